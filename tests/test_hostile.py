"""Hostile files and callers end in clean errors (issue 21).

A structure-aware fuzzer found no memory error in the C core, but Python tracebacks, stalls and, from Python, two
C-API calls that write outside their buffers. Each case here failed before its fix and must now end in a FormatError
(or the fitting EngineError) and, from the CLI, exit 1 with one line:
  1. a 1-D shared-expert tensor without expert_shared_feed_forward_length (IndexError);
  2. tokenizer.ggml.tokens stored as a scalar (TypeError in `info`);
  3. n_vocab = 2**31 (a sparse file) or a context of 3e9 tokens (OverflowError at the cffi boundary);
  4. a merge of two special tokens whose join is missing (a Rust panic in `tokenizers`, a BaseException);
  5. a directory given as the model (IsADirectoryError);
  6. a 96 MiB junk array under an unused key (865 MiB of RSS): left in the file, peak RSS bounded;
  7. non-finite weights: NaN logits are an error naming the position; --check-tensors names the tensor and block;
  8. le_state_write_kv / le_state_read_kv with start + n past INT_MAX, le_moe_routed with a short x (run in a
     subprocess: before the fix they crash the interpreter);
  9. `info` with a malformed cached machine.json.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from gguf_writer import add_key, hparam_metadata, small_hparams, write_gguf
from legacy_engine.tools import cli
from legacy_engine.format import gguf_file as gf
from legacy_engine.core.errors import ContextLengthError, FormatError
from legacy_engine.format.gguf_file import GGUFArray, GGUFFile
from legacy_engine.format.gguf_model import F16_SCALES, ModelFile, check_tensor_values, expected_tensors
from legacy_engine.cpu.model import Model

pytestmark = pytest.mark.cpu

T = GGMLQuantizationType
# a 96-token vocabulary for small_hparams: "t1" encodes to [2]
TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
             "tokenizer.ggml.tokens": ["t", "1", "t1"] + [f"x{i}" for i in range(93)],
             "tokenizer.ggml.token_type": [1] * 96, "tokenizer.ggml.merges": ["t 1"]}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """The CLI's cache (machine.json, demo model) in a fresh folder per test."""
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def run_cli(capsys, *argv) -> tuple[int, str]:
    """cli.main(argv) -> (exit code, stderr)."""
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: int, err: str, match: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith("legacy-engine: error: ") and match in lines[0], err


def poke(path, name: str, index: int, value: bytes) -> None:
    """Writes `value` over element `index` of tensor `name` (len(value) bytes per element) in the file."""
    t = GGUFFile(path).tensors[name]
    with open(path, "r+b") as f:
        f.seek(t.offset + index * len(value))
        f.write(value)


NAN32 = struct.pack("<f", float("nan"))


# ------------------------------------------------------------------------------------------------ 1, 2, 5: the reader

def test_1d_shared_expert_without_its_length_key(tmp_path):
    hp = small_hparams("qwen35moe")
    p = write_gguf(tmp_path / "m.gguf", hp, drop_keys=["qwen35moe.expert_shared_feed_forward_length"],
                   reshape={"blk.0.ffn_up_shexp.weight": (hp.n_embd,)})
    with pytest.raises(FormatError, match=r"blk\.0\.ffn_up_shexp\.weight.*expert_shared_feed_forward_length"):
        ModelFile.open(p)


def test_tokens_stored_as_a_scalar(tmp_path, capsys):
    p = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35"), extra_keys={"tokenizer.ggml.tokens": 7,
                                                                             "tokenizer.ggml.model": "gpt2"})
    with pytest.raises(FormatError, match="tokenizer.ggml.tokens should be an array"):
        ModelFile.open(p)
    assert_one_line_error(*run_cli(capsys, "info", p), "tokenizer.ggml.tokens should be an array")


def test_directory_as_model(tmp_path, capsys):
    with pytest.raises(FormatError, match="is a directory"):
        GGUFFile(tmp_path)
    assert_one_line_error(*run_cli(capsys, "info", tmp_path), "is a directory")


# ------------------------------------------------------------------------------------------------ 3: C int ranges

def write_sparse_gguf(path, hp, ne: dict[str, tuple[int, ...]], types: dict[str, T]) -> str:
    """hp's tensors (shapes `ne` and types `types` where given, else f32) with their data section a hole: a file of
    any apparent size that costs a few KiB of disk."""
    w = GGUFWriter(str(path), hp.arch)
    for k, v in hparam_metadata(hp).items():
        add_key(w, k, v)
    total = 0
    for name, shape in {**expected_tensors(hp), **ne}.items():
        qt = types.get(name, T.F32)
        block, size = GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(shape, dtype=object)) // block * size
        w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=qt)
        total += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.truncate(-(-os.path.getsize(path) // 32) * 32 + total)
    return str(path)


def test_vocab_of_2_pow_31_rows(tmp_path, capsys):
    # token_embd.weight [64, 2^31] in Q4_0: 72 GiB apparent, a hole on disk. Refused before any page is touched:
    # by the file check, whose tensor schema is the C core's (C ints)
    hp = small_hparams("qwen35moe")
    p = write_sparse_gguf(tmp_path / "big.gguf", hp, {"token_embd.weight": (hp.n_embd, 2**31)},
                          {"token_embd.weight": T.Q4_0})
    try:
        for open_it in (ModelFile.open, lambda p: Model(p, 1)):
            with pytest.raises(FormatError, match=r"n_vocab = 2147483648 \(rows of token_embd.weight\)"):
                open_it(p)
        assert_one_line_error(*run_cli(capsys, "run", p, "-p", "hi", "-n", "1", "-t", "1"), "n_vocab = 2147483648")
    finally:
        os.unlink(p)


def test_context_of_3e9_tokens(tmp_path, capsys):
    # context_length 2^32 - 1 in the file: -c 3000000000 is not clamped to a smaller trained context
    p = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35"),
                   extra_keys={**TOKENIZER, "qwen35.context_length": 2**32 - 1})
    model = Model(p, 1)
    with pytest.raises(ContextLengthError, match="3000000000"):
        model.new_state(3_000_000_000)
    assert_one_line_error(*run_cli(capsys, "run", p, "-p", "t1", "-n", "1", "-t", "1", "-c", "3000000000"),
                          "3000000000")


def test_threads_beyond_the_pool():
    with pytest.raises(ValueError, match="n_threads"):
        Model("unused.gguf", n_threads=3_000_000_000)


# ------------------------------------------------------------------------------------------------ 4: tokenizer panic

def test_merge_of_two_special_tokens(tmp_path, capsys):
    from legacy_engine.format.tokenizer import Tokenizer

    meta = {**TOKENIZER, "tokenizer.ggml.tokens": ["a", "b", "ab", "<|x|>", "<|y|>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 3, 3], "tokenizer.ggml.merges": ["a b", "<|x|> <|y|>"]}
    with pytest.raises(FormatError, match=r"merges\[1\] = '<\|x\|> <\|y\|>' makes '<\|x\|><\|y\|>'"):
        Tokenizer.from_metadata(meta)
    assert "panicked" not in capsys.readouterr().err   # refused before tokenizers sees it: no Rust backtrace
    meta["tokenizer.ggml.merges"] = ["a b", "<|x|> q"]   # a missing part: tokenizers' own (plain) error, named
    with pytest.raises(FormatError, match=r"merges\[1\] = '<\|x\|> q'"):
        Tokenizer.from_metadata(meta)


# ------------------------------------------------------------------------------------------------ 6: junk arrays

def add_junk_array(src, dst, kind: str, nbytes: int) -> None:
    """Copies GGUF src to dst with one more key, general.junk: a u8 array of ~nbytes, or ~nbytes of empty strings
    (and one 4-byte string); its size keeps the data section aligned to 32."""
    raw = open(src, "rb").read()
    key = b"general.junk"
    head = struct.pack("<Q", len(key)) + key
    if kind == "u8":
        n = nbytes - (len(head) + 16 + nbytes) % 32
        kv = head + struct.pack("<IIQ", 9, 0, n) + bytes(n)
    else:
        n = nbytes // 8
        while (len(head) + 16 + 8 * n + 4) % 32:
            n -= 1
        kv = head + struct.pack("<IIQ", 9, 8, n) + bytes(8 * (n - 1)) + struct.pack("<Q", 4) + b"abcd"
    out = bytearray(raw[:24]) + kv + raw[24:]
    struct.pack_into("<Q", out, 16, struct.unpack_from("<Q", raw, 16)[0] + 1)
    with open(dst, "wb") as f:
        f.write(out)


PEAK_RSS = textwrap.dedent("""
    import json, resource, sys
    from legacy_engine.format.gguf_file import GGUFFile
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    f = GGUFFile(sys.argv[1])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"kib": after - before, "junk": type(f.metadata["general.junk"]).__name__}))
""")

# Peak RSS added by opening a file with a 96 MiB junk array (measured 2026-11-26, see the report in the PR):
#   u8:      +865 MiB before (a list of 96M ints), +3 MiB after (skipped without a touch);
#   strings: +193 MiB before (12M str objects), +97 MiB after: the file's own pages, mapped while their lengths are
#            walked (page cache, not private memory).
JUNK_RSS_MIB = {"u8": 32, "str": 160}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["u8", "str"])
def test_junk_array_is_not_materialised(tmp_path, kind):
    src = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35moe"))
    p = tmp_path / "junk.gguf"
    add_junk_array(src, p, kind, 96 << 20)
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(p)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    print(f"\n{kind}: peak RSS +{got['kib'] / 1024:.0f} MiB opening a file with a 96 MiB junk array")
    assert got["junk"] == "GGUFArray" and got["kib"] < JUNK_RSS_MIB[kind] * 1024
    assert ModelFile.open(p).hparams.n_layer == 4     # the model itself is untouched


def test_lazy_arrays_read_on_demand(tmp_path, monkeypatch):
    monkeypatch.setattr(gf, "LAZY_ARRAY_BYTES", 64)
    words = [f"w{i}" for i in range(40)]
    p = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35moe"),
                   extra_keys={**TOKENIZER, "general.junk_u32": list(range(100)), "general.junk_str": words,
                               "general.small": [1, 2, 3]})
    f = GGUFFile(p)
    assert isinstance(f.metadata["general.junk_u32"], GGUFArray) and f.metadata["general.junk_u32"].count == 100
    assert f.array("general.junk_u32") == list(range(100))
    assert isinstance(f.metadata["general.junk_str"], GGUFArray) and f.array("general.junk_str") == words
    assert f.metadata["general.small"] == [1, 2, 3] == f.array("general.small")
    # the arrays the engine reads stay lists, whatever their size
    assert f.metadata["tokenizer.ggml.tokens"] == TOKENIZER["tokenizer.ggml.tokens"]
    assert f.metadata["qwen35moe.rope.dimension_sections"] == [3, 3, 2, 0]
    assert f.is_array("general.junk_str") and f.value_type("general.junk_str") == gf.GGUFValueType.STRING


def test_lazy_array_still_bounds_checked(tmp_path, monkeypatch):
    # a truncated string array under an unused key: skipped, but still a FormatError, not a read past the end
    monkeypatch.setattr(gf, "LAZY_ARRAY_BYTES", 64)
    raw = struct.pack("<IIQQ", 0x46554747, 3, 0, 1)
    key = b"general.junk"
    raw += struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, 3) + struct.pack("<Q", 2) + b"ab"
    raw += struct.pack("<Q", 2**40) + b"\0" * 16
    p = tmp_path / "t.gguf"
    p.write_bytes(raw)
    with pytest.raises(FormatError, match=r"truncated: 'general.junk'\[1\]"):
        GGUFFile(p)


# ------------------------------------------------------------------------------------------------ 7: non-finite

def test_nan_weight_gives_a_clear_error(tmp_path, capsys):
    p = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35moe"), extra_keys=TOKENIZER)
    good = Model(p, 1)
    assert good.tensor_check is None
    st = good.new_state(64)
    assert np.isfinite(good.forward(st, [1, 2, 3], all_logits=True)).all()
    poke(p, "output_norm.weight", 5, NAN32)
    bad = Model(p, 1)                                   # loads: nothing reads the values
    st = bad.new_state(64)
    with pytest.raises(FormatError, match=r"non-finite logits at position 0; run with --check-tensors"):
        bad.forward(st, [1, 2, 3], all_logits=True)
    st = bad.new_state(64)
    with pytest.raises(FormatError, match="position 2"):   # only the last row is returned: its position
        bad.forward(st, [1, 2, 3])
    with pytest.raises(FormatError, match=r"'output_norm.weight' \(F32, ne=\[64\]\): element 5 \(row 0, column 5\)"):
        Model(p, 1, check_tensors=True)
    assert_one_line_error(*run_cli(capsys, "info", p, "--check-tensors"), "output_norm.weight")
    assert_one_line_error(*run_cli(capsys, "run", p, "-p", "t1", "-n", "2", "-t", "1"), "non-finite logits")
    assert_one_line_error(*run_cli(capsys, "run", p, "-p", "t1", "-n", "2", "-t", "1", "--check-tensors"),
                          "'output_norm.weight'")


def test_check_tensors_clean_file(tmp_path, capsys):
    p = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35moe"))
    m = Model(p, 1, check_tensors=True)
    assert m.tensor_check["tensors"] == len(m.file.tensors) and m.tensor_check["unchecked"] == []
    assert m.tensor_check["bytes"] == sum(t.n_bytes for t in m.file.tensors.values())
    assert cli.main(["info", str(p), "--check-tensors"]) == 0
    assert "tensor values: finite" in capsys.readouterr().out


QUANT_TYPES = [*F16_SCALES, T.Q8_K, T.MXFP4, T.F32, T.F16, T.BF16]


def quant_tensor(qt: T, rows: int, rng) -> np.ndarray:
    """uint8[rows, row bytes] of 256-wide rows of type qt: random quants, every scale 1.0 (finite)."""
    block, size = GGML_QUANT_SIZES[qt]
    if qt == T.F32:
        return rng.standard_normal((rows, 256)).astype(np.float32).view(np.uint8)
    if qt == T.F16:
        return rng.standard_normal((rows, 256)).astype(np.float16).view(np.uint8)
    if qt == T.BF16:
        return (rng.standard_normal((rows, 256)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(
            np.uint8).reshape(rows, 512)
    blocks = rng.integers(0, 256, (rows * 256 // block, size), dtype=np.uint8)
    for _, off in F16_SCALES.get(qt, ()):
        blocks[:, off:off + 2] = np.frombuffer(struct.pack("<e", 1.0), np.uint8)
    if qt == T.Q8_K:
        blocks[:, 0:4] = np.frombuffer(struct.pack("<f", 1.0), np.uint8)
    if qt == T.MXFP4:
        blocks[:, 0] = 127
    return blocks.reshape(rows, -1)


def write_typed(path, tensors: dict[str, tuple[T, np.ndarray]]) -> str:
    w = GGUFWriter(str(path), "qwen35")
    for name, (qt, data) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("qt", QUANT_TYPES, ids=lambda t: t.name.lower())
def test_check_tensors_finds_the_bad_block(tmp_path, qt):
    rng = np.random.default_rng(int(qt))
    rows = 4
    data = {f"t.{q.name}": (q, quant_tensor(q, rows, rng)) for q in QUANT_TYPES}
    rep = check_tensor_values(GGUFFile(write_typed(tmp_path / "good.gguf", data)))
    assert rep["tensors"] == len(QUANT_TYPES) and rep["unchecked"] == []

    block, size = GGML_QUANT_SIZES[qt]
    raw = data[f"t.{qt.name}"][1].reshape(-1)
    b = raw.size // size - 2                             # a block of the last row
    if qt in (T.F32, T.F16, T.BF16):
        at, bad = b * size, {T.F32: NAN32, T.F16: struct.pack("<e", float("inf")), T.BF16: b"\x80\x7f"}[qt]
        want = rf"element {b} \(row {b // 256}, column {b % 256}\) is (nan|inf)"
    else:
        off = F16_SCALES[qt][-1][1] if qt in F16_SCALES else 0   # the last scale field (dmin where there is one)
        at, bad = b * size + off, {T.Q8_K: NAN32, T.MXFP4: b"\xff"}.get(qt, struct.pack("<e", float("nan")))
        per_row = 256 // block
        want = (rf"block {b} \(row {b // per_row}, columns {b % per_row * block}\.\.{b % per_row * block + block - 1}\)"
                rf" has a non-finite")
    raw[at:at + len(bad)] = np.frombuffer(bad, np.uint8)
    p = write_typed(tmp_path / "bad.gguf", data)
    with pytest.raises(FormatError, match=rf"tensor 't\.{qt.name}' \({qt.name}, ne=\[256, {rows}\]\): {want}"):
        check_tensor_values(GGUFFile(p))


# ------------------------------------------------------------------------------------------------ 8: C API callers

HOSTILE_CALLS = textwrap.dedent("""
    import json, sys
    import numpy as np
    from legacy_engine.cpu.model import Model
    m = Model(sys.argv[1], 1)
    st = m.new_state(16)
    n_attn, row = 1, m.hparams.n_head_kv * m.hparams.head_dim

    def outcome(fn):
        try:
            fn()
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    one = bytes(st.kv_nbytes(1))
    res = {
        "write_kv past INT_MAX": outcome(lambda: st.write_kv(2**31 - 1, 1, one)),
        "read_kv past INT_MAX": outcome(lambda: st.read_kv_into(2**31 - 1, 1, bytearray(one))),
        "write_kv start 2^31": outcome(lambda: st.write_kv(2**31, 1, one)),
        "kv_nbytes(2^31-1)": st.kv_nbytes(2**31 - 1) == 4 * 2 * n_attn * (2**31 - 1) * row,
        "write_kv in range": outcome(lambda: st.write_kv(15, 1, one)),
        "moe_routed short x": outcome(lambda: m.native.moe_routed(0, np.ones(3, np.float32), np.array([0, 1]),
                                                                  np.ones(2, np.float32))),
        "moe_routed long x": outcome(lambda: m.native.moe_routed(0, np.ones(65, np.float32), np.array([0, 1]),
                                                                 np.ones(2, np.float32))),
        "moe_routed": outcome(lambda: m.native.moe_routed(0, np.ones(64, np.float32), np.array([0, 1]),
                                                          np.ones(2, np.float32))),
        "moe_routed layer 2^31": outcome(lambda: m.native.moe_routed(2**31, np.ones(64, np.float32), np.array([0]),
                                                                     np.ones(1, np.float32))),
    }
    print(json.dumps(res))
""")


def test_c_api_rejects_hostile_arguments(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35moe"))
    out = subprocess.run([sys.executable, "-c", HOSTILE_CALLS, p], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"crashed (rc {out.returncode}): {out.stderr[-2000:]}"
    res = json.loads(out.stdout)
    assert res["write_kv past INT_MAX"].startswith("NativeError") and "outside the context of 16" in \
        res["write_kv past INT_MAX"]
    assert res["read_kv past INT_MAX"].startswith("NativeError")
    assert res["write_kv start 2^31"].startswith("ValueError") and "KV start" in res["write_kv start 2^31"]
    assert res["kv_nbytes(2^31-1)"] is True
    assert res["write_kv in range"] == "ok"
    assert res["moe_routed short x"] == "ValueError: x has 3 elements, the model's n_embd is 64"
    assert res["moe_routed long x"].startswith("ValueError")
    assert res["moe_routed"] == "ok"
    assert res["moe_routed layer 2^31"].startswith("ValueError: layer = 2147483648")


# ------------------------------------------------------------------------------------------------ 9: planner cache

@pytest.mark.parametrize("content", ['{"k": {"nope": 1}}', "[1, 2]", '{"k": 5}'])
def test_info_with_a_malformed_machine_cache(tmp_path, capsys, content):
    d = tmp_path / "cache"
    d.mkdir(exist_ok=True)
    (d / "machine.json").write_text(content)
    p = write_gguf(tmp_path / "m.gguf", small_hparams("qwen35"))
    assert cli.main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "Planner" in out and "model    " in out


def test_info_when_the_planner_raises(tmp_path, capsys, monkeypatch):
    from legacy_engine.plan import probe

    def broken():
        raise KeyError("cpu_read_gbps")
    monkeypatch.setattr(probe, "cached_machines", broken)
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "KeyError" in data["planner_probes"]["error"]
