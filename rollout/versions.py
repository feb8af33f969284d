"""Weight versions of rollout samples: which versions a step may train on, and the lag.

Every `GenerationResult` carries the `weight_version` that generated all of its tokens (the
engines and servers swap weights only between generations). The loop names versions after the
RL step whose update produced them: "0" is the starting policy, "n" the weights after step n's
update. Synchronously (`loop.max_staleness: 0`) step n trains on samples of version n-1; with
`max_staleness: k` the samples of step n may be of any version in {n-1-k, ..., n-1}.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .client import RolloutError
from .types import GenerationResult


def allowed_versions(step: int, max_staleness: int, first_version: int = 0) -> list[str]:
    """The versions step `step`'s samples may carry: n-1-k .. n-1, none before
    `first_version` (the version the run started or resumed from)."""
    newest = step - 1
    return [str(v) for v in range(max(first_version, newest - max_staleness), newest + 1)]


def check_versions(results: Sequence[GenerationResult], allowed: Iterable[str]) -> list[str]:
    """Each result's weight version, in order; a version outside `allowed` raises a
    `RolloutError` naming the request id, the sample and both versions."""
    ok = [str(v) for v in allowed]
    if not ok:
        raise ValueError("check_versions: the allowed set is empty")
    ok_set = set(ok)
    out = []
    for r in results:
        v = str(r.weight_version)
        if v not in ok_set:
            raise RolloutError(f"request {r.rid} sample {r.index}: generated with weight version "
                               f"{v!r}, but this step accepts only {ok} (a version the loop did "
                               f"not ask for)")
        out.append(v)
    return out


def version_lag(versions: Sequence[str], step: int) -> list[int]:
    """How many updates behind step `step`'s newest policy (version step-1) each sample is."""
    lags = []
    for v in versions:
        if not str(v).isdigit():
            raise ValueError(f"weight version {v!r} is not a step number")
        lags.append(step - 1 - int(v))
    return lags
