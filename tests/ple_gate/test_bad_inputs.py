"""ple_gate's bad inputs: each case of tests/ple_gate/bad_inputs.py raises an exception whose
message names the offending argument and leaves both outputs bit-identical, on every backend that
takes the table's CPU tensors (the CPU kernels and the SIMT emulator's HIP kernels, whose host
glue is the GPU build's); one error of the functional op (no out=); and valid inputs pass with
debug checks on the backends that read index data on the device.
"""

from __future__ import annotations

import pytest
import torch

from bad_inputs_support import table_tests
from qwen4exp_ext import ops

from . import bad_inputs
from .support import EPS, make_inputs

# The tests every op's table gets (tests/bad_inputs_support.py).
(
    test_bad_input_raises_and_writes_nothing,
    test_baselines_are_valid,
    test_debug_checks_pass_valid_inputs,
) = table_tests(bad_inputs)


def gate_call(**overrides):
    key, value, hidden, weights = make_inputs(4, 8, 2, torch.bfloat16)
    args = dict(
        key=key,
        value=value,
        hidden=hidden,
        norm_key_w=weights[0],
        norm_query_w=weights[1],
        norm_conv_w=weights[2],
        eps=EPS,
    )
    args.update(overrides)
    return ops.ple_gate(**args)


# The functional op's errors that the table (which runs ple_gate_out) has no case for.
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(norm_conv_w=torch.zeros(16, dtype=torch.bfloat16, device="meta")),
            "norm_conv_w is on meta but hidden is on cpu",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(overrides, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        gate_call(**overrides)
