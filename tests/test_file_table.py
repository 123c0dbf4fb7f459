"""PLE tables served from a table file (``NGramEmbedding(placement="file")``,
python/qwen4exp_ext/tables/readers.py): both readers equal the same table in RAM bit for bit
(every format, vocabulary shards, odd and empty batches, alone and through the staged
pipeline); a missing, foreign or truncated file, or a short read in the middle of a step, is a
clear error naming the file, with no partial rows handed out; no descriptor or mapping
outlives the table. Real files and real O_DIRECT reads throughout."""

from __future__ import annotations

import errno
import gc
import itertools
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from leak_support import nothing_left_behind
from lookup_support import (
    BATCHES,
    CONFIG,
    FORMATS,
    NVFP4_CONFIG,
    make_batch,
    make_embedding,
    same_bits,
)
from qwen4exp_ext.layers import NGramEmbedding, StagedLookupPipeline
from qwen4exp_ext.tables.file_format import (
    TableFileError,
    TableFileHeader,
    read_header,
    write_header,
)
from qwen4exp_ext.tables.pack import pack_table
from qwen4exp_ext.tables.readers import FileTable

READERS = ("mmap", "direct")


def _config(table_format):
    return NVFP4_CONFIG if table_format == "nvfp4" else CONFIG


def _in_ram_and_file(tmp_path, table_format, reader, *, layer_index=1, seed=0, shard=None):
    """(the table in RAM, the same table read from its file with ``reader``)."""
    ram = make_embedding(table_format, "cpu", layer_index=layer_index, seed=seed)
    path = tmp_path / f"layer{layer_index}_{table_format}.table"
    ram.save_table_file(path)
    if shard is not None:
        sharded = make_embedding(table_format, "cpu", layer_index=layer_index, shard=shard)
        sharded.load_state_dict(_shard_state(ram, sharded))
        ram = sharded
    on_file = NGramEmbedding(
        _config(table_format),
        layer_index,
        placement="file",
        table_path=path,
        table_reader=reader,
        dtype=table_format,
        shard=shard,
        max_tokens=32,
    )
    return ram, on_file


def _shard_state(whole: NGramEmbedding, shard: NGramEmbedding) -> dict:
    """``whole``'s state with the row parameters cut to ``shard``'s rows."""
    state = dict(whole.state_dict())
    for name in shard.row_parameters:
        state[name] = state[name][shard.vocab_start : shard.vocab_end]
    return state


def _held(path) -> tuple[int, int]:
    """(mappings of ``path`` in this process, descriptors open on it)."""
    path = str(path)
    with open("/proc/self/maps") as maps:
        mapped = sum(line.rstrip().endswith(path) for line in maps)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:
            pass
    return mapped, fds


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("table_format", FORMATS)
def test_file_tables_equal_the_table_in_ram(tmp_path, table_format, reader):
    ram, on_file = _in_ram_and_file(tmp_path, table_format, reader)
    for lengths in BATCHES.values():
        batch = make_batch(lengths, "cpu", seed=len(lengths))
        same_bits(on_file(*batch), ram(*batch))
    # lookup of given ids, with ids no row has (-1, past the end) reading zero rows
    ids = torch.tensor([[0, 3, -1, ram.num_rows - 1], [ram.num_rows, 5, 5, 2]])
    same_bits(on_file.lookup(ids), ram.lookup(ids))
    # the prefetch buffers of max_tokens work the same
    batch = make_batch([5, 0, 13, 1], "cpu")
    on_file.start_prefetch(*batch)
    same_bits(on_file.finalize_prefetch(), ram(*batch))


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("table_format", ["bfloat16", "float8_e4m3fn", "nvfp4"])
def test_vocabulary_shards_read_their_own_rows(
    one_process_group,
    tmp_path,
    table_format,
    reader,
):
    for rank in range(3):
        ram, on_file = _in_ram_and_file(tmp_path, table_format, reader, shard=(rank, 3))
        for lengths in ([5, 0, 13, 1], [1]):
            batch = make_batch(lengths, "cpu", seed=rank)
            same_bits(on_file(*batch), ram(*batch))


@pytest.mark.parametrize("decode", ["host", "device"])
@pytest.mark.parametrize("reader", READERS)
def test_the_staged_pipeline_reads_file_tables(tmp_path, reader, decode):
    """Two file tables of different formats behind one pipeline, several steps, the NVFP4 rows
    decoded by the CPU gather or staged raw for the device's."""
    pairs = [
        _in_ram_and_file(tmp_path, "bfloat16", reader, layer_index=0, seed=1),
        _in_ram_and_file(tmp_path, "nvfp4", reader, layer_index=2, seed=2),
    ]
    with StagedLookupPipeline([f for _, f in pairs], max_tokens=32, decode=decode) as pipeline:
        for seed, lengths in enumerate(([5, 0, 13, 1], [], [32], [2, 7])):
            batch = make_batch(lengths, "cpu", seed=seed)
            with pipeline.submit(*batch) as step:
                for index, (ram, _) in enumerate(pairs):
                    same_bits(step.rows(index), ram(*batch))


def test_a_packed_checkpoint_reads_as_the_loaded_one(tmp_path):
    """qwen4exp-table pack's file, read with either reader, equals the same checkpoint loaded
    into RAM with load_safetensors (NVFP4: codes, block scales and the global scale)."""
    ram = make_embedding("nvfp4", "cpu", layer_index=1, seed=3)
    shard_rows = -(-ram.num_rows // CONFIG.split_ngram_parts)
    tensors = {"ngram_embedding.weight_scale_2": ram.weight_scale_2.clone()}
    for i, start in enumerate(range(0, ram.num_rows, shard_rows)):
        stop = min(start + shard_rows, ram.num_rows)
        tensors[f"ngram_embedding.shard_{i}.weight"] = ram.weight[start:stop].clone()
        tensors[f"ngram_embedding.shard_{i}.weight_scale"] = ram.weight_scale[start:stop].clone()
    checkpoint = tmp_path / "model.safetensors"
    save_file(tensors, str(checkpoint))
    loaded = make_embedding("nvfp4", "cpu", layer_index=1, seed=9)
    loaded.load_safetensors([checkpoint])
    table = tmp_path / "layer1.table"
    pack_table([checkpoint], table, NVFP4_CONFIG, 1)
    batch = make_batch([5, 0, 13, 1], "cpu")
    for reader in READERS:
        on_file = NGramEmbedding(
            NVFP4_CONFIG, 1, placement="file", table_path=table, table_reader=reader, dtype="nvfp4"
        )
        same_bits(on_file(*batch), loaded(*batch))


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", READERS)
def test_a_missing_or_foreign_file_is_refused_naming_it(tmp_path, reader):
    ram = make_embedding("bfloat16", "cpu", layer_index=1)
    path = tmp_path / "layer1.table"
    ram.save_table_file(path)

    def open_as(config=CONFIG, layer_index=1, dtype="bfloat16", table=path):
        return NGramEmbedding(
            config,
            layer_index,
            placement="file",
            table_path=table,
            table_reader=reader,
            dtype=dtype,
        )

    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere.table")):
        open_as(table=tmp_path / "nowhere.table")
    with pytest.raises(TableFileError, match=f"{path}.*layer 1's, expected layer 0's"):
        open_as(layer_index=0)
    with pytest.raises(TableFileError, match=f"{path}.*bfloat16.*float8_e4m3fn"):
        open_as(dtype="float8_e4m3fn")
    wider = SimpleNamespace(**{**vars(CONFIG), "ple_embed_dim": 32})
    with pytest.raises(TableFileError, match=str(path)):
        open_as(config=wider)
    not_a_table = tmp_path / "weights.bin"
    not_a_table.write_bytes(b"\0" * 8192)
    with pytest.raises(TableFileError, match=f"{not_a_table}.*not a qwen4exp table file"):
        open_as(table=not_a_table)
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(TableFileError, match=str(path)):
        open_as()


@pytest.mark.parametrize("decode", ["host", "device"])
@pytest.mark.parametrize("reader", READERS)
def test_a_file_truncated_under_the_table_fails_the_step_not_the_process(tmp_path, reader, decode):
    """Truncated after it was opened: the lookup raises naming the file (mmap: before touching
    a page past the end, which would be SIGBUS; direct: the short read), the output buffer
    keeps its previous rows, and through the staged pipeline the step fails while the previous
    step's rows stay intact."""
    ram, on_file = _in_ram_and_file(tmp_path, "float8_e4m3fn", reader)
    path = on_file.file_table.path
    batch = make_batch([5, 0, 13, 1], "cpu", seed=1)
    output = torch.full((19, on_file.embedding_dim), 7.0, dtype=torch.bfloat16)
    with StagedLookupPipeline([on_file], max_tokens=32, decode=decode) as pipeline:
        before = pipeline.submit(*batch)
        kept = before.rows(0).clone()
        same_bits(kept, ram(*batch))
        os.truncate(path, 4096 + 64 * on_file.file_table.header.row_bytes)
        failed = pipeline.submit(*make_batch([13, 5, 1], "cpu", seed=2))
        with pytest.raises(RuntimeError, match=f"lookup of layer 0 failed.*{path}"):
            failed.rows(0)
        same_bits(before.rows(0), kept)
        before.release()
        failed.release()
    with pytest.raises((OSError, RuntimeError), match=str(path)):
        on_file._lookup_local(*batch, output=output)
    assert bool((output == 7.0).all())


@pytest.mark.parametrize("reader", READERS)
def test_nothing_is_left_open_after_the_table_is_freed(tmp_path, reader):
    ram, on_file = _in_ram_and_file(tmp_path, "nvfp4", reader)
    path = on_file.file_table.path
    batch = make_batch([5, 0, 13, 1], "cpu")
    same_bits(on_file(*batch), ram(*batch))
    mapped, fds = _held(path)
    assert fds == 1 + (reader == "mmap")  # mmap: the mapping's own descriptor and ours
    assert mapped == (reader == "mmap")
    del on_file
    gc.collect()
    assert _held(path) == (0, 0)
    # close_table() releases them too, and the module refuses to run after it
    _, on_file = _in_ram_and_file(tmp_path, "nvfp4", reader)
    on_file.close_table()
    assert _held(path) == (0, 0)
    with pytest.raises(RuntimeError, match=f"{path}: the table file was closed"):
        on_file(*batch)


def test_file_tables_refuse_misuse(tmp_path):
    ram, on_file = _in_ram_and_file(tmp_path, "float8_e4m3fn", "mmap")
    path = on_file.file_table.path
    # no table parameter: rows come from the file; the scale from its header
    assert "weight" not in on_file.state_dict()
    assert on_file.weight_scale.item() == ram.weight_scale.item()
    with pytest.raises(ValueError, match=f"rows of a file table come from its file \\({path}\\)"):
        on_file.load_weights([("ngram_embedding.weight", ram.weight)])
    with pytest.raises(ValueError, match="come from its file"):
        on_file.load_weights([("ngram_embedding.shard_0.weight", ram.weight[:3])])
    with pytest.raises(ValueError, match="table is already a file"):
        on_file.save_table_file(tmp_path / "again.table")
    with pytest.raises(ValueError, match="placement='file' needs table_path"):
        NGramEmbedding(CONFIG, 1, placement="file")
    with pytest.raises(ValueError, match="table_path is only for placement='file'"):
        NGramEmbedding(CONFIG, 1, placement="cpu", table_path=path)
    with pytest.raises(ValueError, match="table_reader must be one of"):
        NGramEmbedding(CONFIG, 1, placement="file", table_path=path, table_reader="aio")
    with pytest.raises(ValueError, match="reads the table with the CPU.*StagedLookupPipeline"):
        NGramEmbedding(CONFIG, 1, placement="file", table_path=path, device="cuda")
    with pytest.raises(ValueError, match="a table file holds every row"):
        make_embedding("bfloat16", "cpu", shard=(0, 2)).save_table_file(tmp_path / "shard.table")


def test_save_table_file_leaves_nothing_when_it_fails(tmp_path, monkeypatch):
    ram = make_embedding("bfloat16", "cpu")
    target = tmp_path / "layer1.table"
    target.write_bytes(b"old")
    calls = []
    numpy = torch.Tensor.numpy

    def failing_numpy(self, *args, **kwargs):  # the third chunk of rows fails
        calls.append(1)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        return numpy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", failing_numpy)
    with pytest.raises(OSError, match="No space left"):
        ram.save_table_file(target, chunk_rows=16)
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer1.table"]


def test_prefault_maps_every_page_of_an_mmap_table(tmp_path):
    ram, on_file = _in_ram_and_file(tmp_path, "bfloat16", "mmap")
    on_file.file_table.prefault()
    batch = make_batch([5, 0, 13, 1], "cpu")
    same_bits(on_file(*batch), ram(*batch))
    _, direct = _in_ram_and_file(tmp_path, "bfloat16", "direct")
    with pytest.raises(RuntimeError, match="prefault needs the 'mmap' reader"):
        direct.file_table.prefault()


# --- the descriptor, the file and what it is checked against (issue #47) -------------------------


def _table_of(path, num_rows, fill: int, checksum: str = "0" * 64, head_dim=1024):
    """A float32 table file of ``num_rows`` rows of ``head_dim`` elements (one 4 KiB block a
    row at 1024), row i holding ``fill`` + i in every element; any layout checksum."""
    header = TableFileHeader("float32", 0, num_rows, head_dim, head_dim * 4, 4096, None, checksum)
    with open(path, "wb") as f:
        write_header(f, header)
        rows = torch.arange(fill, fill + num_rows, dtype=torch.int32)
        f.write(rows.repeat_interleave(head_dim).numpy().tobytes())
    return header


def _in_thread(call, timeout):
    """Runs ``call`` in a thread and waits at most ``timeout`` seconds: (thread, result box)."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as error:  # handed to the test
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, box


def test_a_close_during_a_direct_read_never_lets_another_file_be_read(tmp_path):
    """close() while read_rows is in flight (8192 separate O_DIRECT reads on one I/O thread,
    about a second): the descriptor must not be closed under the reader, or the next open gets
    its number and the rest of the rows come from that other file."""
    path, other = tmp_path / "table.bin", tmp_path / "other.bin"
    rows = 16384
    _table_of(path, rows, fill=0)
    _table_of(other, rows, fill=1 << 20)  # another file of the same size, other bytes
    table = FileTable(path, None, "direct", io_threads=1)
    ids = torch.arange(0, rows, 2)  # every other block: no two reads merge
    output = torch.zeros(ids.numel(), 4096, dtype=torch.uint8)
    box: dict = {}

    def read():
        try:
            table.read_rows(ids, output, 0, rows)
        except BaseException as error:
            box["error"] = error

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.15)
    assert reader.is_alive(), "the read ended before close(): it must be slower for this test"
    closer, closed = _in_thread(table.close, 60)
    assert not closer.is_alive() and "error" not in closed
    reused = os.open(other, os.O_RDONLY)  # the lowest free number: the closed one's, if free
    try:
        reader.join(60)
        assert not reader.is_alive()
        assert "error" not in box, box.get("error")
        got = output.view(torch.int32)[:, ::1024].reshape(-1)
        assert torch.equal(got, ids.to(torch.int32)), "rows read from another file"
    finally:
        os.close(reused)
    with pytest.raises(RuntimeError, match=f"{path}: the table file was closed"):
        table.read_rows(ids[:4], output[:4], 0, rows)


@pytest.mark.parametrize("reader", READERS)
def test_a_file_replaced_while_it_is_opened_is_read_whole_or_not_at_all(tmp_path, reader):
    """The header and the rows must come from one file: another thread keeps replacing the path
    with one of two tables of the same size (layout checksums a..., b...; rows 0xA..., 0xB...),
    and every FileTable opened meanwhile must read the rows of the file its header is from."""
    path = tmp_path / "table.bin"
    sources = {"a": tmp_path / "a.src", "b": tmp_path / "b.src"}
    fills = {"a": 0xA0000, "b": 0xB0000}
    for name, source in sources.items():
        _table_of(source, 4, fills[name], checksum=name * 64)
    os.link(sources["a"], path)
    stop = threading.Event()

    def swap():
        for i in itertools.count():
            if stop.is_set():
                return
            fresh = tmp_path / "fresh.tmp"
            os.link(sources["ba"[i % 2]], fresh)  # never the file at path: a no-op
            os.replace(fresh, path)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    mismatches, deadline = [], time.monotonic() + 4
    try:
        while time.monotonic() < deadline and not mismatches:
            try:
                table = FileTable(path, None, reader)
            except OSError:  # the mmap reader refusing a file whose size changed: allowed
                continue
            if reader == "mmap":
                first = int(table.rows[0, :4].view(torch.int32))
            else:
                output = torch.empty(1, 4096, dtype=torch.uint8)
                table.read_rows(torch.zeros(1, dtype=torch.int64), output, 0, 4)
                first = int(output[0, :4].view(torch.int32))
            table.close()
            if first != fills[table.header.layout_checksum[0]]:
                mismatches.append((table.header.layout_checksum[0], hex(first)))
    finally:
        stop.set()
        swapper.join(10)
    assert not swapper.is_alive()
    assert not mismatches, f"header of one file, rows of the other: {mismatches}"


def test_load_weights_keeps_the_scale_and_hash_layout_the_file_was_checked_against(tmp_path):
    ram, on_file = _in_ram_and_file(tmp_path, "float8_e4m3fn", "direct")
    path = on_file.file_table.path
    batch = make_batch([5, 0, 13, 1], "cpu")
    header_scale = on_file.weight_scale.clone()
    multipliers = on_file.layer_multipliers.clone()
    with nothing_left_behind(tmp_path):
        with pytest.raises(ValueError, match=f"weight_scale .*differs from the table file's "
                           f"\\({path}\\)"):  # fmt: skip
            on_file.load_weights([("ngram_embedding.weight_scale", torch.tensor([0.5]))])
        with pytest.raises(ValueError, match=f"layer_multipliers .*differs from the table "
                           f"file's \\({path}\\)"):  # fmt: skip
            on_file.load_weights([("layer_multipliers", multipliers + 2)])
    assert torch.equal(on_file.weight_scale, header_scale)
    assert torch.equal(on_file.layer_multipliers, multipliers)
    # the file's own values (a checkpoint's, loaded beside the file) are accepted
    loaded = on_file.load_weights(
        [("ngram_embedding.weight_scale", header_scale), ("layer_multipliers", multipliers)]
    )
    assert loaded == {"ngram_embedding.weight_scale", "layer_multipliers"}
    same_bits(on_file(*batch), ram(*batch))


def test_load_state_dict_keeps_the_scale_and_hash_layout_the_file_was_checked_against(tmp_path):
    ram, on_file = _in_ram_and_file(tmp_path, "float8_e4m3fn", "mmap")
    batch = make_batch([5, 0, 13, 1], "cpu")
    state = on_file.state_dict()
    for name, changed in (
        ("weight_scale", torch.tensor([0.5])),
        ("layer_multipliers", state["layer_multipliers"] + 2),
        ("ngram_heads_offsets", state["ngram_heads_offsets"] + 1),
    ):
        with pytest.raises(ValueError, match=f"{name} .*differs from the table file's"):
            on_file.load_state_dict({**state, name: changed})
    assert all(torch.equal(on_file.state_dict()[k], v) for k, v in state.items())
    on_file.load_state_dict(state)  # the file's own values are accepted
    same_bits(on_file(*batch), ram(*batch))


def test_save_table_file_never_writes_through_a_planted_temporary_name(tmp_path):
    """A link planted where a predictable temporary name would be must not be written through
    (the victim file keeps its bytes) and the table still appears whole."""
    ram = make_embedding("bfloat16", "cpu")
    target = tmp_path / "layer1.table"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / f".{target.name}.{os.getpid()}.partial"
    planted.symlink_to(victim)
    ram.save_table_file(target)
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink()
    assert read_header(target).num_rows == ram.num_rows
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [target.name, victim.name, planted.name]
    )


PREFAULT_TRUNCATED = """
import mmap, os, sys, warnings
import torch
from qwen4exp_ext.tables.readers import prefault_range
fd = os.open(sys.argv[1], os.O_RDWR)
os.ftruncate(fd, 4 * mmap.PAGESIZE)
mapping = mmap.mmap(fd, 4 * mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
os.ftruncate(fd, mmap.PAGESIZE)  # three of the four mapped pages are past the end now
try:
    prefault_range(address, 4 * mmap.PAGESIZE)
except OSError as error:
    print("errno", error.errno)
"""


def test_prefault_of_a_file_truncated_under_its_mapping_raises_not_sigbus(tmp_path):
    """MADV_POPULATE_READ says EFAULT where a page is past the file's end; only EINVAL (a
    kernel without it) may fall back to touching the pages, which would be a SIGBUS here."""
    path = tmp_path / "t.bin"
    path.write_bytes(b"")
    done = subprocess.run(
        [sys.executable, "-c", PREFAULT_TRUNCATED, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"killed by signal {-done.returncode}: {done.stderr}"
    assert done.stdout.strip() == f"errno {errno.EFAULT}"
