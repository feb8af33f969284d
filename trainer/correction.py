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
  DataProto holding "rollout_is_weights" where we return the tensor.

Beyond verl: the `geometric` IS level (per-sequence exp of the masked *mean* log ratio), the
IPO/DPPO probability-difference mask, and `is_split_metrics` (mismatch x staleness factorisation).

Log-probs are named by origin: `rollout_logprobs` (mu_old, the engine's), `old_logprobs` (pi_old,
trainer recompute before the update), `logprobs` (pi_theta, current). Shapes: B sequences, T
response positions; every tensor is `[B, T]`; `response_mask` is 1 on valid tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lockstep.moe.config import strict_kwargs

SAFETY_BOUND = 20.0  # |log ratio| clamp before exp (verl's value)
IS_LEVELS = ("token", "sequence", "geometric")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")


def _masked_sum(v, mask, dim=None):
    # where() first, so NaN/inf outside the mask cannot leak into the sum (verl does the same)
    s = torch.where(mask.bool(), v, torch.zeros_like(v)) * mask
    return s.sum() if dim is None else s.sum(dim)


def _masked_mean(v, mask, dim=None):
    n = mask.sum() if dim is None else mask.sum(dim)
    return _masked_sum(v, mask, dim) / (n + 1e-8)


# ---------------------------------------------------------------- threshold parsing
def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """`2.0` or `"2.0"` -> (2.0, None) = TIS clamp; `"0.5_2.0"` -> (2.0, 0.5) = IcePop bounds."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    try:
        if isinstance(spec, str):
            text = spec.strip()
            if "_" in text:
                lo, up = text.split("_", 1)
                lower, upper = float(lo), float(up)
            else:
                upper = float(text)
        else:
            upper = float(spec)
    except ValueError as exc:
        raise ValueError(f"invalid rollout_is_threshold {spec!r}: expected a number C or 'lower_upper'") from exc
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper} in {spec!r}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_is_threshold needs 0 < lower <= upper, got {spec!r}")
    return upper, lower


def parse_rs_options(rollout_rs: str) -> list[str]:
    """Comma-separated options -> list, duplicates dropped, unknown names rejected."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a comma-separated string, got {rollout_rs!r}")
    out: list[str] = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {opt!r}; valid: {', '.join(RS_OPTIONS)}")
        if opt not in out:
            out.append(opt)
    if not out:
        raise ValueError(f"rollout_rs {rollout_rs!r} names no option; valid: {', '.join(RS_OPTIONS)}")
    return out


def parse_rs_thresholds(options: list[str], spec: float | str | None) -> dict[str, tuple[float | None, float]]:
    """Per option (lower, upper) on the *ratio*. One spec for all options or one per option.

    k1 options take 'lower_upper' (a single U means lower = 1/U); k2/k3 options one upper bound.
    """
    if spec is None:
        raise ValueError("rollout_rs_threshold must be given when rollout_rs is set")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a number or string, got {spec!r}")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold {spec!r} has {len(parts)} entries; give 1 or {len(options)} "
                         f"(one per option of {options})")
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for opt, p in zip(options, parts):
        try:
            if opt.endswith("k1"):
                lo, up = p.split("_", 1) if "_" in p else (None, p)
                upper = float(up)
                lower = float(lo) if lo is not None else 1.0 / upper
            else:
                if "_" in p:
                    raise ValueError(f"option {opt!r} takes one upper bound, not 'lower_upper' ({p!r})")
                lower, upper = None, float(p)
        except ZeroDivisionError as exc:
            raise ValueError(f"threshold {p!r} for option {opt!r} must be positive") from exc
        except ValueError as exc:
            if "takes one upper bound" in str(exc):
                raise
            raise ValueError(f"invalid threshold {p!r} for option {opt!r}") from exc
        if not upper > 0 or (lower is not None and not lower > 0):
            raise ValueError(f"threshold {p!r} for option {opt!r} must be positive")
        if lower is not None and lower > upper:
            raise ValueError(f"threshold {p!r} for option {opt!r} needs lower <= upper")
        out[opt] = (lower, upper)
    return out


# ---------------------------------------------------------------- importance weights
def compute_rollout_correction_weights(log_ratio, response_mask, rollout_is="token", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=False):
    """IS weights exp(log_ratio) at `rollout_is` level, TIS-clamped or IcePop-zeroed, detached.

    Returns (weights [B, T], metrics without prefix). Metrics describe the weights before batch
    normalisation (as verl); `rollout_is_batch_norm_factor` is the divisor when normalising.
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {rollout_is!r}; valid: {', '.join(IS_LEVELS)}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        agg = _masked_sum if rollout_is == "sequence" else _masked_mean
        log_ratio_for_metrics = agg(log_ratio, response_mask, -1).unsqueeze(-1)  # [B, 1]
        raw = torch.exp(log_ratio_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = torch.where(response_mask.bool(), raw, torch.zeros_like(raw)) * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:  # IcePop: both bounds inclusive
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = compute_is_metrics(weights, raw, log_ratio_for_metrics, response_mask, rollout_is, upper, lower)
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = _masked_mean(oob.float(), response_mask).item()
    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = _masked_mean(weights, response_mask)
        else:  # one weight per non-empty sequence
            seq_w = _masked_mean(weights, response_mask, -1)
            seq_valid = (response_mask.sum(-1) > 0).to(weights.dtype)
            mean = (seq_w * seq_valid).sum() / seq_valid.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def compute_is_metrics(rollout_is_weights, raw_rollout_is_weights, log_ratio_for_metrics, response_mask, rollout_is,
                       rollout_is_threshold, rollout_is_threshold_lower=None):
    """IS weight statistics under verl's names (no prefix). Lower threshold defaults to 1/upper."""
    if not response_mask.any():
        raise ValueError("response_mask has no valid token")
    w, raw, mask = rollout_is_weights, raw_rollout_is_weights, response_mask
    upper = rollout_is_threshold
    lower = 1.0 / upper if rollout_is_threshold_lower is None else rollout_is_threshold_lower
    m: dict[str, float] = {"rollout_is_mean": _masked_mean(w, mask).item()}
    if rollout_is == "token":
        m["rollout_is_ratio_fraction_high"] = _masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = _masked_mean((raw < lower).float(), mask).item()
        m["rollout_is_max"] = w.masked_fill(~mask.bool(), -math.inf).max().item()
        m["rollout_is_min"] = w.masked_fill(~mask.bool(), math.inf).min().item()
    else:  # per-sequence log ratio [B, 1]; empty rows count (log ratio 0), as in verl
        lr = log_ratio_for_metrics
        m["rollout_is_max"] = torch.exp(lr.max().clamp(max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(lr.min()).item()
        m["rollout_is_ratio_fraction_high"] = (lr > math.log(upper)).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (lr < math.log(lower)).float().mean().item()
    w_c = w.clamp(min=0.0, max=upper)
    if mask.sum() > 1:
        var = _masked_mean(w_c.square(), mask) - _masked_mean(w_c, mask).square()
        m["rollout_is_std"] = var.clamp(min=0.0).sqrt().item()
    else:
        m["rollout_is_std"] = 0.0
    w_n = w_c / (_masked_mean(w_c, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / _masked_mean(w_n.square(), mask).item()
    seq_w = _masked_mean(w, mask, -1)
    m["rollout_is_seq_mean"] = seq_w.mean().item()
    m["rollout_is_seq_std"] = seq_w.std().item() if seq_w.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_w.max().item()
    m["rollout_is_seq_min"] = seq_w.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max().item()
    raw_seq = _masked_mean(raw, mask, -1)  # pre-truncation, else "high" could never fire under TIS
    m["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq < lower).float().mean().item()
    return m


# ---------------------------------------------------------------- rejection sampling
def compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs="token_k1", rollout_rs_threshold=None):
    """Mask tokens/sequences whose divergence estimate leaves the bounds; every option must pass.

    k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r with log r clamped to +-20. Token options
    act per token; seq_sum/seq_mean/seq_max aggregate over the sequence's valid tokens and reject
    the whole sequence. k1 keeps log(lower) <= k1 <= log(upper). Returns (mask, metrics).
    """
    options = parse_rs_options(rollout_rs)
    thresholds = parse_rs_thresholds(options, rollout_rs_threshold)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_k = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    mask_b = response_mask.bool()
    seq_valid = response_mask.sum(-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for opt in options:
        lower, upper = thresholds[opt]
        k = per_k[opt[-2:]]
        if opt.endswith("k1"):
            lo_t, up_t = math.log(lower), math.log(upper)
        else:
            lo_t, up_t = None, upper
        if opt.startswith("token"):
            stat, seq_stat = k, None
        else:
            if opt.startswith("seq_sum"):
                seq_stat = _masked_sum(k, response_mask, -1)
            elif opt.startswith("seq_mean"):
                seq_stat = _masked_mean(k, response_mask, -1)
            else:  # seq_max over valid tokens; an empty row scores 0
                mx = k.masked_fill(~mask_b, -math.inf).max(-1).values
                seq_stat = torch.where(torch.isinf(mx) & (mx < 0), torch.zeros_like(mx), mx)
            stat = seq_stat.unsqueeze(-1).expand_as(k)
        keep = stat <= up_t if lo_t is None else (stat >= lo_t) & (stat <= up_t)
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        metrics.update(compute_rs_metrics(opt, stat, response_mask, seq_valid, level="token" if seq_stat is None
                                          else "sequence", per_sequence_values=seq_stat, rollout_rs_threshold=up_t,
                                          rollout_rs_threshold_lower=lo_t if lo_t is not None else 0.0,
                                          apply_lower_threshold=lo_t is not None))
        metrics[f"rollout_rs_{opt}_masked_fraction"] = _masked_mean(1 - keep_f, response_mask).item()
        seq_kept = ~((~keep) & mask_b).any(-1)
        n_valid = seq_valid.float().sum()
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = (
            ((~seq_kept) & seq_valid).float().sum() / n_valid).item() if n_valid > 0 else 0.0
    metrics["rollout_rs_masked_fraction"] = _masked_mean(1 - combined, response_mask).item()
    rejected_any = ((combined <= 0.5) & mask_b).any(-1)
    metrics["rollout_rs_seq_masked_fraction"] = rejected_any.float().mean().item()  # over all rows, as verl
    return (response_mask * combined).to(response_mask.dtype), metrics


def compute_rs_metrics(option_name, rs_statistic, response_mask, seq_valid_mask, *, level, per_sequence_values,
                       rollout_rs_threshold, rollout_rs_threshold_lower, apply_lower_threshold):
    """Per-option RS statistics `rollout_rs_<option>_*` (thresholds in statistic space)."""
    if not response_mask.any():
        raise ValueError("response_mask has no valid token")
    p, mask, stat = f"rollout_rs_{option_name}", response_mask, rs_statistic
    up, lo = rollout_rs_threshold, rollout_rs_threshold_lower
    seq = per_sequence_values if per_sequence_values is not None else _masked_mean(stat, mask, -1)
    seq = seq[seq_valid_mask]
    m = {f"{p}_mean": _masked_mean(stat, mask).item()}
    if level == "sequence" and seq.numel() > 0:
        m[f"{p}_max"], m[f"{p}_min"] = seq.max().item(), seq.min().item()
        m[f"{p}_fraction_high"] = (seq > up).float().mean().item()
        m[f"{p}_fraction_low"] = (seq < lo).float().mean().item() if apply_lower_threshold else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~mask.bool(), -math.inf).max().item()
        m[f"{p}_min"] = stat.masked_fill(~mask.bool(), math.inf).min().item()
        m[f"{p}_fraction_high"] = _masked_mean((stat > up).float(), mask).item()
        m[f"{p}_fraction_low"] = _masked_mean((stat < lo).float(), mask).item() if apply_lower_threshold else 0.0
    if mask.sum() > 1:
        s_c = stat.clamp(min=lo if apply_lower_threshold else 0.0, max=up)
        var = _masked_mean(s_c.square(), mask) - _masked_mean(s_c, mask).square()
        m[f"{p}_std"] = var.clamp(min=0.0).sqrt().item()
    else:
        m[f"{p}_std"] = 0.0
    if seq.numel() > 0:
        m[f"{p}_seq_mean"] = seq.mean().item()
        m[f"{p}_seq_std"] = seq.std().item() if seq.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = seq.max().item(), seq.min().item()
        m[f"{p}_seq_max_deviation"] = seq.abs().max().item()
        m[f"{p}_seq_fraction_high"] = (seq > up).float().mean().item()
        if apply_lower_threshold:
            m[f"{p}_seq_fraction_low"] = (seq < lo).float().mean().item()
    else:
        for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                  "seq_fraction_low"):
            m[f"{p}_{k}"] = 0.0
    return m


# ---------------------------------------------------------------- off-policy metrics
def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """KL / perplexity / chi^2 diagnostics between the trainer's and the rollout's log-probs.

    Per-sequence quantities average over all rows, empty rows included (verl's definition).
    """
    if not response_mask.any():
        raise ValueError("response_mask has no valid token")
    mean_old = _masked_mean(old_log_prob, response_mask, -1)  # [B]
    m = {"training_ppl": torch.exp(-mean_old).mean().item(), "training_log_ppl": (-mean_old).mean().item()}
    if rollout_log_prob is None:
        return m
    lr = old_log_prob - rollout_log_prob
    m["kl"] = _masked_mean(-lr, response_mask).item()
    m["k3_kl"] = _masked_mean(torch.exp(lr) - lr - 1, response_mask).item()
    mean_roll = _masked_mean(rollout_log_prob, response_mask, -1)
    m["rollout_ppl"] = torch.exp(-mean_roll).mean().item()
    m["rollout_log_ppl"] = (-mean_roll).mean().item()
    diff = mean_roll - mean_old
    m["log_ppl_diff"] = diff.mean().item()
    m["log_ppl_abs_diff"] = diff.abs().mean().item()
    m["log_ppl_diff_max"], m["log_ppl_diff_min"] = diff.max().item(), diff.min().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    m["chi2_token"] = (_masked_mean(rho.square(), response_mask) - 1.0).item()
    seq_lr = _masked_sum(lr, response_mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * seq_lr).mean() - 1.0).item()
    return m


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    return {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}


def check_logprobs(name: str, logprobs: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Raise naming (row, position) if a valid token's log-prob is NaN or +inf, or shapes differ."""
    if logprobs.shape != response_mask.shape:
        raise ValueError(f"{name} shape {tuple(logprobs.shape)} != response_mask shape {tuple(response_mask.shape)}")
    bad = (torch.isnan(logprobs) | (logprobs == math.inf)) & response_mask.bool()
    if bad.any():
        r, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name} is {logprobs[r, t].item()} at row {r}, position {t} (a valid response token)")


def compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_is=None,
                                                  rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                                                  rollout_rs=None, rollout_rs_threshold=None):
    """verl's one-call entry: (IS weights or None, response mask after RS, metrics `rollout_corr/*`)."""
    if not response_mask.any():
        raise ValueError("response_mask has no valid token")
    check_logprobs("old_log_prob", old_log_prob, response_mask)
    check_logprobs("rollout_log_prob", rollout_log_prob, response_mask)
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_m = compute_rollout_correction_weights(log_ratio, response_mask, rollout_is,
                                                           rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(is_m)
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, rs_m = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_m)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, _prefixed(metrics)


def compute_rollout_corr_metrics_from_logprobs(log_prob, rollout_log_prob, response_mask):
    """Off-policy metrics of the *current* policy vs the rollout (verl logs these in the actor)."""
    return _prefixed(compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask))


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


# ---------------------------------------------------------------- typed API
@dataclass
class CorrectionConfig:
    """Rollout-correction settings (field names as verl's `RolloutCorrectionConfig`)."""

    rollout_is: str | None = None  # None (off) | "token" | "sequence" | "geometric" (ours)
    rollout_is_threshold: float | str = 2.0  # C -> TIS clamp(max=C); "lower_upper" -> IcePop
    rollout_is_batch_normalize: bool = False  # rescale weights to batch mean 1
    rollout_rs: str | None = None  # comma-separated RS options, all must pass; None = off
    rollout_rs_threshold: float | str | None = None  # one for all options or one per option
    bypass_mode: bool = False  # True: pi_old := mu_old, IS/RS against the current policy in the loss
    loss_type: str = "ppo_clip"  # bypass only: "ppo_clip" (ratio is the IS) | "reinforce" (apply weights)
    prob_diff_eps: float | None = None  # IPO/DPPO mask: drop tokens with |p_old - p_rollout| > eps (0.3 typical)

    def __post_init__(self):
        if self.rollout_is is not None:
            if self.rollout_is not in IS_LEVELS:
                raise ValueError(f"unknown rollout_is {self.rollout_is!r}; valid: None, {', '.join(IS_LEVELS)}")
            parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
        if self.prob_diff_eps is not None and not 0 < self.prob_diff_eps <= 1:
            raise ValueError(f"prob_diff_eps must be in (0, 1], got {self.prob_diff_eps}")

    @classmethod
    def from_dict(cls, d: dict) -> "CorrectionConfig":
        return cls(**strict_kwargs(cls, d, "correction", ValueError))


@dataclass
class CorrectionResult:
    weights: torch.Tensor | None  # [B, T] detached IS weights, 0 on padding; None when IS is off
    response_mask: torch.Tensor  # [B, T] after rejection sampling and the prob-diff mask
    metrics: dict[str, float]  # "rollout_corr/<name>" -> value


def prob_diff_mask(old_logprobs, rollout_logprobs, response_mask, eps: float):
    """IPO/DPPO trust mask: zero tokens with |exp(old) - exp(rollout)| > eps. Returns (mask, metrics)."""
    diff = (old_logprobs.exp() - rollout_logprobs.exp()).abs()
    keep = diff <= eps
    mask_b = response_mask.bool()
    m = {"prob_diff_mean": _masked_mean(diff, response_mask).item(),
         "prob_diff_max": diff.masked_fill(~mask_b, 0.0).max().item(),
         "prob_diff_masked_fraction": _masked_mean((~keep).float(), response_mask).item(),
         "prob_diff_seq_masked_fraction": ((~keep) & mask_b).any(-1).float().mean().item()}
    return (response_mask * keep).to(response_mask.dtype), m


def correct(cfg: CorrectionConfig, old_logprobs, rollout_logprobs, response_mask) -> CorrectionResult:
    """Weights, mask and `rollout_corr/*` metrics of `old_logprobs` (pi_old) vs `rollout_logprobs` (mu_old).

    In bypass mode call it inside the loss, under no_grad, with the current policy's log-probs in
    place of `old_logprobs` (verl's `compute_policy_loss_bypass_mode` does the same).
    """
    with torch.no_grad():
        w, mask, metrics = compute_rollout_correction_and_rejection_mask(
            old_logprobs.detach(), rollout_logprobs.detach(), response_mask, cfg.rollout_is,
            cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize, cfg.rollout_rs, cfg.rollout_rs_threshold)
        if cfg.prob_diff_eps is not None:
            mask, pd = prob_diff_mask(old_logprobs.detach(), rollout_logprobs.detach(), mask, cfg.prob_diff_eps)
            metrics.update(_prefixed(pd))
    return CorrectionResult(weights=w, response_mask=mask, metrics=metrics)


def is_split_metrics(logprobs, old_logprobs, rollout_logprobs, response_mask) -> dict[str, float]:
    """Split pi_theta/mu_old = (pi_old/mu_old) [mismatch] x (pi_theta/pi_old) [staleness].

    For each part: `is_split/<part>_mean|max|min` of the ratio (log clamped +-20), `_log_mean`,
    `_log_std` (masked std of the log ratio) and `_k3` (mean r - 1 - log r). The log ratios add up
    exactly, so `mismatch_log_var_share` = var(log mismatch) / (var(log mismatch) + var(log staleness))
    says which part dominates the spread; `log_corr` is their correlation over valid tokens.
    """
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        check_logprobs(name, t, response_mask)
    parts = {"mismatch": old_logprobs - rollout_logprobs, "staleness": logprobs - old_logprobs,
             "total": logprobs - rollout_logprobs}
    mask, mask_b = response_mask, response_mask.bool()
    m: dict[str, float] = {}
    var = {}
    for part, lr in parts.items():
        lr = lr.detach().float()
        r = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        mu = _masked_mean(lr, mask)
        var[part] = _masked_mean((lr - mu).square(), mask)
        m[f"is_split/{part}_mean"] = _masked_mean(r, mask).item()
        m[f"is_split/{part}_max"] = r.masked_fill(~mask_b, -math.inf).max().item()
        m[f"is_split/{part}_min"] = r.masked_fill(~mask_b, math.inf).min().item()
        m[f"is_split/{part}_log_mean"] = mu.item()
        m[f"is_split/{part}_log_std"] = var[part].sqrt().item()
        m[f"is_split/{part}_k3"] = _masked_mean(r - 1 - lr.clamp(-SAFETY_BOUND, SAFETY_BOUND), mask).item()
    denom = var["mismatch"] + var["staleness"]
    m["is_split/mismatch_log_var_share"] = (var["mismatch"] / denom).item() if denom > 0 else 0.0
    a = parts["mismatch"].detach().float() - _masked_mean(parts["mismatch"].detach().float(), mask)
    b = parts["staleness"].detach().float() - _masked_mean(parts["staleness"].detach().float(), mask)
    cov = _masked_mean(a * b, mask)
    sd = (var["mismatch"] * var["staleness"]).sqrt()
    m["is_split/log_corr"] = (cov / sd).item() if sd > 0 else 0.0
    return m
