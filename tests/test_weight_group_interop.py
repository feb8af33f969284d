"""Our weight group (built on its own store, outside torch's group registry) meets a process
that joins the way SGLang's /init_weights_update_group does: tcp rendezvous, a prefix store
named after the group, torch's process-group helper (REFERENCE.md). A broadcast from our rank 0
arrives; a changed key layout on our side would leave the peer waiting (it fails in seconds)."""

import subprocess
import sys
import textwrap

import torch

from lockstep.cluster.ports import free_port
from lockstep.rollout.weight_group import WeightGroup

# The receiving side as SGLang sets it up, with torch's private helpers (as SGLang does).
PEER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)
    port, name = int(sys.argv[1]), sys.argv[2]
    timeout = timedelta(seconds=20)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore(name, store),
                                      group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    x = torch.zeros(6)
    dist.broadcast(x, src=0, group=pg)
    print(x.tolist(), flush=True)
    dist.destroy_process_group(pg)
""")


def test_weight_group_joins_an_sglang_style_peer():
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port), "weight_update_group"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        group = WeightGroup("127.0.0.1", port, 0, 2, "weight_update_group", "gloo", timeout_s=20)
        group.broadcast(torch.arange(6, dtype=torch.float32) * 1.5)
        out, err = peer.communicate(timeout=30)
        group.close()
    finally:
        if peer.poll() is None:
            peer.kill()
    assert peer.returncode == 0, err[-2000:]
    assert out.strip() == str([0.0, 1.5, 3.0, 4.5, 6.0, 7.5])
