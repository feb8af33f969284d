"""CPU threads that behave on a shared machine: OpenMP's wait policy for every lockstep process.

While torch's OpenMP threads wait for work they spin on a core for a while (the runtime's
default). On a machine whose cores other jobs use, each spin takes a core from the thread that
has work: 100 warm-start steps with two busy-loop processes on a 2-core box took 381 s with the
default policy and 8 s with `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep). So lockstep puts
`OMP_WAIT_POLICY=PASSIVE` into the environment of each of its processes unless the user set
`OMP_WAIT_POLICY` already (`ACTIVE` brings the spinning back):

- every entry point (`lockstep ...`, `python -m lockstep.launch.serve`): `set_wait_policy()`
  runs when `launch/entry.py` is imported, their first import, before anything imports torch (OpenMP reads the variable once,
  when torch loads it); servers and SGLang launched from it inherit the environment;
- Ray actor ranks and engine workers: `worker_env()` is in their `runtime_env`.

The thread COUNT is left as it was (torch's default, `OMP_NUM_THREADS`, `--threads`,
`cluster.threads_per_rank`): runs are bit-reproducible for a fixed count only, and the wait
policy changes no number. `describe()` is the line `lockstep train` and `lockstep serve` print
once at start. Standard library only (it runs before torch is imported).
"""

from __future__ import annotations

import os

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"


def set_wait_policy() -> None:
    """`OMP_WAIT_POLICY=PASSIVE` in this process's environment unless it is set already.
    Takes effect only if torch (its OpenMP runtime) is not loaded yet."""
    os.environ.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)


def worker_env(threads: int) -> dict[str, str]:
    """The environment variables of a worker process (Ray rank or engine) with `threads`
    torch threads and this process's wait policy (PASSIVE unless the user chose another)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            WAIT_POLICY_ENV: os.environ.get(WAIT_POLICY_ENV) or DEFAULT_WAIT_POLICY}


def describe() -> str:
    """One line: this process's torch thread count and OpenMP wait policy, and how to change
    them."""
    import torch

    count = os.environ.get("OMP_NUM_THREADS")
    where = f"OMP_NUM_THREADS={count}" if count else "torch's default"
    policy = os.environ.get(WAIT_POLICY_ENV, "unset (the OpenMP runtime spins)")
    return (f"threads: {torch.get_num_threads()} torch threads ({where}; --threads N changes "
            f"it), {WAIT_POLICY_ENV}={policy} (lockstep's default PASSIVE: waiting "
            f"threads sleep instead of spinning on a shared machine; {WAIT_POLICY_ENV}=ACTIVE "
            f"spins)")

