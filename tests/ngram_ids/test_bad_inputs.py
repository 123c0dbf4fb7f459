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
    data_only_tests,
    device_index_backends,
    run_without_debug_checks,
    table_tests,
)
from qwen4exp_ext import ops

from . import bad_inputs
from .bad_inputs import DATA_CASES, OPS, ngram_baseline

# The tests every op's table gets (tests/bad_inputs_support.py).
(
    test_bad_input_raises_and_writes_nothing,
    test_baselines_are_valid,
    test_debug_checks_pass_valid_inputs,
) = table_tests(bad_inputs)


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


(
    test_every_data_only_case_is_in_the_table,
    test_debug_checks_raise_the_cpu_error_and_write_nothing,
) = data_only_tests(bad_inputs)


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
