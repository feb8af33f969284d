"""kernels/threads.py: every lockstep process waits without spinning (OMP_WAIT_POLICY=PASSIVE,
in the environment before torch loads its OpenMP runtime), unless the user chose a policy;
Ray ranks and engine workers get it in their runtime_env. bench/busy_machine.py measures why."""

import os
import subprocess
import sys

from lockstep.kernels.threads import describe, worker_env

# Imports the CLI module and prints OMP_WAIT_POLICY at the moment `import torch` starts (the
# process ends there: what OpenMP will read is known).
AT_TORCH_IMPORT = """
import importlib.abc, os, sys
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            print("at torch import:", os.environ.get("OMP_WAIT_POLICY"), flush=True)
            os._exit(0)
sys.meta_path.insert(0, Spy())
import lockstep.launch.cli
"""


def _cli_process(**env):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    res = subprocess.run([sys.executable, "-c", AT_TORCH_IMPORT], env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.splitlines()


def test_the_cli_sets_passive_before_torch_loads_and_keeps_a_users_choice():
    assert _cli_process() == ["at torch import: PASSIVE"]
    assert _cli_process(OMP_WAIT_POLICY="ACTIVE") == ["at torch import: ACTIVE"]
    line = describe()  # what `lockstep train` / `serve` print once
    assert line.startswith("threads: ") and "torch threads" in line and "OMP_WAIT_POLICY=" in line


def test_ray_workers_get_the_wait_policy_and_their_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_env(2) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                             "OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(1)["OMP_WAIT_POLICY"] == "ACTIVE"  # the Ray workers' env (fleet, group)
