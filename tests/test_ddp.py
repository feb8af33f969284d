"""The torch actor's data parallelism is torch DDP: two gloo ranks, each updating on its half of
every optimiser step's rows (one step with no rows at all on rank 1, one with two micro-batches
under `no_sync`), end with the weights one process gets on all the rows, and every step's
gradient norm is one process's. R3 replay on, fp32 and bf16 compute (fp32 router and LM head:
the DDP forward casts the master's parameters, the one-process update has its own copy).
Two spawned processes."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig

from test_actor import _batch, _model
from test_host_syncs import count_host_reads

pytestmark = pytest.mark.slow  # two spawned processes (~5 s)

B = 8
OWNER = [0, 0, 0, 0, 1, 1, 1, 1]  # rank of each row
# optimiser steps (rows of the batch): rank 1 has none in the third; three rows (two
# micro-batches of micro_batch_size=2) on rank 1 in the fourth
STEPS = [[0, 1, 4, 5], [2, 3, 6, 7], [0, 2], [1, 3, 5, 6, 7]]
DTYPES = {"fp32": {}, "bf16": dict(dtype="bf16", router_dtype="fp32", lm_head_dtype="fp32")}


def _cfg(dtype: str) -> ActorConfig:
    return ActorConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2, **DTYPES[dtype])


def _loss(batch, adv_B, counts):
    """Token-sum REINFORCE over the global step's token count (`counts[key]`), so the ranks'
    losses add up to the one-process loss."""
    def loss_fn(lp_BT, ent_BT, rows, key):
        mask = batch.response_mask_BT[rows].float()
        loss = -(adv_B[rows, None] * lp_BT * mask).sum() / counts[id(key)]
        return loss, {"actor/pg_loss": loss.detach()}
    return loss_fn


def _run(dtype: str, rank: int | None) -> tuple[dict[str, torch.Tensor], list[float], list[int]]:
    """Train the STEPS in one process (rank None) or as `rank` of the 2-rank world; returns
    the master weights, each step's gradient norm and its host reads (test_host_syncs)."""
    model = _model()
    batch = _batch(model, B=B)
    adv = torch.linspace(-1, 1, B)
    group = None if rank is None else dist.group.WORLD
    actor = TorchActor(model, _cfg(dtype), total_updates=len(STEPS), dp_group=group)
    mine = torch.arange(B) if rank is None else \
        torch.tensor([i for i in range(B) if OWNER[i] == rank])
    local = batch.rows(mine)
    position = {int(g): i for i, g in enumerate(mine)}
    norms, reads = [], []
    for step in STEPS:
        rows = torch.tensor([position[i] for i in step if i in position], dtype=torch.long)
        counts = {id(rows): batch.response_mask_BT[step].sum()}
        with count_host_reads() as n:
            metrics, _, _ = actor.update(local, _loss(local, adv[mine], counts),
                                         local.rollout_routes_BTLK, local.rollout_routes_valid_BT,
                                         steps=[rows], mini_size=len(step))
        norms.append(metrics["actor/grad_norm"])
        reads.append(n["n"])
    return {k: v.detach().clone() for k, v in actor.master.state_dict().items()}, norms, reads


def _worker(rank: int, port: int, dtype: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.save(_run(dtype, rank), f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dp2_through_ddp_equals_one_process(tmp_path, dtype):
    out = str(tmp_path / "dp2")
    mp.start_processes(_worker, args=(_free_port(), dtype, out), nprocs=2, join=True,
                       start_method="spawn")
    (w0, n0, r0), (w1, n1, r1) = (torch.load(f"{out}.rank{r}") for r in range(2))
    one, n_one, r_one = _run(dtype, None)
    assert n0 == n1 and all(torch.equal(w0[k], w1[k]) for k in w0)  # the ranks stay equal
    # DDP adds no host read: a handful per update (one optimiser step each), however many
    # micro-batches (1 or 2 here) or none
    assert max(r0 + r1 + r_one) <= 5, (r0, r1, r_one)
    # the sums differ only in order (two ranks' gradients vs one process's micro-batches)
    assert n0 == pytest.approx(n_one, rel=1e-5), (n0, n_one)
    start = _model().state_dict()
    for k, v in one.items():
        if v.is_floating_point():
            assert torch.allclose(w0[k], v, rtol=1e-5, atol=1e-6), \
                (k, float((w0[k] - v).abs().max()))
    moved = max(float((one[k] - start[k]).abs().max()) for k in one if one[k].is_floating_point())
    assert moved > 1e-2  # the weights moved by more than one lr: the comparison bites
