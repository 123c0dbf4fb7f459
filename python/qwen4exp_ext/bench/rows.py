"""The results as data: one JSON line per case result and thread count (JSON Lines).

``qwen4exp-bench --append [FILE]`` appends a row to FILE (default ``results/bench.jsonl``) for
every case it times, at each thread count; ``bench_row`` is the one definition of a row, used by
the CLI and by whatever converts a full ``--json`` report into rows (``json_rows``). A row is a
compact, self-describing subset of the full result (which ``--json`` keeps whole): where, when,
from which checkout, and the headline figures. Its fields, in order (``ROW_FIELDS``):

  date             the run's start, UTC, ISO 8601 (the report's "date")
  machine          the GPU's name, or on a CPU its model name as /proc/cpuinfo (lscpu) gives it,
                   with its family and model where known ("AMD EPYC, family 25 model 17": a VM's
                   model name alone does not tell the generations apart)
  device           "cpu" or "cuda" (CUDA or ROCm: torch's device type)
  torch            torch.__version__
  commit           the checkout's commit, short (7 hex digits); null outside a git checkout
  dirty            whether tracked files differed from that commit; null where commit is
  op, case         the bench op and case name
  threads          torch's thread count for this row
  ours_p50_us      our kernel's median, µs (times to 3 decimals, ratios to 4, % to 2)
  baseline         the name of the op's headline baseline (what a user would run otherwise)
  baseline_p50_us  its median, µs
  speedup          baseline_p50_us / ours_p50_us (> 1: ours is faster); null without a baseline
  pct_of_copy      ours as a % of a same-run copy of the same bytes
  speedup_vs_vllm  vLLM's p50 / ours where vLLM's own code ran; else null
  json             the full report the row also went to (--json's path, or the file a row was
                   converted from); null if none
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

DEFAULT_APPEND = Path("results") / "bench.jsonl"

ROW_FIELDS = (
    "date",
    "machine",
    "device",
    "torch",
    "commit",
    "dirty",
    "op",
    "case",
    "threads",
    "ours_p50_us",
    "baseline",
    "baseline_p50_us",
    "speedup",
    "pct_of_copy",
    "speedup_vs_vllm",
    "json",
)


def machine_name(report: Mapping[str, Any]) -> str | None:
    """The row's ``machine`` from a report's environment: the GPU's name, or the CPU's model
    name with its family and model when the report has them (``cpu``)."""
    name = report.get("device")
    if report.get("device_type") == "cuda":
        return name
    cpu = report.get("cpu") or {}
    name = cpu.get("model_name") or name
    if cpu.get("family") is not None and cpu.get("model") is not None:
        return f"{name}, family {cpu['family']} model {cpu['model']}"
    return name


def split_source(source: str | None) -> tuple[str | None, bool | None]:
    """A report's ``source`` ("<40 hex>" or "<40 hex>-dirty", or null) as (short commit, dirty)."""
    if not source:
        return None, None
    full, dirty, _ = source.partition("-dirty")
    return full[:7], bool(dirty)


def bench_row(
    result: Mapping[str, Any], report: Mapping[str, Any], json_path: str | None = None
) -> dict[str, Any]:
    """One row (``ROW_FIELDS``, in order) of one case result at one thread count: ``result`` is
    an entry of a report's "results", ``report`` the report's environment
    (``machine.describe_environment``: date, device, device_type, torch, cpu, source)."""
    commit, dirty = split_source(report.get("source"))
    baseline = result.get("baseline")
    base = (result.get("baselines") or {}).get(baseline) or {}
    row = {
        "date": report.get("date"),
        "machine": machine_name(report),
        "device": report.get("device_type"),
        "torch": report.get("torch"),
        "commit": commit,
        "dirty": dirty,
        "op": result["op"],
        "case": result["case"],
        "threads": result.get("threads", report.get("threads")),
        "ours_p50_us": _round(result["ours"]["p50_us"], 3),
        "baseline": baseline,
        "baseline_p50_us": _round(base.get("p50_us"), 3),
        # Files of 2026-11-30 have no baseline: their "speedup" is over the oracle, not one.
        "speedup": _round(result.get("speedup"), 4) if baseline is not None else None,
        "pct_of_copy": _round(result.get("pct_of_copy"), 2),
        "speedup_vs_vllm": _round(result.get("speedup_vs_vllm"), 4),
        "json": json_path,
    }
    assert tuple(row) == ROW_FIELDS
    return row


def _round(value: float | None, digits: int) -> float | None:
    """Times to the ns, ratios to 4 decimals: the timing noise is far larger, and a row stays
    short."""
    return None if value is None else round(value, digits)


def json_rows(report: Mapping[str, Any], json_path: str | None = None) -> list[dict[str, Any]]:
    """Every row of a full ``--json`` report, in its order."""
    return [bench_row(result, report, json_path) for result in report.get("results", [])]


def append_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Append ``rows`` to ``path``, one JSON object a line (the file and its folder are made if
    missing; what is there is kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
