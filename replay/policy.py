"""Which routes the actor replays in each forward, per replay mode.

  mode  old-log-prob forward                 update forwards
  off   natural routing                      natural routing
  R3    rollout routes (engine's)            the same rollout routes
  R2    natural routing, routes recorded     the routes recorded by the old-log-prob forward

Per-token replay mask (DESIGN.md contract): a position replays only where a route exists. The
last sampled token of a sample never went through the rollout engine, and padding has no
route, so those positions route naturally (their logits never enter the loss). Dense layers have
no rows: the route tensors' layer axis is the model's MoE layers in order.

Indexer picks (`ReplayOptions.indexer`, DSA models) follow the same plan with their own mode:
r3 replays the engine's picks in every forward, r2 the old-logprob forward's in the updates.

Gate weights (`ReplayOptions.gates`): "recompute" (the default, as every peer does) lets the
trainer's router recompute the weights of the replayed experts; "engine" replays the weights
too, from whoever picked the routes: the rollout engine under R3 (its returned gates), the
old-log-prob forward under R2 (recorded with its routes). The model applies them
straight-through (moe/router.py), so the router keeps its gradient.

Shapes: B batch, T padded time, L MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..kernels.routes import RouteError, check_gates_BTLK, check_routes_BTLK


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


GATES = ("recompute", "engine")
INDEXER_MODES = ("off", "r2", "r3")
"""Indexer replay (DSA models): off (every forward picks its own keys), r2 (updates replay the
old-logprob forward's picks), r3 (every forward replays the engine's picks); independent of
the expert-routing mode (docs/replay.md "Indexer replay")."""
PARTIAL_RULES = ("margin", "tolerance")


@dataclass(frozen=True)
class PartialReplay:
    """Replay a (token, layer) route only where the trainer's own router is unsure enough;
    elsewhere the layer routes naturally (docs/replay.md "Partial replay").

    margin: replay where the router margin (k-th minus (k+1)-th expert probability,
    `moe.router.router_margin`) is below `threshold`: 0 replays nothing (= replay off), inf
    everything (= the mode's full replay). tolerance (prime-rl #2703's rule): replay where the
    trainer's probability mass on the replayed experts is within `threshold` of the mass on its
    own top-k (own - replayed <= threshold): inf replays everything."""

    rule: str
    threshold: float

    def __post_init__(self) -> None:
        if self.rule not in PARTIAL_RULES:
            raise ValueError(f"partial replay rule {self.rule!r}; valid: {list(PARTIAL_RULES)}")
        if not self.threshold >= 0:  # also refuses NaN
            raise ValueError(f"partial replay threshold must be >= 0, got {self.threshold!r}")


@dataclass(frozen=True)
class ReplayOptions:
    """How an actor replays, beyond the mode (the experiment's `replay` section)."""

    gates: str = "recompute"  # GATES: recompute the replayed experts' weights, or replay them
    partial: PartialReplay | None = None  # None: replay every position that has a route
    bias_meter_rows: float = 0.125  # rows of the bias meter's extra forward (0 = none)
    indexer: str = "off"  # INDEXER_MODES: which lightning-indexer picks DSA forwards replay

    def __post_init__(self) -> None:
        if self.gates not in GATES:
            raise ValueError(f"replay gates {self.gates!r}; valid: {list(GATES)}")
        if self.indexer not in INDEXER_MODES:
            raise ValueError(f"replay indexer {self.indexer!r}; valid: {list(INDEXER_MODES)}")
        if not 0.0 <= self.bias_meter_rows <= 1.0:
            raise ValueError(f"bias_meter_rows must be in [0, 1], got {self.bias_meter_rows!r}")

    @property
    def replays_gates(self) -> bool:
        return self.gates == "engine"


@dataclass(frozen=True)
class ReplayPlan:
    """What one actor forward does with routes. Pass `routes_BTLK` and `replay_mask_BT` to the
    model as `routed_experts_BTLK` / `replay_mask_BT`; when `record`, keep the forward's
    `out.routes_BTLK` for the update forwards (R2)."""

    routes_BTLK: torch.Tensor | None  # ids to replay; None = natural routing everywhere
    replay_mask_BT: torch.Tensor | None  # bool, True = replay routes_BTLK at this position
    record: bool  # keep the routes this forward used
    gates_BTLK: torch.Tensor | None = None  # their gate weights to replay; None = recompute

    @property
    def replays(self) -> bool:
        return self.routes_BTLK is not None


NO_REPLAY = ReplayPlan(None, None, False)


def _checked(routes_BTLK: torch.Tensor | None, mask_BT: torch.Tensor | None, what: str,
             mode: ReplayMode, gates_BTLK: torch.Tensor | None = None) -> ReplayPlan:
    if routes_BTLK is None:
        raise RouteError(f"replay mode {mode.value} needs {what}, got None")
    check_routes_BTLK(routes_BTLK, mask_BT, what=what, mask=f"replay mask for {what}")
    if gates_BTLK is not None:
        check_gates_BTLK(gates_BTLK, routes_BTLK.shape, what=f"gate weights of the {what}")
    if mask_BT is None:
        mask_BT = torch.ones(routes_BTLK.shape[:2], dtype=torch.bool, device=routes_BTLK.device)
    return ReplayPlan(routes_BTLK, mask_BT, record=False, gates_BTLK=gates_BTLK)


def old_logprob_plan(mode: ReplayMode | str, rollout_routes_BTLK: torch.Tensor | None = None,
                     rollout_valid_BT: torch.Tensor | None = None,
                     rollout_gates_BTLK: torch.Tensor | None = None) -> ReplayPlan:
    """Plan for the forward that computes old log-probs (pi_old).

    R3 replays the rollout routes where `rollout_valid_BT` (from `batch_traces`) is True, with
    the engine's gate weights when given; R2 routes naturally and records; off routes
    naturally."""
    mode = ReplayMode.parse(mode)
    if mode is ReplayMode.R3:
        return _checked(rollout_routes_BTLK, rollout_valid_BT, "rollout routes", mode,
                        rollout_gates_BTLK)
    if mode is ReplayMode.R2:
        return ReplayPlan(None, None, record=True)
    return NO_REPLAY


def update_plan(mode: ReplayMode | str, rollout_routes_BTLK: torch.Tensor | None = None,
                rollout_valid_BT: torch.Tensor | None = None,
                recorded_routes_BTLK: torch.Tensor | None = None,
                recorded_valid_BT: torch.Tensor | None = None,
                rollout_gates_BTLK: torch.Tensor | None = None,
                recorded_gates_BTLK: torch.Tensor | None = None) -> ReplayPlan:
    """Plan for a policy-update forward (pi_theta) of the same batch rows.

    R3: the rollout routes again (and the engine's gate weights when given). R2: the routes
    the old-log-prob forward recorded (and its gate weights when given); the trainer routed
    every position of that forward, so `recorded_valid_BT` defaults to all True (pass the
    token mask to leave padding natural). off: natural routing."""
    mode = ReplayMode.parse(mode)
    if mode is ReplayMode.R3:
        return _checked(rollout_routes_BTLK, rollout_valid_BT, "rollout routes", mode,
                        rollout_gates_BTLK)
    if mode is ReplayMode.R2:
        return _checked(recorded_routes_BTLK, recorded_valid_BT,
                        "routes recorded by the old-log-prob forward", mode, recorded_gates_BTLK)
    return NO_REPLAY
