"""Engine-core threads that follow the cores other processes leave free.

A step's parallel regions run at the pace of their slowest OpenMP thread. When another process keeps
one of the engine core's cores busy (a load generator preparing its prompts, a build beside the
server), a thread waits at every barrier for a partner the OS scheduler has taken away, and a step
takes two to three times as long as it does on one thread alone (benchmarks/README.md, "Server
threads and step budget", the busy column, and "Issue 15, item 2: the TTFT tail under guidellm").
The model runner asks ``ThreadGovernor`` before each step: at most every ``window_s`` seconds it
measures how many cores the processors this process may run on spent on other processes (Linux
``/proc/stat``'s per-CPU busy time, less this process's own CPU time) and sets torch's intra-op
threads to the cores left, at most ``max_threads`` and at least one. A core counts as taken once others keep it busy ``TAKEN`` of the time, and as free
again below ``FREED``, so a load near the threshold does not flip the count every window.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

#: share of a core other processes must keep busy for it to count as taken
TAKEN = 0.6
#: ... and below which a taken core counts as free again
FREED = 0.4
# /proc/stat columns after the cpu name: user nice system idle iowait irq softirq steal (guest is in user)
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def cpu_busy_seconds(cpus: set[int], path: str = "/proc/stat") -> Optional[float]:
    """Seconds the processors ``cpus`` have spent busy since boot (user, nice, system, irq, softirq and
    steal time, from ``path``'s per-CPU lines), or None when the file cannot be read (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    cols = rest.split()
                    total += sum(int(cols[i]) for i in _BUSY_COLUMNS if i < len(cols))
    except (OSError, ValueError):
        return None
    return total / tick


def cpu_steal_seconds(path: str = "/proc/stat") -> Optional[float]:
    """Seconds all processors of this machine have spent in steal time since boot (time a hypervisor
    ran something else while this virtual CPU wanted to run: the "cpu" line's eighth column), or None
    when the file cannot be read or has no steal column (not Linux, an old kernel)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name == "cpu":
                    cols = rest.split()
                    return int(cols[7]) / tick if len(cols) > 7 else None
    except (OSError, ValueError):
        return None
    return None


def threads_for(others: float, max_threads: int, current: int) -> int:
    """The thread count for ``others`` cores (float, mean cores busy with other processes) kept busy
    beside ``current`` threads out of ``max_threads``: ``max_threads`` less the taken cores, in
    [1, max_threads]. Dropping a thread needs ``TAKEN`` of a core, taking it back needs under ``FREED``."""
    fewer = max_threads - math.floor(others + 1 - TAKEN)   # a core is taken from TAKEN of it busy
    more = max_threads - math.floor(others + 1 - FREED)    # ... and free again below FREED
    want = fewer if current > fewer else more if current < more else current
    return max(1, min(max_threads, want))


class ThreadGovernor:
    """Sets torch's intra-op threads between steps to the cores other processes leave free.

    ``max_threads``: the most threads (the engine core's ``--num-threads``); ``cpus``: the processors
    this process may run on (default its affinity mask). ``clock``, ``busy`` (seconds the processors
    were busy, or None), ``own`` (this process's CPU seconds) and ``set_threads`` are injectable for
    tests; by default ``time.monotonic``, ``cpu_busy_seconds``, ``time.process_time`` and
    ``torch.set_num_threads``. Where the busy time cannot be read the governor keeps ``max_threads``.
    """

    def __init__(self, max_threads: int, cpus: Optional[set[int]] = None, window_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, busy: Optional[Callable[[], Optional[float]]] = None,
                 own: Callable[[], float] = time.process_time, set_threads: Optional[Callable[[int], None]] = None):
        if cpus is None:
            cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(max_threads))
        if set_threads is None:
            import torch
            set_threads = torch.set_num_threads
        self.max_threads = max_threads
        self.threads = max_threads
        self.window_s = window_s
        self._clock, self._own, self._set = clock, own, set_threads
        self._busy = busy or (lambda: cpu_busy_seconds(cpus))
        self._last = self._sample()
        self.others = 0.0  # cores other processes kept busy in the last window

    def _sample(self) -> Optional[tuple[float, float, float]]:
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._own())

    def update(self) -> int:
        """Call between steps: at most once per ``window_s`` re-measure and, if the count changes,
        set the threads. Returns the thread count in force."""
        if self._last is None or self.max_threads <= 1:
            return self.threads
        t0, busy0, own0 = self._last
        if self._clock() - t0 < self.window_s:
            return self.threads
        now = self._sample()
        if now is None:
            return self.threads
        t1, busy1, own1 = now
        self._last = now
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        want = threads_for(self.others, self.max_threads, self.threads)
        if want != self.threads:
            log.info("engine threads %d -> %d (other processes kept %.2f cores busy)", self.threads, want, self.others)
            self._set(want)
            self.threads = want
        return self.threads
