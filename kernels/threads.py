"""CPU threads that behave on a shared machine and cost nothing on a quiet one: OpenMP's wait
policy for every lockstep process, chosen from what the machine is doing when it starts.

While torch's OpenMP threads wait for work they spin on a core (the runtime's default: ~300k
spins before they sleep). On a machine whose cores other jobs use, each spin takes a core from
a thread that has work: 100 warm-start steps with two busy-loop processes on a 2-core box took
381 s with the default and 8 s with `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep at once).
On a quiet machine PASSIVE costs instead: every parallel region then wakes its threads from a
futex, and the tiny models' many small ops made the same 100 steps 1.9-2.2x slower than with
spinning. A short spin is enough to keep that cost away (`GOMP_SPINCOUNT=10000`: the same time as
`ACTIVE`, within the box's noise) and bounds the harm if the machine fills up later.

So each entry point samples the run queue once at start (`/proc/stat`'s procs_running, 10
samples over ~20 ms) and sets, unless the user set `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`:
- quiet (fewer than 0.5 other runnable tasks on average): `GOMP_SPINCOUNT=10000`;
- busy, or no run queue to read (not Linux): `OMP_WAIT_POLICY=PASSIVE`.
`bench/busy_machine.py` prints the quiet-machine cost against ACTIVE and busy/quiet.

- every entry point (`lockstep ...`, `python -m lockstep.launch.serve`): `set_wait_policy()`
  runs when `launch/entry.py` is imported, their first import, before anything imports torch
  (OpenMP reads the variables once, when torch loads it); servers and SGLang launched from it
  inherit the environment;
- Ray actor ranks and engine workers: `worker_env()` (the choice of the process that starts
  them) is in their `runtime_env`.

The thread COUNT is left as it was (torch's default, `OMP_NUM_THREADS`, `--threads`,
`cluster.threads_per_rank`): runs are bit-reproducible for a fixed count only, and the wait
policy changes no number. `describe()` is the line `lockstep train` and `lockstep serve` print
once at start. Standard library only (it runs before torch is imported).
"""

from __future__ import annotations

import os
import time

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_ENV = "GOMP_SPINCOUNT"
BUSY = {WAIT_POLICY_ENV: "PASSIVE"}  # waiting threads sleep at once
QUIET = {SPIN_ENV: "10000"}  # a short spin (~10-30 us), then sleep
OTHERS_BUSY = 0.5  # other runnable tasks (mean over the samples) that make a machine busy

_chosen: str | None = None  # why this process's policy is what it is (for describe())


def other_runnable(samples: int = 10, gap_s: float = 0.002) -> float | None:
    """Mean number of runnable tasks on the machine besides this one, from `/proc/stat`'s
    procs_running sampled `samples` times `gap_s` apart; None where there is none to read."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat", "rb") as f:
                line = next(ln for ln in f if ln.startswith(b"procs_running "))
        except (OSError, StopIteration):
            return None
        counts.append(int(line.split()[1]) - 1)  # this process is running while it reads
        if i + 1 < samples:
            time.sleep(gap_s)
    return sum(counts) / len(counts)


def choose(others: float | None) -> dict[str, str]:
    """The variables for a machine with `others` other runnable tasks (None: unknown)."""
    return dict(QUIET) if others is not None and others < OTHERS_BUSY else dict(BUSY)


def _user_set() -> dict[str, str]:
    """The wait variables present in the environment (set but empty: the runtime's default)."""
    return {k: os.environ[k] for k in (WAIT_POLICY_ENV, SPIN_ENV) if k in os.environ}


def set_wait_policy(others: float | None | str = "sample") -> None:
    """Put the wait policy for this machine's load (`others`; sampled by default) into this
    process's environment unless `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is set already (set
    to "": the runtime's default).
    Takes effect only if torch (its OpenMP runtime) is not loaded yet."""
    global _chosen
    if _user_set():
        _chosen = "set before lockstep started"
        return
    if others == "sample":
        others = other_runnable()
    chosen = choose(others)
    os.environ.update(chosen)
    _chosen = ("run queue unknown" if others is None else
               f"{others:.1f} other runnable tasks on {os.cpu_count()} CPUs: "
               + ("quiet" if chosen == QUIET else "busy"))


def policy_env() -> dict[str, str]:
    """This process's wait-policy variables: the user's, else the ones set_wait_policy chose
    (PASSIVE if it never ran)."""
    return _user_set() or dict(BUSY)


def policy_text(env: dict[str, str] | None = None) -> str:
    """The wait-policy variables of `env` (this process's environment by default) as one
    string, e.g. "OMP_WAIT_POLICY=PASSIVE"; "" when neither is set."""
    env = os.environ if env is None else env
    return " ".join(f"{k}={env[k]}" for k in (WAIT_POLICY_ENV, SPIN_ENV) if env.get(k))


def worker_env(threads: int) -> dict[str, str]:
    """The environment variables of a worker process (Ray rank or engine) with `threads`
    torch threads and this process's wait policy."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **policy_env()}


def describe() -> str:
    """One line: this process's torch thread count and OpenMP wait policy, and how to change
    them."""
    import torch

    count = os.environ.get("OMP_NUM_THREADS")
    where = f"OMP_NUM_THREADS={count}" if count else "torch's default"
    policy = policy_text() or "the runtime's default (spins)"
    why = f" ({_chosen})" if _chosen else ""
    return (f"threads: {torch.get_num_threads()} torch threads ({where}; --threads N changes "
            f"it), {policy}{why}; lockstep sleeps waiting threads on a busy machine and spins "
            f"them briefly on a quiet one, {WAIT_POLICY_ENV}=PASSIVE or ACTIVE overrides")
