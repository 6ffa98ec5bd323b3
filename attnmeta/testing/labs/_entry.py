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
    ``expected``'s rows, dtype and at least its columns, and that those leading columns equal it. With
    ``read``, row ``i`` is compared on its first ``read[i]`` entries only (a local-attention virtual
    row's entries past its chunk's blocks repeat the table's last column, whichever that is).

    Examples
    --------
    >>> import numpy as np, torch
    >>> want = LeadingColumns(torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), read=torch.tensor([2, 1]))
    >>> got, expected = want.leading(np.array([[1, 2, 7], [3, 9, 7]], np.int32))
    >>> got.tolist(), expected.tolist()
    ([[1, 2], [3, 0]], [[1, 2], [3, 0]])
    """

    value: torch.Tensor
    """(rows, used_columns), the field's dtype, on the reference's device."""
    read: torch.Tensor | None = None
    """(rows,) integer, any device, or None (every one of ``value``'s columns): the entries of each row
    that are compared."""

    def leading(self, got: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``got`` (a field's host values) cut to ``value``'s columns, with the entries past ``read`` set to
        the reference's, and ``value`` on the host (test code: reads the device back); None when ``got``
        is not 2-D with ``value``'s rows and at least its columns."""
        want = self.value.detach().cpu().numpy()
        if got.ndim != 2 or got.shape[0] != want.shape[0] or got.shape[1] < want.shape[1]:
            return None
        got = got[:, : want.shape[1]]
        if self.read is not None:
            unread = np.arange(want.shape[1])[None, :] >= self.read.detach().cpu().numpy()[:, None]
            got = np.where(unread, want, got).astype(got.dtype)
        return got, want


class LabEntry(NamedTuple):
    """A builder's lab functions, as :func:`attnmeta.testing.lab.register_lab` takes them."""

    reference: Reference | None = None
    sample: Sample | None = None
    defaults: Defaults | None = None
