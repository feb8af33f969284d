"""A tiny "pretrained" setup written the way a user would bring it: a byte-level BPE tokenizer
with a chat template trained here with `tokenizers`, a random Qwen3-MoE written by
transformers' save_pretrained into the same folder, a JSONL set of arithmetic word problems, and
a reward file with verl's compute_score signature."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAMES = ["Tom", "Ana", "Li", "Sam", "Eva", "Raj", "Mia", "Ben"]
THINGS = ["apples", "books", "coins", "stamps", "shells", "cards"]

REWARD_FILE = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right final number, 0.1 for any number, 0 otherwise."""
    numbers = re.findall(r"-?\\d+", solution_str)
    if not numbers:
        return 0.0
    return {"score": 1.0 if numbers[-1] == str(ground_truth) else 0.1, "n": len(numbers)}
'''


def word_problems(n: int, seed: int) -> list[dict]:
    """verl-format rows: chat-message prompts (every 4th a plain string), ground truth."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randrange(1, 10), rng.randrange(1, 10)
        text = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?"
        prompt = text if i % 4 == 3 else [{"role": "user", "content": text}]
        rows.append({"prompt": prompt, "data_source": "arith" if i % 2 else "arith_b",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i}})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_tokenizer(folder: Path, texts: list[str]):
    """Byte-level BPE trained on `texts`, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[
        "<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                 eos_token="<|im_end|>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(folder))
    return hf


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
