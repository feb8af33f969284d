"""Latency of one KV-cache decode step (one new token per row) of lockstep's MoE model.

This step bounds the rollout engine's tokens/s: generation at small scale is per-step overhead,
not compute. Timed: the model's cached forward, and the engine's decode step
(`lockstep.rollout.decode.decode_step`: same bits, prepared weights). The baseline in the same
run is transformers' Qwen3-MoE doing the same step (one token per row on a DynamicCache holding
the same prefix), as inside `generate()`.
    OMP_NUM_THREADS=1 python bench/decode_step.py [--preset small|medium] [--dtype bf16|fp32|all]
        [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from lockstep.moe.checkpoint import save_hf
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import KVCache, MoEModel
from lockstep.rollout.decode import DecodeWeights, decode_step

from model_forward import DTYPES, PRESETS  # same models as fwd+bwd
from timing import CLOCKS, median_seconds




@torch.no_grad()
def run(preset: str, dtype_name: str, args) -> None:
    from transformers import DynamicCache, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig(**PRESETS[preset])
    dtype = DTYPES[dtype_name]
    ours = MoEModel(cfg)
    with tempfile.TemporaryDirectory() as d:
        save_hf(ours, d + "/ck")
        theirs = Qwen3MoeForCausalLM.from_pretrained(d + "/ck", dtype=dtype).eval()
    ours.set_precision(dtype).eval()
    B, P = args.batch, args.cache_len
    prompt_BP = torch.randint(0, cfg.vocab_size, (B, P))
    new_B1 = torch.randint(0, cfg.vocab_size, (B, 1))

    # Ours: slots 0..B-1 of a larger cache (as the engine holds them), prefix prefilled.
    cache = KVCache.allocate(cfg, num_slots=2 * B, max_len=P + 64, dtype=dtype)
    slots_B = torch.arange(B)
    ours(prompt_BP, kv_cache=cache, cache_slots_B=slots_B, compute_logits=False)
    pos_B1 = torch.full((B, 1), P)

    def step_ours():  # rewrites cache index P each time: same work every repeat
        return ours(new_B1, positions_BT=pos_B1, kv_cache=cache, cache_slots_B=slots_B)

    weights = DecodeWeights(ours)

    def step_engine():
        return decode_step(ours, weights, new_B1[:, 0], pos_B1[:, 0], cache, slots_B)

    # Theirs: a DynamicCache with the same prefix; cropped back after each step.
    hf_cache = DynamicCache(config=theirs.config)
    theirs(prompt_BP, cache=hf_cache, use_cache=True)
    hf_pos_B1 = torch.full((B, 1), P)

    def step_theirs():
        out = theirs(new_B1, cache=hf_cache, position_ids=hf_pos_B1, use_cache=True)
        hf_cache.crop(-1)  # drop the token just added
        return out

    # Same next-token logits from both (sanity: the benchmark times equal work).
    want = step_ours().logits_BTV[:, 0]
    diff = (want.float() - step_theirs().logits[:, 0].float()).abs().max().item()
    if not torch.equal(step_engine()[0], want):
        raise AssertionError("engine decode step and cached forward disagree")
    t_ours, t_engine, t_theirs = [], [], []
    for _ in range(3):  # interleaved against drift on a shared host
        t_ours.append(median_seconds(step_ours, args.repeats, 3, CLOCKS[args.clock]))
        t_engine.append(median_seconds(step_engine, args.repeats, 3, CLOCKS[args.clock]))
        t_theirs.append(median_seconds(step_theirs, args.repeats, 3, CLOCKS[args.clock]))
    to, te, tt = (statistics.median(t) for t in (t_ours, t_engine, t_theirs))
    print(f"model {preset}, decode step batch {B}, cache length {P}, {dtype_name}, "
          f"torch threads {torch.get_num_threads()}, {args.clock} clock "
          f"(max |logit diff| {diff:.1e})")
    print(f"lockstep forward step: {to * 1e3:7.2f} ms  ({B / to:8.0f} new tok/s)  "
          f"transformers/this {tt / to:.2f}x")
    print(f"engine decode_step:    {te * 1e3:7.2f} ms  ({B / te:8.0f} new tok/s)  "
          f"transformers/this {tt / te:.2f}x (same bits as the forward)")
    print(f"transformers step:     {tt * 1e3:7.2f} ms  ({B / tt:8.0f} new tok/s)\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--dtype", choices=sorted(DTYPES) + ["all"], default="all")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cache-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="cpu: this thread's CPU time (drops waits on a shared host)")
    args = ap.parse_args()
    for dtype_name in sorted(DTYPES) if args.dtype == "all" else [args.dtype]:
        run(args.preset, dtype_name, args)


if __name__ == "__main__":
    main()
