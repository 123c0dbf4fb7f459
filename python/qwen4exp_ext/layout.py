"""Hash constants and table layout of one PLE layer (SPEC §2).

Everything here is exact integer arithmetic in Python ints (arbitrary precision), done once at
model build time. Checkpoints ship these values as buffers that overwrite the computed ones, so the
functions only have to agree with the published construction (golden values in SPEC §2, checked in
tests/test_layout.py against transformers 5.18).
"""

from __future__ import annotations

from typing import NamedTuple

from qwen4exp_ext._args import as_int

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
# Seeds of consecutive PLE layers are 10007 apart (a prime, so layers never share a stream).
PLE_LAYER_PRIME = 10007
INT64_MAX = (1 << 63) - 1
# The largest dense PLE layer index. Layer L's head sizes are the primes after the first L·NH
# primes >= ngram_vocab_size_base: a walk of L·NH primes, ~12 us each in Python (tests at B_v
# = 2e7), so the bound is what keeps a mistyped layer (10^6, 2^63) from running for minutes or
# forever. No model comes near it: the released model has 16 heads a layer and a few dozen
# layers; at this bound and its 16 heads the walk takes ~0.2 s.
MAX_LAYER_INDEX = 1023
# The walk's length bound for configs with many heads a layer (NH up to 1024, SPEC §3):
# (layer_index + 1) * NH global heads, ~1 s of walk at most.
MAX_GLOBAL_HEADS = 1 << 16


def check_layer_index(layer_index, name: str = "layer_index") -> int:
    """``layer_index`` as an int in [0, MAX_LAYER_INDEX]; raises naming ``name`` otherwise."""
    value = as_int(layer_index)
    if value is None:
        raise TypeError(f"{name} must be an integer, got {layer_index!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if value > MAX_LAYER_INDEX:
        raise ValueError(
            f"{name} must be <= {MAX_LAYER_INDEX}, got {value} (no model has that many PLE "
            "layers: the hash layout of a layer that far would take minutes to compute)"
        )
    return value


def splitmix64(x: int) -> int:
    """One splitmix64 step on an unsigned 64-bit value (all arithmetic mod 2^64)."""
    x = (x + SPLITMIX_GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * SPLITMIX_M1) & MASK64
    x = ((x ^ (x >> 27)) * SPLITMIX_M2) & MASK64
    return x ^ (x >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, seed: int, layer_index: int) -> list[int]:
    """The N odd hash multipliers m_0..m_{N-1} of dense PLE layer ``layer_index``.

    Each multiplier is bounded by (2^63-1) // vocab_size so that token·m_i stays below 2^63 for a
    single in-vocabulary token; the XOR of several such products is still taken mod 2^64.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if ngram_size < 1:
        raise ValueError(f"ngram_size must be >= 1, got {ngram_size}")
    layer_index = check_layer_index(layer_index)
    half = max(1, (INT64_MAX // vocab_size) // 2)
    base = seed + PLE_LAYER_PRIME * layer_index
    return [
        2 * (splitmix64((base + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half) + 1
        for i in range(ngram_size)
    ]


# Deterministic Miller–Rabin for all n < 2^64: these seven bases (Jim Sinclair, 2011) leave no
# strong pseudoprime below 2^64, so the test is exact on the whole int64 range.
_MR_BASES = (2, 325, 9375, 28178, 450775, 9780504, 1795265022)
_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact primality for 0 <= n < 2^64 (deterministic Miller–Rabin)."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        a %= n
        if a == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def nth_prime_at_or_above(start: int, n: int) -> int:
    """The n-th prime (n >= 1) that is >= ``start``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    candidate = max(start, 2)
    found = 0
    while True:
        if is_prime(candidate):
            found += 1
            if found == n:
                return candidate
        candidate += 1 if candidate == 2 else (2 if candidate % 2 else 1)


class HeadLayout(NamedTuple):
    """Rows of one PLE layer's table: head h owns rows [offsets[h], offsets[h] + sizes[h])."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total_rows: int
    padded_rows: int


def head_vocab_layout(
    ngram_vocab_size_base: int, ngram_heads: int, layer_index: int, pad_to: int
) -> HeadLayout:
    """Per-head prime sizes, their prefix-sum offsets, and the padded row count.

    Global head g = layer_index·NH + h gets the (g+1)-th prime >= ngram_vocab_size_base. The
    primes are consecutive, so one forward walk finds all NH of them.
    """
    if ngram_heads <= 0:
        raise ValueError(f"ngram_heads must be positive, got {ngram_heads}")
    if pad_to <= 0:
        raise ValueError(f"pad_to must be positive, got {pad_to}")
    layer_index = check_layer_index(layer_index)
    if (layer_index + 1) * ngram_heads > MAX_GLOBAL_HEADS:
        raise ValueError(
            f"layer_index {layer_index} with {ngram_heads} n-gram heads a layer: its heads are "
            f"past global head {MAX_GLOBAL_HEADS} (the hash layout's prime walk is bounded "
            "there; no model has that many)"
        )
    first_global = layer_index * ngram_heads
    p = nth_prime_at_or_above(ngram_vocab_size_base, first_global + 1)
    sizes = [p]
    while len(sizes) < ngram_heads:
        p = nth_prime_at_or_above(p + 1, 1)
        sizes.append(p)
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    padded = -(-total // pad_to) * pad_to
    return HeadLayout(tuple(sizes), tuple(offsets), total, padded)
