"""Ray orchestration of the rollout: N embedded engines as Ray actors, one CPU bundle each in a
placement group, behind the same `RolloutBackend` interface as the in-process engine.

    backend = RayBackend.from_model(model, EngineConfig(dtype="bf16"), num_engines=4)
    results = backend.generate(requests)          # sharded, gathered in request order
    backend.update_weights(buckets, "7")          # each bucket put once, every engine loads it
    backend.close()                               # kills the workers, frees the bundles

Sharding keeps each request (one prompt and its n samples, the GRPO group) on one engine, in
contiguous runs balanced by sample count, so results come back prompt-major, sample minor, as
from `LocalBackend`. Seeded requests give the same tokens, log-probs and routes as the
in-process engine (the engine's per-request seeding makes a sample independent of what else
is in its batch). Every result's weight version is checked against the version last pushed.

Faults. Every request has a unique rid and results are matched by (rid, sample index), so a
sample is returned exactly once whatever happens to the workers. A worker that dies (killed,
crashed, out of memory) or does not answer within `request_timeout_s` (it is then killed) is
recreated in its own bundle, built from the weights of the last push (`_replay`: the object
refs of that push's buckets, see `update_weights`), so it serves the current version; the
requests it had not answered are split over the live workers at once (whole requests: a GRPO
group never straddles two engines), and the restarted worker takes work as soon as it is up.
A call returns only when every worker is up again. Each engine may be restarted
`max_engine_restarts` times per backend; past that the backend closes and a `RolloutError`
names the engine (index, pid, node) and the requests it left unanswered. A call that raised
inside a live worker (a bad request) is not a fault: it closes the backend and propagates, as
does a result with an unexpected weight version (which does not close it: the next
`update_weights` brings every worker to one version again).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError, WorkerCrashedError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lockstep.kernels.threads import worker_env
from lockstep.moe.buckets import Bucket, bucketize, tensor_bytes
from lockstep.moe.checkpoint import hf_state_dict, read_hf_state_dict
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import RolloutBackend, RolloutError
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.types import GenerateRequest, GenerationResult
from lockstep.rollout.weight_sync import as_buckets

# Engines run one torch thread each; OpenMP/MKL pools follow the same env var, and OpenMP
# waits without spinning.
WORKER_ENV = worker_env(1)  # + OMP_WAIT_POLICY (kernels/threads.py)
# What a dead worker process looks like from the driver (the actor itself, or the process
# running its task, was killed or crashed).
WORKER_DIED = (RayActorError, WorkerCrashedError, OutOfMemoryError)


class EngineWorker:
    """One embedded engine in a Ray actor process (wrapped by `ray.remote` in `RayBackend`).

    `source` is an HF folder readable on the worker's node, or a list of object refs of weight
    buckets (each a list of `(name, tensor)`, native or HF names, together the whole model;
    passed nested, so this worker fetches them itself) with `model_cfg`.
    """

    def __init__(self, source: str | list, model_cfg: ModelConfig | None,
                 engine_cfg: EngineConfig, weight_version: str, threads: int = 1):
        torch.set_num_threads(threads)
        self._incoming: dict[str, torch.Tensor] = {}
        self._buckets_in = 0
        if isinstance(source, str):
            self.engine = Engine.from_hf(source, engine_cfg, weight_version)
            return
        if model_cfg is None:
            raise ValueError("EngineWorker: a bucket source needs model_cfg")
        weights = {name: t for bucket in ray.get(list(source)) for name, t in bucket}
        self.engine = Engine(MoEModel(model_cfg), engine_cfg, weight_version)
        self.engine.update_weights(weights, weight_version)

    def info(self) -> dict[str, Any]:
        """Where this worker runs and the dtype each weight is held in, under its native and
        its HF name (for casting pushes on the driver)."""
        model = self.engine.model
        named = {**model.state_dict(), **hf_state_dict(model)}
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "threads": torch.get_num_threads(), "wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "weight_version": self.engine.weight_version,
                "model_cfg": model.cfg, "dtypes": {k: v.dtype for k, v in named.items()}}

    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return self.engine.generate(requests)

    def load_bucket(self, k: int, bucket: Bucket) -> None:
        """Receive bucket k of a push (k == 0 starts a new one); applied by `commit_weights`."""
        if k == 0:
            self._incoming, self._buckets_in = {}, 0
        if k != self._buckets_in:
            raise RolloutError(f"weight push: bucket {k} arrived after {self._buckets_in}")
        self._incoming.update(bucket)
        self._buckets_in += 1

    def commit_weights(self, weight_version: str, num_buckets: int) -> str:
        """Load the `num_buckets` buckets received (validate, then swap: a bad push leaves the
        engine as it was); returns the new version."""
        weights, got = self._incoming, self._buckets_in
        self._incoming, self._buckets_in = {}, 0
        if got != num_buckets:
            raise RolloutError(f"weight push {weight_version!r}: received {got} of "
                               f"{num_buckets} buckets")
        return self.engine.update_weights(weights, weight_version)

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
    wait_policy: str | None = None
    """The worker's OMP_WAIT_POLICY (kernels/threads.py)."""
    restarts: int = 0
    """Times this engine was restarted (dead or hung) in this backend."""
    samples: int = 0
    """Samples this engine (any of its incarnations) has answered."""

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


@dataclass
class _Call:
    """One call in flight on worker `w`: `item` is what to hand out again if it dies."""

    w: int
    item: Any
    deadline: float
    starting: bool = False  # the call is a restarted worker's `info()`


class RayBackend(RolloutBackend):
    """Rollout over `num_engines` embedded engines running as Ray actors.

    Joins the running Ray cluster (or `address`; starts a local one when there is none), puts
    one `{"CPU": cpus_per_engine}` bundle per engine in a placement group (`strategy` PACK:
    one node while it fits) and starts an `EngineWorker` in each bundle. `request_timeout_s`
    and `max_engine_restarts` are the rollout section's fault settings (module docstring).
    """

    def __init__(self, source: str | Path | MoEModel | dict[str, torch.Tensor],
                 engine_cfg: EngineConfig, num_engines: int, weight_version: str = "0",
                 model_cfg: ModelConfig | None = None, address: str | None = None,
                 cpus_per_engine: float = 1.0, strategy: str = "PACK",
                 threads_per_engine: int = 1, startup_timeout_s: float = 300.0,
                 name: str = "lockstep-engine", request_timeout_s: float = 600.0,
                 max_engine_restarts: int = 3, bucket_bytes: int = 1 << 28):
        if not (isinstance(num_engines, int) and num_engines >= 1):
            raise ValueError(f"RayBackend: num_engines must be a positive integer, "
                             f"got {num_engines!r}")
        if not request_timeout_s > 0:
            raise ValueError(f"RayBackend: request_timeout_s must be > 0, got {request_timeout_s!r}")
        if not (isinstance(max_engine_restarts, int) and max_engine_restarts >= 0):
            raise ValueError(f"RayBackend: max_engine_restarts must be an integer >= 0, "
                             f"got {max_engine_restarts!r}")
        if isinstance(source, MoEModel):
            source, model_cfg = source.state_dict(), source.cfg
        if isinstance(source, dict) and model_cfg is None:
            raise ValueError("RayBackend: a state-dict source needs model_cfg")
        self.weight_version = str(weight_version)
        self.workers: list[Any] = []
        self.infos = [WorkerInfo(i, f"{name}-{i}") for i in range(num_engines)]
        self.dtypes: dict[str, torch.dtype] = {}
        self.model_cfg, self.engine_cfg, self.threads = model_cfg, engine_cfg, threads_per_engine
        self.cpus_per_engine, self.startup_timeout_s = cpus_per_engine, startup_timeout_s
        self.request_timeout_s, self.max_engine_restarts = request_timeout_s, max_engine_restarts
        self.bucket_bytes = bucket_bytes
        self.last_push: dict = {}  # {"mode", "bytes", "seconds", "buckets"} of the last push
        self.closed = False
        self._lock = threading.Lock()
        self._env = worker_env(threads_per_engine)  # + OMP_WAIT_POLICY (kernels/threads.py)
        # an engine on CUDA gets a GPU of its own (Ray shows it as device 0 to the worker)
        self.gpus = gpus = 1.0 if engine_cfg.device.startswith("cuda") else 0.0
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, runtime_env={"env_vars": self._env})
        self.pg: PlacementGroup | None = None
        self._remote_cls = ray.remote(EngineWorker)
        try:
            bundle = {"CPU": cpus_per_engine, **({"GPU": gpus} if gpus else {})}
            self.pg = placement_group([bundle] * num_engines, strategy=strategy,
                                      name=f"{name}-{os.getpid()}-{id(self):x}")
            if not self.pg.wait(startup_timeout_s):
                raise RolloutError(
                    f"RayBackend: could not reserve {num_engines} bundles {bundle} "
                    f"({strategy}) within {startup_timeout_s:.0f}s; the cluster has "
                    f"{ray.available_resources().get('CPU', 0)} CPUs free of "
                    f"{ray.cluster_resources().get('CPU', 0)}")
            # What a restarted worker is built from: the source until the first push, then the
            # refs of the last push's buckets (each put once; every worker resolves the same).
            self._replay: str | list = (str(source) if isinstance(source, (str, Path)) else
                                        [ray.put(b) for b in bucketize(source.items(),
                                                                       bucket_bytes)])
            self.workers = [self._spawn(i, self._replay, self.weight_version)
                            for i in range(num_engines)]
            for info, got in zip(self.infos, self._gather("start", [
                    w.info.remote() for w in self.workers], timeout_s=startup_timeout_s)):
                self._learn(info, got)
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
        """Shard across the engines, run them concurrently, gather in request order (a dead or
        hung worker's requests run again elsewhere; see the module docstring). Calls from
        several threads run one at a time (a push waits for the generate in flight)."""
        with self._lock:
            return self._generate(requests)

    def _generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        self._check_open()
        seen: set[str] = set()
        for k, r in enumerate(requests):  # rids must be unique across engines
            r.rid = r.rid or f"ray-{time.monotonic_ns():x}-{k}"
            if r.rid in seen:
                raise RolloutError(f"RayBackend.generate: request {k} repeats rid {r.rid!r}; "
                                   f"results are matched by (rid, sample index)")
            seen.add(r.rid)
        done: dict[tuple[str, int], GenerationResult] = {}
        stale: list[tuple[int, GenerationResult]] = []

        def accept(w: int, chunk: list[GenerateRequest], got: list[GenerationResult]) -> None:
            want = [(r.rid, j) for r in chunk for j in range(r.sampling.n)]
            if [(g.rid, g.index) for g in got] != want:
                self._fail(RolloutError(f"{self.infos[w]}: answered {len(got)} results out of "
                                        f"request order (asked {len(want)})"))
            for g in got:
                if (g.rid, g.index) in done:
                    self._fail(RolloutError(f"{self.infos[w]}: request {g.rid} sample "
                                            f"{g.index} came back twice"))
                done[g.rid, g.index] = g
                self.infos[w].samples += 1
                if g.weight_version != self.weight_version:
                    stale.append((w, g))

        chunks = deque(c for c in shard(requests, len(self.workers)) if c)
        self._drive("generate", chunks, {}, self._replay, self.weight_version,
                    lambda w, chunk: self.workers[w].generate.remote(chunk), accept)
        if stale:  # workers alive, weights unexpected: a fresh update_weights fixes it
            w, g = stale[0]
            raise RolloutError(f"{self.infos[w]}: request {g.rid} sample {g.index} was "
                               f"generated with weight version {g.weight_version!r}, expected "
                               f"{self.weight_version!r}")
        want = [(r.rid, j) for r in requests for j in range(r.sampling.n)]
        missing = [k for k in want if k not in done]
        if missing:
            self._fail(RolloutError(f"RayBackend.generate: {len(missing)} sample(s) never came "
                                    f"back, e.g. request {missing[0][0]} sample {missing[0][1]}"))
        return [done[k] for k in want]

    def update_weights(self, source: Any, weight_version: str | None = None) -> str:
        """`source`: an iterable of buckets (lists of `(name, tensor)`, consumed once, in
        order), a model, a state dict (native or HF names) or an HF folder (read here).

        Each bucket is cast to the engines' dtypes and put once, and every worker fetches it
        as soon as it is put; the driver never holds more than one bucket. The refs are kept
        until the next push: a worker restarted before then is built from them, at this
        version (one copy of the weights in the engines' dtypes in the object store, which Ray
        may spill to disk; nothing on the driver's heap; during a push, the old and the new)."""
        with self._lock:
            return self._update_weights(source, weight_version)

    def _update_weights(self, source: Any, weight_version: str | None) -> str:
        self._check_open()
        if weight_version is None:
            v = self.weight_version
            weight_version = str(int(v) + 1) if v.isdigit() else v + "+1"
        weight_version = str(weight_version)
        t0, nbytes, refs = time.perf_counter(), 0, []
        for bucket in _buckets(source, self.bucket_bytes):
            # a name the engines do not hold ships as it is (the engine casts or refuses it)
            cast = [(k, t.detach().to(self.dtypes.get(k, t.dtype))) for k, t in bucket]
            nbytes += sum(tensor_bytes(t) for _, t in cast)
            ref = ray.put(cast)
            del cast, bucket
            for w in self.workers:  # the answers come with commit_weights (calls run in order)
                w.load_bucket.remote(len(refs), ref)
            refs.append(ref)
        deadline = time.monotonic() + self.request_timeout_s
        calls = {w.commit_weights.remote(weight_version, len(refs)): _Call(i, None, deadline)
                 for i, w in enumerate(self.workers)}

        def accept(w: int, _: Any, got: str) -> None:
            if got != weight_version:
                self._fail(RolloutError(f"{self.infos[w]}: reports weight version {got!r} "
                                        f"after loading {weight_version!r}"))

        self._drive("update_weights", deque(), calls, refs, weight_version, None, accept)
        self._replay, self.weight_version = refs, weight_version
        self.last_push = {"mode": "object_store", "bytes": nbytes, "buckets": len(refs),
                          "seconds": time.perf_counter() - t0}
        return weight_version

    # -- faults -----------------------------------------------------------------------------
    def _drive(self, what: str, todo: deque, calls: dict, replay: str | list, version: str,
               submit: Callable[[int, Any], Any] | None,
               accept: Callable[[int, Any, Any], None]) -> None:
        """Run `todo` items (each `submit`ted to one idle worker) and the `calls` already in
        flight to completion, restarting workers that die or hang (built from `replay` at
        `version`) and handing their unanswered items to live workers. Returns when every
        call was answered and every worker is up."""
        busy = {c.w for c in calls.values()}
        idle = [w for w in range(len(self.workers)) if w not in busy]
        while todo or calls:
            while todo and idle and submit is not None:
                w, item = idle.pop(0), todo.popleft()
                calls[submit(w, item)] = _Call(w, item, time.monotonic() + self.request_timeout_s)
            if not calls:  # nobody to run the rest: every worker died and none is coming back
                self._fail(RolloutError(f"RayBackend: {what} has {len(todo)} unanswered "
                                        f"item(s) and no live engine worker"))
            left = max(0.0, min(c.deadline for c in calls.values()) - time.monotonic())
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=left)
            if not ready:  # the earliest deadline passed: that worker is hung
                ref = min(calls, key=lambda r: calls[r].deadline)
                c = calls.pop(ref)
                limit = self.startup_timeout_s if c.starting else self.request_timeout_s
                self._lost(what, c, f"did not answer within {limit:g}s and was killed",
                           calls, todo, idle, replay, version)
                continue
            c = calls.pop(ready[0])
            try:
                got = ray.get(ready[0])
            except WORKER_DIED as e:
                self._lost(what, c, f"died ({_reason(e)})", calls, todo, idle, replay, version)
                continue
            except RayTaskError as e:
                self._fail(RolloutError(f"{self.infos[c.w]} failed in "
                                        f"{'restart' if c.starting else what}: "
                                        f"{type(e.cause).__name__}: {e.cause}"))
            if c.starting:
                self._learn(self.infos[c.w], got)
                if got["weight_version"] != version:
                    self._fail(RolloutError(f"{self.infos[c.w]}: restarted at weight version "
                                            f"{got['weight_version']!r}, expected {version!r}"))
            else:
                accept(c.w, c.item, got)
            idle.append(c.w)

    def _lost(self, what: str, c: _Call, how: str, calls: dict, todo: deque, idle: list,
              replay: str | list, version: str) -> None:
        """Worker `c.w` is gone: requeue its item over the live workers and restart it in its
        bundle, or fail when it has used up its restarts."""
        info = self.infos[c.w]
        items = [] if c.item is None else [c.item]
        if info.restarts >= self.max_engine_restarts:
            rids = sorted({r.rid for item in items for r in item})
            self._fail(RolloutError(
                f"{info} {how} during {'restart' if c.starting else what}; restarted "
                f"{info.restarts} time(s) already (rollout.max_engine_restarts="
                f"{self.max_engine_restarts}); unanswered requests: {rids}"))
        live = len(idle) + sum(not k.starting for k in calls.values())
        for item in items:  # split over the workers that can take it now
            todo.extend(piece for piece in shard(item, max(1, live)) if piece)
        info.restarts += 1
        info.pid, info.node = -1, "?"
        try:  # dead already, or hung: free its bundle for the new one
            ray.kill(self.workers[c.w], no_restart=True)
        except Exception:
            pass
        self.workers[c.w] = self._spawn(c.w, replay, version)
        calls[self.workers[c.w].info.remote()] = _Call(
            c.w, None, time.monotonic() + self.startup_timeout_s, starting=True)

    def _spawn(self, w: int, source: str | list, version: str) -> Any:
        """A new worker in bundle `w`, built from `source` at `version` (no Ray restarts: a
        dead worker is replaced here, from the weights of the last push)."""
        return self._remote_cls.options(
            num_cpus=self.cpus_per_engine, num_gpus=self.gpus, max_restarts=0,
            runtime_env={"env_vars": self._env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=w),
        ).remote(source, self.model_cfg, self.engine_cfg, version, self.threads)

    def _learn(self, info: WorkerInfo, got: dict) -> None:
        info.pid, info.node, info.threads = got["pid"], got["node"], got["threads"]
        info.wait_policy = got["wait_policy"]
        self.dtypes, self.model_cfg = got["dtypes"], self.model_cfg or got["model_cfg"]

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Kill the workers and remove the placement group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        release(self.workers, self.pg, self._owns_ray)
        self.workers, self.pg, self._replay = [], None, []

    def __enter__(self) -> "RayBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RolloutError("RayBackend is closed (after close() or an engine worker "
                               "that could not be recovered); build a new one")

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
            except WORKER_DIED as e:
                self._fail(RolloutError(f"{info} died during {what}: {_reason(e)}"))
            except RayTaskError as e:
                self._fail(RolloutError(f"{info} failed in {what}: "
                                        f"{type(e.cause).__name__}: {e.cause}"))
        return [got[ref] for ref in refs]


def _buckets(source: Any, bucket_bytes: int) -> Iterable[Bucket]:
    """Any weight source as buckets (`as_buckets`, plus HF folders and native-named state
    dicts); an iterable of buckets passes through, consumed once."""
    if isinstance(source, (str, Path)):
        source = read_hf_state_dict(source)
    if isinstance(source, dict) and not any(k.startswith("model.") for k in source):
        return bucketize(((k, t.detach()) for k, t in source.items()), bucket_bytes)  # native
    return as_buckets(source, bucket_bytes)


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
