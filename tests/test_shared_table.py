"""One copy of a PLE table per node (python/qwen4exp_ext/tables/shared.py): a table file on
tmpfs mapped where it is, a disk file staged into a tmpfs directory under a lock by one process
and mapped by all, the pages shared between processes (smaps), a slow stager waited for, a
killed one leaving nothing mapped, a stale copy staged again, the copy removed by its last user,
and a table larger than the memory falling back to the CPU-staged lookups. Real files, real
processes, a tmpfs directory under /dev/shm; every wait has a timeout."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch

from leak_support import nothing_left_behind
from lookup_support import make_embedding
from qwen4exp_ext.tables import shared
from qwen4exp_ext.tables.file_format import (
    TableFileError,
    TableFileNotFoundError,
    read_header,
    write_header,
)
from qwen4exp_ext.tables.readers import FileTable
from qwen4exp_ext.tables.shared import (
    SharedTable,
    open_shared_table,
    plan_shared_table,
    remove_staged_copy,
    staged_copy_path,
)

WAIT = 60.0  # seconds any wait of these tests may take before it fails


@pytest.fixture
def shm_dir():
    if not os.path.isdir(shared.SHM_DIR) or not shared.on_tmpfs(shared.SHM_DIR):
        pytest.skip(f"{shared.SHM_DIR} is not a tmpfs here")
    directory = tempfile.mkdtemp(prefix="q4x-shared-test-", dir=shared.SHM_DIR)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def table_file(directory, seed=0, name="ple1.q4xt"):
    path = os.path.join(directory, name)
    make_embedding("bfloat16", "cpu", seed=seed).save_table_file(path)
    return path


def file_rows(path) -> torch.Tensor:
    header = read_header(path)
    with open(path, "rb") as f:
        data = f.read()
    rows = torch.frombuffer(bytearray(data[header.data_offset :]), dtype=torch.uint8)
    return rows.view(header.num_rows, header.row_bytes)


def mapped_file(address: int, pid: str | int = "self") -> str:
    """The file mapped at ``address`` in process ``pid`` (/proc/<pid>/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else ""
    raise AssertionError(f"{address:#x} is not mapped in {pid}")


def smaps_of(address: int, pid: str | int) -> dict[str, int]:
    """The smaps counters (kB) of the mapping holding ``address`` in process ``pid``."""
    counters: dict[str, int] = {}
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            vma = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if vma:
                inside = int(vma[1], 16) <= address < int(vma[2], 16)
            elif inside:
                key, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    counters[key] = int(value.split()[0])
    return counters


# A process of the node: opens the table (staging it if it is first), says so, and waits.
RANK = textwrap.dedent(
    """
    import os, sys, time
    from qwen4exp_ext.tables import shared
    source, shm_dir, mode = sys.argv[1:4]
    shared._COPY_CHUNK = 4096  # several chunks even for a small table
    def progress(done, total):
        print(f"copying {done} {total}", flush=True)
        if mode == "slow":
            time.sleep(2.0)
        elif mode == "hang":
            time.sleep(600)
    table = shared.open_shared_table(
        source, shm_dir=shm_dir, stage=mode != "nostage", progress=progress, timeout=60
    )
    rows = table.rows
    rows.sum()  # every page of the table mapped into this process
    print(f"ready {rows.data_ptr()} {int(table.staged)}", flush=True)
    sys.stdin.readline()  # until the test says go
    table.close()
    print("closed", flush=True)
    """
)


def start_rank(source, shm_dir, mode="plain"):
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(source), str(shm_dir), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def read_line(process, starts_with, timeout=WAIT) -> str:
    """The next line of ``process`` that starts with ``starts_with``, waiting at most
    ``timeout`` seconds (a reader thread, so that a silent process cannot hang the test)."""
    lines: queue.Queue = queue.Queue()

    def reader():
        for line in process.stdout:
            lines.put(line)
            if line.startswith(starts_with):
                return
        lines.put(None)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"no {starts_with!r} line from the process in {timeout}s"
            ) from None
        if line is None:
            raise AssertionError(f"the process ended without a {starts_with!r} line")
        if line.startswith(starts_with):
            thread.join(timeout)
            return line


def finish(process) -> None:
    process.stdin.write("go\n")
    process.stdin.flush()
    read_line(process, "closed")
    process.stdin.close()
    process.stdout.close()
    assert process.wait(timeout=WAIT) == 0


def test_a_table_on_tmpfs_is_mapped_where_it_is(shm_dir):
    source = table_file(shm_dir)
    with nothing_left_behind(shm_dir):
        with open_shared_table(source, shm_dir=shm_dir) as table:
            assert isinstance(table, SharedTable) and table.how == "tmpfs"
            assert str(table.path) == source and not table.staged
            # On a CPU the mapping is the table: its rows are the file's pages.
            assert torch.equal(table.rows, file_rows(source))
            assert mapped_file(table.rows.data_ptr()) == os.path.realpath(source)
        assert sorted(os.listdir(shm_dir)) == ["ple1.q4xt"]  # nothing staged


def test_a_disk_table_is_staged_mapped_and_removed_by_its_last_user(tmp_path, shm_dir):
    source = table_file(tmp_path)
    copy = staged_copy_path(source, shm_dir)
    with nothing_left_behind(tmp_path, shm_dir):
        first = open_shared_table(source, shm_dir=shm_dir)
        second = open_shared_table(source, shm_dir=shm_dir)
        assert first.how == second.how == "stage"
        assert first.staged and not second.staged  # the second maps the first's copy
        for table in (first, second):
            assert torch.equal(table.rows, file_rows(source))
            assert mapped_file(table.rows.data_ptr()) == str(copy)
        first.close()
        assert copy.exists()  # the second still uses it
        second.close()
        assert os.listdir(shm_dir) == []  # the last user removed the copy and its locks


@pytest.mark.parametrize("stage", [True, False], ids=["staged-tmpfs", "disk-page-cache"])
def test_two_processes_mapping_one_file_share_its_pages(tmp_path, shm_dir, stage):
    source = table_file(tmp_path)
    if not stage:
        os.sync()  # written back: the page cache's pages are clean
    with nothing_left_behind(tmp_path, shm_dir):
        table = open_shared_table(source, shm_dir=shm_dir, stage=stage)
        other = start_rank(source, shm_dir, "plain" if stage else "nostage")
        try:
            _, address, _ = read_line(other, "ready").split()
            table.rows.sum()  # every page mapped here too
            mine = smaps_of(table.rows.data_ptr(), "self")
            theirs = smaps_of(int(address), other.pid)
            # The rows' pages (from data_offset, page-aligned); the header page may be mapped
            # in one process only (fault-around), so it is left out.
            rows_kb = -(-table.rows.numel() // 4096) * 4
            for counters in (mine, theirs):
                # Every page of the rows is resident in both and shared by both. A tmpfs
                # file's pages are always dirty (no disk behind them to be clean against), so
                # the kernel counts them Shared_Dirty; a disk file's written-back pages are
                # Shared_Clean.
                shared_kb = counters["Shared_Dirty"] if stage else counters["Shared_Clean"]
                assert shared_kb >= rows_kb, counters
                assert shared_kb + 4 >= counters["Rss"], counters
            finish(other)
        finally:
            if other.poll() is None:
                other.kill()
                other.wait(WAIT)
                other.stdin.close()
                other.stdout.close()
            table.close()


def test_staging_waits_for_a_slow_first_rank(tmp_path, shm_dir):
    source = table_file(tmp_path)
    with nothing_left_behind(tmp_path, shm_dir):
        first = start_rank(source, shm_dir, "slow")
        try:
            read_line(first, "copying")  # the first rank holds the lock and copies, slowly
            copied = []
            started = time.monotonic()
            table = open_shared_table(
                source, shm_dir=shm_dir, timeout=WAIT, progress=lambda d, t: copied.append(d)
            )
            waited = time.monotonic() - started
            _, _, first_staged = read_line(first, "ready").split()
            # This rank waited for the first's copy and mapped it: it copied nothing, and
            # what it maps is the whole table.
            assert first_staged == "1" and not table.staged and copied == []
            assert waited > 1.0
            assert torch.equal(table.rows, file_rows(source))
            finish(first)
            table.close()
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(WAIT)
        assert os.listdir(shm_dir) == []


def test_a_waiting_rank_times_out_naming_the_lock_and_its_holder(tmp_path, shm_dir):
    source = table_file(tmp_path)
    first = start_rank(source, shm_dir, "hang")
    try:
        read_line(first, "copying")
        with nothing_left_behind(tmp_path):
            lock = f"{staged_copy_path(source, shm_dir)}.lock"
            pattern = f"{re.escape(lock)}: waited .*held by pid {first.pid}"
            with pytest.raises(TimeoutError, match=pattern):
                open_shared_table(source, shm_dir=shm_dir, timeout=0.5)
    finally:
        first.kill()
        first.wait(WAIT)
        first.stdout.close()
        first.stdin.close()


def test_a_stager_killed_mid_copy_leaves_no_partial_copy_mapped(tmp_path, shm_dir):
    source = table_file(tmp_path)
    copy = staged_copy_path(source, shm_dir)
    first = start_rank(source, shm_dir, "hang")
    with first:
        _, done, total = read_line(first, "copying").split()
        assert int(done) < int(total)  # stopped part way
        first.kill()
        first.wait(WAIT)
    assert not copy.exists()  # the partial copy never had the copy's name
    partial = [name for name in os.listdir(shm_dir) if name.endswith(".tmp")]
    assert len(partial) == 1 and os.path.getsize(os.path.join(shm_dir, partial[0])) == int(done)
    with nothing_left_behind(tmp_path):
        with open_shared_table(source, shm_dir=shm_dir, timeout=WAIT) as table:
            assert table.staged  # staged again, completely
            assert torch.equal(table.rows, file_rows(source))
            assert not [name for name in os.listdir(shm_dir) if name.endswith(".tmp")]
    assert os.listdir(shm_dir) == []


def test_a_stale_copy_is_staged_again(tmp_path, shm_dir):
    source = table_file(tmp_path, seed=0)
    copy = staged_copy_path(source, shm_dir)
    with nothing_left_behind(tmp_path, shm_dir):
        with open_shared_table(source, shm_dir=shm_dir, keep=True) as table:
            assert table.staged
        assert copy.exists()  # kept for the next start
        with open_shared_table(source, shm_dir=shm_dir, keep=True) as table:
            assert not table.staged  # fresh: reused
        table_file(tmp_path, seed=1)  # the source replaced by another table
        with open_shared_table(source, shm_dir=shm_dir, keep=True) as table:
            assert table.staged
            assert torch.equal(table.rows, file_rows(source))
        # A copy changed behind the record (another file at its name) is stale too.
        os.unlink(copy)
        shutil.copyfile(table_file(tmp_path, seed=2, name="other.q4xt"), copy)
        os.unlink(tmp_path / "other.q4xt")
        with open_shared_table(source, shm_dir=shm_dir) as table:
            assert table.staged
            assert torch.equal(table.rows, file_rows(source))
        assert not remove_staged_copy(source, shm_dir)  # the last user removed it already
        assert os.listdir(shm_dir) == []


def test_a_kept_copy_is_removed_on_request(tmp_path, shm_dir):
    source = table_file(tmp_path)
    with nothing_left_behind(tmp_path, shm_dir):
        with open_shared_table(source, shm_dir=shm_dir, keep=True):
            assert not remove_staged_copy(source, shm_dir)  # in use: left alone
        assert os.listdir(shm_dir)
        assert remove_staged_copy(source, shm_dir)
        assert os.listdir(shm_dir) == []


def test_missing_and_foreign_files_are_refused_naming_them(tmp_path, shm_dir):
    missing = tmp_path / "missing.q4xt"
    not_a_table = tmp_path / "not_a_table.q4xt"
    not_a_table.write_bytes(b"x" * 8192)
    other_layer = table_file(tmp_path)
    expected = dataclasses.replace(read_header(other_layer), layer_index=2)
    with nothing_left_behind(tmp_path, shm_dir):
        with pytest.raises(TableFileNotFoundError, match=re.escape(str(missing))):
            open_shared_table(missing, shm_dir=shm_dir)
        with pytest.raises(TableFileError, match=f"{re.escape(str(not_a_table))}: not a"):
            open_shared_table(not_a_table, shm_dir=shm_dir)
        with pytest.raises(TableFileError, match="layer 1's, expected layer 2's"):
            open_shared_table(other_layer, expected, shm_dir=shm_dir)
        with pytest.raises(ValueError, match="timeout must be"):
            open_shared_table(other_layer, shm_dir=shm_dir, timeout=-1)
        assert os.listdir(shm_dir) == []


def test_a_table_larger_than_memory_falls_back_before_mapping_or_copying(tmp_path, shm_dir, caplog):
    # A real table file larger than this machine's memory: a sparse one.
    small = read_header(table_file(tmp_path))
    rows = 2 * (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // small.row_bytes
    huge = dataclasses.replace(small, num_rows=rows)
    path = tmp_path / "huge.q4xt"
    with open(path, "wb") as f:
        write_header(f, huge)
        f.truncate(huge.file_bytes)
    plan = plan_shared_table(path, shm_dir=shm_dir)
    assert plan.how == "staged_lookup" and "MemAvailable" in plan.reason
    with nothing_left_behind(tmp_path, shm_dir):
        with caplog.at_level(logging.WARNING, logger=shared.__name__):
            table = open_shared_table(path, shm_dir=shm_dir)
        try:
            assert isinstance(table, FileTable) and table.reader == "direct"
            assert f"{path}: not mapped whole" in caplog.text and "MemAvailable" in caplog.text
            assert os.listdir(shm_dir) == []  # nothing copied
        finally:
            table.close()
    assert plan_shared_table(path, stage=False).how == "staged_lookup"


def test_an_ngram_embedding_reads_the_shared_copy(tmp_path, shm_dir):
    from lookup_support import make_batch
    from ngram_support import CONFIG
    from qwen4exp_ext.layers import NGramEmbedding

    ram = make_embedding("bfloat16", "cpu")
    source = tmp_path / "ple1.q4xt"
    ram.save_table_file(source)
    with nothing_left_behind(tmp_path, shm_dir):
        with open_shared_table(source, shm_dir=shm_dir) as table:
            layer = NGramEmbedding(
                CONFIG, 1, placement="file", dtype="bfloat16", table_path=table.path
            )
            batch = make_batch([5, 0, 13, 1], "cpu", seed=3)
            assert torch.equal(layer(*batch), ram(*batch))
            layer.close_table()
            del layer


def test_without_a_tmpfs_to_stage_in_the_disk_file_is_mapped_through_the_page_cache(
    tmp_path, caplog
):
    source = table_file(tmp_path)
    not_tmpfs = tmp_path / "not_shm"
    not_tmpfs.mkdir()
    with nothing_left_behind(tmp_path):
        with caplog.at_level(logging.WARNING, logger=shared.__name__):
            table = open_shared_table(source, shm_dir=not_tmpfs)
        with table:
            assert table.how == "page_cache" and str(table.path) == source
            assert f"{not_tmpfs} is not a tmpfs directory" in caplog.text
            assert torch.equal(table.rows, file_rows(source))
            assert mapped_file(table.rows.data_ptr()) == source


def _gpu() -> bool:
    from qwen4exp_ext.tables import host_memory

    return torch.cuda.is_available() and host_memory._gpu_build()


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA/ROCm device and a GPU build")
def test_the_shared_mapping_registered_on_the_gpu_reads_as_the_pinned_table(tmp_path, shm_dir):
    from qwen4exp_ext import ops
    from qwen4exp_ext.tables.host_memory import device_view, pinned_host_table

    ram = make_embedding("bfloat16", "cpu")
    source = tmp_path / "ple1.q4xt"
    ram.save_table_file(source)
    pinned = pinned_host_table(ram.num_rows, ram.head_dim, torch.bfloat16)
    pinned.copy_(ram.weight.detach())
    ids = torch.randint(0, ram.num_rows, (64, 4), device="cuda")
    want = ops.gather_rows(device_view(pinned), ids)
    with open_shared_table(source, shm_dir=shm_dir) as table:
        rows = table.device_rows()
        assert rows.is_cuda and table._registration.is_pinned()
        assert table.device_rows().data_ptr() == rows.data_ptr()  # registered once
        got = ops.gather_rows(table.header.value_view(rows), ids)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        del rows
    assert os.listdir(shm_dir) == []


@pytest.mark.skipif(_gpu(), reason="the refusal of a machine without a GPU")
def test_device_rows_without_a_gpu_is_refused_and_registers_nothing(tmp_path, shm_dir):
    source = table_file(tmp_path)
    with nothing_left_behind(tmp_path, shm_dir):
        with open_shared_table(source, shm_dir=shm_dir) as table:
            with pytest.raises(RuntimeError, match="SharedTable.device_rows: "):
                table.device_rows()
            assert table._registration is None
            assert torch.equal(table.rows, file_rows(source))  # the CPU table still serves
