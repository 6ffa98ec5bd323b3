"""Layer 2 of the sync audit: a torch function mode for calls that never look like a host read to aten.

It rejects ``Tensor.tolist``/``numpy``/``__array__``/``cpu`` on device data,
``torch.tensor(data, device=...)`` and friends (blocking uploads), ``dev[i] = 3`` (a 0-dim
blocking upload), ``dev[idx] = 3`` through an integer index tensor or a host mask, and indexing
with a Python list or numpy array (a blocking upload of the index). While a Python-scalar
``__setitem__`` runs it sets ``THREAD.python_scalar_setitem``, which the dispatch mode reads.
"""

from __future__ import annotations

import array
import collections.abc
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from attnmeta.sync._errors import report
from attnmeta.sync._rules import (
    MASK_DTYPES,
    R_FACTORY,
    R_FACTORY_ITEMS,
    R_LIST_INDEX,
    R_PRINT,
    R_SCALAR_HOST_MASK,
    R_SCALAR_INDEX_PUT,
    R_SCALAR_SET,
    R_TOLIST,
    Found,
)
from attnmeta.sync._state import ACTIVE, THREAD, SyncAudit, ViolationKind

__all__ = ["FunctionAudit"]

_FunctionRule: TypeAlias = Callable[
    [SyncAudit, Sequence[Any], Mapping[str, Any]], "tuple[ViolationKind, str] | None"
]


def _rule_tensor_host_read(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    self = args[0]
    if isinstance(self, torch.Tensor) and audit.is_device(self.device):
        return "sync", R_TOLIST
    return None


def _rule_numpy_view(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # A numpy view of a CPU tensor is zero-copy: it is how host staging buffers are written, so it
    # is not flagged even where CPU tensors are declared device data. For other devices torch
    # refuses anyway; the audit says why first.
    self = args[0]
    if isinstance(self, torch.Tensor) and self.device.type != "cpu" and audit.is_device(self.device):
        return "sync", R_TOLIST
    return None


def _target_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        return None


def _factory_violation(audit: SyncAudit, data: Any, device: torch.device | None) -> Found | None:
    if device is None or not audit.is_device(device):
        return None
    if isinstance(data, torch.Tensor) and data.device.type == device.type:
        return None  # no copy
    if _empty_host_data(data):
        return None  # (nothing is copied; as the copy checks ignore empty tensors)
    return "sync", R_FACTORY


def _empty_host_data(data: Any) -> bool:
    """Whether ``data`` (a factory's data or an index) holds no element: an empty tensor or array, or a
    sequence whose every entry is empty (``[]``, ``[[]]``)."""
    if isinstance(data, torch.Tensor):
        return data.numel() == 0
    if isinstance(data, np.ndarray):
        return data.size == 0
    if isinstance(data, list | tuple | range | collections.deque | array.array):
        return all(_empty_host_data(e) for e in data)
    return False


def _device_items(audit: SyncAudit, data: Any) -> bool:
    """Whether ``data``, a factory's nested list or tuple, holds a device tensor among its entries (each
    read on the host, ``Tensor.item()``, to build the new tensor)."""
    if isinstance(data, list | tuple):
        return any((isinstance(e, torch.Tensor) and audit.is_device(e.device)) or _device_items(audit, e) for e in data)
    return False


def _rule_tensor_factory(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # torch.tensor(data, *, device=), torch.as_tensor(data, dtype=None, device=None), torch.asarray
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    if _device_items(audit, data):
        return "sync", R_FACTORY_ITEMS
    device = kwargs.get("device", args[2] if len(args) > 2 else None)
    return _factory_violation(audit, data, _target_device(device))


def _rule_print(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    # Tensor.__repr__ / __format__ (str, print, f-strings and logging reach one of them): torch's
    # formatter reads the values (tolist, item, masked_select) on the host
    self = args[0] if args else None
    if isinstance(self, torch.Tensor) and audit.is_device(self.device) and self.numel():  # (empty: nothing read)
        return "sync", R_PRINT
    return None


def _rule_new_tensor(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    self, data = args[0], (args[1] if len(args) > 1 else kwargs.get("data"))
    device = _target_device(kwargs.get("device")) or self.device
    return _factory_violation(audit, data, device)


def _host_sequence_index(index: Any) -> bool:
    """A host sequence of numbers used as an index, which torch uploads as an index tensor: a numpy array,
    a ``range`` or ``array.array``, or a list (a ``deque``, any non-tuple sequence) of numbers or of such
    lists (not of tensors or slices)."""
    if isinstance(index, np.ndarray | range | array.array):
        return True
    if isinstance(index, collections.abc.Sequence | collections.deque) and not isinstance(
            index, tuple | str | bytes | torch.Tensor):
        return all(
            isinstance(e, numbers.Number | list | collections.deque) and not isinstance(e, torch.Tensor) for e in index
        ) and all(_host_sequence_index(e) for e in index if isinstance(e, list | collections.deque))
    return False


def _index_entries(index: Any) -> tuple[Any, ...]:
    return index if isinstance(index, tuple) else (index,)


def _rule_getitem(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
    self, index = args[0], args[1]
    if not (isinstance(self, torch.Tensor) and audit.is_device(self.device)):
        return None
    if any(_host_sequence_index(e) and not _empty_host_data(e) for e in (index, *_index_entries(index))):
        return "sync", R_LIST_INDEX
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
        and e.dtype not in MASK_DTYPES
    )


def _rule_setitem(audit: SyncAudit, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Found | None:
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
    if any(t.dtype not in MASK_DTYPES for t in index_tensors):
        return "sync", R_SCALAR_INDEX_PUT
    if any(t.device != self.device for t in index_tensors):
        return "sync", R_SCALAR_HOST_MASK  # not a masked fill: index_put_ uploads the scalar
    scalar_element = (
        not index_tensors
        and all(_is_int_index(e) or e is None or e is Ellipsis for e in entries)
        and sum(1 for e in entries if _is_int_index(e)) == self.dim()
    )
    if scalar_element:  # the indexed view is 0-dim: a blocking copy_ of a 0-dim host tensor
        return "sync", R_SCALAR_SET
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
        torch.Tensor.__repr__: ("Tensor.__repr__", _rule_print),
        torch.Tensor.__format__: ("Tensor.__format__", _rule_print),
        torch.tensor: ("torch.tensor", _rule_tensor_factory),
        torch.as_tensor: ("torch.as_tensor", _rule_tensor_factory),
    }
    asarray = getattr(torch, "asarray", None)
    if asarray is not None:
        rules[asarray] = ("torch.asarray", _rule_tensor_factory)
    return rules


_FUNCTION_RULES: Final = _function_rules()
_SETITEM: Final = torch.Tensor.__setitem__


class FunctionAudit(TorchFunctionMode):
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
        audit = ACTIVE.get()
        if audit is not None:
            try:
                entry = _FUNCTION_RULES.get(func)
            except TypeError:  # an unhashable callable
                entry = None
            if entry is not None:
                name, rule = entry
                found = rule(audit, args, kwargs)
                if found is not None:
                    report(audit, name, found)
                if func is _SETITEM and len(args) > 2 and _is_python_scalar(args[2]):
                    state = THREAD
                    previous, state.python_scalar_setitem = state.python_scalar_setitem, True
                    try:
                        return func(*args, **kwargs)
                    finally:
                        state.python_scalar_setitem = previous
        return func(*args, **kwargs)
