"""Rollout dumps: a record of real engine + actor outputs round-trips, and every kind of
corruption (wrong lengths, ids out of range, missing fields, truncated file) is an error
naming the sample and field."""

import pytest
import torch
from safetensors.torch import save_file

from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.observe.dump import (FORMAT, HEADER_KEY, VERSION, DumpError, StepRecord,
                                   model_header, read_dump, record_step, write_dump)

from model_fixtures import tiny_config

import json


@pytest.fixture(scope="module")
def record():
    torch.manual_seed(0)
    cfg = tiny_config(max_position_embeddings=32, mlp_only_layers=[0])
    model = MoEModel(cfg)
    engine = Engine.from_model(model, EngineConfig(dtype="bf16", max_running=8, max_len=24))
    reqs = [GenerateRequest([1, 5 + i, 7, 9], SamplingParams(max_new_tokens=6, n=2, seed=10 * i))
            for i in range(3)]
    res = engine.generate(reqs)
    batch = collate(res, 0, cfg.num_experts, cfg.num_moe_layers, cfg.num_experts_per_tok)
    header = {"format": FORMAT, "version": VERSION, "step": 3, "weight_version": "2",
              "replay_mode": "off", "model": model_header(cfg), "task": None,
              "engine": {"dtype": "bf16"}, "actor": {"dtype": "fp32"}, "correction": {},
              "source": "test"}
    return record_step(TorchActor(model, ActorConfig(mini_batch_size=6, micro_batch_size=6), 1), batch,
                       torch.arange(6.0), header)


def _write_raw(path, rec: StepRecord, header=None):
    meta = {HEADER_KEY: json.dumps(rec.header if header is None else header)}
    save_file({k: v.clone() for k, v in rec.tensors.items()}, str(path), metadata=meta)
    return path


def _edit(rec, **tensors):
    t = {k: v.clone() for k, v in rec.tensors.items()}
    for k, v in tensors.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    return StepRecord(dict(rec.header), t)


def test_round_trip(record, tmp_path):
    path = write_dump(tmp_path / "dumps" / "step_3.safetensors", record)
    back = read_dump(path)
    assert back.header == record.header
    assert set(back.tensors) == set(record.tensors)
    for k, v in record.tensors.items():
        assert torch.equal(back.tensors[k], v), k
    assert json.loads(path.with_suffix(".json").read_text())["step"] == 3
    # the record is what the actor saw: R0 natural == pi_old under replay off
    assert torch.equal(record.old_logprobs, record.natural_logprobs)
    assert (record.router_margin >= 0).all()


@pytest.mark.parametrize("change, sample, field", [
    (lambda r: _edit(r, input_ids=_set(r.input_ids, (2, 3), 99)), 2, "input_ids"),
    (lambda r: _edit(r, seq_lens=_set(r.seq_lens, (4,), r.input_ids.shape[1] + 1)), 4, "seq_lens"),
    (lambda r: _edit(r, rollout_routes_valid=_set(r.rollout_routes_valid, (1, 2), False)), 1,
     "rollout_routes_valid"),
    (lambda r: _edit(r, rollout_routes=_set(r.rollout_routes, (5, 1, 0, 0), 6)), 5,
     "rollout_routes"),
    (lambda r: _edit(r, actor_routes=_dup(r.actor_routes, 3)), 3, "actor_routes"),
    (lambda r: _edit(r, rollout_logprobs=_set(r.rollout_logprobs, (0, int(r.prompt_lens[0])),
                                              float("nan"))), 0, "rollout_logprobs"),
    (lambda r: _edit(r, prompt_lens=_set(r.prompt_lens, (2,), 0)), 2, "prompt_lens"),
])
def test_inconsistent_dumps_name_sample_and_field(record, tmp_path, change, sample, field):
    path = _write_raw(tmp_path / "bad.safetensors", change(record))
    with pytest.raises(DumpError, match=f"sample {sample}, field '{field}'"):
        read_dump(path)


def _set(t, idx, v):
    t = t.clone()
    t[idx] = v
    return t


def _dup(routes, b):
    routes = routes.clone()
    routes[b, 0, 0, 1] = routes[b, 0, 0, 0]
    return routes


def test_missing_field_and_wrong_shape(record, tmp_path):
    with pytest.raises(DumpError, match="missing field 'old_logprobs'"):
        read_dump(_write_raw(tmp_path / "a.safetensors", _edit(record, old_logprobs=None)))
    short = record.router_margin[:, :, :1].clone()
    with pytest.raises(DumpError, match="field 'router_margin' has shape"):
        read_dump(_write_raw(tmp_path / "b.safetensors", _edit(record, router_margin=short)))
    header = {k: v for k, v in record.header.items() if k != "weight_version"}
    with pytest.raises(DumpError, match="missing header field 'weight_version'"):
        read_dump(_write_raw(tmp_path / "c.safetensors", record, header))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "d.safetensors"))
    with pytest.raises(DumpError, match="not a lockstep dump"):
        read_dump(tmp_path / "d.safetensors")


def test_truncated_file(record, tmp_path):
    path = write_dump(tmp_path / "t.safetensors", record)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(DumpError, match="truncated or corrupt"):
        read_dump(path)
    with pytest.raises(DumpError, match="no such dump file"):
        read_dump(tmp_path / "absent.safetensors")
