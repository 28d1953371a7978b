"""Images in the LM (format/multimodal.py, le_forward_embd): pad expansion, M-RoPE positions and the LM's logits with
image embeddings, against transformers.

1. rope_positions equals transformers' Qwen3_5Model.get_rope_index for prompts with 0-3 images of odd grids.
2. The LM with image embeddings (transformers' own merged embeddings: this isolates the LM side from the tower) at
   every prompt position, and decode steps after it (the state's rope delta), against Qwen3_5ForConditionalGeneration
   run on the whole sequence: max |Δlogit| within LOGIT_ABS_F32 (oracle.md's f32 bar), dense and MoE.
3. Negative controls: text positions for the image rows, and no rope delta after the image, each fail the gate.
4. The rope delta survives save/restore and copy; bad input is refused with the state kept.
"""
from __future__ import annotations

import numpy as np
import pytest

from legacy_engine.core.errors import FormatError, NativeError
from legacy_engine.cpu.model import Model
from legacy_engine.format.multimodal import ImageSpan, expand_pads, merged_grid, rope_positions

import tolerances as tol

pytestmark = pytest.mark.cpu

VISION_START, VISION_END, IMAGE_PAD = 4009, 4010, 4012      # tests/fixtures/tiny_vision.py's tokenizer


class _Img:
    def __init__(self, h, w, digest="d"):
        self.grid_thw, self.digest = (1, h, w), digest


def _hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]]):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    class Cfg:
        class vision_config:
            spatial_merge_size = 2
    fake = type("M", (), {"config": Cfg, "get_vision_position_ids": Qwen3_5Model.get_vision_position_ids})()
    t = torch.tensor([ids])
    types = (t == IMAGE_PAD).int()
    pos, delta = Qwen3_5Model.get_rope_index(fake, t, types, torch.tensor(grids) if grids else None)
    return pos[:, 0].T.numpy(), int(delta[0, 0])


@pytest.mark.oracle
@pytest.mark.parametrize("grids", [[], [(1, 4, 6)], [(1, 6, 4), (1, 2, 2)], [(1, 10, 6), (1, 4, 4), (1, 2, 8)]])
def test_rope_positions_are_transformers(grids):
    rng = np.random.default_rng(len(grids))
    ids = list(rng.integers(0, 4000, 5))
    for g in grids:
        ids += [VISION_START, IMAGE_PAD, VISION_END] + list(rng.integers(0, 4000, int(rng.integers(1, 6))))
    full, spans = expand_pads(ids, IMAGE_PAD, [_Img(g[1], g[2]) for g in grids], merge=2)
    ours = rope_positions(len(full), spans)
    ref, delta = _hf_rope_index(full, grids)
    assert np.array_equal(ours, ref)
    assert ours.max() + 1 - len(full) == delta


def test_expand_pads_and_bad_grids():
    ids, spans = expand_pads([1, IMAGE_PAD, 2, IMAGE_PAD], IMAGE_PAD, [_Img(4, 6, "a"), _Img(2, 2, "b")], merge=2)
    assert ids == [1] + [IMAGE_PAD] * 6 + [2] + [IMAGE_PAD]
    assert spans == [ImageSpan(1, (1, 2, 3), "a"), ImageSpan(8, (1, 1, 1), "b")]
    with pytest.raises(FormatError, match="2 image placeholder"):
        expand_pads([IMAGE_PAD, IMAGE_PAD], IMAGE_PAD, [_Img(2, 2)], merge=2)
    with pytest.raises(FormatError, match="does not merge"):
        merged_grid((1, 3, 4), 2)
    with pytest.raises(ValueError, match="overlap"):
        rope_positions(4, [ImageSpan(0, (1, 2, 2), "a"), ImageSpan(2, (1, 1, 1), "b")])


def _prompt(grids, seed=0):
    """A conversation-like prompt: text, an image, text, another image mid-way, text; then 6 continuation tokens."""
    rng = np.random.default_rng(seed)
    ids = list(rng.integers(0, 4000, 7))
    for g in grids:
        ids += [VISION_START, IMAGE_PAD, VISION_END] + list(rng.integers(0, 4000, 5))
    return ids, list(rng.integers(0, 4000, 6))


def _ours(model, ids, spans, embd, cont, positions="mrope", delta=True):
    state = model.new_state(256)
    toks = np.array(ids, dtype=np.int64)
    rows = np.zeros((len(ids), model.hparams.n_embd), np.float32)
    for s in spans:
        toks[s.start:s.end] = -1
    rows[toks < 0] = embd
    pos = rope_positions(len(ids), spans) if positions == "mrope" else np.repeat(np.arange(len(ids))[:, None], 3, 1)
    out = [model.forward(state, toks, all_logits=True, embd=rows, positions=pos)]
    if not delta:
        state.rope_delta = 0
    for t in cont:
        out.append(model.forward(state, [t], chunked=False))
    return np.concatenate(out)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_lm_with_image_embeddings_matches_transformers(tiny_vision_gguf, kind):
    pytest.importorskip("torch")
    from fixtures.tiny_vision import reference_logits, reference_vision_embeddings, sample_image
    hf, text, _ = tiny_vision_gguf(kind, "f32")
    grids = [(1, 4, 6), (1, 6, 2)]
    imgs = [sample_image(g[1:], seed=i) for i, g in enumerate(grids)]
    pixels = np.concatenate([p for p, _ in imgs])
    embd = reference_vision_embeddings(hf, pixels, np.array(grids))
    ids, cont = _prompt(grids)
    full, spans = expand_pads(ids, IMAGE_PAD, [_Img(g[1], g[2]) for g in grids], merge=2)
    ref = reference_logits(hf, full + cont, pixels, grids)
    model = Model(text, n_threads=2)
    ours = _ours(model, full, spans, embd, cont)
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    print(f"{kind}: max |Δlogit| {err:.2e} over {len(ref)} positions")
    assert err <= tol.LOGIT_ABS_F32, err
    # negative controls: text positions for the image rows; the rope delta dropped before decoding
    for bad in (dict(positions="text"), dict(delta=False)):
        assert np.abs(_ours(model, full, spans, embd, cont, **bad) - ref).max() > 10 * tol.LOGIT_ABS_F32, bad


def test_rope_delta_is_state(tmp_path):
    from gguf_writer import small_hparams, write_gguf
    hp = small_hparams("qwen35")
    m = Model(write_gguf(tmp_path / "m.gguf", hp), n_threads=1)
    s = m.new_state(64)
    m.forward(s, [1, 2, 3], positions=np.array([[0, 0, 0], [1, 1, 1], [1, 5, 9]], np.int32), want_logits=False)
    assert (s.pos, s.rope_delta) == (3, 7)             # next text position 10 = 3 + 7
    blob = s.save()
    t = m.new_state(64)
    t.restore(blob)
    assert t.rope_delta == 7
    u = m.new_state(64)
    u.copy_from(s)
    assert u.rope_delta == 7
    s.reset()
    assert s.rope_delta == 0
    with pytest.raises((NativeError, ValueError), match="negative"):
        m.forward(t, [1], positions=np.array([[-1, 0, 0]], np.int32))
    with pytest.raises(ValueError, match="embd"):
        m.forward(t, [-1], embd=np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="non-negative"):
        m.forward(t, [-1])
    assert (t.pos, t.rope_delta) == (3, 7)             # refused before anything ran
