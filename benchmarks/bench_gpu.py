"""GPU GEMV (decode) and GEMM (prefill) of cuda8/, per weight type x tier variant, timed with CUDA events.

    python benchmarks/bench_gpu.py [--mib 512] [--reps 20] [--variants dp4a-sm90,fermi-sm35] [--json out.json]
    python -m pytest benchmarks/bench_gpu.py -m gpu          # the same, small, as tests (extra_info has the numbers)

What is timed: y = W x for a weight matrix of N = 4096 columns and as many rows as fit `--mib` MiB (default 512 MiB,
~10x the H100/H200 L2, so the weights stream from HBM), gemv_f32 (f32 x) and gemv_dp4a (x already quantised to
Q8_1; the quantiser is timed apart), after 3 warm-up launches, as the mean of `--reps` back-to-back launches between
two CUDA events. Bytes counted: the weight bytes, read once (x and y are < 0.1 % of them).
Roofline: the device's peak memory bandwidth from cuDeviceGetAttribute (2 x memory clock x bus width; DDR), and
a measured device-to-device copy (cuMemcpyDtoD of 1 GiB, read + write bytes). Legacy variants (fermi-sm35 …) are
JIT-compiled for the card they run on: their numbers are the legacy code path on this card, not an old card's.
GEMM: Y = X W^T with X [128 tokens, 4096] against a 4096 x 4096 matrix, gemm_f32, gemm_dp4a (X as Q8_1) and
gemm_mma (the same on tensor cores, where the variant has them):
GFLOP/s (2 flops per weight per token). Prefill (--ops prefill): bench_prefill's doc.
Layer ops (--ops layer), Qwen3.5-35B-A3B shapes: decode attention over 32k cached tokens (16 query heads, 2 KV heads,
head 256: bytes = K and V of the 32k tokens once, although each query head re-reads its KV head, from L2 at best),
prefill attention (512 tokens: GFLOP/s, 4 flops per head dim per (query, key) pair), one GDN decode step (the f32
state of 32 heads x 128 x 128 read and written; cycled over 64 layers' states so that it streams from HBM), the GDN
recurrence over 512 tokens, conv1d, MoE routing, argmax over 248320 logits, SwiGLU over 16M elements. The ops of a
few MB (one decode token's conv, routing, argmax, GDN step) take ~15-35 us here, the rate at which this harness
issues launches through cffi, not the kernels' own time: read them as upper bounds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

import numpy as np
import pytest

from legacy_engine.core import _native

from legacy_engine import gpu
from legacy_engine.core.errors import EngineError

pytestmark = pytest.mark.gpu

NCOLS = 4096
ATTR_MEMORY_CLOCK_KHZ, ATTR_BUS_WIDTH_BITS = 36, 37
HALF_FIELDS = {2: [0], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208], 23: [0]}


def peak_bandwidth() -> float | None:
    """Bytes/s from the memory clock and bus width (None when the driver does not say)."""
    try:
        clock = _native.gpu_attribute(ATTR_MEMORY_CLOCK_KHZ)
        width = _native.gpu_attribute(ATTR_BUS_WIDTH_BITS)
    except EngineError:
        return None
    return 2.0 * clock * 1e3 * width / 8 if clock and width else None


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Measured device-to-device copy, bytes read + written per second."""
    with gpu.Buffer(nbytes, "copy src") as a, gpu.Buffer(nbytes, "copy dst") as b:
        _native.gpu_copy_dtod(b.ptr, a.ptr, nbytes)
        e0, e1 = gpu.Event(), gpu.Event()
        e0.record()
        for _ in range(reps):
            _native.gpu_copy_dtod(b.ptr, a.ptr, nbytes)
        e1.record()
        ms = e0.elapsed_ms(e1) / reps
    return 2 * nbytes / (ms * 1e-3)


def weights(qtype: int, nrows: int, ncols: int, seed: int = 0) -> np.ndarray:
    _, bs, ts = gpu.GPU_TYPES[qtype]
    nb = nrows * ncols // bs
    raw = np.random.default_rng(seed).integers(0, 256, size=(nb, ts), dtype=np.uint8)
    half = np.array([0.01], np.float16).view(np.uint8)
    for off in HALF_FIELDS[qtype]:
        raw[:, off], raw[:, off + 1] = half[0], half[1]
    return raw.reshape(-1)


def time_ms(launch, reps: int, warmup: int = 3) -> float:
    return gpu.time_ms(launch, reps, warmup)


def bench(kernels: list[gpu.Kernels], mib: int, reps: int) -> list[dict]:
    """Every op x type for each loaded variant; weights made and uploaded once per type."""
    rows = []
    x = np.random.default_rng(1).standard_normal(NCOLS).astype(np.float32)
    with gpu.Buffer.from_array(x) as bx, gpu.Buffer(NCOLS // 32 * 36) as bq:
        for k in kernels:
            k.quantize_q8_1(bx, bq, NCOLS)
            ms = time_ms(lambda: k.quantize_q8_1(bx, bq, NCOLS), reps)
            rows.append({"variant": k.name, "op": "quantize_q8_1", "type": "f32", "ms": ms, "bytes": 4 * NCOLS})
        for qtype, (tn, bs, ts) in gpu.GPU_TYPES.items():
            row_bytes = NCOLS // bs * ts
            nrows = (mib << 20) // row_bytes
            with gpu.Buffer.from_array(weights(qtype, nrows, NCOLS), f"{tn} weights") as bw, \
                    gpu.Buffer(4 * nrows) as by:
                for k in kernels:
                    for op, act in (("gemv_f32", bx), ("gemv_dp4a", bq)):
                        fn = getattr(k, op)
                        ms = time_ms(lambda: fn(qtype, bw, act, by, nrows, NCOLS), reps)
                        rows.append({"variant": k.name, "op": op, "type": tn, "rows": nrows, "ms": ms,
                                     "bytes": nrows * row_bytes})
    # prefill GEMM: 128 tokens x 4096 x 4096
    ntok, n = 128, 4096
    X = np.random.default_rng(2).standard_normal((ntok, n)).astype(np.float32)
    with gpu.Buffer.from_array(X) as bX, gpu.Buffer(4 * ntok * n) as bY, gpu.Buffer(ntok * n // 32 * 36) as bXq:
        for qtype, (tn, bs, ts) in gpu.GPU_TYPES.items():
            with gpu.Buffer.from_array(weights(qtype, n, n)) as bw:
                for k in kernels:
                    k.quantize_q8_1(bX, bXq, ntok * n)
                    for op, act in (("gemm_f32", bX), ("gemm_dp4a", bXq)) + ((("gemm_mma", bXq),) if k.has_mma else ()):
                        fn = getattr(k, op)
                        ms = time_ms(lambda: fn(qtype, bw, act, bY, n, n, ntok), max(2, reps // 4))
                        rows.append({"variant": k.name, "op": op, "type": tn, "rows": n, "ntok": ntok, "ms": ms,
                                     "bytes": n * (n // bs) * ts, "flops": 2.0 * ntok * n * n})
    order = {k.name: i for i, k in enumerate(kernels)}
    return sorted(rows, key=lambda r: (order[r["variant"]], r["op"]))


def bench_layer_ops(kernels: list[gpu.Kernels], reps: int) -> list[dict]:
    """The layer ops of cuda8/ at Qwen3.5-35B-A3B shapes; rows as bench() (type = the shape)."""
    rng = np.random.default_rng(3)
    rows = []

    def add(k, op, shape, ms, nbytes, flops=None):
        rows.append({"variant": k.name, "op": op, "type": shape, "ms": ms, "bytes": nbytes}
                    | ({"flops": flops} if flops else {}))

    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    nh, nkv, hd, n_ctx = 16, 2, 256, 32768
    Hk, Hv, dk, dv, K = 16, 32, 128, 128, 4
    conv_dim = 2 * Hk * dk + Hv * dv
    n_states = 64
    ns, _ = gpu.Kernels.attn_splits(n_ctx)
    with contextlib.ExitStack() as stack:
        def buf(a=None, nbytes=None):
            b = gpu.Buffer.from_array(a) if a is not None else gpu.Buffer(nbytes)
            return stack.enter_context(b)
        kc, vc, qg = buf(f32(n_ctx, nkv * hd)), buf(f32(n_ctx, nkv * hd)), buf(f32(512, nh * 2 * hd))
        o, part = buf(nbytes=4 * 512 * nh * hd), buf(nbytes=gpu.Kernels.attn_partials_bytes(nh, hd, ns))
        S, u = buf(nbytes=4 * n_states * Hv * dk * dv), buf(f32(512, conv_dim))
        g, beta = buf(-np.abs(f32(512, Hv))), buf(np.full((512, Hv), 0.5, np.float32))
        cw, cst, cy = buf(f32(conv_dim, K)), buf(nbytes=4 * (K - 1) * conv_dim), buf(nbytes=4 * 512 * conv_dim)
        logits, ids, wts = buf(f32(512, 256)), buf(nbytes=4 * 512 * 8), buf(nbytes=4 * 512 * 8)
        lm, apart, amax = buf(f32(248320)), buf(nbytes=8 * gpu.ARGMAX_MAX_PARTS), buf(nbytes=4)
        ea, eb = buf(f32(1 << 24)), buf(f32(1 << 24))
        _native.gpu_memset8(S.ptr, 0, S.nbytes)
        _native.gpu_memset8(cst.ptr, 0, cst.nbytes)
        state_bytes = 4 * Hv * dk * dv
        for k in kernels:
            ms = time_ms(lambda: k.attention_decode(qg, kc, vc, o, part, n_ctx, nh, nkv, hd), reps)
            add(k, "attn_decode", f"{n_ctx // 1024}k", ms, 2 * 4 * n_ctx * nkv * hd)
            n = 512
            ms = time_ms(lambda: k.attention_prefill(qg, kc, vc, o, n, 0, nh, nkv, hd), max(2, reps // 4))
            add(k, "attn_prefill", f"{n}", ms, 4 * n * (2 * nh + 2 * nkv + nh) * hd,
                4.0 * hd * nh * n * (n + 1) / 2)
            it = iter(range(1 << 30))
            ms = time_ms(lambda: k.gdn_recurrent(u, g, beta, S.ptr + (next(it) % n_states) * state_bytes, o, 1,
                                                 Hk, Hv, dk, dv), reps)
            add(k, "gdn_step", "1", ms, 2 * state_bytes)
            ms = time_ms(lambda: k.gdn_recurrent(u, g, beta, S, o, n, Hk, Hv, dk, dv), max(2, reps // 4))
            add(k, "gdn_recurrent", f"{n}", ms, 4 * n * (conv_dim + Hv * dv) + 2 * state_bytes,
                4.0 * n * Hv * dk * dv)
            for nt in (1, n):
                ms = time_ms(lambda: k.conv1d_silu(u, cw, cst, cy, nt, conv_dim, K), reps)
                add(k, "conv1d", f"{nt}", ms, 4 * (2 * nt + 2 * (K - 1) + K) * conv_dim)
                ms = time_ms(lambda: k.moe_route(logits, ids, wts, nt, 256, 8), reps)
                add(k, "moe_route", f"{nt}x256", ms, 4 * nt * 256)
            ms = time_ms(lambda: k.argmax(lm, apart, amax, 248320), reps)
            add(k, "argmax", "248320", ms, 4 * 248320)
            ms = time_ms(lambda: k.swiglu(ea, eb, ea, 1 << 24), reps)
            add(k, "swiglu", "16M", ms, 3 * 4 << 24)
    return rows


def bench_prefill(kernels: list[gpu.Kernels], reps: int) -> list[dict]:
    """A pp2048 pass's matmuls at Qwen3.5-35B-A3B shapes, Q4_K weights (zeros: the kernels' time does not depend on
    the values): the GDN input projection (12288 x 2048, 2048 tokens) dense, and the routed experts' gate (512 x
    2048) and down (2048 x 512) as grouped GEMMs over 2048 x 8 pairs routed uniformly over 256 experts, each in f32
    (gemm_f32) and int8 (gemm_dp4a on Q8_1 activations, and gemm_mma where the variant has tensor cores); the Q8_1 quantiser and moe_sort (the grouped GEMMs' work
    list) beside them."""
    rng = np.random.default_rng(4)
    q4k, n_tok, n_exp, k_used = 12, 2048, 256, 8
    _, bs, ts = gpu.GPU_TYPES[q4k]
    wbytes = lambda r, c: r * (c // bs) * ts   # noqa: E731
    ids = np.concatenate([rng.choice(n_exp, k_used, replace=False) for _ in range(n_tok)]).astype(np.int32)
    order = np.argsort(ids, kind="stable")
    tiles = {t: gpu.Kernels.expert_tiles(ids[order], t) for t in (gpu.GEMM_TT, gpu.GEMM_MMA_TT)}
    P = ids.size
    rows = []
    with contextlib.ExitStack() as stack:
        def zeros(nbytes):
            b = stack.enter_context(gpu.Buffer(nbytes))
            _native.gpu_memset8(b.ptr, 0, nbytes)
            return b
        big = max(4 * P * 2048, 4 * n_tok * 12288)
        X, Y, Xq = zeros(big), zeros(big), zeros(P * 2048 // 32 * 36)
        W = zeros(max(wbytes(12288, 2048), n_exp * wbytes(512, 2048)))
        bt = {t: stack.enter_context(gpu.Buffer.from_array(v)) for t, v in tiles.items()}
        bi = stack.enter_context(gpu.Buffer.from_array(ids))
        mt = gpu.Kernels.sort_tiles_max(P, n_exp)
        meta, cnt = zeros(4 * 3 * P + 12 * mt), zeros(4 * n_exp)
        for k in kernels:
            r, c = 12288, 2048
            for op, act in (("gemm_f32", X), ("gemm_dp4a", Xq)) + ((("gemm_mma", Xq),) if k.has_mma else ()):
                fn = getattr(k, op)
                ms = time_ms(lambda: fn(q4k, W, act, Y, r, c, n_tok), max(2, reps // 4))
                rows.append({"variant": k.name, "op": op, "type": f"{r}x{c}", "ms": ms, "bytes": wbytes(r, c),
                             "flops": 2.0 * r * c * n_tok})
            for r, c in ((512, 2048), (2048, 512)):
                eb = wbytes(r, c)
                forms = ((False, False, X), (True, False, Xq)) + (((True, True, Xq),) if k.has_mma else ())
                for int8, mma, act in forms:
                    t = gpu.Kernels.group_tile(int8, mma)
                    ms = time_ms(lambda: k.gemm_ids(q4k, W, act, Y, r, c, bt[t], len(tiles[t]), eb, P, int8=int8,
                                                    mma=mma), max(2, reps // 4))
                    op = ("gemm_mma_ids" if mma else "gemm_dp4a_ids") if int8 else "gemm_ids"
                    rows.append({"variant": k.name, "op": op, "type": f"{r}x{c}",
                                 "ms": ms, "bytes": n_exp * eb, "flops": 2.0 * r * c * P})
            ms = time_ms(lambda: k.quantize_q8_1(X, Xq, n_tok * 2048), reps)
            rows.append({"variant": k.name, "op": "quantize_q8_1", "type": f"{n_tok}x2048", "ms": ms,
                         "bytes": 4 * n_tok * 2048})
            ms = time_ms(lambda: k.moe_sort(bi, P, k_used, n_exp, meta, meta.ptr + 4 * P, meta.ptr + 8 * P,
                                            meta.ptr + 12 * P, mt, cnt), reps)
            rows.append({"variant": k.name, "op": "moe_sort", "type": f"{P}", "ms": ms, "bytes": 4 * P})
    return rows


def report(rows: list[dict], peak: float | None, copy: float) -> list[str]:
    lines = [f"{'variant':<12} {'op':<14} {'type':<7} {'ms':>8} {'GB/s':>8} {'% peak':>7} {'% copy':>7} {'GFLOP/s':>8}"]
    for r in rows:
        gbs = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        r["gbps"] = gbs
        r["pct_peak"] = 100 * gbs * 1e9 / peak if peak else None
        r["pct_copy"] = 100 * gbs * 1e9 / copy
        gf = f"{r['flops'] / (r['ms'] * 1e-3) / 1e9:8.0f}" if "flops" in r else "       -"
        pk = f"{r['pct_peak']:6.1f}%" if peak else "     -"
        lines.append(f"{r['variant']:<12} {r['op']:<14} {r['type']:<7} {r['ms']:8.3f} {gbs:8.1f} {pk:>7} "
                     f"{r['pct_copy']:6.1f}% {gf}")
    return lines


def variants(names: str | None) -> list[tuple[str, int]]:
    arch = gpu.device_arch()
    vs = [v for v in gpu.default_variants(native_archs=(arch,)) if v[1] <= arch]
    if names:
        want = set(names.split(","))
        vs = [v for v in vs if gpu.variant_name(*v) in want]
    return vs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="weight MiB per GEMV (default 512)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", help="comma-separated, e.g. dp4a-sm90,fermi-sm35 (default: all that run here)")
    p.add_argument("--ops", choices=("matmul", "layer", "prefill", "all"), default="all",
                   help="matmul: GEMV/GEMM per type; layer: attention, GDN, conv, routing, argmax, SwiGLU; "
                        "prefill: a pp2048 pass's dense and grouped GEMMs at 35B-A3B shapes, f32 and int8")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    dev = gpu.init()
    peak, copy = peak_bandwidth(), copy_bandwidth()
    print(f"{dev['name']} sm_{gpu.device_arch()}: peak {peak / 1e9 if peak else float('nan'):.0f} GB/s "
          f"(memory clock x bus width), device-to-device copy {copy / 1e9:.0f} GB/s (read + write)")
    kernels = []
    for tier, arch in variants(a.variants):
        try:
            kernels.append(gpu.Kernels(tier, arch))
        except EngineError as e:
            print(f"{gpu.variant_name(tier, arch)}: skipped ({e})")
    rows = bench(kernels, a.mib, a.reps) if a.ops in ("matmul", "all") else []
    rows += bench_layer_ops(kernels, a.reps) if a.ops in ("layer", "all") else []
    rows += bench_prefill(kernels, a.reps) if a.ops in ("prefill", "all") else []
    print("\n".join(report(rows, peak, copy)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "peak_bytes_per_s": peak, "copy_bytes_per_s": copy, "rows": rows}, f, indent=1)
    return 0


# ---- as pytest (small: 64 MiB per GEMV, still past L2) ----------------------------------------------------------

@pytest.fixture(scope="module")
def roofline():
    ok, why = gpu.available()
    if not ok:
        pytest.skip(f"no GPU: {why}")
    gpu.init()
    return peak_bandwidth(), copy_bandwidth(256 << 20)


@pytest.mark.parametrize("variant", ["fermi-sm35", "kepler-sm35", "dp4a-sm61", "dp4a-sm70", "native"])
def test_bench_gemv(roofline, variant, record_property):
    arch = gpu.device_arch()
    tier, va = ("dp4a", arch) if variant == "native" else (variant.split("-sm")[0], int(variant.split("-sm")[1]))
    try:
        k = gpu.Kernels(tier, va)
    except EngineError as e:
        pytest.skip(str(e))
    rows = bench([k], 64, 5)
    lines = report(rows, *roofline)
    print("\n" + "\n".join(lines))
    record_property("rows", json.dumps(rows))
    assert all(r["ms"] > 0 for r in rows)


@pytest.mark.parametrize("variant", ["fermi-sm35", "native"])
def test_bench_layer_ops(roofline, variant, record_property):
    arch = gpu.device_arch()
    tier, va = ("dp4a", arch) if variant == "native" else ("fermi", 35)
    try:
        k = gpu.Kernels(tier, va)
    except EngineError as e:
        pytest.skip(str(e))
    rows = bench_layer_ops([k], 3) + (bench_prefill([k], 3) if variant == "native" else [])
    print("\n" + "\n".join(report(rows, *roofline)))
    record_property("rows", json.dumps(rows))
    assert all(r["ms"] > 0 for r in rows)


if __name__ == "__main__":
    sys.exit(main())
