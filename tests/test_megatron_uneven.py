"""Uneven pipeline stages end to end: the README's toy (3 decoder layers) on 2 pipeline stages
through `lockstep train configs/toy_r3.yaml --set cluster.actor_ranks=2 --set
actor.backend=megatron --set actor.megatron.pipeline_parallel=2` (stages of 2 and 1 layers,
`layout.stage_layer_counts`). Its 2 RL steps equal the one-process megatron run's within
docs/cluster.md's tolerances, with R3 routes replayed on every layer of both stages
(`replay/mismatch` 0: the routes each stage's routers ran, put back at their layers, equal
the rollout's); its checkpoint after step 2 resumes in one process (another layout) and gives
the uninterrupted run's step 3."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from lockstep.trainer.state.checkpoint import load_tree  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

from test_group_checkpoint import TOLERANCE  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=4",
         "rollout.samples_per_prompt=4", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
         "actor.aux_loss_coef=0.01",
         "loss.entropy_coef=0.05",  # no warm start: keeps a gradient if all rewards are 0
         "actor.backend=megatron", "loop.plots=false", "loop.tensorboard=false"]
PP2 = ["cluster.actor_ranks=2", "actor.backend=megatron", "actor.megatron.pipeline_parallel=2"]


def _trainer(out: Path, *sets: str, resume: bool = False) -> Trainer:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [*SMALL, *sets])
    return Trainer(cfg, out, resume=resume, progress=False, log=lambda s: None)


def test_toy_on_two_uneven_stages_matches_one_process(tmp_path):
    run = tmp_path / "pp2"
    sets = [*SMALL, "loop.steps=2", "loop.checkpoint_every=2", *PP2]
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", str(CONFIGS / "toy_r3.yaml"),
           "--out", str(run), "--no-progress", *[a for s in sets for a in ("--set", s)]]
    group = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    one = _trainer(tmp_path / "one", "loop.steps=3")  # meanwhile, the one-process run
    try:
        want = [one.step(s) for s in (1, 2, 3)]
    finally:
        text, _ = group.communicate(timeout=900)
    assert group.returncode == 0, text[-3000:]
    got = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2]
    layout = load_tree(run / "checkpoints/step_2/trainer_state")["actor"]["layout"]
    assert layout["pipeline_parallel"] == 2 and layout["pipeline_layers"] == [2, 1], layout

    def close(a: dict, b: dict, where: str) -> None:
        assert b["replay/mismatch"] == 0.0 and b["replay/replayed_fraction"] > 0.9, where
        assert b["routing/num_tokens"] == a["routing/num_tokens"], where
        tol = {**TOLERANCE, "actor/aux_loss": (1e-3, 0.0)}
        print(where, {k: f"{abs(a[k] - b[k]) / max(abs(a[k]), 1e-12):.1e}" for k in tol})
        for k, (rtol, atol) in tol.items():
            assert abs(a[k] - b[k]) <= rtol * abs(a[k]) + atol, (where, k, a[k], b[k])
    for s in (0, 1):
        close(want[s], got[s], f"PP=2 step {s + 1}")

    # the PP=2 checkpoint (HF-named parts) resumes in one process: step 3 as uninterrupted
    out = tmp_path / "resumed"
    shutil.copytree(run, out)
    b = _trainer(out, "loop.steps=3", resume=True)
    assert b.state.step == 2
    close(want[2], b.step(3), "resumed in one process, step 3")
