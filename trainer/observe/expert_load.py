"""Expert-load metrics per MoE layer: how evenly the routes spread tokens over the experts.

Read next to the flip rates, they tell routing collapse (a few experts take everything, the
rest die) from routing noise (flips with an even load). Two sources, the same tokens and names:
- `rollout/moe/*`: the engine's routes (the rollout's trace), as verl 0.9.1 logs them
  (`verl.trainer.ppo.metric_utils.compute_rollout_moe_load_balance_metrics`);
- `actor/moe/*`: the actor's own routes: its router's natural top-k in the pi_old forward
  (under R3 the routes it *ran* are the engine's, so its own choice is the natural one).
Counted tokens: response tokens that have a route, i.e. every response token but each row's
last (sampled, never fed back through the model; verl drops it too). Prompt tokens are left
out, as verl does. Each (token, k) slot counts once.

Per MoE layer `<i>` (its decoder layer id, as `routing/flip_rate/layer_<i>`), with c_e the
slots routed to expert e, C = sum c_e, mean load C/E and load fraction p_e = c_e / C:

| key | definition | verl |
| --- | --- | --- |
| `max_vio/layer_<i>` | max_e (E p_e - 1) = max load / mean load - 1 | same name, same formula |
| `min_vio/layer_<i>` | min_e (E p_e - 1) (-1 when an expert is dead) | same |
| `avg_vio/layer_<i>` | mean_e \\|E p_e - 1\\| | same |
| `cv/layer_<i>` | coefficient of variation: population std_e(c_e) / mean_e(c_e) | none |
| `entropy/layer_<i>` | -sum_e p_e ln p_e, nats (ln E when even, 0 when one expert takes all) | none |
| `dead_experts/layer_<i>` | experts with c_e = 0 | none |

plus `<key>/max` and `<key>/avg` over layers (verl's aggregates; `entropy/min` and
`entropy/avg`) and `routed_expert_assignments` (C summed over layers; verl's name). A layer
with C = 0 (no counted tokens) reports NaN.

The actor's counts travel as `Stats` (`load_count_stats`: one (count, first) pair per layer and
expert) so data-parallel ranks add them; `step_load_metrics` turns them back into [L, E] on the
driver (dropping them from what is logged) and computes both sources' metrics.

Shapes: B rows, T time, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ROLLOUT_PREFIX, ACTOR_PREFIX = "rollout/moe", "actor/moe"
COUNT_KEY = "moe_load_count"  # stats key prefix of the actor's per-(layer, expert) counts
ROLLOUT_COUNT_KEY = "rollout_load_count"  # the engine routes' counts, from the ranks (routes
# by reference: the driver holds no routes)
VERL_KEYS = ("max_vio", "min_vio", "avg_vio")
OUR_KEYS = ("cv", "entropy", "dead_experts")


def counted_tokens(response_mask_BT: torch.Tensor, seq_lens_B: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: response tokens that have a route (all but each row's last token)."""
    T = response_mask_BT.shape[1]
    before_last = torch.arange(T, device=seq_lens_B.device)[None, :] < (seq_lens_B[:, None] - 1)
    return response_mask_BT.bool() & before_last.to(response_mask_BT.device)


def load_counts(routes_BTLK: torch.Tensor, tokens_BT: torch.Tensor, num_experts: int
                ) -> torch.Tensor:
    """int64 [L, E]: (token, k) slots of the `tokens_BT` tokens routed to each expert."""
    L = routes_BTLK.shape[2]
    ids_NLK = routes_BTLK[tokens_BT.to(routes_BTLK.device)].long()  # [N, L, K]
    layer_NLK = torch.arange(L, device=ids_NLK.device)[None, :, None].expand_as(ids_NLK)
    flat = (layer_NLK * num_experts + ids_NLK).reshape(-1)
    return torch.bincount(flat, minlength=L * num_experts).view(L, num_experts).cpu()


def load_metrics(counts_LE: torch.Tensor, layer_names: Sequence[int], prefix: str
                 ) -> dict[str, float]:
    """The module doc's metrics of per-layer loads `counts_LE` under `prefix`."""
    c = counts_LE.double()
    E = c.shape[1]
    total_L = c.sum(1)
    p = c / total_L.clamp(min=1)[:, None]
    dev = p * E - 1
    mean_L = total_L / E
    plogp = torch.where(p > 0, p * p.clamp(min=1e-300).log(), torch.zeros_like(p))
    per = {"max_vio": dev.max(1).values, "min_vio": dev.min(1).values,
           "avg_vio": dev.abs().mean(1),
           "cv": c.std(1, correction=0) / mean_L.clamp(min=1e-300),
           "entropy": -plogp.sum(1), "dead_experts": (c == 0).sum(1).double()}
    empty = (total_L == 0).tolist()
    out: dict[str, float] = {}
    for key, v_L in per.items():
        vals = [math.nan if e else float(v) for v, e in zip(v_L.tolist(), empty)]
        for name, v in zip(layer_names, vals):
            out[f"{prefix}/{key}/layer_{int(name)}"] = v
        seen = [v for v in vals if not math.isnan(v)]
        agg = ("min", min) if key == "entropy" else ("max", max)
        out[f"{prefix}/{key}/{agg[0]}"] = agg[1](seen) if seen else math.nan
        out[f"{prefix}/{key}/avg"] = sum(seen) / len(seen) if seen else math.nan
    out[f"{prefix}/routed_expert_assignments"] = float(total_L.sum())
    return out


def rollout_load_metrics(batch, layer_names: Sequence[int], num_experts: int) -> dict[str, float]:
    """`rollout/moe/*` of a batch's engine routes ({} when the engine returned none)."""
    if batch.rollout_routes_BTLK is None:
        return {}
    tokens_BT = counted_tokens(batch.response_mask_BT, batch.seq_lens_B)
    if batch.rollout_routes_valid_BT is not None:
        tokens_BT = tokens_BT & batch.rollout_routes_valid_BT
    return load_metrics(load_counts(batch.rollout_routes_BTLK, tokens_BT, num_experts),
                        layer_names, ROLLOUT_PREFIX)


def load_count_stats(routes_BTLK: torch.Tensor, tokens_BT: torch.Tensor,
                     layer_names: Sequence[int], num_experts: int, first: bool,
                     key: str = COUNT_KEY) -> dict[str, tuple[float, float]]:
    """A rank's counts as `Stats` pairs (count, 1 on the group's first rank, else 0): the sum
    over ranks divided by the count is the group's total."""
    counts = load_counts(routes_BTLK, tokens_BT, num_experts).tolist()
    one = 1.0 if first else 0.0
    return {f"{key}/{int(name)}/{e}": (float(c), one)
            for name, row in zip(layer_names, counts) for e, c in enumerate(row)}


def take_load_counts(stats: dict[str, tuple[float, float]], num_experts: int,
                     key: str = COUNT_KEY) -> tuple[list[int], torch.Tensor] | None:
    """Remove the `load_count_stats` pairs from `stats` (added over ranks) and return
    (decoder layer ids, int64 counts [L, E]); None when there were none."""
    keys = [k for k in stats if k.startswith(key + "/")]
    if not keys:
        return None
    got: dict[int, list[float]] = {}
    for k in keys:
        layer, e = (int(x) for x in k[len(key) + 1:].split("/"))
        s, c = stats.pop(k)
        got.setdefault(layer, [0.0] * num_experts)[e] = s / c if c else 0.0
    layers = sorted(got)
    return layers, torch.tensor([got[l] for l in layers]).round().long()


def step_load_metrics(batch, stats: dict[str, tuple[float, float]], layer_names: Sequence[int],
                      num_experts: int) -> dict[str, float]:
    """An RL step's `rollout/moe/*` (the batch's engine routes) and `actor/moe/*` (the counts
    the actor's ranks put in its pi_old `stats`, removed from them)."""
    taken = take_load_counts(stats, num_experts)
    actor = {} if taken is None else load_metrics(taken[1], taken[0], ACTOR_PREFIX)
    by_ref = take_load_counts(stats, num_experts, ROLLOUT_COUNT_KEY)  # routes by reference
    rollout = (rollout_load_metrics(batch, layer_names, num_experts) if by_ref is None
               else load_metrics(by_ref[1], by_ref[0], ROLLOUT_PREFIX))
    return {**rollout, **actor}
