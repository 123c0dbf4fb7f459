#!/usr/bin/env python3
"""Runs setup.py as it runs on a ROCm build of torch, with the torch installed here (a CUDA or CPU
build) and Debian's hipcc: the check that the ROCm install path (`pip install
--no-build-isolation .` on a ROCm torch) builds, on a machine where no ROCm torch can be installed.

What is simulated, and nothing else:
- torch says it is a ROCm build: `torch.version.hip` is set (`torch.version.cuda` cleared), before
  setup.py imports `torch.utils.cpp_extension`, which then takes its ROCm branch as on a ROCm torch
  (IS_HIP_EXTENSION, ROCM_HOME, hipify, COMMON_HIP_FLAGS/COMMON_HIPCC_FLAGS, `--offload-arch`,
  `-std=c++20`, hipcc for `.hip` files): the installed torch's own code, not a copy;
- ROCM_HOME is a folder made here (`make_rocm_home`): `bin/hipcc` runs Debian's hipcc (ROCm 5.2)
  for AMD; `include/` holds the `c10/hip` and `ATen/hip` headers a ROCm torch ships, generated
  from the installed torch's `c10/cuda` and `ATen/cuda` headers by the installed torch's hipify
  with PyTorch's ROCm build's own call (`tools/amd_build/build_amd.py`); `lib/` holds Debian's
  libamdhip64 and empty stand-ins for torch's libc10_hip and libtorch_hip (the module links, it
  cannot load).

    python tools/rocm_build_sim.py [--hip-version 7.0.0] [--rocm-home DIR] -- SETUP_ARGS...

runs `setup.py SETUP_ARGS` (e.g. `build_ext --inplace`) in the current directory. The HIP
version decides nothing in torch's build; it is what `build_info()` would report.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile

# ROCm 5.2's HIP headers lack the user-object API (hipUserObject*, ROCm 5.3) that torch's
# c10/hip/HIPGraphsC10Utils.h and friends may name; declared here so that those headers parse.
# Only declarations: nothing links against them.
HIP_COMPAT_H = """\
#pragma once
#include <hip/hip_runtime_api.h>
#if HIP_VERSION < 50300000
typedef struct ihipUserObject_t* hipUserObject_t;
typedef enum hipUserObjectFlags { hipUserObjectNoDestructorSync = 0x1 } hipUserObjectFlags;
typedef enum hipUserObjectRetainFlags {
  hipGraphUserObjectMove = 0x1
} hipUserObjectRetainFlags;
hipError_t hipUserObjectCreate(hipUserObject_t*, void*, hipHostFn_t, unsigned int, unsigned int);
hipError_t hipUserObjectRelease(hipUserObject_t, unsigned int);
hipError_t hipUserObjectRetain(hipUserObject_t, unsigned int);
hipError_t hipGraphRetainUserObject(hipGraph_t, hipUserObject_t, unsigned int, unsigned int);
hipError_t hipGraphReleaseUserObject(hipGraph_t, hipUserObject_t, unsigned int);
#endif
"""


def generate_hip_headers(torch_include: str, include: str) -> None:
    """c10/hip and ATen/hip as a ROCm torch ships them: its c10/cuda and ATen/cuda hipified by
    the installed torch's hipify, with build_amd.py's includes, ignores and hip_clang_launch, in
    the source tree's layout (c10/cuda, aten/src/ATen/cuda), then installed as torch installs
    them (include/c10/hip, include/ATen/hip)."""
    from torch.utils.hipify import hipify_python

    with tempfile.TemporaryDirectory() as proj:
        shutil.copytree(os.path.join(torch_include, "c10", "cuda"), f"{proj}/c10/cuda")
        shutil.copytree(os.path.join(torch_include, "ATen", "cuda"), f"{proj}/aten/src/ATen/cuda")
        # PyTorch makes ATen/hip/HIPConfig.h as CUDAConfig.h.in -> (hipify) HIPConfig.h.in ->
        # (CMake) HIPConfig.h. A wheel ships only the configured CUDAConfig.h: it stands in for
        # the template here, and configure_hip_config() sets a ROCm build's values below.
        os.rename(
            f"{proj}/aten/src/ATen/cuda/CUDAConfig.h", f"{proj}/aten/src/ATen/cuda/CUDAConfig.h.in"
        )
        hipify_python.hipify(
            project_directory=proj,
            output_directory=proj,
            includes=[f"{proj}/c10/cuda/*", f"{proj}/aten/src/ATen/cuda/*"],
            ignores=[f"{proj}/*/hip/*", f"{proj}/aten/src/ATen/cuda/CUDAConfig.h"],
            show_progress=False,
            hip_clang_launch=True,
        )
        # The one ROCm 5.2 gap, made visible to every c10/hip header through the one they all
        # include.
        with open(f"{proj}/c10/hip/qwen4exp_rocm52_compat.h", "w") as f:
            f.write(HIP_COMPAT_H)
        with open(f"{proj}/c10/hip/HIPMacros.h", "a") as f:
            f.write('\n#include "qwen4exp_rocm52_compat.h"  // rocm_build_sim.py\n')
        configure_hip_config(f"{proj}/aten/src/ATen/hip/HIPConfig.h.in")
        for src, dst in (("c10/hip", "c10/hip"), ("aten/src/ATen/hip", "ATen/hip")):
            sync_tree(os.path.join(proj, src), os.path.join(include, dst))


# What CMake's configure writes into HIPConfig.h on a ROCm build (USE_ROCM: ROCm on; cuDNN is
# CUDA's; hipSPARSELt, which hipify also names what was cuSPARSELt, is optional and off here).
# The v1 glue's ATen/hip/impl/*MasqueradingAsCUDA.h include it; nothing of ours reads the values.
ROCM_CONFIG = {
    "AT_ROCM_ENABLED": "1",
    "AT_CUDNN_ENABLED": "0",
    "AT_HIPSPARSELT_ENABLED": "0",
}


def configure_hip_config(template: str) -> None:
    """HIPConfig.h from the hipified HIPConfig.h.in, with a ROCm build's values."""

    with open(template) as f:
        text = f.read()
    for name, value in ROCM_CONFIG.items():
        text, n = re.subn(rf"(#define {name}\(\)) \S+", rf"\g<1> {value}", text)
        if n == 0:
            sys.exit(f"rocm_build_sim: {name}() is not defined in {template}")
    text = re.sub(r'#define NVCC_FLAGS_EXTRA ".*"', '#define NVCC_FLAGS_EXTRA ""', text)
    os.remove(template)
    with open(template[: -len(".in")], "w") as f:
        f.write(text)


def sync_tree(src: str, dst: str) -> None:
    """dst becomes a copy of src; unchanged files keep their times (no rebuild of what includes
    them on the next run)."""
    wanted = set()
    for dirpath, _, names in os.walk(src):
        for name in names:
            path = os.path.relpath(os.path.join(dirpath, name), src)
            wanted.add(path)
            with open(os.path.join(src, path), "rb") as f:
                data = f.read()
            target = os.path.join(dst, path)
            if os.path.exists(target):
                with open(target, "rb") as f:
                    if f.read() == data:
                        continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)
    for dirpath, _, names in os.walk(dst):
        for name in names:
            if os.path.relpath(os.path.join(dirpath, name), dst) not in wanted:
                os.remove(os.path.join(dirpath, name))


def make_rocm_home(home: str) -> None:
    import torch

    hipcc = shutil.which("hipcc")
    if hipcc is None:
        sys.exit("rocm_build_sim: hipcc not found (apt-get install hipcc)")
    os.makedirs(os.path.join(home, "bin"), exist_ok=True)
    os.makedirs(os.path.join(home, "lib"), exist_ok=True)
    wrapper = os.path.join(home, "bin", "hipcc")
    with open(wrapper, "w") as f:
        # Debian's hipcc targets NVIDIA when it finds nvcc; a ROCm install's targets AMD.
        f.write(f'#!/bin/sh\nHIP_PLATFORM=amd exec {hipcc} "$@"\n')
    os.chmod(wrapper, 0o755)
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    generate_hip_headers(torch_include, os.path.join(home, "include"))
    lib = os.path.join(home, "lib")
    for name in ("c10_hip", "torch_hip"):
        stub = os.path.join(lib, f"lib{name}.so")
        if not os.path.exists(stub):
            subprocess.run(["cc", "-shared", "-x", "c", "/dev/null", "-o", stub], check=True)
    amdhip = subprocess.run(
        ["cc", "-print-file-name=libamdhip64.so"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(amdhip):  # the driver echoes the bare name when it finds none
        for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib", "/opt/rocm/lib"):
            if os.path.exists(os.path.join(folder, "libamdhip64.so")):
                amdhip = os.path.join(folder, "libamdhip64.so")
                break
        else:
            sys.exit("rocm_build_sim: libamdhip64.so not found (apt-get install libamdhip64-dev)")
    link = os.path.join(lib, "libamdhip64.so")
    if not os.path.lexists(link):
        os.symlink(amdhip, link)


def pretend_rocm_torch(hip_version: str, rocm_home: str) -> None:
    """Makes the installed torch take its ROCm branches from here on (before cpp_extension is
    imported: it decides IS_HIP_EXTENSION and ROCM_HOME at import)."""
    import torch

    if "torch.utils.cpp_extension" in sys.modules:
        sys.exit("rocm_build_sim: torch.utils.cpp_extension was imported too early")
    torch.version.hip = hip_version
    torch.version.cuda = None
    # A CPU build of torch says it has no GPU runtime, which would hide ROCM_HOME.
    torch.cuda._is_compiled = lambda: True
    os.environ["ROCM_HOME"] = rocm_home
    os.environ.pop("ROCM_PATH", None)
    os.environ["HIP_PLATFORM"] = "amd"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hip-version", default="7.0.0")
    parser.add_argument("--rocm-home", help="where to make the ROCm stand-in (default: a temp dir)")
    parser.add_argument("setup_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    setup_args = [a for a in args.setup_args if a != "--"] or ["build_ext", "--inplace"]
    home = args.rocm_home or tempfile.mkdtemp(prefix="rocm-home-")
    make_rocm_home(os.path.abspath(home))
    pretend_rocm_torch(args.hip_version, os.path.abspath(home))
    import torch

    print(
        f"rocm_build_sim: torch {torch.__version__} as a ROCm {torch.version.hip} build, "
        f"ROCM_HOME={home}",
        flush=True,
    )
    sys.argv = ["setup.py", *setup_args]
    runpy.run_path("setup.py", run_name="__main__")


if __name__ == "__main__":
    main()
