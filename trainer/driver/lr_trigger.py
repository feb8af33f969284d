"""Triggered LR decay (`actor.lr_schedule: triggered`): multiply the learning rate by
`actor.lr_trigger.factor` when a symptom of growing train/inference mismatch shows up.

Three symptoms, each on when its threshold is set, read from the step's metrics *before* its
update (the trigger of step s already lowers step s's update):
  - `length_growth`: the mean response length runs away. The least-squares slope of
    `response/length_mean` over the last `length_window` steps, divided by the window's mean
    length, is above the threshold (a fraction of the length per step: 0.02 = 2%/step).
  - `k3_kl`: `rollout_corr/k3_kl` (k3 KL between pi_old and mu_old on the step's samples) is
    above the threshold.
  - `flip_rate`: `routing/flip_rate` ((token, layer) pairs whose rollout routes differ from the
    trainer's natural top-k) is above the threshold.
After a trigger none fires for `cooldown` steps; the multiplier never goes below `min_scale`.
The LR an update uses is `actor.lr x warm-up x scale` (the schedule is constant after warm-up,
`trainer.actor.torch_actor.lr_lambda`); the driver sends `scale` with the update's inputs
(`UpdateInputs.lr_scale`), so every actor backend applies it alike.

The state (multiplier, last trigger step, the length window) goes into the checkpoint's
trainer state, so a resumed run keeps the decayed LR and triggers where an uninterrupted one
would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lockstep.trainer.config.sections import LRTriggerConfig

LENGTH = "response/length_mean"
K3 = "rollout_corr/k3_kl"
FLIPS = "routing/flip_rate"


def length_growth(lengths: list[float]) -> float:
    """Least-squares slope of `lengths` (one per step) divided by their mean: the fraction of
    the length it grows by per step (0 for a zero mean length)."""
    n = len(lengths)
    mean = sum(lengths) / n
    x_mean = (n - 1) / 2
    num = sum((i - x_mean) * (y - mean) for i, y in enumerate(lengths))
    den = sum((i - x_mean) ** 2 for i in range(n))
    return num / den / mean if mean > 0 else 0.0


class LRTrigger:
    """The trigger's state over a run; `observe` once per step before its update."""

    def __init__(self, cfg: LRTriggerConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.scale = 1.0
        self.last_trigger: int | None = None  # step of the last trigger
        self.lengths: list[float] = []        # the last length_window mean lengths

    def observe(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Read step `step`'s symptoms from `metrics` (response/length_mean and whichever of
        rollout_corr/k3_kl, routing/flip_rate are on); cut `self.scale` if one passes its
        threshold outside the cooldown. Returns the `lr_trigger/*` metrics of the step:
        the scale its update uses, the measured length growth (once its window is full) and,
        per enabled cause,
        `lr_trigger/fired/<cause>` = 1 when it triggered this step."""
        cfg = self.cfg
        values: dict[str, float] = {}
        if cfg.length_growth is not None:
            self.lengths = (self.lengths + [_metric(metrics, LENGTH, "length_growth")]
                            )[-cfg.length_window:]
            if len(self.lengths) == cfg.length_window:
                values["length_growth"] = length_growth(self.lengths)
        if cfg.k3_kl is not None:
            values["k3_kl"] = _metric(metrics, K3, "k3_kl")
        if cfg.flip_rate is not None:
            values["flip_rate"] = _metric(metrics, FLIPS, "flip_rate")
        limits = cfg.enabled_causes()
        cooling = self.last_trigger is not None and step - self.last_trigger <= cfg.cooldown
        fired = [] if cooling else [k for k, v in values.items() if v > limits[k]]
        if fired:
            old, self.scale = self.scale, max(cfg.min_scale, self.scale * cfg.factor)
            self.last_trigger = step
            why = ", ".join(f"{k} {values[k]:.4g} > {limits[k]:.4g}" for k in fired)
            self.log(f"step {step}: LR x{self.scale / old:.4g} (now {self.scale:.4g} of the "
                     f"schedule) by the triggered decay: {why}")
        out = {"lr_trigger/scale": self.scale}
        if "length_growth" in values:
            out["lr_trigger/length_growth"] = values["length_growth"]
        out.update({f"lr_trigger/fired/{k}": float(k in fired) for k in limits})
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain numbers and lists)."""
        return {"scale": self.scale, "last_trigger": self.last_trigger,
                "lengths": list(self.lengths)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        try:
            scale, last, lengths = state["scale"], state["last_trigger"], state["lengths"]
        except (KeyError, TypeError):
            raise ValueError(f"checkpoint: bad lr_trigger state {state!r} (want scale, "
                             "last_trigger, lengths)") from None
        self.scale, self.last_trigger = float(scale), None if last is None else int(last)
        self.lengths = [float(x) for x in lengths][-self.cfg.length_window:]


def _metric(metrics: Mapping[str, float], key: str, cause: str) -> float:
    v = metrics.get(key)
    if v is None:
        raise ValueError(f"actor.lr_trigger.{cause}: this step has no {key}"
                         f"{' (the rollout returned no routes)' if key == FLIPS else ''}")
    if v != v:
        raise ValueError(f"actor.lr_trigger.{cause}: this step's {key} is NaN")
    return float(v)
