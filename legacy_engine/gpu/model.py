"""GPU-resident mode: the whole model in VRAM, prefill and decode on the GPU (cuda8/ kernels).

`GpuModel(model)` uploads the weights of a loaded `Model` (its GGUF file's tensors, as they are stored)
and runs the same forward pass as native/model.c, op for op, with the kernels of one tier:

  x = token_embd[tokens]                         get_rows
  per layer:  h = RMSNorm(x) * attn_norm         rmsnorm
              GDN:  qkv, z, beta, alpha = W h    matmuls; conv1d_silu; gdn_l2norm_qk; gdn_gates;
                                                 gdn_recurrent (state in VRAM); gdn_gated_rmsnorm; W_out
              attention: q|gate, k, v = W h      matmuls (k, v straight into the KV cache rows);
                                                 qk_norm_rope; attention_decode / _prefill; W_o
              x += y;  h = RMSNorm(x) * post_norm
              FFN: dense SwiGLU, or MoE          router matmul; moe_route; gemv_ids gate/up; swiglu;
                                                 gemv_ids down; shared expert; moe_combine
              x += y
  logits = W_out RMSNorm(x) * output_norm        rmsnorm; matmul (downloaded)

Matmuls: one token (decode) -> GEMV; with int8 (default on the dp4a tier) the activations are
quantised to Q8_1 once per input and the quantised weights run gemv_dp4a (W4A8/W8A8), f32 weights
gemv_f32_f32; several tokens (prefill) -> gemm_dp4a on the same Q8_1 activations (int8_prefill, default
= int8), else gemm_f32 (dequantise into shared memory, f32 accumulate).
MoE experts run as (token, expert) GEMVs indexed on the GPU by the router's ids (no host round trip).

`GpuState` holds a sequence's GDN conv/SSM states and KV cache in VRAM, with the byte layouts of the CPU
state (NativeState.save_recurrent / read_kv), so `to_cpu` / `from_cpu` hand a sequence between the
engines at any position, and the snapshot cache (cache.py) works on it unchanged.

Types without a GPU kernel (e.g. Q5_0, Q2_K, F16) are dequantised to f32 at upload and listed in
`converted` (`legacy-engine run --gpu` prints them): more VRAM, same values, never silent.
Decode steps replay a LaunchPlan (gpu.py): the launches of the first step are recorded with every argument
fixed; the token and its position live in a device buffer (st.io) that the kernels read (rope, the KV store,
attention), so the next steps only upload 8 bytes, replay, and download the logits. Where the driver has CUDA
graphs (and the tier is not fermi) the plan is captured once as a graph: a token is then one cuGraphLaunch.
Not here yet: chunked GDN prefill (the recurrence runs token by token), DP4A GEMM for prefill; the grouped
expert GEMM (grouped_experts=True) is not yet run-verified and off by default.
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .. import gpu
from ..core.errors import EngineError, UnavailableError
from .sample import DeviceSampler
from ..cpu.model import check_logits
from ..plan.planner import ALLOC_GRANULE, ARENA_ALIGN, ARENA_NAMES, align_up, arena_bytes

PREFILL_CHUNK = 512      # tokens per pass by default: bounds the scratch
MAX_CHUNK = 4096         # the most a GpuModel may be asked for (n*k MoE pairs <= gpu.MAX_PAIRS is checked too)
HANDOFF_PINNED_MAX = 1 << 30   # page-locked staging of a GPU <-> CPU state handoff up to 1 GiB (past it: pageable)
# The hybrid decode's waits on each other (a healthy layer takes well under a second; a cold page cache, seconds):
# the host's for a layer's routing, the GPU's for the CPU's row (clock cycles: 2^36 is 34-69 s at 1-2 GHz). Past
# them the host raises and the GPU writes a NaN row, so neither side can hang the other.
HYBRID_TIMEOUT_S = 30.0
# The streamed prefill puts a layer's pinned experts into its staging (beside the copied ones: the grouped GEMMs read
# one array) with a copy kernel on the compute stream (hybrid_fetch), not cuMemcpyDtoDAsync: the driver runs a
# device-to-device memcpy on a copy engine, where it queued behind the next layer's host copies. Measured (35B-A3B
# skewed, 2048 tokens, 6 GiB, H200, alternated in one process, .lebench pinab): 6,089 vs 5,885 tok/s, the GPU
# waiting for expert copies 14 vs 26 ms a prefill.
PIN_COPY_KERNEL = True
HYBRID_WAIT_CYCLES = 1 << 36
# maybe_repin: re-choose the pinned experts once the routing counted since they were chosen (at least
# REPIN_MIN_ROUTES (token, slot) routes per expert on average) would have the best pins for the same bytes take
# REPIN_DRIFT more of the routed work (planner.pinned_share) than the current ones. Each repin uploads the pins
# again between requests, by DMA from the page-locked map: 108 ms for 1,716 pins (3.07 GiB) of the 35B-A3B, H200.
REPIN_DRIFT = 0.05
REPIN_MIN_ROUTES = 64
# The hybrid decode's lookahead (lookahead=True): during layer i the GPU predicts the next MoE layer's experts from
# layer i's h (that layer's router on h rescaled to its norm), and the CPU, done with layer i, prefetches them into
# its caches while the GPU runs the next layer's attention/GDN. Measured on the 35B-A3B Q4_K_M random-weight file
# (H100 host, 2026-11-25g, .lebench/predict.py-style run: 16 tokens x 39 layer pairs): the real top-8 is 81 % inside
# the predicted top 8, 96 % inside the top 16. LOOKAHEAD_PRED ids are published (2 k); the CPU prefetches them in
# order up to LOOKAHEAD_PREFETCH_EXPERTS experts' bytes (~14 MB of 1.8 MB experts: more than the ~90 µs between two
# layers can bring in at the host's ~70 GB/s, so the cap never binds first; the prefetch stops when the routing
# comes). Its device buffers (scales, predictions, logits: ~0.3 MB on the 35B) live in the planner's scratch slack.
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


def default_tier(arch: int) -> str:
    """The fastest tier a GPU of compute capability arch (x10) runs natively."""
    if arch >= gpu.TIERS["dp4a"][1]:
        return "dp4a"
    return "kepler" if arch >= gpu.TIERS["kepler"][1] else "fermi"


def rope_table(hp, n_ctx: int) -> np.ndarray:
    """[n_ctx, n_rot/2, 2] f32 (cos, sin) of every position and frequency slot, as native/rope.c computes
    them: inv_freq = theta^(-2i/n_rot) and the angle in f64, IMRoPE's position per slot (text tokens:
    t = h = w = pos, e = 0), then cos/sin rounded to f32."""
    half = hp.n_rot // 2
    i = np.arange(half)
    inv_freq = np.power(np.float64(np.float32(hp.rope_theta)), -2.0 * i / hp.n_rot)
    s = hp.rope_sections
    if sum(s) > 0:
        sec = i % 3
        covered = ((sec == 0) & (i < 3 * s[0])) | ((sec == 1) & (i < 3 * s[1])) | ((sec == 2) & (i < 3 * s[2]))
    else:
        covered = np.ones(half, dtype=bool)
    pos = np.arange(n_ctx, dtype=np.float64)[:, None]
    ang = np.where(covered[None, :], pos, 0.0) * inv_freq[None, :]
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)


class _W:
    """A weight in VRAM: ptr (device address of expert 0 / the row range), ggml type (gpu.F32 for f32),
    rows, cols, bytes from one expert to the next (3-D tensors)."""
    __slots__ = ("ptr", "qtype", "nrows", "ncols", "expert_bytes")

    def __init__(self, ptr: int, qtype: int, nrows: int, ncols: int, expert_bytes: int = 0):
        self.ptr, self.qtype, self.nrows, self.ncols, self.expert_bytes = ptr, qtype, nrows, ncols, expert_bytes


class GpuModel:
    def __init__(self, model, tier: str | None = None, arch: int | None = None, int8: bool | None = None,
                 toolchain: str = "auto", progress=None, plan: bool = True, graphs: bool | None = None,
                 stream_experts: bool = False, pinned: dict | None = None, vram: int | None = None,
                 n_ctx: int = 4096, chunk: int = PREFILL_CHUNK, simulate_link: float | None = None,
                 sort_pairs: bool = True, save_routing: bool = True, grouped_experts: bool = True,
                 cpu_experts: bool = False, int8_prefill: bool | None = None, mma: bool | None = None,
                 link_experts: int = 0, lookahead: bool | None = None, early_experts: int = 0,
                 decode_extras: dict | None = None):
        """model: a loaded Model (its file's tensors are uploaded; the CPU model stays usable).
        tier: 'fermi' | 'kepler' | 'dp4a' (default: the GPU's own, default_tier); arch: the PTX target
        (compute capability x10, default the GPU's: 35, 61 or 70 run the legacy PTX on a newer card);
        int8: DP4A decode GEMVs on Q8_1 activations (default: on for the dp4a tier).
        int8_prefill: passes of several tokens run the quantised weights as int8 GEMMs too (gemm_dp4a: activations
        quantised to Q8_1 once per input, as decode does), default = int8. The f32 GEMM (gemm_f32) is the
        alternative: 1.3-1.4x slower on an H100 (q4_K, same run), no activation rounding.
        mma: the int8 GEMMs on tensor cores (gemm_mma: the same bits as gemm_dp4a), default on where the kernels
        have it (dp4a tier, sm_75+: T4 and newer); False keeps gemm_dp4a (a card whose tensor cores are throttled).
        plan: decode steps replay a recorded LaunchPlan (the first step of a state records it; the token and
        position go to the GPU, every argument stays fixed): ~1 µs of Python per launch instead of ~30.
        graphs: the plan also runs as one CUDA graph (one host call per token). Default: on where the driver has
        graphs (11.4+), off for the fermi tier (a Fermi driver stops at CUDA 9.1); True where the driver lacks
        them is an error.
        stream_experts: the routed experts stay in host RAM (page-locked in place) except `pinned`
        {layer: [expert ids]}, which live in VRAM; a pass copies the experts its tokens route to into one of two
        staging buffers (full-layer layout, so the router's ids index it unchanged) on a copy stream, the next
        layer's while this one computes when the chunk will route to most experts. For prefill; decode steps
        work but copy their experts every token (the CPU decodes in the split plans).
        vram: budget in bytes for everything this model allocates, states of up to n_ctx positions and passes of
        up to `chunk` tokens included: checked before any upload (planner.PlanningError naming the parts), then
        held by the driver layer (gpu.set_budget).
        sort_pairs: passes of several tokens run the routed experts' (token, expert) GEMVs in expert order (x rows
        gathered per pair, outputs scattered back), so the blocks reading one expert run together and share its
        weights in L2 (one host sync per MoE layer to read the routing).
        grouped_experts: with sort_pairs, passes of several tokens run the routed experts as one grouped GEMM per
        matrix (gemm_f32_<type>_ids: tiles of up to 32 tokens of one expert, weights read once per tile, f32
        activations) instead of one GEMV per (token, expert) pair. On by default: 1,120 vs 1,001 tok/s (pp2048,
        same run, 35B-A3B Q4_K_M streamed under 6 GiB, H100, 2026-11-25; `bench split --strategies
        stream/grouped,stream/pairs`).
        cpu_experts (with stream_experts): the hybrid decode. One-token steps run attention/GDN, the router, the
        shared expert and the pinned experts on the GPU and the other routed experts on the CPU (the CPU model's
        le_moe_routed on its threads). Per MoE layer the GPU publishes the normed hidden state and the routing in a
        channel of page-locked host memory (hybrid_publish), runs the shared and pinned experts, and waits
        (hybrid_wait) for the row the CPU writes there (le_hybrid_serve, spinning on the channel): no host step,
        a token is one launch sequence (one CUDA graph).
        link_experts (hybrid decode): per layer and token, the GPU also runs this many of the experts that are not
        pinned, fetching their weights from the page-locked host map over the link into a small VRAM staging
        (hybrid_fetch) while the CPU runs the rest (the link's bandwidth added to the CPU's); 0: the CPU runs every
        expert not pinned. The planner chooses it (planner.choose_link).
        decode_extras (hybrid decode): {layer: [expert ids]} not pinned that the decode keeps in the prefill's expert
        staging (idle between prefills: planner.choose_decode_extras, extras_regions) and runs on the GPU as it runs
        the pinned ones; a prefill overwrites them, and the decode steps after it copy them back on the copy stream
        (the first step issues the copies, a later one finds them done and switches them on: until then the CPU
        runs them).
        lookahead (hybrid decode, f32 routers as in every llama.cpp file; off by default: measured no faster, see
        LOOKAHEAD_PRED): each MoE layer also predicts the next one's experts (hybrid_predict), which the CPU loads
        into its caches while the GPU runs that layer's attention/GDN (le_hybrid_serve's prefetch); the link experts
        are then the ones predicted last. The same experts and sums either way; only where they run and how soon.
        early_experts (hybrid decode, f32 routers, the page-locked map): per MoE layer the CPU, done with the layer
        before, copies the next layer's this many likeliest experts not pinned (the prediction above) into VRAM on
        a copy stream of its own while the GPU runs that layer's attention/GDN (the link and the host's memory are
        idle then); those the layer then routes to run on the GPU (if the copy finished before its routing).
        save_routing: close() adds the routing counts of this model's passes to the file's saved statistics
        (planner.load_routing), from which the next placement pins the hottest experts.
        simulate_link: GB/s; streamed expert copies are paced to it (the host waits until a copy would have
        finished on that link), to run a slow card's split (a CMP 100-210 on PCIe Gen1 x1: 0.25) on a fast one."""
        hp = self.hparams = model.hparams
        if hp.arch == "qwen3next":
            raise UnavailableError("the GPU forward pass runs qwen35 and qwen35moe files (not qwen3next)")
        dev = gpu.init()
        self.device = dev
        dev_arch = gpu.device_arch()
        self.tier = tier or default_tier(dev_arch)
        self.k = gpu.Kernels(self.tier, dev_arch if arch is None else arch, toolchain)
        self.int8 = (self.tier == "dp4a") if int8 is None else bool(int8)
        self.int8_prefill = self.int8 if int8_prefill is None else bool(int8_prefill)
        if mma and not (self.int8_prefill and self.k.has_mma):
            raise UnavailableError(f"mma: the int8 tensor-core GEMM needs int8 prefill and the dp4a tier at "
                                   f"compute_{gpu.MMA_ARCH}+, not {self.k.name} "
                                   f"(int8 prefill {'on' if self.int8_prefill else 'off'})")
        self.mma = self.int8_prefill and self.k.has_mma if mma is None else bool(mma)
        self.model = model
        self.file = model.file
        self._faults = model_faults(model)
        self.chunk = int(chunk)
        if not 1 <= self.chunk <= MAX_CHUNK or self.chunk * max(hp.n_expert_used, 1) > gpu.MAX_PAIRS:
            raise ValueError(f"chunk = {chunk}: 1…{MAX_CHUNK} tokens and chunk * experts per token <= "
                             f"{gpu.MAX_PAIRS}")
        self.stream = bool(stream_experts) and hp.n_expert > 0
        if cpu_experts and not self.stream:
            raise ValueError("cpu_experts (the hybrid decode) needs stream_experts and a MoE model")
        self.cpu_experts = bool(cpu_experts)
        if not 0 <= int(link_experts) <= (hp.n_expert_used if hp.n_expert else 0):
            raise ValueError(f"link_experts = {link_experts}: 0 … n_expert_used")
        if link_experts and not cpu_experts:
            raise ValueError("link_experts is a setting of the hybrid decode (cpu_experts=True)")
        self.link_experts = int(link_experts)
        routers = [model.file.tensors.get(f"blk.{i}.ffn_gate_inp.weight") for i in range(hp.n_layer)]
        f32_routers = all(t is None or t.type == 0 for t in routers)
        if not 0 <= int(early_experts) <= gpu.HY_EARLY_MAX:
            raise ValueError(f"early_experts = {early_experts}: 0 … {gpu.HY_EARLY_MAX}")
        for what, on in (("lookahead", lookahead), ("early_experts", early_experts)):   # both use the prediction
            if on and not cpu_experts:
                raise ValueError(f"{what} is a setting of the hybrid decode (cpu_experts=True)")
            if on and not f32_routers:
                raise UnavailableError(f"{what}: the next layer's routing is predicted with f32 routers only; this "
                                       "file's are quantised")
        self.lookahead = bool(lookahead)
        self.early_experts = int(early_experts)
        self.lookahead_why = "" if self.lookahead else "off (measured no faster: LOOKAHEAD_PRED's note)"

        self.pinned = {int(i): sorted(set(int(e) for e in v)) for i, v in (pinned or {}).items()} if self.stream else {}
        for i, es in self.pinned.items():
            if not 0 <= i < hp.n_layer or any(not 0 <= e < hp.n_expert for e in es):
                raise ValueError(f"pinned: layer {i} experts {es[:4]}… outside {hp.n_layer} layers x {hp.n_expert}")
        self.decode_extras = {int(i): sorted(set(int(e) for e in v)) for i, v in (decode_extras or {}).items() if v}
        if self.decode_extras and not self.cpu_experts:
            raise ValueError("decode_extras is a setting of the hybrid decode (cpu_experts=True)")
        for i, es in self.decode_extras.items():
            if not 0 <= i < hp.n_layer or any(not 0 <= e < hp.n_expert for e in es) or set(es) & set(
                    self.pinned.get(i, ())):
                raise ValueError(f"decode_extras: layer {i} experts {es[:4]}… outside {hp.n_layer} layers x "
                                 f"{hp.n_expert}, or pinned")
        from ..plan import planner
        self.logit_rows = planner.head_rows(self.chunk, self.stream)   # all_logits runs the head in such pieces
        self.n_ctx_plan = int(n_ctx)
        self.footprint = self._footprint(self.pinned)
        self.budget = None
        if vram is not None:
            planner.check_fits(self.footprint, int(vram), f"{'streamed' if self.stream else 'resident'} GPU model")
            self.budget = int(vram)
            gpu.set_budget(gpu.mem_stats()["used"] + self.budget)
        self.simulate_link = simulate_link
        self.sort_pairs = bool(sort_pairs)
        self.grouped = bool(grouped_experts) and self.sort_pairs
        self.save_routing = bool(save_routing)
        self._host = None          # (address, bytes) of the page-locked weight map (stream mode)
        self.host_pinned_why = ""
        self._staging: list[gpu.Buffer] = []
        self.pin_copy_kernel = PIN_COPY_KERNEL   # the pinned experts into the staging by a copy kernel (or memcpy)
        self._staged: list[tuple[int, set]] = []
        # streamed-expert accounting (stream_report), and the host's wait for the routing (sorted pairs too)
        # copy_busy_s: the copy stream's time from the start to the end of each layer's host copies (events on it,
        # after its wait for the slot), copy_slowest_gbps: the slowest such layer's rate (of those >= 64 MiB)
        self.stream_stats = {"h2d_bytes": 0, "d2d_bytes": 0, "layers": 0, "copy_stall_s": 0.0, "ids_wait_s": 0.0,
                             "copy_busy_s": 0.0, "copy_slowest_gbps": 0.0}
        # the hybrid decode: MoE layer steps, experts run on the CPU, seconds in le_moe_routed and in the routing read
        self._hybrid_stats = {"steps": 0, "cpu_experts": 0, "cpu_s": 0.0, "read_s": 0.0, "prefetch_s": 0.0,
                              "prefetch_aimed": 0, "prefetch_hits": 0, "prefetch_bytes": 0.0, "early_copied": 0,
                              "early_in_time": 0, "early_routed": 0, "split_lag_s": 0.0, "split_tail_s": 0.0}
        self._stalls: list = []
        self._copy_marks: list = []     # (event before, event after, bytes) of each layer's host copies
        # routing statistics, counted where the host reads the routing anyway (streamed or sorted passes);
        # close() adds them to the model file's saved counts (planner.save_routing), which choose the pins
        self.route_counts: dict[int, np.ndarray] = {}
        self._counts_dev, self._counts_layers = None, set()     # moe_sort's device counts (_route_counts_dev)
        self._handoff = None                                     # page-locked staging of GpuState's handoff
        self.converted: list[str] = []     # "name (TYPE)" of tensors dequantised to f32 at upload
        self._bufs: dict[str, tuple] = {}      # resident tensor -> (device address, type on the GPU)
        self._weights: gpu.Buffer | None = None
        self.vram_bytes = 0
        from ..plan.planner import host_embedding
        # the token embedding: "vram", or "host" (planner.host_embedding: page-locked host memory, rows read by
        # get_rows over the link; needs the device to address host memory)
        self.embd_where = "host" if host_embedding(self.file, self.stream) else "vram"
        self._host_copy = None     # a page-locked copy of the host-read embedding where the map is not page-locked
        try:
            self._upload_all(progress)
        except BaseException:
            for b in [self._weights, getattr(self, "_pool", None)] + list(getattr(self, "_pin_store", {}).values()):
                if b is not None:
                    b.free()
            if self._host is not None:
                from ..core import _native
                _native.gpu_host_unregister(self._host[0])
            if self._host_copy is not None:
                self._host_copy.free()
            if self.budget is not None:
                gpu.set_budget(None)          # a failed load leaves no budget (nor memory) behind
            raise
        self._scratch: dict[str, gpu.Buffer] = {}
        self._sampler: DeviceSampler | None = None   # sample_next's buffers, made on first use
        self._arena: gpu.Buffer | None = None      # a pass's block buffers (_arena_reserve, _arena_buf)
        self._arena_block, self._arena_at = None, 0
        self._retired: list[gpu.Buffer] = []
        self._tag = "p"           # scratch set: "d" decode (one token, named by plans), "p" prefill
        self._gen = 0             # bumped when a decode buffer or the rope table moves: plans recorded before are stale
        # a streamed step syncs with the host to stage its experts: not replayable; a hybrid step's host work is
        # made of host steps, which a plan replays between its segments
        self.plan = plan and (not self.stream or self.cpu_experts)
        self._hy = None           # the hybrid decode's channel (_hy_channel)
        have = gpu.graphs_available()
        if graphs and not have:
            raise UnavailableError("CUDA graphs requested but the driver lacks them (needs CUDA 11.4+)")
        if graphs is None:
            graphs = have and self.tier != "fermi"
            self.graphs_why = ("off: the fermi tier (a Fermi driver has no graphs)" if self.tier == "fermi" else
                               "on" if have else "off: the driver lacks them (needs CUDA 11.4+)")
        else:
            self.graphs_why = "on (asked)" if graphs else "off (asked)"
        self.graphs = bool(graphs) and self.plan
        if graphs and not self.plan:
            self.graphs_why = "off: needs the launch plan (plan=False)"
        self._rope_n = 0
        self._rope: gpu.Buffer | None = None
        self._prof = None

    # ------------------------------------------------------------------ weights

    def _upload(self, name: str) -> tuple[int, int]:
        """Uploads tensor `name` once into its place in the weight allocation -> (device address, ggml type as
        stored on the GPU)."""
        if name in self._bufs:
            return self._bufs[name]
        if name == "token_embd.weight" and self.embd_where == "host":
            return self._host_tensor(name)
        from ..core import _native
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
        """A tensor the GPU reads where it lies in host memory (planner.host_embedding), over the link: the weight
        map's device address where the map is page-locked (_setup_streaming), else a page-locked copy of it ->
        (device address, ggml type)."""
        from ..core import _native
        if not _native.gpu_attribute(gpu.ATTR_UNIFIED_ADDRESSING):
            raise UnavailableError(f"{name} stays in host memory when the experts stream, and this GPU cannot address "
                                   "host memory (no unified addressing: a 64-bit host and driver)")
        t, data = self.file.tensors[name], self.file.gguf.data(name)
        if self._host is not None:
            addr = _native.gpu_host_device_pointer(self._map_base) + (_native.host_address(data) - self._map_base)
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
        offset inside a staging buffer (the layer's layout, _stage_layout)."""
        t = self.file.tensors[name]
        if name in self._exp_names:
            if t.type != gpu.F32 and t.type not in gpu.GPU_TYPES:
                from ..core import _native
                raise UnavailableError(f"{name}: {_native.type_traits(t.type)['name']} has no GPU kernel, so it "
                                       "cannot be streamed (run it resident: it is dequantised at upload)")
            ptr, qtype = self._stage_offset[name], t.type
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
        from ..plan.planner import expert_tensors, resident_names, weight_layout
        self._exp_names = {n for i in range(hp.n_layer) for n in expert_tensors(self.file, i)} if self.stream else set()
        names = resident_names(self.file, self.stream)
        # every resident tensor in one allocation (planner.weight_layout: the footprint counts the same bytes)
        self._woff, total = weight_layout(self.file, names)
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
        self.layers = []
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            L = {"attn_norm": self._f32(p + "attn_norm.weight"), "post_norm": self._f32(p + "post_attention_norm.weight")}
            if hp.recurrent[i]:
                L.update(qkv=self._w(p + "attn_qkv.weight"), z=self._w(p + "attn_gate.weight"),
                         beta=self._w(p + "ssm_beta.weight"), alpha=self._w(p + "ssm_alpha.weight"),
                         conv=self._f32(p + "ssm_conv1d.weight"), dt=self._f32(p + "ssm_dt.bias"),
                         a=self._f32(p + "ssm_a"), ssm_norm=self._f32(p + "ssm_norm.weight"),
                         out=self._w(p + "ssm_out.weight"))
            else:
                if p + "attn_qkv.weight" in T:
                    q, kv = 2 * hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
                    L.update(q=self._w(p + "attn_qkv.weight", rows=(0, q)),
                             k=self._w(p + "attn_qkv.weight", rows=(q, q + kv)),
                             v=self._w(p + "attn_qkv.weight", rows=(q + kv, q + 2 * kv)))
                else:
                    L.update(q=self._w(p + "attn_q.weight"), k=self._w(p + "attn_k.weight"),
                             v=self._w(p + "attn_v.weight"))
                L.update(o=self._w(p + "attn_output.weight"), q_norm=self._f32(p + "attn_q_norm.weight"),
                         k_norm=self._f32(p + "attn_k_norm.weight"))
            if hp.n_expert:
                L["router"] = self._w(p + "ffn_gate_inp.weight")
                if p + "ffn_gate_up_exps.weight" in T:
                    ff = hp.n_ff_exp
                    L["gate_exps"] = self._w(p + "ffn_gate_up_exps.weight", expert_rows=(0, ff))
                    L["up_exps"] = self._w(p + "ffn_gate_up_exps.weight", expert_rows=(ff, 2 * ff))
                    L["exp_tensor"] = {"gate_exps": p + "ffn_gate_up_exps.weight", "up_exps": p + "ffn_gate_up_exps.weight"}
                else:
                    L["gate_exps"] = self._w(p + "ffn_gate_exps.weight")
                    L["up_exps"] = self._w(p + "ffn_up_exps.weight")
                    L["exp_tensor"] = {"gate_exps": p + "ffn_gate_exps.weight", "up_exps": p + "ffn_up_exps.weight"}
                L["down_exps"] = self._w(p + "ffn_down_exps.weight")
                L["exp_tensor"]["down_exps"] = p + "ffn_down_exps.weight"
                if hp.n_ff_shexp:
                    L.update(sh_gate_inp=self._w(p + "ffn_gate_inp_shexp.weight"),
                             sh_gate=self._w(p + "ffn_gate_shexp.weight"), sh_up=self._w(p + "ffn_up_shexp.weight"),
                             sh_down=self._w(p + "ffn_down_shexp.weight"))
            else:
                L.update(gate=self._w(p + "ffn_gate.weight"), up=self._w(p + "ffn_up.weight"),
                         down=self._w(p + "ffn_down.weight"))
            L["index"] = i
            self.layers.append(L)
        # the shared-expert gate is an [E] vector: one output row
        for L in self.layers:
            if "sh_gate_inp" in L:
                w = L["sh_gate_inp"]
                w.nrows, w.ncols = 1, self.hparams.n_embd

    # ------------------------------------------------------------------ streamed experts

    def _setup_streaming(self, progress) -> None:
        """Host addresses of every layer's expert tensors (the weight map, page-locked in place), the staging
        layout (tensor offsets inside one buffer), pinned experts uploaded."""
        from ..core import _native
        from ..plan.planner import expert_tensors
        hp, gg = self.hparams, self.file.gguf
        base = self._map_base = _native.host_address(gg._map)
        self._map_np = np.asarray(gg._map).view(np.uint8).reshape(-1)
        nbytes = int(gg._map.nbytes)
        try:
            _native.gpu_host_register(base, nbytes, read_only=not gg._map.flags.writeable)
            self._host = (base, nbytes)
            self.host_pinned_why = "page-locked in place"
        except Exception as e:     # said in describe() and by `run`; the copies then go through the driver's staging
            self.host_pinned_why = f"NOT page-locked ({e}); copies run from pageable memory, slower"
        self._stage_layout: dict[int, list] = {}     # layer -> [(host address, tensor bytes, expert bytes, offset,
        #                                               offset of the tensor's pinned experts in the pin store)]
        self._stage_offset: dict[str, int] = {}
        self._host_addr: dict[str, int] = {}          # expert tensor -> its host address in the weight map
        self._stage_names: dict[int, list] = {}       # layer -> its expert tensors, in _stage_layout's order
        self._pin_store: dict[int, gpu.Buffer] = {}  # layer -> pinned experts of every tensor, tensor-major
        self._pin_off: dict[str, int] = {}            # expert tensor -> offset of its pinned experts in the store
        self._pin_idx: dict[int, np.ndarray] = {}     # layer -> [n_expert] int32: index in the store or -1
        self._pin_lists: dict[int, tuple] = {}         # layer -> (device int32 [2, n]: ranks 0..n-1, expert ids; n),
        #                                               where its copy kernel's 16-byte words fit (else cuMemcpyDtoD)
        layer_max = 0
        for i in range(hp.n_layer):
            off, lay = 0, []
            for name in expert_tensors(self.file, i):
                t, data = self.file.tensors[name], gg.data(name)
                lay.append((_native.host_address(data), int(t.n_bytes), int(t.n_bytes) // hp.n_expert, off, 0))
                self._stage_offset[name] = off
                self._host_addr[name] = _native.host_address(data)
                off += int(t.n_bytes)
            if lay:
                self._stage_layout[i] = lay
                self._stage_names[i] = expert_tensors(self.file, i)
                layer_max = max(layer_max, off)
        self._build_pins()
        # the two staging slots in one allocation (planner.staging_pool_bytes), which holds the hybrid decode's
        # extras between prefills (planner.extras_regions: per layer its link/early slots, then its extras)
        half = align_up(max(layer_max, 256), ALLOC_GRANULE)
        self._pool = gpu.Buffer(2 * half, "expert staging (2 layers)")
        self._staging = [gpu.BufferView(self._pool, j * half, half, f"expert staging {j}") for j in range(2)]
        self._staged = [(-1, set()), (-1, set())]
        self._extras_at: dict = {}
        if self.decode_extras:
            from ..plan.planner import extras_regions
            if self._host is None:
                raise UnavailableError(f"decode_extras: the weight map is {self.host_pinned_why}; the extras are "
                                       "copied back after each prefill from page-locked memory only")
            self._extras_at = extras_regions(self.file, self.decode_extras, self.link_experts + self.early_experts)
            end = max(o + b for o, b in self._extras_at.values())
            if end > self._pool.nbytes:
                raise ValueError(f"decode_extras need {end} bytes of the {self._pool.nbytes}-byte expert staging "
                                 "(planner.choose_decode_extras fills it)")
        self._extras_state = "empty"     # "empty" (the staging holds a prefill's experts), "filling", "ready"
        self.extras_refills, self._extras_due = 0, 0.0
        self._repin_base: dict = {}      # route_counts when the pins were last chosen (maybe_repin's baseline)
        self.repins = 0
        self._copy = gpu.Stream()
        self._slot_free = [gpu.Event(), gpu.Event()]
        self._slot_ready = [gpu.Event(), gpu.Event()]
        self._slot_used = [False, False]
        self._d2d: list[list] = [[], []]     # per slot: pinned experts' (dst, src, bytes) not yet copied in
        self._pin_copy: list = [None, None]    # per slot: the layer whose pins the copy kernel puts there at the wait

    def _footprint(self, pins: dict):
        """planner.vram_footprint of this model with `pins`."""
        from ..plan import planner
        return planner.vram_footprint(self.file, stream_experts=self.stream, pinned=pins, n_ctx=self.n_ctx_plan,
                                      chunk=self.chunk, int8=self.int8 or self.int8_prefill, logit_rows=self.logit_rows,
                                      link_experts=self.link_experts, early_experts=self.early_experts)

    def _build_pins(self) -> None:
        """Every layer's pin store from self.pinned: its experts tensor-major, then the copy kernel's lists; the
        tensors' offsets there (_pin_off, the stage layout's last field), the expert -> index tables (_pin_idx)."""
        from ..core import _native
        hp, gg = self.hparams, self.file.gguf
        for i, lay in self._stage_layout.items():
            es = self.pinned.get(i, [])
            pin_off, new = 0, []
            for (host, tb, eb, off, _po), name in zip(lay, self._stage_names[i]):
                new.append((host, tb, eb, off, pin_off))
                self._pin_off[name] = pin_off
                pin_off += len(es) * eb
            self._stage_layout[i] = new
            self._pin_idx[i] = np.full(hp.n_expert, -1, dtype=np.int32)
            self._pin_idx[i][es] = np.arange(len(es), dtype=np.int32)
            if not es:
                continue
            # after the experts: their ranks in the store and their ids (int32 [2, n]), the copy kernel's lists
            # (the layout planner.pin_store_bytes counts)
            lists = np.concatenate([np.arange(len(es)), np.asarray(es)]).astype(np.int32).view(np.uint8)
            body = align_up(pin_off, 16)
            store = self._pin_store[i] = gpu.Buffer(body + lists.nbytes, f"pinned experts of layer {i}")
            for (host, _tb, eb, _off, po), name in zip(new, self._stage_names[i]):
                for j, n in consecutive_runs(es):
                    if self._host is not None:    # from the page-locked map, by DMA
                        _native.gpu_copy_htod_addr(store.ptr + po + j * eb, host + es[j] * eb, n * eb,
                                                   _native.ffi.NULL)
                    else:
                        _native.gpu_copy_htod(store.ptr + po + j * eb, gg.data(name)[es[j] * eb:(es[j] + n) * eb],
                                              n * eb)
            _native.gpu_copy_htod(store.ptr + body, lists, lists.nbytes)
            if all(eb % 16 == 0 and off % 16 == 0 and po % 16 == 0 for _h, _t, eb, off, po in new):
                self._pin_lists[i] = (store.ptr + body, len(es))
            self.vram_bytes += store.nbytes
        gpu.synchronize()

    def maybe_repin(self) -> bool:
        """Between requests: where the routing counted since the pins were chosen (route_counts, less what was
        counted before) would have the best pins for the same bytes take REPIN_DRIFT more of the routed work than
        the current ones (planner.pins_drift), re-choose and re-upload them (repin). -> whether it did."""
        if not self.stream or self.budget is None:
            return False
        self._hy_flush()
        hp = self.hparams
        base = self._repin_base
        recent = {i: np.maximum(c - base.get(i, 0), 0) for i, c in self.route_counts.items()}
        seen = sum(int(c.sum()) for c in recent.values())
        if seen < REPIN_MIN_ROUTES * hp.n_expert * max(len(self._stage_layout), 1):
            return False
        from ..plan.planner import pins_drift
        drift, best = pins_drift(self.file, self.pinned, recent)
        if drift < REPIN_DRIFT:
            return False
        from ..plan.planner import PlanningError
        try:
            self.repin(best, recent)
        except PlanningError:             # the new layout's granules do not fit: keep the pins there are
            return False
        return True

    def repin(self, pins: dict, counts: dict | None = None) -> None:
        """New pinned experts {layer: ids} (the same bytes or fewer: the footprint's pin part must still hold them),
        uploaded in place of the old ones; the decode extras re-chosen around them (counts), the hybrid tables
        updated, decode plans recorded again at their next step."""
        from ..core import _native
        from ..plan import planner
        pins = {int(i): sorted(set(int(e) for e in v)) for i, v in pins.items() if v}
        fp = self._footprint(pins)
        if self.budget is not None:
            planner.check_fits(fp, self.budget, "the new pins")
        gpu.synchronize()
        for b in self._pin_store.values():
            self.vram_bytes -= b.nbytes
            b.free()
        self._pin_store, self._pin_off, self._pin_idx, self._pin_lists = {}, {}, {}, {}
        self.pinned, self.footprint = pins, fp
        self._build_pins()
        self._staged = [(-1, set()), (-1, set())]
        self._d2d, self._pin_copy = [[], []], [None, None]
        if self.decode_extras:
            x = planner.choose_decode_extras(self.file, pins, counts, self.link_experts + self.early_experts)
            self.decode_extras = x
            self._extras_at = planner.extras_regions(self.file, x, self.link_experts + self.early_experts)
            if self._hy is not None and self._extras_state == "ready":
                _native.gpu_memset8(self._hy["extra_idx"].ptr, 0xFF, self._hy["extra_idx"].nbytes)
            self._extras_state = "empty"
        if self._hy is not None:
            self._hy["pin_idx"].upload(self._pin_table())
        self._repin_base = {i: c.copy() for i, c in self.route_counts.items()}
        self.repins += 1
        self._gen += 1                       # the decode plans name the old stores: recorded again

    def _stage(self, i: int, want, wait: bool = True) -> int:
        """Makes staging slot i % 2 hold experts `want` of layer i (host copies on the copy stream, after the
        compute that last read the slot); records the slot's ready event, and (wait) makes the default stream wait
        for it and copies the pinned experts in there on the default stream (on the copy stream they stalled its host
        copies behind the SMs' work): all of the layer's by the copy kernel (pin_copy_kernel, _copy_pins), else
        cuMemcpyDtoD runs of consecutive pins. -> the slot's device address."""
        from ..core import _native
        s = i % 2
        layer, have = self._staged[s]
        if layer != i:
            have = set()
        need = sorted(set(int(e) for e in want) - have)
        if need:
            t_issue, h2d0 = time.perf_counter(), self.stream_stats["h2d_bytes"]
            if self._slot_used[s]:
                self._copy.wait(self._slot_free[s])
            c0 = gpu.Event()
            c0.record(self._copy)
            dst0 = self._staging[s].ptr
            pins = {e: j for j, e in enumerate(self.pinned.get(i, []))}
            h = self._copy.handle
            for host, tbytes, eb, off, pin_off in self._stage_layout[i]:
                run: list[int] = []
                for e in need + [None]:
                    if e is not None and e not in pins and (not run or e == run[-1] + 1):
                        run.append(e)
                        continue
                    if run:                                   # one copy per run of consecutive host experts
                        nb = len(run) * eb
                        if self._host is not None:
                            _native.gpu_copy_htod_addr(dst0 + off + run[0] * eb, host + run[0] * eb, nb, h)
                        else:
                            at = host - self._map_base + run[0] * eb
                            _native.gpu_copy_htod(dst0 + off + run[0] * eb, self._map_np[at:at + nb], nb, h)
                        self.stream_stats["h2d_bytes"] += nb
                        run = []
                    if e is None:
                        break
                    if e in pins:
                        if self.pin_copy_kernel and i in self._pin_lists:   # all the layer's, by the kernel
                            self._pin_copy[s] = i
                            continue
                        dst, src = dst0 + off + e * eb, self._pin_store[i].ptr + pin_off + pins[e] * eb
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
            c1.record(self._copy)
            self._copy_marks.append((c0, c1, self.stream_stats["h2d_bytes"] - h2d0))
            if self.simulate_link:
                self._copy.synchronize()
                copied = self.stream_stats["h2d_bytes"] - h2d0
                rest = copied / (self.simulate_link * 1e9) - (time.perf_counter() - t_issue)
                if rest > 0:
                    time.sleep(rest)
        self._slot_ready[s].record(self._copy)
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

    def _copy_pins(self, i: int, dst0: int) -> None:
        """Every pinned expert of layer i from its pin store into its place in the staging at dst0, by the copy
        kernel on the default stream (cuMemcpyDtoD runs on a copy engine, queued with the link's copies: measured
        PIN_COPY_KERNEL's note)."""
        lists, n = self._pin_lists[i]
        tensors = [(self._pin_store[i].ptr + pin_off, dst0 + off, eb)
                   for _host, _tb, eb, off, pin_off in self._stage_layout[i]]
        for c0 in range(0, n, gpu.MOE_MAX_K):
            k = min(gpu.MOE_MAX_K, n - c0)
            self.k.hybrid_fetch(lists + 4 * c0, lists + 4 * (n + c0), k, tensors)
        self.stream_stats["d2d_bytes"] += n * sum(eb for _src, _dst, eb in tensors)

    def _ids_buf(self, ids: int, pairs: int) -> np.ndarray:
        """The router's expert ids of this pass, on the host (waits for the routing)."""
        from ..core import _native
        out = np.empty(pairs, dtype=np.int32)
        t0 = time.perf_counter()
        _native.gpu_copy_dtoh(out, ids, 4 * pairs)
        self.stream_stats["ids_wait_s"] += time.perf_counter() - t0
        return out

    def profile(self, on: bool = True) -> None:
        """Times the GPU's work per phase of passes with more than one token (events between phases; adds a
        little host work per layer): read with profile_report(). Decode plans are not profiled."""
        self._prof = {} if on else None
        self._prof_marks: list = []

    def _mark(self, phase: str) -> None:
        """Ends `phase` (the GPU work launched since the previous mark) when profiling."""
        if self._prof is None or self._tag == "d":
            return
        e = gpu.Event()
        e.record()
        self._prof_marks.append((phase, e))

    def profile_report(self) -> dict:
        """{phase: GPU seconds} summed since profile() (the first mark of each pass starts its clock)."""
        if self._prof is None:
            return {}
        marks, prev = self._prof_marks, None
        for phase, e in marks:
            if prev is not None and phase != "embed":
                self._prof[phase] = self._prof.get(phase, 0.0) + prev.elapsed_ms(e) / 1e3
            prev = e
        self._prof_marks = marks[-1:] if marks else []
        return dict(self._prof)

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

    def _next_moe(self, i: int) -> int:
        return i + 1 if i + 1 in self._stage_layout else self.hparams.n_layer

    def _release(self, i: int) -> None:
        """The compute that reads slot i % 2 has been issued: its end frees the slot for the copy stream."""
        s = i % 2
        self._slot_free[s].record(None)
        self._slot_used[s] = True

    def _handoff_buffer(self, nbytes: int):
        """A uint8 view of >= nbytes of page-locked host memory for GpuState's handoff (grown as needed, freed by
        close), or None above HANDOFF_PINNED_MAX (the caller copies through pageable memory then)."""
        if nbytes > HANDOFF_PINNED_MAX:
            return None
        if self._handoff is None or self._handoff.nbytes < nbytes:
            if self._handoff is not None:
                self._handoff.free()
            self._handoff = None
            self._handoff = gpu.PinnedBuffer(max(nbytes, 1 << 20))
        return self._handoff.array

    def _stages_all(self, n: int) -> bool:
        """Whether a pass of n tokens stages every expert of a layer (_prefetch_all's rule)."""
        from ..plan.planner import expected_distinct
        hp = self.hparams
        return expected_distinct(hp.n_expert, hp.n_expert_used, n) >= hp.n_expert / 2

    def _route_counts_dev(self, i: int) -> int:
        """Device address of layer i's int32 routing counts [n_expert] (moe_sort adds to them; _flush_counts moves
        them into route_counts when the pass is done)."""
        from ..core import _native
        hp = self.hparams
        if self._counts_dev is None:
            self._counts_dev = self._buf("route_counts", 4 * hp.n_layer * hp.n_expert)
            _native.gpu_memset8(self._counts_dev.ptr, 0, 4 * hp.n_layer * hp.n_expert)
        self._counts_layers.add(i)
        return self._counts_dev.ptr + 4 * i * hp.n_expert

    def _flush_counts(self) -> None:
        """The pass's device routing counts into route_counts (after the pass: the download waits for it)."""
        from ..core import _native
        if not self._counts_layers:
            return
        hp = self.hparams
        c = self._counts_dev.download(dtype=np.int32, count=hp.n_layer * hp.n_expert).reshape(hp.n_layer, hp.n_expert)
        for i in sorted(self._counts_layers):
            self.route_counts.setdefault(i, np.zeros(hp.n_expert, dtype=np.int64))[:] += c[i]
        _native.gpu_memset8(self._counts_dev.ptr, 0, 4 * hp.n_layer * hp.n_expert)
        self._counts_layers = set()

    def _prefetch_all(self, i: int, n: int) -> None:
        """Copies every expert of layer i ahead when n tokens will likely route to most of them (expected
        distinct experts >= half), so the copy overlaps the compute of the layer before."""
        hp = self.hparams
        if i >= hp.n_layer or i not in self._stage_layout:
            return
        if self._stages_all(n):
            self._stage(i, range(hp.n_expert), wait=False)

    # ------------------------------------------------------------------ scratch

    def _buf(self, name: str, nbytes: int) -> gpu.Buffer:
        """Scratch buffer `name` of the current set (self._tag) of >= nbytes: a pass of several tokens takes its
        blocks' buffers (planner.ARENA_NAMES) from the block arena (_arena_open), the others have one each."""
        if self._tag == "p" and name in ARENA_NAMES:
            return self._arena_buf(name, nbytes)
        key = f"{self._tag}:{name}"
        b = self._scratch.get(key)
        if b is None or b.nbytes < nbytes:
            if b is not None:
                # a decode buffer outgrown while a plan is being recorded is still named by the launches
                # recorded before: it stays allocated (small; decode sizes settle after the first step)
                (self._retired.append if self._tag == "d" else lambda b: b.free())(b)
            b = self._scratch[key] = gpu.Buffer(max(nbytes, 256), f"scratch {key}")
            if self._tag == "d":
                self._gen += 1
        return b

    def _arena_reserve(self, n: int) -> None:
        """The block arena for passes of n tokens (planner.arena_bytes: the largest block's buffers), grown before
        the pass launches anything (a pass never grows it: its blocks' buffers would move under queued work)."""
        need = arena_bytes(self.hparams, n, self.int8 or self.int8_prefill)     # as the footprint counts it
        if self._arena is None or self._arena.nbytes < need:
            if self._arena is not None:
                gpu.synchronize()           # the last pass's blocks are done with it
                self._arena.free()
                self._arena = None
            self._arena = gpu.Buffer(max(need, 256), "scratch p:block arena")
        self._arena_block, self._arena_at = None, 0

    def _arena_open(self, block: str) -> None:
        """A pass's block (planner.block_scratch) starts: its buffers take the arena from its start (the last
        block's are dead: it wrote y, which lives outside)."""
        if self._tag == "p":
            self._arena_block, self._arena_at = block, 0

    def _arena_buf(self, name: str, nbytes: int) -> gpu.BufferView:
        block = ARENA_NAMES[name]
        if self._arena is None or block != self._arena_block:
            raise RuntimeError(f"scratch {name!r} of the {block} block asked for inside block {self._arena_block!r}"
                               " (gpu_model: _arena_open at the block's start)")
        at = self._arena_at
        if at + nbytes > self._arena.nbytes:
            raise RuntimeError(f"the {block} block's scratch outgrew its arena at {name!r} ({at + nbytes} > "
                               f"{self._arena.nbytes} bytes): planner.block_scratch misses a buffer")
        self._arena_at = at + align_up(nbytes, ARENA_ALIGN)
        return gpu.BufferView(self._arena, at, nbytes, f"scratch p:{name}")

    def _rope_cs(self, n_ctx: int) -> gpu.Buffer:
        if self._rope is None or self._rope_n < n_ctx:
            if self._rope is not None:
                self._rope.free()
            self._rope = gpu.Buffer.from_array(rope_table(self.hparams, n_ctx), "rope table")
            self._rope_n = n_ctx
            self._gen += 1
        return self._rope

    # ------------------------------------------------------------------ ops

    def _mm(self, w: _W, x: int, y: int, n: int, xq: int | None = None) -> None:
        """y[n, w.nrows] = x[n, w.ncols] W^T. xq: x already quantised to Q8_1 (n rows; from add_rmsnorm, _hq)."""
        k = self.k
        if n > 1 and self.int8_prefill and w.qtype != gpu.F32:
            if xq is None:
                xq = self._q8_1(x, n * w.ncols, "xq_mm")
            (k.gemm_mma if self.mma else k.gemm_dp4a)(w.qtype, w.ptr, xq, y, w.nrows, w.ncols, n)
        elif n > 1:
            k.gemm_f32(w.qtype, w.ptr, x, y, w.nrows, w.ncols, n)
        elif self.int8 and w.qtype != gpu.F32:
            if xq is None:
                xq = self._q8_1(x, w.ncols, "xq")
            k.gemv_dp4a(w.qtype, w.ptr, xq, y, w.nrows, w.ncols)
        else:
            k.gemv_f32(w.qtype, w.ptr, x, y, w.nrows, w.ncols)

    def _mm2(self, w1: _W, w2: _W, x: int, y1: int, y2: int, n: int, xq: int | None = None) -> None:
        """_mm of two matrices on the same input; one token and the same type and width: one launch (the GEMV's
        second matrix, grid.z = 2), else two."""
        if n != 1 or (w1.qtype, w1.ncols) != (w2.qtype, w2.ncols):
            self._mm(w1, x, y1, n, xq)
            self._mm(w2, x, y2, n, xq)
            return
        k = self.k
        if self._int8_for(w1, 1):
            if xq is None:
                xq = self._q8_1(x, w1.ncols, "xq")
            k.gemv_dp4a(w1.qtype, w1.ptr, xq, y1, w1.nrows, w1.ncols, W2=w2.ptr, y2=y2, nrows2=w2.nrows)
        else:
            k.gemv_f32(w1.qtype, w1.ptr, x, y1, w1.nrows, w1.ncols, W2=w2.ptr, y2=y2, nrows2=w2.nrows)

    def _int8_for(self, w: _W, n: int) -> bool:
        """Whether _mm runs w on int8 activations (Q8_1) for a pass of n tokens."""
        return w.qtype != gpu.F32 and (self.int8_prefill if n > 1 else self.int8)

    def _hq(self, n: int) -> int | None:
        """The buffer add_rmsnorm writes the normed h [n, E] into as Q8_1, for the int8 GEMVs (one token) or GEMMs
        (several, int8_prefill) that read h; None on the f32 paths. A name of its own: _mm's "xq" (the other
        inputs' Q8_1) must not overwrite it while a block still reads h (the hybrid's pinned experts after the
        shared expert's down)."""
        if not (self.int8_prefill if n > 1 else self.int8):
            return None
        return self._buf("hq", n * self.hparams.n_embd // 32 * gpu.Q8_1_BYTES).ptr

    def _q8_1(self, x: int, n_el: int, name: str) -> int:
        """x[n_el] f32 (rows of a multiple of 32) quantised to Q8_1 in scratch buffer `name` -> its address."""
        xq = self._buf(name, n_el // 32 * gpu.Q8_1_BYTES).ptr
        self.k.quantize_q8_1(x, xq, n_el)
        return xq

    def _gdn(self, L: dict, h: int, hq, n: int, st: "GpuState", si: int, y: int) -> None:
        hp, k = self.hparams, self.k
        self._arena_open("gdn")
        E, Hk, Hv, dk = hp.n_embd, hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state
        dv = hp.ssm_d_inner // Hv
        conv_dim = 2 * Hk * dk + hp.ssm_d_inner
        qkv = self._buf("qkv", 4 * n * conv_dim).ptr
        u = self._buf("u", 4 * n * conv_dim).ptr
        z = self._buf("z", 4 * n * hp.ssm_d_inner).ptr
        o = self._buf("o", 4 * n * hp.ssm_d_inner).ptr
        beta = self._buf("beta", 4 * n * Hv).ptr
        g = self._buf("g", 4 * n * Hv).ptr
        self._mm2(L["qkv"], L["z"], h, qkv, z, n, hq)
        self._mm2(L["beta"], L["alpha"], h, beta, g, n, hq)
        k.conv1d_silu(qkv, L["conv"], st.conv_ptr(si), u, n, conv_dim, hp.ssm_conv_kernel)
        k.gdn_l2norm_qk(u, n, conv_dim, Hk, dk)
        if n > 1:          # a long recurrence: the gates in a launch of their own (on its serial path they cost more)
            k.gdn_gates(beta, g, L["dt"], L["a"], n, Hv)
        k.gdn_recurrent(u, g, beta, st.ssm_ptr(si), o, n, Hk, Hv, dk, dv, tiled=not self._faults.get("gdn_grouped"),
                        dt_bias=L["dt"] if n == 1 else None, ssm_a=L["a"] if n == 1 else None)
        # a decode step's norm also writes o's Q8_1 where the out projection runs int8 (no quantize launch of its
        # own; in a 2048-token pass the fused form took 5 ms more than quantize_q8_1's launch, H200)
        oq = self._buf("oq", hp.ssm_d_inner // 32 * gpu.Q8_1_BYTES).ptr if n == 1 and self._int8_for(L["out"], n) \
            else None
        k.gdn_gated_rmsnorm(o, z, L["ssm_norm"], o, n * Hv, dv, hp.rms_eps, yq=oq)
        self._mm(L["out"], o, y, n, oq)

    def _attention_planned(self, L: dict, h: int, hq, st: "GpuState", si: int, y: int) -> None:
        """One token whose position is the device int st.io[1]: every argument independent of the position."""
        hp, k = self.hparams, self.k
        E, hd, nh, nkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
        qw, kvw = nh * 2 * hd, nkv * hd
        qg = self._buf("qg", 4 * qw).ptr
        o = self._buf("ao", 4 * nh * hd).ptr
        kb, vb = self._buf("kb", 4 * kvw).ptr, self._buf("vb", 4 * kvw).ptr
        kc, vc, pos_dev = st.k_ptr(si), st.v_ptr(si), st.io.ptr + 4
        self._mm(L["q"], h, qg, 1, hq)
        self._mm2(L["k"], L["v"], h, kb, vb, 1, hq)
        cs = self._rope_cs(st.n_ctx).ptr
        k.qk_norm_rope(qg, L["q_norm"], cs, 1, nh, 2 * hd, qw, hd, hp.n_rot, hp.rms_eps, pos_dev=pos_dev)
        k.qk_norm_rope(kb, L["k_norm"], cs, 1, nkv, hd, kvw, hd, hp.n_rot, hp.rms_eps, pos_dev=pos_dev)
        k.kv_store(kb, vb, kc, vc, pos_dev, kvw)
        n_split = k.attn_splits(st.n_ctx)[0]
        part = self._buf("attn_part", k.attn_partials_bytes(nh, hd, gpu.ATTN_MAX_SPLIT)).ptr
        k.attention_decode(qg, kc, vc, o, part, st.n_ctx, nh, nkv, hd, n_split=n_split, pos_dev=pos_dev)
        self._mm(L["o"], o, y, 1)

    def _attention(self, L: dict, h: int, hq, n: int, st: "GpuState", si: int, y: int) -> None:
        hp, k = self.hparams, self.k
        self._arena_open("attention")
        E, hd, nh, nkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
        qw, kvw, pos = nh * 2 * hd, nkv * hd, st.pos
        qg = self._buf("qg", 4 * n * qw).ptr
        o = self._buf("ao", 4 * n * nh * hd).ptr
        kc, vc = st.k_ptr(si), st.v_ptr(si)
        kn, vn = kc + 4 * pos * kvw, vc + 4 * pos * kvw   # this batch's cache rows
        self._mm(L["q"], h, qg, n, hq)
        self._mm(L["k"], h, kn, n, hq)
        self._mm(L["v"], h, vn, n, hq)
        cs = self._rope_cs(st.n_ctx).ptr + 4 * pos * hp.n_rot   # rows pos.. of [n_ctx, n_rot/2, 2]
        k.qk_norm_rope(qg, L["q_norm"], cs, n, nh, 2 * hd, qw, hd, hp.n_rot, hp.rms_eps)
        k.qk_norm_rope(kn, L["k_norm"], cs, n, nkv, hd, kvw, hd, hp.n_rot, hp.rms_eps)
        if n == 1:
            n_split, _ = k.attn_splits(pos + 1)
            part = self._buf("attn_part", k.attn_partials_bytes(nh, hd, n_split)).ptr
            k.attention_decode(qg, kc, vc, o, part, pos + 1, nh, nkv, hd, n_split=n_split)
        else:
            k.attention_prefill(qg, kc, vc, o, n, pos, nh, nkv, hd)
        self._mm(L["o"], o, y, n)

    def _ffn(self, L: dict, h: int, hq, n: int, y: int) -> None:
        hp, k = self.hparams, self.k
        E = hp.n_embd
        if not hp.n_expert:
            ff = hp.n_ff
            self._arena_open("ffn")
            g = self._buf("ffg", 4 * n * ff).ptr
            u = self._buf("ffu", 4 * n * ff).ptr
            self._mm2(L["gate"], L["up"], h, g, u, n, hq)
            k.swiglu(g, u, g, n * ff)
            self._mm(L["down"], g, y, n)
            return
        if n == 1 and self.cpu_experts:
            return self._ffn_hybrid(L, h, hq, y)
        ne, kk, ff = hp.n_expert, hp.n_expert_used, hp.n_ff_exp
        pairs = n * kk
        self._arena_open("moe")
        logits = self._buf("router", 4 * n * ne).ptr
        ids = self._buf("ids", 4 * pairs).ptr
        wts = self._buf("wts", 4 * pairs).ptr
        g = self._buf("eg", 4 * pairs * ff).ptr
        u = self._buf("eu", 4 * pairs * ff).ptr
        sort = n > 1 and self.sort_pairs
        yd = None if sort else self._buf("ed", 4 * pairs * E).ptr     # sorted: the outputs stay in xg (pinv)
        self._mm(L["router"], h, logits, n, hq)
        k.moe_route(logits, ids, wts, n, ne, kk)
        base = 0
        # the grouped GEMMs' work list made on the GPU (moe_sort): no host wait, where the host needs no ids
        # (resident experts, or all of the layer staged because the pass routes to most of them)
        dev_sort = sort and self.grouped and ne <= gpu.MOE_SORT_MAX_E and (not self.stream or self._stages_all(n))
        if (self.stream or sort) and not dev_sort:
            self._mark("ffn rest")
            used = self._ids_buf(ids, pairs)
            c = self.route_counts.setdefault(L["index"], np.zeros(ne, dtype=np.int64))
            c += np.bincount(used, minlength=ne)[:ne]
        if self.stream:
            i = L["index"]
            base = self._stage(i, range(ne) if dev_sort else np.unique(used))
            self._mark("waiting for expert copies")
            self._prefetch_all(self._next_moe(i), n)      # the next layer's copy overlaps this layer's experts
        x_tok, xg, eids, x_group = h, h, ids, kk
        if dev_sort:
            n_tiles = gpu.Kernels.sort_tiles_max(pairs, ne, self._group_tile(L))
            mb = self._buf("pair_meta", 4 * (3 * pairs + 3 * n_tiles))
            eids, ptok, pinv, ptiles = mb.ptr, mb.ptr + 4 * pairs, mb.ptr + 8 * pairs, mb.ptr + 12 * pairs
            k.moe_sort(ids, pairs, kk, ne, eids, ptok, pinv, ptiles, n_tiles, self._route_counts_dev(L["index"]),
                       tile=self._group_tile(L))
        elif sort:
            # pairs in expert order: the GEMV blocks of one expert run together and share its weights in L2.
            # x rows gathered per pair; moe_combine reads the outputs in that order (pinv)
            order = np.argsort(used, kind="stable").astype(np.int32)
            inv = np.empty_like(order)
            inv[order] = np.arange(pairs, dtype=np.int32)
            tiles = (gpu.Kernels.expert_tiles(used[order], self._group_tile(L)) if self.grouped
                     else np.zeros((0, 3), np.int32))
            meta = np.concatenate([used[order], order // kk, inv, tiles.reshape(-1)]).astype(np.int32)
            mb = self._buf("pair_meta", 4 * (3 * pairs + 3 * len(tiles)))
            mb.upload(meta)
            eids, ptok, pinv, ptiles = mb.ptr, mb.ptr + 4 * pairs, mb.ptr + 8 * pairs, mb.ptr + 12 * pairs
            n_tiles = len(tiles)
        if sort:       # x rows gathered per sorted pair (Q8_1 from hq where the grouped int8 GEMMs read them)
            xg = self._buf("xg", 4 * pairs * E).ptr
            xq = self._gather_hq(L, hq, ptok, pairs)
            if xq is None:
                k.get_rows(gpu.F32, h, ptok, xg, pairs, E)
            x_tok, x_group = xg, 1
        if sort and self.grouped:
            self._grouped_experts(L, base, xg, g, u, pairs, ptiles, n_tiles, xq)   # output in xg (sorted)
        else:
            addr = {w: base + L[w].ptr for w in ("gate_exps", "up_exps", "down_exps")}
            self._pair_gemvs(L, addr, x_tok, hq if not sort else None, g, u, xg if sort else yd, eids, pairs,
                             x_group)
        self._mark("routed experts")
        if self.stream:
            self._release(i)
            self.stream_stats["layers"] += 1
        if sort:       # the outputs in expert order: the combine reads pair (t, s) from row pinv[t*k + s] of xg
            self._shared_and_combine(L, h, hq, n, xg, wts, y, rows=pinv)
        else:
            self._shared_and_combine(L, h, hq, n, yd, wts, y)

    # ------------------------------------------------------------------ hybrid decode

    def _ffn_hybrid(self, L: dict, h: int, hq, y: int) -> None:
        """One token's MoE block split between the GPU and the CPU (cpu_experts), exchanged through the channel
        (HybridLayout, page-locked host memory both sides read and write): hybrid_publish puts h and the routing in
        layer i's slot and makes hy_meta [kk gids (index in the pin store, -1: not pinned) | kk lids (the experts
        fetched over the link, link_experts of them) | kk lslots (their place in hy_link) | 2kk + 1 weights]; the GPU
        fetches the link experts (hybrid_fetch), runs the shared, pinned (rows 1..kk of hy_rows [2kk + 1, E]) and
        link experts (rows kk+1..2kk) while the CPU runs the others (le_hybrid_serve); hybrid_wait brings the CPU's
        weighted sum into row 0 (weight 1); one moe_combine adds them and the shared expert. No host step: a token
        is one launch sequence."""
        hp, k = self.hparams, self.k
        E, kk, ne, ff = hp.n_embd, hp.n_expert_used, hp.n_expert, hp.n_ff_exp
        i = L["index"]
        pinned = bool(self.pinned.get(i))
        hy = self._hy_channel()
        chan, slot = hy["ptr"], hy["ptr"] + 4 * hy["layout"].slot_offset(i)
        link, n_early = self.link_experts, self.early_experts
        meta = self._buf("hy_meta", 4 * (7 * kk + 1)).ptr
        fresh = f"{self._tag}:hy_rows" not in self._scratch
        rows = self._buf("hy_rows", 4 * (2 * kk + 1) * E).ptr
        if fresh:      # rows a layer does not compute (no pins here, no link experts) stay zero, at weight 0
            from ..core import _native
            _native.gpu_memset8(rows, 0, 4 * (2 * kk + 1) * E)
        ids = self._buf("hy_ids", 4 * kk).ptr
        wts = self._buf("hy_wts", 4 * kk).ptr
        logits = self._buf("router", 4 * ne).ptr
        self._mm(L["router"], h, logits, 1, hq)
        k.moe_route(logits, ids, wts, 1, ne, kk)
        la = hy["lookahead"]
        parity = int(np.searchsorted(hy["layers"], i)) % 2        # the early buffer's half this layer uses
        extra = i in self.decode_extras
        k.hybrid_publish(h, ids, wts, hy["pin_idx"].ptr + 4 * i * ne if pinned else None, link, meta, slot, chan,
                         E, kk, pred=la["pred"] + 4 * gpu.HY_PRED_MAX * i if la and i in la["from"].values() else None,
                         n_early=n_early, extra_idx=hy["extra_idx"].ptr + 4 * i * ne if extra else None)
        if la and i in la["from"]:    # the next MoE layer's experts predicted from this h (the CPU prefetches them)
            j = la["from"][i]
            k.hybrid_predict(self.layers[j]["router"].ptr, h, la["scales"] + 4 * E * i, la["logits"], ne, E)
            k.hybrid_predict_publish(la["logits"], ne, min(LOOKAHEAD_PRED, ne), hy["pin_idx"].ptr + 4 * j * ne
                                     if self.pinned.get(j) else None, la["pred"] + 4 * gpu.HY_PRED_MAX * j,
                                     chan + 4 * hy["layout"].slot_offset(j), chan, E, kk)
        names = L["exp_tensor"]
        staged, tensors = self._hy_staging(i)
        if link:           # the link experts' weights into VRAM first (a copy kernel: the link's full rate)
            k.hybrid_fetch(meta + 12 * kk, meta + 8 * kk, kk, tensors)
        if n_early:        # the early experts the layer routes to: from the CPU's early buffer into staging slots
            ea = self._hy_early_regions()
            k.hybrid_fetch(meta + 16 * kk, meta + 8 * kk, kk,
                           [(ea[parity][name], staged[name], eb) for (_src, _dst, eb), name
                            in zip(tensors, self._stage_names[i])])
        # queued before the wait, so the GPU computes these while the CPU runs its experts
        sh, shg = self._shared_expert(L, h, hq, 1)
        g = self._buf("eg", 4 * kk * ff).ptr
        u = self._buf("eu", 4 * kk * ff).ptr
        if pinned:         # rows 1..kk: the pinned experts (gids: index in the pin store)
            store = self._pin_store[i].ptr
            addr = {w: store + self._pin_off[names[w]] + L[w].ptr - self._stage_offset[names[w]]
                    for w in ("gate_exps", "up_exps", "down_exps")}
            self._pair_gemvs(L, addr, h, hq, g, u, rows + 4 * E, meta, kk, kk)
        if link or n_early or extra:  # rows kk+1..2kk: early, fetched and extra experts (lslots: their staging slot)
            addr = {w: staged[names[w]] + L[w].ptr - self._stage_offset[names[w]]
                    for w in ("gate_exps", "up_exps", "down_exps")}
            self._pair_gemvs(L, addr, h, hq, g, u, rows + 4 * (1 + kk) * E, meta + 8 * kk, kk, kk)
        k.hybrid_wait(slot, chan, rows, E, kk, HYBRID_WAIT_CYCLES)
        n_rows = 1 + kk * (2 if link or n_early or extra else 1 if pinned else 0)
        k.moe_combine(rows, meta + 20 * kk, sh, shg, y, 1, n_rows, E)
        if self.graphs:
            self._hy_serve([i])     # the recording pass (a replay is one graph launch, then every layer is served)
        else:
            gpu.host_step(functools.partial(self._hy_serve, [i]))   # replayed after this layer's launches

    def _hy_channel(self) -> dict:
        """The hybrid decode's channel (page-locked, device-visible through unified addressing), its layout, the
        device table of pin indices [n_layer, n_expert] (-1: not pinned), the MoE layers in order."""
        if self._hy is None:
            from ..core import _native
            hp = self.hparams
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
            arr[HybridLayout.N_LINK] = self.link_experts     # the CPU's lookahead skips the link's share
            arr[HybridLayout.N_EARLY] = self.early_experts
            host_dev = {}
            if self.link_experts or self.early_experts or self.decode_extras:
                if self._host is None:
                    raise UnavailableError(f"link/early experts: the weight map is {self.host_pinned_why}; the GPU "
                                           "can fetch experts only from page-locked memory")
                dev0 = _native.gpu_host_device_pointer(self._map_base)
                host_dev = {n: dev0 + (a - self._map_base) for n, a in self._host_addr.items()}
            moe = [L["index"] for L in self.layers if "router" in L]
            self._hy = {"buf": pb, "arr": arr, "ptr": int(_native.ffi.cast("uintptr_t", pb.ptr)), "layout": lay,
                        "host_dev": host_dev,
                        "pin_idx": gpu.Buffer.from_array(self._pin_table(), "hybrid pin indices"), "seq": 0,
                        # the decode extras' places [n_layer, n_expert] (-1: none, or not in the staging now)
                        "extra_idx": gpu.Buffer.from_array(np.full((hp.n_layer, hp.n_expert), -1, np.int32),
                                                           "hybrid decode extras' places"),
                        "layers": np.array(moe, dtype=np.int32), "lookahead": self._lookahead_buffers(moe),
                        "counts": np.zeros((hp.n_layer, hp.n_expert), dtype=np.int64),
                        "stats": np.zeros(_native.lib.LE_HY_STATS)}
        return self._hy

    def _hy_staging(self, i: int) -> tuple[dict, list]:
        """Layer i's staging in VRAM of the experts the GPU runs from the link: per expert tensor a region of
        link_experts + early_experts experts (the fetched ones, then the early ones) ->
        ({tensor name: region address}, [(host device address, region, expert bytes)] for hybrid_fetch)."""
        slots = self.early_experts + self.link_experts
        hy = self._hy
        if self.decode_extras:     # the layer's region of the staging pool: its slots, then its extras
            if i not in self._extras_at:
                return {}, []
            lbuf, per = self._pool.ptr + self._extras_at[i][0], slots + len(self.decode_extras.get(i, ()))
        elif slots:
            lbuf, per = self._buf("hy_link", slots * max(self.footprint.expert_bytes.values())).ptr, slots
        else:
            return {}, []
        at, tensors, staged = 0, [], {}
        for name, (_host, _tb, eb, _off, _po) in zip(self._stage_names[i], self._stage_layout[i]):
            tensors.append((hy["host_dev"][name], lbuf + at, eb))
            staged[name] = lbuf + at
            at += per * eb
        return staged, tensors

    def _hy_early_regions(self) -> list:
        """The CPU's early buffer: per parity (MoE layer ordinal % 2) and expert tensor a region of early_experts
        slots of the largest expert of any expert tensor -> [{tensor name: region address} per parity]; a layer's
        copies never land where the layer before may still be reading (the other parity), whatever their sizes."""
        hy = self._hy
        if "early_regions" not in hy:
            n, slot = self.early_experts, self._early_slot_bytes()
            tag, self._tag = self._tag, "d"
            try:
                base = self._buf("hy_early", 6 * n * slot).ptr
            finally:
                self._tag = tag
            regions = [{}, {}]
            for p in (0, 1):
                for L in self.layers:
                    if "router" not in L:
                        continue
                    for t, w in enumerate(("gate_exps", "up_exps", "down_exps")):
                        regions[p][L["exp_tensor"][w]] = base + ((3 * p + t) * n) * slot
            hy["early_regions"], hy["early_stride"] = regions, 3 * n * slot
        return hy["early_regions"]

    def _early_slot_bytes(self) -> int:
        """The largest expert of any expert tensor (a slot of the early buffer)."""
        return max(L[w].expert_bytes for L in self.layers if "router" in L
                   for w in ("gate_exps", "up_exps", "down_exps"))

    def _hy_early(self) -> dict | None:
        """le_hybrid_serve's early config: the copy stream and, per layer and gate/up/down, the staging address of
        early slot 0 and an expert's bytes (None: no early experts)."""
        hy = self._hy
        if not self.early_experts:
            return None
        if "early" not in hy:
            hp = self.hparams
            dst = np.zeros((hp.n_layer, 3), dtype=np.uint64)
            eb = np.zeros((hp.n_layer, 3), dtype=np.int64)
            regions = self._hy_early_regions()
            for i in hy["layers"]:
                L = self.layers[int(i)]
                for t, w in enumerate(("gate_exps", "up_exps", "down_exps")):
                    name = L["exp_tensor"][w]
                    if L[w].ptr != self._stage_offset[name]:
                        raise UnavailableError(f"early_experts: layer {i}'s {w} is part of a fused tensor")
                    dst[i, t] = regions[0][name]
                    eb[i, t] = L[w].expert_bytes
            hy["early"] = {"n_early": self.early_experts, "stream": gpu.Stream(ordered=False), "dst": dst, "eb": eb}
        e = hy["early"]
        return {"n_early": e["n_early"], "stream": e["stream"].handle, "dst": e["dst"], "eb": e["eb"],
                "parity_stride": hy["early_stride"]}

    def _lookahead_buffers(self, moe: list) -> dict | None:
        """The lookahead's device data in one buffer: scales [n_layer, E] (row i: the next MoE layer's post-attention
        norm / layer i's, so h_i * scales_i is h_i normed as that layer would), pred [n_layer, HY_PRED_MAX] int32
        (each layer's predicted experts) and logits [n_expert]; `from` {i: the MoE layer after i}. None: off."""
        if not (self.lookahead or self.early_experts) or len(moe) < 2:
            return None
        hp, f = self.hparams, self.file.gguf
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

    def _extras_step(self) -> None:
        """Before a hybrid decode step: after a prefill, copy the decode extras back into the staging on the copy
        stream (after the prefill's last reads of its slots; the host issues runs of consecutive experts); once the
        copy stream is done, their places into the device table hybrid_publish reads (from then on the GPU runs
        them)."""
        from ..core import _native
        hy = self._hy_channel()
        if self._extras_state == "empty":
            for s_ in range(2):
                if self._slot_used[s_]:
                    self._copy.wait(self._slot_free[s_])
            self._staged = [(-1, set()), (-1, set())]
            slots, h = self.link_experts + self.early_experts, self._copy.handle
            for i, es in self.decode_extras.items():
                base, per = self._pool.ptr + self._extras_at[i][0], slots + len(es)
                for host, _tb, eb, _off, _po in self._stage_layout[i]:
                    for j, n in consecutive_runs(es):
                        _native.gpu_copy_htod_addr(base + (slots + j) * eb, host + es[j] * eb, n * eb, h)
                    base += per * eb
            self._extras_state = "filling"
            self.extras_refills += 1
            # a simulated link: done no sooner than its rate allows (the copy stays asynchronous, as on that link)
            nb = sum(len(es) * sum(eb for _h, _t, eb, _o, _p in self._stage_layout[i])
                     for i, es in self.decode_extras.items())
            self._extras_due = time.perf_counter() + (nb / (self.simulate_link * 1e9) if self.simulate_link else 0)
        elif (self._extras_state == "filling" and self._copy.query()
              and time.perf_counter() >= self._extras_due):
            hy["extra_idx"].upload(self._extras_table())
            self._extras_state = "ready"

    def _pin_table(self) -> np.ndarray:
        """int32 [n_layer, n_expert]: each pinned expert's index in its layer's pin store, -1 elsewhere (the hybrid
        decode's device table)."""
        t = np.full((self.hparams.n_layer, self.hparams.n_expert), -1, dtype=np.int32)
        for i, idx in self._pin_idx.items():
            t[i] = idx
        return t

    def _extras_table(self) -> np.ndarray:
        """int32 [n_layer, n_expert]: each decode extra's place among its layer's extras, -1 elsewhere."""
        hp = self.hparams
        t = np.full((hp.n_layer, hp.n_expert), -1, dtype=np.int32)
        for i, es in self.decode_extras.items():
            t[i, es] = np.arange(len(es), dtype=np.int32)
        return t

    def _extras_invalidate(self) -> None:
        """A pass of several tokens is about to overwrite the staging: the decode extras off (their table -1, on
        the default stream before the pass's work) until _extras_step has copied them back."""
        if self._extras_state != "empty":
            if self._extras_state == "ready":
                from ..core import _native
                _native.gpu_memset8(self._hy["extra_idx"].ptr, 0xFF, self._hy["extra_idx"].nbytes)
            self._extras_state = "empty"

    def _hy_next(self) -> None:
        """A new token's sequence number into the channel (before its launches)."""
        hy = self._hy_channel()
        _HY_SEQ[0] = hy["seq"] = _HY_SEQ[0] % 0x7FFFFFFF + 1
        hy["arr"][HybridLayout.SEQ] = hy["seq"]

    def _hy_serve(self, layers) -> None:
        """The CPU's experts of `layers` for the current token (le_hybrid_serve: waits for each layer's routing)."""
        hy = self._hy
        pf = 0
        if self.lookahead and not self.early_experts:
            pf = LOOKAHEAD_PREFETCH_EXPERTS * max(self.footprint.expert_bytes.values())
        self.model.native.hybrid_serve(hy["buf"].ptr, hy["seq"], layers, counts=hy["counts"],
                                       timeout_s=HYBRID_TIMEOUT_S, stats=hy["stats"], prefetch_bytes=pf,
                                       early=self._hy_early())

    def _hy_flush(self) -> None:
        """The channel's counts and timings into route_counts and hybrid_stats."""
        hy = self._hy
        if hy is None:
            return
        from ..core import _native
        c, st = hy["counts"], hy["stats"]
        for i in np.flatnonzero(c.any(axis=1)):
            self.route_counts.setdefault(int(i), np.zeros(self.hparams.n_expert, dtype=np.int64))[:] += c[i]
        hs = self._hybrid_stats
        for key, stat in _HY_STATS.items():
            v = st[getattr(_native.lib, "LE_HY_STAT_" + stat)]
            hs[key] += v if isinstance(hs[key], float) else int(v)
        c[:] = 0
        st[:] = 0

    def _pair_gemvs(self, L: dict, addr: dict, x_rows: int, xq, g: int, u: int, out: int, eids: int, pairs: int,
                    x_group: int) -> None:
        """Routed experts as one GEMV per (token, expert) pair: pair p reads row p // x_group of x_rows [*, E]
        (xq: those rows already in Q8_1, the one-token decode case), writes out [pairs, E]; g, u [pairs, ff].
        addr: {gate_exps, up_exps, down_exps: device address of expert 0 of that matrix} (eids index from there;
        < 0: the pair is skipped, its row zero)."""
        hp, k = self.hparams, self.k
        E, ff = hp.n_embd, hp.n_ff_exp
        int8 = self.int8 and L["gate_exps"].qtype != gpu.F32
        x, xs = x_rows, E
        if int8:
            x, xs = xq, E // 32
            if x is None:         # several rows: quantise each (tokens, or gathered pairs)
                x = self._q8_1(x_rows, pairs // x_group * E, "xq_tok")
        wg, wu = L["gate_exps"], L["up_exps"]
        if (wg.qtype, wg.nrows, wg.ncols, wg.expert_bytes) == (wu.qtype, wu.nrows, wu.ncols, wu.expert_bytes):
            k.gemv_ids(wg.qtype, addr["gate_exps"], x, g, wg.nrows, wg.ncols, eids, pairs, wg.expert_bytes, x_group,
                       xs, int8=int8, W2=addr["up_exps"], y2=u)       # gate and up in one launch
        else:
            for w, a, o in ((wg, addr["gate_exps"], g), (wu, addr["up_exps"], u)):
                k.gemv_ids(w.qtype, a, x, o, w.nrows, w.ncols, eids, pairs, w.expert_bytes, x_group, xs, int8=int8)
        k.swiglu(g, u, g, pairs * ff)
        w = L["down_exps"]
        int8d = self.int8 and w.qtype != gpu.F32
        xd, xds = g, ff
        if int8d:
            xd, xds = self._q8_1(g, pairs * ff, "xq_down"), ff // 32
        k.gemv_ids(w.qtype, addr["down_exps"], xd, out, w.nrows, w.ncols, eids, pairs, w.expert_bytes, 1, xds,
                   int8=int8d)

    def _shared_and_combine(self, L: dict, h: int, hq, n: int, yd: int, wts: int, y: int, rows=None) -> None:
        """y[n, E] = the routed experts' outputs yd [n*k, E] (pair (t, s) in row t*k + s, or rows[t*k + s])
        weighted by wts, plus the gated shared expert."""
        sh, shg = self._shared_expert(L, h, hq, n)
        self.k.moe_combine(yd, wts, sh, shg, y, n, self.hparams.n_expert_used, self.hparams.n_embd, rows=rows)

    def _shared_expert(self, L: dict, h: int, hq, n: int) -> tuple:
        """The shared expert's output sh [n, E] and gate logit shg [n] (device addresses), or (None, None)."""
        hp, k = self.hparams, self.k
        E = hp.n_embd
        sh = shg = None
        if hp.n_ff_shexp:
            fs = hp.n_ff_shexp
            sg = self._buf("sg", 4 * n * fs).ptr
            su = self._buf("su", 4 * n * fs).ptr
            sh = self._buf("sh", 4 * n * E).ptr
            shg = self._buf("shg", 4 * n).ptr
            self._mm2(L["sh_gate"], L["sh_up"], h, sg, su, n, hq)
            k.swiglu(sg, su, sg, n * fs)
            self._mm(L["sh_down"], sg, sh, n)
            self._mm(L["sh_gate_inp"], h, shg, n, hq)
        return sh, shg

    def _group_tile(self, L: dict) -> int:
        """Pairs per tile of layer L's grouped expert GEMMs (their work list is cut to it): gemm_mma's 64 where all
        three expert matrices run on it, else 32."""
        mma = self.mma and all(L[w].qtype != gpu.F32 for w in ("gate_exps", "up_exps", "down_exps"))
        return gpu.Kernels.group_tile(self.int8_prefill, mma)

    def _gather_hq(self, L: dict, hq, ptok: int, pairs: int) -> int | None:
        """The grouped int8 GEMMs' input: the Q8_1 rows of h (hq) gathered per sorted pair into "xq_tok" (the same
        bits as quantising the gathered f32 rows: no f32 gather, no quantise pass) -> its address, or None where
        the experts read f32 rows (not grouped, f32 weights, no hq, rows not in 16-byte words)."""
        rb = self.hparams.n_embd // 32 * gpu.Q8_1_BYTES
        if not (self.grouped and self.int8_prefill and L["gate_exps"].qtype != gpu.F32 and hq is not None
                and rb % 16 == 0):
            return None
        xq = self._buf("xq_tok", pairs * rb).ptr
        self.k.get_rows_raw(hq, ptok, xq, pairs, rb)
        return xq

    def _grouped_experts(self, L: dict, base: int, xg: int, g: int, u: int, pairs: int, tiles: int,
                         n_tiles: int, xq: int | None = None) -> None:
        """Routed experts as grouped GEMMs over the pairs sorted by expert: xg [pairs, E] gathered rows in (or
        xq, their Q8_1 rows gathered already: _gather_hq), the down projection's output in xg [pairs, E] (sorted
        order); g, u [pairs, ff] scratch."""
        k, ff, E = self.k, self.hparams.n_ff_exp, self.hparams.n_embd
        int8 = self.int8_prefill and L["gate_exps"].qtype != gpu.F32
        mma = self._group_tile(L) == gpu.GEMM_MMA_TT        # then every matrix here is int8
        x = xg
        if int8:       # one Q8_1 copy of the gathered rows for gate and up
            x = xq if xq is not None else self._q8_1(xg, pairs * E, "xq_tok")
        for wname, out in (("gate_exps", g), ("up_exps", u)):
            w = L[wname]
            k.gemm_ids(w.qtype, base + w.ptr, x, out, w.nrows, w.ncols, tiles, n_tiles, w.expert_bytes, pairs,
                       int8=int8, mma=mma)
        k.swiglu(g, u, g, pairs * ff)
        w = L["down_exps"]
        int8d = self.int8_prefill and w.qtype != gpu.F32
        xd = g
        if int8d:
            xd = self._q8_1(g, pairs * ff, "xq_down")
        k.gemm_ids(w.qtype, base + w.ptr, xd, xg, w.nrows, w.ncols, tiles, n_tiles, w.expert_bytes, pairs,
                   int8=int8d, mma=mma)

    # ------------------------------------------------------------------ forward

    def new_state(self, n_ctx: int | None = None) -> "GpuState":
        from ..cpu.model import DEFAULT_CTX
        n_ctx = n_ctx or DEFAULT_CTX
        if self.budget is not None and n_ctx > self.n_ctx_plan:
            from ..plan.planner import PlanningError
            raise PlanningError(f"a state of {n_ctx} positions: this model's VRAM budget was planned for "
                                f"{self.n_ctx_plan} (make the GpuModel with n_ctx={n_ctx})")
        return GpuState(self, n_ctx)

    def forward(self, state: "GpuState", tokens, all_logits: bool = False, chunked: bool = True,
                want_logits: bool = True) -> np.ndarray | None:
        """tokens: int[n] at positions state.pos.. -> logits float32[n or 1, n_vocab] (as Model.forward;
        `chunked` is accepted for the interface: the GPU runs the GDN recurrence token by token)."""
        hp = self.hparams
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("tokens: a non-empty 1-D sequence of ids")
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= hp.n_vocab:
            raise ValueError(f"token ids must be integers in [0, {hp.n_vocab})")
        if not isinstance(state, GpuState) or state.gm is not self:
            raise ValueError("state belongs to another model (make it with this GpuModel's new_state)")
        if state.pos + ids.size > state.n_ctx:
            raise ValueError(f"{ids.size} tokens at position {state.pos} exceed the context of {state.n_ctx}")
        ids = ids.astype(np.int32)
        if ids.size == 1 and self.plan:
            return self._decode(state, int(ids[0]), want_logits)
        outs = []
        for c0 in range(0, ids.size, self.chunk):
            part = ids[c0:c0 + self.chunk]
            last = c0 + self.chunk >= ids.size
            if part.size == 1 and self.plan:
                # a last chunk of one token is the decode plan's step (an unplanned one-token pass would allocate
                # decode buffers of its own, and the plan be recorded again at the next token)
                out = self._decode(state, int(part[0]), want_logits and (all_logits or last))
                if out is not None:
                    outs.append(out)
                continue
            out = self._forward_chunk(state, part, all_logits if want_logits else False,
                                      want_logits and (all_logits or last))
            if out is not None:
                outs.append(out)
        if not want_logits:
            return None
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def sample_next(self, state: "GpuState", token: int, sampler, history: list[int] | None) -> int:
        """forward(state, [token]), then `sampler`'s draw from its logits -> the next token; history: the tokens
        seen, token included (the penalties' window). A planned decode step leaves its logits in VRAM and the
        draw's candidates are chosen there (gpu_sample.DeviceSampler: the same token as Sampler.sample on the
        downloaded row, for the same seed)."""
        if not self.plan:
            out = self.forward(state, [token])
            check_logits(out, state.pos - 1)
            return sampler.sample(out[0], history)
        self.forward(state, [token], want_logits=False)
        if self._sampler is None:
            self._sampler = DeviceSampler(self.k, self.hparams.n_vocab)
        return self._sampler.sample(self._scratch["d:logits"], sampler, history, state.pos - 1)

    def _decode(self, st: "GpuState", token: int, want: bool) -> np.ndarray | None:
        """One token through the state's LaunchPlan (recorded on the first call, and again when a buffer it
        names has moved)."""
        hp = self.hparams
        if self.decode_extras:
            self._extras_step()
        st.io.upload(np.array([token, st.pos], dtype=np.int32))
        if st._plan is None or st._plan_gen != self._gen:
            st._plan = None
            with gpu.record() as launches:
                self._forward_chunk(st, None, False, True, planned=True)
            st._plan, st._plan_gen = gpu.LaunchPlan(launches, graph=self.graphs), self._gen
        else:
            serve_all = self.cpu_experts and self.graphs     # else the plan's host steps serve layer by layer
            if self.cpu_experts:
                self._hy_next()
            try:
                st._plan.replay()
            except BaseException:
                if serve_all:
                    self.model.native.hybrid_release(self._hy["buf"].ptr, self._hy["seq"], self._hy["layers"])
                raise
            if serve_all:
                self._hy_serve(self._hy["layers"])      # each layer as the GPU publishes its routing
            st._pos += 1
        logits = self._scratch["d:logits"]
        out = logits.download(dtype=np.float32, count=hp.n_vocab).reshape(1, hp.n_vocab)
        return out if want else None

    def _forward_chunk(self, st: "GpuState", ids: np.ndarray | None, all_logits: bool, want: bool,
                       planned: bool = False) -> np.ndarray | None:
        """ids [n] from the host; planned: one token whose id and position are already in st.io (the decode
        plan's form: no argument depends on them)."""
        hp, k = self.hparams, self.k
        n, E = (1 if planned else ids.size), hp.n_embd
        self._tag = "d" if n == 1 else "p"
        if n > 1:
            self._arena_reserve(n)
            if self.decode_extras:
                self._extras_invalidate()
        if n == 1 and self.cpu_experts:
            self._hy_next()
        if planned:
            idb = st.io
        else:
            idb = self._buf("tokens", 4 * n)
            idb.upload(ids)
        x = self._buf("x", 4 * n * E).ptr
        h = self._buf("h", 4 * n * E).ptr
        y = self._buf("y", 4 * n * E).ptr
        if self.stream:
            self._prefetch_all(self._next_moe(-1), n)
        k.get_rows(self.embd.qtype, self.embd.ptr, idb.ptr, x, n, E)
        self._mark("embed")
        hq = self._hq(n)        # h's Q8_1 (int8 paths): each add_rmsnorm writes it with h
        k.add_rmsnorm(x, None, self.layers[0]["attn_norm"], h, hq, E, n, hp.rms_eps)
        for i, L in enumerate(self.layers):
            si = st.index[i]
            if hp.recurrent[i]:
                self._gdn(L, h, hq, n, st, si, y)
                self._mark("gdn")
            elif planned:
                self._attention_planned(L, h, hq, st, si, y)
            else:
                self._attention(L, h, hq, n, st, si, y)
                self._mark("attention")
            k.add_rmsnorm(x, y, L["post_norm"], h, hq, E, n, hp.rms_eps)      # residual add, norm, Q8_1: one launch
            self._ffn(L, h, hq, n, y)
            if i + 1 < len(self.layers):
                k.add_rmsnorm(x, y, self.layers[i + 1]["attn_norm"], h, hq, E, n, hp.rms_eps)
            else:
                k.add(x, y, x, n * E)
            self._mark("ffn rest")
        st._pos += n
        if not want:
            gpu.synchronize()
            self._flush_counts()
            return None
        self._mark("ffn rest")
        first = 0 if all_logits else n - 1
        outs = []
        for r0 in range(first, n, self.logit_rows):        # the head in pieces of logit_rows rows (scratch bound)
            n_out = min(self.logit_rows, n - r0)
            k.rmsnorm(x + 4 * r0 * E, self.out_norm, h, E, n_out, hp.rms_eps)
            logits = self._buf("logits", 4 * n_out * hp.n_vocab)
            self._mm(self.head, h, logits.ptr, n_out)
            if planned:
                return None                       # _decode downloads
            outs.append(logits.download(dtype=np.float32, count=n_out * hp.n_vocab).reshape(n_out, hp.n_vocab))
        self._mark("head")
        self._flush_counts()
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def close(self) -> None:
        """Frees the weights, staging and scratch in VRAM now (states keep their own buffers), unlocks the host
        weight map, lifts the budget this model set."""
        from ..core import _native
        gpu.synchronize()
        pins = list(getattr(self, "_pin_store", {}).values())
        for b in [self._weights, self._arena, getattr(self, "_pool", None)] + list(self._scratch.values()) \
                + self._retired + pins:
            if b is not None:
                b.free()
        if self._rope is not None:
            self._rope.free()
        self._bufs, self._scratch, self._retired, self._rope, self._staging, self._pin_store = {}, {}, [], None, [], {}
        self._pool = None
        self._weights, self._arena = None, None
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self._counts_dev, self._counts_layers = None, set()
        if self._handoff is not None:
            self._handoff.free()
            self._handoff = None
        if self._host_copy is not None:
            self._host_copy.free()
            self._host_copy = None
        if self._hy is not None:
            self._hy_flush()
            hy, self._hy = self._hy, None
            _HY_POOL.append(hy["buf"])          # kept for the next model (see _HY_POOL)
            hy["pin_idx"].free()
            if hy["lookahead"]:
                hy["lookahead"]["buf"].free()
        if self._host is not None:
            _native.gpu_host_unregister(self._host[0])
            self._host = None
        if self.budget is not None:
            gpu.set_budget(None)
            self.budget = None
        self.flush_routing()

    @property
    def hybrid_stats(self) -> dict:
        """The hybrid decode so far: MoE layer steps, experts run on the CPU, seconds in them (cpu_s) and waiting
        for the GPU's routing (read_s)."""
        self._hy_flush()
        return self._hybrid_stats

    def flush_routing(self) -> None:
        """Adds the routing counts gathered so far to the file's saved statistics (save_routing) and clears them;
        close() calls it, and the Engine at exit."""
        self._hy_flush()
        if self.route_counts and self.save_routing:
            from ..plan.planner import save_routing
            try:
                save_routing(self.model, self.route_counts)
            except OSError:
                pass                      # statistics are advice: an unwritable cache costs only better pins
        self.route_counts = {}
        self._repin_base = {}

    def describe(self) -> str:
        conv = f"; dequantised to f32 at upload: {len(self.converted)} tensors" if self.converted else ""
        streamed = ""
        if self.stream:
            n_pin = sum(len(v) for v in self.pinned.values())
            by = ("the copy kernel" if self.pin_copy_kernel and len(self._pin_lists) == len(self._pin_store)
                  else "cuMemcpyDtoD")
            streamed = (f"; routed experts streamed from host RAM ({self.host_pinned_why}), {n_pin} of "
                        f"{self.hparams.n_expert * len(self._stage_layout)} pinned in VRAM (into the prefill's "
                        f"staging by {by})")
            if self.cpu_experts:
                n_x = sum(len(v) for v in self.decode_extras.values())
                streamed += (f"; hybrid decode ({n_x} more experts in VRAM for the decode: kept in the staging "
                             "between prefills, copied back after each" if n_x else
                             "; hybrid decode (no experts kept in the staging between prefills")
                streamed += (f"; {self.link_experts} experts per layer fetched over the link, the "
                             f"rest not pinned on the CPU; {self.early_experts} of the next layer's likeliest copied "
                             "early; lookahead "
                             + (f"on: the next layer's {LOOKAHEAD_PRED} likeliest experts prefetched by the CPU)"
                                if self.lookahead else self.lookahead_why + ")"))
        budget = f" (budget {self.budget / 2**30:.2f} GiB: {self.footprint.describe()})" if self.budget else ""
        kind = lambda on: "int8 DP4A" if on else "f32"   # noqa: E731
        gemm = "int8 tensor-core (mma)" if self.mma else kind(self.int8_prefill)
        embd = ("; token embedding read from host memory over the link ("
                + ("the page-locked map" if self._host is not None else "a page-locked copy") + ")"
                if self.embd_where == "host" else "")
        return (f"GPU {self.device['name']} ({self.k.name} kernels, {kind(self.int8)} decode GEMVs, "
                f"{gemm} prefill GEMMs), weights {self.vram_bytes / 2**30:.2f} GiB in "
                f"VRAM{budget}{streamed}{embd}; decode CUDA graphs {self.graphs_why}{conv}")


def model_faults(model) -> dict:
    """The negative-control faults the CPU model was made with (tests only); those the GPU path knows:
    gdn_grouped (v-head j reads k-head j / (H_v/H_k) instead of j % H_k)."""
    faults = dict(model.faults)
    unknown = set(faults) - {"gdn_grouped"}
    if unknown:
        raise ValueError(f"the GPU forward pass cannot inject {sorted(unknown)}")
    return faults


class GpuState:
    """One sequence's state in VRAM: conv [n_gdn, K-1, conv_dim], SSM [n_gdn, H_v, d_k, d_v], K and V
    [n_attn, n_ctx, n_kv*hd], all f32 (the CPU state's layouts), and the position."""

    def __init__(self, gm: GpuModel, n_ctx: int):
        hp = gm.hparams
        if n_ctx < 1:
            raise ValueError(f"n_ctx = {n_ctx}")
        self.gm, self.n_ctx, self._pos = gm, int(n_ctx), 0
        self.index, n_gdn, n_attn = [], 0, 0
        for r in hp.recurrent:
            self.index.append(n_gdn if r else n_attn)
            n_gdn, n_attn = n_gdn + bool(r), n_attn + (not r)
        self.n_gdn, self.n_attn = n_gdn, n_attn
        conv_dim = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
        self.conv_floats = (hp.ssm_conv_kernel - 1) * conv_dim
        self.ssm_floats = hp.ssm_d_inner * hp.ssm_d_state
        self.kvw = hp.n_head_kv * hp.head_dim
        self.conv = gpu.Buffer(4 * max(1, n_gdn * self.conv_floats), "GDN conv states")
        self.ssm = gpu.Buffer(4 * max(1, n_gdn * self.ssm_floats), "GDN SSM states")
        self.k = gpu.Buffer(4 * max(1, n_attn * self.n_ctx * self.kvw), "K cache")
        self.v = gpu.Buffer(4 * max(1, n_attn * self.n_ctx * self.kvw), "V cache")
        self.io = gpu.Buffer(8, "decode token, position")    # int32 [token, pos] of a planned decode step
        self._plan, self._plan_gen = None, -1
        gm._rope_cs(self.n_ctx)
        self.reset()

    @property
    def pos(self) -> int:
        return self._pos

    def reset(self) -> None:
        from ..core import _native
        _native.gpu_memset8(self.conv.ptr, 0, self.conv.nbytes)
        _native.gpu_memset8(self.ssm.ptr, 0, self.ssm.nbytes)
        self._pos = 0

    def conv_ptr(self, i: int) -> int:
        return self.conv.ptr + 4 * i * self.conv_floats

    def ssm_ptr(self, i: int) -> int:
        return self.ssm.ptr + 4 * i * self.ssm_floats

    def k_ptr(self, i: int) -> int:
        return self.k.ptr + 4 * i * self.n_ctx * self.kvw

    def v_ptr(self, i: int) -> int:
        return self.v.ptr + 4 * i * self.n_ctx * self.kvw

    # the NativeState interface of the snapshot cache (same byte layouts)
    def recurrent_nbytes(self) -> int:
        return 4 * self.n_gdn * (self.conv_floats + self.ssm_floats)

    def kv_nbytes(self, n: int) -> int:
        return 2 * self.n_attn * 4 * n * self.kvw

    def save_recurrent(self) -> bytes:
        """conv + SSM states of every GDN layer (all conv, then all SSM; f32 bytes)."""
        out = np.empty(self.recurrent_nbytes(), dtype=np.uint8)
        self.save_recurrent_into(out)
        return out.tobytes()

    def save_recurrent_into(self, out) -> None:
        """save_recurrent into a writable bytes-like (page-locked memory: the copy runs at the link's speed)."""
        gpu.synchronize()
        nc, ns = 4 * self.n_gdn * self.conv_floats, 4 * self.n_gdn * self.ssm_floats
        mv = memoryview(out).cast("B")
        if mv.nbytes < nc + ns:
            raise ValueError(f"recurrent state of {nc + ns} bytes into a {mv.nbytes}-byte buffer")
        if nc:
            self.conv.download(mv[:nc])
        if ns:
            self.ssm.download(mv[nc:nc + ns])

    def restore_recurrent(self, data: bytes, pos: int) -> None:
        nc, ns = 4 * self.n_gdn * self.conv_floats, 4 * self.n_gdn * self.ssm_floats
        if len(data) != nc + ns:
            raise ValueError(f"recurrent state of {len(data)} bytes, this model's is {nc + ns}")
        if not 0 <= pos <= self.n_ctx:
            raise ValueError(f"position {pos} outside the context of {self.n_ctx}")
        mv = memoryview(data).cast("B")
        if nc:
            self.conv.upload(mv[:nc])
        if ns:
            self.ssm.upload(mv[nc:])
        self._pos = int(pos)

    def _kv_rows(self, start: int, n: int) -> None:
        if start < 0 or n < 0 or start + n > self.n_ctx:
            raise ValueError(f"KV rows [{start}, {start + n}) outside the context of {self.n_ctx}")

    def read_kv(self, start: int, n: int) -> bytes:
        """KV rows [start, start+n) of every attention layer: [n_attn][K, V][n][row] f32 bytes."""
        out = np.empty(self.kv_nbytes(n), dtype=np.uint8)
        self.read_kv_into(start, n, out)
        return out.tobytes()

    def read_kv_into(self, start: int, n: int, out) -> None:
        """read_kv into a writable bytes-like of at least kv_nbytes(n)."""
        from ..core import _native
        self._kv_rows(start, n)
        gpu.synchronize()
        rb = 4 * n * self.kvw
        mv = memoryview(out).cast("B")
        if mv.nbytes < 2 * self.n_attn * rb:
            raise ValueError(f"{2 * self.n_attn * rb} bytes of KV rows into a {mv.nbytes}-byte buffer")
        for a in range(self.n_attn):
            for j, base in enumerate((self.k_ptr(a), self.v_ptr(a))):
                if rb:
                    _native.gpu_copy_dtoh(mv[(2 * a + j) * rb:(2 * a + j + 1) * rb], base + 4 * start * self.kvw, rb)

    def write_kv(self, start: int, n: int, data: bytes) -> None:
        from ..core import _native
        self._kv_rows(start, n)
        rb = 4 * n * self.kvw
        if len(data) != 2 * self.n_attn * rb:
            raise ValueError(f"KV data of {len(data)} bytes for {n} rows, expected {2 * self.n_attn * rb}")
        mv = memoryview(data).cast("B")
        for a in range(self.n_attn):
            for j, base in enumerate((self.k_ptr(a), self.v_ptr(a))):
                if rb:
                    _native.gpu_copy_htod(base + 4 * start * self.kvw, mv[(2 * a + j) * rb:(2 * a + j + 1) * rb], rb)

    def copy_from(self, other: "GpuState") -> None:
        self.restore_recurrent(other.save_recurrent(), other.pos)
        self.write_kv(0, other.pos, other.read_kv(0, other.pos))

    # the handoff between engines, through one page-locked staging buffer of the model (GpuModel._handoff_buffer):
    # device <-> page-locked copies at the link's speed and one memcpy on the CPU side, instead of pageable copies
    # and Python bytes (SplitModel hands every GPU pass's state over both ways)
    def to_cpu(self, cpu_state) -> None:
        """Makes a CPU NativeState (of the same model) hold this sequence: prefill here, decode there."""
        self.to_cpu_rows(cpu_state, 0, self.pos)

    def to_cpu_rows(self, cpu_state, start: int, n: int) -> None:
        """The recurrent states, the position and KV rows [start, start + n) into a CPU NativeState (the rows a
        pass wrote: the CPU state holds the ones before)."""
        nr, nk = self.recurrent_nbytes(), self.kv_nbytes(n)
        stage = self.gm._handoff_buffer(max(nr, nk))
        if stage is None:                          # larger than the page-locked cap: pageable copies
            cpu_state.restore_recurrent(self.save_recurrent(), self.pos)
            cpu_state.write_kv(start, n, self.read_kv(start, n))
            return
        self.save_recurrent_into(stage[:nr])
        cpu_state.restore_recurrent(stage[:nr], self.pos)
        if n:
            self.read_kv_into(start, n, stage[:nk])
            cpu_state.write_kv(start, n, stage[:nk])

    def from_cpu(self, cpu_state) -> None:
        """Takes over a CPU NativeState's sequence."""
        pos = cpu_state.pos
        nr, nk = self.recurrent_nbytes(), self.kv_nbytes(pos)
        stage = self.gm._handoff_buffer(max(nr, nk))
        if stage is None:
            self.restore_recurrent(cpu_state.save_recurrent(), pos)
            self.write_kv(0, pos, cpu_state.read_kv(0, pos))
            return
        cpu_state.save_recurrent_into(stage[:nr])
        self.restore_recurrent(stage[:nr], pos)
        if pos:
            cpu_state.read_kv_into(0, pos, stage[:nk])
            self.write_kv(0, pos, stage[:nk])
