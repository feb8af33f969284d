"""The reward of a run's own policy, sampled without the engine: temperature 1 and greedy, on
held-out problems of its task, from a checkpoint's HF folder. Study 4 (docs/evidence.md) uses
it where the engine's sampling is perturbed (`rollout.mismatch.logprob_noise`): the run's
reward/mean is the perturbed engine's, this is the trainer's pi without the perturbation.

    OMP_NUM_THREADS=1 python bench/policy_reward.py runs/study4_lp2/off@0@s0 ...
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from lockstep.moe.checkpoint import load_hf
from lockstep.rollout.tasks import Task, TaskConfig


@torch.no_grad()
def policy_reward(model, task: Task, problems, greedy: bool, seed: int = 0) -> float:
    """Mean task reward of full-forward decoding (prompts of a task share a length)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([task.prompt_ids(p) for p in problems])
    P = ids.shape[1]
    for _ in range(task.max_new_tokens):
        logits = model(ids).logits_BTV[:, -1].float()
        nxt = logits.argmax(-1) if greedy else \
            torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
        ids = torch.cat([ids, nxt[:, None]], 1)
    return sum(task.reward(p, ids[b, P:].tolist()) for b, p in enumerate(problems)) / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (config.yaml, checkpoints/)")
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--seed", type=int, default=12345, help="held-out problems' seed")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for run in a.runs:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        task = Task(TaskConfig(**cfg["task"]))
        ckpt = max((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
        model = load_hf(ckpt / "hf").eval()
        probs = task.problems(a.seed, 0, a.problems)
        print(f"{run} ({ckpt.name}): sampled {policy_reward(model, task, probs, False):.3f} "
              f"greedy {policy_reward(model, task, probs, True):.3f}", flush=True)


if __name__ == "__main__":
    main()
