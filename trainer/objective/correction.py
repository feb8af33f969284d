"""Rollout correction: importance weights, rejection masks and off-policy metrics.

Semantics follow verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py` (option names, threshold
strings, metric names and their exact definitions, including its quirks), re-implemented here.
Two entry points over the same code:

- typed: `correct(cfg: CorrectionConfig, old_logprobs, rollout_logprobs, response_mask)
  -> CorrectionResult(weights, response_mask, metrics)`;
- verl-compatible: `compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob,
  response_mask, rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
  rollout_rs=None, rollout_rs_threshold=None) -> (weights | None, response_mask, metrics)` and the
  other public functions of verl's module under the same names and argument order; verl returns a
  DataProto holding "rollout_is_weights" where we return the tensor. They live in
  `trainer/objective/rollout_corr.py` (import them from there).

Beyond verl: the `geometric` IS level (per-sequence exp of the masked *mean* log ratio), the
IPO/DPPO probability-difference mask, M2PO's second-moment mask (`m2po_threshold`, AReaL's rule)
and `is_split_metrics` (mismatch x staleness factorisation). verl's named presets
(`preset: NAME`) are trainer/objective/presets.py.

Speed: every [B, T] input is zero-padded once (`_Mask`), after which masked means are plain
sums and the log ratio and its exp are shared by the weights, RS and off-policy metrics; about
5x faster than verl's module at [512, 4096] with token TIS (bench/data_plane.py). Masks must be
0/1 (verl's functions also accept fractional masks; here that is an error).

Log-probs are named by origin: `rollout_logprobs` (mu_old, the engine's), `old_logprobs` (pi_old,
trainer recompute before the update), `logprobs` (pi_theta, current). Shapes: B sequences, T
response positions; every tensor is `[B, T]`; `response_mask` is 1 on valid tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from lockstep.moe.checks import strict_kwargs
from lockstep.trainer.objective.presets import PRESETS, VERL_FIELDS, expand_preset
from lockstep.trainer.objective.rollout_corr import (_checked_zero_pad, _correction, _Mask,
                                                     _prefixed,
                                                     compute_rollout_correction_and_rejection_mask,
                                                     IS_LEVELS, LOSS_TYPES, parse_is_threshold,
                                                     parse_rs_options, parse_rs_thresholds)
from lockstep.trainer.objective.stats import clamp_log_ratio, k3, masked_mean, to_floats


# ---------------------------------------------------------------- typed API
@dataclass
class CorrectionConfig:
    """Rollout-correction settings (field names as verl's `RolloutCorrectionConfig`)."""

    rollout_is: Literal[IS_LEVELS] | None = None  # None (off) | "token" | "sequence" | "geometric" (ours)
    rollout_is_threshold: float | str = 2.0  # C -> TIS clamp(max=C); "lower_upper" -> IcePop
    rollout_is_batch_normalize: bool = False  # rescale weights to batch mean 1
    rollout_rs: str | None = None  # comma-separated RS options, all must pass; None = off
    rollout_rs_threshold: float | str | None = None  # one for all options or one per option
    bypass_mode: bool = False  # True: pi_old := mu_old, IS/RS against the current policy in the loss
    loss_type: Literal[LOSS_TYPES] = "ppo_clip"  # bypass only: "ppo_clip" (ratio is the IS) | "reinforce" (apply weights)
    prob_diff_eps: float | None = None  # IPO/DPPO mask: drop tokens with |p_old - p_rollout| > eps (0.3 typical)
    # M2PO (AReaL actor.m2_threshold): mask the largest (log r)^2 tokens until the rest's mean < it
    m2po_threshold: float | None = field(default=None, metadata={"saved": "non_default"})
    # KPop (AReaL rejection_sampling.metric=binary_kl): mask tokens whose binary KL either way > kpop_phi
    kpop: bool = field(default=False, metadata={"saved": "non_default"})
    # KPop's threshold phi (AReaL's rejection_sampling.upper; 2.0 in its example)
    kpop_phi: float = field(default=2.0, metadata={"saved": "non_default"})
    # TRM (arXiv 2512.23075) max criterion: mask a sequence with max_t |log r_t| > delta
    trm_delta: float | None = field(default=None, metadata={"saved": "non_default"})
    # TRM average criterion: mask a sequence whose mean k3 over its tokens > it
    trm_k3_mean: float | None = field(default=None, metadata={"saved": "non_default"})
    # verl preset name: sets verl's 7 fields (correction_presets), then None
    preset: Literal[tuple(PRESETS)] | None = field(default=None, metadata={"saved": False})

    def __post_init__(self):
        if self.preset is not None:  # a field away from its default must agree with the preset
            given = {f: getattr(self, f) for f in VERL_FIELDS
                     if getattr(self, f) != self.__dataclass_fields__[f].default}
            for k, v in expand_preset({**given, "preset": self.preset}).items():
                setattr(self, k, v)
            self.preset = None
        if self.rollout_is is not None:
            if self.rollout_is not in IS_LEVELS:
                raise ValueError(f"unknown rollout_is {self.rollout_is!r}; valid: None, {', '.join(IS_LEVELS)}")
            parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        elif self.rollout_rs_threshold is not None:
            raise ValueError(f"rollout_rs_threshold={self.rollout_rs_threshold!r} has no effect "
                             "without rollout_rs (rejection sampling is off); set rollout_rs "
                             "(token_k1, seq_mean_k3, ...) or drop it")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
        if self.prob_diff_eps is not None and not 0 < self.prob_diff_eps <= 1:
            raise ValueError(f"prob_diff_eps must be in (0, 1], got {self.prob_diff_eps}")
        if self.m2po_threshold is not None and not self.m2po_threshold > 0:
            raise ValueError(f"m2po_threshold must be > 0 (None disables M2PO), got {self.m2po_threshold}")
        if not self.kpop_phi > 0:
            raise ValueError(f"kpop_phi must be > 0, got {self.kpop_phi}")
        for name in ("trm_delta", "trm_k3_mean"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 (None disables it), got {v}")

    @classmethod
    def from_dict(cls, d: dict) -> "CorrectionConfig":
        """From a mapping of fields; a `preset` key expands to verl's preset (correction_presets)."""
        return cls(**strict_kwargs(cls, expand_preset(d) if isinstance(d, dict) else d, "correction", ValueError))


@dataclass
class CorrectionResult:
    weights: torch.Tensor | None  # [B, T] detached IS weights, 0 on padding; None when IS is off
    response_mask: torch.Tensor  # [B, T] after rejection sampling and the prob-diff mask
    metrics: dict[str, torch.Tensor | float]  # "rollout_corr/<name>" -> value (see `correct`)


def prob_diff_mask(old_logprobs, rollout_logprobs, response_mask, eps: float):
    """IPO/DPPO trust mask: zero tokens with |exp(old) - exp(rollout)| > eps. Returns (mask,
    metrics as 0-dim tensors)."""
    diff = (old_logprobs.exp() - rollout_logprobs.exp()).abs()
    keep = diff <= eps
    mask_b = response_mask.bool()
    m = {"prob_diff_mean": masked_mean(diff, response_mask),
         "prob_diff_max": diff.masked_fill(~mask_b, 0.0).max(),
         "prob_diff_masked_fraction": masked_mean((~keep).float(), response_mask),
         "prob_diff_seq_masked_fraction": ((~keep) & mask_b).any(-1).float().mean()}
    return (response_mask * keep).to(response_mask.dtype), m


def m2po_mask(old_logprobs, rollout_logprobs, response_mask, threshold: float):
    """M2PO's second-moment constraint (arXiv 2510.01161; AReaL's `_apply_m2po_masking`): with
    m2 = (old - rollout)^2 per valid token, drop the tokens of largest m2 (ties: the first in
    row-major order goes first) until the mean m2 of the rest is below `threshold`; when no
    such point exists all but the smallest one are dropped. Returns (mask, metrics)."""
    valid = response_mask.bool()
    m2 = (old_logprobs - rollout_logprobs).square()
    sel = m2[valid]
    n = sel.numel()
    k = 0
    if n > 0:
        top = torch.sort(sel, descending=True, stable=True)
        suffix_mean = top.values.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=sel.dtype)
        below = torch.nonzero(suffix_mean < threshold)
        k = int(below[0]) if below.numel() else n - 1
    keep_sel = torch.ones(n, dtype=torch.bool)
    if k:
        keep_sel[top.indices[:k]] = False
    keep = torch.zeros_like(valid)
    keep[valid] = keep_sel
    m = {"m2po_m2_mean": sel.mean() if n else 0.0,
         "m2po_m2_mean_kept": sel[keep_sel].mean() if n else 0.0,
         "m2po_masked_fraction": k / n if n else 0.0}
    return (response_mask * keep).to(response_mask.dtype), m


BINARY_KL_EPS = 1e-8
"""Probabilities are clamped to [eps, 1 - eps] before the binary KL (AReaL's value)."""


def binary_kl(log_p, log_q, eps: float = BINARY_KL_EPS):
    """KL(Bernoulli(p) || Bernoulli(q)) = p log(p/q) + (1-p) log((1-p)/(1-q)), p = exp(log_p),
    q = exp(log_q), both clamped to [eps, 1 - eps] (AReaL's `compute_binary_kl_divergence`),
    in fp64 with 1 - p from expm1 (p near 1 keeps its digits; AReaL's fp32 1 - p loses them).
    fp64, so a threshold given as a Python float is compared exactly."""
    lp, lq = log_p.double(), log_q.double()
    p, q = lp.exp().clamp(eps, 1 - eps), lq.exp().clamp(eps, 1 - eps)
    p1, q1 = (-torch.expm1(lp)).clamp(eps, 1 - eps), (-torch.expm1(lq)).clamp(eps, 1 - eps)
    return p * (p.log() - q.log()) + p1 * (p1.log() - q1.log())


def kpop_mask(old_logprobs, rollout_logprobs, response_mask, phi: float):
    """KPop (Ant Group's Ring team; AReaL `rejection_sampling.metric: binary_kl`, level token,
    action mask): with p = pi_old(y_t), q = mu_old(y_t), keep a valid token iff D(p||q) <= phi
    and D(q||p) <= phi (`binary_kl`); the others leave the response mask. Returns (mask,
    metrics): `binary_kl_mean`, `binary_kl_max` (of max(D(p||q), D(q||p)) over valid tokens),
    `kpop_masked_fraction` (of valid tokens), `kpop_seq_masked_fraction` (of all rows)."""
    d = torch.maximum(binary_kl(old_logprobs, rollout_logprobs),
                      binary_kl(rollout_logprobs, old_logprobs))
    keep = d <= phi
    valid = response_mask.bool()
    drop = ~keep & valid
    m = {"binary_kl_mean": masked_mean(d, response_mask),
         "binary_kl_max": d.masked_fill(~valid, 0.0).max(),
         "kpop_masked_fraction": masked_mean(drop.float(), response_mask),
         "kpop_seq_masked_fraction": drop.any(-1).float().mean()}
    return (response_mask * keep).to(response_mask.dtype), m


def trm_mask(old_logprobs, rollout_logprobs, response_mask, delta: float | None,
             k3_mean: float | None):
    """Trust Region Masking (Li et al., arXiv 2512.23075): drop every token of a sequence that
    leaves the trust region. The paper's criterion is max_t KL(mu(.|c_t) || pi(.|c_t)) > eps;
    from the sampled tokens' log-probs alone it is detected as the authors propose: `delta`
    bounds max_t |log r_t| (r_t = pi_old / mu_old at the sampled token; symmetric, so r >> 1
    and r << 1 both count: the same rows as verl's `rollout_rs: seq_max_k2` at delta^2 / 2),
    `k3_mean` bounds the mean of k3 = r - 1 - log r over the sequence's tokens. Both on:
    both must pass. Returns (mask, metrics): `trm_max_abs_log_ratio` (mean over non-empty rows
    of the row's max |log r|), `trm_max_abs_log_ratio_max`, `trm_k3_seq_mean` (mean over
    non-empty rows of the row's mean k3), `trm_masked_fraction` (of valid tokens),
    `trm_seq_masked_fraction` (of all rows)."""
    valid = response_mask.bool()
    lr = (old_logprobs.detach().float() - rollout_logprobs.detach().float()).masked_fill(~valid, 0.0)
    lr = clamp_log_ratio(lr)
    n_B = valid.sum(-1)
    rows = n_B > 0
    max_B = lr.abs().amax(-1)
    k3_B = k3(lr).masked_fill(~valid, 0.0).sum(-1) / n_B.clamp(min=1)
    keep_B = torch.ones_like(rows)
    if delta is not None:
        keep_B &= max_B <= delta
    if k3_mean is not None:
        keep_B &= k3_B <= k3_mean
    drop_B = ~keep_B & rows
    nonempty = rows.any()
    # an empty row's max is 0, so the max over all rows is the non-empty rows' (or 0)
    m = {"trm_max_abs_log_ratio": torch.where(nonempty, max_B[rows].mean(), 0.0),
         "trm_max_abs_log_ratio_max": max_B.amax() if len(max_B) else 0.0,
         "trm_k3_seq_mean": torch.where(nonempty, k3_B[rows].mean(), 0.0),
         "trm_masked_fraction": masked_mean(drop_B[:, None].expand_as(valid).float(),
                                             response_mask),
         "trm_seq_masked_fraction": drop_B.float().mean()}
    return (response_mask * keep_B[:, None]).to(response_mask.dtype), m


def correct(cfg: CorrectionConfig, old_logprobs, rollout_logprobs, response_mask, *,
            floats: bool = True) -> CorrectionResult:
    """Weights, mask and `rollout_corr/*` metrics of `old_logprobs` (pi_old) vs `rollout_logprobs` (mu_old).

    In bypass mode call it inside the loss, under no_grad, with the current policy's log-probs in
    place of `old_logprobs` (verl's `compute_policy_loss_bypass_mode` does the same), and
    `floats=False`: the metrics stay 0-dim tensors, read with the optimiser step's others.
    """
    with torch.no_grad():
        w, mask, metrics = _correction(
            old_logprobs.detach(), rollout_logprobs.detach(), response_mask, cfg.rollout_is,
            cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize, cfg.rollout_rs, cfg.rollout_rs_threshold)
        if cfg.prob_diff_eps is not None:
            mask, pd = prob_diff_mask(old_logprobs.detach(), rollout_logprobs.detach(), mask, cfg.prob_diff_eps)
            metrics.update(_prefixed(pd))
        if cfg.kpop:
            mask, km = kpop_mask(old_logprobs.detach(), rollout_logprobs.detach(), mask, cfg.kpop_phi)
            metrics.update(_prefixed(km))
        if cfg.trm_delta is not None or cfg.trm_k3_mean is not None:
            # over every token of the response (a token another mask dropped still counts)
            keep, tm = trm_mask(old_logprobs.detach(), rollout_logprobs.detach(), response_mask,
                                cfg.trm_delta, cfg.trm_k3_mean)
            mask = (mask * keep).to(mask.dtype)
            metrics.update(_prefixed(tm))
        if cfg.m2po_threshold is not None:
            mask, mm = m2po_mask(old_logprobs.detach(), rollout_logprobs.detach(), mask, cfg.m2po_threshold)
            metrics.update(_prefixed(mm))
    return CorrectionResult(weights=w, response_mask=mask, metrics=to_floats(metrics) if floats else metrics)


def is_split_metrics(logprobs, old_logprobs, rollout_logprobs, response_mask) -> dict[str, float]:
    """Split pi_theta/mu_old = (pi_old/mu_old) [mismatch] x (pi_theta/pi_old) [staleness].

    For each part: `is_split/<part>_mean|max|min` of the ratio (log clamped +-20), `_log_mean`,
    `_log_std` (masked std of the log ratio) and `_k3` (mean r - 1 - log r). The log ratios add up
    exactly, so `mismatch_log_var_share` = var(log mismatch) / (var(log mismatch) + var(log staleness))
    says which part dominates the spread; `log_corr` is their correlation over valid tokens.
    """
    mk = _Mask(response_mask)
    mk.check(need_token=False)
    lp_z, old_z, roll_z = (_checked_zero_pad(mk, name, t.detach().float(), response_mask) for name, t in
                           (("logprobs", logprobs), ("old_logprobs", old_logprobs),
                            ("rollout_logprobs", rollout_logprobs)))
    parts = {"mismatch": old_z - roll_z, "staleness": lp_z - old_z, "total": lp_z - roll_z}
    m: dict[str, torch.Tensor] = {}
    var, dev = {}, {}
    for part, lr in parts.items():  # zero-padded, so masked means are sums (`_Mask`)
        dev[part], var[part] = _ratio_part(mk, part, lr, m)
    denom = var["mismatch"] + var["staleness"]
    m["is_split/mismatch_log_var_share"] = torch.where(denom > 0, var["mismatch"] / denom, 0.0)
    cov = mk.mean(dev["mismatch"] * dev["staleness"])
    sd = (var["mismatch"] * var["staleness"]).sqrt()
    m["is_split/log_corr"] = torch.where(sd > 0, cov / sd, 0.0)
    return to_floats(m)


def _ratio_part(mk: _Mask, part: str, lr, m: dict[str, torch.Tensor]):
    """`is_split/<part>_*` of the zero-padded log ratio `lr` into `m`; returns its masked
    deviation from the mean and its variance."""
    lr_c = clamp_log_ratio(lr)
    e = torch.exp(lr_c)  # 1 on padding, so k3 is 0 there
    r_z = e * mk.f
    mu = mk.mean(lr)
    dev = (lr - mu).mul_(mk.f)
    var = mk.mean_sq(dev)
    m[f"is_split/{part}_mean"] = mk.mean(r_z)
    m[f"is_split/{part}_max"] = mk.max(r_z, nonneg=True)
    m[f"is_split/{part}_min"] = mk.min(r_z)
    m[f"is_split/{part}_log_mean"] = mu
    m[f"is_split/{part}_log_std"] = var.sqrt()
    m[f"is_split/{part}_k3"] = mk.mean(k3(lr_c, e))
    return dev, var


def version_split_metrics(old_logprobs, gen_logprobs, rollout_logprobs, response_mask
                          ) -> dict[str, float]:
    """Split the mismatch part pi_old/mu_old further when samples come from an older weight
    version (async rollout, `loop.max_staleness` >= 1):

        pi_old/mu_old = (pi_old/pi_gen) [version] x (pi_gen/mu_old) [engine]

    `gen_logprobs` (pi_gen) are the trainer's log-probs under the weights of the version that
    generated each sample (`trainer.versions`, on the actor's ranks); for a sample of the current
    version they *are* `old_logprobs`, so its version ratio is exactly 1. `version` is the
    policy lag the rollout's staleness adds; `engine` is the train/infer mismatch at equal
    weights (what R3 and TIS address). Logged as `is_split/version_*` and `is_split/engine_*`
    with the statistics of `is_split_metrics`, plus `is_split/version_log_var_share` =
    var(log version) / (var(log version) + var(log engine)). Rollout correction (TIS, IcePop,
    RS) still applies to the full pi_old/mu_old, as verl's async mode does."""
    mk = _Mask(response_mask)
    mk.check(need_token=False)
    old_z, gen_z, roll_z = (_checked_zero_pad(mk, name, t.detach().float(), response_mask)
                            for name, t in (("old_logprobs", old_logprobs),
                                            ("gen_logprobs", gen_logprobs),
                                            ("rollout_logprobs", rollout_logprobs)))
    m: dict[str, torch.Tensor] = {}
    _, v_var = _ratio_part(mk, "version", old_z - gen_z, m)
    _, e_var = _ratio_part(mk, "engine", gen_z - roll_z, m)
    denom = v_var + e_var
    m["is_split/version_log_var_share"] = torch.where(denom > 0, v_var / denom, 0.0)
    return to_floats(m)


# ---------------------------------------------------------------- verl's batch entries
def compute_rollout_correction_and_add_to_batch(batch: dict, rollout_corr_config) -> tuple[dict, dict]:
    """verl's batch entry over a plain dict with 'old_log_probs', 'rollout_log_probs', 'response_mask'.

    Returns a new dict with 'response_mask' replaced and 'rollout_is_weights' added when IS is on.
    """
    cfg = rollout_corr_config if isinstance(rollout_corr_config, CorrectionConfig) else \
        CorrectionConfig.from_dict(dict(rollout_corr_config))
    w, mask, metrics = compute_rollout_correction_and_rejection_mask(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], cfg.rollout_is,
        cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize, cfg.rollout_rs, cfg.rollout_rs_threshold)
    out = dict(batch, response_mask=mask)
    if w is not None:
        out["rollout_is_weights"] = w
    return out, metrics


def apply_bypass_mode(batch: dict) -> None:
    """verl's bypass setup on a plain dict: old_log_probs := rollout_log_probs (in place)."""
    if "rollout_log_probs" not in batch:
        raise ValueError("bypass mode needs 'rollout_log_probs' in the batch (the engine must return log-probs)")
    batch["old_log_probs"] = batch["rollout_log_probs"]
