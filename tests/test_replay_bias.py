"""The replay bias meter (trainer/actor/replay_bias.py): 0 under replay off by definition; under R3,
after an update, a flip rate and a KL > 0 that equal a direct computation."""

import copy

import torch

from lockstep.replay import ReplayOptions
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.rank import UpdateInputs
from lockstep.trainer.actor.replay_bias import sampled_rows
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import LossConfig
from lockstep.trainer.objective.stats import stats_values

from server_fixtures import model  # noqa: F401 (pytest fixture)


def _run(model, mode, rows=0.5):
    """bf16 engine samples, one fp32 actor step (lr large enough to move the routers)."""
    g = torch.Generator().manual_seed(6)
    reqs = [GenerateRequest(torch.randint(3, 40, (p,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=8, seed=11 + i, n=2, ignore_eos=True))
            for i, p in enumerate([6, 9])]
    c = model.cfg
    results = Engine.from_model(model, EngineConfig(dtype="bf16", max_len=48)).generate(reqs)
    batch = collate(results, 0, c.num_experts, c.num_moe_layers, c.num_experts_per_tok)
    # two epochs of two optimiser steps: the last pass runs under updated weights
    actor = TorchActor(copy.deepcopy(model), ActorConfig(mini_batch_size=2, micro_batch_size=2,
                       epochs=2, lr=5e-2), total_updates=4,
                       replay=ReplayOptions(bias_meter_rows=rows))
    old = actor.old_logprobs(batch, mode, step=1)
    mask_BT = batch.response_mask_BT.float()
    adv_BT = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask_BT
    upd = actor.policy_update(batch, UpdateInputs(old.logprobs_BT, adv_BT, mask_BT, None, 3,
                                                  LossConfig(), CorrectionConfig()), mode, 1)
    return actor, batch, stats_values(upd.stats)


def test_zero_under_replay_off(model):
    _, _, m = _run(model, "off")
    assert m["replay_bias/flip_rate"] == 0.0
    assert m["replay_bias/k3"] == 0.0 and m["replay_bias/abs_logp_diff"] == 0.0


def test_positive_under_r3_after_an_update_and_equal_to_a_direct_computation(model):
    actor, batch, m = _run(model, "R3")
    assert m["replay_bias/flip_rate"] > 0.0
    assert m["replay_bias/k3"] > 0.0 and m["replay_bias/abs_logp_diff"] > 0.0
    assert all(f"replay_bias/flip_rate/layer_{i}" in m for i in model.cfg.moe_layer_ids)
    # the same rows, replayed and natural, in two separate forwards of the updated actor
    rows = sampled_rows(batch.size, 0.5, step=1)
    sub = batch.rows(rows)
    rep = actor.logprobs(sub, sub.rollout_routes_BTLK, sub.rollout_routes_valid_BT).logprobs_BT
    nat = actor.logprobs(sub).logprobs_BT
    log_r = (nat - rep)[sub.response_mask_BT].double()
    want = float((log_r.exp() - 1 - log_r).mean())
    assert abs(m["replay_bias/k3"] - want) <= 1e-6 * max(want, 1e-12) + 1e-9
    assert abs(m["replay_bias/abs_logp_diff"] - float(log_r.abs().mean())) < 1e-6
