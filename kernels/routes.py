"""`RouteError` and the shape check of a batch of routes, on the ground floor so the model
(moe/), the replay policies (replay/) and the megatron adapter share them.

Route *values* (ids in [0, num_experts), distinct within a row) are checked once, where routes
enter: `replay.trace.validate_ids`, run by every `RoutingTrace` (the engine's result, the wire
codecs, trace files) and by the dump reader. Inside, a batch of routes is either built from
validated traces (`batch_traces`) or recorded by the model's own top-k, so the model and the
megatron adapter check shapes only (`check_routes_BTLK`), with no pass over the ids.

Shapes: B batch, T padded time, L MoE layers, K top-k.
"""

from __future__ import annotations

import torch


class RouteError(ValueError):
    """Routes that break the RoutingTrace contract (shape, dtype, id range, lengths)."""


def check_routes_BTLK(routes_BTLK: torch.Tensor, mask_BT: torch.Tensor | None = None, *,
                      what: str = "routes", mask: str = "replay mask",
                      shape: tuple[int, int, int, int] | None = None) -> None:
    """Raise RouteError unless `routes_BTLK` is an integer [B, T, L, K] tensor (of exactly
    `shape` when given) and `mask_BT`, when given, is bool [B, T]. `what` and `mask` name the
    tensors in the message."""
    if shape is not None and tuple(routes_BTLK.shape) != tuple(shape):
        raise RouteError(f"{what} has shape {tuple(routes_BTLK.shape)}, expected "
                         f"[B, T, L_moe, K] = {list(shape)} (L_moe counts MoE layers only)")
    dt = routes_BTLK.dtype
    if routes_BTLK.dim() != 4 or dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise RouteError(f"{what} must be an integer [B, T, L, K] tensor, got {dt} "
                         f"{tuple(routes_BTLK.shape)}")
    if mask_BT is not None and (mask_BT.dtype != torch.bool
                                or tuple(mask_BT.shape) != tuple(routes_BTLK.shape[:2])):
        raise RouteError(f"{mask} must be bool {tuple(routes_BTLK.shape[:2])}, got "
                         f"{mask_BT.dtype} {tuple(mask_BT.shape)}")


def check_gates_BTLK(gates_BTLK: torch.Tensor, routes_shape, *, what: str = "routed_gates"):
    """Raise RouteError unless replayed gate weights are a floating [B, T, L, K] tensor of the
    routes' shape (values are checked where they enter: `replay.gates.decode_gates`)."""
    if not gates_BTLK.dtype.is_floating_point or tuple(gates_BTLK.shape) != tuple(routes_shape):
        raise RouteError(f"{what} must be a floating tensor of the routes' shape "
                         f"{list(routes_shape)}, got {gates_BTLK.dtype} {tuple(gates_BTLK.shape)}")
