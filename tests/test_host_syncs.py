"""Host syncs of a policy update: the actor keeps its metrics on the device and reads them once
per optimiser step (STYLE 16), so the number of host reads lockstep's own code makes does not
grow with the micro-batches of a step.

A host read is counted where lockstep code calls `Tensor.item`, `.tolist`, `.cpu`, `float()`,
`int()` or `bool()` on a tensor (the immediate caller's file is in the package; torch's own
reads, e.g. AdamW's step counter, are not lockstep's). On a GPU each one waits for the device.
Not counted: trainer/actor/batch.py, whose `Batch` lives on the host (its reads wait for no
device), and reads a Python-level hook cannot see (boolean-mask indexing, `nonzero`)."""

import importlib
import os
import sys
from contextlib import contextmanager

import pytest
import torch

import lockstep
import lockstep.trainer
from lockstep.trainer.actor.rank import Objective, UpdateInputs
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import LossConfig
from test_actor import _batch, _model

# the package's source folders (pyproject maps each top-level sub-package to its own folder);
# named one by one, since a venv inside the checkout (CI's .venv-ci) holds torch's own files
SOURCES = tuple(os.path.realpath(importlib.import_module(f"lockstep.{name}").__path__[0]) + os.sep
                for name in ("cluster", "kernels", "launch", "moe", "replay", "rollout", "trainer")
                ) + (os.path.realpath(lockstep.__path__[0]) + os.sep,)
HOST_SIDE = os.path.join(os.path.realpath(lockstep.trainer.__path__[0]), "actor", "batch.py")
READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")


@contextmanager
def count_host_reads():
    """Count the host reads lockstep code makes inside the block (`counts["n"]`)."""
    counts = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def read(self, *args, **kwargs):
            path = os.path.realpath(sys._getframe(1).f_code.co_filename)
            if path.startswith(SOURCES) and path != HOST_SIDE:
                counts["n"] += 1
            return fn(self, *args, **kwargs)
        return read
    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _update_reads(micro: int, epochs: int, correction: CorrectionConfig, **actor) -> int:
    """Host reads of one `policy_update`'s training part (`_train_steps`) over 8 rows in one
    mini-batch of `8 // micro`-row micro-batches, `epochs` optimiser steps."""
    model = _model()
    batch = _batch(model)
    cfg = ActorConfig(micro_batch_size=8 // micro, mini_batch_size=8, epochs=epochs, **actor)
    act = TorchActor(model, cfg, 10)
    old = act.logprobs(batch, None, None).logprobs_BT
    mask = batch.response_mask_BT.float()
    adv = torch.linspace(-1, 1, 8)[:, None] * mask
    inputs = UpdateInputs(old, adv, mask, None, None, LossConfig(entropy_coef=0.01), correction)
    steps = [torch.arange(8)] * epochs
    with count_host_reads() as counts:
        act._train_steps(batch, Objective(batch, inputs, torch.zeros_like(old)), steps,
                         None, None)
    return counts["n"]


def _per_step(correction: CorrectionConfig, micro: int, **actor) -> tuple[int, int]:
    """(reads per optimiser step, reads per update besides)."""
    one, two = (_update_reads(micro, e, correction, **actor) for e in (1, 2))
    return two - one, 2 * one - two


@pytest.mark.parametrize("actor", [{}, {"aux_loss_coef": 0.01}], ids=["plain", "aux"])
def test_host_reads_per_step_do_not_grow_with_micro_batches(actor):
    corr = CorrectionConfig()
    per_step_1, per_update_1 = _per_step(corr, 1, **actor)
    per_step_4, per_update_4 = _per_step(corr, 4, **actor)
    assert (per_step_4, per_update_4) == (per_step_1, per_update_1)
    # the grad norm (skip a non-finite step) and the metrics; the route buffers to the host
    assert per_step_1 <= 2 and per_update_1 <= 3, (per_step_1, per_update_1)


def test_bypass_mode_reads_once_per_micro_batch():
    """Bypass mode corrects inside the loss: each micro-batch checks pi_theta's log-probs (one
    read, `correct`'s checks); its metrics wait for the step's read."""
    corr = CorrectionConfig(bypass_mode=True, rollout_is="token", rollout_rs="token_k1",
                            rollout_rs_threshold=2.0)
    per_step_1, _ = _per_step(corr, 1)
    per_step_4, _ = _per_step(corr, 4)
    assert per_step_1 <= 3 and per_step_4 == per_step_1 + 3, (per_step_1, per_step_4)
