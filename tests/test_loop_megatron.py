"""The same RL step with the megatron-core actor (actor.backend=megatron) on CPU/gloo."""

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

pytestmark = pytest.mark.megatron
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_megatron_actor_step_replays(tmp_path, mode):
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "actor.backend=megatron", f"replay.mode={mode}", "warmstart.enabled=false",
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "actor.mini_batch_size=16",
        "actor.micro_batch_size=8", "loss.entropy_coef=0.1", "actor.lr=1e-2",
        "loop.tensorboard=false", "loop.plots=false"])
    tr = Trainer(cfg, tmp_path / mode, progress=False, log=lambda s: None)
    assert type(tr.actor).__name__ == "MegatronActor"
    m = tr.step(1)
    assert m["replay/mode"] == mode and m["replay/mismatch"] == 0.0
    assert m["replay/replayed_fraction"] > 0.8
    assert m["actor/grad_norm"] > 0 and m["routing/num_tokens"] > 0
