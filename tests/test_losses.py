"""Policy losses, advantages, KL and aggregation with hand-computed numbers."""

import math

import pytest
import torch

from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import (KL_ESTIMATORS, LossConfig, agg_loss, grpo_advantages, gspo_loss, kl_penalty, policy_loss,
                                     ppo_clip_loss)

# shared PPO case: ratio r = pi/pi_old = [1.5, .5, .5, 5], advantages [1, 1, -1, -1]
R = [1.5, 0.5, 0.5, 5.0]


def ppo_case():
    lp = torch.log(torch.tensor([R])).requires_grad_()
    return lp, torch.zeros(1, 4), torch.tensor([[1.0, 1, -1, -1]]), torch.ones(1, 4)


def approx(x):
    return pytest.approx(x, rel=1e-5, abs=1e-6)


def test_ppo_dual_clip_hand_computed():
    lp, old, adv, mask = ppo_case()
    loss, m = ppo_clip_loss(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    # tok0 A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped)      tok1 A=+1 r=.5: max(-.5, -.8) = -.5
    # tok2 A=-1 r=.5: max(.5, .8) = .8 (clipped)              tok3 A=-1 r=5: max(5, 1.2) = 5 -> dual min(3, 5) = 3
    assert loss.item() == approx((-1.2 - 0.5 + 0.8 + 3.0) / 4)
    assert m["actor/pg_clipfrac"] == approx(2 / 4) and m["actor/pg_clipfrac_lower"] == approx(1 / 4)
    assert m["actor/ppo_kl"] == approx(-sum(math.log(r) for r in R) / 4)
    (g,) = torch.autograd.grad(loss, lp)
    # only tok1 is unclipped: d(-A r)/d log pi = -A r = -.5, / 4 tokens
    torch.testing.assert_close(g, torch.tensor([[0.0, -0.125, 0.0, 0.0]]))
    loss, m = ppo_clip_loss(lp, old, adv, mask, clip_ratio_c=None)
    assert loss.item() == approx((-1.2 - 0.5 + 0.8 + 5.0) / 4) and m["actor/pg_clipfrac_lower"] == 0.0
    # asymmetric clip-higher: hi .6 leaves r = 1.5 unclipped -> tok0 = -1.5
    loss, _ = ppo_clip_loss(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.6)
    assert loss.item() == approx((-1.5 - 0.5 + 0.8 + 3.0) / 4)
    # decoupled IS weights multiply the per-token loss
    loss, _ = ppo_clip_loss(lp, old, adv, mask, is_weights=torch.tensor([[2.0, 1, 1, 0]]))
    assert loss.item() == approx((-2.4 - 0.5 + 0.8 + 0.0) / 4)


def test_agg_modes_and_global_counts():
    loss_mat = torch.tensor([[1.0, 2, 3], [4, 9, 9], [7, 7, 7]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2 empty: excluded from seq means
    assert agg_loss(loss_mat, mask, "token-mean").item() == approx((1 + 2 + 3 + 4) / 4)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == approx((2 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == approx((6 + 4) / 2)
    assert agg_loss(loss_mat, mask, "token-mean", num_tokens=8).item() == approx(10 / 8)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum", num_seqs=5).item() == approx(10 / 5)
    with pytest.raises(ValueError, match="valid: token-mean"):
        agg_loss(loss_mat, mask, "token-sum-norm")


def test_grpo_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
    groups = ["a", "a", "b", "b", "c"]
    mask = torch.tensor([[1.0, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    adv = grpo_advantages(rewards, groups, mask, epsilon=1e-6)
    s = math.sqrt(0.5**2 * 2 / 1)  # group a: mean .5, unbiased std .7071
    expect = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0, 0.0, 0.5 / (1 + 1e-6)]  # b: std 0 -> 0; c: single -> mean 0, std 1
    torch.testing.assert_close(adv, torch.tensor(expect)[:, None] * mask)
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 1, 1, 2]), mask, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0, 0, 0.5])[:, None] * mask)
    with pytest.raises(ValueError, match="reward is NaN for sample 2"):
        grpo_advantages(torch.tensor([1.0, 0, float("nan"), 1, 1]), groups, mask)


def test_kl_estimators():
    lp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert kl_penalty(lp, ref, "k1").item() == approx(math.log(2))
    assert kl_penalty(lp, ref, "k2").item() == approx(math.log(2) ** 2 / 2)
    assert kl_penalty(lp, ref, "k3").item() == approx(0.5 + math.log(2) - 1)  # e^{-ln2} - (-ln2) - 1
    # clamps: log ratio -30 -> -20, e^-20 + 20 - 1 = 19 -> capped at 10
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "k3").item() == approx(10.0)
    with pytest.raises(ValueError, match="valid: kl, k1, abs, mse, k2, low_var_kl, k3"):
        kl_penalty(lp, ref, "low_var")


def test_kl_loss_types_match_verl_kl_penalty():
    """Every verl 0.9.1 name (and its "+" straight-through form) gives verl's value and grad."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 5, generator=g)
    for name in KL_ESTIMATORS:
        ours_lp = (ref + torch.randn(3, 5, generator=g)).requires_grad_()
        theirs_lp = ours_lp.detach().clone().requires_grad_()
        ours = kl_penalty(ours_lp, ref, name)
        theirs = core_algos.kl_penalty(theirs_lp, ref, name)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
        ours.sum().backward()
        theirs.sum().backward()
        torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=0, atol=0, msg=name)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-1.0]), "abs").item() == approx(1.0)


def test_gspo_sequence_ratio_value_and_per_token_gradient():
    lp = torch.tensor([[math.log(2), 0.0], [0.0, -math.log(2)]], requires_grad=True)
    old, mask = torch.zeros(2, 2), torch.ones(2, 2)
    adv = torch.tensor([[1.0, 1], [-1, -1]])
    # s0 = exp(ln2/2) = 1.414 -> clip at 1.2 -> -1.2 ; s1 = 2^-1/2 = .707, A<0 -> max(.707, .8) = .8
    loss, m = gspo_loss(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.item() == approx((-1.2 + 0.8) / 2) and m["actor/pg_clipfrac"] == approx(1.0)
    loss, _ = gspo_loss(lp, old, adv, mask, clip_ratio_low=0.5, clip_ratio_high=0.5)  # nothing clipped
    (g,) = torch.autograd.grad(loss, lp)
    # d/dlogpi_t of -A s (value s, gradient through pi/sg(pi) per token): -A s, / 2 tokens / 2 seqs
    s0, s1 = math.sqrt(2), 1 / math.sqrt(2)
    torch.testing.assert_close(g, torch.tensor([[-s0 / 4, -s0 / 4], [s1 / 4, s1 / 4]]))


def test_policy_loss_with_kl_and_entropy():
    lp, old, adv, mask = ppo_case()
    ref = lp.detach() - 0.1  # k1 = 0.1 everywhere
    ent = torch.full((1, 4), 2.0)
    out = policy_loss(LossConfig(kl_coef=0.5, kl_loss_type="k1", entropy_coef=0.01), lp, old, adv, mask,
                      ref_logprobs=ref, entropy=ent)
    pg = (-1.2 - 0.5 + 0.8 + 3.0) / 4
    assert out.loss.item() == approx(pg + 0.5 * 0.1 - 0.01 * 2.0)
    assert out.metrics["actor/pg_loss"] == approx(pg) and out.metrics["actor/kl_loss"] == approx(0.1)
    assert out.metrics["actor/entropy"] == approx(2.0)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(LossConfig(kl_coef=0.1), lp, old, adv, mask)


def test_bypass_mode_ppo_and_reinforce():
    lp, _, adv, mask = ppo_case()
    rollout = torch.zeros(1, 4)  # pi_old := mu_old, so the PPO ratio is pi/mu = R
    corr = CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                            rollout_rs_threshold=2.0, bypass_mode=True)
    # RS token_k1 U=2 keeps r in [.5, 2]: tok3 (r=5) rejected -> mask [1, 1, 1, 0]
    out = policy_loss(LossConfig(), lp, torch.full((1, 4), -9.0), adv, mask, correction=corr, rollout_logprobs=rollout)
    assert out.loss.item() == approx((-1.2 - 0.5 + 0.8) / 3)  # old_logprobs argument ignored in bypass
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"] == approx(1 / 4)
    corr.loss_type = "reinforce"
    out = policy_loss(LossConfig(), lp, None, adv, mask, correction=corr, rollout_logprobs=rollout)
    # -A log pi w with w = clamp(r, max=2) = [1.5, .5, .5]: -ln1.5*1.5 - ln.5*.5 + ln.5*.5
    assert out.loss.item() == approx(-math.log(1.5) * 1.5 / 3)


def test_loss_config_validation():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="valid: token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        LossConfig(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="loss: unknown keys \\['clip'\\]; valid keys are"):
        LossConfig.from_dict({"clip": 0.2})
