#!/usr/bin/env bash
# One device call: several benchmarks/paired.py runs in a row, packed into one tar for the trip back (a device call
# returns at most 8 files, and each run writes a JSON and a PNG).
# Usage on a GPU machine, from the repository root:
#   bash benchmarks/gpu_paired_sweep.sh OUT_DIR SECONDS SPEC_FILE
# SPEC_FILE: one run per line, "NAME paired.py-arguments" (blank lines and lines starting with # are skipped);
# run NAME writes OUT_DIR/NAME.json and .png, its output goes to OUT_DIR/sweep_log.txt. A run is started only
# while the slowest run so far still fits in the SECONDS left, so a sweep ends inside the device call's limit.
set -u
OUT=${1:?OUT_DIR}
BUDGET=${2:?SECONDS}
SPECS=${3:?SPEC_FILE}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/sweep"
start=$(date +%s)
slowest=0
while read -r name args; do
    case "$name" in ""|\#*) continue ;; esac
    now=$(date +%s)
    if (( now - start + slowest > BUDGET )); then
        echo "skipped $name: $(( BUDGET - (now - start) )) s left, slowest run ${slowest} s" | tee -a "$OUT/sweep_log.txt"
        continue
    fi
    echo "== $name: python3 benchmarks/paired.py $args --out $OUT/sweep/$name.json" >> "$OUT/sweep_log.txt"
    # shellcheck disable=SC2086  # the spec's arguments split on spaces
    python3 benchmarks/paired.py $args --out "$OUT/sweep/$name.json" 2>&1 | grep -v Warning >> "$OUT/sweep_log.txt"
    rc=${PIPESTATUS[0]}
    took=$(( $(date +%s) - now ))
    echo "== $name: exit $rc, ${took} s" | tee -a "$OUT/sweep_log.txt"
    (( took > slowest )) && slowest=$took
done < "$SPECS"
tar -C "$OUT" -cf "$OUT/sweep.tar" sweep && rm -r "$OUT/sweep"
ls -la "$OUT"
