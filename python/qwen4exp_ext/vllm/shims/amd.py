"""The shims of vLLM's AMD Qwen4Exp code: its layer's refusal of NVFP4 tables lifted and their
loader, and the step-entry lookups of its pinned tables (the model's call and the pinned-lookup
op; :mod:`..prefetch`).

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import prefetch, table_dir
from .base import AMD_LAYER_MODULE, DEVICE_TYPES, EMBEDDING_MODULE, NVIDIA_EMBEDDING_MODULE
from .lookup import _lookup_rows_capped, _staged_by_vllm
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
    ``weight_scale`` per shard, ``weight_scale_2`` once), and every shard of a disk-offloaded
    table (vLLM 0.34.0), are loaded by vLLM's NVIDIA ``Qwen4ExpNGramEmbedding.load_weights``,
    the same loader over the same attributes, which knows them; other tables by the AMD one,
    as before. A layer whose table comes from a table file loads no row shard
    (:func:`..table_dir.wrap_load_weights`)."""

    def load_weights(self: Any, weights: Any) -> set[str]:
        common = sys.modules.get(EMBEDDING_MODULE)
        embedding = getattr(self, "ngram_embedding", None)
        method = getattr(embedding, "embedding_method", None)
        nvfp4 = common is not None and isinstance(method, common.Qwen4ExpPLENvFp4EmbeddingMethod)
        if not nvfp4 and not _staged_by_vllm(embedding):  # (vLLM 0.34's disk offload: its
            return original(self, weights)  # shards go to accept_checkpoint_shard)
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


# ---- vLLM 0.34.0's disk_offload on ROCm ------------------------------------------------------
# vLLM refuses disk_offload off CUDA, and its AMD layer neither builds the disk-offloaded table
# nor stages its rows. The rows below lift the refusal where our path serves the platform, build
# the table in the AMD layer, load its shards, take its staged rows in the forward, and stage
# each step from the AMD model state's prepare_inputs (disk_offload_step.py), as vLLM's NVIDIA
# code does.

# vLLM's AMD model state (0.34.0: no staging call of its own).
AMD_MODEL_STATE_MODULE = "vllm.models.qwen4_exp.amd.model_state"
# vLLM's engram config, whose verify_model_config refuses disk_offload off CUDA.
ENGRAM_CONFIG_MODULE = "vllm.config.engram"
# The AMD model state's attribute that caches its disk-offloaded layers.
_DISK_MODULES_ATTR = "_qwen4exp_disk_offload_modules"


def _disk_offload_served(platform: Any) -> bool:
    """Whether our path serves disk_offload on vLLM's ``platform`` where vLLM refuses it: ROCm
    with a GPU build of ours (our reader, our gather, our n-gram ids), or CPU tensors (vLLM's
    CPU platform, or none detected, as on a machine without a GPU)."""
    if platform.is_cuda():
        return False
    if platform.is_rocm():
        return "cuda" in DEVICE_TYPES
    return platform.is_cpu() or not getattr(platform, "device_type", "")


def _make_verify_model_config(original: Callable[..., None]) -> Callable[..., None]:
    """``EngramConfig.verify_model_config(self, model_config)``: vLLM's checks, except that
    disk_offload of a Qwen4Exp model is allowed where :func:`_disk_offload_served`."""

    def verify_model_config(self: Any, model_config: Any) -> None:
        if not getattr(self, "disk_offload", False):
            return original(self, model_config)
        platform = importlib.import_module("vllm.platforms").current_platform
        if not _disk_offload_served(platform):
            return original(self, model_config)
        original(dataclasses.replace(self, disk_offload=False), model_config)  # the other checks
        fields = getattr(sys.modules[ENGRAM_CONFIG_MODULE], "_NGRAM_LAYER_FIELDS", {})
        if fields.get(model_config.architecture) != "ple_layer_ids":
            raise ValueError("disk_offload requires a Qwen4Exp model on CUDA or ROCm")
        return None

    return verify_model_config


def _make_amd_ngram_init(original: Callable[..., None]) -> Callable[..., None]:
    """AMD ``Qwen4ExpNGramEmbedding.__init__``: with ``engram_config.disk_offload``, the table
    is vLLM's ``Qwen4ExpPLEDiskOffloadEmbedding`` (no table in memory), as vLLM's NVIDIA layer
    builds it, and (as there) the sequence-parallel reduce-scatter is off: every rank stages
    full rows. vLLM's AMD ``__init__`` picks between the pinned and device classes by the names
    of its module, so both name the disk class while it runs (model construction is one
    thread; the lock keeps two constructions apart)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = importlib.import_module("vllm.config").get_current_vllm_config()
        engram = getattr(config, "engram_config", None)
        if engram is None or not getattr(engram, "disk_offload", False):
            return original(self, *args, **kwargs)
        disk = importlib.import_module(NVIDIA_EMBEDDING_MODULE).Qwen4ExpPLEDiskOffloadEmbedding
        layer_module = sys.modules[AMD_LAYER_MODULE]
        names = ("Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding")
        with _init_lock:
            saved = {name: layer_module.__dict__[name] for name in names}
            try:
                for name in names:
                    setattr(layer_module, name, disk)
                original(self, *args, **kwargs)
            finally:
                for name, cls in saved.items():
                    setattr(layer_module, name, cls)
        self.use_reduce_scatter = False
        self.ngram_embedding.reduce_results = True
        return None

    return __init__


_init_lock = threading.Lock()


def _make_amd_ngram_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """AMD ``Qwen4ExpNGramEmbedding.forward(self, input_ids, query_start_loc,
    ngram_context)``: a disk-offloaded table's rows are the step's staged rows (no hashing, no
    lookup), as in vLLM's NVIDIA forward; other tables as before."""

    def forward(
        self: Any, input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: Any
    ) -> torch.Tensor:
        embedding = self.ngram_embedding
        if not _staged_by_vllm(embedding):
            return original(self, input_ids, query_start_loc, ngram_context)
        rows = embedding.staged_rows(input_ids.reshape(-1).shape[0])
        return self._sp_shard_embeddings(rows) if self.use_sequence_parallel else rows

    return forward


def _make_amd_prepare_inputs(original: Callable[..., dict]) -> Callable[..., dict]:
    """AMD ``Qwen4ExpModelState.prepare_inputs(self, input_batch, req_states)``: vLLM's, then
    the step's rows of every disk-offloaded PLE table staged (started) as vLLM's NVIDIA model
    state does, from the step's ids and the query starts and n-gram context just prepared."""

    def prepare_inputs(self: Any, input_batch: Any, req_states: Any) -> dict:
        model_inputs = original(self, input_batch, req_states)
        if not getattr(self, "uses_ngram_embedding", False):
            return model_inputs
        modules = self.__dict__.get(_DISK_MODULES_ATTR)
        if modules is None:
            modules = [
                (m, m.ngram_embedding)
                for m in self.model.modules()
                if _staged_by_vllm(getattr(m, "ngram_embedding", None))
            ]
            self.__dict__[_DISK_MODULES_ATTR] = modules
        if modules:
            from .disk_offload_step import amd_ngram_ids, stage_step

            stage_step(
                modules,
                input_batch.input_ids,
                model_inputs["query_start_loc"],
                model_inputs["ngram_context"],
                amd_ngram_ids,
                config=self.vllm_config,
            )
        return model_inputs

    return prepare_inputs
