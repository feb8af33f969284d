"""IndexerTrace: the key positions a sample's tokens attended to in each lightning-indexer layer
of a DSA model (DeepSeek-V3.2, GLM-5), stored compactly, stitched across turns like routes;
and the indexer flip rate (how often the trainer's own indexer picks other keys).

Contract (the routes' contract, replay/trace.py): row i is the token at absolute position
`start + i` of prompt+response; a complete sample of P + R tokens has P + R - 1 rows (the last
sampled token never went through the model). The layer axis is the model's indexer layers in
decoder order (GLM-5's shared layers have no rows: they reuse the previous full layer's pick).
A row at position p holds the request-local key positions its query attended to, ascending,
distinct, within [0, p], exactly min(p + 1, index_topk) of them, then -1 up to index_topk.
Storage is int16 when every position fits (< 32768), else int32.

Shapes: N rows, L indexer layers, K index_topk, B batch, T padded time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels.routes import RouteError

NO_KEY = -1


def _who(sample: int | None) -> str:
    return "indexer picks" if sample is None else f"sample {sample}: indexer picks"


def picks_dtype(end: int) -> torch.dtype:
    """int16 when positions < `end` fit in it, else int32."""
    return torch.int16 if end <= 32767 else torch.int32


def validate_picks(picks_NLK: torch.Tensor, start: int, sample: int | None = None) -> None:
    """Raise RouteError naming sample, position and layer for the first row that breaks the
    contract (module docstring)."""
    N, L, K = picks_NLK.shape
    if N == 0:
        return
    x = picks_NLK.to(torch.int64)
    pos_N = torch.arange(start, start + N)
    valid = x >= 0
    want_N = (pos_N + 1).clamp(max=K)
    ok = (valid.sum(-1) == want_N[:, None]) & (x <= pos_N[:, None, None]).all(-1) & \
        ((x == NO_KEY) | valid).all(-1)                                # [N, L]
    if K > 1:
        prefix = (valid[..., :-1] >= valid[..., 1:]).all(-1)           # -1 only at the end
        rising = ((x[..., 1:] > x[..., :-1]) | ~valid[..., 1:]).all(-1)
        ok &= prefix & rising
    if bool(ok.all()):
        return
    n, l = (int(v) for v in (~ok).nonzero()[0])
    raise RouteError(
        f"{_who(sample)} row {n} (position {start + n}), layer {l}: {x[n, l].tolist()} is not "
        f"{int(want_N[n])} ascending distinct positions in [0, {start + n}] padded with -1")


class IndexerTrace:
    """Indexer picks of one sample: `picks_NLK` [N, L, K] compact, row i = position start + i."""

    __slots__ = ("picks_NLK", "start")

    def __init__(self, picks_NLK, start: int = 0, sample: int | None = None):
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise RouteError(f"{_who(sample)}: start must be an int >= 0, got {start!r}")
        if not isinstance(picks_NLK, torch.Tensor):
            raise RouteError(f"{_who(sample)} must be a torch.Tensor, got "
                             f"{type(picks_NLK).__name__}")
        if picks_NLK.dtype.is_floating_point or picks_NLK.dtype == torch.bool or \
                picks_NLK.dim() != 3:
            raise RouteError(f"{_who(sample)} must be integers [rows, indexer layers, "
                             f"index_topk], got {picks_NLK.dtype} {tuple(picks_NLK.shape)}")
        picks = picks_NLK.detach().cpu()
        validate_picks(picks, start, sample)
        self.picks_NLK = picks.to(picks_dtype(start + picks.shape[0])).contiguous()
        self.start = start

    @property
    def num_rows(self) -> int:
        return self.picks_NLK.shape[0]

    @property
    def num_layers(self) -> int:
        return self.picks_NLK.shape[1]

    @property
    def top_k(self) -> int:
        return self.picks_NLK.shape[2]

    @property
    def end(self) -> int:
        return self.start + self.num_rows

    @property
    def nbytes(self) -> int:
        return self.picks_NLK.numel() * self.picks_NLK.element_size()

    def __len__(self) -> int:
        return self.num_rows

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IndexerTrace) and self.start == other.start and \
            torch.equal(self.picks_NLK.long(), other.picks_NLK.long())

    __hash__ = None

    def __repr__(self) -> str:
        return (f"IndexerTrace(rows={self.num_rows}, layers={self.num_layers}, "
                f"top_k={self.top_k}, start={self.start}, dtype={self.picks_NLK.dtype})")

    def to_int64(self) -> torch.Tensor:
        return self.picks_NLK.to(torch.int64)

    def check(self, prompt_len: int, response_len: int, num_layers: int, top_k: int,
              sample: int | None = None) -> None:
        """RouteError unless this trace covers positions [start, P+R-1) for a model with
        `num_layers` indexer layers of `top_k` picks."""
        who = _who(sample)
        expected = prompt_len + response_len - 1 - self.start
        if self.num_rows != expected:
            raise RouteError(f"{who} have {self.num_rows} rows starting at position "
                             f"{self.start}, expected {expected} = prompt {prompt_len} + "
                             f"response {response_len} - 1 - start {self.start}")
        if (self.num_layers, self.top_k) != (num_layers, top_k):
            raise RouteError(f"{who} have {self.num_layers} layers x {self.top_k} picks, the "
                             f"model has {num_layers} indexer layers x index_topk {top_k}")

    def slice(self, begin: int, end: int) -> IndexerTrace:
        if not (self.start <= begin <= end <= self.end):
            raise RouteError(f"slice [{begin}, {end}) is outside the trace's positions "
                             f"[{self.start}, {self.end})")
        return IndexerTrace(self.picks_NLK[begin - self.start:end - self.start], begin)

    def extend(self, continuation: IndexerTrace, sample: int | None = None) -> IndexerTrace:
        """Append a later turn's picks; it must start where this trace ends (as routes)."""
        if continuation.start != self.end:
            kind = "overlaps" if continuation.start < self.end else "leaves a gap after"
            raise RouteError(f"{_who(sample)}: continuation starts at position "
                             f"{continuation.start} but the trace covers [{self.start}, "
                             f"{self.end}); it {kind} the trace")
        if (continuation.num_layers, continuation.top_k) != (self.num_layers, self.top_k):
            raise RouteError(f"{_who(sample)}: continuation has {continuation.num_layers} x "
                             f"{continuation.top_k}, the trace {self.num_layers} x {self.top_k}")
        out = IndexerTrace.__new__(IndexerTrace)  # both validated; positions stay request-local
        dtype = picks_dtype(continuation.end)
        out.picks_NLK = torch.cat([self.picks_NLK.to(dtype), continuation.picks_NLK.to(dtype)])
        out.start = self.start
        return out


def concat_indexer_traces(traces: Sequence[IndexerTrace],
                          sample: int | None = None) -> IndexerTrace:
    if not traces:
        raise RouteError(f"{_who(sample)}: nothing to concatenate")
    out = traces[0]
    for t in traces[1:]:
        out = out.extend(t, sample=sample)
    return out


def batch_indexer_traces(traces: Sequence[IndexerTrace], T: int,
                         seq_lens: Sequence[int] | None = None):
    """Right-pad complete traces into (picks_BTLK int32, -1 at rows without picks; valid_BT)."""
    if not traces:
        raise RouteError("need at least one IndexerTrace")
    L, K = traces[0].num_layers, traces[0].top_k
    picks = torch.full((len(traces), T, L, K), NO_KEY, dtype=torch.int32)
    valid = torch.zeros(len(traces), T, dtype=torch.bool)
    for b, t in enumerate(traces):
        if (t.num_layers, t.top_k) != (L, K):
            raise RouteError(f"sample {b}: indexer picks are {t.num_layers} x {t.top_k}, "
                             f"sample 0's {L} x {K}")
        if t.start != 0:
            raise RouteError(f"sample {b}: indexer picks start at position {t.start}; batching "
                             f"needs them from position 0 (concatenate the earlier turns)")
        if t.num_rows > T or (seq_lens is not None and t.num_rows != seq_lens[b] - 1):
            raise RouteError(f"sample {b}: indexer picks have {t.num_rows} rows for a sequence "
                             f"of {seq_lens[b] if seq_lens else '?'} tokens (batch length {T})")
        picks[b, :t.num_rows] = t.picks_NLK.to(torch.int32)
        valid[b, :t.num_rows] = True
    return picks, valid


def picks_mask(picks_BTLK: torch.Tensor, M: int) -> torch.Tensor:
    """bool [B, T, L, M]: True at the picked positions (-1 picks nothing)."""
    x = picks_BTLK.long()
    out = torch.zeros(*x.shape[:-1], M + 1, dtype=torch.bool, device=x.device)
    return out.scatter_(-1, torch.where(x < 0, M, x), True)[..., :M]


def indexer_flip_rate(a_BTLK: torch.Tensor, b_BTLK: torch.Tensor,
                      valid_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """How often two forwards' indexers picked other keys, over the valid rows that had a
    choice (position >= index_topk: earlier rows pick every causal key). Returns fp32 tensors:
    `flip_rate` (mean over those (token, layer) pairs of the fraction of picked keys not in the
    other pick), `flip_rate_layers` [L] (the same per indexer layer), `token_any_flip` (tokens
    with a different pick in >= 1 layer) and `rows` (the (token, layer) pairs counted)."""
    B, T, L, K = a_BTLK.shape
    M = int(max(a_BTLK.max(), b_BTLK.max(), 0)) + 1
    ma, mb = picks_mask(a_BTLK, M), picks_mask(b_BTLK, M)
    choice_BT = valid_BT & (torch.arange(T, device=valid_BT.device) >= K)
    differ_BTL = (ma & ~mb).sum(-1).float() / K
    n = choice_BT.sum()
    w = choice_BT[..., None].float()
    per_layer = (differ_BTL * w).sum((0, 1)) / n.clamp(min=1)
    any_flip = ((differ_BTL > 0).any(-1) & choice_BT).sum().float() / n.clamp(min=1)
    return dict(flip_rate=per_layer.mean(), flip_rate_layers=per_layer,
                token_any_flip=any_flip, rows=n * L)
