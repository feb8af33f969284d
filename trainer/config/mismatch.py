"""The checks of what `rollout.exact` and `rollout.mismatch` need of the other sections
(trainer/config/experiment.py runs them; docs/precision.md "Exact mode", docs/training.md
"Injected mismatch").

Exact mode makes the engine's log-probs and routes bitwise the actor's; every knob below would
put a difference back, so each is refused with the mode rather than silently breaking it."""

from __future__ import annotations

from lockstep.trainer.config.types import need


def check_exact(cfg) -> None:
    """Refuse the settings under which engine and actor cannot compute the same bits."""
    ro, a = cfg.rollout, cfg.actor
    if not ro.exact:
        return
    why = "rollout.exact=true makes the engine and the actor bitwise equal"
    need(a.backend == "torch", f"{why}; actor.backend={a.backend!r} runs megatron-core's "
         "kernels: use actor.backend=torch")
    need(ro.backend in ("embedded", "ray"), f"{why}, with lockstep's own engine in this "
         f"process or as Ray actors; rollout.backend={ro.backend!r} serves through an HTTP "
         "server (SGLang's kernels, or a `lockstep serve` that takes no exact flag)")
    need(ro.dtype == a.dtype, f"{why} in one precision; rollout.dtype={ro.dtype!r} but "
         f"actor.dtype={a.dtype!r}: set actor.dtype={ro.dtype}" if ro.dtype != "fp8" else
         f"{why}; rollout.dtype=fp8 (block FP8) has no exact kernels: use bf16")
    for name in ("router_dtype", "lm_head_dtype"):
        need(getattr(ro, name) == getattr(a, name),
             f"{why}; rollout.{name}={getattr(ro, name)!r} but actor.{name}="
             f"{getattr(a, name)!r}: give both sides the same")
    need(not a.fp8, f"{why}; actor.fp8=true (block FP8) has no exact kernels")
    need(not ro.truncates, f"{why}; rollout.top_p / top_k truncate sampling, and the "
         "renormalisation over the kept set has no exact kernel: sample the full distribution")
    need(not cfg.model.is_mla, f"{why}; model_type {cfg.model.model_type} uses multi-head "
         "latent attention, which has no exact kernel (GQA families only)")


def check_mismatch(cfg) -> None:
    """The injected mismatch lives in the embedded engine and is calibrated between steps."""
    m = cfg.rollout.mismatch
    if m is None or not m.enabled:
        return
    need(cfg.rollout.backend == "embedded", f"rollout.mismatch perturbs lockstep's embedded "
         f"engine (and calibrates on its model); rollout.backend={cfg.rollout.backend!r}")
    need(cfg.loop.max_staleness == 0, f"rollout.mismatch: loop.max_staleness="
         f"{cfg.loop.max_staleness} generates while the noise is recalibrated; use 0")
