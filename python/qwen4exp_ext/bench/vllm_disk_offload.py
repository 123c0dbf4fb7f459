"""``vllm_disk_offload`` (issue #48 item 3): vLLM 0.34.0's PLE ``disk_offload`` staging, vLLM's own
read against ours, from the same safetensors checkpoint.

vLLM keeps a ``disk_offload`` PLE table in its checkpoint files and, every step, reads the rows
of the step's n-gram ids into pinned host buffers and copies them to fixed staging buffers
(``Qwen4ExpPLEDiskOffloadEmbedding.stage_rows``; ``docs/design/vllm-0.34-disk-offload.md``).
**One call** is one layer's ``stage_rows`` for T tokens x 16 heads (rows of 160 bf16, the
released shape), on vLLM's own layer object built over the checkpoint file as vLLM's loader
binds it (the file's mapping handed over, then vLLM's own descriptors):

- ``vllm_staging`` (headline, and vLLM's code): vLLM 0.34.0's ``stage_rows``: the sorted
  distinct ids, every run of pages advised (``POSIX_FADV_WILLNEED``), one ``os.preadv`` per row,
  serially, then the inverse-index copy.
- ``ours``: the same method as the plugin swaps it (``qwen4exp_ext.vllm.shims.disk_offload``):
  ``ops.read_file_rows`` per shard file, many reads in flight.
- ``oracle``: the file's rows by numpy fancy indexing of a fresh mapping of the file.

Each contender has its own layer (its own buffers and descriptors) and its own cursor over the
same id batches, so the check compares the same rows. Case names
``stage_<phase>_T<T>_bf16_<warm|cold>``: decode T = 64 and prefill T = 8192; ``warm``: every
page of the file in the page cache; ``cold``: the file's pages dropped before every call,
untimed (``Case.before_call``: ``posix_fadvise(DONTNEED)``; nothing maps the file between
calls), so each call reads from the disk. Calls are timed by the wall clock (host reads).
The table is split into CHECKPOINT_SHARDS checkpoint shards, as vLLM's loader hands them over.

The CPU is the report's ``cpu``; the disk holding the file is each case's ``params["disk"]``
and the section ``disk``. Needs vLLM 0.34.0 or later (its class) importable: elsewhere no case,
and the section says why. Not in the representative subset (``registry.FULL_ONLY_OPS``): it
imports vLLM and writes a TABLE_ROWS-row file (640 MB). The file goes in a fresh directory in
$QWEN4EXP_BENCH_TABLE_DIR (default /var/tmp, never tmpfs), unlinked once vLLM's layers hold it
open.
"""

from __future__ import annotations

import atexit
import itertools
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qwen4exp_ext import _switches
from qwen4exp_ext.bench.gather_rows import HEAD_DIM, NUM_HEADS
from qwen4exp_ext.bench.registry import Case, Section

TABLE_ROWS = 2_000_000  # 640 MB of bf16 rows: far beyond any CPU cache
CHECKPOINT_SHARDS = 512  # the released checkpoint's split_ngram_parts
DECODE_TOKENS = 64
PREFILL_TOKENS = 8192
ID_BATCHES = 4  # id batches each contender cycles through
# The same variable as staged_lookup's table files: where the bench may write GBs.
TABLE_DIR_ENV = "QWEN4EXP_BENCH_TABLE_DIR"
SEED = 48
DTYPE = torch.bfloat16
KEY = "ngram_embedding.shard_{}.weight"
VLLM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
VLLM_CLASS = "Qwen4ExpPLEDiskOffloadEmbedding"


def _vllm_class() -> tuple[type | None, str | None]:
    """vLLM's disk-offload class, or None and why it cannot be had here."""
    try:
        import importlib

        module = importlib.import_module(VLLM_MODULE)
    except Exception as exc:  # noqa: BLE001 - any import failure: no case, said why
        return None, f"vLLM is not importable here ({type(exc).__name__}: {exc})"
    cls = getattr(module, VLLM_CLASS, None)
    if cls is None:
        from importlib.metadata import version

        return None, f"vLLM {version('vllm')} has no {VLLM_CLASS} (disk_offload is 0.34.0 on)"
    return cls, None


def disk_of(path: str) -> str:
    """The block device holding ``path`` (its name, model and whether it spins), from sysfs;
    a plain description where there is none (tmpfs, overlay)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    link = f"/sys/dev/block/{major}:{minor}"
    if not os.path.exists(link):
        return f"no block device (device {major}:{minor}: tmpfs, overlay or network)"
    block = os.path.realpath(link)
    if os.path.exists(os.path.join(block, "partition")):
        block = os.path.dirname(block)

    def read(name: str) -> str | None:
        try:
            with open(os.path.join(block, name)) as f:
                return f.read().strip() or None
        except OSError:
            return None

    model = read("device/model") or "unknown model"
    kind = {"0": "SSD", "1": "rotational"}.get(read("queue/rotational") or "", "unknown kind")
    return f"{os.path.basename(block)} ({model}, {kind})"


def _rows_of_shard(index: int, shard_rows: int, rows: int | None = None) -> int:
    """Rows of checkpoint shard ``index`` (the last is shorter), as vLLM's loader expects."""
    rows = TABLE_ROWS if rows is None else rows
    return max(0, min(shard_rows, rows - index * shard_rows))


@dataclass
class _Checkpoint:
    """The checkpoint file (CHECKPOINT_SHARDS shards of the table), open, unlinked once read."""

    fd: int
    nbytes: int
    starts: list[int]  # each shard's data offset in the file
    shard_rows: int
    disk: str
    state: str = "cached"

    def drop(self) -> None:
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.state = "cold"

    def warm(self) -> None:
        if self.state != "warm":
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_WILLNEED)
            view = mmap.mmap(self.fd, self.nbytes, prot=mmap.PROT_READ)
            try:
                np.frombuffer(view, dtype=np.uint8)[::4096].sum()  # every page read once
            finally:
                view.close()
            self.state = "warm"

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The oracle: the rows of ``ids`` from a fresh mapping of the file (unmapped after)."""
        row_bytes = HEAD_DIM * 2
        flat = ids.flatten().numpy()
        shard, local = np.divmod(flat, self.shard_rows)
        picked = np.empty((flat.size, row_bytes), dtype=np.uint8)
        view = mmap.mmap(self.fd, self.nbytes, prot=mmap.PROT_READ)
        try:
            data = np.frombuffer(view, dtype=np.uint8)
            for i, start in enumerate(self.starts):
                mine = shard == i
                n = _rows_of_shard(i, self.shard_rows)
                table = data[start : start + n * row_bytes].reshape(-1, row_bytes)
                picked[mine] = table[local[mine]]
                del table
            del data
        finally:
            view.close()
        return torch.from_numpy(picked).view(DTYPE).view(*ids.shape, HEAD_DIM)


def _write_checkpoint(directory: str, rows: int) -> tuple[str, int, list[int], int]:
    """The table in a safetensors file, split as vLLM's loader splits it; returns its path, its
    size, each shard's data offset and rows per shard."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    shard_rows = -(-rows // CHECKPOINT_SHARDS)
    tensors = {}
    for i in range(CHECKPOINT_SHARDS):
        n = _rows_of_shard(i, shard_rows, rows)
        tensors[KEY.format(i)] = torch.randn(n, HEAD_DIM, generator=gen).to(DTYPE)
    path = os.path.join(directory, "ple.safetensors")
    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # no dirty page: a drop (posix_fadvise DONTNEED) leaves none cached
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    starts = [
        8 + header_len + header[KEY.format(i)]["data_offsets"][0] for i in range(CHECKPOINT_SHARDS)
    ]
    return path, os.path.getsize(path), starts, shard_rows


def _vllm_layer(cls: type, path: str, starts: list[int], shard_rows: int, device: torch.device):
    """vLLM's disk-offloaded layer over the file, bound as its loader binds it: views of the
    file's mapping handed to ``accept_checkpoint_shard``, then ``process_weights_after_loading``
    (vLLM finds the file in /proc/self/maps, opens it, drops the views)."""
    from vllm.models.qwen4_exp.common.ngram_embedding import (
        Qwen4ExpPLEUnquantizedEmbeddingMethod,
    )

    with _vllm_context(device), torch.device(device):
        layer = cls(
            TABLE_ROWS,
            HEAD_DIM,
            params_dtype=DTYPE,
            padding_size=1,
            prefix="bench.ple",
            embedding_method=Qwen4ExpPLEUnquantizedEmbeddingMethod(),
            num_ngram_heads=NUM_HEADS,
            max_total_tokens=max(DECODE_TOKENS, PREFILL_TOKENS),
        )
    row_bytes = HEAD_DIM * 2
    for i, start in enumerate(starts):
        n = _rows_of_shard(i, shard_rows)
        mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(n * row_bytes,))
        view = torch.from_numpy(np.asarray(mapped)).view(DTYPE).view(n, HEAD_DIM)
        layer.accept_checkpoint_shard(i, view, shard_rows, "weight")
    layer.embedding_method.process_weights_after_loading(layer)
    return layer


_CONFIG: list[Any] = []


def _vllm_context(device: torch.device) -> Any:
    """vLLM's config context for building its layers, with its (one-rank) groups initialised
    once per process."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if not _CONFIG:
        config = VllmConfig(device_config=DeviceConfig(device.type))
        with set_current_vllm_config(config):
            if not torch.distributed.is_initialized():
                store = tempfile.mkdtemp(prefix="qwen4exp-bench-vllm-")
                atexit.register(shutil.rmtree, store, ignore_errors=True)  # gloo's file store
                backend = "nccl" if device.type == "cuda" else "gloo"
                init_distributed_environment(1, 0, f"file://{store}/store", 0, backend)
            initialize_model_parallel(1, 1)
        _CONFIG.append(config)
    return set_current_vllm_config(_CONFIG[0])


def cases(device: torch.device) -> list[Case]:
    """Every case (module docstring); none where vLLM's class cannot be had (``sections``)."""
    cls, _ = _vllm_class()
    if cls is None:
        return []
    from qwen4exp_ext.vllm.shims.disk_offload import _make_stage_rows

    parent = _switches.env_directory(TABLE_DIR_ENV) or "/var/tmp"
    directory = tempfile.mkdtemp(prefix="qwen4exp-bench-disk-offload-", dir=parent)
    path, nbytes, starts, shard_rows = _write_checkpoint(directory, TABLE_ROWS)
    try:
        layers = {
            who: _vllm_layer(cls, path, starts, shard_rows, device)
            for who in ("ours", "vllm_staging")
        }
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        checkpoint = _Checkpoint(fd, nbytes, starts, shard_rows, disk_of(path))
    finally:
        # vLLM's layers hold the file open: unlinked, it goes with this process.
        os.unlink(path)
        os.rmdir(directory)
    stage = {"ours": _make_stage_rows(cls.stage_rows), "vllm_staging": cls.stage_rows}
    out = []
    for tokens, source in itertools.product((DECODE_TOKENS, PREFILL_TOKENS), ("warm", "cold")):
        out.append(_case(device, layers, stage, checkpoint, tokens, source))
    return out


def _case(
    device: torch.device,
    layers: dict[str, Any],
    stage: dict[str, Callable[..., None]],
    checkpoint: _Checkpoint,
    tokens: int,
    source: str,
) -> Case:
    phase = "prefill" if tokens == PREFILL_TOKENS else "decode"
    gen = torch.Generator().manual_seed(SEED + tokens)
    batches = torch.randint(0, TABLE_ROWS, (ID_BATCHES, tokens, NUM_HEADS), generator=gen)

    def contender(who: str) -> Callable[[], torch.Tensor]:
        layer, fn, cursor = layers.get(who), stage.get(who), itertools.cycle(batches)

        def call() -> torch.Tensor:
            ids = next(cursor)
            if layer is None:
                return checkpoint.rows(ids).to(device).flatten(-2)
            layer.copy_ids_to_host(ids)
            fn(layer, tokens)
            return layer.staged_rows(tokens)

        return call

    row_bytes = HEAD_DIM * 2
    return Case(
        op="vllm_disk_offload",
        name=f"stage_{phase}_T{tokens}_bf16_{source}",
        tokens=tokens,
        nbytes=2 * tokens * NUM_HEADS * row_bytes,  # each row read once and written once
        ours=contender("ours"),
        oracle=contender("oracle"),
        baselines={"vllm_staging": contender("vllm_staging")},
        params={
            "table_rows": TABLE_ROWS,
            "checkpoint_shards": CHECKPOINT_SHARDS,
            "heads": NUM_HEADS,
            "row_bytes": row_bytes,
            "source": source,
            "disk": checkpoint.disk,
        },
        vllm="vllm_staging",
        host_waits=True,
        before_call=checkpoint.drop if source == "cold" else checkpoint.warm,
    )


def sections(device: torch.device) -> list[Section]:
    """Where the file was read from (the disk), or why no case ran."""
    del device
    cls, why = _vllm_class()
    if cls is None:
        return [
            Section(
                "vllm_disk_offload",
                "skipped",
                "no case: vLLM's disk_offload class cannot be had here",
                [("reason", "reason")],
                [{"reason": why}],
            )
        ]
    parent = _switches.env_directory(TABLE_DIR_ENV) or "/var/tmp"
    return [
        Section(
            "vllm_disk_offload",
            "disk",
            "the disk the checkpoint file was read from (cold cases)",
            [("directory", "directory"), ("disk", "disk")],
            [{"directory": parent, "disk": disk_of(parent)}],
        )
    ]
