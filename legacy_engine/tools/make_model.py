"""legacy-engine make-model: random-weight Qwen3.5 / Qwen3.6 GGUFs in exactly llama.cpp's layout.

The real models cannot be downloaded here, so speed work and the planner run on files with the real
shapes, the real tokenizer and llama.cpp's quant mixes, but random weights. What is written:

* Metadata: every key of spec §3.2 for `qwen35` / `qwen35moe` (no MTP block), `general.file_type`
  (llama.cpp's LLAMA_FTYPE), `general.quantization_version` 2, and the real 248,320-row Qwen3.5
  vocabulary from `legacy_engine.format.vocab`.
* Tensors: exactly `gguf_model.expected_tensors(hp)`, in the order llama-quantize writes them
  (its `weight_name_comparer`: tensors outside blocks first, then block by block in layer order,
  by name inside each group): the order of every file llama-quantize makes (all K-quant mixes).
* Types: norms, 1-D tensors, ssm_a, ssm_dt.bias, ssm_conv1d, ffn_gate_inp(_shexp) always F32.
  Mixes (`q4_k_m`, `q5_k_m`, `mxfp4_moe`) follow llama-quant.cpp's `llama_tensor_get_type_impl`
  for the tensors these architectures have (`presets.tensor_type`; checked against llama.cpp's quant-mix
  snapshots for Qwen3.5-397B and Qwen3.6-27B). With tied embeddings llama.cpp quantises
  token_embd like the LM head (Q6_K in Q4_K_M). Pure types put every quantisable weight in that
  type, falling back like llama-quantize when a row is not a whole number of blocks.
* Values: O(1/sqrt(fan_in)) weights, finite everywhere, so a forward pass gives sane logits
  (see `_role`). Quantised tensors are random *blocks*: random bytes for the quant fields, then the
  fp16 / E8M0 scale fields overwritten with one finite value per tensor (MXFP4: the two powers of
  two around it) chosen so that the dequantised weights have the intended RMS and mean ≈ 0
  (calibrated once per type through gguf-py's dequantiser). No float weights and no quantiser are
  involved, so big files write at disk speed.
* Determinism: tensor data depends only on (seed, tensor name, chunk index) through numpy PCG64,
  so any tensor can be regenerated on its own and two runs give identical bytes.
* Router skew (`router_skew` = ALPHA > 0): see `router_row_scales`.

Files are streamed tensor by tensor (never more than a few chunks of 32 MiB in memory), generated on
the calling thread while a writer thread writes the previous chunk, and written atomically
(temporary file, fsync, rename).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import queue
import struct
import sys
import threading
import time
from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..core.errors import EngineError
from ..core.paths import written_atomically
from ..format.gguf_model import Hparams
from ..format.presets import (N_VOCAB, PRESETS, QUANTS, MakeModelError, TensorSpec, layer_of, plan_tensors,
                              preset_hparams, preset_vision_hparams)
from ..format.vocab import qwen_vocab, vocab_metadata
from .make_mmproj import MMPROJ_TYPES, make_mmproj, mmproj_nbytes, plan_mmproj

T = GGMLQuantizationType

GGUF_VERSION = 3
ALIGNMENT = 32
CHUNK_BYTES = 32 << 20          # generation / write unit; part of the output format (chunk seeds)
LOGIT_STD = 3.0                 # std of the logits a normalised hidden state gets from the LM head

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
RESIDUAL_OUTPUTS = ("ssm_out.weight", "attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight",
                    "ffn_down_shexp.weight")


# ---- metadata (the presets, their hyperparameters and tensor types: format/presets.py) -----------------

def arch_metadata(hp: Hparams) -> list[tuple[str, object, GGUFValueType]]:
    """The {arch}.* keys of spec §3.2, typed as llama.cpp's converter writes them."""
    a, U, F = hp.arch, GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kv = [(f"{a}.block_count", hp.n_layer_all, U), (f"{a}.context_length", hp.n_ctx_train, U),
          (f"{a}.embedding_length", hp.n_embd, U)]
    if not hp.is_moe:
        kv.append((f"{a}.feed_forward_length", hp.n_ff, U))
    kv += [(f"{a}.attention.head_count", hp.n_head, U), (f"{a}.attention.head_count_kv", hp.n_head_kv, U),
           (f"{a}.rope.freq_base", hp.rope_theta, F), (f"{a}.attention.layer_norm_rms_epsilon", hp.rms_eps, F)]
    if hp.is_moe:
        kv += [(f"{a}.expert_count", hp.n_expert, U), (f"{a}.expert_used_count", hp.n_expert_used, U)]
    kv += [(f"{a}.attention.key_length", hp.head_dim, U), (f"{a}.attention.value_length", hp.head_dim_v, U)]
    if hp.is_moe:
        kv += [(f"{a}.expert_feed_forward_length", hp.n_ff_exp, U),
               (f"{a}.expert_shared_feed_forward_length", hp.n_ff_shexp, U)]
    interval = next((i + 1 for i, r in enumerate(hp.recurrent) if not r), 4)
    kv += [(f"{a}.ssm.conv_kernel", hp.ssm_conv_kernel, U), (f"{a}.ssm.state_size", hp.ssm_d_state, U),
           (f"{a}.ssm.group_count", hp.ssm_n_group, U), (f"{a}.ssm.time_step_rank", hp.ssm_dt_rank, U),
           (f"{a}.ssm.inner_size", hp.ssm_d_inner, U), (f"{a}.full_attention_interval", interval, U),
           (f"{a}.rope.dimension_count", hp.n_rot, U),
           (f"{a}.rope.dimension_sections", list(hp.rope_sections), GGUFValueType.INT32)]
    return kv


# ---- random values ---------------------------------------------------------------------------------

def _role(name: str, ne: tuple[int, ...], hp: Hparams, tame: bool) -> tuple[str, float]:
    """(kind, scale) of a tensor's values. Matrices: N(0, scale²) with scale = 1/sqrt(fan_in)."""
    if name.endswith("_norm.weight"):
        return "norm", 0.04                          # GGUF stores 1 + w (ssm_norm: w itself, ≈ 1)
    if name.endswith("ssm_a"):
        return "ssm_a", 0.0
    if name.endswith(("ssm_dt.bias", "ssm_conv1d.weight")):
        return "normal", 0.25
    if name.endswith("ffn_gate_inp.weight"):
        return "router", 1.0 / math.sqrt(ne[0])
    if name == "output.weight" or (name == "token_embd.weight" and hp.tied_embeddings):
        return "normal", LOGIT_STD / math.sqrt(ne[0])   # logit std ≈ 3
    if name == "token_embd.weight":
        return "normal", 1.0
    scale = 1.0 / math.sqrt(ne[0])
    if tame and name.endswith(RESIDUAL_OUTPUTS):
        scale *= 0.25
    return "normal", scale


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def _rng(seed: int, name: str, chunk: int) -> np.random.Generator:
    """PCG64 stream of one chunk of one tensor: depends on (seed, name, chunk) only."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _name_key(name), chunk])))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    words = rng.bit_generator.random_raw((n + 7) // 8)   # ≈ 1.5 GB/s; rng.bytes is 6x slower
    return words.view(np.uint8)[:n]


# Byte offsets of a block's fp16 scale fields: (d offset, [(min offset, min = factor·d)]).
# The min factor cancels the mean of the unsigned codes, so weights are zero-mean on average.
_SCALES: dict[T, tuple[int, tuple[tuple[int, float], ...]]] = {
    T.Q4_0: (0, ()), T.Q5_0: (0, ()), T.Q8_0: (0, ()), T.IQ4_NL: (0, ()), T.IQ4_XS: (0, ()),
    T.Q4_1: (0, ((2, -7.5),)), T.Q5_1: (0, ((2, -15.5),)),      # y = q·d + m,      q in [0, 16) / [0, 32)
    T.Q2_K: (80, ((82, 1.5),)),                                    # y = d·sc·q − dmin·m, q in [0, 4)
    T.Q4_K: (0, ((2, 7.5),)), T.Q5_K: (0, ((2, 15.5),)),           # q in [0, 16) / [0, 32)
    T.Q3_K: (108, ()), T.Q6_K: (208, ()),
    T.MXFP4: (0, ()),                                              # u8 E8M0 exponent, d = 2^(e-128)
}


def _set_scales(blocks: np.ndarray, qtype: T, d: float) -> None:
    """Overwrites the scale fields of blocks (uint8 [n_blocks, block_bytes]) in place."""
    off, mins = _SCALES[qtype]
    if qtype == T.MXFP4:
        # d = 2^(e-128) is a power of two: give each block one of the two exponents around log2(d),
        # picked by its (random) exponent byte so that the mean of d² is d².
        lo = math.floor(math.log2(d))
        p_hi = (d * d - 4.0 ** lo) / (4.0 ** (lo + 1) - 4.0 ** lo)
        e_lo, e_hi = (min(254, max(1, 128 + e)) for e in (lo, lo + 1))
        blocks[:, 0] = np.where(blocks[:, 0] < round(p_hi * 256), e_hi, e_lo).astype(np.uint8)
        return
    blocks[:, off:off + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    for moff, factor in mins:
        blocks[:, moff:moff + 2] = np.frombuffer(np.float16(factor * d).tobytes(), np.uint8)


@lru_cache(maxsize=None)
def unit_rms(qtype: T) -> float:
    """RMS of the dequantised weights of random blocks whose scale is 1 (gguf-py's dequantiser)."""
    from gguf.quants import dequantize

    block, size = GGML_QUANT_SIZES[qtype]
    n = 8192
    blocks = _random_bytes(np.random.Generator(np.random.PCG64(12345)), n * size).reshape(n, size).copy()
    _set_scales(blocks, qtype, 1.0)
    w = dequantize(blocks.reshape(-1), qtype).astype(np.float64)
    return float(np.sqrt(np.mean(w * w)))


def scale_for(qtype: T, rms: float) -> float:
    """The block scale d that gives dequantised weights of RMS `rms`."""
    d = rms / unit_rms(qtype)
    return d if qtype == T.MXFP4 else float(np.float16(d))


def quant_blocks(qtype: T, n_blocks: int, rms: float, rng: np.random.Generator) -> np.ndarray:
    """n_blocks random blocks of qtype (uint8 [n_blocks, block_bytes]) with weight RMS ≈ rms."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = _random_bytes(rng, n_blocks * size).reshape(n_blocks, size)
    if not blocks.flags.writeable:
        blocks = blocks.copy()
    _set_scales(blocks, qtype, scale_for(qtype, rms))
    return blocks


# ---- router skew -----------------------------------------------------------------------------------

def _zipf_targets(n: int, k: int, alpha: float, f_max: float) -> np.ndarray:
    """Per-rank selection frequencies ∝ (rank+1)^-alpha, summing to k, each capped at f_max."""
    f = (np.arange(n) + 1.0) ** -alpha
    f *= k / f.sum()
    for _ in range(n):
        over = f > f_max
        if not over.any():
            break
        spare = (f[over] - f_max).sum()
        f[over] = f_max
        f[~over] += spare * f[~over] / f[~over].sum()
    return f


@lru_cache(maxsize=16)
def router_row_scales(n_expert: int, n_used: int, alpha: float) -> np.ndarray:
    """Norm multiplier of the router row of the expert of popularity rank r (0 = most popular).

    Method: router rows are random directions, so for any hidden state x the logits w_e·x are
    independent zero-mean Gaussians with std ∝ ‖w_e‖. Scaling row e by s_e therefore sets how often
    expert e lands in the top-k, whatever the hidden states are. The s_r are calibrated (Monte Carlo
    on Gaussian logits, fixed seed, damped multiplicative updates) so that expert r is picked by a
    fraction ∝ (r+1)^-alpha of tokens: Zipf popularity. A zero-mean logit is in the top-k at most half
    the time, so a rank's frequency is capped at 0.45 and the excess spread over the others.
    alpha = 0 gives all ones. The scales have RMS 1; the rows are written with exactly these norms
    (times 1 = sqrt(fan_in)/sqrt(fan_in)), so alpha = 0 is as uniform as random directions allow.
    """
    if alpha <= 0:
        return np.ones(n_expert)
    k = min(n_used, n_expert)
    target = _zipf_targets(n_expert, k, alpha, f_max=0.45)
    rng = np.random.Generator(np.random.PCG64(20260101))
    s = np.ones(n_expert)
    for it in range(60):
        z = rng.standard_normal((4096, n_expert), dtype=np.float32) * s.astype(np.float32)
        top = np.argpartition(-z, k - 1, axis=1)[:, :k]
        freq = np.bincount(top.ravel(), minlength=n_expert) / z.shape[0]
        s *= ((target + 1e-3) / (freq + 1e-3)) ** 0.3
        s /= np.sqrt(np.mean(s * s))
    return s


def router_ranks(seed: int, layer: int, n_expert: int) -> np.ndarray:
    """rank[e] = popularity rank of expert e in this layer (a seeded permutation per layer)."""
    return _rng(seed, f"router-rank.blk.{layer}", 0).permutation(n_expert)


# ---- tensor data -----------------------------------------------------------------------------------

def tensor_chunks(spec: TensorSpec, hp: Hparams, seed: int, tame: bool = False,
                  router_skew: float = 0.0):
    """Yields the bytes of one tensor as uint8 arrays, chunk by chunk (≤ CHUNK_BYTES each)."""
    kind, scale = _role(spec.name, spec.ne, hp, tame)
    if spec.qtype in FLOAT_TYPES:
        yield from _float_chunks(spec, kind, scale, hp, seed, router_skew)
        return
    if kind != "normal":
        raise MakeModelError(f"{spec.name}: {kind} tensors are always float, not {spec.qtype.name}")
    block, size = GGML_QUANT_SIZES[spec.qtype]
    n_blocks = spec.n_elements // block
    per_chunk = max(8, CHUNK_BYTES // size // 8 * 8)
    for c, start in enumerate(range(0, n_blocks, per_chunk)):
        n = min(per_chunk, n_blocks - start)
        yield quant_blocks(spec.qtype, n, scale, _rng(seed, spec.name, c)).reshape(-1)


def _float_chunks(spec: TensorSpec, kind: str, scale: float, hp: Hparams, seed: int, router_skew: float):
    ne0 = spec.ne[0]
    n_rows = spec.n_elements // ne0
    rows_per_chunk = max(1, (CHUNK_BYTES // 4) // ne0)
    row_scale = None
    if kind == "router":
        ranks = router_ranks(seed, layer_of(spec.name), n_rows)
        row_scale = router_row_scales(n_rows, hp.n_expert_used, float(router_skew))[ranks]
    for c, r0 in enumerate(range(0, n_rows, rows_per_chunk)):
        r1 = min(n_rows, r0 + rows_per_chunk)
        rng = _rng(seed, spec.name, c)
        shape = (r1 - r0, ne0)
        if kind == "norm":
            x = 1.0 + scale * rng.standard_normal(shape, dtype=np.float32)
        elif kind == "ssm_a":
            x = -np.exp(rng.uniform(math.log(0.5), math.log(4.0), shape)).astype(np.float32)
        else:
            x = rng.standard_normal(shape, dtype=np.float32)
            if row_scale is None:
                x *= np.float32(scale)
            else:   # router: rows of norm exactly scale·sqrt(ne0)·s_rank, so skew 0 is as uniform as can be
                x *= (scale * math.sqrt(ne0) * row_scale[r0:r1, None] / np.linalg.norm(x, axis=1, keepdims=True)
                      ).astype(np.float32)
        yield _to_type(x.astype(np.float32, copy=False), spec.qtype).reshape(-1).view(np.uint8)


def _to_type(x: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return x
    if qtype == T.F16:
        return x.astype(np.float16)
    bits = x.view(np.uint32)                       # BF16: round to nearest even on the top 16 bits
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


# ---- GGUF container --------------------------------------------------------------------------------

_SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
# tokenizer.* value types as llama.cpp's converter writes them (GGUFWriter's add_* calls)
_TOKENIZER_TYPES = {"tokenizer.ggml.token_type": GGUFValueType.INT32,
                    "tokenizer.ggml.scores": GGUFValueType.FLOAT32}


def _pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _infer_type(v) -> GGUFValueType:
    if isinstance(v, bool):
        return GGUFValueType.BOOL
    if isinstance(v, (int, np.integer)):
        return GGUFValueType.UINT32 if v >= 0 else GGUFValueType.INT32
    if isinstance(v, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(v, str):
        return GGUFValueType.STRING
    raise MakeModelError(f"cannot store {type(v).__name__} in GGUF metadata")


def pack_kv(key: str, value, vtype: GGUFValueType | None = None) -> bytes:
    """One GGUF key/value. For arrays, vtype is the element type (inferred when None)."""
    out = [_pack_str(key)]
    if isinstance(value, (list, tuple)):
        if vtype is None:
            vtype = GGUFValueType.INT32 if value and all(isinstance(x, int) and not isinstance(x, bool)
                                                         for x in value) else _infer_type(value[0])
        out.append(struct.pack("<IIQ", GGUFValueType.ARRAY, vtype, len(value)))
        if vtype == GGUFValueType.STRING:
            out.append(b"".join(_pack_str(s) for s in value))
        else:
            dt = np.dtype(_SCALAR[vtype])
            out.append(np.asarray(value, dtype=dt).tobytes())
    else:
        vtype = vtype or _infer_type(value)
        out.append(struct.pack("<I", vtype))
        out.append(_pack_str(value) if vtype == GGUFValueType.STRING else struct.pack(_SCALAR[vtype], value))
    return b"".join(out)


@lru_cache(maxsize=1)
def tokenizer_kv() -> tuple[int, bytes]:
    """(key count, packed bytes) of the real Qwen3.5/3.6 tokenizer metadata (248,320 tokens)."""
    meta = vocab_metadata(qwen_vocab(None, N_VOCAB))
    return len(meta), b"".join(pack_kv(k, v, _TOKENIZER_TYPES.get(k)) for k, v in meta.items())


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def gguf_header(n_kv: int, kv_bytes: bytes, specs: list[TensorSpec]) -> tuple[bytes, int]:
    """(header up to the aligned start of the data, data bytes) for n_kv packed key/values and specs."""
    infos, off = [], 0
    for s in specs:
        infos.append(_pack_str(s.name) + struct.pack(f"<I{len(s.ne)}QIQ", len(s.ne), *s.ne, s.qtype, off))
        off += s.n_bytes + _pad(s.n_bytes)
    head = struct.pack("<4sIQQ", b"GGUF", GGUF_VERSION, len(specs), n_kv) + kv_bytes + b"".join(infos)
    return head + bytes(_pad(len(head))), off


# ---- the writer ------------------------------------------------------------------------------------

def _stream(path: str, header: bytes, chunks, total: int, progress: bool, desc: str) -> None:
    """Writes header then chunks to path; generation (caller's iterator) overlaps the writes."""
    from tqdm import tqdm

    q: queue.Queue = queue.Queue(maxsize=4)
    failed: list[BaseException] = []
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress,
               file=sys.stderr, mininterval=0.5)

    with open(path, "wb") as f:
        def writer():
            try:
                while (buf := q.get()) is not None:
                    f.write(buf)
                    bar.update(len(buf))
            except BaseException as e:     # noqa: BLE001 - re-raised on the caller's thread
                failed.append(e)
                while q.get() is not None:
                    pass

        th = threading.Thread(target=writer, name="make-model-writer", daemon=True)
        th.start()
        try:
            q.put(header)
            for buf in chunks:
                if failed:
                    break
                q.put(buf)
        finally:
            q.put(None)
            th.join()
            bar.close()
        if failed:
            raise failed[0]
        f.flush()
        os.fsync(f.fileno())


def _data_chunks(specs, hp, seed, tame, router_skew):
    for s in specs:
        yield from tensor_chunks(s, hp, seed, tame, router_skew)
        if _pad(s.n_bytes):
            yield bytes(_pad(s.n_bytes))


def make_model(preset: str, out: str, *, layers: int | None = None, quant: str | None = None,
               router_skew: float = 0.0, seed: int = 0, tame: bool = False, progress: bool = True) -> str:
    """Writes a random-weight GGUF of `preset` to `out` (atomically) and returns its path.

    preset: one of PRESETS. layers: cut the model to N layers (pattern [L,L,L,F] from layer 0).
    quant: one of QUANTS (default: the preset's, q8_0 for tiny presets, q4_k_m for real ones).
    router_skew: Zipf exponent of expert popularity (MoE only; 0 = near-uniform random router).
    seed: the data depend only on (seed, tensor name). tame: residual-branch output projections
    (ssm_out, attn_output, ffn_down*) ×0.25. progress: tqdm bar in bytes and a summary line on stderr.
    """
    hp = preset_hparams(preset, layers)
    quant = (quant or PRESETS[preset]["quant"]).lower()
    if router_skew < 0 or not math.isfinite(router_skew):
        raise MakeModelError(f"--router-skew must be a finite number >= 0, got {router_skew}")
    if not 0 <= seed < 2**63:
        raise MakeModelError(f"--seed must be in [0, 2^63), got {seed}")
    specs, notes = plan_tensors(hp, quant)
    if all(hp.recurrent):
        notes.append(f"{hp.n_layer} layer(s) hold no full-attention layer (layer 3 is the first): llama.cpp "
                     f"aborts on such a file (its KV cache has no layer); legacy_engine reads it")
    if router_skew and not hp.is_moe:
        notes.append(f"--router-skew is ignored: {preset} has no router")
    for n in notes:
        print(f"make-model: note: {n}", file=sys.stderr)

    ftype = QUANTS[quant][0]
    p = PRESETS[preset]
    name = p["name"] + (f" ({hp.n_layer} of {p['n_layer']} layers)" if hp.n_layer != p["n_layer"] else "")
    desc = (f"random weights by legacy-engine make-model: preset {preset}, layers {hp.n_layer}, quant {quant}, "
            f"seed {seed}, router_skew {router_skew:g}, tame {tame}")
    kvs = [pack_kv("general.architecture", hp.arch), pack_kv("general.type", "model"),
           pack_kv("general.name", name), pack_kv("general.description", desc)]
    kvs += [pack_kv(k, v, t) for k, v, t in arch_metadata(hp)]
    kvs += [pack_kv("general.file_type", ftype, GGUFValueType.UINT32),
            pack_kv("general.quantization_version", 2, GGUFValueType.UINT32)]
    n_tok, tok_bytes = tokenizer_kv()
    header, data_bytes = gguf_header(len(kvs) + n_tok, b"".join(kvs) + tok_bytes, specs)
    total = len(header) + data_bytes

    out = os.fspath(out)
    t0 = time.perf_counter()
    with written_atomically(out) as tmp:
        _stream(tmp, header, _data_chunks(specs, hp, seed, tame, router_skew), total, progress,
                os.path.basename(out))
    dt = time.perf_counter() - t0
    if progress:
        print(f"make-model: wrote {out}: {total:,} bytes ({total / 2**30:.2f} GiB) in {dt:.1f} s, "
              f"{total / dt / 1e6:.0f} MB/s", file=sys.stderr)
    return out


# ---- command line ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="legacy-engine make-model",
        description="Write a random-weight Qwen3.5/3.6 GGUF with the real shapes, tokenizer and llama.cpp "
                    "quant mix, in llama-quantize's tensor order. Loads in llama.cpp and in legacy_engine.")
    p.add_argument("--preset", required=True, choices=list(PRESETS),
                   help="model shape: real configs (qwen3.5-0.8b, qwen3.5-9b, qwen3.6-35b-a3b) or tiny ones "
                        "with the real structure (tiny-moe: the demo model; tiny-dense)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep only the first N layers (pattern [L,L,L,F] from layer 0); default: all")
    p.add_argument("--quant", choices=list(QUANTS), default=None, type=str.lower,
                   help="tensor types: q4_k_m / q5_k_m / mxfp4_moe are llama.cpp's mixes; the others put every "
                        "quantisable weight in that type (norms, router, conv, ssm_a/dt stay F32). "
                        "Default: q8_0 for tiny presets, q4_k_m for real ones")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="ALPHA",
                   help="MoE only: expert popularity ∝ rank^-ALPHA (Zipf), ranks shuffled per layer by the seed; "
                        "0 (default) = plain random router, near-uniform")
    p.add_argument("--seed", type=int, default=0, help="random seed; the data depend only on seed and tensor name")
    p.add_argument("--tame", action="store_true",
                   help="scale residual-branch output projections (ssm_out, attn_output, ffn_down*) by 0.25: "
                        "less chaotic under quantisation, for accuracy comparisons")
    target = p.add_mutually_exclusive_group()   # usage: (--out F.gguf | --dry-run), or --mmproj-out alone
    target.add_argument("--out", metavar="F.gguf",
                        help="output path (written atomically); required unless --dry-run or --mmproj-out")
    target.add_argument("--dry-run", action="store_true",
                        help="print the tensor plan (types and bytes) without writing anything")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    v = p.add_argument_group("vision tower (make_mmproj.py)")
    v.add_argument("--mmproj-out", metavar="MMPROJ.gguf",
                   help="also (or, without --out, only) write the preset's vision tower as a random-weight mmproj "
                        "GGUF in llama.cpp's converter layout (clip / qwen3vl_merger)")
    v.add_argument("--mmproj-type", choices=list(MMPROJ_TYPES), default="f16", type=str.lower,
                   help="type of the mmproj's matrices, as the converter's --outtype (f16, like llama.cpp's common "
                        "files; 1-D tensors and the position table stay F32)")
    v.add_argument("--mmproj-depth", type=int, default=None, metavar="N",
                   help="keep only the first N ViT blocks (fast tests); default: the preset's real depth")
    return p


def main(argv: list[str] | None = None) -> int:
    """`legacy-engine make-model …`: returns 0 on success, 1 on a bad request (message on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        if args.dry_run:
            hp = preset_hparams(args.preset, args.layers)
            quant = args.quant or PRESETS[args.preset]["quant"]
            specs, notes = plan_tensors(hp, quant)
            by_type: dict[str, list[int]] = {}
            for s in specs:
                e = by_type.setdefault(s.qtype.name, [0, 0])
                e[0] += 1
                e[1] += s.n_bytes
            total = sum(s.n_bytes for s in specs)
            print(f"{args.preset}, {hp.n_layer} layers, {quant}: {len(specs)} tensors, "
                  f"{total:,} bytes of tensor data ({total / 2**30:.2f} GiB)")
            for t, (c, b) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
                print(f"  {t:8s} {c:5d} tensors {b / 2**30:8.3f} GiB")
            for n in notes:
                print(f"  note: {n}")
            if args.mmproj_out:
                vspecs = plan_mmproj(preset_vision_hparams(args.preset, args.mmproj_depth), args.mmproj_type)
                print(f"vision tower ({args.mmproj_type}): {len(vspecs)} tensors, "
                      f"{sum(mmproj_nbytes(ne, t) for _, ne, t in vspecs):,} bytes of tensor data")
            return 0
        if not args.out and not args.mmproj_out:
            build_parser().error("--out is required (or --dry-run, or --mmproj-out for the vision tower only)")
        if args.out:
            make_model(args.preset, args.out, layers=args.layers, quant=args.quant, router_skew=args.router_skew,
                       seed=args.seed, tame=args.tame, progress=not args.quiet)
        if args.mmproj_out:
            make_mmproj(args.preset, args.mmproj_out, outtype=args.mmproj_type, depth=args.mmproj_depth,
                        seed=args.seed, progress=not args.quiet)
        return 0
    except EngineError as e:
        print(f"legacy-engine make-model: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
