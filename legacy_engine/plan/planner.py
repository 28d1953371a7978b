"""The planner: what goes where, and which engine runs which phase, decided from measurements.

Three parts, each usable alone:

1. VRAM accounting (`vram_footprint`): every device allocation a GPU model of a file would make: resident
   weights, pinned experts, the two expert staging buffers of streamed prefill, the states of a context, the rope
   table and the scratch of a prefill chunk and of a decode step. The GPU model checks it against its budget
   before it uploads anything (`PlanningError` naming the parts), then enforces the budget in the driver layer.

2. Machine measurements (`measure`, cached per machine in $LE_CACHE_DIR/machine.json): host→device bandwidth
   from page-locked memory, CPU read bandwidth at the decode thread count, GPU prefill and decode throughput per
   tier. `--simulate-link GBPS` replaces the measured link (a CMP 100-210 on PCIe Gen1 x1 ≈ 0.25 GB/s, a Fermi
   box on PCIe 2.0 x16 ≈ 6 GB/s).

3. Strategies and the choice (`plan`): for a prompt length and a generation length, predict prefill and decode
   time of each strategy the machine can run:
     cpu        prefill and decode on the CPU (the integer SIMD kernels)
     stream     prefill on the GPU with the routed experts copied per layer from host RAM (pinned experts stay in
                VRAM), decode on the CPU (the seed paper's split)
     hybrid     the same prefill; decode steps with attention, GDN, router, shared and pinned experts on the GPU
                and the other routed experts on the CPU (pins chosen from the file's saved routing counts)
     resident   everything in VRAM, prefill and decode on the GPU
   and choose the fastest that fits the VRAM budget; short prompts stay on the CPU when the copy cannot pay
   (`min_gpu_tokens`, the crossover).

Models of time (a roofline per phase, each term from one measurement; shown by `legacy-engine plan`):
  CPU decode  t = decode_bytes / cpu_bw_eff            (bytes read per token: dense + top-k experts + LM head)
  CPU prefill t = n * decode_params * 2 / cpu_flops    (one integer dot product per token and weight)
  GPU prefill t = max(copy, compute) per layer summed, copy = streamed expert bytes / link_bw, compute =
              n * active_params * 2 / (gpu_flops * GPU_PREFILL_EFF) (the GEMM probe's rate, derated by the
              measured share of expert GEMVs, GDN recurrence and attention); the stream split adds the state
              handoff both ways at SPLIT_HANDOFF_GBPS (the hybrid split has none)
  GPU decode  t = decode_bytes / gpu_bw_eff + launches * launch_s
  hybrid step t = (dense + pinned share of expert bytes) / gpu_bw + launches * launch_s
                  + unpinned expert bytes / (cpu_bw * HYBRID_CPU_EFF) + MoE layers * HYBRID_HOST_S_PER_LAYER
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from ..core.errors import EngineError


class PlanningError(ValueError, EngineError):
    """A placement does not fit the VRAM budget (or no strategy can run); the message names the parts."""


GiB = 2**30
MiB = 2**20
# Scratch that is not one of the named buffers (driver-side rounding of cuMemAlloc to 2 MiB pages for the large
# buffers, the argmax partials, small launch temporaries): a fixed allowance, checked by the GPU tests (peak use
# after a prefill chunk and decode steps stays under the footprint's total).
SCRATCH_SLACK = 32 * MiB
ALLOC_GRANULE = 2 * MiB


WEIGHT_ALIGN = 256           # each resident tensor's offset inside the one weight allocation (cuMemAlloc's own)


def align_up(n: int, a: int = 256) -> int:
    """n rounded up to a multiple of a (WEIGHT_ALIGN, ARENA_ALIGN)."""
    return -(-int(n) // a) * a


def _round(n: int) -> int:
    return -(-int(n) // ALLOC_GRANULE) * ALLOC_GRANULE if n > 0 else 0


def weight_layout(file, names) -> tuple[dict, int]:
    """Offsets of tensors `names` inside one device allocation (each WEIGHT_ALIGN-aligned, as stored on the GPU:
    gpu_tensor_bytes) -> ({name: offset}, total bytes). One allocation: as ~600 separate ones (norms, biases, the
    GDN's small vectors) each rounded to the driver's 2 MiB page they were ~1 GiB of a 35B-A3B's 6 GiB budget."""
    offs, at = {}, 0
    for n in names:
        offs[n] = at
        at += align_up(gpu_tensor_bytes(file.tensors[n]), WEIGHT_ALIGN)
    return offs, at


def host_embedding(file, stream_experts: bool) -> bool:
    """Whether a GPU model of `file` leaves the token embedding in page-locked host memory (get_rows reads its n
    rows over the link, a decode step's one row ~1 KB): where the experts stream (VRAM is short: its bytes hold
    more pinned experts), the head is a tensor of its own (a tied head reads every row each token) and a GPU kernel
    reads its type as stored. llama.cpp keeps it on the host always."""
    from .. import gpu
    t = file.tensors.get("token_embd.weight")
    return bool(stream_experts and t is not None and "output.weight" in file.tensors
                and (t.type == gpu.F32 or t.type in gpu.GPU_TYPES))


def resident_names(file, stream_experts: bool = False) -> list:
    """The tensors a GPU model of `file` keeps in VRAM, in file order: every layer's (MTP layers excepted: not run)
    and the embedding (not where host_embedding), output norm and head; without the routed experts when they
    stream."""
    hp = file.hparams
    exp = {n for i in range(hp.n_layer) for n in expert_tensors(file, i)} if stream_experts else set()
    if host_embedding(file, stream_experts):
        exp.add("token_embd.weight")
    return [n for n in file.tensors
            if (n.startswith("blk.") and int(n.split(".")[1]) < hp.n_layer
                or n in ("token_embd.weight", "output_norm.weight", "output.weight")) and n not in exp]


def parse_size(text: str) -> int:
    """'6GiB', '6G', '6144MiB', '512M', '6.5GB' (GB = 10^9), or plain bytes -> bytes."""
    t = str(text).strip()
    units = {"gib": GiB, "g": GiB, "mib": MiB, "m": MiB, "kib": 1024, "k": 1024, "gb": 10**9, "mb": 10**6,
             "b": 1, "": 1}
    num = t.rstrip("BbIiGgMmKk")
    unit = t[len(num):].lower()
    if unit not in units:
        raise ValueError(f"size {text!r}: unit must be one of GiB, MiB, KiB, GB, MB, B")
    try:
        v = float(num)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with a unit (e.g. 6GiB)") from None
    if v < 0 or not math.isfinite(v):
        raise ValueError(f"size {text!r} must be >= 0")
    return int(v * units[unit])


def expert_tensors(file, layer: int) -> list[str]:
    """The routed-expert tensors of a layer, in file order ([n_expert, rows, cols] each)."""
    p = f"blk.{layer}."
    names = [p + s for s in ("ffn_gate_up_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                             "ffn_down_exps.weight")]
    return [n for n in names if n in file.tensors]


def layer_expert_bytes(file) -> dict:
    """{layer: bytes in VRAM of all its routed experts} for the layers that have experts."""
    hp = file.hparams
    out = {}
    for i in range(hp.n_layer):
        names = expert_tensors(file, i)
        if names:
            out[i] = sum(gpu_tensor_bytes(file.tensors[n]) for n in names)
    return out


def expert_bytes(file) -> dict:
    """{layer: bytes in VRAM of one of its routed experts} for the layers that have experts."""
    return {i: full // file.hparams.n_expert for i, full in layer_expert_bytes(file).items()}


def gpu_tensor_bytes(t) -> int:
    """Bytes of a tensor in VRAM: as stored for the GPU's types and f32, f32 for types dequantised at upload."""
    from .. import gpu
    if t.type == gpu.F32 or t.type in gpu.GPU_TYPES:
        return int(t.n_bytes)
    return 4 * int(np.prod(t.ne))


@dataclasses.dataclass
class VramFootprint:
    parts: dict                 # name -> bytes (each rounded as the driver allocates)
    expert_bytes: dict          # layer -> bytes of one expert (all its expert tensors)
    layer_expert_bytes: int     # the largest layer's routed experts (one staging buffer)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in self.parts.items() if v) + \
            f" = {self.total / GiB:.2f} GiB"


# Rows of logits one head pass computes (gpu_model runs a longer all_logits request in pieces): 512 for a resident
# model; 32 where experts stream, whose VRAM is better spent on pinned experts (each GiB pinned is a GiB less to copy
# per pass; 512 rows of a 248k vocabulary are 0.47 GiB, the head's pieces cost ~0.15 ms each on an H100).
LOGIT_ROWS, STREAM_LOGIT_ROWS = 512, 32


def head_rows(chunk: int, stream: bool) -> int:
    """Rows of logits per head pass of a GPU model with passes of `chunk` tokens."""
    return min(chunk, STREAM_LOGIT_ROWS if stream else LOGIT_ROWS)


ARENA_ALIGN = 256        # each buffer of the prefill's block arena starts at a multiple of it (gpu_model._buf)


def block_scratch(hp, n: int, int8: bool) -> dict:
    """The scratch buffers of each block of a layer in a pass of n tokens, {block: {_buf name: bytes}} (gpu_model's
    names; "ed" and "xg" are one buffer: the pairs' rows, unsorted or sorted). A block reads h and writes y, so
    none of its buffers outlives it: a pass of n > 1 tokens puts each block's buffers in one allocation shared by
    the blocks (arena_bytes), a decode step keeps them apart (plans name them)."""
    from .. import gpu
    E, k = hp.n_embd, max(hp.n_expert_used, 1)
    blocks = {}
    if any(hp.recurrent):
        cd = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
        blocks["gdn"] = {"qkv": 4 * n * cd, "u": 4 * n * cd, "z": 4 * n * hp.ssm_d_inner,
                         "o": 4 * n * hp.ssm_d_inner, "beta": 4 * n * hp.ssm_dt_rank, "g": 4 * n * hp.ssm_dt_rank}
        if int8 and n == 1:      # o's Q8_1 (a decode step's gated norm writes it for the out projection)
            blocks["gdn"]["oq"] = hp.ssm_d_inner // 32 * gpu.Q8_1_BYTES
    if not all(hp.recurrent):
        hd, nh = hp.head_dim, hp.n_head
        blocks["attention"] = {"qg": 4 * n * nh * 2 * hd, "ao": 4 * n * nh * hd}
    if hp.n_expert:
        pairs, ff = n * k, hp.n_ff_exp
        # router logits, ids and weights, gate/up rows, the pairs' rows [pairs, E] (the down outputs in (token,
        # slot) order, or with sorted pairs the gathered inputs, which the down outputs overwrite in place), the
        # sorted pairs' ids/token/inverse and tiles (moe_sort's padded list)
        moe = {"router": 4 * n * hp.n_expert, "ids": 4 * pairs, "wts": 4 * pairs, "eg": 4 * pairs * ff,
               "eu": 4 * pairs * ff, "xg": 4 * pairs * E,
               "pair_meta": 3 * 4 * pairs + 12 * (-(-pairs // 32) + min(hp.n_expert, pairs))}
        if int8:      # the grouped int8 GEMMs' Q8_1 inputs: the gathered rows, the down's
            moe |= {"xq_tok": pairs * E // 32 * gpu.Q8_1_BYTES, "xq_down": pairs * ff // 32 * gpu.Q8_1_BYTES}
        if hp.n_ff_shexp:
            fs = hp.n_ff_shexp
            moe |= {"sg": 4 * n * fs, "su": 4 * n * fs, "sh": 4 * n * E, "shg": 4 * n}
        blocks["moe"] = moe
    else:
        blocks["ffn"] = {"ffg": 4 * n * hp.n_ff, "ffu": 4 * n * hp.n_ff}
    return blocks


ARENA_NAMES = {"qkv": "gdn", "u": "gdn", "z": "gdn", "o": "gdn", "beta": "gdn", "g": "gdn", "oq": "gdn",
               "qg": "attention", "ao": "attention", "router": "moe", "ids": "moe", "wts": "moe", "eg": "moe",
               "eu": "moe", "xg": "moe", "ed": "moe", "pair_meta": "moe", "xq_tok": "moe", "xq_down": "moe",
               "sg": "moe", "su": "moe", "sh": "moe", "shg": "moe", "ffg": "ffn", "ffu": "ffn"}
# (the names above: gpu_model._buf's scratch of a pass's blocks, each in its block of block_scratch)


def arena_bytes(hp, n: int, int8: bool) -> int:
    """The prefill's block arena for passes of n tokens: the largest block's buffers, each ARENA_ALIGN-aligned."""
    return max((sum(align_up(b, ARENA_ALIGN) for b in blk.values())
                for blk in block_scratch(hp, n, int8).values()), default=0)


def scratch_bytes(hp, n: int, int8: bool, logit_rows: int) -> int:
    """The named scratch buffers of one forward pass of n tokens (gpu_model's _buf calls), logits for logit_rows:
    the blocks' buffers in one arena when n > 1 (arena_bytes), apart in a decode step."""
    from .. import gpu
    E = hp.n_embd
    b = 4 * n + 3 * 4 * n * E                    # tokens; x, h, y
    if n == 1 and not all(hp.recurrent):         # a decode step's k and v rows and its split-K partials
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        b += 2 * 4 * nkv * hd + 4 * nh * gpu.ATTN_MAX_SPLIT * (hd + 2)
    if hp.n_expert:
        b += 4 * hp.n_layer * hp.n_expert        # the routing counts
    if int8:       # Q8_1 rows of n tokens: the normed h (hq), another shared input (xq), a matmul's own (xq_mm)
        b += 4 * n * max(E, hp.ssm_d_inner, hp.n_ff, hp.n_ff_shexp, hp.n_ff_exp, hp.n_head * hp.head_dim) // 32 \
            * gpu.Q8_1_BYTES
    b += arena_bytes(hp, n, int8) if n > 1 else sum(sum(blk.values()) for blk in block_scratch(hp, n, int8).values())
    return b + 4 * logit_rows * hp.n_vocab


def state_bytes(hp, n_ctx: int) -> int:
    """One GpuState of n_ctx positions (GDN conv + SSM, f32 K and V) plus the rope table."""
    n_gdn = sum(1 for r in hp.recurrent if r)
    n_attn = len(hp.recurrent) - n_gdn
    conv_dim = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
    conv = n_gdn * (hp.ssm_conv_kernel - 1) * conv_dim * 4
    ssm = n_gdn * hp.ssm_d_inner * hp.ssm_d_state * 4
    kv = 2 * n_attn * n_ctx * hp.n_head_kv * hp.head_dim * 4
    return _round(conv) + _round(ssm) + _round(kv) + _round(n_ctx * hp.n_rot * 4)


def pin_store_bytes(n: int, expert_bytes: int) -> int:
    """One layer's pin store (gpu_model): its n pinned experts, padding to 16 bytes, then the copy kernel's lists
    (int32 [2, n]: ranks, expert ids); 0 without pins."""
    body = n * expert_bytes
    return body + -body % 16 + 8 * n if n else 0


def vram_footprint(file, *, stream_experts: bool = False, pinned: dict | None = None, n_ctx: int = 4096,
                   chunk: int = 512, int8: bool = True, logit_rows: int | None = None,
                   link_experts: int = 0, early_experts: int = 0) -> VramFootprint:
    """What a GPU model of `file` allocates. stream_experts: routed experts stay in host RAM except `pinned`
    {layer: [expert ids]}; two staging buffers of the largest layer's experts. logit_rows: rows of logits a
    head pass computes (default head_rows). link_experts: the hybrid decode's staging of experts fetched per
    layer over the link (GpuModel link_experts). early_experts: the hybrid decode's early experts (GpuModel
    early_experts): that many more staging slots, and the CPU's early buffer (two halves of that many slots of the
    largest expert tensor's expert for each of gate, up, down)."""
    hp = file.hparams
    pinned = pinned or {}
    resident = _round(weight_layout(file, resident_names(file, stream_experts))[1])
    per_expert, layer_max, pin_total = {}, 0, 0
    for i, full in layer_expert_bytes(file).items():
        per_expert[i] = full // hp.n_expert
        layer_max = max(layer_max, full)
        if stream_experts:
            pin_total += _round(pin_store_bytes(len(pinned.get(i, ())), per_expert[i]))
    parts = {"weights": resident}
    if stream_experts:
        parts["pinned experts"] = pin_total
        parts["expert staging (2 layers)"] = 2 * _round(layer_max)
        if link_experts or early_experts:
            parts["link staging"] = _round((link_experts + early_experts) * max(per_expert.values()))
        if early_experts:
            one = max(gpu_tensor_bytes(file.tensors[n]) // hp.n_expert
                      for i in per_expert for n in expert_tensors(file, i))
            parts["early buffer"] = _round(6 * early_experts * one)
    parts["state"] = state_bytes(hp, n_ctx)
    rows = head_rows(chunk, stream_experts) if logit_rows is None else logit_rows
    parts["scratch"] = (_round(scratch_bytes(hp, chunk, int8, rows)) + _round(scratch_bytes(hp, 1, int8, 1))
                        + SCRATCH_SLACK)
    return VramFootprint(parts, per_expert, layer_max)


def check_fits(fp: VramFootprint, budget: int, what: str = "this placement") -> None:
    if fp.total > budget:
        raise PlanningError(f"{what} needs {fp.total / GiB:.2f} GiB of VRAM, the budget is {budget / GiB:.2f} GiB: "
                            f"{fp.describe()}")


# ================================================================================================ the machine

# Efficiencies measured on the GPU machine (README, issue 4/5 numbers) that turn a bandwidth into a rate; each
# is a ratio of a measured tok/s to the roofline of the same run, so the planner's only other inputs are the
# probes below.
CPU_DECODE_EFF = 0.62        # CPU decode tok/s / (read bandwidth / bytes per token): 59-64 % at 16 threads
CPU_PREFILL_GAIN = 1.0       # CPU prefill tok/s / CPU decode tok/s (one integer dot per token and row: ~1x)
# Whole GPU prefill / the GEMM probe's rate: the prefill also runs the grouped expert GEMMs (tiles of <= 32 tokens
# of one expert), the GDN recurrence token by token and attention, which the f32 GEMM probe does not see. Measured
# with `bench split --strategies hybrid` (no handoff to the CPU) on the 35B-A3B Q4_K_M file under 6 GiB, H100,
# 2026-11-25: pp2048 1,555 tok/s (uniform routing) where the probe alone predicts 1.86 s at 0.47, i.e. 0.66;
# the first calibration (0.47, GEMVs per (token, expert) pair instead of the grouped GEMM) is superseded.
GPU_PREFILL_EFF = 0.66
GPU_DECODE_LAUNCHES_PER_LAYER = 14   # kernels per layer and token (gpu_model: 544 for 24 layers + head ≈ 22.5/layer
#                                     on the 0.8B incl. quantise/route; 14 is the MoE-free GDN average)
# The hybrid decode (gpu_model._ffn_hybrid: the GPU and the CPU exchange each MoE layer through a host channel that
# both read and write directly, a token is one CUDA graph), calibrated on `bench split --strategies hybrid --reps 3`
# (35B-A3B Q4_K_M, 6 GiB, H100 + 16 cores reading 52.3 GB/s, 2026-11-25 fifth session, the quietest run: 0.5 % of the
# CPUs taken by the hypervisor): skewed routing (--router-skew 1.2) 10.8 ms per token at 12 threads, of which the
# CPU's 98 experts 5.96 ms (0.187 GB: 31 GB/s = 0.60 of the probe's read bandwidth), the host waiting for each
# layer's routing 4.21 ms (the GPU's chain from one layer's CPU row to the next layer's routing: ~20 kernels), the
# rest 0.66 ms; uniform routing 16.8 ms for 278 experts (0.53 GB, 0.61). The per-layer cost below is that chain less
# the GPU's own share (its GEMV weights at the GEMV rate, ~1.2 ms) plus the rest, per MoE layer. HYBRID_CPU_EFF:
# the CPU's experts per token / the probe's read bandwidth, recalibrated 2026-11-25 (seventh session) after the dot
# products' prefetch and le_moe_routed's static split: uniform 196 experts (347 MB) in 7.0 ms, skewed 100 (177 MB)
# in 3.6 ms, both 49-50 GB/s of the probe's 90.2 = 0.55 (the first calibration, 0.47, before both changes: the
# planner's decode then read 18 % / 12 % under the measurement; now 81.0 (uniform, recomputed on that call's machine)
# and ~115 (skewed, estimated from the parts) vs 90.0 / 122.3; link choice unchanged, 2 / 0). A few % of hypervisor
# steal halves these numbers (bench split reports it per run). Recalibrated 2026-11-25 (eighth session; H200 + 16
# cores, probe 85.8 GB/s, bench split --tg-depth 0,2048, the pins from warm routing counts, JSONs
# split_a3b_6GiB_*_2026-11-25h.json): the CPU's experts uniform 161.7 (286 MB) in 5.4 ms, skewed 99.7 (176 MB) in
# 3.1 ms: 53 / 57 GB/s = 0.62 / 0.66 -> 0.64; the host's wait for each routing 4.4 / 3.5 ms a token, of which the
# GPU's own share (~1 ms, `gpu` in _hybrid_decode) -> 75 µs a layer. Before it the planner read 90.6 / 113.9 against
# 106.1 / 152.5 tok/s measured (depth 0).
# The split's state handoff (SplitModel.forward, stream strategy: the GDN states (and KV rows so far) to the GPU
# before a pass, the states and the pass's KV rows back after, through one page-locked staging buffer), bytes moved /
# seconds: benchmarks/bench_split_handoff.py, 35B-A3B Q4_K_M under 6 GiB, pp2048, H100 2026-11-25 (fourth session):
# from_cpu 66 MB in 14.2 ms, to_cpu_rows 150 MB in 30.7 ms: 4.8 GB/s (the pageable Python-bytes path it replaced:
# 328 ms, 0.66 GB/s). The hybrid strategy keeps the state on the GPU: no handoff.
SPLIT_HANDOFF_GBPS = 4.8
HYBRID_CPU_EFF = 0.64
HYBRID_HOST_S_PER_LAYER = 75e-6
# The hybrid decode's link experts (GpuModel link_experts: per layer, some experts that are not pinned are fetched
# into VRAM by a copy kernel and run on the GPU while the CPU runs the rest). Same machine and file, pp512/tg32 x3:
# uniform routing 62.5 tok/s with none, 83.4 / 87.3 / 83.3 / 76.9 with 1-4 per layer (the GPU's chain grows past 2:
# ~55 µs per 1.9 MB expert, 36 GB/s of the link's 52: LINK_FETCH_EFF 0.7); skewed routing (2.15 unpinned experts
# per layer) 125 with none, 116 / 107 with 1 / 2. The count balancing the CPU's share against the link's is
# under-committed by LINK_COMMIT: the unpinned experts per layer vary token to token, and a layer whose GPU share
# finishes last delays the next layer.
LINK_FETCH_EFF = 0.7
LINK_COMMIT = 0.8
# The hybrid decode's extras (choose_decode_extras): after each prefill the link carries them back into the
# staging (~0.9 GiB on the 35B-A3B under 6 GiB: 17 ms at 53 GB/s, 3.6 s over a CMP's 0.25 GB/s) while the decode
# runs without them. Kept where the time they save over a reply of EXTRAS_MIN_GEN tokens (or the plan's gen, if
# longer) exceeds that copy. Measured (35B-A3B Q4_K_M, 6 GiB, H200, 2026-11-25, hybrid vs hybrid/noextras in one
# process, 16 threads): the CPU's experts per token 193 -> 174 (uniform) and 87 -> 72 (skewed); decode tok/s
# within the runs' spread (+-5 %) on that 16-core host, where the GPU's chain and not the CPU's bytes set the pace.
EXTRAS_MIN_GEN = 128
MACHINE_FILE = "machine.json"
PROBE_VERSION = 3   # part of the cache key: 3 = the GEMM probe times the prefill's own GEMM (gemm_mma / gemm_dp4a)
# A probe taken while other work ran on the CPUs reads low (issue 21: 6.6 GB/s host reads on a 2-core box with other
# work on the cores, 35 GB/s idle, and `plan` predicted 5x too low until --remeasure). measure() records the other
# work (cpu_load: CPUs' worth before and during the probe, and the load average) and flags the probe `under_load`
# from cpu_load.BUSY_CPU; a flagged probe (or one without a record, older than this rule) is retaken by the next
# measure() that finds the machine idle, and used, flagged, while it is not. `plan` prints the probe's age and load.
PROBE_STALE_DAYS = 30   # `plan` calls an older probe stale: the machine (or what runs on it) may have changed


@dataclasses.dataclass
class Machine:
    """What the planner knows of a machine: measured (`measure`) or described (tests, --simulate-link)."""
    cpu_threads: int
    cpu_read_gbps: float                 # host read bandwidth at cpu_threads (GB/s)
    gpu_name: str = ""                   # "" = no usable GPU
    gpu_tier: str = ""
    vram_free: int = 0                   # bytes free on the device when measured
    link_gbps: float = 0.0               # host -> device from page-locked memory
    gpu_gemm_tflops: float = 0.0         # prefill GEMM on Q4_K, 512 tokens (gemm_mma / gemm_dp4a on dp4a, else gemm_f32)
    gpu_gemv_gbps: float = 0.0           # decode GEMV weight streaming (the tier's decode kernel, Q4_K)
    gpu_launch_us: float = 0.0           # per kernel inside a decode step (graph replay)
    simulated_link: bool = False
    measured_at: float = 0.0             # Unix time of the probe (0: described, or cached before the load record)
    load_cpus: float = -1.0              # CPUs' worth of other work before or during the probe (-1: unknown)
    load_avg: float = -1.0               # the 1-minute load average at the probe (-1: unknown)
    under_load: bool = False             # load_cpus >= cpu_load.BUSY_CPU: the CPU rates read low

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_name)

    def probe_note(self, now: float | None = None) -> str:
        """When the probe was taken and whether other work ran during it (`plan`, `info`)."""
        if not self.measured_at:
            return "probe: no record of when or under what load (retaken on an idle machine; --remeasure)"
        age = (time.time() if now is None else now) - self.measured_at
        days = age / 86400
        when = "probe taken " + (f"{days:.0f} days" if days >= 2 else f"{age / 3600:.1f} h" if age >= 3600 else
                                 f"{age / 60:.0f} min") + " ago"
        if self.under_load:
            return (f"{when} UNDER LOAD (other work on {self.load_cpus:.1f} CPUs, load average {self.load_avg:.2f}): "
                    "its CPU rates read low; retaken once the machine is idle, or --remeasure")
        note = f"{when} on an idle machine (other work on {self.load_cpus:.1f} CPUs)"
        if days > PROBE_STALE_DAYS:
            note += f"; STALE (over {PROBE_STALE_DAYS} days): --remeasure if the machine changed"
        return note


_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def machine_from_json(d) -> Machine | None:
    """A cached probe (an entry of machine.json) as a Machine; None when it is malformed: not an object, a field
    without a default missing, a field of the wrong type, a rate not a finite number, no thread or no bandwidth.
    Unknown keys are ignored."""
    if not isinstance(d, dict):
        return None
    kw = {}
    for f in dataclasses.fields(Machine):
        if f.name not in d:
            if f.default is dataclasses.MISSING:
                return None
            continue
        v = d[f.name]
        if not isinstance(v, _JSON_TYPES[f.type]) or (isinstance(v, bool) and f.type != "bool"):
            return None
        if f.type == "float":
            if not math.isfinite(v):
                return None
            v = float(v)
        kw[f.name] = v
    m = Machine(**kw)
    return m if m.cpu_threads >= 1 and m.cpu_read_gbps > 0 else None


def _read_probes(path: str) -> dict:
    """machine.json's object ({} when absent, unreadable, not JSON or not an object)."""
    import json
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _gpu_probes(tier: str | None = None) -> dict:
    """H2D bandwidth, GEMM and GEMV throughput of this GPU's tier, launch cost (a few seconds)."""
    import time

    from ..core import _native
    from .. import gpu
    from ..gpu.model import default_tier
    dev = gpu.init()
    arch = gpu.device_arch()
    tier = tier or default_tier(arch)
    k = gpu.Kernels(tier, arch)
    st = gpu.mem_stats()
    out = {"gpu_name": dev["name"], "gpu_tier": tier, "vram_free": int(st["free_bytes"])}
    # host -> device from page-locked memory, 256 MiB
    n = 256 * MiB
    hp, hbuf = _native.gpu_host_alloc(n)
    try:
        with gpu.Buffer(n, "link probe") as d:
            s = gpu.Stream()
            best = float("inf")
            for _ in range(4):
                t0 = time.perf_counter()
                _native.gpu_copy_htod_addr(d.ptr, int(_native.ffi.cast("uintptr_t", hp)), n, s.handle)
                s.synchronize()
                best = min(best, time.perf_counter() - t0)
            out["link_gbps"] = n / best / 1e9
    finally:
        _native.gpu_host_free(hp)
    # GEMM on a 4096 x 4096 Q4_K matrix x 512 tokens; GEMV on 16384 x 8192 (75 MB: past the L2 of any card);
    # zero blocks (timing only), timed with events
    q4k, cols, ntok = 12, 4096, 512
    _, bs, ts = gpu.GPU_TYPES[q4k]
    rows_mm, rows_mv, cols_mv = 4096, 16384, 8192
    wbytes = rows_mv * cols_mv // bs * ts
    with gpu.Buffer(wbytes, "probe W") as W, gpu.Buffer(4 * ntok * cols_mv, "probe X") as X, \
            gpu.Buffer(4 * ntok * rows_mv, "probe Y") as Y, \
            gpu.Buffer(cols_mv // 32 * gpu.Q8_1_BYTES, "probe xq") as xq:
        _native.gpu_memset8(W.ptr, 0, wbytes)
        _native.gpu_memset8(X.ptr, 0, 4 * ntok * cols_mv)

        def timed(fn, reps):
            return gpu.time_ms(fn, reps) / 1e3
        if tier == "dp4a":       # the prefill's GEMM there: int8 on Q8_1 activations (gpu_model int8_prefill)
            with gpu.Buffer(ntok * cols // 32 * gpu.Q8_1_BYTES, "probe Xq") as xqm:
                k.quantize_q8_1(X, xqm, ntok * cols)
                gemm = k.gemm_mma if k.has_mma else k.gemm_dp4a
                t = timed(lambda: gemm(q4k, W, xqm, Y, rows_mm, cols, ntok), 5)
        else:
            t = timed(lambda: k.gemm_f32(q4k, W, X, Y, rows_mm, cols, ntok), 5)
        out["gpu_gemm_tflops"] = 2 * rows_mm * cols * ntok / t / 1e12
        if tier == "dp4a":
            k.quantize_q8_1(X, xq, cols_mv)
            t = timed(lambda: k.gemv_dp4a(q4k, W, xq, Y, rows_mv, cols_mv), 20)
        else:
            t = timed(lambda: k.gemv_f32(q4k, W, X, Y, rows_mv, cols_mv), 20)
        out["gpu_gemv_gbps"] = wbytes / t / 1e9
        # launch cost: a tiny kernel recorded 200 times, replayed as a plan (a graph where the driver has them)
        with gpu.record() as launches:
            for _ in range(200):
                k.add(Y, Y, Y, 32)
        plan = gpu.LaunchPlan(launches, graph=gpu.graphs_available() and tier != "fermi")
        plan.replay()
        gpu.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            plan.replay()
        gpu.synchronize()
        out["gpu_launch_us"] = (time.perf_counter() - t0) / 10 / 200 * 1e6
    return out


def measure(n_threads: int | None = None, gpu: bool = True, cache: bool = True, refresh: bool = False,
            log=None) -> Machine:
    """Probes this machine (CPU read bandwidth at the decode thread count; the GPU's link, GEMM, GEMV and launch
    cost) or returns the cached probe of the same thread count. Takes ~10 s the first time. A cached probe taken
    under load (or without a load record) is retaken when the machine is idle now, else returned as it is,
    flagged (under_load); a malformed cache is treated as absent."""
    import json
    import os

    from ..cpu import cpu_load
    from ..tools.bench import machine_bandwidth
    from ..cpu.model import default_threads
    from ..core.paths import cache_dir
    say = log or (lambda s: None)
    n_threads = n_threads or default_threads()
    path = os.path.join(cache_dir(), MACHINE_FILE)
    key = f"v{PROBE_VERSION},threads={n_threads},gpu={int(gpu)}"
    saved = _read_probes(path) if cache else {}
    old = machine_from_json(saved.get(key))
    if old is not None and not refresh:
        if old.measured_at and not old.under_load:
            return old
        now = cpu_load.sample()
        if now is not None and now.shared:   # a probe now would read low again
            say(f"the cached machine probe was taken under load (or has no record); other work still runs "
                f"({now.describe()}): using it")
            return old
        say("retaking the machine probe: the cached one was taken under load (or has no record of it)")
    say(f"measuring this machine ({n_threads} threads{', GPU' if gpu else ''}) …")
    before = cpu_load.sample()
    bw, during = cpu_load.during(lambda: machine_bandwidth(n_threads, size_mib=512, reps=3))
    loads = [x for x in (before, during) if x is not None]
    other = max((x.other for x in loads), default=-1.0)
    m = {"cpu_threads": n_threads, "cpu_read_gbps": bw, "measured_at": time.time(), "load_cpus": round(other, 2),
         "load_avg": round(loads[-1].load_avg, 2) if loads else -1.0,
         "under_load": other >= cpu_load.BUSY_CPU}
    if m["under_load"]:
        say(f"other work ran during the probe ({other:.1f} CPUs): flagged, retaken once the machine is idle")
    if gpu:
        from .. import gpu as gpu_mod
        ok, _why = gpu_mod.available()
        if ok:
            m.update(_gpu_probes())
    if cache:
        saved[key] = m
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=1)
        os.replace(path + ".tmp", path)
    return Machine(**m)


def cached_machines() -> dict:
    """The well-formed machine probes saved by measure() ({"vV,threads=T,gpu=G": Machine fields}), {} when none;
    malformed entries (or a malformed file) are left out."""
    import os

    from ..core.paths import cache_dir
    saved = _read_probes(os.path.join(cache_dir(), MACHINE_FILE))
    out = {}
    for key, d in saved.items():
        m = machine_from_json(d)
        if m is not None:
            out[key] = dataclasses.asdict(m)
    return out


def format_machines(saved: dict) -> list[str]:
    """`info`'s planner lines: what the planner will use without measuring again (malformed entries skipped)."""
    ms = {k: m for k, m in ((k, machine_from_json(d)) for k, d in saved.items()) if m is not None}
    if not ms:
        return ["Planner  no machine probe cached yet (`legacy-engine plan` measures once, ~10 s)"]
    out = ["Planner  cached machine probes (`legacy-engine plan --remeasure` refreshes):"]
    for key, m in sorted(ms.items()):
        line = f"  {key}: CPU {m.cpu_read_gbps:.1f} GB/s read"
        if m.gpu_name:
            line += (f"; GPU {m.gpu_name} ({m.gpu_tier}): link {m.link_gbps:.1f} GB/s, GEMM "
                     f"{m.gpu_gemm_tflops:.1f} TFLOP/s, GEMV {m.gpu_gemv_gbps:.0f} GB/s")
        out += [line, f"    {m.probe_note()}"]
    return out


# ================================================================================================ predictions

def expected_distinct(n_expert: int, k: int, n: int) -> float:
    """Expected number of distinct experts n tokens route to (uniform routing, k of n_expert each)."""
    if not n_expert:
        return 0.0
    return n_expert * (1 - (1 - k / n_expert) ** n)


@dataclasses.dataclass
class Strategy:
    name: str
    fits: bool
    why: str                        # placement / reason it cannot run
    vram: int                       # planned bytes
    prefill_s: float = math.inf
    decode_s_per_tok: float = math.inf
    prefill_parts: dict = dataclasses.field(default_factory=dict)     # where the prefill time goes
    pinned: dict = dataclasses.field(default_factory=dict)
    min_gpu_tokens: int = 0
    chunk: int = 512                # tokens per GPU pass (streamed: each pass copies the experts it routes to)
    decode_parts: dict = dataclasses.field(default_factory=dict)      # where the decode time goes (hybrid)
    link_experts: int = 0           # hybrid: experts per layer the GPU fetches over the link (GpuModel link_experts)
    decode_extras: dict = dataclasses.field(default_factory=dict)    # hybrid: GpuModel decode_extras

    def total_s(self, gen: int) -> float:
        return self.prefill_s + gen * self.decode_s_per_tok


def choose_pins(file, budget_bytes: int, counts: dict | None = None) -> dict:
    """{layer: [expert ids]} that fill budget_bytes, hottest first by `counts` {layer: [count per expert]}
    (routing statistics); without counts every expert is equally hot and the pins are spread evenly over the
    layers (round-robin, lower ids first)."""
    per = expert_bytes(file)
    budget_bytes -= len(per) * ALLOC_GRANULE          # each layer's pin store is rounded up to the granule
    if not per or budget_bytes <= 0:
        return {}
    pins, used = {}, 0
    for e, i in _ranked_experts(file, per, counts):
        if used + per[i] > budget_bytes:
            continue
        pins.setdefault(i, []).append(e)
        used += per[i]
    return {i: sorted(v) for i, v in sorted(pins.items())}


def _ranked_experts(file, layers, counts: dict | None, skip: dict | None = None) -> list:
    """[(expert, layer)] of `layers` hottest first by `counts` (none: all equally hot); ties: the lower id, then the
    lower layer (round-robin over the layers); the experts in `skip` {layer: ids} left out."""
    hp = file.hparams
    cand = []
    for i in layers:
        c = np.asarray(counts.get(i, np.zeros(hp.n_expert)) if counts else np.zeros(hp.n_expert), dtype=float)
        out = set(skip.get(i, ())) if skip else set()
        cand += [(-c[e], e, i) for e in range(hp.n_expert) if e not in out]
    cand.sort()
    return [(e, i) for _, e, i in cand]


def staging_pool_bytes(file) -> int:
    """Bytes of the streamed prefill's expert staging (two layers' worth, one allocation): idle between prefills,
    where the hybrid decode keeps its extras (choose_decode_extras)."""
    per = layer_expert_bytes(file)
    return 2 * _round(max(per.values())) if per else 0


def extras_regions(file, extras: dict, slots: int = 0) -> dict:
    """{layer: (offset, bytes)} of each MoE layer's region in the staging pool, packed in layer order: per expert
    tensor `slots` link/early experts then the layer's extras (WEIGHT_ALIGN-aligned); a layer with neither has
    none. The layout gpu_model uses."""
    out, at = {}, 0
    for i, eb in expert_bytes(file).items():
        n = slots + len(extras.get(i, ()))
        if n:
            out[i] = (at, align_up(n * eb, WEIGHT_ALIGN))
            at += out[i][1]
    return out


def choose_decode_extras(file, pins: dict, counts: dict | None = None, slots: int = 0) -> dict:
    """{layer: [expert ids]} the hybrid decode keeps in the expert staging between prefills (VRAM a decode leaves
    idle, staging_pool_bytes): the hottest experts not pinned by `counts` (none: spread evenly, as choose_pins),
    as many as the pool holds beside each layer's `slots` link/early experts (extras_regions). Used as pins by
    the decode once a prefill's staging is refilled with them."""
    per = expert_bytes(file)
    pool = staging_pool_bytes(file)
    if not per or not pool:
        return {}
    region = lambda i, n: align_up((slots + n) * per[i], WEIGHT_ALIGN)    # noqa: E731  (extras_regions' size)
    used = sum(region(i, 0) for i in per)
    extras: dict = {}
    for e, i in _ranked_experts(file, per, counts, pins):
        n = len(extras.get(i, ()))
        grow = region(i, n + 1) - region(i, n)
        if used + grow > pool:
            continue
        extras.setdefault(i, []).append(e)
        used += grow
    return {i: sorted(v) for i, v in sorted(extras.items())}


def pins_drift(file, pins: dict, counts: dict) -> tuple[float, dict]:
    """How far the routing `counts` have drifted from `pins`: (pinned_share of the best pins for those counts in
    the same bytes - pinned_share of `pins`, those best pins)."""
    per = expert_bytes(file)
    used = sum(per[i] * len(v) for i, v in pins.items() if i in per)
    best = choose_pins(file, used + len(per) * ALLOC_GRANULE, counts) if used else {}
    return pinned_share(file, best, counts) - pinned_share(file, pins, counts), best


def merge_pins(pins: dict, extras: dict) -> dict:
    """The experts a hybrid decode runs on the GPU: pins and decode extras, {layer: sorted ids}."""
    return {i: sorted(set(pins.get(i, ())) | set(extras.get(i, ()))) for i in sorted(set(pins) | set(extras))}


def fill_pins(file, budget: int, n_ctx: int, chunk: int, int8: bool, counts: dict | None = None,
              link_experts: int = 0, early_experts: int = 0) -> tuple[dict, VramFootprint]:
    """The pins (choose_pins) that fill what `budget` leaves after everything else a streamed model of `file`
    allocates (passes of `chunk` tokens, link and early experts' staging) -> (pins, the footprint with them); no
    pins, and a footprint over the budget, when even none fit."""
    fp0 = vram_footprint(file, stream_experts=True, n_ctx=n_ctx, chunk=chunk, int8=int8, link_experts=link_experts,
                         early_experts=early_experts)
    pins = choose_pins(file, budget - fp0.total, counts) if fp0.total <= budget else {}
    return pins, vram_footprint(file, stream_experts=True, pinned=pins, n_ctx=n_ctx, chunk=chunk, int8=int8,
                                link_experts=link_experts, early_experts=early_experts)


def pinned_share(file, pins: dict, counts: dict | None = None) -> float:
    """The expected share of routed-expert work that lands on pinned experts (uniform routing: pins per layer /
    n_expert; with routing counts, the pinned experts' share of them), averaged over the MoE layers."""
    hp = file.hparams
    layers = list(layer_expert_bytes(file))
    if not layers or not hp.n_expert:
        return 0.0
    shares = []
    for i in layers:
        es = list(pins.get(i, ()))
        c = np.asarray(counts.get(i), dtype=float) if counts and counts.get(i) is not None else None
        if c is not None and c.sum() > 0:
            shares.append(float(c[es].sum() / c.sum()) if es else 0.0)
        else:
            shares.append(len(es) / hp.n_expert)
    return float(np.mean(shares))


def choose_link(m: Machine, file, pins: dict, counts: dict | None) -> int:
    """Experts per MoE layer the hybrid decode fetches over the link (LINK_COMMIT of the count that balances the
    CPU's time on the rest against the link's on these)."""
    hp = file.hparams
    per = list(layer_expert_bytes(file).values())
    if not per or not m.has_gpu or m.link_gbps <= 0 or m.cpu_read_gbps <= 0:
        return 0
    eb = sum(per) / len(per) / hp.n_expert
    u = hp.n_expert_used * (1 - pinned_share(file, pins, counts))        # experts per layer not pinned
    t_cpu = eb / (m.cpu_read_gbps * 1e9 * HYBRID_CPU_EFF)
    t_link = eb / (m.link_gbps * 1e9 * LINK_FETCH_EFF)
    return max(0, min(hp.n_expert_used, int(LINK_COMMIT * u * t_cpu / (t_cpu + t_link))))


def _hybrid_decode(m: Machine, file, fpd, pins: dict, counts: dict | None, link: int = 0) -> tuple[float, dict]:
    """Seconds per token of the hybrid decode and its parts: the GPU's share (dense weights, shared expert, head,
    pinned experts at the GEMV rate, launches), the routed experts that are not pinned (per layer the longer of the
    CPU's share at the CPU decode rate and the `link` experts fetched over the link) and the per-layer exchange
    between them (the GPU's chain to the next routing); they run one after the other (only the shared, pinned and
    link experts overlap the CPU)."""
    hp = file.hparams
    n_moe = len(layer_expert_bytes(file))
    share = pinned_share(file, pins, counts)
    experts = fpd.parts.get("experts", 0)
    gpu = ((fpd.decode_bytes - experts + share * experts) / (m.gpu_gemv_gbps * 1e9)
           + GPU_DECODE_LAUNCHES_PER_LAYER * hp.n_layer * m.gpu_launch_us * 1e-6)
    cpu = (1 - share) * experts / (m.cpu_read_gbps * 1e9 * HYBRID_CPU_EFF)
    if link and n_moe:
        u = hp.n_expert_used * (1 - share)
        eb = experts / n_moe / hp.n_expert_used            # bytes of one routed expert's work (per token and layer)
        per_layer = max(max(u - link, 0.0) * eb / (m.cpu_read_gbps * 1e9 * HYBRID_CPU_EFF),
                        min(link, u) * eb / (m.link_gbps * 1e9 * LINK_FETCH_EFF))
        cpu = n_moe * per_layer
    host = n_moe * HYBRID_HOST_S_PER_LAYER
    return gpu + cpu + host, {"gpu": gpu, "cpu": cpu, "host": host, "pinned_share": share, "link_experts": link}


def _cpu_times(m: Machine, decode_bytes: int) -> tuple[float, float]:
    """(CPU decode s/token, CPU prefill s/token)."""
    t_tok = decode_bytes / (m.cpu_read_gbps * 1e9 * CPU_DECODE_EFF)
    return t_tok, t_tok / CPU_PREFILL_GAIN


def _gpu_prefill(m: Machine, file, fp_decode, n: int, chunk: int, stream: bool, pinned: dict) -> tuple[float, dict]:
    """Seconds to prefill n tokens on the GPU and where they go (compute, expert copies, overlap)."""
    hp = file.hparams
    per_tok_flops = 2 * (fp_decode.decode_params - fp_decode.head_params) / GPU_PREFILL_EFF
    compute = n * per_tok_flops / (m.gpu_gemm_tflops * 1e12) + 2 * fp_decode.head_params / (m.gpu_gemm_tflops * 1e12)
    parts = {"compute": compute, "copy": 0.0, "total": compute}
    if not stream or not hp.n_expert:
        return compute, parts
    # the split hands the sequence over both ways: GDN states and the new KV rows (SplitModel.forward)
    handoff = (state_bytes(hp, 0) + state_bytes(hp, n)) / (SPLIT_HANDOFF_GBPS * 1e9)   # up, then down
    copy_total, total = 0.0, handoff
    # bytes a chunk copies per layer when it routes to every expert: the unpinned experts
    unpinned = {i: (hp.n_expert - len(pinned.get(i, ()))) * (full // hp.n_expert)
                for i, full in layer_expert_bytes(file).items()}
    n_layers = len(unpinned)
    for c0 in range(0, n, chunk):
        c = min(chunk, n - c0)
        share = expected_distinct(hp.n_expert, hp.n_expert_used, c) / hp.n_expert
        overlap = share >= 0.5                     # gpu_model prefetches the layer ahead then
        layer_compute = c * per_tok_flops / (m.gpu_gemm_tflops * 1e12) / max(n_layers, 1)
        for b in unpinned.values():
            t_copy = share * b / (m.link_gbps * 1e9)
            copy_total += t_copy
            total += max(t_copy, layer_compute) if overlap else t_copy + layer_compute
    total += 2 * fp_decode.head_params / (m.gpu_gemm_tflops * 1e12)
    parts.update(copy=copy_total, handoff=handoff, total=total)
    return total, parts


def plan(file, m: Machine, vram: int | None, prompt: int, gen: int, n_ctx: int | None = None, chunk: int = 512,
         counts: dict | None = None) -> list[Strategy]:
    """Every strategy for this file on this machine, predicted; the first is the one to run (fastest that fits)."""
    from ..tools.bench import weight_footprint
    hp = file.hparams
    n_ctx = n_ctx or max(prompt + gen, 1)
    fpd = weight_footprint(file)
    cpu_dec, cpu_pre = _cpu_times(m, fpd.decode_bytes)
    out = [Strategy("cpu", True, f"{m.cpu_threads} CPU threads, weights in host RAM", 0, prompt * cpu_pre,
                    cpu_dec, {"cpu": prompt * cpu_pre})]
    if not m.has_gpu:
        out.append(Strategy("stream", False, "no usable GPU", 0))
        out.append(Strategy("hybrid", False, "no usable GPU", 0))
        out.append(Strategy("resident", False, "no usable GPU", 0))
        return _rank(out, gen)
    budget = m.vram_free if vram is None else vram
    int8 = m.gpu_tier == "dp4a"
    fp_res = vram_footprint(file, n_ctx=n_ctx, chunk=chunk, int8=int8)
    if fp_res.total <= budget:
        pre, parts = _gpu_prefill(m, file, fpd, prompt, chunk, False, {})
        n_launch = GPU_DECODE_LAUNCHES_PER_LAYER * hp.n_layer
        dec = fpd.decode_bytes / (m.gpu_gemv_gbps * 1e9) + n_launch * m.gpu_launch_us * 1e-6
        out.append(Strategy("resident", True, f"everything in VRAM: {fp_res.describe()}", fp_res.total, pre, dec,
                            parts))
    else:
        out.append(Strategy("resident", False, f"needs {fp_res.total / GiB:.2f} GiB of VRAM, budget "
                            f"{budget / GiB:.2f} GiB", fp_res.total))
    if hp.n_expert:
        best = None
        for c in STREAM_CHUNKS:                # a longer pass copies each layer's experts fewer times, pins fewer
            if c * hp.n_expert_used > 65535:
                continue
            pins, fp = fill_pins(file, budget, n_ctx, c, int8, counts)
            if fp.total > budget:
                continue
            pre, parts = _gpu_prefill(m, file, fpd, prompt, c, True, pins)
            if best is None or pre < best[0]:
                best = (pre, parts, c, pins, fp)
        if best is not None:
            pre, parts, c, pins, fp = best
            n_pin = sum(len(v) for v in pins.values())
            st = Strategy("stream", True, f"dense weights in VRAM, {n_pin} of {hp.n_expert * len(fp.expert_bytes)} "
                          f"experts pinned, the rest copied per layer at {m.link_gbps:.1f} GB/s, passes of {c} "
                          f"tokens: {fp.describe()}", fp.total, pre, cpu_dec, parts, pins, chunk=c)
            st.min_gpu_tokens = crossover(m, file, fpd, c, pins, cpu_pre)
            if prompt < st.min_gpu_tokens:       # the split runs short prompts on the CPU
                st.prefill_s, st.prefill_parts = prompt * cpu_pre, {"cpu": prompt * cpu_pre}
            out.append(st)
            # the same placement with the hybrid decode: short passes run as hybrid steps, token by token; with
            # link experts, their staging comes out of the pins
            link = choose_link(m, file, pins, counts)
            hpins, hfp = fill_pins(file, budget, n_ctx, c, int8, counts, link) if link else (pins, fp)
            hpre, hpre_parts = (pre, parts) if hpins is pins else _gpu_prefill(m, file, fpd, prompt, c, True, hpins)
            extras = choose_decode_extras(file, hpins, counts, link)       # the staging's bytes between prefills
            hyb, hparts = _hybrid_decode(m, file, fpd, merge_pins(hpins, extras), counts, link)
            hyb0, hparts0 = _hybrid_decode(m, file, fpd, hpins, counts, link)
            per = expert_bytes(file)
            refill_s = sum(per[i] * len(v) for i, v in extras.items()) / (m.link_gbps * 1e9)
            if max(gen, EXTRAS_MIN_GEN) * (hyb0 - hyb) <= refill_s:     # not worth their copy after each prefill
                extras, hyb, hparts = {}, hyb0, hparts0
            link_why = (f", {link} more per layer fetched over the link to the GPU" if link else "")
            hy = dataclasses.replace(st, name="hybrid", decode_s_per_tok=hyb, decode_parts=hparts, pinned=hpins,
                                     vram=hfp.total, link_experts=link, decode_extras=extras,
                                     why=st.why + f"; decode hybrid: {hparts['pinned_share']:.0%} of the routed "
                                     f"experts' work on the GPU (pinned, and {sum(map(len, extras.values()))} more "
                                     f"kept in the staging between prefills){link_why}, the rest on the CPU")
            hy.min_gpu_tokens = crossover(m, file, fpd, c, hpins, hyb)
            # the same passes without the handoff: the hybrid split keeps the sequence on the GPU
            hy.prefill_s = hpre - hpre_parts["handoff"]
            hy.prefill_parts = dict(hpre_parts, handoff=0.0, total=hpre_parts["total"] - hpre_parts["handoff"])
            if prompt < hy.min_gpu_tokens:
                hy.prefill_s, hy.prefill_parts = prompt * hyb, {"hybrid steps": prompt * hyb}
            out.append(hy)
        else:
            fp0 = vram_footprint(file, stream_experts=True, n_ctx=n_ctx, chunk=STREAM_CHUNKS[-1], int8=int8)
            why = (f"even without pinned experts it needs {fp0.total / GiB:.2f} GiB of VRAM ({fp0.describe()}), "
                   f"budget {budget / GiB:.2f} GiB")
            out += [Strategy("stream", False, why, fp0.total), Strategy("hybrid", False, why, fp0.total)]
    else:
        out += [Strategy("stream", False, "a dense model has no experts to stream", 0),
                Strategy("hybrid", False, "a dense model has no experts to split", 0)]
    return _rank(out, gen)


def crossover(m: Machine, file, fpd, chunk: int, pins: dict, cpu_pre: float) -> int:
    """The shortest pass worth running on the GPU (its prefill, copies included, beats cpu_pre seconds per token:
    the CPU's, or the hybrid step's); 1 << 30 when none up to 64k tokens does."""
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        if _gpu_prefill(m, file, fpd, n, chunk, True, pins)[0] < n * cpu_pre:
            return n
    return 1 << 30


def _rank(strategies: list[Strategy], gen: int) -> list[Strategy]:
    return sorted(strategies, key=lambda s: (not s.fits, s.total_s(gen)))


class DescribedFile:
    """A model file described, not read: make-model's tensor plan for a preset and quant (what `plan --preset`
    and the planner tests use; the planner needs only hparams and tensor types/shapes)."""

    def __init__(self, preset: str, quant: str | None = None, layers: int | None = None):
        from ..format.gguf_file import TensorInfo
        from ..tools.make_model import PRESETS, plan_tensors, preset_hparams
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        self.hparams = preset_hparams(preset, layers)
        quant = quant or PRESETS[preset].get("quant", "q4_k_m")
        specs, _ = plan_tensors(self.hparams, quant)
        self.tensors = {s.name: TensorInfo(s.name, int(s.qtype), tuple(s.ne), s.n_bytes, 0) for s in specs}
        self.name = f"{preset} {quant}" + (f" ({layers} layers)" if layers else "")


# ================================================================================================ command line

def print_plan(name: str, m: Machine, strategies: list[Strategy], prompt: int, gen: int, vram: int | None) -> None:
    link = f"{m.link_gbps:.2f} GB/s{' (simulated)' if m.simulated_link else ''}"
    gpu_line = (f"GPU {m.gpu_name} ({m.gpu_tier} tier): {m.vram_free / GiB:.1f} GiB free, link {link}, GEMM "
                f"{m.gpu_gemm_tflops:.1f} TFLOP/s, GEMV {m.gpu_gemv_gbps:.0f} GB/s, {m.gpu_launch_us:.1f} µs/kernel"
                if m.has_gpu else "GPU none")
    print(f"{name}: prompt {prompt}, generate {gen}, VRAM budget "
          f"{'all free' if vram is None else f'{vram / GiB:.2f} GiB'}")
    print(f"CPU {m.cpu_threads} threads, {m.cpu_read_gbps:.1f} GB/s read; {gpu_line}")
    print(m.probe_note())
    print(f"{'strategy':<10}{'fits':>5}{'prefill tok/s':>15}{'decode tok/s':>14}{'total s':>10}  placement / why")
    for s in strategies:
        pre = prompt / s.prefill_s if s.fits and s.prefill_s > 0 else float("nan")
        dec = 1 / s.decode_s_per_tok if s.fits else float("nan")
        tot = f"{s.total_s(gen):>10.2f}" if s.fits else f"{'–':>10}"
        print(f"{s.name:<10}{'yes' if s.fits else 'no':>5}{pre:>15.1f}{dec:>14.1f}{tot}  {s.why}")
    best = strategies[0]
    print(f"chosen: {best.name}", end="")
    if best.name in ("stream", "hybrid"):
        parts = best.prefill_parts
        print(f" (GPU prefill for passes of >= {best.min_gpu_tokens} tokens; predicted prefill time: copies "
              f"{parts.get('copy', 0):.2f} s, compute {parts.get('compute', 0):.2f} s, handoff "
              f"{parts.get('handoff', 0):.3f} s, overlapped per layer when a chunk routes to most experts; decode "
              + ("on the CPU)" if best.name == "stream" else
                 "hybrid: {gpu:.1f} ms GPU + {cpu:.1f} ms CPU + {host:.1f} ms host steps per token)".format(
                     **{k: 1e3 * v for k, v in best.decode_parts.items() if k != "pinned_share"})))
    else:
        print()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import dataclasses as dc
    import json
    ap = argparse.ArgumentParser(prog="legacy-engine plan", description="Measure this machine (cached) and print the "
                                 "predicted prefill/decode speed of every strategy for MODEL, and the one chosen.")
    ap.add_argument("model", nargs="?", help="a GGUF file (or --preset)")
    ap.add_argument("--preset", help="plan for a make-model preset instead of a file (e.g. qwen3.6-35b-a3b)")
    ap.add_argument("--quant", default=None, help="with --preset: the quant mix (default: the preset's)")
    ap.add_argument("--vram", default=None, help="VRAM budget, e.g. 6GiB (default: what is free now)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (2048)")
    ap.add_argument("--gen", type=int, default=256, help="generated tokens (256)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU decode threads (default: physical cores)")
    ap.add_argument("--simulate-link", type=float, default=None, metavar="GBPS",
                    help="plan as if host->device copies ran at GBPS (0.25: a CMP 100-210 on PCIe Gen1 x1; 6: a Fermi "
                         "box on PCIe 2.0 x16)")
    ap.add_argument("--no-gpu", action="store_true", help="plan for this machine without its GPU")
    ap.add_argument("--remeasure", action="store_true", help="probe the machine again instead of the cached numbers")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.preset):
        ap.error("give MODEL or --preset")
    if args.prompt < 1 or args.gen < 0:
        ap.error("--prompt must be >= 1 and --gen >= 0")
    if args.simulate_link is not None and args.simulate_link <= 0:
        ap.error("--simulate-link must be > 0")
    vram = parse_size(args.vram) if args.vram is not None else None
    if args.preset:
        f = DescribedFile(args.preset, args.quant)
        name = f.name
    else:
        from ..format.gguf_model import ModelFile
        f = ModelFile.open(args.model)
        name = args.model
    m = measure(args.threads, gpu=not args.no_gpu, refresh=args.remeasure,
                log=lambda s: print(s, file=__import__("sys").stderr))
    if args.simulate_link is not None:
        m = dc.replace(m, link_gbps=args.simulate_link, simulated_link=True)
    counts = None if args.preset else load_routing(f)
    ss = plan(f, m, vram, args.prompt, args.gen, counts=counts)
    if args.json:
        print(json.dumps({"machine": dc.asdict(m), "strategies": [dc.asdict(s) for s in ss]}, indent=1,
                         default=float))
    else:
        print_plan(name, m, ss, args.prompt, args.gen, vram)
        print("pinned experts: " + ("the hottest by this file's saved routing counts" if counts else
                                    "spread evenly (no routing counts saved for this file yet)"))
    return 0


# ================================================================================================ the engine's choice

VRAM_MARGIN = 512 * MiB      # left free when no budget is given (the driver, other processes, fragmentation)
STREAM_CHUNKS = (2048, 1024, 512, 256)   # pass lengths the planner tries for streamed prefill


@dataclasses.dataclass
class Placement:
    stream: bool                # routed experts streamed (split: GPU prefill, CPU decode) or everything resident
    budget: int                 # bytes
    pinned: dict
    min_gpu_tokens: int
    footprint: VramFootprint
    why: str
    chunk: int = 512
    decode: str = "gpu"         # resident: "gpu"; streamed: "cpu" (CPU decode) or "hybrid" (GpuModel cpu_experts)
    link_experts: int = 0       # hybrid: GpuModel link_experts
    decode_extras: dict = dataclasses.field(default_factory=dict)   # hybrid: GpuModel decode_extras


DECODES = ("auto", "cpu", "hybrid")


def gpu_placement(model, vram: int | None = None, n_ctx: int = 4096, int8: bool = True,
                  min_gpu_tokens: int | None = None, machine: Machine | None = None,
                  counts: dict | None = None, decode: str = "auto") -> Placement:
    """Where a GPU run of `model` puts its weights under `vram` (default: free VRAM minus VRAM_MARGIN): resident
    when everything fits, else (MoE) dense weights resident + experts streamed with the budget left pinned, the
    GPU prefilling passes of >= min_gpu_tokens (default: the crossover predicted from `machine`, measured once and
    cached). decode (streamed placements): 'cpu', 'hybrid', or 'auto' = the one predicted faster. PlanningError
    when nothing fits."""
    if decode not in DECODES:
        raise ValueError(f"decode = {decode!r}: one of {', '.join(DECODES)}")
    from .. import gpu
    gpu.init()
    file = model.file
    budget = int(vram) if vram is not None else max(0, gpu.mem_stats()["free_bytes"] - VRAM_MARGIN)
    fp = vram_footprint(file, n_ctx=n_ctx, int8=int8)
    if fp.total <= budget:
        return Placement(False, budget, {}, 1, fp, f"resident: {fp.describe()} in a budget of {budget / GiB:.2f} GiB",
                         512)
    if not file.hparams.n_expert:
        raise PlanningError(f"the model needs {fp.total / GiB:.2f} GiB of VRAM ({fp.describe()}), the budget is "
                            f"{budget / GiB:.2f} GiB, and a dense model has no experts to stream: run it on the CPU "
                            "(without --gpu)")
    m = machine
    if m is None:
        m = measure(model.n_threads)
    if counts is None:
        counts = load_routing(model)
    strategies = {s.name: s for s in plan(file, m, budget, 2048, 0, n_ctx=n_ctx, counts=counts)}
    st = strategies["stream"]
    if not st.fits:
        raise PlanningError(f"streamed GPU model: {st.why}")
    hy = strategies["hybrid"]
    if decode == "auto":
        decode = "hybrid" if hy.decode_s_per_tok < st.decode_s_per_tok else "cpu"
        dec_why = (f"decode {decode} (predicted {1 / hy.decode_s_per_tok:.1f} tok/s hybrid, "
                   f"{1 / st.decode_s_per_tok:.1f} tok/s on the CPU)")
    else:
        dec_why = f"decode {decode} (asked)"
    if decode == "hybrid":
        st = hy
    pins, chunk, link = st.pinned, st.chunk, st.link_experts if decode == "hybrid" else 0
    extras = st.decode_extras if decode == "hybrid" else {}
    fps = vram_footprint(file, stream_experts=True, pinned=pins, n_ctx=n_ctx, chunk=chunk, int8=int8,
                         link_experts=link)
    if min_gpu_tokens is None:
        min_gpu_tokens = st.min_gpu_tokens
    n_pin = sum(len(v) for v in pins.values())
    how = "the hottest by the saved routing counts" if counts else "spread evenly: no routing statistics yet"
    return Placement(True, budget, pins, int(min_gpu_tokens), fps,
                     f"streamed experts ({n_pin} pinned, {how}): {fps.describe()} in a budget of "
                     f"{budget / GiB:.2f} GiB; "
                     f"GPU prefill for passes of >= {min_gpu_tokens} tokens ({chunk} per pass); {dec_why}"
                     + (f", {link} experts per layer fetched over the link" if link else "")
                     + (f", {sum(map(len, extras.values()))} more kept in the staging for the decode" if extras else ""),
                     chunk, decode, link, extras)


# ================================================================================================ routing statistics

ROUTING_DIR = "routing"      # $LE_CACHE_DIR/routing/<model fingerprint>.json: {layer: [count per expert]}


def routing_path(model) -> str:
    import os

    from ..serve.cache import model_fingerprint
    from ..core.paths import cache_dir
    d = os.path.join(cache_dir(), ROUTING_DIR)
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, model_fingerprint(model).hex()[:32] + ".json")


def load_routing(model) -> dict | None:
    """The routing counts saved for this model file ({layer: np.ndarray[n_expert]}), or None. model: a Model or a
    ModelFile. A file that does not fit the model (layers, experts) or does not parse is ignored (counts are advice,
    never required)."""
    import json
    import os
    path = routing_path(model)
    if not os.path.exists(path):
        return None
    hp = getattr(model, "file", model).hparams
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        out = {int(k): np.asarray(v, dtype=np.int64) for k, v in raw.items()}
    except (OSError, ValueError, TypeError):
        return None
    if any(not 0 <= i < hp.n_layer or v.shape != (hp.n_expert,) or (v < 0).any() for i, v in out.items()):
        return None
    return out


def save_routing(model, counts: dict) -> str:
    """Adds `counts` ({layer: counts per expert}) to the saved statistics of this model file; returns the path."""
    import json
    import os
    old = load_routing(model) or {}
    total = {i: (old.get(i, 0) + np.asarray(c, dtype=np.int64)) for i, c in counts.items()}
    for i, c in old.items():
        total.setdefault(i, c)
    path = routing_path(model)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({str(i): [int(x) for x in c] for i, c in sorted(total.items())}, f)
    os.replace(path + ".tmp", path)
    return path
