"""A megatron rank built from an HF folder (`MegatronActor(LazyHF(folder), ...)`) reads only its
shard: under EP=2 its experts, under PP=2 its stage's layers, under TP=2 its half of every split
tensor; the bytes it reads are exactly those, and the weights it holds equal the folder's
(exported across the ranks and compared bit for bit). Two spawned processes, gloo."""

import socket

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from lockstep.moe.checkpoint import save_hf  # noqa: E402
from lockstep.moe.config import ModelConfig  # noqa: E402
from lockstep.moe.hf_lazy import LazyHF  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402

from test_hf_lazy import fused_folder  # noqa: E402

# Two spawned processes each import megatron-core (~10 s CPU each).
pytestmark = [pytest.mark.megatron, pytest.mark.slow]

LAYOUTS = {"ep2": dict(expert_parallel=2), "pp2": dict(pipeline_parallel=2),
           "tp2": dict(tensor_parallel=2)}  # TP=2: experts split over ETP = TP = 2 too


def _cfg() -> ModelConfig:  # 4 layers (PP=2: two per stage), layer 1 dense, 4 experts
    return ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       mlp_only_layers=[1])


def _worker(rank: int, port: int, folders: dict, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lockstep.trainer.config.sections import ActorConfig
    from lockstep.trainer.actor.megatron.actor import MegatronActor
    from lockstep.trainer.config.megatron import MegatronOptions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    got = {}
    for layout, kw in LAYOUTS.items():
        hf = LazyHF(folders[layout])
        actor = MegatronActor(hf, ActorConfig(), total_updates=1,
                              options=MegatronOptions(**kw), model_cfg=_cfg())
        exported = {k: v.clone() for b in actor.export_weights(1 << 14) for k, v in b}
        got[layout] = dict(bytes_read=hf.bytes_read, exported=exported)
        del actor
    torch.save(got, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expected_bytes(hf: LazyHF, layout: str, rank: int) -> int:
    """What rank `rank` of `layout` must read of the folder, tensor by tensor."""
    cfg, total = _cfg(), 0
    per_rank = cfg.num_experts // 2
    for k in hf:
        n = hf.nbytes(k)
        parts = k.split(".")
        layer = int(parts[2]) if k.startswith("model.layers.") else None
        if layout == "ep2":
            if ".experts." in k and int(parts[5]) // per_rank != rank:
                continue
        elif layout == "pp2":  # stage 0: embedding + layers 0, 1; stage 1: layers 2, 3 + head
            stage = (layer // 2) if layer is not None else (0 if "embed" in k else 1)
            if stage != rank:
                continue
        else:  # tp2: norms and routers replicated, everything else split in two
            replicated = k.endswith("norm.weight") or k.endswith("mlp.gate.weight")
            n = n if replicated else n // 2
        total += n
    return total


def test_megatron_ranks_read_only_their_shard(tmp_path):
    cfg = _cfg()
    torch.manual_seed(0)
    model = MoEModel(cfg)
    folders = {"ep2": str(fused_folder(model, tmp_path / "fused")),  # stacked experts, 2 files
               "pp2": str(save_hf(model, tmp_path / "sharded", max_shard_bytes=30_000)),
               "tp2": str(save_hf(model, tmp_path / "single"))}
    out = str(tmp_path / "got")
    mp.start_processes(_worker, args=(_free_port(), folders, out), nprocs=2, join=True,
                       start_method="spawn")
    got = [torch.load(f"{out}.rank{r}") for r in range(2)]
    for layout, folder in folders.items():
        hf = LazyHF(folder)
        whole = sum(hf.nbytes(k) for k in hf)
        experts = sum(hf.nbytes(k) for k in hf if ".experts." in k)
        for r in range(2):
            read = got[r][layout]["bytes_read"]
            assert read == _expected_bytes(hf, layout, r), (layout, r, read)
            exported = got[r][layout]["exported"]
            assert set(exported) == set(hf)
            for k in hf:  # the weights the ranks hold are the folder's, bit for bit
                assert torch.equal(exported[k], hf[k]), (layout, k)
        if layout == "ep2":  # each rank: half the experts plus everything else
            assert got[0][layout]["bytes_read"] == whole - experts // 2
        else:
            assert got[0][layout]["bytes_read"] < 0.6 * whole
