"""Issue 22, weight pushes that used to kill or corrupt `lockstep serve`: a distributed push whose
declared shapes or dtypes do not match the broadcast (plain and flattened_bucket), values that
overflow the engine's dtype, fp8 tensors. Real servers on loopback, a real gloo group with the
trainer's side in this process."""

import base64
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from lockstep.cluster.ports import free_port
from lockstep.moe.checkpoint import hf_state_dict, save_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.server import ServerThread
from lockstep.rollout.weight_group import WeightGroup

from model_fixtures import tiny_config
from server_fixtures import call

CFG = tiny_config(max_position_embeddings=64, mlp_only_layers=[0])
NAME = "model.embed_tokens.weight"


def _model(seed=0):
    torch.manual_seed(seed)
    return MoEModel(CFG)


def _join(url, timeout=20):
    """Join the server's default group as rank 0 of 2; returns our WeightGroup."""
    port, out = free_port(), {}
    t = threading.Thread(target=lambda: out.update(r=call(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "backend": "gloo"}, timeout=60)))
    t.start()
    group = WeightGroup("127.0.0.1", port, 0, 2, "weight_update_group", "gloo", timeout)
    t.join(60)
    assert out["r"][0] == 200, out
    return group


def _begin(url):
    """Open a weight-update session (SGLang's rule: pushes only inside one); one already open
    is fine."""
    status, out = call(url, "/begin_weight_update", {})
    assert status == 200 or "already open" in out["message"], out


def _end(url):
    assert call(url, "/end_weight_update", {})[0] == 200


def _push(url, group, body, sent):
    """POST the push inside a session and broadcast `sent`."""
    _begin(url)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=call(
        url, "/update_weights_from_distributed", body, timeout=60)))
    t.start()
    if sent is not None:
        try:
            group.broadcast(sent)
        except RuntimeError:  # the server left the group without receiving
            pass
    t.join(60)
    _end(url)
    return out["r"]


def _tensor_push(url, tensors, version):
    _begin(url)
    try:
        return call(url, "/update_weights_from_tensor", _tensor_body(tensors, version))
    finally:
        _end(url)


def _greedy(url):
    status, out = call(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}, timeout=30)
    assert status == 200, out
    return out["output_ids"], out["meta_info"]["weight_version"]


def test_mismatched_broadcasts_never_kill_the_server(tmp_path):
    """Before: a declared shape smaller than the broadcast made gloo abort `lockstep serve`
    (EnforceNotMet); a shorter broadcast was loaded with whatever the buffer held."""
    folder = save_hf(_model(0), tmp_path / "hf")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.launch.serve", "--model", str(folder),
                             "--dtype", "fp32", "--port", str(port), "--threads", "1",
                             "--max-len", "48"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if call(url, "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
                threading.Event().wait(0.1)
        before = _greedy(url)
        t = hf_state_dict(_model(1))[NAME].detach().clone()  # (40, 32) fp32
        flat = t.reshape(-1).view(torch.uint8)
        meta = {"names": [NAME], "dtypes": ["float32"], "shapes": [list(t.shape)]}
        cases = [  # (declared fields, bytes the trainer broadcasts, message)
            ({"shapes": [[40, 16]]}, t, "has shape (40, 16), the model's is (40, 32)"),
            ({"shapes": [[40, 16]], "load_format": "flattened_bucket"}, flat,
             "has shape (40, 16), the model's is (40, 32)"),
            ({"dtypes": ["float16"]}, t, "broadcast more than the 2560 bytes"),
            ({"load_format": "flattened_bucket"}, torch.cat([flat, flat]), "broadcast more than"),
            ({}, t.reshape(-1)[:-8].contiguous(), "broadcast fewer bytes"),
            ({"load_format": "flattened_bucket"}, flat[:-3].contiguous(), "broadcast fewer bytes"),
        ]
        for fields, sent, msg in cases:
            group = _join(url)
            status, out = _push(url, group, {**meta, **fields, "weight_version": "bad"}, sent)
            group.close()
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert status == 400 and msg in out["message"], (fields, out)
            assert _greedy(url) == before, fields
            # the group is gone (or still usable): a new join always works
            if "destroyed" not in out["message"]:
                call(url, "/destroy_weights_update_group", {})
        group = _join(url)  # and a good push lands
        status, out = _push(url, group, {**meta, "weight_version": "good"}, t)
        group.close()
        assert status == 200 and out["success"], out
        assert _greedy(url)[1] == "good"
    finally:
        proc.terminate()
        proc.wait(30)


def _tensor_body(tensors, version):
    raw = base64.b64encode(save_safetensors(tensors)).decode()
    return {"serialized_named_tensors": [raw], "load_format": "safetensors",
            "weight_version": version}


def test_overflow_in_the_engine_dtype_is_refused(tmp_path):
    """Before: 1e39 (finite in float64) passed the check made before the cast to the bf16
    engine and the server then served NaN (disk) or answered 500 (tensor, distributed)."""
    model = _model(0)
    sd = {k: v.detach().clone() for k, v in hf_state_dict(_model(1)).items()}
    big = sd["model.norm.weight"].to(torch.float64)
    big[0] = 1e39
    save_hf(_model(1), tmp_path / "w")
    save_file({**sd, "model.norm.weight": big}, tmp_path / "w" / "model.safetensors")
    with ServerThread(Engine.from_model(model, EngineConfig(dtype="bf16", max_running=4,
                                                            max_len=48))) as srv:
        before = _greedy(srv.url)
        msg = "tensor model.norm.weight overflows the model's bfloat16: |values| up to 1e+39"
        status, out = call(srv.url, "/update_weights_from_disk",
                           {"model_path": str(tmp_path / "w"), "weight_version": "x"})
        assert status == 400 and msg in out["message"], out
        status, out = _tensor_push(srv.url, {"model.norm.weight": big}, "x")
        assert status == 400 and "'model.norm.weight' overflows the model's bfloat16" \
            in out["message"], out
        group = _join(srv.url)
        status, out = _push(srv.url, group, {"names": ["model.norm.weight"],
                                             "dtypes": ["float64"], "shapes": [[32]]}, big)
        group.close()
        assert status == 400 and "'model.norm.weight' overflows" in out["message"], out
        assert _greedy(srv.url) == before


def test_fp8_weights_are_cast_like_any_other(tmp_path):
    """Before: `isfinite` is not implemented for float8_e4m3fn: HTTP 500 or a traceback.
    pushed fp8 tensors are cast; a folder of fp8 tensors without their block scales
    (`weight_scale_inv`, DeepSeek-V3's layout) is refused by name, the weights kept."""
    sd = {k: v.detach().clone() for k, v in hf_state_dict(_model(1)).items()}
    fp8 = {k: v.to(torch.float8_e4m3fn) for k, v in sd.items()}
    save_hf(_model(1), tmp_path / "w")
    save_file(fp8, tmp_path / "w" / "model.safetensors")
    want = Engine.from_model(_model(0), EngineConfig(dtype="fp32", max_len=48))
    want.update_weights({**{k: v.detach().float() for k, v in hf_state_dict(_model(0)).items()},
                         **{k: fp8[k].float() for k in (NAME, "model.norm.weight")}})
    with ServerThread(Engine.from_model(_model(0), EngineConfig(dtype="fp32", max_running=4,
                                                                max_len=48))) as srv:
        status, out = call(srv.url, "/update_weights_from_disk",
                           {"model_path": str(tmp_path / "w"), "weight_version": "d"})
        assert status == 400 and "weight_scale_inv" in out["message"], out
        status, out = _tensor_push(srv.url, {NAME: fp8[NAME]}, "t")
        assert status == 200 and out["success"], out
        group = _join(srv.url)
        x = fp8["model.norm.weight"].view(torch.uint8)  # gloo broadcasts no fp8: its bytes
        status, out = _push(srv.url, group, {"names": ["model.norm.weight"], "weight_version": "g",
                                             "dtypes": ["float8_e4m3fn"], "shapes": [[32]]}, x)
        group.close()
        assert status == 200 and out["success"], out
        from lockstep.rollout.weight_receiver import RECEIVER
        got = srv.app[RECEIVER].engine.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.model.state_dict().items())
        assert _greedy(srv.url)[1] == "g"


@pytest.mark.parametrize("dtype", ["int32", "complex64", "bool"])
def test_non_floating_pushes_are_refused_by_name(dtype):
    with ServerThread(Engine.from_model(_model(0), EngineConfig(dtype="fp32", max_len=48))) as srv:
        status, out = _tensor_push(srv.url, {"model.norm.weight": torch.ones(32).to(
            getattr(torch, dtype))}, "x")
        assert status == 400 and "model.norm.weight" in out["message"], out
