"""pi_gen on the actor's own ranks (`loop.max_staleness: k >= 1`, docs/training.md "Async
rollout"): the trainer's log-probs under the weight version that generated each sample.

Rank side (`KeptVersions`, used by `RankActor.gen_logprobs`): every rank (an in-process actor
is a world of one) keeps, on CPU, copies of ITS OWN forward tensors for at most k past
versions: the torch actor its compute model's parameters and buffers (a DDP rank holds the
whole model), a megatron rank its TP / EP / PP shard. A version's copy is taken right before
the update that overwrites it (`advance`, after the pi_gen forwards of the step), and versions
no coming step can carry any more (older than step - k) are dropped first, their storage
reused. pi_gen of a stale row is computed on the rank that holds the row: `swapped_in(v)`
exchanges the kept copy with the live tensors in place (one tensor at a time, so no extra
copy of the shard), the actor runs its own log-prob forward under pi_old's replay plan (R3:
the engine's routes; R2 and off: the version's own routing), and the exchange is undone on
the way out (bit-exact: copies only). So the version part pi_old/pi_gen compares one backend
with itself: the megatron actor's pi_gen is megatron's, never the torch model's.

Driver side (`VersionSplit`): decides which rows are stale (version != step - 1, the weights
the actor holds), asks the actor for their pi_gen and takes pi_old for every other row, so
`is_split/version_*` is exactly 1 on rows of the current weights. It holds no weights.

Multi-turn trajectories may span a weight push (rollout/agent.py records each turn's version):
a row's version is then per position (`Spans`: each turn's sampled tokens and the observation
after it carry the turn's version; `row_versions`), and pi_gen of each token is under the
version that sampled it. `stale_turn_mask` marks the sampled tokens of turns older than their
trajectory's newest turn (`rollout.env.mask_stale_turns` drops them from the loss).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from lockstep.trainer.actor.batch import Batch


Spans = tuple[tuple[str, int, int], ...]
"""A row's weight versions by position: (version, begin, end) over absolute token positions
[begin, end); positions outside every span are not trained (the first prompt)."""
RowVersion = str | Spans
"""One version for the whole row, or its spans."""


def row_versions(results) -> list[RowVersion]:
    """Each sample's weight version; a trajectory whose turns were sampled by several
    versions gets the spans of its turns (its sampled tokens and the observation after)."""
    out: list[RowVersion] = []
    for r in results:
        turns = r.trajectory.turns if r.trajectory is not None else []
        if len({t.weight_version for t in turns}) > 1:
            out.append(tuple((str(t.weight_version), t.start, t.start + t.sampled + t.observation)
                             for t in turns))
        else:
            out.append(str(r.weight_version))
    return out


def versions_of(entry: RowVersion) -> set[str]:
    return {v for v, _, _ in entry} if isinstance(entry, tuple) else {str(entry)}


def positions(entry: RowVersion, version: str, T: int) -> torch.Tensor:
    """[T] bool (host): the positions of a row that `version` generated."""
    if not isinstance(entry, tuple):
        return torch.full((T,), str(entry) == version, device="cpu")
    out = torch.zeros(T, dtype=torch.bool, device="cpu")
    for v, begin, end in entry:
        if v == version:
            out[begin:end] = True
    return out


def stale_versions(versions: list[RowVersion], step: int) -> list[str]:
    """The versions of `versions` other than step `step`'s current one (step - 1), oldest
    first."""
    current = str(step - 1)
    return sorted({v for e in versions for v in versions_of(e) if v != current}, key=int)


def stale_turn_mask(versions: list[RowVersion], T: int) -> torch.Tensor:
    """[B, T] bool: positions of turns sampled by a version older than their row's newest."""
    out = torch.zeros(len(versions), T, dtype=torch.bool, device="cpu")
    for b, e in enumerate(versions):
        if isinstance(e, tuple):
            newest = max(versions_of(e), key=int)
            for v in versions_of(e) - {newest}:
                out[b] |= positions(e, v, T)
    return out


class KeptVersions:
    """One rank's CPU copies of its own forward tensors for at most `k` past versions (module
    docstring). `live` is always the same list of tensors, in the same order (the actor's
    `_version_tensors()`)."""

    def __init__(self, k: int):
        self.k = k
        self.kept: OrderedDict[str, list[torch.Tensor]] = OrderedDict()

    @property
    def versions(self) -> dict[str, int]:
        """Kept version -> bytes of its copy, oldest first."""
        return {v: sum(t.numel() * t.element_size() for t in ts) for v, ts in self.kept.items()}

    def check(self, version: str, step: int, where: str) -> None:
        if version not in self.kept:
            raise RuntimeError(f"step {step}: {where} holds samples of weight version "
                               f"{version!r}, but keeps only versions {list(self.kept)} besides "
                               f"the current {str(step - 1)!r} (loop.max_staleness={self.k})")

    @contextlib.contextmanager
    def swapped_in(self, version: str, live: list[torch.Tensor]):
        """Inside: the live tensors hold `version`'s values (the kept copy holds the current
        ones); restored exactly on the way out."""
        kept = self.kept[version]
        if len(kept) != len(live):
            raise RuntimeError(f"version {version!r}: {len(kept)} kept tensors for "
                               f"{len(live)} live ones")
        exchange(live, kept)
        try:
            yield
        finally:
            exchange(live, kept)

    @torch.no_grad()
    def advance(self, step: int, live: list[torch.Tensor]) -> None:
        """Before step `step`'s update: drop the versions steps > step can no longer carry
        (< step - k), then keep a CPU copy of the live tensors as version step - 1."""
        current = str(step - 1)
        spare = None
        for v in [v for v in self.kept if int(v) < step - self.k]:
            spare = self.kept.pop(v)  # out of reach: its storage takes the new copy
        if current in self.kept or self.k == 0:
            return
        if spare is not None and [t.shape for t in spare] == [t.shape for t in live]:
            for s, t in zip(spare, live):
                s.copy_(t)
        else:
            spare = [t.detach().to("cpu", copy=True) for t in live]
        self.kept[current] = spare
        while len(self.kept) > self.k:  # never more than k copies
            self.kept.popitem(last=False)


@torch.no_grad()
def exchange(live: list[torch.Tensor], kept: list[torch.Tensor]) -> None:
    """Swap the values of `live` (the actor's device) and `kept` (CPU), tensor by tensor."""
    for t, k in zip(live, kept):
        tmp = t.detach().clone()
        t.copy_(k)
        k.copy_(tmp)


class VersionSplit:
    """The driver's side of pi_gen (module docstring): `gen_logprobs(actor, batch, versions,
    old_BT, mode, step)` -> pi_gen [B, T] fp32. Holds no weights: the actor (its ranks) keeps
    the old versions."""

    def __init__(self, max_staleness: int):
        self.k = max_staleness

    def gen_logprobs(self, actor, batch: Batch, versions: list[RowVersion], old_logprobs_BT,
                     mode, step: int) -> torch.Tensor:
        """pi_gen of step `step`'s batch (its rows' `versions`, `row_versions`); call it
        between the old-log-prob forward and the update (the actor keeps the current version
        then)."""
        if self.k == 0:
            return old_logprobs_BT
        stale = stale_versions(versions, step)
        got_BT = actor.gen_logprobs(batch, versions, mode, step, self.k, stale)
        if not stale:
            return old_logprobs_BT
        T = old_logprobs_BT.shape[1]
        stale_BT = torch.zeros(len(versions), T, dtype=torch.bool, device="cpu")
        for b, e in enumerate(versions):
            for v in stale:
                stale_BT[b] |= positions(e, v, T)
        return torch.where(stale_BT.to(got_BT.device), got_BT, old_logprobs_BT)
