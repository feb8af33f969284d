"""What one weight push moves between nodes, on the multi-node tier (tests/multinode_fixtures:
a head for the driver, node 0 with the actor group's 2 ranks (torch DDP: every rank holds the
weights), node 1 with N engines), per path, for N = 1, 2, 4 engines:

  ray-driver     rollout.backend=ray today: rank 0 streams its buckets to the driver, which casts
                 each to the engines' dtypes (bf16) and ray.puts it; every engine fetches it
  ray-rank       the same engines given ActorGroup.export_refs: rank 0 casts and puts each bucket
                 in its own node's object store; the driver passes only the refs
  serve          rollout.backend=serve: rank 0 -> driver as in ray-driver, then the driver (rank 0
                 of the weight group) broadcasts each fp32 bucket over gloo to the N servers

Bytes are what each node's processes sent + received over TCP during one push (the second:
the first forms the groups), from `ss -tinp` before and after: the raylets' object transfers
between nodes, the workers' gloo and HTTP sockets (a process's own object-store reads are
shared memory, not TCP), so a bucket counted at a node crossed the network to or from it (a
transfer between two nodes counts at both). Loopback here: bytes, not bandwidth; time per push
is printed too (2 shared cores: indicative only).

    OMP_NUM_THREADS=1 python bench/weight_sync_nodes.py [--engines 1,2,4] [--hidden 512]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from multinode_fixtures import LABEL, LocalCluster, _children  # noqa: E402

MB = 1e6


def socket_bytes() -> dict[tuple[str, str], tuple[int, int]]:
    """Every TCP socket's (bytes sent + received) by (local, peer) address, with its pid:
    `ss -tinp` (sockets close between two reads: a new one counts from 0)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout.splitlines()
    got, key, pid = {}, None, None
    for line in out:
        if not line.startswith(("\t", " ")):
            parts = line.split()
            key = (parts[3], parts[4]) if len(parts) > 4 else None
            m = re.search(r"pid=(\d+)", line)
            pid = int(m.group(1)) if m else None
            continue
        if key is None or pid is None:
            continue
        sent = re.search(r"bytes_sent:(\d+)", line)
        recv = re.search(r"bytes_received:(\d+)", line)
        got[key] = (pid, (int(sent.group(1)) if sent else 0) + (int(recv.group(1)) if recv else 0))
    return got


def node_pids(c: LocalCluster, actors: dict[str, list[int]]) -> dict[str, set[int]]:
    """Each node's processes: its raylet and what it started, and the actors placed there
    (`actors`: node name -> pids); the head: also the GCS and this driver."""
    out = {}
    for ip, node in c.nodes.items():
        name = f"node {c.index[ip]}"
        raylet = node.all_processes["raylet"][0].process.pid
        out[name] = {raylet, *_children(raylet), *actors.get(name, [])}
    head = c.cluster.head_node
    raylet = head.all_processes["raylet"][0].process.pid
    gcs = head.all_processes["gcs_server"][0].process.pid
    out["head (driver)"] = {os.getpid(), raylet, gcs, *_children(raylet)}
    return out


def measure(push, c: LocalCluster, actors: dict[str, list[int]]) -> tuple[dict[str, int], float]:
    """Bytes each node's processes sent + received over TCP during `push()`, and its time."""
    before = socket_bytes()
    t0 = time.perf_counter()
    push()
    dt = time.perf_counter() - t0
    after = socket_bytes()
    owner = {pid: name for name, pids in node_pids(c, actors).items() for pid in pids}
    moved: dict[str, int] = {name: 0 for name in set(owner.values())}
    for key, (pid, n) in after.items():
        if pid in owner:
            moved[owner[pid]] += n - (before.get(key, (pid, 0))[1] if key in before else 0)
    return moved, dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="1,2,4")
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    counts = [int(x) for x in args.engines.split(",")]
    from lockstep.moe.sizes import param_count
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.fleet import Fleet
    from lockstep.trainer.actor.group import ActorGroup
    from lockstep.trainer.config.load import load_config

    # node 1: room for a Ray fleet and a serve fleet of the largest count
    c = LocalCluster.start([(0, 2, "127.31.0.2"), (1, 2 * max(counts), "127.31.0.3")])
    try:
        h = args.hidden
        cfg = load_config(ROOT / "configs/toy_r3.yaml", [
            "warmstart.enabled=false", "cluster.actor_ranks=2", f"cluster.ray_address={c.address}",
            f"cluster.node_label={LABEL}", "cluster.nodes=1", "cluster.cpus_per_node=2",
            "model.vocab_size=64", f"model.hidden_size={h}", "model.num_hidden_layers=4",
            f"model.moe_intermediate_size={h}", "model.num_experts=8",
            f"model.intermediate_size={2 * h}"])
        from lockstep.moe.model import MoEModel
        model = MoEModel(cfg.model)
        n = param_count(cfg.model)
        print(f"model: {n / 1e6:.1f}M parameters, {4 * n / MB:.0f} MB fp32, {2 * n / MB:.0f} MB "
              f"bf16; actor: 2 torch ranks on node 0; engines on node 1 (bf16)")
        group = ActorGroup(cfg, model, 1)
        bucket = 64 << 20
        pin = lambda k: [{LABEL: "1"}] * k  # noqa: E731
        print(f"{'path':10} {'engines':>7} {'head (driver) MB':>17} {'node 0 MB':>10} "
              f"{'node 1 MB':>10} {'push s':>7}")
        rows = []
        for k in counts:
            ecfg = EngineConfig(dtype="bf16", max_len=32)
            ray_fleet = Fleet.ray(model, ecfg, k, address=c.address, node_selectors=pin(k))
            serve = Fleet.serve(model, ecfg, k, address=c.address, node_selectors=pin(k),
                                weight_sync="distributed")
            v = iter(range(1, 100))
            for name, push in (
                    ("ray-driver", lambda: ray_fleet.update_weights(
                        group.export_weights(bucket), str(next(v)))),
                    ("ray-rank", lambda: ray_fleet.update_weights(group.export_refs(
                        bucket, ray_fleet.transport.dtypes), str(next(v)))),
                    ("serve", lambda: serve.update_weights(group.export_weights(bucket),
                                                           str(next(v))))):
                push()  # forms the weight group / warms the paths
                actors = {"node 0": [i.pid for i in group.infos],
                          "node 1": [x.pid for f in (ray_fleet, serve) for x in f.slots]}
                got, dt = measure(push, c, actors)
                rows.append((name, k, got, dt))
                print(f"{name:10} {k:7d} {got['head (driver)'] / MB:17.1f} "
                      f"{got['node 0'] / MB:10.1f} {got['node 1'] / MB:10.1f} {dt:7.2f}",
                      flush=True)
            ray_fleet.close()
            serve.close()
        group.close()
    finally:
        c.shutdown()


if __name__ == "__main__":
    main()
