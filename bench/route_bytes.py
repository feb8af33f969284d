"""Route bytes through the driver per RL step, before and after routes by reference
(`rollout.routes_by_reference`, docs/cluster.md "Routes by reference"), at the toy's shape and at
Qwen3-30B-A3B's (48 MoE layers, top-8 of 128 experts) with synthetic routes, for 2 DP ranks.

before  the engines' results carry each sample's [P+R-1, L, K] uint8 routes to the driver,
        `collate` pads them into [B, T, L, K], and each rank is sent its rows (trimmed to its
        own longest row)
after   the results carry a `RouteRef` (key + the engine node's `RouteStore` handle); the
        batch and the shards carry the refs; each rank fetches its rows' routes from the store

The driver's side is built by the real code (`collate`, `plan_shards`, `ShardPlan.batch`) on
synthetic results; bytes are the route tensors' bytes in what the driver receives and sends,
and the pickled size of the refs (what replaces them). A rank's fetch is its rows' unpadded
routes. Rows are ragged like bench/data_plane.py (prompt 128..1024, total T/8..T at Qwen's
shape). Needs ~2.5 GB at Qwen's shape (`--rows 64` for a quick run: bytes scale with rows).

    OMP_NUM_THREADS=1 python bench/route_bytes.py [--rows 512] [--time 8192]
"""

from __future__ import annotations

import argparse
import pickle
import sys

import torch

from lockstep.rollout.route_refs import RouteRef, start_store
from lockstep.rollout.types import GenerationResult
from lockstep.trainer.actor.batch import collate, minibatch_schedule, plan_shards

GiB, MiB = float(1 << 30), float(1 << 20)


def results(B: int, T: int, L: int, K: int, E: int, gen: torch.Generator) -> list:
    out = []
    for b in range(B):
        total = T if b == 0 else int(torch.randint(max(T // 8, 3), T + 1, (1,), generator=gen))
        P = min(total - 1, int(torch.randint(max(1, min(128, T // 4)), max(2, min(1024, T // 2)) + 1,
                                             (1,), generator=gen)))
        R = total - P
        base = torch.randint(0, E, (P + R - 1, L, 1), generator=gen)  # K distinct ids a row
        routes = ((base + torch.arange(K)) % E).to(torch.uint8)
        out.append(GenerationResult(f"s1p{b // 8}", b % 8, [1] * P, [3] * R,
                                    torch.zeros(R), None, {"type": "length", "length": R}, "0",
                                    routes_NLK=routes))
    return out


def measure(name: str, B: int, T: int, L: int, K: int, E: int, store, dp: int = 2) -> None:
    gen = torch.Generator().manual_seed(0)
    res = results(B, T, L, K, E, gen)
    routes_in = sum(r.routes_NLK.numel() for r in res)  # uint8: one byte each
    batch = collate(res, 0, E, L, K)
    schedule = minibatch_schedule(B, max(1, B // 4), 1, 0)
    plan = plan_shards(batch.seq_lens_B, dp, schedule)
    shards = [plan.batch(r, batch) for r in range(dp)]
    routes_out = sum(s.rollout_routes_BTLK.numel() + s.rollout_routes_valid_BT.numel()
                     for s in shards)
    fetch = [sum(res[i].routes_NLK.numel() for i in plan.rows[r].tolist()) for r in range(dp)]
    del batch, shards
    # after: the same results with their routes left in a store (refs only here)
    import dataclasses
    refs = []
    for r in res:
        ref = RouteRef(("0", r.rid, r.index, 0), store, r.routes_NLK.shape[0], 0, "uint8")
        refs.append(dataclasses.replace(r, routes_NLK=None, routes_ref=ref))
    del res
    ref_in = len(pickle.dumps([r.routes_ref for r in refs]))  # one reply per engine call
    after_in = sum(0 if r.routes_NLK is None else r.routes_NLK.numel() for r in refs)
    batch = collate(refs, 0, E, L, K)
    assert batch.rollout_routes_BTLK is None
    shards = [plan.batch(r, batch) for r in range(dp)]
    assert all(s.rollout_routes_BTLK is None for s in shards)
    after_out = sum(s.rollout_routes_BTLK.numel() if s.rollout_routes_BTLK is not None else 0
                    for s in shards)
    ref_out = sum(len(pickle.dumps(s.rollout_route_refs)) for s in shards)
    own = [sorted(k.key for k in s.rollout_route_refs.refs) for s in shards]
    assert all(own[r] == sorted(("0", refs[i].rid, refs[i].index, 0) for i in plan.rows[r].tolist())
               for r in range(dp))  # each rank is handed exactly its rows' keys
    print(f"{name}: {B} rows x up to {T} tokens, {L} MoE layers, top-{K} of {E} (uint8), DP {dp}")
    def size(n: float) -> str:
        return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"
    print(f"  routes through the driver per step: in {size(routes_in)} -> {after_in} B "
          f"(refs instead: {size(ref_in)}); out to the ranks {size(routes_out)} -> {after_out} B "
          f"(refs: {size(ref_out)}); route bytes after / before = 0")
    print("  each rank fetches only its rows: " + ", ".join(
        f"rank {r} {size(fetch[r])} ({fetch[r] / routes_in:.2f} of the step's routes)"
        for r in range(dp)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--time", type=int, default=8192)
    args = ap.parse_args()
    import ray
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        store = start_store(ray.get_runtime_context().get_node_id())
        measure("toy (configs/toy_r3.yaml)", 256, 12, 3, 2, 4, store)
        measure("Qwen3-30B-A3B", args.rows, args.time, 48, 8, 128, store)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
