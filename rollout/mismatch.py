"""Calibrated train/infer mismatch, injected on the engine side (`rollout.mismatch`).

A real inference engine disagrees with the trainer by its kernels; this one disagrees on
purpose, by an amount a user chooses, so a study (or a user with a `lockstep diagnose` report)
can ask what a given mismatch does to a run and which correction holds it. Two perturbations,
both the engine's alone (the actor sees the tokens, log-probs and routes the engine produced,
as it would with a real engine):

- **router noise**: N(0, sigma^2) added to every MoE router logit of the engine's forwards
  (prefill and decode) before its experts are chosen and weighted. `router_flip_rate` is the
  target: sigma is *calibrated* so that the per-layer flip rate between the engine's routes and
  an unperturbed forward's natural top-k on the same tokens (what the actor's
  `routing/flip_rate` measures with replay off, bitwise so in exact mode) is the target;
  the flips compound over the layers as a real mismatch does (a flipped expert changes the
  hidden states every later router sees). `router_noise` fixes sigma instead.
- **log-prob noise**: N(0, s^2) added to every logit of the engine's sampling distribution
  (`logprob_noise` = s, in nats): the engine samples from, and reports the log-probs of, a
  perturbed distribution mu, so pi_old / mu_old varies per token (k3 ~ s^2 / 2 for a flat
  distribution, less where it is peaked).

Noise is a pure function of (the sample's seed, position, layer, expert or vocabulary id):
the trainer's per-sample seeds are functions of (loop.seed, step, request, sample), so the
perturbation is deterministic per (seed, step, request, token) and does not depend on which
other requests share a batch. Prompt positions are keyed by the request's first sample (the
prompt is prefilled once for its n samples).

Calibration (`calibrate`): bisection on log(sigma) over teacher-forced forwards of a batch of
the engine's own samples, with and without the noise, until the measured flip rate is within
`tolerance` (relative) of the target. The loop runs it before the first step and every
`calibrate_every` steps after (warm-started from the current sigma), so it tracks routers that
sharpen or soften as the policy trains.

Shapes: B rows, T time, L MoE layers, E experts, V vocabulary, K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PRIME = 2_147_483_647  # 2^31 - 1: every product below stays under 2^62 in int64
ROUTER_SALT, LOGIT_SALT = 17, 29


@dataclass
class MismatchConfig:
    """Engine-side injected mismatch (all off by default)."""

    router_flip_rate: float | None = None
    """Target per-layer routing flip rate (e.g. 0.10, the R3 paper's); sigma is calibrated."""
    router_noise: float | None = None
    """Fixed std of the router-logit noise instead of a calibrated one (not with the target)."""
    logprob_noise: float = 0.0
    """Std (nats) of the noise on the engine's sampling logits (0 = off)."""
    calibrate_every: int = 10
    """Steps between recalibrations of sigma (0 = before the first step only)."""
    tolerance: float = 0.03
    """Calibration stops when the measured flip rate is this close (relative) to the target."""

    def __post_init__(self) -> None:
        f, s = self.router_flip_rate, self.router_noise
        if f is not None and not 0.0 < f < 1.0:
            raise ValueError(f"rollout.mismatch.router_flip_rate={f} must be in (0, 1)")
        if s is not None and not s >= 0.0:
            raise ValueError(f"rollout.mismatch.router_noise={s} must be >= 0")
        if f is not None and s is not None:
            raise ValueError("rollout.mismatch: router_flip_rate (a target, sigma calibrated) "
                             "and router_noise (a fixed sigma) are both set; give one")
        if not self.logprob_noise >= 0.0:
            raise ValueError(f"rollout.mismatch.logprob_noise={self.logprob_noise} must be >= 0")
        if self.calibrate_every < 0:
            raise ValueError(f"rollout.mismatch.calibrate_every={self.calibrate_every} must "
                             "be >= 0")
        if not 0.0 < self.tolerance < 1.0:
            raise ValueError(f"rollout.mismatch.tolerance={self.tolerance} must be in (0, 1)")

    @property
    def enabled(self) -> bool:
        return bool(self.router_flip_rate or self.router_noise or self.logprob_noise)

    @property
    def calibrated(self) -> bool:
        return self.router_flip_rate is not None


# -- deterministic noise --------------------------------------------------------------------
def _mix(h: torch.Tensor) -> torch.Tensor:
    """One round of a multiplicative hash on int64 values in [0, PRIME)."""
    h = (h * 48271) % PRIME
    h = h ^ (h >> 11)
    h = (h * 16807 + 12345) % PRIME
    return h ^ (h >> 7)


def _key(seed: torch.Tensor) -> torch.Tensor:
    """A sample's int64 seed (any value) folded into [0, PRIME)."""
    lo = torch.remainder(seed, PRIME)
    hi = torch.remainder(seed >> 31, PRIME)
    return _mix(_mix(lo) ^ hi)


def _uniform(h: torch.Tensor) -> torch.Tensor:
    return (h.double() + 0.5) / PRIME  # in (0, 1)


def normal(seed: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
    """Standard normals, a pure function of (seed, fields...), broadcast together (int64)."""
    h = _key(seed)
    for f in fields:
        h = _mix((h * 31 + torch.remainder(f, PRIME) + 1) % PRIME)
    u1 = _uniform(_mix(h ^ 0x5bd1e995 % PRIME))
    u2 = _uniform(_mix(_mix(h)))
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).float()


def router_noise(seed_B: torch.Tensor, pos_BT: torch.Tensor, L: int, E: int,
                 sigma: float) -> torch.Tensor:
    """fp32 [B, T, L, E]: sigma * N(0, 1) of (seed, position, layer, expert)."""
    dev = pos_BT.device
    layer = torch.arange(L, device=dev)[None, None, :, None]
    expert = torch.arange(E, device=dev)[None, None, None, :]
    z = normal(seed_B.to(dev)[:, None, None, None], torch.full((), ROUTER_SALT, device=dev),
               pos_BT[:, :, None, None], layer, expert)
    return z * sigma


def logit_noise(seed_B: torch.Tensor, pos_B: torch.Tensor, V: int, s: float) -> torch.Tensor:
    """fp32 [B, V]: s * N(0, 1) of (seed, position of the sampled token, vocabulary id)."""
    dev = pos_B.device
    vocab = torch.arange(V, device=dev)[None, :]
    z = normal(seed_B.to(dev)[:, None], torch.full((), LOGIT_SALT, device=dev),
               pos_B[:, None], vocab)
    return z * s


# -- calibration ------------------------------------------------------------------------------
@torch.no_grad()
def natural_routes(model, ids_BT: torch.Tensor, seed_B: torch.Tensor | None = None,
                   sigma: float = 0.0) -> torch.Tensor:
    """Routes a teacher-forced forward of `ids_BT` runs, with router noise sigma (keyed by
    `seed_B` and the positions) or none."""
    cfg = model.cfg
    B, T = ids_BT.shape
    noise = None
    if sigma > 0:
        pos_BT = torch.arange(T, device=ids_BT.device).expand(B, T)
        noise = router_noise(seed_B, pos_BT, cfg.num_moe_layers, cfg.num_experts, sigma)
    return model(ids_BT, compute_logits=False, router_noise_BTLE=noise).routes_BTLK


def flip_rate(noisy_BTLK: torch.Tensor, clean_BTLK: torch.Tensor, valid_BT: torch.Tensor) -> float:
    """Per-(token, layer) flip rate over the valid rows (`replay.route_divergence`'s)."""
    from lockstep.replay.route_divergence import compare_routes
    cmp = compare_routes(noisy_BTLK, clean_BTLK, valid_BT)
    n = int(cmp.valid_BT.sum()) * cmp.flip_BTL.shape[-1]
    return float(cmp.flip_BTL.sum()) / max(n, 1)


@dataclass
class Calibration:
    sigma: float
    measured: float
    evaluations: int


def calibrate(model, ids_BT: torch.Tensor, valid_BT: torch.Tensor, target: float,
              sigma0: float | None = None, tolerance: float = 0.03, max_evals: int = 16,
              seed: int = 0) -> Calibration:
    """sigma whose flip rate on these tokens (noisy forward vs one clean forward) is within
    `tolerance` (relative) of `target`: a bracket grown by x4 from `sigma0` (default 0.1), then
    bisection on log(sigma); the closest point seen when `max_evals` noisy forwards are spent."""
    seed_B = torch.arange(ids_BT.shape[0], dtype=torch.int64) + seed * 1_000_003
    clean = natural_routes(model, ids_BT)
    evals: list[tuple[float, float]] = []

    def f(sigma: float) -> float:
        r = flip_rate(natural_routes(model, ids_BT, seed_B, sigma), clean, valid_BT)
        evals.append((sigma, r))
        return r

    s = sigma0 or 0.1
    r = f(s)
    lo = hi = None
    while abs(r - target) > tolerance * target and len(evals) < max_evals:
        if r < target:
            lo = s
        else:
            hi = s
        s = hi / 4 if lo is None else lo * 4 if hi is None else math.sqrt(lo * hi)
        r = f(s)
    best = min(evals, key=lambda e: abs(e[1] - target))
    return Calibration(best[0], best[1], len(evals))
