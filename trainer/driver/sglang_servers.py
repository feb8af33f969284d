"""The experiment config's SGLang servers: `rollout`, `rollout.sglang`, `loop.seed` and
`cluster.device` mapped onto `lockstep.rollout.sglang.SGLangConfig` (whose `command()` is the
argv). The fleet launches these, and `lockstep plan` prints them; the rollout side takes only
the resulting options (nothing under rollout/ reads the experiment config)."""

from __future__ import annotations

from typing import Any

from lockstep.kernels.device import resolve_device
from lockstep.kernels.dtypes import FP8, base_precision, hf_name
from lockstep.rollout.sglang import SGLangConfig
from lockstep.rollout.sglang_options import FLEET_KEYS
from lockstep.rollout.sglang_options import check as _check
from lockstep.trainer.config.replay import wants_indexer_picks


def sglang_options_dict(cfg: Any) -> dict[str, Any]:
    """`rollout.sglang` of the experiment `cfg` as `SGLangConfig` keyword arguments, without
    what is chosen per server (model_path, host, port, api_key, weight_version), plus the
    fleet's own `FLEET_KEYS`: the options every server of the fleet is launched with."""
    ro, sg = cfg.rollout, cfg.rollout.sglang
    _check(ro.lm_head_dtype in (None, "fp32", base_precision(ro.dtype)),
           f"rollout.lm_head_dtype={ro.lm_head_dtype!r}: SGLang computes the LM head in "
           f"rollout.dtype={ro.dtype!r} or in fp32 (--enable-fp32-lm-head), nothing else")
    d: dict[str, Any] = dict(
        tp_size=sg.tp_size, ep_size=sg.ep_size, dtype=hf_name(base_precision(ro.dtype)),
        quantization="fp8" if ro.dtype == FP8 else None,
        mem_fraction_static=sg.mem_fraction_static, context_length=sg.context_length,
        enable_fp32_lm_head=ro.lm_head_dtype == "fp32" and ro.dtype != "fp32",
        enable_deterministic_inference=sg.deterministic_inference,
        enable_return_indexer_topk=wants_indexer_picks(cfg),
        sampling_mask_max_tokens=sg.sampling_mask_max_tokens, random_seed=cfg.loop.seed,
        device=resolve_device(cfg.cluster.device, here=False).type, max_total_tokens=sg.max_total_tokens,
        extra_args=list(sg.extra_args), extra_env=dict(e.split("=", 1) for e in sg.extra_env),
        startup_timeout_s=sg.startup_timeout_s, bind=sg.bind)
    if sg.python is not None:
        d["python"] = sg.python
    return d


def sglang_server_config(cfg: Any, local_index: int = 0, *, host: str = "127.0.0.1",
                         port: int | None = None, model_path: str | None = None,
                         api_key: str | None = None,
                         weight_version: str | None = None) -> SGLangConfig:
    """The `SGLangConfig` of the `local_index`-th server on its node for the experiment `cfg`
    (an `ExperimentConfig`): its `command()` is the exact argv to run. The fleet passes each
    server's host and a free port; None = 30000 + local_index (what `lockstep plan` shows)."""
    path = model_path or cfg.model.path
    _check(bool(path), "rollout.sglang: SGLang loads the policy from an HF folder; set "
                       "model.path (the fleet pushes lockstep's weights after the launch)")
    d = sglang_options_dict(cfg)
    for k in FLEET_KEYS:
        d.pop(k)
    return SGLangConfig(model_path=str(path), host=host,
                        port=30000 + local_index if port is None else port,
                        api_key=api_key, weight_version=weight_version, **d)
