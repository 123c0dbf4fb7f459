"""Smoke tests of the benchmark CLI: it runs, checks, and writes a well-formed report.

No timing thresholds: shared CI machines are too noisy for them; the numbers only have to exist.
"""

from __future__ import annotations

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
    for key in ("device", "device_type", "torch", "build_info", "date", "results"):
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
    # The long prefill must cross document boundaries, or the EOS path goes untimed.
    by_case = {r["case"]: r for r in results}
    assert by_case["prefill_T8192_R4"]["params"]["eos_tokens"] > 0


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
