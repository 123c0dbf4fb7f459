"""What the shims of every op family share: the names of vLLM's modules they patch, the mark of
a replacement, the devices our build serves, and how a signature is compared.

This module imports neither vLLM nor anything that does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ... import build_info

# The vLLM module whose functions are swapped; every other vLLM module imports them from here.
PLE_OPS_MODULE = "vllm.models.qwen4_exp.common.ops.ple"
# The vLLM module whose lookup methods are swapped (shared by the AMD and NVIDIA paths).
EMBEDDING_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
# vLLM registers torch.ops.vllm.qwen4_exp_ple_gate here with its own function object.
AMD_LAYER_MODULE = "vllm.models.qwen4_exp.amd.ple_layer"
# vLLM's AMD model, whose Qwen4ExpModel.__call__ starts a step (prefetch.py).
AMD_MODEL_MODULE = "vllm.models.qwen4_exp.amd.model"
# vLLM's NVIDIA model, whose Qwen4ExpForCausalLM gets the loader's skip hook (table_dir.py).
NVIDIA_MODEL_MODULE = "vllm.models.qwen4_exp.nvidia.model"
# vLLM's NVIDIA n-gram embedding, whose load_weights knows NVFP4 shards.
NVIDIA_EMBEDDING_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
# vLLM 0.34.0's disk-offloaded PLE table (in NVIDIA_EMBEDDING_MODULE): no table in memory; vLLM
# stages each step's raw rows from the checkpoint files itself, never through a lookup method.
DISK_OFFLOAD_EMBEDDING = "Qwen4ExpPLEDiskOffloadEmbedding"
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
