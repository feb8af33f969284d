"""Expert-load metrics (trainer/observe/expert_load.py): a hand count on a small batch, verl 0.9.1's own
functions on the same routes, the metrics of a real RL step, and the per-layer plot."""

import json
import math
from pathlib import Path

import pytest
import torch

from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.observe.expert_load import (counted_tokens, load_counts, load_metrics,
                                          step_load_metrics)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _batch() -> Batch:
    """2 rows, prompt 3 tokens; row 0 has responses at 3, 4, 5 and row 1 at 3, 4: the counted
    tokens are (0, 3), (0, 4), (1, 3) (each row's last token has no route). 2 MoE layers, E=4,
    K=2; every other position holds expert 3 twice-over so counting it would show."""
    B, T, L, K = 2, 6, 2, 2
    routes = torch.full((B, T, L, K), 3, dtype=torch.uint8)
    routes[:, :, :, 1] = 2
    routes[0, 3] = torch.tensor([[0, 1], [2, 3]])
    routes[0, 4] = torch.tensor([[0, 2], [1, 0]])
    routes[1, 3] = torch.tensor([[0, 1], [3, 1]])
    lens = torch.tensor([6, 5])
    t = torch.arange(T)
    resp = (t[None] >= 3) & (t[None] < lens[:, None])
    valid = t[None] < (lens[:, None] - 1)
    return Batch(torch.ones(B, T, dtype=torch.long), resp, torch.zeros(B, T), lens, routes, valid)


def test_metrics_equal_a_hand_count():
    b = _batch()
    tokens = counted_tokens(b.response_mask_BT, b.seq_lens_B)
    assert tokens.nonzero().tolist() == [[0, 3], [0, 4], [1, 3]]
    counts = load_counts(b.rollout_routes_BTLK, tokens, 4)
    assert counts.tolist() == [[3, 2, 1, 0], [1, 2, 1, 2]]
    m = load_metrics(counts, [1, 3], "rollout/moe")  # decoder layers 1 and 3
    # layer 1: loads 3,2,1,0 of mean 1.5 -> E p - 1 = 1, 1/3, -1/3, -1
    expect = {"max_vio/layer_1": 1.0, "min_vio/layer_1": -1.0, "avg_vio/layer_1": 2 / 3,
              "cv/layer_1": math.sqrt(1.25) / 1.5, "dead_experts/layer_1": 1.0,
              "entropy/layer_1": -(0.5 * math.log(0.5) + math.log(1 / 3) / 3
                                   + math.log(1 / 6) / 6),
              # layer 3: loads 1,2,1,2 -> E p - 1 = -1/3, 1/3, -1/3, 1/3
              "max_vio/layer_3": 1 / 3, "min_vio/layer_3": -1 / 3, "avg_vio/layer_3": 1 / 3,
              "cv/layer_3": 0.5 / 1.5, "dead_experts/layer_3": 0.0,
              "entropy/layer_3": -(math.log(1 / 6) / 3 + 2 * math.log(1 / 3) / 3),
              "max_vio/max": 1.0, "max_vio/avg": 2 / 3, "min_vio/max": -1 / 3,
              "dead_experts/max": 1.0, "dead_experts/avg": 0.5,
              "entropy/min": -(0.5 * math.log(0.5) + math.log(1 / 3) / 3 + math.log(1 / 6) / 6),
              "routed_expert_assignments": 12.0}
    for k, v in expect.items():
        assert m[f"rollout/moe/{k}"] == pytest.approx(v, abs=1e-12), k
    # a layer without counted tokens says so (NaN), it does not read as balanced
    empty = load_metrics(torch.zeros(1, 4, dtype=torch.long), [0], "x")
    assert math.isnan(empty["x/max_vio/layer_0"]) and empty["x/routed_expert_assignments"] == 0


def test_rollout_metrics_equal_verls_own():
    from test_correction_verl_parity import _import_verl
    mu = _import_verl("verl.trainer.ppo.metric_utils")
    b = _batch()
    P = 3  # verl: responses are the last response_length positions of routed_experts
    counts = mu._compute_rollout_moe_load_counts(b.rollout_routes_BTLK.long()[:, P:][:, :, :, :],
                                                 b.response_mask_BT[:, P:].long(), 4)
    ours = load_counts(b.rollout_routes_BTLK, counted_tokens(b.response_mask_BT, b.seq_lens_B), 4)
    assert torch.equal(counts.long(), ours)
    theirs = mu._compute_rollout_moe_load_balance_metrics_from_counts(counts)
    mine = step_load_metrics(b, {}, [0, 1], 4)
    assert set(theirs) <= set(mine)
    for k, v in theirs.items():
        assert mine[k] == pytest.approx(v, abs=1e-6), k


def test_an_rl_step_logs_both_sources_and_the_plot_has_the_layer_panels(tmp_path):
    from PIL import Image

    from lockstep.trainer.config.load import load_config
    from lockstep.trainer.loop import Trainer
    from lockstep.trainer.observe.metrics import LOAD_PLOT, write_plots
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=32", "actor.micro_batch_size=32", "loop.steps=1",
        "loop.tensorboard=false"])
    tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    tr.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    m = rows[-1]
    assert not any(k.startswith("moe_load_count") for k in m)  # the per-expert counts stay out
    L, K = cfg.model.num_moe_layers, cfg.model.num_experts_per_tok
    for prefix in ("rollout/moe", "actor/moe"):
        # every response token but each row's last, every layer, every slot
        n = m["response/length_mean"] * cfg.rollout.batch_size - cfg.rollout.batch_size
        assert m[f"{prefix}/routed_expert_assignments"] == pytest.approx(n * L * K)
        for i in cfg.model.moe_layer_ids:
            assert 0 <= m[f"{prefix}/max_vio/layer_{i}"] <= cfg.model.num_experts - 1
            assert 0 < m[f"{prefix}/entropy/layer_{i}"] <= math.log(cfg.model.num_experts) + 1e-9
    # R3 on the toy: the actor's own router disagrees with the engine's on few slots
    assert abs(m["rollout/moe/max_vio/avg"] - m["actor/moe/max_vio/avg"]) < 0.1
    path = tmp_path / "run" / LOAD_PLOT  # written at the end of the run, with the others
    img = Image.open(path)
    img.load()
    assert img.size[0] > 300 and img.size[1] > 200
    assert img.text["Description"] == "panels: layer 0, layer 1, layer 2"
    # several runs share the panels (lockstep compare)
    out = tmp_path / "cmp"
    out.mkdir()
    assert out / LOAD_PLOT in write_plots(out, {"a": rows, "b": rows[:1]})
