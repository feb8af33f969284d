"""Block FP8 quantiser (kernels/fp8.py) against hand-made blocks, and the fp8 matmul paths of
moe/layers.py."""

import pytest
import torch

from lockstep.kernels.fp8 import (BLOCK, FP8_MAX, act_qdq, dequantize_act, dequantize_weight,
                                  has_scaled_mm, quantize_act, quantize_weight,
                                  scaled_mm_blockwise, weight_qdq)


def test_one_partial_block_scale_rounding_and_saturation():
    # one 2 x 4 block (below 128 in both dims: the whole matrix is one partial block)
    w = torch.tensor([[7.0, -7.0, 0.5, 1.3],
                      [84 / 64, 1e-6, 3e-4, -3.0]])
    q, s = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 4)
    assert s.shape == (1, 1) and s.item() == pytest.approx(7.0 / FP8_MAX)   # amax / 448 = 1/64
    # w * 64 on the e4m3 grid: 448 and -448 exact, 32 exact; 83.2 -> 80 (grid 64, 72, 80, 88 in
    # [64, 128)); 84 is a tie -> 80 (even mantissa); 6.4e-5 -> 0 (below half the smallest
    # subnormal 2^-9); 0.0192 -> 2^-6 * (1 + 2/8) = 0.01953125
    # (the grid steps by 2^-9 in [2^-6, 2^-5)); -192 exact
    assert q.float().tolist() == [[448.0, -448.0, 32.0, 80.0], [80.0, 0.0, 0.01953125, -192.0]]
    assert dequantize_weight(q, s).tolist() == [[7.0, -7.0, 0.5, 1.25],
                                                [1.25, 0.0, 0.01953125 / 64, -3.0]]
    # given scales: values beyond +-448 saturate (clamped before the cast, whatever the
    # device's own cast does out of range)
    q2, _ = quantize_weight(w, torch.tensor([[1 / 128]]))
    assert q2.float()[0, :2].tolist() == [448.0, -448.0]
    assert not torch.isnan(q2.float()).any()


def test_blocks_at_the_edges_have_their_own_scales():
    O, D = 130, 200                          # blocks (128 | 2) x (128 | 72)
    w = torch.full((O, D), 0.01)
    spikes = {(0, 0): (5, 7, 3.0), (0, 1): (100, 150, -2.0), (1, 0): (129, 1, 0.5),
              (1, 1): (128, 199, 8.0)}
    for (i, j), (r, c, v) in spikes.items():
        w[r, c] = v
    q, s = quantize_weight(w)
    assert s.shape == (2, 2)
    for (i, j), (r, c, v) in spikes.items():
        assert s[i, j].item() == pytest.approx(abs(v) / FP8_MAX, rel=1e-7)
        assert q[r, c].float().item() == FP8_MAX * (1 if v > 0 else -1)
    back = dequantize_weight(q, s)
    assert back.shape == (O, D)
    assert ((back - w).abs() <= w.abs() / 16 + 1e-6).all()   # e4m3: 3 mantissa bits


def test_stacked_expert_weights_are_blocked_per_expert():
    w = torch.randn(3, 40, 136)
    w[1] *= 100
    q, s = quantize_weight(w)
    assert s.shape == (3, 1, 2)
    for e in range(3):
        qe, se = quantize_weight(w[e])
        assert torch.equal(q[e].float(), qe.float()) and torch.equal(s[e], se)


def test_activation_groups_of_128_per_token():
    x = torch.zeros(2, 130)
    x[0, 3], x[0, 129], x[1, 127] = -4.0, 0.25, 9.0
    q, s = quantize_act(x)
    assert s.shape == (2, 2)
    assert s[0].tolist() == pytest.approx([4 / FP8_MAX, 0.25 / FP8_MAX])
    assert s[1, 0].item() == pytest.approx(9 / FP8_MAX)
    assert s[1, 1].item() == pytest.approx(1e-10 / FP8_MAX)   # an all-zero group: eps floor
    assert torch.equal(dequantize_act(q, s), x)


def test_straight_through_gradient():
    w = torch.randn(5, 7, requires_grad=True)
    x = torch.randn(3, 7, requires_grad=True)
    y = (act_qdq(x) @ weight_qdq(w).T).sum()
    y.backward()
    assert torch.equal(x.grad, torch.ones(3, 5) @ weight_qdq(w).detach())
    assert torch.equal(w.grad, torch.ones(5, 3) @ act_qdq(x).detach())
    assert not torch.equal(weight_qdq(w).detach(), w.detach())   # the forward did quantise


def test_bad_scale_shape_is_one_line():
    with pytest.raises(ValueError, match=r"weight_scale_inv of shape \(2, 2\) does not fit a "
                                         r"weight of shape \(4, 4\)"):
        dequantize_weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 2))


@pytest.mark.gpu
def test_scaled_mm_equals_the_emulation():
    dev = torch.device("cuda")
    if not has_scaled_mm(dev):
        pytest.skip("no FP8 tensor cores (compute capability < 8.9)")
    torch.manual_seed(0)
    x, w = torch.randn(64, 2 * BLOCK + 32), torch.randn(3 * BLOCK, 2 * BLOCK + 32)
    emulated = act_qdq(x) @ weight_qdq(w).T
    on_gpu = scaled_mm_blockwise(x.to(dev), w.to(dev), torch.float32).cpu()
    assert torch.allclose(on_gpu, emulated, rtol=1e-5, atol=1e-4)
