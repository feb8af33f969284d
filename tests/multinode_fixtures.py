"""A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`): a head for
the driver (no CPUs) and worker nodes, each a raylet of its own with its own CPU count, its
own loopback address (127.31.0.x: nothing assumes 127.0.0.1) and the node label
`lockstep-node=<index>` that `cluster.node_label` pins bundles by. `kill(node)` loses a node
as a machine does: SIGKILL of its raylet and of every process it started (the Ray workers:
actor ranks, engines, servers), all at once. Import with
`from multinode_fixtures import LocalCluster`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

LABEL = "lockstep-node"
HEAD_IP = "127.31.0.1"


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc; standard library only)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


class LocalCluster:
    """The head (127.31.0.1, 0 CPUs: the driver's node) plus the nodes `add` starts."""

    def __init__(self):
        from ray.cluster_utils import Cluster
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, node_ip_address=HEAD_IP, include_dashboard=False,
            env_vars={"OMP_NUM_THREADS": "1"}))
        self.nodes: dict[str, object] = {}  # ip -> ray Node
        self.index: dict[str, int] = {}  # ip -> plan node index (its label)

    @classmethod
    def start(cls, nodes: list[tuple[int, int, str]], attempts: int = 3) -> "LocalCluster":
        """The head plus `nodes` ((index, CPUs, address) each), the driver connected. A start
        is retried: Ray gives a raylet a fixed time to register, which a busy machine misses."""
        for attempt in range(1, attempts + 1):
            c = None
            try:
                c = cls()
                for index, cpus, ip in nodes:
                    c.add(index, cpus, ip)
                c.connect()
                return c
            except Exception as e:  # noqa: BLE001 - a start that timed out: again
                if c is not None:
                    c.shutdown()
                if "timed out during startup" not in str(e) or attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, index: int, cpus: int, ip: str):
        node = self.cluster.add_node(num_cpus=cpus, node_ip_address=ip, labels={LABEL: str(index)},
                                     env_vars={"OMP_NUM_THREADS": "1"})
        self.nodes[ip], self.index[ip] = node, index
        return node

    def connect(self) -> None:
        import ray
        ray.init(address=self.address, _node_ip_address=HEAD_IP, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})

    def node_id(self, ip: str) -> str:
        return self.nodes[ip].node_id

    def plan_node(self, node_id: str) -> int:
        """The plan index (label) of the Ray node with this id."""
        for ip, node in self.nodes.items():
            if node.node_id == node_id:
                return self.index[ip]
        raise KeyError(node_id)

    def kill(self, ip: str) -> float:
        """Lose node `ip` at once: SIGKILL its raylet's whole process tree (workers first,
        so none outlives it), then its other processes; returns the time it happened."""
        node = self.nodes.pop(ip)
        self.index.pop(ip)
        raylet = node.all_processes["raylet"][0].process.pid
        t = time.monotonic()
        for pid in descendants(raylet) + [raylet]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cluster.remove_node(node, allow_graceful=False)
        return t

    def shutdown(self) -> None:
        import ray
        ray.shutdown()
        for node in list(self.nodes.values()):  # workers first: none left behind
            try:
                for pid in descendants(node.all_processes["raylet"][0].process.pid):
                    os.kill(pid, signal.SIGKILL)
            except (KeyError, ProcessLookupError):
                pass
        self.cluster.shutdown()
