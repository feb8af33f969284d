"""`lockstep plan`'s text: the plan dict as the lines `lockstep plan` prints."""

from __future__ import annotations

import json
from typing import Any


def _span(lo: int, hi: int) -> str:
    return "none" if hi <= lo else f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


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
      + (f" (layers per stage {', '.join(map(str, lay['pipeline_layers']))})"
         if len(set(lay["pipeline_layers"])) > 1 else "")
      + (f" (VPP {lay['virtual_pipeline_parallel']})" if lay['virtual_pipeline_parallel'] > 1
         else "")
      + (f" x CP {lay['context_parallel']}" if lay["context_parallel"] > 1 else "")
      + f" x DP {lay['data_parallel']} (expert DP "
      f"{lay['expert_data_parallel']})")
    for r in a["rank_layout"]:
        where = (f"node {r['node']} GPU {r['gpu']}" if r.get("node") is not None
                 else f"bundle {r['bundle']}" if r.get("bundle") is not None else "driver")
        ex = f"  experts {_span(*r['experts'])}" if r["experts"] else ""
        w(f"  rank {r['rank']:>3}  {where:<16} pp {r['pp']} tp {r['tp']}"
          + (f" cp {r['cp']}" if lay["context_parallel"] > 1 else "") + f" dp {r['dp']} ep "
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
    w(f"  replay {rp['mode']}: old log-probs: {rp['old_logprob']}; update: {rp['update']}"
      + "".join(f"; {k}: {rp[k]}" for k in ("gates", "partial") if k in rp))
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
    if "vllm" in ro:
        v = ro["vllm"]
        w(f"  vLLM TP {v['tp_size']}, experts {v['experts']}")
    if ro.get("vllm_command"):
        w("  launch each server with (lockstep talks to it at rollout.url / rollout.urls):")
        w(f"    {ro['vllm_command']['shell']}")
    em = ro.get("memory_per_gpu")
    if em:
        w(f"  memory per GPU: weights {_size(em['weights_bytes'])}, KV cache "
          f"{_size(em['kv_bytes_per_token'])} per token, "
          + ("gpu_memory_utilization " if "vllm" in ro else "mem_fraction_static ")
          + f"{em['mem_fraction_static']}")
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
    cpu_nodes = [e for e in p["placement"]["engines"] if not e.get("gpus") and e["node"] is not None]
    if cpu_nodes:
        w("  engines on nodes: " + ", ".join(f"{e['engine']} -> node {e['node']}" for e in cpu_nodes))
    for e in p["placement"]["engines"]:
        if e.get("command"):
            w(f"  engine {e['engine']}: node {e['node']} GPUs {e['gpus']}"
              + (f" (shared with actor ranks {e['shares_gpus_with_actor_ranks']})"
                 if e.get("shares_gpus_with_actor_ranks") else ""))
            w(f"    {e['command']['shell']}")
    w("")
    b = p["buffers"]
    w(f"buffers per step: {b['rows']} rows x {b['row_tokens']} tokens (prompt "
      f"{b['prompt_tokens']} + response {b['response_tokens']}"
      + (", a multi-turn trajectory filling the context)" if b["multi_turn"] else ")"))
    w(f"  routes ({b['routes_dtype']}) {_size(b['routes_bytes'])}, "
      f"{_size(b['routes_per_dp_rank_bytes'])} per DP rank"
      + (f"; {_size(b['routes_on_the_wire_bytes'])} as "
         + ("vLLM sends them (base64 .npy)" if ro["backend"] == "vllm"
            else "SGLang sends them (base64 int32)")
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
