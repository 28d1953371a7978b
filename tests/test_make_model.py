"""make-model: random-weight GGUFs in llama.cpp's layout.

Files are written once per module (each ≤ 1.5 GB) and shared. llama.cpp (llama-cpp-python 0.3.36)
runs in a subprocess so an abort inside it fails one test instead of killing the session.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

from legacy_engine.format import presets
from legacy_engine.tools import make_model as mm
from legacy_engine.format.gguf_model import ModelFile, expected_tensors

# preset -> (layers, quant) written for the file tests: small enough for ≲ 1.5 GB per file
FILES = {
    "tiny-moe": (None, None),
    "tiny-dense": (None, None),
    "qwen3.5-0.8b": (4, None),          # q4_k_m, tied: token_embd Q6_K
    "qwen3.5-9b": (4, "q2_k"),          # 0.9 GB
    "qwen3.6-35b-a3b": (4, "q2_k"),     # 1.4 GB
    "tiny-moe/q4_k_m": (None, "q4_k_m"),
    "tiny-moe/mxfp4_moe": (None, "mxfp4_moe"),
}

SPEC_KEYS = ["block_count", "context_length", "embedding_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length",
             "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
             "rope.dimension_sections", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
             "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval"]
MOE_KEYS = ["expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    made: dict[str, str] = {}
    root = tmp_path_factory.mktemp("make_model")

    def get(key: str, **kw) -> str:
        full = key + "".join(f"/{k}={v}" for k, v in sorted(kw.items()))
        if full not in made:
            preset = key.split("/")[0]
            layers, quant = FILES.get(key, (None, None))
            path = str(root / (full.replace("/", "_").replace("=", "-") + ".gguf"))
            made[full] = mm.make_model(preset, path, layers=layers, quant=quant, progress=False, **kw)
        return made[full]

    yield get
    for path in made.values():      # several GB: do not leave them to pytest's kept temp dirs
        os.unlink(path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 24):
            h.update(b)
    return h.hexdigest()


# ---- presets and rules (no files) -------------------------------------------------------------------

@pytest.mark.cpu
def test_real_presets_match_spec():
    hp = mm.preset_hparams("qwen3.6-35b-a3b")
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim) == (
        "qwen35moe", 40, 2048, 16, 2, 256)
    assert (hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_d_inner, hp.conv_dim) == (16, 32, 128, 4096, 8192)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (256, 8, 512, 512)
    assert (hp.n_rot, hp.rope_sections, hp.rope_theta, hp.n_vocab) == (64, (11, 11, 10, 0), 1e7, 248320)
    assert hp.recurrent == (True, True, True, False) * 10 and not hp.tied_embeddings
    hp = mm.preset_hparams("qwen3.5-0.8b")
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.ssm_dt_rank, hp.tied_embeddings) == (
        24, 1024, 8, 2, 3584, 16, True)
    hp = mm.preset_hparams("qwen3.5-9b")
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.ssm_dt_rank, hp.tied_embeddings) == (
        32, 4096, 16, 4, 12288, 32, False)


@pytest.mark.cpu
def test_tiny_presets_keep_the_structure_and_layers_cut():
    moe, dense = mm.preset_hparams("tiny-moe"), mm.preset_hparams("tiny-dense")
    for hp in (moe, dense):
        assert hp.head_dim == 256 and hp.n_rot == 64 and hp.tied_embeddings and 128 <= hp.n_embd <= 256
        assert 4 <= hp.n_layer <= 8 and hp.recurrent[:4] == (True, True, True, False)
    assert moe.ssm_dt_rank == 2 * moe.ssm_n_group and 8 <= moe.n_expert <= 16 and 2 <= moe.n_expert_used <= 4
    assert mm.preset_hparams("qwen3.6-35b-a3b", layers=6).recurrent == (True, True, True, False, True, True)
    with pytest.raises(mm.MakeModelError):
        mm.preset_hparams("qwen3.6-35b-a3b", layers=0)
    with pytest.raises(mm.MakeModelError):
        mm.preset_hparams("llama")


@pytest.mark.cpu
def test_rope_sections_scale_with_rotary_dims():
    assert presets._rope_sections(64) == (11, 11, 10, 0)
    for n_rot in (16, 32, 128):
        s = presets._rope_sections(n_rot)
        assert sum(s) == n_rot // 2 and s[3] == 0 and min(s[:3]) > 0


def _q6k_layers(hp, quant="q4_k_m"):
    specs, _ = mm.plan_tensors(hp, quant)
    out = {}
    for s in specs:
        if s.name.startswith("blk.") and s.qtype == T.Q6_K:
            out.setdefault(mm.layer_of(s.name), set()).add(s.name.split(".", 2)[2])
    return out


@pytest.mark.cpu
def test_q4_k_m_mix_follows_llama_cpp_use_more_bits():
    hp = mm.preset_hparams("qwen3.6-35b-a3b")
    specs, notes = mm.plan_tensors(hp, "q4_k_m")
    assert not notes
    types = {s.name: s.qtype for s in specs}
    more = {0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39}
    assert {i for i in range(40) if presets.use_more_bits(i, 40)} == more
    q6 = _q6k_layers(hp)
    assert set(q6) == more
    for i, names in q6.items():
        v = "attn_v.weight" if (i + 1) % 4 == 0 else "attn_qkv.weight"
        assert names == {v, "ffn_down_exps.weight", "ffn_down_shexp.weight"}
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    for name, ne in expected_tensors(hp).items():
        if presets.forced_f32(name, ne):
            assert types[name] == T.F32, name
        elif not (name == "output.weight" or (mm.layer_of(name) in more and "ffn_down" in name)
                  or (mm.layer_of(name) in more and name.endswith(("attn_v.weight", "attn_qkv.weight")))):
            assert types[name] == T.Q4_K, name
    for name in ("blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ssm_conv1d.weight", "blk.0.ffn_gate_inp.weight",
                 "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ssm_norm.weight", "blk.3.attn_q_norm.weight"):
        assert types[name] == T.F32


@pytest.mark.cpu
def test_mixes_match_llama_cpp_snapshot_qwen35_397b():
    # llama.cpp tests/snapshots/qwen3.5-397b-a17b.schema (60 layers, 512 experts, untied):
    # Q4_K_M and Q5_K_M put Q6_K on attn_qkv/attn_v and ffn_down_exps/_shexp of these layers
    snapshot = set(range(0, 7)) | set(range(9, 52, 3)) | set(range(52, 60))
    hp = dataclasses.replace(mm.preset_hparams("qwen3.6-35b-a3b", 60), n_embd=4096, n_expert=512, n_head=32)
    for quant, default in (("q4_k_m", T.Q4_K), ("q5_k_m", T.Q5_K)):
        assert set(_q6k_layers(hp, quant)) == snapshot
        specs, _ = mm.plan_tensors(hp, quant)
        assert {s.qtype for s in specs} == {T.F32, T.Q6_K, default}
    specs, _ = mm.plan_tensors(hp, "mxfp4_moe")      # MXFP4 experts, Q8_0 elsewhere (output too)
    for s in specs:
        want = T.F32 if presets.forced_f32(s.name, s.ne) else T.MXFP4 if len(s.ne) == 3 else T.Q8_0
        assert s.qtype == want, s.name


@pytest.mark.cpu
def test_mixes_match_llama_cpp_snapshot_files_when_available():
    """Optional: every type of the vendored llama.cpp snapshots (set LE_LLAMA_CPP_SRC to a llama.cpp tree)."""
    src = os.environ.get("LE_LLAMA_CPP_SRC", "/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
    snap = os.path.join(src, "tests", "snapshots")
    if not os.path.isdir(snap):
        pytest.skip(f"no llama.cpp snapshots at {snap} (set LE_LLAMA_CPP_SRC)")
    cases = {"qwen3.5-397b-a17b.schema": dataclasses.replace(mm.preset_hparams("qwen3.6-35b-a3b", 60),
                                                              n_embd=4096, n_expert=512, n_head=32),
             "qwen3.6-27b.schema": dataclasses.replace(mm.preset_hparams("qwen3.5-9b", 64),
                                                       n_embd=5120, n_ff=17408, n_head=24)}
    for fname, hp in cases.items():
        sections, cur = {}, None
        for line in open(os.path.join(snap, fname)):
            line = line.strip()
            if line.startswith("["):
                cur, default = line[1:].split("]")
                sections[cur] = (default.strip().upper(), {})
            elif line and not line.startswith("#"):
                name, t = line.split()
                sections[cur][1][name] = t.upper()
        for sec, quant in (("Q4_K_M", "q4_k_m"), ("Q5_K_M", "q5_k_m"), ("MXFP4_MOE", "mxfp4_moe"),
                           ("Q8_0", "q8_0"), ("BF16", "bf16"), ("F16", "f16")):
            default, over = sections[sec]
            specs, _ = mm.plan_tensors(hp, quant)
            for s in specs:
                if s.qtype != T.F32:
                    assert s.qtype.name == over.get(s.name, default), (fname, sec, s.name)


@pytest.mark.cpu
def test_fallback_when_the_block_does_not_divide_the_row():
    assert presets.fallback_type(T.Q4_K, 160) == T.Q5_0
    assert presets.fallback_type(T.Q5_K, 160) == T.Q5_1
    assert presets.fallback_type(T.Q6_K, 160) == T.Q8_0
    assert presets.fallback_type(T.IQ4_XS, 160) == T.IQ4_NL
    assert presets.fallback_type(T.Q2_K, 160) == T.Q4_0
    assert presets.fallback_type(T.Q4_K, 48) == T.F16 and presets.fallback_type(T.Q8_0, 48) == T.F16
    assert presets.fallback_type(T.Q4_K, 512) == T.Q4_K
    hp = dataclasses.replace(mm.preset_hparams("tiny-dense"), n_ff=800)
    specs, notes = mm.plan_tensors(hp, "q4_k")
    assert {s.qtype for s in specs if s.name.endswith("ffn_down.weight")} == {T.Q5_0}
    assert len(notes) == 1 and "Q4_K" in notes[0] and "Q5_0" in notes[0]


@pytest.mark.cpu
@pytest.mark.parametrize("quant", [q for q, (_, t, _) in mm.QUANTS.items() if t not in mm.FLOAT_TYPES])
def test_random_blocks_dequantise_to_the_intended_scale(quant):
    qtype = mm.QUANTS[quant][1]
    for sigma in (1.0, 0.05, 0.0025):
        blocks = mm.quant_blocks(qtype, 2048, sigma, np.random.Generator(np.random.PCG64(3)))
        assert blocks.shape == (2048, GGML_QUANT_SIZES[qtype][1])
        w = dequantize(blocks.reshape(-1), qtype).astype(np.float64)
        assert w.size == 2048 * GGML_QUANT_SIZES[qtype][0] and np.isfinite(w).all()
        rms = np.sqrt(np.mean(w * w))
        assert 0.9 * sigma < rms < 1.1 * sigma, (quant, sigma, rms)
        assert abs(w.mean()) < 0.15 * sigma and w.std() > 0.5 * sigma


@pytest.mark.cpu
def test_router_row_scales_give_zipf_popularity():
    for n, k in ((256, 8), (16, 4)):
        assert np.all(mm.router_row_scales(n, k, 0.0) == 1.0)
        s = mm.router_row_scales(n, k, 1.0)
        assert s[0] > 3 * s[-1] and np.all(s > 0)
        assert np.isclose(np.sqrt(np.mean(s * s)), 1.0)


# ---- written files ------------------------------------------------------------------------------------

@pytest.mark.cpu
@pytest.mark.slow
@pytest.mark.parametrize("key", list(FILES))
def test_file_opens_with_expected_metadata_and_layout(model_file, key):
    preset = key.split("/")[0]
    layers, quant = FILES[key]
    quant = quant or mm.PRESETS[preset]["quant"]
    m = ModelFile.open(model_file(key))
    hp = mm.preset_hparams(preset, layers)
    assert dataclasses.replace(m.hparams, rms_eps=hp.rms_eps) == hp
    assert np.float32(m.hparams.rms_eps) == np.float32(1e-6)     # stored as f32
    a, meta = hp.arch, m.metadata
    for k in SPEC_KEYS + (MOE_KEYS if hp.is_moe else ["feed_forward_length"]):
        assert f"{a}.{k}" in meta, k
    assert meta["general.architecture"] == a and isinstance(meta["general.name"], str)
    assert meta["general.file_type"] == mm.QUANTS[quant][0] and meta["general.quantization_version"] == 2
    assert meta[f"{a}.rope.dimension_sections"] == [11, 11, 10, 0]
    assert m.gguf.value_type(f"{a}.rope.dimension_sections").name == "INT32"
    assert m.gguf.value_type(f"{a}.block_count").name == "UINT32"
    assert len(meta["tokenizer.ggml.tokens"]) == 248320 and meta["tokenizer.ggml.pre"] == "qwen35"
    assert "tokenizer.chat_template" in meta
    # exactly the schema, in llama-quantize's order, with the planned types
    specs, _ = mm.plan_tensors(hp, quant)
    assert list(m.tensors) == [s.name for s in specs] == presets.llama_order(expected_tensors(hp))
    assert list(m.tensors)[:2] == (["output_norm.weight", "token_embd.weight"] if hp.tied_embeddings
                                   else ["output.weight", "output_norm.weight"])
    for s in specs:
        t = m.tensors[s.name]
        assert (t.ne, t.type) == (s.ne, s.qtype), s.name
    assert m.gguf.file_size == max(t.offset + t.n_bytes for t in m.tensors.values()) + (
        -m.tensors[specs[-1].name].n_bytes % 32)


@pytest.mark.cpu
@pytest.mark.slow
def test_tiny_moe_q4_k_m_file_has_the_mix(model_file):
    m = ModelFile.open(model_file("tiny-moe/q4_k_m"))
    types = {n: t.type for n, t in m.tensors.items()}
    assert types["token_embd.weight"] == T.Q6_K          # tied: llama.cpp treats it as the output
    q6 = {mm.layer_of(n) for n, t in types.items() if t == T.Q6_K and n.startswith("blk.")}
    assert q6 == {0, 3, 6, 7}                              # use_more_bits(i, 8)
    assert types["blk.3.attn_v.weight"] == T.Q6_K and types["blk.4.attn_qkv.weight"] == T.Q4_K
    assert types["blk.6.ffn_down_exps.weight"] == T.Q6_K and types["blk.5.ffn_down_shexp.weight"] == T.Q4_K


@pytest.mark.cpu
@pytest.mark.slow
def test_values_are_sane(model_file):
    m = ModelFile.open(model_file("tiny-moe"))
    hp = m.hparams

    def f32(name):
        return np.frombuffer(m.gguf.data(name).tobytes(), np.float32)

    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ssm_norm.weight", "blk.3.attn_k_norm.weight"):
        w = f32(name)
        assert abs(w.mean() - 1) < 0.02 and 0.02 < w.std() < 0.06
    a = f32("blk.0.ssm_a")
    assert np.all((a <= -0.5 * 0.999) & (a >= -4 * 1.001))
    assert 0.2 < f32("blk.1.ssm_conv1d.weight").std() < 0.3
    for name in ("blk.2.attn_qkv.weight", "blk.3.attn_q.weight", "blk.0.ffn_up_exps.weight", "token_embd.weight"):
        t = m.tensors[name]
        w = dequantize(np.asarray(m.gguf.data(name)), T(t.type)).astype(np.float64)
        want = mm._role(name, t.ne, hp, False)[1]
        assert np.isfinite(w).all() and 0.9 * want < w.std() < 1.1 * want, name


@pytest.mark.cpu
@pytest.mark.slow
def test_deterministic_for_a_seed(model_file, tmp_path):
    a = model_file("tiny-dense", seed=7)
    b = mm.make_model("tiny-dense", str(tmp_path / "again.gguf"), seed=7, progress=False)
    c = model_file("tiny-dense", seed=8)
    assert _sha256(a) == _sha256(b) != _sha256(c)
    os.unlink(b)
    # any tensor can be regenerated on its own
    m = ModelFile.open(a)
    hp = m.hparams
    for s in mm.plan_tensors(hp, "q8_0")[0][:6]:
        data = b"".join(bytes(x) for x in mm.tensor_chunks(s, hp, seed=7))
        assert data == m.gguf.data(s.name).tobytes(), s.name


@pytest.mark.cpu
@pytest.mark.slow
def test_tame_scales_the_residual_outputs(model_file):
    wild, tame = ModelFile.open(model_file("tiny-dense")), ModelFile.open(model_file("tiny-dense", tame=True))
    for name in ("blk.0.ssm_out.weight", "blk.3.attn_output.weight", "blk.1.ffn_down.weight", "blk.1.ffn_up.weight"):
        t = wild.tensors[name]
        sd = [dequantize(np.asarray(f.gguf.data(name)), T(t.type)).std() for f in (wild, tame)]
        assert np.isclose(sd[1] / sd[0], 1.0 if "ffn_up" in name else 0.25, rtol=0.05), name


def _expert_histogram(router: np.ndarray, k: int, n_tokens: int = 8192) -> np.ndarray:
    x = np.random.default_rng(99).standard_normal((n_tokens, router.shape[1]))   # random hidden states
    top = np.argpartition(-(x @ router.T), k - 1, axis=1)[:, :k]
    return np.bincount(top.ravel(), minlength=router.shape[0]) / (n_tokens * k)   # share of selections


@pytest.mark.cpu
@pytest.mark.slow
def test_router_skew_in_the_file(model_file):
    flat, skew = ModelFile.open(model_file("tiny-moe")), ModelFile.open(model_file("tiny-moe", router_skew=1.0))
    hp = flat.hparams
    n, k = hp.n_expert, hp.n_expert_used
    tops = []
    for layer in (0, 5):
        name = f"blk.{layer}.ffn_gate_inp.weight"
        h0 = _expert_histogram(np.frombuffer(flat.gguf.data(name).tobytes(), np.float32).reshape(n, -1), k)
        h1 = _expert_histogram(np.frombuffer(skew.gguf.data(name).tobytes(), np.float32).reshape(n, -1), k)
        assert h0.max() < 1.2 / n and h0.min() > 0.8 / n          # near-uniform
        assert h1.max() > 1.6 / n and h1.max() / h1.min() > 3      # top expert ≫ 1/n, tail ≪ 1/n
        tops.append(int(h1.argmax()))
    # full-size router (256 experts, top-8), generated alone
    hp35 = mm.preset_hparams("qwen3.6-35b-a3b", 1)
    spec = next(s for s in mm.plan_tensors(hp35, "q4_k_m")[0] if s.name == "blk.0.ffn_gate_inp.weight")
    for alpha, check in ((0.0, lambda h: h.max() < 1.5 / 256), (1.0, lambda h: h.max() > 10 / 256)):
        data = b"".join(bytes(c) for c in mm.tensor_chunks(spec, hp35, seed=0, router_skew=alpha))
        h = _expert_histogram(np.frombuffer(data, np.float32).reshape(256, -1), 8, 4096)
        assert check(h), (alpha, h.max() * 256)


@pytest.mark.cpu
def test_cli_dry_run_and_errors(capsys):
    assert mm.main(["--preset", "qwen3.6-35b-a3b", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "733 tensors" in out and "Q6_K" in out and "Q4_K" in out
    assert mm.main(["--preset", "tiny-moe", "--layers", "0", "--out", "/nonexistent/x.gguf"]) == 1
    with pytest.raises(SystemExit):
        mm.main(["--preset", "nope", "--out", "x.gguf"])


# ---- llama.cpp ------------------------------------------------------------------------------------------

LLAMA_RUN = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, verbose=False, logits_all=True)
toks = m.tokenize(b"The quick brown fox jumps over the lazy dog", add_bos=False)
m.eval(toks)
lg = np.array(m.scores[:m.n_tokens], dtype=np.float64)
print(json.dumps({"tokens": toks, "finite": bool(np.isfinite(lg).all()), "min_std": float(lg.std(axis=1).min()),
                  "argmax": lg.argmax(axis=1).tolist()}))
"""


def run_llama_cpp(path: str) -> dict:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python 0.3.36 is not installed (tests/run.sh builds it)")
    p = subprocess.run([sys.executable, "-c", LLAMA_RUN, path], capture_output=True, encoding="utf-8", errors="replace", timeout=600)
    assert p.returncode == 0, f"llama.cpp failed on {path} (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("key", list(FILES))
def test_llama_cpp_loads_and_runs_every_preset(model_file, key):
    r = run_llama_cpp(model_file(key))
    assert r["tokens"][:2] == [760, 3841]        # "The quick": the real Qwen3.5 vocabulary
    assert r["finite"] and r["min_std"] > 0.3, r    # sane, non-flat logits
    assert len(set(r["argmax"])) > 1


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("quant", [q for q in mm.QUANTS if q != "q8_0"])
def test_llama_cpp_runs_every_quant_type(tmp_path, quant):
    path = mm.make_model("tiny-dense", str(tmp_path / f"{quant}.gguf"), quant=quant, progress=False)
    try:
        r = run_llama_cpp(path)
    finally:
        os.unlink(path)
    assert r["finite"] and r["min_std"] > 0.3, r
