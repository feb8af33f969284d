"""The SGLang-wire server over real HTTP on loopback: schema, slicing, errors, endpoints."""

import base64
import re
import threading

import numpy as np
import pytest
import torch

from lockstep.moe.checkpoint import save_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.server import ServerThread
from lockstep.rollout.types import GenerateRequest, SamplingParams

from server_fixtures import ENGINE, call, model, server  # noqa: F401 (pytest fixtures)


def test_generate_matches_engine_and_sglang_schema(server, model):
    body = {"input_ids": [5, 9, 11, 3, 7], "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 9, "sampling_seed": 4},
            "priority": 3, "routing_key": "k"}  # SGLang fields with no effect here are accepted
    status, out = call(server.url, "/generate", body)
    assert status == 200 and isinstance(out, dict)
    meta = out["meta_info"]
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                         "cached_tokens", "output_token_logprobs", "routed_experts",
                         "weight_version"}
    direct = Engine.from_model(model, ENGINE).generate([GenerateRequest(
        body["input_ids"], SamplingParams(temperature=0.7, max_new_tokens=9, seed=4))])[0]
    P, R = 5, len(out["output_ids"])
    assert out["output_ids"] == direct.output_ids and meta["completion_tokens"] == R
    assert meta["prompt_tokens"] == P and meta["weight_version"] == "0"
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    assert np.allclose([e[0] for e in meta["output_token_logprobs"]],
                       direct.output_logprobs.numpy(), atol=1e-6)
    # base64 little-endian int32 [P+R-1, num_hidden_layers, K]; dense layer 0 is all zeros.
    raw = base64.b64decode(meta["routed_experts"])
    assert len(raw) == (P + R - 1) * 3 * 2 * 4
    ids = np.frombuffer(raw, dtype="<i4").reshape(P + R - 1, 3, 2)
    assert (ids[:, 0] == 0).all()
    assert np.array_equal(ids[:, 1:], direct.routes_NLK.numpy())
    assert meta["finish_reason"] in ({"type": "length", "length": 9},
                                     {"type": "stop", "matched": model.cfg.eos_token_id})


def test_batch_n_and_start_lengths(server):
    body = {"input_ids": [[4, 5, 6, 7], [8, 9]], "return_logprob": [True, False],
            "logprob_start_len": [1, -1], "top_logprobs_num": 2,
            "return_routed_experts": True, "routed_experts_start_len": [2, 0],
            "sampling_params": [{"max_new_tokens": 5, "n": 2, "sampling_seed": 1},
                                {"max_new_tokens": 3, "ignore_eos": True}]}
    status, out = call(server.url, "/generate", body)
    assert status == 200 and isinstance(out, list) and len(out) == 3  # prompt-major: 2 + 1
    a0, a1, b = out
    assert a0["meta_info"]["cached_tokens"] == 0 and a1["meta_info"]["cached_tokens"] == 4
    for o, P, start in ((a0, 4, 2), (a1, 4, 2), (b, 2, 0)):
        R = o["meta_info"]["completion_tokens"]
        rows = len(base64.b64decode(o["meta_info"]["routed_experts"])) // (3 * 2 * 4)
        assert rows == P + R - 1 - start
    inp = a0["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == [5, 6, 7] and all(e[0] < 0 for e in inp)
    assert len(a0["meta_info"]["output_top_logprobs"]) == a0["meta_info"]["completion_tokens"]
    assert len(a0["meta_info"]["input_top_logprobs"]) == 3
    assert "output_token_logprobs" not in b["meta_info"]
    # logprob_start_len=0: first prompt token has no log-prob (null), as in SGLang.
    _, c = call(server.url, "/generate", {"input_ids": [4, 5, 6], "return_logprob": True,
                                          "logprob_start_len": 0,
                                          "sampling_params": {"max_new_tokens": 1}})
    assert c["meta_info"]["input_token_logprobs"][0][0] is None


def test_sampling_mask_modes(server):
    base = {"input_ids": [3, 4, 5], "return_sampling_mask": True,
            "sampling_params": {"top_k": 5, "top_p": 0.9, "max_new_tokens": 6, "sampling_seed": 2}}
    _, sel = call(server.url, "/generate", {**base, "sampling_logprobs_mode": "selected"})
    _, sup = call(server.url, "/generate", {**base, "sampling_logprobs_mode": "support"})
    ms, mp = sel["meta_info"], sup["meta_info"]
    assert sel["output_ids"] == sup["output_ids"]
    assert ms["output_token_sampling_mask"] == mp["output_token_sampling_mask"]
    assert ms["output_token_sampling_mask_length"] == [len(m) for m in ms["output_token_sampling_mask"]]
    assert all(1 <= len(m) <= 5 for m in ms["output_token_sampling_mask"])
    for t, mask, lp, lps in zip(sel["output_ids"], ms["output_token_sampling_mask"],
                                ms["output_token_sampling_logprobs"],
                                mp["output_token_sampling_logprobs"]):
        assert t in mask and len(lps) == len(mask)
        assert abs(lps[mask.index(t)] - lp) < 1e-5 and abs(np.exp(lps).sum() - 1) < 1e-5


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"text": "hello"}, "send input_ids"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [[1, 2], []]}, r"input_ids\[1\] must be a non-empty list"),
    ({"input_ids": "1 2 3"}, "input_ids must be a non-empty list"),
    ({"input_ids": [1, "2"]}, r"input_ids\[1\] must be an integer"),
    ({"input_ids": [1, 2.5]}, r"input_ids\[1\] must be an integer"),
    ({"input_ids": [1, 40]}, r"input_ids\[1\] = 40 is outside the vocabulary \[0, 40\)"),
    ({"input_ids": [1, -3]}, r"input_ids\[1\] = -3"),
    ({"input_ids": [1] * 48}, "prompt of 48 tokens is too long"),
    ({"input_ids": [1], "sampling_params": {"temprature": 1}}, r"unknown sampling_params key\(s\) \['temprature'\]"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature must be"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in"),
    ({"input_ids": [1], "sampling_params": {"stop": "x"}}, "use stop_token_ids"),
    ({"input_ids": [1], "sampling_params": [1, 2]}, "sampling_params is a list of 2 entries"),
    ({"input_ids": [1], "sampling_params": "greedy"}, "sampling_params must be a JSON object"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be bool"),
    ({"input_ids": [1, 2], "logprob_start_len": 5}, "logprob_start_len=5 must be in"),
    ({"input_ids": [1, 2], "routed_experts_start_len": -1}, "routed_experts_start_len=-1"),
    ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
    ({"input_ids": [1], "lockstep_routed_experts_encoding": "int8"}, "valid: \\['int32', 'compact'\\]"),
    ({"input_ids": [1], "sampling_logprobs_mode": "selected"}, "needs return_sampling_mask"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid values must be distinct"),
    ({"input_ids": [1], "rid": 7}, "rid must be a string"),
    # strictness (issue 12): misspelled or unknown top-level fields are refused by name
    ({"input_ids": [1], "return_logprobs": True},
     "unknown /generate field 'return_logprobs'; did you mean 'return_logprob'"),
    ({"input_ids": [1], "sampling_param": {}}, "did you mean 'sampling_params'"),
    ({"input_ids": [1], "lora_path": "adapter"}, "'lora_path' is an SGLang feature .* not implement"),
    ({"input_ids": [1] * 40, "sampling_params": {"max_new_tokens": 9}},
     "40 prompt tokens \\+ max_new_tokens=9 exceed the context of 48 tokens.*at most 8"),
    # what SGLang 0.5.23 refuses (issue 9 item 5)
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 2}}, "min_new_tokens=2 is refused"),
    ({"input_ids": [1], "return_sampling_mask": True, "sampling_params": {"top_p": 0.9}},
     "return_sampling_mask needs a finite top_k in \\(1, 4096\\].*got top_k=-1"),
    ({"input_ids": [1], "return_sampling_mask": True, "sampling_params": {"top_k": 5000}},
     "got top_k=5000"),
    ({"input_ids": [1], "return_sampling_mask": True, "sampling_params": {"top_k": 5, "n": 2}},
     "return_sampling_mask with n=2 is refused: SGLang fails"),
]


@pytest.mark.parametrize("body,msg", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_400_and_server_keeps_serving(server, body, msg):
    raw = body if isinstance(body, bytes) else None
    status, out = call(server.url, "/generate", None if raw else body, raw=raw)
    assert status == 400, out

    assert re.search(msg, out["error"]["message"]), out["error"]["message"]
    status, ok = call(server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2}})
    assert status == 200 and ok["meta_info"]["prompt_tokens"] == 2


def test_endpoints_and_weight_update(server, model, tmp_path):
    assert call(server.url, "/health")[0] == 200
    assert call(server.url, "/health_generate")[0] == 200
    status, info = call(server.url, "/model_info")
    assert status == 200 and info["is_generation"] and info["lockstep"]["moe_layer_ids"] == [1, 2]
    assert call(server.url, "/flush_cache", {})[0] == 200
    status, bad = call(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert status == 400 and bad["success"] is False and "nope is not a directory" in bad["message"]
    torch.manual_seed(3)
    other = MoEModel(model.cfg)
    save_hf(other, tmp_path / "w1")
    status, ok = call(server.url, "/update_weights_from_disk",
                      {"model_path": str(tmp_path / "w1"), "weight_version": "w1"})
    assert status == 200 and ok["success"] is True
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 9}}
    _, out = call(server.url, "/generate", body)
    assert out["meta_info"]["weight_version"] == "w1"
    want = Engine.from_model(other, ENGINE).generate([GenerateRequest(
        [5, 6, 7], SamplingParams(max_new_tokens=4, seed=9))])[0]
    assert out["output_ids"] == want.output_ids
    assert call(server.url, "/update_weight_version", {"new_version": "w1b"})[0] == 200
    assert call(server.url, "/model_info")[1]["weight_version"] == "w1b"
    save_hf(model, tmp_path / "w0")
    assert call(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "w0"),
                                                          "weight_version": "0"})[0] == 200


def test_abort_request_finishes_running_request(server):
    box = {}

    def long_request():
        box["resp"] = call(server.url, "/generate", {"input_ids": [1, 2], "rid": "long-one",
                                                     "sampling_params": {"max_new_tokens": 40,
                                                                         "ignore_eos": True}})
    t = threading.Thread(target=long_request)
    t.start()
    for _ in range(200):
        if call(server.url, "/server_info")[1]["running"]:
            break
    assert call(server.url, "/abort_request", {"rid": "long-one"})[0] == 200
    t.join(30)
    status, out = box["resp"]
    assert status == 200
    assert out["meta_info"]["finish_reason"]["type"] in ("abort", "length")
    assert call(server.url, "/abort_request", {"rid": 3})[0] == 400


def test_sampling_mask_max_tokens(model):
    with ServerThread(Engine.from_model(model, ENGINE), sampling_mask_max_tokens=8) as srv:
        body = {"input_ids": [1, 2], "return_sampling_mask": True,
                "sampling_params": {"max_new_tokens": 2}}
        status, out = call(srv.url, "/generate", body)
        assert status == 400 and "set top_k <= 8" in out["error"]["message"]
        body["sampling_params"]["top_k"] = 9
        assert call(srv.url, "/generate", body)[0] == 400
        for ok in ({"top_k": 1}, {"temperature": 0}):  # a one-token support is always allowed
            assert call(srv.url, "/generate", {**body, "sampling_params": ok})[0] == 200
        body["sampling_params"]["top_k"] = 8
        status, out = call(srv.url, "/generate", body)
        assert status == 200 and all(len(m) <= 8 for m in out["meta_info"]["output_token_sampling_mask"])


def test_api_key(model):
    with ServerThread(Engine.from_model(model, ENGINE), api_key="sekret") as srv:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert call(srv.url, "/health")[0] == 200
        status, out = call(srv.url, "/generate", body)
        assert status == 401 and "API key" in out["error"]["message"]
        assert call(srv.url, "/generate", body, headers={"Authorization": "Bearer nope"})[0] == 401
        assert call(srv.url, "/generate", body, headers={"Authorization": "Bearer sekret"})[0] == 200


def test_concurrent_requests_are_batched(model):
    with ServerThread(Engine.from_model(model, ENGINE)) as srv:
        results = [None] * 12

        def one(i):
            results[i] = call(srv.url, "/generate", {"input_ids": [1 + i, 2], "sampling_params": {
                "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": i}})
        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r[0] == 200 and len(r[1]["output_ids"]) == 10 for r in results)
        steps = call(srv.url, "/server_info")[1]["steps"]
        assert steps < 12 * 10, f"{steps} engine steps for 12 requests of 10 tokens: not batched"
