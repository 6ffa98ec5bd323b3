"""Staging: the pinned ring, the one-copy step, graph-stable arenas, several devices, and device-side helpers."""

from attnmeta.staging.helpers import DeviceIndexCache, pad_out
from attnmeta.staging.multi import DeviceStats, MultiStager, NotReplicableError
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
    UncheckedBlockIdsWarning,
    bucket_rows,
    is_expired,
)

__all__ = [
    "STAGEABLE_DTYPES",
    "CapacityError",
    "DeviceIndexCache",
    "DeviceStats",
    "FieldGroup",
    "FieldLayout",
    "MultiStager",
    "NotReplicableError",
    "Staged",
    "Stager",
    "StagerStats",
    "Step",
    "StepExpiredError",
    "StepLayout",
    "StepNotCommittedError",
    "StepStats",
    "UncheckedBlockIdsWarning",
    "bucket_rows",
    "is_expired",
    "pad_out",
]
