"""The only Python door to the compiled kernels (``torch.ops.qwen4exp.*``).

Each public function here has the signature users (and vLLM) call; each op also has a fake
implementation, so the ops trace under torch.compile and capture in CUDA graphs.
"""

from __future__ import annotations

import torch

__all__ = ["ngram_ids"]

# Resolved once: looking an overload up through torch.ops costs a few microseconds per call, which
# is a visible share of a decode step's hashing.
_ngram_ids_op = torch.ops.qwen4exp.ngram_ids.default


def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    first_name, first = next(iter(tensors.items()))
    for name, tensor in tensors.items():
        if tensor.device != first.device:
            raise RuntimeError(
                f"{op}: {name} is on {tensor.device} but {first_name} is on {first.device}"
            )


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
) -> torch.Tensor:
    """Hashed n-gram row ids, SPEC.md §3 (same signature and result as vLLM's ``ple_ngram_ids``).

    input_ids [T] (int32/int64, any shape is flattened), query_start_loc [R+1], ngram_context
    [R, N-1] (the N-1 tokens before each request's chunk, oldest first), layer_multipliers [N],
    ngram_heads_vocab_sizes and ngram_heads_offsets [NH] int64 with NH = (N-1)·heads_per_ngram.
    Returns ``output`` ([T, NH], int64 unless an int32 ``output`` is passed).
    """
    if input_ids.dim() != 1:
        input_ids = input_ids.reshape(-1)
    if output is None:
        output = torch.empty(
            (input_ids.numel(), ngram_context.shape[-1] * heads_per_ngram),
            dtype=torch.int64,
            device=input_ids.device,
        )
    _ngram_ids_op(
        input_ids,
        query_start_loc,
        ngram_context,
        layer_multipliers,
        ngram_heads_vocab_sizes,
        ngram_heads_offsets,
        int(eos_token_id),
        int(heads_per_ngram),
        output,
    )
    return output


@torch.library.register_fake("qwen4exp::ngram_ids")
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
) -> None:
    # The op only writes into `output`; the shape rules are the kernel's own checks, repeated
    # here so that a traced graph fails at trace time, not at run time. The device check matters
    # here too: a meta tensor among CPU ones routes the call to this function, not the kernel.
    _check_same_device(
        "ngram_ids",
        input_ids=input_ids,
        query_start_loc=query_start_loc,
        ngram_context=ngram_context,
        layer_multipliers=layer_multipliers,
        ngram_heads_vocab_sizes=ngram_heads_vocab_sizes,
        ngram_heads_offsets=ngram_heads_offsets,
        output=output,
    )
    torch._check(input_ids.dim() == 1, lambda: "ngram_ids: input_ids must be 1-D")
    torch._check(
        output.shape == (input_ids.shape[0], ngram_context.shape[1] * heads_per_ngram),
        lambda: "ngram_ids: output must be [T, NH]",
    )
    return None


# ---- gather_rows (SPEC §4) -------------------------------------------------------------------

__all__ += ["gather_rows"]

_gather_rows_op = torch.ops.qwen4exp.gather_rows.default
_FP8_TABLE_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_GATHER_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gather_rows(
    table: torch.Tensor,
    ids: torch.Tensor,
    *,
    scale: torch.Tensor | float | None = None,
    vocab_start: int = 0,
    vocab_end: int | None = None,
    out_dtype: torch.dtype | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Embedding rows of every head of every token, concatenated — SPEC.md §4.

    ``table`` [rows, d] in fp32/bf16/fp16/float8_e4m3fn/float8_e4m3fnuz (rows contiguous; fp8
    needs the per-tensor fp32 ``scale``, best passed as a 1-element tensor on the table's device),
    ``ids`` [..., NH] int32/int64 → [..., NH·d] in ``out_dtype`` (default: the table's dtype, bf16
    for fp8; or ``output``'s dtype). This table owns global ids [vocab_start, vocab_end) (default
    vocab_start + rows) and reads table[id - vocab_start] for them; every other id gives a zero
    row, so no id value ever reads out of bounds. A CUDA/ROCm ``table`` may be the GPU view of
    pinned host memory (:func:`qwen4exp_ext.host_table.device_view`): read zero-copy over PCIe.
    """
    if table.dim() != 2:
        raise ValueError(f"gather_rows: table must be 2-D [rows, d], got shape {tuple(table.shape)}")
    if ids.dim() < 1:
        raise ValueError("gather_rows: ids must be [..., NH], got a 0-d tensor")
    rows, width = table.shape
    num_heads = ids.shape[-1]
    if out_dtype is None:
        if output is not None:
            out_dtype = output.dtype
        else:
            out_dtype = torch.bfloat16 if table.dtype in _FP8_TABLE_DTYPES else table.dtype
    elif output is not None and output.dtype != out_dtype:
        raise ValueError(f"gather_rows: output is {output.dtype} but out_dtype is {out_dtype}")
    if vocab_end is None:
        vocab_end = vocab_start + rows
    if scale is not None and not isinstance(scale, torch.Tensor):
        scale = torch.tensor([float(scale)], dtype=torch.float32, device=table.device)
    ids2 = ids if ids.dim() == 2 else ids.reshape(-1, num_heads)
    out_shape = (*ids.shape[:-1], num_heads * width)
    if output is None:
        output = torch.empty(out_shape, dtype=out_dtype, device=table.device)
    elif tuple(output.shape) != out_shape:
        raise ValueError(
            f"gather_rows: output must be {list(out_shape)} = [..., NH·d], got "
            f"{list(output.shape)}"
        )
    out2 = output if output.dim() == 2 else output.view(-1, num_heads * width)
    _gather_rows_op(table, ids2, scale, int(vocab_start), int(vocab_end), out2)
    return output


@torch.library.register_fake("qwen4exp::gather_rows")
def _gather_rows_fake(
    table: torch.Tensor,
    ids: torch.Tensor,
    scale: torch.Tensor | None,
    vocab_start: int,
    vocab_end: int,
    output: torch.Tensor,
) -> None:
    tensors = {"table": table, "ids": ids, "output": output}
    if scale is not None:
        tensors["scale"] = scale
    _check_same_device("gather_rows", **tensors)
    torch._check(table.dim() == 2, lambda: "gather_rows: table must be 2-D [rows, d]")
    torch._check(ids.dim() == 2, lambda: "gather_rows: ids must be 2-D [T, NH]")
    torch._check(
        ids.dtype in (torch.int32, torch.int64), lambda: "gather_rows: ids must be int32 or int64"
    )
    torch._check(
        output.shape == (ids.shape[0], ids.shape[1] * table.shape[1]),
        lambda: "gather_rows: output must be [T, NH·d]",
    )
    torch._check(
        output.dtype in _GATHER_OUT_DTYPES,
        lambda: "gather_rows: output must be float32, bfloat16 or float16",
    )
    torch._check(
        (scale is not None) == (table.dtype in _FP8_TABLE_DTYPES),
        lambda: "gather_rows: fp8 tables need a scale, other tables take none",
    )
    torch._check(
        0 <= vocab_start <= vocab_end and vocab_end - vocab_start <= table.shape[0],
        lambda: "gather_rows: shard [vocab_start, vocab_end) does not fit the table",
    )
    return None
