"""RayBackend on a real local Ray cluster (2 CPUs, 2 engine workers): results equal the
in-process engine's, weight pushes reach every worker, the RL loop runs on it, and a worker
that dies is named in the error. One cluster for the module; ~1 minute on 2 cores."""

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from lockstep.rollout.ray_backend import RayBackend, shard  # noqa: E402
from lockstep.moe.checkpoint import save_hf  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.rollout.client import LocalBackend, RolloutError  # noqa: E402
from lockstep.rollout.engine import Engine, EngineConfig  # noqa: E402
from lockstep.rollout.types import GenerateRequest, SamplingParams  # noqa: E402
from lockstep.trainer.config import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

from model_fixtures import tiny_config  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster and its worker processes take ~15-30 s to start
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ENGINE = EngineConfig(dtype="fp32", max_running=16, max_len=48)



@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))


def _requests(n_prompts=5, n=3, max_new=10, seed=100):
    g = torch.Generator().manual_seed(seed)
    return [GenerateRequest(torch.randint(3, 40, (int(p),), generator=g).tolist(),
                            SamplingParams(temperature=1.1, max_new_tokens=max_new, n=n,
                                           seed=seed + 1000 * i), rid=f"p{i}")
            for i, p in enumerate(torch.randint(2, 12, (n_prompts,), generator=g))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_same(got, want):
    assert [(r.rid, r.index) for r in got] == [(r.rid, r.index) for r in want]
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids, (g.rid, g.index)
        assert torch.allclose(g.output_logprobs, w.output_logprobs, atol=1e-5, rtol=0)
        assert torch.equal(g.routes_NLK, w.routes_NLK), (g.rid, g.index)
        assert g.weight_version == w.weight_version


def test_shard_keeps_groups_whole_balanced_and_in_order():
    reqs = [GenerateRequest([3], SamplingParams(n=n), rid=str(i)) for i, n in
            enumerate([4, 4, 1, 1, 1, 1, 8, 4])]
    parts = shard(reqs, 3)
    assert [r for p in parts for r in p] == reqs
    assert [sum(r.sampling.n for r in p) for p in parts] == [8, 12, 4]
    assert shard(reqs[:1], 3) == [[reqs[0]], [], []]


class TestTwoEngines:
    """One 2-engine backend for the parity and weight-sync checks (closed after the class)."""

    @pytest.fixture(scope="class")
    def backend(self, cluster, model, tmp_path_factory):
        # built from an HF folder (the Trainer test covers building from a model's state dict)
        b = RayBackend(save_hf(model, tmp_path_factory.mktemp("hf")), ENGINE, num_engines=2)
        yield b
        b.close()

    def test_workers_placed_one_thread_each(self, backend):
        pids = {i.pid for i in backend.infos}
        assert len(pids) == 2 and os.getpid() not in pids
        assert [i.threads for i in backend.infos] == [1, 1]
        pg_table = ray.util.placement_group_table(backend.pg)
        assert pg_table["state"] == "CREATED" and len(pg_table["bundles"]) == 2
        assert all(b == {"CPU": 1.0} for b in pg_table["bundles"].values())

    def test_generation_equals_local_engine(self, backend, model):
        local = LocalBackend(Engine.from_model(model, ENGINE))
        reqs = _requests()
        want = local.generate(_requests())
        got = backend.generate(reqs)
        assert len(got) == 15 and all(shard(reqs, 2))  # both workers had requests
        _assert_same(got, want)

    def test_weight_sync_reaches_every_worker(self, backend, model, tmp_path):
        new = MoEModel(model.cfg)  # fresh random weights (a different seed than `model`)
        before = backend.generate(_requests(seed=7))
        assert backend.update_weights(save_hf(new, tmp_path / "new"), "v1") == "v1"
        after = backend.generate(_requests(seed=7))
        assert {r.weight_version for r in after} == {"v1"}
        local = LocalBackend(Engine.from_model(model, ENGINE))
        local.update_weights(new, "v1")
        _assert_same(after, local.generate(_requests(seed=7)))
        # every worker's share changed (each worker loaded the new weights)
        halves = [len(p) * 3 for p in shard(_requests(seed=7), 2)]
        for lo, hi in ((0, halves[0]), (halves[0], sum(halves))):
            assert any(a.output_ids != b.output_ids or
                       not torch.allclose(a.output_logprobs, b.output_logprobs)
                       for a, b in zip(after[lo:hi], before[lo:hi]))
        # a native state dict, cast to the engines' dtypes; version bumped when not given
        assert backend.update_weights(new.state_dict()) == "v1+1"
        _assert_same(backend.generate(_requests(seed=7)),
                     [dataclasses.replace(r, weight_version="v1+1") for r in after])

    def test_stale_weight_version_is_refused(self, backend, model):
        # one worker loads weights behind the backend's back
        ray.get(backend.workers[0].update_weights.remote(model.state_dict(), "rogue"))
        with pytest.raises(RolloutError, match=r"engine worker 0 .* weight version 'rogue', "
                                               r"expected 'v1\+1'"):
            backend.generate(_requests(n_prompts=2))
        assert backend.update_weights(model, "v2") == "v2"  # one push brings all back in line
        assert {r.weight_version for r in backend.generate(_requests(n_prompts=2))} == {"v2"}

    def test_dead_worker_is_named_and_ends_the_backend(self, backend):
        # NOTE: last in the class: it kills the shared backend (one start fewer, ~15 s).
        victim = backend.infos[1]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(RolloutError, match=rf"engine worker 1 \(.*pid {victim.pid}.*\) died "
                                               r"during generate"):
            backend.generate(_requests(n_prompts=4))
        assert backend.closed and backend.pg is None
        survivor = backend.infos[0].pid  # killed by close(), not left holding its CPU
        deadline = time.monotonic() + 30
        while _alive(survivor) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(survivor)
        with pytest.raises(RolloutError, match="closed"):
            backend.generate(_requests(n_prompts=1))


def test_trainer_runs_two_steps_on_ray(cluster, tmp_path):
    sets = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=6", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
            "loop.steps=2", "loop.tensorboard=false", "loop.plots=false",
            "rollout.backend=ray", "rollout.num_engines=2"]
    cfg = load_config(CONFIGS / "toy_r3.yaml", sets)
    tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    assert isinstance(tr.rollout, RayBackend) and len(tr.rollout.infos) == 2
    summary = tr.run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["replay/mismatch"] == 0.0 and summary["steps"] == 2
    assert tr.rollout.closed  # run() released the workers and the placement group
