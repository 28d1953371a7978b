"""GGUF container: one bounds-checked pass over the header, tensor data memory-mapped.

Why not gguf-py's GGUFReader for the header: it trusts the counts and lengths found in
the file (a truncated array with a huge element count makes it loop without end, huge
dims overflow its numpy products), and it takes ~20-27 s to read the 248k-token
vocabulary of a real Qwen3.5 file. So the header is parsed here, every count checked
against the bytes left in plain Python ints, in well under a second; gguf-py supplies
the type tables (GGMLQuantizationType, GGML_QUANT_SIZES, GGUFValueType) and is the
oracle the tests compare this reader with. Any violation is a FormatError naming the
key or tensor and what was expected.

Header arrays under keys the engine does not read (EAGER_ARRAY_KEYS say which it does) are not
turned into Python objects from LAZY_ARRAY_BYTES up: the metadata holds a GGUFArray (where the
array is), and GGUFFile.array(key) reads it on demand. A 96 MiB junk u8 array cost 865 MiB of RSS
as a list; skipped, nothing (tests/test_hostile.py).

Where the tensor data lives (GGUFFile.load_data): the file's memory map (default), or
anonymous memory filled by reading the file (--no-mmap), with a NUMA policy if asked for.

Layout (GGUF v2/v3, little-endian; spec §3.1):
  u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
  n_kv   × (string key, u32 value_type, value)
  n_tensors × (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
  padding to general.alignment | tensor data (offsets relative to here, aligned)
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..core import _native
from ..core.errors import FormatError
from ..core.memory import thp_backed_bytes

GGUF_MAGIC = 0x46554747  # "GGUF" little-endian
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_KEY_LEN = 65535            # llama.cpp rejects longer keys as well
MAX_ELEMENTS = 1 << 50         # far above any model; guards arithmetic on hostile dims
READ_CHUNK = 64 << 20          # --no-mmap reads the data section in pieces of this many bytes
PROGRESS_MIN_BYTES = 1 << 30   # --no-mmap shows a progress bar (on a terminal) from this size up
PAGE_SAMPLE = 2 << 20          # page placement is sampled once per 2 MiB (one huge page)
LAZY_ARRAY_BYTES = 1 << 20     # an array of an unused key this large stays in the file (GGUFArray)
# The header arrays the engine reads: always materialised, whatever their size.
EAGER_ARRAY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
EAGER_ARRAY_SUFFIXES = (".rope.dimension_sections", ".attention.recurrent_layers")

# byte size of each scalar value type
_SCALAR_SIZE = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. ne is in ggml order (ne[0] fastest, = row length)."""
    name: str
    type: int                 # ggml type id
    ne: tuple[int, ...]
    n_bytes: int
    offset: int               # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.type).name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFArray:
    """A header array left in the file (an unused key, LAZY_ARRAY_BYTES or more): where it is, not what it
    holds. GGUFFile.array(key) reads it; its strings are checked for UTF-8 only then."""
    elem_type: GGUFValueType
    count: int
    offset: int               # absolute byte offset of the first element
    nbytes: int


def eager_array(key: str) -> bool:
    """True for the header arrays the engine reads (materialised whatever their size)."""
    return key in EAGER_ARRAY_KEYS or key.endswith(EAGER_ARRAY_SUFFIXES)


class _Cursor:
    """Bounds-checked little-endian reads over a bytes-like object."""

    def __init__(self, buf, size: int, path: str):
        self.buf, self.size, self.pos, self.path = buf, size, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise FormatError(f"{self.path}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                              f"file has {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = struct.unpack_from("<I", self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = struct.unpack_from("<Q", self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str, max_len: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise FormatError(f"{self.path}: {what} is {n} bytes long, at most {max_len} expected")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: {what} is not valid UTF-8") from None



_SCALAR_FMT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_SCALAR_NP = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


def _value_type(cur: _Cursor, vtype: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(vtype)
    except ValueError:
        raise FormatError(f"{cur.path}: key {key!r} has unknown value type {vtype}") from None


def _read_value(cur: _Cursor, vtype: int, key: str):
    """Reads one value; returns (python value, element type)."""
    t = _value_type(cur, vtype, key)
    if t in _SCALAR_FMT:
        size = _SCALAR_SIZE[t]
        cur.need(size, f"value of {key!r}")
        v = struct.unpack_from(_SCALAR_FMT[t], cur.buf, cur.pos)[0]
        cur.pos += size
        return v, t
    if t == GGUFValueType.STRING:
        return cur.string(f"value of {key!r}"), t
    if t == GGUFValueType.ARRAY:
        it = _value_type(cur, cur.u32(f"element type of {key!r}"), key)
        count = cur.u64(f"element count of {key!r}")
        if it not in _SCALAR_SIZE and it != GGUFValueType.STRING:
            raise FormatError(f"{cur.path}: array {key!r} has element type {it.name}, which GGUF models do not use")
        if not eager_array(key):
            start = cur.pos
            nbytes = _skip_array(cur, it, count, key)
            if nbytes >= LAZY_ARRAY_BYTES:  # why: a junk array must not cost RAM (a list of 96M ints: 865 MiB)
                return GGUFArray(it, count, start, nbytes), it
            cur.pos = start
        return _read_array(cur, it, count, key), it
    raise FormatError(f"{cur.path}: key {key!r} has unhandled type {t.name}")  # pragma: no cover


def _read_array(cur: _Cursor, it: GGUFValueType, count: int, key: str) -> list:
    """The elements of an array whose type and count were read; the cursor ends past them."""
    if it in _SCALAR_SIZE:
        cur.need(count * _SCALAR_SIZE[it], f"{count} elements of {key!r}")
        arr = np.frombuffer(cur.buf, dtype=_SCALAR_NP[it], count=count, offset=cur.pos)
        cur.pos += count * _SCALAR_SIZE[it]
        return (arr.astype(bool) if it == GGUFValueType.BOOL else arr).tolist()
    # each string needs at least its 8-byte length: bounds the loop by the file size
    cur.need(count * 8, f"{count} strings of {key!r}")
    buf, pos, size = cur.buf, cur.pos, cur.size
    out = []
    unpack = struct.Struct("<Q").unpack_from
    try:
        for i in range(count):
            if pos + 8 > size:
                raise FormatError(f"{cur.path}: truncated: {key!r}[{i}] runs past the end of the file")
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise FormatError(f"{cur.path}: truncated: {key!r}[{i}] runs past the end of the file")
            out.append(str(buf[pos:pos + n], "utf-8"))
            pos += n
    except UnicodeDecodeError:
        raise FormatError(f"{cur.path}: {key!r}[{len(out)}] is not valid UTF-8") from None
    cur.pos = pos
    return out


def _skip_array(cur: _Cursor, it: GGUFValueType, count: int, key: str) -> int:
    """Moves the cursor past an array without building its elements; returns its size in bytes."""
    if it in _SCALAR_SIZE:
        nbytes = count * _SCALAR_SIZE[it]
        cur.need(nbytes, f"{count} elements of {key!r}")
        cur.pos += nbytes
        return nbytes
    cur.need(count * 8, f"{count} strings of {key!r}")
    buf, start, size = cur.buf, cur.pos, cur.size
    pos = start
    unpack = struct.Struct("<Q").unpack_from
    for i in range(count):  # only the lengths are read: no string objects
        if pos + 8 > size:
            raise FormatError(f"{cur.path}: truncated: {key!r}[{i}] runs past the end of the file")
        pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            raise FormatError(f"{cur.path}: truncated: {key!r}[{i}] runs past the end of the file")
    cur.pos = pos
    return pos - start


def parse_header(path: str) -> tuple[int, dict, dict, list[TensorInfo], int]:
    """Reads the whole header with bounds checks.

    Returns (version, metadata, value_types, tensors, data_start). Raises FormatError on any violation: bad
    magic/version, truncation, bad value types, duplicate keys or tensors, bad dims,
    unknown ggml types, misaligned offsets, data outside the file, overlapping tensors.
    """
    if os.path.isdir(path):
        raise FormatError(f"{path}: is a directory; give the path of a .gguf file")
    try:
        size = os.path.getsize(path)
        if size < 24:
            raise FormatError(f"{path}: {size} bytes is too short for a GGUF header (24 bytes)")
        with open(path, "rb") as f:
            mm = np.memmap(f, dtype=np.uint8, mode="r")
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from None
    buf = memoryview(mm)
    cur = _Cursor(buf, size, path)
    magic = cur.u32("magic")
    if magic != GGUF_MAGIC:
        raise FormatError(f"{path}: not a GGUF file (magic {magic:#010x}, expected {GGUF_MAGIC:#010x} 'GGUF')")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in SUPPORTED_VERSIONS:
            raise FormatError(f"{path}: big-endian GGUF files are not supported")
        raise FormatError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("key/value count")
    # every kv needs >= 12 bytes (key length + type), every tensor info >= 24
    if n_kv * 12 + n_tensors * 24 > size - cur.pos:
        raise FormatError(f"{path}: header claims {n_kv} keys and {n_tensors} tensors, "
                          f"more than a {size}-byte file can hold")

    metadata: dict[str, object] = {}
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType]] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"key #{i}", MAX_KEY_LEN)
        if key in metadata:
            raise FormatError(f"{path}: duplicate key {key!r}")
        vtype = cur.u32(f"value type of {key!r}")
        metadata[key], elem = _read_value(cur, vtype, key)
        value_types[key] = (GGUFValueType(vtype), elem)
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise FormatError(f"{path}: general.alignment must be uint32, found value type {vtype}")
            alignment = metadata[key]
            if alignment == 0 or alignment & (alignment - 1):
                raise FormatError(f"{path}: general.alignment = {alignment}, expected a power of two")

    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}", MAX_KEY_LEN)
        if name in names:
            raise FormatError(f"{path}: duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.u32(f"n_dims of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FormatError(f"{path}: tensor {name!r} has {n_dims} dims, expected 1..{MAX_DIMS}")
        ne = tuple(cur.u64(f"ne[{d}] of {name!r}") for d in range(n_dims))
        gtype = cur.u32(f"type of {name!r}")
        offset = cur.u64(f"offset of {name!r}")
        infos.append((name, gtype, ne, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, gtype, ne, offset in infos:
        try:
            qt = GGMLQuantizationType(gtype)
            block, tsize = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise FormatError(f"{path}: tensor {name!r} has unknown ggml type id {gtype}") from None
        n = 1
        for d in ne:
            if d < 1:
                raise FormatError(f"{path}: tensor {name!r} has a zero dimension: ne={list(ne)}")
            n *= d
            if n > MAX_ELEMENTS:
                raise FormatError(f"{path}: tensor {name!r} has an absurd size: ne={list(ne)}")
        if ne[0] % block:
            raise FormatError(f"{path}: tensor {name!r}: row length ne[0]={ne[0]} is not a multiple "
                              f"of {qt.name}'s block size {block}")
        n_bytes = n // block * tsize
        if offset % alignment:
            raise FormatError(f"{path}: tensor {name!r} offset {offset} is not aligned to {alignment}")
        start = data_start + offset
        if start + n_bytes > size:
            raise FormatError(f"{path}: tensor {name!r} ({qt.name}, ne={list(ne)}, {n_bytes} bytes at "
                              f"{start}) extends past the end of the file ({size} bytes): truncated?")
        tensors.append(TensorInfo(name, int(qt), ne, n_bytes, start))

    by_offset = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if a.offset + a.n_bytes > b.offset:
            raise FormatError(f"{path}: tensors {a.name!r} and {b.name!r} overlap")
    del buf, mm
    return version, metadata, value_types, tensors, data_start


class GGUFFile:
    """A validated, memory-mapped GGUF file.

    metadata: dict key -> Python value (str, int, float, bool, list), or a GGUFArray for a large array
    of a key the engine does not read (array(key) reads it);
    tensors: dict name -> TensorInfo; data(name) -> numpy view of a tensor's bytes, in the
    memory map, or in anonymous memory after load_data(mmap=False).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.version, self.metadata, self._types, infos, self.data_start = parse_header(self.path)
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in infos}
        self.file_size = os.path.getsize(self.path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if infos else np.zeros(0, np.uint8)
        self._base = 0  # file offset of self._map[0]

    def data(self, name: str) -> np.ndarray:
        """Raw bytes of a tensor, uint8[n_bytes], a read-only view (no copy)."""
        t = self.tensors[name]
        return self._map[t.offset - self._base:t.offset - self._base + t.n_bytes]

    def load_data(self, mmap: bool = True, numa: str = "off", node: int = -1, progress: bool | None = None) -> dict:
        """Puts the tensor data where the C core will read it; returns what the kernel did.

        Call it before handing out data() views: views taken earlier keep pointing into the map.

        mmap=True: the file's read-only memory map (np.memmap): pages come from the page cache,
          shared with other processes and kept between runs. MADV_WILLNEED starts reading the file
          now; MADV_HUGEPAGE is asked for, and on a file map the kernel usually accepts it without
          effect (huge pages back anonymous memory and tmpfs, and the page cache of a few filesystems
          only): 'huge_bytes' says what is really backed by huge pages.
        mmap=False: anonymous memory (2 MiB aligned, MADV_HUGEPAGE), filled by reading the data
          section (a progress bar from 1 GiB up on a terminal; progress=True/False forces it). The
          weights then cost RAM of their own and do not survive the process.
        numa: 'off' (the kernel's default: a page goes to the node of the CPU that first touches it),
          'interleave' (pages round-robin over every memory node), or 'node' (all on `node`).
          A page is placed when it is first allocated, so the policy comes before any touch:
          - anonymous memory: mbind on the buffer before the read fills it; every page follows it.
          - file map: page-cache pages ignore the map's mbind policy; the kernel places them by the
            policy of the thread that reads them in. So the loading thread's policy is set while the
            whole map is faulted in (the file is read now, not on first use), then put back. Pages
            already in the page cache (an earlier run, another process) stay where they are: drop the
            cache (`echo 1 > /proc/sys/vm/drop_caches`) or use mmap=False to place them for sure.
          With one node every policy is a no-op (all pages are on node 0 anyway).
          UnavailableError without libnuma or for a node the machine does not have.
        Returns {'mmap', 'numa', 'bytes', 'hugepage', 'hugepage_errno', 'willneed', 'huge_bytes',
        'page_nodes': {node: pages sampled every 2 MiB} or None when numa is off, 'absent_pages'}.
        """
        size = self.file_size - self.data_start
        report = {"mmap": mmap, "numa": numa if numa != "node" else f"node:{node}", "bytes": max(size, 0),
                  "hugepage": False, "hugepage_errno": 0, "willneed": False, "huge_bytes": 0,
                  "page_nodes": None, "absent_pages": 0}
        if not self.tensors or size <= 0:
            return report
        if mmap:
            data = self._map[self.data_start:]  # the tensor data; the header was read already
            advice = _native.mem_advise(data, hugepage=True, willneed=True)
            report.update(hugepage=bool(advice["hugepage"]), hugepage_errno=advice["hugepage_errno"],
                          willneed=bool(advice["willneed"]))
            if numa != "off":
                with _native.numa_thread_policy_set(numa, node):
                    _native.mem_prefault(data)
        else:
            mem = _native.mem_alloc(size)  # MADV_HUGEPAGE asked for before any page exists
            report.update(hugepage=mem.hugepage, hugepage_errno=mem.hugepage_errno)
            if numa != "off":
                _native.mem_set_numa(mem.array, numa, node)  # before the read touches a page
            self._read_into(mem.array, progress)
            mem.array.flags.writeable = False
            self._map, self._base = mem.array, self.data_start  # the array owns the memory
            data = mem.array
        if numa != "off":
            where = _native.mem_page_nodes(data, stride=PAGE_SAMPLE)
            report.update(page_nodes=where["nodes"], absent_pages=where["absent"])
        report["huge_bytes"] = thp_backed_bytes(data)
        return report

    def _read_into(self, out: np.ndarray, progress: bool | None) -> None:
        """Reads the data section [data_start, file_size) into out (uint8[file_size - data_start])."""
        from tqdm import tqdm

        n = out.size
        # progress None: a bar for big files when stderr is a terminal (tqdm's disable=None); True/False: forced
        disable = (not progress) if progress is not None else (None if n >= PROGRESS_MIN_BYTES else True)
        view = memoryview(out)
        with open(self.path, "rb", buffering=0) as f, \
                tqdm(total=n, unit="B", unit_scale=True, unit_divisor=1024, desc="reading weights",
                     disable=disable, leave=False) as bar:
            f.seek(self.data_start)
            pos = 0
            while pos < n:
                got = f.readinto(view[pos:pos + READ_CHUNK])
                if not got:
                    raise FormatError(f"{self.path}: the file shrank while reading it: {self.data_start + pos} "
                                      f"bytes of {self.file_size}")
                pos += got
                bar.update(got)

    def array(self, key: str) -> list:
        """The elements of an array key, also of one the header left in the file (a GGUFArray in metadata)."""
        v = self.metadata[key]
        if not isinstance(v, GGUFArray):
            return v
        with open(self.path, "rb") as f:
            mm = np.memmap(f, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(mm), self.file_size, self.path)
        cur.pos = v.offset
        return _read_array(cur, v.elem_type, v.count, key)

    def value_type(self, key: str) -> GGUFValueType:
        """The GGUF value type of a key (the element type for arrays)."""
        return self._types[key][1]

    def is_array(self, key: str) -> bool:
        return self._types[key][0] == GGUFValueType.ARRAY
