"""The tables that tell the model families apart: each family's HF class name, the config.json
fields it can express, the keys it may carry that hold no information for us, and the default
values of the fields that differ between families. Data only; moe/config.py's `ModelConfig`
reads them (its defaults, its checks, its config.json reading and writing).
"""

from __future__ import annotations

from typing import Any

from .config_families import _DSA_HF_FIELDS, _LINEAR_HF_FIELDS

# Keys of a HF config.json that carry no information for us and are accepted silently.
_IGNORED_HF_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "attention_bias", "attention_dropout", "hidden_act", "initializer_range",
    "output_router_logits", "rope_scaling", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types", "_name_or_path", "qkv_bias", "num_local_experts",
    "rope_parameters",
    "quantization_config",  # block FP8: read (and checked) with the weights, moe/hf_lazy.py
})

# Per architecture: the HF class name, and the keys its config.json may carry that hold no
# information for us (MTP heads we do not run, jitter noise that is 0 at inference, ...).
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)
_DSA_IGNORED = {"n_routed_experts", "qk_head_dim",
                "pretraining_tp", "topk_method", "scoring_func", "ep_size", "moe_layer_freq",
                "aux_loss_alpha", "seq_aux", "index_topk_freq", "index_skip_topk_offset",
                "index_topk_pattern"}
_IGNORED_PER_ARCH = {
    "mixtral": {"router_jitter_noise"},
    "glm4_moe": {"n_routed_experts"},
    "deepseek_v3": {"n_routed_experts",
                    "qk_head_dim", "pretraining_tp", "topk_method", "scoring_func",
                    "ep_size", "moe_layer_freq", "aux_loss_alpha", "seq_aux"},
    "deepseek_v32": _DSA_IGNORED,
    "glm_moe_dsa": _DSA_IGNORED,
}
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid")
# Fields an HF config.json must give (the dataclass defaults are the toy model's).
_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_experts", "num_experts_per_tok", "moe_intermediate_size")

# config.json keys every family carries (under these names or the aliases read above).
_COMMON_HF_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "num_experts", "num_experts_per_tok", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "router_aux_loss_coef", "bos_token_id", "eos_token_id",
    "pad_token_id")
# The family-specific fields each config.json can express; every other field of ModelConfig
# must keep the family's default (validate() checks), so a saved folder means what we ran.
_FAMILY_HF_FIELDS = {
    "qwen3_moe": ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"),
    "qwen2_moe": ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                  "shared_expert_intermediate_size", "attention_bias"),
    "mixtral": (),
    "glm4_moe": ("norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
                 "n_shared_experts", "first_k_dense_replace", "attention_bias", "qk_norm",
                 "partial_rotary_factor", "num_nextn_predict_layers"),
    "deepseek_v3": ("norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
                    "n_shared_experts", "first_k_dense_replace", "rope_interleave",
                    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "rope_scaling", "num_nextn_predict_layers"),
    # attention_bias covers q, k, v and o (attention_out_bias follows it); intermediate_size
    # is the expert width (no dense layers), as Mixtral's
    "gpt_oss": ("layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha",
                "attention_bias", "attention_out_bias", "rope_scaling"),
    # attention_bias covers q, k, v and o; every MoE block has the gated shared expert
    "qwen3_next": ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                   "shared_expert_intermediate_size", "attention_bias", "attention_out_bias",
                   "partial_rotary_factor", *_LINEAR_HF_FIELDS),
    "qwen3_5_moe_text": ("shared_expert_intermediate_size", "attention_bias",
                         "attention_out_bias", "partial_rotary_factor", *_LINEAR_HF_FIELDS),
    # MLA (always interleaved, q_lora_rank required) with the lightning indexer
    "deepseek_v32": _DSA_HF_FIELDS,
    "glm_moe_dsa": (*_DSA_HF_FIELDS, "indexer_types"),
}
# Values of the fields that tell the families apart: Qwen3-MoE's, then each family's own.
_BASE_DEFAULTS: dict[str, Any] = dict(
    router="softmax_topk", norm_topk_prob=True, expert_bias=False, n_shared_experts=0,
    first_k_dense_replace=0, attention_bias=False, qk_norm=True, partial_rotary_factor=1.0,
    rope_interleave=False, attention_sinks=False, attention_out_bias=False, router_bias=False,
    expert_mlp_bias=False, swiglu_limit=None, norm_unit_offset=False, attn_output_gate=False,
    indexer_rope_interleave=False)
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {},
    "qwen2_moe": dict(qk_norm=False, attention_bias=True, norm_topk_prob=False),
    "mixtral": dict(qk_norm=False, router="topk_softmax"),
    "glm4_moe": dict(qk_norm=False, router="sigmoid", expert_bias=True, n_shared_experts=1,
                     first_k_dense_replace=1, partial_rotary_factor=0.5),
    "deepseek_v3": dict(qk_norm=False, router="sigmoid", expert_bias=True, n_shared_experts=1,
                        first_k_dense_replace=3, rope_interleave=True),
    "gpt_oss": dict(qk_norm=False, router="topk_softmax", attention_bias=True,
                    attention_out_bias=True, attention_sinks=True, router_bias=True,
                    expert_mlp_bias=True, swiglu_limit=7.0),
    "qwen3_next": dict(norm_unit_offset=True, attn_output_gate=True, partial_rotary_factor=0.25),
    "qwen3_5_moe_text": dict(norm_unit_offset=True, attn_output_gate=True,
                             partial_rotary_factor=0.25),
    "deepseek_v32": dict(qk_norm=False, router="sigmoid", expert_bias=True, n_shared_experts=1,
                         first_k_dense_replace=3, rope_interleave=True),
    "glm_moe_dsa": dict(qk_norm=False, router="sigmoid", expert_bias=True, n_shared_experts=1,
                        first_k_dense_replace=3, rope_interleave=True,
                        indexer_rope_interleave=True),
}
_ARCH_FIELDS = ("router", "n_group", "topk_group", "routed_scaling_factor", "expert_bias",
                "n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace",
                "attention_bias", "qk_norm", "partial_rotary_factor", "rope_interleave",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                "rope_scaling", "layer_types", "sliding_window", "attention_sinks",
                "attention_out_bias", "router_bias", "expert_mlp_bias", "swiglu_limit",
                "swiglu_alpha", "norm_unit_offset", "attn_output_gate", "linear_conv_kernel_dim",
                "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "index_topk", "index_head_dim", "index_n_heads",
                "indexer_rope_interleave", "indexer_types", "num_nextn_predict_layers")
_YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
