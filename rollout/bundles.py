"""Where a fleet starts each engine's Ray actor: bundle `index[i]` of a placement group (the
fleet's own, pinned to the planned nodes or not, or the actor group's when colocated), until
the engine's node is lost; then a placement group of one bundle of its own, wherever the
cluster has room (`move`), so a relaunch does not wait for a node that is gone. Used by
rollout/fleet.py; the dispatcher calls `move` (rollout/dispatch.py `_relaunch`)."""

from __future__ import annotations

from typing import Any


class EngineBundles:
    """`pg` and one bundle index per engine; `one` is an engine's bundle (for a move);
    `movable`: False for bundles that are not the fleet's (colocated in the actor group's)."""

    def __init__(self, pg: Any, index: list[int], one: dict[str, float], timeout_s: float,
                 name: str, movable: bool = True):
        self.pg, self.index, self.one = pg, list(index), dict(one)
        self.timeout_s, self.name, self.movable = float(timeout_s), name, movable
        self.moved: dict[int, Any] = {}  # engine -> its own placement group after a move

    def where(self, i: int) -> tuple[Any, int]:
        """(placement group, bundle index) engine i starts in."""
        return (self.moved[i], 0) if i in self.moved else (self.pg, self.index[i])

    def move(self, i: int) -> None:
        """Engine i's next start goes to a new one-bundle placement group on any node with
        room (no label pin: its planned node is gone); a RuntimeError naming what is free
        when none has room within the start-up timeout."""
        from ray.util.placement_group import remove_placement_group

        from lockstep.cluster.ray_ops import reserve
        new = reserve([self.one], f"{self.name}-moved", self.timeout_s)
        old = self.moved.pop(i, None)
        if old is not None:
            remove_placement_group(old)
        self.moved[i] = new

    def release(self) -> None:
        """Remove the placement groups of moved engines (the main one is the owner's)."""
        from ray.util.placement_group import remove_placement_group
        for pg in self.moved.values():
            try:
                remove_placement_group(pg)
            except Exception:  # Ray already shut down by its other user
                pass
        self.moved = {}
