"""The lab entry type: a builder's reference, sample and defaults functions (any may be None)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from attnmeta.spec import BatchSpec

__all__ = ["Defaults", "LabEntry", "Reference", "Sample"]

Reference = Callable[[BatchSpec, Any, torch.device, Any], "dict[str, Any]"]
"""``reference(spec, options, device, inputs) -> {field: expected value}``."""
Sample = Callable[[BatchSpec, np.random.Generator], "tuple[Any, Any]"]
"""``sample(spec, rng) -> (options, inputs)``."""
Defaults = Callable[[BatchSpec], "tuple[Any, Any]"]
"""``defaults(spec) -> (options, inputs)``."""


class LabEntry(NamedTuple):
    """A builder's lab functions, as :func:`attnmeta.testing.lab.register_lab` takes them."""

    reference: Reference | None = None
    sample: Sample | None = None
    defaults: Defaults | None = None
