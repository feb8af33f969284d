"""Peak host memory of chunked vs full log-prob (forward + backward) on a large vocabulary.

Each variant runs in its own subprocess; peak = ru_maxrss after fwd+bwd minus ru_maxrss once the
inputs exist, so the ratio compares only what the log-prob computation adds. "full" is the
naive path: fp32 logits [N, V] -> log_softmax -> gather (+ entropy), autograd keeps the
intermediates. "chunked" is `lockstep.kernels.logprob.chunked_logprobs`. Prints medians over
repeats and the chunked/full ratio (target <= 0.25).

The default size needs ~10 GiB free for the full variant (measured on the 2-core dev host:
full 10122 MiB, chunked 282 MiB, ratio 0.028; fwd+bwd 161 s vs 104 s). Shrink it on a shared box.

    OMP_NUM_THREADS=1 python bench/logprob_memory.py                  # N=4096, V=131072, D=256
    python bench/logprob_memory.py --tokens 1024 --vocab 32768 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _child(variant: str, N: int, V: int, D: int, chunk: int) -> None:
    import torch

    from lockstep.kernels.logprob import chunked_logprobs

    torch.manual_seed(0)
    h = torch.randn(N, D, requires_grad=True)
    w = (torch.randn(V, D) * 0.02).requires_grad_()
    ids = torch.randint(0, V, (N,))
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if variant == "full":
        logp = torch.log_softmax(h @ w.t(), dim=-1)
        lp = logp.gather(-1, ids[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    else:
        lp, ent = chunked_logprobs(h, w, ids, chunk_size=chunk)
    (lp.sum() + 0.01 * ent.sum()).backward()
    dt = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"added_mib": (peak_kib - base_kib) / 1024, "seconds": dt,
                      "checksum": float(h.grad.abs().sum())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--child", choices=["full", "chunked"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a.child, a.tokens, a.vocab, a.dim, a.chunk)
    res: dict[str, list[dict]] = {"full": [], "chunked": []}
    for _ in range(a.repeats):
        for variant in ("chunked", "full"):
            cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(a.tokens), "--vocab",
                   str(a.vocab), "--dim", str(a.dim), "--chunk", str(a.chunk)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            res[variant].append(json.loads(out.strip().splitlines()[-1]))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("added_mib", "seconds")} for v, rs in res.items()}
    fp32_logits_mib = a.tokens * a.vocab * 4 / 2**20
    print(f"N={a.tokens} V={a.vocab} D={a.dim} chunk={a.chunk} repeats={a.repeats} "
          f"(one fp32 [N, V] = {fp32_logits_mib:.0f} MiB)")
    for v in ("full", "chunked"):
        print(f"  {v:8s} peak added {med[v]['added_mib']:9.1f} MiB   fwd+bwd {med[v]['seconds']:7.2f} s")
    ratio = med["chunked"]["added_mib"] / med["full"]["added_mib"]
    print(f"  memory ratio chunked/full = {ratio:.3f} (target <= 0.25)   "
          f"time ratio = {med['chunked']['seconds'] / med['full']['seconds']:.2f}")
    grads = {v: res[v][0]["checksum"] for v in res}
    print(f"  |grad h| checksum full {grads['full']:.6g} chunked {grads['chunked']:.6g}")


if __name__ == "__main__":
    main()
