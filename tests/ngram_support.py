"""The toy n-gram config the layer tests share (tests/test_ngram_embedding.py,
tests/test_bad_inputs.py, tests/test_sharding.py), and its table's layout."""

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


def spy_on_ngram_ids(monkeypatch) -> list:
    """Records the head_divmod of every ops.ngram_ids call (and still runs it)."""
    from qwen4exp_ext import ops

    seen = []
    real = ops.ngram_ids

    def spy(*args, head_divmod=None, **kwargs):
        seen.append(head_divmod)
        return real(*args, head_divmod=head_divmod, **kwargs)

    monkeypatch.setattr(ops, "ngram_ids", spy)
    return seen
