"""The 2026 families' experiment configs: `actor.backend=megatron` is refused at config time
naming the family (the toy configs of Qwen3.5-MoE and the DSA families, whose runs are evidence
in docs/model.md, and toy_r3.yaml's model as Qwen3-Next); gpt-oss's toy trains through
megatron-core with the torch actor's metrics; each shipped toy trains two R3 steps with replay
mismatch 0; and the `lockstep plan` configs of gpt-oss-120b (megatron: it fits),
Qwen3.5-35B-A3B and DeepSeek-V3.2 plan (the rollout side fits, the one refusal is the torch
actor's memory: the megatron bridge does not map these two)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.launch.plan import make_plan
from lockstep.moe.model import MoEModel
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
# family -> (config, overrides): the DSA toy, and toy_r3.yaml's model in the other families
QWEN_SHARED = "model.shared_expert_intermediate_size=96"  # their MoE blocks always have one
TOYS = {"qwen3_5_moe_text": ("toy_qwen35_r3.yaml", []),
        "qwen3_next": ("toy_r3.yaml", ["model.model_type=qwen3_next", QWEN_SHARED]),
        "deepseek_v32": ("toy_dsa_r3.yaml", []),
        "glm_moe_dsa": ("toy_dsa_r3.yaml", ["model.model_type=glm_moe_dsa"])}


@pytest.mark.parametrize("family", list(TOYS))
def test_megatron_is_refused_naming_the_family(family):
    name, sets = TOYS[family]
    cfg = load_config(CONFIGS / name, sets)
    assert cfg.model.model_type == family and cfg.replay.mode.value == "R3"
    assert cfg.replay.indexer == ("r3" if cfg.model.is_dsa else "off")
    MoEModel(cfg.model)  # the family builds at the toy's shape
    with pytest.raises(ExperimentConfigError, match=rf"model_type='{family}'.*{family} is not "
                                                    r"mapped: "):
        load_config(CONFIGS / name, [*sets, "actor.backend=megatron"])


SHORT = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=16", "actor.micro_batch_size=16", "loss.entropy_coef=0.05",
         "loop.steps=2", "loop.plots=false", "loop.tensorboard=false"]


def _two_steps(name: str, run, *sets: str) -> list[dict]:
    from lockstep.trainer.loop import Trainer
    cfg = load_config(CONFIGS / f"{name}.yaml", [*SHORT, *sets])
    with Trainer(cfg, run, progress=False, log=lambda s: None) as tr:
        return [tr.step(step) for step in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["toy_gpt_oss_r3", "toy_qwen35_r3", "toy_dsa_r3"])
def test_the_family_toys_train_with_the_engines_routes(name, tmp_path):
    """Two R3 steps of each shipped family toy (no warm start, 4 prompts x 4 samples): the
    actor replays exactly the bf16 engine's routes (replay mismatch 0 on the tokens that have
    one; the last sampled token never ran through the model) and the update is finite."""
    import math

    rows = _two_steps(name, tmp_path / "run")
    for m in rows:
        assert m["replay/mode"] == "R3" and m["replay/mismatch"] == 0.0, m
        assert m["replay/replayed_fraction"] > 0.5 and m["routing/num_tokens"] > 0, m
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, m


@pytest.mark.slow
@pytest.mark.megatron
def test_gpt_oss_trains_through_megatron_as_through_torch(tmp_path):
    """toy_gpt_oss_r3 with actor.backend=megatron (sinks, 4-key windows, clamped SwiGLU,
    biases, R3 through RouterReplay): two steps give the torch actor's metrics: the same
    samples (the rollout sees the same weights), old log-probs, losses and grad norms."""
    pytest.importorskip("megatron.core")
    mg = _two_steps("toy_gpt_oss_r3", tmp_path / "mg", "actor.backend=megatron")
    ref = _two_steps("toy_gpt_oss_r3", tmp_path / "torch")
    for a, b in zip(mg, ref):
        assert a["replay/mismatch"] == 0.0 and a["reward/mean"] == b["reward/mean"]
        for k in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "rollout_corr/k3_kl",
                  "actor/ppo_kl"):
            assert abs(a[k] - b[k]) <= 1e-4 * abs(b[k]) + 1e-6, (a["step"], k, a[k], b[k])
    assert mg[1]["actor/grad_norm"] > 0


# config -> (model_type, published size in billions, servers, indexer replay)
PLANS = {"gpt_oss_120b": ("gpt_oss", 116.8, 2, False),  # megatron: no refusal
         "qwen35_35b_a3b": ("qwen3_5_moe_text", 34.7, 4, False),
         "deepseek_v32": ("deepseek_v32", 683.5, 2, True)}


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # model.path is relative to the repository


@pytest.mark.parametrize("name", list(PLANS))
def test_the_family_plans(name, in_root):
    family, size, servers, indexer = PLANS[name]
    path = CONFIGS / f"cluster_{name}.yaml"
    cfg = load_config(path)
    p = make_plan(cfg)
    assert p["model"]["model_type"] == family
    assert abs(p["model"]["params"] / 1e9 - size) < 0.1
    assert len(p["placement"]["engines"]) == servers == cfg.rollout.num_engines
    argv = p["placement"]["engines"][0]["command"]["argv"]
    assert ("--enable-return-indexer-topk" in argv) == indexer  # replay.indexer=r3 needs it
    if cfg.actor.backend == "megatron":  # gpt-oss: EP 8 x PP 4 fits, its switches printed
        assert p["refusals"] == []
        args = p["actor"]["megatron_args"]
        assert args["softmax_type"] == "learnable" and tuple(args["window_size"]) == (127, 0)
        assert args["yarn_correction_range_round_to_int"] is False
        return
    # the rollout side fits; the torch actor (a whole replica per rank) does not
    assert len(p["refusals"]) == 1 and p["refusals"][0].startswith("actor rank: estimated peak")
    with pytest.raises(ExperimentConfigError, match=f"{family} is not mapped"):
        load_config(path, ["actor.backend=megatron"])
