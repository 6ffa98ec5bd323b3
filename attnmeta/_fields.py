"""Field roles declared once per metadata type, and the generic methods derived from them.

Every metadata dataclass declares three class-level tuples:

- ``_DEVICE_FIELDS``: torch tensors on the device (views into a step's device arena);
- ``_HOST_FIELDS``: numpy arrays on the host (``<name>_cpu`` twins and host-only arrays);
- ``_SCALAR_FIELDS``: plain Python ints / bools computed at build time.

``__repr__`` (shape dtype device only, never values), ``describe()`` (host values) and the
``replace`` twin check loop over these tuples; none of them is written per class, and none of them
ever reads device memory.

Builders construct a metadata object every step. :func:`keyword_factory` gives them a keyword
constructor of a frozen dataclass without the frozen ``__init__``'s ``object.__setattr__`` call per
field, :func:`positional_factory` a positional one, and :func:`template` a constructor of objects
that share all but a few fields with a recorded one (a replayed step's): one construction trick,
kept here (docs/speed-tricks.md has its A/B).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

__all__ = ["MetadataBase", "describe_value", "keyword_factory", "metadata_parts", "positional_factory", "summarize_value",
           "template"]


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


T = TypeVar("T")


class MetadataBase:
    """Mixin giving metadata dataclasses their generic, sync-free methods.

    Its one slot, ``_lease``, holds the :class:`attnmeta.staging.Step` that owns the object once a
    builder hands it out (:meth:`attnmeta.staging.Step.own`): when that step expires, the object
    becomes an expired twin whose every field read raises
    :class:`attnmeta.staging.StepExpiredError`.
    """

    __slots__ = ("_lease",)

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ()
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ()
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ()
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(device field, host twin) pairs that must always change together."""
    _PREFIX_TWINS: ClassVar[tuple[str, ...]] = ()
    """Host twins that may hold only the leading entries of their device field (graph mode stages the
    rest of a fixed buffer once; each such field's docstring says when)."""

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

    def _derived(self, new: T) -> T:
        """``new``, an object derived from this one (sharing its views), tied to the same step."""
        try:
            lease = self._lease  # type: ignore[attr-defined]
        except AttributeError:  # (never handed out by a step)
            return new
        return lease.own(new)  # type: ignore[no-any-return]

    def field_roles(self) -> dict[str, str]:
        """``{field: "device" | "host" | "scalar"}`` for every declared field: the scalars, then the
        device fields, then the host fields, each in declaration order."""
        out = {n: "scalar" for n in self._SCALAR_FIELDS}
        out.update({n: "device" for n in self._DEVICE_FIELDS})
        out.update({n: "host" for n in self._HOST_FIELDS})
        return out

    def host_twin(self, field: str) -> str | None:
        """The host twin of device field ``field`` (``query_start_loc`` -> ``"query_start_loc_cpu"``), or
        None for a device field without one (or a field that is not a device field)."""
        for dev, host in self._TWINS:
            if dev == field:
                return host
        return None


def keyword_factory(cls: type[T]) -> Callable[..., T]:
    """A keyword constructor of the frozen, slotted dataclass ``cls`` for builders' hot paths.

    ``make = keyword_factory(Cls)`` takes the same keyword arguments as ``Cls(...)`` (same defaults,
    a missing or unknown field is the same ``TypeError``) and returns an ordinary frozen instance of
    ``Cls``. It sets the fields with plain slot stores instead of the frozen ``__init__``'s
    ``object.__setattr__`` call per field: the stores go to an instance of a subclass of ``Cls`` that
    adds no slots and restores plain attribute setting, whose ``__init__`` (that of a non-frozen
    dataclass of the same fields) ends by switching the instance's class to ``Cls``. For a metadata
    type of 20 fields or more that is a third of the cost of ``Cls(...)`` (docs/speed-tricks.md), which
    matters to a builder that builds one per step. Any frozen dataclass works, frozen bases included.

    Examples
    --------
    >>> @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    ... class Pair(MetadataBase):
    ...     a: int
    ...     b: int = 2
    >>> make = keyword_factory(Pair)
    >>> p = make(a=1)
    >>> type(p) is Pair, p.a, p.b
    (True, 1, 2)
    >>> p.a = 5
    Traceback (most recent call last):
    dataclasses.FrozenInstanceError: cannot assign to field 'a'
    """
    specs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING:
            spec = dataclasses.field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            spec = dataclasses.field(default_factory=f.default_factory)
        else:
            spec = dataclasses.field()
        specs.append((f.name, f.type, spec))
    return _twin(cls, specs, kw_only=True)


def positional_factory(cls: type[T]) -> Callable[..., T]:
    """:func:`keyword_factory`'s twin, positional: ``make(*values)`` takes every field of ``cls``, in
    ``dataclasses.fields(cls)`` order, no defaults.

    For a builder that rebuilds an object from a recorded one's field values with a few replaced
    (binding keywords costs more than the stores themselves). Field positions are
    ``[f.name for f in dataclasses.fields(cls)].index(name)``; derive them by name, never write them.

    Examples
    --------
    >>> @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    ... class Pair(MetadataBase):
    ...     a: int
    ...     b: int = 2
    >>> p = positional_factory(Pair)(7, 8)
    >>> type(p) is Pair, p.a, p.b
    (True, 7, 8)
    """
    return _twin(cls, [(f.name, f.type) for f in dataclasses.fields(cls)], kw_only=False)  # type: ignore[arg-type]


def template(obj: T, names: tuple[str, ...]) -> Callable[..., T]:
    """A constructor of objects of ``obj``'s frozen dataclass that share every field with ``obj`` but
    ``names``: ``make(*values)`` takes the values of ``names``, in that order.

    For a builder that makes one object per step of a layout whose other fields do not change (a
    replay, :class:`attnmeta.builder.Replayer`): a direct positional call of the class's
    :func:`positional_factory` with the shared values bound once, so a step pays for its own values
    only (binding every field by keyword costs more than the stores themselves; docs/speed-tricks.md).
    The function's body is compiled once per class and ``names``; each call binds new values to it.

    Examples
    --------
    >>> @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    ... class Trio(MetadataBase):
    ...     a: int
    ...     b: int
    ...     c: int
    >>> make = template(Trio(a=1, b=2, c=3), ("c",))
    >>> t = make(30)
    >>> type(t) is Trio, t.a, t.b, t.c
    (True, 1, 2, 30)
    """
    cls = type(obj)
    code = _TEMPLATE_CODE.get((cls, names))
    if code is None:
        code = _TEMPLATE_CODE[(cls, names)] = _template_code(cls, names)
    base, keys, shared = code
    # (a new function of the one compiled body: only its keyword-only defaults, the shared values, differ)
    make: Callable[..., T] = types.FunctionType(base.__code__, base.__globals__, base.__name__)
    make.__kwdefaults__ = dict(zip(keys, (_POSITIONAL[cls], *(getattr(obj, n) for n in shared)), strict=True))
    make.__qualname__ = base.__qualname__
    return make


_TEMPLATE_CODE: dict[tuple[type, tuple[str, ...]], tuple[Callable[..., Any], tuple[str, ...], tuple[str, ...]]] = {}
""":func:`template`'s compiled body per class and per-call names: the function, the names of its
keyword-only defaults (``_factory``, then one per shared field) and the shared fields, in that order."""


def _template_code(cls: type, names: tuple[str, ...]) -> tuple[Callable[..., Any], tuple[str, ...], tuple[str, ...]]:
    """Compile :func:`template`'s body for ``cls`` and ``names`` (once per pair: the compile is most of
    what a template would cost; a builder makes one per recorded layout, and an engine's decode loop
    records a new layout every few dozen steps)."""
    fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = [n for n in names if n not in fields]
    if unknown:
        raise ValueError(f"template(): {cls.__name__} has no field {unknown}")
    if cls not in _POSITIONAL:
        _POSITIONAL[cls] = positional_factory(cls)
    shared = tuple(n for n in fields if n not in names)
    keys = ("_factory", *(f"_v{i}" for i in range(len(shared))))
    args = ", ".join(f"_a{names.index(n)}" if n in names else f"_v{shared.index(n)}" for n in fields)
    params = ", ".join([*(f"_a{i}" for i in range(len(names))), "*", *(f"{k}=None" for k in keys)])
    env: dict[str, Any] = {}
    # (the shared values are keyword-only defaults: locals of the call, the fastest loads there are)
    exec(f"def make({params}):\n    return _factory({args})\n", env)
    base = env["make"]
    base.__qualname__ = f"template({cls.__name__}, {names})"
    return base, keys, shared


_POSITIONAL: dict[type, Callable[..., Any]] = {}
""":func:`positional_factory` by class, made once."""


def _twin(cls: type[T], specs: list[Any], *, kw_only: bool) -> Callable[..., T]:
    """A subclass of ``cls`` under construction: no slots of its own (so ``cls``'s layout, and the
    instance can become a ``cls``), ``object``'s attribute setting (both ``__setattr__`` and
    ``__delattr__``, so CPython keeps its C fast path), and the ``__init__`` of a non-frozen dataclass
    of ``specs`` (plain ``self.name = value`` stores) that ends by switching the instance to ``cls``."""

    def become_frozen(self: Any) -> None:
        self.__class__ = cls

    fields_only = dataclasses.make_dataclass(
        f"_{cls.__name__}Fields", specs, namespace={"__post_init__": become_frozen}, kw_only=kw_only, eq=False,
        repr=False,
    )
    init = vars(fields_only)["__init__"]
    return type(f"_{cls.__name__}UnderConstruction", (cls,), {  # type: ignore[return-value]
        "__slots__": (), "__init__": init, "__post_init__": become_frozen,
        "__setattr__": object.__setattr__, "__delattr__": object.__delattr__,
    })


_PARTS: dict[type, tuple[str, ...]] = {}
""":func:`metadata_parts` by class."""


def metadata_parts(cls: type) -> tuple[str, ...]:
    """The dataclass fields of ``cls`` annotated with a :class:`MetadataBase` type (optional or not): the
    metadata objects an object of ``cls`` may hold, which expire with it (cached per class).

    Examples
    --------
    >>> from attnmeta.backends.mamba.mamba2 import Mamba2Metadata
    >>> metadata_parts(Mamba2Metadata)
    ('common', 'checkpoint_meta')
    """
    found = _PARTS.get(cls)
    if found is not None:
        return found
    names: list[str] = []
    if dataclasses.is_dataclass(cls):
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an annotation that does not resolve at run time: judge by its text
            hints = {}
        for f in dataclasses.fields(cls):
            hint = hints.get(f.name)
            kinds = typing.get_args(hint) or (hint,) if hint is not None else ()
            if any(isinstance(k, type) and issubclass(k, MetadataBase) for k in kinds) or (
                    hint is None and "Metadata" in str(f.type)):
                names.append(f.name)
    _PARTS[cls] = found = tuple(names)
    return found
