"""The engine's decode step: one new token per running sequence, no autograd, no replay.

Shape legend: B running rows, D model width, H query heads, G key/value heads, R = H/G query
heads per key/value head, Dh head width, M cache length read, V vocabulary, E experts, K top-k,
L MoE layers.

Same math as `MoEModel.forward` with a KV cache and T = 1, with fewer and cheaper ops: at small
scale a decode step is per-op overhead, not arithmetic. What differs from the forward:
- `DecodeWeights` holds the weights once in the layout the step wants: q, k and v projections
  fused into one matrix, and on CPU with bf16/fp16 compute an fp32 copy of every matmul weight
  (exact: bf16/fp16 values are fp32 values), so `linear()` no longer converts each weight on
  every call (~200 conversions per step at 4 layers).
- q and k are rotated together (one RoPE expression for both); no T axis, no replay branch, no
  router logits kept for the load-balancing loss.
Every result is rounded where the forward rounds it, so the step gives the same bits as the
cached forward in fp32 and bf16 (tests/test_decode.py), and the engine's routes and log-probs
match one full forward (tests/test_engine.py).

The fused step covers Qwen3-MoE without FP8 only (`fused_decode_supported`). The other families (Qwen2-MoE,
Mixtral, GLM-4.5, DeepSeek-V3 with MLA) decode through `cached_forward_step`: the model's own
forward with the KV cache and T = 1, slower per token but the same math by construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..moe.layers import (KVCache, _emulated_on_cpu, attention, grouped_linear, linear, rms_norm,
                          rope_cos_sin)
from ..moe.model import MoEModel


def fused_decode_supported(model: MoEModel) -> bool:
    """The fused step implements Qwen3-MoE's layer (q/k norm, no biases, softmax router) in
    plain precisions; block FP8 decodes through the model's forward (its fused q/k/v matrix
    would be quantised in other blocks than the separate projections). Exact kernels
    (`MoEModel.set_exact`) decode through the forward too: its kernels are the batch-invariant
    ones the actor runs."""
    return model.cfg.model_type == "qwen3_moe" and not model.fp8 and not model.exact


def make_decode_weights(model: MoEModel) -> "DecodeWeights | None":
    """DecodeWeights for the fused step, or None where the cached forward is used instead."""
    return DecodeWeights(model) if fused_decode_supported(model) else None


@torch.no_grad()
def cached_forward_step(model: MoEModel, ids_B: torch.Tensor, pos_B: torch.Tensor,
                        cache: KVCache, slots_B: torch.Tensor, router_noise_BLE=None):
    """decode_step for any family: one cached forward of T = 1. Same returns as decode_step,
    plus (DSA families) the indexer picks [B, indexer layers, index_topk], else None."""
    out = model(ids_B[:, None], positions_BT=pos_B[:, None], kv_cache=cache,
                cache_slots_B=slots_B, compute_logits=False,
                router_noise_BTLE=None if router_noise_BLE is None else router_noise_BLE[:, None])
    picks = None if out.indexer_BTLK is None else out.indexer_BTLK[:, 0]
    return model.logits(out.hidden_BTD[:, 0]), out.routes_BTLK[:, 0], out.gates_BTLK[:, 0], picks


def _fingerprint(model: MoEModel) -> tuple:
    """Changes whenever a parameter is written in place (version counter) or replaced."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


class DecodeWeights:
    """A model's weights laid out for `decode_step`. Valid while the model's parameters are
    unchanged: `current(model)` checks every parameter's storage and in-place version counter
    (load_state_dict, copy_ and optimiser steps bump it), so a stale copy is never used.
    NOTE: writes through `param.data` bypass the version counter; change an engine's weights
    with `Engine.update_weights` (which rebuilds this object) or in-place ops on the parameters."""

    def __init__(self, model: MoEModel):
        self.key = _fingerprint(model)
        cfg = model.cfg

        def mm_weight(w: torch.Tensor) -> torch.Tensor:
            # linear() and grouped_linear() run bf16/fp16 matmuls as fp32 on CPU anyway; an fp32
            # weight there is used as is (.float() of an fp32 tensor is the tensor itself).
            return w.float() if _emulated_on_cpu(w) else w

        self.layers = []
        for layer in model.layers:
            a = layer.self_attn
            w = dict(
                n1=layer.input_layernorm.weight, n2=layer.post_attention_layernorm.weight,
                # q and k are normalised in one call, then scaled per head (same bits).
                qk_norm=torch.cat([a.q_norm.weight.expand(cfg.num_attention_heads, -1),
                                   a.k_norm.weight.expand(cfg.num_key_value_heads, -1)]),
                qkv=mm_weight(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                o=mm_weight(a.o_proj.weight))
            if layer.is_moe:
                # The router computes in its own weights' dtype (router_dtype): inputs are cast
                # to it and its logits rounded to it, whatever dtype its matmul runs in here.
                w.update(router=mm_weight(layer.mlp.gate.weight),
                         router_dtype=layer.mlp.gate.weight.dtype,
                         gate_up=mm_weight(layer.mlp.experts.gate_up_proj),
                         down=mm_weight(layer.mlp.experts.down_proj))
            else:
                w.update(gate_up=mm_weight(torch.cat([layer.mlp.gate_proj.weight,
                                                      layer.mlp.up_proj.weight])),
                         down=mm_weight(layer.mlp.down_proj.weight))
            self.layers.append(w)
        self.norm = model.norm.weight
        self.lm_head = mm_weight(model.lm_head_weight.to(model.lm_head_dtype))
        self.eps = cfg.rms_norm_eps

    def current(self, model: MoEModel) -> bool:
        return self.key == _fingerprint(model)


@torch.no_grad()
def decode_step(model: MoEModel, dw: DecodeWeights, ids_B: torch.Tensor, pos_B: torch.Tensor,
                cache: KVCache, slots_B: torch.Tensor, router_noise_BLE=None):
    """Feed token ids_B[b] at position pos_B[b] of slot slots_B[b]; returns next-token logits
    [B, V] (in the LM head's dtype), the experts each token ran, int64 [B, L, K], and their
    gate weights as the experts were combined with them (compute dtype) [B, L, K].
    `router_noise_BLE` (fp32 [B, L_moe, E]) is added to the router logits (rollout/mismatch.py)."""
    cfg = model.cfg
    B, dev = ids_B.shape[0], ids_B.device
    H, G, Dh, K = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
        cfg.num_experts_per_tok
    E, eps = cfg.num_experts, dw.eps
    x_BD = model.embed_tokens(ids_B).to(model.compute_dtype)
    cos, sin_signed = rope_cos_sin(pos_B[:, None], Dh, cfg.rope_theta, x_BD.dtype)
    cos, sin_signed = cos.view(B, 1, Dh), sin_signed.view(B, 1, Dh)
    M = int(pos_B.max()) + 1
    # Keys beyond a row's own position belong to the slot's previous occupant or are unwritten.
    allowed_B11M = (torch.arange(M, device=dev) <= pos_B[:, None])[:, None, None]
    # Flat row of (slot, kv head, position) in one layer's (S * G * M_max, Dh) cache view.
    M_max = cache.max_len
    row_BG = ((slots_B[:, None] * G + torch.arange(G, device=dev)) * M_max
              + pos_B[:, None]).reshape(-1)
    s0 = int(slots_B[0])
    consecutive = bool((slots_B == torch.arange(s0, s0 + B, device=dev)).all())
    routes, gates = [], []
    for i, w in enumerate(dw.layers):
        h = rms_norm(x_BD, w["n1"], eps)
        qkv = linear(h, w["qkv"])
        qk = qkv[:, :(H + G) * Dh].view(B, H + G, Dh)
        # rms_norm()'s bf16 form; in fp32 the unweighted norm times the weight is the same bits.
        qk = w["qk_norm"] * F.rms_norm(qk.float(), (Dh,), None, eps).to(qk.dtype)
        v = qkv[:, (H + G) * Dh:].view(B, G, Dh)
        x1, x2 = qk.chunk(2, dim=-1)
        qk = qk * cos + torch.cat([x2, x1], dim=-1) * sin_signed
        q, k = qk[:, :H], qk[:, H:]
        ck, cv = cache.k[i], cache.v[i]  # (S, G, M_max, Dh)
        if ck.dtype != k.dtype:
            raise TypeError(f"KV cache dtype {ck.dtype} != activation dtype {k.dtype}")
        # index_copy_ on the flat rows: cheaper than ck[slots_B, :, pos_B] = k (index_put).
        ck.view(-1, Dh).index_copy_(0, row_BG, k.reshape(B * G, Dh))
        cv.view(-1, Dh).index_copy_(0, row_BG, v.reshape(B * G, Dh))
        if consecutive:
            keys, values = ck[s0:s0 + B, :, :M], cv[s0:s0 + B, :, :M]
        else:
            keys, values = ck[:, :, :M].index_select(0, slots_B), \
                cv[:, :, :M].index_select(0, slots_B)
        o = attention(q[:, :, None], keys, values, allowed_B11M)  # (B, H, 1, Dh)
        x_BD = x_BD + linear(o.reshape(B, H * Dh), w["o"])
        h = rms_norm(x_BD, w["n2"], eps)
        if "router" in w:
            noise = None if router_noise_BLE is None else router_noise_BLE[:, len(routes)]
            y, ids_BK, gates_BK = moe(h, w, K, E, cfg.norm_topk_prob, noise)
            routes.append(ids_BK)
            gates.append(gates_BK)
        else:
            g, u = linear(h, w["gate_up"]).chunk(2, dim=-1)
            # silu of a strided half can take another vector path than DenseMLP's contiguous
            # gate (1 ulp apart on AVX-512 Intel): the same layout, the same bits
            y = linear(F.silu(g.contiguous()) * u, w["down"])
        x_BD = x_BD + y
    hidden = rms_norm(x_BD, dw.norm, eps)
    logits_BV = linear(hidden.to(model.lm_head_dtype), dw.lm_head)
    if not routes:
        return (logits_BV, torch.empty(B, 0, K, dtype=torch.long, device=dev),
                torch.empty(B, 0, K, dtype=x_BD.dtype, device=dev))
    return logits_BV, torch.stack(routes, 1), torch.stack(gates, 1)


def moe(h_BD, w: dict, K: int, E: int, norm_topk_prob: bool, noise_BE=None):
    """Router top-k and the grouped experts (MoEBlock without replay); returns (y_BD, ids_BK,
    gates_BK in h's dtype). `noise_BE` is added to the router logits."""
    router = w["router"]
    router_dtype = w["router_dtype"]
    logits_BE = linear(h_BD.to(router_dtype), router).to(router_dtype).float()
    if noise_BE is not None:
        logits_BE = logits_BE + noise_BE
    probs_BE = logits_BE.softmax(-1)
    gates_BK, ids_BK = probs_BE.topk(K, dim=-1)
    if norm_topk_prob:
        gates_BK = gates_BK / gates_BK.sum(-1, keepdim=True)
    flat = ids_BK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // K
    offs_E = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    g, u = grouped_linear(h_BD.index_select(0, token_of), w["gate_up"], offs_E).chunk(2, dim=-1)
    y = grouped_linear(F.silu(g) * u, w["down"], offs_E)
    gates_BK = gates_BK.to(h_BD.dtype)
    y = y * gates_BK.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(h_BD).index_add_(0, token_of, y), ids_BK, gates_BK
