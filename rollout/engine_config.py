"""`EngineConfig`: the embedded engine's sizing and numerics (rollout/engine.py), checked when
made."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.dtypes import BY_NAME, ENGINE_PRECISIONS, FP8, PRECISIONS
from ..moe.checks import strict_kwargs

DTYPES = {n: BY_NAME[n].torch for n in PRECISIONS}  # our spellings -> torch


@dataclass
class EngineConfig:
    """Engine sizing and numerics."""

    dtype: str = "bf16"
    """Weights, activations and KV cache: bf16, fp16 or fp32; or fp8: bf16 with block-FP8
    matmuls (kernels/dtypes.py FP8)."""
    router_dtype: str | None = None
    """Keep router weights (and their matmul) in this dtype, e.g. fp32; None = dtype."""
    lm_head_dtype: str | None = None
    """Keep the LM head in this dtype, e.g. fp32 (MiniMax-M1's fix); None = dtype."""
    max_running: int = 64
    """KV-cache slots: most sequences decoding at once."""
    max_len: int | None = None
    """Slot length (prompt + generated tokens; max_new_tokens is clamped to fit, as in
    SGLang); None = the model's max_position_embeddings."""
    max_prefill_tokens: int = 8192
    """Padded prompt tokens per prefill forward (a longer single prompt still runs alone)."""
    capture_routes: bool = True
    """Record routed experts (off only to measure its cost)."""
    seed: int = 0
    """Seeds the per-request seeds of requests that do not give one."""
    device: str = "cpu"
    """Where the model, KV cache, sampling and route capture run: "cpu", "cuda", "cuda:N"
    (or "auto": cuda when this process sees a GPU). Results move to the CPU once per
    finished sample."""
    exact: bool = False
    """Batch-invariant kernels (kernels/exact.py, `MoEModel.set_exact`): every token's routes
    and log-probs are bitwise those an exact actor of the same dtype computes, whatever the
    batch, padding or prefill/decode path (docs/precision.md "Exact mode"). Decodes through the
    model's forward (no fused step); logits are fp32."""
    router_noise: float = 0.0
    """Std of the N(0, sigma^2) noise added to every router logit (an injected mismatch,
    rollout/mismatch.py; `set_mismatch` changes it between steps)."""
    logprob_noise: float = 0.0
    """Std (nats) of the noise added to every sampling logit (rollout/mismatch.py)."""

    def __post_init__(self) -> None:
        if self.dtype not in ENGINE_PRECISIONS:
            raise ValueError(f"EngineConfig.dtype must be one of {list(DTYPES)} or {FP8!r} "
                             f"(bf16 with block-FP8 matmuls), got {self.dtype!r}")
        for name in ("router_dtype", "lm_head_dtype"):
            v = getattr(self, name)
            if not (v in DTYPES or v is None):
                raise ValueError(f"EngineConfig.{name} must be one of {list(DTYPES)}, got {v!r}")
        for name in ("max_running", "max_prefill_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {v!r}")
        if self.max_len is not None and not (isinstance(self.max_len, int) and self.max_len >= 2):
            raise ValueError(f"EngineConfig.max_len must be an integer >= 2, got {self.max_len!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(f"EngineConfig.device must be 'auto', 'cpu', 'cuda' or "
                                 f"'cuda:N', got {self.device!r}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        return cls(**strict_kwargs(cls, d, error=ValueError))
