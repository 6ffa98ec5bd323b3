"""Lifetimes: how a step's metadata objects expire.

A step owns the metadata objects it hands out (:meth:`Step.own <attnmeta.staging.Step.own>`); when a
newer step claims the step's memory, each becomes its *expired twin*: a subclass without slots of its
own whose every attribute read raises :class:`~attnmeta.staging.StepExpiredError` with the expiry of
the step in ``_lease``. One class change per object, no copy, no flag read on the hot path.
"""

from __future__ import annotations

from typing import Any

from attnmeta._fields import metadata_parts
from attnmeta.staging._layout import StepExpiredError

__all__ = ["POISON_INFO", "TWIN_CLASSES", "is_expired", "poison", "poison_info"]

_EXPIRED_TWINS: dict[type, type] = {}
"""A class's expired twin (:func:`poison`), by class."""
TWIN_CLASSES: set[type] = set()
_OPEN_NAMES = frozenset({"_lease"})


def is_expired(obj: Any) -> bool:
    """Whether ``obj``, a metadata object handed out by a step, has expired (reading its fields would
    raise :class:`StepExpiredError`): a newer step has claimed its step's memory.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager, build_common
    >>> stager = Stager("cpu", num_slots=2)
    >>> spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[1], block_table=[[7]], block_size=4)
    >>> first = build_common(spec, stager)
    >>> second = build_common(spec, stager)
    >>> is_expired(first), is_expired(second)
    (False, False)
    >>> third = build_common(spec, stager)  # begins on the ring slot of `first`
    >>> is_expired(first)
    True
    """
    return type(obj) in TWIN_CLASSES


def _expired_twin(cls: type) -> type:
    """The subclass an expired object of ``cls`` becomes: no slots of its own (the same layout), every
    attribute read but ``__class__`` and ``_lease`` raising :class:`StepExpiredError` with the expiry
    of the step in ``_lease``."""
    twin = _EXPIRED_TWINS.get(cls)
    if twin is not None:
        return twin

    def __getattribute__(self: Any, name: str) -> Any:
        if name in _OPEN_NAMES or name.startswith("__"):  # (introspection: the class's dunders)
            return object.__getattribute__(self, name)
        raise StepExpiredError(f"{cls.__name__}.{name}: {object.__getattribute__(self, '_lease').expiry()}")

    def __repr__(self: Any) -> str:
        return f"<expired {cls.__name__}: {object.__getattribute__(self, '_lease').expiry()}>"

    twin = type(f"Expired{cls.__name__}", (cls,), {
        "__slots__": (), "__getattribute__": __getattribute__, "__repr__": __repr__, "__module__": cls.__module__,
    })
    _EXPIRED_TWINS[cls] = twin
    TWIN_CLASSES.add(twin)
    return twin


def poison_info(cls: type) -> tuple[type, tuple[str, ...]] | None:
    """``(expired twin, metadata parts)`` of ``cls``; None for a twin (already expired)."""
    info = None if cls in TWIN_CLASSES else (_expired_twin(cls), metadata_parts(cls))
    POISON_INFO[cls] = info
    return info


POISON_INFO: dict[type, tuple[type, tuple[str, ...]] | None] = {}
""":func:`poison_info` by class."""


def poison(obj: Any, step: object) -> None:
    """Turn ``obj`` (owned by ``step``, which has expired) and the metadata objects in its fields that
    no other step owns into their expired twins."""
    cls = type(obj)
    info = POISON_INFO[cls] if cls in POISON_INFO else poison_info(cls)
    if info is None:
        return
    twin, parts = info
    object.__setattr__(obj, "__class__", twin)
    for name in parts:  # a part no step owns (an owned one is poisoned by its own step)
        part = object.__getattribute__(obj, name)
        if part is not None and type(part) not in TWIN_CLASSES and getattr(part, "_lease", None) is None:
            object.__setattr__(part, "_lease", step)
            poison(part, step)
