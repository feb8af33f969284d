"""Prompt sources for the RL loop: the synthetic task, or a prompt data set with a reward function.

A data set is JSONL or Parquet in verl's columns, one prompt per row:

    {"prompt": [{"role": "user", "content": "Tom has 3 apples ..."}],   # or a plain string
     "data_source": "arith", "reward_model": {"ground_truth": "7"}, "extra_info": {"id": 12}}

Chat messages go through the tokenizer's chat template (with the generation prompt); a string is
tokenised as it is. Prompts longer than `data.max_prompt_length` tokens are dropped, with the
count in the log. The tokenizer is transformers' `AutoTokenizer` of the model folder
(`model.path`), read locally.

Order: epoch e visits the prompts in a permutation seeded by (loop.seed, e); the cursor (a plain
int, `LoopState.cursor`) counts prompts drawn so far, so epoch = cursor // N and the position in
it = cursor % N. A resumed run continues from the checkpointed cursor with the same order.

Both sources give the loop the same interface (`PromptSource`): `prompts(cursor, n)`,
`rewards(prompts_per_sample, results)`, `pad_id`, `max_prompt_len`, `tokenizer`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep.rollout.rewards import RewardCall, RewardConfig, RewardPool
from lockstep.rollout.tasks import Task
from lockstep.rollout.types import GenerateRequest, GenerationResult, SamplingParams
from lockstep.trainer.config.sections import DataConfig

DATA_FILE = "data.json"  # in the run directory: the fingerprints a resumed run must match


@dataclass(frozen=True)
class Prompt:
    """One prompt of either source; `ground_truth` is what its reward compares against."""

    ids: tuple[int, ...]
    ground_truth: Any
    data_source: str = ""
    extra_info: dict = field(default_factory=dict, hash=False, compare=False)


# -- reading -----------------------------------------------------------------------------
def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of one JSONL or Parquet file as dicts (pyarrow only for Parquet)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("Parquet data files need pyarrow (pip install 'lockstep[data]')"
                              ) from None
        return pq.read_table(path).to_pylist()
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON: {e}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: a row must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def load_tokenizer(folder: str | Path):
    """transformers' AutoTokenizer of a local model folder (nothing is downloaded)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("data sets need transformers for the tokenizer and chat template "
                          "(pip install 'lockstep[data]')") from None
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def encode_prompt(tokenizer, prompt: Any, where: str) -> list[int]:
    """Token ids of one `prompt` cell: chat messages through the chat template (generation
    prompt added), a string as it is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ok = (isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt))
    if not ok:
        raise ValueError(f"{where}: prompt must be a string or a non-empty list of "
                         f"{{role, content}} messages, got {str(prompt)[:120]!r}")
    if not tokenizer.chat_template:
        raise ValueError(f"{where}: chat-message prompts need a chat template, but the "
                         "tokenizer has none (add one to tokenizer_config.json)")
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_prompts(files: Sequence[str], tokenizer, max_prompt_length: int, what: str,
                 log: Callable[[str], None] = print) -> list[Prompt]:
    """Every row of `files` as a Prompt, over-long ones dropped (counted in the log)."""
    prompts, dropped, total = [], 0, 0
    for f in files:
        for n, row in enumerate(read_rows(f), 1):
            where = f"{f}: row {n}"
            total += 1
            if "prompt" not in row:
                raise ValueError(f"{where}: no 'prompt' column (columns: {sorted(row)})")
            rm = row.get("reward_model")
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise ValueError(f"{where}: needs reward_model.ground_truth, got "
                                 f"reward_model={str(rm)[:80]!r}")
            extra = row.get("extra_info") or {}
            if not isinstance(extra, dict):
                raise ValueError(f"{where}: extra_info must be a mapping, got {extra!r}")
            ids = encode_prompt(tokenizer, row["prompt"], where)
            if len(ids) > max_prompt_length:
                dropped += 1
                continue
            prompts.append(Prompt(tuple(ids), rm["ground_truth"], str(row.get("data_source", "")),
                                  extra))
    log(f"data: {what}: {len(prompts)} prompts from {total} rows of {len(files)} file(s); "
        f"dropped {dropped} longer than data.max_prompt_length={max_prompt_length} tokens")
    if not prompts:
        raise ValueError(f"data: {what}: no prompt is at most data.max_prompt_length="
                         f"{max_prompt_length} tokens long ({total} rows read)")
    return prompts


def resolve_lengths(cfg, source: DatasetSource, log: Callable[[str], None] = print):
    """`cfg` (an ExperimentConfig of a data run) with an unset data.max_prompt_length set to the
    longest prompt `source` kept and an unset rollout.max_new_tokens to the rest of the model's
    context, each choice said once in the log (config.yaml records the result); the warm start
    a data run left unset is off."""
    data, ro = cfg.data, cfg.rollout
    context = cfg.model.max_position_embeddings
    if "enabled" not in cfg.warmstart.model_fields_set:
        log("defaults: warmstart.enabled=false (a data run starts from model.path; the warm "
            "start trains on the synthetic task only)")
    P, R = data.max_prompt_length, ro.max_new_tokens
    if P is None:
        P = source.max_prompt_len
        log(f"defaults: data.max_prompt_length={P}, the longest prompt of the data (at most "
            f"{data.prompt_cap(R, context)}: "
            f"{'max_position_embeddings - rollout.max_new_tokens' if R else 'half the context'})")
        data = dataclasses.replace(data, max_prompt_length=P)
    if R is None:
        R = context - P
        log(f"defaults: rollout.max_new_tokens={R}, the model's context left after the "
            f"longest prompt (max_position_embeddings={context} - {P})")
        ro = ro.model_copy(update={"max_new_tokens": R})
    if data is cfg.data and ro is cfg.rollout:
        return cfg
    out = cfg.model_copy(update={"data": data, "rollout": ro})
    return out._check()  # the checks across sections, on the lengths now set


def fingerprint(prompts: Sequence[Prompt]) -> str:
    """Hash of the prompt ids and ground truths (a resumed run must see the same data)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.ids, p.ground_truth, p.data_source], default=str).encode())
    return h.hexdigest()[:16]


# -- sources -----------------------------------------------------------------------------
class TaskSource:
    """The synthetic task as a prompt source (problem i is a pure function of (seed, i))."""

    def __init__(self, task: Task, seed: int):
        self.task, self.seed = task, seed
        self.pad_id, self.tokenizer = task.pad_id, task.tokenizer
        self.max_prompt_len = task.prompt_len

    def prompts(self, cursor: int, n: int) -> list[Prompt]:
        return [Prompt(tuple(self.task.prompt_ids(p)), p)
                for p in self.task.problems(self.seed, cursor, n)]

    def rewards(self, prompts: Sequence[Prompt], results: Sequence[GenerationResult]):
        """(rewards [B], metrics) for sample b of prompt `prompts[b]`."""
        return torch.tensor([self.task.reward(p.ground_truth, r.output_ids)
                             for p, r in zip(prompts, results)]), {}

    def close(self) -> None:
        pass


class DatasetSource:
    """Training prompts of a data set in seeded per-epoch order, scored by a RewardPool."""

    def __init__(self, cfg: DataConfig, reward: RewardConfig, model_path: str, seed: int,
                 log: Callable[[str], None] = print, max_prompt_length: int | None = None):
        """`max_prompt_length`: the cap of an unset data.max_prompt_length (`prompt_cap`)."""
        tokenizer = load_tokenizer(Path(model_path).expanduser())
        self.cfg, self.seed, self.tokenizer = cfg, seed, tokenizer
        cap = cfg.max_prompt_length or max_prompt_length
        if cap is None:
            raise ValueError("data.max_prompt_length is unset and no cap was given")
        self.train = load_prompts(cfg.train_files, tokenizer, cap, "train", log)
        self.val = (load_prompts(cfg.val_files, tokenizer, cap, "val", log)
                    if cfg.val_files else [])
        self.max_prompt_len = max(len(p.ids) for p in self.train + self.val)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token to pad batches with")
        self.pad_id = pad
        self.pool = RewardPool(reward, log)
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """Prompt indices in the order epoch `epoch` visits them."""
        if epoch not in self._orders:
            idx = list(range(len(self.train)))
            if self.cfg.shuffle:
                random.Random(f"data:{self.seed}:{epoch}").shuffle(idx)
            self._orders = {epoch: idx}  # one epoch at a time is enough
        return self._orders[epoch]

    def prompts(self, cursor: int, n: int) -> list[Prompt]:
        N = len(self.train)
        return [self.train[self.order(c // N)[c % N]] for c in range(cursor, cursor + n)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def score(self, prompts: Sequence[Prompt], results: Sequence[GenerationResult],
              prefix: str = "reward"):
        calls = [RewardCall(p.data_source, self.decode(r.output_ids), p.ground_truth, p.extra_info)
                 for p, r in zip(prompts, results)]
        scores = self.pool.score(calls)
        return torch.tensor(scores.scores, dtype=torch.float32), scores.metrics(prefix)

    def rewards(self, prompts: Sequence[Prompt], results: Sequence[GenerationResult]):
        """(rewards [B], reward/errors metrics) for sample b of prompt `prompts[b]`."""
        return self.score(prompts, results)

    def validate(self, rollout, params: Sequence[SamplingParams], generate=None,
                 score=None) -> dict[str, float]:
        """val/... metrics: every validation prompt generated with its `params` (routes not
        recorded) and scored. Multi-turn runs pass `generate(prompts, requests)` (their
        trajectories) and `score(prompts_per_sample, results)` (a trajectory's reward, with
        val/ metrics), which default to `rollout.generate` and `score(..., prefix="val")`."""
        reqs = [GenerateRequest(list(p.ids), sp, rid=f"val{i}", return_routes=False)
                for i, (p, sp) in enumerate(zip(self.val, params))]
        results = rollout.generate(reqs) if generate is None else generate(self.val, reqs)
        n = params[0].n
        prompts = [self.val[i // n] for i in range(len(results))]
        scores_B, errors = (self.score(prompts, results, prefix="val") if score is None
                            else score(prompts, results))
        out = validation_metrics(self.val, scores_B, n, errors)
        if score is not None:  # the trajectory metrics beside them
            out.update({k: v for k, v in errors.items() if k not in out})
        return out

    def fingerprints(self) -> dict[str, str]:
        return {"train": fingerprint(self.train), "val": fingerprint(self.val)}

    def close(self) -> None:
        self.pool.close()


def check_data_on_resume(source, run_dir: Path, fresh: bool) -> None:
    """Record the data set's fingerprints in a fresh run's directory; on resume refuse data
    whose prompts or ground truths changed (the cursor would point elsewhere)."""
    if not isinstance(source, DatasetSource):
        return
    path, now = Path(run_dir) / DATA_FILE, source.fingerprints()
    if fresh:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(now) + "\n")
        return
    if not path.exists():
        raise FileNotFoundError(f"--resume: {path} is missing (written when the run started)")
    was = json.loads(path.read_text())
    if was != now:
        raise ValueError(f"--resume: the data set differs from the one the run started with "
                         f"(fingerprints {was} != {now}); the data cursor would not continue "
                         "exactly")


def validation_metrics(prompts: Sequence[Prompt], scores_B: torch.Tensor, n: int,
                       error_metrics: dict[str, float]) -> dict[str, float]:
    """val/reward_mean, val/pass@n (a prompt passes when any of its n samples scores > 0),
    per data source val/<source>/reward_mean, and val/reward_errors."""
    per_prompt = scores_B.view(len(prompts), n)
    m = {"val/reward_mean": float(per_prompt.mean()),
         f"val/pass@{n}": float((per_prompt > 0).any(1).float().mean()),
         "val/reward_errors": error_metrics.get("val/errors", 0.0)}
    for src in sorted({p.data_source for p in prompts}):
        rows = torch.tensor([p.data_source == src for p in prompts])
        m[f"val/{src or 'default'}/reward_mean"] = float(per_prompt[rows].mean())
    return m
