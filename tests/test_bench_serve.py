"""`legacy-engine bench serve` (tools/bench_serve.py, tools/llama_server.py): the length distributions, the SSE
parser on canned streams, the percentiles, one streamed request against a canned server, and short runs against our
server on the tiny model (and llama-server's, where a binary is found)."""
from __future__ import annotations

import http.server
import json
import random
import signal
import threading

import pytest

from legacy_engine.core.errors import UnavailableError
from legacy_engine.tools import bench_cmd, llama_server
from legacy_engine.tools.bench_serve import (Dist, LoadConfig, Request, make_requests, one_token_words, parse_dist,
                                             percentile, run_request, sse_data, summarize)

pytestmark = pytest.mark.cpu


# ---- distributions

@pytest.mark.parametrize("spec, dist", [("fixed:64", Dist(64, 64)), ("uniform:64-256", Dist(64, 256)),
                                        (" uniform: 3 - 3 ", Dist(3, 3)), ("fixed:1", Dist(1, 1))])
def test_parse_dist(spec, dist):
    assert parse_dist(spec) == dist


@pytest.mark.parametrize("spec", ["64", "fixed:", "fixed:0", "fixed:4-8", "uniform:8", "uniform:9-3", "uniform:0-3",
                                  "normal:3-4", "uniform:-1-3", "fixed:2.5", ""])
def test_parse_dist_refuses(spec):
    with pytest.raises(ValueError, match=r"--prompt-len takes fixed:N or uniform:A-B"):
        parse_dist(spec, "--prompt-len")


def test_dist_sample_is_seeded_and_inclusive():
    d = Dist(3, 5)
    draws = [d.sample(random.Random(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    rng = random.Random(0)
    assert {d.sample(rng) for _ in range(200)} == {3, 4, 5}
    assert str(d) == "uniform:3-5" and str(Dist(4, 4)) == "fixed:4"


# ---- percentiles

def test_percentile_linear():
    xs = [4.0, 1.0, 3.0, 2.0]                   # sorted 1 2 3 4: numpy's "linear"
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 95) == pytest.approx(3.85)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


# ---- server-sent events

def test_sse_openai_stream():
    stream = b'data: {"a": 1}\n\ndata: {"a": 2}\n\ndata: [DONE]\n\ndata: {"after": true}\n\n'
    assert [json.loads(d) for d in sse_data(stream.splitlines(keepends=True))] == [{"a": 1}, {"a": 2}]


def test_sse_crlf_comments_fields_multiline_and_no_final_blank():
    lines = [b": ping\r\n", b"event: message\r\n", b"data:x\r\n", b"data: y\r\n", b"id: 3\r\n", b"\r\n",
             b"\r\n", b"retry: 10\n", b"data: last"]
    assert list(sse_data(lines)) == ["x\ny", "last"]


def test_sse_empty_and_unicode():
    assert list(sse_data([])) == []
    assert list(sse_data(["data: «é»\n".encode(), b"\n"])) == ["«é»"]


# ---- one request against a canned server

CANNED = [{"choices": [{"text": "a", "finish_reason": None}]},
          {"choices": [{"text": "", "finish_reason": None}]},      # a token whose text waits (inside a character)
          {"choices": [{"text": "bc", "finish_reason": None}]},
          {"choices": [{"text": "d", "finish_reason": "length"}]}]
USAGE = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                                  "prompt_tokens_details": {"cached_tokens": 5}}}


@pytest.fixture
def canned_server():
    events: list = []
    seen: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for e in events:
                self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], events, seen
    srv.shutdown()
    srv.server_close()


def _request(port: int) -> dict:
    return run_request(port, Request(0, " one two", 2, 4, True, 11), "k")


def test_run_request_reads_usage(canned_server):
    port, events, seen = canned_server
    events += CANNED + [USAGE]
    rec = _request(port)
    assert rec["error"] is None and rec["text"] == "abcd" and rec["finish_reason"] == "length"
    assert (rec["chunks"], len(rec["itl_s"]), rec["completion_tokens"]) == (3, 2, 4)
    assert (rec["prompt_tokens"], rec["cached_tokens"]) == (9, 5) and "tokens_from" not in rec
    assert 0 < rec["ttft_s"] <= rec["e2e_s"]
    assert seen == [{"prompt": " one two", "max_tokens": 4, "temperature": 0, "seed": 11, "stream": True,
                     "stream_options": {"include_usage": True}}]
    s = summarize([rec], wall_s=2.0)
    assert (s["completion_tokens"], s["output_tok_s"], s["requests_s"], s["errors"]) == (4, 2.0, 0.5, 0)
    assert s["chunks_per_token"] == 0.75 and s["cached_tokens"] == 5 and s["tokens_from"] == "usage"
    assert s["ttft_shared_ms"]["p50"] == pytest.approx(rec["ttft_s"] * 1e3) and s["ttft_other_ms"]["p50"] is None


def test_run_request_without_usage_counts_chunks(canned_server):
    port, events, _ = canned_server
    events += CANNED
    rec = _request(port)
    assert (rec["completion_tokens"], rec["tokens_from"], rec["prompt_tokens"]) == (3, "chunks", None)


def test_run_request_error_event(canned_server):
    port, events, _ = canned_server
    events += [CANNED[0], {"error": {"message": "shutting down", "code": 503}}]
    rec = _request(port)
    assert "shutting down" in rec["error"]
    assert summarize([rec], 1.0)["errors"] == 1


# ---- configuration and the llama-server helper

def test_load_config_checks():
    LoadConfig("m.gguf").check()
    with pytest.raises(ValueError, match="does not fit --ctx 256"):
        LoadConfig("m.gguf", ctx=256).check()
    LoadConfig("m.gguf", ctx=320, shared_prefix=0.0).check()        # no prefix: 256 + 64 fit
    with pytest.raises(ValueError, match="--shared-prefix"):
        LoadConfig("m.gguf", shared_prefix=1.5).check()
    with pytest.raises(ValueError, match="--clients"):
        LoadConfig("m.gguf", clients=(0,)).check()
    assert LoadConfig("m.gguf", clients=(1, 8)).slots == 8 and LoadConfig("m.gguf", parallel=3).slots == 3


def test_bench_serve_flag_errors(capsys):
    assert bench_cmd.main(["serve", "m.gguf", "--max-tokens", "uniform:9-3"]) == 2
    assert "--max-tokens takes fixed:N or uniform:A-B" in capsys.readouterr().err
    assert bench_cmd.main(["serve", "m.gguf", "--clients", "1,x"]) == 2
    assert bench_cmd.main(["serve"]) == 2
    assert "MODEL is required" in capsys.readouterr().err


def test_find_llama_server_says_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(UnavailableError, match="not an executable llama-server"):
        llama_server.find_llama_server(str(tmp_path / "nope"))
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UnavailableError, match="--build-llama-server"):
        llama_server.find_llama_server()
    monkeypatch.setattr(llama_server.shutil, "which", lambda name: None)
    with pytest.raises(UnavailableError, match="cmake, a C compiler"):
        llama_server.build_llama_server(log=lambda s: None)


def test_llama_cpp_version_is_the_oracles():
    from conftest import LLAMA_CPP_PYTHON_VERSION
    assert llama_server.LLAMA_CPP_PYTHON_VERSION == LLAMA_CPP_PYTHON_VERSION


def test_isa_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni avx_vnni\n")
    assert llama_server.isa_flags(str(info)) == ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX_VNNI=ON"]
    info.write_text("flags\t\t: avx2 avx512_vnni\n")                    # no AVX512F: no AVX-512 extension
    assert llama_server.isa_flags(str(info)) == []
    assert llama_server.isa_flags(str(tmp_path / "missing")) == []


# ---- end to end on the tiny model

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from legacy_engine.tools.make_model import make_model
    out = tmp_path_factory.mktemp("bench_serve_model") / "tiny-moe-q8_0-4l.gguf"
    return make_model("tiny-moe", str(out), layers=4, quant="q8_0", progress=False)


def test_prompts_are_one_token_per_word(tiny_model):
    from legacy_engine.format.gguf_file import GGUFFile
    from legacy_engine.format.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(GGUFFile(tiny_model).metadata)
    cfg = LoadConfig(tiny_model, requests=6, prompt_len=Dist(5, 30), prefix_len=12, shared_prefix=0.5, seed=3)
    reqs = make_requests(one_token_words(tok), cfg)
    assert reqs == make_requests(one_token_words(tok), cfg)
    assert any(r.shared for r in reqs) and not all(r.shared for r in reqs)
    for r in reqs:
        assert len(tok.encode(r.prompt, special=False, add_bos=False)) == r.prompt_tokens
    shared = [r.prompt for r in reqs if r.shared]
    assert all(p.split()[:12] == shared[0].split()[:12] for p in shared)


RUN_ARGS = ["--clients", "2", "--requests", "3", "--prompt-len", "uniform:8-24", "--max-tokens", "fixed:6",
            "--prefix-len", "16", "--shared-prefix", "0.5", "--parallel", "2", "--threads", "1", "--ctx", "128"]
SUMMARY_KEYS = {"requests", "errors", "wall_s", "completion_tokens", "prompt_tokens", "cached_tokens", "output_tok_s",
                "requests_s", "ttft_ms", "ttft_shared_ms", "ttft_other_ms", "itl_ms", "tpot_ms_mean", "e2e_ms",
                "chunks_per_token", "tokens_from"}


def _bench(tmp_path, capsys, model, *extra) -> tuple[dict, str]:
    out = tmp_path / "serve.json"
    assert bench_cmd.main(["serve", model, *RUN_ARGS, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _check_runs(res: dict, engines: list[str]) -> None:
    assert [(r["engine"], r["clients"]) for r in res["runs"]] == [(e, 2) for e in engines]
    assert res["config"]["parallel"] == 2 and len(res["requests"]) == 3
    for run in res["runs"]:
        s = run["summary"]
        assert SUMMARY_KEYS <= set(s) and s["requests"] == 3 and s["errors"] == 0
        assert s["output_tok_s"] > 0 and set(s["ttft_ms"]) == {"p50", "p95", "p99"}
        assert "KEY" in run["command"] and run["server_exit"] in (0, -signal.SIGTERM)   # uvicorn re-raises it
        assert [r["index"] for r in run["records"]] == [0, 1, 2]
        for rec, req in zip(run["records"], res["requests"]):
            assert rec["error"] is None and 1 <= rec["completion_tokens"] <= 6 and rec["chunks"] >= 1
            assert rec["prompt_tokens"] == req["prompt_tokens"]          # one token per word, on both servers


@pytest.mark.slow
def test_bench_serve_ours(tiny_model, tmp_path, capsys):
    res, text = _bench(tmp_path, capsys, tiny_model)
    _check_runs(res, ["ours"])
    assert res["ratios"] == [] and "slot(s)" in res["runs"][0]["banner"]
    assert "ours" in text and "TTFT p50" in text


@pytest.mark.slow
def test_bench_serve_with_llama(tiny_model, tmp_path, capsys):
    try:
        binary = llama_server.find_llama_server()
    except UnavailableError as e:
        pytest.skip(f"no llama-server: {e}")
    res, text = _bench(tmp_path, capsys, tiny_model, "--llama", binary)
    _check_runs(res, ["ours", "llama.cpp"])
    assert [q["clients"] for q in res["ratios"]] == [2] and res["ratios"][0]["output_tok_s"] > 0
    assert "ours/llama.cpp at 2 client(s)" in text


@pytest.mark.slow
def test_bench_long_prompt_ours(tiny_model, tmp_path, capsys):
    """--long-prompt: probes idle and during a long prefill, each answered; during-probes counted only while the
    long request had no first token yet."""
    out = tmp_path / "long.json"
    assert bench_cmd.main(["serve", tiny_model, "--long-prompt", "400", "--probes", "3", "--parallel", "2",
                           "--threads", "1", "--ctx", "512", "--json", str(out)]) == 0
    res, text = json.loads(out.read_text()), capsys.readouterr().out
    (run,) = res["runs"]
    assert run["engine"] == "ours" and run["errors"] == 0 and run["long_error"] is None
    assert len(run["records"]["idle"]) == 3 and len(run["records"]["busy"]) == 3
    assert run["idle_ttft_ms"]["p50"] > 0 and run["long_ttft_s"] > 0
    assert run["n_during"] == sum(1 for r in run["records"]["busy"] if r["sent_after_s"] < run["long_ttft_s"])
    assert "p95 during / p50 idle" in text


def test_bench_long_prompt_refuses_a_prompt_beyond_the_context(tiny_model, capsys):
    assert bench_cmd.main(["serve", tiny_model, "--long-prompt", "4096", "--ctx", "512"]) == 2
    assert "does not fit --ctx 512" in capsys.readouterr().err
