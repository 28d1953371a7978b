"""What this machine has, and what the engine chooses on it, as data.

`machine_report()` gathers CPU features (CPUID masked by XGETBV), NUMA nodes (libnuma,
dlopened) and GPUs (libcuda, dlopened) from the C core, and the transparent-huge-page
setting from sysfs; `cpu_tiers()` names the integer SIMD tiers the CPU could run and why a
tier is off. `legacy-engine info` prints these.
"""
from __future__ import annotations

import os

from ..core import _native
from ..core.errors import UnavailableError
from ..gpu import MMA_ARCH, TF32_ARCH
from ..gpu.kernels import ATTN_TILED_TIERS, GDN_CHUNKED_TIERS
from ..gpu.placement import RESIDENT_CHUNKS
from ..gpu.options import default_tier

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
    return {"isa": _native.get_isa(), "f32_kernels": _native.f32_isa(), "fp_flushes": _native.fp_flushes(),
            "vec_dot": {n: _native.kernel_isa(q) for n, q in names.items() if n not in ("f32", "f16", "bf16",
                                                                                       "q8_1", "q8_K")},
            # types whose weight blocks are unpacked once for several activation rows (prefill, batched decode)
            "vec_dot_n": sorted(n for n, q in names.items() if _native.kernel_isa(q) and _native.has_vec_dot_n(q))}


THP_DIR = "/sys/kernel/mm/transparent_hugepage"


def _sysfs_choice(path: str) -> str | None:
    """The [bracketed] choice of a sysfs setting like 'always [madvise] never'; None if unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text.strip() or None


def thp_report() -> dict:
    """{'enabled': 'always'|'madvise'|'never'|None, 'defrag': ...}; None: a kernel without THP."""
    return {"enabled": _sysfs_choice(f"{THP_DIR}/enabled"), "defrag": _sysfs_choice(f"{THP_DIR}/defrag")}


def numa_report() -> dict:
    """libnuma's view (available, nodes, reason) plus the memory nodes and each node's CPUs."""
    numa = _native.numa_info()
    numa["node_cpus"] = {}
    if numa["available"]:
        try:
            numa["node_cpus"] = {n: _native.numa_cpus_of_node(n) for n in _native.numa_nodes()}
        except UnavailableError as e:  # libnuma loads but the kernel refuses: say so, do not fail `info`
            numa["reason"] = str(e)
    return numa


def machine_report() -> dict:
    cpu = _native.cpu_info()
    return {
        "cpu": cpu,
        "cpu_tiers": cpu_tiers(cpu),
        "kernels": kernel_report(),
        "numa": numa_report(),
        "thp": thp_report(),
        "gpu": dict(_native.gpu_info(), cuda_graphs=_native.gpu_graphs_available()),
    }


def _cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out) or "none"


def gpu_lines(gpu: dict) -> list[str]:
    """format_machine_report's lines of a usable GPU: its devices and what each tier runs."""
    lines = []
    v = gpu["driver_version"]
    lines.append(f"GPU      CUDA driver {v // 1000}.{v % 1000 // 10}, {gpu['device_count']} device(s)")
    for i, d in enumerate(gpu["devices"]):
        lines.append(f"  [{i}] {d['name']}  sm_{d['cc_major']}{d['cc_minor']}  "
                     f"{d['total_mem'] / 2**30:.1f} GiB  {d['multiprocessors']} SMs  "
                     f"tier {default_tier(10 * d['cc_major'] + d['cc_minor'])} (`--gpu-tier` forces a lower one)"
                     + (", int8 / f16 tensor cores" if 10 * d["cc_major"] + d["cc_minor"] >= MMA_ARCH else ""))
    lines.append("  decode CUDA graphs: " + ("the driver has them (used except on the fermi tier; "
                                             "--no-cuda-graphs)" if gpu["cuda_graphs"] else
                                             "the driver lacks them (needs 11.4+): decode launches replayed "
                                             "one by one"))
    lines.append("  matmuls: dp4a tier int8 DP4A decode GEMVs (gemv_dp4a) and int8 prefill GEMMs on Q8_1 "
                 f"activations, on tensor cores from sm_{MMA_ARCH} (gemm_mma; --gpu-no-mma: gemm_dp4a), with DP4A "
                 "below (gemm_dp4a); --gpu-f32 for f32; fermi/kepler tiers f32 (gemv_f32, gemm_f32); MoE prefill "
                 "orders its routing on the GPU (moe_sort) when the host needs no ids; a layer's int8 projections of "
                 "one input in one launch (the _multi GEMMs; not on fermi), the FFN's SiLU product quantised in its "
                 "own launch (swiglu_q8_1)")
    chunked = " and ".join(sorted(GDN_CHUNKED_TIERS))
    lines.append(f"  GDN prefill: the chunked form (gdn_chunked) on the {chunked} tiers, token by token "
                 "(gdn_recurrent) elsewhere, where the chunked one measured slower; its prep loads a tile ahead "
                 "(gdn_chunk_prep_ahead_f32; not on fermi) where a short pass leaves at most a block an SM; its scan's "
                 f"products on tf32 tensor cores at f32 grade (gdn_chunk_scan_tf32) on the dp4a tier from "
                 f"sm_{TF32_ARCH} (--gpu-no-mma: the FMA scan)")
    lines.append("  GDN decode: a step's conv, its state update and the q/k norms in one launch "
                 "(conv1d_step_l2norm_f32, every tier), the recurrence with its gates in one more (gdn_recurrent_f32)")
    lines.append("  decode step: one token's kernels in a CUDA graph (fermi: launched one by one); a layer's GEMVs of "
                 "one input and type in one launch (up to 4: GDN's qkv, z, beta, alpha; the router and the shared "
                 "expert's gate), the residual add + norm + Q8_1 in one (add_rmsnorm_f32, the row in registers), the "
                 "experts' SiLU product into Q8_1 in one (swiglu_q8_1); `benchmarks/decode_kernel_costs.py` says what "
                 "each kernel costs")
    tiled = " and ".join(sorted(ATTN_TILED_TIERS))
    lines.append(f"  attention prefill: f16 tensor cores at f32 grade (hi + lo halves: attn_prefill_mma_f32) on the dp4a "
                 f"tier from sm_{MMA_ARCH} (--gpu-no-mma: the FMA kernels), register tiles (attn_prefill_tiled_f32) "
                 f"on the {tiled} tiers, one query a warp (attn_prefill_f32) elsewhere; a resident model's passes "
                 "the longest of "
                 + "/".join(map(str, RESIDENT_CHUNKS)) + " tokens whose scratch fits the VRAM")
    lines.append("  --vram SIZE budgets VRAM; a model over it runs split (`legacy-engine plan` shows the choice): "
                 "streamed prefill, hybrid decode through a page-locked channel the GPU and CPU both poll (needs "
                 "unified addressing: a 64-bit driver), the planner's link experts fetched over PCIe")
    lines.append("  sampling: in VRAM on every tier (sample_cut: the candidates of top-k/top-p/min-p chosen on the "
                 "GPU, only they cross the link; a flat top-p row's cut bin; penalties or temperature alone: the "
                 "row is downloaded)")
    lines.append("  images: the vision tower on the GPU (layernorm, gelu, rope_vision, attention_bidir, gemm_f32; "
                 "every tier) where the planner finds its VRAM (f32 weights + the largest image's scratch) beside "
                 "the model's placement, a split's pinned experts giving way, and predicts it faster than the CPU; "
                 "else on the CPU (`legacy-engine plan MODEL --mmproj FILE` shows the decision, `run` says it); "
                 "the LM's image rows and M-RoPE on the GPU")
    return lines


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
    several = k.get("vec_dot_n", [])
    lines.append("  several tokens per weight block (prefill, batched decode): "
                 + (" ".join(several) if several else "none at this tier")
                 + ("; the other types run one token at a time" if several else ""))
    lines.append("  f32 kernels (GDN step, f32 dot, gemm_nn: the chunked GDN prefill and the vision tower; silu: the "
                 "SwiGLU gates and the GDN's activations): "
                 f"{k['f32_kernels']}"
                 + (" (the scalar reference: this tier has none of its own)" if k["f32_kernels"] == "ref" else ""))
    lines.append("  denormal floats: " + ("flushed to zero in the C core's work (FTZ/DAZ; the chunked GDN's decays "
                                          "would otherwise cost ~100 cycles a multiply)" if k.get("fp_flushes")
                                          else "kept (IEEE gradual underflow; not an x86 build)"))
    if numa["available"]:
        cpus = "; ".join(f"node {n}: CPUs {_cpu_ranges(c)}" for n, c in numa.get("node_cpus", {}).items())
        lines.append(f"NUMA     {numa['nodes']} node(s) (libnuma)" + (f"; {cpus}" if cpus else ""))
        if numa["nodes"] == 1:
            lines.append("  one node: --numa interleave|node:0 is a no-op here (every page is on node 0 anyway)")
        else:
            lines.append("  --numa interleave spreads weight pages over the nodes; --numa node:N binds them to one")
    else:
        lines.append(f"NUMA     off: {numa['reason']}; treated as 1 node (--numa needs libnuma)")
    thp = rep.get("thp", {})
    if thp.get("enabled") is None:
        lines.append("THP      off: this kernel has no transparent huge pages")
    else:
        meaning = {"always": "large anonymous mappings get 2 MiB pages",
                   "madvise": "ranges that ask get 2 MiB pages (the engine asks for its weights)",
                   "never": "weights use 4 KiB pages; to allow: echo madvise > " + THP_DIR + "/enabled"}
        lines.append(f"THP      {thp['enabled']}: {meaning.get(thp['enabled'], '?')}; defrag {thp['defrag']}")
        lines.append("  a file map (the default) rarely gets huge pages; --no-mmap memory does")
    if gpu["available"]:
        lines += gpu_lines(gpu)
    else:
        lines.append(f"GPU      none: {gpu['reason']}")
    return lines
