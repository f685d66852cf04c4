#!/usr/bin/env bash
# Serving at engine speed, on the H200: deepinfer's server beside its offline engine and, when
# vLLM 0.26 is installed in /tmp/site, beside `vllm serve`; each server driven by
# `deepinfer bench serve` and (with vLLM) by `vllm bench serve`, with the same flags.
#
#   bash benchmarks/serve_vs_vllm.sh STAGE...     (from the project root; results under $OUT)
#
# Stages, run in the order given:
#   offline      the offline engine on the same workload (benchmarks/gpu_fast_path.py --parts c)
#   deepinfer    `deepinfer serve` on a safetensors checkpoint of random weights (Llama-3-8B shape)
#   deepinfer16k the same with --max-num-batched-tokens 16384 (the offline engine's token budget)
#   profile      deepinfer again, with py-spy sampling the front end and the engine core for 20 s
#                of the saturated run (flame-graph text under $OUT)
#   profile_moderate  the moderate-rate run (where TTFT and ITL tails are measured) with py-spy on
#                both processes for 15 s and the engine core under torch's profiler for 3 s of it
#                (/start_profile, /stop_profile: its timeline and op table under $OUT/torch_traces)
#   vllm         `vllm serve --load-format dummy` (needs vLLM in /tmp/site: .vllm-peer/vllm_install.sh)
# Workload: 1000 requests of 1024 random tokens in, 256 out (ignore_eos), all sent at once, at most
# 512 in flight; then 200 requests at 10 requests/s (TTFT and ITL at a moderate rate).
# SHAPE=v4-flash serves DeepSeek-V4-Flash at full depth in its own formats instead (FP8 blocks, FP4
# experts; routed experts cut to V4_EXPERTS, default 96 for an 80 GB card, 160 fits an H200): both
# servers read one config-only directory (benchmarks/v4_release_dir.py) and draw random weights
# (--load-format dummy), and the workload is V4_PROMPTS requests (default 200), at most V4_CONCURRENCY
# (default 64) in flight, then V4_RATE requests/s (default 2) for the moderate run.
# Dependencies the GPU image lacks travel as wheels in .whl/ and are installed into /tmp/di-site.
set -u
OUT=${OUT:-/tmp/serve-vs-vllm}; mkdir -p "$OUT"
root=$(cd "$(dirname "$0")/.." && pwd)
peer=${PEER:-$root/.vllm-peer}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
if ls "$root"/.whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/di-site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/di-site "$root"/.whl/*.whl
fi
DI="env PYTHONPATH=$root:$root/recipe:/tmp/di-site DEEPINFER_ACCELERATOR=cuda python3 -m deepinfer.cli.main"
VL="env PYTHONPATH=/tmp/site python3 -m vllm.entrypoints.cli.main"
SPY=/tmp/di-site/bin/py-spy
RANDOM_1K="--dataset-name random --random-input-len 1024 --random-output-len 256"
if [ "${SHAPE:-llama3-8b}" = v4-flash ]; then
  NAME=v4-flash
  MODEL=/tmp/v4-flash-dummy     # config + tokenizer only, read by both servers
  CKPT=$MODEL
  DI_FLAGS="--load-format dummy --quantization fp8 --max-model-len 1408"
  VL_FLAGS="--max-model-len 1408"
  SATURATED="$RANDOM_1K --num-prompts ${V4_PROMPTS:-200} --request-rate inf --max-concurrency ${V4_CONCURRENCY:-64}"
  MODERATE="$RANDOM_1K --num-prompts ${V4_PROMPTS:-200} --request-rate ${V4_RATE:-2}"
  [ -d $MODEL ] || env PYTHONPATH=$root/recipe:/tmp/di-site python3 benchmarks/v4_release_dir.py $MODEL \
    --routed-experts "${V4_EXPERTS:-96}" >/dev/null
else
  NAME=llama3-8b
  MODEL=/tmp/llama3-8b-dummy    # config + tokenizer only: vLLM's --load-format dummy
  CKPT=/tmp/llama3-8b-random    # the same shape with random bf16 weights, for deepinfer
  DI_FLAGS=""
  VL_FLAGS="--dtype bfloat16 --max-model-len 1280"
  SATURATED="$RANDOM_1K --num-prompts 1000 --request-rate inf --max-concurrency 512"
  MODERATE="$RANDOM_1K --num-prompts 200 --request-rate 10"
  [ -d $MODEL ] || python3 "$peer/make_llama3_8b_dummy.py" $MODEL >/dev/null
fi
COMMON="--ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result --result-dir $OUT"

make_checkpoint() {
  [ -f $CKPT/config.json ] && return
  env PYTHONPATH=/tmp/di-site python3 - <<'PY'
import shutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
with torch.device("cuda"):
    model = LlamaForCausalLM(LlamaConfig.from_pretrained("/tmp/llama3-8b-dummy")).to(torch.bfloat16)
model.save_pretrained("/tmp/llama3-8b-random", safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"/tmp/llama3-8b-dummy/{name}", "/tmp/llama3-8b-random/")
PY
}

wait_healthy() {   # port pid (gives up after HEALTH_WAIT seconds, default 600)
  for _ in $(seq "${HEALTH_WAIT:-600}"); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

clients() {   # name port: both clients on the saturated workload, then the moderate rate
  local name=$1 port=$2
  if [ -d /tmp/site/vllm ]; then
    echo "--- vllm bench serve -> $name (saturated)"
    timeout 240 $VL bench serve --backend openai --endpoint /v1/completions --port "$port" --model $NAME \
      --tokenizer $MODEL $SATURATED $COMMON --disable-tqdm --result-filename "${NAME}_vllm_client_${name}_saturated.json" \
      2>&1 | grep -E "Successful|duration|throughput|TTFT|TPOT|ITL|E2EL|Failed"
  fi
  echo "--- deepinfer bench serve -> $name (saturated)"
  timeout 240 $DI bench serve --port "$port" --model $NAME $SATURATED $COMMON --disable-tqdm \
    --result-filename "${NAME}_di_client_${name}_saturated.json" 2>&1 | grep -E "Successful|duration|throughput|TTFT|TPOT|ITL|E2EL|Failed"
  if [ -d /tmp/site/vllm ]; then
    echo "--- vllm bench serve -> $name (moderate rate)"
    timeout 120 $VL bench serve --backend openai --endpoint /v1/completions --port "$port" --model $NAME \
      --tokenizer $MODEL $MODERATE $COMMON --disable-tqdm --result-filename "${NAME}_vllm_client_${name}_moderate.json" \
      2>&1 | grep -E "Successful|duration|throughput|TTFT|ITL|Failed"
  else
    echo "--- deepinfer bench serve -> $name (moderate rate)"
    timeout 120 $DI bench serve --port "$port" --model $NAME $MODERATE $COMMON --disable-tqdm \
      --result-filename "${NAME}_di_client_${name}_moderate.json" 2>&1 | grep -E "Successful|duration|throughput|TTFT|ITL|Failed"
  fi
}

deepinfer_server() {   # name extra-flags...
  local name=$1; shift
  make_checkpoint
  local t0=$(date +%s)
  $DI serve $CKPT --served-model-name $NAME --host 127.0.0.1 --port 8000 --uvicorn-log-level warning $DI_FLAGS "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  wait_healthy 8000 $pid || { echo "deepinfer server did not start"; tail -30 "$OUT/server_$name.log"; return 1; }
  echo "deepinfer ($name) healthy after $(( $(date +%s) - t0 )) s"
  DI_PID=$pid
}

stop() { kill -INT "$1" 2>/dev/null; wait "$1" 2>/dev/null; }

for stage in "$@"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    offline)
      timeout 300 env PYTHONPATH=$root:$root/recipe:/tmp/di-site:$root/benchmarks DEEPINFER_ACCELERATOR=cuda \
        python3 benchmarks/gpu_fast_path.py --parts c --out "$OUT/offline_c.json" 2>&1 | grep -vE "^\s*$|it/s\]" | tail -12 ;;
    deepinfer)
      deepinfer_server default && { clients deepinfer 8000; stop $DI_PID; } ;;
    deepinfer16k)
      deepinfer_server b16k --max-num-batched-tokens 16384 && { clients deepinfer16k 8000; stop $DI_PID; } ;;
    profile)
      deepinfer_server profile || continue
      core=$(pgrep -P $DI_PID | head -1)   # the engine core is the front end's one child process
      ( sleep 15; $SPY record --nonblocking -p $DI_PID -d 20 -r 200 -f raw -o "$OUT/pyspy_frontend.txt" >/dev/null 2>&1 ) &
      p1=$!
      ( sleep 15; $SPY record --nonblocking -p "$core" -d 20 -r 200 -f raw -o "$OUT/pyspy_core.txt" >/dev/null 2>&1 ) &
      p2=$!
      ( sleep 15; top -b -d 2 -n 10 -H -p "$DI_PID,$core" > "$OUT/top_threads.txt" ) &
      p3=$!
      timeout 240 $DI bench serve --port 8000 --model $NAME $SATURATED $COMMON --disable-tqdm \
        --result-filename di_client_profile.json 2>&1 | grep -E "Successful|duration|throughput|TPOT|ITL"
      wait $p1 $p2 $p3; stop $DI_PID ;;
    profile_moderate)
      export DEEPINFER_TORCH_PROFILER_DIR=$OUT/torch_traces
      deepinfer_server profile_moderate || continue
      core=$(pgrep -P $DI_PID | head -1)
      ( sleep 5; $SPY record --nonblocking -p $DI_PID -d 15 -r 200 -f raw -o "$OUT/pyspy_frontend_moderate.txt" >/dev/null 2>&1 ) &
      p1=$!
      ( sleep 5; $SPY record --nonblocking -p "$core" -d 15 -r 200 -f raw -o "$OUT/pyspy_core_moderate.txt" >/dev/null 2>&1 ) &
      p2=$!
      ( sleep 8; curl -sf -X POST http://127.0.0.1:8000/start_profile; sleep 3
        curl -sf -X POST http://127.0.0.1:8000/stop_profile ) &
      p3=$!
      timeout 120 $DI bench serve --port 8000 --model $NAME $MODERATE $COMMON --disable-tqdm \
        --result-filename "${NAME}_di_client_profile_moderate.json" 2>&1 | grep -E "Successful|duration|TTFT|TPOT|ITL"
      wait $p1 $p2 $p3; sleep 5; stop $DI_PID; unset DEEPINFER_TORCH_PROFILER_DIR ;;
    vllm)
      t0=$(date +%s)
      $VL serve $MODEL --load-format dummy $VL_FLAGS --gpu-memory-utilization 0.90 \
        --served-model-name $NAME --host 127.0.0.1 --port 8001 > "$OUT/vllm_server.log" 2>&1 &
      pid=$!
      wait_healthy 8001 $pid || { echo "vllm server did not start"; tail -30 "$OUT/vllm_server.log"; continue; }
      echo "vllm healthy after $(( $(date +%s) - t0 )) s"
      clients vllm 8001; stop $pid ;;
    *) echo "unknown stage $stage" ;;
  esac
done
