"""The megatron actor's part of a checkpoint (trainer/actor/checkpoint.py has the format): each rank
gathers the parts it writes from the ranks that hold their shards, and reads back only its own
slices of the HF-named weights and Adam moments. `MegatronActor.checkpoint_parts` and
`MegatronActor.load_checkpoint` call these.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lockstep.moe.hf_lazy import CheckpointError
from lockstep.trainer.actor.checkpoint import MOMENTS, Part, check_adam, common_step, num_parts
from lockstep.trainer.actor.megatron import convert

_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def adam_states(actor) -> dict[str, tuple[Any, torch.nn.Parameter]]:
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
    return {n: main_of[id(p)] for m in actor.chunks
            for n, p in convert.global_names(m, dict(m.named_parameters())).items()
            if id(p) in main_of}


def _is_expert(megatron_name: str) -> bool:
    return ".mlp.experts." in megatron_name


def checkpoint_parts(actor) -> tuple[Iterator[Part], dict]:
    """(the parts this rank writes, the actor state). A collective over the world: every
    rank iterates the parts to the end. Part p is gathered to rank p % world only; of each
    shard, only data-parallel rank 0 (expert-data-parallel rank 0 for experts) sends it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    cfg = actor.model_cfg
    lay = convert.Layout.of_model(actor.chunks)
    local = {k: v for m in actor.chunks for k, v in convert.global_names(m, m.state_dict()).items()}
    adam = adam_states(actor)
    steps = []
    for name, (o, main) in adam.items():
        s = o.state.get(main)
        if s:
            check_adam(s, f"megatron {name}")
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


def load_checkpoint(actor, moments: Mapping[str, Mapping[str, torch.Tensor]], state: dict,
                    weights=None) -> None:
    """Give this megatron rank its slices of the HF-named moments + the step count (and,
    under a mixed-precision optimizer, its fp32 main weights from `weights`: the model was
    built from them, but in 16 bits; `weights()` gives the HF-named weights, read only then)."""
    cfg = actor.model_cfg
    lay = convert.Layout.of_model(actor.chunks)
    tp, ep, etp = convert._ranks()
    adam = adam_states(actor)
    step = state.get("step")
    params = {k: v for m in actor.chunks
              for k, v in convert.global_names(m, dict(m.named_parameters())).items()}
    # only this rank's slices are read (`hf_to_megatron_items` over a LazyHF): its stage's
    # layers, its EP rank's experts, its TP / ETP chunks
    shard = dict(layers=sorted(i for m in actor.chunks for i in convert.stage_layers(m).values()),
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
