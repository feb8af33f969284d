"""An actor group started from `model.path` (megatron TP=2 on 2 Ray ranks, gloo): the driver
builds no policy model and puts no weights in Ray's object store (the ranks read their shards
of the folder), and the run equals the in-memory start (the driver loading the model and
shipping it through the object store, as before) bit for bit over 3 RL steps."""

import traceback
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from lockstep.moe.checkpoint import save_hf  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.trainer import loop  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SETS = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=8", "actor.micro_batch_size=4", "actor.aux_loss_coef=0.01",
        "loss.entropy_coef=0.05",  # rewards may all be 0 without a warm start
        "actor.backend=megatron", "model.num_hidden_layers=4", "loop.steps=3",
        "loop.plots=false", "loop.tensorboard=false", "cluster.actor_ranks=2",
        "actor.megatron.tensor_parallel=2"]


def _run(tmp_path, name: str, folder: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [*SETS, f"model.path={folder}"])
    trainer = Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)
    try:
        metrics = [trainer.step(s) for s in (1, 2, 3)]
        weights = {k: v.clone() for b in trainer.actor.export_weights(1 << 20) for k, v in b}
    finally:
        trainer.rollout.close()
        trainer.actor.close()
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics], weights


def test_group_from_model_path_holds_no_weights_on_the_driver(cluster, tmp_path, monkeypatch):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SETS)
    torch.manual_seed(1)
    folder = save_hf(MoEModel(cfg.model), tmp_path / "init")
    # the in-memory start (what the group did before): the driver loads the model and ships it
    with monkeypatch.context() as m:
        m.setattr(loop, "lean_startup", lambda cfg: False)
        want, want_w = _run(tmp_path, "in_memory", folder)

    built, put = [], []  # policy models built in this (driver) process; weights put in Ray
    init, ray_put = MoEModel.__init__, ray.put

    def counted_init(self, *a, **kw):
        stack = [f.filename for f in traceback.extract_stack()]
        if not any(f.endswith("rollout/engine.py") for f in stack):  # the local engine's own
            built.append(stack[-2])
        init(self, *a, **kw)

    def counted_put(value, *a, **kw):
        vals = value.values() if isinstance(value, dict) else [value]
        put.extend(type(v).__name__ for v in vals if isinstance(v, torch.Tensor))
        return ray_put(value, *a, **kw)
    monkeypatch.setattr(MoEModel, "__init__", counted_init)
    monkeypatch.setattr(ray, "put", counted_put)
    got, got_w = _run(tmp_path, "from_folder", folder)
    assert built == [], built
    assert put == []
    assert [m["replay/mismatch"] for m in got] == [0.0] * 3
    assert got == want  # every metric of every step, bit for bit
    assert set(got_w) == set(want_w) and all(torch.equal(got_w[k], want_w[k]) for k in want_w)
