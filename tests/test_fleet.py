"""The rollout fleet's balancing client over real loopback servers (`lockstep serve`'s app on
threads, no Ray): results equal the in-process engine's, a request's samples stay on one
engine, load is spread, a dead server's requests are retried elsewhere with every sample
exactly once; and the SGLang fleet's launch arguments (SGLang itself is GPU-only)."""

import importlib.util
import json
import sys

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.client import EngineDown, HTTPBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.fleet import Fleet, FleetError, require_sglang, sglang_config
from lockstep.rollout.server import ServerThread
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError

from model_fixtures import tiny_config
from sglang_fixtures import PYTHON as SGLANG_PYTHON

ENGINE = EngineConfig(dtype="fp32", max_running=16, max_len=48)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))


def requests(k=6, n=4, seed=100, max_new=10, mask=False):
    g = torch.Generator().manual_seed(seed)
    return [GenerateRequest(torch.randint(3, 40, (int(p),), generator=g).tolist(), SamplingParams(
        temperature=1.0, top_k=20 if mask else -1, max_new_tokens=max_new, n=n,
        seed=seed + 1000 * i), rid=f"p{i}", return_sampling_mask=mask)
        for i, p in enumerate(torch.randint(2, 10, (k,), generator=g))]


def same(got, want):
    assert [(r.rid, r.index) for r in got] == [(r.rid, r.index) for r in want]
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids, (a.rid, a.index)
        assert torch.allclose(a.output_logprobs, b.output_logprobs, atol=1e-6, rtol=0)
        assert torch.equal(a.routes_NLK, b.routes_NLK)


@pytest.fixture
def servers(model):
    srv = [ServerThread(Engine.from_model(model, ENGINE, weight_version="0")).start()
           for _ in range(2)]
    yield srv
    for s in srv:
        s.stop()


@pytest.mark.parametrize("fan_out", [False, True])
def test_results_equal_the_engine_and_groups_stay_on_one_engine(model, servers, fan_out):
    fleet = Fleet.http([s.url for s in servers], model.cfg, fan_out_samples=fan_out)
    got = fleet.generate(requests())
    same(got, Engine.from_model(model, ENGINE).generate(requests()))
    engines_of = {}
    for (rid, _), e in fleet.placement.items():
        engines_of.setdefault(rid, set()).add(e)
    assert all(len(e) == 1 for e in engines_of.values()), engines_of  # a group on one engine
    per_engine = [sum(1 for e in engines_of.values() if i in e) for i in range(2)]
    assert per_engine == [3, 3]  # least-loaded: 6 equal groups over 2 idle engines


def test_sampling_mask_groups_fan_out_on_one_engine(model, servers):
    fleet = Fleet.http([s.url for s in servers], model.cfg)
    got = fleet.generate(requests(k=3, mask=True))
    same(got, Engine.from_model(model, ENGINE).generate(requests(k=3, mask=True)))
    assert all(r.sampling_mask is not None for r in got)
    by_rid = {}
    for (rid, _), e in fleet.placement.items():
        by_rid.setdefault(rid, set()).add(e)
    assert all(len(e) == 1 for e in by_rid.values())


def test_dead_server_requests_are_retried_on_the_live_one(model, servers):
    fleet = Fleet.http([s.url for s in servers], model.cfg, fan_out_samples=True)
    servers[1].stop()  # connection refused from now on
    got = fleet.generate(requests())
    same(got, Engine.from_model(model, ENGINE).generate(requests()))
    assert fleet.slots[1].state == "dead" and fleet.slots[0].state == "live"
    assert set(fleet.placement.values()) == {0}
    assert fleet.stats.retried_groups >= 1 and fleet.stats.engines_marked_dead == 1
    # every engine dead: a clear error naming them, not a hang
    servers[0].stop()
    with pytest.raises(FleetError, match="no live rollout engine"):
        fleet.generate(requests(k=1))


def test_rids_must_be_unique(model, servers):
    fleet = Fleet.http([s.url for s in servers], model.cfg)
    reqs = requests(k=2)
    reqs[1].rid = reqs[0].rid
    with pytest.raises(RolloutError, match="share rid"):
        fleet.generate(reqs)


def test_unanswered_post_is_engine_down_other_errors_are_not(model, servers):
    client = HTTPBackend(servers[0].url, model.cfg, retries=0)
    bad = requests(k=1)
    bad[0].input_ids = [10_000]  # outside the vocabulary: HTTP 400, the request's fault
    with pytest.raises(RolloutError) as e:
        client.generate(bad)
    assert not isinstance(e.value, EngineDown)
    servers[0].stop()
    with pytest.raises(EngineDown):
        client.generate(requests(k=1))


def test_config_fleet_backends():
    cfg = load_config(None, ["rollout.backend=serve", "rollout.num_engines=2"])
    assert cfg.rollout.backend == "serve" and cfg.rollout.request_timeout_s == 600.0
    cfg = load_config(None, ["rollout.backend=http", "rollout.urls=[http://a:1, http://b:2]"])
    assert cfg.rollout.urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ExperimentConfigError, match="url and rollout.urls"):
        load_config(None, ["rollout.backend=http", "rollout.url=http://a:1",
                           "rollout.urls=[http://b:2]"])
    with pytest.raises(ExperimentConfigError, match="request_timeout_s"):
        load_config(None, ["rollout.request_timeout_s=0"])
    # the fleet's keys at their defaults do not change a run's hash (old runs resume)
    assert load_config(None, ["rollout.max_engine_restarts=3"]).hash() == load_config().hash()


def test_fleet_clients_know_the_servers_it_launched():
    """A server given by URL may be paused by someone else (VLLMBackend refuses it at first
    contact); one the fleet launched, at the start or as a relaunch (`attach` with its
    info), is paused only by the fleet's own pushes: its client is `launched`."""
    from lockstep.rollout.vllm_client import VLLMBackend
    fleet = Fleet.http(["http://127.0.0.1:9"], tiny_config(), client_cls=VLLMBackend)
    slot = fleet.slots[0]
    assert isinstance(slot.client, VLLMBackend) and not slot.client.launched
    fleet.transport.attach(fleet, slot, {"url": slot.url, "pid": 1, "node": "n"})
    assert slot.client.launched
    fleet.close()


def test_sglang_fleet_arguments():
    from lockstep.trainer.driver.sglang_servers import sglang_options_dict
    cfg = load_config(None, ["rollout.backend=sglang", "cluster.device=cuda",
                             "rollout.sglang.tp_size=4", "rollout.sglang.ep_size=2",
                             "rollout.lm_head_dtype=fp32",
                             "rollout.sglang.deterministic_inference=true"])
    sc = sglang_config(sglang_options_dict(cfg), "/ckpt/hf", "10.1.2.3", 31234, "7", "k")
    argv = sc.command()
    for flag, value in (("--tp-size", "4"), ("--ep-size", "2"), ("--port", "31234"),
                        ("--host", "10.1.2.3"), ("--model-path", "/ckpt/hf"),
                        ("--weight-version", "7"), ("--dtype", "bfloat16")):
        assert argv[argv.index(flag) + 1] == value, flag
    for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init",
                 "--enable-fp32-lm-head", "--enable-deterministic-inference"):
        assert flag in argv
    with pytest.raises(ValueError, match="rollout.sglang.port"):
        sglang_config({"port": 1}, "/ckpt/hf", "h", 2)
    assert "--api-key" not in argv and "k" not in argv  # the key goes in a --config file
    assert "--device" not in argv and "SGLANG_USE_CPU_ENGINE" not in sc.env()


def test_sglang_fleet_arguments_on_cpu():
    from lockstep.trainer.driver.sglang_servers import sglang_options_dict
    cfg = load_config(None, ["rollout.backend=sglang", "cluster.device=cpu",
                             "rollout.sglang.extra_env=[PYTHONPATH=/shims, SGL_X=a=b]",
                             "rollout.sglang.startup_timeout_s=30", "rollout.sglang.bind=node"])
    opts = sglang_options_dict(cfg)
    assert opts["device"] == "cpu" and opts["bind"] == "node"
    assert opts["startup_timeout_s"] == 30.0
    sc = sglang_config(opts, "/ckpt/hf", "127.0.0.1", 31234)
    argv = sc.command()
    for flag, value in (("--device", "cpu"), ("--attention-backend", "torch_native"),
                        ("--max-total-tokens", "8192")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--disable-cuda-graph" in argv
    env = sc.env()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"] == "/shims"
    assert env["SGL_X"] == "a=b"
    for bad, msg in (("rollout.sglang.extra_env=[PYTHONPATH]", "entries must be NAME=VALUE"),
                     ("rollout.sglang.bind=lo", "bind"),
                     ("rollout.sglang.extra_args=[--device, cuda]", "cluster.device"),
                     ("rollout.sglang.extra_args=[--api-key, x]", "a fresh key per run")):
        with pytest.raises(ExperimentConfigError, match=msg):
            load_config(None, ["rollout.backend=sglang", bad])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_sglang_backend_without_sglang_is_refused_clearly(model, tmp_path):
    with pytest.raises(FleetError, match="needs SGLang installed") as e:
        require_sglang()
    assert f"lockstep's own interpreter ({sys.executable}" in str(e.value)
    with pytest.raises(FleetError, match="rollout.backend=serve"):
        Fleet.sglang({}, "/ckpt/hf", 2, model.cfg)  # before Ray or any bundle is touched
    # the configured interpreter is the one checked, and named
    with pytest.raises(FleetError, match=f"no `sglang` package in rollout.sglang.python="
                                         f"{sys.executable}"):
        Fleet.sglang({"python": sys.executable}, "/ckpt/hf", 2, model.cfg)
    with pytest.raises(FleetError, match=f"cannot run rollout.sglang.python={tmp_path}/nopy"):
        require_sglang(str(tmp_path / "nopy"))
    # extra_env reaches the probe: a PYTHONPATH holding an `sglang` package satisfies it
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    require_sglang(sys.executable, {"PYTHONPATH": str(tmp_path)})


def test_require_sglang_checks_the_configured_interpreter():
    """lockstep's venv has no sglang; SGLang's own venv (tests/sglang_cpu/install.sh) has."""
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"real SGLang venv not found at {SGLANG_PYTHON}; run "
                    f"tests/sglang_cpu/install.sh")
    require_sglang(str(SGLANG_PYTHON))  # accepted: the configured interpreter has it


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router not installed (optional; not a dependency)")
def test_sglang_router_drops_the_route_fields(tmp_path):
    """Why the fleet balances by itself: SGLang's load balancer (sglang-router 0.3.2, CPU wheel)
    forwards /generate through its own request type, without the fields R2/R3 and
    sampling-mask replay need. Fails (and says so) once a router version forwards them."""
    import asyncio
    import json
    import shutil
    import socket
    import subprocess
    import threading
    import time
    import urllib.request

    from aiohttp import web

    seen = []

    async def generate(request):
        seen.append(await request.json())
        return web.json_response({"output_ids": [2], "meta_info": {"id": "x"}})

    async def health(request):
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def free():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rport = free()
    exe = shutil.which("sglang-router") or pytest.skip("no sglang-router executable")
    proc = subprocess.Popen([exe, "launch", "--host", "127.0.0.1", "--port", str(rport),
                             "--worker-urls", f"http://127.0.0.1:{port}", "--policy",
                             "round_robin", "--prometheus-port", str(free()), "--log-level",
                             "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}, "rid": "r1",
                "return_logprob": True, "return_routed_experts": True,
                "routed_experts_start_len": 0, "return_sampling_mask": True,
                "sampling_logprobs_mode": "selected"}
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{rport}/generate", data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"}), timeout=10).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.skip("sglang-router did not come up here")
                time.sleep(0.5)
        fwd = seen[-1]
        assert fwd["rid"] == "r1" and fwd["input_ids"] == [3, 4]
        dropped = [k for k in ("return_routed_experts", "routed_experts_start_len",
                               "return_sampling_mask", "sampling_logprobs_mode") if k not in fwd]
        assert dropped, ("sglang-router now forwards the route and sampling-mask fields: it "
                         "could balance the fleet (docs/ray.md, 'sglang-router')")
    finally:
        proc.terminate()
        proc.wait(10)
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("urls", ["rollout.urls=[http://a:1, http://b:2]", "rollout.url=http://a:1"])
def test_colocated_placement_refused_for_servers_given_by_url(urls, tmp_path):
    """Servers given by URL were not launched by lockstep: no bundle to share with a rank."""
    from lockstep.launch.plan import PlanError, check_devices
    from lockstep.trainer.driver.rollouts import make_fleet
    cfg = load_config(None, ["rollout.backend=http", urls, "cluster.placement=colocated",
                             "cluster.actor_ranks=2", "rollout.num_engines=2"])
    with pytest.raises(PlanError, match="rollout.backend=http: servers given by rollout.url"):
        check_devices(cfg)  # `lockstep train`, before the run directory
    if "urls" in urls:  # the fleet (Trainer) refuses too, before any request
        with pytest.raises(ValueError, match="have no placement-group bundle to share"):
            make_fleet(cfg, MoEModel(cfg.model), "0", ENGINE, tmp_path)
    check_devices(load_config(None, ["rollout.backend=http", urls, "cluster.actor_ranks=2"]))


def test_colocated_fleet_releases_memory_between_phases(model, servers, tmp_path):
    """With `colocate`, the servers hold no memory while the actor trains (SGLang's
    /release_memory_occupation after generating, /resume_memory_occupation before the push
    and the next generate); a server that was not resumed refuses /generate."""
    import urllib.request

    def released(srv):
        with urllib.request.urlopen(srv.url + "/server_info") as r:
            return json.loads(r.read())["memory_released"]

    fleet = Fleet.http([s.url for s in servers], model.cfg, colocate=True, weight_sync="disk",
                       weights_dir=tmp_path)
    got = fleet.generate(requests(k=2))
    assert [released(s) for s in servers] == [["kv_cache", "weights"]] * 2  # actor's turn
    direct = HTTPBackend(servers[0].url, model.cfg)
    with pytest.raises(RolloutError, match="resume_memory_occupation"):
        direct.generate(requests(k=1))
    fleet.update_weights(model, "1")  # weights back for the push, the KV cache not yet
    assert [released(s) for s in servers] == [["kv_cache"]] * 2
    again = fleet.generate(requests(k=2))  # resumes first, releases after
    assert [r.output_ids for r in again] == [r.output_ids for r in got]
    assert {r.weight_version for r in again} == {"1"}
    assert [released(s) for s in servers] == [["kv_cache", "weights"]] * 2
    fleet.resume_memory()
    assert [released(s) for s in servers] == [[], []]
    assert len(direct.generate(requests(k=1))) == 4


@pytest.mark.slow  # two short RL steps (~10 s on a quiet 2-core host)
@pytest.mark.parametrize("staleness", [0, 1])
def test_trainer_over_rollout_urls(tmp_path, staleness):
    """`rollout.backend: http` with `rollout.urls`: the loop runs over the balancing client,
    pushing its weights to both servers by /update_weights_from_distributed (nothing on disk)."""
    from pathlib import Path

    from lockstep.trainer.loop import Trainer
    sets = ["warmstart.enabled=false", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
            "actor.mini_batch_size=8", "actor.micro_batch_size=8", "loop.steps=2",
            "loop.tensorboard=false", "loop.plots=false", "loop.checkpoint_every=0",
            f"loop.max_staleness={staleness}"]  # 1: generation on the pipeline's thread
    toy = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"
    mcfg = load_config(toy, sets).model  # the servers start from other weights: pushed at once
    servers = [ServerThread(Engine(MoEModel(mcfg), EngineConfig(dtype="bf16", max_len=32),
                                   weight_version="x")).start() for _ in range(2)]
    try:
        cfg = load_config(toy, sets + ["rollout.backend=http",
                                       f"rollout.urls=[{servers[0].url}, {servers[1].url}]"])
        tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
        tr.run()
    finally:
        for s in servers:
            s.stop()
    fleet = tr.rollout
    assert isinstance(fleet, Fleet) and fleet.weight_sync == "distributed"
    assert fleet.stats.pushes == 3 and fleet.stats.disk_bytes_written == 0  # start + 2 steps
    assert set(fleet.placement.values()) == {0, 1}
    assert not (tmp_path / "run" / "weights").exists()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["replay/mismatch"] == 0.0


def test_auto_fleet_falls_back_to_disk_when_a_push_is_refused(model, servers, tmp_path):
    """weight_sync=auto: a push one engine refuses before any weight changed (another client
    holds its weight-update session) goes through disk, this push and every later one, said
    once; `distributed` stops instead."""
    import urllib.request

    def post(url, path):
        req = urllib.request.Request(url + path, data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return r.status
    assert post(servers[1].url, "/begin_weight_update") == 200
    strict = Fleet.http([s.url for s in servers], model.cfg, weight_sync="distributed",
                        weights_dir=tmp_path / "d", request_timeout_s=30)
    with pytest.raises(FleetError, match="already open"):
        strict.update_weights(model, "1")
    strict.close()
    logs = []
    fleet = Fleet.http([s.url for s in servers], model.cfg, weight_sync="auto",
                       weights_dir=tmp_path / "a", request_timeout_s=30, log=logs.append)
    assert fleet.update_weights(model, "2") == "2" and fleet.weight_sync == "disk"
    assert fleet.update_weights(model, "3") == "3"
    said = [x for x in logs if "through disk" in x]
    assert len(said) == 1 and "already open" in said[0], logs
    assert {r.weight_version for r in fleet.generate(requests(k=2))} == {"3"}
    fleet.close()
    assert post(servers[1].url, "/end_weight_update") == 200
