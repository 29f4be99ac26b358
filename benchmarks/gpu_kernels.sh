#!/usr/bin/env bash
# One device call: compiled kernel tests + kernel benchmark (+ Nsight Compute counters where ncu works).
# Usage on a GPU machine, from the repository root:  bash benchmarks/gpu_kernels.sh OUT_DIR
set -u
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -n 30 | tee "$OUT/kernel_tests_gpu.txt"
python3 benchmarks/kernels.py --out "$OUT/kernels_h200.json" 2>&1 | tail -n 40 | tee "$OUT/kernels_stdout.txt"
