"""Shared by the fused hyper-connection projections' tests (issue #50 item 3: ``hc_up_gate_mix``,
``hc_down_silu_inject``, tests/hc_up_gate_mix/ and tests/hc_down_silu_inject/): seeded batches,
the ops' arguments, and the checks both run on every backend (cpu, the HIP kernels on the SIMT
emulator at wave 32 and 64) against the oracle, the unfused path (qwen4exp_ext.reference_hc).

By default every activation is a strided view as vLLM passes them (the low-rank input a column
slice of the merged down+inject GEMM output, xn a column slice of a wider buffer) and w_up a
column slice of a wider weight (a row stride above R); ``strided=False`` gives contiguous
tensors. Magnitudes as a module's: xn normalised (|x| of a few units), weights scaled by
1/sqrt(K) so that the dots are of a few units (sigmoid's steep and flat parts both).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import pytest
import torch

from qwen4exp_ext import ops
from qwen4exp_ext import reference_hc as ref
from qwen4exp_ext.testing import assert_exact, assert_within, tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (T, H, HC, R): decode's T = 1, 3 and 16; H not a multiple of any vector width (33, 7) and one
# that is (40); R odd (the dots' partial last vector) and R = 1; HC = 1..4. Small: the SIMT
# emulator runs every thread as a fiber.
SHAPES = [(1, 40, 4, 17), (3, 33, 3, 8), (16, 7, 2, 5), (2, 24, 1, 1)]


@dataclass
class FusedBatch:
    lowrank: torch.Tensor  # [T, R]
    xn: torch.Tensor  # [T, HC·H]
    w_up: torch.Tensor  # [HC·H, R]
    w_down: torch.Tensor  # [R, HC·H]
    w_inj: torch.Tensor  # [HC, HC·H]
    hc_count: int


def fused_batch(
    tokens: int,
    width: int,
    hc_count: int,
    rank: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    strided: bool = True,
) -> FusedBatch:
    gen = torch.Generator().manual_seed(seed)
    depth = hc_count * width
    pad = 3 if strided else 0

    def randn(rows: int, cols: int, scale: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * scale).to(dtype)

    down = randn(tokens, rank + hc_count + pad, 1.0)  # the merged down+inject GEMM output
    merged = randn(rank + hc_count, depth + pad, 3.0 / depth**0.5)  # merged down+inject weight
    return FusedBatch(
        lowrank=down[:, :rank] if strided else down[:, :rank].contiguous(),
        xn=randn(tokens, depth + pad, 1.0)[:, pad:],
        w_up=randn(depth, rank + pad, 3.0 / rank**0.5)[:, :rank],
        w_down=merged[:rank, :depth],
        w_inj=merged[rank:, :depth],
        hc_count=hc_count,
    )


def args(op: str, b: FusedBatch, *, inject: bool = True) -> tuple:
    if op == "hc_up_gate_mix":
        return (b.lowrank, b.w_up, b.xn, b.hc_count)
    return (b.xn, b.w_down, b.w_inj if inject else None, b.hc_count)


def oracle(op: str, *a) -> tuple:
    out = getattr(ref, op)(*a)
    return out if isinstance(out, tuple) else (out,)


def run(backend, op: str, *a, **kw) -> tuple:
    out = getattr(backend.ops, op)(*a, **kw)
    return out if isinstance(out, tuple) else (out,)


def check_matches_oracle(backend, op, dtype, shape, *, strided=True, inject=True) -> None:
    tokens, width, hc_count, rank = shape
    b = fused_batch(tokens, width, hc_count, rank, dtype, seed=sum(shape), strided=strided)
    a = args(op, b, inject=inject)
    got, expected = run(backend, op, *a), oracle(op, *a)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        if e is None:
            assert g is None
            continue
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape)
        assert_within(g, e, tolerance(op, dtype), f"{backend} {op} {dtype} {shape}")


def bit_equal_share(got: torch.Tensor, expected: torch.Tensor) -> float:
    bits = torch.int16 if got.itemsize == 2 else torch.int32
    return (got.view(bits) == expected.view(bits)).float().mean().item()


def check_out(backend, op, dtype) -> None:
    """out= writes into row-major column slices of wider buffers and returns them, the functional
    result's bits; the columns around them untouched."""
    b = fused_batch(3, 8, 2, 5, dtype, seed=4)
    a = args(op, b)
    expected = run(backend, op, *a)
    wides = [torch.full((e.shape[0], e.shape[1] + 3), 7.0, dtype=dtype) for e in expected]
    views = [w[:, 1 : 1 + e.shape[1]] for w, e in zip(wides, expected, strict=True)]
    got = run(backend, op, *a, out=tuple(views) if len(views) > 1 else views[0])
    for g, v, e, w in zip(got, views, expected, wides, strict=True):
        assert g is v
        assert_exact(v, e, f"{backend} {op} out=", bitwise=True)
        assert (w[:, 0] == 7.0).all() and (w[:, -2:] == 7.0).all()


def check_empty(backend, op) -> None:
    b = fused_batch(0, 8, 2, 3, torch.bfloat16)
    a = args(op, b)
    for g, e in zip(run(backend, op, *a), oracle(op, *a), strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype


def check_opcheck(backend, op) -> None:
    b = fused_batch(2, 8, 2, 3, torch.float32, seed=3)
    a = args(op, b)
    library_op = getattr(backend.library, op)
    torch.library.opcheck(library_op.default, a)
    expected = library_op.default(*a)
    expected = expected if isinstance(expected, tuple) else (expected,)
    outs = [torch.empty_like(e) for e in expected]
    names = ("lowrank", "logits") if op == "hc_down_silu_inject" else ("out",)
    out_op = getattr(backend.library, f"{op}_out").default
    torch.library.opcheck(out_op, a, dict(zip(names, outs, strict=True)))


def check_batch_independent(backend, op, dtype) -> None:
    """Each token's result is the same bits alone as in a batch of 16 (each dot is summed in an
    order of its own, whatever tile it is computed in): a decode step does not depend on what
    else is in its batch."""
    b = fused_batch(16, 24, 4, 9, dtype, seed=11)
    whole = run(backend, op, *args(op, b))
    for t in (0, 5, 15):
        alone = replace(b, lowrank=b.lowrank[t : t + 1], xn=b.xn[t : t + 1])
        for g, e in zip(run(backend, op, *args(op, alone)), whole, strict=True):
            assert_exact(g, e[t : t + 1], f"{backend} {op} token {t}", bitwise=True)


@contextlib.contextmanager
def cpu_hc_dot(dot: str):
    """The CPU kernels' bf16 dots pinned to ``dot`` ("fp32" or "bf16", ops.set_cpu_hc_dot) for
    the block; skips where this CPU lacks it."""
    try:
        previous = ops.set_cpu_hc_dot(dot)
    except ValueError as e:
        pytest.skip(str(e))
    try:
        yield
    finally:
        ops.set_cpu_hc_dot(previous)
