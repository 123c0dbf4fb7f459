"""The time-bounded fuzzing kit of every op's tests/<op>/test_fuzz.py: each fuzz test draws whole
calls with hypothesis and compares the kernels with the oracle on every backend (SPEC §9.8).

Each test draws whole calls with hypothesis: sizes (0, 1, odd, prime and larger), every supported
dtype, strided and transposed views where the op takes them, contiguous ones, and request layouts
(empty, single-token and many requests, padding, tokens outside the requests); it compares ours
with ``qwen4exp_ext.reference`` exactly as the op's other tests do (same tolerances: bit for bit
where they are), and checks that nothing outside the outputs is written.

Budget: hypothesis has no time limit, so each test runs batches of ``EXAMPLES_PER_BATCH`` examples,
each batch a fresh hypothesis run with its own seed (batch i of a test uses seed base + i), until
``QWEN4EXP_FUZZ_SECONDS`` (default 8; per op, shared by the backends) are spent; one batch always
runs. A developer fuzzes for longer with e.g. ``QWEN4EXP_FUZZ_SECONDS=600``. The base seed is
random unless ``QWEN4EXP_FUZZ_SEED`` is set; a failure names the seed of its batch and the test, and

    QWEN4EXP_FUZZ_SEED=<seed> QWEN4EXP_FUZZ_SECONDS=0 python -m pytest '<the test>'

replays exactly that batch (hypothesis also prints the falsifying draws and a
``@reproduce_failure`` blob). The explicit settings below override the conftest profile, whose
``derandomize=True`` would otherwise repeat the same examples in every batch; every test asserts
that later batches drew new inputs.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from conftest import backends
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact

BACKENDS = backends()
FUZZ_SECONDS = float(os.environ.get("QWEN4EXP_FUZZ_SECONDS", "8"))
EXAMPLES_PER_BATCH = 25
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
FP8 = reference.FP8_DTYPES
SENTINEL_BYTE = 0x5A  # fills every buffer byte outside a view: finite in every float format


# --- the time-bounded driver ----------------------------------------------------------------------


def _base_seed() -> int:
    env = os.environ.get("QWEN4EXP_FUZZ_SEED")
    return int(env) if env else secrets.randbits(32)


class Recorder:
    """`data.draw` that also keeps what was drawn, to count distinct examples."""

    def __init__(self, data):
        self.data = data
        self.drawn: list[str] = []

    def __call__(self, strategy, label: str | None = None):
        value = self.data.draw(strategy, label=label)
        self.drawn.append(repr(value))
        return value


def fuzz(label: str, body: Callable[[Recorder], None], record=None) -> dict:
    """Runs hypothesis batches of `body(draw)` until this test's budget is spent (at least one)."""
    budget = FUZZ_SECONDS / len(BACKENDS)
    base = _base_seed()
    started = time.monotonic()
    seen: set = set()
    first_batch: set = set()
    batches = 0
    calls = [0]  # examples run (hypothesis may draw one twice)
    current: list[set] = []  # the running batch's draws (a list: no loop variable in the closure)
    while True:
        batch_seed = base + batches
        drawn: set = set()
        current[:] = [drawn]

        @seed(batch_seed)
        @settings(
            max_examples=EXAMPLES_PER_BATCH,
            deadline=None,
            derandomize=False,
            database=None,
            print_blob=True,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.filter_too_much,
                HealthCheck.large_base_example,
                HealthCheck.differing_executors,
            ],
        )
        @given(data=st.data())
        def batch(data):
            calls[0] += 1
            draw = Recorder(data)
            body(draw)
            current[0].add(tuple(draw.drawn))

        try:
            batch()
        except Exception as exc:
            raise AssertionError(
                f"fuzz {label}: batch {batches} failed (hypothesis seed {batch_seed}); replay it "
                f"with QWEN4EXP_FUZZ_SEED={batch_seed} QWEN4EXP_FUZZ_SECONDS=0 "
                f"python -m pytest '{_current_test()}'"
            ) from exc
        if batches == 0:
            first_batch = set(drawn)
        seen |= drawn
        batches += 1
        if time.monotonic() - started >= budget:
            break
    elapsed = time.monotonic() - started
    examples = calls[0]
    stats = {"examples": examples, "distinct": len(seen), "batches": batches, "seconds": elapsed}
    print(
        f"fuzz {label}: {examples} examples ({len(seen)} distinct) in {batches} batches of "
        f"{EXAMPLES_PER_BATCH}, {elapsed:.1f} s (base seed {base})"
    )
    if record is not None:
        record("fuzz", stats)
    if batches > 1:
        # Guards against a hypothesis profile that makes every batch replay the same examples.
        assert len(seen) > len(first_batch), f"fuzz {label}: later batches drew nothing new"
    return stats


# --- laying tensors out in memory -----------------------------------------------------------------


@dataclass
class Laid:
    """A tensor's values placed inside a larger `base` buffer through `view_fn` (a strided view);
    every base byte outside the view holds SENTINEL_BYTE."""

    base: torch.Tensor
    view_fn: Callable[[torch.Tensor], torch.Tensor]
    kind: str

    def on(self, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh copy of the base on `device`, and the view into it."""
        base = self.base.clone().to(device)
        return base, self.view_fn(base)

    def outside(self) -> torch.Tensor:
        """Mask of the base elements outside the view."""
        mask = torch.ones(self.base.shape, dtype=torch.bool)
        self.view_fn(mask).fill_(False)
        return mask


def place(values: torch.Tensor, base_shape, view_fn, kind: str) -> Laid:
    base = torch.empty(base_shape, dtype=values.dtype)
    if base.dtype == torch.bool:
        base.fill_(True)
    else:
        base.view(torch.uint8).fill_(SENTINEL_BYTE)
    view = view_fn(base)
    assert view.shape == values.shape, (kind, view.shape, values.shape)
    view.copy_(values)
    return Laid(base, view_fn, kind)


def draw_layout_2d(draw, values: torch.Tensor, name: str, *, any_strides: bool) -> Laid:
    """[rows, cols] as: contiguous, a column slice of a wider buffer (row stride > cols, storage
    offset), every 2nd/3rd row of a taller one, and (when the op takes any strides) transposed
    storage, possibly with a column step too."""
    rows, cols = values.shape
    kinds = ["contiguous", "column_slice", "row_step"]
    if any_strides:
        kinds += ["transposed", "transposed_step"]
    kind = draw(st.sampled_from(kinds), label=f"{name} layout")
    if kind == "contiguous":
        return place(values, (rows, cols), lambda b: b, kind)
    if kind == "column_slice":
        pad = draw(st.integers(1, 5), label=f"{name} pad")
        off = draw(st.integers(0, pad), label=f"{name} offset")
        return place(values, (rows, cols + pad), lambda b: b[:, off : off + cols], kind)
    if kind == "row_step":
        step = draw(st.integers(2, 3), label=f"{name} row step")
        off = draw(st.integers(0, step - 1), label=f"{name} offset")
        return place(values, (rows * step, cols), lambda b: b[off::step][:rows], kind)
    if kind == "transposed":
        return place(values, (cols, rows), lambda b: b.t(), kind)
    return place(values, (cols, 2 * rows), lambda b: b[:, 1::2].t(), kind)


def draw_layout_1d(draw, values: torch.Tensor, name: str, *, column_2d: bool = False) -> Laid:
    """[n] as: contiguous, every 2nd/3rd element, a column of a 2-D buffer, or (index vectors of
    ple_conv, which take a block-table column) an [n, 1] tensor."""
    (n,) = values.shape
    kinds = ["contiguous", "step", "column"] + (["n_by_1"] if column_2d else [])
    kind = draw(st.sampled_from(kinds), label=f"{name} layout")
    if kind == "contiguous":
        return place(values, (n,), lambda b: b, kind)
    if kind == "step":
        step = draw(st.integers(2, 3), label=f"{name} step")
        return place(values, (n * step + 1,), lambda b: b[1::step][:n], kind)
    if kind == "column":
        width = draw(st.integers(2, 4), label=f"{name} block width")
        col = draw(st.integers(0, width - 1), label=f"{name} column")
        return place(values, (n, width), lambda b: b[:, col], kind)
    return Laid(values.clone().reshape(n, 1), lambda b: b, kind)


def assert_outside_untouched(laid: Laid, base_after: torch.Tensor, what: str) -> None:
    """Every base element outside the view still holds its original bytes."""
    mask = laid.outside()
    assert_exact(
        base_after.cpu()[mask], laid.base[mask], f"{what} (outside the view)", bitwise=True
    )


def assert_unchanged(laid: Laid, base_after: torch.Tensor, what: str) -> None:
    assert_exact(base_after.cpu(), laid.base, f"{what} was mutated", bitwise=True)


def sizes(small: list[int], low: int, high: int):
    """Sizes: hand-picked edge values (0, 1, odd, prime) or anything in [low, high]."""
    return st.one_of(st.sampled_from(small), st.integers(low, high))


def generator(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="data seed"))


def random_ints(gen, shape, low: int, high: int, dtype) -> torch.Tensor:
    """Uniform in [low, high] (inclusive), the full int64 range included."""
    if low == INT64_MIN and high == INT64_MAX:
        raw = torch.randint(0, 256, (*shape, 8), dtype=torch.uint8, generator=gen)
        return raw.view(torch.int64).reshape(shape).to(dtype)
    return torch.randint(low, high + 1, shape, dtype=torch.int64, generator=gen).to(dtype)


def dtype_range(dtype) -> tuple[int, int]:
    return (INT32_MIN, INT32_MAX) if dtype == torch.int32 else (INT64_MIN, INT64_MAX)


def _current_test() -> str:
    """The running test's node id, as pytest names it (what replays it)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "tests").rsplit(" ", 1)[0]


# --- request layouts of varlen batches (ngram_ids, ple_conv) ------------------------------------


def draw_request_lengths(draw, *, longest: int, many: int) -> list[int]:
    """A varlen batch's chunk lengths: mixed (empty, single-token and longer requests), many
    single-token requests (a decode batch), one long chunk, or only empty requests."""
    kind = draw(st.sampled_from(["mixed", "many_single", "one_long", "all_empty"]), label="batch")
    if kind == "mixed":
        lengths = draw(
            st.lists(sizes([0, 1, 1, 2, 3], 0, longest // 3), max_size=8), label="lengths"
        )
    elif kind == "many_single":
        lengths = [1] * draw(st.integers(1, many), label="requests")
    elif kind == "one_long":
        lengths = [draw(st.integers(0, longest), label="length")]
    else:
        lengths = [0] * draw(st.integers(0, 4), label="requests")
    return lengths
