"""Indexer picks as the engine records them and the trainer replays them (replay/indexer.py,
replay/indexer_codec.py): the contract every trace is checked against, both wire encodings,
stitching across turns, batching, the flip rate."""

import pytest
import torch

from lockstep.kernels.routes import RouteError
from lockstep.replay.indexer import (IndexerTrace, batch_indexer_traces, concat_indexer_traces,
                                     indexer_flip_rate)
from lockstep.replay.indexer_codec import (decode_indexer, encode_indexer, wire_bytes,
                                           wire_layer_sources)


def random_picks(N, L, K, start=0, seed=0, local=0):
    """Rows as an indexer makes them: every causal key while p < K, else K of them (the last
    `local` positions always among them)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N, L, K), -1, dtype=torch.int64)
    for i in range(N):
        p = start + i
        for l in range(L):
            if p + 1 <= K:
                out[i, l, :p + 1] = torch.arange(p + 1)
                continue
            recent = torch.arange(p + 1 - local, p + 1)
            older = torch.randperm(p + 1 - local, generator=g)[:K - local]
            out[i, l] = torch.cat([older, recent]).sort().values
    return out


def test_the_contract_is_checked_with_the_row_named():
    good = random_picks(12, 2, 4)
    IndexerTrace(good)
    bad = good.clone()
    bad[7, 1, 0] = 8  # beyond its own position
    with pytest.raises(RouteError, match=r"row 7 \(position 7\), layer 1"):
        IndexerTrace(bad)
    dup = good.clone()
    dup[9, 0, 1] = dup[9, 0, 0]
    with pytest.raises(RouteError, match="row 9"):
        IndexerTrace(dup)
    short = good.clone()
    short[2, 0, 2] = -1  # position 2 picks all 3 keys
    with pytest.raises(RouteError, match="row 2"):
        IndexerTrace(short)
    with pytest.raises(RouteError, match="row 0 \\(position 0\\)"):
        IndexerTrace(good[5:])  # rows of positions 5.. declared to start at 0
    assert IndexerTrace(good[5:], start=5).end == 12


@pytest.mark.parametrize("encoding", ["int32", "compact"])
@pytest.mark.parametrize("local", [0, 6])
def test_both_encodings_round_trip_from_any_start(encoding, local):
    picks = random_picks(60, 3, 8, start=0, local=local)
    full = IndexerTrace(picks)
    later = full.slice(20, 60)
    src = wire_layer_sources([False, True, False, False, True])  # GLM-5-like: 2 shared layers
    assert src == [0, 0, 1, 2, 2]
    for t, rows, start in ((full, 60, 0), (later, 40, 20)):
        assert decode_indexer(encode_indexer(t, encoding, src), rows, src, 8, start) == t
    with pytest.raises(RouteError, match="expected"):
        decode_indexer(encode_indexer(later, encoding, src), 39, src, 8, 20)


def test_int32_is_sglangs_layout_over_every_decoder_layer():
    """SGLang's array: [rows, num_hidden_layers, index_topk] int32, shared layers mirroring
    their source; a shared layer holding other positions is refused by name."""
    import base64

    import numpy as np

    src = [0, 0, 1]
    t = IndexerTrace(random_picks(12, 2, 4))
    raw = base64.b64decode(encode_indexer(t, "int32", src))
    arr = np.frombuffer(raw, dtype="<i4").reshape(12, 3, 4)
    assert (arr[:, 1] == arr[:, 0]).all() and (arr[:, 2] == t.to_int64()[:, 1].numpy()).all()
    bad = arr.copy()
    bad[10, 1] = arr[10, 2]
    with pytest.raises(RouteError, match="decoder layer 1 reuses indexer layer 0"):
        decode_indexer(base64.b64encode(bad.tobytes()).decode(), 12, src, 4)


def test_compact_is_smaller_and_picks_its_body():
    t = IndexerTrace(random_picks(200, 2, 16, local=12))
    raw, compact = wire_bytes(t, "int32"), wire_bytes(t, "compact")
    assert compact * 4 < raw
    # rows before index_topk cost nothing: a trace of only such rows is its header
    assert wire_bytes(IndexerTrace(random_picks(16, 2, 16)), "compact") < 30


def test_turns_stitch_like_routes():
    picks = random_picks(30, 2, 4)
    a, b = IndexerTrace(picks[:12]), IndexerTrace(picks[12:], start=12)
    assert concat_indexer_traces([a, b]) == IndexerTrace(picks)
    with pytest.raises(RouteError, match="overlaps"):
        a.extend(IndexerTrace(picks[11:], start=11))
    with pytest.raises(RouteError, match="gap"):
        a.extend(IndexerTrace(picks[13:], start=13))


def test_batching_puts_row_t_at_position_t():
    t1, t2 = IndexerTrace(random_picks(9, 2, 4, seed=1)), IndexerTrace(random_picks(5, 2, 4))
    picks, valid = batch_indexer_traces([t1, t2], T=10, seq_lens=[10, 6])
    assert picks.shape == (2, 10, 2, 4)
    assert torch.equal(picks[0, :9].long(), t1.to_int64())
    assert valid[1].tolist() == [True] * 5 + [False] * 5
    assert (picks[1, 5:] == -1).all()
    with pytest.raises(RouteError, match="sample 1"):
        batch_indexer_traces([t1, t2], T=10, seq_lens=[10, 7])


def test_flip_rate_by_hand():
    """Two forwards over one sample of 6 tokens, top-2 picks: only rows at positions >= 2 had
    a choice; at position 4 one of the two picks differs in layer 0."""
    a = random_picks(6, 2, 2, seed=3)[None]
    b = a.clone()
    b[0, 4, 0] = torch.tensor([x for x in range(5) if x not in a[0, 4, 0].tolist()][:1]
                              + [a[0, 4, 0, 1].item()]).sort().values
    valid = torch.ones(1, 6, dtype=torch.bool)
    r = indexer_flip_rate(a, b, valid)
    assert r["rows"] == 4 * 2
    assert r["flip_rate_layers"].tolist() == pytest.approx([0.5 / 4, 0.0])
    assert r["token_any_flip"].item() == pytest.approx(1 / 4)
    assert indexer_flip_rate(a, a, valid)["flip_rate"].item() == 0.0
