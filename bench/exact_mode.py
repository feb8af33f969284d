"""Exact mode's cost: the embedded engine's generation and the torch actor's log-prob forward and
update with the batch-invariant kernels (`rollout.exact`) vs the default kernels, same model,
same bf16 precision, measured in this run; and whether their log-probs agree bitwise.

    OMP_NUM_THREADS=1 python bench/exact_mode.py              # the toy and Study 4's config
    OMP_NUM_THREADS=1 python bench/exact_mode.py --configs toy --reps 5

Times are CPU seconds of this process (`time.process_time`: on a shared box the wall clock
counts other jobs), medians over `--reps` alternating repetitions; the ratio is exact /
default per phase and for the whole step (generate + log-probs + update).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.sections import ActorConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"toy": "configs/toy_r3.yaml", "study4": "configs/study_mismatch.yaml"}


def step_times(cfg, model: MoEModel, exact: bool, seed: int) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """CPU seconds of one RL step's phases; the rollout and the recomputed log-probs."""
    from lockstep.rollout.tasks import Task
    task = Task(cfg.task)
    ro = cfg.rollout
    probs = task.problems(seed, 0, ro.prompts_per_step)
    reqs = [GenerateRequest(task.prompt_ids(p), SamplingParams(
        max_new_tokens=task.max_new_tokens, n=ro.samples_per_prompt, seed=seed * 1000 + 10 * i),
        rid=f"p{i}") for i, p in enumerate(probs)]
    eng = Engine.from_model(model, EngineConfig(
        dtype="bf16", max_running=ro.batch_size, exact=exact,
        max_len=task.prompt_len + task.max_new_tokens))
    a = cfg.actor
    actor = TorchActor(copy.deepcopy(model), ActorConfig(
        dtype="bf16", mini_batch_size=a.mini_batch_size, micro_batch_size=a.micro_batch_size),
        total_updates=10, exact=exact)
    out = {}
    t = time.process_time()
    res = eng.generate(reqs)
    out["generate"] = time.process_time() - t
    c = cfg.model
    b = collate(res, task.pad_id, c.num_experts, c.num_moe_layers, c.num_experts_per_tok)
    t = time.process_time()
    lp = actor.logprobs(b).logprobs_BT
    out["logprobs"] = time.process_time() - t
    m = b.response_mask_BT.float()
    t = time.process_time()
    actor.update(b, lambda lp_, ent, rows, mini: (-(lp_ * m[rows]).sum() / m.sum(), {}))
    out["update"] = time.process_time() - t
    out["step"] = sum(out.values())
    return out, lp[b.response_mask_BT], b.rollout_logprobs_BT[b.response_mask_BT]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.configs:
        cfg = load_config(ROOT / CONFIGS[name])
        torch.manual_seed(0)
        model = MoEModel(cfg.model)
        times = {False: [], True: []}
        diff = {}
        for rep in range(args.reps + 1):  # the first repetition warms up, not counted
            for exact in (False, True):
                t, lp, mu = step_times(cfg, model, exact, seed=rep)
                diff[exact] = (int((lp != mu).sum()), lp.numel(), float((lp - mu).abs().max()))
                if rep:
                    times[exact].append(t)
        print(f"{name} ({cfg.rollout.batch_size} samples, {cfg.model.num_hidden_layers} layers "
              f"x {cfg.model.num_experts} experts, bf16 engine and actor)")
        for phase in ("generate", "logprobs", "update", "step"):
            d = statistics.median(x[phase] for x in times[False])
            e = statistics.median(x[phase] for x in times[True])
            print(f"  {phase:9s} default {d:7.3f} s  exact {e:7.3f} s  ratio {e / d:5.2f}")
        for exact in (False, True):
            n, tot, mx = diff[exact]
            print(f"  {'exact' if exact else 'default':7s} log-probs differing from the engine's: "
                  f"{n} of {tot} (max |diff| {mx:.2e})")


if __name__ == "__main__":
    main()
