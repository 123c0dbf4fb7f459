"""Issue #49's acceptance "two processes mapping one file share its pages", at vLLM's level: two
processes of a node each build vLLM's own Qwen4Exp PLE embedding (NVIDIA class, on the CPU) from
one table directory (``vllm_table_dir_script.py``, mode ``share``), load it and look every row
up; while both are alive, the table's pages show as shared in both processes' smaps entry for
the mapping that holds vLLM's ``weight``: one copy in RAM, the page cache's.

The table directory is on a disk here (the test skips where ``tmp_path`` is a tmpfs): its
written-back pages count as ``Shared_Clean``. (A tmpfs file's pages count as ``Shared_Dirty``:
see tests/test_shared_table.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model_checkpoint as mc
from test_shared_table import WAIT, read_line, smaps_of
from vllm_support import require_vllm

pytestmark = require_vllm()

from qwen4exp_ext.tables import pack_model  # noqa: E402
from qwen4exp_ext.tables.file_format import table_path  # noqa: E402
from qwen4exp_ext.tables.shared import on_tmpfs  # noqa: E402

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
