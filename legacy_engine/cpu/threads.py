"""Where the C core's thread pool runs: how many threads by default, and the CPUs its workers are pinned to.

One thread per physical core (default_threads); workers pinned in pin_order (physical cores first, over the NUMA
nodes) only where no other work runs on the allowed CPUs at load (pin_decision reads cpu_load). `report` is
`info`'s view of both.
"""
from __future__ import annotations

import os

from ..core import _native
from . import cpu_load


def _cpu_topology(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU from sysfs; (0, cpu) where sysfs does not say."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f:
            package = int(f.read())
        with open(base + "core_id") as f:
            return package, int(f.read())
    except (OSError, ValueError):
        return 0, cpu


def physical_cpus() -> list[int]:
    """One logical CPU per physical core of those this process may run on (the first hyper-thread of each
    core), in CPU order: the default thread placement."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))
    seen, out = set(), []
    for cpu in allowed:
        key = _cpu_topology(cpu)
        if key not in seen:
            seen.add(key)
            out.append(cpu)
    return out


def default_threads() -> int:
    """One thread per physical core available: the kernels are bound by memory bandwidth, and a second
    hyper-thread on a core only competes for the same load ports. Also where other work runs on some or all of
    the cores (issue 21): the pool does not wait for a thread that the scheduler has not run (native/threads.c),
    so a thread on a busy core adds its share of that core and costs little; measured (`legacy-engine bench
    shared`, 2 and 16 cores, 1, half and all of them busy) this count was the fastest or within the runs' spread
    of it, while one per idle core lost 1.6x (2 cores) and 5x (16 cores) with every core busy."""
    return max(1, len(physical_cpus()))


def pin_order(n_threads: int) -> list[int] | None:
    """The CPUs the pool's threads are pinned to (thread i -> element i): physical cores first, dealt over
    the NUMA nodes round-robin when there are several (so each node's memory gets its share of readers),
    then the remaining hyper-threads. None when there are more threads than allowed CPUs (pinning would
    stack threads on a CPU; the scheduler does better then)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return None
    if n_threads > len(allowed):
        return None
    phys = physical_cpus()
    order = phys
    try:
        if _native.numa_info()["nodes"] > 1:
            spread = [c for c in _native.numa_spread_cpus() if c in phys]
            order = spread + [c for c in phys if c not in spread]
    except Exception:  # libnuma absent or unreadable topology: CPU order
        order = phys
    return order + [c for c in allowed if c not in order]


def pin_decision(pin, n_threads: int, load: cpu_load.CpuLoad | None = None) -> tuple[list[int] | None, str]:
    """(the CPUs to pin the pool's threads to or None, why). pin=True pins (pin_order) only where no other work
    runs on the allowed CPUs (`load`, default cpu_load.current()): a pinned thread cannot leave a core that
    other work takes, an unpinned one is moved by the scheduler; pin='always' pins anyway; False never."""
    if n_threads < 2:
        return None, "one thread: nothing to pin"
    if not pin:
        return None, "not pinned (--no-pin)"
    order = pin_order(n_threads)
    if order is None:
        return None, f"not pinned: {n_threads} threads for fewer CPUs (the scheduler places them)"
    if pin != "always":
        load = cpu_load.current() if load is None else load
        if load and load.shared:
            return None, (f"not pinned: other work on {load.other:.1f} CPUs at load (the scheduler moves unpinned "
                          "threads off busy CPUs)")
    return order, f"workers pinned to CPUs {','.join(map(str, order[1:n_threads]))}" + (
        " (pin='always')" if pin == "always" else " (no other work on the CPUs at load)")


def report() -> dict:
    """`info`'s view: the load now, and the default threads and pinning (default_threads, pin_decision)."""
    load = cpu_load.current()
    n = default_threads()
    return {"load": load.as_dict() if load else None, "describe": load.describe() if load else "no /proc/stat",
            "default_threads": n, "pinning": pin_decision(True, n, load)[1]}


def format_report(rep: dict) -> list[str]:
    return [f"Load     {rep['describe']}",
            f"  default {rep['default_threads']} threads (one per core, whatever the load; -t sets it): "
            f"{rep['pinning']}"]
