#!/usr/bin/env bash
# One device call: build the demo pair on the GPU and pack it for the trip back.
# Usage on a GPU machine, from the repository root:  bash benchmarks/gpu_demo_pair.sh OUT_DIR [build options]
#   e.g.  bash benchmarks/gpu_demo_pair.sh "$OUT" --extra-packages transformers,torch
set -u
OUT=${1:-/tmp/out}
shift || true
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m diffspec_jax.demo.build --out /tmp/pair "$@" 2>&1 | grep -v Warning | tee "$OUT/build_log.txt" | tail -n 40
tar -C /tmp/pair -cf "$OUT/target.tar" target
tar -C /tmp/pair -cf "$OUT/rest.tar" draft model_card.json MODEL_CARD.md demo_prompt.txt corpus_files.json
ls -la "$OUT"
