"""The rollout backend a run's config names: the embedded engine, Ray engines, HTTP
server(s) or a fleet of servers, with its weight-sync mode and API key.

`Trainer` (trainer/loop.py) and `lockstep diagnose` build it here, so which backend a config
means is decided once. Below trainer/ nothing reads the experiment config: the rollout
backends take the numbers this module passes them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lockstep.kernels.device import resolve_device
from lockstep.moe.model import MoEModel
from lockstep.rollout import colocate
from lockstep.rollout.backends import BACKENDS
from lockstep.rollout.client import HTTPBackend, LocalBackend, RolloutBackend
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.weight_push import MARKER
from lockstep.trainer.actor.build import (bundle_selectors, colocates_fleet,
                                          colocation_refusal)
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.load import rollout_api_key


# -- the rollout backend ---------------------------------------------------------------------
def http_client_class(engine: str, url: str, api_key: str | None,
                      log: Callable[[str], None], timeout_s: float = 60.0) -> type[HTTPBackend]:
    """The client class of `rollout.engine` (auto: asked of the server once, within
    `timeout_s`, and said)."""
    from lockstep.rollout.vllm_client import VLLMBackend, detect_engine
    if engine == "auto":
        engine = detect_engine(url, api_key, timeout_s)
        log(f"rollout.engine: {url} speaks the {engine} wire (detected; set rollout.engine to "
            f"skip the check)")
    return VLLMBackend if engine == "vllm" else HTTPBackend


def needs_initial_push(cfg: ExperimentConfig) -> bool:
    """Backends whose servers are pushed the policy's weights at start-up (a given URL's
    server holds unknown weights; a fleet's servers are pushed as make_fleet did)."""
    return BACKENDS[cfg.rollout.backend].servers


def make_rollout(cfg: ExperimentConfig, model: MoEModel | Path, weight_version: str, *,
                 max_len: int, run_dir: Path | None, log: Callable[[str], None] = print,
                 actor_pg: Any = None) -> RolloutBackend:
    """The rollout backend `rollout.backend` names, holding `model`'s weights at
    `weight_version`; engines hold sequences of up to `max_len` tokens. `model` an HF folder
    (an actor group's run): the engines load it themselves, and servers that need a push get
    the group's streamed export afterwards (`needs_initial_push`). `actor_pg`: the actor
    group's placement group, whose bundles colocated servers join. `run_dir` None: no run
    directory (diagnose's embedded engine)."""
    ro = cfg.rollout
    folder = model if isinstance(model, Path) else None
    if ro.backend == "http" and not ro.urls:
        client = http_client_class(ro.engine, ro.url, rollout_api_key(ro), log,
                                   ro.request_timeout_s)
        backend = client(ro.url, cfg.model, api_key=rollout_api_key(ro),
                              max_concurrency=ro.prompts_per_step,
                              timeout_s=ro.request_timeout_s,
                              weights_dir=ro.weights_dir or run_dir / "weights",
                              weight_sync=ro.weight_sync, log=log,
                              bucket_bytes=cfg.cluster.weight_bucket_bytes,
                              push_marker=run_dir / MARKER)
        if folder is None:
            try:  # the server's weights are unknown
                backend.update_weights(model, weight_version)
            except BaseException:
                backend.close()  # leave no weight group behind on the server
                raise
        return backend
    engine_cfg = EngineConfig(
        dtype=ro.dtype, router_dtype=ro.router_dtype, lm_head_dtype=ro.lm_head_dtype,
        max_running=ro.batch_size, max_len=max_len, seed=cfg.loop.seed,
        device=str(resolve_device(cfg.cluster.device)), exact=ro.exact)
    if BACKENDS[ro.backend].servers:  # a fleet of servers (needs 'ray' unless given by URL)
        return make_fleet(cfg, model, weight_version, engine_cfg, run_dir, log,
                          actor_pg=actor_pg)
    if ro.backend == "ray":  # the same engines as Ray actors; needs the extra 'ray'
        return make_ray_engines(cfg, model, weight_version, engine_cfg)
    if folder is not None:
        return LocalBackend(Engine.from_hf(folder, engine_cfg, weight_version=weight_version))
    return LocalBackend(Engine.from_model(model, engine_cfg, weight_version=weight_version))


def weight_sync_mode(cfg: ExperimentConfig) -> str:
    """How a fleet of servers takes weights: `rollout.weight_sync` (auto = distributed,
    falling back to disk for good when the engines refuse a push before any weight changed)."""
    mode = cfg.rollout.weight_sync
    if mode not in ("auto", "distributed", "disk"):
        raise ValueError(f"rollout.weight_sync={mode!r} with rollout.backend="
                         f"{cfg.rollout.backend!r}: a fleet of HTTP servers takes 'distributed' "
                         f"(/update_weights_from_distributed), 'disk' or 'auto'")
    return mode


def ray_address(cfg: ExperimentConfig) -> str | None:
    """The Ray cluster a fleet joins: `rollout.ray_address`, else `cluster.ray_address` (the
    actor group's), else Ray's own discovery."""
    return cfg.rollout.ray_address or cfg.cluster.ray_address


def make_ray_engines(cfg: ExperimentConfig, model: MoEModel | Path, weight_version: str,
                     engine_cfg: EngineConfig) -> RolloutBackend:
    """`rollout.backend: ray`: `rollout.num_engines` embedded engines as Ray actors. `model` an
    HF folder (an actor group's run): each engine loads it."""
    from lockstep.rollout.fleet import Fleet
    ro = cfg.rollout
    if ro.routes_by_reference and cfg.cluster.actor_ranks == 1:  # a layout key: not in the
        # config's own checks (run hashes drop it), so here, before anything starts
        raise ValueError("rollout.routes_by_reference=true needs an actor group "
                         "(cluster.actor_ranks > 1): the in-process actor is the driver, which "
                         "would fetch every route anyway")
    source = str(model) if isinstance(model, Path) else model
    return Fleet.ray(source, engine_cfg, ro.num_engines, weight_version, cfg.model,
                     address=ray_address(cfg), request_timeout_s=ro.request_timeout_s,
                     node_selectors=bundle_selectors(cfg)[1],
                     routes_by_reference=ro.routes_by_reference,
                     max_engine_restarts=ro.max_engine_restarts,
                     threads_per_engine=cfg.cluster.threads_per_rank)


def make_fleet(cfg: ExperimentConfig, model: MoEModel | Path, weight_version: str,
               engine_cfg: EngineConfig, out_dir: str | Path,
               log: Callable[[str], None] | None = None, actor_pg: Any = None) -> RolloutBackend:
    """The fleet `rollout.backend` (serve, sglang, vllm, or http with `rollout.urls`) asks for,
    holding `model`'s weights at `weight_version`. Colocated (`cluster.placement`,
    rollout/colocate.py): the servers go into `actor_pg`, the actor group's placement group.
    `model` an HF folder (an actor group's run): the servers start from it and are not pushed
    here (the caller pushes the group's streamed export)."""
    from lockstep.rollout.fleet import Fleet
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
        shared = (actor_pg, colocate.engine_bundles(cfg.cluster.actor_ranks, ro.num_engines))
    kw: dict[str, Any] = dict(
        weight_sync=weight_sync_mode(cfg), weights_dir=ro.weights_dir or Path(out_dir) / "weights",
        push_marker=Path(out_dir) / MARKER,
        request_timeout_s=ro.request_timeout_s, max_engine_restarts=ro.max_engine_restarts,
        max_concurrency=max(ro.prompts_per_step, 1) * ro.samples_per_prompt,
        bucket_bytes=cfg.cluster.weight_bucket_bytes, log=log,
        # colocated with the actor: servers release their memory while it trains
        colocate=cfg.cluster.placement == "colocated",
        node_selectors=None if shared else bundle_selectors(cfg)[1])
    if ro.backend == "serve":
        gpu = engine_cfg.device.startswith("cuda")  # cluster.device: a GPU per engine
        return Fleet.serve(model, engine_cfg, ro.num_engines, weight_version,
                           address=ray_address(cfg), gpus_per_engine=1 if gpu else 0,
                           threads_per_engine=cfg.cluster.threads_per_rank, colocate_in=shared,
                           **kw)
    if ro.backend == "sglang":
        from lockstep.trainer.driver.sglang_servers import sglang_options_dict
        opts = sglang_options_dict(cfg)
        fleet = Fleet.sglang(opts, _initial_folder(cfg, model, out_dir), ro.num_engines, cfg.model, weight_version,
                             address=ray_address(cfg), log_dir=str(out_dir),
                             fan_out_samples=ro.sglang.deterministic_inference,
                             sampling_mask_max_tokens=ro.sglang.sampling_mask_max_tokens or 4096,
                             colocate_in=shared, **kw)
    elif ro.backend == "vllm":
        from lockstep.trainer.driver.vllm_servers import vllm_options_dict
        fleet = Fleet.vllm(vllm_options_dict(cfg), _initial_folder(cfg, model, out_dir),
                           ro.num_engines, cfg.model, weight_version, address=ray_address(cfg),
                           log_dir=str(out_dir), colocate_in=shared, **kw)
    else:
        client = http_client_class(ro.engine, ro.urls[0], rollout_api_key(ro), log,
                                   ro.request_timeout_s)
        fleet = Fleet.http(list(ro.urls), cfg.model, api_key=rollout_api_key(ro),
                           client_cls=client, **kw)
    if isinstance(model, Path):
        return fleet
    try:
        fleet.update_weights(model, weight_version)  # the servers' weights are not the policy's
    except BaseException:
        fleet.close()
        raise
    return fleet


def _initial_folder(cfg: ExperimentConfig, model: MoEModel | Path, out_dir: str | Path) -> str:
    """The HF folder real SGLang / vLLM servers start from (and a relaunched one restarts
    from): `model` itself when it is a folder, else model.path, else the initial weights
    written once under out_dir/weights/initial."""
    path = str(model) if isinstance(model, Path) else cfg.model.path
    if path is None:
        from lockstep.moe.checkpoint import save_hf
        path = str(save_hf(model, Path(out_dir) / "weights" / "initial"))
    return str(path)
