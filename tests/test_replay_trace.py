"""RoutingTrace: validation, checks, multi-turn concatenation, slicing, batching, save/load."""

import numpy as np
import pytest
import torch

from lockstep.replay import (
    RouteError,
    RoutingTrace,
    batch_traces,
    compact_dtype,
    concat_traces,
    load_traces,
    save_traces,
)


def make_ids(rows, L=2, K=2, E=8, seed=0):
    """[rows, L, K] int64 with distinct ids per row (a random top-k)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, L, E, generator=g).topk(K, dim=-1).indices


def test_compact_dtype_boundaries():
    assert compact_dtype(1) == torch.uint8
    assert compact_dtype(256) == torch.uint8
    assert compact_dtype(257) == torch.uint16
    assert compact_dtype(65536) == torch.uint16
    with pytest.raises(RouteError, match="65537 exceeds"):
        compact_dtype(65537)
    with pytest.raises(RouteError, match="positive int"):
        compact_dtype(0)


@pytest.mark.parametrize("E, dtype", [(8, torch.uint8), (256, torch.uint8), (300, torch.uint16)])
def test_construction_stores_compact_and_roundtrips(E, dtype):
    ids = make_ids(5, L=3, K=2, E=E)
    t = RoutingTrace(ids, E)
    assert t.ids_NLK.dtype == dtype
    assert (t.num_rows, t.num_layers, t.top_k, t.num_experts, t.start) == (5, 3, 2, E, 0)
    assert t.nbytes == 5 * 3 * 2 * dtype.itemsize
    assert torch.equal(t.to_int64(), ids)
    assert t.to_int64().dtype == torch.int64


def test_construction_accepts_numpy_and_int_dtypes():
    ids = make_ids(4)
    for arr in (ids.numpy().astype(np.int32), ids.numpy().astype(np.uint8), ids.to(torch.int16)):
        assert torch.equal(RoutingTrace(arr, 8).to_int64(), ids)


def test_construction_errors_name_sample_row_layer_value():
    ids = make_ids(4, L=3)
    ids[2, 1, 0] = 8  # out of range for E=8
    with pytest.raises(RouteError, match=r"sample 7: routes row 2 \(position\), layer 1, slot 0: expert id 8 outside \[0, 8\)"):
        RoutingTrace(ids, 8, sample=7)
    ids[2, 1, 0] = -1
    with pytest.raises(RouteError, match="expert id -1"):
        RoutingTrace(ids, 8)
    # row index is reported as an absolute position when the trace starts later
    with pytest.raises(RouteError, match=r"row 12 \(position\)"):
        RoutingTrace(ids, 8, start=10)


def test_construction_rejects_repeated_ids_dtype_shape():
    ids = make_ids(3, L=2, K=3)
    ids[1, 0] = torch.tensor([4, 1, 4])
    with pytest.raises(RouteError, match=r"sample 0: routes row 1 \(position\), layer 0: expert ids \[4, 1, 4\] repeat"):
        RoutingTrace(ids, 8, sample=0)
    with pytest.raises(RouteError, match="must be integers, got torch.float32"):
        RoutingTrace(torch.zeros(2, 1, 1), 8)
    with pytest.raises(RouteError, match="must be integers, got numpy dtype float64"):
        RoutingTrace(np.zeros((2, 1, 1)), 8)
    with pytest.raises(RouteError, match=r"shape \[rows, layers, top_k\], got \(2, 2\)"):
        RoutingTrace(torch.zeros(2, 2, dtype=torch.long), 8)
    with pytest.raises(RouteError, match="need >= 1 layer"):
        RoutingTrace(torch.zeros(2, 0, 2, dtype=torch.long), 8)
    with pytest.raises(RouteError, match="torch.Tensor or numpy array, got list"):
        RoutingTrace([[[0]]], 8)
    with pytest.raises(RouteError, match="start must be an int >= 0"):
        RoutingTrace(make_ids(1), 8, start=-1)
    # compact-dtype fast path still validates the range
    with pytest.raises(RouteError, match="expert id 200 outside"):
        RoutingTrace(torch.full((1, 1, 1), 200, dtype=torch.uint8), 8)


def test_zero_row_trace_is_valid():
    t = RoutingTrace(torch.zeros(0, 2, 2, dtype=torch.long), 8)
    t.check(prompt_len=1, response_len=0, num_layers=2, top_k=2, num_experts=8)


def test_check_rows_layers_topk_experts():
    t = RoutingTrace(make_ids(9, L=2, K=2), 8)
    t.check(prompt_len=4, response_len=6, num_layers=2, top_k=2, num_experts=8, sample=3)
    with pytest.raises(RouteError, match=r"sample 3: routes have 9 rows starting at position 0, expected 10 = prompt 5 \+ response 6 - 1"):
        t.check(5, 6, 2, 2, 8, sample=3)
    with pytest.raises(RouteError, match="sample 3: routes have 2 layers, the model has 3 MoE layers"):
        t.check(4, 6, 3, 2, 8, sample=3)
    with pytest.raises(RouteError, match="top_k 2, the model routes to 4"):
        t.check(4, 6, 2, 4, 8, sample=3)
    with pytest.raises(RouteError, match="recorded for 8 experts, the model has 16"):
        t.check(4, 6, 2, 2, 16, sample=3)
    with pytest.raises(RouteError, match="need prompt_len >= 1"):
        t.check(0, 10, 2, 2, 8)
    # a continuation trace is checked against prompt + completion - 1 - start
    cont = RoutingTrace(make_ids(5), 8, start=9)
    cont.check(prompt_len=12, response_len=3, num_layers=2, top_k=2, num_experts=8)


def test_multi_turn_concat_and_errors():
    full = make_ids(20)
    turn1 = RoutingTrace(full[:9], 8)           # P1 + R1 - 1 = 9 rows
    turn2 = RoutingTrace(full[9:15], 8, start=9)  # routed_experts_start_len = 9
    turn3 = RoutingTrace(full[15:], 8, start=15)
    joined = concat_traces([turn1, turn2, turn3])
    assert joined == RoutingTrace(full, 8)
    assert joined.ids_NLK.dtype == torch.uint8
    with pytest.raises(RouteError, match=r"sample 4: routes: continuation starts at position 8 but the trace covers \[0, 9\); it overlaps"):
        turn1.extend(RoutingTrace(full[8:15], 8, start=8), sample=4)
    with pytest.raises(RouteError, match="leaves a gap after.*routed_experts_start_len=9"):
        turn1.extend(RoutingTrace(full[10:15], 8, start=10))
    with pytest.raises(RouteError, match="continuation has top_k=3, the trace has 2"):
        turn1.extend(RoutingTrace(make_ids(2, K=3), 8, start=9))
    with pytest.raises(RouteError, match="continuation has num_experts=16"):
        turn1.extend(RoutingTrace(make_ids(2), 16, start=9))
    with pytest.raises(RouteError, match="nothing to concatenate"):
        concat_traces([])


def test_slice_uses_absolute_positions():
    full = make_ids(10)
    t = RoutingTrace(full[4:], 8, start=4)
    s = t.slice(5, 8)
    assert s.start == 5 and torch.equal(s.to_int64(), full[5:8])
    assert t.slice(4, 6).extend(t.slice(6, 10)) == t
    with pytest.raises(RouteError, match=r"slice \[3, 6\) is outside the trace's positions \[4, 10\)"):
        t.slice(3, 6)
    with pytest.raises(RouteError, match="outside"):
        t.slice(6, 11)


def test_batch_traces_right_padded_absolute_positions():
    a, b = make_ids(4, seed=1), make_ids(2, seed=2)
    ids_BTLK, valid_BT = batch_traces([RoutingTrace(a, 8), RoutingTrace(b, 8)], T=6, seq_lens=[5, 3])
    assert ids_BTLK.shape == (2, 6, 2, 2) and ids_BTLK.dtype == torch.uint8
    assert valid_BT.tolist() == [[True] * 4 + [False] * 2, [True] * 2 + [False] * 4]
    assert torch.equal(ids_BTLK[0, :4].long(), a) and torch.equal(ids_BTLK[1, :2].long(), b)
    assert int(ids_BTLK[~valid_BT].long().abs().sum()) == 0
    ids16, _ = batch_traces([RoutingTrace(make_ids(3, E=500), 500)], T=4)
    assert ids16.dtype == torch.uint16


def test_batch_traces_errors():
    t4 = RoutingTrace(make_ids(4), 8)
    with pytest.raises(RouteError, match="sample 1: routes have 4 rows, more than the batch length 3"):
        batch_traces([RoutingTrace(make_ids(2), 8), t4], T=3)
    with pytest.raises(RouteError, match=r"sample 0: routes have 4 rows, expected 5 = sequence length 6 - 1"):
        batch_traces([t4], T=8, seq_lens=[6])
    with pytest.raises(RouteError, match="sample 1: trace starts at position 3"):
        batch_traces([t4, RoutingTrace(make_ids(2), 8, start=3)], T=8)
    with pytest.raises(RouteError, match="sample 1: routes have num_layers=3, sample 0 has 2"):
        batch_traces([t4, RoutingTrace(make_ids(2, L=3), 8)], T=8)
    with pytest.raises(RouteError, match="at least one"):
        batch_traces([], T=8)
    with pytest.raises(RouteError, match="2 seq_lens for 1 traces"):
        batch_traces([t4], T=8, seq_lens=[5, 5])
    with pytest.raises(RouteError, match="sample 0: expected a RoutingTrace, got Tensor"):
        batch_traces([make_ids(2)], T=8)


@pytest.mark.parametrize("E", [8, 1000])
def test_save_load_roundtrip_compact_on_disk(tmp_path, E):
    traces = [RoutingTrace(make_ids(n, L=3, K=4, E=E, seed=n), E, start=s)
              for n, s in [(50, 0), (0, 0), (7, 12)]]
    path = tmp_path / "routes.safetensors"
    save_traces(path, traces, metadata={"step": "3"})
    loaded, meta = load_traces(path)
    assert loaded == traces and meta == {"step": "3"}
    assert loaded[0].ids_NLK.dtype == compact_dtype(E)
    # no int64 blowup: the file is about rows*L*K*itemsize plus a small header
    payload = 57 * 3 * 4 * compact_dtype(E).itemsize
    assert path.stat().st_size < payload + 1024


def test_save_load_errors(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(RouteError, match="metadata must map str to str"):
        save_traces(tmp_path / "x.safetensors", [RoutingTrace(make_ids(2), 8)], metadata={"a": 1})
    with pytest.raises(RouteError, match="at least one"):
        save_traces(tmp_path / "x.safetensors", [])
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(RouteError, match="not a routing-trace file"):
        load_traces(foreign)
    # a corrupted file (an id out of range) is caught with the sample named
    good = tmp_path / "good.safetensors"
    save_traces(good, [RoutingTrace(make_ids(2), 8), RoutingTrace(make_ids(3), 8)])
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(good), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(good))
    tensors["ids"][3, 1, 0] = 9
    save_file(tensors, str(good), metadata=meta)
    with pytest.raises(RouteError, match=r"sample 1: routes row 1 \(position\), layer 1, slot 0: expert id 9"):
        load_traces(good)
    tensors["ids"][3, 1, 0] = 0
    tensors["offsets"][1] = 9
    save_file(tensors, str(good), metadata=meta)
    with pytest.raises(RouteError, match="offsets/starts do not describe 2 traces over 5 rows"):
        load_traces(good)
