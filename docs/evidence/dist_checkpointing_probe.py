"""Probe (not a test): megatron-core 0.16.1 `dist_checkpointing` on CPU with gloo, 2 processes.

Saves the megatron actor's GPTModel + optimizer (`sharded_state_dict`, `torch_dist` with
`FullyParallelSaveStrategyWrapper`) under TP=2 after one optimiser step, then loads it under
the layout given as JSON MegatronOptions kwargs and compares Adam's exp_avg (HF names):

    OMP_NUM_THREADS=1 python docs/evidence/dist_checkpointing_probe.py /tmp/dc '{}'   # DP=2
    OMP_NUM_THREADS=1 python docs/evidence/dist_checkpointing_probe.py /tmp/dc '{"expert_parallel": 2}'

Needs `psutil` and the `torch.cuda.synchronize` no-op below (filesystem_async.preload_tensors
calls it). Seen 2026-11-30: DP=2 loads with exp_avg max diff 0.0; EP=2 fails with
`KeyError: "chained_0.optimizer.state.exp_avg... from model not in state dict"` (EP makes the
optimizer a ChainedOptimizer, whose keys differ). docs/cluster.md "Checkpoints and resume".
"""
import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def _cfg():
    from lockstep.moe.config import ModelConfig
    return ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


def _build(kw, c):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from lockstep.trainer.actor.megatron.actor import ddp_config
    from lockstep.trainer.actor.megatron.model import (build_gpt_model, initialize_parallel,
                                                       transformer_config)
    from lockstep.trainer.config.megatron import MegatronOptions
    opts = MegatronOptions(**kw)
    initialize_parallel(opts)
    tc = transformer_config(c, opts)
    gpt = build_gpt_model(c, opts, tc=tc)
    ddp = DistributedDataParallel(config=tc, module=gpt, ddp_config=ddp_config())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0,
                                                 params_dtype=torch.float32), [ddp])
    return gpt, opt


def _exp_avg(gpt, opt, c):
    from lockstep.trainer.actor.megatron import convert
    states = {p: s for o in getattr(opt, "chained_optimizers", [opt])
              for p, s in o.optimizer.state.items()}
    return convert.megatron_to_hf_state_dict(
        gpt, c, {n: states[p]["exp_avg"] for n, p in gpt.named_parameters()})


def _worker(rank, port, folder, load_kw):
    torch.set_num_threads(1)
    torch.cuda.synchronize = lambda *a, **k: None  # CPU bridge for filesystem_async
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import \
        FullyParallelSaveStrategyWrapper

    from lockstep.moe.checkpoint import hf_state_dict
    from lockstep.moe.model import MoEModel
    from lockstep.trainer.actor.megatron import convert
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    c = _cfg()
    torch.manual_seed(0)
    hf = {k: v.detach().clone() for k, v in hf_state_dict(MoEModel(c)).items()}
    gpt, opt = _build({"tensor_parallel": 2}, c)
    convert.load_hf_into_megatron(gpt, hf, c)
    for p in gpt.parameters():
        p.main_grad.copy_(torch.randn_like(p) * 0.01)
    opt.step()
    msd = gpt.sharded_state_dict()
    dc.save({"model": msd, "optimizer": opt.sharded_state_dict(msd)}, folder,
            sharded_strategy=FullyParallelSaveStrategyWrapper(
                get_default_save_sharded_strategy("torch_dist")))
    want = _exp_avg(gpt, opt, c)
    gpt2, opt2 = _build(load_kw, c)
    msd2 = gpt2.sharded_state_dict()
    loaded = dc.load({"model": msd2, "optimizer": opt2.sharded_state_dict(msd2, is_loading=True)},
                     folder)
    gpt2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    got = _exp_avg(gpt2, opt2, c)
    print(rank, load_kw, "exp_avg max diff after load:",
          max(float((got[k] - want[k]).abs().max()) for k in want), flush=True)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(sys.argv[1], exist_ok=True)
    mp.spawn(_worker, args=(port, sys.argv[1], json.loads(sys.argv[2])), nprocs=2)
