"""Typed model configuration that reads and writes Hugging Face Qwen3-MoE `config.json`.

Both spellings found in the wild are read: released Qwen3-MoE folders say `num_experts` and
`rope_theta`; transformers 5's `save_pretrained` writes `num_local_experts` and
`rope_parameters: {rope_theta, rope_type}`. We always write the released spelling plus the
transformers-5 aliases, so either reader loads our folders.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json (or ModelConfig) that is not a valid Qwen3-MoE configuration."""


def need(cond: bool, msg: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error(msg)` unless `cond`: the one validator the typed configs share."""
    if not cond:
        raise error(msg)


def strict_kwargs(cls: type, d: Any, what: str | None = None,
                  error: type[Exception] = ConfigError) -> dict[str, Any]:
    """`d` checked as keyword arguments of dataclass `cls`: an unknown key raises `error`
    naming it and listing the valid ones ("<what>: unknown keys [...]; valid keys are [...]",
    `what` defaulting to the class name). Returns a copy to pass as `cls(**kw)`."""
    what = what or cls.__name__
    if not isinstance(d, dict):
        raise error(f"{what} must be a mapping, got {type(d).__name__}")
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in d if k not in valid)
    if unknown:
        raise error(f"{what}: unknown keys {unknown}; valid keys are {valid}")
    return dict(d)


# Keys of a HF config.json that carry no information for us and are accepted silently.
_IGNORED_HF_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "attention_bias", "attention_dropout", "hidden_act", "initializer_range",
    "output_router_logits", "rope_scaling", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types", "_name_or_path", "qkv_bias", "num_local_experts",
    "rope_parameters",
})


@dataclass
class ModelConfig:
    """Qwen3-MoE architecture hyper-parameters (field names follow HF `config.json`)."""

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
    norm_topk_prob: bool = True
    """Renormalise the top-k gate weights to sum to one."""
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

    def __post_init__(self) -> None:
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
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

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
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
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
        """Build from a HF config dict; unknown keys are an error listing the valid ones."""
        d = dict(d)
        model_type = d.get("model_type")
        if model_type not in (None, "qwen3_moe"):
            raise ConfigError(f"model_type {model_type!r} is not supported; expected 'qwen3_moe'")
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        elif "num_experts" in d and "num_local_experts" in d \
                and d["num_experts"] != d["num_local_experts"]:
            raise ConfigError(f"inconsistent config: num_experts={d['num_experts']} but "
                              f"num_local_experts={d['num_local_experts']}")
        rope = d.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope:
            if "rope_theta" in d and d["rope_theta"] != rope["rope_theta"]:
                raise ConfigError(f"inconsistent config: rope_theta={d['rope_theta']} but "
                                  f"rope_parameters.rope_theta={rope['rope_theta']}")
            d["rope_theta"] = rope["rope_theta"]
        if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported")
        if d.get("rope_scaling"):
            raise ConfigError(f"rope_scaling {d['rope_scaling']!r} is not supported")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not part of Qwen3-MoE; not supported")
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported; expected 'silu'")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            d["eos_token_id"] = eos[0] if eos else None
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        valid = set(cls.field_names())
        unknown = sorted(k for k in d if k not in valid and k not in _IGNORED_HF_KEYS)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; valid keys are {sorted(valid)}")
        return cls(**{k: v for k, v in d.items() if k in valid})

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
            "num_local_experts": self.num_experts,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
        })
        return d

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_hf_dict(d)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{path}: {e}") from None

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
