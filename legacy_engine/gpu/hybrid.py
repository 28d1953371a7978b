"""The hybrid decode's channel: the exchange between the GPU and the CPU of a decode step's MoE layers (GpuModel with
a hybrid placement). Per MoE layer the GPU publishes the normed hidden state and the routing in a slot of page-locked
host memory that both sides read and write (HybridLayout: native/include/le_hybrid.h), runs the shared, pinned, link,
early and extra experts, and waits for the row the CPU writes there (le_hybrid_serve, spinning on the channel): a
token is one launch sequence (one CUDA graph), its host side the CPU model's serve call. The channel also holds the
device tables the publish kernel reads (the pins' and the decode extras' places), the lookahead's buffers, the early
experts' regions and the decode extras' state (copied back into the staging after each prefill)."""
from __future__ import annotations

import time

import numpy as np

from .. import gpu
from ..core import _native
from ..core.errors import UnavailableError

# The hybrid decode's waits on each other (a healthy layer takes well under a second; a cold page cache, seconds):
# the host's for a layer's routing, the GPU's for the CPU's row (clock cycles: 2^36 is 34-69 s at 1-2 GHz). Past
# them the host raises and the GPU writes a NaN row, so neither side can hang the other.
HYBRID_TIMEOUT_S = 30.0
HYBRID_WAIT_CYCLES = 1 << 36
# The hybrid decode's lookahead (lookahead=True): during layer i the GPU predicts the next MoE layer's experts from
# layer i's h (that layer's router on h rescaled to its norm), and the CPU, done with layer i, prefetches them into
# its caches while the GPU runs the next layer's attention/GDN. Measured on the 35B-A3B Q4_K_M random-weight file
# (H100 host, 2026-11-25g, .lebench/predict.py-style run: 16 tokens x 39 layer pairs): the real top-8 is 81 % inside
# the predicted top 8, 96 % inside the top 16. LOOKAHEAD_PRED ids are published (2 k); the CPU prefetches them in
# order up to LOOKAHEAD_PREFETCH_EXPERTS experts' bytes (~14 MB of 1.8 MB experts: more than the ~90 µs between two
# layers can bring in at the host's ~70 GB/s, so the cap never binds first; the prefetch stops when the routing
# comes). Its device buffers (scales, predictions, logits: ~0.3 MB on the 35B) live in the footprint's scratch slack.
# Measured OFF by default: the CPU's experts take as long with their rows already loaded into each thread's own
# caches (uniform 5.9 vs 6.0 ms a token with 88 % of them loaded; skewed 3.1 vs 3.6) while the load fills the
# chain the CPU would have waited anyway, and the abort lag costs more (bench split hybrid/look vs hybrid, H100 +
# 16 cores, 2026-11-25g: uniform 77.8 vs 90.4 tok/s, skewed 123.4 vs 119.5, steal 0-0.2 %): the CPU's experts are
# not limited by where their weights are. The predictions (81 % / 96 % recall) are for the GPU's link fetch next.
LOOKAHEAD_PRED = 16
LOOKAHEAD_PREFETCH_EXPERTS = 8
# The hybrid decode's channels (page-locked host memory) are kept for the process and reused by the next model, and
# token numbers (SEQ) count on across models: no flag left in a channel by an earlier model's token can equal a new
# token's. Added (2026-11-25f) when test_gpu_model.py run in order failed test_hybrid_decode_matches_cpu[replay]
# with a NaN row (not alone); this alone did not cure it, that session's changes together did: cause not found.
_HY_POOL: list = []           # [PinnedBuffer], the channels not in use
# hybrid_stats' keys <- le_hybrid_serve's stats (LE_HY_STAT_<name>, native/include/le_model.h)
_HY_STATS = {"read_s": "WAIT_S", "cpu_s": "CPU_S", "cpu_experts": "EXPERTS", "steps": "LAYERS", "prefetch_s": "PF_S",
             "prefetch_aimed": "PF_AIMED", "prefetch_hits": "PF_HITS", "prefetch_bytes": "PF_BYTES",
             "early_copied": "E_COPIED", "early_in_time": "E_READY", "early_routed": "E_HITS",
             "split_lag_s": "SPLIT_LAG", "split_tail_s": "SPLIT_TAIL"}
_HY_SEQ = [0]


class HybridLayout:
    """native/include/le_hybrid.h in Python: word offsets of the hybrid decode's channel (tests/test_hybrid_serve.py
    serves through it, so a mismatch with the C macros fails there)."""
    SEQ, N_LINK, N_EARLY, HEADER, READY, DONE, H, PRED_MAX, EARLY_MAX = 0, 1, 2, 16, 0, 16, 32, 32, 4

    def __init__(self, E: int, k: int, n_layer: int):
        self.E, self.k, self.n_layer = E, k, n_layer
        self.seq, self.ready, self.done, self.h = self.SEQ, self.READY, self.DONE, self.H
        self.ids = self.H + E
        self.cpu_ids = self.ids + k
        self.wts = self.ids + 2 * k
        self.row = (self.ids + 3 * k + 15) // 16 * 16
        self.pred_ready = self.row + (E + 15) // 16 * 16
        self.pred = self.pred_ready + 16
        self.early_ready = self.pred + self.PRED_MAX
        self.early = self.early_ready + 16
        self.slot_words = self.early + 16
        self.channel_words = self.HEADER + n_layer * self.slot_words

    def slot_offset(self, layer: int) -> int:
        return self.HEADER + layer * self.slot_words

    def slot(self, chan: np.ndarray, layer: int) -> np.ndarray:
        """Layer's slot as a view of the int32 channel array."""
        o = self.slot_offset(layer)
        return chan[o:o + self.slot_words]


class HybridChannel:
    """gm: the GpuModel whose hybrid decode this is (its residency, scratch, layers and CPU model); the channel itself
    is made at the first hybrid step (channel())."""

    def __init__(self, gm):
        self.gm = gm
        self.ch = None            # the channel and its device tables (channel())
        # the hybrid decode: MoE layer steps, experts run on the CPU, seconds in le_moe_routed and in the routing read
        self.stats = {"steps": 0, "cpu_experts": 0, "cpu_s": 0.0, "read_s": 0.0, "prefetch_s": 0.0,
                      "prefetch_aimed": 0, "prefetch_hits": 0, "prefetch_bytes": 0.0, "early_copied": 0,
                      "early_in_time": 0, "early_routed": 0, "split_lag_s": 0.0, "split_tail_s": 0.0}
        self.extras_state = "empty"     # "empty" (the staging holds a prefill's experts), "filling", "ready"
        self.extras_refills, self._extras_due = 0, 0.0

    def channel(self) -> dict:
        """The hybrid decode's channel (page-locked, device-visible through unified addressing), its layout, the
        device table of pin indices [n_layer, n_expert] (-1: not pinned), the MoE layers in order."""
        if self.ch is None:
            hp = self.gm.hparams
            if not _native.gpu_attribute(gpu.ATTR_UNIFIED_ADDRESSING):
                raise UnavailableError("the hybrid decode needs unified addressing (a 64-bit host and driver): the "
                                       "GPU reads and writes its host channel directly")
            lay = HybridLayout(hp.n_embd, hp.n_expert_used, hp.n_layer)
            pb = next((b for b in _HY_POOL if b.nbytes >= 4 * lay.channel_words), None)
            if pb is None:
                pb = gpu.PinnedBuffer(4 * lay.channel_words)
            else:
                _HY_POOL.remove(pb)
            arr = pb.array.view(np.int32)[:lay.channel_words]
            arr[:] = 0
            arr[HybridLayout.N_LINK] = self.gm.link_experts     # the CPU's lookahead skips the link's share
            arr[HybridLayout.N_EARLY] = self.gm.early_experts
            host_dev = {}
            if self.gm.link_experts or self.gm.early_experts or self.gm.decode_extras:
                if self.gm.res.host is None:
                    raise UnavailableError(f"link/early experts: the weight map is {self.gm.res.host_pinned_why}; the "
                                           "GPU can fetch experts only from page-locked memory")
                dev0 = _native.gpu_host_device_pointer(self.gm.res.map_base)
                host_dev = {n: dev0 + (a - self.gm.res.map_base) for n, a in self.gm.res.host_addr.items()}
            moe = [L["index"] for L in self.gm.layers if "ffn_gate_inp" in L]
            self.ch = {"buf": pb, "arr": arr, "ptr": int(_native.ffi.cast("uintptr_t", pb.ptr)), "layout": lay,
                       "host_dev": host_dev,
                       "pin_idx": gpu.Buffer.from_array(self.gm.res.pin_table(), "hybrid pin indices"), "seq": 0,
                       # the decode extras' places [n_layer, n_expert] (-1: none, or not in the staging now)
                       "extra_idx": gpu.Buffer.from_array(np.full((hp.n_layer, hp.n_expert), -1, np.int32),
                                                          "hybrid decode extras' places"),
                       "layers": np.array(moe, dtype=np.int32), "lookahead": self._lookahead_buffers(moe),
                       "counts": np.zeros((hp.n_layer, hp.n_expert), dtype=np.int64),
                       "stats": np.zeros(_native.lib.LE_HY_STATS)}
        return self.ch

    def staging(self, i: int) -> tuple[dict, list]:
        """Layer i's staging in VRAM of the experts the GPU runs from the link: per expert tensor a region of
        link_experts + early_experts experts (the fetched ones, then the early ones) ->
        ({tensor name: region address}, [(host device address, region, expert bytes)] for hybrid_fetch)."""
        slots = self.gm.early_experts + self.gm.link_experts
        hy = self.ch
        if self.gm.decode_extras:     # the layer's region of the staging pool: its slots, then its extras
            if i not in self.gm.placement.extras_at:
                return {}, []
            lbuf = self.gm.res.pool.ptr + self.gm.placement.extras_at[i][0]
            per = slots + len(self.gm.decode_extras.get(i, ()))
        elif slots:
            lbuf, per = self.gm.scratch.buf("hy_link", slots * max(self.gm.footprint.expert_bytes.values())).ptr, slots
        else:
            return {}, []
        at, tensors, staged = 0, [], {}
        for name, (_host, _tb, eb, _off, _po) in zip(self.gm.res.stage_names[i], self.gm.res.stage_layout[i]):
            tensors.append((hy["host_dev"][name], lbuf + at, eb))
            staged[name] = lbuf + at
            at += per * eb
        return staged, tensors

    def early_regions(self) -> list:
        """The CPU's early buffer: per parity (MoE layer ordinal % 2) and expert tensor a region of early_experts
        slots of the largest expert of any expert tensor -> [{tensor name: region address} per parity]; a layer's
        copies never land where the layer before may still be reading (the other parity), whatever their sizes."""
        hy = self.ch
        if "early_regions" not in hy:
            n, slot = self.gm.early_experts, self._early_slot_bytes()
            tag, self.gm.scratch.tag = self.gm.scratch.tag, "d"
            try:
                base = self.gm.scratch.buf("hy_early", 6 * n * slot).ptr
            finally:
                self.gm.scratch.tag = tag
            regions = [{}, {}]
            for p in (0, 1):
                for L in self.gm.layers:
                    if "ffn_gate_inp" not in L:
                        continue
                    for t, w in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                        regions[p][L["exp_tensor"][w]] = base + ((3 * p + t) * n) * slot
            hy["early_regions"], hy["early_stride"] = regions, 3 * n * slot
        return hy["early_regions"]

    def _early_slot_bytes(self) -> int:
        """The largest expert of any expert tensor (a slot of the early buffer)."""
        return max(L[w].expert_bytes for L in self.gm.layers if "ffn_gate_inp" in L
                   for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))

    def early(self) -> dict | None:
        """le_hybrid_serve's early config: the copy stream and, per layer and gate/up/down, the staging address of
        early slot 0 and an expert's bytes (None: no early experts)."""
        hy = self.ch
        if not self.gm.early_experts:
            return None
        if "early" not in hy:
            hp = self.gm.hparams
            dst = np.zeros((hp.n_layer, 3), dtype=np.uint64)
            eb = np.zeros((hp.n_layer, 3), dtype=np.int64)
            regions = self.early_regions()
            for i in hy["layers"]:
                L = self.gm.layers[int(i)]
                for t, w in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                    name = L["exp_tensor"][w]
                    if L[w].ptr != self.gm.res.stage_offset[name]:
                        raise UnavailableError(f"early_experts: layer {i}'s {w} is part of a fused tensor")
                    dst[i, t] = regions[0][name]
                    eb[i, t] = L[w].expert_bytes
            hy["early"] = {"n_early": self.gm.early_experts, "stream": gpu.Stream(ordered=False), "dst": dst,
                           "eb": eb}
        e = hy["early"]
        return {"n_early": e["n_early"], "stream": e["stream"].handle, "dst": e["dst"], "eb": e["eb"],
                "parity_stride": hy["early_stride"]}

    def _lookahead_buffers(self, moe: list) -> dict | None:
        """The lookahead's device data in one buffer: scales [n_layer, E] (row i: the next MoE layer's post-attention
        norm / layer i's, so h_i * scales_i is h_i normed as that layer would), pred [n_layer, HY_PRED_MAX] int32
        (each layer's predicted experts) and logits [n_expert]; `from` {i: the MoE layer after i}. None: off."""
        if not (self.gm.lookahead or self.gm.early_experts) or len(moe) < 2:
            return None
        hp, f = self.gm.hparams, self.gm.file.gguf
        E, ne = hp.n_embd, hp.n_expert
        scales = np.zeros((hp.n_layer, E), dtype=np.float32)
        for i, j in zip(moe, moe[1:]):
            a = f.data(f"blk.{i}.post_attention_norm.weight").view(np.float32)
            b = f.data(f"blk.{j}.post_attention_norm.weight").view(np.float32)
            scales[i] = np.where(np.abs(a) > 1e-30, b / np.where(a == 0, 1, a), 0)   # a zero weight: no information
        pred = np.full((hp.n_layer, gpu.HY_PRED_MAX), -1, dtype=np.int32)
        data = np.concatenate([scales.view(np.uint8).ravel(), pred.view(np.uint8).ravel(),
                               np.zeros(4 * ne, dtype=np.uint8)])
        buf = gpu.Buffer.from_array(data, "hybrid lookahead")
        return {"buf": buf, "scales": buf.ptr, "pred": buf.ptr + scales.nbytes,
                "logits": buf.ptr + scales.nbytes + pred.nbytes, "from": dict(zip(moe, moe[1:]))}

    def extras_step(self) -> None:
        """Before a hybrid decode step: after a prefill, copy the decode extras back into the staging on the copy
        stream (after the prefill's last reads of its slots; the host issues runs of consecutive experts); once the
        copy stream is done, their places into the device table hybrid_publish reads (from then on the GPU runs
        them)."""
        hy = self.channel()
        if self.extras_state == "empty":
            nb = self.gm.res.fill_extras(self.gm.link_experts + self.gm.early_experts)
            self.extras_state = "filling"
            self.extras_refills += 1
            # a simulated link: done no sooner than its rate allows (the copy stays asynchronous, as on that link)
            sim = self.gm.simulate_link
            self._extras_due = time.perf_counter() + (nb / (sim * 1e9) if sim else 0)
        elif (self.extras_state == "filling" and self.gm.res.copy_stream.query()
              and time.perf_counter() >= self._extras_due):
            hy["extra_idx"].upload(self.extras_table())
            self.extras_state = "ready"

    def extras_table(self) -> np.ndarray:
        """int32 [n_layer, n_expert]: each decode extra's place among its layer's extras, -1 elsewhere."""
        hp = self.gm.hparams
        t = np.full((hp.n_layer, hp.n_expert), -1, dtype=np.int32)
        for i, es in self.gm.decode_extras.items():
            t[i, list(es)] = np.arange(len(es), dtype=np.int32)
        return t

    def extras_off(self) -> None:
        """A pass of several tokens is about to overwrite the staging: the decode extras off (their table -1, on
        the default stream before the pass's work) until extras_step has copied them back."""
        if self.extras_state != "empty":
            if self.extras_state == "ready":
                _native.gpu_memset8(self.ch["extra_idx"].ptr, 0xFF, self.ch["extra_idx"].nbytes)
            self.extras_state = "empty"

    def next(self) -> None:
        """A new token's sequence number into the channel (before its launches)."""
        hy = self.channel()
        _HY_SEQ[0] = hy["seq"] = _HY_SEQ[0] % 0x7FFFFFFF + 1
        hy["arr"][HybridLayout.SEQ] = hy["seq"]

    def serve(self, layers) -> None:
        """The CPU's experts of `layers` for the current token (le_hybrid_serve: waits for each layer's routing)."""
        hy = self.ch
        pf = 0
        if self.gm.lookahead and not self.gm.early_experts:
            pf = LOOKAHEAD_PREFETCH_EXPERTS * max(self.gm.footprint.expert_bytes.values())
        self.gm.model.native.hybrid_serve(hy["buf"].ptr, hy["seq"], layers, counts=hy["counts"],
                                          timeout_s=HYBRID_TIMEOUT_S, stats=hy["stats"], prefetch_bytes=pf,
                                          early=self.early())

    def serve_all(self) -> None:
        """Every MoE layer of the current token, as the GPU publishes its routing (a replayed CUDA graph)."""
        self.serve(self.ch["layers"])

    def release_all(self) -> None:
        """The current token's slots released unserved (its replay failed): the GPU's waits end."""
        self.gm.model.native.hybrid_release(self.ch["buf"].ptr, self.ch["seq"], self.ch["layers"])

    def flush(self) -> None:
        """The channel's counts and timings into route_counts and hybrid_stats."""
        hy = self.ch
        if hy is None:
            return
        c, st = hy["counts"], hy["stats"]
        for i in np.flatnonzero(c.any(axis=1)):
            self.gm.route_counts.setdefault(int(i), np.zeros(self.gm.hparams.n_expert, dtype=np.int64))[:] += c[i]
        hs = self.stats
        for key, stat in _HY_STATS.items():
            v = st[getattr(_native.lib, "LE_HY_STAT_" + stat)]
            hs[key] += v if isinstance(hs[key], float) else int(v)
        c[:] = 0
        st[:] = 0

    def close(self) -> None:
        """The counts flushed, the channel kept for the next model (see _HY_POOL), its device tables freed."""
        if self.ch is not None:
            self.flush()
            hy, self.ch = self.ch, None
            _HY_POOL.append(hy["buf"])          # kept for the next model (see _HY_POOL)
            hy["pin_idx"].free()
            if hy["lookahead"]:
                hy["lookahead"]["buf"].free()
