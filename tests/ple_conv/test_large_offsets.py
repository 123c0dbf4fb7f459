"""ple_conv past 2^31 and 2^32 elements (issue #48): a conv state whose slots (or channels) lie
across and past those marks of its storage, read and written back in decode, prefill and spec,
with inputs, residual and outer_residual rows there too (views into sparse files:
tests/large_offsets_support.py), on the CPU kernel and the HIP kernels on the SIMT emulator,
against the oracle on compact copies. vLLM 0.34 fixed the same bug in its Triton kernels: program
ids and offsets computed in int32."""

from __future__ import annotations

import pytest
import torch

from conftest import backends
from large_offsets_support import (
    MARKS,
    TOKEN_ROW_STRIDE,
    TOKEN_ROWS,
    run_leaving_nothing,
    seed,
    token_rows,
)
from qwen4exp_ext import reference

from .support import assert_same

BACKENDS = [b for b in backends() if b.device == "cpu"]
CHANNELS = 40
SLOTS = 4  # slot 0 is the null slot
QUERY_LEN = 2  # spec
WIDEST = (4 - 1) * 3 + QUERY_LEN - 1  # the state width of the released K = 4, δ = 3 in spec
# A channel stride that puts channel 16 past 2^31 and channel 32 past 2^32 (the "channels"
# layout), a multiple of 16 elements.
CHANNEL_STRIDE = 2**27 + 16
assert 16 * CHANNEL_STRIDE > MARKS[0] and 32 * CHANNEL_STRIDE > MARKS[1]

# Each mode's batch of TOKEN_ROWS tokens: (state_indices, keyword arguments). Every live slot
# (1: across 2^31, 2: across 2^32, 3: past both, in the "slots" layouts) is read and written.
BATCHES = {
    "decode": ([1, 2, 3, 0], {"has_initial_states": torch.tensor([True, False, True, True])}),
    "prefill": (
        [2, 3, 1],
        {
            "query_start_loc": torch.tensor([0, 1, 3, TOKEN_ROWS]),
            "has_initial_states": torch.tensor([True, True, False]),
        },
    ),
    "spec": (
        [3, 1],
        {
            "query_start_loc": torch.tensor([0, 2, TOKEN_ROWS]),
            "num_accepted_tokens": torch.tensor([2, 1]),
            "spec_query_len": QUERY_LEN,
        },
    ),
}


def state_view(files, layout: str, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A [SLOTS, C, width] state: slots TOKEN_ROW_STRIDE apart, window-first (vLLM's default) or
    dim-first within a slot; or the slots side by side and the channels CHANNEL_STRIDE apart."""
    strides = {
        "window_first": (TOKEN_ROW_STRIDE, 1, CHANNELS),
        "dim_first": (TOKEN_ROW_STRIDE, width, 1),
        "channels": (width, CHANNEL_STRIDE, 1),
    }[layout]
    return files.tensor(dtype, (SLOTS, CHANNELS, width), strides)


def check_conv(files, backend, layout):
    gen = torch.Generator().manual_seed(seed(layout))
    # A page of a sparse file costs milliseconds the first time it is written: the "channels"
    # layout puts each channel on its own pages, so it runs in bf16 only (its HIP kernels then
    # take one channel a thread, as in fp32).
    for dtype in (torch.bfloat16,) if layout == "channels" else (torch.bfloat16, torch.float32):
        # One set of views per dtype, refilled for each call (a page costs nothing after).
        rows = [token_rows(files, dtype, CHANNELS) for _ in range(3)]
        inputs, residual, outer = rows
        widest = state_view(files, layout, dtype, WIDEST)
        # In the "channels" layout the weights' channels lie past the marks too.
        if layout == "channels":
            far_weights = files.tensor(dtype, (CHANNELS, 4), (CHANNEL_STRIDE, 1))
        for mode, (state_indices, kwargs) in BATCHES.items():
            state_indices = torch.tensor(state_indices, dtype=torch.int32)
            for kernel, dilation in ((4, 3), (3, 2)):  # the released shape (its own kernels), any
                width = (kernel - 1) * dilation + (QUERY_LEN - 1 if mode == "spec" else 0)
                state = widest[:, :, :width]
                for t in (*rows, state):
                    t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
                weights = (torch.randn(CHANNELS, kernel, generator=gen) * 0.5).to(dtype)
                if layout == "channels":
                    weights = far_weights[:, :kernel].copy_(weights)
                call = {"mode": mode, "dilation": dilation, **kwargs}
                small = [t.clone() for t in (inputs, residual, state, outer)]
                reference.ple_conv(*small[:3], weights, state_indices, small[3], **call)
                backend.ops.ple_conv(inputs, residual, state, weights, state_indices, outer, **call)
                assert_same(
                    (residual.clone(), state.clone()),
                    (small[1], small[2]),
                    dtype,
                    f"{mode} {dtype} K={kernel} δ={dilation}",
                )


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("layout", ["window_first", "dim_first", "channels"])
def test_state_and_rows_past_2_31_and_2_32_elements(tmp_path, backend, layout):
    """Live slots whose windows straddle element 2^31 (slot 1) and 2^32 (slot 2) of the state's
    storage and lie past both (slot 3), window-first and dim-first; or a state whose channels lie
    past the marks, and the weights' too (channel stride 2^27 + 16: the HIP decode's 32-bit lane
    offsets do not fit, so it must take its generic kernel); read and written back in decode,
    prefill and spec, bf16 and fp32 (bf16 only for the far channels), the released K = 4,
    δ = 3 and another shape; inputs, residual and outer_residual rows across and past the marks
    too. Catches ``slot * state_slot_stride``, ``c * state_channel_stride``,
    ``c * weight_channel_stride`` and ``row * inputs_row_stride`` (and residual's,
    outer_residual's) computed in 32 bits."""
    run_leaving_nothing(tmp_path, check_conv, backend, layout)
