"""Images for the vision tower: decode with pillow and cut into the patches Qwen3.5's processor makes.

load_image(path or bytes) reproduces, bit for bit, what transformers 5.23 does to an image given by path:
`image_utils.load_image` (open, `ImageOps.exif_transpose`, `convert("RGB")`: alpha is dropped, not composited)
followed by `Qwen2VLImageProcessorPil` (the "pil" backend AutoImageProcessor maps qwen3_5 / qwen3_5_moe to):

1. smart_resize: each side to a multiple of patch*merge = 32 with Python's round (half to even), the total pixel
   count into [min_pixels, max_pixels], aspect ratio at most 200;
2. a PIL bicubic resize of the uint8 RGB image to that size (a stretch; `image_transforms.resize` works in uint8);
3. x * (1/255) in float64 rounded to float32 (`image_transforms.rescale`), then (x - mean) / std in float32
   (`image_transforms.normalize`);
4. patches ordered (h/2 blocks, w/2 blocks, 2x2 merge group row-major), each flattened as (channel, temporal,
   16, 16), the single frame repeated to fill temporal 2 (`Qwen2VLImageProcessorPil.patchify`).

preprocess(pil_image) is steps 1-4 for an image already in memory, with the processor's own RGB conversion
(`image_transforms.convert_to_rgb`: transparency composited onto white) and no EXIF step: what the image processor
does when handed a PIL image.

Deliberate differences, all refusals (never different numbers): only PNG, JPEG, WebP and GIF are decoded; the
declared size is checked against ImageConfig.max_source_pixels before any pixel is decoded; a str is a path (not a
URL or base64); every bad input is a FormatError naming the image (a missing file: the builtin FileNotFoundError).
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..core.errors import FormatError

FORMAT_NAMES = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}


@dataclass(frozen=True)
class ImageConfig:
    """The processor's parameters. Defaults: the real Qwen3.5/3.6 preprocessor_config.json (patch 16, temporal 2,
    merge 2, size shortest_edge 65,536 / longest_edge 16,777,216, mean = std = 0.5) plus the class defaults of
    Qwen2VLImageProcessorPil the config does not override (bicubic, rescale 1/255), plus our own input limits."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65_536            # of the resized image
    max_pixels: int = 16_777_216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    max_aspect_ratio: float = 200.0     # smart_resize raises above this
    # of the source, checked on the declared size before decoding; = PIL's own MAX_IMAGE_PIXELS default, so an image
    # PIL would warn about is refused instead (89.5 Mpx is ~270 MB of RGB, far above anything max_pixels keeps)
    max_source_pixels: int = 89_478_485
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF")

    def __post_init__(self):
        ints = (self.patch_size, self.temporal_patch_size, self.merge_size, self.min_pixels, self.max_source_pixels)
        if min(ints) < 1 or self.max_pixels < self.min_pixels:
            raise ValueError(f"ImageConfig: sizes must be positive and min_pixels <= max_pixels: {self}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0.0 in self.image_std:
            raise ValueError(f"ImageConfig: image_mean/image_std need 3 values, std non-zero: {self}")
        if not set(self.formats) <= set(FORMAT_NAMES):
            raise ValueError(f"ImageConfig: formats must be among {sorted(FORMAT_NAMES)}, got {self.formats}")

    @property
    def factor(self) -> int:
        """Pixels per merged token side: both resized sides are multiples of it (32)."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True, eq=False)   # eq=False: compare images by digest, not by array
class ImageInput:
    """One image ready for the vision tower.

    patches: float32 [n_patches, 3 * temporal * patch * patch] = [gh*gw, 1536], read-only; row order (h/2 blocks,
        w/2 blocks, 2x2 merge group row-major), row layout (channel, temporal, y, x).
    grid_thw: (1, gh, gw) in patches. n_tokens: t*gh*gw / merge**2, the number of <|image_pad|> tokens.
    digest: sha256 hex of the patch bytes (little-endian f32) then the grid (3 little-endian i64): the prefix cache's
        key for the image's pad tokens. size: (width, height) of the source after EXIF orientation."""
    patches: np.ndarray
    grid_thw: tuple[int, int, int]
    n_tokens: int
    digest: str
    size: tuple[int, int]


def smart_resize(height: int, width: int, config: ImageConfig = ImageConfig()) -> tuple[int, int]:
    """(height, width) the processor resizes a height x width image to; transformers' `smart_resize`, line for line
    (round is Python's: half to even). Raises FormatError where it raises ValueError (aspect ratio > 200)."""
    if min(height, width) < 1:
        raise FormatError(f"image is {width}x{height}: it has no pixels")
    if max(height, width) / min(height, width) > config.max_aspect_ratio:
        raise FormatError(f"image is {width}x{height}: aspect ratio {max(height, width) / min(height, width):.1f} "
                          f"is above the processor's limit of {config.max_aspect_ratio:g}; crop or pad it first")
    f = config.factor
    h_bar, w_bar = round(height / f) * f, round(width / f) * f
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((height * width) / config.max_pixels)
        h_bar = max(f, math.floor(height / beta / f) * f)
        w_bar = max(f, math.floor(width / beta / f) * f)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / f) * f
        w_bar = math.ceil(width * beta / f) * f
    return h_bar, w_bar


def load_image(source: str | bytes | os.PathLike, config: ImageConfig = ImageConfig()) -> ImageInput:
    """Decode an image file (path) or its bytes and preprocess it as transformers does for an image given by path:
    EXIF orientation applied, convert("RGB"), then `preprocess`. GIF/WebP animations: the first frame.

    Raises FormatError (corrupt, truncated, empty, unsupported format, too many pixels, aspect ratio > 200) and
    FileNotFoundError / other OSError (a path that cannot be read), each naming the image and what to do."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        name = f"<{len(data)} bytes of image data>"
        if not data:
            raise FormatError("image data is empty (0 bytes): pass the bytes of a PNG, JPEG, WebP or GIF file")
        return _load(io.BytesIO(data), name, config)
    path = os.fspath(source)
    if isinstance(path, str) and path.startswith(("http://", "https://", "data:")):
        raise FormatError(f"load_image takes a file path or bytes, not a URL: fetch or base64-decode {path[:40]!r}… "
                          "first")
    try:
        fp = open(path, "rb")
    except OSError as e:    # the builtin type (FileNotFoundError, IsADirectoryError, …) with a message that says so
        raise type(e)(e.errno, f"cannot read image file {path!r}: {e.strerror}; check the path") from None
    with fp:
        return _load(fp, f"image file {path!r}", config)


def preprocess(image: Image.Image, config: ImageConfig = ImageConfig()) -> ImageInput:
    """Preprocess a decoded PIL image as `Qwen2VLImageProcessorPil` does when handed one: its RGB conversion
    (transparency composited onto white), smart resize, bicubic stretch, rescale, normalise, patches. No EXIF step
    (the processor has none; load_image applies it, as transformers' load_image does). Raises FormatError for an
    image with no pixels, more than config.max_source_pixels, or an aspect ratio above 200."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"preprocess takes a PIL.Image.Image, got {type(image).__name__}")
    return _preprocess(image, "<PIL image>", config)


def _load(fp, name: str, config: ImageConfig) -> ImageInput:
    """Open (header only), check the declared size, decode, orient, convert: transformers' load_image + processor."""
    im = _open(fp, name, config)
    with im:
        _check_declared(im.size, name, config)     # before any pixel is decoded: a bomb never reaches load()
        try:
            oriented = ImageOps.exif_transpose(im)  # loads the pixels (first frame)
            rgb = oriented.convert("RGB")            # load_image's conversion: alpha dropped, palette looked up
        except Exception as e:  # noqa: BLE001  any failure decoding untrusted bytes is the file's fault, not ours
            raise FormatError(f"{name}: cannot decode the {im.format} pixels ({type(e).__name__}: {e}); the file "
                              "is truncated or corrupt: re-export or re-download it") from None
    return _preprocess(rgb, name, config)


def _open(fp, name: str, config: ImageConfig) -> Image.Image:
    """Image.open restricted to config.formats; every failure a FormatError saying what is wrong."""
    allowed = " / ".join(FORMAT_NAMES[f] for f in config.formats)
    try:
        with warnings.catch_warnings():   # process-wide filter state: a race only loses or adds a warning
            # our own limit (checked next, on the declared size) replaces PIL's warning; PIL still raises its
            # DecompressionBombError past twice its MAX_IMAGE_PIXELS, caught below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(fp, formats=list(config.formats))
    except Image.DecompressionBombError as e:
        raise FormatError(f"{name}: too many pixels ({e}); downscale the image first") from None
    except UnidentifiedImageError:
        other = _sniff_format(fp)
        what = f"a {other} image, not {allowed}" if other else f"not a {allowed} image, or its header is corrupt"
        raise FormatError(f"{name} is {what}; convert it to PNG or JPEG") from None
    except Exception as e:  # noqa: BLE001  a corrupt header can raise anything inside a plugin
        raise FormatError(f"{name}: cannot read the image header ({type(e).__name__}: {e}); the file is "
                          "corrupt or not an image") from None


def _sniff_format(fp) -> str | None:
    """The format PIL would identify without our whitelist (for the error message), or None."""
    try:
        fp.seek(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(fp) as im:
                return im.format
    except Exception:  # noqa: BLE001  only a better message is at stake
        return None


def _check_declared(size: tuple[int, int], name: str, config: ImageConfig) -> None:
    """Refuse a declared size that has no pixels, too many, or an aspect ratio smart_resize rejects."""
    w, h = size
    if w * h > config.max_source_pixels:
        raise FormatError(f"{name} declares {w}x{h} = {w * h:,} pixels, above the limit of "
                          f"{config.max_source_pixels:,} (ImageConfig.max_source_pixels, a decompression-bomb "
                          "guard); downscale it first")
    try:
        smart_resize(h, w, config)
    except FormatError as e:
        raise FormatError(f"{name}: {e}") from None


def _preprocess(image: Image.Image, name: str, config: ImageConfig) -> ImageInput:
    """Steps 1-4 of the module docstring on a decoded image."""
    width, height = image.size
    _check_declared((width, height), name, config)
    rgb = _to_rgb(image)
    rh, rw = smart_resize(height, width, config)
    # image_transforms.resize: PIL resize of the uint8 image, reducing_gap None; [rh, rw, 3] uint8
    pixels = np.asarray(rgb.resize((rw, rh), resample=config.resample), dtype=np.uint8)
    patches = _patchify(pixels, config)
    p = config.patch_size
    grid = (1, rh // p, rw // p)    # t = 1: one image is one temporal patch (its frame repeated)
    digest = hashlib.sha256()
    digest.update(patches.tobytes())
    digest.update(np.asarray(grid, dtype="<i8").tobytes())
    patches.flags.writeable = False   # the digest must keep describing the array
    n_tokens = grid[0] * grid[1] * grid[2] // (config.merge_size ** 2)
    return ImageInput(patches, grid, n_tokens, digest.hexdigest(), (width, height))


def _to_rgb(image: Image.Image) -> Image.Image:
    """image_transforms.convert_to_rgb for a PIL image: transparency (an alpha band or a transparency key)
    composited onto opaque white, else convert("RGB"). A no-op for load_image's output (already RGB)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")     # note: 16-bit grey ("I;16") clips at 255 here, as in transformers


@lru_cache(maxsize=8)
def _lut(config: ImageConfig) -> np.ndarray:
    """[3, 256] float32: the normalised value of each uint8 per channel, computed with transformers' exact ops
    (rescale: float64 multiply then float32; normalize: float32 subtract and divide), so a lookup is bit-equal."""
    x = (np.arange(256).astype(np.float64) * config.rescale_factor).astype(np.float32)     # [256]
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]                         # [3, 1]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None]
    return (x[None, :] - mean) / std                                                        # [3, 256] float32


def _patchify(pixels: np.ndarray, config: ImageConfig) -> np.ndarray:
    """[H, W, 3] uint8 (H, W multiples of patch*merge) -> [gh*gw, 3*t*p*p] float32, Qwen2VLImageProcessorPil's
    order: rows (h block, w block, merge row, merge col), each row (channel, temporal, y, x)."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    h, w, c = pixels.shape
    gh, gw = h // p, w // p
    x = pixels.reshape(gh // m, m, p, gw // m, m, p, c)     # [bh, mh, y, bw, mw, x, c]
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)                      # [bh, bw, mh, mw, c, y, x]
    chan = np.arange(c).reshape(1, 1, 1, 1, c, 1, 1)
    x = _lut(config)[chan, x]                                  # same shape, float32 (normalised on the small uint8)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))   # [bh, bw, mh, mw, c, t, y, x]
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), dtype="<f4")
