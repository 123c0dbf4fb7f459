#!/usr/bin/env bash
# The test command of README.md: sets up ./.venv (first run: a few minutes), builds, runs pytest.
# Extra arguments go to pytest, e.g. tools/run-tests.sh -k ngram -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$QWEN4EXP_ROOT"
exec "$PY" -m pytest tests "$@"
