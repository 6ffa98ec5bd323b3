"""One call per step for the common, FlashAttention and FlashInfer metadata of an engine's loop.

:class:`FusedStepBuilder` does what an engine's step does with the composable API::

    with stager.step() as step:
        common = stage_common(spec, step, paged_kv=True, block_table_columns=width)
        fa = flash_attn.stage(common, step)
        fi = flashinfer.stage(common, step)
    common, fa, fi = common.result(), fa.result(), fi.result()

(``width``: in eager mode the longest request's block count rounded up to a multiple of
``table_column_step``, 8 by default; with 1 it is ``stage_common``'s default width) and returns the
same three objects, field for field, from the same single copy. What it saves is the Python around
the compiled pass: on most steps of a serving loop it replays a layout it has seen instead of running
the composable builders.

Replay
------
A step whose split is the same in both backends whatever its values is **replayed** once the
builder has seen its layout on the step's ring slot. Those are the steps without context
parallelism, with FlashAttention's options staging nothing of their own (no DCP) and FlashInfer's
default options, that are either

- decode steps: every row's query at most one token, so every row is a decode row (the split's
  first rule, docs/semantics.md); or
- prefill-only steps: the first row's query is longer than both backends' decode thresholds, so
  every row is a prefill row (the split's second rule). Spec decode with the default thresholds is
  one (``1 + k`` query tokens a row), and so is a batch of prefills.

The layout is: which of the two kinds, same padded row and token counts, same block-table width,
same bucket of page counts (eager mode; in graph mode the width is the profile's and the page
indices have a fixed capacity), same block size, same optional spec arrays. In eager mode the width
is the longest request's block count rounded up to ``table_column_step`` columns (8 by default),
so a layout lasts while that does: about ``8 * block_size`` steps of plain decoding, and
``8 * block_size / (1 + k)`` of spec decoding with ``k`` drafts.

How a replay works, all through public interfaces: the first step of a layout on a slot runs the
composable builders and keeps the step's :class:`~attnmeta.staging.StepLayout`, the
:class:`~attnmeta.metadata.CommonWriter` that wrote it, and the three objects' field values. A later
step of that layout on that slot reserves the same fields with
:meth:`~attnmeta.staging.Step.restage`, runs the writer's compiled pass (which rewrites every staged
byte of the common fields and of the page table built with them; in graph mode FlashInfer's prefill
query indptr too, its own fixed buffer), commits, and builds the three objects from the recorded
values with the step's own scalars (the real row and token counts, ``max_query_len``,
``max_seq_len``, the page count and its views of ``paged_kv_indices``, FlashInfer's longest decode or
prefill query and ``max_kv_len``) through :func:`attnmeta._fields.positional_factory`, this module's
one construction trick (docs/benchmarks.md has its A/B). A slot whose
memory was reallocated, or a graph layout that grew, is recorded again (the stager drops a slot's
records with its memory, and ``restage`` refuses a stale layout).

A replay is the composable path's output by construction (the same kernels write the same bytes;
the objects carry the same views), and the tests check it field by field against the composable
builders on walks of decode, spec-decode, prefill, mixed and padded steps, in graph mode every fixed
device buffer too (tests/backends/test_fused.py).

Shape legend
------------
As in :mod:`attnmeta.metadata`, :mod:`attnmeta.backends.flash_attn` and
:mod:`attnmeta.backends.flashinfer`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numba
import numpy as np

from attnmeta._fields import positional_factory
from attnmeta.backends.flash_attn import FLASH_ATTN, FlashAttentionMetadata, FlashAttentionOptions
from attnmeta.backends.flashinfer import FLASHINFER, FlashInferMetadata, FlashInferOptions
from attnmeta.builder import UnsupportedBatchError
from attnmeta.common import CommonWriter, stage_common
from attnmeta.host.paged import prefill_qo_indptr
from attnmeta.metadata import CommonAttentionMetadata
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager, Step, StepLayout, bucket_rows

__all__ = ["PARALLEL_MIN_ROWS", "FusedStats", "FusedStep", "FusedStepBuilder", "table_columns"]

_DEFAULT_FI = FlashInferOptions()
_MAX_RECORDS = 512  # per ring slot; dropped (and re-recorded on demand) when a slot outgrows this
PARALLEL_MIN_ROWS = 512
"""Padded request rows from which a builder made with ``threads > 1`` replays a layout with the
block-table rows and page indices copied on numba's thread pool (fewer rows stay on one thread: the
pool's hand-off costs more than it saves there; docs/benchmarks.md)."""

_FIELDS: dict[type, list[str]] = {cls: [f.name for f in dataclasses.fields(cls)]
                                  for cls in (CommonAttentionMetadata, FlashAttentionMetadata, FlashInferMetadata)}
"""Each metadata class's fields in declaration order: the order of :func:`positional_factory`'s arguments."""
_make: dict[type, Any] = {cls: positional_factory(cls) for cls in _FIELDS}


def _at(cls: type, name: str) -> int:
    return _FIELDS[cls].index(name)


# The positions of the fields a replay sets from its step (the rest are the recorded layout's).
_CM_MAX_Q, _CM_MAX_SEQ, _CM_REAL_REQS, _CM_REAL_TOKENS = (
    _at(CommonAttentionMetadata, n) for n in ("max_query_len", "max_seq_len", "num_real_reqs", "num_real_tokens"))
_FA_COMMON, _FA_MAX_Q, _FA_MAX_SEQ = (
    _at(FlashAttentionMetadata, n) for n in ("common", "max_query_len", "max_seq_len"))
_FI_COMMON, _FI_PAGED, _FI_MAX_DQ, _FI_MAX_PQ, _FI_MAX_KV = (
    _at(FlashInferMetadata, n) for n in ("common", "paged", "max_decode_query_len", "max_prefill_query_len",
                                         "max_kv_len"))


class FusedStep(NamedTuple):
    """The metadata of one step built by :meth:`FusedStepBuilder.build`.

    Device tensors are views into the step's device arena (one copy), valid for kernels enqueued on
    the commit stream after the build; host arrays are read-only views into the step's pinned slot,
    valid until the stager reuses the slot (``num_slots`` steps later), as for every builder. A
    replayed step's objects share their view objects with other steps of the same layout on the same
    slot (the same bytes); no view handed out is ever resized.
    """

    common: CommonAttentionMetadata
    """The common metadata (``stage_common``'s fields, with FlashInfer's page table staged alongside)."""
    flash_attn: FlashAttentionMetadata | None
    """FlashAttention varlen metadata, or None when the builder was made with ``flash_attn=None``."""
    flashinfer: FlashInferMetadata | None
    """FlashInfer paged-KV metadata, or None when the builder was made with ``flashinfer=None``."""


@dataclasses.dataclass(slots=True)
class FusedStats:
    """Counts over a :class:`FusedStepBuilder`'s life (for monitoring and benchmarks)."""

    steps: int = 0
    """Steps built."""
    replayed: int = 0
    """Steps replayed from a recorded layout (the rest ran the composable builders)."""


class _Record:
    """A recorded layout on one ring slot: how to stage it again, and the three objects' field values.

    A replay builds its objects from these values (:func:`attnmeta._fields.positional_factory`, in
    declaration order), with the fields that depend on the step replaced: binding a metadata class's
    20-odd fields by keyword costs more than the rest of a replay's object work.
    """

    __slots__ = ("cm", "fa", "fi", "indices", "layout", "qo_full", "threads", "writer")

    def __init__(self, layout: StepLayout, writer: CommonWriter, cm: list[Any], fa: list[Any] | None,
                 fi: list[Any] | None, qo_full: np.ndarray | None, indices: str, threads: int) -> None:
        self.layout = layout
        self.writer = writer
        self.cm, self.fa, self.fi = cm, fa, fi  # the recorded step's field values, in declaration order
        self.qo_full = qo_full  # graph mode: FlashInfer's whole prefill query indptr buffer (writable)
        self.indices = indices  # graph mode: the page indices field, staged with each step's page count
        self.threads = threads


class FusedStepBuilder:
    """Builds a step's common + FlashAttention + FlashInfer metadata in one call and one copy.

    Parameters
    ----------
    stager : Stager
        Owns the pinned ring; every :meth:`build` is one step of it (begun and committed inside).
    flash_attn : FlashAttentionOptions, True or None, default True
        Options of the FlashAttention metadata (True: the defaults); None builds none.
    flashinfer : FlashInferOptions, True or None, default True
        Options of the FlashInfer metadata (True: the defaults); None builds none. With the default
        options the common pass also builds the page table (``stage_common(paged_kv=True)``).
    causal : bool, default True
        ``CommonAttentionMetadata.causal``.
    prefix : str, default "common"
        Namespace of the common metadata's staged fields.
    table_column_step : int, default 8
        Eager mode: stage ``block_table_tensor`` with the longest request's block count rounded up
        to a multiple of this many columns, i.e. ``stage_common(block_table_columns=...)`` with that
        width (the columns past a request's blocks are the engine's table's, and no kernel reads
        them). 1 is ``stage_common``'s default width. The width is part of a replay's layout: each
        time it changes, a new layout starts and its first step on each ring slot composes, which
        costs several times a replay. With 1 that happens every time the longest request gets a block
        (every ``block_size`` steps of decoding, every ``block_size / (1 + k)`` of spec decoding with
        ``k`` drafts); 8 makes it 8 times rarer for at most 28 more bytes a row. Graph mode stages the
        profile's width whatever this is.
    threads : int, default 1
        Replays of layouts with at least :data:`PARALLEL_MIN_ROWS` padded rows copy the block-table
        rows and the page indices (the step's two big copies) on this many of numba's threads
        (:func:`attnmeta._numba.pool_threads`, at most ``NUMBA_NUM_THREADS``); the bytes are the same.
        1 keeps every step on the calling thread and never starts numba's threading layer. The cost
        is cores: OpenMP's default wait policy keeps the ``threads - 1`` helpers spinning between
        steps, so a loop of such steps keeps ``threads`` cores busy the whole time, also while the
        host waits for the GPU; with ``OMP_WAIT_POLICY=passive`` they sleep, and the wake-up eats the
        gain (docs/benchmarks.md). Steps that compose (a layout's first step on a slot) run on one
        thread.

    Notes
    -----
    Driven by one thread at a time, like its stager. Other code may use the same stager between
    builds (other steps, other builders): a replay rewrites every byte of its layout, and a layout
    recorded on a slot that has since grown (new memory) is recorded again.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> builder = FusedStepBuilder(Stager("cpu"))
    >>> spec = BatchSpec(num_computed_tokens=[5, 17], num_scheduled_tokens=[1, 1],
    ...                  block_table=[[3, 4, 0, 0, 0], [7, 8, 9, 1, 2]], block_size=4)
    >>> for _ in range(4):  # the 4th step replays the layout the 1st recorded on ring slot 0
    ...     common, fa, fi = builder.build(spec)
    >>> fi.paged_kv_indices_cpu.tolist(), fa.max_seq_len, common.slot_mapping_cpu.tolist()
    ([3, 4, 7, 8, 9, 1, 2], 18, [17, 9])
    >>> builder.stats
    FusedStats(steps=4, replayed=1)
    """

    def __init__(
        self,
        stager: Stager,
        *,
        flash_attn: FlashAttentionOptions | bool | None = True,
        flashinfer: FlashInferOptions | bool | None = True,
        causal: bool = True,
        prefix: str = "common",
        table_column_step: int = 8,
        threads: int = 1,
    ) -> None:
        if not isinstance(stager, Stager):
            raise TypeError(f"stager: expected a Stager, got {type(stager).__name__}")
        if isinstance(table_column_step, bool) or not isinstance(table_column_step, int) or table_column_step < 1:
            raise ValueError(f"table_column_step: expected an int >= 1, got {table_column_step!r}")
        most = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most:
            raise ValueError(f"threads: expected an int in [1, {most}] (numba's thread pool, NUMBA_NUM_THREADS), "
                             f"got {threads!r}")
        fa = FlashAttentionOptions() if flash_attn is True else flash_attn or None
        fi = FlashInferOptions() if flashinfer is True else flashinfer or None
        if fa is not None and not isinstance(fa, FlashAttentionOptions):
            raise TypeError(f"flash_attn: expected FlashAttentionOptions, True or None, got {type(fa).__name__}")
        if fi is not None and not isinstance(fi, FlashInferOptions):
            raise TypeError(f"flashinfer: expected FlashInferOptions, True or None, got {type(fi).__name__}")
        self._stager = stager
        self._fa_opts: FlashAttentionOptions | None = fa
        self._fi_opts: FlashInferOptions | None = fi
        self._causal = bool(causal)
        self._prefix = prefix
        self._paged = fi is not None and fi == _DEFAULT_FI  # the common pass builds FlashInfer's page table
        self._graph = stager.graph_mode
        # Which steps can replay: default FlashInfer options, FlashAttention staging nothing.
        self._replay = (fa is None or fa.dcp_world_size == 1) and (fi is None or fi == _DEFAULT_FI)
        # A step whose first row's query is longer than every backend's decode threshold splits into
        # prefill rows only, in both backends, whatever its other rows (the split's second rule):
        # spec decode with the default thresholds, or a batch of prefills. Such steps replay too.
        self._prefill_above = max(fa.decode_threshold if fa is not None else 0,
                                  _DEFAULT_FI.decode_threshold if fi is not None else 0)
        self._token = object()  # this builder's key in each slot's extras
        self._column_step = table_column_step
        self._threads = threads
        self.stats = FusedStats()

    @property
    def stager(self) -> Stager:
        """The :class:`Stager` every step goes through."""
        return self._stager

    def build(self, spec: BatchSpec) -> FusedStep:
        """One step: stage ``spec``'s metadata, commit it (one copy), return the objects.

        Parameters
        ----------
        spec : BatchSpec
            The step (reordered: decodes first, as FlashInfer requires).

        Returns
        -------
        FusedStep
            ``(common, flash_attn, flashinfer)``; a backend built with None is None.

        Raises
        ------
        attnmeta.UnsupportedBatchError
            A context-parallel spec the FlashInfer options do not describe (before any step begins).
        ValueError, attnmeta.staging.CapacityError
            As :func:`attnmeta.stage_common` and the backends' ``stage`` functions. The step is then
            abandoned (nothing copied) and the stager is ready for the next one.
        """
        self.stats.steps += 1
        if spec.context_parallel is not None:
            reasons = FLASHINFER.unsupported_reasons(spec, self._fi_opts, None) if self._fi_opts is not None else []
            if reasons:
                raise UnsupportedBatchError(FLASHINFER.name, reasons)
            return self._compose(spec, self._stager.step(), None)
        if not self._replay:
            return self._compose(spec, self._stager.step(), None)
        if spec.max_query_len <= 1:
            kind = 0  # every row decodes, in both backends' splits
        elif int(spec.num_scheduled_tokens[0]) > self._prefill_above:
            kind = 1  # every row is a prefill row, in both backends' splits
        else:
            return self._compose(spec, self._stager.step(), None)
        B, T = spec.num_reqs, spec.num_tokens
        Bp = B if spec.num_reqs_padded is None else spec.num_reqs_padded
        Tp = T if spec.num_tokens_padded is None else spec.num_tokens_padded
        opt = (spec.num_prompt_tokens is None, spec.num_draft_tokens is None, spec.seq_lens_upper_bound is None)
        if self._graph:
            prof = self._stager.profile
            assert prof is not None
            if (spec.block_size != prof.block_size or Bp > prof.max_num_reqs or Tp > prof.max_num_tokens
                    or spec.num_pages > prof.max_num_pages
                    or -(-spec.max_exact_seq_len // spec.block_size) > prof.max_blocks_per_req):
                return self._compose(spec, self._stager.step(), None)  # raises the builders' errors
            key: tuple[Any, ...] = (kind, Bp, Tp, *opt)
        else:
            # Everything the layout depends on. The real row and token counts are not: they only set
            # scalars, so CUDA-graph padded steps of one padded size share a layout whatever their real
            # counts.
            key = (kind, Bp, Tp, table_columns(spec, self._column_step),
                   bucket_rows(spec.num_pages) if self._paged else 0, spec.block_size, *opt)
        step = self._stager.step()
        rec = self._records(step).get(key)
        if rec is None or not step.restage(rec.layout, {rec.indices: spec.num_pages} if rec.indices else None):
            return self._compose(spec, step, key)
        return self._replay_record(spec, step, rec, kind)

    def _replay_record(self, spec: BatchSpec, step: Step, rec: _Record, kind: int) -> FusedStep:
        """Rewrite ``rec``'s restaged fields for ``spec``, commit, and build the objects."""
        total = spec.num_pages
        try:
            rec.writer.write(spec, threads=rec.threads)
            if rec.qo_full is not None:  # graph mode: every row decodes (kind 0) or is a prefill row
                prefill_qo_indptr(rec.writer.qsl_ro, rec.writer.num_reqs if kind == 0 else 0, out=rec.qo_full)
            step.commit()
        except BaseException:
            step.abandon()
            raise
        self.stats.replayed += 1
        max_q, max_seq = spec.max_query_len, spec.max_seq_len
        v = rec.cm.copy()
        v[_CM_MAX_Q], v[_CM_MAX_SEQ], v[_CM_REAL_REQS], v[_CM_REAL_TOKENS] = max_q, max_seq, spec.num_reqs, spec.num_tokens
        own = step.own
        cm = own(_make[CommonAttentionMetadata](*v))
        fa = fi = None
        if rec.fa is not None:
            v = rec.fa.copy()
            v[_FA_COMMON], v[_FA_MAX_Q], v[_FA_MAX_SEQ] = cm, max_q, max_seq
            fa = own(_make[FlashAttentionMetadata](*v))
        if rec.fi is not None:
            v = rec.fi.copy()
            v[_FI_COMMON], v[_FI_PAGED], v[_FI_MAX_KV] = cm, own(rec.writer.paged_metadata(step, total)), spec.max_exact_seq_len
            v[_FI_MAX_DQ], v[_FI_MAX_PQ] = (0, max_q) if kind else (max_q, 0)
            fi = own(_make[FlashInferMetadata](*v))
        return FusedStep._make((cm, fa, fi))

    def _compose(self, spec: BatchSpec, step: Step, key: tuple[Any, ...] | None) -> FusedStep:
        """The composable builders on ``step`` (begun by the caller); records the layout under ``key``."""
        columns = table_columns(spec, self._column_step) if self._column_step > 1 and not self._graph else None
        try:
            staged = stage_common(spec, step, prefix=self._prefix, causal=self._causal, paged_kv=self._paged,
                                  block_table_columns=columns)
            fa_staged = FLASH_ATTN.stage(staged, step, self._fa_opts) if self._fa_opts is not None else None
            fi_staged = FLASHINFER.stage(staged, step, self._fi_opts) if self._fi_opts is not None else None
            step.commit()
        except BaseException:
            step.abandon()
            raise
        cm = staged.result()
        fa = fa_staged.result() if fa_staged is not None else None
        fi = fi_staged.result() if fi_staged is not None else None
        if key is not None and staged.writer is not None:
            self._record(step, key, staged.writer, cm, fa, fi)
        return FusedStep(cm, fa, fi)

    def _records(self, step: Step) -> dict[tuple[Any, ...], _Record]:
        """This builder's recorded layouts on ``step``'s ring slot, by key."""
        extras = step.slot_extras
        records: dict[tuple[Any, ...], _Record] | None = extras.get(self._token)
        if records is None:
            records = extras[self._token] = {}
        return records

    def _record(self, step: Step, key: tuple[Any, ...], writer: CommonWriter, cm: CommonAttentionMetadata,
                fa: FlashAttentionMetadata | None, fi: FlashInferMetadata | None) -> None:
        """Keep what a replay of this committed step's layout on its slot needs, unless the layout
        changed during the step or a backend staged fields a replay would not rewrite."""
        if step.stats.grew:
            return  # the slot's memory (eager) or the graph layout changed during the step
        common = set(writer.group.names)
        prefix = self._prefix + "."
        qo_name = f"{self._fi_opts.prefix}.qo_indptr_prefill" if fi is not None and self._fi_opts is not None else ""
        own = {n for n in step.field_names if n not in common}
        indices = ""
        if self._graph and self._paged:
            indices = prefix + "paged_kv_indices"
            own.discard(indices)
        qo_full = None
        if own:
            if own != {qo_name} or not self._graph:
                return  # a backend staged fields of its own (not seen with the options that replay)
            qo_full = step.host_full(qo_name)
        threads = self._threads if writer.num_reqs >= PARALLEL_MIN_ROWS else 1
        records = self._records(step)
        if len(records) >= _MAX_RECORDS:
            records.clear()
        records[key] = _Record(step.layout(), writer, [getattr(cm, n) for n in _FIELDS[CommonAttentionMetadata]],
                               _values(fa), _values(fi), qo_full, indices, threads)

    def __repr__(self) -> str:
        parts = [f"flash_attn={self._fa_opts is not None}", f"flashinfer={self._fi_opts is not None}",
                 *([f"table_column_step={self._column_step}"] if self._column_step != 8 else []),
                 *([f"threads={self._threads}"] if self._threads != 1 else []),
                 f"replay={'on' if self._replay else 'off'}", f"steps={self.stats.steps}",
                 f"replayed={self.stats.replayed}"]
        return f"FusedStepBuilder({', '.join(parts)})"


def _values(obj: Any) -> list[Any] | None:
    """A metadata object's field values in declaration order (None for None)."""
    return None if obj is None else [getattr(obj, n) for n in _FIELDS[type(obj)]]


def table_columns(spec: BatchSpec, column_step: int = 8) -> int:
    """The eager-mode ``block_table_columns`` a :class:`FusedStepBuilder` with ``table_column_step``
    stages for ``spec``: the longest request's block count (one column spans ``block_size *
    world_size`` tokens under context parallelism), at least 1, rounded up to a multiple of
    ``column_step``. Pass it to :func:`attnmeta.stage_common` to compose the same objects, or to keep
    a composable loop's layouts as long (docs/serving.md).

    Examples
    --------
    >>> from attnmeta import BatchSpec
    >>> spec = BatchSpec(num_computed_tokens=[70], num_scheduled_tokens=[1], block_table=[list(range(16))],
    ...                  block_size=8)
    >>> table_columns(spec), table_columns(spec, 1)
    (16, 9)
    """
    cp = spec.context_parallel
    span = spec.block_size * (1 if cp is None else cp.world_size)
    return -(-max(1, -(-spec.max_exact_seq_len // span)) // column_step) * column_step
