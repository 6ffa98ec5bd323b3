"""The builder contract, the registry of builders, and the one generic :func:`build`.

A **builder** turns a step's common metadata into one backend family's metadata. Every builder is an
object of one production contract (:class:`Builder`), named after its family ``<Family>``:

- a ``name`` (its registry key, and the default namespace of its staged fields);
- ``<Family>Options`` (:attr:`Builder.options_type`): a frozen dataclass validated once, when it is
  constructed (a wrong type is a ``TypeError`` naming the option, a bad value a ``ValueError``), whose
  ``prefix`` names the builder's staged fields (``<prefix>.<field>``; graph-mode users read the
  full-capacity views as ``step.device_full("<prefix>.<field>")``);
- ``<Family>Inputs`` (:attr:`Builder.inputs_type`), or None: a frozen dataclass of the step's own
  inputs (accepted-token counts, logits indices, the shared prefix, ...), every field optional;
- ``<Family>Metadata`` (:attr:`Builder.metadata_type`): what :meth:`Staged.result
  <attnmeta.staging.Staged.result>` returns after the commit;
- ``<Family>Host`` where it has one: the typed host part its :class:`~attnmeta.staging.Staged` hands
  to builders staged after it in the same step;
- :meth:`Builder.needs`: which common fields it reads (:class:`CommonNeeds`), so that :func:`build`
  derives and stages only those;
- :meth:`Builder.derive`: the host derivation, written into an open step;
- :meth:`Builder.unsupported_reasons`: every reason a batch/options/inputs triple cannot be served.

:meth:`Builder.stage` is the same for every builder and is not overridden: it does the shared
preamble once (the common metadata staged into this very step, the options and inputs of the right
types, their defaults) and then calls :meth:`Builder.derive`. The **lab** (what tests, the audit,
the demo and the benchmarks need besides: reference values, random options and inputs, the options
a demo shows) is a separate contract, registered by builder name in :mod:`attnmeta.testing.lab`;
production code never imports it.

For writing one, this module also exports the pieces every builder uses: :class:`MetadataBase` (the
field roles and the sync-free ``repr``/``describe`` of metadata types), :func:`keyword_factory` (a
builder's fast keyword constructor of its metadata type) and the declared option rules
(:func:`option_rule` in a field's metadata, :class:`OptionRule`, checked by
:func:`check_option_fields`: one declaration for ``__post_init__`` and for the bad-input test that
walks every registered builder's options).

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
>>> fa.query_start_loc_cpu.tolist(), fa.max_query_len
([0, 1, 4], 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar, final

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
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import Staged, Stager, Step

__all__ = [
    "AnyBuilder",
    "Builder",
    "CommonNeeds",
    "MetadataBase",
    "OptionRule",
    "Replayer",
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
    "require_same_step",
    "unregister",
]

OptionsT = TypeVar("OptionsT")
InputsT = TypeVar("InputsT")
HostT = TypeVar("HostT")
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


def checked_needs(builder: AnyBuilder, shape: StepShape, options: Any) -> CommonNeeds:
    """``builder.needs(shape, options)``, checked to be a :class:`CommonNeeds`.

    Raises
    ------
    TypeError
        ``needs`` returned something else (a builder author's mistake, named as such).
    """
    needs = builder.needs(shape, options)
    if type(needs) is not CommonNeeds:
        raise TypeError(f"{builder.name}: needs() must return an attnmeta.builder.CommonNeeds, got {_described(needs)}")
    return needs


def require_token_arrays(builder: AnyBuilder, common: StagedCommon, options: Any) -> None:
    """Raise where ``builder`` reads the per-token arrays (:meth:`Builder.needs`) and ``common``, staged
    by :func:`attnmeta.stage_common` with ``token_arrays=False``, has none: its metadata would hold an
    empty ``slot_mapping``, through which a kernel writes no KV. (A common metadata derived by another
    builder, which knows no spec, is not checked.)

    Raises
    ------
    ValueError
        As above.
    """
    spec = common.spec
    if spec is not None and checked_needs(builder, spec.shape, options).token_arrays:
        raise ValueError(
            f"{builder.name}: reads the per-token arrays (slot_mapping, positions), but the common metadata was "
            f"staged without them (stage_common(..., token_arrays=False)); stage it with token_arrays=True, or "
            f"with what the builder's needs() asks for (attnmeta.build does; in a step composer, leave "
            f"Group.token_arrays at None)"
        )


def require_same_step(common: Any, step: Step) -> None:
    """Raise unless ``common`` is a :class:`~attnmeta.StagedCommon` staged into ``step``.

    :meth:`Builder.stage` calls it when its cheap inline test fails (``type(common) is not
    StagedCommon or common.step is not step``); a subclass of ``StagedCommon`` staged into ``step``
    passes. A builder's device views and the common metadata's must come from one upload.

    Raises
    ------
    TypeError
        ``common`` is not a ``StagedCommon`` (the metadata object itself, a spec, None, ...).
    ValueError
        ``common`` was staged into another step.
    """
    if not isinstance(common, StagedCommon):
        what = type(common).__name__
        hint = (" (pass the StagedCommon that stage_common returned, not its .result())"
                if isinstance(common, CommonAttentionMetadata) else "")
        raise TypeError(
            f"common: expected the StagedCommon of this step (from attnmeta.stage_common(spec, step)), got {what}{hint}"
        )
    if common.step is not step:
        raise ValueError(
            "common: staged in another step; stage the common metadata and this builder into the same step "
            "(their device views come from one upload)"
        )


def _described(value: Any) -> str:
    """``<type> <repr>`` of a wrong argument, the repr cut short."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


class Replayer(Generic[InputsT, MetadataT]):
    """How a builder replays a step it staged before: a steady-state step of the same layout on the same
    ring slot (:class:`attnmeta.compose.StepBuilder`).

    :meth:`Builder.replayer` makes one from a step it staged; it keeps that step's host and device
    views of the builder's own fields (the slot's memory, unchanged while the layout lasts) and what
    the builder's metadata shares from step to step. A replay of a later step of the layout then
    costs :meth:`rewrite` (before the commit) and :meth:`result` (after it), instead of a
    :meth:`~Builder.derive`. Both compute the step's values the way ``derive`` does, with the same
    functions: a replay's metadata equals the one ``derive`` would have made, field for field.
    """

    def rewrite(self, step: Step, host: CommonHost, inputs: InputsT) -> None:
        """Write ``step``'s values into every byte of the builder's own staged fields (the slot holds
        another step's), before the commit; ``host`` is the step's common host part. Default: the
        builder stages no fields of its own for this layout."""

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: InputsT) -> MetadataT:
        """``step``'s metadata, after the commit: ``common`` and ``paged`` (the group's paged-KV layout,
        when staged) are the step's, ``host`` its common host part."""
        raise NotImplementedError


class Builder(Generic[OptionsT, InputsT, HostT, MetadataT]):
    """One backend family's metadata builder: the production contract every builder implements.

    Type parameters: the options, the per-step inputs (``None`` for a builder without inputs), the
    host part of its :class:`~attnmeta.staging.Staged` and the metadata.

    A subclass sets :attr:`name`, :attr:`options_type`, :attr:`metadata_type` (and
    :attr:`inputs_type` when it takes per-step inputs) and implements :meth:`derive`; :meth:`needs`
    and :meth:`unsupported_reasons` have defaults. A builder object holds no per-step state (its
    caches, if any, live with the staging slots), so one instance serves every stager and thread.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [a for a in ("name", "options_type", "metadata_type") if not hasattr(cls, a)]
        if "derive" not in vars(cls) and not any("derive" in vars(b) for b in cls.__mro__[1:-1] if b is not Builder):
            missing.append("derive")
        if missing:
            raise TypeError(f"{cls.__name__}: a Builder must define {', '.join(missing)}")
        for attr in ("options_type", "inputs_type"):
            t = vars(cls).get(attr)
            params = getattr(t, "__dataclass_params__", None)  # (a dataclass's; its frozen flag)
            if t is not None and not (isinstance(t, type) and params is not None and params.frozen):
                raise TypeError(f"{cls.__name__}.{attr}: expected a frozen dataclass (@dataclasses.dataclass(frozen=True)): "
                                f"{'options are' if attr == 'options_type' else 'inputs are'} immutable, so a step "
                                f"composer may key its layouts on them; got {t!r}")
        if "stage" in vars(cls):
            raise TypeError(f"{cls.__name__}: Builder.stage is the shared preamble; implement derive() instead")

    name: ClassVar[str]
    """Registry name (also the default ``prefix`` of its options)."""
    options_type: ClassVar[type]
    """``<Family>Options``: the frozen dataclass of its options; ``options_type()`` gives the defaults."""
    inputs_type: ClassVar[type | None] = None
    """``<Family>Inputs``: the frozen dataclass of its per-step inputs (every field optional), or None
    for a builder without any."""
    metadata_type: ClassVar[type]
    """``<Family>Metadata``: the class :meth:`derive`'s ``result()`` returns."""

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

    def inputs(self, inputs: InputsT | None) -> InputsT:
        """``inputs``, or the empty inputs for None (``inputs_type()``, or None for a builder without
        inputs); a ``TypeError`` naming the builder for another type."""
        t = self.inputs_type
        if inputs is None:
            if t is None:
                return None  # type: ignore[return-value]
            empty: InputsT | None = self.__dict__.get("_empty_inputs")
            if empty is None:
                empty = self.__dict__["_empty_inputs"] = t()
            return empty
        if t is None:
            raise TypeError(f"{self.name}: takes no per-step inputs, got {_described(inputs)}")
        if type(inputs) is not t and not isinstance(inputs, t):
            got = type(inputs).__name__
            if isinstance(inputs, Mapping):
                got += f" {inputs!r} (make the inputs from it: {t.__name__}(**inputs))"
            raise TypeError(f"{self.name}: inputs must be {t.__name__}, got {got}")
        return inputs

    def needs(self, shape: StepShape, options: OptionsT) -> CommonNeeds:
        """The common fields this builder reads for a step of ``shape`` (:attr:`BatchSpec.shape
        <attnmeta.BatchSpec.shape>`, the step's scalars) with ``options`` (default: every field, no
        paged-KV layout, the default block-table width). ``options`` is of the builder's options type,
        never None (:meth:`options` of None gives the defaults), as for :meth:`unsupported_reasons` and
        :meth:`replay_key`.

        A function of its arguments only: the step composer computes it once per shape."""
        return _ALL_TOKENS

    @final
    def stage(
        self, common: StagedCommon, step: Step, options: OptionsT | None = None, inputs: InputsT | None = None
    ) -> Staged[HostT, MetadataT]:
        """Derive this builder's metadata from the staged common metadata, staging into the same step.

        The shared preamble, then :meth:`derive`.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``, with at least :meth:`needs`.
        step : Step
            The open step.
        options : the builder's ``<Family>Options``, optional
            Default: the builder's default options.
        inputs : the builder's ``<Family>Inputs``, optional
            This step's inputs; default: none given (every field at its default).

        Returns
        -------
        Staged[host part, metadata]
            ``.host`` now (for builders staged after it), ``.result()`` after the commit.

        Raises
        ------
        TypeError
            ``common`` is not a :class:`~attnmeta.StagedCommon`, or options or inputs of another type.
        ValueError
            ``common`` was staged into another step, or without the per-token arrays this builder reads
            (:meth:`needs`); as the builder's :meth:`derive`.
        RuntimeError
            ``step`` is not open (it has committed, or was abandoned).
        """
        if type(common) is not StagedCommon or common.step is not step:
            require_same_step(common, step)  # raises (a subclass of the right step passes)
        if step.state != "open":
            step.require_open(f"{self.name}: stage()")
        opts = self.options(options)
        h = common.host
        if h.slot_mapping_cpu.shape[0] < h.num_actual_tokens:  # a common staged without token arrays
            require_token_arrays(self, common, opts)
        staged = self.derive(common, step, opts, self.inputs(inputs))
        if not isinstance(staged, Staged):
            raise TypeError(f"{self.name}: derive() must return an attnmeta.staging.Staged (the host part now, the "
                            f"metadata after the commit), got {_described(staged)}")
        return staged

    def derive(self, common: StagedCommon, step: Step, options: OptionsT, inputs: InputsT) -> Staged[HostT, MetadataT]:
        """The builder's derivation (called by :meth:`stage`, after the preamble): write this step's
        fields into ``step`` and return the host part and how to make the metadata after the commit.

        ``options`` and ``inputs`` are of the builder's types (never None, but for a builder without
        inputs); ``common`` was staged into ``step``. Each builder implements it."""
        raise NotImplementedError  # pragma: no cover - __init_subclass__ requires it

    def unsupported_reasons(self, spec: BatchSpec, options: OptionsT, inputs: InputsT) -> list[str]:
        """Every reason this builder cannot serve ``spec`` with ``options`` and ``inputs`` (an empty
        list when it can). :func:`build` raises :class:`UnsupportedBatchError` listing them."""
        return []

    def replay_key(self, shape: StepShape, options: OptionsT, inputs: InputsT) -> Hashable | None:
        """What the fields this builder stages for a step of ``shape`` (the step's scalars) depend on,
        beyond the common metadata's layout (their names, shapes and order, and which views its
        metadata holds): two steps of one key on one ring slot stage the same fields at the same places.
        None: this step is staged the ordinary way (:meth:`derive`), never replayed. Default None (a
        builder opts in to replay by implementing this and :meth:`replayer`).

        A function of its arguments only: the step composer computes it once per shape (for a step
        without inputs) and reuses it."""
        return None

    def reads_lengths(self, options: OptionsT) -> bool:
        """Whether :meth:`needs` and :meth:`replay_key` read the step's lengths with ``options``:
        :attr:`~attnmeta.StepShape.max_seq_len`, :attr:`~attnmeta.StepShape.max_exact_seq_len` and
        :attr:`~attnmeta.StepShape.num_pages`, the scalars that change every step of a decode loop.
        Default True.

        False promises, for every ``shape`` and ``inputs``, with ``blank = shape._replace(max_seq_len=0,
        max_exact_seq_len=0, num_pages=0)``: ``replay_key(shape, ...) == replay_key(blank, ...)``, and
        ``needs(shape, ...)`` equals ``needs(blank, ...)`` but for its ``block_table_columns``, which is
        None for both or the larger of ``needs(blank, ...).block_table_columns`` and the blocks of the
        longest request (``cdiv(max_exact_seq_len, block_size)``, at least 1). The step composer then
        asks once per step shape without lengths instead of every step (a decode loop's steps differ
        in lengths only); :func:`attnmeta.testing.check_reads_lengths` checks the promise on a shape
        (and :func:`attnmeta.testing.check_builder` on every batch it builds)."""
        return True

    def replayer(self, staged: Staged[HostT, MetadataT], common: StagedCommon, step: Step, options: OptionsT,
                 inputs: InputsT) -> Replayer[InputsT, MetadataT] | None:
        """A :class:`Replayer` of ``staged``, what :meth:`stage` returned in ``step`` (committed) for a
        spec whose :meth:`replay_key` was not None; None when this step cannot be replayed after all.
        Default None."""
        return None

    def any_rows_key(self, shape: StepShape, options: OptionsT, inputs: InputsT) -> Hashable | None:
        """Graph mode, an unpadded step (``num_reqs_padded`` None): the key under which one recorded
        layout of this builder serves such steps of any request and token counts, or None (the
        default): :meth:`replay_key` decides, its layouts naming the counts.

        Not None promises, for such steps: neither the key nor :meth:`needs` depends on the step's counts
        (``num_reqs``, ``num_tokens``, ``num_tokens_padded``: the composer asks once for the steps that
        differ in those only); every field :meth:`derive` stages has one place and
        capacity whatever the counts (its rows follow the common fields' only through views the builder
        makes per step); and the :class:`Replayer` of a step so keyed reads every count from the step's
        common part (``host``, ``common``, ``paged``), keeping no view of the recorded step's rows. Where
        every builder of every group gives a step such a key, the step composer records one layout for
        those steps, instead of one per count: a serving loop's mixed steps (prompt chunks joining
        running decodes), whose counts change from step to step, replay it. A function of its
        arguments only, as :meth:`replay_key`; :meth:`reads_lengths` covers both.
        :func:`attnmeta.testing.check_any_rows_key` checks the first promise on a shape
        (:func:`attnmeta.testing.check_builder` on every batch it builds)."""
        return None

    @property
    def gives_any_rows_key(self) -> bool:
        """Whether this builder implements :meth:`any_rows_key` (the default returns None for every
        step): in graph mode a step composer keys unpadded steps without their counts where every builder
        of every group does.

        Examples
        --------
        >>> from attnmeta.builder import get_builder
        >>> get_builder("flashinfer").gives_any_rows_key, get_builder("flash_attn").gives_any_rows_key
        (True, False)
        """
        return type(self).any_rows_key is not Builder.any_rows_key

    def build(self, spec: BatchSpec, stager: Stager, options: OptionsT | None = None,
              inputs: InputsT | None = None) -> MetadataT:
        """:func:`build` with this builder: common + this builder's metadata in one step of its own."""
        return build(spec, stager, self, options, inputs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


AnyBuilder = Builder[Any, Any, Any, Any]
"""A builder of any types (the registry's entries)."""

_ALL_TOKENS = CommonNeeds()
_REGISTRY: dict[str, AnyBuilder] = {}


def register(builder: Builder[OptionsT, InputsT, HostT, MetadataT], *,
             replace: bool = False) -> Builder[OptionsT, InputsT, HostT, MetadataT]:
    """Add ``builder`` to the registry under ``builder.name``; returns it.

    Raises
    ------
    TypeError
        ``builder`` is not a :class:`Builder`.
    ValueError
        The name is taken (pass ``replace=True`` to replace it), or is not a non-empty str without ``.``.
    """
    if not isinstance(builder, Builder):
        raise TypeError(f"register(): expected a Builder, got {type(builder).__name__}")
    name = builder.name
    if type(name) is not str or not name or "." in name:
        raise ValueError(f"register(): a builder's name must be a non-empty str without '.' (it is also the default "
                         f"prefix of its staged fields, '<name>.<field>'), got {_described(name)}")
    if not replace and name in _REGISTRY and _REGISTRY[name] is not builder:
        raise ValueError(f"register(): a builder named {name!r} is registered already (replace=True replaces it)")
    _REGISTRY[name] = builder
    return builder


def unregister(name: str) -> AnyBuilder:
    """Remove the builder registered as ``name`` (a test that registered one of its own cleans up);
    returns it.

    Raises
    ------
    KeyError
        No such builder.
    """
    if name not in _REGISTRY:
        raise KeyError(f"no builder named {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY.pop(name)


def registry() -> Mapping[str, AnyBuilder]:
    """Every registered builder by name (read-only), the built-in ones included (the package's
    ``__init__`` imports :mod:`attnmeta.backends`, which registers them, before any of its modules can
    be used)."""
    return MappingProxyType(_REGISTRY)


def get_builder(name: str) -> AnyBuilder:
    """The registered builder called ``name``.

    Raises
    ------
    UnknownBuilderError
        No such builder (a ``KeyError`` and a ``ValueError``); the message lists the registered names.
    """
    found = _REGISTRY.get(name)
    if found is None:
        raise UnknownBuilderError(f"builder: no builder named {name!r}; registered: {sorted(_REGISTRY)}")
    return found


def build(spec: BatchSpec, stager: Stager, builder: Builder[Any, Any, Any, MetadataT] | str, options: Any = None,
          inputs: Any = None) -> MetadataT:
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
    inputs : the builder's inputs type, optional
        The builder's per-step inputs (:attr:`Builder.inputs_type`).

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
        ``builder`` neither a :class:`Builder` nor a str, options or inputs of another type (each
        before any step begins).
    UnknownBuilderError
        No builder is registered as ``builder`` (a ``ValueError`` and a ``KeyError``).
    ValueError, attnmeta.staging.CapacityError
        As the builder's :meth:`~Builder.derive` and :func:`attnmeta.stage_common`.
    """
    if type(spec) is not BatchSpec and not isinstance(spec, BatchSpec):
        raise TypeError(f"spec: expected a BatchSpec, got {_described(spec)}")
    if type(stager) is not Stager and not isinstance(stager, Stager):
        raise TypeError(f"stager: expected an attnmeta.Stager (e.g. Stager('cpu'), created once and kept), got "
                        f"{_described(stager)}")
    b: Builder[Any, Any, Any, MetadataT]
    if isinstance(builder, str):
        b = get_builder(builder)
    elif isinstance(builder, Builder):
        b = builder
    else:
        raise TypeError(f"builder: expected a Builder or a registered name (str), got {_described(builder)}")
    opts = b.options(options)
    inp = b.inputs(inputs)
    reasons = b.unsupported_reasons(spec, opts, inp)
    if reasons:
        raise UnsupportedBatchError(b.name, reasons)
    needs = checked_needs(b, spec.shape, opts)
    with stager.step() as step:
        common = stage_common(spec, step, token_arrays=needs.token_arrays, paged_kv=needs.paged_kv,
                              block_table_columns=None if stager.graph_mode else needs.block_table_columns)
        staged = b.stage(common, step, opts, inp)
    return staged.result()
