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
import math
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from lockstep.kernels.dtypes import BY_NAME
from lockstep.rollout.colocate import (RANK_SHARE, SERVER_SHARE, colocates_fleet,
                                       colocation_refusal, engine_bundles)
from lockstep.trainer.config import ExperimentConfig, ExperimentConfigError, load_config

GiB = float(1 << 30)
SGLANG_DEFAULT_MEM_FRACTION = 0.9
# the TransformerConfig arguments (trainer/megatron/layout.megatron_args) the plan prints
_PLAN_ARGS = ("tensor_model_parallel_size", "expert_model_parallel_size",
              "expert_tensor_parallel_size", "pipeline_model_parallel_size",
              "virtual_pipeline_model_parallel_size", "sequence_parallel", "num_layers",
              "hidden_size", "num_attention_heads", "num_query_groups", "num_moe_experts",
              "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
              "moe_router_dtype", "moe_enable_routing_replay", "moe_router_fusion",
              "moe_expert_capacity_factor", "moe_router_load_balancing_type",
              "moe_token_dispatcher_type", "moe_grouped_gemm", "params_dtype", "bf16", "fp16",
              "recompute_granularity")  # what the plan assumes when rollout.sglang leaves it unset


class PlanError(ExperimentConfigError):
    """The experiment's layout does not fit the cluster it describes (each reason named)."""


# -- the model's parameters, by how they are sharded ------------------------------------------
@dataclass
class ParamCount:
    """Parameter counts of one model, split by how megatron-core / SGLang shard them."""

    embedding: int = 0      # vocab-parallel over TP (first pipeline stage)
    lm_head: int = 0        # vocab-parallel over TP (last stage); 0 when tied
    final_norm: int = 0     # replicated (last stage)
    # per decoder layer:
    layer_tp: list[int] = field(default_factory=list)    # attention, dense MLP, shared experts
    layer_rep: list[int] = field(default_factory=list)   # norms, router (replicated)
    layer_experts: list[int] = field(default_factory=list)  # routed experts (EP x ETP)

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.final_norm + sum(self.layer_tp)
                + sum(self.layer_rep) + sum(self.layer_experts))

    @property
    def experts(self) -> int:
        return sum(self.layer_experts)


_LAYER = re.compile(r"^layers\.(\d+)\.")


_COUNTS: dict[str, ParamCount] = {}


def count_params(model_cfg) -> ParamCount:
    """Exact parameter counts from the model built on the meta device (no memory, any family)."""
    import dataclasses

    key = json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str)
    if key not in _COUNTS:
        _COUNTS[key] = _count_params(model_cfg)
    return _COUNTS[key]


def _count_params(model_cfg) -> ParamCount:
    import torch

    from lockstep.moe.model import MoEModel

    with torch.device("meta"):
        model = MoEModel(model_cfg)
    L = model_cfg.num_hidden_layers
    pc = ParamCount(layer_tp=[0] * L, layer_rep=[0] * L, layer_experts=[0] * L)
    for name, p in model.named_parameters():
        n = p.numel()
        m = _LAYER.match(name)
        if m is None:
            if name.startswith("embed_tokens"):
                pc.embedding += n
            elif name.startswith("lm_head"):
                pc.lm_head += n
            else:
                pc.final_norm += n
            continue
        i = int(m.group(1))
        if ".mlp.experts." in name:
            pc.layer_experts[i] += n
        elif "norm" in name or ".mlp.gate." in name or "e_score_correction_bias" in name:
            pc.layer_rep[i] += n
        else:
            pc.layer_tp[i] += n
    return pc


# -- helpers -----------------------------------------------------------------------------------
def _gib(b: float) -> float:
    return round(b / GiB, 2)


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


def _stage_chunks(L: int, pp: int, vpp: int, stage: int) -> list[list[int]]:
    """[lo, hi) decoder layers of each model chunk of pipeline stage `stage` (one chunk
    without a virtual pipeline; chunk c holds (c * PP + stage) * n .. with n = L / (PP x VPP),
    megatron-core's interleaved assignment)."""
    n = max(1, L // (pp * vpp))
    return [[(c * pp + stage) * n, min(L, (c * pp + stage + 1) * n)] for c in range(vpp)]


def _seq_len(cfg: ExperimentConfig) -> tuple[int, int]:
    """(longest prompt, longest response) of a step's rows."""
    if cfg.data.enabled:
        return cfg.data.max_prompt_length, cfg.rollout.max_new_tokens or 0
    from lockstep.rollout.tasks import Task

    task = Task(cfg.task)
    return task.prompt_len, cfg.rollout.max_new_tokens or task.max_new_tokens


class _Plan:
    """Builds the plan dict of one experiment; `refusals` collects why it does not fit."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.refusals: list[str] = []
        self.notes: list[str] = []

    def refuse(self, msg: str) -> None:
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
        if c.nodes > 1 and not self.gpu:
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
            vpp = o.vpp
        else:
            tp = ep = etp = pp = vpp = 1
        self._check_actor_layout(N, tp, ep, etp, pp)
        dp = max(1, N // (tp * pp))
        edp = max(1, N // (etp * ep * pp))
        L = m.num_hidden_layers
        per_stage = max(1, L // pp)
        E = m.num_experts
        ranks = []
        stage_size = max(1, N // pp)
        for r in range(N):
            s, idx = r // stage_size, r % stage_size
            chunks = _stage_chunks(L, pp, vpp, s)
            e_rank = (idx // etp) % ep
            e_lo, e_hi = e_rank * (E // ep), (e_rank + 1) * (E // ep)
            # "layers": the stage's layers; under a virtual pipeline (not contiguous) null,
            # and "chunks" lists each model chunk's [lo, hi)
            ranks.append({"rank": r, "pp": s, "tp": idx % tp, "dp": idx // tp,
                          "ep": e_rank, "etp": idx % etp, "edp": idx // (etp * ep),
                          "layers": chunks[0] if vpp == 1 else None, "chunks": chunks,
                          "experts": [e_lo, e_hi] if E else None})
        mem = self._actor_memory(tp, ep, etp, pp, dp)
        out = {"backend": a.backend, "ranks": N,
               "layout": {"tensor_parallel": tp, "expert_parallel": ep,
                          "expert_tensor_parallel": etp, "pipeline_parallel": pp,
                          "virtual_pipeline_parallel": vpp,
                          "data_parallel": dp, "expert_data_parallel": edp},
               "rank_layout": ranks, "memory_per_rank": mem}
        if a.backend == "megatron":
            out["megatron_args"] = self._megatron_args(tp, ep, etp, pp, dp)
        else:
            out["torch"] = {"data_parallel": N, "replica": "whole model on every rank (DDP)"}
        out["replay"] = _replay_plan(cfg.replay.mode.value, a.backend)
        return out

    def _check_actor_layout(self, N: int, tp: int, ep: int, etp: int, pp: int) -> None:
        """The megatron layout rules (trainer/megatron/layout.py, what the actor enforces)."""
        cfg = self.cfg
        if cfg.actor.backend != "megatron":
            return
        if N == 1 and (tp, ep, etp, pp) != (1, 1, 1, 1):
            f = "actor.megatron."
            self.refuse(f"{f}tensor_parallel={tp}, expert_parallel={ep}, pipeline_parallel={pp} "
                        "need cluster.actor_ranks > 1 (the in-process actor is a world of one)")
            return
        from lockstep.trainer.megatron.layout import layout_problems, precision_problems

        for why in (layout_problems(cfg.actor.megatron, cfg.model, N, on_gpu=self.gpu)
                    + precision_problems(cfg.actor, on_gpu=self.gpu)):
            self.refuse(why)

    def _actor_memory(self, tp: int, ep: int, etp: int, pp: int, dp: int) -> dict[str, Any]:
        """Bytes per actor rank on the fullest pipeline stage."""
        cfg, pc, m = self.cfg, self.pc, self.cfg.model
        a = cfg.actor
        L = m.num_hidden_layers
        megatron = a.backend == "megatron"
        vpp = a.megatron.vpp if megatron else 1
        best = None
        for s in range(pp if megatron else 1):
            spans = _stage_chunks(L, pp, vpp, s) if megatron else [[0, L]]
            sharded = sum(sum(pc.layer_tp[lo:hi]) for lo, hi in spans)
            rep = sum(sum(pc.layer_rep[lo:hi]) for lo, hi in spans)
            experts = sum(sum(pc.layer_experts[lo:hi]) for lo, hi in spans)
            if s == 0:
                sharded += pc.embedding
            if s == (pp - 1 if megatron else 0):
                sharded += pc.lm_head
                rep += pc.final_norm
            if megatron:
                n = sharded / tp + rep + experts / (ep * etp)
                n_exp = experts / (ep * etp)
            else:
                n, n_exp = sharded + rep + experts, experts
            if best is None or n > best[0]:
                best = (n, n_exp, s)
        n, n_exp, stage = best
        pb = BY_NAME[a.dtype].bytes
        if megatron:
            # DDP grad buffers in fp32 (grad_reduce_in_fp32), fp32 master copy when the
            # parameters are 16-bit, Adam's two fp32 moments; no distributed optimizer, so
            # nothing is sharded over data parallel.
            weights, grads = n * pb, n * 4
            master = n * 4 if pb != 4 else 0
            adam = n * 8
            how = ("params in actor.dtype, fp32 grad buffers, fp32 master copy (16-bit params), "
                   "Adam m+v fp32; optimizer not sharded over DP (use_distributed_optimizer=False)")
        else:
            # fp32 master + fp32 grads + AdamW m, v; a 16-bit compute copy (and its grads)
            low = any(d not in (None, "fp32") for d in (a.dtype, a.router_dtype, a.lm_head_dtype))
            weights, grads, adam = n * 4, n * 4, n * 8
            master = n * 4 if low else 0  # the cast compute copy + its grads (2 x 2 bytes)
            how = ("torch actor: fp32 master + fp32 grads + AdamW m+v on every rank (DDP), plus "
                   "a 16-bit compute copy with its grads when actor.dtype is not fp32")
        static = weights + grads + master + adam
        act = self._activations(tp, etp, pp) if megatron else self._activations(1, 1, 1)
        return {"params": int(n), "expert_params": int(n_exp), "fullest_stage": stage,
                "weights_bytes": int(weights), "grads_bytes": int(grads),
                "master_bytes": int(master), "adam_bytes": int(adam),
                "static_bytes": int(static), "activations_bytes": int(act),
                "peak_bytes": int(static + act), "precision": how}

    def _activations(self, tp: int, etp: int, pp: int) -> float:
        """Rough activation bytes of one rank: one micro-batch's tokens through the layers
        (1F1B keeps up to PP micro-batches in flight on the first stage), plus fp32 logits."""
        cfg, m = self.cfg, self.cfg.model
        a = cfg.actor
        tokens = a.max_tokens_per_micro_batch or a.micro_batch_size * self.T
        b = BY_NAME[a.dtype].bytes
        H, K, I = m.hidden_size, m.num_experts_per_tok, m.moe_intermediate_size
        full = 17 * H * b / tp + K * (H + 3 * I) * b / etp  # attention/norms (SP) + experts
        L = m.num_hidden_layers
        recompute = a.backend == "megatron" and a.megatron.recompute_activations
        per_layer = H * b / tp if recompute else full  # recompute keeps each layer's input
        layers = L  # L/PP layers x PP micro-batches in flight
        vpp = a.megatron.vpp if a.backend == "megatron" else 1
        if vpp > 1:  # interleaved 1F1B keeps (1 + (PP-1)/(PP x VPP)) x that (Narayanan 2021)
            layers = L * (1 + (pp - 1) / (pp * vpp))
        logits = tokens * math.ceil(m.vocab_size / tp) * 4
        return tokens * (per_layer * layers + (full if recompute else 0)) + logits

    def _megatron_args(self, tp: int, ep: int, etp: int, pp: int, dp: int) -> dict[str, Any]:
        """The megatron-core settings the actor passes for this layout (TransformerConfig,
        DDP and optimizer: `trainer/megatron/layout.py`, the same functions the actor calls);
        `auto` = decided on the GPU node."""
        from lockstep.trainer.megatron.layout import (actor_options, ddp_args, megatron_args,
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
        ddp, opt = ddp_args(), optimizer_args(a, o)
        out["ddp"] = {k: ddp[k] for k in ("grad_reduce_in_fp32", "use_distributed_optimizer")}
        out["optimizer"] = {k: opt[k] for k in ("optimizer", "lr", "clip_grad")}
        return out

    # -- the rollout -------------------------------------------------------------------
    def _rollout(self) -> dict[str, Any]:
        cfg = self.cfg
        ro, sg, m, c = cfg.rollout, cfg.rollout.sglang, cfg.model, cfg.cluster
        out: dict[str, Any] = {"backend": ro.backend, "engines": ro.num_engines,
                               "dtype": ro.dtype}
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
                            f"{ro.backend}: only SGLang servers take GPUs")
            return out
        g = sg.tp_size
        out["gpus_per_engine"] = g
        out["sglang"] = {"tp_size": sg.tp_size, "ep_size": sg.ep_size,
                         "moe_tp_size": sg.tp_size // sg.ep_size}
        if m.num_attention_heads % g:
            self.refuse(f"rollout.sglang.tp_size={g} does not divide the model's "
                        f"num_attention_heads={m.num_attention_heads}")
        kv = m.num_key_value_heads
        if not m.is_mla and (kv % g if g <= kv else g % kv):
            self.refuse(f"rollout.sglang.tp_size={g} and the model's num_key_value_heads={kv}: "
                        "one must divide the other (SGLang splits or replicates KV heads)")
        if m.num_experts % sg.ep_size:
            self.refuse(f"rollout.sglang.ep_size={sg.ep_size} does not divide the model's "
                        f"num_experts={m.num_experts}")
        if self.gpu and g > c.gpus_per_node:
            self.refuse(f"rollout.sglang.tp_size={g}: one SGLang server spans at most one node "
                        f"here (cluster.gpus_per_node={c.gpus_per_node})")
        if not m.path:
            self.refuse("rollout.backend=sglang needs model.path: SGLang loads the policy "
                        "from an HF folder")
        if ro.router_dtype not in (None, ro.dtype):
            self.notes.append(f"rollout.router_dtype={ro.router_dtype}: SGLang has no router "
                              "dtype option; its router runs in --dtype")
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

    def _engine_memory(self, g: int) -> dict[str, Any]:
        cfg, pc, m = self.cfg, self.pc, self.cfg.model
        ro, sg = cfg.rollout, cfg.rollout.sglang
        b = BY_NAME[ro.dtype].bytes
        sharded = sum(pc.layer_tp) + pc.embedding + pc.lm_head
        rep = sum(pc.layer_rep) + pc.final_norm
        # experts: ep_size-way expert parallel x (tp/ep)-way expert TP = split over all tp GPUs
        weights = (sharded / g + rep + pc.experts / g) * b
        L = m.num_hidden_layers
        if m.is_mla:  # SGLang caches the compressed latent + the rope key, on every TP rank
            per_token = L * (m.kv_lora_rank + m.qk_rope_head_dim) * b
        else:
            per_token = L * 2 * max(1, m.num_key_value_heads // g) * m.head_dim * b
        frac = sg.mem_fraction_static or SGLANG_DEFAULT_MEM_FRACTION
        seqs = math.ceil(ro.batch_size / max(1, ro.num_engines))
        out = {"weights_bytes": int(weights),
               "kv_bytes_per_token": int(per_token),
               "mem_fraction_static": frac,
               "step_tokens_per_engine": seqs * self.T,
               "sequences_per_engine": seqs}
        if self.gpu_bytes is not None:
            budget = frac * self.gpu_bytes - weights
            cap = int(max(0.0, budget) // per_token)
            out.update({"static_bytes": int(frac * self.gpu_bytes), "kv_budget_bytes": int(budget),
                        "kv_tokens": cap,
                        "step_fits_at_once": cap >= seqs * self.T})
            if budget <= 0:
                self.refuse(f"SGLang engine: weights {_gib(weights)} GiB per GPU exceed "
                            f"rollout.sglang.mem_fraction_static={frac} x "
                            f"cluster.gpu_memory_gib={self.cfg.cluster.gpu_memory_gib} = "
                            f"{_gib(frac * self.gpu_bytes)} GiB: no room for a KV cache")
            elif cap < self.T:
                self.refuse(f"SGLang engine: KV budget {_gib(budget)} GiB holds {cap} tokens, "
                            f"less than one row of {self.T} (prompt {self.prompt_len} + "
                            f"response {self.response_len})")
        return out

    # -- placement ---------------------------------------------------------------------
    def _placement(self, actor: dict, rollout: dict) -> dict[str, Any]:
        c, ro = self.cfg.cluster, self.cfg.rollout
        N = c.actor_ranks
        M, g = rollout["engines"], rollout.get("gpus_per_engine", 0)
        sglang = ro.backend == "sglang"
        if not self.gpu:
            for r in actor["rank_layout"]:
                r["bundle"] = r["rank"] if N > 1 else None
                r["node"], r["gpu"] = None, None
            engines = [{"engine": e, "node": None, "gpus": [], "bundle": e} for e in range(M)]
            if colocates_fleet(self.cfg) and N >= M > 0:  # in the actor ranks' bundles
                for x, b in zip(engines, engine_bundles(N, M)):
                    x["bundle"], x["shares_bundle_with_actor_rank"] = None, b
            if sglang:
                self.refuse("rollout.backend=sglang needs GPUs: set cluster.gpus_per_node")
            return {"actor_bundles": ([{"CPU": 1.0}] * N) if N > 1 else [],
                    "engines": engines, "gpus_needed": 0,
                    "note": "CPU bundles; the actor runs in the driver process"
                            if N == 1 else "CPU bundles (Ray chooses the nodes: PACK)"}
        G, gpn = c.nodes * c.gpus_per_node, c.gpus_per_node
        colocated = c.placement == "colocated"
        need = gpus_needed(self.cfg)
        N_cpu, N = N, (N if c.device != "cpu" else 0)  # actor ranks on GPUs
        if need > G:
            how = (f"max(actor ranks {N}, engines {M} x {g} GPUs)" if colocated
                   else f"{N} actor ranks + {M} engines x {g} GPUs")
            self.refuse(f"the layout needs {need} GPUs ({how}, cluster.placement="
                        f"{c.placement}) but the cluster has {G} (cluster.nodes={c.nodes} x "
                        f"cluster.gpus_per_node={gpn})")
        # actor ranks: one GPU bundle each, one placement group (PACK fills node by node)
        for r in actor["rank_layout"]:
            k = r["rank"]
            r["bundle"] = k if N_cpu > 1 else None  # one rank: the driver process itself
            r["node"], r["gpu"] = (k // gpn, k % gpn) if k < min(N, G) else (None, None)
        free = [list(range(gpn)) for _ in range(c.nodes)]
        if not colocated:
            for k in range(min(N, G)):
                free[k // gpn].remove(k % gpn)
        engines = []
        for e in range(M if sglang else 0):
            node = next((n for n in range(c.nodes) if len(free[n]) >= g), None)
            b = engine_bundles(N, M)[e] if N else 0
            if colocated and N and M * g <= N and b // gpn == (b + g - 1) // gpn:
                # where `lockstep train` puts it: from the bundle (GPU) of actor rank e * N // M
                node, gpus = b // gpn, [(b + j) % gpn for j in range(g)]
                engines.append({"engine": e, "node": node, "gpus": gpus,
                                "local_index": sum(1 for x in engines if x["node"] == node),
                                "shares_gpus_with_actor_ranks": list(range(b, b + g))})
                continue
            if node is None:
                engines.append({"engine": e, "node": None, "gpus": []})
                continue
            gpus, free[node] = free[node][:g], free[node][g:]
            share = [r["rank"] for r in actor["rank_layout"]
                     if r["node"] == node and r["gpu"] in gpus] if colocated else []
            engines.append({"engine": e, "node": node, "gpus": gpus,
                            "local_index": sum(1 for x in engines if x["node"] == node),
                            "shares_gpus_with_actor_ranks": share})
        lost = [x["engine"] for x in engines if x["node"] is None]
        if lost and need <= G:
            self.refuse(f"engines {lost} find no node with {g} free GPUs (an SGLang server "
                        "stays on one node): change rollout.sglang.tp_size or the placement")
        if need < G:
            self.notes.append(f"{G - need} of the cluster's {G} GPUs stay idle")
        for x in engines:
            x["command"] = self._sglang_command(x) if x["node"] is not None else None
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if N else {})}
        return {"actor_bundles": [bundle] * N_cpu if N_cpu > 1 else [],
                "engines": engines, "gpus_needed": need, "gpus_total": G}

    def _sglang_command(self, engine: dict) -> dict[str, Any]:
        from lockstep.rollout.sglang_options import sglang_server_config

        cfg = self.cfg
        host = "0.0.0.0" if cfg.cluster.nodes > 1 else "127.0.0.1"
        try:
            sc = sglang_server_config(cfg, engine["local_index"], host=host,
                                      model_path=cfg.model.path or "MODEL_PATH")
        except ValueError as e:
            self.refuse(str(e))
            return {}
        argv = sc.command()
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, engine["gpus"])),
               "SGLANG_RETURN_ORIGINAL_LOGPROB": sc.env()["SGLANG_RETURN_ORIGINAL_LOGPROB"]}
        line = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(argv)
        return {"argv": argv, "env": env, "shell": line}

    # -- memory fit --------------------------------------------------------------------
    def _memory_fit(self, actor: dict, rollout: dict) -> None:
        c = self.cfg.cluster
        if self.gpu_bytes is None:
            if self.gpu:
                self.notes.append("cluster.gpu_memory_gib is not set: memory not checked")
            return
        mem = actor["memory_per_rank"]
        G = c.gpu_memory_gib
        on_gpu = self.gpu and c.device != "cpu"
        if on_gpu and mem["peak_bytes"] > self.gpu_bytes:
            self.refuse(f"actor rank: estimated peak {_gib(mem['peak_bytes'])} GiB (static "
                        f"{_gib(mem['static_bytes'])} + activations "
                        f"{_gib(mem['activations_bytes'])}) exceeds "
                        f"cluster.gpu_memory_gib={G}: raise expert_parallel / tensor_parallel / "
                        "pipeline_parallel, turn on actor.megatron.recompute_activations or "
                        "lower actor.max_tokens_per_micro_batch")
        eng = rollout.get("memory_per_gpu")
        if c.placement == "colocated" and eng and on_gpu:
            # the actor's weights, grads and Adam states stay on the GPU while SGLang generates;
            # with loop.max_staleness >= 1 SGLang generates while the actor trains (no release)
            frac = eng["mem_fraction_static"]
            overlap = getattr(self.cfg.loop, "max_staleness", 0) > 0
            actor_part = mem["peak_bytes"] if overlap else mem["static_bytes"]
            rollout_phase = actor_part + frac * self.gpu_bytes
            eng["colocated_rollout_phase_bytes"] = int(rollout_phase)
            eng["colocated_train_phase_bytes"] = int(rollout_phase) if overlap else mem["peak_bytes"]
            eng["colocated_overlap"] = overlap
            if rollout_phase > self.gpu_bytes:
                room = (self.gpu_bytes - actor_part) / self.gpu_bytes
                what = ("peak (it trains while SGLang generates: loop.max_staleness="
                        f"{self.cfg.loop.max_staleness})" if overlap else "resident")
                self.refuse(f"colocated: the actor's {what} {_gib(actor_part)} GiB + SGLang's "
                            f"mem_fraction_static={frac} x {G} GiB = {_gib(rollout_phase)} GiB "
                            f"exceeds cluster.gpu_memory_gib={G}; set "
                            f"rollout.sglang.mem_fraction_static below {max(0.0, room):.2f}")

    # -- host memory -------------------------------------------------------------------
    def _host(self, actor: dict) -> dict[str, Any]:
        """Host RAM while the run starts. One rank: the driver holds the fp32 policy (the
        in-process actor). An actor group (`trainer.loop.lean_startup`): the driver and the
        object store hold no weights; each rank reads its own part of the HF folder one tensor
        at a time, so its start-up peak is its shard (`memory_per_rank.weights_bytes`; a
        torch DDP rank: the whole model) plus about the largest tensor it reads (fp32)."""
        c, m = self.cfg.cluster, self.cfg.model
        full = 4 * self.pc.total
        N = c.actor_ranks
        per_node = min(N, c.gpus_per_node) if self.gpu and c.device != "cpu" else N
        if N == 1:
            out = {"mode": "in-process", "driver_bytes": full, "object_store_bytes": 0,
                   "rank_startup_bytes": 0, "largest_read_bytes": 0, "ranks_per_node": 0}
        else:
            lay = actor["layout"]
            tp = lay["tensor_parallel"] if self.cfg.actor.backend == "megatron" else 1
            etp = lay["expert_tensor_parallel"] if self.cfg.actor.backend == "megatron" else 1
            D = m.hidden_size
            attn = 0 if m.is_mla else m.num_attention_heads * m.head_dim * D  # q_proj, o_proj
            largest = 4 * max(m.vocab_size * D // tp, attn // tp,
                              2 * m.intermediate_size * D // tp,  # linear_fc1 = [gate; up]
                              2 * (m.moe_intermediate_size or 0) * D // etp)
            shard = actor["memory_per_rank"]["weights_bytes"]
            out = {"mode": "from-folder", "driver_bytes": 0, "object_store_bytes": 0,
                   "rank_startup_bytes": shard + largest, "largest_read_bytes": largest,
                   "ranks_per_node": per_node}
        out["node_peak_bytes"] = (out["driver_bytes"] + out["object_store_bytes"]
                                  + out["rank_startup_bytes"] * out["ranks_per_node"])
        return out

    # -- per-step buffers --------------------------------------------------------------
    def _buffers(self, actor: dict) -> dict[str, Any]:
        cfg, m = self.cfg, self.cfg.model
        ro = cfg.rollout
        B, T = ro.batch_size, self.T
        Lm, K, E = m.num_moe_layers, m.num_experts_per_tok, m.num_experts
        rb = 1 if E <= 256 else 2
        dp = actor["layout"]["data_parallel"]
        routes = B * T * Lm * K * rb
        wire = B * T * m.num_hidden_layers * K * 4 * 4 / 3  # SGLang: int32, base64
        logprobs = 3 * B * T * 4  # rollout, old, new: fp32 [B, T]
        out = {"rows": B, "row_tokens": T, "prompt_tokens": self.prompt_len,
               "response_tokens": self.response_len,
               "routes_dtype": "uint8" if rb == 1 else "uint16",
               "routes_bytes": int(routes), "routes_per_dp_rank_bytes": int(routes / dp),
               "routes_on_the_wire_bytes": int(wire) if ro.backend == "sglang" else None,
               "logprobs_bytes": logprobs, "logprobs_per_dp_rank_bytes": int(logprobs / dp)}
        if ro.mask_replay:
            S = ro.top_k if ro.top_k > 0 else (ro.sglang.sampling_mask_max_tokens or 4096)
            cb = 2 if m.vocab_size <= 32767 else 4
            cand = B * self.response_len * S * cb
            out.update({"candidates_per_token": S, "candidates_bytes": int(cand),
                        "candidates_per_dp_rank_bytes": int(cand / dp)})
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


def gpus_needed(cfg: ExperimentConfig) -> int:
    """GPUs the layout takes: actor ranks (on cuda) and SGLang servers, shared if colocated."""
    c, ro = cfg.cluster, cfg.rollout
    actor = c.actor_ranks if c.device != "cpu" else 0
    engines = ro.num_engines * ro.sglang.tp_size if ro.backend == "sglang" else 0
    return max(actor, engines) if c.placement == "colocated" else actor + engines


def _colocated_note(cfg: ExperimentConfig) -> str:
    """What `lockstep train` does with a colocated layout (or why it refuses it)."""
    why = colocation_refusal(cfg)
    if why is not None:
        return f"colocated: planned only, `lockstep train` refuses it: {why}"
    if not colocates_fleet(cfg):
        return (f"cluster.placement=colocated with rollout.backend={cfg.rollout.backend}: no "
                f"fleet of servers to place (serve and sglang are placed)")
    return (f"colocated: `lockstep train` runs server i in the placement-group bundle of actor "
            f"rank i x {cfg.cluster.actor_ranks} // {cfg.rollout.num_engines} with "
            f"{SERVER_SHARE} of its CPU/GPU (the rank: {RANK_SHARE}); the servers release their "
            f"memory while the actor trains (rollout/colocate.py)")


def check_devices(cfg: ExperimentConfig, source: str | None = None) -> None:
    """Refuse, before any work, a run whose config plans GPUs that are not there (on a machine
    without them, no cluster.ray_address) or several nodes without a Ray cluster."""
    c = cfg.cluster
    why = colocation_refusal(cfg)  # a colocated layout the fleet cannot put in the ranks' bundles
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


# -- text ----------------------------------------------------------------------------------
def _size(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= k:
            return f"{b / k:.2f} {unit}"
    return f"{int(b)} B"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{int(n)}"


def render(p: dict[str, Any]) -> str:
    """The plan as the text `lockstep plan` prints."""
    out: list[str] = []
    w = out.append
    m, c, a, ro = p["model"], p["cluster"], p["actor"], p["rollout"]
    w(f"lockstep plan: {p['config'] or '(defaults)'}")
    w(f"model    {m['model_type']}, {_count(m['params'])} params ({_count(m['expert_params'])} "
      f"in experts), {m['layers']} layers ({m['moe_layers']} MoE), {m['experts']} experts "
      f"top-{m['top_k']}, {m['attention_heads']} heads / {m['kv_heads']} KV heads, vocab "
      f"{m['vocab_size']}" + (f", from {m['path']}" if m["path"] else ""))
    gpus = (f"{c['nodes']} node(s) x {c['gpus_per_node']} GPUs = {c['gpus_total']} GPUs"
            + (f" of {c['gpu_memory_gib']} GiB" if c["gpu_memory_gib"] else "")
            if c["gpus_per_node"] else f"{c['nodes']} node(s), CPU only")
    w(f"cluster  {gpus}, placement {c['placement']}"
      + (f", {p['placement']['gpus_needed']} GPUs used" if c["gpus_per_node"] else ""))
    w("")
    lay = a["layout"]
    w(f"actor    {a['backend']}, {a['ranks']} rank(s): TP {lay['tensor_parallel']} x EP "
      f"{lay['expert_parallel']} (ETP {lay['expert_tensor_parallel']}) x PP "
      f"{lay['pipeline_parallel']}"
      + (f" (VPP {lay['virtual_pipeline_parallel']})" if lay['virtual_pipeline_parallel'] > 1
         else "") + f" x DP {lay['data_parallel']} (expert DP "
      f"{lay['expert_data_parallel']})")
    for r in a["rank_layout"]:
        where = (f"node {r['node']} GPU {r['gpu']}" if r.get("node") is not None
                 else f"bundle {r['bundle']}" if r.get("bundle") is not None else "driver")
        ex = f"  experts {_span(*r['experts'])}" if r["experts"] else ""
        w(f"  rank {r['rank']:>3}  {where:<16} pp {r['pp']} tp {r['tp']} dp {r['dp']} ep "
          f"{r['ep']} etp {r['etp']}  layers "
          + (" | ".join(_span(*c) for c in r["chunks"]) + " (chunks)"
             if len(r["chunks"]) > 1 else _span(*r["chunks"][0])) + ex)
    mem = a["memory_per_rank"]
    w(f"  memory per rank (pipeline stage {mem['fullest_stage']}: {_count(mem['params'])} "
      f"params, {_count(mem['expert_params'])} of them experts):")
    w(f"    weights {_size(mem['weights_bytes'])} + grads {_size(mem['grads_bytes'])} + master "
      f"{_size(mem['master_bytes'])} + Adam {_size(mem['adam_bytes'])} = static "
      f"{_size(mem['static_bytes'])}; activations ~{_size(mem['activations_bytes'])}; "
      f"peak ~{_size(mem['peak_bytes'])}")
    w(f"    ({mem['precision']})")
    rp = a["replay"]
    w(f"  replay {rp['mode']}: old log-probs: {rp['old_logprob']}; update: {rp['update']}")
    if "megatron_args" in a:
        w("  megatron-core arguments:")
        for k, v in a["megatron_args"].items():
            w(f"    {k} = {json.dumps(v)}")
    w("")
    w(f"rollout  {ro['backend']}, {ro['engines']} engine(s), dtype {ro['dtype']}"
      + (f", {ro['gpus_per_engine']} GPU(s) each" if ro.get("gpus_per_engine") else "")
      + (f": {ro['note']}" if ro.get("note") else ""))
    if "sglang" in ro:
        s = ro["sglang"]
        w(f"  SGLang TP {s['tp_size']} x EP {s['ep_size']} (expert TP {s['moe_tp_size']})")
    em = ro.get("memory_per_gpu")
    if em:
        w(f"  memory per GPU: weights {_size(em['weights_bytes'])}, KV cache "
          f"{_size(em['kv_bytes_per_token'])} per token, mem_fraction_static "
          f"{em['mem_fraction_static']}")
        if "kv_budget_bytes" in em:
            w(f"  KV budget {_size(em['kv_budget_bytes'])} = {em['kv_tokens']} tokens; a step "
              f"is {em['sequences_per_engine']} rows x {p['buffers']['row_tokens']} tokens = "
              f"{em['step_tokens_per_engine']} per engine ("
              + ("fits at once" if em["step_fits_at_once"] else "generated in waves") + ")")
        if em.get("colocated_overlap"):
            w(f"  colocated, per GPU: {_size(em['colocated_rollout_phase_bytes'])} (the actor "
              "trains while SGLang generates, loop.max_staleness >= 1: actor peak + SGLang)")
        elif "colocated_rollout_phase_bytes" in em:
            w(f"  colocated, per GPU: rollout phase {_size(em['colocated_rollout_phase_bytes'])} "
              f"(actor resident + SGLang), train phase "
              f"{_size(em['colocated_train_phase_bytes'])} (SGLang released)")
    for e in p["placement"]["engines"]:
        if e.get("command"):
            w(f"  engine {e['engine']}: node {e['node']} GPUs {e['gpus']}"
              + (f" (shared with actor ranks {e['shares_gpus_with_actor_ranks']})"
                 if e.get("shares_gpus_with_actor_ranks") else ""))
            w(f"    {e['command']['shell']}")
    w("")
    b = p["buffers"]
    w(f"buffers per step: {b['rows']} rows x {b['row_tokens']} tokens (prompt "
      f"{b['prompt_tokens']} + response {b['response_tokens']})")
    w(f"  routes ({b['routes_dtype']}) {_size(b['routes_bytes'])}, "
      f"{_size(b['routes_per_dp_rank_bytes'])} per DP rank"
      + (f"; {_size(b['routes_on_the_wire_bytes'])} as SGLang sends them (base64 int32)"
         if b.get("routes_on_the_wire_bytes") is not None else ""))
    w(f"  log-probs (rollout, old, new; fp32) {_size(b['logprobs_bytes'])}, "
      f"{_size(b['logprobs_per_dp_rank_bytes'])} per DP rank")
    if "candidates_bytes" in b:
        w(f"  sampling-mask candidate sets ({b['candidates_per_token']} per token) "
          f"{_size(b['candidates_bytes'])}, {_size(b['candidates_per_dp_rank_bytes'])} per DP rank")
    h = p["host"]
    if h["mode"] == "in-process":
        w(f"host memory while starting: driver {_size(h['driver_bytes'])} (the fp32 policy of the "
          f"in-process actor)")
    else:
        w(f"host memory while starting: driver 0, object store 0 (every rank reads its part of "
          f"the HF folder); a rank's start-up peak {_size(h['rank_startup_bytes'])} = its shard "
          f"+ the largest tensor it reads ({_size(h['largest_read_bytes'])}); "
          f"{_size(h['node_peak_bytes'])} on a node with {h['ranks_per_node']} ranks")
    for n in p["notes"]:
        w(f"note: {n}")
    return "\n".join(out)


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
