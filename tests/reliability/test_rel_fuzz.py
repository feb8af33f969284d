"""Class 7/8 fuzzing (hypothesis): the config loader (YAML text and --set overrides), the
checkpoint loader (corrupted folders, hostile state trees) and the route codecs. Any input
gives a valid result or the library's own error type with a message, never another exception.
Example counts keep the whole file under ~30 s."""

import base64
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.replay.codec import (decode_compact, decode_routes, decode_sglang,  # noqa: E402
                                   encode_routes)
from lockstep.moe.hf_lazy import CheckpointError
from lockstep.replay.trace import RouteError, RoutingTrace  # noqa: E402
from lockstep.trainer.state.checkpoint import (load_checkpoint, load_tree, LoopState,
                                               save_checkpoint, save_tree)
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError

from model_fixtures import tiny_config  # noqa: E402
from rundir_fixtures import TOY  # noqa: E402

pytestmark = pytest.mark.reliability
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
BASE = yaml.safe_load(TOY.read_text())
SECTIONS = sorted(BASE)
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
           | st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=6) | st.integers(), c, max_size=3),
                      max_leaves=8)


def _load_text(text: str, overrides=()):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(text)
        try:
            cfg = load_config(p, list(overrides))
        except ExperimentConfigError as e:
            assert str(e).strip()
            return None
    assert isinstance(cfg, ExperimentConfig)
    return cfg


@FUZZ
@given(st.text(max_size=200))
def test_config_loader_any_text(text):
    _load_text(text)


@FUZZ
@given(st.text(alphabet=" \n\t:-[]{}#&*!|>'\"%@`,?=.0123456789abcelnorstuy_", max_size=120))
def test_config_loader_yaml_like_text(text):
    _load_text(text)


@FUZZ
@given(st.sampled_from(SECTIONS), st.text(max_size=20) | st.sampled_from(
    sorted({k for s in BASE.values() if isinstance(s, dict) for k in s})), values)
def test_config_loader_mutated_sections(section, key, value):
    data = json.loads(json.dumps(BASE))
    if isinstance(data[section], dict):
        data[section][key] = value
    else:
        data[section] = value
    try:
        text = yaml.safe_dump(data)
    except yaml.YAMLError:
        return
    _load_text(text)


keys = st.sampled_from(["actor.lr", "loop.steps", "rollout.top_k", "replay.mode", "model",
                        "actor.megatron.tensor_parallel", "actor.betas", "rollout.api_key",
                        "correction.rollout_is", "task.digits", "warmstart", "loop", ".", "a..b",
                        "loop.steps.x"]) | st.text(max_size=15)


@FUZZ
@given(st.lists(st.tuples(keys, st.text(max_size=15)), max_size=3))
def test_config_overrides(pairs):
    _load_text(TOY.read_text(), [f"{k}={v}" for k, v in pairs])


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("ck")
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    return save_checkpoint(run, MoEModel(tiny_config()), {"optimizer": opt.state_dict()},
                           LoopState(1, 4, "h", "1"))


edits = st.lists(st.tuples(st.sampled_from(["flip", "truncate", "delete", "garbage", "json"]),
                           st.integers(0, 10**9), st.binary(max_size=40) | st.just(b"")),
                 min_size=1, max_size=3)


@FUZZ
@given(edits)
def test_checkpoint_loader_corrupted_folders(good_checkpoint, ops):
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d) / "step_1"
        shutil.copytree(good_checkpoint, folder)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        before = {p: p.read_bytes() for p in files}
        for op, n, blob in ops:
            f = files[n % len(files)]
            if not f.exists():
                continue
            data = f.read_bytes()
            if op == "flip" and data:
                i = n % len(data)
                f.write_bytes(data[:i] + bytes([data[i] ^ (1 + n % 255)]) + data[i + 1:])
            elif op == "truncate":
                f.write_bytes(data[:n % (len(data) + 1)])
            elif op == "delete":
                f.unlink()
            elif op == "garbage":
                f.write_bytes(blob)
            else:
                f.write_text(json.dumps({"format": "x", "files": {"a": blob.hex()}}))
        changed = any(not p.exists() or p.read_bytes() != b for p, b in before.items())
        try:
            load_checkpoint(folder)
        except CheckpointError as e:
            assert str(e).strip()
        else:
            assert not changed, ops


json_trees = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(
        st.sampled_from(["__tensor__", "__ndarray__", "__dict__", "__tuple__", "__float__",
                         "dtype", "x"]), c, max_size=2), max_leaves=10)


@FUZZ
@given(json_trees)
def test_state_tree_loader_hostile_json(tree):
    with tempfile.TemporaryDirectory() as d:
        save_tree(Path(d) / "t", {"a": torch.zeros(2)})
        (Path(d) / "t.json").write_text(json.dumps({"format": "lockstep-state-tree/1",
                                                    "tree": tree}))
        try:
            load_tree(Path(d) / "t")
        except CheckpointError as e:
            assert str(e).strip()


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=60), st.integers(0, 12), st.integers(1, 5),
       st.integers(1, 4), st.integers(1, 300), st.integers(-2, 3))
def test_route_codecs_any_payload(payload, rows, layers, k, experts, start):
    if isinstance(payload, bytes) and len(payload) % 2:
        payload = base64.b64encode(payload).decode()
    moe = list(range(layers))
    for fn, args in ((decode_routes, (rows, layers, moe, k, experts)),
                     (decode_sglang, (rows, layers, moe, k, experts)),
                     (decode_compact, (rows, layers, k, experts))):
        try:
            out = fn(payload, *args, start_len=max(start, 0)) if start >= 0 else fn(payload, *args)
        except RouteError as e:
            assert str(e).strip()
        else:
            assert isinstance(out, RoutingTrace)


@FUZZ
@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.integers(2, 300),
       st.sampled_from(["int32", "compact"]), st.integers(0, 2**31))
def test_route_codecs_roundtrip(rows, layers, k, experts, enc, seed):
    k = min(k, experts)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows * layers)])
    trace = RoutingTrace(ids.view(rows, layers, k), experts)
    moe = list(range(layers))
    back = decode_routes(encode_routes(trace, enc, layers, moe), rows, layers, moe, k, experts)
    assert torch.equal(back.ids_NLK.long(), trace.ids_NLK.long())
