#!/usr/bin/env bash
# One batched H200 run of the lead's checks: GPU tests, the foundation check, the tune CLI (default and a preset),
# and the bucket-edge measurement. Logs go to $OUT (the device tool brings them back).
#   bash benchmarks/h200_integration.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4DISPATCH_CACHE_DIR=/tmp/fp4c-int
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%H:%M:%S))"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
step gpu_tests 120 python3 -m pytest -q -x tests/test_gpu_reference.py tests/test_triton_gpu.py tests/test_integration_gpu.py
step foundation 60 python3 benchmarks/h200_foundation.py
step tune_default 150 python3 -m fp4dispatch.tune
step tune_llama_tp8 150 python3 -m fp4dispatch.tune --preset llama-3.1-70b-nvfp4 --tp 8
step buckets 120 python3 benchmarks/bench_buckets.py --shapes 8192x8192,2048x6144 --max-m 4096
