"""How a case's check says that two contenders disagree: one line naming the first bad element."""

from __future__ import annotations

import torch


def exact_mismatch(
    what: str, got: torch.Tensor, expected: torch.Tensor, against: str
) -> str | None:
    """None if ``got`` (ours) equals ``expected`` (``against``'s) bit for bit, else why not."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (
            f"{what}: ours is {got.dtype}{list(got.shape)}, {against} is "
            f"{expected.dtype}{list(expected.shape)}"
        )
    if torch.equal(got, expected):
        return None
    bad = got != expected
    if got.is_floating_point():
        bad &= ~(got.isnan() & expected.isnan())
        if not bool(bad.any()):
            return None
    return _describe(what, got, expected, bad, against, "differ from")


def close_mismatch(
    what: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    against: str,
    *,
    atol: float,
    rtol: float,
) -> str | None:
    """None if every element of ``got`` is within ``atol + rtol·|expected|`` of ``expected``."""
    if got.shape != expected.shape:
        return f"{what}: ours is {list(got.shape)}, {against} is {list(expected.shape)}"
    bad = ~torch.isclose(got.float(), expected.float(), atol=atol, rtol=rtol)
    if not bool(bad.any()):
        return None
    return _describe(
        what, got, expected, bad, against, f"are beyond atol={atol:g}, rtol={rtol:g} of"
    )


def _describe(
    what: str, got: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, against: str, how: str
) -> str:
    first = tuple(bad.nonzero()[0].tolist())
    return (
        f"{what}: {int(bad.sum())} of {got.numel()} elements {how} {against}; first at {first}: "
        f"ours {got[first].item()}, {against} {expected[first].item()}"
    )
