"""The toy n-gram config the layer tests share (tests/test_ngram_embedding.py,
tests/test_load_weights.py, tests/test_sharding.py), and its table's layout; the CPU hash widths
that the ngram_ids and ngram_gather_rows tests run each kernel test on."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from qwen4exp_ext import layout, ops

CONFIG = SimpleNamespace(
    vocab_size=97,
    ngram_size=3,
    heads_per_ngram=2,
    ple_embed_dim=24,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=16,
    eos_token_id=5,
    seed=7,
    split_ngram_parts=7,
)
HEADS = layout.head_vocab_layout(50, 4, 1, 16)  # 4 heads = (N-1)=2 x heads_per_ngram=2
ROWS = HEADS.padded_rows
HEAD_DIM = 6  # ple_embed_dim / 4 heads
SHARD_ROWS = -(-ROWS // 7)  # rows of each of the checkpoint's split_ngram_parts shards


# ngram_ids' arguments before its output, in order (ngram_gather_rows takes them first too).
HASHING_ARGS = (
    "input_ids",
    "query_start_loc",
    "ngram_context",
    "layer_multipliers",
    "ngram_heads_vocab_sizes",
    "ngram_heads_offsets",
    "eos_token_id",
    "heads_per_ngram",
)


def spy_on_ngram_ids(monkeypatch) -> list:
    """Records the head_divmod of every call that hashes n-grams, ops.ngram_ids or the fused
    ops.ngram_gather_rows (and still runs it)."""
    from qwen4exp_ext import ops

    seen = []
    for name in ("ngram_ids", "ngram_gather_rows"):
        real = getattr(ops, name)

        def spy(*args, head_divmod=None, _real=real, **kwargs):
            seen.append(head_divmod)
            return _real(*args, head_divmod=head_divmod, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    return seen


@contextlib.contextmanager
def cpu_ngram_hash(isa: str | None):
    """Within the block the CPU n-gram hash (ngram_ids, and ngram_gather_rows' hashing) runs in
    ``isa``, one of CPU_HASH_ISAS; None leaves the setting as it is (a backend other than the
    CPU's)."""
    if isa is None:
        yield
        return
    previous = ops.set_cpu_ngram_hash_isa(isa)
    try:
        yield
    finally:
        ops.set_cpu_ngram_hash_isa(previous)


def _cpu_hash_isas() -> list[str]:
    found = []
    for isa in ("scalar", "avx2", "avx512"):
        try:
            with cpu_ngram_hash(isa):
                found.append(isa)
        except ValueError:
            pass
    return found


# The CPU hash widths this CPU has: by default the kernel runs only the widest, so each is pinned
# in turn to test them all on one machine.
CPU_HASH_ISAS = _cpu_hash_isas()


def hash_cases(found) -> list:
    """(backend, CPU hash width or None) params of the backends `found`: the CPU kernel once per
    width this CPU has ("cpu-avx2"), every other backend once, as it is."""
    cases = []
    for backend in found:
        if backend.name == "cpu":
            cases += [pytest.param(backend, isa, id=f"cpu-{isa}") for isa in CPU_HASH_ISAS]
        else:
            cases.append(pytest.param(backend, None, id=backend.name))
    return cases


def pinned_hash_width(request):
    """The context of a test parametrised by hash_cases: its "isa" parameter pinned (checked to
    be what runs), or nothing for a test or backend without one."""
    callspec = getattr(request.node, "callspec", None)
    isa = callspec.params.get("isa") if callspec is not None else None
    return _pinned(isa)


@pytest.fixture
def hash_width(request):
    """A hash_cases test in its CPU hash width; a module runs all of its tests so with
    ``pytestmark = pytest.mark.usefixtures("hash_width")``, so that their bodies stay as they
    are."""
    with pinned_hash_width(request):
        yield


@contextlib.contextmanager
def _pinned(isa: str | None):
    with cpu_ngram_hash(isa):
        assert isa is None or ops.cpu_ngram_hash_isa() == isa
        yield
