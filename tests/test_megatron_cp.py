"""Context-parallel slicing (trainer/actor/megatron/context_parallel.py) equals megatron-core's own
`get_batch_on_this_cp_rank` on tokens, labels, masks and routes [B, T, L, K], for 3 row
lengths (one padded by `cp_padded_length`) and CP sizes 2 and 4, on every rank of a real gloo
world of 4 (CP=4: the world; CP=2: two groups of 2); gathering the slices back gives every row
whole. The megatron actor refuses context_parallel > 1 on CPU, naming the reason."""

import multiprocessing
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402 (before the fork)

from lockstep.trainer.actor.megatron.context_parallel import (cp_padded_length,  # noqa: E402
                                                        cp_positions, gather_from_cp,
                                                        place_from_cp, slice_for_cp)

pytestmark = pytest.mark.megatron
LENGTHS = (8, 13, 40)  # 13: padded to a multiple of 2 x CP x TP first


def _batch(T: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(T)
    S = cp_padded_length(T, 4, tp=2)  # every CP size here (2, 4) and TP 1 or 2 splits S
    tokens = torch.nn.functional.pad(torch.randint(1, 100, (2, T), generator=g), (0, S - T))
    return {"tokens": tokens,
            "labels": torch.nn.functional.pad(tokens[:, 1:], (0, 1)),  # sliced, not shifted
            "loss_mask": (torch.arange(S) < T - 1).expand(2, S).clone(),
            "position_ids": torch.arange(S).expand(2, S).clone(),
            "routes": torch.randint(0, 8, (2, S, 3, 2), generator=g, dtype=torch.uint8)}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    bad = []
    for cp, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        r = dist.get_rank(group)
        for T in LENGTHS:
            whole = _batch(T)
            theirs = get_batch_on_this_cp_rank(dict(whole), cp_group=group)
            for key, x in whole.items():
                ours = slice_for_cp(x, cp, r)
                if not torch.equal(ours, theirs[key]):
                    bad.append(f"cp={cp} rank {r} T={T} {key}: sliced differently")
                back = gather_from_cp(ours, x.shape[1], cp, group)
                if not torch.equal(back, x):
                    bad.append(f"cp={cp} rank {r} T={T} {key}: gathered back differently")
    torch.save(bad, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slicing_equals_megatron_cores_on_every_cp_rank(tmp_path):
    import torch.distributed as dist

    # fork: the children reuse this process's imports (megatron-core costs seconds each);
    # spawn where this process already holds a process group the children must not inherit
    ctx = multiprocessing.get_context("spawn" if dist.is_initialized() else "fork")
    out, port = str(tmp_path / "bad"), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    bad = [b for r in range(4) for b in torch.load(f"{out}.{r}")]
    assert bad == []


def test_positions_and_placement():
    # CP=2, T=8: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(2, 8)
    whole = sum(place_from_cp(slice_for_cp(x, 2, r), 8, 2, r) for r in range(2))
    assert torch.equal(whole, x)
    assert cp_padded_length(13, 2) == 16 and cp_padded_length(13, 2, tp=2) == 16
    assert cp_padded_length(17, 2, tp=2) == 24
    with pytest.raises(ValueError, match=r"a row of 13 tokens does not split into 2 x "
                       r"context_parallel=4 equal chunks"):
        cp_positions(13, 2, 0)


def test_context_parallel_is_refused_on_cpu_with_the_reason():
    """The loop's check before any rank starts, and the actor's TransformerConfig, name the
    reason: megatron-core's CPU attention has no context parallelism."""
    from lockstep.moe.checks import ConfigError
    from lockstep.trainer.actor.megatron.model import transformer_config
    from lockstep.trainer.config.load import load_config
    from lockstep.trainer.config.megatron import check_world

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    toy = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"
    cfg = load_config(toy, ["actor.backend=megatron", "cluster.actor_ranks=2",
                            "actor.megatron.context_parallel=2"])
    why = (r"actor\.megatron\.context_parallel=2 on CPU: megatron-core runs context "
           r"parallelism only in Transformer Engine's attention .* local DotProductAttention, "
           r"the CPU path, supports context_parallel_size 1 only")
    with pytest.raises(ConfigError, match=why):
        check_world(cfg)
    with pytest.raises(ConfigError, match=why):
        transformer_config(cfg.model, cfg.actor.megatron)
    with pytest.raises(ConfigError, match=r"tensor_parallel=1 x actor\.megatron\."
                       r"context_parallel=2 x actor\.megatron\.pipeline_parallel=2 does not "
                       r"divide the 2 actor ranks"):
        check_world(load_config(toy, ["actor.backend=megatron", "cluster.actor_ranks=2",
                                               "actor.megatron.context_parallel=2",
                                               "actor.megatron.pipeline_parallel=2"]))
    with pytest.raises(ValueError, match=r"actor\.megatron\.context_parallel=2: the RL loop "
                       r"runs megatron-core in a world of one process"):
        check_world(load_config(toy, ["actor.backend=megatron",
                                               "actor.megatron.context_parallel=2"]))
