"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE), in its two forms: the chunked
one a full-sequence forward runs, and the recurrent one an engine's decode step runs
(transformers `qwen3_next` / `qwen3_5_moe` are the reference; docs/model.md).

Shape legend (suffixes): B batch, T time, D model width, C conv channels (q | k | v), W conv
kernel, Hk query/key heads, Hv value heads (a multiple of Hk), Dk key width, Dv value width,
S cache slots, L linear-attention layers.

Per head, with l2-normalised q_t (scaled by Dk^-0.5) and k_t, decay gamma_t = exp(g_t),
g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0, and beta_t = sigmoid(b_t), the state
S [Dk, Dv] follows the delta rule

    S_t = gamma_t * S_{t-1} + k_t (beta_t * (v_t - gamma_t * S_{t-1}^T k_t))^T,  o_t = S_t^T q_t

q, k, v first go through a causal depthwise convolution of width W and SiLU; the output is
RMS-normalised per value head, times SiLU(z), and projected out. The recurrent form steps this
rule token by token; the chunked form solves it for a chunk of 64 tokens at once (a unit lower
triangular system, as in the Gated DeltaNet paper) and carries S between chunks. Both compute
in fp32: they agree to rounding, not bit for bit (a source of engine/trainer mismatch that
routing replay cannot remove; docs/model.md "Gated DeltaNet").

Projections: Qwen3.5 stores in_proj_qkv (q of all heads | k | v), in_proj_z, in_proj_b and
in_proj_a; Qwen3-Next fuses them into in_proj_qkvz and in_proj_ba laid out per key head
[q_h | k_h | v of its Hv/Hk value heads | z of those], [b | a]. We keep each family's own
tensors (so its checkpoint names are our parameters) and reorder the fused outputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .layers import CacheRows, linear

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_chunked(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """The gated delta rule over a whole sequence, `chunk` tokens at a time.

    q, k [B, H, T, Dk] (normalised, q scaled), v [B, H, T, Dv], g, beta [B, H, T], all fp32;
    state [B, H, Dk, Dv] or None (zeros). Returns (o [B, H, T, Dv], final state).

    Within a chunk, with G_t the cumulative log decay from the chunk start, the per-token
    writes d_t = beta_t (v_t - gamma_t S_{t-1}^T k_t) satisfy (I + A) d = beta v - beta e^G K S0,
    A_ts = beta_t e^(G_t - G_s) k_t.k_s for s < t: one triangular solve instead of a loop."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (x.view(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.view(B, H, n, chunk), beta.view(B, H, n, chunk)
    G = g.cumsum(-1)                                           # [B, H, n, c]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay_ts = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * decay_ts                  # e^(G_t - G_s) k_t.k_s, s <= t
    A = (beta[..., :, None] * kk).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False,
                                        unitriangular=True)   # (I + A)^-1
    d_v = inv @ (beta[..., None] * v)                          # the part independent of S0
    d_k = inv @ (beta[..., None] * G.exp()[..., None] * k)     # times S0 gives the rest
    qk = (q @ k.transpose(-1, -2)) * decay_ts                  # e^(G_t - G_s) q_t.k_s, s <= t
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.to(q.dtype)
    out = []
    for i in range(n):
        d = d_v[:, :, i] - d_k[:, :, i] @ S                    # [B, H, c, Dv]
        out.append((q[:, :, i] * G[:, :, i, :, None].exp()) @ S + qk[:, :, i] @ d)
        tail = (G[:, :, i, -1:] - G[:, :, i]).exp()            # e^(G_C - G_s)
        S = S * G[:, :, i, -1].exp()[..., None, None] + (k[:, :, i] * tail[..., None]) \
            .transpose(-1, -2) @ d
    o = torch.stack(out, 2).reshape(B, H, -1, Dv)[:, :, :T]
    return o, S


def delta_rule_step(q, k, v, g, beta, state):
    """One token of the gated delta rule: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv] (fp32). Returns (o [B, H, Dv], new state)."""
    S = state * g.exp()[..., None, None]
    d = beta[..., None] * (v - (S * k[..., None]).sum(-2))
    S = S + k[..., None] * d[..., None, :]
    return (S * q[..., None]).sum(-2), S


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head, times SiLU(z) (fp32 inside, the input's dtype out)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        dtype = x.dtype
        h = self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. With a cache (`cache_rows`), a row whose first position is
    0 starts from zero states, any other continues from its slot's conv and delta states; the
    states after the row's last token are written back. Rows of one forward must then have no
    right padding (the engine prefills such models in groups of equal length)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.linear_index = cfg.linear_layer_ids.index(layer_idx)
        D = cfg.hidden_size
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.Dk, self.Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.W = cfg.linear_conv_kernel_dim
        kd, vd = self.Hk * self.Dk, self.Hv * self.Dv
        self.fused = cfg.model_type == "qwen3_next"  # in_proj_qkvz / in_proj_ba
        if self.fused:
            self.in_proj_qkvz = nn.Linear(D, 2 * kd + 2 * vd, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * self.Hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(D, 2 * kd + vd, bias=False)
            self.in_proj_z = nn.Linear(D, vd, bias=False)
            self.in_proj_b = nn.Linear(D, self.Hv, bias=False)
            self.in_proj_a = nn.Linear(D, self.Hv, bias=False)
        C = 2 * kd + vd
        self.conv1d = nn.Conv1d(C, C, self.W, groups=C, bias=False)  # weight [C, 1, W]
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.Dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(vd, D, bias=False)

    @torch.no_grad()
    def reset_family_parameters(self) -> None:
        """transformers' init of the decay: dt_bias 1, A = U(0.01, 16); gated norm weight 1."""
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.weight.fill_(1.0)

    def _project(self, x_BTD):
        """(qkv [B, T, C], z [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv]) in Qwen3.5's order."""
        B, T, _ = x_BTD.shape
        if not self.fused:
            return (linear(x_BTD, self.in_proj_qkv.weight),
                    linear(x_BTD, self.in_proj_z.weight).view(B, T, self.Hv, self.Dv),
                    linear(x_BTD, self.in_proj_b.weight), linear(x_BTD, self.in_proj_a.weight))
        r = self.Hv // self.Hk
        qkvz = linear(x_BTD, self.in_proj_qkvz.weight).view(B, T, self.Hk, -1)
        q, k, v, z = qkvz.split([self.Dk, self.Dk, r * self.Dv, r * self.Dv], dim=-1)
        ba = linear(x_BTD, self.in_proj_ba.weight).view(B, T, self.Hk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1)
        return (qkv, z.reshape(B, T, self.Hv, self.Dv), b.reshape(B, T, self.Hv),
                a.reshape(B, T, self.Hv))

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None):
        B, T, _ = x_BTD.shape
        dtype = x_BTD.dtype
        qkv_BTC, z, b, a = self._project(x_BTD)
        states = None if cache_rows is None else cache_rows.cache.linear_states(
            self.linear_index, cache_rows.slots_B, cache_rows.positions_BT[:, 0] > 0)
        conv_BCW = None if states is None else states[0]            # last W-1 inputs
        qkv_BCT = qkv_BTC.transpose(1, 2).float()
        w_C1W = self.conv1d.weight.float()
        past = qkv_BCT.new_zeros(B, qkv_BCT.shape[1], self.W - 1) if conv_BCW is None \
            else conv_BCW.float()
        full = torch.cat([past, qkv_BCT], dim=-1)
        mixed = F.silu(F.conv1d(full, w_C1W, groups=w_C1W.shape[0])).to(dtype)  # [B, C, T]
        kd = self.Hk * self.Dk
        q, k, v = mixed.transpose(1, 2).split([kd, kd, self.Hv * self.Dv], dim=-1)
        r = self.Hv // self.Hk
        q = q.reshape(B, T, self.Hk, self.Dk).repeat_interleave(r, dim=2)
        k = k.reshape(B, T, self.Hk, self.Dk).repeat_interleave(r, dim=2)
        v = v.reshape(B, T, self.Hv, self.Dv)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))   # [B, Hv, T, Dk|Dv]
        q = l2_normalize(q) * self.Dk ** -0.5
        k = l2_normalize(k)
        beta = torch.sigmoid(b.float()).transpose(1, 2)
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())) \
            .transpose(1, 2)                                         # [B, Hv, T]
        S0 = None if states is None else states[1]
        if T == 1 and S0 is not None:                                # the decode step
            o, S = delta_rule_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0],
                                   beta[:, :, 0], S0)
            o = o[:, :, None]
        else:
            o, S = delta_rule_chunked(q, k, v, g, beta, S0)
        if cache_rows is not None:
            cache_rows.cache.store_linear_states(self.linear_index, cache_rows.slots_B,
                                                 full[..., -(self.W - 1):], S)
        o = self.norm(o.transpose(1, 2).to(dtype), z)                # [B, T, Hv, Dv]
        return linear(o.reshape(B, T, -1), self.out_proj.weight)
