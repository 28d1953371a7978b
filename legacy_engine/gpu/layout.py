"""VRAM accounting of a GPU model (`vram_footprint`): every device allocation a GPU model of a file makes: the resident
weights (one allocation, `weight_layout`), pinned experts, the expert staging buffers of streamed prefill
(STAGING_LAYERS; where the hybrid decode keeps its extras between prefills: `extras_regions`), the states of a
context, the rope table and the scratch of a prefill chunk (the blocks' buffers in one arena: `block_scratch`) and of
a decode step. The planner checks a placement against its budget with it (`check_fits`: PlanningError naming the
parts), the GPU model lays its allocations out by the same functions, and the driver layer enforces the budget."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..core.errors import PlanningError
from ..format.schema import weights
from .launch import ATTN_MAX_SPLIT, F32, GDNC_C, GPU_TYPES, Q8_1_BYTES, attn_planes_bytes


GiB = 2**30
MiB = 2**20
# Scratch that is not one of the named buffers (driver-side rounding of cuMemAlloc to 2 MiB pages for the large
# buffers, the argmax partials, small launch temporaries): a fixed allowance, checked by the GPU tests (peak use
# after a prefill chunk and decode steps stays under the footprint's total).
SCRATCH_SLACK = 32 * MiB
ALLOC_GRANULE = 2 * MiB
# Streamed prefill: layers' experts in the staging at once. Two keep the link busy the whole pass (measured: the
# copy stream idle < 1 ms of a 2048-token pass of the 35B-A3B); a third costs pins (benchmarks/split_timeline.py).
STAGING_LAYERS = 2


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
    t = file.tensors.get("token_embd.weight")
    return bool(stream_experts and t is not None and "output.weight" in file.tensors
                and (t.type == F32 or t.type in GPU_TYPES))


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


def expert_tensors(file, layer: int) -> list[str]:
    """The routed-expert tensors of a layer ([n_expert, rows, cols] each): the file's alternative, in the schema's
    order."""
    return list(dict.fromkeys(w.tensor for w in weights(file.hparams, layer, file.tensors) if w.expert))


def f32_routers(file) -> bool:
    """Whether every router of `file` is f32 (as in every llama.cpp file): the hybrid decode predicts the next MoE
    layer's routing with it (lookahead, early experts)."""
    routers = [file.tensors.get(f"blk.{i}.ffn_gate_inp.weight") for i in range(file.hparams.n_layer)]
    return all(t is None or t.type == 0 for t in routers)


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
    if t.type == F32 or t.type in GPU_TYPES:
        return int(t.n_bytes)
    return 4 * int(np.prod(t.ne))


@dataclasses.dataclass(frozen=True)
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


# Rows of logits one head pass computes (the GPU model runs a longer all_logits request in pieces): 512 for a resident
# model; 32 where experts stream, whose VRAM is better spent on pinned experts (each GiB pinned is a GiB less to copy
# per pass; 512 rows of a 248k vocabulary are 0.47 GiB, the head's pieces cost ~0.15 ms each on an H100).
LOGIT_ROWS, STREAM_LOGIT_ROWS = 512, 32


def head_rows(chunk: int, stream: bool) -> int:
    """Rows of logits per head pass of a GPU model with passes of `chunk` tokens."""
    return min(chunk, STREAM_LOGIT_ROWS if stream else LOGIT_ROWS)


ARENA_ALIGN = 256        # each buffer of the prefill's block arena starts at a multiple of it (scratch.Scratch)


def gdn_chunk_work(hp, n: int) -> dict:
    """The chunked GDN's buffers for n tokens (Kernels.gdn_chunked's work, in that order): W [n, Hv, dk], U [n, Hv, dv],
    P [chunks, Hv, C, C], G [n, Hv], f32."""
    Hv, C = hp.ssm_dt_rank, GDNC_C
    return {"cw": 4 * n * Hv * hp.ssm_d_state, "cu": 4 * n * hp.ssm_d_inner, "cp": 4 * -(-n // C) * Hv * C * C,
            "cg": 4 * n * Hv}


def block_scratch(hp, n: int, int8: bool) -> dict:
    """The scratch buffers of each block of a layer in a pass of n tokens, {block: {buf name: bytes}} (the forward
    ops' names; "ed" and "xg" are one buffer: the pairs' rows, unsorted or sorted). A block reads h and writes y, so
    none of its buffers outlives it: a pass of n > 1 tokens puts each block's buffers in one allocation shared by
    the blocks (arena_bytes), a decode step keeps them apart (plans name them)."""
    E, k = hp.n_embd, max(hp.n_expert_used, 1)
    blocks = {}
    if any(hp.recurrent):
        cd = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
        blocks["gdn"] = {"qkv": 4 * n * cd, "u": 4 * n * cd, "z": 4 * n * hp.ssm_d_inner,
                         "o": 4 * n * hp.ssm_d_inner, "beta": 4 * n * hp.ssm_dt_rank, "g": 4 * n * hp.ssm_dt_rank}
        if int8 and n == 1:      # o's Q8_1 (a decode step's gated norm writes it for the out projection)
            blocks["gdn"]["oq"] = hp.ssm_d_inner // 32 * Q8_1_BYTES
        if n > 1:                # the chunked form's W, U, P and G (cuda8/gdn_chunked.cu)
            blocks["gdn"] |= gdn_chunk_work(hp, n)
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
            moe |= {"xq_tok": pairs * E // 32 * Q8_1_BYTES, "xq_down": pairs * ff // 32 * Q8_1_BYTES}
        if hp.n_ff_shexp:
            fs = hp.n_ff_shexp
            moe |= {"sg": 4 * n * fs, "su": 4 * n * fs, "sh": 4 * n * E, "shg": 4 * n}
        blocks["moe"] = moe
    else:
        blocks["ffn"] = {"ffg": 4 * n * hp.n_ff, "ffu": 4 * n * hp.n_ff}
    return blocks


ARENA_NAMES = {"qkv": "gdn", "u": "gdn", "z": "gdn", "o": "gdn", "beta": "gdn", "g": "gdn", "oq": "gdn",
               "cw": "gdn", "cu": "gdn", "cp": "gdn", "cg": "gdn",
               "qg": "attention", "ao": "attention", "router": "moe", "ids": "moe", "wts": "moe", "eg": "moe",
               "eu": "moe", "xg": "moe", "ed": "moe", "pair_meta": "moe", "xq_tok": "moe", "xq_down": "moe",
               "sg": "moe", "su": "moe", "sh": "moe", "shg": "moe", "ffg": "ffn", "ffu": "ffn"}
# (the names above: Scratch.buf's scratch of a pass's blocks, each in its block of block_scratch)


def arena_bytes(hp, n: int, int8: bool) -> int:
    """The prefill's block arena for passes of n tokens: the largest block's buffers, each ARENA_ALIGN-aligned."""
    return max((sum(align_up(b, ARENA_ALIGN) for b in blk.values())
                for blk in block_scratch(hp, n, int8).values()), default=0)


def scratch_bytes(hp, n: int, int8: bool, logit_rows: int) -> int:
    """The named scratch buffers of one forward pass of n tokens (the GPU model's Scratch.buf calls), logits for logit_rows:
    the blocks' buffers in one arena when n > 1 (arena_bytes), apart in a decode step."""
    E = hp.n_embd
    b = 4 * n + 3 * 4 * n * E                    # tokens; x, h, y
    if n == 1 and not all(hp.recurrent):         # a decode step's k and v rows and its split-K partials
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        b += 2 * 4 * nkv * hd + 4 * nh * ATTN_MAX_SPLIT * (hd + 2)
    if hp.n_expert:
        b += 4 * hp.n_layer * hp.n_expert        # the routing counts
    if int8:       # Q8_1 rows of n tokens: the normed h (hq), another shared input (xq), a matmul's own (xq_mm)
        b += 4 * n * max(E, hp.ssm_d_inner, hp.n_ff, hp.n_ff_shexp, hp.n_ff_exp, hp.n_head * hp.head_dim) // 32 \
            * Q8_1_BYTES
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
    """One layer's pin store (residency.Residency): its n pinned experts, padding to 16 bytes, then the copy kernel's lists
    (int32 [2, n]: ranks, expert ids); 0 without pins."""
    body = n * expert_bytes
    return body + -body % 16 + 8 * n if n else 0


def vram_footprint(file, *, stream_experts: bool = False, pinned: dict | None = None, n_ctx: int = 4096,
                   chunk: int = 512, int8: bool = True, logit_rows: int | None = None,
                   link_experts: int = 0, early_experts: int = 0) -> VramFootprint:
    """What a GPU model of `file` allocates. stream_experts: routed experts stay in host RAM except `pinned`
    {layer: [expert ids]}; STAGING_LAYERS staging buffers of the largest layer's experts. logit_rows: rows of logits
    a head pass computes (default head_rows). link_experts: the hybrid decode's staging of experts fetched per
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
        parts[f"expert staging ({STAGING_LAYERS} layers)"] = STAGING_LAYERS * _round(layer_max)
        if link_experts or early_experts:
            parts["link staging"] = _round((link_experts + early_experts) * max(per_expert.values()))
        if early_experts:
            one = max(gpu_tensor_bytes(file.tensors[n]) // hp.n_expert
                      for i in per_expert for n in expert_tensors(file, i))
            parts["early buffer"] = _round(6 * early_experts * one)
    parts["state"] = state_bytes(hp, n_ctx)
    if not all(hp.recurrent):   # the tensor-core attention prefill's f16 hi / lo planes of the context's keys (counted
        parts["attention planes"] = _round(attn_planes_bytes(n_ctx, hp.n_head_kv, hp.head_dim))   # on every tier)
    rows = head_rows(chunk, stream_experts) if logit_rows is None else logit_rows
    parts["scratch"] = (_round(scratch_bytes(hp, chunk, int8, rows)) + _round(scratch_bytes(hp, 1, int8, 1))
                        + SCRATCH_SLACK)
    return VramFootprint(parts, per_expert, layer_max)


def check_fits(fp: VramFootprint, budget: int, what: str = "this placement") -> None:
    if fp.total > budget:
        raise PlanningError(f"{what} needs {fp.total / GiB:.2f} GiB of VRAM, the budget is {budget / GiB:.2f} GiB: "
                            f"{fp.describe()}")


def staging_pool_bytes(file) -> int:
    """Bytes of the streamed prefill's expert staging (STAGING_LAYERS layers' worth, one allocation): idle between
    prefills, where the hybrid decode keeps its extras (choose_decode_extras)."""
    per = layer_expert_bytes(file)
    return STAGING_LAYERS * _round(max(per.values())) if per else 0


def extras_regions(file, extras: dict, slots: int = 0) -> dict:
    """{layer: (offset, bytes)} of each MoE layer's region in the staging pool, packed in layer order: per expert
    tensor `slots` link/early experts then the layer's extras (WEIGHT_ALIGN-aligned); a layer with neither has
    none. The layout the GPU model uses."""
    out, at = {}, 0
    for i, eb in expert_bytes(file).items():
        n = slots + len(extras.get(i, ()))
        if n:
            out[i] = (at, align_up(n * eb, WEIGHT_ALIGN))
            at += out[i][1]
    return out


def expected_distinct(n_expert: int, k: int, n: int) -> float:
    """Expected number of distinct experts n tokens route to (uniform routing, k of n_expert each)."""
    if not n_expert:
        return 0.0
    return n_expert * (1 - (1 - k / n_expert) ** n)
