"""ngram_gather_rows' bad inputs (bad_inputs.py): each raises an error that names the offending
argument (under the fused op's name) and leaves the output bit-identical, on the CPU kernel and
the SIMT emulator's HIP kernels (whose host glue is the GPU build's). The DATA_ONLY cases, bad
index values that only the data shows, are not errors there without debug checks: with them, they
raise the CPU's error and write nothing; without, every head's row is a row of the table or
zeros (a bad head hashes to -1), nothing read out of bounds."""

from __future__ import annotations

import pytest

from bad_inputs_support import (
    data_only_tests,
    device_index_backends,
    run_without_debug_checks,
    table_tests,
)

from . import bad_inputs
from .bad_inputs import DATA_CASES, OPS

# The tests every op's table gets (tests/bad_inputs_support.py).
(
    test_bad_input_raises_and_writes_nothing,
    test_baselines_are_valid,
    test_debug_checks_pass_valid_inputs,
) = table_tests(bad_inputs)


(
    test_every_data_only_case_is_in_the_table,
    test_debug_checks_raise_the_cpu_error_and_write_nothing,
) = data_only_tests(bad_inputs)


@pytest.mark.parametrize("backend", device_index_backends(), ids=str)
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_without_debug_checks_rows_are_table_rows_or_zero(backend, op, override, match, exc):
    args = run_without_debug_checks(OPS[op], backend, override)
    table = args["table"].cpu()
    rows = args["output"].cpu().reshape(-1, table.shape[1])
    for i, row in enumerate(rows):
        is_zero = bool((row == 0).all())
        is_a_row = bool((table == row).all(dim=1).any())
        assert is_zero or is_a_row, f"head row {i} is neither zeros nor a table row: {row}"
