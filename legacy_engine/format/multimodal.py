"""Images in a Qwen3.5 prompt: the pad tokens they take and the M-RoPE positions of every row (spec §2.7).

The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per image; `expand_pads` widens each pad to
the image's token count (t · h/merge · w/merge of its patch grid) and records where it lies (`ImageSpan`).
`rope_positions` gives every row of such a prompt its (t, h, w) rope position as transformers' get_rope_index
does: text rows count up by one in all three components; an image starting at rope position s puts its merged patch
(tt, r, c) at (s + tt, s + r, s + c), and the text after it resumes at s + max(h, w)/merge.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import FormatError


@dataclass(frozen=True)
class ImageSpan:
    """One image's rows in a prompt."""
    start: int                      # index of its first pad token in the prompt's ids
    grid: tuple[int, int, int]      # merged grid (t, h / merge, w / merge): one row per cell, in (t, h, w) order
    digest: str                     # the image's pixels' hash (format.image.ImageInput.digest): the prefix cache key

    @property
    def n_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def merged_grid(grid_thw: tuple[int, int, int], merge: int) -> tuple[int, int, int]:
    """A patch grid (t, h, w) -> the LM's grid of merged tokens; FormatError where merge does not divide h, w."""
    t, h, w = grid_thw
    if h % merge or w % merge or min(t, h, w) < 1:
        raise FormatError(f"an image grid of {t}x{h}x{w} patches does not merge by {merge}x{merge}")
    return t, h // merge, w // merge


def expand_pads(ids: list[int], pad_id: int, images: list, merge: int) -> tuple[list[int], list[ImageSpan]]:
    """ids with one `pad_id` per image (the chat template's form) -> (ids with each pad repeated to its image's token
    count, the images' spans). images: the images in prompt order (format.image.ImageInput: grid_thw, digest).
    FormatError when the pads and the images do not pair up."""
    where = [i for i, t in enumerate(ids) if t == pad_id]
    if len(where) != len(images):
        raise FormatError(f"the prompt has {len(where)} image placeholder(s) for {len(images)} image(s)")
    out: list[int] = []
    spans: list[ImageSpan] = []
    prev = 0
    for i, img in zip(where, images):
        out += ids[prev:i]
        span = ImageSpan(len(out), merged_grid(img.grid_thw, merge), img.digest)
        out += [pad_id] * span.n_tokens
        spans.append(span)
        prev = i + 1
    return out + ids[prev:], spans


def rope_positions(n: int, spans: list[ImageSpan], offset: int = 0) -> np.ndarray:
    """int32 [n, 3] rope positions (t, h, w) of a prompt of n rows whose images lie at `spans` (sorted, inside
    [0, n)), starting at rope position `offset` (a continuation: the state's position + its rope delta)."""
    pos = np.empty((n, 3), dtype=np.int64)
    cur, row = offset, 0
    for s in spans:
        if s.start < row or s.end > n:
            raise ValueError(f"image rows [{s.start}, {s.end}) overlap another image or pass the prompt's {n} rows")
        k = s.start - row
        pos[row:s.start] = (cur + np.arange(k))[:, None]
        cur += k
        t, h, w = s.grid
        tt, rr, cc = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[s.start:s.end] = cur + np.stack([tt.ravel(), rr.ravel(), cc.ravel()], axis=1)
        cur += max(h, w)          # transformers: current_pos += max(h, w) // merge (t = 1 per image)
        row = s.end
    pos[row:] = (cur + np.arange(n - row))[:, None]
    if n and pos.max() > np.iinfo(np.int32).max:
        raise ValueError("rope positions beyond int32")
    return pos.astype(np.int32)
