"""The cuda8 kernels of one variant (tier, arch) as ops: each launcher checks its buffers' sizes and launches with
the geometry each source's header states (launch.py reads it from the sources' #defines). The matmuls are in
matmul.py (MatmulLaunchers, a part of Kernels); the layer ops around them here."""
from __future__ import annotations

import math

import numpy as np

from ..core.errors import UnavailableError
from .launch import (ARGMAX_MAX_PARTS, ARGMAX_THREADS, ATTN_M_Q, ATTN_M_THREADS, ATTN_MAX_HD, ATTN_MAX_SPLIT,
                     ATTN_MIN_KEYS_PER_SPLIT, ATTN_P_THREADS, ATTN_PREFILL_THREADS, ATTN_QTILE, ATTN_T_D, ATTN_T_Q,
                     ATTN_T_THREADS, ATTN_THREADS, ATTN_WARPS, CONV_MAX_K, CONV_THREADS, CONV_TOKENS, EW_THREADS,
                     GDNC_C, GDNC_COLS, GDNC_MAX_DK, GDNC_THREADS, GDN_COLS, GDN_EW_THREADS, GDN_MAX_DK,
                     GDN_NORM_THREADS, GDN_THREADS, GEMM_TT, GET_ROWS_THREADS, MAX_GRID, MAX_PAIRS,
                     MOE_COMBINE_THREADS, MOE_MAX_K, MOE_SORT_MAX_E, MOE_SORT_MAX_TILE, MOE_SORT_THREADS, MOE_THREADS,
                     MOE_WSUM_MIN, PEAK_CHAINS, PEAK_MMA_CHAINS, PEAK_THREADS, Q8_1_BYTES, Q8_THREADS,
                     RMSNORM_THREADS, ROPE_MAX_HD, ROPE_THREADS, SAMPLE_BINS, SAMPLE_BINS_PER_NAT, SAMPLE_DRAW_AT,
                     SAMPLE_DRAW_BLOCK, SAMPLE_HEAD, SAMPLE_MAX_PARTS, SAMPLE_THREADS, SAMPLE_WORK_BYTES,
                     _inv_sqrt_f32, _need, _ptr, attn_planes_bytes, attn_planes_keys)
from .matmul import MatmulLaunchers
from .runtime import Buffer, BufferView, Module, Stream, _ensure_open, _native, device_arch
from .sync_kernels import SyncLaunchers
from .toolchain import SOURCES, check_variant, get_ptx, has_mma, has_tf32, many_regs, variant_name
from .vision_kernels import VisionLaunchers


# The tiers whose passes of several tokens run the GDN in its chunked form (gdn_chunked): where it measured at least as
# fast as the recurrence (H200, 35B-A3B layer, 2048 tokens: 1.145 vs 1.247 ms). Fermi keeps the recurrence: its 63
# registers force the chunked scan's loops rolled (1.797 vs 1.379 ms). benchmarks/results/gdn_chunked_2026-11-29.md.
GDN_CHUNKED_TIERS = frozenset({"kepler", "dp4a"})
# The tiers whose attention prefill runs attn_prefill_tiled_f32 (register tiles: 64 accumulators a thread, more than
# Fermi's 63 registers hold; there the one-query-per-warp attn_prefill_f32). Head sizes a multiple of ATTN_T_D.
ATTN_TILED_TIERS = frozenset({"kepler", "dp4a"})


class Kernels(MatmulLaunchers, VisionLaunchers, SyncLaunchers):
    """The cuda8 kernels of one variant (tier, arch) on the open device.

    Each op checks shapes and buffer sizes before launching (an out-of-bounds kernel would take the
    whole context down) and launches on `stream` (default stream when None) without waiting."""

    def __init__(self, tier: str, arch: int | None = None, toolchain: str = "auto"):
        _ensure_open()
        self.arch = device_arch(_native().gpu_current_device()) if arch is None else int(arch)
        self.tier = tier
        check_variant(tier, self.arch)
        self.has_mma = has_mma(tier, self.arch)     # gemm_mma's kernels (tensor cores) are in this variant
        self.many_regs = many_regs(tier)            # the register-hungry forms: gemm_multi, the GDN prep ahead
        self.has_tf32 = has_tf32(tier, self.arch)   # the GDN scan on tf32 tensor cores (gdn_chunk_scan_tf32)
        # the open device's SMs (launch shapes that leave SMs idle pick smaller tiles: gemm_mma)
        self.sm_count = _native().gpu_info()["devices"][_native().gpu_current_device()]["multiprocessors"]
        self.modules: dict[str, Module] = {}
        self.origins: dict[str, str] = {}
        for name in SOURCES:
            ptx, origin = get_ptx(name, tier, self.arch, toolchain)
            self.modules[name] = Module(ptx, f"{name}.{variant_name(tier, self.arch)}")
            self.origins[name] = origin

    @property
    def name(self) -> str:
        return variant_name(self.tier, self.arch)

    def probe(self, source: str = "gemv_f32") -> dict:
        """What a module was compiled as: {'arch', 'tier_cc', 'compiler', 'features'} (le_tier_probe)."""
        with Buffer(16, "probe") as out:
            self.modules[source].kernel("le_tier_probe").launch((1, 1, 1), (32, 1, 1), [("ptr", out)])
            v = out.download(dtype=np.int32, count=4)
        feats = [f for bit, f in ((1, "shfl"), (2, "ldg"), (4, "dp4a"), (8, "sync"),
                                                  (16, "mma")) if v[3] & bit]
        return {"arch": int(v[0]), "tier_cc": int(v[1]), "compiler": int(v[2]), "features": feats}

    @staticmethod
    def _grid(n_units: int) -> int:
        return max(1, min(n_units, MAX_GRID))

    def rmsnorm(self, x, w, y, ncols: int, nrows: int, eps: float, stream: Stream | None = None) -> None:
        """x, y: [nrows, ncols] f32 (y may be x); w: [ncols] f32 or None."""
        _need(x, 4 * ncols * nrows, "rmsnorm x")
        _need(y, 4 * ncols * nrows, "rmsnorm y")
        _need(w, 4 * ncols, "rmsnorm w")
        self.modules["rmsnorm"].kernel("rmsnorm_f32").launch(
            (self._grid(nrows), 1, 1), (RMSNORM_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(y)), ("i32", ncols), ("i32", nrows), ("f32", eps)],
            stream=stream)

    def add_rmsnorm(self, x, y, w, h, hq, ncols: int, nrows: int, eps: float, stream: Stream | None = None) -> None:
        """x [nrows, ncols] += y (None: no add); h = rmsnorm(x) * w (w None: no weight); hq: None, or h as
        [nrows * ncols / 32] block_q8_1 (GPU layout). One launch, bit-identical to add, rmsnorm, quantize_q8_1."""
        if hq is not None and ncols % 32:
            raise ValueError(f"add_rmsnorm: ncols = {ncols} is not a multiple of 32 (Q8_1 blocks)")
        for b, nb, what in ((x, 4 * ncols * nrows, "x"), (y, 4 * ncols * nrows, "y"), (w, 4 * ncols, "w"),
                            (h, 4 * ncols * nrows, "h"), (hq, ncols * nrows // 32 * Q8_1_BYTES, "hq")):
            _need(b, nb, f"add_rmsnorm {what}")
        self.modules["rmsnorm"].kernel("add_rmsnorm_f32").launch(
            (self._grid(nrows), 1, 1), (RMSNORM_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(y)), ("ptr", _ptr(w)), ("ptr", _ptr(h)), ("ptr", _ptr(hq)),
             ("i32", ncols), ("i32", nrows), ("f32", eps)], stream=stream)

    def quantize_q8_1(self, x, y, n: int, stream: Stream | None = None) -> None:
        """x: [n] f32 (n % 32 == 0) -> y: [n/32] block_q8_1, GPU layout (d, s = sum of x)."""
        if n % 32:
            raise ValueError(f"quantize_q8_1: n = {n} is not a multiple of 32")
        _need(x, 4 * n, "quantize_q8_1 x")
        _need(y, n // 32 * Q8_1_BYTES, "quantize_q8_1 y")
        self.modules["quantize_q8_1"].kernel("quantize_q8_1").launch(
            (self._grid(-(-n // Q8_THREADS)), 1, 1), (Q8_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(y)), ("i32", n)], stream=stream)

    def swiglu_q8_1(self, g, u, y, n: int, stream: Stream | None = None) -> None:
        """y: [n/32] block_q8_1 of SiLU(g) * u (g, u: [n] f32, n % 32 == 0): swiglu then quantize_q8_1, bit for bit,
        in one launch."""
        if n % 32:
            raise ValueError(f"swiglu_q8_1: n = {n} is not a multiple of 32")
        _need(g, 4 * n, "swiglu_q8_1 g")
        _need(u, 4 * n, "swiglu_q8_1 u")
        _need(y, n // 32 * Q8_1_BYTES, "swiglu_q8_1 y")
        self.modules["quantize_q8_1"].kernel("swiglu_q8_1").launch(
            (self._grid(-(-n // Q8_THREADS)), 1, 1), (Q8_THREADS, 1, 1),
            [("ptr", _ptr(g)), ("ptr", _ptr(u)), ("ptr", _ptr(y)), ("i32", n)], stream=stream)

    # The products of the prefill GEMMs (their module) -> the peak kernel of the same instruction and the operations
    # one thread's iteration of it counts (cuda8/peak.cu: 2 per multiply-add; a warp's m16n8k16 is 4096).
    PEAK_OF = {"gemm_f32": ("peak_fma_f32", 2 * PEAK_CHAINS), "gemm_dp4a": ("peak_dp4a_s8", 8 * PEAK_CHAINS),
               "gemm_mma": ("peak_mma_s8", 4096 // 32 * PEAK_MMA_CHAINS)}

    def peak(self, gemm: str, out, blocks: int, iters: int, stream: Stream | None = None) -> int:
        """Runs the peak kernel of `gemm`'s instruction (PEAK_OF) on `blocks` blocks of PEAK_THREADS, `iters` steps
        each; out: [blocks * PEAK_THREADS] f32 / int32 (each thread's sums: c + iters for the FMA chains, 4 * iters
        + c for dp4a's, 16 * iters per accumulator for mma's). -> the operations it ran."""
        kernel, per_iter = self.PEAK_OF[gemm]
        if gemm == "gemm_mma" and not self.has_mma:
            raise UnavailableError(f"peak: the {self.name} kernels have no int8 mma")
        if not 0 < blocks <= MAX_GRID or iters <= 0:
            raise ValueError(f"peak: blocks = {blocks} (1…{MAX_GRID}), iters = {iters}")
        _need(out, 4 * blocks * PEAK_THREADS, "peak out")
        a, b = (("f32", 1.0), ("f32", 1.0)) if gemm == "gemm_f32" else (("i32", 0x01010101), ("i32", 0x01010101))
        self.modules["peak"].kernel(kernel).launch((blocks, 1, 1), (PEAK_THREADS, 1, 1),
                                                   [("ptr", _ptr(out)), ("i32", iters), a, b], stream=stream)
        return per_iter * iters * blocks * PEAK_THREADS

    # ---- the layer ops after the matmuls (cuda8/conv1d.cu, gdn.cu, attention.cu, moe_route.cu, argmax.cu,
    # elementwise.cu); every tensor f32 unless said, shapes as in each file's header.

    def conv1d_silu(self, x, w, state, y, n: int, conv_dim: int, K: int, stream: Stream | None = None) -> None:
        """y[n, conv_dim] = SiLU(causal depthwise conv of [state; x] with w[conv_dim, K]); state[K-1, conv_dim]
        (oldest row first) becomes the last K-1 rows of [state; x]. y must not be x."""
        if not 1 <= K <= CONV_MAX_K:
            raise ValueError(f"conv1d: K = {K} outside 1…{CONV_MAX_K}")
        if n <= 0 or conv_dim <= 0:
            raise ValueError(f"conv1d: n = {n}, conv_dim = {conv_dim}")
        if _ptr(x) == _ptr(y):
            raise ValueError("conv1d: y must not be x (later tokens read x after earlier ones are written)")
        _need(x, 4 * n * conv_dim, "conv1d x")
        _need(y, 4 * n * conv_dim, "conv1d y")
        _need(w, 4 * conv_dim * K, "conv1d w")
        _need(state, 4 * max(K - 1, 1) * conv_dim, "conv1d state")
        gx = -(-conv_dim // CONV_THREADS)
        mod = self.modules["conv1d"]
        mod.kernel("conv1d_silu_f32").launch(
            (gx, self._grid(-(-n // CONV_TOKENS)), 1), (CONV_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(state)), ("ptr", _ptr(y)), ("i32", n),
             ("i32", conv_dim), ("i32", K)], stream=stream)
        mod.kernel("conv1d_state_f32").launch(
            (gx, 1, 1), (CONV_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(state)), ("i32", n), ("i32", conv_dim), ("i32", K)], stream=stream)

    def gdn_gates(self, beta, g, dt_bias, ssm_a, n: int, Hv: int, stream: Stream | None = None) -> None:
        """In place, [n, Hv] each: beta <- sigmoid(beta); g <- softplus(g + dt_bias) * ssm_a (the log decay)."""
        _need(beta, 4 * n * Hv, "gdn_gates beta")
        _need(g, 4 * n * Hv, "gdn_gates g")
        _need(dt_bias, 4 * Hv, "gdn_gates dt_bias")
        _need(ssm_a, 4 * Hv, "gdn_gates ssm_a")
        self.modules["gdn"].kernel("gdn_gates_f32").launch(
            (self._grid(-(-n * Hv // GDN_EW_THREADS)), 1, 1), (GDN_EW_THREADS, 1, 1),
            [("ptr", _ptr(beta)), ("ptr", _ptr(g)), ("ptr", _ptr(dt_bias)), ("ptr", _ptr(ssm_a)), ("i32", n),
             ("i32", Hv)], stream=stream)

    def conv1d_step_l2norm(self, x, w, state, y, conv_dim: int, K: int, Hk: int, dk: int, eps: float = 1e-6,
                           stream: Stream | None = None) -> None:
        """One token's conv1d_silu (its state updated) and gdn_l2norm_qk on y in one launch, the same bits as the
        three: y[conv_dim] (q | k | v) from x[conv_dim]; dk <= CONV_THREADS (a q or k head a block)."""
        if not 1 <= K <= CONV_MAX_K or not 0 < dk <= CONV_THREADS or Hk <= 0 or conv_dim < 2 * Hk * dk:
            raise ValueError(f"conv1d_step_l2norm: K = {K} (1…{CONV_MAX_K}), dk = {dk} (1…{CONV_THREADS}), "
                             f"Hk = {Hk}, conv_dim = {conv_dim} (>= 2 Hk dk)")
        if _ptr(x) == _ptr(y):
            raise ValueError("conv1d_step_l2norm: y must not be x")
        _need(x, 4 * conv_dim, "conv1d_step_l2norm x")
        _need(y, 4 * conv_dim, "conv1d_step_l2norm y")
        _need(w, 4 * conv_dim * K, "conv1d_step_l2norm w")
        _need(state, 4 * max(K - 1, 1) * conv_dim, "conv1d_step_l2norm state")
        qscale = _inv_sqrt_f32(dk)      # gdn_l2norm_qk's default
        self.modules["conv1d"].kernel("conv1d_step_l2norm_f32").launch(
            (2 * Hk + -(-(conv_dim - 2 * Hk * dk) // CONV_THREADS), 1, 1), (CONV_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(state)), ("ptr", _ptr(y)), ("i32", conv_dim),
             ("i32", K), ("i32", Hk), ("i32", dk), ("f32", qscale), ("f32", eps)], stream=stream)

    def gdn_l2norm_qk(self, u, n: int, conv_dim: int, Hk: int, dk: int, eps: float = 1e-6,
                      qscale: float | None = None, stream: Stream | None = None) -> None:
        """In place on u[n, conv_dim] (q | k | v per row): each of the Hk q and Hk k heads of dk <- l2-normalised
        (x / sqrt(sum x^2 + eps)), q heads then * qscale (default 1/sqrt(dk) in f32, as gdn.c)."""
        if conv_dim < 2 * Hk * dk:
            raise ValueError(f"gdn_l2norm_qk: conv_dim {conv_dim} < 2 * {Hk} * {dk}")
        _need(u, 4 * n * conv_dim, "gdn_l2norm_qk u")
        qscale = _inv_sqrt_f32(dk) if qscale is None else qscale
        self.modules["gdn"].kernel("gdn_l2norm_qk_f32").launch(
            (self._grid(n * 2 * Hk), 1, 1), (GDN_NORM_THREADS, 1, 1),
            [("ptr", _ptr(u)), ("i32", n), ("i32", conv_dim), ("i32", Hk), ("i32", dk), ("f32", qscale),
             ("f32", eps)], stream=stream)

    def gdn_recurrent(self, u, g, beta, S, o, n: int, Hk: int, Hv: int, dk: int, dv: int, tiled: bool = True,
                      dt_bias=None, ssm_a=None, stream: Stream | None = None) -> None:
        """The delta rule over n tokens: u [n, 2*Hk*dk + Hv*dv] (normalised q | k | v), g and beta [n, Hv],
        S [Hv, dk, dv] updated in place, o [n, Hv*dv]. v-head j reads k-head j % Hk (tiled, qwen35*) or
        j / (Hv/Hk) (qwen3next). dt_bias, ssm_a [Hv]: g and beta are the raw projections and the gates (gdn_gates)
        are taken here; None: already gated."""
        if not 0 < dk <= GDN_MAX_DK:
            raise ValueError(f"gdn_recurrent: dk = {dk} outside 1…{GDN_MAX_DK}")
        if Hk <= 0 or Hv % Hk or dv <= 0 or n <= 0:
            raise ValueError(f"gdn_recurrent: Hv = {Hv} is not a multiple of Hk = {Hk} (or dv = {dv}, n = {n})")
        conv_dim = 2 * Hk * dk + Hv * dv
        _need(u, 4 * n * conv_dim, "gdn_recurrent u")
        _need(g, 4 * n * Hv, "gdn_recurrent g")
        _need(beta, 4 * n * Hv, "gdn_recurrent beta")
        _need(S, 4 * Hv * dk * dv, "gdn_recurrent S")
        _need(o, 4 * n * Hv * dv, "gdn_recurrent o")
        if (dt_bias is None) != (ssm_a is None):
            raise ValueError("gdn_recurrent: the gates need both dt_bias and ssm_a")
        if dt_bias is not None:
            _need(dt_bias, 4 * Hv, "gdn_recurrent dt_bias")
            _need(ssm_a, 4 * Hv, "gdn_recurrent ssm_a")
        self.modules["gdn"].kernel("gdn_recurrent_f32").launch(
            (Hv, -(-dv // GDN_COLS), 1), (GDN_THREADS, 1, 1),
            [("ptr", _ptr(u)), ("ptr", _ptr(g)), ("ptr", _ptr(beta)), ("ptr", _ptr(S)), ("ptr", _ptr(o)),
             ("i32", n), ("i32", conv_dim), ("i32", Hk), ("i32", Hv), ("i32", dk), ("i32", dv),
             ("i32", int(bool(tiled))), ("ptr", _ptr(dt_bias)), ("ptr", _ptr(ssm_a))], stream=stream)

    def gdn_scan_tf32(self, dk: int, conv_dim: int) -> bool:
        """Whether gdn_chunked's scan can run on tf32 tensor cores for these shapes (gdn_chunk_scan_tf32: the variant
        has_tf32, dk a multiple of 16, u's rows of a multiple of 4 floats; the buffers 16-byte aligned besides)."""
        return self.has_tf32 and dk % 16 == 0 and conv_dim % 4 == 0

    def gdn_chunked(self, u, g, beta, S, o, n: int, Hk: int, Hv: int, dk: int, dv: int, work: tuple,
                    tiled: bool = True, stream: Stream | None = None, prep_ahead: bool | None = None,
                    mma: bool | None = None) -> None:
        """gdn_recurrent's rule over n tokens in chunks of GDNC_C (cuda8/gdn_chunked.cu; chunks counted from the first
        token), g and beta already gated. work: (W [n, Hv, dk], U [n, Hv, dv], P [chunks, Hv, C, C], G [n, Hv]) f32
        buffers (layout.gdn_chunk_work). prep_ahead: the prep's form (the same bits): None chooses by the grid.
        mma: the scan's products on tf32 tensor cores at f32 grade (gdn_chunk_scan_tf32, cuda8/gdn_scan_tf32.cu:
        other bits, within the same bound); None: where gdn_scan_tf32 allows these shapes and u, W and P are 16-byte
        aligned; False: the f32 FMA scan."""
        if not 0 < dk <= GDNC_MAX_DK:
            raise ValueError(f"gdn_chunked: dk = {dk} outside 1…{GDNC_MAX_DK}")
        if Hk <= 0 or Hv % Hk or dv <= 0 or n <= 0:
            raise ValueError(f"gdn_chunked: Hv = {Hv} is not a multiple of Hk = {Hk} (or dv = {dv}, n = {n})")
        conv_dim = 2 * Hk * dk + Hv * dv
        W, U, P, G = work
        for buf, nbytes, what in ((u, 4 * n * conv_dim, "u"), (g, 4 * n * Hv, "g"), (beta, 4 * n * Hv, "beta"),
                                  (S, 4 * Hv * dk * dv, "S"), (o, 4 * n * Hv * dv, "o"), (W, 4 * n * Hv * dk, "W"),
                                  (U, 4 * n * Hv * dv, "U"), (P, 4 * -(-n // GDNC_C) * Hv * GDNC_C ** 2, "P"),
                                  (G, 4 * n * Hv, "G")):
            _need(buf, nbytes, f"gdn_chunked {what}")
        mod, shape = self.modules["gdn_chunked"], [("i32", n), ("i32", conv_dim), ("i32", Hk), ("i32", Hv),
                                                    ("i32", dk), ("i32", dv), ("i32", int(bool(tiled)))]
        chunks = -(-n // GDNC_C)
        # a grid of at most a block an SM (a short pass) waits on each tile's loads: the form that issues them a tile
        # ahead (two blocks an SM, the same bits); more blocks hide the loads, and the plain form's four an SM do
        ahead = self.many_regs and chunks * Hv <= self.sm_count if prep_ahead is None else prep_ahead
        if ahead and not self.many_regs:
            raise UnavailableError(f"gdn_chunked: the {self.name} kernels have no prep ahead (toolchain.many_regs)")
        mod.kernel("gdn_chunk_prep_ahead_f32" if ahead else "gdn_chunk_prep_f32").launch(
            (chunks, Hv, 1), (GDNC_THREADS, 1, 1),
            [("ptr", _ptr(u)), ("ptr", _ptr(g)), ("ptr", _ptr(beta)), ("ptr", _ptr(W)), ("ptr", _ptr(U)),
             ("ptr", _ptr(P)), ("ptr", _ptr(G))] + shape, stream=stream)
        # its fragments are 16-byte loads of u's rows, W's and P's
        tf32_ok = self.gdn_scan_tf32(dk, conv_dim) and not (_ptr(u) | _ptr(W) | _ptr(P)) % 16
        if mma is None:
            mma = tf32_ok
        elif mma and not tf32_ok:
            raise UnavailableError(f"gdn_chunked: the tf32 scan needs the dp4a tier at compute_80+, dk a multiple of "
                                   f"16 and 16-byte aligned rows, not {self.name} with dk = {dk}, conv_dim = "
                                   f"{conv_dim}")
        scan = self.modules["gdn_scan_tf32"].kernel("gdn_chunk_scan_tf32") if mma else mod.kernel("gdn_chunk_scan_f32")
        scan.launch(
            (Hv, -(-dv // GDNC_COLS), 1), (GDNC_THREADS, 1, 1),
            [("ptr", _ptr(u)), ("ptr", _ptr(W)), ("ptr", _ptr(U)), ("ptr", _ptr(P)), ("ptr", _ptr(G)),
             ("ptr", _ptr(S)), ("ptr", _ptr(o))] + shape, stream=stream)

    def gdn_gated_rmsnorm(self, o, z, w, y, nrows: int, dv: int, eps: float, yq=None,
                          stream: Stream | None = None) -> None:
        """y = RMSNorm(o) * w * SiLU(z) per row of dv (nrows = n * Hv); y may be o. yq: also y's Q8_1 blocks (the
        out projection's int8 input), bit-identical to quantize_q8_1 of y."""
        _need(o, 4 * nrows * dv, "gdn_gated_rmsnorm o")
        _need(z, 4 * nrows * dv, "gdn_gated_rmsnorm z")
        _need(y, 4 * nrows * dv, "gdn_gated_rmsnorm y")
        _need(w, 4 * dv, "gdn_gated_rmsnorm w")
        if yq is not None:
            if dv % 32:
                raise ValueError(f"gdn_gated_rmsnorm: Q8_1 rows need dv % 32 == 0, dv = {dv}")
            _need(yq, nrows * dv // 32 * Q8_1_BYTES, "gdn_gated_rmsnorm yq")
        self.modules["gdn"].kernel("gdn_gated_rmsnorm_f32").launch(
            (self._grid(nrows), 1, 1), (GDN_NORM_THREADS, 1, 1),
            [("ptr", _ptr(o)), ("ptr", _ptr(z)), ("ptr", _ptr(w)), ("ptr", _ptr(y)), ("ptr", _ptr(yq)), ("i32", nrows),
             ("i32", dv), ("f32", eps)], stream=stream)

    @staticmethod
    def _attn_shape(n_head: int, n_kv: int, hd: int, what: str) -> None:
        if hd <= 0 or hd % 32 or hd > ATTN_MAX_HD:
            raise ValueError(f"{what}: head size {hd} is not a multiple of 32 in 32…{ATTN_MAX_HD}")
        if n_kv <= 0 or n_head % n_kv:
            raise ValueError(f"{what}: n_head = {n_head} is not a multiple of n_kv = {n_kv}")

    @staticmethod
    def attn_splits(n_keys: int) -> tuple[int, int]:
        """Decode split-K: (n_split, keys_per_split): at least ATTN_MIN_KEYS_PER_SPLIT keys a split (a multiple
        of the block's warps), at most ATTN_MAX_SPLIT splits."""
        kps = max(ATTN_MIN_KEYS_PER_SPLIT, -(-n_keys // ATTN_MAX_SPLIT))
        kps = -(-kps // ATTN_WARPS) * ATTN_WARPS
        return max(1, -(-n_keys // kps)), kps

    @staticmethod
    def attn_partials_bytes(n_head: int, hd: int, n_split: int) -> int:
        """Bytes of the f32 partials of attention_decode: [n_head, n_split, hd + 2]."""
        return 4 * n_head * n_split * (hd + 2)

    def attention_decode(self, qg, kc, vc, o, part, n_keys: int, n_head: int, n_kv: int, hd: int,
                         scale: float | None = None, n_split: int | None = None, pos_dev=None,
                         stream: Stream | None = None) -> None:
        """One query token: qg [n_head * 2 * hd] (q_h then gate_h per head), kc/vc [>= n_keys, n_kv * hd],
        o [n_head * hd] = softmax(scale q K^T) V * sigmoid(gate), split-K over n_split blocks per head
        (default attn_splits) with f32 partials in `part` (attn_partials_bytes) merged by log-sum-exp.
        pos_dev: a device int32 p; the kernels then take n_keys = p + 1 from it (n_keys here is only the
        bound the buffers are checked against) and split the keys over at most n_split blocks of at least
        ATTN_MIN_KEYS_PER_SPLIT keys (a short context uses few splits; the merge reads only those)."""
        self._attn_shape(n_head, n_kv, hd, "attention_decode")
        if n_keys <= 0:
            raise ValueError(f"attention_decode: n_keys = {n_keys}")
        if n_split is None:
            n_split, kps = self.attn_splits(n_keys)
        else:
            if not 0 < n_split <= MAX_GRID:
                raise ValueError(f"attention_decode: n_split = {n_split} outside 1…{MAX_GRID}")
            kps = -(-n_keys // n_split)
        scale = _inv_sqrt_f32(hd) if scale is None else scale
        _need(qg, 4 * n_head * 2 * hd, "attention_decode qg")
        _need(kc, 4 * n_keys * n_kv * hd, "attention_decode kc")
        _need(vc, 4 * n_keys * n_kv * hd, "attention_decode vc")
        _need(o, 4 * n_head * hd, "attention_decode o")
        _need(part, self.attn_partials_bytes(n_head, hd, n_split), "attention_decode partials")
        mod = self.modules["attention"]
        mod.kernel("attn_decode_partial_f32").launch(
            (n_head, n_split, 1), (ATTN_THREADS, 1, 1),
            [("ptr", _ptr(qg)), ("ptr", _ptr(kc)), ("ptr", _ptr(vc)), ("ptr", _ptr(part)), ("i32", n_keys),
             ("i32", n_head), ("i32", n_kv), ("i32", hd), ("f32", scale), ("i32", kps), ("ptr", _ptr(pos_dev))],
            stream=stream)
        mod.kernel("attn_decode_merge_f32").launch(
            (n_head, 1, 1), (ATTN_THREADS, 1, 1),
            [("ptr", _ptr(part)), ("ptr", _ptr(qg)), ("ptr", _ptr(o)), ("i32", n_head), ("i32", hd),
             ("i32", n_split), ("ptr", _ptr(pos_dev))], stream=stream)

    attn_planes_bytes = staticmethod(attn_planes_bytes)

    def attention_prefill(self, qg, kc, vc, o, n: int, pos: int, n_head: int, n_kv: int, hd: int,
                          scale: float | None = None, stream: Stream | None = None, mma: bool | None = None,
                          planes=None) -> None:
        """n query tokens at positions pos … pos+n-1 (qg [n, n_head * 2 * hd]; their keys already in kc/vc
        [>= pos+n, n_kv * hd]), causal: o [n, n_head * hd]. mma: the products on f16 tensor cores at f32 grade
        (attn_kv_planes_f16 writes the keys' hi + lo halves into `planes`, attn_planes_bytes(pos + n, n_kv, hd)
        bytes, then attn_prefill_mma_f32; default where the variant has_mma and hd is a multiple of 16, and then
        planes is needed); False: the f32 FMA kernels."""
        self._attn_shape(n_head, n_kv, hd, "attention_prefill")
        if n <= 0 or pos < 0:
            raise ValueError(f"attention_prefill: n = {n}, pos = {pos}")
        if mma is None:
            mma = self.has_mma and hd % 16 == 0
        elif mma and not (self.has_mma and hd % 16 == 0):
            raise UnavailableError(f"attention_prefill: the tensor-core kernel needs the dp4a tier at compute_75+ and "
                                   f"a head size that is a multiple of 16, not {self.name} with hd = {hd}")
        scale = _inv_sqrt_f32(hd) if scale is None else scale
        _need(qg, 4 * n * n_head * 2 * hd, "attention_prefill qg")
        _need(kc, 4 * (pos + n) * n_kv * hd, "attention_prefill kc")
        _need(vc, 4 * (pos + n) * n_kv * hd, "attention_prefill vc")
        _need(o, 4 * n * n_head * hd, "attention_prefill o")
        if mma:
            n_keys = pos + n
            if planes is None:
                raise ValueError("attention_prefill: the tensor-core kernel needs its planes buffer "
                                 "(attn_planes_bytes(pos + n, n_kv, hd) bytes)")
            _need(planes, self.attn_planes_bytes(n_keys, n_kv, hd), "attention_prefill planes")
            nkp = attn_planes_keys(n_keys)
            mod = self.modules["attention"]
            mod.kernel("attn_kv_planes_f16").launch(
                (self._grid(-(-n_kv * nkp * hd // 2 // ATTN_P_THREADS)), 2, 1), (ATTN_P_THREADS, 1, 1),
                [("ptr", _ptr(kc)), ("ptr", _ptr(vc)), ("ptr", _ptr(planes)), ("i32", n_keys), ("i32", n_kv),
                 ("i32", hd), ("i32", nkp)], stream=stream)
            mod.kernel("attn_prefill_mma_f32").launch(
                (n_head, self._grid(-(-n // ATTN_M_Q)), 1), (ATTN_M_THREADS, 1, 1),
                [("ptr", _ptr(qg)), ("ptr", _ptr(planes)), ("ptr", _ptr(o)), ("i32", n), ("i32", pos),
                 ("i32", n_head), ("i32", n_kv), ("i32", hd), ("f32", scale), ("i32", nkp)], stream=stream)
            return
        args = [("ptr", _ptr(qg)), ("ptr", _ptr(kc)), ("ptr", _ptr(vc)), ("ptr", _ptr(o)), ("i32", n), ("i32", pos),
                ("i32", n_head), ("i32", n_kv), ("i32", hd), ("f32", scale)]
        if self.tier in ATTN_TILED_TIERS and hd % ATTN_T_D == 0:
            self.modules["attention"].kernel("attn_prefill_tiled_f32").launch(
                (n_head, self._grid(-(-n // ATTN_T_Q)), 1), (ATTN_T_THREADS, 1, 1), args, stream=stream)
            return
        self.modules["attention"].kernel("attn_prefill_f32").launch(
            (n_head, self._grid(-(-n // ATTN_QTILE)), 1), (ATTN_PREFILL_THREADS, 1, 1), args, stream=stream)

    def moe_route(self, logits, ids, weights, n_tok: int, n_expert: int, k: int, wsum_min: float = MOE_WSUM_MIN,
                  stream: Stream | None = None) -> None:
        """logits [n_tok, n_expert] -> ids [n_tok, k] int32 (largest first, ties to the lower index) and
        weights [n_tok, k] = the top-k softmax probabilities / max(their sum, wsum_min)."""
        if not 0 < k <= min(MOE_MAX_K, n_expert):
            raise ValueError(f"moe_route: k = {k} outside 1…min({MOE_MAX_K}, n_expert = {n_expert})")
        _need(logits, 4 * n_tok * n_expert, "moe_route logits")
        _need(ids, 4 * n_tok * k, "moe_route ids")
        _need(weights, 4 * n_tok * k, "moe_route weights")
        self.modules["moe_route"].kernel("moe_route_f32").launch(
            (self._grid(n_tok), 1, 1), (MOE_THREADS, 1, 1),
            [("ptr", _ptr(logits)), ("ptr", _ptr(ids)), ("ptr", _ptr(weights)), ("i32", n_tok), ("i32", n_expert),
             ("i32", k), ("f32", wsum_min)], stream=stream)

    @staticmethod
    def sort_tiles_max(n_pairs: int, n_expert: int, tile: int = GEMM_TT) -> int:
        """Length of moe_sort's tile list: every full tile plus at most one partial tile per expert."""
        return -(-n_pairs // tile) + min(n_expert, n_pairs)

    def moe_sort(self, ids, n_pairs: int, k: int, n_expert: int, eids, ptok, pinv, tiles, max_tiles: int, counts,
                 stream: Stream | None = None, tile: int = GEMM_TT) -> None:
        """The routing ids [n_pairs] (moe_route's [n_tok, k], each in [0, n_expert)) in expert order, stable:
        eids = ids[order], ptok = order // k, pinv[order] = arange (int32 [n_pairs] each); tiles int32
        [max_tiles, 3] = expert_tiles(eids, tile) then (0, 0, 0) rows; counts int32 [n_expert] += pairs per expert.
        max_tiles >= sort_tiles_max(n_pairs, n_expert, tile). All on the GPU (the host never waits)."""
        if not 0 < n_pairs <= MAX_PAIRS or not 0 < k <= MOE_MAX_K or not 0 < n_expert <= MOE_SORT_MAX_E:
            raise ValueError(f"moe_sort: n_pairs = {n_pairs} (1…{MAX_PAIRS}), k = {k}, n_expert = {n_expert} "
                             f"(1…{MOE_SORT_MAX_E})")
        if not 0 < tile <= MOE_SORT_MAX_TILE:
            raise ValueError(f"moe_sort: tile = {tile} outside 1…{MOE_SORT_MAX_TILE}")
        if not self.sort_tiles_max(n_pairs, n_expert, tile) <= max_tiles <= MAX_GRID:
            raise ValueError(f"moe_sort: max_tiles = {max_tiles} outside "
                             f"{self.sort_tiles_max(n_pairs, n_expert, tile)}…{MAX_GRID}")
        for b, nb, what in ((ids, 4 * n_pairs, "ids"), (eids, 4 * n_pairs, "eids"), (ptok, 4 * n_pairs, "ptok"),
                            (pinv, 4 * n_pairs, "pinv"), (tiles, 12 * max_tiles, "tiles"),
                            (counts, 4 * n_expert, "counts")):
            _need(b, nb, f"moe_sort {what}")
        self.modules["moe_sort"].kernel("moe_sort").launch(
            (1, 1, 1), (MOE_SORT_THREADS, 1, 1),
            [("ptr", _ptr(ids)), ("i32", n_pairs), ("i32", k), ("i32", n_expert), ("ptr", _ptr(eids)),
             ("ptr", _ptr(ptok)), ("ptr", _ptr(pinv)), ("ptr", _ptr(tiles)), ("i32", max_tiles),
             ("ptr", _ptr(counts)), ("i32", tile)], stream=stream)

    @staticmethod
    def argmax_parts(n: int) -> int:
        """Blocks of the first argmax pass for a row of n: ~8 elements a thread, at most ARGMAX_MAX_PARTS."""
        return max(1, min(ARGMAX_MAX_PARTS, -(-n // (ARGMAX_THREADS * 8))))

    def argmax(self, x, part, out, n: int, n_rows: int = 1, n_part: int | None = None,
               stream: Stream | None = None) -> None:
        """out[n_rows] int32 = the index of the first maximum of each row of x [n_rows, n]; part: scratch of
        8 * n_rows * n_part bytes (n_part default argmax_parts(n))."""
        n_part = self.argmax_parts(n) if n_part is None else n_part
        if not 0 < n_part <= ARGMAX_MAX_PARTS or not 0 < n_rows <= MAX_GRID or n <= 0:
            raise ValueError(f"argmax: n_part = {n_part} (1…{ARGMAX_MAX_PARTS}), n_rows = {n_rows}, n = {n}")
        _need(x, 4 * n * n_rows, "argmax x")
        _need(part, 8 * n_rows * n_part, "argmax partials")
        _need(out, 4 * n_rows, "argmax out")
        part_v, part_i = _ptr(part), _ptr(part) + 4 * n_rows * n_part
        mod = self.modules["argmax"]
        mod.kernel("argmax_partial_f32").launch(
            (n_part, n_rows, 1), (ARGMAX_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("i32", n), ("ptr", part_v), ("ptr", part_i)], stream=stream)
        mod.kernel("argmax_final_i32").launch(
            (n_rows, 1, 1), (ARGMAX_THREADS, 1, 1),
            [("ptr", part_v), ("ptr", part_i), ("i32", n_part), ("ptr", _ptr(out))], stream=stream)

    @staticmethod
    def sample_parts(n: int) -> int:
        """Blocks of sample_cut's row passes: ~16 elements a thread, at most SAMPLE_MAX_PARTS."""
        return max(1, min(SAMPLE_MAX_PARTS, -(-n // (SAMPLE_THREADS * 16))))

    @staticmethod
    def min_p_bin(min_p: float) -> int:
        """sample_cut's min-p bin: the one holding d = -log(min_p), plus one of slack; 0: off (or beyond the bins)."""
        if not min_p > 0:
            return 0
        b = int(math.floor(-math.log(min_p) * SAMPLE_BINS_PER_NAT)) + 1
        return b if b < SAMPLE_BINS - 1 else 0

    def sample_cut(self, x, work, out, n: int, top_k: int, top_p: float, min_p: float, cap: int,
                   stream: Stream | None = None) -> None:
        """The sampler's candidates of the row x[n] f32 (cuda8/sample_cut.cu): out = a SAMPLE_HEAD, then cap
        (int32 id, f32 x) pairs (the first head.n_cand written, in no order): mode 0, every token of the bins up
        to the cut; mode 1, top-p's bin alone (head.base: the mass before it). work: SAMPLE_WORK_BYTES, zero before
        the first call (each call leaves it so). top_k >= n, top_p 1, min_p 0: off."""
        if not 0 < n or not 0 < cap <= n or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"sample_cut: n = {n}, cap = {cap}, top_k = {top_k}, top_p = {top_p}")
        _need(x, 4 * n, "sample_cut x")
        _need(work, SAMPLE_WORK_BYTES, "sample_cut work")
        _need(out, SAMPLE_HEAD.itemsize + 8 * cap, "sample_cut out")
        n_part = self.sample_parts(n)
        part = _ptr(work)
        hm = part + 4 * SAMPLE_MAX_PARTS
        hc = hm + 8 * SAMPLE_BINS
        head, cand = _ptr(out), _ptr(out) + SAMPLE_HEAD.itemsize
        mod = self.modules["sample_cut"]
        mod.kernel("sample_max_f32").launch((n_part, 1, 1), (SAMPLE_THREADS, 1, 1),
                                            [("ptr", _ptr(x)), ("i32", n), ("ptr", part)], stream=stream)
        mod.kernel("sample_hist_f32").launch(
            (n_part, 1, 1), (SAMPLE_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("i32", n), ("ptr", part), ("i32", n_part), ("ptr", hm), ("ptr", hc)], stream=stream)
        mod.kernel("sample_cut_f32").launch(
            (1, 1, 1), (SAMPLE_THREADS, 1, 1),
            [("ptr", part), ("i32", n_part), ("ptr", hm), ("ptr", hc), ("i32", top_k if top_k < n else 0),
             ("f32", float(top_p)), ("i32", self.min_p_bin(min_p)), ("i32", cap), ("ptr", head)], stream=stream)
        mod.kernel("sample_compact_f32").launch(
            (n_part, 1, 1), (SAMPLE_THREADS, 1, 1), [("ptr", _ptr(x)), ("i32", n), ("ptr", head), ("ptr", cand)],
            stream=stream)

    @staticmethod
    def draw_blocks(n: int) -> int:
        """Blocks of sample_draw's sums over a row of n."""
        return -(-n // SAMPLE_DRAW_BLOCK)

    @staticmethod
    def set_draw(out, inv_t: float, cut_x: float, cut_id: int, u: float) -> None:
        """The next sample_draw's parameters into the head in `out` (a device buffer): the kept set {x_i > cut_x, or
        x_i == cut_x and i <= cut_id}, weights exp((x_i - m) * inv_t), u in [0, 1)."""
        if not 0 <= u < 1 or not 0 < inv_t < float("inf"):
            raise ValueError(f"sample_draw: u = {u}, inv_t = {inv_t}")
        p = np.zeros(1, SAMPLE_HEAD)
        p["inv_t"], p["cut_x"], p["cut_id"], p["u"] = inv_t, cut_x, cut_id, u
        BufferView(out, SAMPLE_DRAW_AT, SAMPLE_HEAD.itemsize - SAMPLE_DRAW_AT).upload(
            p.view(np.uint8)[SAMPLE_DRAW_AT:])

    def sample_draw(self, x, out, bsum, n: int, stream: Stream | None = None) -> None:
        """The draw set_draw described over the row x[n] (the max from sample_cut's head in `out`): u inverted over
        the kept weights in index order (le_sample's pass_draw); the token in head.token. bsum: 8 * draw_blocks(n)
        bytes. Same arguments every token: a LaunchPlan replays it."""
        nb = self.draw_blocks(n)
        if not 0 < n:
            raise ValueError(f"sample_draw: n = {n}")
        _need(x, 4 * n, "sample_draw x")
        _need(out, SAMPLE_HEAD.itemsize, "sample_draw head")
        _need(bsum, 8 * nb, "sample_draw block sums")
        mod = self.modules["sample_cut"]
        args = [("ptr", _ptr(x)), ("i32", n), ("ptr", _ptr(out)), ("ptr", _ptr(bsum))]
        mod.kernel("sample_draw_blocks_f32").launch((self._grid(nb), 1, 1), (SAMPLE_DRAW_BLOCK, 1, 1), args,
                                                    stream=stream)
        mod.kernel("sample_draw_pick_f32").launch((1, 1, 1), (SAMPLE_DRAW_BLOCK, 1, 1), args, stream=stream)

    def _elementwise(self, kernel: str, args: list, n: int, bufs: list, stream: Stream | None) -> None:
        for b, what in bufs:
            _need(b, 4 * n, f"{kernel} {what}")
        self.modules["elementwise"].kernel(kernel).launch(
            (self._grid(-(-n // EW_THREADS)), 1, 1), (EW_THREADS, 1, 1), args + [("i32", n)], stream=stream)

    def get_rows(self, qtype: int, W, ids, y, n: int, ncols: int, stream: Stream | None = None) -> None:
        """y[n, ncols] f32 = rows ids[:n] (int32, device; the caller checks them) of W [*, ncols], dequantised."""
        suffix = self._weights(qtype, W, 1, ncols, "get_rows")
        if n <= 0:
            raise ValueError(f"get_rows: n = {n}")
        _need(ids, 4 * n, "get_rows ids")
        _need(y, 4 * n * ncols, "get_rows y")
        self.modules["get_rows"].kernel(f"get_rows_{suffix}").launch(
            (self._grid(n), 1, 1), (GET_ROWS_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(ids)), ("ptr", _ptr(y)), ("i32", n), ("i32", ncols)], stream=stream)

    def get_rows_raw(self, W, ids, y, n: int, row_bytes: int, stream: Stream | None = None) -> None:
        """y[n, row_bytes] = rows ids[:n] (int32, device; the caller checks them) of W [*, row_bytes], bytes copied
        as they are (row_bytes and the addresses: multiples of 16)."""
        if n <= 0 or row_bytes <= 0 or row_bytes % 16 or _ptr(W) % 16 or _ptr(y) % 16:
            raise ValueError(f"get_rows_raw: n = {n}, row_bytes = {row_bytes} (a multiple of 16, as the addresses)")
        _need(ids, 4 * n, "get_rows_raw ids")
        _need(y, n * row_bytes, "get_rows_raw y")
        self.modules["get_rows"].kernel("get_rows_raw16").launch(
            (self._grid(n), 1, 1), (GET_ROWS_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(ids)), ("ptr", _ptr(y)), ("i32", n), ("i32", row_bytes // 16)],
            stream=stream)

    def qk_norm_rope(self, x, w, cs, n: int, n_heads: int, head_stride: int, row_stride: int, hd: int, n_rot: int,
                     eps: float, pos_dev=None, stream: Stream | None = None) -> None:
        """In place: head h of token t (x + t*row_stride + h*head_stride floats, hd of them) <- RMSNorm * w, then
        the NeoX rotation of its first n_rot dims by cs [n, n_rot/2] (cos, sin) pairs (rope_table rows).
        pos_dev: a device int32 p; token t then reads row p + t of cs (cs: the whole table)."""
        if not 0 < hd <= ROPE_MAX_HD or n_rot % 2 or not 0 <= n_rot <= hd or n <= 0 or n_heads <= 0:
            raise ValueError(f"qk_norm_rope: hd = {hd} (1…{ROPE_MAX_HD}), n_rot = {n_rot}, n = {n}, n_heads = {n_heads}")
        _need(x, 4 * ((n - 1) * row_stride + (n_heads - 1) * head_stride + hd), "qk_norm_rope x")
        _need(w, 4 * hd, "qk_norm_rope w")
        _need(cs, 4 * n * n_rot, "qk_norm_rope cs")
        self.modules["rope"].kernel("qk_norm_rope_f32").launch(
            (self._grid(n * n_heads), 1, 1), (ROPE_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(cs)), ("i32", n), ("i32", n_heads),
             ("i32", head_stride), ("i32", row_stride), ("i32", hd), ("i32", n_rot // 2), ("f32", eps),
             ("ptr", _ptr(pos_dev))], stream=stream)

    def kv_store(self, k, v, kc, vc, pos_dev, kvw: int, stream: Stream | None = None) -> None:
        """Row *pos_dev of kc, vc [n_ctx, kvw] <- k, v [kvw] (the caller keeps *pos_dev < n_ctx)."""
        _need(k, 4 * kvw, "kv_store k")
        _need(v, 4 * kvw, "kv_store v")
        self.modules["attention"].kernel("attn_kv_store_f32").launch(
            (-(-kvw // ATTN_THREADS), 1, 1), (ATTN_THREADS, 1, 1),
            [("ptr", _ptr(k)), ("ptr", _ptr(v)), ("ptr", _ptr(kc)), ("ptr", _ptr(vc)), ("ptr", _ptr(pos_dev)),
             ("i32", kvw)], stream=stream)

    def moe_combine(self, y, w, sh, shgate, out, n: int, k: int, E: int, rows=None,
                    stream: Stream | None = None) -> None:
        """out[n, E] = sum_s w[t, s] y[r(t, s)] + sigmoid(shgate[t]) sh[t] (sh None: no shared expert), r(t, s) =
        t*k + s, or rows[t*k + s] (device int32 [n*k], a permutation of 0..n*k-1: the caller's)."""
        if n <= 0 or k <= 0 or E <= 0:
            raise ValueError(f"moe_combine: n = {n}, k = {k}, E = {E}")
        _need(y, 4 * n * k * E, "moe_combine y")
        _need(w, 4 * n * k, "moe_combine w")
        if rows is not None:
            _need(rows, 4 * n * k, "moe_combine rows")
        _need(out, 4 * n * E, "moe_combine out")
        if sh is not None:
            _need(sh, 4 * n * E, "moe_combine sh")
            _need(shgate, 4 * n, "moe_combine shgate")
        self.modules["moe_combine"].kernel("moe_combine_f32").launch(
            (self._grid(-(-n * E // MOE_COMBINE_THREADS)), 1, 1), (MOE_COMBINE_THREADS, 1, 1),
            [("ptr", _ptr(y)), ("ptr", _ptr(w)), ("ptr", _ptr(sh)), ("ptr", _ptr(shgate)), ("ptr", _ptr(out)),
             ("i32", n), ("i32", k), ("i32", E), ("ptr", _ptr(rows))], stream=stream)

    def swiglu(self, g, u, out, n: int, stream: Stream | None = None) -> None:
        """out[n] = SiLU(g) * u (out may be g or u)."""
        self._elementwise("swiglu_f32", [("ptr", _ptr(g)), ("ptr", _ptr(u)), ("ptr", _ptr(out))], n,
                          [(g, "g"), (u, "u"), (out, "out")], stream)

    def add(self, a, b, out, n: int, stream: Stream | None = None) -> None:
        """out[n] = a + b (out may be a or b)."""
        self._elementwise("add_f32", [("ptr", _ptr(a)), ("ptr", _ptr(b)), ("ptr", _ptr(out))], n,
                          [(a, "a"), (b, "b"), (out, "out")], stream)

    def add_scaled(self, acc, y, w: float, n: int, stream: Stream | None = None) -> None:
        """acc[n] += w * y (an expert's output into the MoE sum)."""
        self._elementwise("add_scaled_f32", [("ptr", _ptr(acc)), ("ptr", _ptr(y)), ("f32", w)], n,
                          [(acc, "acc"), (y, "y")], stream)
