"""The model's fast paths give the numbers of the plain formulas they replace.

Fused fp32 RMSNorm, RoPE with the sign folded into sin, fp32-emulated bf16 matmul/attention on CPU,
and the KV-cache read through a view (consecutive slots) or a gather (any slots).
"""

import pytest
import torch
import torch.nn.functional as F

from lockstep.moe.layers import (KVCache, RMSNorm, apply_rope, grouped_linear, grouped_linear_loop,
                                 linear, rope_cos_sin)
from lockstep.moe.model import MoEModel

from model_fixtures import tiny_config


def test_fused_fp32_rmsnorm_has_the_bits_of_the_explicit_formula():
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 7, 48, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = norm.weight.detach().clone().requires_grad_()
    ref = w_ref * (x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = norm(x)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
    assert torch.allclose(norm.weight.grad, w_ref.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_rotate_half_formula(dtype):
    torch.manual_seed(1)
    pos = torch.tensor([[0, 1, 2, 7], [3, 4, 5, 6]])
    x = torch.randn(2, 3, 4, 16).to(dtype)
    cos, sin_signed = rope_cos_sin(pos, 16, 10000.0, dtype)
    # the textbook form: fp32 cos/sin of cat(freqs, freqs), rotate_half = (-x2, x1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    emb = torch.cat((pos[..., None].float() * inv,) * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    ref = x * emb.cos().to(dtype) + torch.cat((-x2, x1), -1) * emb.sin().to(dtype)
    assert torch.equal(apply_rope(x, cos, sin_signed), ref)


def test_emulated_bf16_linear_is_within_one_ulp_of_native():
    torch.manual_seed(3)
    x = torch.randn(64, 128).bfloat16()
    w = (torch.randn(96, 128) * 0.05).bfloat16()
    got, native = linear(x, w), F.linear(x, w)
    assert got.dtype == torch.bfloat16
    ulp = native.float().abs().clamp(min=1e-3) * 2.0 ** -7
    assert ((got.float() - native.float()).abs() <= ulp).all()
    assert (got == native).float().mean() > 0.99  # summation order moves only a few


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_equals_per_expert_loop_with_empty_experts(dtype):
    """The CPU grouped matmul and the loop used on other devices agree, gradients too."""
    torch.manual_seed(4)
    x = torch.randn(11, 16).to(dtype).requires_grad_()
    w = torch.randn(5, 24, 16).to(dtype).requires_grad_()
    offs = torch.tensor([3, 3, 7, 11, 11], dtype=torch.int32)  # experts 1 and 4 get no rows
    got, want = grouped_linear(x, w, offs), grouped_linear_loop(x, w, offs)
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    grads = [torch.autograd.grad(y, (x, w), g) for y in (got, want)]
    for a, b in zip(*grads):
        assert torch.allclose(a.float(), b.float(), atol=1e-5 if dtype == torch.float32 else 5e-2)
    assert torch.equal(grads[0][1][1], torch.zeros_like(w[1]))  # an empty expert: zero grad


def _decode_all(model, cfg, seqs, slots, dtype, prompt_len):
    cache = KVCache.allocate(cfg, num_slots=8, max_len=32, dtype=dtype)
    B, total = seqs.shape
    with torch.no_grad():
        pre = model(seqs[:, :prompt_len], kv_cache=cache, cache_slots_B=slots)
        logits, routes = [pre.logits_BTV], [pre.routes_BTLK]
        for t in range(prompt_len, total):
            out = model(seqs[:, t:t + 1], positions_BT=torch.full((B, 1), t), kv_cache=cache,
                        cache_slots_B=slots)
            logits.append(out.logits_BTV)
            routes.append(out.routes_BTLK)
    return torch.cat(logits, 1), torch.cat(routes, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_decode_matches_full_forward_for_any_slots(dtype):
    """bf16 too: the cached and full paths share the same (emulated) kernels on CPU."""
    torch.manual_seed(5)
    cfg = tiny_config(mlp_only_layers=[0])
    model = MoEModel(cfg).set_precision(dtype).eval()
    seqs = torch.randint(3, cfg.vocab_size, (3, 12))
    with torch.no_grad():
        full = model(seqs)
    for slots in (torch.tensor([2, 3, 4]), torch.tensor([6, 0, 3])):  # view path, gather path
        logits, routes = _decode_all(model, cfg, seqs, slots, dtype, prompt_len=5)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert (logits.float() - full.logits_BTV.float()).abs().max() <= tol, slots
        assert (routes == full.routes_BTLK).float().mean() >= (1.0 if tol == 1e-5 else 0.98)
