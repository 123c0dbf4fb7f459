"""Smoke tests of the benchmark CLI: it runs, checks, and writes a well-formed report.

No timing thresholds: shared CI machines are too noisy for them; the numbers only have to exist.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qwen4exp_ext
from qwen4exp_ext import ops
from qwen4exp_ext.bench.cli import QUICK_REPEAT, main

NGRAM_IDS_CASES = {
    "decode_T1",
    "decode_T8",
    "decode_T64",
    "decode_T256",
    "prefill_T64_R1",
    "prefill_T8192_R4",
}
TIMED = ("ours", "ref", "copy")


def test_quick_run_writes_complete_json(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    assert main(["ngram_ids", "--quick", "--json", str(path)]) == 0

    report = json.loads(path.read_text())
    for key in ("device", "device_type", "torch", "build_info", "date", "results", "sections"):
        assert key in report
    assert report["device"]
    assert report["device_type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert report["torch"] == torch.__version__
    results = report["results"]
    assert {r["case"] for r in results} == NGRAM_IDS_CASES
    for r in results:
        assert r["op"] == "ngram_ids"
        assert r["check"] is True
        for who in TIMED:
            q = r[who]
            assert 0 < q["min_us"] <= q["p20_us"] <= q["p50_us"] <= q["p80_us"]
            assert q["n"] == QUICK_REPEAT
        assert r["speedup"] > 0
        assert r["tokens"] == r["params"]["T"] > 0
        assert r["tokens_per_s"]["ours"] > 0 and r["tokens_per_s"]["ref"] > 0
        # ids in (int32) + ids out (16 int64 heads) at the least
        assert r["bytes"] >= r["tokens"] * (4 + 16 * 8)
        assert r["copy_bytes"] >= r["bytes"]
        assert all(r["gbps"][who] > 0 for who in TIMED)
        assert r["pct_of_copy"] > 0
        # The roofline: the case's bytes at each GPU's datasheet HBM bandwidth (TB/s).
        for gpu, tbps in {"MI300X": 5.3, "MI325X": 6.0, "MI355X": 8.0, "H200": 4.8}.items():
            assert r["roofline_us"][gpu] == pytest.approx(r["bytes"] / (tbps * 1e12) * 1e6)
        if report["device_type"] == "cpu":
            assert r["pct_of_peak"] is None
    # The long prefill must cross document boundaries, or the EOS path goes untimed.
    by_case = {r["case"]: r for r in results}
    assert by_case["prefill_T8192_R4"]["params"]["eos_tokens"] > 0


def test_percent_of_the_datasheet_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a listed GPU, ours as a % of its HBM peak: 2400 GB/s on an H200 (4.8 TB/s) is 50%; an
    MI325X is not taken for another MI300-series part; an unlisted GPU or a CPU gives None."""
    from qwen4exp_ext.bench import cli

    gpu = torch.device("cuda")
    for name, expected in (
        ("NVIDIA H200", 50.0),
        ("AMD Instinct MI325X", 40.0),
        ("AMD Instinct MI300X", 2400 / 53),
        ("AMD Instinct MI355X", 30.0),
        ("NVIDIA A100-SXM4-80GB", None),
    ):
        monkeypatch.setattr(cli, "_device_name", lambda device, name=name: name)
        got = cli._pct_of_peak(2400.0, gpu)
        assert got == (None if expected is None else pytest.approx(expected)), name
    assert cli._pct_of_peak(2400.0, torch.device("cpu")) is None


def test_wrong_kernel_fails_the_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = ops.ngram_ids

    def off_by_one(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)
        out[-1, -1] += 1
        return out

    monkeypatch.setattr(ops, "ngram_ids", off_by_one)
    path = tmp_path / "bench.json"
    assert main(["ngram_ids", "--quick", "--device", "cpu", "--json", str(path)]) == 1
    assert not path.exists()


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
    assert "ngram_ids" in proc.stdout and "--quick" in proc.stdout


# --- gather: NVFP4 cases and pinned bytes per layer ----------------------------------------------

GATHER_ROWS = 4096  # a small table: the quick run checks and times every case in seconds
NVFP4_CASES = {
    "decode_T1_nvfp4",
    "decode_T8_nvfp4",
    "decode_T64_nvfp4",
    "decode_T256_nvfp4",
    "prefill_T8192_nvfp4",
    "prefill_T8192_nvfp4_vs_index_select",
}
RELEASED_ROWS = 320_001_536  # R_pad of one released PLE layer (tests/test_layout.py)
D = 160
NH = 16


@pytest.fixture(scope="module")
def gather_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One quick ``gather`` run (JSON report and printed output), shared by the tests below."""
    path = tmp_path_factory.mktemp("bench") / "gather.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("QWEN4EXP_BENCH_GATHER_ROWS", str(GATHER_ROWS))
        assert main(["gather", "--quick", "--json", str(path)]) == 0
    return json.loads(path.read_text()), printed.getvalue()


def test_gather_nvfp4_cases_run_checked(gather_report: tuple[dict, str]) -> None:
    report, printed = gather_report
    by_case = {r["case"]: r for r in report["results"]}
    expected = set(NVFP4_CASES)
    if report["device_type"] == "cuda":
        expected |= {f"pinned_decode_T{t}_nvfp4" for t in (1, 8, 64, 256)}
        expected.add("pinned_prefill_T8192_nvfp4")
    assert expected <= set(by_case)
    for name in expected:
        r = by_case[name]
        assert r["check"] is True
        assert all(r[who]["n"] == QUICK_REPEAT for who in TIMED)
        assert r["params"]["rows"] == GATHER_ROWS
        t = r["tokens"]
        # int64 ids read, d/2 packed bytes + d/16 e4m3 block scales read per row, bf16 out written.
        assert r["bytes"] == t * NH * 8 + t * NH * (D // 2 + D // 16) + t * NH * D * 2
        assert name in printed
    # Same rows in every format: the NVFP4 case reads 90 of the bf16 case's 320 bytes a row.
    bf16 = by_case["prefill_T8192_bf16"]
    assert bf16["params"]["rows"] == GATHER_ROWS
    assert bf16["bytes"] - by_case["prefill_T8192_nvfp4"]["bytes"] == 8192 * NH * (320 - 90)


def test_gather_nvfp4_check_compares_with_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qwen4exp_ext import reference
    from qwen4exp_ext.bench import gather

    monkeypatch.setenv("QWEN4EXP_BENCH_GATHER_ROWS", str(GATHER_ROWS))
    nvfp4 = [c for c in gather.cases(torch.device("cpu")) if c.name in NVFP4_CASES]
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


def _next_power_of_two(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def test_gather_pinned_bytes_per_layer(gather_report: tuple[dict, str]) -> None:
    report, printed = gather_report
    (section,) = [s for s in report["sections"] if s["name"] == "pinned_bytes"]
    assert section["op"] == "gather"
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
def test_gather_pinned_bytes_measured(gather_report: tuple[dict, str]) -> None:
    report, _ = gather_report
    (section,) = [s for s in report["sections"] if s["name"] == "pinned_bytes_measured"]
    for r in section["rows"]:
        assert r["torch_pin_memory_bytes"] >= r["table_bytes"]
        assert r["table_bytes"] <= r["pinned_host_table_bytes"] < r["table_bytes"] + 2 * 4096
