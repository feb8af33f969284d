"""`lockstep example-data DIR`: write a complete "bring your own model and data" setup to try
`data.train_files` without downloading anything:

    DIR/policy/      a random tiny Qwen3-MoE HF folder with a byte-level BPE tokenizer (trained
                     here with `tokenizers`) and a chat template, loadable by transformers
    DIR/train.jsonl  arithmetic word problems in verl's columns (prompt as chat messages)
    DIR/val.jsonl    held-out problems
    DIR/reward.py    a compute_score(data_source, solution_str, ground_truth, extra_info)
    DIR/env.py       a multi-turn environment (rollout.env): a wrong first answer gets a
                     second try after a hint, sent as a user message through the chat template

    lockstep example-data runs/example
    lockstep train configs/dataset_example.yaml --out runs/example/run
    lockstep train configs/dataset_agent_example.yaml --out runs/example/agent   # multi-turn

Needs the extra 'data' (transformers for the tokenizer folder).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAMES = ["Tom", "Ana", "Li", "Sam", "Eva", "Raj", "Mia", "Ben"]
THINGS = ["apples", "books", "coins", "stamps", "shells", "cards"]

REWARD_FILE = '''"""Reward for the arithmetic word problems (verl's compute_score signature)."""
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right final number, 0.1 for any number, 0 otherwise."""
    numbers = re.findall(r"-?\\d+", solution_str)
    if not numbers:
        return 0.0
    return {"score": 1.0 if numbers[-1] == str(ground_truth) else 0.1, "n": len(numbers)}
'''

ENV_FILE = '''"""A multi-turn environment for the word problems (lockstep's rollout.env protocol):
a wrong first answer gets one more try after a hint; the reward function scores the last turn."""
import re


def reset(problem):
    return {"answer": str(problem["ground_truth"]), "tries": 0}


def step(state, turn):
    numbers = re.findall(r"-?\\d+", turn["text"])
    if (numbers and numbers[-1] == state["answer"]) or state["tries"] >= 1:
        return {"done": True}
    hint = "Not quite: add the two numbers and answer with one number."
    return {"observation": [{"role": "user", "content": hint}],
            "state": {**state, "tries": state["tries"] + 1}}
'''


def word_problems(n: int, seed: int) -> list[dict]:
    """verl-format rows: chat-message prompts (every 4th a plain string) and ground truths."""
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


def build_tokenizer(folder: Path, texts: list[str], vocab_size: int = 300):
    """Byte-level BPE trained on `texts` with `<|pad|>`, `<|im_start|>`, `<|im_end|>` (= eos)
    and a chat template, saved as a transformers tokenizer folder; returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                 eos_token="<|im_end|>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(folder))
    return hf


def write_example(root: str | Path, n_train: int = 64, n_val: int = 16, seed: int = 0) -> Path:
    """Write policy/, train.jsonl, val.jsonl and reward.py under `root`; returns `root`."""
    import torch

    from lockstep.moe.checkpoint import save_hf
    from lockstep.moe.config import ModelConfig
    from lockstep.moe.model import MoEModel

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    train, val = word_problems(n_train, seed), word_problems(n_val, seed + 1)
    texts = [json.dumps(r["prompt"]) for r in train + val] + [str(i) for i in range(30)]
    tok = build_tokenizer(root / "tokenizer.tmp", texts * 4)
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    save_hf(MoEModel(cfg), root / "policy", tokenizer=tok)
    import shutil

    shutil.rmtree(root / "tokenizer.tmp")
    write_jsonl(root / "train.jsonl", train)
    write_jsonl(root / "val.jsonl", val)
    (root / "reward.py").write_text(REWARD_FILE)
    (root / "env.py").write_text(ENV_FILE)
    return root


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("example-data", help="write a tiny model folder, prompt set and reward "
                       "file to try data.train_files", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="where to write policy/, train.jsonl, val.jsonl, reward.py, "
                   "env.py")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    root = write_example(args.dir)
    print(f"wrote {root}/policy, {root}/train.jsonl, {root}/val.jsonl, {root}/reward.py, "
          f"{root}/env.py")
    return 0
