"""Position-indexed prefix cache: a prompt that repeats or extends one seen before skips that prefix.

A Gated DeltaNet layer folds the whole prefix into one recurrent state, so the state at position p cannot
be cut out of a longer run: it is snapshotted while prefilling. Snapshots (conv + SSM state of every GDN
layer, f32) are taken at multiples of `page` tokens: on a grid (every `grid` tokens) and at the end of
every prompt. The attention layers' KV rows are kept in immutable pages of `page` tokens, shared by every
snapshot whose prefix contains them.

An exact repeat of a prompt costs only a restore: every prefill of an L-token prompt also keeps an end entry,
keyed by a hash of the whole prompt (the chain key of its aligned prefix a = floor(L/page)*page, the tail tokens
[a, L) and L), holding the recurrent state at L, the KV rows [a, L) and the last token's logits. It serves only a
prompt equal to the cached one (same length and tokens): its aligned KV pages, the tail rows and the state at L
are written back and the stored logits returned. It is bit-identical because a full recompute of the same prompt
performs exactly the same computation (same chunk boundaries), so its state and logits at L are the same bits.
An extension or a divergence never uses it (its key differs): they take the aligned path below.

Keys form a hash chain over the prompt's pages: h_0 = seed, h_k = sha256(h_{k-1} || tokens of page k-1).
The snapshot at position k*page and the KV page of tokens [(k-1)*page, k*page) are both keyed by h_k:
equal prefixes share entries, a different token anywhere before means a different key.

Bit-identical to a full recompute: the chunked GDN prefill (native/gdn.c) is exact only up to rounding,
and its rounding depends on where its 64-token chunks start; a fresh prefill chunks at absolute positions
0, 64, 128, ... So snapshots are taken and restored only at multiples of 64 and the tokens after a
restored position run in forward calls split only at multiples of 64. Attention, MoE and norms are per
token, so the logits equal a fresh Session's bit for bit (tests/test_cache.py).

Memory: RAM holds snapshots and end entries in one LRU order within `ram_bytes`; a page is counted once and
held by the entries that need it (reference counts), dropped with the last one; an entry being restored is
pinned. An end entry is kept only if it fits the budget on its own, and ranks just below the prompt's last
snapshot in the LRU order (under pressure it goes first: that snapshot also serves extensions). End entries
live in RAM only (the disk tier holds snapshots and pages; after a restart an exact repeat takes the aligned
path, still bit-identical). The optional disk tier (`disk_dir`; serve/cache_disk.py) is written through and survives
restarts. Every file carries the model fingerprint (a hash of the whole model file), FORMAT_VERSION, its key and a
sha256 of its payload; a snapshot file also lists the keys of the pages it needs. A start removes the .tmp files of
dead writers and checks every file's type, header and size once; only regular files are opened (lstat, O_NOFOLLOW),
a lookup reads one only if it has exactly the size its entry needs, and its checksum is verified when it is read. A
bad file is warned about (CacheFileWarning), counted (stats "disk_rejected") and deleted, so it is rejected once;
another model's or a newer format's files are left alone. The disk budget keeps what is usable: the most recent
snapshots, each with every page it needs; no page outlives the last snapshot that needs it.

    cache = PrefixCache.for_model(engine.model, disk_dir="~/.cache/legacy_engine/prefix")
    logits = cache.prefill(session, ids)     # instead of session.reset(); session.prefill(ids)
"""
from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..core.errors import Cancelled, ContextLengthError, EngineError
from ..format.fingerprint import model_fingerprint
from .cache_disk import FORMAT_VERSION, KIND_PAGE, KIND_SNAPSHOT, CacheFileWarning, DiskTier  # noqa: F401 (API)
from .generate import PREFILL_BATCH, rope_delta_at

CHUNK = 64          # native/gdn.c GDN_CHUNK: restore points and forward-call splits are multiples of it
assert PREFILL_BATCH % CHUNK == 0, "prefill batches must split at chunk boundaries"
_END_SEED = b"legacy_engine prompt end v%d" % FORMAT_VERSION

_fingerprints: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Model -> model_fingerprint, once


def _image_salt(spans, lo: int, hi: int) -> bytes:
    """What identifies the images whose rows meet [lo, hi): each one's pixel digest, start and grid. An image's pad
    tokens are the same ids whatever the image: this keeps a different image with the same text from a hit."""
    return b"".join(s.digest.encode() + struct.pack("<4q", s.start, *s.grid) for s in spans
                    if s.start < hi and s.end > lo)


def chain_keys(ids, page: int, spans=()) -> list[bytes]:
    """[h_1 .. h_K], K = len(ids) // page: h_k = sha256(h_{k-1} || int32 LE tokens [(k-1)*page, k*page) || the
    image salt of those rows). spans: the prompt's images (format.multimodal.ImageSpan)."""
    toks = np.asarray(ids, dtype=np.int64)
    if toks.size and (toks.min() < 0 or toks.max() >= 1 << 31):
        raise ValueError("token ids must lie in [0, 2**31)")
    raw = toks.astype("<i4").tobytes()
    h = hashlib.sha256(b"legacy_engine prefix chain v%d page %d" % (FORMAT_VERSION, page)).digest()
    out = []
    for k in range(toks.size // page):
        h = hashlib.sha256(h + raw[4 * k * page:4 * (k + 1) * page]
                           + _image_salt(spans, k * page, (k + 1) * page)).digest()
        out.append(h)
    return out


def end_key(ids, keys: list[bytes], page: int, spans=()) -> bytes:
    """The key of the end entry of the whole prompt ids (keys = chain_keys(ids, page, spans)): a hash of the chain
    key of its aligned prefix [0, floor(L/page)*page), its tail tokens (and the images they hold) and its length L."""
    k = len(ids) // page
    tail = np.asarray(ids[k * page:], dtype=np.int64).astype("<i4").tobytes()
    tail += _image_salt(spans, k * page, len(ids))
    prefix = keys[k - 1] if k else b"page %d" % page
    return hashlib.sha256(_END_SEED + prefix + struct.pack("<q", len(ids)) + tail).digest()


@dataclass(frozen=True)
class Sizes:
    """Payload bytes of one snapshot and one page for a model (the C state's layout, native/state.c)."""
    snapshot: int
    page: int

    @classmethod
    def of(cls, model, page: int) -> "Sizes":
        hp = model.hparams
        n_gdn = sum(1 for r in hp.recurrent if r)
        n_attn = hp.n_layer - n_gdn
        conv_dim = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
        recurrent = n_gdn * ((hp.ssm_conv_kernel - 1) * conv_dim + hp.ssm_d_inner * hp.ssm_d_state)
        return cls(4 * recurrent, 4 * 2 * n_attn * page * hp.n_head_kv * hp.head_dim)


@dataclass
class _Snapshot:
    pos: int
    data: bytes         # save_recurrent() at pos
    pages: list[bytes]  # keys of the KV pages [0, pos) (an end entry: [0, floor(pos/page)*page))
    pins: int = 0
    tail: bytes = b""   # an end entry: read_kv of the rows after its pages, up to pos
    logits: np.ndarray | None = None  # an end entry: the last token's logits (float32); None for a snapshot

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.tail) + (0 if self.logits is None else self.logits.nbytes)


@dataclass
class _Page:
    data: bytes         # read_kv(start, page)
    refs: int = 0       # snapshots in RAM that hold it


class PrefixCache(DiskTier):
    """Snapshots of GDN state + shared KV pages, keyed by position and a hash chain of the tokens before it.

    model_fingerprint: bytes or str naming the model (model_fingerprint(model)); disk files of any other
    fingerprint are ignored. grid: snapshot every `grid` tokens (a multiple of `page`). page: KV page and
    hash block in tokens (a multiple of 64). ram_bytes: RAM budget. disk_dir: optional write-through disk
    tier; disk_bytes: its budget (None: unbounded; the least recently used snapshots go first, with the pages no
    other snapshot needs). sizes: the payload sizes of the model's entries (for_model sets them), so that disk files
    of any other size are refused from their directory entry alone.

    One cache serves one model (one fingerprint); it is safe to share between threads.
    """

    def __init__(self, model_fingerprint: bytes | str, grid: int = 256, page: int = 64, ram_bytes: int = 4 << 30,
                 disk_dir: str | os.PathLike | None = None, disk_bytes: int | None = None, sizes: Sizes | None = None):
        if page <= 0 or page % CHUNK:
            raise ValueError(f"page = {page}: must be a positive multiple of {CHUNK} (the GDN chunk)")
        if grid <= 0 or grid % page:
            raise ValueError(f"grid = {grid}: must be a positive multiple of page = {page}")
        if ram_bytes < 0:
            raise ValueError(f"ram_bytes = {ram_bytes} is negative")
        fp = model_fingerprint.encode() if isinstance(model_fingerprint, str) else bytes(model_fingerprint)
        self.fingerprint = fp if len(fp) == 32 else hashlib.sha256(fp).digest()
        self.grid, self.page, self.ram_bytes = grid, page, ram_bytes
        self.disk_dir = os.path.expanduser(os.fspath(disk_dir)) if disk_dir is not None else None
        self.disk_bytes = disk_bytes
        self._lock = threading.RLock()
        self._snaps: OrderedDict[bytes, _Snapshot] = OrderedDict()  # LRU first
        self._pages: dict[bytes, _Page] = {}
        self._ram = 0
        self._sizes: Sizes | None = sizes
        self._model: bytes | None = None  # model_fingerprint of the model it serves (set on first use)
        self._disk: dict[tuple[bytes, int], int] = {}  # (key, kind) -> file bytes, for files in disk_dir
        self._deps: dict[bytes, list[bytes]] = {}      # snapshot key -> the page keys its disk file lists
        self._recent: dict[bytes, float] = {}          # snapshot key -> when its file was last written or read
        self._stats = dict(hits=0, misses=0, exact_hits=0, disk_hits=0, tokens_reused=0, tokens_prefilled=0,
                           snapshots_taken=0, evictions=0, disk_reads=0, disk_writes=0, disk_rejected=0,
                           disk_errors=0, disk_evictions=0, disk_orphans=0)
        self.last: dict = {}  # the last prefill: reused, prefilled, exact, restore_s, prefill_s, capture_s (in prefill_s)
        if self.disk_dir is not None:
            os.makedirs(self.disk_dir, exist_ok=True)
            self._scan_disk()

    @classmethod
    def for_model(cls, model, **kw) -> "PrefixCache":
        """A cache for a legacy_engine Model, fingerprinted from its file, with its entry sizes."""
        fp = _fingerprints[model] = model_fingerprint(model)
        return cls(fp, sizes=Sizes.of(model, kw.get("page", 64)), **kw)

    # ---- public -------------------------------------------------------------------------------------------

    def prefill(self, session, ids, cancel=None, images=None, step=None) -> np.ndarray:
        """Runs the whole sequence `ids` in `session`, reusing the longest cached prefix, and returns the
        logits of its last token (float32[n_vocab]), equal bit for bit to a fresh session's prefill.

        The session's previous content is replaced: afterwards session.tokens == ids, session.pos == len(ids).
        Snapshots, KV pages and the end entry of ids are stored for later prompts; an exact repeat of a prompt
        whose end entry is held runs nothing (reused == len(ids)). cancel() is asked before each forward call
        (at most PREFILL_BATCH tokens apart, or step() after it: Session.prefill); True raises Cancelled: the
        session holds the part already run and
        the snapshots taken so far stay (each is complete). images: the prompt's images (generate.PromptImages):
        keyed by their pixels' digests; a restore inside or after one also restores the state's rope delta."""
        ids = [int(t) for t in ids]
        n, state = len(ids), session.state
        if n == 0:
            raise ValueError("empty prompt: nothing to run")
        if n > state.n_ctx:
            raise ContextLengthError(f"{n} tokens exceed the context of {state.n_ctx} tokens")
        sizes = self._check_model(session.engine.model)
        spans = images.spans if images is not None else ()
        keys = chain_keys(ids, self.page, spans)
        ekey = end_key(ids, keys, self.page, spans)
        rows = None
        if images is not None:
            session.reset()      # the image rows' positions count from an empty state
            rows = session.image_rows(ids, images)
        t0 = time.perf_counter()
        logits = self._restore_end(session, ids, ekey, rows)
        if logits is not None:
            t1 = time.perf_counter()
            with self._lock:
                self._stats["hits"] += 1
                self._stats["exact_hits"] += 1
                self._stats["tokens_reused"] += n
            self.last.update(reused=n, prefilled=0, exact=True, restore_s=t1 - t0, prefill_s=0.0, capture_s=0.0)
            session.timings.prefill_s += t1 - t0
            return logits
        p, snap_key, snap, pages = self._lookup(keys, (n - 1) // self.page, sizes)  # leaves >= 1 token to run
        session.reset()
        try:
            if p:
                state.restore_recurrent(snap, p)
                if rows is not None:
                    state.rope_delta = rope_delta_at(rows["positions"], p)
                for j, d in enumerate(pages):
                    state.write_kv(j * self.page, self.page, d)
        except EngineError:
            session.reset()
            raise
        finally:
            if snap_key is not None:
                self._unpin(snap_key)
        session.tokens = ids[:p]
        t1 = time.perf_counter()
        logits = self._run(session, ids, p, keys, pages, ekey, cancel, rows, step)
        t2 = time.perf_counter()
        with self._lock:
            self._stats["hits" if p else "misses"] += 1
            self._stats["tokens_reused"] += p
            self._stats["tokens_prefilled"] += n - p
        self.last.update(reused=p, prefilled=n - p, exact=False, restore_s=t1 - t0, prefill_s=t2 - t1)
        session.timings.prefill_tokens += n - p
        session.timings.prefill_s += t2 - t0
        return logits

    def cached_prefix(self, ids) -> int:
        """How many leading tokens of ids a prefill would reuse now (no disk file is read or checked):
        len(ids) when its end entry is held (an exact repeat)."""
        keys = chain_keys(ids, self.page)
        with self._lock:
            if ids and end_key(ids, keys, self.page) in self._snaps:
                return len(ids)
            for k in range(min((len(ids) - 1) // self.page, len(keys)), 0, -1):
                key = keys[k - 1]
                if key in self._snaps or ((key, KIND_SNAPSHOT) in self._disk and all(
                        kk in self._pages or (kk, KIND_PAGE) in self._disk for kk in keys[:k])):
                    return k * self.page
        return 0

    @property
    def stats(self) -> dict:
        """Counters plus what is held: snapshots, end_entries, pages, ram_bytes, disk_files, disk_bytes.
        disk_rejected: bad files refused (and deleted) or other models' files ignored; disk_orphans: .tmp files of
        dead writers removed at start."""
        with self._lock:
            ends = sum(1 for s in self._snaps.values() if s.logits is not None)
            return dict(self._stats, snapshots=len(self._snaps) - ends, end_entries=ends, pages=len(self._pages),
                        ram_bytes=self._ram,
                        disk_files=len(self._disk), disk_bytes=sum(self._disk.values()))

    def clear(self) -> None:
        """Drops every RAM entry (pinned ones stay); disk files stay."""
        with self._lock:
            for key in [k for k, s in self._snaps.items() if not s.pins]:
                self._drop(key)

    # ---- restore --------------------------------------------------------------------------------------------

    def _check_model(self, model) -> Sizes:
        """The payload sizes of `model`; ValueError if the cache already served a model of another file."""
        fp = _fingerprints.get(model)
        if fp is None:
            fp = _fingerprints[model] = model_fingerprint(model)
        with self._lock:
            if self._model is None:
                self._model, self._sizes = fp, Sizes.of(model, self.page)
            elif fp != self._model:
                raise ValueError("this PrefixCache holds another model's states; use one PrefixCache per model")
        return self._sizes

    def _lookup(self, keys: list[bytes], k_max: int, sizes: Sizes):
        """The largest k <= k_max whose snapshot and pages are available -> (pos, key, snapshot, pages).
        The snapshot comes back pinned in RAM (unpin it with _unpin(key)) unless it did not fit."""
        disk_pages: dict[bytes, bytes | None] = {}  # pages read from disk during this lookup
        for k in range(min(k_max, len(keys)), 0, -1):
            key, pos = keys[k - 1], k * self.page
            with self._lock:
                s = self._snaps.get(key)
                if s is not None:
                    s.pins += 1
                    self._snaps.move_to_end(key)
                    return pos, key, s.data, [self._pages[pk].data for pk in s.pages]
                if (key, KIND_SNAPSHOT) not in self._disk:
                    continue
            data = self._read(key, KIND_SNAPSHOT, pos, sizes.snapshot, keys[:k])
            if data is None:
                continue
            pages = []
            for j, pk in enumerate(keys[:k]):
                with self._lock:
                    pg = self._pages.get(pk)
                d = pg.data if pg is not None else disk_pages.get(pk)
                if d is None and pk not in disk_pages:
                    d = disk_pages[pk] = self._read(pk, KIND_PAGE, j * self.page, sizes.page)
                if d is None:
                    break
                pages.append(d)
            if len(pages) < k:
                continue
            with self._lock:
                self._stats["disk_hits"] += 1
                pinned = self._insert(key, pos, data, keys[:k], pages, pin=True)
            self._write_through(key, pos, data, keys[:k], pages)  # pages that were only in RAM
            return pos, key if pinned else None, data, pages
        return 0, None, None, []

    def _restore_end(self, session, ids: list[int], ekey: bytes, rows: dict | None) -> np.ndarray | None:
        """An exact repeat: writes the end entry of ids (pages, tail rows, state at len(ids)) into the session and
        returns a copy of its logits; None (session untouched) when the entry is not held."""
        with self._lock:
            e = self._snaps.get(ekey)
            if e is None or e.logits is None or e.pos != len(ids):
                return None
            e.pins += 1
            self._snaps.move_to_end(ekey)
            pages = [self._pages[pk].data for pk in e.pages]
        state, a = session.state, len(e.pages) * self.page
        session.reset()
        try:
            state.restore_recurrent(e.data, e.pos)
            if rows is not None:
                state.rope_delta = rope_delta_at(rows["positions"], e.pos)
            for j, d in enumerate(pages):
                state.write_kv(j * self.page, self.page, d)
            if e.pos > a:
                state.write_kv(a, e.pos - a, e.tail)
        except EngineError:
            session.reset()
            raise
        finally:
            self._unpin(ekey)
        session.tokens = list(ids)
        return e.logits.copy()

    def _unpin(self, key: bytes) -> None:
        with self._lock:
            s = self._snaps.get(key)
            if s is not None:
                s.pins -= 1
            self._evict()

    # ---- prefill with capture -------------------------------------------------------------------------------

    def _capture_points(self, p: int, n: int) -> list[int]:
        """Snapshot positions in (p, n]: the grid and the prompt's end (floor to a page; also the page before
        it when n is a multiple of page, the restore point of an exact repeat)."""
        pts = set(range(self.grid, n + 1, self.grid))
        pts |= {(n - 1) // self.page * self.page, n // self.page * self.page}
        return sorted(q for q in pts if q > p)

    def _run(self, session, ids: list[int], p: int, keys: list[bytes], pages: list[bytes], ekey: bytes,
             cancel=None, rows: dict | None = None, step=None) -> np.ndarray:
        """Prefill ids[p:] in forward calls that split only at multiples of 64, storing snapshots, pages and the
        end entry (key ekey). rows: the image rows' forward arguments of the whole prompt (generate.image_rows)."""
        n, model, state = len(ids), session.engine.model, session.state
        capture = self._capture_points(p, n)
        pages = list(pages)  # KV page j for j < len(pages)
        pos, logits, t_capture = p, None, 0.0
        while pos < n:
            if cancel is not None and cancel():
                raise Cancelled(f"prefill cancelled after {pos} of {n} tokens")
            size = step() if step is not None else PREFILL_BATCH  # the calls split at capture points and multiples
            q = min([c for c in capture if c > pos][:1] + [(pos // size + 1) * size, n])   # of size: of 64
            try:
                kw = {k: v[pos:q] for k, v in rows.items()} if rows is not None else {"tokens": ids[pos:q]}
                out = model.forward(state, kw.pop("tokens"), all_logits=False, chunked=True, want_logits=q == n, **kw)
            except EngineError:
                session.reset()  # a failed forward may have updated some layers
                raise
            session.tokens += ids[pos:q]
            pos = q
            if q == n:
                logits = out[0]
            if q in capture:
                t0 = time.perf_counter()
                k = q // self.page
                with self._lock:
                    if keys[k - 1] in self._snaps:  # taken by an earlier prompt: only refresh its recency
                        self._snaps.move_to_end(keys[k - 1])
                        continue
                self._fill_pages(state, keys, pages, k)
                snap = state.save_recurrent()
                if len(snap) != self._sizes.snapshot or len(pages[0]) != self._sizes.page:
                    raise EngineError(f"state layout changed: snapshot {len(snap)} B, page {len(pages[0])} B; "
                                      f"expected {self._sizes}")
                with self._lock:
                    self._stats["snapshots_taken"] += 1
                    self._insert(keys[k - 1], q, snap, keys[:k], pages[:k], pin=False)
                self._write_through(keys[k - 1], q, snap, keys[:k], pages[:k])
                t_capture += time.perf_counter() - t0
        t0 = time.perf_counter()
        self._capture_end(state, ids, keys, pages, ekey, logits)
        self.last["capture_s"] = t_capture + time.perf_counter() - t0
        return logits

    def _fill_pages(self, state, keys: list[bytes], pages: list[bytes], k: int) -> None:
        """Extends pages to the first k KV pages (from RAM where held, else read from the state)."""
        while len(pages) < k:
            j = len(pages)
            with self._lock:
                pg = self._pages.get(keys[j])
            pages.append(pg.data if pg is not None else state.read_kv(j * self.page, self.page))

    def _capture_end(self, state, ids: list[int], keys: list[bytes], pages: list[bytes], ekey: bytes,
                     logits: np.ndarray) -> None:
        """Stores the end entry of ids (state at len(ids)): only if it fits the RAM budget on its own, ranked
        just below the prompt's last snapshot in the LRU order. RAM only."""
        n, k = len(ids), len(ids) // self.page
        a = k * self.page
        with self._lock:
            if ekey in self._snaps:
                self._snaps.move_to_end(ekey)
                return
        cost = self._sizes.snapshot + self._sizes.page * k + self._sizes.page // self.page * (n - a) + 4 * logits.size
        if cost > self.ram_bytes:
            return
        self._fill_pages(state, keys, pages, k)
        e = _Snapshot(n, state.save_recurrent(), list(keys[:k]), tail=state.read_kv(a, n - a) if n > a else b"",
                      logits=np.array(logits, dtype=np.float32, copy=True))
        with self._lock:
            if ekey in self._snaps:
                return
            self._add(ekey, e, pages[:k])
            for j in sorted({(n - 1) // self.page, k}):  # the prompt's last snapshots (restore points) stay above it
                if j and keys[j - 1] in self._snaps:
                    self._snaps.move_to_end(keys[j - 1])
            self._evict()

    # ---- RAM tier -------------------------------------------------------------------------------------------

    def _insert(self, key: bytes, pos: int, data: bytes, page_keys: list[bytes], pages: list[bytes],
                pin: bool) -> bool:
        """Adds a snapshot and its pages to RAM (lock held) and evicts to the budget.
        Returns whether the snapshot is in RAM afterwards (and pinned when pin)."""
        s = self._snaps.get(key)
        if s is None:
            s = self._add(key, _Snapshot(pos, data, list(page_keys)), pages)
        self._snaps.move_to_end(key)
        if pin:
            s.pins += 1
        self._evict(keep=key)
        return key in self._snaps

    def _add(self, key: bytes, s: _Snapshot, pages: list[bytes]) -> _Snapshot:
        """Adds an entry (the most recent) and references its pages (lock held); no eviction."""
        for pk, d in zip(s.pages, pages):
            pg = self._pages.get(pk)
            if pg is None:
                pg = self._pages[pk] = _Page(d)
                self._ram += len(d)
            pg.refs += 1
        self._snaps[key] = s
        self._ram += s.nbytes
        return s

    def _evict(self, keep: bytes | None = None) -> None:
        """Drops least recently used unpinned snapshots until RAM fits the budget; `keep` goes last."""
        while self._ram > self.ram_bytes:
            victim = next((k for k, s in self._snaps.items() if not s.pins and k != keep), None)
            if victim is None:
                s = self._snaps.get(keep)
                if s is None or s.pins:
                    return
                victim = keep
            self._drop(victim)
            self._stats["evictions"] += 1

    def _drop(self, key: bytes) -> None:
        s = self._snaps.pop(key)
        self._ram -= s.nbytes
        for pk in s.pages:
            pg = self._pages[pk]
            pg.refs -= 1
            if pg.refs == 0:
                del self._pages[pk]
                self._ram -= len(pg.data)
