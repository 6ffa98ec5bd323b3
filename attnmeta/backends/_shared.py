"""Pieces every backend builder uses: indptr staging, and the read-only views a replaying builder hands out
(the same-step check is :func:`attnmeta.builder.require_same_step`).

Private to :mod:`attnmeta.backends`; one definition each, so the backends cannot drift apart.
"""

from __future__ import annotations

from typing import overload

import numpy as np

from attnmeta.staging import CapacityError, Step

__all__ = ["alloc_indptr", "read_only_view"]


def alloc_indptr(step: Step, name: str, rows: int, capacity: int | None) -> np.ndarray:
    """Stage an int32 indptr for ``rows`` rows; returns its *full* host view.

    Eager mode: ``rows + 1`` entries. Graph mode (``capacity`` rows): all ``capacity + 1`` entries,
    because the sentinel (the last value, repeated) depends on the data; the caller fills
    ``full[:rows + 1]`` and then ``full[rows + 1:] = full[rows]``.

    Raises
    ------
    CapacityError
        Graph mode: ``rows > capacity``.
    """
    if capacity is None:
        return step.alloc(name, rows + 1, np.int32)
    if rows > capacity:
        raise CapacityError(f"{name}: needs {rows + 1} entries but its graph-mode capacity is {capacity + 1}")
    return step.alloc(name, capacity + 1, np.int32, capacity=capacity + 1)


@overload
def read_only_view(a: np.ndarray) -> np.ndarray: ...
@overload
def read_only_view(a: None) -> None: ...
def read_only_view(a: np.ndarray | None) -> np.ndarray | None:
    """A read-only view of ``a``, the same memory (None for None): what a builder's metadata holds of a
    field it staged, while the writable view stays with the builder for a replay to rewrite."""
    if a is None:
        return None
    ro = a.view()
    ro.flags.writeable = False
    return ro
