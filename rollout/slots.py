"""What the rollout dispatcher (rollout/dispatch.py) keeps of each engine and each request: an
`EngineSlot` per engine, a `Group` per request (a prompt and its n samples), the fleet's
counters, how requests are split over engines, and the two faults a call can end in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from lockstep.rollout.client import HTTPBackend
from lockstep.rollout.types import GenerateRequest, RolloutError

START_GRACE_S = 30.0  # beyond the start-up timeout, for a Ray worker process to start


class Aborted(RolloutError):
    """A sample came back aborted (someone aborted it on a live server): send the group again."""


class EnginesDown(RolloutError):
    """A weight push that some engines did not take: `dead` did not answer (dead or hung),
    `unknown` may hold any version now."""

    def __init__(self, message: str, dead: list, unknown: list | None = None):
        super().__init__(message)
        self.dead, self.unknown = dead, unknown or []


# -- one engine of the fleet ---------------------------------------------------------------------
@dataclass
class EngineSlot:
    """What the dispatcher knows of one engine: where it runs, its Ray actor (None for a server
    given by URL), its HTTP client (HTTP transport), the weights it holds, its state."""

    index: int
    url: str = ""
    pid: int = -1
    node: str = "?"
    last_node: str = "?"  # the node of its last incarnation that came up (kept while it restarts)
    threads: int = 0
    wait_policy: str | None = None  # its OpenMP wait variables (kernels/threads.policy_text)
    actor: Any = None
    client: HTTPBackend | None = None
    state: str = "starting"  # live | joining (up, without the current weights) | dead
    version: str | None = None  # the weight version it holds (None: not known)
    restarts: int = 0
    life: int = 0  # +1 each time it is marked dead: trajectories pinned to a life end with it
    load: int = 0  # samples in flight
    samples: int = 0  # samples answered (every incarnation)
    last_error: str = ""

    def __str__(self) -> str:
        where = self.url or ("starting" if self.pid < 0 else "ray actor")
        return f"engine {self.index} ({where}, pid {self.pid}, node {self.node[:12]}, {self.state})"


@dataclass
class Group:
    """One request (a prompt and its n samples) and the wire requests it is sent as."""

    pos: int
    req: GenerateRequest
    wire: list[tuple[int, GenerateRequest]]  # (first sample index, request): the request
    # itself, or n single-sample ones (HTTP fan-out)
    tries: int = 0
    target: int | None = None  # the engine its trajectories are pinned to (None: any)

    @property
    def samples(self) -> int:
        return self.req.sampling.n


@dataclass
class FleetStats:
    retried_groups: int = 0
    duplicates_dropped: int = 0
    engines_marked_dead: int = 0
    relaunches: int = 0
    trajectories_lost: int = 0  # reported by TrajectoriesLost, to be started again
    pushes: int = 0
    push_seconds: float = 0.0
    push_bytes: int = 0          # bytes sent to the engines by the last push
    disk_bytes_written: int = 0  # weight folders this fleet wrote for weight sync, in total
    events: list[str] = field(default_factory=list)


def shard(groups: list, num_shards: int, samples: Callable[[Any], int]) -> list[list]:
    """Contiguous runs of `groups`, balanced by `samples` (a group stays whole);
    concatenating the runs gives back `groups` in order."""
    total = sum(samples(g) for g in groups)
    runs: list[list] = [[] for _ in range(num_shards)]
    done = 0
    for g in groups:
        # the run whose equal share of all samples holds this group's first sample
        runs[min(num_shards - 1, done * num_shards // max(total, 1))].append(g)
        done += samples(g)
    return runs
