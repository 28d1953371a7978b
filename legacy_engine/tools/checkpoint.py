"""A (possibly sharded) safetensors checkpoint read tensor by tensor as numpy arrays (convert, convert_mmproj)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..core.errors import FormatError


def _safetensors_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class Checkpoint:
    """The tensors of a (possibly sharded) safetensors checkpoint, read one at a time as numpy arrays.

    F32/F16 tensors go through safetensors' numpy API. numpy has no bfloat16, so BF16 tensors are read as raw
    uint16 words from a memory map of the file and widened to F32 exactly (bits << 16), as llama.cpp does."""

    def __init__(self, hf_dir: Path):
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if not files:
            raise FormatError(f"no *.safetensors files in {hf_dir}")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for fname in files:
            path = hf_dir / fname
            if not path.is_file():
                raise FormatError(f"{path} is listed in model.safetensors.index.json but missing")
            header, data_start = _safetensors_header(path)
            for name, info in header.items():
                self._where[name] = (path, info, data_start)
        self._open: dict[Path, object] = {}       # safe_open handles / memory maps, one per shard

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def load(self, name: str, index: tuple = ()) -> np.ndarray:
        """tensor[index] as F32 or F16 (BF16 and other types become F32); slicing first saves memory."""
        path, info, data_start = self._where[name]
        if info["dtype"] == "BF16":
            if (path, "mmap") not in self._open:
                self._open[path, "mmap"] = np.memmap(path, dtype=np.uint8, mode="r")
            begin, end = info["data_offsets"]
            words = self._open[path, "mmap"][data_start + begin:data_start + end].view("<u2")
            raw = words.reshape(info["shape"])[index]
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if path not in self._open:
            from safetensors import safe_open
            self._open[path] = safe_open(path, framework="np")
        arr = self._open[path].get_slice(name)[index] if index else self._open[path].get_tensor(name)
        return arr if arr.dtype in (np.float16, np.float32) else arr.astype(np.float32)

    def close(self) -> None:
        self._open.clear()
