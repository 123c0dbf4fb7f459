"""The command line of ``qwen4exp-bench``: the parser, its checks (``parse_args``; argparse exits
2 on bad usage), the thread counts of ``--threads`` (``_thread_counts``), the device of
``--device`` (``selected_device``) and which of an op's cases a run times (``selected_case_names``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from qwen4exp_ext.bench.registry import FULL_ONLY_OPS, OP_MODULES, headline_case_names
from qwen4exp_ext.bench.rows import DEFAULT_APPEND, ROW_FIELDS
from qwen4exp_ext.bench.runner import (
    CASE_BUDGET_S,
    DEFAULT_REPEAT,
    MIN_REPEAT,
    QUICK_REPEAT,
    SUBSET_CASE_BUDGET_S,
)

DEFAULT_THREADS = "1,all"


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[int]]:
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
        on_gpu = selected_device(args).type == "cuda"
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
            import matplotlib  # noqa: F401 - only checked here, used by report._write_plot
        except ImportError:
            parser.error(
                "--plot needs matplotlib, which is not installed "
                "(pip install matplotlib, or the package's [test] extra)"
            )
    return args, thread_counts


def selected_ops(args: argparse.Namespace) -> list[str]:
    """The ops the run builds: those named, else every op (the subset: but FULL_ONLY_OPS)."""
    if args.ops:
        return list(args.ops)
    return [op for op in OP_MODULES if not (args.subset and op in FULL_ONLY_OPS)]


def selected_case_names(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """Of one op's case names, those the run times: in the subset its headline cases
    (``registry.headline_case_names``), else those that --cases matches (all by default)."""
    if args.subset:
        return headline_case_names(names)
    return [n for n in names if args.cases.search(n)]


def selected_device(args: argparse.Namespace) -> torch.device:
    """The device of --device: auto is a GPU where torch sees one."""
    return torch.device(
        "cuda"
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )


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
