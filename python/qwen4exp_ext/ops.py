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
