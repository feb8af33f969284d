"""The experiment config's vLLM servers (`rollout.backend: vllm`): `rollout`, `rollout.vllm`,
`loop.seed` and `cluster.device` mapped onto `lockstep.rollout.vllm.VLLMConfig` (whose
`command()` is the argv). The fleet launches these and `lockstep plan` prints them; the
rollout side takes only the resulting options (nothing under rollout/ reads the experiment
config)."""

from __future__ import annotations

from typing import Any

from lockstep.kernels.device import resolve_device
from lockstep.kernels.dtypes import FP8, base_precision, hf_name
from lockstep.rollout.sglang_options import check as _check
from lockstep.rollout.vllm import VLLMConfig
from lockstep.rollout.vllm_options import FLEET_KEYS


def vllm_options_dict(cfg: Any, strict: bool = True) -> dict[str, Any]:
    """`rollout.vllm` of the experiment `cfg` as `VLLMConfig` keyword arguments, without what
    is chosen per server (model_path, host, port, api_key), plus the fleet's own
    `FLEET_KEYS`: the options every server of the fleet is launched with. `strict`: refuse
    the rollout dtypes vLLM has no flag for (false: a server the user runs, rollout.urls)."""
    ro, vl = cfg.rollout, cfg.rollout.vllm
    if strict:
        _check(ro.dtype != FP8, "rollout.dtype=fp8 with rollout.backend=vllm: not done "
                                "(vLLM's --quantization fp8 is not mapped); use bf16 or fp32")
        for key in ("lm_head_dtype", "router_dtype"):
            v = getattr(ro, key)
            _check(v in (None, base_precision(ro.dtype)),
                   f"rollout.{key}={v!r} with rollout.backend=vllm: vLLM has no flag for it "
                   f"and computes it in rollout.dtype={ro.dtype!r}; leave it unset")
    d: dict[str, Any] = dict(
        tp_size=vl.tp_size, expert_parallel=vl.expert_parallel,
        dtype=hf_name(base_precision(ro.dtype)), max_model_len=vl.max_model_len,
        return_sampling_mask=ro.mask_replay, max_num_seqs=vl.max_num_seqs,
        gpu_memory_utilization=vl.gpu_memory_utilization, seed=cfg.loop.seed,
        weight_transfer_backend=vl.weight_transfer_backend,
        device=resolve_device(cfg.cluster.device, here=False).type,
        cpu_kv_cache_gb=vl.cpu_kv_cache_gb, pythonpath=list(vl.pythonpath),
        extra_args=list(vl.extra_args), extra_env=dict(e.split("=", 1) for e in vl.extra_env),
        startup_timeout_s=vl.startup_timeout_s, bind=vl.bind)
    if vl.python is not None:
        d["python"] = vl.python
    return d


def vllm_server_config(cfg: Any, local_index: int = 0, *, host: str = "127.0.0.1",
                       port: int | None = None, model_path: str | None = None,
                       api_key: str | None = None, strict: bool = True) -> VLLMConfig:
    """The `VLLMConfig` of the `local_index`-th server on its node for the experiment `cfg`:
    its `command()` is the exact argv to run. The fleet passes each server's host and a free
    port; None = 8000 + local_index (what `lockstep plan` shows)."""
    path = model_path or cfg.model.path
    _check(bool(path), "rollout.vllm: vLLM loads the policy from an HF folder; set model.path "
                       "(the fleet pushes lockstep's weights after the launch)")
    d = vllm_options_dict(cfg, strict)
    for k in FLEET_KEYS:
        d.pop(k)
    return VLLMConfig(model_path=str(path), host=host,
                      port=8000 + local_index if port is None else port, api_key=api_key, **d)
