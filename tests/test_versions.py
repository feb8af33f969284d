"""pi_gen on the actor itself (`trainer/actor/versions.py`, loop.max_staleness >= 1): through the rank
interface, a stale row's pi_gen is the actor's OWN forward under the weights of the row's
version (bit for bit where the forward is the same: the megatron actor's pi_gen is megatron's,
not the torch model's), current rows take pi_old, the live weights come back exactly, at most k
versions are kept, and a version out of reach is refused."""

from pathlib import Path

import pytest
import torch

from lockstep.moe.checkpoint import load_hf_state_dict
from lockstep.moe.model import MoEModel
from lockstep.replay import ReplayMode, old_logprob_plan
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.config.load import load_config
from lockstep.trainer.objective.correction import CorrectionConfig, correct
from lockstep.trainer.objective.losses import LossConfig
from lockstep.trainer.loop import Trainer
from lockstep.trainer.actor.rank import UpdateInputs
from lockstep.trainer.actor.versions import KeptVersions, VersionSplit

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODE = ReplayMode.R3


def _trainer(tmp_path, *sets: str) -> Trainer:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=16", "actor.micro_batch_size=16", "actor.lr=1e-2",
        "loss.entropy_coef=0.1", "loop.max_staleness=2", "loop.plots=false",
        "loop.tensorboard=false", *sets])
    return Trainer(cfg, tmp_path, progress=False, log=lambda s: None)


def _pi(actor, batch) -> torch.Tensor:
    """The actor's own log-probs of `batch` now, under pi_old's R3 plan."""
    plan = old_logprob_plan(MODE, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
    return actor.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT).logprobs_BT


def _torch_pi(tr, batch) -> torch.Tensor:
    """The torch model's log-probs under the actor's exported weights now."""
    model = MoEModel(tr.cfg.model)
    load_hf_state_dict(model, {k: v.clone() for bucket in tr.actor.export_weights(1 << 24)
                               for k, v in bucket})
    return _pi(TorchActor(model, tr.cfg.actor, 1, temperature=tr.cfg.rollout.temperature), batch)


def _step(tr, batch, versions, step):
    """old log-probs, pi_gen, update: the loop's order, through the rank interface."""
    old = tr.actor.old_logprobs(batch, MODE, step)
    gen = tr.versions.gen_logprobs(tr.actor, batch, versions, old.logprobs_BT, MODE, step)
    mask_BT = batch.response_mask_BT.float()
    adv_BT = torch.linspace(-1, 1, batch.size)[:, None] * mask_BT
    corr = correct(tr.cfg.correction, old.logprobs_BT, batch.rollout_logprobs_BT, mask_BT)
    tr.actor.policy_update(batch, tr.update_inputs(batch, old, adv_BT, corr, step), MODE, step)
    return old.logprobs_BT, gen


@pytest.mark.parametrize("backend", ["torch", pytest.param("megatron", marks=pytest.mark.megatron)])
def test_pi_gen_is_the_actors_own_forward_under_the_rows_version(tmp_path, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    tr = _trainer(tmp_path, f"actor.backend={backend}")
    try:
        prompts = tr.source.prompts(0, tr.cfg.rollout.prompts_per_step)
        batch = collate(tr.rollout.generate(tr.requests(prompts, 1)), tr.source.pad_id,
                        *tr._route_shape())
        n = batch.size
        resp = batch.response_mask_BT
        want = {"0": _pi(tr.actor, batch)}  # the actor's forward under version 0
        torch_v0 = _torch_pi(tr, batch)  # the torch model's, on the same (exported) weights
        # step 1: every row is of the current version: pi_gen IS pi_old (version part 1)
        old1, gen1 = _step(tr, batch, ["0"] * n, 1)
        assert gen1 is old1 and list(tr.actor.kept_versions()) == ["0"]
        want["1"] = _pi(tr.actor, batch)
        # step 2: all rows of version 0, one update behind: pi_gen is the actor's own forward
        # under version 0, bit for bit (the same rows and micro-batches)
        old2, gen2 = _step(tr, batch, ["0"] * n, 2)
        assert torch.equal(gen2, want["0"])
        # the driver's recompute before ran the torch model on the exported weights: the same
        # for the torch actor, off by the backends' rounding for megatron (4.8e-7 here)
        gap = float((gen2 - torch_v0)[resp].abs().max())
        assert (gap > 0) == (backend == "megatron"), gap
        assert float((gen2 - old2)[resp].abs().max()) > 1e-3  # the weights did move
        assert list(tr.actor.kept_versions()) == ["0", "1"]
        # the live weights came back exactly: pi_old of step 3 is version 2's own forward
        want["2"] = _pi(tr.actor, batch)
        # step 3: rows of versions 0, 1 and 2 (current) mixed; each row under its version
        versions = [str(i % 3) for i in range(n)]
        old3, gen3 = _step(tr, batch, versions, 3)
        assert torch.equal(old3, want["2"])
        for v in "012":
            rows = torch.tensor([x == v for x in versions])
            got, ref = gen3[rows], want[v][rows]
            if v == "2":  # current: pi_old itself
                assert torch.equal(got, old3[rows])
            else:  # sub-batches of other shapes: fp32 rounding at most
                assert torch.allclose(got, ref, atol=1e-5, rtol=0), (v, (got - ref).abs().max())
                other = want[str(int(v) + 1)][rows]  # the next version is far off
                assert float((got - other)[resp[rows]].abs().max()) > 1e-3, v
        kept = tr.actor.kept_versions()
        assert list(kept) == ["1", "2"]  # at most k = 2; version 0 is out of reach now
        shard = sum(t.numel() * t.element_size() for t in tr.actor._version_tensors())
        assert all(b == shard for b in kept.values())
        # a row of a version nobody keeps any more is refused, naming it
        tr.actor.old_logprobs(batch, MODE, 4)
        with pytest.raises(RuntimeError, match=r"step 4: .*version '0'.*\['1', '2'\]"):
            tr.versions.gen_logprobs(tr.actor, batch, ["0"] + ["3"] * (n - 1), want["0"],
                                     MODE, 4)
    finally:
        tr.pipeline.close()


def test_kept_versions_exchange_in_place_and_reuse_storage():
    live = [torch.arange(6.0).view(2, 3), torch.ones(4)]
    store = KeptVersions(1)
    store.advance(1, live)  # before step 1's update: version 0
    live[0].add_(10)
    live[1].mul_(3)
    now = [t.clone() for t in live]
    with store.swapped_in("0", live):
        assert torch.equal(live[0], torch.arange(6.0).view(2, 3))
        assert torch.equal(live[1], torch.ones(4))
    assert all(torch.equal(a, b) for a, b in zip(live, now))  # restored exactly
    copy0 = store.kept["0"]
    store.advance(2, live)  # version 0 is out of reach (k = 1): its storage takes version 1
    assert list(store.kept) == ["1"] and store.kept["1"] is copy0
    assert all(torch.equal(a, b) for a, b in zip(store.kept["1"], now))
    assert VersionSplit(0).gen_logprobs(None, None, ["0"], now[0], MODE, 1) is now[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_actor_on_its_device_keeps_versions_on_the_host(device):
    """The torch actor on `device` (cuda: not run without a GPU): the kept copies live on the
    CPU, pi_gen of stale rows is the actor's forward under their version, the live weights
    come back exactly (bf16 compute copy)."""
    from lockstep.trainer.config.sections import ActorConfig
    from test_router_families import _actor_batch, make
    model = make("deepseek_mla")
    batch = _actor_batch(model)
    actor = TorchActor(model, ActorConfig(dtype="bf16", mini_batch_size=4, micro_batch_size=2,
                                          lr=1e-2), 2, device=device)
    split, mode, mask_BT = VersionSplit(1), ReplayMode.R2, batch.response_mask_BT.float()
    want = actor.logprobs(batch).logprobs_BT  # version 0 (R2's pi_old plan: natural routes)
    old = actor.old_logprobs(batch, mode, 1)
    split.gen_logprobs(actor, batch, ["0"] * 4, old.logprobs_BT, mode, 1)
    inputs = UpdateInputs(old.logprobs_BT, torch.linspace(-1, 1, 4)[:, None] * mask_BT, mask_BT,
                          None, 7, LossConfig(), CorrectionConfig())
    actor.policy_update(batch, inputs, mode, 1)
    live = [t.clone() for t in actor._version_tensors()]
    old = actor.old_logprobs(batch, mode, 2)
    gen = split.gen_logprobs(actor, batch, ["0"] * 4, old.logprobs_BT, mode, 2)
    assert all(torch.equal(a, b) for a, b in zip(live, actor._version_tensors()))
    assert all(t.device.type == "cpu" for ts in actor._versions.kept.values() for t in ts)
    assert all(t.device.type == device for t in live)
    # the same rows and micro-batches as `want`: the same kernels (cuda: up to atomics)
    assert torch.allclose(gen, want, atol=0 if device == "cpu" else 1e-5, rtol=0)
    assert float((gen - old.logprobs_BT).abs().max()) > 1e-3
