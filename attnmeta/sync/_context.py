"""Arming the sync audit: the context managers, and the modes they install on the thread.

:func:`no_device_sync`, :func:`record_device_syncs` and :func:`allow_device_sync` set the
active audit (:data:`attnmeta.sync._state.ACTIVE`) for the current thread or asyncio task;
arming also installs the function and dispatch modes on the thread's torch mode stacks (once,
however many audits are open there) and, where CUDA is available and ``cuda_mode != "off"``,
acquires torch's CUDA sync debug mode. :func:`make_audit` validates the options into a
:class:`SyncAudit` (the pytest plugin uses it too).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import torch

from attnmeta.sync._cuda import cuda_acquire, cuda_release
from attnmeta.sync._dispatch import DispatchAudit
from attnmeta.sync._errors import DeviceSyncError, Recording
from attnmeta.sync._function import FunctionAudit
from attnmeta.sync._state import ACTIVE, THREAD, CudaMode, SyncAudit

__all__ = [
    "allow_device_sync",
    "current_audit",
    "make_audit",
    "no_device_sync",
    "record_device_syncs",
]

_ALWAYS_DEVICE: Final = frozenset({"cuda", "meta"})
_CUDA_MODES: Final = ("error", "warn", "off")


def current_audit() -> SyncAudit | None:
    """The audit armed for the current thread or asyncio task, or None (also inside an allow block).

    Examples
    --------
    >>> from attnmeta.sync import allow_device_sync, current_audit, no_device_sync
    >>> current_audit() is None
    True
    >>> with no_device_sync():
    ...     armed = current_audit() is not None
    ...     with allow_device_sync():
    ...         suspended = current_audit() is None
    >>> armed, suspended
    (True, True)
    """
    return ACTIVE.get()


def make_audit(
    devices: Iterable[str | torch.device] | str | torch.device | None,
    check_copies: bool,
    cuda_mode: str,
    allow_async_d2h: bool,
) -> SyncAudit:
    """The settings of :func:`no_device_sync` as a :class:`SyncAudit`, validated.

    Raises
    ------
    ValueError
        For an unknown ``cuda_mode`` or device type.
    """
    if cuda_mode not in _CUDA_MODES:
        raise ValueError(f"cuda_mode={cuda_mode!r}: expected one of {', '.join(map(repr, _CUDA_MODES))}")
    if devices is None:
        declared: Iterable[str | torch.device] = ()
    elif isinstance(devices, (str, torch.device)):
        declared = (devices,)
    else:
        declared = devices
    types = set(_ALWAYS_DEVICE)
    for d in declared:
        try:
            types.add(torch.device(d).type)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"devices: {d!r} is not a device type (expected e.g. 'cpu', 'cuda')") from e
    mode: CudaMode = "error" if cuda_mode == "error" else "warn" if cuda_mode == "warn" else "off"
    return SyncAudit(frozenset(types), bool(check_copies), mode, bool(allow_async_d2h))


class _Scope(contextlib.ContextDecorator):
    """An audit scope (:func:`no_device_sync`, :func:`allow_device_sync`): a context manager, and a
    decorator of plain functions. A generator or async function is refused: the decorator's block would
    end when the call returns its generator or coroutine, before the body runs."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[Any]], name: str) -> None:
        self._make = make
        self._name = name
        self._cm: contextlib.AbstractContextManager[Any] | None = None

    def _recreate_cm(self) -> _Scope:
        return _Scope(self._make, self._name)

    def __enter__(self) -> Any:
        self._cm = self._make()
        return self._cm.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        assert self._cm is not None
        return self._cm.__exit__(*exc)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"@{self._name}(): {getattr(fn, '__qualname__', fn)!r} is a generator or async function, whose "
                f"body runs after the decorated call returns; use `with {self._name}():` inside its body instead "
                f"(in a generator, around code that does not yield)")
        return super().__call__(fn)


def no_device_sync(
    *,
    devices: Iterable[str | torch.device] | str | torch.device | None = None,
    check_copies: bool = True,
    cuda_mode: CudaMode = "error",
    allow_async_d2h: bool = False,
) -> _Scope:
    """Fail on any host read of device data (and any unsafe copy) inside the block.

    Scoped to the current thread and asyncio task: other threads and tasks are not policed, and a
    task started inside the block inherits it. Nestable: an inner block replaces the settings of
    an outer one until it exits, and re-arms the audit inside :func:`allow_device_sync`. Usable
    as a decorator of a plain function (a generator or async function is a ``TypeError``). A
    block begins and ends on one thread, and a generator must not yield inside it (its caller would
    run under the generator's audit, or none).

    Parameters
    ----------
    devices : iterable of str or torch.device, optional
        Extra device types whose tensors count as device data, besides ``cuda`` and ``meta``
        (which always do). ``{"cpu"}`` audits device-style code running on CPU tensors; numpy
        arrays are then the only host data.
    check_copies : bool, default True
        Reject non-blocking host<->device copies whose host side is pageable (for a real
        accelerator; pinned memory does not exist for ``meta``/``cpu``) or not contiguous, or that
        broadcast a host tensor. Blocking copies are syncs and are rejected regardless.
    cuda_mode : {"error", "warn", "off"}, default "error"
        Where CUDA is available: arm torch's sync debug mode (process-wide ``"warn"``, reference
        counted) and raise :class:`DeviceSyncError` for the syncs it reports in this thread/task
        (``"error"``), let torch's warning through (``"warn"``), or leave it off (``"off"``).
    allow_async_d2h : bool, default False
        Allow non-blocking device->host copies (by default a ``"race"``: their contents are stale
        until the stream catches up).

    Yields
    ------
    SyncAudit
        The settings now in force.

    Raises
    ------
    DeviceSyncError
        From the offending operation, inside the block.
    ValueError
        For an unknown ``cuda_mode`` or device type.

    Examples
    --------
    >>> import numpy as np
    >>> import torch
    >>> from attnmeta.sync import DeviceSyncError, no_device_sync
    >>> seq_lens_cpu = np.array([5, 3, 9], dtype=np.int32)
    >>> with no_device_sync():
    ...     seq_lens = torch.from_numpy(seq_lens_cpu).to("meta", non_blocking=True)
    ...     max_seq_len = int(seq_lens_cpu.max())           # host data: fine
    >>> max_seq_len
    9
    >>> with no_device_sync():
    ...     try:
    ...         seq_lens.max().item()
    ...     except DeviceSyncError as e:
    ...         print(e.op)
    aten._local_scalar_dense.default

    CPU tensors count as device data once declared:

    >>> with no_device_sync(devices={"cpu"}):
    ...     try:
    ...         torch.tensor([True, False]).nonzero()
    ...     except DeviceSyncError as e:
    ...         print(e.op)
    aten.nonzero.default
    """
    return _Scope(lambda: _armed(make_audit(devices, check_copies, cuda_mode, allow_async_d2h)), "no_device_sync")


@contextlib.contextmanager
def record_device_syncs(
    *,
    devices: Iterable[str | torch.device] | str | torch.device | None = None,
    check_copies: bool = True,
    cuda_mode: CudaMode = "error",
    allow_async_d2h: bool = False,
) -> Iterator[list[DeviceSyncError]]:
    """Like :func:`no_device_sync`, but collect the violations instead of raising them.

    The offending operations still run, so a block can be counted end to end (benchmarks report
    syncs per step this way). Use it on real data (``cpu`` declared as device data, or CUDA): on
    ``meta`` the first host read still fails, in torch. A sync that torch itself raises for (its
    debug mode at ``"error"``, set by the process) is still raised.

    Parameters
    ----------
    devices : iterable of str or torch.device, optional
        As for :func:`no_device_sync`.
    check_copies : bool, default True
        As for :func:`no_device_sync`.
    cuda_mode : {"error", "warn", "off"}, default "error"
        As for :func:`no_device_sync`; with ``"error"``, torch's reports are recorded.
    allow_async_d2h : bool, default False
        As for :func:`no_device_sync`.

    Yields
    ------
    list of DeviceSyncError
        Filled in as the block runs, in order.

    Examples
    --------
    >>> import torch
    >>> from attnmeta.sync import record_device_syncs
    >>> query_lens = torch.tensor([1, 5, 1, 7])
    >>> with record_device_syncs(devices={"cpu"}) as found:
    ...     num_prefills = int((query_lens > 1).sum())
    ...     max_query_len = query_lens.max().item()
    >>> num_prefills, max_query_len, [e.op for e in found]
    (2, 7, ['aten._local_scalar_dense.default', 'aten._local_scalar_dense.default'])
    """
    plain = make_audit(devices, check_copies, cuda_mode, allow_async_d2h)
    recording = Recording(plain.devices, plain.check_copies, plain.cuda_mode, plain.allow_async_d2h)
    with _armed(recording):
        yield recording.found


@contextlib.contextmanager
def _armed(audit: SyncAudit) -> Iterator[SyncAudit]:
    use_cuda = audit.cuda_mode != "off" and torch.cuda.is_available()
    token = ACTIVE.set(audit)
    _push_thread_modes()
    THREAD.last_op = None
    began = threading.current_thread()  # (the object: a thread's ident is reused once it ends)
    try:
        if use_cuda:
            cuda_acquire()
        try:
            yield audit
        finally:
            if use_cuda:
                cuda_release()
    finally:
        if threading.current_thread() is not began:  # (a generator holding the block, closed on another thread)
            raise RuntimeError(  # (this thread's state is not the block's: leave it whole)
                "an audit block ended on another thread than the one it began on; that thread stays audited "
                "(a block must begin and end on one thread: do not yield inside one)")
        _pop_thread_modes()
        ACTIVE.reset(token)


def allow_device_sync() -> _Scope:
    """Suspend the audit of the current thread/task for a deliberate host read.

    An inner :func:`no_device_sync` re-arms it. Outside any audit this does nothing. Usable as a
    decorator of a plain function; a generator must not yield inside the block (its caller would run
    unaudited until it resumes).

    Examples
    --------
    >>> import torch
    >>> from attnmeta.sync import allow_device_sync, no_device_sync
    >>> x = torch.arange(4, device="cpu")
    >>> with no_device_sync(devices={"cpu"}):
    ...     y = x * 2
    ...     with allow_device_sync():
    ...         print(y.tolist())        # an expected read, e.g. checking a result
    [0, 2, 4, 6]
    """
    return _Scope(_suspended, "allow_device_sync")


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """:func:`allow_device_sync`'s block."""
    token = ACTIVE.set(None)
    try:
        yield
    finally:
        ACTIVE.reset(token)


# --------------------------------------------------------------------------------------------
# Per-thread installation of the two modes
# --------------------------------------------------------------------------------------------


def _push_thread_modes() -> None:
    """Install the modes on this thread's mode stacks (once, however many audits are armed).

    The torch mode stacks are thread-local; the modes stay installed while any audit on this
    thread is open (asyncio tasks interleave on one thread, so their blocks need not nest), and
    they do nothing unless the current context has an audit armed.
    """
    state = THREAD
    state.depth += 1
    if state.depth == 1:
        modes = (FunctionAudit(), DispatchAudit())
        torch._C._push_on_torch_function_stack(modes[0])
        torch._C._push_on_torch_dispatch_stack(modes[1])
        state.modes = modes


def _remove_mode(
    mode: object,
    length: Callable[[], int],
    at: Callable[[int], object],
    pop: Callable[[], object],
    push: Callable[[Any], None],
) -> None:
    """Remove ``mode`` from a torch mode stack, keeping any modes pushed above it (in order)."""
    if not any(at(i) is mode for i in range(length())):
        return
    above: list[object] = []
    while (top := pop()) is not mode:
        above.append(top)
    for m in reversed(above):
        push(m)


def _pop_thread_modes() -> None:
    state = THREAD
    state.depth -= 1
    if state.depth == 0 and state.modes is not None:
        function_mode, dispatch_mode = state.modes
        state.modes = None
        _remove_mode(
            dispatch_mode,
            torch._C._len_torch_dispatch_stack,
            torch._C._get_dispatch_stack_at,
            lambda: torch._C._pop_torch_dispatch_stack(None),
            torch._C._push_on_torch_dispatch_stack,
        )
        _remove_mode(
            function_mode,
            torch._C._len_torch_function_stack,
            torch._C._get_function_stack_at,
            torch._C._pop_torch_function_stack,
            torch._C._push_on_torch_function_stack,
        )
