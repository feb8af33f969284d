"""The one dtype table: torch dtype, our config spelling, the HF/SGLang/megatron spelling, bytes.

Configs, the CLI and the embedded engine say "bf16"/"fp16"/"fp32" (`name`); HF config.json,
SGLang's wire and launcher, and megatron-core's `params_dtype` say "bfloat16"/"float16"/
"float32" (`hf`, the torch attribute name). Every module that maps one to another reads it here.
float64 and the fp8 dtypes are only wire dtypes (SGLang accepts such tensors in a weight push),
not model precisions.
The table itself needs no torch import (`lockstep serve` and the SGLang launcher start without
torch); `DType.torch` imports it on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str
    """Our spelling (configs, `lockstep serve --dtype`)."""
    hf: str
    """HF/SGLang/megatron spelling: the torch attribute name."""
    bytes: int
    precision: bool
    """A model precision a config may choose (float64 is wire-only)."""

    @property
    def torch(self) -> torch.dtype:
        import torch
        return getattr(torch, self.hf)


DTYPES = (
    DType("bf16", "bfloat16", 2, True),
    DType("fp16", "float16", 2, True),
    DType("fp32", "float32", 4, True),
    DType("fp64", "float64", 8, False),
    DType("fp8_e4m3", "float8_e4m3fn", 1, False),
    DType("fp8_e5m2", "float8_e5m2", 1, False),
)
PRECISIONS = tuple(d.name for d in DTYPES if d.precision)
"""Our spellings a config or the CLI accepts, in table order: ("bf16", "fp16", "fp32")."""
HF_PRECISIONS = tuple(d.hf for d in DTYPES if d.precision)
"""The same precisions in HF/SGLang/megatron spelling: ("bfloat16", "float16", "float32")."""
FP8 = "fp8"
"""A rollout-engine precision, not a torch dtype: bf16 weights, activations and KV cache with
every attention, MLP and expert matmul in block FP8 (kernels/fp8.py: e4m3 weights in 128x128
blocks, activations in 1x128 groups, the DeepSeek-V3/SGLang recipe); routers, embeddings and
the LM head stay bf16 (or router_dtype / lm_head_dtype)."""
FP8_BASE = "bf16"
"""The precision an fp8 engine holds and computes everything else in."""
ENGINE_PRECISIONS = PRECISIONS + (FP8,)
"""What `rollout.dtype` and `lockstep serve --dtype` accept."""


def base_precision(name: str) -> str:
    """The torch precision behind an engine precision: "fp8" -> "bf16", others unchanged."""
    return FP8_BASE if name == FP8 else name


BY_NAME = {d.name: d for d in DTYPES}
BY_HF = {d.hf: d for d in DTYPES}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of our spelling ("bf16") or the HF one ("bfloat16")."""
    d = BY_NAME.get(name) or BY_HF.get(name)
    if d is None:
        raise ValueError(f"unknown dtype {name!r}; valid: {list(BY_NAME)} or {list(BY_HF)}")
    return d.torch


def hf_name(name: str) -> str:
    """HF/SGLang/megatron spelling of our spelling: "bf16" -> "bfloat16"."""
    return BY_NAME[name].hf
