"""Embedded engine: exact capture vs one full forward, batching, stops, seeds, weights, precision."""

import math

import pytest
import torch

from lockstep.moe.checkpoint import hf_state_dict, save_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.sampling import support_ids_to_mask, support_logprobs
from lockstep.rollout.types import GenerateRequest, RequestError, SamplingParams

from model_fixtures import tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # Decoder layer 0 dense: routes have 2 MoE layers of 3 (the wire layer axis has 3).
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))


def _full_forward(model, res):
    """Log-probs (temperature-scaled) of the generated tokens and routes from one fp32 forward."""
    ids = torch.tensor(res.prompt_ids + res.output_ids)[None]
    with torch.no_grad():
        out = model(ids)
    return out.logits_BTV[0].float(), out.routes_BTLK[0]


def _check_exact(model, results, temperature=1.0):
    for r in results:
        P, R = len(r.prompt_ids), len(r.output_ids)
        logits_TV, routes_TLK = _full_forward(model, r)
        logp = torch.log_softmax(logits_TV / temperature, -1)[P - 1:P + R - 1]
        want = logp.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert torch.allclose(r.output_logprobs, want, atol=1e-5, rtol=0), (r.rid, r.index)
        assert r.routes_NLK.shape == (P + R - 1, 2, 2) and r.routes_NLK.dtype == torch.uint8
        # Prompt rows included; the last generated token has no row.
        assert torch.equal(r.routes_NLK.long(), routes_TLK[:P + R - 1]), (r.rid, r.index)


def _reqs(lengths, max_new=12, **sp):
    g = torch.Generator().manual_seed(1)
    return [GenerateRequest(torch.randint(3, 40, (p,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=max_new, seed=100 + i, **sp))
            for i, p in enumerate(lengths)]


def test_capture_exact_mixed_lengths_fp32(model):
    eng = Engine.from_model(model, EngineConfig(dtype="fp32", max_running=16, max_len=64))
    res = eng.generate(_reqs([3, 11, 1, 7, 5], max_new=12, temperature=0.8, top_k=20))
    assert [r.rid for r in res] == [f"req-{i}" for i in range(1, 6)]
    assert any(r.finish_reason["type"] == "stop" for r in res) or \
        all(len(r.output_ids) == 12 for r in res)
    _check_exact(model, res, temperature=0.8)


def test_capture_exact_under_continuous_batching(model):
    # 3 slots for 7 samples: requests wait, join the running batch mid-way, others leave.
    eng = Engine.from_model(model, EngineConfig(dtype="fp32", max_running=3, max_len=64))
    reqs = _reqs([4, 9, 2, 6, 3], max_new=10)
    reqs[1].sampling.n = 2
    reqs[3].sampling.n = 2
    joined_mid_run = []
    for r in reqs:
        eng.add_request(r)
    results = []
    while eng.has_work:
        before = {s.req.rid for s in eng.running.values()}
        results += eng.step()
        now = {s.req.rid for s in eng.running.values()}
        if before and now - before:
            joined_mid_run.append(now - before)
    assert joined_mid_run, "no request joined a running batch"
    assert len(results) == 7
    _check_exact(model, results)
    # n samples share the prompt's prefill: identical prompt routes, distinct continuations.
    two = [r for r in results if r.rid == reqs[1].rid]
    assert torch.equal(two[0].routes_NLK[:9], two[1].routes_NLK[:9])
    assert two[0].output_ids != two[1].output_ids


def test_seeded_request_independent_of_batch(model):
    cfg = EngineConfig(dtype="fp32", max_running=8, max_len=64)
    alone = Engine.from_model(model, cfg).generate(_reqs([5], max_new=16, temperature=1.2))[0]
    crowd = Engine.from_model(model, cfg).generate(
        _reqs([5, 8, 2, 9], max_new=16, temperature=1.2))[0]
    assert alone.output_ids == crowd.output_ids
    assert torch.allclose(alone.output_logprobs, crowd.output_logprobs, atol=1e-5)


def test_sampling_mask_and_support_logprobs(model):
    eng = Engine.from_model(model, EngineConfig(dtype="fp32", max_running=4, max_len=64))
    reqs = _reqs([6, 4], max_new=10, temperature=0.9, top_p=0.8, top_k=12)
    for r in reqs:
        r.return_sampling_mask = True
        r.top_logprobs_num = 3
    for r in eng.generate(reqs):
        P, R = len(r.prompt_ids), len(r.output_ids)
        assert len(r.sampling_mask) == R and len(r.top_logprobs) == R
        assert all(m is not None and 1 <= len(m) <= 12 for m in r.sampling_mask)
        assert all(t in m.tolist() for t, m in zip(r.output_ids, r.sampling_mask))
        logits_TV, _ = _full_forward(model, r)
        mask_TV = support_ids_to_mask(r.sampling_mask, model.cfg.vocab_size)
        recomputed = support_logprobs(logits_TV[P - 1:P + R - 1], torch.tensor(r.output_ids),
                                      mask_TV, temperature=0.9)
        assert torch.allclose(recomputed, r.sampling_logprobs, atol=1e-5)
        assert (r.sampling_logprobs >= r.output_logprobs - 1e-6).all()
        top = r.top_logprobs[0]
        assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0]


def test_stop_conditions(model):
    eos = model.cfg.eos_token_id
    eng = Engine.from_model(model, EngineConfig(dtype="fp32", max_running=8, max_len=64))
    # Greedy continuation of this prompt; then make its 3rd token a stop id.
    probe = eng.generate([GenerateRequest([5, 6, 7], SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True))])[0]
    stop_id = probe.output_ids[2]
    r = eng.generate([GenerateRequest([5, 6, 7], SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=(stop_id,)))])[0]
    first = probe.output_ids.index(stop_id)
    assert r.output_ids == probe.output_ids[:first + 1]
    assert r.finish_reason == {"type": "stop", "matched": stop_id}
    # min_new_tokens keeps stop ids out of the support until reached.
    r = eng.generate([GenerateRequest([5, 6, 7], SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=(stop_id,),
        min_new_tokens=first + 2))])[0]
    assert stop_id not in r.output_ids[:first + 2]
    # EOS stops unless ignore_eos; sample many to hit EOS at least once.
    many = eng.generate(_reqs([2] * 8, max_new=40, temperature=1.5))
    assert all(r.finish_reason == {"type": "stop", "matched": eos} and r.output_ids[-1] == eos
               for r in many if r.finish_reason["type"] == "stop")
    assert all(eos not in r.output_ids[:-1] for r in many)
    ign = eng.generate(_reqs([2] * 4, max_new=40, temperature=1.5, ignore_eos=True))
    assert all(len(r.output_ids) == 40 and r.finish_reason == {"type": "length", "length": 40}
               for r in ign)
    zero = eng.generate([GenerateRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=0))])[0]
    assert zero.output_ids == [] and zero.routes_NLK.shape[0] == 3
    assert zero.finish_reason == {"type": "length", "length": 0}


def test_weight_update_in_place(model, tmp_path):
    eng = Engine.from_model(model, EngineConfig(dtype="fp32", max_len=64), weight_version="v0")
    reqs = lambda: _reqs([5, 3], max_new=8)  # noqa: E731
    assert {r.weight_version for r in eng.generate(reqs())} == {"v0"}
    torch.manual_seed(7)
    new = MoEModel(model.cfg)
    assert eng.update_weights(hf_state_dict(new)) == "v0+1"
    got = eng.generate(reqs())
    want = Engine.from_model(new, EngineConfig(dtype="fp32", max_len=64)).generate(reqs())
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert {r.weight_version for r in got} == {"v0+1"}
    _check_exact(new, got)
    save_hf(model, tmp_path / "ckpt")
    eng.update_weights(tmp_path / "ckpt", weight_version="step-3")
    back = eng.generate(reqs())
    assert {r.weight_version for r in back} == {"step-3"}
    _check_exact(model, back)
    eng.update_weights(new.state_dict(), weight_version="native")
    _check_exact(new, eng.generate(reqs()))


def test_precision_options(model):
    eng = Engine.from_model(model, EngineConfig(dtype="bf16", router_dtype="fp32",
                                                lm_head_dtype="fp32", max_len=64))
    m = eng.model
    assert m.embed_tokens.weight.dtype == torch.bfloat16
    assert m.layers[1].mlp.gate.weight.dtype == torch.float32
    assert m.lm_head.weight.dtype == torch.float32
    assert eng.cache.k.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.float32  # from_model copies
    res = eng.generate(_reqs([4, 6], max_new=5))
    assert all(len(r.output_ids) >= 1 for r in res)
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\]"):
        EngineConfig(dtype="float64")
    with pytest.raises(ValueError, match=r"unknown keys \['max_batch'\]"):
        EngineConfig.from_dict({"max_batch": 3})


def test_bf16_vs_fp32_divergence_is_measured(model):
    """Precision-only mismatch: reported, not hidden (printed; run with -s to see it)."""
    res = Engine.from_model(model, EngineConfig(dtype="bf16", max_len=64)).generate(
        _reqs([6] * 16, max_new=24, ignore_eos=True))
    flips = pairs = tok_flips = toks = 0
    dlp = []
    for r in res:
        logits_TV, routes_TLK = _full_forward(model, r)
        rows = r.routes_NLK.long()
        same_set = (rows.sort(-1).values == routes_TLK[:len(rows)].sort(-1).values).all(-1)  # [N, L]
        flips += int((~same_set).sum())
        pairs += same_set.numel()
        tok_flips += int((~same_set).any(-1).sum())
        toks += len(rows)
        P = len(r.prompt_ids)
        lp = torch.log_softmax(logits_TV, -1)[P - 1:-1].gather(
            1, torch.tensor(r.output_ids)[:, None])[:, 0]
        dlp.append((lp - r.output_logprobs).abs())
    dlp = torch.cat(dlp)
    print(f"\nbf16 engine vs fp32 forward: route flips {flips}/{pairs} (token, layer) pairs = "
          f"{flips / pairs:.2%}; tokens with any flip {tok_flips / toks:.2%}; "
          f"|dlogp| mean {dlp.mean():.2e} max {dlp.max():.2e}")
    assert 0 < dlp.mean() < 0.05 and flips / pairs < 0.2


def test_bad_requests_rejected_by_name(model):
    eng = Engine.from_model(model, EngineConfig(dtype="fp32", max_running=4, max_len=32))
    for req, msg in [
        (GenerateRequest([]), "non-empty"),
        (GenerateRequest([1, 40, 2]), r"input_ids\[1\] = 40 is outside the vocabulary \[0, 40\)"),
        (GenerateRequest([1, -1]), r"input_ids\[1\] = -1"),
        (GenerateRequest([1] * 32, SamplingParams(max_new_tokens=5)),
         "prompt of 32 tokens is too long: the engine's max_len=32"),
        (GenerateRequest([1], SamplingParams(n=5)), "n=5 exceeds"),
        (GenerateRequest([1], SamplingParams(stop_token_ids=(99,))), "stop_token_ids has 99"),
    ]:
        with pytest.raises(RequestError, match=msg):
            eng.add_request(req)
    assert not eng.has_work
    # max_new_tokens is clamped to the room left (SGLang semantics).
    r = eng.generate([GenerateRequest([1] * 28, SamplingParams(max_new_tokens=50,
                                                                  ignore_eos=True))])[0]
    assert len(r.output_ids) == 4 and r.finish_reason == {"type": "length", "length": 4}
    rid = eng.add_request(GenerateRequest([1, 2], SamplingParams(max_new_tokens=20)))
    with pytest.raises(RequestError, match="already queued or running"):
        eng.add_request(GenerateRequest([3], rid=rid))
    eng.step()
    aborted = eng.abort(rid)
    assert len(aborted) == 1 and aborted[0].finish_reason["type"] == "abort"
    assert not eng.has_work and len(eng.free_slots) == 4
    assert math.isfinite(float(aborted[0].output_logprobs.sum()))
    eng.add_request(GenerateRequest([3], SamplingParams(n=2), rid=rid))  # a finished rid is free
    # a queued request is answered too (every sample, no tokens), as SGLang does
    queued = eng.abort()
    assert [(r.rid, r.index, r.output_ids, r.finish_reason["type"]) for r in queued] == \
        [(rid, 0, [], "abort"), (rid, 1, [], "abort")]
    assert not eng.has_work and not eng._live
