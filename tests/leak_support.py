"""Nothing left behind: what a call leaves open in this process, read from ``/proc/self``.

The host tier's bad-input tables (table files, readers, pipelines, the environment variables)
check that a refused call leaves no descriptor, file mapping or thread behind, and no file
written::

    with nothing_left_behind(tmp_path):
        with pytest.raises(TableFileError, match="..."):
            FileTable(path)

compares the process's open descriptors (by target), its file-backed mappings, its live threads
and the files under ``tmp_path`` (the directories given) before and after the block. Objects
that a failed call created are garbage-collected first, so what counts is what outlives them.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SETTLE_SECONDS = 5.0  # how long a thread that is shutting down may take to go


def open_descriptors() -> collections.Counter:
    """What this process's descriptors point at (a path, ``pipe:[...]``, ...), with counts."""
    targets: collections.Counter = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            targets[os.readlink(f"/proc/self/fd/{fd}")] += 1
    return targets


def file_mappings() -> collections.Counter:
    """The files mapped into this process (the path column of /proc/self/maps), with counts of
    their mappings; anonymous and special ([heap], [stack]...) mappings are left out."""
    mapped: collections.Counter = collections.Counter()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                mapped[fields[5].strip()] += 1
    return mapped


def live_threads() -> set[int]:
    """The idents of this process's live Python threads."""
    return {t.ident for t in threading.enumerate() if t.is_alive()}


def files_under(directories: tuple[Path, ...]) -> set[str]:
    """Every file and folder below ``directories`` (dot files included)."""
    found: set[str] = set()
    for directory in directories:
        for root, dirs, files in os.walk(directory):
            found.update(os.path.join(root, name) for name in (*dirs, *files))
    return found


@contextlib.contextmanager
def nothing_left_behind(*directories: str | os.PathLike) -> Iterator[None]:
    """Fails (AssertionError) when the block leaves a descriptor, a file mapping, a thread or a
    file under ``directories`` that was not there before it. Threads get SETTLE_SECONDS to
    end (a worker told to stop may still be on its way out). Objects created before the block
    and dropped in it are not collected there (they are frozen): drop them before the block."""
    dirs = tuple(Path(d) for d in directories)
    # What lives now is frozen, so that the collection after the block scans only what the block
    # created: a full collection in a process holding torch, transformers and vLLM takes ~0.5 s,
    # and two a block made these checks a fifth of CI's test time. Garbage already there is left
    # to the collections after the block: it could only close descriptors, never open them.
    gc.freeze()
    try:
        fds, maps, threads = open_descriptors(), file_mappings(), live_threads()
        files = files_under(dirs)
        yield
        gc.collect()
    finally:
        gc.unfreeze()
    deadline = time.monotonic() + SETTLE_SECONDS
    while live_threads() - threads and time.monotonic() < deadline:
        time.sleep(0.01)
    problems = []
    if left := dict(open_descriptors() - fds):
        problems.append(f"descriptors left open: {left}")
    if left := dict(file_mappings() - maps):
        problems.append(f"files left mapped: {left}")
    if left := live_threads() - threads:
        names = sorted(t.name for t in threading.enumerate() if t.ident in left)
        problems.append(f"threads left running: {names}")
    if left := files_under(dirs) - files:
        problems.append(f"files left behind: {sorted(left)}")
    assert not problems, "; ".join(problems)
