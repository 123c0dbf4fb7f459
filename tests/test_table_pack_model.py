"""``qwen4exp-table pack-model`` and ``verify-model`` (qwen4exp_ext.tables.pack_model) on real
small model directories (tests/model_checkpoint.py): every layer's file equals ``pack --layer L``
byte for byte, a second run skips every layer, a corrupted file is repacked alone, a run killed
with SIGKILL leaves only complete files and the next run completes, and verify-model names the
first layer whose file is missing or differs. Bad arguments: tests/table_bad_inputs.py."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from leak_support import nothing_left_behind
from model_checkpoint import (
    CAUSAL,
    CONDITIONAL,
    DECODER_LAYERS,
    PLE_LAYER_IDS,
    file_bytes,
    text_config,
    write_model,
)
from qwen4exp_ext.tables import pack as table_pack
from qwen4exp_ext.tables.cli import main
from qwen4exp_ext.tables.file_format import HEADER_BYTES, read_header, table_path
from qwen4exp_ext.tables.pack_model import pack_model, ple_layers

LAYERS = range(len(DECODER_LAYERS))
TIMEOUT = 120
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of a few rows: each table is streamed in many pieces."""
    monkeypatch.setattr(table_pack, "CHUNK_BYTES", 300)


def run(capsys, *args) -> tuple[int, list[str], str]:
    """(exit code, stdout lines, stderr) of ``qwen4exp-table *args``."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def inodes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in directory.iterdir()}


@pytest.mark.parametrize("template", [CONDITIONAL, CAUSAL])
@pytest.mark.parametrize("fmt", ["bfloat16", "float8_e4m3fn", "nvfp4"])
def test_pack_model_writes_what_pack_writes_for_every_layer(tmp_path, capsys, fmt, template):
    model = write_model(tmp_path / "model", fmt, template)
    with nothing_left_behind(model):  # the outputs, and nothing else (the listing below)
        code, lines, err = run(capsys, "pack-model", model, "-o", tmp_path / "tables")
    assert code == 0, err
    assert len(lines) == len(LAYERS) + 1  # one line a layer, then the summary
    assert sorted(os.listdir(tmp_path / "tables")) == [f"ple{layer}.q4xt" for layer in LAYERS]
    for layer, decoder in zip(LAYERS, DECODER_LAYERS, strict=True):
        path = table_path(tmp_path / "tables", layer)
        data = path.read_bytes()
        assert data[HEADER_BYTES:] == file_bytes(fmt, layer)  # the checkpoint's rows
        header = read_header(path)
        assert lines[layer] == (
            f"PLE layer {layer} (decoder layer {decoder}): packed, {header.num_rows} rows, "
            f"{header.file_bytes} bytes, " + lines[layer].split(" bytes, ")[1]
        )
        assert lines[layer].endswith(f" s: {path}")
        prefix = template.replace("{layer}", str(decoder))
        single = tmp_path / f"single{layer}"
        code, _, err = run(capsys, "pack", "--config", model / "config.json", "--layer", layer,
                           "--prefix", prefix, "-o", single, model)  # fmt: skip
        assert code == 0, err
        assert data == single.read_bytes()  # byte for byte what `pack --layer L` writes
    assert lines[-1].startswith(f"{tmp_path / 'tables'}: 3 PLE layers, 3 packed, 0 skipped")
    code, lines, err = run(capsys, "verify-model", model, tmp_path / "tables")
    assert code == 0, err
    assert [line.split(":")[0] for line in lines[:-1]] == [
        f"PLE layer {layer} (decoder layer {decoder})"
        for layer, decoder in zip(LAYERS, DECODER_LAYERS, strict=True)
    ]
    assert all(": verified, " in line for line in lines[:-1])


def test_the_layers_are_transformers_dense_ple_indices(tmp_path):
    """ple_layer_ids of a transformers 5.18 config, saved by it: PLE layer L is the decoder
    layer transformers builds with ple_layer_index L."""
    pytest.importorskip("transformers.models.qwen4_exp")
    from hf_support import tiny_config

    config = tiny_config(
        num_hidden_layers=5, layer_types=["linear_attention"] * 5, ple_layer_ids=[5, 2, 4, 2]
    )
    want = [
        (config.ple_layer_ids.index(decoder + 1), decoder)
        for decoder in range(5)
        if decoder + 1 in config.ple_layer_ids
    ]
    config.save_pretrained(tmp_path)
    loaded = table_pack.load_config(tmp_path / "config.json")
    got = [(layer.index, layer.decoder_layer) for layer in ple_layers(loaded)]
    assert got == want == [(0, 1), (1, 3), (2, 4)]


def test_a_second_run_skips_every_layer(tmp_path, capsys):
    model = write_model(tmp_path / "model")
    out = tmp_path / "tables"
    assert run(capsys, "pack-model", model, "-o", out)[0] == 0
    before = inodes(out)
    with nothing_left_behind(tmp_path):
        code, lines, err = run(capsys, "pack-model", model, "-o", out)
    assert code == 0, err
    assert [": skipped (its file verifies), " in line for line in lines[:-1]] == [True] * 3
    assert "3 PLE layers, 0 packed, 3 skipped" in lines[-1]
    assert inodes(out) == before  # no file rewritten


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "row .* differs from the checkpoint's"),
        (lambda data: data[:-7], "truncated table file"),
        (lambda data: b"", "not a qwen4exp table file"),
    ],
    ids=["flipped-bit", "truncated", "empty"],
)
def test_a_damaged_file_is_repacked_alone(tmp_path, capsys, damage, reason):
    model = write_model(tmp_path / "model")
    out = tmp_path / "tables"
    assert run(capsys, "pack-model", model, "-o", out)[0] == 0
    good = table_path(out, 1).read_bytes()
    table_path(out, 1).write_bytes(damage(good))
    before = inodes(out)
    with nothing_left_behind(tmp_path):
        code, lines, err = run(capsys, "pack-model", model, "-o", out)
    assert code == 0, err
    assert ": skipped (" in lines[0] and ": skipped (" in lines[2]
    assert lines[1].startswith("PLE layer 1 (decoder layer 3): repacked (its file did not verify: ")
    assert re.search(reason, lines[1]), lines[1]
    assert "1 packed, 2 skipped" in lines[-1]
    assert table_path(out, 1).read_bytes() == good
    after = inodes(out)
    assert after["ple0.q4xt"] == before["ple0.q4xt"] and after["ple2.q4xt"] == before["ple2.q4xt"]
    assert run(capsys, "verify-model", model, out)[0] == 0


def test_verify_model_names_the_first_missing_or_differing_layer(tmp_path, capsys):
    model = write_model(tmp_path / "model")
    out = tmp_path / "tables"
    assert run(capsys, "pack-model", model, "-o", out)[0] == 0
    data = bytearray(table_path(out, 2).read_bytes())
    data[HEADER_BYTES + 5] ^= 0x40
    table_path(out, 2).write_bytes(bytes(data))
    code, lines, err = run(capsys, "verify-model", model, out)
    assert code == 1
    assert len(lines) == 2  # layers 0 and 1 verified, then the error
    assert err.startswith("qwen4exp-table: error: PLE layer 2 (decoder layer 4): ")
    assert "row 0 differs from the checkpoint's (byte 5 of the row" in err
    table_path(out, 1).unlink()
    code, lines, err = run(capsys, "verify-model", model, out)
    assert code == 1 and len(lines) == 1
    assert f"PLE layer 1 (decoder layer 3): {table_path(out, 1)}: no such table file" in err


def test_a_table_directory_beside_the_checkpoint_files_works(tmp_path, capsys):
    """The checkpoint directory itself as the output: ple<L>.q4xt is no name its scan reads."""
    model = write_model(tmp_path / "model")
    assert run(capsys, "pack-model", model, "-o", model)[0] == 0
    assert run(capsys, "pack-model", model, "-o", model)[1][0].count("skipped") == 1
    assert run(capsys, "verify-model", model, model)[0] == 0


def test_leftover_temporaries_of_a_dead_writer_are_removed(tmp_path, capsys):
    model = write_model(tmp_path / "model")
    out = tmp_path / "tables"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=TIMEOUT, check=True)  # fmt: skip
    dead = out / f".ple1.q4xt.{int(gone.stdout)}.0123456789abcdef.tmp"
    live = out / f".ple1.q4xt.{os.getppid()}.0123456789abcdef.tmp"  # pytest's parent: alive
    dead.write_bytes(b"half a table")
    live.write_bytes(b"another writer's")
    code, lines, err = run(capsys, "pack-model", model, "-o", out)
    assert code == 0, err
    assert not dead.exists() and live.read_bytes() == b"another writer's"
    assert f"PLE layer 1 (decoder layer 3): removed {dead}, left by a killed run" in lines
    live.unlink()


def _pack_model_process(model: Path, out: Path) -> subprocess.Popen:
    """pack-model in a child process, in chunks of 64 bytes (long enough to be killed while
    writing a layer); its stdout line-buffered."""
    code = (
        "import sys; from qwen4exp_ext.tables import pack; pack.CHUNK_BYTES = 64; "
        "from qwen4exp_ext.tables.cli import main; "
        f"sys.exit(main(['pack-model', {str(model)!r}, '-o', {str(out)!r}]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), *sys.path])}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def test_a_run_killed_mid_way_leaves_only_complete_files_and_the_next_completes(tmp_path, capsys):
    base = 12000  # ~48,000 rows a layer: about half a second of 64-byte chunks
    model = write_model(tmp_path / "model", ngram_vocab_size_base=base)
    out = tmp_path / "tables"
    child = _pack_model_process(model, out)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in child.stdout], daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=TIMEOUT)
        assert first.startswith("PLE layer 0 (decoder layer 1): packed"), first
        # Killed while it writes layer 1: once its temporary file is there.
        deadline = time.monotonic() + TIMEOUT
        while not (writing := [p for p in out.iterdir() if p.name.startswith(".ple1.q4xt.")]):
            assert time.monotonic() < deadline and child.poll() is None, "layer 1 never started"
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=TIMEOUT) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=TIMEOUT)
        reader.join(TIMEOUT)  # the pipe is at its end once the child is gone
        assert not reader.is_alive()
        child.stdout.close()
        child.stderr.close()
    # Only complete files under the final names: each one's header and size check out, and it
    # holds its layer's rows.
    finals = sorted(p for p in out.iterdir() if not p.name.startswith("."))
    assert finals == [table_path(out, 0)]  # layer 1's half file is not under its name
    assert writing[0].exists()  # its temporary is left, half written
    for path in finals:
        layer = int(path.name.removeprefix("ple").removesuffix(".q4xt"))
        assert path.read_bytes()[HEADER_BYTES:] == file_bytes(
            "bfloat16", layer, ngram_vocab_size_base=base
        )
    code, got, err = run(capsys, "pack-model", model, "-o", out)
    assert code == 0, err
    assert got[0].startswith("PLE layer 0 (decoder layer 1): skipped")
    assert got[1] == f"PLE layer 1 (decoder layer 3): removed {writing[0]}, left by a killed run"
    assert got[2].startswith("PLE layer 1 (decoder layer 3): packed")
    assert sorted(os.listdir(out)) == ["ple0.q4xt", "ple1.q4xt", "ple2.q4xt"]  # no temporary
    assert run(capsys, "verify-model", model, out)[0] == 0


def test_pack_model_checks_every_layer_before_writing_any(tmp_path, capsys):
    """A checkpoint without PLE layer 2's table: refused before ple0.q4xt is written, and no
    output directory is created."""
    model = write_model(tmp_path / "model", skip_layers=(2,))
    with nothing_left_behind(tmp_path):
        code, lines, err = run(capsys, "pack-model", model, "-o", tmp_path / "tables")
    assert code == 1 and lines == []
    assert "no PLE table rows" in err and "model.language_model.layers.4.ple.ple_embedding." in err
    assert not (tmp_path / "tables").exists()


def test_pack_model_api_returns_each_layer(tmp_path):
    model = write_model(tmp_path / "model", "float16")
    seen: list[str] = []
    results = pack_model(model, tmp_path / "t", progress=seen.append)
    assert [r.action for r in results] == ["packed"] * 3
    assert seen == [r.line() for r in results]
    assert [r.layer.decoder_layer for r in results] == DECODER_LAYERS
    assert text_config()["ple_layer_ids"] == PLE_LAYER_IDS
