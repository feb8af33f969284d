"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA whose keys a lightning indexer picks
per query, and the replay of that pick (transformers `deepseek_v32`, `glm_moe_dsa` are the
reference; docs/model.md "DeepSeek sparse attention", docs/replay.md "Indexer replay").

Shape legend (suffixes): B batch, T time, M keys (cache length), D model width, Q q_lora_rank,
Hi indexer heads, Di indexer width, R rotary dims (qk_rope_head_dim), K index_topk, L indexer
layers (the decoder layers that run their own indexer, in order).

The indexer scores key m for query t as  sum_h w_h(x_t) * relu(q_h(x_t) . k(x_m) / sqrt(Di)),
q from the compressed query (q_resid = q_a_layernorm(q_a_proj(x))), k = LayerNorm(wk(x)) shared
by all heads, w = weights_proj(x) / sqrt(Hi); the first R dims of q and k are rotated (RoPE
half-split for DeepSeek-V3.2, interleaved pairs for GLM-5: `indexer_rope_interleave`). Query t
attends to the K causal keys of highest score (all of them while t < K). The pick is discrete,
as expert routing is, and it is computed without gradient (as transformers does; the indexer's
own training loss is not part of RL). GLM-5's `shared` layers reuse the previous full layer's
pick.

Picks are request-local positions: row t of a sample lists the key positions (in its own
sequence, 0..t) that the token at position t attended to, ascending, -1 padded to K (rows
t < K - 1 hold t + 1 positions). A given pick (`IndexerReplay`) replaces the indexer's at the
rows its mask marks; the indexer still runs, so the natural pick is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .layers import (CacheRows, MLAttention, apply_rope, apply_rope_interleaved, attention,
                     linear)


def picks_from_scores(scores_BTM: torch.Tensor, visible_BTM: torch.Tensor, k: int):
    """int64 [B, T, K]: the k visible keys of highest score per query, ascending, -1 padded
    (fewer than k visible keys: all of them). Ties go to torch.topk's order."""
    M = scores_BTM.shape[-1]
    kk = min(k, M)
    top = scores_BTM.masked_fill(~visible_BTM, float("-inf")).topk(kk, dim=-1).indices
    top = torch.where(visible_BTM.gather(-1, top), top, M).sort(-1).values  # invisible last
    top = torch.where(top == M, -1, top)
    if kk < k:
        top = F.pad(top, (0, k - kk), value=-1)
    return top


def picks_to_mask(picks_BTK: torch.Tensor, M: int) -> torch.Tensor:
    """bool [B, T, M]: True at the picked key positions (-1 entries pick nothing)."""
    B, T, _ = picks_BTK.shape
    mask = torch.zeros(B, T, M + 1, dtype=torch.bool, device=picks_BTK.device)
    mask.scatter_(-1, torch.where(picks_BTK < 0, M, picks_BTK.long()), True)
    return mask[..., :M]


@dataclass
class IndexerReplay:
    """One forward's indexer picks: the given ones (replayed where `mask_BT` is set) and, filled
    as the layers run, the natural ones and those used (each [B, T, K] per indexer layer)."""

    given_BTLK: torch.Tensor | None = None
    mask_BT: torch.Tensor | None = None
    natural: list[torch.Tensor] = field(default_factory=list)
    used: list[torch.Tensor] = field(default_factory=list)
    last_mask_B1TM: torch.Tensor | None = None
    """The previous full layer's key mask (GLM-5's shared layers reuse it)."""

    def pick(self, natural_BTK: torch.Tensor) -> torch.Tensor:
        """The picks this indexer layer runs: the given ones where replayed, else natural."""
        l = len(self.natural)
        self.natural.append(natural_BTK)
        if self.given_BTLK is None:
            used = natural_BTK
        else:
            given = self.given_BTLK[:, :, l].to(natural_BTK.device, torch.int64)
            used = torch.where(self.mask_BT[..., None], given, natural_BTK)
        self.used.append(used)
        return used


def indexer_replay(cfg: ModelConfig, given_BTLK: torch.Tensor | None,
                   mask_BT: torch.Tensor | None, B: int, T: int, device) -> IndexerReplay:
    """The IndexerReplay of one forward, given picks checked against the model: shape
    [B, T, indexer layers, index_topk], integers (RouteError naming the mismatch)."""
    from ..kernels.routes import RouteError

    if given_BTLK is None:
        if mask_BT is not None:
            raise RouteError("indexer_mask given without indexer_topk")
        return IndexerReplay()
    want = (B, T, cfg.num_indexer_layers, cfg.index_topk)
    if given_BTLK.dtype.is_floating_point or given_BTLK.dtype == torch.bool or \
            tuple(given_BTLK.shape) != want:
        raise RouteError(f"indexer_topk must be integer {list(want)} (batch, time, indexer "
                         f"layers, index_topk), got {given_BTLK.dtype} "
                         f"{list(given_BTLK.shape)}")
    if mask_BT is None:
        mask_BT = torch.ones(B, T, dtype=torch.bool, device=device)
    if mask_BT.dtype != torch.bool or tuple(mask_BT.shape) != (B, T):
        raise RouteError(f"indexer_mask must be bool [{B}, {T}], got {mask_BT.dtype} "
                         f"{list(mask_BT.shape)}")
    return IndexerReplay(given_BTLK, mask_BT.to(device))


class Indexer(nn.Module):
    """The lightning indexer of one DSA layer (its scores and picks; no gradient)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.Hi, self.Di, self.R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.k_top = cfg.index_topk
        self.interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.Hi * self.Di, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.Di, bias=False)
        self.k_norm = nn.LayerNorm(self.Di, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.Hi, bias=False)

    def _rope(self, x_BTHD, cos, sin_signed):
        """RoPE on the first R dims (cos / sin [B, 1, T, R] moved to [B, T, 1, R])."""
        rot, rest = x_BTHD[..., :self.R], x_BTHD[..., self.R:]
        rope = apply_rope_interleaved if self.interleave else apply_rope
        return torch.cat([rope(rot, cos.transpose(1, 2), sin_signed.transpose(1, 2)), rest], -1)

    def keys(self, x_BTD, cos, sin_signed) -> torch.Tensor:
        """[B, T, Di]: this forward's indexer keys (rotated)."""
        B, T, _ = x_BTD.shape
        k = F.layer_norm(linear(x_BTD, self.wk.weight), (self.Di,), self.k_norm.weight.to(
            x_BTD.dtype), self.k_norm.bias.to(x_BTD.dtype), self.k_norm.eps)
        return self._rope(k.view(B, T, 1, self.Di), cos, sin_signed)[:, :, 0]

    @torch.no_grad()
    def scores(self, x_BTD, q_resid_BTQ, keys_BMD, cos, sin_signed) -> torch.Tensor:
        """fp32 [B, T, M] index scores of every query against `keys_BMD`."""
        B, T, _ = x_BTD.shape
        q = self._rope(linear(q_resid_BTQ, self.wq_b.weight).view(B, T, self.Hi, self.Di),
                       cos, sin_signed)                                   # [B, T, Hi, Di]
        s_BTHM = F.relu((q.float() @ keys_BMD.float()[:, None].transpose(-1, -2))
                        * self.Di ** -0.5)
        w_BTH = linear(x_BTD.to(self.weights_proj.weight.dtype),
                       self.weights_proj.weight).float() * self.Hi ** -0.5
        return (w_BTH[:, :, None] @ s_BTHM)[:, :, 0]


class DSAttention(MLAttention):
    """MLA (interleaved RoPE on its rotary dims) restricted to the keys the indexer picks.
    GLM-5's `shared` layers have no indexer and reuse the previous full layer's key mask."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        need_q = not hasattr(self, "q_a_proj")
        if need_q:
            raise ValueError("DeepSeek sparse attention needs q_lora_rank")
        self.indexer = None if cfg.indexer_shared(layer_idx) else Indexer(cfg)
        # its place on the indexer-replay axis and in the key cache (MTP layers have none)
        self.index_layer = cfg.indexer_layer_ids.index(layer_idx) \
            if layer_idx in cfg.indexer_layer_ids else None

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None,
                sparse: IndexerReplay | None = None):
        B, T, _ = x_BTD.shape
        sparse = sparse if sparse is not None else IndexerReplay()
        q_resid = self.q_a_layernorm(linear(x_BTD, self.q_a_proj.weight))
        q_BHTq = linear(q_resid, self.q_b_proj.weight).view(B, T, -1, self.dn + self.dr) \
            .transpose(1, 2)
        q_nope, q_rot = q_BHTq.split([self.dn, self.dr], dim=-1)
        latent, k_rot = linear(x_BTD, self.kv_a_proj_with_mqa.weight).split(
            [self.kv_rank, self.dr], dim=-1)
        k_rot_B1TR = k_rot.view(B, 1, T, self.dr)
        q_rot = apply_rope_interleaved(q_rot, cos, sin_signed)
        k_rot_B1TR = apply_rope_interleaved(k_rot_B1TR, cos, sin_signed)
        kv = linear(self.kv_a_layernorm(latent), self.kv_b_proj.weight)
        k_nope, v = kv.view(B, T, -1, self.dn + self.dv).transpose(1, 2).split(
            [self.dn, self.dv], dim=-1)
        H = k_nope.shape[1]
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot_B1TR.expand(B, H, T, self.dr)), dim=-1)
        if cache_rows is None:
            keys, values = k, v
            query_pos_BT = torch.arange(T, device=x_BTD.device).expand(B, T)
        else:
            keys, values = cache_rows.write_and_read(self.layer_idx, k, v)
            query_pos_BT = cache_rows.positions_BT
        M = keys.shape[2]
        visible_BTM = torch.arange(M, device=x_BTD.device) <= query_pos_BT[..., None]
        if self.indexer is None:
            mask_B1TM = sparse.last_mask_B1TM
        else:
            with torch.no_grad():
                ik = self.indexer.keys(x_BTD, cos, sin_signed)                 # [B, T, Di]
                if cache_rows is not None:
                    ik = cache_rows.cache.index_keys(self.index_layer, cache_rows, ik)
                scores = self.indexer.scores(x_BTD, q_resid, ik, cos, sin_signed)
                picks = sparse.pick(picks_from_scores(scores, visible_BTM,
                                                      self.indexer.k_top))
            mask_B1TM = (picks_to_mask(picks, M) & visible_BTM)[:, None]
            sparse.last_mask_B1TM = mask_B1TM
        o = attention(q, keys, values, mask_B1TM, self.scale)
        return linear(o.transpose(1, 2).reshape(B, T, -1), self.o_proj.weight,
                      self.o_proj.bias)
