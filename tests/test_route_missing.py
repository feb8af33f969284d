"""Routes with no route for a row (`replay.missing`): the -1 sentinel on the SGLang wire and
its compact code round-trip, a row -1 only in part is refused, `batch_traces` refuses missing
rows or leaves them to the live router, and a step under `live` logs
replay/fallback_fraction (replay/trace.py, replay/codec.py, docs/replay.md)."""

import base64
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import lockstep.trainer.loop as loop
from lockstep.replay import (RouteError, RoutingTrace, batch_traces, decode_compact,
                             decode_routes, decode_sglang, encode_compact, encode_sglang,
                             load_traces, save_traces)
from lockstep.replay.trace import missing_code
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.loop import Trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _ids(E: int, K: int, N: int = 6, L: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(E * 10 + K)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N * L)]).view(N, L, K)
    ids[[1, 4]] = -1  # rows 1 and 4 have no route
    return ids


@pytest.mark.parametrize("E,K", [(4, 2), (6, 2), (5, 1), (256, 8), (300, 2), (256, 2)])
def test_missing_rows_round_trip_on_both_wires(E, K):
    t = RoutingTrace(_ids(E, K), E)
    assert t.missing_rows().tolist() == [False, True, False, False, True, False]
    assert t.ids_NLK.dtype == (torch.uint8 if E <= 256 else torch.uint16)
    assert int(t.to_int64()[1].min()) == missing_code(E, K) == (255 if E <= 256 else 65535)
    payload = encode_sglang(t, 3, [0, 2])  # decoder layer 1 dense
    raw_NHK = np.frombuffer(base64.b64decode(payload), "<i4").reshape(6, 3, K)
    assert (raw_NHK[[1, 4]] == -1).all() and (raw_NHK[[0, 2, 3, 5]] >= 0).all()
    assert decode_sglang(payload, 6, 3, [0, 2], K, E) == t
    raw_NHK = raw_NHK.copy()
    raw_NHK[1, 1] = 0  # a dense layer's 0 in a missing row is read as missing too
    assert decode_sglang(base64.b64encode(raw_NHK.tobytes()), 6, 3, [0, 2], K, E) == t
    compact = encode_compact(t)
    assert decode_compact(compact, 6, 2, K, E) == t
    assert decode_routes(compact, 6, 3, [0, 2], K, E) == t


def test_top1_with_every_code_an_expert():
    """Top-1 of 4 experts: a compact code of 3 is expert 3, so compact cannot mark a missing
    row (refused; int32 can); 256 experts: no stored value is free (refused)."""
    real = RoutingTrace(torch.full((3, 2, 1), 3), 4)
    assert real.missing_rows() is None and decode_compact(encode_compact(real), 3, 2, 1, 4) == real
    t = RoutingTrace(_ids(4, 1), 4)
    with pytest.raises(RouteError, match="compact encoding cannot mark for top-1 routes of 4"):
        encode_compact(t)
    assert decode_sglang(encode_sglang(t, 2, [0, 1]), 6, 2, [0, 1], 1, 4) == t
    with pytest.raises(RouteError, match="cannot be stored for top-1 routes of exactly 256"):
        RoutingTrace(_ids(256, 1), 256)
    full = RoutingTrace(torch.full((2, 2, 1), 255), 256)  # a real route of expert 255
    assert full.missing_rows() is None


def test_a_row_missing_in_part_is_refused():
    ids = _ids(6, 2)
    ids[1, 0, 0] = 3  # row 1: -1 everywhere but one slot
    with pytest.raises(RouteError) as e:
        RoutingTrace(ids, 6, start=2, sample=7)
    assert str(e.value) == ("sample 7: routes row 3 (position), layer 0, slot 1: expert id -1 "
                            "outside [0, 6) (a row with no route has -1 in every slot of every "
                            "layer)")


def test_trace_files_keep_missing_rows(tmp_path):
    t = RoutingTrace(_ids(6, 2), 6)
    save_traces(tmp_path / "t.safetensors", [t])
    (back,), _ = load_traces(tmp_path / "t.safetensors")
    assert back == t and back.missing_rows().tolist() == t.missing_rows().tolist()


def test_batch_traces_refuses_or_routes_live():
    t, full = RoutingTrace(_ids(6, 2), 6), RoutingTrace(_ids(6, 2)[[0, 2, 3]], 6)
    with pytest.raises(RouteError) as e:
        batch_traces([full, t], 8)
    assert str(e.value).startswith("sample 1: routes row 1 (position) has no route (the engine "
                                   "sent -1: 2 of its 6 rows); replay.missing=live")
    ids_BTLK, valid_BT = batch_traces([full, t], 8, missing="live")
    assert valid_BT[1].tolist() == [True, False, True, True, False, True, False, False]
    assert valid_BT[0].tolist() == [True] * 3 + [False] * 5
    assert int(ids_BTLK[1, [1, 4]].max()) == 0  # no sentinel reaches the actor
    assert torch.equal(ids_BTLK[1, [0, 2, 3, 5]], t.ids_NLK[[0, 2, 3, 5]])


SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=32", "actor.micro_batch_size=32", "loop.tensorboard=false",
         "loop.plots=false", "loop.steps=1", "replay.check=full"]


def test_a_step_under_live_logs_the_fallback_fraction(tmp_path, monkeypatch):
    """An engine that lost the routes of every 4th sample's row 3: `live` trains the step
    (the validator, on every token, passes: those tokens route live) and logs the share of
    rows; `refuse`, the default, stops it naming the sample."""
    real, lost = loop.collate, []

    def engine_lost_rows(results, *args, **kw):
        out = []
        for b, r in enumerate(results):
            if b % 4 == 0:
                routes = r.routes_NLK.clone()
                routes[3] = missing_code(4, 2)  # what the client stores for a row of -1s
                r = dataclasses.replace(r, routes_NLK=routes)
            out.append(r)
        lost.append(sum(r.prompt_tokens + r.completion_tokens - 1 for r in results))
        return real(out, *args, **kw)
    monkeypatch.setattr(loop, "collate", engine_lost_rows)
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + ["replay.missing=live"])
    with Trainer(cfg, tmp_path / "live", progress=False, log=lambda s: None) as tr:
        m = tr.step(1)
    assert m["replay/fallback_fraction"] == pytest.approx(8 / lost[0])
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL)
    with Trainer(cfg, tmp_path / "refuse", progress=False, log=lambda s: None) as tr:
        with pytest.raises(RouteError, match=r"^sample 0: routes row 3 \(position\) has no route"):
            tr.step(1)


def test_live_is_refused_with_routes_by_reference():
    with pytest.raises(ExperimentConfigError, match="replay.missing=live needs the routes on"):
        load_config(CONFIGS / "toy_r3.yaml", ["replay.missing=live", "rollout.backend=ray",
                                              "rollout.routes_by_reference=true",
                                              "cluster.actor_ranks=2"])
