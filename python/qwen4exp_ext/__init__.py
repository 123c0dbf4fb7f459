"""qwen4exp_ext: fast kernels for the Qwen4Exp PLE layer (hashed n-gram memory).

Importing the package loads the compiled kernels, which registers ``torch.ops.qwen4exp.*``; it
never needs a GPU. The typed Python door to the kernels is :mod:`qwen4exp_ext.ops`.
"""

from __future__ import annotations

import contextlib
import json
from functools import cache
from typing import Any

import torch


@cache
def build_info() -> dict[str, Any]:
    """What the loaded binary was built with: backends, GPU archs, torch version.

    ``backends`` lists the kernels compiled in ("cpu", plus "cuda" or "rocm");
    ``simt_wave_sizes`` the wave sizes of the SIMT emulator built in (:mod:`qwen4exp_ext.simt`);
    ``torch`` is the version built against, ``torch_runtime`` the one running now (they must
    agree in major.minor).
    """
    info = json.loads(torch.ops.qwen4exp.build_info())
    info["torch_runtime"] = torch.__version__
    return info


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def _load_kernels() -> None:
    """Loads the compiled kernels (which registers torch.ops.qwen4exp), and refuses a binary
    built against another torch major.minor: torch's C++ ABI changes between them, so it would
    fail later and less clearly (a missing symbol, or a crash)."""
    rebuild = (
        "rebuild qwen4exp_ext against it (pip install --no-build-isolation --no-deps "
        "--force-reinstall <its source>)"
    )
    try:
        from . import _kernels  # noqa: F401
    except (ImportError, OSError) as error:
        raise ImportError(
            f"qwen4exp_ext: its kernels do not load under torch {torch.__version__} ({error}); if "
            f"they were built against another torch, {rebuild}"
        ) from error
    built = build_info()["torch"]
    if _major_minor(built) != _major_minor(str(torch.__version__)):
        raise ImportError(
            f"qwen4exp_ext was built against torch {built} but torch {torch.__version__} is "
            f"running; {rebuild}"
        )


_load_kernels()

from . import _switches, ops  # noqa: E402  (they bind the library loaded above)

__all__ = ["build_info", "debug_checks", "debug_checks_enabled", "ops", "set_debug_checks"]
__version__ = "0.1.0"


def debug_checks(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within the block, GPU calls from this thread also check index *values* and raise on bad
    ones.

    On a GPU the kernels never read index data on the host (it would sync the stream and break
    CUDA-graph capture), so a bad ``query_start_loc`` layout, an out-of-range ``state_indices``
    or ``token_indices`` entry, or a non-positive head size is not an error there: the kernels
    read and write nothing out of bounds (skipped rows and slots; ids of -1, which gather as zero
    rows). With the checks on, each GPU call copies those index tensors to the host (a sync) and
    raises the same error the CPU path raises. Skipped while a CUDA graph is being captured.

    Like ``torch.no_grad``, the block holds for the calling thread only (``enabled=False`` turns
    the checks off there); blocks nest. For every thread: :func:`set_debug_checks`, or
    ``QWEN4EXP_DEBUG_CHECKS=1`` in the environment when the package is imported (also for
    processes it starts). Token ids and gather ids are data, never errors, with or without the
    checks (SPEC §3, §4).
    """
    return _switches.debug_checks(enabled)


def set_debug_checks(enabled: bool) -> None:
    """Turns the debug checks (:func:`debug_checks`) on or off for the whole process, except
    inside a thread's ``debug_checks`` block."""
    _switches.set_debug_checks(enabled)


def debug_checks_enabled() -> bool:
    """Whether GPU calls from this thread run the debug checks now."""
    return _switches.debug_checks_enabled()
