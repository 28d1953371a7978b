"""The fingerprint of a model file: 32 bytes naming it by its whole content. A property of the file, so it lives with
the file format; the prefix cache keys its disk files by it, the planner its routing statistics."""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

from ..core.paths import cache_dir

FINGERPRINT_PIECE = 64 << 20  # bytes per hashing task: the pieces run on every core (hashlib releases the GIL)
_MEMO_MIN = 64 << 20          # files this big have their fingerprint remembered; smaller ones hash in < 0.1 s


def model_fingerprint(model, memo_dir: str | os.PathLike | None = None) -> bytes:
    """32 bytes naming a model file by its whole content: a hash of every byte (header, metadata, all tensor data),
    so files that differ anywhere never share cache entries; independent of path and mtime.
    model: a legacy_engine Model, a ModelFile, a GGUFFile or a path.

    Hashing reads the whole file (FINGERPRINT_PIECE pieces, one task per core: 15.6 GB/s from the page cache on 16
    cores, about 2 on 2; a cold file reads at disk speed), so for files of 64 MiB and more the result is remembered
    in memo_dir (default: paths.cache_dir()/fingerprints), keyed by the file's device, inode, size, mtime and ctime:
    a file rewritten in place gets a new ctime even when its mtime is put back."""
    mf = getattr(model, "file", model)
    mf = getattr(mf, "gguf", mf)
    path = mf.path if hasattr(mf, "data_start") else os.fspath(mf)
    st = os.stat(path)
    memo = None
    if st.st_size >= _MEMO_MIN:
        folder = os.fspath(memo_dir) if memo_dir is not None else os.path.join(cache_dir(), "fingerprints")
        memo = os.path.join(folder, "v2-%x-%x-%x-%x-%x" % (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                            st.st_ctime_ns))
        try:
            with open(memo) as f:
                digest = bytes.fromhex(f.read().strip())
            if len(digest) == 32:
                return digest
        except (OSError, ValueError):
            pass
    digest = _hash_file(path, st.st_size)
    if memo is not None:
        try:
            os.makedirs(os.path.dirname(memo), exist_ok=True)
            tmp = f"{memo}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(digest.hex())
            os.replace(tmp, memo)
        except OSError:  # a read-only cache dir: hash again next time
            pass
    return digest


def _hash_file(path: str, size: int) -> bytes:
    """sha256 of (size, sha256 of each FINGERPRINT_PIECE of the file), the pieces hashed in parallel. Why sha256:
    OpenSSL's uses the CPU's SHA extensions, 1.37 GB/s a core on the H200 host against blake2b's 0.60."""
    h = hashlib.sha256(b"legacy_engine model fingerprint v2" + struct.pack("<Q", size))
    if size == 0:
        return h.digest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        pieces = [view[i:i + FINGERPRINT_PIECE] for i in range(0, size, FINGERPRINT_PIECE)]
        try:
            try:
                with ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1)) as pool:
                    digests = list(pool.map(lambda p: hashlib.sha256(p).digest(), pieces))
            except RuntimeError:  # no new threads at interpreter shutdown (an atexit routing flush): one core
                digests = [hashlib.sha256(p).digest() for p in pieces]
            for d in digests:
                h.update(d)
        finally:
            for p in pieces:  # the map cannot close while views of it live
                p.release()
            view.release()
    return h.digest()
