"""kernels/threads.py: every lockstep process chooses OpenMP's wait policy from the machine's
run queue before torch loads its OpenMP runtime (PASSIVE when busy, a short GOMP_SPINCOUNT
when quiet), keeps a user's choice, and hands its choice to Ray ranks and engine workers.
bench/busy_machine.py measures why."""

import os
import subprocess
import sys
import time

from lockstep.kernels import threads
from lockstep.kernels.threads import (BUSY, QUIET, choose, describe, other_runnable,
                                      policy_text, set_wait_policy, worker_env)

# Imports the CLI module and prints the wait variables at the moment `import torch` starts
# (the process ends there: what OpenMP will read is known).
AT_TORCH_IMPORT = """
import importlib.abc, os, sys
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            print("at torch import:", os.environ.get("OMP_WAIT_POLICY"),
                  os.environ.get("GOMP_SPINCOUNT"), flush=True)
            os._exit(0)
sys.meta_path.insert(0, Spy())
import lockstep.launch.cli
"""


def _cli_process(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    res = subprocess.run([sys.executable, "-c", AT_TORCH_IMPORT], env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.splitlines()


class BusyLoops:
    """`n` processes that keep a core each busy while the block runs."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.n)]
        time.sleep(0.5)  # started and spinning
        return self

    def __exit__(self, *exc):
        for p in self.loops:
            p.kill()
            p.wait()


def test_the_run_queue_is_read_and_counts_other_jobs():
    with BusyLoops(3):
        assert other_runnable() >= 2.5  # three loops (the scheduler runs or queues each)
    if sys.platform.startswith("linux"):
        assert other_runnable(samples=1) is not None


def test_busy_sleeps_quiet_spins_briefly_unknown_sleeps():
    assert choose(0.0) == choose(0.4) == QUIET == {"GOMP_SPINCOUNT": "10000"}
    assert choose(0.5) == choose(3.0) == choose(None) == BUSY == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_the_cli_chooses_before_torch_loads_and_keeps_a_users_choice():
    with BusyLoops(3):  # a busy machine, whatever else runs beside the test
        assert _cli_process() == ["at torch import: PASSIVE None"]
    assert _cli_process(OMP_WAIT_POLICY="ACTIVE") == ["at torch import: ACTIVE None"]
    assert _cli_process(GOMP_SPINCOUNT="5") == ["at torch import: None 5"]  # nothing added


def test_the_choice_is_set_said_and_handed_to_ray_workers(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # recorded, so undone after the test
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setattr(threads, "_chosen", None)
    assert worker_env(2) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                             "OMP_WAIT_POLICY": "PASSIVE"}  # never chosen: the safe one
    set_wait_policy(others=0.0)
    assert policy_text() == "GOMP_SPINCOUNT=10000" and "OMP_WAIT_POLICY" not in os.environ
    assert worker_env(1) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                             "GOMP_SPINCOUNT": "10000"}  # the Ray workers' env (fleet, group)
    line = describe()  # what `lockstep train` / `serve` print once
    assert line.startswith("threads: ") and "GOMP_SPINCOUNT=10000 (0.0 other runnable" in line
    assert "quiet" in line
    set_wait_policy(others=2.0)  # set already: kept
    assert policy_text() == "GOMP_SPINCOUNT=10000" and "set before lockstep" in describe()
    monkeypatch.delenv("GOMP_SPINCOUNT")
    set_wait_policy(others=2.0)
    assert policy_text() == "OMP_WAIT_POLICY=PASSIVE" and "busy" in describe()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(1)["OMP_WAIT_POLICY"] == "ACTIVE"
