"""read_file_rows past 2^31 and 2^32 (issue #48): rows of a sparse table file past 2^31 and 2^32
rows and bytes, behind a data offset past them too, read buffered and with O_DIRECT into output
rows past 2^31 and 2^32 bytes of their storage (a view into a sparse file:
tests/large_offsets_support.py), bit for bit against the file's own bytes read by os.pread."""

from __future__ import annotations

import os

import pytest
import torch

from large_offsets_support import MARKS, run_leaving_nothing
from qwen4exp_ext import ops
from qwen4exp_ext.testing import assert_exact

pytestmark = pytest.mark.skipif(not hasattr(os, "pread"), reason="POSIX files")

BLOCK = 4096
# The ids' and the output rows' stride (elements): id and row 4 past 2^31 elements of their
# storage, 8 past 2^32 (a multiple of 16).
OUT_STRIDE = 2**29 + 48


def marked_ids(row_bytes: int, data_offset: int, id_dtype: torch.dtype) -> list[int]:
    """Rows around 2^31 and 2^32 rows, the rows whose bytes straddle file offsets 2^31 and 2^32
    (those after data_offset), the first two, and the last of a table of about 2^35 bytes (a
    sparse file), as far as the id dtype reaches."""
    last = min(2**35 // row_bytes, 2**31 - 1 if id_dtype == torch.int32 else 2**63 - 1)
    picks = {0, 1, 2**31 - 2, 2**31 - 1, 2**31, MARKS[-1], MARKS[-1] + 1, last}
    picks.update((mark - data_offset) // row_bytes for mark in MARKS if mark > data_offset)
    return sorted(i for i in picks if i <= last)


def check_rows(files, row_bytes, direct):
    gen = torch.Generator().manual_seed(row_bytes)
    for data_offset in (BLOCK, MARKS[-1] + 2 * BLOCK):
        for id_dtype in (torch.int32, torch.int64):
            wanted = marked_ids(row_bytes, data_offset, id_dtype)
            end = wanted[-1] + 1  # the reader owns [1, end): row 0 is another reader's
            size = data_offset + (end + 3) * row_bytes
            path = files.file(size)  # only the rows written below take space
            fd = os.open(path, os.O_RDWR)
            try:
                for i in wanted:
                    data = torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=gen)
                    os.pwrite(fd, data.numpy().tobytes(), data_offset + i * row_bytes)
                # The oracle: the file's own bytes at each owned id, zeros elsewhere.
                most = 2**31 - 1 if id_dtype == torch.int32 else 2**63 - 1
                ids = [*wanted, *(i for i in (-1, end, end + 1) if i <= most)]
                expected = torch.zeros(len(ids), row_bytes, dtype=torch.uint8)
                for k, i in enumerate(ids):
                    if 1 <= i < end:
                        raw = os.pread(fd, row_bytes, data_offset + i * row_bytes)
                        expected[k] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            finally:
                os.close(fd)
            # The ids read from, and the rows written to, past 2^31 and 2^32 elements of theirs.
            id_view = files.tensor(id_dtype, (len(ids),), (OUT_STRIDE,))
            id_view.copy_(torch.tensor(ids))
            output = files.tensor(torch.uint8, (len(ids), row_bytes), (OUT_STRIDE, 1))
            output.fill_(0xAB)  # a row not written shows
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                got = ops.read_file_rows(
                    fd,
                    id_view,
                    output,
                    data_offset=data_offset,
                    row_bytes=row_bytes,
                    vocab_start=1,
                    vocab_end=end,
                    io_threads=4,
                    path=str(path),
                )
            finally:
                os.close(fd)
            assert got is output
            assert_exact(output.clone(), expected, f"data_offset {data_offset}, {id_dtype} {ids}")


def direct_supported(directory) -> bool:
    probe = directory / "direct-probe"
    probe.write_bytes(b"\0" * BLOCK)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("row_bytes", [5, 4096 + 37])
def test_rows_past_2_31_and_2_32_rows_and_bytes(tmp_path, row_bytes, direct):
    """Row ids 2^31 - 1, 2^31 and past 2^32 (int64 ids, 5-byte rows; int32 ids up to their
    largest), rows whose bytes straddle file offsets 2^31 and 2^32, the last row of a file of
    about 2^35 bytes, a data offset past 2^32, rows of 5 bytes and of more than a block, owned ids
    and others, the ids read from past 2^31 elements of theirs, into output rows past 2^31 and
    2^32 bytes of the output's storage. Catches ``id * row_bytes`` (a file offset),
    ``k * ids_stride`` or ``k * output_row_stride`` computed in 32 bits, and an int32 id or
    offset where the reads are sorted and grouped."""
    if direct and not direct_supported(tmp_path):
        pytest.skip(f"{tmp_path}: this file system refuses O_DIRECT")
    run_leaving_nothing(tmp_path, check_rows, row_bytes, direct)
