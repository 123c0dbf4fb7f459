"""Fuzzing of ple_conv (SPEC §6) against the reference oracle (SPEC §9.8), within the tolerance of
tests/ple_conv/test_kernel.py, with the time-bounded kit of tests/fuzz_support.py (what is drawn,
the budget, how to replay a failure): every mode, dtype, K, dilation, state layout and stride,
index dtype, token map, null and unreferenced slots and padding requests."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import strategies as st

from fuzz_support import (
    BACKENDS,
    FLOATS,
    Laid,
    Recorder,
    assert_outside_untouched,
    assert_unchanged,
    draw_layout_1d,
    draw_layout_2d,
    draw_request_lengths,
    fuzz,
    generator,
    place,
    sizes,
)
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact, assert_within, tolerance


def draw_state(draw, state: torch.Tensor) -> Laid:
    """conv_state [slots, C, W] in any strides: dim-first, vLLM's window-first, either inside a
    padded buffer, every 2nd slot of a bigger one, or fully permuted storage."""
    slots, channels, width = state.shape
    kind = draw(
        st.sampled_from(
            [
                "dim_first",
                "window_first",
                "dim_first_padded",
                "window_first_padded",
                "slot_step",
                "permuted",
            ]
        ),
        label="conv_state layout",
    )
    if kind == "dim_first":
        return place(state, state.shape, lambda b: b, kind)
    if kind == "window_first":
        return place(state, (slots, width, channels), lambda b: b.transpose(1, 2), kind)
    if kind in ("dim_first_padded", "window_first_padded"):
        pc = draw(st.integers(0, 3), label="channel pad")
        pw = draw(st.integers(0, 3), label="window pad")
        off = draw(st.integers(0, pc), label="channel offset")
        if kind == "dim_first_padded":
            return place(
                state,
                (slots, channels + pc, width + pw),
                lambda b: b[:, off : off + channels, :width],
                kind,
            )
        return place(
            state,
            (slots, width + pw, channels + pc),
            lambda b: b[:, :width, off : off + channels].transpose(1, 2),
            kind,
        )
    if kind == "slot_step":
        return place(state, (2 * slots, channels, width), lambda b: b[1::2], kind)
    return place(state, (width, channels, slots), lambda b: b.permute(2, 1, 0), kind)


def conv_body(backend, draw: Recorder) -> None:
    ops, device = backend.ops, backend.device
    mode = draw(st.sampled_from(reference.CONV_MODES), label="mode")
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    weight_dtype = draw(st.sampled_from([dtype, torch.float32]), label="weight dtype")
    kernel = draw(st.integers(1, 8), label="K")
    dilation = draw(st.integers(1, 8), label="dilation")
    channels = draw(sizes([1, 2, 3, 7, 16, 33, 64], 1, 80), label="C")
    query_len = draw(st.integers(1, 5), label="spec_query_len") if mode == "spec" else 1
    outer = draw(st.booleans(), label="outer_residual")
    state_len = (kernel - 1) * dilation

    # query_start_loc[0] is always 0: the kernels reject anything else (the reference would take
    # rows before it, as rows without output).
    tail = pad_reqs = qsl_extra = decode_pad = 0
    if mode == "decode":
        lengths = [1] * draw(sizes([0, 1, 2, 3], 0, 32), label="tokens")
        decode_pad = draw(st.integers(0, 3), label="state_indices padding")
    else:
        if mode == "prefill":
            lengths = draw_request_lengths(draw, longest=64, many=32)
        else:
            lengths = draw(st.lists(st.integers(0, query_len), max_size=12), label="lengths")
        pad_reqs = draw(st.integers(0, 3), label="padding requests (null slot, empty)")
        tail = draw(st.sampled_from([0, 0, 1, 3]), label="rows past qsl[R]")
        qsl_extra = draw(st.integers(0, 2), label="extra query_start_loc entries")
    null_rate = draw(st.sampled_from([0.0, 0.3, 1.0]), label="null slot rate")
    spare_slots = draw(st.integers(0, 3), label="unreferenced slots")
    extra_width = draw(st.integers(0, 2), label="extra state window")
    token_map = draw(st.booleans(), label="token_indices")
    gen = generator(draw)
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))

    num_reqs = len(lengths)
    is_null = [rng.random() < null_rate for _ in range(num_reqs)]
    num_live = num_reqs - sum(is_null)
    num_slots = 1 + num_live + spare_slots
    live = rng.sample(range(1, num_slots), num_live)
    slots = [0 if null else live.pop() for null in is_null]
    if mode == "decode":
        num_rows = num_reqs
        padding = [rng.choice([0, -1, *slots[:1], num_slots + 5]) for _ in range(decode_pad)]
        slots_all = slots + padding
    else:
        slots_all = slots + [0] * pad_reqs
        qsl = [0]
        for n in lengths + [0] * pad_reqs:
            qsl.append(qsl[-1] + n)
        num_rows = qsl[-1] + tail
        qsl += sorted(qsl[-1] + rng.randint(0, tail) for _ in range(qsl_extra))
    all_reqs = len(slots_all)
    physical = num_rows + (draw(st.integers(0, 3), label="unmapped rows") if token_map else 0)
    width = state_len + query_len - 1 + extra_width

    inputs = torch.randn(physical, channels, generator=gen).to(dtype)
    residual = torch.randn(physical, channels, generator=gen).to(dtype)
    outer_residual = torch.randn(physical, channels, generator=gen).to(dtype) if outer else None
    weights = (torch.randn(channels, kernel, generator=gen) * 0.5).to(weight_dtype)
    state = torch.randn(num_slots, channels, width, generator=gen).to(dtype)
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
    index = {"state_indices": torch.tensor(slots_all, dtype=index_dtype)}
    kwargs = {"mode": mode, "dilation": dilation}
    if mode != "decode":
        index["query_start_loc"] = torch.tensor(qsl, dtype=index_dtype)
    if mode == "spec":
        kwargs["spec_query_len"] = query_len
        accepted = [rng.randint(0, query_len + 1) for _ in range(all_reqs)]
        index["num_accepted_tokens"] = torch.tensor(accepted, dtype=index_dtype)
    init_dtype = draw(
        st.sampled_from([torch.bool, torch.uint8, torch.int32, torch.int64]),
        label="has_initial_states dtype",
    )
    if mode == "prefill" or draw(st.booleans(), label="has_initial_states given"):
        flags = [rng.random() < 0.7 for _ in range(all_reqs + rng.randint(0, 2))]
        index["has_initial_states"] = torch.tensor(flags).to(init_dtype)
    if token_map:
        index["token_indices"] = torch.tensor(
            rng.sample(range(physical), num_rows),
            dtype=draw(st.sampled_from([torch.int32, torch.int64]), label="token_indices dtype"),
        )

    # The reference, on contiguous copies.
    ref_residual, ref_state = residual.clone(), state.clone()
    reference.ple_conv(
        inputs,
        ref_residual,
        ref_state,
        weights,
        index["state_indices"],
        outer_residual,
        **kwargs,
        **{k: v for k, v in index.items() if k != "state_indices"},
    )

    # Ours, on strided layouts of the same values.
    laid = {
        "inputs": draw_layout_2d(draw, inputs, "inputs", any_strides=False),
        "residual": draw_layout_2d(draw, residual, "residual", any_strides=False),
        "conv_weights": draw_layout_2d(draw, weights, "conv_weights", any_strides=True),
        "conv_state": draw_state(draw, state),
    }
    if outer_residual is not None:
        laid["outer_residual"] = draw_layout_2d(
            draw, outer_residual, "outer_residual", any_strides=False
        )
    for name, values in index.items():
        laid[name] = draw_layout_1d(draw, values, name, column_2d=True)
    on_device = {name: x.on(device) for name, x in laid.items()}
    args = {name: view for name, (_, view) in on_device.items()}
    ops.ple_conv(
        args.pop("inputs"),
        args.pop("residual"),
        args.pop("conv_state"),
        args.pop("conv_weights"),
        args.pop("state_indices"),
        args.pop("outer_residual", None),
        **kwargs,
        **args,
    )

    got_residual = on_device["residual"][1].cpu()
    assert_within(
        got_residual, ref_residual, tolerance("ple_conv", dtype), "residual", bitwise=True
    )
    got_state = on_device["conv_state"][1].cpu()
    assert_exact(got_state, ref_state, "conv_state")
    # Nothing is written outside the views, nor to slots no request (of the first R) refers to,
    # nor to a live slot whose prefill chunk is empty, nor to rows token_indices does not map.
    referenced = {s for s in slots if s != 0}
    if mode == "prefill":
        referenced -= {s for s, n in zip(slots, lengths, strict=True) if n == 0}
    for slot in range(num_slots):
        if slot not in referenced:
            assert_exact(
                got_state[slot], state[slot], f"conv_state slot {slot} (unused)", bitwise=True
            )
    if token_map:
        unmapped = sorted(set(range(physical)) - set(index["token_indices"].tolist()))
        assert_exact(
            got_residual[unmapped], residual[unmapped], "unmapped residual rows", bitwise=True
        )
    for name in ("residual", "conv_state"):
        assert_outside_untouched(laid[name], on_device[name][0], name)
    for name, x in laid.items():
        if name not in ("residual", "conv_state"):
            assert_unchanged(x, on_device[name][0], name)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_fuzz_ple_conv(backend, record_property):
    fuzz(f"ple_conv on {backend}", lambda draw: conv_body(backend, draw), record_property)
