"""Rollout/train overlap of async rollout: `loop.max_staleness: 1` vs 0 on the toy job, measured
in the same run with the same engines (default: rollout.backend=ray with 2 engine workers;
`--backend serve`: 2 `lockstep serve` servers on Ray, the fleet).

Both runs train the toy (configs/toy_r3.yaml, no warm start) for `--steps` RL steps from the
same seed, their steps interleaved (sync step 1, async step 1, sync step 2, ...) so that the
drifting load of a shared host hits both alike; the first `--warmup` steps are not timed. Printed per run: median step time, the
rollout phase (`time/rollout_s`: the backend's generation call, in the background thread when
async), the time the step waited for its samples (`time/generate_s`, which also holds collate
and rewards), the train phase (`time/old_logprob_s` + `time/update_s`) and the weight push
(`time/sync_s`, which under max_staleness 1 also waits for the generation in flight); then the
ratio step(max_staleness 0) / step(max_staleness 1). The ideal ratio is
(rollout + train) / max(rollout, train).

    OMP_NUM_THREADS=1 python bench/async_overlap.py [--backend ray|serve|embedded] [--engines 2]
        [--steps 8] [--warmup 2] [--set key=value ...]

`measure_overlap(...)` returns the same numbers as a dict (bench/weight_sync.py imports it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"
PHASES = {"step": ("time/step_s",), "rollout": ("time/rollout_s",),
          "wait": ("time/generate_s",), "train": ("time/old_logprob_s", "time/update_s"),
          "sync": ("time/sync_s",)}


def make_trainer(max_staleness: int, backend: str, engines: int, steps: int, out: Path,
                 overrides: list[str]) -> Trainer:
    """A trainer of the toy (no warm start) for `steps` RL steps."""
    cfg = load_config(CONFIG, ["warmstart.enabled=false", f"loop.steps={steps}",
                               "loop.checkpoint_every=0", "loop.tensorboard=false",
                               "loop.plots=false", f"rollout.backend={backend}",
                               f"rollout.num_engines={engines}",
                               f"loop.max_staleness={max_staleness}", *overrides])
    return Trainer(cfg, out, progress=False, log=lambda s: None)


def record_spans(tr: Trainer) -> dict[str, list[tuple[float, float]]]:
    """Wall-clock spans of the trainer's generation calls (in whichever thread runs them) and
    of its training calls (old log-probs, update), recorded by wrapping them."""
    spans: dict[str, list[tuple[float, float]]] = {"rollout": [], "train": []}

    def timed(fn, kind):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[kind].append((t0, time.perf_counter()))
        return wrapped
    tr.rollout.generate = timed(tr.rollout.generate, "rollout")
    tr.actor.old_logprobs = timed(tr.actor.old_logprobs, "train")
    tr.actor.policy_update = timed(tr.actor.policy_update, "train")
    return spans


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time inside some span of `a` and some span of `b` (each list non-overlapping)."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def run_interleaved(trainers: dict[str, Trainer], steps: int) -> dict[str, list[dict]]:
    """Step every trainer once per round, in turn, so slow drift of a shared host's load hits
    both alike. Nothing of one runs during another's step: an async trainer's push waits for
    its generation in flight, and its next generation starts only in its next step."""
    out: dict[str, list[dict]] = {name: [] for name in trainers}
    try:
        for step in range(1, steps + 1):
            for name, tr in trainers.items():
                out[name].append(tr.step(step))
    finally:
        for tr in trainers.values():
            tr.pipeline.close()
            tr.rollout.close()
            tr.actor.close()
    return out


def phase_medians(ms: list[dict]) -> dict[str, float]:
    return {name: statistics.median(sum(m[k] for k in keys) for m in ms)
            for name, keys in PHASES.items()}


def measure_overlap(backend: str = "ray", engines: int = 2, steps: int = 8, warmup: int = 2,
                    overrides: list[str] | None = None) -> dict:
    """{"sync": phase medians at max_staleness 0, "async": at 1, "ratio": step time 0 / 1,
    "hidden": per run, the fraction of generation time that ran while the actor trained,
    "ideal": (rollout + train) / max(rollout, train) of the synchronous run, "lag": mean
    weight-version lag of the async run's timed steps}. With backend=ray a local Ray
    cluster is started for the measurement (unless one is running) and shut down after."""
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}")
    own_ray = False
    if backend in ("ray", "serve"):
        import ray
        if not ray.is_initialized():
            # both runs' engines exist at once (logical CPUs: only one run works at a time)
            ray.init(address="local", num_cpus=2 * engines, include_dashboard=False,
                     log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            own_ray = True
        elif ray.cluster_resources().get("CPU", 0) < 2 * engines:
            raise RuntimeError(f"measure_overlap: the running Ray cluster has "
                               f"{ray.cluster_resources().get('CPU', 0)} CPUs; both runs' "
                               f"engines need {2 * engines} (shut it down, or start it with more)")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainers = {name: make_trainer(k, backend, engines, steps, Path(tmp) / name,
                                           list(overrides or []))
                        for name, k in (("sync", 0), ("async", 1))}
            spans = {name: record_spans(tr) for name, tr in trainers.items()}
            runs = {name: ms[warmup:] for name, ms in run_interleaved(trainers, steps).items()}
    finally:
        if own_ray:
            import ray
            ray.shutdown()
    sync, asyn = phase_medians(runs["sync"]), phase_medians(runs["async"])
    hidden = {name: overlap_seconds(sp["rollout"], sp["train"]) /
              max(1e-9, sum(e - b for b, e in sp["rollout"])) for name, sp in spans.items()}
    return {"sync": sync, "async": asyn, "ratio": sync["step"] / asyn["step"],
            "hidden": hidden,
            "ideal": (sync["rollout"] + sync["train"]) / max(sync["rollout"], sync["train"]),
            "lag": statistics.mean(m["rollout/weight_version_lag_mean"] for m in runs["async"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["ray", "embedded", "serve"], default="ray",
                    help="ray: embedded engines as Ray actors; serve: `lockstep serve` servers "
                         "on Ray (the fleet, weights over the gloo group); embedded: in-process")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for both runs (e.g. rollout.prompts_per_step=16)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    r = measure_overlap(args.backend, args.engines, args.steps, args.warmup, args.set)
    print(f"toy, rollout.backend={args.backend}"
          f"{f' x{args.engines} engines' if args.backend != 'embedded' else ''}, "
          f"{args.steps - args.warmup} timed steps (medians, seconds)")
    print(f"{'max_staleness':>14} {'step':>7} {'rollout':>8} {'wait':>7} {'train':>7} {'sync':>7}")
    for name, k in (("sync", 0), ("async", 1)):
        p = r[name]
        print(f"{k:>14} {p['step']:7.3f} {p['rollout']:8.3f} {p['wait']:7.3f} {p['train']:7.3f} "
              f"{p['sync']:7.3f}")
    print(f"generation time spent while the actor trained: {r['hidden']['sync']:.0%} "
          f"(max_staleness 0), {r['hidden']['async']:.0%} (max_staleness 1)")
    print(f"step time ratio max_staleness 0 / 1: {r['ratio']:.2f}x "
          f"(ideal (rollout + train) / max: {r['ideal']:.2f}x); async mean version lag "
          f"{r['lag']:.2f}")


if __name__ == "__main__":
    main()
