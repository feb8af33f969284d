"""MoE policy models in plain torch (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3), with
routers that replay given routes (moe/router.py).

Shape legend (suffixes): B batch, T time (tokens per row), N = B*T flattened tokens, D model
width, H query heads, G key/value heads, Dh head width, V vocab, E experts, K top-k, L MoE
layers (the internal route axis: MoE layers only, in decoder order), I expert width,
S cache slots, M cache length.

Model math knows nothing of process groups; parallelism is applied from outside. The building
blocks (matmuls, norms, RoPE, the KV cache, attention) are in moe/layers.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import exact as exact_kernels
from ..kernels.routes import RouteError, check_gates_BTLK, check_routes_BTLK
from .config import ModelConfig
from .layers import (Attention, CacheRows, KVCache, MLAttention, RMSNorm, grouped_linear, linear,
                     rope_cos_sin)
from .dsa import indexer_replay
from .gpt_oss import GptOssExperts
from .mixers import layer_norm, token_mixer
from .mtp import MTPLayer
from .replay_check import RouteCheck, check_registered
from .router import bias_update, expert_load, partial_replay_mask, route, router_probs


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
    gates_BTLK: torch.Tensor
    """Detached gate weights the experts were combined with, in the compute dtype (the
    replayed ones where gate weights were replayed)."""
    router_logits_LNE: list[torch.Tensor]
    """Per MoE layer, fp32 router logits of all N tokens (for the load-balancing loss)."""
    replayed_BTL: torch.Tensor | None = None
    """bool: where each MoE layer ran the given ids (the replay mask, narrowed per layer by
    partial replay); None when nothing was given."""
    indexer_BTLK: torch.Tensor | None = None
    """DSA families: int64 key positions each token attended to per indexer layer (the given
    ones where replayed), ascending, -1 padded to index_topk; None for the others."""
    indexer_natural_BTLK: torch.Tensor | None = None
    """DSA families: the indexers' own picks from the same pass."""


class DenseMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fp8 = False  # block FP8 projections (set_precision)
        self.exact = False  # batch-invariant kernels (set_exact)

    def forward(self, x):
        mm = dict(fp8=self.fp8, exact=self.exact)
        g = linear(x, self.gate_proj.weight, **mm)
        h = _silu(g, self.exact) * linear(x, self.up_proj.weight, **mm)
        return linear(h, self.down_proj.weight, **mm)


def _silu(x: torch.Tensor, exact: bool) -> torch.Tensor:
    return exact_kernels.silu(x) if exact else F.silu(x)


class Experts(nn.Module):
    """E SwiGLU experts stored stacked; each expert runs once on the tokens routed to it."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))  # (E, 2I, D)
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))  # (E, D, I)
        self.fp8 = False  # block FP8 matmuls, 128x128 blocks per expert (set_precision)
        self.exact = False  # batch-invariant kernels (set_exact)

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
        mm = dict(fp8=self.fp8, exact=self.exact)
        g, u = grouped_linear(x_sorted, self.gate_up_proj, offs_E, **mm).chunk(2, dim=-1)
        y_sorted = grouped_linear(_silu(g, self.exact) * u, self.down_proj, offs_E, **mm)
        y_sorted = y_sorted * gates_NK.reshape(-1).index_select(0, order)[:, None]
        if self.exact:  # each token's K outputs added in top-k order, in fp32, rounded once
            y_NKD = y_sorted.index_select(0, torch.argsort(order)).view(N, K, -1).float()
            return exact_kernels.sum_in_order(y_NKD, 1)[:, 0].to(x_ND.dtype)
        return torch.zeros_like(x_ND).index_add_(0, token_of, y_sorted)


class MoEBlock(nn.Module):
    """Router (moe/router.py: the family picks or replays ids and computes gate weights) +
    grouped experts + optional shared experts. Replay fixes the ids; the gate weights are
    recomputed from the current router unless replayed too (`replay_gates_NK`, straight-through:
    moe/router.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # router (E, D); gpt-oss's has a logit bias
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        if cfg.expert_bias:
            # Selection-only bias (aux-loss-free balancing); a buffer: no gradient, kept fp32.
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.experts = GptOssExperts(cfg) if cfg.swiglu_limit is not None else \
            Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.n_shared_experts:  # DeepSeek-V3 / GLM-4.5: always on, weight 1
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_expert_width)
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE: scaled by a sigmoid gate
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_width)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.exact = False  # batch-invariant kernels (set_exact)

    def forward(self, x_BTD, replay_ids_NK, replay_mask_N, replay_gates_NK=None, partial=None,
                noise_NE=None):
        """`partial` (a `lockstep.replay.PartialReplay`: rule, threshold) narrows the replay
        mask to the tokens whose router is unsure enough (`partial_replay_mask`). `noise_NE`
        (fp32) is added to the router logits (an engine's injected mismatch,
        rollout/mismatch.py). Returns (y, ids run, natural top-k, router logits, gates used,
        replay mask used or None)."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        w = self.gate.weight  # the router computes in its own weights' dtype (router_dtype)
        router_logits_NE = linear(x_ND.to(w.dtype), w, self.gate.bias, exact=self.exact).float()
        if noise_NE is not None:
            router_logits_NE = router_logits_NE + noise_NE
        if partial is not None and replay_ids_NK is not None:
            replay_mask_N = replay_mask_N & partial_replay_mask(
                router_logits_NE, self.cfg, replay_ids_NK, partial.rule, partial.threshold)
        ids_NK, gates_NK, natural_NK = route(router_logits_NE, self.cfg,
                                             self.e_score_correction_bias, replay_ids_NK,
                                             replay_mask_N, replay_gates_NK, exact=self.exact)
        gates_NK = gates_NK.to(x_ND.dtype)
        y_ND = self.experts(x_ND, ids_NK, gates_NK)
        if self.cfg.n_shared_experts:
            y_ND = y_ND + self.shared_experts(x_ND)
        if self.cfg.shared_expert_intermediate_size:
            logit_N1 = linear(x_ND, self.shared_expert_gate.weight, exact=self.exact)
            g_N1 = exact_kernels.sigmoid(logit_N1) if self.exact else torch.sigmoid(logit_N1)
            y_ND = y_ND + g_N1 * self.shared_expert(x_ND)
        return (y_ND.view(B, T, D), ids_NK, natural_NK, router_logits_NE, gates_NK.detach(),
                replay_mask_N)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.input_layernorm = layer_norm(cfg, cfg.hidden_size)
        self.self_attn = token_mixer(cfg, layer_idx)  # attention, or linear attention
        self.post_attention_layernorm = layer_norm(cfg, cfg.hidden_size)
        self.mlp = MoEBlock(cfg) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)


class MoEModel(nn.Module):
    """MoE causal LM of any supported family. See docs/model.md for the replay contract."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = layer_norm(cfg, cfg.hidden_size)
        # draft layers engines speculate with (moe/mtp.py): outside forward and route replay
        self.mtp = nn.ModuleList(MTPLayer(cfg, k, DecoderLayer, layer_norm)
                                 for k in range(cfg.num_nextn_predict_layers))
        self.lm_head = None if cfg.tie_word_embeddings else \
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compute_dtype = torch.float32
        self.lm_head_dtype = torch.float32
        self.fp8 = False
        """Block-FP8 matmuls (set_precision)."""
        self.exact = False
        """Batch-invariant kernels (set_exact)."""
        for i, block in enumerate(self.moe_blocks):
            block.moe_index = i  # what the router reports to a RouteCheck as its layer
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        for m in self.modules():  # zero-centred norms, linear attention's decay rates
            if hasattr(m, "reset_family_parameters"):
                m.reset_family_parameters()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_precision(self, dtype: torch.dtype, router_dtype: torch.dtype | None = None,
                      lm_head_dtype: torch.dtype | None = None, fp8: bool = False) -> "MoEModel":
        """Cast for inference/training: everything to dtype, router and LM head optionally
        kept in a wider dtype (they then compute in it). With tied embeddings a wider LM head
        keeps the shared matrix wide; lookups are cast to dtype. `fp8`: the attention, MLP and
        expert matmuls run in block FP8 (moe/layers.py fp8_linear); the routers, the
        shared-expert gate, embeddings and LM head do not (as SGLang and DeepSeek-V3's FP8
        checkpoints leave them). The weights it quantises stay fp32 (not rounded to dtype
        first): they quantise to what an FP8 export of the fp32 weights holds, the weights a
        trainer pushes to an FP8 engine (docs/precision.md)."""
        if fp8 and not self.cfg.supports_fp8:
            raise ValueError(f"block-FP8 matmuls are not mapped for model_type "
                             f"{self.cfg.model_type!r} (docs/precision.md)")
        quantised = [m for m in self.modules()
                     if isinstance(m, (Attention, MLAttention, DenseMLP, Experts))]
        # each tensor is cast once from the values it holds: a tensor kept wider than `dtype`
        # is not rounded to `dtype` on the way (an fp32 router of fp32 weights is those weights)
        wide: dict[int, torch.dtype] = {}
        if fp8:
            wide |= {id(p): torch.float32 for m in quantised for p in m.parameters() if p.dim() >= 2}
        moe = [layer.mlp for layer in self.layers if layer.is_moe]
        if router_dtype is not None:
            wide |= {id(p): router_dtype for mlp in moe for p in mlp.gate.parameters()}
        if lm_head_dtype is not None:
            head = self.embed_tokens if self.lm_head is None else self.lm_head
            wide |= {id(p): lm_head_dtype for p in head.parameters()}
        # the selection bias stays fp32 (as HF keeps it)
        wide |= {id(mlp.e_score_correction_bias): torch.float32 for mlp in moe
                 if mlp.e_score_correction_bias is not None}
        for t in [*self.parameters(), *self.buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(wide.get(id(t), dtype))
        for m in quantised:
            m.fp8 = fp8
        self.fp8 = fp8
        self.compute_dtype = dtype
        self.lm_head_dtype = lm_head_dtype or dtype
        return self

    def set_exact(self, exact: bool = True) -> "MoEModel":
        """Run every forward through the batch-invariant kernels (kernels/exact.py): a token's
        hidden states, routes and logits get the same bits whatever else is in the batch, its
        padding, and whether it came through a full forward, a prefill or a KV-cache decode
        step (docs/precision.md "Exact mode"). Logits are then fp32 (`logits`). Not with block
        FP8 nor multi-head latent attention (refused)."""
        if exact and self.fp8:
            raise ValueError("exact kernels do not cover block FP8 (rollout.dtype=fp8 / "
                             "actor.fp8); use bf16, fp16 or fp32")
        if exact and self.cfg.is_mla:
            raise ValueError(f"exact kernels do not cover multi-head latent attention "
                             f"(model_type {self.cfg.model_type}); GQA families only")
        for m in self.modules():
            if hasattr(m, "exact"):
                m.exact = exact
        return self

    def logits(self, hidden_XD: torch.Tensor) -> torch.Tensor:
        w = self.lm_head_weight
        if self.exact:  # fp32, unrounded: what kernels.exact.logprobs gathers from
            return exact_kernels.linear(hidden_XD.to(self.lm_head_dtype), w.to(self.lm_head_dtype),
                                        out_dtype=torch.float32)
        return linear(hidden_XD.to(self.lm_head_dtype), w.to(self.lm_head_dtype))

    def _check_routes(self, ids_BTLK: torch.Tensor, mask_BT: torch.Tensor, B: int, T: int):
        """Shapes only: the ids were validated where they entered (`RoutingTrace`, the one
        route validator) or come from this model's own top-k (R2), so no pass over them here."""
        cfg = self.cfg
        check_routes_BTLK(ids_BTLK, mask_BT, what="routed_experts", mask="replay_mask",
                          shape=(B, T, cfg.num_moe_layers, cfg.num_experts_per_tok))
        return ids_BTLK.long()

    def _check_routers(self, check: RouteCheck) -> None:
        """Orphaned routers (moe/replay_check.py `check_registered`): every MoE block of the
        decoder (the draft layers stay out of replay) must be a replayed layer's."""
        blocks = [(name, getattr(m, "moe_index", None)) for name, m in self.named_modules()
                  if isinstance(m, MoEBlock) and not name.startswith("mtp.")]
        reported = [f"layers.{i}.mlp" for i, layer in enumerate(self.layers) if layer.is_moe]
        check_registered(blocks, self.cfg.num_moe_layers, reported, check.what)

    def forward(self, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor | None = None,
                routed_experts_BTLK: torch.Tensor | None = None,
                replay_mask_BT: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, cache_slots_B: torch.Tensor | None = None,
                compute_logits: bool = True,
                routed_gates_BTLK: torch.Tensor | None = None,
                replay_check: RouteCheck | None = None,
                partial_replay=None,
                indexer_topk_BTLK: torch.Tensor | None = None,
                indexer_mask_BT: torch.Tensor | None = None,
                router_noise_BTLE: torch.Tensor | None = None) -> ModelOutput:
        """`routed_experts_BTLK` (+ `replay_mask_BT`, default all True) replays expert ids;
        `routed_gates_BTLK` (any float dtype, same shape) replays their gate weights too, where
        the mask is set (straight-through: the forward uses them, the router's gradient is that
        of its own gates at those ids). `replay_check` (with `routed_experts_BTLK`): every MoE
        router reports the ids it ran to it, and it is finished after the last layer
        (moe/replay_check.py). `partial_replay` (`lockstep.replay.PartialReplay`) replays a
        (token, layer) only where that layer's router is unsure enough. DSA families:
        `indexer_topk_BTLK` (request-local key positions, -1 padded, [B, T, indexer layers,
        index_topk]; + `indexer_mask_BT`, default all True) replays the lightning indexer's
        picks (moe/dsa.py). `router_noise_BTLE`
        (fp32, [B, T, L_moe, E]) is added to each MoE layer's router logits before its experts
        are chosen and weighted (an engine's injected mismatch, rollout/mismatch.py)."""
        cfg = self.cfg
        B, T = input_ids_BT.shape
        if positions_BT is None:
            positions_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
        if kv_cache is not None and cache_slots_B is None:
            cache_slots_B = torch.arange(B, device=input_ids_BT.device)
        replay_ids_LNK: list[torch.Tensor | None] = [None] * cfg.num_moe_layers
        replay_gates_LNK: list[torch.Tensor | None] = [None] * cfg.num_moe_layers
        replay_mask_N = None
        if routed_gates_BTLK is not None:
            if routed_experts_BTLK is None:
                raise RouteError("routed_gates given without routed_experts")
            check_gates_BTLK(routed_gates_BTLK, routed_experts_BTLK.shape)
            replay_gates_LNK = list(routed_gates_BTLK.reshape(B * T, cfg.num_moe_layers, -1)
                                    .unbind(1))
        if routed_experts_BTLK is not None:
            if replay_mask_BT is None:
                replay_mask_BT = torch.ones(B, T, dtype=torch.bool, device=input_ids_BT.device)
            ids = self._check_routes(routed_experts_BTLK, replay_mask_BT, B, T)
            replay_ids_LNK = list(ids.reshape(B * T, cfg.num_moe_layers, -1).unbind(1))
            replay_mask_N = replay_mask_BT.reshape(-1)
        elif replay_mask_BT is not None:
            raise RouteError("replay_mask given without routed_experts")

        x = self.embed_tokens(input_ids_BT).to(self.compute_dtype)
        if self.exact:  # one table for every position, looked up: the same bits on any path
            table = rope_cos_sin(torch.arange(cfg.max_position_embeddings, device=x.device)[None],
                                 cfg.rotary_dim, cfg.rope_theta, x.dtype, cfg.rope_scaling,
                                 cfg.max_position_embeddings)
            cos, sin_signed = (t[0, 0][positions_BT][:, None] for t in table)
        else:
            cos, sin_signed = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta, x.dtype,
                                           cfg.rope_scaling, cfg.max_position_embeddings)
        cache_rows = None if kv_cache is None else \
            CacheRows.build(kv_cache, cache_slots_B, positions_BT)
        if replay_check is not None:
            self._check_routers(replay_check)
        routes, natural, router_logits, gates, replayed = [], [], [], [], []
        sparse = None
        if cfg.is_dsa:
            sparse = indexer_replay(cfg, indexer_topk_BTLK, indexer_mask_BT, B, T,
                                    input_ids_BT.device)
        elif indexer_topk_BTLK is not None:
            raise RouteError(f"indexer_topk given, but model_type {cfg.model_type} has no "
                             f"lightning indexer")
        for d, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + (layer.self_attn(h, cos, sin_signed, cache_rows) if sparse is None else
                     layer.self_attn(h, cos, sin_signed, cache_rows, sparse))
            h = layer.post_attention_layernorm(x)
            if layer.is_moe:
                l = len(routes)
                noise_NE = None if router_noise_BTLE is None else \
                    router_noise_BTLE[:, :, l].reshape(B * T, -1)
                y, ids_NK, nat_NK, logits_NE, gates_NK, mask_N = layer.mlp(
                    h, replay_ids_LNK[l], replay_mask_N, replay_gates_LNK[l], partial_replay,
                    noise_NE)
                gates.append(gates_NK)
                replayed.append(mask_N)
                if replay_check is not None:  # partial replay: only its replayed tokens count
                    replay_check.ran(getattr(layer.mlp, "moe_index", None), ids_NK, nat_NK,
                                     None if partial_replay is None else mask_N,
                                     router=f"layers.{d}.mlp")
                routes.append(ids_NK)
                natural.append(nat_NK)
                router_logits.append(logits_NE)
            else:
                y = layer.mlp(h)
            x = x + y
        if replay_check is not None:
            replay_check.finish()
        hidden = self.norm(x)
        K = cfg.num_experts_per_tok
        empty = torch.empty(B, T, 0, K, dtype=torch.long, device=x.device)
        return ModelOutput(
            logits_BTV=self.logits(hidden) if compute_logits else None,
            hidden_BTD=hidden,
            routes_BTLK=torch.stack(routes, 1).view(B, T, -1, K) if routes else empty,
            natural_BTLK=torch.stack(natural, 1).view(B, T, -1, K) if natural else empty,
            gates_BTLK=(torch.stack(gates, 1).view(B, T, -1, K) if gates
                        else empty.to(self.compute_dtype)),
            replayed_BTL=(torch.stack(replayed, 1).view(B, T, -1)
                          if replay_mask_N is not None and replayed else None),
            indexer_BTLK=None if sparse is None else torch.stack(sparse.used, 2),
            indexer_natural_BTLK=None if sparse is None else torch.stack(sparse.natural, 2),
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
