"""Fast field setting for frozen, slotted dataclasses (per-step objects with budgets of microseconds).

A frozen dataclass sets each field through ``object.__setattr__`` (its own ``__setattr__`` refuses),
about 0.2 us a field on the 2-core machine. :func:`fast_constructor` builds a metadata object and
:func:`slot_filler` fills a ``BatchSpec`` under construction without that cost. No torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["fast_constructor", "slot_filler"]

T = TypeVar("T")


def _mutable_twin(cls: type, names: list[str]) -> type | None:
    """A class with ``cls``'s bases and slots and no frozen ``__setattr__`` (layout-compatible, so an
    instance's ``__class__`` may be switched between the two), or None where ``cls``'s slots are not
    exactly ``names`` or a base defines ``__setattr__``."""
    own = set(cls.__dict__.get("__slots__", ()))
    if set(names) != own or any("__setattr__" in vars(b) for b in cls.__mro__[1:-1]):
        return None
    return type(f"_Mutable{cls.__name__}", cls.__bases__, {"__slots__": cls.__dict__["__slots__"]})


def fast_constructor(cls: type[T]) -> Callable[..., T]:
    """A positional constructor for the frozen, slotted metadata dataclass ``cls``.

    It takes every field of ``cls`` positionally, in ``dataclasses.fields(cls)`` order (its parameters
    carry the field names), and skips the dataclass ``__init__`` (keyword binding plus one
    ``object.__setattr__`` call per field): where ``cls``'s bases define no ``__setattr__`` it fills an
    instance of a mutable twin class with the same slot layout and then sets ``__class__`` to ``cls``
    (about 7x cheaper for 20 fields), else it calls each slot's descriptor (about 3x cheaper). This
    matters in a per-step builder with a budget of tens of microseconds. The result is an ordinary,
    frozen instance of ``cls``. No defaults, no checks: a builder passes every field, and the
    equivalence tests check every field's value.

    Parameters
    ----------
    cls : type
        A ``@dataclasses.dataclass(frozen=True, slots=True)`` class.

    Returns
    -------
    Callable
        ``make(field_0, field_1, ...) -> cls``.
    """
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    ns: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    stores, twin = _stores(cls, names, ns)
    if twin is not None:
        src = f"def make({', '.join(names)}):\n    o = _new(_twin)\n{stores}    o.__class__ = _cls\n    return o\n"
    else:
        src = f"def make({', '.join(names)}):\n    o = _new(_cls)\n{stores}    return o\n"
    make: Callable[..., T] = _compile(src, ns, "make")
    make.__doc__ = f"Positional constructor of {cls.__name__} (fields in declaration order)."
    return make


def slot_filler(cls: type) -> Callable[..., None]:
    """``fill(obj, field_0, field_1, ...)``: set every field of an instance of the frozen, slotted
    dataclass ``cls`` (``dataclasses.fields(cls)`` order, ``init=False`` fields included), for a
    hand-written ``__init__`` that validates first and then sets each field once.

    Where :func:`fast_constructor` would use a mutable twin class, an instance of ``cls`` itself is
    switched to the twin, the fields are plain slot stores, and the class is switched back (16 fields:
    1.1 us against 3.3 us for ``object.__setattr__`` calls on the 2-core machine); nothing in between
    can raise, so ``obj`` never stays of the twin class. An instance of a subclass (another layout)
    gets one ``object.__setattr__`` a field. Without a twin each slot's descriptor is called.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    ns: dict[str, Any] = {"_set": object.__setattr__, "_cls": cls}
    stores, twin = _stores(cls, names, ns)
    if twin is not None:  # (a subclass's instance has another layout: one object.__setattr__ a field)
        each = "".join(f"        _set(o, {n!r}, {n})\n" for n in names)
        stores = (f"    if o.__class__ is not _cls:\n{each}        return\n"
                  f"    _set(o, '__class__', _twin)\n{stores}    o.__class__ = _cls\n")
    fill: Callable[..., None] = _compile(f"def fill(o, {', '.join(names)}):\n{stores}", ns, "fill")
    fill.__doc__ = f"Set every field of a {cls.__name__} (fields in declaration order)."
    return fill


def _stores(cls: type, names: list[str], ns: dict[str, Any]) -> tuple[str, type | None]:
    """The generated lines that store each of ``names`` into ``o``, and the mutable twin they store
    through (then ``ns["_twin"]``), or None: then they call each slot's descriptor (put into ``ns``)."""
    twin = _mutable_twin(cls, names)
    if twin is not None:
        ns["_twin"] = twin
        return "".join(f"    o.{n} = {n}\n" for n in names), twin
    for i, n in enumerate(names):
        ns[f"_set{i}"] = getattr(cls, n).__set__  # the slot's member descriptor
    return "".join(f"    _set{i}(o, {n})\n" for i, n in enumerate(names)), None


def _compile(src: str, ns: dict[str, Any], name: str) -> Any:
    """The function ``name`` defined by ``src`` (generated from a class's own field names) in ``ns``."""
    exec(src, ns)
    return ns[name]
