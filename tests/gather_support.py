"""What the gather_rows tests share (tests/gather_rows/, tests/ngram_gather_rows/): the switch
between the CPU kernel's paths and the one of its fp8 conversions, tables that hold every
finite bit pattern, and what the grid-cap (max_blocks) tests need of the HIP kernels'
launches."""

from __future__ import annotations

import contextlib

import torch

from qwen4exp_ext import ops, reference, simt

FP8 = reference.FP8_DTYPES
# The NaN bytes of each fp8 format: NaN != NaN, so tables leave them out (SPEC fixes no payload).
FP8_NAN_BYTES = {torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e4m3fnuz: (0x80,)}


@contextlib.contextmanager
def cpu_gather_path(path: str):
    """Within the block the CPU gather takes ``path`` for every output size: one of
    ops.CPU_GATHER_PATHS ("stream" only where the CPU has it: ops.cpu_gather_stream_bytes() !=
    -1)."""
    previous = ops.set_cpu_gather_path(path)
    try:
        yield
    finally:
        ops.set_cpu_gather_path(previous)


def _cpu_paths() -> list[str]:
    has_stream = ops.cpu_gather_stream_bytes() != -1
    return [path for path in ops.CPU_GATHER_PATHS if has_stream or path != "stream"]


CPU_PATHS = _cpu_paths()  # the CPU gather paths this CPU has


@contextlib.contextmanager
def cpu_fp8_lookup(lookup: str):
    """Within the block the CPU gather converts fp8 rows with ``lookup`` (one of
    CPU_FP8_LOOKUPS)."""
    previous = ops.set_cpu_gather_fp8_lookup(lookup)
    try:
        yield
    finally:
        ops.set_cpu_gather_fp8_lookup(previous)


def _cpu_fp8_lookups() -> list[str]:
    found = []
    for lookup in ("scalar", "avx2", "avx512"):
        try:
            with cpu_fp8_lookup(lookup):
                found.append(lookup)
        except ValueError:
            pass
    return found


# The CPU gather's fp8 conversions this CPU has: by default it runs only the widest, so each is
# pinned in turn to test them all on one machine.
CPU_FP8_LOOKUPS = _cpu_fp8_lookups()


def every_fp8_code_rows(dtype: torch.dtype, width: int = 256 + 37) -> torch.Tensor:
    """fp8 rows holding every byte, the NaNs included, at every position: long enough for the
    CPU's vector lookups (32 codes a step) and their tails."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return torch.stack([codes.roll(k).repeat(2)[:width] for k in range(0, 256, 5)]).view(dtype)


def make_table(rows: int, width: int, dtype: torch.dtype, *, gen=None) -> torch.Tensor:
    """Every finite bit pattern is fair game: random bytes for fp8, wide-range values otherwise
    (fp16 tables overflow to inf in a bf16 → fp16 conversion, and subnormals occur)."""
    if dtype in FP8:
        raw = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen)
        for nan in FP8_NAN_BYTES[dtype]:
            raw[raw == nan] = 0x11
        return raw.view(dtype)
    values = torch.randn(rows, width, generator=gen) * torch.exp2(
        torch.randint(-30, 20, (rows, width), generator=gen).float()
    )
    return values.to(dtype)


# ---- max_blocks: the HIP gathers under a capped grid --------------------------------------------
#
# Every launch of gather_rows and ngram_gather_rows uses at most max_blocks blocks; the kernels
# stride over their grid, so the output is the same under any cap. A case of these tests gives each
# kernel more work than GRID_CAPS[-1] blocks take in one pass, so that under every cap each block
# takes several passes, and a kernel that did not stride would leave part of its output unwritten.
# What one block of each kernel takes in one pass (csrc/hip/gather_rows.hip and ngram_ids.hip,
# kThreadsPerBlock = 256 threads, the vector kernel's kUnroll = 4 pieces of 16 table bytes each):
GRID_CAPS = (1, 2, 3, 7)
VECTOR_PIECES_PER_BLOCK = 256 * 4  # the vector kernel (and the fused one): 16-byte table pieces
SCALAR_ELEMENTS_PER_BLOCK = 256  # the scalar kernel: output elements


def grid_cap_row(table_format, path: str) -> tuple[int, int, int]:
    """(row width, units of work per row, units per block) of a table row that takes the HIP
    gather kernel ``path``: "vector" (rows in 16-byte pieces; a unit is a piece) or "scalar"
    (rows that are not; a unit is an output element). ``table_format`` is a dtype or "nvfp4"."""
    nvfp4 = table_format == "nvfp4"
    if path == "vector":
        width = 160 if nvfp4 else 64
    else:
        width = 16 if nvfp4 else 5
    row_bytes = width // 2 if nvfp4 else width * table_format.itemsize
    assert (row_bytes % 16 == 0) == (path == "vector"), "the case takes the other kernel"
    if path == "vector":
        return width, row_bytes // 16, VECTOR_PIECES_PER_BLOCK
    return width, width, SCALAR_ELEMENTS_PER_BLOCK


IDS_ELEMENTS_PER_BLOCK = 256  # ngram_ids' kernel: (token, head) ids


def blocks_for(work: int, per_block: int) -> int:
    """The uncapped grid of a launch: enough blocks to cover the work once."""
    return -(-work // per_block)


def take_launch_record(backend) -> tuple[int, int] | None:
    """(launches, most blocks of one) of the backend's emulator since the last call, or None for a
    backend that is not the emulator (the CPU, whose kernel has no grid; a GPU, which keeps no
    record)."""
    if not backend.name.startswith("simt"):
        return None
    return simt.take_launch_record(int(backend.name.removeprefix("simt")))
