"""The shims of vLLM's PLE table lookups: the device table (``embedding``), the pinned host
table (``lookup_from_pinned``), of the unquantized, FP8 and NVFP4 methods, the FP8 method's
``lookup_dtype`` and ``dequantize``, and the pinned and device tables' allocations.

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ... import ops
from .. import choice, table_dir
from ..choice import OURS, token_bucket
from .base import DEVICE_TYPES, DISK_OFFLOAD_EMBEDDING, MARK, NVIDIA_EMBEDDING_MODULE

# Row formats that our gather copies exactly (out dtype == table dtype).
_EXACT_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What vLLM's Qwen4ExpPLEFp8EmbeddingMethod allocates (on every platform).
_FP8_TABLE_DTYPE = torch.float8_e4m3fn


def _kernel_table(layer: Any) -> torch.Tensor:
    """The table our gather reads for a vLLM PLE embedding: the GPU (UVA) view of a pinned host
    table, else the weight itself."""
    uva = getattr(layer, "_uva_weight", None)
    return uva if uva is not None else layer.weight


def _staged_by_vllm(layer: Any) -> bool:
    """Whether ``layer`` is vLLM 0.34's disk-offloaded table, whose rows vLLM stages itself
    (raw, from the checkpoint files) without calling a lookup of ours."""
    nvidia = sys.modules.get(NVIDIA_EMBEDDING_MODULE)
    cls = getattr(nvidia, DISK_OFFLOAD_EMBEDDING, None)
    return isinstance(cls, type) and isinstance(layer, cls)


def _fp8_fused(layer: Any) -> bool:
    """Whether our gather looks up *and dequantises* this FP8 table: its rows and its scale where
    our kernels run. The lookups, ``lookup_dtype`` and ``dequantize`` all ask this one question
    of the same layer, so a row is scaled exactly once, by us or by vLLM. Never for a table whose
    rows vLLM stages itself (0.34's disk offload): its raw rows reach ``dequantize``."""
    weight = getattr(layer, "weight", None)
    scale = getattr(layer, "weight_scale", None)
    if weight is None or scale is None or weight.dtype != _FP8_TABLE_DTYPE:
        return False
    if _staged_by_vllm(layer):
        return False
    table = _kernel_table(layer)
    return (
        table.device.type in DEVICE_TYPES
        and scale.device == table.device
        and scale.dtype == torch.float32
        and scale.numel() == 1
    )


def _make_embedding(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Qwen4ExpPLEEmbeddingMethod.embedding` (the unquantized and FP8 methods): rows of the
    device-resident table (ids already made local to this rank's vocabulary shard by vLLM); FP8
    rows come out dequantised, in the layer's activation dtype."""

    def ours(self: Any, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        if _fp8_fused(layer):
            rows = ops.gather_rows(
                weight,
                input_.to(weight.device),
                scale=layer.weight_scale,
                out_dtype=layer.params_dtype,
            )
        else:
            rows = ops.gather_rows(weight, input_)
        return rows.view(*input_.shape, weight.shape[1])

    def vllms(self: Any, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        rows = original(self, layer, input_)
        return _vllm_fp8_dequantize(self, layer, rows) if _fp8_fused(layer) else rows

    def embedding(self: Any, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        if not _fp8_fused(layer) and (
            weight.dtype not in _EXACT_TABLE_DTYPES
            or input_.device.type not in DEVICE_TYPES
            or weight.device != input_.device
        ):
            return original(self, layer, input_)
        args = (self, layer, input_)
        which = _choose_lookup("embedding", layer, weight, input_.numel(), args, ours, vllms)
        return (ours if which == OURS else vllms)(*args)

    return embedding


def _lookup_class(layer: Any, table: torch.Tensor, ids: int) -> tuple:
    """A table lookup's class: the table format (its dtype, and the rows' dtype for a
    dequantising lookup), the row width, the bucket of the number of ids."""
    out_dtype = getattr(layer, "params_dtype", table.dtype)
    return (
        table.dtype,
        out_dtype,
        getattr(layer, "embedding_dim", table.shape[-1]),
        token_bucket(ids),
    )


def _choose_lookup(
    op: str,
    layer: Any,
    table: torch.Tensor,
    ids: int,
    args: tuple,
    ours: Callable[..., Any],
    vllms: Callable[..., Any],
) -> str:
    """The kernel of one table lookup (``args`` = the method's arguments; a lookup into
    ``output`` is timed into fresh outputs)."""
    cls = _lookup_class(layer, table, ids)
    which = choice.choose(op, cls, table.device)
    if which is None:

        def setup() -> tuple:
            if len(args) == 4:  # (self, layer, ids, output)
                return (*args[:3], torch.empty_like(args[3]))
            return args

        which = choice.decide(op, cls, table.device, setup, lambda a: ours(*a), lambda a: vllms(*a))
    return which


def _vllm_fp8_dequantize(method: Any, layer: Any, rows: torch.Tensor) -> torch.Tensor:
    """vLLM's own FP8 ``dequantize`` of raw fp8 rows to the activation dtype (what vLLM runs
    after its lookup; the plugin's ``dequantize`` only casts rows of a fused layer)."""
    fn = type(method).dequantize
    fn = getattr(fn, MARK, fn)
    return fn(method, layer, rows, layer.params_dtype)


# The grid cap of the gathers launched by this thread now (0: none): set around the step-entry
# lookups, which run beside the model's compute (prefetch.py).
_grid_cap = threading.local()


def _gather_into(output: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, **kwargs) -> None:
    """One row per id into ``output`` [..., d] (any layout with contiguous rows is written in
    place; other layouts through a temporary)."""
    max_blocks = getattr(_grid_cap, "max_blocks", 0)
    if max_blocks:
        kwargs["max_blocks"] = max_blocks
    width = output.shape[-1]
    if output.is_contiguous():
        ops.gather_rows(table, ids.reshape(-1, 1), output=output.view(-1, width), **kwargs)
    else:
        rows = ops.gather_rows(table, ids.reshape(-1, 1), out_dtype=output.dtype, **kwargs)
        output.copy_(rows.view(output.shape))


def _make_lookup_from_pinned(original: Callable[..., None]) -> Callable[..., None]:
    """`Qwen4ExpPLEEmbeddingMethod.lookup_from_pinned` (unquantized and FP8): this rank's rows of
    the pinned host table, read by the GPU through its UVA view; rows another rank owns are zero.
    FP8 rows come out dequantised (``lookup_dtype`` says so)."""

    def ours(self: Any, layer: torch.nn.Module, ids: torch.Tensor, output: torch.Tensor) -> None:
        table = layer._uva_weight
        shard = layer.shard_indices
        bounds = dict(vocab_start=shard.org_vocab_start_index, vocab_end=shard.org_vocab_end_index)
        if _fp8_fused(layer):
            _gather_into(output, table, ids.to(table.device), scale=layer.weight_scale, **bounds)
        else:
            _gather_into(output, table, ids, **bounds)

    def vllms(self: Any, layer: torch.nn.Module, ids: torch.Tensor, output: torch.Tensor) -> None:
        if not _fp8_fused(layer):
            return original(self, layer, ids, output)
        raw = torch.empty(output.shape, dtype=layer.weight.dtype, device=output.device)
        original(self, layer, ids.to(output.device), raw)
        output.copy_(_vllm_fp8_dequantize(self, layer, raw))
        return None

    def lookup_from_pinned(
        self: Any, layer: torch.nn.Module, ids: torch.Tensor, output: torch.Tensor
    ) -> None:
        table = layer._uva_weight
        if not _fp8_fused(layer) and (
            table.dtype not in _EXACT_TABLE_DTYPES
            or output.dtype != table.dtype
            or ids.device.type not in DEVICE_TYPES
            or not output.is_contiguous()
        ):
            return original(self, layer, ids, output)
        args = (self, layer, ids, output)
        if getattr(_grid_cap, "max_blocks", 0):  # a step-entry lookup (prefetch.py): ours
            return ours(*args)
        which = _choose_lookup("lookup_from_pinned", layer, table, ids.numel(), args, ours, vllms)
        return (ours if which == OURS else vllms)(*args)

    return lookup_from_pinned


def _make_lookup_dtype(original: Callable[..., torch.dtype]) -> Callable[..., torch.dtype]:
    """`Qwen4ExpPLEEmbeddingMethod.lookup_dtype`: the dtype pinned lookups write, which for a
    fused FP8 table is the activation dtype, not fp8."""

    def lookup_dtype(self: Any, layer: torch.nn.Module) -> torch.dtype:
        return layer.params_dtype if _fp8_fused(layer) else original(self, layer)

    return lookup_dtype


def _make_fp8_dequantize(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Qwen4ExpPLEFp8EmbeddingMethod.dequantize`: rows our gather already dequantised are only
    cast (as vLLM's NVFP4 method does); vLLM's raw-byte rows are dequantised by vLLM. A
    disk-offloaded table's rows are raw (fp8) unless our CPU gather decoded them on the host
    (disk_offload_step.py): their dtype says which."""

    def dequantize(
        self: Any, layer: torch.nn.Module, embeddings: torch.Tensor, output_dtype: torch.dtype
    ) -> torch.Tensor:
        decoded = _staged_by_vllm(layer) and embeddings.dtype != _FP8_TABLE_DTYPE
        if decoded or _fp8_fused(layer):
            return embeddings.to(output_dtype)
        return original(self, layer, embeddings, output_dtype)

    return dequantize


def _nvfp4_unserved(device: torch.device) -> bool:
    """True where our build has no kernel for an NVFP4 table on ``device``. On ROCm that is an
    error (vLLM itself refuses NVFP4 tables there; the plugin lifted the refusal for our
    kernels), elsewhere vLLM's own lookup runs."""
    if device.type in DEVICE_TYPES:
        return False
    if torch.version.hip is not None:
        raise RuntimeError(
            "NVFP4 PLE tables on ROCm run on qwen4exp_ext's kernels, but this build of "
            f"qwen4exp_ext has none for {device} (backends {sorted(DEVICE_TYPES)}); reinstall "
            "it with a ROCm torch: pip install --no-build-isolation qwen4exp_ext"
        )
    return True


def _make_nvfp4_embedding(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Qwen4ExpPLENvFp4EmbeddingMethod.embedding`: NVFP4 rows of the device table, decoded in
    the gather (vLLM: its Triton lookup on a GPU, `dequantize_to_dtype` elsewhere)."""

    def ours(self: Any, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        rows = ops.gather_rows(
            weight,
            input_.reshape(-1, 1).to(weight.device),
            scale=layer.weight_scale_2,
            block_scales=layer.weight_scale,
            out_dtype=layer.params_dtype,
        )
        return rows.view(*input_.shape, layer.embedding_dim)

    def embedding(self: Any, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        if _nvfp4_unserved(weight.device):
            return original(self, layer, input_)
        args = (self, layer, input_)
        if torch.version.hip is not None:  # vLLM refuses NVFP4 tables on ROCm: only ours
            return ours(*args)
        which = _choose_lookup("embedding", layer, weight, input_.numel(), args, ours, original)
        return (ours if which == OURS else original)(*args)

    return embedding


def _make_nvfp4_lookup_from_pinned(original: Callable[..., None]) -> Callable[..., None]:
    """`Qwen4ExpPLENvFp4EmbeddingMethod.lookup_from_pinned`: this rank's NVFP4 rows and block
    scales, both read from pinned host memory through their UVA views."""

    def lookup_from_pinned(
        self: Any, layer: torch.nn.Module, ids: torch.Tensor, output: torch.Tensor
    ) -> None:
        table = layer._uva_weight
        if _nvfp4_unserved(table.device):
            return original(self, layer, ids, output)
        args = (self, layer, ids, output)
        if torch.version.hip is None and not getattr(_grid_cap, "max_blocks", 0):
            which = _choose_lookup(
                "lookup_from_pinned", layer, table, ids.numel(), args, ours, original
            )
            if which != OURS:
                return original(*args)
        return ours(*args)

    def ours(self: Any, layer: torch.nn.Module, ids: torch.Tensor, output: torch.Tensor) -> None:
        table = layer._uva_weight
        shard = layer.shard_indices
        _gather_into(
            output,
            table,
            ids.to(table.device),
            scale=layer.weight_scale_2,
            block_scales=self._uva_weight_scale,
            vocab_start=shard.org_vocab_start_index,
            vocab_end=shard.org_vocab_end_index,
        )
        return None

    return lookup_from_pinned


def _make_allocate_pinned(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight`: the pinned table (and NVFP4
    block scales) allocated at exactly their size (huge pages, prefaulted, NUMA-local to the GPU,
    registered once), not rounded up to a power of two by torch's caching host allocator; under a
    table directory, this rank's rows of the table file (:mod:`..table_dir`)."""

    def allocate_embedding_weight(
        self: Any, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        rows = table_dir.allocate_from_file(self, num_embeddings, embedding_dim, dtype)
        if rows is not None:  # a table directory: the file's rows, mapped and registered
            return rows
        if "cuda" not in DEVICE_TYPES:  # no registration without our GPU glue
            return original(self, num_embeddings, embedding_dim, dtype)
        from ...tables import host_memory

        return host_memory.pinned_host_table(num_embeddings, embedding_dim, dtype)

    return allocate_embedding_weight


def _make_allocate_device(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Qwen4ExpPLEDeviceEmbedding.allocate_embedding_weight`: under a table directory, this
    rank's rows of the table file (:mod:`..table_dir`); where vLLM's ``torch.empty`` lands on the
    CPU (vLLM serving on CPUs), the same uninitialised table on transparent huge pages
    (``host_memory.empty_host_table``, advised before the load fills it), which takes most page
    walks out of our gather (README, "Use with vLLM"). On a GPU, vLLM's allocation."""

    def allocate_embedding_weight(
        self: Any, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        rows = table_dir.allocate_from_file(self, num_embeddings, embedding_dim, dtype)
        if rows is not None:  # a table directory: the file's rows, mapped
            return rows
        weight = original(self, num_embeddings, embedding_dim, dtype)
        if (
            weight.device.type != "cpu"
            or weight.shape != (num_embeddings, embedding_dim)
            or weight.dtype != dtype
        ):
            return weight
        from ...tables import host_memory

        # vLLM's table is untouched (torch.empty): dropping it frees address space only, and
        # first, so that the two are never committed at once (vm.overcommit_memory=2).
        del weight
        return host_memory.empty_host_table(num_embeddings, embedding_dim, dtype)

    return allocate_embedding_weight


def _lookup_rows_capped(
    embedding: Any, flat_ids: torch.Tensor, output: torch.Tensor, max_blocks: int
) -> None:
    """vLLM's ``lookup_from_pinned`` of ``embedding`` (ours, through the plugin), its gather on
    at most ``max_blocks`` blocks."""
    _grid_cap.max_blocks = max_blocks
    try:
        embedding.embedding_method.lookup_from_pinned(embedding, flat_ids, output)
    finally:
        _grid_cap.max_blocks = 0
