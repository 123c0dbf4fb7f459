"""The bench says which paths of our CPU kernels ran (issue #51): each CPU row of the gather ops
(gather_rows, ngram_gather_rows, host_lookup's step and staged cases) carries ``cpu_paths`` in the
JSON (the gather's path, how many gathers took each, the timing behind it, the fp8 lookup, the
hash width's slot) and its short form in the table's and the CSV's "path" column; the report
and the summary name the CPU's model and generation. Smoke runs at toy sizes, as
tests/test_bench.py's: no timing thresholds.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest

from gather_support import CPU_PATHS, cpu_gather_path
from qwen4exp_ext import ops
from qwen4exp_ext.bench import machine, runner
from qwen4exp_ext.bench import report as bench_report
from qwen4exp_ext.bench.cli import main

GATHER_ROWS = 4096  # a small table: the quick run times a case in well under a second


def _run(tmp_path: Path, argv: list[str], **env: str) -> tuple[dict, str, list[dict]]:
    """One quick bench run on the CPU at 1 thread: its JSON report, stdout and CSV rows."""
    paths = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "csv")}
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        for name, value in env.items():
            mp.setenv(name, value)
        argv = [*argv, "--quick", "--threads", "1", "--device", "cpu"]
        assert main([*argv, "--json", str(paths["json"]), "--csv", str(paths["csv"])]) == 0
    with paths["csv"].open(newline="") as f:
        rows = list(csv.DictReader(f))
    return json.loads(paths["json"].read_text()), printed.getvalue(), rows


def _path_cell(stdout: str, result: dict) -> str:
    """The "path" cell (the last) of the printed table row of ``result``."""
    column = [name for name, _, _ in bench_report.COLUMNS].index("path")
    assert column == len(bench_report.COLUMNS) - 1
    for line in stdout.splitlines():
        cells = line.split()
        if cells[:3] == [result["op"], result["case"], str(result["threads"])]:
            return cells[column]
    raise AssertionError(f"no table row for {result['op']}/{result['case']}")


@pytest.mark.parametrize("path", CPU_PATHS)
def test_gather_rows_rows_say_the_path_that_ran(tmp_path: Path, path: str) -> None:
    """With a path pinned, every gather of the timed loop takes it, and each row says so in the
    JSON, the table and the CSV; fp8 rows name the lookup that converted them, bf16 rows none;
    the gather hashes nothing, so its hash is null."""
    with cpu_gather_path(path):
        report, stdout, csv_rows = _run(
            tmp_path,
            ["gather_rows", "--cases", "decode_T64_(bf16|fp8)$"],
            QWEN4EXP_BENCH_GATHER_ROWS=str(GATHER_ROWS),
        )
    results = report["results"]
    assert {r["case"] for r in results} == {"decode_T64_bf16", "decode_T64_fp8"}
    for result in results:
        paths = result["cpu_paths"]
        fp8 = result["case"].endswith("fp8")
        assert paths["gather"] == path
        assert set(paths["gather_calls"]) == {path} and paths["gather_calls"][path] > 0
        assert paths["fp8_lookup"] == (ops.cpu_gather_fp8_lookup() if fp8 else None)
        assert "hash" in paths and paths["hash"] is None
        text = path + (f"/{ops.cpu_gather_fp8_lookup()}" if fp8 else "")
        assert runner.path_text(paths) == text
        assert _path_cell(stdout, result) == text
        (row,) = [r for r in csv_rows if r["case"] == result["case"]]
        assert row["path"] == text


def test_a_large_gather_row_reports_the_timed_path(tmp_path: Path) -> None:
    """A prefill whose output passes the size from which the paths are timed (no setting) takes
    the path the timing chose (by the end of the run's warm-up), and its row says so, with the
    timing's figures."""
    previous = ops.set_cpu_gather_path(None), ops.set_cpu_gather_stream_bytes(None)
    try:
        large = max(ops.cpu_gather_stream_bytes(), 8 << 20)  # 1 thread: past its cache share
        tokens = -(-large // (16 * 160 * 2))
        from qwen4exp_ext.bench import gather_rows

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gather_rows, "PREFILL_TOKENS", tokens)
            report, _, _ = _run(
                tmp_path,
                ["gather_rows", "--cases", "prefill_T[0-9]+_bf16$"],
                QWEN4EXP_BENCH_GATHER_ROWS=str(GATHER_ROWS),
            )
    finally:
        ops.set_cpu_gather_path(previous[0])
        ops.set_cpu_gather_stream_bytes(previous[1])
    (result,) = report["results"]
    paths = result["cpu_paths"]
    timing = paths["gather_timing"]["copy"]  # made by the run's warm-up at the latest
    assert timing["threads"] == 1 and sorted(timing["seconds"]) == sorted(CPU_PATHS)
    assert timing["path"] == min(timing["seconds"], key=timing["seconds"].get)
    assert paths["gather"] == timing["path"]


def test_ngram_gather_rows_rows_have_the_hash_slot(tmp_path: Path) -> None:
    """The fused op's rows say the gather path and the width the kernel hashed with
    (ops.cpu_ngram_hash_isa, the same in the bench's process as in this one)."""
    report, stdout, _ = _run(
        tmp_path,
        ["ngram_gather_rows", "--cases", "decode_T64$"],
        QWEN4EXP_BENCH_GATHER_ROWS=str(GATHER_ROWS),
    )
    (result,) = report["results"]
    paths = result["cpu_paths"]
    assert paths["gather"] in CPU_PATHS and paths["gather_calls"][paths["gather"]] > 0
    assert paths["fp8_lookup"] is None
    assert paths["hash"] in ("avx512", "avx2", "scalar")
    assert paths["hash"] == runner.hash_width() == ops.cpu_ngram_hash_isa()
    assert _path_cell(stdout, result) == runner.path_text(paths)
    assert _path_cell(stdout, result).endswith("/" + paths["hash"])


def test_host_lookup_staged_rows_say_the_path(tmp_path: Path) -> None:
    """The staged lookup gathers on its worker thread: its row counts those gathers too (fp8:
    with the lookup that converted them); a step case's row says its path as well."""
    from qwen4exp_ext.bench import step_proxy

    report, stdout, _ = _run(
        tmp_path,
        ["host_lookup", "--cases", "^staged_decode_T1_fp8_ram$|^decode_T1_bf16$"],
        **{step_proxy.SIZE_ENV: "quick"},
    )
    by_case = {r["case"]: r for r in report["results"]}
    assert set(by_case) == {"staged_decode_T1_fp8_ram", "decode_T1_bf16"}
    staged = by_case["staged_decode_T1_fp8_ram"]["cpu_paths"]
    assert staged["gather"] in CPU_PATHS
    assert staged["fp8_lookup"] == ops.cpu_gather_fp8_lookup()
    assert by_case["decode_T1_bf16"]["cpu_paths"]["gather"] in CPU_PATHS
    for result in by_case.values():
        assert _path_cell(stdout, result) == runner.path_text(result["cpu_paths"])


def test_rows_of_other_ops_have_no_paths(tmp_path: Path) -> None:
    report, stdout, csv_rows = _run(tmp_path, ["ple_gate", "--cases", "decode_T64$"])
    (result,) = report["results"]
    assert "cpu_paths" not in result
    assert _path_cell(stdout, result) == "-" and csv_rows[0]["path"] == "-"


def test_the_report_and_the_summary_name_the_cpu(tmp_path: Path) -> None:
    """The JSON names the CPU in words (model name, generation where known, family and model),
    and the run's summary says it is the machine its figures are from."""
    report, stdout, _ = _run(
        tmp_path,
        ["gather_rows", "--cases", "decode_T64_bf16$"],
        QWEN4EXP_BENCH_GATHER_ROWS=str(GATHER_ROWS),
    )
    facts = report["cpu"]
    assert report["cpu_model"] == machine.cpu_text(facts)
    assert report["cpu_model"].startswith(facts["model_name"])
    assert f"family {facts['family']} model {facts['model']}" in report["cpu_model"]
    summary = next(line for line in stdout.splitlines() if line.startswith("summary ("))
    assert summary.startswith(f"summary (1 thread) on {report['cpu_model']}: ")


def test_cpu_generations() -> None:
    """A VM's "AMD EPYC" or "Intel Xeon Processor" gets its generation from family and model."""
    assert machine.cpu_generation("AuthenticAMD", "25", "17") == "Zen 4"
    assert machine.cpu_generation("AuthenticAMD", "25", "1") == "Zen 3"
    assert machine.cpu_generation("AuthenticAMD", "26", "2") == "Zen 5"
    assert machine.cpu_generation("GenuineIntel", "6", "143") == "Sapphire Rapids"
    assert machine.cpu_generation("GenuineIntel", "6", "85") == "Skylake/Cascade Lake"
    assert machine.cpu_generation("GenuineIntel", "6", "1") is None
    assert machine.cpu_generation(None, None, None) is None
    assert machine.cpu_generation("AuthenticAMD", "x", "17") is None
    facts = {"model_name": "AMD EPYC", "family": "25", "model": "17", "generation": "Zen 4"}
    assert machine.cpu_text(facts) == "AMD EPYC (Zen 4, family 25 model 17)"
    assert machine.cpu_text({"model_name": "Some CPU"}) == "Some CPU"


def test_path_text_and_the_summary_heading() -> None:
    paths = {"gather": "stream", "fp8_lookup": None, "hash": "avx512"}
    assert runner.path_text(paths) == "stream/-/avx512"
    assert runner.path_text({"gather": None, "fp8_lookup": None, "hash": None}) == "-"
    assert runner.path_text(None) == "-"
    result = {
        "op": "gather_rows",
        "case": "decode_T64_bf16",
        "threads": 1,
        "baseline": "index_select",
        "speedup": 2.0,
        "pct_of_copy": 50.0,
    }
    lines = bench_report.summary_lines([result], ["gather_rows"], [1], "AMD EPYC (Zen 4)")
    assert lines[0].startswith("summary (1 thread) on AMD EPYC (Zen 4): ")
    assert bench_report.summary_lines([result], ["gather_rows"], [1])[0].startswith(
        "summary (1 thread): "
    )
