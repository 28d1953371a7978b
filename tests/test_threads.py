"""The thread pool's placement (native/threads.c, legacy_engine/model.py pin_order) and the phase profile.

Affinity is read back from the kernel (os.sched_getaffinity of each thread of this process), not from the
engine's own record, so a pool that records a pin it never made fails here. The profile must account for the
forward pass's wall time (its phases are spans on the calling thread) and name only phases that ran.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from fixtures.make_reference import tiny_gguf

from legacy_engine import _native
from legacy_engine.model import Model, default_threads, physical_cpus, pin_order

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
    m = Model(moe_path, n_threads=2)
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
    for pin in (True, False):
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
