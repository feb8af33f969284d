"""Tiny model configs shared by tests."""

from lockstep.moe.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48,
                moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                eos_token_id=2, pad_token_id=0, bos_token_id=1)
    base.update(overrides)
    return ModelConfig(**base)
