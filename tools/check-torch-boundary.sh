#!/usr/bin/env bash
# The torch boundary of csrc/ (issue #42): everything that includes torch lives under csrc/torch/
# (the op library, the argument checks, the CPU ops, the GPU glue, the emulator's module); the
# rest of csrc/ (common/, cpu/, hip/, simt/runtime.*) is the torch-free kernel library that
# csrc/kernel_sources.txt lists and the CMake package ships to C++ engines, and must stay so.
# Fails, listing each offending line, when a file of csrc/ outside csrc/torch/ includes
#   - a header of torch, ATen, c10 or pybind11, or Python.h (<...> or "..."), or
#   - a file of csrc/torch/ (e.g. "../torch/args/tensor_args.h": torch, one step removed);
# or when csrc/kernel_sources.txt lists a file under torch/. csrc/torch/ may include anything of
# the library. Checks the files git knows of and the new ones it does not ignore.
#   usage: tools/check-torch-boundary.sh        (in CI's lint step and a pre-commit hook)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

mapfile -t files < <(git ls-files --cached --others --exclude-standard 'csrc/*' |
  grep -v '^csrc/torch/' | sort -u)
# `#include <torch/...>`, `# include "ATen/..."`, `#include "../torch/..."`, `#include <Python.h>`.
include='^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]'
pattern="$include(([^\">]*/)?(torch|ATen|c10|pybind11)/|Python\\.h[\">])"
status=0
if offenders="$(grep -nE "$pattern" "${files[@]}")"; then
  printf '%s\n' "$offenders"
  echo "check-torch-boundary: $(printf '%s\n' "$offenders" | wc -l) include(s) of torch outside" \
    "csrc/torch/: the kernel library (csrc/common, cpu, hip, simt) stays torch-free; move the" \
    "torch-facing code under csrc/torch/ (docs/developing.md, Layout). Untracked *_hip.* files" \
    "are hipify's copies from an old ROCm build: \`git clean -n csrc\` lists them"
  status=1
fi
if listed="$(grep -nE '^[[:space:]]*[a-z_]+[[:space:]]+torch/' csrc/kernel_sources.txt)"; then
  printf 'csrc/kernel_sources.txt:%s\n' "$listed"
  echo "check-torch-boundary: csrc/kernel_sources.txt lists torch-facing files; the kernel" \
    "library's sources are torch-free (setup.py builds csrc/torch/ itself)"
  status=1
fi
[ "$status" -eq 0 ] && echo "check-torch-boundary: ${#files[@]} files outside csrc/torch/ include no torch"
exit "$status"
