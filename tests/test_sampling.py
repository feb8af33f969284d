"""Sampler: filters, log-prob definitions, support record, seeds, SGLang param parsing."""

import math

import pytest
import torch

from lockstep.rollout.sampling import (RowUniforms, SamplingTensors, sample, support_ids_to_mask,
                                       support_logprobs)
from lockstep.rollout.types import RequestError, SamplingParams


def _st(B, V, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    return SamplingTensors.build([temperature] * B, [top_k] * B, [top_p] * B, [min_p] * B, V)


def test_top_p_selected_logprob_gives_is_ratio_one():
    # Raw probs [0.5, 0.3, 0.15, 0.05]; top_p=0.7 keeps {0, 1} (mass 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    st = _st(1, 4, top_p=0.7)
    # uniform 0.9 * 0.8 = 0.72 > 0.5 -> token 1 (raw prob 0.3, renormalised 0.375)
    out = sample(logits, st, torch.tensor([0.9]))
    assert out.token_ids_B.tolist() == [1]
    assert out.support_BV.tolist() == [[True, True, False, False]]
    assert math.isclose(out.logprobs_B.exp().item(), 0.3, rel_tol=1e-6)
    assert math.isclose(out.sampling_logprobs_B.exp().item(), 0.375, rel_tol=1e-6)
    # Trainer, same weights: recompute over the recorded support -> ratio exactly 1 ...
    recomputed = support_logprobs(logits, out.token_ids_B, out.support_BV)
    assert math.isclose((recomputed - out.sampling_logprobs_B).exp().item(), 1.0, rel_tol=1e-6)
    # ... whereas the full-vocabulary log-prob against the behaviour log-prob gives 0.8.
    full = support_logprobs(logits, out.token_ids_B, None)
    assert math.isclose((full - out.sampling_logprobs_B).exp().item(), 0.8, rel_tol=1e-6)
    # The support record round-trips through a list of ids.
    ids = [out.support_BV[0].nonzero().squeeze(1).tolist()]
    assert torch.equal(support_ids_to_mask(ids, 4), out.support_BV)


def test_filters_compose_on_full_distribution():
    p = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]])
    logits = p.log()
    keep = lambda **kw: sample(logits, _st(1, 5, **kw), torch.tensor([0.0])).support_BV[0].tolist()
    assert keep(top_k=2) == [True, True, False, False, False]
    # mass before: 0, .4, .65, .85, .95 -> top_p .65 keeps 3 (boundary kept), .6 keeps 2
    assert keep(top_p=0.65) == [True, True, True, False, False]
    assert keep(top_p=0.6) == [True, True, False, False, False]
    assert keep(min_p=0.5) == [True, True, True, False, False]       # >= 0.2
    # top-p is measured on the full distribution, not on the renormalised top-k set:
    # HF order would renormalise {.4,.25,.2} and keep only 2 for top_p=0.6; joint keeps min(3, 2).
    assert keep(top_k=3, top_p=0.6) == [True, True, False, False, False]
    assert keep(top_k=4, top_p=0.9, min_p=0.3) == [True, True, True, False, False]


def test_temperature_and_greedy_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 11)
    st = SamplingTensors.build([0.5, 0.0, 2.0], [-1, -1, -1], [1.0] * 3, [0.0] * 3, 11)
    out = sample(logits, st, torch.tensor([0.3, 0.99, 0.7]))
    ids = out.token_ids_B
    want0 = torch.log_softmax(logits[0] / 0.5, -1)[ids[0]]
    assert torch.allclose(out.logprobs_B[0], want0)
    assert ids[1] == logits[1].argmax()  # greedy ignores the uniform
    assert torch.allclose(out.logprobs_B[1], torch.log_softmax(logits[1], -1)[ids[1]])
    assert out.sampling_logprobs_B[1].item() == 0.0  # support of one token
    assert out.support_BV[1].sum() == 1 and out.support_BV[0].all() and out.support_BV[2].all()
    assert torch.allclose(out.sampling_logprobs_B[[0, 2]], out.logprobs_B[[0, 2]])


def test_sampling_frequencies_match_truncated_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    N = 20000
    logits = p.log().expand(N, 4)
    u = torch.rand(N, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = sample(logits, _st(N, 4, top_p=0.7), u)
    freq = torch.bincount(out.token_ids_B, minlength=4).float() / N
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.625) < 0.015 and abs(freq[1] - 0.375) < 0.015
    out = sample(logits, _st(N, 4), u)
    freq = torch.bincount(out.token_ids_B, minlength=4).float() / N
    assert torch.allclose(freq, p, atol=0.015)


def test_rows_independent_of_batch_and_seeded_streams_reproduce():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = dict(temperature=[0.7, 1.0, 0.0, 1.3, 1.0], top_k=[-1, 5, -1, 10, -1],
                  top_p=[1.0, 0.9, 1.0, 0.8, 1.0], min_p=[0.0, 0.0, 0.0, 0.05, 0.1])
    st = SamplingTensors.build(**params, vocab_size=50)
    u = torch.rand(5, dtype=torch.float64)
    full = sample(logits, st, u)
    for b in range(5):
        one = SamplingTensors.build(**{k: [v[b]] for k, v in params.items()}, vocab_size=50)
        single = sample(logits[b:b + 1], one, u[b:b + 1])
        assert single.token_ids_B.item() == full.token_ids_B[b].item()
        kept = single.support_BV[0] if single.support_BV is not None else torch.ones(50, dtype=bool)
        assert torch.equal(kept, full.support_BV[b])
        assert torch.allclose(single.sampling_logprobs_B, full.sampling_logprobs_B[b])
    ru = RowUniforms(4, chunk=3)
    ru.assign(0, 123)
    ru.assign(2, 123)
    ru.assign(3, 7)
    a = torch.stack([ru.next(torch.tensor([0, 2, 3])) for _ in range(7)])  # crosses refills
    assert torch.equal(a[:, 0], a[:, 1]) and not torch.equal(a[:, 0], a[:, 2])
    ref = torch.rand(9, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    assert torch.equal(a[:, 0], ref[:7])


def test_sampling_params_from_sglang():
    sp = SamplingParams.from_sglang({"temperature": 0.7, "top_k": 20, "max_new_tokens": 5,
                                     "stop_token_ids": [3], "sampling_seed": 9, "n": 2,
                                     "skip_special_tokens": False, "frequency_penalty": 0.0,
                                     "top_p": None})
    assert (sp.temperature, sp.top_k, sp.top_p, sp.stop_token_ids, sp.seed, sp.n) == \
        (0.7, 20, 1.0, (3,), 9, 2)
    assert SamplingParams.from_sglang({"temperature": 0}).greedy
    assert SamplingParams.from_sglang({"top_k": 1 << 30}).top_k == -1
    with pytest.raises(RequestError, match=r"unknown sampling_params key\(s\) \['tempreature'\]"):
        SamplingParams.from_sglang({"tempreature": 1.0})
    with pytest.raises(RequestError, match="repetition_penalty=1.2 is not supported"):
        SamplingParams.from_sglang({"repetition_penalty": 1.2})
    with pytest.raises(RequestError, match="stop_token_ids"):
        SamplingParams.from_sglang({"stop": ["\n"]})
    for bad, msg in [({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
                     ({"temperature": -1}, "temperature"), ({"max_new_tokens": "8"}, "max_new"),
                     ({"min_new_tokens": 9, "max_new_tokens": 3}, "min_new_tokens"),
                     ({"n": 0}, "n must"), ({"min_p": 2}, "min_p")]:
        with pytest.raises(RequestError, match=msg):
            SamplingParams.from_sglang(bad)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        SamplingParams(stop_token_ids=(40,)).validate(vocab_size=32)
