"""How a :class:`~attnmeta.staging.shared.RingReader` copies a slot to its device and learns the copy is
done: the :class:`CopyEngine` interface and its default, :class:`DeviceCopyEngine` (tests pass engines
that hold copies back, to race the protocol)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["CopyEngine", "DeviceCopyEngine"]


class CopyEngine(Protocol):
    """How a reader issues its one copy of a slot and learns that the copy has completed."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> Any:
        """Issue ``dst.copy_(src)`` (``src``: uint8 view of the shared slot ``slot``; ``dst``: the same
        number of bytes in the reader's arena) and return a fence for :meth:`done`."""
        ...

    def done(self, fence: Any) -> bool:
        """Whether the copy that returned ``fence`` has completed (never blocks)."""
        ...


class DeviceCopyEngine:
    """The default :class:`CopyEngine`: on CUDA a non-blocking copy on the device's current stream
    and an event per slot recorded after it; elsewhere a copy that is done when it returns.

    Parameters
    ----------
    device : torch.device
        The reader's device.
    num_slots : int
        The ring's slots (one event each).
    """

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self._events = [torch.cuda.Event() for _ in range(num_slots)] if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> Any:
        """See :meth:`CopyEngine.copy`."""
        dst.copy_(src, non_blocking=True)
        if self._events is None:
            return None
        ev = self._events[slot]
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def done(self, fence: Any) -> bool:
        """See :meth:`CopyEngine.done`."""
        return fence is None or bool(fence.query())
