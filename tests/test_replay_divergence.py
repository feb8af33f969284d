"""Routing divergence metrics on hand-made routes with hand-counted answers."""

import math
import time

import pytest
import torch

from lockstep.replay import RouteError, compare_routes, routing_divergence


def hand_pair():
    """B=1, T=3, L=2, K=2. Token 2 is invalid (last token / padding) and differs everywhere."""
    a = torch.tensor([[[[0, 1], [2, 3]],
                       [[4, 5], [6, 7]],
                       [[0, 1], [0, 1]]]])
    b = torch.tensor([[[[1, 0], [2, 4]],     # layer 0 same set (order swapped); layer 1 one differs
                       [[4, 5], [0, 1]],     # layer 0 same; layer 1 both differ
                       [[6, 7], [6, 7]]]])   # invalid
    valid = torch.tensor([[True, True, False]])
    return a, b, valid


def test_hand_counted_metrics():
    a, b, valid = hand_pair()
    m = routing_divergence(a.to(torch.uint8), b, valid)
    assert m["routing/flip_rate"] == pytest.approx(2 / 4)
    assert m["routing/flip_rate/layer_0"] == pytest.approx(0.0)
    assert m["routing/flip_rate/layer_1"] == pytest.approx(1.0)
    assert m["routing/token_any_flip"] == pytest.approx(1.0)
    # overlaps: 2/2, 1/2, 2/2, 0/2 -> mean 0.625
    assert m["routing/topk_overlap"] == pytest.approx(0.625)
    assert m["routing/num_tokens"] == 2.0


def test_per_token_tensors_and_prefix_and_layer_names():
    a, b, valid = hand_pair()
    c = compare_routes(a, b, valid)
    assert c.flip_BTL.tolist() == [[[False, True], [False, True], [False, False]]]
    assert c.any_flip_BT.tolist() == [[True, True, False]]
    assert c.overlap_BTL.tolist() == [[[1.0, 0.5], [1.0, 0.0], [0.0, 0.0]]]
    m = c.metrics(prefix="routing_r2", layer_names=[1, 3])
    assert set(m) == {"routing_r2/flip_rate", "routing_r2/flip_rate/layer_1",
                      "routing_r2/flip_rate/layer_3", "routing_r2/token_any_flip",
                      "routing_r2/topk_overlap", "routing_r2/num_tokens"}
    assert m["routing_r2/flip_rate/layer_3"] == 1.0
    with pytest.raises(RouteError, match="layer_names has 1 entries for 2 layers"):
        c.metrics(layer_names=[0])


def test_identical_routes_and_default_mask():
    a, _, _ = hand_pair()
    m = routing_divergence(a, a.flip(-1))  # same sets, other order; all positions valid
    assert m["routing/flip_rate"] == 0.0 and m["routing/token_any_flip"] == 0.0
    assert m["routing/topk_overlap"] == 1.0 and m["routing/num_tokens"] == 3.0


def test_token_any_flip_differs_from_flip_rate():
    # 4 tokens, 4 layers, K=1; one flip in token 0, three in token 1
    a = torch.zeros(1, 4, 4, 1, dtype=torch.long)
    b = a.clone()
    b[0, 0, 2] = 1
    b[0, 1, :3] = 1
    m = routing_divergence(a, b)
    assert m["routing/flip_rate"] == pytest.approx(4 / 16)
    assert m["routing/token_any_flip"] == pytest.approx(2 / 4)
    assert m["routing/flip_rate/layer_0"] == pytest.approx(1 / 4)
    assert m["routing/topk_overlap"] == pytest.approx(12 / 16)


def test_no_valid_token_gives_nan():
    a, b, _ = hand_pair()
    m = routing_divergence(a, b, torch.zeros(1, 3, dtype=torch.bool))
    assert m["routing/num_tokens"] == 0.0
    assert all(math.isnan(v) for k, v in m.items() if k != "routing/num_tokens")


def test_uint16_routes():
    a, b, valid = hand_pair()
    a16, b16 = (a + 300).to(torch.uint16), (b + 300).to(torch.uint16)
    assert routing_divergence(a16, b16, valid) == routing_divergence(a, b, valid)


def test_input_errors():
    a, b, valid = hand_pair()
    with pytest.raises(RouteError, match=r"routes differ in shape: \(1, 3, 2, 2\) vs \(1, 2, 2, 2\)"):
        routing_divergence(a, b[:, :2])
    with pytest.raises(RouteError, match=r"must be \[B, T, L, K\], got shape \(3, 2, 2\)"):
        routing_divergence(a[0], b[0])
    with pytest.raises(RouteError, match="routes b must be an integer tensor, got torch.float32"):
        routing_divergence(a, b.float())
    with pytest.raises(RouteError, match=r"valid mask must be bool \(1, 3\), got torch.int64"):
        routing_divergence(a, b, valid.long())


def test_matches_loop_reference_and_is_fast():
    """Random routes at a realistic size (B*T*L*K = 4.2M) vs a plain-Python reference on a
    subset; the vectorised version must stay well under a second or two on one core."""
    torch.manual_seed(0)
    B, T, L, K, E = 16, 512, 64, 8, 128
    stride = torch.arange(K) * (E // K)  # distinct ids per row: base + j * 16 (mod E)
    a = ((torch.randint(0, E, (B, T, L, 1)) + stride) % E).to(torch.uint8)
    b = a.clone()
    flip = torch.rand(B, T, L) < 0.1
    b[flip] = ((torch.randint(0, E, (int(flip.sum()), 1)) + stride) % E).to(torch.uint8)
    valid = torch.rand(B, T) < 0.9
    t0 = time.perf_counter()
    c = compare_routes(a, b, valid)
    m = c.metrics()
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"compare_routes took {elapsed:.2f}s"
    # reference on the first two samples, via Python sets
    for bi in range(2):
        for t in range(0, T, 37):
            for l in range(0, L, 7):
                sa, sb = set(a[bi, t, l].tolist()), set(b[bi, t, l].tolist())
                assert bool(c.flip_BTL[bi, t, l]) == (bool(valid[bi, t]) and sa != sb)
                expect = len(sa & sb) / K if valid[bi, t] else 0.0
                assert float(c.overlap_BTL[bi, t, l]) == pytest.approx(expect)
    # flips injected with p=0.1; a re-draw gives the same set when base matches mod 16 (p=1/16)
    assert m["routing/flip_rate"] == pytest.approx(0.1 * 15 / 16, abs=0.003)
