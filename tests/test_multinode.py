"""The multi-node tier: a Ray cluster of three raylets on this machine (tests/multinode_fixtures:
a head for the driver, node 0 at 127.31.0.2 and node 1 at 127.31.0.3, each with its own CPUs
and the label `lockstep-node`), with `cluster.node_label` pinning every bundle to the node
`lockstep plan` gives it.

- placement: actor ranks on node 0, `lockstep serve` engines on node 1 (their URLs on node 1's
  address, the weight group's rendezvous across nodes), where the plan says; the toy R3 run
  there equals the same run with every bundle on node 0, bit for bit;
- real SGLang (`sglang` tier, skipped without its venv): two servers on node 1, bound to its
  address, serving exactly the pushed weights at every step of the toy R3 run;
- node loss, engines: node 1 killed mid-generate (both engines on it): the run finishes, the
  engines relaunched on the surviving node, every sample once;
- node loss, actor ranks: node 0 killed after a checkpoint: the run stops naming the node
  within 60 s; `--resume` on a node added in its place gives the uninterrupted run's metrics.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lockstep.launch.plan import make_plan  # noqa: E402
from lockstep.trainer.config.load import load_config  # noqa: E402
from lockstep.trainer.loop import Trainer  # noqa: E402

from multinode_fixtures import LABEL, LocalCluster, descendants  # noqa: E402
from sglang_fixtures import PYTHON as SGLANG_PYTHON, SHIMS, VENV as SGLANG_VENV  # noqa: E402

pytestmark = pytest.mark.slow  # three raylets, ranks and engines: ~minutes on 2 cores
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
NODE0, NODE1 = "127.31.0.2", "127.31.0.3"
NEW1, NEW0 = "127.31.0.4", "127.31.0.5"  # the nodes added in place of lost ones
# toy_r3, smaller (as tests/test_group.py): no warm start, 8 prompts x 4 samples
SETS = ["warmstart.enabled=false", "loss.entropy_coef=0.05",  # a gradient every step
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
        "actor.mini_batch_size=16", "actor.micro_batch_size=16",
        "loop.plots=false", "loop.tensorboard=false", "loop.steps=2",
        f"cluster.node_label={LABEL}"]
ONE_NODE = ["cluster.nodes=1", "cluster.cpus_per_node=4"]   # every bundle on node 0
TWO_NODES = ["cluster.nodes=2", "cluster.cpus_per_node=2"]  # ranks on node 0, engines on 1
GROUP = ["cluster.actor_ranks=2", "rollout.backend=serve", "rollout.num_engines=2"]


@pytest.fixture(scope="module")
def nodes():
    c = LocalCluster.start([(0, 6, NODE0),  # room for two ranks, two engines, two relaunched
                            (1, 2, NODE1)])
    try:
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
    assert tr.rollout.stats.pushes == 3 and tr.rollout.weight_sync == "distributed"
    # the same run with every bundle on node 0: the same numbers, bit for bit
    one = Trainer(_cfg(nodes, cache, *GROUP, *ONE_NODE), tmp_path / "one", progress=False,
                  log=lambda s: None)
    one.run()
    assert {nodes.plan_node(s.node) for s in one.rollout.slots} == {0}
    two_m, one_m = _metrics(out), _metrics(tmp_path / "one")
    assert [r["step"] for r in two_m] == [1, 2]
    assert two_m == one_m
    assert all(r["actor/grad_norm"] > 0 for r in two_m)  # the policy moved every step


# real SGLang 0.5.23 servers on CPU (the `sglang` tier, tests/sglang_cpu/install.sh), fp32
SGLANG = ["cluster.actor_ranks=2", "rollout.backend=sglang", "rollout.num_engines=2",
          "cluster.device=cpu", "rollout.dtype=fp32",
          f"rollout.sglang.python={SGLANG_PYTHON}",
          f"rollout.sglang.extra_env=[PYTHONPATH={SHIMS}, LOCKSTEP_SGLANG_CPU_HOST_BUFFER=1]",
          "rollout.sglang.extra_args=[--sleep-on-idle]", "rollout.sglang.startup_timeout_s=600"]


def _server_checks(nodes, fleet, node_ip: str) -> list[dict]:
    """Where each of `fleet`'s SGLang servers runs and listens, seen from outside it: its
    process is in `node_ip`'s raylet's process tree, it was started with `--host node_ip`,
    answers there (and reports that host in /server_info) and nothing listens on 127.0.0.1."""
    raylet = nodes.nodes[node_ip].all_processes["raylet"][0].process.pid
    tree, seen = set(descendants(raylet)), []
    for s in fleet.slots:
        assert s.pid in tree, (s, node_ip)
        argv = Path(f"/proc/{s.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--host") + 1] == node_ip.encode(), argv
        assert s.url.startswith(f"http://{node_ip}:"), s.url
        port = int(s.url.rsplit(":", 1)[1])
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), 2):
            pass
        req = urllib.request.Request(s.url + "/server_info", headers={
            "Authorization": f"Bearer {fleet.transport.api_key}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            info = json.loads(r.read())
        assert info["host"] == node_ip and info["port"] == port, info
        seen.append(info)
    return seen


@pytest.mark.sglang
@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"real SGLang venv not found at "
                    f"{SGLANG_VENV}; run tests/sglang_cpu/install.sh")
def test_real_sglang_engines_on_node_1_serve_the_pushed_weights(nodes, cache, tmp_path):
    """`rollout.backend: sglang`: two real SGLang servers launched by the fleet on node 1 (Ray
    actors pinned there by the plan; each server binds node 1's address and a port taken
    there), the actor ranks on node 0, every push across the nodes by the weight group. The
    toy R3 run's own mismatch metrics hold the tolerances of tests/test_sglang_real.py at
    every step: each token's SGLang log-prob within 1e-5 of the actor's recompute (the IS
    ratio within 1e-5 of 1) and SGLang's routes equal to the actor's own (flip rate 0).

    Not compared with a one-node run metric by metric: SGLang samples with the server's
    torch RNG (per-request seeds need --enable-deterministic-inference, which SGLang 0.5.23
    refuses with torch_native attention, its only CPU backend), so which samples a run gets
    depends on how requests meet in the servers' batches, wherever they run."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    tr = Trainer(_cfg(nodes, cache, *SGLANG, *TWO_NODES), out, progress=False,
                 log=lambda s: None)
    started = time.monotonic() - t0
    plan = make_plan(tr.cfg)
    assert [e["node"] for e in plan["placement"]["engines"]] == [1, 1]
    assert [nodes.plan_node(s.node) for s in tr.rollout.slots] == [1, 1]
    assert [nodes.plan_node(i.node) for i in tr.actor.infos] == [0, 0]
    assert len({s.url for s in tr.rollout.slots}) == 2
    _server_checks(nodes, tr.rollout, NODE1)
    tr.run()
    print(f"2 SGLang servers on node 1 up in {started:.0f} s; 2 steps in "
          f"{time.monotonic() - t0 - started:.0f} s")
    m = _metrics(out)
    assert [r["step"] for r in m] == [1, 2]
    for r in m:  # step 2 samples the weights pushed after step 1: stale ones are far off
        assert r["replay/mode"] == "R3" and r["rollout/weight_version_lag_max"] == 0
        assert abs(r["rollout_corr/rollout_is_max"] - 1) <= 1e-5, (r["step"], r)
        assert abs(r["rollout_corr/rollout_is_min"] - 1) <= 1e-5, (r["step"], r)
        assert r["routing/flip_rate"] == 0 and r["routing/num_tokens"] > 0, (r["step"], r)
        assert r["actor/grad_norm"] > 0  # the policy moved every step
    assert tr.rollout.stats.pushes == 3 and tr.rollout.weight_sync == "distributed"
    assert tr.rollout.stats.disk_bytes_written == 0 and tr.rollout.stats.push_bytes > 0


RAY = ["cluster.actor_ranks=2", "rollout.backend=ray", "rollout.num_engines=2",
       "rollout.dtype=fp32", *TWO_NODES]


@pytest.fixture(scope="module")
def ray_run(nodes, cache, tmp_path_factory):
    """The toy R3 run with Ray engines (fp32) on node 1 and the actor ranks on node 0."""
    out = tmp_path_factory.mktemp("ray")
    Trainer(_cfg(nodes, cache, *RAY), out, progress=False, log=lambda s: None).run()
    return out


def test_routes_by_reference_leave_the_driver_out(nodes, cache, ray_run, tmp_path):
    """rollout.routes_by_reference: the engines' routes stay on node 1 (the driver's batch and
    the shards it sends hold refs only), each rank fetches exactly its rows' routes, keyed by
    weight version, request, sample and attempt; the metrics equal the run without it."""
    tr = Trainer(_cfg(nodes, cache, *RAY, "rollout.routes_by_reference=true"), tmp_path / "ref",
                 progress=False, log=lambda s: None)
    seen: dict = {}
    inner = tr.actor.old_logprobs

    def spy(batch, mode, step):
        seen[step] = batch
        out = inner(batch, mode, step)
        plan = tr.actor._plans[step]
        seen[step, "fetched"] = [ray.get(w.fetched_routes.remote()) for w in tr.actor.workers]
        seen[step, "rows"] = [plan.rows[d].tolist() for d in tr.actor.dp_rank]
        return out
    tr.actor.old_logprobs = spy
    tr.run()
    for step in (1, 2):
        batch = seen[step]
        assert batch.rollout_routes_BTLK is None and batch.rollout_routes_valid_BT is None
        refs = batch.rollout_route_refs.refs
        assert len(refs) == batch.size
        # each rank fetched exactly its rows, every row once, under the step's weight version
        fetched, rows = seen[step, "fetched"], seen[step, "rows"]
        for got, mine in zip(fetched, rows):
            assert [tuple(k) for k in got] == [refs[i].key for i in mine]
        assert sorted(i for mine in rows for i in mine) == list(range(batch.size))
        assert {k[0] for got in fetched for k in got} == {str(step - 1)}
        assert all(k[3] == 0 for got in fetched for k in got)  # first attempts
    assert _metrics(tmp_path / "ref") == _metrics(ray_run)


def test_a_node_with_both_engines_lost_mid_generate(nodes, cache, ray_run, tmp_path):
    """`rollout.backend=ray` (the embedded engines as Ray actors) on node 1, the actor ranks on
    node 0: node 1 is killed while step 2 generates. Ray declares it dead; both engines are
    relaunched in bundles of their own on node 0 (their pinned node is gone) and built from
    the last push's weights in the object store; the step's requests are resent, every sample
    comes back once, and the run equals an uninterrupted one (fp32 engines: a sample does not
    depend on which requests share its engine)."""
    events: list[str] = []
    tr = Trainer(_cfg(nodes, cache, *RAY), tmp_path / "lost", progress=False, log=events.append)
    assert [nodes.plan_node(s.node) for s in tr.rollout.slots] == [1, 1]
    fleet, killed = tr.rollout, {}

    def kill_in_step_2():
        metrics = tmp_path / "lost" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while not any(s.load > 0 for s in fleet.slots):  # step 2's generate in flight
            assert time.monotonic() < deadline
            time.sleep(0.001)
        killed["at"] = nodes.kill(NODE1)
    th = threading.Thread(target=kill_in_step_2)
    th.start()
    try:
        tr.run()
    finally:
        th.join(60)
    assert "at" in killed
    nodes.add(1, 2, NEW1)  # node 1 again, for the tests after this one
    assert fleet.stats.relaunches == 2 and fleet.stats.engines_marked_dead == 2
    assert [nodes.plan_node(s.node) for s in fleet.slots] == [0, 0]  # the surviving node
    assert [nodes.plan_node(i.node) for i in tr.actor.infos] == [0, 0]
    assert sum("is dead; starting it on another node" in e for e in fleet.stats.events) == 2
    lost, want = _metrics(tmp_path / "lost"), _metrics(ray_run)
    assert [r["step"] for r in lost] == [1, 2]
    for a, b in zip(want, lost):  # the same samples: tokens, rewards, routes exactly
        for k in a:
            if k.split("/")[0] in ("step", "reward", "response", "routing", "replay"):
                assert a[k] == b[k], (a["step"], k)
            else:  # fp32 engine log-probs of other batch shapes: rounding only
                assert abs(a[k] - b[k]) <= 1e-4 * abs(a[k]) + 1e-6, (a["step"], k, a[k], b[k])


def _train(out: Path, nodes, cache, *sets: str, resume: bool = False) -> subprocess.Popen:
    args = [a for s in SETS + [f"warmstart.cache_dir={cache}",
                               f"cluster.ray_address={nodes.address}", *sets]
            for a in ("--set", s)]
    cmd = [sys.executable, "-m", "lockstep.launch.cli", "train", str(CONFIGS / "toy_r3.yaml"),
           "--out", str(out), "--no-progress", *(["--resume"] if resume else []), *args]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_node_with_the_actor_ranks_lost_stops_cleanly_and_resumes(nodes, cache, two_node_run,
                                                                     tmp_path):
    """`lockstep train` joined to the cluster (the driver on the head), the actor ranks on
    node 0: node 0 is killed once the step-1 checkpoint is written. The run stops within 60 s
    with an error naming the node; no half-written checkpoint is left; `--resume` with a new
    node 0 (another address, the same label) gives the uninterrupted run's metrics."""
    run = tmp_path / "run"
    victim = _train(run, nodes, cache, *GROUP, *TWO_NODES, "loop.steps=1000",
                    "loop.checkpoint_every=1", "loop.keep_checkpoints=0")
    done = run / "checkpoints/step_1/state.json"
    deadline = time.monotonic() + 600
    while not done.exists():
        assert victim.poll() is None, victim.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint at step 1"
        time.sleep(0.01)
    t0 = nodes.kill(NODE0)
    try:
        text, _ = victim.communicate(timeout=120)
    finally:
        victim.kill()
    stopped_s = time.monotonic() - t0
    assert victim.returncode not in (0, None), text[-3000:]
    assert stopped_s < 60, stopped_s
    print(f"the run stopped {stopped_s:.1f} s after node 0 was lost")
    assert f"node {NODE0} ({LABEL}=0)" in text and "is lost, with actor rank(s) [0, 1]" in text, \
        text[-3000:]
    # every checkpoint under a final name is whole (a save cut short stays a .tmp folder)
    final = [d for d in (run / "checkpoints").iterdir() if not d.name.endswith(".tmp")]
    assert final and all((d / "state.json").exists() for d in final), final
    nodes.add(0, 6, NEW0)
    p = _train(run, nodes, cache, *GROUP, *TWO_NODES, "loop.steps=2",
               "loop.checkpoint_every=1", "loop.keep_checkpoints=0", resume=True)
    text, _ = p.communicate(timeout=900)
    assert p.returncode == 0, text[-3000:]
    assert "resuming from" in text
    assert _metrics(run) == _metrics(two_node_run[2])
