"""The replay study: replay variant (off / R2 / R3 / R3 + engine gates / R3 partial replay) x
correction (none / token TIS / IcePop) x LR schedule (constant / triggered decay) over seeds.

    OMP_NUM_THREADS=1 python bench/replay_study.py --out runs/study --seeds 0 1 --steps 25
    python bench/replay_study.py --out runs/study --report-only     # tables + plots again
    # a named regime (config + overrides, REGIMES below) under OUT/<regime>/:
    OMP_NUM_THREADS=1 python bench/replay_study.py --out runs/regimes --regime toy_lr1e-3 \\
        --modes off --corrections none --seeds 0 --steps 150
    python bench/replay_study.py --out runs/regimes --regime-table  # every regime under OUT

Each cell is one `lockstep train` run (skipped when its summary.json exists, so a killed study
continues); its exact command is written to OUT/<cell>.cmd and listed in OUT/study.md. A
replay variant or LR schedule whose options this checkout does not have is refused up front,
naming it. Prints and writes OUT/study.md: per run the k3 KL, flip rates, the reward of the
first steps, its peak (trailing mean over up to 5 steps, from step 1) and its last 5 steps, the largest grad norm, the
LR triggers, and whether it degraded (the last 5-step mean below half the peak and >= 0.05
under it, or a skipped / NaN step); per seed and correction the k3 KL
ratio off / R3 (both from the same study); plots OUT/study_reward.png and OUT/study_k3.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPLAYS = {  # name -> overrides
    "off": ["replay.mode=off"],
    "R2": ["replay.mode=R2"],
    "R3": ["replay.mode=R3"],
    "R3_gates": ["replay.mode=R3", "replay.gates=engine"],
    # replay a (token, layer) route only where the actor's router margin is below 0.05
    "R3_partial": ["replay.mode=R3", "replay.partial.rule=margin", "replay.partial.threshold=0.05"],
}
MODES = tuple(REPLAYS)
CORRECTIONS = {  # name -> overrides
    "none": ["correction.rollout_is=null"],
    "tis": ["correction.rollout_is=token", "correction.rollout_is_threshold=2.0"],
    "icepop": ["correction.rollout_is=token", "correction.rollout_is_threshold=0.5_2.0"],
}
# the triggered decay of the study: cut the LR in half when the k3 KL of a step passes 3e-3
# (the toy's later steps sit at ~5e-4..1e-3; its first, from the warm start, at ~6e-3 with
# replay off) or the mean length grows > 3%/step over 10 steps
TRIGGERED = ["actor.lr_schedule=triggered", "actor.lr_trigger.k3_kl=3e-3",
             "actor.lr_trigger.length_growth=0.03", "actor.lr_trigger.length_window=10",
             "actor.lr_trigger.cooldown=10", "actor.lr_trigger.min_scale=0.05"]
SCHEDULES = {"const": [], "trig": TRIGGERED}  # name -> overrides
# regimes of the search for one where plain GRPO degrades (docs/evidence.md): config + overrides
TOY = "configs/toy_r3.yaml"
REGIMES = {
    "toy": (TOY, []),
    "toy_lr1e-3": (TOY, ["actor.lr=1e-3"]),
    "toy_lr1e-3_fp32engine": (TOY, ["actor.lr=1e-3", "rollout.dtype=fp32"]),
    "toy_lr2e-3": (TOY, ["actor.lr=2e-3"]),
    "toy_lr2e-3_fp32engine": (TOY, ["actor.lr=2e-3", "rollout.dtype=fp32"]),
    "toy_lr3e-3": (TOY, ["actor.lr=3e-3"]),
    "toy_lr3e-3_fp32engine": (TOY, ["actor.lr=3e-3", "rollout.dtype=fp32"]),
    "toy_lr1e-2": (TOY, ["actor.lr=1e-2"]),
    "toy_fp8engine": (TOY, ["rollout.dtype=fp8"]),
    "toy_fp8engine_lr1e-3": (TOY, ["rollout.dtype=fp8", "actor.lr=1e-3"]),
    "toy_lr3e-3_small": (TOY, ["actor.lr=3e-3", "rollout.prompts_per_step=8",
                               "actor.mini_batch_size=16", "actor.micro_batch_size=16"]),
    "toy_top1_lr3e-3": (TOY, ["actor.lr=3e-3", "model.num_experts=8",
                              "model.num_experts_per_tok=1"]),
    "toy_top1": (TOY, ["model.num_experts=8", "model.num_experts_per_tok=1"]),
    "toy_top1_fp32engine": (TOY, ["model.num_experts=8", "model.num_experts_per_tok=1",
                                  "rollout.dtype=fp32"]),
}
WINDOW = 5    # steps averaged for "first" reward
SMOOTH = 5    # steps of the trailing mean whose peak and last value say whether reward fell
# degraded: the last trailing mean is below FALL x its peak and at least DROP below it (reward)
FALL, DROP = 0.5, 0.05


def run_name(mode: str, corr: str, seed: int, sched: str = "const") -> str:
    return f"{mode}_{corr}_s{seed}" if sched == "const" else f"{mode}_{corr}_{sched}_s{seed}"


def cell_command(config: Path, d: Path, mode: str, corr: str, seed: int, steps: int,
                 extra: list[str], sched: str = "const") -> list[str]:
    """The `lockstep train` command of one cell (run directory `d`)."""
    sets = [*REPLAYS[mode], f"loop.seed={seed}", f"loop.steps={steps}",
            "loop.checkpoint_every=0", "loop.keep_checkpoints=1", *CORRECTIONS[corr],
            *SCHEDULES[sched], *extra]
    return [sys.executable, "-m", "lockstep.launch.cli", "train", str(config), "--out", str(d),
            "--no-progress"] + [a for s in sets for a in ("--set", s)]


def check_cells(config: Path, modes, scheds, extra: list[str]) -> None:
    """Refuse up front a replay variant or schedule whose options this checkout lacks."""
    from lockstep.trainer.config.load import load_config
    from lockstep.trainer.config.types import ExperimentConfigError
    for mode in modes:
        for sched in scheds:
            try:
                load_config(config, [*REPLAYS[mode], *SCHEDULES[sched], *extra])
            except ExperimentConfigError as e:
                raise SystemExit(f"replay variant {mode!r} / schedule {sched!r} is not "
                                 f"available on this checkout: {e}") from None


def train(config: Path, out: Path, mode: str, corr: str, seed: int, steps: int,
          extra: list[str], sched: str = "const") -> Path:
    d = out / run_name(mode, corr, seed, sched)
    if (d / "summary.json").exists():
        return d
    if d.exists():  # a killed run: start it again
        subprocess.run(["rm", "-rf", str(d)], check=True)
    cmd = cell_command(config, d, mode, corr, seed, steps, extra, sched)
    (out / f"{d.name}.cmd").write_text(
        "OMP_NUM_THREADS=1 " + shlex.join(["python", *cmd[1:]]) + "\n")
    with open(out / f"{d.name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    print(f"{d.name}: {'done' if rc == 0 else f'FAILED rc={rc} (see {d.name}.log)'}", flush=True)
    return d


def _trailing_mean(xs: list[float], n: int) -> list[float]:
    """For plots: entry i is the mean of steps max(1, i - n + 2)..i + 1 (starts at step 1)."""
    return [statistics.mean(xs[max(0, i + 1 - n):i + 1]) for i in range(len(xs))]


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
    smooth = _trailing_mean(reward, SMOOTH)  # from step 1: a collapse right after it counts
    peak = max(smooth)
    grad = col("actor/grad_norm")
    skipped = sum(r.get("actor/skipped_step", 0) for r in rows)
    nan_steps = len(rows) - len(k3)
    triggers = [r["step"] for r in rows
                if any(v for k, v in r.items() if k.startswith("lr_trigger/fired/"))]
    return {"steps": len(rows), "k3_mean": statistics.mean(k3), "k3_median": statistics.median(k3),
            "k3_max": max(k3), "flip_rate": statistics.mean(col("routing/flip_rate")),
            "token_any_flip": statistics.mean(col("routing/token_any_flip")),
            "reward_first": statistics.mean(reward[:WINDOW]), "reward_peak": peak,
            "peak_step": smooth.index(peak) + 1,  # the last step of its window
            "reward_last": smooth[-1],
            "grad_norm_max": max(grad), "triggers": triggers,
            "lr_scale_last": rows[-1].get("lr_trigger/scale", 1.0),
            "reward_curve": reward, "k3_curve": k3, "skipped_steps": skipped,
            "degraded": bool((smooth[-1] < FALL * peak and smooth[-1] < peak - DROP)
                             or skipped or nan_steps)}


def collect(out: Path, seeds: list[int], modes=MODES, corrections=tuple(CORRECTIONS),
            scheds=tuple(SCHEDULES)) -> dict:
    runs = {}
    for mode in modes:
        for corr in corrections:
            for sched in scheds:
                for s in seeds:
                    r = summarize_run(out / run_name(mode, corr, s, sched))
                    if r is not None:
                        runs[(mode, corr, sched, s)] = r
    return runs


def run_table(runs: dict, out: Path | None = None) -> list[str]:
    lines = ["| replay | correction | LR | seed | steps | k3 KL mean | k3 KL max | flip rate | "
             "reward step 1 | first 5 | peak (step) | last | max grad norm | LR triggers | "
             "degraded | command |", "|" + "---|" * 16]
    for (mode, corr, sched, s), r in runs.items():
        trig = ("-" if sched == "const" else
                f"{len(r['triggers'])} (x{r['lr_scale_last']:.3g})")
        cmd = f"`{run_name(mode, corr, s, sched)}.cmd`" if out else ""
        lines.append(f"| {mode} | {corr} | {sched} | {s} | {r['steps']} | {r['k3_mean']:.2e} | "
                     f"{r['k3_max']:.2e} | {r['flip_rate']:.4f} | {r['reward_curve'][0]:.3f} | "
                     f"{r['reward_first']:.3f} | "
                     f"{r['reward_peak']:.3f} ({r['peak_step']}) | {r['reward_last']:.3f} | "
                     f"{r['grad_norm_max']:.3g} | {trig} | "
                     f"{'YES' if r['degraded'] else 'no'} | {cmd} |")
    return lines


def held_table(runs: dict) -> list[str]:
    """Per (replay, correction, schedule): how many seeds degraded, mean last / peak reward."""
    groups: dict = {}
    for (mode, corr, sched, s), r in runs.items():
        groups.setdefault((mode, corr, sched), []).append(r)
    lines = ["| replay | correction | LR | seeds | degraded | mean peak | mean last | "
             "mean k3 KL |", "|---|---|---|---|---|---|---|---|"]
    for (mode, corr, sched), rs in groups.items():
        lines.append(f"| {mode} | {corr} | {sched} | {len(rs)} | "
                     f"{sum(r['degraded'] for r in rs)}/{len(rs)} | "
                     f"{statistics.mean(r['reward_peak'] for r in rs):.3f} | "
                     f"{statistics.mean(r['reward_last'] for r in rs):.3f} | "
                     f"{statistics.mean(r['k3_mean'] for r in rs):.2e} |")
    return lines


def report(out: Path, seeds: list[int]) -> str:
    runs = collect(out, seeds)
    lines = run_table(runs, out)
    lines += ["", "Which hold (seeds degraded of those run):", ""] + held_table(runs)
    lines += ["", "k3 KL ratio off / R3 (same seed, correction and LR schedule; mean and "
              "median over steps):", "",
              "| correction | LR | seed | off/R3 mean | off/R3 median |", "|---|---|---|---|---|"]
    ratios = []
    for (mode, corr, sched, s), off in runs.items():
        r3 = runs.get(("R3", corr, sched, s))
        if mode != "off" or r3 is None:
            continue
        q = (off["k3_mean"] / r3["k3_mean"], off["k3_median"] / r3["k3_median"])
        ratios.append(q)
        lines.append(f"| {corr} | {sched} | {s} | {q[0]:.2f} | {q[1]:.2f} |")
    if ratios:
        lines += ["", f"off / R3 k3 KL over {len(ratios)} pairs: mean ratio "
                  f"{statistics.mean(r[0] for r in ratios):.2f} (min "
                  f"{min(r[0] for r in ratios):.2f}, max {max(r[0] for r in ratios):.2f})"]
    text = "\n".join(lines)
    (out / "study.md").write_text(text + "\n")
    (out / "study.json").write_text(json.dumps(
        {f"{m}_{c}_{sc}_s{s}": r for (m, c, sc, s), r in runs.items()}, indent=1) + "\n")
    if runs:
        plots(out, runs)
    return text


def regime_table(out: Path) -> str:
    """One row per regime under OUT (each OUT/<regime>/ a study): its config, overrides and
    the off / none / constant-LR runs' outcome."""
    lines = ["| regime | config | overrides | seed | steps | reward step 1 | first 5 | "
             "peak (step) | last | k3 KL mean | k3 KL max | max grad norm | degraded |",
             "|" + "---|" * 13]
    for name, (config, sets) in REGIMES.items():
        for (mode, corr, sched, s), r in collect(out / name, list(range(10)), ("off",),
                                                 ("none",), ("const",)).items():
            lines.append(f"| {name} | `{config}` | {' '.join(f'`{x}`' for x in sets) or '-'} | "
                         f"{s} | {r['steps']} | {r['reward_curve'][0]:.3f} | "
                         f"{r['reward_first']:.3f} | "
                         f"{r['reward_peak']:.3f} ({r['peak_step']}) | {r['reward_last']:.3f} | "
                         f"{r['k3_mean']:.2e} | {r['k3_max']:.2e} | {r['grad_norm_max']:.3g} | "
                         f"{'YES' if r['degraded'] else 'no'} |")
    text = "\n".join(lines)
    (out / "regimes.md").write_text(text + "\n")
    regime_plot(out)
    return text


def regime_plot(out: Path) -> None:
    """OUT/regimes.png: the off / none / constant-LR reward (5-step mean) of each regime."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bases = list(dict.fromkeys(n.replace("_fp32engine", "") for n in REGIMES))
    for name in REGIMES:
        i = bases.index(name.replace("_fp32engine", ""))  # a regime and its fp32-engine twin
        r = summarize_run(out / name / run_name("off", "none", 0))
        if r is not None:
            y = _trailing_mean(r["reward_curve"], SMOOTH)
            ax.plot(range(1, len(y) + 1), y, color=f"C{i % 10}",
                    linestyle="--" if "fp32engine" in name else "-", label=name)
    ax.set_xlabel("step")
    ax.set_xlim(0, 60)
    ax.set_ylabel(f"reward/mean (trailing {SMOOTH}-step mean)")
    ax.set_title("replay off, no correction, constant LR, seed 0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "regimes.png", dpi=80)
    plt.close(fig)


def plots(out: Path, runs: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed0 = min(k[3] for k in runs)
    for key, name, ylabel, log in (("reward_curve", "study_reward.png", "reward/mean", False),
                                   ("k3_curve", "study_k3.png", "rollout_corr/k3_kl", True)):
        corrs = [c for c in CORRECTIONS if any(k[1] == c for k in runs)]
        fig, axes = plt.subplots(1, len(corrs), figsize=(5 * len(corrs), 3.6), sharey=True,
                                 squeeze=False)
        axes = axes[0]
        for ax, corr in zip(axes, corrs):
            for i, mode in enumerate(MODES):
                for (m, c, sched, s), r in runs.items():
                    if m == mode and c == corr:
                        y = r[key] if log else _trailing_mean(r[key], SMOOTH)
                        ax.plot(range(1, len(y) + 1), y, color=f"C{i}", alpha=0.7,
                                linestyle="-" if sched == "const" else "--",
                                label=f"{mode} {sched}" if s == seed0 else None)
            ax.set_title(f"correction: {corr}")
            ax.set_xlabel("step")
            if log:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        axes[0].set_ylabel(ylabel if log else f"{ylabel} (trailing {SMOOTH}-step mean)")
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="default configs/study_routing.yaml (or the --regime's)")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--jobs", type=int, default=1, help="runs at once (one core each)")
    p.add_argument("--modes", nargs="+", default=["off", "R2", "R3"], choices=MODES)
    p.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    p.add_argument("--schedules", nargs="+", default=["const"], choices=list(SCHEDULES),
                   help="LR schedules: const (the config's) and/or trig (TRIGGERED)")
    p.add_argument("--regime", choices=list(REGIMES), help="config + overrides of a named "
                   "regime; runs go under OUT/<regime>/")
    p.add_argument("--set", dest="extra", action="append", default=[],
                   help="extra config override for every run")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--regime-table", action="store_true",
                   help="the table of every regime under OUT (OUT/regimes.md)")
    args = p.parse_args()
    out, extra = Path(args.out), list(args.extra)
    if args.regime_table:
        print(regime_table(out))
        return 0
    config = args.config or str(ROOT / "configs" / "study_routing.yaml")
    if args.regime:
        config, sets = REGIMES[args.regime]
        config, extra, out = str(ROOT / config), sets + extra, out / args.regime
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        check_cells(Path(config), args.modes, args.schedules, extra)
        # seed-major, so the first seed's full table exists early; one run per seed first,
        # so each seed's warm start is trained once and the other runs load it from the cache
        cells = [(m, c, s, sc) for s in args.seeds for sc in args.schedules
                 for c in args.corrections for m in args.modes]
        first = [next(x for x in cells if x[2] == s) for s in args.seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            for batch in (first, [x for x in cells if x not in first]):
                list(pool.map(lambda x: train(Path(config), out, x[0], x[1], x[2], args.steps,
                                              extra, x[3]), batch))
    print(report(out, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
