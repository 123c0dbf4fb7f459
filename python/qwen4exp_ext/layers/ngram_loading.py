"""Loading an :class:`~.ngram_embedding.NGramEmbedding` from a checkpoint (SPEC §4
"Checkpoints"): ``load_weights`` (tensors) and ``load_safetensors`` (files, read as memory-mapped
slices of this rank's rows), with every tensor checked from its metadata (``_plan``) before
anything is written, and a table left half-written by a failed load refused until a load
succeeds.

:class:`CheckpointLoading` is a mixin of ``NGramEmbedding`` (its only user), kept apart because
the checks are as long as the rest of the module: it reads the module's geometry (``num_rows``,
``split_ngram_parts``, ``vocab_start``/``vocab_end``, ``nvfp4``, ``table_dtype``,
``file_table``), writes ``weight``, ``weight_scale``, ``weight_scale_2`` and the hash buffers,
and calls ``_check_file_values`` and ``_refresh_head_divmod``. The checkpoint's names are
:mod:`qwen4exp_ext.tables.checkpoint`'s, shared with the table-file packer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qwen4exp_ext.reference import FP8_DTYPES
from qwen4exp_ext.tables.checkpoint import (
    BUFFER_NAMES,
    GLOBAL_SCALE_NAME,
    SCALE_NAME,
    SHARD_PREFIX,
    WEIGHT_NAME,
    checkpoint_shard_rows,
    safetensors_dtype,
    shard_name,
)

__all__ = ["CheckpointLoading"]


class CheckpointLoading:
    """``NGramEmbedding``'s checkpoint loading (see the module's docstring)."""

    def _checkpoint_shard_rows(self, shard_index: int) -> tuple[int, int]:
        """(first global row, row count) of checkpoint shard ``shard_index``."""
        return checkpoint_shard_rows(self.num_rows, self.split_ngram_parts, shard_index)

    @staticmethod
    def _shard_name(name: str) -> tuple[int, str] | None:
        """(index, leaf) of ``ngram_embedding.shard_<index>.<leaf>``, leaf in SHARD_LEAVES."""
        return shard_name(name)

    def _owned_rows(self, global_start: int, count: int) -> tuple[int, int]:
        """The global rows [lo, hi) of checkpoint rows [global_start, global_start + count) that
        this rank owns (lo >= hi: none)."""
        return max(global_start, self.vocab_start), min(global_start + count, self.vocab_end)

    def _copy_rows(self, global_start: int, rows: torch.Tensor, target: str = "weight") -> None:
        """Copies checkpoint rows [global_start, global_start + len) that this rank owns into
        ``target`` (``weight``, or the NVFP4 block scales ``weight_scale``), rows already checked
        by :meth:`_plan`."""
        lo, hi = self._owned_rows(global_start, rows.shape[0])
        if lo >= hi:
            return
        with torch.no_grad():
            getattr(self, target)[lo - self.vocab_start : hi - self.vocab_start].copy_(
                rows[lo - global_start : hi - global_start]
            )

    def _check_shard(self, name: str, shard_index: int, shape: Sequence[int], width: int) -> int:
        start, expected_rows = self._checkpoint_shard_rows(shard_index)
        expected = (expected_rows, width)
        if tuple(shape) != expected:
            raise ValueError(
                f"Shape mismatch for PLE embedding shard {shard_index} ({name}): expected "
                f"{expected}, got {tuple(shape)}"
            )
        return start

    def _check_rows(self, name: str, dtype: torch.dtype) -> None:
        if self.nvfp4:
            if dtype != torch.uint8:
                raise ValueError(
                    f"NVFP4 PLE rows {name} must be torch.uint8 (two E2M1 codes a byte), got "
                    f"{dtype}: a cast would reinterpret the packed codes"
                )
            return
        if not dtype.is_floating_point:
            raise ValueError(f"PLE embedding rows {name} must be floating point, got {dtype}")
        if self.table_dtype in FP8_DTYPES and dtype != self.table_dtype:
            raise ValueError(
                f"PLE embedding rows {name} are {dtype} but the table is {self.table_dtype}; "
                "an fp8 table loads fp8 rows of the same format (with their weight_scale)"
            )
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, self.table_dtype):
            raise ValueError(
                f"PLE embedding rows {name} are {dtype} but the table is {self.table_dtype}"
            )

    def _unsharded_nvfp4(self, name: str) -> ValueError:
        # vLLM's loader raises the same: NVFP4 checkpoints always come split in shards.
        return ValueError(
            f"NVFP4 PLE tables must be stored as {SHARD_PREFIX}<i>.weight and "
            f"{SHARD_PREFIX}<i>.weight_scale shards, got unsharded {name}"
        )

    def _check_global_scale(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        if not self.nvfp4:
            raise ValueError(
                f"{name} (an NVFP4 global scale) given, but the table is {self.table_dtype}"
            )
        if math.prod(shape) != 1 or not dtype.is_floating_point:
            raise ValueError(f"{name} must be one float element, got {dtype} {tuple(shape)}")

    def _plan(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device):
        """Checks one checkpoint tensor from its metadata alone and says what loading it does:
        ("skip",), ("buffer",), ("scale",) (the fp8 scale), ("global_scale",) (NVFP4) or
        ("rows", first global row, "weight" | "weight_scale") (table rows, NVFP4 block-scale
        rows). Raises on a mismatch, before anything is written."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("hashstats_") or leaf == "token_lookup":
            return ("skip",)
        if device.type == "meta":
            raise ValueError(f"checkpoint tensor {name!r} has no data (it is on the meta device)")
        shape = tuple(shape)
        if name in BUFFER_NAMES:
            expected = tuple(getattr(self, name).shape)
            if shape != expected:
                raise ValueError(f"Shape mismatch for {name}: expected {expected}, got {shape}")
            if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
                raise ValueError(
                    f"{name} must be an integer tensor (int64 hash constants), got {dtype}"
                )
            return ("buffer",)
        shard = self._shard_name(name)
        if self.file_table is not None and (
            name == WEIGHT_NAME or (shard is not None and shard[1] in ("weight", "weight_scale"))
        ):
            raise ValueError(
                f"{name}: the rows of a file table come from its file ({self.file_table.path}); "
                "write the file from the checkpoint with `qwen4exp-table pack`"
            )
        if shard is not None:
            shard_index, leaf = shard
            if leaf == "weight":
                start = self._check_shard(name, shard_index, shape, self.weight.shape[1])
                self._check_rows(name, dtype)
                return ("rows", start, "weight")
            if not self.nvfp4:
                raise ValueError(f"{name} holds NVFP4 scales, but the table is {self.table_dtype}")
            if leaf == "weight_scale":
                start = self._check_shard(name, shard_index, shape, self.weight_scale.shape[1])
                if dtype != torch.float8_e4m3fn:
                    raise ValueError(
                        f"NVFP4 PLE block scales {name} must be torch.float8_e4m3fn, got {dtype}"
                    )
                return ("rows", start, "weight_scale")
            self._checkpoint_shard_rows(shard_index)  # the index must name a shard
            self._check_global_scale(name, shape, dtype)
            return ("global_scale",)
        if self.nvfp4 and name in (WEIGHT_NAME, SCALE_NAME):
            raise self._unsharded_nvfp4(name)
        if name == GLOBAL_SCALE_NAME:
            self._check_global_scale(name, shape, dtype)
            return ("global_scale",)
        if name == SCALE_NAME:
            if self.weight_scale is None:
                raise ValueError(
                    f"{SCALE_NAME} given, but the table is {self.table_dtype}, not fp8"
                )
            if math.prod(shape) != 1 or not dtype.is_floating_point:
                raise ValueError(f"{SCALE_NAME} must be one float element, got {dtype} {shape}")
            return ("scale",)
        raise ValueError(f"NGramEmbedding.load_weights: unexpected checkpoint tensor {name!r}")

    @staticmethod
    def _state_name(name: str, plan: tuple) -> str:
        """The name in this module's state dict that a planned checkpoint tensor writes."""
        if plan[0] == "rows":
            return plan[2]
        if plan[0] == "global_scale":
            return "weight_scale_2"
        return name.removeprefix("ngram_embedding.")

    @staticmethod
    def _agree_global_scale(seen: list[tuple[str, torch.Tensor]], name: str, value) -> None:
        """Raises unless ``value`` equals the first global scale of this load (in ``seen``):
        an NVFP4 table has one global scale, however many shards repeat it."""
        value = value.detach().reshape(1).to(device="cpu", dtype=torch.float32)
        if not seen:
            seen.append((name, value))
            return
        first_name, first = seen[0]
        if not torch.equal(first, value):
            raise ValueError(
                f"NVFP4 global scales differ: {first_name} = {first.item()!r} but {name} = "
                f"{value.item()!r}; an NVFP4 table has one global scale (weight_scale_2)"
            )

    def _check_global_scales(self, steps: Iterable[tuple[str, tuple, Any]]) -> None:
        """The value check of a whole list of planned steps, before any of them writes."""
        seen: list[tuple[str, torch.Tensor]] = []
        for name, plan, source in steps:
            if plan[0] == "global_scale":
                self._agree_global_scale(seen, name, source)

    def _commit_small(self, staged: list[tuple[str, str, torch.Tensor]]) -> None:
        """Writes the checked hash buffers (exact int64), the fp8 scale and the NVFP4 global
        scale."""
        with torch.no_grad():
            for kind, name, tensor in staged:
                if kind == "scale":
                    self.weight_scale.copy_(tensor.reshape(1).to(torch.float32))
                elif kind == "global_scale":
                    self.weight_scale_2.copy_(tensor.reshape(1).to(torch.float32))
                else:
                    buffer = getattr(self, name)
                    buffer.copy_(tensor.to(dtype=torch.int64).to(buffer.device))
        if any(name == "ngram_heads_vocab_sizes" for _, name, _ in staged):
            self._refresh_head_divmod()

    def _check_complete(self) -> None:
        if self._incomplete_load is not None:
            raise RuntimeError(self._incomplete_load)

    def _mark_incomplete(self, error: BaseException) -> None:
        """After a load failed having written table rows: refuse to run until a load succeeds."""
        self._incomplete_load = (
            "NGramEmbedding: a load_weights call failed after writing part of the table "
            f"({type(error).__name__}: {error}); load the checkpoint again before use"
        )
        error.add_note("The table is partly written; this module refuses to run.")

    def _run_load(self, steps: Iterable[tuple[str, tuple, Any]]) -> set[str]:
        """Loads (name, plan, tensor-or-slice-reader) steps whose plans are all checked. Table
        rows (and NVFP4 block-scale rows) are written as they come (the table is never staged:
        it is too large); buffers and scales only once every step succeeded. A list of steps
        has its global scales compared before the first write; a stream, as they come. If a
        step fails after rows were written, the module refuses to run until a later load
        succeeds: a half-written table must never give silent wrong rows."""
        if isinstance(steps, list):
            self._check_global_scales(steps)
        loaded: set[str] = set()
        staged: list[tuple[str, str, torch.Tensor]] = []
        global_scales: list[tuple[str, torch.Tensor]] = []
        wrote_rows = False
        try:
            for name, plan, source in steps:
                kind = plan[0]
                if kind == "skip":
                    continue
                if kind == "rows":
                    _, start, target = plan
                    if isinstance(source, torch.Tensor):
                        self._copy_rows(start, source, target)
                    else:  # a reader of a memory-mapped checkpoint slice
                        source(start)
                    wrote_rows = True
                    loaded.add("ngram_embedding." + target)
                else:
                    if kind == "global_scale":
                        self._agree_global_scale(global_scales, name, source)
                        name = GLOBAL_SCALE_NAME  # one scale, whichever shard carried it
                    staged.append((kind, name, source))
                    loaded.add(name)
        except BaseException as error:
            if wrote_rows:
                self._mark_incomplete(error)
            raise
        if self.file_table is not None:  # the file was checked against these: they stay
            self._check_file_values(staged)
        self._commit_small(staged)
        if wrote_rows:
            self._incomplete_load = None
        return loaded

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads hash buffers (exact int64), checkpoint-split table rows and the fp8 scale, or
        for an NVFP4 table: ``ngram_embedding.shard_<i>.weight`` (exactly uint8 [rows_i, d/2]),
        ``ngram_embedding.shard_<i>.weight_scale`` (exactly float8_e4m3fn [rows_i, d/16]) and
        the global scale, as ``ngram_embedding.weight_scale_2`` or per shard as
        ``ngram_embedding.shard_<i>.weight_scale_2`` (every value given in one call must be
        equal). An unsharded NVFP4 ``ngram_embedding.weight``/``weight_scale`` is an error.

        ``hashstats_*`` and ``token_lookup`` tensors are skipped; every other mismatch — a shard
        index >= split_ngram_parts, a wrong shard or buffer shape or dtype, a float buffer, a
        meta tensor, an unknown name — is an error. Returns the names loaded
        (``ngram_embedding.weight`` for the rows, ``ngram_embedding.weight_scale`` for NVFP4
        block scales, ``ngram_embedding.weight_scale_2`` for the global scale).

        A list, tuple or dict is checked in full before anything is written, so an error leaves
        the module untouched. Any other iterable is consumed one tensor at a time (a lazy
        iterator never holds the table twice): buffers and scales are still written only at
        the end, but rows of earlier shards are already in place when a later tensor is bad; the
        module then raises on use until a load succeeds.
        """
        if isinstance(weights, Mapping):
            weights = list(weights.items())
        steps = ((n, self._plan(n, t.shape, t.dtype, t.device), t) for n, t in weights)
        if isinstance(weights, Sequence):
            steps = list(steps)  # every tensor checked before the first write
        return self._run_load(steps)

    def load_safetensors(self, files: Iterable[str | Path], prefix: str = "") -> set[str]:
        """Loads from safetensors files, reading only the rows this rank owns (memory-mapped
        slices, one checkpoint shard at a time; NVFP4 block scales alike): the table is never in
        memory twice.
        ``prefix`` (e.g. ``"model.ple."``) is stripped; other tensors are ignored. Every
        tensor's header is checked before anything is written."""
        from safetensors import safe_open

        files = [str(path) for path in files]
        steps = []
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if not key.startswith(prefix):
                        continue
                    name = key[len(prefix) :]
                    piece = f.get_slice(key)
                    dtype = safetensors_dtype(piece.get_dtype(), key)
                    plan = self._plan(name, piece.get_shape(), dtype, torch.device("cpu"))
                    if plan[0] == "rows":
                        steps.append((name, plan, self._slice_reader(path, key, plan[2])))
                    elif plan[0] != "skip":  # small: read now, written at the end
                        steps.append((name, plan, f.get_tensor(key)))
        return self._run_load(steps)

    def _slice_reader(self, path: str, key: str, target: str = "weight"):
        """Copies this rank's rows of one checkpoint shard into ``target`` (the table, or the
        NVFP4 block scales), as a memory-mapped slice."""

        def read(start: int) -> None:
            from safetensors import safe_open

            with safe_open(path, framework="pt", device="cpu") as f:
                piece = f.get_slice(key)
                lo, hi = self._owned_rows(start, piece.get_shape()[0])
                if lo < hi:
                    self._copy_rows(lo, piece[lo - start : hi - start], target)

        return read
