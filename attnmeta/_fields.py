"""Field roles declared once per metadata type, and the generic methods derived from them.

Every metadata dataclass declares three class-level tuples:

- ``_DEVICE_FIELDS``: torch tensors on the device (views into a step's device arena);
- ``_HOST_FIELDS``: numpy arrays on the host (``<name>_cpu`` twins and host-only arrays);
- ``_SCALAR_FIELDS``: plain Python ints / bools computed at build time.

``__repr__`` (shape dtype device only, never values), ``describe()`` (host values) and the
``replace`` twin check loop over these tuples; none of them is written per class, and none of them
ever reads device memory (STYLE.md items 1 and 11).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from attnmeta._slots import fast_constructor

__all__ = ["MetadataBase", "Staged", "describe_value", "fast_constructor", "summarize_value"]


def summarize_value(v: Any) -> str:
    """One-line summary of a field value that never touches device memory."""
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')} {v.device}"
    if isinstance(v, np.ndarray):
        return f"{v.shape} {v.dtype} host"
    if v is None:
        return "None"
    return repr(v)


def describe_value(v: Any, limit: int) -> str:
    """Values of a host array (first ``limit`` entries); device tensors show shape/dtype/device only."""
    if isinstance(v, np.ndarray):
        flat = v.reshape(-1) if v.ndim > 1 else v
        if v.ndim > 1:
            rows = [np.array2string(r[:limit], separator=", ") + (" ..." if r.shape[0] > limit else "") for r in v[:limit]]
            more = f" ... ({v.shape[0]} rows)" if v.shape[0] > limit else ""
            return f"{v.shape} {v.dtype} host: [" + ", ".join(rows) + more + "]"
        body = np.array2string(flat[:limit], separator=", ")
        more = f" ... ({flat.shape[0]} total)" if flat.shape[0] > limit else ""
        return f"{v.shape} {v.dtype} host: {body}{more}"
    return summarize_value(v)


class MetadataBase:
    """Mixin giving metadata dataclasses their generic, sync-free methods."""

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ()
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ()
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ()
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(device field, host twin) pairs that must always change together."""

    def __repr__(self) -> str:
        parts = [f"{n}={getattr(self, n)!r}" for n in self._SCALAR_FIELDS]
        parts += [f"{n}={summarize_value(getattr(self, n))}" for n in self._DEVICE_FIELDS + self._HOST_FIELDS]
        return f"{type(self).__name__}(" + ", ".join(parts) + ")"

    def describe(self, limit: int = 8) -> str:
        """Readable multi-line description: scalars, host values (first ``limit``), device shapes.

        Reads host twins only; a device tensor is shown as shape, dtype and device.
        """
        lines = [f"{type(self).__name__}"]
        for n in self._SCALAR_FIELDS:
            lines.append(f"  {n:<32} {getattr(self, n)!r}")
        for n in self._DEVICE_FIELDS:
            lines.append(f"  {n:<32} {summarize_value(getattr(self, n))}")
        for n in self._HOST_FIELDS:
            lines.append(f"  {n:<32} {describe_value(getattr(self, n), limit)}")
        return "\n".join(lines)

    def _check_twins(self, changes: dict[str, Any]) -> None:
        for dev, host in self._TWINS:
            if (dev in changes) != (host in changes):
                given, missing = (dev, host) if dev in changes else (host, dev)
                raise ValueError(
                    f"replace(): {given} changed without its twin {missing}; a device field and its host "
                    f"twin always change together (else they would disagree)"
                )

    def field_roles(self) -> dict[str, str]:
        """``{field: "device" | "host" | "scalar"}`` for every declared field."""
        out = {n: "device" for n in self._DEVICE_FIELDS}
        out.update({n: "host" for n in self._HOST_FIELDS})
        out.update({n: "scalar" for n in self._SCALAR_FIELDS})
        return out


T = TypeVar("T")


class Staged(Generic[T]):
    """A builder's result that exists once its step commits.

    ``host`` holds the host-side part (usable by other builders staging into the same step);
    :meth:`result` returns the finished metadata object and raises
    :class:`attnmeta.staging.StepNotCommittedError` before the commit.
    """

    __slots__ = ("_make", "_result", "host", "step")

    def __init__(self, step: Any, host: Any, make: Callable[[], T]) -> None:
        self.step = step
        self.host = host
        self._make = make
        self._result: T | None = None

    def result(self) -> T:
        """The finished metadata (device fields are views into the step's device arena)."""
        r = self._result
        if r is not None:
            return r
        step = self.step
        if not (step._committed and step._generation >= 0):  # Step.committed, inlined
            from attnmeta.staging import StepNotCommittedError

            raise StepNotCommittedError(
                "result(): the step has not committed; leave the `with stager.step()` block (or call "
                "step.commit()) before reading device metadata"
            )
        r = self._result = self._make()
        return r


def dataclass_fields(obj: Any) -> dict[str, Any]:
    """Shallow ``{name: value}`` of a dataclass instance (no deep copies; arrays are shared)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
