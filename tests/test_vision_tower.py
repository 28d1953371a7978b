"""The Qwen3.5/3.6 vision tower in the C core (native/vision.c, legacy_engine/cpu/vision.py; spec §2.7).

(a) every op of the tower (LayerNorm, both GELUs, the 2-D RoPE, bidirectional attention per frame, the position
grid's interpolation) against a float64 numpy transcription of transformers; (b) the oracle: the merged embeddings of
llama.cpp's conversion of tiny seeded checkpoints (tests/fixtures/tiny_vision.py) against transformers'
Qwen3_5VisionModel in f32, on several grids (one odd in merged units), real images through load_image, the F16 mmproj
(against transformers on the f16-rounded weights), 1 and 2 threads bit for bit; (c) negative controls: known bugs
injected through le_vision_hparams.faults must fail the gate; (d) bad input is a clear error."""
from __future__ import annotations

import math

import numpy as np
import pytest

from legacy_engine.core import _native
from legacy_engine.core.errors import FormatError, NativeError
from legacy_engine.cpu.vision import VisionTower, native_vision_hparams
from legacy_engine.format.image import load_image
from legacy_engine.format.mmproj import MmprojFile
from tolerances import VISION_ATTN_REL, VISION_F32_ABS, VISION_OP_REL

pytestmark = pytest.mark.cpu

GRIDS = [(4, 6), (6, 4), (2, 2), (8, 10), (6, 10)]   # (6, 10): 3 x 5 merged tokens, odd in merged units
FAULTS = ["merger_gelu_tanh", "ffn_gelu_erf", "pos_nearest", "rope_swap"]


def _close(got, ref, what, tol=VISION_OP_REL):
    err = float(np.max(np.abs(got.astype(np.float64) - ref) / np.maximum(np.abs(ref), 1.0)))
    assert err <= tol, f"{what}: max relative error {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------------------------------------ (a) the ops
def test_layernorm_matches_numpy():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 96)) * 3 + 20).astype(np.float32)      # an offset mean: the two-pass form's case
    w, b = (1 + 0.2 * rng.standard_normal(96)).astype(np.float32), (0.1 * rng.standard_normal(96)).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-6) * w + b
    _close(_native.vision_layernorm(x, w, b, 1e-6), ref, "layernorm")
    _close(_native.vision_layernorm(x, None, None, 1e-6), (ref - b) / w, "layernorm without affine")


def test_gelus_match_numpy_and_differ():
    x = np.linspace(-8, 8, 4001, dtype=np.float32)
    x64 = x.astype(np.float64)
    tanh_ref = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    erf_ref = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    _close(_native.vision_gelu(x, "tanh"), tanh_ref, "gelu tanh")
    _close(_native.vision_gelu(x, "erf"), erf_ref, "gelu erf")
    # the two forms differ by up to ~5e-4 (why the merger's must be erf and the blocks' tanh)
    assert np.max(np.abs(tanh_ref - erf_ref)) > 1e-4


def _rope_ref(x, pos, n_head, theta):
    """transformers' Qwen3_5VisionRotaryEmbedding + apply_rotary_pos_emb_vision, float64."""
    n, width = x.shape
    hd = width // n_head
    inv_freq = 1.0 / theta ** (np.arange(0, hd // 2, 2) / (hd // 2))
    fh, fw = pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq                # [n, hd/4] each
    ang = np.concatenate([fh, fw, fh, fw], axis=1)[:, None, :]           # [n, 1, hd]
    xh = x.reshape(n, n_head, hd).astype(np.float64)
    rot = np.concatenate([-xh[..., hd // 2:], xh[..., :hd // 2]], axis=-1)
    return (xh * np.cos(ang) + rot * np.sin(ang)).reshape(n, width)


def test_rope_2d_matches_transformers_formula():
    rng = np.random.default_rng(1)
    pos = np.stack(np.meshgrid(np.arange(6), np.arange(10), indexing="ij"), -1).reshape(-1, 2).astype(np.int32)
    x = rng.standard_normal((60, 2 * 32)).astype(np.float32)
    _close(_native.vision_rope(x, pos, 2, 10000.0), _rope_ref(x, pos, 2, 10000.0), "rope 2d")
    swapped = _native.vision_rope(x, pos, 2, 10000.0, {"rope_swap": True})
    _close(swapped, _rope_ref(x, pos[:, ::-1], 2, 10000.0), "rope 2d, rows and columns swapped")


def _attention_ref(qkv, seg, n_head):
    n, width = qkv.shape
    H = width // 3
    hd = H // n_head
    q, k, v = (qkv[:, i * H:(i + 1) * H].astype(np.float64).reshape(n, n_head, hd) for i in range(3))
    out = np.empty((n, n_head, hd))
    for s in range(0, n, seg):
        sl = slice(s, s + seg)
        sc = np.einsum("ihd,jhd->hij", q[sl], k[sl]) / math.sqrt(hd)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[sl] = np.einsum("hij,jhd->ihd", p, v[sl])
    return out.reshape(n, H)


@pytest.mark.parametrize("forced_isa", _native.ISA_NAMES, indirect=True)
def test_attention_matches_numpy_per_segment_and_threads_agree(forced_isa):
    """Every tier's gemm_nn and exp_sub_sum under the attention (tests/test_f32_kernels.py tests them alone)."""
    rng = np.random.default_rng(2)
    qkv = (2 * rng.standard_normal((3 * 24, 3 * 2 * 32))).astype(np.float32)   # 3 frames of 24 patches
    one = _native.vision_attention(qkv, 24, 2, n_threads=1)
    _close(one, _attention_ref(qkv, 24, 2), "bidirectional attention", VISION_ATTN_REL)
    assert np.array_equal(one, _native.vision_attention(qkv, 24, 2, n_threads=2))
    # the segments are independent: one long segment gives other numbers
    assert np.max(np.abs(one - _native.vision_attention(qkv, 72, 2))) > 1e-3


@pytest.mark.parametrize("forced_isa", _native.ISA_NAMES, indirect=True)
@pytest.mark.parametrize("seg,n_head,hd", [(784, 2, 64), (100, 1, 72)])
def test_attention_real_head_sizes(forced_isa, seg, n_head, hd):
    """The real tower's head (64: gemm_nn's full tiles, 784 keys = a 448x448 image) and the tiny towers' 72 (column
    tails), a segment that is no multiple of the 48-query tile."""
    rng = np.random.default_rng([seg, hd])
    qkv = rng.standard_normal((seg, 3 * n_head * hd)).astype(np.float32)
    got = _native.vision_attention(qkv, seg, n_head, n_threads=2)
    _close(got, _attention_ref(qkv, seg, n_head), "bidirectional attention", VISION_ATTN_REL)


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 6, 10), (2, 8, 8), (1, 2, 2), (1, 16, 12)])
def test_pos_embed_matches_transformers_interpolation(grid):
    torch = pytest.importorskip("torch")
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights
    table = np.random.default_rng(3).standard_normal((64, 48)).astype(np.float32)      # an 8 x 8 grid
    idx, wts = get_vision_interpolation_indices_and_weights(torch.tensor([grid]), 8, mode="bilinear",
                                                            align_corners=True, spatial_merge_size=2)
    ref = (torch.from_numpy(table)[idx] * wts[:, :, None]).sum(1).double().numpy()
    _close(_native.vision_pos_embed(table, grid, 2), ref, f"position grid resampled to {grid}")
    if grid[1:] not in ((8, 8), (2, 2)):   # nearest sampling is right where the grids' points coincide
        assert np.max(np.abs(_native.vision_pos_embed(table, grid, 2, {"pos_nearest": True}) - ref)) > 0.05


# ------------------------------------------------------------------------------------------------ (b) the oracle
@pytest.fixture(scope="module")
def towers(tiny_vision_gguf):
    """towers(kind, outtype, n_threads=2, **faults) -> (hf_dir, VisionTower), loaded once per key."""
    made = {}

    def get(kind="dense", outtype="f32", n_threads=2, **faults):
        key = (kind, outtype, n_threads, tuple(sorted(faults.items())))
        if key not in made:
            hf, _, mmproj = tiny_vision_gguf(kind, outtype)
            made[key] = (hf, VisionTower(mmproj, n_threads, _faults=faults or None))
        return made[key]
    return get


@pytest.fixture(scope="module")
def reference():
    """reference(hf_dir, pixels, grid_thw, f16=False) -> transformers' merged embeddings (float64), cached."""
    from fixtures.tiny_vision import reference_vision_embeddings
    made = {}

    def get(hf, pixels, grid_thw, f16=False):
        key = (str(hf), pixels.tobytes(), np.asarray(grid_thw).tobytes(), f16)
        if key not in made:
            run = _reference_f16 if f16 else reference_vision_embeddings
            made[key] = run(hf, pixels, grid_thw).astype(np.float64)
        return made[key]
    return get


def _reference_f16(hf_dir, pixel_values, grid_thw):
    """transformers' tower with every matrix rounded to f16 as an --outtype f16 mmproj holds them: 1-D tensors and
    the position grid stay f32 (llama.cpp's converter keeps them so)."""
    import torch
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
    cfg = AutoConfig.from_pretrained(hf_dir)
    cls = Qwen3_5MoeForConditionalGeneration if cfg.model_type == "qwen3_5_moe" else Qwen3_5ForConditionalGeneration
    visual = cls.from_pretrained(hf_dir, dtype=torch.float32).eval().model.visual
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if p.ndim >= 2 and name != "pos_embed.weight":
                p.copy_(p.half().float())
        out = visual(torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(np.asarray(grid_thw, np.int64)))
    return out.pooler_output.float().numpy()


def _delta(got, ref):
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return float(np.max(np.abs(got - ref)))


def _seeded_png(tmp_path, size, seed):
    """A seeded smooth-ish RGB image (noise over a gradient) of size (width, height) as a PNG file."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([255 * xx / w, 255 * yy / h, 128 + 0 * xx], -1)
    img = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    path = tmp_path / f"seeded_{w}x{h}.png"
    Image.fromarray(img, "RGB").save(path)
    return path


@pytest.mark.oracle
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_tower_matches_transformers_dense(towers, reference, grid):
    from fixtures.tiny_vision import sample_image
    hf, tower = towers("dense")
    pixels, thw = sample_image(grid, seed=11)
    d = _delta(tower.encode_patches(pixels, thw), reference(hf, pixels, thw))
    assert d <= VISION_F32_ABS, f"grid {grid}: max |Δ| = {d:.3g} vs transformers > {VISION_F32_ABS}"


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_tower_matches_transformers_moe(towers, reference, grid):
    from fixtures.tiny_vision import sample_image
    hf, tower = towers("moe")
    pixels, thw = sample_image(grid, seed=12)
    d = _delta(tower.encode_patches(pixels, thw), reference(hf, pixels, thw))
    assert d <= VISION_F32_ABS, f"grid {grid}: max |Δ| = {d:.3g} vs transformers > {VISION_F32_ABS}"


@pytest.mark.oracle
@pytest.mark.parametrize("size,seed", [((97, 61), 5), ((224, 160), 6)], ids=["97x61", "224x160"])
def test_real_images_through_load_image(towers, reference, tmp_path, size, seed):
    hf, tower = towers("dense")
    image = load_image(_seeded_png(tmp_path, size, seed))
    got = tower.encode(image)
    assert got.shape == (image.n_tokens, tower.hparams.out_hidden)
    d = _delta(got, reference(hf, np.array(image.patches), np.array([image.grid_thw])))
    assert d <= VISION_F32_ABS, f"{size} image (grid {image.grid_thw}): max |Δ| = {d:.3g} > {VISION_F32_ABS}"


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_f16_mmproj_matches_transformers_on_rounded_weights(towers, reference, tiny_vision_gguf, kind):
    from fixtures.tiny_vision import sample_image
    m = MmprojFile.open(tiny_vision_gguf(kind, "f16")[2])
    f32 = {n for n, t in m.tensors.items() if t.type_name == "F32"}      # what the reference does not round
    assert f32 == {n for n, t in m.tensors.items() if len(t.ne) == 1} | {"v.position_embd.weight"}
    assert {t.type_name for n, t in m.tensors.items() if n not in f32} == {"F16"}
    hf, tower = towers(kind, "f16")
    pixels, thw = sample_image((6, 10), seed=13)
    got = tower.encode_patches(pixels, thw)
    d = _delta(got, reference(hf, pixels, thw, f16=True))
    assert d <= VISION_F32_ABS, f"F16 {kind}: max |Δ| = {d:.3g} vs transformers on f16 weights > {VISION_F32_ABS}"
    # and the rounding itself is visible: against the f32 weights the same image is further off
    assert _delta(got, reference(hf, pixels, thw)) > 10 * d


@pytest.mark.oracle
@pytest.mark.parametrize("grid", [(8, 10), (6, 10)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_one_and_two_threads_give_the_same_bits(towers, grid):
    from fixtures.tiny_vision import sample_image
    pixels, thw = sample_image(grid, seed=14)
    one = towers("dense", n_threads=1)[1].encode_patches(pixels, thw)
    assert np.array_equal(one, towers("dense", n_threads=2)[1].encode_patches(pixels, thw))
    assert np.array_equal(one, towers("dense", n_threads=3)[1].encode_patches(pixels, thw))


@pytest.mark.oracle
def test_scratch_is_planned_once_per_size(towers):
    from fixtures.tiny_vision import sample_image
    tower = towers("dense", n_threads=1)[1]
    big, small = sample_image((8, 10), seed=15), sample_image((2, 4), seed=15)
    tower.encode_patches(*big)
    growths = tower.native.scratch_growths
    for pixels, thw in (small, big, small):
        tower.encode_patches(pixels, thw)
    assert tower.native.scratch_growths == growths
    assert tower.native.scratch_bytes > 0


# ------------------------------------------------------------------------------------------------ (c) negative controls
@pytest.mark.oracle
@pytest.mark.parametrize("fault", FAULTS)
def test_negative_controls_fail_the_gate(towers, reference, fault):
    from fixtures.tiny_vision import sample_image
    hf, tower = towers("dense", **{fault: True})
    pixels, thw = sample_image((4, 6), seed=11)
    d = _delta(tower.encode_patches(pixels, thw), reference(hf, pixels, thw))
    assert d > 5 * VISION_F32_ABS, f"fault {fault}: max |Δ| = {d:.3g} does not fail the gate {VISION_F32_ABS}"


def test_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="unknown vision faults"):
        _native.vision_fault_bits({"pos_sideways": True})


# ------------------------------------------------------------------------------------------------ (d) bad input
@pytest.mark.oracle
def test_bad_input_is_a_clear_error(towers):
    from fixtures.tiny_vision import sample_image
    tower = towers("dense")[1]
    pixels, thw = sample_image((4, 6), seed=1)
    with pytest.raises(FormatError, match="holds t\\*h\\*w = 24"):
        tower.encode_patches(pixels[:-1], thw)
    with pytest.raises(FormatError, match="multiples of the spatial merge"):
        tower.encode_patches(pixels, [[1, 3, 8]])
    with pytest.raises(FormatError, match="expected \\[n, 1536\\]"):
        tower.encode_patches(pixels[:, :768], thw)
    with pytest.raises(FormatError, match="float32"):
        tower.encode_patches(pixels.astype(np.float64), thw)
    with pytest.raises(FormatError, match="positive patch counts"):
        tower.encode_patches(pixels, [[0, 4, 6]])


@pytest.mark.oracle
def test_native_checks_shapes_and_order(tiny_vision_gguf):
    m = MmprojFile.open(tiny_vision_gguf("dense", "f32")[2])
    nv = _native.NativeVision(native_vision_hparams(m.hparams), 1)
    t = m.tensor("qkv_w", 0)
    with pytest.raises(NativeError, match="expected"):
        nv.set_weight(0, "qkv_w", m.gguf.data(t.name), t.type, (t.ne[1], t.ne[0]))
    with pytest.raises(NativeError, match="global slots take -1"):
        nv.set_weight(None, "qkv_w", m.gguf.data(t.name), t.type, t.ne)
    with pytest.raises(NativeError, match="not set"):
        nv.finalize()
    with pytest.raises(NativeError, match="not finalized"):
        nv.encode(np.zeros((4, 1536), np.float32), (1, 2, 2))
    bad = dict(native_vision_hparams(m.hparams), n_head=3)
    with pytest.raises(NativeError, match="multiple of 4 per head"):
        _native.NativeVision(bad, 1)
