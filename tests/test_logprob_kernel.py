"""Chunked log-prob/entropy kernel vs the naive full log-softmax (values and gradients)."""

import pytest
import torch

from lockstep.kernels.logprob import chunked_logprobs, entropy_from_logits, logprobs_from_logits


def _inputs(N=37, D=16, V=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (N,), generator=g)
    return h, w, ids


def _naive(h, w, ids, T=1.0, keep_NV=None):
    z = (h.float() @ w.float().t()) / T
    if keep_NV is not None:
        z = z.masked_fill(~keep_NV, float("-inf"))
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, ids[:, None]).squeeze(-1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return lp, ent


def _grads(fn, h, w):
    g = torch.Generator().manual_seed(1)
    lp, ent = fn()
    a, b = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    gh, gw = torch.autograd.grad((lp * a).sum() + (ent * b).sum(), [h, w])
    return lp, ent, gh, gw


@pytest.mark.parametrize("chunk", [1, 7, 50, 101, 4096])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_matches_full_logsoftmax_values_and_grads(chunk, T):
    h, w, ids = _inputs()
    lp, ent, gh, gw = _grads(lambda: chunked_logprobs(h, w, ids, temperature=T, chunk_size=chunk), h, w)
    lp0, ent0, gh0, gw0 = _grads(lambda: _naive(h, w, ids, T), h, w)
    for a, b in [(lp, lp0), (ent, ent0)]:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # a gradient sums the rows' (or chunks') terms in another order: within 1e-5 of the
    # largest entry (an entry near 0 can be a sum of terms ~10x larger: measured 1.3e-5 off)
    for a, b in [(gh, gh0), (gw, gw0)]:
        torch.testing.assert_close(a, b, atol=1e-5 * max(1.0, float(b.abs().max())), rtol=1e-5)


def test_reference_helpers_match_naive():
    h, w, ids = _inputs()
    logits = h @ w.t()
    lp0, ent0 = _naive(h, w, ids, 0.5)
    torch.testing.assert_close(logprobs_from_logits(logits, ids, 0.5), lp0)
    torch.testing.assert_close(entropy_from_logits(logits, 0.5), ent0)
    # hand check on a 2-token vocabulary: logits (0, ln 3) -> p = (1/4, 3/4)
    two = torch.tensor([[0.0, torch.log(torch.tensor(3.0))]])
    assert logprobs_from_logits(two, torch.tensor([0])).item() == pytest.approx(-torch.log(torch.tensor(4.0)).item())
    assert entropy_from_logits(two).item() == pytest.approx(-(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75))).item())


def test_candidate_mask_renormalises_over_kept_set():
    h, w, ids = _inputs(N=6, V=30)
    S = 5
    g = torch.Generator().manual_seed(3)
    cand = torch.full((6, S), -1)
    keep = torch.zeros(6, 30, dtype=torch.bool)
    for r in range(6):
        k = 1 + r % S if r != 2 else 0  # row 2: all -1 = unrestricted
        if k == 0:
            keep[r] = True
            continue
        others = torch.randperm(30, generator=g)[:k]
        others[0] = ids[r]
        cand[r, :k] = others
        keep[r, others] = True
    lp, ent, gh, gw = _grads(lambda: chunked_logprobs(h, w, ids, candidates_NS=cand, chunk_size=8, temperature=0.9), h, w)
    lp0, ent0, gh0, gw0 = _grads(lambda: _naive(h, w, ids, 0.9, keep), h, w)
    for a, b in [(lp, lp0), (ent, ent0), (gh, gh0), (gw, gw0)]:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert lp[0].item() == 0.0 and ent[0].item() == 0.0  # one candidate: probability 1


def test_bf16_inputs_compute_in_fp32_and_return_grads_in_input_dtype():
    h, w, ids = _inputs(dtype=torch.bfloat16)
    lp, ent, gh, gw = _grads(lambda: chunked_logprobs(h, w, ids, chunk_size=16), h, w)
    assert lp.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    lp0, ent0, gh0, gw0 = _grads(lambda: _naive(h, w, ids), h, w)  # fp32 math on the bf16 values
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh.float(), gh0.float(), atol=1e-2, rtol=1e-2)


def test_batched_leading_shape_and_errors():
    h, w, ids = _inputs(N=12)
    lp, ent = chunked_logprobs(h.view(3, 4, -1), w, ids.view(3, 4), chunk_size=10)
    lp0, _ = _naive(h, w, ids)
    torch.testing.assert_close(lp, lp0.view(3, 4), atol=1e-5, rtol=1e-5)
    bad = ids.clone()
    bad[5] = 101
    with pytest.raises(ValueError, match="token id 101 at flat position 5"):
        chunked_logprobs(h, w, bad)
    cand = torch.full((12, 2), -1)
    cand[4] = torch.tensor([(int(ids[4]) + 1) % 101, -1])
    with pytest.raises(ValueError, match="flat position 4 is not in its candidate set"):
        chunked_logprobs(h, w, ids, candidates_NS=cand)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(h, w, ids, temperature=0.0)
