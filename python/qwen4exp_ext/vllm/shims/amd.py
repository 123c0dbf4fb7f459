"""The shims of vLLM's AMD Qwen4Exp code: its layer's refusal of NVFP4 tables lifted and their
loader, and the step-entry lookups of its pinned tables (the model's call and the pinned-lookup
op; :mod:`..prefetch`).

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from .. import prefetch, table_dir
from .base import DEVICE_TYPES, EMBEDDING_MODULE, NVIDIA_EMBEDDING_MODULE
from .lookup import _lookup_rows_capped
from .ple import head_divmod_for


class _NoNvfp4Refusal:
    """Stands in for ``Qwen4ExpPLENvFp4EmbeddingMethod`` in the one place vLLM's AMD layer names
    it: ``isinstance(method, <this>)``, which decides to raise NotImplementedError for NVFP4
    tables on ROCm. No method is an instance of this class, so the AMD layer builds NVFP4
    tables, and their lookups run on our kernels (the NVFP4 rows of
    :data:`~qwen4exp_ext.vllm.shims.SWAPS`)."""


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
    knows them; other tables by the AMD one, as before. A layer whose table comes from a table
    file loads no row shard (:func:`..table_dir.wrap_load_weights`)."""

    def load_weights(self: Any, weights: Any) -> set[str]:
        common = sys.modules.get(EMBEDDING_MODULE)
        method = getattr(getattr(self, "ngram_embedding", None), "embedding_method", None)
        if common is None or not isinstance(method, common.Qwen4ExpPLENvFp4EmbeddingMethod):
            return original(self, weights)
        nvidia = importlib.import_module(NVIDIA_EMBEDDING_MODULE)
        return nvidia.Qwen4ExpNGramEmbedding.load_weights(self, weights)

    # A layer served from a table file skips the checkpoint's row shards (table_dir.py).
    return table_dir.wrap_load_weights(load_weights)


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
