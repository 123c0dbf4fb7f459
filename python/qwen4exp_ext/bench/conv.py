"""``conv`` cases: ``ple_conv`` at the released shape (C = 10240, K = 4, dilation 3, state of
S = 9 entries, bf16, vLLM's window-first state layout, fused residuals) over decode batches
(1, 8, 64, 256 requests), spec-decode batches (64 requests of q = 2 and 4 tokens) and a T = 8192
prefill (4 requests of 2048 tokens, each with an initial state), against the eager reference;
on a GPU with vLLM importable, also against vLLM's own Triton ``ple_conv`` (cases
``*_vs_vllm``, where the "ref" column is vLLM's kernel).

ple_conv works in place (residual, conv_state): each contender owns its copies, and the timed
calls keep advancing them, as a server's steps do. The check runs both once from identical
copies and requires equal residuals and states (bf16 results are exact, tests/test_ple_conv.py).
"""

from __future__ import annotations

import torch

from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench.registry import Case

# Released config, SPEC.md §1.
CHANNELS = 10240
KERNEL = 4
DILATION = 3
STATE_LEN = (KERNEL - 1) * DILATION
DTYPE = torch.bfloat16
DECODE_REQUESTS = (1, 8, 64, 256)
SPEC_REQUESTS = 64
SPEC_QUERY_LENS = (2, 4)
PREFILL_TOKENS, PREFILL_REQUESTS = 8192, 4
INPUT_SEED = 0


def _vllm_ple_conv():
    """vLLM's own Triton ple_conv, or None when vLLM cannot be imported (it needs a GPU build)."""
    try:
        from vllm.models.qwen4_exp.common.ops.ple import ple_conv
    except Exception:  # noqa: BLE001 - any import failure means "no vLLM to compare with"
        return None
    return ple_conv


def cases(device: torch.device) -> list[Case]:
    shapes = [(f"decode_R{r}", "decode", [1] * r, 1) for r in DECODE_REQUESTS]
    shapes += [
        (f"spec_q{q}_R{SPEC_REQUESTS}", "spec", [q] * SPEC_REQUESTS, q) for q in SPEC_QUERY_LENS
    ]
    per_request = PREFILL_TOKENS // PREFILL_REQUESTS
    shapes += [
        (
            f"prefill_T{PREFILL_TOKENS}_R{PREFILL_REQUESTS}",
            "prefill",
            [per_request] * PREFILL_REQUESTS,
            1,
        )
    ]
    out = [_case(*shape, device, vs_vllm=None) for shape in shapes]
    vllm_conv = _vllm_ple_conv() if device.type == "cuda" else None
    if vllm_conv is not None:
        out += [
            _case(name + "_vs_vllm", *rest, device, vs_vllm=vllm_conv) for name, *rest in shapes
        ]
    return out


class _Contender:
    """One contender's own residual and state, advanced by every call."""

    def __init__(self, residual: torch.Tensor, state_storage: torch.Tensor):
        self.residual = residual.clone()
        self.storage = state_storage.clone()
        self.state = self.storage.transpose(1, 2)  # [slots, C, W], window-first


def _case(
    name: str, mode: str, lengths: list[int], query_len: int, device: torch.device, vs_vllm
) -> Case:
    gen = torch.Generator().manual_seed(INPUT_SEED)
    tokens = sum(lengths)
    requests = len(lengths)
    width = STATE_LEN + query_len - 1
    inputs = torch.randn(tokens, CHANNELS, generator=gen).to(DTYPE).to(device)
    residual = torch.randn(tokens, CHANNELS, generator=gen).to(DTYPE).to(device)
    outer = torch.randn(tokens, CHANNELS, generator=gen).to(DTYPE).to(device)
    weights = (torch.randn(CHANNELS, KERNEL, generator=gen) * 0.3).to(DTYPE).to(device)
    storage = torch.randn(requests + 1, width, CHANNELS, generator=gen).to(DTYPE).to(device)
    slots = torch.arange(1, requests + 1, dtype=torch.int32, device=device)
    qsl = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    kwargs: dict = {"mode": mode, "dilation": DILATION}
    if mode == "prefill":
        kwargs.update(
            query_start_loc=qsl,
            has_initial_states=torch.ones(requests, dtype=torch.bool, device=device),
        )
    elif mode == "spec":
        kwargs.update(
            query_start_loc=qsl,
            spec_query_len=query_len,
            num_accepted_tokens=torch.full(
                (requests,), query_len, dtype=torch.int32, device=device
            ),
        )
    mine, theirs = _Contender(residual, storage), _Contender(residual, storage)
    ref_fn = reference.ple_conv if vs_vllm is None else vs_vllm

    def call(fn, c: _Contender) -> torch.Tensor:
        fn(inputs, c.residual, c.state, weights, slots, outer, **kwargs)
        return c.residual

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours() -> torch.Tensor:
        return call(ops.ple_conv, mine)

    def ref() -> torch.Tensor:
        return call(ref_fn, theirs)

    def check() -> str | None:
        a, b = _Contender(residual, storage), _Contender(residual, storage)
        call(ops.ple_conv, a)
        call(ref_fn, b)
        for what, x, y in (("residual", a.residual, b.residual), ("conv_state", a.state, b.state)):
            if not torch.equal(x, y):
                bad = (x != y).nonzero()
                first = tuple(bad[0].tolist())
                return (
                    f"{what}: {bad.shape[0]} of {x.numel()} elements differ; first at "
                    f"{first}: ours {x[first].item()}, ref {y[first].item()}"
                )
        return None

    element = inputs.element_size()
    live_state = requests * CHANNELS * element
    # inputs and outer read once, residual read and written, weights read, and each request's
    # window read and rewritten (S entries; spec keeps S - 1 + q).
    kept = STATE_LEN if mode != "spec" else STATE_LEN - 1 + query_len
    nbytes = element * tokens * CHANNELS * 4 + weights.numel() * element + 2 * kept * live_state
    return Case(
        op="conv",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=ours,
        ref=ref,
        params={
            "T": tokens,
            "R": requests,
            "q": query_len,
            "C": CHANNELS,
            "K": KERNEL,
            "dilation": DILATION,
        },
        check=check,
    )
