#!/usr/bin/env bash
# Run the test suite in the project's environment (after scripts/setup.sh).
#   bash scripts/test.sh [pytest args...]      e.g. -m "not slow and not engine": no engine starts
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$REPO/scripts/env.sh"
cd "$REPO"
set +e
python -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "test.sh: pytest collected no tests; that is a failure here" >&2
    exit 1
fi
if [[ $# -eq 0 ]]; then
    # The whole suite: then the draft side's tests again with a GPU's host copies on this CPU
    # (no tensor a view of the array it came from, no read a view of its tensors:
    # vllm_ouroboros/host_copy.py COPY_ON_CPU), where code that reads through the CPU's sharing
    # fails as it would on a GPU.
    echo "test.sh: the draft side's tests with host copies as on a GPU (OUROBOROS_TEST_CPU_COPIES=1)"
    set +e
    OUROBOROS_TEST_CPU_COPIES=1 python -m pytest -q -m "not slow and not engine" \
        tests/test_host_copy.py tests/test_draft_runtime.py tests/test_device_round.py \
        tests/test_pool.py tests/test_pool_writer.py tests/test_pool_draft.py tests/test_kv_cache.py \
        tests/test_prefill_graph.py tests/test_accept.py tests/test_target_step.py \
        tests/test_kv_relocate.py tests/test_draft_attention_layout.py
    copies_rc=$?
    set -e
    if [[ $rc -eq 0 ]]; then rc=$copies_rc; fi
fi
exit $rc
