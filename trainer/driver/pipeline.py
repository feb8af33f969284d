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

Multi-turn trajectories with `rollout.env.turns_before_push: t >= 1` (`turns`): a step
generated ahead runs its first t turns (one pool task), and its remaining turns are queued
right behind the next weight push (or when the step is taken, if no push comes first), so its
trajectories span that push, always at the same turn: the order of the pool's tasks depends
only on the order of the trainer's calls, never on timing.

Which version generated what is checked per sample (`allowed_versions`,
`lockstep.rollout.weight_sync.check_versions`), and the
trainer's log-probs under that version (pi_gen, computed by the actor's ranks from their own
kept copies of old versions: `trainer/actor/versions.py`) split pi_old/mu_old into a version part
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
from lockstep.rollout.types import RolloutError
from lockstep.rollout.weight_sync import check_versions
from lockstep.trainer.actor.versions import row_versions, versions_of


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


def spanning_metrics(results: list[GenerationResult], rows: list, step: int) -> dict:
    """rollout/trajectories_spanning_pushes: the fraction of trajectories whose turns were
    sampled by several weight versions; rollout/stale_sampled_tokens: the fraction of sampled
    tokens whose turn is older than the trainer's weights (step - 1)."""
    current, stale, total = str(step - 1), 0, 0
    for r in results:
        for t in r.trajectory.turns:
            total += t.sampled
            stale += t.sampled if str(t.weight_version) != current else 0
    spans = sum(isinstance(e, tuple) for e in rows)
    return {"rollout/trajectories_spanning_pushes": spans / max(len(rows), 1),
            "rollout/stale_sampled_tokens": stale / max(total, 1)}


MakeRequests = Callable[[int], tuple[list, list[GenerateRequest]]]
"""make_requests(step) -> (prompts, requests) of that step."""


class RolloutPipeline:
    """The rollout side of the loop: `take(step)` -> (prompts, results), `update_weights`,
    `check_versions`; generates ahead by up to `max_staleness` steps (module docstring)."""

    def __init__(self, backend: RolloutBackend, make_requests: MakeRequests, max_staleness: int,
                 last_step: int, first_version: int = 0,
                 generate: Callable[[list, list[GenerateRequest]], list[GenerationResult]]
                 | None = None, turns: Callable[[list, list[GenerateRequest]], Any] | None = None,
                 turns_before_push: int = 0):
        """`generate(prompts, requests)`: how a step's requests become results (default: the
        backend's `generate`; multi-turn runs pass their trajectory runner's). `turns(prompts,
        requests)` -> a `rollout.agent.Turns`, with `turns_before_push` >= 1 (module
        docstring)."""
        self.backend, self.make_requests = backend, make_requests
        self.generate = generate or (lambda prompts, requests: backend.generate(requests))
        self.turns = turns if turns_before_push >= 1 and max_staleness > 0 else None
        self.turns_before_push = turns_before_push
        self._partial: dict[int, Any] = {}  # step -> its Turns, until the rest is queued
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
                if self.turns is None:
                    fut = self._pool.submit(self._generate, prompts, requests)
                else:  # its first turns now, the rest after the next push
                    self._partial[s] = turns = self.turns(prompts, requests)
                    fut = self._pool.submit(self._advance, turns, self.turns_before_push)
                self._pending[s] = (prompts, fut)
        if step not in self._pending:
            raise RuntimeError(f"rollout pipeline: step {step} was never submitted "
                               f"(pending: {list(self._pending)})")
        if step in self._partial:  # no push came since its first turns: the rest now
            self._continue([step])
        prompts, fut = self._pending.pop(step)
        return (prompts, *fut.result())

    def _advance(self, turns, calls: int | None) -> tuple[Any, float]:
        t0 = time.perf_counter()
        turns.advance(self.backend.generate, calls)
        return turns.results, time.perf_counter() - t0

    def _continue(self, steps: list[int]) -> None:
        """Queue the remaining turns of `steps`' partial generations; their futures then give
        (results, seconds of both parts)."""
        for s in steps:
            turns, (prompts, first) = self._partial.pop(s), self._pending[s]
            rest = self._pool.submit(self._advance, turns, None)
            self._pending[s] = (prompts, _Both(first, rest))

    def update_weights(self, source: Any, weight_version: str) -> str:
        """Push weights after the generations already queued (waits for the push)."""
        if self._pool is None:
            return self.backend.update_weights(source, weight_version)
        push = self._pool.submit(self.backend.update_weights, source, weight_version)
        self._continue(sorted(self._partial))  # right behind the push: they span it
        return push.result()

    def check_versions(self, results: list[GenerationResult], step: int
                       ) -> tuple[list[str], dict[str, float]]:
        """Refuse a sample of a version outside {step-1-k .. step-1} (naming its rid);
        returns the versions and their lag as `rollout/weight_version_lag_mean|max` and under
        verl's name (its v1 trainer's `(global_steps - 1) - version`, the same definition),
        `training/off_policy/trajectory_staleness/mean|max|min`."""
        allowed = set(allowed_versions(step, self.k, self.first_version))
        check_versions(results, allowed)
        rows = row_versions(results)  # a trajectory that spans pushes: per turn
        for r, e in zip(results, rows):
            bad = versions_of(e) - allowed
            if bad:
                raise RolloutError(f"request {r.rid} sample {r.index}: a turn was generated "
                                   f"with weight version {sorted(bad)[0]!r}; this step "
                                   f"accepts {sorted(allowed)}")
        lags = version_lag([str(r.weight_version) for r in results], step) or [0]
        mean, hi, lo = sum(lags) / len(lags), float(max(lags)), float(min(lags))
        m = {"rollout/weight_version_lag_mean": mean, "rollout/weight_version_lag_max": hi,
             "training/off_policy/trajectory_staleness/mean": mean,
             "training/off_policy/trajectory_staleness/max": hi,
             "training/off_policy/trajectory_staleness/min": lo}
        if self.turns is not None:  # rollout.env.turns_before_push: trajectories span pushes
            m.update(spanning_metrics(results, rows, step))
        return rows, m

    def close(self) -> None:
        """Drop queued generations and wait for the running one (idempotent)."""
        if self._pool is not None:
            for _, fut in self._pending.values():
                fut.cancel()
            self._pending.clear()
            self._partial.clear()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class _Both:
    """The future of a generation run in two parts: (results, seconds of both)."""

    def __init__(self, first: Future, rest: Future):
        self.first, self.rest = first, rest

    def result(self) -> tuple[list[GenerationResult], float]:
        _, t1 = self.first.result()
        results, t2 = self.rest.result()
        return results, t1 + t2

    def cancel(self) -> bool:
        first, rest = self.first.cancel(), self.rest.cancel()
        return first and rest
