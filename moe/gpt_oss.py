"""gpt-oss's building blocks: attention with per-head sinks and sliding windows, and experts
with biases and the clamped SwiGLU (transformers `gpt_oss` is the reference; docs/model.md).

Shape legend (suffixes): B batch, T time, M keys (cache length), H query heads, G key/value
heads, Dh head width, D model width, N tokens, X sorted (token, k) rows, E experts, I expert
width.

- Sinks: each head has a learned logit s_h that joins every query's softmax as one more "key"
  without a value: p = softmax([q.k_0, ..., q.k_M, s_h])[:M], so a head may attend to nothing.
- Sliding window: a sliding_attention layer's query at position p sees keys p-W+1 .. p.
- Experts are stored as transformers stores them (`gate_up_proj` [E, D, 2I] with gate and up
  interleaved on the last axis, `down_proj` [E, I, D], plus biases), so the HF state dict is
  the parameters themselves. act(g, u) = (clamp(u, -l, l) + 1) * g' * sigmoid(alpha * g'),
  g' = clamp(g, max=l).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import ModelConfig
from .layers import (Attention, CacheRows, _emulated_on_cpu, apply_partial_rope, grouped_linear,
                     linear)


def key_mask(query_pos_BT: torch.Tensor | None, T: int, M: int, window: int | None,
             device) -> torch.Tensor:
    """bool [B|1, 1, T, M]: key m is visible to query t (causal by position, and within the
    window when given). Without positions (no cache) queries and keys are indices 0..T-1."""
    key_M = torch.arange(M, device=device)
    q_BT = torch.arange(T, device=device)[None] if query_pos_BT is None else query_pos_BT
    visible = key_M <= q_BT[..., None]
    if window is not None:
        visible = visible & (key_M > q_BT[..., None] - window)
    return visible[:, None]


def sink_attention(q_BHTD, k_BGMD, v_BGMD, visible_B1TM, sinks_H, scale: float | None = None):
    """Softmax attention whose normaliser includes exp(sink_h) per head; `visible` masks keys.
    Low precision on CPU runs in fp32, as moe/layers.py attention() does."""
    if _emulated_on_cpu(q_BHTD):
        out = sink_attention(q_BHTD.float(), k_BGMD.float(), v_BGMD.float(), visible_B1TM,
                             sinks_H.float(), scale)
        return out.to(q_BHTD.dtype)
    B, H, T, Dh = q_BHTD.shape
    rep = H // k_BGMD.shape[1]
    k, v = k_BGMD.repeat_interleave(rep, dim=1), v_BGMD.repeat_interleave(rep, dim=1)
    scale = Dh ** -0.5 if scale is None else scale
    s_BHTM = (q_BHTD @ k.transpose(-1, -2)) * scale
    s_BHTM = s_BHTM.masked_fill(~visible_B1TM, float("-inf"))
    sink = sinks_H.to(s_BHTM.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    logits = torch.cat([s_BHTM, sink], dim=-1)
    p = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return p.to(v.dtype) @ v


class SinkAttention(Attention):
    """GQA with q/k/v/o biases, attention sinks and (sliding_attention layers) a window."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        if cfg.attention_out_bias:
            self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None
        self.window = cfg.sliding_window if cfg.layer_type(layer_idx) == "sliding_attention" \
            else None

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None):
        B, T, _ = x_BTD.shape
        Dh = self.head_dim
        q = linear(x_BTD, self.q_proj.weight, self.q_proj.bias).view(B, T, -1, Dh)
        k = linear(x_BTD, self.k_proj.weight, self.k_proj.bias).view(B, T, -1, Dh)
        v = linear(x_BTD, self.v_proj.weight, self.v_proj.bias).view(B, T, -1, Dh)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin_signed), apply_partial_rope(k, cos, sin_signed)
        if cache_rows is None:
            visible = key_mask(None, T, T, self.window, x_BTD.device)
        else:
            k, v = cache_rows.write_and_read(self.layer_idx, k, v)  # (B, G, M, Dh)
            visible = key_mask(cache_rows.positions_BT, T, k.shape[2], self.window,
                               x_BTD.device)
        if self.sinks is None:
            sinks = torch.full((self.num_heads,), float("-inf"), device=x_BTD.device)
        else:
            sinks = self.sinks
        o = sink_attention(q, k, v, visible, sinks)
        return linear(o.transpose(1, 2).reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias)


class GptOssExperts(nn.Module):
    """E experts with biases and the clamped SwiGLU, in transformers' stored layout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, D, 2 * I))  # gate, up interleaved
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, D))
        self.limit, self.alpha = float(cfg.swiglu_limit), float(cfg.swiglu_alpha)

    def forward(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, gates_NK: torch.Tensor):
        N, K = ids_NK.shape
        flat_ids = ids_NK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // K
        expert_of = flat_ids.index_select(0, order)  # expert of each sorted row
        offs_E = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).cumsum(0)
        offs_E = offs_E.to(torch.int32)
        x_XD = x_ND.index_select(0, token_of)
        # grouped_linear multiplies by w.T per expert: hand it the [E, O, D] view of [E, D, O]
        gu = grouped_linear(x_XD, self.gate_up_proj.transpose(1, 2), offs_E)
        gu = gu + self.gate_up_proj_bias.index_select(0, expert_of).to(gu.dtype)
        g, u = gu[..., 0::2], gu[..., 1::2]
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        h = (u + 1) * (g * torch.sigmoid(g * self.alpha))
        y = grouped_linear(h, self.down_proj.transpose(1, 2), offs_E)
        y = y + self.down_proj_bias.index_select(0, expert_of).to(y.dtype)
        y = y * gates_NK.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x_ND).index_add_(0, token_of, y)

