"""The RL step with a real bf16 engine and an fp32 actor: replay contracts and mismatch metrics."""

import math
from pathlib import Path

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.replay import old_logprob_plan
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.server import ServerThread
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer, run_hash
from lockstep.trainer.objective.correction import correct

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# the toy job, smaller: 16 prompts x 4 samples, no warm start (a random policy still samples)
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=16", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=64", "actor.micro_batch_size=32", "loop.steps=2",
         "loop.tensorboard=false", "loop.plots=false"]


def _trainer(tmp_path, mode, *extra):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + [f"replay.mode={mode}", *extra])
    return Trainer(cfg, tmp_path / mode, progress=False, log=lambda s: None)


def _rollout(tr, step=1):
    prompts = tr.source.prompts(0, tr.cfg.rollout.prompts_per_step)
    results = tr.rollout.generate(tr.requests(prompts, step))
    return collate(results, tr.task.pad_id, *tr._route_shape())


def test_r3_actor_runs_exactly_the_rollout_routes(tmp_path):
    tr = _trainer(tmp_path, "R3")
    assert tr.rollout.engine.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in tr.actor.master.parameters())
    batch = _rollout(tr)
    plan = old_logprob_plan("R3", batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
    old = tr.actor.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT, record=True)
    valid = batch.rollout_routes_valid_BT
    assert valid.sum() == (batch.seq_lens_B - 1).sum()  # every row but the last token
    assert torch.equal(old.routes_BTLK[valid], batch.rollout_routes_BTLK[valid])
    # ... while the fp32 router on its own would have picked other experts somewhere
    assert not torch.equal(old.natural_BTLK[valid], batch.rollout_routes_BTLK[valid])
    m = tr.step(1)
    assert m["replay/mode"] == "R3" and m["replay/mismatch"] == 0.0
    assert m["replay/replayed_fraction"] > 0.8
    # pi_old vs mu_old twice: one k3 definition (objective/stats.py), so the same bits
    assert m["is_split/mismatch_k3"] == m["rollout_corr/k3_kl"]


def test_replay_off_shows_bf16_vs_fp32_flips_and_r3_lowers_the_mismatch(tmp_path):
    tr = _trainer(tmp_path, "off")
    batch = _rollout(tr)
    mask = batch.response_mask_BT.float()
    free = tr.actor.logprobs(batch)
    replayed = tr.actor.logprobs(batch, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
    k3 = {name: correct(tr.cfg.correction, res.logprobs_BT, batch.rollout_logprobs_BT,
                        mask).metrics["rollout_corr/k3_kl"]
          for name, res in (("off", free), ("R3", replayed))}
    assert k3["off"] > 0 and k3["R3"] < k3["off"], k3
    m = tr.step(1)
    assert m["replay/mode"] == "off" and m["replay/replayed_fraction"] == 0.0
    assert m["routing/flip_rate"] > 0 and m["routing/token_any_flip"] >= m["routing/flip_rate"]
    assert any(m[f"routing/flip_rate/layer_{i}"] > 0 for i in range(3))
    for key in ("reward/mean", "rollout_corr/kl", "rollout_corr/k3_kl",
                "rollout_corr/rollout_is_mean", "time/step_s"):
        assert key in m


def test_r2_updates_replay_the_old_logprob_routes(tmp_path):
    # two epochs of two mini-batches: the weights move between the update forwards (the
    # entropy bonus gives a gradient even where every reward of the random policy is 0)
    tr = _trainer(tmp_path, "R2", "actor.epochs=2", "actor.mini_batch_size=32",
                  "actor.micro_batch_size=16", "actor.lr=1e-2", "loss.entropy_coef=0.1")
    m = tr.step(1)
    assert m["replay/mode"] == "R2" and m["replay/mismatch"] == 0.0
    assert m["replay/replayed_fraction"] == 1.0
    assert m["routing_stale/flip_rate"] > 0  # the current router would route otherwise


def test_loop_writes_metrics_checkpoints_and_rejects_config_change_on_resume(tmp_path):
    tr = _trainer(tmp_path, "R3", "loop.checkpoint_every=1", "loop.keep_checkpoints=1")
    tr.run()
    out = tmp_path / "R3"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_2"]
    assert (out / "checkpoints/step_2/hf/config.json").exists()
    assert (out / "checkpoints/step_2/hf/tokenizer.json").exists()
    cfg = load_config(out / "config.yaml", ["actor.lr=1e-3"])
    assert run_hash(cfg) != run_hash(tr.cfg)
    with pytest.raises(ValueError, match="another config"):
        Trainer(cfg, out, resume=True, progress=False, log=lambda s: None)
    more = load_config(out / "config.yaml", ["loop.steps=3"])
    tr2 = Trainer(more, out, resume=True, progress=False, log=lambda s: None)
    assert tr2.state.step == 2 and tr2.state.cursor == 32
    tr2.run()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_http_backend_step_matches_the_embedded_engine(tmp_path):
    """The same step through a real SGLang-wire server on loopback (weights pushed with
    /update_weights_from_disk) samples the same tokens as the in-process engine."""
    local = _trainer(tmp_path, "R3")
    cfg = local.cfg
    torch.manual_seed(123)  # the server starts from other weights: the trainer must push its own
    engine = Engine(MoEModel(cfg.model), EngineConfig(dtype="bf16", max_running=64,
                                                      max_len=16, seed=cfg.loop.seed))
    with ServerThread(engine) as srv:
        remote = Trainer(load_config(CONFIGS / "toy_r3.yaml", SMALL + [
            "rollout.backend=http", f"rollout.url={srv.url}"]), tmp_path / "http",
            progress=False, log=lambda s: None)
        assert engine.weight_version == "0"
        m_remote = remote.step(1)
        assert engine.weight_version == "1"  # the update was pushed to the server
    m_local = local.step(1)
    assert m_remote["replay/mismatch"] == 0.0
    for key in ("reward/mean", "response/length_mean", "routing/num_tokens"):
        assert m_remote[key] == m_local[key], key
    assert m_remote["rollout_corr/k3_kl"] == pytest.approx(m_local["rollout_corr/k3_kl"], rel=1e-3)


def test_bypass_mode_step(tmp_path):
    """verl's bypass (PPO-IS): pi_old := mu_old; IS/RS are recomputed against pi_theta in the
    loss, whose metrics then come from the current policy: the step's rollout_corr/* are the
    update's alone (the driver's would collide with them: merge_metrics refuses that)."""
    tr = _trainer(tmp_path, "R3", "correction.bypass_mode=true", "correction.rollout_rs=token_k3",
                  "correction.rollout_rs_threshold=0.01")
    m = tr.step(1)
    assert m["replay/mismatch"] == 0.0 and "rollout_corr/rollout_rs_masked_fraction" in m
    assert m["actor/grad_norm"] == 0.0  # a random policy earns no reward: nothing to learn yet


def test_issue20_loss_and_correction_options_reach_the_step(tmp_path):
    """loss.loss_mode / loss.opsm_delta reach the actor's loss and correction.m2po_threshold the
    loop's correction (their numbers: tests/test_losses_trust.py, tests/test_correction_m2po.py)."""
    tr = _trainer(tmp_path, "R3", "loss.loss_mode=dppo_kl", "loss.opsm_delta=0.0",
                  "correction.m2po_threshold=1e-9")
    m = tr.step(1)
    assert {"actor/opsm_masked_fraction", "actor/opsm_kl", "actor/pg_clipfrac"} <= set(m)
    assert m["rollout_corr/m2po_masked_fraction"] > 0  # bf16 engine vs fp32 actor: m2 > 1e-9 somewhere
    assert m["rollout_corr/m2po_m2_mean_kept"] < m["rollout_corr/m2po_m2_mean"]


def test_metrics_merge_refuses_a_key_two_parts_write():
    from lockstep.trainer.observe.metrics import MetricKeyCollision, merge_metrics

    row = merge_metrics(a={"x": 1, "y": 2}, b={"z": 3})
    assert list(row) == ["x", "y", "z"]
    with pytest.raises(MetricKeyCollision, match="'y' is written by both a and b"):
        merge_metrics(a={"x": 1, "y": 2}, b={"y": 3})


def test_layer_flip_matrix_orders_layers_and_marks_missing_steps():
    from lockstep.trainer.observe.metrics import layer_flip_matrix

    rows = [{"step": 1, "routing/flip_rate/layer_3": 0.5, "routing/flip_rate/layer_1": 0.25},
            {"step": 2, "routing/flip_rate/layer_3": None, "routing/flip_rate/layer_1": 0.0}]
    layers, steps, matrix = layer_flip_matrix(rows)
    assert layers == [1, 3] and steps == [1, 2]
    assert matrix[0] == [0.25, 0.0]
    assert matrix[1][0] == 0.5 and math.isnan(matrix[1][1])
