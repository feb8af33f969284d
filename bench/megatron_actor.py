"""Cost of the megatron backend on CPU: MegatronActor vs TorchActor (baseline, same run) on
the same weights and batch, for R3 old log-probs and one update (one optimiser step).

On CPU this measures framework overhead (megatron-core's dispatcher, schedule, DDP buffers,
replay adapter), not kernels: the megatron backend exists for GPU clusters. Medians of repeats.
    OMP_NUM_THREADS=1 python bench/megatron_actor.py [--batch 32] [--seq 48] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy

import torch

from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.actor.megatron.actor import MegatronActor
from timing import median_seconds




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, intermediate_size=192,
                      moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2)
    model = MoEModel(cfg)
    B, T, L, K = args.batch, args.seq, cfg.num_moe_layers, cfg.num_experts_per_tok
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    lens = torch.full((B,), T)
    resp = torch.arange(T)[None].expand(B, T) >= T // 3
    valid = torch.arange(T)[None].expand(B, T) < T - 1
    routes = torch.rand(B, T, L, cfg.num_experts).argsort(-1)[..., :K].to(torch.uint8)
    batch = Batch(ids, resp, torch.zeros(B, T), lens, routes, valid)
    acfg = ActorConfig(lr=1e-4, mini_batch_size=B, micro_batch_size=B // 2)
    mask = resp.float()

    def loss_fn(lp, ent, rows, mini):
        return -(lp * mask[rows]).sum() / mask[mini].sum(), {}

    rows = []
    for name, cls in (("torch", TorchActor), ("megatron", MegatronActor)):
        actor = cls(copy.deepcopy(model), acfg, total_updates=100)
        lp = median_seconds(lambda: actor.logprobs(batch, routes, valid), args.repeats, 1)
        up = median_seconds(lambda: actor.update(batch, loss_fn, routes, valid), args.repeats, 1)
        rows.append((name, lp, up))
    base = rows[0]
    tokens = B * T
    print(f"batch {B} x {T} tokens, {sum(p.numel() for p in model.parameters())} params, "
          f"R3 replay, medians of {args.repeats}")
    print(f"{'backend':10s} {'logprobs s':>11s} {'tok/s':>9s} {'ratio':>6s} "
          f"{'update s':>9s} {'tok/s':>9s} {'ratio':>6s}")
    for name, lp, up in rows:
        print(f"{name:10s} {lp:11.4f} {tokens / lp:9.0f} {lp / base[1]:6.2f} "
              f"{up:9.4f} {tokens / up:9.0f} {up / base[2]:6.2f}")


if __name__ == "__main__":
    main()
