"""The rules both audit modes share: the reasons a violation gives, and the copy checker.

The dispatch mode (:mod:`attnmeta.sync._dispatch`), the function mode
(:mod:`attnmeta.sync._function`) and the CUDA layer (:mod:`attnmeta.sync._cuda`) report
violations with the reasons defined here (``R_*``: what the operation does wrong and what to do
instead). :func:`copy_violation` decides whether one host<->device copy is a sync, a copy from
pageable or non-contiguous host memory, or a device->host race.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, TypeAlias

import torch

from attnmeta.sync._state import SyncAudit, ViolationKind

__all__ = [
    "MASK_DTYPES",
    "R_BOOL_MASK",
    "R_BROADCAST",
    "R_D2H_BLOCKING",
    "R_D2H_RACE",
    "R_DATA_SHAPE",
    "R_EXPLICIT_SYNC",
    "R_FACTORY",
    "R_FACTORY_ITEMS",
    "R_H2D_BLOCKING",
    "R_HISTC",
    "R_HOST_BOOL",
    "R_HOST_INDEX",
    "R_HOST_READ",
    "R_HOST_VALUE",
    "R_ISIN",
    "R_KERNEL_CHECK",
    "R_KERNEL_READ",
    "R_LIST_INDEX",
    "R_NONCONTIG",
    "R_ONE_HOT",
    "R_PAGEABLE",
    "R_PRINT",
    "R_REPEAT",
    "R_SCALAR_HOST_MASK",
    "R_SCALAR_INDEX_PUT",
    "R_SCALAR_SET",
    "R_TOLIST",
    "TORCH_SYNC_TEXT",
    "Found",
    "any_device",
    "copy_violation",
]

TORCH_SYNC_TEXT: Final = "called a synchronizing CUDA operation"
"""The text of torch's CUDA sync debug mode warning (and of its error, in ``"error"`` mode)."""
# Device types whose host side may need pinning; pinned memory does not exist for these.
_NO_PINNING: Final = frozenset({"meta", "cpu"})
MASK_DTYPES: Final = (torch.bool, torch.uint8)
"""Index dtypes torch treats as boolean masks."""

Found: TypeAlias = "tuple[ViolationKind, str]"
"""What a rule returns for a violation: its kind and the reason."""

# --------------------------------------------------------------------------------------------
# Reasons: what the operation does wrong, and what to do instead
# --------------------------------------------------------------------------------------------

R_HOST_READ: Final = (
    "reads a device value on the host (.item(), bool(), int(), float(), `if t:`, a device tensor "
    "used as a Python number); the host waits for all queued device work. Keep the value on the "
    "host (numpy) where it was computed"
)
R_DATA_SHAPE: Final = (
    "its output shape depends on device data, so the host must read it first (nonzero, "
    "masked_select, unique, bincount, torch.where(cond), argwhere); derive sizes on the host, or "
    "use fixed-size ops (nonzero_static, where(cond, a, b), masked_fill)"
)
R_HOST_BOOL: Final = "returns a host bool computed from device data; the host waits for the device"
R_REPEAT: Final = (
    "repeat_interleave with device repeats and no output_size reads the total from the device; "
    "pass output_size= (known on the host)"
)
R_ONE_HOT: Final = "one_hot without num_classes reads max() from the device; pass num_classes="
R_HISTC: Final = (
    "histc without an explicit range (min == max) reads min/max from the device; pass min= and max="
)
R_ISIN: Final = (
    "isin with test_elements.numel() >= int(10 * elements.numel() ** 0.145) takes torch's sorting path, "
    "which synchronises (with or without assume_unique; without it, it also calls unique, whose output "
    "size is read from the device); compare by broadcasting, (elements[..., None] == test_elements).any(-1), "
    "or on the host"
)
R_BOOL_MASK: Final = (
    "boolean-mask indexing with a device mask calls nonzero (the output shape depends on device "
    "data); use torch.where / masked_fill, a host mask, or index tensors derived on the host"
)
R_HOST_INDEX: Final = (
    "indexing device data with a host integer index tensor uploads the index with a blocking copy; "
    "upload it once with non_blocking=True from pinned memory (or cache it on the device)"
)
R_HOST_VALUE: Final = (
    "index_put_ with a host value tensor uploads it with a blocking copy; use index_fill_ with a "
    "Python scalar, or put a device tensor"
)
R_D2H_BLOCKING: Final = (
    "a blocking device->host copy (.cpu(), .to('cpu'), .tolist(), printing): the host waits for "
    "all queued device work. Keep a host twin (the *_cpu field) instead"
)
R_D2H_RACE: Final = (
    "a non-blocking device->host copy: the host tensor is undefined until the stream reaches the "
    "copy, so reading it soon is a race and waiting for it is a sync (attnmeta never copies "
    "device->host). Pass allow_async_d2h=True if you synchronise on an event before reading"
)
R_H2D_BLOCKING: Final = (
    "a blocking host->device copy (torch.tensor(..., device=), .to(device)/.cuda()/copy_ without "
    "non_blocking=True): the host waits for the stream. Copy from pinned memory with "
    "non_blocking=True"
)
R_PAGEABLE: Final = (
    "a non-blocking host<->device copy whose host side is pageable (not pinned): torch stages it "
    "through a bounce buffer and it can block. Copy through a pinned staging buffer"
)
R_NONCONTIG: Final = (
    "a non-blocking host<->device copy whose host side is not contiguous: torch first makes a "
    "pageable contiguous temporary. Stage into a contiguous pinned buffer"
)
R_BROADCAST: Final = (
    "copy_ broadcasts a host tensor into a device tensor of another shape: torch materialises a "
    "pageable temporary. Copy a host tensor of the destination's shape, or use fill_"
)
R_FACTORY: Final = (
    "builds the tensor from host data and uploads it with a blocking copy; fill a pinned staging "
    "buffer and copy it with non_blocking=True"
)
R_SCALAR_SET: Final = (
    "assigning a Python scalar to one element of device data uploads a 0-dim host tensor with a "
    "blocking copy; write slices (dev[a:b] = v), use fill_, or index_fill_ with a device index"
)
R_SCALAR_INDEX_PUT: Final = (
    "assigning a Python scalar through an integer index tensor runs index_put_ with the scalar as a "
    "0-dim host tensor, uploaded with a blocking copy; use index_fill_(dim, device_index, value)"
)
R_SCALAR_HOST_MASK: Final = (
    "assigning a Python scalar through a host boolean mask is not a masked fill (the mask is not on "
    "the device): index_put_ uploads the scalar with a blocking copy; upload the mask once "
    "(non_blocking=True) and use masked_fill_"
)
R_LIST_INDEX: Final = (
    "indexing device data with a Python list or numpy array builds the index on the host and "
    "uploads it with a blocking copy; keep index tensors on the device (built once, uploaded "
    "non-blocking)"
)
R_TOLIST: Final = "copies device data to the host and waits for it; keep a host twin (numpy) instead"
R_KERNEL_READ: Final = (
    "its kernel reads a device value on the host before it runs (a 0-dim device tensor as the fill value "
    "of masked_fill/index_fill, as linspace/logspace's start or end, as normal's std; segment_reduce's "
    "device lengths or offsets, which it checks unless unsafe=True); pass a Python number, use "
    "torch.where with the device value, or pass segment_reduce unsafe=True for lengths known valid"
)
R_KERNEL_CHECK: Final = (
    "checks its result on the host (torch's linalg functions read an error code): the host waits for the "
    "device; use the *_ex variant with check_errors=False, or do it on the host"
)
R_PRINT: Final = (
    "formats device data on the host (repr, str, print, f-strings, logging of a tensor): a copy to the "
    "host and a wait; log host twins or shapes instead"
)
R_FACTORY_ITEMS: Final = (
    "builds a tensor from device scalars: torch reads each one on the host; use torch.stack or "
    "torch.cat of the device tensors"
)
R_EXPLICIT_SYNC: Final = "an explicit synchronisation: the host waits for the device"


# --------------------------------------------------------------------------------------------
# Helpers of both modes, and the copy checker
# --------------------------------------------------------------------------------------------


def _flat_tensors(args: Iterable[Any]) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _flat_tensors(a)


def any_device(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether any tensor among ``args``/``kwargs`` (lists and tuples searched) is device data."""
    return any(audit.is_device(t.device) for t in _flat_tensors((*args, *kwargs.values())))


def copy_violation(
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
            return "sync", R_D2H_BLOCKING
        if not audit.allow_async_d2h:
            return "race", R_D2H_RACE
        if audit.check_copies and dst is not None and src.device.type not in _NO_PINNING:
            if not dst.is_contiguous():
                return "pageable-copy", R_NONCONTIG
            if not dst.is_pinned():
                return "pageable-copy", R_PAGEABLE
        return None
    # host -> device
    if not non_blocking:
        return "sync", R_H2D_BLOCKING
    if audit.check_copies:
        if not src.is_contiguous():
            return "pageable-copy", R_NONCONTIG
        if dst is not None and tuple(src.shape) != tuple(dst.shape):
            return "pageable-copy", R_BROADCAST
        if dst_device.type not in _NO_PINNING and not src.is_pinned():
            return "pageable-copy", R_PAGEABLE
    return None
