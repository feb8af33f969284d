"""Block-FP8 HF folders (DeepSeek-V3's layout): written by save_hf(fp8=True), read back
dequantised by LazyHF / load_hf, refused by name when malformed."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lockstep.kernels.fp8 import dequantize_weight, quantize_weight
from lockstep.moe.checkpoint import FP8_WEIGHTS, hf_state_dict, load_hf, save_hf
from lockstep.moe.config import ModelConfig
from lockstep.moe.hf_lazy import CheckpointError, LazyHF
from lockstep.moe.model import MoEModel

from arch_fixtures import COMMON, HF_FAMILIES
from model_fixtures import tiny_config


def _deepseek(seed=0):
    torch.manual_seed(seed)
    kw = {**COMMON, **HF_FAMILIES["deepseek_v3"][2], "model_type": "deepseek_v3"}
    return MoEModel(ModelConfig.from_hf_dict(kw))


@pytest.mark.parametrize("make", [lambda: MoEModel(tiny_config(mlp_only_layers=[0])),
                                  _deepseek,
                                  lambda: MoEModel(tiny_config(model_type="mixtral",
                                                               intermediate_size=16))],
                         ids=["qwen3_moe", "deepseek_v3", "mixtral"])
def test_fp8_names_are_the_matmuls_the_model_quantises(make):
    model = make().set_precision(torch.float32, fp8=True)
    quantised = {p.untyped_storage().data_ptr() for m in model.modules()
                 if getattr(m, "fp8", False) and m is not model
                 for p in m.parameters() if p.dim() >= 2}
    for name, t in hf_state_dict(model).items():
        assert bool(FP8_WEIGHTS.search(name)) == (t.untyped_storage().data_ptr() in quantised), \
            name


def test_deepseek_layout_round_trip(tmp_path):
    model = _deepseek()
    folder = save_hf(model, tmp_path / "fp8", fp8=True)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}
    stored = load_file(folder / "model.safetensors")
    p = "model.layers.1."
    for name in (p + "self_attn.kv_a_proj_with_mqa.weight", p + "mlp.experts.3.down_proj.weight",
                 p + "mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        assert stored[name].dtype == torch.float8_e4m3fn, name
        assert stored[name + "_scale_inv"].dtype == torch.float32
        assert stored[name + "_scale_inv"].shape == (1, 1)  # tiny: one partial block
    assert stored[p + "mlp.gate.weight"].dtype == torch.bfloat16           # the router
    assert stored[p + "mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    # read back dequantised, in fp32: FP8 weights are q * scale, the rest bf16 values
    back = load_hf(folder)
    want, got = hf_state_dict(model), hf_state_dict(back)
    for name, w in want.items():
        if FP8_WEIGHTS.search(name):
            assert torch.equal(got[name], dequantize_weight(*quantize_weight(w))), name
        else:
            assert torch.equal(got[name], w.to(torch.bfloat16).float()), name
    assert not any(k.endswith("_scale_inv") for k in LazyHF(folder))
    # exported again: the same FP8 bytes (re-quantising dequantised weights is exact here)
    again = load_file(save_hf(back, tmp_path / "again", fp8=True) / "model.safetensors")
    assert all(torch.equal(again[k].float(), v.float()) for k, v in stored.items())


def test_malformed_fp8_folders_are_refused_by_name(tmp_path):
    folder = save_hf(MoEModel(tiny_config()), tmp_path / "f", fp8=True)
    sd = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    scale = sd.pop(name + "_scale_inv")
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"float8 tensor '{name}' has no "
                                              f"'{name}_scale_inv'"):
        LazyHF(folder)
    sd[name + "_scale_inv"] = torch.ones(2, 1)
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"_scale_inv has shape \(2, 1\).* needs \(1, 1\)"):
        load_hf(folder)
    sd[name + "_scale_inv"] = scale
    save_file(sd, folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"only block FP8 \(quant_method fp8\) is read"):
        load_hf(folder)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}  # per-tensor
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="weight_block_size = None: expected two"):
        load_hf(folder)


def test_tp_parts_of_an_fp8_weight_are_slices_of_the_dequantised_one(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(260, 136)
    q, s = quantize_weight(w)
    save_file({"x.weight": q, "x.weight_scale_inv": s}, tmp_path / "model.safetensors")
    hf = LazyHF(tmp_path)
    full = dequantize_weight(q, s)
    assert torch.equal(hf["x.weight"], full)
    assert torch.equal(hf.part("x.weight", dim=0, n=2, r=1), full[130:])
    assert torch.equal(hf.part("x.weight", dim=1, n=2, r=0), full[:, :68])
    assert hf.nbytes("x.weight") == 260 * 136 + 4 * 3 * 2
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_slice("x.weight").get_dtype() == "F8_E4M3"


def test_export_command_writes_fp8_and_refuses_by_name(tmp_path, capsys):
    from lockstep.launch.cli import main

    src = save_hf(MoEModel(tiny_config()), tmp_path / "src")
    (src / "tokenizer.json").write_text("{}")
    assert main(["export", str(src), "--out", str(tmp_path / "fp8"), "--dtype", "fp8"]) == 0
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    assert stored["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert (tmp_path / "fp8" / "tokenizer.json").read_text() == "{}"
    assert main(["export", str(tmp_path / "fp8"), "--out", str(tmp_path / "b"),
                 "--dtype", "bf16"]) == 0
    assert load_file(tmp_path / "b" / "model.safetensors")[
        "model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    capsys.readouterr()
    assert main(["export", str(src), "--out", str(tmp_path / "fp8"), "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err.strip().endswith("exists; export writes a new folder")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "c"), "--dtype", "fp8"]) == 2
    assert "is not an HF folder (no config.json)" in capsys.readouterr().err
    (tmp_path / "ck" / "hf").mkdir(parents=True)  # a run's checkpoint: the folder is hf/
    (tmp_path / "ck" / "hf" / "config.json").write_text((src / "config.json").read_text())
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "c"),
                 "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"keeps it in {tmp_path / 'ck' / 'hf'}")


@pytest.mark.slow
def test_train_on_an_fp8_folder_and_export_it_back(tmp_path):
    """An FP8 folder written by our code is model.path of a run (fp8 engine, fp8 actor); the
    run's checkpoint exports back to block FP8, which an fp8 engine serves."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from lockstep.moe.tokenizer import load_tokenizer
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.tasks import Task
    from lockstep.rollout.types import GenerateRequest, SamplingParams
    from lockstep.trainer.config.load import load_config

    toy = Path(__file__).resolve().parents[1] / "configs" / "toy_r3.yaml"
    cfg = load_config(toy)
    torch.manual_seed(0)
    src = save_hf(MoEModel(cfg.model), tmp_path / "src", fp8=True,
                  tokenizer=Task(cfg.task).tokenizer)

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "lockstep.launch.cli", *args],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        return r
    # an untrained policy earns no reward (no advantage): the entropy bonus moves it
    sets = [f"model.path={src}", "warmstart.enabled=false", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "actor.mini_batch_size=4", "loss.entropy_coef=0.01",
            "actor.micro_batch_size=4", "loop.steps=1", "loop.checkpoint_every=1",
            "loop.plots=false", "loop.tensorboard=false", "rollout.dtype=fp8", "actor.fp8=true"]
    cli("train", str(toy), "--out", str(tmp_path / "run"), "--no-progress",
        *[a for s in sets for a in ("--set", s)])
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for k in ("routing/flip_rate", "rollout_corr/k3_kl", "replay/mismatch",
              "is_split/mismatch_mean"):
        assert k in row, k
    assert row["replay/mismatch"] == 0.0  # R3 ran the fp8 engine's routes
    ckpt = tmp_path / "run" / "checkpoints" / "step_1" / "hf"
    trained = load_hf(ckpt)
    assert any(not torch.equal(a, b) for a, b in
               zip(trained.parameters(), load_hf(src).parameters()))
    cli("export", str(ckpt), "--out", str(tmp_path / "out"), "--dtype", "fp8")
    stored = load_file(tmp_path / "out" / "model.safetensors")
    name = "model.layers.2.mlp.experts.1.up_proj.weight"
    assert stored[name].dtype == torch.float8_e4m3fn
    assert torch.equal(stored[name].float(), quantize_weight(
        hf_state_dict(trained)[name])[0].float())
    assert load_tokenizer(tmp_path / "out").get_vocab_size() == 16
    eng = Engine.from_hf(tmp_path / "out", EngineConfig(dtype="fp8", max_running=4, max_len=32))
    res = eng.generate([GenerateRequest([1, 3, 4, 12], SamplingParams(max_new_tokens=3))])
    assert len(res[0].output_ids) >= 1 and res[0].routes_NLK.shape[1:] == (3, 2)
