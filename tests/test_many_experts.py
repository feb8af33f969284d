"""More than 256 experts (Kimi-K2 has 384): routes are uint16 end to end, and R3 trains."""

from pathlib import Path

import pytest
import torch

from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Kimi-K2's layout at tiny width: DeepSeek-V3 architecture (MLA, sigmoid router with expert
# bias, one shared expert, first layer dense) with 384 routed experts, top-8.
KIMI_LIKE = ["model.model_type=deepseek_v3", "model.num_experts=384",
             "model.num_experts_per_tok=8", "model.routed_scaling_factor=2.827",
             "model.first_k_dense_replace=1", "model.moe_intermediate_size=4",
             "model.hidden_size=32", "model.num_hidden_layers=2", "model.intermediate_size=32",
             "model.num_attention_heads=2", "model.num_key_value_heads=2",
             "model.head_dim=8", "model.q_lora_rank=16", "model.kv_lora_rank=16",
             "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
             "warmstart.enabled=false", "rollout.prompts_per_step=4",
             "rollout.samples_per_prompt=2", "actor.mini_batch_size=8",
             "actor.micro_batch_size=8", "loop.steps=2", "loop.tensorboard=false",
             "loop.plots=false", "actor.aux_loss_coef=0.01", "actor.expert_bias_update_rate=0.001"]


@pytest.mark.slow
def test_384_experts_train_with_r3(tmp_path):
    cfg = load_config(CONFIGS / "toy_r3.yaml", KIMI_LIKE)
    tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    assert tr.actor.route_dtype == torch.uint16
    assert tr.actor.master.cfg.is_mla and tr.actor.master.cfg.router == "sigmoid"
    gates = [b.gate.weight for b in tr.actor.master.moe_blocks]
    before = [g.detach().clone() for g in gates]
    for step in (1, 2):
        m = tr.step(step)
        assert m["replay/mode"] == "R3" and m["replay/mismatch"] == 0.0
        assert m["replay/replayed_fraction"] > 0.5
        assert m["actor/aux_loss"] > 0  # a gradient whatever the rewards of a random policy
    # the routers trained under replay (their gradient flows through the replayed gates)
    assert all(not torch.equal(a, b) for a, b in zip(before, gates))
    # the expert bias moved (aux-loss-free balancing on the routes that ran)
    assert all(b.e_score_correction_bias.abs().sum() > 0 for b in tr.actor.master.moe_blocks)
    # ... and reached the engine with the weights (the bias stays fp32 in the bf16 engine)
    for ours, engine in zip(tr.actor.master.moe_blocks, tr.rollout.engine.model.moe_blocks):
        assert torch.equal(ours.e_score_correction_bias, engine.e_score_correction_bias)
    # experts beyond id 255 did run (uint16 matters)
    assert int(tr.rollout.engine.routes_SMLK.view(torch.uint16).int().max()) > 255


def test_family_from_experiment_yaml_keys_and_megatron_refusal():
    cfg = load_config(CONFIGS / "toy_r3.yaml", ["model.model_type=glm4_moe", "model.n_group=2",
                                                "model.num_experts=4"])
    m = cfg.model
    assert (m.router, m.expert_bias, m.partial_rotary_factor, m.first_k_dense_replace) == \
        ("sigmoid", True, 0.5, 1)
    from lockstep.trainer.config.types import ExperimentConfigError
    with pytest.raises(ExperimentConfigError, match="actor.backend=megatron cannot build model_type='mixtral'"):
        load_config(CONFIGS / "toy_r3.yaml", ["model.model_type=mixtral", "actor.backend=megatron",
                                              "model.intermediate_size=96"])
