#!/usr/bin/env bash
# Multi-GPU tune run (issue 7) on nvidia-h200-x2: torchrun with NCCL, then --devices all, each into its own empty
# cache dir; check_multi_gpu.py compares the ranks' tables and counts each decision in the cache.
#   bash benchmarks/h200_multi_gpu.sh        (logs and caches go to $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off on these shared hosts (KINDS.md), also for every process torchrun starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PRESET=(--preset llama-3.1-70b-nvfp4 --tp 8)
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date -u +%H:%M:%S)): $*"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
nvidia-smi topo -m
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
# 1. torchrun, text tables, both ranks tee'd to the terminal
FP4DISPATCH_CACHE_DIR=$OUT/cache-torchrun step torchrun 240 torchrun --standalone --nproc-per-node 2 \
  --log-dir "$OUT/logs-torchrun" --tee 3 -m fp4dispatch.tune "${PRESET[@]}"
# 2. the same again with --json into the same (now warm) cache: every key comes from the cache, no rank re-tunes
FP4DISPATCH_CACHE_DIR=$OUT/cache-torchrun step torchrun_json 120 torchrun --standalone --nproc-per-node 2 \
  --log-dir "$OUT/logs-torchrun-json" --redirects 3 -m fp4dispatch.tune "${PRESET[@]}" --json
# 3. --devices all, fresh cache, JSON
FP4DISPATCH_CACHE_DIR=$OUT/cache-devices step devices 240 python3 -m fp4dispatch.tune "${PRESET[@]}" --devices all --json
FP4DISPATCH_CACHE_DIR=$OUT/cache-devices step devices_show 60 python3 -m fp4dispatch.tune show
step check 60 python3 benchmarks/check_multi_gpu.py "$OUT"
