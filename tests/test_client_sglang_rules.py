"""Issue 9 item 5: the client sends only what SGLang 0.5.23 accepts, against a real loopback
server that refuses what SGLang refuses (top_k=-1 with the sampling mask, n > 1 with the mask)."""

import socket
from pathlib import Path

import pytest
import torch

from lockstep.rollout.client import HTTPBackend, LocalBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer

from server_fixtures import ENGINE, call, model, server  # noqa: F401 (pytest fixtures)


def _mask_reqs(n):
    return [GenerateRequest([4, 5, 6 + i], SamplingParams(temperature=1.0, top_p=0.9, top_k=-1,
                            max_new_tokens=6, n=n, seed=100 + 10 * i), rid=f"m{i}",
                            return_sampling_mask=True, return_support_logprobs=i == 1)
            for i in range(3)]


def _same(got, want):
    assert [(g.rid, g.index, g.output_ids) for g in got] == \
        [(w.rid, w.index, w.output_ids) for w in want]
    for g, w in zip(got, want):
        assert torch.allclose(g.output_logprobs, w.output_logprobs, atol=1e-5)
        assert torch.equal(g.routes_NLK, w.routes_NLK)
        V = 40
        for gm, wm in zip(g.sampling_mask, w.sampling_mask):  # None = whole vocabulary
            assert torch.equal(gm, torch.arange(V, dtype=torch.int32) if wm is None else wm)
        if w.support_logprobs is None:
            assert torch.allclose(g.sampling_logprobs, w.sampling_logprobs, atol=1e-5)
        else:
            assert all(torch.allclose(a, b, atol=1e-5)
                       for a, b in zip(g.support_logprobs, w.support_logprobs))


@pytest.mark.parametrize("n", [1, 4])
def test_top_p_mask_requests_match_the_engine(server, model, n):
    """top_k=-1 (today's client sent it: HTTP 400, as from SGLang) goes out as the vocabulary
    size; n > 1 goes out as n single requests with seeds seed + j and is regrouped: the same
    samples as the engine's own n-sample request."""
    http = HTTPBackend(server.url, model.cfg)
    body = http.request_body(_mask_reqs(1)[0])
    assert body["sampling_params"]["top_k"] == 40
    got = http.generate(_mask_reqs(n))
    want = LocalBackend(Engine.from_model(model, ENGINE)).generate(_mask_reqs(n))
    assert len(got) == 3 * n
    _same(got, want)


def test_fan_out_samples_gives_the_engine_samples(server, model):
    """fan_out_samples=True (for SGLang with deterministic inference, which seeds all n samples
    of a request alike) sends plain n > 1 requests as n seeded single requests too."""
    def reqs():
        return [GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=5, n=3, seed=7),
                                rid="f")]
    from aiohttp import web

    from lockstep.rollout.server import ServerThread
    seen = []

    @web.middleware
    async def count(request, handler):
        if request.path == "/generate":
            seen.append((await request.json())["sampling_params"])
        return await handler(request)
    srv = ServerThread(Engine.from_model(model, ENGINE))
    srv.app.middlewares.append(count)
    with srv:
        got = HTTPBackend(srv.url, model.cfg, fan_out_samples=True).generate(reqs())
    assert [(sp["n"], sp["sampling_seed"]) for sp in seen] == [(1, 7), (1, 8), (1, 9)]
    want = LocalBackend(Engine.from_model(model, ENGINE)).generate(reqs())
    assert [(g.rid, g.index, g.output_ids) for g in got] == \
        [(w.rid, w.index, w.output_ids) for w in want]


def test_mask_request_the_server_cannot_take_is_refused_before_sending(model):
    with socket.socket() as s:  # nothing listens there: a sent request would fail to connect
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    http = HTTPBackend(url, model.cfg, sampling_mask_max_tokens=16, retries=0)
    with pytest.raises(RolloutError, match=r"return_sampling_mask with top_k=-1 \(vocabulary 40\): "
                       r"SGLang needs a finite top_k <= sampling_mask_max_tokens=16"):
        http.generate(_mask_reqs(1))
    bad = _mask_reqs(1)[:1]
    bad[0].sampling.top_k = 17
    with pytest.raises(RolloutError, match="top_k=17"):
        http.generate(bad)


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_training_step_over_http_with_top_p_and_8_samples(tmp_path):
    """The loop's own requests (top_p=0.9, n=8, sampling-mask replay) over a real loopback
    server: accepted, replayed, and the fp32 engine/actor ratios are 1."""
    from lockstep.moe.model import MoEModel
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.server import ServerThread

    small = ["warmstart.enabled=false", "rollout.prompts_per_step=2",
             "rollout.samples_per_prompt=8", "actor.mini_batch_size=16",
             "actor.micro_batch_size=16", "loop.steps=1", "loop.tensorboard=false",
             "loop.plots=false", "rollout.dtype=fp32", "rollout.top_p=0.9"]
    cfg = load_config(CONFIGS / "toy_r3.yaml", small)
    engine = Engine(MoEModel(cfg.model), EngineConfig(dtype="fp32", max_running=32, max_len=16,
                                                      seed=cfg.loop.seed))
    with ServerThread(engine) as srv:
        cfg = load_config(CONFIGS / "toy_r3.yaml", small + [
            "rollout.backend=http", f"rollout.url={srv.url}"])
        tr = Trainer(cfg, tmp_path / "http", progress=False, log=lambda s: None)
        assert tr.cfg.rollout.mask_replay
        m = tr.step(1)
    for part in ("mismatch", "total"):
        assert abs(m[f"is_split/{part}_max"] - 1) < 1e-4, part
        assert abs(m[f"is_split/{part}_min"] - 1) < 1e-4, part
