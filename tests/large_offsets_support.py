"""Tensors with elements past 2^31 and 2^32 of their storage, without the RAM: views into sparse
files mapped shared (tests/<op>/test_large_offsets.py, issue #48).

vLLM 0.34 fixed its Triton kernels, whose program ids and offsets were int32: a table or state
past 2^31 elements read and wrote the wrong place. Each op's test_large_offsets.py puts what its
kernels read and write past those marks and compares with the oracle on a small copy of the same
rows. Only the pages touched cost memory: a file of tens of GB is a few pages of RAM.

Every view starts GUARD_ELEMENTS elements into its file, the guard: a 32-bit offset that wraps
(an element or byte offset in [2^31, 2^32) read as int32 is negative, one past 2^32 loses its
high bits) still lands inside the mapping, on zeros, so a kernel with the bug gives wrong values
(or writes in the wrong place) instead of a crash that takes the test run with it.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import backends
from gather_support import CPU_PATHS, FP8_NAN_BYTES, cpu_gather_path, make_table
from leak_support import nothing_left_behind
from qwen4exp_ext import reference

MARKS = (2**31, 2**32)  # where a signed and an unsigned 32-bit element offset wrap
GUARD_ELEMENTS = 2**31  # zeros before every view: a wrapped offset lands in them
PAGE = 4096


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def seed(*parts) -> int:
    """A generator seed from a test case's parameters, the same in every process (hash() of a
    str is not)."""
    return zlib.crc32(repr(parts).encode())


def make_sparse_file(path: Path, nbytes: int) -> None:
    """A file of ``nbytes`` zeros at ``path`` that takes no space: skips the test where this
    filesystem cannot make one of that size, or allocates it whole."""
    try:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    except OSError as e:
        pytest.skip(f"{path.parent}: cannot make a sparse file of {nbytes} bytes ({e})")
    if os.stat(path).st_blocks * 512 > PAGE * 16:
        path.unlink()
        pytest.skip(f"{path.parent}: the filesystem allocated a {nbytes}-byte file whole")


class SparseFiles:
    """Sparse files under one directory, each mapped shared as a tensor (see the module)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.paths: list[Path] = []

    def file(self, nbytes: int) -> Path:
        """A new sparse file of ``nbytes`` zeros (make_sparse_file), removed when the block of
        sparse_files() ends."""
        path = self.directory / f"sparse-{len(self.paths)}.bin"
        self.paths.append(path)
        make_sparse_file(path, nbytes)
        return path

    def mapping(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (rounded up to a page), mapped from a new sparse file:
        zeros, none of them in RAM or on disk until written."""
        nbytes = -(-nbytes // PAGE) * PAGE
        path = self.file(nbytes)
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)

    def tensor(
        self, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...]
    ) -> torch.Tensor:
        """A ``dtype`` view of ``size`` and ``stride`` (elements) starting GUARD_ELEMENTS
        elements into a new sparse file just large enough to hold it."""
        extent = GUARD_ELEMENTS + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        item = element_size(dtype)
        storage = self.mapping(extent * item).view(dtype)
        return storage.as_strided(size, stride, GUARD_ELEMENTS)


@contextlib.contextmanager
def sparse_files(directory: str | os.PathLike) -> Iterator[SparseFiles]:
    """SparseFiles under ``directory``, each file removed when the block ends (the mappings go
    when the last view of each is freed)."""
    files = SparseFiles(Path(directory))
    try:
        yield files
    finally:
        for path in files.paths:
            path.unlink(missing_ok=True)


def run_leaving_nothing(directory: str | os.PathLike, check, *args, **kwargs) -> None:
    """``check(files, *args, **kwargs)`` with the SparseFiles of ``directory``, which must leave
    nothing behind (leak_support.nothing_left_behind): no file, mapping, descriptor or thread.
    Its views are its locals, freed when it returns, before the check."""
    with nothing_left_behind(directory):
        with sparse_files(directory) as files:
            check(files, *args, **kwargs)


def rows_at_marks(row_stride: int, rows: int) -> list[int]:
    """Rows of a [rows, ·] view with that row stride (elements) around each of MARKS: the row
    that holds the element before the mark and the one that holds the mark (one row when it
    straddles), the row after, the first two and the last. Sorted, distinct, all < rows."""
    picks = {0, 1, rows - 1}
    for mark in MARKS:
        before, at = (mark - 1) // row_stride, mark // row_stride
        picks.update(r for r in (before, at, at + 1) if r < rows)
    return sorted(picks)


# A per-token view's row stride (elements): row 1 starts 16 elements before 2^31 and row 2 32
# before 2^32, so a row of more than 32 elements straddles each mark; row 3 lies past both. A
# multiple of 16 elements: row starts stay 16-byte aligned (the HIP kernels' vector paths).
TOKEN_ROW_STRIDE = 2**31 - 16
TOKEN_ROWS = 4


def token_rows(files: SparseFiles, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A [TOKEN_ROWS, width] row-major view whose rows lie across and past 2^31 and 2^32
    elements of its storage (row stride TOKEN_ROW_STRIDE)."""
    assert width > 32, "a row must straddle the marks"
    return files.tensor(dtype, (TOKEN_ROWS, width), (TOKEN_ROW_STRIDE, 1))


# ---- tables past the marks (gather_rows, ngram_gather_rows) ---------------------------------

FORMATS = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "e4m3fn": torch.float8_e4m3fn,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "nvfp4": "nvfp4",
}
# Row widths (elements) that take the HIP gather's vector kernel (rows in 16-byte pieces) and its
# scalar one (rows that are not).
WIDTHS = {
    "vector": {"nvfp4": 256, "e4m3fn": 48, "e4m3fnuz": 48, "default": 24},
    "scalar": {"nvfp4": 48, "default": 9},
}


def gather_cases() -> list:
    """(backend, CPU gather path or None) params: the CPU kernel once per path this CPU has, the
    emulator at each wave size (a GPU is left out: tables of tens of GB are out of scope)."""
    found = []
    for backend in backends():
        if backend.name == "cpu":
            found += [pytest.param(backend, path, id=f"cpu-{path}") for path in CPU_PATHS]
        elif backend.device == "cpu":
            found.append(pytest.param(backend, None, id=backend.name))
    return found


def gather_path(path: str | None):
    """The CPU gather path of a gather_cases() param (none for the emulator)."""
    return cpu_gather_path(path) if path is not None else contextlib.nullcontext()


@dataclass
class LargeTable:
    """A table of more than 2^32 elements (bytes for fp8 and NVFP4) in a sparse file, zeros but
    for the rows fill() wrote. NVFP4 as table files store it: each row's codes then its block
    scales (one row stride for both, so that the scales lie past the marks too)."""

    table: torch.Tensor
    block_scales: torch.Tensor | None
    scale: torch.Tensor | None
    raw: torch.Tensor  # [rows, row_stride] of the storage dtype (uint8 for NVFP4)
    width: int  # elements

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    @property
    def row_stride(self) -> int:
        return self.raw.stride(0)

    @property
    def out_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The default output dtype, then another one."""
        quantized = self.block_scales is not None or self.table.dtype in reference.FP8_DTYPES
        default = torch.bfloat16 if quantized else self.table.dtype
        return default, torch.bfloat16 if default == torch.float32 else torch.float32

    def fill(self, rows: list[int], gen: torch.Generator) -> None:
        """Random rows (every finite value, fp8 byte and E2M1 code; finite block scales) at
        ``rows``."""
        index = torch.tensor(rows, dtype=torch.int64)
        if self.block_scales is None:
            self.raw[index] = make_table(len(rows), self.width, self.raw.dtype, gen=gen)
            return
        codes = torch.randint(
            0, 256, (len(rows), self.width // 2), dtype=torch.uint8, generator=gen
        )
        scales = torch.randint(
            0, 256, (len(rows), self.width // 16), dtype=torch.uint8, generator=gen
        )
        for nan in FP8_NAN_BYTES[torch.float8_e4m3fn]:
            scales[scales == nan] = 0x38  # 1.0
        self.raw[index] = torch.cat([codes, scales], dim=1)


def large_table(files: SparseFiles, table_format: str, kind: str) -> LargeTable:
    """A LargeTable of FORMATS[table_format] whose rows take the HIP kernel ``kind`` (WIDTHS),
    rows·row_stride past 2^32 by 16 rows, nothing written yet."""
    width = WIDTHS[kind].get(table_format, WIDTHS[kind]["default"])
    dtype = FORMATS[table_format]
    if dtype == "nvfp4":
        row_bytes = width // 2 + width // 16
        raw = files.tensor(torch.uint8, (MARKS[-1] // row_bytes + 16, row_bytes), (row_bytes, 1))
        table = raw[:, : width // 2]
        block_scales = raw[:, width // 2 :].view(torch.float8_e4m3fn)
        return LargeTable(table, block_scales, torch.tensor([0.75]), raw, width)
    raw = files.tensor(dtype, (MARKS[-1] // width + 16, width), (width, 1))
    scale = torch.tensor([0.0371]) if dtype in reference.FP8_DTYPES else None
    return LargeTable(raw, None, scale, raw, width)


def gather_oracle(
    large: LargeTable, ids: torch.Tensor, vocab_start: int, vocab_end: int, out_dtype
) -> torch.Tensor:
    """reference.gather_rows of ``ids`` from ``large`` (owning [vocab_start, vocab_end)), on a
    copy of just the rows they read: the ids remapped to it, every id not owned to -1."""
    flat = ids.reshape(-1).tolist()
    owned = sorted({i - vocab_start for i in flat if vocab_start <= i < vocab_end})
    small = {r: k for k, r in enumerate(owned)}
    remapped = torch.tensor(
        [small[i - vocab_start] if vocab_start <= i < vocab_end else -1 for i in flat]
    ).reshape(ids.shape)
    index = torch.tensor(owned, dtype=torch.int64)
    scales = None if large.block_scales is None else large.block_scales[index]
    return reference.gather_rows(
        large.table[index], remapped, scale=large.scale, block_scales=scales, out_dtype=out_dtype
    )
