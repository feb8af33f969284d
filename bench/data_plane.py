"""Data plane at a Qwen3-30B-A3B shape: collate, DP shards, bytes per rank, rank memory, and
rollout correction against verl 0.9.1.

A synthetic RL batch: B=256 rows of ragged length (prompt 128..1024 tokens, total T/8..T, one
row of exactly T=8192), routes for 48 MoE layers, top-8 of 128 experts (uint8, as the engine
returns them). Measured in one run:

- collate: `trainer.actor.batch.collate` of the 256 engine results vs the bare copy of the same
  routes into a zeroed [B, T, L, K] uint8 tensor (what any padded batch costs; ratio >= 1);
- for 2 and 4 simulated DP ranks (`plan_shards` over a 4-step mini-batch schedule): shard build
  time; bytes sent per rank (`wire_bytes`: tokens, masks, rollout log-probs, compact routes and
  valid flags, plus fp32 advantages and IS weights) vs the whole batch; each rank's route bytes
  vs 1/DP of the batch's compact routes; and each rank's peak memory measured in its own
  process: the shard is saved as the driver would ship it, loaded by a fresh process, and the
  process's peak RSS growth (ru_maxrss) is reported;
- rollout correction (`compute_rollout_correction_and_rejection_mask`, the function
  `correct` runs) vs verl 0.9.1's function of the same name on the same log-probs, at
  [512, 4096] and [64, 1024], for the toy config's token TIS and other common options. Ratio =
  verl time / ours (target >= 2). Skipped when verl is not installed.

Measured on the shared 2-core dev host (loaded by other jobs, so absolute times drift; the
ratios are from the same run): collate 10.9 s vs bare copy 4.3 s (2.5x); DP=2 ranks get
0.49-0.50 of the batch's bytes, DP=4 0.24-0.25; rank routes 0.97-1.00 x 1/DP of the batch's
compact routes, rank RSS growth on load 1.02-1.04 x; correction vs verl at [512, 4096]: token
TIS 3.8x, sequence IS 3.5x, IcePop 3.0x, TIS + RS 2.9x; at [64, 1024]: 20-27x without RS,
2.5x with RS (token_k1,seq_mean_k3).

Memory: about 2.5 GB at the default size (the engine results' routes, the padded batch, one
shard at a time); no int64 copy of any route tensor is ever built.

    OMP_NUM_THREADS=1 python bench/data_plane.py
    python bench/data_plane.py --rows 32 --time 2048 --repeats 1      # quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from timing import median_seconds

L, K, E = 48, 8, 128  # Qwen3-30B-A3B: 48 MoE layers, top-8 of 128 experts


def synth_results(B: int, T: int, seed: int = 0):
    """Engine-like results with ragged lengths and distinct top-k routes (uint8)."""
    from lockstep.rollout.types import GenerationResult

    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(B):
        n = T if b == 0 else int(torch.randint(T // 8, T + 1, (1,), generator=g))
        P = min(int(torch.randint(128, 1025, (1,), generator=g)), n - 1)
        base = torch.randint(0, E, (n - 1, L, 1), generator=g, dtype=torch.int16)
        routes = ((base + torch.arange(K, dtype=torch.int16) * (E // K)) % E).to(torch.uint8)
        ids = torch.randint(3, 150_000, (n,), generator=g).tolist()
        lp = -torch.rand(n - P, generator=g)
        out.append(GenerationResult(f"r{b}", 0, ids[:P], ids[P:], lp, lp,
                                    {"type": "length", "length": n - P}, "0", routes))
    return out


def bare_copy(results, T: int) -> torch.Tensor:
    """The floor under any padded batch: copy each sample's routes into [B, T, L, K]."""
    out = torch.zeros(len(results), T, L, K, dtype=torch.uint8)
    for b, r in enumerate(results):
        out[b, :r.routes_NLK.shape[0]] = r.routes_NLK
    return out


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(path: str) -> None:
    """A simulated DP rank: load the shard it was sent, report its peak RSS growth (VmHWM after
    resetting it, minus VmRSS before: Linux's clear_refs "5" resets the high-water mark)."""
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_mib("VmRSS")
    shard = torch.load(path, weights_only=True)
    peak = _rss_mib("VmHWM")
    routes = shard["rollout_routes_BTLK"]
    print(json.dumps({"peak_mib": peak - base, "routes_dtype": str(routes.dtype),
                      "routes_bytes": routes.numel() * routes.element_size()}))


def shard_section(batch, dps, mini_batches: int, repeats: int) -> None:
    from dataclasses import fields

    from lockstep.trainer.actor.batch import minibatch_schedule, plan_shards, wire_bytes

    B = batch.size
    adv_BT = torch.randn(batch.input_ids_BT.shape)  # per-token extras the loop ships too
    isw_BT = torch.rand(batch.input_ids_BT.shape)
    whole = wire_bytes(batch, adv_BT, isw_BT)
    routes_all = batch.rollout_routes_BTLK.numel()
    print(f"\nwhole batch: {whole / 2**20:.0f} MiB ({routes_all / 2**20:.0f} MiB compact routes, "
          f"{batch.rollout_routes_BTLK.dtype})")
    schedule = minibatch_schedule(B, B // mini_batches, 1, shuffle_seed=1)
    for dp in dps:
        plan = plan_shards(batch.seq_lens_B, dp, schedule)
        t_plan = median_seconds(lambda: plan_shards(batch.seq_lens_B, dp, schedule), repeats)
        t_shard = median_seconds(lambda: [plan.batch(r, batch) for r in range(dp)], repeats)
        print(f"\nDP={dp}: plan {t_plan * 1e3:.1f} ms, all shards {t_shard:.2f} s; "
              f"target: rank routes <= 1/{dp} of the batch's")
        for r in range(dp):
            sh = plan.batch(r, batch)
            extras = [plan.take(r, x, batch.seq_lens_B) for x in (adv_BT, isw_BT)]
            sent = wire_bytes(sh, extras)
            tokens = int(batch.seq_lens_B[plan.rows[r]].sum())
            with tempfile.TemporaryDirectory() as d:
                path = str(Path(d) / "shard.pt")
                torch.save({f.name: getattr(sh, f.name) for f in fields(sh)
                            if getattr(sh, f.name) is not None}, path)
                file_mib = os.path.getsize(path) / 2**20
                child = json.loads(subprocess.run(
                    [sys.executable, __file__, "--child", path], check=True, capture_output=True,
                    text=True).stdout)
            rb = child["routes_bytes"]
            print(f"  rank {r}: {len(plan.rows[r])} rows, {tokens} tokens, t={sh.input_ids_BT.shape[1]}; "
                  f"sent {sent / 2**20:.0f} MiB = {sent / whole:.3f} of the batch "
                  f"(file {file_mib:.0f} MiB); routes {rb / 2**20:.0f} MiB {child['routes_dtype']} = "
                  f"{rb / (routes_all / dp):.3f} x 1/{dp}; rank peak RSS growth "
                  f"{child['peak_mib']:.0f} MiB = {child['peak_mib'] * 2**20 / (routes_all / dp):.3f} x 1/{dp}")
            del sh, extras


def correction_section(repeats_big: int, repeats_small: int) -> None:
    from lockstep.trainer.objective import rollout_corr as ours

    try:
        from verl.trainer.ppo import rollout_corr_helper as verl
    except ImportError as e:
        print(f"\ncorrection vs verl: skipped (verl not importable: {e})")
        return
    cases = {
        "token TIS 2.0 (toy)": dict(rollout_is="token", rollout_is_threshold=2.0),
        "sequence IS 2.0": dict(rollout_is="sequence", rollout_is_threshold=2.0),
        "token TIS + batch norm": dict(rollout_is="token", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=True),
        "token IcePop 0.5_2.0": dict(rollout_is="token", rollout_is_threshold="0.5_2.0"),
        "TIS + RS token_k1,seq_mean_k3": dict(rollout_is="token", rollout_is_threshold=2.0,
                                              rollout_rs="token_k1,seq_mean_k3",
                                              rollout_rs_threshold="0.8_1.2,0.01"),
    }
    print("\nrollout correction, same log-probs (ratio = verl / ours; target >= 2)")
    for B, T, n in ((512, 4096, repeats_big), (64, 1024, repeats_small)):
        g = torch.Generator().manual_seed(0)
        rollout = -torch.rand(B, T, generator=g) * 3
        old = rollout + torch.randn(B, T, generator=g) * 0.3
        lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).float()
        for name, kw in cases.items():
            tv = median_seconds(lambda: verl.compute_rollout_correction_and_rejection_mask(
                old, rollout, mask, **kw), n, warmup=1)
            to = median_seconds(lambda: ours.compute_rollout_correction_and_rejection_mask(
                old, rollout, mask, **kw), n, warmup=1)
            print(f"  [{B}, {T}] {name:32s} verl {tv * 1e3:8.1f} ms  ours {to * 1e3:8.1f} ms  "
                  f"ratio {tv / to:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--time", type=int, default=8192)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mini-batches", type=int, default=4, help="optimiser steps per RL step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-correction", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a.child)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from lockstep.trainer.actor.batch import collate

    t0 = time.perf_counter()
    results = synth_results(a.rows, a.time)
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in results)
    print(f"batch: B={a.rows} T={a.time} L={L} K={K} E={E}, {tokens} tokens "
          f"({tokens / (a.rows * a.time):.2f} of B x T), synthesised in {time.perf_counter() - t0:.1f} s")
    t_copy = median_seconds(lambda: bare_copy(results, a.time), a.repeats)
    t_collate = median_seconds(lambda: collate(results, 0, E, L, K), a.repeats)
    print(f"collate {t_collate:.2f} s vs bare route copy {t_copy:.2f} s: ratio {t_collate / t_copy:.2f}")
    batch = collate(results, 0, E, L, K)
    del results
    shard_section(batch, a.dp, a.mini_batches, a.repeats)
    del batch
    if not a.skip_correction:
        correction_section(max(3, a.repeats), 10 * max(3, a.repeats))


if __name__ == "__main__":
    main()
