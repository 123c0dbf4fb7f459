"""The five hyper-connection ops of vLLM's Qwen4Exp (``vllm/models/qwen4_exp/{amd,nvidia}/ops/
hc.py``) in plain PyTorch — SPEC §10, with vLLM's argument order and meaning and its rounding
points: every tensor an op writes is rounded once to the storage dtype (round to nearest, ties to
even); everything between is fp32.

``qwen4exp_ext.reference`` re-exports these names (``reference.hc_combine_norm`` ...): this is a
module of its own only because reference.py is near the project's 800-line limit.

fp32 is evaluated as vLLM's Triton kernels are on Triton's CPU interpreter, operation by
operation, so that a backend can reproduce it: products and sums are separately rounded (no FMA
contraction), sigmoid(v) = 1 / (1 + exp(−v)) (Triton's ``tl.sigmoid``), rsqrt(v) = 1 / sqrt(v)
(the interpreter's ``tl.rsqrt``, two correctly rounded operations). Sums of squares are the one
place where no order is prescribed: the oracle takes the exact sum of the fp32 squares, rounded
once to fp32, which every order approximates.
"""

from __future__ import annotations

import torch

__all__ = [
    "HC_DTYPES",
    "HC_OPS",
    "grouped_gemma_rmsnorm",
    "hc_average_combine",
    "hc_combine",
    "hc_combine_norm",
    "hc_down_silu_inject",
    "hc_gate_mix",
    "hc_silu",
    "hc_up_gate_mix",
]

# The five ops, by the names of their doors (ops.<name>), the oracle's and vLLM's.
HC_OPS: tuple[str, ...] = (
    "hc_combine_norm",
    "grouped_gemma_rmsnorm",
    "hc_silu",
    "hc_gate_mix",
    "hc_combine",
)
# The activation dtypes of the five ops (SPEC §10); norm weights may also be fp32.
HC_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


# --- argument checks (SPEC §1: name the argument, say what was expected) ---------------------
def _check_rows(name: str, x: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``x`` is a [T, W] row-major view (unit inner stride, any row stride) of an HC dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, width], got shape {tuple(x.shape)}")
    if x.dtype not in HC_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} must have the activations' dtype {dtype}, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must have unit inner stride, got strides {x.stride()}")


def _check_count(name: str, count: object, width: int, what: str) -> int:
    """``count`` is a positive int that divides ``width``."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{name} must be a positive int, got {count!r}")
    if width % count:
        raise ValueError(f"{name}={count} must divide {what}'s width {width}")
    return count


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps must be a float, got {eps!r}")
    eps32 = float(torch.tensor(float(eps), dtype=torch.float32))
    if not eps32 > 0 or eps32 == float("inf"):
        raise ValueError(f"eps must be > 0 and finite in fp32, got {eps!r}")
    return eps32


def _check_norm_weight(weight: torch.Tensor, dtype: torch.dtype, group: int, width: int) -> None:
    """The Gemma affine: [group] shared by every group, or [width] (one per element)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"norm weight must be a tensor, got {type(weight).__name__}")
    if weight.dtype not in (torch.float32, dtype):
        raise ValueError(f"norm weight must be float32 or {dtype}, got {weight.dtype}")
    if weight.numel() not in (group, width) or not weight.is_contiguous():
        raise ValueError(
            f"norm weight must be contiguous with {group} (shared) or {width} (per-branch) "
            f"elements, got shape {tuple(weight.shape)}"
        )


# --- the fp32 pieces, in vLLM's operation order ----------------------------------------------
def _sigmoid(v: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.sigmoid``: 1 / (1 + exp(−v)), each operation rounded in fp32."""
    return 1.0 / (1.0 + torch.exp(-v))


def _injection(logits: torch.Tensor, hc_count: int) -> torch.Tensor:
    """2·sigmoid(logit / M) in fp32, [T, M]."""
    return 2.0 * _sigmoid(logits.to(torch.float32) / hc_count)


def _gemma_norm(v: torch.Tensor, weight: torch.Tensor, eps32: float) -> torch.Tensor:
    """Gemma RMSNorm of ``v`` [T, G, W] fp32 over its last dim, weight [W] or [G·W]:
    rrms = 1/sqrt(Σv²/W + ε); y = v·rrms; y += y·w. Returns fp32 [T, G, W]."""
    squares = v * v  # rounded fp32 products, as the kernels form them
    sumsq = squares.to(torch.float64).sum(dim=-1, keepdim=True).to(torch.float32)
    rrms = 1.0 / torch.sqrt(sumsq / v.shape[-1] + eps32)
    w = weight.to(torch.float32).reshape(-1, v.shape[-1])
    y = v * rrms
    return y + y * w


# --- the five ops ----------------------------------------------------------------------------
def grouped_gemma_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, num_groups: int
) -> torch.Tensor:
    """SPEC §10: x [T, D] (D = G·W) → each W-wide group Gemma-normalised, [T, D] in x's dtype.
    ``weight`` [W] (shared by the groups) or [D]."""
    _check_rows("x", x)
    num_tokens, width = x.shape
    groups = _check_count("num_groups", num_groups, width, "x")
    _check_norm_weight(weight, x.dtype, width // groups, width)
    eps32 = _check_eps(eps)
    v = x.to(torch.float32).reshape(num_tokens, groups, width // groups)
    return _gemma_norm(v, weight, eps32).reshape(num_tokens, width).to(x.dtype)


def hc_silu(x: torch.Tensor, hc_count: int) -> torch.Tensor:
    """SPEC §10: v = x / M in fp32, silu(v) = v·sigmoid(v); [T, r] in x's dtype."""
    _check_rows("x", x)
    if isinstance(hc_count, bool) or not isinstance(hc_count, int) or hc_count < 1:
        raise ValueError(f"hc_count must be a positive int, got {hc_count!r}")
    v = x.to(torch.float32) / hc_count
    return (v * _sigmoid(v)).to(x.dtype)


def hc_gate_mix(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    """SPEC §10: the block input, mean over streams of sigmoid(gate_m)·x_m: x (the normalised
    streams) and gate (logits) [T, M·H] → [T, H] in x's dtype. fp32 accumulation over streams
    0..M−1 in order, then one division by M."""
    _check_rows("x", x)
    _check_rows("gate", gate, x.dtype)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    streams = _check_count("hc_count", hc_count, x.shape[1], "x")
    width = x.shape[1] // streams
    xs = x.to(torch.float32).unflatten(1, (streams, width))
    gs = gate.to(torch.float32).unflatten(1, (streams, width))
    acc = torch.zeros(x.shape[0], width, dtype=torch.float32)
    for m in range(streams):
        acc = acc + _sigmoid(gs[:, m]) * xs[:, m]
    return (acc / streams).to(x.dtype)


def _combine_fp32(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None,
    hc_count: object,
) -> torch.Tensor:
    """Checks the combine's arguments; returns the unrounded fp32 combine [T, M, H]."""
    _check_rows("residual", residual)
    _check_rows("block_output", block_output, residual.dtype)
    num_tokens, hyper = residual.shape
    streams = _check_count("hc_count", hc_count, hyper, "residual")
    width = hyper // streams
    if block_output.shape != (num_tokens, width):
        raise ValueError(
            f"block_output must be [{num_tokens}, {width}] (T, residual width / hc_count), "
            f"got {tuple(block_output.shape)}"
        )
    block = block_output.to(torch.float32)[:, None, :]
    if injection_logits is not None:
        _check_rows("injection_logits", injection_logits, residual.dtype)
        if injection_logits.shape != (num_tokens, streams):
            raise ValueError(
                f"injection_logits must be [{num_tokens}, {streams}] (T, hc_count), got "
                f"{tuple(injection_logits.shape)}"
            )
        block = block * _injection(injection_logits, streams)[:, :, None]
    return residual.to(torch.float32).unflatten(1, (streams, width)) + block


_LEGACY = object()


def hc_combine(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None | object = _LEGACY,
    hc_count: int | None = None,
) -> torch.Tensor:
    """SPEC §10: out_m = residual_m + block_output · 2·sigmoid(logit_m / M), [T, M·H] in
    residual's dtype. ``injection_logits`` [T, M] is typically a strided column slice of the
    down-GEMM output; None (vLLM's NVIDIA module) gives every stream unit weight.

    The two-argument call ``hc_combine(block_output, residual)`` (this name's meaning before
    SPEC §10: HyperConnectionBase's combine, any leading dims) still works; new code calls
    :func:`hc_average_combine` for it."""
    if injection_logits is _LEGACY and hc_count is None:
        return hc_average_combine(residual, block_output)
    if injection_logits is _LEGACY:
        raise TypeError("hc_combine needs injection_logits (a tensor or None) with hc_count")
    out = _combine_fp32(residual, block_output, injection_logits, hc_count)
    return out.flatten(1).to(residual.dtype)


def hc_combine_norm(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    hc_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §10: the delayed combine fused with the next module's norm. Returns (h, xn), both
    [T, M·H] in residual's dtype: h = hc_combine(...) (rounded), xn = the grouped Gemma RMSNorm
    of the *rounded* h per stream (norm_weight [H] shared or [M·H] per branch)."""
    combined = _combine_fp32(residual, block_output, injection_logits, hc_count)
    num_tokens, streams, width = combined.shape
    _check_norm_weight(norm_weight, residual.dtype, width, streams * width)
    eps32 = _check_eps(eps)
    h = combined.to(residual.dtype)
    xn = _gemma_norm(h.to(torch.float32), norm_weight, eps32).to(residual.dtype)
    return h.flatten(1), xn.flatten(1)


def hc_average_combine(block_output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """HyperConnectionBase combine — SPEC §8: residual [..., M·H] plus block_output [..., H]
    added to every stream."""
    width = block_output.shape[-1]
    if residual.shape[-1] % width:
        raise ValueError(f"residual width {residual.shape[-1]} is not a multiple of {width}")
    streams = residual.unflatten(-1, (residual.shape[-1] // width, width))
    return (streams + block_output.unsqueeze(-2)).flatten(-2)


# --- the fused decode projections (issue #50 item 3; ops.hc_up_gate_mix, hc_down_silu_inject) --
# Their oracle is the unfused path they replace, vLLM's: the vendor GEMM (here torch's F.linear,
# which sums each dot in fp32 and rounds it once to the dtype), then the element-wise op above.
# A kernel sums its dots in its own order, so it matches within one unit in the last place
# (qwen4exp_ext.testing), not bit for bit.
def _check_weight(name: str, w: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    _check_rows(name, w, dtype)
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {tuple(w.shape)}")


def hc_up_gate_mix(
    lowrank: torch.Tensor, w_up: torch.Tensor, xn: torch.Tensor, hc_count: int
) -> torch.Tensor:
    """hc_gate_mix(xn, lowrank @ w_up^T, hc_count): lowrank [T, R], w_up [HC·H, R], xn [T, HC·H]
    -> [T, H]."""
    _check_rows("lowrank", lowrank)
    _check_rows("xn", xn, lowrank.dtype)
    _check_weight("w_up", w_up, lowrank.dtype, (xn.shape[1], lowrank.shape[1]))
    return hc_gate_mix(xn, torch.nn.functional.linear(lowrank, w_up), hc_count)


def hc_down_silu_inject(
    xn: torch.Tensor, w_down: torch.Tensor, w_inj: torch.Tensor | None, hc_count: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hc_silu(xn @ w_down^T, hc_count) [T, R], xn @ w_inj^T [T, HC] or None without w_inj)."""
    _check_rows("xn", xn)
    _check_count("hc_count", hc_count, xn.shape[1], "xn")
    _check_weight("w_down", w_down, xn.dtype, (w_down.shape[0], xn.shape[1]))
    lowrank = hc_silu(torch.nn.functional.linear(xn, w_down), hc_count)
    if w_inj is None:
        return lowrank, None
    _check_weight("w_inj", w_inj, xn.dtype, (hc_count, xn.shape[1]))
    return lowrank, torch.nn.functional.linear(xn, w_inj)
