"""nn.Modules built on the qwen4exp kernels."""

from __future__ import annotations

from .hyper_connection import GatedResidual, HyperConnection, HyperConnectionConfig
from .ngram_embedding import NGramEmbedding
from .ple_layer import PLELayer
from .prefetch import LookupPipeline
from .staged import StagedLookupPipeline, StagedStep
from .state import PLEBatch, PLEState, get_ple_mamba_state_dtype, get_ple_mamba_state_shape

__all__ = [
    "GatedResidual",
    "HyperConnection",
    "HyperConnectionConfig",
    "LookupPipeline",
    "NGramEmbedding",
    "PLEBatch",
    "PLELayer",
    "PLEState",
    "StagedLookupPipeline",
    "StagedStep",
    "get_ple_mamba_state_dtype",
    "get_ple_mamba_state_shape",
]
