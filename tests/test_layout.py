"""Hash constants and table layout (SPEC §2): golden values, exact primality, and speed."""

from __future__ import annotations

import time

import pytest

from qwen4exp_ext import layout

RELEASED_SIZES = [
    20000003,
    20000023,
    20000033,
    20000047,
    20000059,
    20000063,
    20000069,
    20000077,
    20000081,
    20000093,
    20000107,
    20000147,
    20000153,
    20000159,
    20000161,
    20000171,
]


def test_splitmix64_reference_values():
    # splitmix64 seeded with 0: the first outputs of Vigna's reference generator.
    state, outputs = 0, []
    for _ in range(3):
        outputs.append(layout.splitmix64(state))
        state = (state + layout.SPLITMIX_GAMMA) & layout.MASK64
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_released_multipliers():
    assert layout.layer_multipliers(248320, 3, 1234, 0) == [
        23703573157769,
        20109073645365,
        8052911324071,
    ]


def test_toy_multipliers_and_layout():
    assert layout.layer_multipliers(128, 3, 42, 0) == [
        62987067181621929,
        46389143539761089,
        16259569841195145,
    ]
    heads = layout.head_vocab_layout(1000, 4, 0, 128)
    assert heads.sizes == (1009, 1013, 1019, 1021)
    assert heads.offsets == (0, 1009, 2022, 3041)


def test_released_layout_in_under_a_second():
    start = time.perf_counter()
    heads = layout.head_vocab_layout(20_000_000, 16, 0, 128)
    elapsed = time.perf_counter() - start
    assert list(heads.sizes) == RELEASED_SIZES
    assert heads.total_rows == 320_001_446
    assert heads.padded_rows == 320_001_536
    assert heads.offsets[0] == 0 and heads.offsets[-1] == 320_001_446 - 20000171
    assert elapsed < 1.0, f"layout took {elapsed:.3f} s"


def test_later_layers_continue_the_prime_sequence():
    """Layer L's heads are the global heads L·NH..L·NH+NH-1: consecutive primes across layers."""
    l0 = layout.head_vocab_layout(1000, 4, 0, 1)
    l1 = layout.head_vocab_layout(1000, 4, 1, 1)
    both = layout.head_vocab_layout(1000, 8, 0, 1)
    assert l0.sizes + l1.sizes == both.sizes
    assert layout.layer_multipliers(128, 3, 42, 1) != layout.layer_multipliers(128, 3, 42, 0)


def trial_division_is_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def test_miller_rabin_matches_trial_division():
    for n in list(range(0, 20000)) + list(range(20_000_000, 20_002_000)):
        assert layout.is_prime(n) == trial_division_is_prime(n), n


@pytest.mark.parametrize(
    "n,expected",
    [
        (2**61 - 1, True),  # Mersenne prime
        (2**64 - 59, True),  # largest prime below 2^64
        (3215031751, False),  # strong pseudoprime to bases 2, 3, 5, 7
        (3825123056546413051, False),  # strong pseudoprime to the first 9 prime bases
    ],
)
def test_miller_rabin_hard_cases(n, expected):
    assert layout.is_prime(n) is expected


def test_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        layout.layer_multipliers(0, 3, 1, 0)
    with pytest.raises(ValueError, match="ngram_heads"):
        layout.head_vocab_layout(1000, 0, 0, 128)
    with pytest.raises(ValueError, match="pad_to"):
        layout.head_vocab_layout(1000, 4, 0, 0)
