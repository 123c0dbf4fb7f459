"""The fused hyper-connection projections' bench rows (python/qwen4exp_ext/bench/hc_fused.py,
issue #50 item 3), on shapes shrunk from the released ones: both ops' cases run, check ours and
the unfused baseline against the oracle, and report bytes per token; the check catches a wrong
kernel. No timing thresholds (tests/test_bench.py says why)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from qwen4exp_ext.bench import registry
from qwen4exp_ext.bench.cli import main

CPU = torch.device("cpu")
OPS = ("hc_up_gate_mix", "hc_down_silu_inject")


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch):
    """bench.hc at H = 64, r = 12 (the merged down weight then 16 rows), T = 1 and 3."""
    from qwen4exp_ext.bench import hc, hc_fused

    monkeypatch.setattr(hc, "WIDTH", 64)
    monkeypatch.setattr(hc, "LOWRANK", 12)
    monkeypatch.setattr(hc_fused, "DECODE_TOKENS", (1, 3))
    return hc_fused


def test_both_ops_are_registered_with_their_cases(small) -> None:
    for op in OPS:
        assert registry.OP_MODULES[op] == small.__name__ and op in registry.FULL_ONLY_OPS
        cases = registry.load_cases(op, CPU)
        assert [c.name for c in cases] == ["decode_T1", "decode_T3"]
        assert {c.op for c in cases} == {op}
    with pytest.raises(ValueError, match="op must be one of"):
        small.op_cases("hc_gate_mix", CPU)


@pytest.mark.parametrize("op", OPS)
def test_rows_run_check_and_report_bytes(small, op: str, tmp_path: Path) -> None:
    path = tmp_path / f"{op}.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([op, "--quick", "--threads", "1", "--json", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    assert {r["case"] for r in results} == {"decode_T1", "decode_T3"}
    channels, rank = 4 * 64, 12
    for r in results:
        assert r["op"] == op and r["check"] is True and r["baseline"] == "unfused"
        assert r["vllm_baseline"] is None and r["vllm_note"] == small.VLLM_NOTE
        t = r["tokens"]
        if op == "hc_up_gate_mix":  # w_up, then lowrank and xn read, the block input written
            expected = channels * rank + t * (rank + channels + 64)
        else:  # w_down and w_inj, then xn read, lowrank and logits written
            expected = (rank + 4) * channels + t * (channels + rank + 4)
        assert r["bytes"] == 2 * expected
        assert r["bytes_per_token"] == pytest.approx(r["bytes"] / t)


@pytest.mark.parametrize("op", OPS)
def test_check_catches_a_wrong_kernel(small, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    from qwen4exp_ext import ops

    real = getattr(ops, op)

    def off(*args, out=None):
        result = real(*args, out=out)
        first = result[0] if isinstance(result, tuple) else result
        first.view(-1)[first.numel() // 2] += 0.25 + first.view(-1)[first.numel() // 2].abs()
        return result

    monkeypatch.setattr(ops, op, off)
    for case in small.op_cases(op, CPU):
        problem = case.check()
        assert problem is not None and "the oracle" in problem, (case.name, problem)
