"""The tensor schema (native/schema.c, format/schema.py): one table per architecture that the file check, the C loader,
the CPU model and the GPU upload all read.

1. Its names per architecture are exactly gguf-py's tensor list of that architecture (a table we did not write).
2. Every C weight slot has one standard tensor; the slots of a fused tensor tile its rows.
3. The C loader's shape rule (le_schema_slot_shape) is the file check's (groups) for every slot of every layer kind.
4. A file in the fused layouts (attention attn_qkv, ffn_gate_up_exps) runs bit-equal to the same weights unfused.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

from gguf_writer import add_key, hparam_metadata, small_hparams, write_gguf
from legacy_engine.core import _native
from legacy_engine.cpu.model import Model
from legacy_engine.format import schema

pytestmark = pytest.mark.cpu

ROWS = _native.schema_rows()


def _gguf_py_names(arch: str) -> set[str]:
    a = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    return {TENSOR_NAMES[t].replace("blk.{bid}.", "") for t in MODEL_TENSORS[a]}


@pytest.mark.parametrize("arch", schema.ARCHITECTURES)
def test_names_are_gguf_py_s(arch):
    bit = 1 << schema.ARCHITECTURES.index(arch)
    ours = {r["name"].removesuffix(".weight").removesuffix(".bias") for r in ROWS if r["archs"] & bit}
    assert ours == _gguf_py_names(arch)


def test_every_slot_has_one_standard_tensor():
    slots = range(_native.lib.LE_W_COUNT)
    assert sorted(schema.SLOT_NAMES) == list(slots)
    for s in slots:
        std = [r for r in ROWS if r["slot"] == s and r["alt"] == 0]
        assert len({r["name"] for r in std}) == 1, (s, std)
        assert std[0]["rows"] == (schema.ZERO, schema.ZERO)     # a standard tensor is one slot, whole


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_fused_slots_tile_their_tensor(arch):
    hp = small_hparams(arch)
    dims = _native.schema_dims(schema.native_hparams(hp))
    bit = 1 << schema.ARCHITECTURES.index(arch)
    fused = {}
    for r in ROWS:
        if r["rows"] != (schema.ZERO, schema.ZERO) and r["archs"] & bit:
            fused.setdefault(r["name"], []).append(r)
    assert set(fused) == {"attn_qkv.weight"} | ({"ffn_gate_up_exps.weight"} if hp.is_moe else set())
    for name, rows in fused.items():
        spans = sorted((dims[r["rows"][0]], dims[r["rows"][1]]) for r in rows)
        assert spans[0][0] == 0 and spans[-1][1] == dims[rows[0]["ne"][1]], name
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:])), (name, spans)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_c_shape_rule_is_the_file_check_s(arch):
    hp = small_hparams(arch, tied_embeddings=False)
    c = _native.hparams_struct(schema.native_hparams(hp), hp.recurrent, hp.rope_sections)
    ne = _native.ffi.new("int64_t[3]")
    for layer in range(-1, hp.n_layer):
        standard = {n: s for g in schema.groups(hp, layer) for n, s in g.alternatives[0].items()}
        held = {w.slot_id: w for w in schema.weights(hp, layer, standard)}
        for slot in range(_native.lib.LE_W_COUNT):
            used = _native.lib.le_schema_slot_shape(c, layer, slot, ne)
            assert used == (slot in held), (layer, schema.SLOT_NAMES[slot])
            if used:
                want = standard[held[slot].tensor] + (1,) * (3 - len(standard[held[slot].tensor]))
                assert tuple(ne) == want, (layer, schema.SLOT_NAMES[slot])


def _rewrite(src, dst, hp, edit=None):
    """src's tensors at a scale whose f32 logits stay finite, edited by `edit` (a dict name -> array)."""
    T = {t.name: np.array(t.data) * np.float32(0.15) for t in GGUFReader(src).tensors}
    if edit:
        edit(T)
    w = GGUFWriter(str(dst), hp.arch)
    for k, v in hparam_metadata(hp).items():
        add_key(w, k, v)
    for n, a in T.items():
        w.add_tensor(n, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def _fuse(T):
    # arrays are numpy order [ne2, ne1, ne0]: slots' rows are axis -2
    q = "blk.3."
    T[q + "attn_qkv.weight"] = np.concatenate([T.pop(q + f"attn_{x}.weight") for x in "qkv"], axis=0)
    for i in range(4):
        p = f"blk.{i}."
        T[p + "ffn_gate_up_exps.weight"] = np.concatenate(
            [T.pop(p + "ffn_gate_exps.weight"), T.pop(p + "ffn_up_exps.weight")], axis=1)


def test_fused_layouts_run_bit_equal(tmp_path):
    hp = small_hparams("qwen35moe")
    raw = write_gguf(tmp_path / "raw.gguf", hp, seed=1)
    plain = _rewrite(raw, tmp_path / "plain.gguf", hp)
    fused = _rewrite(raw, tmp_path / "fused.gguf", hp, _fuse)
    toks = [(7 * i + 3) % 90 for i in range(20)]
    out = []
    for path in (plain, fused):
        m = Model(path, n_threads=1)
        assert m.file.layout["attention projections of layer 3"] == (path == fused)
        assert m.file.layout["experts of layer 0"] == (path == fused)
        st = m.new_state(64)
        out.append(np.concatenate([m.forward(st, toks, all_logits=True), m.forward(st, [5])]))
    assert np.isfinite(out[0]).all() and np.abs(out[0]).max() > 0.1
    assert np.array_equal(out[0], out[1])
