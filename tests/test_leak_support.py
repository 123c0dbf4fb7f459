"""tests/leak_support.py catches each kind of leak it claims to, and passes a clean block."""

from __future__ import annotations

import gc
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


def test_garbage_the_block_made_is_collected_before_counting(tmp_path):
    """A descriptor held only by a reference cycle the block dropped is closed by the block's own
    collection, though everything older is frozen meanwhile: not a leak."""
    held = tmp_path / "held"
    held.write_bytes(b"")

    class Holder:
        def __init__(self):
            self.file = open(held, "rb")  # noqa: SIM115 (closed when collected)
            self.cycle = self

        def __del__(self):
            self.file.close()

    gc.disable()  # only the block's own collection may find the cycle
    try:
        with nothing_left_behind(tmp_path):
            Holder()
    finally:
        gc.enable()
