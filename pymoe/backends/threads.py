"""Sharing the CPU: how many threads the compiled kernels use when other processes want cores too.

What this is: `ThreadGovernor`, which the CPU backend asks before each forward call (`CPUBackend.share_cpu`) how
many threads to run, and `others_cpu`, the measurement it decides by.

Why: Numba runs a kernel's parallel loop on a team of threads (its OpenMP threading layer) and every loop ends in
a barrier, so a step goes at the pace of its slowest thread. On a quiet machine each thread has a core and the
barrier costs microseconds. When another process keeps a core busy, the kernel thread that shares that core runs
only in the scheduler's time slices (milliseconds), and a decode step has a few hundred loops: the demo model's
decode fell from ~1,300 tok/s to 15 beside two busy processes on 2 cores, while one thread still gave ~500. So the
team shrinks to the cores the others leave free:

    others  = (CPU time all processes used - CPU time this process used) / wall time, over the last interval
    threads = clamp(round(cores - others), 1, the most allowed)

measured at most every INTERVAL_S (reading /proc/stat: ~20 us), so a quiet machine keeps every core and a busy
one gets a fair share (docs/performance.md "A shared machine", bench/contention.py). The thread count changes no
result: the kernels split their work so that each output's sums are the same for any number of threads (the
thread-split tests in tests/test_repack.py and tests/test_every_command.py).

It governs only when the thread count was not given (`-t`); PYMOE_ADAPT_THREADS=0 turns it off. Without
/proc/stat (not Linux) it keeps the most allowed.
What this is not: a scheduler of requests (serve/scheduler.py), or a setting of Numba's threading layer.
"""
from __future__ import annotations

import os
import time
from typing import Optional

INTERVAL_S = 0.2  # how often the others' use is measured: a step of a small model is ~1 ms, of a large one ~100
PROC_STAT = "/proc/stat"


def cpu_ticks(path: str = PROC_STAT) -> Optional[tuple[int, int]]:
    """(busy, total) clock ticks of all CPUs since boot from /proc/stat's first line, or None where it is not
    readable. busy = total - idle - iowait."""
    try:
        with open(path, "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), which is what a team of threads can use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ThreadGovernor:
    """threads(now) -> how many threads the next forward call should use (see the module docstring)."""

    def __init__(self, most: int, cores: Optional[int] = None, interval_s: float = INTERVAL_S,
                 ticks=cpu_ticks, own_cpu=time.process_time, clock=time.monotonic):
        """most: the team's size on a quiet machine; ticks / own_cpu / clock: the measurements (tests pass
        their own)."""
        self.most = max(1, int(most))
        self.cores = int(cores or usable_cores())
        self.interval_s = float(interval_s)
        self._ticks, self._own_cpu, self._clock = ticks, own_cpu, clock
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.current = self.most
        self.others = 0.0  # cores the other processes used over the last interval
        self.changes = 0  # how often the count changed (telemetry)
        self._last = self._sample()

    def _sample(self):
        ticks = self._ticks()
        return None if ticks is None else (self._clock(), self._own_cpu(), *ticks)

    def threads(self) -> int:
        """The thread count for the next forward call: re-measured when INTERVAL_S has passed, else the last."""
        if self._last is None:
            return self.current
        now = self._clock()
        if now - self._last[0] < self.interval_s:
            return self.current
        sample = self._sample()
        if sample is None:
            return self.current
        t0, own0, busy0, total0 = self._last
        t1, own1, busy1, total1 = sample
        self._last = sample
        if total1 <= total0:
            return self.current
        # all CPUs' busy time over the interval in cores (ticks / all ticks x cores), less this process's own
        busy_cores = (busy1 - busy0) / (total1 - total0) * self.cores
        own_cores = (own1 - own0) / max(t1 - t0, 1e-9)
        self.others = max(0.0, busy_cores - own_cores)
        want = max(1, min(self.most, int(round(self.cores - self.others))))
        if want != self.current:
            self.current, self.changes = want, self.changes + 1
        return self.current


def adaptive(threads_given: Optional[int]) -> bool:
    """Whether to govern: the thread count was not given, and PYMOE_ADAPT_THREADS is not 0."""
    return not threads_given and os.environ.get("PYMOE_ADAPT_THREADS", "1") != "0"
