"""Where the weights live: anonymous memory, madvise, NUMA policies (native/memory.c, native/numa.c).

Policies are read back with libnuma's own get_mempolicy through ctypes, not through the engine, so a
wrong mode or mask in the C core fails here. The model tests load the tiny MoE (f32, torch-free rebuild)
and a q4_k_m random-weight tiny MoE both ways (file map / anonymous memory) and demand bit-identical logits;
a negative control shows that --no-mmap really copied: rewriting the file changes the mapped model's
logits and not the copy's. libnuma's absence is simulated with le_numa_set_library / $LE_NUMA_LIB.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures.make_reference import tiny_gguf

from legacy_engine.core import _native
from legacy_engine.core.memory import thp_backed_bytes
from legacy_engine.plan.caps import thp_report
from legacy_engine.core.errors import NativeError, UnavailableError
from legacy_engine.format.gguf_file import GGUFFile
from legacy_engine.tools.make_model import make_model
from legacy_engine.cpu.model import Model, parse_numa

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[1]
N_THREADS = 2
MIB = 1 << 20
ABSENT = "libnuma-absent-for-tests.so.0"     # a library name that never loads
# linux/mempolicy.h, written out here so that the C core's own constants are not the oracle
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
MPOL_F_ADDR = 1 << 1

HAVE_NUMA = bool(_native.numa_info()["available"])
needs_numa = pytest.mark.skipif(not HAVE_NUMA, reason="libnuma is not installed here: "
                                + _native.numa_info()["reason"])


# ------------------------------------------------------------------------------------------------ helpers

def kernel_policy(addr: int | None) -> tuple[int, set[int]]:
    """(mode, nodes) from libnuma's get_mempolicy via ctypes: of the mapping at addr, or of the thread (None)."""
    numa = ctypes.CDLL("libnuma.so.1")
    numa.get_mempolicy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                   ctypes.c_ulong]
    numa.get_mempolicy.restype = ctypes.c_long
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * 17)()                 # 1024 nodes + a spare word (the kernel's maxnode - 1 rule)
    rc = numa.get_mempolicy(ctypes.byref(mode), mask, 1025, addr, MPOL_F_ADDR if addr is not None else 0)
    assert rc == 0, f"get_mempolicy failed: errno {ctypes.get_errno()}"
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    return mode.value, {n for n in range(1024) if mask[n // bits] >> (n % bits) & 1}


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def mapping_of(addr: int) -> str:
    """The pathname column of /proc/self/maps for the mapping holding addr ('' for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    raise AssertionError(f"{addr:#x} is not mapped")


@pytest.fixture
def no_libnuma():
    """Makes every NUMA call load a library that does not exist; puts the default back afterwards."""
    _native.numa_set_library(ABSENT)
    try:
        yield
    finally:
        _native.numa_set_library(None)


@pytest.fixture(scope="module")
def f32_moe(tmp_path_factory) -> Path:
    return tiny_gguf("moe", tmp_path_factory.mktemp("memory") / "moe.f32.gguf")


@pytest.fixture(scope="module")
def q4_moe(tmp_path_factory) -> Path:
    return Path(make_model("tiny-moe", str(tmp_path_factory.mktemp("memory") / "moe.q4_k_m.gguf"),
                           quant="q4_k_m", seed=5, progress=False))


def samples(model: Model) -> int:
    """How many pages load_data's placement query samples: one per 2 MiB of the 4 KiB pages holding the data."""
    g = model.file.gguf
    t = next(iter(g.tensors.values()))
    lo = address(g.data(t.name)) - (t.offset - g.data_start)  # where the data section starts in memory
    hi = lo + g.file_size - g.data_start
    lo, hi = lo & ~4095, -(-hi // 4096) * 4096
    return -(-(hi - lo) // (2 * MIB))


def logits(model: Model, ids=tuple(range(3, 40))) -> np.ndarray:
    """Prefill (all positions) then three decode steps: float32[n + 3, n_vocab]."""
    st = model.new_state(128)
    out = [model.forward(st, np.asarray(ids), all_logits=True)]
    for t in (7, 11, 13):
        out.append(model.forward(st, [t]))
    return np.concatenate(out)


# ------------------------------------------------------------------------------------------------ anonymous memory

def test_alloc_is_2mib_aligned_rounded_and_zeroed():
    m = _native.mem_alloc(3 * MIB + 1)
    assert m.size == 4 * MIB
    assert address(m.array) % (2 * MIB) == 0
    assert m.array.size == 3 * MIB + 1 and m.array.flags.writeable
    assert not m.array.any()
    m.array[::4096] = 7                            # every page writable
    assert int(m.array.sum()) == 7 * len(range(0, m.array.size, 4096))
    assert mapping_of(address(m.array)) == ""      # anonymous, not a file


def test_alloc_asks_for_huge_pages_and_gets_them():
    thp = thp_report()["enabled"]
    m = _native.mem_alloc(8 * MIB)
    if thp is None:
        assert not m.hugepage and m.hugepage_errno != 0, "a kernel without THP refuses MADV_HUGEPAGE"
        return
    assert m.hugepage and m.hugepage_errno == 0, "a THP kernel accepts MADV_HUGEPAGE on anonymous memory"
    m.array[:] = 1                                 # fault every page in
    huge = thp_backed_bytes(m.array)
    if thp in ("always", "madvise") and thp_report()["defrag"] in ("always", "madvise", "defer+madvise"):
        assert huge > 0, "THP allows madvised ranges and may compact for them, yet no huge page backs the buffer"
    assert huge <= m.size


def test_memory_lives_while_a_view_does():
    m = _native.mem_alloc(MIB)
    view = m.array[10:20]
    view[:] = 5
    del m
    import gc
    gc.collect()
    assert view.tolist() == [5] * 10               # a freed mapping would segfault or read zeros


def test_alloc_of_zero_bytes_is_an_error():
    with pytest.raises(NativeError, match="zero size"):
        _native.mem_alloc(0)


def test_advise_on_a_file_map_reports_what_the_kernel_said(f32_moe):
    mm = np.memmap(f32_moe, dtype=np.uint8, mode="r")
    got = _native.mem_advise(mm, hugepage=True, willneed=True)
    assert got["willneed"] == 1 and got["willneed_errno"] == 0
    assert got["hugepage"] == (thp_report()["enabled"] is not None)
    _native.mem_prefault(mm)                       # reads the file in; must not fault past its end
    assert thp_backed_bytes(mm) >= 0


# ------------------------------------------------------------------------------------------------ NUMA policies

@needs_numa
def test_interleave_reads_back_as_mpol_interleave_over_every_node():
    m = _native.mem_alloc(4 * MIB)
    assert kernel_policy(address(m.array))[0] == MPOL_DEFAULT
    _native.mem_set_numa(m.array, "interleave")
    mode, nodes = kernel_policy(address(m.array))
    assert mode == MPOL_INTERLEAVE
    assert nodes == set(_native.numa_nodes()) and 0 in nodes
    assert _native.mem_policy(m.array) == {"mode": MPOL_INTERLEAVE, "name": "interleave", "flags": 0,
                                           "nodes": sorted(nodes)}
    # the last page of the buffer is covered too (mbind over the whole range)
    assert kernel_policy(address(m.array) + m.size - 1)[0] == MPOL_INTERLEAVE


@needs_numa
def test_node0_reads_back_as_bind_and_places_every_page_there():
    m = _native.mem_alloc(4 * MIB)
    _native.mem_set_numa(m.array, "node", 0)
    assert kernel_policy(address(m.array)) == (MPOL_BIND, {0})
    before = _native.mem_page_nodes(m.array)
    assert before == {"nodes": {}, "absent": 4 * MIB // 4096}, "the query must not touch pages"
    m.array[:] = 3
    assert _native.mem_page_nodes(m.array) == {"nodes": {0: 4 * MIB // 4096}, "absent": 0}


@needs_numa
def test_off_puts_the_default_back():
    m = _native.mem_alloc(2 * MIB)
    _native.mem_set_numa(m.array, "interleave")
    _native.mem_set_numa(m.array, "off")
    assert kernel_policy(address(m.array)) == (MPOL_DEFAULT, set())


@needs_numa
@pytest.mark.parametrize("node", [99, 1023, 4096, -1])
def test_a_node_the_machine_lacks_is_a_clear_error_and_changes_nothing(node):
    m = _native.mem_alloc(2 * MIB)
    with pytest.raises(UnavailableError, match=rf"NUMA node {node} is not a memory node .*nodes: 0"):
        _native.mem_set_numa(m.array, "node", node)
    assert kernel_policy(address(m.array))[0] == MPOL_DEFAULT


@needs_numa
def test_thread_policy_is_set_inside_the_block_and_restored_after():
    assert kernel_policy(None)[0] == MPOL_DEFAULT
    with _native.numa_thread_policy_set("interleave"):
        assert kernel_policy(None) == (MPOL_INTERLEAVE, set(_native.numa_nodes()))
        with _native.numa_thread_policy_set("node", 0):
            assert kernel_policy(None) == (MPOL_BIND, {0})
        assert kernel_policy(None)[0] == MPOL_INTERLEAVE
    assert kernel_policy(None) == (MPOL_DEFAULT, set())


@needs_numa
def test_cpus_of_nodes_cover_the_allowed_cpus_and_spread_deals_them_round_robin():
    nodes = _native.numa_nodes()
    per_node = {n: _native.numa_cpus_of_node(n) for n in nodes}
    allowed = os.sched_getaffinity(0)
    assert allowed <= set().union(*map(set, per_node.values()))
    spread = _native.numa_spread_cpus()
    assert sorted(spread) == sorted(allowed)
    node_of = {c: n for n, cs in per_node.items() for c in cs}
    # round r holds the r-th allowed CPU of each node that has one, in node order
    expect = []
    lists = [[c for c in per_node[n] if c in allowed] for n in nodes]
    for r in range(max(map(len, lists))):
        expect += [cs[r] for cs in lists if r < len(cs)]
    assert spread == expect
    assert len({node_of[c] for c in spread[:len(nodes)]}) == sum(1 for cs in lists if cs)
    with pytest.raises(UnavailableError, match="does not exist"):
        _native.numa_cpus_of_node(4096)


# ------------------------------------------------------------------------------------------------ libnuma absent

def test_without_libnuma_numa_calls_fail_clearly_and_the_rest_works(no_libnuma, f32_moe):
    info = _native.numa_info()
    assert info["available"] == 0 and info["nodes"] == 1
    assert "libnuma not found" in info["reason"] and ABSENT in info["reason"]
    m = _native.mem_alloc(2 * MIB)                 # anonymous memory needs no libnuma
    for call in (lambda: _native.mem_set_numa(m.array, "interleave"), lambda: _native.mem_policy(m.array),
                 _native.numa_nodes, _native.numa_spread_cpus, lambda: _native.numa_cpus_of_node(0)):
        with pytest.raises(UnavailableError, match=r"libnuma not found .*install libnuma1"):
            call()
    with pytest.raises(UnavailableError, match="libnuma not found"):
        Model(f32_moe, N_THREADS, mmap=False, numa="interleave")
    with pytest.raises(UnavailableError, match="libnuma not found"):
        Model(f32_moe, N_THREADS, numa="node:0")
    Model(f32_moe, N_THREADS, mmap=False)          # numa off: no libnuma needed


@needs_numa
def test_libnuma_comes_back_after_the_hook_is_cleared():
    _native.numa_set_library(ABSENT)
    try:
        assert not _native.numa_info()["available"]
    finally:
        _native.numa_set_library(None)
    assert _native.numa_info()["available"] and _native.numa_nodes()


# ------------------------------------------------------------------------------------------------ models

@pytest.mark.parametrize("numa", ["off", "interleave", "node:0"])
@pytest.mark.parametrize("which", ["f32_moe", "q4_moe"])
def test_no_mmap_gives_bit_identical_logits(which, numa, request):
    if numa != "off" and not HAVE_NUMA:
        pytest.skip("libnuma is not installed here")
    path = request.getfixturevalue(which)
    mapped = Model(path, N_THREADS)
    copied = Model(path, N_THREADS, mmap=False, numa=numa)
    name = "output_norm.weight"
    assert mapping_of(address(mapped.file.gguf.data(name))) == str(path)
    assert mapping_of(address(copied.file.gguf.data(name))) == "", "--no-mmap weights must be anonymous memory"
    assert not copied.file.gguf.data(name).flags.writeable
    rep = copied.load_report
    assert rep["mmap"] is False and rep["bytes"] == os.path.getsize(path) - copied.file.gguf.data_start
    if numa != "off":
        mode, node = parse_numa(numa)
        want = (MPOL_INTERLEAVE, set(_native.numa_nodes())) if mode == "interleave" else (MPOL_BIND, {node})
        assert kernel_policy(address(copied.file.gguf.data(name))) == want
        assert rep["page_nodes"] == {0: samples(copied)} and rep["absent_pages"] == 0
    a, b = logits(mapped), logits(copied)
    assert a.dtype == b.dtype == np.float32 and np.isfinite(a).all()
    assert np.array_equal(a, b), f"max |diff| {np.abs(a - b).max()}"


def test_no_mmap_really_copies(f32_moe, tmp_path):
    """Negative control: rewrite a weight in the file after loading; the mapped model sees it, the copy not."""
    path = tmp_path / "moe.gguf"
    shutil.copy(f32_moe, path)
    mapped, copied = Model(path, N_THREADS), Model(path, N_THREADS, mmap=False)
    before = logits(copied)
    t = GGUFFile(path).tensors["output_norm.weight"]
    with open(path, "r+b") as f:
        f.seek(t.offset)
        f.write(np.full(t.n_bytes // 4, 3.0, np.float32).tobytes())
    assert not np.array_equal(logits(mapped), before), "the file map should see the rewritten weight"
    assert np.array_equal(logits(copied), before)


@needs_numa
def test_mmap_with_numa_prefaults_under_the_policy_and_restores_the_thread(q4_moe):
    m = Model(q4_moe, N_THREADS, numa="interleave")
    rep = m.load_report
    assert rep["mmap"] is True and rep["willneed"] is True
    assert rep["page_nodes"] == {0: samples(m)}
    assert rep["absent_pages"] == 0, "numa with the file map faults the whole file in"
    assert kernel_policy(None) == (MPOL_DEFAULT, set()), "the loading thread's policy must be put back"
    assert kernel_policy(address(m.file.gguf.data("output_norm.weight")))[0] == MPOL_DEFAULT  # no mbind on the map


@pytest.mark.parametrize("value,expect", [("off", ("off", -1)), (None, ("off", -1)), ("interleave", ("interleave", -1)),
                                          ("node:0", ("node", 0)), ("NODE:12", ("node", 12))])
def test_parse_numa(value, expect):
    assert parse_numa(value) == expect


@pytest.mark.parametrize("bad", ["", "on", "node", "node:", "node:-1", "node:x", "interleave:0", "0"])
def test_bad_numa_values_are_value_errors(bad, f32_moe):
    with pytest.raises(ValueError, match="expected 'interleave', 'node:N'"):
        Model(f32_moe, N_THREADS, numa=bad)


@needs_numa
def test_model_on_a_missing_node_is_a_clear_error(f32_moe):
    with pytest.raises(UnavailableError, match=r"node:99: NUMA node 99 is not a memory node .*nodes: 0"):
        Model(f32_moe, N_THREADS, mmap=False, numa="node:99")
    with pytest.raises(UnavailableError, match="NUMA node 99"):
        Model(f32_moe, N_THREADS, numa="node:99")


# ------------------------------------------------------------------------------------------------ CLI

def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "legacy_engine", *map(str, args)], cwd=REPO, capture_output=True,
                          encoding="utf-8", errors="replace", timeout=120, env={**os.environ, **(env or {})})


def test_cli_no_mmap_generates_the_same_text(f32_moe):
    base = ["run", f32_moe, "-p", "Hello there", "-n", 6, "-t", N_THREADS]
    a = _cli(*base)
    b = _cli(*base, "--no-mmap", *(["--numa", "interleave"] if HAVE_NUMA else []))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


@pytest.mark.parametrize("args,env,rc,message", [
    (["--numa", "bogus"], None, 2, "argument --numa: numa='bogus': expected"),
    (["--numa", "interleave"], {"LE_NUMA_LIB": ABSENT}, 1, f"libnuma not found (tried {ABSENT}"),
    pytest.param(["--no-mmap", "--numa", "node:99"], None, 1, "NUMA node 99 is not a memory node",
                 marks=needs_numa),
])
def test_cli_numa_errors(f32_moe, args, env, rc, message):
    r = _cli("run", f32_moe, "-p", "Hi", "-n", 1, "-t", N_THREADS, *args, env=env)
    assert r.returncode == rc and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_cli_flags_on_every_loading_command():
    for cmd in ("run", "demo", "serve"):
        r = _cli(cmd, "-h")
        assert "--no-mmap" in r.stdout and "--numa" in r.stdout, cmd


def test_info_reports_numa_and_thp():
    r = _cli("info")
    assert r.returncode == 0, r.stderr
    thp = thp_report()["enabled"]
    assert (f"THP      {thp}:" if thp else "THP      off") in r.stdout
    if HAVE_NUMA and _native.numa_info()["nodes"] == 1:
        assert "one node: --numa interleave|node:0 is a no-op here" in r.stdout
    r = _cli("info", env={"LE_NUMA_LIB": ABSENT})
    assert "NUMA     off: libnuma not found" in r.stdout and "treated as 1 node" in r.stdout


def test_info_names_each_gpus_prefill_gemm():
    """The GPU lines of `info` (a described report: this machine has no GPU): the int8 tensor cores from sm_75 (T4),
    none on sm_70 (a CMP 100-210 runs DP4A), the matmul kernels per tier and the flags that change them, the GDN
    and attention prefill's forms per tier (the tensor-core attention from sm_75), the resident pass lengths."""
    from legacy_engine.plan import caps
    rep = caps.machine_report()
    rep["gpu"] = {"available": True, "driver_version": 12080, "device_count": 2, "cuda_graphs": True,
                  "devices": [{"name": "Tesla T4", "cc_major": 7, "cc_minor": 5, "total_mem": 16 << 30,
                               "multiprocessors": 40},
                              {"name": "CMP 100-210", "cc_major": 7, "cc_minor": 0, "total_mem": 16 << 30,
                               "multiprocessors": 80}]}
    lines = caps.format_machine_report(rep)
    t4 = next(ln for ln in lines if "Tesla T4" in ln)
    cmp_ = next(ln for ln in lines if "CMP 100-210" in ln)
    assert "tier dp4a" in t4 and t4.endswith("int8 / f16 tensor cores")
    assert "tier dp4a" in cmp_ and "tensor cores" not in cmp_
    mm = next(ln for ln in lines if "matmuls:" in ln)
    assert "gemm_mma" in mm and "--gpu-no-mma" in mm and "gemm_dp4a" in mm and "--gpu-f32" in mm
    assert "_multi GEMMs; not on fermi" in mm and "swiglu_q8_1" in mm
    gdn = next(ln for ln in lines if "GDN prefill:" in ln)    # the form each tier runs (gpu/kernels.py's table)
    assert "the chunked form (gdn_chunked) on the dp4a and kepler tiers" in gdn and "gdn_recurrent" in gdn
    assert "gdn_chunk_prep_ahead_f32; not on fermi" in gdn
    assert "(gdn_chunk_scan_tf32) on the dp4a tier from sm_80 (--gpu-no-mma" in gdn
    att = next(ln for ln in lines if "attention prefill:" in ln)     # ATTN_TILED_TIERS, RESIDENT_CHUNKS
    assert "attn_prefill_tiled_f32) on the dp4a and kepler tiers" in att and "2048/1024/512 tokens" in att
    assert "attn_prefill_mma_f32) on the dp4a tier from sm_75 (--gpu-no-mma" in att
