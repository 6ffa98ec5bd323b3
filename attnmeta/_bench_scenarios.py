"""Compatibility shim: the per-tensor uploaders under their old private names.

``attnmeta._bench_mamba2`` imports them from here. This module goes once the Mamba scenarios move
into :mod:`attnmeta.bench` (their new home is :mod:`attnmeta.bench.harness`).
"""

from attnmeta.bench.harness import blocking_uploader as _raw_uploader
from attnmeta.bench.harness import pinned_uploader as _uploader

__all__ = ["_raw_uploader", "_uploader"]
