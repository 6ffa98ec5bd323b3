"""The commit's copy and fence through the CUDA driver API, without torch's per-call overhead.

A step's one H2D copy is a ``cuMemcpyHtoDAsync`` from the pinned slot to the slot's device arena on
the commit stream, followed by ``cuEventRecord`` of the slot's fence event: exactly what
``Tensor.copy_(non_blocking=True)`` and ``Event.record`` enqueue, minus torch's argument parsing,
dispatch and host-allocator bookkeeping, which are a large part of a small step's commit
(docs/speed-tricks.md has the A/B, and how to repeat it with ``ATTNMETA_DRIVER_COPY=0``).

The fast path is an optimisation only, never a requirement:

- it is off where ``libcuda`` cannot be loaded, with ``ATTNMETA_DRIVER_COPY=0``, while another CUDA
  device is current, and while a torch dispatch or function mode is active (the sync audit), so
  audits see every copy as a torch op;
- any non-zero driver status (no current context on this thread, another device current, ...)
  makes the caller fall back to the torch calls for that commit.

Torch's pinned-memory allocator records an event for every ``copy_`` so that a freed pinned block
is not handed out again while a copy still reads it. Copies issued here bypass that bookkeeping, so
the stager keeps its pinned slots alive until their last copy completed (:func:`retire`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

__all__ = ["Driver", "load", "purge", "retire"]


class Driver:
    """Bound ``cuMemcpyHtoDAsync_v2`` and ``cuEventRecord`` of the process's ``libcuda``.

    Both return the driver status (0 = ``CUDA_SUCCESS``); they never raise.
    """

    __slots__ = ("copy", "record")

    def __init__(self, lib: Any) -> None:
        copy = lib.cuMemcpyHtoDAsync_v2
        copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        copy.restype = ctypes.c_int
        record = lib.cuEventRecord
        record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        record.restype = ctypes.c_int
        self.copy = copy
        """``copy(dst_device_ptr, src_host_ptr, nbytes, stream_handle) -> status``."""
        self.record = record
        """``record(event_handle, stream_handle) -> status``."""


_LOADED: list[Driver | None] = []


def load() -> Driver | None:
    """The process's :class:`Driver`, loaded once; ``None`` if disabled or unavailable."""
    if not _LOADED:
        drv = None
        if os.environ.get("ATTNMETA_DRIVER_COPY", "1") != "0":
            try:
                drv = Driver(ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"))
            except (OSError, AttributeError):
                drv = None
        _LOADED.append(drv)
    return _LOADED[0]


# (event, pinned tensor) pairs of stagers that were collected while a copy might still read the
# tensor; kept alive until the event has completed.
_RETIRED: list[tuple[Any, Any]] = []


def retire(slots: list[Any]) -> None:
    """Finalizer of a stager's slot list: keep each slot's pinned bytes alive until its last copy
    has completed (checked without waiting, here and by :func:`purge`)."""
    for slot in slots:
        if slot.event is not None and slot.host is not None and slot.generation:
            _RETIRED.append((slot.event, slot.host))
    purge()


def purge() -> None:
    """Release the retired pinned buffers whose copies have completed (a non-blocking query each)."""
    if _RETIRED:
        _RETIRED[:] = [(ev, host) for ev, host in _RETIRED if not ev.query()]
