#!/usr/bin/env bash
# Last batched H200 run: GPU tests, the backend-comparison entry point and the tune CLI on the final kernels, and an
# ncu profile of the small-M picks (what limits them). Logs go to $OUT.   bash benchmarks/h200_final.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4DISPATCH_CACHE_DIR=/tmp/fp4c-final
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%H:%M:%S))"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
step gpu_tests 90 python3 -m pytest -q -x tests/test_triton_gpu.py tests/test_gpu_reference.py
step bench 150 python3 benchmarks/run_benchmarks.py --budget-s 150 --date 2026-11-29 --json "$OUT/bench.json" --command "bash benchmarks/h200_final.sh"
cp benchmarks/RESULTS.md benchmarks/backend_comparison_*.png "$OUT"/ 2>/dev/null
step tune_default 90 python3 -m fp4dispatch.tune
step ncu 120 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy python3 benchmarks/profile_small_m.py
