"""What one weight push moves between nodes, on the multi-node tier (tests/multinode_fixtures:
a head for the driver, node 0 with the actor group's 2 ranks (torch DDP: every rank holds the
weights), node 1 with N engines), per path, for N = 1, 2, 4 engines:

  ray-driver     rollout.backend=ray today: rank 0 streams its buckets to the driver, which casts
                 each to the engines' dtypes (bf16) and ray.puts it; every engine fetches it
  ray-rank       the same engines given ActorGroup.export_refs: rank 0 casts and puts each bucket
                 in its own node's object store; the driver passes only the refs
  serve          rollout.backend=serve: rank 0 -> driver as in ray-driver, then the driver (rank 0
                 of the weight group) broadcasts each fp32 bucket over gloo to the N servers

Bytes are what each node's processes read + wrote through syscalls during one push (the second:
the first forms the groups): the raylet's object transfers between nodes and the workers'
sockets (gloo, HTTP); a process's own shared-memory object-store reads are not syscalls, so
a bucket counted at a node crossed the network to or from it. Loopback here, so the numbers are
bytes, not bandwidth; time per push is printed too (2 shared cores: indicative only).

    OMP_NUM_THREADS=1 python bench/weight_sync_nodes.py [--engines 1,2,4] [--hidden 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from multinode_fixtures import LABEL, LocalCluster, _children  # noqa: E402

MB = 1e6


def io_bytes(pids: list[int]) -> int:
    """rchar + wchar summed over `pids` (processes gone since are skipped)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith(("rchar:", "wchar:")):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def node_pids(c: LocalCluster) -> dict[str, list[int]]:
    """Every node's processes: its raylet and what the raylet started (the head: also the
    GCS and this driver)."""
    out = {}
    for ip, node in c.nodes.items():
        raylet = node.all_processes["raylet"][0].process.pid
        out[f"node {c.index[ip]}"] = [raylet] + _children(raylet)
    head = c.cluster.head_node
    raylet = head.all_processes["raylet"][0].process.pid
    gcs = head.all_processes["gcs_server"][0].process.pid
    out["head (driver)"] = [os.getpid(), raylet, gcs] + _children(raylet)
    return out


def measure(push, c: LocalCluster) -> tuple[dict[str, int], float]:
    before = {k: io_bytes(v) for k, v in node_pids(c).items()}
    t0 = time.perf_counter()
    push()
    dt = time.perf_counter() - t0
    pids = node_pids(c)
    return {k: io_bytes(v) - before.get(k, 0) for k, v in pids.items()}, dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="1,2,4")
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    counts = [int(x) for x in args.engines.split(",")]
    from lockstep.moe.sizes import param_count
    from lockstep.rollout.engine import EngineConfig
    from lockstep.rollout.fleet import Fleet
    from lockstep.trainer.config import load_config
    from lockstep.trainer.group import ActorGroup

    c = LocalCluster()
    try:
        c.add(0, 2, "127.31.0.2")
        c.add(1, 2 * max(counts), "127.31.0.3")  # a Ray fleet and a serve fleet
        c.connect()
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
            ecfg = EngineConfig(dtype="bf16", max_len=64)
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
                got, dt = measure(push, c)
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
