"""The machine as the planner sees it: probes of this machine, measured once and cached per machine in
$LE_CACHE_DIR/machine.json (`measure`): host read bandwidth at the decode thread count (`machine_bandwidth`:
numpy reductions, no C code of ours involved), the CPU's f32 GEMM rate at that count (`cpu_f32_gflops`: the vision
tower's matmul kernel), and the GPU's host→device bandwidth from page-locked memory, GEMM
and GEMV throughput of its tier and launch cost (`_gpu_probes`). `Machine` holds them, measured or described
(tests, --simulate-link); `format_machines` is `info`'s view of the cache.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import gpu
from ..core import _native
from ..core.paths import cache_dir
from ..cpu import cpu_load
from ..cpu.threads import default_threads
from ..gpu import available as gpu_available
from ..gpu.options import default_tier

MiB = 2**20


# ================================================================================================ host read bandwidth

# name -> reduction over a uint64 / float32 view of the same bytes (SIMD inner loops that release the GIL)
READ_KERNELS = {
    "u64-add": lambda b: np.add.reduce(b.view(np.uint64)),
    "f32-max": lambda b: b.view(np.float32).max(),
}


def read_bandwidth(n_threads: int, size_mib: int = 1024, reps: int = 5, kernel: str = "u64-add",
                   buf: np.ndarray | None = None) -> float:
    """Best GB/s (1e9 bytes/s) of reading `size_mib` MiB with `n_threads` Python threads, each reducing its own
    contiguous slice once per pass (benchmarks/bandwidth.py is its command line)."""
    if buf is None:
        buf = np.ones(size_mib << 17, dtype=np.float64)        # MiB / 8 bytes; ones: touched, not a zero page
    slices = np.array_split(buf.view(np.uint8), n_threads)
    cut = [len(s) // 64 * 64 for s in slices]                  # 64-byte multiples keep the 8-byte views valid
    slices = [s[:c] for s, c in zip(slices, cut)]
    nbytes = sum(cut)
    f = READ_KERNELS[kernel]
    with ThreadPoolExecutor(n_threads) as ex:
        list(ex.map(f, slices))                                   # warm-up: page-in, thread start
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(f, slices))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def machine_bandwidth(n_threads: int, size_mib: int = 1024, reps: int = 5) -> float:
    """The best of every read kernel at n_threads threads, GB/s: the roofline's denominator."""
    buf = np.ones(size_mib << 17, dtype=np.float64)
    return max(read_bandwidth(n_threads, reps=reps, kernel=k, buf=buf) for k in READ_KERNELS)


# ================================================================================================ CPU f32 GEMM rate

# The probe's product per thread and call: a token block of the vision tower's matmuls (native/vision.c MM_TOK 64
# tokens x 768) against 256 weight rows, in L2 like the tower's tiles (~25 MFLOP, ~0.3 ms on one AVX-512 core).
F32_PROBE_SHAPE = (64, 256, 768)      # m (tokens), n (weight rows), k
F32_PROBE_CALLS = 8                   # calls per thread and pass


def cpu_f32_gflops(n_threads: int, reps: int = 3) -> float:
    """Best GFLOP/s (1e9 flop/s) of the C core's f32 GEMM tile kernel (le_gemm_f32_k: the selected tier's
    gemm_tile, the vision tower's matmuls) on n_threads Python threads at once (cffi releases the GIL), each on
    its own operands."""
    m, n, k = F32_PROBE_SHAPE
    rng = np.random.default_rng(0)
    ops = [(rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32))
           for _ in range(n_threads)]

    def work(ab):
        for _ in range(F32_PROBE_CALLS):
            _native.gemm_f32(*ab)
    with ThreadPoolExecutor(n_threads) as ex:
        list(ex.map(work, ops))                                   # warm-up: thread start, caches
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(work, ops))
            best = min(best, time.perf_counter() - t0)
    return 2 * m * n * k * F32_PROBE_CALLS * n_threads / best / 1e9


# ================================================================================================ the probe

MACHINE_FILE = "machine.json"
PROBE_VERSION = 4   # part of the cache key: 3 = the GEMM probe times the prefill's own GEMM (gemm_mma / gemm_dp4a);
#                     4 = the CPU's f32 GEMM rate (cpu_f32_gflops) is probed too
# A probe taken while other work ran on the CPUs reads low (issue 21: 6.6 GB/s host reads on a 2-core box with other
# work on the cores, 35 GB/s idle, and `plan` predicted 5x too low until --remeasure). measure() records the other
# work (cpu_load: CPUs' worth before and during the probe, and the load average) and flags the probe `under_load`
# from cpu_load.BUSY_CPU; a flagged probe (or one without a record, older than this rule) is retaken by the next
# measure() that finds the machine idle, and used, flagged, while it is not. `plan` prints the probe's age and load.
PROBE_STALE_DAYS = 30   # `plan` calls an older probe stale: the machine (or what runs on it) may have changed


@dataclasses.dataclass
class Machine:
    """What the planner knows of a machine: measured (`measure`) or described (tests, --simulate-link)."""
    cpu_threads: int
    cpu_read_gbps: float                 # host read bandwidth at cpu_threads (GB/s)
    cpu_f32_gflops: float = 0.0          # f32 GEMM tile kernel at cpu_threads (GFLOP/s; 0: not probed)
    gpu_name: str = ""                   # "" = no usable GPU
    gpu_tier: str = ""
    vram_free: int = 0                   # bytes free on the device when measured
    link_gbps: float = 0.0               # host -> device from page-locked memory
    gpu_gemm_tflops: float = 0.0         # prefill GEMM on Q4_K, 512 tokens (gemm_mma / gemm_dp4a on dp4a, else gemm_f32)
    gpu_gemv_gbps: float = 0.0           # decode GEMV weight streaming (the tier's decode kernel, Q4_K)
    gpu_launch_us: float = 0.0           # per kernel inside a decode step (graph replay)
    simulated_link: bool = False
    measured_at: float = 0.0             # Unix time of the probe (0: described, or cached before the load record)
    load_cpus: float = -1.0              # CPUs' worth of other work before or during the probe (-1: unknown)
    load_avg: float = -1.0               # the 1-minute load average at the probe (-1: unknown)
    under_load: bool = False             # load_cpus >= cpu_load.BUSY_CPU: the CPU rates read low

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_name)

    def probe_note(self, now: float | None = None) -> str:
        """When the probe was taken and whether other work ran during it (`plan`, `info`)."""
        if not self.measured_at:
            return "probe: no record of when or under what load (retaken on an idle machine; --remeasure)"
        age = (time.time() if now is None else now) - self.measured_at
        days = age / 86400
        when = "probe taken " + (f"{days:.0f} days" if days >= 2 else f"{age / 3600:.1f} h" if age >= 3600 else
                                 f"{age / 60:.0f} min") + " ago"
        if self.under_load:
            return (f"{when} UNDER LOAD (other work on {self.load_cpus:.1f} CPUs, load average {self.load_avg:.2f}): "
                    "its CPU rates read low; retaken once the machine is idle, or --remeasure")
        note = f"{when} on an idle machine (other work on {self.load_cpus:.1f} CPUs)"
        if days > PROBE_STALE_DAYS:
            note += f"; STALE (over {PROBE_STALE_DAYS} days): --remeasure if the machine changed"
        return note


_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def machine_from_json(d) -> Machine | None:
    """A cached probe (an entry of machine.json) as a Machine; None when it is malformed: not an object, a field
    without a default missing, a field of the wrong type, a rate not a finite number, no thread or no bandwidth.
    Unknown keys are ignored."""
    if not isinstance(d, dict):
        return None
    kw = {}
    for f in dataclasses.fields(Machine):
        if f.name not in d:
            if f.default is dataclasses.MISSING:
                return None
            continue
        v = d[f.name]
        if not isinstance(v, _JSON_TYPES[f.type]) or (isinstance(v, bool) and f.type != "bool"):
            return None
        if f.type == "float":
            if not math.isfinite(v):
                return None
            v = float(v)
        kw[f.name] = v
    m = Machine(**kw)
    return m if m.cpu_threads >= 1 and m.cpu_read_gbps > 0 else None


def _read_probes(path: str) -> dict:
    """machine.json's object ({} when absent, unreadable, not JSON or not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _gpu_probes(tier: str | None = None) -> dict:
    """H2D bandwidth, GEMM and GEMV throughput of this GPU's tier, launch cost (a few seconds)."""
    dev = gpu.init()
    arch = gpu.device_arch()
    tier = tier or default_tier(arch)
    k = gpu.Kernels(tier, arch)
    st = gpu.mem_stats()
    out = {"gpu_name": dev["name"], "gpu_tier": tier, "vram_free": int(st["free_bytes"])}
    # host -> device from page-locked memory, 256 MiB
    n = 256 * MiB
    hp, hbuf = _native.gpu_host_alloc(n)
    try:
        with gpu.Buffer(n, "link probe") as d:
            s = gpu.Stream()
            best = float("inf")
            for _ in range(4):
                t0 = time.perf_counter()
                _native.gpu_copy_htod_addr(d.ptr, int(_native.ffi.cast("uintptr_t", hp)), n, s.handle)
                s.synchronize()
                best = min(best, time.perf_counter() - t0)
            out["link_gbps"] = n / best / 1e9
    finally:
        _native.gpu_host_free(hp)
    # GEMM on a 4096 x 4096 Q4_K matrix x 512 tokens; GEMV on 16384 x 8192 (75 MB: past the L2 of any card);
    # zero blocks (timing only), timed with events
    q4k, cols, ntok = 12, 4096, 512
    _, bs, ts = gpu.GPU_TYPES[q4k]
    rows_mm, rows_mv, cols_mv = 4096, 16384, 8192
    wbytes = rows_mv * cols_mv // bs * ts
    with gpu.Buffer(wbytes, "probe W") as W, gpu.Buffer(4 * ntok * cols_mv, "probe X") as X, \
            gpu.Buffer(4 * ntok * rows_mv, "probe Y") as Y, \
            gpu.Buffer(cols_mv // 32 * gpu.Q8_1_BYTES, "probe xq") as xq:
        _native.gpu_memset8(W.ptr, 0, wbytes)
        _native.gpu_memset8(X.ptr, 0, 4 * ntok * cols_mv)

        def timed(fn, reps):
            return gpu.time_ms(fn, reps) / 1e3
        if tier == "dp4a":       # the prefill's GEMM there: int8 on Q8_1 activations (GpuOptions.int8_prefill)
            with gpu.Buffer(ntok * cols // 32 * gpu.Q8_1_BYTES, "probe Xq") as xqm:
                k.quantize_q8_1(X, xqm, ntok * cols)
                gemm = k.gemm_mma if k.has_mma else k.gemm_dp4a
                t = timed(lambda: gemm(q4k, W, xqm, Y, rows_mm, cols, ntok), 5)
        else:
            t = timed(lambda: k.gemm_f32(q4k, W, X, Y, rows_mm, cols, ntok), 5)
        out["gpu_gemm_tflops"] = 2 * rows_mm * cols * ntok / t / 1e12
        if tier == "dp4a":
            k.quantize_q8_1(X, xq, cols_mv)
            t = timed(lambda: k.gemv_dp4a(q4k, W, xq, Y, rows_mv, cols_mv), 20)
        else:
            t = timed(lambda: k.gemv_f32(q4k, W, X, Y, rows_mv, cols_mv), 20)
        out["gpu_gemv_gbps"] = wbytes / t / 1e9
        # launch cost: a tiny kernel recorded 200 times, replayed as a plan (a graph where the driver has them)
        with gpu.record() as launches:
            for _ in range(200):
                k.add(Y, Y, Y, 32)
        plan = gpu.LaunchPlan(launches, graph=gpu.graphs_available() and tier != "fermi")
        plan.replay()
        gpu.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            plan.replay()
        gpu.synchronize()
        out["gpu_launch_us"] = (time.perf_counter() - t0) / 10 / 200 * 1e6
    return out


def measure(n_threads: int | None = None, gpu: bool = True, cache: bool = True, refresh: bool = False,
            log=None) -> Machine:
    """Probes this machine (CPU read bandwidth at the decode thread count; the GPU's link, GEMM, GEMV and launch
    cost) or returns the cached probe of the same thread count. Takes ~10 s the first time. A cached probe taken
    under load (or without a load record) is retaken when the machine is idle now, else returned as it is,
    flagged (under_load); a malformed cache is treated as absent."""
    say = log or (lambda s: None)
    n_threads = n_threads or default_threads()
    path = os.path.join(cache_dir(), MACHINE_FILE)
    key = f"v{PROBE_VERSION},threads={n_threads},gpu={int(gpu)}"
    saved = _read_probes(path) if cache else {}
    old = machine_from_json(saved.get(key))
    if old is not None and not refresh:
        if old.measured_at and not old.under_load:
            return old
        now = cpu_load.sample()
        if now is not None and now.shared:   # a probe now would read low again
            say(f"the cached machine probe was taken under load (or has no record); other work still runs "
                f"({now.describe()}): using it")
            return old
        say("retaking the machine probe: the cached one was taken under load (or has no record of it)")
    say(f"measuring this machine ({n_threads} threads{', GPU' if gpu else ''}) …")
    before = cpu_load.sample()
    bw, during = cpu_load.during(lambda: machine_bandwidth(n_threads, size_mib=512, reps=3))
    f32 = cpu_f32_gflops(n_threads)
    loads = [x for x in (before, during) if x is not None]
    other = max((x.other for x in loads), default=-1.0)
    m = {"cpu_threads": n_threads, "cpu_read_gbps": bw, "cpu_f32_gflops": f32, "measured_at": time.time(),
         "load_cpus": round(other, 2),
         "load_avg": round(loads[-1].load_avg, 2) if loads else -1.0,
         "under_load": other >= cpu_load.BUSY_CPU}
    if m["under_load"]:
        say(f"other work ran during the probe ({other:.1f} CPUs): flagged, retaken once the machine is idle")
    if gpu:
        ok, _why = gpu_available()
        if ok:
            m.update(_gpu_probes())
    if cache:
        saved[key] = m
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=1)
        os.replace(path + ".tmp", path)
    return Machine(**m)


def cached_machines() -> dict:
    """The well-formed machine probes saved by measure() ({"vV,threads=T,gpu=G": Machine fields}), {} when none;
    malformed entries (or a malformed file) are left out."""
    saved = _read_probes(os.path.join(cache_dir(), MACHINE_FILE))
    out = {}
    for key, d in saved.items():
        m = machine_from_json(d)
        if m is not None:
            out[key] = dataclasses.asdict(m)
    return out


def format_machines(saved: dict) -> list[str]:
    """`info`'s planner lines: what the planner will use without measuring again (malformed entries skipped)."""
    ms = {k: m for k, m in ((k, machine_from_json(d)) for k, d in saved.items()) if m is not None}
    if not ms:
        return ["Planner  no machine probe cached yet (`legacy-engine plan` measures once, ~10 s)"]
    out = ["Planner  cached machine probes (`legacy-engine plan --remeasure` refreshes):"]
    for key, m in sorted(ms.items()):
        line = f"  {key}: CPU {m.cpu_read_gbps:.1f} GB/s read" + (
            f", f32 GEMM {m.cpu_f32_gflops:.0f} GFLOP/s" if m.cpu_f32_gflops else "")
        if m.gpu_name:
            line += (f"; GPU {m.gpu_name} ({m.gpu_tier}): link {m.link_gbps:.1f} GB/s, GEMM "
                     f"{m.gpu_gemm_tflops:.1f} TFLOP/s, GEMV {m.gpu_gemv_gbps:.0f} GB/s")
        out += [line, f"    {m.probe_note()}"]
    return out
