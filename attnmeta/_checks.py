"""Host-side validation helpers shared by every public wrapper.

All checks read host (numpy) data only, so they can never synchronise with a device. Every failure is
a ``ValueError`` (or ``TypeError`` for the wrong kind of object) whose message names the field, the
rule, what was expected and what was found, and the first offending row where there is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "INT32_MAX",
    "OptionRule",
    "as_host_array",
    "check_nonnegative",
    "check_option_fields",
    "check_out",
    "first_bad_row",
    "option_bool",
    "option_choice",
    "option_int",
    "option_prefix",
    "option_rule",
    "reject_tensor",
]

INT32_MAX = int(np.iinfo(np.int32).max)
_I32 = np.dtype(np.int32)


def reject_tensor(value: Any, name: str) -> None:
    """Raise ``TypeError`` if ``value`` is a torch tensor: host derivations take numpy only.

    The message says where the host copy should come from, because a device tensor here would force
    a GPU->CPU synchronisation.
    """
    mod = type(value).__module__
    if mod.startswith("torch"):
        raise TypeError(
            f"{name}: got a torch.Tensor ({getattr(value, 'device', '?')}); attnmeta derives metadata from "
            f"host data only. Pass the numpy array the scheduler already holds (for a CPU tensor: "
            f"`{name}.numpy()`); never copy a device tensor back to the host for this."
        )


def as_host_array(
    value: Any,
    name: str,
    *,
    dtype: npt.DTypeLike = np.int32,
    ndim: int = 1,
    length: int | None = None,
    allow_none: bool = False,
) -> np.ndarray:
    """Return ``value`` as a C-contiguous numpy array of ``dtype`` with ``ndim`` dimensions.

    Accepts numpy arrays, Python sequences and scalars (for ``ndim == 0``). Integer inputs are
    range-checked before any narrowing so that e.g. an int64 value above ``2**31 - 1`` is an error,
    never a silent wrap-around. Floats, bools (unless ``dtype`` is bool) and objects are rejected.

    Raises
    ------
    TypeError
        ``value`` is a torch tensor or has a non-integer dtype.
    ValueError
        Wrong number of dimensions, wrong length, values outside ``dtype``'s range, or a ragged nested
        sequence (rows of different lengths: the message names the first one that differs).
    """
    target = _I32 if dtype is np.int32 else np.dtype(dtype)
    if (
        type(value) is np.ndarray
        and value.dtype == target
        and value.ndim == ndim
        and value.flags.c_contiguous
        and (length is None or value.shape[0] == length)
    ):
        return value  # fast path: already exactly what is needed (the per-step common case)
    if value is None:
        if allow_none:
            return None  # type: ignore[return-value]
        raise ValueError(f"{name}: is required, got None")
    reject_tensor(value, name)
    try:
        arr = np.asarray(value)
    except ValueError as e:  # numpy's "inhomogeneous shape": a ragged nested sequence
        raise ValueError(f"{name}: {_ragged(value)}; pass a rectangular array (pad the short rows)") from e
    if arr.size == 0 and arr.dtype == np.float64 and arr.ndim >= 1:
        arr = arr.astype(target)  # np.asarray([]) is float64; an empty list is fine for any dtype
    if target == np.bool_:
        if arr.dtype != np.bool_:
            raise TypeError(f"{name}: expected a bool array, got dtype {arr.dtype}")
    else:
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
        if arr.size and arr.dtype != target:
            info = np.iinfo(target)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                flat_at = int(np.argmax(((arr < info.min) | (arr > info.max)).reshape(-1)))
                at = np.unravel_index(flat_at, arr.shape)
                where = ", ".join(str(int(i)) for i in at)
                raise ValueError(
                    f"{name}[{where}]={int(arr[at])} does not fit {target} "
                    f"(range [{info.min}, {info.max}])"
                )
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name}: expected length {length}, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=target)


def block_table_rows(value: Any, num_reqs: int) -> np.ndarray:
    """``value`` as a host int32 block table (:func:`as_host_array`, 2-D) with a row per request.

    Raises
    ------
    TypeError, ValueError
        As :func:`as_host_array`; fewer than ``num_reqs`` rows (the message names both counts).
    """
    bt = as_host_array(value, "block_table", ndim=2)
    if bt.shape[0] < num_reqs:
        raise ValueError(f"block_table: has {bt.shape[0]} rows, need one per request ({num_reqs})")
    return bt


def _ragged(value: Any) -> str:
    """What is ragged about a nested sequence numpy refused: the first row whose length differs."""
    try:
        lengths = [len(row) if isinstance(row, Sequence | np.ndarray) and not isinstance(row, str) else None
                   for row in value]
    except TypeError:
        return "rows have different lengths"
    for i, n in enumerate(lengths):
        if n != lengths[0]:
            what = "is not a sequence" if n is None else f"has {n} entries"
            first = "is not a sequence" if lengths[0] is None else f"has {lengths[0]} entries"
            return f"rows have different lengths (row {i} {what}, row 0 {first})"
    return "rows have different lengths (inside a row)"


def first_bad_row(mask: np.ndarray) -> int:
    """Index of the first ``True`` in a 1-D bool mask (caller guarantees one exists)."""
    return int(np.argmax(mask))


def check_nonnegative(arr: np.ndarray, name: str) -> None:
    """Raise ``ValueError`` naming the first negative entry of ``arr``."""
    if arr.size and int(arr.min()) < 0:
        i = first_bad_row(arr.reshape(-1) < 0)
        raise ValueError(f"{name}[{i}]={int(arr.reshape(-1)[i])} is negative (request {i}); counts must be >= 0")


def check_out(out: np.ndarray | None, name: str, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """Validate (or allocate) an ``out=`` buffer of exactly ``shape`` and ``dtype``.

    ``out`` must be a writable, C-contiguous numpy array; staging buffers handed out by a
    :class:`attnmeta.staging.Step` are.
    """
    dt = np.dtype(dtype)
    if out is None:
        return np.empty(shape, dtype=dt)
    reject_tensor(out, name)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: out= must be a numpy array, got {type(out).__name__}")
    if out.dtype != dt:
        raise ValueError(f"{name}: out= must have dtype {dt}, got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"{name}: out= must have shape {shape}, got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name}: out= must be C-contiguous and writable")
    return out


# --------------------------------------------------------------------------------------------------
# options (frozen dataclasses validated once, in __post_init__)


def option_int(owner: Any, name: str, *, minimum: int | None = None, maximum: int | None = None,
               allow_none: bool = False) -> None:
    """Check that ``owner.<name>`` is an int (not a bool) within ``[minimum, maximum]``.

    Raises ``TypeError`` naming the option for the wrong type, ``ValueError`` for a value out of
    range. ``owner`` is the options object (its class name prefixes the message).
    """
    value = getattr(owner, name)
    where = f"{type(owner).__name__}.{name}"
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{where}: expected {kind}, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{where}: must be <= {maximum}, got {value}")


def option_bool(owner: Any, name: str) -> None:
    """Check that ``owner.<name>`` is a bool (``TypeError`` naming the option otherwise)."""
    value = getattr(owner, name)
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{type(owner).__name__}.{name}: expected a bool, got {type(value).__name__} {value!r}")


def option_choice(owner: Any, name: str, choices: tuple[Any, ...]) -> None:
    """Check that ``owner.<name>`` is one of ``choices`` (``ValueError`` listing them otherwise)."""
    value = getattr(owner, name)
    if value not in choices:
        names = [repr(c) for c in choices]
        allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise ValueError(f"{type(owner).__name__}.{name}: must be {allowed}, got {value!r}")


def option_prefix(owner: Any, name: str = "prefix") -> None:
    """Check ``owner.prefix``, the namespace of a builder's staged fields: a non-empty str without dots."""
    value = getattr(owner, name)
    where = f"{type(owner).__name__}.{name}"
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected a str, got {type(value).__name__} {value!r}")
    if not value or "." in value:
        raise ValueError(f"{where}: must be a non-empty name without '.', got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class OptionRule:
    """The declared rule of one option field, kept in its ``dataclasses.field(metadata=...)`` (see
    :func:`option_rule`): what the options' ``__post_init__`` checks (:func:`check_option_fields`) and
    what a test walks (every wrong type, every value out of range), from one declaration.

    Examples
    --------
    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True, kw_only=True)
    ... class Opts:
    ...     world: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    ...     rank: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0, below="world"))
    ...     def __post_init__(self) -> None:
    ...         check_option_fields(self)
    >>> Opts(world=2, rank=2)
    Traceback (most recent call last):
    ValueError: Opts.rank: must be <= 1, got 2
    >>> Opts(world=True)
    Traceback (most recent call last):
    TypeError: Opts.world: expected an int, got bool True
    """

    kind: Literal["int", "bool", "choice", "prefix"]
    """``"int"`` (an int, never a bool, within the bounds), ``"bool"``, ``"choice"`` (one of
    :attr:`choices`) or ``"prefix"`` (a builder's namespace: a non-empty str without dots)."""
    minimum: int | None = None
    """Smallest valid int (None: no bound)."""
    maximum: int | None = None
    """Largest valid int (None: no bound)."""
    below: str | None = None
    """Another int field of the same options that the value must stay below (``dcp_rank <
    dcp_world_size``); it must be declared, and is checked, before this one."""
    choices: tuple[Any, ...] = ()
    """The valid values of a ``"choice"``."""
    allow_none: bool = False
    """None is valid too (an int or bool that may be unset)."""

    def check(self, owner: Any, name: str) -> None:
        """Check ``owner.<name>``: a ``TypeError`` naming ``<Options>.<name>`` for a wrong type, a
        ``ValueError`` for a value out of range."""
        if self.kind == "int":
            maximum = self.maximum
            if self.below is not None:
                bound = int(getattr(owner, self.below)) - 1
                maximum = bound if maximum is None else min(maximum, bound)
            option_int(owner, name, minimum=self.minimum, maximum=maximum, allow_none=self.allow_none)
        elif self.kind == "bool":
            if not (self.allow_none and getattr(owner, name) is None):
                option_bool(owner, name)
        elif self.kind == "choice":
            option_choice(owner, name, self.choices)
        else:
            option_prefix(owner, name)


def option_rule(
    kind: Literal["int", "bool", "choice", "prefix"],
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    below: str | None = None,
    choices: tuple[Any, ...] = (),
    allow_none: bool = False,
) -> dict[str, OptionRule]:
    """The ``metadata`` of an option field that declares its rule: ``x: int =
    dataclasses.field(default=1, metadata=option_rule("int", minimum=1))``; the options'
    ``__post_init__`` calls :func:`check_option_fields`.

    Parameters
    ----------
    kind : {"int", "bool", "choice", "prefix"}
        What the field holds (:attr:`OptionRule.kind`).
    minimum, maximum : int, optional
        Bounds of an int.
    below : str, optional
        Another int field the value must stay below.
    choices : tuple, optional
        The valid values of a choice.
    allow_none : bool, default False
        None is valid too.

    Returns
    -------
    dict
        ``{"rule": OptionRule(...)}``.
    """
    return {"rule": OptionRule(kind, minimum, maximum, below, tuple(choices), allow_none)}


def check_option_fields(owner: Any) -> None:
    """Check every field of the options dataclass ``owner`` that declares an :class:`OptionRule`, in
    field order (the options' ``__post_init__`` calls it, then checks what no rule says)."""
    for f in dataclasses.fields(owner):
        rule = f.metadata.get("rule")
        if rule is not None:
            rule.check(owner, f.name)
