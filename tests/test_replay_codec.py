"""Route wire codecs: SGLang base64 int32 (all decoder layers) and the compact encoding."""

import base64
import struct

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


@pytest.mark.parametrize("E", [8, 256, 257, 5000])
def test_compact_roundtrip_and_header(E):
    trace = RoutingTrace(make_ids(9, E=E), E, start=3)
    payload = encode_compact(trace)
    raw = base64.b64decode(payload)
    itemsize = 1 if E <= 256 else 2
    assert raw[:4] == b"LSRT" and len(raw) == COMPACT_HEADER_BYTES + 9 * 3 * K * itemsize
    magic, version, isz, L, k, _, e, start, rows = struct.unpack_from("<4sBBHHHIII", raw)
    assert (version, isz, L, k, e, start, rows) == (1, itemsize, 3, K, E, 3, 9)
    body = np.frombuffer(raw[24:], dtype="<u1" if itemsize == 1 else "<u2").reshape(9, 3, K)
    assert (body == trace.to_int64().numpy()).all()
    assert decode_compact(payload, 9, 3, K, E, start_len=3) == trace


def test_compact_errors():
    trace = RoutingTrace(make_ids(4), 8)
    payload = encode_compact(trace)
    with pytest.raises(RouteError, match="sample 5: routes: compact header says rows=4, expected 5"):
        decode_compact(payload, 5, 3, K, 8, sample=5)
    with pytest.raises(RouteError, match="compact header says num_layers=3, expected 4"):
        decode_compact(payload, 4, 4, K, 8)
    with pytest.raises(RouteError, match="compact header says num_experts=8, expected 16"):
        decode_compact(payload, 4, 3, K, 16)
    with pytest.raises(RouteError, match="compact header says start_len=0, expected 2"):
        decode_compact(payload, 4, 3, K, 8, start_len=2)
    with pytest.raises(RouteError, match="bytes per id=1, expected 2"):
        raw = bytearray(base64.b64decode(payload))
        struct.pack_into("<I", raw, 12, 300)  # claim 300 experts but keep 1-byte ids
        decode_compact(base64.b64encode(bytes(raw)), 4, 3, K, 300)
    raw = base64.b64decode(payload)
    with pytest.raises(RouteError, match="compact body has 23 bytes, header implies 4x3x2x1 = 24"):
        decode_compact(base64.b64encode(raw[:-1]), 4, 3, K, 8)
    with pytest.raises(RouteError, match="must start with the 24-byte header"):
        decode_compact(base64.b64encode(b"XXXX" + raw[4:]), 4, 3, K, 8)
    bad = bytearray(raw)
    bad[4] = 2
    with pytest.raises(RouteError, match="compact version 2"):
        decode_compact(base64.b64encode(bytes(bad)), 4, 3, K, 8)
    bad = bytearray(raw)
    bad[COMPACT_HEADER_BYTES + 5] = 9  # row 0, layer 2, slot 1
    with pytest.raises(RouteError, match=r"sample 1: routes row 0 \(position\), layer 2, slot 1: expert id 9"):
        decode_compact(base64.b64encode(bytes(bad)), 4, 3, K, 8, sample=1)


def test_decode_routes_autodetects_both_encodings():
    trace = RoutingTrace(make_ids(5), 8)
    for enc in ("int32", "compact"):
        payload = encode_routes(trace, enc, H, MOE)
        assert decode_routes(payload, 5, H, MOE, K, 8, sample=0) == trace
    with pytest.raises(RouteError, match=r"unknown routes encoding 'int8'; valid: \['int32', 'compact'\]"):
        encode_routes(trace, "int8", H, MOE)


def test_bytes_per_token_compact_vs_int32():
    # all-MoE model, E <= 256: exactly 1/4 of SGLang's int32 bytes per token
    assert wire_bytes_per_token("compact", 48, 48, 8, 128) * 4 == wire_bytes_per_token("int32", 48, 48, 8, 128)
    # first dense layers dropped too: 1/4 x 58/61
    assert wire_bytes_per_token("int32", 61, 58, 8, 256) == 61 * 8 * 4
    assert wire_bytes_per_token("compact", 61, 58, 8, 256) == 58 * 8
    # > 256 experts: uint16, half of int32
    assert wire_bytes_per_token("compact", 4, 4, 2, 384) * 2 == wire_bytes_per_token("int32", 4, 4, 2, 384)
    # measured on real payloads: long sample, per-sample header amortised
    trace = RoutingTrace(make_ids(1000, L=3, K=K, E=128), 128)
    int32_len = len(base64.b64decode(encode_sglang(trace, H, MOE)))
    compact_len = len(base64.b64decode(encode_compact(trace)))
    assert int32_len == 1000 * H * K * 4
    assert compact_len == COMPACT_HEADER_BYTES + 1000 * 3 * K
    assert compact_len / int32_len < 0.25
    with pytest.raises(RouteError, match="unknown routes encoding"):
        wire_bytes_per_token("zip", 1, 1, 1, 1)
