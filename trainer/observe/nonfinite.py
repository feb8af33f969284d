"""Divergence detection: stop a run whose loss, log-probs, gradient or weights stop being finite,
say what diverged at which step, and never checkpoint the broken model.

The loop calls `check_step` after every RL step, `check_weights` on the weights it is about to
checkpoint and `from_step_error` on an exception raised inside a step (the engine's and the
correction's own NaN checks); all give a `DivergenceError`:

    lockstep train: diverged at step 3: actor/grad_norm is inf (the last good checkpoint,
    step_2, is kept); lower actor.lr (now 1.0) or set actor.grad_clip (now 0.0) ...
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

import torch

# Metrics that must be finite at every step (present ones only; others may be NaN by design).
WATCHED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout_corr/training_log_ppl",
           "rollout_corr/rollout_log_ppl")
_NONFINITE = re.compile(r"\b(nan|inf|non-finite|not finite)\b", re.IGNORECASE)


class DivergenceError(RuntimeError):
    """Training produced NaN/Inf (loss, log-probs, gradient norm or weights)."""


def _hint(cfg, last_ckpt: Path | None) -> str:
    kept = (f"the last good checkpoint, {last_ckpt.name}, is kept" if last_ckpt is not None
            else "no checkpoint was written yet")
    clip = (f"lower actor.grad_clip (now {cfg.actor.grad_clip:g})" if cfg.actor.grad_clip > 0
            else "set actor.grad_clip (e.g. 1.0; now off)")
    return f" ({kept}); lower actor.lr (now {cfg.actor.lr:g}) or {clip}, then restart or --resume"


def check_step(step: int, metrics: dict, cfg, last_ckpt: Path | None) -> None:
    """Raise `DivergenceError` if a watched metric of `step` is not finite."""
    bad = [f"{k} is {metrics[k]}" for k in WATCHED
           if isinstance(metrics.get(k), float) and not math.isfinite(metrics[k])]
    if metrics.get("actor/skipped_step"):
        bad.append("an optimiser step was skipped (non-finite gradient)")
    if bad:
        raise DivergenceError(f"diverged at step {step}: {'; '.join(bad)}" + _hint(cfg, last_ckpt))


def check_weights(step: int, named: Iterable[tuple[str, torch.Tensor]], cfg,
                  last_ckpt: Path | None) -> None:
    """Raise `DivergenceError` if any weight is not finite (called before a checkpoint)."""
    with torch.no_grad():
        names = [n for n, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    check_weight_names(step, names, cfg, last_ckpt)


def check_weight_names(step: int, names: list[str], cfg, last_ckpt: Path | None) -> None:
    """`check_weights` from the names of the non-finite weights (the actor ranks check the
    weights they write into a checkpoint and report only names)."""
    if names:
        raise DivergenceError(f"diverged at step {step}: weights are not finite "
                              f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                              + _hint(cfg, last_ckpt))


def from_step_error(step: int, err: BaseException, cfg, last_ckpt: Path | None,
                    ) -> DivergenceError | None:
    """A `DivergenceError` for a step that failed on a NaN/Inf check (e.g. the engine's
    log-probs), else None (the error is something else)."""
    if isinstance(err, (ValueError, RuntimeError, FloatingPointError)) and _NONFINITE.search(str(err)):
        return DivergenceError(f"diverged at step {step}: {err}" + _hint(cfg, last_ckpt))
    return None
