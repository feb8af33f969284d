"""The actor a run's config names (torch or megatron-core), its KL reference policy, and
whether the rollout fleet shares the actor group's bundles.

`Trainer` (trainer/loop.py) builds the in-process actor here, and the actor group's ranks
(trainer/actor/group.py `RankWorker`) build their actor and reference here, so which backend a
config means is decided once. Below trainer/ nothing reads the experiment config: the actors
take the numbers this module passes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lockstep.kernels.device import resolve_device
from lockstep.moe.model import MoEModel
from lockstep.rollout import colocate
from lockstep.trainer.config.experiment import ExperimentConfig


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
               n * per_param, str(resolve_device(cfg.cluster.device)),
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
        from lockstep.trainer.actor.megatron.actor import MegatronActor
        return MegatronActor(weights, cfg.actor, total_updates, temperature=temperature,
                             options=cfg.actor.megatron, model_cfg=cfg.model,
                             replay_check=cfg.replay.check, min_overlap=replay_min_overlap(cfg))
    from lockstep.trainer.actor.torch_actor import TorchActor
    if not isinstance(weights, MoEModel):
        from lockstep.moe.checkpoint import load_hf_state_dict
        model = MoEModel(cfg.model)
        load_hf_state_dict(model, weights)
        weights = model
    return TorchActor(weights, cfg.actor, total_updates, temperature=temperature,
                      dp_group=dp_group, device=str(resolve_device(cfg.cluster.device)),
                      replay=cfg.replay.options(), replay_check=cfg.replay.check,
                      min_overlap=replay_min_overlap(cfg), exact=cfg.rollout.exact)


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
    from lockstep.trainer.actor.reference import ReferencePolicy, reference_folder_for_run
    if not in_driver or cfg.actor.backend == "megatron":
        return reference_folder_for_run(cfg, run_dir, initial)
    return ReferencePolicy.for_run(cfg, run_dir, initial,
                                   device=str(resolve_device(cfg.cluster.device)))


def rank_reference(cfg: ExperimentConfig, actor, source: str | Mapping[str, torch.Tensor]):
    """A rank's KL reference from `source` (an HF folder this node reads, or HF-named
    weights): the megatron actor's own shard of a folder (ShardReference), else a frozen
    torch `ReferencePolicy` (on the CPU next to a megatron actor)."""
    from lockstep.moe.checkpoint import load_hf_state_dict
    from lockstep.moe.hf_lazy import LazyHF
    from lockstep.trainer.actor.reference import ReferencePolicy
    megatron = cfg.actor.backend == "megatron"
    if megatron and isinstance(source, str):
        return source  # the actor reads this rank's shard of it
    model = MoEModel(cfg.model)
    load_hf_state_dict(model, LazyHF(source) if isinstance(source, str) else source)
    return ReferencePolicy(model, cfg.actor, cfg.rollout.temperature,
                           "cpu" if megatron else str(resolve_device(cfg.cluster.device)))


# -- colocation: whether the fleet goes into the actor group's bundles ---------------------
def colocates_fleet(cfg: ExperimentConfig) -> bool:
    """Whether the run puts a fleet of servers (serve / sglang) into the actor's bundles."""
    return colocate.colocates(cfg.cluster.placement, cfg.rollout.backend)


def colocation_refusal(cfg: ExperimentConfig) -> str | None:
    """Why `cfg`'s colocated layout cannot be trained (None: it can, or it is not colocated)."""
    c, ro = cfg.cluster, cfg.rollout
    return colocate.refusal(c.placement, ro.backend, c.actor_ranks, ro.num_engines,
                            ro.sglang.tp_size, c.device)


# -- placement over nodes: what `lockstep plan` prints and `lockstep train` pins -------------
def planned_nodes(cfg: ExperimentConfig) -> tuple[list[int | None], list[int | None]]:
    """(node of each actor-rank bundle, node of each engine bundle) as `lockstep plan` lays
    them out (`cluster/placement.lay_out`): GPU bundles by `cluster.gpus_per_node`, CPU ones
    by `cluster.cpus_per_node` (0: None, Ray chooses). An in-process actor has no bundle;
    colocated engines and engines without a bundle of their own (local, http) have None."""
    from lockstep.cluster.placement import first_fit, lay_out
    c, ro = cfg.cluster, cfg.rollout
    ranks = c.actor_ranks if c.actor_ranks > 1 else 0
    real, fleet = ro.backend in ("sglang", "vllm"), ro.backend in ("ray", "serve", "sglang",
                                                                    "vllm")
    engines = ro.num_engines if fleet else 0
    colocated = colocates_fleet(cfg)
    rank_gpu = c.device != "cpu" and c.gpus_per_node > 0
    engine_gpu = real and c.device != "cpu" and c.gpus_per_node > 0
    engine_size = getattr(ro, ro.backend).tp_size if real else 1
    if rank_gpu == engine_gpu:  # one kind of unit: laid out together
        per = c.gpus_per_node if rank_gpu else c.cpus_per_node
        if per == 0:
            return [None] * ranks, [None] * engines
        return lay_out(ranks, 1, engines, engine_size, c.nodes, per, colocated)
    # GPU ranks with CPU engines, or CPU ranks with SGLang on GPUs: each by its own unit
    gpu_n, cpu_n = (ranks, engines) if rank_gpu else (engines, ranks)
    gpus = first_fit([1 if rank_gpu else engine_size] * gpu_n, [float(c.gpus_per_node)] * c.nodes)
    # a CPU bundle of a rank or of a ray / serve engine takes one CPU
    cpus = (first_fit([1.0] * cpu_n, [float(c.cpus_per_node)] * c.nodes)
            if c.cpus_per_node else [None] * cpu_n)
    rank_nodes, engine_nodes = (gpus, cpus) if rank_gpu else (cpus, gpus)
    return rank_nodes, [None] * engines if colocated else engine_nodes


def bundle_selectors(cfg: ExperimentConfig) -> tuple[list | None, list | None]:
    """The Ray label selectors that pin (actor-rank bundles, engine bundles) to their planned
    nodes (`cluster.node_label`); None where nothing is pinned. Refuses a label with bundles
    the plan gives no node (say `cluster.cpus_per_node` / `gpus_per_node`, or more nodes)."""
    from lockstep.cluster.placement import node_selectors
    label = cfg.cluster.node_label
    if label is None:
        return None, None
    ranks, engines = planned_nodes(cfg)
    if not colocates_fleet(cfg) and None in ranks + engines:
        c = cfg.cluster
        raise ValueError(f"cluster.node_label={label!r}: the plan gives no node to some bundles "
                         f"(actor ranks on nodes {ranks}, engines on {engines}; cluster.nodes="
                         f"{c.nodes}, gpus_per_node={c.gpus_per_node}, cpus_per_node="
                         f"{c.cpus_per_node}): say the nodes' sizes (`lockstep plan` shows the "
                         f"layout)")
    return node_selectors(label, ranks), node_selectors(label, engines)
