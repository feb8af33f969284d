"""Log-probs and entropy of chosen tokens from a vocabulary-parallel LM head, chunked over tokens.

Under tensor parallelism each rank holds rows [start, start + V/TP) of the LM head. Building the
local logits of every token at once costs tokens x V/TP x 4 bytes per rank (and autograd keeps
them for backward). `vocab_parallel_logprobs` walks the tokens in chunks of `chunk_tokens`: per
chunk it forms the local logits [c, V/TP], all-reduces the max over the TP group, then the
sum-exp, the sum-exp * logit (entropy) and the target's logit (non-zero only on the rank that
owns the target id) in one all-reduce. Backward recomputes each chunk's local logits; the
gradients it returns are local (the LM-head shard's gradient is complete; the hidden states'
gradient is this rank's vocabulary share, which the caller's TP mapping sums, as megatron-core's
output layer does). Peak extra memory: O(chunk_tokens x V/TP), forward and backward.

Semantics equal `lockstep.kernels.logprob.chunked_logprobs` (TP = 1) and
`model.token_logprobs_entropy` (unchunked, vocab-parallel): fp32 statistics, logits divided by
`temperature`, optional candidate sets (long [N, S], -1 padded, all -1 = whole vocabulary).

Shapes: N tokens, D model dim, V full vocabulary, Vl = V/TP local rows, c token chunk,
S candidates per token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local_logits(h32_cD, weight_VlD, temperature, keep_cV):
    """fp32 scaled local logits of one token chunk; -inf outside the candidate set."""
    z_cV = (h32_cD @ weight_VlD.float().t()).div_(temperature)
    if keep_cV is not None:
        z_cV.masked_fill_(~keep_cV, float("-inf"))
    return z_cV


def _keep(cand_cS, free_c, start, v_local):
    """Bool [c, Vl]: which local ids are in each token's candidate set (None = all)."""
    if cand_cS is None:
        return None
    local_cS = cand_cS - start
    here_cS = (cand_cS >= 0) & (local_cS >= 0) & (local_cS < v_local)
    keep_cV = torch.zeros(cand_cS.shape[0], v_local + 1, dtype=torch.bool,
                          device=cand_cS.device)  # the extra column takes misses
    keep_cV.scatter_(-1, torch.where(here_cS, local_cS, v_local), True)
    keep_cV = keep_cV[:, :v_local]
    keep_cV[free_c] = True
    return keep_cV


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VlD, ids_N, cand_NS, free_N, start, group, temperature,
                chunk):
        N, Vl = hidden_ND.shape[0], weight_VlD.shape[0]
        dev = hidden_ND.device
        lse_N = torch.empty(N, device=dev)
        ent_N = torch.empty(N, device=dev)
        lp_N = torch.empty(N, device=dev)
        for lo in range(0, N, chunk):
            hi = min(lo + chunk, N)
            keep = _keep(None if cand_NS is None else cand_NS[lo:hi],
                         None if free_N is None else free_N[lo:hi], start, Vl)
            z_cV = _local_logits(hidden_ND[lo:hi].float(), weight_VlD, temperature, keep)
            m_c = z_cV.max(-1).values
            if group is not None:
                dist.all_reduce(m_c, op=dist.ReduceOp.MAX, group=group)
            local_c = ids_N[lo:hi] - start
            here_c = (local_c >= 0) & (local_c < Vl)
            z_t = z_cV.gather(-1, local_c.clamp(0, Vl - 1)[:, None])[:, 0]
            e_cV = (z_cV - m_c[:, None]).exp_()  # 0 outside the candidate set
            sums_3c = torch.stack([e_cV.sum(-1),
                                   e_cV.mul_(torch.nan_to_num_(z_cV, neginf=0.0)).sum(-1),
                                   torch.where(here_c, z_t, torch.zeros_like(z_t))])
            del z_cV, e_cV
            if group is not None:
                dist.all_reduce(sums_3c, group=group)
            s_c, t_c, zt_c = sums_3c.unbind(0)
            lse = m_c + s_c.log()
            lse_N[lo:hi] = lse
            lp_N[lo:hi] = zt_c - lse
            ent_N[lo:hi] = lse - t_c / s_c
        ctx.save_for_backward(hidden_ND, weight_VlD, ids_N, cand_NS, free_N, lse_N, ent_N)
        ctx.start, ctx.temperature, ctx.chunk = start, temperature, chunk
        return lp_N, ent_N

    @staticmethod
    def backward(ctx, g_lp_N, g_ent_N):
        hidden_ND, weight_VlD, ids_N, cand_NS, free_N, lse_N, ent_N = ctx.saved_tensors
        start, temp, chunk = ctx.start, ctx.temperature, ctx.chunk
        N, Vl = hidden_ND.shape[0], weight_VlD.shape[0]
        dev = hidden_ND.device
        g_lp_N = torch.zeros(N, device=dev) if g_lp_N is None else g_lp_N.float()
        g_ent_N = torch.zeros(N, device=dev) if g_ent_N is None else g_ent_N.float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden_ND.shape, device=dev) if need_h else None
        grad_w = torch.zeros(weight_VlD.shape, device=dev) if need_w else None
        w32 = weight_VlD.float()
        for lo in range(0, N, chunk):
            hi = min(lo + chunk, N)
            keep = _keep(None if cand_NS is None else cand_NS[lo:hi],
                         None if free_N is None else free_N[lo:hi], start, Vl)
            h32_cD = hidden_ND[lo:hi].float()
            logp_cV = _local_logits(h32_cD, weight_VlD, temp, keep).sub_(lse_N[lo:hi, None])
            p_cV = logp_cV.exp()  # 0 outside the candidate set
            # d logprob / dz_j = 1[j=y] - p_j ;  d entropy / dz_j = -p_j (log p_j + H)
            coef = torch.nan_to_num_(logp_cV, neginf=0.0).add_(ent_N[lo:hi, None])
            coef.mul_(g_ent_N[lo:hi, None]).add_(g_lp_N[lo:hi, None])
            g_cV = p_cV.mul_(coef).neg_()
            del coef, logp_cV
            local_c = ids_N[lo:hi] - start
            here = ((local_c >= 0) & (local_c < Vl)).nonzero(as_tuple=True)[0]
            g_cV[here, local_c[here]] += g_lp_N[lo:hi][here]
            g_cV.div_(temp)  # z = logits / T
            if need_h:
                grad_h[lo:hi] = g_cV @ w32
            if need_w:
                grad_w.addmm_(g_cV.t(), h32_cD)
            del g_cV, p_cV
        return (None if grad_h is None else grad_h.to(hidden_ND.dtype),
                None if grad_w is None else grad_w.to(weight_VlD.dtype),
                None, None, None, None, None, None, None)


def vocab_parallel_logprobs(hidden_ND: torch.Tensor, weight_VlD: torch.Tensor,
                            ids_N: torch.Tensor, *, vocab_start: int, group=None,
                            temperature: float = 1.0,
                            candidates_NS: torch.Tensor | None = None,
                            chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(ids), entropy), fp32, shape of `ids`, under softmax((hidden @ W.T) / temperature)
    where this rank holds W's rows [vocab_start, vocab_start + Vl) as `weight_VlD` and the other
    ranks of `group` (None: a world of one, no collectives) hold the rest.

    hidden_ND [..., D] must be the same on every rank of `group` (the full sequence);
    ids_N long [...] full-vocabulary ids; candidates_NS [..., S] full-vocabulary kept ids.
    A collective: every rank of `group` calls it with the same token count and chunk."""
    if hidden_ND.shape[:-1] != ids_N.shape:
        raise ValueError(f"hidden {tuple(hidden_ND.shape)} and ids {tuple(ids_N.shape)}: "
                         "leading shapes differ")
    if weight_VlD.dim() != 2 or weight_VlD.shape[1] != hidden_ND.shape[-1]:
        raise ValueError(f"weight must be [V/TP, D={hidden_ND.shape[-1]}], got "
                         f"{tuple(weight_VlD.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    lead = ids_N.shape
    h_ND = hidden_ND.reshape(-1, hidden_ND.shape[-1])
    ids = ids_N.reshape(-1).long()
    cand = free = None
    if candidates_NS is not None:
        if candidates_NS.shape[:-1] != lead:
            raise ValueError(f"candidates {tuple(candidates_NS.shape)} must be [*{tuple(lead)}, S]")
        cand = candidates_NS.reshape(ids.shape[0], -1).long()
        free = (cand < 0).all(-1)
    lp, ent = _VocabParallelLogProb.apply(h_ND, weight_VlD, ids, cand, free, int(vocab_start),
                                          group, float(temperature), int(chunk_tokens))
    return lp.reshape(lead), ent.reshape(lead)
