"""The thread pool's placement (native/threads.c, legacy_engine/cpu/threads.py pin_order) and the phase profile.

Affinity is read back from the kernel (os.sched_getaffinity of each thread of this process), not from the
engine's own record, so a pool that records a pin it never made fails here. The profile must account for the
forward pass's wall time (its phases are spans on the calling thread) and name only phases that ran.

A machine that is doing other things too (issue 21), tested by mechanism, not by speed (speed: `legacy-engine bench
shared`): a worker the scheduler does not run (the le_pool_hold test hook) is not waited for, in le_parallel_for
and le_parallel_each jobs, with the same bits; the caller waiting for a worker that lost its CPU inside a job, and
idle workers, sleep on a futex (read back from /proc: the thread's state and system call), not spin; two threads
of the pool on one CPU yield it to each other; the hybrid
decode's poll of a channel backs off to sleeps; pinning is skipped where a load reading (cpu_load) says other work
runs on the allowed CPUs.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from fixtures.make_reference import tiny_gguf

from legacy_engine.core import _native

from legacy_engine.cpu import cpu_load
from legacy_engine.gpu.model import HybridLayout
from legacy_engine.cpu.model import Model
from legacy_engine.cpu.threads import default_threads, physical_cpus, pin_decision, pin_order

pytestmark = pytest.mark.cpu

ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return tiny_gguf("moe", tmp_path_factory.mktemp("threads") / "moe.gguf")


def thread_affinities() -> dict[int, set[int]]:
    """tid -> CPUs it may run on, for every thread of this process (from the kernel)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return out


def test_physical_cpus_one_per_core():
    phys = physical_cpus()
    assert phys and set(phys) <= set(ALLOWED)
    cores = set()
    for cpu in phys:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        if os.path.exists(base + "core_id"):
            key = (open(base + "physical_package_id").read(), open(base + "core_id").read())
            assert key not in cores, f"CPU {cpu} shares a core with an earlier one"
            cores.add(key)
    assert default_threads() == len(phys)


def test_pin_order_covers_allowed_cpus_once():
    order = pin_order(len(ALLOWED))
    assert sorted(order) == ALLOWED
    assert order[:len(physical_cpus())] == physical_cpus() or _native.numa_info()["nodes"] > 1
    assert pin_order(len(ALLOWED) + 1) is None  # more threads than CPUs: left to the scheduler


@pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning a worker needs 2 CPUs")
def test_workers_are_pinned_as_reported(moe_path):
    before = set(thread_affinities())
    m = Model(moe_path, n_threads=2, pin="always")    # whatever else runs on this machine now
    workers = {tid: cpus for tid, cpus in thread_affinities().items() if tid not in before}
    assert len(workers) == 1, "one worker thread besides the caller"
    order = pin_order(2)
    assert m.pinned == [-1, order[1]]  # the caller's thread is never pinned
    assert list(workers.values()) == [{order[1]}], "the kernel's affinity of the worker is its one CPU"
    assert os.sched_getaffinity(0) == set(ALLOWED), "the calling thread keeps its affinity"
    del m


def test_no_pin_leaves_workers_free(moe_path):
    before = set(thread_affinities())
    m = Model(moe_path, n_threads=2, pin=False)
    workers = [cpus for tid, cpus in thread_affinities().items() if tid not in before]
    assert m.pinned == [-1, -1]
    assert all(cpus == set(ALLOWED) for cpus in workers)
    del m


def test_pinned_and_unpinned_give_the_same_logits(moe_path):
    ids = np.random.default_rng(5).integers(0, 200, 40).tolist()
    outs = []
    for pin in ("always", False):
        m = Model(moe_path, n_threads=2, pin=pin)
        st = m.new_state(64)
        outs.append(np.concatenate([m.forward(st, ids[:33]), m.forward(st, ids[33:34], chunked=False)]))
    assert np.array_equal(outs[0], outs[1])


def test_profile_accounts_for_the_forward_pass(moe_path):
    m = Model(moe_path, n_threads=2)
    st = m.new_state(64)
    m.forward(st, [1, 2, 3])
    m.native.set_profile(True)
    t0 = time.perf_counter()
    for tok in range(5):
        m.forward(st, [tok], chunked=False)
    wall = time.perf_counter() - t0
    prof = m.native.profile()
    assert set(prof) == set(_native.PROFILE_PHASES)
    total = sum(prof.values())
    assert 0 < total <= wall, "the phases are spans inside the calls"
    ran = {k for k, v in prof.items() if v > 0}
    assert {"gdn_proj", "gdn_core", "attn_core", "moe_router", "ffn_gate_up", "ffn_down", "lm_head"} <= ran
    m.native.set_profile(True)  # turning it on again resets
    assert sum(m.native.profile().values()) == 0


# ------------------------------------------------------------------------------------------------ issue 21

def load_reading(busy: dict[int, float]) -> cpu_load.CpuLoad:
    """A cpu_load reading with these busy fractions and none of it this process's."""
    return cpu_load.CpuLoad(ALLOWED, busy, 0.0, 0.0, cpu_load.SAMPLE_S)


def worker_tids(before: set[int]) -> list[int]:
    return sorted(tid for tid in thread_affinities() if tid not in before)


# the futex system call's number, as /proc/<tid>/syscall's first field shows it
FUTEX_NR = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


def blocked_in(tid: int) -> tuple[str, int | None]:
    """(the thread's state letter, the system call it is blocked in or None) from /proc."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            first = f.read().split()[0]
        return state, int(first) if first.lstrip("-").isdigit() else None
    except OSError:
        return state, None


class apart:
    """`with apart(m):` the calling thread on another CPU than m's worker 1 (pinned: pin="always"), so that the
    worker joins the jobs it is awake for (on one CPU with the caller it yields to it)."""

    def __init__(self, m):
        self.cpu = next(c for c in ALLOWED if c != m.pinned[1])

    def __enter__(self):
        self.saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self.cpu})

    def __exit__(self, *exc):
        os.sched_setaffinity(0, self.saved)


def until_joined(m, run, timeout: float = 5.0) -> bool:
    """Runs run() until worker 1 has joined one of its jobs (it is awake and spinning right after); False if not in
    timeout s (a loaded machine that does not run it)."""
    j0, t0 = m.native.pool_stats()["joined"], time.monotonic()
    while time.monotonic() - t0 < timeout:
        run()
        if m.native.pool_stats()["joined"] > j0:
            return True
    return False


def test_default_threads_one_per_core_whatever_the_load():
    """The rule (threads.default_threads): one thread per physical core; the load decides pinning, not the count."""
    assert default_threads() == len(physical_cpus())


@pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning a worker needs 2 CPUs")
def test_pinning_skipped_where_other_work_runs(moe_path, monkeypatch):
    """pin=True (the default) pins only when the load reading finds the allowed CPUs idle; where other work runs
    the workers stay free (the kernel's affinity says so) and pin_why / load_report say why."""
    busy = load_reading({ALLOWED[0]: 1.0})
    idle = load_reading({})
    assert busy.shared and not idle.shared
    assert pin_decision(True, 2, busy)[0] is None and "other work" in pin_decision(True, 2, busy)[1]
    assert pin_decision(True, 2, idle)[0] == pin_order(2)
    assert pin_decision("always", 2, busy)[0] == pin_order(2)
    assert pin_decision(False, 2, idle)[0] is None
    for reading, pinned in ((busy, False), (idle, True)):
        monkeypatch.setattr(cpu_load, "current", lambda reading=reading: reading)
        before = set(thread_affinities())
        m = Model(moe_path, n_threads=2)
        (tid,) = worker_tids(before)
        if pinned:
            assert m.pinned == [-1, pin_order(2)[1]] and os.sched_getaffinity(tid) == {pin_order(2)[1]}
        else:
            assert m.pinned == [-1, -1] and os.sched_getaffinity(tid) == set(ALLOWED)
            assert "not pinned: other work" in m.pin_why and m.load_report["pinning"] == m.pin_why
            assert m.load_report["cpu_load"]["shared"]
        del m


@pytest.mark.skipif(len(ALLOWED) < 2, reason="a busy CPU beside a free one needs 2 CPUs")
def test_load_reading_sees_a_busy_process():
    """cpu_load.sample sees a process spinning on one CPU (and not this process's own work), so a model loaded
    beside it is not pinned."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(p.pid, {ALLOWED[0]})
        time.sleep(0.3)
        load = cpu_load.sample(0.3)
        assert load.busy[ALLOWED[0]] > 0.7 and load.other > cpu_load.BUSY_CPU and load.shared
        assert pin_decision(True, 2, load)[0] is None
    finally:
        p.kill()
        p.wait()


@pytest.mark.skipif(len(ALLOWED) < 2, reason="a worker apart from the caller needs 2 CPUs")
def test_late_worker_is_not_waited_for(moe_path):
    """A worker the scheduler does not run (held: it joins no job) costs nothing: prefill and decode finish on the
    caller with the same logits as one thread, every job of it counted as missed by the worker; let go, it joins
    again."""
    ids = np.random.default_rng(7).integers(0, 200, 24).tolist()
    one = Model(moe_path, n_threads=1)
    st1 = one.new_state(64)
    ref = [one.forward(st1, ids[:20]), *(one.forward(st1, [t], chunked=False) for t in ids[20:])]
    m = Model(moe_path, n_threads=2, pin="always")
    st = m.new_state(64)
    m.native.pool_hold(1, 1)
    s0 = m.native.pool_stats()
    out = [m.forward(st, ids[:20]), *(m.forward(st, [t], chunked=False) for t in ids[20:])]
    s1 = m.native.pool_stats()
    assert all(np.array_equal(a, b) for a, b in zip(out, ref))
    assert s1["jobs"] > s0["jobs"] and s1["joined"] == s0["joined"], "the held worker ran in no job"
    m.native.pool_hold(1, 0)
    st.reset()
    with apart(m):
        assert until_joined(m, lambda: (st.reset(), m.forward(st, [1], chunked=False)))


def test_late_worker_share_of_a_static_split_is_stolen(moe_path):
    """le_parallel_each (the hybrid decode's experts, le_moe_routed: a static split per thread): a held worker's
    share is run by the caller, same bits."""
    m = Model(moe_path, n_threads=2, pin=False)
    hp = m.hparams
    rng = np.random.default_rng(3)
    x = rng.standard_normal(hp.n_embd).astype(np.float32)
    ids = rng.choice(hp.n_expert, hp.n_expert_used, replace=False).astype(np.int32)
    wts = rng.dirichlet(np.ones(hp.n_expert_used)).astype(np.float32)
    ref = m.native.moe_routed(0, x, ids, wts)
    m.native.pool_hold(1, 1)
    s0 = m.native.pool_stats()
    assert np.array_equal(m.native.moe_routed(0, x, ids, wts), ref)
    s1 = m.native.pool_stats()
    assert s1["stolen"] > s0["stolen"] and s1["joined"] == s0["joined"]


@pytest.mark.skipif(len(ALLOWED) < 2, reason="a worker apart from the caller needs 2 CPUs")
def test_caller_sleeps_waiting_for_a_descheduled_worker(moe_path):
    """A worker that lost its CPU inside a job (held 2: it sleeps 20 ms there) is waited for by a caller that
    sleeps on a futex after its short spin (CALLER_SPIN_NS), not one that spins for the 20 ms."""
    m = Model(moe_path, n_threads=2, pin="always")
    hp = m.hparams
    x = np.ones(hp.n_embd, np.float32)
    ids = np.arange(hp.n_expert_used, dtype=np.int32)
    wts = np.full(hp.n_expert_used, 1.0 / hp.n_expert_used, np.float32)
    ref = m.native.moe_routed(0, x, ids, wts)
    for _ in range(5):              # the worker must be awake to join: right after a job it spins (1 ms)
        with apart(m):
            until_joined(m, lambda: m.native.moe_routed(0, x, ids, wts))
            m.native.pool_hold(1, 2)
            s0 = m.native.pool_stats()
            c0, t0 = time.thread_time(), time.perf_counter()
            out = m.native.moe_routed(0, x, ids, wts)
            cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
            s1 = m.native.pool_stats()
            m.native.pool_hold(1, 0)
        joins = s1["joined"] - s0["joined"]
        if joins:
            break
    assert joins, "the worker joined no job in 5 tries"
    assert np.array_equal(out, ref)
    assert wall >= 0.02 * joins * 0.9, "the caller waited for the worker inside each job it joined"
    assert s1["caller_sleeps"] > s0["caller_sleeps"]
    assert cpu < 0.5 * wall, f"the caller spun: {cpu * 1e3:.1f} ms of CPU in {wall * 1e3:.1f} ms"


@pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning a worker needs 2 CPUs")
def test_threads_on_one_cpu_yield_to_each_other(moe_path):
    """Where the scheduler puts the caller and a worker on one CPU, the one that waits yields the CPU to the one
    with work (a worker spinning for the next job would take the caller's time); same logits."""
    ids = list(range(1, 9))
    m = Model(moe_path, n_threads=2, pin="always")
    cpu = m.pinned[1]
    st = m.new_state(64)
    ref = m.forward(st, ids)
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})                  # the caller onto the worker's CPU
    try:
        s0 = m.native.pool_stats()
        st.reset()
        out = m.forward(st, ids)
        for t in ids:
            m.forward(st, [t], chunked=False)
        s1 = m.native.pool_stats()
    finally:
        os.sched_setaffinity(0, saved)
    assert np.array_equal(out, ref)
    assert s1["yields"] > s0["yields"]


@pytest.mark.skipif(FUTEX_NR is None, reason=f"the futex call's number on {platform.machine()} is not listed")
def test_idle_workers_sleep_on_a_futex(moe_path):
    """Past their spin budget (LE_SPIN_US, 1 ms) idle workers block in the futex system call."""
    before = set(thread_affinities())
    m = Model(moe_path, n_threads=3, pin=False)
    tids = worker_tids(before)
    assert len(tids) == 2
    st = m.new_state(64)
    m.forward(st, [1, 2, 3])
    deadline = time.monotonic() + 2.0
    asleep = lambda s: s[0] == "S" and s[1] in (FUTEX_NR, None)   # noqa: E731 (None: /proc hides the call)
    while True:                     # 1 ms of spinning, then asleep (a loaded machine may run them late)
        states = [blocked_in(t) for t in tids]
        if all(map(asleep, states)) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert all(map(asleep, states)), states
    assert m.native.pool_stats()["worker_sleeps"] >= 2
    assert m.native.pool_stats()["spin_us"] == 1000


def test_hybrid_poll_backs_off_to_sleeps(moe_path):
    """le_hybrid_serve's wait for READY: past the spin budget it sleeps between looks (a wait of 0.3 s costs the
    serving thread little CPU) and still answers within a few ms of READY."""
    m = Model(moe_path, n_threads=1)
    hp = m.hparams
    lay = HybridLayout(hp.n_embd, hp.n_expert_used, hp.n_layer)
    chan = np.zeros(lay.channel_words, dtype=np.int32)
    chan[lay.seq] = 1
    s = lay.slot(chan, 0)
    s[lay.h:lay.h + lay.E] = np.ones(lay.E, np.float32).view(np.int32)
    s[lay.ids:lay.ids + lay.k] = np.arange(lay.k)
    s[lay.cpu_ids:lay.cpu_ids + lay.k] = np.arange(lay.k)
    s[lay.wts:lay.wts + lay.k] = np.full(lay.k, 1.0 / lay.k, np.float32).view(np.int32)
    ready_at = []

    def gpu():
        time.sleep(0.3)
        ready_at.append(time.perf_counter())
        s[lay.ready] = 1

    stats = np.zeros(_native.lib.LE_HY_STATS)
    t = threading.Thread(target=gpu)
    c0, t0 = time.thread_time(), time.perf_counter()
    t.start()
    m.native.hybrid_serve(chan, 1, np.array([0], np.int32), stats=stats, timeout_s=10)
    cpu, done = time.thread_time() - c0, time.perf_counter()
    t.join()
    assert s[lay.done] == 1
    assert stats[_native.lib.LE_HY_STAT_SLEEPS] > 0
    assert cpu < 0.5 * (done - t0), f"the poll spun: {cpu * 1e3:.0f} ms of CPU in {(done - t0) * 1e3:.0f} ms"
    assert done - ready_at[0] < 0.1, "answered long after READY"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="FTZ/DAZ is the x86 builds' mode")
def test_denormals_flushed_inside_the_core_and_kept_outside(moe_path):
    """The core runs flushed (le_fp_flushes; `info` says so) and puts the caller's mode back: after a forward pass on
    several threads, numpy on this thread still produces and reads denormals (gradual underflow)."""
    assert _native.fp_flushes()
    tiny = np.float32(1e-38) * np.float32(1e-3)          # 1e-41: a denormal where the mode is IEEE's
    assert tiny != 0 and tiny * np.float32(1e3) != 0
    m = Model(moe_path, 3)
    m.forward(m.new_state(64), [1, 2, 3, 4, 5])
    again = np.float32(1e-38) * np.float32(1e-3)
    assert again == tiny and again * np.float32(1e3) != 0
