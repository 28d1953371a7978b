"""What this machine has, and what the engine chooses on it, as data.

`machine_report()` gathers CPU features (CPUID masked by XGETBV), NUMA nodes (libnuma,
dlopened) and GPUs (libcuda, dlopened) from the C core; `cpu_tiers()` names the integer
SIMD tiers the CPU could run and why a tier is off. `legacy-engine info` prints these.
"""
from __future__ import annotations

import os

from . import _native
from .errors import UnavailableError

# The CPU tiers of the capability table, best first, with the features each needs.
CPU_TIERS = (
    ("avx512vnni", ("avx512f", "avx512bw", "avx512vl", "avx512vnni")),
    ("avx2", ("avx2", "fma")),
    ("ssse3", ("ssse3",)),
    ("ref", ()),
)

CPU_FEATURES = ("sse3", "ssse3", "sse41", "sse42", "avx", "f16c", "fma", "avx2", "avx512f", "avx512bw",
                "avx512vl", "avx512dq", "avx512vnni", "avx512bf16", "avxvnni", "amx_tile", "amx_int8",
                "amx_bf16")


def cpu_tiers(cpu: dict) -> list[tuple[str, bool, str]]:
    """[(tier, usable, reason)] for every CPU tier, best first."""
    out = []
    for tier, needs in CPU_TIERS:
        missing = [f for f in needs if not cpu.get(f)]
        if not cpu.get("is_x86") and needs:
            out.append((tier, False, "not an x86-64 CPU"))
        elif missing:
            out.append((tier, False, "CPU/OS lacks " + ", ".join(missing)))
        else:
            out.append((tier, True, ""))
    return out


def kernel_report() -> dict:
    """The selected CPU tier and which tier serves each quant type's integer dot product."""
    names = {}
    for qtype in range(64):
        try:
            names[_native.type_traits(qtype)["name"]] = qtype
        except UnavailableError:  # ids the engine does not handle
            continue
    return {"isa": _native.get_isa(),
            "vec_dot": {n: _native.kernel_isa(q) for n, q in names.items() if n not in ("f32", "f16", "bf16",
                                                                                       "q8_1", "q8_K")}}


def machine_report() -> dict:
    cpu = _native.cpu_info()
    return {
        "cpu": cpu,
        "cpu_tiers": cpu_tiers(cpu),
        "kernels": kernel_report(),
        "numa": _native.numa_info(),
        "gpu": _native.gpu_info(),
    }


def format_machine_report(rep: dict) -> list[str]:
    cpu, numa, gpu = rep["cpu"], rep["numa"], rep["gpu"]
    lines = [f"CPU      {cpu['brand'] or cpu['vendor']} ({cpu['logical_cpus']} logical CPUs)"]
    have = [f for f in CPU_FEATURES if cpu.get(f)]
    lacks = [f for f in CPU_FEATURES if not cpu.get(f)]
    lines.append("  features: " + (" ".join(have) or "none"))
    if lacks:
        lines.append("  absent:   " + " ".join(lacks))
    os_state = [n for n, k in (("AVX", "os_avx"), ("AVX-512", "os_avx512"), ("AMX", "os_amx")) if cpu.get(k)]
    lines.append("  OS saves register state for: " + (", ".join(os_state) or "SSE only") + " (XGETBV)")
    for tier, ok, why in rep["cpu_tiers"]:
        lines.append(f"  tier {tier:<11} {'usable' if ok else 'off: ' + why}")
    k = rep["kernels"]
    forced = os.environ.get("LE_FORCE_ISA")
    lines.append(f"  chosen tier: {k['isa']}" + (f" (LE_FORCE_ISA={forced})" if forced else " (best the CPU runs)"))
    by_tier: dict[str, list[str]] = {}
    for name, tier in k["vec_dot"].items():
        by_tier.setdefault(tier or "none (dequantise + f32)", []).append(name)
    lines.append("  integer dot products (W4A8 ...): " + "; ".join(f"{t}: {' '.join(n)}" for t, n in by_tier.items()))
    if numa["available"]:
        lines.append(f"NUMA     {numa['nodes']} node(s) (libnuma)"
                     + ("; interleave is a no-op with one node" if numa["nodes"] == 1 else ""))
    else:
        lines.append(f"NUMA     off: {numa['reason']}; treated as 1 node")
    if gpu["available"]:
        v = gpu["driver_version"]
        lines.append(f"GPU      CUDA driver {v // 1000}.{v % 1000 // 10}, {gpu['device_count']} device(s)")
        for i, d in enumerate(gpu["devices"]):
            lines.append(f"  [{i}] {d['name']}  sm_{d['cc_major']}{d['cc_minor']}  "
                         f"{d['total_mem'] / 2**30:.1f} GiB  {d['multiprocessors']} SMs")
    else:
        lines.append(f"GPU      none: {gpu['reason']}")
    return lines
