"""Command line of ``qwen4exp-bench`` / ``python -m qwen4exp_ext.bench``.

For every case of every selected op: check ours against the reference (exact equality), then time
ours, the reference and a same-traffic ``copy_`` side by side, print one table row (with the
case's compulsory bytes, its minimum time at the HBM peak of each GPU in ``PEAK_TBPS``, and on a
listed GPU the % of that GPU's datasheet peak that ours reaches), and optionally
write everything to JSON tagged with the device, torch version, build info and date, so results
from different machines and commits can be compared later. After an op's cases come its untimed
sections (``registry.Section``: e.g. gather's pinned bytes per table format), printed as small
tables of their own and written to the JSON under "sections".
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import qwen4exp_ext
from qwen4exp_ext import ops
from qwen4exp_ext.bench.registry import OP_MODULES, Case, Section, load_cases, load_sections
from qwen4exp_ext.bench.timing import roofline_copy, time_interleaved

DEFAULT_REPEAT = 500
QUICK_REPEAT = 10
# Without --repeat, each case gets as many rounds as fit this many seconds (MIN_REPEAT to
# DEFAULT_REPEAT): the eager references of the big shapes take seconds per call on a CPU, the
# kernels microseconds, and a fixed count would make the default run take hours.
CASE_BUDGET_S = 4.0
MIN_REPEAT = 5

# The memory roofline of the GPUs users serve on: datasheet HBM bandwidth, TB/s. A case's
# minimum time on one is its compulsory bytes at that bandwidth.
PEAK_TBPS = {"MI300X": 5.3, "MI325X": 6.0, "MI355X": 8.0, "H200": 4.8}

COLUMNS = (
    ("op", 10, "s"),
    ("case", 18, "s"),
    ("T", 6, "d"),
    ("ours p50 µs", 12, ".2f"),
    ("ref p50 µs", 12, ".2f"),
    ("speedup", 8, ".2f"),
    ("tokens/s", 9, "si"),
    ("GB/s", 8, ".3g"),
    ("% copy", 7, ".1f"),
    ("MB", 8, ".4g"),
    *((f"{gpu} µs", 10, ".3g") for gpu in PEAK_TBPS),
    ("% peak", 7, "rs"),  # a right-aligned text: "-" where there is no listed GPU
)


class CheckFailed(Exception):
    """Our kernel disagrees with the reference on a case; timing a wrong kernel means nothing."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if a check fails (argparse exits 2 on bad usage)."""
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in OP_MODULES]
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OP_MODULES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA/ROCm device")
    if args.repeat is not None and args.repeat < 1:
        parser.error("--repeat must be >= 1")
    device = torch.device(
        "cuda"
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    repeat: int | None = args.repeat or (QUICK_REPEAT if args.quick else None)
    # A tenth of the run, at least two rounds: enough to settle caches, clocks and the allocator.
    # (With repeat=None each case warms up and sizes its own run: _auto_repeat.)
    warmup = max(2, repeat // 10) if repeat is not None else 2

    shown = repeat if repeat is not None else f"auto ({CASE_BUDGET_S:g} s per case)"
    print(
        f"device: {_device_name(device)} ({device.type}), torch {torch.__version__}, "
        f"repeat {shown}, warmup {warmup}"
    )
    print(_row([name for name, _, _ in COLUMNS], header=True))
    results = []
    sections: list[dict[str, Any]] = []
    for op in args.ops or list(OP_MODULES):
        for case in load_cases(op, device):
            try:
                result = _run_case(case, device, warmup, repeat, args.check)
            except CheckFailed as err:
                print(f"CHECK FAILED {case.op}/{case.name}: {err}", file=sys.stderr)
                return 1
            results.append(result)
            print(_row(_table_values(result)), flush=True)
        for section in load_sections(op, device):
            print(_section_text(section), flush=True)
            sections.append(
                {k: getattr(section, k) for k in ("op", "name", "note")}
                | {"rows": [dict(r) for r in section.rows]}
            )

    if args.json is not None:
        report = {
            **_environment(device),
            "repeat": shown,
            "warmup": warmup,
            "results": results,
            "sections": sections,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen4exp-bench",
        description="Time qwen4exp_ext kernels against the eager reference, side by side, "
        "and against a same-run copy of the same bytes (the memory roofline).",
    )
    # Validated by hand: argparse rejects an empty nargs="*" list against choices on Python 3.11.
    parser.add_argument(
        "ops", nargs="*", metavar="OP", help=f"ops to run (default: all): {', '.join(OP_MODULES)}"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto = cuda (CUDA or ROCm) if available, else cpu",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results as JSON")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REPEAT} repetitions: a smoke run for tests and CI",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help=f"timed calls per contender (default: as many as fit {CASE_BUDGET_S:g} s per case, "
        f"{MIN_REPEAT} to {DEFAULT_REPEAT})",
    )
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="assert ours == reference on each case before timing",
    )
    return parser


def _auto_repeat(fns: dict[str, Any], device: torch.device, warmup: int) -> int:
    """Runs the warm-up rounds and returns how many rounds fit CASE_BUDGET_S (timed on the last
    warm-up round), clamped to [MIN_REPEAT, DEFAULT_REPEAT]."""
    round_s = 0.0
    for _ in range(warmup):
        start = time.perf_counter()
        for fn in fns.values():
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        round_s = time.perf_counter() - start
    return max(MIN_REPEAT, min(DEFAULT_REPEAT, int(CASE_BUDGET_S / max(round_s, 1e-9))))


def _run_case(
    case: Case, device: torch.device, warmup: int, repeat: int | None, check: bool
) -> dict[str, Any]:
    if check:
        _check(case)
    copy, copy_bytes = roofline_copy(case.nbytes, device)
    fns = {"ours": case.ours, "ref": case.ref, "copy": copy}
    if repeat is None:
        repeat = _auto_repeat(fns, device, warmup)
        warmup = 0  # done
    times = time_interleaved(fns, device, warmup, repeat)
    ours, ref, copy_t = times["ours"], times["ref"], times["copy"]
    gbps = {
        "ours": case.nbytes / (ours.p50_us * 1e3),
        "ref": case.nbytes / (ref.p50_us * 1e3),
        "copy": copy_bytes / (copy_t.p50_us * 1e3),
    }
    return {
        "op": case.op,
        "case": case.name,
        "tokens": case.tokens,
        "params": dict(case.params),
        "check": True if check else None,
        "ours": asdict(ours),
        "ref": asdict(ref),
        "copy": asdict(copy_t),
        "speedup": ref.p50_us / ours.p50_us,
        "tokens_per_s": {
            "ours": case.tokens / (ours.p50_us * 1e-6),
            "ref": case.tokens / (ref.p50_us * 1e-6),
        },
        "bytes": case.nbytes,
        "copy_bytes": copy_bytes,
        "gbps": gbps,
        "pct_of_copy": 100.0 * gbps["ours"] / gbps["copy"],
        "roofline_us": {gpu: case.nbytes / (tbps * 1e6) for gpu, tbps in PEAK_TBPS.items()},
        "pct_of_peak": _pct_of_peak(gbps["ours"], device),
    }


def _peak_tbps(device: torch.device) -> float | None:
    """The datasheet bandwidth of the GPU this runs on, where it is one of PEAK_TBPS's."""
    if device.type != "cuda":
        return None
    name = _device_name(device).upper().replace(" ", "")
    return next((tbps for gpu, tbps in PEAK_TBPS.items() if gpu in name), None)


def _pct_of_peak(gbps: float, device: torch.device) -> float | None:
    """Our effective bandwidth as a % of the running GPU's datasheet peak (None on a CPU or an
    unlisted GPU)."""
    peak = _peak_tbps(device)
    return None if peak is None else 100.0 * gbps / (peak * 1e3)


def _check(case: Case) -> None:
    if case.check is not None:
        problem = case.check()
        if problem is not None:
            raise CheckFailed(problem)
        return
    ours, ref = case.ours(), case.ref()
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        raise CheckFailed(
            f"ours is {ours.dtype}{list(ours.shape)}, reference is {ref.dtype}{list(ref.shape)}"
        )
    if not torch.equal(ours, ref):
        bad = (ours != ref).nonzero()
        first = tuple(bad[0].tolist())
        raise CheckFailed(
            f"{bad.shape[0]} of {ref.numel()} elements differ; first at {first}: "
            f"ours {ours[first].item()}, reference {ref[first].item()}"
        )


def _environment(device: torch.device) -> dict[str, Any]:
    build_info = getattr(qwen4exp_ext, "build_info", None)
    return {
        "device": _device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "torch_gpu_runtime": torch.version.hip or torch.version.cuda,
        "threads": torch.get_num_threads(),
        "build_info": build_info() if callable(build_info) else None,
        # Outputs of at least this many bytes take the CPU gather's streaming path (-1: none).
        "cpu_gather_stream_bytes": ops.cpu_gather_stream_bytes(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _table_values(result: dict[str, Any]) -> list[object]:
    return [
        result["op"],
        result["case"],
        result["tokens"],
        result["ours"]["p50_us"],
        result["ref"]["p50_us"],
        result["speedup"],
        result["tokens_per_s"]["ours"],
        result["gbps"]["ours"],
        result["pct_of_copy"],
        result["bytes"] / 1e6,
        *(result["roofline_us"][gpu] for gpu in PEAK_TBPS),
        "-" if result["pct_of_peak"] is None else f"{result['pct_of_peak']:.1f}",
    ]


def _row(values: Sequence[object], header: bool = False) -> str:
    cells = []
    for value, (_, width, fmt) in zip(values, COLUMNS, strict=True):
        if header:
            text = str(value)
        elif fmt == "si":
            text = _si(float(value))
        elif fmt == "rs":
            text = str(value)
        else:
            text = format(value, fmt)
        cells.append(text.ljust(width) if fmt == "s" else text.rjust(width))
    return " ".join(cells)


def _si(x: float) -> str:
    """4.1M rather than 4096000.0: tokens/s spans six orders of magnitude across cases."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g}{suffix}"
    return f"{x:.3g}"


def _section_text(section: Section) -> str:
    """The section's note, then its columns as a table (first column left-aligned)."""
    lines = [[header for _, header in section.columns]]
    lines += [[_cell(key, row[key]) for key, _ in section.columns] for row in section.rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(section.columns))]
    text = [f"{section.op} {section.name}: {section.note}"]
    for line in lines:
        cells = [c.rjust(w) for c, w in zip(line, widths, strict=True)]
        cells[0] = line[0].ljust(widths[0])
        text.append("  ".join(cells))
    return "\n".join(text)


def _cell(key: str, value: object) -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        return _bytes_text(value)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _bytes_text(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"
