"""The Qwen3.5/3.6 vision tower on the CPU (spec §2.7): an mmproj GGUF loaded into the C core (le_vision.h).

`VisionTower(mmproj)` validates the file (format.mmproj.MmprojFile), hands every tensor to the C core as a pointer
into the memory map (no copy; the Conv3d kernel's two time halves are joined into one f32 matrix there), and
`encode(image)` turns an ImageInput (format.image.load_image / preprocess) into the merged embeddings the LM
receives in place of the image's <|image_pad|> tokens: float32 [n_tokens, out_hidden], computed in f32 as
transformers' Qwen3_5VisionModel computes them. `check_patches` and `ImageEncoder` (the input checks, encode)
serve the GPU tower (gpu/vision.py) as well.
"""
from __future__ import annotations

import os

import numpy as np

from ..core import _native
from ..core.errors import FormatError
from ..format.image import ImageInput
from ..format.mmproj import IN_CHANNELS, MmprojFile, VisionHparams
from .threads import default_threads

MAX_THREADS = 1024     # native/threads.c's pool


def native_vision_hparams(hp: VisionHparams, faults: dict | None = None) -> dict:
    """The le_vision_hparams fields of an mmproj's VisionHparams (faults: tests' negative controls only)."""
    return dict(depth=hp.depth, hidden=hp.hidden, n_head=hp.n_head, ffn=hp.ffn, patch_size=hp.patch_size,
                temporal_patch=hp.temporal_patch, in_channels=IN_CHANNELS, merge=hp.merge, pos_side=hp.pos_side,
                out_hidden=hp.out_hidden, eps=hp.eps, rope_theta=hp.rope_theta,
                faults=_native.vision_fault_bits(faults))


def check_patches(hp: VisionHparams, patches, grid_thw) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An encode's input checked against a tower of `hp` -> (patches as contiguous float32 [t*h*w, C*T*P*P],
    (t, h, w)). patches in the processor's order (format/image.py); grid_thw (t, h, w) in patches (a [[t, h, w]]
    array is accepted). FormatError for a grid or patch array that does not fit the tower."""
    grid = tuple(int(x) for x in np.asarray(grid_thw).reshape(-1))
    if len(grid) != 3 or min(grid) < 1:
        raise FormatError(f"grid_thw = {grid_thw!r}: expected one (t, h, w) of positive patch counts")
    t, h, w = grid
    if h % hp.merge or w % hp.merge:
        raise FormatError(f"grid {grid}: h and w must be multiples of the spatial merge {hp.merge} (the "
                          f"processor resizes to multiples of {hp.patch_size * hp.merge} pixels)")
    patches = np.asarray(patches)
    if patches.dtype != np.float32:
        raise FormatError(f"patches: dtype {patches.dtype}, expected float32")
    if patches.ndim != 2 or patches.shape[1] != hp.patch_pixels:
        raise FormatError(f"patches: shape {patches.shape}, expected [n, {hp.patch_pixels}] (channels "
                          f"{IN_CHANNELS} x temporal {hp.temporal_patch} x {hp.patch_size} x {hp.patch_size})")
    if patches.shape[0] != t * h * w:
        raise FormatError(f"patches: {patches.shape[0]} rows, but grid {grid} holds t*h*w = {t * h * w}")
    return np.ascontiguousarray(patches), (t, h, w)


class ImageEncoder:
    """What every tower shares (this CPU one, gpu/vision.GpuVisionTower): the input checks and the image's token
    count around its own `_encode(patches, grid)` (checked float32 [t*h*w, C*T*P*P], (t, h, w)) -> float32
    [t*h*w / merge², out_hidden]."""
    hparams: VisionHparams

    def encode(self, image: ImageInput) -> np.ndarray:
        """The merged embeddings of one preprocessed image: float32 [image.n_tokens, out_hidden]."""
        out = self.encode_patches(image.patches, image.grid_thw)
        if out.shape[0] != image.n_tokens:
            raise FormatError(f"image: n_tokens = {image.n_tokens} but its grid {tuple(image.grid_thw)} gives "
                              f"{out.shape[0]} tokens with merge {self.hparams.merge}")
        return out

    def encode_patches(self, patches: np.ndarray, grid_thw) -> np.ndarray:
        """patches float32 [t*h*w, C*T*P*P] in the processor's order (format/image.py), grid_thw (t, h, w) in
        patches (a [[t, h, w]] array is accepted) -> float32 [t*h*w / merge², out_hidden]. FormatError for a grid
        or patch array that does not fit this tower (check_patches)."""
        return self._encode(*check_patches(self.hparams, patches, grid_thw))

    def _encode(self, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        raise NotImplementedError


class VisionTower(ImageEncoder):
    def __init__(self, mmproj: str | os.PathLike | MmprojFile, n_threads: int | None = None,
                 _faults: dict | None = None):
        """mmproj: a path or an opened MmprojFile (kept open: the C core reads its map). n_threads: default one
        per physical core. _faults (tests only): inject known bugs for negative controls, e.g.
        {"merger_gelu_tanh": True, "pos_nearest": True, "rope_swap": True, "ffn_gelu_erf": True}."""
        self.file = mmproj if isinstance(mmproj, MmprojFile) else MmprojFile.open(mmproj)
        self.hparams = hp = self.file.hparams
        self.n_threads = n_threads or default_threads()
        if not 1 <= self.n_threads <= MAX_THREADS:
            raise ValueError(f"n_threads = {self.n_threads}, expected 1..{MAX_THREADS}")
        self.native = _native.NativeVision(native_vision_hparams(hp, _faults), self.n_threads)
        for name, (role, block) in self.file.roles.items():
            t = self.file.tensors[name]
            self.native.set_weight(block, role, self.file.gguf.data(name), t.type, t.ne, what=name)
        self.native.finalize()

    def _encode(self, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        return self.native.encode(patches, grid)
