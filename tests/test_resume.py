"""SIGKILL a training process between checkpoints, --resume, and get the uninterrupted metrics."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kill_fixtures import kill_when_written

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Small and fast, but every part of the state matters: the entropy bonus moves the weights and
# the AdamW moments at every step even where the (untrained) policy earns no reward, two
# mini-batches per step exercise the per-step shuffle, and the LR warm-up spans the checkpoint.
OVERRIDES = ["warmstart.enabled=false", "rollout.prompts_per_step=8",
             "rollout.samples_per_prompt=4", "actor.mini_batch_size=16",
             "actor.micro_batch_size=8", "actor.lr=3e-3", "actor.warmup_steps=10",
             "loss.entropy_coef=0.05", "loop.checkpoint_every=3",
             "loop.keep_checkpoints=0", "loop.plots=false", "loop.tensorboard=true"]


def _train(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", "--out", str(out), "--no-progress",
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _fresh(out: Path, steps: int) -> subprocess.Popen:
    sets = [a for o in OVERRIDES + [f"loop.steps={steps}"] for a in ("--set", o)]
    return _train(out, str(CONFIGS / "toy_r3.yaml"), *sets)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    ref = _fresh(tmp_path / "ref", 8)
    out_ref, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out_ref

    # The victim is set to run far longer than 8 steps, so it is still running whenever the
    # (possibly descheduled) test gets to kill it; the resume then stops at step 8. loop.steps
    # is the one setting a resume may change (with a constant LR schedule it changes nothing).
    victim = _fresh(tmp_path / "run", 1000)
    done = tmp_path / "run/checkpoints/step_3/state.json"
    kill_when_written(victim, done, "step 3", poll_s=0.005)
    assert victim.returncode == -signal.SIGKILL
    killed_at = len(_metrics(tmp_path / "run"))
    last = max(int(p.name[5:]) for p in (tmp_path / "run/checkpoints").glob("step_*[0-9]"))
    assert last < 8 and killed_at < 8, (last, killed_at)  # cut short before the end

    resumed = _train(tmp_path / "run", "--resume", "--set", "loop.steps=8")
    out_res, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out_res
    assert "resuming from" in out_res

    got, want = _metrics(tmp_path / "run"), _metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, 9))
    assert got == want
    assert {"step_3", "step_6", "step_8"} <= {p.name for p in (tmp_path / "run/checkpoints").iterdir()}
