"""Forward+backward tokens/s of lockstep's MoE model vs transformers' Qwen3-MoE.

Same config, weights, batch and dtype in one run; prints medians and the ratio ours/theirs.
    OMP_NUM_THREADS=1 python bench/model_forward.py [--preset small|medium] [--dtype fp32|bf16]
        [--clock wall|cpu]
`--clock cpu` times this thread's CPU time instead of wall time: on a host shared by other
jobs it drops the time spent waiting for a core (run with OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from timing import CLOCKS, median_seconds

from lockstep.kernels.dtypes import torch_dtype
from lockstep.moe.checkpoint import save_hf
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel

PRESETS = {
    # The two models REFERENCE.md measured transformers on (3.4M and 27M parameters).
    "small": dict(vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=256,
                  moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2),
    "medium": dict(vocab_size=1024, hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, intermediate_size=512,
                   moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4),
}
DTYPES = {n: torch_dtype(n) for n in ("fp32", "bf16")}




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS) + ["all"], default="all")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args()
    for preset in sorted(PRESETS) if args.preset == "all" else [args.preset]:
        run(preset, args)


def run(preset: str, args) -> None:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig(**PRESETS[preset])
    dtype = DTYPES[args.dtype]
    ours = MoEModel(cfg)
    with tempfile.TemporaryDirectory() as d:
        save_hf(ours, d + "/ck")
        theirs = Qwen3MoeForCausalLM.from_pretrained(d + "/ck", dtype=dtype)
    ours.set_precision(dtype)
    ours.train()
    theirs.train()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))

    def step_ours():
        ours.zero_grad(set_to_none=True)
        ours(ids).logits_BTV.float().logsumexp(-1).mean().backward()

    def step_theirs():
        theirs.zero_grad(set_to_none=True)
        theirs(ids).logits.float().logsumexp(-1).mean().backward()

    tokens = args.batch * args.seq
    n_params = sum(p.numel() for p in ours.parameters())
    # Interleave the two so drift on a shared host hits both alike.
    t_ours, t_theirs = [], []
    for _ in range(3):
        t_ours.append(median_seconds(step_ours, args.repeats, 2, CLOCKS[args.clock]))
        t_theirs.append(median_seconds(step_theirs, args.repeats, 2, CLOCKS[args.clock]))
    to, tt = statistics.median(t_ours), statistics.median(t_theirs)
    print(f"model {preset} ({n_params / 1e6:.1f}M params), batch [{args.batch}, {args.seq}], "
          f"{args.dtype}, torch threads {torch.get_num_threads()}, {args.clock} clock")
    print(f"lockstep     fwd+bwd: {tokens / to:9.0f} tok/s  ({to * 1e3:.1f} ms/step)")
    print(f"transformers fwd+bwd: {tokens / tt:9.0f} tok/s  ({tt * 1e3:.1f} ms/step)")
    print(f"ratio ours/theirs: {tt / to:.2f}x (target >= 1.5x)\n")


if __name__ == "__main__":
    main()
