"""The 2026 families' experiment configs: `actor.backend=megatron` is refused at config time
naming the family (the toy configs of gpt-oss, Qwen3.5-MoE and the DSA families, whose runs are
evidence in docs/model.md, and toy_r3.yaml's model as Qwen3-Next); each shipped toy trains two
R3 steps with replay mismatch 0; and the `lockstep plan` configs of gpt-oss-120b,
Qwen3.5-35B-A3B and DeepSeek-V3.2 plan: the rollout side fits, the one refusal is the torch
actor's memory (the megatron bridge does not map these families)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.launch.plan import make_plan
from lockstep.moe.model import MoEModel
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
# family -> (config, overrides): the DSA toy, and toy_r3.yaml's model in the other families
QWEN_SHARED = "model.shared_expert_intermediate_size=96"  # their MoE blocks always have one
TOYS = {"gpt_oss": ("toy_gpt_oss_r3.yaml", []),
        "qwen3_5_moe_text": ("toy_qwen35_r3.yaml", []),
        "qwen3_next": ("toy_r3.yaml", ["model.model_type=qwen3_next", QWEN_SHARED]),
        "deepseek_v32": ("toy_dsa_r3.yaml", []),
        "glm_moe_dsa": ("toy_dsa_r3.yaml", ["model.model_type=glm_moe_dsa"])}


@pytest.mark.parametrize("family", list(TOYS))
def test_megatron_is_refused_naming_the_family(family):
    name, sets = TOYS[family]
    cfg = load_config(CONFIGS / name, sets)
    assert cfg.model.model_type == family and cfg.replay.mode.value == "R3"
    assert cfg.replay.indexer == ("r3" if cfg.model.is_dsa else "off")
    MoEModel(cfg.model)  # the family builds at the toy's shape
    with pytest.raises(ExperimentConfigError, match=rf"model_type='{family}'.*{family} is not "
                                                    r"mapped: "):
        load_config(CONFIGS / name, [*sets, "actor.backend=megatron"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["toy_gpt_oss_r3", "toy_qwen35_r3", "toy_dsa_r3"])
def test_the_family_toys_train_with_the_engines_routes(name, tmp_path):
    """Two R3 steps of each shipped family toy (no warm start, 4 prompts x 4 samples): the
    actor replays exactly the bf16 engine's routes (replay mismatch 0 on the tokens that have
    one; the last sampled token never ran through the model) and the update is finite."""
    import math

    from lockstep.trainer.loop import Trainer
    cfg = load_config(CONFIGS / f"{name}.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=16", "actor.micro_batch_size=16", "loss.entropy_coef=0.05",
        "loop.steps=2", "loop.plots=false", "loop.tensorboard=false"])
    with Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None) as tr:
        rows = [tr.step(step) for step in (1, 2)]
    for m in rows:
        assert m["replay/mode"] == "R3" and m["replay/mismatch"] == 0.0, m
        assert m["replay/replayed_fraction"] > 0.5 and m["routing/num_tokens"] > 0, m
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, m


# config -> (model_type, published size in billions, servers, indexer replay)
PLANS = {"gpt_oss_120b": ("gpt_oss", 116.8, 2, False),
         "qwen35_35b_a3b": ("qwen3_5_moe_text", 34.7, 4, False),
         "deepseek_v32": ("deepseek_v32", 683.5, 2, True)}


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # model.path is relative to the repository


@pytest.mark.parametrize("name", list(PLANS))
def test_the_family_plans(name, in_root):
    family, size, servers, indexer = PLANS[name]
    path = CONFIGS / f"cluster_{name}.yaml"
    cfg = load_config(path)
    p = make_plan(cfg)
    assert p["model"]["model_type"] == family
    assert abs(p["model"]["params"] / 1e9 - size) < 0.1
    assert len(p["placement"]["engines"]) == servers == cfg.rollout.num_engines
    # the rollout side fits; the torch actor (a whole replica per rank) does not
    assert len(p["refusals"]) == 1 and p["refusals"][0].startswith("actor rank: estimated peak")
    argv = p["placement"]["engines"][0]["command"]["argv"]
    assert ("--enable-return-indexer-topk" in argv) == indexer  # replay.indexer=r3 needs it
    with pytest.raises(ExperimentConfigError, match=f"{family} is not mapped"):
        load_config(path, ["actor.backend=megatron"])
