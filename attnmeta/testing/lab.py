"""The lab contract: what tests, the sync audit, the demo and the benchmarks need of a builder besides
its production contract, registered by builder name.

A builder's production contract (:class:`attnmeta.builder.Builder`) is what serves a step. Its **lab
entry** (:class:`Lab`) is what checks and shows it:

- ``reference(spec, options, device, inputs) -> dict``: the device-side reference values of its fields
  for ``spec`` (the straightforward torch computations of :mod:`attnmeta.testing.reference`,
  synchronisations and all), by field name: tensors for device fields, host values for the rest; a
  nested ``dict`` for a part (``{"paged": {...}}``); a :class:`LeadingColumns` for a 2-D field whose
  width follows the staging (a block table), of which it names the entries kernels read. A reference
  that also takes a ``profile`` keyword gets the graph-mode profile the metadata was staged under
  (None: eager), for fields whose shape graph mode fixes. A reference derives every field itself: it
  shares no helper with the builder it checks (an oracle that shares code with the code under test
  cannot catch that code's bugs).
- ``sample(spec, rng) -> (options, inputs)``: random valid options and inputs for ``spec`` (the
  audit's and the warm-up's variety);
- ``defaults(spec) -> (options, inputs)``: the options and inputs the demo and the benchmarks use.

:func:`register_lab` adds an entry; :func:`lab` finds one, with the defaults filled in for what an
entry leaves out (no reference; samples = defaults; defaults = the builder's default options and no
inputs). The built-in builders' entries (:data:`attnmeta.testing.labs.BUILTIN`) are registered the
first time an entry is looked up or registered. Production code (``attnmeta.backends``, ``attnmeta.host``,
``attnmeta.staging`` and the package's top-level modules) never imports this module.

Examples
--------
>>> import numpy as np
>>> from attnmeta import BatchSpec
>>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3],
...                  block_table=[[1, 2], [3, 4]], block_size=4)
>>> options, inputs = lab("flash_attn").sample(spec, np.random.default_rng(0))
>>> type(options).__name__
'FlashAttentionOptions'
>>> ref = lab("flash_attn").reference(spec, options, "cpu", inputs)
>>> ref["query_start_loc"].tolist()
[0, 1, 4]
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnmeta.builder import AnyBuilder, Builder, get_builder
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec
from attnmeta.testing.labs import BUILTIN, Defaults, LabEntry, LeadingColumns, Reference, Sample

__all__ = ["Lab", "LabEntry", "LeadingColumns", "lab", "register_lab", "unregister_lab"]


@dataclasses.dataclass(frozen=True, slots=True)
class Lab:
    """A builder's lab entry (see the module docstring); :func:`lab` returns it with every method set.

    Attributes
    ----------
    builder : Builder
        The registered builder it belongs to.
    """

    builder: AnyBuilder
    _reference: Reference | None = None
    _sample: Sample | None = None
    _defaults: Defaults | None = None

    @property
    def has_reference(self) -> bool:
        """Whether the entry has a reference (:func:`attnmeta.testing.check_builder` needs one)."""
        return self._reference is not None

    def reference(self, spec: BatchSpec, options: Any, device: torch.device | str, inputs: Any = None, *,
                  profile: StaticProfile | None = None) -> dict[str, Any] | None:
        """Reference values of the builder's fields for ``spec`` on ``device`` (None: no reference).

        ``options`` and ``inputs`` may be None (the builder's defaults). ``profile`` is the graph-mode
        profile the metadata was staged under (None: eager), passed on to a reference function that
        takes a ``profile`` keyword (for fields whose shape graph mode fixes)."""
        if self._reference is None:
            return None
        b = self.builder
        args = (spec, b.options(options), torch.device(device), b.inputs(inputs))
        if _takes_profile(self._reference):
            return self._reference(*args, profile=profile)  # type: ignore[call-arg]
        return self._reference(*args)

    def sample(self, spec: BatchSpec, rng: np.random.Generator) -> tuple[Any, Any]:
        """Random valid ``(options, inputs)`` for ``spec`` (default: :meth:`defaults`)."""
        if self._sample is None:
            return self.defaults(spec)
        return self._sample(spec, rng)

    def defaults(self, spec: BatchSpec) -> tuple[Any, Any]:
        """The ``(options, inputs)`` the demo and the benchmarks use for ``spec`` (default: the
        builder's default options, no inputs)."""
        if self._defaults is None:
            return self.builder.options(None), None
        return self._defaults(spec)


def _takes_profile(fn: Callable[..., Any]) -> bool:
    """Whether a reference function takes the ``profile`` keyword."""
    try:
        return "profile" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # (a callable without a signature)
        return False


_LABS: dict[str, Lab] = {}


def register_lab(name: str, *, reference: Reference | None = None, sample: Sample | None = None,
                 defaults: Defaults | None = None, replace: bool = False) -> Lab:
    """Register the lab entry of the builder registered as ``name``; returns it.

    Parameters
    ----------
    name : str
        The builder's registry name (:func:`attnmeta.register` it first).
    reference, sample, defaults : callables, optional
        See the module docstring; each may be left out.
    replace : bool, default False
        Replace an entry registered already.

    Raises
    ------
    attnmeta.UnknownBuilderError
        No builder is registered as ``name``.
    ValueError
        ``name`` has an entry already and ``replace`` is False.
    """
    builder = get_builder(name)
    _load_builtin()
    if name in _LABS and not replace:
        raise ValueError(f"register_lab(): {name!r} has a lab entry already (replace=True replaces it)")
    entry = _LABS[name] = Lab(builder, reference, sample, defaults)
    return entry


def unregister_lab(name: str) -> None:
    """Remove ``name``'s lab entry (a test that registered one cleans up); no error if there is none."""
    _LABS.pop(name, None)


def lab(builder: AnyBuilder | str) -> Lab:
    """The lab entry of ``builder`` (a builder, or a registered builder's name); a builder without one
    (an unregistered one included) gets an entry of defaults (no reference, the default options, no
    inputs).

    Raises
    ------
    attnmeta.UnknownBuilderError
        No builder is registered under that name.
    """
    _load_builtin()
    b = get_builder(builder) if isinstance(builder, str) else builder
    if not isinstance(b, Builder):
        raise TypeError(f"lab(): expected a builder or a registered builder's name, got {type(builder).__name__}")
    entry = _LABS.get(b.name)
    if entry is None or entry.builder is not b:
        return Lab(b)
    return entry


_LOADED: list[bool] = []


def _load_builtin() -> None:
    """Register the built-in builders' entries (once)."""
    if not _LOADED:
        _LOADED.append(True)
        for name, entry in BUILTIN.items():
            _LABS.setdefault(name, Lab(get_builder(name), entry.reference, entry.sample, entry.defaults))
