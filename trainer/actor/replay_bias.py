"""The R3 bias meter (docs/replay.md "The replay bias meter"): how far forcing replayed routes
moves the policy the update trains away from the policy the current weights define.

Every step under R2/R3, on the rank, after the update:
- `replay_bias/flip_rate` (and `/layer_<i>`): the fraction of (token, layer) pairs whose
  natural top-k under the weights of the update's last pass differs (as a set) from the route
  that pass ran; counted over real tokens, so partial replay's natural pairs count as
  agreeing. 0 under replay off by definition.
- `replay_bias/k3` and `replay_bias/abs_logp_diff`: on a sampled fraction of the shard's rows
  (`replay.bias_meter_rows`; rows drawn by a generator seeded with the step, the global RNG
  untouched), one extra no-grad forward of those rows twice, once replaying the update's
  routes and once routing naturally, under the updated weights; with
  log r = log pi_natural - log pi_replayed of each response token (clamped to +-20 as
  everywhere: objective/stats.py), k3 = r - 1 - log r
  (an estimate of KL(pi_replayed || pi_natural) on the sampled tokens, as the rollout-
  correction metrics estimate theirs) and |log r|. 0 under replay off by definition.

All are (sum, count) `Stats`, so data-parallel ranks add them.
Shapes: B rows, T time, L MoE layers, K top-k, n sampled rows.
"""

from __future__ import annotations

import math

import torch

from lockstep.trainer.actor.batch import Batch, trim, trim_batch
from lockstep.trainer.objective.stats import k3, log_ratio, route_stats


def flip_stats(used_BTLK: torch.Tensor, natural_BTLK: torch.Tensor, token_BT: torch.Tensor,
               layer_names, replays: bool, first: bool) -> dict[str, tuple[float, float]]:
    """replay_bias/flip_rate overall and per layer (module docstring)."""
    if not replays:
        return {"replay_bias/flip_rate": (0.0, 1.0 if first else 0.0)}
    st = route_stats(used_BTLK, natural_BTLK, token_BT, "replay_bias", layer_names, first)
    return {k: v for k, v in st.items() if k.startswith("replay_bias/flip_rate")}


def sampled_rows(b: int, fraction: float, step: int) -> torch.Tensor:
    """ceil(b * fraction) distinct rows of b (sorted), drawn by a generator seeded with step."""
    n = min(b, math.ceil(b * fraction))
    gen = torch.Generator().manual_seed(step)
    return torch.randperm(b, generator=gen, device="cpu")[:n].sort().values


@torch.no_grad()
def kl_stats(actor, batch: Batch, routes_BTLK, replay_mask_BT, gates_BTLK, rows: torch.Tensor,
             first: bool) -> dict[str, tuple[float, float]]:
    """replay_bias/k3 and /abs_logp_diff of `rows` (module docstring): the rows twice in one
    forward (`actor.shard_logprobs`), the first copy replaying, the second natural."""
    if routes_BTLK is None or not len(rows):
        zero = (0.0, 1.0 if first else 0.0)  # nothing replayed: no bias, by definition
        return {"replay_bias/k3": zero, "replay_bias/abs_logp_diff": zero}
    n = len(rows)
    both = torch.cat([rows, rows])
    sub = trim_batch(batch, both)
    t = sub.input_ids_BT.shape[1]
    mask = trim(replay_mask_BT, both, t).clone()
    mask[n:] = False  # the second copy routes naturally
    lp = actor.shard_logprobs(sub, trim(routes_BTLK, both, t), mask, gates_BTLK=None if
                              gates_BTLK is None else trim(gates_BTLK, both, t)).logprobs_BT
    resp = sub.response_mask_BT[:n]
    log_r = log_ratio(lp[n:], lp[:n])[resp].double()
    k3_sum = k3(log_r).sum()
    count = float(resp.sum())
    return {"replay_bias/k3": (float(k3_sum), count),
            "replay_bias/abs_logp_diff": (float(log_r.abs().sum()), count)}
