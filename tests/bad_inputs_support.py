"""What every op's bad-input tests share: the kit its case table (tests/<op>/bad_inputs.py) is
written with, and the checks its tests/<op>/test_bad_inputs.py runs.

An op's table holds OPS: per variant, one valid baseline (outputs filled with a sentinel
pattern), the runner that calls the op with it, and the names of the tensors it writes; CASES:
each overrides one argument of a baseline, with the error message it must give; DATA_ONLY
(DATA_CASES): the cases whose bad values only the index data shows, errors on the CPU and, on the
GPU and the SIMT emulator, only with debug checks.
"""

from __future__ import annotations

import pytest
import torch

import qwen4exp_ext
from conftest import backends
from qwen4exp_ext.testing import assert_untouched, snapshot

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
META = torch.device("meta")
EXC = (RuntimeError, ValueError, TypeError, IndexError)


def sentinel(shape, dtype) -> torch.Tensor:
    """A tensor with a distinctive bit pattern (no two neighbours equal)."""
    n = 1
    for s in shape:
        n *= s
    t = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype.is_floating_point:
        return (t * -1.375 - 7777.0).to(dtype)
    return (t * 7919 - 123456789).to(dtype)


# ---- the kit: overrides of one argument ------------------------------------------------------


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to(META)


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, stride(-1) == 2."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def set_(name, fn):
    """An override: args[name] = fn(args[name]); `arg` names the argument it changes."""

    def apply(a):
        a[name] = fn(a[name])

    apply.arg = name
    return apply


def put(name, value):
    def apply(a):
        a[name] = value() if callable(value) else value

    apply.arg = name
    return apply


def p(op, case_id, override, match, exc=EXC):
    return pytest.param(op, override, match, exc, id=f"{op}-{case_id}")


I32 = torch.int32
F16 = torch.float16
F32 = torch.float32
FP8 = torch.float8_e4m3fn


# ---- the checks every op's bad-input tests run (tests/<op>/test_bad_inputs.py) ----------------
# An op's bad-input module (tests/<op>/bad_inputs.py) holds its specs: for each variant, one valid
# baseline (outputs filled with a sentinel pattern), the runner that calls the op of a backend's
# `kernels` with it, and the names of the tensors it writes: (baseline, run, mutable). Its cases
# override one argument of a baseline each, with the error message it must give.


# The backends that take the table's CPU tensors: the CPU kernels and the SIMT emulator's HIP
# kernels, whose host glue is the GPU build's.
def cpu_backends() -> list:
    return [b for b in backends() if b.device == "cpu"]


# The backends whose kernels read index data on the device: the GPU and the SIMT emulator. Bad
# index values are defined there instead of errors, unless debug checks are on.
def device_index_backends() -> list:
    return [b for b in backends() if b.reads_indices_on_device]


def on_device(args: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def synchronize(backend) -> None:
    if backend.device == "cuda":
        torch.cuda.synchronize()  # an out-of-bounds access would surface here


def check_raises_and_writes_nothing(spec, backend, override, match, exc) -> None:
    """The op raises `exc` with a message matching `match`, and every tensor it writes keeps its
    bytes."""
    baseline, run, mutable = spec
    args = baseline()
    override(args)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with pytest.raises(exc, match=match):
        run(dict(args), backend.ops)
    assert_untouched(before, outputs)


def bad_args_on_device(spec, override, backend) -> dict:
    baseline, _, _ = spec
    args = baseline()
    override(args)
    return on_device(args, backend.device)


def check_debug_checks_raise_and_write_nothing(spec, backend, override, match) -> None:
    """With debug checks, a kernel that reads indices on the device raises the CPU's error and
    writes nothing."""
    _, run, mutable = spec
    args = bad_args_on_device(spec, override, backend)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with qwen4exp_ext.debug_checks(), pytest.raises(EXC, match=match):
        run(dict(args), backend.ops)
    synchronize(backend)
    assert_untouched(before, outputs)


def run_without_debug_checks(spec, backend, override) -> dict:
    """Runs the op on the bad data with debug checks off; returns its arguments, as written."""
    _, run, _ = spec
    args = bad_args_on_device(spec, override, backend)
    with qwen4exp_ext.debug_checks(enabled=False):
        run(dict(args), backend.ops)
    synchronize(backend)
    return args


def check_debug_checks_pass_valid_inputs(spec, backend) -> None:
    baseline, run, _ = spec
    with qwen4exp_ext.debug_checks():
        run(on_device(baseline(), backend.device), backend.ops)
    synchronize(backend)


# ---- the tests every op's table gets ---------------------------------------------------------
# Each op's tests/<op>/test_bad_inputs.py names these in its own namespace (pytest collects them
# there, with the same ids in every folder), then adds the tests only its op has: "data, never
# errors", and what its kernels must do with bad index values when debug checks are off.


def table_tests(table) -> tuple:
    """(test_bad_input_raises_and_writes_nothing, test_baselines_are_valid,
    test_debug_checks_pass_valid_inputs) for an op's table (its bad_inputs module: OPS, CASES,
    DATA_CASES). The DATA_ONLY cases are skipped where the kernels read indices on the device."""
    data_overrides = {case.values[1] for case in table.DATA_CASES}

    @pytest.mark.parametrize("backend", cpu_backends(), ids=str)
    @pytest.mark.parametrize("op,override,match,exc", table.CASES)
    def test_bad_input_raises_and_writes_nothing(backend, op, override, match, exc):
        if backend.reads_indices_on_device and override in data_overrides:
            pytest.skip("an index value, not an error without debug checks on this backend")
        check_raises_and_writes_nothing(table.OPS[op], backend, override, match, exc)

    @pytest.mark.parametrize("backend", cpu_backends(), ids=str)
    @pytest.mark.parametrize("op", sorted(table.OPS))
    def test_baselines_are_valid(backend, op):
        baseline, run, _ = table.OPS[op]
        run(baseline(), backend.ops)

    @pytest.mark.parametrize("backend", device_index_backends(), ids=str)
    def test_debug_checks_pass_valid_inputs(backend):
        for spec in table.OPS.values():
            check_debug_checks_pass_valid_inputs(spec, backend)

    return (
        test_bad_input_raises_and_writes_nothing,
        test_baselines_are_valid,
        test_debug_checks_pass_valid_inputs,
    )


def data_only_tests(table) -> tuple:
    """(test_every_data_only_case_is_in_the_table,
    test_debug_checks_raise_the_cpu_error_and_write_nothing) for an op whose table has DATA_ONLY
    cases: with debug checks, the kernels that read indices on the device raise the CPU's error
    and write nothing."""
    assert table.DATA_CASES, "no DATA_ONLY cases: nothing for these tests to run"

    def test_every_data_only_case_is_in_the_table():
        assert {case.id for case in table.DATA_CASES} == table.DATA_ONLY

    @pytest.mark.parametrize("backend", device_index_backends(), ids=str)
    @pytest.mark.parametrize("op,override,match,exc", table.DATA_CASES)
    def test_debug_checks_raise_the_cpu_error_and_write_nothing(backend, op, override, match, exc):
        check_debug_checks_raise_and_write_nothing(table.OPS[op], backend, override, match)

    return (
        test_every_data_only_case_is_in_the_table,
        test_debug_checks_raise_the_cpu_error_and_write_nothing,
    )
