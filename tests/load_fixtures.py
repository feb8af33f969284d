"""Start-up deadlines for real servers and clusters that scale with the machine's load: a
loaded host is slow, not broken. `scaled(base_s)` is `base_s` (measured on a quiet 2-core
machine) times the 1-minute load per core, at least 1 and at most 6; `Deadline` re-reads the
load while it waits, so a start that meets a load spike gets the longer deadline.
Import with `from load_fixtures import Deadline, scaled`."""

from __future__ import annotations

import os
import time

MAX_FACTOR = 6.0


def load_factor() -> float:
    """The 1-minute load per core, clamped to [1, MAX_FACTOR]."""
    return min(MAX_FACTOR, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def scaled(base_s: float) -> float:
    return base_s * load_factor()


class Deadline:
    """`base_s` from now, stretched by the highest load factor seen while waiting."""

    def __init__(self, base_s: float):
        self.base_s, self.t0, self.factor = base_s, time.monotonic(), load_factor()

    @property
    def seconds(self) -> float:
        return self.base_s * self.factor

    def passed(self) -> bool:
        self.factor = max(self.factor, load_factor())
        return time.monotonic() - self.t0 > self.seconds
