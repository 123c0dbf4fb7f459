"""Issue #49's acceptance "two processes mapping one file share its pages", at vLLM's level: two
processes of a node each build vLLM's own Qwen4Exp PLE embedding (NVIDIA class, on the CPU) from
one table directory (``vllm_table_dir_script.py``, mode ``share``), load it and look every row
up; while both are alive, the table's pages show as shared in both processes' smaps entry for
the mapping that holds vLLM's ``weight``: one copy in RAM, the page cache's.

The table directory is on a disk here (the test skips where ``tmp_path`` is a tmpfs): its
written-back pages count as ``Shared_Clean``. (A tmpfs file's pages count as ``Shared_Dirty``:
see tests/test_shared_table.py.)

And the join of vLLM's pinned table with ``tables/shared.py`` (``table_dir.node_shared_table``):
on the CPU, which mapping a rank takes (the node's staged copy, one staging for two ranks) and
the fallback of a table larger than memory (a private mapping of the rank's rows, or an error
naming the file); on a GPU (skipped here), the registered shared mapping's lookup of a rank's
rows against the private pinned table's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model_checkpoint as mc
import test_shared_table
from leak_support import nothing_left_behind
from qwen4exp_ext.tables import pack_model
from qwen4exp_ext.tables.file_format import read_header, table_path, write_header
from qwen4exp_ext.tables.shared import SharedTable, on_tmpfs, staged_copy_path
from qwen4exp_ext.vllm import table_dir
from test_shared_table import WAIT, _gpu, file_rows, read_line, smaps_of, table_file
from vllm_support import require_vllm

shm_dir = test_shared_table.shm_dir  # the fixture: a fresh directory in /dev/shm (tmpfs)

SCRIPT = Path(__file__).with_name("vllm_table_dir_script.py")
LAYER = 1
PREFIX = mc.CONDITIONAL.replace("{layer}", str(mc.DECODER_LAYERS[LAYER]))
START_WAIT = 300.0  # a fresh interpreter importing vLLM on a loaded 2-core machine


def _start(work: Path, name: str, case: dict) -> subprocess.Popen:
    """One process of the node running the script's ``share`` mode (its own gloo store)."""
    case_path = work / f"{name}.json"
    case_path.write_text(json.dumps({**case, "store": str(work / f"store_{name}")}))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(case_path), str(work / f"{name}.pt")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _stop(process: subprocess.Popen) -> None:
    """Lets the process finish (or kills it if it has not), every wait with a timeout."""
    try:
        if process.poll() is None:
            process.stdin.write("go\n")
            process.stdin.flush()
            read_line(process, "closed", WAIT)
        assert process.wait(timeout=WAIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT)
        process.stdin.close()
        process.stdout.close()


@require_vllm()
def test_two_vllm_processes_share_the_table_files_pages(tmp_path):
    if on_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is a tmpfs: its pages would count as Shared_Dirty")
    model = mc.write_model(tmp_path / "model", "bfloat16")
    tables = tmp_path / "tables"
    pack_model.pack_model(model, tables)
    os.sync()  # written back: the page cache's pages of the file are clean
    case = dict(
        mode="share",
        cls="nvidia",
        config=mc.text_config(),
        layer=LAYER,
        prefix=PREFIX,
        rows=mc.table("bfloat16", LAYER)[0].shape[0],
        table_dir=str(tables),
        files=sorted(str(p) for p in model.glob("*.safetensors")),
    )
    path = os.path.realpath(table_path(tables, LAYER))
    processes = [_start(tmp_path, name, case) for name in ("first", "second")]
    try:
        ready = [read_line(p, "ready", START_WAIT).split(maxsplit=3) for p in processes]
        counters = []
        for process, (_, address, _, where) in zip(processes, ready, strict=True):
            assert where.strip() == path  # vLLM's weight lies in the file's mapping
            counters.append(smaps_of(int(address), process.pid))
        # Every page of the rows (page-aligned down, so one more page may be the header's,
        # mapped by fault-around in one process only) is resident and shared in both.
        rows_kb = (int(ready[0][2]) // 4096) * 4
        assert rows_kb > 0
        for mine in counters:
            assert mine["Shared_Clean"] >= rows_kb, counters
            assert mine["Private_Clean"] + mine["Private_Dirty"] <= 4, counters
            assert mine["Shared_Clean"] + 4 >= mine["Rss"], counters
    finally:
        for process in processes:
            _stop(process)
    first, second = (torch.load(tmp_path / f"{n}.pt") for n in ("first", "second"))
    assert first.abs().sum() > 0 and torch.equal(first.view(torch.uint8), second.view(torch.uint8))


def _halves(path) -> list[tuple[int, int]]:
    """Two ranks' vocabulary shards (ETP = 2) of the table file: (start, count)."""
    rows = read_header(path).num_rows
    return [(0, rows // 2), (rows // 2, rows - rows // 2)]


def test_a_pinned_tables_ranks_map_the_nodes_one_staged_copy(tmp_path, shm_dir):
    source = table_file(tmp_path)
    expected = read_header(source)
    with nothing_left_behind(tmp_path, shm_dir):
        ranks = [
            table_dir.node_shared_table(source, expected, start, count, shm_dir=shm_dir)
            for start, count in _halves(source)
        ]
        try:
            assert all(isinstance(t, SharedTable) and t.how == "stage" for t in ranks)
            assert ranks[0].staged and not ranks[1].staged  # staged once for the node
            assert ranks[0].path == ranks[1].path == staged_copy_path(source, shm_dir)
            want = file_rows(source)
            for table, (start, count) in zip(ranks, _halves(source), strict=True):
                assert torch.equal(table.rows[start : start + count], want[start : start + count])
        finally:
            for table in ranks:
                table.close()
        assert os.listdir(shm_dir) == []  # the last rank removed the copy


def _huge_table(directory) -> str:
    """A real table file larger than this machine's memory (sparse), as test_shared_table's."""
    small = read_header(table_file(directory, name="small.q4xt"))
    rows = 2 * (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // small.row_bytes
    huge = dataclasses.replace(small, num_rows=rows)
    path = os.path.join(directory, "huge.q4xt")
    with open(path, "wb") as f:
        write_header(f, huge)
        f.truncate(huge.file_bytes)
    return path


def test_a_pinned_table_larger_than_memory_falls_back_to_the_ranks_own_rows(
    tmp_path, shm_dir, caplog
):
    path = _huge_table(tmp_path)
    header = read_header(path)
    with nothing_left_behind(tmp_path, shm_dir):
        with caplog.at_level(logging.WARNING, logger=table_dir.logger.name):
            assert table_dir.node_shared_table(path, header, 64, 1024, shm_dir=shm_dir) is None
        assert f"{path} is larger than the memory available" in caplog.text
        assert "rows [64, 1088)" in caplog.text and "private copy" in caplog.text
        # A rank whose own rows do not fit either: refused, naming the file and why.
        with pytest.raises(table_dir.TableFileError) as refused:
            table_dir.node_shared_table(path, header, 0, header.num_rows, shm_dir=shm_dir)
        message = str(refused.value)
        assert message.startswith(f"{path}: ") and "no CPU-staged lookup" in message
        assert os.listdir(shm_dir) == []  # nothing staged


@pytest.mark.skipif(not _gpu(), reason="needs a GPU (CUDA/ROCm device and a GPU build)")
def test_on_a_gpu_a_ranks_rows_of_the_registered_shared_mapping_read_as_the_pinned_table(
    tmp_path, shm_dir
):
    """What a pinned vLLM table's ``weight`` is on a GPU (LayerTable._register_shared): rank
    1's rows of the node's registered mapping, looked up zero-copy, equal the same rows of a
    private pinned table."""
    from qwen4exp_ext import ops
    from qwen4exp_ext.tables.host_memory import device_view, pinned_host_table

    source = table_file(tmp_path)
    header = read_header(source)
    start, count = _halves(source)[1]
    want_rows = header.value_view(file_rows(source))[start : start + count]
    pinned = pinned_host_table(count, want_rows.shape[1], want_rows.dtype)
    pinned.copy_(want_rows)
    ids = torch.randint(0, count, (64, 4), device="cuda")
    want = ops.gather_rows(device_view(pinned), ids)
    table = table_dir.node_shared_table(source, header, start, count, shm_dir=shm_dir)
    try:
        weight = table.registered_rows()[start : start + count]
        assert weight.device.type == "cpu" and weight.is_pinned()
        got = ops.gather_rows(header.value_view(device_view(weight)), ids)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        del weight
    finally:
        table.close()
    assert os.listdir(shm_dir) == []
