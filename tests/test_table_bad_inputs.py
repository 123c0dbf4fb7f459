"""Bad inputs of the table-file surface (issue #47; the cases: tests/table_bad_inputs.py):
``qwen4exp-table`` exits 1 (argparse: 2) with one error line that names the argument or file,
writes no output, leaves its inputs byte for byte and nothing open; ``NGramEmbedding(placement=
"file")`` and ``FileTable`` raise with the case's message and leave nothing open. No call may
hang: each runs in a thread with a timeout, and a FIFO it would block on is opened from the other
side if it does."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import threading

import pytest

from leak_support import nothing_left_behind
from qwen4exp_ext.layers import NGramEmbedding
from qwen4exp_ext.tables.cli import main
from qwen4exp_ext.tables.file_format import TableFileError, read_header
from qwen4exp_ext.tables.readers import FileTable
from table_bad_inputs import (
    CLI_CASES,
    EMBEDDING_CASES,
    FILE_TABLE_CASES,
    World,
    argv,
    baseline,
    embedding_baseline,
)

TIMEOUT = 60


@pytest.fixture
def world(tmp_path):
    return World(tmp_path)


def regular_files(root) -> dict:
    """The bytes of every regular file under ``root`` and the names of the other entries (a FIFO
    is never read)."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                with open(path, "rb") as f:
                    found[path] = f.read()
            else:
                found[path] = stat.S_IFMT(mode)
    return found


def run_bounded(call, root):
    """call() in a thread, at most TIMEOUT seconds: its result, or raises what it raised. A call
    still blocked then (on a FIFO of ``root``) is unblocked by opening the FIFOs for writing,
    and the test fails."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as error:  # SystemExit included: handed to the test
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    if thread.is_alive():
        for path, kind in regular_files(root).items():
            if kind == stat.S_IFIFO:
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(TIMEOUT)
        pytest.fail(f"the call did not return within {TIMEOUT} s (blocked)")
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize(("command", "arg", "value", "match", "code"), CLI_CASES)
def test_qwen4exp_table_refuses_a_bad_argument(world, capsys, command, arg, value, match, code):
    args = baseline(world, command)
    args[arg] = value(world)
    line = argv(command, args)
    before = regular_files(world.root)
    capsys.readouterr()
    with nothing_left_behind(world.root):
        try:
            got = run_bounded(lambda: main(line), world.root)
        except SystemExit as usage:  # argparse
            got = usage.code
    err = capsys.readouterr().err
    assert got == code, err
    assert err.count("\n") == 1 or code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert re.search(match, last), f"{match!r} not in {last!r}"
    if code == 1:
        assert last.startswith("qwen4exp-table: error: ")
    assert regular_files(world.root) == before  # no output, inputs unchanged


@pytest.mark.parametrize("reader", ["mmap", "direct"])
@pytest.mark.parametrize(("arg", "value", "match", "exc"), EMBEDDING_CASES)
def test_file_embedding_refuses_a_bad_argument(world, reader, arg, value, match, exc):
    kwargs = embedding_baseline(world, reader)
    kwargs[arg] = value(world)
    config = kwargs.pop("config")
    before = regular_files(world.root)
    with nothing_left_behind(world.root), pytest.raises(exc, match=match):
        run_bounded(lambda: NGramEmbedding(config, **kwargs), world.root)
    assert regular_files(world.root) == before


@pytest.mark.parametrize("reader", ["mmap", "direct"])
@pytest.mark.parametrize(("arg", "value", "match", "exc"), FILE_TABLE_CASES)
def test_file_table_refuses_a_bad_argument(world, reader, arg, value, match, exc):
    kwargs = {"table_path": str(world.table), "table_reader": reader, "io_threads": 0}
    kwargs[arg] = value(world)
    before = regular_files(world.root)
    with nothing_left_behind(world.root), pytest.raises(exc, match=match):
        run_bounded(
            lambda: FileTable(kwargs["table_path"], None, kwargs["table_reader"],
                              kwargs["io_threads"]),
            world.root,
        )  # fmt: skip
    assert regular_files(world.root) == before


@pytest.mark.parametrize("recursion_limit", [None, 20_000])
def test_a_deeply_nested_header_is_refused_whatever_the_recursion_limit(world, recursion_limit):
    """json.loads raises RecursionError only past the interpreter's recursion limit: under a
    host that raised it (a test runner's worker did), the nested header parsed and was refused
    for its fields instead, a message that depended on who read the file."""
    path = world.nested_header()
    previous = sys.getrecursionlimit()
    try:
        if recursion_limit:
            sys.setrecursionlimit(recursion_limit)
        with pytest.raises(TableFileError, match=r"corrupted table file header \(too deeply"):
            read_header(path)
    finally:
        sys.setrecursionlimit(previous)
