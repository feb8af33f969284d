"""Colocated placement (`cluster.placement: colocated`): the fleet's servers run inside the
actor group's placement-group bundles, next to the actor ranks, instead of bundles of their own.

Engine i of M goes into the bundle of actor rank `i * R // M` (R = `cluster.actor_ranks`; with
R = M x tp these are the first of the tp ranks whose GPUs `lockstep plan` gives the server).
The server actor takes `SERVER_SHARE` of the bundle's CPU (and GPU, when the bundle has one);
every rank of a colocated group takes `RANK_SHARE`; together they fill the bundle exactly
(`{CPU: 1}` on CPU, `{CPU: 1, GPU: 1}` on cuda: both processes then see the same GPU).
These numbers are Ray's bookkeeping only (Ray does not cap a process's memory or compute): the
memory split on a GPU is SGLang's `mem_fraction_static` plus the fleet's
`/release_memory_occupation` while the actor trains and `/resume_memory_occupation` before the
push and the next rollout (`Fleet(colocate=True)`).
"""

from __future__ import annotations

from .backends import BACKENDS

SERVER_SHARE = 0.2  # of the bundle's CPU and GPU, for the server actor
RANK_SHARE = 1.0 - SERVER_SHARE  # for the actor rank in the same bundle


def colocates(placement: str, backend: str) -> bool:
    """Whether a run with `cluster.placement` and `rollout.backend` puts a fleet of servers
    (serve / sglang) into the actor's bundles."""
    return placement == "colocated" and BACKENDS[backend].colocatable


def engine_bundles(ranks: int, engines: int) -> list[int]:
    """The actor-group bundle of each engine: rank i * ranks // engines (spread evenly)."""
    return [i * ranks // engines for i in range(engines)]


def refusal(placement: str, backend: str, actor_ranks: int, num_engines: int,
            sglang_tp_size: int, device: str) -> str | None:
    """Why a colocated layout cannot be trained (None: it can, or it is not colocated)."""
    if placement == "colocated" and backend == "http":
        return ("cluster.placement=colocated puts each rollout server into an actor rank's "
                "placement-group bundle, but rollout.backend=http: servers given by rollout.url "
                "/ rollout.urls were not launched by lockstep and have no placement-group bundle "
                "to share; use cluster.placement=disaggregated (or rollout.backend=serve | sglang)")
    if not colocates(placement, backend):
        return None
    R, M = actor_ranks, num_engines
    why = "cluster.placement=colocated puts each rollout server into an actor rank's " \
          "placement-group bundle"
    if R == 1:
        return (f"{why}, but cluster.actor_ranks=1 runs the actor in the driver process, which "
                f"has no bundle to share; set cluster.actor_ranks >= rollout.num_engines ({M}) "
                f"or cluster.placement=disaggregated")
    if R < M:
        return (f"{why} (one server per bundle), so it needs cluster.actor_ranks ({R}) >= "
                f"rollout.num_engines ({M})")
    if backend == "vllm":
        return (f"{why}, but vLLM servers are not colocated yet (vLLM's sleep mode is not wired "
                f"to the fleet's memory release): use cluster.placement=disaggregated")
    if backend == "sglang":
        tp = sglang_tp_size
        if tp > 1:
            return (f"{why}; a Ray actor holds resources of one bundle only, so an SGLang server "
                    f"with rollout.sglang.tp_size={tp} cannot take the GPUs of {tp} ranks' "
                    f"bundles (not done: launching it outside Ray's CUDA_VISIBLE_DEVICES); "
                    f"colocated training takes tp_size=1, or use cluster.placement=disaggregated")
        if device == "cpu":
            return (f"{why}; rollout.backend=sglang needs a GPU in that bundle, and "
                    f"cluster.device=cpu gives the ranks CPU bundles only: set cluster.device=cuda")
    return None
