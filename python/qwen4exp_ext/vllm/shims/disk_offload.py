"""The shim of vLLM 0.34.0's PLE ``disk_offload`` (``Qwen4ExpPLEDiskOffloadEmbedding``): each
step's rows read from the checkpoint files by :func:`qwen4exp_ext.ops.read_file_rows`.

vLLM's ``stage_rows`` sorts the step's distinct ids, then reads one row per ``os.preadv``,
serially on the calling thread, into a buffer of distinct rows, and copies them out by the
inverse index. Ours hands each shard file and plane to one ``read_file_rows`` call (rows read
in file order, rows sharing a block read once, many reads in flight on the op's threads, with
the GIL released), which writes every token's row straight into vLLM's pinned host buffer: with
one shard there is no sort and no second copy; with several, the ids are sorted once so that
each shard's ids are one slice, and the rows go back to token order in one ``index_copy_``.
The staged bytes are vLLM's, bit for bit (raw planes: FP8 bytes, NVFP4 packed bytes and block
scales, which vLLM's forward decodes as before).

vLLM opens the files buffered (``O_RDONLY``) at offsets that are safetensors data offsets, not
4096-aligned, so the reads go through the page cache, as vLLM's do. What vLLM checks is kept:
an id outside the table raises its ``IndexError`` before anything is read, and a file that ends
before a wanted row raises its ``ValueError`` naming the file. A layer bound to no file (vLLM's
``load_format="dummy"``) is left to vLLM (zero rows).

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from ... import ops


def _file_names(layer: Any) -> dict[int, str]:
    """fd -> path of the files vLLM opened for ``layer`` (its ``_fds`` is path -> fd)."""
    return {fd: path for path, fd in layer._fds.items()}


def _read_shard(
    layer: Any, fd: int, ids: torch.Tensor, out: torch.Tensor, base: int, path: str
) -> None:
    """One shard file's rows: ``out[k]`` = the row of shard-local id ``ids[k]``, read from
    ``fd`` at ``base`` (the shard's safetensors data offset). A short or failed read raises
    vLLM's ValueError, naming the file."""
    try:
        ops.read_file_rows(
            fd,
            ids,
            out,
            data_offset=base,
            row_bytes=out.shape[1],
            vocab_start=0,
            vocab_end=layer._shard_size,
            path=path,
        )
    except RuntimeError as exc:
        raise ValueError(f"PLE shard file {path} could not be read: {exc}") from exc


def _stage_plane(layer: Any, name: str, ids: torch.Tensor, out: torch.Tensor, rows: Any) -> None:
    """One plane (``weight`` or NVFP4's ``weight_scale``) of the step's ids into ``out`` (uint8
    ``[n, row_bytes]``, token-major, as vLLM's pinned host buffer); ``rows`` is vLLM's scratch
    buffer of at least ``n`` rows, used only with several shards."""
    fds, bases = layer._sources[name]
    names = _file_names(layer)
    if fds.numel() == 1:
        fd = int(fds[0])
        _read_shard(layer, fd, ids, out, int(bases[0]), names.get(fd, ""))
        return
    # Sorted, each shard's ids are one slice: one call per shard file, into vLLM's scratch rows,
    # then back to token order.
    ordered, order = torch.sort(ids)
    starts = torch.arange(fds.numel(), dtype=ordered.dtype) * layer._shard_size
    bounds = torch.searchsorted(ordered, starts).tolist() + [ordered.numel()]
    scratch = rows[: ordered.numel()]
    for shard, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if lo == hi:
            continue
        fd = int(fds[shard])
        local = ordered[lo:hi] - int(starts[shard])
        _read_shard(layer, fd, local, scratch[lo:hi], int(bases[shard]), names.get(fd, ""))
    out.index_copy_(0, order, scratch)


def _make_stage_rows(original: Callable[..., None]) -> Callable[..., None]:
    """``Qwen4ExpPLEDiskOffloadEmbedding.stage_rows(self, num_tokens)``: the rows of
    ``_host_ids[:num_tokens]`` read by our reader into vLLM's pinned host buffers, then copied
    to its staging buffers as vLLM does."""

    def stage_rows(self: Any, num_tokens: int) -> None:
        if not self._fds:  # nothing bound (load_format="dummy"): vLLM's zero rows
            original(self, num_tokens)
            return
        ids = self._host_ids[:num_tokens].flatten()
        if ids.numel():
            low, high = torch.aminmax(ids)
            if not 0 <= int(low) <= int(high) < self.org_vocab_size:
                raise IndexError(f"PLE id out of range for {self.org_vocab_size} rows")
        for name, (_, host, rows) in self._planes.items():
            out = host[:num_tokens].flatten(0, 1).view(torch.uint8)
            _stage_plane(self, name, ids, out, rows)
        for staging, host, _ in self._planes.values():
            staging[:num_tokens].copy_(host[:num_tokens], non_blocking=True)

    return stage_rows
