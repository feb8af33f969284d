"""The megatron actor hosted by the Ray actor group (cluster.actor_ranks=2, gloo, one thread per
rank): TP=2 and PP=2 give the one-process megatron run's first RL step (R3 replay on every
rank, rewards and routing metrics exactly, losses and grad norm within rounding) and the same
exported weights."""

from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from lockstep.trainer.config import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"



def _trainer(tmp_path, name: str, *sets: str) -> Trainer:
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=8", "actor.micro_batch_size=4", "actor.aux_loss_coef=0.01",
        "actor.backend=megatron", "model.num_hidden_layers=4", "loop.plots=false", "loop.tensorboard=false", *sets])
    return Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)


def _export(actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for bucket in actor.export_weights(1 << 20) for k, v in bucket}


def test_tp2_and_pp2_ranks_match_one_process(cluster, tmp_path):
    one = _trainer(tmp_path, "one")
    want, want_w = one.step(1), _export(one.actor)
    layouts = {"tp2": "actor.megatron.tensor_parallel=2", "pp2": "actor.megatron.pipeline_parallel=2"}
    for name, layout in layouts.items():
        group = _trainer(tmp_path, name, "cluster.actor_ranks=2", layout)
        try:
            got = group.step(1)
            got_w = _export(group.actor)
        finally:
            group.actor.close()
        assert got["replay/mismatch"] == 0.0, name
        for k in ("reward/mean", "replay/replayed_fraction", "routing/flip_rate",
                  "routing/num_tokens",
                  "routing_stale/num_tokens"):
            assert got[k] == want[k], (name, k, got[k], want[k])
        for k in ("actor/grad_norm", "actor/pg_loss", "actor/aux_loss", "actor/entropy",
                  "rollout_corr/k3_kl"):
            assert abs(got[k] - want[k]) <= 1e-4 * abs(want[k]) + 1e-6, (name, k, got[k], want[k])
        assert set(got_w) == set(want_w)
        diff = max((got_w[k] - want_w[k]).abs().max() for k in want_w)
        assert diff <= 1e-6, (name, diff)
