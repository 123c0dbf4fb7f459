"""Smoke tests of the benchmark CLI: it runs, checks, and writes a well-formed report.

No timing thresholds: shared CI machines are too noisy for them; the numbers only have to exist.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import torch

import qwen4exp_ext
from qwen4exp_ext import ops
from qwen4exp_ext.bench import args as bench_args
from qwen4exp_ext.bench import cli, machine, runner, vllm_triton
from qwen4exp_ext.bench import report as bench_report
from qwen4exp_ext.bench import rows as bench_rows
from qwen4exp_ext.bench.cli import main
from qwen4exp_ext.bench.registry import HEADLINE_CASES, HEADLINE_PHASES, OP_MODULES
from qwen4exp_ext.bench.runner import QUICK_REPEAT
from qwen4exp_ext.testing import HC_OPS, exact_mismatch
from vllm_support import require_vllm, run_python, vllm_version

NGRAM_IDS_CASES = {
    "decode_T1",
    "decode_T8",
    "decode_T64",
    "decode_T256",
    "prefill_T64_R1",
    "prefill_T8192_R4",
}
TIMED = ("ours", "oracle", "copy")
THREADS = bench_args._thread_counts("1,all", torch.get_num_threads())  # [1] on a one-core machine


def _timed(q: dict) -> None:
    assert 0 < q["min_us"] <= q["p20_us"] <= q["p50_us"] <= q["p80_us"]
    assert q["n"] == QUICK_REPEAT


@pytest.fixture(scope="module")
def ngram_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One quick ``ngram_ids`` run at the default thread counts, with --json, --csv and --plot,
    its stdout and stderr captured: shared by the tests of the report's outputs."""
    out = tmp_path_factory.mktemp("bench")
    paths = {ext: out / f"bench.{ext}" for ext in ("json", "csv", "png")}
    printed, progress = io.StringIO(), io.StringIO()
    before = torch.get_num_threads()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(progress):
        argv = ["ngram_ids", "--quick", "--json", str(paths["json"])]
        argv += ["--csv", str(paths["csv"])]
        if importlib.util.find_spec("matplotlib") is not None:  # a test dependency
            argv += ["--plot", str(paths["png"])]
        assert main(argv) == 0
    assert torch.get_num_threads() == before  # restored after every case
    return {
        "report": json.loads(paths["json"].read_text()),
        "paths": paths,
        "stdout": printed.getvalue(),
        "stderr": progress.getvalue(),
    }


def test_quick_run_writes_complete_json(ngram_run: dict) -> None:
    report = ngram_run["report"]
    for key in ("device", "device_type", "torch", "build_info", "date", "results", "sections"):
        assert key in report
    assert report["device"]
    assert report["device_type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    # The host CPU and the source, which a VM's model name and a file name leave out.
    cpu = report["cpu"]
    if cpu is not None:  # Linux
        assert cpu["model_name"] and cpu["family"] is not None and cpu["model"] is not None
        # torch's own reading of the CPU agrees (its kernels' dispatch level).
        needs = {"AVX2": "avx2", "AVX512": "avx512f"}.get(torch.backends.cpu.get_cpu_capability())
        assert needs is None or needs in cpu["flags"]
    assert report["cpu_conv_silu_lookup"] in ("loop", "gather")
    assert report["cpu_gather_fp8_lookup"] == ops.cpu_gather_fp8_lookup()
    source = report["source"]
    assert source is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", source)
    assert report["torch"] == torch.__version__
    assert report["thread_counts"] == THREADS
    assert report["complete"] is True
    assert not ngram_run["paths"]["json"].with_name("bench.json.partial").exists()
    results = report["results"]
    assert {r["case"] for r in results} == NGRAM_IDS_CASES
    # Every case once per thread count, the counts of one case side by side.
    assert [r["threads"] for r in results] == THREADS * len(NGRAM_IDS_CASES)
    for r in results:
        assert r["op"] == "ngram_ids"
        assert r["check"] is True
        for who in TIMED:
            _timed(r[who])
        # The headline baseline, transformers' own hashing, timed beside ours and the oracle.
        assert r["baseline"] == "transformers"
        assert set(r["baselines"]) == {"transformers"}
        _timed(r["baselines"]["transformers"])
        ours_p50 = r["ours"]["p50_us"]
        assert r["speedup"] == pytest.approx(r["baselines"]["transformers"]["p50_us"] / ours_p50)
        assert r["speedups"] == {"transformers": pytest.approx(r["speedup"])}
        assert r["speedup_vs_oracle"] == pytest.approx(r["oracle"]["p50_us"] / ours_p50)
        assert r["tokens"] == r["params"]["T"] > 0
        assert all(r["tokens_per_s"][who] > 0 for who in ("ours", "oracle", "transformers"))
        # ids in (int32) + ids out (16 int64 heads) at the least
        assert r["bytes"] >= r["tokens"] * (4 + 16 * 8)
        assert r["copy_bytes"] >= r["bytes"]
        assert all(r["gbps"][who] > 0 for who in (*TIMED, "transformers"))
        assert r["pct_of_copy"] > 0
        # The roofline: the case's bytes at each GPU's datasheet HBM bandwidth (TB/s).
        for gpu, tbps in {"MI300X": 5.3, "MI325X": 6.0, "MI355X": 8.0, "H200": 4.8}.items():
            assert r["roofline_us"][gpu] == pytest.approx(r["bytes"] / (tbps * 1e12) * 1e6)
        if report["device_type"] == "cpu":
            assert r["pct_of_peak"] is None
    # The long prefill must cross document boundaries, or the EOS path goes untimed.
    by_case = {r["case"]: r for r in results}
    assert by_case["prefill_T8192_R4"]["params"]["eos_tokens"] > 0


def test_table_shows_the_baseline_and_the_oracle(ngram_run: dict) -> None:
    lines = ngram_run["stdout"].splitlines()
    header = next(line for line in lines if line.startswith("op "))
    for column in ("thr", "ours p50 µs", "baseline", "base p50 µs", "speedup", "oracle p50 µs"):
        assert column in header
    rows = [line.split() for line in lines if line.startswith("ngram_ids ")]
    assert len(rows) == len(NGRAM_IDS_CASES) * len(THREADS)
    assert all(row[5] == "transformers" for row in rows)
    assert sorted({int(row[2]) for row in rows}) == sorted(THREADS)


def test_progress_lines_on_stderr(ngram_run: dict) -> None:
    """Not a terminal: one plain line per case and thread count, numbered within the op."""
    lines = ngram_run["stderr"].splitlines()
    total = len(NGRAM_IDS_CASES) * len(THREADS)
    assert f"[1/{total}] ngram_ids decode_T1 (1 thread)..." in lines
    assert any(line.startswith(f"[{total}/{total}] ngram_ids prefill_T8192_R4 (") for line in lines)
    assert "\r" not in ngram_run["stderr"]


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = bench_report._Progress(stream)
    progress.show("[1/2] op a (1 thread)...")
    progress.show("[2/2] op b (1 thread)...")
    progress.clear()
    text = stream.getvalue()
    assert "\n" not in text
    assert text.count("\r\x1b[K") == 3 and text.endswith("\r\x1b[K")


def test_csv_has_a_row_per_case_and_thread_count(ngram_run: dict) -> None:
    import csv

    with ngram_run["paths"]["csv"].open() as f:
        rows = list(csv.DictReader(f))
    results = ngram_run["report"]["results"]
    assert len(rows) == len(results) == len(NGRAM_IDS_CASES) * len(THREADS)
    for row, r in zip(rows, results, strict=True):
        assert (row["op"], row["case"], int(row["threads"])) == (r["op"], r["case"], r["threads"])
        assert row["baseline"] == "transformers"
        assert float(row["speedup"]) == pytest.approx(r["speedup"])
        assert float(row["pct_of_copy"]) == pytest.approx(r["pct_of_copy"])
        for who, key in (("ours", "ours"), ("oracle", "oracle"), ("copy", "copy")):
            assert float(row[f"p50_us_{who}"]) == pytest.approx(r[key]["p50_us"])
        assert float(row["p50_us_transformers"]) == pytest.approx(
            r["baselines"]["transformers"]["p50_us"]
        )


def test_plot_is_a_png(ngram_run: dict) -> None:
    pytest.importorskip("matplotlib")
    data = ngram_run["paths"]["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_without_matplotlib_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as exc:
        main(["ngram_ids", "--quick", "--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_thread_counts() -> None:
    assert bench_args._thread_counts("1,all", 8) == [1, 8]
    assert bench_args._thread_counts("all", 8) == [8]
    assert bench_args._thread_counts("2, 1 ,2", 8) == [2, 1]
    assert bench_args._thread_counts("1,all", 1) == [1]
    for bad in ("0", "x", "1,", "-1"):
        with pytest.raises(ValueError):
            bench_args._thread_counts(bad, 8)
    with pytest.raises(SystemExit) as exc:
        main(["ngram_ids", "--quick", "--threads", "0"])
    assert exc.value.code == 2


def test_orders_balance_predecessors() -> None:
    """Each contender follows every other equally often (a call's cache and TLB state depends on
    the call before it), and each order holds every contender once."""
    from collections import Counter

    from qwen4exp_ext.bench.timing import balanced_orders

    for n in range(1, 9):
        rows = balanced_orders(n)
        assert all(sorted(row) == list(range(n)) for row in rows), n
        pairs = Counter((row[j], row[j + 1]) for row in rows for j in range(n - 1))
        assert len(pairs) == n * (n - 1), n
        assert len(set(pairs.values())) <= 1, (n, pairs)


def test_before_call_runs_before_every_call_untimed() -> None:
    """Case.before_call (the cold file cases' page drop) runs before each call, warm-up rounds
    included, and its time is in no sample: a 20 ms sleep before a call that does nothing."""
    from qwen4exp_ext.bench.timing import time_interleaved

    calls = {"before": 0, "a": 0, "b": 0}

    def before() -> None:
        calls["before"] += 1
        time.sleep(0.02)

    def count(name: str):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    fns = {"a": count("a"), "b": count("b")}
    times = time_interleaved(fns, torch.device("cpu"), warmup=1, repeat=4, before_call=before)
    assert calls == {"before": 10, "a": 5, "b": 5}
    assert all(q.n == 4 and q.mean_us < 10_000 for q in times.values())


def test_percent_of_the_datasheet_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a listed GPU, ours as a % of its HBM peak: 2400 GB/s on an H200 (4.8 TB/s) is 50%; an
    MI325X is not taken for another MI300-series part; an unlisted GPU or a CPU gives None."""
    gpu = torch.device("cuda")
    for name, expected in (
        ("NVIDIA H200", 50.0),
        ("AMD Instinct MI325X", 40.0),
        ("AMD Instinct MI300X", 2400 / 53),
        ("AMD Instinct MI355X", 30.0),
        ("NVIDIA A100-SXM4-80GB", None),
    ):
        monkeypatch.setattr(machine, "device_name", lambda device, name=name: name)
        got = machine.pct_of_peak(2400.0, gpu)
        assert got == (None if expected is None else pytest.approx(expected)), name
    assert machine.pct_of_peak(2400.0, torch.device("cpu")) is None


def test_wrong_kernel_fails_the_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = ops.ngram_ids

    def off_by_one(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)
        out[-1, -1] += 1
        return out

    monkeypatch.setattr(ops, "ngram_ids", off_by_one)
    path = tmp_path / "bench.json"
    argv = ["ngram_ids", "--quick", "--device", "cpu", "--threads", "1", "--json", str(path)]
    assert main(argv) == 1
    # Every case failed, none was timed, and the report says which failed and why.
    report = json.loads(path.read_text())
    assert report["results"] == []
    failures = report["check_failures"]
    assert failures and all(f.startswith("ngram_ids/") for f in failures)
    assert len(failures) == len({f.split(" ")[0] for f in failures})


def test_a_run_cut_short_keeps_its_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The JSON is rewritten after every case: a run stopped in its third case (a time limit,
    Ctrl-C, a crash) leaves the first two, marked incomplete."""
    real, calls = cli._run_case, []

    def stopped_in_the_third(*args: object, **kwargs: object) -> dict:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "_run_case", stopped_in_the_third)
    path = tmp_path / "bench.json"
    argv = ["ngram_ids", "--quick", "--threads", "1", "--json", str(path)]
    with pytest.raises(KeyboardInterrupt), contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    report = json.loads(path.read_text())
    assert report["complete"] is False
    assert [r["case"] for r in report["results"]] == ["decode_T1", "decode_T8"]
    assert report["device"] and report["thread_counts"] == [1]


def test_cases_filter(tmp_path: Path) -> None:
    """--cases runs only the matching cases and records the pattern; a bad pattern or one that
    matches nothing is a usage error."""
    path = tmp_path / "bench.json"
    argv = ["ngram_ids", "--quick", "--threads", "1", "--cases", "^decode_T(1|64)$"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([*argv, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["cases"] == "^decode_T(1|64)$"
    assert sorted(r["case"] for r in report["results"]) == ["decode_T1", "decode_T64"]
    with pytest.raises(SystemExit) as exc:
        main(["ngram_ids", "--quick", "--cases", "(unclosed"])
    assert exc.value.code == 2
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["ngram_ids", "--quick", "--threads", "1", "--cases", "no_such_case"]) == 2


# Every op's case names on a CPU (the GPU adds gather_rows' pinned_* cases), as the bench builds
# them: what the default selection is tested on without building the inputs (about 35 s here).
# The fused decode projections (bench/hc_fused.py), in registry.FULL_ONLY_OPS.
FUSED_HC_OPS = ("hc_up_gate_mix", "hc_down_silu_inject")
CPU_CASES = {
    "ngram_ids": sorted(NGRAM_IDS_CASES),
    "gather_rows": [
        f"{phase}_T{t}_{kind}"
        for kind in ("bf16", "fp8", "nvfp4")
        for phase, t in (("decode", 1), ("decode", 8), ("decode", 64), ("decode", 256))
        + (("prefill", 8192),)
    ]
    + ["decode_T64_bf16_repeated", "prefill_T8192_bf16_repeated", "prefill_T8192_bf16_dup1024"]
    + ["prefill_T8192_bf16_sorted", "prefill_T8192_bf16_hugepages"],
    "ngram_gather_rows": [
        "decode_T1",
        "decode_T8",
        "decode_T64",
        "decode_T256",
        "prefill_T8192_R4",
    ],
    "ple_gate": [
        f"{name}{fast}"
        for name in ("decode_T1", "decode_T8", "decode_T64", "decode_T256")
        + ("spec_q2_R64", "spec_q4_R64", "prefill_T8192")
        for fast in ("", "_fast")
    ],
    "ple_conv": ["decode_R1", "decode_R8", "decode_R64", "decode_R256", "spec_q2_R64"]
    + ["spec_q4_R64", "prefill_T8192_R4", "decode_R64_ds", "prefill_T8192_R4_ds"],
    "host_lookup": [
        f"{phase}_T{t}_{fmt}"
        for fmt in ("bf16", "fp8", "nvfp4")
        for phase, t in (("decode", 1), ("decode", 64), ("decode", 256), ("prefill", 8192))
    ]
    + [
        f"staged_{phase}_T{t}_{fmt}_{source}"
        for fmt in ("bf16", "fp8", "nvfp4")
        for source in ("ram", "warm", "cold")
        if fmt == "bf16" or source == "ram"
        for phase, t in (("decode", 1), ("decode", 64), ("decode", 256), ("prefill", 8192))
        if not (source == "cold" and phase == "prefill")
    ],
    "vllm_disk_offload": [
        f"stage_{p}_bf16_{s}" for p in ("decode_T64", "prefill_T8192") for s in ("warm", "cold")
    ],
    **{op: ["decode_T16", "decode_T64", "prefill_T8192"] for op in HC_OPS},
    "hc_module": ["decode_T1", "decode_T16", "decode_T64", "prefill_T8192"],
    **{op: ["decode_T1", "decode_T4", "decode_T16"] for op in FUSED_HC_OPS},
}
# Of those, every variant of the headline shapes (formats, id patterns, the fast gate, the
# dim-first conv state): what tools/check-gpu.sh benches, registry.HEADLINE_CASES.
HEADLINE_VARIANTS = {
    "ngram_ids": {"decode_T64", "prefill_T8192_R4"},
    "gather_rows": {
        f"{shape}_{variant}"
        for shape in ("decode_T64", "prefill_T8192")
        for variant in ("bf16", "fp8", "nvfp4", "bf16_repeated")
    }
    | {f"prefill_T8192_bf16_{v}" for v in ("dup1024", "sorted", "hugepages")},
    "ngram_gather_rows": {"decode_T64", "prefill_T8192_R4"},
    "ple_gate": {"decode_T64", "decode_T64_fast", "prefill_T8192", "prefill_T8192_fast"},
    "ple_conv": {"decode_R64", "decode_R64_ds", "prefill_T8192_R4", "prefill_T8192_R4_ds"},
    "host_lookup": {
        f"{p}_{f}" for p in ("decode_T64", "prefill_T8192") for f in ("bf16", "fp8", "nvfp4")
    }
    | {f"staged_{p}_{f}_ram" for p in ("decode_T64", "prefill_T8192") for f in ("fp8", "nvfp4")}
    | {f"staged_{p}_bf16_{s}" for p in ("decode_T64", "prefill_T8192") for s in ("ram", "warm")}
    | {"staged_decode_T64_bf16_cold"},
    "vllm_disk_offload": set(CPU_CASES["vllm_disk_offload"]),
    **{op: {"decode_T64", "prefill_T8192"} for op in (*HC_OPS, "hc_module")},
    **{op: set() for op in FUSED_HC_OPS},  # decode T <= 16 only
}
# The representative subset: each op's headline case of each phase, in its default format and
# layout (the first of its cases at that shape).
HEADLINE = {
    "ngram_ids": {"decode_T64", "prefill_T8192_R4"},
    "gather_rows": {"decode_T64_bf16", "prefill_T8192_bf16"},
    "ngram_gather_rows": {"decode_T64", "prefill_T8192_R4"},
    "ple_gate": {"decode_T64", "prefill_T8192"},
    "ple_conv": {"decode_R64", "prefill_T8192_R4"},
    "host_lookup": {"decode_T64_bf16", "prefill_T8192_bf16"},
    **{op: {"decode_T64", "prefill_T8192"} for op in (*HC_OPS, "hc_module")},
}


def _selection(argv: list[str]) -> tuple[argparse.Namespace, dict[str, set[str]]]:
    """The parsed arguments and the cases of CPU_CASES the run would time, by op."""
    args, _ = bench_args.parse_args(argv)
    ops_ = bench_args.selected_ops(args)
    return args, {op: set(bench_args.selected_case_names(args, CPU_CASES[op])) for op in ops_}


def test_case_names_cover_every_op() -> None:
    assert set(CPU_CASES) == set(OP_MODULES)
    assert all(len(set(names)) == len(names) for names in CPU_CASES.values())


def test_default_selection_is_the_headline_cases_of_every_op() -> None:
    """No op and no --cases: each op's headline case of each phase (decode T = 64 or R = 64,
    prefill T = 8192) and no other, at both thread counts on a CPU."""
    args, selected = _selection([])
    assert args.subset
    assert selected == HEADLINE
    for op, names in selected.items():
        for phase, pattern in HEADLINE_PHASES.items():
            assert sum(bool(re.search(pattern, n)) for n in names) == 1, (op, phase)
    if not torch.cuda.is_available():
        assert bench_args.parse_args([])[1] == THREADS
    assert bench_args.parse_args(["--threads", "1"])[1] == [1]
    # check-gpu.sh's --cases: every variant of those shapes, the subset's among them.
    args, variants = _selection(["--cases", HEADLINE_CASES])
    assert not args.subset and variants == HEADLINE_VARIANTS
    assert all(HEADLINE[op] <= variants[op] for op in HEADLINE)


def test_full_and_explicit_selections_pick_every_case() -> None:
    """--full, or naming ops, runs every case (of the ops named); --cases still filters; --full
    with --cases is a usage error."""
    args, selected = _selection(["--full"])
    assert not args.subset
    assert selected == {op: set(names) for op, names in CPU_CASES.items()}
    args, selected = _selection(["ngram_ids", "ple_conv"])
    assert not args.subset and selected == {
        op: set(CPU_CASES[op]) for op in ("ngram_ids", "ple_conv")
    }
    args, selected = _selection(["--cases", "^decode_T1$"])
    assert not args.subset
    assert {op: names for op, names in selected.items() if names} == {
        "ngram_ids": {"decode_T1"},
        "ngram_gather_rows": {"decode_T1"},
        "ple_gate": {"decode_T1"},
        "hc_module": {"decode_T1"},
        **{op: {"decode_T1"} for op in FUSED_HC_OPS},
    }
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        bench_args.parse_args(["--full", "--cases", "decode"])
    assert exc.value.code == 2


def _result(op: str, case: str, threads: int, speedup: float, pct: float) -> dict:
    return {
        "op": op,
        "case": case,
        "threads": threads,
        "baseline": "index_select" if op == "gather_rows" else "transformers",
        "speedup": speedup,
        "pct_of_copy": pct,
    }


def test_summary_has_one_line_per_op_with_both_figures() -> None:
    """From the results alone: per op, the first decode and first prefill headline case, its
    speedup over the headline baseline and its % of copy at each thread count."""
    results = [
        _result("ngram_ids", "decode_T1", 1, 9.0, 9.0),  # not a headline case
        _result("ngram_ids", "decode_T64", 1, 10.0, 20.0),
        _result("ngram_ids", "decode_T64", 2, 15.0, 30.0),
        _result("ngram_ids", "prefill_T8192_R4", 1, 3.0, 40.0),
        _result("ngram_ids", "prefill_T8192_R4", 2, 5.5, 60.25),
        _result("gather_rows", "decode_T64_bf16", 1, 2.0, 50.0),
        _result("gather_rows", "decode_T64_fp8", 1, 7.0, 70.0),  # a later variant: left out
        _result("gather_rows", "prefill_T8192_bf16", 2, 1.5, 80.0),  # its 1-thread check failed
    ]
    lines = bench_report.summary_lines(results, ["ngram_ids", "gather_rows", "ple_gate"], [1, 2])
    assert len(lines) == 4
    assert lines[0].startswith("summary (1 / 2 threads): ")
    assert "headline baseline" in lines[0] and "% copy" in lines[0]
    assert (
        lines[1].split()
        == (
            "ngram_ids: decode_T64 10.00x / 15.00x transformers, 20.0 / 30.0 % copy;"
            " prefill_T8192_R4 3.00x / 5.50x transformers, 40.0 / 60.2 % copy"
        ).split()
    )
    assert (
        lines[2].split()
        == (
            "gather_rows: decode_T64_bf16 2.00x / - index_select, 50.0 / - % copy;"
            " prefill_T8192_bf16 - / 1.50x index_select, - / 80.0 % copy"
        ).split()
    )
    assert lines[3].split()[0] == "ple_gate:" and "no headline case ran" in lines[3]
    gpu = bench_report.summary_lines(
        [_result("ple_gate", "prefill_T8192", 8, 4.0, 90.0)], ["ple_gate"], [8]
    )
    assert gpu[0].startswith("summary (8 threads): ")
    assert gpu[1].split() == "ple_gate: prefill_T8192 4.00x transformers, 90.0 % copy".split()


def test_a_run_ends_with_its_summary(ngram_run: dict) -> None:
    """The last lines of a run: the summary of its headline cases, from the figures it printed."""
    lines = ngram_run["stdout"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("summary ("))
    assert (
        lines[start + 1 :]
        == bench_report.summary_lines(ngram_run["report"]["results"], ["ngram_ids"], THREADS)[1:]
    )
    assert len(lines) == start + 2
    by_case = {(r["case"], r["threads"]): r for r in ngram_run["report"]["results"]}
    for case in ("decode_T64", "prefill_T8192_R4"):
        figures = " / ".join(f"{by_case[case, n]['speedup']:.2f}x" for n in THREADS)
        assert f"{case} {figures} transformers" in lines[-1]


def test_references_and_derived_fields(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A case's references are timed with its contenders (JSON "references", CSV p50 columns),
    its derived fields join the result, and a derived "summary" prints under the row; a derived
    field may not replace one of the CLI's, nor a reference take a contender's name."""
    from qwen4exp_ext.bench import registry
    from qwen4exp_ext.bench.registry import Case

    calls: list[str] = []

    def fn(who: str):
        return lambda: calls.append(who) or torch.zeros(4)

    def derive(times):
        return {"gap_us": times["slow"].p50_us - times["ours"].p50_us, "summary": "gap line"}

    case = Case(
        op="toy",
        name="one",
        tokens=4,
        nbytes=16,
        ours=fn("ours"),
        oracle=fn("oracle"),
        baselines={"base": fn("base")},
        params={},
        references={"slow": fn("slow")},
        derive=derive,
    )
    monkeypatch.setitem(registry.OP_MODULES, "toy", "toy")
    monkeypatch.setattr(cli, "load_cases", lambda op, device: [case])
    monkeypatch.setattr(cli, "load_sections", lambda op, device: [])
    path, table = tmp_path / "toy.json", tmp_path / "toy.csv"
    argv = ["toy", "--quick", "--threads", "1", "--json", str(path), "--csv", str(table)]
    assert main(argv) == 0
    (r,) = json.loads(path.read_text())["results"]
    _timed(r["references"]["slow"])
    # As often as ours, less the check's call (a reference is never checked).
    assert calls.count("slow") + 1 == calls.count("ours") == calls.count("base") > 1
    assert r["gap_us"] == pytest.approx(r["references"]["slow"]["p50_us"] - r["ours"]["p50_us"])
    assert r["summary"] == "gap line" and "\n    gap line\n" in capsys.readouterr().out
    assert "p50_us_slow" in table.read_text().splitlines()[0]
    clashing = Case(**{**case.__dict__, "derive": lambda times: {"speedup": 0.0}})
    monkeypatch.setattr(cli, "load_cases", lambda op, device: [clashing])
    with pytest.raises(ValueError, match=r"derived fields \['speedup'\] are taken"):
        main(["toy", "--quick", "--threads", "1"])
    with pytest.raises(ValueError, match=r"reference names \['base'\] are taken"):
        Case(**{**case.__dict__, "references": {"base": fn("x")}})


def test_append_adds_one_row_per_case_and_thread_count(tmp_path: Path) -> None:
    """--append FILE adds a JSON line per case result and thread count, each with every field of
    ``bench_rows.ROW_FIELDS``; a second run appends after the first's rows, never over them."""
    path = tmp_path / "results" / "bench.jsonl"
    report_path = tmp_path / "bench.json"
    cases = "^decode_T(1|8)$"
    argv = ["ngram_ids", "--quick", "--cases", cases, "--append", str(path)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([*argv, "--json", str(report_path)]) == 0
    first = [json.loads(line) for line in path.read_text().splitlines()]
    report = json.loads(report_path.read_text())
    assert [(r["case"], r["threads"]) for r in first] == [
        (r["case"], r["threads"]) for r in report["results"]
    ]
    assert len(first) == 2 * len(THREADS)
    for row, r in zip(first, report["results"], strict=True):
        assert tuple(row) == bench_rows.ROW_FIELDS
        assert row["op"] == "ngram_ids"
        assert row["date"] == report["date"]
        assert datetime.fromisoformat(row["date"]).utcoffset() == timedelta(0)
        assert row["machine"] and row["device"] == report["device_type"]
        assert row["torch"] == torch.__version__
        if report["source"] is None:
            assert row["commit"] is None and row["dirty"] is None
        else:
            assert row["commit"] == report["source"][:7] and isinstance(row["dirty"], bool)
        assert row["ours_p50_us"] == pytest.approx(r["ours"]["p50_us"], abs=1e-3)
        assert row["baseline"] == "transformers"
        assert row["baseline_p50_us"] == pytest.approx(
            r["baselines"]["transformers"]["p50_us"], abs=1e-3
        )
        assert row["ours_p50_us"] > 0 and row["baseline_p50_us"] > 0
        assert row["speedup"] == pytest.approx(r["speedup"], abs=1e-4)
        assert (
            row["pct_of_copy"] == pytest.approx(r["pct_of_copy"], abs=0.01)
            and row["pct_of_copy"] > 0
        )
        vs_vllm = r["speedup_vs_vllm"]
        assert row["speedup_vs_vllm"] == (
            None if vs_vllm is None else pytest.approx(vs_vllm, abs=1e-4)
        )
        assert row["json"] == str(report_path)
    # Again, without --json: the rows go after the first run's, which stay as they were.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    both = [json.loads(line) for line in path.read_text().splitlines()]
    assert both[: len(first)] == first
    second = both[len(first) :]
    assert [(r["case"], r["threads"]) for r in second] == [(r["case"], r["threads"]) for r in first]
    assert all(tuple(r) == bench_rows.ROW_FIELDS and r["json"] is None for r in second)


def test_append_without_a_path_uses_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """--append alone is results/bench.jsonl; an op name after it is an op, not a file."""
    for argv in (["ngram_ids", "--append"], ["--append", "ngram_ids"]):
        args, _ = bench_args.parse_args(argv)
        assert args.append == bench_rows.DEFAULT_APPEND == Path("results", "bench.jsonl")
        assert args.ops == ["ngram_ids"]
    args, _ = bench_args.parse_args(["ngram_ids", "--append=out.jsonl"])
    assert args.append == Path("out.jsonl") and args.ops == ["ngram_ids"]
    assert bench_args.parse_args(["ngram_ids"])[0].append is None


def test_row_of_an_old_report_has_nulls_where_it_lacks_fields() -> None:
    """A report from before a field existed (no baseline, no source, no cpu facts) converts
    with nulls, never a wrong figure: its "speedup" was over the oracle, not a baseline."""
    report = {"date": "2026-11-30T03:14:45+00:00", "device": "AMD EPYC", "device_type": "cpu"}
    result = {"op": "gather_rows", "case": "decode_T1", "threads": 2, "speedup": 3.0}
    result |= {"ours": {"p50_us": 1.0}, "pct_of_copy": 50.0}
    row = bench_rows.bench_row(result, report | {"torch": "2.14.1"}, "old.json")
    assert tuple(row) == bench_rows.ROW_FIELDS
    assert row["machine"] == "AMD EPYC" and row["commit"] is None and row["dirty"] is None
    assert row["baseline"] is None and row["speedup"] is None and row["speedup_vs_vllm"] is None
    report |= {"source": "0c3c8c65cc191e66b3c963741605628167643395-dirty"}
    report |= {"cpu": {"model_name": "AMD EPYC", "family": "25", "model": "17"}}
    row = bench_rows.bench_row(result, report, None)
    assert (row["commit"], row["dirty"]) == ("0c3c8c6", True)
    assert row["machine"] == "AMD EPYC, family 25 model 17"


def test_unknown_op_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no_such_op", "--quick"])
    assert exc.value.code == 2


def test_module_help_runs() -> None:
    package_root = str(Path(qwen4exp_ext.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "qwen4exp_ext.bench", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for word in ("ngram_ids", "gather_rows", "ple_gate", "ple_conv", "--quick", "--threads"):
        assert word in proc.stdout


# --- gather_rows: NVFP4 cases, id patterns, pinned bytes per layer --------------------------------

GATHER_ROWS = 4096  # a small table: the quick run checks and times every case in seconds
GATHER_PREFILL = (
    1024  # T of the prefill cases here (8192 in the bench): the same code, 1/8 the time
)
NVFP4_CASES = {
    "decode_T1_nvfp4",
    "decode_T8_nvfp4",
    "decode_T64_nvfp4",
    "decode_T256_nvfp4",
    f"prefill_T{GATHER_PREFILL}_nvfp4",
}
# bf16 rows beyond the fresh ids of every case: hot (repeated), duplicate-heavy, sorted.
ID_PATTERN_CASES = {
    "decode_T64_bf16_repeated": "repeated",
    f"prefill_T{GATHER_PREFILL}_bf16_repeated": "repeated",
    f"prefill_T{GATHER_PREFILL}_bf16_dup1024": "dup1024",
    f"prefill_T{GATHER_PREFILL}_bf16_sorted": "sorted",
}
RELEASED_ROWS = 320_001_536  # R_pad of one released PLE layer (tests/test_layout.py)
D = 160
NH = 16


@pytest.fixture(scope="module")
def gather_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One quick ``gather_rows`` run (JSON report and printed output) on all threads only (the
    thread counts are ngram_run's), shared by the tests below."""
    from qwen4exp_ext.bench import gather_rows

    path = tmp_path_factory.mktemp("bench") / "gather.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("QWEN4EXP_BENCH_GATHER_ROWS", str(GATHER_ROWS))
        mp.setattr(gather_rows, "PREFILL_TOKENS", GATHER_PREFILL)
        argv = ["gather_rows", "--quick", "--threads", "all", "--json", str(path)]
        assert main(argv) == 0
    return json.loads(path.read_text()), printed.getvalue()


def test_gather_nvfp4_cases_run_checked(gather_report: tuple[dict, str]) -> None:
    report, printed = gather_report
    by_case = {r["case"]: r for r in report["results"]}
    expected = set(NVFP4_CASES)
    if report["device_type"] == "cuda":
        expected |= {f"pinned_decode_T{t}_nvfp4" for t in (1, 8, 64, 256)}
        expected.add(f"pinned_prefill_T{GATHER_PREFILL}_nvfp4")
    assert expected <= set(by_case)
    for name in expected:
        r = by_case[name]
        assert r["check"] is True
        assert all(r[who]["n"] == QUICK_REPEAT for who in TIMED)
        assert r["baseline"] == "index_select"
        assert set(r["baselines"]) == {"index_select", "embedding"}
        assert r["params"]["rows"] == GATHER_ROWS
        t = r["tokens"]
        # int64 ids read, d/2 packed bytes + d/16 e4m3 block scales read per row, bf16 out written.
        assert r["bytes"] == t * NH * 8 + t * NH * (D // 2 + D // 16) + t * NH * D * 2
        assert name in printed
    # Same rows in every format: the NVFP4 case reads 90 of the bf16 case's 320 bytes a row.
    bf16 = by_case[f"prefill_T{GATHER_PREFILL}_bf16"]
    assert bf16["params"]["rows"] == GATHER_ROWS
    nvfp4 = by_case[f"prefill_T{GATHER_PREFILL}_nvfp4"]
    assert bf16["bytes"] - nvfp4["bytes"] == GATHER_PREFILL * NH * (320 - 90)


def test_gather_nvfp4_check_compares_with_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qwen4exp_ext import reference
    from qwen4exp_ext.bench import gather_rows

    monkeypatch.setenv("QWEN4EXP_BENCH_GATHER_ROWS", str(GATHER_ROWS))
    monkeypatch.setattr(gather_rows, "PREFILL_TOKENS", GATHER_PREFILL)
    nvfp4 = [c for c in gather_rows.cases(torch.device("cpu")) if c.name in NVFP4_CASES]
    assert {c.name for c in nvfp4} == NVFP4_CASES
    assert all(case.check() is None for case in nvfp4)

    real_ops, real_ref = ops.gather_rows, reference.gather_rows

    def nudged(real):
        def fn(*args: object, **kwargs: object) -> torch.Tensor:
            out = real(*args, **kwargs)
            if kwargs.get("block_scales") is not None:
                out.view(-1)[-1] += 1
            return out

        return fn

    # A wrong kernel fails the check...
    monkeypatch.setattr(ops, "gather_rows", nudged(real_ops))
    assert all(case.check() is not None for case in nvfp4)
    # ...and so does a baseline that agrees with ours but not with reference.gather_rows.
    monkeypatch.setattr(ops, "gather_rows", real_ops)
    monkeypatch.setattr(reference, "gather_rows", nudged(real_ref))
    problems = [case.check() for case in nvfp4]
    assert all(p is not None and "reference.gather_rows" in p for p in problems)


def test_gather_every_case_against_index_select(gather_report: tuple[dict, str]) -> None:
    """The headline baseline of every case is index_select into a preallocated output, timed and
    checked beside ours and the oracle; the table names it."""
    report, printed = gather_report
    for r in report["results"]:
        assert r["op"] == "gather_rows" and r["check"] is True
        assert r["baseline"] == "index_select"
        assert next(iter(r["baselines"])) == "index_select"
        for q in r["baselines"].values():
            _timed(q)
        assert r["speedup"] == pytest.approx(
            r["baselines"]["index_select"]["p50_us"] / r["ours"]["p50_us"]
        )
        # F.embedding stays as a second baseline, except on the huge-page table.
        expected = {"index_select"} if "hugepages" in r["case"] else {"index_select", "embedding"}
        assert set(r["baselines"]) == expected
    names = {r["case"] for r in report["results"]}
    rows = [line.split() for line in printed.splitlines()]
    rows = [row for row in rows if row[:1] == ["gather_rows"] and row[1] in names]
    assert len(rows) == len(names) and all(row[5] == "index_select" for row in rows)


def test_gather_id_patterns(gather_report: tuple[dict, str]) -> None:
    report, printed = gather_report
    by_case = {r["case"]: r for r in report["results"]}
    assert set(ID_PATTERN_CASES) <= set(by_case)
    for name, pattern in ID_PATTERN_CASES.items():
        r = by_case[name]
        assert r["params"]["ids"] == pattern and r["check"] is True
        assert name in printed
        fresh = by_case[name.rsplit("_", 1)[0]]
        assert fresh["params"]["ids"] == "fresh"
        assert r["bytes"] == fresh["bytes"]  # the same lookups, only the ids differ
    prefill = f"prefill_T{GATHER_PREFILL}_bf16"
    assert by_case[f"{prefill}_repeated"]["params"]["id_batches"] == 1
    assert by_case["decode_T64_bf16_repeated"]["params"]["id_batches"] == 1
    # 1024 rows drawn from a 4096-row table: a few draws coincide.
    assert 700 < by_case[f"{prefill}_dup1024"]["params"]["distinct_rows"] <= 1024


def test_gather_id_batches_of_each_pattern() -> None:
    from qwen4exp_ext.bench import gather_rows

    gen = torch.Generator().manual_seed(0)
    fresh = torch.randint(0, 1 << 20, (3, 64, NH), generator=gen)
    sorted_ = gather_rows._patterned_ids("sorted", fresh, 1 << 20, gen)
    assert sorted_.shape == fresh.shape
    for batch, original in zip(sorted_, fresh, strict=True):
        assert torch.equal(batch.flatten(), original.flatten().sort().values)
    assert torch.equal(gather_rows._patterned_ids("repeated", fresh, 1 << 20, gen), fresh[:1])
    dup = gather_rows._patterned_ids("dup1024", fresh, 1 << 20, gen)
    assert dup.shape == (2, 64, NH) and dup.unique().numel() <= 1024


def _next_power_of_two(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def test_gather_pinned_bytes_per_layer(gather_report: tuple[dict, str]) -> None:
    report, printed = gather_report
    (section,) = [s for s in report["sections"] if s["name"] == "pinned_bytes"]
    assert section["op"] == "gather_rows"
    rows = {r["format"]: r for r in section["rows"]}
    assert set(rows) == {"bf16", "fp8", "nvfp4"}
    allocations = {
        "bf16": [RELEASED_ROWS * D * 2],
        "fp8": [RELEASED_ROWS * D],
        "nvfp4": [RELEASED_ROWS * D // 2, RELEASED_ROWS * D // 16],  # rows, block scales
    }
    for fmt, sizes in allocations.items():
        r = rows[fmt]
        assert r["rows"] == RELEASED_ROWS and r["d"] == D
        assert sorted(r["allocations"].values()) == sorted(sizes)
        assert r["table_bytes"] == sum(sizes)
        assert r["torch_pin_memory_bytes"] == sum(_next_power_of_two(n) for n in sizes)
        assert r["pinned_host_table_bytes"] == sum((n + 4095) // 4096 * 4096 for n in sizes)
    # The figures quoted for the released table: 47.7 GiB of fp8 pins 64 GiB through torch.
    assert rows["fp8"]["table_bytes"] == 51_200_245_760
    assert rows["fp8"]["torch_pin_memory_bytes"] == 64 << 30
    assert rows["fp8"]["pinned_host_table_bytes"] == 51_200_245_760
    assert rows["bf16"]["torch_pin_memory_bytes"] == 128 << 30
    assert rows["nvfp4"]["torch_pin_memory_bytes"] == (32 << 30) + (4 << 30)
    # The block scales (3,200,015,360 bytes) end 3 KiB into a page: 1 KiB of padding.
    assert rows["nvfp4"]["pinned_host_table_bytes"] == 28_800_138_240 + 1024
    assert "pinned_bytes" in printed and "64.00 GiB" in printed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measured pinned bytes need a GPU")
def test_gather_pinned_bytes_measured_on_the_gpu(gather_report: tuple[dict, str]) -> None:
    report, _ = gather_report
    (section,) = [s for s in report["sections"] if s["name"] == "pinned_bytes_measured"]
    for r in section["rows"]:
        assert r["torch_pin_memory_bytes"] >= r["table_bytes"]
        assert r["table_bytes"] <= r["pinned_host_table_bytes"] < r["table_bytes"] + 2 * 4096


# --- ple_gate and ple_conv, on shapes shrunk from the released ones -------------------------------


def _small_gate(monkeypatch: pytest.MonkeyPatch):
    from qwen4exp_ext.bench import ple_gate

    monkeypatch.setattr(ple_gate, "WIDTH", 64)
    monkeypatch.setattr(ple_gate, "CHANNELS", 64 * ple_gate.STREAMS)
    monkeypatch.setattr(ple_gate, "DECODE_TOKENS", (8,))
    monkeypatch.setattr(ple_gate, "SPEC_QUERY_LENS", (2,))
    monkeypatch.setattr(ple_gate, "SPEC_REQUESTS", 4)
    monkeypatch.setattr(ple_gate, "PREFILL_TOKENS", 64)
    return ple_gate


def _small_conv(monkeypatch: pytest.MonkeyPatch):
    from qwen4exp_ext.bench import ple_conv

    monkeypatch.setattr(ple_conv, "CHANNELS", 48)
    monkeypatch.setattr(ple_conv, "DECODE_REQUESTS", (ple_conv.DIM_FIRST_DECODE_REQUESTS,))
    monkeypatch.setattr(ple_conv, "SPEC_QUERY_LENS", (3,))
    monkeypatch.setattr(ple_conv, "SPEC_REQUESTS", 4)
    monkeypatch.setattr(ple_conv, "PREFILL_TOKENS", 40)
    monkeypatch.setattr(ple_conv, "PREFILL_REQUESTS", 4)
    return ple_conv


def _quick_report(op: str, tmp_path: Path) -> dict:
    path = tmp_path / f"{op}.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([op, "--quick", "--threads", "1", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_ple_gate_against_transformers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("transformers.models.qwen4_exp")
    _small_gate(monkeypatch)
    results = _quick_report("ple_gate", tmp_path)["results"]
    names = {"decode_T8", "spec_q2_R4", "prefill_T64"}
    assert {r["case"] for r in results} == names | {f"{n}_fast" for n in names}
    for r in results:
        assert r["op"] == "ple_gate" and r["check"] is True and r["threads"] == 1
        assert r["baseline"] == "transformers"
        _timed(r["baselines"]["transformers"])
        _timed(r["oracle"])


def test_ple_gate_check_covers_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers gate that computes something else fails the check (so its time would not
    be a like-for-like baseline), though ours still matches the oracle."""
    pytest.importorskip("transformers.models.qwen4_exp")
    ple_gate = _small_gate(monkeypatch)
    real = ple_gate._transformers_gate

    def off(weights):
        gate = real(weights)
        return lambda *args: tuple(t * 1.25 for t in gate(*args))

    monkeypatch.setattr(ple_gate, "_transformers_gate", off)
    for case in ple_gate.cases(torch.device("cpu")):
        problem = case.check()
        assert problem is not None and "transformers" in problem, case.name


def test_ple_conv_both_state_layouts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ple_conv = _small_conv(monkeypatch)
    results = _quick_report("ple_conv", tmp_path)["results"]
    by_case = {r["case"]: r for r in results}
    assert set(by_case) == {
        "decode_R64",
        "spec_q3_R4",
        "prefill_T40_R4",
        "decode_R64_ds",
        "prefill_T40_R4_ds",
    }
    for name, r in by_case.items():
        assert r["check"] is True
        assert r["params"]["state_layout"] == ("DS" if name.endswith("_ds") else "SD")
        assert r["baseline"] == "conv1d"
        assert {"conv1d", "conv1d_fp32"} <= set(r["baselines"])
        for q in r["baselines"].values():
            _timed(q)
    # The two layouts: window-first is a transposed view (channel stride 1), dim-first is
    # contiguous [slots, C, W] (window stride 1, channel stride W).
    storage = torch.zeros(3, 11, ple_conv.CHANNELS)
    sd = ple_conv._Contender(torch.zeros(1), storage, "SD").state
    ds = ple_conv._Contender(torch.zeros(1), storage, "DS").state
    assert sd.shape == ds.shape == (3, ple_conv.CHANNELS, 11)
    assert sd.stride()[1:] == (1, ple_conv.CHANNELS)
    assert ds.stride()[1:] == (11, 1)


def test_ple_conv_check_covers_conv1d(monkeypatch: pytest.MonkeyPatch) -> None:
    ple_conv = _small_conv(monkeypatch)
    real = torch.nn.functional.conv1d
    monkeypatch.setattr(ple_conv.F, "conv1d", lambda *a, **k: real(*a, **k) * 1.5)
    for case in ple_conv.cases(torch.device("cpu")):
        problem = case.check()
        assert problem is not None and "conv1d" in problem, case.name


# --- vLLM's Triton kernels from a carried copy of their source ------------------------------------


@require_vllm()
def test_vllm_kernels_from_a_carried_source(tmp_path: Path) -> None:
    """Where vLLM is not installed (the GPU machine): ``python -m qwen4exp_ext.bench.vllm_triton
    DIR`` copies its PLE kernels' source here, and with $QWEN4EXP_VLLM_SOURCE=DIR a process that
    cannot import vllm loads them from DIR; they run (Triton's interpreter here) and give what
    ours gives (fp16 "vllm" rounding on the CPU: vLLM's order, bit for bit)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "qwen4exp_ext.bench.vllm_triton", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    ple = tmp_path.joinpath("vllm", *vllm_triton.PLE_PATH)
    assert str(ple) in proc.stdout.split()
    installed = vllm_version()
    assert (tmp_path / vllm_triton.VERSION_FILE).read_text().strip() == installed
    out = run_python(
        f"""
        import sys
        sys.modules["vllm"] = None  # no vLLM in this process: find_spec and import both fail
        from qwen4exp_ext.bench import vllm_triton
        with vllm_triton.interpreter():
            import triton.language  # (its standard library for the interpreter: conftest.py)
        import torch
        from qwen4exp_ext import ops

        assert str(vllm_triton.ple_source_path()) == {str(ple)!r}, vllm_triton.ple_source_path()
        assert vllm_triton.vllm_source_version() == {installed!r}
        vllm = vllm_triton.load()
        g = torch.Generator().manual_seed(0)
        tokens, width, streams = 3, 100, 3
        kv = torch.randn(tokens, (streams + 1) * width, generator=g).half()
        key, value = kv[:, : streams * width], kv[:, streams * width :]
        hidden = (torch.randn(tokens, streams * width, generator=g) * 3).half()
        weights = [(torch.randn(streams * width, generator=g) * 0.2).half() for _ in range(3)]
        with vllm_triton.interpreter():
            theirs = vllm.ple_gate(key, value, hidden, *weights, 1e-6)
        ours = ops.ple_gate(key, value, hidden, *weights, 1e-6)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()
        print("carried source ok")
        """,
        env={vllm_triton.SOURCE_ENV: str(tmp_path)},
        bare=True,
    )
    assert "carried source ok" in out


def test_vllm_source_extract_usage() -> None:
    assert vllm_triton.main([]) == 2
    assert vllm_triton.main(["--help"]) == 2


def test_ngram_gather_rows_cases_run_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The fused op's cases run, each checked against the two ops it replaces and the oracle; a
    fused kernel off by one row fails the check."""
    from qwen4exp_ext.bench import ngram_gather_rows

    monkeypatch.setenv("QWEN4EXP_BENCH_GATHER_ROWS", str(GATHER_ROWS))
    monkeypatch.setattr(ngram_gather_rows, "PREFILL_TOKENS", GATHER_PREFILL)
    path = tmp_path / "fused.json"
    argv = ["ngram_gather_rows", "--quick", "--threads", "1", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    expected = {f"decode_T{t}" for t in (1, 8, 64, 256)} | {f"prefill_T{GATHER_PREFILL}_R4"}
    assert {r["case"] for r in report["results"]} == expected
    for r in report["results"]:
        assert r["check"] is True and list(r["baselines"]) == ["two_ops"], r["case"]

    real = ops.ngram_gather_rows

    def shifted(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)
        out.copy_(out.roll(1, dims=0))
        return out

    monkeypatch.setattr(ops, "ngram_gather_rows", shifted)
    argv = ["ngram_gather_rows", "--quick", "--threads", "1", "--cases", "decode_T8$"]
    assert main(argv) == 1


# --- host_lookup: a step proxy whose PLE tables are read from host memory -------------------------

HOST_LOOKUP_GPU_ONLY = ("h2d_copy_gbps", "pinned_gather_gbps", "pinned_gather_pct_of_h2d")
HOST_LOOKUP_ROW_BYTES = {"bf16": 2 * D, "fp8": D, "nvfp4": D // 2 + D // 16}


def _host_lookup_names() -> set[str]:
    """The step proxy's cases at the quick size."""
    from qwen4exp_ext.bench import step_proxy

    size = step_proxy.SIZES["quick"]
    shapes = [f"decode_T{t}" for t in size.decode_tokens] + [f"prefill_T{size.prefill_tokens}"]
    return {f"{shape}_{fmt}" for shape in shapes for fmt in step_proxy.FORMATS}


def _staged_names() -> set[str]:
    """The lookup-level cases (bench/staged_lookup.py) at the quick size: every format from RAM,
    bf16 from a warm and (decode only) a cold file."""
    from qwen4exp_ext.bench import staged_lookup, step_proxy

    size = step_proxy.SIZES["quick"]
    decode = [f"decode_T{t}" for t in size.decode_tokens]
    shapes = [*decode, f"prefill_T{size.prefill_tokens}"]
    names = {f"staged_{s}_{f}_ram" for s in shapes for f in staged_lookup.RAM_FORMATS}
    for fmt in staged_lookup.FILE_FORMATS:
        names |= {f"staged_{s}_{fmt}_warm" for s in shapes}
        names |= {f"staged_{s}_{fmt}_cold" for s in decode}
    return names


def _staged_names_on(report: dict) -> set[str]:
    """_staged_names of the report's device: no cold cases on a GPU."""
    names = _staged_names()
    if report["device_type"] == "cuda":
        names = {n for n in names if not n.endswith("_cold")}
    return names


def _step_results(report: dict) -> list[dict]:
    """The step proxy's cases (not the lookup-level staged_* nor a GPU's staged_step_*)."""
    return [r for r in report["results"] if re.match(r"(decode|prefill)_", r["case"])]


@pytest.fixture(scope="module")
def host_lookup_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One quick ``host_lookup`` run at toy widths (QWEN4EXP_BENCH_HOST_LOOKUP_SIZE=quick: every
    case in seconds), 1 thread, with --json and --csv, on this machine's default device."""
    from qwen4exp_ext.bench import step_proxy

    out = tmp_path_factory.mktemp("bench")
    paths = {ext: out / f"host_lookup.{ext}" for ext in ("json", "csv")}
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv(step_proxy.SIZE_ENV, "quick")
        argv = ["host_lookup", "--quick", "--threads", "1"]
        assert main([*argv, "--json", str(paths["json"]), "--csv", str(paths["csv"])]) == 0
    return {
        "report": json.loads(paths["json"].read_text()),
        "paths": paths,
        "stdout": printed.getvalue(),
    }


def test_host_lookup_writes_every_field_of_every_case(host_lookup_run: dict) -> None:
    """Every case ran, checked, with each path's step quantiles, exposed lookup time and
    overhead against the device path, the no-lookup step, the lookup bytes and notes."""
    report, printed = host_lookup_run["report"], host_lookup_run["stdout"]
    gpu = report["device_type"] == "cuda"
    results = _step_results(report)
    staged_steps = {f"staged_step_{name}" for name in _host_lookup_names()} if gpu else set()
    names = _host_lookup_names() | _staged_names_on(report) | staged_steps
    assert {r["case"] for r in report["results"]} == names
    ours_path = "pinned_pipeline" if gpu else "pipeline"
    for r in results:
        name, fmt = r["case"], r["params"]["format"]
        assert r["op"] == "host_lookup" and r["check"] is True and r["threads"] == 1
        assert r["ours_path"] == r["params"]["ours"] == ours_path
        assert r["baseline"] == "device"  # the headline: what the overhead is measured against
        assert r["params"]["decoder_layers"] == 6 and r["params"]["ple_layers"] == [2, 6]
        assert r["params"]["size"] == "quick"
        t = r["tokens"]
        assert t == r["params"]["T"] and name.endswith(f"_T{t}_{fmt}")
        assert r["lookup_bytes"] == r["bytes"] == 2 * t * NH * HOST_LOOKUP_ROW_BYTES[fmt]
        no_lookup = r["references"]["no_lookup"]
        _timed(no_lookup)
        _timed(r["oracle"])
        device = r["baselines"]["device"]["p50_us"]
        assert set(r["paths"]) == set(r["params"]["paths"]) >= {"device", ours_path}
        for path, p in r["paths"].items():
            step = r["ours"] if path == ours_path else r["baselines"][path]
            assert p["step"] == step
            _timed(p["step"])
            assert p["exposed_lookup_us"] == pytest.approx(step["p50_us"] - no_lookup["p50_us"])
            assert p["overhead_pct"] == pytest.approx(100 * (step["p50_us"] - device) / device)
        assert r["paths"]["device"]["overhead_pct"] == 0
        assert "no_lookup" in r["exposed_lookup_method"] and r["notes"]
        for key in HOST_LOOKUP_GPU_ONLY:
            assert key in r
        assert name in printed
    assert printed.count("exposed lookup µs: device ") == len(results)
    # The references are timed beside the contenders: the CSV has their p50 too.
    import csv

    with host_lookup_run["paths"]["csv"].open() as f:
        rows = [row for row in csv.DictReader(f) if re.match(r"(decode|prefill)_", row["case"])]
    assert [float(row["p50_us_no_lookup"]) for row in rows] == pytest.approx(
        [r["references"]["no_lookup"]["p50_us"] for r in results]
    )


def _gpu_claims(value: object, where: str = "") -> list[str]:
    """Where a result holds something of a GPU: a non-null field named for the link, the
    pinned tables or vLLM's kernels, or a path or contender of that name (a note, which says
    why such a field is null, claims nothing)."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{where}.{key}"
            if key.endswith("_note"):
                continue
            if re.search(r"pinned|h2d|vllm", key) and item is not None:
                found.append(here)
            found += _gpu_claims(item, here)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str) and re.fullmatch(r"pinned_\w+|vllm\w*|h2d\w*", item):
                found.append(f"{where}[{i}]")
            found += _gpu_claims(item, f"{where}[{i}]")
    return found


def test_host_lookup_claims_no_gpu_field_on_a_cpu(host_lookup_run: dict) -> None:
    report = host_lookup_run["report"]
    if report["device_type"] == "cuda":
        pytest.skip("the CPU's rows: this run was on a GPU")
    for r in _step_results(report):
        assert set(r["paths"]) == {"device", "pipeline", "staged"}
        assert set(r["baselines"]) == {"device", "staged"}
        assert set(r["references"]) == {"no_lookup"}
        assert all(r[key] is None for key in HOST_LOOKUP_GPU_ONLY)
        assert r["pct_of_peak"] is None
        assert any("no host-to-device link" in note for note in r["notes"])
        assert _gpu_claims(r) == [], r["case"]
    assert "(no host-to-device link on a CPU)" in host_lookup_run["stdout"]


def test_host_lookup_gpu_rows_have_the_pinned_paths(host_lookup_run: dict) -> None:
    report = host_lookup_run["report"]
    if report["device_type"] != "cuda":
        pytest.skip("needs a GPU")
    for r in _step_results(report):
        assert {"device", "pinned_sync", "pinned_pipeline"} <= set(r["paths"])
        assert set(r["references"]) == {"no_lookup", "h2d_copy", "pinned_gather"}
        assert all(r[key] > 0 for key in HOST_LOOKUP_GPU_ONLY)
        assert r["pinned_gather_pct_of_h2d"] == pytest.approx(
            100 * r["pinned_gather_gbps"] / r["h2d_copy_gbps"]
        )
        assert ("vllm_triton" in r["paths"]) == (r["params"]["vllm_kernels"] is not None)


def test_host_lookup_gpu_staged_steps_beside_zero_copy(host_lookup_run: dict) -> None:
    """On a GPU, each step shape also runs as staged_step_*: the staged transport's step (ours)
    beside the device and zero-copy steps, checked, timed by the wall clock."""
    report = host_lookup_run["report"]
    if report["device_type"] != "cuda":
        pytest.skip("needs a GPU")
    steps = [r for r in report["results"] if r["case"].startswith("staged_step_")]
    assert {r["case"] for r in steps} == {f"staged_step_{n}" for n in _host_lookup_names()}
    for r in steps:
        assert r["check"] is True and r["ours_path"] == "staged"
        assert set(r["paths"]) == {"device", "pinned_pipeline", "staged"}
        assert "wall clock" in r["notes"][0]


def test_host_lookup_staged_cases_check_and_derive(host_lookup_run: dict) -> None:
    """Every staged case checked its paths against the oracle and derived each path's rows/s
    and read GB/s, the file's sequential read, and a summary; ours is the staged pipeline of
    its source's reader."""
    report, printed = host_lookup_run["report"], host_lookup_run["stdout"]
    gpu = report["device_type"] == "cuda"
    staged = [r for r in report["results"] if re.match(r"staged_(decode|prefill)_", r["case"])]
    assert {r["case"] for r in staged} == _staged_names_on(report)
    ours_of = {"ram": "staged", "warm": "staged_mmap", "cold": "staged_direct"}
    headline_of = {"ram": "torch_gather", "warm": "memmap_fancy", "cold": "memmap_fancy"}
    for r in staged:
        source, fmt = r["params"]["source"], r["params"]["format"]
        assert r["check"] is True and r["case"].endswith(f"_{fmt}_{source}")
        assert r["ours_path"] == r["params"]["ours"] == ours_of[source]
        assert r["baseline"] == headline_of[source]
        assert r["vllm_baseline"] is None and "vLLM 0.33.0 has no" in r["vllm_note"]
        paths = set(r["paths"])
        expected = {"ram": {"staged", "torch_gather"}}.get(
            source, {"staged_mmap", "staged_direct", "memmap_fancy", "memmap_take"}
        )
        if source == "ram" and fmt != "bf16":
            expected = expected | {"decode_rows", "raw_rows"}
        if source == "ram" and gpu:
            expected = (
                expected | {"zero_copy"} | ({"staged_device_decode"} if fmt != "bf16" else set())
            )
        assert paths == expected == set(r["params"]["paths"])
        references = r.get("references", {})
        assert set(references) == ({"sequential_read"} if source != "ram" else set())
        for path, p in r["paths"].items():
            call = r["ours"] if path == r["ours_path"] else r["baselines"][path]
            assert p["call"] == call
            assert p["read_gbps"] == pytest.approx(r["lookup_bytes"] / (call["p50_us"] * 1e3))
        assert (r["sequential_read_gbps"] is None) == (source == "ram")
        assert r["summary"].splitlines()[0] in printed


def test_host_lookup_staged_check_catches_rows_that_differ(monkeypatch: pytest.MonkeyPatch):
    """A staged step whose rows are off by one element fails every staged case's check and the
    step proxy's, naming the staged path."""
    from qwen4exp_ext.layers import StagedStep

    host_lookup, _, proxy = _host_lookup_quick(monkeypatch)
    from qwen4exp_ext.bench import staged_lookup

    cases = staged_lookup.cases(proxy)
    real = StagedStep.rows

    def off(self, layer, timeout=None):
        rows = real(self, layer, timeout).clone()
        if rows.numel():
            rows.view(-1)[0] += 1
        return rows

    monkeypatch.setattr(StagedStep, "rows", off)
    for case in cases:
        problem = case.check()
        assert problem is not None and "staged" in problem.split("'s rows")[0], case.name
    # and the step proxy's staged path
    for case in host_lookup.cases(torch.device("cpu")):
        if re.match(r"(decode|prefill)_", case.name):
            problem = case.check()
            assert problem is not None and "staged's step output" in problem, case.name


def _host_lookup_quick(monkeypatch: pytest.MonkeyPatch):
    from qwen4exp_ext.bench import host_lookup, step_proxy

    monkeypatch.setenv(step_proxy.SIZE_ENV, "quick")
    size = step_proxy.size_for(torch.device("cpu"))
    return host_lookup, size, step_proxy.StepProxy(size, torch.device("cpu"))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_host_lookup_pipeline_step_equals_the_device_step(
    monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """One step with every lookup started at step entry gives the synchronous step's output and
    conv states bit for bit (decode and prefill); and the proxy is deterministic."""
    from qwen4exp_ext.layers import LookupPipeline

    host_lookup, size, proxy = _host_lookup_quick(monkeypatch)
    tables = host_lookup._tables(size, fmt, proxy.device, proxy.max_tokens)
    pipeline = LookupPipeline(tables.device)
    gen = torch.Generator().manual_seed(5)
    for tokens in (max(size.decode_tokens), size.prefill_tokens):
        batch = proxy.batches[tokens]
        batch.input_ids.copy_(torch.randint(0, host_lookup.VOCAB_SIZE, (tokens,), generator=gen))
        before = [s.clone() for s in proxy.conv_states()]
        outputs, states = [], []
        for run in range(3):  # device, device again, pipeline
            for state, saved in zip(proxy.conv_states(), before, strict=True):
                state.copy_(saved)
            out = proxy.step(tables.device, batch, pipeline if run == 2 else None)
            outputs.append(out.clone())
            states.append([s.clone() for s in proxy.conv_states()])
        assert _same_bits(outputs[0], outputs[1]) and _same_bits(outputs[0], outputs[2]), tokens
        for a, b in zip(states[0], states[2], strict=True):
            assert _same_bits(a, b)
        assert not _same_bits(states[0][0], before[0])  # the step did move the conv states


def test_host_lookup_check_catches_a_pipeline_with_other_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every case's check passes; a pipeline whose prefetched rows are off fails each case's."""
    from qwen4exp_ext.layers import LookupPipeline

    host_lookup, _, _ = _host_lookup_quick(monkeypatch)
    cases = host_lookup.cases(torch.device("cpu"))
    assert {c.name for c in cases} == _host_lookup_names() | _staged_names()
    assert all(case.check() is None for case in cases)
    cases = [case for case in cases if not case.name.startswith("staged_")]
    real = LookupPipeline.start_prefetch

    def off(self, input_ids, *args):
        real(self, input_ids, *args)
        rows = self.embeddings[1].prefetch_slot.rows
        rows[input_ids.numel() - 1, 0] += 1

    monkeypatch.setattr(LookupPipeline, "start_prefetch", off)
    for case in cases:
        problem = case.check()
        assert problem is not None and "pipeline's step output" in problem, case.name


def test_host_lookup_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen4exp_ext.bench import step_proxy

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(step_proxy.SIZE_ENV, raising=False)
    monkeypatch.delenv(step_proxy.ROWS_ENV, raising=False)
    assert step_proxy.size_for(cpu).name == "cpu" and step_proxy.size_for(gpu).name == "released"
    released = step_proxy.size_for(gpu)
    assert (released.hidden, released.hc_count, released.ffn) == (2560, 4, step_proxy.FFN)
    assert released.decode_tokens == (1, 64, 256) and released.prefill_tokens == 8192
    # The CPU preset scales only H (hence C): the same F, the same lookups.
    assert step_proxy.size_for(cpu).ffn == released.ffn
    monkeypatch.setenv(step_proxy.ROWS_ENV, "100000")
    assert step_proxy.size_for(cpu).rows == 100_000
    monkeypatch.setenv(step_proxy.SIZE_ENV, "huge")
    with pytest.raises(ValueError, match="choose one of released, cpu, quick"):
        step_proxy.size_for(cpu)


def test_host_lookup_stand_in_has_a_decoder_layers_active_parameters() -> None:
    """ACTIVE_PARAMS, counted from transformers' own linear-attention decoder layer at the
    released H (the rest of its config at Qwen4ExpTextConfig's defaults), its PLE excluded and
    only the routed experts a token uses counted; FFN is that over 2·H, rounded up to 64."""
    pytest.importorskip("transformers.models.qwen4_exp")
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextDecoderLayer

    from qwen4exp_ext.bench import step_proxy

    config = Qwen4ExpTextConfig(
        hidden_size=2560, ple_layer_ids=[2], ple_embed_dim=2560, eos_token_id=1
    )
    assert config.layer_types[1] == "linear_attention"
    with torch.device("meta"):
        layer = Qwen4ExpTextDecoderLayer(config, 1)
    params = {n: p.numel() for n, p in layer.named_parameters() if not n.startswith("ple.")}
    experts = sum(n for name, n in params.items() if ".experts." in name)
    active = sum(params.values()) - experts
    active += experts * config.num_experts_per_tok // config.num_experts
    assert active == step_proxy.ACTIVE_PARAMS
    ffn = step_proxy.FFN
    assert ffn % 64 == 0 and 0 <= 2 * 2560 * ffn - active < 2 * 2560 * 64


@require_vllm()
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_host_lookup_vllm_lookup_equals_ours(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """The vllm_triton path's lookup (the installed vLLM's kernels, Triton's CPU interpreter here):
    its rows equal our gather's, ids outside the table included, and for bf16 and fp8 a whole
    step through it equals the device step bit for bit. (NVFP4 rows are compared in fp32,
    rounded as a GPU stores them: the interpreter truncates fp32 to bf16,
    triton-lang/triton#8322.)"""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs on a machine without a GPU")
    kernels = vllm_triton.load_lookup_kernels(interpret=True)
    if kernels is None:
        pytest.skip("triton is not installed")
    host_lookup, size, proxy = _host_lookup_quick(monkeypatch)
    tables = host_lookup._tables(size, fmt, proxy.device, proxy.max_tokens)
    embedding = tables.device[0].ple_embedding
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, embedding.num_rows + 50, (9, NH), generator=gen)
    ids[0, :3] = torch.tensor([-1, embedding.num_rows, embedding.num_rows - 1])
    out_dtype = torch.float32 if fmt == "nvfp4" else torch.bfloat16
    ours = ops.gather_rows(embedding.table, ids, **embedding._dequant(), out_dtype=out_dtype)
    staging = torch.empty(9 * NH, D, dtype=torch.uint8)
    theirs = torch.full((9, NH * D), 7.0, dtype=out_dtype)
    with vllm_triton.interpreter():
        host_lookup.vllm_rows(kernels, embedding, ids, theirs, staging)
    assert exact_mismatch(theirs, ours, "rows", against="ours", bitwise=True) is None
    assert not bool((ours[0, : 2 * D] != 0).any())  # ids -1 and past the table: zero rows
    if fmt == "nvfp4":
        return
    batch = proxy.batches[max(size.decode_tokens)]
    batch.input_ids.copy_(torch.randint(0, host_lookup.VOCAB_SIZE, (batch.num_tokens,)))
    before = [s.clone() for s in proxy.conv_states()]
    want = proxy.step(tables.device, batch).clone()
    for state, saved in zip(proxy.conv_states(), before, strict=True):
        state.copy_(saved)
    replaced = [
        (la.ple_embedding, host_lookup.vllm_lookup(kernels, la.ple_embedding))
        for la in tables.device
    ]
    with vllm_triton.interpreter(), host_lookup.lookups_replaced(replaced):
        got = proxy.step(tables.device, batch)
    assert _same_bits(got, want)


# --- vLLM's own code as a contender: speedup_vs_vllm on every row vLLM implements ---------------

VS_VLLM_FIELDS = ("vllm_baseline", "speedup_vs_vllm", "vllm_note")


def test_speedup_vs_vllm_is_vllms_p50_over_ours() -> None:
    """The figure follows every speedup here: the contender's p50 over ours (> 1: ours is
    faster); None where a case names no vLLM baseline. A Case's vllm must be one of its
    baselines, and needs no note."""
    from qwen4exp_ext.bench.registry import Case
    from qwen4exp_ext.bench.timing import Quantiles

    def q(p50: float) -> Quantiles:
        return Quantiles(p50 * 0.9, p50, p50 * 1.1, p50 * 0.8, p50, 10)

    times = {"ours": q(4.0), "vllm": q(10.0), "other": q(2.0), "oracle": q(50.0)}
    assert runner.speedup_vs_vllm(times, "vllm") == pytest.approx(2.5)
    assert runner.speedup_vs_vllm(times, "other") == pytest.approx(0.5)  # ours slower: < 1
    assert runner.speedup_vs_vllm(times, None) is None
    fn = lambda: torch.zeros(1)  # noqa: E731
    base = dict(op="toy", name="c", tokens=1, nbytes=1, ours=fn, oracle=fn, params={})
    with pytest.raises(ValueError, match="is not a baseline"):
        Case(**base, baselines={"a": fn}, vllm="vllm")
    with pytest.raises(ValueError, match="needs no vllm_note"):
        Case(**base, baselines={"vllm": fn}, vllm="vllm", vllm_note="why")


def test_vs_vllm_in_the_json_csv_and_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A case that names its vLLM baseline gets speedup_vs_vllm in its row, its CSV row and the
    table's "vs vllm" column; one that names none gets nulls, its note, blanks and "-"."""
    from qwen4exp_ext.bench import registry
    from qwen4exp_ext.bench.registry import Case

    fn = lambda: torch.zeros(4)  # noqa: E731
    common = dict(op="toy", tokens=4, nbytes=16, ours=fn, oracle=fn, params={})
    with_vllm = Case(name="with", baselines={"base": fn, "theirs": fn}, vllm="theirs", **common)
    without = Case(name="without", baselines={"base": fn}, vllm_note="no GPU here", **common)
    monkeypatch.setitem(registry.OP_MODULES, "toy", "toy")
    monkeypatch.setattr(cli, "load_cases", lambda op, device: [with_vllm, without])
    monkeypatch.setattr(cli, "load_sections", lambda op, device: [])
    path, table = tmp_path / "toy.json", tmp_path / "toy.csv"
    argv = ["toy", "--quick", "--threads", "1", "--json", str(path), "--csv", str(table)]
    assert main(argv) == 0
    r, s = json.loads(path.read_text())["results"]
    assert r["vllm_baseline"] == "theirs" and r["vllm_note"] is None
    assert r["speedup_vs_vllm"] == pytest.approx(r["speedups"]["theirs"])
    assert r["speedup_vs_vllm"] == pytest.approx(
        r["baselines"]["theirs"]["p50_us"] / r["ours"]["p50_us"]
    )
    assert (s["vllm_baseline"], s["speedup_vs_vllm"], s["vllm_note"]) == (None, None, "no GPU here")
    import csv

    with table.open() as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["vllm_baseline"] == "theirs"
    assert float(rows[0]["speedup_vs_vllm"]) == pytest.approx(r["speedup_vs_vllm"])
    assert rows[1]["vllm_baseline"] == rows[1]["speedup_vs_vllm"] == ""
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    column = [name for name, _, _ in bench_report.COLUMNS].index("vs vllm")
    assert "vs vllm" in header
    printed = {row.split()[1]: row.split() for row in lines if row.startswith("toy ")}
    # "vs vllm" is one word in the header, one cell in a row: the row's index counts it once.
    assert printed["with"][column] == f"{r['speedup_vs_vllm']:.2f}"
    assert printed["without"][column] == "-"
    # tools/check-gpu.sh's summary line, from the same JSON.
    tool = Path(__file__).resolve().parent.parent / "tools" / "vs_vllm_summary.py"
    proc = subprocess.run(
        [sys.executable, str(tool), str(path)], capture_output=True, text=True, check=True
    )
    assert proc.stdout.splitlines() == [
        f"  vs_vllm toy: with {r['speedup_vs_vllm']:.2f}, without -",
        "    (no GPU here)",
    ]


def _cpu_rows_have_null_vs_vllm(results: list[dict], triton_row) -> None:
    """On a CPU: each row vLLM runs as a Triton kernel (``triton_row(r)``) has a null
    speedup_vs_vllm and the note why; every row has the three fields."""
    for r in results:
        assert all(key in r for key in VS_VLLM_FIELDS), r["case"]
        if triton_row(r):
            assert r["vllm_baseline"] is None and r["speedup_vs_vllm"] is None, r["case"]
            assert "not timed on a CPU" in r["vllm_note"] and "Triton" in r["vllm_note"]
            assert "vllm" not in r["baselines"] and "vllm_triton" not in r["baselines"]


def _skip_on_a_gpu(report: dict) -> None:
    if report["device_type"] == "cuda":
        pytest.skip("the CPU's rows: this run was on a GPU")


def test_ngram_ids_vs_vllm_on_a_cpu_is_null_with_a_note(ngram_run: dict) -> None:
    _skip_on_a_gpu(ngram_run["report"])
    _cpu_rows_have_null_vs_vllm(ngram_run["report"]["results"], lambda r: True)


def test_gather_vs_vllm_on_a_cpu(gather_report: tuple[dict, str]) -> None:
    """A device table's bf16/fp8 lookup in vLLM is F.embedding (+ eager dequantize): the
    "embedding" baseline, timed on a CPU too; its NVFP4 lookup is a Triton kernel: null."""
    report, _ = gather_report
    _skip_on_a_gpu(report)
    results = report["results"]
    nvfp4 = [r for r in results if r["case"].endswith("_nvfp4")]
    assert nvfp4
    _cpu_rows_have_null_vs_vllm(nvfp4, lambda r: True)
    for r in results:
        if r["case"].endswith("_nvfp4"):
            continue
        if "hugepages" in r["case"]:
            assert r["speedup_vs_vllm"] is None and "index_select only" in r["vllm_note"]
            continue
        assert r["vllm_baseline"] == "embedding" and r["vllm_note"] is None, r["case"]
        assert r["speedup_vs_vllm"] == pytest.approx(r["speedups"]["embedding"])


def test_gate_and_conv_vs_vllm_on_a_cpu_is_null_with_a_note(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("transformers.models.qwen4_exp")
    if torch.cuda.is_available():
        pytest.skip("the CPU's rows: this machine has a GPU")
    monkeypatch.delenv("QWEN4EXP_BENCH_VLLM_INTERPRET", raising=False)
    _small_gate(monkeypatch)
    _small_conv(monkeypatch)
    for op in ("ple_gate", "ple_conv"):
        results = _quick_report(op, tmp_path)["results"]
        assert results
        _cpu_rows_have_null_vs_vllm(results, lambda r: True)


def test_host_lookup_vs_vllm_on_a_cpu_is_null_with_a_note(host_lookup_run: dict) -> None:
    _skip_on_a_gpu(host_lookup_run["report"])
    for r in _step_results(host_lookup_run["report"]):
        assert r["speedup_vs_vllm"] is None and r["vllm_baseline"] is None
        assert "not timed on a CPU" in r["vllm_note"] and "vllm_triton" in r["vllm_note"]


@require_vllm()
def test_every_vllm_row_declares_its_contender_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case plan as a GPU builds it: with vLLM's kernels under Triton's interpreter
    ($QWEN4EXP_BENCH_VLLM_INTERPRET=1, the same branch a GPU takes with its compiled kernels),
    every case of every op that vLLM implements names its vLLM baseline and no note; and small
    cases' checks pass with vLLM's own kernels in them (so the contenders compute what ours
    does). gather_rows' pinned cases need a GPU's mapped host memory: their branch
    runs here on a device table as its own "pinned" one."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs on a machine without a GPU")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    pytest.importorskip("transformers.models.qwen4_exp")
    from qwen4exp_ext.bench import gather_rows, ngram_gather_rows, ngram_ids, registry

    monkeypatch.setenv(registry.VLLM_INTERPRET_ENV, "1")
    cpu = torch.device("cpu")
    vllm = registry.vllm_kernels(cpu)
    assert vllm.interpreted and vllm.ple is not None and vllm.lookups is not None
    assert vllm.note is None

    def planned(cases, expected: str = "vllm") -> dict:
        for case in cases:
            assert case.vllm == expected and case.vllm_note is None, (case.op, case.name)
            assert expected in case.baselines
        return {case.name: case for case in cases}

    monkeypatch.setenv("QWEN4EXP_BENCH_GATHER_ROWS", str(GATHER_ROWS))
    monkeypatch.setattr(gather_rows, "PREFILL_TOKENS", GATHER_PREFILL)
    monkeypatch.setattr(ngram_gather_rows, "PREFILL_TOKENS", 64)
    monkeypatch.setattr(ngram_ids, "PREFILL_SHAPES", ((64, 1),))
    small = {
        "ngram_ids": planned(ngram_ids.cases(cpu)),
        "ngram_gather_rows": planned(ngram_gather_rows.cases(cpu)),
        "ple_gate": planned(_small_gate(monkeypatch).cases(cpu)),
        "ple_conv": planned(_small_conv(monkeypatch).cases(cpu)),
    }
    gathers = gather_rows.cases(cpu)
    # A device table: bf16 and fp8 are vLLM's F.embedding, NVFP4 its Triton kernel.
    planned([c for c in gathers if c.name.endswith("_nvfp4")])
    eager = ("_bf16", "_fp8", "_repeated", "_dup1024", "_sorted")
    planned([c for c in gathers if c.name.endswith(eager)], "embedding")
    for name in ("ngram_ids", "ngram_gather_rows"):
        assert small[name]["decode_T8"].check() is None, name
    # Not ple_gate's, ple_conv's nor NVFP4's (bf16 out): Triton's interpreter has no bf16
    # arithmetic of a GPU's (it truncates fp32 to bf16, triton-lang/triton#8322; the conv's bf16
    # state comes out as garbage). tests/ple_gate/test_kernel.py, tests/ple_conv/test_kernel.py
    # and the host_lookup test above hold vLLM's kernels to ours in fp16 and fp32, and on a GPU
    # the bench's own check does in bf16.
    # The pinned branch (a table_for_ref) in every format: vLLM's Triton lookup.
    gen = torch.Generator().manual_seed(3)
    for kind in ("bf16", "fp8", "nvfp4"):
        table = _small_gather_table(gather_rows, kind, gen)
        ids = torch.randint(0, GATHER_ROWS, (2, 8, NH), generator=gen)
        case = gather_rows._case("pinned_like", table, ids, "fresh", vllm, table_for_ref=table)
        assert case.vllm == "vllm" and "vllm" in case.baselines, kind
        if kind != "nvfp4":  # raw bytes (fp8: then eager dequantize): exact here too
            assert case.check() is None, kind


def _small_gather_table(gather_rows, kind: str, gen: torch.Generator):
    """A GATHER_ROWS-row table of ``kind`` as gather_rows.cases makes them."""
    raw = torch.randint(0, 0x70, (GATHER_ROWS, 2 * D), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([0.0123])
    if kind == "bf16":
        return gather_rows._Table(kind, raw.view(torch.bfloat16))
    if kind == "fp8":
        return gather_rows._Table(kind, raw[:, :D].contiguous().view(torch.float8_e4m3fn), scale)
    packed = torch.randint(0, 256, (GATHER_ROWS, D // 2), dtype=torch.uint8, generator=gen)
    blocks = raw[:, : D // 16].contiguous().view(torch.float8_e4m3fn)
    return gather_rows._Table(kind, packed, scale, blocks)
