"""Cost of the replay validator (`replay.check`): the actor's part of an RL step (pi_old forward
+ the update's forwards and backwards, R3) with the check off, `sample` and `full`, on the same
batch of engine rollouts, the three settings alternating within each repeat (median of CPU
thread time, which drops waits for a core on a busy host; wall time also printed). Prints each
setting's ratio to `off`, and the overhead as a share of the whole RL step measured by the
same trainer (generation included). On a busy host those differences drown in noise, so the
validator's own work (making each forward's `RouteCheck`, the routers' reports, `finish`) is
also timed directly, as a share of the actor step and of the RL step. `replay.check` defaults
to `sample` only while that share is below 1% of a step.

    OMP_NUM_THREADS=1 python bench/replay_check.py
    OMP_NUM_THREADS=1 python bench/replay_check.py --config configs/study_routing.yaml --repeats 9
    OMP_NUM_THREADS=1 python bench/replay_check.py --set actor.backend=megatron   # megatron-core
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import lockstep.moe.replay_check as replay_check
from lockstep.moe.replay_check import ReplayCheck
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.replay import ReplayMode
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.config.load import load_config
from lockstep.trainer.objective.correction import correct
from lockstep.trainer.objective.losses import grpo_advantages
from lockstep.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parent.parent


def actor_step(tr: Trainer, batch, step: int) -> None:
    """pi_old forward + policy update of `batch` under R3 (what the validator watches)."""
    old = tr.actor.old_logprobs(batch, ReplayMode.R3, step)
    group = torch.arange(batch.size) // tr.cfg.rollout.samples_per_prompt
    mask = batch.response_mask_BT.float()
    rewards = torch.randn(batch.size)
    adv = grpo_advantages(rewards, group, mask)
    corr = correct(tr.cfg.correction, old.logprobs_BT, batch.rollout_logprobs_BT, mask)
    tr.actor.policy_update(batch, tr.update_inputs(batch, old, adv, corr, step), ReplayMode.R3,
                           step)


class OwnTime:
    """CPU thread time spent inside the validator's own calls (patched around them)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, owner, name: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kw):
            t0 = time.thread_time()
            try:
                return real(*args, **kw)
            finally:
                self.seconds += time.thread_time() - t0
        setattr(owner, name, timed)


def set_check(actor, mode: ReplayCheck) -> None:
    """The validator's setting on either actor (the megatron actor keeps it per replay
    adapter); the overlap floor off: the one batch is replayed after updates moved the weights
    (routes of an older step, by design), so only its raise is skipped, not its work."""
    if hasattr(actor, "replays"):  # MegatronActor: its RouteReplay adapters
        for r in actor.replays:
            r.check, r.min_overlap = mode, 0.0
    else:
        actor.replay_check, actor.min_overlap = mode, 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "toy_r3.yaml"))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config, ["warmstart.enabled=false", "loop.tensorboard=false",
                                 "loop.plots=false", "replay.mode=R3", *a.overrides])
    own = OwnTime()
    from lockstep.trainer.actor.megatron.replay import RouteReplay  # no megatron-core import
    for owner, name in ((TorchActor, "_route_check"), (RouteReplay, "_route_check"),
                        (replay_check.RouteCheck, "ran"), (replay_check.RouteCheck, "finish")):
        own.wrap(owner, name)
    own_s: dict[ReplayCheck, list[float]] = {m: [] for m in ReplayCheck}
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, Path(tmp) / "run", progress=False, log=lambda s: None)
        try:
            prompts = tr.source.prompts(0, cfg.rollout.prompts_per_step)
            batch = collate(tr.rollout.generate(tr.requests(prompts, 1)), tr.source.pad_id,
                            *tr._route_shape())
            modes = list(ReplayCheck)
            cpu: dict[ReplayCheck, list[float]] = {m: [] for m in modes}
            wall: dict[ReplayCheck, list[float]] = {m: [] for m in modes}
            step = 0
            for r in range(a.repeats + 1):  # the first round warms up
                for m in (modes if r % 2 else modes[::-1]):
                    set_check(tr.actor, m)
                    step += 1
                    own.seconds = 0.0
                    t0, c0 = time.perf_counter(), time.thread_time()
                    actor_step(tr, batch, step)
                    if r:
                        cpu[m].append(time.thread_time() - c0)
                        wall[m].append(time.perf_counter() - t0)
                        own_s[m].append(own.seconds)
            set_check(tr.actor, ReplayCheck.OFF)
            steps = []
            for s in range(1, 4):  # whole RL steps (generation + actor + sync), check off
                c0 = time.thread_time()
                tr.step(s)
                steps.append(time.thread_time() - c0)
        finally:
            tr.pipeline.close()
            tr.rollout.close()
            tr.actor.close()
    med = {m: statistics.median(cpu[m]) for m in modes}
    rl_step = statistics.median(steps)
    print(f"config {a.config} ({cfg.actor.backend} actor): {batch.size} rows x {batch.input_ids_BT.shape[1]} tokens, "
          f"{cfg.model.num_moe_layers} MoE layers, {a.repeats} repeats (CPU thread time)")
    print(f"{'check':8s} {'actor step s':>12s} {'wall s':>8s} {'x off':>7s} {'of RL step':>10s}"
          f" {'own s':>8s} {'own/actor':>9s} {'own/RL step':>11s}")
    for m in modes:
        o = statistics.median(own_s[m])
        print(f"{m.value:8s} {med[m]:12.4f} {statistics.median(wall[m]):8.4f} "
              f"{med[m] / med[ReplayCheck.OFF]:7.4f} "
              f"{(med[m] - med[ReplayCheck.OFF]) / rl_step:+10.2%} {o:8.5f} "
              f"{o / med[ReplayCheck.OFF]:9.2%} {o / rl_step:11.2%}")
    print(f"whole RL step (check off, median of 3): {rl_step:.4f} s CPU")


if __name__ == "__main__":
    main()
