"""ngram_ids' bad inputs (bad_inputs.py): each raises an error that names the offending argument
and leaves the output bit-identical, on the CPU kernel and the SIMT emulator's HIP kernels (whose
host glue is the GPU build's); token ids are data, never errors. The DATA_ONLY cases, bad index
values that only the data shows, are errors there only with debug checks (the GPU kernels never
read index data on the host): with them, the CPU's error and nothing written; without them, every
id in its head's range or -1 (SPEC §9.10). Out-of-bounds accesses in the no-debug runs are caught
by compute-sanitizer in tools/check-gpu.sh and by ASan in the emulator's sanitizer build
(tools/check-sanitizers.sh)."""

from __future__ import annotations

import pytest

from bad_inputs_support import (
    INT64_MAX,
    INT64_MIN,
    check_debug_checks_pass_valid_inputs,
    check_debug_checks_raise_and_write_nothing,
    check_raises_and_writes_nothing,
    cpu_backends,
    device_index_backends,
    run_without_debug_checks,
)
from qwen4exp_ext import ops

from .bad_inputs import CASES, DATA_CASES, DATA_ONLY, OPS, ngram_baseline

_DATA_OVERRIDES = {case.values[1] for case in DATA_CASES}


@pytest.mark.parametrize("backend", cpu_backends(), ids=str)
@pytest.mark.parametrize("op,override,match,exc", CASES)
def test_bad_input_raises_and_writes_nothing(backend, op, override, match, exc):
    if backend.reads_indices_on_device and override in _DATA_OVERRIDES:
        pytest.skip("an index value, not an error without debug checks on this backend")
    check_raises_and_writes_nothing(OPS[op], backend, override, match, exc)


@pytest.mark.parametrize("backend", cpu_backends(), ids=str)
@pytest.mark.parametrize("op", sorted(OPS))
def test_baselines_are_valid(backend, op):
    baseline, run, _ = OPS[op]
    run(baseline(), backend.ops)


# ---- data, never errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    [INT64_MIN, INT64_MIN + 1, -1, 0, 2**31, 2**32 + 5, INT64_MAX - 1, INT64_MAX],
    ids=str,
)
def test_any_int64_token_hashes(token):
    a = ngram_baseline()
    a["input_ids"] = a["input_ids"].clone()
    a["input_ids"][3] = token
    a["ngram_context"] = a["ngram_context"].clone()
    a["ngram_context"][1, 0] = token
    out = ops.ngram_ids(**a)
    sizes = a["ngram_heads_vocab_sizes"]
    offsets = a["ngram_heads_offsets"]
    assert ((out >= offsets) & (out < offsets + sizes)).all()


# ---- index values on the HIP kernels: the GPU and the SIMT emulator --------------------------


def test_every_data_only_case_is_in_the_table():
    assert {case.id for case in DATA_CASES} == DATA_ONLY


@pytest.mark.parametrize("backend", device_index_backends(), ids=str)
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_debug_checks_raise_the_cpu_error_and_write_nothing(backend, op, override, match, exc):
    check_debug_checks_raise_and_write_nothing(OPS[op], backend, override, match)


@pytest.mark.parametrize("backend", device_index_backends(), ids=str)
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_without_debug_checks_bad_values_stay_in_bounds(backend, op, override, match, exc):
    args = run_without_debug_checks(OPS[op], backend, override)
    sizes = args["ngram_heads_vocab_sizes"].cpu()
    offsets = args["ngram_heads_offsets"].cpu()
    out = args["output"].cpu().long()
    # A non-positive size gives -1 for its head; every other id is in its head's range,
    # or -1 where the offset puts it past what the output can hold.
    bad_head = (sizes <= 0).expand_as(out)
    assert (out[bad_head] == -1).all()
    in_range = (out >= offsets) & (out - offsets < sizes)  # offsets + sizes may overflow
    assert (in_range | (out == -1)).all()


@pytest.mark.parametrize("backend", device_index_backends(), ids=str)
def test_debug_checks_pass_valid_inputs(backend):
    for spec in OPS.values():
        check_debug_checks_pass_valid_inputs(spec, backend)
