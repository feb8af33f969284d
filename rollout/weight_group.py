"""The weight-update process group: the trainer (rank 0) and every engine rank, joined outside
any default torch.distributed world.

Wire-compatible with SGLang's `init_custom_process_group` (what `/init_weights_update_group`
runs on each of its TP ranks): a TCP store hosted by rank 0 at `master_address:master_port`,
keys under the prefixes `<group_name>`, `<group_name>/` and `<device>/` (the chain torch's
`new_group` helper builds), then a gloo (CPU) or NCCL (CUDA) backend on that store. The
backend object is built directly instead of through torch's process-group registry, so a
process may hold several such groups (and its own default world) and two groups of the same
name may live in one process (a trainer and a server thread in one test).

Every operation is bounded by `timeout_s` (the store, the connect, each collective): a peer
that dies or hangs gives an error, never a hang.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore


BACKENDS = ("gloo", "nccl")
DEVICE_OF = {"gloo": "cpu", "nccl": "cuda"}


class WeightGroup:
    """One member of a weight-update group (`rank` of `world_size`)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str = "gloo", timeout_s: float = 600.0):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; valid: {list(BACKENDS)}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, and this process has no GPU: use "
                             "backend='gloo'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
        self.rank, self.world_size, self.name, self.backend = rank, world_size, group_name, backend
        self.device = DEVICE_OF[backend]
        timeout = timedelta(seconds=timeout_s)
        # Rank 0 hosts the store and waits for every other rank to connect (bounded).
        self._store = TCPStore(master_address, master_port, world_size, rank == 0, timeout,
                               multi_tenant=True)
        store = PrefixStore(f"{self.device}/",
                            PrefixStore(f"{group_name}/", PrefixStore(group_name, self._store)))
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:  # pragma: no cover - needs a GPU
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` in place from rank 0 (blocks until every rank has it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([tensor], opts).wait()
        if self.backend == "nccl":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()

    def close(self) -> None:
        try:
            if self.pg is not None:
                self.pg.shutdown()
        except Exception:  # already broken: nothing left to free
            pass
        self.pg = None
        self._store = None
