"""Trajectory pins: the dispatcher (rollout/dispatch.py) sends every turn of a multi-turn
trajectory to the engine that answered its first turn, whose prefix cache holds the earlier
turns and whose forward passes produced the routes stitched so far.

A request names the trajectories its samples belong to (`GenerateRequest.trajectories`, one
id per sample; empty for single-turn requests). The first request of a trajectory goes to any
engine; once answered, the trajectory is pinned to that engine's current life (a relaunch or a
server that rejoins is a new life: its cache is empty and it may have restarted elsewhere).
A later request of a pinned trajectory goes to that engine only. When the engine is lost
(before the call, or during it with the request unanswered) the request is not sent anywhere
else: the trajectory is *lost*, the call raises `TrajectoriesLost` once every other request is
answered, holding their results, and whoever runs the trajectories starts the lost ones again
from their first turn (rollout/agent.py does, once). A first turn whose engine dies before it
is answered is resent to a live engine as any request is: nothing of it was kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep.rollout.types import GenerateRequest, GenerationResult, RolloutError


class TrajectoriesLost(RolloutError):
    """Trajectories whose engine was lost mid-trajectory: start them again from their first
    turn. `lost`: trajectory id -> what happened to its engine; `results`: the call's results
    in request order (sample index minor), None for the samples of lost trajectories."""

    def __init__(self, lost: dict[str, str], results: list[GenerationResult | None]):
        ids = sorted(lost)
        super().__init__(f"{len(ids)} trajectory(ies) lost with their engine, to be started "
                         f"again: {ids[:5]}{' ...' if len(ids) > 5 else ''}: "
                         f"{lost[ids[0]][:200]}")
        self.lost, self.results = lost, results


def check_trajectories(requests: list[GenerateRequest]) -> None:
    """Each request names no trajectory or one per sample; no trajectory has two requests in
    one call (a trajectory has one turn in flight)."""
    seen: set[str] = set()
    for r in requests:
        ids = r.trajectories
        if ids and (len(ids) != r.sampling.n or not all(isinstance(t, str) and t for t in ids)):
            raise RolloutError(f"request {r.rid}: trajectories={list(ids)[:5]} must be one "
                               f"non-empty id per sample (n={r.sampling.n}), or empty")
        for t in ids:
            if t in seen:
                raise RolloutError(f"trajectory {t!r} has two requests in one generate call "
                                   f"(one turn of a trajectory at a time)")
            seen.add(t)


@dataclass
class Pins:
    """trajectory id -> (engine index, engine life) of the engine holding it."""

    held: dict[str, tuple[int, int]] = field(default_factory=dict)

    def target(self, req: GenerateRequest, slots: list) -> tuple[int | None, str]:
        """The engine `req` must go to (None: any) and, when its trajectories' engine is gone,
        why (the request is then not sent). A request's samples share one engine, so their
        trajectories must be pinned alike."""
        pins = {self.held.get(t) for t in req.trajectories}
        if not pins or pins == {None}:
            return None, ""
        if len(pins) > 1:
            raise RolloutError(f"request {req.rid}: its trajectories {list(req.trajectories)[:5]}"
                               f" are held by different engines (or some by none); send one "
                               f"request per trajectory after its first turn")
        (index, life), = pins
        slot = slots[index]
        if slot.life != life or slot.state != "live":
            return index, (f"engine {index} was lost after their last turn ({slot.state}: "
                           f"{slot.last_error[:200] or 'relaunched'})")
        return index, ""

    def pin(self, req: GenerateRequest, answered_by: dict[tuple[str, int], tuple[int, int]]
            ) -> None:
        """After a call: each of `req`'s trajectories is held by the engine (life) that
        answered its sample."""
        for j, t in enumerate(req.trajectories):
            self.held[t] = answered_by[(req.rid, j)]

    def drop(self, trajectories) -> None:
        for t in trajectories:
            self.held.pop(t, None)
