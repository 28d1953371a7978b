"""What else runs on this process's CPUs: a short sample of /proc/stat, read when a model loads.

The engine's choices when the machine is shared (issue 21: a browser, a build or another model beside it):
  pinning  only where no other work runs on the allowed CPUs (threads.pin_decision): a pinned thread cannot move
           off a core that other work takes, an unpinned one is moved by the scheduler
  planner  a machine probe taken while other work runs is flagged and retaken (probe.measure)
  threads  not from the load: one per physical core (threads.default_threads; the pool does not wait for a thread
           the scheduler has not run, so a thread on a busy core costs little and adds its share)
"CPUs busy with other work" = the busy time of every allowed CPU over the sample (user, nice, system, irq,
softirq, steal), less this process's own CPU time, in CPUs; other work of half a CPU or more makes the machine
shared. The 1-minute load average is recorded beside it but not used: it lags a load that started seconds ago.
"""
from __future__ import annotations

import dataclasses
import os
import time

SAMPLE_S = 0.1          # long enough for ~10 of /proc/stat's 10 ms ticks per CPU
MAX_AGE_S = 2.0         # current() reuses a sample this young (a process loading several models samples once)
BUSY_CPU = 0.5          # other work of at least this many CPUs' worth makes the machine shared


@dataclasses.dataclass
class CpuLoad:
    allowed: list[int]           # the CPUs this process may run on (sched_getaffinity)
    busy: dict[int, float]       # CPU -> busy fraction over the sample (all work, this process's included)
    own: float                   # CPUs' worth of this process's work during the sample
    load_avg: float              # /proc/loadavg, 1 minute (recorded, not used: it lags)
    sample_s: float

    @property
    def other(self) -> float:
        """CPUs' worth of other processes' work on the allowed CPUs during the sample."""
        return max(0.0, sum(self.busy.values()) - self.own)

    @property
    def shared(self) -> bool:
        """Other work of at least BUSY_CPU CPUs' worth runs here."""
        return self.other >= BUSY_CPU

    def describe(self) -> str:
        hot = [c for c, b in sorted(self.busy.items()) if b >= BUSY_CPU]
        return (f"other work on {self.other:.1f} of {len(self.allowed)} CPUs ("
                + (f"busy: CPU {','.join(map(str, hot))}; " if hot else "")
                + f"{self.sample_s * 1e3:.0f} ms sample, load average {self.load_avg:.2f})")

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), other=self.other, shared=self.shared)


def _read_stat() -> dict[int, tuple[int, int]]:
    """CPU -> (busy ticks, total ticks) since boot, from /proc/stat."""
    out = {}
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *v = line.split()
            t = [int(x) for x in v[:8]] + [0] * (8 - len(v[:8]))
            user, nice, system, idle, iowait, irq, softirq, steal = t
            busy = user + nice + system + irq + softirq + steal
            out[int(name[3:])] = (busy, busy + idle + iowait)
    return out


def _allowed() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return float("nan")


def during(fn) -> tuple[object, CpuLoad | None]:
    """(fn(), the load on the allowed CPUs while it ran): other work is the CPUs' busy time less this process's
    own (fn's threads included). The load is None where /proc/stat cannot be read."""
    allowed = _allowed()
    try:
        s0, c0, w0 = _read_stat(), time.process_time(), time.perf_counter()
    except (OSError, ValueError):
        return fn(), None
    result = fn()
    try:
        s1, c1, w1 = _read_stat(), time.process_time(), time.perf_counter()
    except (OSError, ValueError):
        return result, None
    busy = {}
    for cpu in allowed:
        if cpu in s0 and cpu in s1:
            total = s1[cpu][1] - s0[cpu][1]
            busy[cpu] = min(1.0, (s1[cpu][0] - s0[cpu][0]) / total) if total > 0 else 0.0
    return result, CpuLoad(allowed, busy, (c1 - c0) / (w1 - w0), _load_avg(), w1 - w0)


def sample(duration: float = SAMPLE_S) -> CpuLoad | None:
    """Busy fraction of each allowed CPU over `duration` seconds, and this process's own share; None where
    /proc/stat cannot be read (then the defaults assume an idle machine)."""
    return during(lambda: time.sleep(duration))[1]


_last: tuple[float, CpuLoad | None] | None = None


def current(max_age: float = MAX_AGE_S) -> CpuLoad | None:
    """sample(), or the last one if it is younger than max_age seconds."""
    global _last
    now = time.monotonic()
    if _last is None or now - _last[0] > max_age:
        _last = (now, sample())
    return _last[1]
