"""MoE policy models in plain torch (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3), with
routers that replay given routes (moe/router.py).

Shape legend (suffixes): B batch, T time (tokens per row), N = B*T flattened tokens, D model
width, H query heads, G key/value heads, Dh head width, V vocab, E experts, K top-k, L MoE
layers (the internal route axis: MoE layers only, in decoder order), I expert width,
S cache slots, M cache length.

Model math knows nothing of process groups; parallelism is applied from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.routes import RouteError, check_routes_BTLK
from .config import ModelConfig
from .router import bias_update, expert_load, route, router_probs


@dataclass
class ModelOutput:
    logits_BTV: torch.Tensor | None
    """Logits in the LM head's compute dtype; None when compute_logits=False."""
    hidden_BTD: torch.Tensor
    """Final-normed hidden states (the LM head's input)."""
    routes_BTLK: torch.Tensor
    """int64 experts each token actually ran (the given ids where replayed)."""
    natural_BTLK: torch.Tensor
    """int64 natural top-k of the current router, computed in the same pass."""
    router_logits_LNE: list[torch.Tensor]
    """Per MoE layer, fp32 router logits of all N tokens (for the load-balancing loss)."""


def _emulated_on_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) in the operands' dtype.

    NOTE: CPUs without native bf16/fp16 matmul (AVX2) run them 5-12x slower than fp32 at our
    sizes. Both round the fp32-accumulated result once: the products of bf16/fp16 numbers are
    exact in fp32, so upcasting differs only by summation order (about 1e-4 of outputs move one
    ulp). GPUs keep the native kernel.
    """
    if _emulated_on_cpu(x):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)


def grouped_linear(x_XD: torch.Tensor, w_EOD: torch.Tensor, offs_E: torch.Tensor):
    """Rows offs_E[e-1]:offs_E[e] of x times w_EOD[e].T, for every expert e in one call.

    One grouped matmul instead of a Python loop of E matmuls, E activations and a cat: the same
    bits on CPU (per-expert matmuls inside), far fewer kernels when rows per expert are few
    (decoding). Its weight gradient is one (E, O, D) tensor, not E zero-filled full-size ones.
    """
    if x_XD.device.type != "cpu":
        # CUDA's grouped_mm takes only bf16 on recent GPUs; a loop of matmuls runs anywhere.
        return grouped_linear_loop(x_XD, w_EOD, offs_E)
    if _emulated_on_cpu(x_XD):  # see linear()
        return F.grouped_mm(x_XD.float(), w_EOD.float().transpose(1, 2),
                            offs=offs_E).to(x_XD.dtype)
    return F.grouped_mm(x_XD, w_EOD.transpose(1, 2), offs=offs_E)


def grouped_linear_loop(x_XD: torch.Tensor, w_EOD: torch.Tensor, offs_E: torch.Tensor):
    """grouped_linear as one matmul per expert."""
    ends = offs_E.tolist()
    # unbind once: indexing the stacked weight per expert would make backward allocate
    # (and zero-fill) a full-size gradient for every expert.
    w_E = w_EOD.unbind(0)
    return torch.cat([linear(x_XD[start:end], w_E[e])
                      for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))])


def attention(q, k, v, mask=None, scale=None) -> torch.Tensor:
    """Causal (mask None) or masked GQA attention; on CPU low precision runs in fp32 as above.
    `scale` None is 1/sqrt(q's head width)."""
    if _emulated_on_cpu(q):
        return attention(q.float(), k.float(), v.float(), mask, scale).to(q.dtype)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                              scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last axis, in fp32 (also for bf16/fp16 inputs), scaled by weight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused kernel forward and backward; in fp32 it gives the same bits as the
        # explicit form x * rsqrt(mean(x^2) + eps) * w (tests/test_model_fast_paths.py checks).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalise in fp32, scale in the input dtype (the Qwen3 convention, needed for parity:
    # scaling in fp32 would round once, not twice). The unweighted fused kernel gives the same
    # bits as the explicit fp32 normalisation, in 1 kernel instead of 5.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rope_cos_sin(positions_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None, max_position_embeddings: int = 0):
    """cos and signed sin of shape [B, 1, T, Dh] in `dtype` (rotate-half convention).

    The sign of rotate_half, (-x2, x1), is folded into sin: sin_signed = (-sin, sin), so a
    layer rotates with a plain half swap (x2, x1). Negating a factor is exact, so the result
    has the same bits as x * cos + cat(-x2, x1) * sin. Computed once per forward in fp32 and
    cast once, not per layer.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=positions_BT.device).float() / head_dim))
    attention_factor = 1.0
    if scaling is not None:
        inv_freq, attention_factor = yarn_inv_freq(inv_freq, head_dim, theta, scaling,
                                                   max_position_embeddings)
    freqs_BTF = positions_BT[..., None].float() * inv_freq
    cos_half, sin_half = freqs_BTF.cos(), freqs_BTF.sin()
    if attention_factor != 1.0:
        cos_half, sin_half = cos_half * attention_factor, sin_half * attention_factor
    cos = torch.cat((cos_half, cos_half), dim=-1)[:, None]
    sin_signed = torch.cat((-sin_half, sin_half), dim=-1)[:, None]
    return cos.to(dtype), sin_signed.to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(inv_freq_F: torch.Tensor, dim: int, theta: float, s: dict, max_pos: int):
    """YaRN (arXiv 2309.00071) as DeepSeek-V3 configures it: frequencies between the
    beta_fast/beta_slow correction dims blend interpolation (1 / factor) and extrapolation;
    cos/sin are scaled by the attention factor. Returns (inv_freq, attention_factor)."""
    factor = float(s["factor"])
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, s["mscale"]) / \
                yarn_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)
    original = s.get("original_max_position_embeddings") or max_pos

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = (1 - ramp).to(inv_freq_F.device)
    pos_freqs = 1.0 / inv_freq_F
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + \
        (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


def apply_rope(x_BHTDh: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    return x_BHTDh * cos + swap_halves(x_BHTDh) * sin_signed


def apply_partial_rope(x_BHTDh: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    """RoPE on the first cos.shape[-1] dims of each head, the rest passed through (GLM-4.5)."""
    rot = cos.shape[-1]
    if rot == x_BHTDh.shape[-1]:
        return apply_rope(x_BHTDh, cos, sin_signed)
    return torch.cat((apply_rope(x_BHTDh[..., :rot], cos, sin_signed), x_BHTDh[..., rot:]), -1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    """DeepSeek's interleaved RoPE: pairs (x0, x1), (x2, x3), ... each rotated by one frequency;
    the rotated evens are laid out first, then the odds (the same permutation for q and k, so
    their dot products are those of the interleaved rotation)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin_signed[..., half:]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class KVCache:
    """Per-slot key/value cache for incremental decoding.

    Each slot holds one sequence; a token at position p writes its key/value at index p of its
    slot and attends to the slot's indices <= p. Slots are reused without clearing: indices
    beyond a new occupant's position are never attended before they are overwritten.
    """

    def __init__(self, k_LSGMDh: torch.Tensor, v_LSGMDh: torch.Tensor):
        self.k = k_LSGMDh  # (layers, S, G, M, Dk): every decoder layer, dense ones too
        self.v = v_LSGMDh  # (layers, S, G, M, Dv); MLA: G = H expanded heads, Dk != Dv

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, max_len: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        G, Dk, Dv = cfg.kv_cache_dims
        shape = (cfg.num_hidden_layers, num_slots, G, max_len)
        return cls(torch.zeros(*shape, Dk, dtype=dtype, device=device),
                   torch.zeros(*shape, Dv, dtype=dtype, device=device))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Share a prefilled prompt: copy the first `length` cache entries of slot src to dst."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


@dataclass
class CacheRows:
    """Where one forward's rows live in a KVCache; built once per forward, shared by layers."""

    cache: KVCache
    slots_B: torch.Tensor
    positions_BT: torch.Tensor
    first_slot: int | None
    """Slots are first_slot, first_slot+1, ...: the cache is read through a view, not a copy."""
    length: int
    """Keys 0..length-1 of each slot are read (max position + 1)."""
    mask_B1TM: torch.Tensor
    """Causal by position: key index <= query position."""

    @classmethod
    def build(cls, cache: KVCache, slots_B: torch.Tensor, positions_BT: torch.Tensor):
        B = slots_B.shape[0]
        s0 = int(slots_B[0])
        consecutive = bool((slots_B == torch.arange(s0, s0 + B, device=slots_B.device)).all())
        length = int(positions_BT.max()) + 1
        key_pos_M = torch.arange(length, device=positions_BT.device)
        return cls(cache, slots_B, positions_BT, s0 if consecutive else None, length,
                   (key_pos_M <= positions_BT[:, :, None])[:, None])

    def write_and_read(self, layer: int, k_BGTDh: torch.Tensor, v_BGTDh: torch.Tensor):
        """Store this forward's keys/values, return all keys/values of the rows (B, G, M, Dh)."""
        ck, cv = self.cache.k[layer], self.cache.v[layer]  # (S, G, M, Dh)
        if ck.dtype != k_BGTDh.dtype:
            raise TypeError(f"KV cache dtype {ck.dtype} != activation dtype {k_BGTDh.dtype}")
        index = (self.slots_B[:, None], slice(None), self.positions_BT)
        ck[index] = k_BGTDh.transpose(1, 2)
        cv[index] = v_BGTDh.transpose(1, 2)
        M = self.length
        if self.first_slot is not None:
            rows = slice(self.first_slot, self.first_slot + self.slots_B.shape[0])
            return ck[rows, :, :M], cv[rows, :, :M]
        return (ck[:, :, :M].index_select(0, self.slots_B),
                cv[:, :, :M].index_select(0, self.slots_B))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias  # q/k/v biases (Qwen2-MoE, GLM-4.5); o_proj never has one
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None):
        B, T, _ = x_BTD.shape
        Dh = self.head_dim
        q = linear(x_BTD, self.q_proj.weight, self.q_proj.bias).view(B, T, -1, Dh)
        k = linear(x_BTD, self.k_proj.weight, self.k_proj.bias).view(B, T, -1, Dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = linear(x_BTD, self.v_proj.weight, self.v_proj.bias).view(B, T, -1, Dh).transpose(1, 2)
        # (B, H|G, T, Dh); cos covers the rotary dims only (all of Dh but for GLM-4.5)
        q, k = apply_partial_rope(q, cos, sin_signed), apply_partial_rope(k, cos, sin_signed)
        if cache_rows is None:
            o = attention(q, k, v)
        else:
            keys, values = cache_rows.write_and_read(self.layer_idx, k, v)  # (B, G, M, Dh)
            o = attention(q, keys, values, cache_rows.mask_B1TM)
        return linear(o.transpose(1, 2).reshape(B, T, -1), self.o_proj.weight)


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention. Queries go through a low-rank bottleneck
    (q_lora_rank; a plain q_proj when None); keys/values through a kv_lora_rank latent shared by
    all heads plus one shared RoPE key part of qk_rope_head_dim. The KV cache holds the expanded
    per-head keys (nope | rope) and values, so cached decoding is ordinary attention.
    NOTE: q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says (as
    DeepSeek's and transformers' code)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        self.scale = None  # 1/sqrt(dn + dr); YaRN multiplies it by mscale(factor, mscale_all_dim)^2
        rs = cfg.rope_scaling
        if rs is not None and rs.get("mscale_all_dim"):
            m = yarn_mscale(float(rs["factor"]), rs["mscale_all_dim"])
            self.scale = (self.dn + self.dr) ** -0.5 * m * m
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (self.dn + self.dr), bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=False)

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None):
        B, T, _ = x_BTD.shape
        if hasattr(self, "q_proj"):
            q = linear(x_BTD, self.q_proj.weight)
        else:
            q = linear(self.q_a_layernorm(linear(x_BTD, self.q_a_proj.weight)),
                       self.q_b_proj.weight)
        q_BHTq = q.view(B, T, -1, self.dn + self.dr).transpose(1, 2)
        q_nope, q_rot = q_BHTq.split([self.dn, self.dr], dim=-1)
        latent, k_rot = linear(x_BTD, self.kv_a_proj_with_mqa.weight).split(
            [self.kv_rank, self.dr], dim=-1)
        k_rot_B1TR = k_rot.view(B, 1, T, self.dr)
        rope = apply_rope_interleaved if self.interleave else apply_rope
        q_rot, k_rot_B1TR = rope(q_rot, cos, sin_signed), rope(k_rot_B1TR, cos, sin_signed)
        kv = linear(self.kv_a_layernorm(latent), self.kv_b_proj.weight)
        k_nope, v = kv.view(B, T, -1, self.dn + self.dv).transpose(1, 2).split(
            [self.dn, self.dv], dim=-1)
        H = k_nope.shape[1]
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot_B1TR.expand(B, H, T, self.dr)), dim=-1)
        if cache_rows is None:
            o = attention(q, k, v, scale=self.scale)
        else:
            keys, values = cache_rows.write_and_read(self.layer_idx, k, v)
            o = attention(q, keys, values, cache_rows.mask_B1TM, self.scale)
        return linear(o.transpose(1, 2).reshape(B, T, -1), self.o_proj.weight)


class DenseMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = F.silu(linear(x, self.gate_proj.weight)) * linear(x, self.up_proj.weight)
        return linear(h, self.down_proj.weight)


class Experts(nn.Module):
    """E SwiGLU experts stored stacked; each expert runs once on the tokens routed to it."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))  # (E, 2I, D)
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))  # (E, D, I)

    def forward(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, gates_NK: torch.Tensor):
        N, K = ids_NK.shape
        flat_ids = ids_NK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // K  # token index of each sorted (token, k) pair
        # Sorted rows of expert e end at offs_E[e]; an expert with no rows has an empty group.
        offs_E = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).cumsum(0)
        offs_E = offs_E.to(torch.int32)
        # index_select, not x_ND[token_of]: advanced indexing is several times slower on CPU
        # forward, and its backward is an accumulating index_put (a sort) instead of index_add.
        x_sorted = x_ND.index_select(0, token_of)
        g, u = grouped_linear(x_sorted, self.gate_up_proj, offs_E).chunk(2, dim=-1)
        y_sorted = grouped_linear(F.silu(g) * u, self.down_proj, offs_E)
        y_sorted = y_sorted * gates_NK.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x_ND).index_add_(0, token_of, y_sorted)


class MoEBlock(nn.Module):
    """Router (moe/router.py: the family picks or replays ids and computes gate weights) +
    grouped experts + optional shared experts. Replay fixes the ids, never the gate weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router (E, D)
        if cfg.expert_bias:
            # Selection-only bias (aux-loss-free balancing); a buffer: no gradient, kept fp32.
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.n_shared_experts:  # DeepSeek-V3 / GLM-4.5: always on, weight 1
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_expert_width)
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE: scaled by a sigmoid gate
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_width)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x_BTD, replay_ids_NK, replay_mask_N):
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        w = self.gate.weight  # the router computes in its own weights' dtype (router_dtype)
        router_logits_NE = linear(x_ND.to(w.dtype), w).float()
        ids_NK, gates_NK, natural_NK = route(router_logits_NE, self.cfg,
                                             self.e_score_correction_bias, replay_ids_NK,
                                             replay_mask_N)
        y_ND = self.experts(x_ND, ids_NK, gates_NK.to(x_ND.dtype))
        if self.cfg.n_shared_experts:
            y_ND = y_ND + self.shared_experts(x_ND)
        if self.cfg.shared_expert_intermediate_size:
            g_N1 = torch.sigmoid(linear(x_ND, self.shared_expert_gate.weight))
            y_ND = y_ND + g_N1 * self.shared_expert(x_ND)
        return y_ND.view(B, T, D), ids_NK, natural_NK, router_logits_NE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx) if cfg.is_mla else Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)


class MoEModel(nn.Module):
    """MoE causal LM of any supported family. See docs/model.md for the replay contract."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else \
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compute_dtype = torch.float32
        self.lm_head_dtype = torch.float32
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_precision(self, dtype: torch.dtype, router_dtype: torch.dtype | None = None,
                      lm_head_dtype: torch.dtype | None = None) -> "MoEModel":
        """Cast for inference/training: everything to dtype, router and LM head optionally
        kept in a wider dtype (they then compute in it). With tied embeddings a wider LM head
        keeps the shared matrix wide; lookups are cast to dtype."""
        self.to(dtype)
        for layer in self.layers:  # the selection bias stays fp32 (as HF keeps it)
            if layer.is_moe and layer.mlp.e_score_correction_bias is not None:
                layer.mlp.e_score_correction_bias.data = \
                    layer.mlp.e_score_correction_bias.data.float()
        if router_dtype is not None:
            for layer in self.layers:
                if layer.is_moe:
                    layer.mlp.gate.to(router_dtype)
        if lm_head_dtype is not None:
            (self.embed_tokens if self.lm_head is None else self.lm_head).to(lm_head_dtype)
        self.compute_dtype = dtype
        self.lm_head_dtype = lm_head_dtype or dtype
        return self

    def logits(self, hidden_XD: torch.Tensor) -> torch.Tensor:
        w = self.lm_head_weight
        return linear(hidden_XD.to(self.lm_head_dtype), w.to(self.lm_head_dtype))

    def _check_routes(self, ids_BTLK: torch.Tensor, mask_BT: torch.Tensor, B: int, T: int):
        """Shapes only: the ids were validated where they entered (`RoutingTrace`, the one
        route validator) or come from this model's own top-k (R2), so no pass over them here."""
        cfg = self.cfg
        check_routes_BTLK(ids_BTLK, mask_BT, what="routed_experts", mask="replay_mask",
                          shape=(B, T, cfg.num_moe_layers, cfg.num_experts_per_tok))
        return ids_BTLK.long()

    def forward(self, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor | None = None,
                routed_experts_BTLK: torch.Tensor | None = None,
                replay_mask_BT: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, cache_slots_B: torch.Tensor | None = None,
                compute_logits: bool = True) -> ModelOutput:
        cfg = self.cfg
        B, T = input_ids_BT.shape
        if positions_BT is None:
            positions_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
        if kv_cache is not None and cache_slots_B is None:
            cache_slots_B = torch.arange(B, device=input_ids_BT.device)
        replay_ids_LNK: list[torch.Tensor | None] = [None] * cfg.num_moe_layers
        replay_mask_N = None
        if routed_experts_BTLK is not None:
            if replay_mask_BT is None:
                replay_mask_BT = torch.ones(B, T, dtype=torch.bool, device=input_ids_BT.device)
            ids = self._check_routes(routed_experts_BTLK, replay_mask_BT, B, T)
            replay_ids_LNK = list(ids.reshape(B * T, cfg.num_moe_layers, -1).unbind(1))
            replay_mask_N = replay_mask_BT.reshape(-1)
        elif replay_mask_BT is not None:
            raise RouteError("replay_mask given without routed_experts")

        x = self.embed_tokens(input_ids_BT).to(self.compute_dtype)
        cos, sin_signed = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta, x.dtype,
                                       cfg.rope_scaling, cfg.max_position_embeddings)
        cache_rows = None if kv_cache is None else \
            CacheRows.build(kv_cache, cache_slots_B, positions_BT)
        routes, natural, router_logits = [], [], []
        for layer in self.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin_signed, cache_rows)
            h = layer.post_attention_layernorm(x)
            if layer.is_moe:
                y, ids_NK, nat_NK, logits_NE = layer.mlp(h, replay_ids_LNK[len(routes)],
                                                         replay_mask_N)
                routes.append(ids_NK)
                natural.append(nat_NK)
                router_logits.append(logits_NE)
            else:
                y = layer.mlp(h)
            x = x + y
        hidden = self.norm(x)
        K = cfg.num_experts_per_tok
        empty = torch.empty(B, T, 0, K, dtype=torch.long, device=x.device)
        return ModelOutput(
            logits_BTV=self.logits(hidden) if compute_logits else None,
            hidden_BTD=hidden,
            routes_BTLK=torch.stack(routes, 1).view(B, T, -1, K) if routes else empty,
            natural_BTLK=torch.stack(natural, 1).view(B, T, -1, K) if natural else empty,
            router_logits_LNE=router_logits,
        )

    def load_balancing_loss(self, out: ModelOutput, valid_BT: torch.Tensor | None = None):
        """Switch-style auxiliary loss, E * sum_e f_e * P_e averaged over MoE layers.

        f_e is the fraction of (valid token, k) slots dispatched to expert e by the routes the
        forward actually ran (the replayed ones under R2/R3: that is the load the experts saw),
        and P_e the mean current router probability of e over valid tokens. Gradient flows
        through P only, so under replay the router is still pushed towards balance.
        """
        if not out.router_logits_LNE:
            return out.hidden_BTD.new_zeros(())
        E = self.cfg.num_experts
        B, T = out.routes_BTLK.shape[:2]
        valid_N = (torch.ones(B * T, dtype=torch.bool, device=out.hidden_BTD.device)
                   if valid_BT is None else valid_BT.reshape(-1))
        n_valid = valid_N.sum().clamp(min=1)
        total = 0.0
        for l, logits_NE in enumerate(out.router_logits_LNE):
            ids_NK = out.routes_BTLK[:, :, l].reshape(B * T, -1)[valid_N]
            f_E = torch.bincount(ids_NK.reshape(-1), minlength=E).float() / ids_NK.numel()
            P_E = (router_probs(logits_NE, self.cfg) * valid_N[:, None]).sum(0) / n_valid
            total = total + E * (f_E * P_E).sum()
        return total / len(out.router_logits_LNE)

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    @torch.no_grad()
    def update_expert_bias(self, routes_BTLK: torch.Tensor, valid_BT: torch.Tensor | None,
                           rate: float) -> torch.Tensor:
        """Aux-loss-free balancing (DeepSeek-V3): e_score_correction_bias += rate *
        sign(mean load - load) per MoE layer, the load counted over the valid tokens' routes
        in `routes_BTLK`. Pass the routes the forward ran (`ModelOutput.routes_BTLK`: the
        replayed ones under R2/R3), as the load the experts saw. Returns the loads [L, E]."""
        loads_LE = self.expert_loads(routes_BTLK, valid_BT)
        self.apply_expert_bias_update(loads_LE, rate)
        return loads_LE

    @torch.no_grad()
    def expert_loads(self, routes_BTLK: torch.Tensor, valid_BT: torch.Tensor | None):
        """Tokens per expert and MoE layer, fp32 [L, E], over the valid tokens' routes."""
        B, T = routes_BTLK.shape[:2]
        valid = torch.ones(B, T, dtype=torch.bool, device=routes_BTLK.device) \
            if valid_BT is None else valid_BT.bool()
        return torch.stack([expert_load(routes_BTLK[:, :, l][valid], self.cfg.num_experts)
                            for l in range(routes_BTLK.shape[2])])

    @torch.no_grad()
    def apply_expert_bias_update(self, loads_LE: torch.Tensor, rate: float) -> None:
        """e_score_correction_bias += rate * sign(mean load - load), per MoE layer."""
        blocks = self.moe_blocks
        if not blocks or blocks[0].e_score_correction_bias is None:
            raise ValueError(f"model_type {self.cfg.model_type} with expert_bias=False has no "
                             f"e_score_correction_bias to update")
        for block, load_E in zip(blocks, loads_LE):
            bias = block.e_score_correction_bias
            bias += bias_update(load_E, rate).to(bias.device, bias.dtype)
