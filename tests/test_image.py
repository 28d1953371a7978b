"""legacy_engine.format.image against transformers' Qwen3.5 image path (spec §2.7): Qwen2VLImageProcessorPil, built
directly with the released preprocessor_config.json values (no hub access), fed the same PIL images or file paths
(a path goes through transformers' image_utils.load_image: EXIF orientation + convert("RGB")). Every image is made
here from a seeded generator."""
from __future__ import annotations

import hashlib
import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from legacy_engine.core.errors import FormatError
from legacy_engine.format.image import ImageConfig, ImageInput, load_image, preprocess, smart_resize

pytestmark = pytest.mark.cpu

# Patches are compared bit for bit: both sides decode with the same pillow, resize the same uint8 image with PIL's
# bicubic, and normalise with the same float64-then-float32 operations (ours through a 256-entry table built with
# those operations), so no rounding step differs. Any nonzero difference is a bug, not noise.
PATCH_ATOL = 0.0

# the released Qwen3.5 / 3.6 preprocessor_config.json (image part)
RELEASED = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}

RGB_SIZES = [(97, 61), (224, 160), (96, 96), (640, 480), (61, 97), (1000, 5), (33, 2000)]   # (width, height)


@pytest.fixture(scope="module")
def proc():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(**RELEASED)


def _ref(proc, image) -> tuple[np.ndarray, tuple[int, int, int]]:
    out = proc(images=image, return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def _assert_same(ours: ImageInput, proc, image):
    pv, grid = _ref(proc, image)
    assert ours.grid_thw == grid
    assert ours.patches.dtype == np.float32 and pv.dtype == np.float32
    assert ours.patches.shape == pv.shape == (grid[1] * grid[2], 1536)
    np.testing.assert_allclose(ours.patches, pv, rtol=0, atol=PATCH_ATOL)
    assert ours.n_tokens == grid[0] * grid[1] * grid[2] // 4


def _noise(w, h, channels=3, seed=0, dtype=np.uint8, high=256) -> np.ndarray:
    shape = (h, w, channels) if channels > 1 else (h, w)
    return np.random.default_rng(seed).integers(0, high, shape).astype(dtype)


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _png_header(w: int, h: int) -> bytes:
    """A PNG that declares w x h and carries (almost) no pixel data: only a decoder that ignores the declared size
    would get past the header."""
    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


# ---- the configuration and smart_resize

@pytest.mark.oracle
def test_config_is_the_released_processor_and_the_class_qwen35_uses(proc):
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    assert IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_5"]["pil"] == type(proc).__name__ == "Qwen2VLImageProcessorPil"
    assert IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_5_moe"]["pil"] == type(proc).__name__
    c = ImageConfig()
    assert (c.patch_size, c.temporal_patch_size, c.merge_size) == (proc.patch_size, proc.temporal_patch_size,
                                                                  proc.merge_size) == (16, 2, 2)
    assert (c.min_pixels, c.max_pixels) == (proc.size["shortest_edge"], proc.size["longest_edge"])
    assert list(c.image_mean) == list(proc.image_mean) and list(c.image_std) == list(proc.image_std)
    assert c.resample == int(proc.resample) == int(Image.Resampling.BICUBIC)   # class default, not in the json
    assert c.rescale_factor == proc.rescale_factor and proc.do_convert_rgb


@pytest.mark.oracle
def test_smart_resize_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref
    rng = np.random.default_rng(1)
    sizes = [(h, w) for h, w in rng.integers(1, 6000, (400, 2)) if max(h, w) / min(h, w) <= 200]
    sizes += [(80, 1100), (16, 16), (5, 1000), (4096, 4097), (8000, 8000), (48, 48), (1, 200)]
    for h, w in sizes:
        assert smart_resize(int(h), int(w)) == ref(int(h), int(w), 32, 65536, 16777216), (h, w)


def test_rounding_is_half_to_even_as_transformers():
    """Negative control: 80/32 = 2.5 is where half-to-even (Python's round, transformers) and half-up (C's lround,
    llama.cpp) part; the test would catch the wrong one."""
    assert round(80 / 32) == 2 and int(80 / 32 + 0.5) == 3
    assert smart_resize(80, 1100) == (64, 1088)          # half-up would give (96, 1088)
    assert load_image(_encode(Image.fromarray(_noise(1100, 80)), "PNG")).grid_thw == (1, 4, 68)


def test_token_counts_of_spec_examples():
    assert load_image(_encode(Image.fromarray(_noise(96, 96)), "PNG")).n_tokens == 64     # llama.cpp: 9
    assert load_image(_encode(Image.fromarray(_noise(224, 160)), "PNG")).n_tokens == 70   # llama.cpp: 35


# ---- patches against transformers

@pytest.mark.oracle
@pytest.mark.parametrize("w,h", RGB_SIZES)
def test_rgb_patches_match_transformers(proc, w, h):
    image = Image.fromarray(_noise(w, h, seed=w * h))
    _assert_same(preprocess(image), proc, image)


def _mode_image(mode: str) -> Image.Image:
    if mode == "L":
        return Image.fromarray(_noise(97, 61, channels=1))
    if mode == "RGBA":
        return Image.fromarray(_noise(97, 61, channels=4), "RGBA")
    if mode == "LA":
        return Image.fromarray(_noise(61, 97, channels=2), "LA")
    if mode == "P":     # palette with a transparent index: the processor composites it onto white
        im = Image.fromarray(_noise(224, 160, channels=1, high=16)).convert("P")
        im.info["transparency"] = 3
        return im
    if mode == "I;16":  # 16-bit grey: convert("RGB") clips at 255, in transformers and here alike
        return Image.fromarray(_noise(97, 61, channels=1, dtype=np.uint16, high=700))
    raise AssertionError(mode)


@pytest.mark.oracle
@pytest.mark.parametrize("mode", ["L", "RGBA", "LA", "P", "I;16"])
def test_other_modes_match_transformers(proc, mode):
    image = _mode_image(mode)
    assert image.mode == mode
    _assert_same(preprocess(image), proc, image)


@pytest.mark.oracle
@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("JPEG", {"quality": 90}), ("WEBP", {"quality": 80}),
                                    ("GIF", {}), ("PNG-RGBA", {}), ("PNG-16", {})])
def test_files_match_transformers_given_the_path(proc, tmp_path, fmt, kw):
    """load_image(path) and load_image(bytes) == the processor given the path (transformers' load_image: EXIF,
    convert("RGB") so alpha is dropped, not composited)."""
    if fmt == "PNG-RGBA":
        fmt, image = "PNG", Image.fromarray(_noise(97, 61, channels=4, seed=5), "RGBA")
    elif fmt == "PNG-16":
        fmt, image = "PNG", Image.fromarray(_noise(97, 61, channels=1, dtype=np.uint16, high=65536))
    else:
        image = Image.fromarray(_noise(224, 160, seed=3))
    data = _encode(image, fmt, **kw)
    path = tmp_path / f"img.{fmt.lower()}"
    path.write_bytes(data)
    ours = load_image(path)
    _assert_same(ours, proc, str(path))
    assert load_image(data).digest == load_image(str(path)).digest == ours.digest
    assert ours.size == image.size


def test_alpha_differs_between_load_image_and_preprocess():
    """transformers' two RGB conversions differ and each side matches its own (tested above): a path drops alpha
    (load_image), an in-memory image composites onto white (the processor). Shown here so neither is mistaken."""
    rgba = Image.fromarray(_noise(97, 61, channels=4, seed=5), "RGBA")
    data = _encode(rgba, "PNG")
    assert load_image(data).digest == preprocess(rgba.convert("RGB")).digest
    assert load_image(data).digest != preprocess(rgba).digest


# ---- EXIF, GIF, WebP

def _exif_jpeg(orientation: int) -> tuple[bytes, Image.Image]:
    image = Image.fromarray(_noise(224, 160, seed=7))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encode(image, "JPEG", quality=95, exif=exif), image


@pytest.mark.oracle
def test_exif_orientation_matches_transformers(proc, tmp_path):
    data, _ = _exif_jpeg(6)     # 6: rotate 90° clockwise to display
    path = tmp_path / "rot.jpg"
    path.write_bytes(data)
    ours = load_image(data)
    assert ours.size == (160, 224)                    # upright: width and height swapped
    assert ours.grid_thw == (1, 20, 14)
    _assert_same(ours, proc, str(path))               # transformers' load_image applies EXIF too
    _assert_same(ours, proc, ImageOps.exif_transpose(Image.open(path)))
    raw = Image.open(path)                            # un-rotated: the processor handed a PIL image has no EXIF step
    unrotated = preprocess(raw)
    assert unrotated.grid_thw == (1, 14, 20) and unrotated.size == (224, 160)
    _assert_same(unrotated, proc, raw)


def test_exif_orientation_1_is_a_no_op():
    data, image = _exif_jpeg(1)
    assert load_image(data).digest == preprocess(Image.open(io.BytesIO(data))).digest


def test_gif_first_frame():
    a, b = _noise(96, 96, channels=1, seed=1, high=64), _noise(96, 96, channels=1, seed=2, high=64)
    frames = [Image.fromarray(x).convert("P") for x in (a, b)]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    got = load_image(data)
    assert got.digest == preprocess(frames[0].convert("RGB")).digest
    assert got.digest != preprocess(frames[1].convert("RGB")).digest


def test_lossless_webp_is_the_source_pixels():
    image = Image.fromarray(_noise(97, 61, seed=9))
    assert load_image(_encode(image, "WEBP", lossless=True)).digest == preprocess(image).digest


# ---- layout and digest, independent of transformers

def test_patch_layout_by_hand():
    """A 64x96 image is resized to itself (small min_pixels), so each patch row can be read off the pixels."""
    cfg = ImageConfig(min_pixels=1024)
    px = _noise(96, 64, seed=11)                        # [H=64, W=96, 3]
    got = preprocess(Image.fromarray(px), cfg)
    assert got.grid_thw == (1, 4, 6) and got.n_tokens == 6
    norm = (px.astype(np.float64) / 255).astype(np.float32)
    norm = (norm - np.float32(0.5)) / np.float32(0.5)
    row = 0
    for bh in range(2):                                 # h/2 blocks, w/2 blocks, then 2x2 group row-major
        for bw in range(3):
            for mh in range(2):
                for mw in range(2):
                    y, x = (2 * bh + mh) * 16, (2 * bw + mw) * 16
                    patch = norm[y:y + 16, x:x + 16].transpose(2, 0, 1)             # [c, 16, 16]
                    want = np.broadcast_to(patch[:, None], (3, 2, 16, 16)).ravel()  # (c, t, y, x)
                    np.testing.assert_array_equal(got.patches[row], want)
                    row += 1


@pytest.mark.oracle
def test_wrong_patch_order_would_be_caught(proc):
    """Negative control: the column-major merge group, or (t, c) instead of (c, t) inside a row, differs from
    transformers, so the comparisons above would see either mistake."""
    image = Image.fromarray(_noise(97, 61, seed=4))
    ours = preprocess(image)
    pv, (_, gh, gw) = _ref(proc, image)
    col_major = ours.patches.reshape(gh // 2, gw // 2, 2, 2, 1536).swapaxes(2, 3).reshape(-1, 1536)
    assert not np.array_equal(col_major, pv)
    t_first = ours.patches.reshape(-1, 3, 2, 256).swapaxes(1, 2).reshape(-1, 1536)
    assert not np.array_equal(t_first, pv)
    np.testing.assert_array_equal(ours.patches, pv)


def test_digest_and_immutability():
    a = load_image(_encode(Image.fromarray(_noise(97, 61, seed=1)), "PNG"))
    b = load_image(_encode(Image.fromarray(_noise(97, 61, seed=2)), "PNG"))
    want = hashlib.sha256(a.patches.astype("<f4").tobytes() + np.asarray(a.grid_thw, "<i8").tobytes()).hexdigest()
    assert a.digest == want and a.digest != b.digest
    assert not a.patches.flags.writeable
    with pytest.raises(ValueError):
        a.patches[0, 0] = 1.0
    with pytest.raises(AttributeError):
        a.n_tokens = 1


# ---- bad input: FormatError (or the builtin for a path that cannot be read), never a crash or a hang

def _truncated(fmt):
    def make():
        data = _encode(Image.fromarray(_noise(224, 160, seed=6)), fmt)
        return data[: len(data) // 2]
    return make


BAD = {
    "empty": (lambda: b"", "empty"),
    "random bytes": (lambda: np.random.default_rng(0).bytes(2000), "not a PNG / JPEG / WebP / GIF image"),
    "truncated PNG": (_truncated("PNG"), "truncated or corrupt"),
    "truncated JPEG": (_truncated("JPEG"), "truncated or corrupt"),
    "zero width PNG": (lambda: _png_header(0, 10), "not a PNG / JPEG / WebP / GIF image"),
    "bomb above our limit": (lambda: _png_header(10000, 10000), "max_source_pixels"),
    "bomb above PIL's limit": (lambda: _png_header(20000, 20000), "too many pixels"),
    "BMP": (lambda: _encode(Image.fromarray(_noise(8, 8)), "BMP"), "a BMP image"),
    "TIFF": (lambda: _encode(Image.fromarray(_noise(8, 8)), "TIFF"), "a TIFF image"),
    "aspect 1000x3": (lambda: _encode(Image.fromarray(_noise(1000, 3)), "PNG"), "aspect ratio 333.3"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_bytes_raise_format_error(case):
    make, match = BAD[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # PIL's DecompressionBombWarning must not escape either
        with pytest.raises(FormatError, match=match) as e:
            load_image(make())
    assert "image data" in str(e.value)     # names the input


def test_declared_size_is_checked_before_decoding():
    """A 97x61 image over a 1000-pixel limit: refused by its header (the message is the limit's, not a decode
    error), and the header-only bomb above is refused the same way although it has no pixel data at all."""
    data = _encode(Image.fromarray(_noise(97, 61)), "PNG")
    with pytest.raises(FormatError, match="5,917 pixels, above the limit of 1,000"):
        load_image(data, ImageConfig(max_source_pixels=1000))


@pytest.mark.oracle
def test_aspect_ratio_limit_matches_transformers(proc):
    ok, bad = Image.fromarray(_noise(1000, 5)), Image.fromarray(_noise(1000, 3))   # ratio 200 and 333
    _assert_same(preprocess(ok), proc, ok)
    with pytest.raises(ValueError, match="aspect ratio"):
        proc(images=bad)
    with pytest.raises(FormatError, match="aspect ratio"):
        preprocess(bad)


def test_zero_size_in_memory_image():
    with pytest.raises(FormatError, match="no pixels"):
        preprocess(Image.new("RGB", (0, 5)))


def test_paths(tmp_path):
    missing = tmp_path / "nope.png"
    with pytest.raises(FileNotFoundError, match="nope.png"):
        load_image(missing)
    with pytest.raises(IsADirectoryError, match="cannot read image file"):
        load_image(tmp_path)
    with pytest.raises(FormatError, match="not a URL"):
        load_image("https://example.com/a.png")
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(FormatError, match="bad.jpg"):
        load_image(bad)


def test_config_is_validated():
    with pytest.raises(ValueError):
        ImageConfig(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError):
        ImageConfig(formats=("PNG", "BMP"))
    with pytest.raises(TypeError):
        preprocess(np.zeros((4, 4, 3), np.uint8))
