"""The families added since GLM-4.5 / DeepSeek-V3 (gpt-oss, ...) against transformers in fp32:
logits, every MoE layer's top-k and gate weights (tests/families_parity.py measures them and
writes docs/model.md's parity table), the features that make each family what it is, and
save/load round trips."""

import copy

import pytest
import torch

from lockstep.moe.checkpoint import hf_state_dict, load_hf, save_hf
from lockstep.moe.config import ModelConfig

from arch_fixtures import write_hf_folder
from families_parity import NEW_FAMILIES, documented_families, family_parity, parity

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_family_matches_transformers_and_its_parity_row(family, tmp_path):
    r = family_parity(family, tmp_path / family)
    assert r["logit_diff"] <= 1e-5
    assert r["topk_agree"] and all(a == 1.0 for a in r["topk_agree"]), r["topk_agree"]
    assert r["gate_diff"] <= 1e-6
    assert r["experts_used"] >= 4  # routing is not degenerate
    row = documented_families().get(family)
    assert row is not None, f"docs/model.md's parity table has no row for {family}: run " \
                            "python tests/families_parity.py --write"
    n_index = len(r["indexer_agree"] or [])
    assert all(a == 1.0 for a in r["indexer_agree"] or []), r["indexer_agree"]
    assert row.count("100%") == len(r["topk_agree"]) + n_index, row


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_our_folder_loads_back_in_transformers(family, tmp_path):
    folder = write_hf_folder(family, tmp_path / "ref")
    ours = load_hf(folder).eval()
    save_hf(ours, tmp_path / "ours")
    assert ModelConfig.from_json(tmp_path / "ours") == ours.cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours",
                                                           dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(4))
    r = parity(ours, hf, ids)
    assert r["logit_diff"] <= 1e-5 and all(a == 1.0 for a in r["topk_agree"])
    reloaded = load_hf(tmp_path / "ours")
    for k, v in hf_state_dict(ours).items():
        assert torch.equal(v, hf_state_dict(reloaded)[k]), k


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "qwen3_5_moe_text"])
def test_all_full_attention_is_written_as_such(family, tmp_path):
    """layer_types None (every layer full attention, ours) must not reach config.json as
    null: transformers and our reader would take the family's default pattern (sliding or
    linear layers) instead."""
    import dataclasses

    from lockstep.moe.model import MoEModel
    ref = load_hf(write_hf_folder(family, tmp_path / "ref")).cfg
    torch.manual_seed(0)
    ours = MoEModel(dataclasses.replace(ref, layer_types=None)).eval()
    save_hf(ours, tmp_path / "ours")
    back = ModelConfig.from_json(tmp_path / "ours")
    L = back.num_hidden_layers
    assert [back.layer_type(i) for i in range(L)] == ["full_attention"] * L
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours",
                                                           dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(4))
    r = parity(ours, hf, ids)
    assert r["logit_diff"] <= 1e-5 and all(a == 1.0 for a in r["topk_agree"])


def _gpt_oss_ablations(model):
    """Each gpt-oss feature switched off in a copy: what the parity test would catch."""
    def sinks(m):
        for layer in m.layers:
            layer.self_attn.sinks.data.fill_(float("-inf"))

    def window(m):
        for layer in m.layers:
            layer.self_attn.window = None

    def clamp(m):
        for layer in m.layers:
            layer.mlp.experts.limit = float("inf")

    def router_bias(m):
        for layer in m.layers:
            layer.mlp.gate.bias.data.zero_()

    for name, off in dict(sinks=sinks, window=window, clamp=clamp, router_bias=router_bias).items():
        m = copy.deepcopy(model)
        off(m)
        yield name, m


def test_gpt_oss_features_each_change_the_logits(tmp_path):
    """Dropping the sinks, the sliding window, the SwiGLU clamp or the router bias moves the
    logits well past the parity tolerance (so the parity test fails without any of them)."""
    ours = load_hf(write_hf_folder("gpt_oss", tmp_path / "g")).eval()
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ours(ids).logits_BTV
        for name, m in _gpt_oss_ablations(ours):
            assert (m(ids).logits_BTV - ref).abs().max() > 1e-4, name


def test_qwen_hybrid_features_each_change_the_logits(tmp_path):
    """Gated attention's gate, the DeltaNet convolution, its output gate z, its decay and the
    zero-centred norms each move Qwen3.5's logits past the parity tolerance."""
    ours = load_hf(write_hf_folder("qwen3_5_moe_text", tmp_path / "q")).eval()
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))

    def no_output_gate(m):  # gate rows 0, gate bias 60: sigmoid(gate) = 1
        attn = m.layers[3].self_attn
        H, Dh = attn.num_heads, attn.head_dim
        attn.q_proj.weight.data.view(H, 2, Dh, -1)[:, 1] = 0.0
        attn.q_proj.bias.data.view(H, 2, Dh)[:, 1] = 60.0

    def no_conv(m):
        for layer in m.layers[:3]:
            w = layer.self_attn.conv1d.weight.data
            w.zero_()
            w[..., -1] = 1.0  # identity kernel: the token itself

    def no_z_gate(m):
        for layer in m.layers[:3]:
            z = layer.self_attn.in_proj_z.weight.data  # z = 50 x_0: silu(z) ~ z, not a gate
            z.zero_()
            z[:, 0] = 50.0

    def no_decay(m):
        for layer in m.layers[:3]:
            layer.self_attn.A_log.data.fill_(-30.0)  # g ~ 0: gamma = 1

    def plain_norms(m):
        for layer in m.layers:
            layer.input_layernorm.weight.data -= 1.0  # (1 + w) -> w

    with torch.no_grad():
        ref = ours(ids).logits_BTV
        for off in (no_output_gate, no_conv, no_z_gate, no_decay, plain_norms):
            m = copy.deepcopy(ours)
            off(m)
            assert (m(ids).logits_BTV - ref).abs().max() > 1e-4, off.__name__


def test_delta_rule_chunked_equals_the_recurrent_steps():
    """The chunked form (full-sequence forwards) and the token-by-token form (decode steps)
    of the gated delta rule agree to fp32 rounding across chunk boundaries and from a given
    initial state; a one-token shift of the decay breaks the agreement."""
    from lockstep.moe.deltanet import delta_rule_chunked, delta_rule_step, l2_normalize

    gen = torch.Generator().manual_seed(0)
    B, H, T, Dk, Dv = 2, 3, 150, 8, 6
    q = l2_normalize(torch.randn(B, H, T, Dk, generator=gen)) * Dk ** -0.5
    k = l2_normalize(torch.randn(B, H, T, Dk, generator=gen))
    v = torch.randn(B, H, T, Dv, generator=gen)
    g = -torch.rand(B, H, T, generator=gen)
    beta = torch.rand(B, H, T, generator=gen)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen)
    o, S = delta_rule_chunked(q, k, v, g, beta, S0)
    state, outs = S0, []
    for t in range(T):
        out, state = delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t],
                                     beta[:, :, t], state)
        outs.append(out)
    torch.testing.assert_close(o, torch.stack(outs, 2), rtol=0, atol=1e-5)
    torch.testing.assert_close(S, state, rtol=0, atol=1e-5)
    shifted, _ = delta_rule_chunked(q, k, v, g.roll(1, -1), beta, S0)
    assert (shifted - o).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "gpt_oss"])
def test_engine_decode_equals_the_full_forward_in_fp32(family, tmp_path):
    """The embedded engine (prefill by length groups + cached decode: recurrent DeltaNet steps,
    sliding windows and sinks over the KV cache) against one full forward of our model over
    prompt + completion (chunked DeltaNet across chunk boundaries): log-probs within 1e-5,
    routes identical."""
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.types import GenerateRequest, SamplingParams

    folder = write_hf_folder(family, tmp_path / family, max_position_embeddings=160)
    model = load_hf(folder).eval()
    engine = Engine.from_model(model, EngineConfig(dtype="fp32", max_len=160, max_running=8))
    reqs = [GenerateRequest(list(p), SamplingParams(max_new_tokens=90, seed=i, n=2,
                                                    ignore_eos=True))
            for i, p in enumerate(((5, 9, 1, 7, 3), (5, 9, 4), (3, 4, 8, 8, 1)))]
    for r in engine.generate(reqs):
        ids = torch.tensor(r.prompt_ids + r.output_ids)[None]
        with torch.no_grad():
            out = model(ids)
        P, R = r.prompt_tokens, r.completion_tokens
        assert P + R > 64  # past the chunked rule's first chunk
        lp = torch.log_softmax(out.logits_BTV[0].float(), -1)[P - 1:P + R - 1]
        want = lp.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert (r.output_logprobs - want).abs().max().item() <= 1e-5
        assert torch.equal(r.routes_NLK.long(), out.routes_BTLK[0, :P + R - 1])


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_rope_layout_is_the_familys(family, tmp_path):
    """DeepSeek-V3.2's indexer rotates half-split pairs, GLM-5's interleaved ones: the other
    layout breaks parity with transformers (the picks and the logits move)."""
    import transformers as tf

    folder = write_hf_folder(family, tmp_path / family)
    ours = load_hf(folder).eval()
    assert ours.cfg.indexer_rope_interleave == (family == "glm_moe_dsa")
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(1))
    swapped = copy.deepcopy(ours)
    for layer in swapped.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.interleave = not layer.self_attn.indexer.interleave
    r = parity(swapped, hf, ids)
    assert r["logit_diff"] > 1e-3
    assert min(r["indexer_agree"]) < 0.9


def test_glm5_shared_layers_reuse_the_previous_pick(tmp_path):
    """GLM-5's shared layers have no indexer; their attention uses the last full layer's keys."""
    ours = load_hf(write_hf_folder("glm_moe_dsa", tmp_path / "g")).eval()
    assert [layer.self_attn.indexer is None for layer in ours.layers] == [False, True, False, True]
    assert ours.cfg.indexer_layer_ids == [0, 2]
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ours(ids)
    assert out.indexer_BTLK.shape == (2, 13, 2, 4)


def test_replaying_indexer_picks(tmp_path):
    """The model's own picks replayed reproduce its forward bit for bit; picks shifted by one
    position, or taken from the other sample, change the logits; a replay mask limits it."""
    from lockstep.kernels.routes import RouteError

    ours = load_hf(write_hf_folder("deepseek_v32", tmp_path / "d")).eval()
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ours(ids)
        picks = out.indexer_BTLK
        same = ours(ids, indexer_topk_BTLK=picks.to(torch.int32))
        assert torch.equal(same.logits_BTV, out.logits_BTV)
        assert torch.equal(same.indexer_natural_BTLK, picks)
        T = torch.arange(13)[None, :, None, None]
        shifted = torch.where(picks > 0, picks - 1, picks)  # one position earlier, still causal
        assert (ours(ids, indexer_topk_BTLK=shifted).logits_BTV - out.logits_BTV).abs().max() \
            > 1e-4
        other = picks.flip(0)
        other = torch.where(other <= T, other, -1)
        assert (ours(ids, indexer_topk_BTLK=other).logits_BTV - out.logits_BTV).abs().max() > 1e-4
        none = torch.zeros(2, 13, dtype=torch.bool)
        masked = ours(ids, indexer_topk_BTLK=shifted, indexer_mask_BT=none)
        assert torch.equal(masked.logits_BTV, out.logits_BTV)
        with pytest.raises(RouteError, match="indexer_topk must be integer"):
            ours(ids, indexer_topk_BTLK=picks[:, :, :2])
