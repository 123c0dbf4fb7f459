#!/usr/bin/env bash
# Checks that every C/C++/HIP source the project owns (the tracked csrc/**/*.{h,cpp,hip} and
# tests/cpp/**/*.{h,cpp}) is formatted as .clang-format says; fails, listing what to run, if not.
# Also fails when one of them includes torch/all.h or torch/extension.h (see the end).
# The clang-format version is pinned (tools/venv.sh, which sets up the venv of the tests and CI):
# another version formats differently, so any other is refused.
#   usage: tools/check-format.sh
# CLANG_FORMAT=PATH picks the binary; default: the venv's ($QWEN4EXP_VENV or ./.venv), else the
# one on PATH.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

venv="${QWEN4EXP_VENV:-$root/.venv}"
if [ -z "${CLANG_FORMAT:-}" ] && [ -x "$venv/bin/clang-format" ]; then
  CLANG_FORMAT="$venv/bin/clang-format"
fi
clang_format="${CLANG_FORMAT:-clang-format}"
want="$(sed -n 's/.*clang-format==\([0-9.]*\).*/\1/p' tools/venv.sh)"
if ! command -v "$clang_format" >/dev/null 2>&1; then
  echo "check-format: $clang_format not found (pip install clang-format==$want)"
  exit 1
fi
have="$({ "$clang_format" --version || true; } | sed -n 's/.*clang-format version \([0-9.]*\).*/\1/p')"
if [ "$have" != "$want" ]; then
  echo "check-format: $clang_format is version ${have:-unknown}, the project pins $want" \
    "(pip install clang-format==$want)"
  exit 1
fi

# tests/cpp/cmake_consumer/ is the CMake package's consumer, kept as its own project.
mapfile -t files < <(git ls-files 'csrc/*' 'tests/cpp/*' | grep -E '\.(h|cpp|hip)$' |
  grep -v '^tests/cpp/cmake_consumer/')
if ! report="$("$clang_format" --dry-run --Werror "${files[@]}" 2>&1)"; then
  printf '%s\n' "$report" | head -n 60
  mapfile -t bad < <(printf '%s\n' "$report" |
    sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: error: code should be clang-formatted.*/\1/p' | sort -u)
  echo
  echo "check-format: ${#bad[@]} file(s) not formatted as .clang-format says. Fix with:"
  echo "  $clang_format -i ${bad[*]:-${files[*]}}"
  exit 1
fi
echo "check-format: ${#files[@]} files formatted (clang-format $have)"

# House rule: the torch glue includes ATen's own headers, never the whole C++ frontend (why:
# csrc/torch/args/tensor_args.h).
if frontend="$(grep -nE '#include <torch/(all|extension)\.h>' "${files[@]}")"; then
  printf '%s\n' "$frontend"
  echo "check-format: include ATen's headers (ATen/core/Tensor.h, ATen/ops/<op>.h," \
    "torch/library.h), not torch/all.h or torch/extension.h (csrc/torch/args/tensor_args.h says why)"
  exit 1
fi
