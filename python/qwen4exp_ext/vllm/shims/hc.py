"""The shims of vLLM's hyper-connection ops (SPEC §10): ``hc_combine_norm``,
``grouped_gemma_rmsnorm``, ``hc_silu``, ``hc_gate_mix`` and ``hc_combine``, each running our
kernel or vLLM's, whichever :mod:`..choice` picked for the shape class.

vLLM has them twice, the same Triton kernels with the same arguments: its AMD module
(``amd/ops/hc.py``) registers its launchers ``_hc_combine_norm`` ... as
``torch.ops.vllm.qwen4_exp_*`` (the AMD ``GatedResidual`` calls those ops), and its NVIDIA module
(``nvidia/ops/hc.py``) has them as plain functions, ``hc_combine_norm`` ..., which its
``GatedResidual`` imports. One replacement per op serves both; its rows are in
:data:`HC_SWAPS`.

Where our door refuses a call that vLLM's kernel takes (activations of mixed dtypes, a norm
weight in a third dtype: SPEC §10 lists what the doors accept),
vLLM's kernel runs it, so that vLLM never breaks because of us: the door's own checks say so
(they run before anything is launched or written; the shims pass no ``out=``), so the rules are
not written twice. vLLM 0.34.0 only widened its kernels' program ids to int64: same rows.

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ... import ops
from .. import choice
from ..choice import OURS, token_bucket
from .base import DEVICE_TYPES

logger = logging.getLogger("vllm.qwen4exp_ext")

# vLLM's AMD HC kernels: registered as torch.ops.vllm.qwen4_exp_<op> by this module.
AMD_HC_MODULE = "vllm.models.qwen4_exp.amd.ops.hc"
# vLLM's NVIDIA HC kernels: plain functions, imported by nvidia/hyperconnection.py.
NVIDIA_HC_MODULE = "vllm.models.qwen4_exp.nvidia.ops.hc"

# What a door raises for arguments it does not serve (TORCH_CHECK: RuntimeError; Python-side
# checks: ValueError, TypeError).
_REFUSED = (RuntimeError, ValueError, TypeError)
_refusals_said: set[str] = set()


def _run(
    op: str,
    cls: tuple,
    device: torch.device,
    args: tuple,
    original: Callable[..., Any],
) -> Any:
    """One call of ``op``: vLLM's ``original`` on a device our build does not serve, else the
    chosen kernel (measured at the first call of the class on a GPU; ours on the CPU), and
    vLLM's where our door refuses the arguments. Nothing is written in place, so the timing
    runs on the live arguments."""
    door = getattr(ops, op)
    if device.type not in DEVICE_TYPES:
        return original(*args)
    which = choice.choose(op, cls, device)
    if which is None:
        which = choice.decide(
            op, cls, device, lambda: args, lambda a: door(*a), lambda a: original(*a)
        )
    if which != OURS:
        return original(*args)
    try:
        return door(*args)
    except _REFUSED as exc:
        if op not in _refusals_said:  # once per op: a refused class repeats every step
            _refusals_said.add(op)
            logger.info("qwen4exp_ext: ops.%s refuses a call (%s); vLLM's kernel runs it", op, exc)
        return original(*args)


def _weight_kind(weight: torch.Tensor, width: int) -> str:
    return "shared" if weight.numel() == width else "per-branch"


def _make_hc_combine_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def hc_combine_norm(
        residual: torch.Tensor,
        block_output: torch.Tensor,
        injection_logits: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        hc_count: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        args = (residual, block_output, injection_logits, norm_weight, eps, hc_count)
        cls = (
            residual.dtype,
            norm_weight.dtype,
            hc_count,
            block_output.shape[-1],
            _weight_kind(norm_weight, block_output.shape[-1]),
            "inj" if injection_logits is not None else "-",
            token_bucket(residual.shape[0]),
        )
        return _run("hc_combine_norm", cls, residual.device, args, original)

    return hc_combine_norm


def _make_hc_combine(original: Callable[..., Any]) -> Callable[..., Any]:
    def hc_combine(
        residual: torch.Tensor,
        block_output: torch.Tensor,
        injection_logits: torch.Tensor | None,
        hc_count: int,
    ) -> torch.Tensor:
        args = (residual, block_output, injection_logits, hc_count)
        cls = (
            residual.dtype,
            hc_count,
            block_output.shape[-1],
            "inj" if injection_logits is not None else "-",
            token_bucket(residual.shape[0]),
        )
        return _run("hc_combine", cls, residual.device, args, original)

    return hc_combine


def _make_grouped_gemma_rmsnorm(original: Callable[..., Any]) -> Callable[..., Any]:
    def grouped_gemma_rmsnorm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, num_groups: int
    ) -> torch.Tensor:
        args = (x, weight, eps, num_groups)
        width = x.shape[-1]
        cls = (
            x.dtype,
            weight.dtype,
            num_groups,
            width,
            _weight_kind(weight, width // max(num_groups, 1)),
            token_bucket(x.shape[0]),
        )
        return _run("grouped_gemma_rmsnorm", cls, x.device, args, original)

    return grouped_gemma_rmsnorm


def _make_hc_silu(original: Callable[..., Any]) -> Callable[..., Any]:
    def hc_silu(x: torch.Tensor, hc_count: int) -> torch.Tensor:
        cls = (x.dtype, hc_count, x.shape[-1], token_bucket(x.shape[0]))
        return _run("hc_silu", cls, x.device, (x, hc_count), original)

    return hc_silu


def _make_hc_gate_mix(original: Callable[..., Any]) -> Callable[..., Any]:
    def hc_gate_mix(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
        cls = (x.dtype, gate.dtype, hc_count, x.shape[-1], token_bucket(x.shape[0]))
        return _run("hc_gate_mix", cls, x.device, (x, gate, hc_count), original)

    return hc_gate_mix


# Each op: its vLLM signature (the AMD launcher's and the NVIDIA function's are the same, in
# 0.33.0 and 0.34.0) and the replacement's maker.
HC_OPS: dict[str, tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    "hc_combine_norm": (
        "(residual, block_output, injection_logits, norm_weight, eps, hc_count)",
        _make_hc_combine_norm,
    ),
    "grouped_gemma_rmsnorm": ("(x, weight, eps, num_groups)", _make_grouped_gemma_rmsnorm),
    "hc_silu": ("(x, hc_count)", _make_hc_silu),
    "hc_gate_mix": ("(x, gate, hc_count)", _make_hc_gate_mix),
    "hc_combine": ("(residual, block_output, injection_logits, hc_count)", _make_hc_combine),
}
