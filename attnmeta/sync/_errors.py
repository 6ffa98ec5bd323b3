"""The sync audit's errors: :class:`DeviceSyncError`, and how a violation is raised or recorded.

- :class:`DeviceSyncError` names the operation, the kind of violation, the reason and the line of
  user code that issued it (frames inside torch, :mod:`attnmeta.sync`, :mod:`warnings` and
  :mod:`contextlib` are skipped when locating that line);
- :class:`Recording` is the audit that :func:`attnmeta.sync.record_device_syncs` arms: it collects
  violations instead of raising them;
- :func:`report` raises a violation, or records it under a :class:`Recording`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
import warnings
from typing import Any, Final

import torch

from attnmeta.sync._state import SyncAudit, ViolationKind

__all__ = ["DeviceSyncError", "Recording", "report", "violation"]


class DeviceSyncError(RuntimeError):
    """A host read of device data, a blocking copy or an unsafe copy inside :func:`no_device_sync`.

    Attributes
    ----------
    op : str
        The operation: an aten overload (``"aten.nonzero.default"``), a Python-level call
        (``"Tensor.tolist"``, ``"torch.tensor"``) or ``"cuda-sync-debug-mode"``.
    kind : ViolationKind
        ``"sync"``, ``"pageable-copy"`` or ``"race"``.
    reason : str
        Why the operation is a problem, and what to do instead.
    frame : traceback.FrameSummary or None
        The line of user code that issued the operation (torch internals and attnmeta.sync skipped).

    Examples
    --------
    >>> import torch
    >>> from attnmeta.sync import DeviceSyncError, no_device_sync
    >>> x = torch.ones(4, device="meta")
    >>> try:
    ...     with no_device_sync():
    ...         x.tolist()
    ... except DeviceSyncError as e:
    ...     print(e.op, e.kind, e.frame is not None)
    Tensor.tolist sync True
    """

    def __init__(
        self,
        op: str,
        reason: str,
        *,
        kind: ViolationKind = "sync",
        frame: traceback.FrameSummary | None = None,
    ) -> None:
        self.op = op
        self.kind: ViolationKind = kind
        self.reason = reason
        self.frame = frame
        where = f" at {_show_frame(frame)}" if frame is not None else ""
        super().__init__(
            f"{op}{where}: {reason}. "
            "(attnmeta.sync.no_device_sync; wrap a deliberate read in attnmeta.sync.allow_device_sync())"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (self.op, self.reason, self.kind, self.frame))


def _rebuild_error(
    op: str, reason: str, kind: ViolationKind, frame: traceback.FrameSummary | None
) -> DeviceSyncError:
    return DeviceSyncError(op, reason, kind=kind, frame=frame)


@dataclasses.dataclass(frozen=True, slots=True)
class Recording(SyncAudit):
    """An audit that records violations (:func:`record_device_syncs`) instead of raising them."""

    found: list[DeviceSyncError] = dataclasses.field(default_factory=list, compare=False, repr=False)


# --------------------------------------------------------------------------------------------
# Locating the user's line
# --------------------------------------------------------------------------------------------

_TORCH_DIR: Final = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# Every module of the attnmeta.sync package (this file's folder).
_SYNC_DIR: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIP_FILES: Final = frozenset(
    os.path.abspath(f) for f in (warnings.__file__ or "", contextlib.__file__ or "")
)


def _user_frame() -> traceback.FrameSummary | None:
    """The innermost frame outside torch, attnmeta.sync, :mod:`warnings` and :mod:`contextlib`."""
    f = sys._getframe(1)
    while f is not None:
        filename = f.f_code.co_filename
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if not path.startswith((_TORCH_DIR, _SYNC_DIR)) and path not in _SKIP_FILES:
            return traceback.FrameSummary(filename, f.f_lineno, f.f_code.co_name)
        f = f.f_back  # type: ignore[assignment]
    return None


def _show_frame(frame: traceback.FrameSummary) -> str:
    filename = frame.filename
    if not filename.startswith("<"):
        with contextlib.suppress(ValueError):
            rel = os.path.relpath(filename)
            if not rel.startswith(".."):
                filename = rel
    line = (frame.line or "").strip()
    return f"{filename}:{frame.lineno} in {frame.name}" + (f": `{line}`" if line else "")


def violation(op: str, found: tuple[ViolationKind, str]) -> DeviceSyncError:
    """The error for ``op`` with ``found`` = (kind, reason), located at the user's line."""
    kind, reason = found
    return DeviceSyncError(op, reason, kind=kind, frame=_user_frame())


def report(audit: SyncAudit, op: str, found: tuple[ViolationKind, str]) -> None:
    """Raise the violation; under :func:`record_device_syncs`, record it and let the op run."""
    __tracebackhide__ = True
    error = violation(op, found)
    if isinstance(audit, Recording):
        audit.found.append(error)
        return
    audit.raised.append(error)
    raise error
