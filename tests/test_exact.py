"""Exact mode (kernels/exact.py): the engine's bf16 log-probs and routes are bitwise the actor's,
whatever the batch composition, padding and prefill/decode path; and they stop being so when
one kernel is swapped for torch's default."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lockstep.kernels import exact as X
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig

from model_fixtures import tiny_config

CFG = tiny_config(vocab_size=24, hidden_size=32, num_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=8, max_position_embeddings=48, mlp_only_layers=[0])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(CFG)


def _reqs(lengths, seed0, n=2, max_new=10, rid="a"):
    g = torch.Generator().manual_seed(seed0)
    return [GenerateRequest(torch.randint(3, 24, (p,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=max_new, seed=seed0 * 100 + 10 * i, n=n),
                            rid=f"{rid}{i}")
            for i, p in enumerate(lengths)]


def _generate(model, reqs, max_running=64, dtype="bf16"):
    eng = Engine.from_model(model, EngineConfig(dtype=dtype, max_len=48, exact=True,
                                                max_running=max_running))
    return {(r.rid, r.index): r for r in eng.generate(reqs)}


def _actor(model, micro, dtype="bf16"):
    cfg = ActorConfig(dtype=dtype, micro_batch_size=micro, mini_batch_size=micro)
    return TorchActor(copy.deepcopy(model), cfg, total_updates=1, exact=True)


def _mismatches(model, results, micro, dtype="bf16"):
    """(log-prob mismatches, route-row mismatches) of the actor's recompute vs the engine."""
    b = collate(results, CFG.pad_token_id, CFG.num_experts, CFG.num_moe_layers,
                CFG.num_experts_per_tok)
    out = _actor(model, micro, dtype).logprobs(b)
    m = b.response_mask_BT
    lp_bad = int((out.logprobs_BT[m] != b.rollout_logprobs_BT[m]).sum())
    v = b.rollout_routes_valid_BT
    same = (out.natural_BTLK.long() == b.rollout_routes_BTLK.long()).all(-1).all(-1)
    return lp_bad, int((~same[v]).sum())


def test_engine_and_actor_are_bitwise_equal_whatever_the_batch(model):
    mine = _reqs([5, 2, 9], seed0=1)
    alone = _generate(model, mine)
    # other requests around them (other prompt lengths: other padding in the prefill), and 3
    # slots for 16 samples: they wait, join running decode batches of other sizes
    crowd = _generate(model, _reqs([11, 1], 2, rid="b") + mine + _reqs([7, 3], 3, rid="c"))
    squeezed = _generate(model, _reqs([6, 12], 4, rid="d", n=1) + mine, max_running=3)
    for key, r in alone.items():
        for other in (crowd[key], squeezed[key]):
            assert other.output_ids == r.output_ids, key
            assert torch.equal(other.output_logprobs, r.output_logprobs), key
            assert torch.equal(other.routes_NLK, r.routes_NLK), key
    everyone = list(crowd.values())
    rows = sum(len(r.output_ids) for r in everyone)
    assert rows > 80
    # the actor: alone, row by row, in micro-batches of 5 among the others (more padding)
    for results, micro in ((list(alone.values()), 6), (list(alone.values()), 1),
                           (everyone[::-1], 5)):
        assert _mismatches(model, results, micro) == (0, 0)


def _torch_attention(q, k, v, valid, scale, max_len):
    return X._attention_ref(q, k, v, valid, scale)


def _torch_linear(x, w, bias=None, out_dtype=None):
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(
        out_dtype or x.dtype)


def _torch_log_softmax(z, max_terms=None):
    return torch.log_softmax(z.float(), dim=-1)


# bf16 rounds most one-ulp fp32 differences away inside the network, not at its fp32 end (the
# log-softmax); in fp32 every kernel's differences reach the log-probs
@pytest.mark.parametrize("kernel,dtype", [("log_softmax", "bf16"), ("attention_forward", "fp32"),
                                          ("linear_forward", "fp32")])
def test_swapping_one_kernel_for_torchs_breaks_it(model, monkeypatch, kernel, dtype):
    reqs = _reqs([5, 2, 9, 4], seed0=1, max_new=10)
    assert _mismatches(model, list(_generate(model, reqs, 3, dtype).values()), 8, dtype) == (0, 0)
    monkeypatch.setattr(X, kernel, {"attention_forward": _torch_attention,
                                    "linear_forward": _torch_linear,
                                    "log_softmax": _torch_log_softmax}[kernel])
    lp_bad, _ = _mismatches(model, list(_generate(model, reqs, 3, dtype).values()), 8, dtype)
    assert lp_bad > 0


def test_exact_linear_is_row_invariant_and_torchs_is_not():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=g).bfloat16()
    w = torch.randn(192, 96, generator=g).bfloat16()
    full = X.linear(x, w)
    assert all(torch.equal(X.linear(x[i:i + n], w), full[i:i + n])
               for n in (1, 2, 3, 7) for i in (0, 5, 33))
    ref = F.linear(x.float(), w.float())
    assert (full.float() - ref).abs().max() <= ref.abs().max() * 2 ** -8  # a bf16 rounding
    # torch's CPU GEMM: another blocking for 1-4 rows (the reason for the exact kernel)
    torch_rows = [torch.equal(F.linear(x[:n].float(), w.float()), ref[:n]) for n in (1, 2, 3)]
    assert not all(torch_rows)


def test_exact_attention_equals_across_prefill_and_decode_with_stale_keys():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g).bfloat16() for h in (4, 2, 2))
    full = X.attention(q, k, v, None, None, max_len=48)
    ref = X._attention_ref(q, k, v, None, None)
    assert (full.float() - ref.float()).abs().max() < 2e-2
    junk = (torch.randn(2, 2, 6, 8, generator=g) * 50).bfloat16()  # stale cache entries
    kk, vv = torch.cat([k, junk], 2), torch.cat([v, junk], 2)
    for t in range(9):
        valid = (torch.arange(15) <= t)[None, None, None]
        assert torch.equal(X.attention(q[:, :, t:t + 1], kk, vv, valid, None, max_len=48),
                           full[:, :, t:t + 1]), t


def test_exp_and_log_are_position_invariant():
    """The kernels rely on torch.exp / torch.log giving an element the same bits in the vector
    loop and the scalar tail loop (true of sigmoid neither here nor in general)."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(4096, generator=g, dtype=torch.float64) * -80
    for dt in (torch.float32, torch.float64):
        xs = x.to(dt)
        for fn, arg in ((torch.exp, xs), (torch.log, -xs + 1e-3)):
            one_by_one = torch.cat([fn(arg[i:i + 1]) for i in range(0, 4096, 7)])
            assert torch.equal(one_by_one, fn(arg)[::7]), (fn, dt)
    one_by_one = torch.cat([X.sigmoid(x[i:i + 1]) for i in range(0, 4096, 7)])
    assert torch.equal(one_by_one, X.sigmoid(x)[::7])


def test_exact_gradients_are_torchs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g).requires_grad_()
    w = torch.randn(20, 32, generator=g).requires_grad_()
    X.linear(x, w).pow(2).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.linear(x, w).pow(2).sum().backward()
    assert torch.allclose(gx, x.grad, rtol=1e-4, atol=1e-4)
    assert torch.allclose(gw, w.grad, rtol=1e-4, atol=1e-4)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g).requires_grad_() for _ in range(3))
    X.attention(q, k, v, None, None, max_len=48).sum().backward()
    want = torch.autograd.grad(X._attention_ref(q, k, v, None, None).sum(), (q, k, v))
    assert all(torch.allclose(a.grad, b, atol=1e-5) for a, b in zip((q, k, v), want))


def test_exact_model_trains(model):
    """The update forward runs the exact kernels too; a step changes the weights."""
    results = list(_generate(model, _reqs([4, 6], seed0=5)).values())
    b = collate(results, CFG.pad_token_id, CFG.num_experts, CFG.num_moe_layers,
                CFG.num_experts_per_tok)
    actor = _actor(model, 4)
    before = copy.deepcopy(actor.master.state_dict())
    m = b.response_mask_BT.float()

    def loss_fn(lp, ent, rows, mini):
        return -(lp[rows] * m[rows]).sum() / m.sum(), {}

    metrics, _, _ = actor.update(b, lambda lp, ent, rows, mini: (-(lp * m[rows]).sum()
                                                                 / m.sum(), {}))
    assert metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in actor.master.state_dict().items())


def test_exact_refuses_fp8_and_mla():
    m = MoEModel(tiny_config()).set_precision(torch.bfloat16, fp8=True)
    with pytest.raises(ValueError, match="FP8"):
        m.set_exact(True)
    mla = MoEModel(tiny_config(model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=None,
                               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8))
    with pytest.raises(ValueError, match="latent attention"):
        mla.set_exact(True)


FAMILIES = {
    "qwen2_moe": dict(shared_expert_intermediate_size=24, mlp_only_layers=[0]),
    "mixtral": dict(intermediate_size=8),
    "glm4_moe": dict(n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     n_shared_experts=1),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_gqa_families_are_bitwise_equal_too(family):
    from lockstep.moe.config import ModelConfig
    cfg = ModelConfig.for_architecture(
        family, vocab_size=24, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=8, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=48, eos_token_id=2, pad_token_id=0,
        bos_token_id=1, **{"intermediate_size": 32, **FAMILIES[family]})
    torch.manual_seed(1)
    model = MoEModel(cfg)
    eng = Engine.from_model(model, EngineConfig(dtype="bf16", max_len=48, exact=True,
                                                max_running=3))
    results = eng.generate(_reqs([5, 3], seed0=7, n=2, max_new=6))
    b = collate(results, 0, cfg.num_experts, cfg.num_moe_layers, cfg.num_experts_per_tok)
    actor = TorchActor(copy.deepcopy(model), ActorConfig(dtype="bf16", micro_batch_size=3,
                                                         mini_batch_size=3), 1, exact=True)
    out = actor.logprobs(b)
    m = b.response_mask_BT
    assert torch.equal(out.logprobs_BT[m], b.rollout_logprobs_BT[m])
    v = b.rollout_routes_valid_BT
    assert torch.equal(out.natural_BTLK.long()[v], b.rollout_routes_BTLK.long()[v])
