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
