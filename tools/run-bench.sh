#!/usr/bin/env bash
# The main job of README.md: sets up ./.venv, builds, and runs qwen4exp-bench on this machine's
# default device (the GPU if there is one, else the CPU). Extra arguments go to qwen4exp-bench,
# e.g. tools/run-bench.sh ngram_ids --json results.json, or
# tools/run-bench.sh gather_rows ple_conv --threads all --csv results.csv --plot results.png
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$QWEN4EXP_ROOT"
exec "$VENV/bin/qwen4exp-bench" "$@"
