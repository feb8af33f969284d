"""The actor's part of a checkpoint (trainer/actor/checkpoint.py), one process: the torch actor's
Adam state round-trips through HF-named moment folders bit for bit, ranks' parts cover the
model once, a non-finite weight stops the save without leaving a folder, and a checkpoint of
the earlier per-rank format is refused on another layout."""

import json
from pathlib import Path

import pytest
import torch

from lockstep.moe.checkpoint import read_hf_state_dict
from lockstep.moe.model import MoEModel
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.actor.checkpoint import (MOMENTS, actor_parts, finish, num_parts, write_parts)
from lockstep.trainer.state.checkpoint import (TRAINER_STATE, latest_checkpoint, load_tree, save_tree,
                                         write_manifest)
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.observe.nonfinite import DivergenceError
from lockstep.trainer.loop import Trainer

from model_fixtures import tiny_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


# a sigmoid router with an expert bias: the bias is a buffer (a weight without optimiser state)
BIASED = dict(model_type="glm4_moe", router="sigmoid", expert_bias=True, norm_topk_prob=True)


def _stepped_actor(seed: int = 0, steps: int = 2) -> TorchActor:
    torch.manual_seed(seed)
    actor = TorchActor(MoEModel(tiny_config(**BIASED)), ActorConfig(lr=1e-2, warmup_steps=3),
                       10)
    for _ in range(steps):  # real AdamW steps on random gradients
        for p in actor.master.parameters():
            p.grad = torch.randn_like(p)
        actor.optimizer.step()
        actor.scheduler.step()
    return actor


def _opt_state(actor) -> list[dict]:
    return [{k: v.clone() for k, v in actor.optimizer.state[p].items()}
            for p in actor.master.parameters()]


def test_torch_adam_state_round_trips_through_hf_named_moments(tmp_path):
    src = _stepped_actor()
    state, _ = src.write_checkpoint(tmp_path)
    exp_avg = read_hf_state_dict(tmp_path / "optim/exp_avg")
    assert set(exp_avg) == set(read_hf_state_dict(tmp_path / "hf"))
    bias = [k for k in exp_avg if k.endswith("e_score_correction_bias")]
    assert bias and sorted(state["no_state"]) == sorted(bias)  # zeros, marked stateless
    assert all(not exp_avg[k].any() for k in bias)
    dst = _stepped_actor(seed=1, steps=1)  # other moments, another step count
    dst.load_checkpoint(tmp_path, state)
    for a, b in zip(_opt_state(src), _opt_state(dst)):
        assert a.keys() == b.keys() == {"step", *MOMENTS}
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert dst.scheduler.state_dict() == src.scheduler.state_dict()
    assert [g["lr"] for g in dst.optimizer.param_groups] == \
        [g["lr"] for g in src.optimizer.param_groups]


def test_ranks_parts_cover_the_model_once_and_the_index_names_them(tmp_path):
    actor = _stepped_actor()
    cfg = actor.model_cfg
    metas = [write_parts(tmp_path, actor_parts(actor, r, 3)[0], cfg) for r in range(3)]
    assert sorted(p for m in metas for p in m["parts"]) == list(range(num_parts(cfg)))
    known = finish(tmp_path, metas, cfg)
    write_manifest(tmp_path, known)
    whole = read_hf_state_dict(tmp_path / "optim/exp_avg_sq")
    want = {}
    for m in metas:  # the rank files hold what the index says
        for f, v in m["files"].items():
            if f.startswith("optim/exp_avg_sq/"):
                want.update({k: f.split("/")[-1] for k in v["names"]})
    index = json.loads((tmp_path / "optim/exp_avg_sq/model.safetensors.index.json").read_text())
    assert index["weight_map"] == want and set(whole) == set(want)
    with pytest.raises(Exception, match="parts written"):
        finish(tmp_path, metas[:2], cfg)  # rank 2's parts missing
    # a rank's file the driver cannot see (no shared storage) is named, not left out
    next((tmp_path / "hf").glob("model-*.safetensors")).unlink()
    with pytest.raises(Exception, match="not visible here.*shared storage"):
        write_manifest(tmp_path, known)


SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=16", "actor.micro_batch_size=16", "loop.steps=2",
         "loop.tensorboard=false", "loop.plots=false", "loss.entropy_coef=0.05"]


def test_non_finite_weights_stop_the_save_and_leave_no_folder(tmp_path):
    tr = Trainer(load_config(CONFIGS / "toy_r3.yaml", SMALL), tmp_path / "run",
                 progress=False, log=lambda s: None)
    tr.step(1)
    with torch.no_grad():
        tr.actor.master.norm.weight[0] = float("nan")
    with pytest.raises(DivergenceError, match=r"weights are not finite \(model.norm.weight\)"):
        tr.save()
    assert latest_checkpoint(tmp_path / "run") is None
    assert not any((tmp_path / "run/checkpoints").iterdir())


def test_old_per_rank_checkpoints_resume_only_on_their_layout(tmp_path):
    out = tmp_path / "run"
    tr = Trainer(load_config(CONFIGS / "toy_r3.yaml", SMALL), out, progress=False,
                 log=lambda s: None)
    tr.step(1)
    ckpt = tr.save()
    # rewrite it as earlier versions did: the optimiser state in trainer_state, no optim/
    state = load_tree(ckpt / TRAINER_STATE)
    state.pop("actor")
    save_tree(ckpt / TRAINER_STATE, {**tr.actor.rank_state(), **state})
    for f in (ckpt / "optim").rglob("*"):
        if f.is_file():
            f.unlink()
    write_manifest(ckpt)
    with pytest.raises(ValueError, match="loads only on the layout it was written with"):
        Trainer(load_config(out / "config.yaml", ["cluster.actor_ranks=2"]), out, resume=True,
                progress=False, log=lambda s: None)
    again = Trainer(load_config(out / "config.yaml"), out, resume=True, progress=False,
                    log=lambda s: None)  # its own layout: loads (load_rank_state)
    assert again.state.step == 1
    assert all(torch.equal(a[k], b[k]) for a, b in zip(_opt_state(tr.actor),
                                                        _opt_state(again.actor)) for k in a)
