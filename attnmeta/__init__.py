"""attnmeta: attention metadata for LLM serving, derived on the host, uploaded in one copy.

Everything is derived on the host from data the scheduler already has (numba-compiled), written
straight into a pinned staging slot, and moved to the device with ONE non-blocking copy per step.
Nothing is ever read back from the device.

Quick start::

    from attnmeta import BatchSpec, Stager, build_common
    stager = Stager("cuda")                       # once
    common = build_common(BatchSpec(...), stager)  # every step

See docs/ for the backend-author quickstart, the serving-framework guide and the field semantics.
"""

from attnmeta.metadata import CommonAttentionMetadata, build_common, stage_common
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec, ContextParallel
from attnmeta.staging import Stager, Step

__all__ = [
    "BatchSpec",
    "CommonAttentionMetadata",
    "ContextParallel",
    "Stager",
    "StaticProfile",
    "Step",
    "build_common",
    "stage_common",
]
__version__ = "0.1.0"
