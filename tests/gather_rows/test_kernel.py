"""gather_rows (SPEC §4), the kernels against the oracle and against vLLM's lookups: every
(table dtype × id dtype × out dtype × shard) case bit-equal to the reference, fp8 and NVFP4
decoding, strided views, rows beyond element 2^31, the same output under a capped grid
(max_blocks), the CPU kernel's switches, opcheck and torch.compile — on every backend here.
SPEC's properties (shards sum to the whole, ids out of range give +0 rows) are in
test_properties.py, the errors in test_bad_inputs.py.

The CPU kernel has three paths: the cached one (csrc/cpu/gather_rows.cpp), the streaming one
(sorted reads, non-temporal stores; csrc/cpu/gather_rows_stream.cpp) and the plain one (a row
after another, as index_select); large outputs take the one timed fastest on the machine. Every
CPU test here runs on each: the ``cpu_path`` fixture (support.py) pins it. The timed choice
itself is tested in test_path_choice.py.
"""

from __future__ import annotations

import gc
import itertools
import math

import pytest
import torch

from conftest import backends
from gather_support import (
    CPU_FP8_LOOKUPS,
    CPU_PATHS,
    FP8_NAN_BYTES,
    GRID_CAPS,
    blocks_for,
    cpu_fp8_lookup,
    every_fp8_code_rows,
    grid_cap_row,
    make_table,
    take_launch_record,
)
from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.testing import assert_exact, bit_patterns, same_layout

from .support import cpu_path, random_ids  # noqa: F401 - cpu_path: the fixture

pytestmark = pytest.mark.usefixtures("cpu_path")  # every test once per CPU gather path

BACKENDS = backends()
FP8 = reference.FP8_DTYPES
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, *FP8)
OUT_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
SHARDS = ("none", "middle", "head", "tail", "empty")


def shard_bounds(kind: str, rows: int) -> tuple[int, int | None]:
    """(vocab_start, vocab_end) of a rank owning part of a global vocabulary of ~2.5·rows ids."""
    return {
        "none": (0, None),
        "middle": (rows + 3, 2 * rows + 3),
        "head": (0, max(rows - 5, 1)),
        "tail": (rows // 2, rows // 2 + rows),
        "empty": (7, 7),
    }[kind]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES, ids=str)
@pytest.mark.parametrize("shard", SHARDS)
def test_matches_reference(backend, table_dtype, shard):
    """Every out dtype and id dtype for this (table dtype, shard), on odd shapes."""
    ops, device = backend.ops, backend.device
    gen = torch.Generator().manual_seed(hash((str(table_dtype), shard)) % 2**31)
    for (rows, width, tokens, heads), out_dtype, id_dtype in itertools.product(
        [(1009, 24, 37, 5), (151, 160, 9, 16), (64, 7, 13, 3), (3, 1, 5, 2)],
        OUT_DTYPES,
        ID_DTYPES,
    ):
        table = make_table(rows, width, table_dtype, gen=gen)
        scale = torch.tensor([0.0371]) if table_dtype in FP8 else None
        start, end = shard_bounds(shard, rows)
        ids = random_ids(tokens, heads, end if end is not None else rows, id_dtype, gen)
        expected = reference.gather_rows(
            table, ids, scale=scale, vocab_start=start, vocab_end=end, out_dtype=out_dtype
        )
        got = ops.gather_rows(
            table.to(device),
            ids.to(device),
            scale=None if scale is None else scale.to(device),
            vocab_start=start,
            vocab_end=end,
            out_dtype=out_dtype,
        )
        assert_exact(got, expected, bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("table_dtype", FP8, ids=str)
@pytest.mark.parametrize("scale", [1.0, -0.5, 3.0e-5, 700.0, 1.0e30])
def test_fp8_scales(backend, table_dtype, scale):
    """Every fp8 byte through every out dtype: the scale is rounded to the out dtype first, then
    one rounding of the product (overflow to inf included); unowned rows stay +0 even when the
    scale is negative. A scale that overflows the out dtype makes 0 * inf: a NaN whose sign and
    payload are the hardware's (x86 sets the sign, NVIDIA GPUs do not), so NaN matches any NaN."""
    ops, device = backend.ops, backend.device
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    for nan in FP8_NAN_BYTES[table_dtype]:
        table[table == nan] = 0
    table = table.view(table_dtype)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, -1]])
    s = torch.tensor([scale])
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        expected = reference.gather_rows(table, ids, scale=s, out_dtype=out_dtype)
        got = ops.gather_rows(
            table.to(device), ids.to(device), scale=s.to(device), out_dtype=out_dtype
        )
        assert_exact(got, expected, bitwise=True, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("table_dtype", FP8, ids=str)
@pytest.mark.parametrize(
    "scale",
    # Scales whose outputs stay normal and finite for every code (the CPU's AVX2 kernel factors
    # the table then), and scales whose outputs overflow, turn subnormal, or are all NaN or zero.
    [0.0123, -0.5, 1.0, 7.0e4, 3.0e-38, 1.0e30, math.inf, math.nan, 0.0, -0.0],
)
def test_fp8_every_code_in_long_rows(backend, table_dtype, scale):
    """Every fp8 byte, the NaNs included, at every position of rows long enough for the CPU's
    vector lookups (32 codes a step) and their tails: each output as the scalar dequantisation
    gives it, bit for bit (any NaN for a NaN)."""
    ops, device = backend.ops, backend.device
    table = every_fp8_code_rows(table_dtype)
    ids = torch.arange(table.shape[0]).reshape(-1, 4)
    s = torch.tensor([scale])
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        expected = reference.gather_rows(table, ids, scale=s, out_dtype=out_dtype)
        got = ops.gather_rows(
            table.to(device), ids.to(device), scale=s.to(device), out_dtype=out_dtype
        )
        assert_exact(got, expected, f"{out_dtype}", bitwise=True, equal_nan=True)


@pytest.mark.parametrize("lookup", CPU_FP8_LOOKUPS)
@pytest.mark.parametrize("table_dtype", FP8, ids=str)
@pytest.mark.parametrize("scale", [0.0123, -0.5, 3.0e-38, 1.0e30, math.nan])
def test_cpu_fp8_lookups(lookup, table_dtype, scale):
    """Each fp8 conversion this CPU has, pinned (the kernel runs only the widest by default), on
    both CPU paths: every byte at every position of long rows in every output dtype, and rows of
    the released width into outputs at every alignment the streaming path tells apart (64-byte
    aligned rows are streamed straight from the AVX-512 lookup, 32-byte aligned ones from the
    AVX2 one; others go through a stage)."""
    long_rows = every_fp8_code_rows(table_dtype)
    gen = torch.Generator().manual_seed(3)
    released = make_table(5000, 160, table_dtype, gen=gen)
    released_ids = torch.randint(0, 5000, (40, 16), generator=gen)
    s = torch.tensor([scale])
    with cpu_fp8_lookup(lookup):
        assert ops.cpu_gather_fp8_lookup() == lookup
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            ids = torch.arange(long_rows.shape[0]).reshape(-1, 4)
            expected = reference.gather_rows(long_rows, ids, scale=s, out_dtype=out_dtype)
            got = ops.gather_rows(long_rows, ids, scale=s, out_dtype=out_dtype)
            assert_exact(got, expected, f"{out_dtype}", bitwise=True, equal_nan=True)
            expected = reference.gather_rows(released, released_ids, scale=s, out_dtype=out_dtype)
            for offset in (0, 64 // expected.element_size() // 2, 1):  # 64-, 32-, 2-byte aligned
                buffer = torch.full((40, 16 * 160 + 64), 5.0, dtype=out_dtype)
                out = buffer[:, offset : offset + 16 * 160]
                ops.gather_rows(released, released_ids, scale=s, output=out)
                assert_exact(
                    out, expected, f"{out_dtype} at +{offset}", bitwise=True, equal_nan=True
                )


def test_cpu_fp8_lookup_switch():
    """The default is the widest this CPU has; a bad setting is a clear error."""
    previous = ops.set_cpu_gather_fp8_lookup(None)
    try:
        assert ops.cpu_gather_fp8_lookup() == CPU_FP8_LOOKUPS[-1]
        assert ops.set_cpu_gather_fp8_lookup("scalar") is None
        assert ops.cpu_gather_fp8_lookup() == "scalar"
        assert ops.set_cpu_gather_fp8_lookup(None) == "scalar"
        for bad in ("sse2", 0, True):
            with pytest.raises(
                ValueError, match="lookup must be 'scalar', 'avx2', 'avx512' or None"
            ):
                ops.set_cpu_gather_fp8_lookup(bad)
        for missing in {"avx2", "avx512"} - set(CPU_FP8_LOOKUPS):
            with pytest.raises(ValueError, match=f"the {missing} lookup needs"):
                ops.set_cpu_gather_fp8_lookup(missing)
        assert ops.cpu_gather_fp8_lookup() == CPU_FP8_LOOKUPS[-1]
    finally:
        ops.set_cpu_gather_fp8_lookup(previous)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_strided_views(backend, table_dtype):
    """ids as a non-contiguous view, the table as a column slice of a wider one (row stride > d),
    the output as a column slice of a wider buffer; the columns around it stay untouched."""
    ops, device = backend.ops, backend.device
    wide_table = make_table(300, 40, table_dtype).to(device)
    table = wide_table[:, 8:32]  # d = 24, row stride 40
    scale = torch.tensor([0.25], device=device) if table_dtype in FP8 else None
    ids = random_ids(20, 6, 300, torch.int64).to(device)
    strided_ids = torch.stack([ids, ids + 1], dim=2)[:, :, 0]
    assert not strided_ids.is_contiguous() and not table.is_contiguous()
    buffer = torch.full((20, 6 * 24 + 10), 7.0, dtype=torch.bfloat16, device=device)
    out = buffer[:, 3 : 3 + 6 * 24]
    ops.gather_rows(table, strided_ids, scale=scale, output=out)
    expected = reference.gather_rows(
        table.cpu(), ids.cpu(), scale=None if scale is None else scale.cpu()
    )
    assert_exact(out, expected, bitwise=True)
    assert torch.all(buffer[:, :3] == 7) and torch.all(buffer[:, 3 + 6 * 24 :] == 7)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_batched_ids_and_edges(backend):
    """[..., NH] ids keep their leading dims; T = 0, NH = 0 and an empty table give empty or zero
    outputs without reading anything."""
    ops, device = backend.ops, backend.device
    table = make_table(40, 16, torch.float16).to(device)
    ids = torch.randint(0, 40, (2, 3, 4), device=device)
    got = ops.gather_rows(table, ids)
    assert got.shape == (2, 3, 64)
    assert_exact(got.reshape(6, 64), reference.gather_rows(table, ids.reshape(6, 4)), bitwise=True)
    assert ops.gather_rows(table, torch.empty(0, 4, dtype=torch.long, device=device)).shape == (
        0,
        64,
    )
    assert ops.gather_rows(table, torch.empty(5, 0, dtype=torch.long, device=device)).shape == (
        5,
        0,
    )
    empty = table[:0]
    zeros = ops.gather_rows(empty, torch.tensor([[0, 1, -1]], device=device))
    assert zeros.shape == (1, 48) and torch.all(bit_patterns(zeros.cpu()) == 0)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES, ids=str)
def test_many_blocks_wide_rows_and_zero_rows(backend, table_dtype):
    """Beyond one unit of work: 16000 items (16 blocks on the cached path, 4 sorted blocks on
    the streaming one with 2 threads), ids out of range and repeated, 3-element heads (rows
    not whole cache lines) and 700-element heads (a converted fp32 row is 2800 bytes, more than
    one staging buffer), a shard, a strided output."""
    ops, device = backend.ops, backend.device
    gen = torch.Generator().manual_seed(11)
    for rows, width, tokens, heads, shard in [
        (50_000, 3, 1000, 16, "none"),
        (20_000, 24, 1000, 16, "middle"),
        (600, 700, 20, 16, "tail"),
    ]:
        table = make_table(rows, width, table_dtype, gen=gen)
        scale = torch.tensor([0.0371]) if table_dtype in FP8 else None
        start, end = shard_bounds(shard, rows)
        ids = random_ids(tokens, heads, end if end is not None else rows, torch.int32, gen)
        ids[::7] = ids[0]  # repeated rows
        for out_dtype in (None, torch.float32):
            expected = reference.gather_rows(
                table, ids, scale=scale, vocab_start=start, vocab_end=end, out_dtype=out_dtype
            )
            buffer = torch.full(
                (tokens, heads * width + 5), 3.0, dtype=expected.dtype, device=device
            )
            out = buffer[:, 1 : 1 + heads * width]
            ops.gather_rows(
                table.to(device),
                ids.to(device),
                scale=None if scale is None else scale.to(device),
                vocab_start=start,
                vocab_end=end,
                output=out,
            )
            assert_exact(out, expected, bitwise=True)
            assert torch.all(buffer[:, :1] == 3) and torch.all(buffer[:, 1 + heads * width :] == 3)


@pytest.mark.skipif("stream" not in CPU_PATHS, reason="this CPU has no streaming path")
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_streaming_sorted_and_output_order(table_dtype, threads):
    """The streaming path sorts a block's rows by table row unless its distinct rows fit in a
    thread's share of the threshold; then it copies them in output order. With the threshold at
    a quarter of the output, fresh ids take the sorted branch and ids drawn from 8 rows the
    other; both, and a mix (a block of each kind), give the reference's rows."""
    gen = torch.Generator().manual_seed(5)
    rows, width, tokens, heads = 40_000, 160, 600, 16
    table = make_table(rows, width, table_dtype, gen=gen)
    scale = torch.tensor([0.5]) if table_dtype == torch.float8_e4m3fn else None
    fresh = random_ids(tokens, heads, rows, torch.int64, gen)
    few = torch.randint(0, rows, (8,), generator=gen)
    duplicates = few[torch.randint(0, 8, (tokens, heads), generator=gen)]
    mixed = torch.cat((fresh[: tokens // 2], duplicates[tokens // 2 :]))
    mixed[::5, 3] = -1  # zero rows in both kinds of block
    out_bytes = tokens * heads * width * 2
    previous_threads = torch.get_num_threads()
    previous = ops.set_cpu_gather_stream_bytes(out_bytes // 4)
    previous_path = ops.set_cpu_gather_path(None)  # the threshold decides, not the fixture's pin
    try:
        torch.set_num_threads(threads)
        assert ops.cpu_gather_path(out_bytes) == "stream"
        for ids in (fresh, duplicates, mixed):
            expected = reference.gather_rows(table, ids, scale=scale, out_dtype=torch.bfloat16)
            got = ops.gather_rows(table, ids, scale=scale, out_dtype=torch.bfloat16)
            assert_exact(got, expected, bitwise=True)
    finally:
        ops.set_cpu_gather_path(previous_path)
        ops.set_cpu_gather_stream_bytes(previous)
        torch.set_num_threads(previous_threads)


def test_cpu_gather_stream_bytes_switch():
    """The threshold is set through ops.set_cpu_gather_stream_bytes (None: the default, from the
    cache sizes), which returns the setting it replaces; a bad value is a clear error. The
    environment is read at import only (tests/test_switches.py)."""
    previous = ops.set_cpu_gather_stream_bytes(None)
    try:
        if "stream" not in CPU_PATHS:
            assert ops.set_cpu_gather_stream_bytes(0) is None
            assert ops.cpu_gather_stream_bytes() == -1
            return
        assert ops.cpu_gather_stream_bytes() >= 1 << 20  # what this process can keep in cache
        assert ops.set_cpu_gather_stream_bytes(12345) is None
        assert ops.cpu_gather_stream_bytes() == 12345
        assert ops.set_cpu_gather_stream_bytes(0) == 12345
        assert ops.cpu_gather_stream_bytes() == 0
        for bad in (-1, 1.5, "12 MB", True):
            with pytest.raises(ValueError, match="stream_bytes must be an int >= 0 or None"):
                ops.set_cpu_gather_stream_bytes(bad)
        assert ops.cpu_gather_stream_bytes() == 0
    finally:
        ops.set_cpu_gather_stream_bytes(previous)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_rows_beyond_element_2_31(backend):
    """64-bit offsets: an fp8 table of 2^31 + 160·1024 elements (2.1 GB of address space; only the
    pages that are written or read are ever backed), rows gathered from past element 2^31."""
    if backend.device != "cpu":
        pytest.skip("a 2.1 GB table on the GPU is out of scope for the tests")
    ops = backend.ops
    width = 160
    rows = 2**31 // width + 1024
    table = torch.empty(rows, width, dtype=torch.uint8)
    try:
        probe = [
            0,
            5,
            rows // 2,
            2**31 // width - 1,
            2**31 // width,
            2**31 // width + 1,
            rows - 2,
            rows - 1,
        ]
        gen = torch.Generator().manual_seed(3)
        for r in probe:
            row = torch.randint(0, 127, (width,), dtype=torch.uint8, generator=gen)
            table[r] = row
        table8 = table.view(torch.float8_e4m3fn)
        ids = torch.tensor([probe, probe[::-1]], dtype=torch.int64)
        ids = torch.cat([ids, torch.tensor([[rows, -1, 2**31, rows - 1, 0, 1, 2, 3]])])
        scale = torch.tensor([0.5])
        for id_dtype in ID_DTYPES:
            got = ops.gather_rows(table8, ids.to(id_dtype), scale=scale)
            expected = reference.gather_rows(table8, ids, scale=scale)
            assert_exact(got, expected, bitwise=True)
        # Past 2^31 *bytes of output* too is out of scope for CI memory; the shard path here:
        got = ops.gather_rows(
            table8[rows - 8 :], ids, scale=scale, vocab_start=rows - 8, vocab_end=rows
        )
        assert_exact(
            got,
            reference.gather_rows(
                table8[rows - 8 :], ids, scale=scale, vocab_start=rows - 8, vocab_end=rows
            ),
            bitwise=True,
        )
    finally:
        del table
        gc.collect()


# ---- NVFP4 tables ----------------------------------------------------------------------------
#
# vLLM's layout: uint8 [rows, d/2] (two E2M1 codes per byte), float8_e4m3fn block scales
# [rows, d/16], one fp32 global scale. Oracles: the reference (here, every backend), vLLM 0.33.0's
# Triton lookup under the interpreter and vLLM's CPU `dequantize_to_dtype` (below).
E4M3FN_NAN_BYTES = FP8_NAN_BYTES[torch.float8_e4m3fn]


def make_nvfp4(rows: int, width: int, *, gen=None, row_stride=None, scale_stride=None):
    """(packed table, block scales) of `rows` rows of `width` elements: every byte pattern of the
    codes, block scales from every finite e4m3fn byte, and optionally wider rows (strided views:
    the tensors are column slices of wider buffers)."""
    packed_width, blocks = width // 2, width // reference.NVFP4_BLOCK
    wide = torch.randint(
        0, 256, (rows, row_stride or packed_width), dtype=torch.uint8, generator=gen
    )
    raw_scales = torch.randint(
        0, 256, (rows, scale_stride or blocks), dtype=torch.uint8, generator=gen
    )
    for nan in E4M3FN_NAN_BYTES:
        raw_scales[raw_scales == nan] = 0x38  # 1.0
    return wide[:, :packed_width], raw_scales.view(torch.float8_e4m3fn)[:, :blocks]


def gather_on(backend, table, ids, **kwargs):
    """``backend.ops.gather_rows`` with every tensor argument moved to the backend's device."""
    device = backend.device
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return backend.ops.gather_rows(table.to(device), ids.to(device), **moved)


NVFP4_SHAPES = [(1009, 160, 37, 5), (151, 16, 9, 16), (64, 48, 13, 3), (3, 32, 5, 2)]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("shard", SHARDS)
def test_nvfp4_matches_reference(backend, shard):
    """Every out dtype and id dtype, on rows of 1, 2, 3 and 10 blocks (16 elements: no whole
    16-byte piece; 48: not a multiple of 32), ids out of range, shards."""
    gen = torch.Generator().manual_seed(hash(("nvfp4", shard)) % 2**31)
    for (rows, width, tokens, heads), out_dtype, id_dtype in itertools.product(
        NVFP4_SHAPES, OUT_DTYPES, ID_DTYPES
    ):
        table, block_scales = make_nvfp4(rows, width, gen=gen)
        scale = torch.tensor([0.37])
        start, end = shard_bounds(shard, rows)
        ids = random_ids(tokens, heads, end if end is not None else rows, id_dtype, gen)
        args = dict(
            scale=scale,
            block_scales=block_scales,
            vocab_start=start,
            vocab_end=end,
            out_dtype=out_dtype,
        )
        expected = reference.gather_rows(table, ids, **args)
        got = gather_on(backend, table, ids, **args)
        assert got.dtype == (out_dtype or torch.bfloat16) and got.shape == (tokens, heads * width)
        assert_exact(got, expected, bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("scale", [1.0, -0.5, 3.0e-5, 1.0e30, 1.0e-38])
def test_nvfp4_every_code_and_scale_byte(backend, scale):
    """All 16 codes under all 256 block-scale bytes (NaN scales give NaN, overflow gives inf,
    tiny global scales give subnormals), every out dtype; unowned rows stay +0."""
    codes = torch.arange(16, dtype=torch.uint8)
    row = (codes[0::2] | (codes[1::2] << 4)).repeat(2)  # codes 0..15 twice: 32 elements
    table = row.repeat(256, 1)
    block_scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    block_scales = block_scales[:, None].repeat(1, 2).view(torch.float8_e4m3fn)
    ids = torch.cat([torch.arange(256), torch.tensor([-1, 256])])[:, None]
    s = torch.tensor([scale])
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        expected = reference.gather_rows(
            table, ids, scale=s, block_scales=block_scales, out_dtype=out_dtype
        )
        got = gather_on(
            backend, table, ids, scale=s, block_scales=block_scales, out_dtype=out_dtype
        ).cpu()
        nan = torch.isnan(expected)
        assert bool(nan[0x7F].all()) and bool(torch.isnan(got[nan]).all())
        assert_exact(
            torch.where(nan, 0.0, got).to(out_dtype), torch.where(nan, 0.0, expected), bitwise=True
        )
        assert torch.all(bit_patterns(got[256:]) == 0)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_nvfp4_strided_views(backend):
    """Table and block scales as column slices of wider buffers (row strides 100 > d/2 and
    13 > d/16), non-contiguous ids, a strided output whose neighbours stay untouched."""
    ops, device = backend.ops, backend.device
    table, block_scales = make_nvfp4(200, 64, row_stride=100, scale_stride=13)
    assert not table.is_contiguous() and not block_scales.is_contiguous()
    ids = random_ids(20, 6, 200, torch.int64)
    strided_ids = torch.stack([ids, ids + 1], dim=2)[:, :, 0]
    scale = torch.tensor([2.5])
    buffer = torch.full((20, 6 * 64 + 10), 7.0, dtype=torch.float16, device=device)
    out = buffer[:, 3 : 3 + 6 * 64]
    on_device = [same_layout(t, device) for t in (table, strided_ids, block_scales)]
    assert not any(t.is_contiguous() for t in on_device)
    ops.gather_rows(
        on_device[0],
        on_device[1],
        scale=scale.to(device),
        block_scales=on_device[2],
        output=out,
    )
    expected = reference.gather_rows(
        table, ids, scale=scale, block_scales=block_scales, out_dtype=torch.float16
    )
    assert_exact(out, expected, bitwise=True)
    assert torch.all(buffer[:, :3] == 7) and torch.all(buffer[:, 3 + 6 * 64 :] == 7)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_nvfp4_many_blocks(backend):
    """16000 items of the released row shape (d = 160): many units of work on either CPU path."""
    ops, device = backend.ops, backend.device
    gen = torch.Generator().manual_seed(11)
    table, block_scales = make_nvfp4(5000, 160, gen=gen)
    ids = random_ids(1000, 16, 5000, torch.int64, gen)
    scale = torch.tensor([0.0123])
    expected = reference.gather_rows(table, ids, scale=scale, block_scales=block_scales)
    got = ops.gather_rows(
        table.to(device),
        ids.to(device),
        scale=scale.to(device),
        block_scales=block_scales.to(device),
    )
    assert_exact(got, expected, bitwise=True)


def _vllm_nvfp4_lookup():
    kernels = vllm_triton.load_nvfp4_lookup()
    if kernels is None:
        pytest.skip("vLLM 0.33.0 or triton is not installed")
    return kernels


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nvfp4_equals_vllm_triton_lookup(backend, out_dtype):
    """vLLM 0.33.0's `_lookup_nvfp4_ple_embedding_kernel` (Triton's interpreter), shard ids
    included. Its fp32 rows are the oracle, rounded to `out_dtype` to nearest even, as the GPU's
    store conversion does (Triton's default "rtne"): the interpreter's own fp32 → bf16 downcast
    truncates (triton-lang/triton#8322), which no GPU does."""
    kernels = _vllm_nvfp4_lookup()
    if torch.cuda.is_available():
        pytest.skip("the interpreter oracle runs on a machine without a GPU")
    ops, device = backend.ops, backend.device
    gen = torch.Generator().manual_seed(12)
    rows, width, count = 300, 160, 400
    table, block_scales = make_nvfp4(rows, width, gen=gen)
    table, block_scales = table.contiguous(), block_scales.contiguous()
    start, end = 1000, 1000 + rows - 7
    ids = torch.randint(start - 50, end + 50, (count,), generator=gen)
    scale = torch.tensor([0.37])
    rows_f32 = torch.empty(count, width, dtype=torch.float32)
    with vllm_triton.interpreter():
        kernels._lookup_nvfp4_ple_embedding_kernel[(count,)](
            table,
            block_scales.view(torch.uint8),
            scale,
            ids,
            rows_f32,
            width,
            start,
            end,
            BLOCK_D=256,
        )
    got = ops.gather_rows(
        table.to(device),
        ids[:, None].to(device),
        scale=scale.to(device),
        block_scales=block_scales.to(device),
        vocab_start=start,
        vocab_end=end,
        out_dtype=out_dtype,
    )
    assert_exact(got, rows_f32.to(out_dtype), bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nvfp4_against_vllm_cpu_dequantize_to_dtype(backend, out_dtype):
    """vLLM's CPU path (`dequantize_to_dtype`, used by its NVFP4 `embedding` off the GPU) folds
    the two scales first, e2m1 · fp32(block · global): equal to ours (and vLLM's GPU kernel)
    wherever the E2M1 magnitude is 0 or a power of two, and one fp32 rounding apart elsewhere,
    so at most one unit of `out_dtype` apart once rounded."""
    try:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
            dequantize_to_dtype,
        )
    except Exception as error:  # noqa: BLE001 - vLLM absent or not importable here
        pytest.skip(f"vLLM's nvfp4_emulation_utils is not importable: {error}")
    gen = torch.Generator().manual_seed(13)
    table, block_scales = make_nvfp4(500, 160, gen=gen)
    table, block_scales = table.contiguous(), block_scales.contiguous()
    scale = torch.tensor([0.37])
    ids = torch.arange(500)[:, None]
    ours = gather_on(
        backend, table, ids, scale=scale, block_scales=block_scales, out_dtype=out_dtype
    ).cpu()
    theirs = dequantize_to_dtype(table, block_scales, scale, out_dtype, swizzle=False)
    codes = torch.stack((table & 0xF, table >> 4), dim=-1).reshape(500, 160) & 7
    power_of_two = torch.isin(codes, torch.tensor([0, 1, 2, 4, 6], dtype=torch.uint8))
    assert_exact(ours[power_of_two], theirs[power_of_two], bitwise=True)
    # Same sign, so adjacent values are adjacent bit patterns.
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))
    units = (bit_patterns(ours).long() - bit_patterns(theirs).long()).abs()
    assert int(units.max()) <= 1
    if out_dtype == torch.float32:
        assert bool((units > 0).any()), "the two rounding orders should differ somewhere"


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_nvfp4_opcheck(backend):
    device = backend.device
    table, block_scales = make_nvfp4(70, 48)
    ids = random_ids(9, 5, 60, torch.int64).to(device)
    out = torch.empty(9, 5 * 48, dtype=torch.bfloat16, device=device)
    # No allclose for fp8 (the block scales): the schema check is left out, the bytes compared.
    before = block_scales.view(torch.uint8).clone()
    torch.library.opcheck(
        backend.library.gather_rows.default,
        (
            table.to(device),
            ids,
            torch.tensor([0.5], device=device),
            block_scales.to(device),
            3,
            63,
            out,
        ),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    assert torch.equal(block_scales.view(torch.uint8), before)


OPCHECK_CASES = [
    (torch.bfloat16, torch.int64, torch.bfloat16, 0, None),
    (torch.float32, torch.int32, torch.float16, 0, None),
    (torch.float16, torch.int64, torch.float32, 20, 90),
    (torch.float8_e4m3fn, torch.int32, torch.bfloat16, 0, None),
    (torch.float8_e4m3fnuz, torch.int64, torch.float32, 5, 50),
    (torch.float8_e4m3fn, torch.int64, torch.float16, 100, 100),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(backend, case):
    device = backend.device
    table_dtype, id_dtype, out_dtype, start, end = case
    table = make_table(70, 24, table_dtype).to(device)
    # end None: the op's own default, vocab_start + rows.
    ids = random_ids(9, 5, start + 70 if end is None else end, id_dtype).to(device)
    scale = torch.tensor([0.5], device=device) if table_dtype in FP8 else None
    out = torch.empty(9, 5 * 24, dtype=out_dtype, device=device)
    utils = None
    if table_dtype in FP8:
        # torch's schema checker compares inputs before/after with allclose, which has no fp8
        # kernel; the other three checks run, and the table's bytes are compared here instead.
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        before = table.view(torch.uint8).clone()
    torch.library.opcheck(
        backend.library.gather_rows.default,
        (table, ids, scale, None, start, end, out),
        **({} if utils is None else {"test_utils": utils}),
    )
    if table_dtype in FP8:
        assert torch.equal(table.view(torch.uint8), before)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_torch_compile_smoke(backend):
    ops, device = backend.ops, backend.device
    table = make_table(64, 16, torch.float8_e4m3fn).to(device)
    scale = torch.tensor([0.125], device=device)

    @torch.compile(fullgraph=True, dynamic=True)
    def embed(ids):
        return ops.gather_rows(table, ids, scale=scale, out_dtype=torch.float32) * 2

    ids = torch.randint(0, 64, (7, 3), device=device)
    eager = ops.gather_rows(table, ids, scale=scale, out_dtype=torch.float32) * 2
    assert_exact(embed(ids), eager, bitwise=True)
    ids = torch.randint(0, 64, (12, 3), device=device)
    assert_exact(
        embed(ids),
        ops.gather_rows(table, ids, scale=scale, out_dtype=torch.float32) * 2,
        bitwise=True,
    )


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_torch_compile_into_an_output(backend):
    # With an output the door takes its fast path, which Dynamo must trace to the OpOverload.
    ops, device = backend.ops, backend.device
    table = make_table(64, 16, torch.bfloat16).to(device)

    @torch.compile(fullgraph=True, dynamic=True)
    def embed(ids, out):
        ops.gather_rows(table, ids, vocab_start=8, output=out)
        return out * 2

    for tokens in (7, 12):
        ids = torch.randint(0, 80, (tokens, 3), device=device)
        out = torch.empty(tokens, 48, dtype=torch.bfloat16, device=device)
        eager = ops.gather_rows(table, ids, vocab_start=8) * 2
        assert_exact(embed(ids, out), eager, bitwise=True)
        assert_exact(out * 2, eager, bitwise=True)


# ---- max_blocks: a capped grid gives the same output -------------------------------------------

GRID_CAP_FORMATS = (*TABLE_DTYPES, "nvfp4")


def grid_cap_case(table_format, path: str, id_dtype, gen):
    """(table, ids, gather kwargs, the uncapped grid) of a gather that takes the HIP kernel
    `path` ("vector": rows in 16-byte pieces; "scalar": rows that are not), with more work than
    GRID_CAPS[-1] blocks do in one pass (gather_support). T is odd, the ids an int32 or int64
    strided view, the table a shard [3, rows - 1) of a larger vocabulary."""
    rows, heads = 300, 16
    nvfp4 = table_format == "nvfp4"
    width, unit, per_block = grid_cap_row(table_format, path)
    tokens = (GRID_CAPS[-1] * per_block) // (heads * unit) + 1
    tokens |= 1  # odd
    blocks = blocks_for(tokens * heads * unit, per_block)
    assert blocks > GRID_CAPS[-1], "every cap must leave blocks more than one pass"
    kwargs = dict(vocab_start=3, vocab_end=rows - 1)
    if nvfp4:
        table, block_scales = make_nvfp4(rows, width, gen=gen)
        kwargs.update(scale=torch.tensor([0.37]), block_scales=block_scales)
    else:
        table = make_table(rows, width, table_format, gen=gen)
        if table_format in FP8:
            kwargs["scale"] = torch.tensor([0.0371])
    ids = random_ids(tokens, heads, rows + 2, id_dtype, gen)
    return table, ids, kwargs, blocks


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("table_format", GRID_CAP_FORMATS, ids=str)
@pytest.mark.parametrize("path", ["vector", "scalar"])
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
def test_max_blocks_gives_the_same_output(backend, table_format, path, id_dtype):
    """Under max_blocks in GRID_CAPS the output equals the uncapped one bit for bit (and the
    reference), in an output filled with NaN first, so that a kernel that did not stride over its
    grid would leave NaN rows. On the emulator the launch record shows the cap kept and the
    uncapped grid of the kernel the case means to take. The CPU kernel takes the argument and
    ignores it."""
    device = backend.device
    seed = GRID_CAP_FORMATS.index(table_format) * 4 + ["vector", "scalar"].index(path) * 2
    gen = torch.Generator().manual_seed(seed + ID_DTYPES.index(id_dtype))
    table, ids, kwargs, blocks = grid_cap_case(table_format, path, id_dtype, gen)
    expected = reference.gather_rows(table, ids, **kwargs)
    strided = torch.stack([ids, ids.flip(0)], dim=2).to(device)[:, :, 0]
    assert not strided.is_contiguous()
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def gather(max_blocks):
        out = torch.full(expected.shape, math.nan, dtype=expected.dtype, device=device)
        take_launch_record(backend)
        backend.ops.gather_rows(
            table.to(device), strided, output=out, max_blocks=max_blocks, **moved
        )
        return out, take_launch_record(backend)

    uncapped, record = gather(0)
    assert_exact(uncapped, expected, "uncapped", bitwise=True)
    if record is not None:
        assert record == (1, blocks), f"uncapped launches (count, most blocks): {record}"
    for cap in GRID_CAPS:
        got, record = gather(cap)
        assert_exact(got, uncapped, f"max_blocks={cap}", bitwise=True)
        if record is not None:
            assert record == (1, cap), f"max_blocks={cap}: launches (count, most blocks) {record}"


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_max_blocks_keeps_the_positional_schema(backend):
    """max_blocks is the schema's last argument with a default: a caller of the older seven
    arguments runs uncapped, and the eighth caps; opcheck (the fake's rules too) with it."""
    device = backend.device
    table = make_table(70, 24, torch.bfloat16).to(device)
    ids = random_ids(9, 5, 70, torch.int64).to(device)
    op = backend.library.gather_rows.default
    outputs = [torch.full((9, 5 * 24), math.nan, dtype=torch.bfloat16, device=device)]
    op(table, ids, None, None, 0, None, outputs[0])
    for extra in ((1,), (0,)):
        outputs.append(torch.full_like(outputs[0], math.nan))
        op(table, ids, None, None, 0, None, outputs[-1], *extra)
    outputs.append(torch.full_like(outputs[0], math.nan))
    op(table, ids, None, None, 0, None, outputs[-1], max_blocks=2)
    for out in outputs:
        assert_exact(out, reference.gather_rows(table.cpu(), ids.cpu()), bitwise=True)
    torch.library.opcheck(op, (table, ids, None, None, 0, None, outputs[0], 3))
