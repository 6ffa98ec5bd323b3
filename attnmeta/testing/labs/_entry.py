"""The lab entry type: a builder's reference, sample and defaults functions (any may be None)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from attnmeta.spec import BatchSpec

__all__ = ["Defaults", "LabEntry", "LeadingColumns", "Reference", "Sample"]

Reference = Callable[[BatchSpec, Any, torch.device, Any], "dict[str, Any]"]
"""``reference(spec, options, device, inputs) -> {field: expected value}``."""
Sample = Callable[[BatchSpec, np.random.Generator], "tuple[Any, Any]"]
"""``sample(spec, rng) -> (options, inputs)``."""
Defaults = Callable[[BatchSpec], "tuple[Any, Any]"]
"""``defaults(spec) -> (options, inputs)``."""


class LeadingColumns(NamedTuple):
    """A reference value for a 2-D device field whose width follows the staging, not the batch.

    A block table's rows have as many columns as the stager gives them (an eager step the longest
    request's blocks, a graph-mode one its profile's ``max_blocks_per_req``); kernels read each row's
    first ``cdiv(seq_len, block_size)`` entries. A reference returns ``LeadingColumns(expected)`` for
    such a field: :func:`attnmeta.testing.check_builder` asserts that the field (and its host twin) has
    ``expected``'s rows, dtype and at least its columns, and that those leading columns equal it.

    Examples
    --------
    >>> import torch
    >>> LeadingColumns(torch.zeros(2, 3, dtype=torch.int32)).value.shape
    torch.Size([2, 3])
    """

    value: torch.Tensor
    """(rows, used_columns), the field's dtype, on the reference's device."""


class LabEntry(NamedTuple):
    """A builder's lab functions, as :func:`attnmeta.testing.lab.register_lab` takes them."""

    reference: Reference | None = None
    sample: Sample | None = None
    defaults: Defaults | None = None
