"""Quantised GGUFs judged by KL, as ../shared/oracle.md says ("Quantised GGUFs", pitfall 7).

Reference: transformers 5.23 run on the *dequantised* weights of the very file under test
(fixtures/gguf_to_hf.py inverts `convert`), so the weight rounding is shared and only each engine's own arithmetic
shows. Ours and llama.cpp (F32 KV cache) run the same file on the same 200 seeded tokens (one batched prefill);
per position: KL(ref ‖ engine), top-5 overlap, argmax agreement (reported, not gated). Gate: ours is no further
from the reference than llama.cpp is (tolerances.QUANT_*); negative controls (injected bugs) must fail that gate.
Ours runs on two paths: its integer one (W4A8-style kernels, activations quantised as llama.cpp does) is held to
the gate with every CPU tier this machine runs forced in turn (ids …-ref, …-ssse3, …-avx2, …-avx512vnni; a tier
the CPU lacks skips with the reason), each run checked to be served by that tier's kernels; its f32 path (integer
kernels off: f32 arithmetic on the dequantised rows, i.e. on the weights transformers got) must meet the f32 bar
(KL ≤ QUANT_KL_FLOOR). The reference and llama.cpp's distance are computed once per file; per tier only our
forward pass runs.

Models: the tame variants (pitfall 7) of the tiny `moe` (H_v = 2·H_k, 16 experts top-4 + shared) and `dense` kinds
(hidden 64), and a tame "wide" variant of each made here (hidden, FFN and expert widths 256). At hidden 64
llama-quantize cannot use 256-element K-quant blocks on 32/64/128-wide rows and falls back (Q4_K → Q5_0,
Q6_K → Q8_0): only ssm_out / attn_output (512-wide rows) end up Q4_K and nothing Q6_K. The wide files are the
real Q4_K / Q6_K / F32 mix. test_q4_k_m_tensor_types records both.

Files:  q8_0-ours    legacy_engine.tools.convert(hf, out, "q8_0")
        q8_0-llama   llama.cpp's convert_hf_to_gguf.py --outtype q8_0 (--no-mtp)
        q4_k_m       llama_model_quantize(our f32 file, LLAMA_FTYPE_MOSTLY_Q4_K_M), llama.cpp's own quantiser

`pytest tests/test_quantized.py -s` prints one table row per file.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import tolerances as tol

from legacy_engine.core import _native
from legacy_engine.tools.convert import convert, tile_v_heads
from legacy_engine.cpu.model import Model

gguf = pytest.importorskip("gguf")

pytestmark = [pytest.mark.cpu, pytest.mark.oracle]

T = gguf.GGMLQuantizationType
KINDS = ("moe", "dense")
N_TOKENS = 200          # spans several 64-token GDN chunks
TOKEN_SEED = 20261122
N_CTX = 256
WIDE = 256              # one Q4_K / Q6_K block per row


# ------------------------------------------------------------------------------------------------ helpers

def make_tiny_wide(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """The tame tiny checkpoint `kind` with hidden size and FFN / expert widths WIDE (fixtures/tiny_models' config,
    weight rules, tokenizer and seed otherwise), so that every quantised row is a whole number of K-quant blocks."""
    import torch
    from fixtures import tiny_models as tm
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    vocab = tm.tiny_vocab()
    base = tm._config(kind, vocab)
    wide = dict(hidden_size=WIDE)
    wide.update(dict(moe_intermediate_size=WIDE, shared_expert_intermediate_size=WIDE) if kind.startswith("moe")
                else dict(intermediate_size=WIDE))
    config = type(base).from_dict({**base.to_dict(), **wide})
    torch.manual_seed(seed)
    model = (Qwen3_5MoeForCausalLM if kind.startswith("moe") else Qwen3_5ForCausalLM)(config).eval()
    tm._redraw(model, seed, tame=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tm.write_tokenizer(vocab, out_dir)
    return out_dir


def llama_quantize(src: Path, dst: Path, ftype: int) -> Path:
    """llama.cpp's llama-quantize (through llama-cpp-python) of src to the LLAMA_FTYPE `ftype`."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({src}) returned {rc}"
    return dst


def seeded_tokens() -> list[int]:
    from fixtures.tiny_models import N_RANKS
    return np.random.default_rng(TOKEN_SEED).integers(0, N_RANKS, N_TOKENS).tolist()   # ordinary BPE tokens


def ours_logits(path: Path, ids: list[int], faults: dict | None = None, int8: bool = True) -> np.ndarray | None:
    """Our logits of one batched prefill. int8=False switches the integer kernels off (f32 on dequantised rows);
    None when this engine has no such switch."""
    model = Model(path, _faults=faults)
    if not int8:
        set_int8 = getattr(model.native, "set_int8", None)
        if set_int8 is None:
            return None
        set_int8(False)
    return model.forward(model.new_state(N_CTX), ids, all_logits=True, chunked=True)


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama
    llm = Llama(str(path), n_ctx=N_CTX, n_batch=512, n_ubatch=512, logits_all=True, type_k=0, type_v=0,
                n_threads=2, n_threads_batch=2, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


def integer_kernels(path: Path) -> dict[str, str]:
    """{weight type: tier} for the file's types that our matmul serves with an integer (W4A8-style) kernel under
    the tier selected now, i.e. quantising activations; empty when every matmul runs in f32 on dequantised rows."""
    kernel_isa = getattr(_native, "kernel_isa", None)            # absent from engines without integer kernels
    if kernel_isa is None:
        return {}
    types = {t.tensor_type for t in gguf.GGUFReader(path).tensors} - {T.F32, T.F16, T.BF16}
    return {t.name: kernel_isa(int(t)) for t in sorted(types) if kernel_isa(int(t)) is not None}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, x: np.ndarray) -> dict:
    """Per-position KL(ref ‖ x) (nats) mean and max, top-5 overlap, argmax agreement, max |Δlogit|."""
    assert ref.shape == x.shape and np.isfinite(x).all()
    lp, lq = _log_softmax(ref), _log_softmax(x)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    top_r, top_x = np.argsort(-ref, axis=-1)[:, :5], np.argsort(-x, axis=-1)[:, :5]
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top_r, top_x)])
    return dict(kl_mean=float(kl.mean()), kl_max=float(kl.max()), top5=float(overlap),
                argmax=float((ref.argmax(-1) == x.argmax(-1)).mean()), max_abs=float(np.abs(ref - x).max()))


def gate_failures(ours: dict, llama: dict) -> list[str]:
    """Why ours is further from the reference than llama.cpp (empty: it is not)."""
    fails = []
    for key in ("kl_mean", "kl_max"):
        bound = max(tol.QUANT_KL_RATIO * llama[key], tol.QUANT_KL_FLOOR)
        if not ours[key] <= bound:
            fails.append(f"{key} {ours[key]:.3g} > {bound:.3g} (llama.cpp {llama[key]:.3g})")
    if not ours["top5"] >= llama["top5"] - tol.QUANT_TOP5_SLACK:
        fails.append(f"top-5 overlap {ours['top5']:.3f} < llama.cpp {llama['top5']:.3f} - {tol.QUANT_TOP5_SLACK}")
    return fails


def row(label: str, m: dict) -> str:
    return (f"{label:<44} KL mean {m['kl_mean']:9.2e}  KL max {m['kl_max']:9.2e}  top-5 {m['top5']:.3f}  "
            f"argmax {m['argmax']:.3f}  max|Δ| {m['max_abs']:.2e}")


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def checkpoint(tiny_hf, tmp_path_factory):
    """checkpoint(kind, variant) -> tame HF checkpoint dir; variant "tiny" (hidden 64) or "wide" (256)."""
    made, root = {}, tmp_path_factory.mktemp("quant_hf")

    def get(kind: str, variant: str) -> Path:
        if variant == "tiny":
            return tiny_hf(kind, tame=True)
        if (kind, variant) not in made:
            made[kind, variant] = make_tiny_wide(kind, root / f"{kind}-wide-tame")
        return made[kind, variant]
    return get


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory, request):
    """gguf_file(kind, variant, what) -> GGUF path; what in f32, q8_0-ours, q8_0-llama, q4_k_m."""
    made, root = {}, tmp_path_factory.mktemp("quant_gguf")

    def get(kind: str, variant: str, what: str) -> Path:
        key = (kind, variant, what)
        if key not in made:
            hf, out = checkpoint(kind, variant), root / f"{kind}-{variant}.{what}.gguf"
            if what in ("f32", "q8_0-ours"):
                made[key] = convert(hf, out, what.split("-")[0], progress=False)
            elif what == "q8_0-llama":
                made[key] = request.getfixturevalue("llama_cpp_convert")(hf, out, "q8_0")
            elif what == "q4_k_m":
                llama_cpp = pytest.importorskip("llama_cpp")
                made[key] = llama_quantize(get(kind, variant, "f32"), out, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)
            else:
                raise ValueError(what)
        return made[key]
    return get


@pytest.fixture(scope="module")
def reference(checkpoint, gguf_file):
    """reference(kind, variant, what) -> transformers' logits float32[N_TOKENS, n_vocab] on the file's weights."""
    from fixtures.gguf_to_hf import hf_logits, load_hf_on_gguf
    made = {}

    def get(kind: str, variant: str, what: str) -> np.ndarray:
        key = (kind, variant, what)
        if key not in made:
            model = load_hf_on_gguf(checkpoint(kind, variant), gguf_file(*key))
            made[key] = hf_logits(model, seeded_tokens())
        return made[key]
    return get


@pytest.fixture(scope="module")
def llama_distance(gguf_file, reference):
    """llama_distance(kind, variant, what) -> compare(reference, llama.cpp's logits) on the file, run once."""
    pytest.importorskip("llama_cpp")
    made = {}

    def get(kind: str, variant: str, what: str) -> dict:
        key = (kind, variant, what)
        if key not in made:
            made[key] = compare(reference(*key), llama_logits(gguf_file(*key), seeded_tokens()))
        return made[key]
    return get


# ------------------------------------------------------------------------------------------------ gguf_to_hf itself

def test_untile_inverts_tile_v_heads():
    from fixtures.gguf_to_hf import untile_v_heads
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(5, 2 * 3 * 4)      # H_k 2, r 3, head_dim 4 on axis 1
    tiled = tile_v_heads(x, 1, 2, 4)
    assert not np.array_equal(tiled, x)
    assert np.array_equal(untile_v_heads(tiled, 1, 2, 4), x)
    assert np.array_equal(untile_v_heads(tile_v_heads(x.T, 0, 2, 4), 0, 2, 4), x.T)


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_to_hf_roundtrip_f32(kind, checkpoint, gguf_file):
    """f32 GGUF → HF tensors gives the checkpoint back (per-expert names as saved), and transformers on them
    computes the original logits."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from fixtures.gguf_to_hf import gguf_to_hf_state_dict, hf_logits, load_hf_on_gguf
    hf, f32 = checkpoint(kind, "tiny"), gguf_file(kind, "tiny", "f32")
    saved = load_file(hf / "model.safetensors")
    back = gguf_to_hf_state_dict(f32, fused_experts=False)
    assert sorted(back) == sorted(saved)
    for name, x in saved.items():
        y = back[name].reshape(x.shape)
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "A_log")):
            np.testing.assert_allclose(y, x, rtol=0, atol=tol.GGUF_TO_HF_F32_ABS, err_msg=name)
        else:
            assert np.array_equal(y, x), name
    ids = seeded_tokens()
    original = hf_logits(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval(), ids)
    roundtrip = hf_logits(load_hf_on_gguf(hf, f32), ids)
    assert np.abs(roundtrip - original).max() <= tol.GGUF_TO_HF_LOGITS_ABS


# ------------------------------------------------------------------------------------------------ what llama.cpp wrote

@pytest.mark.parametrize("variant", ["tiny", "wide"])
@pytest.mark.parametrize("kind", KINDS)
def test_q4_k_m_tensor_types(kind, variant, gguf_file):
    """llama-quantize Q4_K_M: Q4_K / Q6_K on rows that are whole 256-blocks; Q5_0 / Q8_0 (its fallbacks) on the
    others; F32 for norms, ssm_a/dt/conv and routers. Q4_K must really occur (Q6_K too in the wide files)."""
    reader = gguf.GGUFReader(gguf_file(kind, variant, "q4_k_m"))
    types = {t.name: (t.tensor_type, int(t.shape[0])) for t in reader.tensors}       # shape[0] = ne0 = row length
    seen = {}
    for name, (typ, ne0) in types.items():
        seen[typ.name] = seen.get(typ.name, 0) + 1
        if typ == T.F32:
            assert name.endswith(("norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight",
                                  "ffn_gate_inp_shexp.weight")), name
        elif ne0 % 256 == 0:
            assert typ in (T.Q4_K, T.Q6_K), (name, typ.name)
        else:
            assert typ in (T.Q5_0, T.Q8_0), (name, typ.name)
    print(f"\n{kind}-{variant} q4_k_m tensor types: {dict(sorted(seen.items()))}")
    assert seen.get("Q4_K", 0) > 0
    if variant == "wide":
        assert set(seen) == {"F32", "Q4_K", "Q6_K"}
        assert types["output.weight"][0] == T.Q6_K
    else:   # every row but ssm_out's / attn_output's (512 wide) is 32…128 wide: fallbacks, no Q6_K
        assert "Q6_K" not in seen and types["output.weight"][0] == T.Q8_0
        assert {n.split(".", 2)[-1] for n, (t, _) in types.items() if t == T.Q4_K} == {"ssm_out.weight",
                                                                                        "attn_output.weight"}


# ------------------------------------------------------------------------------------------------ the KL gate

CASES = [pytest.param(k, "tiny", w, id=f"{k}-{w}", marks=[pytest.mark.slow] if w == "q8_0-llama" else [])
         for k in KINDS for w in ("q8_0-ours", "q8_0-llama", "q4_k_m")]
CASES += [pytest.param(k, "wide", "q4_k_m", id=f"{k}-wide-q4_k_m", marks=pytest.mark.slow) for k in KINDS]


# Known single-position outliers of the kl_max gate: (kind, variant, what, tier) -> why. There only a kl_max failure
# is an xfail (it passes when the outlier goes); the mean-KL and top-5 gates still hold these runs.
_NEAR_TIE_148 = ("position 148 of 200, where transformers' layer-4 router has its 4th and 5th experts 0.005 apart "
                 "(median gap 0.14): the ref/ssse3 run (bit-identical to each other on these 64-wide rows; it differs "
                 "from avx2's in float summation order only) lands max|Δlogit| 0.36 away there, an expert choice "
                 "that went the other way, while avx2 and llama.cpp agree with transformers there (llama.cpp's worst "
                 "position is 80, a 0.0016 gap in layer 0). Random MoE routing under quantisation, oracle.md "
                 "pitfall 7")
ROUTER_NEAR_TIES = {("moe", "tiny", what, isa): _NEAR_TIE_148
                    for what in ("q8_0-ours", "q8_0-llama") for isa in ("ref", "ssse3")}


@pytest.mark.parametrize("forced_isa", _native.ISA_NAMES, indirect=True)
@pytest.mark.parametrize("kind,variant,what", CASES)
def test_quantized_no_further_from_reference_than_llama_cpp(kind, variant, what, forced_isa, gguf_file, reference,
                                                            llama_distance):
    """Our integer-kernel path with tier `forced_isa` forced, against llama.cpp's distance from the reference. The
    file's types must be served by that tier's own kernels (a lower tier's only where it has none), so a tier
    switch that did nothing fails here instead of testing the default tier under another name."""
    path, ids = gguf_file(kind, variant, what), seeded_tokens()
    served = integer_kernels(path)
    assert served, f"no integer kernel serves {path.name}: forcing {forced_isa} would test nothing"
    assert forced_isa in served.values(), f"{forced_isa} forced, but the kernels serving the file are {served}"
    order = _native.ISA_NAMES.index
    assert all(order(k) <= order(forced_isa) for k in served.values()), served
    ours, llama = compare(reference(kind, variant, what), ours_logits(path, ids)), llama_distance(kind, variant, what)
    label = f"{kind}-{variant} {what}"
    kernels = "/".join(f"{t}:{k}" for t, k in served.items())
    print(f"\n{row(f'{label} ours (int {kernels})', ours)}\n{row(f'{label} llama.cpp', llama)}")
    fails = gate_failures(ours, llama)
    why = ROUTER_NEAR_TIES.get((kind, variant, what, forced_isa))
    if why and fails and all(f.startswith("kl_max") for f in fails):
        pytest.xfail(f"{fails[0]}: {why}")
    assert not fails, fails


@pytest.mark.parametrize("kind,variant,what", CASES)
def test_quantized_f32_path_meets_the_f32_bar(kind, variant, what, gguf_file, reference):
    """Integer kernels off: f32 arithmetic on the dequantised rows, i.e. on the weights transformers got, so only
    summation order differs (no CPU tier is involved: it runs once per file)."""
    path, ids = gguf_file(kind, variant, what), seeded_tokens()
    logits = ours_logits(path, ids, int8=False) if integer_kernels(path) else ours_logits(path, ids)
    if logits is None:
        pytest.skip("this engine has no switch for its integer kernels")
    f32 = compare(reference(kind, variant, what), logits)
    print(f"\n{row(f'{kind}-{variant} {what} ours (f32)', f32)}")
    assert f32["kl_max"] <= tol.QUANT_KL_FLOOR, f32


NEGATIVE = [("moe", "gdn_grouped"), ("moe", "no_topk_renorm"), ("dense", "gdn_grouped"),
            ("dense", "rope_interleaved")]


@pytest.mark.parametrize("kind,fault", NEGATIVE, ids=[f"{k}-{f}" for k, f in NEGATIVE])
def test_negative_controls_fail_the_gate(kind, fault, gguf_file, reference, llama_distance):
    """Injected bugs must be further from the reference than llama.cpp is (on the Q8_0 file)."""
    path, ids = gguf_file(kind, "tiny", "q8_0-ours"), seeded_tokens()
    ref = reference(kind, "tiny", "q8_0-ours")
    faulty, llama = compare(ref, ours_logits(path, ids, {fault: True})), llama_distance(kind, "tiny", "q8_0-ours")
    print(f"\n{row(f'{kind} q8_0 ours+{fault}', faulty)}")
    assert gate_failures(faulty, llama)
