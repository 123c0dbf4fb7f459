"""tests/leak_support.py catches each kind of leak it claims to, and passes a clean block."""

from __future__ import annotations

import mmap
import os
import threading

import pytest

from leak_support import nothing_left_behind


def test_a_clean_block_passes(tmp_path):
    with nothing_left_behind(tmp_path):
        fd = os.open(tmp_path, os.O_RDONLY)
        os.close(fd)
        (tmp_path / "gone").write_bytes(b"x")
        (tmp_path / "gone").unlink()


def test_a_descriptor_left_open_fails(tmp_path):
    fd = None
    with pytest.raises(AssertionError, match="descriptors left open"):
        with nothing_left_behind():
            fd = os.open(tmp_path, os.O_RDONLY)
    os.close(fd)


def test_a_file_left_mapped_fails(tmp_path):
    path = tmp_path / "mapped"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(path, "rb") as f:
        mapping = None
        with pytest.raises(AssertionError, match="files left mapped"):
            with nothing_left_behind():
                mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    mapping.close()


def test_a_thread_left_running_fails():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, args=(30,), name="left-behind")
    try:
        with pytest.raises(AssertionError, match="threads left running: \\['left-behind'\\]"):
            with nothing_left_behind():
                thread.start()
    finally:
        stop.set()
        thread.join(timeout=30)


def test_a_file_left_behind_fails(tmp_path):
    with pytest.raises(AssertionError, match="files left behind: .*tmp.partial"):
        with nothing_left_behind(tmp_path):
            (tmp_path / "tmp.partial").write_bytes(b"half")
