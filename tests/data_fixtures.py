"""A tiny "pretrained" setup written the way a user would bring it: a byte-level BPE tokenizer
with a chat template trained here with `tokenizers`, a random Qwen3-MoE written by
transformers' save_pretrained into the same folder, a JSONL set of arithmetic word problems, and
a reward file with verl's compute_score signature."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.launch.example import (CHAT_TEMPLATE, REWARD_FILE, build_tokenizer,  # noqa: F401
                                    word_problems, write_jsonl)


def build_model_folder(root: Path, n_train: int = 10, n_val: int = 4, seed: int = 0):
    """(model folder, train.jsonl, val.jsonl, reward.py) under `root`."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    train, val = word_problems(n_train, seed), word_problems(n_val, seed + 1)
    texts = [json.dumps(r["prompt"]) for r in train + val] + [str(i) for i in range(30)]
    folder = root / "policy"
    hf_tok = build_tokenizer(folder, texts * 4)
    cfg = Qwen3MoeConfig(
        vocab_size=len(hf_tok), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False, norm_topk_prob=True)
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(cfg).save_pretrained(str(folder))
    reward = root / "reward.py"
    reward.write_text(REWARD_FILE)
    return (folder, write_jsonl(root / "train.jsonl", train), write_jsonl(root / "val.jsonl", val),
            reward)
