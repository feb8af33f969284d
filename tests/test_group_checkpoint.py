"""Group checkpoints written by the ranks themselves, resumed on another layout (gloo, local
Ray, one thread per rank; docs/cluster.md "Checkpoints and resume").

megatron TP=2 on two ranks trains 3 RL steps, checkpointing after step 2: the driver takes no
weights or optimiser state from the ranks (their export and state calls are blocked during
the save; what the ranks send back is names and checksums), and the `hf/` folder the ranks
wrote loads with `load_hf` and equals the exported weights bit for bit. The step-2 checkpoint
is then resumed with EP=2 and with PP=2 on two ranks and with the one-process megatron actor:
each writes the same checkpoint back bit for bit (its own slices of weights and Adam moments),
and step 3's metrics equal the uninterrupted TP=2 run's within docs/cluster.md's tolerances
and the weights after step 3 within lr / 10 (Adam's moments dropped on load move them by
O(lr))."""

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from lockstep.moe.checkpoint import hf_state_dict, load_hf, read_hf_state_dict  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# docs/cluster.md "One process vs the group": name -> (rtol, atol)
TOLERANCE = {"reward/mean": (0.0, 0.0), "routing/flip_rate": (0.0, 0.0),
             "rollout_corr/k3_kl": (1e-2, 1e-7), "actor/grad_norm": (1e-3, 0.0),
             "actor/pg_loss": (1e-2, 1e-4), "actor/entropy": (1e-3, 0.0)}


def _trainer(out: Path, *sets: str, resume: bool = False) -> Trainer:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=8", "actor.micro_batch_size=4",
        # the load-balancing loss balances each micro-batch's tokens, and DP layouts cut
        # micro-batches differently: off, so the layouts train the same loss
        "actor.aux_loss_coef=0",
        "loss.entropy_coef=0.05",  # no warm start: keeps a gradient if all rewards are 0
        "actor.backend=megatron", "model.num_hidden_layers=4", "loop.steps=3",
        "loop.plots=false", "loop.tensorboard=false", *sets])
    return Trainer(cfg, out, resume=resume, progress=False, log=lambda s: None)


def _export(actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for bucket in actor.export_weights(1 << 20) for k, v in bucket}


def _blocked(*_, **__):
    raise AssertionError("the driver asked the ranks for weights or optimiser state")


def test_ranks_write_the_checkpoint_and_it_resumes_on_another_layout(cluster, tmp_path):
    run = tmp_path / "tp2"
    a = _trainer(run, "cluster.actor_ranks=2", "actor.megatron.tensor_parallel=2")
    try:
        a.step(1)
        a.step(2)
        a.actor.export_weights, a.actor.rank_state = _blocked, _blocked  # the save may not
        ckpt = a.save()
        del a.actor.export_weights, a.actor.rank_state
        want2 = _export(a.actor)
        want3, w3 = a.step(3), _export(a.actor)
    finally:
        a.actor.close()

    # the driver got names and checksums only; the ranks wrote every part
    written = sum(p.stat().st_size for p in ckpt.rglob("*.safetensors"))
    assert a.actor.checkpoint_bytes < 64 << 10 < written // 8, (a.actor.checkpoint_bytes, written)
    parts = sorted(p.name for p in (ckpt / "hf").glob("model-*.safetensors"))
    assert len(parts) == 5 and (ckpt / "hf/model.safetensors.index.json").exists()
    got2 = hf_state_dict(load_hf(ckpt / "hf"))
    assert set(got2) == set(want2)
    assert all(torch.equal(got2[k], want2[k]) for k in want2)
    moments = read_hf_state_dict(ckpt / "optim/exp_avg_sq")
    assert set(moments) == set(want2) and all(bool((v >= 0).all()) for v in moments.values())
    assert max(float(v.max()) for v in moments.values()) > 0

    lr = a.cfg.actor.lr
    layouts = {"ep2": ("cluster.actor_ranks=2", "actor.megatron.expert_parallel=2"),
               "pp2": ("cluster.actor_ranks=2", "actor.megatron.pipeline_parallel=2"),
               "one_process": ()}
    for name, sets in layouts.items():
        out = tmp_path / name
        shutil.copytree(run, out)
        b = _trainer(out, *sets, resume=True)
        try:
            assert b.state.step == 2
            again = b.save()  # this layout's slices, written back: the same checkpoint
            for d in ("hf", "optim/exp_avg", "optim/exp_avg_sq"):
                x, y = read_hf_state_dict(ckpt / d), read_hf_state_dict(again / d)
                assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x), (name, d)
            got3, got_w3 = b.step(3), _export(b.actor)
        finally:
            b.actor.close()
        for k, (rtol, atol) in TOLERANCE.items():
            assert abs(got3[k] - want3[k]) <= rtol * abs(want3[k]) + atol, \
                (name, k, got3[k], want3[k])
        diff = max(float((got_w3[k] - w3[k]).abs().max()) for k in w3)
        assert diff <= lr / 10, (name, diff, lr)
