"""Which node each actor rank and each rollout engine goes to: the arithmetic `lockstep plan`
prints and `lockstep train` pins (standard library only; the callers pass numbers).

    ranks, engines = lay_out(ranks=2, rank_size=1, engines=2, engine_size=1,
                             nodes=2, per_node=2)          # -> [0, 0], [1, 1]
    selectors = node_selectors("lockstep-node", ranks)      # [{"lockstep-node": "0"}, ...]

Actor ranks fill the nodes in order (rank r on node r // per_node when each takes one unit);
engines then take the first node with room for the whole engine (an engine never spans
nodes). `per_node` counts what a bundle asks for: GPUs on a GPU cluster, CPUs on a CPU one.
With a node label (`cluster.node_label`) every bundle carries a Ray label selector naming its
node's index, so Ray puts it exactly there: the node started with
`ray start --labels='{"lockstep-node": "1"}'` is the plan's node 1.
"""

from __future__ import annotations


def first_fit(sizes: list[float], free: list[float]) -> list[int | None]:
    """The node of each item in order: the first with `size` still free (None: none has
    room); `free` is updated in place."""
    out: list[int | None] = []
    for size in sizes:
        node = next((n for n, left in enumerate(free) if left >= size), None)
        if node is not None:
            free[node] -= size
        out.append(node)
    return out


def lay_out(ranks: int, rank_size: float, engines: int, engine_size: float, nodes: int,
            per_node: float, colocated: bool = False) -> tuple[list[int | None],
                                                              list[int | None]]:
    """(node of each actor rank, node of each engine). `colocated`: engines run in the
    actor ranks' bundles, so they take no room of their own (their node: None here, the
    rank's bundle decides)."""
    free = [float(per_node)] * nodes
    rank_nodes = first_fit([rank_size] * ranks, free)
    if colocated:
        return rank_nodes, [None] * engines
    return rank_nodes, first_fit([engine_size] * engines, free)


def node_selectors(label: str | None, nodes: list[int | None]) -> list[dict[str, str]] | None:
    """One Ray bundle label selector per bundle (`{label: "<node index>"}`), or None (Ray
    chooses) when there is no label or a bundle has no planned node."""
    if label is None or any(n is None for n in nodes):
        return None
    return [{label: str(n)} for n in nodes]
