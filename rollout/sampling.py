"""Batched next-token sampling with per-row parameters, log-probs and a record of the support.

Shapes: B rows (one per running sequence), V vocabulary, C uniforms buffered per row.

Which distribution (the contract with the trainer):
- `logprobs_B` = log softmax(logits / temperature)[sampled id] over the FULL vocabulary
  (temperature 1 for greedy rows). This is what the trainer recomputes by default.
- `sampling_logprobs_B` = log(p[sampled] / sum of p over the kept support), i.e. the log-prob
  under the truncated, renormalised distribution the token was actually drawn from (SGLang's
  `sampling_logprobs_mode="selected"`). A trainer that recomputes over the same support (see
  `support_logprobs`) gets an IS ratio of exactly 1 for unchanged weights; comparing it with the
  full-vocabulary log-prob instead would give p_kept_mass (e.g. 0.3 / 0.375 = 0.8), a bias.

How top-k, top-p and min-p compose: all three are computed on the same temperature-scaled
full distribution p (sorted descending) and intersected, as SGLang's torch sampler does:
  top-k keeps the k most likely tokens; top-p keeps a token when the mass strictly before it
  in sorted order is <= top_p (so at least one token, and the token that crosses top_p is kept);
  min-p keeps tokens with p >= min_p * max(p).
Each keeps a prefix of the sorted order, so the support is the shortest of the three prefixes;
top-p is NOT re-applied to a renormalised top-k distribution (HF's order), so `top_k=5,
top_p=0.9` keeps the first min(5, n_p) tokens where n_p is measured on the full distribution.
Ties: a token whose probability equals the last kept one is kept too (the support is
{i : p_i >= threshold}), so the support never depends on sort order.

Randomness is inverse-CDF sampling with one uniform per row per step in vocabulary order, so a
row's draw depends only on its own logits and its own uniform: results do not depend on which
other requests share the batch. `RowUniforms` supplies per-request seeded uniforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import exact as exact_kernels
from .types import GREEDY_TEMPERATURE


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors (built once when the batch changes)."""

    temperature_B: torch.Tensor   # fp32; greedy rows hold 1.0
    greedy_B: torch.Tensor        # bool
    top_k_B: torch.Tensor         # long; V for "whole vocabulary"
    top_p_B: torch.Tensor         # fp32
    min_p_B: torch.Tensor         # fp32
    any_truncation: bool          # False -> the sort is skipped entirely
    any_greedy: bool

    @classmethod
    def build(cls, temperature: list[float], top_k: list[int], top_p: list[float],
              min_p: list[float], vocab_size: int,
              device: str | torch.device = "cpu") -> "SamplingTensors":
        """From per-row Python lists (host work once per batch change), on `device`."""
        greedy = [t < GREEDY_TEMPERATURE for t in temperature]
        k = [vocab_size if (kk == -1 or kk >= vocab_size) else kk for kk in top_k]
        any_trunc = any(kk < vocab_size for kk in k) or any(p < 1.0 for p in top_p) \
            or any(m > 0.0 for m in min_p)
        return cls(
            temperature_B=torch.tensor([1.0 if g else t for t, g in zip(temperature, greedy)],
                                       dtype=torch.float32, device=device),
            greedy_B=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k_B=torch.tensor(k, dtype=torch.long, device=device),
            top_p_B=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p_B=torch.tensor(min_p, dtype=torch.float32, device=device),
            any_truncation=any_trunc,
            any_greedy=any(greedy),
        )


@dataclass
class SampleOutput:
    token_ids_B: torch.Tensor         # long
    logprobs_B: torch.Tensor          # fp32, full-vocabulary log-prob after temperature
    sampling_logprobs_B: torch.Tensor  # fp32, log-prob under the truncated renormalised support
    support_BV: torch.Tensor | None   # bool kept candidates; None when no row truncates
    logprobs_BV: torch.Tensor         # fp32 full log-softmax after temperature (for top-logprobs)


def support_mask(probs_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Kept candidates [B, V] (bool) of the top-k / top-p / min-p filters (see module doc)."""
    B, V = probs_BV.shape
    sorted_BV, _ = torch.sort(probs_BV, dim=-1, descending=True, stable=True)
    before_BV = torch.cumsum(sorted_BV, dim=-1) - sorted_BV       # mass strictly before
    n_p_B = (before_BV <= st.top_p_B[:, None]).sum(-1)             # >= 1 (first is 0)
    # top_p = 1 keeps everything even where the fp32 cumsum rounds above 1.
    n_p_B = torch.where(st.top_p_B >= 1.0, V, n_p_B)
    n_min_B = (sorted_BV >= (st.min_p_B * sorted_BV[:, 0])[:, None]).sum(-1)  # >= 1
    n_B = torch.minimum(torch.minimum(st.top_k_B, n_p_B), n_min_B).clamp_(min=1)
    n_B = torch.where(st.greedy_B, torch.ones_like(n_B), n_B)
    thresh_B = sorted_BV.gather(1, (n_B - 1)[:, None])             # [B, 1]
    return probs_BV >= thresh_B


def sample(logits_BV: torch.Tensor, st: SamplingTensors, uniform_B: torch.Tensor,
           banned_BV: torch.Tensor | None = None, exact: bool = False) -> SampleOutput:
    """Draw one token per row. `uniform_B` in [0, 1) is the row's random number for this step.

    `banned_BV` (bool) removes ids from the support before the filters run (the distribution
    is renormalised without them, as SGLang's min_new_tokens penalty does); `logprobs_B` is
    still the full-vocabulary log-prob, `sampling_logprobs_B` the one over the support.
    Greedy rows take the first argmax (no randomness). Logits are promoted to fp32.
    `exact`: the log-softmax is kernels/exact.py's, the bits an exact actor recomputes.
    """
    logits_BV = logits_BV.float()
    log_softmax = exact_kernels.log_softmax if exact else \
        (lambda z: torch.log_softmax(z, dim=-1))
    logp_BV = log_softmax(logits_BV / st.temperature_B[:, None])
    samp_logp_BV = logp_BV if banned_BV is None else \
        log_softmax(logp_BV.masked_fill(banned_BV, float("-inf")))
    probs_BV = samp_logp_BV.exp()
    if st.any_truncation or st.any_greedy or banned_BV is not None:
        keep_BV = support_mask(probs_BV, st)
        if banned_BV is not None:
            keep_BV &= ~banned_BV
        if st.any_greedy:
            # Greedy support is exactly the first argmax, even under ties.
            first_BV = torch.zeros_like(keep_BV).scatter_(
                1, samp_logp_BV.argmax(-1, keepdim=True), True)
            keep_BV = torch.where(st.greedy_B[:, None], first_BV, keep_BV)
        weights_BV = probs_BV * keep_BV
    else:
        keep_BV = None
        weights_BV = probs_BV
    cdf_BV = torch.cumsum(weights_BV, dim=-1)
    total_B = cdf_BV[:, -1]
    target_B1 = (uniform_B.to(cdf_BV.dtype) * total_B)[:, None]
    ids_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(1)
    ids_B = ids_B.clamp_(max=logits_BV.shape[1] - 1)
    # Rounding can put the target past the last positive weight: fall back to the row's argmax
    # (rare; computed for every row anyway, since asking whether it happened would wait for
    # the device).
    zero_B = weights_BV.gather(1, ids_B[:, None]).squeeze(1) <= 0
    ids_B = torch.where(zero_B, weights_BV.argmax(-1), ids_B)
    lp_B = logp_BV.gather(1, ids_B[:, None]).squeeze(1)
    if keep_BV is None:
        sel_B = lp_B
    else:
        sel_B = lp_B - torch.logsumexp(logp_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    return SampleOutput(ids_B, lp_B, sel_B, keep_BV, logp_BV)


def support_logprobs(logits_TV: torch.Tensor, token_ids_T: torch.Tensor,
                     support_TV: torch.Tensor | None, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of `token_ids_T` renormalised over the recorded support (trainer-side replay).

    Same definition as `sampling_logprobs_B`; a row whose support is all True (or support None)
    is the plain full-vocabulary log-prob. Differentiable in `logits_TV`.
    """
    logp_TV = torch.log_softmax(logits_TV.float() / temperature, dim=-1)
    lp_T = logp_TV.gather(1, token_ids_T[:, None].long()).squeeze(1)
    if support_TV is None:
        return lp_T
    return lp_T - torch.logsumexp(logp_TV.masked_fill(~support_TV, float("-inf")), dim=-1)


def support_ids_to_mask(support: list[torch.Tensor | list[int] | None], vocab_size: int
                        ) -> torch.Tensor:
    """Per-position kept id lists (None = whole vocabulary) -> bool mask [T, V]."""
    mask_TV = torch.zeros(len(support), vocab_size, dtype=torch.bool)
    for t, ids in enumerate(support):
        if ids is None:
            mask_TV[t] = True
            continue
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        if ids_t.numel() == 0 or int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab_size:
            raise ValueError(f"support at position {t} is empty or has ids outside "
                             f"[0, {vocab_size}): {ids_t.tolist()[:8]}...")
        mask_TV[t, ids_t] = True
    return mask_TV


class RowUniforms:
    """Per-slot uniforms from per-request `torch.Generator`s, drawn C at a time.

    A request's stream depends only on its seed, so a seeded request reproduces its tokens
    whatever else is in the batch. Refills happen once per C steps per row. The generators
    are CPU generators on every device (the same seed gives the same stream on CPU and GPU);
    the buffer and pointers live on `device`, and a refill copies C uniforms there.
    """

    def __init__(self, num_slots: int, chunk: int = 64, device: str | torch.device = "cpu"
                 ) -> None:
        self.chunk = chunk
        self.device = torch.device(device)
        self.buf_SC = torch.zeros(num_slots, chunk, dtype=torch.float64, device=self.device)
        self.ptr_S = torch.full((num_slots,), chunk, dtype=torch.long,
                                device=self.device)  # == chunk -> refill
        self.gens: list[torch.Generator | None] = [None] * num_slots

    def assign(self, slot: int, seed: int) -> None:
        g = torch.Generator(device="cpu")
        g.manual_seed(seed % (1 << 63))
        self.gens[slot] = g
        self._refill(slot)

    def _refill(self, slot: int) -> None:
        g = self.gens[slot]
        if g is None:
            raise RuntimeError(f"slot {slot} has no generator assigned")
        self.buf_SC[slot] = torch.rand(self.chunk, generator=g, dtype=torch.float64,
                                       device="cpu").to(self.device)
        self.ptr_S[slot] = 0

    def next(self, slots_B: torch.Tensor) -> torch.Tensor:
        """One uniform per listed slot (advancing each slot's stream by one)."""
        ptr_B = self.ptr_S[slots_B]
        if bool((ptr_B >= self.chunk).any()):
            for s in slots_B[ptr_B >= self.chunk].tolist():
                self._refill(s)
            ptr_B = self.ptr_S[slots_B]
        u_B = self.buf_SC[slots_B, ptr_B]
        self.ptr_S[slots_B] = ptr_B + 1
        return u_B
