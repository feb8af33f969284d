"""The vocabulary-parallel, token-chunked log-prob kernel (trainer/actor/megatron/logprob.py) on a gloo
world of 2 (TP = 2, each rank holds half the LM head): log-probs, entropies and gradients
(hidden states summed over ranks, each rank's LM-head shard) equal the unchunked full-vocabulary
computation, with a temperature and candidate sets (some whose ids live on one rank only);
and a chunk's logits are [chunk, V/TP], never [tokens, V/TP].

Shapes: N tokens, D model dim, V vocabulary, S candidates.
"""

import pickle
import socket

import pytest
import torch
import torch.multiprocessing as mp

N, D, V, S, TEMP = 23, 8, 12, 3, 0.7


def _data():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g, dtype=torch.float64).float()
    w = torch.randn(V, D, generator=g).mul(2)
    ids = torch.randint(0, V, (N,), generator=g)
    cand = torch.full((N, S), -1)
    for i in range(0, N, 2):  # every other token restricted: its id + ids from one half
        lo = 0 if i % 4 else V // 2
        cand[i] = torch.tensor([int(ids[i]), lo + 1, lo + 3])
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return h, w, ids, cand, g_lp, g_ent


def _reference(h, w, ids, cand, g_lp, g_ent):
    """The unchunked path: full [N, V] logits, masked softmax, autograd."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    z = (h @ w.t()) / TEMP
    keep = torch.zeros(N, V, dtype=torch.bool)
    keep.scatter_(-1, cand.clamp(min=0), True)
    keep |= (cand < 0).all(-1, keepdim=True)
    logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    lp = logp.gather(-1, ids[:, None])[:, 0]
    ent = -(logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(-1)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from lockstep.trainer.actor.megatron import logprob
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    h, w, ids, cand, g_lp, g_ent = _data()
    vl = V // 2
    shapes = []
    real = logprob._local_logits

    def spy(*a):
        z = real(*a)
        shapes.append(tuple(z.shape))
        return z
    logprob._local_logits = spy
    out = {}
    for chunk in (1, 5, N):
        hh = h.clone().requires_grad_()
        ww = w[rank * vl:(rank + 1) * vl].clone().requires_grad_()
        lp, ent = logprob.vocab_parallel_logprobs(
            hh, ww, ids, vocab_start=rank * vl, group=dist.group.WORLD, temperature=TEMP,
            candidates_NS=cand, chunk_tokens=chunk)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        gh = hh.grad.clone()
        dist.all_reduce(gh)  # the TP mapping before the kernel sums the hidden-state grads
        out[chunk] = (lp.detach(), ent.detach(), gh, ww.grad.clone(), list(shapes))
        shapes.clear()
    # as bytes: a tensor put on the queue as is shares its storage by a file descriptor that
    # is gone once this process exits
    q.put(pickle.dumps((rank, out)))
    dist.barrier()
    dist.destroy_process_group()


def test_tp2_chunked_logprobs_and_grads_equal_unchunked():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(pickle.loads(q.get(timeout=120)) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    h, w, ids, cand, g_lp, g_ent = _data()
    lp, ent, gh, gw = _reference(h, w, ids, cand, g_lp, g_ent)
    vl = V // 2
    for rank in (0, 1):
        for chunk, (lp_r, ent_r, gh_r, gw_r, shapes) in got[rank].items():
            torch.testing.assert_close(lp_r, lp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent_r, ent, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gh_r, gh, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gw_r, gw[rank * vl:(rank + 1) * vl], rtol=1e-5, atol=1e-5)
            # forward and backward: one [<= chunk, V/TP] block of logits at a time
            assert max(s[0] for s in shapes) == min(chunk, N) and {s[1] for s in shapes} == {vl}
            assert len(shapes) == 2 * -(-N // chunk)


def test_bad_input_is_named():
    from lockstep.trainer.actor.megatron.logprob import vocab_parallel_logprobs
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2).long(),
                                vocab_start=0, chunk_tokens=0)
    with pytest.raises(ValueError, match="leading shapes"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(3).long(),
                                vocab_start=0)
