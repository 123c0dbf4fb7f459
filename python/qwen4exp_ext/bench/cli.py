"""Command line of ``qwen4exp-bench`` / ``python -m qwen4exp_ext.bench``.

For every case of every selected op, at each thread count of ``--threads``
(``torch.set_num_threads``, restored afterwards): check ours against the oracle (``reference.py``)
and against every baseline (what a user would run without our kernel; see ``registry.Case``), then
time ours, the oracle, the baselines and a same-traffic ``copy_`` side by side in one interleaved
loop, print one table row (the headline baseline and the speedup over it, the speedup over vLLM's
own code where the case names a ``vllm`` baseline, the oracle's time, the case's compulsory bytes,
its minimum time at the HBM peak of each GPU in ``machine.PEAK_TBPS``, and on a listed GPU the % of
that GPU's datasheet peak that ours reaches), and optionally write everything to JSON tagged with
the device, torch version, build info and date, so results from different machines and commits can
be compared later; ``--append`` adds one JSON line per case result and thread count to a results
file (``results/bench.jsonl`` by default; the row's fields: ``rows.ROW_FIELDS``); ``--csv`` writes
one row per case and thread count, ``--plot`` a PNG of the % of copy bandwidth. After an op's cases
come its untimed sections (``registry.Section``: e.g. gather_rows' pinned bytes per table format),
printed as small tables of their own and written to the JSON under "sections". A progress line on
stderr names the case being checked and timed (rewritten in place on a terminal).

With no op and no ``--cases``, a run is the representative subset: each op's headline case of
each phase (``registry.headline_case_names``: decode T = 64, prefill T = 8192) on a shorter
budget per case; ``--full`` runs every case. Every run ends with a summary, one line per op,
from the results it collected (``report.summary_lines``).

This module is the run itself (``main``: each op's cases at each thread count, then its
sections, then the summary); the rest is one thing a module: ``args.py`` the command line,
``runner.py`` one case checked and timed, ``machine.py`` what the run ran on, ``report.py`` what
it prints and writes, ``rows.py`` the ``--append`` row, ``timing.py`` the interleaved timing
loop, ``registry.py`` the ops and their cases.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import torch

from qwen4exp_ext.bench.args import (
    parse_args,
    selected_case_names,
    selected_device,
    selected_ops,
)
from qwen4exp_ext.bench.machine import describe_environment, device_name
from qwen4exp_ext.bench.registry import load_cases, load_sections
from qwen4exp_ext.bench.report import (
    COLUMNS,
    _Progress,
    _row,
    _section_text,
    _table_values,
    _threads_text,
    _write_json,
    _write_tables,
    summary_lines,
)
from qwen4exp_ext.bench.rows import append_rows, bench_row
from qwen4exp_ext.bench.runner import (
    CASE_BUDGET_S,
    QUICK_REPEAT,
    SUBSET_CASE_BUDGET_S,
    CheckFailed,
    _num_threads,
    _run_case,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if a check fails (argparse exits 2 on bad usage)."""
    args, thread_counts = parse_args(argv)
    device = selected_device(args)
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
        f"device: {device_name(device)} ({device.type}), torch {torch.__version__}, "
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
    environment = describe_environment(device)

    def save_json(complete: bool) -> None:
        """The JSON report of what has run so far: rewritten after every case, so that a run cut
        short (a time limit, a crash, Ctrl-C) keeps its figures, with "complete": false."""
        if args.json is not None:
            report = {**environment, **run_info, "complete": complete}
            _write_json(args.json, report | {"results": results, "sections": sections})

    run_ops = selected_ops(args)
    for op in run_ops:
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
    # The machine the figures are from: the CPU's model and generation, or the GPU's name.
    machine = environment["cpu_model"] if device.type == "cpu" else environment["device"]
    print("\n".join(summary_lines(results, run_ops, thread_counts, machine)))
    if failures:
        print(f"{len(failures)} case(s) failed their check and were not timed", file=sys.stderr)
        return 1
    return 0
