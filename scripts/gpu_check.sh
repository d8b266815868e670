#!/usr/bin/env bash
# Issue 15's checks on a lent GPU machine (torch, Triton, transformers, pytest-xdist; no vLLM, no
# registry), sized for one device-tool call: a task that is lent a GPU gets 15 device-minutes in
# all, the machine's start (minutes) included, and one call runs at most 10 minutes.
#   bash scripts/gpu_check.sh            # = all: the benchmark, then the suite on CUDA
#   bash scripts/gpu_check.sh bench      # scripts/bench_gpu.py alone
#   bash scripts/gpu_check.sh tests      # the suite alone (engine tests skip there: no vLLM)
#   bash scripts/gpu_check.sh tests tests/test_fused_ops.py ...   # a part of it (a rerun)
# The whole run ends inside GPU_CHECK_LIMIT seconds (default 540, under the tool's 600 s per call);
# `all` gives the benchmark GPU_CHECK_BENCH_SHARE percent of it (default 55; the suite took ~2 min on
# the H200's 16 cores) as its --budget-s
# (bench_gpu.py measures what the issue's targets read first and writes its files after every
# section) and the tests the rest: first the files that run on the GPU (kernels, draft model and
# runtime, rounds, graphs, pool), then the others, each in its own log, so a cut leaves the first.
# What comes back from $OUT (the tool returns 8 files at most): summary.txt (machine, install,
# how each part ended, the acceptance lines, the round profile, failures), bench.log, bench_gpu.json, bench_gpu.md,
# tests_gpu.log, tests_rest.log (tests.log for a selection), sampled_verify.log, pool_ops.log. Outside the device tool $OUT defaults
# to results/gpu_check. Runs on a CPU too (the tests then run on the CPU; the benchmark needs
# CUDA unless GPU_CHECK_BENCH_ARGS=--tiny). GPU_CHECK_BENCH_ARGS replaces the benchmark's default
# arguments (--skip tiles; set it empty for the tile sweep).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PART="${1:-all}"
shift || true
SELECTION=("$@")
OUT="${OUT:-$REPO/results/gpu_check}"
LIMIT="${GPU_CHECK_LIMIT:-540}"
SHARE="${GPU_CHECK_BENCH_SHARE:-55}"
export PYTHONUNBUFFERED=1
# `python scripts/x.py` puts scripts/ first on sys.path, not the repo: without an install the
# package is found through this.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( LIMIT - ($(date +%s) - START) )); }

# Run "$@" with at most $2 seconds, its output into the log $3; record how it ended.
timed() {
    local name=$1 secs=$2 log=$3; shift 3
    if (( secs < 20 )); then say "$name: not run (no time left)"; return; fi
    local t0=$(date +%s)
    timeout -k 10 "$secs" "$@" > "$log" 2>&1
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
    *) echo "usage: $0 [all|bench|tests [test paths...]]" >&2; exit 2 ;;
esac

{
    echo "== machine"
    date -u
    git rev-parse HEAD 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" 2>&1
} >> "$SUMMARY"
# Importable without vLLM: setup.py maps vllm_ouroboros.kernels to kernels/; --no-deps skips vllm.
# GPU_CHECK_NO_INSTALL=1 where the project is installed already (scripts/setup.sh's venv).
# `python -m pip`, not `pip`: on the lent machines a bare `pip` belongs to another Python than the
# `python` holding torch, so it "succeeded" and the package stayed uninstalled (seen 2026-11-27).
if [[ -z ${GPU_CHECK_NO_INSTALL:-} ]]; then
    # Bounded: without a registry pip's retries alone took minutes of the call.
    if ! log=$(timeout 60 python -m pip install -q --no-deps --no-build-isolation -e . 2>&1); then
        say "install failed:"; echo "$log" >> "$SUMMARY"
    fi
fi
# The check that counts is the import itself. Where the install did not make kernels/ importable as
# vllm_ouroboros.kernels, a link in this (throwaway) copy of the tree does: only in $OUT's machine.
if ! python -c "import vllm_ouroboros.kernels.tree_attention" 2>>"$SUMMARY"; then
    if [[ -n ${GPU_CHECK_NO_INSTALL:-} || -e vllm_ouroboros/kernels ]]; then
        say "vllm_ouroboros.kernels is not importable"; cat "$SUMMARY"; exit 1
    fi
    ln -s ../kernels vllm_ouroboros/kernels
    say "install did not map kernels/: linked vllm_ouroboros/kernels -> ../kernels in this copy"
    python -c "import vllm_ouroboros.kernels.tree_attention" 2>>"$SUMMARY" \
        || { say "vllm_ouroboros.kernels is still not importable"; cat "$SUMMARY"; exit 1; }
fi

# Compiling Triton kernels is CPU work: the lent machines' 16 cores take the suite in parallel
# where pytest-xdist is there (it is on their image) and vLLM is not (engine tests, which skip
# without it, must not start engines side by side); pytest-timeout keeps one hung test from
# eating the call. -v: a log cut short still says which test ran last. --dist loadgroup: the tests
# of one xdist_group on one worker, so test_bench_gpu.py's module-scoped benchmark run runs once.
PYTEST=(python -m pytest -v -p no:cacheprovider -rfEs --durations=15)
python -c "import importlib.util as u, sys; sys.exit(not u.find_spec('xdist') or bool(u.find_spec('vllm')))" \
    2>/dev/null && PYTEST+=(-n "${GPU_CHECK_WORKERS:-8}" --dist loadgroup)
python -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 240)
# The tests that run the draft side and our target step on the GPU (the CUDA-only sync counts
# among them), first.
GPU_FIRST=(tests/test_tree_attention_kernel.py tests/test_split_tuning.py tests/test_fused_ops.py tests/test_norm_gemm.py tests/test_draft_model.py tests/test_device_clock.py
           tests/test_draft_attention_layout.py tests/test_draft_runtime.py tests/test_device_round.py tests/test_prefill_graph.py tests/test_fusion_choice.py
           tests/test_cuda_graph.py tests/test_pool_writer.py tests/test_kv_cache.py tests/test_pool.py tests/test_pool_draft.py
           tests/test_pool_kernels.py tests/test_pool_warmup.py tests/test_round_steps_kernel.py
           tests/test_host_copy.py tests/test_target_step.py tests/test_sampled_walk_kernel.py
           tests/test_accept.py tests/test_kv_move_kernel.py tests/test_kv_relocate.py)
# Last of all: on CUDA its module runs the whole benchmark (--tiny, every section), which the
# real benchmark above has just run; cut short there, it no longer takes the other tests with it.
LAST=(tests/test_bench_gpu.py)

run_tests() {  # $1: log name, the rest: pytest arguments; then the log's last lines into the summary
    local name=$1; shift
    timed "$name" "$(left)" "$OUT/$name.log" "${PYTEST[@]}" "$@"
    [[ -f $OUT/$name.log ]] && { echo "== $name.log (end)"; tail -n 25 "$OUT/$name.log"; } >> "$SUMMARY"
}

if [[ $PART == bench || $PART == all ]]; then
    budget=$(( $(left) - 30 ))
    [[ $PART == all ]] && budget=$(( $(left) * SHARE / 100 ))
    # Default: no tile sweep (its answer, at 40dd220, kept the shipped tiles; 49 s that the
    # round's profile, the prefill and the pool inserts, never measured on the mended code, need).
    extra=(${GPU_CHECK_BENCH_ARGS---skip tiles})
    # The budget stops the measuring; the grace after it is for the section in progress.
    timed bench $(( budget + 45 < $(left) ? budget + 45 : $(left) )) "$OUT/bench.log" python \
        scripts/bench_gpu.py "${extra[@]}" --budget-s "$budget" --json "$OUT/bench_gpu.json" \
        --md "$OUT/bench_gpu.md"
    rm -f "$OUT"/*.tmp  # a save cut by the time-out: its last complete JSON stands
    # Printed at the benchmark's end only; where the time-out cut it, from its last saved JSON.
    grep -q "^\[acceptance\]" "$OUT/bench.log" 2>/dev/null || python -c "
import json, sys
for a in json.load(open(sys.argv[1])).get('acceptance') or []:
    print('  {}: {} {}; target {} {}: {} (from the last saved JSON)'.format(*(a.get(k) for k in
          ('name', 'value', 'unit', 'op', 'target', 'status'))))" "$OUT/bench_gpu.json" >> "$OUT/bench.log" 2>&1
    { echo "== bench acceptance"; grep -E "PASS|FAIL|NOT MEASURED|INCOMPLETE|^\[errors\]|^\[kernel tiles\]|^\[profile\] |^\[fusion_choice\] |^  prefill |^  split rules|^  pool fill |^  cut rounds " "$OUT/bench.log"; } \
        >> "$SUMMARY" 2>/dev/null
fi

if [[ $PART == tests || $PART == all ]]; then
    if (( ${#SELECTION[@]} )); then
        run_tests tests "${SELECTION[@]}"
    else
        run_tests tests_gpu "${GPU_FIRST[@]}"
        rest=()
        for f in tests/test_*.py; do
            [[ " ${GPU_FIRST[*]} ${LAST[*]} " == *" $f "* ]] || rest+=("$f")
        done
        rest+=("${LAST[@]}")
        run_tests tests_rest "${rest[@]}"
    fi
fi

# Sampled verification (scripts/bench_sampled_verify.py, 1 and 32 requests): every node's row
# at once walked by torch and by the Triton kernel, against the rows the walk reads (memory,
# time; on an H200 the kernel took 0.10x the torch walk's time at 1 request, 0.67x at 32). Then
# a pool insert in torch with its adds as index_put_ and as scatter_add_ and through the pool's
# Triton kernels (scripts/bench_pool_ops.py: what SCATTER_ADD_DEVICES should hold and what the
# kernels save; bench_gpu.py's inserts section and its graph+fused+torch-pool round time them
# too); then kernels/norm_gemm.py against the separate kernels (scripts/bench_norm_gemm.py). Last,
# in what time is left, after the whole suite only.
if [[ $PART == all ]] && (( ${#SELECTION[@]} == 0 && $(left) >= 60 )); then
    timed sampled_verify $(( $(left) - 40 )) "$OUT/sampled_verify.log" python scripts/bench_sampled_verify.py
    { echo "== sampled verification"; tail -n 12 "$OUT/sampled_verify.log"; } >> "$SUMMARY" 2>/dev/null
    timed pool_ops $(( $(left) - 25 )) "$OUT/pool_ops.log" python scripts/bench_pool_ops.py
    { echo "== pool insert and lookup"; tail -n 20 "$OUT/pool_ops.log"; } >> "$SUMMARY" 2>/dev/null
    # RMSNorm and SiLU*up inside the products (draft_norm_gemm) against the separate kernels and
    # cuBLAS, per layer product; into the summary (the tool returns 8 files, all taken).
    norm_log=$(mktemp)
    timed norm_gemm $(( $(left) - 5 )) "$norm_log" python scripts/bench_norm_gemm.py --reps 100
    { echo "== norm inside the products"; tail -n 12 "$norm_log"; } >> "$SUMMARY" 2>/dev/null
fi
cat "$SUMMARY"
