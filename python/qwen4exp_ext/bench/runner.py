"""One case of ``qwen4exp-bench``, checked and timed: ``_run_case`` checks ours against the
oracle and every baseline (``_check``; a disagreement is ``CheckFailed``, and the case is not
timed), sizes the run to a time budget where no repeat count is given (``_auto_repeat``), times
ours, the baselines, the oracle, the references and a same-traffic copy in one interleaved loop
and returns the case's result: the dict that becomes a table row, a CSV row, a ``--append`` row
and an entry of the JSON's "results" (on a CPU with ``cpu_paths``: which paths of our CPU kernels
the timed calls took). ``_num_threads`` runs a block at one torch thread count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch

from qwen4exp_ext import ops
from qwen4exp_ext.bench.machine import PEAK_TBPS, pct_of_peak
from qwen4exp_ext.bench.registry import Case
from qwen4exp_ext.bench.timing import Quantiles, roofline_copy, time_interleaved
from qwen4exp_ext.testing import exact_mismatch

DEFAULT_REPEAT = 500
QUICK_REPEAT = 10
# Without --repeat, each case gets as many rounds as fit this many seconds (MIN_REPEAT to
# DEFAULT_REPEAT): the eager baselines of the big shapes take seconds per call on a CPU, the
# kernels microseconds, and a fixed count would make the default run take hours.
CASE_BUDGET_S = 4.0
# The same for the representative subset (no op, no --cases, no --full: each op's headline
# cases, at args.DEFAULT_THREADS on a CPU), which should end in about three minutes on a 2-core
# machine. The decode cases reach DEFAULT_REPEAT rounds well within a second; the prefill cases'
# eager oracle and baselines take seconds a call on a CPU, so there MIN_REPEAT rounds, not this
# budget, set the time (on 2026-12-05 a 2-core EPYC VM, compiling CI beside it, took 453 s, most
# of it ple_gate's and ple_conv's prefill oracles).
SUBSET_CASE_BUDGET_S = 1.0
MIN_REPEAT = 5


class CheckFailed(Exception):
    """Our kernel disagrees with the oracle or a baseline; timing a wrong kernel means nothing."""


class _num_threads:  # noqa: N801 - used as a context manager, like torch's own
    """torch.set_num_threads(n) for the block, the previous count restored after it."""

    def __init__(self, n: int):
        self.n = n
        self.previous = torch.get_num_threads()

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


def _auto_repeat(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    warmup: int,
    budget_s: float,
    before_call: Callable[[], None] | None = None,
) -> int:
    """Runs the warm-up rounds and returns how many rounds fit ``budget_s`` (timed on the last
    warm-up round, ``before_call`` included), clamped to [MIN_REPEAT, DEFAULT_REPEAT]."""
    round_s = 0.0
    for _ in range(warmup):
        start = time.perf_counter()
        for fn in fns.values():
            if before_call is not None:
                before_call()
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        round_s = time.perf_counter() - start
    return max(MIN_REPEAT, min(DEFAULT_REPEAT, int(budget_s / max(round_s, 1e-9))))


def _run_case(
    case: Case,
    device: torch.device,
    warmup: int,
    repeat: int | None,
    check: bool,
    budget_s: float = CASE_BUDGET_S,
) -> dict[str, Any]:
    if check:
        _check(case)
    copy, copy_bytes = roofline_copy(case.nbytes, device)
    fns: dict[str, Callable[[], object]] = {
        "ours": case.ours,
        **case.baselines,
        "oracle": case.oracle,
        **case.references,
        "copy": copy,
    }
    if repeat is None:
        repeat = _auto_repeat(fns, device, warmup, budget_s, case.before_call)
        warmup = 0  # done
    if device.type == "cpu":
        ops.cpu_gather_calls(reset=True)  # from here on: the gathers of the timed calls
    times = time_interleaved(
        fns, device, warmup, repeat, wall_clock=case.host_waits, before_call=case.before_call
    )
    paths = cpu_paths(case.op) if device.type == "cpu" else None
    ours, oracle, copy_t = times["ours"], times["oracle"], times["copy"]
    baselines = {name: times[name] for name in case.baselines}
    headline = baselines[case.baseline]
    timed = {"ours": ours, **baselines, "oracle": oracle}

    def gbps(q: Quantiles, nbytes: int = case.nbytes) -> float:
        return nbytes / (q.p50_us * 1e3)

    rates = {name: gbps(q) for name, q in timed.items()} | {"copy": gbps(copy_t, copy_bytes)}
    result = {
        "op": case.op,
        "case": case.name,
        "threads": torch.get_num_threads(),
        "tokens": case.tokens,
        "params": dict(case.params),
        "check": True if check else None,
        "ours": asdict(ours),
        "baseline": case.baseline,
        "baselines": {name: asdict(q) for name, q in baselines.items()},
        "oracle": asdict(oracle),
        "copy": asdict(copy_t),
        # The headline: what a user gains over what they would run otherwise.
        "speedup": headline.p50_us / ours.p50_us,
        "speedups": {name: q.p50_us / ours.p50_us for name, q in baselines.items()},
        "speedup_vs_oracle": oracle.p50_us / ours.p50_us,
        # Over vLLM 0.33.0's own code for the case, where it ran (else null, and the note says
        # why): what a vLLM user gains by our kernel.
        "vllm_baseline": case.vllm,
        "speedup_vs_vllm": speedup_vs_vllm(times, case.vllm),
        "vllm_note": case.vllm_note,
        "tokens_per_s": {name: case.tokens / (q.p50_us * 1e-6) for name, q in timed.items()},
        "bytes": case.nbytes,
        "copy_bytes": copy_bytes,
        "gbps": rates,
        "pct_of_copy": 100.0 * rates["ours"] / rates["copy"],
        "roofline_us": {gpu: case.nbytes / (tbps * 1e6) for gpu, tbps in PEAK_TBPS.items()},
        "pct_of_peak": pct_of_peak(rates["ours"], device),
    }
    if paths is not None:
        result["cpu_paths"] = paths
    if case.references:
        result["references"] = {name: asdict(times[name]) for name in case.references}
    if case.derive is not None:
        derived = dict(case.derive(times))
        clash = set(derived) & set(result)
        if clash:
            raise ValueError(f"{case.op}/{case.name}: derived fields {sorted(clash)} are taken")
        result |= derived
    return result


# The ops whose CPU rows say which paths of our CPU kernels ran (issue #51): the gather's, its
# fp8 lookup's and the n-gram hash's, in the result's "cpu_paths" and the table's "path" column.
CPU_PATH_OPS = ("ngram_ids", "gather_rows", "ngram_gather_rows", "host_lookup")
# Of those, the ones that hash n-grams (ngram_ids' kernel, alone or fused into the gather).
HASHING_OPS = ("ngram_ids", "ngram_gather_rows", "host_lookup")


def cpu_paths(op: str) -> dict[str, Any] | None:
    """For a row of ``op`` on a CPU, read right after its timed loop: which gather path ran
    (``gather``, the one most of the loop's gathers took, None where none ran;
    ``gather_calls``, every path that ran and how often: the first large gathers of a process
    time each path, ``ops.cpu_gather_path``), the figures of that timing at this thread count
    (``gather_timing``: per kind, "copy" or "convert", where made), the lookup that converted
    fp8 rows (``fp8_lookup``, None where no fp8 gather ran) and the width of the n-gram hash
    (``hash``, for the ops that hash). Counted over every gather of the loop, whoever made it:
    a baseline built on our kernel (``ngram_gather_rows``' two_ops) takes the same path. None for
    other ops."""
    if op not in CPU_PATH_OPS:
        return None
    calls = ops.cpu_gather_calls()
    ran = {path: n for path, n in calls["path"].items() if n}
    lookups = {lookup: n for lookup, n in calls["fp8_lookup"].items() if n}
    timing = {
        kind: ops.cpu_gather_timing(converting=kind == "convert") for kind in ("copy", "convert")
    }
    return {
        "gather": max(ran, key=ran.get) if ran else None,
        "gather_calls": ran,
        "gather_timing": {kind: t for kind, t in timing.items() if t is not None},
        "fp8_lookup": max(lookups, key=lookups.get) if lookups else None,
        "hash": hash_width() if op in HASHING_OPS else None,
    }


def hash_width() -> str | None:
    """The width the CPU ``ngram_ids`` (and the fused gather) hashes with ("avx512", "avx2",
    "scalar"), for the rows of HASHING_OPS."""
    return ops.cpu_ngram_hash_isa()


def path_text(paths: dict[str, Any] | None) -> str:
    """The table's "path" cell: the gather's path, its fp8 lookup and the hash width where they
    apply ("stream", "cached/avx512", "plain/-/avx2"...), "-" for none."""
    if paths is None:
        return "-"
    parts = [paths["gather"] or "-", paths["fp8_lookup"] or "-", paths["hash"] or "-"]
    while len(parts) > 1 and parts[-1] == "-":
        parts.pop()
    return "/".join(parts)


def speedup_vs_vllm(times: Mapping[str, Quantiles], vllm: str | None) -> float | None:
    """vLLM's p50 over ours, as every speedup here (> 1: ours is faster), from the case's
    quantiles by contender name; None where the case names no vLLM baseline (``vllm``)."""
    if vllm is None:
        return None
    return times[vllm].p50_us / times["ours"].p50_us


def _check(case: Case) -> None:
    """The case's own check, or exact equality of ours with the oracle and every baseline."""
    if case.check is not None:
        problem = case.check()
    else:
        ours = case.ours().clone()  # a baseline may share nothing with it, but be safe
        problem = exact_mismatch(
            ours, case.oracle(), "output", against="the oracle", equal_nan=True
        )
        for name, fn in case.baselines.items():
            problem = problem or exact_mismatch(ours, fn(), "output", against=name, equal_nan=True)
    if problem is not None:
        raise CheckFailed(problem)
