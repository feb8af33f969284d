"""Ray orchestration of the rollout: N embedded engines as Ray actors, one CPU bundle each in a
placement group, behind the same `RolloutBackend` interface as the in-process engine.

    backend = RayBackend.from_model(model, EngineConfig(dtype="bf16"), num_engines=4)
    results = backend.generate(requests)          # sharded, gathered in request order
    backend.update_weights(actor.master, "7")     # one ray.put, every engine loads from it
    backend.close()                               # kills the workers, frees the bundles

Sharding keeps each request (one prompt and its n samples, the GRPO group) on one engine, in
contiguous runs balanced by sample count, so results come back prompt-major, sample minor, as
from `LocalBackend`. Seeded requests give the same tokens, log-probs and routes as the
in-process engine (the engine's per-request seeding makes a sample independent of what else
is in its batch). Every result's weight version is checked against the version last pushed.

A worker that died or a task that raised closes the backend: the workers' state is no longer
known, so they are killed and the placement group removed before the error, which names the
worker, propagates. A result with an unexpected weight version raises without closing (the
next `update_weights` brings every worker to one version again).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lockstep.moe.checkpoint import read_hf_state_dict
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import RolloutBackend, RolloutError, as_source
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.types import GenerateRequest, GenerationResult

# Engines run one torch thread each; OpenMP/MKL pools follow the same env var.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class EngineWorker:
    """One embedded engine in a Ray actor process (wrapped by `ray.remote` in `RayBackend`).

    `source` is an HF folder readable on the worker's node, or a native state dict (shipped as
    an object ref, which Ray resolves before the constructor runs) with `model_cfg`.
    """

    def __init__(self, source: str | dict[str, torch.Tensor], model_cfg: ModelConfig | None,
                 engine_cfg: EngineConfig, weight_version: str, threads: int = 1):
        torch.set_num_threads(threads)
        if isinstance(source, str):
            self.engine = Engine.from_hf(source, engine_cfg, weight_version)
        else:
            if model_cfg is None:
                raise ValueError("EngineWorker: a state-dict source needs model_cfg")
            model = MoEModel(model_cfg)
            model.load_state_dict(source, strict=True)
            self.engine = Engine(model, engine_cfg, weight_version)

    def info(self) -> dict[str, Any]:
        """Where this worker runs and the dtype each weight is held in (for casting pushes)."""
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "threads": torch.get_num_threads(), "weight_version": self.engine.weight_version,
                "dtypes": {k: v.dtype for k, v in self.engine.model.state_dict().items()}}

    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return self.engine.generate(requests)

    def update_weights(self, state_dict: dict[str, torch.Tensor], weight_version: str) -> str:
        return self.engine.update_weights(state_dict, weight_version)


@dataclass
class WorkerInfo:
    """What the driver knows of one engine worker, for error messages."""

    index: int
    name: str
    pid: int = -1
    node: str = "?"
    threads: int = 0

    def __str__(self) -> str:
        where = "starting" if self.pid < 0 else f"pid {self.pid}, node {self.node[:12]}"
        return f"engine worker {self.index} ({self.name}, {where})"


def shard(requests: list[GenerateRequest], num_shards: int) -> list[list[GenerateRequest]]:
    """Contiguous runs of whole requests, balanced by sample count (a request's n samples stay
    together); concatenating the shards gives back `requests` in order."""
    total = sum(r.sampling.n for r in requests)
    shards: list[list[GenerateRequest]] = [[] for _ in range(num_shards)]
    done = 0
    for r in requests:
        # The shard whose equal share of all samples holds this request's first sample.
        w = min(num_shards - 1, done * num_shards // total)
        shards[w].append(r)
        done += r.sampling.n
    return shards


class RayBackend(RolloutBackend):
    """Rollout over `num_engines` embedded engines running as Ray actors.

    Joins the running Ray cluster (or `address`; starts a local one when there is none), puts
    one `{"CPU": cpus_per_engine}` bundle per engine in a placement group (`strategy` PACK:
    one node while it fits) and starts an `EngineWorker` in each bundle.
    """

    def __init__(self, source: str | Path | MoEModel | dict[str, torch.Tensor],
                 engine_cfg: EngineConfig, num_engines: int, weight_version: str = "0",
                 model_cfg: ModelConfig | None = None, address: str | None = None,
                 cpus_per_engine: float = 1.0, strategy: str = "PACK",
                 threads_per_engine: int = 1, startup_timeout_s: float = 300.0,
                 name: str = "lockstep-engine"):
        if not (isinstance(num_engines, int) and num_engines >= 1):
            raise ValueError(f"RayBackend: num_engines must be a positive integer, "
                             f"got {num_engines!r}")
        if isinstance(source, MoEModel):
            source, model_cfg = source.state_dict(), source.cfg
        if isinstance(source, dict) and model_cfg is None:
            raise ValueError("RayBackend: a state-dict source needs model_cfg")
        self.weight_version = str(weight_version)
        self.workers: list[Any] = []
        self.infos = [WorkerInfo(i, f"{name}-{i}") for i in range(num_engines)]
        self.dtypes: dict[str, torch.dtype] = {}
        self.closed = False
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, runtime_env={"env_vars": WORKER_ENV})
        self.pg: PlacementGroup | None = None
        try:
            self.pg = placement_group([{"CPU": cpus_per_engine}] * num_engines, strategy=strategy,
                                      name=f"{name}-{os.getpid()}-{id(self):x}")
            if not self.pg.wait(startup_timeout_s):
                raise RolloutError(
                    f"RayBackend: could not reserve {num_engines} bundles of {cpus_per_engine} "
                    f"CPU ({strategy}) within {startup_timeout_s:.0f}s; the cluster has "
                    f"{ray.available_resources().get('CPU', 0)} CPUs free of "
                    f"{ray.cluster_resources().get('CPU', 0)}")
            # Shipped once: every worker's constructor resolves the same object.
            src = str(source) if isinstance(source, (str, Path)) else ray.put(source)
            remote_cls = ray.remote(EngineWorker)
            for i, info in enumerate(self.infos):
                self.workers.append(remote_cls.options(
                    num_cpus=cpus_per_engine, max_restarts=0, runtime_env={"env_vars": WORKER_ENV},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=i),
                ).remote(src, model_cfg, engine_cfg, self.weight_version, threads_per_engine))
            for info, got in zip(self.infos, self._gather("start", [
                    w.info.remote() for w in self.workers], timeout_s=startup_timeout_s)):
                info.pid, info.node, info.threads = got["pid"], got["node"], got["threads"]
                self.dtypes = got["dtypes"]
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_model(cls, model: MoEModel, engine_cfg: EngineConfig, num_engines: int,
                   weight_version: str = "0", **kw: Any) -> "RayBackend":
        """Engines over a copy of `model`'s weights (the fp32 state dict, put once)."""
        return cls(model.state_dict(), engine_cfg, num_engines, weight_version, model.cfg, **kw)

    # -- RolloutBackend ---------------------------------------------------------------------
    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return await asyncio.to_thread(self.generate, requests)

    async def aupdate_weights(self, source: Any, weight_version: str | None = None) -> str:
        return await asyncio.to_thread(self.update_weights, source, weight_version)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        """Shard across the engines, run them concurrently, gather in request order."""
        self._check_open()
        for k, r in enumerate(requests):  # rids must be unique across engines
            r.rid = r.rid or f"ray-{time.monotonic_ns():x}-{k}"
        busy = [(w, chunk) for w, chunk in enumerate(shard(requests, len(self.workers))) if chunk]
        per_worker = self._gather("generate", [self.workers[w].generate.remote(chunk)
                                               for w, chunk in busy], [w for w, _ in busy])
        results: list[GenerationResult] = []
        for (w, chunk), got in zip(busy, per_worker):
            want = [(r.rid, j) for r in chunk for j in range(r.sampling.n)]
            if [(g.rid, g.index) for g in got] != want:
                self._fail(RolloutError(f"{self.infos[w]}: answered {len(got)} results out of "
                                        f"request order (asked {len(want)})"))
            stale = [g for g in got if g.weight_version != self.weight_version]
            if stale:  # workers alive, weights unexpected: a fresh update_weights fixes it
                raise RolloutError(
                    f"{self.infos[w]}: request {stale[0].rid} sample {stale[0].index} was "
                    f"generated with weight version {stale[0].weight_version!r}, expected "
                    f"{self.weight_version!r}")
            results += got
        return results

    def update_weights(self, source: Any, weight_version: str | None = None) -> str:
        """`source`: a model, a state dict (native or HF names) or an HF folder (read here).
        Cast once to the engines' dtypes, put once; each engine loads from the object ref."""
        self._check_open()
        source = as_source(source)  # an iterable of weight buckets: one dict for the put
        if isinstance(source, MoEModel):
            source = source.state_dict()
        elif isinstance(source, (str, Path)):
            source = read_hf_state_dict(source)
        if weight_version is None:
            v = self.weight_version
            weight_version = str(int(v) + 1) if v.isdigit() else v + "+1"
        weight_version = str(weight_version)
        # HF-named tensors are not in the map: shipped as they are, cast by the engine on load.
        ref = ray.put({k: t.detach().to(self.dtypes.get(k, t.dtype)) for k, t in source.items()})
        got = self._gather("update_weights",
                           [w.update_weights.remote(ref, weight_version) for w in self.workers])
        del ref
        for info, v in zip(self.infos, got):
            if v != weight_version:
                self._fail(RolloutError(f"{info}: reports weight version {v!r} after loading "
                                        f"{weight_version!r}"))
        self.weight_version = weight_version
        return weight_version

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Kill the workers and remove the placement group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        release(self.workers, self.pg, self._owns_ray)
        self.workers, self.pg = [], None

    def __enter__(self) -> "RayBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RolloutError("RayBackend is closed (after close() or an earlier worker "
                               "failure); build a new one")

    def _fail(self, err: Exception) -> None:
        self.close()
        raise err

    def _gather(self, what: str, refs: list, workers: list[int] | None = None,
                timeout_s: float | None = None) -> list:
        """Each worker's answer, in order; the first failure (whichever worker it hits first)
        closes the backend and raises an error naming that worker."""
        workers = list(range(len(refs))) if workers is None else workers
        owner = {ref: w for ref, w in zip(refs, workers)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending, got = list(refs), {}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                self._fail(RolloutError(f"{self.infos[owner[pending[0]]]}: no answer to {what} "
                                        f"within {timeout_s:.0f}s"))
            ref = ready[0]
            info = self.infos[owner[ref]]
            try:
                got[ref] = ray.get(ref)
            except RayActorError as e:
                self._fail(RolloutError(f"{info} died during {what}: {_reason(e)}"))
            except RayTaskError as e:
                self._fail(RolloutError(f"{info} failed in {what}: "
                                        f"{type(e.cause).__name__}: {e.cause}"))
        return [got[ref] for ref in refs]


def release(workers: list, pg: PlacementGroup | None, owns_ray: bool) -> None:
    """Tear down what a group of Ray actors holds: kill the actors, remove their placement
    group, and shut Ray down if the caller started it. Safe when actors are already dead or
    another owner (the rollout backend, the actor group) has already shut Ray down."""
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # already dead: nothing left to free
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # Ray already shut down by its other user
            pass
    if owns_ray and ray.is_initialized():
        ray.shutdown()


def _reason(e: RayActorError) -> str:
    """Ray's death message, cut to its first line plus the last line of any traceback in it
    (a constructor's exception)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Ray colours its task names
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"
