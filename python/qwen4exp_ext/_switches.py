"""The run-time switches of the op libraries: the GPU glue's debug checks and the CPU gather's
streaming threshold (held in atomics: csrc/torch/switches.h in each library, and the CPU gather's
own, csrc/cpu/gather_rows_stream.cpp).

Their environment variables are read once, when the package is imported. After that they change
only through functions: :func:`qwen4exp_ext.set_debug_checks` (the process),
:func:`qwen4exp_ext.debug_checks` (a block of the calling thread) and
:func:`qwen4exp_ext.ops.set_cpu_gather_stream_bytes`. Nothing writes ``os.environ``, which C
code on another thread may be reading. Every op library is brought to the current settings
when it is bound (``torch.ops.qwen4exp`` at import, the SIMT emulator's in ``simt.ops``), so a
switch applies to all of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator

import torch

DEBUG_CHECKS_ENV = "QWEN4EXP_DEBUG_CHECKS"
CPU_GATHER_STREAM_BYTES_ENV = "QWEN4EXP_CPU_GATHER_STREAM_BYTES"

_lock = threading.Lock()
_libraries: list[str] = []  # the namespaces of the op libraries bound so far
_debug_checks_process = os.environ.get(DEBUG_CHECKS_ENV, "") not in ("", "0")
_this_thread = threading.local()  # .debug_checks: 1 on, 0 off, -1 (or unset) no block


def _thread_debug_checks() -> int:
    return getattr(_this_thread, "debug_checks", -1)


def attach(namespace: str) -> None:
    """Brings the op library ``namespace`` to the current settings, and keeps it in step."""
    library = getattr(torch.ops, namespace)
    with _lock:
        if namespace in _libraries:
            return
        library.set_debug_checks(_debug_checks_process)
        # Only the calling thread's block reaches a library bound inside it: the others' blocks
        # are not known here (the emulator libraries are bound by tests and debugging sessions).
        library.set_thread_debug_checks(_thread_debug_checks())
        _libraries.append(namespace)


def set_debug_checks(enabled: bool) -> None:
    with _lock:
        global _debug_checks_process
        _debug_checks_process = bool(enabled)
        for namespace in _libraries:
            getattr(torch.ops, namespace).set_debug_checks(_debug_checks_process)


def debug_checks_enabled() -> bool:
    here = _thread_debug_checks()
    return here == 1 if here >= 0 else _debug_checks_process


def _set_thread_debug_checks(setting: int) -> None:
    _this_thread.debug_checks = setting
    with _lock:
        for namespace in _libraries:
            getattr(torch.ops, namespace).set_thread_debug_checks(setting)


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    previous = _thread_debug_checks()
    _set_thread_debug_checks(1 if enabled else 0)
    try:
        yield
    finally:
        _set_thread_debug_checks(previous)


def cpu_gather_stream_bytes_from_env() -> int | None:
    """``QWEN4EXP_CPU_GATHER_STREAM_BYTES`` as a byte count (None where it is unset or empty)."""
    value = os.environ.get(CPU_GATHER_STREAM_BYTES_ENV, "")
    if value == "":
        return None
    if re.fullmatch("[0-9]+", value) is None:  # digits only: no sign, exponent, unit or space
        raise ValueError(f"{CPU_GATHER_STREAM_BYTES_ENV} must be a byte count >= 0, got {value!r}")
    return int(value)
