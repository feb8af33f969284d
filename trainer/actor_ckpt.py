"""The actor's part of a checkpoint, written by the actor ranks themselves and readable on any
layout: the weights as an HF folder (`hf/`) and Adam's moments under the same HF names
(`optim/exp_avg/`, `optim/exp_avg_sq/`, each an HF folder too), plus a small state (step
count, LR schedule) the driver stores in `trainer_state`.

Why HF names for the optimiser: Adam's moments have the shape of their weight and are
element-wise, so the exact HF <-> megatron-core conversion (`trainer/megatron/convert.py`:
slicing and concatenation only) applies to them as it does to the weights. A checkpoint
written by megatron TP=2 then loads on EP=2, PP=2, more or fewer ranks, or one process: each
rank takes its own slices, as it does for the weights. The torch actor's parameters map to HF
names through `moe.checkpoint.hf_state_dict` (views; the moments are viewed the same way).

Who writes what (`cluster.actor_ranks` > 1, shared storage: every rank sees the run
directory): the model is cut in parts, part 0 = embedding, final norm and LM head, part i+1
= decoder layer i, each written as one file `model-<p+1>-of-<P>.safetensors` in `hf/` and in
both moment folders, by rank p % world. A megatron part is gathered to its writer only
(`torch.distributed.gather_object`, one layer at a time; only one data-parallel copy of each
shard is sent); torch data-parallel ranks all hold everything and each writes its own parts
without any exchange. The driver writes the index files, config.json and the tokenizer
afterwards from the names and checksums the ranks return (no tensors).
In one process (`cluster.actor_ranks` = 1) the actor is in the driver and the same tensors
are written with `save_hf_state_dict` (one file below 2 GiB), as before.

Shapes: P = num_hidden_layers + 1 parts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lockstep.moe.checkpoint import (INDEX_FILE, CheckpointError, hf_state_dict,
                                     save_hf_state_dict, write_hf_extras)
from lockstep.moe.config import ModelConfig
from lockstep.trainer.checkpoint import file_sha256

FORMAT = "lockstep-actor-ckpt/1"
OPTIM = "optim"
MOMENTS = ("exp_avg", "exp_avg_sq")
ADAM_KEYS = {"step", *MOMENTS}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def num_parts(cfg: ModelConfig) -> int:
    return cfg.num_hidden_layers + 1


def part_of(hf_name: str) -> int:
    """0 for the global tensors, i + 1 for decoder layer i's."""
    m = _LAYER.match(hf_name)
    return 0 if m is None else int(m.group(1)) + 1


def part_file(p: int, n: int) -> str:
    return f"model-{p + 1:05d}-of-{n:05d}.safetensors"


def dirs() -> list[str]:
    """The folders of an actor checkpoint, relative to the checkpoint: hf and each moment."""
    return ["hf", *(f"{OPTIM}/{m}" for m in MOMENTS)]


class Part:
    """One part's HF-named weights and moments (moments are zeros where a tensor has no
    optimiser state; `no_state` names them)."""

    def __init__(self, p: int, weights: dict, moments: dict[str, dict], no_state: set[str]):
        self.p, self.weights, self.moments, self.no_state = p, weights, moments, no_state

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"hf": self.weights, **{f"{OPTIM}/{m}": self.moments[m] for m in MOMENTS}}


# -- the actor side --------------------------------------------------------------------------
def common_step(steps: list[torch.Tensor], where: str) -> dict | None:
    """{'step': float, 'dtype': str} shared by every tensor with state; None when none has."""
    if not steps:
        return None
    vals = {float(s) for s in steps}
    if len(vals) != 1:
        raise CheckpointError(f"{where}: optimiser steps differ between tensors ({sorted(vals)[:4]}"
                              "); the HF-named checkpoint stores one step count")
    return {"step": vals.pop(), "dtype": str(steps[0].dtype).removeprefix("torch.")}


def _check_adam(state: dict, where: str) -> None:
    extra = set(state) - ADAM_KEYS
    if extra:
        raise CheckpointError(f"{where}: optimiser state has {sorted(extra)} besides "
                              f"{sorted(ADAM_KEYS)} (only Adam/AdamW without amsgrad is stored)")


# torch actor (TorchActor: fp32 master MoEModel + torch.optim.AdamW)
def _hf_views(model, per_param: Mapping[torch.nn.Parameter, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For every HF name whose parameter has a tensor in `per_param` (same shape and strides
    as the parameter), the same view of that tensor as `hf_state_dict(model)` takes of the
    parameter (e.g. expert e's gate rows of the stacked gate_up_proj). Buffers (the expert
    bias) have no optimiser state and are left out."""
    by_storage = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    out = {}
    for name, v in hf_state_dict(model).items():
        p = by_storage.get(v.untyped_storage().data_ptr())
        t = None if p is None else per_param.get(p)
        if t is None:
            continue
        if t.shape != p.shape or t.stride() != p.stride():
            raise CheckpointError(f"{name}: optimiser tensor {tuple(t.shape)}/{t.stride()} does not "
                                  f"match its parameter {tuple(p.shape)}/{p.stride()}")
        out[name] = t.as_strided(v.size(), v.stride(),
                                 t.storage_offset() + v.storage_offset() - p.storage_offset())
    return out


def torch_parts(actor, rank: int = 0, world: int = 1) -> tuple[Iterator[Part], dict]:
    """(the parts rank `rank` of `world` writes, the actor state). Every data-parallel rank
    holds the whole model and optimiser, so nothing is exchanged."""
    model, opt = actor.master, actor.optimizer
    weights = {k: v.detach() for k, v in hf_state_dict(model).items()}
    states = {p: opt.state[p] for g in opt.param_groups for p in g["params"] if opt.state.get(p)}
    for p, s in states.items():
        _check_adam(s, "torch actor")
    moments = {m: _hf_views(model, {p: s[m] for p, s in states.items()}) for m in MOMENTS}
    step = common_step([s["step"] for s in states.values()], "torch actor")
    n = num_parts(actor.model_cfg)

    def parts() -> Iterator[Part]:
        for p in range(rank, n, world):
            names = [k for k in weights if part_of(k) == p]
            no_state = {k for k in names if k not in moments["exp_avg"]}
            yield Part(p, {k: weights[k] for k in names},
                       {m: {k: (torch.zeros_like(weights[k]) if k in no_state else moments[m][k])
                            for k in names} for m in MOMENTS}, no_state)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return parts(), {"step": step, "scheduler": actor.scheduler.state_dict(),
                     "param_groups": groups}


def torch_load(actor, moments: Mapping[str, Mapping[str, torch.Tensor]], state: dict) -> None:
    """Give the torch actor the optimiser state `moments[m][hf_name]` + `state`."""
    model, opt = actor.master, actor.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    per = {m: {p: torch.zeros_like(p) for p in params} for m in MOMENTS}
    no_state = set(state.get("no_state", ()))
    have: dict[torch.nn.Parameter, bool] = {}
    views = {m: _hf_views(model, per[m]) for m in MOMENTS}
    by_storage = {p.untyped_storage().data_ptr(): p for p in params}
    with torch.no_grad():
        for m in MOMENTS:
            for name, view in views[m].items():
                view.copy_(moments[m][name])
        for name, v in hf_state_dict(model).items():
            p = by_storage.get(v.untyped_storage().data_ptr())
            if p is not None:
                have[p] = have.get(p, False) or name not in no_state
    opt.state.clear()
    step = state.get("step")
    if step is not None:
        for p in params:
            if have.get(p):
                opt.state[p] = {"step": torch.tensor(step["step"], dtype=getattr(torch, step["dtype"]),
                                                     device=p.device),
                                **{m: per[m][p] for m in MOMENTS}}
    for g, saved in zip(opt.param_groups, state["param_groups"]):
        g.update(saved)
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.sync_compute()


# megatron actor (MegatronActor: megatron-core GPTModel + its optimizer)
def _adam_states(actor) -> dict[str, tuple[Any, torch.nn.Parameter]]:
    """megatron param name (whole-model layer numbers) -> (torch optimizer, the param its
    state is keyed by: the param itself, or its fp32 main copy under a mixed-precision
    optimizer)."""
    opt = actor.optimizer
    main_of: dict[int, tuple[Any, torch.nn.Parameter]] = {}
    for o in getattr(opt, "chained_optimizers", [opt]):
        pairs = []
        if hasattr(o, "float16_groups"):  # Float16OptimizerWithFloat16Params (GPU bf16/fp16)
            for mg, fg in zip(o.float16_groups, o.fp32_from_float16_groups):
                pairs += list(zip(mg, fg))
            pairs += [(p, p) for g in o.fp32_from_fp32_groups for p in g]
        else:
            pairs += [(p, p) for g in o.optimizer.param_groups for p in g["params"]]
        for model_p, main_p in pairs:
            main_of[id(model_p)] = (o.optimizer, main_p)
    from lockstep.trainer.megatron import convert
    return {n: main_of[id(p)] for m in _chunks(actor)
            for n, p in convert.global_names(m, dict(m.named_parameters())).items()
            if id(p) in main_of}


def _chunks(actor) -> list:
    """The megatron actor's model chunks (several under a virtual pipeline), each with its
    own decoder layers."""
    return getattr(actor, "chunks", None) or [actor.gpt]


def _is_expert(megatron_name: str) -> bool:
    return ".mlp.experts." in megatron_name


def megatron_parts(actor) -> tuple[Iterator[Part], dict]:
    """(the parts this rank writes, the actor state). A collective over the world: every
    rank iterates the parts to the end. Part p is gathered to rank p % world only; of each
    shard, only data-parallel rank 0 (expert-data-parallel rank 0 for experts) sends it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from lockstep.trainer.megatron import convert

    cfg = actor.model_cfg
    lay = convert.Layout.of_model(_chunks(actor))
    local = {k: v for m in _chunks(actor) for k, v in convert.global_names(m, m.state_dict()).items()}
    adam = _adam_states(actor)
    steps = []
    for name, (o, main) in adam.items():
        s = o.state.get(main)
        if s:
            _check_adam(s, f"megatron {name}")
            steps.append(s["step"])
    step = common_step(steps, "megatron actor")
    if dist.get_world_size() > 1:  # every rank must agree (all hold the same count)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, step)
        if any(e != step for e in every):
            raise CheckpointError(f"megatron ranks disagree on the optimiser step: {every}")
    tp, ep, etp = convert._ranks()
    dense_src = ps.get_data_parallel_rank() == 0
    expert_src = ps.get_expert_data_parallel_rank() == 0
    rank, world = dist.get_rank(), dist.get_world_size()
    n = num_parts(cfg)

    def entry(name: str) -> tuple:
        o, main = adam.get(name, (None, None))
        # a mixed-precision optimizer (GPU bf16) keeps fp32 main weights: those are the
        # checkpoint's weights (the fp32 master), not the 16-bit copies the model computes with
        w = (local[name] if main is None or main.data_ptr() == local[name].data_ptr()
             else main).detach().cpu()
        s = o.state.get(main) if o is not None else None
        if not s:
            return w, None
        return w, tuple(s[m].detach().cpu() for m in MOMENTS)

    def part_names(p: int) -> list[str]:
        if p == 0:
            return [k for k in local if not k.startswith("decoder.layers.")]
        return [k for k in local if (m := _MG_LAYER.match(k)) and int(m.group(1)) == p - 1]

    def parts() -> Iterator[Part]:
        for p in range(n):
            names = part_names(p)
            mine = [((tp, -1, -1), {k: entry(k) for k in names if not _is_expert(k)}
                     if dense_src else {}),
                    ((-1, ep, etp), {k: entry(k) for k in names if _is_expert(k)}
                     if expert_src else {})]
            writer = p % world
            got = [None] * world if rank == writer else None
            dist.gather_object(mine, got, dst=writer)
            if rank != writer:
                continue
            shards: dict[tuple, dict] = {}
            for sent in got:
                for key, d in sent:
                    if d or key not in shards:
                        shards.setdefault(key, {}).update(d)
            layers = [] if p == 0 else [p - 1]

            def convert_(pick) -> dict[str, torch.Tensor]:
                return convert.megatron_to_hf(
                    {k: {n_: pick(n_, e) for n_, e in d.items()} for k, d in shards.items()},
                    cfg, lay, layers=layers, with_globals=p == 0)
            weights = convert_(lambda _, e: e[0])
            moments = {m: convert_(lambda _, e, i=i: e[0].new_zeros(e[0].shape) if e[1] is None
                                   else e[1][i]) for i, m in enumerate(MOMENTS)}
            stateless = convert_(lambda _, e: torch.full(e[0].shape, float(e[1] is None)))
            no_state = {k for k, v in stateless.items() if bool(v.all())}
            yield Part(p, weights, moments, no_state)
    return parts(), {"step": step, "num_steps": actor.num_steps}


def megatron_load(actor, moments: Mapping[str, Mapping[str, torch.Tensor]], state: dict,
                  weights=None) -> None:
    """Give this megatron rank its slices of the HF-named moments + the step count (and,
    under a mixed-precision optimizer, its fp32 main weights from `weights`: the model was
    built from them, but in 16 bits; `weights()` gives the HF-named weights, read only then)."""
    from lockstep.trainer.megatron import convert

    cfg = actor.model_cfg
    lay = convert.Layout.of_model(_chunks(actor))
    tp, ep, etp = convert._ranks()
    adam = _adam_states(actor)
    step = state.get("step")
    params = {k: v for m in _chunks(actor)
              for k, v in convert.global_names(m, dict(m.named_parameters())).items()}
    # only this rank's slices are read (`hf_to_megatron_items` over a LazyHF): its stage's
    # layers, its EP rank's experts, its TP / ETP chunks
    shard = dict(layers=sorted(i for m in _chunks(actor) for i in convert.stage_layers(m).values()),
                 globals_=[k for k in params if not _MG_LAYER.match(k)],
                 tp_rank=tp, ep_rank=ep, etp_rank=etp)
    mixed = {k: main for k, (_, main) in adam.items() if main is not params[k]}
    if mixed and weights is not None:
        with torch.no_grad():
            for k, v in convert.hf_to_megatron_items(weights(), cfg, lay, **shard):
                if k in mixed:
                    mixed[k].copy_(v)
    # every megatron parameter has state after a step (DDP gives each a gradient); the
    # tensors a megatron run stored without state are buffers (the expert bias)
    per: dict[str, dict] = {k: {} for k in adam}
    for m in MOMENTS:
        for k, v in convert.hf_to_megatron_items(moments[m], cfg, lay, **shard):
            if k in per:
                per[k][m] = v
    for o in {id(o): o for o, _ in adam.values()}.values():
        o.state.clear()
    if step is not None:
        missing = sorted(k for k, d in per.items() if set(d) != set(MOMENTS))
        if missing:
            raise CheckpointError(f"optimiser state for {missing[:4]} not in the checkpoint")
        for name, (o, main) in adam.items():
            o.state[main] = {
                "step": torch.tensor(step["step"], dtype=getattr(torch, step["dtype"]),
                                     device=main.device),
                **{m: per[name][m].to(main.device, main.dtype).clone() for m in MOMENTS}}
    actor.num_steps = state["num_steps"]
    actor._set_lr()


# -- dispatch --------------------------------------------------------------------------------
def _is_megatron(actor) -> bool:
    # `chunks`: a virtual pipeline's actor has no single `gpt` (it raises AttributeError)
    return hasattr(actor, "chunks") or hasattr(actor, "gpt")


def actor_parts(actor, rank: int = 0, world: int = 1) -> tuple[Iterator[Part], dict]:
    if _is_megatron(actor):
        return megatron_parts(actor)
    return torch_parts(actor, rank, world)


def actor_load(actor, folder: Path, state: dict) -> None:
    """Restore `actor`'s optimiser state from checkpoint `folder` (its `optim/` moments)."""
    moments = {m: _hf_mapping(folder / OPTIM / m) for m in MOMENTS}
    if _is_megatron(actor):
        megatron_load(actor, moments, state, weights=lambda: _hf_mapping(folder / "hf"))
    else:
        torch_load(actor, moments, state)


def _hf_mapping(folder: Path) -> Mapping[str, torch.Tensor]:
    """HF-named tensors of `folder` (the moments are HF folders), each read when asked, as
    stored (`LazyHF`)."""
    from lockstep.moe.hf_lazy import LazyHF
    return LazyHF(folder, dtype=None)


# -- writing ---------------------------------------------------------------------------------
def write_parts(folder: Path, parts: Iterator[Part], cfg: ModelConfig) -> dict:
    """Write each part as `<dir>/model-<p+1>-of-<P>.safetensors` for dir in `dirs()`; returns
    what the driver needs (no tensors): per file its names, sha256 and bytes; non-finite
    weights; tensors without optimiser state."""
    n = num_parts(cfg)
    files: dict[str, dict] = {}
    nonfinite: list[str] = []
    no_state: list[str] = []
    written: list[int] = []
    for part in parts:
        name = part_file(part.p, n)
        for d, tensors in part.tensors().items():
            (folder / d).mkdir(parents=True, exist_ok=True)
            path = folder / d / name
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
                      metadata={"format": "pt"})
            files[f"{d}/{name}"] = {"sha256": file_sha256(path), "bytes": path.stat().st_size,
                                    "names": sorted(tensors),
                                    "tensor_bytes": sum(v.numel() * v.element_size()
                                                        for v in tensors.values())}
        nonfinite += [k for k, v in part.weights.items()
                      if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        no_state += sorted(part.no_state)
        written.append(part.p)
    return {"files": files, "nonfinite": nonfinite, "no_state": no_state, "parts": written}


def finish(folder: Path, metas: list[dict], cfg: ModelConfig, tokenizer=None) -> dict[str, dict]:
    """The driver's share after the ranks wrote their parts: every part written exactly once,
    then each folder's index, config.json (and the tokenizer in hf/). Returns the ranks' files
    as {relative path: {sha256, bytes}} for the manifest."""
    n = num_parts(cfg)
    done = sorted(p for m in metas for p in m["parts"])
    if done != list(range(n)):
        raise CheckpointError(f"actor checkpoint parts written {done}, expected 0..{n - 1} once each")
    files = {k: v for m in metas for k, v in m["files"].items()}
    for d in dirs():
        mine = {k: v for k, v in files.items() if k.startswith(d + "/") and "/" not in k[len(d) + 1:]}
        weight_map = {t: k[len(d) + 1:] for k, v in sorted(mine.items()) for t in v["names"]}
        total = sum(v["tensor_bytes"] for v in mine.values())
        (folder / d / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        write_hf_extras(cfg, folder / d, tokenizer if d == "hf" else None)
    return {k: {"sha256": v["sha256"], "bytes": v["bytes"]} for k, v in files.items()}


def write_in_process(folder: Path, actor, cfg: ModelConfig, tokenizer=None) -> dict:
    """The one-process path: the actor lives in this process; its weights and moments go to
    `hf/` and `optim/<moment>/` through `save_hf_state_dict`. Returns the actor state."""
    parts, state = actor_parts(actor)
    weights: dict = {}
    moments: dict = {m: {} for m in MOMENTS}
    no_state: list[str] = []
    for part in parts:
        weights.update(part.weights)
        for m in MOMENTS:
            moments[m].update(part.moments[m])
        no_state += sorted(part.no_state)
    save_hf_state_dict(weights, cfg, folder / "hf", tokenizer=tokenizer)
    for m in MOMENTS:
        save_hf_state_dict(moments[m], cfg, folder / OPTIM / m)
    nonfinite = [k for k, v in weights.items()
                 if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    return {**state, "no_state": no_state, "nonfinite": nonfinite}


# -- layouts ---------------------------------------------------------------------------------
LAYOUT_KEYS = ("cluster.actor_ranks", "actor.megatron.tensor_parallel",
               "actor.megatron.expert_parallel", "actor.megatron.expert_tensor_parallel",
               "actor.megatron.pipeline_parallel", "actor.megatron.virtual_pipeline_parallel")
"""Config keys a checkpoint may be resumed across (left out of the run hash)."""


def without_layout(cfg) -> dict:
    """`cluster` and `actor` sections of `cfg` with the LAYOUT_KEYS at their defaults."""
    import dataclasses
    m = dataclasses.replace(cfg.actor.megatron, tensor_parallel=1, expert_parallel=1,
                            expert_tensor_parallel=None, pipeline_parallel=1,
                            virtual_pipeline_parallel=None)
    return {"cluster": cfg.cluster.model_copy(update={"actor_ranks": 1}),
            "actor": cfg.actor.model_copy(update={"megatron": m})}


def layout_state(cfg) -> dict:
    """What a checkpoint records of the layout that wrote it (informational: loading reads
    the slices of the layout it runs on)."""
    m = cfg.actor.megatron
    return {"format": FORMAT, "backend": cfg.actor.backend,
            "layout": {"actor_ranks": cfg.cluster.actor_ranks,
                       **({"tensor_parallel": m.tensor_parallel,
                           "expert_parallel": m.expert_parallel,
                           "expert_tensor_parallel": m.etp,
                           "pipeline_parallel": m.pipeline_parallel}
                          if cfg.actor.backend == "megatron" else {})}}
