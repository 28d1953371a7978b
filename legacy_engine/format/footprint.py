"""What a model file's weights cost per decoded token: bytes read and weight elements used (the roofline's
numerator for `bench` and the planner's model of decode time)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .gguf_model import ModelFile


@dataclass
class Footprint:
    """Weight bytes and elements of a model file, and what one decoded token has to read."""
    file_bytes: int = 0            # all tensor data
    decode_bytes: int = 0          # weights read per decoded token (top-k experts only)
    decode_params: int = 0         # weight elements used per token (for FLOPs), LM head included
    head_params: int = 0           # LM head elements
    parts: dict = field(default_factory=dict)   # decode_bytes split: experts, lm_head, other (attention, GDN, ...)


def _layer(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def weight_footprint(mf: ModelFile) -> Footprint:
    """Bytes per decoded token from the GGUF's tensor sizes: every tensor of the layers that run, expert tensors
    (ffn_*_exps) at n_expert_used/n_expert of their bytes (the routed top-k), token_embd one row unless it is the
    LM head (tied); recurrent state and KV are not counted. mf: a ModelFile, or anything with its hparams and
    tensors (presets.DescribedFile)."""
    hp, tensors = mf.hparams, mf.tensors
    fp = Footprint(parts={"experts": 0, "lm_head": 0, "other": 0})
    tied = "output.weight" not in tensors
    for t in tensors.values():
        fp.file_bytes += t.n_bytes
        layer = _layer(t.name)
        if layer is not None and layer >= hp.n_layer:          # MTP block: not run
            continue
        n_bytes, n_el = t.n_bytes, t.n_elements
        if t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            part, fp.head_params = "lm_head", n_el
        elif t.name == "token_embd.weight":                    # one row looked up
            n_bytes, n_el, part = n_bytes // t.ne[1], 0, "other"
        elif "_exps." in t.name:                                # [E, out, in]: top-k of E experts
            n_bytes = n_bytes * hp.n_expert_used // hp.n_expert
            n_el = n_el * hp.n_expert_used // hp.n_expert
            part = "experts"
        else:
            part = "other"
        fp.decode_bytes += n_bytes
        fp.decode_params += n_el if len(t.ne) >= 2 and t.ne[1] > 1 else 0     # matmul weights only
        fp.parts[part] += n_bytes
    return fp
