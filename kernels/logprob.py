"""Log-probs and entropy of chosen tokens, computed in vocabulary chunks.

The trainer needs log pi(y_t) for every response token, and the entropy of the policy there,
but never the full distribution. Materialising `[N, V]` fp32 logits (and autograd keeping the
log-softmax for backward) costs N*V*4 bytes twice: 4k tokens x 128k vocabulary is 2 GiB each.
`chunked_logprobs` walks the vocabulary in chunks of `chunk_size` rows of the LM head, keeps a
running (max, sum-exp, sum-exp*logit) per token, and in backward recomputes each chunk's logits
to form the gradient, so peak extra memory is O(N * chunk_size), forward and backward.

Precision: whatever the dtype of `hidden_ND` / `weight_VD` (bf16, fp16, fp32), each chunk's
logits are computed as fp32 matmuls of fp32 copies (the hidden states are upcast once, each
weight chunk when it is used), and all softmax statistics are fp32. This is the "fp32 LM head"
of MiniMax-M1 / SGLang's `--enable-fp32-lm-head`. Gradients are accumulated in fp32 and returned
in the input's dtype.

Temperature: logits are divided by T before the softmax, as the sampler does, so the result is
the log-prob under the distribution that was sampled from.

Sampling-mask replay: `candidates_NS` (long `[N, S]`, padded with -1) lists, per token, the ids
the sampler kept (after top-k/top-p/min-p). The log-prob and entropy are then those of the
softmax renormalised over that set (SGLang's `sampling_logprobs_mode="selected"`). A row that is
all -1 means "no restriction" (whole vocabulary).

Shapes: N tokens, D model dim, V vocabulary, C vocabulary chunk, S max candidates per token.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_logprobs", "logprobs_from_logits", "entropy_from_logits"]


def logprobs_from_logits(logits_NV: torch.Tensor, ids_N: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Reference: fp32 log-softmax(logits / T) gathered at `ids`. Any leading shape `[..., V]`."""
    logp_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    return logp_NV.gather(-1, ids_N.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits_NV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Reference: fp32 entropy of softmax(logits / T). Any leading shape `[..., V]`."""
    logp_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    return -(logp_NV.exp() * logp_NV).sum(-1)


def _chunk_keep(candidates_NS: torch.Tensor | None, free_N: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Bool [N, hi-lo]: which vocabulary entries of this chunk are in each token's candidate set."""
    if candidates_NS is None:
        return None
    N = candidates_NS.shape[0]
    keep_NC = torch.zeros(N, hi - lo, dtype=torch.bool, device=candidates_NS.device)
    rows, cols = ((candidates_NS >= lo) & (candidates_NS < hi)).nonzero(as_tuple=True)
    keep_NC[rows, candidates_NS[rows, cols] - lo] = True
    keep_NC[free_N] = True
    return keep_NC


def _chunk_logits(h32_ND, weight_VD, lo, hi, temperature, keep_NC):
    """fp32 scaled logits of vocabulary rows [lo, hi); -inf outside the candidate set."""
    z_NC = (h32_ND @ weight_VD[lo:hi].float().t()).div_(temperature)
    if keep_NC is not None:
        z_NC.masked_fill_(~keep_NC, float("-inf"))
    return z_NC


class _ChunkedLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, ids_N, candidates_NS, free_N, temperature, chunk_size):
        N, V = hidden_ND.shape[0], weight_VD.shape[0]
        h32_ND = hidden_ND.float()
        neg_inf = torch.full((N,), float("-inf"), device=hidden_ND.device)
        m_N = neg_inf.clone()  # running max of z
        s_N = torch.zeros(N, device=hidden_ND.device)  # running sum exp(z - m)
        t_N = torch.zeros(N, device=hidden_ND.device)  # running sum exp(z - m) * z
        chosen_N = torch.zeros(N, device=hidden_ND.device)  # z at the chosen id
        for lo in range(0, V, chunk_size):
            hi = min(lo + chunk_size, V)
            keep_NC = _chunk_keep(candidates_NS, free_N, lo, hi)
            z_NC = _chunk_logits(h32_ND, weight_VD, lo, hi, temperature, keep_NC)
            m_new = torch.maximum(m_N, z_NC.max(-1).values)
            # rows with nothing seen yet keep m = -inf; shift by 0 there to avoid inf - inf
            safe_m = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            scale_N = torch.exp(m_N - safe_m)
            idx = ((ids_N >= lo) & (ids_N < hi)).nonzero(as_tuple=True)[0]
            chosen_N[idx] = z_NC[idx, ids_N[idx] - lo]
            # in-place ops keep at most two [N, C] buffers alive
            e_NC = (z_NC - safe_m[:, None]).exp_()
            s_N = s_N * scale_N + e_NC.sum(-1)
            # masked entries: e = 0 and z = -inf, and 0 * -inf is NaN, so zero z there first
            t_N = t_N * scale_N + e_NC.mul_(torch.nan_to_num_(z_NC, neginf=0.0)).sum(-1)
            m_N = m_new
            del z_NC, e_NC
        lse_N = m_N + torch.log(s_N)
        logprob_N = chosen_N - lse_N
        entropy_N = lse_N - t_N / s_N
        ctx.save_for_backward(hidden_ND, weight_VD, ids_N, candidates_NS, free_N, lse_N, entropy_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logprob_N, entropy_N

    @staticmethod
    def backward(ctx, g_lp_N, g_ent_N):
        hidden_ND, weight_VD, ids_N, candidates_NS, free_N, lse_N, entropy_N = ctx.saved_tensors
        T, chunk_size = ctx.temperature, ctx.chunk_size
        N, V = hidden_ND.shape[0], weight_VD.shape[0]
        g_lp_N = torch.zeros(N, device=hidden_ND.device) if g_lp_N is None else g_lp_N.float()
        g_ent_N = torch.zeros(N, device=hidden_ND.device) if g_ent_N is None else g_ent_N.float()
        h32_ND = hidden_ND.float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h32_ND = torch.zeros_like(h32_ND) if need_h else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=weight_VD.dtype, device=weight_VD.device) if need_w else None
        for lo in range(0, V, chunk_size):
            hi = min(lo + chunk_size, V)
            keep_NC = _chunk_keep(candidates_NS, free_N, lo, hi)
            z_NC = _chunk_logits(h32_ND, weight_VD, lo, hi, T, keep_NC)
            logp_NC = z_NC.sub_(lse_N[:, None])  # in place: z is not needed again
            p_NC = torch.exp(logp_NC)  # 0 outside the candidate set
            # d logprob / dz_j = 1[j=y] - p_j ;  d entropy / dz_j = -p_j (log p_j + H)
            coef_NC = torch.nan_to_num_(logp_NC, neginf=0.0).add_(entropy_N[:, None])
            coef_NC.mul_(g_ent_N[:, None]).add_(g_lp_N[:, None])
            g_NC = p_NC.mul_(coef_NC).neg_()
            del coef_NC, logp_NC, z_NC
            idx = ((ids_N >= lo) & (ids_N < hi)).nonzero(as_tuple=True)[0]
            g_NC[idx, ids_N[idx] - lo] += g_lp_N[idx]
            g_NC.div_(T)  # z = logits / T
            if need_h:
                grad_h32_ND.addmm_(g_NC, weight_VD[lo:hi].float())
            if need_w:
                grad_w_VD[lo:hi] = (g_NC.t() @ h32_ND).to(weight_VD.dtype)
            del g_NC, p_NC
        grad_h = grad_h32_ND.to(hidden_ND.dtype) if need_h else None
        return grad_h, grad_w_VD, None, None, None, None, None


def chunked_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    ids_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    candidates_NS: torch.Tensor | None = None,
    chunk_size: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `ids` and entropy under softmax((hidden @ weight.T) / temperature), in fp32.

    hidden_ND: [..., D] final-normed hidden states (any float dtype); weight_VD: [V, D] LM head;
    ids_N: long [...] chosen token ids; candidates_NS: optional long [..., S] kept ids padded
    with -1 (all -1 = whole vocabulary). Returns (logprobs, entropy), fp32, shape of `ids`.
    Differentiable w.r.t. hidden and weight; never holds more than [N, chunk_size] logits.
    """
    if hidden_ND.shape[:-1] != ids_N.shape:
        raise ValueError(f"hidden {tuple(hidden_ND.shape)} and ids {tuple(ids_N.shape)}: leading shapes differ")
    if weight_VD.dim() != 2 or weight_VD.shape[1] != hidden_ND.shape[-1]:
        raise ValueError(f"weight must be [V, D={hidden_ND.shape[-1]}], got {tuple(weight_VD.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = ids_N.shape
    V = weight_VD.shape[0]
    h_ND = hidden_ND.reshape(-1, hidden_ND.shape[-1])
    ids = ids_N.reshape(-1).long()
    bad = ((ids < 0) | (ids >= V)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"token id {int(ids[i])} at flat position {i} is outside the vocabulary [0, {V})")
    cand, free = None, None
    if candidates_NS is not None:
        if candidates_NS.shape[:-1] != lead:
            raise ValueError(f"candidates {tuple(candidates_NS.shape)} must be [*{tuple(lead)}, S]")
        cand = candidates_NS.reshape(ids.shape[0], -1).long()
        bad = ((cand < -1) | (cand >= V)).nonzero()
        if bad.numel():
            r, c = (int(x) for x in bad[0])
            raise ValueError(f"candidate id {int(cand[r, c])} at flat position {r} is outside [0, {V}) (pad with -1)")
        free = (cand < 0).all(-1)
        has_chosen = (cand == ids[:, None]).any(-1) | free
        missing = (~has_chosen).nonzero()
        if missing.numel():
            r = int(missing[0])
            raise ValueError(f"chosen id {int(ids[r])} at flat position {r} is not in its candidate set")
    lp, ent = _ChunkedLogProb.apply(h_ND, weight_VD, ids, cand, free, float(temperature), int(chunk_size))
    return lp.reshape(lead), ent.reshape(lead)
