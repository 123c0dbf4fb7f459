#!/usr/bin/env bash
# The ROCm install path (`pip install --no-build-isolation .` on a ROCm build of torch), checked on
# a machine with no ROCm torch and no GPU: setup.py runs as on a ROCm torch, through the installed
# torch's own cpp_extension and hipify (tools/rocm_build_sim.py says what is simulated), in a copy
# of this working tree, twice in a row:
#   1. a full build: torch hipifies the sources (into build/hipify, never into csrc/), compiles
#      the hipified host sources with the C++ compiler against c10/hip headers generated from the
#      installed torch's c10/cuda ones, and the hipified .hip files with hipcc (Debian's ROCm 5.2)
#      with torch's hipcc flags (--offload-arch=..., -fno-gpu-rdc, -std=c++20 from torch 2.14.1,
#      -std=c++17 from 2.10.0), and links;
#   2. the same build again in the same tree (the second `pip install .` or `-e .`), which must
#      succeed and recompile nothing;
#   3. the toolchain checks before any compile (setup.py --name, seconds each): the default
#      PYTORCH_ROCM_ARCH keeps only what this hipcc knows (gfx90a: it has no gfx942 or gfx950),
#      with a warning naming the rest; an explicit gfx950 stops the build, naming the arch and the
#      compiler; a torch built for ROCm 5.7 (below the minimum) stops it;
#   4. a source renamed (csrc/cpu/ple_conv.cpp) and setup.py run again: its old copies must leave
#      build/hipify.
# After every run, no file may have appeared in the tree outside build/ and the built module.
# The same check covers both hipify generations, by the torch it is given: torch >= 2.11 (v2, the
# c10::cuda names kept) and torch 2.9/2.10 (v1, the ...MasqueradingAsCUDA names, compiled against
# that torch's own ATen/hip/impl headers); QWEN4EXP_EXPECT_HIPIFY=v1|v2 fails the check if the
# torch given hipifies otherwise.
#   usage: tools/check-rocm-build.sh            (PYTHON: a python with torch; default python3)
# PYTORCH_ROCM_ARCH: default gfx90a;gfx940, the AMD targets Debian's hipcc knows.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
command -v hipcc >/dev/null || { echo "check-rocm-build: hipcc not found (apt-get install hipcc)"; exit 1; }
export PYTORCH_ROCM_ARCH="${PYTORCH_ROCM_ARCH:-gfx90a;gfx940}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export QWEN4EXP_BUILD_TARGET=rocm QWEN4EXP_BUILD_SIMT=0
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tree="$work/tree"
mkdir -p "$tree"
# The working tree as git sees it (tracked and untracked, not ignored): what a clone would hold,
# with the changes not yet committed.
(cd "$root" && git ls-files -z --cached --others --exclude-standard) >"$work/files"
(cd "$root" && tar --null -T "$work/files" -cf - 2>/dev/null) | tar -xf - -C "$tree"
(cd "$tree" && find . -type f ! -path './build/*' | sort) >"$work/before"

torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
status=0
# Runs setup.py (arguments) as on a ROCm torch; then fails on any file it left in the source tree.
simulated() {
  local name="$1"
  shift
  local start=$SECONDS
  if ! (cd "$tree" && "$py" tools/rocm_build_sim.py --rocm-home "$work/rocm" -- "$@") \
      >"$work/$name.log" 2>&1; then
    tail -n 60 "$work/$name.log"
    echo "check-rocm-build: FAIL $name (setup.py $*, torch $torch_version as ROCm)"
    status=1
    return 1
  fi
  local stray
  stray="$(cd "$tree" && find . -type f ! -path './build/*' ! -path './python/qwen4exp_ext/_kernels*.so' \
    | sort | comm -13 "$work/before" -)"
  if [ -n "$stray" ]; then
    echo "$stray" | sed -n 1,20p
    echo "check-rocm-build: FAIL $name left $(echo "$stray" | wc -l) files in the source tree"
    status=1
    return 1
  fi
  echo "check-rocm-build: ok   $name (setup.py $*, $((SECONDS - start)) s)"
}
compiled() { grep -c '^\[[0-9]*/[0-9]*\] ' "$work/$1.log" || true; }

echo "check-rocm-build: torch $torch_version as a ROCm build, hipcc $(HIP_PLATFORM=amd hipcc --version 2>/dev/null | sed -n 's/^HIP version: //p'), PYTORCH_ROCM_ARCH=$PYTORCH_ROCM_ARCH"
if simulated build1 build_ext --inplace; then
  grep -q -- '--offload-arch=' "$work/build1.log" || { echo "check-rocm-build: FAIL hipcc never ran"; status=1; }
  # Which hipify this torch has, seen in what it made of the GPU glue: v1 (torch 2.9, 2.10)
  # renames CUDA's guards and streams to the ...MasqueradingAsCUDA classes of
  # ATen/hip/impl/, v2 (torch >= 2.11) keeps the c10::cuda names.
  generation=v2
  grep -q 'MasqueradingAsCUDA' "$tree/build/hipify/csrc/torch/gpu/glue_hip.h" && generation=v1
  echo "   hipify $generation: $(grep -m1 'using DeviceGuard' "$tree/build/hipify/csrc/torch/gpu/glue_hip.h" | sed 's/^ *//')"
  if [ -n "${QWEN4EXP_EXPECT_HIPIFY:-}" ] && [ "$generation" != "$QWEN4EXP_EXPECT_HIPIFY" ]; then
    echo "check-rocm-build: FAIL torch $torch_version hipified as $generation, expected $QWEN4EXP_EXPECT_HIPIFY"
    status=1
  fi
  echo "   $(compiled build1) files compiled; the hipcc command of one kernel (-I dropped):"
  grep -m1 'bin/hipcc .*ple_gate_hip\.hip' "$work/build1.log" | sed 's/^\[[0-9/]*\] //; s/ -I[^ ]*//g; s/^/     /' || true
fi
if [ $status -eq 0 ] && simulated build2 build_ext --inplace; then
  n="$(compiled build2)"
  [ "$n" -eq 0 ] || { echo "check-rocm-build: FAIL the second build recompiled $n files"; status=1; }
fi
# Runs setup.py --name as on a ROCm torch with the environment given; its output must match a
# pattern (grep -E), and its exit status be the one expected.
expect() {
  local name="$1" want_rc="$2" pattern="$3"
  shift 3
  local rc=0
  (cd "$tree" && env "$@" "$py" tools/rocm_build_sim.py --rocm-home "$work/rocm" \
    ${HIP_VERSION:+--hip-version "$HIP_VERSION"} -- --name) >"$work/$name.log" 2>&1 || rc=$?
  if [ "$rc" -ne "$want_rc" ] || ! grep -Eq "$pattern" "$work/$name.log"; then
    tail -n 20 "$work/$name.log"
    echo "check-rocm-build: FAIL $name: exit $rc (want $want_rc), output must match: $pattern"
    status=1
    return 1
  fi
  echo "check-rocm-build: ok   $name: $(grep -Eo "$pattern" "$work/$name.log" | sed -n 1p | cut -c1-150)"
}
if [ $status -eq 0 ]; then
  expect default-archs 0 'WARNING: the compiler .*hipcc cannot build for \[.gfx942., .gfx950.\]' \
    -u PYTORCH_ROCM_ARCH
  expect default-archs-kept 0 '"gpu_archs": \["gfx90a"\]' -u PYTORCH_ROCM_ARCH
  expect explicit-gfx950 1 'compiler .*hipcc cannot build for \[.gfx950.\].*gfx950 \(needs ROCm >= 7.0\)' \
    PYTORCH_ROCM_ARCH='gfx90a;gfx950'
  HIP_VERSION=5.7.0 expect old-rocm 1 'needs ROCm >= 6.0; this torch is built for ROCm 5.7.0'
fi
if [ $status -eq 0 ]; then
  mv "$tree/csrc/cpu/ple_conv.cpp" "$tree/csrc/cpu/ple_conv_renamed.cpp"
  sed -i 's#cpu/ple_conv.cpp#cpu/ple_conv_renamed.cpp#' "$tree/csrc/kernel_sources.txt"
  sed -i 's#^\./csrc/cpu/ple_conv.cpp$#./csrc/cpu/ple_conv_renamed.cpp#' "$work/before"
  if simulated rename --name; then
    old="$(cd "$tree/build/hipify" && find . -name 'ple_conv.cpp' -path '*/cpu/*' -o -name 'ple_conv_hip.cpp' -path '*/cpu/*')"
    new="$(cd "$tree/build/hipify" && find . -name 'ple_conv_renamed_hip.cpp')"
    [ -z "$old" ] || { echo "check-rocm-build: FAIL stale copies in build/hipify: $old"; status=1; }
    [ -n "$new" ] || { echo "check-rocm-build: FAIL no hipified ple_conv_renamed"; status=1; }
  fi
fi
[ $status -eq 0 ] && echo "check-rocm-build: ok   two builds in a row, stale copies removed (torch $torch_version)"
exit $status
