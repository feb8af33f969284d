"""Typed model configuration that reads and writes Hugging Face `config.json` of the MoE
architectures we run: Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 (`glm4_moe`), DeepSeek-V3
(also Kimi-K2 and Moonlight, which are DeepSeek-V3 folders), gpt-oss, Qwen3-Next and
Qwen3.5-MoE (`qwen3_5_moe_text`); moe/config_families.py holds the later families' checks
and spellings.

One dataclass covers them all: the architecture is `model_type`, and every difference between
the families is a typed field (router family, expert bias, groups, scaling factor, shared
experts, dense first layers, attention biases, q/k norm, partial or interleaved RoPE, MLA ranks),
so a converter (Megatron, SGLang) reads the same fields whatever the family.

Both spellings found in the wild are read: released folders say `num_experts` (Qwen) or
`n_routed_experts` (DeepSeek, GLM) and `rope_theta`; transformers 5's `save_pretrained` writes
`num_local_experts` and `rope_parameters: {rope_theta, rope_type, partial_rotary_factor}`. We
write each family's released spelling plus the transformers-5 aliases, so either reader loads
our folders.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .checks import ConfigError, need
from .config_families import NEW_FAMILY_READERS, NEW_FAMILY_WRITERS, validate_new_families
from .family_tables import (_ARCH_FIELDS, _BASE_DEFAULTS, _COMMON_HF_FIELDS, _FAMILY_DEFAULTS,
                            _FAMILY_HF_FIELDS, _IGNORED_HF_KEYS, _IGNORED_PER_ARCH,
                            _REQUIRED_HF_KEYS, _YARN_KEYS, ARCHITECTURES, MODEL_TYPES, ROUTERS)


# Fields added with gpt-oss, Qwen3-Next / Qwen3.5, DeepSeek-V3.2 / GLM-5 and MTP: experiment
# configs leave them out at the family's value (`family_default`), so older runs save and hash
# as before (trainer/config/types.py, "Saved-config compatibility").
LATER_FAMILY_FIELD = {"saved": "family_default"}
# Families whose matmuls MoEModel.set_precision(fp8=True) maps (moe/checkpoint.py FP8_WEIGHTS).
_FP8_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")


@dataclass
class ModelConfig:
    """MoE architecture hyper-parameters (field names follow HF `config.json`); the defaults
    are Qwen3-MoE's, and `for_architecture(model_type, ...)` fills in another family's."""

    model_type: Literal[MODEL_TYPES] = "qwen3_moe"
    """Architecture: one of ARCHITECTURES (qwen3_moe, qwen2_moe, mixtral, glm4_moe, deepseek_v3,
    gpt_oss, qwen3_next, qwen3_5_moe_text)."""
    vocab_size: int = 32
    """Number of token ids, including special tokens."""
    hidden_size: int = 96
    """Model (residual stream) width D."""
    num_hidden_layers: int = 3
    """Decoder layers, dense and MoE together (the SGLang route layer axis)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA when smaller than num_attention_heads)."""
    head_dim: int = 24
    """Per-head width; need not equal hidden_size / num_attention_heads."""
    intermediate_size: int = 192
    """SwiGLU width of dense MLP layers."""
    moe_intermediate_size: int = 96
    """SwiGLU width of each expert."""
    num_experts: int = 4
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Top-k experts each token is routed to."""
    norm_topk_prob: bool | None = None
    """Renormalise the top-k gate weights to sum to one (None: the family's default, True but
    for Qwen2-MoE)."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers forced to a dense MLP."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_position_embeddings: int = 2048
    """Longest sequence (prompt + response) the model accepts."""
    tie_word_embeddings: bool = False
    """LM head shares the token-embedding matrix."""
    router_aux_loss_coef: float = 0.001
    """Load-balancing loss coefficient (used by the trainer when enabled)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if the tokenizer has one."""
    eos_token_id: int | None = None
    """End-of-sequence id; generation stops on it."""
    pad_token_id: int | None = None
    """Padding id used in batches."""
    # -- router family (docs/model.md "Router families") ---------------------------------
    router: Literal[ROUTERS] | None = None
    """softmax_topk: softmax over all experts, then top-k (Qwen); topk_softmax: top-k of the
    logits, then softmax over the k (Mixtral); sigmoid: sigmoid scores, selection by scores +
    expert bias within the best groups (DeepSeek-V3, Kimi-K2, GLM-4.5)."""
    n_group: int = 1
    """Expert groups for group-limited top-k (sigmoid router); 1 = no group limit."""
    topk_group: int = 1
    """Groups a token may pick its experts from (by the sum of each group's top-2 scores)."""
    routed_scaling_factor: float = 1.0
    """Gate weights are multiplied by this after (optional) normalisation."""
    expert_bias: bool | None = None
    """Router carries `e_score_correction_bias`: added to the scores for selection only."""
    n_shared_experts: int | None = None
    """Always-on shared experts of width moe_intermediate_size * n_shared_experts (DeepSeek, GLM)."""
    shared_expert_intermediate_size: int = 0
    """Width of Qwen2-MoE's shared expert, scaled by sigmoid(shared_expert_gate(x)); 0 = none."""
    first_k_dense_replace: int | None = None
    """The first k decoder layers have a dense MLP (DeepSeek-V3, GLM-4.5)."""
    # -- attention -----------------------------------------------------------------------
    attention_bias: bool | None = None
    """q/k/v projections carry biases (Qwen2-MoE `qkv_bias`, GLM-4.5 `attention_bias`)."""
    qk_norm: bool | None = None
    """Per-head RMSNorm of q and k before RoPE (Qwen3; GLM-4.5 `use_qk_norm`)."""
    partial_rotary_factor: float | None = None
    """RoPE rotates the first head_dim * factor dims of each head (GLM-4.5: 0.5)."""
    rope_interleave: bool | None = None
    """DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3), ... instead of rotate-half."""
    q_lora_rank: int | None = None
    """MLA: rank of the query compression (None: a plain q_proj)."""
    kv_lora_rank: int | None = None
    """MLA: rank of the compressed key/value latent; None = not MLA (standard GQA attention)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key dims with RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    rope_scaling: dict[str, Any] | None = None
    """YaRN context extension as DeepSeek-V3 / Kimi-K2 release it (deepseek_v3 only):
    {rope_type: yarn, factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim}; None = plain RoPE."""
    # -- families added since: gpt-oss, Qwen3-Next / Qwen3.5-MoE, DeepSeek-V3.2 / GLM-5 ------
    layer_types: list[str] | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """Per decoder layer: full_attention, sliding_attention (gpt-oss) or linear_attention
    (Gated DeltaNet: Qwen3-Next, Qwen3.5-MoE); None = every layer full attention."""
    sliding_window: int | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """Keys a sliding_attention layer sees: the query's own position and the W-1 before it."""
    attention_sinks: bool | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """Per-head learned sink logit in the attention softmax, dropped after it (gpt-oss)."""
    attention_out_bias: bool | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """o_proj carries a bias (gpt-oss, whose attention_bias covers q, k, v and o)."""
    router_bias: bool | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """The router linear has a (trainable) bias added to its logits (gpt-oss)."""
    expert_mlp_bias: bool | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """Experts' gate_up and down projections carry biases (gpt-oss)."""
    swiglu_limit: float | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """gpt-oss's clamped SwiGLU: gate clamped above, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(swiglu_alpha * gate); None = plain SiLU(gate) * up."""
    swiglu_alpha: float = field(default=1.702, metadata=LATER_FAMILY_FIELD)
    """Sigmoid gain of the clamped SwiGLU."""
    norm_unit_offset: bool | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """RMSNorms scale by (1 + weight), weights zero-initialised (Qwen3-Next, Qwen3.5)."""
    attn_output_gate: bool | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """Gated attention: q_proj also yields a per-head gate, the output is times sigmoid(gate)
    (Qwen3-Next, Qwen3.5)."""
    linear_conv_kernel_dim: int = field(default=4, metadata=LATER_FAMILY_FIELD)
    """Gated DeltaNet: width of the causal depthwise convolution over q, k, v."""
    linear_key_head_dim: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """Gated DeltaNet: query/key head width."""
    linear_value_head_dim: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """Gated DeltaNet: value head width."""
    linear_num_key_heads: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """Gated DeltaNet: query/key heads."""
    linear_num_value_heads: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """Gated DeltaNet: value heads (a multiple of the key heads)."""
    index_topk: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """DeepSeek sparse attention: key positions the lightning indexer keeps per query; 0 =
    no indexer (dense attention)."""
    index_head_dim: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """Indexer query/key width (its first qk_rope_head_dim dims are rotated)."""
    index_n_heads: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """Indexer query heads."""
    indexer_rope_interleave: bool | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """The indexer rotates interleaved pairs (GLM-5) instead of half-split (DeepSeek-V3.2)."""
    indexer_types: list[str] | None = field(default=None, metadata=LATER_FAMILY_FIELD)
    """Per decoder layer: full (runs its indexer) or shared (reuses the previous full layer's
    choice; GLM-5); None = every layer full."""
    num_nextn_predict_layers: int = field(default=0, metadata=LATER_FAMILY_FIELD)
    """Multi-token-prediction layers after the decoder (DeepSeek-V3, GLM): loaded and saved,
    never part of the policy's forward or of route replay (docs/model.md "MTP layers")."""
    path: str | None = field(default=None, metadata={"hashed": "non_default"})
    """Experiment configs only (never in config.json): an HF folder (config, safetensors,
    tokenizer) whose weights are the initial policy; the fields above then come from its
    config.json."""

    def __post_init__(self) -> None:
        # Fields left None take the family's value (a YAML `model: {model_type: glm4_moe, ...}`
        # gets GLM's router, bias and partial RoPE without spelling them out).
        need(self.model_type in ARCHITECTURES,
             f"model_type {self.model_type!r} is not supported; expected one of "
             f"{list(ARCHITECTURES)}")
        for name, base in _BASE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, _FAMILY_DEFAULTS[self.model_type].get(name, base))
        self.validate()

    # -- derived -------------------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> list[int]:
        """Indices (in decoder order) of the MoE layers; the internal route layer axis."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i >= self.first_k_dense_replace
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of GQA."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        """Dims of each query/key head that RoPE rotates."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i: int) -> str:
        """Decoder layer i's token mixer: full_attention, sliding_attention or
        linear_attention."""
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    @property
    def linear_layer_ids(self) -> list[int]:
        """Decoder layers with Gated DeltaNet linear attention (a recurrent state, no KV)."""
        return [i for i in range(self.num_hidden_layers)
                if self.layer_type(i) == "linear_attention"]

    @property
    def is_dsa(self) -> bool:
        """DeepSeek sparse attention: MLA whose keys a lightning indexer selects per query."""
        return self.index_topk > 0

    def indexer_shared(self, i: int) -> bool:
        """Decoder layer i reuses the previous full layer's indexer choice (GLM-5); MTP layers
        (i >= num_hidden_layers) run their own."""
        return self.indexer_types is not None and i < self.num_hidden_layers and \
            self.indexer_types[i] == "shared"

    @property
    def indexer_layer_ids(self) -> list[int]:
        """Decoder layers that run their own indexer: the indexer-replay layer axis."""
        if not self.is_dsa:
            return []
        return [i for i in range(self.num_hidden_layers) if not self.indexer_shared(i)]

    @property
    def num_indexer_layers(self) -> int:
        return len(self.indexer_layer_ids)

    @property
    def supports_fp8(self) -> bool:
        """Block-FP8 matmuls are mapped for the families before gpt-oss only."""
        return self.model_type in _FP8_FAMILIES

    @property
    def score_function(self) -> str:
        """Megatron's moe_router_score_function: 'softmax' or 'sigmoid'."""
        return "sigmoid" if self.router == "sigmoid" else "softmax"

    @property
    def softmax_before_topk(self) -> bool:
        """Megatron's moe_router_pre_softmax: softmax over all experts, then top-k."""
        return self.router == "softmax_topk"

    @property
    def shared_expert_width(self) -> int:
        """Width of the shared expert MLP (0: none)."""
        return self.shared_expert_intermediate_size or \
            self.moe_intermediate_size * self.n_shared_experts

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of one layer's KV cache entry. MLA caches the
        expanded per-head keys and values (docs/model.md "Incremental decoding")."""
        if self.is_mla:
            return (self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
                    self.v_head_dim)
        return self.num_key_value_heads, self.head_dim, self.head_dim

    def family_default(self, name: str) -> Any:
        """What field `name` holds in this family when it is not given."""
        if name in _BASE_DEFAULTS:
            return _FAMILY_DEFAULTS[self.model_type].get(name, _BASE_DEFAULTS[name])
        f = self.__dataclass_fields__[name]
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    def partial_dict(self) -> dict[str, Any]:
        """asdict() with the fields that tell the families apart set to None where they hold
        this family's value: a base to which a partial config (another model_type) is added,
        as experiment configs do."""
        d = dataclasses.asdict(self)
        for name, base in _BASE_DEFAULTS.items():
            if d[name] == _FAMILY_DEFAULTS[self.model_type].get(name, base):
                d[name] = None
        return d

    @classmethod
    def for_architecture(cls, model_type: str, **fields) -> "ModelConfig":
        """A config of `model_type` with that family's defaults (router, norms, biases), any
        field overridden by `fields` (the same as ModelConfig(model_type=..., **fields))."""
        return cls(model_type=model_type, **fields)

    # -- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size",
                     "moe_intermediate_size", "max_position_embeddings", "decoder_sparse_step"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{name} must be a positive integer, got {v!r}")
        need(isinstance(self.num_experts, int) and self.num_experts >= 1,
             f"num_experts must be >= 1, got {self.num_experts!r}")
        need(isinstance(self.num_experts_per_tok, int)
             and 1 <= self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
             f"got {self.num_experts_per_tok!r}")
        need(self.num_experts <= 65535,
             f"num_experts={self.num_experts} exceeds 65535 (routes are stored as uint16)")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} must be a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(self.model_type in ARCHITECTURES,
             f"model_type {self.model_type!r} is not supported; expected one of "
             f"{list(ARCHITECTURES)}")
        need(self.router in ROUTERS, f"router {self.router!r} is not one of {list(ROUTERS)}")
        family = _FAMILY_DEFAULTS[self.model_type]
        defaults = {f.name: f.default for f in dataclasses.fields(self)
                    if f.default is not dataclasses.MISSING}
        defaults.update(_BASE_DEFAULTS, mlp_only_layers=[])
        for name in _ARCH_FIELDS:
            if name in _FAMILY_HF_FIELDS[self.model_type]:
                continue
            want = family.get(name, defaults[name])
            need(getattr(self, name) == want,
                 f"{name}={getattr(self, name)!r} is not expressible in a {self.model_type} "
                 f"config.json (that family has {name}={want!r}); choose another model_type")
        if self.model_type in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
            need(self.is_mla, f"model_type {self.model_type} needs kv_lora_rank (MLA)")
        if self.model_type in ("deepseek_v32", "glm_moe_dsa"):
            need(self.is_dsa, f"model_type {self.model_type} needs index_topk > 0 (its lightning "
                              f"indexer)")
        if self.model_type in ("gpt_oss", "qwen3_next", "qwen3_5_moe_text"):
            need(self.attention_out_bias == self.attention_bias,
                 f"{self.model_type}'s attention_bias covers q, k, v and o: attention_out_bias "
                 f"must equal attention_bias")
        if self.model_type in ("qwen3_next", "qwen3_5_moe_text"):
            need(self.shared_expert_intermediate_size > 0,
                 f"model_type {self.model_type} needs shared_expert_intermediate_size > 0 (its "
                 f"MoE blocks always have the gated shared expert)")
        if self.model_type in ("mixtral", "gpt_oss"):
            need(self.intermediate_size == self.moe_intermediate_size,
                 f"{self.model_type} has no dense layers and one expert width "
                 f"(intermediate_size): "
                 f"intermediate_size={self.intermediate_size} must equal "
                 f"moe_intermediate_size={self.moe_intermediate_size}")
        if self.model_type == "qwen2_moe":
            need(self.shared_expert_intermediate_size > 0,
                 "model_type qwen2_moe needs shared_expert_intermediate_size > 0")
        validate_new_families(self)
        need(0 < self.partial_rotary_factor <= 1,
             f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        need(self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
             f"the rotary dims (head_dim * partial_rotary_factor, or qk_rope_head_dim) must be "
             f"even and positive, got {self.rotary_dim}")
        for name in ("n_group", "topk_group"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name} must be >= 1, got {v!r}")
        need(self.topk_group <= self.n_group,
             f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        need(self.num_experts % self.n_group == 0,
             f"num_experts={self.num_experts} is not a multiple of n_group={self.n_group}")
        if self.n_group > 1:
            need(self.router == "sigmoid",
                 f"n_group={self.n_group} (group-limited top-k) needs router='sigmoid'")
            need(self.num_experts // self.n_group >= 2,
                 f"group-limited top-k ranks groups by their top-2 scores: num_experts / n_group "
                 f"must be >= 2, got {self.num_experts}/{self.n_group}")
            need(self.num_experts_per_tok <= self.topk_group * self.num_experts // self.n_group,
                 f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of "
                 f"topk_group={self.topk_group} groups")
        need(not self.expert_bias or self.router == "sigmoid",
             "expert_bias (e_score_correction_bias) needs router='sigmoid'")
        need(self.routed_scaling_factor > 0,
             f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        for name in ("n_shared_experts", "shared_expert_intermediate_size",
                     "first_k_dense_replace", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                 f"{name} must be a non-negative integer, got {v!r}")
        need(not (self.n_shared_experts and self.shared_expert_intermediate_size),
             "set n_shared_experts (plain shared experts) or shared_expert_intermediate_size "
             "(Qwen2-MoE's gated one), not both")
        if self.is_mla:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                v = getattr(self, name)
                need(isinstance(v, int) and v > 0, f"MLA needs {name} > 0, got {v!r}")
            need(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int)
                                              and self.q_lora_rank > 0),
                 f"q_lora_rank must be None or > 0, got {self.q_lora_rank!r}")
            need(not self.attention_bias, "attention_bias with MLA is not supported")
        else:
            need(self.q_lora_rank is None, "q_lora_rank is set but kv_lora_rank is None (MLA "
                                           "needs both)")
            need(not self.rope_interleave, "rope_interleave is only supported with MLA")
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            need(isinstance(rs, dict) and rs.get("rope_type") == "yarn"
                 and set(rs) <= set(_YARN_KEYS) and rs.get("factor", 0) >= 1,
                 f"rope_scaling must be a YaRN dict (rope_type 'yarn', factor >= 1, keys from "
                 f"{list(_YARN_KEYS)}), got {rs!r}")
        bad = [i for i in self.mlp_only_layers
               if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        need(not bad, f"mlp_only_layers has ids outside [0, {self.num_hidden_layers}): {bad}")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        need(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and 0 <= v < self.vocab_size),
                 f"{name}={v!r} is outside the vocabulary [0, {self.vocab_size})")

    # -- HF config.json ------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a HF config dict of any supported family; unknown keys are an error
        listing the valid ones, and a setting we do not run (rope scaling, sliding window,
        another activation) is an error naming it."""
        d = dict(d)
        model_type = d.pop("model_type", None) or "qwen3_moe"
        if model_type not in ARCHITECTURES:
            raise ConfigError(f"model_type {model_type!r} is not supported; expected one of "
                              f"{list(ARCHITECTURES)}")
        _merge_aliases(d, "num_experts", ("num_local_experts", "n_routed_experts"))
        _merge_aliases(d, "num_nextn_predict_layers", ("num_mtp_layers",))
        missing = [k for k in _REQUIRED_HF_KEYS if k not in d and not (
            k == "moe_intermediate_size" and model_type in ("mixtral", "gpt_oss")
            and "intermediate_size" in d)]
        if missing:  # never filled from the toy defaults: that would be another model
            raise ConfigError(f"config is missing required MoE field(s) {missing}; a "
                              f"{model_type} config.json has them all")
        rope = d.get("rope_parameters")
        legacy = d.pop("rope_scaling", None)
        if isinstance(rope, dict) and rope.get("rope_type", "default") == "yarn":
            d["rope_scaling"] = {k: v for k, v in rope.items() if k in _YARN_KEYS}
            rope = {k: v for k, v in rope.items() if k in ("rope_theta", "partial_rotary_factor")}
        elif isinstance(legacy, dict) and legacy.get("type", legacy.get("rope_type")) == "yarn":
            d["rope_scaling"] = {**{k: v for k, v in legacy.items() if k in _YARN_KEYS},
                                 "rope_type": "yarn"}
        elif legacy:
            raise ConfigError(f"rope_scaling {legacy!r} is not supported")
        if isinstance(rope, dict):
            if rope.get("rope_type", "default") != "default":
                raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported")
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rope:
                    if key in d and d[key] != rope[key]:
                        raise ConfigError(f"inconsistent config: {key}={d[key]} but "
                                          f"rope_parameters.{key}={rope[key]}")
                    d[key] = rope[key]
        if d.get("use_sliding_window") or (model_type == "mixtral" and d.get("sliding_window")):
            raise ConfigError("sliding-window attention is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported; expected 'silu'")
        if d.get("scoring_func", "sigmoid") != "sigmoid" or \
                d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"scoring_func={d.get('scoring_func')!r} / topk_method="
                              f"{d.get('topk_method')!r}: only DeepSeek-V3's sigmoid + noaux_tc "
                              f"router is supported")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            d["eos_token_id"] = eos[0] if eos else None
        # Family spellings of our fields.
        if model_type == "qwen2_moe":
            _merge_aliases(d, "attention_bias", ("qkv_bias",))
            d.setdefault("attention_bias", True)  # transformers' Qwen2MoeConfig default
        elif model_type == "qwen3_moe" and d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not part of Qwen3-MoE; not supported")
        if model_type == "glm4_moe":
            _merge_aliases(d, "qk_norm", ("use_qk_norm",))
            d.setdefault("partial_rotary_factor", 0.5)  # transformers' Glm4MoeConfig default
        if model_type == "mixtral":
            # Mixtral's intermediate_size is the expert width; it has no dense layers.
            d["moe_intermediate_size"] = d.get("intermediate_size", 14336)
        if model_type in NEW_FAMILY_READERS:
            NEW_FAMILY_READERS[model_type](d)
        if model_type == "deepseek_v3":
            d["head_dim"] = d.get("qk_rope_head_dim", 64)  # as transformers' DeepseekV3Config
            if d.get("attention_bias"):
                raise ConfigError("attention_bias=true with MLA is not supported")
            d.pop("attention_bias", None)
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        expressible = set(_COMMON_HF_FIELDS) | set(_FAMILY_HF_FIELDS[model_type])
        ignored = _IGNORED_HF_KEYS | _IGNORED_PER_ARCH.get(model_type, set()) | {
            "use_qk_norm", "qkv_bias", "partial_rotary_factor", "n_routed_experts",
            "num_experts", "attention_bias", "sliding_window"} - expressible
        unknown = sorted(k for k in d if k not in expressible and k not in ignored)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown} for model_type {model_type!r}; "
                              f"valid keys are {sorted(expressible)}")
        kw = {k: v for k, v in d.items() if k in expressible}
        try:
            return cls.for_architecture(model_type, **kw)
        except TypeError as e:
            raise ConfigError(str(e)) from None

    def to_hf_dict(self) -> dict[str, Any]:
        """This config in its family's config.json spelling (plus transformers-5 aliases)."""
        mt = self.model_type
        d = {k: getattr(self, k) for k in (*_COMMON_HF_FIELDS, *_FAMILY_HF_FIELDS[mt])}
        d.update({
            "architectures": [ARCHITECTURES[mt]],
            "model_type": mt,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
            "num_local_experts": self.num_experts,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
        })
        if mt == "qwen3_moe":
            d.update(attention_bias=False, use_sliding_window=False)
        elif mt == "qwen2_moe":
            d.update(qkv_bias=d.pop("attention_bias"), use_sliding_window=False)
        elif mt == "mixtral":
            d.update(sliding_window=None)
            d.pop("num_experts")
            d.pop("moe_intermediate_size")
        elif mt in NEW_FAMILY_WRITERS:
            NEW_FAMILY_WRITERS[mt](self, d)
        else:  # glm4_moe, deepseek_v3: DeepSeek spelling of the expert count
            d["n_routed_experts"] = d.pop("num_experts")
        if mt == "glm4_moe":
            d["use_qk_norm"] = d.pop("qk_norm")
            d["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        if mt in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
            d.update(attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc")
        if mt == "deepseek_v3" and d.pop("rope_scaling") is not None:
            d["rope_parameters"].update(self.rope_scaling)
        return d

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if path.exists() and not path.is_file():  # a FIFO or device would block the read
            raise ConfigError(f"{path} is not a regular file")
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        try:
            return cls.from_hf_dict(d)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{path}: {e}") from None

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def yarn_settings(rs: dict[str, Any], max_position: int) -> dict[str, Any]:
    """A YaRN `rope_scaling` with its defaults filled in, the one reading of them (our RoPE
    and the megatron mapping): `original_max_position_embeddings` else the model's context,
    `beta_fast` 32, `beta_slow` 1, `truncate` true (round the correction range);
    `mscale` / `mscale_all_dim` kept only when both are set (the attention factor is then
    their ratio, else 0.1 ln(factor) + 1), an explicit `attention_factor` as given."""
    both = bool(rs.get("mscale")) and bool(rs.get("mscale_all_dim"))
    return dict(factor=float(rs["factor"]),
                original=int(rs.get("original_max_position_embeddings") or max_position),
                beta_fast=float(rs.get("beta_fast") or 32),
                beta_slow=float(rs.get("beta_slow") or 1),
                truncate=bool(rs.get("truncate", True)),
                mscale=float(rs["mscale"]) if both else None,
                mscale_all_dim=float(rs["mscale_all_dim"]) if both else None,
                attention_factor=rs.get("attention_factor"))


def _merge_aliases(d: dict[str, Any], name: str, aliases: tuple[str, ...]) -> None:
    """Read `name` from whichever spelling is present; two spellings must agree."""
    for alias in aliases:
        if alias not in d:
            continue
        if name in d and d[name] != d[alias]:
            raise ConfigError(f"inconsistent config: {name}={d[name]} but {alias}={d[alias]}")
        d[name] = d[alias]
