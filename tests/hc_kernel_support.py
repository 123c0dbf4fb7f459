"""The checks every hyper-connection op's tests/<op>/test_kernel.py runs (issue #50 item 2), on
tests/hc_support.py's batches: the kernels of every backend against the oracle (every dtype,
strided views as vLLM passes them, contiguous rows, a row longer than vLLM's 512-wide tile, odd
widths), against vLLM's own Triton kernels on Triton's CPU interpreter (fp16: the measured share
of bit-equal elements, at least HC_MIN_EQUAL_SHARE, and one unit in the last place at most; fp32
within the stated tolerance), out= into strided views, empty batches and opcheck.
"""

from __future__ import annotations

import torch

from hc_support import as_tuple, hc_batch, op_args, oracle, parity, run_vllm
from qwen4exp_ext.testing import HC_MIN_EQUAL_SHARE, assert_exact, assert_within, tolerance

# (T, H, hc_count): 16-byte rows (the HIP kernels' 128-bit path when contiguous), odd widths (the
# element path), a stream longer than vLLM's 512-wide tile of hc_combine_norm, one stream. Small:
# the emulator runs every thread as a fiber.
SHAPES = [(3, 40, 4), (2, 33, 3), (1, 520, 2), (2, 24, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUTPUT_NAMES = {"hc_combine_norm": ("h", "xn")}


def _names(op: str, count: int) -> tuple[str, ...]:
    return OUTPUT_NAMES.get(op, ("out",))[:count] if count > 1 else ("out",)


def run(backend, op: str, *args, **kwargs):
    return as_tuple(getattr(backend.ops, op)(*args, **kwargs))


def check_matches_oracle(backend, op, dtype, shape, *, strided=True, **batch_kw) -> None:
    tokens, width, hc_count = shape
    batch = hc_batch(
        tokens, width, hc_count, dtype, seed=tokens + width, strided=strided, **batch_kw
    )
    got = run(backend, op, *op_args(op, batch))
    expected = as_tuple(oracle(op, batch))
    for g, e, name in zip(got, expected, _names(op, len(expected)), strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, (name, g.shape, g.dtype)
        assert_within(g, e, tolerance(op, dtype), f"{backend} {op} {name} {dtype} {shape}")


# vLLM's results by case: the interpreter is slow, and every backend compares with them.
_VLLM_RESULTS: dict = {}


def vllm_parity(backend, op, dtype, shape, vendor="amd", no_logits=False, **batch_kw) -> list:
    """Our kernel and vLLM's (interpreter) on one batch: [(output name, Parity)], each within
    the stated tolerance. ``no_logits``: injection_logits None (vLLM's NVIDIA kernels)."""
    tokens, width, hc_count = shape
    batch = hc_batch(tokens, width, hc_count, dtype, seed=tokens * width, **batch_kw)
    if no_logits:
        batch.injection_logits = None
    args = op_args(op, batch)
    key = (op, dtype, shape, vendor, no_logits, tuple(sorted(batch_kw.items())))
    if key not in _VLLM_RESULTS:
        _VLLM_RESULTS[key] = as_tuple(run_vllm(op, *args, vendor=vendor))
    expected = _VLLM_RESULTS[key]
    got = run(backend, op, *args)
    found = []
    for g, e, name in zip(got, expected, _names(op, len(expected)), strict=True):
        what = f"{backend} {op} {name} {dtype} {shape} against vLLM"
        assert_within(g, e, tolerance(op, dtype, against="vllm"), what)
        found.append((name, parity(g, e)))
    return found


def check_matches_vllm(backend, op, dtype, shape, **kw) -> None:
    for name, measured in vllm_parity(backend, op, dtype, shape, **kw):
        if dtype == torch.float16:
            assert measured.equal_share >= HC_MIN_EQUAL_SHARE, f"{backend} {op} {name}: {measured}"


def check_out(backend, op, dtype) -> None:
    """out= writes into row-major views (column slices of wider buffers) and returns them, the
    functional result's bits; the columns around them are untouched."""
    batch = hc_batch(3, 24, 2, dtype, seed=5)
    args = op_args(op, batch)
    expected = run(backend, op, *args)
    wides, views = [], []
    for e in expected:
        wide = torch.full((e.shape[0], e.shape[1] + 3), 7.0, dtype=dtype)
        wides.append(wide)
        views.append(wide[:, 1 : 1 + e.shape[1]])
    out = tuple(views) if len(views) > 1 else views[0]
    got = run(backend, op, *args, out=out)
    for g, v, e, wide in zip(got, views, expected, wides, strict=True):
        assert g is v
        assert_exact(v, e, f"{op} out=", bitwise=True)
        assert (wide[:, 0] == 7.0).all() and (wide[:, -2:] == 7.0).all()


def check_empty(backend, op) -> None:
    batch = hc_batch(0, 16, 2, torch.bfloat16)
    for g, e in zip(
        run(backend, op, *op_args(op, batch)), as_tuple(oracle(op, batch)), strict=True
    ):
        assert g.shape == e.shape and g.dtype == e.dtype


def check_opcheck(backend, op) -> None:
    batch = hc_batch(2, 16, 2, torch.float32, seed=3)
    args = op_args(op, batch)
    library = backend.library
    torch.library.opcheck(getattr(library, op).default, args)
    expected = as_tuple(getattr(library, op).default(*args))
    outs = [torch.empty_like(e) for e in expected]
    kwargs = dict(zip(_names(op, len(outs)), outs, strict=True))
    torch.library.opcheck(getattr(library, f"{op}_out").default, args, kwargs)


def check_alignment_independent(backend, op, dtype, shape) -> None:
    """The same values in strided views (rows not 16-byte aligned: the HIP kernels' element
    path) and in contiguous tensors (their 128-bit path) give the same bits: which elements a
    thread sums, and in what order, depends on the width alone."""
    tokens, width, hc_count = shape
    strided = hc_batch(tokens, width, hc_count, dtype, seed=width)
    args = op_args(op, strided)
    dense = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    for g, e in zip(run(backend, op, *args), run(backend, op, *dense), strict=True):
        assert_exact(g, e, f"{backend} {op}: strided against contiguous", bitwise=True)
