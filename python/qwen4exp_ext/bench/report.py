"""What a bench run prints and writes from its results: the progress line on stderr
(``_Progress``), the table (``COLUMNS``, one row per case and thread count), an op's untimed
sections (``_section_text``), the closing summary (``summary_lines``), the ``--json`` report
(``_write_json``: replaced whole), and the ``--csv`` and ``--plot`` files (``_write_tables``).
The ``--append`` rows are ``rows.py``'s.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from qwen4exp_ext.bench.machine import PEAK_TBPS, device_name
from qwen4exp_ext.bench.registry import Section, headline_case_names
from qwen4exp_ext.bench.runner import path_text

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
    # CPU: the gather path / fp8 lookup / hash width that ran (runner.cpu_paths), "-" for none.
    ("path", 13, "s"),
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
        _write_plot(results, args.plot, f"{device_name(device)} ({device.type})")
        print(f"wrote {args.plot}")


def _threads_text(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


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


def summary_lines(
    results: Sequence[dict[str, Any]],
    ops_: Sequence[str],
    thread_counts: Sequence[int],
    cpu: str | None = None,
) -> list[str]:
    """The run's conclusion, from its results (nothing more is timed): a heading (naming the
    ``cpu``, machine.cpu_text(), where given), then one line
    per op of ``ops_``: for each phase of ``registry.HEADLINE_PHASES``, the op's first case that
    ran and matches it (``registry.headline_case_names``), its speedup over the headline
    baseline and ours as a % of the same-run copy, at each thread count ("-" where that count
    has no result, e.g. a failed check)."""
    counts = " / ".join(map(str, thread_counts))
    plural = "thread" if list(thread_counts) == [1] else "threads"
    on = f" on {cpu}" if cpu else ""
    lines = [
        f"summary ({counts} {plural}){on}: ours against the headline baseline (speedup) and "
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
        path_text(result.get("cpu_paths")),
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
    """The table's numbers per case and thread count (with its "path"), then p50_us_<name> of
    every contender (ours, each baseline, the oracle, each reference, the copy; blank where a
    case has no such baseline or reference)."""
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
        "path",
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
                "path": path_text(r.get("cpu_paths")),
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
