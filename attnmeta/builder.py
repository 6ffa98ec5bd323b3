"""The builder protocol, the registry of builders, and the one generic :func:`build`.

A **builder** turns a step's common metadata into one backend family's metadata. Every builder is an
object of one protocol (:class:`Builder`):

- a ``name`` and an **options type**: a frozen dataclass validated once, when it is constructed (a
  wrong type is a ``TypeError`` naming the option, a bad value a ``ValueError``), whose ``prefix``
  names the builder's staged fields (``<prefix>.<field>``; graph-mode users read the full-capacity
  views as ``step.device_full("<prefix>.<field>")``);
- :meth:`Builder.needs`: which common fields it reads (:class:`CommonNeeds`), so that :func:`build`
  derives and stages only those;
- :meth:`Builder.stage`: ``stage(common, step, options, **inputs) -> Staged``, the host derivation
  written into an open step, with the step's per-step inputs (accepted-token counts, logits indices,
  the shared prefix, ...) as keyword arguments named in :attr:`Builder.inputs`;
- :meth:`Builder.unsupported_reasons`: every reason a batch/options pair cannot be served (an
  empty list when it can);
- :meth:`Builder.defaults`, :meth:`Builder.sample` and :meth:`Builder.reference`: representative and
  random valid options and inputs for a batch, and the device-side reference values of its fields,
  from which the demo, the sync audit, the benchmarks and the generic equivalence check
  (:func:`attnmeta.testing.check_builder`) work.

For writing one, this module also exports the pieces every builder uses: :class:`MetadataBase` (the
field roles and the sync-free ``repr``/``describe`` of metadata types), :func:`keyword_factory` (a
builder's fast keyword constructor of its metadata type), the declared option rules
(:func:`option_rule` in a field's metadata, :class:`OptionRule`, checked by
:func:`check_option_fields`: one declaration for ``__post_init__`` and for the bad-input test that
walks every registered builder's options) and the single checks :func:`option_int`,
:func:`option_bool`, :func:`option_choice`, :func:`option_prefix`.

:func:`register` adds a builder to the registry that ``python -m attnmeta audit``, ``python -m
attnmeta demo``, ``python -m attnmeta bench`` and the test suite read, so a builder is audited and
benchmarked by being registered. The built-in builders are registered when :mod:`attnmeta.backends`
is imported (``import attnmeta`` does). docs/extending.md shows a new builder end to end.

Examples
--------
>>> import attnmeta
>>> from attnmeta import BatchSpec, Stager
>>> sorted(attnmeta.registry())[:3]
['cascade', 'fast_prefill', 'flash_attn']
>>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3],
...                  block_table=[[1, 2], [3, 4]], block_size=4)
>>> fa = attnmeta.build(spec, Stager("cpu"), "flash_attn")
>>> fa.query_start_loc_cpu.tolist(), fa.num_decode_reqs
([0, 1, 4], 1)
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np

from attnmeta._checks import (
    OptionRule,
    check_option_fields,
    option_bool,
    option_choice,
    option_int,
    option_prefix,
    option_rule,
)
from attnmeta._fields import MetadataBase, keyword_factory
from attnmeta.common import stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import Staged, Stager

if TYPE_CHECKING:
    import torch

__all__ = [
    "Builder",
    "CommonNeeds",
    "MetadataBase",
    "OptionRule",
    "UnknownBuilderError",
    "UnsupportedBatchError",
    "build",
    "check_option_fields",
    "get_builder",
    "keyword_factory",
    "option_bool",
    "option_choice",
    "option_int",
    "option_prefix",
    "option_rule",
    "register",
    "registry",
    "unregister",
]

OptionsT = TypeVar("OptionsT")
MetadataT = TypeVar("MetadataT")


@dataclasses.dataclass(frozen=True, slots=True)
class CommonNeeds:
    """Which common fields a builder reads, so that :func:`build` derives and stages only those.

    Examples
    --------
    >>> CommonNeeds(token_arrays=False, block_table_columns=3).merge(CommonNeeds(paged_kv=True))
    CommonNeeds(token_arrays=True, paged_kv=True, block_table_columns=3)
    """

    token_arrays: bool = True
    """Per-token ``positions`` and ``slot_mapping`` (False for a KV-cache group whose layers write no
    KV: Mamba, linear attention; vLLM's ``SlotMappingMode.NONE``)."""
    paged_kv: bool = False
    """The paged-KV layout of every row, built in the common pass (:attr:`attnmeta.StagedCommon.paged`)."""
    block_table_columns: int | None = None
    """Eager mode: at least this many block-table columns (default: the longest request's blocks)."""

    def merge(self, other: CommonNeeds) -> CommonNeeds:
        """What two builders of one step need together (for one :func:`attnmeta.stage_common` call)."""
        a, b = self.block_table_columns, other.block_table_columns
        return CommonNeeds(
            token_arrays=self.token_arrays or other.token_arrays,
            paged_kv=self.paged_kv or other.paged_kv,
            block_table_columns=b if a is None else a if b is None else max(a, b),
        )


class UnsupportedBatchError(ValueError):
    """A builder cannot serve a batch with these options; ``reasons`` lists every reason."""

    def __init__(self, builder: str, reasons: list[str]) -> None:
        self.builder = builder
        self.reasons = reasons
        super().__init__(f"{builder}: cannot serve this batch: " + "; ".join(reasons))


class UnknownBuilderError(KeyError, ValueError):
    """No builder is registered under the name asked for; the message lists the registered names.

    A ``KeyError`` (a registry lookup) and a ``ValueError`` (a bad argument of :func:`build`)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Builder(Generic[OptionsT, MetadataT]):
    """One backend family's metadata builder (the protocol every builder implements).

    Subclasses set the class attributes and implement :attr:`stage`; the other methods have
    defaults. A builder object holds no per-step state (its caches, if any, live with the staging
    slots), so one instance serves every stager and thread.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [a for a in ("name", "options_type", "metadata_type") if not hasattr(cls, a)]
        if "stage" not in vars(cls) and not any("stage" in vars(b) for b in cls.__mro__[1:-1] if b is not Builder):
            missing.append("stage")
        if missing:
            raise TypeError(f"{cls.__name__}: a Builder must define {', '.join(missing)}")

    name: ClassVar[str]
    """Registry name (also the default ``prefix`` of its options)."""
    options_type: ClassVar[type]
    """The frozen dataclass of its options; ``options_type()`` gives the defaults."""
    metadata_type: ClassVar[type]
    """The metadata class :meth:`stage`'s ``result()`` returns."""
    inputs: ClassVar[tuple[str, ...]] = ()
    """Names of the per-step keyword inputs :meth:`stage` accepts."""

    def options(self, options: OptionsT | None) -> OptionsT:
        """``options``, or the defaults for None; a ``TypeError`` naming the builder for another type.

        The defaults are made (and validated) once per builder: options are immutable.
        """
        if options is None:
            default: OptionsT | None = self.__dict__.get("_default_options")
            if default is None:
                default = self.__dict__["_default_options"] = self.options_type()
            return default
        if type(options) is not self.options_type and not isinstance(options, self.options_type):
            t = self.options_type.__name__
            got = type(options).__name__
            if isinstance(options, Mapping):
                got += f" {options!r} (make the options from it: {t}(**options))"
            raise TypeError(f"{self.name}: options must be {t}, got {got}")
        return options

    def needs(self, spec: BatchSpec, options: OptionsT) -> CommonNeeds:
        """The common fields this builder reads for ``spec`` with ``options`` (default: every field,
        no paged-KV layout, the default block-table width)."""
        return _ALL_TOKENS

    stage: Callable[..., Staged[Any, MetadataT]]
    """``stage(common, step, options=None, **inputs) -> Staged[host part, metadata]``: derive this
    builder's metadata from the staged common metadata, staging into the same step. ``common`` must
    come from :func:`attnmeta.stage_common` on ``step`` (with at least :meth:`needs`); ``.result()`` of
    the returned :class:`~attnmeta.staging.Staged` gives the metadata after the commit. Each builder
    implements it, with its per-step inputs (:attr:`inputs`) as keyword-only arguments."""

    def unsupported_reasons(self, spec: BatchSpec, options: OptionsT, **inputs: Any) -> list[str]:
        """Every reason this builder cannot serve ``spec`` with ``options`` and ``inputs`` (an empty
        list when it can). :func:`build` raises :class:`UnsupportedBatchError` listing them."""
        return []

    def defaults(self, spec: BatchSpec) -> tuple[OptionsT, dict[str, Any]]:
        """The options and inputs ``python -m attnmeta demo`` and the benchmarks use for ``spec``:
        the default options and no inputs, unless the builder needs more (its own choice, documented)."""
        return self.options(None), {}

    def sample(self, spec: BatchSpec, rng: np.random.Generator) -> tuple[OptionsT, dict[str, Any]]:
        """Random valid options and inputs for ``spec`` (the audit's and the benchmarks' variety);
        default: the default options, no inputs."""
        return self.options_type(), {}

    def reference(self, spec: BatchSpec, options: OptionsT, device: torch.device, **inputs: Any) -> dict[str, Any] | None:
        """Device-side reference values of this builder's fields for ``spec`` (the straightforward
        torch computations of :mod:`attnmeta.testing.reference`, syncs and all), by field name:
        tensors for device fields, host values for the rest. None when there is no reference."""
        return None

    def build(self, spec: BatchSpec, stager: Stager, options: OptionsT | None = None, **inputs: Any) -> MetadataT:
        """:func:`build` with this builder: common + this builder's metadata in one step of its own."""
        return build(spec, stager, self, options, **inputs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


_ALL_TOKENS = CommonNeeds()
_REGISTRY: dict[str, Builder[Any, Any]] = {}


def register(builder: Builder[Any, Any], *, replace: bool = False) -> Builder[Any, Any]:
    """Add ``builder`` to the registry under ``builder.name``; returns it.

    Raises
    ------
    TypeError
        ``builder`` is not a :class:`Builder`.
    ValueError
        The name is taken (pass ``replace=True`` to replace it).
    """
    if not isinstance(builder, Builder):
        raise TypeError(f"register(): expected a Builder, got {type(builder).__name__}")
    name = builder.name
    if not replace and name in _REGISTRY and _REGISTRY[name] is not builder:
        raise ValueError(f"register(): a builder named {name!r} is registered already (replace=True replaces it)")
    _REGISTRY[name] = builder
    return builder


def unregister(name: str) -> Builder[Any, Any]:
    """Remove the builder registered as ``name`` (a test that registered one of its own cleans up);
    returns it.

    Raises
    ------
    KeyError
        No such builder.
    """
    registry()  # (the built-in builders first, so they are never registered after this)
    if name not in _REGISTRY:
        raise KeyError(f"no builder named {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY.pop(name)


def registry() -> Mapping[str, Builder[Any, Any]]:
    """Every registered builder by name (read-only), the built-in ones included."""
    importlib.import_module("attnmeta.backends")  # registers the built-in builders on first import
    return MappingProxyType(_REGISTRY)


def get_builder(name: str) -> Builder[Any, Any]:
    """The registered builder called ``name``.

    Raises
    ------
    UnknownBuilderError
        No such builder (a ``KeyError`` and a ``ValueError``); the message lists the registered names.
    """
    found = _REGISTRY.get(name)
    if found is None:
        found = registry().get(name)  # the built-in builders register when attnmeta.backends is imported
    if found is None:
        raise UnknownBuilderError(f"builder: no builder named {name!r}; registered: {sorted(_REGISTRY)}")
    return found


def _described(value: Any) -> str:
    """``<type> <repr>`` of a wrong argument, the repr cut short."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def build(spec: BatchSpec, stager: Stager, builder: Builder[Any, MetadataT] | str, options: Any = None, **inputs: Any) -> MetadataT:
    """Common + one builder's metadata of ``spec`` in a step of its own (one copy).

    The common metadata is staged with exactly what the builder reads (:meth:`Builder.needs`).

    Parameters
    ----------
    spec : BatchSpec
        The step.
    stager : Stager
        Owns the pinned ring; the step commits before this returns.
    builder : Builder or str
        The builder, or its registry name.
    options : the builder's options type, optional
        Default: the builder's default options.
    **inputs
        The builder's per-step inputs (:attr:`Builder.inputs`).

    Returns
    -------
    The builder's metadata
        Device fields are views into the step's upload.

    Raises
    ------
    UnsupportedBatchError
        The builder cannot serve the batch (every reason listed); nothing is staged.
    TypeError
        ``spec`` not a :class:`BatchSpec`, ``stager`` not a :class:`~attnmeta.staging.Stager`,
        ``builder`` neither a :class:`Builder` nor a str, options of another type, or an input the
        builder does not take (each before any step begins).
    UnknownBuilderError
        No builder is registered as ``builder`` (a ``ValueError`` and a ``KeyError``).
    ValueError, attnmeta.staging.CapacityError
        As the builder's ``stage`` and :func:`attnmeta.stage_common`.
    """
    if type(spec) is not BatchSpec and not isinstance(spec, BatchSpec):
        raise TypeError(f"spec: expected a BatchSpec, got {_described(spec)}")
    if type(stager) is not Stager and not isinstance(stager, Stager):
        raise TypeError(f"stager: expected an attnmeta.Stager (e.g. Stager('cpu'), created once and kept), got "
                        f"{_described(stager)}")
    b: Builder[Any, MetadataT]
    if isinstance(builder, str):
        b = get_builder(builder)
    elif isinstance(builder, Builder):
        b = builder
    else:
        raise TypeError(f"builder: expected a Builder or a registered name (str), got {_described(builder)}")
    opts = b.options(options)
    unknown = set(inputs) - set(b.inputs)
    if unknown:
        raise TypeError(f"{b.name}: unknown input(s) {sorted(unknown)}; it takes {list(b.inputs)}")
    reasons = b.unsupported_reasons(spec, opts, **inputs)
    if reasons:
        raise UnsupportedBatchError(b.name, reasons)
    needs = b.needs(spec, opts)
    with stager.step() as step:
        common = stage_common(spec, step, token_arrays=needs.token_arrays, paged_kv=needs.paged_kv,
                              block_table_columns=None if stager.graph_mode else needs.block_table_columns)
        staged = b.stage(common, step, opts, **inputs)
    return staged.result()
