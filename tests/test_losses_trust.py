"""Newer trust regions and masks in the policy loss (issue 20 items 2-3), with hand-computed numbers
and verl 0.9.1's own `core_algos` where verl has them (DPPO's binary-TV / binary-KL masks);
DeepSeek-V3.2's OPSM and unbiased KL (slime's `--use-opsm`, `--use-unbiased-kl`) by hand."""

import math

import pytest
import torch

from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import LossConfig, dppo_loss, policy_loss


def approx(x):
    return pytest.approx(x, rel=1e-5, abs=1e-6)


# p_old, p, A per token: tok0 rises past the TV bound (A > 0), tok2 falls past it (A < 0), tok4 is
# inside the TV bound but outside the binary-KL one (p_old .9 -> .999: KL .3666 > .2)
P_OLD = [0.5, 0.5, 0.5, 0.5, 0.9]
P = [0.8, 0.6, 0.2, 0.45, 0.999]
A = [1.0, 1, -1, -1, 1]


def dppo_case():
    lp = torch.log(torch.tensor([P])).requires_grad_()
    return lp, torch.log(torch.tensor([P_OLD])), torch.tensor([A]), torch.ones(1, 5)


def test_dppo_tv_and_kl_hand_computed():
    r = [p / q for p, q in zip(P, P_OLD)]  # [1.6, 1.2, .4, .9, 1.11]
    for mode, keep in (("tv", [0, 1, 0, 1, 1]), ("kl", [0, 1, 0, 1, 0])):
        lp, old, adv, mask = dppo_case()
        loss, m = dppo_loss(lp, old, adv, mask, divergence=mode, clip_ratio_low=0.2, clip_ratio_high=0.2)
        want = sum(-a * ri * math.log(p) * k for a, ri, p, k in zip(A, r, P, keep)) / 5
        assert loss.item() == approx(want), mode
        assert m["actor/pg_clipfrac"] == approx(1 - sum(keep) / 5)
        (g,) = torch.autograd.grad(loss, lp)  # -A sg(r) on kept tokens, / 5 tokens
        torch.testing.assert_close(g, torch.tensor([[-a * ri * k / 5 for a, ri, k in zip(A, r, keep)]]))
    # truncation at clip_ratio_c: tok1's r = 1.2 -> 1.1, counted in pg_clipfrac_lower (tok4: 1.11 too)
    lp, old, adv, mask = dppo_case()
    loss, m = dppo_loss(lp, old, adv, mask, divergence="tv", clip_ratio_c=1.1)
    assert loss.item() == approx((-1.1 * math.log(0.6) + 0.9 * math.log(0.45) - 1.1 * math.log(0.999)) / 5)
    assert m["actor/pg_clipfrac_lower"] == approx(2 / 5)


class _VerlActorConfig:
    """The attributes verl's dppo losses read from its ActorConfig."""

    def __init__(self, low, high, c):
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = low, low, high
        self._c, self.global_batch_info = c, {}

    def get(self, key, default=None):
        return self._c if key == "clip_ratio_c" else default


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_matches_verl(mode):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(3)
    B, T = 6, 11
    old = -torch.rand(B, T, generator=g) * 2
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    w = torch.rand(B, T, generator=g) * 2
    for low, high, c, agg, weights in ((0.2, 0.2, 3.0, "token-mean", None), (0.05, 0.1, 1.5, "token-mean", w),
                                       (0.1, 0.3, 3.0, "seq-mean-token-mean", w)):
        lp0 = (old + torch.randn(B, T, generator=g) * 0.4).clamp(max=-1e-3)
        ours_lp, theirs_lp = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
        cfg = LossConfig(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, loss_agg_mode=agg,
                         loss_mode=mode)
        ours = policy_loss(cfg, ours_lp, old, adv, mask, is_weights=weights)
        fn = core_algos.get_policy_loss_fn(mode)
        theirs, theirs_m = fn(old, theirs_lp, adv, mask, loss_agg_mode=agg,
                              config=_VerlActorConfig(low, high, c), rollout_is_weights=weights)
        torch.testing.assert_close(ours.loss, theirs, rtol=1e-6, atol=1e-7)
        ours.loss.backward()
        theirs.backward()
        torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-6, atol=1e-8)
        for k, v in theirs_m.items():
            assert ours.metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (mode, k)
        assert 0 < ours.metrics["actor/pg_clipfrac"] < 1  # the masks do act in these cases


def test_loss_mode_config():
    with pytest.raises(ValueError, match="unknown loss_mode 'dppo'; valid: vanilla, dppo_tv, dppo_kl"):
        LossConfig(loss_mode="dppo")
    with pytest.raises(ValueError, match="loss_mode=dppo_kl is a per-token loss; it needs ratio_level=token"):
        LossConfig(loss_mode="dppo_kl", ratio_level="sequence")


def test_opsm_masks_negative_advantage_sequences_far_off_policy():
    # rows: A = -1 with mean log(mu/pi) = ln(1.25)/2 = .1116 > .1 (masked); the same with A = +1
    # (kept); A = -.5 on policy (kept). old = pi, so the PPO ratio is 1 and the term is -A per token
    mu = torch.log(torch.tensor([[0.5, 0.5]] * 3))
    lp = torch.log(torch.tensor([[0.4, 0.5], [0.4, 0.5], [0.5, 0.5]])).requires_grad_()
    adv, mask = torch.tensor([[-1.0, -1], [1, 1], [-0.5, -0.5]]), torch.ones(3, 2)
    kw = dict(rollout_logprobs=mu)
    off = policy_loss(LossConfig(), lp, lp.detach(), adv, mask, **kw)
    on = policy_loss(LossConfig(opsm_delta=0.1), lp, lp.detach(), adv, mask, **kw)
    assert off.loss.item() == approx((2 - 2 + 1) / 6)
    assert on.loss.item() == approx((-2 + 1) / 6)  # the masked row leaves the sum, not the denominator
    assert on.metrics["actor/opsm_masked_fraction"] == approx(2 / 6)
    assert on.metrics["actor/opsm_kl"] == approx(2 * math.log(1.25) / 6)
    (g,) = torch.autograd.grad(on.loss, lp)
    assert g[0].abs().sum() == 0 and g[1].abs().sum() > 0
    # delta above the row's KL: nothing masked; opsm_logprobs=old measures against pi_old = pi: 0
    assert policy_loss(LossConfig(opsm_delta=0.12), lp, lp.detach(), adv, mask, **kw).loss.item() == approx(1 / 6)
    assert policy_loss(LossConfig(opsm_delta=0.1, opsm_logprobs="old"), lp, lp.detach(), adv, mask,
                       **kw).metrics["actor/opsm_masked_fraction"] == 0.0
    # bypass REINFORCE: pi_old := mu; OPSM multiplies the IS-weighted -A log pi
    byp = CorrectionConfig(rollout_is="token", bypass_mode=True, loss_type="reinforce")
    out = policy_loss(LossConfig(opsm_delta=0.1), lp, None, adv, mask, correction=byp, **kw)
    w = [[0.8, 1.0], [0.8, 1.0], [1.0, 1.0]]  # pi/mu
    lpv = lp.detach().tolist()
    want = sum(-adv[i, t].item() * lpv[i][t] * w[i][t] for i in (1, 2) for t in (0, 1)) / 6
    assert out.loss.item() == approx(want)
    with pytest.raises(ValueError, match="opsm_delta must be >= 0"):
        LossConfig(opsm_delta=-1.0)
    with pytest.raises(ValueError, match="valid: rollout, old"):
        LossConfig(opsm_logprobs="ref")


def test_unbiased_kl_weights_the_estimate_by_pi_over_pi_old():
    # pi = .5, pi_old = .25 (r = 2), ref = .25: k1 = ln 2, unbiased 2 ln 2; d/dlog pi (r k1) = r k1 + r
    lp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    old = ref = torch.log(torch.tensor([[0.25]]))
    zero, one = torch.zeros(1, 1), torch.ones(1, 1)
    for unbiased, value, grad in ((False, math.log(2), 1.0), (True, 2 * math.log(2), 2 * math.log(2) + 2)):
        cfg = LossConfig(kl_coef=1.0, kl_loss_type="k1", unbiased_kl=unbiased)
        out = policy_loss(cfg, lp, old, zero, one, ref_logprobs=ref)
        assert out.metrics["actor/kl_loss"] == approx(value)
        (g,) = torch.autograd.grad(out.loss, lp)
        assert g.item() == approx(grad)
    # low_var_kl: r = e^5, k3 = e^-1 + 1 - 1 = .368 -> r k3 = 54.6, clamped to 10 (as slime does)
    cfg = LossConfig(kl_coef=1.0, kl_loss_type="low_var_kl", unbiased_kl=True)
    out = policy_loss(cfg, torch.zeros(1, 1), torch.full((1, 1), -5.0), zero, one, ref_logprobs=-one)
    assert out.metrics["actor/kl_loss"] == approx(10.0)
