"""The tensor schema of each architecture, as the C core states it (native/schema.c, le_schema.h).

One table names every tensor a Qwen3.5-family GGUF holds: the architectures and layers that hold it, the weight slot
it fills, its shape as a rule over the hyperparameters, the rows a slot takes of a fused tensor, and whether it is
read as f32 or is a routed expert. Everything that reads tensors reads this: the file check (`groups`, via
gguf_model.check_schema), the CPU loader and the GPU upload (`weights`: which tensor fills each slot of a layer),
the planner and the streaming (gpu/layout.expert_tensors), make-model (gguf_model.expected_tensors).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core import _native
from ..core.errors import FormatError

ARCHITECTURES = _native.schema_arch_names()
_ROWS = tuple(_native.schema_rows())
_L = _native.lib
F32, EXPERT, OPTIONAL = _L.LE_T_F32, _L.LE_T_EXPERT, _L.LE_T_OPTIONAL
ONE, ZERO = _L.LE_D_ONE, _L.LE_D_ZERO


def _slot_name(slot: int) -> str:
    # a slot is named by its standard tensor (its first row): "attn_q" for attn_q.weight
    name = next(r["name"] for r in _ROWS if r["slot"] == slot)
    return name.removesuffix(".weight").removesuffix(".bias")


SLOT_NAMES = {r["slot"]: _slot_name(r["slot"]) for r in _ROWS if r["slot"] >= 0}

# le_hparams field -> the GGUF key (after "{arch}.") it comes from, for error messages
HPARAM_KEYS = {"n_layer": "block_count", "n_embd": "embedding_length", "n_head": "attention.head_count",
               "n_head_kv": "attention.head_count_kv", "head_dim": "attention.key_length",
               "n_rot": "rope.dimension_count", "ssm_conv_kernel": "ssm.conv_kernel", "ssm_d_state": "ssm.state_size",
               "ssm_n_group": "ssm.group_count", "ssm_dt_rank": "ssm.time_step_rank", "ssm_d_inner": "ssm.inner_size",
               "n_ff": "feed_forward_length", "n_expert": "expert_count", "n_expert_used": "expert_used_count",
               "n_ff_exp": "expert_feed_forward_length", "n_ff_shexp": "expert_shared_feed_forward_length"}


def native_hparams(hp, faults: dict | None = None) -> dict:
    """The le_hparams fields of a file's hyperparameters; FormatError for a value no C int holds (a hostile
    file: n_vocab = 2**31 rows of token_embd.weight, say), before anything reaches the C core."""
    c = dict(n_layer=hp.n_layer, n_embd=hp.n_embd, n_vocab=hp.n_vocab, n_head=hp.n_head,
             n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_rot=hp.n_rot, rope_theta=hp.rope_theta,
             rms_eps=hp.rms_eps, ssm_conv_kernel=hp.ssm_conv_kernel, ssm_d_state=hp.ssm_d_state,
             ssm_n_group=hp.ssm_n_group, ssm_dt_rank=hp.ssm_dt_rank, ssm_d_inner=hp.ssm_d_inner,
             gdn_tiled=0 if (faults or {}).get("gdn_grouped") else 1, n_ff=hp.n_ff, n_expert=hp.n_expert,
             n_expert_used=hp.n_expert_used, n_ff_exp=hp.n_ff_exp, n_ff_shexp=hp.n_ff_shexp,
             faults=_native.fault_bits(faults or {}))
    for k, v in c.items():
        if isinstance(v, int) and not 0 <= v <= _native.INT_MAX:
            src = "rows of token_embd.weight" if k == "n_vocab" else f"{hp.arch}.{HPARAM_KEYS.get(k, k)}"
            raise FormatError(f"{k} = {v} ({src}) is more than this engine handles ({_native.INT_MAX}, a C int)")
    return c


# One group = alternatives; each alternative maps tensor name -> ne (ggml order).
Alternative = dict[str, tuple[int, ...]]


@dataclass
class Group:
    what: str
    alternatives: list[Alternative]
    optional: bool = False


@dataclass(frozen=True)
class Weight:
    """One weight slot of one layer and the file tensor that fills it."""
    slot: str                       # the C slot's name ("attn_q"): the GPU layer's key too
    slot_id: int                    # its le_weight_slot
    tensor: str                     # the GGUF name, "blk.3.attn_qkv.weight"
    rows: tuple[int, int] | None    # the ne1 range it takes of a fused tensor (of every expert where 3-D)
    f32: bool                       # read as an f32 array (norms, conv taps, gates)
    expert: bool                    # routed experts [n_expert, rows, cols]


@functools.lru_cache(maxsize=16)
def _resolved(hp) -> tuple[tuple[int, ...], int, dict]:
    """(dims, the architecture's bit, {recurrent flag or None: layer kinds}) of a model's hyperparameters."""
    c = native_hparams(hp)
    kinds = {r: _native.layer_kinds(c, r) for r in (None, True, False)}
    return _native.schema_dims(c), 1 << ARCHITECTURES.index(hp.arch), kinds


def _rows(hp, layer: int):
    """(prefix, dims, the table's rows that layer `layer` (-1: the global tensors) of this model holds)."""
    dims, arch, kinds = _resolved(hp)
    k = kinds[None if layer < 0 else bool(hp.recurrent[layer])]
    prefix = "" if layer < 0 else f"blk.{layer}."
    return prefix, dims, [r for r in _ROWS if r["archs"] & arch and r["kind"] & k]


def _shape(dims, ne: tuple[int, ...]) -> tuple[int, ...]:
    # trailing unused dimensions (LE_D_ONE) are not part of the shape: [E] not [E, 1, 1]
    n = len(ne)
    while n > 1 and ne[n - 1] == ONE:
        n -= 1
    return tuple(dims[d] for d in ne[:n])


def groups(hp, layer: int) -> list[Group]:
    """What layer `layer` (-1: the global tensors) must hold (spec §3.3), group by group; each group's first
    alternative is the standard layout."""
    prefix, dims, rows = _rows(hp, layer)
    out: dict[str, Group] = {}
    for r in rows:
        g = out.setdefault(r["group"], Group(r["group"], [], optional=bool(r["flags"] & OPTIONAL)))
        while len(g.alternatives) <= r["alt"]:
            g.alternatives.append({})
        g.alternatives[r["alt"]][prefix + r["name"]] = _shape(dims, r["ne"])
    return list(out.values())


def weights(hp, layer: int, tensors) -> list[Weight]:
    """The slots of layer `layer` (-1: the global ones) this engine runs, each with the tensor that fills it in a
    file holding `tensors` (names): per group the first alternative the file holds (gguf_model.check_schema's
    choice). Tensors of no slot (qwen3next's fused ssm_in/ssm_ba) are left out."""
    prefix, dims, rows = _rows(hp, layer)
    chosen: dict[str, int] = {}
    for g in groups(hp, layer):
        pick = next((k for k, alt in enumerate(g.alternatives) if alt and all(n in tensors for n in alt)), None)
        if pick is not None:
            chosen[g.what] = pick
    out = []
    for r in rows:
        if r["slot"] < 0 or chosen.get(r["group"]) != r["alt"]:
            continue
        lo, hi = r["rows"]
        out.append(Weight(SLOT_NAMES[r["slot"]], r["slot"], prefix + r["name"],
                          None if hi == ZERO else (dims[lo], dims[hi]), bool(r["flags"] & F32),
                          bool(r["flags"] & EXPERT)))
    return out

