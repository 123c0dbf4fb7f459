"""The hyper-connection ops' cases (SPEC §10): ``hc_combine_norm``, ``grouped_gemma_rmsnorm``,
``hc_silu``, ``hc_gate_mix`` and ``hc_combine`` at the released shape (H = 2560, M = 4 streams,
C = 10240, the low rank r = 320, bf16) over decode batches (T = 16 and 64) and a T = 8192
prefill. One module benches the five ops: ``registry.OP_MODULES`` names it for each, and
``op_cases(op, device)`` builds that op's cases.

Baselines: "transformers" (the headline), the eager PyTorch of transformers 5.18's Qwen4Exp for
the same step: its ``Qwen4ExpTextRMSNorm(C, group_size=H)`` module for the norms, and its
decoder layer's and ``Qwen4ExpTextGatedResidual``'s lines for the rest (the injection weight
2·sigmoid(logits / M) and ``hyper_input + (block ⊗ weight)``, silu(x / M), the gated mean
``(sigmoid(gate) · xn).mean`` over the streams), in bf16 as transformers runs them. On a GPU
with vLLM's source here, every case also times vLLM 0.33.0's own Triton kernel (baseline
"vllm", for ``speedup_vs_vllm``: the NVIDIA module's launcher on CUDA, the AMD one on ROCm).
The oracle is ``reference.<op>``.

Inputs are the views vLLM passes: the injection logits and the low-rank input are column slices of
one merged down+inject GEMM output [T, r + M + pad] (336 columns), the rest contiguous. Ours
writes into preallocated outputs (``out=``), the baselines and the oracle allocate as eager
PyTorch does. The check holds ours to the oracle and to vLLM's kernel within one bf16 unit, and
to transformers within the module tolerance (qwen4exp_ext.testing.TOLERANCES, with the reasons):
transformers rounds the injection weight, the gates and the products to bf16 where vLLM's
kernels keep fp32.

Bytes: every input read once (the slices of the GEMM output: their own columns), every output
written once, the norm weight once; the JSON's ``bytes_per_token`` is that over T.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from qwen4exp_ext import _switches, ops, reference
from qwen4exp_ext.bench.registry import (
    VLLM_CPU_NOTE,
    VLLM_INTERPRET_ENV,
    VLLM_MISSING_NOTE,
    Case,
)
from qwen4exp_ext.testing import HC_OPS, close_mismatch, tolerance

# Released config (SPEC §1; vLLM's GEMM tuning tables: the merged down+inject GEMM is
# [336, C], the up GEMM [C, 320]).
WIDTH = 2560  # H
STREAMS = 4  # M
LOWRANK = 320  # r
EPS = 1e-6
DTYPE = torch.bfloat16
DECODE_TOKENS = (16, 64)
PREFILL_TOKENS = 8192
INPUT_SEED = 0


def _down_width() -> int:
    """The merged down+inject GEMM's output width: r + M, padded to 16 columns (336)."""
    return LOWRANK + STREAMS + (-(LOWRANK + STREAMS)) % 16


def op_cases(op: str, device: torch.device) -> list[Case]:
    """The cases of ``op`` (one of HC_OPS) on ``device``."""
    if op not in HC_OPS:
        raise ValueError(f"op must be one of {HC_OPS}, got {op!r}")
    shapes = [(f"decode_T{t}", t) for t in DECODE_TOKENS]
    shapes += [(f"prefill_T{PREFILL_TOKENS}", PREFILL_TOKENS)]
    vllm_op, note, interpreted = _vllm_launcher(op, device)
    return [_case(op, name, t, device, vllm_op, note, interpreted) for name, t in shapes]


def _vllm_launcher(op: str, device: torch.device) -> tuple[Callable | None, str | None, bool]:
    """vLLM's launcher of ``op`` for ``device`` (None, with the note on why not), and whether it
    runs on Triton's interpreter (tests only, $QWEN4EXP_BENCH_VLLM_INTERPRET=1)."""
    from qwen4exp_ext.bench import vllm_triton

    interpreted = device.type != "cuda" and _switches.env_flag(VLLM_INTERPRET_ENV, False)
    if device.type != "cuda" and not interpreted:
        return None, VLLM_CPU_NOTE, False
    # vLLM's NVIDIA model runs nvidia/ops/hc.py (launchers named as the op); its AMD model the
    # same kernels from amd/ops/hc.py (launchers with a leading underscore).
    vendor = "amd" if torch.version.hip is not None else "nvidia"
    module = vllm_triton.load_hc(interpret=interpreted, vendor=vendor)
    if module is None:
        return None, VLLM_MISSING_NOTE, interpreted
    launcher = getattr(module, f"_{op}" if vendor == "amd" else op)
    if not interpreted:
        return launcher, None, False

    def run(*args: Any) -> Any:
        with vllm_triton.interpreter():
            return launcher(*args)

    return run, None, True


def _inputs(tokens: int, device: torch.device) -> dict[str, Any]:
    """Seeded bf16 inputs of every op, as vLLM lays them out (|values| < 16)."""
    gen = torch.Generator().manual_seed(INPUT_SEED)
    channels = STREAMS * WIDTH

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DTYPE).to(device)

    down = randn(tokens, _down_width(), scale=3.0)
    return {
        "residual": randn(tokens, channels, scale=2.0),
        "block_output": randn(tokens, WIDTH),
        "injection_logits": down[:, LOWRANK : LOWRANK + STREAMS],
        "lowrank": down[:, :LOWRANK],
        "xn": randn(tokens, channels),
        "gate": randn(tokens, channels, scale=3.0),
        "norm_weight": randn(channels, scale=0.3),
    }


def _arguments(op: str, x: Mapping[str, Any]) -> tuple[Any, ...]:
    """``op``'s arguments in the doors' (vLLM's) order."""
    r, b, inj, w = x["residual"], x["block_output"], x["injection_logits"], x["norm_weight"]
    return {
        "hc_combine_norm": (r, b, inj, w, EPS, STREAMS),
        "grouped_gemma_rmsnorm": (r, w, EPS, STREAMS),
        "hc_silu": (x["lowrank"], STREAMS),
        "hc_gate_mix": (x["xn"], x["gate"], STREAMS),
        "hc_combine": (r, b, inj, STREAMS),
    }[op]


def _outputs(op: str, x: Mapping[str, Any]) -> Any:
    """Preallocated outputs for ``out=``."""
    r = x["residual"]
    return {
        "hc_combine_norm": (torch.empty_like(r), torch.empty_like(r)),
        "grouped_gemma_rmsnorm": torch.empty_like(r),
        "hc_silu": torch.empty(r.shape[0], LOWRANK, dtype=DTYPE, device=r.device),
        "hc_gate_mix": torch.empty(r.shape[0], WIDTH, dtype=DTYPE, device=r.device),
        "hc_combine": torch.empty_like(r),
    }[op]


def _transformers(op: str, weight: torch.Tensor) -> Callable[..., Any]:
    """transformers' eager step of ``op``, taking the op's arguments (see the docstring)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    norm = Qwen4ExpTextRMSNorm(STREAMS * WIDTH, group_size=WIDTH, eps=EPS)
    norm = norm.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)

    def combine(hyper_input, block, logits):
        injection_weights = 2 * torch.sigmoid(logits / STREAMS)
        injection = block.unsqueeze(-2) * injection_weights.unsqueeze(-1)
        return hyper_input + injection.flatten(-2)

    def gate_mix(xn, gate):
        weights = torch.sigmoid(gate).unflatten(-1, (STREAMS, WIDTH))
        return (weights * xn.unflatten(-1, (STREAMS, WIDTH))).mean(dim=-2)

    steps: dict[str, Callable[..., Any]] = {
        "hc_combine_norm": lambda r, b, inj, w, eps, m: (lambda h: (h, norm(h)))(
            combine(r, b, inj)
        ),
        "grouped_gemma_rmsnorm": lambda x, w, eps, m: norm(x),
        "hc_silu": lambda x, m: F.silu(x / STREAMS),
        "hc_gate_mix": lambda xn, gate, m: gate_mix(xn, gate),
        "hc_combine": lambda r, b, inj, m: combine(r, b, inj),
    }
    return torch.no_grad()(steps[op])


def _nbytes(op: str, tokens: int) -> int:
    """Compulsory traffic in bytes: inputs read once, outputs written once, the weight once."""
    c, h, m, r = STREAMS * WIDTH, WIDTH, STREAMS, LOWRANK
    per_token = {
        "hc_combine_norm": c + h + m + 2 * c,
        "grouped_gemma_rmsnorm": 2 * c,
        "hc_silu": 2 * r,
        "hc_gate_mix": 2 * c + h,
        "hc_combine": c + h + m + c,
    }[op]
    weight = c if op in ("hc_combine_norm", "grouped_gemma_rmsnorm") else 0
    return torch.tensor([], dtype=DTYPE).element_size() * (tokens * per_token + weight)


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def _as_tuple(result: Any) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, tuple) else (result,)


def _case(
    op: str,
    name: str,
    tokens: int,
    device: torch.device,
    vllm_op: Callable | None,
    vllm_note: str | None,
    interpreted: bool,
) -> Case:
    x = _inputs(tokens, device)
    args = _arguments(op, x)
    out = _outputs(op, x)
    eager = _transformers(op, x["norm_weight"])

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours() -> torch.Tensor:
        return _first(getattr(ops, op)(*args, out=out))

    def oracle() -> torch.Tensor:
        return _first(getattr(reference, op)(*args))

    baselines = {"transformers": lambda: _first(eager(*args))}
    if vllm_op is not None:
        baselines["vllm"] = lambda: _first(vllm_op(*args))

    def check() -> str | None:
        got = [t.clone() for t in _as_tuple(getattr(ops, op)(*args, out=out))]
        others = [
            ("the oracle", tolerance(op, DTYPE), getattr(reference, op)(*args)),
            ("transformers", tolerance(op, DTYPE, against="transformers"), eager(*args)),
        ]
        # Triton's interpreter mis-rounds bf16 (triton#8322): there vLLM's kernel is timed by
        # the tests but not compared.
        if vllm_op is not None and not interpreted:
            others.append(("vllm", tolerance(op, DTYPE, against="vllm"), vllm_op(*args)))
        for who, tol, expected in others:
            for index, (g, e) in enumerate(zip(got, _as_tuple(expected), strict=True)):
                problem = close_mismatch(g, e, tol, f"{op}[{index}]", against=who)
                if problem is not None:
                    return problem
        return None

    nbytes = _nbytes(op, tokens)
    return Case(
        op=op,
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=ours,
        oracle=oracle,
        baselines=baselines,
        params={"T": tokens, "H": WIDTH, "M": STREAMS, "r": LOWRANK},
        check=check,
        derive=lambda _times: {"bytes_per_token": nbytes / tokens},
        vllm="vllm" if vllm_op is not None else None,
        vllm_note=None if vllm_op is not None else vllm_note,
    )
