#!/usr/bin/env bash
# One device call for the attention work (issue 22): compiled tests of the fast paths (cuDNN prefill, the Pallas
# cache-attention kernel), the kernel benchmark, then the target's decode / verify steps and prefill through
# generate() beside transformers' prefill (long_context.py --steps-only --prefill).
# Usage on a GPU machine, from the repository root:
#   bash benchmarks/gpu_attention.sh OUT_DIR [CONTEXTS] [BATCHES] [PEER_CONTEXTS]
set -u -o pipefail
OUT=${1:-benchmarks/results}
CONTEXTS=${2:-8192,65536,131072,32768}
BATCHES=${3:-1,8}
PEER=${4:-8192,65536,131072,32768}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
FILTER=(grep --line-buffered -v -e "^WARNING: All log messages before absl" -e "^W0000")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -x -p no:cacheprovider tests/test_attention.py tests/test_kernels.py -k \
    "attention or prefill_plan" 2>&1 | tail -n 25 | tee "$OUT/attention_tests_gpu.txt"
fi
if [ -z "${SKIP_KERNELS:-}" ]; then
  python3 benchmarks/kernels.py --only cache_attention --out "$OUT/kernels_cache_h200.json" ${KERNEL_ARGS:-} 2>&1 \
    | "${FILTER[@]}" | tail -n 30 | tee "$OUT/kernels_stdout.txt"
fi
python3 benchmarks/long_context.py --steps-only --prefill --contexts "$CONTEXTS" --batches "$BATCHES" --k 4 \
  --peer --peer-contexts "$PEER" --out "$OUT/attention_h200.json" ${LC_ARGS:-} 2>&1 | "${FILTER[@]}" \
  | tee "$OUT/attention_log.txt" | tail -n 60
