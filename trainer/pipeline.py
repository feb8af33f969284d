"""Async rollout, `loop.max_staleness: k` (docs/training.md, "Async rollout").

k = 0 (default): each step generates its own samples, then trains on them, then pushes the
new weights; `RolloutPipeline` then only forwards the calls, in the caller's thread, so a
synchronous run is the same sequence of calls as without it.

k >= 1: one background thread owns every call to the rollout backend, in submission order
(FIFO). `take(n)` submits the generation of steps n .. n+k that are not submitted yet (their
prompts and seeds are pure functions of (loop.seed, step, cursor), made here in the caller's
thread), then waits for step n's. So while the actor trains on step n, the backend generates
step n+1 with the weights it holds. `update_weights` is queued behind those generations and
waited for: a push never overlaps a generation (no sample mixes versions, and the actor's
exported views stay unchanged until the push has read them), and once it returns nothing is
in flight (validation may use the backend directly). Steady state: step n trains on samples
of version n-1-k (lag exactly k); the first k steps of a run (or of a resume) lag less.
The queue holds at most k+1 steps of results.

Which version generated what is checked per sample (`allowed_versions`,
`lockstep.rollout.weight_sync.check_versions`), and the
trainer's log-probs under that version (pi_gen, computed by the actor's ranks from their own
kept copies of old versions: `trainer/versions.py`) split pi_old/mu_old into a version part
and an engine part (`correction.version_split_metrics`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lockstep.rollout.client import RolloutBackend
from lockstep.rollout.types import GenerateRequest, GenerationResult
from lockstep.rollout.weight_sync import check_versions


def allowed_versions(step: int, max_staleness: int, first_version: int = 0) -> list[str]:
    """The versions step `step`'s samples may carry. Versions are named after the RL step
    whose update made them ("0" = the starting policy); step n trains from version n-1 and,
    with `max_staleness` k, on samples of n-1-k .. n-1, none before `first_version` (the
    version the run started or resumed from)."""
    newest = step - 1
    return [str(v) for v in range(max(first_version, newest - max_staleness), newest + 1)]


def version_lag(versions: list[str], step: int) -> list[int]:
    """How many updates behind step `step`'s policy (version step-1) each sample is."""
    lags = []
    for v in versions:
        if not str(v).isdigit():
            raise ValueError(f"weight version {v!r} is not a step number")
        lags.append(step - 1 - int(v))
    return lags


MakeRequests = Callable[[int], tuple[list, list[GenerateRequest]]]
"""make_requests(step) -> (prompts, requests) of that step."""


class RolloutPipeline:
    """The rollout side of the loop: `take(step)` -> (prompts, results), `update_weights`,
    `check_versions`; generates ahead by up to `max_staleness` steps (module docstring)."""

    def __init__(self, backend: RolloutBackend, make_requests: MakeRequests, max_staleness: int,
                 last_step: int, first_version: int = 0,
                 generate: Callable[[list, list[GenerateRequest]], list[GenerationResult]]
                 | None = None):
        """`generate(prompts, requests)`: how a step's requests become results (default: the
        backend's `generate`; multi-turn runs pass their trajectory runner's)."""
        self.backend, self.make_requests = backend, make_requests
        self.generate = generate or (lambda prompts, requests: backend.generate(requests))
        self.k, self.last_step, self.first_version = max_staleness, last_step, first_version
        self._pending: OrderedDict[int, tuple[list, Future]] = OrderedDict()
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="lockstep-rollout")
                      if max_staleness > 0 else None)

    def _generate(self, prompts: list, requests: list[GenerateRequest]
                  ) -> tuple[list[GenerationResult], float]:
        t0 = time.perf_counter()
        results = self.generate(prompts, requests)
        return results, time.perf_counter() - t0

    def take(self, step: int) -> tuple[list, list[GenerationResult], float]:
        """Step `step`'s (prompts, results, seconds the backend spent generating them)."""
        if self._pool is None:
            prompts, requests = self.make_requests(step)
            return (prompts, *self._generate(prompts, requests))
        for s in range(step, min(step + self.k, self.last_step) + 1):
            if s not in self._pending:
                prompts, requests = self.make_requests(s)
                self._pending[s] = (prompts, self._pool.submit(self._generate, prompts,
                                                                requests))
        if step not in self._pending:
            raise RuntimeError(f"rollout pipeline: step {step} was never submitted "
                               f"(pending: {list(self._pending)})")
        prompts, fut = self._pending.pop(step)
        return (prompts, *fut.result())

    def update_weights(self, source: Any, weight_version: str) -> str:
        """Push weights after the generations already queued (waits for the push)."""
        if self._pool is None:
            return self.backend.update_weights(source, weight_version)
        return self._pool.submit(self.backend.update_weights, source, weight_version).result()

    def check_versions(self, results: list[GenerationResult], step: int
                       ) -> tuple[list[str], dict[str, float]]:
        """Refuse a sample of a version outside {step-1-k .. step-1} (naming its rid);
        returns the versions and their lag as `rollout/weight_version_lag_mean|max` and under
        verl's name (its v1 trainer's `(global_steps - 1) - version`, the same definition),
        `training/off_policy/trajectory_staleness/mean|max|min`."""
        check_versions(results, set(allowed_versions(step, self.k, self.first_version)))
        versions = [str(r.weight_version) for r in results]
        lags = version_lag(versions, step) or [0]
        mean, hi, lo = sum(lags) / len(lags), float(max(lags)), float(min(lags))
        return versions, {"rollout/weight_version_lag_mean": mean,
                          "rollout/weight_version_lag_max": hi,
                          "training/off_policy/trajectory_staleness/mean": mean,
                          "training/off_policy/trajectory_staleness/max": hi,
                          "training/off_policy/trajectory_staleness/min": lo}

    def close(self) -> None:
        """Drop queued generations and wait for the running one (idempotent)."""
        if self._pool is not None:
            for _, fut in self._pending.values():
                fut.cancel()
            self._pending.clear()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
