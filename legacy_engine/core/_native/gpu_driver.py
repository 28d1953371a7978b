"""The CUDA driver API of native/gpu.c (le_gpu.h).

Device pointers are ints; modules, kernels, streams and events are cffi pointers owned by the caller
(legacy_engine.gpu.runtime wraps them in objects that free themselves). No driver: UnavailableError; a driver
failure: NativeError whose message names the call, the CUresult and the kernel; the VRAM budget: NativeError with
code lib.LE_ERR_NO_MEMORY.
"""
from __future__ import annotations

import struct

from ..errors import UnavailableError
from ._lib import check, ffi, lib, struct_to_dict


def _gpu_check(code: int, what: str) -> None:
    if code == lib.LE_ERR_UNAVAILABLE:
        detail = ffi.string(lib.le_last_error()).decode("utf-8", "replace")
        raise UnavailableError(f"{what}: {detail}")
    check(code, what)


def gpu_init(device: int = 0) -> None:
    """Opens `device` (its primary context) for this process; again with the same device is a no-op."""
    _gpu_check(lib.le_gpu_init(int(device)), f"le_gpu_init({device})")


def gpu_shutdown() -> None:
    _gpu_check(lib.le_gpu_shutdown(), "le_gpu_shutdown")


def gpu_current_device() -> int:
    """The open device, -1 when none."""
    return lib.le_gpu_current_device()


def gpu_synchronize() -> None:
    _gpu_check(lib.le_gpu_synchronize(), "le_gpu_synchronize")


def gpu_attribute(attribute: int) -> int:
    """cuDeviceGetAttribute of the open device (CUdevice_attribute id)."""
    p = ffi.new("int *")
    _gpu_check(lib.le_gpu_attribute(int(attribute), p), f"le_gpu_attribute({attribute})")
    return p[0]


def gpu_set_budget(nbytes: int | None) -> None:
    """VRAM budget in bytes for le_gpu_alloc; None (or < 0): no budget."""
    _gpu_check(lib.le_gpu_set_budget(-1 if nbytes is None else int(nbytes)), "le_gpu_set_budget")


def gpu_mem_stats() -> dict:
    """{'budget', 'used', 'peak', 'n_allocs', 'pinned', 'free_bytes', 'total_bytes'} in bytes."""
    p = ffi.new("le_gpu_mem_stats *")
    _gpu_check(lib.le_gpu_get_mem_stats(p), "le_gpu_get_mem_stats")
    return struct_to_dict(p)


def gpu_alloc(nbytes: int, what: str = "buffer") -> int:
    """nbytes of device memory, accounted against the budget -> the device pointer."""
    p = ffi.new("uint64_t *")
    _gpu_check(lib.le_gpu_alloc(p, int(nbytes), what.encode()), f"le_gpu_alloc({what})")
    return int(p[0])


def gpu_free(dptr: int) -> None:
    _gpu_check(lib.le_gpu_free(int(dptr)), "le_gpu_free")


def gpu_memset8(dptr: int, value: int, nbytes: int) -> None:
    _gpu_check(lib.le_gpu_memset8(int(dptr), int(value), int(nbytes)), "le_gpu_memset8")


def _stream(stream):
    return ffi.NULL if stream is None else stream


def gpu_copy_htod(dptr: int, src, nbytes: int | None = None, stream=None) -> None:
    """Copies a bytes-like (numpy array, bytes, pinned buffer) to the device; async when `stream` is given."""
    buf = ffi.from_buffer(src)
    n = len(buf) if nbytes is None else int(nbytes)
    if n > len(buf):
        raise ValueError(f"copy of {n} bytes from a {len(buf)}-byte buffer")
    if stream is None:
        _gpu_check(lib.le_gpu_copy_htod(int(dptr), buf, n), "le_gpu_copy_htod")
    else:
        _gpu_check(lib.le_gpu_copy_htod_async(int(dptr), buf, n, stream), "le_gpu_copy_htod_async")


def gpu_copy_dtoh(dst, dptr: int, nbytes: int | None = None, stream=None) -> None:
    """Copies device memory into a writable bytes-like; async when `stream` is given."""
    buf = ffi.from_buffer(dst, require_writable=True)
    n = len(buf) if nbytes is None else int(nbytes)
    if n > len(buf):
        raise ValueError(f"copy of {n} bytes into a {len(buf)}-byte buffer")
    if stream is None:
        _gpu_check(lib.le_gpu_copy_dtoh(buf, int(dptr), n), "le_gpu_copy_dtoh")
    else:
        _gpu_check(lib.le_gpu_copy_dtoh_async(buf, int(dptr), n, stream), "le_gpu_copy_dtoh_async")


def gpu_copy_dtod(dst: int, src: int, nbytes: int, stream=None) -> None:
    if stream is None:
        _gpu_check(lib.le_gpu_copy_dtod(int(dst), int(src), int(nbytes)), "le_gpu_copy_dtod")
    else:
        _gpu_check(lib.le_gpu_copy_dtod_async(int(dst), int(src), int(nbytes), stream), "le_gpu_copy_dtod_async")


def host_address(buf) -> int:
    """The address of a bytes-like object's first byte (a numpy array, a memory map)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))


def gpu_copy_htod_addr(dptr: int, host_addr: int, nbytes: int, stream) -> None:
    """Async copy of nbytes at a raw host address (inside memory registered with gpu_host_register) on `stream`."""
    _gpu_check(lib.le_gpu_copy_htod_async(int(dptr), ffi.cast("void *", host_addr), int(nbytes), stream),
               "le_gpu_copy_htod_async")


def gpu_host_register(host_addr: int, nbytes: int, read_only: bool) -> None:
    _gpu_check(lib.le_gpu_host_register(ffi.cast("void *", host_addr), int(nbytes), int(read_only)),
               "le_gpu_host_register")


def gpu_host_device_pointer(host_addr: int) -> int:
    """The device address of a host address inside page-locked memory (allocated or registered)."""
    out = ffi.new("uint64_t *")
    _gpu_check(lib.le_gpu_host_device_pointer(ffi.cast("void *", host_addr), out), "le_gpu_host_device_pointer")
    return int(out[0])


def gpu_host_unregister(host_addr: int) -> None:
    _gpu_check(lib.le_gpu_host_unregister(ffi.cast("void *", host_addr)), "le_gpu_host_unregister")


def gpu_host_alloc(nbytes: int):
    """Pinned host memory -> (pointer, writable cffi buffer of nbytes); free with gpu_host_free(pointer)."""
    p = ffi.new("void **")
    _gpu_check(lib.le_gpu_host_alloc(p, int(nbytes)), "le_gpu_host_alloc")
    return p[0], ffi.buffer(p[0], int(nbytes))


def gpu_host_free(ptr) -> None:
    _gpu_check(lib.le_gpu_host_free(ptr), "le_gpu_host_free")


def gpu_stream_create(ordered: bool = False):
    """ordered: the stream waits for earlier default-stream work and the default stream waits for it."""
    p = ffi.new("le_gpu_stream **")
    if ordered:
        _gpu_check(lib.le_gpu_stream_create_ordered(p), "le_gpu_stream_create_ordered")
    else:
        _gpu_check(lib.le_gpu_stream_create(p), "le_gpu_stream_create")
    return p[0]


def gpu_stream_destroy(stream) -> None:
    _gpu_check(lib.le_gpu_stream_destroy(stream), "le_gpu_stream_destroy")


def gpu_stream_synchronize(stream) -> None:
    _gpu_check(lib.le_gpu_stream_synchronize(_stream(stream)), "le_gpu_stream_synchronize")


def gpu_stream_query(stream) -> bool:
    """Whether every piece of work launched on `stream` so far has finished (does not wait)."""
    done = ffi.new("int *")
    _gpu_check(lib.le_gpu_stream_query(_stream(stream), done), "le_gpu_stream_query")
    return bool(done[0])


def gpu_stream_wait_event(stream, event) -> None:
    _gpu_check(lib.le_gpu_stream_wait_event(_stream(stream), event), "le_gpu_stream_wait_event")


def gpu_event_create():
    p = ffi.new("le_gpu_event **")
    _gpu_check(lib.le_gpu_event_create(p), "le_gpu_event_create")
    return p[0]


def gpu_event_destroy(event) -> None:
    _gpu_check(lib.le_gpu_event_destroy(event), "le_gpu_event_destroy")


def gpu_event_record(event, stream=None) -> None:
    _gpu_check(lib.le_gpu_event_record(event, _stream(stream)), "le_gpu_event_record")


def gpu_event_synchronize(event) -> None:
    _gpu_check(lib.le_gpu_event_synchronize(event), "le_gpu_event_synchronize")


def gpu_event_elapsed_ms(start, end) -> float:
    p = ffi.new("float *")
    _gpu_check(lib.le_gpu_event_elapsed(p, start, end), "le_gpu_event_elapsed")
    return float(p[0])


def gpu_module_load(image: bytes, name: str):
    """Loads PTX text or a cubin -> module pointer; a JIT failure's NativeError carries the JIT log."""
    p = ffi.new("le_gpu_module **")
    _gpu_check(lib.le_gpu_module_load(p, ffi.from_buffer(image), len(image), name.encode()),
               f"loading GPU module {name}")
    return p[0]


def gpu_module_log(module) -> str:
    return ffi.string(lib.le_gpu_module_log(module)).decode("utf-8", "replace")


def gpu_module_unload(module) -> None:
    _gpu_check(lib.le_gpu_module_unload(module), "le_gpu_module_unload")


def gpu_kernel_get(module, name: str):
    p = ffi.new("le_gpu_kernel **")
    _gpu_check(lib.le_gpu_kernel_get(p, module, name.encode()), f"le_gpu_kernel_get({name})")
    return p[0]


def gpu_kernel_info(kernel) -> dict:
    """{'num_regs', 'shared_bytes', 'local_bytes', 'max_threads', 'ptx_version', 'binary_version'}"""
    p = ffi.new("le_gpu_kernel_info *")
    _gpu_check(lib.le_gpu_kernel_info_get(kernel, p), "le_gpu_kernel_info_get")
    return struct_to_dict(p)


# kernel argument kinds -> (the C type a pointer to one is made of (gpu_launch_args), le_gpu_launch_packed's letter,
# the struct code of its value (gpu_launch))
_ARG_KINDS = {"ptr": ("uint64_t *", "p", "Q"), "i32": ("int32_t *", "i", "i"), "u32": ("uint32_t *", "u", "I"),
              "i64": ("int64_t *", "q", "q"), "f32": ("float *", "f", "f")}
_PACKERS: dict = {}   # kinds tuple -> (le_gpu_launch_packed's letters, struct.Struct)


def _kind(kind: str) -> tuple:
    try:
        return _ARG_KINDS[kind]
    except KeyError:
        raise ValueError(f"gpu_launch: unknown argument kind {kind!r} ({'/'.join(_ARG_KINDS)})") from None


def _packer(kinds: tuple):
    p = _PACKERS.get(kinds)
    if p is None:
        rows = [_kind(k) for k in kinds]
        # "@": each value at the next multiple of its size, as le_gpu_launch_packed reads them
        p = _PACKERS[kinds] = ("".join(r[1] for r in rows).encode(), struct.Struct("@" + "".join(r[2] for r in rows)))
    return p


def gpu_launch(kernel, grid, block, args, shared_bytes: int = 0, stream=None) -> None:
    """grid, block: (x, y, z); args: [(kind, value)] with kind in ptr/i32/u32/i64/f32, in parameter order. The values
    go packed in one buffer (le_gpu_launch_packed): ~2 us of Python a launch, not an allocation per argument."""
    letters, packer = _packer(tuple(k for k, _ in args))
    try:
        blob = packer.pack(*(v for _, v in args))
    except struct.error as e:
        raise OverflowError(f"gpu_launch: an argument does not fit its kind ({e})") from None
    gx, gy, gz = grid
    bx, by, bz = block
    _gpu_check(lib.le_gpu_launch_packed(kernel, gx, gy, gz, bx, by, bz, int(shared_bytes), _stream(stream), letters,
                                        blob, len(blob)), "le_gpu_launch")


def gpu_launch_args(args):
    """Kernel parameters prepared once for gpu_replay: [(kind, value)] -> (params, keep); `keep` owns the storage
    `params` points into and must live as long as the launch may be replayed."""
    keep = [ffi.new(_kind(kind)[0], value) for kind, value in args]
    params = ffi.new("void *[]", [ffi.cast("void *", k) for k in keep]) if keep else ffi.NULL
    return params, keep


def gpu_replay(launches, stream=None) -> None:
    """launches: [(kernel, grid, block, shared_bytes, stream, params)] with params from gpu_launch_args, launched in
    order (a decode step recorded once: legacy_engine.gpu.LaunchPlan); `stream` given: all of them on it."""
    launch = lib.le_gpu_launch
    for kernel, (gx, gy, gz), (bx, by, bz), shared, s, params in launches:
        rc = launch(kernel, gx, gy, gz, bx, by, bz, shared, _stream(s if stream is None else stream), params)
        if rc:
            _gpu_check(rc, "le_gpu_launch (replayed plan)")


def gpu_graphs_available() -> bool:
    return bool(lib.le_gpu_graphs_available())


def gpu_capture(launches, stream):
    """The launches (gpu_replay's form) captured on `stream` (not the default one) as an instantiated CUDA graph;
    nothing runs. On an error the capture is abandoned and the error raised."""
    _gpu_check(lib.le_gpu_capture_begin(stream), "le_gpu_capture_begin")
    try:
        gpu_replay(launches, stream)
    except BaseException:
        lib.le_gpu_capture_end(stream, ffi.NULL)
        raise
    p = ffi.new("le_gpu_graph **")
    _gpu_check(lib.le_gpu_capture_end(stream, p), "le_gpu_capture_end")
    return p[0]


def gpu_graph_launch(graph, stream) -> None:
    _gpu_check(lib.le_gpu_graph_launch(graph, stream), "le_gpu_graph_launch")


def gpu_graph_destroy(graph) -> None:
    _gpu_check(lib.le_gpu_graph_destroy(graph), "le_gpu_graph_destroy")
