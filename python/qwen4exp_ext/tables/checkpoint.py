"""A PLE table in a safetensors checkpoint: its tensor names, row shards and dtypes (SPEC §4
"Checkpoints"), shared by the table-file packer (:mod:`.pack`) and ``NGramEmbedding``'s loader
(``layers/ngram_loading.py``).

Under a layer's prefix: ``ngram_embedding.shard_<i>.weight`` row shards (or one unsharded
``ngram_embedding.weight``), fp8's per-tensor ``ngram_embedding.weight_scale``, NVFP4's
``shard_<i>.weight_scale`` block scales and ``shard_<i>.weight_scale_2`` global scale, and the
hash buffers BUFFER_NAMES.
"""

from __future__ import annotations

import torch

__all__ = [
    "BUFFER_NAMES",
    "GLOBAL_SCALE_NAME",
    "SCALE_NAME",
    "SHARD_LEAVES",
    "SHARD_PREFIX",
    "WEIGHT_NAME",
    "checkpoint_shard_rows",
    "safetensors_dtype",
    "shard_name",
]

BUFFER_NAMES = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
SHARD_PREFIX = "ngram_embedding.shard_"
WEIGHT_NAME = "ngram_embedding.weight"
# fp8: the per-tensor scale; NVFP4: the block scales (vLLM's names).
SCALE_NAME = "ngram_embedding.weight_scale"
GLOBAL_SCALE_NAME = "ngram_embedding.weight_scale_2"  # NVFP4 only
# Checkpoint shard leaves: ngram_embedding.shard_<i>.<leaf>.
SHARD_LEAVES = ("weight", "weight_scale", "weight_scale_2")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_dtype(code: str, key: str) -> torch.dtype:
    """The torch dtype of a safetensors header dtype code."""
    try:
        return _SAFETENSORS_DTYPES[code]
    except KeyError:
        raise ValueError(f"checkpoint tensor {key!r} has unsupported dtype {code}") from None


def shard_name(name: str) -> tuple[int, str] | None:
    """(index, leaf) of a checkpoint name ``ngram_embedding.shard_<index>.<leaf>``, leaf in
    SHARD_LEAVES; None for any other name. Shared with the table-file packer (pack.py)."""
    if not name.startswith(SHARD_PREFIX):
        return None
    text, _, leaf = name[len(SHARD_PREFIX) :].partition(".")
    return (int(text), leaf) if text.isdigit() and leaf in SHARD_LEAVES else None


def checkpoint_shard_rows(num_rows: int, parts: int, shard_index: int) -> tuple[int, int]:
    """(first global row, row count) of checkpoint shard ``shard_index`` of a table of
    ``num_rows`` rows split in ``parts`` (split_ngram_parts): ceil(num_rows / parts) rows each,
    the last shorter (and any after it empty)."""
    if shard_index >= parts:
        raise ValueError(
            f"PLE embedding shard index {shard_index} exceeds split_ngram_parts={parts}"
        )
    shard_size = -(-num_rows // parts)
    start = shard_index * shard_size
    return start, max(0, min(shard_size, num_rows - start))
