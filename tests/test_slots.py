"""plan/slots: one slot's state bytes (against the native state's own sizes) and the default slot count."""
from legacy_engine.cpu.model import Model
from legacy_engine.plan.slots import DEFAULT_PARALLEL, STATE_SHARE, serve_slots, state_bytes
from legacy_engine.tools.make_model import make_model

N_CTX = 300


def test_state_bytes_is_the_native_states(tmp_path):
    for preset, layers in (("tiny-moe", 4), ("tiny-dense", 5)):
        path = make_model(preset, str(tmp_path / f"{preset}.gguf"), layers=layers, quant="q8_0", progress=False)
        m = Model(path, n_threads=1)
        st = m.new_state(N_CTX)
        assert state_bytes(m.hparams, N_CTX) == st.recurrent_nbytes() + st.kv_nbytes(N_CTX), preset


def test_default_slots(tmp_path):
    path = make_model("tiny-moe", str(tmp_path / "m.gguf"), layers=4, quant="q8_0", progress=False)
    hp = Model(path, n_threads=1).hparams
    one = state_bytes(hp, N_CTX)
    assert serve_slots(hp, N_CTX, batched=False, available=1 << 40).n == 1          # no batched pass: one
    assert serve_slots(hp, N_CTX, batched=True, available=1 << 40).n == DEFAULT_PARALLEL
    fits3 = int(3.5 * one / STATE_SHARE)                                             # the memory holds 3 states
    p = serve_slots(hp, N_CTX, batched=True, available=fits3)
    assert p.n == 3 and p.state_bytes == one and "available" in p.why
    assert serve_slots(hp, N_CTX, batched=True, available=1).n == 1                  # never fewer than one
