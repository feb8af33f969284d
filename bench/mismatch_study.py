"""Study 4, the mismatch lab (docs/evidence.md): correction and replay arms at injected
train/infer mismatch levels, against an exact (zero-mismatch) control.

    OMP_NUM_THREADS=1 nohup python bench/mismatch_study.py --out runs/study4 &   # the plan
    python bench/mismatch_study.py --out runs/study4 --report-only               # tables, plots
    OMP_NUM_THREADS=1 python bench/mismatch_study.py --out runs/study4 \\
        --cells off@0.1@s0 R3@0.1@s0                                            # given cells
    OMP_NUM_THREADS=1 python bench/mismatch_study.py --out runs/study4_lp1 --logprob-noise 1.0 \\
        --cells exact@0@s0 off@0@s0 TIS@0@s0                                    # noisy sampling

A cell is `ARM@LEVEL@sSEED`, one `lockstep train configs/study_mismatch.yaml` run:
- `exact`: rollout.exact (engine and actor bitwise equal), no injection (level 0 only);
- `bf16`: the default kernels, bf16 engine and actor, no injection (their natural mismatch);
- `off`, `R2`, `R3`, `R3_gates`, `TIS`, `IcePop`, `KPop`, `TRM` at LEVEL = the target per-layer
  routing flip rate the engine's router noise is calibrated to (`rollout.mismatch`), on the
  default kernels (bf16 on both sides: their own mismatch is the `bf16` row's, far below the
  levels). TIS / IcePop / KPop / TRM run with replay off.
`--logprob-noise S` adds `rollout.mismatch.logprob_noise: S` to every injected arm (the engine
samples from, and reports, logits plus N(0, S^2)); injected arms may then run at level 0 (no
router noise): a mismatch of the sampling distribution alone. Use its own --out.

Cells run one after another (one thread, a shared box); a cell with a summary.json is done, one
killed mid-way resumes from its last checkpoint (every 50 steps), so the driver can be killed
and restarted at any time. Each cell's exact command is written to OUT/<cell>.cmd. The plan
(`PLAN`, run when no --cells are given) runs seed 0 of every arm at the key levels first, then
higher levels, then seeds 1 and 2. OUT/study.md and OUT/study.json hold every number; plots
OUT/study4_*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "study_mismatch.yaml"
ARMS = {  # name -> overrides (the config: replay off, no correction, exact off below)
    "exact": ["rollout.exact=true"],
    "bf16": [],
    "off": [],
    "R2": ["replay.mode=R2"],
    "R3": ["replay.mode=R3"],
    "R3_gates": ["replay.mode=R3", "replay.gates=engine"],
    "TIS": ["correction.rollout_is=token", "correction.rollout_is_threshold=2.0"],
    "IcePop": ["correction.rollout_is=token", "correction.rollout_is_threshold=0.5_2.0"],
    "KPop": ["correction.kpop=true", "correction.kpop_phi=2.0"],
    "TRM": ["correction.trm_delta=1.0"],
}
INJECTED = ("off", "R2", "R3", "R3_gates", "TIS", "IcePop", "KPop", "TRM")
MAIN = ("off", "R2", "R3", "R3_gates", "TIS", "IcePop", "KPop")


def _plan() -> list[str]:
    cells = ["exact@0@s0", "bf16@0@s0"]
    for level in ("0.1", "0.3"):
        cells += [f"{a}@{level}@s0" for a in MAIN]
    cells += ["off@0.6@s0", "R3@0.6@s0", "R3_gates@0.6@s0", "TIS@0.6@s0", "IcePop@0.6@s0",
              "KPop@0.6@s0", "R2@0.6@s0", "off@0.03@s0", "TRM@0.3@s0"]
    for s in (1, 2):
        cells += [f"exact@0@s{s}"] + [f"{a}@0.3@s{s}" for a in MAIN] + \
            [f"off@0.1@s{s}", f"R3@0.1@s{s}", f"off@0.6@s{s}", f"R3@0.6@s{s}"]
    return cells


PLAN = _plan()
LOGPROB_NOISE = 0.0  # --logprob-noise: sampling-logit noise of every injected arm
CHECKPOINT_EVERY = 50
LAST = 50          # steps of the final reward window
LAG = 0.05         # degraded: final reward this far below the exact arm of the same seed
FALL, DROP, SMOOTH = 0.5, 0.05, 5   # or collapsed (Study 3's rule)


def parse(cell: str) -> tuple[str, float, int]:
    try:
        arm, level, seed = cell.split("@")
        out = arm, float(level), int(seed.removeprefix("s"))
    except ValueError:
        raise SystemExit(f"cell {cell!r}: expected ARM@LEVEL@sSEED, e.g. off@0.1@s0") from None
    if arm not in ARMS:
        raise SystemExit(f"cell {cell!r}: unknown arm {arm!r}; valid: {list(ARMS)}")
    if (arm in INJECTED) != (out[1] > 0) and not (arm in INJECTED and LOGPROB_NOISE):
        raise SystemExit(f"cell {cell!r}: {arm} runs at level "
                         f"{'> 0' if arm in INJECTED else '0'}")
    return out


def command(cell: str, out: Path, steps: int, extra: list[str], resume: bool) -> list[str]:
    arm, level, seed = parse(cell)
    sets = [*ARMS[arm], f"loop.seed={seed}", f"loop.steps={steps}",
            f"loop.checkpoint_every={CHECKPOINT_EVERY}", "loop.keep_checkpoints=1", *extra]
    mismatch = {"router_flip_rate": level} if level > 0 else {}
    if arm in INJECTED and LOGPROB_NOISE:
        mismatch["logprob_noise"] = LOGPROB_NOISE
    if mismatch:
        sets.append("rollout.mismatch={" + ", ".join(f"{k}: {v}" for k, v in mismatch.items()) + "}")
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", str(CONFIG), "--out",
           str(out / cell), "--no-progress"] + [a for s in sets for a in ("--set", s)]
    return cmd + (["--resume"] if resume else [])


def run_cell(cell: str, out: Path, steps: int, extra: list[str]) -> bool:
    d = out / cell
    if (d / "summary.json").exists():
        return True
    resume = (d / "checkpoints").is_dir() and any((d / "checkpoints").iterdir())
    if d.exists() and not resume:
        subprocess.run(["rm", "-rf", str(d)], check=True)
    cmd = command(cell, out, steps, extra, resume=False)
    (out / f"{cell}.cmd").write_text("OMP_NUM_THREADS=1 " + shlex.join(["python", *cmd[1:]]) + "\n")
    t0 = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] {cell}{' (resumed)' if resume else ''}", flush=True)
    with open(out / f"{cell}.log", "a") as log:
        rc = subprocess.run(command(cell, out, steps, extra, resume), stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}).returncode
    print(f"    rc {rc} in {time.time() - t0:.0f}s", flush=True)
    return rc == 0


# -- the report --------------------------------------------------------------------------------
def _rows(d: Path) -> list[dict]:
    p = d / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else float("nan")


def summarize(cell: str, rows: list[dict]) -> dict:
    arm, level, seed = parse(cell)
    r = [m["reward/mean"] for m in rows]
    trail = [_mean(r[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(r))]
    peak = max(trail) if trail else float("nan")
    g = lambda k: [m.get(k) for m in rows]
    return {"cell": cell, "arm": arm, "level": level, "seed": seed, "steps": len(rows),
            "flip_rate": _mean(g("routing/flip_rate")),
            "any_flip": _mean(g("routing/token_any_flip")),
            "k3_mean": _mean(g("rollout_corr/k3_kl")),
            "k3_max": max((x for x in g("rollout_corr/k3_kl") if x is not None), default=float("nan")),
            "reward_first": _mean(r[:10]), "reward_peak": peak, "reward_last": _mean(r[-LAST:]),
            "len_first": _mean(g("response/length_mean")[:10]),
            "len_last": _mean(g("response/length_mean")[-LAST:]),
            "grad_norm_max": max((x for x in g("actor/grad_norm") if x is not None), default=float("nan")),
            "sigma": _mean(g("mismatch/router_noise")),
            "masked": _mean([m.get("rollout_corr/kpop_masked_fraction",
                                   m.get("rollout_corr/trm_masked_fraction",
                                         m.get("rollout_corr/rollout_is_oob_ratio")))
                             for m in rows]),
            "collapsed": bool(trail) and trail[-1] < FALL * peak and trail[-1] <= peak - DROP,
            "skipped": sum(m.get("actor/skipped_step", 0) for m in rows)}


def report(out: Path, cells: list[str]) -> list[dict]:
    done = [c for c in cells if (out / c / "summary.json").exists()]
    res = [summarize(c, _rows(out / c)) for c in done]
    exact = {s["seed"]: s["reward_last"] for s in res if s["arm"] == "exact"}
    for s in res:
        ref = exact.get(s["seed"])
        s["lag_vs_exact"] = float("nan") if ref is None else ref - s["reward_last"]
        s["degraded"] = s["collapsed"] or s["skipped"] > 0 or (
            ref is not None and s["reward_last"] < ref - LAG)
    res.sort(key=lambda s: (s["seed"], s["level"], list(ARMS).index(s["arm"])))
    cols = ["arm", "level", "seed", "steps", "flip_rate", "any_flip", "k3_mean", "k3_max",
            "reward_first", "reward_peak", "reward_last", "lag_vs_exact", "len_first", "len_last",
            "grad_norm_max", "masked", "degraded"]
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " | command |", "|" + "---|" * (len(cols) + 1)]
    for s in res:
        lines.append("| " + " | ".join(fmt(s[c]) for c in cols) + f" | `{s['cell']}.cmd` |")
    missing = [c for c in cells if c not in done]
    text = "\n".join(lines) + f"\n\ncells run: {len(done)} of {len(cells)}" + (
        f"; not run: {', '.join(missing)}" if missing else "") + "\n"
    (out / "study.md").write_text(text)
    (out / "study.json").write_text(json.dumps(res, indent=1) + "\n")
    print(text)
    plots(out, res)
    return res


def plots(out: Path, res: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = sorted({s["level"] for s in res if s["arm"] in INJECTED})
    if not levels:
        return
    for key, name, ylabel in (("reward/mean", "reward", "reward (10-step mean)"),
                              ("rollout_corr/k3_kl", "k3", "k3 KL (pi_old vs mu_old)"),
                              ("response/length_mean", "length", "response length"),
                              ("actor/grad_norm", "grad_norm", "grad norm")):
        fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 3.6), squeeze=False)
        for ax, level in zip(axes[0], levels):
            for s in res:
                if s["seed"] != 0 or s["level"] not in (0, level):
                    continue
                ys = [m.get(key) for m in _rows(out / s["cell"])]
                ys = [float("nan") if y is None else y for y in ys]
                k = 10 if key != "rollout_corr/k3_kl" else 1
                sm = [_mean(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
                style = "k-" if s["arm"] == "exact" else ("k:" if s["arm"] == "bf16" else "-")
                ax.plot(range(1, len(sm) + 1), sm, style, label=s["arm"], lw=1.2)
            noise = f", logprob noise {LOGPROB_NOISE}" if LOGPROB_NOISE else ""
            ax.set_title(f"injected flip rate {level}{noise} (seed 0)")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            if key == "rollout_corr/k3_kl":
                ax.set_yscale("symlog", linthresh=1e-6)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"study4_{name}.png", dpi=90)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cells", nargs="*", help="ARM@LEVEL@sSEED cells (default: the plan)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    help="an override for every cell, e.g. actor.lr=1e-3")
    ap.add_argument("--logprob-noise", type=float, default=0.0,
                    help="rollout.mismatch.logprob_noise of every injected arm")
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    global LOGPROB_NOISE
    LOGPROB_NOISE = a.logprob_noise
    cells = a.cells or PLAN
    for c in cells:
        parse(c)
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.report_only:
        for c in cells:
            run_cell(c, a.out, a.steps, a.extra)
            report(a.out, cells)
    report(a.out, cells)


if __name__ == "__main__":
    main()
