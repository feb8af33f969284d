"""The actor's part of a checkpoint, written by the actor ranks themselves and readable on any
layout: the weights as an HF folder (`hf/`) and Adam's moments under the same HF names
(`optim/exp_avg/`, `optim/exp_avg_sq/`, each an HF folder too), plus a small state (step
count, LR schedule) the driver stores in `trainer_state`.

Why HF names for the optimiser: Adam's moments have the shape of their weight and are
element-wise, so the exact HF <-> megatron-core conversion (`trainer/actor/megatron/convert.py`:
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

import torch
from safetensors.torch import save_file

from lockstep.moe.checkpoint import save_hf_state_dict, write_hf_extras
from lockstep.moe.config import ModelConfig
from lockstep.moe.hf_lazy import INDEX_FILE, CheckpointError
from lockstep.trainer.state.checkpoint import file_sha256

FORMAT = "lockstep-actor-ckpt/1"
OPTIM = "optim"
MOMENTS = ("exp_avg", "exp_avg_sq")
ADAM_KEYS = {"step", *MOMENTS}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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


def check_adam(state: dict, where: str) -> None:
    extra = set(state) - ADAM_KEYS
    if extra:
        raise CheckpointError(f"{where}: optimiser state has {sorted(extra)} besides "
                              f"{sorted(ADAM_KEYS)} (only Adam/AdamW without amsgrad is stored)")


def hf_mapping(folder: Path) -> Mapping[str, torch.Tensor]:
    """HF-named tensors of `folder` (the moments are HF folders), each read when asked, as
    stored (`LazyHF`)."""
    from lockstep.moe.hf_lazy import LazyHF
    return LazyHF(folder, dtype=None)


def read_moments(folder: Path) -> dict[str, Mapping[str, torch.Tensor]]:
    """The HF-named Adam moments of checkpoint `folder` (`optim/<moment>/`), read lazily."""
    return {m: hf_mapping(folder / OPTIM / m) for m in MOMENTS}


def actor_parts(actor, rank: int = 0, world: int = 1) -> tuple[Iterator[Part], dict]:
    """(the parts rank `rank` of `world` writes, the actor state): the actor's own
    `checkpoint_parts` (`TorchActor`, `MegatronActor`)."""
    return actor.checkpoint_parts(rank, world)


def actor_load(actor, folder: Path, state: dict) -> None:
    """Restore `actor`'s optimiser state from checkpoint `folder`: its own `load_checkpoint`."""
    actor.load_checkpoint(folder, state)


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
               "actor.megatron.pipeline_parallel", "actor.megatron.pipeline_layers",
               "actor.megatron.virtual_pipeline_parallel", "actor.megatron.context_parallel")
"""Config keys a checkpoint may be resumed across (left out of the run hash)."""


def without_layout(cfg) -> dict:
    """`cluster` and `actor` sections of `cfg` with the LAYOUT_KEYS at their defaults."""
    import dataclasses
    m = dataclasses.replace(cfg.actor.megatron, tensor_parallel=1, expert_parallel=1,
                            expert_tensor_parallel=None, pipeline_parallel=1,
                            pipeline_layers=None, virtual_pipeline_parallel=None,
                            context_parallel=1)
    return {"cluster": cfg.cluster.model_copy(update={"actor_ranks": 1}),
            "actor": cfg.actor.model_copy(update={"megatron": m})}


def layout_state(cfg) -> dict:
    """What a checkpoint records of the layout that wrote it (informational: loading reads
    the slices of the layout it runs on)."""
    from lockstep.trainer.config.megatron import stage_layer_counts
    m = cfg.actor.megatron
    return {"format": FORMAT, "backend": cfg.actor.backend,
            "layout": {"actor_ranks": cfg.cluster.actor_ranks,
                       **({"tensor_parallel": m.tensor_parallel,
                           "expert_parallel": m.expert_parallel,
                           "expert_tensor_parallel": m.etp,
                           "pipeline_parallel": m.pipeline_parallel,
                           **({"pipeline_layers": stage_layer_counts(cfg.model, m)}
                              if m.pipeline_parallel > 1 else {}),
                           **({"context_parallel": m.context_parallel}
                              if m.context_parallel > 1 else {})}
                          if cfg.actor.backend == "megatron" else {})}}
