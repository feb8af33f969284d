"""Cost of the replay bias meter (trainer/actor/replay_bias.py) as a ratio of RL step time, measured in
one run: a Trainer runs steps with `replay.bias_meter_rows` set to each fraction under test in
turn (interleaved, so all see the same load on a shared machine); the meter's two parts (the
flip rate, and the extra forward of `kl_stats`) are timed inside each step.

    OMP_NUM_THREADS=1 python bench/replay_bias_meter.py                      # toy_r3, 0.125 0.25
    OMP_NUM_THREADS=1 python bench/replay_bias_meter.py --config configs/study_routing.yaml

Prints per fraction the median step time and the median time of the meter's parts, and their
ratio (meter / step).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

from lockstep.trainer.actor import replay_bias
from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer


def timed(fn, log: list):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        log.append(time.perf_counter() - t0)
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/toy_r3.yaml")
    ap.add_argument("--rows", type=float, nargs="+", default=[0.125, 0.25])
    ap.add_argument("--steps", type=int, default=10, help="steps per fraction")
    args = ap.parse_args()
    total = args.steps * len(args.rows)
    cfg = load_config(args.config, overrides=[f"loop.steps={total + 1}", "loop.checkpoint_every=0",
                                              "loop.plots=false", "loop.dump_every=0"])
    flip_s, kl_s = [], []
    replay_bias.flip_stats = timed(replay_bias.flip_stats, flip_s)
    replay_bias.kl_stats = timed(replay_bias.kl_stats, kl_s)
    per = {r: {"step": [], "flip": [], "kl": []} for r in args.rows}
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(cfg, out, progress=False, log=lambda s: None)
        base = tr.actor.replay_options
        tr.step(1)  # warm-up (first-call allocations)
        for i in range(total):
            rows = args.rows[i % len(args.rows)]
            tr.actor.replay_options = dataclasses.replace(base, bias_meter_rows=rows)
            flip_s.clear(), kl_s.clear()
            m = tr.step(i + 2)
            per[rows]["step"].append(m["time/step_s"])
            per[rows]["flip"].append(sum(flip_s))
            per[rows]["kl"].append(sum(kl_s))
        tr.pipeline.close()
        tr.rollout.close()
        tr.actor.close()
    print(f"{args.config}, replay.mode={cfg.replay.mode.value}, {args.steps} steps per fraction:")
    for rows, t in per.items():
        step, flip, kl = (statistics.median(t[k]) for k in ("step", "flip", "kl"))
        print(f"  bias_meter_rows={rows}: step {step:.3f} s; flip rate {flip * 1e3:.1f} ms "
              f"({flip / step:.3f} of a step); extra forward {kl * 1e3:.1f} ms "
              f"({kl / step:.3f} of a step); meter total {(flip + kl) / step:.3f} of a step")


if __name__ == "__main__":
    main()
