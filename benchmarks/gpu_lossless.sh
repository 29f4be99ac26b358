#!/usr/bin/env bash
# One GPU call for bit-exact speculation (issue 40): the deterministic attention kernel's row invariance on the
# device, then benchmarks/lossless_check.py over the demo pair (bf16, 16 prompts x 512 new tokens, every policy
# and self-drafting) and over Llama-3.1-8B shapes with random bf16 weights, both modes side by side.
#   [KERNEL_ROWS=0] [MODES=deterministic] bash benchmarks/gpu_lossless.sh OUT_DIR [SECONDS] [CASES]
set -u
OUT=${1:?usage: gpu_lossless.sh OUT_DIR [SECONDS] [CASES]}
BUDGET=${2:-560}
CASES=${3:-8192x1,8192x8,65536x1,131072x1,65536x8}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if [ "${KERNEL_ROWS:-1}" = 1 ]; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "deterministic_rows" \
        > "$OUT/kernel_rows.log" 2>&1
    echo "kernel rows rc=$?" >> "$OUT/kernel_rows.log"
fi
timeout $(( $(left) * 2 / 5 )) python3 -m benchmarks.lossless_check --dtypes bfloat16 --prompts 16 --context 3000 \
    --new-tokens 512 --policies full,recent,diffspec,self --modes ${MODES:-default,deterministic} --no-ties \
    --out "$OUT/lossless_demo_h200.json" > "$OUT/demo.log" 2>&1
echo "demo rc=$?" >> "$OUT/demo.log"
timeout $(( $(left) - 10 )) python3 -m benchmarks.lossless_check --shapes 8b --cases "$CASES" --new-tokens 256 \
    --policies diffspec,self --modes ${MODES:-default,deterministic} --time-budget $(( $(left) - 150 )) \
    --out "$OUT/lossless_8b_h200.json" > "$OUT/8b.log" 2>&1
echo "8b rc=$?" >> "$OUT/8b.log"
