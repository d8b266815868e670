#!/usr/bin/env bash
# Issue 15's checks on a lent GPU machine (torch, Triton, transformers; no vLLM, no registry), one
# device-tool call per part, everything the part wrote coming back in $OUT:
#   bash scripts/gpu_check.sh tests    # the suite on CUDA (engine tests skip there: no vLLM)
#   bash scripts/gpu_check.sh tests tests/test_fused_ops.py ...   # a part of it (if cut short)
#   bash scripts/gpu_check.sh bench    # scripts/bench_gpu.py, then with --fused-ops
#   bash scripts/gpu_check.sh all      # both, the time limit split between them
# Each part stops at GPU_CHECK_LIMIT seconds (default 540, under the tool's 10 minutes per call) so
# that its logs still come back; a part cut short says so in summary.txt. Outside the device tool
# $OUT defaults to results/gpu_check. Runs on a CPU too (the tests then run on the CPU; the
# benchmark needs CUDA unless GPU_CHECK_BENCH_ARGS=--tiny).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PART="${1:-all}"
shift || true
SELECTION=("${@:-tests}")
OUT="${OUT:-$REPO/results/gpu_check}"
LIMIT="${GPU_CHECK_LIMIT:-540}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( LIMIT - ($(date +%s) - START) )); }

# Run "$@" with at most $1 seconds; record how it ended.
timed() {
    local name=$1 secs=$2; shift 2
    if (( secs < 20 )); then say "$name: not run (no time left)"; return; fi
    local t0=$(date +%s)
    timeout -k 10 "$secs" "$@"
    local rc=$?
    local took=$(( $(date +%s) - t0 ))
    if (( rc == 124 || rc == 137 )); then
        say "$name: CUT SHORT after ${took} s (limit ${secs} s)"
    else
        say "$name: exit ${rc} in ${took} s"
    fi
}

case "$PART" in
    tests|bench|all) ;;
    *) echo "usage: $0 tests|bench|all" >&2; exit 2 ;;
esac

{
    date -u
    git rev-parse HEAD 2>/dev/null
    nvidia-smi 2>/dev/null || echo "no nvidia-smi"
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
} > "$OUT/machine.txt" 2>&1
# Importable without vLLM: setup.py maps vllm_ouroboros.kernels to kernels/; --no-deps skips vllm.
# GPU_CHECK_NO_INSTALL=1 where the project is installed already (scripts/setup.sh's venv).
if [[ -z ${GPU_CHECK_NO_INSTALL:-} ]]; then
    pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
        || { say "install failed (see install.log)"; exit 1; }
fi

if [[ $PART == tests || $PART == all ]]; then
    share=$(left)
    [[ $PART == all ]] && share=$(( share / 2 ))
    timed tests "$share" python -m pytest -q -p no:cacheprovider "${SELECTION[@]}" -rs --durations=20 \
        --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
    tail -n 40 "$OUT/tests.log" | tee -a "$SUMMARY" > /dev/null
fi

if [[ $PART == bench || $PART == all ]]; then
    extra=(${GPU_CHECK_BENCH_ARGS:-})
    timed bench $(( $(left) * 2 / 3 )) python scripts/bench_gpu.py "${extra[@]}" \
        --json "$OUT/bench_gpu.json" --md "$OUT/bench_gpu.md" > "$OUT/bench.log" 2>&1
    timed bench-fused-ops $(left) python scripts/bench_gpu.py "${extra[@]}" --fused-ops --skip kernel \
        --json "$OUT/bench_gpu_fused.json" --md "$OUT/bench_gpu_fused.md" > "$OUT/bench_fused.log" 2>&1
    grep -E "PASS|FAIL|NOT MEASURED" "$OUT/bench.log" "$OUT/bench_fused.log" >> "$SUMMARY" 2>/dev/null
fi
cat "$SUMMARY"
