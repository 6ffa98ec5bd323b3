"""The step composer: a serving loop's whole step in one call and one copy, replaying steady-state steps.

An engine's step stages the common metadata of each KV-cache group, the builders its kernels read over
each, and arrays of its own (token ids, sampled-row indices), into one step of one stager. With the
composable API that is::

    with stager.step() as step:
        common = stage_common(spec, step, paged_kv=True)
        fi = FLASHINFER.stage(common, step)
        ids = step.alloc("engine.input_ids", len(tokens), np.int32)
        ids[:] = tokens

:class:`StepBuilder` does the same from a declaration made once (:class:`Group`: a common metadata
and the registered builders over it; :class:`Array`: an engine array), and returns the step's objects
(:class:`ComposedStep`). What it adds is **replay**: most steps of a serving loop repeat the layout that
their ring slot held ``num_slots`` steps earlier (a decode step, a spec-decode step, a padded CUDA-graph
step of one size). The first step of a layout on a slot is staged the ordinary way, through the
builders' own ``stage``, and recorded; a later step of that layout on that slot reserves the same fields
with one call (:meth:`attnmeta.staging.Step.restage`), rewrites every staged byte (the common pass of
each group, each builder's :meth:`~attnmeta.builder.Replayer.rewrite`, the engine's arrays), commits,
and makes each builder's metadata with its :meth:`~attnmeta.builder.Replayer.result`. A builder's
replay computes the step's values with the same functions as its ``derive``: a replayed step's
metadata equals the composed one, field for field (tests/compose/test_compose.py checks it on walks of
decode, spec-decode, prefill, mixed and padded steps, eager and graph mode).

A step replays when every builder of every group gives it a replay key
(:meth:`attnmeta.builder.Builder.replay_key`), no group is context-parallel, and its layout was
recorded on its slot: the same padded rows and tokens, block-table width, block size, optional spec
arrays, builder keys and array rows. An eager group stages the longest request's blocks rounded up
(:func:`table_columns`) and its page indices at the table's capacity: a layout lasts at least
``table_column_step * block_size`` steps of plain decoding. Any other step is staged the ordinary way.

The key is found without asking the builders again on most steps: the steps of a decode loop differ in
their lengths only (the longest sequence, the page count), and for builders that do not read those
(:meth:`~attnmeta.builder.Builder.reads_lengths`) the composer asks once per class of shapes without
them and adds the block-table width itself (the page count never changes an eager layout).

Why one module
--------------
A step's key (:meth:`StepBuilder._key`), what a recorded layout keeps (``_Record``: the writers, the
one-call common passes, the replayers, the arrays' views) and the replay that rewrites it must agree on
every field the layout holds: a part of the layout the key leaves out is one the replay would write
wrongly. Kept side by side, one reading shows they do.

Shape legend
------------
As in :mod:`attnmeta.metadata`; an array's rows are the length of the array given each step.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal, NoReturn

import numba
import numpy as np
import numpy.typing as npt
import torch

from attnmeta._fields import metadata_parts
from attnmeta.builder import AnyBuilder, Builder, Replayer, UnsupportedBatchError, checked_needs, get_builder
from attnmeta.common import CommonPasses, CommonWriter, _stage_common
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata
from attnmeta.spec import SCAN_HEAD, BatchSpec, StepShape, scan_counts, shapes_of, specs_of_scan
from attnmeta.staging import STAGEABLE_DTYPES, Staged, Stager, Step, StepLayout

__all__ = ["PARALLEL_MIN_ROWS", "Array", "ComposeStats", "ComposedStep", "Group", "SharedPrefixWarning", "StepBuilder",
           "table_columns"]

PARALLEL_MIN_ROWS = 512
"""Padded request rows from which a composer made with ``threads > 1`` replays a group's common pass
with the block-table rows and page indices copied on numba's thread pool (fewer rows stay on one thread:
the pool's hand-off costs more than it saves there; docs/speed-tricks.md)."""

_MAX_RECORDS = 512  # per ring slot; dropped (and re-recorded on demand) when a slot outgrows this
_MAX_KEYS = 4096  # layout keys kept by step shape; dropped (and computed again) when outgrown
_MISS = object()
_ANY_ROWS = "any rows"  # the first part of a key that leaves out the step's counts (graph mode, unpadded)
_NO_ARRAYS: list[np.ndarray] = []


def table_columns(spec: BatchSpec, column_step: int = 8) -> int:
    """The eager-mode ``block_table_columns`` a group with ``table_column_step`` stages for ``spec``:
    the longest request's block count ``need`` (columns of ``block_size * world_size`` tokens under
    context parallelism), at least 1, rounded up to a multiple of ``column_step``, or where more (and
    ``column_step`` > 1) of an eighth of the power of two at or above ``need``: four widths an octave
    past ``8 * column_step``, each under a quarter over ``need``, so a long request keeps its width
    longer. Never past the spec's block table (that would only copy zeros). Pass it to
    :func:`attnmeta.stage_common` to compose the same objects (docs/serving.md).

    Examples
    --------
    >>> from attnmeta import BatchSpec
    >>> spec = BatchSpec(num_computed_tokens=[70], num_scheduled_tokens=[1], block_table=[list(range(16))],
    ...                  block_size=8)
    >>> table_columns(spec), table_columns(spec, 1), table_columns(spec, 20)  # 9 blocks
    (16, 9, 16)
    >>> long = BatchSpec(num_computed_tokens=[1100], num_scheduled_tokens=[1], block_table=[[1] * 128], block_size=16)
    >>> table_columns(long), table_columns(long, 4), table_columns(long, 1)  # 69 blocks
    (80, 80, 69)
    """
    cp = spec.context_parallel
    span = spec.block_size * (1 if cp is None else cp.world_size)
    return _width(max(1, -(-spec.max_exact_seq_len // span)), column_step, int(spec.block_table.shape[1]))


def _shape_width(shape: StepShape, columns: int, step: int) -> int:
    """:func:`_width` of a step of ``shape`` without context parallelism whose builders need ``columns``
    (what the composer stages: ``table_columns`` of the step, at least ``columns`` before rounding)."""
    need = -(-shape.max_exact_seq_len // shape.block_size) or 1
    return _width(columns if columns > need else need, step, shape.table_columns)


def _scan_class_getter(groups: int) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The class of a :func:`~attnmeta.spec.scan_counts` result over ``groups`` groups, as one tuple: the
    scan without its lengths (``max_seq_len``, ``max_exact_seq_len`` and each group's ``num_pages``)."""
    lengths = {6, 7, *range(SCAN_HEAD, SCAN_HEAD + 3 * groups, 3)}
    return operator.itemgetter(*[i for i in range(SCAN_HEAD + 3 * groups) if i not in lengths])


def _lengths_fit(shape: StepShape, caps: tuple[int, int]) -> bool:
    """Graph mode: ``shape``'s pages and longest request within the profile's capacities ``caps``,
    ``(max_num_pages, max_blocks_per_req)``."""
    return shape.num_pages <= caps[0] and -(-shape.max_exact_seq_len // shape.block_size) <= caps[1]


def _width(need: int, step: int, table: int) -> int:
    """An eager group's staged block-table width (:func:`table_columns`): ``need`` rounded up, at most
    the ``table``'s columns unless ``need`` is more."""
    granule = max(step, (1 << (need - 1).bit_length()) >> 3) if step > 1 else 1  # (1: exact, as stage_common)
    w = -(-need // granule) * granule
    if w > table:
        w = table if table > need else need
    return w


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """One KV-cache group of a composed step: its common metadata and the builders staged over it.

    Parameters
    ----------
    builders : mapping of str to builder, builder name or (builder, options)
        The group's builders by the names their metadata and inputs go by (unique across groups).
    prefix : str, default "common"
        The namespace of the group's common fields, one per group.
    causal : bool, default True
        ``CommonAttentionMetadata.causal``.
    table_column_step : int, default 8
        Eager mode: the block table's staged width is a multiple of it (of more, for long requests).
    table_columns : int, optional
        Graph mode: the block table's fixed width; default the profile's at the group's block size.
    token_arrays : bool, optional
        Stage ``positions`` and ``slot_mapping``; default when a builder reads them.

    Each is described in full on its attribute below.

    Examples
    --------
    >>> from attnmeta.backends.flashinfer import FLASHINFER, FlashInferOptions
    >>> Group({"flashinfer": (FLASHINFER, FlashInferOptions(decode_threshold=2))}).prefix
    'common'
    """

    builders: Mapping[str, AnyBuilder | str | tuple[AnyBuilder | str, Any]]
    """Name -> a builder (its default options) or ``(builder, options)``, a builder given as an object
    or by its registry name (``"flashinfer"``, as :func:`attnmeta.build` takes it). The name keys the
    builder's metadata in the :class:`ComposedStep` and its inputs in :meth:`StepBuilder.build`; it is
    unique across the composer's groups."""
    prefix: str = "common"
    """Namespace of the group's common fields (one per group)."""
    causal: bool = True
    """``CommonAttentionMetadata.causal``."""
    table_column_step: int = 8
    """Eager mode: stage ``block_table_tensor`` with the longest request's block count rounded up to a
    multiple of this many columns (of more past ``8 * table_column_step``: :func:`table_columns`), at
    least what the builders need (:meth:`~attnmeta.builder.Builder.needs`), at most the spec's table
    unless they need more. The width is part of a replay's layout: 1, the exact count, starts a new
    layout each time the longest request gets a block. Graph mode stages :attr:`table_columns`."""
    table_columns: int | None = None
    """Graph mode: the block table's fixed width, vLLM's ``max_num_blocks_per_req`` of the group's KV-cache
    spec (a ``"none"``-mode Mamba group with spec decode: ``1 + num_speculative_blocks``). None: the
    profile's at the group's block size (:meth:`StaticProfile.for_block_size <attnmeta.StaticProfile.for_block_size>`)."""
    token_arrays: bool | None = None
    """Stage the per-token ``positions`` and ``slot_mapping``: None (the default) when a builder of the
    group reads them (:meth:`~attnmeta.builder.Builder.needs`), and always for a group without builders
    (its common metadata is all a kernel gets, as :func:`attnmeta.stage_common` stages it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Array:
    """An array of the engine's own staged in the composed step (token ids, the rows of last step's
    samples): it travels in the step's one copy.

    Parameters
    ----------
    name : str
        Its staged field name, ``<prefix>.<name>`` under a prefix no group or builder of the composer
        stages under (``engine.input_ids``).
    dtype : numpy dtype
        A stageable one (:data:`attnmeta.staging.STAGEABLE_DTYPES`).
    capacity : int, optional
        Graph mode (required there): the most rows it can ever have.
    fill : scalar, default 0
        Graph mode: the sentinel of the rows past a step's; a value ``dtype`` holds exactly (checked
        when the array is first staged, as :meth:`attnmeta.staging.Step.alloc` checks a fill).

    Raises
    ------
    TypeError, ValueError
        Naming the array and the argument: an empty name, a dtype that cannot be staged, a capacity
        below 0.

    Examples
    --------
    >>> import numpy as np
    >>> Array("engine.input_ids", np.int32, capacity=8192).fill
    0
    """

    name: str
    """Its staged field name (unique in the step)."""
    dtype: npt.DTypeLike
    """A stageable numpy dtype (:data:`attnmeta.staging.STAGEABLE_DTYPES`)."""
    capacity: int | None = None
    """Graph mode (required there): the most rows it can ever have; rows past a step's hold ``fill``."""
    fill: Any = 0
    """Graph mode: the sentinel of the rows past a step's."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Array: name must be a str, got {type(self.name).__name__} {self.name!r}")
        if not self.name:
            raise ValueError("Array: name must not be empty (a staged field's name, e.g. 'engine.input_ids')")
        try:
            dt = np.dtype(self.dtype)
        except TypeError:
            dt = None
        if dt not in STAGEABLE_DTYPES:
            what = f"dtype {self.dtype!r} is not a numpy dtype" if dt is None else f"dtype {dt} cannot be staged"
            raise TypeError(f"Array({self.name!r}): {what} (one of {sorted(str(d) for d in STAGEABLE_DTYPES)})")
        c = self.capacity
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | np.integer)):
            raise TypeError(f"Array({self.name!r}): capacity must be an int or None, got {type(c).__name__} {c!r}")
        if c is not None and c < 0:
            raise ValueError(f"Array({self.name!r}): capacity must be >= 0, got {c}")


class ComposedStep:
    """What :meth:`StepBuilder.build` returns: one committed step's metadata objects.

    Device tensors are views into the step's device arena (one copy), valid for kernels enqueued on the
    commit stream after the build; host arrays are read-only views into the step's pinned slot, valid
    until the stager reuses the slot (``num_slots`` steps later), as for every builder. It expires with
    its step, as the metadata objects do: once a newer step reuses the memory, reading any of its
    attributes (``arrays`` included) raises :class:`~attnmeta.staging.StepExpiredError`. A tensor taken
    out of it before (``ids = out.arrays["engine.input_ids"]``) is a plain view and is not checked.

    Attributes
    ----------
    step : Step
        The committed step.
    commons : tuple of CommonAttentionMetadata
        Each group's common metadata, in the composer's group order.
    metadata : dict
        Each builder's metadata, by its name in its :class:`Group`.
    arrays : dict
        Each :class:`Array`'s device view, by name: ``(rows,)`` of its dtype, device.
    """

    __slots__ = ("_lease", "arrays", "commons", "metadata", "step")

    def __init__(self, step: Step, commons: tuple[CommonAttentionMetadata, ...], metadata: dict[str, Any],
                 arrays: dict[str, torch.Tensor]) -> None:
        self.step, self.commons, self.metadata, self.arrays = step, commons, metadata, arrays

    @property
    def common(self) -> CommonAttentionMetadata:
        """The first group's common metadata."""
        return self.commons[0]

    def __getitem__(self, name: str) -> Any:
        """The metadata of the builder called ``name``."""
        try:
            return self.metadata[name]
        except KeyError:
            raise KeyError(f"{name!r}: no builder of that name in this step (its builders: {list(self.metadata)}; "
                           f"arrays are in .arrays)") from None

    def __repr__(self) -> str:
        return (f"ComposedStep(step={self.step.number}, groups={len(self.commons)}, builders={list(self.metadata)}, "
                f"arrays={list(self.arrays)})")


@dataclasses.dataclass(slots=True)
class ComposeStats:
    """Counts over a :class:`StepBuilder`'s life (for monitoring and benchmarks)."""

    steps: int = 0
    """Steps built."""
    replayed: int = 0
    """Steps replayed from a recorded layout (the rest were staged through the builders' ``stage``)."""


class _Group:
    """A :class:`Group`, resolved: its builders with their options, in order."""

    __slots__ = ("any_rows", "builders", "causal", "column_step", "columns", "prefix", "tokens")

    def __init__(self, g: Group) -> None:
        if not isinstance(g, Group):
            raise TypeError(f"groups: expected attnmeta.compose.Group objects, got {type(g).__name__}"
                            + (" (pass the groups as separate arguments: StepBuilder(stager, group, ...))"
                               if isinstance(g, list | tuple) else ""))
        if isinstance(g.table_column_step, bool) or not isinstance(g.table_column_step, int) or g.table_column_step < 1:
            raise ValueError(f"Group.table_column_step: expected an int >= 1, got {g.table_column_step!r}")
        if not isinstance(g.causal, bool | np.bool_):
            raise TypeError(f"Group.causal: expected a bool, got {type(g.causal).__name__} {g.causal!r}")
        if not isinstance(g.prefix, str) or not g.prefix or "." in g.prefix:
            raise ValueError(f"Group.prefix: must be a non-empty name without '.', got {g.prefix!r}")
        if g.table_columns is not None and (isinstance(g.table_columns, bool) or not isinstance(g.table_columns, int)
                                            or g.table_columns < 1):
            raise ValueError(f"Group.table_columns: expected an int >= 1 or None, got {g.table_columns!r}")
        self.prefix, self.causal, self.column_step = g.prefix, bool(g.causal), g.table_column_step
        self.columns = g.table_columns
        self.builders: list[tuple[str, AnyBuilder, Any]] = []
        if not isinstance(g.builders, Mapping):
            raise TypeError(f"Group.builders: expected a dict of name -> builder or (builder, options), e.g. "
                            f"Group({{'attn': FLASHINFER}}) or Group({{'attn': ('flashinfer', options)}}); got "
                            f"{type(g.builders).__name__}")
        for name, entry in g.builders.items():
            if isinstance(entry, tuple) and len(entry) != 2:
                raise TypeError(f"Group.builders[{name!r}]: expected a builder or (builder, options), got a tuple of "
                                f"{len(entry)}")
            b, o = entry if isinstance(entry, tuple) else (entry, None)
            if isinstance(b, str):
                b = get_builder(b)
            if not isinstance(b, Builder):
                raise TypeError(f"Group.builders[{name!r}]: expected a Builder, a registered builder's name or "
                                f"(builder, options), got {type(b).__name__}")
            self.builders.append((name, b, b.options(o)))
        if g.token_arrays is not None and not isinstance(g.token_arrays, bool):
            raise TypeError(f"Group.token_arrays: expected a bool or None, got {g.token_arrays!r}")
        self.tokens = g.token_arrays if g.token_arrays is not None else (True if not self.builders else None)
        self.any_rows = all(b.gives_any_rows_key for _n, b, _o in self.builders)  # (graph mode: any counts' layout)

    def needs(self, shape: StepShape) -> tuple[bool, bool, int]:
        """``(token arrays, paged KV layout, block-table columns)`` the group's common metadata needs for
        a step of ``shape``: what its builders read (:meth:`~attnmeta.builder.Builder.needs`), the token
        arrays as :attr:`Group.token_arrays` says."""
        tokens = paged = False
        columns = 0
        for _n, b, o in self.builders:
            needs = checked_needs(b, shape, o)
            tokens |= needs.token_arrays
            paged |= needs.paged_kv
            c = needs.block_table_columns
            if c is not None and c > columns:
                columns = c
        return (tokens if self.tokens is None else self.tokens), paged, columns


def _prefix_owners(groups: list[_Group]) -> dict[str, str]:
    """Who stages fields under each prefix: every group's common metadata and every builder whose options
    have a ``prefix``, as ``{prefix: description}``; warns (:class:`SharedPrefixWarning`) for each
    builder whose prefix another group or builder has too.

    Two builders of one prefix fail only on a step where both stage a field ("staged twice in one step"):
    FlashInfer in two groups fails on the first mixed step, while FlashAttention, which stages nothing
    of its own but for DCP and per-request causal flags, never does without them. The composer cannot
    tell ahead which, so it warns at construction instead of refusing.
    """
    owners: dict[str, str] = {g.prefix: f"group {g.prefix!r}'s common metadata" for g in groups}
    for g in groups:
        for name, b, o in g.builders:
            p = getattr(o, "prefix", None)
            if not isinstance(p, str):
                continue
            other = owners.get(p)
            if other is not None:
                warnings.warn(
                    f"Group.builders[{name!r}]: {b.name} stages its fields under prefix {p!r}, as {other} does: a "
                    f"step where both stage a field fails ('staged twice in one step'); give each builder its own, "
                    f"{name!r}: ({b.name!r}, dataclasses.replace(options, prefix={name!r}))", SharedPrefixWarning,
                    stacklevel=3)
            else:
                owners[p] = f"builder {name!r} ({b.name})"
    return owners


class SharedPrefixWarning(UserWarning):
    """Two builders (or a builder and a group, or an :class:`Array`) of one :class:`StepBuilder` stage under
    one prefix: a step where both stage a field raises "staged twice in one step"."""


class _Record:
    """A recorded layout on one ring slot: how to stage it again and rewrite it."""

    __slots__ = ("arrays", "devices", "graph_devices", "groups", "indices", "layout", "passes", "replayers")

    def __init__(self, layout: StepLayout, groups: list[tuple[CommonWriter, bool, bool, int]],
                 replayers: list[tuple[str, int, int, Replayer[Any, Any]]], arrays: list[tuple[str, np.ndarray]],
                 indices: list[str], devices: dict[str, torch.Tensor] | None) -> None:
        self.layout = layout
        self.groups = groups  # per group: (its writer, causal, whether it writes the page table, numba threads)
        # every group's common pass in one compiled call (None: group by group, each on numba's pool when
        # threaded), made by make_passes: False until then
        self.passes: CommonPasses | Literal[False] | None = False
        # eager mode: the arrays' device views, the recorded step's and every replay's (their rows are in the
        # key); graph mode: None (each step's rows)
        self.devices = devices
        # graph mode: the arrays' device views, by their row counts (views of the one arena: the same tensors
        # for every step that stages the same rows)
        self.graph_devices: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        self.replayers = replayers  # (builder name, group index, position in the group, replayer)
        self.arrays = arrays  # (name, writable host view: eager the step's rows, graph the whole capacity)
        self.indices = indices  # graph mode, per group: the page indices' field name ("" without a page table)

    def make_passes(self) -> CommonPasses | None:
        """:attr:`passes`, made when a decode step (every query of at most one token, or all of one length)
        records the layout, else at the layout's first replay: a serving loop records the layout of every
        step it composes, and those of mixed steps (prompt chunks joining running decodes, their queries of
        many lengths) seldom come back, while a decode loop's do (docs/speed-tricks.md has the A/B)."""
        groups = self.groups
        p = self.passes = (None if any(t > 1 or w.any_rows for w, *_g, t in groups) else
                           CommonPasses.of([w for w, *_g in groups]))
        return p


class StepBuilder:
    """Builds a serving loop's step, every group and builder of it and the engine's arrays, in one call
    and one copy; steady-state steps replay their slot's recorded layout (see the module docstring).

    Parameters
    ----------
    stager : Stager
        Owns the pinned ring; every :meth:`build` is one step of it (begun and committed inside).
    *groups : Group
        The step's KV-cache groups, at least one.
    arrays : sequence of Array, optional
        The engine's own arrays staged with the step.
    threads : int, default 1
        Replays of groups with at least :data:`PARALLEL_MIN_ROWS` padded rows copy the block-table rows
        and the page indices (a step's two big copies) on this many of numba's threads; the bytes are the
        same. The cost is cores: OpenMP's default wait policy keeps the ``threads - 1`` helpers spinning
        between steps (docs/speed-tricks.md). 1 never starts numba's threading layer.

    Notes
    -----
    Driven by one thread at a time, like its stager. Other code may use the same stager between builds:
    a replay rewrites every byte of its layout, and a layout recorded on a slot whose memory has since
    changed is recorded again.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> from attnmeta.backends.flash_attn import FLASH_ATTN
    >>> from attnmeta.backends.flashinfer import FLASHINFER
    >>> composer = StepBuilder(Stager("cpu"), Group({"fa": FLASH_ATTN, "fi": FLASHINFER}),
    ...                        arrays=[Array("engine.input_ids", np.int32)])
    >>> spec = BatchSpec(num_computed_tokens=[5, 17], num_scheduled_tokens=[1, 1],
    ...                  block_table=[[3, 4, 0, 0, 0], [7, 8, 9, 1, 2]], block_size=4)
    >>> for _ in range(4):  # the 4th step replays the layout the 1st recorded on ring slot 0
    ...     out = composer.build(spec, arrays={"engine.input_ids": np.array([11, 12], np.int32)})
    >>> # (host twins, and an array's device view of a cpu stager, whose device is the host: no device read)
    >>> out["fi"].paged_kv_indices_cpu.tolist(), out["fa"].max_seq_len, out.common.slot_mapping_cpu.tolist()
    ([3, 4, 7, 8, 9, 1, 2], 18, [17, 9])
    >>> out.arrays["engine.input_ids"].tolist(), composer.stats
    ([11, 12], ComposeStats(steps=4, replayed=1))
    """

    def __init__(self, stager: Stager, *groups: Group, arrays: Sequence[Array] = (), threads: int = 1) -> None:
        if not isinstance(stager, Stager):
            raise TypeError(f"stager: expected a Stager, got {type(stager).__name__}")
        if not groups:
            raise ValueError("groups: a composed step has at least one Group")
        most = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most:
            raise ValueError(f"threads: expected an int in [1, {most}] (numba's thread pool, NUMBA_NUM_THREADS), "
                             f"got {threads!r}")
        self._stager = stager
        self._groups = [_Group(g) for g in groups]
        names = [n for g in self._groups for n, _b, _o in g.builders]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"Group.builders: names must be unique across groups, {sorted(dup)} repeat")
        prefixes = [g.prefix for g in self._groups]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"Group.prefix: one per group, got {prefixes}")
        owners = _prefix_owners(self._groups)
        self._names = frozenset(names)
        self._arrays: list[tuple[str, np.dtype, int | None, Any]] = []
        for a in arrays:
            if not isinstance(a, Array):
                raise TypeError(f"arrays: expected attnmeta.compose.Array objects, got {type(a).__name__}")
            dt = np.dtype(a.dtype)  # (a stageable one: Array checks its fields)
            if stager.graph_mode and a.capacity is None:
                raise ValueError(f"Array({a.name!r}): a graph-mode stager needs its capacity")
            head, _dot, tail = a.name.partition(".")
            if head in owners:
                warnings.warn(f"Array({a.name!r}): its prefix {head!r} is {owners[head]}'s: a step where both stage "
                              f"a field of that name fails; name it under a prefix of its own (e.g. "
                              f"'engine.{tail or a.name}')", SharedPrefixWarning, stacklevel=2)
            self._arrays.append((a.name, dt, a.capacity, a.fill))
        self._array_names = frozenset(a[0] for a in self._arrays)
        if len(self._array_names) != len(self._arrays):
            raise ValueError("arrays: names must be unique")
        self._graph = stager.graph_mode
        # graph mode: one layout may serve the unpadded steps of any counts (every builder has an any_rows_key)
        self._any_rows = self._graph and all(g.any_rows for g in self._groups)
        prof = stager.profile  # (graph mode: the capacities a step's lengths must fit, read every step)
        self._caps: dict[tuple[str, int], tuple[int, int]] = {}  # (graph mode: a group's at a block size, _caps_of)
        self._row_caps = (0, 0) if prof is None else (prof.max_num_reqs, prof.max_num_tokens)
        self._threads = threads
        self._token = object()  # this composer's key in each slot's extras
        self._no_inputs = self._inputs({})  # every builder's empty inputs (the usual step's)
        self._keys: dict[tuple[StepShape, ...], tuple[Hashable, ...] | None] = {}  # by shapes, without inputs
        self._classes: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}  # _key's, by shapes without lengths
        self._scan_classes: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}  # the same, by scans without them
        # graph mode: the entries whose keys leave out the counts, by scans without their lengths and counts
        self._free_classes: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}
        self._scan_class = _scan_class_getter(len(self._groups))
        self._numbers: dict[tuple[Hashable, ...], int] = {}  # a class's number, by its key without lengths
        self._made = 0  # class numbers given (never reused)
        self._no_groups = np.zeros((0, 3), np.int64)  # scan_counts's scratch of a one-group step (never written)
        self.stats = ComposeStats()

    @property
    def stager(self) -> Stager:
        """The :class:`Stager` every step goes through."""
        return self._stager

    def build(self, specs: BatchSpec | Sequence[BatchSpec], inputs: Mapping[str, Any] | None = None,
              arrays: Mapping[str, np.ndarray] | None = None) -> ComposedStep:
        """One step: stage the specs' metadata and the arrays, commit (one copy), return the objects.

        Parameters
        ----------
        specs : BatchSpec or sequence of BatchSpec
            One per group, in group order (a single spec for a single group). Reordered as the builders
            require (decodes first).
        inputs : mapping, optional
            Builder name -> its ``<Family>Inputs`` for this step (builders not named: no inputs).
        arrays : mapping, optional
            :class:`Array` name -> this step's host values, a 1-D numpy array of its dtype; every
            declared array must be given.

        Returns
        -------
        ComposedStep
            The step's common metadata, builder metadata and array views.

        Raises
        ------
        attnmeta.UnsupportedBatchError
            A builder cannot serve the step (every reason listed; before the step begins, unless the
            step has a replay key and its slot had not recorded its layout).
        TypeError, ValueError, attnmeta.staging.CapacityError
            An unknown input or array name, a missing or mistyped array, the wrong number of specs; and
            as :func:`attnmeta.stage_common` and the builders' ``stage``. The step is then abandoned
            (nothing copied) and the stager is ready for the next one.
        """
        self.stats.steps += 1
        if type(specs) is BatchSpec or isinstance(specs, BatchSpec):
            sp: tuple[Any, ...] = (specs,)
        elif isinstance(specs, list | tuple):
            sp = tuple(specs)
        else:
            raise TypeError(f"specs: expected a BatchSpec, or a list or tuple of one BatchSpec per group "
                            f"({len(self._groups)}), got {type(specs).__name__} {specs!r:.80}")
        for s in sp:
            if type(s) is not BatchSpec and not isinstance(s, BatchSpec):
                raise TypeError(f"specs: expected a BatchSpec, or a list or tuple of one BatchSpec per group "
                                f"({len(self._groups)}), got a {type(specs).__name__} holding {type(s).__name__} "
                                f"{s!r:.80}")
        if len(sp) != len(self._groups):
            raise ValueError(f"specs: expected one BatchSpec per group ({len(self._groups)}), got {len(sp)}")
        inp = self._no_inputs if not inputs else self._inputs(inputs)  # (an engine's usual {}: none)
        arr = _NO_ARRAYS if arrays is None and not self._arrays else self._check_arrays(arrays)
        shapes = tuple(s.shape for s in sp)
        return self._run(shapes, self._key(shapes, inp, arr), inp, arr, sp, None)

    def build_counts(
        self, num_computed_tokens: npt.ArrayLike, num_scheduled_tokens: npt.ArrayLike,
        tables: Sequence[tuple[npt.ArrayLike, int]], *, num_prompt_tokens: npt.ArrayLike | None = None,
        num_draft_tokens: npt.ArrayLike | None = None, seq_lens_upper_bound: npt.ArrayLike | None = None,
        num_reqs_padded: int | None = None, num_tokens_padded: int | None = None,
        inputs: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None,
    ) -> ComposedStep:
        """One step from the scheduler's arrays: :meth:`build` of the specs they make, without making
        them on a steady-state step.

        Equal to ``build(specs, inputs, arrays)`` with ``specs[0] = BatchSpec(num_computed_tokens=...,
        num_scheduled_tokens=..., block_table=tables[0][0], block_size=tables[0][1], <the optional
        arrays>, num_reqs_padded=..., num_tokens_padded=...)`` and ``specs[g] =
        specs[0].for_group(block_table=tables[g][0], block_size=tables[g][1])``: the same metadata,
        field for field, and the same errors. A step that replays its slot's recorded layout validates
        the counts against every group's table in one compiled scan, reads the arrays in place (no
        copies, no :class:`~attnmeta.BatchSpec`) and finds the layout's key from the scan (its class,
        the scan without its lengths, then what the lengths add: no cache by exact step shape, which a
        serving loop's decode steps, each with new lengths, would only fill); any other step makes the
        specs, from the arrays and the scan's scalars without checking them again
        (:func:`~attnmeta.spec.specs_of_scan`), and is composed as :meth:`build` composes it.

        Parameters
        ----------
        num_computed_tokens, num_scheduled_tokens : (num_reqs,) int32, host
            As :class:`~attnmeta.BatchSpec`. Read during the call only: the caller may change them as
            soon as it returns.
        tables : sequence of (block_table, block_size)
            One per group, in group order: ``(num_reqs or more, columns)`` int32 host tables and their
            block sizes (a table is read during the call only, as by :meth:`build`).
        num_prompt_tokens, num_draft_tokens, seq_lens_upper_bound : (num_reqs,) int32, host, optional
            As :class:`~attnmeta.BatchSpec`.
        num_reqs_padded, num_tokens_padded : int, optional
            CUDA-graph padding, as :class:`~attnmeta.BatchSpec`.
        inputs, arrays : mapping, optional
            As :meth:`build`.

        Returns
        -------
        ComposedStep
            As :meth:`build`.

        Raises
        ------
        TypeError, ValueError, attnmeta.UnsupportedBatchError, attnmeta.staging.CapacityError
            As ``BatchSpec(...)``, :meth:`~attnmeta.BatchSpec.for_group` and :meth:`build` (the counts'
            and tables' errors name the field, the row and the rule).

        Notes
        -----
        The fast path takes arrays that a spec would keep as they are (C-contiguous int32 numpy arrays,
        ``(block_table, block_size)`` tuples of int32 tables and ``int`` block sizes, ``int`` padding);
        anything else (lists, other dtypes, context parallelism: use :meth:`build`) is converted or
        refused by the specs' constructor, as :meth:`build` would.
        """
        c, q, prompt, drafts, ub = (num_computed_tokens, num_scheduled_tokens, num_prompt_tokens, num_draft_tokens,
                                    seq_lens_upper_bound)
        rp, tp = num_reqs_padded, num_tokens_padded
        n = len(self._groups) - 1  # (a scratch of the call's own: the scan runs without the GIL, and the one
        # thread the stager allows is not yet checked here)
        scan = scan_counts(c, q, tables, prompt, drafts, ub, rp, tp, np.empty((n, 3), np.int64) if n else self._no_groups)
        if scan is None:  # (not arrays a spec keeps as they are, or a broken rule: the specs say which)
            return self.build(_make_specs(c, q, tables, prompt, drafts, ub, rp, tp), inputs, arrays)
        self.stats.steps += 1
        inp = self._no_inputs if not inputs else self._inputs(inputs)
        arr = _NO_ARRAYS if arrays is None and not self._arrays else self._check_arrays(arrays)
        shapes = shapes_of(scan)
        key = self._lengths_key(shapes, inp, arr, scan) if inp is self._no_inputs else self._key(shapes, inp, arr)
        return self._run(shapes, key, inp, arr, None, (c, q, tables, prompt, drafts, ub, scan))

    def _run(self, shapes: tuple[StepShape, ...], key: tuple[Hashable, ...] | None, inputs: list[list[Any]],
             arrays: list[np.ndarray], specs: tuple[BatchSpec, ...] | None, counts: tuple[Any, ...] | None
             ) -> ComposedStep:
        """The step: replayed when its slot recorded its layout ``key``, else composed. Of ``specs``
        (:meth:`build`) or of ``counts``, :meth:`build_counts`'s arrays and their scan (its specs are made
        only for a composed step: :func:`_specs_of`)."""
        if key is None:  # (every builder's reasons first: a step that cannot be served is never begun)
            sp = specs if specs is not None else _specs_of(counts)
            self._check(sp, inputs)
            return self._compose(self._stager.step(), sp, shapes, inputs, arrays, None)
        step = self._stager.step()
        records = step.slot_extras.get(self._token)
        rec = None if records is None else records.get(key)
        rows: dict[str, int] | None = None
        if rec is not None and self._graph:  # the row counts of the fields that change from step to step
            rows = {}
            for name, shape in zip(rec.indices, shapes):
                if name:
                    rows[name] = shape.num_pages
            for (name, *_r), a in zip(self._arrays, arrays):
                rows[name] = len(a)
            for (w, *_g), shape in zip(rec.groups, shapes):
                if w.any_rows:  # (an any-rows writer: the fields whose rows are the step's counts)
                    w.restage_rows(shape, rows)
        try:
            restaged = rec is not None and step.restage(rec.layout, rows)
        except BaseException:
            step.abandon()
            raise
        if rec is None or not restaged:
            try:
                sp = specs if specs is not None else _specs_of(counts)
            except BaseException:
                step.abandon()
                raise
            return self._compose(step, sp, shapes, inputs, arrays, key)
        try:
            return self._replay(step, rec, shapes, inputs, arrays, specs, counts)
        except ValueError as e:  # (the step was abandoned): the builders' reasons, as a composed step gives
            if not isinstance(e, UnsupportedBatchError):
                self._check(specs if specs is not None else _specs_of(counts), inputs)
            raise

    # ------------------------------------------------------------------ the step's inputs and key
    def _inputs(self, inputs: Mapping[str, Any]) -> list[list[Any]]:
        """Every builder's inputs, by group and position (each checked for its type)."""
        unknown = set(inputs) - self._names
        if unknown:
            raise TypeError(f"inputs: no builder named {sorted(unknown)}; the builders are {sorted(self._names)}")
        return [[b.inputs(inputs.get(n)) for n, b, _o in g.builders] for g in self._groups]

    def _check_arrays(self, arrays: Mapping[str, np.ndarray] | None) -> list[np.ndarray]:
        """The declared arrays of ``arrays`` in declaration order, each a 1-D numpy array of its dtype
        within its capacity (else :meth:`_array_error` raises)."""
        got = arrays or {}
        if len(got) != len(self._arrays):
            self._array_error(got)
        out = []
        for name, dt, cap, _fill in self._arrays:
            a = got.get(name)
            # (the dtype by identity first: an array of a declared dtype almost always holds numpy's own object)
            if type(a) is not np.ndarray or (a.dtype is not dt and a.dtype != dt) or a.ndim != 1 or (
                    cap is not None and len(a) > cap):
                self._array_error(got)
            out.append(a)
        return out

    def _array_error(self, got: Mapping[str, Any]) -> NoReturn:
        """Raise the error of ``got``'s names, or of its first array that is not as declared."""
        if got.keys() != self._array_names:
            names = [n for n, *_r in self._arrays]
            raise TypeError(f"arrays: expected exactly {names}, got {sorted(got)}")
        for name, dt, cap, _fill in self._arrays:
            a = got[name]
            if type(a) is not np.ndarray or a.dtype != dt or a.ndim != 1:
                text = (f"numpy array of {a.dtype} and shape {a.shape}" if isinstance(a, np.ndarray)
                        else f"{type(a).__name__} {a!r:.60}")
                raise TypeError(f"arrays[{name!r}]: expected a 1-D numpy array of {dt}, got {text}")
            if cap is not None and a.shape[0] > cap:
                raise ValueError(f"arrays[{name!r}]: {a.shape[0]} rows exceed the capacity {cap}")
        raise AssertionError("_array_error: every array is as declared")  # pragma: no cover

    def _key(self, shapes: tuple[StepShape, ...], inputs: list[list[Any]], arrays: list[np.ndarray]
             ) -> tuple[Hashable, ...] | None:
        """Everything the step's layout depends on, or None: compose it (context parallelism, a builder
        without a replay key, graph mode beyond the profile: the builders raise their errors). A
        function of the shapes, the inputs and (eager mode) the arrays' rows.

        A step without inputs takes the key of its shapes if it was computed before; else what does
        not depend on the step's lengths is found once per class of shapes (the shapes without
        ``max_seq_len``, ``max_exact_seq_len`` and ``num_pages``: the steps of a decode loop are of one
        class), and the lengths add the block-table width of each group; a group
        with a builder that reads the lengths (:meth:`~attnmeta.builder.Builder.reads_lengths`) is
        asked for every new shape. (:meth:`build_counts` asks :meth:`_lengths_key` directly, with its
        scan: no key is kept by exact shape, which a serving loop's decode steps, each with new lengths,
        would only fill.)"""
        if inputs is not self._no_inputs:  # (the key without the counts first where it may be one)
            for any_rows in (True, False) if self._any_rows and shapes[0].num_reqs_padded is None else (False,):
                parts = [self._group_key(g, s, i, None, any_rows) for g, s, i in zip(self._groups, shapes, inputs)]
                if None not in parts:
                    return self._with_rows((_ANY_ROWS, *parts) if any_rows else tuple(parts), arrays)
            return None
        key: Any = self._keys.get(shapes, _MISS)  # (a loop that repeats its steps exactly: a benchmark's)
        if key is _MISS:
            if len(self._keys) >= _MAX_KEYS:
                self._keys.clear()
            key = self._keys[shapes] = self._lengths_key(shapes, inputs, _NO_ARRAYS)
        return None if key is None else self._with_rows(key, arrays)

    def _lengths_key(self, shapes: tuple[StepShape, ...], inputs: list[list[Any]], arrays: list[np.ndarray],
                     scan: tuple[Any, ...] | None = None) -> tuple[Hashable, ...] | None:
        """:meth:`_key` of a step without inputs: its class's part (:meth:`_class_entry`), what its
        lengths add, and (eager mode) the rows of ``arrays``. ``scan``: :meth:`build_counts`'s scan,
        whose class (the scan without its lengths) stands for the shapes'. (One call for the whole key:
        a serving loop's every step computes it, after a wait that left the caches cold.)"""
        free: Any = None
        if scan is None:
            classes = self._classes
            cls = shapes[0][:6] + shapes[0][9:] if len(shapes) == 1 else tuple([s[:6] + s[9:] for s in shapes])
            entry = classes.get(cls, _MISS)  # (a StepShape without its three lengths)
        else:
            classes, cls = self._scan_classes, self._scan_class(scan)
            entry = _MISS
            if self._any_rows and scan[2] is None:  # (an unpadded graph-mode step: its class without its counts)
                free = cls[4:]
                entry = self._free_classes.get(free, _MISS)
            if entry is _MISS:
                entry = classes.get(cls, _MISS)  # (the scan without its lengths)
        if entry is _MISS:
            entry = self._class_entry(shapes, inputs)
            if free is not None and entry is not None and entry[2]:  # (a key without the counts: any counts' too)
                classes = self._free_classes
                cls = free
            if len(classes) >= _MAX_KEYS:
                classes.clear()
            classes[cls] = entry
        if entry is None:
            return None
        assert isinstance(entry, tuple)
        number, groups, any_rows = entry
        if any_rows:  # (the class's entry serves any counts: this step's within the profile, else composed)
            s0, (reqs, tokens) = shapes[0], self._row_caps
            if s0.num_reqs > reqs or s0.padded_num_tokens > tokens:
                return None
        key: list[Hashable] = [_ANY_ROWS, number] if any_rows else [number]
        for i, e in enumerate(groups):
            shape = shapes[i]
            if e is None:  # (a builder reads the lengths)
                part = self._group_key(self._groups[i], shape, inputs[i], None, any_rows)
                if part is None:
                    return None
                key.append(part)
            elif e[0]:  # eager: the block-table width (the page indices are staged at the table's capacity)
                key.append(_shape_width(shape, e[1], e[2]))
            elif not _lengths_fit(shape, e[1]):  # graph mode (else composed: the builders raise)
                return None
        return self._with_rows(tuple(key), arrays)

    def _with_rows(self, key: tuple[Hashable, ...], arrays: list[np.ndarray]) -> tuple[Hashable, ...]:
        """``key`` and, in eager mode, the arrays' rows."""
        if not arrays or self._graph:
            return key
        return (*key, tuple([len(a) for a in arrays]))

    def _class_entry(self, shapes: tuple[StepShape, ...], inputs: list[list[Any]]) -> tuple[Any, ...] | None:
        """A class of shapes' part of :meth:`_key`: None (such steps are composed), or ``(class number,
        per group: None when a builder reads the lengths, else eager mode's (True, block-table columns
        the builders need, the column step) or graph mode's (False, the capacities the lengths must
        fit), whether the key leaves out the counts)``. The builders are asked
        about the class's shape with the lengths 0. Classes whose keys without lengths are equal share
        their number (padded steps of other real counts share a layout), and a number is never reused.
        Graph mode: an unpadded step's key leaves out its counts where every builder gives it an
        :meth:`~attnmeta.builder.Builder.any_rows_key`."""
        for any_rows in (True, False) if self._any_rows and shapes[0].num_reqs_padded is None else (False,):
            entry = self._class_parts(shapes, inputs, any_rows)
            if entry is not None:
                return entry
        return None

    def _class_parts(self, shapes: tuple[StepShape, ...], inputs: list[list[Any]], any_rows: bool
                     ) -> tuple[Any, ...] | None:
        """:meth:`_class_entry` with the builders' any-counts keys (``any_rows``) or their replay keys."""
        groups: list[tuple[Any, ...] | None] = []
        parts: list[Hashable] = []
        prof = self._stager.profile
        for g, shape, inp in zip(self._groups, shapes, inputs):
            if shape.context_parallel is not None:
                return None
            if any(b.reads_lengths(o) for _n, b, o in g.builders):
                groups.append(None)
                parts.append(None)
                continue
            blank = shape._replace(max_seq_len=0, max_exact_seq_len=0, num_pages=0)
            needs = g.needs(blank)
            part = self._group_key(g, blank, inp, needs, any_rows)
            if part is None:
                return None
            parts.append(part)
            groups.append((True, needs[2], g.column_step) if prof is None else
                          (False, self._caps_of(g, shape.block_size)))
        static = tuple(parts)
        number = self._numbers.get(static)
        if number is None:
            if len(self._numbers) >= _MAX_KEYS:
                self._numbers.clear()
            self._made += 1
            number = self._numbers[static] = self._made
        return (number, groups, any_rows)

    def _group_key(self, g: _Group, shape: StepShape, inputs: list[Any],
                   needs: tuple[bool, bool, int] | None = None, any_rows: bool = False) -> tuple[Hashable, ...] | None:
        """One group's part of :meth:`_key` for a step of ``shape``, or None (compose). Given the
        group's ``needs`` of a shape without lengths (:meth:`_class_entry`), the part without what
        :meth:`_key` adds from the lengths (the block-table width, graph mode's checks of
        the width and the pages). ``any_rows`` (graph mode, an unpadded step): the part without the
        counts, of the builders' :meth:`~attnmeta.builder.Builder.any_rows_key`."""
        if shape.context_parallel is not None:
            return None
        lengths = needs is None
        tokens, paged, columns = g.needs(shape) if needs is None else needs
        Bp, Tp = shape.padded_num_reqs, shape.padded_num_tokens
        bs = shape.block_size
        parts: list[Hashable] = []
        prof = self._stager.profile
        if prof is not None:
            if Bp > prof.max_num_reqs or Tp > prof.max_num_tokens:
                return None
            if lengths and not _lengths_fit(shape, self._caps_of(g, bs)):
                return None
            parts.append((tokens, paged) if any_rows else (Bp, Tp, tokens, paged))
        else:
            layout: tuple[Hashable, ...] = (Bp, Tp if tokens else 0, bs, tokens, paged)
            if lengths:
                layout += (_shape_width(shape, columns, g.column_step),)
            parts.append(layout)
        parts.append((shape.has_prompt, shape.has_drafts, shape.has_upper_bound))
        for (_n, b, o), i in zip(g.builders, inputs):
            k = b.any_rows_key(shape, o, i) if any_rows else b.replay_key(shape, o, i)
            if k is None:
                return None
            parts.append(k)
        return tuple(parts)

    def _caps_of(self, g: _Group, block_size: int) -> tuple[int, int]:
        """Graph mode: the capacities group ``g`` of ``block_size`` fits a step's lengths in,
        ``(max_num_pages, block-table width)``: that block size's profile's
        (:meth:`StaticProfile.for_block_size <attnmeta.StaticProfile.for_block_size>`), the width
        :attr:`Group.table_columns` where given."""
        caps = self._caps.get((g.prefix, block_size))
        if caps is None:
            prof = self._stager.profile
            assert prof is not None
            p = prof.for_block_size(block_size)
            caps = self._caps[(g.prefix, block_size)] = (p.max_num_pages, g.columns or p.max_blocks_per_req)
        return caps

    def _check(self, specs: tuple[BatchSpec, ...], inputs: list[list[Any]]) -> None:
        """Raise :class:`~attnmeta.UnsupportedBatchError` for the first builder that cannot serve its
        group's spec (every reason it gives)."""
        for g, spec, inp in zip(self._groups, specs, inputs, strict=True):
            for (n, b, o), i in zip(g.builders, inp, strict=True):
                reasons = b.unsupported_reasons(spec, o, i)
                if reasons:
                    raise UnsupportedBatchError(n, reasons)

    def _records(self, step: Step) -> dict[Hashable, _Record]:
        """This composer's recorded layouts on ``step``'s ring slot, by key."""
        extras = step.slot_extras
        records: dict[Hashable, _Record] | None = extras.get(self._token)
        if records is None:
            records = extras[self._token] = {}
        return records

    # ------------------------------------------------------------------ a step of a new layout
    def _compose(self, step: Step, specs: tuple[BatchSpec, ...], shapes: tuple[StepShape, ...], inputs: list[list[Any]],
                 arrays: list[np.ndarray], key: tuple[Hashable, ...] | None) -> ComposedStep:
        """Stage the step through the builders' ``stage`` (begun by the caller); record its layout under
        ``key``."""
        commons, writers, paged_flags = [], [], []
        staged: list[list[Staged[Any, Any]]] = []
        views: list[np.ndarray] = []
        try:
            if key is not None:  # (a step without a key was checked before it began)
                self._check(specs, inputs)
            for g, spec, shape, inp in zip(self._groups, specs, shapes, inputs, strict=True):
                tokens, paged, columns = g.needs(shape)
                W = g.columns  # (graph mode: the group's fixed width, None for its block size's in the profile)
                if not self._graph:
                    W = _width(max(columns, table_columns(spec, 1)), g.column_step, int(spec.block_table.shape[1]))
                common, writer = _stage_common(spec, step, g.prefix, g.causal, W, tokens, paged)
                commons.append(common)
                writers.append(writer)
                paged_flags.append(common.paged is not None)
                staged.append([b.stage(common, step, o, i) for (_n, b, o), i in zip(g.builders, inp, strict=True)])
            for (name, dt, cap, fill), a in zip(self._arrays, arrays, strict=True):
                v = step.alloc(name, a.shape[0], dt, capacity=cap, fill=fill)
                v[...] = a
                views.append(v)
            step.commit()
        except BaseException:
            step.abandon()
            raise
        cms = tuple(c.result() for c in commons)
        meta = {n: s.result() for g, ss in zip(self._groups, staged, strict=True)
                for (n, _b, _o), s in zip(g.builders, ss, strict=True)}
        devices = {n: step.device(n) for n, *_r in self._arrays}
        if key is not None and not step.stats.grew:
            self._record(step, key, specs, inputs, commons, writers, paged_flags, staged, views, dict(devices))
        return step.own(ComposedStep(step, cms, meta, devices))

    def _record(self, step: Step, key: tuple[Hashable, ...], specs: tuple[BatchSpec, ...], inputs: list[list[Any]],
                commons: list[Any], writers: list[CommonWriter], paged: list[bool], staged: list[list[Staged[Any, Any]]],
                views: list[np.ndarray], devices: dict[str, torch.Tensor]) -> None:
        """Keep what a replay of this committed step's layout on its slot needs (unless a builder
        declines); ``devices``: a copy of the arrays' device views it handed out (the caller may change its dict)."""
        replayers: list[tuple[str, int, int, Replayer[Any, Any]]] = []
        for gi, (g, common, ss, inp) in enumerate(zip(self._groups, commons, staged, inputs, strict=True)):
            for pi, ((n, b, o), s, i) in enumerate(zip(g.builders, ss, inp, strict=True)):
                rep = b.replayer(s, common, step, o, i)
                if rep is None:
                    return
                replayers.append((n, gi, pi, rep))
        arrays = [(name, step.host_full(name) if self._graph else v)
                  for (name, *_r), v in zip(self._arrays, views, strict=True)]
        indices = [f"{g.prefix}.paged_kv_indices" if self._graph and p else "" for g, p in zip(self._groups, paged,
                                                                                               strict=True)]
        if key[0] is _ANY_ROWS:  # (the key left out the counts: _group_key)
            groups = [(CommonWriter.for_any_rows(w, step), g.causal, p, 1)
                      for g, w, p in zip(self._groups, writers, paged, strict=True)]
        else:
            groups = [(w, g.causal, p, self._threads if self._threads > 1 and w.num_reqs >= PARALLEL_MIN_ROWS else 1)
                      for g, w, p in zip(self._groups, writers, paged, strict=True)]
        records = self._records(step)
        if len(records) >= _MAX_RECORDS:
            records.clear()
        rec = records[key] = _Record(step.layout(), groups, replayers, arrays, indices, None if self._graph else devices)
        s0 = specs[0]
        if s0.max_query_len <= 1 or s0.uniform_queries:  # (a decode loop's layout, spec decode's too: replayed)
            rec.make_passes()

    # ------------------------------------------------------------------ a steady-state step
    def _replay(self, step: Step, rec: _Record, shapes: tuple[StepShape, ...], inputs: list[list[Any]],
                arrays: list[np.ndarray], specs: tuple[BatchSpec, ...] | None, counts: tuple[Any, ...] | None
                ) -> ComposedStep:
        """Rewrite ``rec``'s restaged fields for this step (of ``specs``, or of :meth:`build_counts`'s
        ``counts``), commit, and make the objects."""
        hosts: list[CommonHost] = []
        passes = rec.passes
        if passes is False:
            passes = rec.make_passes()
        try:
            if passes is not None:
                if specs is None:  # (build_counts: every group's counts are the same arrays)
                    passes.write_arrays(*counts[:6])  # type: ignore[index]
                elif not passes.write(specs):  # (specs with counts of their own)
                    passes = None
            if passes is not None:
                for (w, causal, _p, _t), shape in zip(rec.groups, shapes):
                    hosts.append(w.host(shape, causal))
            else:  # (group by group)
                for g, ((w, causal, _paged, threads), shape) in enumerate(zip(rec.groups, shapes)):
                    if w.any_rows:
                        w.set_rows(shape)
                    if specs is not None:
                        w.write(specs[g], threads=threads)
                    else:  # (each group's table its own)
                        c, q, tables, prompt, drafts, ub = counts[:6]  # type: ignore[index]
                        w.write_arrays(c, q, tables[g][0], prompt, drafts, ub, threads=threads)
                    hosts.append(w.host(shape, causal))
            for _n, gi, pi, rep in rec.replayers:
                rep.rewrite(step, hosts[gi], inputs[gi][pi])
            for (_name, view), a in zip(rec.arrays, arrays):
                view[: a.shape[0]] = a
            step.commit()
        except BaseException:
            step.abandon()
            raise
        self.stats.replayed += 1
        owned: list[Any] = []  # (the hosts are the builders' inputs, never handed out)
        cms: list[CommonAttentionMetadata] = []
        pks: list[PagedKVMetadata | None] = []
        for (w, causal, paged, _threads), shape in zip(rec.groups, shapes):
            cm = w.metadata(step, shape, causal)
            cms.append(cm)
            owned.append(cm)
            if paged:
                pk = w.paged_metadata(step, shape.num_pages)
                pks.append(pk)
                owned.append(pk)
            else:
                pks.append(None)
        meta = {}
        for n, gi, pi, rep in rec.replayers:
            meta[n] = m = rep.result(step, cms[gi], hosts[gi], pks[gi], inputs[gi][pi])
            owned.append(m)
            for part_name in metadata_parts(type(m)):  # (own_all: every metadata object they hold is owned)
                part = getattr(m, part_name)
                if part is not None and part is not cms[gi] and part is not pks[gi]:
                    owned.append(part)  # (Mamba2's checkpoint_meta of a prefill step)
        devices = rec.devices
        if devices is None:  # (graph mode: the arrays' views of the one arena, the same for the same rows)
            rows = tuple([len(a) for a in arrays])
            devices = rec.graph_devices.get(rows)
            if devices is None:
                if len(rec.graph_devices) >= _MAX_KEYS:
                    rec.graph_devices.clear()
                devices = rec.graph_devices[rows] = {n: step.device(n) for n, _v in rec.arrays}
        out = ComposedStep(step, tuple(cms), meta, devices.copy())
        owned.append(out)  # (it holds the others: one class change each at expiry, no walk)
        step.own_all(owned)
        return out

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.prefix}: {[n for n, _b, _o in g.builders]}"
                           + (f" (table_column_step={g.column_step})" if g.column_step != 8 else "") for g in self._groups)
        threads = f", threads={self._threads}" if self._threads != 1 else ""
        return (f"StepBuilder({groups}, arrays={[n for n, *_r in self._arrays]}{threads}, steps={self.stats.steps}, "
                f"replayed={self.stats.replayed})")


def _specs_of(counts: tuple[Any, ...] | None) -> tuple[BatchSpec, ...]:
    """The specs of :meth:`StepBuilder.build_counts`' ``(c, q, tables, prompt, drafts, ub, scan)``, its
    arrays and their :func:`~attnmeta.spec.scan_counts` (which checked every rule): equal to
    :func:`_make_specs` of the same arguments, without checking them again."""
    assert counts is not None  # (a step of build() comes with its specs)
    c, q, tables, prompt, drafts, ub, scan = counts
    return specs_of_scan(c, q, tables, prompt, drafts, ub, scan)


def _make_specs(c: Any, q: Any, tables: Any, prompt: Any, drafts: Any, ub: Any, rp: Any, tp: Any
                ) -> tuple[BatchSpec, ...]:
    """:meth:`StepBuilder.build_counts`'s specs, made (and checked) by the constructor."""
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence) or not tables:
        raise TypeError(f"tables: expected a non-empty sequence of (block_table, block_size), got {tables!r:.80}")
    made: list[BatchSpec] = []
    for g, t in enumerate(tables):
        if not isinstance(t, tuple) or len(t) != 2:
            raise TypeError(f"tables[{g}]: expected a (block_table, block_size) tuple, got {type(t).__name__}")
        made.append(BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=t[0], block_size=t[1],
                              num_prompt_tokens=prompt, num_draft_tokens=drafts, seq_lens_upper_bound=ub,
                              num_reqs_padded=rp, num_tokens_padded=tp) if g == 0
                    else made[0].for_group(block_table=t[0], block_size=t[1]))
    return tuple(made)

