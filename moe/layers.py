"""Building blocks of the MoE policy models (moe/model.py): linear and grouped-expert matmuls
(bf16/fp16 emulated in fp32 on CPU; block FP8 with `fp8=True`, kernels/fp8.py), attention,
RMSNorm, RoPE (with YaRN and partial and interleaved rotary), the KV cache and the attention
layers (GQA/MHA and DeepSeek's multi-head latent attention).

Shape legend (suffixes): B batch, T time, N flattened tokens, D model width, H query heads, G
key/value heads, Dh head width, E experts, S cache slots, M cache length, L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import exact as exact_kernels
from ..kernels.fp8 import act_qdq, has_scaled_mm, scaled_mm_blockwise, scaled_mm_fits, weight_qdq
from .config import ModelConfig, yarn_settings


def _emulated_on_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           fp8: bool = False, exact: bool = False) -> torch.Tensor:
    """x @ w.T (+ b) in the operands' dtype (`fp8`: in block FP8, see fp8_linear; `exact`: the
    batch-invariant kernel, kernels/exact.py).

    NOTE: CPUs without native bf16/fp16 matmul (AVX2) run them 5-12x slower than fp32 at our
    sizes. Both round the fp32-accumulated result once: the products of bf16/fp16 numbers are
    exact in fp32, so upcasting differs only by summation order (about 1e-4 of outputs move one
    ulp). GPUs keep the native kernel.
    """
    if fp8:
        return fp8_linear(x, w, b)
    if exact:
        return exact_kernels.linear(x, w, b)
    if _emulated_on_cpu(x):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) in block FP8 (kernels/fp8.py): x quantised per token in 1x128 groups, w in
    128x128 blocks, both dequantised to fp32 for an fp32 matmul (an fp32-accumulating FP8 GEMM
    emulated), the result in x's dtype; the bias is added unquantised. Gradients pass straight
    through both quantisers to x and w (fp32 master weights train). On a GPU with FP8 tensor
    cores, inference (no gradient) runs torch._scaled_mm instead."""
    O, D = w.shape
    x_ND = x.reshape(-1, D)
    if (x.device.type == "cuda" and not (x.requires_grad or w.requires_grad)
            and has_scaled_mm(x.device) and scaled_mm_fits(x_ND.shape[0], D, O)):
        y = scaled_mm_blockwise(x_ND, w, x.dtype).view(*x.shape[:-1], O)
        return y if b is None else y + b.to(y.dtype)
    y = F.linear(act_qdq(x), weight_qdq(w), None if b is None else b.float())
    return y.to(x.dtype)


def grouped_linear(x_XD: torch.Tensor, w_EOD: torch.Tensor, offs_E: torch.Tensor,
                   fp8: bool = False, exact: bool = False):
    """Rows offs_E[e-1]:offs_E[e] of x times w_EOD[e].T, for every expert e in one call
    (`fp8`: each expert's weight in 128x128 blocks and x in 1x128 groups, as fp8_linear).

    One grouped matmul instead of a Python loop of E matmuls, E activations and a cat: the same
    bits on CPU (per-expert matmuls inside), far fewer kernels when rows per expert are few
    (decoding). Its weight gradient is one (E, O, D) tensor, not E zero-filled full-size ones.
    `exact`: the batch-invariant kernel (kernels/exact.py), with this function's gradient.
    """
    if exact:
        return exact_kernels.grouped_linear(x_XD, w_EOD, offs_E, grouped_linear)
    if x_XD.device.type != "cpu":
        # CUDA's grouped_mm takes only bf16 on recent GPUs; a loop of matmuls runs anywhere.
        return grouped_linear_loop(x_XD, w_EOD, offs_E, fp8)
    if fp8:
        return F.grouped_mm(act_qdq(x_XD), weight_qdq(w_EOD).transpose(1, 2),
                            offs=offs_E).to(x_XD.dtype)
    if _emulated_on_cpu(x_XD):  # see linear()
        return F.grouped_mm(x_XD.float(), w_EOD.float().transpose(1, 2),
                            offs=offs_E).to(x_XD.dtype)
    return F.grouped_mm(x_XD, w_EOD.transpose(1, 2), offs=offs_E)


def grouped_linear_loop(x_XD: torch.Tensor, w_EOD: torch.Tensor, offs_E: torch.Tensor,
                        fp8: bool = False):
    """grouped_linear as one matmul per expert."""
    ends = offs_E.tolist()
    # unbind once: indexing the stacked weight per expert would make backward allocate
    # (and zero-fill) a full-size gradient for every expert.
    w_E = w_EOD.unbind(0)
    return torch.cat([linear(x_XD[start:end], w_E[e], fp8=fp8)
                      for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))])


def attention(q, k, v, mask=None, scale=None, exact_max_len: int | None = None) -> torch.Tensor:
    """Causal (mask None) or masked GQA attention; on CPU low precision runs in fp32 as above.
    `scale` None is 1/sqrt(q's head width). `exact_max_len` (the model's context): the
    batch-invariant kernel (kernels/exact.py)."""
    if exact_max_len is not None:
        return exact_kernels.attention(q, k, v, mask, scale, max_len=exact_max_len)
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
        self.exact = False  # batch-invariant kernels (MoEModel.set_exact)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return exact_kernels.rms_norm(x, self.weight, self.eps)
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
    y = yarn_settings(s, max_pos)
    factor, attention_factor = y["factor"], y["attention_factor"]
    if attention_factor is None:
        if y["mscale"] is not None:
            attention_factor = yarn_mscale(factor, y["mscale"]) / \
                yarn_mscale(factor, y["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)
    original = y["original"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y["beta_fast"]), correction_dim(y["beta_slow"])
    if y["truncate"]:
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
        self.fp8 = False
        """Projections in block FP8 (MoEModel.set_precision's fp8)."""
        self.exact = False
        """Batch-invariant kernels (MoEModel.set_exact)."""
        self.max_len = cfg.max_position_embeddings

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None):
        B, T, _ = x_BTD.shape
        Dh = self.head_dim
        mm = dict(fp8=self.fp8, exact=self.exact)
        q = linear(x_BTD, self.q_proj.weight, self.q_proj.bias, **mm).view(B, T, -1, Dh)
        k = linear(x_BTD, self.k_proj.weight, self.k_proj.bias, **mm).view(B, T, -1, Dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = linear(x_BTD, self.v_proj.weight, self.v_proj.bias, **mm)
        v = v.view(B, T, -1, Dh).transpose(1, 2)
        # (B, H|G, T, Dh); cos covers the rotary dims only (all of Dh but for GLM-4.5)
        q, k = apply_partial_rope(q, cos, sin_signed), apply_partial_rope(k, cos, sin_signed)
        exact_len = self.max_len if self.exact else None
        if cache_rows is None:
            o = attention(q, k, v, exact_max_len=exact_len)
        else:
            keys, values = cache_rows.write_and_read(self.layer_idx, k, v)  # (B, G, M, Dh)
            o = attention(q, keys, values, cache_rows.mask_B1TM, exact_max_len=exact_len)
        return linear(o.transpose(1, 2).reshape(B, T, -1), self.o_proj.weight, **mm)


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
        self.fp8 = False
        """Projections in block FP8 (MoEModel.set_precision's fp8)."""

    def forward(self, x_BTD, cos, sin_signed, cache_rows: CacheRows | None):
        B, T, _ = x_BTD.shape
        if hasattr(self, "q_proj"):
            q = linear(x_BTD, self.q_proj.weight, fp8=self.fp8)
        else:
            q = linear(self.q_a_layernorm(linear(x_BTD, self.q_a_proj.weight, fp8=self.fp8)),
                       self.q_b_proj.weight, fp8=self.fp8)
        q_BHTq = q.view(B, T, -1, self.dn + self.dr).transpose(1, 2)
        q_nope, q_rot = q_BHTq.split([self.dn, self.dr], dim=-1)
        latent, k_rot = linear(x_BTD, self.kv_a_proj_with_mqa.weight, fp8=self.fp8).split(
            [self.kv_rank, self.dr], dim=-1)
        k_rot_B1TR = k_rot.view(B, 1, T, self.dr)
        rope = apply_rope_interleaved if self.interleave else apply_rope
        q_rot, k_rot_B1TR = rope(q_rot, cos, sin_signed), rope(k_rot_B1TR, cos, sin_signed)
        kv = linear(self.kv_a_layernorm(latent), self.kv_b_proj.weight, fp8=self.fp8)
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
        return linear(o.transpose(1, 2).reshape(B, T, -1), self.o_proj.weight, fp8=self.fp8)
