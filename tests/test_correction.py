"""Rollout correction with hand-computed numbers for every option (verl 0.9.1 semantics + ours).

Shared batch: rollout log-probs 0, so the log ratio log r = old - rollout is `old` itself, and
    row 0: r = [2, 1, 1/4]   (log r = [ln 2, 0, -ln 4])
    row 1: r = [3, pad, pad] (log r = [ln 3])
k1 = -log r = [-0.6931, 0, 1.3863 | -1.0986]
k2 = (log r)^2/2 = [0.2402, 0, 0.9609 | 0.6035]
k3 = r - 1 - log r = [0.3069, 0, 0.6363 | 0.9014]
"""

import math

import pytest
import torch

from lockstep.trainer.objective.correction import (apply_bypass_mode,
                                                   compute_rollout_correction_and_add_to_batch,
                                                   correct, CorrectionConfig, is_split_metrics)
from lockstep.trainer.objective.rollout_corr import (compute_rollout_correction_and_rejection_mask,
                                                     compute_rollout_correction_weights,
                                                     compute_rollout_rejection_mask,
                                                     parse_rs_thresholds)

L2, L3, L4 = math.log(2), math.log(3), math.log(4)
K1 = [-L2, 0.0, L4, -L3]
K2 = [L2**2 / 2, 0.0, L4**2 / 2, L3**2 / 2]
K3 = [2 - 1 - L2, 0.0, 0.25 - 1 + L4, 3 - 1 - L3]


def batch():
    old = torch.tensor([[L2, 0.0, -L4], [L3, 0.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    return old, rollout, mask


def approx(x):
    return pytest.approx(x, rel=1e-5, abs=1e-6)


def test_token_tis_weights_and_metrics():
    old, rollout, mask = batch()
    w, m = compute_rollout_correction_weights(old - rollout, mask, "token", 2.0)
    # raw [2, 1, .25 | 3] -> clamp(max=2) -> [2, 1, .25 | 2]; padding 0
    torch.testing.assert_close(w, torch.tensor([[2.0, 1, 0.25], [2, 0, 0]]))
    assert not w.requires_grad
    assert m["rollout_is_mean"] == approx((2 + 1 + 0.25 + 2) / 4)  # 1.3125
    assert m["rollout_is_max"] == approx(2.0) and m["rollout_is_min"] == approx(0.25)
    assert m["rollout_is_ratio_fraction_high"] == approx(1 / 4)  # raw 3 > 2
    assert m["rollout_is_ratio_fraction_low"] == approx(1 / 4)  # raw .25 < 1/C = .5
    ew2 = (4 + 1 + 0.0625 + 4) / 4
    assert m["rollout_is_std"] == approx(math.sqrt(ew2 - 1.3125**2))
    assert m["rollout_is_eff_sample_size"] == approx(1.3125**2 / ew2)  # 1 / E[(w/mean)^2]
    assert m["rollout_is_seq_mean"] == approx((3.25 / 3 + 2) / 2)
    assert m["rollout_is_seq_max"] == approx(2.0) and m["rollout_is_seq_min"] == approx(3.25 / 3)
    assert m["rollout_is_seq_max_deviation"] == approx(1.0)
    assert m["rollout_is_seq_fraction_high"] == approx(0.5)  # raw row means 1.083, 3 -> one > 2
    assert m["rollout_is_seq_fraction_low"] == approx(0.0)
    assert "rollout_is_oob_ratio" not in m and "rollout_is_batch_norm_factor" not in m


def test_token_icepop_bounds_inclusive_and_mask_unchanged():
    old, rollout, mask = batch()
    weights, new_mask, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask, "token", "0.5_2.0")
    # keep raw in [0.5, 2] inclusive: 2 (on the upper bound) stays, .25 and 3 -> 0
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1, 0], [0, 0, 0]]))
    torch.testing.assert_close(new_mask, mask)  # IcePop never touches the mask
    assert m["rollout_corr/rollout_is_oob_ratio"] == approx(2 / 4)
    assert m["rollout_corr/rollout_is_mean"] == approx(3 / 4)
    # weight exactly 1.0 on a lower bound of 1.0 is kept (>=)
    w, _ = compute_rollout_correction_weights(torch.zeros(1, 2), torch.ones(1, 2), "token", "1.0_2.0")
    torch.testing.assert_close(w, torch.ones(1, 2))


def test_sequence_and_geometric_levels():
    old, rollout, mask = batch()
    w, m = compute_rollout_correction_weights(old - rollout, mask, "sequence", 2.0)
    # row sums: ln2 + 0 - ln4 = -ln2 -> 0.5 ; ln3 -> 3 -> clamp 2
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5, 0.5], [2, 0, 0]]))
    assert m["rollout_is_max"] == approx(3.0) and m["rollout_is_min"] == approx(0.5)  # unclamped, log space
    assert m["rollout_is_ratio_fraction_high"] == approx(0.5)  # ln3 > ln2
    assert m["rollout_is_ratio_fraction_low"] == approx(0.0)  # -ln2 is not < ln(1/2)
    w, _ = compute_rollout_correction_weights(old - rollout, mask, "geometric", 2.0)
    # row means: -ln2/3 -> 2^(-1/3) = 0.7937 ; ln3 -> 3 -> clamp 2
    torch.testing.assert_close(w, torch.tensor([[2 ** (-1 / 3)] * 3, [2, 0, 0]]))
    w, m = compute_rollout_correction_weights(old - rollout, mask, "sequence", "0.6_5.0")  # IcePop per sequence
    torch.testing.assert_close(w, torch.tensor([[0.0, 0, 0], [3, 0, 0]]))  # 0.5 < 0.6 out, 3 in
    assert m["rollout_is_oob_ratio"] == approx(3 / 4)  # token-weighted: row 0 has 3 of 4 valid tokens


def test_batch_normalisation():
    old, rollout, mask = batch()
    w, m = compute_rollout_correction_weights(old - rollout, mask, "token", 2.0, True)
    assert m["rollout_is_batch_norm_factor"] == approx(1.3125)  # token mean of truncated weights
    torch.testing.assert_close(w, torch.tensor([[2.0, 1, 0.25], [2, 0, 0]]) / 1.3125)
    assert m["rollout_is_mean"] == approx(1.3125)  # metrics describe the pre-normalisation weights
    w, m = compute_rollout_correction_weights(old - rollout, mask, "sequence", 2.0, True)
    assert m["rollout_is_batch_norm_factor"] == approx((0.5 + 2) / 2)  # one weight per sequence
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.4, 0.4], [1.6, 0, 0]]))


def test_safety_clamp_at_20():
    lr = torch.tensor([[25.0, -25.0], [15.0, 15.0]])
    mask = torch.ones(2, 2)
    w, _ = compute_rollout_correction_weights(lr, mask, "token", 1e12)
    torch.testing.assert_close(w, torch.exp(torch.tensor([[20.0, -20.0], [15, 15]])))
    w, m = compute_rollout_correction_weights(lr, mask, "sequence", 1e12)
    # row sums 0 and 30 -> 30 clamps to 20
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [math.exp(20)] * 2]))
    assert m["rollout_is_max"] == approx(math.exp(20))
    # RS statistics use the clamped log ratio too: k2 of 25 is 20^2/2 = 200
    _, m = compute_rollout_rejection_mask(lr, mask, "token_k2", 1e6)
    assert m["rollout_rs_token_k2_max"] == approx(200.0)


RS_EXPECT = {
    # option, threshold -> kept mask (rows: [r=2, 1, 1/4], [r=3])
    ("token_k1", 2.0): [[1, 1, 0], [0, 0, 0]],  # U=2 -> lower 1/2: -log r in [ln .5, ln 2] <=> r in [.5, 2]
    ("token_k1", "1.0_5.0"): [[0, 1, 1], [0, 0, 0]],  # k1 in [0, ln 5] <=> r in [1/5, 1]: bounds invert
    ("token_k2", 0.3): [[1, 1, 0], [0, 0, 0]],  # k2 .24 0 .96 | .60
    ("token_k3", 0.3): [[0, 1, 0], [0, 0, 0]],  # k3 .307 0 .636 | .901
    ("seq_sum_k1", "0.4_2.5"): [[1, 1, 1], [0, 0, 0]],  # sums ln2=.693 in [ln.4=-.916, ln2.5=.916]; -1.099 out
    ("seq_sum_k2", 1.0): [[0, 0, 0], [1, 0, 0]],  # sums 1.201 | .604
    ("seq_sum_k3", 0.92): [[0, 0, 0], [1, 0, 0]],  # sums .943 | .901
    ("seq_mean_k1", 2.0): [[1, 1, 1], [0, 0, 0]],  # means .231 in [-.693, .693]; -1.099 out
    ("seq_mean_k2", 0.5): [[1, 1, 1], [0, 0, 0]],  # means .400 | .604
    ("seq_mean_k3", 0.5): [[1, 1, 1], [0, 0, 0]],  # means .314 | .901
    ("seq_max_k2", 0.7): [[0, 0, 0], [1, 0, 0]],  # max .961 | .604
    ("seq_max_k3", 0.7): [[1, 1, 1], [0, 0, 0]],  # max .636 | .901
    ("seq_mean_k1,token_k2", "2.0,0.3"): [[1, 1, 0], [0, 0, 0]],  # both must pass
    ("token_k3,seq_sum_k2", "0.3"): [[0, 0, 0], [0, 0, 0]],  # one threshold shared: k3 .3 and sum_k2 .3
}


@pytest.mark.parametrize("opt,thr", list(RS_EXPECT))
def test_rejection_options(opt, thr):
    old, rollout, mask = batch()
    new_mask, m = compute_rollout_rejection_mask(old - rollout, mask, opt, thr)
    expect = torch.tensor(RS_EXPECT[(opt, thr)], dtype=torch.float32)
    torch.testing.assert_close(new_mask, expect)
    assert m["rollout_rs_masked_fraction"] == approx(1 - expect.sum().item() / 4)
    rows_hit = [((mask[i] == 1) & (expect[i] == 0)).any().item() for i in range(2)]
    assert m["rollout_rs_seq_masked_fraction"] == approx(sum(rows_hit) / 2)


def test_rs_metrics_token_and_sequence():
    old, rollout, mask = batch()
    _, m = compute_rollout_rejection_mask(old - rollout, mask, "token_k2,seq_sum_k3", "0.3,0.92")
    assert m["rollout_rs_token_k2_mean"] == approx(sum(K2) / 4)
    assert m["rollout_rs_token_k2_max"] == approx(K2[2]) and m["rollout_rs_token_k2_min"] == approx(0.0)
    assert m["rollout_rs_token_k2_fraction_high"] == approx(2 / 4) and m["rollout_rs_token_k2_fraction_low"] == 0.0
    assert m["rollout_rs_token_k2_masked_fraction"] == approx(2 / 4)
    assert m["rollout_rs_token_k2_seq_masked_fraction"] == approx(2 / 2)
    assert m["rollout_rs_token_k2_seq_mean"] == approx((sum(K2[:3]) / 3 + K2[3]) / 2)
    s0, s1 = sum(K3[:3]), K3[3]
    assert m["rollout_rs_seq_sum_k3_mean"] == approx((3 * s0 + s1) / 4)  # token-weighted
    assert m["rollout_rs_seq_sum_k3_max"] == approx(s0) and m["rollout_rs_seq_sum_k3_min"] == approx(s1)
    assert m["rollout_rs_seq_sum_k3_seq_fraction_high"] == approx(0.5)
    assert m["rollout_rs_seq_sum_k3_masked_fraction"] == approx(3 / 4)
    assert m["rollout_rs_seq_sum_k3_seq_masked_fraction"] == approx(1 / 2)
    # k1 options report thresholds in log space and a lower fraction
    _, m = compute_rollout_rejection_mask(old - rollout, mask, "token_k1", 2.0)
    assert m["rollout_rs_token_k1_fraction_high"] == approx(1 / 4)  # k1 = ln4 > ln2
    assert m["rollout_rs_token_k1_fraction_low"] == approx(1 / 4)  # k1 = -ln3 < ln .5


def test_k1_single_threshold_means_reciprocal_lower_and_spec_errors():
    assert parse_rs_thresholds(["token_k1"], 4.0) == {"token_k1": (0.25, 4.0)}
    assert parse_rs_thresholds(["seq_mean_k1", "token_k3"], "0.5_1.5,0.1") == {
        "seq_mean_k1": (0.5, 1.5), "token_k3": (None, 0.1)}
    with pytest.raises(ValueError, match="takes one upper bound"):
        parse_rs_thresholds(["token_k2"], "0.1_0.2")
    with pytest.raises(ValueError, match="give 1 or 2"):
        parse_rs_thresholds(["token_k1", "token_k2"], "1,2,3")
    with pytest.raises(ValueError, match="lower <= upper"):
        parse_rs_thresholds(["token_k1"], "2_1")


def test_offpolicy_metrics_hand_computed():
    old, rollout, mask = batch()
    rollout = rollout - 1.0
    old = old - 1.0
    _, _, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask)
    lr_sum = L2 + 0 - L4 + L3
    assert m["rollout_corr/kl"] == approx(-lr_sum / 4)  # mean(rollout - old)
    assert m["rollout_corr/k3_kl"] == approx(sum(K3) / 4)
    mean_old = [-1 - L2 / 3, -1 + L3]  # per-sequence mean of old log-probs
    assert m["rollout_corr/training_log_ppl"] == approx(-(mean_old[0] + mean_old[1]) / 2)
    assert m["rollout_corr/training_ppl"] == approx((math.exp(-mean_old[0]) + math.exp(-mean_old[1])) / 2)
    assert m["rollout_corr/rollout_log_ppl"] == approx(1.0)
    assert m["rollout_corr/rollout_ppl"] == approx(math.e)
    diff = [L2 / 3, -L3]  # mean rollout - mean old per sequence
    assert m["rollout_corr/log_ppl_diff"] == approx(sum(diff) / 2)
    assert m["rollout_corr/log_ppl_abs_diff"] == approx((abs(diff[0]) + abs(diff[1])) / 2)
    assert m["rollout_corr/log_ppl_diff_max"] == approx(diff[0]) and m["rollout_corr/log_ppl_diff_min"] == approx(diff[1])
    assert m["rollout_corr/ppl_ratio"] == approx((2 ** (1 / 3) + 1 / 3) / 2)
    assert m["rollout_corr/chi2_token"] == approx((4 + 1 + 1 / 16 + 9) / 4 - 1)
    assert m["rollout_corr/chi2_seq"] == approx((0.25 + 9) / 2 - 1)  # exp(2 * [-ln2, ln3])


def test_all_masked_rows_follow_verl():
    old, rollout, mask = batch()
    old = torch.cat([old, torch.full((1, 3), -5.0)])
    rollout = torch.cat([rollout, torch.zeros(1, 3)])
    mask = torch.cat([mask, torch.zeros(1, 3)])
    w, new_mask, m = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, "sequence", 2.0, False, "seq_mean_k1", 2.0)
    assert w[2].abs().sum() == 0 and new_mask[2].sum() == 0
    # empty rows count in per-sequence averages with log ratio 0 / mean weight 0 (verl's definition)
    assert m["rollout_corr/rollout_is_seq_mean"] == approx((0.5 + 2 + 0) / 3)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == approx(1 / 3)
    assert m["rollout_corr/chi2_seq"] == approx((0.25 + 9 + 1) / 3 - 1)
    # ... but the per-option RS sequence fraction only counts non-empty rows, the global one all rows
    assert m["rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction"] == approx(1 / 2)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == approx(1 / 3)
    with pytest.raises(ValueError, match="no valid token"):
        compute_rollout_correction_and_rejection_mask(old, rollout, torch.zeros(3, 3), "token")


def test_nan_logprob_error_names_position_and_padding_is_ignored():
    old, rollout, mask = batch()
    old[1, 2] = float("nan")  # padding: ignored
    compute_rollout_correction_and_rejection_mask(old, rollout, mask, "token")
    rollout[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_log_prob is nan at row 0, position 1"):
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, "token")
    with pytest.raises(ValueError, match=r"rollout_log_prob shape \(2, 2\)"):
        compute_rollout_correction_and_rejection_mask(old, rollout[:, :2], mask, "token")


def test_config_validation():
    with pytest.raises(ValueError, match="correction: unknown keys \\['rollout_iss'\\]; valid keys are \\['rollout_is', "):
        CorrectionConfig.from_dict({"rollout_iss": "token"})
    with pytest.raises(ValueError, match="valid: None, token, sequence, geometric"):
        CorrectionConfig(rollout_is="tokens")
    with pytest.raises(ValueError, match="invalid rollout_is_threshold '2,0'"):
        CorrectionConfig(rollout_is="token", rollout_is_threshold="2,0")
    with pytest.raises(ValueError, match="0 < lower <= upper"):
        CorrectionConfig(rollout_is="token", rollout_is_threshold="3_2")
    with pytest.raises(TypeError):
        CorrectionConfig(rollout_is="token", rollout_is_threshold=True)
    with pytest.raises(ValueError, match="unknown rollout_rs option 'seq_max_k1'; valid: token_k1, "):
        CorrectionConfig(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="must be given"):
        CorrectionConfig(rollout_rs="token_k1")
    with pytest.raises(ValueError, match="loss_type"):
        CorrectionConfig(loss_type="grpo")
    with pytest.raises(ValueError, match="prob_diff_eps"):
        CorrectionConfig(prob_diff_eps=0.0)


def test_correct_typed_entry_with_prob_diff_mask():
    # p_old vs p_rollout: .9/.5 (diff .4 > .3 -> masked), .6/.5 (.1 kept), .5/.5 kept
    old = torch.log(torch.tensor([[0.9, 0.6, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    mask = torch.ones(1, 3)
    cfg = CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, prob_diff_eps=0.3)
    res = correct(cfg, old.requires_grad_(), rollout, mask)
    torch.testing.assert_close(res.response_mask, torch.tensor([[0.0, 1, 1]]))
    torch.testing.assert_close(res.weights, torch.tensor([[1.8, 1.2, 1.0]]))
    assert not res.weights.requires_grad
    assert res.metrics["rollout_corr/prob_diff_masked_fraction"] == approx(1 / 3)
    assert res.metrics["rollout_corr/prob_diff_max"] == approx(0.4)
    assert res.metrics["rollout_corr/prob_diff_mean"] == approx(0.5 / 3)
    assert res.metrics["rollout_corr/rollout_is_mean"] == approx(4.0 / 3)
    assert correct(CorrectionConfig(), old, rollout, mask).weights is None  # IS off


def test_batch_dict_entry_and_bypass_mode():
    old, rollout, mask = batch()
    b = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}
    out, m = compute_rollout_correction_and_add_to_batch(
        b, {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": 2.0})
    torch.testing.assert_close(out["response_mask"], torch.tensor([[1.0, 1, 0], [0, 0, 0]]))
    torch.testing.assert_close(out["rollout_is_weights"], torch.tensor([[2.0, 1, 0.25], [2, 0, 0]]))
    apply_bypass_mode(b)
    assert b["old_log_probs"] is rollout
    # bypass: IS/RS against the current policy; with pi_old := mu_old the weights are pi_theta/mu_old
    logprobs = rollout + torch.tensor([[L2, 0, 0], [0, 0, 0]])
    res = correct(CorrectionConfig(rollout_is="token", bypass_mode=True), logprobs, b["old_log_probs"], mask)
    torch.testing.assert_close(res.weights, torch.tensor([[2.0, 1, 1], [1, 0, 0]]))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        apply_bypass_mode({"old_log_probs": old})


def test_is_split_metrics():
    rollout = torch.zeros(1, 2)
    old = torch.tensor([[L2, 0.0]])  # mismatch r = [2, 1]
    logprobs = torch.tensor([[L2, L2]])  # staleness r = [1, 2], total r = [2, 2]
    m = is_split_metrics(logprobs, old, rollout, torch.ones(1, 2))
    assert m["is_split/mismatch_mean"] == approx(1.5) and m["is_split/staleness_mean"] == approx(1.5)
    assert m["is_split/total_mean"] == approx(2.0) and m["is_split/total_log_std"] == approx(0.0)
    assert m["is_split/mismatch_log_mean"] == approx(L2 / 2) and m["is_split/mismatch_log_std"] == approx(L2 / 2)
    assert m["is_split/mismatch_max"] == approx(2.0) and m["is_split/staleness_min"] == approx(1.0)
    assert m["is_split/mismatch_k3"] == approx((1 - L2) / 2)
    assert m["is_split/mismatch_log_var_share"] == approx(0.5)
    assert m["is_split/log_corr"] == approx(-1.0)  # the two parts cancel exactly here
    pad = torch.tensor([[float("nan")]])  # a padding column of garbage changes nothing
    padded = is_split_metrics(*(torch.cat([t, pad], 1) for t in (logprobs, old, rollout)),
                              torch.tensor([[1.0, 1.0, 0.0]]))
    assert padded == m
    logprobs[0, 1] = float("nan")
    with pytest.raises(ValueError, match="logprobs is nan at row 0, position 1"):
        is_split_metrics(logprobs, old, rollout, torch.ones(1, 2))


def test_fractional_response_mask_is_refused():
    old, rollout, mask = batch()
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        compute_rollout_correction_and_rejection_mask(old, rollout, mask * 0.5, "token")
