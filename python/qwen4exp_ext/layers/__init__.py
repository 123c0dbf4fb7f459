"""nn.Modules built on the qwen4exp kernels."""

from __future__ import annotations

from .ngram_embedding import NGramEmbedding

__all__ = ["NGramEmbedding"]
