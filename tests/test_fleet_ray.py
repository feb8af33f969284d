"""The rollout fleet on a real local Ray cluster: `lockstep serve` servers as Ray actors.

- The RL loop over 2 servers (weights pushed with /update_weights_from_distributed over gloo)
  gives the in-process run's metrics for the same seed, and writes no weight bytes to disk.
- kill -9 of one server's process mid-generate: every sample comes back exactly once (equal to
  the in-process engine's), and the server is relaunched with the current weights at the push.
- A hung server (SIGSTOP) times out, is treated as dead, killed and relaunched.
"""

import dataclasses
import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.rollout.engine import Engine, EngineConfig  # noqa: E402
from lockstep.rollout.fleet import Fleet  # noqa: E402
from lockstep.trainer.config import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

from model_fixtures import tiny_config  # noqa: E402
from test_fleet import requests, same  # noqa: E402

pytestmark = pytest.mark.slow  # Ray and its worker processes take ~15-30 s to start
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DISTRIBUTED = importlib.util.find_spec("lockstep.rollout.weight_sync") is not None
SYNC = "distributed" if DISTRIBUTED else "disk"
# two slots per server: a fanned-out group's samples finish one after another, so a kill
# lands while some of a group's samples are in and others are not
ENGINE = EngineConfig(dtype="fp32", max_running=2, max_len=48)
LOCAL = dataclasses.replace(ENGINE, max_running=16)  # the reference (fp32: batch-independent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_rl_loop_on_two_servers_equals_in_process(cluster, tmp_path):
    # 1-digit addition after a short supervised warm start (cached for the second run): the
    # policy earns rewards in some groups, so every step changes the weights (a push that did
    # not reach the engines would change the samples)
    sets = ["task.digits=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
            "loop.steps=5", "loop.tensorboard=false", "loop.plots=false",
            "loop.checkpoint_every=0", "warmstart.max_steps=60", "warmstart.eval_every=20",
            "warmstart.eval_size=32", f"warmstart.cache_dir={tmp_path / 'warmstart'}"]
    runs = {}
    for name, extra in (("local", []), ("fleet", ["rollout.backend=serve",
                                                  "rollout.num_engines=2"])):
        cfg = load_config(CONFIGS / "toy_r3.yaml", sets + extra)
        tr = Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)
        tr.run()
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                      .splitlines()]
        if name == "fleet":
            fleet = tr.rollout
    assert isinstance(fleet, Fleet) and len(fleet.slots) == 2 and fleet.closed
    assert fleet.weight_sync == SYNC and fleet.stats.pushes == 5
    assert {e for e in fleet.placement.values()} == {0, 1}  # both engines served the last step
    local, remote = runs["local"], runs["fleet"]
    assert [r["step"] for r in remote] == [1, 2, 3, 4, 5]
    keys = [k for k in local[0] if not k.startswith("time/")]
    assert keys == [k for k in remote[0] if not k.startswith("time/")]
    for a, b in zip(local, remote):
        # Same seeds and weights: the same tokens, routes and rewards (exact). A bf16 engine's
        # log-probs depend on the batch a sample shares (matmul blocking; each server sees half
        # the batch), at bf16-rounding level (~1e-5, docs/ray.md): what depends on the rollout
        # log-probs (KL, ppl, IS weights, is_split) is held to docs/cluster.md's tolerance,
        # rtol 1e-2 with atol 1e-4 for near-zero means. A missed push or wrong weights changes
        # the tokens and rewards; a dropped route shows in replay/mismatch.
        for k in keys:
            if k.split("/")[0] in ("step", "reward", "response", "routing", "replay"):
                assert a[k] == b[k], (a["step"], k)
            else:
                assert abs(a[k] - b[k]) <= 1e-2 * abs(a[k]) + 1e-4, (a["step"], k, a[k], b[k])
    assert remote[-1]["replay/mismatch"] == 0.0
    assert all(r["actor/grad_norm"] > 0 for r in local)  # the policy moved every step
    if DISTRIBUTED:  # weights travelled by broadcast only: nothing written for them
        assert fleet.stats.disk_bytes_written == 0 and fleet.stats.push_bytes > 0
        assert not (tmp_path / "fleet" / "weights").exists()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))


@pytest.fixture(scope="module")
def fleet(cluster, model, tmp_path_factory):
    f = Fleet.serve(model, ENGINE, 2, "0", weight_sync=SYNC, fan_out_samples=True,
                    weights_dir=tmp_path_factory.mktemp("weights"), request_timeout_s=120.0,
                    max_engine_restarts=2)
    yield f
    f.close()


def _perturbed(model, seed):
    m = MoEModel(model.cfg)
    m.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def _generate_killing(fleet, reqs, slot, sig):
    """Run generate on a thread; once `slot` has answered one sample and has more in flight,
    send `sig` to its server process."""
    out, pid = {}, slot.pid

    def run():
        try:
            out["r"] = fleet.generate(reqs)
        except Exception as e:  # noqa: BLE001 - re-raised below, in the test's thread
            out["e"] = e
    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 60
    while not (slot.index in fleet.placement.values() and slot.load > 0):
        assert time.monotonic() < deadline and th.is_alive(), "the slot never got work"
        time.sleep(0.002)
    os.kill(pid, sig)
    th.join(120)
    assert not th.is_alive()
    if "e" in out:
        raise out["e"]
    return out["r"]


def test_kill9_mid_generate_every_sample_once_and_server_back(fleet, model):
    reqs = lambda: requests(k=8, n=4, max_new=12)  # noqa: E731
    victim = fleet.slots[1]
    old_pid = victim.pid
    got = _generate_killing(fleet, reqs(), victim, signal.SIGKILL)
    # every sample exactly once, each the in-process engine's (per-sample seeds)
    same(got, Engine.from_model(model, LOCAL).generate(reqs()))
    assert victim.state == "dead" and fleet.slots[0].state == "live"
    assert fleet.stats.retried_groups >= 1
    assert fleet.stats.duplicates_dropped >= 1  # a resent group's answered samples came back
    assert _wait_gone(old_pid)
    # the next push relaunches it in its bundle; it gets the current weights before serving
    new = _perturbed(model, 1)
    assert fleet.update_weights(new, "1") == "1"
    assert victim.state == "live" and victim.pid != old_pid and victim.restarts == 1
    got = fleet.generate(reqs())
    same(got, Engine.from_model(new, LOCAL).generate(reqs()))
    assert {r.weight_version for r in got} == {"1"}
    assert set(fleet.placement.values()) == {0, 1}


def test_hung_server_times_out_is_killed_and_relaunched(fleet, model):
    weights = _perturbed(model, 2)
    fleet.update_weights(weights, "2")
    victim = fleet.slots[0]
    old_pid = victim.pid
    fleet.request_timeout_s = 6.0  # short, for the test; few requests so live ones finish
    try:
        t0 = time.monotonic()
        got = _generate_killing(fleet, requests(k=4, n=2), victim, signal.SIGSTOP)
        took = time.monotonic() - t0
    finally:
        fleet.request_timeout_s = 120.0
        try:
            os.kill(old_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    same(got, Engine.from_model(weights, LOCAL).generate(requests(k=4, n=2)))
    assert victim.state == "dead" and "no answer within" in victim.last_error
    assert took >= 6.0  # it waited for the timeout, not for the server
    assert _wait_gone(old_pid)  # the hung process was killed, its bundle freed
    fleet.update_weights(weights, "3")
    assert victim.state == "live" and victim.pid != old_pid
    assert set(fleet.placement.values()) <= {0, 1}
    got = fleet.generate(requests(k=4, n=2))
    assert {r.weight_version for r in got} == {"3"} and set(fleet.placement.values()) == {0, 1}
