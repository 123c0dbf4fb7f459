"""The GPU kernels run on the CPU: the SIMT emulator (csrc/simt), for tests and debugging.

``simt.ops(64)`` (CDNA's 64-wide waves) and ``simt.ops(32)`` (RDNA's and NVIDIA's) return the kernel
ops (those csrc/torch/schemas.h defines, as :class:`qwen4exp_ext.ops.KernelOps`) with exactly
:mod:`qwen4exp_ext.ops`' signatures, argument checks and errors, for CPU tensors; each call runs the
HIP kernel of ``csrc/hip`` through the GPU build's own host glue and launcher, on an emulated GPU:
the threads of a block are fibers that meet at ``__syncthreads`` and wave shuffles, lanes run in a
seeded shuffled order, and shared memory starts as 0xFF bytes. Like a GPU, it reads index data only
on the device: bad ``query_start_loc``/slot/token indices are skipped rather than rejected, unless
:func:`qwen4exp_ext.debug_checks` is on. Its ops live in their own libraries,
``torch.ops.qwen4exp_simt32`` and ``torch.ops.qwen4exp_simt64``.

It is slow (every thread is a fiber) and proves indexing, barriers, shuffles, bounds and wave-size
independence; not timing, the GPU memory model, or the device compiler's float code (README, "How
the GPU kernels are tested without a GPU"). Built when ``QWEN4EXP_BUILD_SIMT=1``; the lane order
seed is ``QWEN4EXP_SIMT_SEED`` (read when :func:`ops` first loads a wave size's library, default
0; a value it cannot read as written raises ValueError there).
"""

from __future__ import annotations

import importlib
from functools import cache

import torch

from . import _switches
from .ops import KernelOps

__all__ = ["WAVE_SIZES", "available", "ops", "take_launch_record"]

WAVE_SIZES = (32, 64)


def available() -> tuple[int, ...]:
    """The wave sizes this build has an emulator for (empty unless built with
    ``QWEN4EXP_BUILD_SIMT=1``)."""
    from . import build_info

    return tuple(build_info().get("simt_wave_sizes", ()))


@cache
def ops(wave_size: int) -> KernelOps:
    """The kernel ops of the HIP kernels emulated with ``wave_size``-wide waves (32 or 64)."""
    if wave_size not in WAVE_SIZES:
        raise ValueError(f"simt.ops: wave_size must be one of {WAVE_SIZES}, got {wave_size!r}")
    if wave_size not in available():
        raise RuntimeError(
            "simt.ops: this qwen4exp_ext was built without the SIMT emulator; rebuild with "
            "QWEN4EXP_BUILD_SIMT=1 (e.g. QWEN4EXP_BUILD_SIMT=1 pip install --no-build-isolation .)"
        )
    _switches.check_simt_seed_env()  # the library reads it when it loads, with no error of its own
    importlib.import_module(f"qwen4exp_ext._simt{wave_size}")  # registers its op library
    return KernelOps(f"qwen4exp_simt{wave_size}")


def take_launch_record(wave_size: int) -> tuple[int, int]:
    """``(launches, most_blocks)``: how many kernel launches the emulator of ``wave_size`` was
    asked for since the last call (or its load), and the most blocks one of them had; the next
    record starts empty. What tests read a launcher's grid from (``max_blocks`` of
    ``gather_rows``). Launches run one at a time in a process, so in a test that calls one op
    the record is that op's."""
    namespace = ops(wave_size).namespace
    launches, most_blocks = getattr(torch.ops, namespace).take_launch_record()
    return int(launches), int(most_blocks)
