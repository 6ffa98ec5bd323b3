"""The project's one numba configuration.

Every compiled kernel in attnmeta is decorated with :func:`njit` from this module, never with a raw
``numba.njit``: caching, ``nogil`` and ``fastmath=False`` are fixed here once (a CI grep enforces it).
``NUMBA_DISABLE_JIT=1`` turns every kernel back into plain Python (coverage, pdb).

Editing kernels: numba's on-disk cache (``__pycache__/*.nbi``, ``*.nbc`` next to each source file)
is checked against the kernel's own file only. A kernel that calls a compiled helper from another
file (every caller of :mod:`attnmeta._intdiv`, the kernels of :mod:`attnmeta.host.common` calling
those of :mod:`attnmeta.host.layout`) keeps the helper's old code, inlined, until its own file
changes. After editing such a helper, run with ``NUMBA_CACHE_DIR`` set to a fresh directory or
delete the caches (``find attnmeta -name '*.nb[ic]' -delete``). An installed release is unaffected
(every file is new), and a fresh checkout has no caches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numba

__all__ = ["njit", "njit_parallel", "pool_threads"]

F = TypeVar("F", bound=Callable[..., Any])


def njit(fn: F) -> F:
    """Compile ``fn`` in nopython mode with attnmeta's fixed options.

    Options: ``cache=True`` (compiled code is reused across processes), ``nogil=True`` (a serving
    framework may build metadata for several devices from several threads), ``fastmath=False``
    (integer code only; nothing may be reassociated), ``boundscheck=False``.
    """
    return numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False)(fn)  # type: ignore[return-value]


def njit_parallel(fn: F) -> F:
    """:func:`njit` with ``parallel=True``: ``numba.prange`` loops run on numba's thread pool, with as
    many threads as ``numba.get_num_threads()`` of the calling thread when the loop starts (set it
    around the call; a ``numba.set_num_threads`` inside compiled code would make it uncacheable).
    """
    return numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False,  # type: ignore[return-value]
                      parallel=True)(fn)


_POOL_STARTED = False


def pool_threads(n: int) -> int:
    """Have numba's thread pool run the calling thread's next :func:`njit_parallel` loops on ``n``
    threads; returns the count to restore with ``numba.set_num_threads``.

    The first call starts numba's threading layer, whose OpenMP start changes the thread count that
    torch's CPU ops see: torch's count is put back as it was. A process that never calls this never
    starts the layer.
    """
    import torch

    global _POOL_STARTED
    torch_threads = None if _POOL_STARTED else torch.get_num_threads()
    was = int(numba.get_num_threads())
    numba.set_num_threads(n)
    if torch_threads is not None:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        _POOL_STARTED = True
    return was
