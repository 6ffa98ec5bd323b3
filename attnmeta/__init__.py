"""attnmeta: attention metadata for LLM serving, derived on the host, uploaded in one copy.

Everything is derived on the host from data the scheduler already has (numba-compiled), written
straight into a pinned staging slot, and moved to the device with ONE non-blocking copy per step.
Nothing is ever read back from the device.

Quick start::

    import attnmeta
    from attnmeta import BatchSpec, Stager
    stager = Stager("cuda")                                    # once
    fa = attnmeta.build(BatchSpec(...), stager, "flash_attn")  # every step: common + FlashAttention

Builders (one per backend family, of one protocol) are listed by :func:`registry`; see
:mod:`attnmeta.builder`. docs/ has the backend-author quickstart, the serving-framework guide, the
contributor guide (adding a builder) and the field semantics.
"""

from typing import TYPE_CHECKING, Any

import attnmeta._announce
import attnmeta.backends  # noqa: F401  (registers the built-in builders)
from attnmeta.builder import (
    Builder,
    CommonNeeds,
    UnknownBuilderError,
    UnsupportedBatchError,
    build,
    get_builder,
    register,
    registry,
    unregister,
)
from attnmeta.common import build_common, stage_common
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec, ContextParallel, StepShape
from attnmeta.staging import Staged, Stager, Step, StepExpiredError, is_expired

__all__ = [
    "BatchSpec",
    "Builder",
    "CommonAttentionMetadata",
    "CommonHost",
    "CommonNeeds",
    "ContextParallel",
    "PagedKVMetadata",
    "Staged",
    "StagedCommon",
    "Stager",
    "StaticProfile",
    "Step",
    "StepExpiredError",
    "StepShape",
    "UnknownBuilderError",
    "UnsupportedBatchError",
    "build",
    "build_common",
    "get_builder",
    "is_expired",
    "register",
    "registry",
    "stage_common",
    "unregister",
    "warmup",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from attnmeta.bench.warmup import warmup


def __getattr__(name: str) -> Any:
    """``attnmeta.warmup``, loaded on first use: the warm-up runs every builder with its lab samples
    (:mod:`attnmeta.bench.warmup`), which ``import attnmeta`` does not load."""
    if name == "warmup":
        from attnmeta.bench.warmup import warmup as run

        return run
    raise AttributeError(f"module 'attnmeta' has no attribute {name!r}")
