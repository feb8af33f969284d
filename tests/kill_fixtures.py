"""Killing a training run mid-way for the resume tests: wait for a checkpoint file while the
run is alive, then SIGKILL it. Import with `from kill_fixtures import kill_when_written`."""

import os
import signal
import subprocess
import time
from pathlib import Path


def kill_when_written(victim: subprocess.Popen, done: Path, what: str, poll_s: float = 0.01,
                      timeout_s: float = 600, whole_session: bool = False) -> None:
    """SIGKILL `victim` as soon as `done` exists (failing with its output if it exits first, or
    with "no checkpoint at `what`" after `timeout_s`). `whole_session`: also kill its process
    group (a run that started Ray; Ray's agents outlive the driver), so `victim` must have been
    started with `start_new_session=True`."""
    deadline = time.monotonic() + timeout_s
    try:
        while not done.exists():
            assert victim.poll() is None, victim.communicate()[0][-3000:]
            assert time.monotonic() < deadline, f"no checkpoint at {what}"
            time.sleep(poll_s)
        victim.send_signal(signal.SIGKILL)
        victim.communicate(timeout=60)
    finally:
        if whole_session:
            time.sleep(1)
            try:
                os.killpg(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pid: int, timeout_s: float = 60.0) -> bool:
    """True once `pid` is gone (within `timeout_s`), else False."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def generate_then(fleet, reqs, ready, act, wait_s: float, join_s: float):
    """fleet.generate(reqs) on a thread; once `ready()` holds (polled), `act()` (the fault:
    a signal to an engine's process); then the results, or the generate's exception."""
    import threading

    out = {}

    def run():
        try:
            out["r"] = fleet.generate(reqs)
        except Exception as e:  # noqa: BLE001 - re-raised below, in the test's thread
            out["e"] = e
    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + wait_s
    while not ready():
        assert time.monotonic() < deadline and th.is_alive(), "the engine never got work"
        time.sleep(0.002)
    act()
    th.join(join_s)
    assert not th.is_alive()
    if "e" in out:
        raise out["e"]
    return out["r"]
