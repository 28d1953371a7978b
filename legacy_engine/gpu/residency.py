"""Residency: every weight and expert byte of a GPU model and where it lives, as its Placement says. The resident
tensors in one allocation (uploaded once, types without a GPU kernel dequantised to f32 and listed in `converted`);
a tensor read from host memory over the link; where the routed experts stream: the weight map page-locked in place,
per layer the pinned experts in a pin store, the staging slots (layout.STAGING_LAYERS of them, one allocation: the
staging pool) a pass copies its experts into on a copy stream (the next layer's while this one computes), the pinned
ones put beside them by a copy kernel, a pass's last row's experts fetched by the GPU itself (fetch); the decode
extras copied back into the pool after a prefill (the hybrid channel keeps their state)."""
from __future__ import annotations

import time

import numpy as np

from .. import gpu
from ..core import _native
from ..core.errors import EngineError, UnavailableError
from ..format.schema import weights
from . import layout
from .layout import ALLOC_GRANULE, align_up, expert_tensors, expected_distinct

# The streamed prefill puts a layer's pinned experts into its staging (beside the copied ones: the grouped GEMMs read
# one array) with a copy kernel on the compute stream (hybrid_fetch), not cuMemcpyDtoDAsync: the driver runs a
# device-to-device memcpy on a copy engine, where it queued behind the next layer's host copies. Measured (35B-A3B
# skewed, 2048 tokens, 6 GiB, H200, alternated in one process, .lebench pinab): 6,089 vs 5,885 tok/s, the GPU
# waiting for expert copies 14 vs 26 ms a prefill.
PIN_COPY_KERNEL = True

# f32 vectors the forward runs as a one-row matrix (_W), not as an array: the shared expert's gate [E]
MATRIX_VECTORS = {"ffn_gate_inp_shexp"}


def consecutive_runs(ids) -> list[tuple[int, int]]:
    """[(index of its first id, length)] of each run of consecutive ids in sorted `ids` (one copy each)."""
    runs, j = [], 0
    while j < len(ids):
        r = j
        while r + 1 < len(ids) and ids[r + 1] == ids[r] + 1:
            r += 1
        runs.append((j, r - j + 1))
        j = r + 1
    return runs

class _W:
    """A weight in VRAM: ptr (device address of expert 0 / the row range), ggml type (gpu.F32 for f32),
    rows, cols, bytes from one expert to the next (3-D tensors)."""
    __slots__ = ("ptr", "qtype", "nrows", "ncols", "expert_bytes")

    def __init__(self, ptr: int, qtype: int, nrows: int, ncols: int, expert_bytes: int = 0):
        self.ptr, self.qtype, self.nrows, self.ncols, self.expert_bytes = ptr, qtype, nrows, ncols, expert_bytes

class Residency:
    """file: the model's file; placement: where its tensors live (placement.Placement); kernels: the model's (the
    pins' copy kernel); simulate_link: GB/s the streamed copies are paced to (GpuOptions.simulate_link)."""

    def __init__(self, file, placement, kernels, simulate_link: float | None = None):
        self.file, self.hparams, self.placement, self.k = file, file.hparams, placement, kernels
        self.stream = placement.stream
        self.simulate_link = simulate_link
        self.host = None           # (address, bytes) of the page-locked weight map (stream mode)
        self.host_pinned_why = ""
        self._staging: list[gpu.Buffer] = []
        self.pin_copy_kernel = PIN_COPY_KERNEL   # the pinned experts into the staging by a copy kernel (or memcpy)
        self._staged: list[tuple[int, set]] = []
        # streamed-expert accounting (stream_report), and the host's wait for the routing (sorted pairs too)
        # copy_busy_s: the copy stream's time from the start to the end of each layer's host copies (events on it,
        # after its wait for the slot), copy_slowest_gbps: the slowest such layer's rate (of those >= 64 MiB)
        self.stream_stats = {"h2d_bytes": 0, "d2d_bytes": 0, "layers": 0, "copy_stall_s": 0.0, "ids_wait_s": 0.0,
                             "copy_busy_s": 0.0, "copy_slowest_gbps": 0.0}
        self._stalls: list = []
        self._copy_marks: list = []     # (event before, event after, bytes) of each layer's host copies
        self.converted: list[str] = []     # "name (TYPE)" of tensors dequantised to f32 at upload
        self._bufs: dict[str, tuple] = {}      # resident tensor -> (device address, type on the GPU)
        self._weights: gpu.Buffer | None = None
        self.vram_bytes = 0
        # the token embedding: "vram", or "host" (layout.host_embedding: page-locked host memory, rows read by
        # get_rows over the link; needs the device to address host memory)
        self.embd_where = "host" if placement.residency.get("token_embd.weight") == "host" else "vram"
        self._host_copy = None     # a page-locked copy of the host-read embedding where the map is not page-locked
        # where the experts stream (_setup_streaming): the staging pool, the layers' expert tensors and pin stores
        self.pool = None
        self.stage_layout, self.stage_names, self.stage_offset, self.host_addr = {}, {}, {}, {}
        self.pin_store, self.pin_off, self.pin_idx, self.pin_lists = {}, {}, {}, {}

    def load(self, progress) -> None:
        """Everything into VRAM (and the weight map page-locked where the experts stream); a failed load leaves no
        memory behind."""
        try:
            self._upload_all(progress)
        except BaseException:
            for b in [self._weights, self.pool] + list(self.pin_store.values()):
                if b is not None:
                    b.free()
            if self.host is not None:
                _native.gpu_host_unregister(self.host[0])
            if self._host_copy is not None:
                self._host_copy.free()
            raise

    def _upload(self, name: str) -> tuple[int, int]:
        """Uploads tensor `name` once into its place in the weight allocation -> (device address, ggml type as
        stored on the GPU)."""
        if name in self._bufs:
            return self._bufs[name]
        if name == "token_embd.weight" and self.embd_where == "host":
            return self._host_tensor(name)
        t = self.file.tensors[name]
        data = self.file.gguf.data(name)
        qtype = t.type
        if qtype != gpu.F32 and qtype not in gpu.GPU_TYPES:
            n_el = int(np.prod(t.ne))
            data = _native.dequantize_row(qtype, data, n_el)
            self.converted.append(f"{name} ({_native.type_traits(qtype)['name']})")
            qtype = gpu.F32
        raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        ptr = self._weights.ptr + self._woff[name]
        if raw.nbytes:
            _native.gpu_copy_htod(ptr, raw, raw.nbytes)
        self._bufs[name] = (ptr, qtype)
        return ptr, qtype

    def _host_tensor(self, name: str) -> tuple[int, int]:
        """A tensor the GPU reads where it lies in host memory (layout.host_embedding), over the link: the weight
        map's device address where the map is page-locked (_setup_streaming), else a page-locked copy of it ->
        (device address, ggml type)."""
        if not _native.gpu_attribute(gpu.ATTR_UNIFIED_ADDRESSING):
            raise UnavailableError(f"{name} stays in host memory when the experts stream, and this GPU cannot address "
                                   "host memory (no unified addressing: a 64-bit host and driver)")
        t, data = self.file.tensors[name], self.file.gguf.data(name)
        if self.host is not None:
            addr = _native.gpu_host_device_pointer(self.map_base) + (_native.host_address(data) - self.map_base)
        else:
            raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
            self._host_copy = gpu.PinnedBuffer(max(raw.nbytes, 1))
            self._host_copy.array[:raw.nbytes] = raw
            addr = _native.gpu_host_device_pointer(int(_native.ffi.cast("uintptr_t", self._host_copy.ptr)))
        self._bufs[name] = (addr, t.type)
        return addr, t.type

    def _w(self, name: str, rows: tuple[int, int] | None = None, expert_rows: tuple[int, int] | None = None) -> _W:
        """The weight `name` ([ne1, ne0] or [ne2, ne1, ne0]); rows: a row range of a fused 2-D tensor;
        expert_rows: a row range inside every expert of a fused 3-D tensor. A streamed expert tensor's ptr is its
        offset inside a staging buffer (the layer's layout, stage_layout)."""
        t = self.file.tensors[name]
        if name in self._exp_names:
            if t.type != gpu.F32 and t.type not in gpu.GPU_TYPES:
                raise UnavailableError(f"{name}: {_native.type_traits(t.type)['name']} has no GPU kernel, so it "
                                       "cannot be streamed (run it resident: it is dequantised at upload)")
            ptr, qtype = self.stage_offset[name], t.type
        else:
            ptr, qtype = self._upload(name)
        ne = list(t.ne) + [1, 1]
        ncols, nrows, n_exp = ne[0], ne[1], ne[2]
        if qtype == gpu.F32:
            row_bytes = 4 * ncols
        else:
            _, bs, ts = gpu.GPU_TYPES[qtype]
            row_bytes = ncols // bs * ts
        expert_bytes = row_bytes * nrows
        for r in (rows, expert_rows):
            if r is not None:
                ptr += r[0] * row_bytes
                nrows = r[1] - r[0]
        return _W(ptr, qtype, nrows, ncols, expert_bytes if n_exp > 1 or expert_rows else 0)

    def _f32(self, name: str) -> int:
        ptr, qtype = self._upload(name)
        if qtype != gpu.F32:
            raise EngineError(f"{name}: expected an f32 tensor")
        return ptr

    def _upload_all(self, progress) -> None:
        hp, T = self.hparams, self.file.tensors
        self._exp_names = {n for n, where in self.placement.residency.items() if where == "streamed"}
        names = list(self.placement.offsets)
        # every resident tensor in one allocation (the placement's offsets: the footprint counts the same bytes)
        self._woff, total = self.placement.offsets, self.placement.weight_bytes
        self._weights = gpu.Buffer(max(total, 256), "weights")
        self.vram_bytes += self._weights.nbytes
        it = progress(names) if progress else names
        for n in it:
            self._upload(n)
        if self.stream:
            self._setup_streaming(progress)
        self.embd = self._w("token_embd.weight")    # in VRAM, or read from host memory (embd_where)
        self.out_norm = self._f32("output_norm.weight")
        self.head = self._w("output.weight") if "output.weight" in T else self.embd
        self.layers = [self._layer(i) for i in range(hp.n_layer)]

    def _layer(self, i: int) -> dict:
        """Layer i's weights by slot name (format/schema.py: "attn_qkv", "ffn_gate_exps" …): f32 arrays' device
        addresses, matrices as _W; "exp_tensor": {expert slot: its file tensor} where the layer has experts."""
        L: dict = {"index": i}
        for w in weights(self.hparams, i, self.file.tensors):
            if w.f32 and w.slot not in MATRIX_VECTORS:
                L[w.slot] = self._f32(w.tensor)
            elif w.expert:
                L[w.slot] = self._w(w.tensor, expert_rows=w.rows)
                L.setdefault("exp_tensor", {})[w.slot] = w.tensor
            else:
                L[w.slot] = self._w(w.tensor, rows=w.rows)
        for name in MATRIX_VECTORS & L.keys():   # an [E] vector run as a one-row matrix
            L[name].nrows, L[name].ncols = 1, self.hparams.n_embd
        return L

    def _setup_streaming(self, progress) -> None:
        """Host addresses of every layer's expert tensors (the weight map, page-locked in place), the staging
        layout (tensor offsets inside one buffer), pinned experts uploaded."""
        hp, gg = self.hparams, self.file.gguf
        base = self.map_base = _native.host_address(gg._map)
        self._map_np = np.asarray(gg._map).view(np.uint8).reshape(-1)
        nbytes = int(gg._map.nbytes)
        try:
            _native.gpu_host_register(base, nbytes, read_only=not gg._map.flags.writeable)
            self.host = (base, nbytes)
            self.host_pinned_why = "page-locked in place"
        except Exception as e:     # said in describe() and by `run`; the copies then go through the driver's staging
            self.host_pinned_why = f"NOT page-locked ({e}); copies run from pageable memory, slower"
        self.stage_layout: dict[int, list] = {}     # layer -> [(host address, tensor bytes, expert bytes, offset,
        #                                               offset of the tensor's pinned experts in the pin store)]
        self.stage_offset: dict[str, int] = {}
        self.host_addr: dict[str, int] = {}          # expert tensor -> its host address in the weight map
        self.stage_names: dict[int, list] = {}       # layer -> its expert tensors, in stage_layout's order
        self.pin_store: dict[int, gpu.Buffer] = {}  # layer -> pinned experts of every tensor, tensor-major
        self.pin_off: dict[str, int] = {}            # expert tensor -> offset of its pinned experts in the store
        self.pin_idx: dict[int, np.ndarray] = {}     # layer -> [n_expert] int32: index in the store or -1
        self.pin_lists: dict[int, tuple] = {}         # layer -> (device int32 [2, n]: ranks 0..n-1, expert ids; n),
        #                                               where its copy kernel's 16-byte words fit (else cuMemcpyDtoD)
        layer_max = 0
        for i in range(hp.n_layer):
            off, lay = 0, []
            for name in expert_tensors(self.file, i):
                t, data = self.file.tensors[name], gg.data(name)
                lay.append((_native.host_address(data), int(t.n_bytes), int(t.n_bytes) // hp.n_expert, off, 0))
                self.stage_offset[name] = off
                self.host_addr[name] = _native.host_address(data)
                off += int(t.n_bytes)
            if lay:
                self.stage_layout[i] = lay
                self.stage_names[i] = expert_tensors(self.file, i)
                layer_max = max(layer_max, off)
        self._build_pins()
        # the staging slots in one allocation (layout.staging_pool_bytes), which holds the hybrid decode's
        # extras between prefills (the placement's extras_at: per layer its link/early slots, then its extras)
        half, d = align_up(max(layer_max, 256), ALLOC_GRANULE), layout.STAGING_LAYERS
        self.pool = gpu.Buffer(d * half, f"expert staging ({d} layers)")
        self._staging = [gpu.BufferView(self.pool, j * half, half, f"expert staging {j}") for j in range(d)]
        self._staged = [(-1, set()) for _ in range(d)]
        if self.placement.decode_extras and self.host is None:
            raise UnavailableError(f"decode_extras: the weight map is {self.host_pinned_why}; the extras are "
                                   "copied back after each prefill from page-locked memory only")
        self.copy_stream = gpu.Stream()
        self._slot_free = [gpu.Event() for _ in range(d)]
        self._slot_ready = [gpu.Event() for _ in range(d)]
        self._slot_used = [False] * d
        self._d2d: list[list] = [[] for _ in range(d)]   # per slot: pinned experts' (dst, src, bytes) not yet copied
        self._pin_copy: list = [None] * d    # per slot: the layer whose pins the copy kernel puts there at the wait

    def _build_pins(self) -> None:
        """Every layer's pin store from the placement's pins: its experts tensor-major, then the copy kernel's lists;
        the tensors' offsets there (pin_off, the stage layout's last field), the expert -> index tables (pin_idx)."""
        hp, gg = self.hparams, self.file.gguf
        for i, lay in self.stage_layout.items():
            es = list(self.placement.pinned.get(i, ()))
            pin_off, new = 0, []
            for (host, tb, eb, off, _po), name in zip(lay, self.stage_names[i]):
                new.append((host, tb, eb, off, pin_off))
                self.pin_off[name] = pin_off
                pin_off += len(es) * eb
            self.stage_layout[i] = new
            self.pin_idx[i] = np.full(hp.n_expert, -1, dtype=np.int32)
            self.pin_idx[i][es] = np.arange(len(es), dtype=np.int32)
            if not es:
                continue
            # after the experts: their ranks in the store and their ids (int32 [2, n]), the copy kernel's lists
            # (the layout layout.pin_store_bytes counts)
            lists = np.concatenate([np.arange(len(es)), np.asarray(es)]).astype(np.int32).view(np.uint8)
            body = align_up(pin_off, 16)
            store = self.pin_store[i] = gpu.Buffer(body + lists.nbytes, f"pinned experts of layer {i}")
            for (host, _tb, eb, _off, po), name in zip(new, self.stage_names[i]):
                for j, n in consecutive_runs(es):
                    if self.host is not None:    # from the page-locked map, by DMA
                        _native.gpu_copy_htod_addr(store.ptr + po + j * eb, host + es[j] * eb, n * eb,
                                                   _native.ffi.NULL)
                    else:
                        _native.gpu_copy_htod(store.ptr + po + j * eb, gg.data(name)[es[j] * eb:(es[j] + n) * eb],
                                              n * eb)
            _native.gpu_copy_htod(store.ptr + body, lists, lists.nbytes)
            if all(eb % 16 == 0 and off % 16 == 0 and po % 16 == 0 for _h, _t, eb, off, po in new):
                self.pin_lists[i] = (store.ptr + body, len(es))
            self.vram_bytes += store.nbytes
        gpu.synchronize()

    def apply(self, placement) -> None:
        """A new placement's pinned experts (the same bytes or fewer: its footprint fits the budget), uploaded in
        place of the old ones; the staging's contents forgotten (its decode extras' regions are the placement's)."""
        gpu.synchronize()
        for b in self.pin_store.values():
            self.vram_bytes -= b.nbytes
            b.free()
        self.pin_store, self.pin_off, self.pin_idx, self.pin_lists = {}, {}, {}, {}
        self.placement = placement
        self._build_pins()
        d = len(self._staging)
        self._staged = [(-1, set()) for _ in range(d)]
        self._d2d, self._pin_copy = [[] for _ in range(d)], [None] * d

    def stage(self, i: int, want, wait: bool = True) -> int:
        """Makes staging slot i % depth hold experts `want` of layer i (host copies on the copy stream, after the
        compute that last read the slot); records the slot's ready event, and (wait) makes the default stream wait
        for it and copies the pinned experts in there on the default stream (on the copy stream they stalled its host
        copies behind the SMs' work): all of the layer's by the copy kernel (pin_copy_kernel, _copy_pins), else
        cuMemcpyDtoD runs of consecutive pins. -> the slot's device address."""
        s = i % len(self._staging)
        layer, have = self._staged[s]
        if layer != i:
            have = set()
        need = sorted(set(int(e) for e in want) - have)
        if need:
            t_issue, h2d0 = time.perf_counter(), self.stream_stats["h2d_bytes"]
            if self._slot_used[s]:
                self.copy_stream.wait(self._slot_free[s])
            c0 = gpu.Event()
            c0.record(self.copy_stream)
            dst0 = self._staging[s].ptr
            pins = {e: j for j, e in enumerate(self.placement.pinned.get(i, []))}
            h = self.copy_stream.handle
            for host, tbytes, eb, off, pin_off in self.stage_layout[i]:
                run: list[int] = []
                for e in need + [None]:
                    if e is not None and e not in pins and (not run or e == run[-1] + 1):
                        run.append(e)
                        continue
                    if run:                                   # one copy per run of consecutive host experts
                        nb = len(run) * eb
                        if self.host is not None:
                            _native.gpu_copy_htod_addr(dst0 + off + run[0] * eb, host + run[0] * eb, nb, h)
                        else:
                            at = host - self.map_base + run[0] * eb
                            _native.gpu_copy_htod(dst0 + off + run[0] * eb, self._map_np[at:at + nb], nb, h)
                        self.stream_stats["h2d_bytes"] += nb
                        run = []
                    if e is None:
                        break
                    if e in pins:
                        if self.pin_copy_kernel and i in self.pin_lists:   # all the layer's, by the kernel
                            self._pin_copy[s] = i
                            continue
                        dst, src = dst0 + off + e * eb, self.pin_store[i].ptr + pin_off + pins[e] * eb
                        d2d = self._d2d[s]
                        if d2d and d2d[-1][0] + d2d[-1][2] == dst and d2d[-1][1] + d2d[-1][2] == src:
                            d2d[-1][2] += eb                  # the next pin of a run: one copy
                        else:
                            d2d.append([dst, src, eb])
                        self.stream_stats["d2d_bytes"] += eb
                    else:
                        run = [e]
            self._staged[s] = (i, have | set(need))
            c1 = gpu.Event()
            c1.record(self.copy_stream)
            self._copy_marks.append((c0, c1, self.stream_stats["h2d_bytes"] - h2d0))
            if self.simulate_link:
                self.copy_stream.synchronize()
                copied = self.stream_stats["h2d_bytes"] - h2d0
                rest = copied / (self.simulate_link * 1e9) - (time.perf_counter() - t_issue)
                if rest > 0:
                    time.sleep(rest)
        self._slot_ready[s].record(self.copy_stream)
        if wait:
            e0 = gpu.Event()
            e0.record()
            gpu.wait_default(self._slot_ready[s])
            e1 = gpu.Event()
            e1.record()
            self._stalls.append((e0, e1))
            if self._pin_copy[s] is not None:      # ordered after the slot's last reader on this stream
                self._copy_pins(self._pin_copy[s], self._staging[s].ptr)
            for dst, src, nb in self._d2d[s]:
                _native.gpu_copy_dtod(dst, src, nb, _native.ffi.NULL)
            self._d2d[s], self._pin_copy[s] = [], None
        return self._staging[s].ptr

    def can_fetch(self, i: int) -> bool:
        """Whether layer i's experts for one token can be fetched by the GPU itself (fetch): the weight map
        page-locked and addressable from the device, 16-byte expert rows, the link not simulated (its pacing is the
        copy stream's), and the layer not staged already (a prefetch of all of it)."""
        return (self.host is not None and not self.simulate_link and i in self.stage_layout
                and self._staged[i % len(self._staging)][0] != i
                and _native.gpu_attribute(gpu.ATTR_UNIFIED_ADDRESSING)
                and all(eb % 16 == 0 and off % 16 == 0 and host % 16 == 0
                        for host, _tb, eb, off, _po in self.stage_layout[i]))

    def fetch(self, i: int, ids: int, k: int) -> int:
        """Layer i's experts ids (device int32 [k], one token's routing) from the page-locked weight map into their
        places in staging slot i % depth, by the copy kernel on the compute stream: no host wait for the routing (a
        pass's last row: _forward_chunk's last layer). The slot's earlier readers are on this stream, later copies
        into it wait for release(i). -> the slot's device address."""
        s = i % len(self._staging)
        dst0, dev = self._staging[s].ptr, _native.gpu_host_device_pointer(self.map_base)
        tensors = [(dev + host - self.map_base, dst0 + off, eb) for host, _tb, eb, off, _po in self.stage_layout[i]]
        self.k.hybrid_fetch(ids, ids, k, tensors)
        self._staged[s] = (-1, set())          # the slot now holds neither its last layer's experts nor a full set
        self.stream_stats["h2d_bytes"] += k * sum(eb for _src, _dst, eb in tensors)
        return dst0

    def _copy_pins(self, i: int, dst0: int) -> None:
        """Every pinned expert of layer i from its pin store into its place in the staging at dst0, by the copy
        kernel on the default stream (cuMemcpyDtoD runs on a copy engine, queued with the link's copies: measured
        PIN_COPY_KERNEL's note)."""
        lists, n = self.pin_lists[i]
        tensors = [(self.pin_store[i].ptr + pin_off, dst0 + off, eb)
                   for _host, _tb, eb, off, pin_off in self.stage_layout[i]]
        for c0 in range(0, n, gpu.MOE_MAX_K):
            k = min(gpu.MOE_MAX_K, n - c0)
            self.k.hybrid_fetch(lists + 4 * c0, lists + 4 * (n + c0), k, tensors)
        self.stream_stats["d2d_bytes"] += n * sum(eb for _src, _dst, eb in tensors)

    def stream_report(self) -> dict:
        """stream_stats with copy_stall_s brought up to date: the time the GPU's compute stream sat waiting for
        expert copies (events around each wait), summed since the model was made; copy_busy_s the copy stream's time
        copying (a stall with the link busy is a slow link, with it idle a late issue), copy_slowest_gbps the
        slowest layer's rate."""
        for e0, e1 in self._stalls:
            self.stream_stats["copy_stall_s"] += e0.elapsed_ms(e1) / 1e3
        self._stalls = []
        for c0, c1, nb in self._copy_marks:
            dt = c0.elapsed_ms(c1) / 1e3
            self.stream_stats["copy_busy_s"] += dt
            if nb >= 64 << 20 and dt > 0:
                gbps = nb / dt / 1e9
                slow = self.stream_stats["copy_slowest_gbps"]
                self.stream_stats["copy_slowest_gbps"] = gbps if not slow else min(slow, gbps)
        self._copy_marks = []
        return dict(self.stream_stats)

    def next_moe(self, i: int) -> int:
        return i + 1 if i + 1 in self.stage_layout else self.hparams.n_layer

    def release(self, i: int) -> None:
        """The compute that reads slot i % depth has been issued: its end frees the slot for the copy stream."""
        s = i % len(self._staging)
        self._slot_free[s].record(None)
        self._slot_used[s] = True

    def stages_all(self, n: int) -> bool:
        """Whether a pass of n tokens stages every expert of a layer (prefetch_all's rule)."""
        hp = self.hparams
        return expected_distinct(hp.n_expert, hp.n_expert_used, n) >= hp.n_expert / 2

    def prefetch_all(self, i: int, n: int) -> None:
        """Copies every expert of layer i ahead when n tokens will likely route to most of them (expected
        distinct experts >= half), so the copy overlaps the compute of the layer before."""
        hp = self.hparams
        if i >= hp.n_layer or i not in self.stage_layout:
            return
        if self.stages_all(n):
            self.stage(i, range(hp.n_expert), wait=False)

    def fill_extras(self, slots: int) -> int:
        """The placement's decode extras back into their regions of the staging pool (after a prefill's last reads
        of its slots, on the copy stream; runs of consecutive experts), past each layer's `slots` link/early slots
        -> the bytes copied. The staging then holds no prefill's experts."""
        for s_ in range(len(self._staging)):
            if self._slot_used[s_]:
                self.copy_stream.wait(self._slot_free[s_])
        self._staged = [(-1, set()) for _ in self._staging]
        h = self.copy_stream.handle
        for i, es in self.placement.decode_extras.items():
            base, per = self.pool.ptr + self.placement.extras_at[i][0], slots + len(es)
            for host, _tb, eb, _off, _po in self.stage_layout[i]:
                for j, n in consecutive_runs(es):
                    _native.gpu_copy_htod_addr(base + (slots + j) * eb, host + es[j] * eb, n * eb, h)
                base += per * eb
        return sum(len(es) * sum(eb for _h, _t, eb, _o, _p in self.stage_layout[i])
                   for i, es in self.placement.decode_extras.items())

    def pin_table(self) -> np.ndarray:
        """int32 [n_layer, n_expert]: each pinned expert's index in its layer's pin store, -1 elsewhere (the hybrid
        decode's device table)."""
        t = np.full((self.hparams.n_layer, self.hparams.n_expert), -1, dtype=np.int32)
        for i, idx in self.pin_idx.items():
            t[i] = idx
        return t

    def close(self) -> None:
        """Frees the weights, pin stores and staging now, unlocks the host weight map."""
        for b in [self._weights, self.pool] + list(self.pin_store.values()):
            if b is not None:
                b.free()
        self._bufs, self._staging, self.pin_store = {}, [], {}
        self.pool, self._weights = None, None
        if self._host_copy is not None:
            self._host_copy.free()
            self._host_copy = None
        if self.host is not None:
            _native.gpu_host_unregister(self.host[0])
            self.host = None
