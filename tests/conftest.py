import os
import socket

# One torch thread per process: small CPU matmuls crawl when processes fight over cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# The longest modules first (their wall time on a 2-core machine, CI's two pytest-xdist
# workers, longest first): `--dist loadfile` hands out whole files in collection order, so a
# long file collected last would run alone at the end while the other worker idles.
LONGEST_FIRST = ("test_vllm_real.py", "test_multinode.py", "test_group.py",
                 "test_megatron_group.py", "test_sglang_real.py", "test_vllm_fleet.py",
                 "test_group_checkpoint.py", "test_sglang_fleet.py", "test_server_soak.py",
                 "test_megatron_uneven.py", "test_megatron_group4.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cluster():
    """A private local Ray cluster for one test module (2 CPUs, one torch thread per worker);
    address="local" so a `ray start` cluster or a stale address on this machine is never joined."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def world1():
    """A gloo world of one process with megatron-core's parallel state at TP=EP=PP=1 (created
    here unless the module already has a process group), torn down after the module."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from lockstep.trainer.actor.megatron.model import initialize_parallel
    from lockstep.trainer.config.megatron import MegatronOptions
    created = not dist.is_initialized()
    if created:  # gloo even where CUDA is present: these are CPU tests
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    initialize_parallel(MegatronOptions())
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
