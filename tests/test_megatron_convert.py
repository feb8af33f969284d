"""HF <-> megatron-core weight layouts (pure tensor code: no megatron-core import needed) and
the replay adapter's token-order helpers.

Shapes: B batch, T tokens, L MoE layers, K top-k, E experts, G kv groups, hd head dim.
"""

import pytest
import torch

from lockstep.moe.config import ModelConfig
from lockstep.replay import RouteError, RoutingTrace
from lockstep.trainer.actor.megatron.convert import Layout, hf_to_megatron, megatron_to_hf
from lockstep.trainer.actor.megatron.replay import build_replay_ids, to_router_order


def cfg_(**kw) -> ModelConfig:
    base = dict(vocab_size=16, hidden_size=8, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=4, intermediate_size=12,
                moe_intermediate_size=6, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=[0])
    base.update(kw)
    return ModelConfig(**base)


def hf_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every HF tensor filled with distinct values, so any misplaced element is caught."""
    from lockstep.moe.checkpoint import hf_state_dict
    from lockstep.moe.model import MoEModel
    from lockstep.trainer.actor.megatron.convert import expected_hf_keys

    shapes = {k: v.shape for k, v in hf_state_dict(MoEModel(cfg)).items()}
    assert set(shapes) == expected_hf_keys(cfg)
    out, start = {}, 0
    for k in sorted(shapes):
        n = shapes[k].numel()
        out[k] = torch.arange(start, start + n, dtype=torch.float32).view(shapes[k])
        start += n
    return out


@pytest.mark.parametrize("lay", [
    Layout(), Layout(tp=2), Layout(ep=2), Layout(ep=4), Layout(tp=2, ep=2, etp=2),
    Layout(tp=2, etp=2),
    Layout(ep=2, grouped_experts=True, te_fused_norms=True),
])
@pytest.mark.parametrize("tied", [False, True])
def test_roundtrip_through_shards_is_exact(lay, tied):
    cfg = cfg_(tie_word_embeddings=tied)
    hf = hf_weights(cfg)
    shards = {(t, e, x): hf_to_megatron(hf, cfg, lay, tp_rank=t, ep_rank=e, etp_rank=x)
              for t in range(lay.tp) for e in range(lay.ep) for x in range(lay.etp)}
    if lay.tp == lay.etp == 2 and lay.ep == 1:  # world of 2: expert TP rank = TP rank
        shards = {k: v for k, v in shards.items() if k[0] == k[2]}
    back = megatron_to_hf(shards, cfg, lay)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_is_interleaved_per_query_group_and_split_by_tp():
    cfg = cfg_()
    hf = hf_weights(cfg)
    hd, D = cfg.head_dim, cfg.hidden_size
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    k = hf["model.layers.1.self_attn.k_proj.weight"]
    v = hf["model.layers.1.self_attn.v_proj.weight"]
    # group g = query heads 2g, 2g+1 (H/G = 2), then key head g, then value head g
    want_g1 = torch.cat([q[2 * hd:4 * hd], k[hd:2 * hd], v[hd:2 * hd]])
    whole = hf_to_megatron(hf, cfg)["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(whole[4 * hd:], want_g1)
    rank1 = hf_to_megatron(hf, cfg, Layout(tp=2), tp_rank=1)
    assert torch.equal(rank1["decoder.layers.1.self_attention.linear_qkv.weight"], want_g1)
    # o_proj columns of rank 1 = heads 2, 3
    o = hf["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(rank1["decoder.layers.1.self_attention.linear_proj.weight"],
                       o[:, 2 * hd:])
    assert whole.shape == (cfg.num_key_value_heads * 4 * hd, D)


def test_fc1_holds_gate_then_up_of_each_shard_and_experts_follow_ep_rank():
    cfg = cfg_()
    hf = hf_weights(cfg)
    I = cfg.intermediate_size
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    r1 = hf_to_megatron(hf, cfg, Layout(tp=2), tp_rank=1)
    assert torch.equal(r1["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([gate[I // 2:], up[I // 2:]]))
    e1 = hf_to_megatron(hf, cfg, Layout(ep=2), ep_rank=1)
    # EP rank 1 holds global experts 2, 3 as local 0, 1
    assert torch.equal(e1["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf["model.layers.2.mlp.experts.3.down_proj.weight"])
    assert "decoder.layers.2.mlp.experts.local_experts.2.linear_fc2.weight" not in e1


def test_bad_inputs_name_the_problem():
    cfg = cfg_()
    hf = hf_weights(cfg)
    del hf["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="missing.*layers.2.mlp.experts.3.up_proj"):
        hf_to_megatron(hf, cfg)
    with pytest.raises(ValueError, match=r"needs a shard with tp_rank=1"):
        megatron_to_hf({(0, 0, 0): {}}, cfg, Layout(tp=2))


def test_router_order_is_sequence_first_and_sharded_by_tp():
    B, T, L, K = 2, 5, 3, 2
    ids = torch.arange(B * T * L * K).view(B, T, L, K)
    (layer0,) = to_router_order(ids[:, :, :1], tp=1, tp_rank=0)
    # token n = s * B + b
    assert torch.equal(layer0[3 * B + 1], ids[1, 3, 0])
    # TP=2: S = 6 (one padding position), rank 1 holds positions 3, 4, 5
    r1 = to_router_order(ids, tp=2, tp_rank=1)
    assert len(r1) == L and r1[2].shape == (3 * B, K)
    assert torch.equal(r1[2][0 * B + 1], ids[1, 3, 2])
    assert torch.equal(r1[2][1 * B + 0], ids[0, 4, 2])


def test_replay_ids_keep_given_routes_and_placeholders_elsewhere():
    B, T, L, K, E = 2, 5, 2, 2, 4
    ids = torch.randint(0, E, (B, T, L, K))
    valid = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    full = build_replay_ids(ids, valid, num_experts=E)
    assert torch.equal(full[valid], ids[valid])
    # elsewhere a placeholder (the forward routes these positions naturally): distinct ids
    spread = full[~valid]
    assert (spread.sort(-1).values[..., 0] != spread.sort(-1).values[..., 1]).all()
    # ids are validated where they enter (RoutingTrace), not again here: the same bad id is
    # refused at the edge, naming sample, position and layer
    bad = ids.clone()
    bad[1, 2, 1, 0] = E
    with pytest.raises(RouteError, match=r"sample 1: routes row 2 \(position\), layer 1, slot 0: "
                                         r"expert id 4 outside \[0, 4\)"):
        RoutingTrace(bad[1], E, sample=1)
    with pytest.raises(RouteError, match=r"valid_BT must be bool \(2, 5\)"):
        build_replay_ids(ids, valid.long(), num_experts=E)


@pytest.mark.parametrize("family,field", [("mixtral", "has not been checked"),
                                          ("deepseek_v3", "rms_norm_eps="),
                                          ("qwen2_moe", "shared_expert_intermediate_size=")])
def test_transformer_config_refuses_unmapped_families(family, field):
    from lockstep.moe.checks import ConfigError
    from lockstep.trainer.actor.megatron.model import transformer_config
    from lockstep.trainer.config.megatron import MegatronOptions

    kw = dict(kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=8, rms_norm_eps=1e-5) if family == "deepseek_v3" else \
        dict(shared_expert_intermediate_size=16) if family == "qwen2_moe" else \
        dict(intermediate_size=96) if family == "mixtral" else {}
    cfg = ModelConfig.for_architecture(family, **kw)
    with pytest.raises(ConfigError, match=rf"model_type='{family}' .*{field}.*use "
                                          r"actor\.backend=torch"):
        transformer_config(cfg, MegatronOptions())
