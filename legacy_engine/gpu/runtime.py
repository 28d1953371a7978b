"""The CUDA driver's objects through the C core (native/gpu.c, libcuda dlopened): the device, memory (device,
pinned host), streams, events, modules and kernels, recorded launch plans (replayed launch by launch or as CUDA
graphs)."""
from __future__ import annotations

import statistics

import numpy as np

from ..core.errors import UnavailableError


def _native():
    from ..core import _native as n   # imported late: building PTX needs no compiled core
    return n


def available() -> tuple[bool, str]:
    """(True, "") when a driver and a device are there, else (False, why)."""
    info = _native().gpu_info()
    if not info["available"]:
        return False, info["reason"]
    if info["device_count"] < 1:
        return False, "the CUDA driver sees no device"
    return True, ""


def init(device: int = 0) -> dict:
    """Opens `device` (UnavailableError with the reason when there is no driver or device) -> its info."""
    ok, why = available()
    if not ok:
        raise UnavailableError(f"no usable GPU: {why}")
    n = _native()
    n.gpu_init(device)
    return n.gpu_info()["devices"][device]


def device_arch(device: int = 0) -> int:
    d = _native().gpu_info()["devices"][device]
    return d["cc_major"] * 10 + d["cc_minor"]


def set_budget(nbytes: int | None) -> None:
    """VRAM budget for every Buffer (None: none); a Buffer beyond it raises NativeError (LE_ERR_NO_MEMORY)."""
    _native().gpu_set_budget(nbytes)


def mem_stats() -> dict:
    return _native().gpu_mem_stats()


def _ensure_open() -> None:
    """Opens device 0 on first use (UnavailableError with the reason when there is none)."""
    if _native().gpu_current_device() < 0:
        init()


class Buffer:
    """Device memory; freed by free(), by `with`, or when garbage-collected."""

    def __init__(self, nbytes: int, what: str = "buffer"):
        _ensure_open()
        self.nbytes = int(nbytes)
        self.what = what
        self.ptr = _native().gpu_alloc(self.nbytes, what)

    @classmethod
    def from_array(cls, a, what: str = "buffer") -> "Buffer":
        a = np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a
        mv = memoryview(a).cast("B")
        b = cls(max(mv.nbytes, 1), what)
        if mv.nbytes:
            b.upload(mv)
        return b

    def upload(self, src, stream: "Stream | None" = None) -> None:
        n = memoryview(src).nbytes
        if n > self.nbytes:
            raise ValueError(f"{n} bytes do not fit the {self.nbytes}-byte {self.what}")
        _native().gpu_copy_htod(self.ptr, src, n, None if stream is None else stream.handle)

    def download(self, out=None, dtype=np.uint8, count: int | None = None, stream: "Stream | None" = None):
        """-> a numpy array of `count` `dtype` items (default: the whole buffer), or fills `out`."""
        if out is None:
            dt = np.dtype(dtype)
            out = np.empty(self.nbytes // dt.itemsize if count is None else count, dtype=dt)
        n = memoryview(out).nbytes
        if n > self.nbytes:
            raise ValueError(f"{n} bytes asked from the {self.nbytes}-byte {self.what}")
        _native().gpu_copy_dtoh(out, self.ptr, n, None if stream is None else stream.handle)
        return out

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            _native().gpu_free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __del__(self):
        try:
            self.free()
        except Exception:   # interpreter shutdown or a closed context: nothing left to free
            pass


class BufferView(Buffer):
    """nbytes of a Buffer from an offset, read and written as a Buffer; it owns nothing (free() forgets the address,
    the Buffer keeps the memory)."""

    def __init__(self, parent: Buffer, offset: int, nbytes: int, what: str = "view"):
        if offset < 0 or offset + nbytes > parent.nbytes:
            raise ValueError(f"{what}: bytes {offset}…{offset + nbytes} outside the {parent.nbytes}-byte {parent.what}")
        self.parent, self.nbytes, self.what = parent, int(nbytes), what
        self.ptr = parent.ptr + int(offset)

    def free(self) -> None:
        self.ptr = 0


class PinnedBuffer:
    """Page-locked host memory (fast and asynchronous copies); .array is a uint8 numpy view."""

    def __init__(self, nbytes: int):
        _ensure_open()
        self.nbytes = int(nbytes)
        self.ptr, buf = _native().gpu_host_alloc(self.nbytes)
        self.array = np.frombuffer(buf, dtype=np.uint8)

    def free(self) -> None:
        if self.ptr is not None:
            ptr, self.ptr = self.ptr, None
            self.array = None
            _native().gpu_host_free(ptr)

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


class Stream:
    """ordered=False: independent of the default stream (cudaStreamNonBlocking); True: ordered with it both ways
    (work launched on the default stream before runs first, work launched there after waits)."""

    def __init__(self, ordered: bool = False):
        _ensure_open()
        self.handle = _native().gpu_stream_create(ordered)

    def synchronize(self) -> None:
        _native().gpu_stream_synchronize(self.handle)

    def query(self) -> bool:
        """Whether the work launched on this stream so far has finished (does not wait)."""
        return _native().gpu_stream_query(self.handle)

    def wait(self, event: "Event") -> None:
        """Work launched on this stream from now on waits for `event`."""
        _native().gpu_stream_wait_event(self.handle, event.handle)

    def __del__(self):
        try:
            if self.handle is not None:
                _native().gpu_stream_destroy(self.handle)
                self.handle = None
        except Exception:
            pass


def wait_default(event: "Event") -> None:
    """Work launched on the default stream from now on waits for `event`."""
    _native().gpu_stream_wait_event(None, event.handle)


class Event:
    def __init__(self):
        _ensure_open()
        self.handle = _native().gpu_event_create()

    def record(self, stream: Stream | None = None) -> None:
        _native().gpu_event_record(self.handle, None if stream is None else stream.handle)

    def synchronize(self) -> None:
        _native().gpu_event_synchronize(self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded; waits for `end`)."""
        end.synchronize()
        return _native().gpu_event_elapsed_ms(self.handle, end.handle)

    def __del__(self):
        try:
            if self.handle is not None:
                _native().gpu_event_destroy(self.handle)
                self.handle = None
        except Exception:
            pass


class Module:
    """A loaded PTX/cubin image; kernel(name) fetches its functions."""

    def __init__(self, image: bytes, name: str):
        _ensure_open()
        self.name = name
        self.handle = _native().gpu_module_load(image, name)
        self._kernels: dict[str, Kernel] = {}

    @property
    def jit_log(self) -> str:
        return _native().gpu_module_log(self.handle)

    def kernel(self, name: str) -> "Kernel":
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name, _native().gpu_kernel_get(self.handle, name))
        return self._kernels[name]

    def unload(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            self._kernels.clear()
            _native().gpu_module_unload(h)

    def __del__(self):
        try:
            self.unload()
        except Exception:
            pass


class Kernel:
    def __init__(self, module: Module, name: str, handle):
        self.module, self.name, self.handle = module, name, handle

    def info(self) -> dict:
        """Registers, shared/local bytes, PTX and binary versions as the driver compiled it."""
        return _native().gpu_kernel_info(self.handle)

    def launch(self, grid, block, args, shared_bytes: int = 0, stream: Stream | None = None) -> None:
        """grid/block: (x, y, z); args: [(kind, value)], kind in ptr/i32/u32/i64/f32 (Buffer -> its ptr).
        Inside `record()` the launch is also appended to the recording."""
        args = [(k, v.ptr if isinstance(v, Buffer) else v) for k, v in args]
        sh = None if stream is None else stream.handle
        if _RECORDING is not None:
            _RECORDING.append((self.handle, tuple(grid), tuple(block), args, shared_bytes, sh))
        _native().gpu_launch(self.handle, grid, block, args, shared_bytes, sh)


_RECORDING: list | None = None


class record:
    """`with gpu.record() as launches:` every kernel launched inside runs as usual and is appended to `launches`
    (for LaunchPlan). Not reentrant."""

    def __enter__(self) -> list:
        global _RECORDING
        if _RECORDING is not None:
            raise RuntimeError("gpu.record() is already active")
        _RECORDING = []
        return _RECORDING

    def __exit__(self, *exc):
        global _RECORDING
        _RECORDING = None


def graphs_available() -> bool:
    """The driver exports the CUDA graph entry points (11.4+)."""
    _ensure_open()
    return _native().gpu_graphs_available()


def host_step(fn) -> None:
    """Runs fn() now; inside record() the recording also keeps the call, and a LaunchPlan made from it calls fn
    again at that point of every replay, between the launches before and after it (the hybrid decode reads the
    routing and runs the CPU's experts there: fn's copies on the default stream order it with the launches)."""
    if _RECORDING is not None:
        _RECORDING.append(("host", fn))
    fn()


class LaunchPlan:
    """A recorded sequence of launches with their arguments prepared once; replay() launches them again in order
    (~1 µs of Python per launch instead of ~30). Valid while every buffer it names is alive and where it was.
    Host steps (host_step) in the recording split it into segments; replay() calls each host step between them.

    graph=True: each segment of launches is also captured once as a CUDA graph on one stream ordered with the
    default stream, and replays as one cuGraphLaunch (no per-kernel host cost; the order with default-stream copies
    before and after, the host steps' included, is kept). Every recorded launch must have been on the default
    stream."""

    def __init__(self, launches: list, graph: bool = False):
        n = _native()
        self._keep = []
        self._graphs: list = []
        self._stream = None
        self._parts: list = []       # [("launches", prepared) | ("graph", graph) | ("host", fn)] in order
        self._n = 0
        if graph:
            if any(item[0] != "host" and item[5] is not None for item in launches):
                raise ValueError("LaunchPlan(graph=True): a recorded launch is on a non-default stream")
            self._stream = Stream(ordered=True)
        seg: list = []
        for item in list(launches) + [None]:
            if item is not None and item[0] != "host":
                handle, grid, block, args, shared, stream = item
                params, keep = n.gpu_launch_args(args)
                self._keep.append((params, keep))
                seg.append((handle, grid, block, shared, stream, params))
                continue
            if seg:
                self._n += len(seg)
                if graph:
                    g = n.gpu_capture(seg, self._stream.handle)
                    self._graphs.append(g)
                    self._parts.append(("graph", g))
                else:
                    self._parts.append(("launches", seg))
                seg = []
            if item is not None:
                self._parts.append(("host", item[1]))

    def __len__(self) -> int:
        return self._n

    @property
    def graph(self) -> bool:
        return self._stream is not None

    @property
    def host_steps(self) -> int:
        return sum(kind == "host" for kind, _ in self._parts)

    def replay(self) -> None:
        n = _native()
        for kind, what in self._parts:
            if kind == "graph":
                n.gpu_graph_launch(what, self._stream.handle)
            elif kind == "launches":
                n.gpu_replay(what)
            else:
                what()

    def __del__(self):
        try:
            for g in self._graphs:
                _native().gpu_graph_destroy(g)
            self._graphs = []
        except Exception:
            pass


def synchronize() -> None:
    _native().gpu_synchronize()


def time_ms(launch, reps: int, warmup: int = 1) -> float:
    """Milliseconds per call of `launch` (work on the default stream), timed by events after `warmup` calls."""
    for _ in range(warmup):
        launch()
    e0, e1 = Event(), Event()
    e0.record()
    for _ in range(reps):
        launch()
    e1.record()
    return e0.elapsed_ms(e1) / reps


def median_ms(launch, reps: int) -> float:
    """The median milliseconds of one call of `launch` (work on the default stream), events around each call: a
    call's own time, where time_ms averages calls in a row."""
    out = []
    for _ in range(reps):
        e0, e1 = Event(), Event()
        e0.record()
        launch()
        e1.record()
        out.append(e0.elapsed_ms(e1))
    return statistics.median(out)
