"""What lockstep asks of megatron-core, worked out without importing it: the layout options
(`MegatronOptions`), the layout rules (which TP x EP x ETP x PP x VPP layouts of which model
megatron-core 0.16.1 runs here: `layout_problems`, the one place they live), and the arguments
of the `TransformerConfig`, the DDP config and the optimizer (`megatron_args`, `ddp_args`,
`optimizer_args`) as plain dicts. `model.transformer_config` builds the TransformerConfig from
them and `lockstep plan` prints them, so the plan shows what runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from lockstep.kernels.device import resolve_device
from lockstep.kernels.dtypes import HF_PRECISIONS, hf_name, torch_dtype
from lockstep.moe.checks import ConfigError, strict_kwargs
from lockstep.moe.config import ModelConfig, yarn_settings

F = "actor.megatron."  # how the messages name the options (the experiment config's keys)


@dataclass
class MegatronOptions:
    """How to lay the model out on megatron-core (parallelism, precision, kernels)."""

    tensor_parallel: int = 1
    """TP size; > 1 turns sequence parallelism on (megatron-core requires it for MoE)."""
    expert_parallel: int = 1
    """EP size: experts are partitioned over this many ranks."""
    expert_tensor_parallel: int | None = None
    """Expert TP size (ETP); None = tensor_parallel (megatron-core's default)."""
    pipeline_parallel: int = 1
    """PP size: the decoder layers are split over this many stages (1F1B schedule), as
    `pipeline_layers` says."""
    pipeline_layers: list[int] | None = field(default=None, metadata={"saved": "non_default"})
    """Decoder layers of each pipeline stage, first to last (one count per stage, each >= 1,
    summing to model.num_hidden_layers), e.g. [2, 1]; None = equal counts, or where
    pipeline_parallel does not divide the layers, the first L % PP stages hold one layer more
    than the others (`stage_layer_counts`). Uneven counts reach megatron-core as its
    `pipeline_model_parallel_layout`."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and compute dtype."""
    router_dtype: Literal["fp32", "fp64"] | None = None
    """megatron-core `moe_router_dtype`: router GEMM and softmax in this precision."""
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """MoE token dispatcher."""
    use_transformer_engine: bool | None = None
    """TE layer spec; None = use it when CUDA and transformer_engine are both present."""
    grouped_gemm: bool | None = None
    """Grouped expert GEMM (TE spec only); None = same as use_transformer_engine."""
    recompute_activations: bool = False
    """Full activation recomputation per layer (replayed with REPLAY_BACKWARD)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (the torch model's, see replay.py); 0 = none."""
    seed: int = 1234
    """Seed for megatron-core's RNG tracker (dropout is 0; initial weights are overwritten)."""
    context_parallel: int = field(default=1, metadata={"saved": "non_default"})
    """CP size: each row's tokens are split over this many ranks in megatron-core's
    load-balanced layout (2 x CP chunks, rank r holding chunks r and 2 x CP - 1 - r:
    context_parallel.py); megatron-core runs it with Transformer Engine's attention only (GPU).
    The ranks of a CP group share their rows, as TP ranks do; DP is what TP x CP x PP leave.
    > 1 is refused for now (`context_parallel_problems`): the actor's passes do not apply the
    layout yet."""
    virtual_pipeline_parallel: int | None = field(default=None, metadata={"hashed": "non_default"})
    """Virtual pipeline stages (model chunks) per PP stage, megatron-core's interleaved 1F1B
    schedule; None / 1 = one chunk per stage. Stage p's chunk c holds the layers
    (c * PP + p) * n .. with n = layers / (PP x VPP)."""
    logprob_chunk_tokens: int = field(default=1024, metadata={"hashed": "non_default"})
    """TP > 1: tokens per chunk of the vocabulary-parallel log-prob kernel (logprob.py); a
    chunk holds [chunk, V/TP] fp32 logits per rank (TP = 1 uses actor.logprob_chunk)."""
    fp8: bool = field(default=False, metadata={"saved": "non_default"})
    """FP8 GEMMs through Transformer Engine's blockwise recipe (TransformerConfig fp8="e4m3",
    fp8_recipe="blockwise": 1x128 activation and 128x128 weight scales, as kernels/fp8.py);
    from actor.fp8. GPU with transformer_engine only."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "expert_parallel", "expert_tensor_parallel",
                     "pipeline_parallel", "context_parallel", "logprob_chunk_tokens"):
            v = getattr(self, name)
            if v is None and name == "expert_tensor_parallel":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"megatron.{name} must be a positive integer, got {v!r}")
        if self.expert_parallel == 1 and self.etp != self.tensor_parallel:
            # megatron-core 0.16.1 tags expert weights as dense (`allreduce=True`) when
            # EP == 1, so it reduces their grads over the dense data-parallel group; with
            # ETP != TP the expert-data-parallel group is larger and grads would go unsummed.
            raise ConfigError(f"megatron.expert_tensor_parallel={self.etp} with "
                              f"expert_parallel=1 must equal tensor_parallel="
                              f"{self.tensor_parallel}: megatron-core would not sum the "
                              "expert gradients over the ranks that share an expert")
        pl = self.pipeline_layers
        if pl is not None:
            if (not isinstance(pl, (list, tuple)) or not pl
                    or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in pl)):
                raise ConfigError(f"megatron.pipeline_layers must be a list of positive layer "
                                  f"counts (one per pipeline stage) or null, got {pl!r}")
            if len(pl) != self.pipeline_parallel:
                raise ConfigError(f"megatron.pipeline_layers={list(pl)} has {len(pl)} stages "
                                  f"but pipeline_parallel={self.pipeline_parallel}: give one "
                                  "layer count per stage")
            self.pipeline_layers = list(pl)
        vpp = self.virtual_pipeline_parallel
        if vpp is not None and (not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1):
            raise ConfigError(f"megatron.virtual_pipeline_parallel must be a positive integer "
                              f"or null, got {vpp!r}")
        if self.vpp > 1 and self.pipeline_parallel < 2:
            raise ConfigError(f"megatron.virtual_pipeline_parallel={vpp} needs "
                              f"pipeline_parallel >= 2 (got {self.pipeline_parallel}): virtual "
                              "stages interleave the chunks of several pipeline stages")
        if self.params_dtype not in HF_PRECISIONS:
            raise ConfigError(f"megatron.params_dtype {self.params_dtype!r} is not one of "
                              + ", ".join(map(repr, HF_PRECISIONS)))
        if self.router_dtype not in (None, "fp32", "fp64"):
            raise ConfigError(f"megatron.router_dtype {self.router_dtype!r} is not one of "
                              "None, 'fp32', 'fp64'")
        if self.token_dispatcher not in ("alltoall", "allgather"):
            raise ConfigError(f"megatron.token_dispatcher {self.token_dispatcher!r} is not one "
                              "of 'alltoall', 'allgather'")
        if self.aux_loss_coef < 0:
            raise ConfigError(f"megatron.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if self.pipeline_parallel > 1 and self.recompute_activations and self.aux_loss_coef > 0:
            # 1F1B runs later micro-batches' forwards before an earlier one's recomputation,
            # and the load-balancing loss attached there needs that micro-batch's token mask
            raise ConfigError("megatron.recompute_activations with pipeline_parallel > 1 and a "
                              "load-balancing loss (actor.aux_loss_coef > 0) is not supported: "
                              "the recomputed forward would mask the wrong micro-batch's padding")

    @classmethod
    def from_dict(cls, d: dict) -> "MegatronOptions":
        return cls(**strict_kwargs(cls, d, "megatron options"))

    @property
    def etp(self) -> int:
        """Expert TP size in effect."""
        return self.tensor_parallel if self.expert_tensor_parallel is None \
            else self.expert_tensor_parallel

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline stage (1 = no virtual pipeline)."""
        return self.virtual_pipeline_parallel or 1

    @property
    def torch_dtype(self):
        """`params_dtype` as a torch dtype."""
        return torch_dtype(self.params_dtype)


# ModelConfig fields whose non-default values the megatron mapping does not cover (yet):
# field -> the value it must have (MLA, DeepSeek's interleaved RoPE, Qwen2-MoE's gated shared
# expert)
_UNMAPPED = dict(shared_expert_intermediate_size=0, rope_scaling=None)


# families whose megatron log-probs and routes were compared with the torch model
# (tests/test_megatron_parity.py, tests/test_megatron_families.py)
_CHECKED_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss")

# megatron-core's quick_gelu is x * sigmoid(1.702 x): gpt-oss's SwiGLU alpha, fixed
_QUICK_GELU_ALPHA = 1.702


# What megatron-core 0.16.1 offers for the families added since, and why they are not mapped
# (docs/megatron.md "Families"): refused naming the family.
_NOT_BUILT = {
    "qwen3_next": "megatron-core 0.16.1's gated_delta_net spec needs flash-linear-attention "
                  "(a Triton GPU library) and does not build on CPU; gated attention and the "
                  "zero-centred norms are not mapped",
    "qwen3_5_moe_text": "as qwen3_next (megatron-core 0.16.1's gated_delta_net needs "
                        "flash-linear-attention)",
    "deepseek_v32": "megatron-core 0.16.1's DSA (experimental_attention_variant='dsa') trains "
                    "the indexer with its KL loss and takes no given picks: indexer replay "
                    "(Megatron-LM #5384 / #5386) is not in it",
    "glm_moe_dsa": "as deepseek_v32, and its shared-indexer layers (indexer_types) have no "
                   "megatron-core spec",
}


def _gpt_oss_problems(cfg: ModelConfig) -> list[str]:
    """What of a gpt-oss config megatron-core 0.16.1 cannot express: it has sinks
    (softmax_type='learnable'), sliding windows per layer (window_size, window_attn_skip_freq),
    the clamped SwiGLU (quick_gelu, glu_linear_offset=1, activation_func_clamp_value) and
    biases on every linear (add_bias_linear), all in one switch each."""
    why = []
    if cfg.swiglu_limit is None or cfg.swiglu_alpha != _QUICK_GELU_ALPHA:
        why.append(f"swiglu_limit={cfg.swiglu_limit}, swiglu_alpha={cfg.swiglu_alpha} "
                   f"(megatron-core's quick_gelu has alpha {_QUICK_GELU_ALPHA}, and the clamp "
                   "needs a limit)")
    if not (cfg.attention_bias and cfg.attention_out_bias and cfg.router_bias):
        why.append(f"attention_bias={cfg.attention_bias}, attention_out_bias="
                   f"{cfg.attention_out_bias}, router_bias={cfg.router_bias} (megatron-core's "
                   "add_bias_linear puts a bias on q/k/v, the output, the router and the "
                   "experts at once)")
    if cfg.qk_norm:
        why.append("qk_norm=True (gpt-oss has none; unchecked)")
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("attention_factor") is not None:
        why.append("rope_scaling.attention_factor (megatron-core derives the YaRN attention "
                   "factor from factor / mscale / mscale_all_dim only)")
    return why


def _yarn_args(rs: dict[str, Any], max_position: int) -> dict[str, Any]:
    """megatron-core's YaRN settings for a YaRN `rope_scaling` (gpt-oss), read as our RoPE
    reads it (`yarn_settings`; megatron-core takes mscale / mscale_all_dim None as "0.1
    ln(factor) + 1", as we do). They are not TransformerConfig fields: GPTModel and the
    attention read them from the config object (getattr), so `transformer_config` sets them."""
    y = yarn_settings(rs, max_position)
    return dict(yarn_rotary_scaling_factor=y["factor"],
                yarn_original_max_position_embeddings=y["original"],
                yarn_beta_fast=y["beta_fast"], yarn_beta_slow=y["beta_slow"],
                yarn_mscale=y["mscale"], yarn_mscale_all_dim=y["mscale_all_dim"],
                yarn_correction_range_round_to_int=y["truncate"])


def check_supported(cfg: ModelConfig) -> None:
    """Refuse model features the megatron mapping does not build (it would otherwise build a
    different model and fail or, worse, differ from the torch model silently). Mapped: the
    softmax routers (Qwen3-MoE, Mixtral-style top-k softmax) and the sigmoid router with
    expert bias, group-limited top-k and scaling factor (GLM-4.5), shared experts, dense first
    layers, q/k/v biases, q/k norm or none, partial RoPE."""
    unmapped = dict(_UNMAPPED)
    if cfg.model_type == "gpt_oss":  # YaRN through megatron-core's yarn embedding
        del unmapped["rope_scaling"]
    bad = {k: getattr(cfg, k) for k, v in unmapped.items() if getattr(cfg, k) != v}
    why = _gpt_oss_problems(cfg) if cfg.model_type == "gpt_oss" else []
    if cfg.model_type in _NOT_BUILT:
        why.append(f"{cfg.model_type} is not mapped: {_NOT_BUILT[cfg.model_type]}")
    elif cfg.model_type not in _CHECKED_FAMILIES:
        why.append(f"model_type={cfg.model_type!r} has not been checked against the torch "
                   f"model (checked: {', '.join(_CHECKED_FAMILIES)})")
    if cfg.num_nextn_predict_layers:
        why.append(f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} (MTP layers are "
                   f"not mapped to megatron-core's MTP block; load a folder without them)")
    if bad:
        why.append(", ".join(f"{k}={v!r} (megatron needs {_UNMAPPED[k]!r})"
                             for k, v in bad.items()))
    if cfg.router not in ("softmax_topk", "topk_softmax", "sigmoid"):
        why.append(f"router={cfg.router!r}")
    if cfg.is_mla and not cfg.rope_interleave:
        # megatron-core's MLA always lays the rotary dims out evens-then-odds (DeepSeek's)
        why.append("MLA with rope_interleave=False (megatron-core MLA rotates interleaved "
                   "pairs only)")
    if cfg.rope_interleave and not cfg.is_mla:
        why.append("rope_interleave=True without MLA (kv_lora_rank=None)")
    if cfg.is_mla and cfg.rms_norm_eps != 1e-6:
        # our q_a / kv_a norms use 1e-6 (as DeepSeek's code); megatron's use layernorm_epsilon
        why.append(f"MLA with rms_norm_eps={cfg.rms_norm_eps} (megatron-core's q/kv latent "
                   "norms use rms_norm_eps, ours 1e-6: mapped only when they agree)")
    K = cfg.num_experts_per_tok
    if cfg.router == "sigmoid" and bool(cfg.norm_topk_prob) != (K > 1):
        # megatron-core normalises sigmoid gates exactly when topk > 1
        why.append(f"router='sigmoid' with norm_topk_prob={cfg.norm_topk_prob} and "
                   f"num_experts_per_tok={K} (megatron-core normalises the sigmoid gates "
                   "if and only if num_experts_per_tok > 1)")
    if cfg.expert_bias and cfg.router != "sigmoid":
        why.append(f"expert_bias=True with router={cfg.router!r} (megatron-core: sigmoid only)")
    if cfg.n_group > 1 and (cfg.router != "sigmoid" or K // cfg.topk_group != 2):
        # a group ranks by the sum of its 2 best scores (ours, DeepSeek's); megatron-core sums
        # the best num_experts_per_tok // topk_group
        why.append(f"n_group={cfg.n_group} with router={cfg.router!r}, num_experts_per_tok={K}, "
                   f"topk_group={cfg.topk_group} (megatron-core ranks groups by their best "
                   "num_experts_per_tok // topk_group scores: mapped only for the sigmoid "
                   "router where that is 2)")
    if why:
        raise ConfigError(
            f"actor.backend=megatron cannot build model_type={cfg.model_type!r} as the torch "
            "model runs it: " + "; ".join(why) + "; use actor.backend=torch for this "
            "architecture")


def stage_layer_counts(cfg: ModelConfig, opts: MegatronOptions) -> list[int]:
    """Decoder layers of each pipeline stage, first to last: `opts.pipeline_layers`, else
    equal counts where PP divides the layers, else the first L % PP stages one layer more
    (3 layers on 2 stages: [2, 1]; 61 on 8: [8, 8, 8, 8, 8, 7, 7, 7]). Not checked against
    the model (`check_stage_layers`)."""
    pp, L = opts.pipeline_parallel, cfg.num_hidden_layers
    if opts.pipeline_layers is not None:
        return list(opts.pipeline_layers)
    return [L // pp + (1 if p < L % pp else 0) for p in range(pp)]


def is_uneven(cfg: ModelConfig, opts: MegatronOptions) -> bool:
    """Whether the stages hold different layer counts (megatron-core is then given a
    `pipeline_model_parallel_layout`; equal stages keep its default split)."""
    return len(set(stage_layer_counts(cfg, opts))) > 1


def pipeline_layout(cfg: ModelConfig, opts: MegatronOptions) -> str | None:
    """megatron-core's `pipeline_model_parallel_layout` string for uneven stages ("E" the
    embedding, "t" a decoder layer, "L" the LM head and loss, "|" between stages: 3 layers on
    2 stages is "Ett|tL"); None for equal stages or PP = 1."""
    if opts.pipeline_parallel == 1 or not is_uneven(cfg, opts):
        return None
    stages = ["t" * n for n in stage_layer_counts(cfg, opts)]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


def check_stage_layers(cfg: ModelConfig, opts: MegatronOptions, model: str = "model.",
                       f: str = F) -> None:
    """Every pipeline stage holds at least one decoder layer (`stage_layer_counts`); under a
    virtual pipeline the layers split evenly over PP stages x VPP chunks."""
    pp, vpp, L = opts.pipeline_parallel, opts.vpp, cfg.num_hidden_layers
    pl = opts.pipeline_layers
    if pl is not None and sum(pl) != L:
        raise ConfigError(f"{f}pipeline_layers={pl} sums to {sum(pl)} layers, but "
                          f"{model}num_hidden_layers={L}")
    if pl is None and pp > L:
        raise ConfigError(f"{f}pipeline_parallel={pp} is more stages than "
                          f"{model}num_hidden_layers={L} (every stage needs a decoder layer)")
    if vpp > 1 and pl is not None:
        raise ConfigError(f"{f}pipeline_layers with {f}virtual_pipeline_parallel={vpp} is not "
                          "supported: the model chunks hold equal layer counts (megatron-core's "
                          "interleaved assignment); drop one of them")
    if vpp > 1 and L % (pp * vpp):
        raise ConfigError(f"{model}num_hidden_layers={L} is not divisible by "
                          f"{f}pipeline_parallel={pp} x {f}virtual_pipeline_parallel={vpp} "
                          "(every model chunk holds the same number of layers)")


def chunk_layers(cfg: ModelConfig, opts: MegatronOptions, pp_rank: int) -> list[list[int]]:
    """Global decoder layers of each model chunk of pipeline stage `pp_rank`: without a
    virtual pipeline one chunk, the stage's `stage_layer_counts` layers after the earlier
    stages'; under one megatron-core's interleaved assignment (chunk c of stage p holds
    layers (c * PP + p) * n + 0 .. n-1, n = L / (PP x VPP))."""
    pp, vpp = opts.pipeline_parallel, opts.vpp
    if vpp == 1:
        counts = stage_layer_counts(cfg, opts)
        lo = sum(counts[:pp_rank])
        return [list(range(lo, lo + counts[pp_rank]))]
    n = cfg.num_hidden_layers // (pp * vpp)
    return [list(range((c * pp + pp_rank) * n, (c * pp + pp_rank + 1) * n)) for c in range(vpp)]


def _world_problems(opts: MegatronOptions, world: int, on_gpu: bool) -> list[str]:
    """What a group of `world` ranks cannot run (or gloo cannot carry). DP = the rest."""
    tp, ep, etp, pp = (opts.tensor_parallel, opts.expert_parallel, opts.etp,
                       opts.pipeline_parallel)
    f, out, cp = F, [], opts.context_parallel
    if world % (tp * pp):
        out.append(f"{f}tensor_parallel={tp} x {f}pipeline_parallel={pp} does not divide "
                   f"the {world} actor ranks (cluster.actor_ranks)")
    elif cp > 1 and world % (tp * cp * pp):
        out.append(f"{f}tensor_parallel={tp} x {f}context_parallel={cp} x "
                   f"{f}pipeline_parallel={pp} does not divide the {world} actor ranks "
                   "(cluster.actor_ranks)")
    if world % (etp * ep * pp):
        out.append(f"{f}expert_tensor_parallel={etp} x {f}expert_parallel={ep} x "
                   f"{f}pipeline_parallel={pp} does not divide the {world} actor ranks")
    if not on_gpu and opts.token_dispatcher == "alltoall" and ep > 1 and etp > 1:
        out.append(f"{f}expert_parallel={ep} with {f}expert_tensor_parallel={etp} and "
                   f"{f}token_dispatcher=alltoall on CPU: the dispatcher all-gathers "
                   "tensors of unequal sizes over the expert-TP group (each expert-TP "
                   "rank receives its own count of tokens from the all-to-all), which "
                   f"gloo cannot do; use {f}expert_tensor_parallel=1")
    if opts.token_dispatcher == "allgather" and ep * etp > tp:
        out.append(f"{f}token_dispatcher=allgather with {f}expert_parallel={ep} x "
                   f"{f}expert_tensor_parallel={etp} > {f}tensor_parallel={tp}: the "
                   "dispatcher all-gathers each micro-batch's tokens over the "
                   f"{ep * etp} expert ranks assuming equal counts, but they span "
                   "data-parallel ranks whose shards are trimmed to their own longest "
                   "row (and packed by actor.max_tokens_per_micro_batch), so counts "
                   f"differ; use {f}token_dispatcher=alltoall (with "
                   f"{f}expert_tensor_parallel=1 on CPU)")
    return out


def context_parallel_problems(opts: MegatronOptions, on_gpu: bool,
                              use_te: bool | None = None) -> list[str]:
    """Why `context_parallel` > 1 does not run (empty for CP = 1); `use_te`: whether the
    Transformer Engine spec is in use, None = not known yet (the plan's "auto")."""
    cp, f = opts.context_parallel, F
    if cp == 1:
        return []
    if not on_gpu or False in (opts.use_transformer_engine, use_te):
        where = "on CPU" if not on_gpu else "without Transformer Engine"
        return [f"{f}context_parallel={cp} {where}: megatron-core runs context parallelism "
                "only in Transformer Engine's attention (TEDotProductAttention, GPU); its "
                "local DotProductAttention, the CPU path, supports context_parallel_size 1 "
                "only"]
    # the layout and its route slicing exist (context_parallel.py, tested against
    # megatron-core's get_batch_on_this_cp_rank); the actor's passes do not apply them yet
    return [f"{f}context_parallel={cp}: the megatron actor does not split its passes over "
            "context-parallel ranks yet (ids, labels, routes and log-probs by "
            "trainer/actor/megatron/context_parallel.py's layout; not run on a GPU here)"]


def _shape_problems(cfg: ModelConfig, opts: MegatronOptions) -> list[str]:
    """What the model's shapes cannot be split into."""
    tp, ep, f, out = opts.tensor_parallel, opts.expert_parallel, F, []
    if cfg.num_attention_heads % tp:
        out.append(f"{f}tensor_parallel={tp} does not divide the model's "
                   f"num_attention_heads={cfg.num_attention_heads}")
    if cfg.num_key_value_heads % tp:
        out.append(f"{f}tensor_parallel={tp} does not divide the model's "
                   f"num_key_value_heads={cfg.num_key_value_heads} (megatron-core splits "
                   "whole query groups over TP)")
    if cfg.num_experts % ep:
        out.append(f"{f}expert_parallel={ep} does not divide the model's "
                   f"num_experts={cfg.num_experts}")
    if cfg.model_type == "gpt_oss" and opts.etp != 1 and tp == 1:
        out.append(f"{f}expert_tensor_parallel={opts.etp} with gpt-oss: megatron-core 0.16.1 "
                   "keeps expert biases only at expert_tensor_parallel=1")
    if cfg.model_type == "gpt_oss" and tp > 1:
        # ETP must be 1 for expert biases (megatron-core asserts it), and then TP ranks hold
        # different experts: 0.16.1's finalize_model_grads sums every sequence-parallel-tagged
        # grad over TP, expert fc2 biases included, adding other experts' bias gradients
        out.append(f"{f}tensor_parallel={tp} with gpt-oss: megatron-core 0.16.1 keeps expert "
                   "biases only at expert_tensor_parallel=1, and then sums each expert's fc2 "
                   "bias gradient with another expert's over the TP ranks (they are tagged "
                   "sequence_parallel); use expert_parallel / pipeline_parallel instead")
    if cfg.vocab_size % tp:
        out.append(f"{f}tensor_parallel={tp} does not divide vocab_size={cfg.vocab_size} "
                   "(no vocabulary padding: padded rows would add zero logits to the softmax)")
    if opts.pipeline_parallel > 1 and cfg.tie_word_embeddings:
        out.append(f"{f}pipeline_parallel > 1 with tie_word_embeddings: the first and last "
                   "stage would each hold a copy of the embedding, which lockstep's weight "
                   "conversion does not handle")
    return out


def layout_problems(opts: MegatronOptions, cfg: ModelConfig | None = None,
                    world: int | None = None, on_gpu: bool = False) -> list[str]:
    """Every reason megatron-core 0.16.1 cannot run `opts` (for the model `cfg`, on `world`
    ranks, when given), each naming the fields and why: the model families it maps, the
    layers per stage and chunk, the group sizes and dispatchers, the shapes TP / EP split."""
    out: list[str] = []
    if cfg is not None:
        for check in (check_supported, lambda c: check_stage_layers(c, opts)):
            try:
                check(cfg)
            except ConfigError as e:
                out.append(str(e))
    if world is not None:
        out += _world_problems(opts, world, on_gpu)
    out += context_parallel_problems(opts, on_gpu)
    if cfg is not None:
        out += _shape_problems(cfg, opts)
    return out


def check_layout(opts: MegatronOptions, world: int | None, on_gpu: bool,
                 cfg: ModelConfig | None = None) -> None:
    """Raise ConfigError with the first of `layout_problems` (before any rank starts)."""
    problems = layout_problems(opts, cfg, world, on_gpu)
    if problems:
        raise ConfigError(problems[0])


def check_world(cfg) -> None:
    """Refuse an `actor.megatron` layout the loop cannot run (`cfg`: an ExperimentConfig).
    The loop is one process (every rank would run its own engine and write the same run
    directory), so the megatron actor gets a world of one: tensor, expert and expert-tensor
    parallel sizes must all be 1."""
    import torch.distributed as dist

    if cfg.actor.backend != "megatron":
        return
    m = cfg.actor.megatron
    if cfg.cluster.actor_ranks > 1:  # the Ray actor group hosts one megatron rank per member
        on_gpu = resolve_device(cfg.cluster.device, here=False).type == "cuda"
        check_layout(m, cfg.cluster.actor_ranks, on_gpu=on_gpu, cfg=cfg.model)
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != 1:
        raise ValueError(f"Trainer runs in one process, but torch.distributed has a world of "
                         f"{world}: multi-rank megatron (torchrun) is not supported by the loop")
    big = {k: v for k, v in (("tensor_parallel", m.tensor_parallel),
                             ("expert_parallel", m.expert_parallel),
                             ("expert_tensor_parallel", m.etp),
                             ("pipeline_parallel", m.pipeline_parallel),
                             ("context_parallel", m.context_parallel)) if v != 1}
    if big:
        raise ValueError(
            f"{', '.join(f'actor.megatron.{k}={v}' for k, v in big.items())}: the RL loop runs "
            "megatron-core in a world of one process, so every parallel size must be 1; "
            "multi-rank launch (torchrun) is not supported yet: set cluster.actor_ranks "
            "(docs/megatron.md)")


def precision_problems(cfg, on_gpu: bool) -> list[str]:
    """What megatron-core cannot run of the ActorConfig `cfg`'s precision knobs."""
    out = []
    if cfg.lm_head_dtype not in (None, cfg.dtype):
        out.append(f"actor.lm_head_dtype={cfg.lm_head_dtype} is not supported by the "
                   "megatron backend (megatron-core has no separate LM-head dtype)")
    if cfg.dtype != "fp32" and not on_gpu:
        out.append(f"actor.dtype={cfg.dtype}: the megatron backend on CPU trains in fp32 "
                   "only (megatron-core's mixed-precision optimizer needs CUDA)")
    if cfg.router_dtype not in (None, cfg.dtype, "fp32"):
        out.append(f"actor.router_dtype={cfg.router_dtype}: megatron-core's router dtype "
                   "can only be raised to fp32")
    if cfg.fp8 and not on_gpu:
        out.append("actor.fp8=true: the megatron backend runs FP8 through Transformer Engine's "
                   "blockwise recipe, which needs a CUDA GPU with transformer_engine; "
                   "megatron-core's local (CPU) layers have no FP8 path to emulate it with "
                   "(use actor.backend=torch for FP8 on CPU)")
    return out


def actor_options(cfg, options: MegatronOptions | None) -> MegatronOptions:
    """MegatronOptions with the precision / aux-loss knobs taken from the ActorConfig `cfg`
    (not checked: `precision_problems`)."""
    router = None if cfg.router_dtype in (None, cfg.dtype) else cfg.router_dtype
    return dataclasses.replace(options or MegatronOptions(), params_dtype=hf_name(cfg.dtype),
                               router_dtype=router, aux_loss_coef=cfg.aux_loss_coef,
                               fp8=cfg.fp8)


# -- the arguments megatron-core is given --------------------------------------------------
def megatron_args(cfg: ModelConfig, opts: MegatronOptions, *, use_te: bool | str,
                  on_gpu: bool) -> dict[str, Any]:
    """The `TransformerConfig` arguments for `cfg` laid out as `opts`, as plain values:
    dtypes by their HF names ("bfloat16"), the activation by its torch.nn.functional name.
    `use_te`: the Transformer Engine spec, or "auto" (decided on the GPU node: the plan)."""
    pp = opts.pipeline_parallel
    grouped = use_te if opts.grouped_gemm is None else opts.grouped_gemm
    params = opts.params_dtype
    mla = {}
    if cfg.is_mla:  # DeepSeek-V3 multi-head latent attention (q_lora_rank None: a plain q)
        mla = dict(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank,
                   kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                   qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                   rope_type="rope", rotary_base=cfg.rope_theta, rotary_scaling_factor=1.0,
                   mscale=1.0, mscale_all_dim=0.0)
    oss = {}
    if cfg.model_type == "gpt_oss":  # check_supported: every linear has a bias, alpha 1.702
        layers = range(cfg.num_hidden_layers)
        sliding = [cfg.layer_type(i) == "sliding_attention" for i in layers]
        oss = dict(add_bias_linear=True, activation_func="quick_gelu", glu_linear_offset=1.0,
                   activation_func_clamp_value=float(cfg.swiglu_limit),
                   softmax_type="learnable" if cfg.attention_sinks else "vanilla",
                   # a query at p sees keys p-W+1 .. p; the list says which layers slide
                   window_size=(cfg.sliding_window - 1, 0) if any(sliding) else None,
                   window_attn_skip_freq=[int(x) for x in sliding] if any(sliding) else None)
        if cfg.rope_scaling is not None:
            oss.update(_yarn_args(cfg.rope_scaling, cfg.max_position_embeddings))
    return dict(
        **mla,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=None if cfg.is_mla else cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        qk_layernorm=cfg.qk_norm or cfg.is_mla,  # MLA: the q / kv latent norms
        gated_linear_unit=True,
        activation_func=oss.pop("activation_func", "silu"),
        add_bias_linear=oss.pop("add_bias_linear", False),
        add_qkv_bias=cfg.attention_bias,
        **oss,
        rotary_interleaved=False,  # MLA: its evens-then-odds layout is implied
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # MoE
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_layer_freq=[1 if cfg.is_moe_layer(i) else 0 for i in range(cfg.num_hidden_layers)],
        moe_router_score_function=cfg.score_function,
        # sigmoid router (GLM-4.5): selection by scores + bias within the best groups; gate
        # weights are the unbiased scores, normalised, times the factor (as moe/router.py)
        moe_router_enable_expert_bias=bool(cfg.expert_bias),
        # the bias changes only as the torch actor's expert_bias_update_rate (0 here: the
        # config refuses a rate with this backend); megatron-core's own update is off
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=cfg.n_group if cfg.n_group > 1 else None,
        moe_router_group_topk=cfg.topk_group if cfg.n_group > 1 else None,
        moe_router_topk_scaling_factor=(cfg.routed_scaling_factor
                                        if cfg.routed_scaling_factor != 1.0 else None),
        moe_shared_expert_intermediate_size=cfg.shared_expert_width or None,
        # norm_topk_prob: softmax over the K chosen logits == renormalised top-k of the full
        # softmax; without it, the plain top-k of the full softmax.
        moe_router_pre_softmax=(not cfg.norm_topk_prob and cfg.router == "softmax_topk"
                                if cfg.router != "sigmoid" else False),
        # the load-balancing loss is the torch model's, added by replay.RouteReplay (its own
        # counts natural routes under replay and sums layers): megatron-core's is off
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype=opts.router_dtype,
        moe_token_dispatcher_type=opts.token_dispatcher,
        moe_grouped_gemm=grouped,
        moe_enable_routing_replay=True,
        moe_router_fusion=False,
        moe_expert_capacity_factor=None,
        moe_permute_fusion=use_te,  # TE's fused (un)permute: after routing, replay-neutral
        # parallelism
        tensor_model_parallel_size=opts.tensor_parallel,
        expert_model_parallel_size=opts.expert_parallel,
        expert_tensor_parallel_size=opts.etp,
        sequence_parallel=opts.tensor_parallel > 1,
        context_parallel_size=opts.context_parallel,
        pipeline_model_parallel_size=pp,
        # uneven stages (stage_layer_counts); None: megatron-core's equal split
        pipeline_model_parallel_layout=pipeline_layout(cfg, opts),
        virtual_pipeline_model_parallel_size=opts.vpp if opts.vpp > 1 else None,
        pipeline_dtype=params if pp > 1 else None,
        # micro-batches of unequal rows (the last one of a batch) travel between stages
        variable_seq_lengths=pp > 1,
        # the batched p2p path calls torch.cuda.synchronize() (p2p_communication.py)
        batch_p2p_sync=on_gpu,
        # virtual pipeline: with PP=2 the previous and next stage are the same rank, and a
        # batched exchange (one call sending an activation forward and a gradient back)
        # would pair messages by order, not direction; the overlapped path keeps the two
        # directions on two process groups (p2p_communication._p2p_ops) and sends each
        # direction in a call of its own
        overlap_p2p_comm=opts.vpp > 1,
        batch_p2p_comm=opts.vpp == 1,
        # precision and kernels
        params_dtype=params,
        bf16=params == "bfloat16",
        fp16=params == "float16",
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=use_te,
        apply_rope_fusion=use_te,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        recompute_granularity="full" if opts.recompute_activations else None,
        recompute_method="uniform" if opts.recompute_activations else None,
        recompute_num_layers=1 if opts.recompute_activations else None,
        # FP8 GEMMs (actor.fp8) through TE: e4m3 forward and backward, block scales
        **(dict(fp8="e4m3", fp8_recipe="blockwise") if opts.fp8 else {}),
    )


def ddp_args() -> dict[str, Any]:
    """megatron-core DDP settings of the actor: gradients are accumulated over micro-batches
    (and reduced over DP) in fp32 grad buffers (`main_grad`) whatever the parameter dtype."""
    return dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=False)


def optimizer_args(cfg, opts: MegatronOptions) -> dict[str, Any]:
    """megatron-core `OptimizerConfig` arguments of the ActorConfig `cfg` (Adam; the dtype by
    its HF name)."""
    return dict(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
                clip_grad=cfg.grad_clip, params_dtype=opts.params_dtype,
                bf16=opts.params_dtype == "bfloat16", fp16=opts.params_dtype == "float16")
