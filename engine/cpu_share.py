"""How many torch threads the model worker should use, given what other programs take of the CPU.

torch splits each op over its threads and waits for the slowest. With 2 threads on 2 cores and
another program busy on one of them, every op waits for the thread that shares its core, and
the whole model runs at that thread's pace (docs/performance.md has the figures). So the
worker measures, every `INTERVAL_S`, how much CPU the rest of the machine takes (all cores'
busy time from /proc/stat, less this worker's and its server's own) and uses one thread fewer
per core of it, with a band between the thresholds so that it does not flip back and forth.
Where there is no /proc (not Linux), it keeps its threads.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

INTERVAL_S = 2.0
BUSY_ABOVE = 0.5  # cores other programs use: above it, a thread fewer (per core)
FREE_BELOW = 0.25  # ... below it (of the next core), the thread comes back


@dataclass
class CpuSample:
    busy: int  # ticks all cores spent busy
    total: int  # ticks all cores spent, busy or idle
    ours: int  # ticks of our processes


def others_cores(a: CpuSample, b: CpuSample, num_cpus: int) -> float:
    """Cores other programs kept busy on average between two samples."""
    wall = (b.total - a.total) / num_cpus
    if wall <= 0:
        return 0.0
    return max(0.0, ((b.busy - a.busy) - (b.ours - a.ours)) / wall)


def choose_threads(current: int, most: int, others: float) -> int:
    """The threads to use now, from `current`, at most `most`, with `others` cores taken."""
    want_fewer = most - int(others + 1 - BUSY_ABOVE)  # one fewer per core over BUSY_ABOVE
    want_more = most - int(others + 1 - FREE_BELOW)
    if want_fewer < current:
        return max(1, want_fewer)
    if want_more > current:
        return min(most, want_more)
    return current


def _process_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15)


def read_sample(pids: list[int]) -> CpuSample | None:
    """Now, from /proc (None where it cannot be read)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        ours = sum(_process_ticks(pid) for pid in pids)
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq = values[:7]
    busy = user + nice + system + irq + softirq
    return CpuSample(busy, busy + idle + iowait, ours)


class CpuShare:
    """Follows the machine's load; `update()` before each step -> the threads to use."""

    def __init__(self, most: int, pids: list[int]):
        self.most, self.threads, self.pids = most, most, pids
        self.num_cpus = os.cpu_count() or 1
        self.last = read_sample(pids)
        self.last_at = time.monotonic()
        self.others = 0.0

    def update(self) -> int:
        if self.last is None or self.most <= 1 or time.monotonic() - self.last_at < INTERVAL_S:
            return self.threads
        sample = read_sample(self.pids)
        if sample is None:
            return self.threads
        self.others = others_cores(self.last, sample, self.num_cpus)
        self.last, self.last_at = sample, time.monotonic()
        self.threads = choose_threads(self.threads, self.most, self.others)
        return self.threads
