"""Client round trips through a real loopback server, compact/int32 routes, retries, weights."""

import asyncio
import json
import re
import socket
import threading
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from lockstep.moe.model import MoEModel
from lockstep.replay.codec import ENCODING_REQUEST_FIELD
from lockstep.rollout.client import HTTPBackend, LocalBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.server import ServerThread
from lockstep.rollout.types import GenerateRequest, SamplingParams

from server_fixtures import ENGINE, model, server  # noqa: F401 (pytest fixtures)


def _reqs():
    g = torch.Generator().manual_seed(5)
    reqs = [GenerateRequest(torch.randint(3, 40, (p,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=8, seed=10 + i, temperature=0.9))
            for i, p in enumerate([3, 7, 5, 1, 6])]
    reqs[2].sampling.n = 3
    reqs[4].return_sampling_mask = True
    reqs[4].sampling.top_k = 6
    return reqs


@pytest.mark.parametrize("compact", [True, False])
def test_http_round_trip_equals_engine(server, model, compact):
    http = HTTPBackend(server.url, model.cfg, max_concurrency=4, compact_routes=compact)
    local = LocalBackend(Engine.from_model(model, ENGINE))
    got, want = http.generate(_reqs()), local.generate(_reqs())
    assert len(got) == len(want) == 7
    for g, w in zip(got, want):
        assert (g.index, g.prompt_ids, g.output_ids) == (w.index, w.prompt_ids, w.output_ids)
        assert torch.allclose(g.output_logprobs, w.output_logprobs, atol=1e-5)
        assert g.routes_NLK.dtype == torch.uint8 and torch.equal(g.routes_NLK, w.routes_NLK)
        assert g.finish_reason == w.finish_reason and g.weight_version == w.weight_version
        g.trace(model.cfg.num_experts).check(g.prompt_tokens, g.completion_tokens, 2, 2, 6)
    masked = [r for r in got if r.sampling_mask is not None]
    assert len(masked) == 1 and torch.allclose(masked[0].sampling_logprobs,
                                               want[-1].sampling_logprobs, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(masked[0].sampling_mask, want[-1].sampling_mask))
    kind = "compact" if compact else "int32"
    assert http.encodings_seen[kind] == 7 and http.encodings_seen[
        "int32" if compact else "compact"] == 0


def test_compact_is_smaller_and_int32_fallback_decodes(server, model):
    reqs = [GenerateRequest([4, 5, 6, 7] * 4, SamplingParams(max_new_tokens=16, ignore_eos=True))
            for _ in range(4)]
    sizes = {}
    for compact in (True, False):
        http = HTTPBackend(server.url, model.cfg, compact_routes=compact)
        http.generate(reqs)
        sizes[compact] = http.route_bytes_received
    # 3 decoder layers of int32 vs 2 MoE layers of bit-packed ids (+ a 5-byte header per sample).
    assert sizes[True] * 4 < sizes[False]
    # A server that ignores the compact field (real SGLang) answers int32: the client asked
    # for compact, gets int32, and still decodes and checks it.
    http = HTTPBackend(server.url, model.cfg, compact_routes=True)
    body = http.request_body(reqs[0])
    assert body[ENCODING_REQUEST_FIELD] == "compact"
    int32_answer = asyncio.run(_post_plain(server.url, {**body, ENCODING_REQUEST_FIELD: None}))
    res = http.parse(int32_answer, reqs[0], 0, 0)
    assert http.encodings_seen == {"int32": 1, "compact": 0}
    assert res.routes_NLK.shape == (16 + 16 - 1, 2, 2)


async def _post_plain(url, body, path="/generate"):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def test_row_count_and_contract_checks(server, model):
    http = HTTPBackend(server.url, model.cfg)
    req = GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=5, ignore_eos=True))
    item = asyncio.run(_post_plain(server.url, http.request_body(req)))
    item["meta_info"]["completion_tokens"] = 4
    item["output_ids"] = item["output_ids"][:4]
    item["meta_info"]["output_token_logprobs"] = item["meta_info"]["output_token_logprobs"][:4]
    with pytest.raises(RolloutError,
                       match="^request 0 sample 0: routes: compact header says rows=7, expected 6"):
        http.parse(item, req, 0, 0)
    item = asyncio.run(_post_plain(server.url, http.request_body(req)))
    item["meta_info"]["prompt_tokens"] = 2
    with pytest.raises(RolloutError, match="request 0 sample 0: prompt_tokens=2 \\(sent 3\\)"):
        http.parse(item, req, 0, 0)
    with pytest.raises(RolloutError, match="HTTP 400.*outside the vocabulary"):
        http.generate([GenerateRequest([1, 99], SamplingParams(max_new_tokens=4))])


def test_bad_routes_name_request_and_sample(server, model):
    # with n > 1 the sample index differs from the request index: a bad payload in request 1
    # sample 2 must say so, as a RolloutError like every other contract check
    http = HTTPBackend(server.url, model.cfg)
    req = GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True, n=3))
    items = asyncio.run(_post_plain(server.url, http.request_body(req)))
    assert len(items) == 3
    http.parse(items[2], req, 1, 2)
    items[2]["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(RolloutError, match="^request 1 sample 2: routes payload is not valid base64"):
        http.parse(items[2], req, 1, 2)


def test_missing_weight_version_and_finish_reason_are_refused(server, model):
    http = HTTPBackend(server.url, model.cfg)
    req = GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=3))
    item = asyncio.run(_post_plain(server.url, http.request_body(req)))
    assert http.parse(item, req, 0, 0).weight_version == "0"
    for key, msg in (("weight_version", "request 3 sample 1: meta_info has no weight_version"),
                     ("finish_reason", "request 3 sample 1: finish_reason is None")):
        bad = {**item, "meta_info": {k: v for k, v in item["meta_info"].items() if k != key}}
        with pytest.raises(RolloutError, match=msg):
            http.parse(bad, req, 3, 1)


def _version_hiding_server(model):
    """The real server, behind a middleware that drops weight_version from /model_info (an
    older or foreign server)."""
    srv = ServerThread(Engine.from_model(model, ENGINE))

    @web.middleware
    async def hide(request, handler):
        resp = await handler(request)
        if request.path != "/model_info":
            return resp
        info = json.loads(resp.body)
        del info["weight_version"]
        return web.json_response(info)

    srv.app.middlewares.append(hide)
    return srv


def test_update_weights_checks_the_version_the_server_reports(model, tmp_path):
    with _version_hiding_server(model) as srv:
        http = HTTPBackend(srv.url, model.cfg, weights_dir=tmp_path)
        with pytest.raises(RolloutError, match="/model_info after update_weights_from_disk.*has no "
                                               "weight_version"):
            http.update_weights(model, weight_version="s0")


def test_results_of_another_version_than_pushed_are_refused(model, tmp_path):
    with ServerThread(Engine.from_model(model, ENGINE)) as srv:
        http = HTTPBackend(srv.url, model.cfg, weights_dir=tmp_path)
        assert http.update_weights(model, weight_version="s1") == "s1"
        req = [GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=2))]
        assert http.generate(req)[0].weight_version == "s1"
        # someone else changes the server's version behind the trainer's back
        asyncio.run(_post_plain(srv.url, {"new_version": "other"}, "/update_weight_version"))
        with pytest.raises(RolloutError, match="request 0 sample 0: generated with weight version "
                                               "'other', expected 's1'"):
            http.generate(req)


class _DroppingServer:
    """A loopback TCP server that reads each HTTP request in full, counts it, and closes the
    connection without answering (a server that died after accepting the request)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
                while len(body) < length:
                    body += conn.recv(65536)
                self.requests += 1

    def close(self):
        self.sock.close()


def test_connection_lost_after_sending_is_not_retried(model, tmp_path):
    srv = _DroppingServer()
    try:
        http = HTTPBackend(srv.url, model.cfg, retries=3, backoff_s=0.01, weights_dir=tmp_path)
        with pytest.raises(RolloutError, match="/generate: connection lost after the request was "
                                               "sent.*not retried"):
            http.generate([GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), rid="r1")])
        assert srv.requests == 1  # a resent rid would be "already running" on a live server
        with pytest.raises(RolloutError, match="/update_weights_from_disk: connection lost"):
            http.update_weights(str(tmp_path))
        assert srv.requests == 2  # a weight update is not idempotent: sent once
    finally:
        srv.close()


def test_retries_connection_errors_with_backoff(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    http = HTTPBackend(url, model.cfg, retries=2, backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match="connection failed after 3 attempts"):
        http.generate([GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))])
    assert time.monotonic() - t0 >= 0.05 * (0.5 + 1.0)  # two backoffs happened
    # The server comes up while the client is backing off: the request then succeeds.
    srv = ServerThread(Engine.from_model(model, ENGINE), port=port)
    timer = threading.Timer(0.4, srv.start)
    timer.start()
    try:
        http = HTTPBackend(url, model.cfg, retries=6, backoff_s=0.1)
        res = http.generate([GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))])
        assert len(res) == 1 and res[0].weight_version == "0"
    finally:
        timer.join()
        srv.stop()


def test_weight_versions_tracked_over_http(model, tmp_path):
    with ServerThread(Engine.from_model(model, ENGINE)) as srv:
        http = HTTPBackend(srv.url, model.cfg, weights_dir=tmp_path)
        req = lambda: [GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=3, seed=1))]  # noqa: E731
        assert http.generate(req())[0].weight_version == "0" and http.weight_version == "0"
        torch.manual_seed(11)
        new = MoEModel(model.cfg)
        assert http.update_weights(model, weight_version="s0") == "s0"
        assert http.update_weights(new, weight_version="s1") == "s1"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["weights_s1"]  # older one removed
        res = http.generate(req())[0]
        assert res.weight_version == "s1"
        want = LocalBackend(Engine.from_model(new, ENGINE)).generate(req())[0]
        assert res.output_ids == want.output_ids
        with pytest.raises(RolloutError, match="update_weights_from_disk"):
            http.update_weights(str(tmp_path / "missing"))
    local = LocalBackend(Engine.from_model(model, ENGINE))
    assert local.update_weights(new, "s2") == "s2" and local.weight_version == "s2"


def test_aborted_samples_are_resent_never_returned(model):  # noqa: F811
    """A sample that comes back with finish_reason abort (someone called /abort_request) is
    sent again under a fresh rid (bounded), counted in the rollout/aborted_resent metric; the
    caller gets only finished samples, under the rid it asked for."""
    from lockstep.rollout.engine_config import EngineConfig
    engine = Engine.from_model(model, EngineConfig(dtype="fp32", max_running=1, max_len=48))
    with ServerThread(engine) as srv:
        long = SamplingParams(max_new_tokens=40, ignore_eos=True)
        blocker = threading.Thread(target=lambda: HTTPBackend(srv.url, model.cfg).generate(
            [GenerateRequest([1, 2], long, rid="blocker")]))
        blocker.start()  # holds the only running slot: "ab" waits in the queue

        def abort_ab():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                queued = [r.rid for r in list(engine.waiting)] + [
                    s.req.rid for s in list(engine.running.values())]
                if "ab" in queued:
                    urllib_call(srv.url, "/abort_request", {"rid": "ab"})
                    return
                time.sleep(0.001)
        aborter = threading.Thread(target=abort_ab)
        aborter.start()
        client = HTTPBackend(srv.url, model.cfg)
        res = client.generate([GenerateRequest([1, 3], long, rid="ab")])
        aborter.join(30)
        blocker.join(30)
    assert [r.finish_reason["type"] for r in res] == ["length"] and res[0].rid == "ab"
    assert len(res[0].output_ids) == 40
    assert client.aborted_resent == 1
    assert client.counters() == {"rollout/aborted_resent": 1.0}


def urllib_call(url, path, body):
    from server_fixtures import call
    return call(url, path, body)
