"""Device-side helpers: constant index tensors uploaded once, and sync-free pad-out.

- :class:`DeviceIndexCache`: constant index tensors built once per device with one async upload from
  pinned memory, then applied on the device with ``index_fill_`` / ``index_copy_``.
- :func:`pad_out`: copy a device tensor into the head of a larger persistent buffer and fill the tail,
  with a non-blocking device copy and ``fill_`` (never a Python-index scalar assignment, which syncs).

Nothing here reads device data on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch

from attnmeta.staging._layout import plain_tensors

__all__ = ["DeviceIndexCache", "pad_out"]


class DeviceIndexCache:
    """Constant int64 index tensors, one per (key, device), uploaded once without a sync.

    ``make`` is called once per key on the host and must return a 1-D integer numpy array; it is
    copied into a pinned buffer (kept alive by the cache, so the async copy can never read freed or
    rewritten memory) and uploaded with one non-blocking copy.

    Examples
    --------
    >>> import numpy as np, torch
    >>> cache = DeviceIndexCache("cpu")
    >>> idx = cache.get("evens", lambda: np.arange(0, 6, 2))
    >>> t = torch.zeros(6, dtype=torch.int32)
    >>> cache.index_fill_(t, "evens", lambda: np.arange(0, 6, 2), 7)
    tensor([7, 0, 7, 0, 7, 0], dtype=torch.int32)
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._pinned: list[torch.Tensor] = []
        self.uploads = 0
        """Uploads issued (one per distinct key)."""

    def get(self, key: Hashable, make: Callable[[], np.ndarray]) -> torch.Tensor:
        """The device index tensor for ``key`` (int64, 1-D), built by ``make()`` on first use."""
        t = self._tensors.get(key)
        if t is None:
            host = np.ascontiguousarray(make(), dtype=np.int64)
            if host.ndim != 1:
                raise ValueError(f"DeviceIndexCache[{key!r}]: index must be 1-D, got shape {host.shape}")
            pin = self.device.type == "cuda"
            with plain_tensors():  # (kept across steps: usable inside and outside inference mode)
                staged = torch.empty(host.shape[0], dtype=torch.int64, pin_memory=pin)
                staged.numpy()[:] = host
                t = torch.empty(host.shape[0], dtype=torch.int64, device=self.device)
                t.copy_(staged, non_blocking=True)
            self._pinned.append(staged)
            self._tensors[key] = t
            self.uploads += 1
        return t

    def index_fill_(
        self, target: torch.Tensor, key: Hashable, make: Callable[[], np.ndarray], value: Any, dim: int = 0
    ) -> torch.Tensor:
        """``target.index_fill_(dim, cached_index, value)`` on the device; returns ``target``."""
        return target.index_fill_(dim, self.get(key, make), value)

    def index_copy_(
        self, target: torch.Tensor, key: Hashable, make: Callable[[], np.ndarray], source: torch.Tensor, dim: int = 0
    ) -> torch.Tensor:
        """``target.index_copy_(dim, cached_index, source)`` on the device; returns ``target``."""
        return target.index_copy_(dim, self.get(key, make), source)


def pad_out(src: torch.Tensor, dst: torch.Tensor, fill: Any) -> torch.Tensor:
    """Copy ``src`` into ``dst[:len(src)]`` and fill ``dst[len(src):]`` with ``fill``, on the device.

    Both tensors live on the same device; ``dst`` is a persistent buffer (fixed address for CUDA
    graphs). Uses a non-blocking device copy and ``fill_`` only. Returns ``dst``.

    Raises
    ------
    ValueError
        ``src`` has more rows than ``dst`` or different trailing dimensions or dtype.

    Examples
    --------
    >>> import torch
    >>> buf = torch.empty(5, dtype=torch.int32)
    >>> pad_out(torch.tensor([3, 1], dtype=torch.int32), buf, -1)
    tensor([ 3,  1, -1, -1, -1], dtype=torch.int32)
    """
    n = src.shape[0]
    if n > dst.shape[0] or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"pad_out: cannot place {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}"
        )
    dst[:n].copy_(src, non_blocking=True)
    dst[n:].fill_(fill)
    return dst
