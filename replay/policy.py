"""Which routes the actor replays in each forward, per replay mode.

  mode  old-log-prob forward                 update forwards
  off   natural routing                      natural routing
  R3    rollout routes (engine's)            the same rollout routes
  R2    natural routing, routes recorded     the routes recorded by the old-log-prob forward

Per-token replay mask (DESIGN.md contract): a position replays only where a route exists. The
last sampled token of a sample never went through the rollout engine, and padding has no
route, so those positions route naturally (their logits never enter the loss). Dense layers have
no rows: the route tensors' layer axis is the model's MoE layers in order.

Shapes: B batch, T padded time, L MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..kernels.routes import RouteError, check_routes_BTLK


class ReplayMode(str, Enum):
    """Routing replay mode: off, R2 (replay the trainer's own old routes), R3 (rollout routes)."""

    OFF = "off"
    R2 = "R2"
    R3 = "R3"

    @classmethod
    def parse(cls, value: ReplayMode | str) -> ReplayMode:
        """'off' | 'R2' | 'R3' (case-insensitive) -> ReplayMode; anything else is an error
        listing the valid values."""
        if isinstance(value, ReplayMode):
            return value
        if isinstance(value, str):
            for m in cls:
                if value.strip().lower() == m.value.lower():
                    return m
        raise ValueError(f"unknown replay mode {value!r}; valid: {[m.value for m in cls]}")

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ReplayPlan:
    """What one actor forward does with routes. Pass `routes_BTLK` and `replay_mask_BT` to the
    model as `routed_experts_BTLK` / `replay_mask_BT`; when `record`, keep the forward's
    `out.routes_BTLK` for the update forwards (R2)."""

    routes_BTLK: torch.Tensor | None  # ids to replay; None = natural routing everywhere
    replay_mask_BT: torch.Tensor | None  # bool, True = replay routes_BTLK at this position
    record: bool  # keep the routes this forward used

    @property
    def replays(self) -> bool:
        return self.routes_BTLK is not None


NO_REPLAY = ReplayPlan(None, None, False)


def _checked(routes_BTLK: torch.Tensor | None, mask_BT: torch.Tensor | None, what: str,
             mode: ReplayMode) -> ReplayPlan:
    if routes_BTLK is None:
        raise RouteError(f"replay mode {mode.value} needs {what}, got None")
    check_routes_BTLK(routes_BTLK, mask_BT, what=what, mask=f"replay mask for {what}")
    if mask_BT is None:
        mask_BT = torch.ones(routes_BTLK.shape[:2], dtype=torch.bool, device=routes_BTLK.device)
    return ReplayPlan(routes_BTLK, mask_BT, record=False)


def old_logprob_plan(mode: ReplayMode | str, rollout_routes_BTLK: torch.Tensor | None = None,
                     rollout_valid_BT: torch.Tensor | None = None) -> ReplayPlan:
    """Plan for the forward that computes old log-probs (pi_old).

    R3 replays the rollout routes where `rollout_valid_BT` (from `batch_traces`) is True; R2
    routes naturally and records; off routes naturally."""
    mode = ReplayMode.parse(mode)
    if mode is ReplayMode.R3:
        return _checked(rollout_routes_BTLK, rollout_valid_BT, "rollout routes", mode)
    if mode is ReplayMode.R2:
        return ReplayPlan(None, None, record=True)
    return NO_REPLAY


def update_plan(mode: ReplayMode | str, rollout_routes_BTLK: torch.Tensor | None = None,
                rollout_valid_BT: torch.Tensor | None = None,
                recorded_routes_BTLK: torch.Tensor | None = None,
                recorded_valid_BT: torch.Tensor | None = None) -> ReplayPlan:
    """Plan for a policy-update forward (pi_theta) of the same batch rows.

    R3: the rollout routes again. R2: the routes the old-log-prob forward recorded; the trainer
    routed every position of that forward, so `recorded_valid_BT` defaults to all True (pass the
    token mask to leave padding natural). off: natural routing."""
    mode = ReplayMode.parse(mode)
    if mode is ReplayMode.R3:
        return _checked(rollout_routes_BTLK, rollout_valid_BT, "rollout routes", mode)
    if mode is ReplayMode.R2:
        return _checked(recorded_routes_BTLK, recorded_valid_BT,
                        "routes recorded by the old-log-prob forward", mode)
    return NO_REPLAY
