"""What the vLLM plugin swaps: one row per vLLM function or method, and the replacements.

Every replacement has vLLM 0.33.0's exact signature and result, and calls
:mod:`qwen4exp_ext.ops`. Where our build has no kernel for a tensor's device (a CPU-only build in
a GPU process), or a storage format our kernel does not copy bit for bit (fp8 rows, which vLLM
moves as raw bytes), it calls vLLM's own function instead, so vLLM never breaks because of us.

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import build_info, ops

# The vLLM module whose functions are swapped; every other vLLM module imports them from here.
PLE_OPS_MODULE = "vllm.models.qwen4_exp.common.ops.ple"
# The vLLM module whose lookup methods are swapped (shared by the AMD and NVIDIA paths).
EMBEDDING_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
# vLLM registers torch.ops.vllm.qwen4_exp_ple_gate here with its own function object.
AMD_LAYER_MODULE = "vllm.models.qwen4_exp.amd.ple_layer"
# Modules whose globals may hold a copy of a swapped function (`from ..ops.ple import x`).
CONSUMER_PREFIX = "vllm.models.qwen4_exp."

# Marks a replacement, so that a second register() recognises its own work.
MARK = "__qwen4exp_replaces__"

# Row formats that our gather copies exactly (out dtype == table dtype).
_EXACT_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _supported_device_types() -> frozenset[str]:
    """Device types our compiled kernels serve: CPU always, plus the GPU (ROCm tensors are
    "cuda" tensors to torch) when the binary was built with a GPU backend."""
    backends = set(build_info()["backends"])
    return frozenset({"cpu"} | ({"cuda"} if backends & {"cuda", "rocm"} else set()))


DEVICE_TYPES = _supported_device_types()


def signature_text(fn: Callable[..., Any]) -> str:
    """A signature as parameter names, kinds and defaults only (annotations vary by style)."""
    parts: list[str] = []
    star_done = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(parts) + ")"


# ---- replacements ---------------------------------------------------------------------------


def _make_ple_ngram_ids(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def ple_ngram_ids(
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
        fn = ops.ngram_ids if input_ids.device.type in DEVICE_TYPES else original
        return fn(
            input_ids,
            query_start_loc,
            ngram_context,
            layer_multipliers,
            ngram_heads_vocab_sizes,
            ngram_heads_offsets,
            eos_token_id,
            heads_per_ngram,
            output,
        )

    return ple_ngram_ids


def _make_ple_gate(
    original: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    # The parameter names are vLLM's: torch.ops.vllm.qwen4_exp_ple_gate's schema was inferred
    # from them, and this function becomes that op's kernel.
    def ple_gate(
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor,
        norm_key_w: torch.Tensor,
        norm_query_w: torch.Tensor,
        norm_conv_w: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fn = ops.ple_gate if hidden.device.type in DEVICE_TYPES else original
        return fn(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps)

    return ple_gate


def _make_ple_conv(original: Callable[..., None]) -> Callable[..., None]:
    def ple_conv(
        inputs: torch.Tensor,
        residual: torch.Tensor,
        conv_state: torch.Tensor,
        conv_weights: torch.Tensor,
        state_indices: torch.Tensor,
        outer_residual: torch.Tensor | None,
        *,
        mode: str,
        dilation: int,
        query_start_loc: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        has_initial_states: torch.Tensor | None = None,
        spec_query_len: int = 1,
        token_indices: torch.Tensor | None = None,
    ) -> None:
        fn = ops.ple_conv if inputs.device.type in DEVICE_TYPES else original
        return fn(
            inputs,
            residual,
            conv_state,
            conv_weights,
            state_indices,
            outer_residual,
            mode=mode,
            dilation=dilation,
            query_start_loc=query_start_loc,
            num_accepted_tokens=num_accepted_tokens,
            has_initial_states=has_initial_states,
            spec_query_len=spec_query_len,
            token_indices=token_indices,
        )

    return ple_conv


def _make_embedding(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Qwen4ExpPLEEmbeddingMethod.embedding`: rows of the device-resident table (ids already
    made local to this rank's vocabulary shard by vLLM)."""

    def embedding(self: Any, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        if (
            weight.dtype not in _EXACT_TABLE_DTYPES
            or input_.device.type not in DEVICE_TYPES
            or weight.device != input_.device
        ):
            return original(self, layer, input_)
        rows = ops.gather_rows(weight, input_)
        return rows.view(*input_.shape, weight.shape[1])

    return embedding


def _make_lookup_from_pinned(original: Callable[..., None]) -> Callable[..., None]:
    """`Qwen4ExpPLEEmbeddingMethod.lookup_from_pinned`: this rank's rows of the pinned host table,
    read by the GPU through its UVA view; rows another rank owns are zero."""

    def lookup_from_pinned(
        self: Any, layer: torch.nn.Module, ids: torch.Tensor, output: torch.Tensor
    ) -> None:
        table = layer._uva_weight
        if (
            table.dtype not in _EXACT_TABLE_DTYPES
            or output.dtype != table.dtype
            or ids.device.type not in DEVICE_TYPES
            or not output.is_contiguous()
        ):
            return original(self, layer, ids, output)
        shard = layer.shard_indices
        ops.gather_rows(
            table,
            ids.reshape(-1, 1),
            vocab_start=shard.org_vocab_start_index,
            vocab_end=shard.org_vocab_end_index,
            output=output.view(-1, table.shape[1]),
        )
        return None

    return lookup_from_pinned


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Swap:
    """One vLLM callable that runs our kernel after register().

    ``owner`` is a module (for a function) or ``module:Class`` (for a method); ``signature`` is
    vLLM 0.33.0's, as :func:`signature_text` writes it; ``needs`` is the :mod:`qwen4exp_ext.ops`
    function the replacement calls (the row is skipped while our build lacks it);
    ``torch_op`` names the ``torch.ops.vllm`` op that vLLM registered with this very function
    object, and ``torch_op_module`` the module that registers it.
    """

    owner: str
    name: str
    needs: str
    signature: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    torch_op: str | None = None
    torch_op_module: str | None = None

    @property
    def label(self) -> str:
        cls = self.owner.partition(":")[2]
        return f"{cls}.{self.name}" if cls else self.name


SWAPS: tuple[Swap, ...] = (
    Swap(
        PLE_OPS_MODULE,
        "ple_ngram_ids",
        "ngram_ids",
        "(input_ids, query_start_loc, ngram_context, layer_multipliers, ngram_heads_vocab_sizes,"
        " ngram_heads_offsets, eos_token_id, heads_per_ngram, output=None)",
        _make_ple_ngram_ids,
    ),
    Swap(
        PLE_OPS_MODULE,
        "ple_gate",
        "ple_gate",
        "(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps)",
        _make_ple_gate,
        torch_op="qwen4_exp_ple_gate",
        torch_op_module=AMD_LAYER_MODULE,
    ),
    Swap(
        PLE_OPS_MODULE,
        "ple_conv",
        "ple_conv",
        "(inputs, residual, conv_state, conv_weights, state_indices, outer_residual, *, mode,"
        " dilation, query_start_loc=None, num_accepted_tokens=None, has_initial_states=None,"
        " spec_query_len=1, token_indices=None)",
        _make_ple_conv,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEEmbeddingMethod",
        "embedding",
        "gather_rows",
        "(self, layer, input_)",
        _make_embedding,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEEmbeddingMethod",
        "lookup_from_pinned",
        "gather_rows",
        "(self, layer, ids, output)",
        _make_lookup_from_pinned,
    ),
)
