#!/usr/bin/env bash
# Makes sure the venv of the tests and the bench exists, with torch and the test dependencies
# (vLLM among them): the first half of tools/env.sh, which sources it. Runs by itself too, so that
# CI can install the venv while it compiles the HIP kernels.
#
# Knobs: QWEN4EXP_VENV (default ./.venv), QWEN4EXP_TORCH (the torch requirement, default
# torch==2.14.1).
set -euo pipefail

QWEN4EXP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN4EXP_VENV:-$QWEN4EXP_ROOT/.venv}"
TORCH_REQ="${QWEN4EXP_TORCH:-torch==2.14.1}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"

stamp="$VENV/.qwen4exp-deps"
# vLLM's AMD Qwen4Exp model module imports torchvision (the plugin swaps its entry:
# tests/test_vllm_prefetch.py); the torchvision build that matches the default torch.
VISION_REQ=""
[ "$TORCH_REQ" = "torch==2.14.1" ] && VISION_REQ="torchvision==0.29.1"
# clang-format is pinned: another version formats differently (tools/check-format.sh).
deps="$TORCH_REQ $VISION_REQ pytest>=8 pytest-xdist hypothesis>=6.100 numpy transformers==5.18.0 safetensors matplotlib ninja setuptools>=77 wheel ruff clang-format==23.1.5"
vllm_reqs="$QWEN4EXP_ROOT/tools/requirements-vllm.txt"
want="$deps | $(md5sum <"$vllm_reqs")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # (the filter drops this machine's pip-config noise about absent local index folders)
  quiet_pip() {
    "$PY" -m pip install --quiet --disable-pip-version-check "$@" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  }
  echo "== installing $deps"
  # shellcheck disable=SC2086
  quiet_pip $deps
  echo "== installing vLLM 0.33.0 for the plugin tests (--no-deps: torch stays as built)"
  quiet_pip --no-deps -r "$vllm_reqs"
  echo "$want" >"$stamp"
fi
