"""The prefix cache's disk tier: the file format and the write-through store (the module docstring of
serve/cache.py says what is kept and why it is safe).

A file is a header (_HEADER), for a snapshot the keys of the pages it needs, then the payload. DiskTier is a base
class of PrefixCache: its methods share the cache's lock, stats and disk index, which PrefixCache.__init__ sets up
(disk_dir, disk_bytes, page, fingerprint, _sizes, _lock, _stats, _disk, _deps, _recent)."""
from __future__ import annotations

import hashlib
import os
import stat
import struct
import threading
import time
import warnings

FORMAT_VERSION = 2  # of the files and of the payloads (save_recurrent / read_kv layouts); bump on any change

MAGIC = b"LEPCACHE"
# magic, version, kind, pos, page tokens, model fingerprint, key, sha256(page keys + payload), payload bytes;
# then a snapshot's page keys (32 bytes each, pos / page of them), then the payload
_HEADER = struct.Struct("<8sIIqq32s32s32sQ")
KIND_SNAPSHOT, KIND_PAGE = 1, 2
_MAX_PAGES = 1 << 16  # pages a snapshot file may list (4M tokens of 64): bounds what a start reads of one
_EXT = {KIND_SNAPSHOT: ".snap", KIND_PAGE: ".kv"}


class CacheFileWarning(UserWarning):
    """A disk-tier file was ignored (corrupt, truncated, another model's or another format's)."""


class DiskTier:
    """The write-through disk tier of a PrefixCache: files of snapshots and KV pages in disk_dir, kept within
    disk_bytes. Every method that touches the index runs under the cache's lock (where it says so, the caller holds
    it)."""

    def _path(self, key: bytes, kind: int) -> str:
        return os.path.join(self.disk_dir, key.hex() + _EXT[kind])

    def _file_bytes(self, kind: int, pos: int, nbytes: int) -> int:
        """The size of a file whose payload is nbytes: header, a snapshot's page keys, payload."""
        return _HEADER.size + (32 * (pos // self.page) if kind == KIND_SNAPSHOT else 0) + nbytes

    def _scan_disk(self) -> None:
        """At start: removes the .tmp files of dead writers and checks every file once from its directory entry and
        header (type, size, model, format, key); bad ones are deleted, so they are rejected once, not at every
        start. One warning sums up what was not used. Payload checksums are checked when a file is read."""
        kinds = {ext: kind for kind, ext in _EXT.items()}
        bad: dict[str, int] = {}
        for name in os.listdir(self.disk_dir):
            path = os.path.join(self.disk_dir, name)
            if name.endswith(".tmp"):
                self._remove_orphan(path, name)
                continue
            stem, ext = os.path.splitext(name)
            if ext not in kinds or len(stem) != 64:
                continue
            try:
                key = bytes.fromhex(stem)
            except ValueError:
                continue
            try:
                st, deps = self._vet(path, key, kinds[ext])
            except _Bad as e:
                self._stats["disk_rejected"] += 1
                bad[e.why] = bad.get(e.why, 0) + 1
                if e.drop:
                    _unlink(path)
                continue
            self._disk[(key, kinds[ext])] = st.st_size
            if deps is not None:
                self._deps[key], self._recent[key] = deps, st.st_mtime
        if bad:
            why = "; ".join(f"{n} x {r}" for r, n in bad.items())
            warnings.warn(f"prefix cache: {sum(bad.values())} files in {self.disk_dir} not used: {why}",
                          CacheFileWarning, stacklevel=3)
        if self.disk_bytes is not None and sum(self._disk.values()) > self.disk_bytes:
            self._prune_disk()

    def _remove_orphan(self, path: str, name: str) -> None:
        """Deletes a .tmp file (KEY.EXT.PID.TID.tmp) whose writer is not alive: left by a kill during a write."""
        try:
            os.kill(int(name.split(".")[-3]), 0)
            return  # alive: it is still writing
        except ProcessLookupError:
            if _unlink(path):
                self._stats["disk_orphans"] += 1
        except (ValueError, IndexError, OSError):  # not ours, or another user's live process
            pass

    def _vet(self, path: str, key: bytes, kind: int) -> tuple[os.stat_result, list[bytes] | None]:
        """A start's check of one file -> (its lstat, the page keys of a snapshot); _Bad if it fails. Only a regular
        file is opened (lstat: no FIFO, device or symlink), and only its header is read before its size is checked
        against it (a sparse 20 GB file costs 136 bytes); another model's file is recognised, and left alone."""
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise _Bad("not a regular file")
            magic, version, f_kind, pos, f_page, fp, f_key, _, length = self._check_header(
                _read_file(path, st, _HEADER.size))
            if (f_kind, f_key, f_page) != (kind, key, self.page) or pos % self.page or pos < (kind == KIND_SNAPSHOT) \
                    or pos // self.page > _MAX_PAGES:
                raise _Bad("header names another entry (kind, key, position or page size differ)")
            if self._sizes is not None:
                _check_size(length, self._sizes.snapshot if kind == KIND_SNAPSHOT else self._sizes.page)
            _check_size(st.st_size, self._file_bytes(kind, pos, length))
            if kind == KIND_PAGE:
                return st, None
            deps = _read_file(path, st, self._file_bytes(kind, pos, 0))[_HEADER.size:]
        except OSError as e:
            raise _Bad(f"unreadable ({e.strerror})", drop=False) from None
        return st, [deps[i:i + 32] for i in range(0, len(deps), 32)]

    def _check_header(self, raw: bytes) -> tuple:
        if len(raw) < _HEADER.size:
            raise _Bad("shorter than the header")
        head = _HEADER.unpack_from(raw)
        if head[0] != MAGIC:
            raise _Bad("not a prefix-cache file (bad magic)")
        if head[1] != FORMAT_VERSION:  # an older engine's files go, a newer one's stay
            raise _Bad(f"format version {head[1]}, this engine writes {FORMAT_VERSION}", drop=head[1] < FORMAT_VERSION)
        if head[5] != self.fingerprint:
            raise _Bad("made for another model (fingerprint differs)", drop=False)
        return head

    def _reject(self, path: str, key: bytes, kind: int, e: "_Bad") -> None:
        """A file found bad when read: counted, warned about, forgotten and (unless _Bad says no) deleted."""
        with self._lock:
            self._stats["disk_rejected"] += 1
            self._forget(key, kind)  # the next capture of this key writes a good one
        if e.drop:
            _unlink(path)
        warnings.warn(f"prefix cache: ignoring {path}: {e.why}", CacheFileWarning, stacklevel=4)

    def _read(self, key: bytes, kind: int, pos: int, nbytes: int, page_keys=()) -> bytes | None:
        """The payload of a disk file after checking everything in it; None if absent or rejected. It is opened only
        if lstat finds a regular file of exactly the expected size (no FIFO, device, symlink to one, or sparse
        giant), and never through a symlink (O_NOFOLLOW)."""
        path = self._path(key, kind)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise _Bad("not a regular file")
            _check_size(st.st_size, self._file_bytes(kind, pos, nbytes))
            raw = _read_file(path, st, st.st_size)
            _, _, f_kind, f_pos, f_page, _, f_key, digest, _ = self._check_header(raw)
            if (f_kind, f_key, f_pos, f_page) != (kind, key, pos, self.page):
                raise _Bad("header names another entry (kind, key, position or page size differ)")
            _check_size(len(raw), self._file_bytes(kind, pos, nbytes))  # it shrank since the lstat
            if raw[_HEADER.size:len(raw) - nbytes] != b"".join(page_keys):
                raise _Bad("lists other pages than its key's")
            if hashlib.sha256(memoryview(raw)[_HEADER.size:]).digest() != digest:
                raise _Bad("checksum mismatch (corrupt)")
        except FileNotFoundError:
            with self._lock:
                self._forget(key, kind)
            return None
        except OSError as e:
            self._reject(path, key, kind, _Bad(f"unreadable ({e.strerror})", drop=False))
            return None
        except _Bad as e:
            self._reject(path, key, kind, e)
            return None
        with self._lock:
            self._stats["disk_reads"] += 1
            if kind == KIND_SNAPSHOT and key in self._deps:
                self._recent[key] = time.time()  # recency for the disk budget
        try:
            os.utime(path)  # ... and after a restart
        except OSError:
            pass
        return raw[len(raw) - nbytes:]

    def _write_through(self, key: bytes, pos: int, data: bytes, page_keys: list[bytes], pages: list[bytes]) -> None:
        """Writes a snapshot and the pages it needs that are not on disk yet: pages first (a snapshot on disk is
        usable only with them), after pruning to make room; nothing when the group cannot fit the budget at all."""
        if self.disk_dir is None:
            return
        with self._lock:
            todo = [(j, pk, d) for j, (pk, d) in enumerate(zip(page_keys, pages)) if (pk, KIND_PAGE) not in self._disk]
            snap = (key, KIND_SNAPSHOT) not in self._disk
            if not todo and not snap:
                return
            if self.disk_bytes is not None:
                new = sum(_HEADER.size + len(d) for _, _, d in todo)
                new += self._file_bytes(KIND_SNAPSHOT, pos, len(data)) if snap else 0
                if new + sum(self._disk.get((pk, KIND_PAGE), 0) for pk in page_keys) > self.disk_bytes:
                    return
                self._prune_disk(room=new, need=page_keys)
        for j, pk, d in todo:
            if not self._write(pk, KIND_PAGE, j * self.page, d):
                return
        if snap:
            self._write(key, KIND_SNAPSHOT, pos, data, b"".join(page_keys))

    def _write(self, key: bytes, kind: int, pos: int, payload: bytes, deps: bytes = b"") -> bool:
        """Writes one file atomically (temp file + rename) unless a good one is there. No fsync: a file torn by
        a crash fails its checksum and is ignored. Returns whether the file is on disk."""
        with self._lock:
            if (key, kind) in self._disk:
                return True
        path = self._path(key, kind)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, pos, self.page, self.fingerprint, key,
                              hashlib.sha256(deps + payload).digest(), len(payload))
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(deps)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            with self._lock:
                self._stats["disk_errors"] += 1
            warnings.warn(f"prefix cache: cannot write {path}: {e.strerror}", CacheFileWarning, stacklevel=4)
            _unlink(tmp)
            return False
        with self._lock:
            self._disk[(key, kind)] = len(header) + len(deps) + len(payload)
            if kind == KIND_SNAPSHOT:
                self._deps[key], self._recent[key] = [deps[i:i + 32] for i in range(0, len(deps), 32)], time.time()
            self._stats["disk_writes"] += 1
        return True

    def _prune_disk(self, room: int = 0, need=()) -> None:
        """Deletes files until the disk tier plus `room` bytes fits the budget (lock held). What stays is usable:
        first the pages `need` of a snapshot about to be written (its new files are the `room`), then snapshots by
        recency (written or read), each only with every page it needs; a page no kept snapshot needs goes."""
        keep = {(pk, KIND_PAGE) for pk in need if (pk, KIND_PAGE) in self._disk}
        used = room + sum(self._disk[f] for f in keep)
        for key in sorted(self._deps, key=self._recent.__getitem__, reverse=True):
            group = {(key, KIND_SNAPSHOT)} | {(pk, KIND_PAGE) for pk in self._deps[key]}
            if not group <= self._disk.keys():
                continue  # a page it needs is gone: unusable
            cost = sum(self._disk[f] for f in group - keep)
            if used + cost <= self.disk_bytes:
                keep |= group
                used += cost
        for f in [f for f in self._disk if f not in keep]:
            _unlink(self._path(*f))
            self._forget(*f)
            self._stats["disk_evictions"] += 1

    def _forget(self, key: bytes, kind: int) -> None:
        """Drops a file from the disk index (lock held)."""
        self._disk.pop((key, kind), None)
        if kind == KIND_SNAPSHOT:
            self._deps.pop(key, None)
            self._recent.pop(key, None)


class _Bad(Exception):
    """A disk file that fails a check: why, and whether to delete it (not another model's or a newer format's)."""

    def __init__(self, why: str, drop: bool = True):
        super().__init__(why)
        self.why, self.drop = why, drop


def _check_size(got: int, want: int) -> None:
    if got != want:
        raise _Bad(f"{got} bytes, {want} expected: truncated, or a payload of another size")


def _read_file(path: str, st: os.stat_result, n: int) -> bytes:
    """The first n bytes of the regular file `path` that lstat gave `st`: never through a symlink, never blocking on
    a FIFO put there since, and only if it is still the same file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _Bad("replaced while being opened")
        chunks, left = [], n
        while left:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
