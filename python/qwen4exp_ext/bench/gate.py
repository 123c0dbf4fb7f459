"""``gate`` cases: ``ple_gate`` at the released shape (H = 2560, M = 4 streams, C = 10240, bf16)
over decode batches (T = 1, 8, 64, 256), spec-decode batches (64 requests of q = 2 and 4 tokens)
and a T = 8192 prefill, in both roundings ("vllm", the default, and the fast "fp32" pass),
against the eager reference; on a GPU with vLLM importable, also against vLLM's own Triton
``ple_gate`` (cases ``*_vs_vllm``, where the "ref" column is vLLM's kernel).

key and value are column slices of one [T, C+H] projection output, as the layer produces them;
ours writes into preallocated outputs (``out=``), the reference allocates as eager PyTorch does.
The check runs both once from the same inputs and applies the tolerance tests/test_ple_gate.py
states: within two units in the last place of bf16 for the "vllm" rounding (which can differ
from the reference's PyTorch summation order by that much), one for the fast pass.
"""

from __future__ import annotations

import torch

from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench.registry import Case

# Released config, SPEC.md §1.
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
# Units in the last place of bf16, at the bottom of a binade (tests/test_ple_gate.py).
ATOL = 1e-5
RTOL = {"vllm": 2.0**-6, "fp32": 2.0**-7}


def _vllm_ple_gate():
    """vLLM's own Triton ple_gate, or None when vLLM cannot be imported (it needs a GPU build)."""
    try:
        from vllm.models.qwen4_exp.common.ops.ple import ple_gate
    except Exception:  # noqa: BLE001 - any import failure means "no vLLM to compare with"
        return None
    return ple_gate


def cases(device: torch.device) -> list[Case]:
    shapes = [(f"decode_T{t}", t) for t in DECODE_TOKENS]
    shapes += [(f"spec_q{q}_R{SPEC_REQUESTS}", SPEC_REQUESTS * q) for q in SPEC_QUERY_LENS]
    shapes += [(f"prefill_T{PREFILL_TOKENS}", PREFILL_TOKENS)]
    out = []
    for name, tokens in shapes:
        for rounding in ("vllm", "fp32"):
            suffix = "" if rounding == "vllm" else "_fast"
            out.append(_case(name + suffix, tokens, rounding, device, vs_vllm=None))
    vllm_gate = _vllm_ple_gate() if device.type == "cuda" else None
    if vllm_gate is not None:
        for name, tokens in shapes:
            out.append(_case(name + "_vs_vllm", tokens, "vllm", device, vs_vllm=vllm_gate))
    return out


def _case(name: str, tokens: int, rounding: str, device: torch.device, vs_vllm) -> Case:
    gen = torch.Generator().manual_seed(INPUT_SEED)
    kv = torch.randn(tokens, CHANNELS + WIDTH, generator=gen).to(DTYPE).to(device)
    hidden = (torch.randn(tokens, CHANNELS, generator=gen) * 3).to(DTYPE).to(device)
    weights = [(torch.randn(CHANNELS, generator=gen) * 0.1).to(DTYPE).to(device) for _ in range(3)]
    key, value = kv[:, :CHANNELS], kv[:, CHANNELS:]
    out = (torch.zeros_like(hidden), torch.zeros_like(hidden))
    args = (key, value, hidden, *weights, EPS)

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours() -> torch.Tensor:
        return ops.ple_gate(*args, rounding=rounding, out=out)[0]

    if vs_vllm is None:

        def ref() -> torch.Tensor:
            return reference.ple_gate(*args, rounding=rounding)[0]

    else:

        def ref() -> torch.Tensor:
            return vs_vllm(*args)[0]

    def check() -> str | None:
        got = [t.clone() for t in ops.ple_gate(*args, rounding=rounding, out=out)]
        if vs_vllm is None:
            expected = reference.ple_gate(*args, rounding=rounding)
        else:
            expected = vs_vllm(*args)
        for what, g, e in zip(("gated", "conv_input"), got, expected, strict=True):
            bad = ~torch.isclose(g.float(), e.float(), atol=ATOL, rtol=RTOL[rounding])
            if bool(bad.any()):
                first = tuple(bad.nonzero()[0].tolist())
                return (
                    f"{what}: {int(bad.sum())} of {g.numel()} elements beyond tolerance; "
                    f"first at {first}: ours {g[first].item()}, ref {e[first].item()}"
                )
        return None

    element = hidden.element_size()
    # key, hidden, value read once, two outputs written once, three weight rows.
    nbytes = element * (tokens * (2 * CHANNELS + WIDTH) + 2 * tokens * CHANNELS + 3 * CHANNELS)
    return Case(
        op="gate",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=ours,
        ref=ref,
        params={"T": tokens, "H": WIDTH, "M": STREAMS, "fast": int(rounding == "fp32")},
        check=check,
    )
