"""The one place that builds a run's backends from the experiment config: the actor (torch or
megatron-core), the KL reference policy, the rollout backend (embedded engine, Ray engines,
HTTP server(s), server fleets) with its weight-sync mode and API key.

`Trainer` (trainer/loop.py) builds the in-process actor and the rollout backend here, and the
actor group's ranks (trainer/group.py `RankWorker`) build their actor and reference here, so
which backend a config means is decided once. Below trainer/ nothing reads the experiment
config: the rollout backends and actors take the numbers this module passes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout import colocate
from lockstep.rollout.client import HTTPBackend, LocalBackend, RolloutBackend
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.trainer.config import ExperimentConfig, rollout_api_key
from lockstep.trainer.rank import resolve_device


def check_policy_fits(cfg: ExperimentConfig) -> None:
    """Refuse, before any allocation, a policy the in-process actor and engine cannot hold:
    its weights, gradients and AdamW moments (fp32 master weights: 16 bytes a parameter),
    plus the engine's copy in rollout.dtype."""
    from lockstep.kernels.dtypes import BY_NAME, base_precision
    from lockstep.moe.sizes import check_fits, param_count
    n = param_count(cfg.model)
    per_param = 4 * BY_NAME[cfg.actor.dtype].bytes + \
        BY_NAME[base_precision(cfg.rollout.dtype)].bytes
    m = cfg.model
    check_fits(f"the {n / 1e9:,.2f}B-parameter policy (model.hidden_size={m.hidden_size}, "
               f"num_hidden_layers={m.num_hidden_layers}, num_experts={m.num_experts}, "
               f"moe_intermediate_size={m.moe_intermediate_size}, vocab_size={m.vocab_size}) "
               f"as the actor's weights, gradients and AdamW moments plus the engine's copy",
               n * per_param, resolve_device(cfg.cluster.device),
               "check the model section's sizes (`lockstep plan CONFIG` prints the estimate "
               "per GPU), or spread it over an actor group (cluster.actor_ranks, "
               "actor.backend=megatron)")


# -- the actor -------------------------------------------------------------------------------
def replay_min_overlap(cfg: ExperimentConfig) -> float | None:
    """The validator's overlap floor (`replay.min_overlap`); 0 (off) when rollouts may come
    from older weights (`loop.max_staleness` > 0), whose routes a moved router may not share."""
    return 0.0 if cfg.loop.max_staleness > 0 else cfg.replay.min_overlap


def make_actor(cfg: ExperimentConfig, weights: MoEModel | Mapping[str, torch.Tensor],
               total_updates: int, dp_group: Any = None):
    """The actor `actor.backend` names, from `weights`: an `MoEModel` (in the driver) or
    HF-named weights (a rank: a `LazyHF` folder reader or a dict from the object store; a
    megatron rank reads only its shard). `dp_group`: the torch actor's data-parallel group
    (a rank of an actor group); the megatron actor builds its own from the layout."""
    temperature = cfg.rollout.temperature
    if cfg.actor.backend == "megatron":  # same interface, megatron-core underneath
        from lockstep.trainer.megatron.actor import MegatronActor
        return MegatronActor(weights, cfg.actor, total_updates, temperature=temperature,
                             options=cfg.actor.megatron, model_cfg=cfg.model,
                             replay_check=cfg.replay.check, min_overlap=replay_min_overlap(cfg))
    from lockstep.trainer.actor import TorchActor
    if not isinstance(weights, MoEModel):
        from lockstep.moe.checkpoint import load_hf_state_dict
        model = MoEModel(cfg.model)
        load_hf_state_dict(model, weights)
        weights = model
    return TorchActor(weights, cfg.actor, total_updates, temperature=temperature,
                      dp_group=dp_group, device=resolve_device(cfg.cluster.device),
                      replay=cfg.replay.options(), replay_check=cfg.replay.check,
                      min_overlap=replay_min_overlap(cfg))


# -- the KL reference ------------------------------------------------------------------------
def run_reference(cfg: ExperimentConfig, run_dir: Path, initial: MoEModel | None,
                  in_driver: bool):
    """The driver's KL reference (`loss.kl_coef > 0`; None without it): the HF folder of the
    initial weights where the actor keeps its own copy (an actor group's ranks, or the
    megatron actor's own shard of it), else a frozen torch `ReferencePolicy` next to the
    in-process torch actor. `initial`: the fresh run's initial model (written to the run's
    reference folder when that is where it lives); None on resume (the folder must exist)."""
    if cfg.loss.kl_coef <= 0:
        return None
    from lockstep.trainer.reference import ReferencePolicy, reference_folder_for_run
    if not in_driver or cfg.actor.backend == "megatron":
        return reference_folder_for_run(cfg, run_dir, initial)
    return ReferencePolicy.for_run(cfg, run_dir, initial,
                                   device=resolve_device(cfg.cluster.device))


def rank_reference(cfg: ExperimentConfig, actor, source: str | Mapping[str, torch.Tensor]):
    """A rank's KL reference from `source` (an HF folder this node reads, or HF-named
    weights): the megatron actor's own shard of a folder (ShardReference), else a frozen
    torch `ReferencePolicy` (on the CPU next to a megatron actor)."""
    from lockstep.moe.checkpoint import load_hf_state_dict
    from lockstep.moe.hf_lazy import LazyHF
    from lockstep.trainer.reference import ReferencePolicy
    megatron = cfg.actor.backend == "megatron"
    if megatron and isinstance(source, str):
        return source  # the actor reads this rank's shard of it
    model = MoEModel(cfg.model)
    load_hf_state_dict(model, LazyHF(source) if isinstance(source, str) else source)
    return ReferencePolicy(model, cfg.actor, cfg.rollout.temperature,
                           "cpu" if megatron else resolve_device(cfg.cluster.device))


# -- the rollout backend ---------------------------------------------------------------------
def needs_initial_push(cfg: ExperimentConfig) -> bool:
    """Backends whose servers are pushed the policy's weights at start-up (a given URL's
    server holds unknown weights; a fleet's servers are pushed as make_fleet did)."""
    return cfg.rollout.backend in ("http", "serve", "sglang")


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
        backend = HTTPBackend(ro.url, cfg.model, api_key=rollout_api_key(ro),
                              max_concurrency=ro.prompts_per_step,
                              timeout_s=ro.request_timeout_s,
                              weights_dir=ro.weights_dir or run_dir / "weights",
                              weight_sync=ro.weight_sync, log=log,
                              bucket_bytes=cfg.cluster.weight_bucket_bytes)
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
        device=str(resolve_device(cfg.cluster.device)))
    if ro.backend in ("serve", "sglang", "http"):  # a fleet of servers (needs 'ray' but http)
        return make_fleet(cfg, model, weight_version, engine_cfg, run_dir, log,
                          actor_pg=actor_pg)
    if ro.backend == "ray":  # the same engines as Ray actors; needs the extra 'ray'
        return make_ray_engines(cfg, model, weight_version, engine_cfg)
    if folder is not None:
        return LocalBackend(Engine.from_hf(folder, engine_cfg, weight_version=weight_version))
    return LocalBackend(Engine.from_model(model, engine_cfg, weight_version=weight_version))


# -- the rollout fleet and colocation: the rollout side takes numbers, read here ------------
def colocates_fleet(cfg: ExperimentConfig) -> bool:
    """Whether the run puts a fleet of servers (serve / sglang) into the actor's bundles."""
    return colocate.colocates(cfg.cluster.placement, cfg.rollout.backend)


def colocation_refusal(cfg: ExperimentConfig) -> str | None:
    """Why `cfg`'s colocated layout cannot be trained (None: it can, or it is not colocated)."""
    c, ro = cfg.cluster, cfg.rollout
    return colocate.refusal(c.placement, ro.backend, c.actor_ranks, ro.num_engines,
                            ro.sglang.tp_size, c.device)


def weight_sync_mode(cfg: ExperimentConfig) -> str:
    """How a fleet of servers takes weights: `rollout.weight_sync` (auto = distributed,
    falling back to disk for good when the engines refuse a push before any weight changed)."""
    mode = cfg.rollout.weight_sync
    if mode not in ("auto", "distributed", "disk"):
        raise ValueError(f"rollout.weight_sync={mode!r} with rollout.backend="
                         f"{cfg.rollout.backend!r}: a fleet of HTTP servers takes 'distributed' "
                         f"(/update_weights_from_distributed), 'disk' or 'auto'")
    return mode


def make_ray_engines(cfg: ExperimentConfig, model: MoEModel | Path, weight_version: str,
                     engine_cfg: EngineConfig) -> RolloutBackend:
    """`rollout.backend: ray`: `rollout.num_engines` embedded engines as Ray actors. `model` an
    HF folder (an actor group's run): each engine loads it."""
    from lockstep.rollout.fleet import Fleet
    ro = cfg.rollout
    source = str(model) if isinstance(model, Path) else model
    return Fleet.ray(source, engine_cfg, ro.num_engines, weight_version, cfg.model,
                     address=ro.ray_address, request_timeout_s=ro.request_timeout_s,
                     max_engine_restarts=ro.max_engine_restarts,
                     threads_per_engine=cfg.cluster.threads_per_rank)


def make_fleet(cfg: ExperimentConfig, model: MoEModel | Path, weight_version: str,
               engine_cfg: EngineConfig, out_dir: str | Path,
               log: Callable[[str], None] | None = None, actor_pg: Any = None) -> RolloutBackend:
    """The fleet `rollout.backend` (serve, sglang, or http with `rollout.urls`) asks for,
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
        request_timeout_s=ro.request_timeout_s, max_engine_restarts=ro.max_engine_restarts,
        max_concurrency=max(ro.prompts_per_step, 1) * ro.samples_per_prompt,
        bucket_bytes=cfg.cluster.weight_bucket_bytes, log=log,
        # colocated with the actor: servers release their memory while it trains
        colocate=cfg.cluster.placement == "colocated")
    if ro.backend == "serve":
        gpu = engine_cfg.device.startswith("cuda")  # cluster.device: a GPU per engine
        return Fleet.serve(model, engine_cfg, ro.num_engines, weight_version,
                           address=ro.ray_address, gpus_per_engine=1 if gpu else 0,
                           threads_per_engine=cfg.cluster.threads_per_rank, colocate_in=shared,
                           **kw)
    if ro.backend == "sglang":
        from lockstep.trainer.sglang_servers import sglang_options_dict
        opts = sglang_options_dict(cfg)
        path = str(model) if isinstance(model, Path) else cfg.model.path
        if path is None:  # SGLang loads a folder: the initial weights, written once
            from lockstep.moe.checkpoint import save_hf
            path = str(save_hf(model, Path(out_dir) / "weights" / "initial"))
        fleet = Fleet.sglang(opts, str(path), ro.num_engines, cfg.model, weight_version,
                             address=ro.ray_address, log_dir=str(out_dir),
                             fan_out_samples=ro.sglang.deterministic_inference,
                             sampling_mask_max_tokens=ro.sglang.sampling_mask_max_tokens or 4096,
                             colocate_in=shared, **kw)
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
