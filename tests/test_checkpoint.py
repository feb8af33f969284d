"""HF checkpoint folders: config, sharding, tokenizer, loading errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lockstep.moe.checkpoint import hf_state_dict, load_hf, read_hf_state_dict, save_hf
from lockstep.moe.checks import ConfigError
from lockstep.moe.config import ModelConfig
from lockstep.moe.hf_lazy import CheckpointError
from lockstep.moe.model import MoEModel
from lockstep.moe.tokenizer import build_char_tokenizer, load_tokenizer

from model_fixtures import tiny_config


def test_config_roundtrip_and_both_spellings(tmp_path):
    cfg = tiny_config(mlp_only_layers=[0], rope_theta=5e5)
    cfg.save_json(tmp_path / "config.json")
    assert ModelConfig.from_json(tmp_path) == cfg
    d = json.loads((tmp_path / "config.json").read_text())
    # transformers-5 spelling only.
    d.pop("num_experts")
    d.pop("rope_theta")
    assert ModelConfig.from_hf_dict(d) == cfg
    # released spelling only.
    d = cfg.to_hf_dict()
    d.pop("num_local_experts")
    d.pop("rope_parameters")
    assert ModelConfig.from_hf_dict(d) == cfg


def test_config_errors_list_valid_keys():
    d = tiny_config().to_hf_dict()
    with pytest.raises(ConfigError, match=r"unknown config keys \['num_expert'\].*valid keys"):
        ModelConfig.from_hf_dict({**d, "num_expert": 3})
    with pytest.raises(ConfigError, match="inconsistent config: num_experts=6 but "
                                          "num_local_experts=8"):
        ModelConfig.from_hf_dict({**d, "num_local_experts": 8})
    with pytest.raises(ConfigError, match="num_experts_per_tok must be in"):
        tiny_config(num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="multiple of"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        tiny_config(mlp_only_layers=[7])
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        ModelConfig.from_hf_dict({**d, "model_type": "llama"})


def test_sharded_save_roundtrips(tmp_path):
    torch.manual_seed(0)
    model = MoEModel(tiny_config(mlp_only_layers=[1]))
    save_hf(model, tmp_path / "ck", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    loaded = load_hf(tmp_path / "ck")
    for k, v in hf_state_dict(model).items():
        assert torch.equal(v, hf_state_dict(loaded)[k]), k


def test_loading_names_every_problem(tmp_path):
    model = MoEModel(tiny_config())
    save_hf(model, tmp_path / "ck")
    sd = read_hf_state_dict(tmp_path / "ck")
    sd.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    sd["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(2)
    sd["model.norm.weight"] = torch.ones(5)
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "ck" / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_hf(tmp_path / "ck")
    msg = str(e.value)
    assert "missing tensors (1): ['model.layers.1.mlp.experts.3.up_proj.weight']" in msg
    assert "unexpected tensors (1): ['model.layers.0.mlp.shared_expert.weight']" in msg
    assert "model.norm.weight: checkpoint (5,) vs model (32,)" in msg


def test_transformers_written_folder_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = tiny_config(mlp_only_layers=[0])
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                            if k not in ("architectures", "model_type",
                                                         "num_local_experts")})
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        assert (ours(ids).logits_BTV - hf(ids).logits).abs().max() < 1e-5


def test_tokenizer_is_loadable_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = build_char_tokenizer("0123456789+=")
    save_hf(MoEModel(tiny_config()), tmp_path / "ck", tokenizer=tok)
    ours = load_tokenizer(tmp_path / "ck")
    assert ours.encode("07+45=").ids == [3, 10, 13, 7, 8, 14]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "ck")
    assert theirs("07+45=", add_special_tokens=False)["input_ids"] == [3, 10, 13, 7, 8, 14]
    assert theirs.decode([3, 10, 13, 7, 8, 14, 2], skip_special_tokens=True) == "07+45="
    assert theirs.eos_token == "<eos>" and theirs.eos_token_id == 2


def test_killed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    model = MoEModel(tiny_config())
    save_hf(model, tmp_path / "ck")
    import lockstep.moe.checkpoint as ck

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError):
        save_hf(model, tmp_path / "ck")
    assert load_hf(tmp_path / "ck") is not None
