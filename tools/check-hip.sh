#!/usr/bin/env bash
# Compiles every HIP kernel in csrc/hip/ for AMD with hipcc, without torch: the proof that the
# AMD build of the kernels compiles on a machine with no ROCm torch. Fails on any error or
# warning. Debian's hipcc (ROCm 5.2) targets gfx90a (MI200) and gfx940 (MI300 family, the closest
# it knows to gfx942); a full ROCm toolchain builds gfx942/gfx950 through setup.py.
#   usage: tools/check-hip.sh [ARCH ...]     (default: gfx90a gfx940)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(gfx90a gfx940)
command -v hipcc >/dev/null || { echo "check-hip: hipcc not found (apt-get install hipcc)"; exit 1; }
# Debian's hipcc targets NVIDIA when it finds nvcc; we want the AMD path.
export HIP_PLATFORM=amd
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for src in "$root"/csrc/hip/*.hip; do
  for arch in "${archs[@]}"; do
    # The flags torch's ROCm build adds (no implicit half conversions/operators) keep us honest
    # about 16-bit float handling going through our own helpers.
    if hipcc --offload-arch="$arch" -O3 -std=c++17 -Wall -Werror \
        -D__HIP_NO_HALF_OPERATORS__=1 -D__HIP_NO_HALF_CONVERSIONS__=1 \
        -I "$root/csrc" -c "$src" -o "$out/kernel.o"; then
      # grep reads all of strings' output (no -q): an early exit would SIGPIPE strings, and
      # pipefail would then fail a large object at random.
      if ! strings "$out/kernel.o" | grep "amdgcn-amd-amdhsa--$arch" >/dev/null; then
        echo "check-hip: FAIL $(basename "$src") has no $arch code object"; status=1; continue
      fi
      echo "check-hip: ok   hipcc --offload-arch=$arch $(basename "$src")"
    else
      echo "check-hip: FAIL hipcc --offload-arch=$arch $(basename "$src")"; status=1
    fi
  done
done
exit $status
