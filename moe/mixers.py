"""Which token mixer (attention kind) and norm each decoder layer runs, from the config.

Every mixer is called as `mixer(x_BTD, cos, sin_signed, cache_rows)` (DSA's also with the
forward's `IndexerReplay`) and returns [B, T, D]; the families differ in what they do inside
(moe/layers.py, moe/gpt_oss.py, moe/gated_attention.py, moe/deltanet.py, moe/dsa.py)."""

from __future__ import annotations

import torch.nn as nn

from .config import ModelConfig
from .deltanet import GatedDeltaNet
from .dsa import DSAttention
from .gated_attention import GatedAttention, OffsetRMSNorm
from .gpt_oss import SinkAttention
from .layers import Attention, MLAttention, RMSNorm


def token_mixer(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The attention module of decoder layer `layer_idx`."""
    if cfg.layer_type(layer_idx) == "linear_attention":
        return GatedDeltaNet(cfg, layer_idx)
    if cfg.is_dsa:
        return DSAttention(cfg, layer_idx)
    if cfg.is_mla:
        return MLAttention(cfg, layer_idx)
    if cfg.attn_output_gate:
        return GatedAttention(cfg, layer_idx)
    if cfg.attention_sinks or cfg.attention_out_bias or \
            cfg.layer_type(layer_idx) == "sliding_attention":
        return SinkAttention(cfg, layer_idx)
    return Attention(cfg, layer_idx)


def layer_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The decoder's RMSNorm: zero-centred (1 + weight) for Qwen3-Next / Qwen3.5."""
    return OffsetRMSNorm(dim, cfg.rms_norm_eps) if cfg.norm_unit_offset else \
        RMSNorm(dim, cfg.rms_norm_eps)
