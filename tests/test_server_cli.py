"""Serving a folder written by transformers' save_pretrained: log-probs and routes checked
against transformers itself (an independent implementation); `lockstep serve` as a process."""

import socket
import subprocess
import sys

import pytest
import torch

from lockstep.launch.serve import main as serve_main
from lockstep.moe.config import ModelConfig
from lockstep.rollout.client import HTTPBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.server import ServerThread
from lockstep.rollout.types import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")


def _transformers_folder(tmp_path):
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
        num_experts=6, num_experts_per_tok=2, mlp_only_layers=[0], eos_token_id=2,
        max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf, ModelConfig.from_json(tmp_path / "hf")


def _check_against_transformers(http: HTTPBackend, hf) -> None:
    reqs = [GenerateRequest([5, 9, 1, 7][:p], SamplingParams(max_new_tokens=10, seed=p))
            for p in (4, 2, 3)]
    for r in http.generate(reqs):
        ids = torch.tensor(r.prompt_ids + r.output_ids)[None]
        with torch.no_grad():
            out = hf(ids, output_router_logits=True)
        P, R = r.prompt_tokens, r.completion_tokens
        lp = torch.log_softmax(out.logits[0].float(), -1)[P - 1:P + R - 1]
        want = lp.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert torch.allclose(r.output_logprobs, want, atol=1e-4)
        hf_routes = torch.stack([x.topk(2, dim=-1).indices for x in out.router_logits], 1)
        assert torch.equal(r.routes_NLK.long().sort(-1).values,
                           hf_routes[:P + R - 1].sort(-1).values)
    with pytest.raises(RolloutError, match="HTTP 400"):
        http.generate([GenerateRequest([41])])


def test_transformers_folder_served_matches_transformers(tmp_path):
    hf, cfg = _transformers_folder(tmp_path)
    engine = Engine.from_hf(tmp_path / "hf", EngineConfig(dtype="fp32", max_len=64))
    with ServerThread(engine, model_path=str(tmp_path / "hf")) as srv:
        _check_against_transformers(HTTPBackend(srv.url, cfg), hf)


@pytest.mark.slow
def test_serve_cli_process(tmp_path):
    hf, cfg = _transformers_folder(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.launch.serve", "--model",
                             str(tmp_path / "hf"), "--dtype", "fp32", "--port", str(port),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        http = HTTPBackend(f"http://127.0.0.1:{port}", cfg, retries=60, backoff_s=0.25)
        _check_against_transformers(http, hf)
        assert proc.poll() is None  # still serving
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_reports_unloadable_folder(tmp_path, capsys):
    assert serve_main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot load" in err and "config.json" in err


# -- user errors: one line `lockstep serve: ...`, no traceback (issue 12) ----------------------

def _one_line_error(capsys, argv, *want):
    rc = serve_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("lockstep serve: "), err
    for w in want:
        assert w in err[-1], err
    return err


def _tiny_folder(tmp_path):
    from lockstep.moe.checkpoint import save_hf
    from lockstep.moe.model import MoEModel
    from model_fixtures import tiny_config
    torch.manual_seed(0)
    return save_hf(MoEModel(tiny_config(max_position_embeddings=64)), tmp_path / "hf")


def test_serve_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_API_KEY", raising=False)
    folder = _tiny_folder(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "config.json").write_bytes((folder / "config.json").read_bytes())
    (tmp_path / "trunc" / "model.safetensors").write_bytes(data[:len(data) // 3])
    base = ["--port", "0", "--model"]
    _one_line_error(capsys, base + [str(folder), "--threads", "0"], "--threads must be a positive")
    _one_line_error(capsys, base + [str(folder), "--device", "gpu"], "--device gpu", "'cuda'")
    if not torch.cuda.is_available():
        _one_line_error(capsys, base + [str(folder), "--device", "cuda"], "--device cuda",
                        "no CUDA device")
    _one_line_error(capsys, base + [str(tmp_path / "missing")], "cannot load", "config.json")
    _one_line_error(capsys, base + [str(tmp_path / "trunc")],
                    str(tmp_path / "trunc" / "model.safetensors"), "truncated")
    _one_line_error(capsys, base + [str(folder), "--max-len", "65"],
                    "--max-len 65 exceeds the model's max_position_embeddings=64")
    (tmp_path / "key").write_text("\n")
    _one_line_error(capsys, base + [str(folder), "--api-key-file", str(tmp_path / "key")],
                    "is empty")
    with socket.socket() as s:  # a port in use, on a public address, with the key on argv
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        err = _one_line_error(capsys, ["--model", str(folder), "--host", "0.0.0.0", "--port",
                                       str(port)], f"cannot listen on 0.0.0.0:{port}")
        assert any("without an API key" in line for line in err), err
        err = _one_line_error(capsys, ["--model", str(folder), "--host", "0.0.0.0", "--port",
                                       str(port), "--api-key", "k"], "cannot listen")
        assert any("--api-key shows the key" in line for line in err), err
        assert not any("without an API key" in line for line in err), err


def test_api_key_from_environment_or_file(tmp_path, monkeypatch):
    import argparse

    from lockstep.launch.serve import _api_key
    ns = lambda **kw: argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})  # noqa: E731
    monkeypatch.setenv("LOCKSTEP_API_KEY", "from-env")
    assert _api_key(ns()) == "from-env"
    (tmp_path / "k").write_text("from-file\n")
    assert _api_key(ns(api_key_file=str(tmp_path / "k"))) == "from-file"
    monkeypatch.delenv("LOCKSTEP_API_KEY")
    assert _api_key(ns()) is None
