"""The RL batch on the trainer side: collating engine results, and splitting a batch into
data-parallel shards (the driver collates once and sends each DP rank only its rows).

Shapes: B batch rows, T padded time (prompt + response), L MoE layers, K top-k, S most kept
candidates of any token in the batch, b rows of one shard, t a shard's own padded time.

DP sharding rule (`plan_shards`): every optimiser step of the update schedule
(`minibatch_schedule`: the rows of each mini-batch, shuffled per epoch by the step's seed) is
split across the DP ranks, so that rank r's part of mini-batch m is a fixed subset of m's rows
and the union over ranks is exactly m. Summing the ranks' gradients of their parts (each part's
loss already being its share of the whole mini-batch's loss) is then the one-process gradient.
Within each mini-batch of the first epoch the rows are dealt by token count, longest first, each
to the rank with the fewest tokens so far among those that still need rows (every rank takes
len(m) // dp rows, the first len(m) % dp ranks one more): ranks hold equal row counts and
near-equal token counts, step by step. Ties go to the lower row id / lower rank, so the plan is
a pure function of (seq_lens, dp, schedule). Later epochs reshuffle rows the ranks already hold:
their parts are whatever rows of each mini-batch a rank has (balanced in rows only on average).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import torch

from lockstep.replay import RoutingTrace, batch_indexer_traces, batch_traces
from lockstep.rollout.types import GenerationResult


@dataclass
class Batch:
    """One RL batch, right-padded, every per-token tensor aligned with `input_ids_BT`.

    Position t of a per-token tensor refers to the token at position t (its log-prob is that
    of predicting it from positions < t); routes row t is the routing of the token at t.
    """

    input_ids_BT: torch.Tensor          # long: prompt + response, right-padded with pad id
    response_mask_BT: torch.Tensor      # bool: True at response tokens (the trained positions)
    rollout_logprobs_BT: torch.Tensor   # fp32: the engine's log-prob at response tokens, else 0
    seq_lens_B: torch.Tensor            # long: P + R per row
    rollout_routes_BTLK: torch.Tensor | None = None  # compact: the engine's routes
    rollout_routes_valid_BT: torch.Tensor | None = None  # bool: rows that have an engine route
    candidates_BTS: torch.Tensor | None = None  # int16/int32: kept ids of the token at t, -1 pad;
    # a row of all -1 = whole vocabulary (prompt, padding, untruncated tokens)
    rollout_gates_BTLK: torch.Tensor | None = None  # the engine's gate weights of its routes
    # (its compute dtype, 0 where no route): replay.gates=engine
    turn_BT: torch.Tensor | None = None  # int8, multi-turn trajectories only: the turn index of
    # the token at t (an observation carries the index of the turn it answers), -1 at the first
    # prompt and padding; observation tokens = turn_BT >= 0 and not response_mask_BT
    rollout_indexer_BTLK: torch.Tensor | None = None  # int32, DSA models: the engine's indexer
    # picks (request-local key positions per indexer layer, -1 padded; replay/indexer.py)
    rollout_indexer_valid_BT: torch.Tensor | None = None  # bool: rows that have engine picks
    recorded_indexer_BTLK: torch.Tensor | None = None  # int32: the old-logprob forward's own
    # picks (replay.indexer=r2 replays them in the updates; set by policy_update)
    rollout_route_refs: Any = None  # rollout.routes_by_reference: a `RouteRefs` (one ref per
    # row) instead of rollout_routes_BTLK / _valid_BT, which each rank fetches (`fetch_rows`)

    @property
    def size(self) -> int:
        return self.input_ids_BT.shape[0]

    @property
    def token_mask_BT(self) -> torch.Tensor:
        """bool: real (non-padding) tokens."""
        T = self.input_ids_BT.shape[1]
        return torch.arange(T, device=self.seq_lens_B.device)[None, :] < self.seq_lens_B[:, None]

    def rows(self, idx: torch.Tensor) -> "Batch":
        """The sub-batch of rows `idx` (long [b])."""
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: None if v is None else v.take(idx) if k == "rollout_route_refs"
                        else v[idx] for k, v in parts.items()})


def collate(results: Sequence[GenerationResult], pad_id: int, num_experts: int,
            num_layers: int, top_k: int, *, sampling_mask: bool = False,
            vocab_size: int | None = None, missing: str = "refuse") -> Batch:
    """Right-pad engine results into a Batch; routes are checked against each sample's length
    and the model (an error names the sample).

    `sampling_mask=True` (sampling-mask replay): every result must carry `sampling_mask` and
    `sampling_logprobs` (request them with `return_sampling_mask`); the rollout log-probs are
    then the truncated, renormalised `sampling_logprobs` and `candidates_BTS` holds each
    response token's kept ids. `vocab_size` is required then (ids are checked against it, and a
    support of the whole vocabulary is stored as "no restriction"). `missing`
    (`replay.missing`): a route row the engine marked missing is refused, or left to the live
    router (`batch_traces`; `fallback_fraction` counts them)."""
    if not results:
        raise ValueError("collate needs at least one GenerationResult")
    if sampling_mask and vocab_size is None:
        raise ValueError("collate(sampling_mask=True) needs vocab_size")
    seq_lens = [r.prompt_tokens + r.completion_tokens for r in results]
    B, T = len(results), max(seq_lens)
    ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    resp_BT = torch.zeros(B, T, dtype=torch.bool)
    rollout_lp_BT = torch.zeros(B, T, dtype=torch.float32)
    traces = []
    multi = any(r.sampled_mask is not None for r in results)
    turn_BT = torch.full((B, T), -1, dtype=torch.int8) if multi else None
    for b, r in enumerate(results):
        P, R = r.prompt_tokens, r.completion_tokens
        if R < 1:
            raise ValueError(f"sample {b}: empty response (nothing to train on)")
        if r.output_logprobs.shape != (R,):
            raise ValueError(f"sample {b}: {tuple(r.output_logprobs.shape)} output log-probs for "
                             f"{R} output tokens")
        ids_BT[b, :P + R] = torch.tensor(list(r.prompt_ids) + list(r.output_ids))
        resp_BT[b, P:P + R] = True if r.sampled_mask is None else _sampled(r, b)
        if multi:
            turn_BT[b, P:P + R] = _turns(r, b)
        if sampling_mask:
            if r.sampling_logprobs is None or r.sampling_logprobs.shape != (R,):
                got = None if r.sampling_logprobs is None else tuple(r.sampling_logprobs.shape)
                raise ValueError(f"sample {b}: sampling-mask replay needs sampling_logprobs for "
                                 f"its {R} output tokens, got {got}")
            rollout_lp_BT[b, P:P + R] = r.sampling_logprobs.float()
        else:
            rollout_lp_BT[b, P:P + R] = r.output_logprobs.float()
        if r.routes_NLK is not None:
            trace = RoutingTrace(r.routes_NLK, num_experts, start=r.routes_start, sample=b)
            trace.check(P, R, num_layers, top_k, num_experts, sample=b)
            traces.append(trace)
    refs = [r.routes_ref for r in results if r.routes_ref is not None]
    if traces and len(traces) + len(refs) != B or refs and (traces or len(refs) != B):
        raise ValueError(f"{B - len(traces) - len(refs)} of {B} samples have no routes, "
                         f"{len(refs)} have them by reference; all or none must, one way")
    for b, ref in enumerate(refs):  # checked as collate checks a trace, without its bytes
        P, R = results[b].prompt_tokens, results[b].completion_tokens
        if ref.start != 0 or ref.rows != P + R - 1:
            raise ValueError(f"sample {b}: routes by reference of {ref.rows} rows from position "
                             f"{ref.start}, expected {P + R - 1} from 0")
    routes, valid = batch_traces(traces, T, seq_lens, missing) if traces else (None, None)
    cand_BTS = _candidates(results, T, vocab_size) if sampling_mask else None
    gates = _gates(results, T, routes) if any(r.gates_NLK is not None for r in results) else None
    picks, picks_valid = _indexer(results, T, seq_lens)
    from lockstep.rollout.route_refs import RouteRefs
    return Batch(ids_BT, resp_BT, rollout_lp_BT, torch.tensor(seq_lens), routes, valid, cand_BTS,
                 gates, turn_BT=turn_BT, rollout_indexer_BTLK=picks,
                 rollout_indexer_valid_BT=picks_valid,
                 rollout_route_refs=RouteRefs(tuple(refs)) if refs else None)


def fallback_fraction(batch: Batch) -> float:
    """Share of the batch's route rows (P+R-1 per sample) that had no route and route live
    (`replay.missing=live`); 0 without routes."""
    valid_BT = batch.rollout_routes_valid_BT
    if valid_BT is None:
        return 0.0
    rows = int((batch.seq_lens_B - 1).sum())
    return 1.0 - float(valid_BT.sum()) / max(rows, 1)


def _indexer(results: Sequence[GenerationResult], T: int, seq_lens: list[int]):
    """The engine's indexer picks, right-padded (replay/indexer.py); all samples or none."""
    traces = [r.indexer for r in results]
    if all(t is None for t in traces):
        return None, None
    missing = [b for b, t in enumerate(traces) if t is None]
    if missing:
        raise ValueError(f"samples {missing[:8]} of {len(traces)} have no indexer picks; all or "
                         f"none must")
    for b, (r, t) in enumerate(zip(results, traces)):
        t.check(r.prompt_tokens, r.completion_tokens, t.num_layers, t.top_k, sample=b)
    return batch_indexer_traces(traces, T, seq_lens)


def fetch_rows(batch: Batch, num_experts: int, num_layers: int, top_k: int) -> Batch:
    """A rank's shard with its rows' routes fetched from where the engines left them
    (`rollout_route_refs`), checked and laid out as `collate` does (`batch_traces`)."""
    from lockstep.rollout.route_refs import fetch_routes
    refs = batch.rollout_route_refs
    if refs is None:
        return batch
    traces = []
    for b, x in enumerate(fetch_routes(refs.refs)):
        trace = RoutingTrace(x, num_experts, start=0, sample=b)
        R = int(batch.response_mask_BT[b].sum())  # single-turn (no rollout.env): P + R tokens
        P = int(batch.seq_lens_B[b]) - R
        trace.check(P, R, num_layers, top_k, num_experts, sample=b)
        traces.append(trace)
    routes, valid = batch_traces(traces, batch.input_ids_BT.shape[1], batch.seq_lens_B.tolist())
    return dataclasses.replace(batch, rollout_routes_BTLK=routes, rollout_routes_valid_BT=valid,
                               rollout_route_refs=None)


def _gates(results: Sequence[GenerationResult], T: int, routes_BTLK) -> torch.Tensor:
    """The engine's gate weights right-padded like its routes (0 where no route); every
    sample must have them, one row per route row."""
    if routes_BTLK is None:
        raise ValueError("gate weights came without routes (replay.gates=engine needs both)")
    got = [r.gates_NLK for r in results]
    for b, (r, g) in enumerate(zip(results, got)):
        want = (r.prompt_tokens + r.completion_tokens - 1, *routes_BTLK.shape[2:])
        if g is None or tuple(g.shape) != want:
            raise ValueError(f"sample {b}: gate weights {None if g is None else tuple(g.shape)}, "
                             f"expected {want} (one per route)")
    dtype = got[0].dtype
    if any(g.dtype != dtype for g in got):
        raise ValueError(f"gate weights of mixed dtypes {sorted({str(g.dtype) for g in got})}")
    out = torch.zeros(routes_BTLK.shape, dtype=dtype)
    for b, g in enumerate(got):
        out[b, :len(g)] = g
    return out


def _sampled(r: GenerationResult, b: int) -> torch.Tensor:
    """A trajectory's loss mask over its output tokens (True = sampled by the policy)."""
    m = r.sampled_mask
    if m.dtype != torch.bool or m.shape != (r.completion_tokens,):
        raise ValueError(f"sample {b}: sampled_mask {m.dtype} {tuple(m.shape)} for "
                         f"{r.completion_tokens} output tokens (need bool [R])")
    if not bool(m.any()):
        raise ValueError(f"sample {b}: no sampled token (nothing to train on)")
    return m


def _turns(r: GenerationResult, b: int) -> torch.Tensor:
    """Turn index of each output token ([R] int8; a single-turn sample is turn 0)."""
    out = torch.zeros(r.completion_tokens, dtype=torch.int8)
    if r.trajectory is None:
        return out
    P = r.prompt_tokens
    for i, t in enumerate(r.trajectory.turns):
        out[t.start - P:t.start - P + t.sampled + t.observation] = min(i, 127)
    return out


def _candidates(results: Sequence[GenerationResult], T: int, V: int) -> torch.Tensor:
    """Per-token kept ids [B, T, S] (-1 padded, smallest int dtype that holds V), aligned with
    the response positions; checked: each sampled id is in its own set (an error names the
    sample and the output position). Tensor ops over the whole batch: the only per-token
    Python is collecting the engine's per-token list of kept-id tensors into one list."""
    kept: list[torch.Tensor] = []  # every truncated token's kept ids, batch order
    where: list[torch.Tensor] = []  # per sample: [n_b, 3] (sample, output position, P)
    chosen: list[torch.Tensor] = []  # per sample: the sampled ids at those positions
    for b, r in enumerate(results):
        P, R = r.prompt_tokens, r.completion_tokens
        if r.sampling_mask is None or len(r.sampling_mask) != R:
            got = None if r.sampling_mask is None else len(r.sampling_mask)
            raise ValueError(f"sample {b}: sampling-mask replay needs a sampling mask for each "
                             f"of its {R} output tokens, got {got} (request "
                             "return_sampling_mask)")
        at_n = torch.tensor([m is not None for m in r.sampling_mask]).nonzero().flatten()
        if len(at_n):
            kept.extend(m for m in r.sampling_mask if m is not None)
            where.append(torch.stack([torch.full_like(at_n, b), at_n, torch.full_like(at_n, P)], 1))
            chosen.append(torch.tensor(r.output_ids)[at_n])
    dtype = torch.int16 if V <= torch.iinfo(torch.int16).max else torch.int32
    if not kept:
        return torch.full((len(results), T, 1), -1, dtype=dtype)
    try:
        ids_nS = torch.nn.utils.rnn.pad_sequence(kept, batch_first=True, padding_value=-1)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"sampling masks must be 1-D tensors of token ids: {e}") from e
    n_n = torch.tensor([len(m) for m in kept])
    where_n3, chosen_n = torch.cat(where), torch.cat(chosen)
    real_nS = torch.arange(ids_nS.shape[1])[None] < n_n[:, None]
    bad_n = (n_n == 0) | (real_nS & ((ids_nS < 0) | (ids_nS >= V))).any(-1)
    bad_n |= ~((ids_nS == chosen_n[:, None]) & real_nS).any(-1)
    if bool(bad_n.any()):
        j = int(bad_n.nonzero()[0])
        b, i, _ = where_n3[j].tolist()
        raise ValueError(f"sample {b}, output token {i}: kept ids {kept[j].tolist()[:8]}... are "
                         f"empty, outside [0, {V}) or miss the sampled id {int(chosen_n[j])}")
    part_n = n_n < V  # a full support is stored as "no restriction"
    S = max(int(n_n[part_n].max()), 1) if bool(part_n.any()) else 1
    cand_BTS = torch.full((len(results), T, S), -1, dtype=dtype)
    w = where_n3[part_n]
    cand_BTS[w[:, 0], w[:, 1] + w[:, 2]] = ids_nS[part_n, :S].to(dtype)
    return cand_BTS


def minibatch_schedule(batch_size: int, mini_batch_size: int, epochs: int,
                       shuffle_seed: int | None) -> list[torch.Tensor]:
    """The rows of every optimiser step of an update, in order: `epochs` passes over
    `batch_size` rows in mini-batches of `mini_batch_size`, rows shuffled per epoch by a
    generator seeded with `shuffle_seed` (None keeps their order). Long [mini_batch_size] each."""
    if batch_size % mini_batch_size:
        raise ValueError(f"batch of {batch_size} rows is not a multiple of "
                         f"actor.mini_batch_size={mini_batch_size}")
    gen = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    steps: list[torch.Tensor] = []
    for _ in range(epochs):
        order = (torch.arange(batch_size, device="cpu") if gen is None
                 else torch.randperm(batch_size, generator=gen, device="cpu"))
        steps.extend(order.split(mini_batch_size))
    return steps


def micro_batches(rows: torch.Tensor, seq_lens_B: torch.Tensor, cfg) -> list[torch.Tensor]:
    """Split the rows of one mini-batch (or of a log-prob pass) into micro-batches; both actors
    call this. Each micro-batch is meant to run trimmed to its own longest row (`trim_batch`).

    `cfg` is the `ActorConfig`. With `max_tokens_per_micro_batch` unset: `micro_batch_size`
    rows each, in the given order (today's schedule). With it set: rows sorted by length
    (longest first, ties by their order in `rows`) are packed greedily, each micro-batch taking
    rows while rows x its first (longest) row fits the budget; a row longer than the budget
    gets a micro-batch of its own (a row is never split). As long as the loss of a micro-batch
    is its share of the mini-batch loss (`LossFn`), the summed gradient does not depend on the
    split, up to fp32 summation order; the load-balancing loss is the exception (it balances
    each micro-batch's own tokens)."""
    budget = cfg.max_tokens_per_micro_batch
    if budget is None:
        return list(rows.split(cfg.micro_batch_size))
    lens = seq_lens_B[rows].tolist()
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    out: list[list[int]] = []
    first = 0
    for i in order:
        if out and (len(out[-1]) + 1) * first <= budget:
            out[-1].append(i)
        else:
            out.append([i])
            first = lens[i]
    return [rows[torch.tensor(m, device=rows.device)] for m in out]


def trim(x: torch.Tensor, rows_b: torch.Tensor, t: int) -> torch.Tensor:
    """Rows `rows_b` of a right-padded per-row [B, ...] or per-token [B, T, ...] tensor, the
    time axis cut to `t` (slice first, then gather: the [b, T, ...] copy is never built)."""
    if x.dim() >= 2:
        x = x[:, :t]
    if x.dtype == torch.uint16:  # indexing kernels are missing for uint16: move the same bits
        return x.view(torch.int16).index_select(0, rows_b).view(torch.uint16)
    return x.index_select(0, rows_b)  # ~2x faster than x[rows_b] on [B, T, L, K] routes


def trim_batch(batch: Batch, rows_b: torch.Tensor) -> Batch:
    """The sub-batch of rows `rows_b`, its time axis cut to its own longest row."""
    t = int(batch.seq_lens_B[rows_b].max())
    parts = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return Batch(**{k: None if v is None else v.take(rows_b) if k == "rollout_route_refs"
                    else trim(v, rows_b, t) for k, v in parts.items()})


def wire_bytes(*items) -> int:
    """Bytes of the tensors in `items` (tensors, Batches, mappings or sequences of them,
    None): what sending them costs, before serialisation framing (a few hundred bytes)."""
    n = 0
    for x in items:
        if x is None:
            continue
        if isinstance(x, torch.Tensor):
            n += x.numel() * x.element_size()
        elif isinstance(x, Batch):  # route refs: a few bytes each, no routes
            n += wire_bytes(*(getattr(x, f.name) for f in fields(x)
                              if f.name != "rollout_route_refs"))
        elif isinstance(x, Mapping):
            n += wire_bytes(*x.values())
        elif isinstance(x, (list, tuple)):
            n += wire_bytes(*x)
        else:
            raise TypeError(f"wire_bytes: cannot size a {type(x).__name__}")
    return n


@dataclass
class ShardPlan:
    """Which batch rows each DP rank holds, and its part of every optimiser step."""

    rows: list[torch.Tensor]         # per rank: global row ids (long, ascending)
    steps: list[list[torch.Tensor]]  # per rank, per optimiser step: local indices into rows[r]
    # (in the mini-batch's own order; may be empty when a mini-batch has fewer rows than ranks)

    @property
    def dp_size(self) -> int:
        return len(self.rows)

    def batch(self, rank: int, batch: Batch) -> Batch:
        """Rank `rank`'s rows of `batch`, trimmed to their own longest row."""
        return trim_batch(batch, self.rows[rank])

    def take(self, rank: int, x: torch.Tensor, seq_lens_B: torch.Tensor) -> torch.Tensor:
        """Rank `rank`'s rows of a per-row [B, ...] or per-token [B, T, ...] tensor (advantages,
        IS weights, old log-probs), cut to the same time as `batch(rank, ...)`."""
        rows_b = self.rows[rank]
        return trim(x, rows_b, int(seq_lens_B[rows_b].max()))


def plan_shards(seq_lens_B: torch.Tensor, dp_size: int,
                schedule: Sequence[torch.Tensor]) -> ShardPlan:
    """Split the rows of a batch over `dp_size` ranks by the rule in this module's docstring.
    `schedule` is the update's `minibatch_schedule`; its first epoch must partition the rows."""
    B = len(seq_lens_B)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if B < dp_size:
        raise ValueError(f"a batch of {B} rows cannot feed {dp_size} DP ranks (each needs a row)")
    first, seen = [], 0
    for mini in schedule:  # the first epoch: mini-batches until every row was seen once
        if seen >= B:
            break
        first.append(mini)
        seen += len(mini)
    if seen != B or not torch.equal(torch.cat(first).sort().values, torch.arange(B)):
        raise ValueError(f"the schedule's first epoch does not cover the {B} rows exactly once")
    lens = seq_lens_B.tolist()
    owner = [0] * B
    load = [0] * dp_size
    for mini in first:
        ids = mini.tolist()
        quota = [len(ids) // dp_size + (r < len(ids) % dp_size) for r in range(dp_size)]
        for i in sorted(ids, key=lambda i: (-lens[i], i)):
            r = min((r for r in range(dp_size) if quota[r]), key=lambda r: (load[r], r))
            owner[i], quota[r], load[r] = r, quota[r] - 1, load[r] + lens[i]
    owner_B = torch.tensor(owner)
    rows = [(owner_B == r).nonzero().flatten() for r in range(dp_size)]
    local_B = torch.empty(B, dtype=torch.long)  # position of each row within its rank's rows
    for r_rows in rows:
        local_B[r_rows] = torch.arange(len(r_rows))
    empty = [r for r in range(dp_size) if not len(rows[r])]
    if empty:  # mini-batches smaller than the group put every row on the first ranks
        raise ValueError(f"mini-batches of {len(first[0])} rows leave DP rank {empty[0]} of "
                         f"{dp_size} no row: actor.mini_batch_size must be at least the "
                         f"{dp_size} DP ranks")
    steps = [[local_B[m[owner_B[m] == r]] for m in schedule] for r in range(dp_size)]
    return ShardPlan(rows, steps)
