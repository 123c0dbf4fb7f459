"""The fake (meta) implementations of the kernel ops and of the host ops: each op's shape, dtype
and device rules, so that the ops trace under torch.compile and capture in CUDA graphs.

:func:`register_kernel_fakes` registers the kernel ops' fakes for one library (``qwen4exp``, and
each SIMT emulator library; :class:`qwen4exp_ext.ops.KernelOps` calls it); the host ops' fakes
(``qwen4exp::ngram_head_divmod``, ``qwen4exp::read_file_rows``) are registered when this module
is imported, which :mod:`qwen4exp_ext.ops` does.
"""

from __future__ import annotations

import torch

from .reference import CONV_MODES, FP8_DTYPES

# An NVFP4 table is packed bytes, two elements each (with float8_e4m3fn block scales).
NVFP4_TABLE_DTYPE = torch.uint8
_GATHER_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    first_name, first = next(iter(tensors.items()))
    for name, tensor in tensors.items():
        if tensor.device != first.device:
            raise RuntimeError(
                f"{op}: {name} is on {tensor.device} but {first_name} is on {first.device}"
            )


def _ngram_ids_fake(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    layer_multipliers: torch.Tensor,
    ngram_heads_vocab_sizes: torch.Tensor,
    ngram_heads_offsets: torch.Tensor,
    eos_token_id: int,
    heads_per_ngram: int,
    output: torch.Tensor,
    head_divmod: torch.Tensor | None = None,
) -> None:
    # The op only writes into `output`; the shape rules are the kernel's own checks, repeated
    # here so that a traced graph fails at trace time, not at run time. The device check matters
    # here too: a meta tensor among CPU ones routes the call to this function, not the kernel.
    optional = {} if head_divmod is None else {"head_divmod": head_divmod}
    _check_same_device(
        "ngram_ids",
        input_ids=input_ids,
        query_start_loc=query_start_loc,
        ngram_context=ngram_context,
        layer_multipliers=layer_multipliers,
        ngram_heads_vocab_sizes=ngram_heads_vocab_sizes,
        ngram_heads_offsets=ngram_heads_offsets,
        output=output,
        **optional,
    )
    num_heads = ngram_context.shape[1] * heads_per_ngram
    torch._check(input_ids.dim() == 1, lambda: "ngram_ids: input_ids must be 1-D")
    torch._check(
        output.shape == (input_ids.shape[0], num_heads),
        lambda: "ngram_ids: output must be [T, NH]",
    )
    if head_divmod is not None:
        torch._check(
            head_divmod.dtype == torch.int64 and head_divmod.shape == (num_heads, 4),
            lambda: "ngram_ids: head_divmod must be int64 [NH, 4]",
        )
        torch._check(
            head_divmod.is_contiguous(), lambda: "ngram_ids: head_divmod must be contiguous"
        )
    return None


def _ngram_head_divmod_fake(head_sizes: torch.Tensor) -> torch.Tensor:
    torch._check(
        head_sizes.dtype == torch.int64 and head_sizes.dim() == 1,
        lambda: "ngram_head_divmod: head_sizes must be int64 [NH]",
    )
    return head_sizes.new_empty((head_sizes.shape[0], 4))


def _check_gather_table_fake(
    op: str,
    table: torch.Tensor,
    scale: torch.Tensor | None,
    block_scales: torch.Tensor | None,
    vocab_start: int,
    vocab_end: int | None,
    output: torch.Tensor,
    max_blocks: int,
    num_tokens: int,
    num_heads: int,
) -> None:
    """gather_rows' and ngram_gather_rows' checks of the table, its scales, the shard, the
    output and the grid cap, for T = num_tokens tokens of NH = num_heads heads."""
    nvfp4 = table.dtype == NVFP4_TABLE_DTYPE
    torch._check(table.dim() == 2, lambda: f"{op}: table must be 2-D [rows, d]")
    width = table.shape[1] * (2 if nvfp4 else 1)
    torch._check(
        output.shape == (num_tokens, num_heads * width),
        lambda: f"{op}: output must be [T, NH·d]",
    )
    torch._check(
        output.dtype in _GATHER_OUT_DTYPES,
        lambda: f"{op}: output must be float32, bfloat16 or float16",
    )
    torch._check(
        (scale is not None) == (table.dtype in FP8_DTYPES or nvfp4),
        lambda: f"{op}: fp8 and NVFP4 tables need a scale, other tables take none",
    )
    torch._check(
        (block_scales is not None) == nvfp4
        and (
            not nvfp4
            or (
                width % 16 == 0
                and block_scales.dtype == torch.float8_e4m3fn
                and block_scales.shape == (table.shape[0], width // 16)
            )
        ),
        lambda: (
            f"{op}: an NVFP4 (uint8) table needs float8_e4m3fn block_scales "
            "[rows, d/16], other tables take none"
        ),
    )
    if vocab_end is None:
        vocab_end = vocab_start + table.shape[0]
    torch._check(
        0 <= vocab_start <= vocab_end and vocab_end - vocab_start <= table.shape[0],
        lambda: f"{op}: shard [vocab_start, vocab_end) does not fit the table",
    )
    torch._check(max_blocks >= 0, lambda: f"{op}: max_blocks must be >= 0 (0: no cap)")


def _gather_rows_fake(
    table: torch.Tensor,
    ids: torch.Tensor,
    scale: torch.Tensor | None,
    block_scales: torch.Tensor | None,
    vocab_start: int,
    vocab_end: int | None,
    output: torch.Tensor,
    max_blocks: int = 0,
) -> None:
    tensors = {"table": table, "ids": ids, "output": output}
    if scale is not None:
        tensors["scale"] = scale
    if block_scales is not None:
        tensors["block_scales"] = block_scales
    _check_same_device("gather_rows", **tensors)
    torch._check(ids.dim() == 2, lambda: "gather_rows: ids must be 2-D [T, NH]")
    torch._check(
        ids.dtype in (torch.int32, torch.int64), lambda: "gather_rows: ids must be int32 or int64"
    )
    _check_gather_table_fake(
        "gather_rows",
        table,
        scale,
        block_scales,
        vocab_start,
        vocab_end,
        output,
        max_blocks,
        ids.shape[0],
        ids.shape[1],
    )
    return None


def _ngram_gather_rows_fake(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    layer_multipliers: torch.Tensor,
    ngram_heads_vocab_sizes: torch.Tensor,
    ngram_heads_offsets: torch.Tensor,
    eos_token_id: int,
    heads_per_ngram: int,
    head_divmod: torch.Tensor | None,
    table: torch.Tensor,
    scale: torch.Tensor | None,
    block_scales: torch.Tensor | None,
    vocab_start: int,
    vocab_end: int | None,
    output: torch.Tensor,
    max_blocks: int = 0,
) -> None:
    optional = {
        name: t
        for name, t in (
            ("head_divmod", head_divmod),
            ("scale", scale),
            ("block_scales", block_scales),
        )
        if t is not None
    }
    _check_same_device(
        "ngram_gather_rows",
        input_ids=input_ids,
        query_start_loc=query_start_loc,
        ngram_context=ngram_context,
        layer_multipliers=layer_multipliers,
        ngram_heads_vocab_sizes=ngram_heads_vocab_sizes,
        ngram_heads_offsets=ngram_heads_offsets,
        table=table,
        output=output,
        **optional,
    )
    torch._check(input_ids.dim() == 1, lambda: "ngram_gather_rows: input_ids must be 1-D")
    num_heads = ngram_context.shape[1] * heads_per_ngram
    if head_divmod is not None:
        torch._check(
            head_divmod.dtype == torch.int64 and head_divmod.shape == (num_heads, 4),
            lambda: "ngram_gather_rows: head_divmod must be int64 [NH, 4]",
        )
    _check_gather_table_fake(
        "ngram_gather_rows",
        table,
        scale,
        block_scales,
        vocab_start,
        vocab_end,
        output,
        max_blocks,
        input_ids.shape[0],
        num_heads,
    )
    return None


def _ple_gate_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_w: torch.Tensor,
    norm_query_w: torch.Tensor,
    norm_conv_w: torch.Tensor,
    eps: float,
    rounding: str = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_same_device(
        "ple_gate",
        hidden=hidden,
        key=key,
        value=value,
        norm_key_w=norm_key_w,
        norm_query_w=norm_query_w,
        norm_conv_w=norm_conv_w,
    )
    torch._check(rounding in ("vllm", "fp32"), lambda: "ple_gate: rounding must be vllm or fp32")
    torch._check(hidden.dim() == 2, lambda: "ple_gate: hidden must be 2-D [T, C]")
    torch._check(hidden.dtype in _PLE_DTYPES, lambda: "ple_gate: unsupported dtype")
    torch._check(
        key.dtype == hidden.dtype and value.dtype == hidden.dtype,
        lambda: "ple_gate: key, value and hidden must share a dtype",
    )
    torch._check(key.shape == hidden.shape, lambda: "ple_gate: key must be [T, C]")
    torch._check(
        value.dim() == 2 and value.shape[0] == hidden.shape[0],
        lambda: "ple_gate: value must be [T, H]",
    )
    torch._check(
        hidden.shape[1] % value.shape[1] == 0, lambda: "ple_gate: C must be a multiple of H"
    )
    return hidden.new_empty(hidden.shape), hidden.new_empty(hidden.shape)


def _ple_gate_out_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_w: torch.Tensor,
    norm_query_w: torch.Tensor,
    norm_conv_w: torch.Tensor,
    eps: float,
    rounding: str = "vllm",
    *,
    gated: torch.Tensor,
    conv_input: torch.Tensor,
) -> None:
    _ple_gate_fake(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps, rounding)
    _check_same_device("ple_gate", hidden=hidden, gated=gated, conv_input=conv_input)
    for name, t in (("gated", gated), ("conv_input", conv_input)):
        torch._check(
            t.shape == hidden.shape and t.dtype == hidden.dtype,
            lambda name=name: f"ple_gate: {name} must be [T, C] in hidden's dtype",
        )
    return None


def _ple_conv_fake(
    inputs: torch.Tensor,
    residual: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weights: torch.Tensor,
    state_indices: torch.Tensor,
    outer_residual: torch.Tensor | None,
    *,
    conv_mode: str,
    dilation: int,
    query_start_loc: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    has_initial_states: torch.Tensor | None = None,
    spec_query_len: int = 1,
    token_indices: torch.Tensor | None = None,
) -> None:
    optional = {
        "outer_residual": outer_residual,
        "query_start_loc": query_start_loc,
        "num_accepted_tokens": num_accepted_tokens,
        "has_initial_states": has_initial_states,
        "token_indices": token_indices,
    }
    _check_same_device(
        "ple_conv",
        inputs=inputs,
        residual=residual,
        conv_state=conv_state,
        conv_weights=conv_weights,
        state_indices=state_indices,
        **{name: t for name, t in optional.items() if t is not None},
    )
    torch._check(
        conv_mode in CONV_MODES,
        lambda: "ple_conv: mode must be decode, prefill or spec",
    )
    torch._check(inputs.dim() == 2, lambda: "ple_conv: inputs must be 2-D [T, C]")
    torch._check(residual.shape == inputs.shape, lambda: "ple_conv: residual must match inputs")
    torch._check(conv_state.dim() == 3, lambda: "ple_conv: conv_state must be [slots, C, W]")
    torch._check(
        conv_weights.dim() == 2 and conv_weights.shape[0] == inputs.shape[1],
        lambda: "ple_conv: conv_weights must be [C, K]",
    )
    return None


# ---- hyper-connections (issue #50): the shape rules of csrc/torch/args/hc_*_args.h -------------


def _hc_rows(op: str, first: str, x: torch.Tensor, **others: torch.Tensor) -> None:
    _check_same_device(op, **{first: x}, **others)
    torch._check(x.dim() == 2, lambda: f"{op}: {first} must be 2-D")
    torch._check(x.dtype in _PLE_DTYPES, lambda: f"{op}: unsupported dtype {x.dtype}")
    for name, t in others.items():
        torch._check(t.dim() == 2, lambda name=name: f"{op}: {name} must be 2-D")
        torch._check(
            t.dtype == x.dtype, lambda name=name: f"{op}: {name} must have {first}'s dtype"
        )


def _hc_width(op: str, columns: int, count: int, count_name: str) -> int:
    torch._check(count >= 1, lambda: f"{op}: {count_name} must be >= 1")
    torch._check(
        columns > 0 and columns % count == 0,
        lambda: f"{op}: the last dim must be a positive multiple of {count_name}",
    )
    return columns // count


def _hc_combine_shapes(op, residual, block_output, injection_logits, hc_count) -> int:
    logits = {} if injection_logits is None else {"injection_logits": injection_logits}
    _hc_rows(op, "residual", residual, block_output=block_output, **logits)
    width = _hc_width(op, residual.shape[1], hc_count, "hc_count")
    torch._check(
        block_output.shape == (residual.shape[0], width),
        lambda: f"{op}: block_output must be [T, H]",
    )
    torch._check(
        injection_logits is None or injection_logits.shape == (residual.shape[0], hc_count),
        lambda: f"{op}: injection_logits must be [T, hc_count]",
    )
    return width


def _hc_out(op: str, name: str, out: torch.Tensor, shape, like: torch.Tensor, like_name: str):
    _check_same_device(op, **{like_name: like, name: out})
    torch._check(
        tuple(out.shape) == tuple(shape) and out.dtype == like.dtype,
        lambda: f"{op}: {name} must be {list(shape)} in the inputs' dtype",
    )


def _hc_combine_norm_fake(residual, block_output, injection_logits, norm_weight, eps, hc_count):
    width = _hc_combine_shapes(
        "hc_combine_norm", residual, block_output, injection_logits, hc_count
    )
    _check_same_device("hc_combine_norm", residual=residual, norm_weight=norm_weight)
    torch._check(
        norm_weight.dim() == 1 and norm_weight.shape[0] in (width, width * hc_count),
        lambda: "hc_combine_norm: norm_weight must be [H] or [HC·H]",
    )
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def _hc_combine_norm_out_fake(
    residual, block_output, injection_logits, norm_weight, eps, hc_count, *, h, xn
):
    _hc_combine_norm_fake(residual, block_output, injection_logits, norm_weight, eps, hc_count)
    _hc_out("hc_combine_norm", "h", h, residual.shape, residual, "residual")
    _hc_out("hc_combine_norm", "xn", xn, residual.shape, residual, "residual")


def _hc_combine_fake(residual, block_output, injection_logits, hc_count):
    _hc_combine_shapes("hc_combine", residual, block_output, injection_logits, hc_count)
    return residual.new_empty(residual.shape)


def _hc_combine_out_fake(residual, block_output, injection_logits, hc_count, *, out):
    _hc_combine_fake(residual, block_output, injection_logits, hc_count)
    _hc_out("hc_combine", "out", out, residual.shape, residual, "residual")


def _grouped_gemma_rmsnorm_fake(x, weight, eps, num_groups):
    op = "grouped_gemma_rmsnorm"
    _hc_rows(op, "x", x)
    _check_same_device(op, x=x, weight=weight)
    width = _hc_width(op, x.shape[1], num_groups, "num_groups")
    torch._check(
        weight.dim() == 1 and weight.shape[0] in (width, width * num_groups),
        lambda: f"{op}: weight must be [D / num_groups] or [D]",
    )
    return x.new_empty(x.shape)


def _grouped_gemma_rmsnorm_out_fake(x, weight, eps, num_groups, *, out):
    _grouped_gemma_rmsnorm_fake(x, weight, eps, num_groups)
    _hc_out("grouped_gemma_rmsnorm", "out", out, x.shape, x, "x")


def _hc_gate_mix_fake(x, gate, hc_count):
    _hc_rows("hc_gate_mix", "x", x, gate=gate)
    torch._check(gate.shape == x.shape, lambda: "hc_gate_mix: gate must have x's shape")
    width = _hc_width("hc_gate_mix", x.shape[1], hc_count, "hc_count")
    return x.new_empty((x.shape[0], width))


def _hc_gate_mix_out_fake(x, gate, hc_count, *, out):
    width = _hc_gate_mix_fake(x, gate, hc_count).shape[1]
    _hc_out("hc_gate_mix", "out", out, (x.shape[0], width), x, "x")


def _hc_silu_fake(x, hc_count):
    _hc_rows("hc_silu", "x", x)
    torch._check(hc_count >= 1, lambda: "hc_silu: hc_count must be >= 1")
    return x.new_empty(x.shape)


def _hc_silu_out_fake(x, hc_count, *, out):
    _hc_silu_fake(x, hc_count)
    _hc_out("hc_silu", "out", out, x.shape, x, "x")


def _hc_up_gate_mix_fake(lowrank, w_up, xn, hc_count):
    op = "hc_up_gate_mix"
    _hc_rows(op, "lowrank", lowrank, w_up=w_up, xn=xn)
    width = _hc_width(op, xn.shape[1], hc_count, "hc_count")
    torch._check(xn.shape[0] == lowrank.shape[0], lambda: f"{op}: xn must have lowrank's rows")
    torch._check(
        w_up.shape == (xn.shape[1], lowrank.shape[1]) and lowrank.shape[1] > 0,
        lambda: f"{op}: w_up must be [HC·H, R]",
    )
    return lowrank.new_empty((lowrank.shape[0], width))


def _hc_up_gate_mix_out_fake(lowrank, w_up, xn, hc_count, *, out):
    width = _hc_up_gate_mix_fake(lowrank, w_up, xn, hc_count).shape[1]
    _hc_out("hc_up_gate_mix", "out", out, (lowrank.shape[0], width), lowrank, "lowrank")


def _hc_down_silu_inject_fake(xn, w_down, w_inj, hc_count):
    op = "hc_down_silu_inject"
    inject = {} if w_inj is None else {"w_inj": w_inj}
    _hc_rows(op, "xn", xn, w_down=w_down, **inject)
    _hc_width(op, xn.shape[1], hc_count, "hc_count")
    torch._check(
        w_down.shape[1] == xn.shape[1] and w_down.shape[0] > 0,
        lambda: f"{op}: w_down must be [R, HC·H]",
    )
    torch._check(
        w_inj is None or w_inj.shape == (hc_count, xn.shape[1]),
        lambda: f"{op}: w_inj must be [hc_count, HC·H]",
    )
    logits = 0 if w_inj is None else hc_count
    return xn.new_empty((xn.shape[0], w_down.shape[0])), xn.new_empty((xn.shape[0], logits))


def _hc_down_silu_inject_out_fake(xn, w_down, w_inj, hc_count, *, lowrank, logits):
    op = "hc_down_silu_inject"
    expected, _ = _hc_down_silu_inject_fake(xn, w_down, w_inj, hc_count)
    torch._check(
        (logits is None) == (w_inj is None),
        lambda: f"{op}: logits must be given exactly when w_inj is",
    )
    _hc_out(op, "lowrank", lowrank, expected.shape, xn, "xn")
    if logits is not None:
        _hc_out(op, "logits", logits, (xn.shape[0], hc_count), xn, "xn")


_KERNEL_FAKES = {
    "ngram_ids": _ngram_ids_fake,
    "gather_rows": _gather_rows_fake,
    "ngram_gather_rows": _ngram_gather_rows_fake,
    "ple_gate": _ple_gate_fake,
    "ple_gate_out": _ple_gate_out_fake,
    "ple_conv": _ple_conv_fake,
    "hc_combine_norm": _hc_combine_norm_fake,
    "hc_combine_norm_out": _hc_combine_norm_out_fake,
    "hc_combine": _hc_combine_fake,
    "hc_combine_out": _hc_combine_out_fake,
    "grouped_gemma_rmsnorm": _grouped_gemma_rmsnorm_fake,
    "grouped_gemma_rmsnorm_out": _grouped_gemma_rmsnorm_out_fake,
    "hc_gate_mix": _hc_gate_mix_fake,
    "hc_gate_mix_out": _hc_gate_mix_out_fake,
    "hc_silu": _hc_silu_fake,
    "hc_silu_out": _hc_silu_out_fake,
    "hc_up_gate_mix": _hc_up_gate_mix_fake,
    "hc_up_gate_mix_out": _hc_up_gate_mix_out_fake,
    "hc_down_silu_inject": _hc_down_silu_inject_fake,
    "hc_down_silu_inject_out": _hc_down_silu_inject_out_fake,
}
_faked: set[str] = set()


def register_kernel_fakes(namespace: str) -> None:
    """The same fakes for every library of the kernel ops, once per library."""
    if namespace in _faked:
        return
    for name, fake in _KERNEL_FAKES.items():
        torch.library.register_fake(f"{namespace}::{name}", fake)
    _faked.add(namespace)


def _read_file_rows_fake(
    fd: int,
    ids: torch.Tensor,
    data_offset: int,
    row_bytes: int,
    vocab_start: int,
    vocab_end: int,
    output: torch.Tensor,
    io_threads: int,
    path: str,
) -> None:
    torch._check(
        ids.dtype in (torch.int32, torch.int64),
        lambda: f"read_file_rows: ids must be int32 or int64, got {ids.dtype}",
    )
    torch._check(row_bytes > 0, lambda: "read_file_rows: row_bytes must be positive")
    torch._check(data_offset >= 0, lambda: "read_file_rows: data_offset must be >= 0")
    torch._check(
        0 <= vocab_start <= vocab_end,
        lambda: "read_file_rows: [vocab_start, vocab_end) must satisfy 0 <= start <= end",
    )
    torch._check(
        output.dtype == torch.uint8,
        lambda: f"read_file_rows: output must be uint8, got {output.dtype}",
    )
    torch._check(
        output.dim() == 2 and output.shape[0] == ids.numel() and output.shape[1] == row_bytes,
        lambda: "read_file_rows: output must be [ids.numel(), row_bytes]",
    )
    return None


torch.library.register_fake("qwen4exp::ngram_head_divmod", _ngram_head_divmod_fake)
torch.library.register_fake("qwen4exp::read_file_rows", _read_file_rows_fake)
