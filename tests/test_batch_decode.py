"""Batched decode (le_forward_seqs, Model.forward_batch): one pass advancing several sequences, each in its own state.

The contract is bit-equality, no tolerance: for every sequence of a batched pass, its logits and its state after the
pass (le_state_save bytes: position, conv + SSM states, KV rows) equal those of the same tokens run alone through
le_forward. Why it holds (native/model.c): every op but the mixers works per row (RMSNorm, the per-row activation
quantisation and one vec_dot / f32 dot per (weight row, token), the MoE's per-token top-k and its combine in
ascending expert order, the LM head); the mixers run each sequence's recurrence (its chunks counted from its own
first token) and attention in its own state. A single batch size or one path could hide a dependence on the other
rows, so every test here runs on:
  files  the tiny f32 checkpoints (moe, dense: the f32 path), and small-vocabulary random files of the tiny-moe /
         tiny-dense presets (hidden 256: whole K-quant blocks) as q4_k_m (Q4_K, Q6_K, F32: Q8_K activations) and
         q8_0 (Q8_0 activations)
  paths  the quantised files with the integer kernels on (int8) and off (f32 on dequantised rows)
  tiers  every CPU tier this machine runs, forced in turn (ref, ssse3, avx2, avx512vnni: integer and f32 kernels);
         a tier the CPU lacks skips with the reason.
Tests:
1. Decode: 16 sequences with different prompt lengths (1 .. 130: before, at and across the 64-token GDN chunks)
   each prefilled alone (once per file); for B in BATCHES the first B decode N_STEPS steps batched vs each alone.
2. A mixed pass (continuous batching): 1-token decode rows of some sequences, a 70-token chunk (crossing the 64-token
   GDN chunk) of one, a 5-token piece of another, a fresh state's first tokens, and a sequence with a rope delta (as
   after an image), chunked and not, two passes in a row.
3. Errors, from Python and straight at the C API: no sequences, an empty sequence, a state twice, a state of
   another model, one sequence beyond its context, a token outside the vocabulary: each refused before anything
   runs, every state unchanged (position and saved bytes).
4. Scratch: the model's batch arena grows once per larger pass, never on later decode steps; the states' own
   (le_forward's) are not touched.
"""
from __future__ import annotations

import numpy as np
import pytest

from fixtures.make_reference import tiny_gguf
from gguf_writer import small_quantized
from legacy_engine.core import _native
from legacy_engine.core.errors import ContextLengthError, NativeError
from legacy_engine.cpu.model import Model
from fixtures.isa import isa_forced

pytestmark = pytest.mark.cpu

N_THREADS = 2
N_CTX = 256
BATCHES = (1, 2, 3, 5, 8, 16)
N_STEPS = 3
# prompt lengths of the 16 sequences: all different; before, at and across the 64-token GDN chunk boundaries
PROMPTS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 63, 64, 65, 70, 100, 128, 130)
CHUNK = 64                                  # the GDN chunk (native/gdn.c GDN_CHUNK)

FILES = ("moe-f32", "dense-f32", "moe-q4_k_m", "dense-q4_k_m", "moe-q8_0")
PATHS = [(f, "f32") for f in FILES] + [(f, "int8") for f in FILES if not f.endswith("f32")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(name) -> a Model of FILES' name, loaded once."""
    made, root = {}, tmp_path_factory.mktemp("batch_decode")

    def get(name: str) -> Model:
        if name not in made:
            kind, quant = name.split("-")
            if quant == "f32":
                path = tiny_gguf(kind, root / f"{name}.gguf")
            else:
                path = small_quantized(f"tiny-{kind}", quant, root / f"{name}.gguf")
            made[name] = Model(path, N_THREADS)
        return made[name]
    return get


@pytest.fixture(params=_native.ISA_NAMES)
def tier(request):
    """Each CPU tier forced in turn (integer and f32 kernels), the previous one restored after."""
    with isa_forced(request.param) as isa:
        yield isa


@pytest.fixture(params=PATHS, ids=[f"{f}-{p}" for f, p in PATHS])
def model(request, models, tier):
    """A Model with the integer kernels on (int8) or off (f32), put back on after."""
    name, path = request.param
    lower = [t for t in _native.ISA_NAMES[:_native.ISA_NAMES.index(tier)] if _native.isa_supported(t)]
    if path == "f32" and any(_with_isa(t, _native.f32_isa) == _native.f32_isa() for t in lower):
        pytest.skip(f"{tier} has no f32 kernels of its own: its f32 path is {_native.f32_isa()}'s, tested there")
    m = models(name)
    m.native.set_int8(path == "int8")
    if path == "int8":   # the file's matmuls must take the tier's integer kernels, or int8 would test nothing
        from gguf import GGUFReader
        types = {int(t.tensor_type) for t in GGUFReader(m.file.path).tensors} - {0, 1, 30}   # F32 F16 BF16
        served = {_native.kernel_isa(t) for t in types}
        assert served and None not in served, f"{name}: types without an integer kernel: {served}"
    yield m
    m.native.set_int8(True)


def _with_isa(isa: str, fn):
    """fn() with tier isa selected, the current one restored after."""
    prev = _native.get_isa()
    _native.set_isa(isa)
    try:
        return fn()
    finally:
        _native.set_isa(prev)


def tokens(seed: int, n: int, n_vocab: int) -> np.ndarray:
    return np.random.default_rng([2026, 11, 28, seed]).integers(0, n_vocab, n).astype(np.int32)


@pytest.fixture(scope="module")
def prompts_run(models):
    """prompts_run(name) -> the saved state of each PROMPTS sequence prefilled alone, once per file: the common start
    of the alone and batched decode steps (whichever tier ran it; only the steps after it are compared)."""
    made = {}

    def get(m: Model) -> list[bytes]:
        key = str(m.file.path)
        if key not in made:
            made[key] = []
            for s, n in enumerate(PROMPTS):
                st = m.new_state(N_CTX)
                m.forward(st, tokens(s, n, m.hparams.n_vocab))
                made[key].append(st.save())
        return made[key]
    return get


def alone_trajectory(m: Model, starts, steps):
    """Each sequence alone from its start: per decode step (logits row, saved state)."""
    out = []
    for start, toks in zip(starts, steps):
        st = m.new_state(N_CTX)
        st.restore(start)
        out.append([(m.forward(st, [t])[0], st.save()) for t in toks])
    return out


# ------------------------------------------------------------------------------------------------ 1. decode

def test_batched_decode_equals_each_alone(model, prompts_run):
    m, V = model, model.hparams.n_vocab
    starts = prompts_run(m)
    steps = [tokens(100 + s, N_STEPS, V) for s in range(len(PROMPTS))]
    alone = alone_trajectory(m, starts, steps)
    assert len({a[0][0].tobytes() for a in alone}) == len(alone)   # 16 different sequences, 16 different rows
    for B in BATCHES:
        states = [m.new_state(N_CTX) for _ in range(B)]
        for st, start in zip(states, starts):
            st.restore(start)
        for k in range(N_STEPS):
            got = m.forward_batch(states, [[steps[s][k]] for s in range(B)])
            assert got.shape == (B, V)
            for s in range(B):
                want_logits, want_state = alone[s][k]
                assert np.array_equal(got[s], want_logits), f"B={B} step {k}: sequence {s}'s logits differ"
                assert states[s].pos == PROMPTS[s] + k + 1
                assert states[s].save() == want_state, f"B={B} step {k}: sequence {s}'s state differs"


# ------------------------------------------------------------------------------------------------ 2. mixed pass

@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "recurrent"])
def test_mixed_pass_equals_each_alone(model, chunked):
    """Sequences at different positions: 1-token decode rows, a 70-token chunk (64-token GDN chunk + 6), a 5-token
    piece, a fresh state's first 3 tokens, one with rope delta 7; then a second pass of other lengths."""
    m, V = model, model.hparams.n_vocab
    prefix = (5, 0, 64, 30, 1, 17)                  # each sequence's position before the passes
    passes = ((1, 70, 1, 5, 3, 1), (70, 1, 2, 1, 1, 65))
    delta = {4: 7}                                  # sequence 4 rotates at pos + 7 (as after an image)
    alone, batched = [], []
    for s, n in enumerate(prefix):
        a, b = m.new_state(N_CTX), m.new_state(N_CTX)
        if n:
            m.forward(a, tokens(200 + s, n, V))
            b.restore(a.save())
        a.rope_delta = b.rope_delta = delta.get(s, 0)
        alone.append(a)
        batched.append(b)
    for p, lengths in enumerate(passes):
        toks = [tokens(300 + 10 * p + s, n, V) for s, n in enumerate(lengths)]
        want = [m.forward(a, t, chunked=chunked)[0] for a, t in zip(alone, toks)]
        got = m.forward_batch(batched, toks, chunked=chunked)
        for s in range(len(lengths)):
            assert np.array_equal(got[s], want[s]), f"pass {p}: sequence {s} ({lengths[s]} tokens) differs"
            assert batched[s].save() == alone[s].save(), f"pass {p}: sequence {s}'s state differs"
            assert batched[s].rope_delta == delta.get(s, 0)


@pytest.mark.parametrize("name", ["moe-f32", "dense-q4_k_m", "moe-q4_k_m"])
def test_attention_cut_by_threads_changes_no_bit(models, name, tmp_path):
    """The attention core's tasks (how many query heads of a KV head and rows of a sequence each takes) follow the
    thread count; every (row, head) pair's bits do not: a prompt's logits at every position and the decode after
    it are equal with 1 and 5 threads (the tiny files' 2 query heads share a KV head: one thread takes both in a
    task, five take one each). The same for the jobs that quantise a pass's activations (one over every product's
    input rows: the grouped experts' on the quantised MoE file) and gather its routed rows (40 tokens: past
    le_parallel_rows' 32, so they run as jobs)."""
    path = models(name).file.path
    m1, m5 = Model(path, 1), Model(path, 5)
    V = m1.hparams.n_vocab
    prompt, steps = tokens(400, 40, V), tokens(401, 4, V)
    a, b = m1.new_state(N_CTX), m5.new_state(N_CTX)
    assert np.array_equal(m1.forward(a, prompt, all_logits=True), m5.forward(b, prompt, all_logits=True))
    for t in steps:
        assert np.array_equal(m1.forward(a, [t]), m5.forward(b, [t]))
    assert a.save() == b.save()


# ------------------------------------------------------------------------------------------------ 3. errors

@pytest.fixture(scope="module")
def moe(models) -> Model:
    return models("moe-f32")


def prefilled(m: Model, lengths) -> list:
    out = []
    for s, n in enumerate(lengths):
        st = m.new_state(N_CTX)
        m.forward(st, tokens(400 + s, n, m.hparams.n_vocab))
        out.append(st)
    return out


def snapshot(states) -> list:
    return [(st.pos, st.save()) for st in states]


def c_forward_seqs(m: Model, states, token_lists, n_seq: int | None = None) -> int:
    """le_forward_seqs called straight (no Python checks): its status code. The arrays carry one spare entry, so
    that an empty batch still passes valid pointers."""
    ffi, lib = _native.ffi, _native.lib
    toks = np.concatenate([np.asarray(t, dtype=np.int32).reshape(-1) for t in token_lists] + [np.zeros(1, np.int32)])
    n_tok = np.array([len(t) for t in token_lists] + [0], dtype=np.int32)
    logits = np.empty((len(states) + 1, m.hparams.n_vocab), dtype=np.float32)
    ptrs = ffi.new("le_state *[]", [st.ptr for st in states] + [ffi.NULL])
    return lib.le_forward_seqs(m.native.ptr, ptrs, len(states) if n_seq is None else n_seq,
                               ffi.from_buffer("int32_t[]", toks), ffi.from_buffer("int32_t[]", n_tok),
                               ffi.from_buffer("float[]", logits), 1)


def last_error() -> str:
    return _native.ffi.string(_native.lib.le_last_error()).decode()


def test_errors_leave_every_state_unchanged(moe, models):
    m = moe
    states = prefilled(m, (3, 40, N_CTX - 2))            # the last has room for 2 more tokens
    before = snapshot(states)
    other = models("dense-f32").new_state(N_CTX)
    ok = [[1], [2], [3]]
    cases = [
        ("no sequences", ([], []), ValueError, "no sequences"),
        ("an empty sequence", (states, [[1], [], [3]]), ValueError, "sequence 1: no tokens"),
        ("a state twice", ([states[0], states[1], states[0]], ok), ValueError, "share one state"),
        ("another model's state", ([states[0], other, states[2]], ok), ValueError, "sequence 1: its state belongs"),
        ("beyond the context", (states, [[1], [2], [3, 4, 5]]), ContextLengthError, "sequence 2: 3 tokens"),
        ("outside the vocabulary", (states, [[1], [m.hparams.n_vocab], [3]]), ValueError, "sequence 1: token ids"),
        ("negative token", (states, [[1], [2], [-1]]), ValueError, "sequence 2: token ids"),
        ("lists of two lengths", (states, ok[:2]), ValueError, "3 states but 2 token lists"),
    ]
    for what, (sts, toks), exc, msg in cases:
        with pytest.raises(exc, match=msg):
            m.forward_batch(sts, toks)
        assert snapshot(states) == before, what
    # the C core's own checks (a C caller has no Python in front): LE_ERR_INVALID_ARG naming the sequence, before
    # anything runs
    c_cases = [
        ("n_seq 0", ([], [], 0), "0 sequences"),
        ("n_tok 0", (states, [[1], [], [3]], None), "sequence 1: 0 tokens"),
        ("a state twice", ([states[0], states[1], states[0]], ok, None), "sequences 0 and 2 share one state"),
        ("another model's state", ([states[0], other, states[2]], ok, None), "sequence 1: its state belongs"),
        ("beyond the context", (states, [[1], [2], [3, 4, 5]], None), "sequence 2: 3 tokens at position 254"),
        ("outside the vocabulary", (states, [[1], [2, m.hparams.n_vocab], [3]], None), "at index 2 is outside"),
    ]
    for what, (sts, toks, n_seq), msg in c_cases:
        assert c_forward_seqs(m, sts, toks, n_seq) == _native.lib.LE_ERR_INVALID_ARG, what
        assert msg in last_error(), (what, last_error())
        assert snapshot(states) == before, what
    assert other.pos == 0
    # negative control of the above: the same call with room runs and advances every state
    assert c_forward_seqs(m, states, [[1], [2], [3, 4]]) == _native.LE_OK
    assert [st.pos for st in states] == [4, 41, N_CTX]


# ------------------------------------------------------------------------------------------------ 4. scratch

def test_batched_decode_does_not_grow_the_scratch(moe):
    """The batch arena (the model's) is planned per pass from (tokens, largest context): a first pass of 8 grows it,
    later decode steps of 8 or fewer do not, a pass with more tokens grows it once; the states' own arenas
    (le_forward's) are left alone."""
    m = Model(moe.file.path, N_THREADS)                    # a fresh model: its arena not yet grown
    states = prefilled(m, (4, 9, 16, 25, 36, 49, 64, 81))
    own = [(st.scratch_growths, st.scratch_bytes) for st in states]
    assert m.native.batch_growths == 0
    m.forward_batch(states, [[s] for s in range(8)])
    assert m.native.batch_growths == 1
    for k in range(5):
        m.forward_batch(states, [[k] for _ in range(8)])
        m.forward_batch(states[:3], [[k] for _ in range(3)])
    assert m.native.batch_growths == 1
    m.forward_batch(states[:2], [[1] * 40, [2]])           # 41 tokens: a larger plan
    assert m.native.batch_growths == 2
    for k in range(3):
        m.forward_batch(states, [[k] for _ in range(8)])
    assert m.native.batch_growths == 2
    assert [(st.scratch_growths, st.scratch_bytes) for st in states] == own
