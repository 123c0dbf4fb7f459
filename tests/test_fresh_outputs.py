"""Fresh outputs of the CPU ops (issue #51 item 3, csrc/torch/fresh_output.h): an output the op
allocates (ple_gate's two; gather_rows', ngram_gather_rows' and ngram_ids' without ``output=``;
the hyper-connection ops' without ``out=``) of ``cpu_fresh_output_bytes()`` or more is a mapping
of its own, 2 MiB-aligned, made resident cheaply (on huge pages where THP allows, else
populated), and freed with the tensor.

Each op's functional outputs equal its ``out=`` outputs bit for bit with the fresh path forced
on (both modes) and off; a forced-on output is its own mapping and leaves none behind when
deleted; a large ple_gate output sits on huge pages by default (the test seen failing before
the fix: torch's allocator faulted it in 4 KiB at a time)."""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch

from leak_support import nothing_left_behind
from ngram_gather_rows.support import make_batch
from ngram_support import HASHING_ARGS
from ple_gate.support import make_inputs
from qwen4exp_ext import cpu_tuning, ops

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
def fresh(on: bool, mode: str | None = None):
    """The fresh path forced on (every output mapped, in ``mode``) or off (torch's allocator)."""
    bytes_before = cpu_tuning.set_cpu_fresh_output_bytes(0 if on else 2**62)
    mode_before = cpu_tuning.set_cpu_fresh_output_mode(mode)
    try:
        yield
    finally:
        cpu_tuning.set_cpu_fresh_output_bytes(bytes_before)
        cpu_tuning.set_cpu_fresh_output_mode(mode_before)


def mapping_of(address: int) -> tuple[int, int] | None:
    """The [start, end) of the mapping of /proc/self/maps that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return start, end
    return None


def huge_page_kb(start: int) -> int:
    """AnonHugePages of the mapping that starts at ``start`` (/proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not found:
                fields = line.split()
                found = "-" in fields[0] and int(fields[0].split("-")[0], 16) == start
            elif line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {start:#x}")


def assert_own_mapping(t: torch.Tensor) -> None:
    """``t``'s storage is a mapping of its own starting at a 2 MiB boundary (the fresh path)."""
    span = mapping_of(t.data_ptr())
    assert span is not None and span[0] == t.data_ptr() and span[0] % HUGE_PAGE == 0, (
        f"output at {t.data_ptr():#x} is not a mapping of its own: {span}"
    )
    assert span[1] - span[0] >= t.untyped_storage().nbytes()


def _gate(rounding):
    key, value, hidden, weights = make_inputs(48, 64, 4, torch.bfloat16, seed=3)
    args = (key, value, hidden, *weights, 1e-6)
    out = (torch.empty_like(hidden), torch.empty_like(hidden))
    ops.ple_gate(*args, rounding=rounding, out=out)
    return list(ops.ple_gate(*args, rounding=rounding)), list(out)


def _ngram():
    args, rows = make_batch(3, 2, [5, 0, 13, 1, 40], torch.Generator().manual_seed(1), "cpu")
    positional = [args.pop(k) for k in HASHING_ARGS]
    table = torch.randn(rows, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    return positional, args, table


def _ngram_ids():
    positional, args, _ = _ngram()
    want = ops.ngram_ids(*positional, **args)  # into a buffer allocated here, below
    out = torch.empty_like(want)
    ops.ngram_ids(*positional, **args, output=out)
    return [ops.ngram_ids(*positional, **args)], [out]


def _gather_rows():
    positional, args, table = _ngram()
    ids = ops.ngram_ids(*positional, **args).clone()
    out = torch.empty(ids.shape[0], ids.shape[1] * table.shape[1], dtype=table.dtype)
    ops.gather_rows(table, ids, output=out)
    return [ops.gather_rows(table, ids)], [out]


def _ngram_gather_rows():
    positional, args, table = _ngram()
    fresh_rows = ops.ngram_gather_rows(*positional, table, **args)
    out = torch.empty_like(fresh_rows)
    ops.ngram_gather_rows(*positional, table, **args, output=out)
    return [ops.ngram_gather_rows(*positional, table, **args)], [out]


def _hc(name: str):
    """One hyper-connection op (SPEC §10) called both ways, HC = 4 streams of H = 64."""
    g = torch.Generator().manual_seed(4)
    tokens, streams, width = 5, 4, 64
    residual = torch.randn(tokens, streams * width, generator=g).bfloat16()
    block = torch.randn(tokens, width, generator=g).bfloat16()
    logits = torch.randn(tokens, streams, generator=g).bfloat16()
    weight = torch.randn(width, generator=g).bfloat16()
    gate = torch.randn(tokens, streams * width, generator=g).bfloat16()
    args = {
        "hc_combine_norm": (residual, block, logits, weight, 1e-6, streams),
        "hc_combine": (residual, block, logits, streams),
        "grouped_gemma_rmsnorm": (residual, weight, 1e-6, streams),
        "hc_gate_mix": (residual, gate, streams),
        "hc_silu": (gate[:, :48], streams),
    }[name]
    op = getattr(ops, name)
    got = op(*args)
    got = list(got) if isinstance(got, tuple) else [got]
    want = [torch.empty_like(x) for x in got]
    op(*args, out=tuple(want) if len(want) > 1 else want[0])
    return got, want


HC_OPS = ("hc_combine_norm", "hc_combine", "grouped_gemma_rmsnorm", "hc_gate_mix", "hc_silu")

CALLS = {
    **{name: functools.partial(_hc, name) for name in HC_OPS},
    "ple_gate_vllm": lambda: _gate("vllm"),
    "ple_gate_fp32": lambda: _gate("fp32"),
    "ngram_ids": _ngram_ids,
    "gather_rows": _gather_rows,
    "ngram_gather_rows": _ngram_gather_rows,
}


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("mode", [*MODES, "off"])
def test_fresh_outputs_equal_the_out_outputs_bit_for_bit(op, mode):
    with fresh(mode != "off", None if mode == "off" else mode):
        got, want = CALLS[op]()
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), op
            if mode != "off":
                assert_own_mapping(g)
            else:
                span = mapping_of(g.data_ptr())
                assert span is None or span[0] != g.data_ptr() or g.numel() == 0


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
