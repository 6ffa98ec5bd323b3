"""The sync audit: prove that a block of code never makes the host wait for a device.

A GPU->CPU synchronisation costs all the GPU work still queued, not its own few microseconds: on
a busy engine every ``.item()`` is milliseconds. This package makes such waits fail loudly, on
CPU-only CI as well as on CUDA (the guide: ``docs/sync-audit.md``):

- :func:`no_device_sync` arms the audit for a block (a context manager and a decorator);
  :func:`allow_device_sync` suspends it for a deliberate read. Both are scoped per thread and per
  asyncio task and nest freely. :func:`record_device_syncs` collects the violations of a block
  instead of raising (for counting syncs per step).
- A violation raises :class:`DeviceSyncError`, which names the operation (an aten op such as
  ``aten.nonzero.default``, or a Python-level call such as ``Tensor.tolist``) and the line of user
  code that issued it.
- :func:`register_audit_target`, :func:`run_audit` and :func:`format_audit_table` (:class:`AuditTable`
  a row at a time) run registered
  metadata builders under the audit and tabulate what they found (``python -m attnmeta audit``).

How it works
------------
Three layers, each installed only while an audit is armed:

1. **A torch dispatch mode** (every device type, CPU-only CI included) sees every aten op and
   rejects those that read device data on the host: ``aten._local_scalar_dense`` (``.item()``,
   ``bool()``, ``int()``, ``float()``), ``aten.equal``/``allclose``, ops whose output shape
   depends on device data (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
   ``repeat_interleave`` without ``output_size``, ``one_hot`` without ``num_classes``, ``histc``
   without a range, ``isin`` with many test elements (torch's sorting path calls ``unique``),
   boolean-mask indexing with a device mask), ops whose kernel reads a device input on the host
   (a 0-dim device value of ``masked_fill``/``index_fill``, ``linspace``/``logspace`` bounds,
   ``normal``'s device ``std``) or checks its result there (the checking linalg functions),
   device->host copies, blocking host->device copies, host index tensors used on device data, and
   - the copy checker - non-blocking host->device copies whose host side is pageable (CUDA) or not
   contiguous.
2. **A torch function mode** catches what never reaches an aten op as a host read:
   ``Tensor.tolist``/``numpy``/``__array__``/``cpu``, printing or formatting a device tensor
   (``Tensor.__repr__``/``__format__``), ``torch.tensor(data, device=...)`` and friends (blocking
   uploads; a list of device tensors, each read on the host), ``dev[i] = 3`` (a 0-dim blocking
   upload) and indexing with a Python list or numpy array (a blocking upload of the index).
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
``VLLM_GPU_SYNC_CHECK`` does: a lock-protected
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
``t.to("cpu", non_blocking=True)`` does not block (see ``docs/sync-audit.md``), but the host
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

Layout
------
The package's private modules follow the layers above: ``_state`` (the active audit and the
per-thread state every layer reads), ``_errors`` (:class:`DeviceSyncError`, locating the user's
line, reporting), ``_rules`` (reasons and the copy checker both modes share), ``_dispatch``
(layer 1), ``_function`` (layer 2), ``_cuda`` (layer 3), ``_context`` (the context managers that
arm the audit and install the modes) and ``_targets`` (the registry of builders, :func:`run_audit`
and its table). Everything public is imported from here.

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

from attnmeta.sync._context import (
    allow_device_sync,
    current_audit,
    make_audit,
    no_device_sync,
    record_device_syncs,
)
from attnmeta.sync._errors import DeviceSyncError
from attnmeta.sync._state import CudaMode, SyncAudit, ViolationKind
from attnmeta.sync._targets import (
    AuditRow,
    AuditTable,
    AuditTarget,
    audit_targets,
    format_audit_table,
    register_audit_target,
    run_audit,
    unregister_audit_target,
)

__all__ = [
    "AuditRow",
    "AuditTable",
    "AuditTarget",
    "CudaMode",
    "DeviceSyncError",
    "SyncAudit",
    "ViolationKind",
    "allow_device_sync",
    "audit_targets",
    "current_audit",
    "format_audit_table",
    "make_audit",
    "no_device_sync",
    "record_device_syncs",
    "register_audit_target",
    "run_audit",
    "unregister_audit_target",
]

# The public classes and functions are defined in the private modules but belong to this package:
# tracebacks name `attnmeta.sync.DeviceSyncError`, pickles refer to `attnmeta.sync.SyncAudit`, and
# the API checks and doctests of the package find them here.
for _public in (
    AuditRow,
    AuditTable,
    DeviceSyncError,
    SyncAudit,
    allow_device_sync,
    audit_targets,
    current_audit,
    format_audit_table,
    make_audit,
    no_device_sync,
    record_device_syncs,
    register_audit_target,
    run_audit,
    unregister_audit_target,
):
    _public.__module__ = __name__
del _public
