"""Plain-PyTorch reference of every qwen4exp kernel: the oracle the kernels are tested against.

Each function is written from docs/SPEC.md, section by section, in the most obviously correct
form that is still vectorised (the bench times it too, as the "oracle" column). It runs on any
device PyTorch supports. Nothing here is ever tuned to agree with a kernel: when a kernel and
this file disagree, docs/SPEC.md decides.

Sections: §3 ``ngram_ids``, §4 ``gather_rows``, §5 ``ple_gate``, §6 ``ple_conv``, §7
``ple_layer``, §8 ``hc_mix``/``hc_combine`` and ``gated_residual_mix``/``gated_residual_combine``.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Literal, get_args

import torch
import torch.nn.functional as F

__all__ = [
    "CONV_MODES",
    "E2M1_VALUES",
    "FP8_DTYPES",
    "NULL_SLOT",
    "NVFP4_BLOCK",
    "ConvMode",
    "gather_rows",
    "gated_residual_combine",
    "gated_residual_mix",
    "grouped_gemma_rmsnorm",
    "grouped_rms_norm",
    "hc_average_combine",
    "hc_combine",
    "hc_combine_norm",
    "hc_gate_mix",
    "hc_mix",
    "hc_silu",
    "ngram_ids",
    "nvfp4_decode",
    "ple_conv",
    "ple_gate",
    "ple_layer",
]

# The constants of the spec are defined here, once: this module imports nothing but torch, so
# ops, the layers and qwen4exp_ext.testing all take them from it.

# The fp8 table formats (SPEC §4): rows dequantised with a per-tensor scale.
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

# NVFP4 (vLLM's layout): two E2M1 codes per byte, the even element in the low nibble; code bit 3
# is the sign, bits 0-2 index these magnitudes. One float8_e4m3fn scale per NVFP4_BLOCK elements.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16

# vLLM's NULL_BLOCK_ID: state slot 0 is padding. It is never read or written (SPEC §6).
NULL_SLOT = 0

# ple_conv's modes (SPEC §6), as a type and as the values themselves.
ConvMode = Literal["decode", "prefill", "spec"]
CONV_MODES: tuple[ConvMode, ...] = get_args(ConvMode)


# --------------------------------------------------------------------------------------------
# §3 n-gram row ids
# --------------------------------------------------------------------------------------------
def _ngram_window(
    tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    eos_token_id: int,
) -> list[torch.Tensor]:
    """window[s] [T] int64 = the token s positions back of every token (window[0] is the token
    itself), s = 0..N-1: from the chunk, else the request's context, EOS from the first EOS back."""
    device = tokens.device
    num_tokens = tokens.numel()
    context_len = ngram_context.shape[1]  # N - 1
    eos = torch.tensor(eos_token_id, dtype=torch.int64, device=device)
    qsl = query_start_loc.to(device=device, dtype=torch.int64).reshape(-1)
    num_reqs = qsl.numel() - 1
    positions = torch.arange(num_tokens, device=device, dtype=torch.int64)

    window = [tokens]
    if num_reqs <= 0:
        return window + [eos.expand(num_tokens)] * context_len
    context = ngram_context.to(device=device, dtype=torch.int64)
    req = torch.searchsorted(qsl[1:].contiguous(), positions, right=True)
    req = req.clamp_(max=num_reqs - 1)
    pos_in_chunk = positions - qsl[req]
    crossed = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for shift in range(1, context_len + 1):
        in_chunk = pos_in_chunk >= shift
        from_step = tokens[(positions - shift).clamp(min=0)]
        column = context_len - shift + pos_in_chunk
        from_context = context[req, column.clamp(0, context_len - 1)]
        from_context = torch.where(column >= 0, from_context, eos)
        candidate = torch.where(in_chunk, from_step, from_context)
        candidate = torch.where(crossed, eos, candidate)
        crossed = crossed | (candidate == eos)
        window.append(candidate)
    return window


def ngram_ids(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    layer_multipliers: torch.Tensor,
    ngram_heads_vocab_sizes: torch.Tensor,
    ngram_heads_offsets: torch.Tensor,
    eos_token_id: int,
    heads_per_ngram: int,
    output: torch.Tensor | None = None,
    *,
    head_divmod: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hashed n-gram table row of every (token, head) — SPEC §3.

    Same signature as vLLM 0.33.0 ``ple_ngram_ids``, plus ``ops.ngram_ids``' ``head_divmod``,
    which is ignored here: those precomputed modulo constants change how fast the kernel reduces,
    never the ids (``torch.remainder`` needs none). ``input_ids`` [T] (int32/int64, any shape
    that flattens to T), ``query_start_loc`` [R+1], ``ngram_context`` [R, N-1] (oldest first),
    ``layer_multipliers`` [N], sizes and offsets [NH] with NH = (N-1)·heads_per_ngram.

    Token t belongs to request r = the last r with qsl[r] <= t, clamped to R-1 (tokens past
    qsl[R] count as the last request's); p = t - qsl[r]. Its window is w[0] = input_ids[t] and,
    for s = 1..N-1, input_ids[t-s] when p >= s else ngram_context[r, N-1-s+p]. Walking back
    from w[1], the first EOS is kept and every older position reads EOS (the current token never
    cuts its own history). With R = 0 every earlier position reads EOS; a context column before
    0 (only reachable when qsl[0] > 0) also reads EOS. Head h of order n = h // K + 2 gets
    floor_mod(XOR_{k<n} w[k]·m_k, size_h) + off_h, the products wrapping mod 2^64 in int64.

    Returns int64 [T, NH], or writes into ``output`` ([T, NH], int64 or int32) and returns it.
    """
    device = input_ids.device
    tokens = input_ids.reshape(-1).to(torch.int64)
    num_tokens = tokens.numel()
    context_len = ngram_context.shape[1]  # N - 1
    num_heads = context_len * heads_per_ngram
    multipliers = layer_multipliers.to(device=device, dtype=torch.int64).reshape(-1)
    sizes = ngram_heads_vocab_sizes.to(device=device, dtype=torch.int64).reshape(-1)
    offsets = ngram_heads_offsets.to(device=device, dtype=torch.int64).reshape(-1)
    if context_len < 1 or heads_per_ngram < 1:
        raise ValueError("need ngram_size >= 2 and heads_per_ngram >= 1")
    if multipliers.numel() < context_len + 1:
        raise ValueError(f"need {context_len + 1} multipliers, got {multipliers.numel()}")
    if sizes.numel() != num_heads or offsets.numel() != num_heads:
        raise ValueError(f"head sizes/offsets must have {num_heads} entries")
    if output is not None:
        if tuple(output.shape) != (num_tokens, num_heads):
            raise ValueError(
                f"output must be [{num_tokens}, {num_heads}], got {tuple(output.shape)}"
            )
        if output.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"output must be int64 or int32, got {output.dtype}")

    window = _ngram_window(tokens, query_start_loc, ngram_context, eos_token_id)

    # mix of order n = XOR over k < n of w[k]·m_k; torch int64 multiply wraps mod 2^64.
    mix = window[0] * multipliers[0]
    mixes = []
    for shift in range(1, context_len + 1):
        mix = mix ^ (window[shift] * multipliers[shift])
        mixes.append(mix)  # order n = shift + 1
    per_head = torch.stack(mixes, dim=1).repeat_interleave(heads_per_ngram, dim=1)  # [T, NH]
    ids = torch.remainder(per_head, sizes) + offsets  # floor mod: in [0, size) even if mix < 0

    if output is None:
        return ids
    output.copy_(ids)
    return output


# --------------------------------------------------------------------------------------------
# §4 embedding gather
# --------------------------------------------------------------------------------------------
def _row_width(table: torch.Tensor, block_scales: torch.Tensor | None) -> int:
    """The elements of a table row: its columns, or for an NVFP4 table (``block_scales`` given)
    two a byte, once the table and its block scales are checked against each other."""
    if block_scales is None:
        return table.shape[1]
    rows = table.shape[0]
    if table.dtype != torch.uint8:
        raise ValueError(f"an NVFP4 table is uint8 [rows, d/2], got {table.dtype}")
    width = 2 * table.shape[1]
    if width % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 rows hold a multiple of {NVFP4_BLOCK} elements, got {width}")
    if block_scales.dtype != torch.float8_e4m3fn or tuple(block_scales.shape) != (
        rows,
        width // NVFP4_BLOCK,
    ):
        raise ValueError(
            f"block_scales must be float8_e4m3fn [{rows}, {width // NVFP4_BLOCK}], got "
            f"{block_scales.dtype} {tuple(block_scales.shape)}"
        )
    return width


def gather_rows(
    table: torch.Tensor,
    ids: torch.Tensor,
    *,
    scale: torch.Tensor | float | None = None,
    block_scales: torch.Tensor | None = None,
    vocab_start: int = 0,
    vocab_end: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Concatenated table rows of every head of every token — SPEC §4.

    ``table`` [rows, d] in fp32/bf16/fp16/float8_e4m3fn/float8_e4m3fnuz (fp8 needs the per-tensor
    fp32 ``scale``), ``ids`` [..., NH] int32/int64 → [..., NH·d]. ``out_dtype`` defaults to the
    table dtype, bf16 for fp8 and NVFP4. FP8 dequantisation follows vLLM's eager
    ``row.to(out) * scale.to(out)``: E = round_out(float(row) · float(round_out(scale))).

    NVFP4: a ``uint8`` table [rows, d/2] given with ``block_scales`` (float8_e4m3fn [rows, d/16])
    and the fp32 global ``scale``. Element c of a row is E2M1 code c of the row (byte c/2, low
    nibble for even c) times its block's scale (block c/16), a product that is exact in fp32, times
    ``scale`` in fp32 (one rounding), then rounded to ``out_dtype``:
    E = round_out(fp32(e2m1 · e4m3) · scale) — vLLM 0.33.0's ``_lookup_nvfp4_ple_embedding_kernel``.

    This rank owns global ids [vocab_start, vocab_end) (default: [vocab_start, vocab_start+rows))
    and reads table[id - vocab_start] for them; every other id — another rank's, negative, or
    past the table — gives a zero row, so no id can read out of bounds.
    """
    if table.dim() != 2:
        raise ValueError(f"table must be [rows, d], got {tuple(table.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    rows = table.shape[0]
    is_fp8 = table.dtype in FP8_DTYPES
    is_nvfp4 = block_scales is not None
    width = _row_width(table, block_scales)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if is_fp8 or is_nvfp4 else table.dtype
    if out_dtype in FP8_DTYPES or not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a non-fp8 float type, got {out_dtype}")
    if (is_fp8 or is_nvfp4) and scale is None:
        raise ValueError("an fp8 or NVFP4 table needs its per-tensor scale")
    if not (is_fp8 or is_nvfp4) and scale is not None:
        raise ValueError("scale is only defined for fp8 and NVFP4 tables")
    if vocab_end is None:
        vocab_end = vocab_start + rows
    if not 0 <= vocab_start <= vocab_end or vocab_end - vocab_start > rows:
        raise ValueError(f"shard [{vocab_start}, {vocab_end}) does not fit a table of {rows} rows")

    flat = ids.reshape(-1).to(device=table.device, dtype=torch.int64)
    owned = (flat >= vocab_start) & (flat < vocab_end)
    local = torch.where(owned, flat - vocab_start, torch.zeros_like(flat))
    # Row 0 stands in for unowned ids and is zeroed below (a zero row when the table has none).
    source = table if rows > 0 else table.new_zeros((1, table.shape[1]))
    picked = source[local]  # [n, d] (NVFP4: [n, d/2] packed)
    if is_nvfp4:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=table.device).reshape(())
        scale_source = block_scales if rows > 0 else block_scales.new_zeros((1, width // 16))
        picked_scales = scale_source[local]
        values = (nvfp4_decode(picked, picked_scales) * scale_t).to(out_dtype)
    elif is_fp8:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=table.device).reshape(())
        scale_out = scale_t.to(out_dtype).to(torch.float32)
        values = (picked.to(torch.float32) * scale_out).to(out_dtype)
    else:
        values = picked.to(out_dtype)
    values = torch.where(
        owned[:, None], values, torch.zeros((), dtype=out_dtype, device=table.device)
    )
    return values.reshape(*ids.shape[:-1], ids.shape[-1] * width)


def nvfp4_decode(packed: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """NVFP4 rows [n, d/2] uint8 with their float8_e4m3fn block scales [n, d/16] → fp32 [n, d]:
    e2m1 · e4m3, exact (a 2-bit by 4-bit significand product, far from fp32's range limits)."""
    n, half = packed.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, 2 * half)
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    e2m1 = magnitudes[(codes & 7).long()]
    e2m1 = torch.where((codes & 8) != 0, -e2m1, e2m1)
    blocks = block_scales.to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=1)
    return e2m1 * blocks


# --------------------------------------------------------------------------------------------
# §5 gate
# --------------------------------------------------------------------------------------------
def _rms_normalize_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim, all in fp32: x·rsqrt(mean(x²)+ε)·(1+w)."""
    variance = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]
    return x * torch.rsqrt(variance + eps) * (1.0 + weight)


def ple_gate(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_w: torch.Tensor,
    norm_query_w: torch.Tensor,
    norm_conv_w: torch.Tensor,
    eps: float,
    *,
    rounding: Literal["vllm", "fp32"] = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-aware gate of every hyper-connection stream — SPEC §5. Returns (gated, conv_input).

    key [T, C], value [T, H] (both may be strided views of one [T, C+H] projection), hidden
    [T, C], weights [C], all of one dtype (fp32, bf16, fp16). Per stream m of width H:
    d = Σ GN(key_m; w_k)·GN(hidden_m; w_q) / √H, a = sign(d)·sqrt(max(|d|, 1e-6)),
    gated_m = sigmoid(a)·value, conv_input_m = GN(gated_m; w_c); GN = Gemma RMSNorm, (1+w).

    ``rounding="vllm"`` rounds to the storage dtype where vLLM's eager graph materialises a
    tensor (and its Triton kernel mirrors it): normed key and query, their products, the dot, d,
    the magnitude, g and gated; conv_input is normalised from the rounded gated in fp32 and then
    stored. ``rounding="fp32"`` keeps every intermediate in fp32 and rounds only the outputs. In
    fp32 the two coincide.
    """
    if rounding not in ("vllm", "fp32"):
        raise ValueError(f"rounding must be 'vllm' or 'fp32', got {rounding!r}")
    dtype = hidden.dtype
    if key.dtype != dtype or value.dtype != dtype:
        raise ValueError("key, value and hidden must have the same dtype")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ple_gate supports fp32, bf16 and fp16, got {dtype}")
    num_tokens, hc_hidden = hidden.shape
    width = value.shape[-1]
    if hc_hidden % width or key.shape != hidden.shape or value.shape[0] != num_tokens:
        raise ValueError("expected key/hidden [T, M·H] and value [T, H]")
    streams = hc_hidden // width

    round_at_boundaries = rounding == "vllm"

    def rnd(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).to(torch.float32) if round_at_boundaries else x

    def per_stream(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).reshape(*x.shape[:-1], streams, width)

    key_n = rnd(_rms_normalize_fp32(per_stream(key), per_stream(norm_key_w), eps))
    query_n = rnd(_rms_normalize_fp32(per_stream(hidden), per_stream(norm_query_w), eps))
    products = rnd(key_n * query_n)
    dot = rnd(products.sum(dim=-1))  # [T, M]
    d = rnd(dot / torch.tensor(math.sqrt(width), dtype=torch.float32))
    magnitude = rnd(torch.sqrt(torch.clamp(d.abs(), min=1e-6)))
    g = rnd(torch.sigmoid(torch.sign(d) * magnitude))  # sign(0) = 0 → g = 1/2
    gated = rnd(g[..., None] * value.to(torch.float32)[:, None, :])  # [T, M, H]
    conv_input = _rms_normalize_fp32(gated, per_stream(norm_conv_w), eps)
    return (
        gated.reshape(num_tokens, hc_hidden).to(dtype),
        conv_input.reshape(num_tokens, hc_hidden).to(dtype),
    )


# --------------------------------------------------------------------------------------------
# §6 dilated causal depthwise conv with state
# --------------------------------------------------------------------------------------------
def _conv_taps(
    history: torch.Tensor, weights: torch.Tensor, dilation: int, count: int
) -> torch.Tensor:
    """fp32 Σ_k w[:, k]·history[j + k·δ] for j < count; history [S + L, C], weights [C, K]."""
    kernel = weights.shape[1]
    base = torch.arange(count, device=history.device)
    acc = history[base] * weights[:, 0]
    for k in range(1, kernel):
        acc = acc + history[base + k * dilation] * weights[:, k]
    return acc


def _check_conv_shapes(
    inputs: torch.Tensor,
    residual: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weights: torch.Tensor,
    mode: ConvMode,
    dilation: int,
    spec_query_len: int,
) -> tuple[int, int]:
    """ple_conv's mode and shape checks; returns (S, q): the state length, the query length."""
    if mode not in CONV_MODES:
        raise ValueError(f"Unsupported short-conv mode: {mode}")
    if inputs.dim() != 2 or residual.dim() != 2 or conv_state.dim() != 3:
        raise ValueError("inputs/residual must be [T, C] and conv_state [slots, C, W]")
    channels = inputs.shape[1]
    kernel = conv_weights.shape[1]
    state_len = (kernel - 1) * dilation
    query_len = spec_query_len if mode == "spec" else 1
    state_width = state_len + query_len - 1
    if conv_weights.shape[0] != channels:
        raise ValueError(f"conv_weights must be [{channels}, K], got {tuple(conv_weights.shape)}")
    if conv_state.shape[1] != channels or conv_state.shape[2] < state_width:
        raise ValueError(
            "conv_state must have shape [slots, channels, window], with "
            f"channels={channels} and window >= {state_width}"
        )
    return state_len, query_len


# What a conv mode leaves for ple_conv to store: the fp32 sums [T, C], which rows have an output
# [T], and the state writes, each (slot or slots, new leading window entries [..., n, C]).
_ConvResult = tuple[torch.Tensor, torch.Tensor, list[tuple[int | torch.Tensor, torch.Tensor]]]


def _conv_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weights: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_states: torch.Tensor | None,
    dilation: int,
    state_len: int,
) -> _ConvResult:
    """Decode: row t is request t, its window [0, S) then x_t; the window moves on by one."""
    num_rows, device = x.shape[0], x.device
    slots = state_indices.reshape(-1)[:num_rows].to(device=device, dtype=torch.int64)
    if slots.numel() != num_rows:
        raise ValueError("decode needs one state index per token")
    live = slots != NULL_SLOT
    if has_initial_states is not None:
        init = has_initial_states.reshape(-1)[:num_rows].to(device=device, dtype=torch.bool)
    else:
        init = torch.ones_like(live)
    read = (live & init)[:, None, None]
    old = conv_state[slots, :, :state_len].to(torch.float32).transpose(1, 2)  # [T, S, C]
    old = torch.where(read, old, torch.zeros((), device=device))
    history = torch.cat([old, x[:, None, :]], dim=1)  # [T, S+1, C]
    acc = history[:, 0] * weights[:, 0]
    for k in range(1, weights.shape[1]):
        acc = acc + history[:, k * dilation] * weights[:, k]
    # Every live token shifts its window by one; tokens are requests, so slots are distinct.
    return acc, live, [(slots[live], history[live, 1:])]


def _conv_varlen(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weights: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_states: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    *,
    mode: ConvMode,
    dilation: int,
    state_len: int,
    query_len: int,
) -> _ConvResult:
    """Prefill and spec: request r is the rows [qsl[r], qsl[r+1]), its history the slot's window
    (from the spec offset) followed by its chunk."""
    num_rows, channels, device = x.shape[0], x.shape[1], x.device
    acc = torch.zeros(num_rows, channels, dtype=torch.float32, device=device)
    has_output = torch.zeros(num_rows, dtype=torch.bool, device=device)
    writes: list[tuple[int | torch.Tensor, torch.Tensor]] = []
    qsl = query_start_loc.reshape(-1).tolist()
    num_reqs = state_indices.numel()
    if len(qsl) < num_reqs + 1:
        raise ValueError(f"query_start_loc needs {num_reqs + 1} entries, got {len(qsl)}")
    qsl = qsl[: num_reqs + 1]
    if any(b < a for a, b in pairwise(qsl)) or (num_reqs and qsl[-1] > num_rows):
        raise ValueError("query_start_loc must be non-decreasing and end within the tokens")
    slots = state_indices.reshape(-1).tolist()
    if mode == "prefill":
        init = has_initial_states.reshape(-1).tolist()
    else:
        accepted = num_accepted_tokens.reshape(-1).tolist()
    for r in range(num_reqs):
        start, end = qsl[r], qsl[r + 1]
        length = end - start
        slot = slots[r]
        live = slot != NULL_SLOT
        if mode == "spec":
            if length > query_len:
                raise ValueError(f"spec request {r} has {length} > {query_len} tokens")
            offset = min(max(accepted[r] - 1, 0), query_len - 1)
            read = live
            produces = True
        else:
            offset = 0
            read = live and bool(init[r])
            produces = live
        if read:
            old = conv_state[slot, :, offset : offset + state_len].to(torch.float32).T
        else:
            old = torch.zeros(state_len, channels, device=device)
        history = torch.cat([old, x[start:end]], dim=0)  # [S + L, C]
        if produces and length > 0:
            acc[start:end] = _conv_taps(history, weights, dilation, length)
            has_output[start:end] = True
        if not live:
            continue
        if mode == "prefill" and length > 0:
            writes.append((slot, history[length:]))
        elif mode == "spec":
            # S-1+qlen entries (vLLM caps them at S-1+q; qlen <= q was checked above).
            writes.append((slot, history[1:]))
    return acc, has_output, writes


def _store_conv_output(
    acc: torch.Tensor,
    has_output: torch.Tensor,
    residual: torch.Tensor,
    outer_residual: torch.Tensor | None,
    rows: torch.Tensor,
) -> None:
    """residual[rows] ← SiLU of the rounded sums (0 without output), with the fused residuals."""
    out_dtype = residual.dtype
    conv = acc.to(out_dtype)  # F.conv1d materialises its output dtype before SiLU
    # SiLU in float64, rounded once: torch's SIMD and scalar exp differ in the last fp32 ulp,
    # and the oracle's value must not depend on where a token sits in the batch.
    conv64 = conv.to(torch.float64)
    activated = conv64 * torch.sigmoid(conv64)
    activated = torch.where(has_output[:, None], activated, torch.zeros((), device=acc.device))
    conv_out = activated.to(out_dtype)
    if outer_residual is None:
        residual[rows] = conv_out
    else:
        ple_out = (residual[rows].to(torch.float32) + conv_out.to(torch.float32)).to(out_dtype)
        residual[rows] = (outer_residual[rows].to(torch.float32) + ple_out.to(torch.float32)).to(
            out_dtype
        )


def _write_conv_state(
    conv_state: torch.Tensor, writes: list[tuple[int | torch.Tensor, torch.Tensor]]
) -> None:
    """Each (slot or slots, entries [..., n, C]) becomes the first n window entries."""
    for slots, entries in writes:
        if entries.shape[-2]:
            window = entries.transpose(-1, -2).to(conv_state.dtype)
            conv_state[slots, :, : entries.shape[-2]] = window


def ple_conv(
    inputs: torch.Tensor,
    residual: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weights: torch.Tensor,
    state_indices: torch.Tensor,
    outer_residual: torch.Tensor | None,
    *,
    mode: ConvMode,
    dilation: int,
    query_start_loc: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    has_initial_states: torch.Tensor | None = None,
    spec_query_len: int = 1,
    token_indices: torch.Tensor | None = None,
) -> None:
    """Dilated causal depthwise conv + SiLU with per-request state — SPEC §6.

    Same signature and meaning as vLLM 0.33.0 ``ple_conv``; mutates ``residual`` and
    ``conv_state`` in place. inputs/residual/outer_residual [T, C]; conv_state [slots, C, W]
    with any strides (window-first storage is a transposed view); conv_weights [C, K];
    S = (K-1)·δ. Logical row t lives at physical row token_indices[t] (identity if None), and
    there are token_indices.numel() logical rows, else inputs.shape[0].

    For token j of a request: y = SiLU(round(Σ_k w[:, k]·hist[j + k·δ])) with hist = (S state
    entries from the slot's window offset, oldest first) ++ (the request's chunk inputs); the
    sum is rounded to residual's dtype before SiLU. Output: with outer_residual,
    residual ← round(round(residual + round(y)) + outer_residual), else residual ← round(y).
    Rows with no output (null slot in decode/prefill, tokens outside [qsl[0], qsl[R])) use y = 0.
    (The kernels take only qsl[0] = 0, as vLLM passes; the oracle stays defined beyond that.)

    - decode: row t is request t; reads window [0, S) (zeros if has_initial_states[t] is
      False), then the window becomes old[1:S] ++ x_t (zeros ++ x_t without initial state).
    - prefill: every token reads the old window (zeros without initial state); afterwards the
      window holds the last S entries of old ++ chunk. Zero-length requests keep theirs.
    - spec: reads start at offset o = clamp(num_accepted-1, 0, q-1); has_initial_states is
      ignored. Write-back (also for empty chunks, as vLLM does): entries [0, S-1+qlen) become
      old[o+1 : o+S] ++ chunk; entries from S-1+qlen on are kept. A null slot still produces
      output, from zero history. A chunk longer than q is an error.
    - slot NULL_SLOT (0) is never read or written.
    """
    state_len, query_len = _check_conv_shapes(
        inputs, residual, conv_state, conv_weights, mode, dilation, spec_query_len
    )
    if mode == "prefill" and (query_start_loc is None or has_initial_states is None):
        raise ValueError("query_start_loc and has_initial_states are required for prefill")
    if mode == "spec" and (query_start_loc is None or num_accepted_tokens is None):
        raise ValueError("query_start_loc and num_accepted_tokens are required for spec decode")
    device = inputs.device
    if token_indices is not None:
        rows = token_indices.to(device=device, dtype=torch.int64).reshape(-1)
    else:
        rows = torch.arange(inputs.shape[0], device=device)
    x = inputs[rows].to(torch.float32)  # [T, C] logical order, a snapshot
    weights = conv_weights.to(torch.float32)
    if mode == "decode":
        result = _conv_decode(
            x, conv_state, weights, state_indices, has_initial_states, dilation, state_len
        )
    else:
        result = _conv_varlen(
            x,
            conv_state,
            weights,
            state_indices,
            query_start_loc,
            has_initial_states,
            num_accepted_tokens,
            mode=mode,
            dilation=dilation,
            state_len=state_len,
            query_len=query_len,
        )
    acc, has_output, writes = result
    _store_conv_output(acc, has_output, residual, outer_residual, rows)
    _write_conv_state(conv_state, writes)  # only once every output has been computed


# --------------------------------------------------------------------------------------------
# §7 the layer
# --------------------------------------------------------------------------------------------
def _fresh_prefill_state(
    hidden: torch.Tensor, query_start_loc: torch.Tensor, kernel: int, dilation: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(conv_state, state_indices, has_initial_states) for requests that start from an empty
    history: slots 1..R of a zeroed state in hidden's dtype, discarded afterwards."""
    num_reqs = query_start_loc.numel() - 1
    state_len = (kernel - 1) * dilation
    conv_state = torch.zeros(
        num_reqs + 1, hidden.shape[-1], state_len, dtype=hidden.dtype, device=hidden.device
    )
    state_indices = torch.arange(1, num_reqs + 1, device=hidden.device)
    has_initial_states = torch.zeros(num_reqs, dtype=torch.bool, device=hidden.device)
    return conv_state, state_indices, has_initial_states


def ple_layer(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    *,
    table: torch.Tensor,
    table_scale: torch.Tensor | float | None = None,
    layer_multipliers: torch.Tensor,
    head_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    eos_token_id: int,
    heads_per_ngram: int,
    w_kv: torch.Tensor,
    norm_key_w: torch.Tensor,
    norm_query_w: torch.Tensor,
    norm_conv_w: torch.Tensor,
    conv_weights: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    mode: ConvMode = "prefill",
    has_initial_states: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    spec_query_len: int = 1,
    dilation: int | None = None,
    rounding: Literal["vllm", "fp32"] = "vllm",
) -> torch.Tensor:
    """One PLE layer on a varlen batch — SPEC §7. Returns hidden + gated + SiLU(conv(conv_in)).

    ids = ngram_ids(...); emb = gather_rows(table, ids) in hidden's dtype (fp8 tables
    dequantised with ``table_scale``); kv = emb·W_kvᵀ with ``w_kv`` = [key_proj; value_proj]
    [C+H, D_e]; key, value = split(kv, [C, H]) (strided views); gated, conv_in = ple_gate(...);
    ple_conv(conv_in, residual=gated, outer_residual=hidden). ``dilation`` defaults to N =
    ngram_context.shape[1] + 1. ``conv_weights`` [C, K] are cast to hidden's dtype (as vLLM
    does). With ``conv_state=None`` every request starts from an empty history (a fresh prefill,
    the state is discarded); otherwise ``conv_state``/``state_indices``/``mode`` and the rest
    are passed to ``ple_conv`` unchanged.
    """
    hc_hidden = hidden.shape[-1]
    width = w_kv.shape[0] - hc_hidden
    if width <= 0 or hc_hidden % width:
        raise ValueError(f"w_kv must be [C+H, D_e] with C = {hc_hidden} a multiple of H")
    if dilation is None:
        dilation = ngram_context.shape[1] + 1

    ids = ngram_ids(
        input_ids,
        query_start_loc,
        ngram_context,
        layer_multipliers,
        head_sizes,
        head_offsets,
        eos_token_id,
        heads_per_ngram,
    )
    embeddings = gather_rows(table, ids, scale=table_scale, out_dtype=hidden.dtype)
    kv = F.linear(embeddings, w_kv.to(hidden.dtype))
    key, value = kv.split([hc_hidden, width], dim=-1)
    gated, conv_input = ple_gate(
        key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps, rounding=rounding
    )

    if conv_state is None:
        if mode != "prefill":
            raise ValueError("conv_state=None only makes sense for a fresh prefill")
        conv_state, state_indices, has_initial_states = _fresh_prefill_state(
            hidden, query_start_loc, conv_weights.shape[1], dilation
        )
    elif state_indices is None:
        raise ValueError("state_indices is required with conv_state")

    ple_conv(
        conv_input,
        gated,
        conv_state,
        conv_weights.to(hidden.dtype),
        state_indices,
        hidden,
        mode=mode,
        dilation=dilation,
        query_start_loc=query_start_loc,
        num_accepted_tokens=num_accepted_tokens,
        has_initial_states=has_initial_states,
        spec_query_len=spec_query_len,
    )
    return gated


# --------------------------------------------------------------------------------------------
# §8 hyper-connections
# --------------------------------------------------------------------------------------------
def hc_mix(hyper_input: torch.Tensor, hc_count: int) -> torch.Tensor:
    """HyperConnectionBase mix — SPEC §8: the mean of the M streams of [..., M·H] → [..., H]."""
    if hyper_input.shape[-1] % hc_count:
        raise ValueError(f"last dim {hyper_input.shape[-1]} is not a multiple of {hc_count}")
    return hyper_input.unflatten(-1, (hc_count, -1)).mean(dim=-2)


def grouped_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Grouped Gemma RMSNorm: each ``group_size`` slice of the last dim normalised in fp32 and
    scaled by (1 + w), returned in x's dtype. ``weight`` is [M·H] (one per element) or [H]
    (shared by the groups, vLLM's ``hc_per_branch_norm=False``)."""
    if x.shape[-1] % group_size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {group_size}")
    if weight.numel() not in (group_size, x.shape[-1]):
        raise ValueError(f"norm weight must have {group_size} or {x.shape[-1]} elements")
    grouped = x.to(torch.float32).unflatten(-1, (-1, group_size))
    w = weight.to(torch.float32).reshape(-1, group_size)
    return _rms_normalize_fp32(grouped, w, eps).flatten(-2).to(x.dtype)


def gated_residual_mix(
    hyper_input: torch.Tensor,
    norm_weight: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    *,
    hc_count: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GatedResidual mix — SPEC §8. Returns (mixed [..., H], normed [..., M·H]).

    n = grouped Gemma RMSNorm of the input (in its dtype); gate = sigmoid(W_up·SiLU(W_down·n /
    M)); mixed = mean_m(gate_m ⊙ n_m). ``normed`` is what the paired combine reuses. w_down
    [r, M·H], w_up [M·H, r]; every matmul runs in the input dtype, as vLLM's eager module does.
    """
    hyper_hidden = hyper_input.shape[-1]
    if hyper_hidden % hc_count:
        raise ValueError(f"last dim {hyper_hidden} is not a multiple of hc_count={hc_count}")
    width = hyper_hidden // hc_count
    dtype = hyper_input.dtype
    normed = grouped_rms_norm(hyper_input, norm_weight, width, eps)
    gate = F.silu(F.linear(normed, w_down.to(dtype)) / hc_count)
    gate = torch.sigmoid(F.linear(gate, w_up.to(dtype))).unflatten(-1, (hc_count, width))
    mixed = (gate * normed.unflatten(-1, (hc_count, width))).mean(dim=-2)
    return mixed.to(dtype), normed


def gated_residual_combine(
    block_output: torch.Tensor,
    hyper_input: torch.Tensor,
    normed: torch.Tensor,
    w_inj: torch.Tensor,
) -> torch.Tensor:
    """GatedResidual combine — SPEC §8: X_m + block_output · 2·sigmoid(W_inj·n / M)_m.

    ``hyper_input`` is X (the mix's input), ``normed`` the n its mix returned, w_inj [M, M·H].
    """
    hc_count = w_inj.shape[0]
    width = block_output.shape[-1]
    if hyper_input.shape[-1] != hc_count * width:
        raise ValueError(f"expected {hc_count}·{width} hyper features, got {hyper_input.shape[-1]}")
    injection = 2.0 * torch.sigmoid(F.linear(normed, w_inj.to(normed.dtype)) / hc_count)  # [..., M]
    streams = hyper_input.unflatten(-1, (hc_count, width))
    out = streams + block_output.unsqueeze(-2) * injection.unsqueeze(-1)
    return out.flatten(-2).to(hyper_input.dtype)


# §8's HyperConnectionBase combine and §10's five hyper-connection ops live in reference_hc
# (this module's length), and are the oracle under these names.
from .reference_hc import (  # noqa: E402
    grouped_gemma_rmsnorm,
    hc_average_combine,
    hc_combine,
    hc_combine_norm,
    hc_gate_mix,
    hc_silu,
)
