"""The engine's decode step vs the model's cached forward: same bits, weights never stale."""

import pytest
import torch

from lockstep.moe.model import KVCache, MoEModel
from lockstep.rollout.decode import DecodeWeights, decode_step

from model_fixtures import tiny_config


def _prefilled(dtype, router_dtype=None, lm_head_dtype=None):
    torch.manual_seed(0)
    cfg = tiny_config(max_position_embeddings=32, mlp_only_layers=[0])
    model = MoEModel(cfg).eval().requires_grad_(False)
    model.set_precision(dtype, router_dtype=router_dtype, lm_head_dtype=lm_head_dtype)
    cache = KVCache.allocate(cfg, num_slots=12, max_len=32, dtype=dtype)
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
    ours = KVCache(cache.k.clone(), cache.v.clone())
    want = model(ids_B[:, None], positions_BT=pos_B[:, None], kv_cache=cache,
                 cache_slots_B=slots_B)
    logits_BV, routes_BLK, gates_BLK = decode_step(model, DecodeWeights(model), ids_B, pos_B,
                                                   ours, slots_B)
    assert logits_BV.dtype == want.logits_BTV.dtype
    assert torch.equal(logits_BV, want.logits_BTV[:, 0])
    assert torch.equal(routes_BLK, want.routes_BTLK[:, 0])
    assert torch.equal(gates_BLK, want.gates_BTLK[:, 0])  # what replay.gates=engine sends
    assert torch.equal(ours.k, cache.k) and torch.equal(ours.v, cache.v)


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
