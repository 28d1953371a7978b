"""How a GPU model runs (GpuOptions): kernels, precision, launch plans, the routed experts' form, the hybrid decode's
lookahead, where the routing statistics go. Where everything lives is the Placement's (placement.py), not these."""
from __future__ import annotations

import dataclasses
from typing import Callable

from .toolchain import TIERS


def default_tier(arch: int) -> str:
    """The fastest tier a GPU of compute capability arch (x10) runs natively."""
    if arch >= TIERS["dp4a"][1]:
        return "dp4a"
    return "kepler" if arch >= TIERS["kepler"][1] else "fermi"


@dataclasses.dataclass(frozen=True)
class GpuOptions:
    """tier: 'fermi' | 'kepler' | 'dp4a' (default: the GPU's own, model.default_tier); arch: the PTX target
    (compute capability x10, default the GPU's: 35, 61 or 70 run the legacy PTX on a newer card); toolchain: how
    the PTX is built (toolchain.get_ptx).
    int8: DP4A decode GEMVs on Q8_1 activations (default: on for the dp4a tier).
    int8_prefill: passes of several tokens run the quantised weights as int8 GEMMs too (gemm_dp4a: activations
    quantised to Q8_1 once per input, as decode does), default = int8. The f32 GEMM (gemm_f32) is the alternative:
    1.3-1.4x slower on an H100 (q4_K, same run), no activation rounding.
    mma: the tensor cores: the int8 GEMMs (gemm_mma: the same bits as gemm_dp4a), the attention prefill's
    products (f16 hi + lo halves, f32 grade: attn_prefill_mma_f32) and the chunked GDN scan's (tf32 hi + lo, f32
    grade: gdn_chunk_scan_tf32, sm_80+), default on where the kernels have them (dp4a tier, sm_75+: T4 and newer);
    False keeps gemm_dp4a and the f32 FMA attention and scan (a card whose tensor cores are throttled).
    plan: decode steps replay a recorded LaunchPlan (the first step of a state records it; the token and position go
    to the GPU, every argument stays fixed): ~1 µs of Python per launch instead of ~30.
    graphs: the plan also runs as one CUDA graph (one host call per token). Default: on where the driver has graphs
    (11.4+), off for the fermi tier (a Fermi driver stops at CUDA 9.1); True where the driver lacks them is an error.
    sort_pairs: passes of several tokens run the routed experts' (token, expert) GEMVs in expert order (x rows
    gathered per pair, outputs scattered back), so the blocks reading one expert run together and share its weights
    in L2 (one host sync per MoE layer to read the routing).
    grouped_experts: with sort_pairs, passes of several tokens run the routed experts as one grouped GEMM per matrix
    (gemm_f32_<type>_ids: tiles of up to 32 tokens of one expert, weights read once per tile, f32 activations)
    instead of one GEMV per (token, expert) pair. On by default: 1,120 vs 1,001 tok/s (pp2048, same run, 35B-A3B
    Q4_K_M streamed under 6 GiB, H100, 2026-11-25; `bench split --strategies stream/grouped,stream/pairs`).
    lookahead (hybrid decode, f32 routers as in every llama.cpp file; off by default: measured no faster, see
    hybrid.LOOKAHEAD_PRED): each MoE layer also predicts the next one's experts (hybrid_predict), which the CPU loads
    into its caches while the GPU runs that layer's attention/GDN (le_hybrid_serve's prefetch); the link experts are
    then the ones predicted last. The same experts and sums either way; only where they run and how soon.
    save_routing: called with the routing counts of the model's passes ({layer: counts per expert}) by
    flush_routing (close(), the Engine at exit): the planner's save_routing of the model's file, from which the
    next placement pins the hottest experts; None: not kept.
    simulate_link: GB/s; streamed expert copies are paced to it (the host waits until a copy would have finished on
    that link), to run a slow card's split (a CMP 100-210 on PCIe Gen1 x1: 0.25) on a fast one.
    progress: wraps the list of tensor names the upload walks (a progress bar)."""
    tier: str | None = None
    arch: int | None = None
    toolchain: str = "auto"
    int8: bool | None = None
    int8_prefill: bool | None = None
    mma: bool | None = None
    plan: bool = True
    graphs: bool | None = None
    sort_pairs: bool = True
    grouped_experts: bool = True
    lookahead: bool | None = None
    save_routing: Callable[[dict], None] | None = None
    simulate_link: float | None = None
    progress: Callable | None = None

    def precision(self, arch: int) -> tuple[bool, bool]:
        """(int8, int8_prefill) of a GPU model with these options on a device of compute capability arch (x10): the
        DP4A decode GEMVs by default on the dp4a tier, the prefill's GEMMs as the decode's unless set. Either on: its
        placement plans scratch for Q8_1 activations."""
        tier = self.tier or default_tier(arch)
        int8 = (tier == "dp4a") if self.int8 is None else bool(self.int8)
        return int8, int8 if self.int8_prefill is None else bool(self.int8_prefill)
