"""Mark reference implementations as sync-allowed oracles.

References read device tensors on the host by design (``.item()``, boolean masks, ``.cpu()``). Wrapping
them in :func:`attnmeta.sync.allow_device_sync` lets a whole test session run under the sync audit
(``--attnmeta-sync-audit``): the oracle may sync, the library under test may not.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

__all__ = ["mark_oracles", "oracle"]

P = ParamSpec("P")
R = TypeVar("R")


def oracle(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` with the sync audit suspended (a deliberate, test-only host read)."""
    if getattr(fn, "__attnmeta_oracle__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from attnmeta.sync import allow_device_sync

        with allow_device_sync():
            return fn(*args, **kwargs)

    wrapper.__attnmeta_oracle__ = True  # type: ignore[attr-defined]
    return wrapper


def mark_oracles(namespace: dict[str, Any], names: Iterable[str]) -> None:
    """Replace every plain function among ``names`` in ``namespace`` by its :func:`oracle` wrapper."""
    for name in names:
        obj = namespace.get(name)
        if inspect.isfunction(obj):
            namespace[name] = oracle(obj)
