"""ngram_gather_rows: ngram_ids then gather_rows in one op. On every backend it must equal the
oracle's composition (reference.ngram_ids, then reference.gather_rows of those ids) bit for bit,
for every table format and output dtype, n-gram orders that take the GPU kernel's unrolled window
and its generic one, vocabulary shards, requests with EOS inside and empty ones, strided inputs
and outputs, NVFP4 tables and tables whose rows are not 16-byte pieces (these, and orders other
than N = 3, take the GPU glue's other path: the two kernels through an ids buffer); the same
output under a capped grid (max_blocks) on both paths; plus opcheck and the errors of its own
arguments (named after the op; its bad-input cases are bad_inputs.py's)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import backends
from gather_support import (
    GRID_CAPS,
    IDS_ELEMENTS_PER_BLOCK,
    blocks_for,
    grid_cap_row,
    make_table,
    take_launch_record,
)
from ngram_support import HASHING_ARGS, hash_cases, hash_width  # noqa: F401 - hash_width: the fixture
from qwen4exp_ext import ops, reference
from qwen4exp_ext.testing import assert_exact, same_layout

from .support import EOS, VOCAB, call, expected, make_batch

BACKENDS = backends()
# Every backend, the CPU kernel once per hash width this CPU has (scalar, AVX2, AVX-512).
HASH_CASES = hash_cases(BACKENDS)

pytestmark = pytest.mark.usefixtures("hash_width")  # HASH_CASES tests: their width


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
@pytest.mark.parametrize("ngram_size", [2, 3, 5])  # context 1, 2 (unrolled on the GPU), 4
@pytest.mark.parametrize(
    "table_dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz],
)
@pytest.mark.parametrize("width", [8, 32, 5])  # 5, and fp8 at 8: rows not 16-byte pieces
def test_matches_the_oracle_composition(backend, isa, ngram_size, table_dtype, width) -> None:
    gen = torch.Generator().manual_seed(ngram_size * 131 + width)
    args, rows = make_batch(ngram_size, 2, [7, 0, 300, 1, 40], gen, backend.device)
    table = make_table(rows, width, table_dtype, gen=gen).to(backend.device)
    gather = {}
    if table_dtype in reference.FP8_DTYPES:
        gather["scale"] = torch.tensor([0.375], device=backend.device)
    for out_dtype in (None, torch.float32, torch.float16):
        got = call(backend, args, table, out_dtype=out_dtype, **gather)
        want = expected(args, table, out_dtype=out_dtype, **gather)
        assert_exact(got, want, f"{table_dtype} -> {out_dtype}", bitwise=True)


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
@pytest.mark.parametrize(
    ("ngram_size", "heads_per_ngram"), [(3, 8), (2, 5), (4, 3), (7, 1)], ids=str
)
def test_head_counts_and_block_tails(backend, isa, ngram_size, heads_per_ngram) -> None:
    """NH = 16 (the released layer: two AVX-512 vectors, four AVX2 ones), 5, 9 and 6 heads (tails
    shorter than a vector), over batches whose token counts leave the CPU kernel's 64-token block
    of mixes part full (65, 3, 130 tokens and an empty request)."""
    gen = torch.Generator().manual_seed(ngram_size * 10 + heads_per_ngram)
    args, rows = make_batch(ngram_size, heads_per_ngram, [65, 0, 3, 130], gen, backend.device)
    table = make_table(rows, 8, torch.float32, gen=gen).to(backend.device)
    got = call(backend, args, table)
    assert_exact(got, expected(args, table), f"N={ngram_size} K_h={heads_per_ngram}", bitwise=True)


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
@pytest.mark.parametrize("head_divmod", [False, True])
def test_shards_strides_and_head_constants(backend, isa, head_divmod) -> None:
    """Vocabulary shards (ids outside a rank's rows are zero rows), a strided input_ids view, an
    output whose rows are a strided view, and the layer's precomputed head constants."""
    gen = torch.Generator().manual_seed(3)
    args, rows = make_batch(3, 3, [50, 13, 2], gen, backend.device)
    args["input_ids"] = torch.stack([args["input_ids"], args["input_ids"]], 1)[:, 0]  # stride 2
    if head_divmod:
        args["head_divmod"] = ops.ngram_head_divmod(args["ngram_heads_vocab_sizes"])
    table = make_table(rows, 16, torch.bfloat16, gen=gen).to(backend.device)
    tokens, width = args["input_ids"].numel(), 6 * 16
    for start, end in ((0, None), (rows // 3, 2 * rows // 3), (rows - 5, rows), (7, 7)):
        shard = table[start : end if end is not None else rows]
        gather = dict(vocab_start=start, vocab_end=end)
        out = torch.full((tokens, width + 8), 7.0, dtype=torch.bfloat16, device=backend.device)
        got = call(backend, args, shard, output=out[:, :width], **gather)
        assert_exact(got, expected(args, shard, **gather), f"shard [{start}, {end})", bitwise=True)
        assert (out[:, width:] == 7.0).all(), "wrote past its rows"


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
def test_nvfp4_table(backend, isa) -> None:
    gen = torch.Generator().manual_seed(4)
    args, rows = make_batch(3, 2, [33, 90], gen, backend.device)
    table = torch.randint(0, 256, (rows, 16), dtype=torch.uint8, generator=gen)  # d = 32
    block_scales = torch.rand(rows, 2, generator=gen).to(torch.float8_e4m3fn)
    gather = dict(
        scale=torch.tensor([0.75]).to(backend.device), block_scales=block_scales.to(backend.device)
    )
    got = call(backend, args, table.to(backend.device), **gather)
    assert_exact(got, expected(args, table, **gather), "nvfp4", bitwise=True)


@pytest.mark.parametrize(("backend", "isa"), HASH_CASES)
def test_empty_batch_and_no_requests(backend, isa) -> None:
    gen = torch.Generator().manual_seed(5)
    args, rows = make_batch(3, 2, [4], gen, backend.device)
    table = make_table(rows, 8, torch.bfloat16, gen=gen).to(backend.device)
    empty = dict(args, input_ids=args["input_ids"][:0])
    empty["query_start_loc"] = torch.zeros(2, dtype=torch.int32, device=backend.device)
    assert call(backend, empty, table).shape == (0, 4 * 8)
    # R = 0: every predecessor is EOS.
    none = dict(args, query_start_loc=args["query_start_loc"][:1])
    none["ngram_context"] = args["ngram_context"][:0]
    got = call(backend, none, table)
    assert_exact(got, expected(none, table), "no requests", bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_opcheck(backend) -> None:
    gen = torch.Generator().manual_seed(6)
    args, rows = make_batch(3, 2, [9, 4], gen, backend.device)
    table = make_table(rows, 8, torch.bfloat16, gen=gen).to(backend.device)
    output = torch.empty(13, 32, dtype=torch.float32, device=backend.device)
    op = backend.library.ngram_gather_rows.default
    torch.library.opcheck(
        op,
        (
            args["input_ids"],
            args["query_start_loc"],
            args["ngram_context"],
            args["layer_multipliers"],
            args["ngram_heads_vocab_sizes"],
            args["ngram_heads_offsets"],
            EOS,
            2,
            None,
            table,
            None,
            None,
            0,
            None,
            output,
        ),
    )


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_bad_arguments_name_the_op(backend) -> None:
    """Its arguments are checked as ngram_ids' and gather_rows' are, under its own name."""
    gen = torch.Generator().manual_seed(8)
    args, rows = make_batch(3, 2, [9], gen, backend.device)
    table = make_table(rows, 8, torch.bfloat16, gen=gen).to(backend.device)
    with pytest.raises(RuntimeError, match="ngram_gather_rows: ngram_heads_offsets must be"):
        call(backend, dict(args, ngram_heads_offsets=args["ngram_heads_offsets"][:2]), table)
    with pytest.raises(RuntimeError, match=r"ngram_gather_rows: output must be \[T, NH·d\]"):
        call(backend, args, table, output=torch.empty(9, 31, device=backend.device))
    with pytest.raises(RuntimeError, match="ngram_gather_rows: an fp8 table needs"):
        call(backend, args, table.view(torch.float8_e4m3fn))
    bad_starts = torch.tensor([0, 12], dtype=torch.int32, device=backend.device)  # past T = 9
    if backend.name == "cpu":
        with pytest.raises(RuntimeError, match=r"ngram_gather_rows: query_start_loc\[R\] = 12"):
            call(backend, dict(args, query_start_loc=bad_starts), table)


GRID_CAP_FORMATS = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    "nvfp4",
)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("table_format", GRID_CAP_FORMATS, ids=str)
@pytest.mark.parametrize("ngram_size", [3, 5])  # 3: the fused kernel where it applies
@pytest.mark.parametrize("path", ["vector", "scalar"])
def test_max_blocks_gives_the_same_output(backend, table_format, ngram_size, path) -> None:
    """Under max_blocks in GRID_CAPS the output equals the uncapped one bit for bit (and the
    oracle's), in an output filled with NaN first, on every route of the GPU glue: the fused
    kernel (N = 3, rows in 16-byte pieces, not NVFP4) and the two kernels through an ids buffer,
    the gather's vector or scalar kernel (`path`). Each kernel of a case has more work than
    GRID_CAPS[-1] blocks do in one pass (gather_support), the ids kernel too, which the cap
    bounds as well (csrc/common/ngram_gather_rows.h, through_ids). On the emulator the launch
    record shows every launch within the cap, and the uncapped route and grids the case means.
    The input ids are an int32 strided view, the table a vocabulary shard."""
    device = backend.device
    nvfp4 = table_format == "nvfp4"
    gen = torch.Generator().manual_seed(ngram_size * 100 + GRID_CAP_FORMATS.index(table_format))
    heads = 16
    width, unit, per_block = grid_cap_row(table_format, path)
    tokens = max(
        (GRID_CAPS[-1] * per_block) // (heads * unit) + 1,
        (GRID_CAPS[-1] * IDS_ELEMENTS_PER_BLOCK) // heads + 1,
    )
    tokens |= 1  # odd
    fused = ngram_size == 3 and path == "vector" and not nvfp4
    gather_blocks = blocks_for(tokens * heads * unit, per_block)
    ids_blocks = blocks_for(tokens * heads, IDS_ELEMENTS_PER_BLOCK)
    uncapped_record = (1, gather_blocks) if fused else (2, max(gather_blocks, ids_blocks))
    assert min(gather_blocks, ids_blocks) > GRID_CAPS[-1], "blocks must take several passes"

    args, rows = make_batch(
        ngram_size, heads // (ngram_size - 1), [40, 0, tokens - 41, 1], gen, "cpu"
    )
    input_ids = args["input_ids"].int()
    args["input_ids"] = torch.stack([input_ids, input_ids], 1)[:, 0]
    gather = {}
    if nvfp4:
        full = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=gen)
        gather["block_scales"] = torch.rand(rows, width // 16, generator=gen).to(
            torch.float8_e4m3fn
        )
        gather["scale"] = torch.tensor([0.75])
    else:
        full = make_table(rows, width, table_format, gen=gen)
        if table_format in reference.FP8_DTYPES:
            gather["scale"] = torch.tensor([0.375])
    start, end = rows // 4, rows - 3
    table = full[start:end]
    if "block_scales" in gather:
        gather["block_scales"] = gather["block_scales"][start:end]
    gather.update(vocab_start=start, vocab_end=end)
    want = expected(args, table, **gather)

    on_device = {
        k: same_layout(v, device) if isinstance(v, torch.Tensor) else v for k, v in args.items()
    }
    assert not on_device["input_ids"].is_contiguous()
    gather_on_device = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in gather.items()
    }

    table_on_device = table.to(device)
    # Other tokens, gathered before each call: the two-kernel route allocates its ids buffer per
    # call, and the allocator hands back the last call's, whose ids (the same batch's) would hide
    # any an ids kernel that did not stride left unwritten.
    decoy = dict(on_device, input_ids=(on_device["input_ids"] + 1) % VOCAB)

    def run(max_blocks):
        scratch = torch.empty(want.shape, dtype=want.dtype, device=device)
        call(backend, decoy, table_on_device, output=scratch, **gather_on_device)
        out = torch.full(want.shape, math.nan, dtype=want.dtype, device=device)
        take_launch_record(backend)
        call(
            backend,
            on_device,
            table_on_device,
            output=out,
            max_blocks=max_blocks,
            **gather_on_device,
        )
        return out, take_launch_record(backend)

    uncapped, record = run(0)
    assert_exact(uncapped, want, "uncapped", bitwise=True)
    if record is not None:
        assert record == uncapped_record, f"uncapped launches (count, most blocks): {record}"
    for cap in GRID_CAPS:
        got, record = run(cap)
        assert_exact(got, uncapped, f"max_blocks={cap}", bitwise=True)
        if record is not None:
            assert record == (uncapped_record[0], cap), f"max_blocks={cap}: launches {record}"


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_max_blocks_keeps_the_positional_schema(backend) -> None:
    """max_blocks is the schema's last argument, with a default: the older fifteen arguments run
    uncapped, a sixteenth caps; opcheck (the fake's rules too) with it."""
    gen = torch.Generator().manual_seed(9)
    args, rows = make_batch(3, 2, [9, 4], gen, backend.device)
    table = make_table(rows, 8, torch.bfloat16, gen=gen).to(backend.device)
    op = backend.library.ngram_gather_rows.default
    positional = [args[k] for k in HASHING_ARGS]
    want = expected(args, table, out_dtype=torch.float32)
    for extra in ((), (0,), (1,)):
        output = torch.full((13, 32), math.nan, dtype=torch.float32, device=backend.device)
        op(*positional, None, table, None, None, 0, None, output, *extra)
        assert_exact(output, want, f"extra arguments {extra}", bitwise=True)
    torch.library.opcheck(op, (*positional, None, table, None, None, 0, None, output, 2))
