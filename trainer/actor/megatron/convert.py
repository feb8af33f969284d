"""Exact HF <-> megatron-core weight conversion, whole or TP/EP-sharded: Qwen3-MoE and the
GQA families trainer/actor/megatron/model.py maps (GLM-4.5: q/k/v biases, no q/k norm, sigmoid
router with `e_score_correction_bias` = megatron's `router.expert_bias`, shared experts =
`mlp.shared_experts.linear_fc1/2` split under TP like a dense MLP).

Shapes: V vocab, D model dim, H query heads, G key/value groups, hd head dim, I MLP width
(expert width for experts), E experts; `tp`, `ep`, `etp` parallel sizes, `r` a rank.

Megatron layouts handled (both ways, bit-exact: only slicing, concatenation, reshapes):
- `linear_qkv` [G*(H/G+2)*hd, D]: per query group, that group's H/G query heads, then its key
  head, then its value head. TP splits whole groups: rank r holds groups r*G/tp .. .
- `linear_proj` [D, H*hd]: TP splits columns (the heads of rank r's groups).
- `linear_fc1` = [gate; up] per shard: under TP (dense) or ETP (experts) rank r holds
  [gate rows of r; up rows of r], because megatron's SwiGLU chunks the *local* output in two.
  `linear_fc2` [D, I]: split columns.
- embedding / output layer [V, D]: TP splits rows (vocab-parallel).
- experts: EP rank r holds global experts r*E/ep .. (r+1)*E/ep - 1 as local 0 .. E/ep - 1,
  named `experts.local_experts.{j}.linear_fc{1,2}.weight` (SequentialMLP, local spec) or
  `experts.linear_fc{1,2}.weight{j}` (TEGroupedMLP).
- Transformer Engine spec: the input RMSNorm lives in `linear_qkv.layer_norm_weight` and the
  dense layers' pre-MLP RMSNorm in `mlp.linear_fc1.layer_norm_weight`.
- gpt-oss: HF stacks its experts (`mlp.experts.gate_up_proj` [E, D, 2I] with gate and up
  interleaved on the last axis, `down_proj` [E, I, D], and their biases); megatron holds one
  `linear_fc1` [2I, D] = [gate; up] and `linear_fc2` [D, I] per expert, each with a bias (the
  fc2 bias whole on every ETP rank). `self_attn.sinks` [H] is `core_attention.softmax_offset`
  (TP splits heads); `o_proj.bias` is `linear_proj.bias` (whole); the router's bias is
  `router.bias`.
Norm weights and the router are replicated. `_extra_state` entries (TE) are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Collection, Iterable, Iterator, Mapping

import torch

from lockstep.moe.config import ModelConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class Layout:
    """Where a megatron-core shard sits and how its module names read."""

    tp: int = 1
    ep: int = 1
    etp: int = 1
    grouped_experts: bool = False
    """TEGroupedMLP names (`linear_fc1.weight{j}`) instead of SequentialMLP ones."""
    te_fused_norms: bool = False
    """TE spec: input / dense pre-MLP norms fused into linear_qkv / linear_fc1."""

    @classmethod
    def of_model(cls, model) -> "Layout":
        """The layout of a built GPTModel or list of model chunks (sizes from its config,
        names from its params)."""
        chunks = as_chunks(model)
        c = chunks[0].config
        names = {k for m in chunks for k in m.state_dict().keys()}
        return cls(
            tp=c.tensor_model_parallel_size, ep=c.expert_model_parallel_size,
            etp=c.expert_tensor_parallel_size or c.tensor_model_parallel_size,
            grouped_experts=any(".experts.linear_fc1.weight" in n for n in names),
            te_fused_norms=any(n.endswith("linear_qkv.layer_norm_weight") for n in names),
        )


def _split(x: Tensor, n: int, r: int, dim: int, what: str) -> Tensor:
    if x.shape[dim] % n:
        raise ValueError(f"{what}: dim {dim} of shape {tuple(x.shape)} not divisible by {n}")
    return x.chunk(n, dim=dim)[r]


def _qkv_groups(q: Tensor, k: Tensor, v: Tensor, G: int, hd: int) -> Tensor:
    """[G, (H/G + 2) * hd, ...]: each of the G query groups' q heads, then its k, then its v
    head. Rows of q / k / v are group-major, so TP rank r's chunk of each gives its groups."""
    tail = q.shape[1:]
    q_G = q.view(G, -1, *tail)          # [G, H/G*hd, D]
    k_G = k.view(G, hd, *tail)
    v_G = v.view(G, hd, *tail)
    return torch.cat([q_G, k_G, v_G], dim=1)


def _fc1(gate: Tensor, up: Tensor, n: int, r: int, what: str) -> Tensor:
    return torch.cat([_split(gate, n, r, 0, what), _split(up, n, r, 0, what)], dim=0)


def _expert_names(prefix: str, j: int, lay: Layout, kind: str = "weight") -> tuple[str, str]:
    if lay.grouped_experts:
        return (f"{prefix}.experts.linear_fc1.{kind}{j}",
                f"{prefix}.experts.linear_fc2.{kind}{j}")
    return (f"{prefix}.experts.local_experts.{j}.linear_fc1.{kind}",
            f"{prefix}.experts.local_experts.{j}.linear_fc2.{kind}")


_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _oss_experts_to_megatron(x: str, take, m: str, lay: Layout, ep_rank: int, etp_rank: int,
                             i: int) -> Iterator[tuple[str, Tensor]]:
    """gpt-oss's stacked experts of HF prefix `x` (`...mlp.experts`) -> EP rank `ep_rank`'s
    megatron experts (weights and biases), fc1 / fc2 weights split over ETP. Only this EP rank's
    experts are read (`take` along the expert axis)."""
    gu, gu_b, down, down_b = (take(f"{x}.{n}", lay.ep, ep_rank, 0, f"layer {i} experts")
                              for n in _OSS_EXPERTS)
    for j in range(gu.shape[0]):
        e = ep_rank * gu.shape[0] + j
        what = f"layer {i} expert {e} linear_fc1"
        w1, w2 = _expert_names(f"{m}.mlp", j, lay)
        b1, b2 = _expert_names(f"{m}.mlp", j, lay, "bias")
        yield w1, _fc1(gu[j, :, 0::2].T, gu[j, :, 1::2].T, lay.etp, etp_rank, what)
        yield b1, _fc1(gu_b[j, 0::2], gu_b[j, 1::2], lay.etp, etp_rank, what)
        yield w2, _split(down[j].T, lay.etp, etp_rank, 1, f"layer {i} expert {e} linear_fc2")
        yield b2, down_b[j]


def _oss_experts_to_hf(parts_of, cfg: ModelConfig, m: str, lay: Layout, per_rank: int
                       ) -> dict[str, Tensor]:
    """The inverse: HF stacked expert tensors (suffix -> tensor) from every expert's shards;
    `parts_of(e)` lists expert e's shards over its ETP ranks."""
    gu, gu_b, down, down_b = [], [], [], []
    for e in range(cfg.num_experts):
        parts = parts_of(e)
        w1, w2 = _expert_names(f"{m}.mlp", e % per_rank, lay)
        b1, b2 = _expert_names(f"{m}.mlp", e % per_rank, lay, "bias")
        pairs = [(p[w1].chunk(2, dim=0), p[b1].chunk(2, dim=0)) for p in parts]
        gate = torch.cat([w[0] for w, _ in pairs]).T   # [D, I]
        up = torch.cat([w[1] for w, _ in pairs]).T
        gu.append(torch.stack([gate, up], dim=-1).flatten(-2))  # interleaved [D, 2I]
        gb, ub = torch.cat([b[0] for _, b in pairs]), torch.cat([b[1] for _, b in pairs])
        gu_b.append(torch.stack([gb, ub], dim=-1).flatten(-2))
        down.append(torch.cat([p[w2] for p in parts], dim=1).T)  # [I, D]
        down_b.append(parts[0][b2])
    return dict(zip(_OSS_EXPERTS, map(torch.stack, (gu, gu_b, down, down_b))))


def _mla_names(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    """MLA (DeepSeek-V3) attention: (HF name, megatron name, TP split dim or None when
    replicated). Per-head up-projections split by rows (heads), the output by columns; the
    down-projections and latent norms are replicated."""
    q = [("q_proj.weight", "linear_q_proj.weight", 0)] if cfg.q_lora_rank is None else [
        ("q_a_proj.weight", "linear_q_down_proj.weight", None),
        ("q_a_layernorm.weight", "q_layernorm.weight", None),
        ("q_b_proj.weight", "linear_q_up_proj.weight", 0)]
    return q + [("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight", None),
                ("kv_a_layernorm.weight", "kv_layernorm.weight", None),
                ("kv_b_proj.weight", "linear_kv_up_proj.weight", 0),
                ("o_proj.weight", "linear_proj.weight", 1)]


def hf_to_megatron(hf: Mapping[str, Tensor], cfg: ModelConfig, lay: Layout = Layout(), *,
                   tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0,
                   layers: Iterable[int] | None = None,
                   globals_: Collection[str] | None = None) -> dict[str, Tensor]:
    """The megatron-core state dict of one shard (tp_rank, ep_rank, etp_rank) from HF weights;
    `layers` / `globals_` restrict it (`hf_to_megatron_items`)."""
    return {k: v.contiguous() for k, v in hf_to_megatron_items(
        hf, cfg, lay, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank, layers=layers,
        globals_=globals_)}


def hf_to_megatron_items(hf: Mapping[str, Tensor], cfg: ModelConfig, lay: Layout = Layout(), *,
                         tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0,
                         layers: Iterable[int] | None = None,
                         globals_: Collection[str] | None = None,
                         ) -> Iterator[tuple[str, Tensor]]:
    """`hf_to_megatron` one tensor at a time, reading from `hf` only what the shard holds:
    the decoder layers `layers` (None: all), the global tensors named in `globals_` (megatron
    names: embedding, final norm, output layer; None: all), and of each MoE layer only EP rank
    `ep_rank`'s experts. From a `LazyHF`, TP / ETP splits read only their chunk from disk
    (`LazyHF.part`: rows, or a strided block of columns)."""
    _check_hf_keys(hf, cfg)
    tp, r = lay.tp, tp_rank
    want = (lambda k: True) if globals_ is None else set(globals_).__contains__

    def take(name: str, n: int = 1, rank: int = 0, dim: int = 0, what: str = "") -> Tensor:
        """`hf[name]`, or its rank-th of n chunks along dim (only that chunk read if lazy)."""
        if n == 1:
            return hf[name]
        part = getattr(hf, "part", None)
        if part is not None:
            return part(name, dim=dim, n=n, r=rank)
        return _split(hf[name], n, rank, dim, what or name)

    def fc1(gate: str, up: str, n: int, rank: int, what: str) -> Tensor:
        return torch.cat([take(gate, n, rank, 0, what), take(up, n, rank, 0, what)], dim=0)

    def qkv(i: int, kind: str) -> Tensor:
        h = f"model.layers.{i}.self_attn"
        G = cfg.num_key_value_heads
        if G % tp:
            raise ValueError(f"linear_qkv: {G} key/value heads not divisible by TP={tp}")
        q, k, v = (take(f"{h}.{p}.{kind}", tp, r, 0, "linear_qkv")
                   for p in ("q_proj", "k_proj", "v_proj"))
        return _qkv_groups(q, k, v, G // tp, cfg.head_dim).reshape(-1, *q.shape[1:])

    if want("embedding.word_embeddings.weight"):
        yield ("embedding.word_embeddings.weight",
               take("model.embed_tokens.weight", tp, r, 0, "embedding"))
    if want("decoder.final_layernorm.weight"):
        yield "decoder.final_layernorm.weight", hf["model.norm.weight"]
    if not cfg.tie_word_embeddings and want("output_layer.weight"):
        yield "output_layer.weight", take("lm_head.weight", tp, r, 0, "output_layer")
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        a = f"{m}.self_attention"
        in_norm = f"{a}.linear_qkv.layer_norm_weight" if lay.te_fused_norms \
            else f"{m}.input_layernorm.weight"
        yield in_norm, hf[f"{h}.input_layernorm.weight"]
        if cfg.is_mla:
            for hf_name, mg_name, dim in _mla_names(cfg):
                x = f"{h}.self_attn.{hf_name}"
                yield f"{a}.{mg_name}", hf[x] if dim is None else take(
                    x, tp, r, dim, f"layer {i} {mg_name}")
        else:
            yield f"{a}.linear_qkv.weight", qkv(i, "weight")
            yield f"{a}.linear_proj.weight", take(f"{h}.self_attn.o_proj.weight", tp, r, 1,
                                                  f"layer {i} linear_proj")
            if cfg.attention_bias:
                yield f"{a}.linear_qkv.bias", qkv(i, "bias")
            if cfg.attention_out_bias:
                yield f"{a}.linear_proj.bias", hf[f"{h}.self_attn.o_proj.bias"]
            if cfg.attention_sinks:
                yield f"{a}.core_attention.softmax_offset", take(
                    f"{h}.self_attn.sinks", tp, r, 0, f"layer {i} sinks")
            if cfg.qk_norm:
                yield f"{a}.q_layernorm.weight", hf[f"{h}.self_attn.q_norm.weight"]
                yield f"{a}.k_layernorm.weight", hf[f"{h}.self_attn.k_norm.weight"]
        post_norm = f"{h}.post_attention_layernorm.weight"
        if cfg.is_moe_layer(i) and cfg.model_type == "gpt_oss":
            yield f"{m}.pre_mlp_layernorm.weight", hf[post_norm]
            yield f"{m}.mlp.router.weight", hf[f"{h}.mlp.router.weight"]
            yield f"{m}.mlp.router.bias", hf[f"{h}.mlp.router.bias"]
            yield from _oss_experts_to_megatron(f"{h}.mlp.experts", take, m, lay, ep_rank,
                                                etp_rank, i)
        elif cfg.is_moe_layer(i):
            yield f"{m}.pre_mlp_layernorm.weight", hf[post_norm]
            yield f"{m}.mlp.router.weight", hf[f"{h}.mlp.gate.weight"]
            if cfg.expert_bias:
                yield (f"{m}.mlp.router.expert_bias",
                       hf[f"{h}.mlp.gate.e_score_correction_bias"].float())
            if cfg.n_shared_experts:  # a dense MLP, TP-split like one
                x = f"{h}.mlp.shared_experts"
                yield f"{m}.mlp.shared_experts.linear_fc1.weight", fc1(
                    f"{x}.gate_proj.weight", f"{x}.up_proj.weight", tp, r,
                    f"layer {i} shared_experts linear_fc1")
                yield f"{m}.mlp.shared_experts.linear_fc2.weight", take(
                    f"{x}.down_proj.weight", tp, r, 1, f"layer {i} shared_experts linear_fc2")
            per_rank = cfg.num_experts // lay.ep
            for j in range(per_rank):
                e = ep_rank * per_rank + j
                x = f"{h}.mlp.experts.{e}"
                name1, name2 = _expert_names(f"{m}.mlp", j, lay)
                yield name1, fc1(f"{x}.gate_proj.weight", f"{x}.up_proj.weight", lay.etp,
                                 etp_rank, f"layer {i} expert {e} linear_fc1")
                yield name2, take(f"{x}.down_proj.weight", lay.etp, etp_rank, 1,
                                  f"layer {i} expert {e} linear_fc2")
        else:
            norm = f"{m}.mlp.linear_fc1.layer_norm_weight" if lay.te_fused_norms \
                else f"{m}.pre_mlp_layernorm.weight"
            yield norm, hf[post_norm]
            yield f"{m}.mlp.linear_fc1.weight", fc1(
                f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight", tp, r,
                f"layer {i} linear_fc1")
            yield f"{m}.mlp.linear_fc2.weight", take(f"{h}.mlp.down_proj.weight", tp, r, 1,
                                                     f"layer {i} linear_fc2")


def megatron_to_hf(shards: Mapping[tuple[int, int, int], Mapping[str, Tensor]],
                   cfg: ModelConfig, lay: Layout = Layout(), *,
                   layers: list[int] | None = None,
                   with_globals: bool = True) -> dict[str, Tensor]:
    """HF weights from megatron-core shards keyed by (tp_rank, ep_rank, etp_rank).

    TP-split tensors are read from a shard of each TP rank, experts from a shard of each
    (EP rank, ETP rank); replicated tensors from any shard (all copies are equal).
    `layers` (None = all) and `with_globals` (embedding, final norm, LM head) restrict the
    conversion to part of the model; the shards need to hold only that part.
    """
    def pick(what: str, want) -> Mapping[str, Tensor]:
        for key in sorted(shards):
            if want(key):
                return shards[key]
        raise ValueError(f"megatron_to_hf needs a shard with {what}; have (tp_rank, ep_rank, "
                         f"etp_rank) {sorted(shards)}")

    tps = [pick(f"tp_rank={r}", lambda k, r=r: k[0] == r) for r in range(lay.tp)]
    s0 = tps[0]
    expert_shards = {(e, t): pick(f"ep_rank={e}, etp_rank={t}",
                                  lambda k, e=e, t=t: k[1] == e and k[2] == t)
                     for e in range(lay.ep) for t in range(lay.etp)}
    G, hd, D = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    qpg = cfg.num_attention_heads // G  # query heads per group

    def cat_tp(name: str, dim: int) -> Tensor:
        return torch.cat([s[name] for s in tps], dim=dim)

    def unfc1(parts: list[Tensor]) -> tuple[Tensor, Tensor]:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])

    hf: dict[str, Tensor] = {}
    if with_globals:
        hf["model.embed_tokens.weight"] = cat_tp("embedding.word_embeddings.weight", 0)
        hf["model.norm.weight"] = s0["decoder.final_layernorm.weight"]
        if not cfg.tie_word_embeddings:
            hf["lm_head.weight"] = cat_tp("output_layer.weight", 0)
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        a = f"{m}.self_attention"
        in_norm = f"{a}.linear_qkv.layer_norm_weight" if lay.te_fused_norms \
            else f"{m}.input_layernorm.weight"
        hf[f"{h}.input_layernorm.weight"] = s0[in_norm]
        if cfg.is_mla:
            for hf_name, mg_name, dim in _mla_names(cfg):
                hf[f"{h}.self_attn.{hf_name}"] = s0[f"{a}.{mg_name}"] if dim is None \
                    else cat_tp(f"{a}.{mg_name}", dim)
        else:
            for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
                tail = (D,) if kind == "weight" else ()
                qkv_G = cat_tp(f"{a}.linear_qkv.{kind}", 0).view(G, (qpg + 2) * hd, *tail)
                q_G, k_G, v_G = qkv_G.split([qpg * hd, hd, hd], dim=1)
                hf[f"{h}.self_attn.q_proj.{kind}"] = q_G.reshape(-1, *tail)
                hf[f"{h}.self_attn.k_proj.{kind}"] = k_G.reshape(-1, *tail)
                hf[f"{h}.self_attn.v_proj.{kind}"] = v_G.reshape(-1, *tail)
            hf[f"{h}.self_attn.o_proj.weight"] = cat_tp(f"{a}.linear_proj.weight", 1)
            if cfg.attention_out_bias:
                hf[f"{h}.self_attn.o_proj.bias"] = s0[f"{a}.linear_proj.bias"]
            if cfg.attention_sinks:
                hf[f"{h}.self_attn.sinks"] = cat_tp(f"{a}.core_attention.softmax_offset", 0)
            if cfg.qk_norm:
                hf[f"{h}.self_attn.q_norm.weight"] = s0[f"{a}.q_layernorm.weight"]
                hf[f"{h}.self_attn.k_norm.weight"] = s0[f"{a}.k_layernorm.weight"]
        if cfg.is_moe_layer(i) and cfg.model_type == "gpt_oss":
            hf[f"{h}.post_attention_layernorm.weight"] = s0[f"{m}.pre_mlp_layernorm.weight"]
            hf[f"{h}.mlp.router.weight"] = s0[f"{m}.mlp.router.weight"]
            hf[f"{h}.mlp.router.bias"] = s0[f"{m}.mlp.router.bias"]
            per_rank = cfg.num_experts // lay.ep
            stacked = _oss_experts_to_hf(
                lambda e: [expert_shards[(e // per_rank, t)] for t in range(lay.etp)],
                cfg, m, lay, per_rank)
            hf.update({f"{h}.mlp.experts.{n}": t for n, t in stacked.items()})
        elif cfg.is_moe_layer(i):
            hf[f"{h}.post_attention_layernorm.weight"] = s0[f"{m}.pre_mlp_layernorm.weight"]
            hf[f"{h}.mlp.gate.weight"] = s0[f"{m}.mlp.router.weight"]
            if cfg.expert_bias:
                hf[f"{h}.mlp.gate.e_score_correction_bias"] = s0[f"{m}.mlp.router.expert_bias"]
            if cfg.n_shared_experts:
                x = f"{h}.mlp.shared_experts"
                hf[f"{x}.gate_proj.weight"], hf[f"{x}.up_proj.weight"] = unfc1(
                    [s[f"{m}.mlp.shared_experts.linear_fc1.weight"] for s in tps])
                hf[f"{x}.down_proj.weight"] = cat_tp(f"{m}.mlp.shared_experts.linear_fc2.weight", 1)
            per_rank = cfg.num_experts // lay.ep
            for e in range(cfg.num_experts):
                fc1, fc2 = _expert_names(f"{m}.mlp", e % per_rank, lay)
                parts = [expert_shards[(e // per_rank, t)] for t in range(lay.etp)]
                x = f"{h}.mlp.experts.{e}"
                hf[f"{x}.gate_proj.weight"], hf[f"{x}.up_proj.weight"] = unfc1(
                    [p[fc1] for p in parts])
                hf[f"{x}.down_proj.weight"] = torch.cat([p[fc2] for p in parts], dim=1)
        else:
            norm = f"{m}.mlp.linear_fc1.layer_norm_weight" if lay.te_fused_norms \
                else f"{m}.pre_mlp_layernorm.weight"
            hf[f"{h}.post_attention_layernorm.weight"] = s0[norm]
            hf[f"{h}.mlp.gate_proj.weight"], hf[f"{h}.mlp.up_proj.weight"] = unfc1(
                [s[f"{m}.mlp.linear_fc1.weight"] for s in tps])
            hf[f"{h}.mlp.down_proj.weight"] = cat_tp(f"{m}.mlp.linear_fc2.weight", 1)
    return {k: v.contiguous() for k, v in hf.items()}


def expected_hf_keys(cfg: ModelConfig) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        keys.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        h = f"model.layers.{i}"
        keys |= {f"{h}.input_layernorm.weight", f"{h}.post_attention_layernorm.weight"}
        if cfg.is_mla:
            keys |= {f"{h}.self_attn.{n}" for n, _, _ in _mla_names(cfg)}
        else:
            keys |= {f"{h}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj",
                                                            "o_proj")}
        if cfg.qk_norm:
            keys |= {f"{h}.self_attn.q_norm.weight", f"{h}.self_attn.k_norm.weight"}
        if cfg.attention_bias:
            keys |= {f"{h}.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")}
        if cfg.attention_out_bias:
            keys.add(f"{h}.self_attn.o_proj.bias")
        if cfg.attention_sinks:
            keys.add(f"{h}.self_attn.sinks")
        if cfg.is_moe_layer(i) and cfg.model_type == "gpt_oss":
            keys |= {f"{h}.mlp.router.weight", f"{h}.mlp.router.bias"}
            keys |= {f"{h}.mlp.experts.{n}" for n in _OSS_EXPERTS}
        elif cfg.is_moe_layer(i):
            keys.add(f"{h}.mlp.gate.weight")
            if cfg.expert_bias:
                keys.add(f"{h}.mlp.gate.e_score_correction_bias")
            if cfg.n_shared_experts:
                keys |= {f"{h}.mlp.shared_experts.{p}.weight"
                         for p in ("gate_proj", "up_proj", "down_proj")}
            keys |= {f"{h}.mlp.experts.{e}.{p}.weight" for e in range(cfg.num_experts)
                     for p in ("gate_proj", "up_proj", "down_proj")}
        else:
            keys |= {f"{h}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    return keys


def _check_hf_keys(hf: Mapping[str, Tensor], cfg: ModelConfig) -> None:
    want = expected_hf_keys(cfg)
    have = set(hf)
    if cfg.tie_word_embeddings:
        have.discard("lm_head.weight")  # tied checkpoints may still carry a copy
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise ValueError(f"HF state dict does not match the config: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")


# -- on a live model (uses megatron-core's parallel state) -----------------------------------
def _ranks() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps
    return (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank())


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def as_chunks(model) -> list:
    """A GPTModel (maybe DDP-wrapped) as a list of one; a list of model chunks as it is."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def stage_layers(model) -> dict[int, int]:
    """This pipeline stage's (or model chunk's) decoder layers: local index -> global layer
    index. A list of model chunks is refused (their local indices overlap: ask each chunk)."""
    if isinstance(model, (list, tuple)):
        raise TypeError("stage_layers takes one model chunk; call it per chunk")
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return {j: layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}


def chunk_state(model, tensors=None) -> dict[str, Tensor]:
    """Whole-model names -> this rank's tensors over all its model chunks (`tensors`: one
    mapping of local names per chunk, default each chunk's state dict)."""
    chunks = as_chunks(model)
    if tensors is None:
        tensors = [m.state_dict() for m in chunks]
    elif not isinstance(tensors, (list, tuple)):
        tensors = [tensors]
    if len(tensors) != len(chunks):
        raise ValueError(f"{len(tensors)} tensor mappings for {len(chunks)} model chunks")
    out: dict[str, Tensor] = {}
    for m, t in zip(chunks, tensors):
        out.update(global_names(m, t))
    return out


def global_names(model, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` keyed by this stage's (or model chunk's) local megatron names -> keyed by
    whole-model names (`decoder.layers.{j}` of a chunk is its j-th layer's global index);
    PP=1: unchanged. For all chunks of a rank at once: `chunk_state`."""
    g = stage_layers(model)

    def rename(k: str) -> str:
        m = _LAYER.match(k)
        return k if m is None else f"decoder.layers.{g[int(m.group(1))]}." + k[m.end():]
    return {rename(k): v for k, v in tensors.items() if not k.endswith("_extra_state")}


def load_hf_into_megatron(model, hf: Mapping[str, Tensor], cfg: ModelConfig) -> None:
    """Copy HF weights into this rank's shard of a built GPTModel (its pipeline stage's
    layers, embedding on the first stage, final norm / LM head on the last), one tensor at a
    time: only this shard's tensors are read from `hf` (`hf_to_megatron_items`; a `LazyHF`
    then reads the shard from disk, not the model). Every tensor is checked; a mismatch
    raises after the pass, naming every tensor not produced, not expected or mis-shaped.
    `model` may be a list of model chunks (virtual pipeline): each reads its own layers."""
    if isinstance(model, (list, tuple)):
        for chunk in model:
            load_hf_into_megatron(chunk, hf, cfg)
        return
    lay = Layout.of_model(model)
    tp_rank, ep_rank, etp_rank = _ranks()
    own = global_names(model, model.state_dict())
    layers = sorted(stage_layers(model).values())
    glob = [k for k in own if not _LAYER.match(k)]
    done, unexpected, bad = set(), [], []
    with torch.no_grad():
        for k, v in hf_to_megatron_items(hf, cfg, lay, tp_rank=tp_rank, ep_rank=ep_rank,
                                         etp_rank=etp_rank, layers=layers, globals_=glob):
            if k not in own:
                unexpected.append(k)
            elif own[k].shape != v.shape:
                bad.append(f"{k}: model {tuple(own[k].shape)} vs converted {tuple(v.shape)}")
            else:
                own[k].copy_(v)
                done.add(k)
            del v
    missing = sorted(set(own) - done - {b.split(":")[0] for b in bad})
    if missing or unexpected or bad:
        raise ValueError(f"HF -> megatron mismatch: model tensors not produced {missing}, "
                         f"produced but not in the model {sorted(unexpected)}, shape "
                         f"mismatches {sorted(bad)}")


def megatron_to_hf_state_dict(model, cfg: ModelConfig,
                              tensors: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Full HF state dict from a (possibly sharded) GPTModel; a collective over the world.

    `tensors` replaces the weights with same-named, same-shaped tensors of this rank (e.g.
    gradients; a list of one mapping per chunk when `model` is a list of model chunks). Gathers every rank's shard with all_gather_object (CPU copies): meant for
    checkpoint export of small models and for tests, not for streaming a large model.
    """
    import torch.distributed as dist

    lay = Layout.of_model(model)
    local = {k: v.detach().cpu() for k, v in chunk_state(model, tensors).items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (_ranks(), local))
    shards: dict = {}
    for ranks, sd in everyone:  # DP copies are equal; PP stages hold disjoint names
        shards.setdefault(ranks, {}).update(sd)
    return megatron_to_hf(shards, cfg, lay)


def export_hf(model, cfg: ModelConfig, bucket_bytes: int):
    """HF-named weights of a (possibly sharded) GPTModel in buckets of at most `bucket_bytes`
    (`lockstep.moe.buckets`); a collective over the world: every rank must iterate it to the
    end, and every rank gets the same buckets.

    Gathered one part at a time (embedding / final norm / LM head, then each decoder layer):
    a rank never holds more than one layer of every rank's shards plus the current bucket.
    `model` may be a list of model chunks (virtual pipeline).
    """
    import torch.distributed as dist

    from lockstep.moe.buckets import bucketize

    lay = Layout.of_model(model)
    local = chunk_state(model)
    ranks = _ranks()

    def gathered(mine: dict[str, Tensor]) -> dict[tuple[int, int, int], dict[str, Tensor]]:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (ranks, {k: v.detach().cpu() for k, v in mine.items()}))
        shards: dict[tuple[int, int, int], dict[str, Tensor]] = {}
        for r, sd in everyone:  # DP copies are equal; PP stages hold disjoint names
            shards.setdefault(r, {}).update(sd)
        return shards

    def named():
        glob = {k: v for k, v in local.items() if not k.startswith("decoder.layers.")}
        yield from megatron_to_hf(gathered(glob), cfg, lay, layers=[]).items()
        for i in range(cfg.num_hidden_layers):
            pre = f"decoder.layers.{i}."
            part = gathered({k: v for k, v in local.items() if k.startswith(pre)})
            yield from megatron_to_hf(part, cfg, lay, layers=[i], with_globals=False).items()

    return bucketize(named(), bucket_bytes)
