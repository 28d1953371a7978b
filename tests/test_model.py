"""The forward pass against the oracles (../shared/oracle.md): transformers and llama.cpp on the tiny checkpoints.

1. Logits: each tiny kind converted to f32 by our `convert` and by llama.cpp's converter; on both files our logits
   agree with transformers' and with llama.cpp's (F32 KV) within LOGIT_ABS_F32 at every position of a seeded 32- and
   200-token sequence (200 spans four 64-token GDN chunks), for batched prefill, token-by-token decode, prefill then
   decode, and a recurrent (unchunked) batch. llama.cpp itself must meet the same gate against transformers.
2. Greedy continuation of 64 tokens equals transformers' generate(do_sample=False).
3. Negative controls: injected bugs (grouped V heads, interleaved RoPE, router weights not renormalised, `w` for
   `1+w`, decay off by 1 %) must fail the gate; their max |Δ| and argmax agreement are printed.
4. State: save/restore/copy/reset, bit-identical continuation, bad buffers rejected.
5. Bad input: token ids outside the vocabulary, prompts beyond the context, empty prompts, qwen3next files.
6. Committed reference logits (fixtures/reference, fixtures/make_reference.py): the engine matches them without
   torch; transformers regenerates them.

Every measured max |Δ| is printed (pytest -s) and tabulated at the end of the session.
"""
from __future__ import annotations

import hashlib
import shutil
import struct
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import tolerances as tol
from fixtures.make_reference import (KINDS, REFERENCE_DIR, SEQ_LENGTHS, compare, load_reference, load_spec, sequence,
                                     tensor_digest, tiny_gguf)

from legacy_engine.core.errors import ContextLengthError, EngineError, NativeError, UnavailableError
from legacy_engine.format.gguf_file import GGUFFile
from legacy_engine.cpu.model import Model

pytestmark = pytest.mark.cpu

N_THREADS = 2
N_CTX = 256
FILES = ("ours", "llama.cpp")                  # who converted the checkpoint to GGUF
ROUTES = ("prefill", "decode", "prefill+decode", "recurrent")
CHUNK = 64                                     # GDN chunk length of the chunked prefill (spec §2.3)
N_GREEDY = 64


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def measured():
    """Collects every max |Δ| measured here, keyed (kind, file or variant, route/n, comparison); printed at the end of
    the session (pytest -s) as one row per (kind, file, route/n) and one column per comparison."""
    table: dict[tuple[str, str, str, str], float] = {}
    yield table
    if not table:
        return
    rows = defaultdict(dict)
    for (kind, file, route, what), d in table.items():
        rows[kind, file, route][what] = d
    sections = defaultdict(list)                   # one table per set of comparisons
    for key, cells in rows.items():
        sections[tuple(sorted(cells))].append(key)
    print("\n\nmax |Δlogit| measured by test_model.py")
    for cols, keys in sections.items():
        print("\n  " + f"{'kind':<14}{'file / variant':<22}{'route/n':<20}" + "".join(f"{c:>20}" for c in cols))
        for key in sorted(keys):
            print("  " + f"{key[0]:<14}{key[1]:<22}{key[2]:<20}" + "".join(f"{rows[key][c]:>20.3g}" for c in cols))


@pytest.fixture(scope="session")
def tiny_file(tmp_path_factory):
    """tiny_file(kind) -> our f32 GGUF of the tiny checkpoint, rebuilt without torch (make_reference.tiny_gguf)."""
    made, root = {}, tmp_path_factory.mktemp("tiny_gguf")

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = tiny_gguf(kind, root / f"{kind}.f32.gguf")
        return made[kind]
    return get


@pytest.fixture(scope="session")
def models():
    """models(path, **faults) -> a Model, loaded once per (path, faults)."""
    made = {}

    def get(path, **faults) -> Model:
        key = (str(path), tuple(sorted(faults.items())))
        if key not in made:
            made[key] = Model(path, N_THREADS, _faults=faults or None)
        return made[key]
    return get


class HFRun:
    """One transformers model of a tiny checkpoint, with its cached outputs."""

    def __init__(self, hf_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.hf_dir = hf_dir
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.n_vocab = self.model.config.vocab_size
        self._logits: dict[int, np.ndarray] = {}
        self._greedy: dict[tuple, tuple[list[int], float]] = {}

    def logits(self, n: int) -> np.ndarray:
        """float32[n, n_vocab] of sequence(n), one forward over the whole sequence."""
        if n not in self._logits:
            ids = self.torch.as_tensor(sequence(n, self.n_vocab).astype(np.int64)[None])
            with self.torch.no_grad():
                self._logits[n] = self.model(ids).logits[0].float().numpy()
        return self._logits[n]

    def greedy(self, prompt: np.ndarray, n_new: int, eos_ids) -> tuple[list[int], float]:
        """generate(do_sample=False) -> (new ids, the smallest top-1/top-2 logit gap along the way)."""
        key = (tuple(int(t) for t in prompt), n_new, tuple(sorted(eos_ids)))
        if key not in self._greedy:
            self._greedy[key] = self._generate(prompt, n_new, eos_ids)
        return self._greedy[key]

    def _generate(self, prompt, n_new, eos_ids):
        torch = self.torch
        ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64)[None])
        eos = sorted(eos_ids)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                                      eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                                      return_dict_in_generate=True)
        top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
        return out.sequences[0, ids.shape[1]:].tolist(), float((top2[:, 0] - top2[:, 1]).min())


@pytest.fixture(scope="session")
def hf(tiny_hf):
    """hf(kind) -> HFRun of the tiny checkpoint (seed 0); one per kind and session."""
    made = {}

    def get(kind: str) -> HFRun:
        if kind not in made:
            made[kind] = HFRun(tiny_hf(kind))
        return made[kind]
    return get


@pytest.fixture(scope="session")
def our_gguf(tiny_hf, tmp_path_factory):
    """our_gguf(kind) -> our f32 conversion of the live transformers checkpoint."""
    from legacy_engine.tools.convert import convert

    made, root = {}, tmp_path_factory.mktemp("ours")

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = convert(tiny_hf(kind), root / f"{kind}.f32.gguf", "f32", progress=False)
        return made[kind]
    return get


@pytest.fixture(scope="session")
def their_gguf(tiny_hf, llama_cpp_convert, tmp_path_factory):
    """their_gguf(kind) -> llama.cpp's f32 conversion of the live transformers checkpoint."""
    made, root = {}, tmp_path_factory.mktemp("theirs")

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = llama_cpp_convert(tiny_hf(kind), root / f"{kind}.f32.gguf", "f32")
        return made[kind]
    return get


@pytest.fixture
def gguf(request):
    """gguf(kind, file) -> the f32 GGUF converted by `file` ("ours" | "llama.cpp")."""
    def get(kind: str, file: str) -> Path:
        return request.getfixturevalue("our_gguf" if file == "ours" else "their_gguf")(kind)
    return get


@pytest.fixture(scope="session")
def llama():
    """llama(path, n) -> llama.cpp's logits of sequence(n) on the file, float32[n, n_vocab] (F32 KV cache)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llms, cache = {}, {}

    def get(path: Path, n: int) -> np.ndarray:
        key = (str(path), n)
        if key not in cache:
            if str(path) not in llms:
                llms[str(path)] = llama_cpp.Llama(str(path), n_ctx=N_CTX, logits_all=True, type_k=0, type_v=0,
                                                  n_threads=N_THREADS, verbose=False)
            llm = llms[str(path)]
            llm.reset()
            llm.eval(sequence(n, llm.n_vocab()).tolist())
            cache[key] = np.array(llm.scores[:n], dtype=np.float32)
        return cache[key]
    yield get
    for llm in llms.values():
        llm.close()


@pytest.fixture(scope="session")
def ours():
    """ours(model, n, route) -> our logits of sequence(n), float32[n, n_vocab], cached."""
    cache = {}

    def get(model: Model, n: int, route: str = "prefill") -> np.ndarray:
        key = (id(model), n, route)
        if key not in cache:
            cache[key] = run_route(model, sequence(n, model.hparams.n_vocab), route)
        return cache[key]
    return get


# ------------------------------------------------------------------------------------------------ helpers

def run_route(model: Model, ids: np.ndarray, route: str, n_ctx: int = N_CTX) -> np.ndarray:
    """Logits of every position of ids from a fresh state, computed along `route`:
    prefill: one chunked call; decode: one recurrent call per token; prefill+decode: a chunked prefill of
    min(120, n/2) tokens, then one token per call; recurrent: one unchunked call for all tokens."""
    st = model.new_state(n_ctx)
    if route == "prefill":
        return model.forward(st, ids, all_logits=True, chunked=True)
    if route == "recurrent":
        return model.forward(st, ids, all_logits=True, chunked=False)
    k = 0 if route == "decode" else min(120, len(ids) // 2)
    out = [model.forward(st, ids[:k], all_logits=True, chunked=True)] if k else []
    out += [model.forward(st, ids[i:i + 1], all_logits=True, chunked=False) for i in range(k, len(ids))]
    return np.concatenate(out)


def diff(a: np.ndarray, b: np.ndarray) -> tuple[float, int, int]:
    """(max |a − b| over every position and column, the position where it occurs, argmax agreements)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    d = np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=1)
    return float(d.max()), int(d.argmax()), int((a.argmax(1) == b.argmax(1)).sum())


def patched_copy(src: Path, dst: Path, select, fn) -> list[str]:
    """Copies a GGUF and rewrites the f32 data of every tensor whose name `select` accepts with fn(values), in
    place (offsets and sizes from GGUFFile). Returns the names rewritten."""
    shutil.copyfile(src, dst)
    g = GGUFFile(src)
    names = [n for n in g.tensors if select(n)]
    with open(dst, "r+b") as f:
        for name in names:
            t = g.tensors[name]
            assert t.type == 0, f"{name} is not f32"
            x = np.frombuffer(g.data(name).tobytes(), dtype=np.float32)
            y = np.asarray(fn(x), dtype=np.float32)
            assert y.nbytes == t.n_bytes
            f.seek(t.offset)
            f.write(y.tobytes())
    return names


def logits_after(model: Model, state, *calls) -> np.ndarray:
    """Runs calls (ids, chunked) on state and returns all their logits concatenated."""
    return np.concatenate([model.forward(state, ids, all_logits=True, chunked=chunked) for ids, chunked in calls])


# ------------------------------------------------------------------------------------------------ 1. logits

@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("n", SEQ_LENGTHS)
@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, file, n, route, gguf, hf, models, ours, measured):
    got = ours(models(gguf(kind, file)), n, route)
    d, pos, agree = diff(got, hf(kind).logits(n))
    measured[kind, file, f"{route}/{n}", "ours-vs-HF"] = d
    print(f"\n{kind} {file}-converted, {n} tokens, {route}: ours vs transformers max |Δ| = {d:.3g} at position "
          f"{pos}, argmax {agree}/{n}")
    assert d <= tol.LOGIT_ABS_F32


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("n", SEQ_LENGTHS)
@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_llama_cpp(kind, file, n, route, gguf, llama, models, ours, measured):
    path = gguf(kind, file)
    got = ours(models(path), n, route)
    d, pos, agree = diff(got, llama(path, n))
    measured[kind, file, f"{route}/{n}", "ours-vs-llama.cpp"] = d
    print(f"\n{kind} {file}-converted, {n} tokens, {route}: ours vs llama.cpp max |Δ| = {d:.3g} at position {pos}, "
          f"argmax {agree}/{n}")
    assert d <= tol.LOGIT_ABS_F32


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("n", SEQ_LENGTHS)
@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_matches_transformers(kind, file, n, gguf, hf, llama, measured):
    """The bar: llama.cpp on the same file meets the gate too (oracle.md measured 1.2e-4)."""
    d, pos, agree = diff(llama(gguf(kind, file), n), hf(kind).logits(n))
    measured[kind, file, f"llama.cpp/{n}", "llama.cpp-vs-HF"] = d
    print(f"\n{kind} {file}-converted, {n} tokens: llama.cpp vs transformers max |Δ| = {d:.3g} at position {pos}, "
          f"argmax {agree}/{n}")
    assert d <= tol.LOGIT_ABS_F32


# ------------------------------------------------------------------------------------------------ 2. greedy

@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(kind, file, gguf, hf):
    """Session at temperature 0 continues sequence(32) with the ids transformers' generate(do_sample=False) gives;
    both stop at the GGUF tokenizer's end-of-generation ids (the EOS is the last id of both)."""
    from legacy_engine.serve.generate import Engine
    from legacy_engine.serve.sampling import SamplingParams

    eng = Engine(gguf(kind, file), n_threads=N_THREADS, n_ctx=N_CTX)
    prompt = sequence(32, eng.model.hparams.n_vocab)
    res = eng.session().generate(prompt.tolist(), max_tokens=N_GREEDY, params=SamplingParams(temperature=0.0))
    want, gap = hf(kind).greedy(prompt, N_GREEDY, eng.tokenizer.eos_ids)
    print(f"\n{kind} {file}-converted: greedy {len(res.tokens)} tokens ({res.finish_reason}), smallest top-2 gap in "
          f"transformers' run {gap:.3g}")
    assert res.tokens == want
    assert res.finish_reason == ("stop" if want[-1] in eng.tokenizer.eos_ids else "length")


# ------------------------------------------------------------------------------------------------ 3. negative controls

def _norm_w_file(src: Path, dst: Path) -> Path:
    """`w` instead of `1+w`: every `*_norm.weight` but ssm_norm (stored as is) reduced by 1."""
    names = patched_copy(src, dst, lambda n: n.endswith("_norm.weight") and not n.endswith("ssm_norm.weight"),
                         lambda x: x - 1)
    assert any(n.endswith("attn_q_norm.weight") for n in names) and "output_norm.weight" in names
    return dst


def _decay_file(src: Path, dst: Path) -> Path:
    """GDN decay off by 1 %: ssm_a (= −exp(A_log)) × 1.01."""
    assert patched_copy(src, dst, lambda n: n.endswith(".ssm_a"), lambda x: x * 1.01)
    return dst


CONTROLS = {  # name -> (kinds where it is a bug, faults, file patch)
    "gdn_grouped": (("moe", "dense"), {"gdn_grouped": True}, None),            # H_v = 2·H_k only
    "rope_interleaved": (KINDS, {"rope_interleaved": True}, None),
    "no_topk_renorm": (("moe", "moe_hv_eq_hk"), {"no_topk_renorm": True}, None),
    "norm_w": (KINDS, {}, _norm_w_file),
    "decay_1pct": (KINDS, {}, _decay_file),
}


@pytest.mark.oracle
@pytest.mark.parametrize("control,kind", [(c, k) for c, (kinds, _, _) in CONTROLS.items() for k in kinds])
def test_negative_control_fails_gate(control, kind, our_gguf, hf, models, tmp_path, measured):
    """Each injected bug must move max |Δ| above the gate; argmax agreement alone would miss some."""
    _, faults, patch = CONTROLS[control]
    path = our_gguf(kind)
    if patch:
        path = patch(path, tmp_path / f"{kind}-{control}.gguf")
    n = 200
    got = run_route(models(path, **faults), sequence(n), "prefill")
    d, pos, agree = diff(got, hf(kind).logits(n))
    measured[kind, control, f"prefill/{n}", "control-vs-HF"] = d
    print(f"\nnegative control {control} on {kind}: max |Δ| = {d:.3g} (position {pos}), argmax {agree}/{n}")
    assert d > tol.LOGIT_ABS_F32


@pytest.mark.parametrize("kind", ["moe_hv_eq_hk", "dense_tied"])
def test_gdn_grouped_is_a_no_op_when_hv_equals_hk(kind, tiny_file, models):
    """With H_v = H_k the grouped and tiled V-head orders coincide: the fault must not change a bit (so the
    control above tests the head mapping, not something else the flag touches)."""
    path = tiny_file(kind)
    ids = sequence(200)
    assert np.array_equal(run_route(models(path), ids, "prefill"),
                          run_route(models(path, gdn_grouped=True), ids, "prefill"))


# ------------------------------------------------------------------------------------------------ 4. state

@pytest.fixture(scope="module")
def moe(tiny_file, models) -> Model:
    return models(tiny_file("moe"))


def test_save_restore_continues_bit_identically(moe):
    ids = sequence(200)
    st = moe.new_state(N_CTX)
    moe.forward(st, ids[:50], chunked=True)
    blob = st.save()
    assert st.pos == 50
    first = logits_after(moe, st, (ids[50:130], True), (ids[130:135], False))
    st.restore(blob)
    assert st.pos == 50 and st.save() == blob
    again = logits_after(moe, st, (ids[50:130], True), (ids[130:135], False))
    assert np.array_equal(first, again)

    fresh = moe.new_state(N_CTX)                    # a fresh state of the same size …
    fresh.restore(blob)
    assert np.array_equal(first, logits_after(moe, fresh, (ids[50:130], True), (ids[130:135], False)))
    bigger = moe.new_state(2 * N_CTX)               # … and of another size
    bigger.restore(blob)
    assert bigger.pos == 50 and bigger.n_ctx == 2 * N_CTX
    assert np.array_equal(first, logits_after(moe, bigger, (ids[50:130], True), (ids[130:135], False)))


def test_last_layer_ffn_runs_on_the_head_rows(moe):
    """A pass runs its last layer's FFN on the rows the head reads only (native/model.c forward_layers): the last
    logits equal the all-logits pass's last row bit for bit (the row's arithmetic does not depend on the others),
    a pass without logits leaves the state a pass with logits leaves, and a batch's rows (each sequence's last)
    equal the sequences' own passes."""
    ids = sequence(200)
    last = moe.forward(moe.new_state(N_CTX), ids[:150])
    assert last.shape == (1, moe.hparams.n_vocab)
    assert np.array_equal(last[0], moe.forward(moe.new_state(N_CTX), ids[:150], all_logits=True)[-1])
    a, b = moe.new_state(N_CTX), moe.new_state(N_CTX)
    assert moe.forward(a, ids[:150], want_logits=False) is None
    moe.forward(b, ids[:150])
    assert a.save() == b.save()
    assert np.array_equal(moe.forward(a, ids[150:160]), moe.forward(b, ids[150:160]))
    s1, s2 = moe.new_state(N_CTX), moe.new_state(N_CTX)
    rows = moe.forward_batch([s1, s2], [ids[:40], ids[40:100]])
    assert np.array_equal(rows[0], moe.forward(moe.new_state(N_CTX), ids[:40])[0])
    assert np.array_equal(rows[1], moe.forward(moe.new_state(N_CTX), ids[40:100])[0])


def test_copy_from_is_independent(moe):
    ids = sequence(200)
    a, b = moe.new_state(N_CTX), moe.new_state(N_CTX)
    moe.forward(a, ids[:70])
    b.copy_from(a)
    assert b.pos == 70 and b.save() == a.save()
    from_b = logits_after(moe, b, (ids[70:100], True), (ids[100:103], False))
    from_a = logits_after(moe, a, (ids[70:100], True), (ids[100:103], False))   # a untouched by b's run
    assert np.array_equal(from_a, from_b)

    small = moe.new_state(64)
    with pytest.raises(NativeError):                # position 103 does not fit a context of 64
        small.copy_from(a)
    assert small.pos == 0


def test_save_restore_across_chunk_boundaries(moe):
    """Saved mid-chunk (100) and continued across the chunk start at 128; saved at a chunk start (128) and
    continued: equals the uninterrupted single call bit for bit, since chunks are counted from each call's start."""
    ids = sequence(200)
    st = moe.new_state(N_CTX)
    moe.forward(st, ids[:100])
    blob = st.save()
    first = logits_after(moe, st, (ids[100:200], True))
    st.restore(blob)
    assert np.array_equal(first, logits_after(moe, st, (ids[100:200], True)))

    whole = run_route(moe, ids, "prefill")
    st = moe.new_state(N_CTX)
    head = logits_after(moe, st, (ids[:2 * CHUNK], True))
    fresh = moe.new_state(N_CTX)
    fresh.restore(st.save())
    tail = logits_after(moe, fresh, (ids[2 * CHUNK:], True))
    assert np.array_equal(np.concatenate([head, tail]), whole)


def test_reset_equals_a_fresh_state(moe):
    ids = sequence(32)
    st = moe.new_state(N_CTX)
    first = logits_after(moe, st, (ids, True))
    logits_after(moe, st, (ids[:5], False))
    st.reset()
    assert st.pos == 0
    assert np.array_equal(first, logits_after(moe, st, (ids, True)))


def test_decode_steps_do_not_grow_the_scratch(moe):
    """The forward pass's scratch (native/arena.c) is planned per pass and grown only for a longer pass than any
    before: a decode step after the first allocates nothing (the state's growth counter stays for 10 steps), nor
    does a pass no longer than an earlier one; a longer one grows it once."""
    ids = sequence(200)
    st = moe.new_state(N_CTX)
    moe.forward(st, ids[:1])
    grown, size = st.scratch_growths, st.scratch_bytes
    assert grown == 1 and size > 0
    for t in range(1, 11):
        moe.forward(st, ids[t:t + 1])
        assert st.scratch_growths == grown, t
    moe.forward(st, ids[11:111], all_logits=True)  # a longer pass: one growth
    assert st.scratch_growths == grown + 1 and st.scratch_bytes > size
    for t in range(111, 121):                     # decode, then shorter passes: none
        moe.forward(st, ids[t:t + 1])
    moe.forward(st, ids[121:128], chunked=False)
    moe.forward(st, ids[128:190], all_logits=True)
    assert st.scratch_growths == grown + 1
    st.reset()                                    # the scratch is not part of the sequence: kept
    moe.forward(st, ids[:100])
    assert st.scratch_growths == grown + 1


def _with_header(blob: bytes, **fields) -> bytes:
    """blob with state-header fields replaced (native/state.c: u32 magic, version; i32 pos, n_gdn, n_attn, pad)."""
    off = {"magic": (0, "<I"), "version": (4, "<I"), "pos": (8, "<i"), "n_gdn": (12, "<i")}
    out = bytearray(blob)
    for k, v in fields.items():
        o, f = off[k]
        struct.pack_into(f, out, o, v)
    return bytes(out)


def test_restore_rejects_bad_buffers(moe, tiny_file, models):
    """Truncated, foreign, or mis-shaped buffers raise a legacy_engine error and leave the state as it was."""
    ids = sequence(200)
    st = moe.new_state(N_CTX)
    moe.forward(st, ids[:40])
    blob = st.save()
    other = models(tiny_file("moe_hv_eq_hk"))          # H_v = 2: SSM states of another size
    ost = other.new_state(N_CTX)
    other.forward(ost, ids[:40])
    small = moe.new_state(16)
    bad = {"empty": b"", "header only": blob[:40], "truncated by 4 bytes": blob[:-4], "half": blob[:len(blob) // 2],
           "foreign bytes": bytes(len(blob)), "random bytes": np.random.default_rng(0).bytes(len(blob)),
           "another model's state": ost.save(), "bad magic": _with_header(blob, magic=0x12345678),
           "future version": _with_header(blob, version=99), "negative position": _with_header(blob, pos=-1),
           "position past the buffer": _with_header(blob, pos=41), "layer count": _with_header(blob, n_gdn=5)}
    target = moe.new_state(N_CTX)
    moe.forward(target, ids[100:110])
    before = target.save()
    for what, data in bad.items():
        with pytest.raises(EngineError):
            target.restore(data)
        assert target.save() == before, what
    with pytest.raises(EngineError):                   # position 40 does not fit a context of 16
        small.restore(blob)
    assert small.pos == 0
    with pytest.raises(NativeError):                   # states of different models
        st.copy_from(ost)


@pytest.mark.parametrize("splits", [[64], [128], [64, 128], [64, 70, 128], [50], [1, 100], [100, 150], [30, 94]])
def test_prefill_split_across_calls(splits, tiny_file, models, measured):
    """Several prefill calls vs one: bit-identical (logits and the state after, so also any decode after) when every
    split is a multiple of 64, since the chunk grid is the same; otherwise within SPLIT_PREFILL_REL."""
    for kind in ("moe", "dense_tied"):
        model = models(tiny_file(kind))
        ids = sequence(200)
        one = model.new_state(N_CTX)
        whole = logits_after(model, one, (ids[:180], True))
        dec_whole = logits_after(model, one, (ids[180:], False))
        parts = model.new_state(N_CTX)
        split = logits_after(model, parts, *[(p, True) for p in np.split(ids[:180], splits)])
        dec_split = logits_after(model, parts, (ids[180:], False))
        scale = float(np.abs(whole).max())
        d = max(np.abs(split - whole).max(), np.abs(dec_split - dec_whole).max()) / scale
        measured[kind, f"split {splits}", "prefill/180", "rel-vs-one-call"] = d
        print(f"\n{kind} prefill split at {splits}: max |Δ| / max |logit| = {d:.3g}")
        if all(s % CHUNK == 0 for s in splits):
            assert np.array_equal(split, whole) and np.array_equal(dec_split, dec_whole)
            assert parts.save() == one.save()
        else:
            assert d <= tol.SPLIT_PREFILL_REL


def test_session_prefill_batches_equal_one_call(tiny_file, models):
    """Session.prefill runs PREFILL_BATCH (a multiple of 64) tokens per call: the same logits as one call, bit for
    bit, and its state continues identically."""
    from legacy_engine.serve.generate import PREFILL_BATCH, Engine

    assert PREFILL_BATCH % CHUNK == 0
    n = PREFILL_BATCH + 44
    ids = np.random.default_rng(7).integers(0, 4096, n).astype(np.int32)
    eng = Engine(tiny_file("moe"), n_threads=N_THREADS, n_ctx=512)
    sess = eng.session()
    got = sess.prefill(ids.tolist(), all_logits=True)
    st = eng.model.new_state(512)
    want = eng.model.forward(st, ids, all_logits=True)
    assert np.array_equal(got, want)
    assert sess.pos == n and sess.tokens == ids.tolist() and sess.state.save() == st.save()
    assert np.array_equal(sess.decode(5), eng.model.forward(st, [5], chunked=False)[0])


# ------------------------------------------------------------------------------------------------ 5. bad input

@pytest.mark.parametrize("bad", [[4096], [-1], [3, 4096 + 7, 5], [2**31 - 1]])
def test_token_outside_vocabulary(bad, moe):
    """Rejected before anything runs: the state (and so the next logits) stay as they were."""
    ids = sequence(32)
    st = moe.new_state(N_CTX)
    moe.forward(st, ids[:10])
    before = st.save()
    for chunked in (True, False):
        # negative ids stop in the Python wrapper (ValueError), the rest in the C core (NativeError)
        with pytest.raises((NativeError, ValueError), match="outside the vocabulary|non-negative"):
            moe.forward(st, bad, chunked=chunked)
        assert st.pos == 10 and st.save() == before
    ref = moe.new_state(N_CTX)
    moe.forward(ref, ids[:10])
    assert np.array_equal(moe.forward(st, ids[10:]), moe.forward(ref, ids[10:]))


@pytest.mark.parametrize("bad", [np.array([2**32 + 5], dtype=np.int64), np.array([5.7])],
                         ids=["int64-wraps", "float-truncates"])
def test_token_ids_are_not_wrapped_or_truncated(bad, moe):
    st = moe.new_state(N_CTX)
    with pytest.raises((ValueError, EngineError)):
        moe.forward(st, bad)
    assert st.pos == 0


def test_session_token_outside_vocabulary(tiny_file):
    """Session refuses a bad id before anything runs and keeps its conversation."""
    from legacy_engine.serve.generate import Engine

    sess = Engine(tiny_file("moe"), n_threads=N_THREADS, n_ctx=64).session()
    sess.prefill([1, 2, 3])
    before = sess.state.save()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sess.prefill([4096])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sess.decode(-1)
    assert sess.tokens == [1, 2, 3] and sess.pos == 3 and sess.state.save() == before


def test_prompt_longer_than_context(tiny_file):
    """ContextLengthError before anything runs; the session keeps its state."""
    from legacy_engine.serve.generate import Engine

    eng = Engine(tiny_file("moe"), n_threads=N_THREADS, n_ctx=16)
    sess = eng.session()
    ids = sequence(32).tolist()
    with pytest.raises(ContextLengthError):
        sess.prefill(ids[:17])
    assert sess.pos == 0 and sess.tokens == [] and sess.timings.prefill_tokens == 0
    with pytest.raises(ContextLengthError):
        sess.generate(ids[:17], max_tokens=1)
    sess.prefill(ids[:10])
    before = sess.state.save()
    with pytest.raises(ContextLengthError):
        sess.prefill(ids[10:17])
    assert sess.pos == 10 and sess.tokens == ids[:10] and sess.state.save() == before
    sess.prefill(ids[10:16])                          # exactly full is fine
    with pytest.raises(ContextLengthError):
        sess.decode(1)
    st = eng.model.new_state(16)                      # the C core checks too
    with pytest.raises(NativeError, match="exceed the context"):
        eng.model.forward(st, ids[:17])
    assert st.pos == 0


def test_empty_prompt(tiny_file, moe):
    from legacy_engine.serve.generate import Engine

    sess = Engine(tiny_file("moe"), n_threads=N_THREADS, n_ctx=64).session()
    with pytest.raises(ValueError, match="empty"):
        sess.prefill([])
    with pytest.raises(ValueError, match="empty"):
        sess.generate("", max_tokens=4)
    assert sess.pos == 0
    st = moe.new_state(N_CTX)
    with pytest.raises(NativeError, match="no tokens"):
        moe.forward(st, [])


def test_qwen3next_is_unavailable(tmp_path):
    from gguf_writer import small_hparams, write_gguf

    from legacy_engine.serve.generate import Engine

    path = write_gguf(tmp_path / "qwen3next.gguf", small_hparams("qwen3next"))
    with pytest.raises(UnavailableError, match="qwen3next"):
        Model(path, N_THREADS)
    with pytest.raises(UnavailableError):
        Engine(path, n_threads=N_THREADS)


def test_conv_kernel_beyond_the_engine_is_refused(tmp_path):
    """A GDN conv of more taps than the engine's (LE_GDN_MAX_CONV_K, CONV_MAX_K on the GPU) is refused when the model
    loads, with what it has and the most there can be."""
    from gguf_writer import small_hparams, write_gguf

    path = write_gguf(tmp_path / "conv9.gguf", small_hparams("qwen35", ssm_conv_kernel=9))
    with pytest.raises(NativeError, match="conv kernel of 9 taps > 8"):
        Model(path, N_THREADS)


def test_unknown_fault_rejected(tiny_file):
    with pytest.raises(ValueError, match="unknown faults"):
        Model(tiny_file("moe"), N_THREADS, _faults={"rope_sideways": True})


# ----------------------------------------------------------------------------------------------- 6. committed reference

def test_reference_files_match_sha256sums():
    sums = {}
    for line in (REFERENCE_DIR / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        digest, name = line.split("  ", 1)
        sums[name] = digest
    files = {p.name for p in REFERENCE_DIR.iterdir() if p.name != "SHA256SUMS"}
    assert set(sums) == files == {f"{k}.{ext}" for k in KINDS for ext in ("npz", "json")}
    for name, digest in sums.items():
        assert hashlib.sha256((REFERENCE_DIR / name).read_bytes()).hexdigest() == digest, name
    assert sum((REFERENCE_DIR / n).stat().st_size for n in files) < 1_000_000


@pytest.mark.parametrize("kind", KINDS)
def test_engine_matches_committed_reference(kind, tiny_file, models, ours, measured):
    """No torch needed: the checkpoint is rebuilt with numpy (its tensor digest checked) and our logits compared
    with transformers' stored ones at every position (128 columns + top-8 per position, full rows at a few)."""
    ref = load_reference(kind)
    model = models(tiny_file(kind))
    for n in SEQ_LENGTHS:
        assert np.array_equal(ref[f"ids{n}"], sequence(n))
        for route in ("prefill", "decode"):
            d = compare(ref, ours(model, n, route), n)
            measured[kind, "reference", f"{route}/{n}", "ours-vs-stored-HF"] = d
            print(f"\n{kind} {n} tokens {route}: ours vs committed transformers logits max |Δ| = {d:.3g}")
            assert d <= tol.LOGIT_ABS_F32


@pytest.mark.oracle
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_regenerates_committed_reference(kind, hf, our_gguf, measured):
    """The committed values are what transformers computes today, and the torch-free rebuild used above converts
    to exactly the tensors of the live checkpoint."""
    ref, spec = load_reference(kind), load_spec(kind)
    assert tensor_digest(our_gguf(kind)) == spec["gguf_tensor_sha256"]
    for n in SEQ_LENGTHS:
        logits = hf(kind).logits(n)
        d = compare(ref, logits, n)
        measured[kind, "reference", f"HF/{n}", "HF-vs-stored-HF"] = d
        print(f"\n{kind} {n} tokens: transformers now vs committed max |Δ| = {d:.3g}")
        assert d <= tol.LOGIT_ABS_F32


# ------------------------------------------------------------------------------------------------ bench decode
# `legacy-engine bench decode` (legacy_engine/bench.py) on a 4-layer tiny MoE Q4_K_M file: the table prints, one
# row per tier forced, and every number is positive; a stand-in llama-bench binary checks the llama.cpp row.

@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    from legacy_engine.tools.make_model import make_model
    return make_model("tiny-moe", str(tmp_path_factory.mktemp("bench") / "tiny-moe-4.q4_k_m.gguf"), layers=4,
                      quant="q4_k_m", progress=False)


def _table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """The markdown table in `out`: its header cells, and each row's cells by engine."""
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| ")]
    return rows[0], {r[0]: r for r in rows[1:]}


def test_bench_decode_prints_the_table(bench_file, capsys):
    from legacy_engine.core import _native
    from legacy_engine.tools.cli import main
    prev = _native.get_isa()
    assert main(["bench", "decode", bench_file, "--threads", "1", "--pp", "8", "--tg", "2", "--reps", "1",
                 "--isa", "all,f32", "--llama", "off", "--bandwidth", "10"]) == 0
    assert _native.get_isa() == prev                     # the forced tiers are undone
    out = capsys.readouterr().out
    header, rows = _table(out)
    assert header == ["engine", "threads", "pp8 tok/s", "tg2 tok/s", "pp ratio", "tg ratio", "bytes/tok",
                                  "roofline tok/s", "% roofline"]
    tiers = [i for i in _native.ISA_NAMES if _native.isa_supported(i)] + ["f32"]
    assert list(rows) == [f"legacy_engine {t}" for t in tiers]
    for t in tiers:
        assert f"kernels with {t}: Q4_K {t}, Q6_K {t}" in out
    for engine, c in rows.items():
        assert c[1] == "1" and float(c[2]) > 0 and float(c[3]) > 0 and c[4] == c[5] == "-", (engine, c)
        assert c[6].endswith("MiB") and float(c[6].split()[0]) > 0
        roof = float(c[7].split()[0])
        assert c[7].endswith("@ 10.0 GB/s") and roof > 0
        assert float(c[8].split()[0]) == pytest.approx(100 * float(c[3]) / roof, rel=0.02)


def test_bench_decode_llama_bench_row_and_bytes_per_token(bench_file, tmp_path):
    """--llama PATH runs a llama-bench binary (`-o json`), the median of its samples counts; bytes per token are
    every weight of the run but the unrouted experts' share and all but one token_embd row (here tied: LM head)."""
    import json
    import stat
    import sys

    from legacy_engine.tools.bench import bench_decode, decode_table
    from legacy_engine.format.gguf_model import ModelFile
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nassert '-o' in sys.argv and '-t' in sys.argv\n"
                    "print(json.dumps([dict(n_prompt=8, n_gen=0, avg_ns=2e8, samples_ns=[1e8, 3e8, 2e8]),\n"
                    "                  dict(n_prompt=0, n_gen=2, avg_ns=1e8, samples_ns=[1e8, 1e8, 4e8])]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    res = bench_decode(bench_file, [1], pp=8, tg=2, reps=1, isas=["ref"], llama=str(fake), bandwidth=None)
    ours, theirs = res["results"]
    assert theirs["engine"] == "llama.cpp (llama-bench)"
    assert theirs["pp_tok_s"] == pytest.approx(8 / 0.2) and theirs["tg_tok_s"] == pytest.approx(2 / 0.1)
    assert ours["kernels"] == {"Q4_K": "ref", "Q6_K": "ref"} and ours["pp_tok_s"] > 0 and ours["tg_tok_s"] > 0
    row = next(ln for ln in decode_table(res).splitlines() if ln.startswith("| legacy_engine ref"))
    assert f"| {ours['tg_tok_s'] / 20:.2f} |" in row and row.endswith("| - | - |")    # tg ratio; no roofline
    json.dumps(res)
    mf = ModelFile.open(bench_file)
    hp, ts = mf.hparams, mf.tensors.values()
    exps = sum(t.n_bytes for t in ts if "_exps." in t.name)
    assert "output.weight" not in mf.tensors
    routed = exps * hp.n_expert_used // hp.n_expert
    assert res["footprint"]["decode_bytes"] == sum(t.n_bytes for t in ts) - exps + routed


def test_bench_split_cli_runs_cpu_and_llama_rows(bench_file, tmp_path, capsys):
    """`bench split` end to end on the CPU: the cpu strategy's row, and one llama-bench row per --ncmoe entry
    ('cpu': -ngl 0) with --llama-flags passed to each (a stand-in binary records its arguments); decode at the
    same context on both sides (llama-bench -d; prefill from depth 0 only)."""
    import json
    import stat
    import sys

    from legacy_engine.tools.cli import main
    log = tmp_path / "argv.jsonl"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                    "a = sys.argv[1:]; ds = [int(d) for d in a[a.index('-d') + 1].split(',')] if '-d' in a else [0]\n"
                    "print(json.dumps([t for d in ds for t in (dict(n_prompt=8, n_gen=0, n_depth=d, avg_ts=40.0 - d),\n"
                    "                                          dict(n_prompt=0, n_gen=2, n_depth=d, avg_ts=20.0 - d))]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert main(["bench", "split", bench_file, "--vram", "1GiB", "--prompt", "8", "--gen", "2", "--threads", "1",
                 "--strategies", "cpu", "--llama", str(fake), "--ncmoe", "3,cpu", "--llama-flags", "-ub 2048",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in res["rows"]}
    assert set(rows) == {"cpu", "llama.cpp -ngl 99 -ncmoe 3 -ub 2048", "llama.cpp -ngl 0 -ub 2048"}
    assert rows["cpu"]["pp"]["8"] > 0 and rows["cpu"]["tg"] > 0
    # decode after the shortest prompt (8 tokens) on both sides: llama-bench -d 0,8; its prefill from depth 0
    assert rows["llama.cpp -ngl 0 -ub 2048"]["pp"] == {"8": 40.0} and rows["llama.cpp -ngl 0 -ub 2048"]["tg"] == 12.0
    assert res["tg_depths"] == [8] and list(rows["cpu"]["tg_at"]) == ["8"]
    argv = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [a[a.index("-ngl") + 1] for a in argv] == ["99", "0"] and all(a[a.index("-d") + 1] == "0,8" for a in argv)
    assert all(a[a.index("-ub") + 1] == "2048" and a[a.index("-t") + 1] == "1" for a in argv)
    assert "-ncmoe" in argv[0] and "-ncmoe" not in argv[1]
    assert res["mmap"] is True
    # --tg-depth 0,4: decode from an empty context (llama-bench's own default) and after 4 tokens; tg is depth 0's
    log.unlink()
    assert main(["bench", "split", bench_file, "--vram", "1GiB", "--prompt", "8", "--gen", "2", "--threads", "1",
                 "--strategies", "cpu", "--llama", str(fake), "--ncmoe", "cpu", "--tg-depth", "0,4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    cpu, llama = res["rows"]
    assert list(cpu["tg_at"]) == ["0", "4"] and cpu["tg"] == cpu["tg_at"]["0"] > 0
    assert llama["tg_at"] == {"0": 20.0, "4": 16.0} and llama["tg"] == 20.0 and llama["pp"] == {"8": 40.0}
    assert json.loads(log.read_text())[json.loads(log.read_text()).index("-d") + 1] == "0,4"
    assert main(["bench", "split", bench_file, "--vram", "1GiB", "--tg-depth", "x"]) != 0
    assert "--tg-depth takes token counts" in capsys.readouterr().err
    # --no-mmap: the weights read into anonymous memory, said in the result and the table's header
    assert main(["bench", "split", bench_file, "--vram", "1GiB", "--prompt", "8", "--gen", "2", "--threads", "1",
                 "--strategies", "cpu", "--no-mmap", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mmap"] is False and res["rows"][0]["tg"] > 0
    from legacy_engine.tools.bench_split import print_split
    print_split(res)
    assert "weights in anonymous memory" in capsys.readouterr().out
