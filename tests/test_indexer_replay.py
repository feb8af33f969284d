"""Indexer replay end to end: the embedded engine records each DSA layer's picks as the full
forward makes them, they travel on SGLang's wire (`return_indexer_topk`, int32 or compact), and
(tests further down) the actor replays them."""

import pytest
import torch

from lockstep.moe.checkpoint import load_hf
from lockstep.moe.config import ModelConfig
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams

from arch_fixtures import write_hf_folder

PROMPTS = ((5, 9, 1, 7, 3), (5, 9), (3, 4, 8, 8, 1, 2))


def _requests(start=0):
    return [GenerateRequest(list(p), SamplingParams(max_new_tokens=9, seed=i, n=2),
                            return_indexer_topk=True, indexer_start=min(start, len(p)))
            for i, p in enumerate(PROMPTS)]


def _check(results, model):
    for r in results:
        ids = torch.tensor(r.prompt_ids + r.output_ids)[None]
        with torch.no_grad():
            want = model(ids).indexer_BTLK[0, r.indexer.start:len(ids[0]) - 1]
        assert torch.equal(r.indexer.to_int64(), want)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_engine_records_the_picks_of_the_full_forward(family, tmp_path):
    """Prefill and cached decode (the indexer's key cache) pick what one full forward over
    prompt + completion picks, row for row (fp32)."""
    model = load_hf(write_hf_folder(family, tmp_path / family)).eval()
    engine = Engine.from_model(model, EngineConfig(dtype="fp32", max_len=64, max_running=8))
    _check(engine.generate(_requests()), model)


def test_picks_on_the_wire(tmp_path):
    """`lockstep serve`'s /generate answers return_indexer_topk in SGLang's int32 layout and in
    the compact one, from a start position too; the client decodes both."""
    from lockstep.rollout.client import HTTPBackend
    from lockstep.rollout.server import ServerThread

    folder = write_hf_folder("glm_moe_dsa", tmp_path / "g")
    model = load_hf(folder).eval()
    engine = Engine.from_hf(folder, EngineConfig(dtype="fp32", max_len=64, max_running=8))
    cfg = ModelConfig.from_json(folder)
    with ServerThread(engine, model_path=str(folder)) as srv:
        for compact in (False, True):
            http = HTTPBackend(srv.url, cfg, compact_routes=compact)
            _check(http.generate(_requests()), model)
            later = http.generate(_requests(start=3))
            assert [r.indexer.start for r in later] == [3, 3, 2, 2, 3, 3]
            _check(later, model)


def test_indexer_request_on_a_model_without_one_is_refused(tmp_path):
    from lockstep.rollout.types import RequestError

    model = load_hf(write_hf_folder("deepseek_v3", tmp_path / "d")).eval()
    engine = Engine.from_model(model, EngineConfig(dtype="fp32", max_len=32, max_running=2))
    with pytest.raises(RequestError, match="has no lightning indexer"):
        engine.generate(_requests())
