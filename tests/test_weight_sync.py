"""Disk-free weight sync over SGLang's wire (rollout/weight_sync.py, rollout/weight_receiver.py):
real servers (a `lockstep serve` process and a loopback ServerThread) in one gloo group with
the trainer, pushes broadcast bucket by bucket."""

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors

from lockstep.moe.buckets import bucketize
from lockstep.moe.checkpoint import hf_state_dict, save_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import HTTPBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.server import ServerThread
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.rollout.weight_sync import DistributedWeightSync, check_versions

from model_fixtures import tiny_config
from server_fixtures import call

ENGINE = EngineConfig(dtype="fp32", max_running=16, max_len=48)
CFG = tiny_config(max_position_embeddings=64, mlp_only_layers=[0])
BUCKET = 40_000  # bytes: the tiny model travels in several buckets


def _model(seed: int) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(CFG)


def _buckets(model: MoEModel, bucket_bytes: int = BUCKET):
    return bucketize(((k, v.detach()) for k, v in hf_state_dict(model).items()), bucket_bytes)


def _serve(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.launch.serve", "--model", str(folder),
                             "--dtype", "fp32", "--port", str(port), "--threads", "1",
                             "--max-len", "48"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if call(url, "/health", timeout=2)[0] == 200:
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"lockstep serve exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("lockstep serve did not start in 120 s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _greedy(url: str) -> list:
    """Greedy tokens and log-probs of three prompts, and the weight version."""
    out = []
    for prompt in ([1, 5, 7, 9], [1, 3], [1, 11, 12, 13, 14]):
        status, r = call(url, "/generate", {"input_ids": prompt, "return_logprob": True,
                                            "sampling_params": {"temperature": 0.0,
                                                                "max_new_tokens": 8}})
        assert status == 200, r
        out.append((r["output_ids"], [e[0] for e in r["meta_info"]["output_token_logprobs"]],
                    r["meta_info"]["weight_version"]))
    return out


def _write_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/<pid>/io")


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A `lockstep serve` process and a ServerThread, both over model 0."""
    folder = save_hf(_model(0), tmp_path_factory.mktemp("m0") / "hf")
    proc, url = _serve(folder)
    try:
        with ServerThread(Engine.from_model(_model(0), ENGINE), weight_sync_timeout_s=30) as srv:
            yield proc, url, srv
    finally:
        _stop(proc)


def test_distributed_push_equals_disk_push_and_writes_nothing(served, tmp_path):
    """Two servers in one group get model 1 by broadcast: greedy tokens and log-probs equal a
    server that loaded the same weights from disk; nothing is written to disk meanwhile."""
    proc, url, srv = served
    new = _model(1)
    before_files = _files(tmp_path)
    before = _write_bytes(), _write_bytes(proc.pid)
    with DistributedWeightSync([url, srv.url], timeout_s=60) as sync:
        assert sync.rank_offsets == [1, 2] and sync.world_size == 3
        stats = sync.push(_buckets(new), "7")
    after = _write_bytes(), _write_bytes(proc.pid)
    assert stats["buckets"] > 2 and stats["bytes"] == sum(
        t.numel() * t.element_size() for t in hf_state_dict(new).values())
    assert after == before, f"write_bytes (trainer, server) {before} -> {after}"
    assert _files(tmp_path) == before_files

    with ServerThread(Engine.from_model(_model(0), ENGINE)) as disk:
        folder = save_hf(new, tmp_path / "m1")
        assert call(disk.url, "/update_weights_from_disk",
                    {"model_path": str(folder), "weight_version": "7"})[0] == 200
        want = _greedy(disk.url)
    assert _greedy(url) == want and _greedy(srv.url) == want
    assert {v for *_, v in want} == {"7"}


def test_disk_push_is_seen_by_the_write_counter(served, tmp_path):
    """The write_bytes probe above can see a write: a disk push moves it."""
    _, _, srv = served
    backend = HTTPBackend(srv.url, CFG, weights_dir=tmp_path, weight_sync="disk")
    w0 = _write_bytes()
    backend.update_weights(_model(2), "8")
    assert _write_bytes() - w0 > 10_000


def _state(url_or_engine):
    return {k: v.clone() for k, v in url_or_engine.model.state_dict().items()}


@pytest.mark.parametrize("bad", ["name", "shape", "nan"])
def test_bad_bucket_leaves_the_server_unchanged(served, bad):
    """A bad tensor in the second bucket: an error naming it, the weights and the version as
    they were (the first bucket was staged, never loaded); the group still works after."""
    _, _, srv = served
    from lockstep.rollout.weight_receiver import RECEIVER
    eng = srv.app[RECEIVER].engine
    before, version = _state(eng), eng.weight_version
    buckets = [list(b) for b in _buckets(_model(3))]
    name, t = buckets[1][0]
    if bad == "name":
        buckets[1][0] = ("model.layers.1.mlp.experts.99.up_proj.weight", t)
        culprit = "experts.99.up_proj"
    elif bad == "shape":
        buckets[1][0] = (name, t[..., :-1].contiguous())
        culprit = name
    else:
        t = t.clone()
        t.view(-1)[3] = float("nan")
        buckets[1][0] = (name, t)
        culprit = name
    with DistributedWeightSync([srv.url], timeout_s=30) as sync:
        with pytest.raises(RolloutError, match=culprit.replace(".", r"\.")) as e:
            sync.push(buckets, "9")
        assert "engine 0" in str(e.value) and ("NaN" in str(e.value) or bad != "nan")
    assert eng.weight_version == version
    assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
    with DistributedWeightSync([srv.url], timeout_s=30) as sync:  # the server joins again
        sync.push(_buckets(_model(3)), "10")
    assert eng.weight_version == "10"


@pytest.mark.slow
def test_server_dying_mid_push_is_named_within_the_timeout(tmp_path):
    """kill -9 of one server between two buckets: the push fails naming it, well within the
    timeout, and the surviving server loaded nothing."""
    folder = save_hf(_model(0), tmp_path / "hf")
    proc, url = _serve(folder)
    try:
        with ServerThread(Engine.from_model(_model(0), ENGINE), weight_sync_timeout_s=20) as srv:
            from lockstep.rollout.weight_receiver import RECEIVER
            eng = srv.app[RECEIVER].engine
            before = _state(eng)
            sync = DistributedWeightSync([url, srv.url], timeout_s=20)

            def buckets():
                for k, b in enumerate(_buckets(_model(4), 20_000)):
                    if k == 2:
                        os.kill(proc.pid, signal.SIGKILL)
                        proc.wait(10)
                    yield b
            t0 = time.monotonic()
            with pytest.raises(RolloutError, match=f"engine 0 \\({url}\\)"):
                sync.push(buckets(), "5")
            assert time.monotonic() - t0 < 20
            sync.close()
            assert eng.weight_version == "0"
            assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
    finally:
        _stop(proc)


def test_weight_endpoints_are_strict(served):
    """Unknown fields name the closest valid one; SGLang's pickled tensor formats are refused
    (no unpickling of request bytes); safetensors bytes load; no group: a clear error. Pushes
    need a weight-update session, as in SGLang 0.5.23 (test_weight_session_like_sglang)."""
    _, _, srv = served
    assert call(srv.url, "/begin_weight_update", {}) == (200, {"success": True, "message": "weight-update session opened"})
    status, r = call(srv.url, "/update_weights_from_distributed",
                     {"names": [], "dtypes": [], "shapes": [], "weight_versoin": "3"})
    assert status == 400 and r["success"] is False and "did you mean 'weight_version'" in r["message"]
    status, r = call(srv.url, "/update_weights_from_distributed",
                     {"names": [], "dtypes": [], "shapes": [], "group_name": "nope"})
    assert status == 400 and "init_weights_update_group first" in r["message"]
    status, r = call(srv.url, "/init_weights_update_group",
                     {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                      "world_size": 2})
    assert status == 400 and "backend='gloo'" in r["message"]  # SGLang's default is nccl
    status, r = call(srv.url, "/update_weights_from_tensor",
                     {"serialized_named_tensors": ["gASVAAAA"], "load_format": None})
    assert status == 400 and "pickled" in r["message"] and "run code" in r["message"]
    new = _model(5)
    sd = {k: v.detach().contiguous() for k, v in hf_state_dict(new).items()}
    payload = base64.b64encode(save_safetensors(sd)).decode()
    status, r = call(srv.url, "/update_weights_from_tensor",
                     {"serialized_named_tensors": [payload], "load_format": "safetensors",
                      "weight_version": "t1"})
    assert status == 200 and r["success"], r
    from lockstep.rollout.weight_receiver import RECEIVER
    eng = srv.app[RECEIVER].engine
    assert eng.weight_version == "t1"
    assert all(torch.equal(a, b) for a, b in zip(eng.model.state_dict().values(),
                                                 new.state_dict().values()))
    assert call(srv.url, "/end_weight_update", {})[0] == 200


def test_weight_session_like_sglang(served):
    """As SGLang 0.5.23 (scheduler_components/weight_updater.py): distributed and tensor
    pushes are refused outside a /begin_weight_update ... /end_weight_update session (the
    weights stay); a second begin and an end without a begin are refused; disk needs none."""
    _, _, srv = served
    from lockstep.rollout.weight_receiver import RECEIVER
    eng = srv.app[RECEIVER].engine
    before = eng.weight_version
    for path in ("/update_weights_from_distributed", "/update_weights_from_tensor"):
        body = ({"names": [], "dtypes": [], "shapes": []} if "distributed" in path else
                {"serialized_named_tensors": [""], "load_format": "safetensors"})
        status, r = call(srv.url, path, body)
        assert status == 400 and r["success"] is False, r
        assert r["message"] == (f"{path[1:]} must run between begin_weight_update() and "
                                f"end_weight_update()")
    assert eng.weight_version == before
    status, r = call(srv.url, "/end_weight_update", {})
    assert status == 400 and "no weight-update session is open" in r["message"]
    assert call(srv.url, "/begin_weight_update", {})[0] == 200
    status, r = call(srv.url, "/begin_weight_update", {})
    assert status == 400 and "already open" in r["message"]
    status, r = call(srv.url, "/begin_weight_update", {"selector": "nope"})
    assert status == 400 and "selector" in r["message"]
    assert call(srv.url, "/end_weight_update", {})[0] == 200
    status, r = call(srv.url, "/end_weight_update", {})
    assert status == 400


def test_check_versions_names_the_sample():
    ok = Engine.from_model(_model(0), ENGINE, weight_version="3").generate(
        [GenerateRequest([1, 2], SamplingParams(max_new_tokens=2, n=2), rid="a")])
    check_versions(ok, {"3"})
    with pytest.raises(RolloutError, match=r"request a sample 0 .* version '3'.*\['4'\]"):
        check_versions(ok, {"4"})


def test_http_backend_auto_falls_back_to_disk_and_tensor_mode(served, tmp_path):
    """HTTPBackend: `auto` pushes through disk (saying so once, and from then on) when the
    server refuses the push before any weight changed (here: another client holds the
    weight-update session open), else distributed, writing nothing; `tensor` sends
    safetensors buckets over HTTP."""
    from lockstep.rollout.weight_receiver import RECEIVER
    _, _, srv = served
    eng = srv.app[RECEIVER].engine
    logs = []
    assert call(srv.url, "/begin_weight_update", {})[0] == 200  # someone else's session
    auto = HTTPBackend(srv.url, CFG, weights_dir=tmp_path / "a", weight_sync="auto",
                       log=logs.append, bucket_bytes=BUCKET)
    new = _model(6)
    auto.update_weights(_buckets(new), "a1")
    assert auto.last_push["mode"] == "disk" and auto.weight_sync == "disk"
    assert auto.last_push["buckets"] > 2  # every bucket reached disk, the refused one first
    assert eng.weight_version == "a1" and all(torch.equal(a, b) for a, b in zip(
        eng.model.state_dict().values(), new.state_dict().values()))
    said = [line for line in logs if "through disk" in line]
    assert len(said) == 1 and "already open" in said[0] and "refused the push" in said[0], logs
    auto.update_weights(_buckets(_model(5)), "a1b")  # disk from now on, not said again
    assert auto.last_push["mode"] == "disk" and len([x for x in logs if "disk" in x]) == 1
    assert call(srv.url, "/end_weight_update", {})[0] == 200
    auto2 = HTTPBackend(srv.url, CFG, weights_dir=tmp_path / "b", weight_sync="auto",
                        bucket_bytes=BUCKET)
    auto2.update_weights(_model(7), "a2")
    assert auto2.last_push["mode"] == "distributed" and auto2.last_push["buckets"] > 2
    assert not (tmp_path / "b").exists() and eng.weight_version == "a2"
    auto2.close()
    tensor = HTTPBackend(srv.url, CFG, weight_sync="tensor", bucket_bytes=BUCKET)
    new = _model(8)
    tensor.update_weights(new, "a3")
    assert tensor.last_push["mode"] == "tensor" and tensor.last_push["buckets"] > 2
    assert eng.weight_version == "a3"
    assert all(torch.equal(a, b) for a, b in zip(eng.model.state_dict().values(),
                                                 new.state_dict().values()))


def test_group_names_are_unique_and_a_failed_push_destroys_its_group(served):
    """Two syncs join one server at once (a name per sync, not one fixed name a dead run
    could leave behind); a push the server refuses destroys the group and closes the
    session on the server, so nothing of the failed client stays there."""
    from lockstep.rollout.weight_receiver import RECEIVER
    _, _, srv = served
    receiver = srv.app[RECEIVER]
    with DistributedWeightSync([srv.url], timeout_s=30) as a, \
            DistributedWeightSync([srv.url], timeout_s=30) as b:
        assert a.group_name != b.group_name and a.backend == b.backend == "gloo"
        assert {a.group_name, b.group_name} <= set(receiver.groups)
    assert not receiver.groups
    client = HTTPBackend(srv.url, CFG, weight_sync="distributed", bucket_bytes=BUCKET)
    bad = {"model.layers.1.mlp.gate.nope": torch.zeros(3), **hf_state_dict(_model(3))}
    with pytest.raises(RolloutError, match="'model.layers.1.mlp.gate.nope' is not a weight"):
        client.update_weights(bad, "b1")
    assert not receiver.groups and not receiver.session and client.pusher.sync is None


def test_trainer_that_fails_at_start_up_leaves_no_group(served, tmp_path):
    """A run whose first push is refused (its model is not the server's), or that dies
    right after joining, stops at start-up and destroys its weight group there."""
    from lockstep.rollout.weight_receiver import RECEIVER
    from lockstep.trainer.config.load import load_config
    from lockstep.trainer.loop import Trainer
    _, _, srv = served
    receiver = srv.app[RECEIVER]
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml",
                      ["warmstart.enabled=false", "rollout.backend=http",
                       f"rollout.url={srv.url}", "rollout.weight_sync=distributed"])
    with pytest.raises(RolloutError, match=r"update_weights_from_distributed \(bucket 0\)"):
        Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    assert not receiver.groups and not receiver.session

    class Died(Exception):
        pass

    def die_once_joined(line: str) -> None:  # the run dies right after joining the group
        if "joined" in line:
            raise Died(line)
    with pytest.raises(Died):
        Trainer(cfg, tmp_path / "run2", progress=False, log=die_once_joined)
    assert not receiver.groups and not receiver.session


def test_group_backend_is_chosen_from_the_devices():
    """gloo for CPU servers (SGLang's /server_info `device`, lockstep serve's
    `engine.device`); NCCL only when every server and this process have CUDA."""
    from lockstep.rollout.weight_sync import choose_backend
    assert choose_backend([{"device": "cpu"}, {"engine": {"device": "cpu"}}]) == "gloo"
    assert choose_backend([{"device": "cuda"}, {"engine": {"device": "cpu"}}]) == "gloo"
    gpu = "nccl" if torch.cuda.is_available() else "gloo"
    assert choose_backend([{"device": "cuda"}, {"engine": {"device": "cuda:1"}}]) == gpu
    assert choose_backend([None]) == "gloo"  # a server that says nothing: CPU


def test_weight_sync_does_not_import_the_client():
    """No import cycle: the client imports weight_sync at module level; weight_sync takes its
    errors from rollout/types.py, not from the client."""
    code = ("import sys, lockstep.rollout.weight_sync; "
            "assert 'lockstep.rollout.client' not in sys.modules, 'weight_sync imports client'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


_KILLED_PUSH = """
import sys, time
sys.path.insert(0, {tests!r})
import torch
from lockstep.moe.buckets import bucketize
from lockstep.moe.checkpoint import hf_state_dict
from lockstep.moe.model import MoEModel
from lockstep.rollout.client import HTTPBackend
from model_fixtures import tiny_config
torch.manual_seed(4)
model = MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))
def buckets():
    for i, b in enumerate(bucketize(((k, v.detach()) for k, v in hf_state_dict(model).items()),
                                    {bucket})):
        if i == 2:  # bucket 0 sent inside the open session, bucket 1 in hand: killed here
            print("in session", flush=True)
            time.sleep(600)
        yield b
HTTPBackend({url!r}, model.cfg, weight_sync="distributed", bucket_bytes={bucket},
            push_marker={marker!r}).update_weights(buckets(), "killed")
"""


def test_a_push_killed_inside_its_session_is_closed_by_its_own_run_only(served, tmp_path):
    """Issue 28 item 8: a trainer killed (SIGKILL) between /begin_weight_update and
    /end_weight_update leaves the server's session open, so every later begin is refused. A
    new run is refused with the exact command that closes it; the killed run's own directory
    (`--resume`: its push marker, left by the kill) closes it, says so, and pushes."""
    from lockstep.rollout.types import PushRefused
    from lockstep.rollout.weight_receiver import RECEIVER
    from lockstep.rollout.weight_push import MARKER
    _, _, srv = served
    eng = srv.app[RECEIVER].engine
    run = tmp_path / "run"
    run.mkdir()
    marker = run / MARKER
    script = _KILLED_PUSH.format(tests=str(Path(__file__).parent), bucket=BUCKET, url=srv.url,
                                 marker=str(marker))
    victim = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert victim.stdout.readline().strip() == "in session", victim.communicate()
    finally:
        victim.kill()
        victim.wait(30)
    assert marker.exists()  # the kill left the marker: URLs, version, the dead process's id
    status, r = call(srv.url, "/begin_weight_update", {})
    assert status == 400 and "already open" in r["message"], r  # the stale session
    # another run: refused, with what to run (weight_sync=distributed: no disk fallback)
    other = HTTPBackend(srv.url, CFG, weight_sync="distributed", bucket_bytes=BUCKET,
                        push_marker=tmp_path / "other" / MARKER)
    with pytest.raises(PushRefused) as e:
        other.update_weights(_buckets(_model(5)), "other")
    assert f"close it with `curl -X POST {srv.url}/end_weight_update`" in str(e.value), e.value
    assert "--resume" in str(e.value) and eng.weight_version != "other"
    assert not (tmp_path / "other" / MARKER).exists()  # a failed push leaves no marker
    other.close()
    # the killed run's own directory: it closes its session and pushes
    logs: list[str] = []
    mine = HTTPBackend(srv.url, CFG, weight_sync="distributed", bucket_bytes=BUCKET,
                       push_marker=marker, log=logs.append)
    new = _model(6)
    mine.update_weights(_buckets(new), "resumed")
    assert eng.weight_version == "resumed" and all(torch.equal(a, b) for a, b in zip(
        eng.model.state_dict().values(), new.state_dict().values()))
    closed = [x for x in logs if "closed the weight-update session" in x]
    assert len(closed) == 1 and srv.url in closed[0], logs
    assert not marker.exists()  # the push ended: no marker
    mine.update_weights(_buckets(_model(7)), "next")  # the next push opens its own session
    assert eng.weight_version == "next" and len(
        [x for x in logs if "closed the weight-update session" in x]) == 1
    mine.close()
    assert not srv.app[RECEIVER].session
