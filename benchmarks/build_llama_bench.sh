#!/usr/bin/env bash
# Builds the llama.cpp peer the benchmarks run beside ours: llama-cpp-python 0.3.36's llama.cpp sources,
# `llama-bench` with CUDA (sm_90 by default: the GPU machine's H100/H200) and the AVX-512/VNNI CPU kernels, not
# -march=native (the build machine is not the one it runs on). Writes OUT (default .llbin/llama-bench.xz: carried to
# the GPU machine, which has no network; there: xz -dc it, chmod +x, LD_LIBRARY_PATH=/usr/local/cuda/lib64).
#
#   bash benchmarks/build_llama_bench.sh [ARCH] [OUT]          (~25 min on 2 cores)
#
# A build machine without a GPU driver or cuBLAS (nvcc alone) needs the link-time pieces: cuBLAS from the
# nvidia-cublas wheel of the toolkit's version (headers and .so into the toolkit's targets/x86_64-linux), and a
# stub libcuda.so (soname libcuda.so.1: the real one is the GPU machine's driver) exporting the driver calls ggml's
# VMM pool makes; LLAMA_STUBS=1 does both.
set -euo pipefail
ARCH=${1:-90}
OUT=${2:-.llbin/llama-bench.xz}
WORK=${LLAMA_WORK:-.llama}
mkdir -p "$WORK" "$(dirname "$OUT")"
[ -f "$WORK/llama_cpp_python-0.3.36.tar.gz" ] ||
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$WORK"
tar -xzf "$WORK/llama_cpp_python-0.3.36.tar.gz" -C "$WORK"
if [ "${LLAMA_STUBS:-0}" = 1 ]; then
    T=$(dirname "$(dirname "$(command -v nvcc)")")/targets/x86_64-linux
    ver=$(nvcc --version | sed -n 's/.*release \([0-9]*\).*/\1/p')
    pip download --no-deps "nvidia-cublas==${ver}.*" -d "$WORK"
    (cd "$WORK" && rm -rf cub && mkdir cub && cd cub && unzip -q ../nvidia_cublas-*.whl)
    cp "$WORK"/cub/nvidia/cu*/include/* "$T/include/"
    cp "$WORK"/cub/nvidia/cu*/lib/* "$T/lib/"
    ln -sf libcublas.so.$ver "$T/lib/libcublas.so"
    ln -sf libcublasLt.so.$ver "$T/lib/libcublasLt.so"
    mkdir -p "$T/lib/stubs"
    : > "$WORK/cstub.c"
    for f in cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate \
             cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap; do
        echo "int $f(void){return 0;} int ${f}_v2(void){return 0;}" >> "$WORK/cstub.c"
    done
    gcc -shared -fPIC -o "$T/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$WORK/cstub.c"
fi
cd "$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
    -DGGML_AVX512_BF16=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build build --target llama-bench -j "$(nproc)"
cd - > /dev/null
xz -T0 -c "$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench" > "$OUT"
echo "wrote $OUT"
