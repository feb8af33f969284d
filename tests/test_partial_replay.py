"""Partial replay (replay.partial): margin threshold 0 is replay off and infinity is full
replay, bit for bit, in the model and through a whole actor step (old log-probs, update,
weights); the tolerance rule at infinity is full replay; the replayed fraction per layer."""

import copy
import math

import pytest
import torch

from lockstep.moe.replay_check import ReplayCheck
from lockstep.replay import PartialReplay, ReplayOptions
from lockstep.rollout.engine import Engine
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import LossConfig
from lockstep.trainer.actor.rank import UpdateInputs
from lockstep.trainer.objective.stats import stats_values

from server_fixtures import ENGINE, model  # noqa: F401 (pytest fixture)

INF = math.inf


def _batch(model):
    """Engine samples whose routes are replaced by arbitrary top-k sets, so that replaying
    them differs from routing naturally almost everywhere."""
    g = torch.Generator().manual_seed(4)
    reqs = [GenerateRequest(torch.randint(3, 40, (p,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=8, seed=3 + i, n=2, ignore_eos=True))
            for i, p in enumerate([5, 8])]
    c = model.cfg
    batch = collate(Engine.from_model(model, ENGINE).generate(reqs), 0, c.num_experts,
                    c.num_moe_layers, c.num_experts_per_tok)
    B, T, L, K = batch.rollout_routes_BTLK.shape
    batch.rollout_routes_BTLK = torch.rand(B, T, L, c.num_experts, generator=g).topk(
        K, -1).indices.to(batch.rollout_routes_BTLK.dtype)
    return batch


def _step(model, batch, mode, partial):
    """One actor step: (pi_old, the update's stats, the updated weights); the replay validator
    checks every token (partial replay's natural pairs must not count as ignored ids)."""
    actor = TorchActor(copy.deepcopy(model), ActorConfig(mini_batch_size=2, micro_batch_size=2,
                       lr=1e-2), total_updates=2, replay=ReplayOptions(partial=partial),
                       replay_check=ReplayCheck.FULL, min_overlap=0.0)
    old = actor.old_logprobs(batch, mode, step=1)
    mask_BT = batch.response_mask_BT.float()
    adv_BT = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask_BT
    upd = actor.policy_update(batch, UpdateInputs(old.logprobs_BT, adv_BT, mask_BT, None, 3,
                                                  LossConfig(), CorrectionConfig()), mode, 1)
    return old.logprobs_BT, stats_values(upd.stats), list(actor.master.parameters())


def _same(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_margin_zero_is_replay_off_and_infinity_is_full_replay(model):
    batch = _batch(model)
    off, r3 = _step(model, batch, "off", None), _step(model, batch, "R3", None)
    assert not _same(off, r3)  # the replayed routes matter
    zero = _step(model, batch, "R3", PartialReplay("margin", 0.0))
    inf = _step(model, batch, "R3", PartialReplay("margin", INF))
    assert _same(zero, off) and _same(inf, r3)
    layers = [f"replay/partial_fraction/layer_{i}" for i in model.cfg.moe_layer_ids]
    assert zero[1]["replay/partial_fraction"] == 0.0 and all(zero[1][k] == 0.0 for k in layers)
    assert inf[1]["replay/partial_fraction"] == 1.0 and all(inf[1][k] == 1.0 for k in layers)
    assert inf[1]["replay/mismatch"] == 0.0 and zero[1]["replay/mismatch"] == 0.0


def test_tolerance_infinity_is_full_replay_and_thresholds_between_replay_part(model):
    batch = _batch(model)
    blocks = copy.deepcopy(model)
    args = dict(routed_experts_BTLK=batch.rollout_routes_BTLK,
                replay_mask_BT=batch.rollout_routes_valid_BT)
    full = blocks(batch.input_ids_BT, **args)
    tol = blocks(batch.input_ids_BT, **args, partial_replay=PartialReplay("tolerance", INF))
    assert torch.equal(tol.logits_BTV, full.logits_BTV)
    out = blocks(batch.input_ids_BT, **args, partial_replay=PartialReplay("tolerance", 0.05))
    frac = float(out.replayed_BTL[batch.rollout_routes_valid_BT].float().mean())
    assert 0.0 < frac < 1.0
    # where a layer did not replay, it ran its own top-k
    nat = ~out.replayed_BTL
    assert torch.equal(out.routes_BTLK[nat], out.natural_BTLK[nat])
    rep = out.replayed_BTL
    assert torch.equal(out.routes_BTLK[rep], batch.rollout_routes_BTLK[rep].long())


@pytest.mark.parametrize("overrides, message", [
    (["replay.mode=off"], "replay.mode=off replays none"),
    (["actor.backend=megatron"], "RouterReplay replays every token of a layer or none"),
    (["replay.partial.threshold=-1"], r"threshold=-1.0 is outside \[0.0, inf\)"),
])
def test_config(overrides, message):
    base = ["replay.partial.rule=margin", "replay.partial.threshold=0.01"]
    cfg = load_config("configs/toy_r3.yaml", overrides=base)
    assert cfg.replay.options().partial == PartialReplay("margin", 0.01)
    with pytest.raises(Exception, match=message):
        load_config("configs/toy_r3.yaml", overrides=base + overrides)
