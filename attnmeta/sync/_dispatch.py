"""Layer 1 of the sync audit: a torch dispatch mode that rejects aten ops reading device data on the host.

It runs on every device type (CPU-only CI included) and sees every aten op: ``aten._local_scalar_dense``
(``.item()``, ``bool()``, ``int()``, ``float()``), ``aten.equal``/``allclose``, ops whose output
shape depends on device data (``nonzero``, ``masked_select``, ``unique``, ``bincount``, ...,
found by explicit rules and by torch's data-dependence tags), boolean-mask indexing with a device
mask, host index tensors used on device data, and the copy checker for ``_to_copy``/``copy_``.
:data:`RULE_CACHE` memoises the rule of each aten overload. See :mod:`attnmeta.sync` for the whole
list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeAlias

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnmeta.sync._errors import DeviceSyncError, report, violation
from attnmeta.sync._rules import (
    MASK_DTYPES,
    R_BOOL_MASK,
    R_DATA_SHAPE,
    R_HISTC,
    R_HOST_BOOL,
    R_HOST_INDEX,
    R_HOST_READ,
    R_HOST_VALUE,
    R_ISIN,
    R_KERNEL_CHECK,
    R_KERNEL_READ,
    R_ONE_HOT,
    R_REPEAT,
    TORCH_SYNC_TEXT,
    Found,
    any_device,
    copy_violation,
)
from attnmeta.sync._state import ACTIVE, THREAD, SyncAudit, ViolationKind

__all__ = ["RULE_CACHE", "DispatchAudit"]

_DispatchRule: TypeAlias = Callable[
    [SyncAudit, Sequence[Any], Mapping[str, Any]], "tuple[ViolationKind, str] | None"
]
aten = torch.ops.aten


def _rule_host_read(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    return ("sync", R_HOST_READ) if any_device(audit, args, kwargs) else None


def _rule_host_bool(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    return ("sync", R_HOST_BOOL) if any_device(audit, args, kwargs) else None


def _rule_data_shape(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    return ("sync", R_DATA_SHAPE) if any_device(audit, args, kwargs) else None


def _rule_repeat_interleave(
    audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Found | None:
    # repeat_interleave.Tensor(Tensor repeats, *, SymInt? output_size=None)
    if kwargs.get("output_size") is None and any_device(audit, args, {}):
        return "sync", R_REPEAT
    return None


def _rule_one_hot(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if num_classes == -1 and any_device(audit, args[:1], {}):
        return "sync", R_ONE_HOT
    return None


def _rule_histc(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # histc(Tensor self, int bins=100, Scalar min=0, Scalar max=0)
    lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
    hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
    if lo == hi and any_device(audit, args[:1], {}):
        return "sync", R_HISTC
    return None


def _rule_isin(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # isin.Tensor_Tensor / .Scalar_Tensor (elements, test_elements, *, assume_unique=False, invert=False).
    # torch's heuristic (numpy's): with test_elements.numel() >= int(10 * elements.numel() ** 0.145) it
    # takes its sorting path, which synchronises with or without assume_unique (CUDA's debug mode says so:
    # tests/gpu/test_sync_rules_cuda.py); without it, it first calls _unique on both inputs, whose output
    # size is read from the device. (Tensor_Scalar redispatches to eq/ne.)
    elements = args[0] if args else kwargs["elements"]
    test = args[1] if len(args) > 1 else kwargs["test_elements"]
    n = elements.numel() if isinstance(elements, torch.Tensor) else 1
    if n == 0 or not any_device(audit, (elements, test), {}):
        return None
    return ("sync", R_ISIN) if test.numel() >= int(10.0 * float(n) ** 0.145) else None


def _device_arg(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any], at: int, name: str) -> bool:
    """Whether the argument at position ``at`` (or keyword ``name``) is a device tensor."""
    value = args[at] if len(args) > at else kwargs.get(name)
    return isinstance(value, torch.Tensor) and audit.is_device(value.device)


def _rule_kernel_read(at: int, name: str) -> _DispatchRule:
    """A rule for an op whose kernel reads its argument ``at``/``name`` on the host when it is a (0-dim)
    tensor: masked_fill's and index_fill's value (``value.item()``), normal's std (its check)."""
    def rule(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
        return ("sync", R_KERNEL_READ) if _device_arg(audit, args, kwargs, at, name) else None
    return rule


def _rule_range_read(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # linspace / logspace with tensor start or end: at::linspace(start.item(), end.item(), ...)
    return ("sync", R_KERNEL_READ) if _device_arg(audit, args, kwargs, 0, "start") or _device_arg(
        audit, args, kwargs, 1, "end") else None


def _rule_segment_reduce(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    # unless unsafe, SegmentReduce.cpp checks the device lengths on the host (lengths.min().item(),
    # all(lengths.sum(-1) == data.size(axis)).item()); CUDA's debug mode reports it (tests/sync_kernel_cases.py)
    if kwargs.get("unsafe", False):
        return None
    lengths, offsets = kwargs.get("lengths"), kwargs.get("offsets")
    return ("sync", R_KERNEL_READ) if any(
        isinstance(t, torch.Tensor) and audit.is_device(t.device) for t in (lengths, offsets)) else None


def _rule_kernel_check(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    return ("sync", R_KERNEL_CHECK) if any_device(audit, args, kwargs) else None


def _rule_checked_ex(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # linalg_*_ex(..., check_errors=False): with check_errors=True they call _linalg_check_errors, whose
    # own dispatch the mode sees too, but not for a meta input (it returns early)
    return _rule_kernel_check(audit, args, kwargs) if kwargs.get("check_errors", False) else None


def _index_violation(
    audit: SyncAudit, self: torch.Tensor, indices: Sequence[torch.Tensor | None]
) -> Found | None:
    if not audit.is_device(self.device):
        return None
    for idx in indices:
        if idx is None:
            continue
        if idx.dtype in MASK_DTYPES:
            if audit.is_device(idx.device):
                return "sync", R_BOOL_MASK
        elif not audit.is_device(idx.device) and idx.numel() > 0:
            return "sync", R_HOST_INDEX
    return None


def _rule_index(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
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
    if not (values.numel() == 1 and (host_value or THREAD.python_scalar_setitem)):
        return False
    masks = [i for i in indices if i is not None]
    return len(masks) == 1 and masks[0].dtype in MASK_DTYPES and masks[0].device == self.device


def _rule_index_put(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
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
        return "sync", R_HOST_VALUE
    return None


def _rule_to_copy(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    src = args[0] if args else kwargs["self"]
    device = kwargs.get("device")
    dst_device = src.device if device is None else torch.device(device)
    return copy_violation(audit, src, dst_device, bool(kwargs.get("non_blocking", False)), None)


def _rule_copy(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    dst = args[0] if args else kwargs["self"]
    src = args[1] if len(args) > 1 else kwargs["src"]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return copy_violation(audit, src, dst.device, bool(non_blocking), dst)


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
    add(("isin.Tensor_Tensor", "isin.Tensor_Tensor_out", "isin.Scalar_Tensor", "isin.Scalar_Tensor_out"), _rule_isin)
    add(("index.Tensor", "_unsafe_index.Tensor"), _rule_index)
    add(("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"), _rule_index_put)
    add(("masked_fill.Tensor", "masked_fill_.Tensor", "masked_fill.Tensor_out"), _rule_kernel_read(2, "value"))
    add(("index_fill.int_Tensor", "index_fill_.int_Tensor", "index_fill.int_Tensor_out"), _rule_kernel_read(3, "value"))
    add(("normal.Tensor_Tensor", "normal.Tensor_Tensor_out", "normal.float_Tensor", "normal.float_Tensor_out"),
        _rule_kernel_read(1, "std"))
    add(("segment_reduce", "segment_reduce.out"), _rule_segment_reduce)
    add(tuple(f"{op}.{o}" for op in ("linspace", "logspace") for o in (
        "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor", "Tensor_Tensor_out", "Tensor_Scalar_out", "Scalar_Tensor_out")),
        _rule_range_read)
    add(("_linalg_check_errors", "_linalg_eigh", "_linalg_eigh.eigenvalues",
         "_linalg_svd", "_linalg_svd.U", "linalg_eig", "linalg_eig.out", "cholesky", "cholesky.out"),
        _rule_kernel_check)
    add(("linalg_cholesky_ex", "linalg_cholesky_ex.L", "linalg_inv_ex", "linalg_inv_ex.inverse", "linalg_solve_ex",
         "linalg_solve_ex.out", "_linalg_solve_ex", "_linalg_solve_ex.result", "linalg_lu_factor_ex",
         "linalg_lu_factor_ex.out", "linalg_ldl_factor_ex", "linalg_ldl_factor_ex.out"), _rule_checked_ex)
    add(("_to_sparse", "_to_sparse.sparse_dim", "to_sparse", "to_sparse.sparse_dim", "_to_sparse_csr", "_to_sparse_csc",
         "_to_sparse_bsr", "_to_sparse_bsc"), _rule_data_shape)
    add(("_to_copy",), _rule_to_copy)
    add(("copy_", "copy", "copy.out"), _rule_copy)
    return rules


_EXPLICIT_RULES: Final = _explicit_rules()
# Ops torch tags as data-dependent that do not read device data on the host (host int lists).
_NOT_DATA_DEPENDENT: Final = frozenset(
    op for op in (getattr(aten._ctc_loss, "default", None),) if op is not None
)
RULE_CACHE: dict[Any, _DispatchRule | None] = {}
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
        return RULE_CACHE[func]
    except KeyError:
        pass
    rule = _EXPLICIT_RULES.get(func)
    if rule is None and func not in _NOT_DATA_DEPENDENT:
        tags = getattr(func, "tags", ())
        if any(t in tags for t in _DATA_TAGS):
            rule = _rule_data_shape
    RULE_CACHE[func] = rule
    return rule


class DispatchAudit(TorchDispatchMode):  # type: ignore[no-untyped-call]
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
        audit = ACTIVE.get()
        if audit is None:
            return func(*args, **kwargs)
        rule = _dispatch_rule(func)
        if rule is not None:
            found = rule(audit, args, kwargs)
            if found is not None:
                report(audit, str(func), found)
        THREAD.last_op = func
        try:
            return func(*args, **kwargs)
        except DeviceSyncError:
            raise
        except RuntimeError as e:  # torch's own sync debug mode set to "error" by the process
            if audit.cuda_mode != "off" and TORCH_SYNC_TEXT in str(e):
                raise violation(str(func), ("sync", f"torch's CUDA sync debug mode: {e}")) from e
            raise
