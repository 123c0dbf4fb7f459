"""Side-by-side timing of a case's contenders, and the copy that serves as its roofline.

All contenders of a case are timed in one loop, so frequency changes and other tenants land on
all of them alike and their ratio stays meaningful even on a noisy machine. The order changes
every repetition so that each contender follows every other equally often: what a call finds in
the caches and TLBs depends on the call before it (a copy evicts them; a gather over the same
table leaves its page-table entries cached), and with a fixed predecessor one contender would
always time the cold case and another the warm one. (A plain rotation keeps the cyclic order,
hence the predecessors, fixed; a Williams design balances them.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

QUANTILES = (0.2, 0.5, 0.8)


@dataclass(frozen=True)
class Quantiles:
    """Per-call times of one contender, in microseconds."""

    p20_us: float
    p50_us: float
    p80_us: float
    min_us: float
    mean_us: float
    n: int

    @classmethod
    def of(cls, samples_us: list[float]) -> Quantiles:
        t = torch.tensor(samples_us, dtype=torch.float64)
        p20, p50, p80 = t.quantile(torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
        return cls(p20, p50, p80, t.min().item(), t.mean().item(), t.numel())


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device,
    warmup: int,
    repeat: int,
    wall_clock: bool = False,
    before_call: Callable[[], None] | None = None,
) -> dict[str, Quantiles]:
    """Time every function ``repeat`` times after ``warmup`` untimed rounds, interleaved.

    On CUDA/ROCm each call sits between two events on the current stream, queued behind a spin
    kernel that lasts longer than the host takes to queue the call: the figure is the device's
    time for the call, as in a CUDA graph (how vLLM runs decode), not the host's launch overhead,
    which would otherwise be most of a decode kernel's few microseconds.
    A contender that waits on the device from the host (a sync) still pays for its wait. On CPU it
    is wall time per call; with ``wall_clock`` also on a GPU, from a device sync to the next
    (launch overheads included): for contenders whose cost is the host's waiting, which the
    spin would hide. ``before_call`` runs before every call, untimed (wall clock only).
    """
    if before_call is not None and device.type == "cuda" and not wall_clock:
        raise ValueError("before_call needs wall_clock timing on a GPU")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            if before_call is not None:
                before_call()
            fns[name]()
    order = [[names[i] for i in row] for row in balanced_orders(len(names))]
    if device.type == "cuda" and not wall_clock:
        samples = _time_cuda(fns, order, device, repeat)
    else:
        sync = device if device.type == "cuda" else None
        samples = _time_cpu(fns, order, repeat, sync, before_call)
    return {name: Quantiles.of(samples[name]) for name in names}


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of range(n) in which every ordered pair of distinct items is adjacent equally
    often (a Williams design: n orders for even n, 2n for odd n)."""
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(j + i) % n for j in first] for i in range(n)]
    return rows if n % 2 == 0 or n == 1 else rows + [row[::-1] for row in rows]


def _time_cpu(
    fns: Mapping[str, Callable[[], object]],
    order: list[list[str]],
    repeat: int,
    sync: torch.device | None = None,
    before_call: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Wall time per call; with ``sync`` (a GPU) between device syncs; ``before_call`` first,
    untimed."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeat):
        for name in order[i % len(order)]:
            fn = fns[name]
            if before_call is not None:
                before_call()
            if sync is not None:
                torch.cuda.synchronize(sync)
            start = time.perf_counter_ns()
            fn()
            if sync is not None:
                torch.cuda.synchronize(sync)
            samples[name].append((time.perf_counter_ns() - start) / 1e3)
    return samples


# Each timed call waits behind a spin lasting this many times the host's time to queue that call
# (measured once, untimed, with the device idle), plus MIN_LEAD_S for the spin and the two event
# records: the host has queued the call before the device reaches it, so the events time the
# device's work, not the host's. One spin per call, not per round: a contender that syncs (the
# conv oracle's .tolist(), eager code with data-dependent shapes) drains the queue, and the calls
# queued after it in a round-wide lead then timed the host's launch overhead instead (first GPU
# run, 2026-12-04: ngram_ids at 27 us for T = 64 and 32 us for T = 8192). The spins cost device
# time between calls only.
QUEUE_LEAD = 1.5
MIN_LEAD_S = 50e-6
MAX_LEAD_S = 0.05


def _time_cuda(
    fns: Mapping[str, Callable[[], object]],
    order: list[list[str]],
    device: torch.device,
    repeat: int,
) -> dict[str, list[float]]:
    events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    with torch.cuda.device(device):
        cycles_per_s = _spin_cycles_per_s(device)
        lead_cycles: dict[str, int] = {}
        for name in order[0]:
            torch.cuda.synchronize()
            start_s = time.perf_counter()
            fns[name]()
            host_s = time.perf_counter() - start_s
            lead_s = min(QUEUE_LEAD * host_s + MIN_LEAD_S, MAX_LEAD_S)
            lead_cycles[name] = int(lead_s * cycles_per_s)
        torch.cuda.synchronize()
        for i in range(repeat):
            for name in order[i % len(order)]:
                torch.cuda._sleep(lead_cycles[name])
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                events.append((name, start, end))
        # One sync at the end keeps the host from stalling the queue between calls.
        torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for name, start, end in events:
        samples[name].append(start.elapsed_time(end) * 1e3)
    return samples


_SPIN_RATES: dict[int, float] = {}


def _spin_cycles_per_s(device: torch.device) -> float:
    """Clock cycles per second of ``torch.cuda._sleep``'s spin on ``device``, measured once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SPIN_RATES:
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # the first launch loads the kernel
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SPIN_RATES[index] = cycles / (start.elapsed_time(end) * 1e-3)
    return _SPIN_RATES[index]


def roofline_copy(nbytes: int, device: torch.device) -> tuple[Callable[[], torch.Tensor], int]:
    """A ``Tensor.copy_`` that moves ``nbytes`` (half read, half written) on ``device``.

    Measured in the same run as the op instead of quoting a datasheet peak, it is the bandwidth
    this machine actually reaches for this many bytes, launch and threading overheads included.
    Returns the copy and the bytes it really moves (``nbytes`` rounded up to even).
    """
    half = max(1, -(-nbytes // 2))
    # zeros, not empty: touch every page now so the copy never times first-touch page faults.
    src = torch.zeros(half, dtype=torch.uint8, device=device)
    dst = torch.zeros(half, dtype=torch.uint8, device=device)
    return (lambda: dst.copy_(src)), 2 * half
