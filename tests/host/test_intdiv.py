"""The shift-or-divide helpers of the compiled kernels (attnmeta._intdiv) against Python's operators."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from attnmeta._intdiv import cdiv_by, div_by, mod_by, pow2_shift

_DIVISORS = st.one_of(st.sampled_from([1, 2, 4, 16, 64, 1024, 3, 6, 12, 48, 528]), st.integers(1, 1 << 20))


def test_pow2_shift_is_log2_of_powers_of_two_and_minus_one_otherwise() -> None:
    for k in range(40):
        assert pow2_shift(1 << k) == k
    for d in (0, -4, 3, 6, 12, 24, 48, 96, 528, (1 << 20) + 1):
        assert pow2_shift(d) == -1


@given(x=st.integers(-(1 << 40), 1 << 40), d=_DIVISORS)
def test_helpers_equal_pythons_floor_division_and_modulo(x: int, d: int) -> None:
    sh = pow2_shift(d)
    assert div_by(x, d, sh) == x // d
    assert mod_by(x, d, sh) == x % d
    assert cdiv_by(x, d, sh) == (x + d - 1) // d
    if x >= 0:
        assert cdiv_by(x, d, sh) == -(-x // d)
