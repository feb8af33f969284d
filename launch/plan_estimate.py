"""`lockstep plan`'s estimates: the model's parameters by how they are sharded (counted on the
meta device), memory per actor rank and per SGLang GPU, the per-step buffers, host memory at
start-up, and whether it all fits (docs/cluster.md "Planning a cluster run" says what each
one counts). A mixin of `plan._Plan` (its `cfg`, `pc`, `T`, `gpu`, `gpu_bytes`, `refuse`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from lockstep.kernels.dtypes import BY_NAME, FP8, base_precision

GiB = float(1 << 30)
SGLANG_DEFAULT_MEM_FRACTION = 0.9


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


def _gib(b: float) -> float:
    return round(b / GiB, 2)



def _stage_chunks(model, opts, stage: int) -> list[list[int]]:
    """[lo, hi) decoder layers of each model chunk of pipeline stage `stage` of `model` laid
    out as the MegatronOptions `opts` (`layout.chunk_layers`, the rule the actor builds by:
    one chunk without a virtual pipeline, uneven stages by `stage_layer_counts`); a chunk a
    refused layout leaves empty is [lo, lo]."""
    from lockstep.trainer.config.megatron import chunk_layers

    out, lo = [], 0
    for c in chunk_layers(model, opts, stage):
        lo = c[0] if c else lo
        out.append([lo, lo + len(c)])
    return out


class Estimates:
    """Memory estimates of `plan._Plan` (see the module docstring)."""

    def _actor_memory(self, tp: int, ep: int, etp: int, pp: int, dp: int) -> dict[str, Any]:
        """Bytes per actor rank on the fullest pipeline stage."""
        cfg, pc, m = self.cfg, self.pc, self.cfg.model
        a = cfg.actor
        L = m.num_hidden_layers
        megatron = a.backend == "megatron"
        best = None
        for s in range(pp if megatron else 1):
            spans = _stage_chunks(m, a.megatron, s) if megatron else [[0, L]]
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
        if a.backend == "megatron":  # a context-parallel rank holds 1 / CP of each row
            tokens = tokens / a.megatron.context_parallel
        b = BY_NAME[a.dtype].bytes
        H, K, I = m.hidden_size, m.num_experts_per_tok, m.moe_intermediate_size
        full = 17 * H * b / tp + K * (H + 3 * I) * b / etp  # attention/norms (SP) + experts
        L = m.num_hidden_layers
        recompute = a.backend == "megatron" and a.megatron.recompute_activations
        per_layer = H * b / tp if recompute else full  # recompute keeps each layer's input
        layers = L  # L/PP layers x PP micro-batches in flight
        if a.backend == "megatron" and pp > 1 and a.megatron.vpp == 1:
            # stage p keeps PP - p micro-batches in flight through its own layers (uneven
            # stages: `stage_layer_counts`; equal ones give L)
            from lockstep.trainer.config.megatron import stage_layer_counts
            layers = max(n * (pp - p) for p, n in
                         enumerate(stage_layer_counts(m, a.megatron)))
        vpp = a.megatron.vpp if a.backend == "megatron" else 1
        if vpp > 1:  # interleaved 1F1B keeps (1 + (PP-1)/(PP x VPP)) x that (Narayanan 2021)
            layers = L * (1 + (pp - 1) / (pp * vpp))
        logits = tokens * math.ceil(m.vocab_size / tp) * 4
        return tokens * (per_layer * layers + (full if recompute else 0)) + logits

    def _engine_memory(self, g: int, frac: float | None = None, kind: str = "SGLang",
                       frac_key: str = "rollout.sglang.mem_fraction_static") -> dict[str, Any]:
        """Memory per GPU of one server over `g` GPUs; `frac` its share of the GPU (None:
        rollout.sglang.mem_fraction_static or SGLang's default)."""
        cfg, pc, m = self.cfg, self.pc, self.cfg.model
        ro, sg = cfg.rollout, cfg.rollout.sglang
        b = BY_NAME[base_precision(ro.dtype)].bytes
        sharded = sum(pc.layer_tp) + pc.embedding + pc.lm_head
        rep = sum(pc.layer_rep) + pc.final_norm
        # experts: ep_size-way expert parallel x (tp/ep)-way expert TP = split over all tp GPUs
        weights = (sharded / g + rep + pc.experts / g) * b
        if ro.dtype == FP8:  # block FP8: the layers' matmul weights take 1 byte (+ 4 per 16k)
            weights -= (sum(pc.layer_tp) + pc.experts) / g * (b - 1)
        L = m.num_hidden_layers
        if m.is_mla:  # SGLang caches the compressed latent + the rope key, on every TP rank
            per_token = L * (m.kv_lora_rank + m.qk_rope_head_dim) * b
        else:
            per_token = L * 2 * max(1, m.num_key_value_heads // g) * m.head_dim * b
        frac = frac or sg.mem_fraction_static or SGLANG_DEFAULT_MEM_FRACTION
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
                self.refuse(f"{kind} engine: weights {_gib(weights)} GiB per GPU exceed "
                            f"{frac_key}={frac} x "
                            f"cluster.gpu_memory_gib={self.cfg.cluster.gpu_memory_gib} = "
                            f"{_gib(frac * self.gpu_bytes)} GiB: no room for a KV cache")
            elif cap < self.T:
                self.refuse(f"{kind} engine: KV budget {_gib(budget)} GiB holds {cap} tokens, "
                            f"less than one row of {self.T} (prompt {self.prompt_len} + "
                            f"response {self.response_len})")
        return out

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
        if ro.backend == "vllm":  # vLLM: a .npy of uint8 (uint16 above 256 experts), base64
            wire = B * T * m.num_hidden_layers * K * rb * 4 / 3
        logprobs = 3 * B * T * 4  # rollout, old, new: fp32 [B, T]
        out = {"rows": B, "row_tokens": T, "prompt_tokens": self.prompt_len,
               "response_tokens": self.response_len, "multi_turn": ro.env is not None,
               "routes_dtype": "uint8" if rb == 1 else "uint16",
               "routes_bytes": int(routes), "routes_per_dp_rank_bytes": int(routes / dp),
               "routes_on_the_wire_bytes": int(wire) if ro.backend in ("sglang", "vllm")
               else None,
               "logprobs_bytes": logprobs, "logprobs_per_dp_rank_bytes": int(logprobs / dp)}
        if ro.mask_replay:
            S = ro.top_k if ro.top_k > 0 else (ro.sglang.sampling_mask_max_tokens or 4096)
            cb = 2 if m.vocab_size <= 32767 else 4
            cand = B * self.response_len * S * cb
            out.update({"candidates_per_token": S, "candidates_bytes": int(cand),
                        "candidates_per_dp_rank_bytes": int(cand / dp)})
        return out
