#!/usr/bin/env bash
# The test command of the README: installs legacy_engine (editable) with its test and oracle
# stack, then runs the whole suite. Extra arguments go to pytest (e.g. `-m "not slow"`).
#
# The oracles (../shared/oracle.md): torch 2.13.0 CPU (pinned exactly: that wheel is on local
# disk), transformers 5.23.0, and llama-cpp-python 0.3.36 built from source with
# GGML_NATIVE=OFF (a native build enables AMX on these hosts and dies with SIGILL) and
# --no-cache-dir (pip's wheel cache ignores CMAKE_ARGS). The build takes ~4 min on 2 cores and
# is skipped when that exact version is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUTF8=1  # the suite's subprocesses print UTF-8 (tokens, llama.cpp logs) whatever the locale

python -m pip install -q -e ".[test,oracle]"
if ! python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '0.3.36')" 2>/dev/null; then
    echo "building llama-cpp-python 0.3.36 (GGML_NATIVE=OFF), ~4 min …"
    CMAKE_ARGS="-DGGML_NATIVE=OFF" python -m pip install -q --no-cache-dir llama-cpp-python==0.3.36
fi

# legacy CUDA toolchains (NVRTC 11.8 / 12.9 and their ptxas) from PyPI: they compile the Kepler,
# Pascal and Volta tiers' PTX on a machine without a GPU (tests/test_gpu.py, non-GPU part)
python -m legacy_engine.gpu install-toolchains

set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests for the given selection"
    exit 0
fi
exit "$rc"
