"""Wire codecs for routes: SGLang's base64 int32, and lockstep's opt-in compact encoding.

SGLang (`meta_info.routed_experts`): base64 of little-endian int32 with shape
[prompt + completion - 1 - start_len, num_hidden_layers, K]. Its layer axis is EVERY decoder
layer; a dense layer's rows are zeros. Internally we keep MoE layers only, so the codec drops
(decode) or zero-fills (encode) the dense layers given the model's `moe_layer_ids`.

Compact (lockstep, opt-in): a client sets the top-level request field
`lockstep_routed_experts_encoding: "compact"` (SGLang ignores unknown top-level keys and keeps
sending int32). The payload is base64 of a 24-byte little-endian header followed by the ids,
MoE layers only, as uint8 (num_experts <= 256) or uint16, row-major [rows, L, K]:

    offset size field
    0      4    magic b"LSRT"
    4      1    version (1)
    5      1    bytes per id (1 or 2)
    6      2    num_layers L (MoE layers)   uint16
    8      2    top_k K                     uint16
    10     2    reserved (0)                uint16
    12     4    num_experts E               uint32
    16     4    start (routed_experts_start_len) uint32
    20     4    rows                        uint32

An SGLang int32 payload can never start with the magic (its first id < 2**16 makes bytes
2-3 zero), so `decode_routes` tells the two apart and a client falls back to int32 by itself.
Shapes: N rows, H decoder layers (num_hidden_layers), L MoE layers, K top-k.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence

import numpy as np
import torch

from .trace import RouteError, RoutingTrace, compact_dtype

ENCODING_REQUEST_FIELD = "lockstep_routed_experts_encoding"
"""Top-level /generate request key a lockstep client sets to ask for the compact encoding."""
ENCODING_INT32 = "int32"
ENCODING_COMPACT = "compact"
ENCODINGS = (ENCODING_INT32, ENCODING_COMPACT)

COMPACT_MAGIC = b"LSRT"
COMPACT_VERSION = 1
_HEADER = struct.Struct("<4sBBHHHIII")
COMPACT_HEADER_BYTES = _HEADER.size  # 24


def _who(sample: int | None) -> str:
    return "routes" if sample is None else f"sample {sample}: routes"


def _b64decode(payload: str | bytes, sample: int | None) -> bytes:
    if not isinstance(payload, (str, bytes)):
        raise RouteError(f"{_who(sample)} payload must be a base64 string, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RouteError(f"{_who(sample)} payload is not valid base64: {e}") from None


def _check_layer_map(num_hidden_layers: int, moe_layer_ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in moe_layer_ids]
    if not ids or sorted(set(ids)) != ids or ids[0] < 0 or ids[-1] >= num_hidden_layers:
        raise RouteError(f"moe_layer_ids {list(moe_layer_ids)} must be strictly increasing, "
                         f"non-empty and inside [0, num_hidden_layers={num_hidden_layers})")
    return ids


# ---- SGLang int32 -------------------------------------------------------------------------
def decode_sglang(payload: str | bytes, num_tokens_expected: int, num_hidden_layers: int,
                  moe_layer_ids: Sequence[int], top_k: int, num_experts: int,
                  sample: int | None = None, start_len: int = 0,
                  check_dense_rows: bool = True) -> RoutingTrace:
    """SGLang `routed_experts` -> RoutingTrace (MoE layers only, starting at `start_len`).

    `num_tokens_expected`: rows the payload must hold, prompt_tokens + completion_tokens - 1 -
    start_len. Errors (RouteError naming the sample): invalid base64, byte length not a
    multiple of 4*num_hidden_layers*top_k, wrong row count, a non-zero id in a dense layer (a
    sign that the server's model has another layer layout than ours; `check_dense_rows=False`
    skips it), ids out of [0, num_experts) or repeated within a row.
    """
    return _decode_sglang_raw(_b64decode(payload, sample), num_tokens_expected, num_hidden_layers,
                              moe_layer_ids, top_k, num_experts, sample, start_len, check_dense_rows)


def _decode_sglang_raw(raw: bytes, num_tokens_expected: int, num_hidden_layers: int,
                       moe_layer_ids: Sequence[int], top_k: int, num_experts: int,
                       sample: int | None, start_len: int, check_dense_rows: bool) -> RoutingTrace:
    layers = _check_layer_map(num_hidden_layers, moe_layer_ids)
    if top_k < 1:
        raise RouteError(f"top_k must be >= 1, got {top_k}")
    row_bytes = 4 * num_hidden_layers * top_k
    if len(raw) % row_bytes:
        raise RouteError(
            f"{_who(sample)}: {len(raw)} bytes is not a multiple of 4 bytes x {num_hidden_layers} "
            f"layers x top_k {top_k} = {row_bytes} (wrong num_hidden_layers/top_k, or truncated)")
    rows = len(raw) // row_bytes
    if rows != num_tokens_expected:
        raise RouteError(
            f"{_who(sample)}: payload has {rows} rows, expected {num_tokens_expected} "
            f"(prompt + completion - 1 - start_len {start_len})")
    ids_NHK = np.frombuffer(raw, dtype="<i4").reshape(rows, num_hidden_layers, top_k)
    if check_dense_rows:
        moe = set(layers)
        dense = [h for h in range(num_hidden_layers) if h not in moe]
        if dense:
            nz_NDK = ids_NHK[:, dense] != 0
            if nz_NDK.any():
                n, d, k = (int(v) for v in np.argwhere(nz_NDK)[0])
                raise RouteError(
                    f"{_who(sample)} row {n + start_len} (position), decoder layer {dense[d]} is "
                    f"dense in our config but has expert id {int(ids_NHK[n, dense[d], k])}; the "
                    f"server's model has another layer layout (moe_layer_ids={layers})")
    ids_NLK = torch.from_numpy(ids_NHK[:, layers].astype(np.int64))
    return RoutingTrace(ids_NLK, num_experts, start=start_len, sample=sample)


def encode_sglang(trace: RoutingTrace, num_hidden_layers: int,
                  moe_layer_ids: Sequence[int]) -> str:
    """RoutingTrace -> SGLang's base64 int32 [rows, num_hidden_layers, K], dense layers zero."""
    layers = _check_layer_map(num_hidden_layers, moe_layer_ids)
    if len(layers) != trace.num_layers:
        raise RouteError(f"trace has {trace.num_layers} MoE layers, moe_layer_ids lists {len(layers)}")
    out_NHK = np.zeros((trace.num_rows, num_hidden_layers, trace.top_k), dtype="<i4")
    out_NHK[:, layers] = trace.ids_NLK.numpy()
    return base64.b64encode(out_NHK.tobytes()).decode("ascii")


# ---- compact ------------------------------------------------------------------------------
def encode_compact(trace: RoutingTrace) -> str:
    """RoutingTrace -> base64(header + uint8/uint16 little-endian ids), MoE layers only."""
    itemsize = trace.ids_NLK.element_size()
    header = _HEADER.pack(COMPACT_MAGIC, COMPACT_VERSION, itemsize, trace.num_layers,
                          trace.top_k, 0, trace.num_experts, trace.start, trace.num_rows)
    body = trace.ids_NLK.numpy().astype("<u1" if itemsize == 1 else "<u2", copy=False).tobytes()
    return base64.b64encode(header + body).decode("ascii")


def _decode_compact_raw(raw: bytes, num_tokens_expected: int, num_layers: int, top_k: int,
                        num_experts: int, sample: int | None, start_len: int) -> RoutingTrace:
    who = _who(sample)
    if len(raw) < COMPACT_HEADER_BYTES or raw[:4] != COMPACT_MAGIC:
        raise RouteError(f"{who}: compact payload must start with the {COMPACT_HEADER_BYTES}-byte "
                         f"header beginning {COMPACT_MAGIC!r}, got {raw[:4]!r} ({len(raw)} bytes)")
    _, version, itemsize, L, K, _, E, start, rows = _HEADER.unpack_from(raw)
    if version != COMPACT_VERSION:
        raise RouteError(f"{who}: compact version {version}, this reader knows {COMPACT_VERSION}")
    expected_itemsize = torch.empty(0, dtype=compact_dtype(num_experts)).element_size()
    got = {"num_layers": L, "top_k": K, "num_experts": E, "start_len": start, "rows": rows,
           "bytes per id": itemsize}
    want = {"num_layers": num_layers, "top_k": top_k, "num_experts": num_experts,
            "start_len": start_len, "rows": num_tokens_expected, "bytes per id": expected_itemsize}
    for name in got:
        if got[name] != want[name]:
            raise RouteError(f"{who}: compact header says {name}={got[name]}, expected {want[name]}")
    body = raw[COMPACT_HEADER_BYTES:]
    if len(body) != rows * L * K * itemsize:
        raise RouteError(f"{who}: compact body has {len(body)} bytes, header implies "
                         f"{rows}x{L}x{K}x{itemsize} = {rows * L * K * itemsize}")
    ids = np.frombuffer(body, dtype="<u1" if itemsize == 1 else "<u2").reshape(rows, L, K)
    return RoutingTrace(torch.from_numpy(ids.astype(np.int64)), num_experts, start=start_len,
                        sample=sample)


def decode_compact(payload: str | bytes, num_tokens_expected: int, num_layers: int, top_k: int,
                   num_experts: int, sample: int | None = None, start_len: int = 0) -> RoutingTrace:
    """Compact payload -> RoutingTrace; every header field is checked against the caller's
    expectation (`num_layers` = MoE layers)."""
    return _decode_compact_raw(_b64decode(payload, sample), num_tokens_expected, num_layers,
                               top_k, num_experts, sample, start_len)


def decode_routes(payload: str | bytes, num_tokens_expected: int, num_hidden_layers: int,
                  moe_layer_ids: Sequence[int], top_k: int, num_experts: int,
                  sample: int | None = None, start_len: int = 0) -> RoutingTrace:
    """Decode either encoding: compact when the payload starts with the compact magic, else
    SGLang int32. What a client uses, since a real SGLang server ignores the compact request."""
    raw = _b64decode(payload, sample)
    if raw[:4] == COMPACT_MAGIC:
        layers = _check_layer_map(num_hidden_layers, moe_layer_ids)
        return _decode_compact_raw(raw, num_tokens_expected, len(layers), top_k, num_experts,
                                   sample, start_len)
    return _decode_sglang_raw(raw, num_tokens_expected, num_hidden_layers, moe_layer_ids, top_k,
                              num_experts, sample, start_len, check_dense_rows=True)


def encode_routes(trace: RoutingTrace, encoding: str, num_hidden_layers: int,
                  moe_layer_ids: Sequence[int]) -> str:
    """Server side: encode in the encoding a request asked for (`int32` unless `compact`)."""
    if encoding == ENCODING_COMPACT:
        _check_layer_map(num_hidden_layers, moe_layer_ids)
        return encode_compact(trace)
    if encoding == ENCODING_INT32:
        return encode_sglang(trace, num_hidden_layers, moe_layer_ids)
    raise RouteError(f"unknown routes encoding {encoding!r}; valid: {list(ENCODINGS)}")


def wire_bytes_per_token(encoding: str, num_hidden_layers: int, num_moe_layers: int, top_k: int,
                         num_experts: int) -> int:
    """Decoded bytes per route row (base64 adds 4/3 to both alike; compact adds a 24-byte
    header per sample)."""
    if encoding == ENCODING_INT32:
        return 4 * num_hidden_layers * top_k
    if encoding == ENCODING_COMPACT:
        return torch.empty(0, dtype=compact_dtype(num_experts)).element_size() * num_moe_layers * top_k
    raise RouteError(f"unknown routes encoding {encoding!r}; valid: {list(ENCODINGS)}")
