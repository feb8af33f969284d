"""Train/infer mismatch under FP8: k3 KL and routing flip rate for three precision choices,
over seeds, on the toy and on the routing study config (docs/evidence.md "FP8").

    OMP_NUM_THREADS=1 python bench/fp8_mismatch.py --out runs/fp8 --seeds 0 1 --steps 30

    bf16       rollout.dtype=bf16, actor fp32            (the configs' default)
    fp8-rollout  rollout.dtype=fp8, actor fp32          ("FP8 rollout + fp32 train")
    fp8-unified  rollout.dtype=fp8, actor.fp8=true      ("unified FP8")

Each cell is one `lockstep train` run (skipped when its summary.json exists). Per run: the mean
over steps of rollout_corr/k3_kl and routing/flip_rate ((token, layer) pairs whose top-k set
differs between engine and actor; under R3 the actor replays the engine's routes, so this is
the natural-routing divergence, the replay's input) and the step time; per config the ratios
against the bf16 run of the same seed, measured in the same study. OUT/fp8.md holds the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPS = {
    "bf16": ["rollout.dtype=bf16"],
    "fp8-rollout": ["rollout.dtype=fp8"],
    "fp8-unified": ["rollout.dtype=fp8", "actor.fp8=true"],
}
CONFIGS = {"toy": ROOT / "configs/toy_r3.yaml", "study": ROOT / "configs/study_routing.yaml"}


def train(out: Path, config: str, setup: str, seed: int, steps: int) -> Path:
    d = out / f"{config}_{setup}_s{seed}"
    if (d / "summary.json").exists():
        return d
    if d.exists():  # a killed run: start it again
        subprocess.run(["rm", "-rf", str(d)], check=True)
    sets = [f"loop.seed={seed}", f"loop.steps={steps}", "loop.checkpoint_every=0",
            "loop.keep_checkpoints=1", "loop.plots=false", *SETUPS[setup]]
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", str(CONFIGS[config]),
           "--out", str(d), "--no-progress"] + [a for s in sets for a in ("--set", s)]
    with open(out / f"{d.name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    print(f"{d.name}: {'done' if rc == 0 else f'FAILED rc={rc} (see {d.name}.log)'}", flush=True)
    return d


def summarize(d: Path, steps: int) -> dict | None:
    """Means over the run's first `steps` steps (None until it has them: a run still going,
    or killed after them, counts once it has)."""
    path = d / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] <= steps]
    if len(rows) < steps:
        return None
    mean = lambda k: statistics.fmean(r[k] for r in rows)  # noqa: E731
    return {"k3": mean("rollout_corr/k3_kl"), "flip": mean("routing/flip_rate"),
            "tok_flip": mean("routing/token_any_flip"), "step_s": mean("time/step_s"),
            "reward": mean("reward/mean")}


def report(out: Path, configs: list[str], seeds: list[int], steps: int) -> str:
    lines = ["| config | setup | seed | k3 KL | x bf16 | flip rate | x bf16 | tokens with a flip "
             "| reward | step s | x bf16 |", "|---" * 11 + "|"]
    for c in configs:
        for seed in seeds:
            base = summarize(out / f"{c}_bf16_s{seed}", steps)
            for setup in SETUPS:
                s = summarize(out / f"{c}_{setup}_s{seed}", steps)
                if s is None:
                    lines.append(f"| {c} | {setup} | {seed} | (missing) |||||||")
                    continue
                r = (lambda k: f"{s[k] / base[k]:.2f}" if base and base[k] else "-")
                lines.append(f"| {c} | {setup} | {seed} | {s['k3']:.2e} | {r('k3')} | "
                             f"{s['flip']:.4f} | {r('flip')} | {s['tok_flip']:.3f} | "
                             f"{s['reward']:.3f} | {s['step_s']:.2f} | {r('step_s')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--report-steps", type=int, default=None,
                   help="average the first N steps of each run (default --steps): runs of "
                        "different lengths compare on their common steps")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.report_only:
        cells = [(c, s, seed) for c in a.configs for seed in a.seeds for s in SETUPS]
        with ThreadPoolExecutor(a.jobs) as pool:
            list(pool.map(lambda cell: train(a.out, *cell, a.steps), cells))
    table = report(a.out, a.configs, a.seeds, a.report_steps or a.steps)
    (a.out / "fp8.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
