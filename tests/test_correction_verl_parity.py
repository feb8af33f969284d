"""Our verl-compatible entry points vs verl 0.9.1's own rollout_corr_helper on the same inputs.

Needs `verl==0.9.1` (installed with --no-deps) plus tensordict, omegaconf, codetiming, orjson.
verl's `import verl` pulls `verl.protocol`, which imports `ray` only to name `ray.ObjectRef` in
annotations; ray is not installed on CPU machines, so when it is missing `_import_verl` sets an
empty placeholder in `sys.modules` with pytest's MonkeyPatch for the duration of the import only,
which puts back whatever was there before (nothing of ray runs in the functions compared here).
Skipped when verl or its light dependencies are missing.
"""

import itertools
import sys
import types

import pytest
import torch

from lockstep.trainer.objective import rollout_corr as ours


def _import_verl(name: str):
    """Import verl module `name` (skip when verl or its light dependencies are missing); when ray
    is missing a placeholder stands in for it during this import only."""
    for dep in ("tensordict", "omegaconf", "codetiming", "orjson"):
        pytest.importorskip(dep)
    with pytest.MonkeyPatch.context() as mp:
        try:
            import ray  # noqa: F401
        except ImportError:
            placeholder = types.ModuleType("ray")
            placeholder.ObjectRef = type("ObjectRef", (), {})
            mp.setitem(sys.modules, "ray", placeholder)
        return pytest.importorskip(name)


verl = _import_verl("verl.trainer.ppo.rollout_corr_helper")


def _batch(seed, B=6, T=9, scale=0.3, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 3
    old = rollout + torch.randn(B, T, generator=g) * scale
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_row:
        lengths[1] = 0
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return old, rollout, mask


IS_CASES = [(None, 2.0), ("token", 2.0), ("token", "0.5_2.0"), ("token", 1.2), ("sequence", 2.0),
            ("sequence", "0.5_5.0"), ("token", "0.8_1.25")]
RS_CASES = [(None, None), ("token_k1", 1.5), ("token_k1", "0.7_1.3"), ("token_k2", 0.02), ("token_k3", 0.02),
            ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1), ("seq_mean_k1", 1.1),
            ("seq_mean_k2", 0.01), ("seq_mean_k3", 0.01), ("seq_max_k2", 0.05), ("seq_max_k3", 0.05),
            ("token_k1,seq_mean_k3", "0.8_1.2,0.01"), ("seq_max_k2, token_k3 ,seq_max_k2", "0.05")]


def _compare(args, kw):
    w0, m0, met0 = verl.compute_rollout_correction_and_rejection_mask(*args, **kw)
    w1, m1, met1 = ours.compute_rollout_correction_and_rejection_mask(*args, **kw)
    if w0 is None:
        assert w1 is None
    else:
        torch.testing.assert_close(w1, w0.batch["rollout_is_weights"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m1, m0)
    assert set(met1) == set(met0), set(met1) ^ set(met0)
    for k in met0:
        assert met1[k] == pytest.approx(met0[k], rel=1e-5, abs=1e-6, nan_ok=True), k


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("is_case,rs_case", list(itertools.product(IS_CASES, RS_CASES[:4])) +
                         [(IS_CASES[1], rs) for rs in RS_CASES[4:]])
def test_parity_random(seed, is_case, rs_case):
    old, rollout, mask = _batch(seed)
    for norm in (False, True):
        _compare((old, rollout, mask), dict(rollout_is=is_case[0], rollout_is_threshold=is_case[1],
                                            rollout_is_batch_normalize=norm, rollout_rs=rs_case[0],
                                            rollout_rs_threshold=rs_case[1]))


@pytest.mark.parametrize("rs", [r for r in RS_CASES if r[0]])
def test_parity_edges_large_ratios_and_clamps(rs):
    # log ratios of +-30 hit the +-20 safety clamp; one valid token only in some rows
    old, rollout, mask = _batch(3, scale=15.0)
    mask[2] = 0
    mask[2, 0] = 1
    for is_case in IS_CASES[1:]:
        _compare((old, rollout, mask), dict(rollout_is=is_case[0], rollout_is_threshold=is_case[1],
                                            rollout_is_batch_normalize=True, rollout_rs=rs[0],
                                            rollout_rs_threshold=rs[1]))


def test_parity_icepop_on_the_bounds_and_single_token():
    # weights exactly 0.5 and 2.0 (inclusive bounds), exactly equal policies, one token in the batch
    rollout = torch.zeros(2, 3)
    old = torch.log(torch.tensor([[0.5, 2.0, 1.0], [2.0001, 0.4999, 1.0]]))
    mask = torch.ones(2, 3)
    _compare((old, rollout, mask), dict(rollout_is="token", rollout_is_threshold="0.5_2.0"))
    # log ratio exactly 0 -> weight exactly 1.0, sitting on the lower bound of "1.0_2.0"
    _compare((rollout, rollout, mask), dict(rollout_is="token", rollout_is_threshold="1.0_2.0"))
    _compare((rollout, rollout, mask), dict(rollout_is="sequence", rollout_is_threshold="0.5_1.0"))
    one = torch.zeros(2, 3)
    one[0, 0] = 1
    _compare((old, rollout, one), dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                       rollout_rs="token_k1", rollout_rs_threshold=2.0))


def test_parity_offpolicy_and_current_policy_metrics():
    old, rollout, mask = _batch(5)
    a = verl.compute_offpolicy_metrics(old, rollout, mask)
    b = ours.compute_offpolicy_metrics(old, rollout, mask)
    assert set(a) == set(b)
    for k in a:
        assert b[k] == pytest.approx(float(a[k]), rel=1e-6), k
    a = verl.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
    b = ours.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
    assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-6) for k in a)


@pytest.mark.parametrize("spec", ["abc", "2_1", "0_2", "-1", "", "1_x"])
def test_parity_bad_is_thresholds_both_raise(spec):
    with pytest.raises(ValueError):
        verl._parse_rollout_is_threshold(spec)
    with pytest.raises(ValueError):
        ours.parse_is_threshold(spec)


@pytest.mark.parametrize("opts,spec", [("token_k2", "0.1_0.2"), ("token_k1,token_k2", "1,2,3"),
                                       ("token_k1", "2_1"), ("seq_sum_k3", "-1"), ("token_k9", "1")])
def test_parity_bad_rs_specs_both_raise(opts, spec):
    old, rollout, mask = _batch(0)
    with pytest.raises(ValueError):
        verl.compute_rollout_rejection_mask(old - rollout, mask, opts, spec)
    with pytest.raises(ValueError):
        ours.compute_rollout_rejection_mask(old - rollout, mask, opts, spec)


# ---------------------------------------------------------------- losses vs verl core_algos
def _import_verl_core():
    core_algos = _import_verl("verl.trainer.ppo.core_algos")
    return core_algos, _import_verl("verl.workers.config.actor").FSDPActorConfig


def test_ray_placeholder_is_scoped_to_the_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees when ray is missing
    monkeypatch.delitem(sys.modules, "verl.protocol")  # imported afresh: it imports ray
    protocol = _import_verl("verl.protocol")
    assert protocol.DataProto and sys.modules["verl.protocol"] is protocol
    assert sys.modules["ray"] is None  # the earlier state is back, no placeholder left behind


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_losses_match_verl_core_algos(agg, seed):
    from lockstep.trainer.objective import losses

    core, ActorCfg = _import_verl_core()
    cfg = ActorCfg(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                   clip_ratio_high=0.28, clip_ratio_c=3.0)
    old, rollout, mask = _batch(seed, scale=0.5)
    g = torch.Generator().manual_seed(seed + 10)
    adv = torch.randn(old.shape, generator=g) * mask
    w = torch.rand(old.shape, generator=g) * 2
    lp0 = (old + torch.randn(old.shape, generator=g) * 0.3).requires_grad_()
    lp1 = lp0.detach().clone().requires_grad_()
    for fn0, fn1, kw in [
        (core.compute_policy_loss_vanilla, losses.ppo_clip_loss,
         dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)),
        (core.compute_policy_loss_gspo, losses.gspo_loss, dict(clip_ratio_low=0.2, clip_ratio_high=0.28)),
    ]:
        l0, m0 = fn0(old, lp0, adv, mask, loss_agg_mode=agg, config=cfg, rollout_is_weights=w)
        l1, m1 = fn1(lp1, old, adv, mask, loss_agg_mode=agg, is_weights=w, **kw)
        assert l1.item() == pytest.approx(l0.item(), rel=1e-5, abs=1e-7)
        for k in m0:
            assert m1[k] == pytest.approx(float(m0[k]), rel=1e-5, abs=1e-7), k
        g0, = torch.autograd.grad(l0, lp0)
        g1, = torch.autograd.grad(l1, lp1)
        torch.testing.assert_close(g1, g0)
    mat = torch.randn(old.shape, generator=g)
    assert losses.agg_loss(mat, mask, agg).item() == pytest.approx(core.agg_loss(mat, mask, agg).item(), rel=1e-6)
    for est in ("k1", "k2", "k3"):
        torch.testing.assert_close(losses.kl_penalty(lp1, rollout, est), core.kl_penalty(lp1, rollout, est))


def test_grpo_advantages_match_verl():
    import numpy as np

    from lockstep.trainer.objective import losses

    core, _ = _import_verl_core()
    g = torch.Generator().manual_seed(0)
    B, T = 13, 5
    rewards = (torch.rand(B, generator=g) > 0.5).float()
    rewards[4] = rewards[5]  # a zero-std group member
    index = np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 5])
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    token_rewards = torch.zeros(B, T)
    token_rewards[:, 0] = rewards
    for norm in (True, False):
        a0, _ = core.compute_grpo_outcome_advantage(token_rewards, mask, index, norm_adv_by_std_in_grpo=norm)
        a1 = losses.grpo_advantages(rewards, index.tolist(), mask, norm_by_std=norm)
        torch.testing.assert_close(a1, a0)
