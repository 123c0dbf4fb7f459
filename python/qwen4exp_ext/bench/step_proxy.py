"""The step proxy of ``host_lookup`` (and its lookup-level cases, ``staged_lookup``): stand-in
decoder layers around two real PLE layers, the step's buffers, conv states and batches, and the
size presets. The paths and how they are timed are ``bench/host_lookup.py``'s.

**The step proxy.** A stack of DECODER_LAYERS = 6 stand-in decoder layers; the 2nd and the 6th
(PLE_LAYERS, 1-based, as ``ple_layer_ids`` counts them) open with a PLE layer, as transformers'
``Qwen4ExpTextDecoderLayer`` does (``hidden += ple(hidden)`` before attention). The 2nd is the
Engram paper's placement (the least compute in front of it to hide a lookup behind); the 6th
has four layers in front of it. Each PLE layer is a real ``layers.PLELayer`` on our kernels
(n-gram hashing, table gather, merged kv projection, ``ple_gate``, ``ple_conv`` on the step's
conv states), built with ``max_tokens`` (fixed buffers, as the pipeline needs), its own table
(dense PLE index 0 and 1: different hashes and rows) and random weights. A step copies the
step's token ids into a fixed buffer (a fresh batch every call, below) and the hidden input
into the step's [T, C] residual stream, then runs the six layers; its output is the last
layer's residual stream.

**The stand-in decoder layer** is dense compute with the FLOPs of one decoder layer's active
parameters: two GEMMs on the first stream's H columns of the residual stream, [T, H]·[H, F]
then [T, F]·[F, H], the result added back in place, with 2·H·F = the layer's active parameters
(2 FLOPs each per token). What the repo knows of the released config (SPEC §1; gather_rows'
RELEASED_ROWS) is the PLE side: H = 2560, M = ``hc_count`` = 4 streams (C = 10240),
``ple_embed_dim`` = 16 heads x 160, 320,001,536 table rows. It does not know the released
MoE's shape, so the rest comes from transformers' ``Qwen4ExpTextConfig`` defaults (512 experts,
10 routed + 1 shared active, expert and shared intermediate 512, Gated DeltaNet with 16 key and
32 value heads of 128, ``hc_lowrank`` 320) at the released H: a linear-attention decoder layer
(the kind every PLE layer sits on) then has ACTIVE_PARAMS = 99,916,480 active parameters
without its PLE (42.1M Gated DeltaNet, 44.6M MoE with router and shared expert, 13.2M
hyper-connection mixes; ``tests/test_bench.py`` counts them from transformers' own module), so
F = ACTIVE_PARAMS / (2·2560) = 19,514.9, rounded up to FFN = 19,520. No attention, router or
activation function: their FLOPs are in the count, their latencies are not modelled. The size
presets below scale this.

**Sizes** (``QWEN4EXP_BENCH_HOST_LOOKUP_SIZE``, default ``released`` on a GPU, ``cpu`` on a
CPU; ``QWEN4EXP_BENCH_HOST_LOOKUP_ROWS`` overrides the rows of each table):

- ``released``: H = 2560, M = 4, F = 19,520; 4M rows a table (1.28 GB in bf16, ~20x an H200's
  60 MB L2; 2 layers x 3 formats: 4.6 GB in device memory and as much pinned).
- ``cpu``: the released proxy with H, hence C = M·H, at 1/80 (H = 32): every GEMM (stand-ins,
  kv projection) and the gate and conv do 1/80 of the released work per token, in the same
  proportions, while the lookups read the released rows (16 heads x 160); 2M rows a table
  (640 MB in bf16, 20x the 32 MB L3; 2.3 GB for all six). A 1-thread prefill step then takes
  about a second on a Zen 4 core and the full run a few minutes. A lookup of a given time
  weighs 80x more against this step than against the released step on the same machine.
- ``quick``: toy widths, 4096 rows, decode T = 1, 16 and prefill T = 64: seconds (tests).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from qwen4exp_ext import _switches
from qwen4exp_ext.bench.gather_rows import COLD_BYTES, HEAD_DIM, NUM_HEADS
from qwen4exp_ext.bench.ngram_ids import (
    EOS_TOKEN_ID,
    HEADS_PER_NGRAM,
    NGRAM_SIZE,
    PAD_TO,
    SEED,
    VOCAB_SIZE,
)
from qwen4exp_ext.layers import (
    LookupPipeline,
    PLEBatch,
    PLELayer,
    PLEState,
    StagedLookupPipeline,
)
from qwen4exp_ext.layers.ngram_embedding import NGramEmbedding

DECODER_LAYERS = 6
PLE_LAYERS = (2, 6)  # 1-based decoder layers that open with a PLE layer
# Active parameters of one linear-attention decoder layer without its PLE (module docstring).
ACTIVE_PARAMS = 99_916_480
RELEASED_HIDDEN = 2560
FFN = 19_520  # ACTIVE_PARAMS / (2 * RELEASED_HIDDEN), rounded up to a multiple of 64
CONV_KERNEL = 4
RMS_EPS = 1e-6
DTYPE = torch.bfloat16
FORMATS = ("bf16", "fp8", "nvfp4")
TABLE_DTYPES: dict[str, torch.dtype | str] = {
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "nvfp4": "nvfp4",
}
FP8_SCALE = 0.25
NVFP4_SCALE = 0.37
INPUT_SEED = 0
SIZE_ENV = "QWEN4EXP_BENCH_HOST_LOOKUP_SIZE"
ROWS_ENV = "QWEN4EXP_BENCH_HOST_LOOKUP_ROWS"


@dataclass(frozen=True)
class Size:
    """The widths, table rows and batches of one size preset (module docstring)."""

    name: str
    hidden: int  # H, one stream's width
    hc_count: int  # M streams: the residual stream is [T, M·H]
    ffn: int  # F, the stand-in's inner width: 2·H·F parameters
    rows: int  # table rows per PLE layer (before the layout's padding)
    decode_tokens: tuple[int, ...]
    prefill_tokens: int
    prefill_requests: int
    cold_bytes: int  # rows the id batches of a case touch per cycle


SIZES = {
    "released": Size(
        "released", RELEASED_HIDDEN, 4, FFN, 4_000_000, (1, 64, 256), 8192, 4, COLD_BYTES
    ),
    "cpu": Size("cpu", RELEASED_HIDDEN // 80, 4, FFN, 2_000_000, (1, 64, 256), 8192, 4, COLD_BYTES),
    "quick": Size("quick", 16, 4, 128, 4096, (1, 16), 64, 4, 1 << 20),
}


def size_for(device: torch.device) -> Size:
    """The preset of $QWEN4EXP_BENCH_HOST_LOOKUP_SIZE (default by device), with the rows of
    $QWEN4EXP_BENCH_HOST_LOOKUP_ROWS when set."""
    name = os.environ.get(SIZE_ENV) or ("released" if device.type == "cuda" else "cpu")
    if name not in SIZES:
        raise ValueError(f"${SIZE_ENV}={name!r}: choose one of {', '.join(SIZES)}")
    size = SIZES[name]
    rows = _switches.env_count(ROWS_ENV, what="a row count", minimum=NUM_HEADS * (PAD_TO + 1))
    if rows is not None:
        size = Size(**{**asdict(size), "rows": rows})
    if size.rows < NUM_HEADS * (PAD_TO + 1):
        raise ValueError(f"a table needs at least {NUM_HEADS * (PAD_TO + 1)} rows, got {size.rows}")
    return size


def row_bytes(fmt: str) -> int:
    """Bytes read per looked-up row: bf16 320, fp8 160, NVFP4 80 packed + 10 block scales."""
    return {"bf16": 2 * HEAD_DIM, "fp8": HEAD_DIM, "nvfp4": HEAD_DIM // 2 + HEAD_DIM // 16}[fmt]


def ple_config(size: Size) -> SimpleNamespace:
    """The text-config fields a PLELayer reads: the released hashing and row shape, the preset's
    widths, a table of about ``size.rows`` rows."""
    return SimpleNamespace(
        vocab_size=VOCAB_SIZE,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        ple_embed_dim=NUM_HEADS * HEAD_DIM,
        ngram_vocab_size_base=size.rows // NUM_HEADS - PAD_TO,
        make_ngram_vocab_size_divisible_by=PAD_TO,
        eos_token_id=EOS_TOKEN_ID,
        seed=SEED,
        split_ngram_parts=512,
        hidden_size=size.hidden,
        hc_count=size.hc_count,
        ple_conv_kernel_size=CONV_KERNEL,
        rms_norm_eps=RMS_EPS,
    )


# --- the proxy's parts --------------------------------------------------------------------------


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (each table and layer its own seed)."""
    return torch.Generator(device=device).manual_seed(seed)


def fill_table(embedding: NGramEmbedding, fmt: str, gen: torch.Generator) -> None:
    """Random rows of moderate, finite values, fast at any size (random bytes, then bit masks):
    bf16 magnitudes in [2^-7, 2), fp8 up to 1.875 (no NaN) times FP8_SCALE, NVFP4 any codes
    with block scales in [0.5, 1) times NVFP4_SCALE."""
    with torch.no_grad():
        raw = embedding.weight.view(torch.uint8)
        raw.random_(0, 256, generator=gen)
        if fmt == "bf16":
            high = raw.view(-1, 2)[:, 1]  # sign and 7 exponent bits (little endian)
            high.bitwise_and_(0x83).bitwise_or_(0x3C)
        elif fmt == "fp8":
            raw.bitwise_and_(0xBF)  # exponent below 8: at most 1.875, never NaN
            embedding.weight_scale.fill_(FP8_SCALE)
        else:
            scales = embedding.weight_scale.view(torch.uint8)
            scales.random_(0x30, 0x38, generator=gen)
            embedding.weight_scale_2.fill_(NVFP4_SCALE)


def fill_weights(layer: PLELayer, gen: torch.Generator) -> None:
    """Random weights of everything but the table: kv projection, norms, conv taps."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.startswith("ple_embedding"):
                continue
            fan_in = param.shape[-1] if name == "kv_proj.weight" else 1
            values = torch.randn(param.shape, generator=gen, device=param.device)
            param.copy_(values * (0.3 / math.sqrt(fan_in)))


def copy_module_weights(source: nn.Module, target: nn.Module) -> None:
    """Every weight of ``source`` into ``target`` (another placement of the same PLELayer or
    NGramEmbedding), the table bytes included: the same layer, whichever memory it reads its
    table from."""
    with torch.no_grad():
        targets = dict(target.named_parameters()) | dict(target.named_buffers())
        for name, tensor in [*source.named_parameters(), *source.named_buffers()]:
            targets[name].copy_(tensor)


class StepProxy:
    """The stand-in decoder layers, the step's buffers, the PLE conv states and the batches of
    one device (module docstring): what every case on it shares."""

    def __init__(self, size: Size, device: torch.device) -> None:
        self.size = size
        self.device = device
        hidden, ffn = size.hidden, size.ffn
        channels = hidden * size.hc_count
        max_tokens = max(*size.decode_tokens, size.prefill_tokens)
        self.max_tokens = max_tokens
        gen = seeded_generator(device, INPUT_SEED)

        def randn(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(shape, generator=gen, device=device) * scale).to(DTYPE)

        self.stand_ins = [
            (randn(hidden, ffn, scale=hidden**-0.5), randn(ffn, hidden, scale=0.5 * ffn**-0.5))
            for _ in range(DECODER_LAYERS)
        ]
        self.inner = torch.empty(max_tokens, ffn, dtype=DTYPE, device=device)
        self.outer = torch.empty(max_tokens, hidden, dtype=DTYPE, device=device)
        self.residual = torch.empty(max_tokens, channels, dtype=DTYPE, device=device)
        self.hidden_in = randn(max_tokens, channels, scale=1.0)
        self.state = PLEState(
            max_requests=max(size.decode_tokens) + size.prefill_requests,
            hc_hidden_size=channels,
            state_len=(CONV_KERNEL - 1) * NGRAM_SIZE,
            ngram_size=NGRAM_SIZE,
            eos_token_id=EOS_TOKEN_ID,
            num_layers=len(PLE_LAYERS),
            dtype=DTYPE,
            device=device,
            layout="window_first",  # vLLM's default conv-state layout
        )
        self.batches = self._batches(torch.Generator().manual_seed(INPUT_SEED))

    def _batches(self, gen: torch.Generator) -> dict[int, PLEBatch]:
        """T -> the step's batch: decode (T requests of one token, each with history) or the
        prefill (fresh requests of equal chunks)."""
        size, state = self.size, self.state

        def tokens(n: int) -> list[int]:
            return torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist()

        decode = list(range(max(size.decode_tokens)))
        for rid in decode:
            state.add_request(rid, context=tokens(NGRAM_SIZE - 1))
        state.commit(state.prepare([(rid, tokens(1)) for rid in decode]))  # history: decode
        batches = {
            t: state.prepare([(rid, tokens(1)) for rid in decode[:t]]) for t in size.decode_tokens
        }
        chunk = size.prefill_tokens // size.prefill_requests
        prefill = [f"prefill{i}" for i in range(size.prefill_requests)]
        for rid in prefill:
            state.add_request(rid, context=tokens(NGRAM_SIZE - 1))
        batches[size.prefill_tokens] = state.prepare([(rid, tokens(chunk)) for rid in prefill])
        return batches

    def conv_states(self) -> list[torch.Tensor]:
        return [self.state.conv_state(i) for i in range(len(PLE_LAYERS))]

    def step(
        self,
        layers: Sequence[PLELayer],
        batch: PLEBatch,
        pipeline: LookupPipeline | None = None,
        staged: StagedLookupPipeline | None = None,
        host_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One step over ``batch`` (its input_ids already hold the step's tokens). With
        ``staged``, the step's lookups are submitted to it at entry (``host_inputs``: the same
        tokens, query_start_loc and ngram_context on the host) and each PLE layer takes its
        staged rows; the step is released at the end (after its reads are queued)."""
        num_tokens = batch.num_tokens
        hidden = self.size.hidden
        ids = batch.input_ids
        residual = self.residual[:num_tokens]
        residual.copy_(self.hidden_in[:num_tokens])
        if pipeline is not None:
            pipeline.start_prefetch(ids, batch.query_start_loc, batch.ngram_context)
        handle = staged.submit(*host_inputs) if staged is not None else None
        ple = iter(layers)
        inner, outer = self.inner[:num_tokens], self.outer[:num_tokens]
        for index, (w_in, w_out) in enumerate(self.stand_ins):
            if index + 1 in PLE_LAYERS:
                k = PLE_LAYERS.index(index + 1)
                rows = handle.rows(k) if handle is not None else None
                residual = next(ple)(residual, ids, batch, embeddings=rows)
            stream = residual[:, :hidden]
            torch.mm(stream, w_in, out=inner)
            torch.mm(inner, w_out, out=outer)
            stream.add_(outer)
        if handle is not None:
            handle.release()
        return residual


def ple_layers(
    size: Size, fmt: str, placement: str, device: torch.device, max_tokens: int
) -> list[PLELayer]:
    """The proxy's PLE layers (dense indices 0 and 1, conv states 0 and 1) with ``fmt`` tables
    where ``placement`` puts them, zeroed."""
    config = ple_config(size)
    return [
        PLELayer(
            config,
            index,
            dtype=DTYPE,
            table_dtype=TABLE_DTYPES[fmt],
            placement=placement,
            device=device,
            max_tokens=max_tokens,
        )
        for index in range(len(PLE_LAYERS))
    ]


def spec_gather_args(embedding: NGramEmbedding) -> dict[str, Any]:
    """``reference.gather_rows``' keyword arguments for ``embedding``'s table: its gather's, less
    the kernel's own (output, max_blocks)."""
    args = embedding._gather_args(None)
    del args["output"], args["max_blocks"]
    return args
