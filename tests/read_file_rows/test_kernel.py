"""read_file_rows (issue #39, tables in a file: the direct reader) on real files under tmp_path,
through real buffered and O_DIRECT file descriptors: bit for bit against the same bytes read by
numpy, the ids it does not own as zero rows, every layout of ids and output, every thread count,
the file's last row ending at EOF, and its errors (a file truncated under it, a closed fd, bad
arguments), the GIL released while it reads, opcheck and torch.compile."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch

from qwen4exp_ext import ops

pytestmark = pytest.mark.skipif(not hasattr(os, "pread"), reason="POSIX files")

BLOCK = 4096
ROW_BYTES = (1, 7, 90, 160, 320, 4096, 5000)
COUNTS = (0, 1, 3, 1024)


def write_table(path, rows: int, row_bytes: int, data_offset: int, seed: int = 0) -> np.ndarray:
    """A file of a data_offset-byte header then rows·row_bytes random bytes, ending with the last
    row (so at EOF, for most row sizes not a multiple of 4096); returns its bytes."""
    data = np.random.default_rng(seed).integers(
        0, 256, size=data_offset + rows * row_bytes, dtype=np.uint8
    )
    data.tofile(path)
    return data


def expected_rows(path, ids, row_bytes, data_offset, vocab_start=0, vocab_end=None):
    """The oracle: numpy's own read of the file (a memmap), global ids, zero rows elsewhere."""
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    end = np.iinfo(np.int64).max if vocab_end is None else vocab_end
    out = np.zeros((flat.size, row_bytes), dtype=np.uint8)
    if flat.size == 0:
        return out
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for k, i in enumerate(flat.tolist()):
        if vocab_start <= i < end:
            start = data_offset + i * row_bytes
            out[k] = data[start : start + row_bytes]
    return out


def direct_supported(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


def drop_page_cache(path) -> None:
    """Out of the page cache (written back first): a buffered read of it then waits on the device,
    which sends the op's reads to its threads instead of the calling thread's RWF_NOWAIT pass."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


MODES = ("buffered", "direct")


def open_fd(path, mode: str) -> int:
    if mode == "direct":
        if not direct_supported(path):
            pytest.skip("this file system refuses O_DIRECT")
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    return os.open(path, os.O_RDONLY)


def read(fd, ids, row_bytes, data_offset, output=None, **kwargs):
    if output is None:
        output = torch.full((ids.numel(), row_bytes), 0xAB, dtype=torch.uint8)
    return ops.read_file_rows(
        fd, ids, output, data_offset=data_offset, row_bytes=row_bytes, **kwargs
    )


def random_ids(rows: int, n: int, seed: int, extra: int = 3) -> torch.Tensor:
    """n ids with repeats, -1 and ids past the table, and the last row (which ends at EOF)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, rows + extra, size=n)
    if n >= 3:
        ids[:3] = [rows - 1, -1, ids[3 % n]]
    elif n >= 1:
        ids[0] = rows - 1
    return torch.from_numpy(ids.astype(np.int64))


# --- the rows, bit for bit ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
def test_rows_equal_numpy(tmp_path, mode, row_bytes, n):
    rows = 700 if row_bytes < 1000 else 60
    path = tmp_path / "table.bin"
    write_table(path, rows, row_bytes, BLOCK, seed=row_bytes)
    ids = random_ids(rows, n, seed=n + row_bytes)
    vocab_start, vocab_end = (rows // 3, rows) if n % 2 else (0, rows)
    fd = open_fd(path, mode)
    try:
        got = read(fd, ids, row_bytes, BLOCK, vocab_start=vocab_start, vocab_end=vocab_end)
        os.fstat(fd)  # still open: the caller's
    finally:
        os.close(fd)
    want = expected_rows(path, ids, row_bytes, BLOCK, vocab_start, vocab_end)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("io_threads", (1, 4, 0, 100_000))
def test_every_thread_count(tmp_path, mode, io_threads):
    path = tmp_path / "table.bin"
    rows, row_bytes = 3000, 90
    write_table(path, rows, row_bytes, BLOCK)
    ids = random_ids(rows, 1024, seed=io_threads % 97)
    drop_page_cache(path)
    fd = open_fd(path, mode)
    try:
        got = read(fd, ids, row_bytes, BLOCK, io_threads=io_threads, vocab_end=rows)
    finally:
        os.close(fd)
    np.testing.assert_array_equal(got.numpy(), expected_rows(path, ids, row_bytes, BLOCK, 0, rows))


@pytest.mark.parametrize("mode", MODES)
def test_layouts_of_ids_and_output(tmp_path, mode):
    """int32 ids, a non-contiguous 2-D view (flattened row-major), an output with padded rows."""
    path = tmp_path / "table.bin"
    rows, row_bytes = 500, 160
    write_table(path, rows, row_bytes, 0)
    base = random_ids(rows, 64 * 6, seed=5).view(64, 6)
    views = {
        "int32": base[:, 0].to(torch.int32),
        "strided": base[:, ::2],  # [64, 3], stride 2 within a row
        "transposed": base.t(),  # [6, 64], no flat view: copied in row-major order
    }
    fd = open_fd(path, mode)
    try:
        for name, ids in views.items():
            padded = torch.full((ids.numel(), row_bytes + 40), 0xCD, dtype=torch.uint8)
            out = padded[:, :row_bytes]
            read(fd, ids, row_bytes, 0, output=out, vocab_end=rows)
            want = expected_rows(path, ids.contiguous(), row_bytes, 0, 0, rows)
            np.testing.assert_array_equal(out.numpy(), want, err_msg=name)
            assert bool((padded[:, row_bytes:] == 0xCD).all()), f"{name}: wrote into the padding"
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", MODES)
def test_rows_across_blocks_and_at_eof(tmp_path, mode):
    """A row across two 4 KiB blocks, the last row ending at EOF (not block-aligned), neighbours
    read together, a row wanted many times, ids past vocab_end: all as numpy reads them."""
    path = tmp_path / "table.bin"
    rows, row_bytes = 1001, 320
    write_table(path, rows, row_bytes, BLOCK)
    assert (BLOCK + rows * row_bytes) % BLOCK != 0
    # Row 12 is bytes [7936, 8256) of the file: across the block boundary at 8192.
    ids = torch.tensor([12, rows - 1, rows - 1, 11, 13, 12, 500, 501, 502, -1, rows, 2**40])
    fd = open_fd(path, mode)
    try:
        for io_threads in (1, 3):
            got = read(fd, ids, row_bytes, BLOCK, vocab_end=rows, io_threads=io_threads)
            want = expected_rows(path, ids, row_bytes, BLOCK, 0, rows)
            np.testing.assert_array_equal(got.numpy(), want)
        # Without vocab_end every id from vocab_start on is owned: the last row still reads.
        got = read(fd, torch.tensor([rows - 1, 0]), row_bytes, BLOCK)
        np.testing.assert_array_equal(
            got.numpy(), expected_rows(path, [rows - 1, 0], row_bytes, BLOCK)
        )
    finally:
        os.close(fd)


@pytest.mark.parametrize("io_threads", (1, 0))
def test_a_partly_cached_file(tmp_path, io_threads):
    """Without O_DIRECT, rows the page cache holds are read on the calling thread (RWF_NOWAIT) and
    the rest by the threads: here the first half of the file is cached, the second is not."""
    path = tmp_path / "table.bin"
    rows, row_bytes = 4000, 320
    write_table(path, rows, row_bytes, BLOCK)
    drop_page_cache(path)
    with open(path, "rb") as f:
        f.read(BLOCK + rows // 2 * row_bytes)
    ids = random_ids(rows, 1024, seed=11)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = read(fd, ids, row_bytes, BLOCK, vocab_end=rows, io_threads=io_threads)
    finally:
        os.close(fd)
    np.testing.assert_array_equal(got.numpy(), expected_rows(path, ids, row_bytes, BLOCK, 0, rows))


def test_a_sequential_run_and_the_whole_file(tmp_path):
    """Every row in order (reads of up to 128 KiB), backwards, and data_offset 0."""
    path = tmp_path / "table.bin"
    rows, row_bytes = 2000, 90
    data = write_table(path, rows, row_bytes, 0)
    for mode in MODES:
        fd = open_fd(path, mode)
        try:
            ids = torch.arange(rows)
            got = read(fd, ids, row_bytes, 0, io_threads=2)
            np.testing.assert_array_equal(got.numpy().reshape(-1), data)
            got = read(fd, ids.flip(0), row_bytes, 0)
            np.testing.assert_array_equal(got.numpy()[::-1].reshape(-1), data)
        finally:
            os.close(fd)


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_file_truncated_under_the_reader(tmp_path, mode):
    path = tmp_path / "table.bin"
    rows, row_bytes = 400, 320
    write_table(path, rows, row_bytes, BLOCK)
    drop_page_cache(path)
    fd = open_fd(path, mode)
    try:
        os.truncate(path, BLOCK + 100 * row_bytes + 17)  # row 100 now ends past EOF
        ok = read(fd, torch.tensor([99, 3]), row_bytes, BLOCK)
        np.testing.assert_array_equal(ok.numpy(), expected_rows(path, [99, 3], row_bytes, BLOCK))
        with pytest.raises(RuntimeError, match=rf"{path} ends before row 100 \("):
            read(fd, torch.tensor([5, 100, 300]), row_bytes, BLOCK, path=str(path))
        with pytest.raises(RuntimeError, match=r"fd \d+ ends before row 399 "):
            read(fd, torch.tensor([399]), row_bytes, BLOCK, io_threads=4)
        os.fstat(fd)
    finally:
        os.close(fd)


def test_fd_errors(tmp_path):
    path = tmp_path / "table.bin"
    write_table(path, 10, 8, 0)
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(RuntimeError, match=rf"{path}: fd {fd} is not an open file descriptor"):
        read(fd, torch.tensor([1]), 8, 0, path=str(path))
    with pytest.raises(RuntimeError, match="fd must be an open file descriptor, got -1"):
        read(-1, torch.tensor([1]), 8, 0)
    fd = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(RuntimeError, match="is not open for reading"):
            read(fd, torch.tensor([1]), 8, 0)
    finally:
        os.close(fd)
    # pread's own error, with its errno: a directory opens for reading but reads EISDIR.
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        message = rf"{tmp_path}: pread of 8 bytes at offset 8 failed: {os.strerror(errno.EISDIR)}"
        with pytest.raises(RuntimeError, match=message):
            read(fd, torch.tensor([1]), 8, 0, path=str(tmp_path))
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"row_bytes": 0}, "row_bytes must be positive"),
        ({"data_offset": -1}, "data_offset must be >= 0"),
        ({"vocab_start": 5, "vocab_end": 4}, "0 <= vocab_start <= vocab_end"),
        ({"vocab_start": -1}, "0 <= vocab_start <= vocab_end"),
        ({"ids": torch.tensor([1.0])}, "ids must be int32 or int64"),
        ({"output": torch.zeros(2, 8, dtype=torch.uint8)}, r"output must be \[ids.numel\(\)"),
        ({"output": torch.zeros(1, 9, dtype=torch.uint8)}, r"output must be \[ids.numel\(\)"),
        ({"output": torch.zeros(1, 8, dtype=torch.int8)}, "output must be uint8"),
        ({"output": torch.zeros(1, 16, dtype=torch.uint8)[:, ::2]}, r"stride\(1\) == 1"),
        (
            {
                "ids": torch.tensor([1, 2]),
                "output": torch.zeros(12, dtype=torch.uint8).as_strided((2, 8), (4, 1)),
            },
            "must not overlap",
        ),
        ({"ids": torch.tensor([2**61])}, r"row 2305843009213693952 \(ids\[0\]\) .* overflows"),
    ],
)
def test_bad_arguments_are_refused_before_reading(tmp_path, kwargs, message):
    path = tmp_path / "table.bin"
    write_table(path, 10, 8, 0)
    args = {"ids": torch.tensor([1]), "row_bytes": 8, "data_offset": 0}
    args.update(kwargs)
    ids = args.pop("ids")
    output = args.pop("output", None)
    if output is None:
        output = torch.full((ids.numel(), max(args["row_bytes"], 1)), 0xAB, dtype=torch.uint8)
    before = output.clone()
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match=message):
            ops.read_file_rows(fd, ids, output, **args)
        os.fstat(fd)
    finally:
        os.close(fd)
    assert torch.equal(output, before), "wrote before its checks passed"


def test_unaligned_data_offset_with_o_direct(tmp_path):
    path = tmp_path / "table.bin"
    write_table(path, 10, 8, 512)
    fd = open_fd(path, "direct")
    try:
        with pytest.raises(RuntimeError, match="with O_DIRECT, data_offset must be a multiple"):
            read(fd, torch.tensor([1]), 8, 512)
    finally:
        os.close(fd)
    fd = open_fd(path, "buffered")  # fine without O_DIRECT
    try:
        got = read(fd, torch.tensor([1, 9]), 8, 512)
        np.testing.assert_array_equal(got.numpy(), expected_rows(path, [1, 9], 8, 512))
    finally:
        os.close(fd)


# --- the GIL, opcheck, compile --------------------------------------------------------------------


def test_the_gil_is_released_while_reading(tmp_path):
    """Another Python thread runs while the op reads. 40000 separate reads on one thread (a
    sparse file: each a syscall that returns zeros) take tens of ms; a thread that holds the GIL
    that long stalls the other for about that long (the switch interval only takes effect between
    bytecodes), so the other thread's longest stall inside the call must be well under it."""
    path = tmp_path / "sparse.bin"
    reads, spacing = 40000, 2 * BLOCK
    with open(path, "wb") as f:
        f.truncate(reads * spacing)
    ids = torch.arange(reads) * spacing  # row_bytes 1: every row in a block of its own
    output = torch.empty(reads, 1, dtype=torch.uint8)
    stalls, stop = [], threading.Event()  # (from, to) of the spinner's gaps over 1 ms

    def spin():
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            if now - last > 1e-3:
                stalls.append((last, now))
            last = now

    fd = os.open(path, os.O_RDONLY)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.01)
        for _ in range(3):
            start = time.perf_counter()
            read(fd, ids, 1, 0, output=output, io_threads=1)
            end = time.perf_counter()
            if end - start > 0.02:
                break
    finally:
        stop.set()
        spinner.join()
        os.close(fd)
    assert not output.any()
    elapsed = end - start
    if elapsed <= 0.02:
        pytest.skip(f"the reads took only {elapsed * 1e3:.1f} ms: too quick to tell")
    longest = max(
        (min(b, end) - max(a, start) for a, b in stalls if b > start and a < end), default=0
    )
    assert longest < elapsed / 2, (
        f"the other thread stalled {longest * 1e3:.1f} ms of a {elapsed * 1e3:.1f} ms call"
    )


def test_opcheck(tmp_path):
    path = tmp_path / "table.bin"
    write_table(path, 50, 90, BLOCK)
    fd = os.open(path, os.O_RDONLY)
    try:
        ids = torch.tensor([[3, -1], [49, 3]])
        output = torch.empty(4, 90, dtype=torch.uint8)
        torch.library.opcheck(
            torch.ops.qwen4exp.read_file_rows.default,
            (fd, ids, BLOCK, 90, 0, 50, output, 2, str(path)),
        )
    finally:
        os.close(fd)


def test_torch_compile_smoke(tmp_path):
    path = tmp_path / "table.bin"
    write_table(path, 50, 90, BLOCK)
    fd = os.open(path, os.O_RDONLY)

    @torch.compile(fullgraph=True, dynamic=True)
    def lookup(ids, output):
        ops.read_file_rows(fd, ids * 2, output, data_offset=BLOCK, row_bytes=90, vocab_end=50)
        return output.sum(dim=1)

    try:
        ids = torch.tensor([1, 7, 24, 30])
        output = torch.empty(4, 90, dtype=torch.uint8)
        sums = lookup(ids, output)
    finally:
        os.close(fd)
    want = expected_rows(path, ids * 2, 90, BLOCK, 0, 50)
    np.testing.assert_array_equal(output.numpy(), want)
    assert torch.equal(sums, torch.from_numpy(want).sum(dim=1))
