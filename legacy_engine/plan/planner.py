"""The planner: what goes where, and which engine runs which phase, decided from measurements.

Three parts, each usable alone:

1. VRAM accounting (gpu/layout.py: `vram_footprint`): every device allocation a GPU model of a file would make:
   resident weights, pinned experts, the two expert staging buffers of streamed prefill, the states of a context,
   the rope table and the scratch of a prefill chunk and of a decode step. The planner's Placement (gpu/placement.py:
   `place`) is checked against its budget when it is built (`PlanningError` naming the parts); the GPU model applies
   it and the driver layer enforces the budget. Between requests `repin` re-chooses the pins from the routing.

2. Machine measurements (probe.py: `measure`, cached per machine in $LE_CACHE_DIR/machine.json): host→device bandwidth
   from page-locked memory, CPU read bandwidth at the decode thread count, GPU prefill and decode throughput per
   tier. `--simulate-link GBPS` replaces the measured link (a CMP 100-210 on PCIe Gen1 x1 ≈ 0.25 GB/s, a Fermi
   box on PCIe 2.0 x16 ≈ 6 GB/s).

3. Strategies and the choice (`plan`): for a prompt length and a generation length, predict prefill and decode
   time of each strategy the machine can run:
     cpu        prefill and decode on the CPU (the integer SIMD kernels)
     stream     prefill on the GPU with the routed experts copied per layer from host RAM (pinned experts stay in
                VRAM), decode on the CPU (the seed paper's split)
     hybrid     the same prefill; decode steps with attention, GDN, router, shared and pinned experts on the GPU
                and the other routed experts on the CPU (pins: the file's saved routing's hottest where the decode
                they speed up pays for their copies, else consecutive ids)
     resident   everything in VRAM, prefill and decode on the GPU
   and choose the fastest that fits the VRAM budget; short prompts stay on the CPU when the copy cannot pay
   (`min_gpu_tokens`, the crossover).

Models of time (a roofline per phase, each term from one measurement; shown by `legacy-engine plan`):
  CPU decode  t = decode_bytes / cpu_bw_eff            (bytes read per token: dense + top-k experts + LM head)
  CPU prefill t = n * decode_params * 2 / cpu_flops    (one integer dot product per token and weight)
  GPU prefill t = max(copy, compute) per layer summed, copy = streamed expert bytes / link_bw + copies *
              H2D_COPY_S (one a tensor and run of experts between the pins), compute =
              n * active_params * 2 / (gpu_flops * GPU_PREFILL_EFF) + attention pairs * 4 * heads * head_dim *
              attention layers / (gpu_flops * GPU_ATTN_EFF) (the GEMM probe's rate, derated as measured); the
              stream split adds the state handoff both ways at SPLIT_HANDOFF_GBPS (the hybrid split has none)
  GPU decode  t = decode_bytes / gpu_bw_eff + launches * launch_s
  hybrid step t = (dense + pinned share of expert bytes) / gpu_bw + launches * launch_s
                  + unpinned expert bytes / (cpu_bw * HYBRID_CPU_EFF) + MoE layers * HYBRID_HOST_S_PER_LAYER
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from .. import gpu
from ..core.errors import PlanningError
from ..core.paths import cache_dir
from ..format.fingerprint import model_fingerprint
from ..format.footprint import weight_footprint
from ..gpu.layout import (ALLOC_GRANULE, GiB, MiB, VramFootprint, WEIGHT_ALIGN, align_up, expected_distinct,
                          expert_bytes, expert_tensors, layer_expert_bytes, staging_pool_bytes, state_bytes,
                          vram_footprint)
from ..gpu.options import GpuOptions
from ..gpu.placement import Placement, place, resident_chunk
from .probe import Machine, measure


def parse_size(text: str) -> int:
    """'6GiB', '6G', '6144MiB', '512M', '6.5GB' (GB = 10^9), or plain bytes -> bytes."""
    t = str(text).strip()
    units = {"gib": GiB, "g": GiB, "mib": MiB, "m": MiB, "kib": 1024, "k": 1024, "gb": 10**9, "mb": 10**6,
             "b": 1, "": 1}
    num = t.rstrip("BbIiGgMmKk")
    unit = t[len(num):].lower()
    if unit not in units:
        raise ValueError(f"size {text!r}: unit must be one of GiB, MiB, KiB, GB, MB, B")
    try:
        v = float(num)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with a unit (e.g. 6GiB)") from None
    if v < 0 or not math.isfinite(v):
        raise ValueError(f"size {text!r} must be >= 0")
    return int(v * units[unit])


# ================================================================================================ the machine's rates
# (the probes that measure it, and Machine: probe.py)

# Efficiencies measured on the GPU machine (README, issue 4/5 numbers) that turn a bandwidth into a rate; each
# is a ratio of a measured tok/s to the roofline of the same run, so the planner's only other inputs are the
# probes (probe.py).
CPU_DECODE_EFF = 0.62        # CPU decode tok/s / (read bandwidth / bytes per token): 59-64 % at 16 threads
CPU_PREFILL_GAIN = 1.0       # CPU prefill tok/s / CPU decode tok/s (one integer dot per token and row: ~1x)
# Whole GPU prefill / the GEMM probe's rate (gpu_gemm_tflops): the weights' FLOPs (2 per weight and token) run at
# GPU_PREFILL_EFF of it, the attention's scores and P V (4 FLOPs per (query, key) pair, head and attention layer,
# causal: n (n + 1) / 2 pairs however the passes cut n) at GPU_ATTN_EFF. Calibrated on the GPU's phases of `bench
# split --strategies hybrid` (35B-A3B Q4_K_M under 6 GiB, H200, probe 113 TFLOP/s; 2,048 and 8,192 tokens:
# benchmarks/results/prefill_s43_2026-11-29.md); the first calibration (0.66, H100, token-by-token GDN) left out
# the attention and read 13.3k tok/s where 9.7k ran.
GPU_PREFILL_EFF = 0.53
GPU_ATTN_EFF = 0.26
GPU_DECODE_LAUNCHES_PER_LAYER = 14   # kernels per layer and token (gpu/forward.py: 544 for 24 layers + head ≈ 22.5/layer
#                                     on the 0.8B incl. quantise/route; 14 is the MoE-free GDN average)
# The hybrid decode (gpu/forward.py _ffn_hybrid: the GPU and the CPU exchange each MoE layer through a host channel that
# both read and write directly, a token is one CUDA graph), calibrated on `bench split --strategies hybrid --reps 3`
# (35B-A3B Q4_K_M, 6 GiB, H100 + 16 cores reading 52.3 GB/s, 2026-11-25 fifth session, the quietest run: 0.5 % of the
# CPUs taken by the hypervisor): skewed routing (--router-skew 1.2) 10.8 ms per token at 12 threads, of which the
# CPU's 98 experts 5.96 ms (0.187 GB: 31 GB/s = 0.60 of the probe's read bandwidth), the host waiting for each
# layer's routing 4.21 ms (the GPU's chain from one layer's CPU row to the next layer's routing: ~20 kernels), the
# rest 0.66 ms; uniform routing 16.8 ms for 278 experts (0.53 GB, 0.61). The per-layer cost below is that chain less
# the GPU's own share (its GEMV weights at the GEMV rate, ~1.2 ms) plus the rest, per MoE layer. HYBRID_CPU_EFF:
# the CPU's experts per token / the probe's read bandwidth, recalibrated 2026-11-25 (seventh session) after the dot
# products' prefetch and le_moe_routed's static split: uniform 196 experts (347 MB) in 7.0 ms, skewed 100 (177 MB)
# in 3.6 ms, both 49-50 GB/s of the probe's 90.2 = 0.55 (the first calibration, 0.47, before both changes: the
# planner's decode then read 18 % / 12 % under the measurement; now 81.0 (uniform, recomputed on that call's machine)
# and ~115 (skewed, estimated from the parts) vs 90.0 / 122.3; link choice unchanged, 2 / 0). A few % of hypervisor
# steal halves these numbers (bench split reports it per run). Recalibrated 2026-11-25 (eighth session; H200 + 16
# cores, probe 85.8 GB/s, bench split --tg-depth 0,2048, the pins from warm routing counts, JSONs
# split_a3b_6GiB_*_2026-11-25h.json): the CPU's experts uniform 161.7 (286 MB) in 5.4 ms, skewed 99.7 (176 MB) in
# 3.1 ms: 53 / 57 GB/s = 0.62 / 0.66 -> 0.64; the host's wait for each routing 4.4 / 3.5 ms a token, of which the
# GPU's own share (~1 ms, `gpu` in _hybrid_decode) -> 75 µs a layer. Before it the planner read 90.6 / 113.9 against
# 106.1 / 152.5 tok/s measured (depth 0).
# The split's state handoff (SplitModel.forward, stream strategy: the GDN states (and KV rows so far) to the GPU
# before a pass, the states and the pass's KV rows back after, through one page-locked staging buffer), bytes moved /
# seconds: benchmarks/bench_split_handoff.py, 35B-A3B Q4_K_M under 6 GiB, pp2048, H100 2026-11-25 (fourth session):
# from_cpu 66 MB in 14.2 ms, to_cpu_rows 150 MB in 30.7 ms: 4.8 GB/s (the pageable Python-bytes path it replaced:
# 328 ms, 0.66 GB/s). The hybrid strategy keeps the state on the GPU: no handoff.
SPLIT_HANDOFF_GBPS = 4.8
HYBRID_CPU_EFF = 0.64
HYBRID_HOST_S_PER_LAYER = 75e-6
# The hybrid decode's link experts (GpuModel link_experts: per layer, some experts that are not pinned are fetched
# into VRAM by a copy kernel and run on the GPU while the CPU runs the rest). Same machine and file, pp512/tg32 x3:
# uniform routing 62.5 tok/s with none, 83.4 / 87.3 / 83.3 / 76.9 with 1-4 per layer (the GPU's chain grows past 2:
# ~55 µs per 1.9 MB expert, 36 GB/s of the link's 52: LINK_FETCH_EFF 0.7); skewed routing (2.15 unpinned experts
# per layer) 125 with none, 116 / 107 with 1 / 2. The count balancing the CPU's share against the link's is
# under-committed by LINK_COMMIT: the unpinned experts per layer vary token to token, and a layer whose GPU share
# finishes last delays the next layer.
LINK_FETCH_EFF = 0.7
LINK_COMMIT = 0.8
# The hybrid decode's extras (choose_decode_extras): after each prefill the link carries them back into the
# staging (~0.9 GiB on the 35B-A3B under 6 GiB: 17 ms at 53 GB/s, 3.6 s over a CMP's 0.25 GB/s) while the decode
# runs without them. Kept where the time they save over a reply of EXTRAS_MIN_GEN tokens (or the plan's gen, if
# longer) exceeds that copy. Measured (35B-A3B Q4_K_M, 6 GiB, H200, 2026-11-25, hybrid vs hybrid/noextras in one
# process, 16 threads): the CPU's experts per token 193 -> 174 (uniform) and 87 -> 72 (skewed); decode tok/s
# within the runs' spread (+-5 %) on that 16-core host, where the GPU's chain and not the CPU's bytes set the pace.
EXTRAS_MIN_GEN = 128
# A host-to-VRAM copy's cost beyond its bytes: a streamed layer issues one a tensor and run of experts between its pins
# (Residency.stage). benchmarks/h2d_copy_sizes.py, H200, 2026-11-29: one long copy 55.4 GB/s, 3 MiB copies 53.0,
# 1.12 MiB 49.3, 0.56 MiB 44.3: 2.6 us each. Pins scattered by hotness (~46 runs a layer of the 35B-A3B under 6 GiB)
# cost a 2048-token pass ~14 ms: 6,625-6,704 tok/s against 6,849-6,994 with consecutive pins, alternated in one
# process (benchmarks/split_timeline.py --pins counts,lowest; prefill_s44_2026-11-29.md). The pins follow the
# routing only where the decode they speed up pays for that (_split_strategies).
H2D_COPY_S = 2.6e-6


# ================================================================================================ predictions

@dataclasses.dataclass
class Strategy:
    name: str
    fits: bool
    why: str                        # placement / reason it cannot run
    vram: int                       # planned bytes
    prefill_s: float = math.inf
    decode_s_per_tok: float = math.inf
    prefill_parts: dict = dataclasses.field(default_factory=dict)     # where the prefill time goes
    pinned: dict = dataclasses.field(default_factory=dict)
    min_gpu_tokens: int = 0
    chunk: int = 512                # tokens per GPU pass (streamed: each pass copies the experts it routes to)
    decode_parts: dict = dataclasses.field(default_factory=dict)      # where the decode time goes (hybrid)
    link_experts: int = 0           # hybrid: experts per layer the GPU fetches over the link (GpuModel link_experts)
    decode_extras: dict = dataclasses.field(default_factory=dict)    # hybrid: GpuModel decode_extras
    pins_by: str = "ids"            # "counts": the saved routing's hottest; "ids": consecutive (fewer copies a pass)

    def total_s(self, gen: int) -> float:
        return self.prefill_s + gen * self.decode_s_per_tok


_PINS_BY = {"counts": "the hottest by the saved routing counts", "ids": "consecutive ids"}   # Strategy.pins_by, said


def choose_pins(file, budget_bytes: int, counts: dict | None = None) -> dict:
    """{layer: [expert ids]} that fill budget_bytes, hottest first by `counts` {layer: [count per expert]}
    (routing statistics); without counts (or a layer's uniform within noise: _hotness) every expert is equally hot
    and the pins are spread evenly over the layers (round-robin, lower ids first)."""
    per = expert_bytes(file)
    budget_bytes -= len(per) * ALLOC_GRANULE          # each layer's pin store is rounded up to the granule
    if not per or budget_bytes <= 0:
        return {}
    pins, used = {}, 0
    for e, i in _ranked_experts(file, per, counts):
        if used + per[i] > budget_bytes:
            continue
        pins.setdefault(i, []).append(e)
        used += per[i]
    return {i: sorted(v) for i, v in sorted(pins.items())}


# A layer's routing counts that uniform routing could have drawn (Pearson's chi-square against their mean within
# UNIFORM_SIGMAS standard deviations of its expectation, n - 1) rank no expert above another: its pins then take
# consecutive ids, around which a streamed pass copies the rest in one copy a tensor, not one per run between pins
# scattered by noise (a copy costs ~2.5 us beyond its bytes: 3 MiB copies 53.1 GB/s against 55.5 for one long copy,
# H200, benchmarks/h2d_copy_sizes.py).
UNIFORM_SIGMAS = 4.0


def _hotness(c: np.ndarray) -> np.ndarray:
    """A layer's counts per expert as the ranking reads them: all zero (equally hot) where they are uniform within
    noise (UNIFORM_SIGMAS), else as they are."""
    n, m = c.size, float(c.mean()) if c.size else 0.0
    if n < 2 or m <= 0:
        return np.zeros_like(c)
    chi2 = float(((c - m) ** 2).sum() / m)
    return np.zeros_like(c) if chi2 <= (n - 1) + UNIFORM_SIGMAS * math.sqrt(2 * (n - 1)) else c


def _ranked_experts(file, layers, counts: dict | None, skip: dict | None = None) -> list:
    """[(expert, layer)] of `layers` hottest first by `counts` (none, or uniform within noise: all equally hot,
    _hotness); ties: the lower id, then the lower layer (round-robin over the layers); the experts in `skip`
    {layer: ids} left out."""
    hp = file.hparams
    cand = []
    for i in layers:
        c = _hotness(np.asarray(counts.get(i, np.zeros(hp.n_expert)) if counts else np.zeros(hp.n_expert),
                                dtype=float))
        out = set(skip.get(i, ())) if skip else set()
        cand += [(-c[e], e, i) for e in range(hp.n_expert) if e not in out]
    cand.sort()
    return [(e, i) for _, e, i in cand]


def choose_decode_extras(file, pins: dict, counts: dict | None = None, slots: int = 0) -> dict:
    """{layer: [expert ids]} the hybrid decode keeps in the expert staging between prefills (VRAM a decode leaves
    idle, staging_pool_bytes): the hottest experts not pinned by `counts` (none: spread evenly, as choose_pins),
    as many as the pool holds beside each layer's `slots` link/early experts (extras_regions). Used as pins by
    the decode once a prefill's staging is refilled with them."""
    per = expert_bytes(file)
    pool = staging_pool_bytes(file)
    if not per or not pool:
        return {}
    region = lambda i, n: align_up((slots + n) * per[i], WEIGHT_ALIGN)    # noqa: E731  (extras_regions' size)
    used = sum(region(i, 0) for i in per)
    extras: dict = {}
    for e, i in _ranked_experts(file, per, counts, pins):
        n = len(extras.get(i, ()))
        grow = region(i, n + 1) - region(i, n)
        if used + grow > pool:
            continue
        extras.setdefault(i, []).append(e)
        used += grow
    return {i: sorted(v) for i, v in sorted(extras.items())}


def pins_drift(file, pins: dict, counts: dict) -> tuple[float, dict]:
    """How far the routing `counts` have drifted from `pins`: (pinned_share of the best pins for those counts in
    the same bytes - pinned_share of `pins`, those best pins)."""
    per = expert_bytes(file)
    used = sum(per[i] * len(v) for i, v in pins.items() if i in per)
    best = choose_pins(file, used + len(per) * ALLOC_GRANULE, counts) if used else {}
    return pinned_share(file, best, counts) - pinned_share(file, pins, counts), best


def merge_pins(pins: dict, extras: dict) -> dict:
    """The experts a hybrid decode runs on the GPU: pins and decode extras, {layer: sorted ids}."""
    return {i: sorted(set(pins.get(i, ())) | set(extras.get(i, ()))) for i in sorted(set(pins) | set(extras))}


def fill_pins(file, budget: int, n_ctx: int, chunk: int, int8: bool, counts: dict | None = None,
              link_experts: int = 0, early_experts: int = 0) -> tuple[dict, VramFootprint]:
    """The pins (choose_pins) that fill what `budget` leaves after everything else a streamed model of `file`
    allocates (passes of `chunk` tokens, link and early experts' staging) -> (pins, the footprint with them); no
    pins, and a footprint over the budget, when even none fit."""
    fp0 = vram_footprint(file, stream_experts=True, n_ctx=n_ctx, chunk=chunk, int8=int8, link_experts=link_experts,
                         early_experts=early_experts)
    pins = choose_pins(file, budget - fp0.total, counts) if fp0.total <= budget else {}
    return pins, vram_footprint(file, stream_experts=True, pinned=pins, n_ctx=n_ctx, chunk=chunk, int8=int8,
                                link_experts=link_experts, early_experts=early_experts)


def pinned_share(file, pins: dict, counts: dict | None = None) -> float:
    """The expected share of routed-expert work that lands on pinned experts (uniform routing: pins per layer /
    n_expert; with routing counts, the pinned experts' share of them), averaged over the MoE layers."""
    hp = file.hparams
    layers = list(layer_expert_bytes(file))
    if not layers or not hp.n_expert:
        return 0.0
    shares = []
    for i in layers:
        es = list(pins.get(i, ()))
        c = np.asarray(counts.get(i), dtype=float) if counts and counts.get(i) is not None else None
        if c is not None and c.sum() > 0:
            shares.append(float(c[es].sum() / c.sum()) if es else 0.0)
        else:
            shares.append(len(es) / hp.n_expert)
    return float(np.mean(shares))


def choose_link(m: Machine, file, pins: dict, counts: dict | None) -> int:
    """Experts per MoE layer the hybrid decode fetches over the link (LINK_COMMIT of the count that balances the
    CPU's time on the rest against the link's on these)."""
    hp = file.hparams
    per = list(layer_expert_bytes(file).values())
    if not per or not m.has_gpu or m.link_gbps <= 0 or m.cpu_read_gbps <= 0:
        return 0
    eb = sum(per) / len(per) / hp.n_expert
    u = hp.n_expert_used * (1 - pinned_share(file, pins, counts))        # experts per layer not pinned
    t_cpu = eb / (m.cpu_read_gbps * 1e9 * HYBRID_CPU_EFF)
    t_link = eb / (m.link_gbps * 1e9 * LINK_FETCH_EFF)
    return max(0, min(hp.n_expert_used, int(LINK_COMMIT * u * t_cpu / (t_cpu + t_link))))


def _hybrid_decode(m: Machine, file, fpd, pins: dict, counts: dict | None, link: int = 0) -> tuple[float, dict]:
    """Seconds per token of the hybrid decode and its parts: the GPU's share (dense weights, shared expert, head,
    pinned experts at the GEMV rate, launches), the routed experts that are not pinned (per layer the longer of the
    CPU's share at the CPU decode rate and the `link` experts fetched over the link) and the per-layer exchange
    between them (the GPU's chain to the next routing); they run one after the other (only the shared, pinned and
    link experts overlap the CPU)."""
    hp = file.hparams
    n_moe = len(layer_expert_bytes(file))
    share = pinned_share(file, pins, counts)
    experts = fpd.parts.get("experts", 0)
    gpu = ((fpd.decode_bytes - experts + share * experts) / (m.gpu_gemv_gbps * 1e9)
           + GPU_DECODE_LAUNCHES_PER_LAYER * hp.n_layer * m.gpu_launch_us * 1e-6)
    cpu = (1 - share) * experts / (m.cpu_read_gbps * 1e9 * HYBRID_CPU_EFF)
    if link and n_moe:
        u = hp.n_expert_used * (1 - share)
        eb = experts / n_moe / hp.n_expert_used            # bytes of one routed expert's work (per token and layer)
        per_layer = max(max(u - link, 0.0) * eb / (m.cpu_read_gbps * 1e9 * HYBRID_CPU_EFF),
                        min(link, u) * eb / (m.link_gbps * 1e9 * LINK_FETCH_EFF))
        cpu = n_moe * per_layer
    host = n_moe * HYBRID_HOST_S_PER_LAYER
    return gpu + cpu + host, {"gpu": gpu, "cpu": cpu, "host": host, "pinned_share": share, "link_experts": link}


def _cpu_times(m: Machine, decode_bytes: int) -> tuple[float, float]:
    """(CPU decode s/token, CPU prefill s/token)."""
    t_tok = decode_bytes / (m.cpu_read_gbps * 1e9 * CPU_DECODE_EFF)
    return t_tok, t_tok / CPU_PREFILL_GAIN


def _runs_between(pins, n: int) -> int:
    """Runs of consecutive ids of 0 … n-1 not in `pins`: the copies a layer's full stage issues per expert tensor."""
    free = np.ones(n, dtype=bool)
    free[list(pins)] = False
    return int(np.count_nonzero(free & ~np.r_[False, free[:-1]]))


def _attention_pairs(c0: int, c: int) -> float:
    """(query, key) pairs a causal pass of c tokens after c0 already in the context scores, per attention layer."""
    return c * (c0 + (c + 1) / 2)


def _gpu_prefill(m: Machine, file, fp_decode, n: int, chunk: int, stream: bool, pinned: dict) -> tuple[float, dict]:
    """Seconds to prefill n tokens on the GPU in passes of `chunk` and where they go (compute: the weights' GEMMs per
    token and the attention's scores per (query, key) pair; expert copies, overlap)."""
    hp = file.hparams
    rate = m.gpu_gemm_tflops * 1e12
    per_tok_flops = 2 * (fp_decode.decode_params - fp_decode.head_params) / GPU_PREFILL_EFF
    n_attn = sum(1 for r in hp.recurrent if not r)
    pair_s = 4 * hp.n_head * hp.head_dim * n_attn / (rate * GPU_ATTN_EFF)      # QK^T and PV of every attention layer
    passes = [(c0, min(chunk, n - c0)) for c0 in range(0, n, chunk)]
    attn = sum(_attention_pairs(c0, c) for c0, c in passes) * pair_s
    compute = n * per_tok_flops / rate + attn + 2 * fp_decode.head_params / rate
    parts = {"compute": compute, "attention": attn, "copy": 0.0, "total": compute}
    if not stream or not hp.n_expert:
        return compute, parts
    # the split hands the sequence over both ways: GDN states and the new KV rows (SplitModel.forward)
    handoff = (state_bytes(hp, 0) + state_bytes(hp, n)) / (SPLIT_HANDOFF_GBPS * 1e9)   # up, then down
    copy_total, copies_total, total = 0.0, 0.0, handoff
    # bytes a chunk copies per layer when it routes to every expert: the unpinned experts; the copies that takes
    # (per tensor, a run between the pins), or one an expert routed to in a pass that routes to fewer
    unpinned = {i: (hp.n_expert - len(pinned.get(i, ()))) * (full // hp.n_expert)
                for i, full in layer_expert_bytes(file).items()}
    tensors = {i: len(expert_tensors(file, i)) for i in unpinned}
    runs = {i: _runs_between(pinned.get(i, ()), hp.n_expert) for i in unpinned}
    n_layers = len(unpinned)
    for c0, c in passes:
        share = expected_distinct(hp.n_expert, hp.n_expert_used, c) / hp.n_expert
        overlap = share >= 0.5                     # the GPU model prefetches the layer ahead then
        layer_compute = (c * per_tok_flops / rate + _attention_pairs(c0, c) * pair_s) / max(n_layers, 1)
        for i, b in unpinned.items():
            copies = tensors[i] * (runs[i] if overlap else share * (hp.n_expert - len(pinned.get(i, ()))))
            t_copy = share * b / (m.link_gbps * 1e9) + copies * H2D_COPY_S
            copy_total += t_copy
            copies_total += copies
            total += max(t_copy, layer_compute) if overlap else t_copy + layer_compute
    total += 2 * fp_decode.head_params / rate
    parts.update(copy=copy_total, copies=copies_total, handoff=handoff, total=total)
    return total, parts


def plan(file, m: Machine, vram: int | None, prompt: int, gen: int, n_ctx: int | None = None, chunk: int = 512,
         counts: dict | None = None) -> list[Strategy]:
    """Every strategy for this file on this machine, predicted; the first is the one to run (fastest that fits)."""
    hp = file.hparams
    n_ctx = n_ctx or max(prompt + gen, 1)
    fpd = weight_footprint(file)
    cpu_dec, cpu_pre = _cpu_times(m, fpd.decode_bytes)
    out = [Strategy("cpu", True, f"{m.cpu_threads} CPU threads, weights in host RAM", 0, prompt * cpu_pre,
                    cpu_dec, {"cpu": prompt * cpu_pre})]
    if not m.has_gpu:
        out.append(Strategy("stream", False, "no usable GPU", 0))
        out.append(Strategy("hybrid", False, "no usable GPU", 0))
        out.append(Strategy("resident", False, "no usable GPU", 0))
        return _rank(out, gen)
    budget = m.vram_free if vram is None else vram
    int8 = m.gpu_tier == "dp4a"
    res_chunk = resident_chunk(file, budget, n_ctx, int8)
    fp_res = vram_footprint(file, n_ctx=n_ctx, chunk=res_chunk, int8=int8)
    if fp_res.total <= budget:
        pre, parts = _gpu_prefill(m, file, fpd, prompt, res_chunk, False, {})
        n_launch = GPU_DECODE_LAUNCHES_PER_LAYER * hp.n_layer
        dec = fpd.decode_bytes / (m.gpu_gemv_gbps * 1e9) + n_launch * m.gpu_launch_us * 1e-6
        out.append(Strategy("resident", True, f"everything in VRAM: {fp_res.describe()}", fp_res.total, pre, dec,
                            parts))
    else:
        out.append(Strategy("resident", False, f"needs {fp_res.total / GiB:.2f} GiB of VRAM, budget "
                            f"{budget / GiB:.2f} GiB", fp_res.total))
    if hp.n_expert:
        out += _split_strategies(file, m, budget, prompt, gen, n_ctx, int8, fpd, cpu_dec, cpu_pre, counts)
    else:
        out += [Strategy("stream", False, "a dense model has no experts to stream", 0),
                Strategy("hybrid", False, "a dense model has no experts to split", 0)]
    return _rank(out, gen)


def _split_strategies(file, m: Machine, budget: int, prompt: int, gen: int, n_ctx: int, int8: bool, fpd,
                      cpu_dec: float, cpu_pre: float, counts: dict | None) -> list[Strategy]:
    """plan's stream and hybrid strategies of a MoE file: the pass length whose streamed prefill is fastest, its
    pins, and the same placement with the hybrid decode (link experts, decode extras). With routing counts each
    strategy takes the saved routing's hottest pins or consecutive ids (fewer copies a pass), whichever is predicted
    faster for the job: the prefill with the CPU's decode, the prefill and max(gen, EXTRAS_MIN_GEN) tokens of the
    hybrid decode (a reply as long as the extras' rule counts)."""
    hp = file.hparams
    best = None
    for c in STREAM_CHUNKS:                # a longer pass copies each layer's experts fewer times, pins fewer
        if c * hp.n_expert_used > 65535:
            continue
        pins, fp = fill_pins(file, budget, n_ctx, c, int8, counts)
        if fp.total > budget:
            continue
        pre, parts = _gpu_prefill(m, file, fpd, prompt, c, True, pins)
        if best is None or pre < best[0]:
            best = (pre, parts, c, pins, fp)
    if best is None:
        fp0 = vram_footprint(file, stream_experts=True, n_ctx=n_ctx, chunk=STREAM_CHUNKS[-1], int8=int8)
        why = (f"even without pinned experts it needs {fp0.total / GiB:.2f} GiB of VRAM ({fp0.describe()}), "
               f"budget {budget / GiB:.2f} GiB")
        return [Strategy("stream", False, why, fp0.total), Strategy("hybrid", False, why, fp0.total)]
    c = best[2]
    orders = [("ids", None)] + ([("counts", counts)] if counts else [])    # a tie: consecutive ids, fewer copies
    streams, hybrids = [], []
    for by, pin_counts in orders:
        if pin_counts is counts:         # the pins the pass length was chosen with: as predicted above
            pre, parts, _, pins, fp = best
        else:
            pins, fp = fill_pins(file, budget, n_ctx, c, int8, pin_counts)
            if fp.total > budget:
                continue
            pre, parts = _gpu_prefill(m, file, fpd, prompt, c, True, pins)
        st = _stream_strategy(file, m, fpd, c, pins, fp, pre, parts, prompt, cpu_dec, cpu_pre, by)
        streams.append(st)
        hybrids.append(_hybrid_strategy(file, m, budget, n_ctx, int8, fpd, st, (pre, parts), prompt, gen, counts,
                                        pin_counts))
    reply = max(gen, EXTRAS_MIN_GEN)
    return [min(streams, key=lambda s: s.prefill_s), min(hybrids, key=lambda s: s.total_s(reply))]


def _stream_strategy(file, m: Machine, fpd, c: int, pins: dict, fp, pre: float, parts: dict, prompt: int,
                     cpu_dec: float, cpu_pre: float, pins_by: str) -> Strategy:
    """The stream strategy of passes of c tokens with `pins` (footprint fp, prefill pre seconds and its parts)."""
    hp = file.hparams
    n_pin = sum(len(v) for v in pins.values())
    st = Strategy("stream", True, f"dense weights in VRAM, {n_pin} of {hp.n_expert * len(fp.expert_bytes)} "
                  f"experts pinned ({_PINS_BY[pins_by]}), the rest copied per layer at {m.link_gbps:.1f} GB/s, "
                  f"passes of {c} tokens: {fp.describe()}", fp.total, pre, cpu_dec, parts, pins, chunk=c,
                  pins_by=pins_by)
    st.min_gpu_tokens = crossover(m, file, fpd, c, pins, cpu_pre)
    if prompt < st.min_gpu_tokens:       # the split runs short prompts on the CPU
        st.prefill_s, st.prefill_parts = prompt * cpu_pre, {"cpu": prompt * cpu_pre}
    return st


def _hybrid_strategy(file, m: Machine, budget: int, n_ctx: int, int8: bool, fpd, st: Strategy, gpu_pre: tuple,
                     prompt: int, gen: int, counts: dict | None, pin_counts: dict | None) -> Strategy:
    """The stream strategy st's placement (its GPU passes predicted: gpu_pre = (seconds, parts)) with the hybrid
    decode: short passes run as hybrid steps, token by token; with link experts, their staging comes out of the pins
    (chosen by pin_counts, as st's)."""
    c, pins = st.chunk, st.pinned
    link = choose_link(m, file, pins, counts)
    hpins, hvram = (pins, st.vram)
    if link:
        hpins, hfp = fill_pins(file, budget, n_ctx, c, int8, pin_counts, link)
        hvram = hfp.total
    hpre, hpre_parts = gpu_pre if hpins is pins else _gpu_prefill(m, file, fpd, prompt, c, True, hpins)
    extras = choose_decode_extras(file, hpins, counts, link)       # the staging's bytes between prefills
    hyb, hparts = _hybrid_decode(m, file, fpd, merge_pins(hpins, extras), counts, link)
    hyb0, hparts0 = _hybrid_decode(m, file, fpd, hpins, counts, link)
    per = expert_bytes(file)
    refill_s = sum(per[i] * len(v) for i, v in extras.items()) / (m.link_gbps * 1e9)
    if max(gen, EXTRAS_MIN_GEN) * (hyb0 - hyb) <= refill_s:     # not worth their copy after each prefill
        extras, hyb, hparts = {}, hyb0, hparts0
    link_why = (f", {link} more per layer fetched over the link to the GPU" if link else "")
    hy = dataclasses.replace(st, name="hybrid", decode_s_per_tok=hyb, decode_parts=hparts, pinned=hpins,
                             vram=hvram, link_experts=link, decode_extras=extras,
                             why=st.why + f"; decode hybrid: {hparts['pinned_share']:.0%} of the routed "
                             f"experts' work on the GPU (pinned, and {sum(map(len, extras.values()))} more "
                             f"kept in the staging between prefills){link_why}, the rest on the CPU")
    hy.min_gpu_tokens = crossover(m, file, fpd, c, hpins, hyb)
    # the same passes without the handoff: the hybrid split keeps the sequence on the GPU
    hy.prefill_s = hpre - hpre_parts["handoff"]
    hy.prefill_parts = dict(hpre_parts, handoff=0.0, total=hpre_parts["total"] - hpre_parts["handoff"])
    if prompt < hy.min_gpu_tokens:
        hy.prefill_s, hy.prefill_parts = prompt * hyb, {"hybrid steps": prompt * hyb}
    return hy


def crossover(m: Machine, file, fpd, chunk: int, pins: dict, cpu_pre: float) -> int:
    """The shortest pass worth running on the GPU (its prefill, copies included, beats cpu_pre seconds per token:
    the CPU's, or the hybrid step's); 1 << 30 when none up to 64k tokens does."""
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        if _gpu_prefill(m, file, fpd, n, chunk, True, pins)[0] < n * cpu_pre:
            return n
    return 1 << 30


def _rank(strategies: list[Strategy], gen: int) -> list[Strategy]:
    return sorted(strategies, key=lambda s: (not s.fits, s.total_s(gen)))


# ================================================================================================ the engine's choice

VRAM_MARGIN = 512 * MiB      # left free when no budget is given (the driver, other processes, fragmentation)
STREAM_CHUNKS = (4096, 2048, 1024, 512, 256)   # pass lengths the planner tries for streamed prefill


DECODES = ("auto", "cpu", "hybrid")


def vram_budget(vram: int | None = None) -> int:
    """The VRAM budget of a GPU engine: `vram` bytes, or (None) what the device has free less VRAM_MARGIN."""
    gpu.init()
    return int(vram) if vram is not None else max(0, gpu.mem_stats()["free_bytes"] - VRAM_MARGIN)


def gpu_int8(options: GpuOptions | None = None) -> bool:
    """Whether a GPU model with `options` on this device plans scratch for Q8_1 activations (its int8 matmuls)."""
    gpu.init()
    return any((options or GpuOptions()).precision(gpu.device_arch()))


def gpu_placement(model, vram: int | None = None, n_ctx: int = 4096, options: GpuOptions | None = None,
                  min_gpu_tokens: int | None = None, machine: Machine | None = None,
                  counts: dict | None = None, decode: str = "auto", reserve: int = 0) -> Placement:
    """Where a GPU run of `model` with `options` (GpuOptions: its int8 matmuls need scratch for Q8_1 activations)
    puts its weights under `vram` (default: free VRAM minus VRAM_MARGIN): resident when everything fits, else (MoE)
    dense weights resident + experts streamed with the budget left pinned, the GPU prefilling passes of
    >= min_gpu_tokens (default: the crossover predicted from `machine`, measured once and cached). decode (streamed
    placements): 'cpu', 'hybrid', or 'auto' = the one predicted faster. reserve: bytes of the budget kept for the
    vision tower (plan/vision.py VisionPlacement.reserve): the model is planned in the rest, and its Placement holds
    the whole budget with them `reserved`. PlanningError when nothing fits."""
    if decode not in DECODES:
        raise ValueError(f"decode = {decode!r}: one of {', '.join(DECODES)}")
    int8 = gpu_int8(options)
    file = model.file
    held = vram_budget(vram)
    if not 0 <= reserve <= held:
        raise ValueError(f"reserve = {reserve}: 0 … the budget ({held})")
    budget = held - reserve
    kept = f" ({reserve / GiB:.2f} GiB more kept for the vision tower)" if reserve else ""
    chunk = resident_chunk(file, budget, n_ctx, int8)
    fp = vram_footprint(file, n_ctx=n_ctx, chunk=chunk, int8=int8)
    if fp.total <= budget:
        return place(file, budget=held, reserved=reserve, n_ctx=n_ctx, chunk=chunk, int8=int8,
                     why=f"resident, passes of {chunk} tokens: {fp.describe()} in a budget of {budget / GiB:.2f} "
                         f"GiB{kept}")
    if not file.hparams.n_expert:
        raise PlanningError(f"the model needs {fp.total / GiB:.2f} GiB of VRAM ({fp.describe()}), the budget is "
                            f"{budget / GiB:.2f} GiB{kept}, and a dense model has no experts to stream: run it on the "
                            "CPU (without --gpu)")
    m = machine
    if m is None:
        m = measure(model.n_threads)
    if counts is None:
        counts = load_routing(model)
    strategies = {s.name: s for s in plan(file, m, budget, 2048, 0, n_ctx=n_ctx, counts=counts)}
    st = strategies["stream"]
    if not st.fits:
        raise PlanningError(f"streamed GPU model: {st.why}")
    hy = strategies["hybrid"]
    if decode == "auto":
        decode = "hybrid" if hy.decode_s_per_tok < st.decode_s_per_tok else "cpu"
        dec_why = (f"decode {decode} (predicted {1 / hy.decode_s_per_tok:.1f} tok/s hybrid, "
                   f"{1 / st.decode_s_per_tok:.1f} tok/s on the CPU)")
    else:
        dec_why = f"decode {decode} (asked)"
    if decode == "hybrid":
        st = hy
    pins, chunk, link = st.pinned, st.chunk, st.link_experts if decode == "hybrid" else 0
    extras = st.decode_extras if decode == "hybrid" else {}
    if min_gpu_tokens is None:
        min_gpu_tokens = st.min_gpu_tokens
    pl = place(file, budget=held, reserved=reserve, n_ctx=n_ctx, chunk=chunk, int8=int8, stream=True, pinned=pins,
               decode=decode, link_experts=link, decode_extras=extras, min_gpu_tokens=int(min_gpu_tokens))
    n_pin = sum(len(v) for v in pins.values())
    if not counts:
        how = "spread evenly: no routing statistics yet"
    elif st.pins_by == "counts":
        how = _PINS_BY["counts"]
    else:
        how = "consecutive ids: the saved routing's hottest would save the decode less than their copies cost a prefill"
    return dataclasses.replace(
        pl, why=f"streamed experts ({n_pin} pinned, {how}): {pl.footprint.describe()} in a budget of "
                f"{budget / GiB:.2f} GiB{kept}; "
                f"GPU prefill for passes of >= {min_gpu_tokens} tokens ({chunk} per pass); {dec_why}"
                + (f", {link} experts per layer fetched over the link" if link else "")
                + (f", {sum(map(len, extras.values()))} more kept in the staging for the decode" if extras else ""))


# repin: re-choose the pinned experts once the routing counted since they were chosen (at least REPIN_MIN_ROUTES
# (token, slot) routes per expert on average) would have the best pins for the same bytes take REPIN_DRIFT more of the
# routed work (pinned_share) than the current ones. Each repin uploads the pins again between requests
# (GpuModel.apply), by DMA from the page-locked map: 108 ms for 1,716 pins (3.07 GiB) of the 35B-A3B, H200.
REPIN_DRIFT = 0.05
REPIN_MIN_ROUTES = 64


def repin(file, placement: Placement, counts: dict) -> Placement | None:
    """Between requests: `placement` with its pins re-chosen for the routing `counts` ({layer: counts per expert})
    counted since they were chosen (GpuModel.recent_routes), and the decode extras re-chosen around them, where the
    best pins for the same bytes would take REPIN_DRIFT more of the routed work than the current ones (pins_drift);
    None when too few routes were counted, the drift is small, the placement does not stream under a budget, or the
    new layout does not fit it (its granules)."""
    if not placement.stream or placement.budget is None:
        return None
    hp = file.hparams
    seen = sum(int(c.sum()) for c in counts.values())
    if seen < REPIN_MIN_ROUTES * hp.n_expert * max(len(layer_expert_bytes(file)), 1):
        return None
    drift, best = pins_drift(file, placement.pinned, counts)
    if drift < REPIN_DRIFT:
        return None
    slots = placement.link_experts + placement.early_experts
    extras = choose_decode_extras(file, best, counts, slots) if placement.decode_extras else {}
    try:
        return place(file, budget=placement.budget, n_ctx=placement.n_ctx, chunk=placement.chunk, int8=placement.int8,
                     stream=True, pinned=best, decode=placement.decode, link_experts=placement.link_experts,
                     early_experts=placement.early_experts, decode_extras=extras,
                     min_gpu_tokens=placement.min_gpu_tokens, why=placement.why, reserved=placement.reserved)
    except PlanningError:             # the new layout's granules do not fit: keep the pins there are
        return None


# ================================================================================================ routing statistics

ROUTING_DIR = "routing"      # $LE_CACHE_DIR/routing/<model fingerprint>.json: {layer: [count per expert]}


def routing_path(model) -> str:
    d = os.path.join(cache_dir(), ROUTING_DIR)
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, model_fingerprint(model).hex()[:32] + ".json")


def load_routing(model) -> dict | None:
    """The routing counts saved for this model file ({layer: np.ndarray[n_expert]}), or None. model: a Model or a
    ModelFile. A file that does not fit the model (layers, experts) or does not parse is ignored (counts are advice,
    never required)."""
    path = routing_path(model)
    if not os.path.exists(path):
        return None
    hp = getattr(model, "file", model).hparams
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        out = {int(k): np.asarray(v, dtype=np.int64) for k, v in raw.items()}
    except (OSError, ValueError, TypeError):
        return None
    if any(not 0 <= i < hp.n_layer or v.shape != (hp.n_expert,) or (v < 0).any() for i, v in out.items()):
        return None
    return out


def save_routing(model, counts: dict) -> str:
    """Adds `counts` ({layer: counts per expert}) to the saved statistics of this model file; returns the path."""
    old = load_routing(model) or {}
    total = {i: (old.get(i, 0) + np.asarray(c, dtype=np.int64)) for i, c in counts.items()}
    for i, c in old.items():
        total.setdefault(i, c)
    path = routing_path(model)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({str(i): [int(x) for x in c] for i, c in sorted(total.items())}, f)
    os.replace(path + ".tmp", path)
    return path
