"""The ops the benchmark knows, the shape of one benchmark case, and of an untimed section.

An op joins by writing a module with ``cases(device) -> list[Case]`` and adding one line to
``OP_MODULES`` (keyed by the op's name, as ``torch.ops.qwen4exp`` spells it); it may also define
``sections(device) -> list[Section]``: figures that belong in its report but are no race between
contenders (arithmetic, memory measurements). A module is imported only when its op runs, so
benchmarking one op never depends on another op's module (or its kernel) importing cleanly.

A case may also time ``references`` beside its contenders (reference points that compute no
output of the op: a step with the lookups left out, a host-to-device copy) and ``derive`` its
own figures from every timed function's quantiles (``host_lookup``: exposed lookup time,
overhead, bandwidths).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qwen4exp_ext.bench.timing import Quantiles

OP_MODULES: dict[str, str] = {
    "ngram_ids": "qwen4exp_ext.bench.ngram_ids",
    "gather_rows": "qwen4exp_ext.bench.gather_rows",
    "ngram_gather_rows": "qwen4exp_ext.bench.ngram_gather_rows",
    "ple_gate": "qwen4exp_ext.bench.ple_gate",
    "ple_conv": "qwen4exp_ext.bench.ple_conv",
    "host_lookup": "qwen4exp_ext.bench.host_lookup",
}

# Contender names the CLI owns; a baseline may not take one.
RESERVED = ("ours", "oracle", "copy")


@dataclass(frozen=True)
class Case:
    """One shape of one op, with its inputs already built and bound into closures.

    ``ours`` (our kernel), ``oracle`` (``reference.py``, the plain-PyTorch statement of the spec)
    and each of ``baselines`` (what a user would run without our kernel: eager transformers,
    ``torch.index_select``, ``F.conv1d``, vLLM's kernel; the first is the headline, the one the
    speedup column divides by) return the op's output, so the CLI can check them against each
    other. Ours and the baselines write into preallocated buffers where their API allows, as
    vLLM's callers do, so timing excludes the allocator. ``nbytes`` is the op's compulsory memory
    traffic (each input read once, the output written once): the numerator of its bandwidth.
    """

    op: str
    name: str
    tokens: int
    nbytes: int
    ours: Callable[[], torch.Tensor]
    oracle: Callable[[], torch.Tensor]
    baselines: Mapping[str, Callable[[], torch.Tensor]]
    params: Mapping[str, object]
    # Optional comparison that replaces the CLI's exact one (ops whose contract is a stated
    # tolerance, or whose result is more than one tensor): runs ours, the oracle and every
    # baseline from the same inputs and returns a description of the disagreement, or None.
    check: Callable[[], str | None] | None = None
    # Optional functions timed in the same interleaved loop as the contenders but racing no one
    # (no check, no speedup): reference points the op's own figures need, e.g. the step with
    # its lookups left out. Their quantiles go to the result under "references".
    references: Mapping[str, Callable[[], object]] = field(default_factory=dict)
    # Optional: the op's own figures, from the quantiles of everything timed (keyed "ours",
    # each baseline's name, "oracle", each reference's name, "copy"), merged into the result
    # (new keys only). A "summary" string among them is also printed under the case's row.
    derive: Callable[[Mapping[str, Quantiles]], Mapping[str, object]] | None = None

    def __post_init__(self) -> None:
        if not self.baselines:
            raise ValueError(f"{self.op}/{self.name}: a case needs at least one baseline")
        clash = set(self.baselines) & set(RESERVED)
        if clash:
            raise ValueError(f"{self.op}/{self.name}: baseline names {sorted(clash)} are taken")
        clash = set(self.references) & (set(RESERVED) | set(self.baselines))
        if clash:
            raise ValueError(f"{self.op}/{self.name}: reference names {sorted(clash)} are taken")

    @property
    def baseline(self) -> str:
        """The headline baseline's name."""
        return next(iter(self.baselines))


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


def vllm_ple_op(name: str):
    """vLLM 0.33.0's own Triton PLE op ``name`` (``ple_gate``, ``ple_conv``) for the GPU: from
    the installed vLLM, else from its source (``bench.vllm_triton``: a copy carried in
    ``$QWEN4EXP_VLLM_SOURCE`` where vLLM is not installed); None when neither is here."""
    try:
        from vllm.models.qwen4_exp.common.ops import ple
    except Exception:  # noqa: BLE001 - any import failure: fall back to the source
        from qwen4exp_ext.bench import vllm_triton

        ple = vllm_triton.load(interpret=False)
    return None if ple is None else getattr(ple, name)
