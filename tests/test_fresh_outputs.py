"""Fresh outputs of the CPU ops (issue #51 item 3, csrc/torch/fresh_output.h): an output the op
allocates (ple_gate's two; gather_rows', ngram_gather_rows' and ngram_ids' without ``output=``;
the hyper-connection ops' without ``out=``) of ``cpu_fresh_output_bytes()`` or more is a mapping
of its own, 2 MiB-aligned, made resident cheaply (on huge pages where THP allows, else
populated), and freed with the tensor into a bounded cache of resident mappings that the next
fresh output it fits takes.

Each op's functional outputs equal its ``out=`` outputs bit for bit with the fresh path forced
on (both modes, the cache off), off, and reusing cached mappings filled with 0xFF bytes (every op
writes all of its output: gather_rows' out-of-shard rows too); a forced-on output is its own
mapping and, with the cache off, leaves none behind when deleted; a large ple_gate output sits
on huge pages by default (the test seen failing before the fix: torch's allocator faulted it in
4 KiB at a time). The cache: a freed output returns to it and is taken again only by an output
it fits; it never holds more than its cap (nor more than its 64 slots); lowering the cap and
emptying it unmap; several threads at once never share a mapping; a forked child starts with an
empty cache and its parent keeps its own."""

from __future__ import annotations

import contextlib
import functools
import gc
import mmap
import os
import threading
import warnings

import pytest
import torch

from gather_support import CPU_PATHS, cpu_gather_path
from leak_support import nothing_left_behind
from ngram_gather_rows.support import make_batch
from ngram_support import HASHING_ARGS
from ple_gate.support import make_inputs
from qwen4exp_ext import cpu_tuning, ops
from qwen4exp_ext.tables.readers import madvise_range

HUGE_PAGE = 2 << 20
MODES = ("huge_pages", "populate")


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


@contextlib.contextmanager
def fresh(on: bool, mode: str | None = None, cache_bytes: int = 0):
    """The fresh path forced on (every output mapped, in ``mode``) or off (torch's allocator),
    the cache holding ``cache_bytes`` (0: off, every output a new mapping), empty to start."""
    bytes_before = cpu_tuning.set_cpu_fresh_output_bytes(0 if on else 2**62)
    mode_before = cpu_tuning.set_cpu_fresh_output_mode(mode)
    cpu_tuning.empty_fresh_output_cache()
    cache_before = cpu_tuning.set_cpu_fresh_output_cache_bytes(cache_bytes)
    try:
        yield
    finally:
        cpu_tuning.set_cpu_fresh_output_bytes(bytes_before)
        cpu_tuning.set_cpu_fresh_output_mode(mode_before)
        cpu_tuning.set_cpu_fresh_output_cache_bytes(cache_before)
        cpu_tuning.empty_fresh_output_cache()


def mapping_of(address: int) -> tuple[int, int] | None:
    """The [start, end) of the mapping of /proc/self/maps that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return start, end
    return None


def smaps_kb(start: int, field: str) -> int:
    """A field (``"LazyFree"``, ``"Rss"``...) of the mapping that starts at ``start`` (from
    /proc/self/smaps), in kB."""
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not found:
                fields = line.split()
                found = "-" in fields[0] and int(fields[0].split("-")[0], 16) == start
            elif line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {start:#x}")


def huge_page_kb(start: int) -> int:
    """AnonHugePages of the mapping that starts at ``start`` (/proc/self/smaps)."""
    return smaps_kb(start, "AnonHugePages")


def assert_own_mapping(t: torch.Tensor) -> None:
    """``t``'s storage is a mapping of its own starting at a 2 MiB boundary (the fresh path)."""
    span = mapping_of(t.data_ptr())
    assert span is not None and span[0] == t.data_ptr() and span[0] % HUGE_PAGE == 0, (
        f"output at {t.data_ptr():#x} is not a mapping of its own: {span}"
    )
    assert span[1] - span[0] >= t.untyped_storage().nbytes()


# Each call's builder returns the functional call (a thunk) and the op's outputs through out=.
def _gate(rounding):
    key, value, hidden, weights = make_inputs(48, 64, 4, torch.bfloat16, seed=3)
    args = (key, value, hidden, *weights, 1e-6)
    out = (torch.empty_like(hidden), torch.empty_like(hidden))
    ops.ple_gate(*args, rounding=rounding, out=out)
    return lambda: list(ops.ple_gate(*args, rounding=rounding)), list(out)


def _ngram():
    """The hashing arguments (positional, in HASHING_ARGS' order; ``args`` keeps the rest), a
    table."""
    args, rows = make_batch(3, 2, [5, 0, 13, 1, 40], torch.Generator().manual_seed(1), "cpu")
    positional = [args.pop(k) for k in HASHING_ARGS]
    table = torch.randn(rows, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    return positional, args, table


def _heads(positional) -> int:
    """NH: (N-1) context tokens times heads_per_ngram."""
    return positional[2].shape[-1] * positional[HASHING_ARGS.index("heads_per_ngram")]


def _ngram_ids():
    positional, args, _ = _ngram()
    input_ids = positional[0]
    out = torch.empty(input_ids.numel(), _heads(positional), dtype=torch.long)
    ops.ngram_ids(*positional, **args, output=out)
    return lambda: [ops.ngram_ids(*positional, **args)], [out]


def _shard(table: torch.Tensor, sharded: bool) -> tuple[torch.Tensor, dict]:
    """The table, or its middle third as a vocab shard (the other ids: zero rows)."""
    if not sharded:
        return table, {}
    start, end = table.shape[0] // 3, 2 * table.shape[0] // 3
    return table[start:end], {"vocab_start": start, "vocab_end": end}


def _gather_rows(sharded: bool = False):
    positional, args, table = _ngram()
    ids = torch.empty(positional[0].numel(), _heads(positional), dtype=torch.long)
    ops.ngram_ids(*positional, **args, output=ids)
    table, shard = _shard(table, sharded)
    out = torch.empty(ids.shape[0], ids.shape[1] * table.shape[1], dtype=table.dtype)
    ops.gather_rows(table, ids, **shard, output=out)
    return lambda: [ops.gather_rows(table, ids, **shard)], [out]


def _ngram_gather_rows(sharded: bool = False):
    positional, args, table = _ngram()
    table, shard = _shard(table, sharded)
    width = _heads(positional) * table.shape[1]
    out = torch.empty(positional[0].numel(), width, dtype=table.dtype)
    ops.ngram_gather_rows(*positional, table, **args, **shard, output=out)
    return lambda: [ops.ngram_gather_rows(*positional, table, **args, **shard)], [out]


def _hc(name: str):
    """One hyper-connection op (SPEC §10) called both ways, HC = 4 streams of H = 64."""
    g = torch.Generator().manual_seed(4)
    tokens, streams, width = 5, 4, 64
    residual = torch.randn(tokens, streams * width, generator=g).bfloat16()
    block = torch.randn(tokens, width, generator=g).bfloat16()
    logits = torch.randn(tokens, streams, generator=g).bfloat16()
    weight = torch.randn(width, generator=g).bfloat16()
    gate = torch.randn(tokens, streams * width, generator=g).bfloat16()
    lowrank = torch.randn(tokens, 12, generator=g).bfloat16()  # the fused projections' rank 12
    w_up = (torch.randn(streams * width, 12, generator=g) * 0.3).bfloat16()
    w_down = (torch.randn(12, streams * width, generator=g) * 0.1).bfloat16()
    w_inj = (torch.randn(streams, streams * width, generator=g) * 0.1).bfloat16()
    args, shapes = {
        "hc_combine_norm": ((residual, block, logits, weight, 1e-6, streams), [residual.shape] * 2),
        "hc_combine": ((residual, block, logits, streams), [residual.shape]),
        "grouped_gemma_rmsnorm": ((residual, weight, 1e-6, streams), [residual.shape]),
        "hc_gate_mix": ((residual, gate, streams), [block.shape]),
        "hc_silu": ((gate[:, :48], streams), [(tokens, 48)]),
        "hc_up_gate_mix": ((lowrank, w_up, residual, streams), [block.shape]),
        "hc_down_silu_inject": ((residual, w_down, w_inj, streams), [(tokens, 12), logits.shape]),
    }[name]
    op = getattr(ops, name)
    out = [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]
    op(*args, out=tuple(out) if len(out) > 1 else out[0])

    def call():
        got = op(*args)
        return list(got) if isinstance(got, tuple) else [got]

    return call, out


HC_OPS = ops._HC_OPS  # every hyper-connection op with an out= form (_hc's table must know it)

CALLS = {
    **{name: functools.partial(_hc, name) for name in HC_OPS},
    "ple_gate_vllm": lambda: _gate("vllm"),
    "ple_gate_fp32": lambda: _gate("fp32"),
    "ngram_ids": _ngram_ids,
    "gather_rows": _gather_rows,
    "gather_rows_shard": lambda: _gather_rows(sharded=True),
    "ngram_gather_rows": _ngram_gather_rows,
    "ngram_gather_rows_shard": lambda: _ngram_gather_rows(sharded=True),
}


def poison_cache(outputs: list[torch.Tensor]) -> set[int]:
    """Puts into the cache a mapping for each of ``outputs``' sizes, filled with 0xFF bytes (a
    byte pattern no op writes everywhere: bf16 NaN, int64 -1); returns their addresses."""
    held = [torch.ops.qwen4exp.empty_cpu_output(list(o.shape), o.dtype) for o in outputs]
    for t in held:
        t.view(torch.uint8).fill_(0xFF)
    return {t.data_ptr() for t in held}


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("mode", [*MODES, "off", "reused"])
def test_fresh_outputs_equal_the_out_outputs_bit_for_bit(op, mode):
    """With "reused" the outputs are cached mappings holding 0xFF bytes, which the op must
    overwrite everywhere (seen failing with a gather that skipped its out-of-shard rows)."""
    on = mode != "off"
    cache_bytes = 64 << 20 if mode == "reused" else 0
    with fresh(on, mode if mode in MODES else None, cache_bytes=cache_bytes):
        call, want = CALLS[op]()
        poisoned = poison_cache(want) if mode == "reused" else set()
        got = call()
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), op
            if on:
                assert_own_mapping(g)
            else:
                span = mapping_of(g.data_ptr())
                assert span is None or span[0] != g.data_ptr() or g.numel() == 0
        if mode == "reused":
            assert {g.data_ptr() for g in got} == poisoned, "the cached mappings were not reused"


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("op", ["gather_rows_shard", "ngram_gather_rows_shard"])
def test_every_gather_path_writes_the_zero_rows_of_a_reused_output(op, path):
    """The rows of ids outside the vocab shard are written as zeros on every CPU gather path,
    so a reused output (0xFF bytes) holds no former output's bytes."""
    with fresh(True, cache_bytes=64 << 20), cpu_gather_path(path):
        call, want = CALLS[op]()
        poisoned = poison_cache(want)
        got = call()
        assert {g.data_ptr() for g in got} == poisoned
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (op, path)


@pytest.mark.parametrize("mode", MODES)
def test_a_fresh_output_unmaps_when_freed(mode):
    """Deleting the output (and a resize_ past it, which moves it to torch's memory) leaves no
    mapping behind, and no descriptor, file mapping or thread."""
    with nothing_left_behind(), fresh(True, mode):
        out = torch.ops.qwen4exp.empty_cpu_output([3 * HUGE_PAGE + 5], torch.uint8)
        out.fill_(7)
        start = out.data_ptr()
        assert_own_mapping(out)
        del out
        gc.collect()
        assert mapping_of(start) is None or mapping_of(start)[0] != start
        moved = torch.ops.qwen4exp.empty_cpu_output([HUGE_PAGE], torch.uint8).fill_(3)
        start = moved.data_ptr()
        moved.resize_(4 * HUGE_PAGE)
        assert moved.data_ptr() != start and bool((moved[:HUGE_PAGE] == 3).all())
        assert mapping_of(start) is None or mapping_of(start)[0] != start
        del moved


@pytest.mark.skipif(not _thp_enabled(), reason="transparent huge pages are 'never' here")
def test_a_large_ple_gate_output_sits_on_huge_pages_by_default():
    """At the default settings a 32 MiB ple_gate output (fp32 [1024, 8192]) is faulted in on
    2 MiB pages. Seen failing before the fix: torch's allocator gave it 4 KiB pages (0 kB of
    AnonHugePages in its mapping)."""
    key, value, hidden, weights = make_inputs(1024, 2048, 4, torch.float32, seed=1)
    cpu_tuning.empty_fresh_output_cache()  # new mappings, not ones an earlier test left
    gated, conv_input = ops.ple_gate(key, value, hidden, *weights, 1e-6)
    for out in (gated, conv_input):
        span = mapping_of(out.data_ptr())
        assert span is not None
        huge_kb, kb = huge_page_kb(span[0]), out.untyped_storage().nbytes() // 1024
        assert huge_kb >= kb // 2, f"{huge_kb} kB of {kb} kB on huge pages"


def test_the_settings_are_checked_and_restored():
    before = cpu_tuning.cpu_fresh_output_bytes()
    assert cpu_tuning.set_cpu_fresh_output_bytes(123) is None
    assert cpu_tuning.cpu_fresh_output_bytes() == 123
    assert cpu_tuning.set_cpu_fresh_output_bytes(None) == 123
    assert cpu_tuning.cpu_fresh_output_bytes() == before == 32 << 20
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="set_cpu_fresh_output_bytes: fresh_bytes must be"):
            cpu_tuning.set_cpu_fresh_output_bytes(bad)
    default = cpu_tuning.cpu_fresh_output_mode()
    assert default == ("huge_pages" if _thp_enabled() else "populate")
    assert cpu_tuning.set_cpu_fresh_output_mode("populate") is None
    assert cpu_tuning.cpu_fresh_output_mode() == "populate"
    assert cpu_tuning.set_cpu_fresh_output_mode(None) == "populate"
    with pytest.raises(ValueError, match="set_cpu_fresh_output_mode: mode must be"):
        cpu_tuning.set_cpu_fresh_output_mode("hugepages")
    cap = cpu_tuning.cpu_fresh_output_cache_bytes()
    assert 0 < cap <= 512 << 20
    assert cpu_tuning.set_cpu_fresh_output_cache_bytes(4096) is None
    assert cpu_tuning.cpu_fresh_output_cache_bytes() == 4096
    assert cpu_tuning.set_cpu_fresh_output_cache_bytes(None) == 4096
    assert cpu_tuning.cpu_fresh_output_cache_bytes() == cap
    for bad in (-1, 1.5, True, "1", 2**63):
        with pytest.raises(ValueError, match="set_cpu_fresh_output_cache_bytes: cache_bytes must"):
            cpu_tuning.set_cpu_fresh_output_cache_bytes(bad)
    with pytest.raises(ValueError, match="empty_cpu_output: size must be >= 0"):
        torch.ops.qwen4exp.empty_cpu_output([-1], torch.uint8)


def test_an_out_dtype_that_is_no_dtype_raises_torchs_type_error_as_before():
    """The doors' allocation reads the dtype's size: an ``out_dtype`` that is no torch.dtype
    still gets torch.empty's TypeError, which names the argument (seen failing before the fix:
    AttributeError: 'str' object has no attribute 'itemsize')."""
    table = torch.randn(10, 4)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="argument 'dtype' must be torch.dtype"):
        ops.gather_rows(table, ids, out_dtype="bf16")


# ---- the cache of released mappings --------------------------------------------------------

PAGE = os.sysconf("SC_PAGESIZE")


def _mapped(nbytes: int) -> int:
    """The length of the mapping of a fresh output of ``nbytes`` bytes: page-rounded."""
    return -(-nbytes // PAGE) * PAGE


def _new(nbytes: int) -> torch.Tensor:
    return torch.ops.qwen4exp.empty_cpu_output([nbytes], torch.uint8)


def _unmapped(address: int) -> bool:
    span = mapping_of(address)
    return span is None or span[0] != address


def test_a_freed_output_returns_to_the_cache_and_only_an_output_it_fits_takes_it():
    size = 4 * HUGE_PAGE - 5  # mapped: 4 huge pages, an even number of pages
    with fresh(True, cache_bytes=64 << 20):
        out = _new(size).fill_(7)
        start = out.data_ptr()
        del out
        assert cpu_tuning.fresh_output_cache_held() == (_mapped(size), 1)
        assert not _unmapped(start)  # kept, resident
        # Neither an output of half its size or less, nor a larger one, takes it.
        small, large = _new(_mapped(size) // 2), _new(_mapped(size) + 1)
        assert start not in (small.data_ptr(), large.data_ptr())
        assert cpu_tuning.fresh_output_cache_held() == (_mapped(size), 1)
        # One of its size (and one over half of it) does, as it is: the former bytes are there.
        again = _new(size)
        assert again.data_ptr() == start and int(again[0]) == 7
        assert cpu_tuning.fresh_output_cache_held() == (0, 0)
        del again, small, large
        nearly = _new(_mapped(size) // 2 + 1)
        assert nearly.data_ptr() == start and nearly.untyped_storage().nbytes() < size
        del nearly
        held = cpu_tuning.fresh_output_cache_held()[0]
        assert cpu_tuning.empty_fresh_output_cache() == held > _mapped(size)
        assert cpu_tuning.fresh_output_cache_held() == (0, 0) and _unmapped(start)


# Linux 5.4: reclaim these pages now, as memory pressure would.
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)


def test_a_cached_mapping_is_the_kernels_to_take_back_and_serves_again_when_taken():
    """A mapping in the cache is MADV_FREE: its pages count as LazyFree, which the kernel may
    reclaim under memory pressure instead of anything else. Until it does, the next output finds
    them resident and writing them makes them the process's again; once taken back (forced here
    with MADV_PAGEOUT), the next output gets the same mapping, zero-filled, and writes it."""
    size = 4 * HUGE_PAGE
    with fresh(True, cache_bytes=64 << 20):
        out = _new(size).fill_(7)
        start = out.data_ptr()
        resident_kb = smaps_kb(start, "Rss")
        assert resident_kb * 1024 >= size
        del out
        assert smaps_kb(start, "LazyFree") == resident_kb
        again = _new(size)
        assert again.data_ptr() == start and int(again[0]) == 7
        again.fill_(5)
        assert smaps_kb(start, "LazyFree") == 0  # written: the process's again
        del again
        try:
            madvise_range(start, _mapped(size), MADV_PAGEOUT)
        except OSError as error:
            pytest.skip(f"MADV_PAGEOUT refused ({error}): a kernel before 5.4")
        assert smaps_kb(start, "Rss") == 0  # taken back, not swapped: nothing was dirty
        third = _new(size)
        assert third.data_ptr() == start and not bool(third.any())
        third.fill_(9)
        assert bool((third == 9).all()) and smaps_kb(start, "LazyFree") == 0
        del third


def test_the_cache_never_holds_more_than_its_cap():
    cap = 5 * HUGE_PAGE
    with fresh(True, cache_bytes=cap):
        first, second, third = (_new(2 * HUGE_PAGE) for _ in range(3))
        starts = [t.data_ptr() for t in (first, second, third)]
        del first  # freed in this order: the first is dropped for the third
        del second
        del third
        assert cpu_tuning.fresh_output_cache_held() == (4 * HUGE_PAGE, 2)
        assert _unmapped(starts[0]) and not _unmapped(starts[1]) and not _unmapped(starts[2])
        over = _new(cap + 1)
        start = over.data_ptr()
        del over  # past the cap: unmapped at once
        assert _unmapped(start) and cpu_tuning.fresh_output_cache_held() == (4 * HUGE_PAGE, 2)
        # Lowering the cap unmaps the oldest until the rest fits; 0 turns the cache off.
        assert cpu_tuning.set_cpu_fresh_output_cache_bytes(3 * HUGE_PAGE) == cap
        assert cpu_tuning.fresh_output_cache_held() == (2 * HUGE_PAGE, 1)
        assert _unmapped(starts[1]) and not _unmapped(starts[2])
        cpu_tuning.set_cpu_fresh_output_cache_bytes(0)
        assert cpu_tuning.fresh_output_cache_held() == (0, 0) and _unmapped(starts[2])
        off = _new(PAGE)
        start = off.data_ptr()
        del off
        assert _unmapped(start) and cpu_tuning.fresh_output_cache_held() == (0, 0)
        # At most 64 mappings, however small: the oldest go first.
        cpu_tuning.set_cpu_fresh_output_cache_bytes(1 << 30)
        small = [_new(PAGE) for _ in range(70)]
        del small
        assert cpu_tuning.fresh_output_cache_held() == (64 * PAGE, 64)


def test_threads_never_share_a_cached_mapping():
    """Four threads allocate, fill, check and free outputs of several sizes at once through a
    small cache: the op call releases the GIL, so takes from the cache race each other and the
    frees. A stress test: with the mutex taken out it failed in about one run of four."""
    cap = 64 * PAGE
    errors: list[str] = []

    def work(value: int) -> None:
        for i in range(600):
            t = _new(PAGE * (1 + (i * 7 + value) % 5))
            t.fill_(value)
            if not bool((t == value).all()):
                errors.append(f"thread {value}: another thread wrote its output")
            del t

    with fresh(True, cache_bytes=cap):
        threads = [threading.Thread(target=work, args=(v,)) for v in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        held, count = cpu_tuning.fresh_output_cache_held()
        assert not errors and 0 < held <= cap and count <= 64
        assert cpu_tuning.empty_fresh_output_cache() == held


def test_a_forked_child_starts_with_an_empty_cache_and_the_parent_keeps_its_own():
    with fresh(True, cache_bytes=64 << 20):
        cached = _new(2 * HUGE_PAGE).fill_(1)
        start = cached.data_ptr()
        del cached
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
            pid = os.fork()
        if pid == 0:  # the child: its copy unmapped, its own outputs cached and freed as usual
            code = 1
            try:
                empty = cpu_tuning.fresh_output_cache_held() == (0, 0) and _unmapped(start)
                t = _new(2 * HUGE_PAGE)
                mine = t.data_ptr()
                del t
                reused = _new(2 * HUGE_PAGE).data_ptr() == mine
                code = 0 if empty and reused else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert cpu_tuning.fresh_output_cache_held() == (2 * HUGE_PAGE, 1)
        assert _new(2 * HUGE_PAGE).data_ptr() == start
