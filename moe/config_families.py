"""What the families added since DeepSeek-V3 bring to ModelConfig: the checks of their fields
and their config.json spellings (gpt-oss, Qwen3-Next / Qwen3.5-MoE; moe/config.py holds the
fields themselves)."""

from __future__ import annotations

from typing import Any

from .checks import need

# The functions below take a moe/config.py `ModelConfig` (named in their annotations only: that
# module imports this one).

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
_DSA_HF_FIELDS = ("norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
                  "n_shared_experts", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_scaling",
                  "index_topk", "index_head_dim", "index_n_heads", "num_nextn_predict_layers")
_LINEAR_HF_FIELDS = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def validate_new_families(self: "ModelConfig") -> None:
    """The fields of gpt-oss, Qwen3-Next / Qwen3.5 and DeepSeek-V3.2 / GLM-5."""
    L = self.num_hidden_layers
    if self.layer_types is not None:
        lt = self.layer_types
        need(isinstance(lt, list) and len(lt) == L and all(t in LAYER_TYPES for t in lt),
             f"layer_types must list one of {list(LAYER_TYPES)} per decoder layer "
             f"({L}), got {lt!r}")
    kinds = {self.layer_type(i) for i in range(L)}
    if "sliding_attention" in kinds:
        need(isinstance(self.sliding_window, int) and not isinstance(self.sliding_window, bool)
             and self.sliding_window >= 1,
             f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window!r}")
    if "linear_attention" in kinds:
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"linear_attention layers need {name} > 0, got {v!r}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
             f"linear_num_key_heads={self.linear_num_key_heads}")
    need(not (kinds - {"full_attention"}) or not self.is_mla,
         f"layer_types {sorted(kinds)} with MLA (kv_lora_rank) is not supported")
    need(self.swiglu_limit is None or (_is_number(self.swiglu_limit)
                                       and self.swiglu_limit > 0),
         f"swiglu_limit must be None or > 0, got {self.swiglu_limit!r}")
    need(_is_number(self.swiglu_alpha) and self.swiglu_alpha > 0,
         f"swiglu_alpha must be > 0, got {self.swiglu_alpha!r}")
    for name in ("index_topk", "index_head_dim", "index_n_heads", "num_nextn_predict_layers"):
        v = getattr(self, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
             f"{name} must be a non-negative integer, got {v!r}")
    if self.is_dsa:
        need(self.is_mla and self.q_lora_rank is not None,
             "the lightning indexer (index_topk > 0) needs MLA with q_lora_rank: it reads "
             "the compressed query")
        need(self.index_n_heads > 0 and self.index_head_dim >= self.qk_rope_head_dim,
             f"index_topk > 0 needs index_n_heads > 0 and index_head_dim >= "
             f"qk_rope_head_dim={self.qk_rope_head_dim}, got {self.index_n_heads} / "
             f"{self.index_head_dim}")
        it = self.indexer_types
        need(it is None or (isinstance(it, list) and len(it) == L
                            and all(t in ("full", "shared") for t in it)
                            and it[0] == "full"),
             f"indexer_types must list full or shared per decoder layer ({L}), the first "
             f"full, got {it!r}")
    else:
        need(self.indexer_types is None, "indexer_types without index_topk > 0")


def _read_gpt_oss(d: dict[str, Any]) -> None:
    """gpt-oss's spellings: intermediate_size is the expert width; attention_bias covers
    q/k/v/o; transformers' defaults for what a config.json may leave out."""
    d["moe_intermediate_size"] = d.get("intermediate_size", 2880)
    d.setdefault("attention_bias", True)
    d["attention_out_bias"] = d["attention_bias"]
    d.setdefault("swiglu_limit", 7.0)
    d.setdefault("sliding_window", 128)
    if d.get("layer_types") is None:
        d["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                            for i in range(d["num_hidden_layers"])]


def _explicit_layer_types(cfg: "ModelConfig", d: dict[str, Any]) -> None:
    """Our None means every layer full attention; in a config.json it means the family's
    default pattern (transformers' and the readers above), so the list is always written."""
    d["layer_types"] = [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)]


def _write_gpt_oss(cfg: "ModelConfig", d: dict[str, Any]) -> None:
    _explicit_layer_types(cfg, d)
    d.pop("num_experts")
    d.pop("moe_intermediate_size")
    d.pop("attention_out_bias")
    if d.pop("rope_scaling") is not None:
        d["rope_parameters"].update(cfg.rope_scaling)


def _read_qwen_hybrid(d: dict[str, Any]) -> None:
    """Qwen3-Next / Qwen3.5-MoE: transformers' defaults (partial RoPE 0.25, a full-attention
    layer every 4th); attention_bias covers q/k/v/o."""
    d.setdefault("partial_rotary_factor", 0.25)
    d.setdefault("attention_bias", False)
    d["attention_out_bias"] = d["attention_bias"]
    if d.get("layer_types") is None:
        d["layer_types"] = ["linear_attention" if (i + 1) % 4 else "full_attention"
                            for i in range(d["num_hidden_layers"])]


def _write_qwen_hybrid(cfg: "ModelConfig", d: dict[str, Any]) -> None:
    _explicit_layer_types(cfg, d)
    d.pop("attention_out_bias")
    d["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.model_type == "qwen3_next":
        d["use_sliding_window"] = False


def _read_dsa(d: dict[str, Any]) -> None:
    """DeepSeek-V3.2 / GLM-5: head_dim is the rotary width (as transformers'), the MLP and
    attention layer-type lists must say what first_k_dense_replace and DSA say, and GLM-5's
    indexer schedule may be given as a pattern or a frequency."""
    from .checks import ConfigError

    d["head_dim"] = d.get("qk_rope_head_dim", 64)
    if d.pop("attention_bias", False) or d.pop("mlp_bias", False):
        raise ConfigError("attention_bias / mlp_bias = true with MLA is not supported")
    L, k = d["num_hidden_layers"], d.setdefault("first_k_dense_replace", 3)
    want = ["dense"] * min(k, L) + ["sparse"] * max(L - k, 0)
    if d.get("mlp_layer_types", want) != want:
        raise ConfigError(f"mlp_layer_types {d['mlp_layer_types']!r} is not first_k_dense_replace"
                          f"={k} dense layers then sparse ones (the only layout supported)")
    d.pop("mlp_layer_types", None)
    if d.get("layer_types", ["indexed_attention"] * L) != ["indexed_attention"] * L:
        raise ConfigError(f"layer_types {d['layer_types']!r}: every layer of a DSA model is "
                          f"indexed_attention")
    d.pop("layer_types", None)
    d.pop("qk_head_dim", None)
    pattern, freq = d.pop("index_topk_pattern", None), d.pop("index_topk_freq", None)
    offset = d.pop("index_skip_topk_offset", 2)
    if d.get("indexer_types") is None and pattern is not None:
        d["indexer_types"] = [{"F": "full", "S": "shared"}[c] for c in pattern] \
            if isinstance(pattern, str) else list(pattern)
    elif d.get("indexer_types") is None and freq is not None and freq > 1:
        d["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                              for i in range(L)]
    if d.get("indexer_types") == ["full"] * L:
        d["indexer_types"] = None


def _write_dsa(cfg: "ModelConfig", d: dict[str, Any]) -> None:
    L = cfg.num_hidden_layers
    d["n_routed_experts"] = d.pop("num_experts")
    k = cfg.first_k_dense_replace
    d["mlp_layer_types"] = ["dense"] * min(k, L) + ["sparse"] * max(L - k, 0)
    d["layer_types"] = ["indexed_attention"] * L
    if cfg.model_type == "glm_moe_dsa" and cfg.indexer_types is None:
        d["indexer_types"] = ["full"] * L
    if d.pop("rope_scaling") is not None:
        d["rope_parameters"].update(cfg.rope_scaling)


# config.json spellings of the families added since (read before the common checks, written
# after the common fields)
NEW_FAMILY_READERS = {"gpt_oss": _read_gpt_oss, "qwen3_next": _read_qwen_hybrid,
                      "qwen3_5_moe_text": _read_qwen_hybrid, "deepseek_v32": _read_dsa,
                      "glm_moe_dsa": _read_dsa}
NEW_FAMILY_WRITERS = {"gpt_oss": _write_gpt_oss, "qwen3_next": _write_qwen_hybrid,
                      "qwen3_5_moe_text": _write_qwen_hybrid, "deepseek_v32": _write_dsa,
                      "glm_moe_dsa": _write_dsa}
