"""Qwen3-Next / Qwen3.5-MoE full-attention layers: gated attention and zero-centred RMSNorm
(transformers `qwen3_next`, `qwen3_5_moe` are the reference).

Shape legend (suffixes): B batch, T time, D model width, H query heads, G key/value heads,
Dh head width, M cache length.

- OffsetRMSNorm scales by (1 + weight), weights initialised to 0; it normalises and scales in
  fp32 and rounds once (these families' convention; RMSNorm rounds before scaling).
- GatedAttention: q_proj yields, per head, the query and a gate of Dh each; the attention output
  is multiplied by sigmoid(gate) before o_proj. q/k are OffsetRMSNorm'ed per head, RoPE rotates
  the first head_dim * partial_rotary_factor dims (0.25 in the released configs), and
  attention_bias gives q, k, v and o biases.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .layers import Attention, CacheRows, apply_partial_rope, attention, linear


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    @torch.no_grad()
    def reset_family_parameters(self) -> None:
        self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(),
                          self.eps).to(x.dtype)


class GatedAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        H, Dh, D, bias = self.num_heads, self.head_dim, cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(D, H * Dh * 2, bias=bias)  # per head: query | gate
        self.o_proj = nn.Linear(H * Dh, D, bias=bias)
        self.q_norm = OffsetRMSNorm(Dh, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(Dh, cfg.rms_norm_eps)

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None):
        B, T, _ = x_BTD.shape
        Dh = self.head_dim
        q, gate = linear(x_BTD, self.q_proj.weight, self.q_proj.bias).view(B, T, -1, 2 * Dh) \
            .chunk(2, dim=-1)
        k = linear(x_BTD, self.k_proj.weight, self.k_proj.bias).view(B, T, -1, Dh)
        v = linear(x_BTD, self.v_proj.weight, self.v_proj.bias).view(B, T, -1, Dh)
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin_signed), apply_partial_rope(k, cos, sin_signed)
        if cache_rows is None:
            o = attention(q, k, v)
        else:
            keys, values = cache_rows.write_and_read(self.layer_idx, k, v)
            o = attention(q, keys, values, cache_rows.mask_B1TM)
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return linear(o, self.o_proj.weight, self.o_proj.bias)
