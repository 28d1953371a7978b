"""Where a GPU model puts everything, as immutable data: the Placement. The planner decides it (plan.planner:
gpu_placement, repin) and builds it with `place`; GpuModel applies it and decides nothing of it again.

A Placement names every tensor's residency and its offset in the weight allocation, the pinned experts, the hybrid
decode's link, early and extra experts and the extras' regions of the staging, the pass length, the context the
states were planned for, the VRAM budget and the footprint (layout.py) that fits it: `place` checks the fit
(PlanningError naming the parts), so a Placement with a budget fits it."""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from ..core.errors import UnavailableError
from .launch import HY_EARLY_MAX, MAX_PAIRS
from .layout import (VramFootprint, arena_bytes, check_fits, expert_tensors, extras_regions, f32_routers, head_rows,
                     host_embedding, resident_names, staging_pool_bytes, vram_footprint, weight_layout)

PREFILL_CHUNK = 512      # tokens per pass by default: bounds the scratch
MAX_CHUNK = 4096         # the most a GpuModel may be asked for (n*k MoE pairs <= MAX_PAIRS is checked too)
# A resident model's passes, longest first: the longest whose scratch fits the budget (resident_chunk). Longer passes
# give the GEMMs' grids more token tiles: 0.8B Q8_0 on an H200, pp2048 29.8k tok/s in passes of 2048 against 19.4k
# in passes of 512 (benchmarks/results/resident_prefill_2026-11-29.md).
RESIDENT_CHUNKS = (2048, 1024, 512)
DECODE_MODES = ("gpu", "cpu", "hybrid")
RESIDENCIES = ("resident", "streamed", "host")


@dataclasses.dataclass(frozen=True)
class Placement:
    """decode: "gpu" (everything resident: prefill and decode on the GPU), "cpu" (the routed experts streamed from
    host RAM for the GPU's prefill; the split decodes on the CPU) or "hybrid" (streamed prefill; decode steps split
    between the GPU and the CPU: GpuModel's hybrid decode).
    residency: every tensor the model runs -> "resident" (in the one weight allocation, at offsets[name]),
    "streamed" (routed experts left in host RAM: copied per pass into the staging, except the `pinned` experts,
    which live in VRAM) or "host" (read where it lies in page-locked host memory, over the link: layout
    host_embedding).
    pinned: streamed: layer -> expert ids kept in VRAM (pin stores).
    link_experts (hybrid): per layer and token, experts not pinned that the GPU fetches over the link into a small
    staging (the planner's choose_link); 0: the CPU runs every expert not pinned.
    early_experts (hybrid, f32 routers): per MoE layer, the next layer's likeliest experts not pinned the CPU copies
    into VRAM ahead (a copy stream of its own) while the GPU runs that layer's attention/GDN.
    decode_extras (hybrid): layer -> experts not pinned the decode keeps in the prefill's expert staging (idle
    between prefills) and runs on the GPU as it runs the pinned ones; extras_at: layer -> (offset, bytes) of its
    region of the staging pool (layout.extras_regions: its link/early slots, then its extras).
    chunk: tokens per pass; n_ctx: the longest state the budget was planned for; int8: the scratch planned for Q8_1
    activations; logit_rows: rows of logits a head pass computes; arena_bytes: the block arena of a pass of chunk
    tokens (a shorter pass takes less).
    budget: bytes the model may allocate (held by the driver layer while it lives), None: no budget.
    reserved: bytes of that budget kept for what runs beside the model (the vision tower: plan/vision.py); the
    model's footprint fits budget - reserved.
    min_gpu_tokens: the split runs passes of at least this many tokens on the GPU. why: the planner's reasons."""
    decode: str
    budget: int | None
    n_ctx: int
    chunk: int
    int8: bool
    residency: Mapping[str, str]
    offsets: Mapping[str, int]
    weight_bytes: int
    pinned: Mapping[int, tuple]
    link_experts: int
    early_experts: int
    decode_extras: Mapping[int, tuple]
    extras_at: Mapping[int, tuple]
    logit_rows: int
    arena_bytes: int
    footprint: VramFootprint
    min_gpu_tokens: int = 1
    why: str = ""
    reserved: int = 0

    @property
    def stream(self) -> bool:
        """The routed experts stream from host RAM (the split placements)."""
        return self.decode != "gpu"

    @property
    def cpu_experts(self) -> bool:
        """The hybrid decode: the routed experts not on the GPU run on the CPU."""
        return self.decode == "hybrid"


def _experts(what: str, v: dict | None, hp) -> dict:
    """{layer: sorted unique expert ids} of `v`, each inside the file's layers and experts (ValueError)."""
    out = {int(i): tuple(sorted(set(int(e) for e in es))) for i, es in (v or {}).items() if es}
    for i, es in out.items():
        if not 0 <= i < hp.n_layer or any(not 0 <= e < hp.n_expert for e in es):
            raise ValueError(f"{what}: layer {i} experts {list(es[:4])}… outside {hp.n_layer} layers x "
                             f"{hp.n_expert}")
    return out


def _check_settings(file, decode: str, chunk: int, link_experts: int, early_experts: int, pinned: dict,
                  extras: dict) -> None:
    """The pass length, and the settings only the hybrid decode (and f32 routers) has: ValueError / UnavailableError."""
    hp = file.hparams
    if not 1 <= chunk <= MAX_CHUNK or chunk * max(hp.n_expert_used, 1) > MAX_PAIRS:
        raise ValueError(f"chunk = {chunk}: 1…{MAX_CHUNK} tokens and chunk * experts per token <= {MAX_PAIRS}")
    if not 0 <= link_experts <= (hp.n_expert_used if hp.n_expert else 0):
        raise ValueError(f"link_experts = {link_experts}: 0 … n_expert_used")
    if link_experts and decode != "hybrid":
        raise ValueError("link_experts is a setting of the hybrid decode (cpu_experts=True)")
    if not 0 <= early_experts <= HY_EARLY_MAX:
        raise ValueError(f"early_experts = {early_experts}: 0 … {HY_EARLY_MAX}")
    if early_experts and decode != "hybrid":
        raise ValueError("early_experts is a setting of the hybrid decode (cpu_experts=True)")
    if early_experts and not f32_routers(file):      # the prediction runs the next layer's router in f32
        raise UnavailableError("early_experts: the next layer's routing is predicted with f32 routers only; this "
                               "file's are quantised")
    if extras and decode != "hybrid":
        raise ValueError("decode_extras is a setting of the hybrid decode (cpu_experts=True)")
    for i, es in extras.items():
        if set(es) & set(pinned.get(i, ())):
            raise ValueError(f"decode_extras: layer {i} experts {list(es[:4])}… outside {hp.n_layer} layers x "
                             f"{hp.n_expert}, or pinned")


def resident_chunk(file, budget: int | None = None, n_ctx: int = 4096, int8: bool = True) -> int:
    """The pass length of a resident model of `file`: the longest of RESIDENT_CHUNKS whose footprint (n_ctx
    positions, int8 scratch) fits `budget` bytes (None: no budget); the shortest when none does (place then says
    what does not fit)."""
    for chunk in RESIDENT_CHUNKS:
        fp = vram_footprint(file, n_ctx=n_ctx, chunk=chunk, int8=int8, logit_rows=head_rows(chunk, False))
        if budget is None or fp.total <= budget:
            return chunk
    return RESIDENT_CHUNKS[-1]


def place(file, *, budget: int | None = None, n_ctx: int = 4096, chunk: int = PREFILL_CHUNK, int8: bool = True,
          stream: bool = False, pinned: dict | None = None, decode: str | None = None, link_experts: int = 0,
          early_experts: int = 0, decode_extras: dict | None = None, min_gpu_tokens: int = 1,
          why: str = "", reserved: int = 0) -> Placement:
    """The complete Placement of a GPU model of `file` from the planner's decisions: stream (the routed experts
    stay in host RAM; a dense file has none to stream: resident), pinned {layer: expert ids}, decode ("gpu" when
    resident; "cpu" (default) or "hybrid" when streamed), the hybrid decode's link, early and extra experts, passes
    of `chunk` tokens, states of up to n_ctx positions, the scratch for Q8_1 activations (int8). With a budget, the
    footprint must fit it less `reserved` (bytes kept for the vision tower; PlanningError naming the parts)."""
    hp = file.hparams
    stream = bool(stream) and hp.n_expert > 0
    decode = decode or ("cpu" if stream else "gpu")
    if decode not in DECODE_MODES or (decode == "gpu") == stream:
        if decode == "hybrid":
            raise ValueError("cpu_experts (the hybrid decode) needs stream_experts and a MoE model")
        raise ValueError(f"decode = {decode!r} of a {'streamed' if stream else 'resident'} placement")
    chunk, link_experts, early_experts = int(chunk), int(link_experts), int(early_experts)
    pins = _experts("pinned", pinned, hp) if stream else {}
    extras = _experts("decode_extras", decode_extras, hp)
    _check_settings(file, decode, chunk, link_experts, early_experts, pins, extras)
    rows = head_rows(chunk, stream)
    fp = vram_footprint(file, stream_experts=stream, pinned=pins, n_ctx=n_ctx, chunk=chunk, int8=int8,
                        logit_rows=rows, link_experts=link_experts, early_experts=early_experts)
    if not 0 <= int(reserved) <= (int(budget) if budget is not None else 0):
        raise ValueError(f"reserved = {reserved}: 0 … the budget ({budget})")
    if budget is not None:
        what = f"{'streamed' if stream else 'resident'} GPU model" + (
            f" beside {int(reserved) / 2**30:.2f} GiB kept for the vision tower" if reserved else "")
        check_fits(fp, int(budget) - int(reserved), what)
    names = resident_names(file, stream)
    offsets, total = weight_layout(file, names)
    residency = dict.fromkeys(names, "resident")
    if stream:
        residency.update((n, "streamed") for i in range(hp.n_layer) for n in expert_tensors(file, i))
    if host_embedding(file, stream):
        residency["token_embd.weight"] = "host"
    at = extras_regions(file, extras, link_experts + early_experts) if extras else {}
    end = max((o + b for o, b in at.values()), default=0)
    if end > staging_pool_bytes(file):
        raise ValueError(f"decode_extras need {end} bytes of the {staging_pool_bytes(file)}-byte expert staging "
                         "(planner.choose_decode_extras fills it)")
    frozen = lambda d: MappingProxyType(dict(d))     # noqa: E731
    return Placement(decode, None if budget is None else int(budget), int(n_ctx), chunk, bool(int8),
                     frozen(residency), frozen(offsets), total, frozen(pins), link_experts, early_experts,
                     frozen(extras), frozen(at), rows, arena_bytes(hp, chunk, int8), fp, int(min_gpu_tokens), why,
                     int(reserved))
