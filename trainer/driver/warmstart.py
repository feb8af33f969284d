"""Supervised warm start on task demonstrations, cached on disk.

GRPO learns nothing from groups whose samples all fail (every advantage is 0), so RL starts
from a policy that sometimes succeeds: teacher-forced cross-entropy on the answer tokens of
generated demonstrations until greedy exact-match accuracy on held-out prompts reaches
`target_accuracy` (REFERENCE.md: >= 0.30 in ~30 s on the toy). The result is cached as an HF
folder under `cache_dir/<key>/`, the key hashing model, task, warm-start settings and seed, so
runs that differ only in RL settings (replay off / R2 / R3) start from the same weights.
Entries are written to a private temporary folder with a sha256 manifest and renamed into
place (concurrent runs never see or make a half entry); an entry that fails its manifest is
set aside with a warning and trained again. The model leaves `warm_start` with no gradients,
so the first RL update sees only its own (a cold and a cached start give the same run).

Shapes: B demonstrations, T prompt + answer tokens, V vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lockstep.moe.checkpoint import load_hf_state_dict, read_hf_state_dict, save_hf
from lockstep.moe.hf_lazy import CheckpointError
from lockstep.moe.model import MoEModel
from lockstep.rollout.tasks import Problem, Task
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.sections import WarmstartConfig
from lockstep.trainer.state.checkpoint import verify_manifest, write_manifest

RESULT_FILE = "warmstart.json"
DEMO_SEED_OFFSET = 1_000_003  # demonstration and evaluation streams differ from the RL stream's
EVAL_SEED_OFFSET = 2_000_003


@dataclass
class WarmstartResult:
    """What the warm start reached."""

    accuracy: float
    """Greedy exact-match accuracy on the held-out prompts."""
    expected_reward: float
    """Mean probability of sampling the exact answer at temperature 1 (the RL reward's mean)."""
    steps: int
    """Supervised steps taken (0 = warm start disabled)."""
    seconds: float
    """Wall time of the training (of the original run when cached)."""
    cached: bool = False
    """Loaded from the cache instead of trained."""


def _pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    T = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])


@torch.no_grad()
def greedy_accuracy(model: MoEModel, task: Task, problems: list[Problem]) -> float:
    """Exact-match rate of greedy decoding (full forwards; prompts of a task share a length)."""
    if task.uses_tool:
        return _greedy_with_tool(model, task, problems)
    ids_BT = torch.tensor([task.prompt_ids(p) for p in problems])
    done_B = torch.zeros(len(problems), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in problems]
    for _ in range(task.max_new_tokens):
        nxt_B = model(ids_BT).logits_BTV[:, -1].argmax(-1)
        for b in (~done_B).nonzero().flatten().tolist():
            out[b].append(int(nxt_B[b]))
        done_B |= nxt_B == task.eos_id
        ids_BT = torch.cat([ids_BT, nxt_B[:, None]], 1)
        if bool(done_B.all()):
            break
    return sum(task.reward(p, o) for p, o in zip(problems, out)) / len(problems)


def _greedy_with_tool(model: MoEModel, task: Task, problems: list[Problem],
                      max_turns: int = 4) -> float:
    """greedy_accuracy of a multi-turn task: a turn ending in a call gets the calculator's
    answer appended (`Task.observe`, as the env workers give it); the final turn is scored.
    Rows grow unevenly, so the batch is right-padded and read at each row's last token."""
    rows = [task.prompt_ids(p) for p in problems]
    turn_start = [len(r) for r in rows]
    turns = [1] * len(rows)
    done = [False] * len(rows)
    for _ in range(max_turns * task.max_new_tokens):
        live = [b for b in range(len(rows)) if not done[b]]
        if not live:
            break
        ids_BT = _pad([rows[b] for b in live], task.pad_id)
        last_B = torch.tensor([len(rows[b]) - 1 for b in live])
        nxt_B = model(ids_BT).logits_BTV[torch.arange(len(live)), last_B].argmax(-1).tolist()
        for b, tok in zip(live, nxt_B):
            rows[b].append(tok)
            turn = rows[b][turn_start[b]:]
            obs = task.observe(turn)
            if tok == task.eos_id or turns[b] == max_turns and obs is not None:
                done[b] = True
            elif obs is not None:
                rows[b] += obs
                turn_start[b], turns[b] = len(rows[b]), turns[b] + 1
            elif len(turn) >= task.max_new_tokens:
                done[b] = True
    return sum(task.reward(p, r[s:]) for p, r, s in zip(problems, rows, turn_start)) / len(rows)


def _answer_logprobs(model: MoEModel, task: Task, problems: list[Problem]):
    """(sum of answer-token log-probs per row [B], answer-token count [B], mean CE loss).
    A multi-turn task's demonstration holds observations: they are context, not trained."""
    prompts = [task.prompt_ids(p) for p in problems]
    demos = [task.demonstration(p) for p in problems]
    ids_BT = _pad([a + d[0] for a, d in zip(prompts, demos)], task.pad_id)
    mask_BT = torch.zeros_like(ids_BT, dtype=torch.bool)
    for b, (p, (a, m)) in enumerate(zip(prompts, demos)):
        mask_BT[b, len(p):len(p) + len(a)] = torch.tensor(m)
    logits_BTV = model(ids_BT).logits_BTV[:, :-1].float()
    tgt_BT, m_BT = ids_BT[:, 1:], mask_BT[:, 1:]
    lp_BT = -F.cross_entropy(logits_BTV.transpose(1, 2), tgt_BT, reduction="none") * m_BT
    return lp_BT.sum(1), m_BT.sum(1), -lp_BT.sum() / m_BT.sum()


@torch.no_grad()
def expected_reward(model: MoEModel, task: Task, problems: list[Problem]) -> float:
    """Mean probability of the exact answer (+ <eos>) under temperature-1 sampling."""
    lp_B, _, _ = _answer_logprobs(model, task, problems)
    return float(lp_B.exp().mean())


def cache_key(cfg: ExperimentConfig) -> str:
    """Cache key: model, task and the warm-start settings that change its result, plus seed."""
    ws = {k: v for k, v in cfg.warmstart.model_dump().items() if k not in ("enabled", "cache_dir")}
    task = asdict(cfg.task)
    if task["reward"] == "exact":  # the default: keys as before the field existed
        task.pop("reward")
    blob = json.dumps([asdict(cfg.model), task, ws, cfg.loop.seed], sort_keys=True)
    return f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}-seed{cfg.loop.seed}"


def warm_start(model: MoEModel, task: Task, cfg: WarmstartConfig, seed: int, key: str,
               log: Callable[[str], None] = print, progress: bool = False) -> WarmstartResult:
    """Train `model` in place (or load it from the cache under `key`) and report the level.
    With `progress`, a bar shows steps and the last greedy accuracy while it trains."""
    eval_set = task.problems(EVAL_SEED_OFFSET + seed, 0, cfg.eval_size)
    cache = Path(os.path.expanduser(cfg.cache_dir)) / key
    if (cache / RESULT_FILE).exists():
        try:
            res = _load(model, cache)
        except (CheckpointError, OSError, ValueError, TypeError) as e:
            log(f"warning: warm-start cache entry {cache} is not usable ({e}); training again")
            bad = cache.with_name(f"{cache.name}.bad-{uuid.uuid4().hex}")
            try:  # set aside (atomically) so that _store can put a good entry in its place
                cache.rename(bad)
            except OSError:
                pass  # another run got there first
            shutil.rmtree(bad, ignore_errors=True)
        else:
            model.zero_grad(set_to_none=True)
            log(f"warm start: loaded from cache {cache} (greedy accuracy {res.accuracy:.3f})")
            return res
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0 = time.perf_counter()
    acc, step = 0.0, 0
    model.train()
    bar = tqdm(total=cfg.max_steps, desc="warm start", unit="step", disable=not progress,
               dynamic_ncols=True)
    for step in range(1, cfg.max_steps + 1):
        demos = task.problems(DEMO_SEED_OFFSET + seed, (step - 1) * cfg.batch_size,
                              cfg.batch_size)
        _, _, loss = _answer_logprobs(model, task, demos)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            acc = greedy_accuracy(model, task, eval_set)
            bar.set_postfix(greedy_acc=f"{acc:.3f}", target=cfg.target_accuracy)
            if not progress and step % (4 * cfg.eval_every) == 0:  # no bar: a line now and then
                log(f"warm start: step {step}/{cfg.max_steps}, greedy accuracy {acc:.3f} "
                    f"(target {cfg.target_accuracy}), {time.perf_counter() - t0:.0f}s")
            if acc >= cfg.target_accuracy:
                break
    bar.close()
    opt.zero_grad(set_to_none=True)  # the last warm-start gradient must not reach RL's update
    seconds = time.perf_counter() - t0
    res = WarmstartResult(acc, expected_reward(model, task, eval_set), step, seconds)
    status = "reached" if acc >= cfg.target_accuracy else "did NOT reach"
    log(f"warm start: {step} steps in {seconds:.1f}s, greedy accuracy {acc:.3f} ({status} "
        f"target {cfg.target_accuracy}), expected sampled reward {res.expected_reward:.3f}")
    _store(model, task, res, cache)
    return res


def _load(model: MoEModel, cache: Path) -> WarmstartResult:
    """Load a cache entry into `model` after checking it against its manifest."""
    if not (cache / "manifest.json").exists():
        raise CheckpointError("it has no checksum manifest (written by an older lockstep)")
    verify_manifest(cache)
    raw = json.loads((cache / RESULT_FILE).read_text())
    res = WarmstartResult(**{k: raw[k] for k in raw if k != "cached"})
    load_hf_state_dict(model, read_hf_state_dict(cache))
    res.cached = True
    return res


def _store(model: MoEModel, task: Task, res: WarmstartResult, cache: Path) -> None:
    """Write the cache entry atomically: a private temporary folder (unique per process and
    host) with a manifest, renamed into place; a concurrent run that got there first wins.
    A cache that cannot be written (read-only, disk full) only costs the next run a retrain."""
    tmp = cache.with_name(f"{cache.name}.tmp-{uuid.uuid4().hex}")
    try:
        save_hf(model, tmp, tokenizer=task.tokenizer)
        (tmp / RESULT_FILE).write_text(json.dumps(asdict(res), indent=2) + "\n")
        write_manifest(tmp)
        tmp.rename(cache)
    except OSError:  # already cached by another process, or not writable
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + ".tmp"), ignore_errors=True)
