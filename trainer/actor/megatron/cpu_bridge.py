"""Run megatron-core (0.16.x) on a CPU-only torch, for tiny models over gloo.

megatron-core assumes CUDA in a handful of places that a tiny MoE GPTModel touches. This
module patches exactly those, and only when `torch.cuda.is_available()` is False: on a GPU
`install()` refuses, so a cluster run always executes megatron-core unchanged. Nothing here
touches routing math or `RouterReplay`; the routes on CPU are megatron-core's own.

Bridged (each patch below names the upstream place and why the replacement is equivalent):
1. `torch.cuda.current_device()` used as a device -> "cpu";
2. the RNG tracker's CUDA generator states -> CPU generator states;
3. the all-to-all dispatcher's side stream / event, and its split sizes for gloo;
4. `te_general_gemm` undefined without Transformer Engine (NameError in 0.16.1 as soon as
   `moe_router_dtype` is set);
5. the torch-norm wrapper's refusal of sequence parallelism (needed for MoE with TP > 1);
6. `device="cuda"` literals in the schedules, optimizer, grad clipping, grad buffers and the
   local multi-tensor helpers;
7. the `'torch.cuda.FloatTensor'` assertion in grad clipping;
8. `torch.cuda.synchronize()` in the variable-shape pipeline p2p;
9. the sliding-window causal mask (gpt-oss's sliding layers) built on "cuda".
`install()` is idempotent; `uninstall()` restores every original (tests use it).

Not bridged (refused elsewhere or not needed on CPU): fused kernels (TE, apex,
permute/rope/router fusion), CUDA graphs, bf16/fp16 mixed-precision optimizers, the default
causal mask built on "cuda" (callers pass an explicit mask), dropout (RL keeps it at 0; on CPU
the tracker's named states swap the one CPU generator, so dropout would be reproducible, but
megatron-core warns that the CPU state changed inside the fork).
"""

from __future__ import annotations

import copy
import types
from typing import Any, Callable

import torch

# (owner object, attribute name) -> original value, for uninstall().
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_MISSING = object()


class CudaPresentError(RuntimeError):
    """install() was called on a machine with CUDA: megatron-core must run unpatched there."""


def is_installed() -> bool:
    return bool(_ORIGINALS)


def install() -> None:
    """Apply every CPU patch (idempotent). Refuses when CUDA is available."""
    if torch.cuda.is_available():
        raise CudaPresentError(
            "lockstep.trainer.actor.megatron.cpu_bridge is for CPU-only runs; CUDA is available, so "
            "megatron-core must run unpatched (do not call install() on a GPU machine)")
    if is_installed():
        return
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # 1. `torch.cuda.current_device()` is used as the device of new tensors all over
    #    megatron-core (router, experts, rotary embedding, all-to-all output buffers). On a
    #    CPU-only torch it raises; CPU is the only device there, so answer "cpu".
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))

    # 2. RNG tracker (`tensor_parallel.random`): named "cuda" RNG states for data-, tensor- and
    #    expert-parallel regions. CPU has one generator, so the states are CPU generator
    #    states: `add` seeds a fresh CPU state, get/set read and write the CPU generator. This
    #    keeps fork() semantics (per-region reproducible streams) without touching CUDA.
    _patch(mc_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mc_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    _patch(mc_random.CudaRNGStatesTracker, "add", _cpu_tracker_add)

    # 3. The all-to-all token dispatcher copies split sizes device->host on a side CUDA stream
    #    and synchronises with an event. On CPU the data is already on the host: no stream is
    #    needed, and the split sizes must be plain numbers for gloo (the GPU path hands
    #    numpy arrays to `all_to_all_single`; a CPU tensor is rejected by gloo).
    _patch(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _NoStream())
    _patch(token_dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize",
           _cpu_dtoh_and_synchronize)

    # 4. megatron-core 0.16.1 only defines `te_general_gemm` when Transformer Engine imports,
    #    but `RouterGatingLinearFunction` (used as soon as `moe_router_dtype` is set) reads it
    #    unconditionally: NameError without TE. None selects its plain torch.mm branch.
    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)

    # 5. The torch-norm wrapper (used when neither TE nor apex is present) refuses
    #    sequence_parallel, which megatron-core requires for MoE with TP > 1. RMSNorm is
    #    per token, so running it on a sequence shard is exact; what SP needs in addition is
    #    that the (replicated) norm weights' grads are summed over the TP group, which
    #    megatron-core does for params tagged `sequence_parallel = True`.
    _patch(torch_norm.WrappedTorchNorm, "__new__", _norm_allowing_sequence_parallel)

    # 6. Training-path modules build small bookkeeping tensors with `device="cuda"` literals
    #    (token counters in the schedules, found-inf / overflow buffers in the optimizer and
    #    grad clipping and the local multi-tensor L2 norm, a warm-up tensor in the grad
    #    buffers). Those modules see a `torch` whose tensor factories build such tensors on the
    #    CPU; everything else is torch itself.
    from megatron.core import utils as mc_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mc_optimizer
    from megatron.core.pipeline_parallel import schedules
    for mod in (schedules, mc_optimizer, clip_grads, param_and_grad_buffer, mc_utils):
        _patch(mod, "torch", _TORCH_CPU_FOR_CUDA)

    # 8. Pipeline p2p with variable shapes (the actor's PP micro-batches may differ in rows)
    #    exchanges shapes first and then calls `torch.cuda.synchronize()` against a NCCL race;
    #    on CPU the requests were already waited on, so the sync is a no-op.
    from megatron.core.pipeline_parallel import p2p_communication
    _patch(p2p_communication, "torch", _TORCH_CPU_NO_CUDA_SYNC)

    # 9. Sliding-window layers (gpt-oss) build their mask in the torch softmax with
    #    `device="cuda"` (transformer/utils.py get_sliding_window_causal_mask, imported by name
    #    into fused_softmax). The same mask on the scores' device (CPU).
    from megatron.core.fusions import fused_softmax
    _patch(fused_softmax, "get_sliding_window_causal_mask", _cpu_sliding_window_mask)

    # 7. Grad clipping asserts every grad is a 'torch.cuda.FloatTensor'. On CPU the same fp32
    #    grads are 'torch.FloatTensor'; scaling them by the clip coefficient is all it does.
    _patch(clip_grads, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32)
    _patch(mc_optimizer, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32)


def uninstall() -> None:
    """Restore every patched attribute (for tests; a normal run never needs it)."""
    for (owner, name), orig in reversed(list(_ORIGINALS.items())):
        if orig is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, orig)
    _ORIGINALS.clear()


# -- patch helpers ------------------------------------------------------------------------------
def _patch(owner: Any, name: str, value: Any) -> None:
    _ORIGINALS[(owner, name)] = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) \
        else getattr(owner, name, _MISSING)
    if isinstance(owner, type) and name == "__new__":
        value = staticmethod(value)
    setattr(owner, name, value)


def _cpu_sliding_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """megatron-core's get_sliding_window_causal_mask on the CPU: True = masked, a query sees
    keys from window_size[0] before it to window_size[1] after it (the last sq of skv keys)."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    visible = torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]),
                         diagonal=skv - sq + window_size[1])
    return ~visible


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    # Same bookkeeping and errors as upstream `CudaRNGStatesTracker.add`.
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


class _NoStream:
    """Placeholder so the dispatcher's `cuda_dtoh_stream is None` check skips torch.cuda.Stream()."""


def _to_host_numbers(x: Any) -> Any:
    return x.numpy() if torch.is_tensor(x) else x


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert: Any = None) -> Any:
    # Mirrors upstream: at the "dtoh point" split sizes become host numbers; there is no
    # stream to wait on, so the "sync point" is a no-op.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _to_host_numbers(self.input_splits)
        self.output_splits = _to_host_numbers(self.output_splits)
        self.output_splits_tp = _to_host_numbers(self.output_splits_tp)
    return tokens_per_expert


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


def _cpu_for_cuda(fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any):
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    return wrapper


class _TorchCpuForCuda(types.ModuleType):
    """`torch`, except that the tensor factories above map device "cuda" to the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_CPU_FOR_CUDA = _TorchCpuForCuda("torch")
for _name in _FACTORIES:
    setattr(_TORCH_CPU_FOR_CUDA, _name, _cpu_for_cuda(getattr(torch, _name)))


class _CudaWithoutSync(types.ModuleType):
    """`torch.cuda`, except that `synchronize()` does nothing (nothing runs asynchronously)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


_TORCH_CPU_NO_CUDA_SYNC = _TorchCpuForCuda("torch")
_TORCH_CPU_NO_CUDA_SYNC.cuda = _CudaWithoutSync("torch.cuda")


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm,
                                      use_decoupled_grad: bool = False) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


def _norm_allowing_sequence_parallel(cls, config, hidden_size: int, eps: float = 1e-5,
                                     **kwargs: Any) -> torch.nn.Module:
    sequence_parallel = config.sequence_parallel
    if sequence_parallel:
        config = copy.copy(config)
        config.sequence_parallel = False
    orig: Callable = _ORIGINALS[(cls, "__new__")]
    norm = orig(cls, config, hidden_size, eps, **kwargs)
    if sequence_parallel:
        for p in norm.parameters():
            p.sequence_parallel = True
    return norm
