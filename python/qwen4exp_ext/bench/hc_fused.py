"""The fused decode projections' cases (issue #50 item 3): ``hc_up_gate_mix`` (the up GEMM with
hc_gate_mix as its epilogue) and ``hc_down_silu_inject`` (the down and inject GEMMs with hc_silu's
epilogue) at the released shape (H = 2560, M = 4 streams, C = 10240, r = 320, bf16), at decode
T = 1, 4 and 16, where the weights (6.5 MB each) are most of a module's bytes. One module benches
both ops: ``registry.OP_MODULES`` names it for each, ``op_cases(op, device)`` builds one op's
cases. Not in the bench's representative subset (registry.FULL_ONLY_OPS: decode rows only); run
them by name: ``qwen4exp-bench hc_up_gate_mix hc_down_silu_inject``.

Baseline "unfused" (the headline): what ``layers.GatedResidual`` runs without them and what
vLLM's path is shaped as: torch's ``F.linear`` (the vendor GEMM, writing the gate [T, C] or the
low-rank and logits), then our element-wise ``ops.hc_gate_mix`` / ``ops.hc_silu``. vLLM has no
fused counterpart. The oracle is ``reference_hc``'s (that unfused path on the oracle's ops); the
check holds ours and the baseline to it within the fused ops' tolerance
(qwen4exp_ext.testing.TOLERANCES, with the reasons).

Bytes (compulsory): the weights once, the activations read once and the outputs written once
(never the gate: the fused kernel does not write it, which is the point); at decode the weights
are > 99% of it, so % of copy is close to % of a copy of the weights' bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen4exp_ext import ops, reference_hc
from qwen4exp_ext.bench import hc
from qwen4exp_ext.bench.registry import Case
from qwen4exp_ext.testing import close_mismatch, tolerance

OPS = ("hc_up_gate_mix", "hc_down_silu_inject")
DECODE_TOKENS = (1, 4, 16)
INPUT_SEED = 2
VLLM_NOTE = "not timed: vLLM 0.33.0 has no fused counterpart (its path is the unfused baseline)"


def op_cases(op: str, device: torch.device) -> list[Case]:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return [_case(op, f"decode_T{t}", t, device) for t in DECODE_TOKENS]


def _case(op: str, name: str, tokens: int, device: torch.device) -> Case:
    gen = torch.Generator().manual_seed(INPUT_SEED)
    channels, rank, streams, width = hc.STREAMS * hc.WIDTH, hc.LOWRANK, hc.STREAMS, hc.WIDTH

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(hc.DTYPE).to(device)

    xn = randn(tokens, channels)
    if op == "hc_up_gate_mix":
        lowrank = randn(tokens, rank)
        w_up = randn(channels, rank, scale=2 * rank**-0.5)
        out = torch.empty(tokens, width, dtype=hc.DTYPE, device=device)
        mixed = torch.empty_like(out)
        args = (lowrank, w_up, xn, streams)

        def ours():
            return (ops.hc_up_gate_mix(*args, out=out),)

        def unfused():
            gate = F.linear(lowrank, w_up)
            return (ops.hc_gate_mix(xn, gate, streams, out=mixed),)

        weights, activations = channels * rank, tokens * (rank + channels + width)
    else:
        # vLLM's merged down+inject weight [r + M + pad, C]: ours takes its row views.
        merged = randn(hc._down_width(), channels, scale=channels**-0.5)
        w_down, w_inj = merged[:rank], merged[rank : rank + streams]
        outs = (
            torch.empty(tokens, rank, dtype=hc.DTYPE, device=device),
            torch.empty(tokens, streams, dtype=hc.DTYPE, device=device),
        )
        silu_out = torch.empty(tokens, rank, dtype=hc.DTYPE, device=device)
        args = (xn, w_down, w_inj, streams)

        def ours():
            return ops.hc_down_silu_inject(*args, out=outs)

        def unfused():
            down = F.linear(xn, merged)  # vLLM's one merged GEMM, its outputs column views
            lowrank = ops.hc_silu(down[:, :rank], streams, out=silu_out)
            return lowrank, down[:, rank : rank + streams]

        weights, activations = (rank + streams) * channels, tokens * (channels + rank + streams)

    def oracle():
        out = getattr(reference_hc, op)(*args)
        return out if isinstance(out, tuple) else (out,)

    def check() -> str | None:
        tol = tolerance(op, hc.DTYPE)
        expected = oracle()
        for who, got in (("ours", ours()), ("unfused", unfused())):
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                problem = close_mismatch(g, e, tol, f"{who} output {i}", against="the oracle")
                if problem is not None:
                    return problem
        return None

    nbytes = hc.DTYPE.itemsize * (weights + activations)
    return Case(
        op=op,
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=lambda: ours()[0],
        oracle=lambda: oracle()[0],
        baselines={"unfused": lambda: unfused()[0]},
        params={"T": tokens, "H": width, "M": streams, "r": rank},
        check=check,
        derive=lambda _times: {"bytes_per_token": nbytes / tokens},
        vllm_note=VLLM_NOTE,
    )
