"""verl's `rollout_corr_helper` re-implemented (the semantics trainer/objective/correction.py describes):
option names and threshold strings, the zero-padded mask (`_Mask`), importance weights,
rejection masks, off-policy metrics and verl's entry points, under verl's names and argument
order. `trainer/objective/correction.py` is the face: it re-exports these and adds the typed API.

Metrics: the internal functions (`_is_weights`, `_rejection`, `_offpolicy`, ...) return 0-dim
device tensors, so a caller inside the update (bypass mode) reads them with the step's other
metrics; the public functions under verl's names return Python floats (`to_floats`, one read).
The checks of a call (a 0/1 mask, a valid token, no NaN / +inf log-prob) are one host read
(`_Mask.check`).

Shapes: B sequences, T response positions; every tensor is `[B, T]`; `response_mask` is 1 on
valid tokens.
"""

from __future__ import annotations

import math

import torch

from lockstep.trainer.objective.stats import SAFETY_BOUND, k3, to_floats

IS_LEVELS = ("token", "sequence", "geometric")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")


class _Mask:
    """A 0/1 response mask prepared once per call, and masked reductions over tensors that are
    already 0 on padding ("zero-padded": built from `zero_pad`-ed inputs, which is verl's
    where() guard applied once). Such sums need no mask multiply and no [B, T] temporary: the
    speed of the whole module rests on this (most metrics are one reduction pass).
    `check` validates it (and whatever else the caller reads with it) before use."""

    def __init__(self, mask: torch.Tensor, dtype: torch.dtype = torch.float32):
        self.b = mask if mask.dtype == torch.bool else mask.bool()
        self.f = mask if mask.dtype == dtype else mask.to(dtype)
        self.n = self.f.sum()                    # verl's mask.sum() (float)
        self.n_row = self.f.sum(-1)              # [B]
        # fill values as 0-d tensors: torch.where with a Python scalar is ~10x slower
        self.zero, self.inf = (torch.tensor(x, dtype=self.f.dtype) for x in (0.0, math.inf))

    def check(self, *extra: torch.Tensor, need_token: bool = True) -> list[float]:
        """Raise unless the mask is 0/1 (and, `need_token`, has a valid token); sets `count`
        and `n_pad`. One host read for it and the 0-dim tensors `extra`, returned as floats."""
        read = torch.stack([t.detach().reshape(()).double() for t in
                            (self.n, torch.count_nonzero(self.b), *extra)]).tolist()
        n, count, *values = read
        self.count = int(count)
        if n != self.count:
            raise ValueError("response_mask must hold only 0 and 1")
        if need_token and self.count == 0:
            raise ValueError("response_mask has no valid token")
        self.n_pad = self.b.numel() - self.count
        return values

    def zero_pad(self, v: torch.Tensor) -> torch.Tensor:
        return torch.where(self.b, v, self.zero)

    def mean(self, v_z: torch.Tensor) -> torch.Tensor:
        """verl's masked mean of a zero-padded tensor."""
        return v_z.sum() / (self.n + 1e-8)

    def mean_sq(self, v_z: torch.Tensor) -> torch.Tensor:
        """Masked mean of v^2. The same elements summed by the same kernel as verl's, so a
        variance E[v^2] - E[v]^2 that is all rounding (every weight clamped alike) rounds alike."""
        return v_z.square().sum() / (self.n + 1e-8)

    def row_mean(self, v_z: torch.Tensor) -> torch.Tensor:
        return v_z.sum(-1) / (self.n_row + 1e-8)

    def fraction(self, hit: torch.Tensor, at_padding: bool) -> torch.Tensor:
        """Masked mean of a bool tensor whose padding entries are all `at_padding`."""
        k = torch.count_nonzero(hit) - (self.n_pad if at_padding else 0)
        return k.to(self.n.dtype) / (self.n + 1e-8)

    def max(self, v_z: torch.Tensor, nonneg: bool = False) -> torch.Tensor:
        return v_z.max() if nonneg else torch.where(self.b, v_z, -self.inf).max()

    def min(self, v_z: torch.Tensor) -> torch.Tensor:
        return torch.where(self.b, v_z, self.inf).min()

    def row_max(self, v: torch.Tensor) -> torch.Tensor:
        """Per-row max over valid tokens (-inf for an empty row)."""
        return torch.where(self.b, v, -self.inf).max(-1).values


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
    mk = _Mask(response_mask, log_ratio.dtype)
    mk.check()
    weights, metrics = _is_weights(mk, mk.zero_pad(log_ratio), rollout_is, upper, lower,
                                   rollout_is_batch_normalize)
    return weights, to_floats(metrics)


def _is_weights(mk: _Mask, lr_z, level, upper, lower, normalize, rho_z=None):
    """`compute_rollout_correction_weights` on the zero-padded log ratio `lr_z` (`mk` checked
    to have a valid token); `rho_z` is exp(clamped lr_z) on valid tokens and 0 on padding,
    when the caller has it already."""
    if level == "token":
        lr_m = lr_z
        raw = rho_z if rho_z is not None else lr_z.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp_().mul_(mk.f)
    else:
        s = lr_z.sum(-1)
        lr_m = (s if level == "sequence" else s / (mk.n_row + 1e-8)).unsqueeze(-1)  # [B, 1]
        raw = lr_m.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * mk.f
    if lower is None:
        weights = raw.clamp(max=upper)
    else:  # IcePop: both bounds inclusive
        weights = torch.where((raw >= lower) & (raw <= upper), raw, mk.zero)
    metrics, mean_w, seq_w = _is_metrics(mk, weights, weights, raw, lr_m, level, upper, lower, nonneg=True)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = mk.fraction((raw < lower) | (raw > upper), at_padding=True)
    if normalize:
        if level == "token":
            mean = mean_w
        else:  # one weight per non-empty sequence
            seq_valid = (mk.n_row > 0).to(weights.dtype)
            mean = (seq_w * seq_valid).sum() / seq_valid.sum().clamp_min(1e-8)
        big = mean > 1e-8  # else the weights stay as they are
        weights = torch.where(big, weights / mean, weights)
        metrics["rollout_is_batch_norm_factor"] = torch.where(big, mean, 1.0)
    return weights, metrics


def compute_is_metrics(rollout_is_weights, raw_rollout_is_weights, log_ratio_for_metrics, response_mask, rollout_is,
                       rollout_is_threshold, rollout_is_threshold_lower=None):
    """IS weight statistics under verl's names (no prefix). Lower threshold defaults to 1/upper."""
    mk = _Mask(response_mask, rollout_is_weights.dtype)
    mk.check()
    w_z = mk.zero_pad(rollout_is_weights)
    return to_floats(_is_metrics(mk, w_z, w_z.clamp(min=0.0, max=rollout_is_threshold),
                                 mk.zero_pad(raw_rollout_is_weights), log_ratio_for_metrics,
                                 rollout_is, rollout_is_threshold, rollout_is_threshold_lower)[0])


def _is_metrics(mk: _Mask, w_z, w_c, raw_z, lr_m, rollout_is, upper, lower=None, nonneg=False):
    """`compute_is_metrics` on zero-padded weights `w_z`, their [0, upper] clamp `w_c` (the same
    tensor when already inside) and raw weights `raw_z`; `nonneg`: w_z >= 0. Also returns the
    masked mean weight and the per-sequence mean weights (batch normalisation reuses them)."""
    lower = 1.0 / upper if lower is None else lower
    mean_w = mk.mean(w_z)
    m: dict[str, torch.Tensor] = {"rollout_is_mean": mean_w}
    if rollout_is == "token":  # padding: raw 0, which is below `lower` and not above `upper`
        m["rollout_is_ratio_fraction_high"] = mk.fraction(raw_z > upper, at_padding=False)
        m["rollout_is_ratio_fraction_low"] = mk.fraction(raw_z < lower, at_padding=True)
        m["rollout_is_max"] = mk.max(w_z, nonneg)
        m["rollout_is_min"] = mk.min(w_z)
    else:  # per-sequence log ratio [B, 1]; empty rows count (log ratio 0), as in verl
        lr = lr_m
        m["rollout_is_max"] = torch.exp(lr.max().clamp(max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(lr.min())
        m["rollout_is_ratio_fraction_high"] = (lr > math.log(upper)).float().mean()
        m["rollout_is_ratio_fraction_low"] = (lr < math.log(lower)).float().mean()
    mean_c = mean_w if w_c is w_z else mk.mean(w_c)
    sq_c = mk.mean_sq(w_c)
    m["rollout_is_std"] = torch.where(mk.n > 1, (sq_c - mean_c.square()).clamp(min=0.0).sqrt(), 0.0)
    # verl: 1 / masked_mean((w_c / (mean_c + 1e-8))^2), with the scale taken out of the sum;
    # the reciprocal in float64, as verl's Python float division of the read value
    m["rollout_is_eff_sample_size"] = 1.0 / (sq_c / (mean_c + 1e-8).square()).double()
    seq_w = mk.row_mean(w_z)
    m["rollout_is_seq_mean"] = seq_w.mean()
    m["rollout_is_seq_std"] = seq_w.std() if seq_w.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_w.max()
    m["rollout_is_seq_min"] = seq_w.min()
    m["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max()
    raw_seq = mk.row_mean(raw_z)  # pre-truncation, else "high" could never fire under TIS
    m["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean()
    m["rollout_is_seq_fraction_low"] = (raw_seq < lower).float().mean()
    return m, mean_w, seq_w


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
    mk = _Mask(response_mask, log_ratio.dtype)
    mk.check(need_token=False)
    mask, metrics = _rejection(mk, response_mask, mk.zero_pad(log_ratio), options, thresholds)
    return mask, to_floats(metrics)


def _rejection(mk: _Mask, response_mask, lr_z, options, thresholds, exp_lr_z=None):
    """`compute_rollout_rejection_mask` on the zero-padded log ratio; `exp_lr_z` = exp(lr_z)
    when the caller has it and no |log ratio| exceeds the safety bound (no clamp then)."""
    lr = lr_z if exp_lr_z is not None else lr_z.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ks: dict[str, torch.Tensor] = {}  # k1/k2/k3 as options need them; all 0 on padding

    def k_of(name):
        if name not in ks:
            ks[name] = -lr if name == "k1" else 0.5 * lr.square() if name == "k2" else \
                (exp_lr_z if exp_lr_z is not None else torch.exp(lr)).sub(1.0).sub_(lr)
        return ks[name]

    seq_valid = mk.n_row > 0
    n_valid = seq_valid.float().sum()
    tok_keep = seq_keep = None  # bool [B, T] / [B]: every token / sequence option passed
    rejected_any = torch.zeros_like(seq_valid)  # rows with a valid token some option rejects
    metrics: dict[str, torch.Tensor] = {}
    for opt in options:
        lower, upper = thresholds[opt]
        k = k_of(opt[-2:])
        lo_t, up_t = (math.log(lower), math.log(upper)) if opt.endswith("k1") else (None, upper)
        if opt.startswith("token"):
            keep = k <= up_t if lo_t is None else (k >= lo_t) & (k <= up_t)
            rejected = torch.lt(keep, mk.b)  # valid and not kept
            rejected_row = rejected.any(-1)
            masked = torch.count_nonzero(rejected).to(mk.n.dtype) / (mk.n + 1e-8)
            metrics.update(_rs_metrics(mk, opt, k, None, seq_valid, "token", up_t, lo_t))
            tok_keep = keep if tok_keep is None else tok_keep.logical_and_(keep)
        else:
            if opt.startswith("seq_sum"):
                seq_stat = k.sum(-1)
            elif opt.startswith("seq_mean"):
                seq_stat = mk.row_mean(k)
            else:  # seq_max over valid tokens; an empty row scores 0
                mx = mk.row_max(k)
                seq_stat = torch.where(torch.isinf(mx) & (mx < 0), torch.zeros_like(mx), mx)
            keep = seq_stat <= up_t if lo_t is None else (seq_stat >= lo_t) & (seq_stat <= up_t)
            rejected_row = ~keep & seq_valid
            masked = ((~keep).to(mk.n.dtype) * mk.n_row).sum() / (mk.n + 1e-8)
            stat_z = seq_stat[:, None] * mk.f  # the row value on each valid token, as verl's
            metrics.update(_rs_metrics(mk, opt, stat_z, seq_stat, seq_valid, "sequence", up_t, lo_t))
            seq_keep = keep if seq_keep is None else seq_keep & keep
        metrics[f"rollout_rs_{opt}_masked_fraction"] = masked
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = torch.where(
            n_valid > 0, (rejected_row & seq_valid).float().sum() / n_valid, 0.0)
        rejected_any |= rejected_row
    keep_all = tok_keep if seq_keep is None else seq_keep[:, None] if tok_keep is None else \
        tok_keep.logical_and_(seq_keep[:, None])
    new_mask = (response_mask * keep_all).to(response_mask.dtype)
    kept = new_mask.sum(dtype=mk.n.dtype) if new_mask.dtype != torch.bool else \
        torch.count_nonzero(new_mask).to(mk.n.dtype)
    metrics["rollout_rs_masked_fraction"] = (mk.n - kept) / (mk.n + 1e-8)
    metrics["rollout_rs_seq_masked_fraction"] = rejected_any.float().mean()  # over all rows, as verl
    return new_mask, metrics


def compute_rs_metrics(option_name, rs_statistic, response_mask, seq_valid_mask, *, level, per_sequence_values,
                       rollout_rs_threshold, rollout_rs_threshold_lower, apply_lower_threshold):
    """Per-option RS statistics `rollout_rs_<option>_*` (thresholds in statistic space)."""
    mk = _Mask(response_mask, rs_statistic.dtype)
    mk.check()
    opt = option_name
    return to_floats(_rs_metrics(mk, opt, mk.zero_pad(rs_statistic), per_sequence_values, seq_valid_mask,
                                 level, rollout_rs_threshold,
                                 rollout_rs_threshold_lower if apply_lower_threshold else None))


def _rs_metrics(mk: _Mask, opt, stat_z, seq_stat, seq_valid, level, up, lo):
    """`compute_rs_metrics` on a zero-padded per-token statistic `stat_z` (a sequence option's:
    its row's value on each valid token) and the per-sequence values `seq_stat` [B] (None: row
    means of `stat_z`). `lo` None: no lower bound."""
    p = f"rollout_rs_{opt}"
    seq = seq_stat if seq_stat is not None else mk.row_mean(stat_z)
    seq = seq[seq_valid]  # NOTE: a boolean index waits for the device (its size)
    m = {f"{p}_mean": mk.mean(stat_z)}
    if level == "sequence" and seq.numel() > 0:
        m[f"{p}_max"], m[f"{p}_min"] = seq.max(), seq.min()
        m[f"{p}_fraction_high"] = (seq > up).float().mean()
        m[f"{p}_fraction_low"] = (seq < lo).float().mean() if lo is not None else 0.0
    else:
        m[f"{p}_max"] = mk.max(stat_z)
        m[f"{p}_min"] = mk.min(stat_z)
        m[f"{p}_fraction_high"] = mk.fraction(stat_z > up, at_padding=0.0 > up)
        m[f"{p}_fraction_low"] = mk.fraction(stat_z < lo, at_padding=0.0 < lo) \
            if lo is not None else 0.0
    c_lo = lo if lo is not None else 0.0
    s_c = stat_z.clamp(min=c_lo, max=up)
    if min(max(0.0, c_lo), up) != 0.0:  # the clamp moved the padding off 0
        s_c.mul_(mk.f)
    var = mk.mean_sq(s_c) - mk.mean(s_c).square()
    m[f"{p}_std"] = torch.where(mk.n > 1, var.clamp(min=0.0).sqrt(), 0.0)
    if seq.numel() > 0:
        m[f"{p}_seq_mean"] = seq.mean()
        m[f"{p}_seq_std"] = seq.std() if seq.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = seq.max(), seq.min()
        m[f"{p}_seq_max_deviation"] = seq.abs().max()
        m[f"{p}_seq_fraction_high"] = (seq > up).float().mean()
        if lo is not None:
            m[f"{p}_seq_fraction_low"] = (seq < lo).float().mean()
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
    mk = _Mask(response_mask, old_log_prob.dtype)
    mk.check()
    return to_floats(_offpolicy(mk, mk.zero_pad(old_log_prob),
                                None if rollout_log_prob is None else mk.zero_pad(rollout_log_prob)))


def _offpolicy(mk: _Mask, old_z, roll_z, lr_z=None, exp_lr_z=None, rho_z=None):
    """`compute_offpolicy_metrics` on zero-padded log-probs; the caller may pass the log ratio,
    its unclamped exp and rho_z = exp(clamped log ratio) x mask when it has them."""
    mean_old = mk.row_mean(old_z)  # [B]
    m = {"training_ppl": torch.exp(-mean_old).mean(), "training_log_ppl": (-mean_old).mean()}
    if roll_z is None:
        return m
    lr_z = old_z - roll_z if lr_z is None else lr_z
    m["kl"] = (-mk.mean(lr_z))
    # verl's k3_kl takes the unclamped log ratio; 0 on padding (exp(0) - 0 - 1)
    m["k3_kl"] = mk.mean(k3(lr_z, exp_lr_z))
    mean_roll = mk.row_mean(roll_z)
    m["rollout_ppl"] = torch.exp(-mean_roll).mean()
    m["rollout_log_ppl"] = (-mean_roll).mean()
    diff = mean_roll - mean_old
    m["log_ppl_diff"] = diff.mean()
    m["log_ppl_abs_diff"] = diff.abs().mean()
    m["log_ppl_diff_max"], m["log_ppl_diff_min"] = diff.max(), diff.min()
    m["ppl_ratio"] = torch.exp(diff).mean()
    if rho_z is None:
        rho_z = lr_z.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp_().mul_(mk.f)
    m["chi2_token"] = (mk.mean_sq(rho_z) - 1.0)
    seq_lr = lr_z.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * seq_lr).mean() - 1.0)
    return m


def _prefixed(metrics: dict) -> dict:
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def check_logprobs(name: str, logprobs: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Raise naming (row, position) if a valid token's log-prob is NaN or +inf, or shapes differ."""
    if logprobs.shape != response_mask.shape:
        raise ValueError(f"{name} shape {tuple(logprobs.shape)} != response_mask shape {tuple(response_mask.shape)}")
    bad = (torch.isnan(logprobs) | (logprobs == math.inf)) & response_mask.bool()
    if bad.any():
        r, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name} is {logprobs[r, t].item()} at row {r}, position {t} (a valid response token)")


def _checked_zero_pad(mk: _Mask, name: str, logprobs, response_mask):
    """`logprobs` with padding set to 0, checked as `check_logprobs` does: a sum is NaN or +inf
    whenever a valid entry is, so only then the full check runs (and names the position)."""
    if logprobs.shape != response_mask.shape:
        check_logprobs(name, logprobs, response_mask)
    x_z = mk.zero_pad(logprobs)
    s = x_z.sum()
    if torch.isnan(s) or s == math.inf:
        check_logprobs(name, logprobs, response_mask)
    return x_z


def compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, rollout_is=None,
                                                  rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                                                  rollout_rs=None, rollout_rs_threshold=None):
    """verl's one-call entry: (IS weights or None, response mask after RS, metrics `rollout_corr/*`).

    Same values as verl's, computed in far fewer passes: log-probs are zero-padded once, the
    log ratio and its exp are shared by the weights, the RS statistics and the off-policy
    metrics, and masked means are plain sums (`_Mask`)."""
    weights, mask, metrics = _correction(old_log_prob, rollout_log_prob, response_mask, rollout_is,
                                         rollout_is_threshold, rollout_is_batch_normalize,
                                         rollout_rs, rollout_rs_threshold)
    return weights, mask, to_floats(metrics)


def _correction(old_log_prob, rollout_log_prob, response_mask, rollout_is, rollout_is_threshold,
                rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold):
    """`compute_rollout_correction_and_rejection_mask` with its metrics as 0-dim tensors; the
    checks of its inputs and the choice of the unclamped fast path are one host read."""
    mk = _Mask(response_mask, old_log_prob.dtype)
    inputs = (("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob))
    for name, x in inputs:
        if x.shape != response_mask.shape:
            check_logprobs(name, x, response_mask)
    if response_mask.numel() == 0:
        raise ValueError("response_mask has no valid token")
    old_z, roll_z = mk.zero_pad(old_log_prob), mk.zero_pad(rollout_log_prob)
    lr_z = old_z - roll_z
    lo, hi = torch.aminmax(lr_z)
    s_old, s_roll, lo, hi = mk.check(old_z.sum(), roll_z.sum(), lo, hi)
    for (name, x), s in zip(inputs, (s_old, s_roll)):
        if math.isnan(s) or s == math.inf:  # so is a valid entry: name its position
            check_logprobs(name, x, response_mask)
    in_bounds = lo >= -SAFETY_BOUND and hi <= SAFETY_BOUND  # False on NaN too
    exp_lr_z = torch.exp(lr_z)  # 1 on padding
    rho_z = exp_lr_z * mk.f if in_bounds else lr_z.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp_().mul_(mk.f)
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        if rollout_is not in IS_LEVELS:
            raise ValueError(f"unknown rollout_is level {rollout_is!r}; valid: {', '.join(IS_LEVELS)}")
        upper, lower = parse_is_threshold(rollout_is_threshold)
        weights, is_m = _is_weights(mk, lr_z, rollout_is, upper, lower, rollout_is_batch_normalize, rho_z)
        metrics.update(is_m)
    if rollout_rs is not None:
        options = parse_rs_options(rollout_rs)
        thresholds = parse_rs_thresholds(options, rollout_rs_threshold)
        mask, rs_m = _rejection(mk, response_mask, lr_z, options, thresholds,
                                exp_lr_z if in_bounds else None)
        metrics.update(rs_m)
    else:
        mask = response_mask.clone()
    metrics.update(_offpolicy(mk, old_z, roll_z, lr_z, exp_lr_z, rho_z))
    return weights, mask, _prefixed(metrics)


def compute_rollout_corr_metrics_from_logprobs(log_prob, rollout_log_prob, response_mask):
    """Off-policy metrics of the *current* policy vs the rollout (verl logs these in the actor)."""
    return _prefixed(compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask))
