"""`lockstep diagnose` on the toy: a short real training run (toy config, warm start off, tiny
batch) writes checkpoints and dumps; the diagnoses of them must agree with each other and with
the run's own metrics, and the knobs must do what they claim."""

import html
import json
import math
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

from lockstep.launch import cli
from lockstep.launch.diagnose import diagnose_checkpoint, diagnose_dump, find_checkpoint
from lockstep.launch.diagnose_report import PLOTS, write_report
from lockstep.moe.checkpoint import load_hf
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.server import ServerThread
from lockstep.trainer.config.load import load_config
from lockstep.trainer.loop import Trainer

from test_train_e2e import CONFIGS

TINY = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=16", "actor.micro_batch_size=16", "loop.steps=2",
        "loop.checkpoint_every=1", "loop.dump_every=1", "loop.plots=false",
        "loop.tensorboard=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    cfg = load_config(CONFIGS / "toy_r3.yaml", TINY)
    Trainer(cfg, out, progress=False, log=lambda m: None).run()
    return out


def _same(a: dict, b: dict, keys=None):
    for k in keys or a:
        x, y = a[k], b[k]
        assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), (k, x, y)


def test_dump_of_a_step_equals_live_diagnose_of_its_checkpoint(run_dir):
    """The dump of step 2 (written by training) and a live diagnosis of the checkpoint of
    step 1 (whose next step is 2) give the same numbers, and both equal the run's metrics."""
    offline = diagnose_dump(run_dir / "dumps" / "step_2.safetensors")
    live = diagnose_checkpoint(run_dir / "checkpoints" / "step_1", [])
    assert offline["header"]["source"] == "train" and live["header"]["source"] == "engine"
    _same(offline["metrics"], live["metrics"])
    for part in ("per_layer", "by_position", "confusion", "margin", "is_weights", "top_tokens",
                 "expert_load"):
        assert offline[part] == live[part], part
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shared = [k for k in logged[1] if k.startswith(("routing/", "rollout_corr/", "rollout/moe/",
                                                    "actor/moe/"))]
    assert "routing/flip_rate/layer_1" in shared and "rollout_corr/k3_kl" in shared
    assert "rollout/moe/max_vio/layer_1" in shared and "actor/moe/cv/layer_2" in shared
    _same(logged[1], offline["metrics"], shared)
    # bf16 engine vs fp32 actor: the toy flips routes
    m = live["metrics"]
    assert m["routing/flip_rate"] > 0 and m["routing/token_any_flip"] > 0
    assert sum(r["flips"] for r in live["per_layer"]) > 0
    conf = live["confusion"]
    assert sum(sum(map(sum, c)) for c in conf.values()) == live["metrics"]["routing/num_tokens"] * \
        len(conf) * 2  # K = 2 entries per (token, layer)
    assert live["margin"]["flipped"]["p50"] < live["margin"]["kept"]["p50"]


def test_fp32_engine_and_actor_agree_exactly(run_dir):
    rep = diagnose_checkpoint(run_dir / "checkpoints" / "step_1",
                              ["rollout.dtype=fp32", "actor.dtype=fp32"])
    m = rep["metrics"]
    assert m["routing/flip_rate"] == 0 and m["routing/token_any_flip"] == 0
    assert abs(m["rollout_corr/kl"]) < 1e-6 and m["rollout_corr/k3_kl"] < 1e-6
    assert m["diagnose/tis_clip_fraction"] == 0 and m["diagnose/icepop_mask_fraction"] == 0


def test_r3_removes_the_routing_part(run_dir):
    ckpt = run_dir / "checkpoints" / "step_1"
    r3 = diagnose_checkpoint(ckpt, ["replay.mode=R3"])["metrics"]
    off = diagnose_checkpoint(ckpt, ["replay.mode=off"])["metrics"]
    assert r3["diagnose/routing_k3_kl"] == 0 and r3["diagnose/routing_k3_share"] == 0
    assert r3["rollout_corr/k3_kl"] == r3["diagnose/k3_kl_replayed"] == r3["diagnose/k3_kl"]
    # same samples: off's pi_old is the natural forward, and routing adds to its mismatch
    assert off["diagnose/k3_kl_natural"] == r3["diagnose/k3_kl_natural"]
    assert off["diagnose/routing_k3_kl"] > 0
    assert off["rollout_corr/k3_kl"] > r3["rollout_corr/k3_kl"]


def test_live_server_gives_the_engine_numbers(run_dir):
    """--url: the samples come from our SGLang-wire server over loopback HTTP, with the
    engine settings the run uses; the report equals the in-process one."""
    ckpt, hf = find_checkpoint(run_dir / "checkpoints" / "step_1")
    cfg = load_config(run_dir / "config.yaml")
    engine = Engine(load_hf(hf), EngineConfig(dtype="bf16", max_running=16, max_len=32),
                    weight_version="1")
    with ServerThread(engine) as srv:
        remote = diagnose_checkpoint(ckpt, [], url=srv.url)
    local = diagnose_checkpoint(ckpt, [])
    assert remote["header"]["source"].startswith("url:")
    assert remote["header"]["weight_version"] == "1"
    _same(local["metrics"], remote["metrics"])
    assert cfg.rollout.dtype == "bf16"


def test_url_to_a_server_that_never_answers_honours_request_timeout(run_dir, tmp_path, capsys):
    """A server that accepts the connection and stays silent: --set
    rollout.request_timeout_s=2 bounds the wait (it was ignored: the client's 600 s)."""
    import socket
    import threading
    import time

    srv = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(64)],
                     daemon=True).start()
    try:
        t0 = time.monotonic()
        code = cli.main(["diagnose", str(run_dir / "checkpoints" / "step_1"), "--out",
                         str(tmp_path / "d"), "--url", f"http://127.0.0.1:{srv.getsockname()[1]}",
                         "--set", "rollout.request_timeout_s=2"])
        took = time.monotonic() - t0
    finally:
        srv.close()
        for conn, _ in held:
            conn.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("lockstep diagnose: ") and "within 2" in err[-1], err
    assert took < 30, took
    assert not (tmp_path / "d").exists()


def test_cli_writes_report_and_rejects_bad_input(run_dir, tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["diagnose", "--dump", str(run_dir / "dumps" / "step_1.safetensors"),
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens with >= 1 flipped layer" in text and "flip rate per layer" in text
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"]["step"] == 1
    for name in ("flip_heatmap", "flip_layers", "by_position", "margin_hist", "is_weights",
                 "confusion", "expert_load"):
        assert (out / f"{name}.png").stat().st_size > 2000, name
    assert (out / "report.html").stat().st_size > 10000
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((run_dir / "dumps" / "step_1.safetensors").read_bytes()[:500])
    assert cli.main(["diagnose", "--dump", str(bad), "--out", str(out)]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err
    assert cli.main(["diagnose", str(run_dir / "checkpoints" / "step_1"), "--out", str(out),
                     "--set", "rollout.dtyp=fp32"]) == 2
    assert "dtyp" in capsys.readouterr().err
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "07+45=", "answer": "52"}\n{"input_ids": [1, 4, 5, 13, 6, 7, 14]}\n')
    assert cli.main(["diagnose", str(run_dir / "checkpoints" / "step_1"), "--out", str(out),
                     "--data", str(data), "--samples", "6"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"]["diagnose/num_samples"] == 6
    assert {t["context"].split(" | ")[0] for t in report["top_tokens"]} <= {"<bos>07+45=",
                                                                           "<bos>12+34="}
    data.write_text('{"text": "x"}\n')
    assert cli.main(["diagnose", str(run_dir / "checkpoints" / "step_1"), "--out", str(out),
                     "--data", str(data)]) == 2
    assert "prompts.jsonl:1: needs 'prompt'" in capsys.readouterr().err


def test_live_diagnosis_of_a_multi_turn_run_is_refused(tmp_path, capsys):
    """It would sample single turns, not the run's trajectories: the dump is the way."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert cli.main(["diagnose", str(tmp_path), "--out", str(tmp_path / "d"),
                     "--config", str(CONFIGS / "toy_agent_r3.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rollout.env" in err and "--dump" in err


@pytest.mark.parametrize("key,value", [("gates", "engine"),
                                       ("partial", "{rule: margin, threshold: 0.05}")])
def test_live_diagnosis_of_gate_or_partial_replay_is_refused(tmp_path, capsys, key, value):
    """The live actor replays ids in full with its own gates: not what such a run trained on
    (replay.gates=engine crashed in Trainer.requests before, an internal error)."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert cli.main(["diagnose", str(tmp_path), "--out", str(tmp_path / "d"), "--config",
                     str(CONFIGS / "toy_r3.yaml"), "--set", f"replay.{key}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"replay.{key}" in err and "--dump" in err


@pytest.mark.slow
def test_sweep_table(run_dir, tmp_path, capsys):
    assert cli.main(["diagnose", str(run_dir / "checkpoints" / "step_1"), "--out",
                     str(tmp_path), "--sweep", "--samples", "8"]) == 0
    table = capsys.readouterr().out
    rows = {r["setting"]: r for r in json.loads((tmp_path / "sweep.json").read_text())}
    assert rows["engine fp32"]["flip_rate"] == 0 and rows["engine + actor fp32"]["k3_kl"] < 1e-6
    assert rows["engine bf16"]["flip_rate"] > 0
    assert rows["replay R3"]["routing_share"] == 0 and rows["replay off"]["routing_k3"] > 0
    assert "engine router fp32" in table
    exact = rows["engine + actor bf16 exact"]  # batch-invariant kernels: nothing differs
    assert exact["flip_rate"] == 0 and exact["k3_kl"] == 0 and exact["routing_k3"] == 0
    assert rows["engine fp8"]["k3_kl"] > 0 and rows["engine + actor fp8"]["flip_rate"] >= 0
    assert os.path.exists(tmp_path / "sweep.txt")


def test_dump_every_does_not_change_training(run_dir, tmp_path):
    """Dumping adds forwards but must not change what training computes."""
    cfg = load_config(CONFIGS / "toy_r3.yaml", TINY + ["loop.dump_every=0", "loop.steps=1",
                                                       "loop.checkpoint_every=0"])
    Trainer(cfg, tmp_path, progress=False, log=lambda m: None).run()
    a = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    b = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    _same(a, b, [k for k in a if not k.startswith("time/")])
    assert not (tmp_path / "dumps").exists()
    assert torch.equal(load_hf(tmp_path / "checkpoints/step_1/hf").lm_head.weight,
                       load_hf(run_dir / "checkpoints/step_1/hf").lm_head.weight)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_html_opens_in_headless_chromium_with_every_image(run_dir, tmp_path):
    out = tmp_path / "report"
    write_report(diagnose_dump(run_dir / "dumps" / "step_2.safetensors"), out)
    page = (out / "report.html").as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run"]

    def chromium(*args):
        profile = tempfile.mkdtemp(dir=tmp_path)
        return subprocess.run([_chromium(), *flags, f"--user-data-dir={profile}", *args, page],
                              capture_output=True, text=True, timeout=120)

    dom = chromium("--virtual-time-budget=5000", "--dump-dom").stdout
    found = re.search(r'<pre id="image-sizes">([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    sizes = json.loads(html.unescape(found.group(1)))  # written by the page's onload script
    assert [s["alt"] for s in sizes] == list(PLOTS)
    assert all(s["complete"] and s["w"] > 0 and s["h"] > 0 for s in sizes), sizes
    chromium("--window-size=1200,3000", f"--screenshot={tmp_path / 'shot.png'}")
    shot = (tmp_path / "shot.png").read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 50_000
