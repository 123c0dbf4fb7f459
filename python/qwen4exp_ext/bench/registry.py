"""The ops the benchmark knows, the shape of one benchmark case, and of an untimed section.

An op joins by writing a module with ``cases(device) -> list[Case]`` and adding one line to
``OP_MODULES``; it may also define ``sections(device) -> list[Section]``: figures that belong in
its report but are no race between contenders (arithmetic, memory measurements). A module is
imported only when its op runs, so benchmarking one op never depends on another op's module (or
its kernel) importing cleanly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

OP_MODULES: dict[str, str] = {
    "ngram_ids": "qwen4exp_ext.bench.ngram_ids",
    "gather": "qwen4exp_ext.bench.gather",
    "gate": "qwen4exp_ext.bench.gate",
    "conv": "qwen4exp_ext.bench.conv",
}


@dataclass(frozen=True)
class Case:
    """One shape of one op, with its inputs already built and bound into two closures.

    ``ours`` and ``ref`` must return the op's output so the CLI can check them against each other;
    they write into preallocated buffers, as vLLM's callers do, so timing excludes the allocator.
    ``nbytes`` is the op's compulsory memory traffic (each input read once, the output written
    once): the numerator of its effective bandwidth.
    """

    op: str
    name: str
    tokens: int
    nbytes: int
    ours: Callable[[], torch.Tensor]
    ref: Callable[[], torch.Tensor]
    params: Mapping[str, int]
    # Optional comparison that replaces the CLI's exact one (ops whose contract is a stated
    # tolerance, or whose result is more than one tensor): runs both contenders from the same
    # inputs and returns a description of the disagreement, or None.
    check: Callable[[], str | None] | None = None


def load_cases(op: str, device: torch.device) -> list[Case]:
    """Build every case of ``op`` on ``device`` (inputs are made once here, not per call)."""
    module = importlib.import_module(OP_MODULES[op])
    return module.cases(device)


@dataclass(frozen=True)
class Section:
    """An untimed table of an op's report: printed after the op's cases (``columns``: (key,
    header) pairs of ``rows`` to print) and written to the JSON under "sections", rows whole."""

    op: str
    name: str
    note: str
    columns: Sequence[tuple[str, str]]
    rows: Sequence[Mapping[str, object]]


def load_sections(op: str, device: torch.device) -> list[Section]:
    """The untimed sections of ``op`` on ``device`` (none if its module defines no ``sections``)."""
    module = importlib.import_module(OP_MODULES[op])
    sections = getattr(module, "sections", None)
    return [] if sections is None else sections(device)
