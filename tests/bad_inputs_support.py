"""The bad-input case table of tests/test_bad_inputs.py, also run by tests/test_gpu_debug_checks.py.

OPS: one valid baseline per op (outputs filled with a sentinel pattern), the runner that calls it,
and the names of the tensors it writes. CASES: each overrides one argument of a baseline, with
the error it must raise. DATA_ONLY (DATA_CASES): the cases whose bad values only the index data
shows, errors on the CPU and, on the GPU and the SIMT emulator, only with debug checks.
"""

from __future__ import annotations

import pytest
import torch

from qwen4exp_ext import ops

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
META = torch.device("meta")
EXC = (RuntimeError, ValueError, TypeError, IndexError)


def sentinel(shape, dtype) -> torch.Tensor:
    """A tensor with a distinctive bit pattern (no two neighbours equal)."""
    n = 1
    for s in shape:
        n *= s
    t = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype.is_floating_point:
        return (t * -1.375 - 7777.0).to(dtype)
    return (t * 7919 - 123456789).to(dtype)


# ---- baselines -------------------------------------------------------------------------------


def _conv_baseline(tokens: int, seed: int, mode: str, **extra) -> dict:
    """ple_conv of `tokens` rows of 4 channels, K = 3, on slots 1 and 2 of 4 (width 2)."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        inputs=torch.randn(tokens, 4, generator=g),
        residual=sentinel((tokens, 4), torch.float32),
        conv_state=sentinel((4, 4, 2), torch.float32) + 0.25,
        conv_weights=torch.randn(4, 3, generator=g),
        state_indices=torch.tensor([1, 2], dtype=torch.int32),
        outer_residual=None,
        mode=mode,
        dilation=1,
        **extra,
    )


def conv_decode_baseline() -> dict:
    return _conv_baseline(tokens=2, seed=2, mode="decode")


def conv_prefill_baseline() -> dict:
    return _conv_baseline(
        tokens=5,
        seed=3,
        mode="prefill",
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        has_initial_states=torch.tensor([True, False]),
    )


# Each runner calls one op of `kernels` (qwen4exp_ext.ops, or a backend's ops) with the arguments.
def run_conv(a, kernels=ops):
    pos = [
        a.pop(k)
        for k in (
            "inputs",
            "residual",
            "conv_state",
            "conv_weights",
            "state_indices",
            "outer_residual",
        )
    ]
    kernels.ple_conv(*pos, **a)


OPS = {
    "ple_conv": (conv_decode_baseline, run_conv, ("residual", "conv_state")),
    "ple_conv_prefill": (conv_prefill_baseline, run_conv, ("residual", "conv_state")),
}


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to(META)


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, stride(-1) == 2."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def set_(name, fn):
    """An override: args[name] = fn(args[name]); `arg` names the argument it changes."""

    def apply(a):
        a[name] = fn(a[name])

    apply.arg = name
    return apply


def put(name, value):
    def apply(a):
        a[name] = value() if callable(value) else value

    apply.arg = name
    return apply


def p(op, case_id, override, match, exc=EXC):
    return pytest.param(op, override, match, exc, id=f"{op}-{case_id}")


I32 = torch.int32
F16 = torch.float16
F32 = torch.float32
FP8 = torch.float8_e4m3fn

CASES = [
    # ---- ple_conv (decode baseline) ----
    p("ple_conv", "inputs-int", set_("inputs", lambda t: t.to(I32)), "inputs"),
    p("ple_conv", "inputs-1d", set_("inputs", lambda t: t.reshape(-1)), "inputs"),
    p("ple_conv", "inputs-noncontig", set_("inputs", noncontig), "inputs"),
    p("ple_conv", "conv_weights-f64", set_("conv_weights", lambda t: t.double()), "conv_weights"),
    p("ple_conv", "conv_weights-channels", set_("conv_weights", lambda t: t[:3]), "conv_weights"),
    p("ple_conv", "kernel-size-0", put("conv_weights", lambda: torch.zeros(4, 0)), "conv_weights"),
    p("ple_conv", "kernel-size-9", put("conv_weights", lambda: torch.zeros(4, 9)), "conv_weights"),
    p("ple_conv", "dilation-0", put("dilation", 0), "dilation"),
    p("ple_conv", "dilation-9", put("dilation", 9), "dilation"),
    p("ple_conv", "dilation-negative", put("dilation", -1), "dilation"),
    p("ple_conv", "conv_state-2d", set_("conv_state", lambda t: t[:, :, 0]), "conv_state"),
    p("ple_conv", "conv_state-narrow", set_("conv_state", lambda t: t[:, :, :1]), "conv_state"),
    p("ple_conv", "conv_state-f16", set_("conv_state", lambda t: t.to(F16)), "conv_state"),
    p(
        "ple_conv",
        "state_indices-float",
        set_("state_indices", torch.Tensor.float),
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-short",
        set_("state_indices", lambda t: t[:1]),
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-negative",
        put("state_indices", lambda: torch.tensor([1, -1], dtype=I32)),
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-eq-slots",
        put("state_indices", lambda: torch.tensor([4, 1], dtype=I32)),
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-duplicate",
        put("state_indices", lambda: torch.tensor([2, 2], dtype=I32)),
        "state_indices",
    ),
    p(
        "ple_conv",
        "token_indices-past",
        put("token_indices", lambda: torch.tensor([0, 2], dtype=I32)),
        "token_indices",
    ),
    p(
        "ple_conv",
        "token_indices-negative",
        put("token_indices", lambda: torch.tensor([-1, 0])),
        "token_indices",
    ),
    p(
        "ple_conv",
        "token_indices-float",
        put("token_indices", lambda: torch.tensor([0.0, 1.0])),
        "token_indices",
    ),
    p("ple_conv", "residual-shape", put("residual", lambda: sentinel((2, 5), F32)), "residual"),
    p("ple_conv", "residual-f16", put("residual", lambda: sentinel((2, 4), F16)), "residual"),
    p("ple_conv", "residual-noncontig", set_("residual", noncontig), "residual"),
    p(
        "ple_conv",
        "outer_residual-shape",
        put("outer_residual", lambda: torch.zeros(3, 4)),
        "outer_residual",
    ),
    p(
        "ple_conv",
        "outer_residual-f16",
        put("outer_residual", lambda: torch.zeros(2, 4, dtype=F16)),
        "outer_residual",
    ),
    p(
        "ple_conv",
        "token_indices-2d",
        put("token_indices", lambda: torch.tensor([[0, 1]])),
        "token_indices",
    ),
    p("ple_conv", "mode-bad", put("mode", "verify"), "mode"),
    p(
        "ple_conv",
        "spec_query_len-0",
        lambda a: a.update(
            mode="spec",
            spec_query_len=0,
            query_start_loc=torch.tensor([0, 1, 2], dtype=I32),
            num_accepted_tokens=torch.tensor([1, 1], dtype=I32),
        ),
        "spec_query_len",
    ),
    p(
        "ple_conv",
        "spec-num_accepted_tokens-missing",
        lambda a: a.update(mode="spec", query_start_loc=torch.tensor([0, 1, 2], dtype=I32)),
        "num_accepted_tokens",
    ),
    p("ple_conv", "meta-residual", set_("residual", meta), "residual"),
    p("ple_conv", "meta-conv_state", set_("conv_state", meta), "conv_state"),
    p(
        "ple_conv",
        "meta-outer_residual",
        put("outer_residual", lambda: torch.zeros(2, 4, device=META)),
        "outer_residual",
    ),
    p("ple_conv", "meta-conv_weights", set_("conv_weights", meta), "conv_weights"),
    p("ple_conv", "meta-state_indices", set_("state_indices", meta), "state_indices"),
    # ---- ple_conv (prefill baseline) ----
    p(
        "ple_conv_prefill",
        "qsl-decreasing",
        put("query_start_loc", lambda: torch.tensor([0, 3, 2], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ple_conv_prefill",
        "qsl-past-T",
        put("query_start_loc", lambda: torch.tensor([0, 2, 6], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ple_conv_prefill",
        "qsl-negative-start",
        put("query_start_loc", lambda: torch.tensor([-1, 2, 5], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ple_conv_prefill",
        "qsl-nonzero-start",
        put("query_start_loc", lambda: torch.tensor([1, 2, 5], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ple_conv_prefill",
        "qsl-short",
        set_("query_start_loc", lambda t: t[:2]),
        "query_start_loc",
    ),
    p("ple_conv_prefill", "qsl-missing", put("query_start_loc", None), "query_start_loc"),
    p(
        "ple_conv_prefill",
        "has_initial_states-missing",
        put("has_initial_states", None),
        "has_initial_states",
    ),
    p(
        "ple_conv_prefill",
        "has_initial_states-float",
        set_("has_initial_states", lambda t: t.float()),
        "has_initial_states",
    ),
    p(
        "ple_conv_prefill",
        "has_initial_states-short",
        set_("has_initial_states", lambda t: t[:1]),
        "has_initial_states",
    ),
    p("ple_conv_prefill", "meta-qsl", set_("query_start_loc", meta), "query_start_loc"),
]


# Index values that only the data shows: errors on the CPU, which reads them for free; on the GPU
# (and the SIMT emulator) only with debug checks (tests/test_gpu_debug_checks.py).
DATA_ONLY = {
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


# ---- the checks every op's bad-input tests run (tests/<op>/test_bad_inputs.py) ----------------
# An op's bad-input module (tests/<op>/bad_inputs.py) holds its specs: for each variant, one valid
# baseline (outputs filled with a sentinel pattern), the runner that calls the op of a backend's
# `kernels` with it, and the names of the tensors it writes: (baseline, run, mutable). Its cases
# override one argument of a baseline each, with the error message it must give.


# The backends that take the table's CPU tensors: the CPU kernels and the SIMT emulator's HIP
# kernels, whose host glue is the GPU build's.
def cpu_backends() -> list:
    from conftest import backends

    return [b for b in backends() if b.device == "cpu"]


# The backends whose kernels read index data on the device: the GPU and the SIMT emulator. Bad
# index values are defined there instead of errors, unless debug checks are on.
def device_index_backends() -> list:
    from conftest import backends

    return [b for b in backends() if b.reads_indices_on_device]


def on_device(args: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def synchronize(backend) -> None:
    if backend.device == "cuda":
        torch.cuda.synchronize()  # an out-of-bounds access would surface here


def check_raises_and_writes_nothing(spec, backend, override, match, exc) -> None:
    """The op raises `exc` with a message matching `match`, and every tensor it writes keeps its
    bytes."""
    from qwen4exp_ext.testing import assert_untouched, snapshot

    baseline, run, mutable = spec
    args = baseline()
    override(args)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with pytest.raises(exc, match=match):
        run(dict(args), backend.ops)
    assert_untouched(before, outputs)


def bad_args_on_device(spec, override, backend) -> dict:
    baseline, _, _ = spec
    args = baseline()
    override(args)
    return on_device(args, backend.device)


def check_debug_checks_raise_and_write_nothing(spec, backend, override, match) -> None:
    """With debug checks, a kernel that reads indices on the device raises the CPU's error and
    writes nothing."""
    import qwen4exp_ext
    from qwen4exp_ext.testing import assert_untouched, snapshot

    _, run, mutable = spec
    args = bad_args_on_device(spec, override, backend)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with qwen4exp_ext.debug_checks(), pytest.raises(EXC, match=match):
        run(dict(args), backend.ops)
    synchronize(backend)
    assert_untouched(before, outputs)


def run_without_debug_checks(spec, backend, override) -> dict:
    """Runs the op on the bad data with debug checks off; returns its arguments, as written."""
    import qwen4exp_ext

    _, run, _ = spec
    args = bad_args_on_device(spec, override, backend)
    with qwen4exp_ext.debug_checks(enabled=False):
        run(dict(args), backend.ops)
    synchronize(backend)
    return args


def check_debug_checks_pass_valid_inputs(spec, backend) -> None:
    import qwen4exp_ext

    baseline, run, _ = spec
    with qwen4exp_ext.debug_checks():
        run(on_device(baseline(), backend.device), backend.ops)
    synchronize(backend)
