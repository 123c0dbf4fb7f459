"""tools/startup_figure.py: the start-up figure runs on a small table, times every source cold
and warm, names the table's size, the CPU and the disk, and leaves nothing in the shared-memory
directory or beside the files; for our layer and for vLLM's (``--layer vllm``)."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import tempfile
from pathlib import Path

import pytest
import safetensors.torch  # noqa: F401 - imported before the leak check: its library maps

from leak_support import nothing_left_behind
from qwen4exp_ext.tables import shared
from vllm_support import require_vllm, run_python

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "startup_figure.py"


@pytest.fixture
def shm_dir():
    if not os.path.isdir(shared.SHM_DIR) or not shared.on_tmpfs(shared.SHM_DIR):
        pytest.skip(f"{shared.SHM_DIR} is not a tmpfs here")
    directory = tempfile.mkdtemp(prefix="q4x-startup-test-", dir=shared.SHM_DIR)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_startup_figure_times_every_source(tmp_path, shm_dir, capsys):
    tool = runpy.run_path(str(SCRIPT))
    out = tmp_path / "figure.json"
    files = tmp_path / "files"
    files.mkdir()
    with nothing_left_behind(files, shm_dir):
        args = ["--rows-base", "300", "--embed-dim", "24", "--dir", str(files), "--repeat", "1"]
        figure = tool["main"]([*args, "--shm-dir", shm_dir, "--json", str(out)])
    assert json.loads(out.read_text()) == figure
    # 4 heads of >= 300 rows (padded), 6 bf16 elements a row, after the 4096-byte header.
    assert figure["table_bytes"] >= 4096 + 4 * 300 * 12
    assert set(figure["seconds"]) == set(tool["SOURCES"])
    for by_state in figure["seconds"].values():
        assert set(by_state) == {"cold", "warm"} and all(t > 0 for t in by_state.values())
    printed = capsys.readouterr().out
    assert "cpu: " in printed and "disk: " in printed and "MiB bfloat16" in printed
    assert os.listdir(files) == []


@require_vllm()
def test_startup_figure_times_vllms_layer_from_safetensors_and_the_table_directory(tmp_path):
    """``--layer vllm`` (in a fresh interpreter: it loads the plugin and sets up vLLM's gloo
    group): vLLM's own embedding timed from safetensors and from the table directory, the
    latter really served from the file (the tool refuses a run where the plugin did not)."""
    out = tmp_path / "figure.json"
    files = tmp_path / "files"
    files.mkdir()
    args = ["--layer", "vllm", "--rows-base", "300", "--embed-dim", "24", "--repeat", "1"]
    args += ["--dir", str(files), "--json", str(out)]
    stdout = run_python(
        f"import runpy, sys\nsys.argv = [{str(SCRIPT)!r}, *{args!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n",
        timeout=600,
    )
    figure = json.loads(out.read_text())
    assert figure["layer"] == "vllm" and figure["table_bytes"] >= 4096 + 4 * 300 * 12
    assert set(figure["seconds"]) == {"safetensors", "table_dir"}
    for by_state in figure["seconds"].values():
        assert set(by_state) == {"cold", "warm"} and all(t > 0 for t in by_state.values())
    assert "(vllm)" in stdout and "cpu: " in stdout and "disk: " in stdout
    assert os.listdir(files) == []  # the files and vLLM's rendezvous file went with the run
