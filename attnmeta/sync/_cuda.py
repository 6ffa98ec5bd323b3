"""Layer 3 of the sync audit: torch's CUDA sync debug mode, scoped per thread and task.

``torch.cuda.set_sync_debug_mode`` is process-wide; its ``"error"`` setting would raise in every
thread, including threads that never asked for an audit. So a lock-protected reference count
(:class:`CudaDebug`) arms the ``"warn"`` setting process-wide while at least one audit with
``cuda_mode != "off"`` is armed (:func:`cuda_acquire`, :func:`cuda_release`; the previous setting
is restored when the count drops to 0), and a hook on the :mod:`warnings` machinery turns torch's
"called a synchronizing CUDA operation" warning into a violation only in a thread or task whose
audit is armed. :func:`patch_explicit_syncs` wraps ``torch.cuda.synchronize()`` and the
``Event``/``Stream`` ``synchronize()`` methods, which the debug mode does not report. The
:mod:`attnmeta.sync` docstring and ``docs/sync-audit.md`` describe the behaviour in full.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

from attnmeta.sync._errors import report
from attnmeta.sync._rules import R_EXPLICIT_SYNC, TORCH_SYNC_TEXT
from attnmeta.sync._state import ACTIVE, THREAD

__all__ = ["PATCHED_SYNCS", "CudaDebug", "cuda_acquire", "cuda_release", "patch_explicit_syncs"]


class CudaDebug:
    """Process-wide state of the CUDA sync debug mode as the audit arms it (guarded by ``lock``)."""

    lock = threading.Lock()
    users = 0
    saved_mode = 0
    raised = False  # True when the audit switched torch from "default" (0) to "warn" (1)


def _sync_warning_hook(msg: warnings.WarningMessage, *, previous: Callable[[Any], None]) -> None:
    __tracebackhide__ = True
    if TORCH_SYNC_TEXT in str(msg.message):
        audit = ACTIVE.get()
        if audit is not None and audit.cuda_mode != "off":
            if audit.cuda_mode == "error":
                last = THREAD.last_op
                where = f" (the last aten op before it on this thread: {last})" if last is not None else ""
                report(
                    audit,
                    "cuda-sync-debug-mode",
                    ("sync", f"torch's CUDA sync debug mode reported a synchronizing CUDA operation{where}"),
                )
                return
        elif CudaDebug.raised:
            return  # this thread/task did not ask for the debug mode; the audit turned it on
    previous(msg)


def _install_warning_hook() -> None:
    """Wrap ``warnings._showwarnmsg`` (once; again if someone replaced it) and force "always"."""
    current = getattr(warnings, "_showwarnmsg", None)
    if current is not None and not getattr(current, "_attnmeta_sync_hook", False):

        def hook(msg: warnings.WarningMessage) -> None:
            _sync_warning_hook(msg, previous=current)

        hook._attnmeta_sync_hook = True  # type: ignore[attr-defined]
        setattr(warnings, "_showwarnmsg", hook)  # noqa: B010
    warnings.filterwarnings("always", message=TORCH_SYNC_TEXT, category=UserWarning)


def _remove_always_filter() -> None:
    filters = cast("list[Any]", warnings.filters)
    for i, f in enumerate(filters):
        if f[0] == "always" and f[2] is UserWarning and getattr(f[1], "pattern", None) == TORCH_SYNC_TEXT:
            del filters[i]
            warnings._filters_mutated()  # type: ignore[attr-defined]
            break


def cuda_acquire() -> None:
    with CudaDebug.lock:
        _install_warning_hook()
        patch_explicit_syncs()
        if CudaDebug.users == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the debug mode is a prototype
                mode = int(torch.cuda.get_sync_debug_mode())
                CudaDebug.saved_mode = mode
                CudaDebug.raised = mode == 0
                if mode == 0:
                    torch.cuda.set_sync_debug_mode(1)
        CudaDebug.users += 1


def cuda_release() -> None:
    with CudaDebug.lock:
        CudaDebug.users -= 1
        if CudaDebug.users == 0:
            if CudaDebug.raised:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.cuda.set_sync_debug_mode(CudaDebug.saved_mode)
            CudaDebug.raised = False
            _remove_always_filter()


PATCHED_SYNCS: dict[str, bool] = {}


def patch_explicit_syncs() -> None:
    """Make explicit CUDA synchronisations fail in audited threads (torch's debug mode misses them).

    ``torch.cuda.synchronize()`` and ``torch.cuda.Event.synchronize()`` block the host without
    triggering the sync debug mode (measured on torch 2.11); they are wrapped once, process-wide,
    and the wrappers pass straight through unless the current thread/task is audited.
    """

    def guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            audit = ACTIVE.get()
            if audit is not None and audit.cuda_mode != "off":
                report(audit, name, ("sync", R_EXPLICIT_SYNC))
            return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__doc__ = fn.__doc__
        wrapper.__name__ = getattr(fn, "__name__", name)
        return wrapper

    targets: list[tuple[str, Any, str]] = [
        ("torch.cuda.synchronize", torch.cuda, "synchronize"),
        ("torch.cuda.Event.synchronize", torch.cuda.Event, "synchronize"),
        ("torch.cuda.Stream.synchronize", torch.cuda.Stream, "synchronize"),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append(("torch.accelerator.synchronize", accelerator, "synchronize"))
    for name, owner, attr in targets:
        if not PATCHED_SYNCS.get(name):
            setattr(owner, attr, guard(name, getattr(owner, attr)))
            PATCHED_SYNCS[name] = True
