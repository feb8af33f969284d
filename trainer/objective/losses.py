"""Policy losses and advantages: PPO clip (dual clip), GSPO, REINFORCE, GRPO advantages, KL, aggregation.

Pure functions over `[B, T]` tensors (B sequences, T response positions; `response_mask` is 1 on
valid tokens). Log-probs are named by origin: `logprobs` (pi_theta, with grad), `old_logprobs`
(pi_old, the PPO ratio's denominator), `rollout_logprobs` (mu_old, the engine's), `ref_logprobs`
(the frozen reference). Definitions and metric names follow verl 0.9.1 `core_algos`
(`compute_policy_loss_vanilla`, `compute_policy_loss_gspo`, `agg_loss`, `kl_penalty`,
`compute_grpo_outcome_advantage`, `compute_policy_loss_dppo_tv` / `_dppo_kl`) so numbers and
dashboards carry over; DeepSeek-V3.2's off-policy sequence masking and unbiased KL follow slime
(`compute_opsm_mask`, `compute_approx_kl` with `--use-unbiased-kl`).

Metrics are detached 0-dim tensors on the inputs' device (a setting, e.g. `actor/kl_coef`, is a
Python float): the actor adds them over micro-batches and reads them once per optimiser step
(`stats.to_floats`), so a loss never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from lockstep.moe.checks import strict_kwargs
from lockstep.trainer.objective.correction import CorrectionConfig, correct
from lockstep.trainer.objective.stats import k3, log_ratio, masked_mean

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# verl 0.9.1 `kl_penalty` names: kl/k1 = log(pi/ref), abs = |log(pi/ref)|, mse/k2 = half its square,
# low_var_kl/k3 = exp(ref - pi) - (ref - pi) - 1; a "+" suffix (e.g. "k3+") keeps the value but
# takes k2's gradient (straight-through), which is the unbiased gradient of KL.
KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_ESTIMATORS = KL_LOSS_TYPES + tuple(k + "+" for k in KL_LOSS_TYPES if k not in ("mse", "k2"))
RATIO_LEVELS = ("token", "sequence")  # sequence = GSPO
# verl 0.9.1 `policy_loss.loss_mode` names: vanilla = PPO clip (or GSPO with ratio_level=sequence);
# dppo_tv / dppo_kl = DPPO's binary-TV / binary-KL trust masks (arXiv 2602.04879)
LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl")
OPSM_LOGPROBS = ("rollout", "old")


@dataclass
class LossConfig:
    """Policy-loss settings."""

    clip_ratio_low: float = 0.2  # ratio clipped below at 1 - low
    clip_ratio_high: float = 0.2  # ratio clipped above at 1 + high (0.28 = DAPO clip-higher)
    clip_ratio_c: float | None = 3.0  # dual clip for A < 0: loss <= -A * c; None disables; must be > 1
    ratio_level: Literal[RATIO_LEVELS] = "token"  # "token" (PPO) | "sequence" (GSPO length-normalised sequence ratio)
    loss_agg_mode: Literal[AGG_MODES] = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    kl_coef: float = 0.0  # weight of the KL-to-reference loss (0 = off, ref_logprobs not needed)
    kl_loss_type: Literal[KL_ESTIMATORS] = "low_var_kl"  # verl's names: kl/k1, abs, mse/k2, low_var_kl/k3; "+" = k2 grad
    entropy_coef: float = 0.0  # subtract entropy_coef * aggregated entropy from the loss
    # verl's name: vanilla (PPO/GSPO) | dppo_tv | dppo_kl (clip_ratio_* = divergence bounds)
    loss_mode: Literal[LOSS_MODES] = field(default="vanilla", metadata={"saved": "non_default"})
    # DeepSeek-V3.2: KL term times pi_theta/pi_old (slime/miles --use-unbiased-kl)
    unbiased_kl: bool = field(default=False, metadata={"saved": "non_default"})
    # DeepSeek-V3.2 OPSM: mask A<0 sequences whose mean log(behaviour/pi_theta) > delta (slime --use-opsm --opsm-delta, 1e-4 there)
    opsm_delta: float | None = field(default=None, metadata={"saved": "non_default"})
    # OPSM's behaviour policy: rollout (mu_old, DeepSeek-V3.2) | old (pi_old)
    opsm_logprobs: Literal[OPSM_LOGPROBS] = field(default="rollout", metadata={"saved": "non_default"})

    def __post_init__(self):
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
                             f"{self.clip_ratio_low}, {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c}")
        for name, val, valid in (("ratio_level", self.ratio_level, RATIO_LEVELS),
                                 ("loss_agg_mode", self.loss_agg_mode, AGG_MODES),
                                 ("kl_loss_type", self.kl_loss_type, KL_ESTIMATORS),
                                 ("loss_mode", self.loss_mode, LOSS_MODES),
                                 ("opsm_logprobs", self.opsm_logprobs, OPSM_LOGPROBS)):
            if val not in valid:
                raise ValueError(f"unknown {name} {val!r}; valid: {', '.join(valid)}")
        if self.unbiased_kl and self.kl_coef == 0:
            raise ValueError("loss.unbiased_kl=true has no effect with loss.kl_coef=0 (there is "
                             "no KL term to weight); set loss.kl_coef > 0 or drop it")
        if self.loss_mode != "vanilla" and self.ratio_level != "token":
            raise ValueError(f"loss_mode={self.loss_mode} is a per-token loss; it needs ratio_level=token, "
                             f"got {self.ratio_level!r}")
        if self.opsm_delta is None and self.opsm_logprobs != "rollout":
            raise ValueError(f"loss.opsm_logprobs={self.opsm_logprobs!r} has no effect without "
                             "loss.opsm_delta (OPSM is off); set loss.opsm_delta or drop it")
        if self.opsm_delta is not None and not self.opsm_delta >= 0:
            raise ValueError(f"opsm_delta must be >= 0 (None disables OPSM), got {self.opsm_delta}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")

    @classmethod
    def from_dict(cls, d: dict) -> "LossConfig":
        return cls(**strict_kwargs(cls, d, "loss", ValueError))


def grpo_advantages(rewards_B: torch.Tensor, group_ids_B, response_mask: torch.Tensor, *, norm_by_std: bool = True,
                    epsilon: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps), or without the std (Dr. GRPO), broadcast over valid tokens.

    std is the unbiased sample std (torch.std); a group of one sample gets mean 0, std 1 (verl).
    `group_ids_B`: one id per sequence (prompt index), tensor or list of hashables.
    """
    if rewards_B.dim() != 1 or rewards_B.shape[0] != response_mask.shape[0]:
        raise ValueError(f"rewards must be [B={response_mask.shape[0]}], got {tuple(rewards_B.shape)}")
    if torch.isnan(rewards_B).any():
        raise ValueError(f"reward is NaN for sample {int(torch.isnan(rewards_B).nonzero()[0])}")
    keys = group_ids_B.tolist() if torch.is_tensor(group_ids_B) else list(group_ids_B)
    if len(keys) != rewards_B.shape[0]:
        raise ValueError(f"{len(keys)} group ids for {rewards_B.shape[0]} rewards")
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    g_B = torch.tensor([index[k] for k in keys])
    r = rewards_B.detach().float()
    G = len(index)
    count = torch.zeros(G).index_add_(0, g_B, torch.ones_like(r))
    mean = torch.zeros(G).index_add_(0, g_B, r) / count
    sq = torch.zeros(G).index_add_(0, g_B, (r - mean[g_B]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.ones(G))
    mean = torch.where(count > 1, mean, torch.zeros(G))
    adv = r - mean[g_B]
    if norm_by_std:
        adv = adv / (std[g_B] + epsilon)
    return adv[:, None] * response_mask


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *,
             num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar (verl's agg_loss).

    token-mean: sum over valid tokens / num_tokens; seq-mean-token-mean: per-sequence token mean,
    then mean over non-empty sequences; seq-mean-token-sum: per-sequence token sum, then mean.
    `num_tokens` / `num_seqs` default to this batch's counts; pass the global mini-batch counts
    when a mini-batch is split into micro-batches, so the summed gradients equal the full batch's.
    """
    masked = torch.where(loss_mask.bool(), loss_mat, torch.zeros_like(loss_mat)) * loss_mask
    if loss_agg_mode == "token-mean":
        n = loss_mask.sum() if num_tokens is None else num_tokens
        return masked.sum() / n
    seq_tokens = loss_mask.sum(-1)
    seq_valid = (seq_tokens > 0).float()
    n = seq_valid.sum() if num_seqs is None else num_seqs
    if loss_agg_mode == "seq-mean-token-sum":
        return (masked.sum(-1) * seq_valid).sum() / n
    if loss_agg_mode == "seq-mean-token-mean":
        return (masked.sum(-1) / (seq_tokens + 1e-8) * seq_valid).sum() / n
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(AGG_MODES)}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate under verl's `kl_penalty` names (KL_ESTIMATORS).
    low_var_kl/k3 = exp(ref - pi) - (ref - pi) - 1 with the log ratio clamped to +-20 and the
    result to [-10, 10]. A "+" suffix returns the same value with k2's gradient."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    base = estimator.rstrip("+")
    if base in ("kl", "k1"):
        value = logprobs - ref_logprobs
    elif base == "abs":
        value = (logprobs - ref_logprobs).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logprobs - ref_logprobs).square()
    else:
        value = k3(log_ratio(ref_logprobs, logprobs)).clamp(-10, 10)
    if not estimator.endswith("+"):
        return value
    k2 = 0.5 * (logprobs - ref_logprobs).square()
    return k2 - k2.detach() + value.detach()


def ppo_clip_loss(logprobs, old_logprobs, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
                  clip_ratio_c=3.0, loss_agg_mode="token-mean", is_weights=None, num_tokens=None, num_seqs=None):
    """PPO clipped surrogate with dual clip; returns (loss, metrics).

    ratio = exp(clamp(logprobs - old, +-20)); per token max(-A r, -A clip(r, 1-lo, 1+hi)); for A < 0
    additionally capped at -A c (dual clip). Multiplied by detached `is_weights` when given.
    """
    neg_kl = log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    metrics = {"actor/pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask),
               "actor/ppo_kl": masked_mean(-neg_kl.detach(), response_mask)}
    if clip_ratio_c is not None:
        loss3 = -advantages * clip_ratio_c
        lower_hit = (clipped > loss3) & (advantages < 0)
        metrics["actor/pg_clipfrac_lower"] = masked_mean(lower_hit.float(), response_mask)
        clipped = torch.where(advantages < 0, torch.minimum(loss3, clipped), clipped)
    else:
        metrics["actor/pg_clipfrac_lower"] = 0.0
    if is_weights is not None:
        clipped = clipped * is_weights.detach()
    loss = agg_loss(clipped, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, metrics


def gspo_loss(logprobs, old_logprobs, advantages, response_mask, *, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
              loss_agg_mode="seq-mean-token-mean", is_weights=None, num_tokens=None, num_seqs=None):
    """GSPO: sequence ratio s = exp(mean_t log(pi/pi_old)) (detached) times pi/sg(pi) per token, so the
    value is the sequence ratio and the gradient flows per token; log s clamped at 10; no dual clip."""
    neg_kl = logprobs - old_logprobs
    seq_len = response_mask.sum(-1).clamp(min=1)
    seq_log_ratio = (neg_kl * response_mask).sum(-1) / seq_len
    log_s = (logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    loss1 = -advantages * s
    loss2 = -advantages * s.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    per_tok = torch.maximum(loss1, loss2)
    if is_weights is not None:
        per_tok = per_tok * is_weights.detach()
    loss = agg_loss(per_tok, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = {"actor/pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask),
               "actor/ppo_kl": masked_mean(-neg_kl.detach(), response_mask),
               "actor/pg_clipfrac_lower": 0.0}
    return loss, metrics


def dppo_loss(logprobs, old_logprobs, advantages, response_mask, *, divergence="tv", clip_ratio_low=0.2,
              clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", is_weights=None, num_tokens=None,
              num_seqs=None):
    """DPPO (verl 0.9.1 `compute_policy_loss_dppo_tv` / `_dppo_kl`): per token
    -A * sg(min(r, c)) * log pi * m, with r = exp(clamp(logprobs - old, +-20)) and a detached trust
    mask m over the probabilities p = exp(logprobs), p_old = exp(old):

    - tv: for A > 0 keep p - p_old <= high, else keep p - p_old >= -low;
    - kl: binary KL(p_old || p) = p_old log(p_old/p) + (1-p_old) log((1-p_old+1e-8)/(1-p+1e-8));
      for A > 0 keep kl <= high or p <= p_old, else keep kl <= low or p >= p_old.

    The gradient is -A sg(min(r, c)) grad log pi on kept tokens (TIS-truncated at c = clip_ratio_c,
    None: no truncation). Metrics: `actor/pg_clipfrac` = fraction of tokens the trust mask drops,
    `actor/pg_clipfrac_lower` = fraction kept with r > c, `actor/ppo_kl`."""
    neg_kl = log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(neg_kl)
    truncated = (ratio if clip_ratio_c is None else ratio.clamp(max=clip_ratio_c)).detach()
    with torch.no_grad():
        p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)
        if divergence == "tv":
            keep_pos, keep_neg = (p - p_old) <= clip_ratio_high, (p - p_old) >= -clip_ratio_low
        elif divergence == "kl":
            bkl = p_old * (old_logprobs - logprobs) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
            keep_pos, keep_neg = (bkl <= clip_ratio_high) | (p <= p_old), (bkl <= clip_ratio_low) | (p >= p_old)
        else:
            raise ValueError(f"unknown DPPO divergence {divergence!r}; valid: tv, kl")
        keep = torch.where(advantages > 0, keep_pos, keep_neg).float()
    per_tok = -advantages * truncated * logprobs * keep
    if is_weights is not None:
        per_tok = per_tok * is_weights.detach()
    loss = agg_loss(per_tok, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    over_c = torch.zeros_like(keep) if clip_ratio_c is None else (ratio.detach() > clip_ratio_c).float()
    metrics = {"actor/pg_clipfrac": masked_mean(1.0 - keep, response_mask),
               "actor/ppo_kl": masked_mean(-neg_kl.detach(), response_mask),
               "actor/pg_clipfrac_lower": masked_mean(over_c * keep, response_mask)}
    return loss, metrics


def reinforce_loss(logprobs, rollout_logprobs, advantages, response_mask, *, loss_agg_mode="token-mean",
                   is_weights=None, num_tokens=None, num_seqs=None):
    """REINFORCE -A log pi (times detached IS weights pi/mu when given): verl's bypass loss_type=reinforce."""
    per_tok = -advantages * logprobs
    if is_weights is not None:
        per_tok = per_tok * is_weights.detach()
    loss = agg_loss(per_tok, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"actor/ppo_kl": masked_mean(rollout_logprobs - logprobs.detach(), response_mask)}


def opsm_mask(logprobs, behaviour_logprobs, advantages, response_mask, delta: float):
    """DeepSeek-V3.2's off-policy sequence masking (slime's `compute_opsm_mask`): a sequence is
    dropped from the policy term on its tokens with A < 0 when its mean over valid tokens of
    log(behaviour / pi_theta) exceeds `delta`. Returns (detached 0/1 keep mask [B, T], metrics):
    `actor/opsm_masked_fraction` (valid tokens masked) and `actor/opsm_kl` (the token mean of
    log(behaviour / pi_theta))."""
    with torch.no_grad():
        lr = torch.where(response_mask.bool(), behaviour_logprobs - logprobs.detach(), torch.zeros_like(logprobs))
        seq_kl = (lr * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
        drop = (advantages < 0) & (seq_kl > delta)[:, None]
        keep = (~drop).to(logprobs.dtype)
    metrics = {"actor/opsm_masked_fraction": masked_mean(drop.float(), response_mask),
               "actor/opsm_kl": masked_mean(lr, response_mask)}
    return keep, metrics


def unbiased_kl_penalty(logprobs, old_logprobs, ref_logprobs, estimator: str) -> torch.Tensor:
    """DeepSeek-V3.2's unbiased KL(pi_theta || ref) from samples of pi_old: the per-token estimate
    times r = pi_theta/pi_old (log r clamped +-20, gradient through r as in slime's
    `--use-unbiased-kl`); for low_var_kl/k3 the product is clamped to [-10, 10] as well."""
    r = torch.exp(log_ratio(logprobs, old_logprobs.detach()))
    kl = r * kl_penalty(logprobs, ref_logprobs, estimator)
    return kl.clamp(-10, 10) if estimator.rstrip("+") in ("low_var_kl", "k3") else kl


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backward
    metrics: dict[str, torch.Tensor | float]  # detached 0-dim tensors (settings: floats)


def policy_loss(cfg: LossConfig, logprobs, old_logprobs, advantages, response_mask, *, is_weights=None,
                ref_logprobs=None, entropy=None, correction: CorrectionConfig | None = None, rollout_logprobs=None,
                num_tokens=None, num_seqs=None) -> LossOutput:
    """The actor's loss for one (micro-)batch: policy term + kl_coef * KL - entropy_coef * entropy.

    Decoupled mode (default): `old_logprobs` is pi_old and `is_weights` / `response_mask` come from
    `correct(...)` on (pi_old, mu_old). Bypass mode (`correction.bypass_mode`): pass
    `rollout_logprobs`; pi_old := mu_old, and IS/RS are recomputed here under no_grad against the
    current policy. With loss_type ppo_clip the PPO ratio pi/mu already is the IS ratio, so weights
    are only logged; with reinforce they multiply -A log pi.
    """
    metrics: dict[str, torch.Tensor | float] = {}
    if correction is not None and correction.bypass_mode:
        if rollout_logprobs is None:
            raise ValueError("bypass mode needs rollout_logprobs")
        res = correct(correction, logprobs.detach(), rollout_logprobs, response_mask, floats=False)
        metrics.update(res.metrics)
        old_logprobs, response_mask = rollout_logprobs, res.response_mask
        is_weights = res.weights if correction.loss_type == "reinforce" else None
    if cfg.opsm_delta is not None:  # multiplies the policy term only; its denominator stays
        behaviour = old_logprobs if cfg.opsm_logprobs == "old" else rollout_logprobs
        if behaviour is None:
            raise ValueError("loss.opsm_logprobs=rollout needs rollout_logprobs")
        keep, om = opsm_mask(logprobs, behaviour, advantages, response_mask, cfg.opsm_delta)
        metrics.update(om)
        is_weights = keep if is_weights is None else is_weights * keep
    if correction is not None and correction.bypass_mode and correction.loss_type == "reinforce":
        loss, pm = reinforce_loss(logprobs, rollout_logprobs, advantages, response_mask, is_weights=is_weights,
                                  loss_agg_mode=cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
        return _finish(cfg, loss, {**metrics, **pm}, logprobs, old_logprobs, ref_logprobs, entropy, response_mask,
                       num_tokens, num_seqs)
    kw = dict(loss_agg_mode=cfg.loss_agg_mode, is_weights=is_weights, num_tokens=num_tokens, num_seqs=num_seqs)
    if cfg.loss_mode != "vanilla":
        loss, pm = dppo_loss(logprobs, old_logprobs, advantages, response_mask, divergence=cfg.loss_mode[5:],
                             clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                             clip_ratio_c=cfg.clip_ratio_c, **kw)
    elif cfg.ratio_level == "sequence":
        loss, pm = gspo_loss(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low=cfg.clip_ratio_low,
                             clip_ratio_high=cfg.clip_ratio_high, **kw)
    else:
        loss, pm = ppo_clip_loss(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low=cfg.clip_ratio_low,
                                 clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c, **kw)
    return _finish(cfg, loss, {**metrics, **pm}, logprobs, old_logprobs, ref_logprobs, entropy, response_mask,
                   num_tokens, num_seqs)


def _finish(cfg, pg_loss, metrics, logprobs, old_logprobs, ref_logprobs, entropy, mask, num_tokens, num_seqs
            ) -> LossOutput:
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs)
    metrics["actor/pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl_BT = (unbiased_kl_penalty(logprobs, old_logprobs, ref_logprobs, cfg.kl_loss_type) if cfg.unbiased_kl
                 else kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type))
        kl = agg_loss(kl_BT, mask, cfg.loss_agg_mode, **agg)
        metrics["actor/kl_loss"], metrics["actor/kl_coef"] = kl.detach(), cfg.kl_coef
        loss = loss + cfg.kl_coef * kl
    if entropy is not None:
        ent = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
        metrics["actor/entropy"] = ent.detach()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    elif cfg.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    return LossOutput(loss=loss, metrics=metrics)
