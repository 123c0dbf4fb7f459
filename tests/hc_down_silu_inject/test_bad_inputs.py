"""hc_down_silu_inject's bad inputs: each case of bad_inputs.py raises an exception whose message
names the offending argument and leaves its outputs bit-identical, on every backend that takes
CPU tensors (the CPU kernels and the SIMT emulator's HIP kernels, whose host glue is the GPU
build's), with out= and without.
"""

from __future__ import annotations

from bad_inputs_support import table_tests

from . import bad_inputs

(
    test_bad_input_raises_and_writes_nothing,
    test_baselines_are_valid,
    test_debug_checks_pass_valid_inputs,
) = table_tests(bad_inputs)
