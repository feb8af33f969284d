"""The rollout fleet: M SGLang-wire servers (ours or real SGLang) as Ray actors, or servers
that are already running, behind one balancing client that survives dead and hung engines.

    fleet = Fleet.serve(model, EngineConfig(dtype="bf16"), num_engines=2)   # lockstep serve x M
    fleet = Fleet.sglang(options, model_path, num_engines=2)                 # real SGLang x M
    fleet = Fleet.http(["http://10.0.0.5:30000", ...], model_cfg)            # running servers
    results = fleet.generate(requests)      # least-loaded dispatch; a request's n samples on one engine
    fleet.update_weights(weights, "7")      # /update_weights_from_distributed (or _from_disk)
    fleet.close()

Dispatch. A request (one prompt and its n samples: the GRPO group) goes to the live engine
with the fewest samples in flight, and all of it stays there (one prefill, prefix cache),
also when it is fanned out into n single-sample requests (sampling-mask requests, or
`fan_out_samples`). Every request carries its rid; results are keyed by (rid, sample index).

Faults. A POST that cannot connect, loses its connection, or gets no answer within
`request_timeout_s` marks its engine dead: the engine's other requests are cancelled, every
unfinished request of it is sent again, whole, to a live engine, and answers already held for
a (rid, index) are kept (a resent group's duplicates are dropped), so every sample comes back
exactly once. The dead engine's Ray actor is killed and relaunched in its bundle (at most
`max_engine_restarts` times per engine); the new server joins the weight sync at the next
push and serves only once it holds the pushed weights. Servers given by URL cannot be
relaunched: a dead one is probed again (`/health`) at each push and rejoins when it answers.

Weight sync. `distributed`: every engine joins one torch.distributed group with the trainer
as rank 0 (`rollout.weight_sync.DistributedWeightSync`: SGLang's /init_weights_update_group and
/update_weights_from_distributed, gloo on CPU, NCCL on GPUs); the group is re-created whenever
the set of engines changes (a relaunch). `disk`: the weights are written once as an HF folder
under `weights_dir` and every engine loads it (/update_weights_from_disk).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import torch

from lockstep.kernels.threads import worker_env
from lockstep.moe.buckets import bucketize
from lockstep.moe.checkpoint import hf_state_dict, save_hf_state_dict
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import EngineDown, HTTPBackend, RolloutBackend, RolloutError
from lockstep.rollout.types import PushRefused
from lockstep.rollout.colocate import SERVER_SHARE, colocates_fleet, engine_bundles
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.types import GenerateRequest, GenerationResult

WORKER_ENV = worker_env(1)  # + OMP_WAIT_POLICY (kernels/threads.py)
_START_GRACE_S = 30.0  # beyond the start-up timeout, for a Ray worker process to start
_UNLOADED = "unloaded"  # version of a relaunched server before its first push (never served)


class FleetError(RolloutError):
    """The fleet cannot go on: no live engine left, restarts used up, or a launch failed."""


class _Aborted(RolloutError):
    """A sample came back aborted (someone aborted it on a live server): send the group again."""


# -- the Ray actors ------------------------------------------------------------------------------
class ServerWorker:
    """Our embedded engine behind our SGLang-wire HTTP server, in a Ray actor process (what
    `lockstep serve` runs). `source`: an HF folder on the worker's node, a native state dict
    (an object ref Ray resolves) with `model_cfg`, or None: random weights with version
    "unloaded", for a relaunched server that gets the current weights pushed before serving."""

    def __init__(self, source: str | dict[str, torch.Tensor] | None, model_cfg: ModelConfig,
                 engine_cfg: EngineConfig, weight_version: str, api_key: str | None,
                 threads: int = 1):
        import ray

        from lockstep.rollout.server import ServerThread
        torch.set_num_threads(threads)
        if isinstance(source, str):
            engine = Engine.from_hf(source, engine_cfg, weight_version)
        else:
            model = MoEModel(model_cfg)
            if source is not None:
                model.load_state_dict(source, strict=True)
            engine = Engine(model, engine_cfg, weight_version if source is not None else _UNLOADED)
        self.node = ray.get_runtime_context().get_node_id()
        self.server = ServerThread(engine, host=_node_ip(), port=0, api_key=api_key).start()

    def info(self) -> dict[str, Any]:
        return {"url": self.server.url, "pid": os.getpid(), "node": self.node}

    def stop(self) -> None:
        self.server.stop()


class SGLangWorker:
    """A real SGLang server launched from a Ray actor (its GPUs, or CPUs, are the actor's
    bundle). Needs the `sglang` package in the configured interpreter (`options["python"]`);
    refused with a clear message otherwise. `host`: "loopback" (127.0.0.1) or "node" (the Ray
    node's IP)."""

    def __init__(self, options: dict[str, Any], model_path: str, weight_version: str,
                 api_key: str | None, log_dir: str | None = None, host: str = "node",
                 startup_timeout_s: float = 900.0):
        import ray

        from lockstep.rollout.sglang import SGLangServer
        require_sglang(options.get("python"), options.get("extra_env"))
        cfg = sglang_config(options, model_path, "127.0.0.1" if host == "loopback" else
                            _node_ip(), _free_port(), weight_version, api_key)
        self.node = ray.get_runtime_context().get_node_id()
        log = None if log_dir is None else os.path.join(log_dir, f"sglang-{cfg.port}.log")
        self.server = SGLangServer(cfg, log_path=log, die_with_parent=True).start(
            float(startup_timeout_s))

    def info(self) -> dict[str, Any]:
        return {"url": self.server.cfg.url, "pid": self.server.proc.pid, "node": self.node}

    def stop(self) -> None:
        self.server.stop()


def require_sglang(python: str | None = None, extra_env: dict[str, str] | None = None) -> None:
    """Refuse (one line, naming the interpreter) unless `python` (rollout.sglang.python; None =
    this interpreter) runs and can import-find `sglang` with `extra_env` set."""
    exe = python or sys.executable
    which = (f"rollout.sglang.python={exe}" if python else
             f"lockstep's own interpreter ({exe}; rollout.sglang.python is unset)")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        rc = subprocess.run([exe, "-c", probe], env={**os.environ, **(extra_env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FleetError(f"rollout.backend=sglang: cannot run {which}: {e}") from None
    if rc != 0:
        raise FleetError(f"rollout.backend=sglang needs SGLang installed in the interpreter "
                         f"that runs the servers: no `sglang` package in {which}; set "
                         f"rollout.sglang.python to SGLang's venv (GPU: pip install "
                         f"'lockstep[gpu]'; CPU tests: tests/sglang_cpu/install.sh), or use "
                         f"rollout.backend=serve (lockstep's own SGLang-wire servers)")


def sglang_config(options: dict[str, Any] | None, model_path: str, host: str, port: int,
                  weight_version: str | None = None, api_key: str | None = None):
    """The `SGLangConfig` one fleet server is launched with: `rollout.sglang` options (the
    SGLangConfig fields: tp_size, ep_size, dtype, enable_fp32_lm_head, ...) plus what the fleet
    decides per server (model, host, port, weight version, key)."""
    from lockstep.rollout.sglang import SGLangConfig
    from lockstep.rollout.sglang_options import FLEET_KEYS
    opts = {k: v for k, v in (options or {}).items() if k not in FLEET_KEYS}
    fixed = {"model_path": model_path, "host": host, "port": port, "api_key": api_key,
             "weight_version": weight_version}
    clash = sorted(k for k in ("model_path", "host", "port", "api_key") if k in opts)
    if clash:
        raise ValueError(f"rollout.sglang.{clash[0]}: set by the fleet for each server "
                         f"(model from the run, a free port on the actor's node); leave it out")
    return SGLangConfig.from_dict({**opts, **fixed})


def _node_ip() -> str:
    import ray.util
    return ray.util.get_node_ip_address()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# -- one engine of the fleet ---------------------------------------------------------------------
@dataclass
class EngineSlot:
    """What the client knows of one engine: its server, its Ray actor, its state."""

    index: int
    url: str = ""
    pid: int = -1
    node: str = "?"
    actor: Any = None
    client: HTTPBackend | None = None
    state: str = "starting"  # live | joining (relaunched, no weights yet) | dead | gone
    restarts: int = 0
    load: int = 0  # samples in flight
    last_error: str = ""

    def __str__(self) -> str:
        return f"engine {self.index} ({self.url or 'starting'}, pid {self.pid}, {self.state})"


@dataclass
class _Group:
    """One request (a prompt and its n samples) and the wire requests it is sent as."""

    pos: int
    req: GenerateRequest
    wire: list[tuple[int, GenerateRequest]]  # (first sample index, HTTP request): one
    # n-sample request, or n single-sample ones
    tries: int = 0

    @property
    def samples(self) -> int:
        return self.req.sampling.n


@dataclass
class FleetStats:
    retried_groups: int = 0
    duplicates_dropped: int = 0
    engines_marked_dead: int = 0
    relaunches: int = 0
    pushes: int = 0
    push_seconds: float = 0.0
    push_bytes: int = 0          # bytes sent to the engines by the last push
    disk_bytes_written: int = 0  # weight folders this fleet wrote for weight sync, in total
    events: list[str] = field(default_factory=list)


class Fleet(RolloutBackend):
    """M SGLang-wire engines behind one balancing, fault-tolerant client (module doc).

    `launch(i)` (None for servers given by URL) starts engine i's Ray actor and returns
    (actor, info dict with url/pid/node); `pg` is the placement group they live in.
    """

    def __init__(self, slots: list[EngineSlot], model_cfg: ModelConfig, *,
                 launch: Callable[[int], tuple[Any, dict]] | None = None, pg: Any = None,
                 owns_pg: bool = True, owns_ray: bool = False, weight_version: str = "0",
                 api_key: str | None = None,
                 weight_sync: str = "distributed", weights_dir: str | Path | None = None,
                 request_timeout_s: float = 600.0, max_engine_restarts: int = 3,
                 max_concurrency: int = 64, fan_out_samples: bool = False,
                 sampling_mask_max_tokens: int = 4096, bucket_bytes: int = 64 << 20,
                 startup_timeout_s: float = 300.0, colocate: bool = False,
                 log: Callable[[str], None] | None = None):
        if weight_sync not in ("auto", "distributed", "disk"):
            raise ValueError(f"Fleet: weight_sync must be 'auto', 'distributed' or 'disk', got "
                             f"{weight_sync!r}")
        if weight_sync in ("auto", "disk") and weights_dir is None:
            raise ValueError(f"Fleet: weight_sync={weight_sync!r} needs weights_dir (a folder "
                             f"every server can read)")
        self.slots, self.cfg, self._launch, self.pg = slots, model_cfg, launch, pg
        self._owns_ray, self._owns_pg = owns_ray, owns_pg
        self.weight_version = str(weight_version)
        self.api_key = api_key
        # auto: distributed, and disk for good once a push is refused before any weight changed
        self.weight_sync = "distributed" if weight_sync == "auto" else weight_sync
        self.auto_sync = weight_sync == "auto"
        self.weights_dir = None if weights_dir is None else Path(weights_dir)
        self._timeout_s = float(request_timeout_s)
        self.max_engine_restarts = int(max_engine_restarts)
        self.startup_timeout_s = float(startup_timeout_s)
        self.max_concurrency = max_concurrency
        self.fan_out_samples = fan_out_samples
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self.bucket_bytes = bucket_bytes
        self.log = log or (lambda s: None)
        self.colocate = colocate
        self._released: set[str] = set()  # memory tags released on the servers (colocate)
        self._refusals: dict[str, str | None] = {}  # url -> why it takes no release/resume
        self.stats = FleetStats()
        self.placement: dict[tuple[str, int], int] = {}  # (rid, index) -> engine, last generate
        self._sync = None  # DistributedWeightSync over the engines in `_sync_urls`
        self._sync_urls: list[str] = []
        self._last_folder: Path | None = None
        self.closed = False
        for s in slots:
            if s.url and s.client is None:
                s.client = self._client(s.url)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def serve(cls, source: MoEModel | str | Path, engine_cfg: EngineConfig, num_engines: int,
              weight_version: str = "0", *, model_cfg: ModelConfig | None = None,
              address: str | None = None, cpus_per_engine: float = 1.0, gpus_per_engine: float = 0,
              threads_per_engine: int = 1, startup_timeout_s: float = 300.0,
              colocate_in: tuple[Any, list[int]] | None = None, **kw: Any) -> "Fleet":
        """`num_engines` embedded engines behind our SGLang-wire servers, one Ray actor each,
        one `{CPU: cpus_per_engine[, GPU: gpus_per_engine]}` bundle each in a placement group.
        `source`: a model (its fp32 state dict is put in the object store once, for start-up
        only) or an HF folder every node can read. `colocate_in=(pg, bundles)`: no placement
        group of its own; engine i runs in bundle `bundles[i]` of `pg` (the actor group's) with
        `colocate.SERVER_SHARE` of its CPU (and GPU when `gpus_per_engine`)."""
        import ray
        if isinstance(source, MoEModel):
            model_cfg, src = source.cfg, None
            state = source.state_dict()
        else:
            src, state = str(source), None
            model_cfg = model_cfg or ModelConfig.from_json(Path(src) / "config.json")
        api_key = kw.pop("api_key", None) or secrets.token_hex(16)
        owns = _init_ray(address)
        if colocate_in is not None:
            pg, bundles = _shared_bundles(colocate_in, num_engines)
            cpus_per_engine, gpus_per_engine = SERVER_SHARE, SERVER_SHARE if gpus_per_engine else 0
        else:
            pg, bundles = _placement(num_engines, cpus_per_engine, gpus_per_engine,
                                     startup_timeout_s, "lockstep-serve"), list(range(num_engines))
        # start-up weights: put once, dropped once every server holds them (no copy kept)
        start = {"ref": ray.put(state)} if state is not None else {}
        remote = ray.remote(ServerWorker)

        def launch(i: int, first: bool = False) -> tuple[Any, dict]:
            # a relaunch starts from random weights and is pushed the current ones before serving
            source_i = start.get("ref") if first and state is not None else src
            actor = remote.options(
                num_cpus=cpus_per_engine, num_gpus=gpus_per_engine, max_restarts=0,
                runtime_env={"env_vars": WORKER_ENV},
                scheduling_strategy=_in_bundle(pg, bundles[i])).remote(
                source_i, model_cfg, engine_cfg, str(weight_version), api_key, threads_per_engine)
            return actor, actor.info

        return _start(cls, num_engines, launch, pg, owns, model_cfg, weight_version, api_key,
                      startup_timeout_s, kw, drop=start.clear, owns_pg=colocate_in is None)

    @classmethod
    def sglang(cls, options: dict[str, Any] | None, model_path: str, num_engines: int,
               model_cfg: ModelConfig, weight_version: str = "0", *, address: str | None = None,
               cpus_per_engine: float = 1.0, startup_timeout_s: float = 900.0,
               log_dir: str | None = None, colocate_in: tuple[Any, list[int]] | None = None,
               **kw: Any) -> "Fleet":
        """`num_engines` real SGLang servers, one Ray actor each with a `{GPU: tp_size}` bundle,
        or `{CPU: tp_size}` with `options["device"] == "cpu"` (`options`: the `rollout.sglang`
        section, SGLangConfig fields plus `bind` and `startup_timeout_s`, which bounds the
        bundle wait and each server's start). `colocate_in=(pg, bundles)`: in the actor group's
        bundles instead, with `colocate.SERVER_SHARE` of a bundle's CPU and GPU each (tp_size 1,
        GPUs only)."""
        import ray
        opts = dict(options or {})
        startup_timeout_s = float(opts.pop("startup_timeout_s", startup_timeout_s))
        bind = opts.pop("bind", "auto")
        # on the driver too: fail before reserving anything
        require_sglang(opts.get("python"), opts.get("extra_env"))
        sglang_config(opts, model_path, "127.0.0.1", 30000)  # options checked before launching
        tp, cpu = int(opts.get("tp_size", 1)), opts.get("device", "cuda") == "cpu"
        if cpu and (colocate_in is not None or kw.get("colocate")):
            raise FleetError("colocated SGLang servers on CPU: SGLang's /release_memory_occupation "
                             "calls torch.cuda.synchronize and kills a CPU server; use "
                             "cluster.placement=disaggregated (or GPUs)")
        api_key = kw.pop("api_key", None) or secrets.token_hex(16)
        owns = _init_ray(address)
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        if bind == "loopback" and nodes > 1:
            raise FleetError(f"rollout.sglang.bind=loopback: the servers listen on 127.0.0.1, "
                             f"which the trainer reaches only on its own machine; this Ray "
                             f"cluster has {nodes} nodes: use bind=node (or auto)")
        host = "loopback" if bind == "loopback" or (bind == "auto" and nodes == 1) else "node"
        gpus = 0 if cpu else tp
        if cpu:
            cpus_per_engine = max(cpus_per_engine, float(tp))
        if colocate_in is not None:
            if gpus != 1:
                raise FleetError(f"colocated SGLang servers take one GPU each (the bundle of one "
                                 f"actor rank); rollout.sglang.tp_size={gpus}")
            pg, bundles = _shared_bundles(colocate_in, num_engines)
            cpus_per_engine, gpus = SERVER_SHARE, SERVER_SHARE
        else:
            try:
                pg = _placement(num_engines, cpus_per_engine, gpus, startup_timeout_s,
                                "lockstep-sglang")
            except FleetError as e:
                if owns:
                    ray.shutdown()
                raise FleetError(f"SGLang servers: {e} (rollout.sglang.startup_timeout_s="
                                 f"{startup_timeout_s:g})") from None
            bundles = list(range(num_engines))
        remote = ray.remote(SGLangWorker)

        def launch(i: int, first: bool = False) -> tuple[Any, dict]:
            actor = remote.options(
                num_cpus=cpus_per_engine, num_gpus=gpus, max_restarts=0,
                scheduling_strategy=_in_bundle(pg, bundles[i])).remote(
                opts, model_path, str(weight_version) if first else _UNLOADED, api_key, log_dir,
                host, startup_timeout_s)
            return actor, actor.info

        return _start(cls, num_engines, launch, pg, owns, model_cfg, weight_version, api_key,
                      startup_timeout_s, kw, drop=lambda: None, owns_pg=colocate_in is None)

    @classmethod
    def http(cls, urls: list[str], model_cfg: ModelConfig, **kw: Any) -> "Fleet":
        """Servers that are already running (`rollout.urls`); they are not relaunched."""
        if not urls:
            raise ValueError("Fleet.http: rollout.urls is empty")
        slots = [EngineSlot(i, url=u.rstrip("/"), state="live") for i, u in enumerate(urls)]
        return cls(slots, model_cfg, weight_version=kw.pop("weight_version", "unknown"), **kw)

    @property
    def request_timeout_s(self) -> float:
        """Seconds a request or push may go unanswered before its engine is marked dead."""
        return self._timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, seconds: float) -> None:
        self._timeout_s = float(seconds)
        for s in self.slots:
            if s.client is not None:
                s.client.timeout = aiohttp.ClientTimeout(total=self._timeout_s)

    def _client(self, url: str) -> HTTPBackend:
        return HTTPBackend(url, self.cfg, api_key=self.api_key,
                           max_concurrency=self.max_concurrency,
                           timeout_s=self.request_timeout_s, retries=1, backoff_s=0.2,
                           sampling_mask_max_tokens=self.sampling_mask_max_tokens,
                           fan_out_samples=self.fan_out_samples)

    # -- generate --------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        return asyncio.run(self.agenerate(requests))

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerationResult]:
        self._check_open()
        if not any(s.state == "live" for s in self.slots):
            await asyncio.to_thread(self._revive)
        prefix = uuid.uuid4().hex[:8]
        for k, r in enumerate(requests):  # rids must be unique across engines and retries
            r.rid = r.rid or f"fleet-{prefix}-{k}"
        seen: set[str] = set()
        for r in requests:
            if r.rid in seen:
                raise RolloutError(f"two requests share rid {r.rid!r}: results are matched by "
                                   f"(rid, sample index), so rids must be unique")
            seen.add(r.rid)
        if self._released:  # colocated: take the memory back before generating
            await asyncio.to_thread(self.resume_memory)
        groups = [_Group(k, r, self._wire(r)) for k, r in enumerate(requests)]
        store: dict[tuple[str, int], GenerationResult] = {}
        self.placement = {}
        sessions: dict[int, aiohttp.ClientSession] = {}
        queue = collections.deque(groups)
        tasks: dict[asyncio.Task, tuple[_Group, EngineSlot]] = {}
        try:
            while queue or tasks:
                while queue:
                    g = queue.popleft()
                    slot = self._pick()
                    if slot.index not in sessions:
                        sessions[slot.index] = aiohttp.ClientSession(
                            timeout=slot.client.timeout,
                            connector=aiohttp.TCPConnector(limit=self.max_concurrency))
                    slot.load += g.samples
                    t = asyncio.ensure_future(self._run_group(g, slot, sessions[slot.index], store))
                    tasks[t] = (g, slot)
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    g, slot = tasks.pop(t)
                    slot.load -= g.samples
                    if t.cancelled():  # its engine died under another request: send it again
                        self._retry(g, queue, slot)
                        continue
                    err = t.exception()
                    if err is None:
                        continue
                    if isinstance(err, _Aborted):  # the engine is fine: just send it again
                        self._retry(g, queue, slot)
                        continue
                    if not isinstance(err, EngineDown):
                        raise err
                    if slot.state == "live":
                        self._mark_dead(slot, str(err))
                        for t2, (_, s2) in tasks.items():
                            if s2 is slot:
                                t2.cancel()
                    self._retry(g, queue, slot)
        finally:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for s in sessions.values():
                await s.close()
        want = [(r.rid, j) for r in requests for j in range(r.sampling.n)]
        missing = [k for k in want if k not in store]
        extra = sorted(set(store) - set(want))
        if missing or extra:
            raise RolloutError(f"fleet: results do not match the requests: missing (rid, index) "
                               f"{missing[:5]}, unexpected {extra[:5]}")
        if self.colocate:  # the actor's phase comes next: give the accelerator back
            await asyncio.to_thread(self.release_memory)
        return [store[k] for k in want]

    def _wire(self, req: GenerateRequest) -> list[tuple[int, GenerateRequest]]:
        """The HTTP requests one request is sent as, each with the index of its first sample:
        fanned out into single-sample requests with seeds seed + j like HTTPBackend does (for
        sampling-mask requests, which SGLang fails with n > 1, or with `fan_out_samples`)."""
        if req.sampling.n > 1 and (req.return_sampling_mask or self.fan_out_samples):
            base, sp = req.rid, req.sampling
            return [(j, dataclasses.replace(req, rid=f"{base}-{j}", sampling=dataclasses.replace(
                sp, n=1, seed=None if sp.seed is None else sp.seed + j))) for j in range(sp.n)]
        return [(0, req)]

    def _pick(self) -> EngineSlot:
        """The live engine with the fewest samples in flight (lowest index on ties)."""
        live = [s for s in self.slots if s.state == "live"]
        if not live:
            raise FleetError("no live rollout engine left: " + "; ".join(
                f"{s}: {s.last_error[:200]}" for s in self.slots))
        return min(live, key=lambda s: (s.load, s.index))

    def _retry(self, g: _Group, queue: collections.deque, slot: EngineSlot) -> None:
        g.tries += 1
        if g.tries > len(self.slots) * (self.max_engine_restarts + 1):
            raise FleetError(f"request {g.req.rid}: sent {g.tries} times, never answered; "
                             f"last engine {slot}: {slot.last_error[:300]}")
        self.stats.retried_groups += 1
        queue.append(g)

    async def _run_group(self, g: _Group, slot: EngineSlot, session: aiohttp.ClientSession,
                         store: dict) -> None:
        """Send a group's wire requests to one engine; store each answer under (rid, index)
        unless that sample is already held."""
        client = slot.client

        async def one(j0: int, wreq: GenerateRequest) -> None:
            resp = await client._post(session, "/generate", client.request_body(wreq))
            items = resp if isinstance(resp, list) else [resp]
            if len(items) != wreq.sampling.n:
                raise RolloutError(f"{slot}: request {wreq.rid} asked n={wreq.sampling.n}, "
                                   f"answered {len(items)} results")
            for j, item in enumerate(items):
                res = client.parse(item, wreq, g.pos, j0 + j)
                if res.finish_reason.get("type") == "abort":  # not a finished sample
                    raise _Aborted(f"{slot}: request {wreq.rid} sample {j} was aborted")
                res = dataclasses.replace(res, rid=g.req.rid, index=j0 + j)
                key = (g.req.rid, j0 + j)
                if key in store:
                    self.stats.duplicates_dropped += 1
                    continue
                store[key] = res
                self.placement[key] = slot.index

        await asyncio.gather(*(one(j0, w) for j0, w in g.wire))

    def _mark_dead(self, slot: EngineSlot, why: str) -> None:
        slot.state, slot.last_error = "dead", why
        self.stats.engines_marked_dead += 1
        self._event(f"{slot.index} marked dead: {why[:200]}")
        if slot.actor is not None:  # a hung server must not keep its bundle (or its CPU)
            _kill(slot.actor)

    def _event(self, text: str) -> None:
        self.stats.events.append(text)
        self.log(f"fleet: engine {text}")

    # -- relaunch ---------------------------------------------------------------------------
    def _revive(self, repush: bool = True) -> list[EngineSlot]:
        """Relaunch dead engines (Ray actors) or re-probe dead URLs; they come back as
        'joining' (no weights yet; with disk sync and `repush` they load the last folder and
        are live at once). Returns the slots that came back."""
        back = []
        for s in self.slots:
            if s.state != "dead":
                continue
            if self._launch is None:  # a server we did not start: is it answering again?
                try:
                    asyncio.run(s.client.get("/health"))
                except Exception:
                    continue
                s.state = "joining"
                back.append(s)
                continue
            if s.restarts >= self.max_engine_restarts:
                s.state = "gone"
                self._event(f"{s.index} not relaunched: rollout.max_engine_restarts="
                            f"{self.max_engine_restarts} used up")
                continue
            s.restarts += 1
            self.stats.relaunches += 1
            try:
                _connect(s, self._launch, self.startup_timeout_s)
            except Exception as e:  # noqa: BLE001 - named and kept; the fleet goes on without it
                s.state, s.last_error = "dead", f"relaunch failed: {e}"
                self._event(f"{s.index} relaunch {s.restarts} failed: {e}")
                continue
            s.client = self._client(s.url)
            s.state = "joining"
            self._event(f"{s.index} relaunched ({s.restarts}/{self.max_engine_restarts}) as "
                        f"pid {s.pid} at {s.url}")
            back.append(s)
        if back and repush and self._last_folder is not None:  # disk: current weights on disk
            self._push_disk(self._last_folder, self.weight_version, back)
            for s in back:
                s.state = "live"
        return back

    # -- weights ----------------------------------------------------------------------------
    async def aupdate_weights(self, source: Any, weight_version: str | None = None) -> str:
        return await asyncio.to_thread(self.update_weights, source, weight_version)

    def update_weights(self, source: Any, weight_version: str | None = None) -> str:
        """Push `source` (a model, an HF-named or native state dict, an HF folder, or an
        iterable of buckets) to every engine; relaunched engines rejoin here."""
        self._check_open()
        self._revive(repush=False)  # the push below brings them the new weights
        if weight_version is None:
            v = self.weight_version
            weight_version = str(int(v) + 1) if v.isdigit() else uuid.uuid4().hex[:8]
        version = str(weight_version)
        t0 = time.perf_counter()
        reiterable = isinstance(source, (MoEModel, dict, str, Path))
        if "weights" in self._released:  # colocated: the weights' memory back, KV cache not yet
            self.resume_memory(["weights"])
        for attempt in range(self.max_engine_restarts + 2):
            targets = [s for s in self.slots if s.state in ("live", "joining")]
            if not targets:
                raise FleetError("no rollout engine to push weights to: " + "; ".join(
                    f"{s}: {s.last_error[:200]}" for s in self.slots))
            try:
                if self.weight_sync == "disk" or isinstance(source, (str, Path)):
                    self._push_disk(source, version, targets)
                else:
                    self._push_distributed(source, version, targets)
                break
            except EngineDown as e:
                dead = self._find_dead(targets, str(e))
                if not reiterable or not dead:
                    raise FleetError(f"weight push {version!r} failed ({e}); "
                                     + ("the weights were a one-pass stream, so they cannot be "
                                        "pushed again" if not reiterable else
                                        "no engine was found dead")) from e
                self._revive(repush=False)
        for s in self.slots:
            if s.state == "joining":
                s.state = "live"
        self.weight_version = version
        self.stats.pushes += 1
        self.stats.push_seconds = time.perf_counter() - t0
        return version

    def _find_dead(self, targets: list[EngineSlot], why: str) -> list[EngineSlot]:
        dead = []
        for s in targets:
            try:
                asyncio.run(_health(s.client, min(10.0, self.request_timeout_s)))
            except Exception:  # noqa: BLE001 - any failure to answer /health means dead here
                self._mark_dead(s, f"during a weight push: {why}")
                dead.append(s)
        return dead

    def _buckets(self, source: Any):
        if isinstance(source, MoEModel):
            source = hf_state_dict(source)
        if isinstance(source, dict):
            return bucketize(source.items(), self.bucket_bytes)
        return source  # an iterable of buckets, consumed once

    def _push_distributed(self, source: Any, version: str, targets: list[EngineSlot]) -> None:
        from lockstep.rollout.weight_sync import DistributedWeightSync
        urls = [s.url for s in targets]
        if self._sync is None or self._sync_urls != urls:  # a new member: a new group
            self._close_sync()
            try:
                self._sync = DistributedWeightSync(urls, master_addr=_master_addr(urls),
                                                   api_key=self.api_key,
                                                   timeout_s=self.request_timeout_s)
            except PushRefused as e:  # an engine refused to join
                if not self.auto_sync:
                    raise
                return self._fall_back(e, source, version, targets)
            self._sync_urls = urls
        try:
            got = self._sync.push(self._buckets(source), version)
        except PushRefused as e:  # refused before any weight changed
            self._close_sync()
            if not self.auto_sync:
                raise EngineDown(f"distributed weight push to {urls}: {e}") from e
            return self._fall_back(e, e.buckets, version, targets)
        except Exception as e:
            self._close_sync()
            raise EngineDown(f"distributed weight push to {urls}: {e}") from e
        self.stats.push_bytes = int(got.get("bytes", 0))
        for s in targets:
            s.client.weight_version = s.client._pushed_version = version

    def _fall_back(self, why: Exception, source: Any, version: str,
                   targets: list[EngineSlot]) -> None:
        """weight_sync=auto: disk from now on (said once), this push included."""
        self.log(f"fleet: rollout.weight_sync=auto: {why}; pushing weights through disk from "
                 f"now on")
        self.weight_sync, self.auto_sync = "disk", False
        self._push_disk(source, version, targets)

    def _push_disk(self, source: Any, version: str, targets: list[EngineSlot]) -> None:
        folder = source
        if not isinstance(source, (str, Path)):
            weights = (hf_state_dict(source) if isinstance(source, MoEModel) else
                       dict(source) if isinstance(source, dict) else
                       {k: t for b in source for k, t in b})
            folder = save_hf_state_dict(weights, self.cfg, self.weights_dir / f"weights_{version}")
            self.stats.disk_bytes_written += sum(
                f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
            old, self._last_folder = self._last_folder, Path(folder)
            if old is not None and old != Path(folder) and old.parent == self.weights_dir:
                import shutil
                shutil.rmtree(old, ignore_errors=True)
        else:
            self._last_folder = Path(folder)

        async def all_() -> list:
            return await asyncio.gather(*(s.client.aupdate_weights(str(folder), version)
                                          for s in targets), return_exceptions=True)
        errors = [(s, e) for s, e in zip(targets, asyncio.run(all_())) if isinstance(e, Exception)]
        down = [(s, e) for s, e in errors if isinstance(e, EngineDown)]
        if len(down) != len(errors):
            s, e = next((s, e) for s, e in errors if not isinstance(e, EngineDown))
            raise RolloutError(f"{s}: /update_weights_from_disk {folder}: {e}")
        for s, e in down:
            self._mark_dead(s, f"during a weight push: {e}")
        if down:
            raise EngineDown(f"{len(down)} engine(s) died during the push")

    # -- colocated placement: SGLang's memory release between phases ------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """POST /release_memory_occupation to every live engine (colocated rollout: free the
        accelerator for the actor's phase; tags None = weights and KV cache). With
        `colocate` the fleet calls it after each generate, resumes ["weights"] before a push
        and the rest before the next generate."""
        self._broadcast("/release_memory_occupation", tags)
        self._released |= set(tags or ("weights", "kv_cache"))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """POST /resume_memory_occupation (tags None = every released tag)."""
        self._broadcast("/resume_memory_occupation", tags)
        self._released -= set(self._released if tags is None else tags)

    def _broadcast(self, path: str, tags: list[str] | None) -> None:
        """POST to every live engine; one that does not answer is marked dead (it is
        relaunched, with its memory in place, at the next push), other errors raise. Refused,
        before anything is sent, when an engine cannot take the call (SGLang on a CPU dies of
        it: `memory_occupation.release_refusal`)."""
        live = [s for s in self.slots if s.state == "live"]
        for s in live:
            why = self._release_refusal(s)
            if why is not None:
                raise RolloutError(f"{s}: {path} refused: {why}")

        async def all_():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                    total=self.request_timeout_s)) as sess:
                return await asyncio.gather(*(s.client._post(sess, path, {"tags": tags})
                                              for s in live), return_exceptions=True)
        for s, got in zip(live, asyncio.run(all_())):
            if isinstance(got, EngineDown):
                self._mark_dead(s, f"{path}: {got}")
            elif isinstance(got, BaseException):
                raise RolloutError(f"{s}: {path}: {got}") from got

    def _release_refusal(self, s: EngineSlot) -> str | None:
        """`release_refusal` of engine `s`'s /server_info, asked once per server URL."""
        from lockstep.rollout.memory_occupation import release_refusal
        if s.url not in self._refusals:
            self._refusals[s.url] = release_refusal(asyncio.run(s.client.get("/server_info")))
        return self._refusals[s.url]

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def engines(self) -> list[EngineSlot]:
        return self.slots

    def _close_sync(self) -> None:
        if self._sync is not None:
            try:
                self._sync.close()
            except Exception:  # noqa: BLE001 - a dead member: the group is gone either way
                pass
            self._sync, self._sync_urls = None, []

    def close(self) -> None:
        """Leave the weight group, stop the servers we launched, free their bundles."""
        if self.closed:
            return
        self.closed = True
        self._close_sync()
        if self._launch is not None:
            from lockstep.rollout.ray_backend import release
            release([s.actor for s in self.slots if s.actor is not None],
                    self.pg if self._owns_pg else None, self._owns_ray)  # not the group's

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RolloutError("the rollout fleet is closed")


# -- helpers -------------------------------------------------------------------------------------
async def _health(client: HTTPBackend, timeout_s: float) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.get(client.url + "/health") as r:
            if r.status != 200:
                raise RolloutError(f"/health -> {r.status}")


def _master_addr(urls: list[str]) -> str:
    """The trainer's address for the weight group's rendezvous: loopback when every engine
    is on this machine's loopback, else the local interface that routes to the first engine."""
    from urllib.parse import urlsplit
    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    if all(h in ("127.0.0.1", "localhost", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((hosts[0], 9))  # UDP: no packet is sent, only a route is chosen
        return s.getsockname()[0]


def _init_ray(address: str | None) -> bool:
    import ray
    if ray.is_initialized():
        return False
    ray.init(address=address, runtime_env={"env_vars": WORKER_ENV})
    return True


def _placement(n: int, cpus: float, gpus: float, timeout_s: float, name: str):
    import ray
    from ray.util.placement_group import placement_group
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"rollout.num_engines must be a positive integer, got {n!r}")
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([bundle] * n, strategy="PACK", name=f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    if not pg.wait(timeout_s):
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(pg)
        raise FleetError(f"could not reserve {n} bundles of {bundle} within {timeout_s:.0f}s; "
                         f"the cluster has {ray.available_resources()} free")
    return pg


def _shared_bundles(colocate_in: tuple[Any, list[int]], n: int) -> tuple[Any, list[int]]:
    pg, bundles = colocate_in
    if pg is None or len(bundles) != n:
        raise FleetError(f"colocated fleet: needs a placement group and one bundle per engine "
                         f"({n}), got {pg!r} and bundles {bundles}")
    return pg, list(bundles)


def _in_bundle(pg, i: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)


def _kill(actor) -> None:
    import ray
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass


def _connect(slot: EngineSlot, launch, timeout_s: float, first: bool = False) -> None:
    """Start engine `slot.index`'s actor and wait for its URL and pid."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    if slot.actor is not None:
        _kill(slot.actor)
    actor, info_fn = launch(slot.index, first) if first else launch(slot.index)
    slot.actor = actor
    try:
        info = ray.get(info_fn.remote(), timeout=timeout_s + _START_GRACE_S)
    except (RayActorError, RayTaskError) as e:
        raise FleetError(f"engine {slot.index} failed to start: {e}") from None
    except GetTimeoutError:
        raise FleetError(f"engine {slot.index} not up within the start-up timeout "
                         f"({timeout_s:g}s)") from None
    slot.url, slot.pid, slot.node = info["url"], int(info["pid"]), str(info["node"])


def _start(cls, n, launch, pg, owns, model_cfg, weight_version, api_key, timeout_s, kw, drop,
           owns_pg=True):
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    slots = [EngineSlot(i) for i in range(n)]
    handles: list = []
    try:
        handles += [launch(i, True) for i in range(n)]
        refs = [h[1].remote() for h in handles]
        try:  # a worker's own wait (its server's /health) ends first and says more: a grace
            infos = ray.get(refs, timeout=timeout_s + _START_GRACE_S)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [i for i, r in enumerate(refs) if r not in ready]
            raise FleetError(f"engines {late} of {n} not up within the start-up timeout "
                             f"({timeout_s:g}s)") from None
        except (RayActorError, RayTaskError) as e:
            raise FleetError(f"an engine failed to start: {e}") from None
        for s, (actor, _), info in zip(slots, handles, infos):
            s.actor, s.url, s.pid, s.node = actor, info["url"], int(info["pid"]), str(info["node"])
            s.state = "live"
    except BaseException:
        from lockstep.rollout.ray_backend import release
        release([h[0] for h in handles], pg if owns_pg else None, owns)
        raise
    drop()
    fleet = cls(slots, model_cfg, launch=launch, pg=pg, owns_pg=owns_pg, owns_ray=owns,
                weight_version=weight_version, api_key=api_key, startup_timeout_s=timeout_s, **kw)
    for s in slots:  # every server started with these weights: results must say so
        s.client._pushed_version = str(weight_version)
    return fleet


# -- from the experiment config (Trainer.make_backend) --------------------------------------------
def weight_sync_mode(cfg: Any) -> str:
    """How the fleet pushes weights: `rollout.weight_sync` (auto = distributed, falling back
    to disk for good when the engines refuse a push before any weight changed)."""
    mode = getattr(cfg.rollout, "weight_sync", "auto")
    if mode == "auto":
        return "auto"
    if mode not in ("distributed", "disk"):
        raise ValueError(f"rollout.weight_sync={mode!r} with rollout.backend="
                         f"{cfg.rollout.backend!r}: a fleet of HTTP servers takes 'distributed' "
                         f"(/update_weights_from_distributed), 'disk' or 'auto'")
    return mode


def make_fleet(cfg: Any, model: MoEModel | Path, weight_version: str, engine_cfg: EngineConfig,
               out_dir: str | Path, log: Callable[[str], None] | None = None,
               actor_pg: Any = None) -> Fleet:
    """The fleet `rollout.backend` (serve, sglang, or http with `rollout.urls`) asks for,
    holding `model`'s weights at `weight_version`. Colocated (`cluster.placement`, rollout/colocate.py): the servers
    go into `actor_pg`, the actor group's placement group. `model` an HF folder (an actor
    group's run): the servers start from it and are not pushed here (the caller pushes the
    group's streamed export)."""
    from lockstep.rollout.colocate import colocation_refusal
    from lockstep.trainer.config import rollout_api_key
    ro = cfg.rollout
    shared = None
    if cfg.cluster.placement == "colocated" and ro.backend == "http":
        raise ValueError(colocation_refusal(cfg))  # servers given by URL: no bundles
    if colocates_fleet(cfg):
        why = colocation_refusal(cfg)
        if why is None and actor_pg is None:
            why = "cluster.placement=colocated: the actor group's placement group was not given"
        if why is not None:
            raise ValueError(why)
        shared = (actor_pg, engine_bundles(cfg.cluster.actor_ranks, ro.num_engines))
    kw: dict[str, Any] = dict(
        weight_sync=weight_sync_mode(cfg), weights_dir=ro.weights_dir or Path(out_dir) / "weights",
        request_timeout_s=ro.request_timeout_s, max_engine_restarts=ro.max_engine_restarts,
        max_concurrency=max(ro.prompts_per_step, 1) * ro.samples_per_prompt,
        bucket_bytes=cfg.cluster.weight_bucket_bytes, log=log,
        # colocated with the actor: servers release their memory while it trains
        colocate=getattr(cfg.cluster, "placement", "disaggregated") == "colocated")
    if ro.backend == "serve":
        gpu = engine_cfg.device.startswith("cuda")  # cluster.device: a GPU per engine
        return Fleet.serve(model, engine_cfg, ro.num_engines, weight_version,
                           address=ro.ray_address, gpus_per_engine=1 if gpu else 0,
                           threads_per_engine=cfg.cluster.threads_per_rank, colocate_in=shared,
                           **kw)
    if ro.backend == "sglang":
        from lockstep.rollout.sglang_options import sglang_options_dict
        opts = sglang_options_dict(cfg)
        path = str(model) if isinstance(model, Path) else cfg.model.path
        if path is None:  # SGLang loads a folder: the initial weights, written once
            from lockstep.moe.checkpoint import save_hf
            path = str(save_hf(model, Path(out_dir) / "weights" / "initial"))
        fleet = Fleet.sglang(opts, str(path), ro.num_engines, cfg.model, weight_version,
                             address=ro.ray_address, log_dir=str(out_dir),
                             fan_out_samples=cfg.rollout.sglang.deterministic_inference,
                             sampling_mask_max_tokens=cfg.rollout.sglang.sampling_mask_max_tokens
                             or 4096, colocate_in=shared, **kw)
    else:
        fleet = Fleet.http(list(ro.urls), cfg.model, api_key=rollout_api_key(ro), **kw)
    if isinstance(model, Path):
        return fleet
    try:
        fleet.update_weights(model, weight_version)  # the servers' weights are not the policy's
    except BaseException:
        fleet.close()
        raise
    return fleet
