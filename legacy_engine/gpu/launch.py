"""The launch constants of the cuda8 kernels, read from the sources' #defines (the build's own inputs: cuda8/*.cu,
*.cuh, native/include/le_hybrid.h), not mirrored by hand; and the buffer checks every launcher makes before it
launches (an out-of-bounds kernel would take the whole context down)."""
from __future__ import annotations

import re

import numpy as np

from .runtime import Buffer
from .toolchain import CUDA_DIR, INCLUDE_DIR


def source_defines() -> dict[str, int]:
    """Every `#define NAME <integer>` of the kernel sources and le_hybrid.h (the launch geometry)."""
    out: dict[str, int] = {}
    paths = sorted(CUDA_DIR.glob("*.cu")) + sorted(CUDA_DIR.glob("*.cuh")) + [INCLUDE_DIR / "le_hybrid.h"]
    for p in paths:
        for name, value in re.findall(r"^#define\s+(\w+)\s+(\d+)\b", p.read_text(encoding="utf-8"), flags=re.M):
            out.setdefault(name, int(value))
    return out


_D = source_defines()
ATTR_UNIFIED_ADDRESSING = 41    # CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: host pointers usable in kernels
HYBRID_THREADS, HYBRID_FETCH_BLOCKS, HYBRID_PRED_E = _D["HYBRID_THREADS"], _D["HYBRID_FETCH_BLOCKS"], _D["HYBRID_PRED_E"]
HY_PRED_MAX, HY_EARLY_MAX = _D["LE_HY_PRED_MAX"], _D["LE_HY_EARLY_MAX"]
GRID_SYNC_THREADS = _D["GRID_SYNC_THREADS"]
# ggml type id -> kernel suffix (cuda8/quants.cuh le_t_*), elements per block, bytes per block
GPU_TYPES = {2: ("q4_0", 32, 18), 8: ("q8_0", 32, 34), 12: ("q4_K", 256, 144), 13: ("q5_K", 256, 176),
             14: ("q6_K", 256, 210), 23: ("iq4_xs", 256, 136)}
F32 = 0   # f32 weights: gemv_f32_f32 / gemm_f32_f32 / get_rows_f32 (no int8 path)
Q8_1_BYTES = 36
MAX_GRID = 65535   # Fermi's grid x limit (y/z everywhere); kernels grid-stride beyond it
MAX_PAIRS = 65535  # (token, expert) pairs of one MoE GEMV launch: grid.y
ATTN_MAX_SPLIT = 64   # decode split-K: the most splits (the launcher's; the fewest keys a split takes is the kernels')
MOE_WSUM_MIN = 6.103515625e-5                            # native/moe.c MOE_WSUM_MIN (llama.cpp's clamp)

# launch geometry: each source's #defines
GEMV_THREADS = _D["GEMV_THREADS"]
GEMV_ROWS = GEMV_THREADS // 32   # a warp a row (the sources' GEMV_WARPS)
GEMV_MAX_MATS = _D["GEMV_MAX_MATS"]   # matrices on one input in one dense GEMV launch (quants.cuh LE_GEMV_MATS)
GEMM_THREADS, GEMM_ROWS, GEMM_TT = _D["GEMM_THREADS"], _D["GEMM_ROWS"], _D["GEMM_TT"]   # a block's tile: rows x tokens
GEMM_MMA_TT = _D["GEMM_MMA_TT"]    # tokens per block of gemm_mma, plain and grouped (its tiles: up to that many pairs)
RMSNORM_THREADS, Q8_THREADS = _D["RMSNORM_THREADS"], _D["Q8_THREADS"]
CONV_THREADS, CONV_TOKENS, CONV_MAX_K = _D["CONV_THREADS"], _D["CONV_TOKENS"], _D["CONV_MAX_K"]
GDN_THREADS, GDN_COLS, GDN_MAX_DK = _D["GDN_THREADS"], _D["GDN_COLS"], _D["GDN_MAX_DK"]
GDNC_C, GDNC_THREADS, GDNC_COLS, GDNC_MAX_DK = _D["GDNC_C"], _D["GDNC_THREADS"], _D["GDNC_COLS"], _D["GDNC_MAX_DK"]
GDN_NORM_THREADS, GDN_EW_THREADS = _D["GDN_NORM_THREADS"], _D["GDN_EW_THREADS"]
ATTN_THREADS, ATTN_WARPS, ATTN_PREFILL_THREADS = _D["ATTN_THREADS"], _D["ATTN_WARPS"], _D["ATTN_PREFILL_THREADS"]
ATTN_QTILE, ATTN_MAX_HD, ATTN_MIN_KEYS_PER_SPLIT = _D["ATTN_QTILE"], _D["ATTN_MAX_HD"], _D["ATTN_MIN_KEYS_PER_SPLIT"]
ATTN_T_THREADS, ATTN_T_Q, ATTN_T_D = _D["ATTN_T_THREADS"], _D["ATTN_T_Q"], _D["ATTN_T_D"]
ATTN_M_THREADS, ATTN_M_Q, ATTN_M_K, ATTN_P_THREADS = (_D["ATTN_M_THREADS"], _D["ATTN_M_Q"], _D["ATTN_M_K"],
                                                     _D["ATTN_P_THREADS"])
MOE_THREADS, MOE_MAX_K = _D["MOE_THREADS"], _D["MOE_MAX_K"]
MOE_SORT_THREADS, MOE_SORT_MAX_E, MOE_SORT_MAX_TILE = _D["MOE_SORT_THREADS"], _D["MOE_SORT_MAX_E"], _D["MOE_SORT_MAX_TILE"]
ARGMAX_THREADS, ARGMAX_MAX_PARTS = _D["ARGMAX_THREADS"], _D["ARGMAX_MAX_PARTS"]
SAMPLE_THREADS, SAMPLE_MAX_PARTS, SAMPLE_BINS = _D["SAMPLE_THREADS"], _D["SAMPLE_MAX_PARTS"], _D["SAMPLE_BINS"]
SAMPLE_BINS_PER_NAT, SAMPLE_FIX_BITS, SAMPLE_DRAW_BLOCK = (_D["SAMPLE_BINS_PER_NAT"], _D["SAMPLE_FIX_BITS"],
                                                           _D["SAMPLE_DRAW_BLOCK"])
SAMPLE_HEAD = np.dtype([("n_cand", "<i4"), ("cut", "<i4"), ("mode", "<i4"), ("rest_key", "<i4"), ("m", "<f4"),
                        ("written", "<i4"), ("z", "<u8"), ("base", "<u8"), ("token", "<i4"), ("pad", "<i4"),
                        ("inv_t", "<f4"), ("cut_x", "<f4"), ("cut_id", "<i4"), ("pad2", "<i4"), ("u", "<f8")])
SAMPLE_DRAW_AT = 48     # the head's draw fields (inv_t, cut_x, cut_id, pad2, u): written by Kernels.set_draw
SAMPLE_WORK_BYTES = 4 * SAMPLE_MAX_PARTS + 8 * SAMPLE_BINS + 4 * SAMPLE_BINS   # partials, bin masses, bin counts
EW_THREADS, ROPE_THREADS, ROPE_MAX_HD = _D["EW_THREADS"], _D["ROPE_THREADS"], _D["ROPE_MAX_HD"]
GET_ROWS_THREADS, MOE_COMBINE_THREADS = _D["GET_ROWS_THREADS"], _D["MOE_COMBINE_THREADS"]
PEAK_THREADS, PEAK_CHAINS, PEAK_MMA_CHAINS = _D["PEAK_THREADS"], _D["PEAK_CHAINS"], _D["PEAK_MMA_CHAINS"]


def _inv_sqrt_f32(d: int) -> float:
    """1 / sqrt(d) rounded as the C core rounds it (f32 operands): the q scale of attention and of the GDN's q heads."""
    return float(np.float32(1) / np.sqrt(np.float32(d)))


def _aligned16(b, what: str) -> None:
    """gemm_f32.cu reads X as float4: its address must be a multiple of 16 bytes (every Buffer is)."""
    if _ptr(b) % 16:
        raise ValueError(f"{what}: address {_ptr(b):#x} is not 16-byte aligned")


def _ptr(b) -> int:
    return 0 if b is None else (b.ptr if isinstance(b, Buffer) else int(b))


def attn_planes_keys(n_keys: int) -> int:
    """The keys the tensor-core attention prefill's planes hold: n_keys rounded up to a tile (its nkp)."""
    return -(-n_keys // ATTN_M_K) * ATTN_M_K


def attn_planes_bytes(n_keys: int, n_kv: int, hd: int) -> int:
    """Bytes of the tensor-core attention prefill's f16 hi / lo planes of n_keys keys (cuda8/attention.cu
    attn_kv_planes_f16: K and V, each hi and lo, attn_planes_keys of them)."""
    return 4 * n_kv * attn_planes_keys(n_keys) * hd * 2


def _need(buf, nbytes: int, what: str) -> None:
    if isinstance(buf, Buffer) and buf.nbytes < nbytes:
        raise ValueError(f"{what} needs {nbytes} bytes; the buffer has {buf.nbytes}")
