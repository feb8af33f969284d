"""The RL loop over an SGLang-wire server with rollout.weight_sync=distributed: the same
metrics as weight_sync=disk, nothing written for the pushes, HF weights in the checkpoint."""

import json
from pathlib import Path

import pytest
import torch

from lockstep.moe.checkpoint import hf_state_dict, read_hf_state_dict
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.server import ServerThread
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.loop import Trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=32", "actor.micro_batch_size=32", "loop.steps=2",
         "loop.tensorboard=false", "loop.plots=false", "rollout.backend=http"]


def _run(tmp_path, sync: str):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL[:-1])
    torch.manual_seed(123)  # the server starts from other weights: the trainer pushes its own
    engine = Engine(MoEModel(cfg.model), EngineConfig(dtype="bf16", max_running=64, max_len=16,
                                                      seed=cfg.loop.seed))
    with ServerThread(engine) as srv:
        cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + [f"rollout.url={srv.url}",
                                                            f"rollout.weight_sync={sync}"])
        tr = Trainer(cfg, tmp_path / sync, progress=False, log=lambda s: None)
        tr.run()
        assert engine.weight_version == "2"
        push = tr.rollout.last_push
    lines = (tmp_path / sync / "metrics.jsonl").read_text().splitlines()
    metrics = [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")}
               for x in lines]
    return tr, metrics, push


@pytest.mark.slow
def test_distributed_weight_sync_run_equals_disk_run(tmp_path):
    tr_d, m_dist, push_d = _run(tmp_path, "distributed")
    _, m_disk, push_k = _run(tmp_path, "disk")
    assert push_d["mode"] == "distributed" and push_k["mode"] == "disk"
    assert push_d["bytes"] == push_k["bytes"] > 0
    assert len(m_dist) == 2 and m_dist == m_disk
    assert not (tmp_path / "distributed" / "weights").exists()  # nothing written for pushes
    assert (tmp_path / "disk" / "weights").exists()
    # the checkpoint still gets the HF weights (exported again at save)
    saved = read_hf_state_dict(tmp_path / "distributed" / "checkpoints" / "step_2" / "hf")
    master = hf_state_dict(tr_d.actor.master)
    assert saved.keys() == master.keys()
    assert all(torch.equal(saved[k], master[k]) for k in master)


def test_loop_refuses_a_version_it_did_not_ask_for(tmp_path):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL[:-1])
    tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    tr.rollout.engine.weight_version = "7"  # weights someone else pushed
    with pytest.raises(RolloutError, match=r"request s1p0 sample 0 .*'7'.*\['0'\]"):
        tr.step(1)


def test_weight_sync_must_fit_the_backend():
    with pytest.raises(ExperimentConfigError, match="rollout.weight_sync='distributed' does not "
                                                    "apply to rollout.backend=embedded"):
        load_config(CONFIGS / "toy_r3.yaml", ["rollout.weight_sync=distributed"])
    cfg = load_config(CONFIGS / "toy_r3.yaml", ["rollout.weight_sync=disk",
                                                "rollout.backend=http", "rollout.url=http://x"])
    other = load_config(CONFIGS / "toy_r3.yaml", ["rollout.weight_sync=distributed",
                                                  "rollout.backend=http", "rollout.url=http://x"])
    assert cfg.hash() == other.hash()  # how weights travel is not the run's identity
