"""Which kernel serves each swapped vLLM op, per shape class: ours or vLLM's own, measured.

The plugin swaps vLLM's PLE and hyper-connection kernels for ours in every process. Ours are
not faster everywhere (op, shape, GPU), so on the first eager call of each *shape class* of an
op the replacement in :mod:`.shims` asks :func:`choose`; when no choice is known yet it calls
:func:`decide`, which times our kernel and vLLM's original on copies of the live arguments
(every tensor the op writes is copied, so the live state is never touched twice), a few calls
each with device events after one warm-up call, and keeps the faster; a tie goes to vLLM's.
The live call is then made once, by the chosen kernel. After that the class costs one dict
lookup.

Shape classes (:func:`token_bucket`): the token count T falls in a power-of-two bucket
(T <= 1, 2, 4, ..., 8192, then one bucket above); with vLLM's CUDA graph sizes (1, 2, 4, 8, 16,
24, ..., 512) and its default chunked-prefill budget (8192 tokens), that separates decode-sized
from prefill-sized batches and bounds the timing to about 15 classes per op and format, while a
kernel's relative speed, which follows occupancy, changes within a bucket by at most a factor
of two in T. Each op adds what changes the kernel: dtype, row width, table format (unquantized,
FP8, NVFP4; device or pinned), the conv mode, state layout, dilation and fused residual; for the
hyper-connection ops the stream count, the norm weight's dtype and layout (shared or per branch)
and whether there are injection logits.
One choice is not between kernels: ``disk_offload_rows`` (vLLM 0.34's disk-offloaded FP8/NVFP4
tables, :mod:`.shims.disk_offload_step`) is our CPU gather decoding the step's rows on the host
and its copy of activation rows, against vLLM's copy of the raw rows and its device decode, timed
on the step's own rows in the forward of the class's first eager step (that step stages raw rows).

When nothing is timed:

- while a CUDA/HIP graph is captured: the choice made in vLLM's eager warm-up is used, and a
  class first seen during capture runs vLLM's kernel (nothing recorded, so a later eager call
  of that class still measures);
- under torch.compile tracing: the same;
- on a device vLLM's Triton kernels do not run on (a CPU tensor): ours.

``QWEN4EXP_VLLM_KERNELS`` (read once per process): ``auto`` (the default; measured on a GPU,
ours on the CPU), ``ours`` or ``vllm`` (every swapped op, no timing). ``vllm`` leaves the
plugin's other work in place (exact-size pinned tables, NVFP4 on ROCm, the step-entry
lookups of :mod:`.prefetch`, which need our gather).

The choices are logged once in vLLM's log as a table (op, class, ours µs, vLLM µs, chosen),
at the first call that reuses a choice or the first call under capture, whichever comes first;
a choice made after that is logged as one line. They are persisted as JSON in
``$QWEN4EXP_VLLM_CHOICE_CACHE`` (a file; an off word of the package's on/off variables, ``0``,
``off``, ``false``, ``no`` or empty: no file; an on word: the default), by default
``${XDG_CACHE_HOME:-~/.cache}/qwen4exp_ext/vllm_kernel_choices.json``, under a key of the GPU
name, the driver, torch, vLLM and qwen4exp_ext versions: a later process with the same key
takes its choices from the file without timing; any other key ignores the file's choices and
replaces them when it saves. Writes are atomic (a temporary file in the same folder, then
``os.replace``), and merge the choices other processes of the same key saved meanwhile.

The file is read only if it is a regular file of at most :data:`MAX_CACHE_BYTES` (a FIFO would
block the open, ``/dev/zero`` never ends), and its choices are used only if every field has its
type (:func:`_checked`); :meth:`Chooser.decide` never raises for the file. What cannot be used is
said once per process, as a warning in vLLM's log, and then: a path that is no regular file,
cannot be opened or is too large is left as it is and nothing is persisted; a file whose
contents are no valid cache (not UTF-8 JSON, another format, a field of the wrong type, a time
that is not a finite number) is ignored and replaced at the next save.

Both kernels compute the same contract (the :mod:`.shims` docstring lists where ours and
vLLM's differ), so a choice changes speed, never results beyond those known differences.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import statistics
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _switches

__all__ = [
    "AUTO",
    "CACHE_ENV",
    "ENV",
    "OURS",
    "VLLM",
    "Choice",
    "Chooser",
    "chooser",
    "choose",
    "decide",
    "event_timer",
    "reset",
    "token_bucket",
]

ENV = "QWEN4EXP_VLLM_KERNELS"
CACHE_ENV = "QWEN4EXP_VLLM_CHOICE_CACHE"
AUTO, OURS, VLLM = "auto", "ours", "vllm"
MODES = (AUTO, OURS, VLLM)
# Timed calls per kernel (after one untimed warm-up call, which also JIT-compiles vLLM's
# Triton kernel for these arguments); the median is kept.
CALLS = 5
# The largest bucket bound; every T above it is one class.
MAX_BUCKET = 8192
FILE_FORMAT = 1
# The largest cache file read: a choice takes ~150 bytes, so thousands fit; a larger file is not
# one of ours.
MAX_CACHE_BYTES = 1 << 22

logger = logging.getLogger("vllm.qwen4exp_ext")

# timer(op, label, which, setup, call) -> µs per call: ``setup()`` makes fresh arguments (copies
# of everything the op writes) outside the timed span, ``call(args)`` runs one kernel on them.
Timer = Callable[[str, str, str, Callable[[], Any], Callable[[Any], Any]], float]


def token_bucket(tokens: int) -> int:
    """The bucket of a token count: the smallest power of two >= ``tokens`` (1 for 0 and 1),
    and ``MAX_BUCKET + 1`` for every count above ``MAX_BUCKET``."""
    if tokens > MAX_BUCKET:
        return MAX_BUCKET + 1
    return 1 << max(tokens - 1, 0).bit_length()


def _bucket_text(bucket: int) -> str:
    return f"T>{MAX_BUCKET}" if bucket > MAX_BUCKET else f"T<={bucket}"


def class_label(cls: tuple) -> str:
    """A class as text: its fields, a dtype without ``torch.``, the bucket last as T<=n."""
    parts = []
    for i, field in enumerate(cls):
        if i == len(cls) - 1 and isinstance(field, int):
            parts.append(_bucket_text(field))
        elif isinstance(field, torch.dtype):
            parts.append(str(field).removeprefix("torch."))
        else:
            parts.append(str(field))
    return " ".join(parts)


def copy_for_timing(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` with its very sizes and strides (a state cache that is a strided
    view of a larger buffer keeps its layout), on its device."""
    out = torch.empty_strided(
        tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device
    )
    out.copy_(tensor)
    return out


def event_timer(
    op: str,
    label: str,
    which: str,
    setup: Callable[[], Any],
    call: Callable[[Any], Any],
    calls: int = CALLS,
) -> float:
    """µs per call of ``call``: one warm-up call, then ``calls`` calls, each on fresh
    ``setup()`` arguments, timed with device events on the current stream (wall clock on the
    CPU); the median. A kernel that raises counts as infinitely slow."""
    try:
        call(setup())
        times: list[float] = []
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            pairs = []
            for _ in range(calls):
                args = setup()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                call(args)
                end.record()
                pairs.append((start, end, args))
            pairs[-1][1].synchronize()
            times = [start.elapsed_time(end) * 1000.0 for start, end, _ in pairs]
        else:
            import time

            for _ in range(calls):
                args = setup()
                t0 = time.perf_counter()
                call(args)
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run loses
        logger.debug("qwen4exp_ext: timing %s %s %s failed: %s", op, label, which, exc)
        return math.inf


@dataclass
class Choice:
    op: str
    label: str
    ours_us: float
    vllm_us: float
    chosen: str
    source: str = "timed"  # or "cached" (from the persisted file)


def _driver_version() -> str:
    for path, pick in (
        ("/proc/driver/nvidia/version", lambda text: text.split("Module", 1)[1].split()[0]),
        ("/sys/module/amdgpu/version", lambda text: text.strip()),
    ):
        try:
            text = Path(path).read_text()
            return f"{'nvidia' if 'nvidia' in path else 'amdgpu'} {pick(text)}"
        except (OSError, IndexError):
            continue
    return "unknown"


def key_fields(device: torch.device) -> dict[str, str]:
    """What a persisted choice is valid for: the GPU, its driver, torch, vLLM, qwen4exp_ext."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        vllm_version = "none"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "gpu": gpu,
        "driver": _driver_version(),
        "torch": str(torch.__version__),
        "vllm": vllm_version,
        "qwen4exp_ext": __version__,
    }


def default_cache_path() -> Path | None:
    """``$QWEN4EXP_VLLM_CHOICE_CACHE``: None for an off word (no file), the default path for an
    on word or where it is unset or empty (as every variable), else the path it names."""
    value = os.environ.get(CACHE_ENV, "")
    word = value.strip().lower()
    if word in _switches.FALSE_WORDS:
        return None
    if word and word not in _switches.TRUE_WORDS:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qwen4exp_ext" / "vllm_kernel_choices.json"


def _busy_device(device: torch.device) -> bool:
    """True while nothing may be timed: torch.compile tracing, or a graph capture on the
    current stream (asked only where a CUDA driver answers)."""
    if torch.compiler.is_compiling():
        return True
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


class Chooser:
    """The choices of one process. ``timer``, ``key`` (device -> key fields), ``cache_path``
    and ``timed_device_types`` are injectable (tests time CPU kernels with a fake timer)."""

    def __init__(
        self,
        *,
        timer: Timer | None = None,
        key: Callable[[torch.device], dict[str, str]] | None = None,
        cache_path: Path | None | str = "default",
        timed_device_types: frozenset[str] = frozenset({"cuda"}),
    ) -> None:
        self.timer: Timer = timer if timer is not None else event_timer
        self.key = key if key is not None else key_fields
        self.cache_path = default_cache_path() if cache_path == "default" else cache_path
        self.timed_device_types = timed_device_types
        self.choices: dict[tuple[str, tuple], Choice] = {}
        self._mode: str | None = None
        self._persisted: dict[str, dict[str, Any]] | None = None  # label key -> entry
        self._key: dict[str, str] | None = None
        self.logged = False
        self._cache_warned = False  # the cache's one warning was given
        self._lock = threading.RLock()

    # ---- the switch ----

    def mode(self) -> str:
        if self._mode is None:
            value = os.environ.get(ENV, AUTO).strip().lower() or AUTO
            if value not in MODES:
                logger.warning(
                    "qwen4exp_ext vLLM plugin: %s=%r is not one of %s; using auto",
                    ENV,
                    value,
                    "|".join(MODES),
                )
                value = AUTO
            self._mode = value
        return self._mode

    # ---- the hot path ----

    def choose(self, op: str, cls: tuple, device: torch.device) -> str | None:
        """The kernel for this call (OURS or VLLM), or None: measure it with :meth:`decide`."""
        mode = self._mode if self._mode is not None else self.mode()
        if mode != AUTO:
            return mode
        if device.type not in self.timed_device_types:
            return OURS
        got = self.choices.get((op, cls))
        if got is not None:
            if not self.logged and not torch.compiler.is_compiling():
                self.log_table()
            return got.chosen
        if _busy_device(device):
            if not self.logged and self.choices and not torch.compiler.is_compiling():
                self.log_table()
            return VLLM
        return None

    # ---- the first call of a class ----

    def decide(
        self,
        op: str,
        cls: tuple,
        device: torch.device,
        setup: Callable[[], Any],
        ours: Callable[[Any], Any],
        vllm: Callable[[Any], Any],
    ) -> str:
        """Measures (or reads from the persisted file) and records the choice of a class."""
        with self._lock:
            got = self.choices.get((op, cls))
            if got is not None:
                return got.chosen
            label = class_label(cls)
            entry = self._load(device).get(_entry_key(op, label))  # checked by _read
            if entry is not None:
                choice = Choice(
                    op,
                    label,
                    _from_json(entry.get("ours_us")),
                    _from_json(entry.get("vllm_us")),
                    entry["chosen"],
                    "cached",
                )
            else:
                ours_us = self.timer(op, label, OURS, setup, ours)
                vllm_us = self.timer(op, label, VLLM, setup, vllm)
                chosen = OURS if ours_us < vllm_us else VLLM  # a tie goes to vLLM's
                choice = Choice(op, label, ours_us, vllm_us, chosen)
            self.choices[(op, cls)] = choice
            if choice.source == "timed":
                self._save(device)
            if self.logged:
                logger.info("qwen4exp_ext vLLM plugin: kernel choice added: %s", _row_text(choice))
            return choice.chosen

    # ---- the log ----

    def table(self) -> str:
        rows = [_row_text(c) for c in self.choices.values()]
        head = f"  {'op':<22} {'class':<34} {'ours µs':>9} {'vLLM µs':>9}  chosen"
        return "\n".join([head, *rows])

    def log_table(self) -> None:
        with self._lock:
            if self.logged or not self.choices:
                return
            self.logged = True
            where = f" (persisted in {self.cache_path})" if self.cache_path is not None else ""
            logger.info(
                "qwen4exp_ext vLLM plugin: kernel choices, µs per call, ties to vLLM%s:\n%s",
                where,
                self.table(),
            )

    # ---- persistence ----

    def _key_for(self, device: torch.device) -> dict[str, str]:
        if self._key is None:
            self._key = self.key(device)
        return self._key

    def _cache_problem(self, message: str) -> None:
        """The cache file cannot be used: one warning per process (vLLM's log), then DEBUG."""
        level = logging.DEBUG if self._cache_warned else logging.WARNING
        self._cache_warned = True
        logger.log(level, "qwen4exp_ext vLLM plugin: %s (%s)", message, CACHE_ENV)

    def _read(self) -> tuple[dict[str, Any] | None, bool]:
        """The cache file's contents where they are a valid cache (else None), and whether a
        save may replace the file (not for a path that is no regular file, cannot be read or
        is too large)."""
        if self.cache_path is None:
            return None, False
        path = Path(self.cache_path)
        try:
            raw = _read_regular_file(path, MAX_CACHE_BYTES)
        except FileNotFoundError:
            return None, True
        except OSError as exc:
            self._cache_problem(f"cannot read the kernel-choice cache {path}: {exc}; not used")
            return None, False
        if not raw.strip():
            return None, True  # an empty file: a cache to be
        try:
            data = json.loads(raw.decode("utf-8"))
            bad = _checked(data)
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
            bad = f"it is no JSON ({type(exc).__name__}: {exc})"
        if bad is not None:
            self._cache_problem(
                f"ignoring the kernel-choice cache {path}: {bad}; it is replaced at the next save"
            )
            return None, True
        return data, True

    def _load(self, device: torch.device) -> dict[str, dict[str, Any]]:
        if self._persisted is None:
            data, _ = self._read()
            key = self._key_for(device)
            ok = data is not None and data.get("key") == key
            self._persisted = dict(data["choices"]) if ok else {}
        return self._persisted

    def _save(self, device: torch.device) -> None:
        if self.cache_path is None:
            return
        key = self._key_for(device)
        data, writable = self._read()
        if not writable:
            return  # said once by _read
        merged: dict[str, Any] = {}
        if data is not None and data.get("key") == key:
            # Only the fields of an entry, checked: anything else in another process's entry
            # (a NaN, deep nesting) must not reach json.dump.
            fields = ("op", "label", "ours_us", "vllm_us", "chosen")
            for name, entry in data["choices"].items():
                merged[name] = {field: entry.get(field) for field in fields}
        for choice in self.choices.values():
            if choice.source == "timed":
                entry = asdict(choice)
                del entry["source"]
                for field in ("ours_us", "vllm_us"):
                    entry[field] = entry[field] if _finite_number(entry[field]) else None
                merged[_entry_key(choice.op, choice.label)] = entry
        path = Path(self.cache_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(
                        {"format": FILE_FORMAT, "key": key, "choices": merged},
                        f,
                        indent=1,
                        sort_keys=True,
                        allow_nan=False,
                        default=str,
                    )
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (OSError, ValueError) as exc:
            self._cache_problem(f"cannot persist the kernel choices in {path}: {exc}")


def _read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes, else OSError.
    Opened without blocking, so that a FIFO is refused rather than waited on; read to at most
    ``limit`` + 1 bytes, so that a file growing meanwhile is refused too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise OSError(f"{path} is larger than {limit} bytes")
    finally:
        os.close(fd)


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


def _checked(data: Any) -> str | None:
    """What is wrong with a cache's fields (None: nothing): the format exactly the int
    FILE_FORMAT (not 1.0 or true), the key an object of strings, the choices an object of
    entries with op and label strings, chosen ours or vllm, and each time a finite number or
    null (never NaN or an infinity: they would make every later save fail)."""
    if not isinstance(data, dict):
        return f"it is a JSON {type(data).__name__}, not an object"
    fmt = data.get("format")
    if type(fmt) is not int or fmt != FILE_FORMAT:
        return f"its format is {fmt!r}, not {FILE_FORMAT}"
    key = data.get("key")
    if not isinstance(key, dict) or not all(isinstance(v, str) for v in key.values()):
        return "its key is not an object of strings"
    choices = data.get("choices")
    if not isinstance(choices, dict):
        return f"its choices are a {type(choices).__name__}, not an object"
    for name, entry in choices.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("op"), str)
            and isinstance(entry.get("label"), str)
            and entry.get("chosen") in (OURS, VLLM)
            and all(
                entry.get(f) is None or _finite_number(entry.get(f)) for f in ("ours_us", "vllm_us")
            )
        ):
            return (
                f"its choice {name!r} is not an object of op, label, ours_us and vllm_us (finite "
                "numbers or null) and chosen (ours or vllm)"
            )
    return None


def _from_json(value: Any) -> float:
    """A persisted time: a number, or null for a kernel that could not run."""
    return float(value) if isinstance(value, (int, float)) else math.inf


def _entry_key(op: str, label: str) -> str:
    return f"{op} | {label}"


def _us(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2f}"


def _row_text(c: Choice) -> str:
    chosen = c.chosen + (" (cached)" if c.source == "cached" else "")
    return f"  {c.op:<22} {c.label:<34} {_us(c.ours_us):>9} {_us(c.vllm_us):>9}  {chosen}"


_CHOOSER = Chooser()


def chooser() -> Chooser:
    return _CHOOSER


def reset(**kwargs: Any) -> Chooser:
    """A fresh chooser for this process (``QWEN4EXP_VLLM_KERNELS`` read again); the keyword
    arguments are :class:`Chooser`'s. For tests."""
    global _CHOOSER
    _CHOOSER = Chooser(**kwargs)
    return _CHOOSER


def choose(op: str, cls: tuple, device: torch.device) -> str | None:
    return _CHOOSER.choose(op, cls, device)


def decide(
    op: str,
    cls: tuple,
    device: torch.device,
    setup: Callable[[], Any],
    ours: Callable[[Any], Any],
    vllm: Callable[[Any], Any],
) -> str:
    return _CHOOSER.decide(op, cls, device, setup, ours, vllm)
