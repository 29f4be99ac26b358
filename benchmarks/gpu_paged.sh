#!/usr/bin/env bash
# One device call for issue 37 (paged K/V, prefix caching): paged vs contiguous steps and prefill
# (benchmarks/paged_steps.py), then the server's shared-document and capacity workloads (benchmarks/serve_load.py),
# within SECONDS. Usage on a GPU machine, from the repository root:
#   bash benchmarks/gpu_paged.sh OUT_DIR SECONDS [STAGES]
# STAGES: comma-separated of steps, shared, capacity, pressure (default the first three, in that order). Each stage
# gets a share of the seconds still left (steps 45, shared 25, capacity 40, pressure 25, over the stages still to
# run) and is stopped past it
# (its scripts start no run past their budget and kill a server past it; JSON is rewritten after every cell / run).
# Files (8 at most, none deeper than OUT_DIR/x/): OUT_DIR/gpu.txt, OUT_DIR/log.txt,
#   OUT_DIR/paged_steps.{json,png}, OUT_DIR/shared/serve_load.{json,png}, OUT_DIR/capacity/serve_load.{json,png},
#   OUT_DIR/pressure/serve_load.{json,png} (a pool far smaller than its load: preemptions, answers against
#   generate() alone)
# On one H200 all three take about 12 minutes (steps ~4, shared ~3, capacity ~5): more than one device call may
# run (10 minutes), so split them, e.g.  STAGES=steps,shared in one call (SECONDS 570) and capacity in the next.
# Extra arguments for a stage: PAGED_STEPS_ARGS, SHARED_ARGS, CAPACITY_ARGS, PRESSURE_ARGS (appended to its command
# line; e.g. SHARED_ARGS="--shared-policies diffspec,self-diffspec --baseline-requests 0").
set -u -o pipefail
OUT=${1:?OUT_DIR}
BUDGET=${2:?SECONDS}
STAGES=${3:-steps,shared,capacity}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
LOG="$OUT/log.txt"
FILTER=(grep --line-buffered -v -e "^WARNING: All log messages before absl" -e "^W0000" -e "Warning")
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$OUT/gpu.txt" 2>&1 || true
echo "git commit: ${DIFFSPEC_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" >> "$OUT/gpu.txt"

declare -A WEIGHT=([steps]=45 [shared]=25 [capacity]=40 [pressure]=25)
IFS=, read -r -a TODO <<< "$STAGES"
for stage in "${TODO[@]}"; do
  [[ -n ${WEIGHT[$stage]:-} ]] || { echo "unknown stage $stage (steps, shared, capacity, pressure)" | tee -a "$LOG"; exit 2; }
done

run_stage() {  # NAME SECONDS COMMAND...: the command under a hard limit of SECONDS + 30, its output in the log
  local name=$1 secs=$2
  shift 2
  echo "== $name ($secs s): $*" | tee -a "$LOG"
  local t0
  t0=$(date +%s)
  timeout --kill-after=15 $((secs + 30)) "$@" 2>&1 | "${FILTER[@]}" >> "$LOG"
  echo "== $name: exit ${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
}

for i in "${!TODO[@]}"; do
  stage=${TODO[$i]}
  left=$(( BUDGET - ($(date +%s) - start) ))
  weights=0
  for s in "${TODO[@]:$i}"; do weights=$(( weights + WEIGHT[$s] )); done
  secs=$(( left * WEIGHT[$stage] / weights - 30 ))  # 30 s for the hard limit's margin
  if (( secs < 60 )); then
    echo "skipped $stage: ${left} s left" | tee -a "$LOG"
    continue
  fi
  case $stage in
    steps)
      # shellcheck disable=SC2086  # extra arguments split on spaces
      run_stage steps "$secs" python3 benchmarks/paged_steps.py --cells 8192x1,65536x1,131072x1,8192x8,32768x8 \
        --prefill-contexts 65536 --prefill-widths auto,2048 --time-budget-s $((secs - 45)) \
        --out "$OUT/paged_steps.json" ${PAGED_STEPS_ARGS:-} ;;
    shared)
      # shellcheck disable=SC2086
      run_stage shared "$secs" python3 benchmarks/serve_load.py --workloads shared-doc --doc-lens 32768,65536 \
        --shared-requests 16 --shared-policies diffspec --baseline-requests 4 --time-budget-s "$secs" \
        --out "$OUT/shared" ${SHARED_ARGS:-} ;;
    capacity)
      # shellcheck disable=SC2086
      run_stage capacity "$secs" python3 benchmarks/serve_load.py --workloads capacity --capacity-requests 48 \
        --capacity-prompt-lens 2048,4096,8192,16384,32768,65536 --capacity-new-tokens 256 \
        --capacity-max-model-len 65536 --capacity-seqs 64 --time-budget-s "$secs" \
        --out "$OUT/capacity" ${CAPACITY_ARGS:-} ;;
    pressure)
      # shellcheck disable=SC2086
      run_stage pressure "$secs" python3 benchmarks/serve_load.py --workloads pressure --deterministic \
        --time-budget-s "$secs" --out "$OUT/pressure" ${PRESSURE_ARGS:-} ;;
  esac
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$LOG"
find "$OUT" -type f | sort | tee -a "$LOG"
