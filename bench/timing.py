"""Timing helpers shared by the benchmarks (run as `python bench/<name>.py`, so this folder is
on sys.path). Medians, because timings on shared hosts drift and sometimes stall."""

from __future__ import annotations

import statistics
import time

# wall: elapsed time; cpu: this thread's CPU time (drops waits for a core on a busy host).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def median_seconds(step, repeats: int, warmup: int = 0, clock=time.perf_counter) -> float:
    """Median time of `repeats` calls of step() after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return statistics.median(times)
