"""Staging: the pinned ring, the one-copy step, graph-stable arenas, and device-side helpers."""

from attnmeta.staging.helpers import DeviceIndexCache, pad_out
from attnmeta.staging.stager import (
    CapacityError,
    FieldGroup,
    Stager,
    StagerStats,
    Step,
    StepExpiredError,
    StepNotCommittedError,
    StepStats,
)

__all__ = [
    "CapacityError",
    "DeviceIndexCache",
    "FieldGroup",
    "Stager",
    "StagerStats",
    "Step",
    "StepExpiredError",
    "StepNotCommittedError",
    "StepStats",
    "pad_out",
]
