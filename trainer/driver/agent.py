"""The trainer's side of multi-turn trajectories (`rollout.env`, rollout/agent.py): the env's
view of a prompt, a trajectory's reward, and the agent/* metrics.

Reward of a trajectory: the prompt source's reward (the task's exact match, or
`reward.function` of a data set) of its *final turn* (the tokens the policy sampled after the
last observation), plus the sum of the env's step rewards; a trajectory the env ended with an
error scores `rollout.env.error_score` instead. An env that scores on its own can leave the
final answer to it by returning its reward from `step` and using a `reward.function` that
returns 0.

Metrics (per step): agent/turns_mean, agent/tool_calls_mean (observations appended per
trajectory), agent/tool_call_rate (trajectories with at least one), agent/errors and
agent/errors_<kind> (rollout.agent.ERROR_KINDS), agent/restarted (trajectories started again
from their first turn after their engine was lost), agent/sampled_tokens_mean,
agent/observation_tokens_mean, agent/end_<how> (fraction of trajectories that ended so:
done, max_turns, context, error), agent/env_reward_mean; agent/k3_kl/turn_<t> (k3 of pi_old vs
the rollout over turn t's sampled tokens). The routing flip rate split by sampled and
observation tokens and by turn comes from the actor (`routing/sampled/*`,
`routing/observation/*`, `routing/turn_<t>/*`, trainer/actor/rank.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import torch

from lockstep.rollout.agent import ERROR_KINDS
from lockstep.rollout.env import EnvConfig
from lockstep.rollout.types import GenerationResult
from lockstep.trainer.objective.stats import k3, log_ratio

MAX_TURN_METRICS = 8  # per-turn metrics for turns 0..7 (later turns are in the totals)


def env_problem(prompt) -> dict:
    """What `reset(problem)` gets for a prompt of either source (JSON-able)."""
    gt = prompt.ground_truth
    if dataclasses.is_dataclass(gt):  # the synthetic task's Problem
        gt = dataclasses.asdict(gt)
    return {"prompt_ids": list(prompt.ids), "ground_truth": gt,
            "data_source": prompt.data_source, "extra_info": dict(prompt.extra_info)}


def final_turn(r: GenerationResult) -> GenerationResult:
    """The trajectory as a single-turn sample of its last turn (what the source's reward
    scores): prompt = everything before it, output = its sampled ids."""
    last = r.trajectory.turns[-1]
    full = list(r.prompt_ids) + list(r.output_ids)
    return dataclasses.replace(r, prompt_ids=full[:last.start],
                               output_ids=full[last.start:last.start + last.sampled])


def trajectory_rewards(score, prompts: Sequence, results: Sequence[GenerationResult],
                       cfg: EnvConfig, prefix: str = "agent") -> tuple[torch.Tensor, dict]:
    """(rewards [B], metrics): the module docstring's rule, for sample b of `prompts[b]`;
    `score(prompts, results)` is the source's reward (its `rewards`, or validation's
    scoring); the trajectory metrics are named `<prefix>/...`."""
    src_B, m = score(prompts, [final_turn(r) for r in results])
    infos = [r.trajectory for r in results]
    env_B = torch.tensor([i.env_reward for i in infos], dtype=torch.float32)
    err_B = torch.tensor([i.error is not None for i in infos])
    rewards_B = torch.where(err_B, torch.tensor(cfg.error_score, dtype=torch.float32),
                            src_B.float() + env_B)
    return rewards_B, {**m, **trajectory_metrics(results, prefix)}


def trajectory_metrics(results: Sequence[GenerationResult], prefix: str = "agent"
                       ) -> dict[str, float]:
    infos = [r.trajectory for r in results]
    n = len(infos)
    errors = Counter(i.error for i in infos if i.error is not None)
    ends = Counter(i.end for i in infos)
    sampled = sum(int(r.sampled_mask.sum()) for r in results)
    total = sum(len(r.output_ids) for r in results)
    m = {"agent/turns_mean": sum(len(i.turns) for i in infos) / n,
         "agent/tool_calls_mean": sum(i.tool_calls for i in infos) / n,
         "agent/tool_call_rate": sum(i.tool_calls > 0 for i in infos) / n,
         "agent/errors": float(sum(errors.values())),
         **{f"agent/errors_{k}": float(errors[k]) for k in ERROR_KINDS},
         "agent/sampled_tokens_mean": sampled / n,
         "agent/observation_tokens_mean": (total - sampled) / n,
         "agent/env_reward_mean": sum(i.env_reward for i in infos) / n,
         "agent/restarted": float(sum(i.restarts for i in infos))}  # engine lost: from turn 1
    m.update({f"agent/end_{k}": ends[k] / n for k in ("done", "max_turns", "context", "error")})
    return {f"{prefix}/{k.split('/', 1)[1]}": v for k, v in m.items()}


def turn_k3(turn_BT: torch.Tensor, response_mask_BT: torch.Tensor, old_logprobs_BT: torch.Tensor,
            rollout_logprobs_BT: torch.Tensor) -> dict[str, float]:
    """agent/k3_kl/turn_<t>: the mean k3 over turn t's sampled tokens of log r = pi_old - mu_old
    (objective/stats.py: clamped to +-20)."""
    k3_BT = k3(log_ratio(old_logprobs_BT.float(), rollout_logprobs_BT.float()))
    out = {}
    for t in range(min(int(turn_BT.max()) + 1, MAX_TURN_METRICS)):
        m_BT = response_mask_BT & (turn_BT == t)
        if bool(m_BT.any()):
            out[f"agent/k3_kl/turn_{t}"] = float(k3_BT[m_BT].mean())
    return out
