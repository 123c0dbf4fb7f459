"""What the vLLM plugin swaps: one row per vLLM function or method, and the replacements.

Every replacement has vLLM 0.33.0's exact signature and calls :mod:`qwen4exp_ext.ops`. Where
our build has no kernel for a tensor's device (a CPU-only build in a GPU process), it calls
vLLM's own function instead, so vLLM never breaks because of us.

Table formats: unquantized rows are copied bit for bit. FP8 and NVFP4 rows are dequantised in the
gather itself (vLLM: a byte copy, then an eager dequantisation, for FP8; its Triton lookup for
NVFP4), so they leave the lookup in the activation dtype, before the vocabulary (ETP)
reduction. For NVFP4 that is where vLLM dequantises too, with the same rounding as its GPU
kernel. For FP8 the values are vLLM's (``row.to(out) * scale.to(out)``) but the reduction then
sums activations instead of raw bytes: the bytes of a row owned by another rank are zeros either
way, so the sum is exact, except that a -0 row element comes out +0 (-0 + +0) when the ETP group
has more than one rank, and the all-reduce moves 2 (bf16) instead of 1 byte per element. The
AMD layer's refusal of NVFP4 tables is lifted (our kernels serve them on ROCm), and its loader
takes NVFP4 shards with vLLM's NVIDIA loader. Pinned host tables are allocated by
:func:`qwen4exp_ext.host_table.pinned_host_table`: exactly the table's bytes, where torch's
``pin_memory=True`` rounds each allocation up to a power of two.

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import build_info, ops
from . import choice, prefetch
from .choice import OURS, copy_for_timing, token_bucket

# The vLLM module whose functions are swapped; every other vLLM module imports them from here.
PLE_OPS_MODULE = "vllm.models.qwen4_exp.common.ops.ple"
# The vLLM module whose lookup methods are swapped (shared by the AMD and NVIDIA paths).
EMBEDDING_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
# vLLM registers torch.ops.vllm.qwen4_exp_ple_gate here with its own function object.
AMD_LAYER_MODULE = "vllm.models.qwen4_exp.amd.ple_layer"
# vLLM's AMD model, whose Qwen4ExpModel.__call__ starts a step (prefetch.py).
AMD_MODEL_MODULE = "vllm.models.qwen4_exp.amd.model"
# vLLM's NVIDIA n-gram embedding, whose load_weights knows NVFP4 shards.
NVIDIA_EMBEDDING_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
# Modules whose globals may hold a copy of a swapped function (`from ..ops.ple import x`).
CONSUMER_PREFIX = "vllm.models.qwen4_exp."

# Marks a replacement, so that a second register() recognises its own work.
MARK = "__qwen4exp_replaces__"

# Row formats that our gather copies exactly (out dtype == table dtype).
_EXACT_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What vLLM's Qwen4ExpPLEFp8EmbeddingMethod allocates (on every platform).
_FP8_TABLE_DTYPE = torch.float8_e4m3fn


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


@dataclass
class _HeadDivmod:
    """ngram_ids' constants of one head-sizes tensor: those of the tensor's ``version`` (None
    where its sizes are not all positive), and whether a CUDA graph captured them."""

    version: int
    divmod: torch.Tensor | None
    captured: bool = False


# vLLM hands ple_ngram_ids a layer's head sizes on every call; their constants are computed once
# per tensor, keyed by (device, address, length): a tensor written in place (a new _version) or
# a new one at another address misses and is recomputed. A new tensor that reuses a freed
# address with the same version hits constants that may be another layer's: the kernel rebuilds
# every head whose stored divisor is not its size, so that costs time, never wrong ids. The
# least recently used entry goes past _HEAD_DIVMODS_MAX (a process that keeps making new size
# tensors would otherwise grow the cache without end); that covers a head-sizes tensor per layer
# of any released model several times over.
_HEAD_DIVMODS_MAX = 512
_HEAD_DIVMODS: OrderedDict[tuple[torch.device, int, int], _HeadDivmod] = OrderedDict()
# Constants a captured CUDA graph reads: kept alive even once their entry is replaced.
_CAPTURED_DIVMODS: list[torch.Tensor] = []


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def head_divmod_for(sizes: torch.Tensor) -> torch.Tensor | None:
    """The :func:`~qwen4exp_ext.ops.ngram_head_divmod` constants of ``sizes``, from the cache, or
    computed and cached (a host round trip for a GPU tensor). None where they cannot be had
    without work that must not happen here: under torch.compile tracing, and during CUDA graph
    capture for sizes not seen before (a copy to the host is impossible then); also for sizes
    that are not all positive (the kernel treats those heads itself)."""
    if torch.compiler.is_compiling():
        return None
    key = (sizes.device, sizes.data_ptr(), sizes.numel())
    version = sizes._version
    entry = _HEAD_DIVMODS.get(key)
    capturing = _capturing(sizes.device)
    if entry is not None and entry.version == version:
        _HEAD_DIVMODS.move_to_end(key)
        if capturing and entry.divmod is not None and not entry.captured:
            entry.captured = True
            _CAPTURED_DIVMODS.append(entry.divmod)
        return entry.divmod
    if capturing:
        return None
    host = sizes.detach().cpu()
    divmod = None
    if host.dtype == torch.int64 and host.dim() == 1 and bool((host > 0).all()):
        divmod = ops.ngram_head_divmod(host).to(sizes.device)
    _HEAD_DIVMODS[key] = _HeadDivmod(version, divmod)
    _HEAD_DIVMODS.move_to_end(key)
    if len(_HEAD_DIVMODS) > _HEAD_DIVMODS_MAX:
        _HEAD_DIVMODS.popitem(last=False)
    return divmod


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
        args = (
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
        device = input_ids.device
        if device.type not in DEVICE_TYPES:
            return original(*args)
        cls = (
            input_ids.dtype,
            ngram_context.shape[1] * heads_per_ngram,
            token_bucket(input_ids.numel()),
        )
        which = choice.choose("ple_ngram_ids", cls, device)
        if which is None:
            divmod = head_divmod_for(ngram_heads_vocab_sizes)

            def setup() -> tuple:
                out = None if output is None else torch.empty_like(output)
                return (*args[:-1], out)

            which = choice.decide(
                "ple_ngram_ids",
                cls,
                device,
                setup,
                lambda a: ops.ngram_ids(*a, head_divmod=divmod),
                lambda a: original(*a),
            )
        if which != OURS:
            return original(*args)
        return ops.ngram_ids(*args, head_divmod=head_divmod_for(ngram_heads_vocab_sizes))

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
        args = (key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps)
        device = hidden.device
        if device.type not in DEVICE_TYPES:
            return original(*args)
        cls = (hidden.dtype, value.shape[-1], hidden.shape[-1], token_bucket(hidden.shape[0]))
        which = choice.choose("ple_gate", cls, device)
        if which is None:  # nothing written in place: the live arguments serve the timing
            which = choice.decide(
                "ple_gate",
                cls,
                device,
                lambda: args,
                lambda a: ops.ple_gate(*a),
                lambda a: original(*a),
            )
        return (ops.ple_gate if which == OURS else original)(*args)

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
        kwargs = dict(
            mode=mode,
            dilation=dilation,
            query_start_loc=query_start_loc,
            num_accepted_tokens=num_accepted_tokens,
            has_initial_states=has_initial_states,
            spec_query_len=spec_query_len,
            token_indices=token_indices,
        )
        device = inputs.device
        if device.type not in DEVICE_TYPES:
            return original(
                inputs, residual, conv_state, conv_weights, state_indices, outer_residual, **kwargs
            )
        tokens = inputs.shape[0] if token_indices is None else token_indices.numel()
        cls = (
            mode,
            "SD" if conv_state.stride(1) == 1 else "DS",  # channel stride 1: window-first
            inputs.dtype,
            inputs.shape[1],
            conv_weights.shape[1],
            dilation,
            "fused" if outer_residual is not None else "-",
            "map" if token_indices is not None else "-",
            token_bucket(tokens),
        )
        which = choice.choose("ple_conv", cls, device)
        if which is None:
            # residual and conv_state are written in place: every timed call gets copies.
            def setup() -> tuple:
                return (
                    inputs,
                    copy_for_timing(residual),
                    copy_for_timing(conv_state),
                    conv_weights,
                    state_indices,
                    outer_residual,
                )

            which = choice.decide(
                "ple_conv",
                cls,
                device,
                setup,
                lambda a: ops.ple_conv(*a, **kwargs),
                lambda a: original(*a, **kwargs),
            )
        fn = ops.ple_conv if which == OURS else original
        return fn(
            inputs, residual, conv_state, conv_weights, state_indices, outer_residual, **kwargs
        )

    return ple_conv


def _kernel_table(layer: Any) -> torch.Tensor:
    """The table our gather reads for a vLLM PLE embedding: the GPU (UVA) view of a pinned host
    table, else the weight itself."""
    uva = getattr(layer, "_uva_weight", None)
    return uva if uva is not None else layer.weight


def _fp8_fused(layer: Any) -> bool:
    """Whether our gather looks up *and dequantises* this FP8 table: its rows and its scale where
    our kernels run. The lookups, ``lookup_dtype`` and ``dequantize`` all ask this one question
    of the same layer, so a row is scaled exactly once, by us or by vLLM."""
    weight = getattr(layer, "weight", None)
    scale = getattr(layer, "weight_scale", None)
    if weight is None or scale is None or weight.dtype != _FP8_TABLE_DTYPE:
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
    cast (as vLLM's NVFP4 method does); vLLM's raw-byte rows are dequantised by vLLM."""

    def dequantize(
        self: Any, layer: torch.nn.Module, embeddings: torch.Tensor, output_dtype: torch.dtype
    ) -> torch.Tensor:
        if _fp8_fused(layer):
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


class _NoNvfp4Refusal:
    """Stands in for ``Qwen4ExpPLENvFp4EmbeddingMethod`` in the one place vLLM's AMD layer names
    it: ``isinstance(method, <this>)``, which decides to raise NotImplementedError for NVFP4
    tables on ROCm. No method is an instance of this class, so the AMD layer builds NVFP4
    tables, and their lookups run on our kernels (the rows above)."""


def _make_amd_nvfp4_check(original: type) -> type:
    del original
    return type("Qwen4ExpPLENvFp4EmbeddingMethod", (_NoNvfp4Refusal,), {})


def _lift_amd_nvfp4_refusal() -> bool:
    """Where the refusal may go: wherever our gather serves NVFP4 tables on the devices vLLM
    uses, i.e. not a CPU-only build of ours under a ROCm torch."""
    return "cuda" in DEVICE_TYPES or torch.version.hip is None


def _make_amd_load_weights(original: Callable[..., set[str]]) -> Callable[..., set[str]]:
    """AMD `Qwen4ExpNGramEmbedding.load_weights`: an NVFP4 table's shards (``weight`` and
    ``weight_scale`` per shard, ``weight_scale_2`` once) are loaded by vLLM's NVIDIA
    ``Qwen4ExpNGramEmbedding.load_weights``, the same loader over the same attributes, which
    knows them; other tables by the AMD one, as before."""

    def load_weights(self: Any, weights: Any) -> set[str]:
        common = sys.modules.get(EMBEDDING_MODULE)
        method = getattr(getattr(self, "ngram_embedding", None), "embedding_method", None)
        if common is None or not isinstance(method, common.Qwen4ExpPLENvFp4EmbeddingMethod):
            return original(self, weights)
        nvidia = importlib.import_module(NVIDIA_EMBEDDING_MODULE)
        return nvidia.Qwen4ExpNGramEmbedding.load_weights(self, weights)

    return load_weights


def _make_allocate_pinned(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight`: the pinned table (and NVFP4
    block scales) allocated at exactly their size (huge pages, prefaulted, NUMA-local to the GPU,
    registered once), not rounded up to a power of two by torch's caching host allocator."""

    def allocate_embedding_weight(
        self: Any, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        if "cuda" not in DEVICE_TYPES:  # no registration without our GPU glue
            return original(self, num_embeddings, embedding_dim, dtype)
        from .. import host_table

        return host_table.pinned_host_table(num_embeddings, embedding_dim, dtype)

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


def _eager_forward_context() -> Any:
    """vLLM's forward context of an eager step (not a CUDA-graph capture or replay), else
    None."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    forward_context = importlib.import_module("vllm.forward_context")
    if not forward_context.is_forward_context_available():
        return None
    context = forward_context.get_forward_context()
    mode = getattr(context, "cudagraph_runtime_mode", None)
    if mode is None or getattr(mode, "name", None) != "NONE":
        return None
    return context


def _start_step_lookups(model: Any, args: tuple, kwargs: dict) -> None:
    """The step-entry lookups of ``model``'s (vLLM's AMD ``Qwen4ExpModel``) pinned PLE layers,
    from the arguments of its call (``input_ids, positions, intermediate_tensors,
    inputs_embeds, query_start_loc, ngram_context, ...``)."""

    def argument(name: str, index: int) -> Any:
        return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)

    input_ids = argument("input_ids", 0)
    query_start_loc = argument("query_start_loc", 4)
    ngram_context = argument("ngram_context", 5)
    if input_ids is None or query_start_loc is None or ngram_context is None:
        return
    if input_ids.device.type != "cuda" or "cuda" not in DEVICE_TYPES:
        return
    step = _eager_forward_context()
    if step is None:
        return
    layers = getattr(model, "layers", ())
    start, end = getattr(model, "start_layer", 0), getattr(model, "end_layer", len(layers))
    ple_layers = [
        layer.ple
        for layer in list(layers)[start:end]
        if getattr(layer, "ple", None) is not None and prefetch.StepLookups.eligible(layer.ple)
    ]
    if ple_layers:
        prefetch.STEP_LOOKUPS.start(
            ple_layers,
            input_ids,
            query_start_loc,
            ngram_context,
            step,
            _lookup_rows_capped,
            head_divmod_for,
        )


def _make_amd_model_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """AMD ``Qwen4ExpModel.__call__`` (vLLM's compiled entry, eager Python every step): starts
    every pinned PLE layer's lookup before the first decoder layer (prefetch.py), then runs
    the model as before."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if prefetch.enabled():
            _start_step_lookups(self, args, kwargs)
        return original(self, *args, **kwargs)

    return __call__


def _make_amd_pinned_lookup(original: Callable[..., None]) -> Callable[..., None]:
    """``torch.ops.vllm.qwen4_exp_amd_ple_ngram_embedding_pinned``: the rows of a lookup
    started at this step's entry (after waiting on that layer's event only), reduced over the
    ETP ranks as ``sync_lookup`` does; else vLLM's ``sync_lookup``."""

    def qwen4_exp_amd_ple_ngram_embedding_pinned(
        ngram_ids: torch.Tensor, output: torch.Tensor, layer_name: str
    ) -> None:
        if ngram_ids.device.type == "cuda":
            step = _eager_forward_context()
            if step is not None:
                embedding = step.no_compile_layers[layer_name].ple_embedding.ngram_embedding
                rows = prefetch.STEP_LOOKUPS.take(embedding, ngram_ids.shape[0], step)
                if rows is not None:
                    if embedding.reduce_results:
                        rows = embedding._reduce_etp_embeddings(rows)
                    output.copy_(rows.flatten(-2))
                    return None
        return original(ngram_ids, output, layer_name)

    return qwen4_exp_amd_ple_ngram_embedding_pinned


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Swap:
    """One vLLM callable that runs our kernel after register().

    ``owner`` is a module (for a function) or ``module:Class`` (for a method); ``signature`` is
    vLLM 0.33.0's, as :func:`signature_text` writes it; ``needs`` is the :mod:`qwen4exp_ext.ops`
    function the replacement calls (the row is skipped while our build lacks it);
    ``torch_op`` names the ``torch.ops.vllm`` op that vLLM registered with this very function
    object, and ``torch_op_module`` the module that registers it. ``rebind_consumers`` (module
    owners) also replaces the copies other vLLM Qwen4Exp modules imported; ``applies`` says
    whether the row applies to this build at all; ``what`` names a row that is not a function;
    ``trigger`` is the vLLM module whose import applies the row (with the other rows of the same
    trigger: all of them or none).
    """

    owner: str
    name: str
    needs: str
    signature: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    torch_op: str | None = None
    torch_op_module: str | None = None
    rebind_consumers: bool = True
    applies: Callable[[], bool] | None = None
    what: str | None = None
    trigger: str = PLE_OPS_MODULE

    @property
    def label(self) -> str:
        if self.what is not None:
            return self.what
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
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEEmbeddingMethod",
        "lookup_dtype",
        "gather_rows",
        "(self, layer)",
        _make_lookup_dtype,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEFp8EmbeddingMethod",
        "dequantize",
        "gather_rows",
        "(self, layer, embeddings, output_dtype)",
        _make_fp8_dequantize,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLENvFp4EmbeddingMethod",
        "embedding",
        "gather_rows",
        "(self, layer, input_)",
        _make_nvfp4_embedding,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLENvFp4EmbeddingMethod",
        "lookup_from_pinned",
        "gather_rows",
        "(self, layer, ids, output)",
        _make_nvfp4_lookup_from_pinned,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEPinnedHostEmbedding",
        "allocate_embedding_weight",
        "gather_rows",
        "(self, num_embeddings, embedding_dim, dtype)",
        _make_allocate_pinned,
    ),
    Swap(
        AMD_LAYER_MODULE,
        "Qwen4ExpPLENvFp4EmbeddingMethod",
        "gather_rows",
        "()",
        _make_amd_nvfp4_check,
        rebind_consumers=False,
        applies=_lift_amd_nvfp4_refusal,
        what="amd.ple_layer NVFP4 refusal",
        trigger=AMD_LAYER_MODULE,
    ),
    Swap(
        AMD_LAYER_MODULE,
        "qwen4_exp_amd_ple_ngram_embedding_pinned",
        "gather_rows",
        "(ngram_ids, output, layer_name)",
        _make_amd_pinned_lookup,
        torch_op="qwen4_exp_amd_ple_ngram_embedding_pinned",
        torch_op_module=AMD_LAYER_MODULE,
        rebind_consumers=False,
        applies=prefetch.enabled,
        trigger=AMD_LAYER_MODULE,
    ),
    Swap(
        f"{AMD_MODEL_MODULE}:Qwen4ExpModel",
        "__call__",
        "gather_rows",
        "(self, *args, **kwargs)",
        _make_amd_model_call,
        applies=prefetch.enabled,
        what="amd.model Qwen4ExpModel step-entry PLE lookups",
        trigger=AMD_MODEL_MODULE,
    ),
    Swap(
        f"{AMD_LAYER_MODULE}:Qwen4ExpNGramEmbedding",
        "load_weights",
        "gather_rows",
        "(self, weights)",
        _make_amd_load_weights,
        trigger=AMD_LAYER_MODULE,
    ),
)
