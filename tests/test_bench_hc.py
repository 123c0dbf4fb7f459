"""The hyper-connection ops' bench rows (python/qwen4exp_ext/bench/hc.py, SPEC §10), on shapes
shrunk from the released ones: every op's cases run, check and report bytes per token; the
check catches a wrong kernel and a wrong baseline; vLLM's kernels join as the "vllm" baseline
where they can run (here: Triton's interpreter, the branch a GPU takes with compiled kernels).
No timing thresholds (tests/test_bench.py says why)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from qwen4exp_ext.bench import registry
from qwen4exp_ext.bench.cli import main
from qwen4exp_ext.testing import HC_OPS

pytest.importorskip("transformers.models.qwen4_exp")

CPU = torch.device("cpu")


@pytest.fixture
def small_hc(monkeypatch: pytest.MonkeyPatch):
    """bench.hc at H = 64, r = 12 (the merged down GEMM then 16 wide), T = 3 and 40."""
    from qwen4exp_ext.bench import hc

    monkeypatch.setattr(hc, "WIDTH", 64)
    monkeypatch.setattr(hc, "LOWRANK", 12)
    monkeypatch.setattr(hc, "DECODE_TOKENS", (3,))
    monkeypatch.setattr(hc, "PREFILL_TOKENS", 40)
    monkeypatch.delenv(registry.VLLM_INTERPRET_ENV, raising=False)
    return hc


def _quick_report(op: str, tmp_path: Path) -> dict:
    path = tmp_path / f"{op}.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([op, "--quick", "--threads", "1", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_every_hc_op_is_registered_with_its_own_cases(small_hc) -> None:
    for op in HC_OPS:
        assert registry.OP_MODULES[op] == small_hc.__name__
        cases = registry.load_cases(op, CPU)
        assert [c.name for c in cases] == ["decode_T3", "prefill_T40"]
        assert {c.op for c in cases} == {op}
    with pytest.raises(ValueError, match="op must be one of"):
        small_hc.op_cases("ple_gate", CPU)


@pytest.mark.parametrize("op", HC_OPS)
def test_hc_rows_run_check_and_report_bytes_per_token(small_hc, op: str, tmp_path: Path) -> None:
    results = _quick_report(op, tmp_path)["results"]
    assert {r["case"] for r in results} == {"decode_T3", "prefill_T40"}
    channels = small_hc.STREAMS * small_hc.WIDTH
    for r in results:
        assert r["op"] == op and r["check"] is True and r["threads"] == 1
        assert r["baseline"] == "transformers" and set(r["baselines"]) == {"transformers"}
        assert r["bytes_per_token"] == pytest.approx(r["bytes"] / r["tokens"])
        assert r["pct_of_copy"] > 0
        # On a CPU vLLM's Triton kernel is not timed, and the row says why.
        assert r["vllm_baseline"] is None and r["speedup_vs_vllm"] is None
        assert r["vllm_note"] == registry.VLLM_CPU_NOTE
    # The traffic of the table, at this width: combine_norm reads residual, block and
    # logits and writes h and xn; gate_mix reads x and gate and writes the block input.
    per_token = {
        "hc_combine_norm": 3 * channels + small_hc.WIDTH + small_hc.STREAMS,
        "hc_gate_mix": 2 * channels + small_hc.WIDTH,
    }
    if op in per_token:
        r = next(r for r in results if r["case"] == "prefill_T40")
        weight = channels if op == "hc_combine_norm" else 0
        assert r["bytes"] == 2 * (40 * per_token[op] + weight)


@pytest.mark.parametrize("op", HC_OPS)
def test_check_catches_a_wrong_kernel(small_hc, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """ours one bf16 unit off in a single element fails the check against the oracle."""
    from qwen4exp_ext import ops

    real = getattr(ops, op)

    def off_by_a_little(*args, out=None):
        result = real(*args, out=out)
        first = result[0] if isinstance(result, tuple) else result
        first.view(-1)[first.numel() // 2] += 0.25 + first.view(-1)[first.numel() // 2].abs()
        return result

    monkeypatch.setattr(ops, op, off_by_a_little)
    for case in small_hc.op_cases(op, CPU):
        problem = case.check()
        assert problem is not None and "the oracle" in problem, (case.name, problem)


@pytest.mark.parametrize("op", HC_OPS)
def test_check_covers_transformers(small_hc, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """A transformers step that computes something else fails the check (its time would not be
    a like-for-like baseline), though ours still matches the oracle."""
    real = small_hc._transformers

    def scaled(name, weight):
        step = real(name, weight)

        def off(*args):
            result = step(*args)
            if isinstance(result, tuple):
                return tuple(t * 1.25 for t in result)
            return result * 1.25

        return off

    monkeypatch.setattr(small_hc, "_transformers", scaled)
    for case in small_hc.op_cases(op, CPU):
        problem = case.check()
        assert problem is not None and "transformers" in problem, (case.name, problem)


def test_vllm_kernels_join_as_the_vllm_baseline(small_hc, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where vLLM's kernels can run (the interpreter here, a GPU in the bench), every case times
    them as "vllm" and returns their output."""
    from qwen4exp_ext.bench import vllm_triton

    if vllm_triton.load_hc(interpret=True, vendor="nvidia") is None:
        pytest.skip("vLLM's hyper-connection kernels or Triton are not installed")
    monkeypatch.setenv(registry.VLLM_INTERPRET_ENV, "1")
    monkeypatch.setattr(small_hc, "PREFILL_TOKENS", 5)
    for op in HC_OPS:
        for case in small_hc.op_cases(op, CPU):
            assert case.vllm == "vllm" and case.vllm_note is None
            got = case.baselines["vllm"]()
            assert got.shape == case.oracle().shape and got.dtype == torch.bfloat16
            assert case.check() is None, (op, case.name)


# --- hc_module: one whole module step (combine_and_mix, two GEMMs included) ---------------------
@pytest.fixture
def small_module(small_hc, monkeypatch: pytest.MonkeyPatch):
    from qwen4exp_ext.bench import hc_module

    monkeypatch.setattr(hc_module, "DECODE_TOKENS", (1, 3))
    monkeypatch.setattr(hc_module, "PREFILL_TOKENS", 40)
    return hc_module


def test_hc_module_rows_run_and_check(small_module, tmp_path: Path) -> None:
    results = _quick_report("hc_module", tmp_path)["results"]
    assert {r["case"] for r in results} == {"decode_T1", "decode_T3", "prefill_T40"}
    for r in results:
        assert r["op"] == "hc_module" and r["check"] is True
        assert r["baseline"] == "transformers"
        assert r["bytes_per_token"] == pytest.approx(r["bytes"] / r["tokens"])
        assert r["vllm_note"] == registry.VLLM_CPU_NOTE


def test_hc_module_check_covers_its_contenders(small_module, monkeypatch) -> None:
    """A module that drops the pending combine's injection fails against the oracle; a
    transformers step that computes something else fails against transformers."""
    from qwen4exp_ext.layers import GatedResidual

    real = GatedResidual.combine_and_mix

    def no_injection(self, hidden, block, logits):
        return real(self, hidden, block, None)

    monkeypatch.setattr(GatedResidual, "combine_and_mix", no_injection)
    for case in small_module.cases(CPU):
        problem = case.check()
        assert problem is not None and "the oracle" in problem, case.name
    monkeypatch.setattr(GatedResidual, "combine_and_mix", real)
    step = small_module._transformers_step

    def scaled(*args):
        run = step(*args)
        return lambda *a: tuple(t * 1.25 for t in run(*a))

    monkeypatch.setattr(small_module, "_transformers_step", scaled)
    for case in small_module.cases(CPU):
        problem = case.check()
        assert problem is not None and "transformers" in problem, case.name


def test_hc_module_times_vllms_path_where_it_runs(small_module, monkeypatch) -> None:
    from qwen4exp_ext.bench import vllm_triton

    if vllm_triton.load_hc(interpret=True, vendor="nvidia") is None:
        pytest.skip("vLLM's hyper-connection kernels or Triton are not installed")
    monkeypatch.setenv(registry.VLLM_INTERPRET_ENV, "1")
    for case in small_module.cases(CPU):
        assert case.vllm == "vllm" and case.vllm_note is None
        assert case.baselines["vllm"]().shape == case.oracle().shape
        assert case.check() is None, case.name


def test_carried_vllm_source_holds_the_hc_kernels(tmp_path: Path, monkeypatch) -> None:
    """``python -m qwen4exp_ext.bench.vllm_triton DIR`` carries both hc.py files, and the
    loader reads them from there (a GPU machine without vLLM)."""
    import importlib.util

    from qwen4exp_ext.bench import vllm_triton

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here: nothing to extract")
    written = vllm_triton.extract(tmp_path)
    monkeypatch.setenv(vllm_triton.SOURCE_ENV, str(tmp_path))
    for vendor in ("amd", "nvidia"):
        path = vllm_triton.hc_source_path(vendor)
        assert path in written and path.is_relative_to(tmp_path)
    with pytest.raises(ValueError, match="vendor must be one of"):
        vllm_triton.hc_source_path("intel")
