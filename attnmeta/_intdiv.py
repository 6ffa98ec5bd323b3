"""Integer division by a block size in compiled loops, without a divide instruction when it can.

A 64-bit integer division costs tens of cycles (up to ~45 on some x86 cores); a step's kernels
divide by the block size a few times per request row (pages, last page, column of a token). Block
sizes are powers of two in practice, and then a shift and a mask give the same results. Each kernel
computes :func:`pow2_shift` once per call and passes it to the helpers below, which fall back to the
division for any other divisor. The results equal Python's floor division and modulo for every
integer, negative ones included (an arithmetic right shift floors; ``x & (d - 1)`` is the
non-negative remainder).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnmeta._numba import njit

__all__ = ["cdiv_by", "div_by", "mod_by", "pow2_shift"]

Int = int | np.integer[Any]
"""A Python or numpy integer (inside a kernel every integer is a machine int)."""


@njit
def pow2_shift(d: Int) -> int:
    """``log2(d)`` if ``d`` (>= 1) is a power of two, else -1 (the helpers then divide)."""
    if d < 1 or d & (d - 1):
        return -1
    s = 0
    while (1 << s) < d:
        s += 1
    return s


@njit
def div_by(x: Int, d: Int, sh: int) -> Int:
    """``x // d``, with ``sh = pow2_shift(d)``."""
    return x >> sh if sh >= 0 else x // d


@njit
def mod_by(x: Int, d: Int, sh: int) -> Int:
    """``x % d`` (Python's sign rule: in ``[0, d)``), with ``sh = pow2_shift(d)``."""
    return x & (d - 1) if sh >= 0 else x % d


@njit
def cdiv_by(x: Int, d: Int, sh: int) -> Int:
    """``ceil(x / d) = (x + d - 1) // d``, with ``sh = pow2_shift(d)``."""
    return (x + d - 1) >> sh if sh >= 0 else (x + d - 1) // d
