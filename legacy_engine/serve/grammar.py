"""Constrained decoding for `response_format` (json_object, json_schema): llguidance's token masks in the sampler.

llguidance (Microsoft's grammar engine, the one llama.cpp, vLLM and SGLang link) compiles a JSON schema to a grammar
and, at each step, computes which tokens keep the output a prefix of a valid document (a bitmask over the
vocabulary, tens of microseconds a token); the sampler draws from the logits with every other token at -inf, then
the matcher consumes the token drawn. llguidance sees our vocabulary through a TokenizerWrapper: the bytes of every
token (format.tokenizer's table: what the GGUF's ids decode to) and our BPE for text, so masks agree with the ids the
model was trained on.

With thinking on (the prompt ends in an open <think>), the constraint starts after the model closes its reasoning
(</think>): the reasoning is free text, the answer is the document."""
from __future__ import annotations

import json
import threading
import weakref

import numpy as np

from ..format.tokenizer import Tokenizer

THINK_END = "</think>"
# JSON as json.dumps writes it (the form models saw most): no free whitespace, which a weak or random model would
# otherwise fill the document with; a schema's own "x-guidance" options override these
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_LOCK = threading.Lock()
_LLTOKENIZERS: "weakref.WeakKeyDictionary[Tokenizer, object]" = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A response_format that cannot become a grammar (the message says why; the server answers 400)."""


class _Vocab:
    """What llguidance's TokenizerWrapper reads: token bytes, EOS / BOS, special ids, and text -> ids."""

    def __init__(self, tok: Tokenizer):
        self.tokens = [tok.token_bytes(i) for i in range(tok.n_vocab)]
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eos_ids)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = sorted(i for t in tok.control_tokens if (i := tok.id_of(t)) is not None)
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, special=False, add_bos=False)


def lltokenizer(tok: Tokenizer, n_vocab: int):
    """llguidance's view of `tok` for a model of n_vocab logits (built once per tokenizer: ~1 s for 248k tokens).
    The EOS tokens are every end-of-generation token of the vocabulary (<|im_end|>, <|endoftext|>)."""
    import llguidance

    with _LOCK:
        lt = _LLTOKENIZERS.get(tok)
        if lt is None:
            lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tok)), n_vocab=n_vocab,
                                        eos_token=sorted(tok.eos_ids))
            _LLTOKENIZERS[tok] = lt
        return lt


def grammar_of(response_format: dict | None) -> str | None:
    """The llguidance grammar of an OpenAI response_format, None for text. GrammarError for a malformed one."""
    import llguidance

    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: dict = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise GrammarError("response_format json_schema needs {'json_schema': {'name': …, 'schema': {…}}}")
        schema = spec.get("schema", {})
    else:
        raise GrammarError(f"response_format type {kind!r}: expected 'text', 'json_object' or 'json_schema'")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"response_format's schema cannot be compiled: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise GrammarError(f"response_format's schema cannot be compiled: {err}")
    return grammar


class ConstrainedSampler:
    """A sampler whose draws keep the output inside `grammar`: wraps the request's Sampler (its parameters and seed
    unchanged), masking the logits it is given. armed=False: free until the token `arm` (</think>) is drawn."""

    needs_row = True     # the mask is applied to the whole row: a GPU's candidate sampling cannot take it

    def __init__(self, inner, tok: Tokenizer, n_vocab: int, grammar: str, armed: bool = True):
        import llguidance

        self.inner, self.n_vocab = inner, n_vocab
        self.matcher = llguidance.LLMatcher(lltokenizer(tok, n_vocab), grammar)
        self.armed = armed
        self.arm = tok.id_of(THINK_END)

    @property
    def stopped(self) -> bool:
        """The document is complete (only EOS may follow): the generation ends."""
        return self.armed and self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """bool[n_vocab]: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.n_vocab].astype(bool)

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        if not self.armed:
            t = self.inner.sample(logits, history)
            self.armed = t == self.arm
            return t
        x = np.where(self.allowed(), np.asarray(logits, dtype=np.float32).reshape(-1), np.float32(-np.inf))
        t = self.inner.sample(x, history)
        if not self.matcher.consume_token(t):
            raise RuntimeError(f"the grammar refused token {t} it allowed: {self.matcher.get_error()}")
        return t
