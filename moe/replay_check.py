"""The replay validator (`replay.check`): a per-forward ledger the routers report to.

Replay that silently does nothing looks like a healthy run (verl #7340: routers registered
twice on a new model family, replay was a no-op in production). A `RouteCheck` is made for one
forward that replays routes, from the routes it was *planned* to replay; every MoE router
reports to it, under its own MoE-layer index, the ids it ran and its natural top-k. `finish()`
after the forward then checks, naming the layer (and the sample and position):
- every MoE layer reported exactly once: a layer that received no replayed ids, or a router
  that ran for two layers (registered twice), stops the run; so does a buffer left
  unconsumed (a layer whose given ids no router ran);
- the ids each router ran equal the given ones on the checked tokens (`full`: every replayed
  real token; `sample`: every SAMPLE_EVERY-th token, at an offset that moves by one with
  every checked forward);
- no checked token's routes repeat an expert within one top-k (given or run), and none is
  all zeros where a route must hold an expert other than 0 (top-k >= 2: every one of K
  distinct ids cannot be 0; top-1: every checked token of a layer given expert 0 while its
  router picks others): routes that were never written (a fused kernel that left its output
  zeroed) or a top-k that repeats;
- every router of the model is one the plan knows (`check_registered`: a router module
  outside the replayed MoE layers, or one with no / another MoE-layer index, routes on its
  own, unseen);
- the given ids overlap the router's own top-k well above chance on the checked tokens
  (at least `min_overlap` of the expert slots; default halfway between chance K/E and 1; only
  where MIN_OVERLAP_TOKENS tokens were checked): routes of another step or sample, which a
  router would run faithfully, agree with its own choice only by chance, while the engine's
  (or the recorded old policy's) routes agree on ~99% of slots (`routing/topk_overlap`).

The reports keep tensors on the routers' device; `finish()` reads them back once.

Shapes: N tokens the routers see (in their order), K top-k, L MoE layers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch

from ..kernels.routes import RouteError

LOGPROB_FORWARD, UPDATE_FORWARD = "log-prob forward", "update forward"
"""The two kinds of replayed forward (messages; the overlap floor applies to the first only)."""
SAMPLE_EVERY = 8
"""`sample`: every 8th replayed token is checked (all of them under `full`)."""
MIN_OVERLAP_TOKENS = 32
"""The overlap floor applies to a layer once this many tokens were checked in a forward."""


class ReplayCheck(str, enum.Enum):
    """`replay.check`: how much of every replayed forward the validator checks."""

    OFF = "off"
    SAMPLE = "sample"
    FULL = "full"


class ReplayCheckError(RouteError):
    """Replay did not happen as planned (names the layer, and the sample and position)."""


def overlap_floor(num_experts: int, top_k: int, min_overlap: float | None) -> float:
    """The overlap floor: `min_overlap`, or halfway between chance (K/E) and 1."""
    return (1.0 + top_k / num_experts) / 2 if min_overlap is None else min_overlap


def sample_slice(mode: ReplayCheck, calls: int) -> slice:
    """The tokens (in the routers' flattened order) a forward checks: all under `full`; under
    `sample` every SAMPLE_EVERY-th, starting at `calls % SAMPLE_EVERY` (`calls`: forwards
    checked so far), so successive forwards cover every offset."""
    if mode is ReplayCheck.FULL:
        return slice(0, None, 1)
    return slice(calls % SAMPLE_EVERY, None, SAMPLE_EVERY)


class RouteCheck:
    """One replayed forward's ledger (module doc).

    `given_NLK`: the ids the plan replays, in the routers' token order; `checked_N`: bool,
    the tokens that count (replayed and real); `tokens`: the slice of them checked
    (`sample_slice`); `layer_names`: decoder layer id of each MoE layer (messages);
    `where(n) -> (sample, position)` names token n; `what`: which forward (messages);
    `moe_ids`: the model's MoE-layer index of each reported layer (default 0..L-1; a pipeline
    stage reports its own layers only); `any_order`: the routers report their ids in another order than given (compared as
    sets). Reports are kept as they come (views); `finish` compares all layers at once."""

    def __init__(self, given_NLK: torch.Tensor, checked_N: torch.Tensor, tokens: slice,
                 layer_names: Sequence[int], where: Callable[[int], tuple[int, int]], *,
                 num_experts: int, min_overlap: float | None = None, what: str = "forward",
                 moe_ids: Sequence[int] | None = None, any_order: bool = False):
        self.given_nLK, self.checked_n = given_NLK[tokens], checked_N[tokens]
        self.tokens, self.layer_names, self.where, self.what = tokens, layer_names, where, what
        self.num_experts, self.any_order = num_experts, any_order
        self.floor = overlap_floor(num_experts, given_NLK.shape[-1], min_overlap)
        L = given_NLK.shape[1]
        self.moe_ids = list(range(L)) if moe_ids is None else list(moe_ids)
        self.counts = [0] * L
        self._ids: list[torch.Tensor | None] = [None] * L
        self._natural: list[torch.Tensor | None] = [None] * L
        self._replayed: list[torch.Tensor | None] = [None] * L

    def ran(self, layer: int | None, ids_NK: torch.Tensor, natural_NK: torch.Tensor,
            replayed_N: torch.Tensor | None = None, *, router: str | None = None) -> None:
        """Router of MoE layer `layer` ran `ids_NK`; its own top-k was `natural_NK`.
        `replayed_N` (partial replay): the tokens this layer replayed; only those must have
        run the given ids (None: every checked token). `router` names it (messages)."""
        if not isinstance(layer, int) or not 0 <= layer < len(self.counts):
            who = "a router" if router is None else f"router {router}"
            raise ReplayCheckError(f"replay check ({self.what}): {who} reported MoE layer "
                                   f"index {layer}, but the plan replays {len(self.counts)} "
                                   f"MoE layers (0..{len(self.counts) - 1}): a router the "
                                   f"replay plan does not know")
        self.counts[layer] += 1
        if self.counts[layer] == 1:
            self._ids[layer] = ids_NK[self.tokens]
            self._natural[layer] = natural_NK[self.tokens]
            if replayed_N is not None:
                self._replayed[layer] = replayed_N[self.tokens]

    def _at(self, i: int) -> str:
        sample, pos = self.where(self.tokens.start + i * self.tokens.step)
        return f"sample {sample}, position {pos}"

    def _bad_rows(self, head, n, K, given, natural, zero, wrong, dup_given, dup_ran) -> None:
        """All-zero routes and repeated ids within one top-k (module doc), first layer first.
        Each of `zero`, `wrong`, `dup_given`, `dup_ran` is (per-layer counts, bool [n, L])."""
        (zeros, zero_nL), (wrongs, wrong_nL) = zero, wrong
        (dup_given, dup_given_nL), (dup_ran, dup_ran_nL) = dup_given, dup_ran
        for l in range(len(zeros)):
            # top-1: one 0 is a real route; a layer given nothing but 0, where its router
            # picks other experts, is not
            if zeros[l] and (K > 1 or (n >= MIN_OVERLAP_TOKENS and zeros[l] == n
                                       and wrongs[l])):
                i = int((zero_nL if K > 1 else wrong_nL)[:, l].nonzero()[0])
                raise ReplayCheckError(
                    f"{head}: {self._name(l)}: all-zero routes at {self._at(i)}: every one of "
                    f"its {K} replayed ids is expert 0, the router's own top-k is "
                    f"{natural[i, l].tolist()}; {int(zeros[l])} of {n} checked tokens (routes "
                    f"never written: a kernel that left its output zeroed?)")
            for what, bad, bad_nL, ids in (("replayed", dup_given[l], dup_given_nL, given),
                                           ("run", dup_ran[l], dup_ran_nL, None)):
                if bad:
                    i = int(bad_nL[:, l].nonzero()[0])
                    got = (ids[i, l] if ids is not None else self._ids[l][i]).tolist()
                    raise ReplayCheckError(
                        f"{head}: {self._name(l)}: duplicate expert ids in one top-k at "
                        f"{self._at(i)}: the {what} ids are {got}; {int(bad)} of {n} checked "
                        f"tokens (a top-k holds {K} distinct experts)")

    def _name(self, layer: int) -> str:
        return f"MoE layer {self.moe_ids[layer]} (decoder layer {self.layer_names[layer]})"

    def finish(self) -> None:
        """Raise `ReplayCheckError` for the first thing that did not happen as planned."""
        head = f"replay check ({self.what})"
        twice = [l for l, c in enumerate(self.counts) if c > 1]
        none = [l for l, c in enumerate(self.counts) if c == 0]
        if twice or none:
            parts = []
            if none:
                parts.append(f"{', '.join(self._name(l) for l in none)} received no replayed "
                             f"ids (its replay buffer was left unconsumed)")
            if twice:
                parts.append(f"the router of {', '.join(self._name(l) for l in twice)} ran "
                             f"{max(self.counts)} times in one forward (registered for "
                             f"more than one layer?)")
            raise ReplayCheckError(f"{head}: {'; '.join(parts)}")
        ran = torch.stack(self._ids, 1)  # [n, L, K]
        L, K = ran.shape[1:]
        given = self.given_nLK.to(ran.device, torch.long)  # compact routes are uint8/uint16
        checked = self.checked_n.to(ran.device)[:, None]
        natural = torch.stack(self._natural, 1)
        zero_nL = (given == 0).all(-1) & checked
        wrong_nL = zero_nL & (natural != 0).any(-1)  # zeros the router would not pick
        dup_given_nL, dup_ran_nL = _repeats(given) & checked, _repeats(ran) & checked
        if self.any_order:
            ran, given = ran.sort(-1).values, given.sort(-1).values
        bad_nL = (ran != given).any(-1) & checked
        if any(r is not None for r in self._replayed):  # partial replay: its own tokens only
            bad_nL &= torch.stack([torch.ones_like(self.checked_n, device=ran.device)
                                   if r is None else r.to(ran.device) for r in self._replayed], 1)
        agree_nL = (given[..., :, None] == natural[..., None, :]).sum((-1, -2)) * checked
        sums = torch.cat([bad_nL.sum(0), agree_nL.sum(0), zero_nL.sum(0), wrong_nL.sum(0),
                          dup_given_nL.sum(0), dup_ran_nL.sum(0), checked.sum(0)]).tolist()
        n = int(sums[-1])  # (one sync above)
        self._bad_rows(head, n, K, given, natural, *(
            (sums[j * L:(j + 1) * L], m) for j, m in
            ((2, zero_nL), (3, wrong_nL), (4, dup_given_nL), (5, dup_ran_nL))))
        for l, bad in enumerate(sums[:L]):
            if bad:
                i = int(bad_nL[:, l].nonzero()[0])
                raise ReplayCheckError(
                    f"{head}: {self._name(l)}: the router did not run the replayed ids: at "
                    f"{self._at(i)} it was given experts "
                    f"{self.given_nLK[i, l].tolist()} and ran {self._ids[l][i].tolist()}; "
                    f"{int(bad)} of {n} checked tokens differ (a router that ignores the "
                    f"given ids?)")
        for l, agree in enumerate(sums[L:2 * L]):
            overlap = agree / max(n * K, 1)
            if n >= MIN_OVERLAP_TOKENS and overlap < self.floor:
                raise ReplayCheckError(
                    f"{head}: {self._name(l)}: the replayed routes agree with the router's "
                    f"own top-k on only {overlap:.1%} of {n * K} expert slots (chance "
                    f"{K / self.num_experts:.1%}, floor {self.floor:.1%}): routes of "
                    f"another step or sample? (replay.min_overlap sets the floor)")


def _repeats(ids_nLK: torch.Tensor) -> torch.Tensor:
    """bool [n, L]: the K ids of a row repeat an expert (pairwise compares; K is small)."""
    K = ids_nLK.shape[-1]
    out = torch.zeros(ids_nLK.shape[:-1], dtype=torch.bool, device=ids_nLK.device)
    for j in range(1, K):
        out |= (ids_nLK[..., j:j + 1] == ids_nLK[..., :j]).any(-1)
    return out


def check_registered(routers: Sequence[tuple[str, int | None]], num_layers: int,
                     reported: Sequence[str], what: str = "forward") -> None:
    """Orphaned routers: `routers` are (name, MoE-layer index) of every router module of the
    model (draft layers excluded), `reported` the names of those the forward reports to the
    ledger. Raise `ReplayCheckError` naming a router the forward never reports (it would
    route on its own, unseen) or one whose index is no MoE layer the plan replays."""
    head = f"replay check ({what})"
    seen = set(reported)
    for name, index in routers:
        if name not in seen:
            raise ReplayCheckError(
                f"{head}: router {name} is in the model but not registered for replay (no "
                f"replayed MoE layer runs it; MoE-layer index {index}): it routes on its own")
        if not isinstance(index, int) or not 0 <= index < num_layers:
            raise ReplayCheckError(
                f"{head}: router {name} reports MoE-layer index {index}, but the plan replays "
                f"{num_layers} MoE layers (0..{num_layers - 1}): a router the replay plan "
                f"does not know")
