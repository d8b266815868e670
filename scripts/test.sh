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
exit $rc
