"""The link's rate by copy size (GPU machine): page-locked host memory -> VRAM, 400 MiB in copies of each size on one,
two and four streams, the best of five (why a streamed pass's copies, the runs of experts between a layer's pins,
move at ~52.5 GB/s where one long copy moves at ~55.5: a copy costs ~2.5 us beyond its bytes).

    python benchmarks/h2d_copy_sizes.py

2026-11-29, H200: 400 MiB 55.5 GB/s, 3 MiB 53.1, 1.12 MiB 49.6, 0.56 MiB 44.2; streams change nothing
(benchmarks/results/prefill_s43_2026-11-29.md)."""
from __future__ import annotations

from legacy_engine import gpu
from legacy_engine.core import _native

TOTAL = 400 << 20
SIZES = (400 << 20, 64 << 20, 8 << 20, 3 << 20, 1179648, 589824)    # the last two: a Q4_K expert tensor's 2 and 1


def rate(dev, base: int, streams: list, size: int, n_streams: int, reps: int = 5) -> float:
    """GB/s of TOTAL bytes in copies of `size` bytes spread round-robin over n_streams streams, best of reps."""
    best = 0.0
    for _ in range(reps):
        gpu.synchronize()
        e0 = gpu.Event()
        e0.record(streams[0])
        for s in streams[1:n_streams]:
            s.wait(e0)
        n = TOTAL // size
        for j in range(n):
            _native.gpu_copy_htod_addr(dev.ptr + j * size, base + j * size, size, streams[j % n_streams].handle)
        ends = []
        for s in streams[:n_streams]:
            e = gpu.Event()
            e.record(s)
            ends.append(e)
        for s in streams[:n_streams]:
            s.synchronize()
        best = max(best, n * size / max(e0.elapsed_ms(e) for e in ends) / 1e6)
    return best


def main() -> None:
    info = gpu.init()
    host, dev = gpu.PinnedBuffer(TOTAL), gpu.Buffer(TOTAL, "h2d probe")
    host.array[:] = 1
    base = int(_native.ffi.cast("uintptr_t", host.ptr))
    streams = [gpu.Stream() for _ in range(4)]
    print(f"{info.get('name', 'GPU')}: page-locked host -> VRAM, {TOTAL >> 20} MiB in copies of each size")
    for size in SIZES:
        r = [rate(dev, base, streams, size, k) for k in (1, 2, 4)]
        print(f"copies of {size / 2**20:7.2f} MiB: 1 stream {r[0]:5.1f} GB/s, 2 streams {r[1]:5.1f}, "
              f"4 streams {r[2]:5.1f}", flush=True)


if __name__ == "__main__":
    main()
