"""Defaults that work (issue 28, item 5): a data run whose YAML names only model.path,
data.train_files and reward.function trains (warm start off, prompt and response lengths from
the data and the model's context, each choice said once in the log, config.yaml recording the
result); a `--set correction.preset=...` replaces the correction fields the config file set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lockstep.trainer.config.load import load_config, save_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.objective.presets import PRESETS

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["decoupled_seq_is", "bypass_pg_is", "decoupled_geo_rs"])
def test_a_preset_from_the_command_line_replaces_the_files_fields(tmp_path, name):
    """configs/toy_r3.yaml sets rollout_is=token and rollout_is_threshold=2.0: the preset on
    the command line wins, and config.yaml records the preset's fields."""
    cfg = load_config(CONFIGS / "toy_r3.yaml", [f"correction.preset={name}"])
    for key, value in PRESETS[name].items():
        assert getattr(cfg.correction, key) == value, key
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["correction"]
    assert "preset" not in saved and {k: saved[k] for k in PRESETS[name]} == PRESETS[name]
    assert load_config(tmp_path / "config.yaml") == cfg
    # within the command line, a field that differs from the preset's is still refused
    with pytest.raises(ExperimentConfigError, match=rf"^correction.preset={name} sets "):
        load_config(CONFIGS / "toy_r3.yaml", [f"correction.preset={name}", _other(name)])


def _other(name: str) -> str:
    """A correction field on the command line that differs from preset `name`'s."""
    level = "sequence" if PRESETS[name]["rollout_is"] == "token" else "token"
    return f"correction.rollout_is={level}"


def test_a_field_from_the_command_line_wins_over_the_files_preset(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text((CONFIGS / "toy_r3.yaml").read_text().replace(
        "correction:\n", "correction:\n  preset: decoupled_seq_is\n  prob_diff_eps: 0.5\n", 1)
        .replace("  rollout_is: token\n", "").replace("  rollout_is_threshold: 2.0\n", ""))
    cfg = load_config(path, ["correction.rollout_is=token"])
    assert cfg.correction.rollout_is == "token" and cfg.correction.prob_diff_eps == 0.5
    assert load_config(path, []).correction.rollout_is == "sequence"
    # a conflict within the file is still refused, naming the file
    path.write_text(path.read_text().replace("  prob_diff_eps: 0.5\n",
                                             "  rollout_is: token\n"))
    with pytest.raises(ExperimentConfigError, match=rf"^{path}: correction.preset="
                                                    r"decoupled_seq_is sets rollout_is="):
        load_config(path, [])


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    pytest.importorskip("transformers")
    from lockstep.launch.example import write_example

    return write_example(tmp_path_factory.mktemp("example"), n_train=16, n_val=4)


def test_a_data_run_with_only_model_data_and_reward_trains(example, tmp_path, capsys):
    """Warm start off, the prompt cap from the data, the response cap from the model's
    context (256 in the example), each said once; config.yaml records them and resumes."""
    from lockstep.launch.cli import main

    path = tmp_path / "minimal.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(example / "policy")},
        "data": {"train_files": [str(example / "train.jsonl")]},
        "reward": {"function": f"{example / 'reward.py'}:compute_score"}}))
    cfg = load_config(path)
    assert not cfg.warmstart.enabled and cfg.data.max_prompt_length is None
    out = tmp_path / "run"
    short = ["loop.steps=2", "loop.plots=false", "loop.tensorboard=false",  # a small batch:
             "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",   # CI's time
             "actor.mini_batch_size=8", "actor.micro_batch_size=8"]
    assert main(["train", str(path), "--out", str(out), "--no-progress",
                 *[a for s in short for a in ("--set", s)]]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("defaults: ")]
    assert [s.split("=")[0] for s in said] == [
        "defaults: warmstart.enabled", "defaults: data.max_prompt_length",
        "defaults: rollout.max_new_tokens"], err
    saved = load_config(out / "config.yaml")
    P, R = saved.data.max_prompt_length, saved.rollout.max_new_tokens
    assert not saved.warmstart.enabled and P is not None and P + R == 256
    assert f"data.max_prompt_length={P}," in said[1] and f"rollout.max_new_tokens={R}," in said[2]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 2
    # the saved config resumes under the same run hash (a longer run continues)
    assert main(["train", "--resume", "--out", str(out), "--no-progress",
                 "--set", "loop.steps=3"]) == 0


def test_a_duplicate_key_in_a_set_mapping_is_refused_as_in_a_file(tmp_path):
    """Issue 28 item 4: `--set 'actor={lr: 1e-3, lr: 2e-3}'` kept the last value silently."""
    with pytest.raises(ExperimentConfigError, match=r"duplicate key 'lr' at line 1, columns 2 "
                                                    r"and 12 \(YAML would silently keep"):
        load_config(CONFIGS / "toy_r3.yaml", ["actor={lr: 1e-3, lr: 2e-3}"])
    path = tmp_path / "flow.yaml"
    path.write_text((CONFIGS / "toy_r3.yaml").read_text() + "replay2: {a: 1, a: 2}\n")
    with pytest.raises(ExperimentConfigError, match=r"duplicate key 'a' at line \d+, columns"):
        load_config(path)


def test_settings_that_would_do_nothing_are_refused_naming_what_makes_them_act(tmp_path):
    """Issue 28 item 4: loss.unbiased_kl without a KL term, mask_stale_turns where no
    trajectory spans a weight push."""
    with pytest.raises(ExperimentConfigError, match=r"loss.unbiased_kl=true has no effect "
                                                    r"with loss.kl_coef=0 .* set loss.kl_coef > 0"):
        load_config(CONFIGS / "toy_r3.yaml", ["loss.unbiased_kl=true"])
    assert load_config(CONFIGS / "toy_r3.yaml", ["loss.unbiased_kl=true",
                                                 "loss.kl_coef=0.1"]).loss.unbiased_kl
    agent = CONFIGS / "toy_agent_r3.yaml"
    with pytest.raises(ExperimentConfigError, match=r"^.*rollout.env.mask_stale_turns=true has "
                                                    r"no effect: .*env.turns_before_push >= 1"):
        load_config(agent, ["rollout.env.mask_stale_turns=true"])
    with pytest.raises(ExperimentConfigError, match="mask_stale_turns=true has no effect"):
        load_config(agent, ["rollout.env.mask_stale_turns=true", "loop.max_staleness=1"])
    assert load_config(agent, ["rollout.env.mask_stale_turns=true", "loop.max_staleness=1",
                               "rollout.env.turns_before_push=1"]).rollout.env.mask_stale_turns
    # OPSM's log-prob source without OPSM, a rejection threshold without rejection sampling
    with pytest.raises(ExperimentConfigError, match=r"loss.opsm_logprobs='old' has no effect "
                                                    r"without loss.opsm_delta"):
        load_config(CONFIGS / "toy_r3.yaml", ["loss.opsm_logprobs=old"])
    assert load_config(CONFIGS / "toy_r3.yaml", ["loss.opsm_logprobs=old",
                                                 "loss.opsm_delta=1e-4"]).loss.opsm_delta == 1e-4
    with pytest.raises(ExperimentConfigError, match=r"rollout_rs_threshold=0.01 has no effect "
                                                    r"without rollout_rs .* set rollout_rs"):
        load_config(CONFIGS / "toy_r3.yaml", ["correction.rollout_rs_threshold=0.01"])
    # an env file with both entry points: the tool would be ignored
    from lockstep.rollout.env import load_env
    from lockstep.rollout.rewards import RewardFunctionError
    both = tmp_path / "both.py"
    both.write_text("def step(state, turn):\n    return {'done': True}\n"
                    "def tool(call):\n    return 'x'\n")
    with pytest.raises(RewardFunctionError, match=r"defines both step\(state, turn\) and "
                                                  r"tool\(call\); step would run and tool never"):
        load_env(str(both))
