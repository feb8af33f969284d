"""Triggered LR decay (actor.lr_schedule=triggered): which steps trigger on a synthetic metric
stream, the config's rules, the actor applying the multiplier, and an exact resume."""

import json
from pathlib import Path

import pytest
import torch

from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.loop import Trainer
from lockstep.trainer.config.sections import LRTriggerConfig
from lockstep.trainer.driver.lr_trigger import length_growth, LRTrigger

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# steps 1..18: response lengths flat, then growing 1 token/step from step 7; k3 spikes at 6 and 18
LENGTHS = [10, 10, 10, 10, 10, 10, 11, 12, 13, 14, 15, 16, 17, 18, 18, 18, 18, 18]
K3 = [1e-3] * 18
K3[5] = K3[13] = K3[17] = 0.02


def _stream(trigger, steps):
    logs, out = [], []
    trigger.log = logs.append
    for s in steps:
        out.append(trigger.observe(s, {"response/length_mean": LENGTHS[s - 1],
                                       "rollout_corr/k3_kl": K3[s - 1]}))
    return out, logs


def test_length_growth_is_the_slope_over_the_mean():
    assert length_growth([10, 10, 11, 12]) == pytest.approx(0.7 / 10.75)
    assert length_growth([5, 5, 5]) == 0.0 and length_growth([0, 0]) == 0.0


def test_synthetic_stream_triggers_at_the_right_steps_with_cooldown_and_floor():
    cfg = LRTriggerConfig(factor=0.5, length_growth=0.05, length_window=4, k3_kl=0.01,
                          cooldown=3, min_scale=0.2)
    out, logs = _stream(LRTrigger(cfg), range(1, 19))
    fired = {s: sorted(k.rsplit("/", 1)[1] for k, v in m.items()
                       if k.startswith("lr_trigger/fired/") and v)
             for s, m in enumerate(out, 1) if any(
                 v for k, v in m.items() if k.startswith("lr_trigger/fired/"))}
    # 6: the k3 spike; 7..9 cool down (growth 0.065 at 8 and 0.087 at 9 ignored); 10: the length
    # window [11..14] grows 1/12.5 = 8%/step; 14: both (window [15..18] grows 6%/step); 18: k3
    # again, the multiplier already at its floor (15, 16, 17 cool down)
    assert fired == {6: ["k3_kl"], 10: ["length_growth"], 14: ["k3_kl", "length_growth"],
                     18: ["k3_kl"]}
    assert [m["lr_trigger/scale"] for m in out] == [1.0] * 5 + [0.5] * 4 + [0.25] * 4 + [0.2] * 5
    assert "lr_trigger/length_growth" not in out[2]  # the window is not full yet
    assert [round(m["lr_trigger/length_growth"], 4) for m in out[3:10]] == \
        [0.0, 0.0, 0.0, round(0.3 / 10.25, 4), round(0.7 / 10.75, 4), 0.087, 0.08]
    assert len(logs) == 4 and "step 6: LR x0.5" in logs[0] and "k3_kl 0.02 > 0.01" in logs[0]
    assert "length_growth 0.08 > 0.05" in logs[1] and "step 14: LR x0.8 (now 0.2" in logs[2]


def test_state_round_trip_continues_the_stream_exactly():
    cfg = LRTriggerConfig(length_growth=0.05, length_window=4, k3_kl=0.01, cooldown=3)
    whole, _ = _stream(LRTrigger(cfg), range(1, 19))
    first = LRTrigger(cfg)
    part1, _ = _stream(first, range(1, 9))
    second = LRTrigger(cfg)
    second.load_state(json.loads(json.dumps(first.state())))  # what a checkpoint keeps
    part2, _ = _stream(second, range(9, 19))
    assert part1 + part2 == whole


def test_a_trigger_without_its_metric_or_thresholds_is_refused():
    t = LRTrigger(LRTriggerConfig(flip_rate=0.1))
    with pytest.raises(ValueError, match="no routing/flip_rate .the rollout returned no routes"):
        t.observe(1, {"response/length_mean": 3.0})
    toy = CONFIGS / "toy_r3.yaml"
    triggered = ["actor.lr_schedule=triggered"]
    with pytest.raises(ExperimentConfigError, match="at least one of length_growth, k3_kl"):
        load_config(toy, triggered + ["actor.lr_trigger.factor=0.5"])
    with pytest.raises(ExperimentConfigError, match="triggered schedule needs actor.lr_trigger"):
        load_config(toy, triggered)
    with pytest.raises(ExperimentConfigError, match="'constant' with actor.lr_trigger set"):
        load_config(toy, ["actor.lr_trigger.k3_kl=0.1"])
    with pytest.raises(ExperimentConfigError, match=r"actor\.lr_trigger\.factor"):
        load_config(toy, triggered + ["actor.lr_trigger.k3_kl=0.1", "actor.lr_trigger.factor=1.5"])


def test_actor_steps_at_the_scaled_lr_and_the_schedule_recovers():
    mcfg = ModelConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       eos_token_id=2, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(0)
    model = MoEModel(mcfg)
    from lockstep.rollout.types import GenerationResult
    results = [GenerationResult(f"r{b}", 0, [1, 3 + b, 4], [5, 6 + b], torch.zeros(2),
                                torch.zeros(2), {"type": "length", "length": 2}, "0", None)
               for b in range(4)]
    batch = collate(results, 0, mcfg.num_experts, mcfg.num_moe_layers, mcfg.num_experts_per_tok)

    def loss_fn(lp, ent, rows, mini):
        return -(lp * batch.response_mask_BT[rows]).sum() / batch.response_mask_BT[mini].sum(), {}

    def run(lr, scales):
        m = MoEModel(mcfg)
        m.load_state_dict(model.state_dict())
        actor = TorchActor(m, ActorConfig(lr=lr, mini_batch_size=4, micro_batch_size=4), 4)
        lrs = [actor.update(batch, loss_fn, lr_scale=s)[0]["actor/lr"] for s in scales]
        return lrs, [p.detach().clone() for p in m.parameters()]

    lrs, scaled = run(1e-2, [0.25, 0.25])
    _, plain = run(2.5e-3, [1.0, 1.0])
    assert lrs == [2.5e-3, 2.5e-3]
    assert all(torch.equal(a, b) for a, b in zip(scaled, plain))  # the same AdamW steps
    assert run(1e-2, [0.25, 1.0])[0] == [2.5e-3, 1e-2]  # the schedule's own LR is untouched


def test_resume_keeps_the_decayed_lr_and_the_cooldown(tmp_path):
    # a tiny k3 threshold fires at step 1; cooldown 2 holds steps 2-3; step 4 fires again
    sets = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
            "actor.mini_batch_size=16", "actor.micro_batch_size=16", "actor.lr=3e-3",
            "actor.lr_schedule=triggered", "actor.lr_trigger.k3_kl=1e-12",
            "actor.lr_trigger.cooldown=2", "loop.checkpoint_every=2", "loop.tensorboard=false",
            "loop.plots=false", "replay.mode=off"]
    logs = []

    def train(out, steps, resume=False):
        cfg = load_config(CONFIGS / "toy_r3.yaml", sets + [f"loop.steps={steps}"])
        Trainer(cfg, out, resume=resume, progress=False, log=logs.append).run()
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
                for line in (out / "metrics.jsonl").read_text().splitlines()]

    want = train(tmp_path / "ref", 4)
    assert [r["lr_trigger/scale"] for r in want] == [0.5, 0.5, 0.5, 0.25]
    assert [r["lr_trigger/fired/k3_kl"] for r in want] == [1.0, 0.0, 0.0, 1.0]
    assert [r["actor/lr"] for r in want] == pytest.approx([1.5e-3] * 3 + [7.5e-4])
    train(tmp_path / "run", 2)
    got = train(tmp_path / "run", 4, resume=True)
    assert got == want
    assert sum("LR x0.5" in line for line in logs) == 4  # steps 1, 4 of each run
