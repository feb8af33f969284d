"""Route wire codecs: SGLang base64 int32 (all decoder layers) and the compact encoding."""

import base64
import struct
import zlib

import numpy as np
import pytest
import torch

from lockstep.replay import (
    COMPACT_HEADER_BYTES,
    RouteError,
    RoutingTrace,
    decode_compact,
    decode_routes,
    decode_sglang,
    encode_compact,
    encode_routes,
    encode_sglang,
    wire_bytes_per_token,
)
from lockstep.replay.codec import compact_bits, pack_bits, routes_encoding, unpack_bits

# 5 decoder layers; layers 0 and 3 are dense (e.g. first_k_dense / mlp_only_layers)
H, MOE, K = 5, [1, 2, 4], 2


def make_ids(rows, L=3, K=K, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, L, E, generator=g).topk(K, dim=-1).indices


def manual_sglang_payload(ids_NLK, H=H, moe=MOE):
    """What SGLang sends, built by hand with struct: int32 LE, every decoder layer, dense rows 0."""
    rows, _, k = ids_NLK.shape
    values = []
    for n in range(rows):
        for h in range(H):
            for j in range(k):
                values.append(int(ids_NLK[n, moe.index(h), j]) if h in moe else 0)
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def test_decode_matches_manual_struct_encoding():
    ids = make_ids(6)
    trace = decode_sglang(manual_sglang_payload(ids), 6, H, MOE, K, 8, sample=0)
    assert torch.equal(trace.to_int64(), ids) and trace.ids_NLK.dtype == torch.uint8
    assert trace.start == 0


def test_encode_matches_manual_struct_and_numpy():
    ids = make_ids(4, E=300)
    trace = RoutingTrace(ids, 300)
    payload = encode_sglang(trace, H, MOE)
    assert payload == manual_sglang_payload(ids)
    raw = np.frombuffer(base64.b64decode(payload), dtype="<i4").reshape(4, H, K)
    assert raw.shape == (4, H, K)  # exactly SGLang's [rows, num_hidden_layers, K]
    assert (raw[:, [0, 3]] == 0).all() and (raw[:, MOE] == ids.numpy()).all()
    assert decode_sglang(payload, 4, H, MOE, K, 300) == trace


def test_roundtrip_with_start_len_and_uint16():
    ids = make_ids(7, E=1000)
    trace = RoutingTrace(ids, 1000, start=11)
    back = decode_sglang(encode_sglang(trace, H, MOE), 7, H, MOE, K, 1000, start_len=11)
    assert back == trace and back.ids_NLK.dtype == torch.uint16


def test_all_moe_model_and_empty_payload():
    ids = make_ids(3, L=2)
    t = RoutingTrace(ids, 8)
    assert decode_sglang(encode_sglang(t, 2, [0, 1]), 3, 2, [0, 1], K, 8) == t
    empty = decode_sglang("", 0, H, MOE, K, 8)
    assert empty.num_rows == 0 and empty.num_layers == 3


def test_decode_errors_name_sample_and_mismatch():
    ids = make_ids(6)
    good = manual_sglang_payload(ids)
    raw = base64.b64decode(good)
    with pytest.raises(RouteError, match=r"sample 2: routes: 236 bytes is not a multiple of 4 bytes x 5 layers x top_k 2 = 40"):
        decode_sglang(base64.b64encode(raw[:-4]), 6, H, MOE, K, 8, sample=2)
    with pytest.raises(RouteError, match=r"sample 2: routes: payload has 6 rows, expected 7 \(prompt \+ completion - 1 - start_len 0\)"):
        decode_sglang(good, 7, H, MOE, K, 8, sample=2)
    with pytest.raises(RouteError, match="not valid base64"):
        decode_sglang("@@not base64@@", 6, H, MOE, K, 8, sample=2)
    with pytest.raises(RouteError, match="must be a base64 string, got list"):
        decode_sglang([1, 2], 6, H, MOE, K, 8)
    # wrong layer count: 4 decoder layers x 2 = 32 bytes per row does not divide 240
    with pytest.raises(RouteError, match="not a multiple of"):
        decode_sglang(good, 6, 4, [1, 2, 3], K, 8)
    # id out of range for the model
    small = torch.tensor([[[0, 1], [2, 3], [1, 2]], [[0, 1], [3, 7], [1, 2]]])
    with pytest.raises(RouteError, match=r"sample 2: routes row 1 \(position\), layer 1, slot 1: expert id 7 outside \[0, 4\)"):
        decode_sglang(manual_sglang_payload(small), 2, H, MOE, K, 4, sample=2)
    with pytest.raises(RouteError, match="moe_layer_ids .* strictly increasing"):
        decode_sglang(good, 6, H, [2, 1, 4], K, 8)
    with pytest.raises(RouteError, match="inside \\[0, num_hidden_layers=5\\)"):
        decode_sglang(good, 6, H, [1, 2, 5], K, 8)
    with pytest.raises(RouteError, match="top_k must be >= 1"):
        decode_sglang(good, 6, H, MOE, 0, 8)


def test_nonzero_dense_layer_is_a_layout_error():
    """A server model whose layer 0 is MoE while ours is dense: caught, not silently shifted."""
    arr = np.frombuffer(base64.b64decode(manual_sglang_payload(make_ids(4))), dtype="<i4").copy()
    arr = arr.reshape(4, H, K)
    arr[2, 3, 1] = 5
    payload = base64.b64encode(arr.tobytes())
    with pytest.raises(RouteError, match=r"sample 1: routes row 12 \(position\), decoder layer 3 is dense in our config but has expert id 5"):
        decode_sglang(payload, 4, H, MOE, K, 8, sample=1, start_len=10)
    trace = decode_sglang(payload, 4, H, MOE, K, 8, check_dense_rows=False)
    assert trace.num_layers == 3


def bitstream_reference(values, bits):
    """Little-endian bitstream built with one Python big int: id i at bits [i*bits, (i+1)*bits)."""
    acc = 0
    for i, v in enumerate(values):
        acc |= int(v) << (i * bits)
    return acc.to_bytes((len(values) * bits + 7) // 8, "little")


@pytest.mark.parametrize("bits", range(1, 17))
def test_pack_bits_matches_big_int_reference(bits):
    rng = np.random.default_rng(bits)
    for n in (0, 1, 7, 8, 9, 1001):
        ids = rng.integers(0, 1 << bits, n)
        body = pack_bits(ids, bits)
        assert body == bitstream_reference(ids, bits)
        back, clean = unpack_bits(body, n, bits)
        assert clean and back.dtype == np.int64 and (back == ids).all()
    with pytest.raises(RouteError, match=rf"ids must lie in \[0, 2\*\*{bits}\), got \[0, {1 << bits}\]"):
        pack_bits(np.array([0, 1 << bits]), bits)


@pytest.mark.parametrize("E,bits", [(1, 1), (2, 1), (8, 3), (9, 4), (64, 6), (128, 7), (256, 8),
                                    (257, 9), (512, 9), (5000, 13), (65536, 16)])
def test_compact_bits(E, bits):
    assert compact_bits(E) == bits


@pytest.mark.parametrize("E", [8, 100, 256, 257, 5000])
def test_compact_roundtrip_and_header(E):
    trace = RoutingTrace(make_ids(9, E=E), E, start=3)
    payload = encode_compact(trace)
    raw = base64.b64decode(payload)
    bits = compact_bits(E)
    assert COMPACT_HEADER_BYTES == 5 and len(raw) == 5 + (9 * 3 * K * bits + 7) // 8
    zlib_layout = zlib.crc32(struct.pack("<III", 3, K, E)) & 0xFF
    assert tuple(raw[:5]) == (0x4C, 2, bits, 9, zlib_layout)
    assert raw[5:] == bitstream_reference(trace.to_int64().reshape(-1).tolist(), bits)
    assert decode_compact(payload, 9, 3, K, E, start_len=3) == trace
    assert routes_encoding(payload) == "compact"
    assert routes_encoding(encode_sglang(trace, H, MOE)) == "int32"


def test_compact_large_sample_roundtrip():
    """4096 rows x 48 layers x top-8 of 128 experts: 1.5M ids, 7 bits each."""
    trace = RoutingTrace(make_ids(4096, L=48, K=8, E=128), 128)
    payload = encode_compact(trace)
    assert len(base64.b64decode(payload)) == 5 + 4096 * 48 * 8 * 7 // 8
    assert decode_compact(payload, 4096, 48, 8, 128, sample=0) == trace


def _b64(raw):
    return base64.b64encode(bytes(raw))


def test_compact_errors():
    trace = RoutingTrace(make_ids(4), 8)  # 4 rows x 3 layers x 2 ids x 3 bits = 72 bits = 9 bytes
    payload = encode_compact(trace)
    raw = base64.b64decode(payload)
    with pytest.raises(RouteError, match=r"sample 5: routes: compact header says rows=4, expected 5 \(the header holds rows mod 256"):
        decode_compact(payload, 5, 3, K, 8, sample=5)
    with pytest.raises(RouteError, match=r"sample 5: routes: compact body has 9 bytes, expected ceil\(260 rows x 3 layers x top_k 2 x 3 bits / 8\) = 585"):
        decode_compact(payload, 260, 3, K, 8, sample=5)
    with pytest.raises(RouteError, match=r"layout check 0x.. does not match num_layers=4 \(MoE\), top_k=2, num_experts=8"):
        decode_compact(payload, 4, 4, K, 8)
    swapped = RoutingTrace(make_ids(4, L=2, K=3), 8)  # same ids per row, L and K swapped
    with pytest.raises(RouteError, match="layout check"):
        decode_compact(encode_compact(swapped), 4, 3, K, 8)
    with pytest.raises(RouteError, match="compact header says 3 bits per id, expected 4 for num_experts=16"):
        decode_compact(payload, 4, 3, K, 16)
    with pytest.raises(RouteError, match="sample 3: routes: compact body has 8 bytes, expected .* = 9 \\(truncated"):
        decode_compact(_b64(raw[:-1]), 4, 3, K, 8, sample=3)
    with pytest.raises(RouteError, match=r"must start with the 5-byte header beginning b'L', got b'L\\x02' \(2 bytes; truncated\?\)"):
        decode_compact(_b64(raw[:2]), 4, 3, K, 8)
    with pytest.raises(RouteError, match="must start with the 5-byte header"):
        decode_compact(_b64(b"X" + raw[1:]), 4, 3, K, 8)
    with pytest.raises(RouteError, match="compact version 3, this reader knows 2"):
        decode_compact(_b64(raw[:1] + b"\x03" + raw[2:]), 4, 3, K, 8)
    with pytest.raises(RouteError, match="compact version 1 payload"):
        decode_compact(_b64(b"LSRT" + bytes(20) + raw[5:]), 4, 3, K, 8)
    # ids out of range: E=6 still takes 3 bits, so a corrupt body can carry id 7
    t6 = RoutingTrace(torch.tensor([[[0, 1], [2, 3], [4, 5]]] * 2), 6)
    bad = bytearray(base64.b64decode(encode_compact(t6)))
    bad[5 + 1] |= 0b111 << 1  # row 0, layer 1, slot 1 = id index 3 = bits 9..11 -> 7
    with pytest.raises(RouteError, match=r"sample 1: routes row 10 \(position\), layer 1, slot 1: expert id 7 outside \[0, 6\)"):
        decode_compact(_b64(bad), 2, 3, K, 6, sample=1, start_len=10)
    t5 = RoutingTrace(make_ids(5, L=1, K=1), 8)  # 5 x 3 bits = 15 bits: 1 padding bit
    bad = bytearray(base64.b64decode(encode_compact(t5)))
    bad[-1] |= 0x80
    with pytest.raises(RouteError, match="non-zero padding bits after id 5"):
        decode_compact(_b64(bad), 5, 1, 1, 8)


def test_decode_routes_autodetects_both_encodings():
    trace = RoutingTrace(make_ids(5), 8)
    for enc in ("int32", "compact"):
        payload = encode_routes(trace, enc, H, MOE)
        assert routes_encoding(payload) == enc
        assert decode_routes(payload, 5, H, MOE, K, 8, sample=0) == trace
    # an int32 payload whose first id is 0x4C ('L', the compact magic) is still int32
    ids = make_ids(5)
    ids[0, 0] = torch.tensor([76, 2])
    t76 = RoutingTrace(ids, 128)
    moe_first = encode_routes(t76, "int32", 3, [0, 1, 2])
    assert base64.b64decode(moe_first)[0] == 0x4C and routes_encoding(moe_first) == "int32"
    assert decode_routes(moe_first, 5, 3, [0, 1, 2], K, 128) == t76
    with pytest.raises(RouteError, match=r"sample 4: routes: compact header says rows=5, expected 6"):
        decode_routes(encode_routes(trace, "compact", H, MOE), 6, H, MOE, K, 8, sample=4)
    with pytest.raises(RouteError, match=r"unknown routes encoding 'int8'; valid: \['int32', 'compact'\]"):
        encode_routes(trace, "int8", H, MOE)
    # a trace with the wrong number of MoE layers is refused by both encodings, naming both counts
    two_layers = RoutingTrace(make_ids(5, L=2), 8)
    for enc in ("int32", "compact"):
        with pytest.raises(RouteError, match=r"trace has 2 MoE layers, moe_layer_ids lists 3"):
            encode_routes(two_layers, enc, H, MOE)


def _wire_ratio(rows, num_hidden_layers, moe, top_k, E, seed=0):
    """Measured base64 wire length, compact / int32, for one sample."""
    trace = RoutingTrace(make_ids(rows, L=len(moe), K=top_k, E=E, seed=seed), E)
    compact = encode_routes(trace, "compact", num_hidden_layers, moe)
    int32 = encode_routes(trace, "int32", num_hidden_layers, moe)
    assert decode_routes(compact, rows, num_hidden_layers, moe, top_k, E) == trace
    return len(compact) / len(int32), len(base64.b64decode(compact)) / len(base64.b64decode(int32))


def test_short_sample_wire_ratio_at_most_a_quarter():
    # the bench's short samples: 47 rows, 4 layers all MoE, top-2 of 8 experts (3 bits per id)
    wire, decoded = _wire_ratio(47, 4, [0, 1, 2, 3], 2, 8)
    assert decoded == (5 + 141) / 1504 and wire <= 0.25 and wire < 0.1
    # E=256 (8 bits): a DeepSeek-like layout (3 dense of 61) is under 1/4 even for 47 rows
    wire, decoded = _wire_ratio(47, 61, list(range(3, 61)), 8, 256)
    assert decoded == (5 + 47 * 58 * 8) / (47 * 61 * 8 * 4) and wire <= 0.25
    # ... and so is a 4-layer model with one dense layer
    wire, _ = _wire_ratio(47, 4, [1, 2, 3], 2, 256)
    assert wire <= 0.25
    # E=256 with every layer MoE: 8 bits per id is exactly 1/4, so the 5-byte header is all
    # that is above it (no lossless per-id code can do better than 8 bits here)
    _, decoded = _wire_ratio(47, 4, [0, 1, 2, 3], 2, 256)
    assert decoded == (5 + 376) / 1504


def test_bytes_per_token_compact_vs_int32():
    # all-MoE model, E=128: 7 bits per id, 7/32 of SGLang's int32 bytes per token
    assert wire_bytes_per_token("compact", 48, 48, 8, 128) == 48 * 8 * 7 / 8
    assert wire_bytes_per_token("int32", 48, 48, 8, 128) == 48 * 8 * 4
    # DeepSeek-like: 3 dense layers dropped too, 8 bits: 58/(61*4)
    assert wire_bytes_per_token("int32", 61, 58, 8, 256) == 61 * 8 * 4
    assert wire_bytes_per_token("compact", 61, 58, 8, 256) == 58 * 8
    # E=8: 3 bits per id (3/32 of int32)
    assert wire_bytes_per_token("compact", 4, 4, 2, 8) == 3
    # > 256 experts: E=512 -> 9 bits
    assert wire_bytes_per_token("compact", 4, 4, 2, 512) == 9
    # measured on real payloads: long sample, per-sample header amortised
    trace = RoutingTrace(make_ids(1000, L=3, K=K, E=128), 128)
    int32_len = len(base64.b64decode(encode_sglang(trace, H, MOE)))
    compact_len = len(base64.b64decode(encode_compact(trace)))
    assert int32_len == 1000 * H * K * 4
    assert compact_len == COMPACT_HEADER_BYTES + 1000 * 3 * K * 7 // 8
    with pytest.raises(RouteError, match="unknown routes encoding"):
        wire_bytes_per_token("zip", 1, 1, 1, 1)
