"""Per-rank memory and time of the megatron actor's log-probs under TP=2 (gloo, 2 processes):
the unchunked vocabulary-parallel path (baseline: the LM head's [tokens, V/TP] logits, then
`model.token_logprobs_entropy`, what the actor ran before) against `vocab_parallel_logprobs`
chunked over tokens (logprob.py), forward + backward of log-probs and entropies.

Each variant runs in fresh processes; "peak MB" is the rise of the process's resident memory
over its level just before the call (sampled every 0.2 ms), per rank (max over the 2 ranks).
    OMP_NUM_THREADS=1 python bench/megatron_logprob_tp.py [--tokens 4096] [--vocab 32768]
        [--dim 256] [--chunk 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import threading
import time

import torch
import torch.multiprocessing as mp


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Highest resident memory while inside, minus the level on entry."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self.stop = False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.rise = self.peak - self.base


def _worker(rank: int, port: int, variant: str, args, q) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    from megatron.core import parallel_state as ps

    from lockstep.trainer.actor.megatron.logprob import vocab_parallel_logprobs
    from lockstep.trainer.actor.megatron.model import initialize_parallel, token_logprobs_entropy
    from lockstep.trainer.config.megatron import MegatronOptions
    initialize_parallel(MegatronOptions(tensor_parallel=2))
    g = torch.Generator().manual_seed(0)
    N, D, V = args.tokens, args.dim, args.vocab
    vl = V // 2
    h0 = torch.randn(N, D, generator=g)
    w0 = torch.randn(V, D, generator=g)[rank * vl:(rank + 1) * vl] * 0.05
    ids = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def run():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if variant == "unchunked":
            lp, ent = token_logprobs_entropy((h @ w.t())[None], ids[None])
        else:
            lp, ent = vocab_parallel_logprobs(h, w, ids, vocab_start=rank * vl,
                                              group=ps.get_tensor_model_parallel_group(),
                                              chunk_tokens=args.chunk)
        ((lp.reshape(-1) * g_lp).sum() + (ent.reshape(-1) * g_ent).sum()).backward()
        return lp.detach().reshape(-1), w.grad

    with _Peak() as peak:  # the first call: memory (later calls reuse freed pages)
        lp, gw = run()
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    q.put(pickle.dumps((rank, peak.rise, sorted(times)[len(times) // 2], lp, gw)))
    dist.barrier()
    dist.destroy_process_group()


def _measure(variant: str, args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, variant, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (pickle.loads(q.get(timeout=600)) for _ in procs))
    for p in procs:
        p.join()
    return (max(got[r][0] for r in got), max(got[r][1] for r in got),
            torch.cat([got[0][2][None], got[1][2][None]]), got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    res = {v: _measure(v, args) for v in ("unchunked", "chunked")}
    (pb, tb, lpb, gb), (pc, tc, lpc, gc) = res["unchunked"], res["chunked"]
    lp_diff = float((lpb - lpc).abs().max())
    gw_diff = max(float((gb[r][3] - gc[r][3]).abs().max()) for r in (0, 1))
    vl = args.vocab // 2
    print(f"TP=2, {args.tokens} tokens, vocabulary {args.vocab} ({vl} per rank), D={args.dim}, "
          f"token chunk {args.chunk}; fwd+bwd, per rank")
    print(f"  one [tokens, V/TP] fp32 logits tensor: {args.tokens * vl * 4 / 2**20:.0f} MB; "
          f"one [chunk, V/TP]: {args.chunk * vl * 4 / 2**20:.0f} MB")
    print(f"{'variant':10s} {'peak MB':>8s} {'ratio':>6s} {'time s':>7s} {'ratio':>6s}")
    for name, peak, t in (("unchunked", pb, tb), ("chunked", pc, tc)):
        print(f"{name:10s} {peak / 2**20:8.0f} {peak / pb:6.2f} {t:7.3f} {t / tb:6.2f}")
    print(f"max |log-prob diff| {lp_diff:.2e}, max |LM-head grad diff| {gw_diff:.2e}")


if __name__ == "__main__":
    main()
