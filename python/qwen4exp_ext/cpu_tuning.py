"""The CPU kernels' tuning switches: which path or lookup they take, for the whole process.
Every setting gives the same values; they exist to tune and to test each path on one machine.
:mod:`qwen4exp_ext.ops` re-exports them all (``ops.set_cpu_gather_stream_bytes`` etc.).

``QWEN4EXP_CPU_GATHER_STREAM_BYTES`` in the environment sets :func:`cpu_gather_stream_bytes`
when this module is imported (with :mod:`qwen4exp_ext.ops`, so with the package). The gather's
path for large outputs is otherwise timed on this machine (:func:`cpu_gather_path`).
``QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES`` sets :func:`cpu_fresh_output_cache_bytes` likewise.
"""

from __future__ import annotations

import torch

from . import _switches

__all__ = [
    "CPU_GATHER_PATHS",
    "cpu_conv_silu_lookup",
    "cpu_fresh_output_bytes",
    "cpu_fresh_output_cache_bytes",
    "cpu_fresh_output_mode",
    "cpu_gather_calls",
    "cpu_gather_fp8_lookup",
    "cpu_gather_path",
    "cpu_gather_stream_bytes",
    "cpu_gather_timing",
    "cpu_hc_dot",
    "cpu_ngram_hash_isa",
    "empty_fresh_output_cache",
    "fresh_output_cache_held",
    "set_cpu_conv_silu_lookup",
    "set_cpu_fresh_output_bytes",
    "set_cpu_fresh_output_cache_bytes",
    "set_cpu_fresh_output_mode",
    "set_cpu_gather_fp8_lookup",
    "set_cpu_gather_path",
    "set_cpu_gather_stream_bytes",
    "set_cpu_hc_dot",
    "set_cpu_ngram_hash_isa",
]

# The CPU gather's paths, as the kernel numbers them (csrc/common/gather_rows.h): "cached"
# (rows prefetched ahead, ordinary stores), "stream" (a block's rows read in table order, written
# with non-temporal stores; x86-64 with AVX only) and "plain" (a row after another, no prefetch:
# what ``index_select`` does).
CPU_GATHER_PATHS = ("cached", "stream", "plain")
_UNTIMED = "untimed"  # the kernel's code 3: large gathers not timed yet


def cpu_gather_stream_bytes() -> int:
    """The output size in bytes from which the CPU ``gather_rows`` streams, where a threshold is
    set (:func:`set_cpu_gather_stream_bytes`, or ``QWEN4EXP_CPU_GATHER_STREAM_BYTES`` in the
    environment when the package is imported); by default the size from which it times its
    paths instead (:func:`cpu_gather_path`): what this process's threads can keep in cache (per
    thread its core's L2 and its share of the L3, at most 4 MiB of it). -1 where this CPU has no
    streaming path (it needs x86-64 with AVX)."""
    return int(torch.ops.qwen4exp.cpu_gather_stream_bytes())


def set_cpu_gather_stream_bytes(stream_bytes: int | None) -> int | None:
    """Sets a threshold for the whole process: outputs of at least ``stream_bytes`` bytes
    stream, smaller ones take the cached path (0: every call streams); it wins over the timed
    choice. None: no threshold, the timed default again. Returns the setting it replaces."""
    if stream_bytes is not None and (
        isinstance(stream_bytes, bool)
        or not isinstance(stream_bytes, int)
        or not 0 <= stream_bytes <= _switches.INT64_MAX  # the kernel's setting is an int64
    ):
        raise ValueError(
            "set_cpu_gather_stream_bytes: stream_bytes must be an int >= 0 or None (at most "
            f"{_switches.INT64_MAX}), got {stream_bytes!r}"
        )
    previous = torch.ops.qwen4exp.set_cpu_gather_stream_bytes(
        -1 if stream_bytes is None else stream_bytes
    )
    return None if previous < 0 else int(previous)


def cpu_gather_path(output_bytes: int | None = None, *, converting: bool = False) -> str:
    """The path the CPU ``gather_rows`` takes now, at this thread count
    (:func:`torch.get_num_threads`), for an output of ``output_bytes`` bytes (None: a large
    one, a prefill): one of :data:`CPU_GATHER_PATHS`, or ``"untimed"``. ``converting``: for a
    gather that converts its rows (fp8, NVFP4, or into another dtype), which is timed apart from
    same-dtype copies.

    An output smaller than what this process's threads keep in cache
    (:func:`cpu_gather_stream_bytes`) takes the cached path. For a larger one the path is chosen
    by measurement on this machine: the first six such gathers of a kind at a thread count (four
    where the CPU has no streaming path) run each path twice, in turn, and time it, and every
    later one takes the fastest ("untimed" until then; :func:`cpu_gather_timing` has the
    figures). The plain path is ``index_select``'s way, so the choice is never slower than that
    on the gathers it timed. An explicit setting wins: :func:`set_cpu_gather_path` pins a path,
    :func:`set_cpu_gather_stream_bytes` a threshold. Same values on every path."""
    if output_bytes is None:
        output_bytes = _switches.INT64_MAX
    elif isinstance(output_bytes, bool) or not isinstance(output_bytes, int) or output_bytes < 0:
        raise ValueError(
            f"cpu_gather_path: output_bytes must be an int >= 0 or None, got {output_bytes!r}"
        )
    code = torch.ops.qwen4exp.cpu_gather_path(min(output_bytes, _switches.INT64_MAX), converting)
    return _UNTIMED if code == len(CPU_GATHER_PATHS) else CPU_GATHER_PATHS[code]


def set_cpu_gather_path(path: str | None) -> str | None:
    """Pins the CPU gather's path for every output size, for the whole process: one of
    :data:`CPU_GATHER_PATHS` (None: none pinned, the threshold or the timed choice again), so
    that each can be tested on one machine; returns the setting it replaces. ``"stream"`` raises
    ValueError where this CPU or build has no streaming path."""
    if path is not None and path not in CPU_GATHER_PATHS:
        raise ValueError(
            f"set_cpu_gather_path: path must be 'cached', 'stream', 'plain' or None, got {path!r}"
        )
    code = -1 if path is None else CPU_GATHER_PATHS.index(path)
    previous = torch.ops.qwen4exp.set_cpu_gather_path(code)
    return None if previous < 0 else CPU_GATHER_PATHS[previous]


def cpu_gather_timing(*, converting: bool = False) -> dict[str, object] | None:
    """The measurement behind :func:`cpu_gather_path` for large gathers at this thread count
    (``converting``: of the converting ones), or None where none has been made yet:
    ``{"path": the choice, "output_bytes": the first timed gather's output, "threads": n,
    "seconds": {path: its best time}}`` (a path this CPU lacks is left out)."""
    code, output_bytes, threads, *nanoseconds = torch.ops.qwen4exp.cpu_gather_timing(converting)
    if code == len(CPU_GATHER_PATHS):
        return None
    return {
        "path": CPU_GATHER_PATHS[code],
        "output_bytes": output_bytes,
        "threads": threads,
        "seconds": {
            path: ns * 1e-9
            for path, ns in zip(CPU_GATHER_PATHS, nanoseconds, strict=True)
            if ns >= 0
        },
    }


def cpu_gather_calls(reset: bool = False) -> dict[str, dict[str, int]]:
    """How many CPU gathers (``gather_rows``, and ``ngram_gather_rows``' gathers) ran each path
    since the last reset, ``{"path": {path: n}, "fp8_lookup": {lookup: n}}`` (fp8 tables: the
    lookup that converted them, see :func:`cpu_gather_fp8_lookup`), whichever thread ran them;
    with ``reset`` the counts then start again from zero. The bench reports from these which
    path its timed calls took."""
    counts = torch.ops.qwen4exp.cpu_gather_calls(reset)
    paths = len(CPU_GATHER_PATHS)
    return {
        "path": dict(zip(CPU_GATHER_PATHS, counts[:paths], strict=True)),
        "fp8_lookup": dict(zip(_GATHER_FP8_LOOKUPS, counts[paths:], strict=True)),
    }


_GATHER_FP8_LOOKUPS = ("scalar", "avx2", "avx512")  # the kernel's codes 0, 1 and 2


def cpu_gather_fp8_lookup() -> str:
    """How the CPU ``gather_rows`` converts fp8 rows: ``"avx512"`` (AVX-512BW permutes over the
    256 outputs), ``"avx2"`` (byte shuffles, for 16-bit outputs whose outputs factor, see
    csrc/cpu/row_convert.h; an element at a time otherwise) or ``"scalar"`` (an element at a
    time). By default the widest this CPU has; :func:`set_cpu_gather_fp8_lookup` pins one, so
    that each can be tested on one machine. Same values either way."""
    return _GATHER_FP8_LOOKUPS[torch.ops.qwen4exp.cpu_gather_fp8_lookup()]


def set_cpu_gather_fp8_lookup(lookup: str | None) -> str | None:
    """Pins the CPU gather's fp8 conversion to ``"scalar"``, ``"avx2"`` or ``"avx512"`` (None:
    the widest this CPU has) for the whole process; returns the setting it replaces. A lookup
    this CPU or build lacks raises ValueError."""
    if lookup is not None and lookup not in _GATHER_FP8_LOOKUPS:
        raise ValueError(
            "set_cpu_gather_fp8_lookup: lookup must be 'scalar', 'avx2', 'avx512' or None, got "
            f"{lookup!r}"
        )
    code = -1 if lookup is None else _GATHER_FP8_LOOKUPS.index(lookup)
    previous = torch.ops.qwen4exp.set_cpu_gather_fp8_lookup(code)
    return None if previous < 0 else _GATHER_FP8_LOOKUPS[previous]


_CONV_SILU_LOOKUPS = ("loop", "gather")  # the kernel's codes 0 and 1


def cpu_conv_silu_lookup() -> str:
    """How the CPU ``ple_conv`` looks up the SiLU of a bf16/fp16 sum in its 65536-entry table:
    ``"loop"`` (one load per element) or ``"gather"`` (AVX-512 gathers, where the CPU has them).
    By default the first call (of this or of a 16-bit conv) times both on this CPU and keeps the
    faster; :func:`set_cpu_conv_silu_lookup` pins one. Same values either way."""
    return _CONV_SILU_LOOKUPS[torch.ops.qwen4exp.cpu_conv_silu_lookup()]


def set_cpu_conv_silu_lookup(lookup: str | None) -> str | None:
    """Pins the CPU conv's SiLU lookup to ``"loop"`` or ``"gather"`` (None: the timed default)
    for the whole process; returns the setting it replaces. ``"gather"`` raises ValueError where
    the CPU or build has no AVX-512."""
    if lookup is not None and lookup not in _CONV_SILU_LOOKUPS:
        raise ValueError(
            f"set_cpu_conv_silu_lookup: lookup must be 'loop', 'gather' or None, got {lookup!r}"
        )
    code = -1 if lookup is None else _CONV_SILU_LOOKUPS.index(lookup)
    previous = torch.ops.qwen4exp.set_cpu_conv_silu_lookup(code)
    return None if previous < 0 else _CONV_SILU_LOOKUPS[previous]


_NGRAM_HASH_ISAS = ("scalar", "avx2", "avx512")  # the kernel's codes 0, 1 and 2


def cpu_ngram_hash_isa() -> str:
    """How the CPU ``ngram_ids`` (and the fused ``ngram_gather_rows``) reduces each head's hash
    modulo its size: ``"avx512"`` (8 heads a step, AVX-512F and DQ), ``"avx2"`` (4) or
    ``"scalar"`` (one at a time). By default the widest this CPU has;
    :func:`set_cpu_ngram_hash_isa` pins one, so that each can be tested on one machine. Same ids
    either way."""
    return _NGRAM_HASH_ISAS[torch.ops.qwen4exp.cpu_ngram_hash_isa()]


def set_cpu_ngram_hash_isa(isa: str | None) -> str | None:
    """Pins the CPU n-gram hash to ``"scalar"``, ``"avx2"`` or ``"avx512"`` (None: the widest
    this CPU has) for the whole process; returns the setting it replaces. A width this CPU or
    build lacks raises ValueError, naming it."""
    if isa is not None and isa not in _NGRAM_HASH_ISAS:
        raise ValueError(
            f"set_cpu_ngram_hash_isa: isa must be 'scalar', 'avx2', 'avx512' or None, got {isa!r}"
        )
    code = -1 if isa is None else _NGRAM_HASH_ISAS.index(isa)
    previous = torch.ops.qwen4exp.set_cpu_ngram_hash_isa(code)
    return None if previous < 0 else _NGRAM_HASH_ISAS[previous]


_HC_DOTS = ("fp32", "bf16")  # the kernel's codes 0 and 1


def cpu_hc_dot() -> str:
    """How the fused hyper-connection projections' CPU kernels (``ops.hc_up_gate_mix``,
    ``ops.hc_down_silu_inject``) take the dots of bf16 data: ``"bf16"`` (AVX512-BF16's
    vdpbf16ps, 32 products an instruction; x86-64 CPUs that have it) or ``"fp32"`` (fp32 FMAs
    after widening; every CPU, and always for fp32/fp16 data). By default ``"bf16"`` where the
    CPU has it; :func:`set_cpu_hc_dot` pins one, so that both can be tested on one machine. The
    two sum the dots in different orders: both within the ops' stated tolerance."""
    return _HC_DOTS[torch.ops.qwen4exp.cpu_hc_dot()]


def set_cpu_hc_dot(dot: str | None) -> str | None:
    """Pins the fused HC projections' CPU dots to ``"fp32"`` or ``"bf16"`` (None: the default)
    for the whole process; returns the setting it replaces. ``"bf16"`` on a CPU or build without
    AVX512-BF16 raises ValueError."""
    if dot is not None and dot not in _HC_DOTS:
        raise ValueError(f"set_cpu_hc_dot: dot must be 'fp32', 'bf16' or None, got {dot!r}")
    code = -1 if dot is None else _HC_DOTS.index(dot)
    previous = torch.ops.qwen4exp.set_cpu_hc_dot(code)
    return None if previous < 0 else _HC_DOTS[previous]


def cpu_fresh_output_bytes() -> int:
    """The size in bytes from which a CPU op's output allocated by the op (``ple_gate``'s two
    outputs; ``gather_rows``', ``ngram_gather_rows``' and ``ngram_ids``' without ``output=``) is a
    mapping of its own made resident cheaply before the kernel writes it (2 MiB huge pages or a
    parallel populate, :func:`cpu_fresh_output_mode`), instead of torch's allocator, whose large
    blocks fault in 4 KiB at a time (csrc/torch/fresh_output.h). Default 32 MiB (glibc's largest
    mmap threshold: below it glibc may reuse memory that is already resident); another comes
    from :func:`set_cpu_fresh_output_bytes`. Same values either way."""
    return _fresh_output_bytes


def set_cpu_fresh_output_bytes(fresh_bytes: int | None) -> int | None:
    """Sets the size :func:`cpu_fresh_output_bytes` reports (0: every fresh output is mapped;
    a size past any output: never, torch's allocator as before; None: the default) for the
    whole process; returns the setting it replaces."""
    global _fresh_output_bytes
    if fresh_bytes is not None and (
        isinstance(fresh_bytes, bool)
        or not isinstance(fresh_bytes, int)
        or not 0 <= fresh_bytes <= _switches.INT64_MAX
    ):
        raise ValueError(
            "set_cpu_fresh_output_bytes: fresh_bytes must be an int >= 0 or None (at most "
            f"{_switches.INT64_MAX}), got {fresh_bytes!r}"
        )
    previous = torch.ops.qwen4exp.set_cpu_fresh_output_bytes(
        -1 if fresh_bytes is None else fresh_bytes
    )
    # The doors in ops.py compare an output's size with this copy (no op call at decode); the
    # kernel's setting stays the one source, read back here.
    _fresh_output_bytes = int(torch.ops.qwen4exp.cpu_fresh_output_bytes())
    return None if previous < 0 else int(previous)


_FRESH_OUTPUT_MODES = ("huge_pages", "populate")  # the kernel's codes 0 and 1


def cpu_fresh_output_mode() -> str:
    """How a fresh output of :func:`cpu_fresh_output_bytes` or more is made resident:
    ``"huge_pages"`` (advised ``MADV_HUGEPAGE`` while untouched, so the kernel's threads fault it
    in 2 MiB at a time) or ``"populate"`` (``MADV_POPULATE_WRITE`` in 2 MiB chunks on the op's
    threads, 4 KiB pages without a fault each). By default huge pages, unless transparent huge
    pages are ``never`` here; :func:`set_cpu_fresh_output_mode` pins one. Same values either
    way."""
    return _FRESH_OUTPUT_MODES[torch.ops.qwen4exp.cpu_fresh_output_mode()]


def set_cpu_fresh_output_mode(mode: str | None) -> str | None:
    """Pins :func:`cpu_fresh_output_mode` to ``"huge_pages"`` or ``"populate"`` (None: the
    default, from /sys/kernel/mm/transparent_hugepage/enabled) for the whole process; returns
    the setting it replaces."""
    if mode is not None and mode not in _FRESH_OUTPUT_MODES:
        raise ValueError(
            "set_cpu_fresh_output_mode: mode must be 'huge_pages', 'populate' or None, got "
            f"{mode!r}"
        )
    code = -1 if mode is None else _FRESH_OUTPUT_MODES.index(mode)
    previous = torch.ops.qwen4exp.set_cpu_fresh_output_mode(code)
    return None if previous < 0 else _FRESH_OUTPUT_MODES[previous]


def cpu_fresh_output_cache_bytes() -> int:
    """The most bytes of released fresh-output mappings kept for reuse. A fresh output's mapping
    (:func:`cpu_fresh_output_bytes`), when its tensor is freed, stays mapped and resident in a
    cache, as torch's CUDA caching allocator keeps freed device blocks; the next fresh output
    that fits (a mapping of at least its size and under twice it) takes it as it is, without the
    kernel zeroing and faulting in every page again (with ``ple_gate`` at prefill, 1.4x to 1.8x
    the ``out=`` call without it). Its contents are then a former output's, as ``torch.empty``'s
    may be; every op writes all of its output. Past this cap the oldest mappings are unmapped.
    Default 512 MiB (``ple_gate``'s two outputs at T = 8192, 320 MiB, with a prefill gather's
    beside them), at most an eighth of RAM; 0: no cache. Per process: a forked child starts with
    an empty cache. Set by :func:`set_cpu_fresh_output_cache_bytes`, or
    ``QWEN4EXP_CPU_FRESH_OUTPUT_CACHE_BYTES`` in the environment when the package is imported.
    Same values either way."""
    return int(torch.ops.qwen4exp.cpu_fresh_output_cache_bytes())


def set_cpu_fresh_output_cache_bytes(cache_bytes: int | None) -> int | None:
    """Sets :func:`cpu_fresh_output_cache_bytes` for the whole process (0: no cache; None: the
    default) and unmaps, oldest first, what the cache holds past it; returns the setting it
    replaces (None: the default)."""
    if cache_bytes is not None and (
        isinstance(cache_bytes, bool)
        or not isinstance(cache_bytes, int)
        or not 0 <= cache_bytes <= _switches.INT64_MAX
    ):
        raise ValueError(
            "set_cpu_fresh_output_cache_bytes: cache_bytes must be an int >= 0 or None (at most "
            f"{_switches.INT64_MAX}), got {cache_bytes!r}"
        )
    previous = torch.ops.qwen4exp.set_cpu_fresh_output_cache_bytes(
        -1 if cache_bytes is None else cache_bytes
    )
    return None if previous < 0 else int(previous)


def fresh_output_cache_held() -> tuple[int, int]:
    """What the cache of :func:`cpu_fresh_output_cache_bytes` holds now: (bytes, mappings)."""
    held_bytes, mappings = torch.ops.qwen4exp.fresh_output_cache_held()
    return int(held_bytes), int(mappings)


def empty_fresh_output_cache() -> int:
    """Unmaps every mapping the fresh-output cache holds (:func:`cpu_fresh_output_cache_bytes`),
    giving its memory back to the system; returns the bytes unmapped. Outputs still alive are
    not touched: their mappings join the cache when they are freed."""
    return int(torch.ops.qwen4exp.empty_fresh_output_cache())


_fresh_output_bytes = int(torch.ops.qwen4exp.cpu_fresh_output_bytes())

_stream_bytes_from_env = _switches.cpu_gather_stream_bytes_from_env()
if _stream_bytes_from_env is not None:
    set_cpu_gather_stream_bytes(_stream_bytes_from_env)
_cache_bytes_from_env = _switches.cpu_fresh_output_cache_bytes_from_env()
if _cache_bytes_from_env is not None:
    set_cpu_fresh_output_cache_bytes(_cache_bytes_from_env)
