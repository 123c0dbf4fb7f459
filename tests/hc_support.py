"""Shared by the hyper-connection ops' tests (SPEC §10: ``hc_combine_norm``,
``grouped_gemma_rmsnorm``, ``hc_silu``, ``hc_gate_mix``, ``hc_combine``): batch builders and
vLLM's own Triton kernels run by Triton's CPU interpreter.

- :func:`hc_batch` builds one seeded batch: odd T and H, any hc_count, every dtype, and (by
  default) every activation a strided view as vLLM passes them: the residual and the gate are
  column slices of wider buffers, the low-rank input and the injection logits are column slices
  of one down-GEMM output ``[T, r + M + pad]`` (vLLM's merged down+inject projection, padded to a
  multiple of 16 columns), so the injection logits' row stride is that GEMM's width.
- :data:`OP_ARGS` names each op's arguments in a batch, in the doors' order; :func:`op_args`
  returns them.
- :func:`run_vllm` runs vLLM's kernel of an op on those arguments under the interpreter
  (``vllm_kernels()`` is None where vLLM or Triton is missing: skip with :func:`need_vllm`).
  Triton's interpreter mis-rounds bf16 (triton#8322), so it refuses bf16: compare bf16 with
  the oracle only.
- :func:`parity` measures two results: the share of bit-equal elements and the largest
  difference (what the parity tests state and assert).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch

from qwen4exp_ext import reference as ref
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.testing import HC_OPS, bit_patterns, same_layout

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# vLLM's kernels take any stream count (padded to a power of two and masked); the model has 4.
HC_COUNTS = (4, 1, 2, 3, 8)
EPS = 1e-6

# Each op's arguments, by their names in HcBatch, in the doors' order.
OP_ARGS: dict[str, tuple[str, ...]] = {
    "hc_combine_norm": (
        "residual",
        "block_output",
        "injection_logits",
        "norm_weight",
        "eps",
        "hc_count",
    ),
    "grouped_gemma_rmsnorm": ("residual", "norm_weight", "eps", "hc_count"),
    "hc_silu": ("lowrank", "hc_count"),
    "hc_gate_mix": ("xn", "gate", "hc_count"),
    "hc_combine": ("residual", "block_output", "injection_logits", "hc_count"),
}

# vLLM's launchers in amd/ops/hc.py (nvidia/ops/hc.py: the same without the underscore).
_VLLM_LAUNCHERS = {op: f"_{op}" for op in HC_OPS}


@dataclass
class HcBatch:
    """One batch of every op's inputs (T tokens, M = hc_count streams of width H)."""

    residual: torch.Tensor  # [T, M·H], the multi-stream state
    block_output: torch.Tensor  # [T, H]
    down: torch.Tensor  # [T, r + M + pad]: the merged down+inject GEMM output
    lowrank: torch.Tensor  # [T, r] = down[:, :r]
    injection_logits: torch.Tensor  # [T, M] = down[:, r:r+M]
    xn: torch.Tensor  # [T, M·H]: normalised streams (gate_mix's x)
    gate: torch.Tensor  # [T, M·H]: the up-GEMM's gate logits
    norm_weight: torch.Tensor  # [M·H] per branch, or [H] shared
    eps: float
    hc_count: int

    @property
    def num_tokens(self) -> int:
        return self.residual.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.block_output.shape[1]


def _view(full: torch.Tensor, width: int, offset: int) -> torch.Tensor:
    """Columns [offset, offset + width) of ``full``: a row-major view with a wider row stride."""
    return full[:, offset : offset + width]


def hc_batch(
    num_tokens: int,
    hidden_size: int,
    hc_count: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    *,
    seed: int = 0,
    lowrank: int = 7,
    strided: bool = True,
    per_branch: bool = True,
    weight_dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> HcBatch:
    """A seeded batch with vLLM-like magnitudes: residual streams of spread scales (a real
    residual grows along the layers), injection and gate logits of a few units (sigmoid's
    steep and flat parts both), and a Gemma norm weight around 0 (the affine is 1 + w).
    ``strided=False`` gives contiguous tensors; ``per_branch=False`` a shared [H] norm weight."""
    gen = torch.Generator().manual_seed(seed)
    streams = hc_count * hidden_size
    pad = 5 if strided else 0
    down_width = lowrank + hc_count
    if strided:
        down_width += (-down_width) % 16 or 16  # vLLM pads the merged GEMM to 16 columns

    def randn(rows: int, cols: int, scale: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * scale).to(dtype)

    scales = torch.logspace(-1, 1, streams)[torch.randperm(streams, generator=gen)]
    residual_full = randn(num_tokens, streams + pad, 1.0)
    residual_full[:, :streams] = (residual_full[:, :streams].float() * scales).to(dtype)
    down = randn(num_tokens, down_width, 3.0)
    weight_len = streams if per_branch else hidden_size
    norm_weight = (torch.randn(weight_len, generator=gen) * 0.3).to(weight_dtype or dtype)
    batch = HcBatch(
        residual=_view(residual_full, streams, 0),
        block_output=_view(randn(num_tokens, hidden_size + pad, 1.0), hidden_size, 0),
        down=down,
        lowrank=_view(down, lowrank, 0),
        injection_logits=_view(down, hc_count, lowrank),
        xn=_view(randn(num_tokens, streams + pad, 1.0), streams, pad),
        gate=_view(randn(num_tokens, streams + 2 * pad, 3.0), streams, pad),
        norm_weight=norm_weight,
        eps=EPS,
        hc_count=hc_count,
    )
    if torch.device(device).type != "cpu":
        # same_layout keeps each view's strides; the two slices of the down-GEMM output are
        # sliced again from its copy, as vLLM's are from one tensor.
        batch.down = batch.down.to(device)
        batch.lowrank = _view(batch.down, lowrank, 0)
        batch.injection_logits = _view(batch.down, hc_count, lowrank)
        for name in ("residual", "block_output", "xn", "gate", "norm_weight"):
            setattr(batch, name, same_layout(getattr(batch, name), device))
    return batch


def op_args(op: str, batch: HcBatch) -> tuple[Any, ...]:
    """``op``'s arguments from ``batch``, in the doors' (vLLM's) order."""
    return tuple(getattr(batch, name) for name in OP_ARGS[op])


def oracle(op: str, batch: HcBatch) -> Any:
    """The oracle's result of ``op`` on ``batch``."""
    return getattr(ref, op)(*op_args(op, batch))


def vllm_kernels(vendor: str = "amd"):
    """vLLM's HC kernels module, defined under the interpreter; None without vLLM or Triton."""
    return vllm_triton.load_hc(interpret=True, vendor=vendor)


def need_vllm(vendor: str = "amd"):
    """vLLM's HC kernels under the interpreter, or skip the test."""
    kernels = vllm_kernels(vendor)
    if kernels is None:
        pytest.skip("vLLM's hyper-connection kernels or Triton are not installed")
    return kernels


def run_vllm(op: str, *args: Any, vendor: str = "amd") -> Any:
    """vLLM's Triton kernel of ``op`` on ``args`` (the doors' order), on Triton's CPU
    interpreter. CPU tensors; fp32 or fp16 (the interpreter mis-rounds bf16: triton#8322)."""
    kernels = need_vllm(vendor)
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dtype == torch.bfloat16 and arg.dim() == 2:
            raise ValueError(
                f"{op}: Triton's interpreter mis-rounds bf16 (triton#8322); compare bf16 "
                "activations with the oracle only"
            )
    name = _VLLM_LAUNCHERS[op] if vendor == "amd" else op
    with vllm_triton.interpreter():
        return getattr(kernels, name)(*args)


class Parity(NamedTuple):
    """How two results compare: the share of bit-equal elements and the largest difference."""

    equal_share: float
    max_abs_diff: float
    count: int

    def __str__(self) -> str:
        return (
            f"{self.equal_share:.4%} of {self.count} bit-equal, largest difference "
            f"{self.max_abs_diff:.3g}"
        )


def parity(got: torch.Tensor, expected: torch.Tensor) -> Parity:
    """Bit-equal share (NaN equal to NaN of the same bits) and largest |got − expected|."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise ValueError(
            f"got {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
        )
    got, expected = got.cpu(), expected.cpu()
    if got.numel() == 0:
        return Parity(1.0, 0.0, 0)
    same = bit_patterns(got.contiguous()) == bit_patterns(expected.contiguous())
    diff = (got.double() - expected.double()).abs().max().item()
    return Parity(same.double().mean().item(), diff, got.numel())


def as_tuple(result: Any) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple (hc_combine_norm returns two tensors, the others one)."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


# --- a whole GatedResidual module on the five ops, as vLLM's AMD module runs them -------------
@dataclass
class HcWeights:
    """One GatedResidual's weights (transformers' names): W_down [r, M·H], W_up [M·H, r], W_inj
    [M, M·H] (None: a final mixer, ``use_combine=False``), the norm weight [M·H] or [H]."""

    norm: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    inject: torch.Tensor | None

    @classmethod
    def of(cls, module: torch.nn.Module) -> HcWeights:
        """From a transformers ``Qwen4ExpTextGatedResidual`` (or our layer: the same names)."""
        inject = getattr(module, "block_inject_weight", None)
        return cls(
            norm=module.hc_norm.weight.detach(),
            down=module.input_mix_weight_down.weight.detach(),
            up=module.input_mix_weight_up.weight.detach(),
            inject=None if inject is None else inject.weight.detach(),
        )

    def merged_down(self, dtype: torch.dtype) -> torch.Tensor:
        """vLLM's merged down+inject projection [r + M + pad, M·H], padded to 16 rows."""
        parts = [self.down] + ([] if self.inject is None else [self.inject])
        rows = sum(p.shape[0] for p in parts)
        pad = (-rows) % 16 if self.inject is not None else 0
        parts.append(torch.zeros(pad, self.down.shape[1], dtype=self.down.dtype))
        return torch.cat(parts).to(dtype)


def vllm_mix_tail(ops, xn: torch.Tensor, weights: HcWeights, hc_count: int):
    """From xn on (vLLM's AMD GatedResidual.mix / combine_and_mix): the merged down GEMM (in
    the activations' dtype), hc_silu, the up GEMM, hc_gate_mix. Returns (block_input,
    injection_logits or None); the logits are a strided view of the GEMM's output."""
    lowrank_width = weights.down.shape[0]
    down = torch.nn.functional.linear(xn, weights.merged_down(xn.dtype))
    lowrank = down[:, :lowrank_width]
    injection = None
    if weights.inject is not None:
        injection = down[:, lowrank_width : lowrank_width + hc_count]
    gate = torch.nn.functional.linear(ops.hc_silu(lowrank, hc_count), weights.up.to(xn.dtype))
    return ops.hc_gate_mix(xn, gate, hc_count), injection


def vllm_mix(ops, hidden: torch.Tensor, weights: HcWeights, hc_count: int, eps: float):
    """vLLM's AMD ``GatedResidual.mix`` on ``ops``' five ops: (block_input, injection_logits)."""
    xn = ops.grouped_gemma_rmsnorm(hidden, weights.norm, eps, hc_count)
    return vllm_mix_tail(ops, xn, weights, hc_count)


def vllm_combine_and_mix(
    ops,
    hidden: torch.Tensor,
    block_output: torch.Tensor,
    injection: torch.Tensor | None,
    weights: HcWeights,
    hc_count: int,
    eps: float,
):
    """vLLM's AMD ``GatedResidual.combine_and_mix``: the pending combine of the previous
    module fused with this one's norm. Returns (hidden, block_input, injection_logits)."""
    hidden, xn = ops.hc_combine_norm(hidden, block_output, injection, weights.norm, eps, hc_count)
    return (hidden, *vllm_mix_tail(ops, xn, weights, hc_count))
