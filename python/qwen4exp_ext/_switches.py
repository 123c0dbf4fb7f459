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

It also holds the one reading of every ``QWEN4EXP_*`` variable's value (README, "Environment
variables", lists them and the rule for a bad value): :func:`parse_flag` for the on/off ones,
:func:`parse_count` for counts, :func:`env_directory` for folders, :func:`warn_once` for the
vLLM plugin's, which warn and use their default rather than raise inside vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

DEBUG_CHECKS_ENV = "QWEN4EXP_DEBUG_CHECKS"
CPU_GATHER_STREAM_BYTES_ENV = "QWEN4EXP_CPU_GATHER_STREAM_BYTES"
CPU_FRESH_OUTPUT_CACHE_BYTES_ENV = "QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES"

# The words of an on/off variable, case-insensitive, surrounding spaces ignored. Unset or empty
# is the variable's own default (``QWEN4EXP_X=`` reads as "no value"), as for every variable.
TRUE_WORDS = ("1", "true", "on", "yes")
FALSE_WORDS = ("0", "false", "off", "no")
INT64_MAX = (1 << 63) - 1  # the largest count the kernels' int64 settings hold


def parse_flag(name: str, value: str) -> bool:
    """``value`` of the on/off variable ``name``; ValueError naming both for any other word."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(
        f"{name} must be 1, true, on or yes (on) or 0, false, off or no (off), any case, "
        f"got {value!r}"
    )


def env_flag(name: str, default: bool) -> bool:
    """The on/off variable ``name`` (``default`` where it is unset or empty); ValueError for a
    bad word."""
    value = os.environ.get(name, "")
    return default if value.strip() == "" else parse_flag(name, value)


def parse_count(
    name: str, value: str, *, what: str, minimum: int = 0, maximum: int = INT64_MAX
) -> int:
    """``value`` of ``name`` as an int in [minimum, maximum]: decimal digits only (no sign,
    exponent, unit or space), else ValueError naming both and what was expected."""
    if re.fullmatch("[0-9]+", value) is None or not minimum <= int(value) <= maximum:
        raise ValueError(f"{name} must be {what} >= {minimum} and <= {maximum}, got {value!r}")
    return int(value)


def env_count(name: str, *, what: str, minimum: int = 0, maximum: int = INT64_MAX) -> int | None:
    """The count variable ``name`` (None where it is unset or empty); ValueError if bad."""
    value = os.environ.get(name, "")
    if value == "":
        return None
    return parse_count(name, value, what=what, minimum=minimum, maximum=maximum)


def env_directory(name: str) -> Path | None:
    """The folder variable ``name`` (None where it is unset or empty); ValueError where it names
    no existing directory (missing, a file, a FIFO...)."""
    value = os.environ.get(name, "")
    if value == "":
        return None
    if not os.path.isdir(value):
        what = "does not exist" if not os.path.lexists(value) else "is not a directory"
        raise ValueError(f"{name} must name an existing directory, got {value!r}, which {what}")
    return Path(value)


_warned_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    """Logs ``message`` as a warning on ``logger`` the first time only, in this process: a bad
    value read on every step is said once."""
    with _warned_lock:
        if (logger.name, message) in _warned:
            return
        _warned.add((logger.name, message))
    logger.warning("%s", message)


def env_flag_or_warn(name: str, default: bool, logger: logging.Logger) -> bool:
    """:func:`env_flag` for the vLLM plugin's variables: a bad word is one warning on ``logger``
    (vLLM's log) and ``default``, so that a typo never stops a running server."""
    try:
        return env_flag(name, default)
    except ValueError as error:
        warn_once(
            logger,
            f"qwen4exp_ext vLLM plugin: {error}; using the default, {'on' if default else 'off'}",
        )
        return default


def env_directory_or_warn(name: str, logger: logging.Logger) -> Path | None:
    """:func:`env_directory` for the vLLM plugin's folder variables: a value that names no
    directory is one warning on ``logger`` (vLLM's log) and None (the variable's default, off)."""
    try:
        return env_directory(name)
    except ValueError as error:
        warn_once(logger, f"qwen4exp_ext vLLM plugin: {error}; using the default, off")
        return None


# The vLLM plugin's table directory (vllm/table_dir.py): packed PLE table files, ple<L>.q4xt.
VLLM_TABLE_DIR_ENV = "QWEN4EXP_VLLM_TABLE_DIR"


_lock = threading.Lock()
_libraries: list[str] = []  # the namespaces of the op libraries bound so far
_debug_checks_process = env_flag(DEBUG_CHECKS_ENV, False)  # a bad word fails the import
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
    return env_count(CPU_GATHER_STREAM_BYTES_ENV, what="a byte count")


def cpu_fresh_output_cache_bytes_from_env() -> int | None:
    """``QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES`` as a byte count (None where it is unset or
    empty)."""
    return env_count(CPU_FRESH_OUTPUT_CACHE_BYTES_ENV, what="a byte count")


SIMT_SEED_ENV = "QWEN4EXP_SIMT_SEED"


def check_simt_seed_env() -> None:
    """Checks ``QWEN4EXP_SIMT_SEED`` before an emulator library loads, which reads it with C's
    ``strtoull`` (csrc/simt/runtime.cpp): that would wrap ``-1`` to 2**64-1, saturate an overflow
    and read ``010`` as octal, so only what it reads as written passes here: decimal without a
    leading zero, or hex with ``0x``, below 2**64."""
    value = os.environ.get(SIMT_SEED_ENV, "")
    if value == "":
        return
    if re.fullmatch("0|[1-9][0-9]*|0[xX][0-9a-fA-F]+", value) is None or int(value, 0) >= 1 << 64:
        raise ValueError(
            f"{SIMT_SEED_ENV} must be an integer >= 0 and < 2**64, decimal without a leading zero "
            f"or hex with 0x, got {value!r}"
        )
