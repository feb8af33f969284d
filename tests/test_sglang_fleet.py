"""`rollout.backend: sglang` on CPU: real SGLang 0.5.23 servers launched by the fleet as Ray
actors on a private local Ray cluster (2 CPUs), as `lockstep train` builds it (`make_fleet`).

- The fleet reserves CPU bundles (`{CPU: 1}`, not `{GPU: 1}`), launches SGLang with its CPU
  flags from the configured interpreter (`rollout.sglang.python`) and `rollout.sglang.extra_env`
  (the tier's CPU shims), binds loopback on a one-node cluster, and keeps the API key out of
  every server process's command line and environment.
- kill -9 of one server mid-generate: every sample comes back exactly once, and the server is
  relaunched in its bundle and pushed the step's weights before it serves again.
- On a CPU SGLang server the fleet refuses /release_memory_occupation (it would kill it).
- A start-up timeout that cannot be met fails at once, naming what it waited for.

Needs SGLang's own venv (tests/sglang_cpu/install.sh); skipped without it. Two servers busy-poll a
core each while up, so the module keeps to one fleet of 2 servers and a few small requests.
"""

import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.rollout.client import RolloutError  # noqa: E402
from lockstep.rollout.engine import Engine  # noqa: E402
from lockstep.rollout.engine_config import EngineConfig  # noqa: E402
from lockstep.rollout.types import FleetError  # noqa: E402
from lockstep.rollout.types import GenerateRequest, SamplingParams  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.driver.rollouts import make_fleet  # noqa: E402

from kill_fixtures import alive, generate_then, wait_gone  # noqa: E402
from sglang_fixtures import PYTHON, SHIMS, VENV  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.skipif(
    not PYTHON.exists(), reason=f"real SGLang venv not found at {VENV}; run "
                                f"tests/sglang_cpu/install.sh")]


def _cfg(out: Path, *extra: str):
    return load_config(None, [
        "rollout.backend=sglang", "rollout.num_engines=2", "cluster.device=cpu",
        "rollout.dtype=fp32", "rollout.request_timeout_s=120",
        "rollout.max_engine_restarts=2", "rollout.prompts_per_step=8",
        "rollout.samples_per_prompt=4", "actor.mini_batch_size=32", "actor.micro_batch_size=32",
        f"rollout.sglang.python={PYTHON}",
        f"rollout.sglang.extra_env=[PYTHONPATH={SHIMS}, LOCKSTEP_SGLANG_CPU_HOST_BUFFER=1]",
        # an idle server polls its sockets instead of spinning on a core
        "rollout.sglang.extra_args=[--sleep-on-idle]",
        "rollout.sglang.startup_timeout_s=600", *extra])


def requests(k: int, n: int = 4, seed: int = 7) -> list[GenerateRequest]:
    """k prompts of n samples; request i generates 4 + 4 i tokens, so one server's requests
    finish one after another (a kill lands while some are answered and others in flight)."""
    g = torch.Generator().manual_seed(seed)
    return [GenerateRequest(torch.randint(3, 16, (3 + i % 4,), generator=g).tolist(),
                            SamplingParams(temperature=1.0, max_new_tokens=4 + 4 * i, n=n,
                                           ignore_eos=True, seed=seed + 100 * i),
                            rid=f"s{seed}p{i}") for i in range(k)]


def once_each(got, reqs, version):
    """Every (rid, sample index) exactly once, in request order, complete, at `version`."""
    assert [(r.rid, r.index) for r in got] == [(q.rid, j) for q in reqs
                                               for j in range(q.sampling.n)]
    for r, q in zip(got, [q for q in reqs for _ in range(q.sampling.n)]):
        assert len(r.output_ids) == q.sampling.max_new_tokens and r.weight_version == version
        assert r.routes_NLK is not None and r.routes_NLK.shape[0] == len(q.input_ids) + len(
            r.output_ids) - 1


def _generate_killing(fleet, reqs, slot):
    """fleet.generate(reqs) on a thread; once `slot` has answered a request and has more in
    flight, kill -9 its server process."""
    return generate_then(fleet, reqs,
                         lambda: slot.index in fleet.placement.values() and slot.load > 0,
                         lambda: os.kill(slot.pid, signal.SIGKILL), wait_s=300, join_s=600)


def _group_pids(pid: int) -> list[int]:
    """The processes of server `pid`'s process group (led by its guard: the fleet's servers die
    with their Ray actor, rollout/sglang.py `_GUARD`)."""
    group, out = os.getpgid(pid), []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.getpgid(int(p)) == group:
                    out.append(int(p))
            except ProcessLookupError:
                pass
    return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(load_config(None).model)


def test_startup_timeout_bounds_the_bundle_wait(cluster, tmp_path, model):
    # 3 servers of {CPU: 1} on a 2-CPU cluster: never placeable; the wait is
    # rollout.sglang.startup_timeout_s (it was a fixed 900 s for a {GPU: 1} bundle)
    cfg = _cfg(tmp_path, "rollout.num_engines=3", "rollout.sglang.startup_timeout_s=2")
    t0 = time.monotonic()
    with pytest.raises(FleetError) as e:
        make_fleet(cfg, model, "0", EngineConfig(), tmp_path)
    took = time.monotonic() - t0
    assert took < 30, took
    msg = str(e.value)
    assert "could not reserve 3 bundles of {'CPU': 1.0} within 2s" in msg, msg
    assert "rollout.sglang.startup_timeout_s=2" in msg, msg
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.fixture(scope="module")
def fleet(cluster, model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang_fleet")
    cfg = _cfg(out)
    t0 = time.monotonic()
    f = make_fleet(cfg, model, "0", EngineConfig(), out)
    f.startup_seconds = time.monotonic() - t0
    yield f
    pids = [p for s in f.slots for p in _group_pids(s.pid)]
    f.close()
    assert all(wait_gone(p, 30) for p in pids), "SGLang processes outlived fleet.close()"


def test_cpu_bundles_and_loopback_bind(fleet):
    print(f"2 SGLang servers up and pushed in {fleet.startup_seconds:.1f}s")
    table = ray.util.placement_group_table(fleet.pg)
    assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    node_ip = ray.util.get_node_ip_address()
    for s in fleet.slots:
        assert s.state == "live" and s.url.startswith("http://127.0.0.1:"), s
        port = int(s.url.rsplit(":", 1)[1])
        if node_ip not in ("127.0.0.1", "localhost"):  # loopback only: not on the interface
            with pytest.raises(OSError), socket.create_connection((node_ip, port), 2):
                pass


def test_api_key_in_effect_and_off_every_command_line(fleet):
    for s in fleet.slots:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(s.url + "/server_info", timeout=10)
        assert e.value.code == 401
        pids = _group_pids(s.pid)
        assert len(pids) >= 4  # the guard, launch_server, scheduler, detokenizer
        key = fleet.transport.api_key.encode()
        for p in pids:
            assert key not in Path(f"/proc/{p}/cmdline").read_bytes(), p
            assert key not in Path(f"/proc/{p}/environ").read_bytes(), p
        cmd = Path(f"/proc/{s.pid}/cmdline").read_bytes().split(b"\0")
        assert cmd[0] == str(PYTHON).encode()  # rollout.sglang.python
        assert b"--device" in cmd and cmd[cmd.index(b"--device") + 1] == b"cpu"


def test_kill9_mid_generate_every_sample_once_and_server_relaunched(fleet, model):
    assert fleet.weight_sync == "distributed"  # the default (auto) for a fleet
    reqs = requests(k=8)
    once_each(fleet.generate(reqs), reqs, "0")
    victim = fleet.slots[1]
    old_pid, children = victim.pid, _group_pids(victim.pid)
    t0 = time.monotonic()
    got = _generate_killing(fleet, requests(k=8, seed=8), victim)
    print(f"generate with a kill -9: {time.monotonic() - t0:.1f}s")
    once_each(got, requests(k=8, seed=8), "0")
    # relaunched in its bundle at once; it joins the weight group at the next push
    assert victim.state == "joining" and fleet.slots[0].state == "live"
    assert fleet.stats.retried_groups >= 1
    assert all(wait_gone(p) for p in children)  # its children and guard died with it
    # the next push relaunches it in its bundle and re-creates the weight group with it: it
    # serves only once it holds the pushed weights
    torch.manual_seed(1)
    new = MoEModel(model.cfg)
    t0 = time.monotonic()
    assert fleet.update_weights(new, "1") == "1"
    print(f"relaunch + push: {time.monotonic() - t0:.1f}s; events: {fleet.stats.events}")
    assert victim.state == "live" and victim.pid != old_pid and victim.restarts == 1, \
        fleet.stats.events
    assert victim.url.startswith("http://127.0.0.1:")
    sync = fleet.transport  # the HTTP transport's weight group
    assert sync.pusher.sync is not None and victim.url in sync.pusher.sync_urls  # new group
    assert fleet.stats.disk_bytes_written == 0 and fleet.stats.push_bytes > 0
    reqs = requests(k=8, seed=9)
    got = fleet.generate(reqs)
    once_each(got, reqs, "1")
    assert set(fleet.placement.values()) == {0, 1}  # the relaunched server serves again
    # both servers hold exactly the pushed weights: greedy tokens equal our fp32 engine's
    greedy = [GenerateRequest(q.input_ids, SamplingParams(temperature=0.0, max_new_tokens=8),
                              rid=f"g{i}") for i, q in enumerate(requests(k=4, n=1, seed=11))]
    got = fleet.generate(greedy)
    assert set(fleet.placement.values()) == {0, 1}
    want = Engine.from_model(new, EngineConfig(dtype="fp32", max_running=8, max_len=64)
                             ).generate(greedy)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_release_memory_refused_on_cpu_sglang(fleet):
    with pytest.raises(RolloutError, match="SGLang on a CPU"):
        fleet.release_memory()
    with pytest.raises(RolloutError, match="SGLang on a CPU"):
        fleet.resume_memory()
    for s in fleet.slots:  # nothing was sent: the servers still serve
        assert s.state == "live" and alive(s.pid)
    reqs = requests(k=2, n=1, seed=10)
    once_each(fleet.generate(reqs), reqs, "1")
