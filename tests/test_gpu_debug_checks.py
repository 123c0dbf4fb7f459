"""Index values that only the data shows, on the HIP kernels: the GPU, and the SIMT emulator.

The CPU path reads index data for free and raises on every bad value (tests/test_bad_inputs.py).
The GPU kernels never read it on the host (a sync, and no CUDA-graph capture), so there the same
values are defined instead: nothing is read or written out of bounds — a token outside the
requests gets no output, an out-of-range slot or token row is skipped, a non-positive head size
(or an offset no layout has) gives id -1 (a zero row in every gather). With
``qwen4exp_ext.debug_checks()`` the GPU glue copies the indices to the host and raises the CPU's
error, writing nothing.

Every case here is one of the bad-input table's DATA_ONLY cases, run on each backend that reads
indices on the device: "cuda" (moved to the GPU) and the emulator's "simt32"/"simt64" (the same
glue and kernels on CPU tensors). Out-of-bounds accesses in the no-debug runs are caught by
compute-sanitizer in tools/check-gpu.sh and by ASan in the emulator's sanitizer build
(tools/check-sanitizers.sh); here they would also show as a slot that no valid index names being
written.
"""

from __future__ import annotations

import pytest
import torch

import qwen4exp_ext
from bad_inputs_support import DATA_CASES, DATA_ONLY, EXC, OPS
from conftest import backends
from qwen4exp_ext.testing import assert_untouched, snapshot

DEVICE_INDEX_BACKENDS = [b for b in backends() if b.reads_indices_on_device]


def test_every_data_only_case_is_in_the_table():
    assert {case.id for case in DATA_CASES} == DATA_ONLY


def on_device(args: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def bad_args(op, override, backend):
    baseline, run, mutable = OPS[op]
    args = baseline()
    override(args)
    return on_device(args, backend.device), run, mutable


def synchronize(backend) -> None:
    if backend.device == "cuda":
        torch.cuda.synchronize()  # an out-of-bounds access would surface here


@pytest.mark.parametrize("backend", DEVICE_INDEX_BACKENDS, ids=str)
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_debug_checks_raise_the_cpu_error_and_write_nothing(backend, op, override, match, exc):
    args, run, mutable = bad_args(op, override, backend)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with qwen4exp_ext.debug_checks(), pytest.raises(EXC, match=match):
        run(dict(args), backend.ops)
    synchronize(backend)
    assert_untouched(before, outputs)


@pytest.mark.parametrize("backend", DEVICE_INDEX_BACKENDS, ids=str)
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_without_debug_checks_bad_values_stay_in_bounds(backend, op, override, match, exc):
    args, run, mutable = bad_args(op, override, backend)
    with qwen4exp_ext.debug_checks(enabled=False):
        run(dict(args), backend.ops)
    synchronize(backend)
    if op == "ngram_ids":
        sizes = args["ngram_heads_vocab_sizes"].cpu()
        offsets = args["ngram_heads_offsets"].cpu()
        out = args["output"].cpu().long()
        # A non-positive size gives -1 for its head; every other id is in its head's range,
        # or -1 where the offset puts it past what the output can hold.
        bad_head = (sizes <= 0).expand_as(out)
        assert (out[bad_head] == -1).all()
        in_range = (out >= offsets) & (out - offsets < sizes)  # offsets + sizes may overflow
        assert (in_range | (out == -1)).all()


@pytest.mark.parametrize("backend", DEVICE_INDEX_BACKENDS, ids=str)
def test_debug_checks_pass_valid_inputs(backend):
    for _op, (baseline, run, _) in OPS.items():
        with qwen4exp_ext.debug_checks():
            run(on_device(baseline(), backend.device), backend.ops)
    synchronize(backend)
