"""`lockstep compare RUN_DIR [RUN_DIR ...] --out DIR`: overlay runs' curves and summaries.

    lockstep compare runs/off runs/r2 runs/r3 --out runs/compare

Writes reward / flip-rate / k3-KL plots with one line per run and a per-layer flip-rate heatmap
per run into DIR, and prints a table of each run's summary (first/last-window reward, mean k3 KL,
mean flip rate), so replay modes can be compared on the same seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lockstep.trainer.observe.metrics import history_problem, read_metrics, summarize, write_plots
from lockstep.trainer.state.rundir import report_dir_problem

COMPARE_MARKER = ".lockstep-compare"  # --out's plots were written by lockstep compare
COLUMNS = ("reward/first_mean", "reward/last_mean", "rollout_corr/k3_kl_mean",
           "rollout_corr/kl_mean", "routing/flip_rate_mean", "routing/token_any_flip_mean")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="overlay the metrics of several runs (plots + table)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", required=True, help="directory for the plots")
    p.add_argument("--window", type=int, default=20, help="steps in the first/last window")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.window < 1:
        print(f"lockstep compare: --window={args.window} must be >= 1", file=sys.stderr)
        return 2
    runs = {}
    for d in args.runs:
        path = Path(d) / "metrics.jsonl"
        if not Path(d).is_dir():
            print(f"lockstep compare: {d} is not a run directory", file=sys.stderr)
            return 2
        if not path.is_file():
            print(f"lockstep compare: no metrics.jsonl in {d}", file=sys.stderr)
            return 2
        rows = read_metrics(path)  # a malformed file: one line via lockstep.launch.cli
        lines = path.read_text().splitlines()  # read_metrics read it as text already
        if rows and len(rows) < len(lines) and lines[-1].strip():
            print(f"lockstep compare: note: the last line of {path} is torn (a run still "
                  f"writing it, or killed); summarising steps 1..{rows[-1]['step']}",
                  file=sys.stderr)
        if not rows:
            print(f"lockstep compare: {path} has no steps yet", file=sys.stderr)
            return 2
        problem = history_problem(rows)  # a doubled row would skew every mean silently
        if problem is not None:
            print(f"lockstep compare: {path} is not one row per step 1..{rows[-1]['step']}: "
                  f"{problem}", file=sys.stderr)
            return 2
        runs[Path(d).name] = rows
    if len(set(runs)) != len(args.runs):
        print("lockstep compare: run directories must have distinct names", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"lockstep compare: --out {out} is a file, not a directory", file=sys.stderr)
        return 2
    problem = report_dir_problem(out)
    if problem is not None:
        print(f"lockstep compare: {problem}", file=sys.stderr)
        return 2
    theirs = sorted(p.name for p in out.glob("*.png")) if not (out / COMPARE_MARKER).is_file() \
        else []
    if theirs:
        print(f"lockstep compare: --out {out} already holds {', '.join(theirs[:3])}, not written "
              f"by lockstep compare (no {COMPARE_MARKER}); it never writes over them: choose a "
              f"new or empty --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / COMPARE_MARKER).touch()
    written = write_plots(out, runs)
    width = max(len(n) for n in runs)
    print(f"{'run':<{width}}  " + "  ".join(f"{c:>28}" for c in COLUMNS))
    for name, rows in runs.items():
        s = summarize(rows, args.window)
        print(f"{name:<{width}}  " + "  ".join(f"{s.get(c, float('nan')):>28.4g}" for c in COLUMNS))
    print("plots: " + ", ".join(str(p) for p in written))
    return 0
