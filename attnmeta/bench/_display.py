"""Readable tables of metadata objects (used by the demo); host twins only, never device reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnmeta._fields import MetadataBase

__all__ = ["format_metadata"]


_NONE = ("-", "-", "-", "None")
"""How every field that is None prints: where, dtype, shape, values (one rendering)."""


def _values(v: Any, limit: int) -> str:
    if isinstance(v, np.ndarray):
        if v.ndim >= 2:  # one line: the rows side by side (a row of a 3-D array is itself a nested list)
            rows = [_values(r, limit) if r.ndim > 1 else
                    np.array2string(r[:limit], separator=",") + ("…" if r.shape[0] > limit else "") for r in v[:limit]]
            return "[" + " ".join(rows) + (" …" if v.shape[0] > limit else "") + "]"
        s = np.array2string(v[:limit], separator=",", max_line_width=10_000)
        return s[:-1] + ",…]" if v.shape[0] > limit else s
    return "" if v is None else repr(v)


def _dtype(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return str(v.dtype).removeprefix("torch.")
    if isinstance(v, np.ndarray):
        return str(v.dtype)
    return type(v).__name__


def _shape(v: Any) -> str:
    if isinstance(v, torch.Tensor | np.ndarray):
        return "(" + ", ".join(str(int(d)) for d in v.shape) + ")"
    return "-"


def format_metadata(meta: MetadataBase, *, limit: int = 12, title: str | None = None) -> str:
    """A table of every field: name, where it lives, dtype, shape, values.

    Device tensors print the values of their host twin (the bytes the one copy moved), so the table
    never reads device memory.
    """
    rows: list[tuple[str, str, str, str, str]] = []
    for n, role in meta.field_roles().items():
        v = getattr(meta, n)
        if v is None:
            rows.append((n, *_NONE))
        elif role == "scalar":
            rows.append((n, "host", type(v).__name__, "-", repr(v)))
        elif role == "device":
            twin = meta.host_twin(n)
            host = getattr(meta, twin) if twin else None
            shown = _values(host, limit) if host is not None else "(on the device only: no host twin)"
            where = f"device:{v.device}" if isinstance(v, torch.Tensor) else "-"
            rows.append((n, where, _dtype(v), _shape(v), shown))
        else:
            rows.append((n, "host", _dtype(v), _shape(v), _values(v, limit)))
    hdr = ("field", "where", "dtype", "shape", "values")
    w = [max(len(hdr[i]), *(len(r[i]) for r in rows)) for i in range(4)]  # (a column as wide as its header too)
    head = title or type(meta).__name__
    out = [head, "=" * len(head)]
    out.append(f"{hdr[0]:<{w[0]}}  {hdr[1]:<{w[1]}}  {hdr[2]:<{w[2]}}  {hdr[3]:<{w[3]}}  {hdr[4]}")
    for r in rows:
        out.append(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]:<{w[3]}}  {r[4]}")
    return "\n".join(out)
