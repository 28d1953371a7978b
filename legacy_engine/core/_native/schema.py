"""The tensor schema table of the C core (le_schema.h, native/schema.c): its rows, the architectures' names, a
model's dimensions and a layer's kinds."""
from __future__ import annotations

from ._lib import check, ffi, lib

HPARAM_FIELDS = ("n_layer", "n_embd", "n_vocab", "n_head", "n_head_kv", "head_dim", "n_rot", "rope_theta",
                 "rms_eps", "ssm_conv_kernel", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_d_inner",
                 "gdn_tiled", "n_ff", "n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp", "faults")
MAX_LAYERS = 512        # le_hparams.recurrent


def hparams_struct(hp: dict, recurrent, rope_sections=(0, 0, 0, 0)):
    """An le_hparams from the fields of HPARAM_FIELDS, the per-layer recurrent flags and the IMRoPE sections."""
    c = ffi.new("le_hparams *")
    for k in HPARAM_FIELDS:
        setattr(c, k, hp[k])
    for i, s in enumerate(rope_sections):
        c.rope_sections[i] = s
    for i, r in enumerate(recurrent):
        c.recurrent[i] = int(r)
    return c


def schema_rows() -> list[dict]:
    """Every row of the table, in its order: name, archs, kind, group, alt, slot, ne (3 LE_D_*), rows (2 LE_D_*),
    flags."""
    n = ffi.new("int *")
    t = lib.le_schema(n)
    return [dict(name=ffi.string(r.name).decode(), archs=r.archs, kind=r.kind, group=ffi.string(r.group).decode(),
                 alt=r.alt, slot=r.slot, ne=tuple(r.ne), rows=tuple(r.rows), flags=r.flags)
            for r in (t[i] for i in range(n[0]))]


def schema_arch_names() -> tuple[str, ...]:
    """The architectures' GGUF names; architecture i is the bit 1 << i of a row's archs."""
    return tuple(ffi.string(lib.le_schema_arch_name(i)).decode() for i in range(lib.LE_ARCH_COUNT))


def schema_dims(hp: dict) -> tuple[int, ...]:
    """[LE_D_COUNT] the value of each dimension symbol for a model of these le_hparams fields."""
    d = ffi.new("int64_t[]", lib.LE_D_COUNT)
    check(lib.le_schema_dims(hparams_struct(hp, ()), d), "le_schema_dims")
    return tuple(d)


def layer_kinds(hp: dict, recurrent: bool | None) -> int:
    """The LE_K_* bits of a layer (recurrent: whether it is Gated DeltaNet; None: the global tensors)."""
    c = hparams_struct(dict(hp, n_layer=1), (recurrent,) if recurrent is not None else ())
    return int(lib.le_schema_layer_kinds(c, -1 if recurrent is None else 0))
