"""Replay mode parsing and the per-forward replay plans of off / R2 / R3."""

import pytest
import torch

from lockstep.replay import (
    NO_REPLAY,
    ReplayMode,
    RouteError,
    RoutingTrace,
    batch_traces,
    old_logprob_plan,
    update_plan,
)


def rollout_batch():
    """Two samples of 4 and 2 tokens in a batch of T=5: 3 and 1 route rows."""
    traces = [RoutingTrace(torch.tensor([[[0, 1]], [[2, 3]], [[1, 3]]]), 4),
              RoutingTrace(torch.tensor([[[3, 2]]]), 4)]
    return batch_traces(traces, T=5, seq_lens=[4, 2])


def test_parse_modes():
    assert ReplayMode.parse("off") is ReplayMode.OFF
    assert ReplayMode.parse("R2") is ReplayMode.R2
    assert ReplayMode.parse("r3") is ReplayMode.R3
    assert ReplayMode.parse(ReplayMode.R3) is ReplayMode.R3
    assert str(ReplayMode.R2) == "R2" and ReplayMode.R2 == "R2"
    with pytest.raises(ValueError, match=r"unknown replay mode 'R4'; valid: \['off', 'R2', 'R3'\]"):
        ReplayMode.parse("R4")
    with pytest.raises(ValueError, match="unknown replay mode None"):
        ReplayMode.parse(None)


def test_r3_replays_rollout_routes_in_both_forwards_with_token_mask():
    ids, valid = rollout_batch()
    old = old_logprob_plan("R3", ids, valid)
    upd = update_plan("R3", ids, valid)
    for plan in (old, upd):
        assert plan.replays and not plan.record
        assert plan.routes_BTLK is ids
        # last token of each sample and padding route naturally
        assert plan.replay_mask_BT.tolist() == [[True, True, True, False, False],
                                                [True, False, False, False, False]]


def test_r2_records_then_replays_recorded_routes():
    ids, valid = rollout_batch()
    old = old_logprob_plan("R2", ids, valid)
    assert old.record and not old.replays  # natural routing, recorded
    recorded = torch.randint(0, 4, (2, 5, 1, 2))  # what out.routes_BTLK of that forward held
    upd = update_plan("R2", ids, valid, recorded_routes_BTLK=recorded)
    assert upd.routes_BTLK is recorded and not upd.record
    assert bool(upd.replay_mask_BT.all())  # the trainer routed every position
    token_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    upd = update_plan("R2", recorded_routes_BTLK=recorded, recorded_valid_BT=token_mask)
    assert torch.equal(upd.replay_mask_BT, token_mask)


def test_off_never_replays():
    ids, valid = rollout_batch()
    assert old_logprob_plan("off", ids, valid) == NO_REPLAY
    assert update_plan(ReplayMode.OFF, ids, valid, ids, valid) == NO_REPLAY
    assert not NO_REPLAY.replays and not NO_REPLAY.record


def test_plan_errors():
    ids, valid = rollout_batch()
    with pytest.raises(RouteError, match="replay mode R3 needs rollout routes, got None"):
        old_logprob_plan("R3")
    with pytest.raises(RouteError, match="replay mode R2 needs routes recorded by the old-log-prob forward"):
        update_plan("R2", ids, valid)
    with pytest.raises(RouteError, match=r"replay mask for rollout routes must be bool \(2, 5\), got torch.bool \(2, 4\)"):
        update_plan("R3", ids, valid[:, :4])
    with pytest.raises(RouteError, match=r"must be an integer \[B, T, L, K\] tensor, got torch.float32"):
        old_logprob_plan("R3", ids.float(), valid)
    with pytest.raises(ValueError, match="unknown replay mode 'R1'"):
        update_plan("R1", ids, valid)
