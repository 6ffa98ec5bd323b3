"""Pieces every backend builder uses: the same-step check and indptr staging.

Private to :mod:`attnmeta.backends`; one definition each, so the backends cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnmeta.metadata import CommonAttentionMetadata, StagedCommon
from attnmeta.staging import CapacityError, Step

__all__ = ["alloc_indptr", "require_same_step"]


def require_same_step(common: Any, step: Step) -> None:
    """Raise unless ``common`` is a :class:`~attnmeta.StagedCommon` staged into ``step``.

    Every backend's ``stage`` calls it when its cheap inline test fails (``type(common) is not
    StagedCommon or common.step is not step``); a subclass of ``StagedCommon`` staged into ``step``
    passes. A backend's device views and the common metadata's must come from one upload.

    Raises
    ------
    TypeError
        ``common`` is not a ``StagedCommon`` (the metadata object itself, a spec, None, ...).
    ValueError
        ``common`` was staged into another step.
    """
    if not isinstance(common, StagedCommon):
        what = type(common).__name__
        hint = (" (pass the StagedCommon that stage_common returned, not its .result())"
                if isinstance(common, CommonAttentionMetadata) else "")
        raise TypeError(
            f"common: expected the StagedCommon of this step (from attnmeta.stage_common(spec, step)), got {what}{hint}"
        )
    if common.step is not step:
        raise ValueError(
            "common: staged in another step; stage the common metadata and this backend into the same step "
            "(their device views come from one upload)"
        )


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
