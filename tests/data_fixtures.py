"""A tiny "pretrained" setup written the way a user would bring it: a byte-level BPE tokenizer
with a chat template trained here with `tokenizers`, a random DeepSeek-V3-style MoE written by
transformers' save_pretrained into the same folder, a JSONL set of arithmetic word problems, and
a reward file with verl's compute_score signature."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.launch.example import (CHAT_TEMPLATE, REWARD_FILE, build_tokenizer,  # noqa: F401
                                    word_problems, write_jsonl)


def build_model_folder(root: Path, n_train: int = 10, n_val: int = 4, seed: int = 0,
                       family: str = "deepseek_v3"):
    """(model folder, train.jsonl, val.jsonl, reward.py) under `root`; the policy is a random
    tiny `family` model (arch_fixtures: DeepSeek-V3 = MLA, sigmoid router with expert bias and
    group-limited top-k, a dense first layer) written by transformers."""
    from arch_fixtures import write_hf_folder

    train, val = word_problems(n_train, seed), word_problems(n_val, seed + 1)
    texts = [json.dumps(r["prompt"]) for r in train + val] + [str(i) for i in range(30)]
    folder = root / "policy"
    hf_tok = build_tokenizer(folder, texts * 4)
    write_hf_folder(family, folder, seed=seed, vocab_size=len(hf_tok),
                    eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
                    bos_token_id=None)
    reward = root / "reward.py"
    reward.write_text(REWARD_FILE)
    return (folder, write_jsonl(root / "train.jsonl", train), write_jsonl(root / "val.jsonl", val),
            reward)
