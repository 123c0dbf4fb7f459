"""The toy n-gram config the layer tests share (tests/test_ngram_embedding.py,
tests/test_load_weights.py, tests/test_sharding.py), and its table's layout."""

from __future__ import annotations

from types import SimpleNamespace

from qwen4exp_ext import layout

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
