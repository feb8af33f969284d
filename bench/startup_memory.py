"""Start-up memory of an actor group: every rank reading its own part of an HF folder (`new`,
`ActorGroup(cfg, folder)`) against the in-memory path (`old`: the driver loads the whole model,
puts its fp32 state dict in Ray's object store, every rank builds the whole model from it and
then shards it), measured in the same run on the same folder (docs/cluster.md, "Start-up").

Layouts: megatron EP=2, megatron TP=2, torch DDP=2, each on 2 ranks of a local Ray cluster
(gloo, OMP_NUM_THREADS=1). Each (layout, path) runs in a driver process of its own (peak RSS
is per process): the driver's peak RSS, each rank's RSS before `build` and its peak after,
the bytes it read from the folder, and what went through the object store. The model is our
own random init written once (332 MiB fp32; no download).

    OMP_NUM_THREADS=1 python bench/startup_memory.py [--layouts ep2,tp2,ddp2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# 87M parameters (332 MiB fp32), 87% of them in experts: 4 MoE layers of 16 experts 512 x 768
MODEL = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, intermediate_size=1536,
             moe_intermediate_size=768, num_experts=16, num_experts_per_tok=2,
             eos_token_id=2, pad_token_id=0, bos_token_id=1)
LAYOUTS = {"ep2": ["actor.backend=megatron", "actor.megatron.expert_parallel=2"],
           "tp2": ["actor.backend=megatron", "actor.megatron.tensor_parallel=2"],
           "ddp2": ["actor.backend=torch"]}
MiB = 1 << 20


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_model(folder: Path) -> int:
    """Our random init of MODEL as an HF folder; returns its fp32 bytes."""
    from lockstep.moe.checkpoint import save_hf
    from lockstep.moe.config import ModelConfig
    from lockstep.moe.model import MoEModel
    torch.manual_seed(0)
    model = MoEModel(ModelConfig(**MODEL))
    save_hf(model, folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def one_case(folder: str, layout: str, path: str) -> dict:
    """In a fresh driver process: start the group (new: from the folder; old: from a model the
    driver loads), and report memory."""
    from lockstep.moe.checkpoint import load_hf
    from lockstep.trainer.config.load import load_config
    from lockstep.trainer.actor.group import ActorGroup
    cfg = load_config(None, [f"model.path={folder}", "cluster.actor_ranks=2",
                             "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                             "actor.mini_batch_size=8", "actor.micro_batch_size=8",
                             *LAYOUTS[layout]])
    source = folder if path == "new" else load_hf(folder)
    group = ActorGroup(cfg, source, total_updates=1)
    try:
        ranks = group.startup_stats()
        # the ranks hold the same weights either way: one exported tensor as a check
        first = next(iter(group.export_weights(1 << 20)))[0]
    finally:
        group.close()
    return {"driver_peak_rss": _peak_rss(), "ranks": ranks, "first_tensor": first[0],
            "first_sum": float(first[1].double().sum())}


def run_case(folder: Path, layout: str, path: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", f"{folder},{layout},{path}"],
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{layout}/{path} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="ep2,tp2,ddp2")
    ap.add_argument("--keep", default=None, help="write the model folder here (default: a temp dir)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        folder, layout, path = args.case.split(",")
        print(json.dumps(one_case(folder, layout, path)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp) / "model"
        model_bytes = write_model(folder)
        print(f"model: {model_bytes / MiB:.0f} MiB fp32 ({folder})")
        print("rank peak: a rank's peak RSS after build (megatron-core's import, grad buffers "
              "and Adam states included: the same in both paths); over idle: minus an idle "
              "rank's RSS (the new path's RSS before build: the same imports, no weights)")
        print(f"{'layout':7} {'path':4} {'driver peak':>12} {'rank peak':>10} "
              f"{'over idle':>10} {'read/rank':>10} {'object store':>13}")
        for layout in args.layouts.split(","):
            got = {p: run_case(folder, layout, p) for p in ("old", "new")}
            assert got["old"]["first_sum"] == got["new"]["first_sum"], got  # same weights
            idle = max(r["rss_before"] for r in got["new"]["ranks"])
            row = {}
            for p in ("old", "new"):
                g = got[p]
                peak = max(r["peak_rss"] for r in g["ranks"])
                read = max(r["bytes_read"] or 0 for r in g["ranks"])
                store = model_bytes if p == "old" else 0
                row[p] = (g["driver_peak_rss"], peak, peak - idle, read)
                print(f"{layout:7} {p:4} {g['driver_peak_rss'] / MiB:10.0f}Mi {peak / MiB:8.0f}Mi "
                      f"{(peak - idle) / MiB:8.0f}Mi {read / MiB:8.0f}Mi {store / MiB:11.0f}Mi")
            o, n = row["old"], row["new"]
            print(f"{layout:7} new/old: driver peak {n[0] / o[0]:.2f}, rank peak {n[1] / o[1]:.2f}, "
                  f"rank peak over idle {n[2] / o[2]:.2f}; bytes read per rank / model "
                  f"{n[3] / model_bytes:.2f}")


if __name__ == "__main__":
    main()
