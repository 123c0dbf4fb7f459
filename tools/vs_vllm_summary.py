"""One line of a bench JSON's speedup over vLLM's own code per case, for check-gpu.sh's summary.

usage: python tools/vs_vllm_summary.py BENCH.json
Prints per op "  vs_vllm OP: CASE X.XX, CASE -, ..." (vLLM p50 / ours p50, > 1: ours is faster;
"-": vLLM not timed, the distinct notes why after it); nothing for a missing or unreadable file (the
bench's own exit status says what went wrong) or a file without results. Standard library only.
"""

from __future__ import annotations

import json
import sys


def summary(report: dict) -> str | None:
    """Per op of the report's results, its line (and the notes of its null figures)."""
    lines = []
    ops = dict.fromkeys(r["op"] for r in report.get("results") or [])
    for op in ops:
        cells, notes = [], []
        for r in (r for r in report["results"] if r["op"] == op):
            value = r.get("speedup_vs_vllm")
            cells.append(f"{r['case']} {'-' if value is None else f'{value:.2f}'}")
            note = r.get("vllm_note")
            if value is None and note and note not in notes:
                notes.append(note)
        lines.append(f"  vs_vllm {op}: {', '.join(cells)}")
        lines += [f"    ({note})" for note in notes]
    return "\n".join(lines) or None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return 0
    text = summary(report)
    if text:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
