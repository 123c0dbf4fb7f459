"""Command line of ``qwen4exp-bench`` / ``python -m qwen4exp_ext.bench``.

For every case of every selected op, at each thread count of ``--threads``
(``torch.set_num_threads``, restored afterwards): check ours against the oracle (``reference.py``)
and against every baseline (what a user would run without our kernel; see ``registry.Case``), then
time ours, the oracle, the baselines and a same-traffic ``copy_`` side by side in one interleaved
loop, print one table row (the headline baseline and the speedup over it, the speedup over vLLM's
own code where the case names a ``vllm`` baseline, the oracle's time, the case's compulsory bytes,
its minimum time at the HBM peak of each GPU in ``PEAK_TBPS``, and on a listed GPU the % of that
GPU's datasheet peak that ours reaches), and optionally write everything to JSON tagged with the
device, torch version, build info and date, so results from different machines and commits can be
compared later; ``--append`` adds one JSON line per case result and thread count to a results
file (``results/bench.jsonl`` by default; the row's fields: ``rows.ROW_FIELDS``); ``--csv``
writes one row per case and thread count, ``--plot`` a PNG of the % of copy bandwidth. After an
op's cases come its untimed sections (``registry.Section``: e.g. gather_rows' pinned bytes per
table format), printed as small tables of their own and written to the JSON under "sections". A
progress line on stderr names the case being checked and timed (rewritten in place on a
terminal).

With no op and no ``--cases``, a run is the representative subset: each op's headline case of
each phase (``registry.headline_case_names``: decode T = 64, prefill T = 8192) on a shorter
budget per case; ``--full`` runs every case. Every
run ends with a summary, one line per op, from the results it collected (``summary_lines``).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import platform
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import torch

import qwen4exp_ext
from qwen4exp_ext import ops
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.bench.registry import (
    OP_MODULES,
    Case,
    Section,
    headline_case_names,
    load_cases,
    load_sections,
)
from qwen4exp_ext.bench.rows import DEFAULT_APPEND, ROW_FIELDS, append_rows, bench_row
from qwen4exp_ext.bench.timing import Quantiles, roofline_copy, time_interleaved
from qwen4exp_ext.testing import exact_mismatch

DEFAULT_REPEAT = 500
QUICK_REPEAT = 10
# Without --repeat, each case gets as many rounds as fit this many seconds (MIN_REPEAT to
# DEFAULT_REPEAT): the eager baselines of the big shapes take seconds per call on a CPU, the
# kernels microseconds, and a fixed count would make the default run take hours.
CASE_BUDGET_S = 4.0
# The same for the representative subset (no op, no --cases, no --full: each op's headline
# cases, at DEFAULT_THREADS on a CPU), which should end in about three minutes on a 2-core
# machine. The decode cases reach DEFAULT_REPEAT rounds well within a second; the prefill cases'
# eager oracle and baselines take seconds a call on a CPU, so there MIN_REPEAT rounds, not this
# budget, set the time (on 2026-12-05 a 2-core EPYC VM, compiling CI beside it, took 453 s, most
# of it ple_gate's and ple_conv's prefill oracles).
SUBSET_CASE_BUDGET_S = 1.0
MIN_REPEAT = 5
DEFAULT_THREADS = "1,all"

# The memory roofline of the GPUs users serve on: datasheet HBM bandwidth, TB/s. A case's
# minimum time on one is its compulsory bytes at that bandwidth.
PEAK_TBPS = {"MI300X": 5.3, "MI325X": 6.0, "MI355X": 8.0, "H200": 4.8}

COLUMNS = (
    ("op", 11, "s"),
    ("case", 28, "s"),
    ("thr", 3, "d"),
    ("T", 6, "d"),
    ("ours p50 µs", 12, ".2f"),
    ("baseline", 12, "s"),
    ("base p50 µs", 12, ".2f"),
    ("speedup", 8, ".2f"),
    ("vs vllm", 7, "rs"),  # speedup_vs_vllm, "-" where vLLM is not timed (the JSON says why)
    ("oracle p50 µs", 13, ".2f"),
    ("tokens/s", 9, "si"),
    ("GB/s", 8, ".3g"),
    ("% copy", 7, ".1f"),
    ("MB", 8, ".4g"),
    *((f"{gpu} µs", 10, ".3g") for gpu in PEAK_TBPS),
    ("% peak", 7, "rs"),  # a right-aligned text: "-" where there is no listed GPU
)


class CheckFailed(Exception):
    """Our kernel disagrees with the oracle or a baseline; timing a wrong kernel means nothing."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if a check fails (argparse exits 2 on bad usage)."""
    args, thread_counts = _parse_args(argv)
    device = _device(args)
    repeat: int | None = args.repeat or (QUICK_REPEAT if args.quick else None)
    budget_s = SUBSET_CASE_BUDGET_S if args.subset else CASE_BUDGET_S
    # A tenth of the run, at least two rounds: enough to settle caches, clocks and the allocator.
    # (With repeat=None each case warms up and sizes its own run: _auto_repeat.)
    warmup = max(2, repeat // 10) if repeat is not None else 2

    shown = repeat if repeat is not None else f"auto ({budget_s:g} s per case)"
    if args.subset:
        print(
            "the representative subset: each op's headline case at decode T = 64 (ple_conv: "
            "R = 64) and prefill T = 8192; --full runs every case"
        )
    print(
        f"device: {_device_name(device)} ({device.type}), torch {torch.__version__}, "
        f"repeat {shown}, warmup {warmup}, threads {','.join(map(str, thread_counts))}"
    )
    print(_row([name for name, _, _ in COLUMNS], header=True))
    progress = _Progress(sys.stderr)
    results = []
    failures: list[str] = []
    sections: list[dict[str, Any]] = []
    run_info = {
        "thread_counts": thread_counts,
        "repeat": shown,
        "warmup": warmup,
        "cases": args.cases.pattern,
        "subset": args.subset,  # the representative subset: no op, no --cases, no --full
        "check_failures": failures,
    }
    environment = _environment(device)

    def save_json(complete: bool) -> None:
        """The JSON report of what has run so far: rewritten after every case, so that a run cut
        short (a time limit, a crash, Ctrl-C) keeps its figures, with "complete": false."""
        if args.json is not None:
            report = {**environment, **run_info, "complete": complete}
            _write_json(args.json, report | {"results": results, "sections": sections})

    selected_ops = args.ops or list(OP_MODULES)
    for op in selected_ops:
        progress.show(f"[{op}] building cases...")
        cases = load_cases(op, device)
        chosen = set(selected_case_names(args, [c.name for c in cases]))
        cases = [c for c in cases if c.name in chosen]
        total = len(cases) * len(thread_counts)
        done = 0
        for case in cases:
            for threads in thread_counts:
                done += 1
                progress.show(
                    f"[{done}/{total}] {case.op} {case.name} ({_threads_text(threads)})..."
                )
                try:
                    with _num_threads(threads):
                        result = _run_case(case, device, warmup, repeat, args.check, budget_s)
                except CheckFailed as err:
                    # Reported, never timed; the other cases still run (on a lent GPU, one
                    # wrong case must not cost the whole run's figures) and the exit is 1.
                    progress.clear()
                    failure = f"{case.op}/{case.name} ({_threads_text(threads)}): {err}"
                    print(f"CHECK FAILED {failure}", file=sys.stderr)
                    failures.append(failure)
                    save_json(complete=False)
                    continue
                result["threads"] = threads
                results.append(result)
                if args.append is not None:
                    json_path = None if args.json is None else str(args.json)
                    append_rows(args.append, [bench_row(result, environment, json_path)])
                progress.clear()
                print(_row(_table_values(result)), flush=True)
                if result.get("summary"):
                    print(textwrap.indent(str(result["summary"]), "    "), flush=True)
                save_json(complete=False)
        del cases
        for section in load_sections(op, device):
            progress.clear()
            print(_section_text(section), flush=True)
            sections.append(
                {k: getattr(section, k) for k in ("op", "name", "note")}
                | {"rows": [dict(r) for r in section.rows]}
            )
        save_json(complete=False)
    progress.clear()
    if not results and not failures:
        print(f"no case matches --cases {args.cases.pattern!r}", file=sys.stderr)
        return 2

    save_json(complete=True)
    if args.json is not None:
        print(f"wrote {args.json}")
    if args.append is not None:
        print(f"appended {len(results)} row(s) to {args.append}")
    _write_tables(args, device, results)
    print()
    print("\n".join(summary_lines(results, selected_ops, thread_counts)))
    if failures:
        print(f"{len(failures)} case(s) failed their check and were not timed", file=sys.stderr)
        return 1
    return 0


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[int]]:
    """The command line, checked (argparse exits 2 on bad usage), and its thread counts."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.append in OP_MODULES:
        # "--append gather_rows": an op, not a file (the flag's path is optional).
        args.ops.insert(0, str(args.append))
        args.append = DEFAULT_APPEND
    if args.append is not None:
        args.append = Path(args.append)
    if args.full and args.cases is not None:
        parser.error("--full runs every case: give it or --cases, not both")
    # No op and no --cases: the representative subset, unless --full.
    args.subset = not args.full and not args.ops and args.cases is None
    if args.cases is None:
        args.cases = ""
    if args.threads is None:
        # A GPU kernel's time does not depend on the host's threads: the subset times it once.
        on_gpu = _device(args).type == "cuda"
        args.threads = "all" if args.subset and on_gpu else DEFAULT_THREADS
    unknown = [op for op in args.ops if op not in OP_MODULES]
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OP_MODULES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA/ROCm device")
    if args.repeat is not None and args.repeat < 1:
        parser.error("--repeat must be >= 1")
    try:
        args.cases = re.compile(args.cases)
    except re.error as err:
        parser.error(f"--cases {args.cases!r}: not a regular expression ({err})")
    all_threads = torch.get_num_threads()
    try:
        thread_counts = _thread_counts(args.threads, all_threads)
    except ValueError as err:
        parser.error(f"--threads {args.threads}: {err}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401 - only checked here, used by _write_plot
        except ImportError:
            parser.error(
                "--plot needs matplotlib, which is not installed "
                "(pip install matplotlib, or the package's [test] extra)"
            )
    return args, thread_counts


def selected_case_names(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """Of one op's case names, those the run times: in the subset its headline cases
    (``registry.headline_case_names``), else those that --cases matches (all by default)."""
    if args.subset:
        return headline_case_names(names)
    return [n for n in names if args.cases.search(n)]


def _device(args: argparse.Namespace) -> torch.device:
    """The device of --device: auto is a GPU where torch sees one."""
    return torch.device(
        "cuda"
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )


def _write_json(path: Path, report: dict[str, Any]) -> None:
    """``report`` as ``path``, replaced whole (a run killed while writing leaves the last one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(partial, path)


def _write_tables(
    args: argparse.Namespace, device: torch.device, results: list[dict[str, Any]]
) -> None:
    """The --csv and --plot files that were asked for, at the end of a run."""
    if args.csv is not None:
        _write_csv(results, args.csv)
        print(f"wrote {args.csv}")
    if args.plot is not None:
        _write_plot(results, args.plot, f"{_device_name(device)} ({device.type})")
        print(f"wrote {args.plot}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen4exp-bench",
        description="Time qwen4exp_ext kernels against what a user would run otherwise (eager "
        "transformers, torch.index_select, F.conv1d, vLLM) and the plain-PyTorch oracle, side "
        "by side, and against a same-run copy of the same bytes (the memory roofline).",
    )
    # Validated by hand: argparse rejects an empty nargs="*" list against choices on Python 3.11.
    parser.add_argument(
        "ops",
        nargs="*",
        metavar="OP",
        help=f"ops to run, every case of each (default: all ops; without --cases or --full only "
        f"their headline cases): {', '.join(OP_MODULES)}",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="run every case of every op (default without an op or --cases: the representative "
        "subset, each op's headline case at decode T = 64 and prefill T = 8192)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto = cuda (CUDA or ROCm) if available, else cpu",
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help='also write results as JSON, rewritten after each case ("complete": false until the '
        "run ends, so a run cut short keeps what it measured)",
    )
    parser.add_argument(
        "--append",
        nargs="?",
        const=str(DEFAULT_APPEND),
        metavar="FILE",
        help=f"also append one JSON line per case result and thread count to FILE (JSON Lines; "
        f"default {DEFAULT_APPEND}, relative to the current directory), written as each case "
        f"ends, never rewritten. A row holds: {', '.join(ROW_FIELDS)} (the date in UTC; "
        "machine: the GPU, or the CPU model with its family and model; commit: the checkout's "
        "short hash, null outside git; json: the --json file, if any). Put the path after "
        "--append= or after the ops",
    )
    parser.add_argument(
        "--csv",
        type=Path,
        metavar="PATH",
        help="also write one CSV row per case and thread count: the table's numbers and every "
        "contender's p50",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="also draw the %% of copy bandwidth of every case and thread count, grouped by op, "
        "as a PNG (needs matplotlib)",
    )
    parser.add_argument(
        "--threads",
        metavar="N[,N...]",
        help="torch thread counts to run every case at, comma-separated; 'all' is torch's "
        f"default ({torch.get_num_threads()} here) (default: {DEFAULT_THREADS}; the subset on "
        "a GPU: all)",
    )
    parser.add_argument(
        "--cases",
        metavar="REGEX",
        help="run only the cases whose name matches (re.search), e.g. 'prefill' or "
        "'T8192_bf16$' (default: every case of the ops named, else the subset, see --full)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REPEAT} repetitions: a smoke run for tests and CI",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="timed calls per contender (default: as many as fit "
        f"{CASE_BUDGET_S:g} s per case, {SUBSET_CASE_BUDGET_S:g} s in the subset, "
        f"{MIN_REPEAT} to {DEFAULT_REPEAT})",
    )
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check ours against the oracle and every baseline on each case before timing",
    )
    return parser


def _thread_counts(spec: str, all_threads: int) -> list[int]:
    """'1,all' -> [1, all_threads], duplicates dropped (on a one-core machine that is [1])."""
    counts: list[int] = []
    for item in spec.split(","):
        item = item.strip().lower()
        n = all_threads if item == "all" else int(item) if item.isdigit() else 0
        if n < 1:
            raise ValueError(f"{item!r} is neither a thread count >= 1 nor 'all'")
        if n not in counts:
            counts.append(n)
    return counts


def _threads_text(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


class _num_threads:  # noqa: N801 - used as a context manager, like torch's own
    """torch.set_num_threads(n) for the block, the previous count restored after it."""

    def __init__(self, n: int):
        self.n = n
        self.previous = torch.get_num_threads()

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


class _Progress:
    """One progress line on ``stream``: rewritten in place (\\r) on a terminal, else one plain
    line per update, so a log shows where a long run was."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        isatty = getattr(stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.shown = False

    def show(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self.shown = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the line (on a terminal) before the table prints over it."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _auto_repeat(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    warmup: int,
    budget_s: float,
    before_call: Callable[[], None] | None = None,
) -> int:
    """Runs the warm-up rounds and returns how many rounds fit ``budget_s`` (timed on the last
    warm-up round, ``before_call`` included), clamped to [MIN_REPEAT, DEFAULT_REPEAT]."""
    round_s = 0.0
    for _ in range(warmup):
        start = time.perf_counter()
        for fn in fns.values():
            if before_call is not None:
                before_call()
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        round_s = time.perf_counter() - start
    return max(MIN_REPEAT, min(DEFAULT_REPEAT, int(budget_s / max(round_s, 1e-9))))


def _run_case(
    case: Case,
    device: torch.device,
    warmup: int,
    repeat: int | None,
    check: bool,
    budget_s: float = CASE_BUDGET_S,
) -> dict[str, Any]:
    if check:
        _check(case)
    copy, copy_bytes = roofline_copy(case.nbytes, device)
    fns: dict[str, Callable[[], object]] = {
        "ours": case.ours,
        **case.baselines,
        "oracle": case.oracle,
        **case.references,
        "copy": copy,
    }
    if repeat is None:
        repeat = _auto_repeat(fns, device, warmup, budget_s, case.before_call)
        warmup = 0  # done
    times = time_interleaved(
        fns, device, warmup, repeat, wall_clock=case.host_waits, before_call=case.before_call
    )
    ours, oracle, copy_t = times["ours"], times["oracle"], times["copy"]
    baselines = {name: times[name] for name in case.baselines}
    headline = baselines[case.baseline]
    timed = {"ours": ours, **baselines, "oracle": oracle}

    def gbps(q: Quantiles, nbytes: int = case.nbytes) -> float:
        return nbytes / (q.p50_us * 1e3)

    rates = {name: gbps(q) for name, q in timed.items()} | {"copy": gbps(copy_t, copy_bytes)}
    result = {
        "op": case.op,
        "case": case.name,
        "threads": torch.get_num_threads(),
        "tokens": case.tokens,
        "params": dict(case.params),
        "check": True if check else None,
        "ours": asdict(ours),
        "baseline": case.baseline,
        "baselines": {name: asdict(q) for name, q in baselines.items()},
        "oracle": asdict(oracle),
        "copy": asdict(copy_t),
        # The headline: what a user gains over what they would run otherwise.
        "speedup": headline.p50_us / ours.p50_us,
        "speedups": {name: q.p50_us / ours.p50_us for name, q in baselines.items()},
        "speedup_vs_oracle": oracle.p50_us / ours.p50_us,
        # Over vLLM 0.33.0's own code for the case, where it ran (else null, and the note says
        # why): what a vLLM user gains by our kernel.
        "vllm_baseline": case.vllm,
        "speedup_vs_vllm": speedup_vs_vllm(times, case.vllm),
        "vllm_note": case.vllm_note,
        "tokens_per_s": {name: case.tokens / (q.p50_us * 1e-6) for name, q in timed.items()},
        "bytes": case.nbytes,
        "copy_bytes": copy_bytes,
        "gbps": rates,
        "pct_of_copy": 100.0 * rates["ours"] / rates["copy"],
        "roofline_us": {gpu: case.nbytes / (tbps * 1e6) for gpu, tbps in PEAK_TBPS.items()},
        "pct_of_peak": _pct_of_peak(rates["ours"], device),
    }
    if case.references:
        result["references"] = {name: asdict(times[name]) for name in case.references}
    if case.derive is not None:
        derived = dict(case.derive(times))
        clash = set(derived) & set(result)
        if clash:
            raise ValueError(f"{case.op}/{case.name}: derived fields {sorted(clash)} are taken")
        result |= derived
    return result


def summary_lines(
    results: Sequence[dict[str, Any]], ops_: Sequence[str], thread_counts: Sequence[int]
) -> list[str]:
    """The run's conclusion, from its results (nothing more is timed): a heading, then one line
    per op of ``ops_``: for each phase of ``registry.HEADLINE_PHASES``, the op's first case that
    ran and matches it (``registry.headline_case_names``), its speedup over the headline
    baseline and ours as a % of the same-run copy, at each thread count ("-" where that count
    has no result, e.g. a failed check)."""
    counts = " / ".join(map(str, thread_counts))
    plural = "thread" if list(thread_counts) == [1] else "threads"
    lines = [
        f"summary ({counts} {plural}): ours against the headline baseline (speedup) and "
        "against a same-run copy of the same bytes (% copy)"
    ]
    width = max(map(len, ops_), default=0)
    for op in ops_:
        ran = [r for r in results if r["op"] == op]
        parts = []
        for name in headline_case_names(dict.fromkeys(r["case"] for r in ran)):
            by_threads = {r["threads"]: r for r in ran if r["case"] == name}
            row = [by_threads.get(n) for n in thread_counts]
            baseline = next(r["baseline"] for r in row if r is not None)
            speedups = " / ".join("-" if r is None else f"{r['speedup']:.2f}x" for r in row)
            copies = " / ".join("-" if r is None else f"{r['pct_of_copy']:.1f}" for r in row)
            parts.append(f"{name} {speedups} {baseline}, {copies} % copy")
        text = (
            "; ".join(parts) or "no headline case ran (decode T = 64 or R = 64, prefill T = 8192)"
        )
        # "op:", not a table row's "op": a reader of the table (or a test) tells them apart.
        lines.append(f"  {(op + ':').ljust(width + 1)}  {text}")
    return lines


def speedup_vs_vllm(times: Mapping[str, Quantiles], vllm: str | None) -> float | None:
    """vLLM's p50 over ours, as every speedup here (> 1: ours is faster), from the case's
    quantiles by contender name; None where the case names no vLLM baseline (``vllm``)."""
    if vllm is None:
        return None
    return times[vllm].p50_us / times["ours"].p50_us


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
    """The case's own check, or exact equality of ours with the oracle and every baseline."""
    if case.check is not None:
        problem = case.check()
    else:
        ours = case.ours().clone()  # a baseline may share nothing with it, but be safe
        problem = exact_mismatch(
            ours, case.oracle(), "output", against="the oracle", equal_nan=True
        )
        for name, fn in case.baselines.items():
            problem = problem or exact_mismatch(ours, fn(), "output", against=name, equal_nan=True)
    if problem is not None:
        raise CheckFailed(problem)


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
        # How the CPU gather converted fp8 rows ("avx512", "avx2" or "scalar").
        "cpu_gather_fp8_lookup": ops.cpu_gather_fp8_lookup(),
        # How the CPU conv looked its SiLU up ("loop" or "gather": timed on this CPU).
        "cpu_conv_silu_lookup": ops.cpu_conv_silu_lookup(),
        # The source of the "vllm" baselines (GPU only; None: no vLLM source here).
        "vllm_kernels": vllm_triton.source_origin() if device.type == "cuda" else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # What "AMD EPYC" alone (a VM's model name) does not say: the host CPU's generation,
        # vector extensions and caches, whichever device ran.
        "cpu": _cpu_facts(),
        "source": _source_commit(),
    }


# The x86 extensions that pick the CPU kernels' paths (simd.h, gather_rows.cpp), where present.
_CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


@functools.cache  # read once per run: the header, the file name and the JSON all name the CPU
def _cpu_facts() -> dict[str, Any] | None:
    """The first CPU's vendor, family, model, name, the flags of ``_CPU_FLAGS`` it has and its
    L2 and L3 sizes, from /proc/cpuinfo and sysfs (Linux); None where there is neither."""
    facts: dict[str, Any] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            fields = {}
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return None
    facts["vendor"] = fields.get("vendor_id")
    facts["family"] = fields.get("cpu family")
    facts["model"] = fields.get("model")
    facts["model_name"] = fields.get("model name")
    flags = set(fields.get("flags", "").split())
    facts["flags"] = [flag for flag in _CPU_FLAGS if flag in flags]
    cache_dir = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction" and level in ("2", "3"):
            facts[f"l{level}"] = size
    return facts


def _source_commit() -> str | None:
    """The git commit of this package's checkout (with "-dirty" if the tracked files differ
    from it), or None outside a checkout or without git."""
    here = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    facts = _cpu_facts()
    if facts is not None and facts["model_name"]:
        return facts["model_name"]
    return platform.processor() or platform.machine()


def _table_values(result: dict[str, Any]) -> list[object]:
    return [
        result["op"],
        result["case"],
        result["threads"],
        result["tokens"],
        result["ours"]["p50_us"],
        result["baseline"],
        result["baselines"][result["baseline"]]["p50_us"],
        result["speedup"],
        "-" if result["speedup_vs_vllm"] is None else f"{result['speedup_vs_vllm']:.2f}",
        result["oracle"]["p50_us"],
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


def _csv_rows(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[dict[str, object]]]:
    """The table's numbers per case and thread count, then p50_us_<name> of every contender
    (ours, each baseline, the oracle, each reference, the copy; blank where a case has no such
    baseline or reference)."""
    contenders: dict[str, None] = {"ours": None}
    for r in results:
        contenders |= dict.fromkeys(r["baselines"])
    contenders |= {"oracle": None}
    for r in results:
        contenders |= dict.fromkeys(r.get("references", {}))
    contenders |= {"copy": None}
    fields = [
        "op",
        "case",
        "threads",
        "tokens",
        "ours_p50_us",
        "baseline",
        "baseline_p50_us",
        "speedup",
        "vllm_baseline",
        "speedup_vs_vllm",
        "oracle_p50_us",
        "speedup_vs_oracle",
        "tokens_per_s",
        "gbps",
        "pct_of_copy",
        "mb",
        *(f"{gpu}_roofline_us" for gpu in PEAK_TBPS),
        "pct_of_peak",
        *(f"p50_us_{name}" for name in contenders),
    ]
    rows = []
    for r in results:
        p50 = {name: q["p50_us"] for name, q in r["baselines"].items()}
        p50 |= {name: q["p50_us"] for name, q in r.get("references", {}).items()}
        p50 |= {who: r[who]["p50_us"] for who in ("ours", "oracle", "copy")}
        rows.append(
            {
                "op": r["op"],
                "case": r["case"],
                "threads": r["threads"],
                "tokens": r["tokens"],
                "ours_p50_us": r["ours"]["p50_us"],
                "baseline": r["baseline"],
                "baseline_p50_us": r["baselines"][r["baseline"]]["p50_us"],
                "speedup": r["speedup"],
                "vllm_baseline": r["vllm_baseline"] or "",
                "speedup_vs_vllm": "" if r["speedup_vs_vllm"] is None else r["speedup_vs_vllm"],
                "oracle_p50_us": r["oracle"]["p50_us"],
                "speedup_vs_oracle": r["speedup_vs_oracle"],
                "tokens_per_s": r["tokens_per_s"]["ours"],
                "gbps": r["gbps"]["ours"],
                "pct_of_copy": r["pct_of_copy"],
                "mb": r["bytes"] / 1e6,
                **{f"{gpu}_roofline_us": r["roofline_us"][gpu] for gpu in PEAK_TBPS},
                "pct_of_peak": "" if r["pct_of_peak"] is None else r["pct_of_peak"],
                **{f"p50_us_{name}": p50.get(name, "") for name in contenders},
            }
        )
    return fields, rows


def _write_csv(results: Sequence[dict[str, Any]], path: Path) -> None:
    fields, rows = _csv_rows(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _write_plot(results: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """% of copy per case, one horizontal bar per thread count, one panel per op (Agg canvas:
    no display and no pyplot state needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ops_ = list(dict.fromkeys(r["op"] for r in results))
    threads = sorted({r["threads"] for r in results})
    by_key = {(r["op"], r["case"], r["threads"]): r["pct_of_copy"] for r in results}
    names = {op: list(dict.fromkeys(r["case"] for r in results if r["op"] == op)) for op in ops_}
    heights = [max(1, len(names[op])) for op in ops_] or [1]
    fig = Figure(figsize=(10, 1.2 + 0.3 * sum(heights) * max(1, len(threads)) ** 0.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    bar = 0.8 / max(1, len(threads))
    for ax, op in zip(axes[:, 0], ops_, strict=False):
        cases = names[op]
        for j, n in enumerate(threads):
            values = [by_key.get((op, case, n), math.nan) for case in cases]
            offsets = [i - 0.4 + bar * (j + 0.5) for i in range(len(cases))]
            ax.barh(offsets, values, height=bar, label=_threads_text(n))
        ax.set_yticks(range(len(cases)), cases, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(100.0, color="grey", linestyle=":", linewidth=1)
        ax.set_title(op, fontsize=9, loc="left")
        ax.set_xlabel("% of a same-run copy of the same bytes", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"qwen4exp-bench: {title}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)


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
