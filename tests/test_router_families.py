"""Replay under every router family (moe/router.py): replayed routes reproduce a forward
exactly, the selection bias and the group limit change natural routing but never replayed gate
weights, the router keeps its gradient, and the bias update counts the routes that ran."""

import pytest
import torch

from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.moe.router import route

DIMS = dict(vocab_size=48, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
            num_experts=8, num_experts_per_tok=2)
MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=8, v_head_dim=8)
FAMILIES = {
    "qwen3_softmax_topk": ("qwen3_moe", dict(norm_topk_prob=False)),
    "qwen2_gated_shared": ("qwen2_moe", dict(shared_expert_intermediate_size=24)),
    "mixtral_topk_softmax": ("mixtral", dict(intermediate_size=16)),
    "glm_sigmoid_groups": ("glm4_moe", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                            first_k_dense_replace=1, attention_bias=True)),
    "deepseek_mla": ("deepseek_v3", dict(n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                         first_k_dense_replace=1, **MLA)),
    "gptoss_biased_topk_softmax": ("gpt_oss", dict(intermediate_size=16, sliding_window=3,
                                                   layer_types=["sliding_attention",
                                                                "full_attention"] * 1
                                                   + ["sliding_attention"])),
    "qwen35_hybrid_gated_shared": ("qwen3_5_moe_text", dict(
        shared_expert_intermediate_size=24, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"])),
    "dsv32_indexed_mla": ("deepseek_v32", dict(n_group=2, topk_group=1, first_k_dense_replace=1,
                                               index_topk=3, index_head_dim=8, index_n_heads=4,
                                               **MLA)),
}


def make(name, seed=0, **over) -> MoEModel:
    model_type, kw = FAMILIES[name]
    cfg = ModelConfig.for_architecture(model_type, **{**DIMS, **kw, **over})
    torch.manual_seed(seed)
    model = MoEModel(cfg).eval()
    with torch.no_grad():
        for block in model.moe_blocks:
            block.gate.weight.normal_(0.0, 0.5)
            if block.e_score_correction_bias is not None:
                block.e_score_correction_bias.uniform_(-0.2, 0.2)
    return model


def shifted(routes_BTLK, E):
    """Different valid routes: every id moved by one (mod E)."""
    return (routes_BTLK + 1) % E


IDS = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_replaying_a_forwards_routes_reproduces_it_exactly(name):
    model = make(name)
    with torch.no_grad():
        out = model(IDS)
        replayed = model(IDS, routed_experts_BTLK=out.routes_BTLK.to(torch.uint8))
        other = model(IDS, routed_experts_BTLK=shifted(out.routes_BTLK, 8))
    assert torch.equal(out.logits_BTV, replayed.logits_BTV)
    assert torch.equal(replayed.routes_BTLK, out.routes_BTLK)
    # Other routes do run: logits change, the natural choice reported is unchanged at the
    # first MoE layer (same input there).
    assert not torch.allclose(other.logits_BTV, out.logits_BTV)
    assert torch.equal(other.routes_BTLK, shifted(out.routes_BTLK, 8))
    assert torch.equal(other.natural_BTLK[:, :, 0], out.natural_BTLK[:, :, 0])


@pytest.mark.parametrize("name", ["glm_sigmoid_groups", "deepseek_mla"])
def test_bias_and_group_limit_change_natural_routing_never_replayed_weights(name):
    model = make(name)
    # The group limit: the same weights with every group allowed route differently, and
    # replay ignores the limit (same logits bit for bit).
    wide = make(name, topk_group=model.cfg.n_group)
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = model(IDS)
        routes = out.routes_BTLK.clone()
        assert not torch.equal(wide(IDS).natural_BTLK, out.natural_BTLK)
        assert torch.equal(wide(IDS, routed_experts_BTLK=routes).logits_BTV, out.logits_BTV)
        # The bias steers selection ...
        for block in model.moe_blocks:
            block.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
        assert not torch.equal(model(IDS).natural_BTLK, out.natural_BTLK)
        # ... but replayed routes give the same logits whatever the bias.
        replayed = model(IDS, routed_experts_BTLK=routes)
        assert torch.equal(replayed.logits_BTV, out.logits_BTV)


def test_sigmoid_gate_weights_under_replay_by_hand():
    cfg = ModelConfig.for_architecture("deepseek_v3", **{**DIMS, **MLA}, n_group=4, topk_group=1,
                                       routed_scaling_factor=2.5)
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    bias = torch.linspace(-3, 3, 8)  # strong: the natural choice is the last group's experts
    ids, gates, natural = route(logits, cfg, bias)
    assert (natural // 2 == 3).all()  # the group limit (top-1 group of 4) holds
    replay = torch.tensor([[0, 5]] * 5)  # two groups, neither the natural one
    ids, gates, natural2 = route(logits, cfg, bias, replay, torch.ones(5, dtype=torch.bool))
    assert torch.equal(ids, replay) and torch.equal(natural2, natural)
    s = logits.sigmoid().gather(1, replay)
    torch.testing.assert_close(gates, s / (s.sum(-1, keepdim=True) + 1e-20) * 2.5,
                               rtol=0, atol=0)


def test_topk_softmax_gates_are_a_softmax_over_the_k_logits():
    cfg = ModelConfig.for_architecture("mixtral", **{**DIMS, "intermediate_size": 16})
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(5))
    replay = torch.tensor([[1, 6]] * 5)
    ids, gates, _ = route(logits, cfg, None, replay, torch.ones(5, dtype=torch.bool))
    torch.testing.assert_close(gates, logits.gather(1, replay).softmax(-1), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_router_gets_gradient_under_replay(name):
    model = make(name).train()
    out = model(IDS)
    routes = shifted(out.routes_BTLK.detach(), 8)  # experts outside the natural top-k
    out = model(IDS, routed_experts_BTLK=routes)
    out.logits_BTV.logsumexp(-1).sum().backward()
    for block in model.moe_blocks:
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
        if block.e_score_correction_bias is not None:
            assert not block.e_score_correction_bias.requires_grad


def test_bias_update_counts_the_replayed_routes():
    model = make("deepseek_mla")
    with torch.no_grad():
        natural = model(IDS)
        replay = torch.zeros_like(natural.routes_BTLK)
        replay[..., 1] = 1  # every token to experts 0 and 1: 0 and 1 overloaded
        out = model(IDS, routed_experts_BTLK=replay)
    before = [b.e_score_correction_bias.clone() for b in model.moe_blocks]
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    loads = model.update_expert_bias(out.routes_BTLK, valid, rate=0.01)
    assert loads[:, :2].tolist() == [[12.0, 12.0]] * model.cfg.num_moe_layers
    assert loads[:, 2:].sum() == 0
    for b, old in zip(model.moe_blocks, before):
        delta = b.e_score_correction_bias - old
        torch.testing.assert_close(delta, torch.tensor([-0.01] * 2 + [0.01] * 6))


def _actor_batch(model, n=4, seed=0):
    from lockstep.kernels.logprob import logprobs_from_logits
    from lockstep.rollout.types import GenerationResult
    from lockstep.trainer.actor.batch import collate

    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    results = []
    for b in range(n):
        ids = torch.randint(3, 48, (7,), generator=g)
        with torch.no_grad():
            o = model(ids[None])
        lp = logprobs_from_logits(o.logits_BTV[0, 3:-1], ids[4:])
        results.append(GenerationResult(f"r{b}", 0, ids[:4].tolist(), ids[4:].tolist(), lp, lp,
                                        {"type": "length", "length": 3}, "0",
                                        o.routes_BTLK[0, :-1].to(torch.uint8)))
    return collate(results, 0, cfg.num_experts, cfg.num_moe_layers, cfg.num_experts_per_tok)


def _forced(batch, first):
    """Replay routes sending every token to experts (first, first + 1)."""
    forced = torch.full_like(batch.rollout_routes_BTLK, first)
    forced[..., 1] = first + 1
    return forced


def _zero_loss(batch):
    return lambda lp_BT, ent_BT, rows, mini: ((lp_BT * batch.response_mask_BT[rows]).sum() * 0,
                                              {})


def test_torch_actor_bias_update_counts_the_replayed_routes():
    """actor.expert_bias_update_rate: the update after each optimiser step counts the routes
    the mini-batch ran: under replay, the replayed ones (every token forced to experts 0, 1)."""
    from lockstep.trainer.actor.torch_actor import TorchActor
    from lockstep.trainer.config.sections import ActorConfig

    model = make("deepseek_mla")
    batch = _actor_batch(model)
    forced = _forced(batch, 0)
    actor = TorchActor(model, ActorConfig(mini_batch_size=4, micro_batch_size=2,
                                          expert_bias_update_rate=0.01), total_updates=1)
    before = [b.e_score_correction_bias.clone() for b in model.moe_blocks]
    metrics, used, _ = actor.update(batch, _zero_loss(batch), forced,
                                    batch.rollout_routes_valid_BT)
    assert torch.equal(used[batch.rollout_routes_valid_BT].long(),
                       forced[batch.rollout_routes_valid_BT].long())
    for b, old in zip(model.moe_blocks, before):
        torch.testing.assert_close(b.e_score_correction_bias - old,
                                   torch.tensor([-0.01] * 2 + [0.01] * 6))
    # 2 of 8 experts take all replayed rows (the unreplayed last tokens route naturally)
    assert metrics["actor/expert_load_max_over_mean"] > 3.5


def _dp_rank(rank, init_file, out_dir):
    import torch.distributed as dist

    from lockstep.trainer.actor.torch_actor import TorchActor
    from lockstep.trainer.config.sections import ActorConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = make("deepseek_mla")
        batch = _actor_batch(model, n=2, seed=rank)
        actor = TorchActor(model, ActorConfig(mini_batch_size=4, micro_batch_size=2,
                                              expert_bias_update_rate=0.01), total_updates=1,
                           dp_group=dist.group.WORLD)
        actor.update(batch, _zero_loss(batch), _forced(batch, 2 * rank),
                     batch.rollout_routes_valid_BT, steps=[torch.arange(2)], mini_size=4)
        torch.save([b.e_score_correction_bias for b in model.moe_blocks],
                   f"{out_dir}/bias{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dp_ranks_apply_the_same_bias_update_from_the_global_load(tmp_path):
    """Two gloo ranks, rank r replaying experts (2r, 2r + 1): both apply the update of the
    summed load (experts 0-3 overloaded), so their biases stay equal."""
    import torch.multiprocessing as mp

    before = [b.e_score_correction_bias.clone() for b in make("deepseek_mla").moe_blocks]
    mp.start_processes(_dp_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    b0, b1 = (torch.load(tmp_path / f"bias{r}.pt") for r in (0, 1))
    for x, y, old in zip(b0, b1, before):
        assert torch.equal(x, y)
        torch.testing.assert_close(x - old, torch.tensor([-0.01] * 4 + [0.01] * 4))


def test_bf16_save_keeps_the_expert_bias_fp32(tmp_path):
    from lockstep.moe.checkpoint import read_hf_state_dict, save_hf

    model = make("glm_sigmoid_groups")
    save_hf(model, tmp_path / "ck", dtype=torch.bfloat16)
    sd = read_hf_state_dict(tmp_path / "ck")
    bias = sd["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    assert torch.equal(bias, model.moe_blocks[0].e_score_correction_bias)
    assert sd["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
