"""`lockstep train` from a pretrained HF folder (a tiny DeepSeek-V3: MLA, sigmoid router with
expert bias, group-limited top-k, dense first layer) on a JSONL prompt set with a reward file:
R3 with the KL loss (exactly 0 at the first on-policy update, positive after), validation,
exact resume of the data cursor across an epoch boundary; R2 with a reward that raises and
hangs."""

from __future__ import annotations

import json

import pytest
import yaml

from data_fixtures import build_model_folder, word_problems, write_jsonl
from lockstep.launch.cli import main
from lockstep.trainer.config.load import load_config
from lockstep.trainer.observe.metrics import read_metrics

pytest.importorskip("transformers")

FLAKY_REWARD = '''
import re
import time

calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Raises on every 3rd call of this worker; the 20th call hangs past reward.timeout_s."""
    global calls
    calls += 1
    if calls == 20:
        time.sleep(600)
    if calls % 3 == 0:
        raise ValueError(f"call {calls}: cannot parse")
    return float(solution_str.strip() == str(ground_truth))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    folder, train, val, reward = build_model_folder(root)
    long = word_problems(1, 99)[0]
    long["prompt"][0]["content"] *= 6  # longer than data.max_prompt_length: dropped
    rows = [json.loads(x) for x in train.read_text().splitlines()] + [long]
    write_jsonl(train, rows)
    return root, folder, train, val, reward


def _config(root, folder, train, val, reward_file, mode, **sections) -> str:
    cfg = {
        "model": {"path": str(folder)},
        "data": {"train_files": [str(train)], "val_files": [str(val)], "max_prompt_length": 64},
        "reward": {"function": f"{reward_file}:compute_score", "timeout_s": 5, "num_workers": 1},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 6,
                    "dtype": "fp32"},
        "actor": {"lr": 1e-2, "mini_batch_size": 16, "micro_batch_size": 16},
        "replay": {"mode": mode},
        "warmstart": {"enabled": False},
        "loop": {"steps": 3, "checkpoint_every": 2, "keep_checkpoints": 0, "val_every": 2,
                 "tensorboard": False, "plots": False},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    path = root / f"{mode}_{len(list(root.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _train(*args: str) -> None:
    assert main(["train", *args, "--no-progress"]) == 0


def _same(a: dict, b: dict) -> bool:
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    return strip(a) == strip(b)


@pytest.mark.slow
def test_r3_with_kl_validation_and_exact_resume(setup, tmp_path, capsys):
    root, folder, train, val, reward = setup
    cfg = _config(root, folder, train, val, reward, "R3",
                  loss={"kl_coef": 0.5, "kl_loss_type": "low_var_kl"})
    _train(cfg, "--out", str(tmp_path / "full"))
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [r["step"] for r in full] == [1, 2, 3]
    model = load_config(tmp_path / "full" / "config.yaml").model  # from the folder's config.json
    assert model.model_type == "deepseek_v3" and model.is_mla and model.router == "sigmoid"
    assert "dropped 1 longer than data.max_prompt_length=64" in capsys.readouterr().err
    # the KL term: exactly 0 at the first (on-policy) update, positive once the policy moved
    assert full[0]["actor/kl_loss"] == 0.0
    assert full[1]["actor/kl_loss"] > 0 and full[2]["actor/kl_loss"] > 0
    assert all(r["replay/mismatch"] == 0.0 and r["reward/errors"] == 0.0 for r in full)
    assert 0 < sum(r["reward/mean"] for r in full)  # the reward file's 0.1 for any number
    assert "val/reward_mean" in full[1] and "val/pass@1" in full[1] and "val/arith/reward_mean" in full[1]
    assert "val/reward_mean" not in full[0]
    # killed after step 2, resumed: step 3 (which wraps into epoch 1) is the uninterrupted one
    _train(cfg, "--out", str(tmp_path / "cut"), "--set", "loop.steps=2")
    _train(cfg, "--out", str(tmp_path / "cut"), "--resume")
    cut = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert len(cut) == 3 and all(_same(a, b) for a, b in zip(full, cut))
    ckpt = tmp_path / "cut" / "checkpoints" / "step_3" / "hf"
    assert (ckpt / "chat_template.jinja").exists() or "chat_template" in (
        ckpt / "tokenizer_config.json").read_text()


@pytest.mark.slow
def test_r2_with_a_reward_that_raises_and_hangs(setup, tmp_path):
    root, folder, train, val, _ = setup
    flaky = root / "flaky.py"
    flaky.write_text(FLAKY_REWARD)
    cfg = _config(root, folder, train, val, flaky, "R2",
                  reward={"timeout_s": 2.0, "error_score": -1.0}, loop={"val_every": 0})
    _train(cfg, "--out", str(tmp_path / "r2"))
    rows = read_metrics(tmp_path / "r2" / "metrics.jsonl")
    # one worker, 16 calls a step: raises at its calls 3, 6, ..; its call 20 (step 2) hangs,
    # so it is killed and replaced by one counting from 1 again, whose call 20 is in step 3
    assert [r["reward/errors_raised"] for r in rows] == [5, 5, 4]
    assert [r["reward/errors_timeout"] for r in rows] == [0, 1, 1]
    assert [r["reward/errors"] for r in rows] == [5, 6, 5]
    assert all(r["replay/mode"] == "R2" and r["replay/mismatch"] == 0.0 for r in rows)
