"""The rollout backends a run's config can name (`rollout.backend`), and what each one is.

The one table the config's choices, the weight-sync modes each takes, the backend builder
(trainer/driver/rollouts.py) and colocation (rollout/colocate.py) read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendKind:
    name: str
    servers: bool
    """HTTP servers (SGLang's wire, or vLLM's for "vllm"; their weights are pushed at start-up), rather than
    in-process or Ray engines that start from the policy's weights."""
    launched: bool
    """lockstep launches the servers on Ray (a fleet it relaunches), rather than taking URLs."""
    weight_syncs: tuple[str, ...]
    """The `rollout.weight_sync` values it takes; "auto" first."""

    @property
    def colocatable(self) -> bool:
        """Its servers can go into the actor group's placement-group bundles."""
        return self.servers and self.launched


BACKENDS: dict[str, BackendKind] = {b.name: b for b in (
    BackendKind("embedded", servers=False, launched=False, weight_syncs=("auto",)),
    BackendKind("http", servers=True, launched=False,
                weight_syncs=("auto", "distributed", "tensor", "disk")),
    BackendKind("ray", servers=False, launched=True, weight_syncs=("auto", "object_store")),
    BackendKind("serve", servers=True, launched=True, weight_syncs=("auto", "distributed", "disk")),
    BackendKind("sglang", servers=True, launched=True, weight_syncs=("auto", "distributed", "disk")),
    BackendKind("vllm", servers=True, launched=True, weight_syncs=("auto", "distributed", "disk")),
)}
