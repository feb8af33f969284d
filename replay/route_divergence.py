"""Routing divergence between two sets of routes for the same tokens.

Typical pairs: the routes the rollout engine used vs the natural top-k of the trainer's router
(train/infer mismatch), or under R2 the routes recorded by the old-log-prob forward vs the
current router's natural top-k (policy staleness). Expert sets are compared order-insensitively.

Definitions over valid (token, layer) pairs (valid tokens x all L layers):
  flip            expert set of `a` != expert set of `b`
  flip_rate       mean of flip over valid (token, layer)
  flip_rate/layer_<i>  mean of flip over valid tokens of layer i
  token_any_flip  fraction of valid tokens with a flip in >= 1 layer
  topk_overlap    mean of |A ∩ B| / K over valid (token, layer)
With no valid token every metric is NaN (there is nothing to measure, and 0 would read as
"no divergence"); `<prefix>/num_tokens` reports the count.

Shapes: B batch, T time, L MoE layers, K top-k, N valid tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .trace import RouteError

_CHUNK_ELEMS = 1 << 22  # bounds the [N, L, K, K] comparison tensor


@dataclass(frozen=True)
class RouteComparison:
    """Per-token comparison tensors (False / 0 at invalid positions), for metrics and debugging."""

    flip_BTL: torch.Tensor      # bool: expert set differs at (token, layer)
    any_flip_BT: torch.Tensor   # bool: flip in >= 1 layer
    overlap_BTL: torch.Tensor   # float32: |A ∩ B| / K
    valid_BT: torch.Tensor      # bool: positions compared

    def metrics(self, prefix: str = "routing",
                layer_names: Sequence[int] | None = None) -> dict[str, float]:
        """Metric dict `{prefix}/flip_rate`, `{prefix}/flip_rate/layer_<i>`,
        `{prefix}/token_any_flip`, `{prefix}/topk_overlap`, `{prefix}/num_tokens`.
        `<i>` is the MoE-layer index (0..L-1) unless `layer_names` (e.g. the model's
        moe_layer_ids, to label by decoder layer) is given."""
        L = self.flip_BTL.shape[-1]
        names = list(range(L)) if layer_names is None else [int(i) for i in layer_names]
        if len(names) != L:
            raise RouteError(f"layer_names has {len(names)} entries for {L} layers")
        n = int(self.valid_BT.sum())
        out = {f"{prefix}/num_tokens": float(n)}
        if n == 0:
            nan = float("nan")
            out.update({f"{prefix}/flip_rate": nan, f"{prefix}/token_any_flip": nan,
                        f"{prefix}/topk_overlap": nan})
            out.update({f"{prefix}/flip_rate/layer_{i}": nan for i in names})
            return out
        flips_L = self.flip_BTL.sum(dim=(0, 1), dtype=torch.float64)  # invalid rows are False
        out[f"{prefix}/flip_rate"] = float(flips_L.sum() / (n * L))
        for i, f in zip(names, flips_L.tolist()):
            out[f"{prefix}/flip_rate/layer_{i}"] = f / n
        out[f"{prefix}/token_any_flip"] = float(self.any_flip_BT.sum()) / n
        out[f"{prefix}/topk_overlap"] = float(self.overlap_BTL.sum(dtype=torch.float64) / (n * L))
        return out


def _check_pair(a_BTLK: torch.Tensor, b_BTLK: torch.Tensor,
                valid_BT: torch.Tensor | None) -> torch.Tensor:
    for name, x in (("a", a_BTLK), ("b", b_BTLK)):
        if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise RouteError(f"routes {name} must be an integer tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 4:
            raise RouteError(f"routes {name} must be [B, T, L, K], got shape {tuple(x.shape)}")
    if a_BTLK.shape != b_BTLK.shape:
        raise RouteError(f"routes differ in shape: {tuple(a_BTLK.shape)} vs {tuple(b_BTLK.shape)}")
    if valid_BT is None:
        return torch.ones(a_BTLK.shape[:2], dtype=torch.bool, device=a_BTLK.device)
    if valid_BT.dtype != torch.bool or valid_BT.shape != a_BTLK.shape[:2]:
        raise RouteError(f"valid mask must be bool {tuple(a_BTLK.shape[:2])}, got "
                         f"{valid_BT.dtype} {tuple(valid_BT.shape)}")
    return valid_BT


def compare_routes(a_BTLK: torch.Tensor, b_BTLK: torch.Tensor,
                   valid_BT: torch.Tensor | None = None) -> RouteComparison:
    """Compare two route tensors (any integer dtype, same shape) at valid positions."""
    valid_BT = _check_pair(a_BTLK, b_BTLK, valid_BT)
    B, T, L, K = a_BTLK.shape
    # int32 because torch has no comparison/sort kernels for uint16.
    a_NLK = a_BTLK[valid_BT].to(torch.int32)
    b_NLK = b_BTLK[valid_BT].to(torch.int32)
    N = a_NLK.shape[0]
    flip_NL = (a_NLK.sort(-1).values != b_NLK.sort(-1).values).any(-1)
    overlap_NL = torch.empty(N, L, dtype=torch.float32, device=a_NLK.device)
    step = max(1, _CHUNK_ELEMS // max(1, L * K * K))
    for s in range(0, N, step):  # chunks of tokens, not a loop over tokens
        a, b = a_NLK[s:s + step], b_NLK[s:s + step]
        hits = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)
        overlap_NL[s:s + step] = hits.to(torch.float32) / K
    flip_BTL = torch.zeros(B, T, L, dtype=torch.bool, device=a_NLK.device)
    flip_BTL[valid_BT] = flip_NL
    overlap_BTL = torch.zeros(B, T, L, dtype=torch.float32, device=a_NLK.device)
    overlap_BTL[valid_BT] = overlap_NL
    return RouteComparison(flip_BTL, flip_BTL.any(-1), overlap_BTL, valid_BT)


def routing_divergence(a_BTLK: torch.Tensor, b_BTLK: torch.Tensor,
                       valid_BT: torch.Tensor | None = None, prefix: str = "routing",
                       layer_names: Sequence[int] | None = None) -> dict[str, float]:
    """Metric dict comparing routes `a` (e.g. used/rollout) with `b` (e.g. natural top-k).
    Use prefix="routing_r2" for R2 old-vs-current routes."""
    return compare_routes(a_BTLK, b_BTLK, valid_BT).metrics(prefix, layer_names)
