"""The loop's side of `rollout.mismatch` (rollout/mismatch.py): sets the embedded engine's noise,
recalibrates the router noise to its target flip rate between steps, and reports the settings
on every metrics row (`mismatch/*`) and in the checkpoint (so a resumed run continues with the
calibrated sigma, not a fresh one).

Calibration runs before step 1 on a batch generated for it (seeds of "step 0", never a training
step's), and then every `calibrate_every` steps on the previous step's samples, warm-started
from the current sigma; it changes the noise of the generations that follow only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lockstep.rollout.mismatch import MismatchConfig, calibrate


class InjectionControl:
    def __init__(self, cfg: MismatchConfig, engine, log: Callable[[str], None] = print):
        self.cfg, self.engine, self.log = cfg, engine, log
        self.sigma = cfg.router_noise or 0.0
        self.measured: float | None = None
        self.calibrated_at: int | None = None
        self.evaluations = 0
        engine.set_mismatch(router_noise=self.sigma, logprob_noise=cfg.logprob_noise)

    def due(self, step: int) -> bool:
        c = self.cfg
        if not c.calibrated:
            return False
        if self.calibrated_at is None:
            return True
        return bool(c.calibrate_every) and step - self.calibrated_at >= c.calibrate_every

    def calibrate(self, step: int, ids_BT, valid_BT, seed: int) -> None:
        """Recalibrate sigma on these tokens (the engine's current weights)."""
        c = self.cfg
        res = calibrate(self.engine.model, ids_BT, valid_BT, c.router_flip_rate,
                        sigma0=self.sigma or None, tolerance=c.tolerance, seed=seed + step)
        self.sigma, self.measured, self.calibrated_at = res.sigma, res.measured, step
        self.evaluations = res.evaluations
        self.engine.set_mismatch(router_noise=self.sigma)
        self.log(f"step {step}: router noise sigma {self.sigma:.4g} gives flip rate "
                 f"{self.measured:.4f} (target {c.router_flip_rate}; {res.evaluations} "
                 f"forwards)")

    def metrics(self) -> dict[str, float]:
        c = self.cfg
        out = {"mismatch/router_noise": self.sigma, "mismatch/logprob_noise": c.logprob_noise}
        if c.calibrated:
            out["mismatch/router_flip_rate_target"] = c.router_flip_rate
            out["mismatch/calibrated_flip_rate"] = float("nan") if self.measured is None \
                else self.measured
        return out

    def state(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "measured": self.measured,
                "calibrated_at": self.calibrated_at}

    def load_state(self, state: Mapping[str, Any]) -> None:
        try:
            self.sigma = float(state["sigma"])
            self.measured = None if state["measured"] is None else float(state["measured"])
            self.calibrated_at = None if state["calibrated_at"] is None \
                else int(state["calibrated_at"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"checkpoint: bad mismatch state {state!r} (want sigma, measured, "
                             "calibrated_at)") from None
        self.engine.set_mismatch(router_noise=self.sigma)
