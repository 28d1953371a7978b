"""The planner on described machines and described files (make-model's tensor plans; nothing is read or run on a
GPU): VRAM accounting, pin choice, the strategy chosen for a fast link, a slow link, no GPU and a tiny card, and
the `plan` command's errors. The GPU model's use of the accounting (the budget holds, streamed prefill gives the
CPU's tokens) is tested on the GPU machine in test_gpu_model.py."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from legacy_engine.format.footprint import weight_footprint
from legacy_engine.format.presets import DescribedFile
from legacy_engine.core.errors import PlanningError
from legacy_engine.gpu import layout as L
from legacy_engine.gpu.placement import place
from legacy_engine.plan import planner as P
from legacy_engine.plan import probe
from legacy_engine.tools.plan_cmd import print_plan

pytestmark = pytest.mark.cpu

A3B = DescribedFile("qwen3.6-35b-a3b", "q4_k_m")
# The GPU machine as measured (README: H100, 16 cores, 90 GB/s host reads, PCIe ~25 GB/s) and three legacy boxes.
H100 = probe.Machine(cpu_threads=16, cpu_read_gbps=90.0, gpu_name="H100", gpu_tier="dp4a", vram_free=79 * L.GiB,
                     link_gbps=25.0, gpu_gemm_tflops=13.0, gpu_gemv_gbps=2000.0, gpu_launch_us=2.8)
CMP = dataclasses.replace(H100, gpu_name="CMP 100-210", link_gbps=0.25, vram_free=16 * L.GiB)   # PCIe Gen1 x1
NO_GPU = probe.Machine(cpu_threads=16, cpu_read_gbps=90.0)


def test_parse_size():
    assert P.parse_size("6GiB") == 6 * 2**30
    assert P.parse_size("6G") == 6 * 2**30
    assert P.parse_size("512MiB") == 512 * 2**20
    assert P.parse_size("6.5GB") == 6_500_000_000
    assert P.parse_size("1024") == 1024
    for bad in ("six", "6 parsecs", "-1G", "nanG"):
        with pytest.raises(ValueError):
            P.parse_size(bad)


def test_footprint_parts():
    """Streaming leaves the routed experts out of the weights and adds (at least two) staging buffers of the largest
    layer's experts; pinning adds exactly the pinned experts' bytes (rounded to the allocation granule)."""
    res = L.vram_footprint(A3B, n_ctx=4096)
    st = L.vram_footprint(A3B, stream_experts=True, n_ctx=4096)
    exp_bytes = sum(t.n_bytes for n, t in A3B.tensors.items() if "_exps." in n)
    assert res.parts["weights"] - st.parts["weights"] >= exp_bytes
    layer = max(sum(A3B.tensors[n].n_bytes for n in L.expert_tensors(A3B, i)) for i in range(40))
    assert st.parts[f"expert staging ({L.STAGING_LAYERS} layers)"] >= L.STAGING_LAYERS * layer >= 2 * layer
    assert st.layer_expert_bytes == layer
    pins = {0: [1, 2, 3], 7: [5]}
    pinned = L.vram_footprint(A3B, stream_experts=True, pinned=pins, n_ctx=4096)
    assert pinned.total - st.total == pinned.parts["pinned experts"]
    assert pinned.parts["pinned experts"] >= 3 * st.expert_bytes[0] + st.expert_bytes[7]
    assert L.vram_footprint(A3B, n_ctx=8192).parts["state"] > res.parts["state"]
    assert L.scratch_bytes(A3B.hparams, 512, True, 1) > L.scratch_bytes(A3B.hparams, 1, True, 1)


def test_footprint_counts_the_attention_planes():
    """The tensor-core attention prefill's f16 hi / lo planes of the context's keys (K and V, each hi and lo: one
    attention layer's f32 K and V, the keys rounded up to a 16-key tile) are a part of the footprint, growing with
    n_ctx."""
    hp = A3B.hparams
    for n_ctx in (4096, 4100):
        fp = L.vram_footprint(A3B, n_ctx=n_ctx)
        keys = -(-n_ctx // 16) * 16
        assert fp.parts["attention planes"] >= 2 * 4 * keys * hp.n_head_kv * hp.head_dim   # as f32 K and V rows
        assert fp.parts["attention planes"] == L._round(L.attn_planes_bytes(n_ctx, hp.n_head_kv, hp.head_dim))
    assert L.attn_planes_bytes(4100, 2, 256) == L.attn_planes_bytes(4112, 2, 256) > L.attn_planes_bytes(4096, 2, 256)


def test_footprint_counts_link_and_early_experts():
    """The hybrid decode's VRAM beyond the streamed model's: link experts one staging slot each; early experts one
    slot each plus the CPU's early buffer (two halves of a slot of the largest single expert tensor's expert for
    gate, up and down); fill_pins leaves that much room."""
    st = L.vram_footprint(A3B, stream_experts=True, n_ctx=4096)
    big = max(st.expert_bytes.values())
    one = max(A3B.tensors[n].n_bytes // 256 for i in range(40) for n in L.expert_tensors(A3B, i))
    link = L.vram_footprint(A3B, stream_experts=True, n_ctx=4096, link_experts=2)
    assert link.total - st.total == link.parts["link staging"] >= 2 * big
    early = L.vram_footprint(A3B, stream_experts=True, n_ctx=4096, link_experts=2, early_experts=2)
    assert early.parts["link staging"] >= 4 * big and early.parts["early buffer"] >= 12 * one
    budget = 6 * L.GiB
    pins, fp = P.fill_pins(A3B, budget, 4096, 512, True, None, 2, 2)
    pins0, _ = P.fill_pins(A3B, budget, 4096, 512, True, None, 2)
    assert fp.total <= budget and "early buffer" in fp.parts
    assert sum(map(len, pins.values())) < sum(map(len, pins0.values()))


def test_check_fits_names_the_parts():
    fp = L.vram_footprint(A3B, n_ctx=4096)
    with pytest.raises(PlanningError, match="weights .* GiB, state"):
        L.check_fits(fp, 6 * L.GiB, "resident GPU model")
    L.check_fits(fp, fp.total)


def test_choose_pins_hottest_first_within_budget():
    per = L.vram_footprint(A3B, stream_experts=True).expert_bytes
    counts = {3: [0] * 256, 9: [0] * 256}
    counts[3][17], counts[9][200], counts[9][4] = 50, 90, 10
    slack = 40 * L.ALLOC_GRANULE
    pins = P.choose_pins(A3B, per[9] + per[3] + slack, counts)
    assert pins == {3: [17], 9: [200]}
    budget = 80 * per[0] + slack
    even = P.choose_pins(A3B, budget, None)
    assert set(even) == set(range(40))                              # spread over every layer
    assert L.vram_footprint(A3B, stream_experts=True, pinned=even).parts["pinned experts"] <= budget
    assert P.choose_pins(A3B, 0, None) == {}


def test_fast_link_six_gib_streams():
    """A 6 GiB budget cannot hold 18 GiB of experts: the GPU prefills with streamed experts; the decode runs on the
    CPU (stream) or hybrid (attention/GDN/shared/pinned experts on the GPU, the other experts on the CPU), and the
    hybrid one, with less for the CPU to read per token, is chosen."""
    ss = P.plan(A3B, H100, 6 * L.GiB, prompt=2048, gen=256)
    by = {s.name: s for s in ss}
    best, stream, cpu = ss[0], by["stream"], by["cpu"]
    assert best.name == "hybrid" and best.fits and best.vram <= 6 * L.GiB
    assert by["resident"].fits is False
    assert stream.fits and stream.prefill_s < cpu.prefill_s / 5     # the point of the GPU
    assert stream.decode_s_per_tok == cpu.decode_s_per_tok          # the stream split decodes on the CPU
    # the same passes and pins (less the room of the link staging: link experts fetched per layer on this fast
    # link); the hybrid split keeps the sequence on the GPU: no state handoff
    n_pins = lambda p: sum(len(v) for v in p.values())   # noqa: E731
    assert best.link_experts >= 1 and 0 <= n_pins(stream.pinned) - n_pins(best.pinned) <= 4 * best.link_experts
    assert best.prefill_parts["handoff"] == 0 and stream.prefill_parts["handoff"] > 0
    assert best.prefill_s == pytest.approx(stream.prefill_s - stream.prefill_parts["handoff"], rel=0.01)
    assert best.decode_s_per_tok < cpu.decode_s_per_tok
    parts = best.decode_parts
    assert 0 < parts["pinned_share"] < 0.5 and parts["cpu"] > parts["gpu"]
    assert sum(len(v) for v in best.pinned.values()) > 0            # the budget left holds hot experts
    assert 1 <= stream.min_gpu_tokens <= 2048 and 1 <= best.min_gpu_tokens <= 2048


def test_link_experts_follow_the_link():
    """The hybrid decode's link experts: some per layer on a fast link (their fetch beats the CPU's share), fewer
    when skewed routing leaves the CPU little, none on a slow link (6 GB/s: a Fermi box) or without a GPU; the
    prediction with them beats the one without on the fast link."""
    n_e = A3B.hparams.n_expert
    fast = P.choose_link(H100, A3B, {}, None)
    assert 1 <= fast < A3B.hparams.n_expert_used
    assert P.choose_link(dataclasses.replace(H100, link_gbps=6.0), A3B, {}, None) == 0
    assert P.choose_link(dataclasses.replace(H100, gpu_name=""), A3B, {}, None) == 0
    counts = {i: np.array([1.0 / (1 + e) ** 1.2 for e in range(n_e)]) * 1e6 for i in range(40)}
    pins = P.choose_pins(A3B, 2 * L.GiB, counts)
    assert P.choose_link(H100, A3B, pins, counts) < fast
    fpd = weight_footprint(A3B)
    with_link = P._hybrid_decode(H100, A3B, fpd, {}, None, fast)[0]
    assert with_link < P._hybrid_decode(H100, A3B, fpd, {}, None, 0)[0]


def test_skewed_routing_makes_pins_pay():
    """With routing counts that favour a few experts per layer, the pins take the hot ones and carry a larger
    share of the work than their number: the hybrid decode is predicted faster than with uniform routing."""
    n_e = A3B.hparams.n_expert
    zipf = [1.0 / (1 + e) ** 1.2 for e in range(n_e)]
    counts = {i: [int(1e6 * z) for z in zipf] for i in range(40)}
    uni = next(s for s in P.plan(A3B, H100, 6 * L.GiB, 2048, 256) if s.name == "hybrid")
    skew = next(s for s in P.plan(A3B, H100, 6 * L.GiB, 2048, 256, counts=counts) if s.name == "hybrid")
    assert all(0 in v for v in skew.pinned.values())                # the hottest expert of every layer
    assert skew.decode_parts["pinned_share"] > 2 * uni.decode_parts["pinned_share"]
    assert skew.decode_s_per_tok < uni.decode_s_per_tok
    assert P.pinned_share(A3B, {}, counts) == 0.0
    assert P.pinned_share(A3B, {i: list(range(n_e)) for i in range(40)}) == 1.0


def test_slow_link_prefers_cpu_prefill():
    """On PCIe Gen1 x1 (0.25 GB/s) streaming the experts costs more than prefilling without them: no pass of a
    1024-token prompt streams (the stream split prefills on the CPU, the hybrid one in hybrid steps), and the plan
    chosen copies nothing. (Near 2048 tokens the ~67 s of copies start to beat the CPU's prefill of this machine.)"""
    ss = P.plan(A3B, CMP, 6 * L.GiB, prompt=1024, gen=256)
    by = {s.name: s for s in ss}
    assert by["stream"].min_gpu_tokens > 1024 and by["hybrid"].min_gpu_tokens > 1024
    assert ss[0].name in ("cpu", "hybrid") and "copy" not in ss[0].prefill_parts
    assert by["stream"].prefill_s == by["cpu"].prefill_s


def test_no_gpu_and_tiny_vram():
    ss = P.plan(A3B, NO_GPU, None, prompt=512, gen=64)
    assert ss[0].name == "cpu" and not any(s.fits for s in ss[1:])
    assert "no usable GPU" in ss[1].why
    tiny = P.plan(A3B, H100, 1 * L.GiB, prompt=512, gen=64)        # the dense weights alone need ~2.5 GiB
    assert tiny[0].name == "cpu"
    stream = next(s for s in tiny if s.name == "stream")
    assert not stream.fits and "budget 1.00 GiB" in stream.why


def test_big_vram_goes_resident():
    ss = P.plan(A3B, H100, 80 * L.GiB, prompt=2048, gen=256)
    assert ss[0].name == "resident"
    assert ss[0].decode_s_per_tok < next(s for s in ss if s.name == "cpu").decode_s_per_tok


def test_dense_model_has_nothing_to_stream():
    ss = P.plan(DescribedFile("qwen3.5-9b", "q4_k_m"), H100, 2 * L.GiB, prompt=512, gen=64)
    assert ss[0].name == "cpu"
    assert "no experts" in next(s for s in ss if s.name == "stream").why
    assert not next(s for s in ss if s.name == "hybrid").fits


def test_plan_command(tmp_path):
    env = {"LE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "legacy_engine", "plan", *a], capture_output=True,
                                    encoding="utf-8", errors="replace", env=env, timeout=300)
    r = run("--preset", "qwen3.6-35b-a3b", "--vram", "6GiB", "--no-gpu", "--prompt", "512", "--gen", "32")
    assert r.returncode == 0, r.stderr
    assert "chosen: cpu" in r.stdout and "no usable GPU" in r.stdout
    assert "serve --parallel B" in r.stdout and "B=8" in r.stdout       # the batched decode's prediction
    assert (tmp_path / probe.MACHINE_FILE).exists()                     # measured once, cached
    bad = run("--preset", "qwen3.6-35b-a3b", "--vram", "lots")
    assert bad.returncode == 2 and "unit" in bad.stderr
    assert run("--preset", "qwen3.6-35b-a3b", "--prompt", "0").returncode == 2
    assert run().returncode == 2


def test_routing_counts_saved_and_loaded(tmp_path, monkeypatch):
    """Routing statistics accumulate per model file (keyed by its fingerprint) and come back as the pins' order;
    a file that does not fit the model is ignored."""
    import numpy as np

    from legacy_engine.tools.make_model import make_model
    from legacy_engine.cpu.model import Model
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path))
    path = make_model("tiny-moe", str(tmp_path / "m.gguf"), progress=False)
    model = Model(path, n_threads=1, pin=False)
    hp = model.hparams
    assert P.load_routing(model) is None
    c = np.zeros(hp.n_expert, dtype=np.int64)
    c[3] = 7
    P.save_routing(model, {1: c})
    P.save_routing(model, {1: c, 2: c})
    got = P.load_routing(model)
    assert got[1][3] == 14 and got[2][3] == 7 and got[1].sum() == 14
    per = L.vram_footprint(model.file, stream_experts=True).expert_bytes
    pins = P.choose_pins(model.file, per[1] + len(per) * L.ALLOC_GRANULE, got)
    assert pins == {1: [3]}
    with open(P.routing_path(model), "w") as f:
        f.write('{"1": [1, 2]}')                                     # wrong expert count: ignored
    assert P.load_routing(model) is None


def test_info_shows_the_cached_probe(tmp_path):
    env = {"LE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"}
    info = lambda: subprocess.run([sys.executable, "-m", "legacy_engine", "info"], capture_output=True,
                                  encoding="utf-8", errors="replace", env=env, timeout=300).stdout
    assert "no machine probe cached yet" in info()
    saved = {"threads=2,gpu=0": dataclasses.asdict(NO_GPU)}
    (tmp_path / probe.MACHINE_FILE).write_text(__import__("json").dumps(saved))
    assert "threads=2,gpu=0: CPU 90.0 GB/s read" in info()


KEY2 = f"v{probe.PROBE_VERSION},threads=2,gpu=0"     # measure(2, gpu=False)'s cache key
MALFORMED_CACHES = ["not json {", "[1, 2]", '"text"', f'{{"{KEY2}": 5}}',
                    f'{{"{KEY2}": {{"cpu_threads": 2}}}}',                                      # a key missing
                    f'{{"{KEY2}": {{"cpu_threads": "2", "cpu_read_gbps": 9.0}}}}',               # a wrong type
                    f'{{"{KEY2}": {{"cpu_threads": 2, "cpu_read_gbps": null}}}}',
                    f'{{"{KEY2}": {{"cpu_threads": 2, "cpu_read_gbps": NaN}}}}',
                    f'{{"{KEY2}": {{"cpu_threads": 2, "cpu_read_gbps": 9.0, "gpu_name": 3}}}}',
                    f'{{"{KEY2}": {{"cpu_threads": true, "cpu_read_gbps": 9.0}}}}']


def fake_probe(monkeypatch, gbps: float, other: float) -> list:
    """measure()'s CPU probe returns gbps while other work of `other` CPUs runs; returns the list of the probe's
    calls."""
    from legacy_engine.cpu import cpu_load
    calls = []

    def bandwidth(n, **kw):
        calls.append(n)
        return gbps
    reading = cpu_load.CpuLoad([0, 1], {0: other}, 0.0, 2.0 * other, 0.1)
    monkeypatch.setattr(probe, "machine_bandwidth", bandwidth)
    monkeypatch.setattr(probe, "cpu_f32_gflops", lambda n, **kw: 100.0)
    monkeypatch.setattr(cpu_load, "sample", lambda *a: reading)
    monkeypatch.setattr(cpu_load, "during", lambda fn: (fn(), reading))
    return calls


@pytest.mark.parametrize("text", MALFORMED_CACHES)
def test_malformed_machine_cache_is_absent(tmp_path, monkeypatch, text):
    """A machine.json that is not JSON, not an object, or whose entry lacks a key or has a wrong type is treated as
    absent: no KeyError/TypeError in `info`'s lines or in measure(), which probes again and rewrites it."""
    import json
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path))
    (tmp_path / probe.MACHINE_FILE).write_text(text)
    assert probe.cached_machines() == {}
    assert "no machine probe cached yet" in probe.format_machines(probe.cached_machines())[0]
    try:
        raw = json.loads(text)
    except ValueError:
        raw = None
    if isinstance(raw, dict):
        assert "no machine probe cached yet" in probe.format_machines(raw)[0]
    calls = fake_probe(monkeypatch, 30.0, 0.0)
    m = probe.measure(2, gpu=False)
    assert calls == [2] and m.cpu_read_gbps == 30.0
    assert probe.machine_from_json(probe.cached_machines()[KEY2]) == m


@pytest.mark.parametrize("text", MALFORMED_CACHES[:2] + MALFORMED_CACHES[4:6])
def test_info_survives_a_malformed_machine_cache(tmp_path, text):
    env = {"LE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"}
    (tmp_path / probe.MACHINE_FILE).write_text(text)
    r = subprocess.run([sys.executable, "-m", "legacy_engine", "info"], capture_output=True, encoding="utf-8",
                       errors="replace", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "no machine probe cached yet" in r.stdout and "Traceback" not in r.stderr


def test_probe_under_load_is_flagged_and_retaken(tmp_path, monkeypatch):
    """Issue 21: a probe taken while other work runs is flagged (the load recorded) and `plan` says so; the next
    measure() keeps it while the machine is still busy and retakes it once it is idle; then the clean one stays."""
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path))
    calls = fake_probe(monkeypatch, 6.6, 1.0)                  # other work on a whole CPU
    m = probe.measure(2, gpu=False)
    assert m.under_load and m.load_cpus == 1.0 and m.measured_at > 0 and calls == [2]
    assert "UNDER LOAD" in m.probe_note() and "retaken" in m.probe_note()
    assert probe.cached_machines()[KEY2]["under_load"] is True
    assert "UNDER LOAD" in "\n".join(probe.format_machines(probe.cached_machines()))
    assert probe.measure(2, gpu=False).cpu_read_gbps == 6.6 and calls == [2]     # still busy: kept, not retaken
    calls = fake_probe(monkeypatch, 35.0, 0.0)                 # idle now
    m = probe.measure(2, gpu=False)
    assert calls == [2] and m.cpu_read_gbps == 35.0 and not m.under_load
    assert "idle" in m.probe_note() and "STALE" not in m.probe_note()
    assert probe.measure(2, gpu=False).cpu_read_gbps == 35.0 and calls == [2]    # clean: cached
    assert probe.measure(2, gpu=False, refresh=True) and calls == [2, 2]        # --remeasure


def test_probe_without_a_load_record_is_retaken_when_idle(tmp_path, monkeypatch):
    """A probe cached before the load was recorded (the issue's 6.6 GB/s) is retaken on an idle machine."""
    import json
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path))
    (tmp_path / probe.MACHINE_FILE).write_text(json.dumps({KEY2: {"cpu_threads": 2,
                                                                                "cpu_read_gbps": 6.6}}))
    old = probe.machine_from_json(probe.cached_machines()[KEY2])
    assert old.cpu_read_gbps == 6.6 and "no record" in old.probe_note()
    calls = fake_probe(monkeypatch, 35.0, 0.0)
    assert probe.measure(2, gpu=False).cpu_read_gbps == 35.0 and calls == [2]


def test_plan_prints_the_probe_note(capsys):
    now = __import__("time").time()
    stale = dataclasses.replace(NO_GPU, measured_at=now - 40 * 86400, load_cpus=0.0, load_avg=0.1)
    assert "STALE" in stale.probe_note(now)
    loaded = dataclasses.replace(NO_GPU, measured_at=now - 60, load_cpus=1.2, load_avg=3.0, under_load=True)
    ss = P.plan(A3B, loaded, None, prompt=64, gen=8)
    print_plan("a3b", loaded, ss, 64, 8, None)
    out = capsys.readouterr().out
    assert "UNDER LOAD (other work on 1.2 CPUs" in out


def test_streamed_models_keep_fewer_logit_rows():
    """A streamed model runs the head in STREAM_LOGIT_ROWS pieces, so its scratch holds that many rows of logits, not
    LOGIT_ROWS: the difference goes to pinned experts."""
    hp = A3B.hparams
    res = L.vram_footprint(A3B, n_ctx=4096, chunk=2048)
    st = L.vram_footprint(A3B, stream_experts=True, n_ctx=4096, chunk=2048)
    assert L.head_rows(2048, False) == L.LOGIT_ROWS and L.head_rows(2048, True) == L.STREAM_LOGIT_ROWS
    assert L.head_rows(16, True) == 16
    saved = res.parts["scratch"] - st.parts["scratch"]
    # the scratch total is rounded to the allocation granularity (layout._round): within a few MiB
    assert saved == pytest.approx(4 * (L.LOGIT_ROWS - L.STREAM_LOGIT_ROWS) * hp.n_vocab, abs=4 * 2**20)


def test_prefill_blocks_share_one_arena():
    """A pass of several tokens keeps one block's buffers at a time (layout.block_scratch: every name the GPU model
    asks for under ARENA_NAMES, each in its block), so its scratch counts the largest block, a decode step all."""
    hp = A3B.hparams
    blocks = L.block_scratch(hp, 2048, True)
    assert set(blocks) == {"gdn", "attention", "moe"}
    for b, names in blocks.items():
        assert all(L.ARENA_NAMES[n] == b for n in names)
    sums = {b: sum(v.values()) for b, v in blocks.items()}
    assert L.arena_bytes(hp, 2048, True) >= max(sums.values())
    assert L.arena_bytes(hp, 2048, True) < max(sums.values()) + L.ARENA_ALIGN * len(L.ARENA_NAMES)
    one = L.block_scratch(hp, 1, True)
    assert L.scratch_bytes(hp, 1, True, 1) >= sum(sum(v.values()) for v in one.values())


def test_token_embedding_stays_on_the_host_when_experts_stream():
    """layout.host_embedding: a streamed model reads its token embedding from host memory (its own head), so the
    weights in VRAM leave it out; resident models and tied heads keep it."""
    assert L.host_embedding(A3B, True) and not L.host_embedding(A3B, False)
    assert "token_embd.weight" not in L.resident_names(A3B, True)
    assert "token_embd.weight" in L.resident_names(A3B, False)
    tied = DescribedFile("qwen3.5-0.8b", "q4_k_m")          # its head is the embedding
    assert "output.weight" not in tied.tensors and not L.host_embedding(tied, True)


def test_decode_extras_fill_the_idle_staging():
    """choose_decode_extras: experts not pinned, hottest first within each layer (by the routing counts), packed
    with each layer's link slots into the staging pool (extras_regions) until no further expert fits."""
    rng = np.random.default_rng(5)
    hp = A3B.hparams
    counts = {i: rng.integers(0, 1000, hp.n_expert) for i in range(hp.n_layer)}
    pins, _ = P.fill_pins(A3B, 6 * L.GiB, 4096, 2048, True, counts)
    extras = P.choose_decode_extras(A3B, pins, counts, slots=1)
    pool = L.staging_pool_bytes(A3B)
    regions = L.extras_regions(A3B, extras, slots=1)
    end = max(o + b for o, b in regions.values())
    per = {i: full // hp.n_expert for i, full in L.layer_expert_bytes(A3B).items()}
    assert end <= pool and pool - end < max(per.values()) + L.WEIGHT_ALIGN
    assert set(regions) == set(per)                                  # every layer: its link slot
    n = sum(map(len, extras.values()))
    assert n > 300
    for i, es in extras.items():
        assert not set(es) & set(pins.get(i, ()))
        rest = [e for e in range(hp.n_expert) if e not in es and e not in pins.get(i, ())]
        if rest:
            assert counts[i][es].min() >= counts[i][rest].max()
    assert P.pinned_share(A3B, P.merge_pins(pins, extras), counts) > P.pinned_share(A3B, pins, counts)


def test_decode_extras_only_where_their_copy_pays():
    """The hybrid strategy keeps decode extras where the decode time they save over a reply (EXTRAS_MIN_GEN tokens)
    exceeds copying them back after each prefill: on the GPU machine's link yes, over a CMP's PCIe Gen1 x1 no."""
    fast = {s.name: s for s in P.plan(A3B, dataclasses.replace(H100, link_gbps=55.0), 6 * L.GiB, 2048, 32)}
    slow = {s.name: s for s in P.plan(A3B, CMP, 6 * L.GiB, 2048, 32)}
    assert sum(map(len, fast["hybrid"].decode_extras.values())) > 300
    assert slow["hybrid"].decode_extras == {}
    with_x = P._hybrid_decode(H100, A3B, weight_footprint(A3B), P.merge_pins(fast["hybrid"].pinned,
                                                                             fast["hybrid"].decode_extras), None)[0]
    assert with_x < P._hybrid_decode(H100, A3B, weight_footprint(A3B), fast["hybrid"].pinned, None)[0]


def test_pins_drift():
    """pins_drift: none for the counts the pins were chosen from; for other counts, the share of the routed work
    the best pins for them (in no more bytes) would take beyond the current pins'."""
    rng = np.random.default_rng(9)
    hp = A3B.hparams
    c1 = {i: rng.integers(0, 1000, hp.n_expert) for i in range(hp.n_layer)}
    c2 = {i: rng.integers(0, 1000, hp.n_expert) for i in range(hp.n_layer)}
    pins, _ = P.fill_pins(A3B, 6 * L.GiB, 4096, 2048, True, c1)
    assert P.pins_drift(A3B, pins, c1)[0] == pytest.approx(0.0, abs=1e-9)
    drift, best = P.pins_drift(A3B, pins, c2)
    assert drift > 0.05
    per = {i: full // hp.n_expert for i, full in L.layer_expert_bytes(A3B).items()}
    assert sum(per[i] * len(v) for i, v in best.items()) <= sum(per[i] * len(v) for i, v in pins.items())
    assert P.pins_drift(A3B, {}, c2) == (0.0, {})


def test_placement_is_complete_immutable_data():
    """place: every tensor's residency (resident in the one weight allocation at its offset, routed experts
    streamed, the token embedding read from the host when they stream), the footprint checked against the budget,
    the hybrid settings checked; the Placement cannot be changed."""
    res = place(A3B, n_ctx=4096)
    assert res.decode == "gpu" and not res.stream and set(res.residency.values()) == {"resident"}
    assert list(res.offsets) == L.resident_names(A3B, False) and res.weight_bytes >= sum(
        L.gpu_tensor_bytes(A3B.tensors[n]) for n in res.offsets)
    assert res.footprint == L.vram_footprint(A3B, n_ctx=4096)
    assert res.arena_bytes == L.arena_bytes(A3B.hparams, 512, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.chunk = 16
    with pytest.raises(TypeError):
        res.offsets["x"] = 0
    with pytest.raises(PlanningError, match="weights .* GiB"):
        place(A3B, budget=6 * L.GiB)
    pins = {3: [5, 1, 5], 7: [0]}
    st = place(A3B, budget=6 * L.GiB, stream=True, pinned=pins, chunk=2048, decode="hybrid", link_experts=1,
               decode_extras={3: [2]})
    assert st.stream and st.cpu_experts and st.pinned == {3: (1, 5), 7: (0,)} and st.decode_extras == {3: (2,)}
    assert st.residency["token_embd.weight"] == "host" and st.residency["blk.0.ffn_down_exps.weight"] == "streamed"
    assert "blk.0.ffn_down_exps.weight" not in st.offsets and st.logit_rows == L.STREAM_LOGIT_ROWS
    assert st.extras_at == L.extras_regions(A3B, {3: [2]}, 1)
    for bad in (dict(link_experts=1), dict(decode_extras={3: [2]}), dict(decode="hybrid", decode_extras={3: [5]}),
                dict(chunk=8192), dict(decode="gpu")):
        with pytest.raises(ValueError):
            place(A3B, stream=True, pinned=pins, **bad)


def test_repin_follows_the_drift():
    """repin: None under a few routes or a small drift; else the placement with the best pins for the routing
    counted since, in no more bytes, the decode extras re-chosen around them, the rest as it was."""
    rng = np.random.default_rng(11)
    hp = A3B.hparams
    c1 = {i: rng.integers(0, 1000, hp.n_expert) for i in range(hp.n_layer)}
    pins, _ = P.fill_pins(A3B, 6 * L.GiB, 4096, 2048, True, c1)
    extras = P.choose_decode_extras(A3B, pins, c1)
    pl = place(A3B, budget=6 * L.GiB, stream=True, pinned=pins, chunk=2048, decode="hybrid", decode_extras=extras)
    many = P.REPIN_MIN_ROUTES * hp.n_expert
    assert P.repin(A3B, pl, {i: c * 0 for i, c in c1.items()}) is None           # no routes yet
    assert P.repin(A3B, pl, {i: c * many for i, c in c1.items()}) is None        # the same routing: no drift
    hot = {i: np.zeros(hp.n_expert, np.int64) for i in range(hp.n_layer)}
    for c in hot.values():
        c[[200, 201]] = many
    new = P.repin(A3B, pl, hot)
    assert new is not None and all({200, 201} <= set(v) for v in new.pinned.values())
    assert all(not set(v) & set(new.pinned.get(i, ())) for i, v in new.decode_extras.items())
    assert new.footprint.total <= pl.budget and new.offsets == pl.offsets and new.decode == pl.decode
    assert P.repin(A3B, place(A3B, stream=True, pinned=pins), hot) is None          # no budget: nothing to follow


def test_noise_counts_pin_consecutive_experts():
    """Routing counts that uniform routing could have drawn rank no expert above another (_hotness): the pins take
    the lowest ids, consecutive, as without counts (a streamed pass copies around them in fewer, longer copies);
    counts with a real skew (a few hot experts) still take the hot ones."""
    rng = np.random.default_rng(3)
    hp = A3B.hparams
    noise = {i: rng.poisson(640, hp.n_expert) for i in range(hp.n_layer)}      # a 2048-token pass's counts, uniform
    plain, _ = P.fill_pins(A3B, 6 * L.GiB, 4096, 2048, True)
    pins, _ = P.fill_pins(A3B, 6 * L.GiB, 4096, 2048, True, noise)
    assert pins == plain and all(v == list(range(len(v))) for v in pins.values())
    skew = {i: c.copy() for i, c in noise.items()}
    for c in skew.values():
        c[[200, 230]] = 5000
    pins, _ = P.fill_pins(A3B, 6 * L.GiB, 4096, 2048, True, skew)
    assert all({200, 230} <= set(v) for v in pins.values())
    assert not np.any(P._hotness(noise[0].astype(float))) and np.array_equal(P._hotness(skew[0] * 1.0), skew[0])


def test_pin_order_weighs_the_copies_against_the_decode():
    """A streamed pass issues a copy a tensor and run of experts between a layer's pins (H2D_COPY_S each beyond its
    bytes): as many pins scattered predict the copies' extra time exactly. The stream strategy (CPU decode) then
    pins consecutive ids for a long prompt; the hybrid pins the saved routing's hottest where the decode they speed
    up pays for their copies over a reply (max(gen, EXTRAS_MIN_GEN)), consecutive ids where the skew is too mild."""
    hp, fpd = A3B.hparams, weight_footprint(A3B)
    layers = list(L.layer_expert_bytes(A3B))
    lined = {i: list(range(45)) for i in layers}
    spread = {i: list(range(0, 225, 5)) for i in layers}
    assert P._runs_between(lined[layers[0]], hp.n_expert) == 1 and P._runs_between(spread[layers[0]], 256) == 45
    _, a = P._gpu_prefill(H100, A3B, fpd, 2048, 2048, True, lined)
    _, b = P._gpu_prefill(H100, A3B, fpd, 2048, 2048, True, spread)
    n_t = len(L.expert_tensors(A3B, layers[0]))
    assert a["copies"] == n_t * len(layers) and b["copies"] == 45 * n_t * len(layers)
    assert b["copy"] - a["copy"] == pytest.approx((b["copies"] - a["copies"]) * P.H2D_COPY_S, rel=1e-9)
    h200 = dataclasses.replace(H100, link_gbps=52.5, gpu_gemm_tflops=113.2)   # as probed: the copies set the pace
    mild = {i: 1000 + 100 * (np.arange(hp.n_expert) % 2) for i in layers}      # odd ids 10 % hotter: no noise
    perm = np.random.default_rng(5).permutation(hp.n_expert)                  # hot experts at scattered ids
    zipf = {i: (1e6 / (1 + perm) ** 1.2).astype(np.int64) for i in layers}
    for counts, hybrid_by in ((mild, "ids"), (zipf, "counts")):
        ss = {s.name: s for s in P.plan(A3B, h200, 6 * L.GiB, 2048, 8, counts=counts)}
        assert ss["stream"].pins_by == "ids" and ss["hybrid"].pins_by == hybrid_by
        assert all(v == list(range(v[0], v[0] + len(v))) for v in ss["stream"].pinned.values())
        hot = P.fill_pins(A3B, 6 * L.GiB, 2048 + 8, ss["hybrid"].chunk, True, counts)[0]
        seq = P.fill_pins(A3B, 6 * L.GiB, 2048 + 8, ss["hybrid"].chunk, True)[0]
        assert hot != seq and P._gpu_prefill(h200, A3B, fpd, 2048, 2048, True, hot)[0] > \
            P._gpu_prefill(h200, A3B, fpd, 2048, 2048, True, seq)[0]


def test_gpu_prefill_counts_the_attention_pairs():
    """The GPU prefill's compute counts the attention's causal (query, key) pairs, n (n + 1) / 2 per attention layer
    however the passes cut n: four times the prompt, sixteen times the attention term (within the pairs' + n / 2),
    and the same term in passes of 2,048 and 4,096 tokens."""
    fpd = weight_footprint(A3B)
    t1, p1 = P._gpu_prefill(H100, A3B, fpd, 2048, 2048, True, {})
    t4, p4 = P._gpu_prefill(H100, A3B, fpd, 8192, 4096, True, {})
    _, p4b = P._gpu_prefill(H100, A3B, fpd, 8192, 2048, True, {})
    assert p1["attention"] > 0 and abs(p4["attention"] / p1["attention"] - 16) < 0.01
    assert p4b["attention"] == pytest.approx(p4["attention"], rel=1e-12)
    assert p4["compute"] > 4 * p1["compute"]             # the quadratic term: more than 4x the compute
