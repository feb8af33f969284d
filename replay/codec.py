"""Wire codecs for routes: SGLang's base64 int32, vLLM's base64 `.npy`, and lockstep's opt-in
compact encoding.

SGLang (`meta_info.routed_experts`): base64 of little-endian int32 with shape
[prompt + completion - 1 - start_len, num_hidden_layers, K]. Its layer axis is EVERY decoder
layer; a dense layer's rows are zeros. Internally we keep MoE layers only, so the codec drops
(decode) or zero-fills (encode) the dense layers given the model's `moe_layer_ids`.

Compact (lockstep, opt-in): a client sets the top-level request field
`lockstep_routed_experts_encoding: "compact"` (SGLang ignores unknown top-level keys and keeps
sending int32). The payload is base64 of a 5-byte header followed by the ids of the MoE layers
only, row-major [rows, L, K], bit-packed at b = ceil(log2(num_experts)) bits per id (E=8 -> 3,
E=128 -> 7, E=256 -> 8) as one little-endian bitstream (id i = bits [i*b, (i+1)*b), zero pad):

    offset field
    0      magic 0x4C ('L')
    1      version (2)
    2      bits per id b (1..16; never 0)
    3      rows mod 256
    4      crc32(<III L, K, E) & 0xFF (layout check)

vLLM (0.32, `choices[i].routed_experts` of `/inference/v1/generate`): base64 of a `.npy` file,
uint8 (uint16 above 256 experts) [prompt + completion - 1 - routed_experts_prompt_start,
num_hidden_layers, K]; `decode_vllm` reads it without unpickling anything.

A row with no route (`RoutingTrace` "missing", replay.missing): SGLang int32 carries -1 in
every slot of the row (every decoder layer; a decoder accepts 0 in the dense layers too);
compact carries the all-ones code 2^b - 1 in every slot of the row, which no real route holds
(K >= 2 distinct ids are never all equal; under top-1 the code is past the last expert unless
num_experts = 2^b, where compact cannot mark a missing row: encoding one is refused, send
int32). Both decode back to the same missing rows.

Rows, L, K and E are not spelled out: the decoder already knows what to expect and checks the
body length ceil(rows*L*K*b/8), the low byte of rows and the layout byte against it. An SGLang
int32 payload never has a non-zero byte 2 (its first id is < 2**16), so `decode_routes` tells
the two apart and a client falls back to int32 by itself.
Shapes: N rows, H decoder layers (num_hidden_layers), L MoE layers, K top-k.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from .trace import RouteError, RoutingTrace, compact_dtype

ENCODING_REQUEST_FIELD = "lockstep_routed_experts_encoding"
"""Top-level /generate request key a lockstep client sets to ask for the compact encoding."""
ENCODING_INT32 = "int32"
ENCODING_COMPACT = "compact"
ENCODINGS = (ENCODING_INT32, ENCODING_COMPACT)

COMPACT_MAGIC = 0x4C  # b"L"
COMPACT_VERSION = 2  # 1 was the 24-byte-header uint8/uint16 format
_HEADER = struct.Struct("<BBBBB")  # magic, version, bits per id, rows & 0xFF, layout check
COMPACT_HEADER_BYTES = _HEADER.size  # 5


def _who(sample: int | None, what: str = "routes") -> str:
    return what if sample is None else f"sample {sample}: {what}"


def _b64decode(payload: str | bytes, sample: int | None, what: str = "routes") -> bytes:
    """The bytes of a base64 payload of `what` (routes, gate weights); RouteError naming the
    sample when it is not a string or not base64."""
    who = _who(sample, what)
    if not isinstance(payload, (str, bytes)):
        raise RouteError(f"{who} payload must be a base64 string, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RouteError(f"{who} payload is not valid base64: {e}") from None


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
            if nz_NDK.any():  # a missing row may hold -1 there too
                gone_N = (ids_NHK == -1).all((1, 2))
                nz_NDK &= ~gone_N[:, None, None]
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
    miss_N = trace.missing_rows()
    if miss_N is not None:
        out_NHK[miss_N.numpy()] = -1
    return base64.b64encode(out_NHK.tobytes()).decode("ascii")


# ---- vLLM .npy ----------------------------------------------------------------------------
def decode_vllm(payload: str | bytes, num_tokens_expected: int, num_hidden_layers: int,
                moe_layer_ids: Sequence[int], top_k: int, num_experts: int,
                sample: int | None = None, start_len: int = 0) -> RoutingTrace:
    """vLLM `routed_experts` (base64 `.npy`) -> RoutingTrace (MoE layers only, row 0 at
    `start_len`, vLLM's `routed_experts_prompt_start`). Errors (RouteError naming the sample):
    invalid base64, not a plain `.npy` of unsigned integers (object arrays are refused, never
    unpickled), a shape other than [num_tokens_expected, num_hidden_layers, top_k], ids out of
    [0, num_experts) or repeated within a row. The layer axis is every decoder layer, as on
    SGLang's wire; dense layers' rows are dropped."""
    layers = _check_layer_map(num_hidden_layers, moe_layer_ids)
    raw = _b64decode(payload, sample)
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise RouteError(f"{_who(sample)} payload is not a .npy array: {e}") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind != "u":
        raise RouteError(f"{_who(sample)}: vLLM sends unsigned integer ids, got "
                         f"{getattr(arr, 'dtype', type(arr).__name__)}")
    want = (num_tokens_expected, num_hidden_layers, top_k)
    if arr.shape != want:
        raise RouteError(f"{_who(sample)}: array of shape {list(arr.shape)}, expected "
                         f"{list(want)} (rows = prompt + completion - 1 - start {start_len}, "
                         f"num_hidden_layers, top_k)")
    ids_NLK = torch.from_numpy(np.ascontiguousarray(arr[:, layers]))
    if ids_NLK.dtype != compact_dtype(num_experts):  # kept without a copy when already compact
        ids_NLK = ids_NLK.to(torch.int64)
    return RoutingTrace(ids_NLK, num_experts, start=start_len, sample=sample)


# ---- compact ------------------------------------------------------------------------------
def compact_bits(num_experts: int) -> int:
    """Bits per id on the compact wire: ceil(log2(num_experts)), at least 1."""
    compact_dtype(num_experts)  # validates 1 <= num_experts <= MAX_EXPERTS
    return max(1, (num_experts - 1).bit_length())


def _layout_check(num_layers: int, top_k: int, num_experts: int) -> int:
    """One byte summarising (L, K, E): catches e.g. L and K swapped, which keep the body length."""
    return zlib.crc32(struct.pack("<III", num_layers, top_k, num_experts)) & 0xFF


def pack_bits(ids: np.ndarray, bits: int) -> bytes:
    """Non-negative ints < 2**bits (any shape, bits <= 16) -> little-endian bitstream: id i
    occupies bits [i*bits, (i+1)*bits), bit 0 = least significant bit of byte 0; zero padding."""
    v_n = np.asarray(ids).reshape(-1)
    n = v_n.size
    if n and (int(v_n.min()) < 0 or int(v_n.max()) >> bits):
        raise RouteError(f"pack_bits: ids must lie in [0, 2**{bits}), got "
                         f"[{int(v_n.min())}, {int(v_n.max())}]")
    if bits in (8, 16):
        return v_n.astype(np.uint8 if bits == 8 else "<u2").tobytes()
    nbytes = (n * bits + 7) // 8
    if bits < 8:
        # 8 ids fill exactly `bits` bytes: build each group as one little-endian uint64 word.
        v_G8 = np.zeros(-(-n // 8) * 8, dtype=np.uint8)
        v_G8[:n] = v_n
        v_G8 = v_G8.reshape(-1, 8)
        word_G = v_G8[:, 0].astype(np.uint64)
        for j in range(1, 8):  # casting one column at a time beats shifting a strided uint64 view
            word_G |= v_G8[:, j].astype(np.uint64) << np.uint64(j * bits)
        return word_G.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :bits].tobytes()[:nbytes]
    # 9..15 bits (E in 257..32768): spread every id over its bits, then repack.
    bits_nB = np.unpackbits(v_n.astype("<u2").view(np.uint8).reshape(-1, 2), axis=1,
                            bitorder="little")
    return np.packbits(bits_nB[:, :bits].reshape(-1), bitorder="little").tobytes()


def unpack_bits(body: bytes, count: int, bits: int) -> tuple[np.ndarray, bool]:
    """Inverse of `pack_bits` for a body of exactly ceil(count*bits/8) bytes: (`count` ids as
    int64, whether the padding bits after the last id are all zero)."""
    buf = np.frombuffer(body, dtype=np.uint8)
    if bits in (8, 16):
        return buf.view(np.uint8 if bits == 8 else "<u2").astype(np.int64), True
    used = count * bits
    pad_clean = used % 8 == 0 or not (int(buf[-1]) >> (used % 8))
    if bits < 8:
        groups = -(-count // 8)
        packed = np.zeros(groups * bits, dtype=np.uint8)
        packed[:buf.size] = buf
        bytes_G8 = np.zeros((groups, 8), dtype=np.uint8)
        bytes_G8[:, :bits] = packed.reshape(groups, bits)  # `bits` bytes hold 8 ids
        word_G = bytes_G8.view("<u8").reshape(groups)
        shift_8 = np.arange(8, dtype=np.uint64) * np.uint64(bits)
        ids_G8 = (word_G[:, None] >> shift_8) & np.uint64((1 << bits) - 1)
        return ids_G8.reshape(-1)[:count].astype(np.int64), pad_clean
    # 9..15 bits: an id starts at bit offset % 8 <= 7 and so lies within 3 bytes.
    padded = np.zeros(buf.size + 2, dtype=np.uint32)
    padded[:buf.size] = buf
    offset_n = np.arange(count, dtype=np.int64) * bits
    byte_n = offset_n >> 3
    word_n = padded[byte_n] | (padded[byte_n + 1] << 8) | (padded[byte_n + 2] << 16)
    ids_n = (word_n >> (offset_n & 7).astype(np.uint32)) & ((1 << bits) - 1)
    return ids_n.astype(np.int64), pad_clean


def encode_compact(trace: RoutingTrace) -> str:
    """RoutingTrace -> base64(5-byte header + bit-packed ids), MoE layers only, row-major."""
    bits = compact_bits(trace.num_experts)
    header = _HEADER.pack(COMPACT_MAGIC, COMPACT_VERSION, bits, trace.num_rows & 0xFF,
                          _layout_check(trace.num_layers, trace.top_k, trace.num_experts))
    ids_NLK = trace.ids_NLK.numpy()
    miss_N = trace.missing_rows()
    if miss_N is not None:
        code = _compact_missing_code(bits, trace.num_experts, trace.top_k)
        if code is None:
            n = int(miss_N.nonzero()[0])
            raise RouteError(f"routes row {n} has no route, which the compact encoding cannot "
                             f"mark for top-1 routes of {trace.num_experts} = 2^{bits} experts "
                             f"(every code is an expert id): use the int32 encoding")
        ids_NLK = ids_NLK.astype(np.int64)
        ids_NLK[miss_N.numpy()] = code
    return base64.b64encode(header + pack_bits(ids_NLK, bits)).decode("ascii")


def _compact_missing_code(bits: int, num_experts: int, top_k: int) -> int | None:
    """The compact code of a missing row's every slot (module doc), or None where it would be
    a real route."""
    code = (1 << bits) - 1
    return code if top_k > 1 or code >= num_experts else None


def _decode_compact_raw(raw: bytes, num_tokens_expected: int, num_layers: int, top_k: int,
                        num_experts: int, sample: int | None, start_len: int) -> RoutingTrace:
    who = _who(sample)
    if raw[:4] == b"LSRT":
        raise RouteError(f"{who}: compact version 1 payload (24-byte 'LSRT' header); this reader "
                         f"knows version {COMPACT_VERSION} (bit-packed): upgrade the server")
    if len(raw) < COMPACT_HEADER_BYTES or raw[0] != COMPACT_MAGIC:
        raise RouteError(f"{who}: compact payload must start with the {COMPACT_HEADER_BYTES}-byte "
                         f"header beginning {bytes([COMPACT_MAGIC])!r}, got {raw[:4]!r} "
                         f"({len(raw)} bytes; truncated?)")
    _, version, bits, rows_lo, layout = _HEADER.unpack_from(raw)
    if version != COMPACT_VERSION:
        raise RouteError(f"{who}: compact version {version}, this reader knows {COMPACT_VERSION}")
    want_bits = compact_bits(num_experts)
    if bits != want_bits:
        raise RouteError(f"{who}: compact header says {bits} bits per id, expected {want_bits} "
                         f"for num_experts={num_experts} (the server's model has another E)")
    want_layout = _layout_check(num_layers, top_k, num_experts)
    if layout != want_layout:
        raise RouteError(f"{who}: compact header layout check 0x{layout:02x} does not match "
                         f"num_layers={num_layers} (MoE), top_k={top_k}, num_experts={num_experts} "
                         f"(0x{want_layout:02x}); the server's model has another layout")
    if rows_lo != num_tokens_expected & 0xFF:
        raise RouteError(f"{who}: compact header says rows={rows_lo}, expected "
                         f"{num_tokens_expected} (the header holds rows mod 256; expected is "
                         f"prompt + completion - 1 - start_len {start_len})")
    count = num_tokens_expected * num_layers * top_k
    body = raw[COMPACT_HEADER_BYTES:]
    want_len = (count * bits + 7) // 8
    if len(body) != want_len:
        raise RouteError(f"{who}: compact body has {len(body)} bytes, expected "
                         f"ceil({num_tokens_expected} rows x {num_layers} layers x top_k {top_k} x "
                         f"{bits} bits / 8) = {want_len} (truncated, or wrong rows)")
    ids_n, clean_pad = unpack_bits(body, count, bits)
    if not clean_pad:
        raise RouteError(f"{who}: compact body has non-zero padding bits after id {count} "
                         f"(corrupt payload, or fewer rows than {num_tokens_expected})")
    ids_NLK = ids_n.reshape(num_tokens_expected, num_layers, top_k)
    code = _compact_missing_code(bits, num_experts, top_k)
    if code is not None and ids_NLK.size and int(ids_NLK.max()) == code:
        ids_NLK[(ids_NLK == code).all((1, 2))] = -1  # missing rows (module doc)
    return RoutingTrace(torch.from_numpy(ids_NLK), num_experts, start=start_len, sample=sample)


def decode_compact(payload: str | bytes, num_tokens_expected: int, num_layers: int, top_k: int,
                   num_experts: int, sample: int | None = None, start_len: int = 0) -> RoutingTrace:
    """Compact payload -> RoutingTrace (`num_layers` = MoE layers). Errors (RouteError naming
    the sample): bad base64 or header, a version, bits per id, layout byte or rows low byte
    other than the caller's model and `num_tokens_expected` imply, a body length other than
    ceil(rows*L*K*bits/8), non-zero padding bits, ids out of [0, num_experts) or repeated."""
    return _decode_compact_raw(_b64decode(payload, sample), num_tokens_expected, num_layers,
                               top_k, num_experts, sample, start_len)


def _is_compact(raw: bytes) -> bool:
    # int32: bytes 2-3 hold the high half of an id < 2**16, so they are zero.
    return len(raw) >= 3 and raw[0] == COMPACT_MAGIC and raw[2] != 0


def routes_encoding(payload: str | bytes) -> str:
    """`compact` or `int32`: which encoding a `routed_experts` payload uses (reads 6 bytes)."""
    try:
        head = base64.b64decode(payload[:8])
    except (binascii.Error, ValueError, TypeError):
        return ENCODING_INT32  # let decode_routes report the bad payload
    return ENCODING_COMPACT if _is_compact(head) else ENCODING_INT32


def decode_routes(payload: str | bytes, num_tokens_expected: int, num_hidden_layers: int,
                  moe_layer_ids: Sequence[int], top_k: int, num_experts: int,
                  sample: int | None = None, start_len: int = 0) -> RoutingTrace:
    """Decode either encoding: compact when the payload starts with the compact header, else
    SGLang int32. What a client uses, since a real SGLang server ignores the compact request."""
    raw = _b64decode(payload, sample)
    if _is_compact(raw):
        layers = _check_layer_map(num_hidden_layers, moe_layer_ids)
        return _decode_compact_raw(raw, num_tokens_expected, len(layers), top_k, num_experts,
                                   sample, start_len)
    return _decode_sglang_raw(raw, num_tokens_expected, num_hidden_layers, moe_layer_ids, top_k,
                              num_experts, sample, start_len, check_dense_rows=True)


def encode_routes(trace: RoutingTrace, encoding: str, num_hidden_layers: int,
                  moe_layer_ids: Sequence[int]) -> str:
    """Server side: encode in the encoding a request asked for (`int32` unless `compact`)."""
    if encoding == ENCODING_COMPACT:
        layers = _check_layer_map(num_hidden_layers, moe_layer_ids)
        if len(layers) != trace.num_layers:
            raise RouteError(f"trace has {trace.num_layers} MoE layers, moe_layer_ids lists "
                             f"{len(layers)}")
        return encode_compact(trace)
    if encoding == ENCODING_INT32:
        return encode_sglang(trace, num_hidden_layers, moe_layer_ids)
    raise RouteError(f"unknown routes encoding {encoding!r}; valid: {list(ENCODINGS)}")


def wire_bytes_per_token(encoding: str, num_hidden_layers: int, num_moe_layers: int, top_k: int,
                         num_experts: int) -> float:
    """Decoded bytes per route row (base64 adds 4/3 to both alike; compact adds a
    COMPACT_HEADER_BYTES header per sample and pads the last byte)."""
    if encoding == ENCODING_INT32:
        return float(4 * num_hidden_layers * top_k)
    if encoding == ENCODING_COMPACT:
        return compact_bits(num_experts) * num_moe_layers * top_k / 8
    raise RouteError(f"unknown routes encoding {encoding!r}; valid: {list(ENCODINGS)}")
