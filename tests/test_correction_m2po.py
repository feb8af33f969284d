"""M2PO's second-moment mask (`correction.m2po_threshold`, AReaL's `m2_threshold`) with
hand-computed numbers (AReaL is not a dependency; its rule: drop the largest (log r)^2 tokens
until the mean of the rest is below the threshold)."""

import pytest
import torch

from lockstep.trainer.objective.correction import CorrectionConfig, correct, m2po_mask

# row 0: log r = [.3, .1, .2, 0] -> m2 [.09, .01, .04, 0]; row 1: [.4, pad]; padding holds a huge
# log ratio that must not count. m2 over valid tokens: mean .3/5 = .06; sorted .16 .09 .04 .01 0
OLD = torch.tensor([[0.3, 0.1, 0.2, 0.0], [0.4, 9.0, 0.0, 0.0]]) - 1.0
ROLLOUT = torch.full((2, 4), -1.0)
MASK = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])


@pytest.mark.parametrize("threshold,kept", [
    (0.1, [[1, 1, 1, 1], [1, 0, 0, 0]]),     # mean .06 < .1: nothing dropped
    (0.05, [[1, 1, 1, 1], [0, 0, 0, 0]]),    # drop .16: the rest .14/4 = .035 < .05
    (0.03, [[0, 1, 1, 1], [0, 0, 0, 0]]),    # .035 >= .03, drop .09 too: .05/3 = .0167
    (0.006, [[0, 1, 0, 1], [0, 0, 0, 0]]),   # .0167 >= .006, drop .04 too: .01/2 = .005
    (1e-9, [[0, 0, 0, 1], [0, 0, 0, 0]]),    # only the m2 = 0 token is below
])
def test_m2po_drops_the_largest_second_moments_until_the_mean_is_below(threshold, kept):
    mask, m = m2po_mask(OLD, ROLLOUT, MASK, threshold)
    assert mask.tolist() == kept
    n_drop = 5 - int(torch.tensor(kept).sum())
    assert m["m2po_masked_fraction"] == pytest.approx(n_drop / 5)
    assert m["m2po_m2_mean"] == pytest.approx(0.06, rel=1e-5)
    m2 = ((OLD - ROLLOUT) ** 2)[torch.tensor(kept).bool()]
    assert m["m2po_m2_mean_kept"] == pytest.approx(m2.mean().item(), rel=1e-5)


def test_m2po_in_correct_after_rejection_and_ties_in_order():
    cfg = CorrectionConfig(rollout_rs="token_k2", rollout_rs_threshold=0.05, m2po_threshold=0.03)
    res = correct(cfg, OLD, ROLLOUT, MASK)
    # RS k2 = m2/2 <= .05 drops the .16 token first; M2PO sees .09 .04 .01 0 (mean .035): drops .09
    assert res.response_mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0]]
    assert res.metrics["rollout_corr/m2po_masked_fraction"] == pytest.approx(1 / 4)
    assert res.weights is None and "rollout_corr/kl" in res.metrics
    tied, _ = m2po_mask(torch.tensor([[0.2, 0.2, 0.0]]), torch.zeros(1, 3), torch.ones(1, 3), 0.021)
    assert tied.tolist() == [[0, 1, 1]]  # equal m2: the first in row-major order goes first
    never, m = m2po_mask(torch.tensor([[0.2, 0.1]]), torch.zeros(1, 2), torch.ones(1, 2), 0.005)
    assert never.tolist() == [[0, 1]]  # no suffix mean below: all but the smallest (AReaL's rule)
    with pytest.raises(ValueError, match="m2po_threshold must be > 0"):
        CorrectionConfig(m2po_threshold=0.0)
