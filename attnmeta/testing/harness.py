"""Compare any metadata object with a reference, field by field: the harness's last step.

A framework author who tests a builder of their own (or someone else's: tests/integrations runs vLLM
0.33.0's own builders through it) draws batches with :mod:`attnmeta.testing.strategies`, builds the
metadata their way, computes the expected fields with :mod:`attnmeta.testing.reference` or a lab entry
(:func:`attnmeta.testing.lab.lab`), and hands both to :func:`compare_with_reference`. It compares every
field the reference names that the object has, by value (tensors are read back: this is test code),
and returns what disagreed instead of stopping at the first difference, so one run lists every
disagreement of a builder.

Examples
--------
>>> import torch
>>> from types import SimpleNamespace
>>> got = SimpleNamespace(seq_lens=torch.tensor([3, 4]), num_decodes=1, extra=None)
>>> cmp = compare_with_reference(got, {"seq_lens": torch.tensor([3, 5], dtype=torch.int32), "num_decodes": 1,
...                                    "max_query_len": 4})
>>> [str(d) for d in cmp.disagreements]
['seq_lens: values differ at [1]: 4 != 5', 'seq_lens: dtype torch.int64, the reference torch.int32']
>>> cmp.compared, cmp.missing
(('seq_lens', 'num_decodes'), ('max_query_len',))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from attnmeta.testing.lab import LeadingColumns

__all__ = ["Comparison", "Disagreement", "compare_with_reference"]


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """One field whose value (or dtype, or presence) differs from the reference's."""

    field: str
    """The field's name (``a.b`` for a field of a nested object)."""
    what: str
    """What differs, in words."""

    def __str__(self) -> str:
        return f"{self.field}: {self.what}"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare_with_reference`."""

    disagreements: tuple[Disagreement, ...]
    """Every difference found (values first, then dtypes, per field)."""
    compared: tuple[str, ...]
    """The fields compared (the reference's, present on the object)."""
    missing: tuple[str, ...]
    """The reference's fields the object does not have (not compared); ``a.b`` for a field of a nested
    object."""

    @property
    def ok(self) -> bool:
        """No disagreement, and at least one field compared (an object that has none of the reference's
        fields, None say, is never ok). Fields the object lacks are not disagreements (a third party's
        metadata may have fewer fields): :attr:`complete` also requires none missing."""
        return not self.disagreements and bool(self.compared)

    @property
    def complete(self) -> bool:
        """:attr:`ok`, and no reference field missing from the object (``missing`` empty)."""
        return self.ok and not self.missing


def _host(value: Any) -> np.ndarray:
    """``value`` (a tensor on any device, an array, a list) as a numpy array on the host (test code:
    tensors are read back)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _dtype(value: Any) -> Any:
    return value.dtype if isinstance(value, torch.Tensor | np.ndarray) else None


def _compare(name: str, got: Any, want: Any, out: list[Disagreement], missing: list[str]) -> None:
    if isinstance(want, Mapping):  # a nested object's fields
        if got is None:
            out.append(Disagreement(name, "None, the reference has a value"))
            return
        for key, sub in want.items():
            if hasattr(got, key):
                _compare(f"{name}.{key}", getattr(got, key), sub, out, missing)
            else:
                missing.append(f"{name}.{key}")
        return
    if want is None or got is None:
        if (want is None) != (got is None):
            out.append(Disagreement(name, f"{'None' if got is None else 'a value'}, the reference "
                                          f"{'None' if want is None else 'a value'}"))
        return
    leading = isinstance(want, LeadingColumns)
    if leading or isinstance(want, torch.Tensor | np.ndarray) or isinstance(got, torch.Tensor | np.ndarray):
        if not isinstance(got, torch.Tensor | np.ndarray):
            out.append(Disagreement(name, f"a {type(got).__name__}, the reference an array ({type(want).__name__})"))
            return
        cut = want.leading(_host(got)) if leading else None  # (the entries kernels read; the rest follow the staging)
        if leading:
            want = want.value
        a, b = cut if cut is not None else (_host(got), _host(want))
        if a.shape != b.shape:
            out.append(Disagreement(name, f"shape {a.shape}, the reference {b.shape}"))
            return
        if a.size and not np.array_equal(a, b):
            where = np.argwhere(a != b)[0]
            idx = tuple(int(i) for i in where)
            out.append(Disagreement(name, f"values differ at {list(idx)}: {a[idx]} != {b[idx]}"))
        da, db = _dtype(got), _dtype(want)
        if da is not None and db is not None and str(da).split(".")[-1] != str(db).split(".")[-1]:
            out.append(Disagreement(name, f"dtype {da}, the reference {db}"))
        return
    if _kind(got) != _kind(want):  # (True for 1, or 2.0 for 2, is a different value to a kernel's argument)
        out.append(Disagreement(name, f"{got!r} ({type(got).__name__}), the reference {want!r} ({type(want).__name__})"))
    elif got != want:
        out.append(Disagreement(name, f"{got!r} != {want!r}"))


def _kind(value: Any) -> str:
    """A scalar's kind for :func:`compare_with_reference`: bool, int or float (numpy's scalars as
    Python's), else its type's name."""
    if isinstance(value, bool | np.bool_):
        return "bool"
    if isinstance(value, int | np.integer):
        return "int"
    if isinstance(value, float | np.floating):
        return "float"
    return type(value).__name__


def compare_with_reference(metadata: Any, reference: Mapping[str, Any], *,
                           skip: Iterable[str] = ()) -> Comparison:
    """Compare the fields of ``metadata`` (any object: attnmeta's metadata, a third party's) with
    ``reference`` (field name -> expected value, as a lab entry's ``reference()`` returns it).

    Parameters
    ----------
    metadata : object
        Read by attribute.
    reference : mapping of str to value
        Tensors (any device), numpy arrays, ints, bools, None, a mapping for a nested object, or a
        :class:`~attnmeta.testing.lab.LeadingColumns` (the 2-D field's rows and at least its columns,
        equal in them).
    skip : iterable of str
        Reference fields not to compare (documented deviations, say).

    Returns
    -------
    Comparison
        Every disagreement, the fields compared and those the object lacks.
    """
    if not isinstance(reference, Mapping):
        raise TypeError(f"reference: expected a mapping of field name to value (a lab's reference(...)), got "
                        f"{type(reference).__name__}")
    skipped = {skip} if isinstance(skip, str) else set(skip)
    out: list[Disagreement] = []
    compared, missing = [], []
    for name, want in reference.items():
        if name in skipped:
            continue
        if not hasattr(metadata, name):
            missing.append(name)
            continue
        compared.append(name)
        _compare(name, getattr(metadata, name), want, out, missing)
    return Comparison(tuple(out), tuple(compared), tuple(missing))
