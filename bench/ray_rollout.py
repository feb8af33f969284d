"""Ray rollout benchmark: `Fleet.ray` (rollout.backend: ray) with N engines vs the in-process engine, measured in
the same run on the same seeded requests with ignore_eos (the same token count; at fp32 the same
samples too: bf16 CPU numerics depend on the batch, and each engine sees a part of it).

(a) generation wall time of one RL batch: in-process engine / Fleet.ray(N) (speed-up);
(b) weight push: Fleet.ray's update_weights (cast, one ray.put per bucket, N loads) / in-process
    Engine.update_weights (a state-dict copy);
(c) fault: generate with engine 1 killed -9 as the call starts (its share runs again on the
    live engines; the call returns once a replacement is up) / generate without a fault.
Start-up (Ray cluster, worker processes importing torch) is printed but not in the ratios.

    OMP_NUM_THREADS=1 python bench/ray_rollout.py [--engines 2] [--preset small] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import ray
import torch

from lockstep.kernels.threads import worker_env
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import LocalBackend
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.fleet import Fleet
from lockstep.rollout.types import GenerateRequest, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from model_forward import PRESETS  # noqa: E402
from timing import median_seconds  # noqa: E402


def batch(prompts: int, n: int, prompt_len: int, new: int, vocab: int) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(0)
    return [GenerateRequest(torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=new, n=n, ignore_eos=True, seed=1000 * i),
                            rid=f"p{i}") for i in range(prompts)]




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig(**PRESETS[args.preset], eos_token_id=2, pad_token_id=0, bos_token_id=1)
    model = MoEModel(cfg)
    ecfg = EngineConfig(dtype=args.dtype, max_running=args.prompts * args.n, max_len=16 + args.new)
    reqs = lambda: batch(args.prompts, args.n, 16, args.new, cfg.vocab_size)  # noqa: E731

    t = time.perf_counter()
    ray.init(address="local", num_cpus=args.engines, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": worker_env(1)})
    t_init = time.perf_counter() - t
    t = time.perf_counter()
    remote = Fleet.ray(model, ecfg, args.engines)
    t_workers = time.perf_counter() - t
    local = LocalBackend(Engine.from_model(model, ecfg))
    try:
        same = [r.output_ids for r in remote.generate(reqs())] == \
            [r.output_ids for r in local.generate(reqs())]
        gen_local = median_seconds(lambda: local.generate(reqs()), args.repeats)
        gen_ray = median_seconds(lambda: remote.generate(reqs()), args.repeats)
        push_local = median_seconds(lambda: local.update_weights(model), args.repeats)
        push_ray = median_seconds(lambda: remote.update_weights(model), args.repeats)
        victim = remote.slots[1].pid
        t = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        same_after_kill = [r.output_ids for r in remote.generate(reqs())] == \
            [r.output_ids for r in local.generate(reqs())]
        gen_fault = time.perf_counter() - t
        gen_after = median_seconds(lambda: remote.generate(reqs()), args.repeats)
    finally:
        remote.close()
        ray.shutdown()
    tokens = args.prompts * args.n * args.new
    params = sum(p.numel() for p in model.parameters())
    print(f"preset {args.preset} ({params / 1e6:.1f}M params, {args.dtype}), "
          f"{args.prompts} prompts x {args.n} samples x {args.new} new tokens, "
          f"{args.engines} engines, median of {args.repeats}; same samples: {same}")
    # NOTE: the engine is bound by per-step overhead, so N engines on 1/N of the batch each do
    # more total work than one engine; the speed-up needs N free cores.
    print(f"start-up: ray.init {t_init:.1f} s, {args.engines} workers {t_workers:.1f} s")
    print(f"(a) generate: in-process {gen_local:.3f} s ({tokens / gen_local:.0f} tok/s), "
          f"ray {gen_ray:.3f} s ({tokens / gen_ray:.0f} tok/s): "
          f"speed-up x{gen_local / gen_ray:.2f}")
    print(f"(b) weight push: in-process {push_local * 1e3:.1f} ms, ray {push_ray * 1e3:.1f} ms: "
          f"x{push_ray / push_local:.1f} the in-process copy")
    print(f"(c) fault: generate with engine 1 killed -9 {gen_fault:.2f} s (restarts "
          f"{[i.restarts for i in remote.slots]}, same samples: {same_after_kill}) = "
          f"x{gen_fault / gen_ray:.1f} a generate without a fault; after it {gen_after:.3f} s")


if __name__ == "__main__":
    main()
