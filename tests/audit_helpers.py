"""Helpers shared by the kernel checks (tests/gpu, tests/kernels); importable from any test module
(``tests/`` is on the path: pytest prepends the directory of the root ``conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from attnmeta.sync import no_device_sync


@contextmanager
def audited() -> Iterator[None]:
    """attnmeta's audit (host reads, unsafe copies), plus torch's own sync debug mode at "error" where
    CUDA is present, so a sync torch sees inside a kernel raises too."""
    if not torch.cuda.is_available():
        with no_device_sync():
            yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with no_device_sync():
            yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)
