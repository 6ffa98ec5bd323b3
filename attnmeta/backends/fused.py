"""One call per step for the common, FlashAttention and FlashInfer metadata of an engine's loop.

:class:`FusedStepBuilder` does what an engine's step does with the composable API::

    with stager.step() as step:
        common = stage_common(spec, step, paged_kv=True, block_table_columns=width)
        fa = flash_attn.stage(common, step)
        fi = flashinfer.stage(common, step)
    common, fa, fi = common.result(), fa.result(), fi.result()

(``width``: in eager mode the longest request's block count rounded up to a multiple of
``table_column_step``, 8 by default; with 1 it is ``stage_common``'s default width) and returns the
same three objects, field for field, from the same single copy. What it saves is the
Python around the compiled pass: the composable path builds, per step, three ``Staged`` objects,
their closures, three host dicts, a split and a field group lookup, which on the H200 hosts cost more
host time than the compiled pass and the copy together at small batches (docs/benchmarks.md).

Replay
------
A step whose split is the same in both backends whatever its values is **replayed** once the
builder has seen its layout on the step's ring slot. Those are the steps without context
parallelism, with the backends' default options (FlashAttention: any ``max_num_splits`` and
``decode_threshold``, ``causal`` a bool or None), that are either

- decode steps: every row's query at most one token, so every row is a decode row (the split's
  first rule, vllm-semantics.md 5.1); or
- prefill-only steps: the first row's query is longer than both backends' decode thresholds, so
  every row is a prefill row (the split's second rule). Spec decode with the default thresholds is
  one (``1 + k`` query tokens a row), and so is a batch of prefills.

The layout is: which of the two kinds, same padded row and token counts, same block-table width,
same bucket of page counts (eager mode; in graph mode the width is the profile's and the page
indices have a fixed capacity), same block size, same optional spec arrays. In eager mode the width
is the longest request's block count rounded up to ``table_column_step`` columns (8 by default),
so a layout lasts while that does: about ``8 * block_size`` steps of plain decoding, and
``8 * block_size / (1 + k)`` of spec decoding with ``k`` drafts.

A replay runs the common pass's compiled kernel into the slot, which rewrites every staged byte of
the layout, so nothing depends on what the slot held (a builder made with ``threads > 1`` copies the
block-table rows and page indices of layouts of :data:`PARALLEL_MIN_ROWS` rows or more on numba's
thread pool, around the kernel: the same bytes). In graph mode the pass's FlashInfer outputs
(page table and prefill query indptr) are addressed in FlashInfer's fixed buffers, so that one pass
writes them too, from the block-table rows it has just staged; in a prefill-only step the prefill
query indptr is ``query_start_loc`` itself (no row decodes), also written by the pass. The replay
then commits (in graph mode with the step's staged rows, so the stager refills the sentinels past
them exactly as for the composable builders) and builds the three objects from the slot's cached
views, with the step's own scalars: the real row and token counts, ``max_query_len``,
``max_seq_len``, the page count and its ``paged_kv_indices`` views, FlashInfer's longest decode or
prefill query and ``max_kv_len``. Every other step, and the first step of each layout on each slot,
goes through the composable builders on the same step and records the layout for later replays; a
slot whose memory was reallocated, or a graph layout that grew (a new device arena), is recorded
again.

A replay is the composable path's output by construction (the same kernels write the same bytes;
the objects carry the views the composable path caches for that slot and layout), and the tests
check it field by field against the composable builders on walks of decode, spec-decode, prefill,
mixed and padded steps, in graph mode every fixed device buffer too (tests/backends/test_fused.py).

Shape legend
------------
As in :mod:`attnmeta.metadata`, :mod:`attnmeta.backends.flash_attn` and
:mod:`attnmeta.backends.flashinfer`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, NamedTuple

import numba
import numpy as np
import torch

from attnmeta.backends import flash_attn as _fa
from attnmeta.backends import flashinfer as _fi
from attnmeta.backends.flash_attn import FlashAttentionMetadata, FlashAttnOptions, _new_fa
from attnmeta.backends.flashinfer import FlashInferMetadata, FlashInferOptions, _new_fi
from attnmeta.host.common import _bt_rows_par_nb, _common_packed_nb, _indices_par_nb
from attnmeta.metadata import CommonAttentionMetadata, _bucket, _new_common, stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager

__all__ = ["PARALLEL_MIN_ROWS", "FusedStats", "FusedStep", "FusedStepBuilder", "table_columns"]

_DEFAULT_FI = FlashInferOptions()
_EMPTY = np.zeros(0, np.int32)
_MAX_RECORDS = 512  # per ring slot; dropped (and re-recorded on demand) when a slot outgrows this
PARALLEL_MIN_ROWS = 512
"""Padded request rows from which a builder made with ``threads > 1`` replays a layout with the
block-table rows and page indices copied on numba's thread pool. Fewer rows stay on one thread: on
an H200 host a 256-request step took 50.8 us on one thread and 57.4 / 59.7 on 2 / 4 (the pool's
hand-off costs more than it saves there)."""


_FIELD_NAMES: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls))
    for cls in (CommonAttentionMetadata, FlashAttentionMetadata, FlashInferMetadata)
}
"""Each metadata class's fields in declaration order (its positional constructor's arguments)."""
_GETTERS = {cls: operator.attrgetter(*names) for cls, names in _FIELD_NAMES.items()}


def _index(cls: type, name: str) -> int:
    return _FIELD_NAMES[cls].index(name)


_CM_MAX_SEQ = _index(CommonAttentionMetadata, "max_seq_len")
_CM_MAX_Q = _index(CommonAttentionMetadata, "max_query_len")
_CM_REAL_REQS = _index(CommonAttentionMetadata, "num_real_reqs")
_CM_REAL_TOKENS = _index(CommonAttentionMetadata, "num_real_tokens")
_FA_MAX_SEQ = _index(FlashAttentionMetadata, "max_seq_len")
_FA_MAX_Q = _index(FlashAttentionMetadata, "max_query_len")
_FI_MAX_DQ = _index(FlashInferMetadata, "max_decode_query_len")
_FI_MAX_PQ = _index(FlashInferMetadata, "max_prefill_query_len")
_FI_INDICES = _index(FlashInferMetadata, "paged_kv_indices")
_FI_INDICES_CPU = _index(FlashInferMetadata, "paged_kv_indices_cpu")
_FI_PAGES = _index(FlashInferMetadata, "num_pages")
_FI_MAX_KV = _index(FlashInferMetadata, "max_kv_len")


class FusedStep(NamedTuple):
    """The metadata of one step built by :meth:`FusedStepBuilder.build`.

    Device tensors are views into the step's device arena (one copy), valid for kernels enqueued on
    the commit stream after the build; host arrays are read-only views into the step's pinned slot,
    valid until the stager reuses the slot (``num_slots`` steps later), as for every builder. A
    replayed step's objects share their view objects with later replays of the same layout on the
    same slot; once the slot is reused, ``flashinfer.paged_kv_indices`` may also be resized in place
    (to the later step's page count), not only rewritten.
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
    """A recorded layout on one ring slot: the kernel's buffers, the step's size, object templates.

    Kept in the slot's :attr:`~attnmeta.staging.Step.slot_extras`, which the stager empties when it
    reallocates the slot's memory (eager growth) or re-creates the graph arena: a record never
    outlives the bytes and views it names.
    """

    __slots__ = ("args", "cm", "end", "fa", "fi", "fields", "graph", "idx_cpu", "idx_dev", "idx_view", "par", "threads",
                 "total")

    def __init__(self, end: int, fields: dict[str, Any], args: tuple[Any, ...], cm: list[Any], fa: list[Any] | None,
                 fi: list[Any] | None, idx_cpu: Any, idx_dev: Any, total: int) -> None:
        self.end, self.fields = end, fields  # what the step staged (Step._restage's arguments)
        self.args = args  # (staged bytes, host-only bytes, offsets, dims) of _common_packed_nb
        self.cm, self.fa, self.fi = cm, fa, fi  # positional constructor arguments of the three objects
        self.idx_cpu, self.idx_dev = idx_cpu, idx_dev  # read-only full page-index views (bucketed / capacity)
        # The record's own device view of the first ``total`` page indices, made at the first replay
        # whose page count differs from the recorded step's, then resized in place (see _emit).
        self.idx_view: Any = None
        self.total = total  # the page count the templates' index views have
        # Graph mode only: the page indices' field name (``fields`` holds it at the current page count).
        self.graph: str = ""
        # > 1: a replay copies the block-table rows and page indices on that many of numba's threads,
        # through ``par``: writable views of the block table, indptr and indices (None without a page table)
        self.threads = 1
        self.par: tuple[Any, Any, Any] | None = None


class FusedStepBuilder:
    """Builds a step's common + FlashAttention + FlashInfer metadata in one call and one copy.

    Parameters
    ----------
    stager : Stager
        Owns the pinned ring; every :meth:`build` is one step of it (begun and committed inside).
    flash_attn : FlashAttnOptions, True or None, default True
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
        costs several times a replay (a new layout builds its views). With 1 that happens every time
        the longest request gets a block (every ``block_size`` steps of decoding, every
        ``block_size / (1 + k)`` of spec decoding with ``k`` drafts); 8 makes it 8 times rarer for
        at most 28 more bytes a row (``benchmarks/bench_replay_rate.py``). Graph mode stages the
        profile's width whatever this is.
    threads : int, default 1
        Replays of layouts with at least :data:`PARALLEL_MIN_ROWS` padded rows copy the block-table
        rows and the page indices (the step's two big copies) on this many of numba's threads
        (``numba.set_num_threads`` around the calls, at most ``NUMBA_NUM_THREADS``); the bytes are
        the same. 1 keeps every step on the calling thread and never starts numba's threading layer.
        The first parallel replay starts it (OpenMP on most installs); its start changes the
        OpenMP thread count torch's CPU ops see, which the builder puts back. The cost is cores:
        OpenMP's default wait policy keeps the ``threads - 1`` helpers spinning between steps, so
        a loop of such steps keeps ``threads`` cores busy the whole time, also while the host waits
        for the GPU; with ``OMP_WAIT_POLICY=passive`` they sleep, and the wake-up eats the gain. On
        an H200 host a 1024-request decode step took 142 us on one thread, 127 on 2 and 107 on 4
        (docs/benchmarks.md). Steps that compose (a layout's first step on a slot) run on one thread.

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
        flash_attn: FlashAttnOptions | bool | None = True,
        flashinfer: FlashInferOptions | bool | None = True,
        causal: bool = True,
        prefix: str = "common",
        table_column_step: int = 8,
        threads: int = 1,
    ) -> None:
        if isinstance(table_column_step, bool) or not isinstance(table_column_step, int) or table_column_step < 1:
            raise ValueError(f"table_column_step: expected an int >= 1, got {table_column_step!r}")
        most = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most:
            raise ValueError(f"threads: expected an int in [1, {most}] (numba's thread pool, NUMBA_NUM_THREADS), "
                             f"got {threads!r}")
        fa = FlashAttnOptions() if flash_attn is True else flash_attn or None
        fi = FlashInferOptions() if flashinfer is True else flashinfer or None
        if fa is not None and not isinstance(fa, FlashAttnOptions):
            raise TypeError(f"flash_attn: expected FlashAttnOptions, True or None, got {type(fa).__name__}")
        if fi is not None and not isinstance(fi, FlashInferOptions):
            raise TypeError(f"flashinfer: expected FlashInferOptions, True or None, got {type(fi).__name__}")
        self._stager = stager
        self._fa_opts: FlashAttnOptions | None = fa
        self._fi_opts: FlashInferOptions | None = fi
        self._causal = bool(causal)
        self._prefix = prefix
        self._paged = fi is not None and fi == _DEFAULT_FI  # the common pass builds FlashInfer's page table
        fa_plain = fa is None or (fa.dcp_world_size == 1 and fa.decode_threshold >= 1
                                  and (fa.causal is None or isinstance(fa.causal, bool)))
        # Which steps can replay: default FlashInfer options, FlashAttention staging nothing. In graph
        # mode a composed step's common pass does not build the page table (FlashInfer's kernel does,
        # into its fixed buffers); a replay's common pass writes it there itself (see _record).
        self._graph = stager.graph_mode
        self._replay = fa_plain and (fi is None or fi == _DEFAULT_FI)
        # A step whose first row's query is longer than every backend's decode threshold splits into
        # prefill rows only, in both backends, whatever its other rows (vllm-semantics.md 5.1): spec
        # decode with the default thresholds, or a batch of prefills. Such steps replay too.
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
        ValueError, attnmeta.staging.CapacityError
            As :func:`attnmeta.stage_common` and the backends' ``stage`` functions. The step is then
            abandoned (nothing copied) and the stager is ready for the next one.
        """
        stats = self.stats
        stats.steps += 1
        max_q = spec.max_query_len
        if not self._replay or spec.context_parallel is not None:
            return self._compose(spec, self._stager.step(), None)
        if max_q <= 1:
            kind = 0  # every row decodes, in both backends' splits
        elif int(spec.num_scheduled_tokens[0]) > self._prefill_above:
            kind = 1  # every row is a prefill row, in both backends' splits
        else:
            return self._compose(spec, self._stager.step(), None)
        if self._graph:
            return self._build_graph(spec, kind)
        B, T, bs = spec.num_reqs, spec.num_tokens, spec.block_size
        Bp = B if spec.num_reqs_padded is None else spec.num_reqs_padded
        Tp = T if spec.num_tokens_padded is None else spec.num_tokens_padded
        exact = spec.max_exact_seq_len
        total = spec.num_pages
        prompt, drafts, upper = spec.num_prompt_tokens, spec.num_draft_tokens, spec.seq_lens_upper_bound
        # Everything the layout and the objects' per-layout fields depend on. The real row and token
        # counts are not: they only set scalars (and the longest query), patched below, so CUDA-graph
        # padded steps of one padded size share a layout whatever their real counts.
        key = (kind, Bp, Tp, self._columns(spec), _bucket(total) if self._paged else 0, bs,
               prompt is None, drafts is None, upper is None)
        step = self._stager.step()
        rec = self._records(step).get(key)
        if rec is None:
            return self._compose(spec, step, key)
        return self._replay_record(spec, step, rec, kind, total, exact)

    def _build_graph(self, spec: BatchSpec, kind: int) -> FusedStep:
        """:meth:`build` of a replayable step (``kind`` 0: decode rows only, 1: prefill rows only) on a
        graph-mode stager (fixed addresses and capacities)."""
        st = self._stager
        prof = st.profile
        assert prof is not None
        B, T, bs = spec.num_reqs, spec.num_tokens, spec.block_size
        Bp = B if spec.num_reqs_padded is None else spec.num_reqs_padded
        Tp = T if spec.num_tokens_padded is None else spec.num_tokens_padded
        exact, total = spec.max_exact_seq_len, spec.num_pages
        if (bs != prof.block_size or Bp > prof.max_num_reqs or Tp > prof.max_num_tokens
                or total > prof.max_num_pages or -(-exact // bs) > prof.max_blocks_per_req):
            return self._compose(spec, st.step(), None)  # raises the builders' errors
        prompt, drafts, upper = spec.num_prompt_tokens, spec.num_draft_tokens, spec.seq_lens_upper_bound
        key = (kind, Bp, Tp, prompt is None, drafts is None, upper is None)
        step = st.step()
        rec = self._records(step).get(key)
        if rec is None:
            return self._compose(spec, step, key)
        return self._replay_record(spec, step, rec, kind, total, exact)

    def _replay_record(self, spec: BatchSpec, step: Any, rec: _Record, kind: int, total: int, exact: int) -> FusedStep:
        """Replay ``rec`` (this slot's record of the step's layout) on ``step``: the common pass's kernel
        writes every staged byte (in graph mode FlashInfer's too, into its fixed buffers: see
        :meth:`_record`), the step commits, the objects come from the record's templates."""
        prompt, drafts, upper = spec.num_prompt_tokens, spec.num_draft_tokens, spec.seq_lens_upper_bound
        try:
            par = rec.par  # threads: the two big copies on numba's thread pool, around the kernel
            was = _pool_threads(rec.threads) if par is not None else 0
            try:
                if par is not None:
                    _bt_rows_par_nb(spec.block_table, par[0], spec.num_reqs)
                status = _common_packed_nb(
                    spec.num_computed_tokens, spec.num_scheduled_tokens, spec.block_table,
                    _EMPTY if prompt is None else prompt, _EMPTY if drafts is None else drafts,
                    _EMPTY if upper is None else upper, *rec.args,
                )
                if par is not None and par[2] is not None and not status:
                    _indices_par_nb(par[0], par[1], par[2], par[0].shape[0])
            finally:
                if par is not None:
                    numba.set_num_threads(was)
            if rec.graph:  # graph mode: the page indices are staged with this step's page count
                f = rec.fields[rec.graph]
                if f.rows != total:
                    rec.fields[rec.graph] = f.with_rows(total)
            if status:  # unreachable for a validated spec (kept as a guard, as in stage_common)
                raise ValueError(f"FusedStepBuilder: internal status {status}; the spec is inconsistent")
            step._restage(rec.end, rec.fields)
            step._finish()
        except BaseException:
            step.abandon()
            raise
        self.stats.replayed += 1
        return _emit(rec, spec, total, kind, exact)

    def _columns(self, spec: BatchSpec) -> int:
        """Eager mode: ``block_table_tensor``'s columns (:func:`table_columns`)."""
        return table_columns(spec, self._column_step)

    def _compose(self, spec: BatchSpec, step: Any, key: tuple[Any, ...] | None) -> FusedStep:
        """The composable builders on ``step`` (begun by the caller); records the layout under ``key``."""
        columns = self._columns(spec) if self._column_step > 1 and not self._graph else None
        try:
            staged = stage_common(spec, step, prefix=self._prefix, causal=self._causal, paged_kv=self._paged,
                                  block_table_columns=columns)
            fa_staged = _fa.stage(staged, step, self._fa_opts) if self._fa_opts is not None else None
            fi_staged = _fi.stage(staged, step, self._fi_opts) if self._fi_opts is not None else None
            step._finish()
        except BaseException:
            step.abandon()
            raise
        cm = staged.result()
        fa = fa_staged.result() if fa_staged is not None else None
        fi = fi_staged.result() if fi_staged is not None else None
        if key is not None:
            self._record(step, key, staged.host, cm, fa, fi)
        return FusedStep(cm, fa, fi)

    def _records(self, step: Any) -> dict[tuple[Any, ...], _Record]:
        """This builder's recorded layouts on ``step``'s ring slot, by key."""
        extras = step.slot_extras
        records: dict[tuple[Any, ...], _Record] | None = extras.get(self._token)
        if records is None:
            records = extras[self._token] = {}
        return records

    def _record(self, step: Any, key: tuple[Any, ...], host: dict[str, Any], cm: CommonAttentionMetadata,
                fa: FlashAttentionMetadata | None, fi: FlashInferMetadata | None) -> None:
        """Keep what a replay of this committed step's layout on its slot needs, unless the layout
        changed during the step or a backend staged fields of its own (those steps always compose).

        Eager mode: FlashInfer's page table is the common group's last three fields. Graph mode: it is
        FlashInfer's own fields; the record's kernel arguments address them (and the prefill query
        indptr) in their fixed buffers, so a replay's one pass writes them, and a replay stages the
        page indices with each step's page count.
        """
        if step.stats.grew:
            return  # the slot's memory (eager) or the graph layout changed during the step
        group, state = host["_group"]
        fields = dict(step._fields)  # the record's own: a graph replay updates the page indices' rows
        idx_cpu = idx_dev = None
        offsets, dims, hbuf = state[:3]
        n_graph = ""
        if not self._graph:
            if fi is not None and len(group.fields) <= 5:
                return
            extra = set(fields) - set(group.names)
            if extra and (fi is None or extra != {_fi._DEFAULT_QO} or len(fields) != len(group.names) + 1):
                return
            if fi is not None:
                idx_cpu, idx_dev = group.frozen[7], group.device(step)[7]
            if extra and fi is not None:  # FlashInfer's prefill query indptr (prefill rows): the kernel writes it
                f_qo = fields[_fi._DEFAULT_QO]
                buf = group.buf
                if buf is None or step.host(f_qo.name).ctypes.data != buf.ctypes.data + f_qo.offset:
                    return  # (not seen: the slot did not grow, so every field is in its one buffer)
                offsets, dims = offsets.copy(), dims.copy()
                offsets[12] = f_qo.offset
                dims[15:17] = (f_qo.rows, fi.num_decodes)
        else:
            fi_names = _fi._NAMES[self._fi_opts.prefix][:4] if fi is not None and self._fi_opts is not None else ()
            if set(fields) != {*group.names, *fi_names}:
                return
            if fi is not None:
                n_indices = fi_names[3]
                # The common kernel's own copy of its arguments, with its paged-KV outputs addressed in
                # FlashInfer's fixed buffers: the indptr at full capacity (the tail repeats the page
                # count, its sentinel), the last-page lengths, the indices (up to their capacity), and
                # the prefill query indptr of the step's split (its tail repeats its last value).
                f_indptr, f_last, f_qo, f_idx = (fields[n] for n in fi_names)
                buf = group.buf
                if (buf is None or f_indptr.rows != f_indptr.capacity or f_qo.rows != f_qo.capacity
                        or any(step.host_full(f.name).ctypes.data != buf.ctypes.data + f.offset
                               for f in (f_indptr, f_last, f_qo, f_idx))):
                    return  # (not seen: graph mode stages both indptrs whole, in the slot's one buffer)
                idx_cpu = step.host_full(n_indices).view()
                idx_cpu.flags.writeable = False
                idx_dev = step.device_full(n_indices)
                offsets, dims = offsets.copy(), dims.copy()
                offsets[9:13] = (f_indptr.offset, f_last.offset, f_idx.offset, f_qo.offset)
                dims[12:17] = (1, f_idx.capacity, f_indptr.rows, f_qo.rows, fi.num_decodes)
                n_graph = n_indices
        threads = self._threads if int(dims[0]) >= PARALLEL_MIN_ROWS and group.buf is not None else 1
        par = None
        if threads > 1:  # replays copy the block-table rows and page indices on numba's thread pool
            dims = dims.copy()
            dims[17] = 1
            buf, (Bp, W) = group.buf, (int(dims[0]), int(dims[2]))
            bt = buf[offsets[2] : offsets[2] + 4 * Bp * W].view(np.int32).reshape(Bp, W)
            indptr = indices = None
            if dims[12]:  # the page table: writable views where the kernel addresses it
                indptr = buf[offsets[9] : offsets[9] + 4 * (Bp + 1)].view(np.int32)
                indices = buf[offsets[11] : offsets[11] + 4 * int(dims[13])].view(np.int32)
            par = (bt, indptr, indices)
        records = self._records(step)
        if len(records) >= _MAX_RECORDS:
            records.clear()
        rec = records[key] = _Record(
            step.stats.bytes if not self._graph else group.end, fields, (group.buf, hbuf, offsets, dims), _values(cm),
            _values(fa) if fa is not None else None, _values(fi) if fi is not None else None,
            idx_cpu, idx_dev, fi.num_pages if fi is not None else -1,
        )
        rec.graph = n_graph
        rec.threads, rec.par = threads, par

    def __repr__(self) -> str:
        parts = [f"flash_attn={self._fa_opts is not None}", f"flashinfer={self._fi_opts is not None}",
                 *([f"table_column_step={self._column_step}"] if self._column_step != 8 else []),
                 *([f"threads={self._threads}"] if self._threads != 1 else []),
                 f"replay={'on' if self._replay else 'off'}", f"steps={self.stats.steps}",
                 f"replayed={self.stats.replayed}"]
        return f"FusedStepBuilder({', '.join(parts)})"


def _emit(rec: _Record, spec: BatchSpec, total: int, kind: int, mkv: int) -> FusedStep:
    """The three objects of a replayed step: ``rec``'s templates with the step's own scalars (and,
    when the page count changed, its page-index views). ``kind``: 0 when every row is a decode row
    in FlashInfer's split, 1 when every row is a prefill row (so the longest query is the longest
    decode query, or the longest prefill query); ``mkv``: the longest KV length."""
    B, T = spec.num_reqs, spec.num_tokens
    max_seq, max_q = spec.max_seq_len, spec.max_query_len
    a = rec.cm
    a[_CM_MAX_SEQ] = max_seq
    a[_CM_MAX_Q] = max_q
    a[_CM_REAL_REQS] = B
    a[_CM_REAL_TOKENS] = T
    cm = _new_common(*a)
    fa = fi = None
    if rec.fa is not None:
        b = rec.fa
        b[0] = cm
        b[_FA_MAX_SEQ] = max_seq
        b[_FA_MAX_Q] = max_q
        fa = _new_fa(*b)
    if rec.fi is not None:
        c = rec.fi
        c[0] = cm
        if total != rec.total:  # the page count changed: its index views (cached while it does not)
            rec.total = total
            view = rec.idx_view
            if view is not None and total <= rec.idx_cpu.shape[0]:
                # Resized in place: a third of a new view's cost; a size within the storage only changes
                # the view's shape. Only objects built from this record on this ring slot hold this
                # tensor, and the slot's earlier steps are past their validity (the stager reused the
                # slot). The recorded step's own view (the stager's, shared with composed steps) is never
                # resized.
                view.resize_(total)
            else:  # = idx_dev[:total] (as_strided: half a slice's cost), the record's own view
                rec.idx_view = c[_FI_INDICES] = rec.idx_dev.as_strided((total,), (1,))
            c[_FI_INDICES_CPU] = rec.idx_cpu[:total]
            c[_FI_PAGES] = total
        if kind:
            c[_FI_MAX_PQ] = max_q
        else:
            c[_FI_MAX_DQ] = max_q
        c[_FI_MAX_KV] = mkv
        fi = _new_fi(*c)
    return FusedStep(cm, fa, fi)


def table_columns(spec: BatchSpec, column_step: int = 8) -> int:
    """The eager-mode ``block_table_columns`` a :class:`FusedStepBuilder` with ``table_column_step``
    stages for ``spec``: the longest request's block count (one column spans ``block_size *
    world_size`` tokens under context parallelism, vllm-semantics.md 4), at least 1, rounded up to a
    multiple of ``column_step``. Pass it to :func:`attnmeta.stage_common` to compose the same
    objects, or to keep a composable loop's layouts as long (docs/serving.md)."""
    cp = spec.context_parallel
    span = spec.block_size * (1 if cp is None else cp.world_size)
    return -(-max(1, -(-spec.max_exact_seq_len // span)) // column_step) * column_step


_POOL_STARTED = False


def _pool_threads(n: int) -> int:
    """Have numba's thread pool run the calling thread's next parallel loops on ``n`` threads; returns
    the count to restore. The first call starts numba's threading layer, whose OpenMP start changes
    the thread count torch's CPU ops see: torch's count is put back as it was."""
    global _POOL_STARTED
    torch_threads = None if _POOL_STARTED else torch.get_num_threads()
    was = numba.get_num_threads()
    numba.set_num_threads(n)
    if torch_threads is not None:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        _POOL_STARTED = True
    return was


def _values(obj: Any) -> list[Any]:
    """A metadata object's field values in declaration order (its positional constructor's arguments)."""
    return list(_GETTERS[type(obj)](obj))
