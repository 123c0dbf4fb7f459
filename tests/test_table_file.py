"""The on-disk PLE table file (qwen4exp_ext.tables.file_format) and qwen4exp-table (tables.pack and
tables.cli): pack from real safetensors checkpoints in every format, byte-for-byte rows, verify, and
every refusal of a bad header, file or checkpoint (leaving no file behind)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from qwen4exp_ext import layout
from qwen4exp_ext.layers import NGramEmbedding
from qwen4exp_ext.tables import pack as table_pack
from qwen4exp_ext.tables.cli import main
from qwen4exp_ext.tables.file_format import (
    FORMATS,
    HEADER_BYTES,
    MAGIC,
    TableFileError,
    TableFileHeader,
    check_header,
    expected_header,
    layout_checksum,
    read_header,
    write_header,
)
from qwen4exp_ext.tables.pack import pack_table, verify_table

LAYER = 1
PARTS = 7
# 4 heads of 16 elements; 320 rows in 7 shards of 46, the last 44.
CONFIG = SimpleNamespace(
    vocab_size=97,
    ngram_size=3,
    heads_per_ngram=2,
    ple_embed_dim=64,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=16,
    eos_token_id=5,
    seed=7,
    split_ngram_parts=PARTS,
)
HEADS = layout.head_vocab_layout(50, 4, LAYER, 16)
ROWS, D = HEADS.padded_rows, 16
SHARD = -(-ROWS // PARTS)
PREFIX = "model.ple."
SCALE = 0.37
SCALE32 = torch.tensor(SCALE).item()  # the scale as a checkpoint's fp32 holds it
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of a few rows, so shards are streamed in several pieces that do not divide them."""
    monkeypatch.setattr(table_pack, "CHUNK_BYTES", 300)


def make_table(fmt: str, seed: int = 0):
    """(checkpoint row tensors, block scales or None): the whole table in ``fmt``."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == "nvfp4":
        codes = torch.randint(0, 256, (ROWS, D // 2), dtype=torch.uint8, generator=gen)
        bits = torch.randint(0x01, 0x60, (ROWS, D // 16), dtype=torch.uint8, generator=gen)
        return codes, bits.view(torch.float8_e4m3fn)
    return torch.randn(ROWS, D, generator=gen).to(DTYPES[fmt]), None


def file_rows(table, block_scales) -> bytes:
    """The bytes the file's data region must hold."""
    data = table.contiguous().view(torch.uint8)
    if block_scales is not None:
        data = torch.cat([data, block_scales.view(torch.uint8)], dim=1)
    return data.numpy().tobytes()


def checkpoint_weights(fmt, table, block_scales, *, per_shard_scale=False, unsharded=False):
    """The checkpoint's tensors (names after the prefix), NGramEmbedding's names."""
    weights = {
        "layer_multipliers": torch.tensor(layout.layer_multipliers(97, 3, 7, LAYER)),
        "ngram_heads_vocab_sizes": torch.tensor(HEADS.sizes),
        "ngram_heads_offsets": torch.tensor(HEADS.offsets),
        "ngram_embedding.hashstats_counts": torch.zeros(3),
    }
    if unsharded:
        weights["ngram_embedding.weight"] = table.clone()
    else:
        for i in range(PARTS):
            rows = slice(i * SHARD, (i + 1) * SHARD)
            weights[f"ngram_embedding.shard_{i}.weight"] = table[rows].clone()
            if block_scales is not None:
                weights[f"ngram_embedding.shard_{i}.weight_scale"] = block_scales[rows].clone()
                if per_shard_scale:
                    weights[f"ngram_embedding.shard_{i}.weight_scale_2"] = torch.tensor(SCALE)
    if fmt.startswith("float8"):
        weights["ngram_embedding.weight_scale"] = torch.tensor([SCALE])
    if fmt == "nvfp4" and not per_shard_scale:
        weights["ngram_embedding.weight_scale_2"] = torch.tensor([SCALE])
    return weights


def save_checkpoint(directory, weights, prefix=PREFIX) -> list:
    """Two safetensors files (shards 0-2 and their scales in the first), with tensors of other
    modules beside them."""
    directory.mkdir(exist_ok=True)
    first = {prefix + k: v for k, v in weights.items() if k.startswith("ngram_embedding.shard_")}
    first = {k: v for k, v in first.items() if int(k.split("shard_")[1].split(".")[0]) < 3}
    rest = {prefix + k: v for k, v in weights.items() if prefix + k not in first}
    first["model.embed_tokens.weight"] = torch.zeros(4, 2)
    rest[prefix + "conv.weight"] = torch.ones(3)
    paths = [directory / "model-00001.safetensors", directory / "model-00002.safetensors"]
    save_file(first, paths[0])
    save_file(rest, paths[1])
    return paths


def checkpoint(tmp_path, fmt="bfloat16", seed=0, **kwargs):
    """(files, table, block scales) of a checkpoint in ``fmt`` under tmp_path/ckpt."""
    table, block_scales = make_table(fmt, seed)
    weights = checkpoint_weights(fmt, table, block_scales, **kwargs)
    return save_checkpoint(tmp_path / "ckpt", weights), table, block_scales


def packed(tmp_path, fmt="bfloat16", **kwargs):
    files, table, block_scales = checkpoint(tmp_path, fmt, **kwargs)
    out = tmp_path / "layer1.q4xtable"
    pack_table(files, out, CONFIG, LAYER, prefix=PREFIX)
    return out, files, table, block_scales


def assert_nothing_written(tmp_path, out):
    """No table file, and no temporary file beside it."""
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# --- the format -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_writes_the_checkpoints_bytes_and_verify_passes(tmp_path, fmt):
    files, table, block_scales = checkpoint(tmp_path, fmt)
    out = tmp_path / "layer1.q4xtable"
    header = pack_table(files, out, CONFIG, LAYER, prefix=PREFIX)
    quantized = fmt == "nvfp4" or fmt.startswith("float8")
    assert header == read_header(out)
    want = expected_header(CONFIG, LAYER, fmt if fmt == "nvfp4" else DTYPES[fmt])
    assert header == TableFileHeader(**{**want.__dict__, "scale": SCALE32 if quantized else None})
    assert header.format == fmt and header.num_rows == ROWS and header.head_dim == D
    assert header.torch_dtype() == table.dtype
    if fmt == "nvfp4":
        assert (header.row_bytes, header.code_bytes) == (D // 2 + D // 16, D // 2)
    else:
        assert header.row_bytes == header.code_bytes == D * table.element_size()
    data = out.read_bytes()
    assert len(data) == header.file_bytes == HEADER_BYTES + ROWS * header.row_bytes
    assert data[:8] == MAGIC
    assert data[HEADER_BYTES:] == file_rows(table, block_scales)
    row = 200  # in shard 4: row i lies at data_offset + i * row_bytes
    at = header.data_offset + row * header.row_bytes
    assert data[at : at + header.code_bytes] == table[row].view(torch.uint8).numpy().tobytes()
    counts = verify_table(out, files, CONFIG, LAYER, prefix=PREFIX)
    assert counts == {"rows": ROWS, "pieces": PARTS, "bytes": ROWS * header.row_bytes}


def test_unsharded_weight_directory_and_whole_chunks(tmp_path, monkeypatch):
    """An unsharded ngram_embedding.weight, the checkpoint given as its directory, and the
    default chunk size (one chunk)."""
    monkeypatch.setattr(table_pack, "CHUNK_BYTES", 64 << 20)
    files, table, _ = checkpoint(tmp_path, "float16", unsharded=True)
    out = tmp_path / "t.bin"
    header = pack_table([tmp_path / "ckpt"], out, CONFIG, LAYER, "float16", PREFIX)
    assert out.read_bytes()[HEADER_BYTES:] == file_rows(table, None)
    assert verify_table(out, files, CONFIG, LAYER, PREFIX)["pieces"] == 1
    assert header.scale is None


def test_nvfp4_global_scale_per_shard(tmp_path):
    out, files, table, scales = packed(tmp_path, "nvfp4", per_shard_scale=True)
    assert read_header(out).scale == SCALE32  # the fp32 value, exactly
    verify_table(out, files, CONFIG, LAYER, PREFIX)


def test_expected_header_is_ngram_embeddings_layout():
    """The checksum binds the layout that NGramEmbedding builds from the same config."""
    for dtype in (torch.bfloat16, "float8_e4m3fn", "nvfp4"):
        m = NGramEmbedding(CONFIG, LAYER, placement="cpu", dtype=dtype)
        header = expected_header(CONFIG, LAYER, dtype)
        assert (header.num_rows, header.head_dim) == (m.num_rows, m.head_dim)
        checksum = layout_checksum(
            header.format,
            m.num_rows,
            m.head_dim,
            header.row_bytes,
            LAYER,
            m.layer_multipliers.tolist(),
            m.ngram_heads_vocab_sizes.tolist(),
            m.ngram_heads_offsets.tolist(),
        )
        assert header.layout_checksum == checksum
    other = expected_header(CONFIG, 0, "nvfp4")
    assert other.layout_checksum != expected_header(CONFIG, LAYER, "nvfp4").layout_checksum


def test_released_model_geometry():
    """SPEC §2's R_pad and the row sizes of the released table (d = 160)."""
    config = SimpleNamespace(
        vocab_size=248320,
        ngram_size=3,
        heads_per_ngram=8,
        ple_embed_dim=2560,
        ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
    )
    sizes = {"bfloat16": 320, "float8_e4m3fn": 160, "nvfp4": 90}
    for fmt, row_bytes in sizes.items():
        header = expected_header(config, 0, fmt)
        assert (header.num_rows, header.head_dim, header.row_bytes) == (320_001_536, 160, row_bytes)
        assert header.file_bytes == 4096 + 320_001_536 * row_bytes


# --- header refusals --------------------------------------------------------------------------


def rewrite(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_read_header_refuses_a_file_that_is_not_a_table(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such table file") as error:
        read_header(tmp_path / "absent.bin")
    assert isinstance(error.value, TableFileError) and "absent.bin" in str(error.value)
    out, *_ = packed(tmp_path)
    rewrite(out, 0, b"NOTMAGIC")
    with pytest.raises(TableFileError, match=f"{out}: not a qwen4exp table file"):
        read_header(out)
    short = tmp_path / "short.bin"
    short.write_bytes(MAGIC + b"\0" * 100)
    with pytest.raises(TableFileError, match="truncated table file: 108 bytes"):
        read_header(short)


def test_read_header_refuses_a_corrupted_header(tmp_path):
    out, *_ = packed(tmp_path)
    good = out.read_bytes()[:HEADER_BYTES]
    length = struct.unpack_from("<I", good, 12)[0]
    text = good[48 : 48 + length]
    cases = {
        "version": (
            8,
            struct.pack("<I", 2),
            "table file version 2, this qwen4exp_ext reads version 1",
        ),
        "json": (48 + 5, b"X", r"corrupted table file header \(checksum mismatch\)"),
        "checksum": (16, b"\0" * 4, r"checksum mismatch"),
        "length": (12, struct.pack("<I", 5000), r"corrupted table file header \(JSON length"),
        "padding": (HEADER_BYTES - 1, b"\1", r"nonzero padding"),
    }
    for name, (offset, data, message) in cases.items():
        rewrite(out, 0, good)
        rewrite(out, offset, data)
        with pytest.raises(TableFileError, match=message) as error:
            read_header(out)
        assert str(out) in str(error.value), name
    # A header with a valid checksum whose fields disagree with each other.
    fields = json.loads(text)
    for change, message in [
        ({"row_bytes": 31}, "row_bytes 31 does not match format bfloat16 with head_dim 16"),
        ({"data_offset": 512}, "data_offset 512 is not 4096"),
        ({"format": "int8"}, "unknown format 'int8'"),
        ({"scale": 1.5}, "a bfloat16 table has no scale"),
        ({"num_rows": -1}, "num_rows must be a non-negative integer"),
    ]:
        text = json.dumps({**fields, **change}, sort_keys=True).encode()
        region = MAGIC + struct.pack("<II", 1, len(text)) + hashlib.sha256(text).digest() + text
        rewrite(out, 0, region.ljust(HEADER_BYTES, b"\0"))
        with pytest.raises(TableFileError, match="inconsistent table file header: " + message):
            read_header(out)


def test_read_header_refuses_a_truncated_or_extended_file(tmp_path):
    out, *_ = packed(tmp_path)
    size = out.stat().st_size
    os.truncate(out, size - 1)
    with pytest.raises(TableFileError, match=f"truncated table file: {size - 1} bytes.*{size}"):
        read_header(out)
    os.truncate(out, size + 4096)
    with pytest.raises(TableFileError, match=f"extended table file: {size + 4096} bytes.*{size}"):
        read_header(out)


def test_check_header_names_the_first_mismatch(tmp_path):
    out, *_ = packed(tmp_path)
    header = read_header(out)
    check_header(header, expected_header(CONFIG, LAYER, torch.bfloat16), out)  # scale ignored
    wider = SimpleNamespace(**{**CONFIG.__dict__, "ple_embed_dim": 128})
    more_rows = SimpleNamespace(**{**CONFIG.__dict__, "make_ngram_vocab_size_divisible_by": 256})
    other_seed = SimpleNamespace(**{**CONFIG.__dict__, "seed": 8})
    cases = [
        (expected_header(CONFIG, 0, torch.bfloat16), "PLE layer 1's, expected layer 0's"),
        (expected_header(CONFIG, LAYER, torch.float16), "format .dtype. is bfloat16, expected"),
        (expected_header(CONFIG, LAYER, "nvfp4"), "format .dtype. is bfloat16, expected nvfp4"),
        (expected_header(wider, LAYER, torch.bfloat16), "16 wide .head_dim., expected 32"),
        (expected_header(more_rows, LAYER, torch.bfloat16), "has 320 rows, expected 512"),
        (expected_header(other_seed, LAYER, torch.bfloat16), "layout checksum differs"),
    ]
    for expected, message in cases:
        with pytest.raises(TableFileError, match=f"{out}: .*{message}"):
            check_header(header, expected, out)


def test_write_header_refuses_an_inconsistent_header(tmp_path):
    header = expected_header(CONFIG, LAYER, "float8_e4m3fn")  # no scale yet
    with open(tmp_path / "t.bin", "wb") as f, pytest.raises(ValueError, match="needs a float"):
        write_header(f, header)


# --- verify finds differences -----------------------------------------------------------------


def test_verify_names_the_first_differing_row(tmp_path):
    out, files, *_ = packed(tmp_path)
    header = read_header(out)
    rewrite(out, header.data_offset + 100 * header.row_bytes + 3, b"\x55")
    message = r"row 100 differs from the checkpoint's \(byte 3 of the row; shard 2, .*row 8\)"
    with pytest.raises(TableFileError, match=f"{out}: {message}"):
        verify_table(out, files, CONFIG, LAYER, PREFIX)


def test_verify_names_nvfp4_block_scales_and_a_changed_scale(tmp_path):
    out, files, table, scales = packed(tmp_path, "nvfp4")
    header = read_header(out)
    original = out.read_bytes()
    rewrite(out, header.data_offset + (ROWS - 1) * header.row_bytes + header.code_bytes, b"\x7f")
    message = rf"row {ROWS - 1} differs .*byte 8 of the row \(block scales\); shard 6, "
    with pytest.raises(TableFileError, match=message + r".*weight_scale row 43"):
        verify_table(out, files, CONFIG, LAYER, PREFIX)
    out.write_bytes(original)
    weights = checkpoint_weights("nvfp4", table, scales)
    weights["ngram_embedding.weight_scale_2"] = torch.tensor([0.5])
    files = save_checkpoint(tmp_path / "ckpt", weights)
    with pytest.raises(TableFileError, match=r"scale 0.37.* differs from the checkpoint's 0.5"):
        verify_table(out, files, CONFIG, LAYER, PREFIX)


def test_verify_refuses_another_layers_or_formats_checkpoint(tmp_path):
    out, files, *_ = packed(tmp_path)
    with pytest.raises(TableFileError, match="is not the config's layout of PLE layer 0"):
        verify_table(out, files, CONFIG, 0, PREFIX)
    other = save_checkpoint(
        tmp_path / "ckpt", checkpoint_weights("float16", *make_table("float16"))
    )
    with pytest.raises(TableFileError, match="format .dtype. is bfloat16, expected float16"):
        verify_table(out, other, CONFIG, LAYER, PREFIX)


# --- pack refusals ----------------------------------------------------------------------------


def bad_checkpoints():
    """(name, format, edit of the checkpoint weights, pack's dtype, message)."""

    def drop(name):
        return lambda w: w.pop(name)

    def put(name, value):
        return lambda w: w.__setitem__(name, value)

    shard = "ngram_embedding.shard_"
    return [
        ("missing shard", "bfloat16", drop(f"{shard}3.weight"), None, "missing rows: .*shard_3"),
        ("missing last", "bfloat16", drop(f"{shard}6.weight"), None, r"rows \[276, 320\)"),
        ("wrong shape", "bfloat16", put(f"{shard}6.weight", torch.zeros(46, D).bfloat16()),
         None, r"shape mismatch for shard 6 .*expected \(44, 16\), got \(46, 16\)"),
        ("wrong width", "bfloat16", put(f"{shard}0.weight", torch.zeros(46, 8).bfloat16()),
         None, "shape mismatch"),
        ("mixed dtypes", "bfloat16", put(f"{shard}2.weight", torch.zeros(46, D)),
         None, "dtype mismatch: a table has one dtype"),
        ("asked dtype", "bfloat16", lambda w: None, "float32", "asked for as float32 but"),
        ("asked fp8", "float8_e4m3fn", lambda w: None, "float8_e4m3fnuz", "dtype mismatch"),
        ("shard past parts", "bfloat16", put(f"{shard}7.weight", torch.zeros(1, D).bfloat16()),
         None, "shard index 7 exceeds split_ngram_parts=7"),
        ("fp8 without scale", "float8_e4m3fn", drop("ngram_embedding.weight_scale"), None,
         "scale ngram_embedding.weight_scale is not in the checkpoint"),
        ("scale of a float", "float16", put("ngram_embedding.weight_scale", torch.ones(1)),
         None, "given, but the table is float16"),
        ("global scales differ", "nvfp4", put(f"{shard}4.weight_scale_2", torch.tensor(0.5)),
         None, "NVFP4 global scales differ"),
        ("no global scale", "nvfp4", drop("ngram_embedding.weight_scale_2"), None,
         "global scale .* is not in the checkpoint"),
        ("missing block scales", "nvfp4", drop(f"{shard}5.weight_scale"), None,
         r"missing rows: .*shard_5.weight_scale"),
        ("block scales dtype", "nvfp4", put(f"{shard}1.weight_scale", torch.zeros(46, 1)),
         None, "dtype mismatch for the block scales of shard 1"),
        ("nvfp4 scale of float", "bfloat16",
         put(f"{shard}1.weight_scale", torch.zeros(46, 1).to(torch.float8_e4m3fn)),
         None, "holds NVFP4 scales, but the table is bfloat16"),
        ("unknown name", "bfloat16", put("ngram_embedding.bias", torch.zeros(1)), None,
         "unexpected PLE table tensor 'model.ple.ngram_embedding.bias'"),
        ("wrong buffer", "bfloat16", put("ngram_heads_offsets", torch.arange(4)), None,
         "ngram_heads_offsets .* is not the config's layout"),
        ("unsharded and shards", "bfloat16", put("ngram_embedding.weight", torch.zeros(1)),
         None, "both an unsharded"),
        ("int rows", "bfloat16", lambda w: [w.__setitem__(k, v.to(torch.int16)) for k, v in
         list(w.items()) if k.endswith(".weight")], None, "no PLE table format"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", bad_checkpoints(), ids=lambda case: case[0])
def test_pack_refuses_a_bad_checkpoint_and_leaves_no_file(tmp_path, case):
    _, fmt, edit, dtype, message = case
    table, block_scales = make_table(fmt)
    weights = checkpoint_weights(fmt, table, block_scales)
    edit(weights)
    files = save_checkpoint(tmp_path / "ckpt", weights)
    out = tmp_path / "out.bin"
    with pytest.raises(TableFileError, match=message) as error:
        pack_table(files, out, CONFIG, LAYER, dtype, PREFIX)
    assert "ckpt/model-0000" in str(error.value)  # names the checkpoint file
    assert_nothing_written(tmp_path, out)


def test_pack_refuses_a_tensor_given_twice_or_none(tmp_path):
    files, *_ = checkpoint(tmp_path)
    twice = tmp_path / "ckpt" / "again.safetensors"
    save_file({PREFIX + "ngram_embedding.shard_0.weight": torch.zeros(46, D)}, twice)
    out = tmp_path / "out.bin"
    with pytest.raises(TableFileError, match=r"again.safetensors: .*shard_0.weight is in the"):
        pack_table([*files, twice], out, CONFIG, LAYER, prefix=PREFIX)
    twice.unlink()
    with pytest.raises(TableFileError, match="no PLE table rows .* under prefix 'model.x.'"):
        pack_table(files, out, CONFIG, LAYER, prefix="model.x.")
    assert_nothing_written(tmp_path, out)


def test_pack_failing_midway_removes_its_temporary_file_and_keeps_the_old(tmp_path, monkeypatch):
    files, *_ = checkpoint(tmp_path)
    out = tmp_path / "out.bin"
    out.write_bytes(b"the previous table")
    real = table_pack._row_chunks

    def failing(plan):
        for i, chunk in enumerate(real(plan)):
            if i == 5:
                raise OSError("disk full")
            yield chunk

    monkeypatch.setattr(table_pack, "_row_chunks", failing)
    with pytest.raises(OSError, match="disk full"):
        pack_table(files, out, CONFIG, LAYER, prefix=PREFIX)
    assert out.read_bytes() == b"the previous table"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out.bin"]


# --- the command ------------------------------------------------------------------------------


def write_config(tmp_path, **changes):
    path = tmp_path / "config.json"
    text_config = {**CONFIG.__dict__, **changes}
    path.write_text(json.dumps({"architectures": ["Qwen4Exp"], "text_config": text_config}))
    return str(path)


def test_cli_pack_verify_info(tmp_path, capsys):
    files, *_ = checkpoint(tmp_path, "float8_e4m3fnuz")
    config = write_config(tmp_path)
    out = str(tmp_path / "t.bin")
    args = ["--config", config, "--layer", "1", "--prefix", PREFIX]
    assert main(["pack", *args, "-o", out, str(tmp_path / "ckpt")]) == 0
    assert "float8_e4m3fnuz, 320 rows x 16" in capsys.readouterr().out
    assert main(["verify", *args, out, *map(str, files)]) == 0
    assert ": OK, 320 rows" in capsys.readouterr().out
    assert main(["info", out]) == 0
    assert json.loads(capsys.readouterr().out)["scale"] == SCALE32
    rewrite(out, HEADER_BYTES, b"\xff")
    assert main(["verify", *args, out, *map(str, files)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"qwen4exp-table: error: {out}: row 0 differs")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert main(["pack", *args, "--dtype", "float64", "-o", out, *map(str, files)]) == 1
    assert "unsupported table dtype torch.float64" in capsys.readouterr().err
    bad_config = tmp_path / "bad.json"
    bad_config.write_text(json.dumps({"vocab_size": 97}))
    assert main(["verify", "--config", str(bad_config), "--layer", "1", out, str(files[0])]) == 1
    assert "bad.json: the config has no ngram_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["pack", "--layer", "1", "-o", out])
    assert usage.value.code == 2


def test_cli_as_a_module_in_a_subprocess(tmp_path):
    out, files, *_ = packed(tmp_path)
    config = write_config(tmp_path)
    command = [sys.executable, "-m", "qwen4exp_ext.tables.cli", "verify", "--config", config]
    command += ["--layer", "1", "--prefix", PREFIX, str(out), *map(str, files)]
    ok = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().endswith("rows (10240 bytes) equal the checkpoint's")
    os.truncate(out, out.stat().st_size - 2)
    bad = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr == (
        f"qwen4exp-table: error: {out}: truncated table file: {HEADER_BYTES + 10238} bytes, but "
        f"its header (320 rows of 32 bytes after 4096) needs {HEADER_BYTES + 10240}\n"
    )


def test_the_tables_package_imports_nothing_from_layers():
    """tables/ (host memory, the file format, its readers, the packer) is below layers/: the
    layers use the tables, never the reverse (issue #49 item 4; table_file once imported
    layers.ngram_embedding for its dtype check). Checked in a fresh interpreter, so no earlier
    import hides one."""
    modules = ["checkpoint", "cli", "file_format", "host_memory", "pack", "readers"]
    code = (
        "import sys\n"
        + "".join(f"import qwen4exp_ext.tables.{name}\n" for name in modules)
        + "print(sorted(m for m in sys.modules if m.startswith('qwen4exp_ext.layers')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_the_old_module_name_is_the_file_format_module():
    """README named ``qwen4exp_ext.table_file`` as the table file's module before ``tables/``
    (#49 item 4): it still imports, as tables.file_format itself, not a copy."""
    import qwen4exp_ext.table_file as by_path
    from qwen4exp_ext import table_file
    from qwen4exp_ext.tables import file_format

    assert by_path is file_format and table_file is file_format
    assert table_file.read_header is read_header
