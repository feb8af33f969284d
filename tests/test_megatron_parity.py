"""megatron-core GPTModel vs transformers' Qwen3MoeForCausalLM and lockstep's torch model, on
CPU (gloo, world size 1, in this process): log-probs, natural routes, replay, record, leaks.

Shapes: B batch, T tokens, L MoE layers, K top-k, E experts, V vocab.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")


from lockstep.moe.checkpoint import hf_state_dict, load_hf_state_dict  # noqa: E402
from lockstep.moe.config import ModelConfig  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.trainer.actor.megatron import convert  # noqa: E402
from lockstep.trainer.actor.megatron.model import (build_gpt_model, forward_logits,
                                                   initialize_parallel, token_logprobs)
from lockstep.trainer.config.megatron import MegatronOptions
from lockstep.trainer.actor.megatron.replay import Mode, RouteReplay  # noqa: E402

pytestmark = pytest.mark.megatron

TOL = 1e-4


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48,
                moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=[0], rope_theta=500.0)
    base.update(kw)
    return ModelConfig(**base)


def random_hf(cfg: ModelConfig, seed: int = 0):
    """A transformers Qwen3MoeForCausalLM with random weights (router wide enough that routes
    are not decided by rounding) and its state dict under HF per-expert names."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg.to_hf_dict())).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.5 if n.endswith("mlp.gate.weight") else 0.1)
    sd = {}
    for k, v in hf.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            for e in range(v.shape[0]):
                g, u = v[e].chunk(2, dim=0)
                sd[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g.clone()
                sd[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = u.clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                sd[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        elif not (cfg.tie_word_embeddings and k == "lm_head.weight"):
            sd[k] = v.clone()
    return hf, sd



def megatron_from_hf(cfg, sd, **opts):
    model = build_gpt_model(cfg, MegatronOptions(**opts)).eval()
    convert.load_hf_into_megatron(model, sd, cfg)
    return model


def shifted_logprobs(logits_BTV, ids_BT):
    return torch.log_softmax(logits_BTV.float(), -1)[:, :-1].gather(-1, ids_BT[:, 1:, None])[..., 0]


def hf_natural_routes(router_logits, cfg, B, T):
    return torch.stack([x.float().topk(cfg.num_experts_per_tok, dim=-1).indices.view(B, T, -1)
                        for x in router_logits], dim=2)


@pytest.mark.parametrize("variant", ["untied_norm_topk", "tied_no_norm_all_moe"])
def test_logprobs_and_natural_routes_match_transformers(world1, variant):
    if variant == "untied_norm_topk":
        cfg = tiny_cfg()
    else:
        cfg = tiny_cfg(tie_word_embeddings=True, norm_topk_prob=False, mlp_only_layers=[])
    hf, sd = random_hf(cfg)
    model = megatron_from_hf(cfg, sd)
    B, T = 3, 9
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
        replay = RouteReplay(model, cfg.num_experts)
        with replay.session(Mode.RECORD):
            lp = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
            routes = replay.recorded(B, T)
    assert replay.num_layers == cfg.num_moe_layers
    assert (lp - shifted_logprobs(out.logits, ids)).abs().max() <= TOL
    want = hf_natural_routes(out.router_logits, cfg, B, T)
    assert torch.equal(routes.sort(-1).values, want.sort(-1).values)


def test_hf_megatron_roundtrip_is_exact_on_live_model(world1):
    cfg = tiny_cfg()
    _, sd = random_hf(cfg, seed=3)
    model = megatron_from_hf(cfg, sd)
    back = convert.megatron_to_hf_state_dict(model, cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_replay_matches_torch_model_and_router_gets_gradient(world1):
    cfg = tiny_cfg()
    _, sd = random_hf(cfg, seed=4)
    model = megatron_from_hf(cfg, sd)
    torch_model = MoEModel(cfg)
    load_hf_state_dict(torch_model, sd)
    B, T, L, K = 2, 8, cfg.num_moe_layers, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    # random distinct experts per (token, layer): far from the natural routes
    routes = torch.rand(B, T, L, cfg.num_experts, generator=g).argsort(-1)[..., :K]
    routes = routes.to(torch.uint8)
    ref = torch_model(ids, routed_experts_BTLK=routes)
    assert torch.equal(ref.routes_BTLK, routes.long())
    ref_lp = shifted_logprobs(ref.logits_BTV, ids)
    natural_lp = shifted_logprobs(torch_model(ids).logits_BTV, ids)
    assert (ref_lp - natural_lp).abs().max() > 10 * TOL  # replay really changes the result

    replay = RouteReplay(model, cfg.num_experts)
    with replay.session(Mode.REPLAY):
        replay.set_routes(routes)
        lp = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
        lp.sum().backward()
    assert (lp.detach() - ref_lp.detach()).abs().max() <= TOL
    for layer in model.decoder.layers:
        if hasattr(layer.mlp, "router"):
            assert layer.mlp.router.weight.grad.abs().sum() > 0


def test_natural_matches_torch_model_and_record_replay_is_identity(world1):
    cfg = tiny_cfg(num_hidden_layers=2, mlp_only_layers=[])
    _, sd = random_hf(cfg, seed=6)
    model = megatron_from_hf(cfg, sd)
    torch_model = MoEModel(cfg)
    load_hf_state_dict(torch_model, sd)
    # our torch model's weights read back through hf_state_dict are the same tensors
    assert all(torch.equal(v, sd[k]) for k, v in hf_state_dict(torch_model).items())
    B, T = 2, 7
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(7))
    ref = torch_model(ids)
    replay = RouteReplay(model, cfg.num_experts)
    with torch.no_grad():
        with replay.session(Mode.RECORD):
            lp_rec = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
            rec = replay.recorded(B, T)
        with replay.session(Mode.REPLAY):
            replay.set_routes(rec)
            lp_rep = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
    assert torch.equal(rec.sort(-1).values, ref.natural_BTLK.sort(-1).values)
    assert (lp_rec - shifted_logprobs(ref.logits_BTV, ids)).abs().max() <= TOL
    assert torch.equal(lp_rec, lp_rep)


def test_failing_forward_does_not_leak_replay_state(world1):
    cfg = tiny_cfg()
    _, sd = random_hf(cfg, seed=8)
    model = megatron_from_hf(cfg, sd)
    B, T, L, K = 2, 6, cfg.num_moe_layers, cfg.num_experts_per_tok
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        natural = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
    replay = RouteReplay(model, cfg.num_experts)
    routes = torch.full((B, T, L, K), 0, dtype=torch.long)
    routes[..., 1] = 3
    with pytest.raises(RuntimeError, match="router sees 24 tokens but the replayed routes cover 12"):
        with replay.session(Mode.REPLAY), torch.no_grad():
            replay.set_routes(routes)
            # a batch of another size: megatron-core itself would silently leave the extra
            # tokens unrouted; the adapter's pre-hook fails the forward in MoE layer 0
            forward_logits(model, torch.cat([ids, ids]))
    for r in replay.routers:
        assert r.router_replay_action is None
        assert r.target_topk_idx is None and r.recorded_topk_idx is None
        assert r.replay_backward_list == []
    with torch.no_grad():
        again = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
    assert torch.equal(again, natural)
    with pytest.raises(RuntimeError, match="needs an open Mode.REPLAY"):
        replay.set_routes(routes)


@pytest.mark.parametrize("gap", [False, True])
def test_recompute_replays_the_same_routes_in_backward(world1, gap):
    """Recomputation replays what the forward ran, also the natural routes it chose at
    positions without a given route."""
    cfg = tiny_cfg()
    _, sd = random_hf(cfg, seed=10)
    B, T, L, K = 2, 6, cfg.num_moe_layers, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    routes = torch.rand(B, T, L, cfg.num_experts, generator=g).argsort(-1)[..., :K]
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[:, 2:4] = not gap
    grads = []
    for recompute in (False, True):
        model = megatron_from_hf(cfg, sd, recompute_activations=recompute).train()
        replay = RouteReplay(model, cfg.num_experts)
        with replay.session(Mode.REPLAY):
            replay.set_routes(routes, valid)
            logits = replay.backward_replays(forward_logits(model, ids))
            token_logprobs(logits[:, :-1], ids[:, 1:]).sum().backward()
            if recompute:  # every MoE layer's recomputation consumed its queued routes
                assert all(r.replay_backward_list == [] for r in replay.routers)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_router_dtype_fp32_runs_on_cpu(world1):
    cfg = tiny_cfg()
    _, sd = random_hf(cfg, seed=12)
    model = megatron_from_hf(cfg, sd, router_dtype="fp32")
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(13))
    ref = megatron_from_hf(cfg, sd)
    with torch.no_grad():
        a = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
        b = token_logprobs(forward_logits(ref, ids)[:, :-1], ids[:, 1:])
    assert (a - b).abs().max() <= TOL


def test_bf16_micro_batch_gradients_accumulate_in_fp32(world1):
    """The actor's DDP grad buffers are fp32: two bf16 micro-batches' gradients add up in fp32
    (a bf16 sum would drop the small second one)."""
    from megatron.core.distributed import DistributedDataParallel

    from lockstep.trainer.actor.megatron.actor import ddp_config

    cfg = tiny_cfg()
    _, sd = random_hf(cfg, seed=14)
    opts = MegatronOptions(params_dtype="bfloat16")
    initialize_parallel(opts)
    gpt = build_gpt_model(cfg, opts)
    convert.load_hf_into_megatron(gpt, sd, cfg)
    ddp = DistributedDataParallel(config=gpt.config, module=gpt, ddp_config=ddp_config())
    g = torch.Generator().manual_seed(15)
    inputs = [(torch.randint(0, cfg.vocab_size, (2, 6), generator=g), scale)
              for scale in (1.0, 1e-3)]

    def backward(ids, scale):
        (forward_logits(ddp, ids).float().logsumexp(-1).sum() * scale).backward()

    def grads():
        out = {n: p.main_grad.detach().clone() for n, p in gpt.named_parameters()}
        ddp.zero_grad_buffer()
        return out

    parts = []
    for ids, scale in inputs:
        backward(ids, scale)
        parts.append(grads())
    for ids, scale in inputs:
        backward(ids, scale)
    both = grads()
    lost = False
    for n, p in gpt.named_parameters():
        assert both[n].dtype == torch.float32, n
        assert torch.equal(both[n], parts[0][n] + parts[1][n]), n
        bf16_sum = (parts[0][n].bfloat16() + parts[1][n].bfloat16()).float()
        lost |= not torch.equal(bf16_sum, both[n])
    assert lost  # the test can tell fp32 from bf16 accumulation
    assert sum(p.dtype == torch.bfloat16 for p in gpt.parameters()) > 10
