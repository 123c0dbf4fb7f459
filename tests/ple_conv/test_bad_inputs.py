"""Bad inputs to ple_conv (the cases are bad_inputs.py's): each raises an exception that names
the offending argument and leaves residual and conv_state bit-identical, on every kernel backend
with the CPU tensors of the table (the CPU kernels and the SIMT emulator's HIP kernels, whose
host glue is the GPU build's).

On the backends that read index data on the device (the GPU, moved there, and the SIMT
emulator), the DATA_ONLY cases, bad index values that only the data shows, are not errors
without debug checks (SPEC §9.10): with ``qwen4exp_ext.debug_checks()`` they raise the CPU's
error and write nothing; without, nothing is written out of bounds: a slot that no in-range
index names keeps its bytes (out-of-bounds accesses themselves are caught by compute-sanitizer
in tools/check-gpu.sh and by ASan in the emulator's sanitizer build).
"""

from __future__ import annotations

import pytest
import torch

from bad_inputs_support import (
    data_only_tests,
    device_index_backends,
    run_without_debug_checks,
    table_tests,
)
from qwen4exp_ext import ops
from qwen4exp_ext.testing import assert_untouched, same_layout, snapshot

from . import bad_inputs
from .bad_inputs import DATA_CASES, OPS
from .support import make_batch

# The tests every op's table gets (tests/bad_inputs_support.py).
(
    test_bad_input_raises_and_writes_nothing,
    test_baselines_are_valid,
    test_debug_checks_pass_valid_inputs,
) = table_tests(bad_inputs)


def test_bad_values_leave_state_and_residual_untouched():
    """A bad slot in a bf16 prefill batch of 8 channels (the CPU kernel's own default backend)."""
    batch = make_batch("prefill", torch.bfloat16, lengths=[2, 3], channels=8, null_every=0, seed=1)
    residual = batch.residual.clone()
    state = same_layout(batch.conv_state)
    before = snapshot({"residual": residual, "conv_state": state})
    with pytest.raises(RuntimeError, match="outside"):
        ops.ple_conv(
            batch.inputs,
            residual,
            state,
            batch.conv_weights,
            torch.tensor([1, 9], dtype=torch.int32),
            batch.outer_residual,
            **batch.kwargs,
        )
    assert_untouched(before, {"residual": residual, "conv_state": state})


# ---- bad index values on the HIP kernels (the GPU, and the SIMT emulator) ---------------------


(
    test_every_data_only_case_is_in_the_table,
    test_debug_checks_raise_the_cpu_error_and_write_nothing,
) = data_only_tests(bad_inputs)


@pytest.mark.parametrize("backend", device_index_backends(), ids=str)
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_without_debug_checks_bad_values_stay_in_bounds(backend, op, override, match, exc):
    baseline, _, _ = OPS[op]
    bad = baseline()  # the baselines are seeded: the same values as those run below
    override(bad)
    before = bad["conv_state"]
    args = run_without_debug_checks(OPS[op], backend, override)
    state = args["conv_state"].cpu()
    # Slots no in-range index names keep their bytes.
    slots = args["state_indices"].view(-1).long().cpu()
    named = {int(s) for s in slots if 0 <= s < state.shape[0]}
    for slot in range(state.shape[0]):
        if slot not in named:
            assert torch.equal(state[slot], before[slot]), f"slot {slot} was written"
