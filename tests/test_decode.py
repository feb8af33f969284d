"""The engine's decode step vs the model's cached forward: same bits, weights never stale."""

import pytest
import torch

from lockstep.moe.model import KVCache, MoEModel
from lockstep.rollout.decode import DecodeWeights, decode_step

from model_fixtures import tiny_config


def _prefilled(dtype, router_dtype=None, lm_head_dtype=None, storage_dtype=None):
    torch.manual_seed(0)
    cfg = tiny_config(max_position_embeddings=32, mlp_only_layers=[0])
    model = MoEModel(cfg).eval().requires_grad_(False)
    model.set_precision(dtype, router_dtype=router_dtype, lm_head_dtype=lm_head_dtype)
    cache = KVCache.allocate(cfg, num_slots=12, max_len=32, dtype=dtype,
                             storage_dtype=storage_dtype)
    prompt = torch.randint(0, cfg.vocab_size, (5, 9))
    model(prompt, kv_cache=cache, cache_slots_B=torch.arange(5), compute_logits=False)
    return model, cache


@pytest.mark.parametrize("dtype,router_dtype,lm_head_dtype", [
    (torch.float32, None, None), (torch.bfloat16, None, None),
    (torch.bfloat16, torch.float32, torch.float32)])
@pytest.mark.parametrize("slots", [[0, 1, 2, 3, 4], [4, 0, 3, 1, 2]])
def test_decode_step_same_bits_as_cached_forward(dtype, router_dtype, lm_head_dtype, slots):
    model, cache = _prefilled(dtype, router_dtype, lm_head_dtype)
    slots_B = torch.tensor(slots)
    pos_B = torch.tensor([9, 3, 7, 9, 5])  # rows at different positions (shorter prompts)
    ids_B = torch.randint(0, model.cfg.vocab_size, (5,))
    ours = KVCache(cache.k.clone(), cache.v.clone(), dtype=cache.dtype)
    want = model(ids_B[:, None], positions_BT=pos_B[:, None], kv_cache=cache,
                 cache_slots_B=slots_B)
    logits_BV, routes_BLK = decode_step(model, DecodeWeights(model), ids_B, pos_B, ours, slots_B)
    assert logits_BV.dtype == want.logits_BTV.dtype
    assert torch.equal(logits_BV, want.logits_BTV[:, 0])
    assert torch.equal(routes_BLK, want.routes_BTLK[:, 0])
    assert torch.equal(ours.k, cache.k) and torch.equal(ours.v, cache.v)


@pytest.mark.parametrize("slots", [[0, 1, 2, 3, 4], [4, 0, 3, 1, 2]])
def test_fp32_held_bf16_cache_gives_the_bits_of_a_bf16_cache(slots):
    """bf16 keys/values held in fp32 storage (no upcast per read): same bits as a bf16 storage,
    for the prefill, the cached forward and the decode step, view and gather reads."""
    wide, wide_cache = _prefilled(torch.bfloat16, storage_dtype=torch.float32)
    narrow, narrow_cache = _prefilled(torch.bfloat16)
    assert wide_cache.k.dtype == torch.float32 and narrow_cache.k.dtype == torch.bfloat16
    assert wide_cache.dtype == narrow_cache.dtype == torch.bfloat16
    assert torch.equal(wide_cache.k, narrow_cache.k.float())
    assert torch.equal(wide_cache.v, narrow_cache.v.float())
    slots_B, pos_B = torch.tensor(slots), torch.tensor([9, 3, 7, 9, 5])
    ids_B = torch.randint(0, wide.cfg.vocab_size, (5,))
    outs = []
    for model, cache in ((wide, wide_cache), (narrow, narrow_cache)):
        fwd = model(ids_B[:, None], positions_BT=pos_B[:, None], kv_cache=cache,
                    cache_slots_B=slots_B)
        step = decode_step(model, DecodeWeights(model), ids_B, pos_B, cache, slots_B)
        outs.append((fwd.logits_BTV[:, 0], fwd.routes_BTLK[:, 0]) + step)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(wide_cache.k, narrow_cache.k.float())
    assert torch.equal(wide_cache.v, narrow_cache.v.float())


def test_kv_cache_storage_must_hold_the_compute_dtype():
    cfg = tiny_config()
    with pytest.raises(TypeError, match="cannot hold compute dtype torch.float32 exactly"):
        KVCache.allocate(cfg, 2, 8, dtype=torch.float32, storage_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="cannot hold compute dtype torch.bfloat16 exactly"):
        KVCache.allocate(cfg, 2, 8, dtype=torch.bfloat16, storage_dtype=torch.float16)
    assert KVCache.allocate(cfg, 2, 8, dtype=torch.float16).k.dtype == torch.float16
    wide = KVCache.allocate(cfg, 2, 8, dtype=torch.float16, storage_dtype=torch.float32)
    assert wide.k.dtype == wide.v.dtype == torch.float32 and wide.dtype == torch.float16


def test_decode_weights_notice_in_place_writes():
    model, _ = _prefilled(torch.bfloat16)
    dw = DecodeWeights(model)
    assert dw.current(model)
    with torch.no_grad():
        model.layers[1].mlp.experts.down_proj.mul_(2)
    assert not dw.current(model)
    dw = DecodeWeights(model)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert not dw.current(model)  # copy_ bumps the version counter even for equal values
