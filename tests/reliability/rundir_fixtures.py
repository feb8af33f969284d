"""Shared bits of the run-directory / checkpoint reliability tests: a small fast experiment."""

import json
import os
import subprocess
import sys
from pathlib import Path

from lockstep.trainer.config.load import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOY = CONFIGS / "toy_r3.yaml"
# A few seconds per RL step on a busy 2-core box; every part of the trainer state matters.
FAST = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "actor.mini_batch_size=8",
        "actor.micro_batch_size=8", "actor.lr=3e-3", "loss.entropy_coef=0.05",
        "loop.plots=false", "loop.tensorboard=false", "loop.checkpoint_every=1",
        "loop.keep_checkpoints=0"]
COLD = ["warmstart.enabled=false"]


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def fast_config(*overrides: str):
    return load_config(TOY, [*FAST, *overrides])


def lockstep(*args: str, timeout: float = 300, env: dict | None = None,
             cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh process; stdin closed, stderr not a terminal."""
    return subprocess.run([sys.executable, "-m", "lockstep.launch.cli", *args],
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=cwd)


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def one_line_error(res: subprocess.CompletedProcess, cmd: str = "train") -> str:
    """The user-error contract: exit 2, one stderr line `lockstep <cmd>: ...`, no traceback."""
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith(f"lockstep {cmd}: "), err
    return last
