"""What the lookup tests share (test_prefetch.py, test_staged.py, test_file_table.py): n-gram
embeddings of every table format filled with random bytes, batches, a bitwise comparison, and
PLE layers with random weights (the one-process gloo group of the shard tests: conftest.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from ngram_support import CONFIG
from qwen4exp_ext.layers import NGramEmbedding, PLELayer

NVFP4_CONFIG = SimpleNamespace(**{**vars(CONFIG), "ple_embed_dim": 128})  # head dim 32
FORMATS = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "nvfp4"]
# (request lengths) of the batches: odd, one empty request, one token, none at all.
BATCHES = {"odd": [5, 0, 13, 1], "one": [1], "empty": []}


def make_batch(lengths, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
    tokens = int(qsl[-1])
    input_ids = torch.randint(0, CONFIG.vocab_size, (tokens,), generator=gen)
    if tokens > 3:
        input_ids[3] = CONFIG.eos_token_id
    context = torch.randint(0, CONFIG.vocab_size, (len(lengths), 2), generator=gen)
    return input_ids.to(device), qsl.to(torch.int32).to(device), context.to(device)


def fill_table(module: NGramEmbedding, seed: int) -> None:
    """Random table bytes (and scales) for any format: every fp8 code, NaN included."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = module.weight
        if weight.dtype.is_floating_point and weight.element_size() > 1:
            weight.copy_(torch.randn(weight.shape, generator=gen).to(weight.dtype))
        else:
            raw = torch.randint(0, 256, weight.shape, dtype=torch.uint8, generator=gen)
            weight.view(torch.uint8).copy_(raw)
        if module.nvfp4:
            bits = torch.randint(
                1, 0x60, module.weight_scale.shape, dtype=torch.uint8, generator=gen
            )
            module.weight_scale.view(torch.uint8).copy_(bits)
            module.weight_scale_2.fill_(0.37)
        elif module.weight_scale is not None:
            module.weight_scale.fill_(0.0123)


def make_embedding(table_format, device, *, layer_index=1, max_tokens=32, shard=None, seed=0):
    config = NVFP4_CONFIG if table_format == "nvfp4" else CONFIG
    placement = "cpu" if device == "cpu" else "device"
    module = NGramEmbedding(
        config,
        layer_index,
        placement=placement,
        device=device,
        dtype=table_format,
        shard=shard,
        max_tokens=max_tokens,
    )
    fill_table(module, seed)
    return module


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (NaN rows of fp8 tables included)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))


def ple_config(table_format):
    base = NVFP4_CONFIG if table_format == "nvfp4" else CONFIG
    return SimpleNamespace(
        **vars(base), hidden_size=8, hc_count=2, ple_conv_kernel_size=4, rms_norm_eps=1e-6
    )


def ple_layers(device, table_format, max_tokens):
    """Two PLE layers (dense indices 0 and 2, conv states 0 and 1) with random weights, and
    their twins without max_tokens (fresh outputs, no prefetch): same weights."""
    config = ple_config(table_format)
    kwargs = dict(
        dtype=torch.bfloat16,
        table_dtype=table_format,
        placement="cpu" if device == "cpu" else "device",
        device=device,
    )
    layers, twins = [], []
    for state_index, layer_index in enumerate((0, 2)):
        layer = PLELayer(
            config, layer_index, state_index=state_index, max_tokens=max_tokens, **kwargs
        )
        fill_table(layer.ple_embedding, layer_index)
        gen = torch.Generator().manual_seed(layer_index)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if not name.startswith("ple_embedding"):
                    param.copy_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.3)
        twin = PLELayer(config, layer_index, state_index=state_index, **kwargs)
        twin.load_state_dict(layer.state_dict())
        layers.append(layer)
        twins.append(twin)
    return config, layers, twins


class SlowOrFailingEmbedding(NGramEmbedding):
    """An embedding whose lookup sleeps ``delay`` seconds for real, or raises ``failure``, each
    time it runs: the producer side of a pipeline made slow or broken without touching files or
    the worker."""

    delay = 0.0
    failure: BaseException | None = None

    def _lookup_local(self, *args, **kwargs):
        if self.failure is not None:
            raise self.failure
        time.sleep(self.delay)
        return super()._lookup_local(*args, **kwargs)


def slow_layers(count: int) -> list[SlowOrFailingEmbedding]:
    """``count`` CPU-table layers (tables filled by ``fill_table``) that can be slowed or broken."""
    layers = []
    for index in range(count):
        layer = SlowOrFailingEmbedding(CONFIG, index, placement="cpu", max_tokens=32)
        fill_table(layer, index)
        layers.append(layer)
    return layers
