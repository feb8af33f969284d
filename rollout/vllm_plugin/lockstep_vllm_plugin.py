"""lockstep's vLLM general plugin: put this folder on a vLLM server's PYTHONPATH (rollout/vllm.py
does) and vLLM loads it through the `vllm.general_plugins` entry point of the dist-info beside
it. It imports nothing of lockstep (vLLM's venv does not have it): only torch and vLLM.

It does two things in every vLLM process (three for the servers lockstep launches to die with
their Ray actor: `EXIT_WITH_PARENT`):

1. Registers the weight-transfer backend `lockstep_gloo` (`--weight-transfer-config
   '{"backend": "lockstep_gloo"}'`): vLLM's dense NCCL transport with gloo in its place, for
   CPU servers (every built-in transport needs a GPU). Same four phases, same fields:
   init_info `{master_address, master_port, rank_offset, world_size, group_name}`; the
   trainer is rank 0 and worker w of the server joins as `rank_offset + w`, over a TCP store
   at master_address:master_port with the key layout of lockstep's `WeightGroup`
   (rollout/weight_group.py). Per `/update_weights` call, update_info `{names, dtype_names,
   shapes, packed}`: with `packed` (the default) one uint8 broadcast of the tensors' bytes
   concatenated in list order (lockstep's flattened bucket), else one broadcast per tensor.
   Nothing touches the disk. Received tensors go through the model's `load_weights` inside
   vLLM's layerwise reload (start ... finish), as the NCCL backend does.

2. On a CPU platform, works around a vLLM 0.32 bug: after a weight update or
   `reload_weights`, `UnquantizedFusedMoEMethod._setup_kernel` copies the new expert weights
   into their parameters but skips the CPU experts' `process_weights_after_loading` (their
   grouped-GEMM prepack), so the MoE kernel reads unpacked weights and serves wrong outputs,
   silently. The wrapper below re-runs that prepack on updates. `LOCKSTEP_VLLM_MOE_REPACK=0`
   turns the workaround off (the test that shows the bug needs it off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

BACKEND = "lockstep_gloo"
EXIT_WITH_PARENT = "LOCKSTEP_VLLM_EXIT_WITH_PARENT"
"""Set by lockstep for the servers it launches to die with their Ray actor: every process of
the server (API server, EngineCore, workers) then ends when its parent does (`_exit_with_parent`).
Without it, a killed API server leaves its EngineCore and workers running (and holding their
memory) for good: vLLM 0.32's EngineCore does not notice its parent's death."""


def _exit_with_parent() -> None:
    """A daemon thread that kills this process once its parent has died (it is then the child of
    another process: init, or a subreaper). Polled twice a second: no signal reaches a
    grandchild, and the thread that spawned a process may not be the one that lives longest,
    so the kernel's parent-death signal would not do."""
    import signal
    import threading
    import time
    if getattr(_exit_with_parent, "started", False):
        return
    _exit_with_parent.started = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="lockstep-exit-with-parent", daemon=True).start()


def register() -> None:
    """vLLM calls this in each of its processes, possibly more than once."""
    if os.environ.get(EXIT_WITH_PARENT) == "1":
        _exit_with_parent()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.platforms import current_platform
    if current_platform.is_cpu() and os.environ.get("LOCKSTEP_VLLM_MOE_REPACK", "1") != "0":
        _repack_cpu_experts_on_update()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _gloo_engine())


def _repack_cpu_experts_on_update() -> None:
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m
    method = m.UnquantizedFusedMoEMethod
    if getattr(method._setup_kernel, "lockstep_repack", False):
        return
    setup = method._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None  # vLLM's own test for "a weight update"
        setup(self, layer, w13, w2)
        if update:  # the prepack the first load ran (vLLM skips it on updates)
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)
    _setup_kernel.lockstep_repack = True
    method._setup_kernel = _setup_kernel


def _gloo_engine():
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                       WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass(kw_only=True)
    class GlooInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        group_name: str = "weight_update_group"
        timeout_s: float = 600.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        packed: bool = True

        def __post_init__(self):
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError(f"names, dtype_names and shapes differ in length: "
                                 f"{len(self.names)}, {len(self.dtype_names)}, "
                                 f"{len(self.shapes)}")
            for name, dt in zip(self.names, self.dtype_names):
                if not isinstance(getattr(torch, dt, None), torch.dtype):
                    raise ValueError(f"tensor {name!r}: unknown dtype {dt!r}")

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        """vLLM's dense NCCL transport over a gloo group (module docstring)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pg = None
            self.store = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            pc = self.parallel_config
            rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
            if not 0 < rank < init_info.world_size:
                raise ValueError(f"worker rank {rank} (rank_offset {init_info.rank_offset}) "
                                 f"is outside a group of world_size {init_info.world_size} "
                                 f"whose rank 0 is the trainer")
            self.shutdown()
            timeout = timedelta(seconds=init_info.timeout_s)
            name = init_info.group_name
            self.store = TCPStore(init_info.master_address, init_info.master_port,
                                  init_info.world_size, False, timeout)
            store = PrefixStore("cpu/", PrefixStore(f"{name}/", PrefixStore(name, self.store)))
            self.pg = dist.ProcessGroupGloo(store, rank, init_info.world_size, timeout)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info) -> None:  # CPU: nothing to synchronise
            self.receive_weights(self.parse_update_info(update_info))

        def _broadcast(self, t: torch.Tensor) -> None:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            self.pg.broadcast([t], opts).wait()

        def receive_weights(self, info: GlooUpdateInfo) -> None:
            if self.pg is None:
                raise RuntimeError(f"{BACKEND}: call init_weight_transfer_engine first")
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check)
            metas = [(n, getattr(torch, d), torch.Size(s))
                     for n, d, s in zip(info.names, info.dtype_names, info.shapes)]
            if info.packed:
                sizes = [s.numel() * torch.empty((), dtype=d).element_size() for _, d, s in metas]
                flat = torch.empty(sum(sizes), dtype=torch.uint8)
                self._broadcast(flat)
                tensors, at = [], 0
                for (name, dt, shape), n in zip(metas, sizes):
                    part = flat[at:at + n]
                    if at % dt.itemsize:  # a view needs an aligned offset
                        part = part.clone()
                    tensors.append((name, part.view(dt).view(shape)))
                    at += n
            else:
                tensors = []
                for name, dt, shape in metas:
                    t = torch.empty(shape, dtype=dt)
                    self._broadcast(t)
                    tensors.append((name, t))
            with disable_mtp_completeness_check():
                self.model.load_weights(tensors)

        def shutdown(self) -> None:
            if self.pg is not None:
                try:
                    self.pg.shutdown()
                except Exception:  # already broken: nothing left to free
                    pass
            self.pg = self.store = None

    return GlooWeightTransferEngine
