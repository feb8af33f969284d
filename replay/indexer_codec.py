"""Indexer picks on the wire (docs/replay.md "Indexer replay").

SGLang 0.5.23's own fields (server flag `--enable-return-indexer-topk`; capture is wired for
CUDA / NPU only): request `return_indexer_topk: true` (`INDEXER_REQUEST_FIELD`), answer
`meta_info.indexer_topk`, base64 of little-endian int32 [prompt + completion - 1,
num_hidden_layers, index_topk] of request-local key positions, -1 where a row has fewer than
index_topk keys. Its layer axis is every decoder layer (GLM-5's shared layers mirror the full
layer they reuse); ours inside is the indexer layers only, as routes keep MoE layers only.
vLLM's open PR returns the same array as `choices[].indexer_topk`. Our extensions (a real
SGLang ignores them and sends every row in int32):

- `lockstep_indexer_topk_start_len` (`INDEXER_START_FIELD`; vLLM's `indexer_topk_prompt_start`):
  the first position returned, for a later turn that has the earlier rows already.
- `lockstep_indexer_topk_encoding: "compact"` (`INDEXER_ENCODING_FIELD`), instead of "int32"
  (4 bytes per pick: at DeepSeek-V3.2's shape, 61 layers x 2048, 500 KB per token):
  a row at position p < index_topk picks every key 0..p, so nothing is sent for it; every
  other row is sent either as the gaps between its ascending positions in LEB128 varints
  ("delta": a byte per pick while gaps stay below 128) or as bitmaps over its p + 1 causal
  keys ((p + 1) / 8 bytes per layer), whichever is smaller for that row (one flag bit each).
  Header: magic, version, rows, layers, top-k, start, the bitmaps' bytes.

Decoding validates (replay/indexer.py IndexerTrace): a wrong row count, layer count or
position is an error naming the sample.
"""

from __future__ import annotations

import base64
import binascii
import struct

import numpy as np
import torch

from ..kernels.routes import RouteError
from .indexer import IndexerTrace

INDEXER_REQUEST_FIELD = "return_indexer_topk"
INDEXER_START_FIELD = "lockstep_indexer_topk_start_len"
INDEXER_ENCODING_FIELD = "lockstep_indexer_topk_encoding"
INDEXER_META_FIELD = "indexer_topk"
ENCODINGS = ("int32", "compact")
_MAGIC = b"LSIX"
_HEADER = struct.Struct("<4sBIHIIQ")  # magic, version, rows, layers, top-k, start, bitmap bytes


def _who(sample: int | None) -> str:
    return "indexer_topk" if sample is None else f"sample {sample}: indexer_topk"


def _b64(payload, sample: int | None) -> bytes:
    if not isinstance(payload, (str, bytes)):
        raise RouteError(f"{_who(sample)}: expected a base64 string, got "
                         f"{type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RouteError(f"{_who(sample)}: not valid base64 ({e})") from None


def wire_layer_sources(indexer_shared: list[bool]) -> list[int]:
    """Per decoder layer, the indexer layer whose pick it uses (its own, or for a shared layer
    the previous full one's): how the wire's layer axis maps onto ours."""
    out, last = [], -1
    for shared in indexer_shared:
        last += not shared
        out.append(last)
    return out


def indexer_encoding(payload) -> str:
    """"compact" or "int32": which encoding a payload is in (from its first bytes)."""
    head = payload[:8] if isinstance(payload, (str, bytes)) else b""
    try:
        return "compact" if base64.b64decode(head)[:4] == _MAGIC else "int32"
    except (binascii.Error, ValueError):
        return "int32"


def int32_rows(payload, num_hidden_layers: int, top_k: int) -> int:
    """Rows an int32 payload holds (from its base64 length)."""
    n = len(payload)
    pad = payload[-2:].count("=" if isinstance(payload, str) else b"=") if n else 0
    return (n * 3 // 4 - pad) // (num_hidden_layers * top_k * 4)


def encode_indexer(trace: IndexerTrace, encoding: str, sources: list[int]) -> str:
    """`sources`: wire_layer_sources of the model (the int32 layout's layer axis)."""
    if encoding == "int32":
        wire = trace.to_int64()[:, sources]
        return base64.b64encode(wire.numpy().astype("<i4").tobytes()).decode()
    if encoding == "compact":
        return base64.b64encode(encode_compact_bytes(trace)).decode()
    raise RouteError(f"unknown indexer_topk encoding {encoding!r}; valid: {list(ENCODINGS)}")


def decode_indexer(payload, rows: int, sources: list[int], top_k: int, start: int = 0,
                   sample: int | None = None) -> IndexerTrace:
    """Either encoding (told apart by the compact header's magic) -> IndexerTrace over the
    indexer layers. In the int32 layout a shared layer must repeat the pick of the layer it
    reuses (a server that says otherwise ran another model)."""
    raw = _b64(payload, sample)
    num_layers = max(sources) + 1
    if raw[:4] == _MAGIC:
        return decode_compact_bytes(raw, rows, num_layers, top_k, start, sample)
    want = rows * len(sources) * top_k * 4
    if len(raw) != want:
        raise RouteError(f"{_who(sample)}: {len(raw)} bytes, expected {want} = {rows} rows x "
                         f"{len(sources)} decoder layers x index_topk {top_k} x 4 (int32)")
    arr = torch.from_numpy(np.frombuffer(raw, dtype="<i4").reshape(rows, len(sources), top_k)
                           .astype(np.int32))
    own = [sources.index(l) for l in range(num_layers)]
    mirrored = arr[:, own][:, sources]
    if not torch.equal(mirrored, arr):
        j = int((mirrored != arr).any(0).any(-1).nonzero()[0])
        raise RouteError(f"{_who(sample)}: decoder layer {j} reuses indexer layer "
                         f"{sources[j]}'s pick but holds other positions")
    return IndexerTrace(arr[:, own], start, sample)


# -- the compact body -------------------------------------------------------------------------
def _leb128(values: np.ndarray) -> bytes:
    """Unsigned LEB128 varints of non-negative int64 `values`, vectorised."""
    v = values.astype(np.uint64)
    n = np.ones(v.shape, dtype=np.int64)
    for b in range(1, 10):
        n += v >= (np.uint64(1) << np.uint64(7 * b))
    offs = np.cumsum(n) - n
    out = np.zeros(int(n.sum()), dtype=np.uint8)
    for b in range(int(n.max()) if n.size else 0):
        sel = n > b
        byte = (v[sel] >> np.uint64(7 * b)) & np.uint64(0x7F)
        more = (n[sel] > b + 1).astype(np.uint64) << np.uint64(7)
        out[offs[sel] + b] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _unleb128(body: np.ndarray, count: int, who: str) -> np.ndarray:
    ends = (body & 0x80) == 0
    if int(ends.sum()) != count or (body.size and not ends[-1]):
        raise RouteError(f"{who}: the delta body holds {int(ends.sum())} values, expected "
                         f"{count}")
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.nonzero(ends)[0][:-1] + 1])
    value_of = np.cumsum(ends) - ends
    shift = (np.arange(body.size) - starts[value_of]) * 7
    if shift.max() > 56:
        raise RouteError(f"{who}: a varint longer than 9 bytes")
    contrib = (body & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    return np.add.reduceat(contrib, starts).astype(np.int64)


def leb128_sizes(values: np.ndarray) -> np.ndarray:
    n = np.ones(values.shape, dtype=np.int64)
    for b in range(1, 10):
        n += values >= (1 << (7 * b))
    return n


def compact_bodies(trace: IndexerTrace) -> tuple[np.ndarray, bytes, bytes]:
    """(per chosen row: True where it goes as a bitmap, the bitmaps, the delta varints)."""
    K, L = trace.top_k, trace.num_layers
    pos = np.arange(trace.start, trace.end)
    chosen = pos + 1 > K                                 # rows with a real choice
    picks = trace.to_int64().numpy()[chosen]             # [n, L, K], all valid
    gaps = np.diff(picks, axis=-1, prepend=-1) - 1       # >= 0 (ascending, distinct)
    delta_size = leb128_sizes(gaps).sum((1, 2))
    as_bitmap = (pos[chosen] + 1 + 7) // 8 * L < delta_size
    bitmap = b"".join(np.packbits(_row_bits(p_LK, p + 1), axis=-1).tobytes()
                      for p_LK, p in zip(picks[as_bitmap], pos[chosen][as_bitmap]))
    return as_bitmap, bitmap, _leb128(gaps[~as_bitmap].reshape(-1))


def encode_compact_bytes(trace: IndexerTrace) -> bytes:
    """Header, one flag bit per row with a choice (1: bitmap), the bitmap rows, the delta
    rows' varints."""
    N, L, K = trace.picks_NLK.shape
    as_bitmap, bitmap, delta = compact_bodies(trace)
    return (_HEADER.pack(_MAGIC, 1, N, L, K, trace.start, len(bitmap))
            + np.packbits(as_bitmap.astype(np.uint8)).tobytes() + bitmap + delta)


def _row_bits(picks_LK: np.ndarray, width: int) -> np.ndarray:
    bits = np.zeros((picks_LK.shape[0], width), dtype=np.uint8)
    np.put_along_axis(bits, picks_LK, 1, axis=-1)
    return bits


def decode_compact_bytes(raw: bytes, rows: int, num_layers: int, top_k: int, start: int,
                         sample: int | None = None) -> IndexerTrace:
    who = _who(sample)
    if len(raw) < _HEADER.size:
        raise RouteError(f"{who}: {len(raw)} bytes, shorter than the compact header")
    magic, version, N, L, K, s, n_bitmap = _HEADER.unpack_from(raw)
    if version != 1:
        raise RouteError(f"{who}: compact version {version} is not known")
    if (N, L, K, s) != (rows, num_layers, top_k, start):
        raise RouteError(f"{who}: compact payload holds {N} rows x {L} layers x {K} from "
                         f"position {s}, expected {rows} x {num_layers} x {top_k} from {start}")
    pos = np.arange(start, start + N)
    chosen = pos + 1 > K
    n = int(chosen.sum())
    flags_end = _HEADER.size + (n + 7) // 8
    body = np.frombuffer(raw, dtype=np.uint8, offset=0)
    as_bitmap = np.unpackbits(body[_HEADER.size:flags_end])[:n].astype(bool)
    out = np.full((N, L, K), -1, dtype=np.int64)
    for i in np.nonzero(~chosen)[0]:                      # implicit: every causal key
        out[i, :, :pos[i] + 1] = np.arange(pos[i] + 1)
    rows_chosen = np.nonzero(chosen)[0]
    widths = (pos[rows_chosen[as_bitmap]] + 1 + 7) // 8
    if int(widths.sum()) * L != n_bitmap or flags_end + n_bitmap > body.size:
        raise RouteError(f"{who}: the bitmap rows need {int(widths.sum()) * L} bytes, the "
                         f"payload says {n_bitmap}")
    off = flags_end
    for i, w in zip(rows_chosen[as_bitmap], widths):
        bits = np.unpackbits(body[off:off + w * L].reshape(L, w), axis=-1)[:, :pos[i] + 1]
        off += w * L
        idx = [np.nonzero(b)[0] for b in bits]
        if any(len(x) != K for x in idx):
            raise RouteError(f"{who}: position {pos[i]}'s bitmap does not hold {K} keys")
        out[i] = np.stack(idx)
    n_delta = int((~as_bitmap).sum())
    gaps = _unleb128(body[off:], n_delta * L * K, who).reshape(n_delta, L, K)
    out[rows_chosen[~as_bitmap]] = np.cumsum(gaps + 1, axis=-1) - 1
    return IndexerTrace(torch.from_numpy(out), start, sample)


def wire_bytes(trace: IndexerTrace, encoding: str, num_hidden_layers: int | None = None) -> int:
    """Bytes of the decoded payload (before base64) in `encoding` (int32: over
    `num_hidden_layers`, default the trace's layers)."""
    if encoding == "int32":
        return trace.num_rows * (num_hidden_layers or trace.num_layers) * trace.top_k * 4
    return len(encode_compact_bytes(trace))
