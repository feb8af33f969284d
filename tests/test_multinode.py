"""The multi-node tier: a Ray cluster of three raylets on this machine (tests/multinode_fixtures:
a head for the driver, node 0 at 127.31.0.2 and node 1 at 127.31.0.3, each with its own CPUs
and the label `lockstep-node`), with `cluster.node_label` pinning every bundle to the node
`lockstep plan` gives it.

- placement: actor ranks on node 0, `lockstep serve` engines on node 1 (their URLs on node 1's
  address, the weight group's rendezvous across nodes), where the plan says; the toy R3 run
  there equals the same run with every bundle on node 0, bit for bit;
- node loss, engines: node 1 killed mid-generate (both engines on it): the run finishes, the
  engines relaunched on the surviving node, every sample once;
- node loss, actor ranks: node 0 killed after a checkpoint: the run stops naming the node
  within 60 s; `--resume` on a node added in its place gives the uninterrupted run's metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lockstep.launch.plan import make_plan  # noqa: E402
from lockstep.trainer.config import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

from multinode_fixtures import LABEL, LocalCluster  # noqa: E402

pytestmark = pytest.mark.slow  # three raylets, ranks and engines: ~minutes on 2 cores
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
NODE0, NODE1 = "127.31.0.2", "127.31.0.3"
# toy_r3, smaller (as tests/test_group.py): a short warm start, 16 prompts x 8 samples
SETS = ["warmstart.target_accuracy=0.1", "warmstart.eval_every=10",
        "rollout.prompts_per_step=16", "actor.mini_batch_size=64", "actor.micro_batch_size=32",
        "loop.plots=false", "loop.tensorboard=false", "loop.steps=3",
        f"cluster.node_label={LABEL}"]
ONE_NODE = ["cluster.nodes=1", "cluster.cpus_per_node=4"]   # every bundle on node 0
TWO_NODES = ["cluster.nodes=2", "cluster.cpus_per_node=2"]  # ranks on node 0, engines on 1
GROUP = ["cluster.actor_ranks=2", "rollout.backend=serve", "rollout.num_engines=2"]


@pytest.fixture(scope="module")
def nodes():
    c = LocalCluster()
    try:
        c.add(0, 4, NODE0)
        c.add(1, 2, NODE1)
        c.connect()
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warmstart")


def _cfg(nodes, cache, *sets):
    return load_config(CONFIGS / "toy_r3.yaml", [
        *SETS, f"warmstart.cache_dir={cache}", f"cluster.ray_address={nodes.address}", *sets])


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.fixture(scope="module")
def two_node_run(nodes, cache, tmp_path_factory):
    """The toy R3 run with its actor ranks on node 0 and its engines on node 1."""
    out = tmp_path_factory.mktemp("two")
    cfg = _cfg(nodes, cache, *GROUP, *TWO_NODES)
    tr = Trainer(cfg, out, progress=False, log=lambda s: None)
    tr.run()
    return cfg, tr, out


def test_placement_follows_the_plan_and_two_nodes_equal_one(nodes, cache, two_node_run,
                                                           tmp_path):
    cfg, tr, out = two_node_run
    plan = make_plan(cfg)
    assert not plan["refusals"], plan["refusals"]
    planned_ranks = [r["node"] for r in plan["actor"]["rank_layout"]]
    planned_engines = [e["node"] for e in plan["placement"]["engines"]]
    assert planned_ranks == [0, 0] and planned_engines == [1, 1]
    # where Ray put each actor (each reports its own node) is where the plan put it
    assert [nodes.plan_node(i.node) for i in tr.actor.infos] == planned_ranks
    assert [nodes.plan_node(s.node) for s in tr.rollout.slots] == planned_engines
    assert {i.ip for i in tr.actor.infos} == {NODE0}  # rank 0 hosted the rendezvous there
    # the servers listen on node 1's address (nothing on 127.0.0.1), and the driver reached
    # them there: every step's samples came over HTTP from node 1
    assert all(s.url.startswith(f"http://{NODE1}:") for s in tr.rollout.slots)
    assert tr.rollout.stats.pushes == 4 and tr.rollout.weight_sync == "distributed"
    # the same run with every bundle on node 0: the same numbers, bit for bit
    one = Trainer(_cfg(nodes, cache, *GROUP, *ONE_NODE), tmp_path / "one", progress=False,
                  log=lambda s: None)
    one.run()
    assert {nodes.plan_node(s.node) for s in one.rollout.slots} == {0}
    two_m, one_m = _metrics(out), _metrics(tmp_path / "one")
    assert [r["step"] for r in two_m] == [1, 2, 3]
    assert two_m == one_m
    assert all(r["actor/grad_norm"] > 0 for r in two_m)  # the policy moved every step
