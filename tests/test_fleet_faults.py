"""The rollout dispatcher's faults, the same tests for every multi-engine backend on a real local
Ray cluster (2 CPUs, 2 engines each):

- `ray`: embedded engines as Ray actors (`rollout.backend: ray`, weights through the object store);
- `serve`: `lockstep serve` servers as Ray actors (`rollout.backend: serve`, weights by
  /update_weights_from_distributed over gloo);
- `urls`: two `lockstep serve` processes given by URL (`rollout.urls`): not relaunched by the
  fleet; restarted here by hand, they rejoin at the next push.

kill -9 mid-generate: every sample comes back exactly once, equal to the in-process engine's, and
the engine is back (relaunched in its bundle, or rejoined) with the pushed weights. A hung engine
(SIGSTOP) is timed out, killed and replaced. An engine past its restarts is named in the error.
Multi-turn trajectories over `serve` with an engine killed -9 in their second turn: the
victim's trajectories start again from their first turn once, every trajectory comes back once.
Real SGLang (`rollout.backend: sglang`) joins BACKENDS once it runs on CPU.
"""

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from lockstep.moe.checkpoint import save_hf  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.rollout.engine import Engine  # noqa: E402
from lockstep.rollout.engine_config import EngineConfig  # noqa: E402
from lockstep.rollout.fleet import Fleet  # noqa: E402
from lockstep.rollout.types import FleetError, RolloutError  # noqa: E402

from kill_fixtures import generate_then, wait_gone  # noqa: E402
from model_fixtures import tiny_config  # noqa: E402
from test_fleet import requests, same  # noqa: E402

pytestmark = pytest.mark.slow  # Ray and its worker processes take ~15-30 s to start
# two slots per engine: a fanned-out group's samples finish one after another, so a kill lands
# while some of a group's samples are in and others are not
ENGINE = EngineConfig(dtype="fp32", max_running=2, max_len=48)
LOCAL = dataclasses.replace(ENGINE, max_running=16)  # the reference (fp32: batch-independent)
BACKENDS = ["ray", "serve", "urls"]  # NOTE: add "sglang" here once it starts on CPU
RELAUNCHED = {"ray", "serve"}  # the fleet starts (and relaunches) these engines itself
HTTP = {"serve", "urls"}  # requests fanned out per sample: a kill leaves groups half answered


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))


class _Servers:
    """`lockstep serve` processes on loopback ports (the `urls` backend's servers)."""

    def __init__(self, folder, n):
        self.folder, self.procs, self.ports = folder, [], []
        for _ in range(n):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.ports.append(s.getsockname()[1])
            self.procs.append(self._start(self.ports[-1]))

    def _start(self, port):
        return subprocess.Popen(
            [sys.executable, "-m", "lockstep.launch.serve", "--model", str(self.folder),
             "--dtype", "fp32", "--max-running", str(ENGINE.max_running), "--max-len",
             str(ENGINE.max_len), "--port", str(port), "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"})

    @property
    def urls(self):
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def wait_up(self, timeout_s=120):
        import urllib.request
        deadline = time.monotonic() + timeout_s
        for url, proc in zip(self.urls, self.procs):
            while True:
                assert proc.poll() is None, "a lockstep serve process exited"
                try:
                    urllib.request.urlopen(url + "/health", timeout=2)
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"{url} never came up"
                    time.sleep(0.2)

    def restart(self, i):
        self.procs[i].wait(30)
        self.procs[i] = self._start(self.ports[i])
        self.wait_up()

    def close(self):
        for p in self.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
            p.wait(30)


@pytest.fixture(scope="module", params=BACKENDS)
def fleet(request, cluster, model, tmp_path_factory):
    kind, servers = request.param, None
    kw = dict(request_timeout_s=120.0, max_engine_restarts=2)
    if kind == "ray":
        f = Fleet.ray(model, LOCAL, 2, "0", **kw)  # an engine call holds its whole run
    elif kind == "serve":
        f = Fleet.serve(model, ENGINE, 2, "0", weight_sync="distributed", fan_out_samples=True,
                        **kw)
    else:
        servers = _Servers(save_hf(model, tmp_path_factory.mktemp("hf")), 2)
        servers.wait_up()
        f = Fleet.http(servers.urls, model.cfg, weight_sync="distributed", fan_out_samples=True,
                       **kw)
        f.update_weights(model, "0")
    f.kind, f.servers = kind, servers
    yield f
    f.close()
    if servers is not None:
        servers.close()


def _perturbed(model, seed):
    m = MoEModel(model.cfg)
    m.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def _pid(fleet, slot):
    """The engine's process: the fleet's actor, or a server given by URL (started here)."""
    return slot.pid if fleet.servers is None else fleet.servers.procs[slot.index].pid


def _generate_signalling(fleet, reqs, slot, kill):
    """Run generate on a thread; once `slot` has work in flight (over HTTP: and has answered
    one sample of it), SIGSTOP its process (it answers nothing more) and, with `kill`, SIGKILL
    it 0.5 s later."""
    pid = _pid(fleet, slot)

    def ready():
        return slot.load > 0 and (fleet.kind not in HTTP or slot.index in
                                  fleet.placement.values())

    def act():
        os.kill(pid, signal.SIGSTOP)
        if kill:
            threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    return generate_then(fleet, reqs, ready, act, wait_s=60, join_s=180)


def test_results_equal_the_engine_on_both_engines(fleet, model):
    got = fleet.generate(requests(k=6, n=2))
    same(got, Engine.from_model(model, LOCAL).generate(requests(k=6, n=2)))
    assert set(fleet.placement.values()) == {0, 1} and {r.weight_version for r in got} == {"0"}


def test_kill9_mid_generate_every_sample_once_and_engine_back(fleet, model):
    reqs = lambda: requests(k=8, n=4, max_new=12)  # noqa: E731
    victim = fleet.slots[1]
    old_pid, dead_before = _pid(fleet, victim), fleet.stats.engines_marked_dead
    got = _generate_signalling(fleet, reqs(), victim, kill=True)
    # every sample exactly once, each the in-process engine's (per-sample seeds)
    same(got, Engine.from_model(model, LOCAL).generate(reqs()))
    assert fleet.stats.engines_marked_dead == dead_before + 1 and fleet.stats.retried_groups >= 1
    if fleet.kind in HTTP:  # a resent group's answered samples came back and were dropped
        assert fleet.stats.duplicates_dropped >= 1
    assert wait_gone(old_pid)
    if fleet.kind in RELAUNCHED:  # relaunched in its bundle before generate returned
        assert victim.restarts == 1 and victim.pid not in (old_pid, -1)
        # an embedded Ray engine is built from the last push's buckets; a server waits for one
        assert victim.state == ("live" if fleet.kind == "ray" else "joining")
    else:  # a server given by URL: dead until it answers again
        assert victim.state == "dead"
        fleet.servers.restart(1)
    new = _perturbed(model, 1)
    assert fleet.update_weights(new, "1") == "1"
    assert victim.state == "live" and fleet.slots[0].state == "live"
    got = fleet.generate(reqs())
    same(got, Engine.from_model(new, LOCAL).generate(reqs()))
    assert {r.weight_version for r in got} == {"1"} and set(fleet.placement.values()) == {0, 1}


def test_trajectories_over_a_kill9_come_back_once(fleet, model, tmp_path):
    """Multi-turn trajectories (rollout/agent.py) with an engine killed -9 during their second
    turn: its trajectories start again from their first turn, once, the others go on, and
    every trajectory comes back exactly once, equal to the in-process run's (fp32, the same
    per-turn seeds)."""
    if fleet.kind != "serve":
        pytest.skip("run over lockstep serve servers on local Ray (the pins are the same code "
                    "for every backend: tests/test_fleet_trajectories.py)")
    from types import SimpleNamespace

    from lockstep.rollout.agent import ObservationCodec, TrajectoryRunner
    from lockstep.rollout.env import EnvConfig, EnvPool
    from lockstep.rollout.tasks import build_tokenizer
    from test_agent import FIXED, _env_file, _requests
    from test_agent_fleet import _same
    weights = _perturbed(model, 3)
    fleet.update_weights(weights, "t")
    cfg = EnvConfig(file=_env_file(tmp_path, FIXED), max_turns=3, num_workers=1)
    calls, first = [], {}

    def run(generate):
        with EnvPool(cfg, log=lambda s: None) as env:
            return TrajectoryRunner(generate, env, ObservationCodec(build_tokenizer()),
                                    ENGINE.max_len, model.cfg.num_experts, eos_id=2,
                                    vocab_size=model.cfg.vocab_size,
                                    release=fleet.release_trajectories).run(
                _requests(n_prompts=4, n=2), [{"k": i} for i in range(4)])

    def generate(reqs):
        calls.append(reqs)
        try:
            return fleet.generate(reqs)
        finally:
            if len(calls) == 1:
                first.update(fleet.placement)
    want = run(Engine.from_model(weights, LOCAL).generate)
    victim = fleet.slots[0]
    pid, lost_before = victim.pid, fleet.stats.trajectories_lost

    def ready():  # in the second turn, with work in flight and one sample answered
        return len(calls) == 2 and victim.load > 0 and 0 in fleet.placement.values()

    def act():
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    got = generate_then(SimpleNamespace(generate=lambda _: run(generate)), None, ready, act,
                        wait_s=60, join_s=240)
    _same(got, want)  # every trajectory once, each as the in-process run samples it
    restarted = {(r.rid, r.index) for r in got if r.trajectory.restarts}
    on_victim = {k for k, e in first.items() if e == 0}
    assert restarted == on_victim  # every one left on it mid-trajectory (3 turns each)
    assert fleet.stats.trajectories_lost - lost_before == len(restarted)
    assert all(r.trajectory.error is None for r in got) and not fleet.pins.held
    assert wait_gone(pid) and victim.pid != pid  # relaunched in its bundle


def test_hung_engine_times_out_is_killed_and_replaced(fleet, model):
    weights = _perturbed(model, 2)
    fleet.update_weights(weights, "2")
    victim = fleet.slots[0]
    old_pid, restarts = _pid(fleet, victim), victim.restarts
    fleet.request_timeout_s = 6.0  # short, for the test; few requests so live ones finish
    try:
        t0 = time.monotonic()
        got = _generate_signalling(fleet, requests(k=4, n=2), victim, kill=False)
        took = time.monotonic() - t0
    finally:
        fleet.request_timeout_s = 120.0
        if fleet.kind not in RELAUNCHED:  # not ours to kill: it wakes up and rejoins
            os.kill(old_pid, signal.SIGCONT)
    same(got, Engine.from_model(weights, LOCAL).generate(requests(k=4, n=2)))
    assert took >= 6.0  # it waited for the timeout, not for the engine
    assert re.search(r"within 6(\.0)?s", victim.last_error), victim.last_error
    if fleet.kind in RELAUNCHED:
        assert wait_gone(old_pid)  # the hung process was killed, its bundle freed
        assert victim.restarts == restarts + 1 and victim.pid != old_pid
    fleet.update_weights(weights, "3")
    assert victim.state == "live"
    got = fleet.generate(requests(k=4, n=2))
    assert {r.weight_version for r in got} == {"3"} and set(fleet.placement.values()) == {0, 1}


def test_restarts_past_the_limit_name_the_engine(fleet):
    # NOTE: last for each backend: it ends the shared fleet
    if fleet.kind not in RELAUNCHED:
        pytest.skip("servers given by URL are not relaunched (test_fleet: no live engine left)")
    victim = fleet.slots[1]
    n = fleet.max_engine_restarts = victim.restarts
    os.kill(victim.pid, signal.SIGSTOP)  # answers nothing: its whole run is unanswered
    threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL)).start()
    with pytest.raises(FleetError, match=(
            rf"engine 1 \(.*pid {victim.pid}, node {victim.node[:12]}, live\) .+ during "
            rf"generate; restarted {n} time\(s\) already \(rollout.max_engine_restarts={n}\); "
            r"unanswered requests: \['p2', 'p3'\]")):
        fleet.generate(requests(k=4, n=2))
    assert fleet.closed and fleet.pg is None
    assert wait_gone(fleet.slots[0].pid)  # the survivor is killed by close(), not left running
    with pytest.raises(RolloutError, match="closed"):
        fleet.generate(requests(k=1))
