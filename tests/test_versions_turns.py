"""Weight versions inside a multi-turn trajectory (trainer/actor/versions.py): a trajectory whose turns
were sampled by different versions (it spanned a push) gets per-position version spans, pi_gen of
each token is the actor's forward under the version that sampled its turn (so the IS split's
version part is exact per turn), and the sampled tokens of turns older than the trajectory's
newest one can be masked out of the loss."""

from dataclasses import replace

import torch

from lockstep.replay import ReplayMode
from lockstep.rollout.agent import TrajectoryInfo, Turn
from lockstep.rollout.types import GenerationResult
from lockstep.trainer.objective.correction import version_split_metrics
from lockstep.trainer.actor.versions import row_versions, stale_turn_mask

MODE = ReplayMode.R2  # pi_old's plan: the version's own routing, what actor.logprobs gives


def _trajectory(versions: list[str], P: int = 3, sampled: int = 2, obs: int = 1):
    turns, start = [], P
    for i, v in enumerate(versions):
        last = i == len(versions) - 1
        turns.append(Turn(start, sampled, 0 if last else obs, v, "length"))
        start += sampled + (0 if last else obs)
    R = start - P
    return GenerationResult("r", 0, [1] * P, [4] * R, torch.zeros(R), None,
                            {"type": "trajectory"}, versions[0],
                            trajectory=TrajectoryInfo(turns=turns))


def test_row_versions_and_stale_turns():
    one = _trajectory(["3", "3"])
    two = _trajectory(["2", "2", "3"])
    single = replace(one, trajectory=None)
    assert row_versions([one, single]) == ["3", "3"]  # one version: the row's
    spans = row_versions([two])[0]
    assert spans == (("2", 3, 6), ("2", 6, 9), ("3", 9, 11))  # each turn + its observation
    m = stale_turn_mask([spans, "3"], 12)
    assert m[0].tolist() == [False] * 3 + [True] * 6 + [False] * 3 and not m[1].any()


def test_pi_gen_of_each_turn_is_under_the_version_that_sampled_it():
    """Step 3 of a k=2 run on the torch actor: each row's 3 response tokens were sampled by
    versions 0, 1 (two pushes during the trajectory) and 2 (current). pi_gen of each token is
    the forward under its turn's version: ignoring a turn's version breaks it."""
    from lockstep.trainer.actor.torch_actor import TorchActor
    from lockstep.trainer.config.sections import ActorConfig
    from lockstep.trainer.objective.correction import CorrectionConfig
    from lockstep.trainer.objective.losses import LossConfig
    from lockstep.trainer.actor.rank import UpdateInputs
    from lockstep.trainer.actor.versions import VersionSplit
    from test_router_families import _actor_batch, make
    model = make("qwen3_softmax_topk")
    batch = _actor_batch(model)  # prompt 4, response 3 tokens (positions 4, 5, 6)
    actor = TorchActor(model, ActorConfig(mini_batch_size=4, micro_batch_size=4, lr=1e-2), 3)
    split, mask_BT = VersionSplit(2), batch.response_mask_BT.float()
    want = {}
    for step in (1, 2):
        want[str(step - 1)] = actor.logprobs(batch).logprobs_BT
        old = actor.old_logprobs(batch, MODE, step)
        split.gen_logprobs(actor, batch, [str(step - 1)] * 4, old.logprobs_BT, MODE, step)
        actor.policy_update(batch, UpdateInputs(
            old.logprobs_BT, torch.linspace(-1, 1, 4)[:, None] * mask_BT, mask_BT, None, 7,
            LossConfig(), CorrectionConfig()), MODE, step)
    old = actor.old_logprobs(batch, MODE, 3)
    spans = [(("0", 0, 5), ("1", 5, 6), ("2", 6, 7))] * 4  # a token per turn and version
    gen = split.gen_logprobs(actor, batch, spans, old.logprobs_BT, MODE, 3)
    for t, v in ((4, "0"), (5, "1")):  # the same rows and micro-batches: bit for bit
        assert torch.equal(gen[:, t], want[v][:, t]), v
        assert float((gen[:, t] - old.logprobs_BT[:, t]).abs().max()) > 1e-3  # weights moved
    assert float((want["0"] - want["1"])[:, 4:7].abs().max()) > 1e-3
    assert torch.equal(gen[:, 6], old.logprobs_BT[:, 6])  # the current turn: pi_old
    # the IS split's version part: exactly 1 on the current turn, not on the stale ones
    cur, stale = torch.zeros_like(mask_BT), torch.zeros_like(mask_BT)
    cur[:, 6], stale[:, 4:6] = 1, 1
    m = version_split_metrics(old.logprobs_BT, gen, batch.rollout_logprobs_BT, cur)
    assert m["is_split/version_mean"] == 1.0 and m["is_split/version_log_std"] == 0
    m = version_split_metrics(old.logprobs_BT, gen, batch.rollout_logprobs_BT, stale)
    assert m["is_split/version_log_std"] > 1e-4
