"""A small real Qwen4Exp model directory for ``qwen4exp-table pack-model`` / ``verify-model``
tests: a ``config.json`` (a ``text_config`` with ``ple_layer_ids``) and two safetensors files
holding every PLE layer's table (in row shards, with its scales and hash buffers) under the
checkpoint's names, among other modules' tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwen4exp_ext import layout

# 4 heads of 16 elements, a few hundred rows a layer (ngram_vocab_size_base=50).
TEXT_CONFIG = {
    "vocab_size": 97,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ple_embed_dim": 64,
    "ngram_vocab_size_base": 50,
    "make_ngram_vocab_size_divisible_by": 16,
    "eos_token_id": 5,
    "seed": 7,
    "split_ngram_parts": 3,
    "num_hidden_layers": 6,
    "hidden_size": 8,
}
D = 16
# Decoder layers 2, 4 and 5 (one-indexed; given unsorted, one twice): PLE layers 0, 1, 2 at
# zero-based decoder layers 1, 3, 4.
PLE_LAYER_IDS = [4, 2, 5, 2]
DECODER_LAYERS = [1, 3, 4]
CONDITIONAL = "model.language_model.layers.{layer}.ple.ple_embedding."
CAUSAL = "model.layers.{layer}.ple.ple_embedding."
SCALE = 0.37
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}


def text_config(**changes) -> dict:
    return {**TEXT_CONFIG, "ple_layer_ids": PLE_LAYER_IDS, **changes}


def write_config(directory: Path, fields: dict | None = None, **changes) -> Path:
    path = directory / "config.json"
    fields = text_config(**changes) if fields is None else fields
    path.write_text(json.dumps({"architectures": ["Qwen4ExpForConditionalGeneration"],
                                "text_config": fields}))  # fmt: skip
    return path


def table(fmt: str, layer: int, seed: int = 0, **changes) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, NVFP4 block scales or None) of PLE layer ``layer``: random, seeded by both."""
    config = text_config(**changes)
    heads = (config["ngram_size"] - 1) * config["heads_per_ngram"]
    rows = layout.head_vocab_layout(
        config["ngram_vocab_size_base"], heads, layer, config["make_ngram_vocab_size_divisible_by"]
    ).padded_rows
    gen = torch.Generator().manual_seed(1000 * seed + layer)
    if fmt == "nvfp4":
        codes = torch.randint(0, 256, (rows, D // 2), dtype=torch.uint8, generator=gen)
        bits = torch.randint(0x01, 0x60, (rows, D // 16), dtype=torch.uint8, generator=gen)
        return codes, bits.view(torch.float8_e4m3fn)
    return torch.randn(rows, D, generator=gen).to(DTYPES[fmt]), None


def layer_weights(fmt: str, layer: int, seed: int = 0, **changes) -> dict[str, torch.Tensor]:
    """PLE layer ``layer``'s checkpoint tensors (names after its prefix), in row shards."""
    config = text_config(**changes)
    heads = (config["ngram_size"] - 1) * config["heads_per_ngram"]
    vocab = layout.head_vocab_layout(
        config["ngram_vocab_size_base"], heads, layer, config["make_ngram_vocab_size_divisible_by"]
    )
    multipliers = layout.layer_multipliers(
        config["vocab_size"], config["ngram_size"], config["seed"], layer
    )
    weights = {
        "layer_multipliers": torch.tensor(multipliers),
        "ngram_heads_vocab_sizes": torch.tensor(vocab.sizes),
        "ngram_heads_offsets": torch.tensor(vocab.offsets),
    }
    rows, block_scales = table(fmt, layer, seed, **changes)
    parts = config["split_ngram_parts"]
    shard = -(-rows.shape[0] // parts)
    for i in range(parts):
        part = slice(i * shard, (i + 1) * shard)
        weights[f"ngram_embedding.shard_{i}.weight"] = rows[part].clone()
        if block_scales is not None:
            weights[f"ngram_embedding.shard_{i}.weight_scale"] = block_scales[part].clone()
    if fmt.startswith("float8"):
        weights["ngram_embedding.weight_scale"] = torch.tensor([SCALE])
    if fmt == "nvfp4":
        weights["ngram_embedding.weight_scale_2"] = torch.tensor([SCALE])
    return weights


def write_model(
    directory: Path,
    fmt: str = "bfloat16",
    template: str = CONDITIONAL,
    seed: int = 0,
    skip_layers: tuple[int, ...] = (),
    **changes,
) -> Path:
    """The model directory: config.json and two safetensors files (PLE layer 0 and the first
    shard of every layer in the first, the rest in the second). Returns ``directory``."""
    directory.mkdir(exist_ok=True)
    write_config(directory, **changes)
    first: dict[str, torch.Tensor] = {"model.language_model.embed_tokens.weight": torch.zeros(4, 2)}
    rest: dict[str, torch.Tensor] = {"lm_head.weight": torch.ones(2, 4)}
    for layer, decoder in enumerate(DECODER_LAYERS):
        if layer in skip_layers:
            continue
        prefix = template.replace("{layer}", str(decoder))
        rest[prefix.removesuffix("ple_embedding.") + "conv.weight"] = torch.ones(3)
        for name, tensor in layer_weights(fmt, layer, seed, **changes).items():
            into = first if layer == 0 or ".shard_0." in name else rest
            into[prefix + name] = tensor
    save_file(first, directory / "model-00001-of-00002.safetensors")
    save_file(rest, directory / "model-00002-of-00002.safetensors")
    return directory


def file_bytes(fmt: str, layer: int, seed: int = 0, **changes) -> bytes:
    """The data region ple<layer>.q4xt must hold: the rows' bytes (NVFP4: codes, then scales)."""
    rows, block_scales = table(fmt, layer, seed, **changes)
    data = rows.contiguous().view(torch.uint8)
    if block_scales is not None:
        data = torch.cat([data, block_scales.view(torch.uint8)], dim=1)
    return data.numpy().tobytes()
