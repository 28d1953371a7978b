"""The `legacy-engine` command line as a llama.cpp or Ollama user meets it (issue 21): --version, `chat`, flags
checked before a model loads, --seed -1, errors without the C core's internals, tokenize's pieces, a load status on
a terminal, make-model's usage, bench cache's defaults, and the README's commands.

"Before the model loads" is shown by naming a model file that does not exist: a flag error must win over the
missing file. The commands that generate run our f32 conversion of the tiny MoE checkpoint (vocab 4096).
"""
from __future__ import annotations

import inspect
import json
import os
import pty
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.make_reference import tiny_gguf

from legacy_engine import __version__

from legacy_engine.tools import cli
from legacy_engine.core.errors import NativeError

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[1]
N_THREADS = 2
TIMING = re.compile(r"^\[(length|stop)\] load [\d.]+ s \| prefill (\d+) tok, [\d.]+ tok/s \| decode (\d+) tok", re.M)


def _cli(*args, env=None, stdin=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "legacy_engine", *map(str, args)], cwd=REPO, capture_output=True,
                          input=stdin, encoding="utf-8", errors="replace", timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return tiny_gguf("moe", tmp_path_factory.mktemp("cli") / "moe.f32.gguf")


@pytest.fixture
def missing(tmp_path) -> Path:
    return tmp_path / "no-such-model.gguf"


def test_version():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"legacy_engine {__version__}"


def test_readme_commands_exist():
    """Every `legacy-engine COMMAND` the README names is a command (the README named `chat` before it existed)."""
    named = set(re.findall(r"`legacy-engine ([a-z][a-z-]*)", (REPO / "README.md").read_text(encoding="utf-8")))
    r = _cli("--help")
    listed = set(re.findall(r"^    ([a-z][a-z-]+)(?: |$)", r.stdout, re.M))
    assert "chat" in named and named <= listed, (named - listed, r.stdout)


# ------------------------------------------------------------------------------------------------ flags before loading

@pytest.mark.parametrize("args,message", [
    (["-p", "Hi", "-n", "-5"], "argument -n/--n-predict: expected a token count >= 0, or -1"),
    (["-p", "Hi", "--seed", "-2"], "argument --seed: expected a seed >= 0, or -1 for a random one"),
    (["-p", ""], "empty prompt"),
    (["-p", "Hi", "--top-p", "3"], "top_p must be in (0, 1]"),
])
def test_bad_flags_fail_before_the_model_loads(missing, args, message):
    r = _cli("run", missing, *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "cannot read" not in r.stderr and "Traceback" not in r.stderr


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}    # no device even on the GPU machine


@pytest.mark.parametrize("cmd", ["run", "chat"])
def test_gpu_without_a_gpu_fails_before_the_model_loads(missing, cmd):
    r = _cli(cmd, missing, "-p", "Hi", "--gpu", env=NO_GPU)
    assert r.returncode == 1 and "--gpu: no usable GPU" in r.stderr, r.stderr
    assert "cannot read" not in r.stderr


def test_demo_gpu_without_a_gpu_says_so_first(tmp_path):
    """No model card and no demo model made: the GPU check runs first."""
    r = _cli("demo", "--gpu", env={**NO_GPU, "LE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("legacy-engine: error: --gpu: no usable GPU"), r.stderr
    assert len(r.stderr.splitlines()) == 1 and not list(tmp_path.glob("demo-*.gguf")), r.stderr


def test_serve_on_a_port_in_use_fails_before_the_model_loads(missing):
    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _cli("serve", missing, "--port", port, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "pick another --port" in r.stderr, r.stderr
    assert "cannot read" not in r.stderr


# ------------------------------------------------------------------------------------------------ clean errors

def test_native_errors_lose_the_c_location(missing, monkeypatch, capsys):
    """A NativeError reaches the user as one clean line; LE_DEBUG=1 keeps the C function, file:line and traceback."""
    raw = "le_model_create: invalid argument: threads.c:125: n_threads = 10000, expected 1..1024"

    def fail(*a, **k):
        raise NativeError(1, raw)
    monkeypatch.setattr("legacy_engine.serve.generate.Engine", fail)
    monkeypatch.delenv("LE_DEBUG", raising=False)
    assert cli.main(["run", str(missing), "-p", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err == "legacy-engine: error: invalid argument: n_threads = 10000, expected 1..1024\n"
    monkeypatch.setenv("LE_DEBUG", "1")
    with pytest.raises(NativeError):
        cli.main(["run", str(missing), "-p", "Hi"])
    assert raw in capsys.readouterr().err


@pytest.mark.slow
def test_too_many_threads_is_one_clean_line(model_path):
    r = _cli("run", model_path, "-p", "Hi", "-t", 10000)
    assert r.returncode in (1, 2), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "n_threads" in r.stderr, r.stderr
    assert not re.search(r"\.c:\d+", r.stderr) and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------ run, seed, chat

@pytest.mark.slow
def test_seed_minus_one_is_random(model_path):
    outs = []
    for _ in range(2):
        r = _cli("run", model_path, "-p", "Once upon a time", "-n", 16, "--temp", 1.0, "--seed", -1, "-t", N_THREADS)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] != outs[1]


def _turns(stderr: str) -> list[tuple[int, int]]:
    return [(int(m.group(2)), int(m.group(3))) for m in TIMING.finditer(stderr)]


@pytest.mark.slow
def test_chat_reset_and_exit(model_path):
    """/reset forgets the conversation (the same turn again: the same answer from the same prompt), /exit ends
    the chat (the line after it is not answered); `run --chat` is the same command."""
    script = "Hello there\n/reset\nHello there\n/exit\nnot answered\n"
    r = _cli("chat", model_path, "-n", 6, "-t", N_THREADS, stdin=script)
    assert r.returncode == 0, r.stderr
    answers = r.stdout.splitlines()
    assert len(answers) == 2 and answers[0] == answers[1] and answers[0].strip(), r.stdout
    turns = _turns(r.stderr)
    assert len(turns) == 2 and turns[0] == turns[1], r.stderr
    assert "(conversation reset)" in r.stderr
    r2 = _cli("run", model_path, "--chat", "-n", 6, "-t", N_THREADS, stdin=script)
    assert r2.returncode == 0 and r2.stdout == r.stdout, r2.stderr


@pytest.mark.slow
def test_chat_keeps_the_state_between_turns(model_path):
    """The second turn runs only what it adds (the end of the first answer's turn and the new user turn), not the
    whole conversation again."""
    r = _cli("chat", model_path, "-n", 6, "-t", N_THREADS, stdin="Hello there\nHello there\n")
    assert r.returncode == 0, r.stderr
    (p1, d1), (p2, _) = _turns(r.stderr)
    assert d1 == 6 and p2 < p1 + d1, r.stderr     # the whole conversation would be p1 + d1 + p2's own tokens


# ------------------------------------------------------------------------------------------------ load status

def _run_on_a_terminal(args) -> str:
    """stderr of `legacy-engine ARGS` written to a pseudo-terminal (stdout captured apart)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "legacy_engine", *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:     # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.communicate(timeout=120)
    os.close(master)
    assert proc.returncode == 0
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_load_status_on_a_terminal_only(model_path):
    err = _run_on_a_terminal(["run", model_path, "-p", "Hi", "-n", 2, "-t", N_THREADS])
    assert f"loading {model_path.name} (" in err and "\r\x1b[K" in err, err
    r = _cli("run", model_path, "-p", "Hi", "-n", 2, "-t", N_THREADS)     # a pipe: no status, no carriage returns
    assert r.returncode == 0 and "loading" not in r.stderr and "\r" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------------ tokenize

def test_token_text():
    assert cli.token_text("Hello wörld".encode()) == "'Hello wörld'"
    assert cli.token_text(b"\xf0\x9f") == "'\\xf0\\x9f'"                 # half of an emoji: escaped bytes
    assert cli.token_text(b"a\xe4b") == "'a\\xe4b'"
    assert cli.token_text(b"it's \\ \n") == "'it\\'s \\\\ \\n'"          # quote, backslash, newline escaped
    assert cli.token_text(b"") == "''"


@pytest.mark.slow
def test_tokenize_prints_pieces(model_path):
    r = _cli("tokenize", model_path, "Hi 😀")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines and all(re.fullmatch(r" *\d+  '.*'", ln) for ln in lines), r.stdout
    assert "b'" not in r.stdout
    assert "\\xf0" in r.stdout or "😀" in r.stdout        # the tiny vocabulary splits the emoji into its bytes
    ids = [int(ln.split()[0]) for ln in lines]
    assert json.loads(_cli("tokenize", model_path, "Hi 😀", "--json").stdout) == ids


# ------------------------------------------------------------------------------------------------ other commands

def test_make_model_usage_shows_out_required():
    r = _cli("make-model", "-h")
    assert r.returncode == 0 and "[--out F.gguf | --dry-run]" in r.stdout and "--mmproj-out" in r.stdout, r.stdout
    r = _cli("make-model", "--preset", "tiny-moe")       # --mmproj-out alone writes only the vision tower
    assert r.returncode == 2 and "--out is required (or --dry-run, or --mmproj-out" in r.stderr, r.stderr


def test_bench_cache_defaults_finish_in_a_minute():
    """947 tokens: 49 s on the 2-core dev box with the demo model (the default of 947 and 4096 took many minutes)."""
    from legacy_engine.tools.bench import bench_cache
    assert inspect.signature(bench_cache).parameters["lengths"].default == (947,)
    r = _cli("bench", "cache", "-h")
    assert "prompt lengths (947:" in r.stdout, r.stdout


def test_bench_decode_defaults_to_the_chosen_tier():
    """`bench decode` runs the tier `info` chooses by default (plus llama.cpp), every tier only with --isa all."""
    from legacy_engine.core import _native
    from legacy_engine.tools import bench

    assert bench.parse_isas("chosen") == [_native.get_isa()]
    assert bench.parse_isas("chosen,all")[0] == _native.get_isa() and len(bench.parse_isas("all")) >= 1
    out = _cli("bench", "decode", "-h", timeout=60).stdout
    assert re.search(r"chosen: the\s+one `info`\s+chooses.*\(chosen\)", out, re.S), out


def _subcommands(*cmd) -> list[str]:
    """The subcommands `legacy-engine CMD -h` lists under its positional argument (name, then its help)."""
    out = _cli(*cmd, "-h").stdout
    block = out.split("positional arguments:", 1)[1].split("\n\n", 1)[0]
    return [m.group(1) for m in re.finditer(r"^    ([a-z][a-z0-9-]*)\b", block, re.M)]


def test_every_command_prints_its_help():
    """`-h` of every command and every `bench` measurement prints its usage (a stray % in one flag's help made
    `bench gpu -h` raise a TypeError from argparse)."""
    top, bench = _subcommands(), _subcommands("bench")
    assert {"run", "serve", "bench", "plan"} <= set(top) and {"decode", "gpu", "split"} <= set(bench), (top, bench)
    for cmd in [[c] for c in top] + [["bench", w] for w in bench]:
        r = _cli(*cmd, "-h")
        assert r.returncode == 0 and r.stdout.startswith("usage:") and "Traceback" not in r.stderr, (cmd, r.stderr)


def test_bench_gpu_lengths_are_checked_before_anything_runs(tmp_path):
    """`bench gpu --pp`: 0 skips the prefill test (it ran a prefill of no tokens and printed an error per row);
    a negative or non-integer length, or nothing left to measure, is a clear error before any GPU work."""
    f = tmp_path / "none.gguf"                       # never opened: the lengths are checked first
    for args, msg in ((["--pp", "0", "--tg", "0"], "nothing to measure"), (["--pp", "-1"], "lengths are >= 0"),
                      (["--pp", "5x"], "integers, comma-separated")):
        r = _cli("bench", "gpu", str(f), *args)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
