#!/usr/bin/env bash
# The same benchmarks on two source trees in one lease, alternating, so a change that should not
# move performance (a restructuring) is measured against the tree before it on the same card:
#
#   git archive <before> deepinfer benchmarks recipe | tar -x -C .old     # the tree before (ignored)
#   DEEPINFER_ACCELERATOR=cuda bash benchmarks/compare_trees.sh .old fast_path spec_replay
#
# Stages: fast_path (gpu_fast_path.py's (a)-(c)), spec_replay (spec_replay.py's batch-1 cell at
# acceptance 0.7 with verify chains of 8: row 14 of docs/benchmarks.md). Each stage runs
# before, after, before, after; results go to $OUT (default /tmp/compare-trees) as
# <stage>_<before|after>_<round>.json. Each tree runs its own benchmark script, from its own root.
set -u
before=$(cd "$1" && pwd)
after=$(cd "$(dirname "$0")/.." && pwd)
shift
OUT=${OUT:-/tmp/compare-trees}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
run() {   # run <tree> <label> <stage> <round>
  local tree=$1 label=$2 stage=$3 round=$4
  local json="$OUT/${stage}_${label}_${round}.json"
  echo "=== $stage $label round $round ($(date -u +%H:%M:%S))"
  case $stage in
    fast_path)
      (cd "$tree" && PYTHONPATH="$tree:$tree/recipe:${PYTHONPATH:-}" timeout "${FAST_PATH_TIMEOUT:-240}" \
        python3 benchmarks/gpu_fast_path.py --parts a,b,c --out "$json") ;;
    spec_replay)
      (cd "$tree" && PYTHONPATH="$tree:$tree/recipe:${PYTHONPATH:-}" timeout "${SPEC_REPLAY_TIMEOUT:-240}" \
        python3 benchmarks/spec_replay.py --alphas 0.7 --batch-sizes 1 --modes fixed-chain adaptive-chain \
        --verify-chain 8 --no-sync-anchor --out "$json") ;;
    *) echo "unknown stage $stage (fast_path, spec_replay)"; return 2 ;;
  esac
}
status=0
for stage in "$@"; do
  for round in $(seq 1 "$ROUNDS"); do
    run "$before" before "$stage" "$round" || status=1
    run "$after" after "$stage" "$round" || status=1
  done
done
exit $status
