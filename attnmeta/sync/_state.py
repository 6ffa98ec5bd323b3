"""The sync audit's shared state: which audit polices the current thread or task; per-thread state.

Every layer of the audit (:mod:`attnmeta.sync`) reads the same two things, and this module holds
them, importing none of the audit's other modules:

- :data:`ACTIVE`, a context variable holding the :class:`SyncAudit` armed for the current thread or
  asyncio task (None outside any audit and inside ``allow_device_sync()``);
- :data:`THREAD`, the per-thread state: how many audits are open on the thread, the torch modes
  installed for them, the last aten op dispatched, and whether a Python-scalar ``__setitem__`` is
  running.

It also defines the settings type :class:`SyncAudit` (the value :data:`ACTIVE` holds) and the two
type aliases of the public API, :data:`CudaMode` and :data:`ViolationKind`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from typing import Any, Final, Literal, TypeAlias

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ACTIVE",
    "THREAD",
    "CudaMode",
    "SyncAudit",
    "ThreadState",
    "ViolationKind",
]

CudaMode: TypeAlias = Literal["error", "warn", "off"]
"""What the audit does with torch's CUDA sync debug mode: raise, let torch warn, or leave it off."""

ViolationKind: TypeAlias = Literal["sync", "pageable-copy", "race"]
"""``sync``: the host waits for the device. ``pageable-copy``: a non-blocking copy whose host side
is pageable or not contiguous (torch stages it, and it can block). ``race``: a non-blocking
device->host copy whose result the host may read before it lands."""


@dataclasses.dataclass(frozen=True, slots=True)
class SyncAudit:
    """The settings of one armed :func:`no_device_sync` block.

    Examples
    --------
    >>> from attnmeta.sync import current_audit, no_device_sync
    >>> with no_device_sync(devices={"cpu"}) as audit:
    ...     sorted(audit.devices), current_audit() is audit
    (['cpu', 'cuda', 'meta'], True)
    """

    devices: frozenset[str]
    """Device types whose tensors count as device data: ``cuda``, ``meta`` and the declared ones."""
    check_copies: bool
    """Whether non-blocking host<->device copies must have a pinned, contiguous host side."""
    cuda_mode: CudaMode
    """What to do with torch's CUDA sync debug mode (see the :mod:`attnmeta.sync` docstring)."""
    allow_async_d2h: bool
    """Whether non-blocking device->host copies are allowed (by default a ``"race"``)."""
    raised: list[Any] = dataclasses.field(default_factory=list, compare=False, repr=False)
    """Every :class:`~attnmeta.sync.DeviceSyncError` raised in the block, in order: one the code caught
    itself (``except RuntimeError:``) still shows here (:func:`~attnmeta.sync.run_audit` counts it)."""

    def is_device(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` count as device data under this audit."""
        return device.type in self.devices


ACTIVE: contextvars.ContextVar[SyncAudit | None] = contextvars.ContextVar(
    "attnmeta_sync_audit", default=None
)
"""The audit armed for the current thread or asyncio task, or None (also inside an allow block)."""


class ThreadState(threading.local):
    """Per-thread state of the audit (torch's mode stacks are thread-local too)."""

    def __init__(self) -> None:
        self.depth = 0  # audits open on this thread; the modes stay installed while it is above 0
        self.modes: tuple[TorchFunctionMode, TorchDispatchMode] | None = None  # installed, or None
        self.last_op: Any = None  # the last aten op dispatched (named by torch's CUDA debug mode errors)
        self.python_scalar_setitem = False  # True while `dev[...] = <Python scalar>` runs


THREAD: Final = ThreadState()
"""The audit's state for the current thread."""
