"""The statistics every part of the trainer computes alike, defined once: log ratios and the
k1/k2/k3 estimators over them, masked reductions, and the routing-divergence pairs that ranks
add up.

- `log_ratio(a, b)` = a - b clamped to +-SAFETY_BOUND (verl's 20) before anything takes exp
  (`clamp_log_ratio` for a difference the caller has already).
- k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (Schulman's estimators of KL(b || a) for
  log r = a - b), on a clamped log ratio. `k3` takes exp(log r) when the caller has it.
- `masked_sum` / `masked_mean`: `where` first, so NaN/inf outside a 0/1 mask cannot leak in;
  the mean divides by (count + 1e-8) as verl does (0 on an empty mask).
- `to_floats`: a dict of 0-dim device tensors (metrics kept on the device through an optimiser
  step) read to Python floats in one host sync.
- `Stats`: metric -> (sum, count) of one rank, added over ranks (`add_stats`) and divided once
  (`stats_values`); `route_stats` puts `compare_routes`' flip metrics in that form,
  `indexer_stats` the lightning indexer's (`indexer_flip_rate`).

Any shape: the masked functions take a mask of the value's shape (or broadcastable to it).
"""

from __future__ import annotations

import math

import torch

from lockstep.replay.indexer import indexer_flip_rate
from lockstep.replay.route_divergence import compare_routes

SAFETY_BOUND = 20.0  # |log ratio| clamp before exp (verl's value)


def clamp_log_ratio(log_r: torch.Tensor) -> torch.Tensor:
    return log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def log_ratio(logprobs_a: torch.Tensor, logprobs_b: torch.Tensor) -> torch.Tensor:
    """log(p_a / p_b), clamped to +-SAFETY_BOUND."""
    return clamp_log_ratio(logprobs_a - logprobs_b)


def k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


def k2(log_r: torch.Tensor) -> torch.Tensor:
    return log_r.square() / 2


def k3(log_r: torch.Tensor, exp_log_r: torch.Tensor | None = None) -> torch.Tensor:
    """r - 1 - log r, computed as (exp(log r) - log r) - 1 (one rounding order everywhere)."""
    e = log_r.exp() if exp_log_r is None else exp_log_r
    return torch.sub(e, log_r).sub_(1)


def masked_sum(v: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    s = torch.where(mask.bool(), v, torch.zeros_like(v)) * mask
    return s.sum() if dim is None else s.sum(dim)


def masked_mean(v: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    n = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(v, mask, dim) / (n + 1e-8)


def to_floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Metrics as Python floats, every tensor value read in one host sync: they are stacked
    as float64 (exact for fp32/bf16/fp64 values, so each float equals its `.item()`) and read
    with a single `.tolist()`. Python numbers pass through."""
    keys = [k for k, v in metrics.items() if torch.is_tensor(v)]
    out = {k: v for k, v in metrics.items() if not torch.is_tensor(v)}
    if keys:
        values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys])
        out.update(zip(keys, values.tolist()))
    return {k: out[k] for k in metrics}


# -- (sum, count) statistics that data-parallel ranks add ---------------------------------------
Stats = dict[str, tuple[float, float]]
"""metric name -> (sum, count) of one rank, or added over ranks."""

ZERO_IF_EMPTY = ("replay/mismatch",)  # nothing replayed = nothing mismatched


def add_stats(parts: list[Stats]) -> Stats:
    """Add ranks' (sum, count) pairs, key order of the first rank."""
    out: Stats = {}
    for part in parts:
        for k, (s, c) in part.items():
            s0, c0 = out.get(k, (0.0, 0.0))
            out[k] = (s0 + s, c0 + c)
    return out


def stats_values(stats: Stats) -> dict[str, float]:
    """sum / count per metric (NaN where nothing was counted, 0 for ZERO_IF_EMPTY)."""
    return {k: s / c if c else (0.0 if k in ZERO_IF_EMPTY else math.nan)
            for k, (s, c) in stats.items()}


def route_stats(a_BTLK: torch.Tensor, b_BTLK: torch.Tensor, valid_BT: torch.Tensor,
                prefix: str, layer_names, first: bool) -> Stats:
    """`compare_routes`' metrics as (sum, count) pairs, so ranks add them: `<prefix>/flip_rate`
    ((token, layer) pairs whose top-k sets differ) overall and per layer, `/token_any_flip`,
    `/topk_overlap` and `/num_tokens`. `first`: this rank reports the token count (the
    group's rank 0). Shapes: B rows, T time, L MoE layers, K top-k."""
    cmp = compare_routes(a_BTLK, b_BTLK, valid_BT)
    L = cmp.flip_BTL.shape[-1]
    n = float(cmp.valid_BT.sum())
    flips_L = cmp.flip_BTL.sum(dim=(0, 1), dtype=torch.float64)
    out: Stats = {f"{prefix}/num_tokens": (n, 1.0 if first else 0.0),
                  f"{prefix}/flip_rate": (float(flips_L.sum()), n * L)}
    for i, f in zip(layer_names, flips_L.tolist()):
        out[f"{prefix}/flip_rate/layer_{int(i)}"] = (f, n)
    out[f"{prefix}/token_any_flip"] = (float(cmp.any_flip_BT.sum()), n)
    out[f"{prefix}/topk_overlap"] = (float(cmp.overlap_BTL.sum(dtype=torch.float64)), n * L)
    return out


def indexer_stats(a_BTLK: torch.Tensor, b_BTLK: torch.Tensor, valid_BT: torch.Tensor,
                  layer_names, first: bool) -> Stats:
    """`indexer_flip_rate` of two forwards' indexer picks as (sum, count) pairs:
    indexer/flip_rate (the share of a's picked keys b did not pick, over (token, indexer
    layer) pairs that had a choice), `/layer_<i>` (decoder layer ids), indexer/token_any_flip
    and indexer/num_tokens. Shapes: B rows, T time, L indexer layers, K index_topk."""
    r = indexer_flip_rate(a_BTLK, b_BTLK, valid_BT)
    n_rows = float(r["rows"])
    n = n_rows / max(len(layer_names), 1)
    out: Stats = {"indexer/flip_rate": (float(r["flip_rate"]) * n_rows, n_rows),
                  "indexer/token_any_flip": (float(r["token_any_flip"]) * n, n),
                  "indexer/num_tokens": (n, 1.0 if first else 0.0)}
    for i, f in zip(layer_names, r["flip_rate_layers"].tolist()):
        out[f"indexer/flip_rate/layer_{int(i)}"] = (f * n, n)
    return out
