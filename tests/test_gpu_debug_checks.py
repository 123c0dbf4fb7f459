"""Index values that only the data shows, on the GPU.

The CPU path reads index data for free and raises on every bad value (tests/test_bad_inputs.py).
The GPU kernels never read it on the host (a sync, and no CUDA-graph capture), so there the same
values are defined instead: nothing is read or written out of bounds — a token outside the
requests gets no output, an out-of-range slot or token row is skipped, a non-positive head size
gives id -1 (a zero row in every gather). With ``qwen4exp_ext.debug_checks()`` the GPU glue
copies the indices to the host and raises the CPU's error, writing nothing.

Every case here is one of the bad-input table's, moved to the GPU. Out-of-bounds accesses in the
no-debug runs are caught by compute-sanitizer in tools/gpu_check.sh; here they would show as a
CUDA error at the synchronize, or as a slot that no valid index names being written.
"""

from __future__ import annotations

import os

import pytest
import torch

import qwen4exp_ext
from conftest import devices
from test_bad_inputs import CASES, EXC, OPS, assert_untouched, snapshot

needs_gpu = pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU build and a GPU")

DATA_ONLY = {
    "ngram_ids-sizes-zero",
    "ngram_ids-sizes-negative",
    "ngram_ids-offsets-negative",
    "ngram_ids-offsets-overflow-int64",
    "ngram_ids-qsl-start-1",
    "ngram_ids-qsl-decreasing",
    "ngram_ids-qsl-past-T",
    "ple_conv-state_indices-negative",
    "ple_conv-state_indices-eq-slots",
    "ple_conv-state_indices-duplicate",
    "ple_conv-token_indices-past",
    "ple_conv-token_indices-negative",
    "ple_conv_prefill-qsl-decreasing",
    "ple_conv_prefill-qsl-past-T",
    "ple_conv_prefill-qsl-negative-start",
    "ple_conv_prefill-qsl-nonzero-start",
}
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]


def test_every_data_only_case_is_in_the_table():
    assert {case.id for case in DATA_CASES} == DATA_ONLY


def on_gpu(args: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def bad_args(op, override):
    baseline, run, mutable = OPS[op]
    args = baseline()
    override(args)
    return on_gpu(args), run, mutable


@needs_gpu
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_debug_checks_raise_the_cpu_error_and_write_nothing(op, override, match, exc):
    args, run, mutable = bad_args(op, override)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with qwen4exp_ext.debug_checks(), pytest.raises(EXC, match=match):
        run(dict(args))
    torch.cuda.synchronize()
    assert_untouched(before, outputs)


@needs_gpu
@pytest.mark.parametrize("op,override,match,exc", DATA_CASES)
def test_without_debug_checks_bad_values_stay_in_bounds(op, override, match, exc):
    args, run, mutable = bad_args(op, override)
    state = args.get("conv_state")
    before = state.clone() if state is not None else None
    with qwen4exp_ext.debug_checks(enabled=False):
        run(dict(args))
    torch.cuda.synchronize()  # an out-of-bounds access would surface here
    if op == "ngram_ids":
        sizes = args["ngram_heads_vocab_sizes"]
        out = args["output"]
        # A non-positive size gives -1 for its head; others stay in their head's range.
        bad_head = (sizes <= 0).expand_as(out)
        assert (out[bad_head] == -1).all()
    else:
        # Slots no in-range index names keep their bytes.
        slots = args["state_indices"].view(-1).long().cpu()
        named = {int(s) for s in slots if 0 <= s < state.shape[0]}
        for slot in range(state.shape[0]):
            if slot not in named:
                assert torch.equal(state[slot], before[slot]), f"slot {slot} was written"


@needs_gpu
def test_debug_checks_pass_valid_inputs():
    for _op, (baseline, run, _) in OPS.items():
        with qwen4exp_ext.debug_checks():
            run(on_gpu(baseline()))
    torch.cuda.synchronize()


def test_debug_checks_switch_restores_the_environment(monkeypatch):
    name = qwen4exp_ext.DEBUG_CHECKS_ENV
    monkeypatch.delenv(name, raising=False)
    with qwen4exp_ext.debug_checks():
        assert os.environ[name] == "1"
        with qwen4exp_ext.debug_checks(enabled=False):
            assert os.environ[name] == "0"
        assert os.environ[name] == "1"
    assert name not in os.environ
    monkeypatch.setenv(name, "1")
    with qwen4exp_ext.debug_checks(enabled=False):
        assert os.environ[name] == "0"
    assert os.environ[name] == "1"
