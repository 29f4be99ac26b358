#!/usr/bin/env bash
# Tuning sweep of the cache_attention kernel's static knobs (block, num_stages, num_warps, splits) on one GPU.
# Usage: bash benchmarks/gpu_cache_sweep.sh OUT_DIR [SHAPES] ; one JSON per option set, OUT_DIR/sweep_<options>.json
set -u
OUT=${1:-benchmarks/results}
SHAPES=${2:-65536:8,8192:8,65536:1}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
for opt in ${SWEEP:-"block=64" "block=128" "num_stages=3" "num_stages=4" "block=128,num_stages=3" "num_warps=8" \
           "block=32,num_stages=4"}; do
  python3 benchmarks/kernels.py --only cache_attention --cache-shapes "$SHAPES" --cache-options "$opt" \
    --out "$OUT/sweep_${opt//[=,]/_}.json" 2>/dev/null | grep "^cache_attention" | sed "s/^/$opt /"
done
