"""KPop's binary-KL token mask and TRM's sequence mask (correction.kpop / kpop_phi, trm_delta /
trm_k3_mean), against hand computations."""

import math

import pytest
import torch

from lockstep.trainer.objective.correction import (CorrectionConfig, binary_kl, correct,
                                                   kpop_mask, trm_mask)
from lockstep.trainer.objective.rollout_corr import compute_rollout_rejection_mask


def _bkl(p, q, eps=1e-8):
    p, q = min(max(p, eps), 1 - eps), min(max(q, eps), 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _random(B=6, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    roll = old + torch.randn(B, T, generator=g) * 0.6
    roll = roll.clamp(max=-1e-4)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[0] = 0.0  # an empty row
    return old, roll, mask


def test_kpop_mask_and_metrics_equal_a_hand_computation():
    old, roll, mask = _random()
    phi = 0.05
    got, m = kpop_mask(old, roll, mask, phi)
    d = [[max(_bkl(math.exp(o), math.exp(r)), _bkl(math.exp(r), math.exp(o)))
          for o, r in zip(ro, rr)] for ro, rr in zip(old.tolist(), roll.tolist())]
    valid = [(b, t) for b in range(6) for t in range(9) if mask[b, t]]
    want = torch.tensor([[float(mask[b, t] and d[b][t] <= phi) for t in range(9)] for b in range(6)])
    assert torch.equal(got, want)
    assert 0 < sum(d[b][t] > phi for b, t in valid) < len(valid)  # both outcomes occur
    assert m["binary_kl_mean"] == pytest.approx(sum(d[b][t] for b, t in valid) / len(valid), rel=1e-5)
    assert m["binary_kl_max"] == pytest.approx(max(d[b][t] for b, t in valid), rel=1e-5)
    dropped = [(b, t) for b, t in valid if d[b][t] > phi]
    assert m["kpop_masked_fraction"] == pytest.approx(len(dropped) / len(valid))
    assert m["kpop_seq_masked_fraction"] == pytest.approx(len({b for b, _ in dropped}) / 6)


def test_kpop_keeps_a_token_at_phi_and_drops_it_just_above():
    old, roll = torch.tensor([[math.log(0.6)]]), torch.tensor([[math.log(0.3)]])
    mask = torch.ones(1, 1)
    d = torch.maximum(binary_kl(old, roll), binary_kl(roll, old))
    hand = max(_bkl(0.6, 0.3), _bkl(0.3, 0.6))  # D(0.6 || 0.3) = 0.19204 > D(0.3 || 0.6) = 0.18379
    assert float(d) == pytest.approx(hand, rel=1e-6)
    phi = float(d)
    assert kpop_mask(old, roll, mask, phi)[0].item() == 1.0  # D = phi: kept
    below = math.nextafter(phi, 0.0)  # the threshold one ulp lower: D is just above it
    assert kpop_mask(old, roll, mask, below)[0].item() == 0.0
    # both directions count: a phi between the two keeps neither order of (p, q)
    assert kpop_mask(old, roll, mask, 0.188)[0].item() == 0.0
    assert kpop_mask(roll, old, mask, 0.188)[0].item() == 0.0


def test_kpop_is_symmetric_and_zero_for_equal_probabilities():
    old, roll, mask = _random(seed=1)
    assert torch.equal(kpop_mask(old, roll, mask, 0.03)[0], kpop_mask(roll, old, mask, 0.03)[0])
    assert float(binary_kl(old, old).abs().max()) == 0.0
    assert kpop_mask(old, old, mask, 1e-12)[0].equal(mask)


def test_trm_masks_whole_sequences_at_the_hand_computed_max():
    old = torch.zeros(3, 4)
    roll = torch.tensor([[0.0, -0.5, 0.2, 0.0],    # max |log r| = 0.5: kept at delta 0.5
                         [0.0, 0.6, 0.0, 0.0],     # 0.6 > 0.5: whole row dropped
                         [0.0, 0.0, 0.0, 3.0]])    # 3.0 only on a padded token: kept
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
    got, m = trm_mask(old, roll, mask, delta=0.5, k3_mean=None)
    assert torch.equal(got, mask * torch.tensor([[1.0], [0.0], [1.0]]))
    assert m["trm_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert m["trm_masked_fraction"] == pytest.approx(4 / 10)
    assert m["trm_max_abs_log_ratio"] == pytest.approx((0.5 + 0.6 + 0.0) / 3)
    assert m["trm_max_abs_log_ratio_max"] == pytest.approx(0.6)
    # the average criterion over each row's valid tokens (log r = old - rollout)
    k3 = [sum(math.exp(x) - 1 - x for x in row) / len(row) for row in ([0.0, 0.5, -0.2],
          [0.0, -0.6, 0.0, 0.0], [0.0, 0.0, 0.0])]                # 0.0558, 0.0372, 0
    assert trm_mask(old, roll, mask, None, k3_mean=k3[0] * 1.001)[0].equal(mask)
    got = trm_mask(old, roll, mask, None, k3_mean=k3[1] * 1.001)[0]
    assert torch.equal(got, mask * torch.tensor([[0.0], [1.0], [1.0]]))
    assert trm_mask(old, roll, mask, None, k3_mean=k3[1] * 0.999)[0].sum(-1).tolist() == [0, 0, 3]
    assert trm_mask(old, roll, mask, None, k3_mean=None)[1]["trm_k3_seq_mean"] == \
        pytest.approx(sum(k3) / 3, rel=1e-5)


def test_trm_max_criterion_is_verls_seq_max_k2_at_delta_squared_over_two():
    old, roll, mask = _random(seed=2)
    delta = 0.9
    ours, _ = trm_mask(old, roll, mask, delta, None)
    verl, _ = compute_rollout_rejection_mask(old - roll, mask, rollout_rs="seq_max_k2",
                                             rollout_rs_threshold=delta ** 2 / 2)
    assert torch.equal(ours, verl)
    assert 0 < int((ours.sum(-1) == 0).sum()) < 6


def test_correct_applies_kpop_and_trm_and_prefixes_their_metrics():
    old, roll, mask = _random(seed=3)
    off = correct(CorrectionConfig(), old, roll, mask)
    assert not any("kpop" in k or "trm" in k or "binary_kl" in k for k in off.metrics)
    res = correct(CorrectionConfig(kpop=True, kpop_phi=0.05, trm_delta=1.5), old, roll, mask)
    k, _ = kpop_mask(old, roll, mask, 0.05)
    t, _ = trm_mask(old, roll, mask, 1.5, None)
    assert torch.equal(res.response_mask, mask * k * t)
    for name in ("binary_kl_mean", "kpop_masked_fraction", "trm_seq_masked_fraction"):
        assert f"rollout_corr/{name}" in res.metrics
    with pytest.raises(ValueError, match="kpop_phi"):
        CorrectionConfig(kpop=True, kpop_phi=0.0)
    with pytest.raises(ValueError, match="trm_delta"):
        CorrectionConfig(trm_delta=-1.0)
