"""`GenerateRequest.routes_start` (SGLang's `routed_experts_start_len`): a later turn of a
multi-turn trajectory asks only the routes its earlier turns do not hold. The in-process engine
and `lockstep serve` over HTTP (a real loopback server, the client decoding with the start)
answer the same rows; three turns stitched equal one prefill of the final trajectory; the
bounds are SGLang 0.5.23's (start <= prompt length; probed, docs/rollout.md)."""

import pytest
import torch

from lockstep.replay.trace import concat_traces
from lockstep.rollout.client import HTTPBackend, LocalBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.types import GenerateRequest, RequestError, SamplingParams

from server_fixtures import ENGINE, call, model, server  # noqa: F401 (pytest fixtures)

OBS = [[7, 8, 9], [11, 12]]  # the "environment's" tokens after turns 1 and 2


def _turns(backend, num_experts, prompt, seed=3):
    """Three turns: each prompt is the previous prompt + its sampled tokens + an observation;
    turn k > 1 asks routes from the previous turn's last sampled token (its trace's end)."""
    ids, traces, results = list(prompt), [], []
    for k in range(3):
        start = traces[-1].end if traces else 0
        res = backend.generate([GenerateRequest(ids, SamplingParams(
            max_new_tokens=4, seed=seed + k, ignore_eos=True), routes_start=start)])[0]
        assert res.routes_start == start
        traces.append(res.trace(num_experts))
        results.append(res)
        ids = ids + res.output_ids + (OBS[k] if k < 2 else [])
    return ids, concat_traces(traces), results


@pytest.mark.parametrize("compact", [True, False])
def test_http_turns_equal_the_engine_and_stitch_to_one_prefill(server, model, compact):
    E = model.cfg.num_experts
    http = HTTPBackend(server.url, model.cfg, compact_routes=compact)
    local = LocalBackend(Engine.from_model(model, ENGINE))
    ids, stitched, got = _turns(http, E, [4, 5, 6, 3])
    ids2, stitched2, want = _turns(local, E, [4, 5, 6, 3])
    assert ids == ids2 and stitched == stitched2
    for a, b in zip(got, want):
        assert torch.equal(a.routes_NLK, b.routes_NLK)
        assert torch.allclose(a.output_logprobs, b.output_logprobs, atol=1e-6, rtol=0)
    assert [r.routes_NLK.shape[0] for r in got] == [4 + 4 - 1, 4 + 3, 4 + 2]  # new rows only
    # the stitched trace covers every position but the last sampled token's: P+R-1 rows
    full = local.generate([GenerateRequest(ids, SamplingParams(max_new_tokens=1))])[0]
    assert stitched.start == 0 and stitched.num_rows == len(ids) - 1
    assert torch.equal(stitched.ids_NLK, full.routes_NLK[:len(ids) - 1])


def test_start_at_the_prompt_length_is_taken_past_it_refused(server, model):
    http = HTTPBackend(server.url, model.cfg)
    P = [4, 5, 6]
    res = http.generate([GenerateRequest(P, SamplingParams(max_new_tokens=3, ignore_eos=True),
                                         routes_start=len(P))])[0]
    assert res.routes_start == 3 and res.routes_NLK.shape[0] == 2  # R - 1 rows, as SGLang
    status, body = call(server.url, "/generate", {
        "input_ids": P, "return_routed_experts": True, "routed_experts_start_len": 4})
    assert status == 400 and "routed_experts_start_len=4 must be in [0, 3]" in str(body)
    with pytest.raises(RolloutError, match=r"routes_start \(routed_experts_start_len\)=3 must "
                                           r"be in \[0, 2\].*max_new_tokens=0"):
        http.generate([GenerateRequest(P, SamplingParams(max_new_tokens=0), routes_start=3)])
    engine = Engine.from_model(model, ENGINE)
    for bad in (-1, 4, True):
        with pytest.raises(RequestError, match="routes_start"):
            engine.validate(GenerateRequest(P, routes_start=bad))
