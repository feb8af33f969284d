"""Tables of the 2026-family toy runs (docs/model.md "Toy runs of the 2026 families") and of the
indexer-replay study (docs/evidence.md "Indexer replay on the DSA toy") from their run folders.

    OMP_NUM_THREADS=1 lockstep train configs/toy_gpt_oss_r3.yaml --out /tmp/fam/gpt_oss
    python bench/family_toys.py /tmp/fam/gpt_oss /tmp/fam/qwen35 /tmp/fam/dsa
    python bench/family_toys.py --steps 20 /tmp/fam/idx_off_s0 /tmp/fam/dsa ...   # first 20 steps

Per run (metrics.jsonl): the reward of step 1 and the mean of the first and last 5 steps, the
largest `replay/mismatch` (routes that differ from the ones replayed: 0 under R3), the mean
routing flip rate, the mean indexer flip rate and tokens with >= 1 flipped indexer layer (DSA
models), and the k3 KL (mean and median over the steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def row(run: Path, steps: int | None) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r][:steps]
    cfg = (run / "config.yaml").read_text()
    rew = [r["reward/mean"] for r in rows]
    k3 = [r["rollout_corr/k3_kl"] for r in rows]

    def mean(key):
        v = [r[key] for r in rows if key in r]
        return statistics.fmean(v) if v else None

    return {"run": run.name, "steps": len(rows), "reward_1": rew[0],
            "reward_first5": statistics.fmean(rew[:5]), "reward_last5": statistics.fmean(rew[-5:]),
            "mismatch_max": max(r.get("replay/mismatch", 0.0) for r in rows),
            "flip_rate": mean("routing/flip_rate"), "indexer_flip": mean("indexer/flip_rate"),
            "indexer_any": mean("indexer/token_any_flip"),
            "k3_mean": statistics.fmean(k3), "k3_median": statistics.median(k3),
            "indexer_replay": "r3" if "indexer: r3" in cfg else
            ("r2" if "indexer: r2" in cfg else "off")}


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3e}" if 0 < abs(v) < 1e-2 else f"{v:.3f}"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="only the first N steps of each run")
    args = ap.parse_args()
    rows = [row(r, args.steps) for r in args.runs]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(fmt(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
