"""The KL loss on the synthetic task: the reference replays the update's routes (R2 and R3),
is rebuilt on resume from RUN/reference/, and works with the megatron actor too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "toy_r3.yaml"
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=16", "actor.micro_batch_size=8", "loop.steps=2",
         "loop.tensorboard=false", "loop.plots=false", "loop.checkpoint_every=1",
         "rollout.dtype=fp32", "actor.lr=1e-2", "loss.entropy_coef=0.01", "loss.kl_coef=0.5"]


def _trainer(tmp_path, name, *extra, resume=False):
    cfg = load_config(CONFIG, SMALL + list(extra))
    return Trainer(cfg, tmp_path / name, resume=resume, progress=False, log=lambda s: None)


@pytest.mark.parametrize("mode", ["R2"])  # R3: tests/test_train_dataset.py
def test_kl_is_zero_on_policy_then_positive_and_resumes(tmp_path, mode):
    tr = _trainer(tmp_path, mode, f"replay.mode={mode}", "loss.kl_loss_type=k3+")
    a = tr.step(1)
    tr.save()
    b = tr.step(2)
    assert a["actor/kl_loss"] == 0.0 and b["actor/kl_loss"] > 0
    assert (tmp_path / mode / "reference" / "config.json").exists()  # random init: saved once
    tr.rollout.close()
    again = _trainer(tmp_path, mode, f"replay.mode={mode}", "loss.kl_loss_type=k3+",
                     resume=True)
    assert again.state.step == 1
    c = again.step(2)
    assert c["actor/kl_loss"] == b["actor/kl_loss"]
    again.rollout.close()


@pytest.mark.slow
@pytest.mark.megatron
def test_kl_with_the_megatron_actor(tmp_path):
    pytest.importorskip("megatron.core")
    from lockstep.trainer.actor.megatron.reference import ShardReference
    torch_tr = _trainer(tmp_path, "torch", "actor.backend=torch")
    mg_tr = _trainer(tmp_path, "megatron", "actor.backend=megatron")
    ref = mg_tr.actor.reference  # megatron's own shard of the reference, not a torch model
    assert isinstance(ref, ShardReference)
    assert ref.nbytes == sum(t.numel() * t.element_size() for t in mg_tr.actor._version_tensors())
    for step in (1, 2):
        a, b = torch_tr.step(step), mg_tr.step(step)
        assert math.isclose(a["actor/kl_loss"], b["actor/kl_loss"], rel_tol=1e-3, abs_tol=1e-6)
        if step == 1:  # pi_ref is megatron's forward: exactly pi_theta at the first update
            assert b["actor/kl_loss"] == 0.0
    assert a["actor/kl_loss"] > 1e-4  # step 2: the policy moved
