"""``ple_gate`` cases: ``ple_gate`` at the released shape (H = 2560, M = 4 streams, C = 10240,
bf16) over decode batches (T = 1, 8, 64, 256), spec-decode batches (64 requests of q = 2 and 4
tokens) and a T = 8192 prefill, in both roundings ("vllm", the default, and the fast "fp32"
pass).

Baselines: "transformers" (the headline), transformers 5.18's own eager gate:
``Qwen4ExpTextPLELayer.forward`` of modeling_qwen4_exp.py from the key projection's output on,
with three of its ``Qwen4ExpTextRMSNorm(C, group_size=H)`` modules (``norm_key``,
``norm_query``, ``norm_conv``, in bf16, their weights the case's) and its gate math line for
line, applied to the bench's [T, M·H] inputs as a [T, C] batch (transformers' [B, L, C] with
the batch flattened: every op in it is per token). It returns (gated_value, gated_value_normed),
our (gated, conv_input). On a GPU with vLLM 0.33.0's source here, every case also times vLLM's
own Triton ``ple_gate`` (baseline "vllm", for ``speedup_vs_vllm``): vLLM has one rounding, its
own, so the fast-pass cases race ours in the fast pass against that same kernel. The oracle is
``reference.ple_gate`` in the case's rounding.

key and value are column slices of one [T, C+H] projection output, as the layer produces them; ours
writes into preallocated outputs (``out=``), the baselines and the oracle allocate as eager PyTorch
does. Ours is also timed without ``out=``, as users call it (the reference ``without_out``, racing
no one): each row adds ``without_out_vs_out``, its median over ours' (issue #51: within 1.15 at
prefill), the cost of the two outputs the op allocates and frees (csrc/torch/fresh_output.h).
The check runs every contender once from the same inputs and holds ours to the tolerance of
ple_gate against each (qwen4exp_ext.testing.TOLERANCES, with the reasons): against the oracle and
vLLM within two units in the last place of bf16 for the "vllm" rounding, one for the fast pass
against the oracle (in the fast-pass cases vLLM's kernel, which computes the other rounding, is held
to ours in the "vllm" rounding); against transformers, which rounds to bf16 where vLLM's graph does,
the same two units for the "vllm" rounding, and a wider bound for the fast pass, which keeps those
intermediates in fp32.

Bytes: key, hidden and value read once, the two outputs written once, the three weight rows.
"""

from __future__ import annotations

import math

import torch

from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench.registry import Case, vllm_kernels
from qwen4exp_ext.testing import close_mismatch, tolerance

# Released config, SPEC §1.
WIDTH = 2560  # H
STREAMS = 4  # M
CHANNELS = WIDTH * STREAMS  # C
EPS = 1e-6
DTYPE = torch.bfloat16
DECODE_TOKENS = (1, 8, 64, 256)
SPEC_REQUESTS = 64
SPEC_QUERY_LENS = (2, 4)
PREFILL_TOKENS = 8192
INPUT_SEED = 0


def cases(device: torch.device) -> list[Case]:
    shapes = [(f"decode_T{t}", t) for t in DECODE_TOKENS]
    shapes += [(f"spec_q{q}_R{SPEC_REQUESTS}", SPEC_REQUESTS * q) for q in SPEC_QUERY_LENS]
    shapes += [(f"prefill_T{PREFILL_TOKENS}", PREFILL_TOKENS)]
    vllm = vllm_kernels(device)
    vllm_gate = vllm.op("ple_gate")
    fields = vllm.case_fields("vllm" if vllm_gate is not None else None)
    out = []
    for name, tokens in shapes:
        for rounding in ("vllm", "fp32"):
            suffix = "" if rounding == "vllm" else "_fast"
            out.append(_case(name + suffix, tokens, rounding, device, vllm_gate, fields))
    return out


def _transformers_gate(weights: list[torch.Tensor]):
    """transformers' eager gate (Qwen4ExpTextPLELayer.forward, from key_proj's output to
    gated_value_normed) with the given norm weights: (key, value, hidden) -> (gated, conv_input)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    norms = []
    for weight in weights:
        norm = Qwen4ExpTextRMSNorm(CHANNELS, group_size=WIDTH, eps=EPS)
        norm = norm.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        norms.append(norm)
    norm_key, norm_query, norm_conv = norms
    hc_count, hidden_size = STREAMS, WIDTH

    @torch.no_grad()
    def gate_fn(key, value, hidden_states):
        key_normed = norm_key(key).unflatten(-1, (hc_count, hidden_size))
        query_normed = norm_query(hidden_states).unflatten(-1, (hc_count, hidden_size))
        gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated_value = torch.sigmoid(gate) * value.unsqueeze(-2)
        gated_value_normed = norm_conv(gated_value.flatten(-2))
        gated_value = gated_value.flatten(-2)
        return gated_value, gated_value_normed

    return gate_fn


def _case(
    name: str, tokens: int, rounding: str, device: torch.device, vllm_gate, vllm_fields: dict
) -> Case:
    gen = torch.Generator().manual_seed(INPUT_SEED)
    kv = torch.randn(tokens, CHANNELS + WIDTH, generator=gen).to(DTYPE).to(device)
    hidden = (torch.randn(tokens, CHANNELS, generator=gen) * 3).to(DTYPE).to(device)
    weights = [(torch.randn(CHANNELS, generator=gen) * 0.1).to(DTYPE).to(device) for _ in range(3)]
    key, value = kv[:, :CHANNELS], kv[:, CHANNELS:]
    out = (torch.zeros_like(hidden), torch.zeros_like(hidden))
    args = (key, value, hidden, *weights, EPS)
    hf_gate = _transformers_gate(weights)

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours() -> torch.Tensor:
        return ops.ple_gate(*args, rounding=rounding, out=out)[0]

    def oracle() -> torch.Tensor:
        return reference.ple_gate(*args, rounding=rounding)[0]

    # As users call it: the op allocates its two outputs, freed again as the call returns.
    def without_out() -> torch.Tensor:
        return ops.ple_gate(*args, rounding=rounding)[0]

    def derive(times) -> dict[str, object]:
        ratio = times["without_out"].p50_us / times["ours"].p50_us
        return {
            "without_out_vs_out": ratio,
            "summary": f"without out=: {times['without_out'].p50_us / 1e3:.2f} ms, "
            f"{ratio:.2f}x the out= call",
        }

    baselines = {"transformers": lambda: hf_gate(key, value, hidden)[0]}
    if vllm_gate is not None:
        baselines["vllm"] = lambda: vllm_gate(*args)[0]

    def check() -> str | None:
        got = [t.clone() for t in ops.ple_gate(*args, rounding=rounding, out=out)]
        # (who, its name in the tolerance table, its results)
        others = [
            ("the oracle", "reference", reference.ple_gate(*args, rounding=rounding)),
            ("transformers", "transformers", hf_gate(key, value, hidden)),
        ]
        if vllm_gate is not None and rounding == "vllm":
            others.append(("vllm", "vllm", vllm_gate(*args)))
        for who, against, expected in others:
            tol = tolerance("ple_gate", DTYPE, rounding=rounding, against=against)
            for what, g, e in zip(("gated", "conv_input"), got, expected, strict=True):
                problem = close_mismatch(g, e, tol, what, against=who)
                if problem is not None:
                    return problem
        if vllm_gate is not None and rounding != "vllm":
            # vLLM's kernel computes the "vllm" rounding: held to ours in that rounding.
            mine = ops.ple_gate(*args, rounding="vllm")
            tol = tolerance("ple_gate", DTYPE, rounding="vllm", against="vllm")
            for what, g, e in zip(("gated", "conv_input"), mine, vllm_gate(*args), strict=True):
                problem = close_mismatch(g, e, tol, what, against="vllm (the vllm rounding)")
                if problem is not None:
                    return problem
        return None

    element = hidden.element_size()
    # key, hidden, value read once, two outputs written once, three weight rows.
    nbytes = element * (tokens * (2 * CHANNELS + WIDTH) + 2 * tokens * CHANNELS + 3 * CHANNELS)
    return Case(
        op="ple_gate",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=ours,
        oracle=oracle,
        baselines=baselines,
        params={"T": tokens, "H": WIDTH, "M": STREAMS, "fast": int(rounding == "fp32")},
        check=check,
        references={"without_out": without_out},
        derive=derive,
        **vllm_fields,
    )
