"""Routes by reference: an embedded Ray engine (`rollout.routes_by_reference`) hands each
sample's routes to a `RouteStore` on its own node and answers with a `RouteRef` instead of the
`[N, L, K]` tensor; the driver batches the refs (`RouteRefs`), never the bytes, and each actor
rank fetches exactly its rows' routes from the stores (trainer/actor/group.py `RankWorker`).

    store = start_store(node_id)                          # per engine node, 0 CPUs
    results = keep_routes(results, attempts, store)       # in the engine, after generate
    routes = fetch_routes(refs)                           # on a rank: its rows' tensors

Keys are (weight_version, rid, sample index, attempt): a retried request is stored under a new
attempt, so it can never stand for a finished one, and the rank checks that what it fetched is
what its row names. The store is its own process (started by the fleet, pinned to the node):
routes survive an engine that dies after answering; losing the node loses them, and the step
fails saying so. A store keeps the routes of the newest `KEEP_VERSIONS` weight versions.
Imports ray inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lockstep.rollout.types import GenerationResult, RolloutError

RouteKey = tuple[str, str, int, int]  # (weight_version, rid, sample index, attempt)
KEEP_VERSIONS = 4  # a store keeps the newest 4 weight versions' routes (loop.max_staleness <= 2)


@dataclass(frozen=True)
class RouteRef:
    """Where one sample's routes are: under `key` in `store` (a `RouteStore` actor on the
    engine's node), `rows` route rows from absolute position `start`, of `dtype`."""

    key: RouteKey
    store: Any
    rows: int
    start: int
    dtype: str


@dataclass(frozen=True)
class RouteRefs:
    """One `RouteRef` per batch row (the batch's `rollout_route_refs`): rows are taken like a
    tensor's (`take`), and nothing of the routes themselves is held."""

    refs: tuple[RouteRef, ...]

    def take(self, rows_b: torch.Tensor) -> "RouteRefs":
        return RouteRefs(tuple(self.refs[i] for i in rows_b.tolist()))

    def __len__(self) -> int:
        return len(self.refs)


class RouteStore:
    """The routes of one node's engines, by key (a Ray actor of 0 CPUs on that node)."""

    def __init__(self, keep: int = KEEP_VERSIONS):
        self.routes: dict[RouteKey, torch.Tensor] = {}
        self.keep = keep

    def put(self, items: dict) -> int:
        """Store `items` (key -> routes); a key already held keeps its first routes. Versions
        beyond the newest `keep` are dropped. Returns the routes held."""
        for k, v in items.items():
            self.routes.setdefault(tuple(k), v)
        versions = sorted({k[0] for k in self.routes}, key=_version_order)
        for old in versions[:-self.keep]:
            for k in [k for k in self.routes if k[0] == old]:
                del self.routes[k]
        return len(self.routes)

    def get(self, keys: list) -> list:
        """The routes of `keys` (None where not held)."""
        return [self.routes.get(tuple(k)) for k in keys]


def _version_order(v: str):
    return (0, int(v), "") if v.isdigit() else (1, 0, v)


def start_store(node_id: str, keep: int = KEEP_VERSIONS) -> Any:
    """A `RouteStore` pinned to the node `node_id`, ready."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    store = ray.remote(RouteStore).options(
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    ).remote(keep)
    ray.get(store.put.remote({}))
    return store


def keep_routes(results: list[GenerationResult], attempts: dict[str, int],
                store: Any) -> list[GenerationResult]:
    """Engine side: each result's routes handed to `store` (on this node) and replaced by their
    `RouteRef` (`attempts`: rid -> how many times it was sent before); returns once stored."""
    import dataclasses

    import ray
    out, items = [], {}
    for r in results:
        if r.routes_NLK is None:
            out.append(r)
            continue
        if r.gates_NLK is not None:
            raise RolloutError(f"request {r.rid}: rollout.routes_by_reference does not carry "
                               f"gate weights (replay.gates=engine)")
        key: RouteKey = (str(r.weight_version), r.rid, int(r.index), int(attempts.get(r.rid, 0)))
        items[key] = r.routes_NLK
        out.append(dataclasses.replace(r, routes_NLK=None, routes_ref=RouteRef(
            key, store, int(r.routes_NLK.shape[0]), int(r.routes_start),
            str(r.routes_NLK.dtype).removeprefix("torch."))))
    if items:
        ray.get(store.put.remote(items))
    return out


def fetch_routes(refs: Sequence[RouteRef]) -> list[torch.Tensor]:
    """Rank side: the routes of `refs` (one call per store), each checked to be what its ref
    names (rows, dtype); an error names the sample."""
    import ray
    from ray.exceptions import RayActorError
    by_store: dict[Any, list[int]] = {}
    for i, r in enumerate(refs):
        by_store.setdefault(r.store, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(refs)
    calls = {store: store.get.remote([refs[i].key for i in idx]) for store, idx in by_store.items()}
    for store, idx in by_store.items():
        try:
            got = ray.get(calls[store])
        except RayActorError as e:
            r = refs[idx[0]]
            raise RolloutError(f"routes by reference: the store holding request {r.key[1]} "
                               f"sample {r.key[2]} is gone, with its node ({type(e).__name__})"
                               ) from None
        for i, routes in zip(idx, got):
            out[i] = routes
    for r, routes in zip(refs, out):
        if routes is None or routes.shape[0] != r.rows or \
                str(routes.dtype).removeprefix("torch.") != r.dtype:
            have = None if routes is None else (routes.shape[0], routes.dtype)
            raise RolloutError(f"routes by reference: request {r.key[1]} sample {r.key[2]} "
                               f"(weight version {r.key[0]}, attempt {r.key[3]}): the store has "
                               f"{have}, expected {r.rows} {r.dtype} rows")
    return out
