"""The MoE model: HF parity, replay semantics, KV cache, precision, bad input."""

import pytest
import torch

from lockstep.moe.checkpoint import save_hf
from lockstep.moe.model import KVCache, MoEModel, RouteError
from lockstep.replay import RoutingTrace

from model_fixtures import tiny_config

PARITY_CONFIGS = {
    "gqa_norm_topk": dict(norm_topk_prob=True),
    "dense_first_layer": dict(mlp_only_layers=[0]),
    "no_norm_topk_tied": dict(norm_topk_prob=False, tie_word_embeddings=True),
    "mha_sparse_step2": dict(num_key_value_heads=4, decoder_sparse_step=2, num_hidden_layers=4),
    "head_dim_ne_hidden_over_heads": dict(head_dim=16, num_experts=8, num_experts_per_tok=3),
}


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_transformers_loads_our_folder_and_matches(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(hash(name) % 1000)
    cfg = tiny_config(**PARITY_CONFIGS[name])
    model = MoEModel(cfg).eval()
    save_hf(model, tmp_path / "ck")
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ck",
                                                          dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 11))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids, output_router_logits=True)
    assert (ours.logits_BTV - theirs.logits).abs().max().item() < 1e-5
    assert len(theirs.router_logits) == cfg.num_moe_layers
    for l, rl in enumerate(theirs.router_logits):
        hf_topk = rl.softmax(-1).topk(cfg.num_experts_per_tok, dim=-1).indices
        assert torch.equal(hf_topk.view(3, 11, -1), ours.natural_BTLK[:, :, l])
        assert torch.allclose(rl.float(), ours.router_logits_LNE[l], atol=1e-5)


def test_replaying_own_routes_is_exact():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = MoEModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    ref = model(ids)
    rep = model(ids, routed_experts_BTLK=ref.routes_BTLK.to(torch.uint8))
    assert torch.equal(ref.logits_BTV, rep.logits_BTV)
    assert torch.equal(rep.routes_BTLK, ref.routes_BTLK)


def test_replaying_other_routes_changes_exactly_the_replayed_positions():
    torch.manual_seed(1)
    cfg = tiny_config(mlp_only_layers=[0])
    model = MoEModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    ref = model(ids)
    routes = ref.routes_BTLK.clone()
    b, t, last = 1, 5, cfg.num_moe_layers - 1
    natural = set(routes[b, t, last].tolist())
    other = [e for e in range(cfg.num_experts) if e not in natural][: cfg.num_experts_per_tok]
    routes[b, t, last] = torch.tensor(other)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[b, t] = True
    rep = model(ids, routed_experts_BTLK=routes, replay_mask_BT=mask)
    changed = (rep.routes_BTLK != ref.routes_BTLK).any(-1).any(-1)
    assert changed.nonzero().tolist() == [[b, t]]
    # The last MoE layer only feeds its own position's head: exactly that row's logits change.
    diff = (rep.logits_BTV - ref.logits_BTV).abs().amax(-1)
    assert diff[b, t] > 1e-4
    diff[b, t] = 0
    assert diff.max() == 0
    # The router still reports what it would have picked.
    assert torch.equal(rep.natural_BTLK, ref.natural_BTLK)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_gets_gradient_for_replayed_experts_outside_its_topk(norm_topk_prob):
    torch.manual_seed(2)
    cfg = tiny_config(num_hidden_layers=1, norm_topk_prob=norm_topk_prob)
    model = MoEModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    nat = model(ids).natural_BTLK
    # Replay, at every token, experts that are NOT in the router's current top-k.
    routes = torch.empty_like(nat)
    for t in range(6):
        outside = [e for e in range(cfg.num_experts) if e not in nat[0, t, 0].tolist()]
        routes[0, t, 0] = torch.tensor(outside[: cfg.num_experts_per_tok])
    out = model(ids, routed_experts_BTLK=routes)
    out.logits_BTV.logsumexp(-1).sum().backward()
    grad = model.layers[0].mlp.gate.weight.grad
    assert grad is not None and torch.isfinite(grad).all()
    # Gathering gate weights from top-k-zeroed probabilities would give zero gradient here.
    assert grad.abs().sum() > 1e-6
    assert torch.isfinite(out.logits_BTV).all()


def test_bf16_and_fp32_route_differently_on_a_sharp_router():
    torch.manual_seed(3)
    cfg = tiny_config(hidden_size=64, num_experts=16, num_experts_per_tok=4, num_hidden_layers=4)
    model32 = MoEModel(cfg)
    with torch.no_grad():
        for layer in model32.layers:
            layer.mlp.gate.weight.mul_(20.0)  # sharp router; bf16 error is relative, so it still flips
    model16 = MoEModel(cfg)
    model16.load_state_dict(model32.state_dict())
    model16.set_precision(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (16, 32))
    with torch.no_grad():
        r32 = model32(ids).routes_BTLK.sort(-1).values
        r16 = model16(ids).routes_BTLK.sort(-1).values
    flips = (r32 != r16).any(-1)  # (B, T, L)
    flip_rate = flips.float().mean().item()
    token_any = flips.any(-1).float().mean().item()
    print(f"bf16 vs fp32: flip rate {flip_rate:.4f} of (token, layer), "
          f"{token_any:.4f} of tokens flip in >= 1 layer")
    assert flip_rate > 0


def test_router_dtype_keeps_router_in_fp32():
    cfg = tiny_config()
    model = MoEModel(cfg).set_precision(torch.bfloat16, router_dtype=torch.float32,
                                        lm_head_dtype=torch.float32)
    assert model.layers[0].mlp.gate.weight.dtype == torch.float32
    assert model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    out = model(torch.randint(0, cfg.vocab_size, (2, 5)))
    assert out.logits_BTV.dtype == torch.float32
    assert out.router_logits_LNE[0].dtype == torch.float32


@pytest.mark.parametrize("fp8", [False, True])
def test_wide_tensors_keep_their_fp32_values(fp8):
    """A router, LM head or selection bias kept wider than the compute dtype is cast from its
    own values, not rounded to bf16 on the way (it was: the actor's fp32 router of step 1 and
    the selection bias always held bf16 values)."""
    torch.manual_seed(5)
    cfg = tiny_config(model_type="deepseek_v3", num_key_value_heads=4, num_experts=8, n_group=4,
                      topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)
    assert cfg.expert_bias
    model = MoEModel(cfg)
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.mlp.e_score_correction_bias.normal_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_precision(torch.bfloat16, router_dtype=torch.float32,
                        lm_head_dtype=torch.float32, fp8=fp8)
    after = model.state_dict()
    wide = [k for k in after if ".mlp.gate." in k or k.startswith("lm_head")
            or k.endswith("e_score_correction_bias")]
    assert len(wide) == 1 + 2 * (cfg.num_hidden_layers - 1)
    for k in wide:
        assert after[k].dtype == torch.float32 and torch.equal(after[k], before[k]), k
    assert after["layers.1.self_attn.o_proj.weight"].dtype == (torch.float32 if fp8 else torch.bfloat16)
    assert after["layers.1.input_layernorm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("tied", [False, True])
def test_kv_cache_matches_full_forward(tied):
    torch.manual_seed(4)
    cfg = tiny_config(mlp_only_layers=[0], tie_word_embeddings=tied)
    model = MoEModel(cfg).eval()
    lengths, total = [3, 7, 5], 12
    seqs = [torch.randint(3, cfg.vocab_size, (total,)) for _ in lengths]
    cache = KVCache.allocate(cfg, num_slots=5, max_len=16, dtype=torch.float32)
    slots = torch.tensor([4, 0, 2])
    # Prefill a right-padded batch of mixed prompt lengths.
    P = max(lengths)
    prompt = torch.zeros(3, P, dtype=torch.long)
    for i, n in enumerate(lengths):
        prompt[i, :n] = seqs[i][:n]
    with torch.no_grad():
        pre = model(prompt, kv_cache=cache, cache_slots_B=slots)
        logits = {i: [pre.logits_BTV[i, :n]] for i, n in enumerate(lengths)}
        routes = {i: [pre.routes_BTLK[i, :n]] for i, n in enumerate(lengths)}
        pos = torch.tensor(lengths)
        # Decode one token per row at its own position, until each row has `total` tokens.
        while int(pos.min()) < total:
            live = (pos < total).nonzero().flatten()
            tok = torch.stack([seqs[i][pos[i]] for i in live.tolist()])[:, None]
            out = model(tok, positions_BT=pos[live][:, None], kv_cache=cache,
                        cache_slots_B=slots[live])
            for j, i in enumerate(live.tolist()):
                logits[i].append(out.logits_BTV[j])
                routes[i].append(out.routes_BTLK[j])
            pos[live] += 1
        full = model(torch.stack(seqs))
    for i in range(3):
        assert (torch.cat(logits[i]) - full.logits_BTV[i]).abs().max() < 1e-5
        assert torch.equal(torch.cat(routes[i]), full.routes_BTLK[i])


def test_bad_routes_name_the_problem():
    cfg = tiny_config()
    model = MoEModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 4))
    good = model(ids).routes_BTLK
    with pytest.raises(RouteError, match=r"shape \(2, 4, 2, 2\).*\[2, 4, 3, 2\]"):
        model(ids, routed_experts_BTLK=good[:, :, :2])
    with pytest.raises(RouteError, match="integer"):
        model(ids, routed_experts_BTLK=good.float())
    # Ids are validated once, where routes enter (RoutingTrace: engine results, codecs, trace
    # files); the model trusts them (shape checks only). The same bad routes at the edge:
    bad = good.clone()
    bad[1, 3, 2, 1] = cfg.num_experts
    with pytest.raises(RouteError, match=r"sample 1: routes row 3 \(position\), layer 2, slot 1: "
                                         r"expert id 6 outside \[0, 6\)"):
        RoutingTrace(bad[1], cfg.num_experts, sample=1)
    # An out-of-range id at a position that is not replayed is ignored, never clamped.
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = False
    out = model(ids, routed_experts_BTLK=bad, replay_mask_BT=mask)
    assert torch.equal(out.routes_BTLK, good)
    dup = good.clone()
    dup[0, 2, 1] = torch.tensor([3, 3])
    with pytest.raises(RouteError, match=r"sample 0: routes row 2 \(position\), layer 1: expert ids "
                                         r"\[3, 3\] repeat an expert"):
        RoutingTrace(dup[0], cfg.num_experts, sample=0)
    with pytest.raises(RouteError, match="replay_mask must be bool"):
        model(ids, routed_experts_BTLK=good, replay_mask_BT=mask.long())


def test_load_balancing_loss_is_one_for_uniform_router():
    cfg = tiny_config()
    model = MoEModel(cfg)
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate.weight.zero_()
    out = model(torch.randint(0, cfg.vocab_size, (4, 8)))
    # Uniform P_e = 1/E; f sums to 1 -> E * sum f_e / E = 1.
    assert model.load_balancing_loss(out).item() == pytest.approx(1.0, abs=1e-6)
