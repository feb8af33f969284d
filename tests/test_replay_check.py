"""The replay validator (`replay.check`, moe/replay_check.py) on the torch actor: replay broken
on purpose in three ways stops the run with a message naming the layer."""

import dataclasses
from pathlib import Path

import pytest
import torch

import lockstep.moe.model as moe_model
import lockstep.trainer.loop as loop
from lockstep.moe.replay_check import ReplayCheck, ReplayCheckError
from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=16", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=64", "actor.micro_batch_size=32", "loop.tensorboard=false",
         "loop.plots=false"]


def _trainer(tmp_path, *extra):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + list(extra))
    return Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)


def test_a_router_that_ignores_the_given_ids_stops_the_run(tmp_path, monkeypatch):
    real = moe_model.route

    def ignores_replay(logits, cfg, bias=None, *replay, **kw):
        return real(logits, cfg, bias, **kw)  # routes naturally whatever it was given
    monkeypatch.setattr(moe_model, "route", ignores_replay)
    tr = _trainer(tmp_path, "loop.steps=1", "replay.check=full")
    with pytest.raises(ReplayCheckError) as e:
        tr.run()
    msg = str(e.value)
    assert msg.startswith("step 1 (pi_old): replay check (log-prob forward): MoE layer "), msg
    assert "the router did not run the replayed ids: at sample " in msg and "position" in msg
    # the same forward with the validator off runs (what replay.check=off would let through)
    tr = _trainer(tmp_path / "off", "loop.steps=1", "replay.check=off")
    assert tr.actor.replay_check is ReplayCheck.OFF
    tr.run()


def test_a_router_registered_for_two_layers_stops_the_run(tmp_path):
    tr = _trainer(tmp_path, "loop.steps=1")  # the default: replay.check=sample
    assert tr.actor.replay_check is ReplayCheck.SAMPLE
    layers = tr.actor.compute.layers
    layers[2].mlp = layers[1].mlp  # verl #7340: one router instance serves two layers
    with pytest.raises(ReplayCheckError) as e:
        tr.run()
    assert str(e.value) == (
        "step 1 (pi_old): replay check (log-prob forward): MoE layer 2 (decoder layer 2) "
        "received no replayed ids (its replay buffer was left unconsumed); the router of "
        "MoE layer 1 (decoder layer 1) ran 2 times in one forward (registered for more "
        "than one layer?)")


def test_routes_of_the_wrong_step_stop_the_run(tmp_path, monkeypatch):
    """Step 2's batch carries step 1's routes (other prompts): the routers run them as given,
    but they agree with the routers' own top-k only about as often as chance (0.5 here)."""
    real, seen = loop.collate, []

    def stale_routes(*args, **kw):
        batch = real(*args, **kw)
        seen.append(batch)
        if len(seen) < 2:
            return batch
        old = seen[0]
        B, T = batch.input_ids_BT.shape
        t = min(T, old.input_ids_BT.shape[1])
        routes = torch.zeros_like(batch.rollout_routes_BTLK)
        routes[:, :t] = old.rollout_routes_BTLK[:, :t]
        valid = torch.zeros_like(batch.rollout_routes_valid_BT)
        valid[:, :t] = old.rollout_routes_valid_BT[:, :t] & batch.rollout_routes_valid_BT[:, :t]
        return dataclasses.replace(batch, rollout_routes_BTLK=routes,
                                   rollout_routes_valid_BT=valid)
    monkeypatch.setattr(loop, "collate", stale_routes)
    tr = _trainer(tmp_path, "loop.steps=2")
    with pytest.raises(ReplayCheckError) as e:
        tr.run()
    msg = str(e.value)
    assert msg.startswith("step 2 (pi_old): replay check (log-prob forward): MoE layer "), msg
    assert "the replayed routes agree with the router's own top-k on only " in msg
    assert "(chance 50.0%, floor 75.0%): routes of another step or sample?" in msg
