"""ple_conv's batch builders and comparison helpers, shared by tests/ple_conv/'s test files (and
by tests/test_vllm_choice.py and the layer test of tests/test_layer_oracle.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_within, same_layout, tolerance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = list(reference.CONV_MODES)


@dataclass
class Batch:
    """One ple_conv call: its tensors on the CPU, and the keyword arguments."""

    inputs: torch.Tensor
    residual: torch.Tensor
    conv_state: torch.Tensor
    conv_weights: torch.Tensor
    state_indices: torch.Tensor
    outer_residual: torch.Tensor | None
    kwargs: dict = field(default_factory=dict)

    def run(self, fn, device="cpu"):
        """Calls fn (ours, the reference or vLLM's) on copies; returns (residual, conv_state)."""
        # Copies in the batch's layouts (strided rows, the state's window order) on any device.
        residual = same_layout(self.residual, device)
        state = same_layout(self.conv_state, device)
        kwargs = {
            k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.kwargs.items()
        }
        outer = self.outer_residual
        outer = same_layout(outer, device) if outer is not None else None
        fn(
            same_layout(self.inputs, device),
            residual,
            state,
            self.conv_weights.to(device),
            self.state_indices.to(device),
            outer,
            **kwargs,
        )
        return residual.cpu(), state.cpu()


def make_state(slots, channels, width, dtype, window_first, gen):
    if window_first:  # vLLM's default: [slots, W, C] storage seen as [slots, C, W]
        return torch.randn(slots, width, channels, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(slots, channels, width, generator=gen).to(dtype)


def make_batch(
    mode,
    dtype,
    *,
    lengths=None,
    tokens=None,
    channels=37,
    kernel=4,
    dilation=3,
    query_len=1,
    extra_width=0,
    window_first=True,
    token_map=False,
    outer=True,
    null_every=3,
    seed=0,
    weight_dtype=None,
    initial=None,
):
    """A random batch: requests of the given lengths (decode: `tokens` single-token requests),
    distinct live slots with every `null_every`-th request on the null slot 0, random
    has_initial_states (or `initial`), a random accepted count per spec request (0..q+1, so the
    clamping runs), an optional token map into a larger shuffled physical batch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if mode == "decode":
        lengths = [1] * (tokens if tokens is not None else 6)
    num_reqs = len(lengths)
    num_rows = sum(lengths)
    state_len = (kernel - 1) * dilation
    width = state_len + (query_len if mode == "spec" else 1) - 1 + extra_width
    slots = num_reqs + 2
    live_slots = rng.sample(range(1, slots), num_reqs) if num_reqs else []
    state_indices = torch.tensor(
        [
            0 if null_every and r % null_every == null_every - 1 else s
            for r, s in enumerate(live_slots)
        ],
        dtype=torch.int32,
    )
    physical = num_rows + (3 if token_map else 0)
    inputs = torch.randn(physical, channels, generator=gen).to(dtype)
    residual = torch.randn(physical, channels, generator=gen).to(dtype)
    outer_residual = torch.randn(physical, channels, generator=gen).to(dtype) if outer else None
    conv_weights = (torch.randn(channels, kernel, generator=gen) * 0.5).to(weight_dtype or dtype)
    conv_state = make_state(slots, channels, width, dtype, window_first, gen)
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    kwargs = {"mode": mode, "dilation": dilation}
    if initial is None:
        has_init = torch.tensor([rng.random() < 0.7 for _ in range(num_reqs)], dtype=torch.bool)
    else:
        has_init = torch.full((num_reqs,), bool(initial), dtype=torch.bool)
    if mode == "decode":
        if rng.random() < 0.5 or initial is not None:
            kwargs["has_initial_states"] = has_init
    else:
        kwargs["query_start_loc"] = torch.tensor(qsl, dtype=torch.int32)
        if mode == "prefill":
            kwargs["has_initial_states"] = has_init
        else:
            kwargs["num_accepted_tokens"] = torch.tensor(
                [rng.randint(0, query_len + 1) for _ in range(num_reqs)], dtype=torch.int32
            )
            kwargs["spec_query_len"] = query_len
    if token_map:
        kwargs["token_indices"] = torch.tensor(
            rng.sample(range(physical), num_rows), dtype=torch.int64
        )
    return Batch(inputs, residual, conv_state, conv_weights, state_indices, outer_residual, kwargs)


def random_lengths(rng, mode, query_len):
    count = rng.randint(0, 5)
    if mode == "spec":
        return [rng.randint(0, query_len) for _ in range(count)]
    return [rng.choice([0, 1, 2, 5, rng.randint(0, 30)]) for _ in range(count)]


def assert_same(got, expected, dtype, what="", against="reference"):
    """(residual, conv_state) within ple_conv's tolerance in this dtype against ``against``."""
    tol = tolerance("ple_conv", dtype, against=against)
    for g, e, name in zip(got, expected, ("residual", "conv_state"), strict=True):
        assert_within(g, e, tol, f"{what} {name}")


def single_request_step(
    backend, mode, x, state, weights, *, init=True, accepted=1, query_len=1, dilation=3
):
    """One call for one request on slot 1 of a one-slot-plus-null state; returns (y, state)."""
    device = backend.device
    residual = torch.zeros_like(x)
    kwargs = {"mode": mode, "dilation": dilation}
    flags = torch.tensor([init]).to(device)
    if mode == "decode":
        kwargs["has_initial_states"] = flags
    else:
        kwargs["query_start_loc"] = torch.tensor([0, x.shape[0]], dtype=torch.int32).to(device)
        if mode == "prefill":
            kwargs["has_initial_states"] = flags
        else:
            kwargs["num_accepted_tokens"] = torch.tensor([accepted], dtype=torch.int32).to(device)
            kwargs["spec_query_len"] = query_len
    backend.ops.ple_conv(
        x, residual, state, weights, torch.tensor([1], dtype=torch.int32).to(device), None, **kwargs
    )
    return residual


def fresh_state(channels, width, dtype, device, gen, window_first=True):
    state = make_state(2, channels, width, dtype, window_first, gen)
    return same_layout(state, device)


def new_state(slots, channels, width, dtype, layout_="dim_first", fill=None):
    """[slots, C, W] pool; window-first storage is a transposed view (vLLM keeps both)."""
    if layout_ == "dim_first":
        state = torch.zeros(slots, channels, width, dtype=dtype)
    else:
        state = torch.zeros(slots, width, channels, dtype=dtype).transpose(1, 2)
    if fill is not None:
        state.copy_(fill)
    return state
