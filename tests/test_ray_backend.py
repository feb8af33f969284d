"""`rollout.backend: ray` (`Fleet.ray`: embedded engines as Ray actors) on a real local Ray
cluster (2 CPUs, 2 engines): results equal the in-process engine's, weight pushes through the
object store reach every engine, a stale weight version is refused, and the RL loop runs on it
and survives an engine killed -9 mid-step. The dispatcher's faults for every backend are in
test_fleet_faults.py. One cluster for the module; ~1 minute on 2 cores."""

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from lockstep.kernels.threads import policy_env, policy_text  # noqa: E402
from lockstep.moe.buckets import bucketize  # noqa: E402
from lockstep.moe.checkpoint import hf_state_dict, save_hf  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.rollout.client import LocalBackend, RolloutError  # noqa: E402
from lockstep.rollout.engine import Engine  # noqa: E402
from lockstep.rollout.engine_config import EngineConfig  # noqa: E402
from lockstep.rollout.fleet import Fleet  # noqa: E402
from lockstep.rollout.slots import shard  # noqa: E402
from lockstep.rollout.types import GenerateRequest, SamplingParams  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
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


def _shard(reqs, k):
    return shard(reqs, k, lambda r: r.sampling.n)


def test_shard_keeps_groups_whole_balanced_and_in_order():
    reqs = [GenerateRequest([3], SamplingParams(n=n), rid=str(i)) for i, n in
            enumerate([4, 4, 1, 1, 1, 1, 8, 4])]
    parts = _shard(reqs, 3)
    assert [r for p in parts for r in p] == reqs
    assert [sum(r.sampling.n for r in p) for p in parts] == [8, 12, 4]
    assert _shard(reqs[:1], 3) == [[reqs[0]], [], []]


class TestTwoEngines:
    """One 2-engine backend for the parity and weight-sync checks (closed after the class)."""

    @pytest.fixture(scope="class")
    def backend(self, cluster, model, tmp_path_factory):
        # built from an HF folder (the Trainer test covers building from a model's state dict)
        b = Fleet.ray(save_hf(model, tmp_path_factory.mktemp("hf")), ENGINE, num_engines=2)
        yield b
        b.close()

    def test_workers_placed_one_thread_each(self, backend):
        pids = {i.pid for i in backend.slots}
        assert len(pids) == 2 and os.getpid() not in pids
        assert [i.threads for i in backend.slots] == [1, 1]
        pg_table = ray.util.placement_group_table(backend.pg)
        assert pg_table["state"] == "CREATED" and len(pg_table["bundles"]) == 2
        assert all(b == {"CPU": 1.0} for b in pg_table["bundles"].values())

    def test_generation_equals_local_engine(self, backend, model):
        local = LocalBackend(Engine.from_model(model, ENGINE))
        reqs = _requests()
        want = local.generate(_requests())
        got = backend.generate(reqs)
        assert len(got) == 15 and set(backend.placement.values()) == {0, 1}  # both engines
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
        halves = [len(p) * 3 for p in _shard(_requests(seed=7), 2)]
        for lo, hi in ((0, halves[0]), (halves[0], sum(halves))):
            assert any(a.output_ids != b.output_ids or
                       not torch.allclose(a.output_logprobs, b.output_logprobs)
                       for a, b in zip(after[lo:hi], before[lo:hi]))
        # a native state dict, cast to the engines' dtypes; version bumped when not given
        assert backend.update_weights(new.state_dict()) == "v1+1"
        _assert_same(backend.generate(_requests(seed=7)),
                     [dataclasses.replace(r, weight_version="v1+1") for r in after])
        # a stream of HF-named buckets (a generator: consumed once, each bucket put once)
        stream = bucketize(hf_state_dict(model).items(), 16 << 10)
        assert backend.update_weights(stream, "v1+2") == "v1+2" and next(stream, None) is None
        n_bytes = sum(t.numel() * t.element_size() for t in hf_state_dict(model).values())
        assert backend.last_push["mode"] == "object_store" and backend.last_push["buckets"] > 4
        assert backend.last_push["bytes"] == n_bytes  # fp32 engines: nothing cast
        local = LocalBackend(Engine.from_model(model, ENGINE, weight_version="v1+2"))
        _assert_same(backend.generate(_requests(seed=7)), local.generate(_requests(seed=7)))

    def test_stale_weight_version_is_refused(self, backend, model):
        # one worker loads weights behind the backend's back
        ray.get(backend.slots[0].actor.update_weights.remote(model.state_dict(), "rogue"))
        with pytest.raises(RolloutError, match=r"engine 0 .* weight version 'rogue', "
                                               r"expected 'v1\+2'"):
            backend.generate(_requests(n_prompts=2))
        assert backend.update_weights(model, "v2") == "v2"  # one push brings all back in line
        assert {r.weight_version for r in backend.generate(_requests(n_prompts=2))} == {"v2"}


def _capture(tr, kill_at_step=None, engine=1):
    """Wrap the trainer's rollout: record each step's results and, at `kill_at_step`, kill -9
    engine `engine` while its share of the step is in flight (SIGSTOP first, so it cannot
    answer before the SIGKILL lands 0.5 s into the call), then run that step's requests once
    more (the restarted engine takes half of them)."""
    seen = {}
    generate = tr.rollout.generate

    def wrapped(requests):
        step = int(requests[0].rid[1:].split("p")[0])
        rec = seen[step] = {"pids": [i.pid for i in getattr(tr.rollout, "slots", [])],
                            "samples": [i.samples for i in getattr(tr.rollout, "slots", [])]}
        if step == kill_at_step:
            victim = tr.rollout.slots[engine].pid
            os.kill(victim, signal.SIGSTOP)
            rec["victim"] = victim
            threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
        rec["results"] = generate(requests)
        rec["served"] = [i.samples - s for i, s in
                         zip(getattr(tr.rollout, "slots", []), rec["samples"])]
        if step == kill_at_step:  # the same requests again, on the restarted worker too
            before = [i.samples for i in tr.rollout.slots]
            rec["again"] = generate(requests)
            rec["again_served"] = [i.samples - s for i, s in zip(tr.rollout.slots, before)]
        return rec["results"]

    tr.rollout.generate = wrapped
    return seen


def test_trainer_survives_kill_9_mid_generate(cluster, tmp_path):
    """3 RL steps on 2 engines; engine 1 is killed -9 in step 2 (after a weight push): the step
    finishes with every sample exactly once, equal to an uninterrupted (in-process) run, and
    the restarted engine serves step 3."""
    sets = ["warmstart.enabled=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=6", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
            "loop.steps=3", "loop.tensorboard=false", "loop.plots=false", "rollout.dtype=fp32",
            # every update moves the weights (with all-equal rewards GRPO's gradient is zero)
            "loss.entropy_coef=0.01", "actor.lr=1e-2"]
    ray_sets = sets + ["rollout.backend=ray", "rollout.num_engines=2"]
    tr = Trainer(load_config(CONFIGS / "toy_r3.yaml", ray_sets), tmp_path / "ray", progress=False,
                 log=lambda s: None)
    assert isinstance(tr.rollout, Fleet) and tr.rollout.weight_sync == "object_store"
    assert len(tr.rollout.slots) == 2
    seen = _capture(tr, kill_at_step=2)
    tr.run()
    ref = Trainer(load_config(CONFIGS / "toy_r3.yaml", sets), tmp_path / "ref", progress=False,
                  log=lambda s: None)
    want = _capture(ref)
    ref.run()
    for step in (1, 2, 3):
        got = seen[step]["results"]
        keys = [(r.rid, r.index) for r in got]
        assert len(keys) == len(set(keys)) == 16  # every sample exactly once
        _assert_same(got, want[step]["results"])
        assert {r.weight_version for r in got} == {str(step - 1)}
    # the restarted worker holds the current weights before the next push (same samples)
    _assert_same(seen[2]["again"], want[2]["results"])
    assert seen[2]["again_served"] == [8, 8]
    victim = seen[2]["victim"]
    assert victim == seen[1]["pids"][1] and victim not in seen[3]["pids"]
    assert seen[3]["pids"][0] == seen[1]["pids"][0]  # the survivor was left alone
    assert [i.restarts for i in tr.rollout.slots] == [0, 1]
    assert seen[3]["served"] == [8, 8]  # the restarted engine took its share of step 3
    rows = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["replay/mismatch"] == 0.0
    for r, w in zip(rows, ref_rows):
        assert r["reward/mean"] == w["reward/mean"]
        assert r["rollout_corr/k3_kl"] == pytest.approx(w["rollout_corr/k3_kl"], abs=1e-6)
    assert tr.rollout.closed  # run() released the workers and the placement group


def test_trainer_engine_workers_run_threads_per_rank(cluster, tmp_path):
    """cluster.threads_per_rank reaches the Ray engine workers the loop starts (each sets its
    own torch thread count; the driver keeps its own)."""
    cfg = load_config(CONFIGS / "toy_r3.yaml", [
        "warmstart.enabled=false", "rollout.prompts_per_step=4", "actor.mini_batch_size=32",
        "actor.micro_batch_size=32", "loop.tensorboard=false", "loop.plots=false",
        "rollout.backend=ray", "rollout.num_engines=2", "cluster.threads_per_rank=2"])
    tr = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    try:
        assert [i.threads for i in tr.rollout.slots] == [2, 2]
        # the engines wait as the driver chose (kernels/threads.py), not as OpenMP defaults
        want = policy_text(policy_env())
        assert want and [i.wait_policy for i in tr.rollout.slots] == [want] * 2
    finally:
        tr.rollout.close()
