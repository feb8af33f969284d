"""Ray, set up one way for every group of actors lockstep starts (the actor ranks, the rollout
engines and servers).

    owns = init_ray(address, env)                      # join `address`, or start a local Ray
    pg = reserve([bundle(1, 0)] * 4, "lockstep-engine", timeout_s=300)
    actor = spawn(ray.remote(MyActor), pg, 2, cpus=1, env=env)(*args)
    infos = gather("start", [a.info.remote() for a in actors], names, timeout_s=300)
    release(actors, pg, owns)                          # kill, free the bundles, stop our Ray

Imports only ray and the standard library; callers pass numbers and the workers' environment
(`kernels/threads.worker_env`), never the experiment config.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from typing import Any

import ray
from ray.exceptions import (ActorUnavailableError, OutOfMemoryError, RayActorError, RayTaskError,
                            WorkerCrashedError)
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# What a dead actor process looks like from the driver (the actor itself, or the process
# running its task, was killed or crashed).
DIED = (RayActorError, WorkerCrashedError, OutOfMemoryError)


class CallFailed(RuntimeError):
    """An actor call in `gather` died, raised or timed out; `index` is the actor's position."""

    def __init__(self, index: int, message: str, died: bool = False, unreachable: bool = False):
        super().__init__(message)
        # died: the actor's process is gone; unreachable: Ray does not know yet whether it is
        # (its connection broke: the process, or its whole node, may be gone)
        self.index, self.died, self.unreachable = index, died, unreachable


def init_ray(address: str | None, env: dict[str, str] | None = None,
             num_cpus: int | None = None, attempts: int = 3) -> bool:
    """Start or join Ray. `address` None: Ray's own discovery (`RAY_ADDRESS`, else the cluster
    `ray start` began on this machine, else a new local one); "local": a private local cluster
    for this run with `num_cpus` (default: this machine's CPUs), even where `ray start` left an
    address; "HOST:PORT": join that cluster. Workers get `env` in their environment. A
    local start is retried: Ray gives its raylet a fixed 30 s to register, which a busy machine
    can miss. Returns whether this call started Ray (the caller then shuts it down in
    `release`); False when it was already up (a test's cluster, another group's)."""
    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"runtime_env": {"env_vars": dict(env or {})}}
    if address == "local":
        kw.update(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, **kw)
            return True
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            ray.shutdown()
    raise AssertionError("unreachable")


def bundle(cpus: float, gpus: float = 0) -> dict[str, float]:
    """One placement-group bundle: `{CPU: cpus}` plus `{GPU: gpus}` when gpus > 0."""
    return {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}


def reserve(bundles: list[dict[str, float]], name: str, timeout_s: float,
            strategy: str = "PACK",
            selectors: list[dict[str, str]] | None = None) -> PlacementGroup:
    """A placement group of `bundles` (PACK: one node while it fits), ready; a RuntimeError
    saying what was asked and what the cluster has free when it is not within `timeout_s`
    (nothing is left reserved). `selectors`: one Ray label selector per bundle (the node it
    must go to, `cluster/placement.node_selectors`)."""
    kw: dict[str, Any] = {} if selectors is None else {"bundle_label_selector": selectors}
    pg = placement_group(bundles, strategy=strategy,
                         name=f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}", **kw)
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        pinned = "" if selectors is None else f" on the nodes labelled {selectors}"
        raise RuntimeError(
            f"could not reserve {len(bundles)} bundles of {bundles[0]}{pinned} within "
            f"{timeout_s:.0f}s ({strategy}); the cluster has {ray.available_resources()} free "
            f"of {ray.cluster_resources()}; nodes: {describe_nodes()}")
    return pg


def describe_nodes() -> str:
    """Every node Ray knows: address, labels of ours (not Ray's own `ray.io/*`), CPUs/GPUs,
    alive or dead (for error messages)."""
    out = []
    for n in ray.nodes():
        labels = {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}
        res = n.get("Resources") or {}
        units = ", ".join(f"{k} {res[k]:g}" for k in ("CPU", "GPU") if k in res) or "no CPU"
        out.append(f"{n['NodeManagerAddress']} ({n['NodeID'][:12]}{', ' if labels else ''}"
                   f"{', '.join(f'{k}={v}' for k, v in labels.items())}; {units}; "
                   f"{'alive' if n['Alive'] else 'dead'})")
    return "; ".join(out)


def node_alive(node: str) -> bool | None:
    """Whether the Ray node with this id (or id prefix) is alive; None when Ray does not know
    it (or it is not a node id: "?")."""
    for n in ray.nodes():
        if node and node != "?" and n["NodeID"].startswith(node):
            return bool(n["Alive"])
    return None


def node_name(node: str) -> str:
    """A node for people: its address and our labels (`10.0.0.7 (lockstep-node=1)`), or the id
    when Ray does not know it."""
    for n in ray.nodes():
        if node and node != "?" and n["NodeID"].startswith(node):
            labels = {k: v for k, v in (n.get("Labels") or {}).items()
                      if not k.startswith("ray.io/")}
            tag = ", ".join(f"{k}={v}" for k, v in labels.items())
            return f"{n['NodeManagerAddress']}{f' ({tag})' if tag else ''}"
    return node


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def spawn(remote_cls: Any, pg: PlacementGroup, index: int, cpus: float, gpus: float = 0,
          env: dict[str, str] | None = None) -> Any:
    """`remote_cls.options(...)` for one actor in bundle `index` of `pg` taking `cpus`/`gpus`
    of it, with Ray's restarts off (the owner replaces a dead actor itself) and `env` in its
    environment; call the result with the constructor's arguments."""
    opts: dict[str, Any] = dict(num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                                scheduling_strategy=in_bundle(pg, index))
    if env is not None:
        opts["runtime_env"] = {"env_vars": dict(env)}
    return remote_cls.options(**opts).remote


def gather(what: str, refs: list, names: list[str], timeout_s: float | None = None) -> list:
    """Every answer, in order. The first failure (whichever actor it hits first) raises
    `CallFailed` naming that actor (`names[i]`): died, raised, or no answer within `timeout_s`."""
    owner = {ref: i for i, ref in enumerate(refs)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending, got = list(refs), {}
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            i = owner[pending[0]]
            raise CallFailed(i, f"{names[i]}: no answer to {what} within {timeout_s:.0f}s")
        i = owner[ready[0]]
        try:
            got[ready[0]] = ray.get(ready[0])
        except DIED as e:
            raise CallFailed(i, f"{names[i]} died during {what}: {death_reason(e)}",
                             died=True, unreachable=isinstance(e, ActorUnavailableError)) from None
        except RayTaskError as e:
            raise CallFailed(i, f"{names[i]} failed in {what}: {task_error(e)}") from None
    return [got[ref] for ref in refs]


def task_error(e: RayTaskError) -> str:
    """What raised inside the actor: `Type: message`."""
    return f"{type(e.cause).__name__}: {e.cause}"


def death_reason(e: BaseException) -> str:
    """Ray's death message, cut to its first line plus the last line of any traceback in it
    (a constructor's exception)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Ray colours its task names
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"


def node_ip() -> str:
    """This process's node address (what a server on it binds and advertises)."""
    return ray.util.get_node_ip_address()


def node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def kill(actor: Any) -> None:
    """Kill an actor (no Ray restart); one already dead is fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead: nothing left to free
        pass


def release(actors: list, pg: PlacementGroup | None, owns_ray: bool) -> None:
    """Tear down what a group of Ray actors holds: kill the actors, remove their placement
    group, and shut Ray down if the caller started it. Safe when actors are already dead or
    another owner (the rollout, the actor group) has already shut Ray down."""
    for a in actors:
        kill(a)
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # Ray already shut down by its other user
            pass
    if owns_ray and ray.is_initialized():
        ray.shutdown()
