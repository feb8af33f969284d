"""The decoding cache of every family: the per-layer KV cache (moe/layers.py KVCache) plus, where
the family has them, the recurrent states of linear-attention layers and the lightning
indexer's key cache.

Shape legend: L layers of the kind, S slots, M slot length, C conv channels, W conv kernel,
H value heads, Dk / Dv key / value widths, Di indexer key width.

- Gated DeltaNet layers (Qwen3-Next, Qwen3.5) keep, per slot, the last W-1 inputs of their
  convolution (compute dtype) and the delta-rule state [H, Dk, Dv] (fp32, as FLA keeps it):
  a fixed size whatever the sequence length. They also hold (unused) KV rows: the KV tensors
  span every decoder layer, which keeps one layer index for all of them.
- DSA layers (DeepSeek-V3.2, GLM-5) keep their indexer keys [M, Di] per slot beside the KV.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .layers import KVCache


class ModelCache(KVCache):
    def __init__(self, k, v, conv_LSCW=None, state_LSHKV=None, index_k_LSMD=None):
        super().__init__(k, v)
        self.conv = conv_LSCW
        self.state = state_LSHKV
        self.index_k = index_k_LSMD

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, max_len: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        kv = KVCache.allocate(cfg, num_slots, max_len, dtype, device)
        conv = state = index_k = None
        L = len(cfg.linear_layer_ids)
        if L:
            C = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
                cfg.linear_num_value_heads * cfg.linear_value_head_dim
            conv = torch.zeros(L, num_slots, C, cfg.linear_conv_kernel_dim - 1, dtype=dtype,
                               device=device)
            state = torch.zeros(L, num_slots, cfg.linear_num_value_heads,
                                cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                dtype=torch.float32, device=device)
        if cfg.is_dsa:
            index_k = torch.zeros(cfg.num_indexer_layers, num_slots, max_len, cfg.index_head_dim,
                                  dtype=dtype, device=device)
        return cls(kv.k, kv.v, conv, state, index_k)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Share a prefilled prompt (and the states after it) with slot dst."""
        super().copy_slot(src, dst, length)
        if self.conv is not None:
            self.conv[:, dst] = self.conv[:, src]
            self.state[:, dst] = self.state[:, src]
        if self.index_k is not None:
            self.index_k[:, dst, :length] = self.index_k[:, src, :length]

    # -- the lightning indexer -------------------------------------------------------------
    def index_keys(self, layer: int, rows, keys_BTD: torch.Tensor) -> torch.Tensor:
        """Store this forward's indexer keys at the rows' positions (`rows`: a CacheRows), return
        all keys 0..length-1 of the rows' slots [B, M, Di]."""
        ck = self.index_k[layer]                                        # [S, M, Di]
        ck[rows.slots_B[:, None], rows.positions_BT] = keys_BTD.to(ck.dtype)
        return ck[:, :rows.length].index_select(0, rows.slots_B)

    # -- linear attention ------------------------------------------------------------------
    def linear_states(self, layer: int, slots_B: torch.Tensor, continuing_B: torch.Tensor):
        """(conv [B, C, W-1], state [B, H, Dk, Dv]) of the rows' slots; zeros for rows that
        start a sequence (continuing False)."""
        conv = self.conv[layer].index_select(0, slots_B)
        state = self.state[layer].index_select(0, slots_B)
        return (torch.where(continuing_B[:, None, None], conv, 0),
                torch.where(continuing_B[:, None, None, None], state, 0))

    def store_linear_states(self, layer: int, slots_B: torch.Tensor, conv_BCW: torch.Tensor,
                            state_BHKV: torch.Tensor) -> None:
        self.conv[layer, slots_B] = conv_BCW.to(self.conv.dtype)
        self.state[layer, slots_B] = state_BHKV.to(self.state.dtype)


def allocate_cache(cfg: ModelConfig, num_slots: int, max_len: int,
                   dtype: torch.dtype = torch.bfloat16,
                   device: str | torch.device = "cpu") -> KVCache:
    """The cache `cfg`'s layers need: a plain KVCache, or a ModelCache with linear-attention
    states and indexer keys."""
    if cfg.linear_layer_ids or cfg.is_dsa:
        return ModelCache.allocate(cfg, num_slots, max_len, dtype, device)
    return KVCache.allocate(cfg, num_slots, max_len, dtype, device)
