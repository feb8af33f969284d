"""Build a megatron-core MoE `GPTModel` equivalent to our `ModelConfig` (Qwen3-MoE and
GLM-4.5-style: docs/megatron.md "Supported families"; `check_supported` refuses the rest).

Shapes: B batch, T time (tokens per row), S = T padded to a multiple of TP (megatron-core
runs sequence-first, [S, B, D]), D model dim, V vocab (V/TP per tensor-parallel rank).

Mapping (Qwen3-MoE -> megatron-core `TransformerConfig`): GQA = `num_query_groups`; q/k norm =
`qk_layernorm` with RMSNorm; RoPE = `position_embedding_type="rope"`, `rotary_base`,
non-interleaved halves (HF `rotate_half`); softmax router top-k with `norm_topk_prob` =
softmax over the K selected logits (`moe_router_pre_softmax=False`), without it = softmax over
all E then top-k (`pre_softmax=True`); SwiGLU experts without bias = `gated_linear_unit` +
silu + `add_bias_linear=False`; dense layers = `moe_layer_freq` as a per-layer 0/1 list.

Routing replay is always on (`moe_enable_routing_replay=True`). Options that bypass it
(fused router, sinkhorn, token dropping / expert capacity) are refused by
`check_replay_compatible`, which `build_gpt_model` runs on the final TransformerConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from lockstep.kernels.dtypes import HF_PRECISIONS, torch_dtype
from lockstep.moe.config import ConfigError, ModelConfig, strict_kwargs


class ReplayBypassError(ValueError):
    """A megatron-core option that would silently skip `RouterReplay` was requested."""


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
    """PP size: the decoder layers are split evenly over this many stages (1F1B schedule)."""
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
    virtual_pipeline_parallel: int | None = None
    """Virtual pipeline stages (model chunks) per PP stage, megatron-core's interleaved 1F1B
    schedule; None / 1 = one chunk per stage. Stage p's chunk c holds the layers
    (c * PP + p) * n .. with n = layers / (PP x VPP)."""
    logprob_chunk_tokens: int = 1024
    """TP > 1: tokens per chunk of the vocabulary-parallel log-prob kernel (logprob.py); a
    chunk holds [chunk, V/TP] fp32 logits per rank (TP = 1 uses actor.logprob_chunk)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "expert_parallel", "expert_tensor_parallel",
                     "pipeline_parallel", "logprob_chunk_tokens"):
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
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.params_dtype)


def check_layout(opts: MegatronOptions, world: int, on_gpu: bool,
                 cfg: ModelConfig | None = None) -> None:
    """Refuse a layout of `world` ranks that megatron-core 0.16.1 cannot run (or that gloo
    cannot carry), naming the fields and why. Data parallel = the rest of the world. With the
    model's `cfg`, also what `transformer_config` would refuse (before any rank starts)."""
    tp, ep, etp, pp = (opts.tensor_parallel, opts.expert_parallel, opts.etp,
                       opts.pipeline_parallel)
    f = "actor.megatron."
    if cfg is not None:
        check_supported(cfg)
        check_stage_layers(cfg, opts, "model.", f)
    if world % (tp * pp):
        raise ConfigError(f"{f}tensor_parallel={tp} x {f}pipeline_parallel={pp} does not divide "
                          f"the {world} actor ranks (cluster.actor_ranks)")
    if world % (etp * ep * pp):
        raise ConfigError(f"{f}expert_tensor_parallel={etp} x {f}expert_parallel={ep} x "
                          f"{f}pipeline_parallel={pp} does not divide the {world} actor ranks")
    if not on_gpu and opts.token_dispatcher == "alltoall" and ep > 1 and etp > 1:
        raise ConfigError(f"{f}expert_parallel={ep} with {f}expert_tensor_parallel={etp} and "
                          f"{f}token_dispatcher=alltoall on CPU: the dispatcher all-gathers "
                          "tensors of unequal sizes over the expert-TP group (each expert-TP "
                          "rank receives its own count of tokens from the all-to-all), which "
                          f"gloo cannot do; use {f}expert_tensor_parallel=1")
    if opts.token_dispatcher == "allgather" and ep * etp > tp:
        raise ConfigError(f"{f}token_dispatcher=allgather with {f}expert_parallel={ep} x "
                          f"{f}expert_tensor_parallel={etp} > {f}tensor_parallel={tp}: the "
                          "dispatcher all-gathers each micro-batch's tokens over the "
                          f"{ep * etp} expert ranks assuming equal counts, but they span "
                          "data-parallel ranks whose shards are trimmed to their own longest "
                          "row (and packed by actor.max_tokens_per_micro_batch), so counts "
                          f"differ; use {f}token_dispatcher=alltoall (with "
                          f"{f}expert_tensor_parallel=1 on CPU)")


def check_stage_layers(cfg: ModelConfig, opts: MegatronOptions, model: str = "",
                       f: str = "megatron.") -> None:
    """The decoder layers must split evenly over PP stages x VPP chunks."""
    pp, vpp, L = opts.pipeline_parallel, opts.vpp, cfg.num_hidden_layers
    if vpp == 1 and L % pp:
        raise ConfigError(f"{model}num_hidden_layers={L} is not divisible by "
                          f"{f}pipeline_parallel={pp} (stages hold equal layer counts)")
    if vpp > 1 and L % (pp * vpp):
        raise ConfigError(f"{model}num_hidden_layers={L} is not divisible by "
                          f"{f}pipeline_parallel={pp} x {f}virtual_pipeline_parallel={vpp} "
                          "(every model chunk holds the same number of layers)")


def chunk_layers(cfg: ModelConfig, opts: MegatronOptions, pp_rank: int) -> list[list[int]]:
    """Global decoder layers of each model chunk of pipeline stage `pp_rank` (megatron-core's
    interleaved assignment: chunk c of stage p holds layers (c * PP + p) * n + 0 .. n-1)."""
    pp, vpp = opts.pipeline_parallel, opts.vpp
    n = cfg.num_hidden_layers // (pp * vpp)
    return [list(range((c * pp + pp_rank) * n, (c * pp + pp_rank + 1) * n)) for c in range(vpp)]


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (the TE spec needs both)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


# ModelConfig fields whose non-default values the megatron mapping does not cover (yet):
# field -> the value it must have (MLA, DeepSeek's interleaved RoPE, Qwen2-MoE's gated shared
# expert)
_UNMAPPED = dict(shared_expert_intermediate_size=0, rope_scaling=None)


# families whose megatron log-probs and routes were compared with the torch model
# (tests/test_megatron_parity.py, tests/test_megatron_families.py)
_CHECKED_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")


def check_supported(cfg: ModelConfig) -> None:
    """Refuse model features the megatron mapping does not build (it would otherwise build a
    different model and fail or, worse, differ from the torch model silently). Mapped: the
    softmax routers (Qwen3-MoE, Mixtral-style top-k softmax) and the sigmoid router with
    expert bias, group-limited top-k and scaling factor (GLM-4.5), shared experts, dense first
    layers, q/k/v biases, q/k norm or none, partial RoPE."""
    bad = {k: getattr(cfg, k) for k, v in _UNMAPPED.items() if getattr(cfg, k) != v}
    why = []
    if cfg.model_type not in _CHECKED_FAMILIES:
        why.append(f"model_type={cfg.model_type!r} has not been checked against the torch "
                   f"model (checked: {', '.join(_CHECKED_FAMILIES)})")
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


def transformer_config(cfg: ModelConfig, opts: MegatronOptions):
    """megatron-core `TransformerConfig` for `cfg` laid out as `opts` says."""
    from megatron.core.transformer import TransformerConfig

    check_supported(cfg)
    on_gpu = torch.cuda.is_available()
    use_te = te_available() if opts.use_transformer_engine is None else opts.use_transformer_engine
    if use_te and not te_available():
        raise ConfigError("megatron.use_transformer_engine=True needs a CUDA GPU and the "
                          "transformer_engine package")
    grouped = use_te if opts.grouped_gemm is None else opts.grouped_gemm
    if grouped and not use_te:
        raise ConfigError("megatron.grouped_gemm=True needs the Transformer Engine spec "
                          "(use_transformer_engine=True on a GPU)")
    if opts.router_dtype is not None and on_gpu and not use_te:
        # 0.16.1 reads `te_general_gemm` unconditionally once moe_router_dtype is set; only the
        # CPU bridge defines it when TE is missing, and the bridge never runs on a GPU.
        raise ConfigError("megatron.router_dtype on a GPU needs transformer_engine "
                          "(megatron-core 0.16.1 uses te_general_gemm for the router GEMM)")
    if cfg.num_key_value_heads % opts.tensor_parallel:
        raise ConfigError(f"num_key_value_heads={cfg.num_key_value_heads} is not divisible by "
                          f"tensor_parallel={opts.tensor_parallel}")
    if cfg.num_experts % opts.expert_parallel:
        raise ConfigError(f"num_experts={cfg.num_experts} is not divisible by "
                          f"expert_parallel={opts.expert_parallel}")
    pp = opts.pipeline_parallel
    check_stage_layers(cfg, opts)
    if pp > 1 and cfg.tie_word_embeddings:
        raise ConfigError("megatron.pipeline_parallel > 1 with tie_word_embeddings: the first and "
                          "last stage would each hold a copy of the embedding, which lockstep's "
                          "weight conversion does not handle")
    if cfg.vocab_size % opts.tensor_parallel:
        raise ConfigError(f"vocab_size={cfg.vocab_size} is not divisible by "
                          f"tensor_parallel={opts.tensor_parallel} (no vocabulary padding: "
                          "padded rows would add zero logits to the softmax)")
    dtype = opts.torch_dtype
    config_cls, mla = TransformerConfig, {}
    if cfg.is_mla:  # DeepSeek-V3 multi-head latent attention (q_lora_rank None: a plain q)
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        config_cls = MLATransformerConfig
        mla = dict(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank,
                   kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                   qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                   rope_type="rope", rotary_base=cfg.rope_theta, rotary_scaling_factor=1.0,
                   mscale=1.0, mscale_all_dim=0.0)
    return config_cls(
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
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.attention_bias,
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
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=opts.vpp if opts.vpp > 1 else None,
        pipeline_dtype=dtype if pp > 1 else None,
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
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
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
    )


def check_replay_compatible(tc) -> None:
    """Refuse TransformerConfig settings under which megatron-core skips or undoes replay."""
    if not tc.moe_enable_routing_replay:
        raise ReplayBypassError("moe_enable_routing_replay is False: routes cannot be replayed")
    if tc.moe_router_fusion:
        raise ReplayBypassError("moe_router_fusion=True: the fused TE top-k kernel never calls "
                                "RouterReplay, so given routes would be ignored")
    if tc.moe_router_load_balancing_type == "sinkhorn":
        raise ReplayBypassError("moe_router_load_balancing_type='sinkhorn' routes outside the "
                                "replayable top-k function")
    if tc.moe_expert_capacity_factor is not None:
        raise ReplayBypassError(f"moe_expert_capacity_factor={tc.moe_expert_capacity_factor}: "
                                "token dropping runs after replay and drops replayed routes")


def build_gpt_model(cfg: ModelConfig, opts: MegatronOptions | None = None, *, tc=None,
                    vp_stage: int | None = None):
    """A megatron-core GPTModel for `cfg` on the current parallel state (one PP stage, or its
    model chunk `vp_stage` under a virtual pipeline: `build_model_chunks` builds them all).

    `tc` overrides the TransformerConfig derived from `cfg`/`opts` (checked all the same).
    Weights are megatron-core's random init; load real ones with `convert.load_hf_into_megatron`.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    opts = opts or MegatronOptions()
    tc = tc if tc is not None else transformer_config(cfg, opts)
    check_replay_compatible(tc)
    use_te = tc.moe_grouped_gemm or (te_available() if opts.use_transformer_engine is None
                                     else opts.use_transformer_engine)
    from megatron.core import parallel_state as ps

    if getattr(tc, "multi_latent_attention", False) and not use_te:
        _patch_local_mla()
    vp = tc.virtual_pipeline_model_parallel_size is not None
    if vp and vp_stage is None:
        raise ValueError("a virtual pipeline model needs vp_stage (use build_model_chunks)")
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=use_te, normalization="RMSNorm",
                                      vp_stage=vp_stage if vp else None)
    pp = tc.pipeline_model_parallel_size > 1
    stage = dict(ignore_virtual=False, vp_stage=vp_stage) if vp else {}
    return GPTModel(
        pre_process=ps.is_pipeline_first_stage(**stage) if pp else True,
        post_process=ps.is_pipeline_last_stage(**stage) if pp else True,
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=cfg.partial_rotary_factor,
        rotary_base=int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        parallel_output=True,
        vp_stage=vp_stage if vp else None,
    )


def build_model_chunks(cfg: ModelConfig, opts: MegatronOptions | None = None, *, tc=None
                       ) -> list:
    """This rank's model chunks: one GPTModel per virtual pipeline stage (a list of one
    without a virtual pipeline). Chunk 0 of the first stage holds the embedding, the last
    chunk of the last stage the final norm and LM head."""
    opts = opts or MegatronOptions()
    tc = tc if tc is not None else transformer_config(cfg, opts)
    if opts.vpp == 1:
        return [build_gpt_model(cfg, opts, tc=tc)]
    return [build_gpt_model(cfg, opts, tc=tc, vp_stage=c) for c in range(opts.vpp)]


def _patch_local_mla() -> None:
    """megatron-core 0.16.1's local spec cannot build MLA as shipped (REFERENCE.md): the local
    `DotProductAttention` does not take the `k_channels` / `v_channels` MLA passes (its output
    width must be heads * v_channels), and without Transformer Engine MLA's
    `isinstance(linear_proj, TELinear)` meets a placeholder. Idempotent."""
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention as mla

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        mla.HAVE_TE = False
    cls = dpa.DotProductAttention
    if getattr(cls.__init__, "_lockstep_mla", False):
        return
    original = cls.__init__

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    __init__._lockstep_mla = True
    cls.__init__ = __init__


def initialize_parallel(opts: MegatronOptions) -> None:
    """megatron-core model-parallel groups + RNG tracker on an initialised torch.distributed.

    On a CPU-only torch this installs the CPU bridge first (see cpu_bridge.py).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "dist.init_process_group('gloo' | 'nccl', ...) first")
    if not torch.cuda.is_available():
        from lockstep.trainer.megatron import cpu_bridge
        cpu_bridge.install()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=opts.tensor_parallel,
        expert_model_parallel_size=opts.expert_parallel,
        expert_tensor_parallel_size=opts.etp,
        pipeline_model_parallel_size=opts.pipeline_parallel,
        virtual_pipeline_model_parallel_size=opts.vpp if opts.vpp > 1 else None,
    )
    model_parallel_cuda_manual_seed(opts.seed)


def padded_length(T: int, tensor_parallel: int) -> int:
    """Sequence length S >= T that sequence parallelism can split evenly over TP ranks."""
    return -(-T // tensor_parallel) * tensor_parallel


def forward_logits(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V/TP] (vocab-sharded under TP) for right-padded rows at positions 0..T-1;
    on a pipeline stage before the last, that stage's output hidden states (sequence-first).

    megatron-core's RoPE always uses positions arange(S), so rows must start at position 0
    (right padding). T is padded to a multiple of TP for sequence parallelism; the padding is
    at the end of every row, so causal attention keeps it invisible to real tokens.
    """
    tp = model.config.tensor_model_parallel_size
    B, T = input_ids_BT.shape
    S = padded_length(T, tp)
    ids_BS = F.pad(input_ids_BT, (0, S - T)) if S != T else input_ids_BT
    device = ids_BS.device
    pos_BS = torch.arange(S, device=device).expand(B, S)
    if ids_BS.is_cuda:
        # causal attention masks itself (TE / flash attention take no explicit causal mask)
        mask_11SS = None
    else:
        # True = masked out (megatron-core convention); explicit, as the default is built
        # on "cuda"
        mask_11SS = torch.ones(1, 1, S, S, dtype=torch.bool, device=device).triu(1)
    out = model(ids_BS, pos_BS, mask_11SS)
    if not is_last_stage(model):
        return out  # hidden states [S/TP, B, D] for the next pipeline stage
    return out[:, :T]


def is_last_stage(model) -> bool:
    """Whether `model` (a GPTModel, maybe DDP-wrapped) computes logits (the last PP stage)."""
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    return bool(model.post_process)


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(target) [B, T] in fp32 from (possibly vocab-sharded) logits, exact under TP."""
    from megatron.core import tensor_parallel

    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    # vocab_parallel_cross_entropy works sequence-first on [T, B, V/TP] and all-reduces the
    # max and the sum over the TP group, so no rank ever holds the full vocabulary.
    logits_TBV = logits.transpose(0, 1).contiguous()
    if logits_TBV.data_ptr() == logits_BTV.data_ptr():
        logits_TBV = logits_TBV.clone()  # NOTE: it works in place; never on the caller's logits
    nll_TB = tensor_parallel.vocab_parallel_cross_entropy(
        logits_TBV, targets_BT.transpose(0, 1).contiguous())
    return -nll_TB.transpose(0, 1)


def token_logprobs_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) [B, T] fp32 of softmax(logits / temperature), differentiable,
    from logits sharded over the vocabulary by TP (rank r holds ids r*V/TP ..).

    The sums over the vocabulary are all-reduced over the TP group with megatron-core's
    autograd-aware reduction (forward all-reduce, backward identity).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    x = logits_BTV.float() / temperature
    tp = ps.get_tensor_model_parallel_world_size()
    m = x.detach().amax(dim=-1)
    if tp > 1:
        import torch.distributed as dist
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    x = x - m[..., None]  # the max cancels in both results; it only keeps exp() finite
    e = x.exp()
    v_local = x.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local if tp > 1 else 0
    local_t = targets_BT - start
    here = (local_t >= 0) & (local_t < v_local)
    x_t = x.gather(-1, local_t.clamp(0, v_local - 1)[..., None])[..., 0] * here
    sums = torch.stack([e.sum(-1), (e * x).sum(-1), x_t], dim=-1)
    if tp > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    z, ex, xt = sums.unbind(-1)
    log_z = z.log()
    return xt - log_z, log_z - ex / z
