"""`cluster.placement: colocated` trained on a real local Ray cluster: 2 actor ranks and 2
`lockstep serve` servers in the same 2 placement-group bundles (rollout/colocate.py).

- Ray's own actor table (GCS) puts server i in the actor group's placement group, in the bundle
  of rank i (2 ranks, 2 engines), taking 0.2 of its CPU next to the rank's 0.8.
- Between phases the servers are released (`/server_info` `memory_released` while the actor
  computes pi_old and updates) and resumed before the push and the next generate.
- The metrics equal the disaggregated run's (servers on bundles of their own) within
  docs/cluster.md's tolerance (they are in fact equal: placement changes no arithmetic).
"""

import json
import re
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lockstep.rollout.fleet import Fleet  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

pytestmark = pytest.mark.slow  # Ray, 2 ranks and 2 servers per run: ~40 s for both runs
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture(scope="module")
def cluster4():
    """A private local Ray with 4 logical CPUs: the disaggregated baseline needs 2 rank bundles
    + 2 server bundles; the colocated run must (and does) live in the ranks' 2 bundles."""
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def _placement_of(handle) -> tuple[str, set[int], dict[str, float]]:
    """(placement group id, bundle indices, resources) of a Ray actor, from the GCS actor table
    (Ray's record, not ours; the state API needs the dashboard, which the fixture leaves out)."""
    import ray._private.state as state
    from ray.core.generated import gcs_pb2
    raw = state.state._global_state_accessor.get_actor_info(handle._actor_id)
    d = gcs_pb2.ActorTableData.FromString(raw)
    pg = d.placement_group_id.hex()
    res = dict(d.required_resources)
    bundles = {int(m.group(1)) for k in res
               for m in [re.fullmatch(rf"bundle_group_(\d+)_{pg}", k)] if m}
    return pg, bundles, res


def _released(fleet: Fleet) -> list[list[str]]:
    import asyncio
    return [asyncio.run(s.client.get("/server_info"))["memory_released"] for s in fleet.slots]


def test_colocated_servers_share_the_ranks_bundles_and_train_like_disaggregated(cluster4,
                                                                                  tmp_path):
    sets = ["task.digits=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
            "loop.steps=3", "loop.tensorboard=false", "loop.plots=false",
            "loop.checkpoint_every=0", "warmstart.max_steps=60", "warmstart.eval_every=20",
            "warmstart.eval_size=32", f"warmstart.cache_dir={tmp_path / 'warmstart'}",
            "cluster.actor_ranks=2", "rollout.backend=serve", "rollout.num_engines=2"]
    runs = {}
    for name in ("disaggregated", "colocated"):
        cfg = load_config(CONFIGS / "toy_r3.yaml", sets + [f"cluster.placement={name}"])
        tr = Trainer(cfg, tmp_path / name, progress=False, log=lambda s: None)
        fleet, group = tr.rollout, tr.actor
        assert isinstance(fleet, Fleet)
        group_pg = group.placement_group.id.hex()
        ranks = [_placement_of(w) for w in group.workers]
        servers = [_placement_of(s.actor) for s in fleet.slots]
        if name == "colocated":
            for r, (pg, bundles, res) in enumerate(ranks):
                assert (pg, bundles) == (group_pg, {r})
                assert res[f"CPU_group_{r}_{pg}"] == pytest.approx(0.8)
            for i, (pg, bundles, res) in enumerate(servers):  # engine i: bundle of rank i
                assert (pg, bundles) == (group_pg, {i}), (i, pg, bundles, group_pg)
                assert res[f"CPU_group_{i}_{pg}"] == pytest.approx(0.2)
            assert fleet.colocate and fleet.pg is group.placement_group
            # nothing reserved beyond the ranks' 2 bundles
            assert ray.available_resources().get("CPU", 0) == pytest.approx(2.0)
            calls = {"release": 0, "resume": 0}
            seen: list[tuple[str, list]] = []
            for what in calls:
                orig = getattr(fleet, f"{what}_memory")

                def counted(tags=None, _orig=orig, _what=what):
                    calls[_what] += 1
                    return _orig(tags)
                setattr(fleet, f"{what}_memory", counted)
            for phase in ("old_logprobs", "policy_update"):  # the actor's phase: released
                orig = getattr(group, phase)

                def observed(*a, _orig=orig, _phase=phase, **k):
                    seen.append((_phase, _released(fleet)))
                    return _orig(*a, **k)
                setattr(group, phase, observed)
        else:
            assert not fleet.colocate and fleet.pg is not group.placement_group
            assert {pg for pg, _, _ in servers} == {fleet.pg.id.hex()} != {group_pg}
        tr.run()
        assert fleet.closed and group.closed
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                      .splitlines()]
    # 3 steps: released after each generate (3), resumed for each push (weights, 3) and before
    # the next generate (kv_cache, 2); both servers released during every actor call
    assert calls == {"release": 3, "resume": 5}, calls
    assert seen == [(p, [["kv_cache", "weights"]] * 2) for _ in range(3)
                    for p in ("old_logprobs", "policy_update")], seen
    base, colo = runs["disaggregated"], runs["colocated"]
    assert [r["step"] for r in colo] == [1, 2, 3]
    keys = [k for k in base[0] if not k.startswith("time/")]
    assert keys == [k for k in colo[0] if not k.startswith("time/")]
    for a, b in zip(base, colo):  # docs/cluster.md's tolerance (measured: equal)
        for k in keys:
            if k.split("/")[0] in ("step", "reward", "response", "routing", "replay"):
                assert a[k] == b[k], (a["step"], k)
            else:
                assert abs(a[k] - b[k]) <= 1e-2 * abs(a[k]) + 1e-4, (a["step"], k, a[k], b[k])
    assert all(r["actor/grad_norm"] > 0 for r in colo)
