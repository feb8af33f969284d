"""End to end through the command line: warm start (cached), a few GRPO steps, outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.moe.checkpoint import load_hf
from lockstep.moe.tokenizer import load_tokenizer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
REQUIRED = ["step", "reward/mean", "rollout_corr/kl", "rollout_corr/k3_kl",
            "rollout_corr/rollout_is_mean", "routing/flip_rate", "routing/token_any_flip",
            "replay/mode", "time/step_s"] + [f"routing/flip_rate/layer_{i}" for i in range(3)]


def _train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", *args]
    return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_train_cli_end_to_end(tmp_path):
    sets = ["warmstart.target_accuracy=0.02", "warmstart.eval_every=10",
            f"warmstart.cache_dir={tmp_path / 'cache'}", "rollout.prompts_per_step=16",
            "actor.mini_batch_size=128", "actor.micro_batch_size=64", "loop.steps=4",
            "loop.checkpoint_every=2"]
    args = [str(CONFIGS / "toy_r3.yaml"), "--no-progress"] + [a for s in sets for a in ("--set", s)]
    first = _train(*args, "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    assert "warm start:" in first.stderr and "loaded from cache" not in first.stderr
    out = tmp_path / "a"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert not [k for k in REQUIRED if k not in r], r.keys()
        assert r["replay/mode"] == "R3" and r["replay/mismatch"] == 0.0
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["warmstart/accuracy"] >= 0.02
    for png in ("reward.png", "flip_rate.png", "k3_kl.png", "flip_rate_layers.png"):
        assert (out / png).stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4"]
    model = load_hf(out / "checkpoints/step_4/hf")
    assert model.cfg.num_experts == 4
    assert load_tokenizer(out / "checkpoints/step_4/hf").get_vocab_size() == 16

    # the same warm start is reused from the cache by a run that differs in replay mode
    second = _train(*args, "--set", "replay.mode=off", "--set", "loop.steps=1",
                    "--out", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert "loaded from cache" in second.stderr
    # and a run directory is never silently overwritten
    again = _train(*args, "--out", str(out))
    assert again.returncode == 2 and "--resume" in again.stderr


def test_train_cli_rejects_bad_config_with_the_valid_keys(tmp_path):
    res = _train(str(CONFIGS / "toy_r3.yaml"), "--out", str(tmp_path / "x"),
                 "--set", "actor.learnin_rate=1")
    assert res.returncode == 2
    assert "learnin_rate" in res.stderr and "'lr'" in res.stderr
