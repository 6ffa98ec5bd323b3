"""The sync audit: prove that a block of code never makes the host wait for a device.

A GPU->CPU synchronisation costs all the GPU work still queued, not its own few microseconds
(shared/reference/gpu-costs.md): on a busy engine every ``.item()`` is milliseconds. This module
makes such waits fail loudly, on CPU-only CI as well as on CUDA:

- :func:`no_device_sync` arms the audit for a block (a context manager and a decorator);
  :func:`allow_device_sync` suspends it for a deliberate read. Both are scoped per thread and per
  asyncio task and nest freely. :func:`record_device_syncs` collects the violations of a block
  instead of raising (for counting syncs per step).
- A violation raises :class:`DeviceSyncError`, which names the operation (an aten op such as
  ``aten.nonzero.default``, or a Python-level call such as ``Tensor.tolist``) and the line of user
  code that issued it.
- :func:`register_audit_target`, :func:`run_audit` and :func:`format_audit_table` run registered
  metadata builders under the audit and tabulate what they found (``python -m attnmeta audit``).

How it works
------------
Three layers, each installed only while an audit is armed:

1. **A torch dispatch mode** (every device type, CPU-only CI included) sees every aten op and
   rejects those that read device data on the host: ``aten._local_scalar_dense`` (``.item()``,
   ``bool()``, ``int()``, ``float()``), ``aten.equal``/``allclose``, ops whose output shape
   depends on device data (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
   ``repeat_interleave`` without ``output_size``, ``one_hot`` without ``num_classes``, ``histc``
   without a range, boolean-mask indexing with a device mask), device->host copies, blocking
   host->device copies, host index tensors used on device data, and - the copy checker -
   non-blocking host->device copies whose host side is pageable (CUDA) or not contiguous.
2. **A torch function mode** catches what never reaches an aten op as a host read:
   ``Tensor.tolist``/``numpy``/``__array__``/``cpu``, ``torch.tensor(data, device=...)`` and
   friends (blocking uploads), ``dev[i] = 3`` (a 0-dim blocking upload) and indexing with a Python
   list or numpy array (a blocking upload of the index).
3. **On CUDA**, torch's own sync debug mode, for the syncs hidden inside kernels, plus explicit
   ``torch.cuda.synchronize()``/``Event.synchronize()`` (which the debug mode does not report).

Which tensors count as device data is a set of device types: ``cuda`` and ``meta`` always, plus
any declared with ``devices=``. On CPU-only CI, ``meta`` tensors stand in for device data (they
carry none, so any read fails loudly anyway; the audit fails first, with the op and the line).
Declaring ``devices={"cpu"}`` makes CPU tensors count as device data, so device-style reference
code running on ``cpu`` is audited too; ``numpy`` arrays are then the only host data.

Per-thread scoping of torch's CUDA sync debug mode
--------------------------------------------------
``torch.cuda.set_sync_debug_mode`` is process-wide; its ``"error"`` setting would raise in every
thread, including threads that never asked for an audit. So the audit does what vLLM's
``VLLM_GPU_SYNC_CHECK`` does (shared/reference/vllm-semantics.md section 10): a lock-protected
reference count arms the ``"warn"`` setting process-wide while at least one audit with
``cuda_mode != "off"`` is armed (the previous setting is saved and restored when the count drops
to 0), and a hook on the :mod:`warnings` machinery turns torch's "called a synchronizing CUDA
operation" warning into :class:`DeviceSyncError` only in a thread or task whose audit is armed
and not inside :func:`allow_device_sync`. The same warning from any other thread is swallowed
(they did not ask for the debug mode). The hook wraps ``warnings._showwarnmsg``, which
``warnings.catch_warnings`` (pytest's per-test capture included) leaves in place, and an
``"always"`` filter for that message is (re)inserted at every arming so that a repeated sync at
one line is never deduplicated away. Torch delivers the warning when the outermost torch call
returns, so the error names the last aten op dispatched on the thread. If the process already
runs torch's debug mode at ``"error"``, the audit leaves it alone: torch then raises in every
thread, and the audit re-raises torch's error as :class:`DeviceSyncError` where it can.

Non-blocking device->host copies
--------------------------------
``t.to("cpu", non_blocking=True)`` does not block (vllm-semantics.md section 12.3), but the host
tensor's contents are undefined until the stream reaches the copy: reading it soon after is a race
(vLLM's fast-prefill ``query_start_loc_cpu``, vllm#36013) and waiting for it is a sync. attnmeta
never copies device->host, so the audit flags such copies by default as a ``"race"``; pass
``allow_async_d2h=True`` where the caller synchronises on an event before it reads.

What is not flagged
-------------------
Pinned non-blocking host->device ``copy_``/``to`` (dtype conversions included), slice assignment
``dev[a:] = 3``, ``fill_``, a host boolean mask indexing device data (``dev[host_mask]``), device
index tensors, ``gather``, ``where(cond, a, b)``, ``full``/``arange``/``zeros`` on the device,
``torch.any`` without ``bool()``, ``bucketize``, ``scatter_add_``, ``split``, ``cumsum(out=)``,
``nonzero_static``, ``masked_fill``/``masked_scatter``, ``dev[dev_mask] = 0`` (a masked fill),
``dev[dev_index] = dev_values``, ``dev[host_mask] = dev_values``, and everything on host tensors. Empty tensors are ignored by the copy checks.

Examples
--------
>>> import torch
>>> from attnmeta.sync import DeviceSyncError, allow_device_sync, no_device_sync
>>> lens_cpu = torch.tensor([3, 1, 4])                # host data
>>> with no_device_sync():
...     lens = lens_cpu.to("meta", non_blocking=True)  # an upload: fine
...     total = lens.sum()                             # device arithmetic: fine
...     try:
...         total.item()                               # a host read of device data
...     except DeviceSyncError as e:
...         print(e.op, e.kind)
aten._local_scalar_dense.default sync
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import numbers
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias, cast, overload

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "AuditRow",
    "AuditTarget",
    "CudaMode",
    "DeviceSyncError",
    "SyncAudit",
    "ViolationKind",
    "allow_device_sync",
    "audit_targets",
    "current_audit",
    "format_audit_table",
    "no_device_sync",
    "record_device_syncs",
    "register_audit_target",
    "run_audit",
    "unregister_audit_target",
]

CudaMode: TypeAlias = Literal["error", "warn", "off"]
"""What the audit does with torch's CUDA sync debug mode: raise, let torch warn, or leave it off."""

ViolationKind: TypeAlias = Literal["sync", "pageable-copy", "race"]
"""``sync``: the host waits for the device. ``pageable-copy``: a non-blocking copy whose host side
is pageable or not contiguous (torch stages it, and it can block). ``race``: a non-blocking
device->host copy whose result the host may read before it lands."""

_ALWAYS_DEVICE: Final = frozenset({"cuda", "meta"})
_CUDA_MODES: Final = ("error", "warn", "off")
_TORCH_SYNC_TEXT: Final = "called a synchronizing CUDA operation"
# Device types whose host side may need pinning; pinned memory does not exist for these.
_NO_PINNING: Final = frozenset({"meta", "cpu"})
_MASK_DTYPES: Final = (torch.bool, torch.uint8)


# --------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------


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
    """What to do with torch's CUDA sync debug mode (see the module docstring)."""
    allow_async_d2h: bool
    """Whether non-blocking device->host copies are allowed (by default a ``"race"``)."""

    def is_device(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` count as device data under this audit."""
        return device.type in self.devices


@dataclasses.dataclass(frozen=True, slots=True)
class _Recording(SyncAudit):
    """An audit that records violations (:func:`record_device_syncs`) instead of raising them."""

    found: list[DeviceSyncError] = dataclasses.field(default_factory=list, compare=False, repr=False)


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


# --------------------------------------------------------------------------------------------
# Context: which audit (if any) polices the current thread / asyncio task
# --------------------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[SyncAudit | None] = contextvars.ContextVar(
    "attnmeta_sync_audit", default=None
)


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
    return _ACTIVE.get()


def _make_audit(
    devices: Iterable[str | torch.device] | str | torch.device | None,
    check_copies: bool,
    cuda_mode: str,
    allow_async_d2h: bool,
) -> SyncAudit:
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


@contextlib.contextmanager
def no_device_sync(
    *,
    devices: Iterable[str | torch.device] | str | torch.device | None = None,
    check_copies: bool = True,
    cuda_mode: CudaMode = "error",
    allow_async_d2h: bool = False,
) -> Iterator[SyncAudit]:
    """Fail on any host read of device data (and any unsafe copy) inside the block.

    Scoped to the current thread and asyncio task: other threads and tasks are not policed, and a
    task started inside the block inherits it. Nestable: an inner block replaces the settings of
    an outer one until it exits, and re-arms the audit inside :func:`allow_device_sync`. Usable
    as a decorator.

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
    with _armed(_make_audit(devices, check_copies, cuda_mode, allow_async_d2h)) as audit:
        yield audit


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
    plain = _make_audit(devices, check_copies, cuda_mode, allow_async_d2h)
    recording = _Recording(plain.devices, plain.check_copies, plain.cuda_mode, plain.allow_async_d2h)
    with _armed(recording):
        yield recording.found


@contextlib.contextmanager
def _armed(audit: SyncAudit) -> Iterator[SyncAudit]:
    use_cuda = audit.cuda_mode != "off" and torch.cuda.is_available()
    token = _ACTIVE.set(audit)
    _push_thread_modes()
    _THREAD.last_op = None
    try:
        if use_cuda:
            _cuda_acquire()
        try:
            yield audit
        finally:
            if use_cuda:
                _cuda_release()
    finally:
        _pop_thread_modes()
        _ACTIVE.reset(token)


@contextlib.contextmanager
def allow_device_sync() -> Iterator[None]:
    """Suspend the audit of the current thread/task for a deliberate host read.

    An inner :func:`no_device_sync` re-arms it. Outside any audit this does nothing.

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
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# --------------------------------------------------------------------------------------------
# Locating the user's line
# --------------------------------------------------------------------------------------------

_TORCH_DIR: Final = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIP_FILES: Final = frozenset(
    os.path.abspath(f) for f in (__file__, warnings.__file__ or "", contextlib.__file__ or "")
)


def _user_frame() -> traceback.FrameSummary | None:
    """The innermost frame outside torch, this module, :mod:`warnings` and :mod:`contextlib`."""
    f = sys._getframe(1)
    while f is not None:
        filename = f.f_code.co_filename
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if not path.startswith(_TORCH_DIR) and path not in _SKIP_FILES:
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


_Found: TypeAlias = "tuple[ViolationKind, str]"


def _violation(op: str, found: tuple[ViolationKind, str]) -> DeviceSyncError:
    kind, reason = found
    return DeviceSyncError(op, reason, kind=kind, frame=_user_frame())


def _report(audit: SyncAudit, op: str, found: tuple[ViolationKind, str]) -> None:
    """Raise the violation; under :func:`record_device_syncs`, record it and let the op run."""
    __tracebackhide__ = True
    error = _violation(op, found)
    if isinstance(audit, _Recording):
        audit.found.append(error)
        return
    raise error


# --------------------------------------------------------------------------------------------
# Rules shared by both modes
# --------------------------------------------------------------------------------------------

_R_HOST_READ: Final = (
    "reads a device value on the host (.item(), bool(), int(), float(), `if t:`, a device tensor "
    "used as a Python number); the host waits for all queued device work. Keep the value on the "
    "host (numpy) where it was computed"
)
_R_DATA_SHAPE: Final = (
    "its output shape depends on device data, so the host must read it first (nonzero, "
    "masked_select, unique, bincount, torch.where(cond), argwhere); derive sizes on the host, or "
    "use fixed-size ops (nonzero_static, where(cond, a, b), masked_fill)"
)
_R_HOST_BOOL: Final = "returns a host bool computed from device data; the host waits for the device"
_R_REPEAT: Final = (
    "repeat_interleave with device repeats and no output_size reads the total from the device; "
    "pass output_size= (known on the host)"
)
_R_ONE_HOT: Final = "one_hot without num_classes reads max() from the device; pass num_classes="
_R_HISTC: Final = (
    "histc without an explicit range (min == max) reads min/max from the device; pass min= and max="
)
_R_BOOL_MASK: Final = (
    "boolean-mask indexing with a device mask calls nonzero (the output shape depends on device "
    "data); use torch.where / masked_fill, a host mask, or index tensors derived on the host"
)
_R_HOST_INDEX: Final = (
    "indexing device data with a host integer index tensor uploads the index with a blocking copy; "
    "upload it once with non_blocking=True from pinned memory (or cache it on the device)"
)
_R_HOST_VALUE: Final = (
    "index_put_ with a host value tensor uploads it with a blocking copy; use index_fill_ with a "
    "Python scalar, or put a device tensor"
)
_R_D2H_BLOCKING: Final = (
    "a blocking device->host copy (.cpu(), .to('cpu'), .tolist(), printing): the host waits for "
    "all queued device work. Keep a host twin (the *_cpu field) instead"
)
_R_D2H_RACE: Final = (
    "a non-blocking device->host copy: the host tensor is undefined until the stream reaches the "
    "copy, so reading it soon is a race and waiting for it is a sync (attnmeta never copies "
    "device->host). Pass allow_async_d2h=True if you synchronise on an event before reading"
)
_R_H2D_BLOCKING: Final = (
    "a blocking host->device copy (torch.tensor(..., device=), .to(device)/.cuda()/copy_ without "
    "non_blocking=True): the host waits for the stream. Copy from pinned memory with "
    "non_blocking=True"
)
_R_PAGEABLE: Final = (
    "a non-blocking host<->device copy whose host side is pageable (not pinned): torch stages it "
    "through a bounce buffer and it can block. Copy through a pinned staging buffer"
)
_R_NONCONTIG: Final = (
    "a non-blocking host<->device copy whose host side is not contiguous: torch first makes a "
    "pageable contiguous temporary. Stage into a contiguous pinned buffer"
)
_R_BROADCAST: Final = (
    "copy_ broadcasts a host tensor into a device tensor of another shape: torch materialises a "
    "pageable temporary. Copy a host tensor of the destination's shape, or use fill_"
)
_R_FACTORY: Final = (
    "builds the tensor from host data and uploads it with a blocking copy; fill a pinned staging "
    "buffer and copy it with non_blocking=True"
)
_R_SCALAR_SET: Final = (
    "assigning a Python scalar to one element of device data uploads a 0-dim host tensor with a "
    "blocking copy; write slices (dev[a:b] = v), use fill_, or index_fill_ with a device index"
)
_R_SCALAR_INDEX_PUT: Final = (
    "assigning a Python scalar through an integer index tensor runs index_put_ with the scalar as a "
    "0-dim host tensor, uploaded with a blocking copy; use index_fill_(dim, device_index, value)"
)
_R_SCALAR_HOST_MASK: Final = (
    "assigning a Python scalar through a host boolean mask is not a masked fill (the mask is not on "
    "the device): index_put_ uploads the scalar with a blocking copy; upload the mask once "
    "(non_blocking=True) and use masked_fill_"
)
_R_LIST_INDEX: Final = (
    "indexing device data with a Python list or numpy array builds the index on the host and "
    "uploads it with a blocking copy; keep index tensors on the device (built once, uploaded "
    "non-blocking)"
)
_R_TOLIST: Final = "copies device data to the host and waits for it; keep a host twin (numpy) instead"
_R_EXPLICIT_SYNC: Final = "an explicit synchronisation: the host waits for the device"


def _flat_tensors(args: Iterable[Any]) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _flat_tensors(a)


def _any_device(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    return any(audit.is_device(t.device) for t in _flat_tensors((*args, *kwargs.values())))


def _copy_violation(
    audit: SyncAudit,
    src: torch.Tensor,
    dst_device: torch.device,
    non_blocking: bool,
    dst: torch.Tensor | None,
) -> tuple[ViolationKind, str] | None:
    """The rule for one copy from ``src`` to ``dst_device`` (``dst`` given for ``copy_``)."""
    if src.numel() == 0:
        return None
    src_dev, dst_dev = audit.is_device(src.device), audit.is_device(dst_device)
    if src_dev == dst_dev:
        return None  # host->host or device->device
    if src_dev:  # device -> host
        if not non_blocking:
            return "sync", _R_D2H_BLOCKING
        if not audit.allow_async_d2h:
            return "race", _R_D2H_RACE
        if audit.check_copies and dst is not None and src.device.type not in _NO_PINNING:
            if not dst.is_contiguous():
                return "pageable-copy", _R_NONCONTIG
            if not dst.is_pinned():
                return "pageable-copy", _R_PAGEABLE
        return None
    # host -> device
    if not non_blocking:
        return "sync", _R_H2D_BLOCKING
    if audit.check_copies:
        if not src.is_contiguous():
            return "pageable-copy", _R_NONCONTIG
        if dst is not None and tuple(src.shape) != tuple(dst.shape):
            return "pageable-copy", _R_BROADCAST
        if dst_device.type not in _NO_PINNING and not src.is_pinned():
            return "pageable-copy", _R_PAGEABLE
    return None


# --------------------------------------------------------------------------------------------
# Layer 1: the dispatch mode (aten ops)
# --------------------------------------------------------------------------------------------

_DispatchRule: TypeAlias = Callable[
    [SyncAudit, Sequence[Any], Mapping[str, Any]], "tuple[ViolationKind, str] | None"
]
aten = torch.ops.aten


def _rule_host_read(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    return ("sync", _R_HOST_READ) if _any_device(audit, args, kwargs) else None


def _rule_host_bool(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    return ("sync", _R_HOST_BOOL) if _any_device(audit, args, kwargs) else None


def _rule_data_shape(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    return ("sync", _R_DATA_SHAPE) if _any_device(audit, args, kwargs) else None


def _rule_repeat_interleave(
    audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> _Found | None:
    # repeat_interleave.Tensor(Tensor repeats, *, SymInt? output_size=None)
    if kwargs.get("output_size") is None and _any_device(audit, args, {}):
        return "sync", _R_REPEAT
    return None


def _rule_one_hot(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if num_classes == -1 and _any_device(audit, args[:1], {}):
        return "sync", _R_ONE_HOT
    return None


def _rule_histc(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    # histc(Tensor self, int bins=100, Scalar min=0, Scalar max=0)
    lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
    hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
    if lo == hi and _any_device(audit, args[:1], {}):
        return "sync", _R_HISTC
    return None


def _index_violation(
    audit: SyncAudit, self: torch.Tensor, indices: Sequence[torch.Tensor | None]
) -> _Found | None:
    if not audit.is_device(self.device):
        return None
    for idx in indices:
        if idx is None:
            continue
        if idx.dtype in _MASK_DTYPES:
            if audit.is_device(idx.device):
                return "sync", _R_BOOL_MASK
        elif not audit.is_device(idx.device) and idx.numel() > 0:
            return "sync", _R_HOST_INDEX
    return None


def _rule_index(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    self = args[0] if args else kwargs["self"]
    indices = args[1] if len(args) > 1 else kwargs["indices"]
    return _index_violation(audit, self, indices)


def _masked_fill_shortcut(
    audit: SyncAudit, self: torch.Tensor, indices: Sequence[torch.Tensor | None], values: torch.Tensor
) -> bool:
    """torch's ``canDispatchToMaskedFill``: ``dev[dev_mask] = 3`` runs as a masked fill.

    torch takes the shortcut for a one-element value on the host. On CUDA, ``dev[mask] = 3`` builds
    that value on the host; on other devices torch builds it on the device, so a Python-scalar
    assignment (seen by the function mode) counts as a host value too.
    """
    host_value = values.device.type == "cpu" and not audit.is_device(values.device)
    if not (values.numel() == 1 and (host_value or _THREAD.python_scalar_setitem)):
        return False
    masks = [i for i in indices if i is not None]
    return len(masks) == 1 and masks[0].dtype in _MASK_DTYPES and masks[0].device == self.device


def _rule_index_put(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    self = args[0] if args else kwargs["self"]
    indices = args[1] if len(args) > 1 else kwargs["indices"]
    values = args[2] if len(args) > 2 else kwargs["values"]
    if not audit.is_device(self.device):
        return None
    if _masked_fill_shortcut(audit, self, indices, values):
        return None
    found = _index_violation(audit, self, indices)
    if found is not None:
        return found
    if not audit.is_device(values.device) and values.numel() > 0:
        return "sync", _R_HOST_VALUE
    return None


def _rule_to_copy(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    src = args[0] if args else kwargs["self"]
    device = kwargs.get("device")
    dst_device = src.device if device is None else torch.device(device)
    return _copy_violation(audit, src, dst_device, bool(kwargs.get("non_blocking", False)), None)


def _rule_copy(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    dst = args[0] if args else kwargs["self"]
    src = args[1] if len(args) > 1 else kwargs["src"]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return _copy_violation(audit, src, dst.device, bool(non_blocking), dst)


def _explicit_rules() -> dict[Any, _DispatchRule]:
    rules: dict[Any, _DispatchRule] = {}

    def add(names: Iterable[str], rule: _DispatchRule) -> None:
        for name in names:
            packet_name, _, overload = name.partition(".")
            packet = getattr(aten, packet_name, None)
            op = getattr(packet, overload or "default", None) if packet is not None else None
            if op is not None:
                rules[op] = rule

    add(("_local_scalar_dense", "item", "is_nonzero"), _rule_host_read)
    add(("equal", "allclose"), _rule_host_bool)
    add(
        (
            "nonzero",
            "nonzero.out",
            "nonzero_numpy",
            "argwhere",
            "masked_select",
            "masked_select.out",
            "_unique",
            "_unique2",
            "unique_dim",
            "unique_consecutive",
            "unique_dim_consecutive",
            "bincount",
            "_ctc_loss.Tensor",
        ),
        _rule_data_shape,
    )
    add(("repeat_interleave.Tensor",), _rule_repeat_interleave)
    add(("one_hot",), _rule_one_hot)
    add(("histc", "histc.out"), _rule_histc)
    add(("index.Tensor", "_unsafe_index.Tensor"), _rule_index)
    add(("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"), _rule_index_put)
    add(("_to_copy",), _rule_to_copy)
    add(("copy_", "copy", "copy.out"), _rule_copy)
    return rules


_EXPLICIT_RULES: Final = _explicit_rules()
# Ops torch tags as data-dependent that do not read device data on the host (host int lists).
_NOT_DATA_DEPENDENT: Final = frozenset(
    op for op in (getattr(aten._ctc_loss, "default", None),) if op is not None
)
_RULE_CACHE: dict[Any, _DispatchRule | None] = {}
_DATA_TAGS: Final = tuple(
    t
    for t in (
        getattr(torch.Tag, "dynamic_output_shape", None),
        getattr(torch.Tag, "data_dependent_output", None),
    )
    if t is not None
)


def _dispatch_rule(func: Any) -> _DispatchRule | None:
    """The rule for an aten overload: explicit, else by torch's data-dependence tags, else None."""
    try:
        return _RULE_CACHE[func]
    except KeyError:
        pass
    rule = _EXPLICIT_RULES.get(func)
    if rule is None and func not in _NOT_DATA_DEPENDENT:
        tags = getattr(func, "tags", ())
        if any(t in tags for t in _DATA_TAGS):
            rule = _rule_data_shape
    _RULE_CACHE[func] = rule
    return rule


class _DispatchAudit(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Layer 1: rejects aten ops that read device data on the host (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in torch._disable_dynamo otherwise, whose first call
        # imports torch._dynamo (seconds). The audit is not meant for torch.compile regions.
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        __tracebackhide__ = True  # pytest: end the traceback at the user's line
        kwargs = kwargs or {}
        audit = _ACTIVE.get()
        if audit is None:
            return func(*args, **kwargs)
        rule = _dispatch_rule(func)
        if rule is not None:
            found = rule(audit, args, kwargs)
            if found is not None:
                _report(audit, str(func), found)
        _THREAD.last_op = func
        try:
            return func(*args, **kwargs)
        except DeviceSyncError:
            raise
        except RuntimeError as e:  # torch's own sync debug mode set to "error" by the process
            if audit.cuda_mode != "off" and _TORCH_SYNC_TEXT in str(e):
                raise _violation(str(func), ("sync", f"torch's CUDA sync debug mode: {e}")) from e
            raise


# --------------------------------------------------------------------------------------------
# Layer 2: the function mode (Python-level calls that never look like a host read to aten)
# --------------------------------------------------------------------------------------------

_FunctionRule: TypeAlias = Callable[
    [SyncAudit, Sequence[Any], Mapping[str, Any]], "tuple[ViolationKind, str] | None"
]


def _rule_tensor_host_read(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    self = args[0]
    if isinstance(self, torch.Tensor) and audit.is_device(self.device):
        return "sync", _R_TOLIST
    return None


def _rule_numpy_view(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    # A numpy view of a CPU tensor is zero-copy: it is how host staging buffers are written, so it
    # is not flagged even where CPU tensors are declared device data. For other devices torch
    # refuses anyway; the audit says why first.
    self = args[0]
    if isinstance(self, torch.Tensor) and self.device.type != "cpu" and audit.is_device(self.device):
        return "sync", _R_TOLIST
    return None


def _target_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        return None


def _factory_violation(audit: SyncAudit, data: Any, device: torch.device | None) -> _Found | None:
    if device is None or not audit.is_device(device):
        return None
    if isinstance(data, torch.Tensor) and data.device.type == device.type:
        return None  # no copy
    if isinstance(data, torch.Tensor) and data.numel() == 0:
        return None
    return "sync", _R_FACTORY


def _rule_tensor_factory(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    # torch.tensor(data, *, device=), torch.as_tensor(data, dtype=None, device=None), torch.asarray
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    device = kwargs.get("device", args[2] if len(args) > 2 else None)
    return _factory_violation(audit, data, _target_device(device))


def _rule_new_tensor(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    self, data = args[0], (args[1] if len(args) > 1 else kwargs.get("data"))
    device = _target_device(kwargs.get("device")) or self.device
    return _factory_violation(audit, data, device)


def _host_sequence_index(index: Any) -> bool:
    """A Python list of numbers (not of tensors/slices) or a numpy array used as an index."""
    if isinstance(index, np.ndarray):
        return True
    if isinstance(index, list):
        return all(
            isinstance(e, (numbers.Number, list)) and not isinstance(e, torch.Tensor) for e in index
        ) and all(_host_sequence_index(e) for e in index if isinstance(e, list))
    return False


def _index_entries(index: Any) -> tuple[Any, ...]:
    return index if isinstance(index, tuple) else (index,)


def _rule_getitem(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    self, index = args[0], args[1]
    if not (isinstance(self, torch.Tensor) and audit.is_device(self.device)):
        return None
    if _host_sequence_index(index) or any(_host_sequence_index(e) for e in _index_entries(index)):
        return "sync", _R_LIST_INDEX
    return None


def _is_int_index(e: Any) -> bool:
    if isinstance(e, bool):
        return False
    if isinstance(e, numbers.Integral):
        return True
    return (
        isinstance(e, torch.Tensor)
        and e.dim() == 0
        and not e.is_floating_point()
        and e.dtype not in _MASK_DTYPES
    )


def _rule_setitem(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Found | None:
    found = _rule_getitem(audit, args, kwargs)
    if found is not None:
        return found
    self, index, value = args[0], args[1], args[2]
    if not (isinstance(self, torch.Tensor) and audit.is_device(self.device)):
        return None
    if not _is_python_scalar(value):
        return None  # a tensor value: the dispatch rules see its copy_ / index_put_
    entries = _index_entries(index)
    index_tensors = [e for e in entries if isinstance(e, torch.Tensor) and not _is_int_index(e)]
    if any(t.dtype not in _MASK_DTYPES for t in index_tensors):
        return "sync", _R_SCALAR_INDEX_PUT
    if any(t.device != self.device for t in index_tensors):
        return "sync", _R_SCALAR_HOST_MASK  # not a masked fill: index_put_ uploads the scalar
    scalar_element = (
        not index_tensors
        and all(_is_int_index(e) or e is None or e is Ellipsis for e in entries)
        and sum(1 for e in entries if _is_int_index(e)) == self.dim()
    )
    if scalar_element:  # the indexed view is 0-dim: a blocking copy_ of a 0-dim host tensor
        return "sync", _R_SCALAR_SET
    return None


def _is_python_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, torch.Tensor)


def _function_rules() -> dict[Any, tuple[str, _FunctionRule]]:
    rules: dict[Any, tuple[str, _FunctionRule]] = {
        torch.Tensor.tolist: ("Tensor.tolist", _rule_tensor_host_read),
        torch.Tensor.numpy: ("Tensor.numpy", _rule_numpy_view),
        torch.Tensor.__array__: ("Tensor.__array__", _rule_numpy_view),
        torch.Tensor.cpu: ("Tensor.cpu", _rule_tensor_host_read),
        torch.Tensor.__getitem__: ("Tensor.__getitem__", _rule_getitem),
        torch.Tensor.__setitem__: ("Tensor.__setitem__", _rule_setitem),
        torch.Tensor.new_tensor: ("Tensor.new_tensor", _rule_new_tensor),
        torch.tensor: ("torch.tensor", _rule_tensor_factory),
        torch.as_tensor: ("torch.as_tensor", _rule_tensor_factory),
    }
    asarray = getattr(torch, "asarray", None)
    if asarray is not None:
        rules[asarray] = ("torch.asarray", _rule_tensor_factory)
    return rules


_FUNCTION_RULES: Final = _function_rules()
_SETITEM: Final = torch.Tensor.__setitem__


class _FunctionAudit(TorchFunctionMode):
    """Layer 2: rejects Python-level calls that read device data or upload with a blocking copy."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        __tracebackhide__ = True
        kwargs = kwargs or {}
        audit = _ACTIVE.get()
        if audit is not None:
            try:
                entry = _FUNCTION_RULES.get(func)
            except TypeError:  # an unhashable callable
                entry = None
            if entry is not None:
                name, rule = entry
                found = rule(audit, args, kwargs)
                if found is not None:
                    _report(audit, name, found)
                if func is _SETITEM and len(args) > 2 and _is_python_scalar(args[2]):
                    state = _THREAD
                    previous, state.python_scalar_setitem = state.python_scalar_setitem, True
                    try:
                        return func(*args, **kwargs)
                    finally:
                        state.python_scalar_setitem = previous
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Per-thread installation of the two modes
# --------------------------------------------------------------------------------------------


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.modes: tuple[_FunctionAudit, _DispatchAudit] | None = None
        self.last_op: Any = None
        self.python_scalar_setitem = False


_THREAD: Final = _ThreadState()


def _push_thread_modes() -> None:
    """Install the modes on this thread's mode stacks (once, however many audits are armed).

    The torch mode stacks are thread-local; the modes stay installed while any audit on this
    thread is open (asyncio tasks interleave on one thread, so their blocks need not nest), and
    they do nothing unless the current context has an audit armed.
    """
    state = _THREAD
    state.depth += 1
    if state.depth == 1:
        modes = (_FunctionAudit(), _DispatchAudit())
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
    state = _THREAD
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


# --------------------------------------------------------------------------------------------
# Layer 3: torch's CUDA sync debug mode, scoped per thread/task through a warnings hook
# --------------------------------------------------------------------------------------------


class _CudaDebug:
    """Process-wide state of the CUDA sync debug mode as the audit arms it (guarded by ``lock``)."""

    lock = threading.Lock()
    users = 0
    saved_mode = 0
    raised = False  # True when the audit switched torch from "default" (0) to "warn" (1)


def _sync_warning_hook(msg: warnings.WarningMessage, *, previous: Callable[[Any], None]) -> None:
    __tracebackhide__ = True
    if _TORCH_SYNC_TEXT in str(msg.message):
        audit = _ACTIVE.get()
        if audit is not None and audit.cuda_mode != "off":
            if audit.cuda_mode == "error":
                last = _THREAD.last_op
                where = f" (the last aten op before it on this thread: {last})" if last is not None else ""
                _report(
                    audit,
                    "cuda-sync-debug-mode",
                    ("sync", f"torch's CUDA sync debug mode reported a synchronizing CUDA operation{where}"),
                )
                return
        elif _CudaDebug.raised:
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
    warnings.filterwarnings("always", message=_TORCH_SYNC_TEXT, category=UserWarning)


def _remove_always_filter() -> None:
    filters = cast("list[Any]", warnings.filters)
    for i, f in enumerate(filters):
        if f[0] == "always" and f[2] is UserWarning and getattr(f[1], "pattern", None) == _TORCH_SYNC_TEXT:
            del filters[i]
            warnings._filters_mutated()  # type: ignore[attr-defined]
            break


def _cuda_acquire() -> None:
    with _CudaDebug.lock:
        _install_warning_hook()
        _patch_explicit_syncs()
        if _CudaDebug.users == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the debug mode is a prototype
                mode = int(torch.cuda.get_sync_debug_mode())
                _CudaDebug.saved_mode = mode
                _CudaDebug.raised = mode == 0
                if mode == 0:
                    torch.cuda.set_sync_debug_mode(1)
        _CudaDebug.users += 1


def _cuda_release() -> None:
    with _CudaDebug.lock:
        _CudaDebug.users -= 1
        if _CudaDebug.users == 0:
            if _CudaDebug.raised:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.cuda.set_sync_debug_mode(_CudaDebug.saved_mode)
            _CudaDebug.raised = False
            _remove_always_filter()


_PATCHED_SYNCS: dict[str, bool] = {}


def _patch_explicit_syncs() -> None:
    """Make explicit CUDA synchronisations fail in audited threads (torch's debug mode misses them).

    ``torch.cuda.synchronize()`` and ``torch.cuda.Event.synchronize()`` block the host without
    triggering the sync debug mode (measured on torch 2.11); they are wrapped once, process-wide,
    and the wrappers pass straight through unless the current thread/task is audited.
    """

    def guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            audit = _ACTIVE.get()
            if audit is not None and audit.cuda_mode != "off":
                _report(audit, name, ("sync", _R_EXPLICIT_SYNC))
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
        if not _PATCHED_SYNCS.get(name):
            setattr(owner, attr, guard(name, getattr(owner, attr)))
            _PATCHED_SYNCS[name] = True


# --------------------------------------------------------------------------------------------
# Audit targets: builders the audit must cover, and the table `python -m attnmeta audit` prints
# --------------------------------------------------------------------------------------------

AuditTarget: TypeAlias = Callable[[torch.device, int], object]
"""``fn(device, seed)``: build metadata for one generated batch (chosen by ``seed``) on ``device``;
what it returns is ignored."""

_TARGETS: dict[str, AuditTarget] = {}
_TARGETS_LOCK: Final = threading.Lock()


@overload
def register_audit_target(name: str, fn: AuditTarget, *, replace: bool = False) -> AuditTarget: ...


@overload
def register_audit_target(
    name: str, fn: None = None, *, replace: bool = False
) -> Callable[[AuditTarget], AuditTarget]: ...


def register_audit_target(
    name: str, fn: AuditTarget | None = None, *, replace: bool = False
) -> AuditTarget | Callable[[AuditTarget], AuditTarget]:
    """Register a builder that :func:`run_audit` must run under the audit.

    Parameters
    ----------
    name : str
        The row name in the audit table (e.g. ``"flash_attn"``).
    fn : callable, optional
        ``fn(device, seed)``: builds metadata for one generated batch on ``device`` (the same seed
        gives the same batch; the return value is ignored). Omit it to use this as a decorator.
    replace : bool, default False
        Replace an existing target of the same name instead of raising.

    Returns
    -------
    callable
        ``fn`` (or a decorator that registers and returns its argument).

    Raises
    ------
    ValueError
        If ``name`` is empty, or is taken and ``replace`` is False.

    Examples
    --------
    >>> import torch
    >>> from attnmeta.sync import audit_targets, register_audit_target, unregister_audit_target
    >>> @register_audit_target("doc_upload")
    ... def build(device: torch.device, seed: int) -> None:
    ...     torch.arange(seed + 1).to(device, non_blocking=True)
    >>> "doc_upload" in audit_targets()
    True
    >>> unregister_audit_target("doc_upload")
    """
    if not name:
        raise ValueError("register_audit_target: name must be a non-empty string")

    def register(f: AuditTarget) -> AuditTarget:
        with _TARGETS_LOCK:
            if name in _TARGETS and not replace and _TARGETS[name] is not f:
                raise ValueError(f"audit target {name!r} is already registered (pass replace=True)")
            _TARGETS[name] = f
        return f

    return register if fn is None else register(fn)


def unregister_audit_target(name: str) -> None:
    """Remove a registered audit target.

    Raises
    ------
    KeyError
        If no target of that name is registered.

    Examples
    --------
    >>> from attnmeta.sync import register_audit_target, unregister_audit_target
    >>> _ = register_audit_target("doc_noop", lambda device, seed: None)
    >>> unregister_audit_target("doc_noop")
    """
    with _TARGETS_LOCK:
        if name not in _TARGETS:
            raise KeyError(f"no audit target named {name!r}; registered: {sorted(_TARGETS)}")
        del _TARGETS[name]


def audit_targets() -> dict[str, AuditTarget]:
    """The registered audit targets, in registration order (a copy).

    Examples
    --------
    >>> from attnmeta.sync import audit_targets
    >>> isinstance(audit_targets(), dict)
    True
    """
    with _TARGETS_LOCK:
        return dict(_TARGETS)


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRow:
    """What :func:`run_audit` found for one builder on one device.

    Counts are of batches: the first violation stops a batch, so a batch counts once.

    Examples
    --------
    >>> from attnmeta.sync import AuditRow
    >>> AuditRow("flash_attn", "meta", batches=8).clean
    True
    """

    builder: str
    """The audit target's name."""
    device: str
    """The device the batches were built on (``"cuda"``, ``"meta"``, ``"cpu"``)."""
    batches: int
    """Batches tried."""
    syncs: int = 0
    """Batches stopped by a host read of device data or a blocking copy."""
    pageable_copies: int = 0
    """Batches stopped by a non-blocking copy from pageable or non-contiguous host memory."""
    races: int = 0
    """Batches stopped by a non-blocking device->host copy."""
    errors: int = 0
    """Batches that raised something other than :class:`DeviceSyncError`."""
    first_problem: str | None = None
    """The message of the first violation or error (``"seed N: ..."``), or None."""

    @property
    def clean(self) -> bool:
        """True when every batch ran without a violation or an error."""
        return self.syncs == self.pageable_copies == self.races == self.errors == 0


def _default_devices() -> list[torch.device]:
    return [torch.device("cuda" if torch.cuda.is_available() else "meta")]


def run_audit(
    *,
    devices: Iterable[str | torch.device] | None = None,
    batches: int = 16,
    targets: Iterable[str] | None = None,
    seed: int = 0,
    check_copies: bool = True,
    cuda_mode: CudaMode = "error",
) -> list[AuditRow]:
    """Run every registered builder under :func:`no_device_sync` and count what it trips over.

    Each batch ``i`` calls ``fn(device, seed + i)`` inside its own audit, with ``device.type``
    declared as device data; a :class:`DeviceSyncError` (or any other exception) is counted and
    the next batch runs.

    Parameters
    ----------
    devices : iterable of str or torch.device, optional
        Where to build; default ``cuda`` if available, else ``meta``. ``"cpu"`` audits CPU tensors
        as device data.
    batches : int, default 16
        Batches (seeds) per builder and device.
    targets : iterable of str, optional
        Names of the targets to run; default all, in registration order.
    seed : int, default 0
        The first seed.
    check_copies : bool, default True
        As for :func:`no_device_sync`.
    cuda_mode : {"error", "warn", "off"}, default "error"
        As for :func:`no_device_sync`.

    Returns
    -------
    list of AuditRow
        One row per target and device, targets outermost.

    Raises
    ------
    ValueError
        If ``batches`` < 1 or a named target is not registered.

    Examples
    --------
    >>> import torch
    >>> from attnmeta.sync import format_audit_table, register_audit_target, run_audit
    >>> from attnmeta.sync import unregister_audit_target
    >>> def good(device, seed):
    ...     torch.arange(seed + 1, dtype=torch.int32).to(device, non_blocking=True)
    >>> def bad(device, seed):
    ...     torch.arange(seed + 1, device=device).sum().item()
    >>> _ = register_audit_target("doc_good", good)
    >>> _ = register_audit_target("doc_bad", bad)
    >>> rows = run_audit(devices=["meta"], batches=3, targets=["doc_good", "doc_bad"])
    >>> [(r.builder, r.batches, r.syncs, r.clean) for r in rows]
    [('doc_good', 3, 0, True), ('doc_bad', 3, 3, False)]
    >>> rows[1].first_problem.split(" at ")[0]
    'seed 0: aten._local_scalar_dense.default'
    >>> for name in ("doc_good", "doc_bad"):
    ...     unregister_audit_target(name)
    """
    if batches < 1:
        raise ValueError(f"run_audit: batches={batches}, expected >= 1")
    registered = audit_targets()
    names = list(registered) if targets is None else list(targets)
    missing = [n for n in names if n not in registered]
    if missing:
        raise ValueError(f"run_audit: no audit target named {missing}; registered: {sorted(registered)}")
    devs = _default_devices() if devices is None else [torch.device(d) for d in devices]
    rows: list[AuditRow] = []
    for name in names:
        fn = registered[name]
        for dev in devs:
            counts = {"sync": 0, "pageable-copy": 0, "race": 0, "error": 0}
            first: str | None = None
            for i in range(batches):
                batch_seed = seed + i
                try:
                    with no_device_sync(devices={dev.type}, check_copies=check_copies, cuda_mode=cuda_mode):
                        fn(dev, batch_seed)
                except DeviceSyncError as e:
                    counts[e.kind] += 1
                    first = first or f"seed {batch_seed}: {e}"
                except Exception as e:
                    counts["error"] += 1
                    first = first or f"seed {batch_seed}: {type(e).__name__}: {e}"
            rows.append(
                AuditRow(
                    builder=name,
                    device=str(dev),
                    batches=batches,
                    syncs=counts["sync"],
                    pageable_copies=counts["pageable-copy"],
                    races=counts["race"],
                    errors=counts["error"],
                    first_problem=first,
                )
            )
    return rows


def format_audit_table(rows: Sequence[AuditRow]) -> str:
    """A plain-text table of :func:`run_audit` rows, then the first problem of each failing row.

    Examples
    --------
    >>> from attnmeta.sync import AuditRow, format_audit_table
    >>> print(format_audit_table([
    ...     AuditRow("flash_attn", "cuda", 16),
    ...     AuditRow("mamba2", "cuda", 16, syncs=16, first_problem="seed 0: aten.nonzero.default ..."),
    ... ]))
    builder     device  batches  syncs  pageable copies  D2H races  errors  result
    ----------  ------  -------  -----  ---------------  ---------  ------  ------
    flash_attn  cuda         16      0                0          0       0  clean
    mamba2      cuda         16     16                0          0       0  FAIL
    <BLANKLINE>
    mamba2 on cuda: seed 0: aten.nonzero.default ...
    """
    header = ("builder", "device", "batches", "syncs", "pageable copies", "D2H races", "errors", "result")
    body = [
        (
            r.builder,
            r.device,
            str(r.batches),
            str(r.syncs),
            str(r.pageable_copies),
            str(r.races),
            str(r.errors),
            "clean" if r.clean else "FAIL",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    numeric = {2, 3, 4, 5, 6}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(b) for b in body]
    problems = [f"{r.builder} on {r.device}: {r.first_problem}" for r in rows if r.first_problem]
    if problems:
        out += ["", *problems]
    return "\n".join(out)
