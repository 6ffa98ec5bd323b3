"""Staging: the pinned ring, the one-copy step, graph-stable arenas, and device-side helpers."""

from attnmeta.staging.helpers import DeviceIndexCache, pad_out
from attnmeta.staging.staged import Staged
from attnmeta.staging.stager import (
    STAGEABLE_DTYPES,
    CapacityError,
    FieldGroup,
    FieldLayout,
    Stager,
    StagerStats,
    Step,
    StepExpiredError,
    StepLayout,
    StepNotCommittedError,
    StepStats,
    bucket_rows,
    is_expired,
)

__all__ = [
    "STAGEABLE_DTYPES",
    "CapacityError",
    "DeviceIndexCache",
    "FieldGroup",
    "FieldLayout",
    "Staged",
    "Stager",
    "StagerStats",
    "Step",
    "StepExpiredError",
    "StepLayout",
    "StepNotCommittedError",
    "StepStats",
    "bucket_rows",
    "is_expired",
    "pad_out",
]
