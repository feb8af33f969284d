"""The replay study: off / R2 / R3 x no correction / token TIS / IcePop over seeds, on a config
where routing divergence dominates the train/infer mismatch (configs/study_routing.yaml).

    OMP_NUM_THREADS=1 python bench/replay_study.py --out runs/study --seeds 0 1 --steps 25
    python bench/replay_study.py --out runs/study --report-only     # tables + plots again

Each cell is one `lockstep train` run (skipped when its summary.json exists, so a killed study
continues). Prints and writes OUT/study.md: per run the mean and median k3 KL, flip rates, the
reward of the first and last steps and whether it degraded; per seed and correction the k3 KL
ratio off / R3 (the baseline of the ratio is the off run of the same seed and correction, from
the same study); plots OUT/study_reward.png and OUT/study_k3.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "R2", "R3")
CORRECTIONS = {  # name -> overrides
    "none": ["correction.rollout_is=null"],
    "tis": ["correction.rollout_is=token", "correction.rollout_is_threshold=2.0"],
    "icepop": ["correction.rollout_is=token", "correction.rollout_is_threshold=0.5_2.0"],
}
WINDOW = 5  # steps averaged for "first" / "last" reward


def run_name(mode: str, corr: str, seed: int) -> str:
    return f"{mode}_{corr}_s{seed}"


def train(config: Path, out: Path, mode: str, corr: str, seed: int, steps: int,
          extra: list[str]) -> Path:
    d = out / run_name(mode, corr, seed)
    if (d / "summary.json").exists():
        return d
    if d.exists():  # a killed run: start it again
        subprocess.run(["rm", "-rf", str(d)], check=True)
    sets = [f"replay.mode={mode}", f"loop.seed={seed}", f"loop.steps={steps}",
            "loop.checkpoint_every=0", "loop.keep_checkpoints=1", *CORRECTIONS[corr], *extra]
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", str(config), "--out", str(d),
           "--no-progress"] + [a for s in sets for a in ("--set", s)]
    with open(out / f"{d.name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    print(f"{d.name}: {'done' if rc == 0 else f'FAILED rc={rc} (see {d.name}.log)'}", flush=True)
    return d


def summarize_run(d: Path) -> dict | None:
    path = d / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return None

    def col(k):
        return [r[k] for r in rows if r.get(k) is not None and math.isfinite(r[k])]

    k3 = col("rollout_corr/k3_kl")
    reward = col("reward/mean")
    first = statistics.mean(reward[:WINDOW])
    last = statistics.mean(reward[-WINDOW:])
    skipped = sum(r.get("actor/skipped_step", 0) for r in rows)
    nan_steps = len(rows) - len(k3)
    return {"steps": len(rows), "k3_mean": statistics.mean(k3), "k3_median": statistics.median(k3),
            "flip_rate": statistics.mean(col("routing/flip_rate")),
            "token_any_flip": statistics.mean(col("routing/token_any_flip")),
            "reward_first": first, "reward_last": last, "reward_curve": reward,
            "k3_curve": k3, "skipped_steps": skipped,
            "degraded": bool(last < first - 0.1 or skipped or nan_steps)}


def report(out: Path, seeds: list[int]) -> str:
    runs = {}
    for mode in MODES:
        for corr in CORRECTIONS:
            for s in seeds:
                r = summarize_run(out / run_name(mode, corr, s))
                if r is not None:
                    runs[(mode, corr, s)] = r
    lines = ["| replay | correction | seed | steps | k3 KL mean | k3 KL median | flip rate | "
             "tokens >= 1 flip | reward first | reward last | degraded |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, corr, s), r in runs.items():
        lines.append(f"| {mode} | {corr} | {s} | {r['steps']} | {r['k3_mean']:.3e} | "
                     f"{r['k3_median']:.3e} | {r['flip_rate']:.4f} | {r['token_any_flip']:.3f} | "
                     f"{r['reward_first']:.3f} | {r['reward_last']:.3f} | "
                     f"{'YES' if r['degraded'] else 'no'} |")
    lines += ["", "k3 KL ratio off / R3 and off / R2 (same seed and correction; mean and "
              "median over steps):", "",
              "| correction | seed | off/R3 mean | off/R3 median | off/R2 mean | off/R2 median |",
              "|---|---|---|---|---|---|"]
    ratios = []
    for corr in CORRECTIONS:
        for s in seeds:
            off, r3, r2 = (runs.get((m, corr, s)) for m in ("off", "R3", "R2"))
            if off is None or r3 is None:
                continue
            q = (off["k3_mean"] / r3["k3_mean"], off["k3_median"] / r3["k3_median"])
            q2 = ((off["k3_mean"] / r2["k3_mean"], off["k3_median"] / r2["k3_median"])
                  if r2 else (math.nan, math.nan))
            ratios.append(q)
            lines.append(f"| {corr} | {s} | {q[0]:.2f} | {q[1]:.2f} | {q2[0]:.2f} | {q2[1]:.2f} |")
    if ratios:
        lines += ["", f"off / R3 k3 KL over {len(ratios)} (seed, correction) pairs: mean ratio "
                  f"{statistics.mean(r[0] for r in ratios):.2f} (min "
                  f"{min(r[0] for r in ratios):.2f}, max {max(r[0] for r in ratios):.2f}); "
                  f"median-k3 ratio {statistics.mean(r[1] for r in ratios):.2f}"]
    text = "\n".join(lines)
    (out / "study.md").write_text(text + "\n")
    (out / "study.json").write_text(json.dumps(
        {f"{m}_{c}_s{s}": {k: v for k, v in r.items()} for (m, c, s), r in runs.items()},
        indent=1) + "\n")
    plots(out, runs)
    return text


def plots(out: Path, runs: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, name, ylabel, log in (("reward_curve", "study_reward.png", "reward/mean", False),
                                   ("k3_curve", "study_k3.png", "rollout_corr/k3_kl", True)):
        corrs = [c for c in CORRECTIONS if any(k[1] == c for k in runs)]
        fig, axes = plt.subplots(1, len(corrs), figsize=(5 * len(corrs), 3.6), sharey=True,
                                 squeeze=False)
        axes = axes[0]
        for ax, corr in zip(axes, corrs):
            for i, mode in enumerate(MODES):
                for (m, c, s), r in runs.items():
                    if m == mode and c == corr:
                        ax.plot(range(1, len(r[key]) + 1), r[key], color=f"C{i}", alpha=0.8,
                                label=mode if s == min(x[2] for x in runs) else None)
            ax.set_title(f"correction: {corr}")
            ax.set_xlabel("step")
            if log:
                ax.set_yscale("log")
            ax.legend()
        axes[0].set_ylabel(ylabel)
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "study_routing.yaml"))
    p.add_argument("--out", default="runs/study")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--jobs", type=int, default=1, help="runs at once (one core each)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    p.add_argument("--set", dest="extra", action="append", default=[],
                   help="extra config override for every run")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        # seed-major, so the first seed's full table exists early; one run per seed first,
        # so each seed's warm start is trained once and the other runs load it from the cache
        cells = [(m, c, s) for s in args.seeds for c in args.corrections for m in args.modes]
        first = [next(x for x in cells if x[2] == s) for s in args.seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            for batch in (first, [x for x in cells if x not in first]):
                list(pool.map(lambda x: train(Path(args.config), out, *x, args.steps,
                                              args.extra), batch))
    print(report(out, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
