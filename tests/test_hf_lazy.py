"""LazyHF (moe/hf_lazy.py): a lazy, validated view of an HF folder, read one tensor (or one TP
chunk, or one stacked expert) at a time; the same reader behind read_hf_state_dict/load_hf."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lockstep.moe.checkpoint import hf_state_dict, load_hf, read_hf_state_dict, save_hf
from lockstep.moe.hf_lazy import CheckpointError
from lockstep.moe.hf_lazy import INDEX_FILE, LazyHF
from lockstep.moe.model import MoEModel

from model_fixtures import tiny_config


@pytest.fixture
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(mlp_only_layers=[1]))


def _nbytes(t):
    return t.numel() * t.element_size()


def fused_folder(model, out, shards=2):
    """`model` written in the stacked-expert layout some transformers versions save
    (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]), in `shards`
    files with an index: what LazyHF must show under per-expert names."""
    cfg = model.cfg
    sd = {k: v.detach().clone() for k, v in hf_state_dict(model).items() if ".experts." not in k}
    for i, layer in enumerate(model.layers):
        if layer.is_moe:
            p = f"model.layers.{i}.mlp.experts."
            sd[p + "gate_up_proj"] = layer.mlp.experts.gate_up_proj.detach().clone()
            sd[p + "down_proj"] = layer.mlp.experts.down_proj.detach().clone()
    out.mkdir(parents=True)
    cfg.save_json(out / "config.json")
    names = sorted(sd)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for j, part in enumerate(parts):
        file = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in part}, out / file)
        weight_map.update({k: file for k in part})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_lazy_reads_one_tensor_at_a_time_and_counts_bytes(model, tmp_path):
    save_hf(model, tmp_path / "ck", max_shard_bytes=20_000)  # sharded, with an index
    assert (tmp_path / "ck" / INDEX_FILE).exists()
    want = hf_state_dict(model)
    hf = LazyHF(tmp_path / "ck")
    assert set(hf) == set(want) and len(hf) == len(want)
    assert hf.bytes_read == 0  # opening reads headers only
    k = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert torch.equal(hf[k], want[k]) and hf.bytes_read == _nbytes(want[k])
    assert hf.shape(k) == want[k].shape and hf.bytes_read == _nbytes(want[k])
    # a TP chunk reads only its rows / columns
    hf.bytes_read = 0
    e = hf.part("model.embed_tokens.weight", dim=0, n=2, r=1)
    assert torch.equal(e, want["model.embed_tokens.weight"].chunk(2, 0)[1])
    o = hf.part("model.layers.0.self_attn.o_proj.weight", dim=1, n=2, r=0)
    assert torch.equal(o, want["model.layers.0.self_attn.o_proj.weight"].chunk(2, 1)[0])
    assert hf.bytes_read == _nbytes(e) + _nbytes(o)
    # the whole-folder reader is the same reader
    sd = read_hf_state_dict(tmp_path / "ck")
    assert set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        hf["nope"]


def test_lazy_casts_floating_tensors(model, tmp_path):
    save_hf(model, tmp_path / "bf16", dtype=torch.bfloat16)
    k = "model.layers.0.self_attn.q_proj.weight"
    assert LazyHF(tmp_path / "bf16")[k].dtype == torch.float32
    assert LazyHF(tmp_path / "bf16", dtype=None)[k].dtype == torch.bfloat16
    assert torch.equal(LazyHF(tmp_path / "bf16")[k],
                       hf_state_dict(model)[k].to(torch.bfloat16).float())


def test_stacked_experts_show_per_expert_and_read_one_expert(model, tmp_path):
    fused_folder(model, tmp_path / "fused")
    want = hf_state_dict(model)
    hf = LazyHF(tmp_path / "fused")
    assert set(hf) == set(want)
    for k in want:
        assert torch.equal(hf[k], want[k]), k
    hf.bytes_read = 0
    k = "model.layers.2.mlp.experts.5.up_proj.weight"
    assert torch.equal(hf[k], want[k]) and hf.bytes_read == _nbytes(want[k])  # not [E, 2I, D]
    # a TP / ETP chunk of one stacked expert
    for kind, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        k = f"model.layers.0.mlp.experts.4.{kind}.weight"
        assert torch.equal(hf.part(k, dim=dim, n=2, r=1), want[k].chunk(2, dim)[1]), k
    # load_hf streams from the same reader
    loaded = load_hf(tmp_path / "fused")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 model.state_dict().values()))


def test_lazy_names_what_is_wrong(model, tmp_path):
    save_hf(model, tmp_path / "ck", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "ck" / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.9.mlp.gate.weight"] = "model-00001-of-00008.safetensors"
    (tmp_path / "ck" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.layers\.9\.mlp\.gate\.weight"):
        LazyHF(tmp_path / "ck")
    save_hf(model, tmp_path / "trunc")
    f = tmp_path / "trunc" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match=f"{f}.*truncated or damaged"):
        hf = LazyHF(tmp_path / "trunc")
        for k in hf:
            hf[k]
    with pytest.raises(CheckpointError, match="is not a directory"):
        LazyHF(tmp_path / "missing")
