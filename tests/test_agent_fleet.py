"""Multi-turn trajectories (rollout/agent.py) over a fleet of real loopback servers (`lockstep
serve`'s app on threads): the turns of a trajectory stay on the engine of its first turn, and an
engine lost mid-run sends its trajectories back to their first turn, once: every trajectory
comes back exactly once, equal to the in-process run's (same seeds, same weights); lost again,
a trajectory ends with the counted error `lost` and the run goes on. Through the trainer,
rollout.backend=http to `lockstep serve` gives the in-process run's metrics."""

import json
import textwrap

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.agent import ObservationCodec, TrajectoryRunner
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.env import EnvConfig, EnvPool
from lockstep.rollout.fleet import Fleet
from lockstep.rollout.server import ServerThread
from lockstep.rollout.tasks import build_tokenizer

from lockstep.trainer.driver.agent import trajectory_metrics
from lockstep.trainer.loop import Trainer

from metric_fixtures import metric_close
from model_fixtures import tiny_config
from test_agent import FIXED, V, _env_file, _requests
from test_agent_staleness import THREE_TURNS
from test_agent_train import _config

TOK = build_tokenizer()
ENGINE = EngineConfig(dtype="fp32", max_len=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(vocab_size=V, max_position_embeddings=64))


@pytest.fixture
def servers(model):
    srv = [ServerThread(Engine.from_model(model, ENGINE, weight_version="0")).start()
           for _ in range(3)]
    yield srv
    for s in srv:
        s.stop()


def _run(tmp_path, generate, model, release=None):
    cfg = EnvConfig(file=_env_file(tmp_path, FIXED), max_turns=3, num_workers=1)
    with EnvPool(cfg, log=lambda s: None) as env:
        runner = TrajectoryRunner(generate, env, ObservationCodec(TOK), 64,
                                  model.cfg.num_experts, eos_id=2, vocab_size=V, release=release)
        return runner.run(_requests(n_prompts=4, n=2), [{"k": i} for i in range(4)])


class Faults:
    """fleet.generate, stopping a server after some calls: `plan(calls so far, requests,
    placement)` gives the server to stop after a call, or None."""

    def __init__(self, fleet, servers, plan):
        self.fleet, self.servers, self.plan, self.calls = fleet, servers, plan, []

    def __call__(self, requests):
        try:
            return self.fleet.generate(requests)
        finally:
            self.calls.append((list(requests), dict(self.fleet.placement)))
            stop = self.plan(self.calls, requests, self.fleet.placement)
            if stop is not None:
                self.servers[stop].stop()


def _restarted(requests):
    return any("-restart" in r.rid for r in requests)


def _same(got, want):
    assert [(r.rid, r.index) for r in got] == [(r.rid, r.index) for r in want]
    for a, b in zip(got, want):
        assert a.prompt_ids + a.output_ids == b.prompt_ids + b.output_ids, (a.rid, a.index)
        assert torch.equal(a.routes_NLK, b.routes_NLK) and torch.equal(a.sampled_mask,
                                                                       b.sampled_mask)
        assert torch.allclose(a.output_logprobs, b.output_logprobs, atol=1e-5, rtol=0)


def test_engine_lost_mid_run_restarts_its_trajectories_once(tmp_path, model, servers):
    want = _run(tmp_path, Engine.from_model(model, ENGINE).generate, model)
    fleet = Fleet.http([s.url for s in servers[:2]], model.cfg)
    # engine 1 goes after the first turns
    faults = Faults(fleet, servers, lambda calls, reqs, p: 1 if len(calls) == 1 else None)
    released = []
    got = _run(tmp_path, faults, model,
               release=lambda ids: (released.extend(ids), fleet.release_trajectories(ids)))
    _same(got, want)  # every trajectory once, as the in-process run samples it
    on_1 = {(r.rid, j) for r in faults.calls[0][0] for j in range(r.sampling.n)
            if faults.calls[0][1][(r.rid, j)] == 1}
    assert on_1 and len(on_1) < 8
    assert {(r.rid, r.index) for r in got if r.trajectory.restarts} == on_1
    assert fleet.stats.trajectories_lost == len(on_1)
    assert all(r.trajectory.error is None and len(r.trajectory.turns) == 3 for r in got)
    assert trajectory_metrics(got)["agent/restarted"] == len(on_1)
    # the restarted ones ran on engine 0 from their first turn; every pin was released
    restarted = [rq for rq, _ in faults.calls if _restarted(rq)]
    assert restarted and all(set(p.values()) == {0} for rq, p in faults.calls[2:]
                             if rq in restarted)
    assert len(released) == 8 + len(on_1) and not fleet.pins.held


def test_lost_again_after_its_restart_is_a_counted_error(tmp_path, model, servers):
    fleet = Fleet.http([s.url for s in servers], model.cfg)

    def plan(calls, reqs, placement):
        if len(calls) == 1:
            return 1  # after the first turns
        if _restarted(reqs) and sum(_restarted(rq) for rq, _ in calls) == 1:
            return placement[(reqs[0].rid, 0)]  # the engine of the restarted first turns
        return None
    got = _run(tmp_path, Faults(fleet, servers, plan), model)
    lost = [r for r in got if r.trajectory.error == "lost"]
    assert lost and all(r.trajectory.restarts == 1 and r.trajectory.end == "error" for r in lost)
    assert all("lost again after a restart" in r.trajectory.message for r in lost)
    assert len(got) == 8 and all(r.trajectory.error in (None, "lost") for r in got)


def test_trajectories_over_lockstep_serve_give_the_in_process_metrics(tmp_path):
    """rollout.backend=http to a `lockstep serve` app (loopback thread): 2 steps of 3-turn
    trajectories, each later turn asking only its new route rows over the wire, give the
    in-process run's metrics (fp32: the same tokens, routes, rewards and log-probs)."""
    env_file = tmp_path / "env.py"
    env_file.write_text(textwrap.dedent(THREE_TURNS))
    env = {"file": str(env_file), "max_turns": 3, "num_workers": 1}
    sets = ["rollout.dtype=fp32", "loop.steps=2", "rollout.max_new_tokens=4"]
    local_cfg = _config(tmp_path, env, *sets)
    torch.manual_seed(123)  # the server starts from other weights: the trainer pushes its own
    engine = Engine(MoEModel(local_cfg.model), EngineConfig(dtype="fp32", max_running=64,
                                                            max_len=48))
    runs = {}
    with ServerThread(engine) as srv:
        for name, extra in (("local", []), ("http", ["rollout.backend=http",
                                                     f"rollout.url={srv.url}"])):
            tr = Trainer(_config(tmp_path, env, *sets, *extra), tmp_path / name,
                         progress=False, log=lambda s: None)
            tr.run()
            runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl")
                          .read_text().splitlines()]
        route_bytes = tr.rollout.route_bytes_received
    local, http = runs["local"], runs["http"]
    keys = [k for k in local[0] if not k.startswith("time/") and not k.startswith("rollout/")]
    assert local[0]["agent/turns_mean"] == 3.0 and engine.weight_version == "2"
    for a, b in zip(local, http):
        for k in keys:
            if k.split("/")[0] in ("step", "reward", "response", "routing", "replay", "agent"):
                assert a[k] == b[k], (a["step"], k)
            else:
                assert metric_close(k, a[k], b[k]), (a["step"], k, a[k], b[k])
    assert route_bytes > 0
