"""`lockstep plan CONFIG [--set key=value ...] [--json]`: the cluster layout of an experiment,
worked out without a GPU, without Ray and without weights (the model's shapes come from its
config: `model.path` may be a folder holding only config.json).

    lockstep plan configs/cluster_qwen3_30b_a3b.yaml
    lockstep plan configs/cluster_qwen3_30b_a3b_colocated.yaml --set cluster.gpu_memory_gib=79.6
    lockstep plan configs/cluster_qwen3_30b_a3b.yaml --json > plan.json

Prints: the placement (actor ranks and rollout engines on nodes / GPUs, the megatron-core
TP x EP x PP x DP coordinates of each rank and the layers / experts it holds), memory
estimates per role (weights, gradients, Adam states by precision and sharding, activations;
each engine's weights and KV-cache budget; the per-step route and log-prob buffers from the
batch shape), the exact SGLang command of each engine and the megatron-core arguments.
A layout that does not fit (more GPUs than the cluster has, TP not dividing the heads, EP not
dividing the experts, an estimate over the GPU's memory, ...) is refused: the plan is still
printed, each reason follows on stderr, and the exit status is 2. Estimates, not
measurements: docs/cluster.md "Planning a cluster run" says what each one counts.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lockstep.kernels.dtypes import FP8, base_precision
from lockstep.launch.plan_estimate import GiB, Estimates, _stage_chunks, count_params
from lockstep.launch.plan_placement import Placement, _colocated_note, gpus_needed
from lockstep.launch.plan_render import render
from lockstep.trainer.actor.build import colocation_refusal
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.megatron import stage_layer_counts
from lockstep.trainer.config.types import ExperimentConfigError

# the TransformerConfig arguments (trainer/actor/megatron/layout.megatron_args) the plan prints
_PLAN_ARGS = ("tensor_model_parallel_size", "expert_model_parallel_size",
              "expert_tensor_parallel_size", "pipeline_model_parallel_size",
              "pipeline_model_parallel_layout", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "sequence_parallel", "num_layers",
              "hidden_size", "num_attention_heads", "num_query_groups", "num_moe_experts",
              "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
              "moe_router_dtype", "moe_enable_routing_replay", "moe_router_fusion",
              "moe_expert_capacity_factor", "moe_router_load_balancing_type",
              "moe_token_dispatcher_type", "moe_grouped_gemm", "params_dtype", "bf16", "fp16",
              "recompute_granularity")  # what the plan assumes when rollout.sglang leaves it unset
# a family's own switches, printed where its mapping sets them (gpt-oss: trainer/config/megatron.py)
_FAMILY_ARGS = ("activation_func", "add_bias_linear", "glu_linear_offset",
                "activation_func_clamp_value", "softmax_type", "window_size",
                "window_attn_skip_freq", "yarn_rotary_scaling_factor",
                "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


class PlanError(ExperimentConfigError):
    """The experiment's layout does not fit the cluster it describes (each reason named)."""


def _seq_len(cfg: ExperimentConfig) -> tuple[int, int]:
    """(longest prompt, longest response) of a step's rows; with rollout.env a row is a whole
    trajectory, which may fill the engines' context (the model's max_position_embeddings)."""
    if cfg.data.enabled:
        # unset lengths: at most what the trainer takes (from the data, within the context)
        context = cfg.model.max_position_embeddings
        prompt = cfg.data.prompt_cap(cfg.rollout.max_new_tokens, context)
        response = cfg.rollout.max_new_tokens or context - prompt
    else:
        from lockstep.rollout.tasks import Task

        task = Task(cfg.task)
        prompt, response = task.prompt_len, cfg.rollout.max_new_tokens or task.max_new_tokens
    if cfg.rollout.env is not None:
        response = cfg.model.max_position_embeddings - prompt
    return prompt, response


class _Plan(Estimates, Placement):
    """Builds the plan dict of one experiment; `refusals` collects why it does not fit."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.refusals: list[str] = []
        self.notes: list[str] = []

    def refuse(self, msg: str) -> None:
        if msg not in self.refusals:  # one per engine would say it again
            self.refusals.append(msg)

    # -- whole plan --------------------------------------------------------------------
    def build(self, source: str | None) -> dict[str, Any]:
        cfg = self.cfg
        self.pc = count_params(cfg.model)
        self.prompt_len, self.response_len = _seq_len(cfg)
        self.T = self.prompt_len + self.response_len
        c = cfg.cluster
        self.gpu = c.gpus_per_node > 0
        self.gpu_bytes = None if c.gpu_memory_gib is None else c.gpu_memory_gib * GiB
        if c.device == "cuda" and not self.gpu:
            self.refuse("cluster.device=cuda but cluster.gpus_per_node=0: say how many GPUs "
                        "each node has")
        if self.gpu and c.device == "cpu":
            self.notes.append(f"cluster.device=cpu: the actor ranks run on CPU bundles; only "
                              f"SGLang servers use the {c.gpus_per_node} GPUs per node")
        if c.nodes > 1 and not self.gpu and not c.cpus_per_node:
            self.notes.append("CPU-only cluster: Ray chooses the node of each bundle")
        if c.placement == "colocated":
            self.notes.append(_colocated_note(cfg))
        model = self._model()
        actor = self._actor()
        rollout = self._rollout()
        placement = self._placement(actor, rollout)
        self._memory_fit(actor, rollout)
        return {"config": source, "model": model,
                "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                            "gpus_total": c.nodes * c.gpus_per_node,
                            "gpu_memory_gib": c.gpu_memory_gib, "placement": c.placement,
                            "ray_address": c.ray_address},
                "placement": placement, "actor": actor, "rollout": rollout,
                "buffers": self._buffers(actor), "host": self._host(actor),
                "notes": self.notes,
                "refusals": self.refusals}

    def _model(self) -> dict[str, Any]:
        m, pc = self.cfg.model, self.pc
        return {"model_type": m.model_type, "path": m.path, "params": pc.total,
                "expert_params": pc.experts, "non_expert_params": pc.total - pc.experts,
                "layers": m.num_hidden_layers, "moe_layers": m.num_moe_layers,
                "experts": m.num_experts, "top_k": m.num_experts_per_tok,
                "attention_heads": m.num_attention_heads, "kv_heads": m.num_key_value_heads,
                "hidden_size": m.hidden_size, "vocab_size": m.vocab_size}

    # -- the actor ---------------------------------------------------------------------
    def _actor(self) -> dict[str, Any]:
        cfg, m = self.cfg, self.cfg.model
        a, N = cfg.actor, cfg.cluster.actor_ranks
        if a.backend == "megatron":
            o = a.megatron
            tp, ep, etp, pp = o.tensor_parallel, o.expert_parallel, o.etp, o.pipeline_parallel
            vpp, cp = o.vpp, o.context_parallel
        else:
            tp = ep = etp = pp = vpp = cp = 1
        self._check_actor_layout(N, tp, ep, etp, pp, cp)
        dp = max(1, N // (tp * cp * pp))
        edp = max(1, N // (etp * ep * pp))
        L = m.num_hidden_layers
        E = m.num_experts
        ranks = []
        stage_size = max(1, N // pp)
        for r in range(N):
            s, idx = r // stage_size, r % stage_size
            chunks = (_stage_chunks(m, a.megatron, s) if a.backend == "megatron"
                      else [[0, L]])
            e_rank = (idx // etp) % ep
            e_lo, e_hi = e_rank * (E // ep), (e_rank + 1) * (E // ep)
            # "layers": the stage's layers; under a virtual pipeline (not contiguous) null,
            # and "chunks" lists each model chunk's [lo, hi)
            # megatron-core's order tp-cp-ep-dp-pp: TP fastest, then CP, then DP (the expert
            # grid has no CP axis: expert DP spans the CP ranks)
            ranks.append({"rank": r, "pp": s, "tp": idx % tp, "cp": (idx // tp) % cp,
                          "dp": idx // (tp * cp),
                          "ep": e_rank, "etp": idx % etp, "edp": idx // (etp * ep),
                          "layers": chunks[0] if vpp == 1 else None, "chunks": chunks,
                          "experts": [e_lo, e_hi] if E else None})
        mem = self._actor_memory(tp, ep, etp, pp, dp)
        out = {"backend": a.backend, "ranks": N,
               "layout": {"tensor_parallel": tp, "expert_parallel": ep,
                          "expert_tensor_parallel": etp, "pipeline_parallel": pp,
                          # decoder layers per stage (layout.stage_layer_counts)
                          "pipeline_layers": stage_layer_counts(m, a.megatron)
                          if a.backend == "megatron" else [L],
                          "virtual_pipeline_parallel": vpp, "context_parallel": cp,
                          "data_parallel": dp, "expert_data_parallel": edp},
               "rank_layout": ranks, "memory_per_rank": mem}
        if a.backend == "megatron":
            out["megatron_args"] = self._megatron_args(tp, ep, etp, pp, dp)
        else:
            out["torch"] = {"data_parallel": N, "replica": "whole model on every rank (DDP)"}
        out["replay"] = _replay_plan(cfg.replay.mode.value, a.backend)
        out["replay"].update(_replay_options(cfg))
        return out

    def _check_actor_layout(self, N: int, tp: int, ep: int, etp: int, pp: int,
                            cp: int) -> None:
        """The megatron layout rules (trainer/config/megatron.py, what the actor enforces)."""
        cfg = self.cfg
        if cfg.actor.backend != "megatron":
            return
        if N == 1 and (tp, ep, etp, pp, cp) != (1, 1, 1, 1, 1):
            f = "actor.megatron."
            self.refuse(f"{f}tensor_parallel={tp}, expert_parallel={ep}, pipeline_parallel={pp} "
                        + (f"context_parallel={cp} " if cp > 1 else "") +
                        "need cluster.actor_ranks > 1 (the in-process actor is a world of one)")
            return
        from lockstep.trainer.config.megatron import layout_problems, precision_problems

        for why in (layout_problems(cfg.actor.megatron, cfg.model, N, on_gpu=self.gpu)
                    + precision_problems(cfg.actor, on_gpu=self.gpu)):
            self.refuse(why)

    def _megatron_args(self, tp: int, ep: int, etp: int, pp: int, dp: int) -> dict[str, Any]:
        """The megatron-core settings the actor passes for this layout (TransformerConfig,
        DDP and optimizer: `trainer/config/megatron.py`, the same functions the actor calls);
        `auto` = decided on the GPU node."""
        from lockstep.trainer.config.megatron import (actor_options, ddp_args, megatron_args,
                                                      optimizer_args)

        a = self.cfg.actor
        o = actor_options(a, a.megatron)
        te = "auto" if o.use_transformer_engine is None else o.use_transformer_engine
        args = megatron_args(self.cfg.model, o, use_te=te, on_gpu=self.gpu)
        out: dict[str, Any] = {}
        for k in _PLAN_ARGS:
            out[k] = args[k]
            if k == "virtual_pipeline_model_parallel_size":
                out["data_parallel_size"] = dp  # plan-only: what the layout leaves for DP
            elif k == "moe_grouped_gemm":
                out["use_transformer_engine"] = te  # the spec build_gpt_model is given
        if self.cfg.model.model_type == "gpt_oss":
            out.update({k: args[k] for k in _FAMILY_ARGS if k in args})
        ddp, opt = ddp_args(), optimizer_args(a, o)
        out["ddp"] = {k: ddp[k] for k in ("grad_reduce_in_fp32", "use_distributed_optimizer")}
        out["optimizer"] = {k: opt[k] for k in ("optimizer", "lr", "clip_grad")}
        if o.fp8:  # actor.fp8: TE's FP8 GEMMs
            out["fp8"], out["fp8_recipe"] = args["fp8"], args["fp8_recipe"]
        return out

    # -- the rollout -------------------------------------------------------------------
    def _rollout(self) -> dict[str, Any]:
        cfg = self.cfg
        ro, sg, m, c = cfg.rollout, cfg.rollout.sglang, cfg.model, cfg.cluster
        out: dict[str, Any] = {"backend": ro.backend, "engines": ro.num_engines,
                               "dtype": ro.dtype}
        if ro.backend == "vllm":
            return self._vllm_rollout(out)
        sglang = ro.backend == "sglang"
        if not sglang:
            urls = list(getattr(ro, "urls", None) or ([ro.url] if ro.url else []))
            n = {"embedded": 1, "http": len(urls)}.get(ro.backend, ro.num_engines)
            out["engines"] = n
            out["gpus_per_engine"] = 0
            out["note"] = {"embedded": "one embedded engine in the driver process (CPU)",
                           "ray": f"{n} embedded engines as Ray actors on CPU bundles",
                           "serve": f"{n} `lockstep serve` servers as Ray actors on CPU bundles",
                           "http": f"SGLang-compatible server(s) you run at {', '.join(urls)}",
                           }.get(ro.backend, f"rollout.backend={ro.backend}")
            if c.gpus_per_engine:
                self.refuse(f"cluster.gpus_per_engine={c.gpus_per_engine} with rollout.backend="
                            f"{ro.backend}: only SGLang and vLLM servers take GPUs")
            if ro.backend == "http" and ro.engine == "vllm":  # servers you launch: their args
                out["note"] = f"vLLM server(s) you run at {', '.join(urls)}"
                out["vllm_command"] = self._vllm_command(
                    {"local_index": 0, "gpus": list(range(ro.vllm.tp_size))}, host="0.0.0.0",
                    launched=False)
            return out
        g = sg.tp_size
        out["gpus_per_engine"] = g
        out["sglang"] = {"tp_size": sg.tp_size, "ep_size": sg.ep_size,
                         "moe_tp_size": sg.tp_size // sg.ep_size}
        self._tp_checks("sglang", "SGLang", g)
        if m.num_experts % sg.ep_size:
            self.refuse(f"rollout.sglang.ep_size={sg.ep_size} does not divide the model's "
                        f"num_experts={m.num_experts}")
        self._server_checks("sglang", "SGLang", g)
        if ro.router_dtype not in (None, base_precision(ro.dtype)):
            self.notes.append(f"rollout.router_dtype={ro.router_dtype}: SGLang has no router "
                              "dtype option; its router runs in --dtype")
        if ro.dtype == FP8:
            self.notes.append(
                "rollout.dtype=fp8: --dtype bfloat16 --quantization fp8; SGLang runs the block "
                "recipe (128x128 weight blocks, 1x128 activation groups) when model.path is a "
                "block-FP8 folder (quantization_config.weight_block_size, `*.weight_scale_inv`: "
                "`lockstep export HF --out DIR --dtype fp8` writes one), else per-tensor "
                "online FP8")
        if ro.mask_replay:
            cap = sg.sampling_mask_max_tokens or 4096
            if ro.top_k == -1 or ro.top_k > cap:
                self.notes.append(
                    f"sampling-mask replay sends a finite top_k <= --sampling-mask-max-tokens "
                    f"({cap}); rollout.top_k={ro.top_k}")
        self.notes.append("the fleet starts each SGLang server on its node's address with a free "
                          "port; the commands above show 0.0.0.0 / 127.0.0.1 and port 30000 + i")
        out["memory_per_gpu"] = self._engine_memory(g)
        return out

    def _tp_checks(self, name: str, label: str, g: int) -> None:
        """What an engine's tensor parallelism of `g` needs of the model's attention heads."""
        m = self.cfg.model
        if m.num_attention_heads % g:
            self.refuse(f"rollout.{name}.tp_size={g} does not divide the model's "
                        f"num_attention_heads={m.num_attention_heads}")
        kv = m.num_key_value_heads
        if not m.is_mla and (kv % g if g <= kv else g % kv):
            self.refuse(f"rollout.{name}.tp_size={g} and the model's num_key_value_heads={kv}: "
                        f"one must divide the other ({label} splits or replicates KV heads)")

    def _server_checks(self, name: str, label: str, g: int) -> None:
        """A launched server of `g` GPUs fits on one node and has an HF folder to load."""
        c = self.cfg.cluster
        if self.gpu and g > c.gpus_per_node:
            self.refuse(f"rollout.{name}.tp_size={g}: one {label} server spans at most one node "
                        f"here (cluster.gpus_per_node={c.gpus_per_node})")
        if not self.cfg.model.path:
            self.refuse(f"rollout.backend={name} needs model.path: {label} loads the policy "
                        f"from an HF folder")

    def _vllm_rollout(self, out: dict[str, Any]) -> dict[str, Any]:
        """rollout.backend=vllm: the servers' TP / expert-parallel sizes, what vLLM refuses,
        and the memory per GPU (the launch command of each engine: `_placement`)."""
        ro, vl, m = self.cfg.rollout, self.cfg.rollout.vllm, self.cfg.model
        g = vl.tp_size
        out["gpus_per_engine"] = g
        out["vllm"] = {"tp_size": g, "expert_parallel": vl.expert_parallel,
                       "experts": (f"sharded over the {g} GPUs (expert parallel)"
                                   if vl.expert_parallel else f"each TP-split {g} ways")}
        self._tp_checks("vllm", "vLLM", g)
        if vl.expert_parallel and m.num_experts % g:
            self.refuse(f"rollout.vllm.expert_parallel with tp_size={g}: it does not divide "
                        f"the model's num_experts={m.num_experts}")
        self._server_checks("vllm", "vLLM", g)
        if ro.mask_replay:
            self.notes.append("sampling-mask replay: the servers run --return-sampling-mask, "
                              "so every request goes out with top_k > 0 and temperature > 0 "
                              "(top_k=-1 as the vocabulary size)")
        self.notes.append("the fleet starts each vLLM server on its node's address with a free "
                          "port; the commands above show 0.0.0.0 / 127.0.0.1 and port 8000 + i; "
                          "weights move by vLLM's native weight transfer (/pause, "
                          "/start_weight_update, /update_weights per bucket, "
                          "/finish_weight_update, /resume)")
        out["memory_per_gpu"] = self._engine_memory(g, vl.gpu_memory_utilization or 0.9,
                                                    "vLLM", "rollout.vllm.gpu_memory_utilization")
        return out


def _replay_options(cfg: ExperimentConfig) -> dict[str, str]:
    """replay.gates / replay.partial where they are not the defaults (docs/replay.md)."""
    rp, out = cfg.replay, {}
    if rp.gates == "engine":
        out["gates"] = ("the engine's gate weights, straight-through" if rp.mode.value == "R3"
                        else "the old-logprob forward's recorded gate weights, straight-through")
    if rp.partial is not None:
        t = rp.partial.threshold
        out["partial"] = (f"only where the actor's router margin < {t:g}" if rp.partial.rule
                          == "margin" else f"only where the actor's own top-k mass exceeds "
                          f"the replayed experts' by <= {t:g}")
    return out


def _replay_plan(mode: str, backend: str) -> dict[str, str]:
    """Which routes the actor's forwards run under `replay.mode`."""
    mg = backend == "megatron"
    if mode == "R3":
        how = ("RouterReplay REPLAY_FORWARD of the engine's routes (REPLAY_BACKWARD when "
               "recomputing)" if mg else "the engine's routes replayed (lockstep.replay)")
        return {"mode": "R3", "old_logprob": how, "update": how}
    if mode == "R2":
        return {"mode": "R2",
                "old_logprob": ("RouterReplay RECORD" if mg else "routes recorded")
                + " (they stay on the rank)",
                "update": ("RouterReplay REPLAY_FORWARD" if mg else "replayed")
                + " of the recorded routes"}
    return {"mode": mode, "old_logprob": "natural routing", "update": "natural routing"}


def check_devices(cfg: ExperimentConfig, source: str | None = None) -> None:
    """Refuse, before any work, a run whose config plans GPUs that are not there (on a machine
    without them, no cluster.ray_address) or several nodes without a Ray cluster."""
    c = cfg.cluster
    why = colocation_refusal(cfg)  # a colocated layout the fleet cannot put in the ranks' bundles
    if cfg.rollout.backend == "sglang" and cfg.rollout.dtype == "fp8":
        raise PlanError(
            "rollout.dtype=fp8 with rollout.backend=sglang: SGLang's block-FP8 layers load FP8 "
            "weights with weight_scale_inv, and lockstep's weight pushes are bf16/fp32 tensors "
            "(FP8 pushes are not implemented). This layout can be planned (`lockstep plan "
            f"{source or 'CONFIG'}`) but not trained; rollout.backend=embedded, ray or serve "
            "run an FP8 engine (docs/precision.md)")
    if why is not None:
        raise PlanError(f"{why}. This layout can be planned (`lockstep plan {source or 'CONFIG'}`) "
                        "but not trained (docs/ray.md, \"Colocated placement\")")
    where = f"{source} plans" if source else "the config plans"
    hint = (f"`lockstep plan {source or 'CONFIG'}` shows the layout without GPUs; README "
            "\"Running on a cluster\" has the Ray commands")
    if c.nodes > 1 and c.ray_address is None:  # CPU-only nodes too: a local Ray is one machine
        raise PlanError(f"{where} {c.nodes} nodes (cluster.nodes={c.nodes}), which a run only "
                        "reaches through a running Ray cluster: start Ray on every node and "
                        f"pass --set cluster.ray_address=auto; {hint}")
    need = gpus_needed(cfg)
    if c.gpus_per_node == 0 or need == 0 or c.ray_address is not None:
        return  # CPU layouts; on a Ray cluster the placement group reserves (or names) the GPUs
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        raise PlanError(f"{where} {need} GPUs (cluster.gpus_per_node={c.gpus_per_node}, "
                        f"cluster.actor_ranks={c.actor_ranks}, rollout.backend={cfg.rollout.backend}) "
                        f"but this machine has {have} CUDA device(s); {hint}")


def make_plan(cfg: ExperimentConfig, source: str | None = None) -> dict[str, Any]:
    """The plan of `cfg` as a plain dict; `plan["refusals"]` lists why it does not fit."""
    return _Plan(cfg).build(source)


# -- command line ----------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="print the cluster layout, memory and launch commands of a "
                                    "config (no GPU, no Ray)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="experiment YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. cluster.gpu_memory_gib=79.6 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    plan = make_plan(cfg, str(args.config))
    print(json.dumps(plan, indent=2) if args.json else render(plan), flush=True)
    if plan["refusals"]:
        raise PlanError("the layout does not fit: " + "; ".join(
            f"({i}) {r}" for i, r in enumerate(plan["refusals"], 1)))
    return 0
