"""``ple_conv`` cases: ``ple_conv`` at the released shape (C = 10240, K = 4, dilation 3, state of
S = 9 entries, bf16, fused residuals) over decode batches (1, 8, 64, 256 requests), spec-decode
batches (64 requests of q = 2 and 4 tokens) and a T = 8192 prefill (4 requests of 2048 tokens,
each with an initial state), in vLLM's default window-first state layout; decode R = 64 and the
prefill also in the dim-first one (cases ``*_ds``).

The state is [slots, C, W] either way (W = S + q - 1): window-first ("SD", vLLM's default) is a
transposed view of [slots, W, C] storage, channel stride 1; dim-first ("DS",
``VLLM_SSM_CONV_STATE_LAYOUT=DS``) is contiguous [slots, C, W], window stride 1, channel
stride W.

Baselines, what a user would run in eager torch, as transformers' ``Qwen4ExpTextPLELayer``
(``_short_conv``) does: "conv1d" (the headline), per request the [C, S + L] window (the state's
S entries from its offset, oldest first, then the chunk; the requests of a case have equal
lengths, so one [R, C, S + L] batch), ``F.conv1d(window, w[:, None, :], groups=C,
dilation=3)`` in bf16, SiLU, then the fused residuals in place (``residual += y``,
``residual += outer``), and the state update by cat + slice (``state[slots, :, :n] =
window[..., -n:]``: n = S, or S - 1 + q for spec from the window's second entry, as ple_conv's
spec write-back keeps old[o+1:o+S] ++ chunk). "conv1d_fp32": the same with the window and
weights upcast to fp32 for the convolution (rounded to bf16 before SiLU): on an AVX2 CPU,
torch's bf16 depthwise dilated conv1d can take a slow path (at decode R = 64 on Zen 3, 32x the
fp32 one), and a user who noticed would upcast; on the AVX-512 CPUs measured (Zen 4, Zen 5, a
Xeon) the bf16 one is the faster. On a GPU with vLLM 0.33.0's source here, every case (each mode,
both layouts) also times vLLM's own Triton ``ple_conv`` ("vllm", for ``speedup_vs_vllm``). The
oracle is ``reference.ple_conv``.

ple_conv works in place (residual, conv_state): each contender owns its copies, and the timed
calls keep advancing them, as a server's steps do. The check runs every contender once from
identical copies; ours must have equal states, and residuals within the tolerance of ple_conv
against each (qwen4exp_ext.testing.TOLERANCES, with the reasons): exact against the oracle and
vLLM (bf16 results are exact), within a unit or so against the conv1d baselines.

Bytes: inputs and outer read once, residual read and written, weights read, and each request's
window read and rewritten (S entries; spec keeps S - 1 + q).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench.registry import Case, vllm_kernels
from qwen4exp_ext.testing import close_mismatch, exact_mismatch, tolerance

# Released config, SPEC §1.
CHANNELS = 10240
KERNEL = 4
DILATION = 3
DTYPE = torch.bfloat16
DECODE_REQUESTS = (1, 8, 64, 256)
SPEC_REQUESTS = 64
SPEC_QUERY_LENS = (2, 4)
PREFILL_TOKENS, PREFILL_REQUESTS = 8192, 4
# Decode batch that also runs in the dim-first layout (as does the prefill).
DIM_FIRST_DECODE_REQUESTS = 64
INPUT_SEED = 0


def cases(device: torch.device) -> list[Case]:
    shapes = [(f"decode_R{r}", "decode", [1] * r, 1) for r in DECODE_REQUESTS]
    shapes += [
        (f"spec_q{q}_R{SPEC_REQUESTS}", "spec", [q] * SPEC_REQUESTS, q) for q in SPEC_QUERY_LENS
    ]
    per_request = PREFILL_TOKENS // PREFILL_REQUESTS
    prefill = (
        f"prefill_T{PREFILL_TOKENS}_R{PREFILL_REQUESTS}",
        "prefill",
        [per_request] * PREFILL_REQUESTS,
        1,
    )
    shapes.append(prefill)
    vllm = vllm_kernels(device)
    vllm_conv = vllm.op("ple_conv")
    fields = vllm.case_fields("vllm" if vllm_conv is not None else None)
    out = [_case(*shape, "SD", device, vllm_conv, fields) for shape in shapes]
    dim_first = [s for s in shapes if s[0] == f"decode_R{DIM_FIRST_DECODE_REQUESTS}"] + [prefill]
    out += [
        _case(name + "_ds", *rest, "DS", device, vllm_conv, fields) for name, *rest in dim_first
    ]
    return out


class _Contender:
    """One contender's own residual and state, advanced by every call."""

    def __init__(self, residual: torch.Tensor, state_storage: torch.Tensor, layout: str):
        self.residual = residual.clone()
        window_first = state_storage.clone().transpose(1, 2)  # [slots, C, W], channel stride 1
        self.state = window_first if layout == "SD" else window_first.contiguous()


def _eager_conv(
    mode: str,
    requests: int,
    query_len: int,
    inputs: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    outer: torch.Tensor,
    conv_dtype: torch.dtype,
) -> Callable[[_Contender], torch.Tensor]:
    """The F.conv1d baseline on one contender (see the module docstring)."""
    tokens, channels = inputs.shape
    state_len = (KERNEL - 1) * DILATION
    # Spec reads from offset o = num_accepted - 1 (here q - 1) and keeps S - 1 + q entries.
    offset = query_len - 1 if mode == "spec" else 0
    kept = state_len - 1 + query_len if mode == "spec" else state_len
    rows = slots.long()
    chunks = inputs.view(requests, tokens // requests, channels).transpose(1, 2)  # [R, C, L]
    taps = weights[:, None, :].to(conv_dtype)  # [C, 1, K]

    def run(c: _Contender) -> torch.Tensor:
        old = c.state[rows, :, offset : offset + state_len]
        window = torch.cat((old, chunks), dim=-1)  # [R, C, S + L]
        conv = F.conv1d(window.to(conv_dtype), taps, groups=channels, dilation=DILATION)
        y = F.silu(conv.to(inputs.dtype)).transpose(1, 2).reshape(tokens, channels)
        c.residual += y
        c.residual += outer
        c.state[rows, :, :kept] = window[..., -kept:]
        return c.residual

    return run


def _conv_kwargs(mode: str, lengths: list[int], query_len: int, device: torch.device) -> dict:
    """ple_conv's keyword arguments for requests of ``lengths`` tokens: prefill from an initial
    state, spec with every draft accepted."""
    requests = len(lengths)
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
    return kwargs


def _first_mismatch(
    ours: Callable[[_Contender], torch.Tensor],
    others: dict[str, Callable[[_Contender], torch.Tensor]],
    fresh: Callable[[], _Contender],
) -> str | None:
    """Runs ours and every other contender once, each on its own ``fresh()`` copy, and describes
    the first disagreement with ours (states equal, residuals within ple_conv's tolerance)."""
    mine = fresh()
    ours(mine)
    for who, run in others.items():
        theirs = fresh()
        run(theirs)
        against = "the oracle" if who == "oracle" else who
        tol = tolerance("ple_conv", DTYPE, against="reference" if who == "oracle" else who)
        problem = exact_mismatch(
            mine.state, theirs.state, "conv_state", against=against, equal_nan=True
        ) or close_mismatch(
            mine.residual, theirs.residual, tol, "residual", against=against, equal_nan=True
        )
        if problem is not None:
            return problem
    return None


def _case(
    name: str,
    mode: str,
    lengths: list[int],
    query_len: int,
    layout: str,
    device: torch.device,
    vllm_conv,
    vllm_fields: dict,
) -> Case:
    gen = torch.Generator().manual_seed(INPUT_SEED)
    tokens = sum(lengths)
    requests = len(lengths)
    state_len = (KERNEL - 1) * DILATION
    width = state_len + query_len - 1
    inputs = torch.randn(tokens, CHANNELS, generator=gen).to(DTYPE).to(device)
    residual = torch.randn(tokens, CHANNELS, generator=gen).to(DTYPE).to(device)
    outer = torch.randn(tokens, CHANNELS, generator=gen).to(DTYPE).to(device)
    weights = (torch.randn(CHANNELS, KERNEL, generator=gen) * 0.3).to(DTYPE).to(device)
    storage = torch.randn(requests + 1, width, CHANNELS, generator=gen).to(DTYPE).to(device)
    slots = torch.arange(1, requests + 1, dtype=torch.int32, device=device)
    kwargs = _conv_kwargs(mode, lengths, query_len, device)

    def kernel_call(fn) -> Callable[[_Contender], torch.Tensor]:
        def run(c: _Contender) -> torch.Tensor:
            fn(inputs, c.residual, c.state, weights, slots, outer, **kwargs)
            return c.residual

        return run

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours_call(c: _Contender) -> torch.Tensor:
        return kernel_call(ops.ple_conv)(c)

    eager = {
        name_: _eager_conv(mode, requests, query_len, inputs, weights, slots, outer, dtype)
        for name_, dtype in (("conv1d", DTYPE), ("conv1d_fp32", torch.float32))
    }
    # The contenders other than ours.
    others: dict[str, Callable[[_Contender], torch.Tensor]] = {
        "oracle": kernel_call(reference.ple_conv),
        **eager,
    }
    if vllm_conv is not None:
        others["vllm"] = kernel_call(vllm_conv)
    states = {who: _Contender(residual, storage, layout) for who in ("ours", *others)}

    def bind(run, who: str) -> Callable[[], torch.Tensor]:
        return lambda: run(states[who])

    def check() -> str | None:
        return _first_mismatch(ours_call, others, lambda: _Contender(residual, storage, layout))

    element = inputs.element_size()
    live_state = requests * CHANNELS * element
    # inputs and outer read once, residual read and written, weights read, and each request's
    # window read and rewritten (S entries; spec keeps S - 1 + q).
    kept = state_len if mode != "spec" else state_len - 1 + query_len
    nbytes = element * tokens * CHANNELS * 4 + weights.numel() * element + 2 * kept * live_state
    return Case(
        op="ple_conv",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=lambda: ours_call(states["ours"]),
        oracle=bind(others["oracle"], "oracle"),
        baselines={who: bind(run, who) for who, run in others.items() if who != "oracle"},
        params={
            "T": tokens,
            "R": requests,
            "q": query_len,
            "C": CHANNELS,
            "K": KERNEL,
            "dilation": DILATION,
            "state_layout": layout,
        },
        check=check,
        **vllm_fields,
    )
