"""Helpers for comparing kernels with the reference, shared by the tests and the bench.

- :data:`TOLERANCES` and :func:`tolerance`: how far each op's results may be from what they are
  compared with, as data, each entry with its reason. A comparison the table does not list is
  exact (``ngram_ids`` and ``gather_rows`` are always bit for bit).
- :func:`exact_mismatch` and :func:`close_mismatch` (within a tolerance; exact where it is):
  ``None`` when two tensors agree, else one line saying how many elements disagree and naming
  the first of them (what the bench's checks report); :func:`assert_exact` and
  :func:`assert_within` raise that line as an :class:`AssertionError` (what the tests call).
- :func:`snapshot` and :func:`assert_untouched`: that a call (one that raised, say) left the
  tensors it must not write bit for bit as they were.
- :func:`same_layout`: a copy that keeps a view's strides, on any device.

Nothing here needs more than torch: no pytest, no numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from qwen4exp_ext.reference import FP8_DTYPES
from qwen4exp_ext.reference_hc import HC_OPS

__all__ = [
    "EXACT",
    "HC_MIN_EQUAL_SHARE",
    "HC_OPS",
    "TOLERANCES",
    "Tolerance",
    "assert_exact",
    "assert_untouched",
    "assert_within",
    "bit_patterns",
    "close_mismatch",
    "exact_mismatch",
    "same_layout",
    "snapshot",
    "tolerance",
]


class Tolerance(NamedTuple):
    """Every element within ``atol + rtol·|expected|`` of ``expected``; (0, 0) is exact."""

    atol: float
    rtol: float

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0


EXACT = Tolerance(0.0, 0.0)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# One unit in the last place at the bottom of a binade (fp32: the 2e-5 relative that a different
# summation order stays within).
_ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2e-5}

# (op, rounding, dtype, against) -> Tolerance: ours in ``rounding`` (None for an op that has only
# one) and ``dtype``, compared with ``against``: "reference" (qwen4exp_ext.reference in the same
# rounding), "vllm" (vLLM's own Triton kernel), or a bench baseline by its name.
TOLERANCES: dict[tuple[str, str | None, torch.dtype, str], Tolerance] = {
    # ple_gate, "vllm" rounding: against the reference (which sums in PyTorch's order, not
    # numpy's) every element within two units in the last place of its dtype (a sum next to a
    # rounding boundary flips g by one unit, and gated = round(g·value) adds the other), fp32
    # within 1e-5 relative. The GPU kernels sum in a tree, and are held to the same against
    # vLLM's kernel; transformers rounds to bf16 where vLLM's graph does, and is held to the same.
    **{
        ("ple_gate", "vllm", dt, against): Tolerance(
            1e-5, 1e-5 if dt == torch.float32 else 2 * _ULP[dt]
        )
        for dt in _FLOATS
        for against in ("reference", "vllm", "transformers")
    },
    # ple_gate, "vllm" rounding, where ours sums in vLLM's order (the CPU kernel: the same rounding
    # points, the same numpy-pairwise reduction order) against vLLM's kernel: fp16 bit for bit;
    # fp32 within 1e-6 (exp and FMA details differ in the last fp32 bit).
    ("ple_gate", "vllm", torch.float16, "vllm_same_order"): EXACT,
    ("ple_gate", "vllm", torch.float32, "vllm_same_order"): Tolerance(1e-6, 1e-6),
    # ple_gate, "fp32" rounding (the fast single pass): every element within one unit in the last
    # place of the output dtype of the exactly computed (fp64) result (fp32: 2e-5 relative), and
    # so of the reference in this rounding; in bf16/fp16 also never further from the fp64 result
    # than 2x the "vllm"-rounded result is (flash-attention's rule; tests/ple_gate/). One
    # caveat, by analysis, not by test: where d is within fp32 rounding of 0, sign(d) can differ,
    # and g differs by up to sqrt(1e-6)/4 = 2.5e-4 absolute.
    **{("ple_gate", "fp32", dt, "reference"): Tolerance(1e-5, _ULP[dt]) for dt in _FLOATS},
    # ple_gate, the fast pass against transformers' bf16 graph, which rounds the products, the dot
    # and the gate logit d to bf16: a = sign(d)·sqrt(|d|) is steep at 0, so a rounding error δ of d
    # can move a by up to sqrt(2δ) (d = ∓δ/2 flips sign), and g = sigmoid(a) by a quarter of that.
    # For the few gates with d near 0 (δ ~ 0.01 at the bench's inputs), gated moves by up to ~8%,
    # hence the 2^-3 bound. The "vllm" rounding, which rounds where transformers does, is held to
    # two units against it and shows the baseline computes the same gate.
    ("ple_gate", "fp32", torch.bfloat16, "transformers"): Tolerance(1e-5, 2.0**-3),
    # ple_conv against the reference and vLLM's kernels: bf16 and fp16 exactly (the conv sum runs
    # in the same order, and SiLU of the rounded 16-bit sum comes from an exactly rounded table);
    # fp32 within 1e-6 (the exp differs in the last bit).
    **{
        ("ple_conv", None, dt, against): Tolerance(1e-6, 1e-6) if dt == torch.float32 else EXACT
        for dt in _FLOATS
        for against in ("reference", "vllm")
    },
    # ple_conv's residual against eager F.conv1d (the bench's baselines "conv1d" and
    # "conv1d_fp32"; the state they write must be equal): conv1d sums the same four bf16 products
    # in fp32 as ours, but in its own order, so y may be one bf16 unit off (|y| < 8 at the bench's
    # inputs: a unit is at most 2^-5), which can carry through the two rounded adds of the fused
    # residual and flip their rounding (a unit of the result: 2^-7 relative).
    **{
        ("ple_conv", None, torch.bfloat16, against): Tolerance(2.0**-5, 2.0**-7)
        for against in ("conv1d", "conv1d_fp32")
    },
}


# The hyper-connection ops (SPEC §10), each output, as the same rounding points give them.
# Against vLLM's Triton kernels (Triton's CPU interpreter) and against the oracle: bf16 and fp16
# within one unit in the last place (the exp of numpy, torch and a kernel differ by up to two fp32
# units, and a sum of squares in another order by a few, which can flip the one rounding of a
# stored value; measured fp16 against vLLM on odd shapes, HC = 1..8, H up to 2560: 99.8% of
# hc_gate_mix's and >= 99.95% of the other outputs bit-equal, hc_silu all, never more than one
# unit apart). The atol covers fp16's subnormal range, whose unit is 2^-24. fp32 within 4e-6
# absolute + 2e-6 relative: measured at most 1.9e-6 apart (two units at |x| < 16): the Gemma affine
# y + y·w cancels where w is near -1, which turns a unit of y into a large relative difference,
# and the combine cancels where residual and injected block output nearly do; bf16 is compared
# with the oracle only under the interpreter (which mis-rounds it, triton#8322), with vLLM's
# kernels on a GPU (the bench's check), where the same one unit holds.
_HC_ONE_UNIT = {
    torch.bfloat16: Tolerance(1e-6, 2.0**-7),
    torch.float16: Tolerance(1e-6, 2.0**-10),
    torch.float32: Tolerance(4e-6, 2e-6),
}
TOLERANCES.update(
    {
        (op, None, dt, against): _HC_ONE_UNIT[dt]
        for op in HC_OPS
        for dt in _FLOATS
        for against in ("reference", "vllm")
    }
)
# The fused decode projections (ops.hc_up_gate_mix, hc_down_silu_inject) against the unfused
# path (reference_hc: torch's F.linear, then the element-wise op): the same rounding points, the
# dots summed in another order (the CPU's fp32 FMAs or AVX512-BF16 dots, cpu_tuning.cpu_hc_dot;
# the HIP kernels' lane-strided sums). bf16 and fp16 within one unit in the last place (a dot one
# fp32 unit apart can flip its rounding, and with it a gate or a low-rank value); measured on the
# CPU at the released shape (T = 16, H = 2560, HC = 4, R = 320): bf16 100% of the block input and
# 99.96-99.98% of the low-rank values bit-equal (both dot paths), fp16 99.99% and 99.5%, never
# more than one unit apart. fp32: the dots differ by a few units of their terms' sum (measured at
# most 3.8e-6 absolute at K = 10240, |dot| < 4); the tests' dots are far shorter.
_HC_FUSED = {**_HC_ONE_UNIT, torch.float32: Tolerance(2e-5, 1e-5)}
TOLERANCES.update(
    {
        (op, None, dt, "reference"): _HC_FUSED[dt]
        for op in ("hc_up_gate_mix", "hc_down_silu_inject")
        for dt in _FLOATS
    }
)
# A whole GatedResidual module ("hc_module": vLLM's AMD module on the five ops, mix and the
# delayed combine_and_mix; our layers.GatedResidual; the bench's hc_module) against seed 004's
# pure-PyTorch module ("seed") and transformers' Qwen4ExpTextGatedResidual with its decoder's
# combine ("transformers"), and one op against transformers' eager lines for it (the bench's
# headline baseline). fp32 within 1e-5 (measured 1e-6: GEMM blocking and the Gemma affine's
# form). bf16: transformers and seed 004 round the gate, the gated products, the injection
# weight and block·injection to bf16 where vLLM's kernels keep fp32, and mean the streams in
# bf16: they differ by up to one unit of the largest term where terms cancel, a unit being 2^-4
# for terms up to 16 (measured 2^-5 with the tests' |x| < 8, 2^-4 at the bench's inputs, whose
# injected block output reaches 12), hence atol 2^-4 and two units (2^-6) relative.
_HC_EAGER = {torch.float32: Tolerance(1e-5, 1e-5), torch.bfloat16: Tolerance(2.0**-4, 2.0**-6)}
TOLERANCES.update(
    {
        ("hc_module", None, dt, against): tol
        for dt, tol in _HC_EAGER.items()
        for against in ("seed", "transformers")
    }
)
TOLERANCES.update(
    {(op, None, torch.bfloat16, "transformers"): _HC_EAGER[torch.bfloat16] for op in HC_OPS}
)
# A module on our kernels against the same module on the oracle's ops or vLLM's kernels
# (identical rounding points, its GEMMs in another blocking, or two GEMMs for vLLM's merged
# down+inject one): measured bit for bit on the CPU; a GEMM result one unit apart moves a gate
# or a low-rank value by one bf16 unit and the block input by less, so within two units (2^-6
# relative) and 2^-8 absolute in bf16, fp32 as the module against seed 004.
TOLERANCES.update(
    {
        ("hc_module", None, dt, against): (
            Tolerance(2.0**-8, 2.0**-6) if dt == torch.bfloat16 else Tolerance(1e-5, 1e-5)
        )
        for dt in _FLOATS
        for against in ("reference", "vllm")
    }
)
# The least share of bit-equal elements against vLLM's kernels (interpreter) in fp16: what was
# measured (above), less a margin for other shapes and seeds.
HC_MIN_EQUAL_SHARE = 0.99


def tolerance(
    op: str, dtype: torch.dtype, *, rounding: str | None = None, against: str = "reference"
) -> Tolerance:
    """The :data:`TOLERANCES` entry of ``op`` in ``rounding`` and ``dtype`` against ``against``
    (a KeyError where the table has none: such a comparison is exact, see the module docstring)."""
    return TOLERANCES[(op, rounding, dtype, against)]


# --- comparing two tensors -------------------------------------------------------------------

_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bit_patterns(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements as integers of their width, so that -0 and +0 differ and every rounding
    decision and NaN payload counts (integers as they are, up to signedness)."""
    return x.view(_INT_OF_SIZE[x.element_size()])


def _same_device(got: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Tensors on two devices (ours on a GPU, the reference's on the CPU) compare on the CPU.
    if got.device == expected.device:
        return got, expected
    return got.cpu(), expected.cpu()


def _values(x: torch.Tensor) -> torch.Tensor:
    # fp8 has no torch.equal on the CPU; its float32 values are exact.
    return x.float() if x.dtype in FP8_DTYPES else x


def exact_mismatch(
    got: torch.Tensor,
    expected: torch.Tensor,
    what: str = "",
    *,
    against: str = "expected",
    bitwise: bool = False,
    equal_nan: bool = False,
) -> str | None:
    """None if ``got`` (ours) equals ``expected`` (``against``'s) in dtype, shape and every
    element, else why not (tensors on two devices compare on the CPU). Elements compare as
    values (-0 equals +0, as in ``torch.equal``), or with ``bitwise`` as bit patterns; NaN
    never equals NaN unless ``equal_nan``."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return _describe_layout(what, got, expected, against)
    got, expected = _same_device(got, expected)
    if bitwise:
        a, b = bit_patterns(got), bit_patterns(expected)
    else:
        a, b = _values(got), _values(expected)
    if torch.equal(a, b):
        return None
    bad = a != b
    if equal_nan and got.is_floating_point():
        bad &= ~(_values(got).isnan() & _values(expected).isnan())
    if not bool(bad.any()):
        return None
    return _describe(what, got, expected, bad, against, "differ from")


def close_mismatch(
    got: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    what: str = "",
    *,
    against: str = "expected",
    bitwise: bool = False,
    equal_nan: bool = False,
) -> str | None:
    """None if ``got`` and ``expected`` have one dtype and shape and every element of ``got`` is
    within ``tol.atol + tol.rtol·|expected|`` of ``expected``, computed in their dtype or, below
    fp32, in fp32 (as ``torch.testing.assert_close`` does from fp32 up), and NaN is never close.
    Where ``tol`` is exact, :func:`exact_mismatch` (with ``bitwise`` and ``equal_nan``)."""
    if tol.exact:
        return exact_mismatch(
            got, expected, what, against=against, bitwise=bitwise, equal_nan=equal_nan
        )
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return _describe_layout(what, got, expected, against)
    got, expected = _same_device(got, expected)
    dtype = torch.promote_types(got.dtype, torch.float32)
    bad = ~torch.isclose(got.to(dtype), expected.to(dtype), atol=tol.atol, rtol=tol.rtol)
    if not bool(bad.any()):
        return None
    how = f"are beyond atol={tol.atol:g}, rtol={tol.rtol:g} of"
    return _describe(what, got, expected, bad, against, how)


def assert_exact(
    got: torch.Tensor,
    expected: torch.Tensor,
    what: str = "",
    *,
    bitwise: bool = False,
    equal_nan: bool = False,
) -> None:
    """Raises AssertionError with :func:`exact_mismatch`'s line unless the two are equal."""
    problem = exact_mismatch(got, expected, what, bitwise=bitwise, equal_nan=equal_nan)
    if problem is not None:
        raise AssertionError(problem)


def assert_within(
    got: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    what: str = "",
    *,
    bitwise: bool = False,
) -> None:
    """Raises AssertionError with :func:`close_mismatch`'s line unless ``got`` is within ``tol``
    of ``expected`` (where ``tol`` is exact: equal, bit for bit with ``bitwise``)."""
    problem = close_mismatch(got, expected, tol, what, bitwise=bitwise)
    if problem is not None:
        raise AssertionError(problem)


def _describe_layout(what: str, got: torch.Tensor, expected: torch.Tensor, against: str) -> str:
    return (
        f"{_prefix(what)}ours is {got.dtype}{list(got.shape)}, {against} is "
        f"{expected.dtype}{list(expected.shape)}"
    )


def _describe(
    what: str, got: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, against: str, how: str
) -> str:
    first = tuple(bad.nonzero()[0].tolist())
    return (
        f"{_prefix(what)}{int(bad.sum())} of {got.numel()} elements {how} {against}; first at "
        f"{first}: ours {got[first].item()}, {against} {expected[first].item()}"
    )


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""


# --- tensors a call must leave as they were --------------------------------------------------


def same_layout(t: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (default: its own) with ``t``'s shape and strides.

    ``t.to(device)`` and ``t.clone()`` give a column slice or a stride-2 view contiguous storage
    (only dense layouts keep their strides), so a strided input built on the CPU and moved would
    reach a GPU kernel contiguous. Not for overlapping views (stride 0)."""
    target = t.device if device is None else device
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target).copy_(t)


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of each tensor, by name, for :func:`assert_untouched` (meta tensors, which hold
    no data, are left out)."""
    return {name: t.detach().clone() for name, t in tensors.items() if t.device.type != "meta"}


def assert_untouched(
    before: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Every tensor of the :func:`snapshot` ``before`` still has, by name in ``tensors``, the
    same dtype, shape and bytes (and is not a meta tensor now)."""
    for name, old in before.items():
        new = tensors[name].detach()
        if new.device.type == "meta":
            raise AssertionError(f"{name} is a meta tensor now")
        problem = exact_mismatch(new, old, f"{name} was written", against="before", bitwise=True)
        if problem is not None:
            raise AssertionError(problem)
