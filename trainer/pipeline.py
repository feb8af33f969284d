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
trainer's log-probs under that version (`VersionCache`) split pi_old/mu_old into a version
part and an engine part (`correction.version_split_metrics`).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lockstep.moe.checkpoint import load_hf_state_dict
from lockstep.moe.model import MoEModel
from lockstep.replay import ReplayMode, old_logprob_plan
from lockstep.rollout.client import RolloutBackend
from lockstep.rollout.types import GenerateRequest, GenerationResult
from lockstep.rollout.weight_sync import check_versions
from lockstep.trainer.batch import Batch, trim_batch


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
                 last_step: int, first_version: int = 0):
        self.backend, self.make_requests = backend, make_requests
        self.k, self.last_step, self.first_version = max_staleness, last_step, first_version
        self._pending: OrderedDict[int, tuple[list, Future]] = OrderedDict()
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="lockstep-rollout")
                      if max_staleness > 0 else None)

    def _generate(self, requests: list[GenerateRequest]) -> tuple[list[GenerationResult], float]:
        t0 = time.perf_counter()
        results = self.backend.generate(requests)
        return results, time.perf_counter() - t0

    def take(self, step: int) -> tuple[list, list[GenerationResult], float]:
        """Step `step`'s (prompts, results, seconds the backend spent generating them)."""
        if self._pool is None:
            prompts, requests = self.make_requests(step)
            return (prompts, *self._generate(requests))
        for s in range(step, min(step + self.k, self.last_step) + 1):
            if s not in self._pending:
                prompts, requests = self.make_requests(s)
                self._pending[s] = (prompts, self._pool.submit(self._generate, requests))
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


class VersionCache:
    """The trainer's log-probs under the weights that generated each sample (pi_gen).

    Holds, on CPU, the weights of the versions a coming step's samples may still carry and
    the actor no longer has: at most `max_staleness` fp32 copies of the model (none when it
    is 0), each an `MoEModel` loaded from the exported HF-named tensors. The current
    version's weights are the exported views of the actor (`set_current`), copied into the
    cache only right before the update that overwrites them (`gen_logprobs`), after the
    version that falls out of reach has been dropped.

    pi_gen is recomputed as pi_old was, under the same replay plan (R3: the engine's routes;
    R2 and off: the version's own routing), on the torch model in the actor's compute
    precision: so the version part is only the weights' lag. Rows of the current version are
    not recomputed: their pi_gen is pi_old, and their version ratio exactly 1."""

    def __init__(self, max_staleness: int, template: MoEModel, actor_cfg, temperature: float,
                 device: str = "cpu"):
        self.k, self.actor_cfg, self.temperature, self.device = (max_staleness, actor_cfg,
                                                                 temperature, device)
        self._template = template  # structure only: copies are loaded with exported weights
        self.current: tuple[str, dict[str, torch.Tensor]] | None = None
        self.cache: OrderedDict[str, MoEModel] = OrderedDict()

    def set_current(self, version: str, hf_weights: dict[str, torch.Tensor]) -> None:
        """The actor's weights now (views are fine: they are copied before the next update)."""
        if self.k > 0:
            self.current = (str(version), hf_weights)

    @torch.no_grad()
    def gen_logprobs(self, batch: Batch, versions: list[str], old_logprobs_BT: torch.Tensor,
                     mode: ReplayMode, step: int) -> torch.Tensor:
        """pi_gen [B, T] fp32 of step `step`'s batch (its rows' `versions`); call it between
        the old-log-prob forward and the update."""
        if self.k == 0:
            return old_logprobs_BT
        cur = self.current[0] if self.current is not None else None
        gen_BT = old_logprobs_BT.clone()
        by_version: dict[str, list[int]] = {}
        for i, v in enumerate(versions):
            if v != cur:
                by_version.setdefault(v, []).append(i)
        for v, rows in by_version.items():
            if v not in self.cache:
                raise RuntimeError(f"step {step}: samples of weight version {v!r} (e.g. row "
                                   f"{rows[0]}), but the trainer keeps only versions "
                                   f"{[*self.cache, cur]}")
            idx = torch.tensor(rows)
            sub = trim_batch(batch, idx)
            plan = old_logprob_plan(mode, sub.rollout_routes_BTLK, sub.rollout_routes_valid_BT)
            lp = self._actor(self.cache[v]).logprobs(sub, plan.routes_BTLK,
                                                      plan.replay_mask_BT).logprobs_BT
            gen_BT[idx] = 0.0
            gen_BT[idx, :lp.shape[1]] = lp
        self._advance(step)
        return gen_BT

    def _actor(self, model: MoEModel):
        from lockstep.trainer.actor import TorchActor
        if self.device != "cpu":  # the cached copy stays on CPU
            model = copy.deepcopy(model)
        return TorchActor(model, self.actor_cfg, total_updates=1, temperature=self.temperature,
                          device=self.device)

    def _advance(self, step: int) -> None:
        """Before step `step`'s update: keep the versions steps step+1.. may still carry
        (>= step-k), the current one copied in."""
        spare = None
        for v in [v for v in self.cache if int(v) < step - self.k]:
            spare = self.cache.pop(v)  # out of reach: its model is reused for the new copy
        if self.current is None or self.current[0] in self.cache:
            return
        if spare is None:
            spare = copy.deepcopy(self._template).requires_grad_(False).to("cpu")
        load_hf_state_dict(spare, self.current[1])
        self.cache[self.current[0]] = spare
        while len(self.cache) > self.k:  # never more than k copies
            self.cache.popitem(last=False)

    @property
    def cached_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for m in self.cache.values()
                   for p in m.parameters())
