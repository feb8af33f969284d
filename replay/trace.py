"""RoutingTrace: the experts a sample's tokens were routed to, stored compactly.

Contract (DESIGN.md): row i of a trace is the routing of the token at absolute position
`start + i` of prompt+response. A complete sample of P prompt and R response tokens has
P+R-1 rows (the last sampled token never went through the model). The layer axis holds the
model's MoE layers only, in order (dense layers have no rows). Ids are logical expert ids in
[0, num_experts), distinct within a row. Storage is uint8 when num_experts <= 256, else uint16
(torch keeps few ops for uint16, so all arithmetic happens on an int32/int64 copy).

A row may be *missing* (the engine had no route for that token: -1 in every slot on the wire,
NeMo-RL's sentinel): it is stored as the storage dtype's largest value (255 / 65535, the
`missing_code`) in every slot of every layer, which no real route holds: K >= 2 distinct ids
are never all equal, and under top-1 the code is past the last expert unless num_experts is
exactly 256 (65536), where a missing row cannot be stored and is refused. Given as int64, a
row of -1s is taken as missing; a row with -1 in some slots only is an error.
`batch_traces` refuses missing rows or leaves them to the live router (`replay.missing`).

Shapes: N rows (token positions), L MoE layers, K top-k, B batch, T padded time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..kernels.routes import RouteError

MAX_EXPERTS = 1 << 16
TRACE_FILE_FORMAT = "lockstep.routing_trace.v1"


def _who(sample: int | None) -> str:
    return "routes" if sample is None else f"sample {sample}: routes"


def compact_dtype(num_experts: int) -> torch.dtype:
    """Smallest unsigned dtype that holds every id in [0, num_experts)."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise RouteError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= MAX_EXPERTS:
        return torch.uint16
    raise RouteError(f"num_experts={num_experts} exceeds the supported maximum {MAX_EXPERTS}")


def missing_code(num_experts: int, top_k: int) -> int | None:
    """The stored value of a missing row's every slot (module doc): the storage dtype's
    largest value; None where it could be a real route (top-1 with exactly 256 or 65536
    experts)."""
    code = torch.iinfo(compact_dtype(num_experts)).max
    return code if top_k > 1 or code >= num_experts else None


def _rows_equal(ids_NLK: torch.Tensor, value: int) -> torch.Tensor:
    """bool [N]: every slot of the row holds `value`."""
    if ids_NLK.dtype == torch.uint16:
        ids_NLK = ids_NLK.to(torch.int32)
    return (ids_NLK == value).flatten(1).all(1)


def _as_int64_NLK(ids, sample: int | None) -> torch.Tensor:
    """Any integer array-like [N, L, K] -> int64 tensor (CPU), with dtype/shape errors named."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise RouteError(f"{_who(sample)} must be integers, got numpy dtype {ids.dtype}")
        ids = torch.from_numpy(ids.astype(np.int64, copy=False))
    elif not isinstance(ids, torch.Tensor):
        raise RouteError(f"{_who(sample)} must be a torch.Tensor or numpy array, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise RouteError(f"{_who(sample)} must be integers, got {ids.dtype}")
    if ids.dim() != 3:
        raise RouteError(f"{_who(sample)} must have shape [rows, layers, top_k], got {tuple(ids.shape)}")
    if ids.shape[1] < 1 or ids.shape[2] < 1:
        raise RouteError(f"{_who(sample)} need >= 1 layer and top_k >= 1, got shape {tuple(ids.shape)}")
    return ids.detach().to("cpu", torch.int64)


def validate_ids(ids_NLK: torch.Tensor, num_experts: int, sample: int | None = None,
                 row_offset: int = 0) -> None:
    """The route validator: raise RouteError naming sample, row, layer and value for the first
    out-of-range or repeated id (every RoutingTrace runs it; the models trust what it passed). `ids_NLK` is int64 or already compact (checked without an int64 copy: uint8
    as is, uint16 through an int32 copy); `row_offset` turns row indices into absolute positions."""
    if ids_NLK.numel() == 0:
        return
    if ids_NLK.dtype == torch.uint16:  # few kernels exist for uint16
        ids_NLK = ids_NLK.to(torch.int32)
    K = ids_NLK.shape[2]
    code = missing_code(num_experts, K)

    def missing_N() -> torch.Tensor:  # missing rows (module doc); looked for only when needed
        if code is None:
            return torch.zeros(ids_NLK.shape[0], dtype=torch.bool)
        return _rows_equal(ids_NLK, code)

    lo = 0 if ids_NLK.dtype == torch.uint8 else int(ids_NLK.min())
    if lo < 0 or int(ids_NLK.max()) >= num_experts:  # a min/max pass; locate only when bad
        bad_NLK = ((ids_NLK < 0) | (ids_NLK >= num_experts)) & ~missing_N()[:, None, None]
        if bool(bad_NLK.any()):
            n, l, k = (int(v) for v in bad_NLK.nonzero()[0])
            v = int(ids_NLK[n, l, k])
            hint = (" (a row with no route has -1 in every slot of every layer)"
                    if v in (-1, code) else "")
            raise RouteError(
                f"{_who(sample)} row {n + row_offset} (position), layer {l}, slot {k}: expert "
                f"id {v} outside [0, {num_experts}){hint}")
    if K > 1:  # pairwise compares of contiguous [N, L] slices: much cheaper than a sort per row
        ids_KNL = ids_NLK.permute(2, 0, 1).contiguous()
        dup_NL = torch.zeros(ids_KNL.shape[1:], dtype=torch.bool)
        for j in range(1, K):
            for i in range(j):
                dup_NL |= ids_KNL[j] == ids_KNL[i]
        if bool(dup_NL.any()) and bool((dup_NL := dup_NL & ~missing_N()[:, None]).any()):
            n, l = (int(v) for v in dup_NL.nonzero()[0])
            raise RouteError(
                f"{_who(sample)} row {n + row_offset} (position), layer {l}: expert ids "
                f"{ids_NLK[n, l].tolist()} repeat an expert (top-k ids must be distinct)")


def _mark_missing(ids_NLK: torch.Tensor, num_experts: int, sample: int | None,
                  start: int) -> torch.Tensor:
    """int64 ids with rows of -1 -> the same with those rows set to `missing_code`."""
    miss_N = _rows_equal(ids_NLK, -1)
    if not bool(miss_N.any()):
        return ids_NLK
    code = missing_code(num_experts, ids_NLK.shape[2])
    if code is None:
        n = int(miss_N.nonzero()[0])
        raise RouteError(f"{_who(sample)} row {n + start} (position) has no route (-1), which "
                         f"cannot be stored for top-1 routes of exactly {num_experts} experts "
                         f"(every stored value is an expert id)")
    ids_NLK = ids_NLK.clone()
    ids_NLK[miss_N] = code
    return ids_NLK


class RoutingTrace:
    """Routes of one sample: `ids_NLK` [N, L, K] compact, row i = absolute position start + i."""

    __slots__ = ("ids_NLK", "num_experts", "start")

    def __init__(self, ids_NLK, num_experts: int, start: int = 0, sample: int | None = None):
        """Validate and store. `ids_NLK`: any integer tensor/array [N, L, K]. `start`: absolute
        position of row 0 (SGLang's `routed_experts_start_len`; 0 for a complete trace).
        `sample` only labels error messages."""
        dtype = compact_dtype(num_experts)
        if not isinstance(start, int) or start < 0:
            raise RouteError(f"{_who(sample)}: start must be an int >= 0, got {start!r}")
        compact = isinstance(ids_NLK, torch.Tensor) and ids_NLK.dtype == dtype \
            and ids_NLK.dim() == 3
        # already compact: validated as is and kept without a copy when contiguous on CPU
        ids = ids_NLK.detach().cpu().contiguous() if compact else _as_int64_NLK(ids_NLK, sample)
        if not compact and ids.numel() and int(ids.min()) < 0:
            ids = _mark_missing(ids, num_experts, sample, start)
        validate_ids(ids, num_experts, sample, row_offset=start)
        self.ids_NLK = ids if compact else ids.to(dtype).contiguous()
        self.num_experts = num_experts
        self.start = start

    # ---- shape -----------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.ids_NLK.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids_NLK.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids_NLK.shape[2]

    @property
    def end(self) -> int:
        """One past the last absolute position covered."""
        return self.start + self.num_rows

    @property
    def nbytes(self) -> int:
        return self.ids_NLK.numel() * self.ids_NLK.element_size()

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (f"RoutingTrace(rows={self.num_rows}, layers={self.num_layers}, top_k={self.top_k}, "
                f"num_experts={self.num_experts}, start={self.start}, dtype={self.ids_NLK.dtype})")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RoutingTrace) and self.num_experts == other.num_experts
                and self.start == other.start and torch.equal(self.ids_NLK, other.ids_NLK))

    __hash__ = None  # mutable tensor inside

    def to_int64(self) -> torch.Tensor:
        """[N, L, K] int64 copy (for arithmetic, or Megatron's int64 replay tensors)."""
        return self.ids_NLK.to(torch.int64)

    def missing_rows(self) -> torch.Tensor | None:
        """bool [N]: the rows with no route (module doc), or None when there are none."""
        code, ids = missing_code(self.num_experts, self.top_k), self.ids_NLK
        if ids.dtype == torch.uint16:
            ids = ids.to(torch.int32)
        if code is None or not ids.numel() or int(ids.max()) < code:
            return None
        miss_N = _rows_equal(ids, code)
        return miss_N if bool(miss_N.any()) else None

    # ---- checks ----------------------------------------------------------------------------
    def check(self, prompt_len: int, response_len: int, num_layers: int, top_k: int,
              num_experts: int, sample: int | None = None) -> None:
        """Raise RouteError (naming `sample`) unless this trace covers exactly positions
        [start, P+R-1) of a sample with P prompt and R response tokens, for a model with
        `num_layers` MoE layers, top-k `top_k` and `num_experts` experts."""
        who = _who(sample)
        if prompt_len < 1 or response_len < 0:
            raise RouteError(f"{who}: need prompt_len >= 1 and response_len >= 0, "
                             f"got {prompt_len}, {response_len}")
        expected = prompt_len + response_len - 1 - self.start
        if self.num_rows != expected:
            raise RouteError(
                f"{who} have {self.num_rows} rows starting at position {self.start}, expected "
                f"{expected} = prompt {prompt_len} + response {response_len} - 1 - start {self.start}")
        if self.num_layers != num_layers:
            raise RouteError(f"{who} have {self.num_layers} layers, the model has {num_layers} MoE layers")
        if self.top_k != top_k:
            raise RouteError(f"{who} have top_k {self.top_k}, the model routes to {top_k}")
        if self.num_experts != num_experts:
            raise RouteError(f"{who} were recorded for {self.num_experts} experts, the model has {num_experts}")

    # ---- editing ---------------------------------------------------------------------------
    def slice(self, begin: int, end: int) -> RoutingTrace:
        """Rows for absolute positions [begin, end); the result starts at `begin`."""
        if not (self.start <= begin <= end <= self.end):
            raise RouteError(f"slice [{begin}, {end}) is outside the trace's positions "
                             f"[{self.start}, {self.end})")
        return RoutingTrace(self.ids_NLK[begin - self.start:end - self.start], self.num_experts, begin)

    def extend(self, continuation: RoutingTrace, sample: int | None = None) -> RoutingTrace:
        """Append the trace of a later turn. The continuation must start exactly where this
        trace ends (its `routed_experts_start_len` == this trace's end): a gap or an overlap
        would double count or drop routes, so it is an error."""
        who = _who(sample)
        if continuation.start != self.end:
            kind = "overlaps" if continuation.start < self.end else "leaves a gap after"
            raise RouteError(
                f"{who}: continuation starts at position {continuation.start} but the trace "
                f"covers [{self.start}, {self.end}); it {kind} the trace (request the next turn "
                f"with routed_experts_start_len={self.end})")
        for name in ("num_layers", "top_k", "num_experts"):
            a, b = getattr(self, name), getattr(continuation, name)
            if a != b:
                raise RouteError(f"{who}: continuation has {name}={b}, the trace has {a}")
        ids = torch.cat([self.ids_NLK, continuation.ids_NLK], dim=0)
        out = RoutingTrace.__new__(RoutingTrace)  # both parts already validated
        out.ids_NLK, out.num_experts, out.start = ids, self.num_experts, self.start
        return out


def concat_traces(traces: Sequence[RoutingTrace], sample: int | None = None) -> RoutingTrace:
    """Join the traces of consecutive turns (each starting where the previous ends)."""
    if not traces:
        raise RouteError(f"{_who(sample)}: nothing to concatenate")
    out = traces[0]
    for t in traces[1:]:
        out = out.extend(t, sample=sample)
    return out


def _check_alike(traces: Sequence[RoutingTrace]) -> tuple[int, int, int]:
    if not traces:
        raise RouteError("need at least one RoutingTrace")
    first = traces[0]
    for i, t in enumerate(traces):
        if not isinstance(t, RoutingTrace):
            raise RouteError(f"sample {i}: expected a RoutingTrace, got {type(t).__name__}")
        for name in ("num_layers", "top_k", "num_experts"):
            if getattr(t, name) != getattr(first, name):
                raise RouteError(f"sample {i}: routes have {name}={getattr(t, name)}, "
                                 f"sample 0 has {getattr(first, name)}")
    return first.num_layers, first.top_k, first.num_experts


MISSING = ("refuse", "live")
"""`replay.missing`: what `batch_traces` does with a row that has no route."""


def batch_traces(traces: Sequence[RoutingTrace], T: int,
                 seq_lens: Sequence[int] | None = None,
                 missing: str = "refuse") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad complete traces into (ids_BTLK compact dtype, valid_BT bool).

    Row t of sample b is the token at absolute position t, matching a right-padded token batch
    of length T. Positions with no route (the last token of each sample, padding) are invalid
    and hold id 0. With `seq_lens` (tokens per sample, P+R), each trace must have seq_len-1 rows.
    A missing row (module doc) is refused (`missing="refuse"`, RouteError naming the sample and
    position) or, under `"live"`, invalid too and id 0: the live router routes that token.
    """
    if missing not in MISSING:
        raise RouteError(f"missing={missing!r}; valid: {list(MISSING)}")
    L, K, E = _check_alike(traces)
    if seq_lens is not None and len(seq_lens) != len(traces):
        raise RouteError(f"got {len(seq_lens)} seq_lens for {len(traces)} traces")
    ids_BTLK = torch.zeros(len(traces), T, L, K, dtype=compact_dtype(E))
    valid_BT = torch.zeros(len(traces), T, dtype=torch.bool)
    for b, t in enumerate(traces):
        if t.start != 0:
            raise RouteError(f"sample {b}: trace starts at position {t.start}; batching needs a "
                             f"complete trace from position 0 (concatenate the earlier turns)")
        if t.num_rows > T:
            raise RouteError(f"sample {b}: routes have {t.num_rows} rows, more than the batch length {T}")
        if seq_lens is not None and t.num_rows != seq_lens[b] - 1:
            raise RouteError(f"sample {b}: routes have {t.num_rows} rows, expected "
                             f"{seq_lens[b] - 1} = sequence length {seq_lens[b]} - 1")
        ids_BTLK[b, :t.num_rows] = t.ids_NLK
        valid_BT[b, :t.num_rows] = True
        miss_N = t.missing_rows()
        if miss_N is not None:
            if missing == "refuse":
                n = int(miss_N.nonzero()[0])
                raise RouteError(
                    f"sample {b}: routes row {n} (position) has no route (the engine sent -1: "
                    f"{int(miss_N.sum())} of its {t.num_rows} rows); replay.missing=live routes "
                    f"such rows with the actor's live router (logged as "
                    f"replay/fallback_fraction)")
            rows = miss_N.nonzero()[:, 0]
            ids_BTLK[b, rows] = 0
            valid_BT[b, rows] = False
    return ids_BTLK, valid_BT


def save_traces(path: str | Path, traces: Sequence[RoutingTrace],
                metadata: dict[str, str] | None = None) -> None:
    """Write traces to one safetensors file: rows of all traces concatenated in their compact
    dtype, plus int64 row offsets and starts. `metadata` (str -> str) is stored alongside."""
    L, K, E = _check_alike(traces)
    lengths = torch.tensor([t.num_rows for t in traces], dtype=torch.int64)
    offsets = torch.zeros(len(traces) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    tensors = {
        "ids": torch.cat([t.ids_NLK for t in traces], dim=0).contiguous(),
        "offsets": offsets,
        "starts": torch.tensor([t.start for t in traces], dtype=torch.int64),
    }
    meta = {"format": TRACE_FILE_FORMAT, "num_experts": str(E), "num_layers": str(L),
            "top_k": str(K), "num_traces": str(len(traces))}
    user = dict(metadata or {})
    for k, v in user.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise RouteError(f"metadata must map str to str, got {k!r}: {v!r}")
    meta["user"] = json.dumps(user, sort_keys=True)
    save_file(tensors, str(path), metadata=meta)


def load_traces(path: str | Path) -> tuple[list[RoutingTrace], dict[str, str]]:
    """Read a file written by `save_traces`: (traces, user metadata). Every trace is
    re-validated, so a corrupted or foreign file fails with a named error."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != TRACE_FILE_FORMAT:
        raise RouteError(f"{path}: not a routing-trace file (format={meta.get('format')!r}, "
                         f"expected {TRACE_FILE_FORMAT!r})")
    tensors = load_file(str(path))
    missing = {"ids", "offsets", "starts"} - tensors.keys()
    if missing:
        raise RouteError(f"{path}: missing tensors {sorted(missing)}")
    E, L, K, n = (int(meta[k]) for k in ("num_experts", "num_layers", "top_k", "num_traces"))
    ids, offsets, starts = tensors["ids"], tensors["offsets"], tensors["starts"]
    if ids.dtype != compact_dtype(E) or tuple(ids.shape[1:]) != (L, K):
        raise RouteError(f"{path}: ids have dtype {ids.dtype} shape {tuple(ids.shape)}, expected "
                         f"{compact_dtype(E)} [*, {L}, {K}]")
    if offsets.shape != (n + 1,) or starts.shape != (n,) or int(offsets[0]) != 0 \
            or int(offsets[-1]) != ids.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
        raise RouteError(f"{path}: offsets/starts do not describe {n} traces over {ids.shape[0]} rows")
    traces = [RoutingTrace(ids[int(offsets[i]):int(offsets[i + 1])], E, int(starts[i]), sample=i)
              for i in range(n)]
    return traces, json.loads(meta.get("user", "{}"))
