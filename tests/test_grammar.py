"""serve/grammar.py: response_format -> llguidance grammar, its masks over our vocabulary, the sampler around them."""
import json

import numpy as np
import pytest

from legacy_engine.format.tokenizer import Tokenizer
from legacy_engine.format.vocab import qwen_vocab, vocab_metadata
from legacy_engine.serve.grammar import THINK_END, ConstrainedSampler, GrammarError, grammar_of, lltokenizer
from legacy_engine.serve.sampling import Sampler, SamplingParams

N_VOCAB = 248_320      # the models' logit rows (the tokenizer's ids and padding)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(vocab_metadata(qwen_vocab()))


class Scripted:
    """A sampler that draws the highest logit (what the mask left): the grammar decides, the logits pick."""

    def sample(self, logits, history=None):
        return int(np.argmax(logits))


def rows_preferring(tok, text: str, n: int):
    """Logit rows that each prefer, in order, the tokens of `text`; then rows of noise."""
    ids = tok.encode(text, special=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        x = rng.normal(size=N_VOCAB).astype(np.float32)
        if i < len(ids):
            x[ids[i]] = 50.0
        yield x


def test_formats_and_errors():
    assert grammar_of(None) is None and grammar_of({"type": "text"}) is None
    assert grammar_of({"type": "json_object"}) and grammar_of({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}):
        with pytest.raises(GrammarError, match="response_format"):
            grammar_of(bad)


def test_masked_draws_make_a_valid_document(tok):
    """Noise logits through the mask: whatever the draw, the text is a document of the schema, and the sampler says
    it is complete at its last token."""
    for seed in range(4):
        cs = ConstrainedSampler(Sampler(SamplingParams(temperature=1.0, seed=seed)), tok, N_VOCAB,
                                grammar_of({"type": "json_schema", "json_schema": {"schema": SCHEMA}}))
        out, rng = [], np.random.default_rng(seed)
        while not cs.stopped:
            out.append(cs.sample(rng.normal(size=N_VOCAB).astype(np.float32) * 3))
            assert len(out) < 200
        doc = json.loads(tok.decode(out))
        assert set(doc) == {"ok", "n"} and type(doc["ok"]) is bool and 0 <= doc["n"] <= 99


def test_mask_is_exactly_the_grammars(tok):
    """The first mask of a json_object: '{'-led tokens are allowed, a letter-led one is not; the padding rows past
    the tokenizer's vocabulary never are."""
    cs = ConstrainedSampler(Scripted(), tok, N_VOCAB, grammar_of({"type": "json_object"}))
    allowed = cs.allowed()
    assert allowed.shape == (N_VOCAB,) and allowed[tok.encode("{", special=False)[0]]
    assert not allowed[tok.encode("hello", special=False)[0]] and not allowed[tok.n_vocab:].any()


def test_document_starts_after_the_reasoning(tok):
    """armed=False (thinking on): free text until </think> is drawn, then the constraint."""
    g = grammar_of({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    cs = ConstrainedSampler(Scripted(), tok, N_VOCAB, g, armed=False)
    out = []
    for x in rows_preferring(tok, "hmm, fine" + THINK_END + '{"ok": true, "n": 5}', 60):
        out.append(cs.sample(x))
        if cs.stopped:
            break
    text = tok.decode(out)
    assert text.startswith("hmm, fine" + THINK_END)
    assert json.loads(text.split(THINK_END, 1)[1]) == {"ok": True, "n": 5}
    # armed from the start (thinking off), the same rows cannot start with the reasoning's text
    armed = ConstrainedSampler(Scripted(), tok, N_VOCAB, g)
    assert tok.decode([armed.sample(next(rows_preferring(tok, "hmm", 1)))]).startswith("{")


def test_lltokenizer_is_built_once(tok):
    assert lltokenizer(tok, N_VOCAB) is lltokenizer(tok, N_VOCAB)
