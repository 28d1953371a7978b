"""Memory and NUMA: native/memory.c + native/numa.c (le_memory.h).

Anonymous memory for weights (--no-mmap), madvise, NUMA policies through libnuma (dlopened). Without libnuma the
NUMA calls raise UnavailableError saying what to install; a node that is not on this machine too. Addresses are
taken from any buffer (numpy array, memmap, bytearray): a policy or advice covers the pages that hold it.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..errors import UnavailableError
from ._lib import check, ffi, lib, struct_to_dict

NUMA_MODES = {"off": "LE_NUMA_OFF", "interleave": "LE_NUMA_INTERLEAVE", "node": "LE_NUMA_NODE"}
# the kernel's policy modes (linux/mempolicy.h) as mem_policy reports them
MPOL_NAMES = ("default", "preferred", "bind", "interleave", "local", "preferred_many", "weighted_interleave")


def _numa_check(code: int, what: str) -> None:
    """No libnuma, or a node this machine does not have: UnavailableError (the message without file:line)."""
    if code in (lib.LE_ERR_UNAVAILABLE, lib.LE_ERR_INVALID_ARG):
        detail = ffi.string(lib.le_last_error()).decode("utf-8", "replace")
        raise UnavailableError(f"{what}: {detail.split(': ', 1)[-1]}")
    check(code, what)


def _address(buf) -> tuple:
    """(void * cdata, nbytes) of a buffer; the cdata keeps `buf` alive while it lives."""
    b = ffi.from_buffer(buf)
    return ffi.cast("void *", b), len(b), b


class AnonMemory:
    """Anonymous memory from le_mem_alloc: 2 MiB aligned and sized, MADV_HUGEPAGE asked for.

    `array` is a writable uint8 view of the first `nbytes` bytes; the memory is unmapped when
    the last view of it (the array, slices of it, ffi buffers made from them) is gone.
    `hugepage`: the kernel accepted MADV_HUGEPAGE (`hugepage_errno` otherwise)."""

    def __init__(self, nbytes: int):
        r = ffi.new("le_mem_region *")
        check(lib.le_mem_alloc(int(nbytes), r), f"le_mem_alloc({nbytes})")
        size = int(r.size)
        owner = ffi.gc(r.ptr, lambda p: lib.le_mem_free(p, size), size=size)
        self.ptr, self.size, self.nbytes = owner, size, int(nbytes)
        self.hugepage, self.hugepage_errno = bool(r.advice.hugepage), int(r.advice.hugepage_errno)
        self.array = np.frombuffer(ffi.buffer(owner, size), dtype=np.uint8)[: self.nbytes]


def mem_alloc(nbytes: int) -> AnonMemory:
    return AnonMemory(nbytes)


def mem_advise(buf, hugepage: bool = False, willneed: bool = False) -> dict:
    """madvise(MADV_HUGEPAGE / MADV_WILLNEED) over buf's pages -> what the kernel answered:
    {'hugepage', 'hugepage_errno', 'willneed', 'willneed_errno'} (accepted is not honoured:
    /proc/self/smaps says whether huge pages back it)."""
    p, n, _keep = _address(buf)
    out = ffi.new("le_advice_result *")
    advice = (lib.LE_ADVISE_HUGEPAGE if hugepage else 0) | (lib.LE_ADVISE_WILLNEED if willneed else 0)
    check(lib.le_mem_advise(p, n, advice, out), "le_mem_advise")
    return struct_to_dict(out)


def mem_prefault(buf) -> None:
    """Faults every page of buf in for reading (a file map: reads the file into the page cache)."""
    p, n, _keep = _address(buf)
    check(lib.le_mem_prefault(p, n), "le_mem_prefault")


def _numa_mode(mode: str) -> int:
    try:
        return getattr(lib, NUMA_MODES[mode])
    except KeyError:
        raise ValueError(f"unknown NUMA mode {mode!r}; one of {', '.join(NUMA_MODES)}") from None


def _policy_dict(p) -> dict:
    mode = p.mode & 0xFF  # the low bits; the kernel's mode flags (MPOL_F_STATIC_NODES ...) sit above
    nodes = [n for n in range(1024) if p.nodemask[n // 64] >> (n % 64) & 1]
    return {"mode": mode, "name": MPOL_NAMES[mode] if mode < len(MPOL_NAMES) else str(mode), "flags": p.mode & ~0xFF,
            "nodes": nodes}


def mem_set_numa(buf, mode: str, node: int = -1) -> None:
    """Sets the NUMA policy of buf's pages (mbind, moving pages already there): mode 'interleave'
    (every allowed memory node), 'node' (bind to `node`) or 'off' (the default policy)."""
    p, n, _keep = _address(buf)
    _numa_check(lib.le_mem_set_numa(p, n, _numa_mode(mode), int(node)),
                f"NUMA policy {mode}{':' + str(node) if mode == 'node' else ''}")


def mem_policy(buf) -> dict:
    """The policy of the mapping holding buf's first byte: {'mode', 'name', 'flags', 'nodes'}."""
    p, _n, _keep = _address(buf)
    out = ffi.new("le_mempolicy *")
    _numa_check(lib.le_mem_get_policy(p, out), "NUMA get_mempolicy")
    return _policy_dict(out)


def mem_page_nodes(buf, stride: int = 0, max_nodes: int = 1024) -> dict:
    """Where buf's pages are, sampling one every `stride` bytes (0: every page), without touching
    them: {'nodes': {node: pages}, 'absent': pages not in memory}."""
    p, n, _keep = _address(buf)
    counts = ffi.new("int[]", max_nodes)
    absent = ffi.new("int *")
    _numa_check(lib.le_mem_page_nodes(p, n, int(stride), counts, max_nodes, absent), "NUMA page query")
    return {"nodes": {i: counts[i] for i in range(max_nodes) if counts[i]}, "absent": absent[0]}


def numa_thread_policy() -> dict:
    out = ffi.new("le_mempolicy *")
    _numa_check(lib.le_numa_get_thread_policy(out), "NUMA thread policy")
    return _policy_dict(out)


@contextlib.contextmanager
def numa_thread_policy_set(mode: str, node: int = -1):
    """`with numa_thread_policy_set('interleave'):` the calling thread allocates new pages (page
    cache included) under this policy; its previous policy is put back on exit."""
    what = f"NUMA policy {mode}{':' + str(node) if mode == 'node' else ''}"
    saved = ffi.new("le_mempolicy *")
    _numa_check(lib.le_numa_get_thread_policy(saved), what)
    _numa_check(lib.le_numa_set_thread_policy(_numa_mode(mode), int(node)), what)
    try:
        yield
    finally:
        check(lib.le_numa_restore_thread_policy(saved), "le_numa_restore_thread_policy")


def _int_list(fn, what: str, cap: int = 4096) -> list[int]:
    out = ffi.new("int[]", cap)
    n = ffi.new("int *")
    _numa_check(fn(out, cap, n), what)
    return [out[i] for i in range(n[0])]


def numa_nodes() -> list[int]:
    """The memory nodes this process may allocate from."""
    return _int_list(lib.le_numa_nodes, "NUMA nodes", 1024)


def numa_cpus_of_node(node: int) -> list[int]:
    return _int_list(lambda o, c, n: lib.le_numa_cpus_of_node(int(node), o, c, n), f"NUMA CPUs of node {node}")


def numa_spread_cpus() -> list[int]:
    """Allowed CPUs dealt round-robin over the nodes (node 0's first, node 1's first, ...):
    pin worker i to element i to spread a thread pool evenly over the nodes."""
    return _int_list(lib.le_numa_spread_cpus, "NUMA spread CPUs")


def numa_set_library(name: str | None) -> None:
    """Test hook: the library NUMA calls load from now on (None: $LE_NUMA_LIB, else libnuma.so.1).
    A name that does not load simulates a machine without libnuma."""
    check(lib.le_numa_set_library(ffi.NULL if name is None else name.encode()), "le_numa_set_library")
