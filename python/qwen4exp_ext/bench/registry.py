"""The ops the benchmark knows, the shape of one benchmark case, and of an untimed section.

An op joins by writing a module with ``cases(device) -> list[Case]`` and adding one line to
``OP_MODULES`` (keyed by the op's name, as ``torch.ops.qwen4exp`` spells it; a module that benches
several ops, named for each, defines ``op_cases(op, device)`` instead); it may also define
``sections(device) -> list[Section]``: figures that belong in its report but are no race between
contenders (arithmetic, memory measurements). A module is imported only when its op runs, so
benchmarking one op never depends on another op's module (or its kernel) importing cleanly.

A case may also time ``references`` beside its contenders (reference points that compute no
output of the op: a step with the lookups left out, a host-to-device copy) and ``derive`` its
own figures from every timed function's quantiles (``host_lookup``: exposed lookup time,
overhead, bandwidths).

A case whose step vLLM 0.33.0 also implements names, in ``vllm``, the baseline that is vLLM's
own code for it (its Triton kernel, or the eager torch it runs), and the CLI derives
``speedup_vs_vllm`` from it; where vLLM's code cannot run here (its Triton kernels on a CPU, no
vLLM source on a GPU), ``vllm_note`` says why instead. ``vllm_kernels(device)`` gives an op's
module both: the kernels for the device, or the note.
"""

from __future__ import annotations

import functools
import importlib
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from qwen4exp_ext import _switches
from qwen4exp_ext.reference_hc import HC_OPS

if TYPE_CHECKING:
    from qwen4exp_ext.bench.timing import Quantiles

OP_MODULES: dict[str, str] = {
    "ngram_ids": "qwen4exp_ext.bench.ngram_ids",
    "gather_rows": "qwen4exp_ext.bench.gather_rows",
    "ngram_gather_rows": "qwen4exp_ext.bench.ngram_gather_rows",
    "ple_gate": "qwen4exp_ext.bench.ple_gate",
    "ple_conv": "qwen4exp_ext.bench.ple_conv",
    "host_lookup": "qwen4exp_ext.bench.host_lookup",
    "vllm_disk_offload": "qwen4exp_ext.bench.vllm_disk_offload",
    # One module benches the five hyper-connection ops (SPEC §10): its op_cases(op, device).
    **{op: "qwen4exp_ext.bench.hc" for op in HC_OPS},
    # One whole hyper-connection module step (combine_and_mix, its two GEMMs included).
    "hc_module": "qwen4exp_ext.bench.hc_module",
    # The fused decode projections (issue #50 item 3): one module, its op_cases(op, device).
    "hc_up_gate_mix": "qwen4exp_ext.bench.hc_fused",
    "hc_down_silu_inject": "qwen4exp_ext.bench.hc_fused",
}
# Ops left out of the representative subset (they run with --full, or named): building their
# cases costs more than the subset's budget (vllm_disk_offload imports vLLM and writes a
# 640 MB checkpoint file), or they have no headline shape (the fused HC projections: decode
# T <= 16 only).
FULL_ONLY_OPS: tuple[str, ...] = ("vllm_disk_offload", "hc_up_gate_mix", "hc_down_silu_inject")

# The headline shapes of every op, by phase: decode at T = 64 tokens (ple_conv: R = 64 requests
# of one token) and prefill at T = 8192, as ``re.search`` patterns on case names; HEADLINE_CASES
# (every variant of those shapes: formats, id patterns, layouts) is what tools/check-gpu.sh
# benches. An op's headline case of a phase is the first of its cases that matches (its
# default format and layout): the bench's representative subset and its summary.
HEADLINE_PHASES: dict[str, str] = {"decode": "decode_T64|decode_R64", "prefill": "prefill_T8192"}
HEADLINE_CASES = "|".join(HEADLINE_PHASES.values())


def headline_case_names(names: Iterable[str]) -> list[str]:
    """Of one op's case names, in its order, the first that matches each of HEADLINE_PHASES
    (none for a phase that no name matches)."""
    names = list(names)
    found = (next((n for n in names if re.search(p, n)), None) for p in HEADLINE_PHASES.values())
    return [n for n in found if n is not None]


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
    # The baseline that is vLLM 0.33.0's own code for this case (the CLI derives
    # "speedup_vs_vllm" from it), or None: then ``vllm_note`` says why vLLM is not timed (its
    # Triton kernels need a GPU; no vLLM source here; vLLM has no counterpart of the case).
    vllm: str | None = None
    vllm_note: str | None = None
    # Contenders that wait on the host (a CPU thread's lookup): on a GPU every call is timed by
    # the wall clock between device syncs instead of by events behind a spin, which would hide
    # the host's waiting (timing.time_interleaved).
    host_waits: bool = False
    # Run before every call of every timed function, outside the timed interval (the file
    # cases' page dropping: each call then reads from the disk, and the drop is not timed).
    before_call: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not self.baselines:
            raise ValueError(f"{self.op}/{self.name}: a case needs at least one baseline")
        if self.vllm is not None and self.vllm not in self.baselines:
            raise ValueError(f"{self.op}/{self.name}: vllm {self.vllm!r} is not a baseline")
        if self.vllm is not None and self.vllm_note is not None:
            raise ValueError(f"{self.op}/{self.name}: a vllm baseline needs no vllm_note")
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
    # A module that benches several ops builds one op's cases with op_cases(op, device).
    per_op = getattr(module, "op_cases", None)
    return module.cases(device) if per_op is None else per_op(op, device)


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


# Where vLLM's kernels are not timed, and why (a row's "vllm_note").
VLLM_CPU_NOTE = (
    "not timed on a CPU: vLLM 0.33.0 runs this as a Triton kernel on a GPU, and Triton's CPU "
    "interpreter, the only way to run it here, is far too slow to time"
)
VLLM_MISSING_NOTE = (
    "not timed: no vLLM 0.33.0 source here (install vLLM, or carry `python -m "
    "qwen4exp_ext.bench.vllm_triton DIR` here and set $QWEN4EXP_VLLM_SOURCE=DIR)"
)
# Tests only: with this set to 1, vllm_kernels on a CPU gives vLLM's kernels under Triton's
# interpreter, so that an op's cases are built (and checked) as on a GPU; never timed so.
VLLM_INTERPRET_ENV = "QWEN4EXP_BENCH_VLLM_INTERPRET"


@dataclass(frozen=True)
class VllmKernels:
    """vLLM 0.33.0's Triton PLE kernels for one device: ``ple`` (``ple_ngram_ids``,
    ``ple_gate``, ``ple_conv``) and ``lookups`` (``vllm_triton.load_lookup_kernels``), each None
    where it cannot run here, ``note`` then saying why; ``interpreted``: defined for Triton's
    CPU interpreter (tests), so every call must run through ``wrap``."""

    ple: types.ModuleType | None
    lookups: types.ModuleType | None
    note: str | None
    interpreted: bool = False

    def case_fields(self, baseline: str | None) -> dict[str, str | None]:
        """A Case's ``vllm`` and ``vllm_note``: ``baseline`` where the case built vLLM's
        contender under that name, else (None) this device's note on why it could not."""
        return {"vllm": baseline, "vllm_note": None if baseline is not None else self.note}

    def op(self, name: str) -> Callable[..., Any] | None:
        """vLLM's PLE op ``name``, ready to call on this device, or None."""
        return None if self.ple is None else self.wrap(getattr(self.ple, name))

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (which launches vLLM's kernels), run under the interpreter if they need it."""
        if not self.interpreted:
            return fn
        from qwen4exp_ext.bench import vllm_triton

        def interpreted(*args: Any, **kwargs: Any) -> Any:
            with vllm_triton.interpreter():
                return fn(*args, **kwargs)

        return interpreted


def vllm_kernels(device: torch.device) -> VllmKernels:
    """vLLM's kernels for ``device``: on a GPU from the installed vLLM or its source
    (``bench.vllm_triton``), None with VLLM_MISSING_NOTE where neither is here; on a CPU none,
    with VLLM_CPU_NOTE (unless $QWEN4EXP_BENCH_VLLM_INTERPRET=1: the tests' interpreter)."""
    if device.type == "cuda":
        return _vllm_kernels(interpret=False)
    if _switches.env_flag(VLLM_INTERPRET_ENV, False):
        return _vllm_kernels(interpret=True)
    return VllmKernels(None, None, VLLM_CPU_NOTE)


@functools.cache
def _vllm_kernels(interpret: bool) -> VllmKernels:
    from qwen4exp_ext.bench import vllm_triton

    ple = vllm_ple_module() if not interpret else vllm_triton.load(interpret=True)
    lookups = vllm_triton.load_lookup_kernels(interpret=interpret)
    missing = ple is None or lookups is None
    return VllmKernels(ple, lookups, VLLM_MISSING_NOTE if missing else None, interpret)


def vllm_ple_module() -> types.ModuleType | None:
    """vLLM 0.33.0's own Triton PLE ops (``ple_ngram_ids``, ``ple_gate``, ``ple_conv``) for the
    GPU: from the installed vLLM, else from its source (``bench.vllm_triton``: a copy carried in
    ``$QWEN4EXP_VLLM_SOURCE`` where vLLM is not installed); None when neither is here."""
    try:
        from vllm.models.qwen4_exp.common.ops import ple
    except Exception:  # noqa: BLE001 - any import failure: fall back to the source
        from qwen4exp_ext.bench import vllm_triton

        ple = vllm_triton.load(interpret=False)
    return ple
