"""Trajectory pins in the dispatcher (rollout/pins.py) over real loopback servers (`lockstep
serve`'s app on threads, no Ray): every turn of a trajectory goes to the engine of its first
turn and asks only its new route rows; a trajectory whose engine is lost between turns is
reported lost (not sent elsewhere: its routes and prefix cache are there) while the others'
results come back; started again from its first turn, it lands on a live engine and every
trajectory ends exactly once, each equal to the in-process engine's."""

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.replay.trace import RoutingTrace
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.fleet import Fleet
from lockstep.rollout.pins import TrajectoriesLost
from lockstep.rollout.server import ServerThread
from lockstep.rollout.types import GenerateRequest, RolloutError, SamplingParams

from model_fixtures import tiny_config

ENGINE = EngineConfig(dtype="fp32", max_running=16, max_len=48)
OBS = [5, 6, 7]  # what the "environment" answers after every turn


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))


@pytest.fixture
def servers(model):
    srv = [ServerThread(Engine.from_model(model, ENGINE, weight_version="0")).start()
           for _ in range(2)]
    yield srv
    for s in srv:
        s.stop()


class Trajectories:
    """k trajectories of `turns` turns over `backend.generate`: turn t of trajectory i is a
    request carrying the whole trajectory so far, seeded by (i, t), routes from the previous
    turn's trace end; `engines[name]` is where each turn ran (a fleet's placement)."""

    def __init__(self, k: int, turns: int = 3):
        g = torch.Generator().manual_seed(7)
        self.prompts = {f"t{i}": torch.randint(3, 40, (int(p),), generator=g).tolist()
                        for i, p in enumerate(torch.randint(2, 8, (k,), generator=g))}
        self.turns = turns
        self.start_all()

    def start_all(self):
        self.state = {name: {"ids": list(p), "trace": None, "turn": 0, "outs": []}
                      for name, p in self.prompts.items()}
        self.engines = {name: [] for name in self.prompts}

    def restart(self, name):
        self.state[name] = {"ids": list(self.prompts[name]), "trace": None, "turn": 0,
                            "outs": []}
        self.engines[name] = []

    def requests(self, E):
        out = []
        for name, st in self.state.items():
            if st["turn"] < self.turns:
                seed = 1000 * int(name[1:]) + st["turn"]
                out.append(GenerateRequest(list(st["ids"]), SamplingParams(
                    max_new_tokens=3, seed=seed, ignore_eos=True), rid=f"{name}-{st['turn']}",
                    routes_start=0 if st["trace"] is None else st["trace"].end,
                    trajectories=(name,)))
        return out

    def take(self, results, E, placement=None):
        for res in results:
            if res is None:
                continue
            name = res.rid.rsplit("-", 1)[0]
            st = self.state[name]
            part = RoutingTrace(res.routes_NLK, E, start=res.routes_start)
            st["trace"] = part if st["trace"] is None else st["trace"].extend(part)
            st["outs"].append(res.output_ids)
            st["ids"] += res.output_ids + (OBS if st["turn"] + 1 < self.turns else [])
            st["turn"] += 1
            if placement is not None:
                self.engines[name].append(placement[(res.rid, 0)])

    def done(self):
        return all(st["turn"] == self.turns for st in self.state.values())


def _reference(model, k):
    """The same trajectories on the in-process engine (one call per turn)."""
    engine, trajs = Engine.from_model(model, ENGINE), Trajectories(k)
    E = model.cfg.num_experts
    while not trajs.done():
        trajs.take(engine.generate(trajs.requests(E)), E)
    return trajs


def _same(got, want):
    for name in want.state:
        a, b = got.state[name], want.state[name]
        assert a["ids"] == b["ids"] and a["trace"] == b["trace"], name


def test_turns_stay_on_one_engine_and_equal_the_engine(model, servers):
    fleet = Fleet.http([s.url for s in servers], model.cfg)
    E, trajs = model.cfg.num_experts, Trajectories(6)
    while not trajs.done():  # later turns in reverse order: balancing alone would swap them
        reqs = trajs.requests(E)
        trajs.take(fleet.generate(reqs if trajs.engines["t0"] == [] else reqs[::-1]), E,
                   fleet.placement)
    _same(trajs, _reference(model, 6))
    assert all(len(set(e)) == 1 for e in trajs.engines.values()), trajs.engines
    assert {e[0] for e in trajs.engines.values()} == {0, 1}  # first turns were balanced
    for st in trajs.state.values():  # stitched routes cover every position but the last
        assert st["trace"].start == 0 and st["trace"].end == len(st["ids"]) - 1
    assert fleet.stats.trajectories_lost == 0 and len(fleet.pins.held) == 6
    fleet.release_trajectories(list(trajs.state))
    assert not fleet.pins.held


def test_engine_lost_between_turns_loses_its_trajectories_once(model, servers):
    fleet = Fleet.http([s.url for s in servers], model.cfg)
    E, trajs = model.cfg.num_experts, Trajectories(6)
    trajs.take(fleet.generate(trajs.requests(E)), E, fleet.placement)  # turn 1
    on_1 = sorted(n for n, e in trajs.engines.items() if e == [1])
    assert on_1
    assert len(on_1) == 3
    servers[1].stop()  # connection refused from now on
    held = on_1[0]  # its environment is still thinking: no turn 2 request in this call
    reqs = [r for r in trajs.requests(E) if r.trajectories != (held,)]
    with pytest.raises(TrajectoriesLost) as e:
        fleet.generate(reqs)  # turn 2: engine 1's trajectories cannot go on
    assert sorted(e.value.lost) == on_1[1:]
    assert "engine 1 was lost mid-trajectory" in e.value.lost[on_1[1]]
    assert [r is None for r in e.value.results] == [r.trajectories[0] in on_1 for r in reqs]
    trajs.take(e.value.results, E, fleet.placement)  # the others' turn 2 is kept
    with pytest.raises(TrajectoriesLost) as e:  # engine 1 is known dead: not even sent
        fleet.generate([r for r in trajs.requests(E) if r.trajectories == (held,)])
    assert list(e.value.lost) == [held] and e.value.results == [None]
    assert "engine 1 was lost after their last turn" in e.value.lost[held]
    for name in on_1:
        trajs.restart(name)  # from the first turn
    while not trajs.done():
        trajs.take(fleet.generate(trajs.requests(E)), E, fleet.placement)
    _same(trajs, _reference(model, 6))  # every trajectory once, the engine's (per-turn seeds)
    assert all(e == [0, 0, 0] for n, e in trajs.engines.items() if n in on_1)
    assert fleet.stats.trajectories_lost == len(on_1)


def test_trajectory_ids_are_checked(model, servers):
    fleet = Fleet.http([s.url for s in servers], model.cfg)
    two = [GenerateRequest([3, 4], rid=f"r{i}", trajectories=("a",)) for i in range(2)]
    with pytest.raises(RolloutError, match="trajectory 'a' has two requests in one generate"):
        fleet.generate(two)
    with pytest.raises(RolloutError, match=r"must be one non-empty id per sample \(n=2\)"):
        fleet.generate([GenerateRequest([3, 4], SamplingParams(n=2), trajectories=("a",))])
