"""The CPU kernel's hash widths (issue #51 item 2): ngram_ids reduces each head's mix modulo its
size with AVX-512 (8 heads a step), AVX2 (4) or a head at a time, picked at run time
(ops.cpu_ngram_hash_isa; ops.set_cpu_ngram_hash_isa pins one). Every width this CPU has, pinned
in turn, must give the scalar kernel's ids and the oracle's bit for bit: head counts that leave a
tail shorter than a vector, token counts that leave a block of mixes part full, orders whose mixes
sit in either half of AVX2's permute, int32 and int64 outputs in rows, strided columns and
transposed, and the floor modulo itself at the edges of int64 for head sizes up to 2^63 - 1.
test_kernel.py runs its parity tests on every width too; tests/cpp/ngram_hash_check.cpp checks
the reduction itself against 128-bit division."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from conftest import run_cpp_check
from ngram_support import CPU_HASH_ISAS, cpu_ngram_hash
from qwen4exp_ext import ops, reference

from .support import Layout, model_layout, random_layout

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_the_widths_are_what_the_cpu_has():
    """The run-time dispatch finds what /proc/cpuinfo says this CPU has (scalar always)."""
    flags = cpu_flags()
    want = ["scalar"]
    if "avx2" in flags:
        want.append("avx2")
    if {"avx512f", "avx512dq"} <= flags:
        want.append("avx512")
    assert CPU_HASH_ISAS == want


def test_the_switch():
    """The default is the widest this CPU has; a pinned width is what runs; a bad setting, or a
    width this CPU lacks, is a clear error naming it, and leaves the setting as it was."""
    previous = ops.set_cpu_ngram_hash_isa(None)
    try:
        assert ops.cpu_ngram_hash_isa() == CPU_HASH_ISAS[-1]
        for isa in CPU_HASH_ISAS:
            assert ops.set_cpu_ngram_hash_isa(isa) is None
            assert ops.cpu_ngram_hash_isa() == isa
            assert ops.set_cpu_ngram_hash_isa(None) == isa
        for bad in ("sse2", "AVX2", 0, True):
            with pytest.raises(ValueError, match="isa must be 'scalar', 'avx2', 'avx512' or None"):
                ops.set_cpu_ngram_hash_isa(bad)
        for missing in {"avx2", "avx512"} - set(CPU_HASH_ISAS):
            with pytest.raises(ValueError, match=f"the {missing} hash needs"):
                ops.set_cpu_ngram_hash_isa(missing)
        with pytest.raises(ValueError, match="isa must be -1 .* got 3"):
            torch.ops.qwen4exp.set_cpu_ngram_hash_isa(3)
        assert ops.cpu_ngram_hash_isa() == CPU_HASH_ISAS[-1]
    finally:
        ops.set_cpu_ngram_hash_isa(previous)


def chunked_batch(rng: random.Random, tokens: int, lay: Layout, vocab: int):
    """`tokens` tokens cut into 0..5 requests (some empty, some tokens past qsl[R]), EOS often."""
    cuts = sorted(rng.randint(0, tokens) for _ in range(rng.randint(0, 5)))
    qsl = [0, *cuts]
    if cuts and rng.random() < 0.5:
        qsl[-1] = tokens  # else the tokens past qsl[R] count as the last request's

    def token() -> int:
        return lay.eos if rng.random() < 0.1 else rng.randint(0, vocab - 1)

    requests = len(qsl) - 1
    input_ids = torch.tensor([token() for _ in range(tokens)], dtype=torch.int64)
    context = torch.tensor(
        [[token() for _ in range(lay.context_len)] for _ in range(requests)], dtype=torch.int64
    )
    return (
        input_ids,
        torch.tensor(qsl, dtype=torch.int32),
        context.reshape(requests, lay.context_len),
    )


def output_of(layout: str, tokens: int, heads: int, dtype: torch.dtype):
    """(output view, the tensor it lives in) for an output layout: "rows" (contiguous),
    "columns" (every other column of a wider tensor) or "transposed" (a head's ids contiguous)."""
    if layout == "rows":
        base = torch.full((tokens, heads), -7, dtype=dtype)
        return base, base
    if layout == "columns":
        base = torch.full((tokens, 2 * heads + 1), -7, dtype=dtype)
        return base[:, 1::2], base
    base = torch.full((heads, tokens), -7, dtype=dtype)
    return base.t(), base


# (N, K_h): NH = 1, 4, 5, 8, 23, 16 (the released layer), 14, 9, 12, 7, 21, 10. N >= 6 puts mixes
# in the upper half of a token's eight slots (AVX2 blends them in).
SHAPES = [(2, 1), (2, 4), (2, 5), (2, 8), (2, 23), (3, 8), (3, 7), (4, 3), (5, 3), (8, 1), (8, 3)]
SHAPES += [(6, 2)]
# T: a single token, tails of the 64-token blocks of mixes, several blocks.
TOKENS = [1, 3, 63, 65, 129, 301]


@pytest.mark.parametrize("isa", CPU_HASH_ISAS)
@pytest.mark.parametrize(("ngram_size", "heads_per_ngram"), SHAPES, ids=str)
@pytest.mark.parametrize("out_layout", ["rows", "columns", "transposed"])
def test_every_width_gives_the_scalar_ids_and_the_oracles(
    isa, ngram_size, heads_per_ngram, out_layout
):
    rng = random.Random(ngram_size * 100 + heads_per_ngram)
    for case, tokens in enumerate(TOKENS):
        lay = random_layout(rng, ngram_size, heads_per_ngram)
        heads = lay.sizes.numel()
        input_ids, qsl, context = chunked_batch(rng, tokens, lay, rng.choice([50, 2**40]))
        if case % 2:  # a strided input_ids view too
            input_ids = torch.stack([input_ids, input_ids + 1], dim=1)[:, 0]
        for dtype in (torch.int64, torch.int32):
            this = lay
            if dtype == torch.int32:  # every id must fit: small heads
                sizes = lay.sizes.clamp(max=1 << 20)
                offsets = torch.cumsum(sizes, 0) - sizes
                this = Layout(lay.multipliers, sizes, offsets, lay.heads_per_ngram, lay.eos)
            want = reference.ngram_ids(input_ids, qsl, context, *this.args()).to(dtype)
            results = {}
            for width in dict.fromkeys(("scalar", isa)):
                out, base = output_of(out_layout, tokens, heads, dtype)
                with cpu_ngram_hash(width):
                    ops.ngram_ids(input_ids, qsl, context, *this.args(), output=out)
                where = f"case {case}: T={tokens} NH={heads} {dtype} {width}"
                assert torch.equal(out, want), where
                assert int((base == -7).sum()) == base.numel() - out.numel(), f"{where}: stray"
                results[width] = out.clone()
            assert torch.equal(results[isa], results["scalar"])


# Head sizes from 1 to 2^63 - 1 (17 heads: two AVX-512 vectors and a tail of one, four AVX2 ones
# and a tail of one): 1, powers of two and their neighbours, a released size, odd ones near 2^63.
EDGE_SIZES = [1, 2, 3, 7, 1009, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**53 + 1]
EDGE_SIZES += [2**62, 2**62 + 1, 20_000_003, 2**63 - 25, 2**63 - 2, 2**63 - 1]


def edge_tokens(rng: random.Random) -> list[int]:
    """int64 values at the edges of every size's floor modulo: both ends of int64, 0 and its
    neighbours, each size's multiples and their neighbours, of either sign, and random ones."""
    values = {INT64_MIN, INT64_MIN + 1, -(2**62), -(2**32) - 1, -2, -1, 0, 1, 2, INT64_MAX}
    for s in EDGE_SIZES:
        for k in (1, 2, INT64_MAX // s):
            for delta in (-1, 0, 1):
                values.update({k * s + delta, -(k * s) + delta})
    values = sorted(v for v in values if INT64_MIN <= v <= INT64_MAX)
    values += [rng.randint(INT64_MIN, INT64_MAX) for _ in range(301)]
    return values


@pytest.mark.parametrize("isa", CPU_HASH_ISAS)
def test_the_floor_modulo_at_the_edges_of_int64(isa):
    """Multipliers (1, 0) make every token's bigram mix the token itself, so the floor modulo
    meets chosen int64 values: each id must be Python's `token % size` (a floor modulo, in
    [0, size) for negative tokens too), the oracle's and the scalar kernel's. Catches a high
    product that drops a carry, a q·d that wraps wrong, and a sign correction off by one."""
    rng = random.Random(11)
    tokens = edge_tokens(rng)
    heads = len(EDGE_SIZES)
    lay = Layout(
        torch.tensor([1, 0]),
        torch.tensor(EDGE_SIZES),
        torch.zeros(heads, dtype=torch.int64),  # offset 0: size 2^63 - 1 leaves no room
        heads,
        5,
    )
    input_ids = torch.tensor(tokens)
    qsl = torch.tensor([0, len(tokens)], dtype=torch.int32)
    context = torch.tensor([[5]])
    want = torch.tensor([[t % s for s in EDGE_SIZES] for t in tokens])
    assert torch.equal(reference.ngram_ids(input_ids, qsl, context, *lay.args()), want)
    for width in dict.fromkeys(("scalar", isa)):
        with cpu_ngram_hash(width):
            got = ops.ngram_ids(input_ids, qsl, context, *lay.args())
        mismatch = (got != want).nonzero()
        assert mismatch.numel() == 0, (
            f"{width}: first wrong (token, size): "
            f"{[(tokens[t], EDGE_SIZES[h]) for t, h in mismatch[:5].tolist()]}"
        )


@pytest.mark.parametrize("isa", CPU_HASH_ISAS)
def test_the_released_layer_at_prefill(isa):
    """The bench's prefill shape, T = 8192 over four requests with EOS inside, on the released
    layer's constants: every width the oracle's ids, on one thread and on every thread (the
    parallel chunks start mid-block)."""
    lay = model_layout(248320, 3, 8, 20_000_000, 1234, 0, eos=248044)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 248320, (8192,), generator=gen)
    input_ids[torch.rand(8192, generator=gen) < 1 / 64] = lay.eos
    qsl = torch.tensor([0, 2048, 4096, 6144, 8192], dtype=torch.int32)
    context = torch.randint(0, 248320, (4, 2), generator=gen)
    want = reference.ngram_ids(input_ids, qsl, context, *lay.args())
    threads = torch.get_num_threads()
    try:
        for count in dict.fromkeys((1, threads)):
            torch.set_num_threads(count)
            with cpu_ngram_hash(isa):
                got = ops.ngram_ids(input_ids, qsl, context, *lay.args())
            assert torch.equal(got, want), f"{count} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_the_reduction_against_128_bit_division(tmp_path):
    """tests/cpp/ngram_hash_check.cpp: the head reduction alone, in every width this CPU has,
    against the hardware's 128-bit division (every head count from 1 to 40, edge and random mixes
    and sizes up to 2^63 - 1, int32 and int64, contiguous and strided, no stray store)."""
    output = run_cpp_check(
        tmp_path, "ngram_hash_check", sources=("csrc/cpu/ngram_hash_simd.cpp",)
    ).split()
    assert int(output[1]) > 500_000
    assert int(output[4]) == len(CPU_HASH_ISAS)
