"""The shim of vLLM 0.34.0's PLE ``disk_offload`` (``Qwen4ExpPLEDiskOffloadEmbedding``): each
step's rows read from the checkpoint files by :func:`qwen4exp_ext.ops.read_file_rows`.

vLLM's ``stage_rows`` sorts the step's distinct ids, advises the kernel of every run of pages
(``POSIX_FADV_WILLNEED``), then reads one row per ``os.preadv``, serially on the calling
thread, into a buffer of distinct rows, and copies them out by the inverse index. Ours hands
each file region of a plane to one ``read_file_rows`` call (rows read in file order, rows
sharing a block read once, the uncached reads advised to the kernel's readahead at once, many
reads in flight on the op's threads, with the GIL released). A region is the shards of one
file that lie on one row grid (consecutive shards, in any order: a safetensors file of one
plane's shards is one region however many shards it holds), so a checkpoint split into 512
shards is read in one call per file, not 512. With one region the rows go straight into vLLM's
pinned host buffer in token order (no sort, no second copy); with several, the ids are grouped
by region once, and the rows go back to token order in one ``index_copy_``.
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ... import ops


@dataclass(frozen=True)
class _Regions:
    """Where one plane's rows lie: shards whose rows are one row grid of one file (the same
    descriptor, data offsets equal modulo the row size: consecutive shards of a safetensors
    file, or shards with other whole rows' worth of bytes between them) form a region, read by
    one call with ids counted in rows from the region's first byte. Per shard: its region and
    the region row of its first row; per region: (fd, data offset, path)."""

    region_of: torch.Tensor  # int64 [shards]
    first_row: torch.Tensor  # int64 [shards]
    regions: tuple[tuple[int, int, str], ...]


# The attribute of vLLM's layer that caches its planes' regions (its files are bound once: vLLM
# refuses a reload).
_REGIONS_ATTR = "_qwen4exp_regions"


def _regions(layer: Any, name: str, row_bytes: int) -> _Regions:
    cache = layer.__dict__.setdefault(_REGIONS_ATTR, {})
    found = cache.get(name)
    if found is not None:
        return found
    fds, bases = (t.tolist() for t in layer._sources[name])
    paths = {fd: path for path, fd in layer._fds.items()}
    keys = [(fd, base % row_bytes) for fd, base in zip(fds, bases, strict=True)]
    lowest: dict[tuple[int, int], int] = {}
    for key, base in zip(keys, bases, strict=True):
        lowest[key] = min(base, lowest.get(key, base))
    index = {key: i for i, key in enumerate(lowest)}
    found = _Regions(
        torch.tensor([index[key] for key in keys], dtype=torch.int64),
        torch.tensor(
            [(base - lowest[key]) // row_bytes for key, base in zip(keys, bases, strict=True)],
            dtype=torch.int64,
        ),
        tuple((fd, offset, paths.get(fd, "")) for (fd, _), offset in lowest.items()),
    )
    cache[name] = found
    return found


def _read_region(region: tuple[int, int, str], ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[k]`` = region row ``ids[k]``; a short or failed read raises vLLM's ValueError,
    naming the file."""
    fd, offset, path = region
    try:
        ops.read_file_rows(fd, ids, out, data_offset=offset, row_bytes=out.shape[1], path=path)
    except RuntimeError as exc:
        raise ValueError(f"PLE shard file {path} could not be read: {exc}") from exc


def _stage_plane(layer: Any, name: str, ids: torch.Tensor, out: torch.Tensor, rows: Any) -> None:
    """One plane (``weight`` or NVFP4's ``weight_scale``) of the step's ids (in range) into
    ``out`` (uint8 ``[n, row_bytes]``, token-major: vLLM's pinned host buffer); ``rows`` is
    vLLM's scratch buffer of at least ``n`` rows, used only where the rows lie in several
    regions (:class:`_Regions`)."""
    where = _regions(layer, name, out.shape[1])
    shard = ids // layer._shard_size
    region_rows = where.first_row[shard] + (ids - shard * layer._shard_size)
    if len(where.regions) == 1:  # one call, in token order: no sort, no second copy
        _read_region(where.regions[0], region_rows, out)
        return
    # Grouped by region, each region's ids are one slice: one call per region into vLLM's
    # scratch rows, then back to token order.
    region = where.region_of[shard]
    order = torch.argsort(region, stable=True)
    counts = torch.bincount(region, minlength=len(where.regions)).tolist()
    ordered, scratch = region_rows[order], rows[: ids.numel()]
    lo = 0
    for spot, count in zip(where.regions, counts, strict=True):
        if count:
            _read_region(spot, ordered[lo : lo + count], scratch[lo : lo + count])
        lo += count
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
