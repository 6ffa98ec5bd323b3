"""The common metadata's host pass: :func:`stage_common`, :func:`build_common`, :class:`CommonWriter`.

:func:`stage_common` derives a step's :class:`~attnmeta.metadata.CommonAttentionMetadata` on the host,
writing every array straight into the step's pinned slot with one compiled call
(:func:`attnmeta.host.common.common_pass_nb`), and returns a
:class:`~attnmeta.metadata.StagedCommon` for the builders staged after it. The fields of a step are a
:class:`~attnmeta.staging.FieldGroup` cached per ring slot and layout, and each group keeps one
:class:`CommonWriter`: the views the pass writes into and the read-only views handed out, built once
per slot and layout. :func:`stage_paged_kv` stages the paged-KV layout of any lengths with the same
compiled pass as the common one's page table.

Why one module
--------------
Where each common field lies in a step (:func:`stage_common`'s reservation), which views the writer
rewrites and hands out for a layout (:class:`CommonWriter`, its any-count form in graph mode included),
and where the one-call passes of several groups write (:class:`CommonPasses`) must agree field by field: a
field placed one way and rewritten another is a replay that writes the wrong bytes. Kept side by side,
one reading shows they do.

Shape legend
------------
- ``num_reqs``: request rows including CUDA-graph padding rows.
- ``num_actual_tokens``: tokens including CUDA-graph padding tokens.
- ``max_blocks``: block-table columns staged.
- ``num_pages``: KV pages of the step, ``sum(cdiv(seq_lens, block_size))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
import torch

from attnmeta._checks import INT32_MAX
from attnmeta._fields import positional_factory
from attnmeta._numba import pool_threads
from attnmeta.host.common import (
    BAD_BLOCK_ID,
    PASS_OUTPUTS,
    PLAN_WIDTH,
    bad_block_id,
    block_table_rows_par_nb,
    common_pass_nb,
    common_passes_nb,
    optional_arrays,
)
from attnmeta.host.paged import PagedKV, num_pages, paged_indices_par_nb, paged_kv_layout, paged_layout_nb
from attnmeta.metadata import (
    CommonAttentionMetadata,
    CommonHost,
    PagedKVMetadata,
    StagedCommon,
    make_paged,
)
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec, ContextParallel, StepShape
from attnmeta.staging import CapacityError, FieldGroup, Staged, Stager, Step, bucket_rows

__all__ = ["CommonPasses", "CommonWriter", "build_common", "stage_common", "stage_paged_kv"]


_I32, _I64, _BOOL, _U8 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_), np.dtype(np.uint8)
_NO_LIMIT = 1 << 31  # num_kv_blocks when the KV cache's size is not given: any int32 id >= 0 is in range
_EMPTY_I32 = np.zeros(0, np.int32)
_PAGED_FIELDS = tuple(f.name for f in dataclasses.fields(PagedKVMetadata))
_PK_INDICES, _PK_INDICES_CPU, _PK_NUM_PAGES = (
    _PAGED_FIELDS.index(n) for n in ("paged_kv_indices", "paged_kv_indices_cpu", "num_pages"))
_make_paged_positional = positional_factory(PagedKVMetadata)
# CommonWriter builds its per-step objects from recorded field values (positional_factory order) with
# the per-step ones replaced; these are their positions, derived by name.
_HOST_FIELDS = tuple(f.name for f in dataclasses.fields(CommonHost))
_HOST_PER_STEP = ("num_actual_tokens", "max_query_len", "max_seq_len", "causal", "num_real_reqs", "num_real_tokens",
                  "num_pages", "max_exact_seq_len", "splits")
_H_TOKENS, _H_MAX_Q, _H_MAX_SEQ, _H_CAUSAL, _H_REAL_REQS, _H_REAL_TOKENS, _H_PAGES, _H_MAX_EXACT, _H_SPLITS = (
    _HOST_FIELDS.index(n) for n in _HOST_PER_STEP)
_make_host_positional = positional_factory(CommonHost)
_COMMON_FIELDS = tuple(f.name for f in dataclasses.fields(CommonAttentionMetadata))
_COMMON_PER_STEP = ("num_actual_tokens", "max_query_len", "max_seq_len", "causal", "num_real_reqs", "num_real_tokens")
_C_TOKENS, _C_MAX_Q, _C_MAX_SEQ, _C_CAUSAL, _C_REAL_REQS, _C_REAL_TOKENS = (
    _COMMON_FIELDS.index(n) for n in _COMMON_PER_STEP)
_make_common_positional = positional_factory(CommonAttentionMetadata)


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class CommonWriter:
    """The common metadata's compiled host pass for one field layout on one ring slot.

    :func:`stage_common` reserves the step's fields (a :class:`~attnmeta.staging.FieldGroup` cached
    per slot and layout) and keeps one writer with each group: the writable views the pass writes
    into, the host-only arrays (upper bounds, computed tokens, prefill flags, draft counts) that live
    with the group, and every read-only view handed out, built once per slot and layout. Every step
    of that layout on that slot then costs one compiled call (:meth:`write`) and the objects.

    The step composer (:class:`attnmeta.compose.StepBuilder`), which replays a layout, keeps the
    writer of the step it recorded, restages the step's fields (:meth:`attnmeta.staging.Step.restage`)
    and calls :meth:`write`, which rewrites every staged byte of the common fields, then
    :meth:`metadata` after the commit.

    In graph mode, where every field has a fixed place, :meth:`for_any_rows` makes a writer of the same
    layout for steps of any request and token counts: the composer replays one recorded layout for
    the unpadded steps (mixed steps: prompt chunks joining running decodes) whose counts change from
    step to step, setting each step's counts with :meth:`set_rows`.

    Attributes
    ----------
    num_reqs, block_size, columns : int
        The layout: padded rows, block size, block-table columns.
    num_kv_blocks : int
        The bound every used block id is checked against (the stager's ``num_kv_blocks``, else
        ``2**31``).
    token_rows : int
        Rows staged for the per-token arrays (eager mode: bucketed; graph mode: the step's).
    paged : bool
        Whether the pass also writes the paged-KV layout.
    any_rows : bool
        Whether the writer serves steps of any counts (:meth:`for_any_rows`).
    """

    __slots__ = (
        "_dev",
        "_full",
        "_host_only",
        "_host_tpl",
        "_idx_host",
        "_idx_name",
        "_indices_ro",
        "_indptr_ro",
        "_paged_host",
        "_paged_meta",
        "_paged_template",
        "_qsl_rows",
        "_ranks",
        "_ro",
        "_rows",
        "_rows_dev",
        "any_rows",
        "block_size",
        "bt",
        "bt_ro",
        "columns",
        "ddt",
        "ddt_ro",
        "graph",
        "group",
        "has_drafts",
        "indices",
        "indptr",
        "last",
        "nc",
        "nc_ro",
        "num_kv_blocks",
        "num_reqs",
        "paged",
        "pos",
        "pre",
        "pre_ro",
        "qsl",
        "qsl_ro",
        "sl",
        "sl_ro",
        "sm",
        "token_arrays",
        "token_rows",
        "ub",
        "ub_ro",
    )

    def __init__(self, step: Step, group: FieldGroup, num_reqs: int, columns: int, block_size: int,
                 context_parallel: ContextParallel | None, token_arrays: bool, paged: bool, has_drafts: bool,
                 indices_name: str) -> None:
        Bp = num_reqs
        self.group = group
        self.num_reqs, self.columns, self.block_size = Bp, columns, block_size
        cp = context_parallel
        self._ranks = (1, 0, 1) if cp is None else (cp.world_size, cp.rank, cp.interleave)
        self.token_arrays, self.paged, self.has_drafts = token_arrays, paged, has_drafts
        self.graph = step.profile is not None
        cap = step.stager.num_kv_blocks
        self.num_kv_blocks = _NO_LIMIT if cap is None else cap
        host = group.host
        self.qsl, self.sl, self.bt, self.sm, self.pos = host[:5]
        self.token_rows = int(self.sm.shape[0])
        ro = group.frozen
        self.qsl_ro = ro[0][: Bp + 1]
        self.sl_ro, self.bt_ro = ro[1], ro[2]
        # Host-only arrays (never staged): one buffer per group, rewritten by every step of the group.
        a4 = (4 * Bp + 63) // 64 * 64
        buf = np.zeros(3 * a4 + Bp, np.uint8)
        self._host_only = buf
        self.ub, self.nc, self.ddt = (buf[i * a4 : i * a4 + 4 * Bp].view(np.int32) for i in range(3))
        self.pre = buf[3 * a4 : 3 * a4 + Bp].view(np.bool_)
        self.ub_ro, self.nc_ro, self.pre_ro = _read_only(self.ub), _read_only(self.nc), _read_only(self.pre)
        self.ddt_ro = _read_only(self.ddt) if has_drafts else None
        self._idx_name = indices_name
        if paged:
            self.indptr, self.last = host[5], host[6]
            # eager: the group's own (bucketed) field; graph: the whole fixed buffer (its rows: the step's)
            self.indices = host[7] if not self.graph else step.host_full(indices_name)
        else:
            self.indptr = self.last = self.indices = _EMPTY_I32
        self._indices_ro = _read_only(self.indices)  # slices of it are read-only too
        self._indptr_ro = ro[5][: Bp + 1] if paged else _EMPTY_I32
        # Field values of the per-step objects (positional_factory order), all but the per-step scalars:
        self._host_tpl: tuple[Any, ...] = (-1, None)  # (token count, CommonHost's)
        self._dev: tuple[Any, ...] = (None, -1, None)  # (group device views, token count, the metadata's)
        self._paged_host: tuple[Any, ...] = (-1, None)  # (page count, PagedKV)
        self._idx_host: tuple[Any, ...] = (-1, None)  # (page count, host indices view)
        # (step, page count, its PagedKVMetadata, device views, the object's field values)
        self._paged_meta: tuple[Any, ...] = (None, -1, None, None, None)
        self._paged_template: tuple[Any, ...] = (None, None, None)  # (device views, full indices, field values)
        self._qsl_rows: dict[Any, Any] = {}
        self._ro: list[np.ndarray] = ro  # the read-only views of the fields' step rows, in the group's order
        # any_rows: (host, read-only and device views of every field's whole capacity, the host-only arrays and
        # their read-only views at the profile's rows). The device views last as long as the writer: a graph
        # layout that grows re-creates the arena and clears every slot's extras, the records that hold it.
        self._full: tuple[Any, ...] | None = None
        self.any_rows = False
        self._rows = (Bp, self.token_rows)  # (request rows, token rows) the views hold
        self._rows_dev: tuple[Any, ...] = (None, None)  # any_rows: (rows, the rows' device views)

    @classmethod
    def for_any_rows(cls, writer: CommonWriter, step: Step) -> CommonWriter:
        """Graph mode: a writer of ``writer``'s layout (its fields, block size, columns, token arrays,
        page table and draft counts) for steps of any request and token counts within the profile.

        Its views are the fields' fixed buffers, which :meth:`set_rows` slices to a step's rows before
        :meth:`write` (the step restaged with those rows: :meth:`restage_rows`); the objects it then
        makes are those a writer of that layout with those rows makes.

        Parameters
        ----------
        writer : CommonWriter
            A graph-mode writer without context parallelism.
        step : Step
            The committed step ``writer`` wrote (the slot's fixed views are read once, here).

        Raises
        ------
        ValueError
            Eager mode, or a writer with context parallelism.
        """
        prof = step.profile
        if prof is None or writer._ranks != (1, 0, 1):
            raise ValueError("CommonWriter.for_any_rows: graph mode without context parallelism only")
        w = cls(step, writer.group, prof.max_num_reqs, writer.columns, writer.block_size, None, writer.token_arrays,
                writer.paged, writer.has_drafts, writer._idx_name)
        names = writer.group.names
        host = [step.host_full(n) for n in names]
        only = [w.ub, w.nc, w.ddt, w.pre]
        w._full = (host, [_read_only(h) for h in host], [step.device_full(n) for n in names], only,
                   [_read_only(a) for a in only])
        w._rows, w.any_rows = (-1, -1), True
        return w

    def set_rows(self, shape: StepShape) -> None:
        """:meth:`for_any_rows` writers: point the views at the request and token rows of a step of
        ``shape`` (its :meth:`write` and objects are then those of a writer of those rows)."""
        full = self._full
        assert full is not None, "set_rows: an any_rows writer only"
        Bp, Tt = shape.padded_num_reqs, shape.padded_num_tokens if self.token_arrays else 0
        if self._rows == (Bp, Tt):
            return
        host, ro, _dev, only, only_ro = full
        self._rows, self.num_reqs, self.token_rows = (Bp, Tt), Bp, Tt
        self.sl, self.bt, self.sm, self.pos = host[1][:Bp], host[2][:Bp], host[3][:Tt], host[4][:Tt]
        self._ro = [ro[0], ro[1][:Bp], ro[2][:Bp], ro[3][:Tt], ro[4][:Tt]]
        self.qsl_ro, self.sl_ro, self.bt_ro = ro[0][: Bp + 1], self._ro[1], self._ro[2]
        self.ub, self.nc, self.ddt, self.pre = (a[:Bp] for a in only)
        self.ub_ro, self.nc_ro, ddt_ro, self.pre_ro = (a[:Bp] for a in only_ro)
        self.ddt_ro = ddt_ro if self.has_drafts else None
        if self.paged:
            self.last = host[6][:Bp]
            self._ro += [ro[5], ro[6][:Bp]]
            self._indptr_ro = ro[5][: Bp + 1]
        self._host_tpl, self._dev, self._paged_host = (-1, None), (None, -1, None), (-1, None)
        self._paged_meta, self._paged_template, self._qsl_rows = (None, -1, None, None, None), (None, None, None), {}

    def restage_rows(self, shape: StepShape, rows: dict[str, int]) -> None:
        """:meth:`for_any_rows` writers: add the row counts of a step of ``shape`` to ``rows``, the
        :meth:`~attnmeta.staging.Step.restage` argument (the fields whose rows follow the counts;
        ``query_start_loc`` and ``paged_kv_indptr`` are staged whole)."""
        n = self.group.names
        Bp = shape.padded_num_reqs
        rows[n[1]] = rows[n[2]] = Bp
        if self.token_arrays:
            rows[n[3]] = rows[n[4]] = shape.padded_num_tokens
        if self.paged:
            rows[n[6]] = Bp

    def _device(self, step: Step) -> list[torch.Tensor]:
        """The device views of the fields of committed ``step`` (the group's; :meth:`for_any_rows` writers:
        of the rows :meth:`set_rows` set)."""
        dev = self.group.device(step)  # (raises for a step not committed, or expired)
        full = self._full
        if full is None:
            return dev
        d = self._rows_dev
        if d[0] != self._rows:
            fd = full[2]
            Bp, Tt = self._rows
            views = [fd[0], fd[1][:Bp], fd[2][:Bp], fd[3][:Tt], fd[4][:Tt]]
            if self.paged:
                views += [fd[5], fd[6][:Bp]]
            d = self._rows_dev = (self._rows, views)
        out: list[torch.Tensor] = d[1]
        return out

    def write(self, spec: BatchSpec, *, threads: int = 1) -> None:
        """Write ``spec``'s common fields (and paged-KV layout) into this layout's views: one compiled
        call, every byte of the staged fields rewritten.

        Parameters
        ----------
        spec : BatchSpec
            A step of this layout (same padded rows, columns, token bucket, block size, optional arrays).
        threads : int, default 1
            With more, the block-table rows and page indices are copied on that many of numba's
            threads (:func:`attnmeta._numba.pool_threads`), around the call: the same bytes.
        """
        self.write_arrays(spec.num_computed_tokens, spec.num_scheduled_tokens, spec.block_table, spec.num_prompt_tokens,
                          spec.num_draft_tokens, spec.seq_lens_upper_bound, threads=threads, spec=spec)

    def write_arrays(self, c: np.ndarray, q: np.ndarray, table: np.ndarray, prompt: np.ndarray | None,
                     drafts: np.ndarray | None, upper: np.ndarray | None, *, threads: int = 1,
                     spec: BatchSpec | None = None) -> None:
        """:meth:`write` of a spec's arrays (the step composer's replay of the scheduler's arrays,
        :meth:`attnmeta.compose.StepBuilder.build_counts`, which checked them as a spec would, without
        context parallelism); ``spec``, when there is one, names a bad block id."""
        ws, rank, il = self._ranks
        serial = threads == 1
        was = 0 if serial else pool_threads(threads)
        try:
            if not serial:  # the block-table rows (and below the page indices) copied on numba's pool
                block_table_rows_par_nb(table, self.bt, q.shape[0])
            status = common_pass_nb(
                c, q, table, self.block_size, ws, rank, il, self.num_kv_blocks, *optional_arrays(prompt, drafts, upper),
                self.token_arrays, serial, self.qsl, self.sl, self.bt, self.pos, self.sm, self.ub, self.nc, self.pre,
                self.ddt, self.paged, self.indptr, self.last, self.indices,
            )
            if not serial and self.paged and not status:
                paged_indices_par_nb(self.bt, self.indptr, self.indices, self.num_reqs)
        finally:
            if not serial:
                numba.set_num_threads(was)
        if status == BAD_BLOCK_ID:
            if spec is None:  # (only to name the entry)
                spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=table,
                                 block_size=self.block_size, num_prompt_tokens=prompt, num_draft_tokens=drafts,
                                 seq_lens_upper_bound=upper)
            raise bad_block_id(spec, None if self.num_kv_blocks == _NO_LIMIT else self.num_kv_blocks)
        if status:  # unreachable for a validated spec (kept as a guard)
            raise ValueError(f"stage_common: internal status {status}; the spec is inconsistent")

    def _fixed_host_fields(self, rows: int) -> dict[str, Any]:
        """The host fields of a step of this layout with ``rows`` token rows: everything of
        :class:`CommonHost` but the per-step scalars (read-only views)."""
        ro = self._ro
        return dict(
            query_start_loc_cpu=self.qsl_ro, seq_lens_cpu=self.sl_ro, seq_lens_cpu_upper_bound=self.ub_ro,
            num_computed_tokens_cpu=self.nc_ro, block_table_cpu=self.bt_ro, slot_mapping_cpu=ro[3][:rows],
            positions_cpu=ro[4][:rows], is_prefilling=self.pre_ro, num_decode_draft_tokens_cpu=self.ddt_ro,
            num_reqs=self.num_reqs, block_size=self.block_size,
        )

    def host(self, spec: BatchSpec | StepShape, causal: bool) -> CommonHost:
        """The :class:`CommonHost` of ``spec`` (or its shape), written by :meth:`write` (read-only views)."""
        B, T = spec.num_reqs, spec.num_tokens
        Tp = T if spec.num_tokens_padded is None else spec.num_tokens_padded
        rows = Tp if self.token_arrays else 0
        t = self._host_tpl
        if t[0] != rows:  # a new token count: new token views (every other field is the layout's)
            fixed = self._fixed_host_fields(rows)
            assert len(fixed) + len(_HOST_PER_STEP) == len(_HOST_FIELDS), "a CommonHost field is not written"
            t = self._host_tpl = (rows, [fixed.get(n) for n in _HOST_FIELDS])
        v = t[1].copy()
        (v[_H_TOKENS], v[_H_MAX_Q], v[_H_MAX_SEQ], v[_H_CAUSAL], v[_H_REAL_REQS], v[_H_REAL_TOKENS], v[_H_PAGES],
         v[_H_MAX_EXACT], v[_H_SPLITS]) = (Tp, spec.max_query_len, spec.max_seq_len, causal, B, T, spec.num_pages,
                                           spec.max_exact_seq_len, {})
        host: CommonHost = _make_host_positional(*v)
        return host

    def metadata(self, step: Step, spec: BatchSpec | StepShape, causal: bool) -> CommonAttentionMetadata:
        """The :class:`CommonAttentionMetadata` of ``spec`` (or its shape), a committed step of this layout written by
        :meth:`write` (device views of ``step``'s arena, read-only host views of its slot).

        Raises
        ------
        StepNotCommittedError, StepExpiredError
            As :meth:`attnmeta.staging.Step.device`.
        """
        dev = self._device(step)
        B, T = spec.num_reqs, spec.num_tokens
        Tp = T if spec.num_tokens_padded is None else spec.num_tokens_padded
        rows = Tp if self.token_arrays else 0
        d = self._dev
        if d[0] is not dev or d[1] != rows:  # new device views or a new token count
            smd, posd = dev[3], dev[4]
            if smd.shape[0] != rows:
                smd, posd = smd[:rows], posd[:rows]
            fixed = self._fixed_host_fields(rows)
            fixed.update(query_start_loc=dev[0][: self.num_reqs + 1] if self.graph else dev[0], seq_lens=dev[1],
                         block_table_tensor=dev[2], slot_mapping=smd, positions=posd)
            assert len(fixed) + len(_COMMON_PER_STEP) == len(_COMMON_FIELDS), "a metadata field is not written"
            d = self._dev = (dev, rows, [fixed.get(n) for n in _COMMON_FIELDS])
        v = d[2].copy()
        v[_C_TOKENS], v[_C_MAX_Q], v[_C_MAX_SEQ], v[_C_CAUSAL], v[_C_REAL_REQS], v[_C_REAL_TOKENS] = (
            Tp, spec.max_query_len, spec.max_seq_len, causal, B, T)
        cm: CommonAttentionMetadata = _make_common_positional(*v)
        return cm

    def query_start_loc_rows(self, step: Step, rows: int) -> tuple[torch.Tensor, np.ndarray]:
        """The device and read-only host views of ``query_start_loc``'s first ``rows`` entries of a
        committed step of this layout (cached per row count: a decode/prefill split changes it)."""
        dev = self._device(step)
        cache = self._qsl_rows
        if cache.get("dev") is not dev:
            cache.clear()
            cache["dev"] = dev
        found = cache.get(rows)
        if found is None:
            if len(cache) > 64:
                cache.clear()
                cache["dev"] = dev
            found = cache[rows] = (dev[0].as_strided((rows,), (1,)), self.qsl_ro[:rows])
        return found  # type: ignore[no-any-return]

    def _indices_cpu(self, num_pages: int) -> np.ndarray:
        """Read-only host view of the first ``num_pages`` page indices (cached per page count)."""
        c = self._idx_host
        if c[0] != num_pages:
            c = self._idx_host = (num_pages, self._indices_ro[:num_pages])
        view: np.ndarray = c[1]
        return view

    def paged_host(self, num_pages: int) -> PagedKV:
        """The paged-KV host arrays of a step of this layout with ``num_pages`` pages (read-only views)."""
        p = self._paged_host
        if p[0] != num_pages:
            p = self._paged_host = (num_pages, PagedKV(self._indptr_ro, self._indices_cpu(num_pages),
                                                       self._ro[6]))
        host: PagedKV = p[1]
        return host

    def paged_metadata(self, step: Step, num_pages: int) -> PagedKVMetadata:
        """The :class:`PagedKVMetadata` of a committed step of this layout with ``num_pages`` pages
        (one object per step, shared by the step's builders; tied to the step's lifetime).

        Raises
        ------
        StepNotCommittedError, StepExpiredError
            As :meth:`attnmeta.staging.Step.device`.
        """
        dev = self._device(step)
        c = self._paged_meta
        if c[0] is step and c[1] == num_pages:
            meta: PagedKVMetadata = c[2]
            return meta
        if c[3] is dev and c[1] == num_pages:  # a new object of the same views (the last step's values)
            meta = _make_paged_positional(*c[4])
            self._paged_meta = (step, num_pages, meta, dev, c[4])
            return meta
        t = self._paged_template
        if t[0] is not dev:  # the fields that do not depend on the page count, for this step's views
            full = step.device_full(self._idx_name) if self.graph else dev[7]
            indptr = dev[5] if dev[5].shape[0] == self.num_reqs + 1 else dev[5][: self.num_reqs + 1]
            fixed = dict(paged_kv_indptr=indptr, paged_kv_last_page_len=dev[6], paged_kv_indptr_cpu=self._indptr_ro,
                         paged_kv_last_page_len_cpu=self._ro[6], page_size=self.block_size)
            t = self._paged_template = (dev, full, [fixed.get(n) for n in _PAGED_FIELDS])
        v = t[2].copy()
        # as_strided: the view a slice would make, at a fraction of the cost
        v[_PK_INDICES], v[_PK_INDICES_CPU], v[_PK_NUM_PAGES] = (
            t[1].as_strided((num_pages,), (1,)), self._indices_cpu(num_pages), num_pages)
        meta = _make_paged_positional(*v)
        self._paged_meta = (step, num_pages, meta, dev, v)
        return meta


class CommonPasses:
    """Every KV-cache group's common pass of one recorded step layout, in one compiled call.

    The step composer (:class:`attnmeta.compose.StepBuilder`) replays a layout of several groups (an
    attention group and a Mamba group of a hybrid model) by writing each group's common fields from the
    same counts and the group's own block table. Each group's :meth:`CommonWriter.write_arrays` is one
    compiled call that takes its fifteen arrays one by one; this class makes the plan of where every
    group's outputs lie once per layout (an int64 array of byte offsets into the slot's pinned bytes
    and each writer's host-only bytes) and writes every group with one call of
    :func:`attnmeta.host.common.common_passes_nb`: the same bytes, a handful of arrays to hand to
    compiled code instead of fifteen per group.

    Make one with :meth:`of`, which returns None where a writer's views are not addressable that way
    (a slot that grew while its fields were reserved); the caller then writes group by group.
    """

    __slots__ = ("_bufs", "_plan", "writers")

    _DTYPES = (_I32, _I32, _I32, _I64, _I64, _I32, _I32, _BOOL, _I32, _I32, _I32, _I32)  # PASS_OUTPUTS'

    def __init__(self, writers: tuple[CommonWriter, ...], bufs: tuple[np.ndarray, ...], plan: np.ndarray) -> None:
        self.writers = writers
        self._bufs = bufs
        self._plan = plan

    @classmethod
    def of(cls, writers: Sequence[CommonWriter]) -> CommonPasses | None:
        """The passes of ``writers`` (one per group, in group order, all of one step), or None when one
        of their outputs does not lie in the slot's bytes or the writer's host-only bytes."""
        slot = writers[0].group.buf
        if slot is None or any(w.group.buf is not slot for w in writers):
            return None
        bufs = (slot, *(w._host_only for w in writers))
        if any(b.dtype != _U8 or b.ndim != 1 or not (b.flags.c_contiguous and b.flags.writeable and b.flags.aligned)
               for b in bufs):  # (one compiled type for the tuple)
            return None
        starts = [b.__array_interface__["data"][0] for b in bufs]
        rows: list[list[int]] = []
        for w in writers:
            outs = (w.qsl, w.sl, w.bt, w.pos, w.sm, w.ub, w.nc, w.pre, w.ddt, w.indptr, w.last, w.indices)
            assert len(outs) == len(PASS_OUTPUTS)
            row: list[int] = []
            for a, dt in zip(outs, cls._DTYPES, strict=True):
                if a.dtype != dt or not a.flags.c_contiguous:
                    return None
                place = _place(a, bufs, starts)
                if place is None:
                    return None
                row += (place[0], place[1], place[1] + a.nbytes)
            ws, rank, il = w._ranks
            row += (w.block_size, ws, rank, il, w.num_kv_blocks, int(w.token_arrays), int(w.paged), *w.bt.shape)
            assert len(row) == PLAN_WIDTH
            rows.append(row)
        return cls(tuple(writers), bufs, np.array(rows, np.int64))

    def write_arrays(self, c: np.ndarray, q: np.ndarray, tables: Sequence[tuple[np.ndarray, int]],
                     prompt: np.ndarray | None, drafts: np.ndarray | None, upper: np.ndarray | None) -> None:
        """Every writer's :meth:`CommonWriter.write_arrays` of the counts and its group's table
        (``tables[g][0]``: C-contiguous int32, as :meth:`attnmeta.compose.StepBuilder.build_counts`
        checked), serially, in one compiled call; the same errors."""
        if not self._call(c, q, prompt, drafts, upper, tuple([t for t, _bs in tables])):
            for w, (table, _bs) in zip(self.writers, tables, strict=True):
                w.write_arrays(c, q, table, prompt, drafts, upper)

    def write(self, specs: Sequence[BatchSpec]) -> bool:
        """Every writer's :meth:`CommonWriter.write` of its group's spec, in one compiled call; the same
        errors. False, with nothing written, unless every spec has the first one's count arrays (as
        :meth:`BatchSpec.for_group` makes them) and a C-contiguous block table: the caller then writes
        group by group."""
        s0 = specs[0]
        tables = []
        for s in specs:
            t = s.block_table
            if not t.flags.c_contiguous or (s is not s0 and not (
                    s.num_computed_tokens is s0.num_computed_tokens and s.num_scheduled_tokens is s0.num_scheduled_tokens
                    and s.num_prompt_tokens is s0.num_prompt_tokens and s.num_draft_tokens is s0.num_draft_tokens
                    and s.seq_lens_upper_bound is s0.seq_lens_upper_bound)):
                return False
            tables.append(t)
        if not self._call(s0.num_computed_tokens, s0.num_scheduled_tokens, s0.num_prompt_tokens, s0.num_draft_tokens,
                          s0.seq_lens_upper_bound, tuple(tables)):
            for w, sp in zip(self.writers, specs, strict=True):
                w.write(sp)
        return True

    def _call(self, c: np.ndarray, q: np.ndarray, prompt: np.ndarray | None, drafts: np.ndarray | None,
              upper: np.ndarray | None, tables: tuple[np.ndarray, ...]) -> bool:
        """The compiled call; False where the caller writes group by group instead: tables of more than
        one compiled type (writable and read-only ones), or a group's non-zero status (its own pass
        then names the error)."""
        if len(tables) > 1:
            f = tables[0].flags
            w, a = f.writeable, f.aligned
            for t in tables[1:]:
                f = t.flags
                if f.writeable is not w or f.aligned is not a:
                    return False
        return not common_passes_nb(c, q, *optional_arrays(prompt, drafts, upper), tables, self._bufs, self._plan)


def _place(a: np.ndarray, bufs: tuple[np.ndarray, ...], starts: list[int]) -> tuple[int, int] | None:
    """``(index in bufs, byte offset)`` of the buffer that holds all of ``a`` (``(0, 0)`` for no bytes)."""
    if not a.nbytes:
        return 0, 0
    at = a.__array_interface__["data"][0]
    for i, (b, start) in enumerate(zip(bufs, starts, strict=True)):
        if start <= at and at + a.nbytes <= start + b.nbytes:
            return i, at - start
    return None


def _common_fields(
    step: Step, prefix: str, spec: BatchSpec, Bp: int, W: int, Tt: int, paged: bool, prof: StaticProfile | None
) -> FieldGroup:
    """Reserve the common fields of a step (cached per slot and layout) and return their group; ``prof``:
    graph mode, the profile of the spec's block size (its table's width, its pages)."""
    n = prefix + "."
    if prof is not None:
        R, Q = prof.max_num_reqs, prof.max_num_tokens
        if Bp > R or Tt > Q:
            raise CapacityError(
                f"batch of {Bp} rows / {Tt} tokens exceeds the profile (max_num_reqs={R}, max_num_tokens={Q})"
            )
        # query_start_loc's and paged_kv_indptr's sentinels are data-dependent (they repeat the
        # total): both are staged at their full capacity.
        specs: tuple[tuple[str, Any, Any, int | None, Any], ...] = (
            (n + "query_start_loc", R + 1, _I32, R + 1, 0),
            (n + "seq_lens", Bp, _I32, R, 0),
            (n + "block_table_tensor", (Bp, W), _I32, R, 0),
            (n + "slot_mapping", Tt, _I64, Q, -1),
            (n + "positions", Tt, _I64, Q, 0),
        )
        if paged:
            specs += ((n + "paged_kv_indptr", R + 1, _I32, R + 1, 0), (n + "paged_kv_last_page_len", Bp, _I32, R, 0))
        group = step.alloc_fields(specs)
        if paged:  # exactly the step's pages: the rest of the fixed buffer gets the sentinel at the commit
            total, cap = spec.num_pages, prof.max_num_pages
            if total > cap:
                raise CapacityError(
                    f"{n}paged_kv_indices: needs {total} pages but its graph-mode capacity is {cap} "
                    f"(StaticProfile.max_num_pages)"
                )
            step.alloc_fields(((n + "paged_kv_indices", total, _I32, cap, 0),))
        return group
    # Eager mode: the per-token fields are staged at a bucketed row count, the page indices at the
    # staged block table's capacity (no row holds more pages than the table's W columns), and both are
    # handed out as exact-length views: their exact lengths change almost every step, and a layout per
    # length would rebuild the group (and its views) every step. Sized by the table, the page indices
    # keep the layout while the table's width lasts; sized by a bucket of the page count, they would
    # end it every few steps of a growing batch, and each ring slot would then stage a step anew. The
    # rows past the step's pages are staged, never written: the host pays nothing for them.
    Tc = bucket_rows(Tt) if Tt else 0
    pages = Bp * W if paged else 0  # (_stage_common refused a request of more than W blocks)

    def eager_specs() -> tuple[tuple[str, Any, Any, int | None, Any], ...]:
        base: tuple[tuple[str, Any, Any, int | None, Any], ...] = (
            (n + "query_start_loc", Bp + 1, _I32, None, 0),
            (n + "seq_lens", Bp, _I32, None, 0),
            (n + "block_table_tensor", (Bp, W), _I32, None, 0),
            (n + "slot_mapping", Tc, _I64, None, -1),
            (n + "positions", Tc, _I64, None, 0),
        )
        if not paged:
            return base
        return (*base, (n + "paged_kv_indptr", Bp + 1, _I32, None, 0), (n + "paged_kv_last_page_len", Bp, _I32, None, 0),
                (n + "paged_kv_indices", pages, _I32, None, 0))

    # ``paged`` is in the key apart from ``pages``: an empty batch stages no page rows either way, and
    # an unpaged layout of its shapes must not serve a paged step (it has no page-layout fields).
    return step.alloc_fields(eager_specs, (prefix, Bp, W, Tc, paged))


def stage_common(
    spec: BatchSpec,
    step: Step,
    *,
    prefix: str = "common",
    causal: bool = True,
    block_table_columns: int | None = None,
    token_arrays: bool = True,
    paged_kv: bool = False,
) -> StagedCommon:
    """Derive the common metadata of ``spec`` on the host, writing straight into ``step``'s pinned slot.

    Parameters
    ----------
    spec : BatchSpec
        The step's host description.
    step : Step
        An open step; everything staged here moves in its one H2D copy.
    prefix : str, default "common"
        Namespace of the staged field names (use one per KV-cache group sharing a step).
    causal : bool, default True
        Stored as ``causal``.
    block_table_columns : int, optional
        Columns of ``block_table_tensor``. Default: eager mode, the most blocks any request uses (at
        least 1; ``cdiv(seq_len, block_size * world_size)`` under context parallelism, where one column
        holds a block on every rank); graph mode, the ``max_blocks_per_req`` of the profile of the spec's
        block size (:meth:`StaticProfile.for_block_size <attnmeta.StaticProfile.for_block_size>`: a
        group of another block size than the profile's, a hybrid model's Mamba group, gets the width of
        the same longest request in its own blocks).
    token_arrays : bool, default True
        Compute and stage the per-token ``slot_mapping`` and ``positions``. ``False`` is vLLM's
        ``SlotMappingMode.NONE`` for KV-cache groups whose layers read neither (Mamba, linear
        attention): both fields (and their host twins) are then empty, ``(0,)``, and a step of ``T``
        tokens stages ``16 * T`` fewer bytes.
    paged_kv : bool, default False
        Also build the paged-KV layout of every row (:class:`PagedKVMetadata`, page size = block size)
        in the same compiled pass, from the block-table rows just staged, and stage it with the common
        fields (:attr:`StagedCommon.paged`). A FlashInfer builder of the same step reuses it instead of
        a pass of its own. Ignored under context parallelism (a row's pages are spread over ranks).

    Returns
    -------
    StagedCommon
        ``.host`` (:class:`CommonHost`) for other builders in the same step; ``.result()`` after the
        commit gives the :class:`CommonAttentionMetadata`.

    Raises
    ------
    TypeError
        ``spec`` is not a BatchSpec or ``step`` not a Step; ``causal``, ``token_arrays`` or ``paged_kv``
        not a bool, ``prefix`` not a str, ``block_table_columns`` neither an int nor None.
    attnmeta.staging.CapacityError
        A row needs more blocks than the staged columns; graph mode: the batch exceeds a profile
        capacity.
    ValueError
        ``prefix`` empty or holding a ``.`` (field names are ``<prefix>.<field>``);
        ``block_table_columns`` below 1. Graph mode: the spec's block size is not the profile's; a used
        block id is negative or past the stager's ``num_kv_blocks`` (named by row and column); the step's
        pages overflow int32.
    """
    if type(prefix) is not str or not prefix or "." in prefix:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__} {prefix!r:.60}")
        raise ValueError(f"prefix: must be a non-empty name without '.' (fields are named '<prefix>.<field>'), "
                         f"got {prefix!r}")
    if type(causal) is not bool or type(token_arrays) is not bool or type(paged_kv) is not bool:
        for name, flag in (("causal", causal), ("token_arrays", token_arrays), ("paged_kv", paged_kv)):
            if not isinstance(flag, bool | np.bool_):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r:.60}")
        causal, token_arrays, paged_kv = bool(causal), bool(token_arrays), bool(paged_kv)
    if block_table_columns is not None and (isinstance(block_table_columns, bool)
                                            or not isinstance(block_table_columns, int | np.integer)
                                            or block_table_columns < 1):
        if isinstance(block_table_columns, bool) or not isinstance(block_table_columns, int | np.integer):
            raise TypeError(f"block_table_columns: expected an int or None, got "
                            f"{type(block_table_columns).__name__} {block_table_columns!r:.60}")
        raise ValueError(f"block_table_columns: must be >= 1, got {block_table_columns}")
    return _stage_common(spec, step, prefix, causal, block_table_columns, token_arrays, paged_kv)[0]


def _stage_common(spec: BatchSpec, step: Step, prefix: str, causal: bool, block_table_columns: int | None,
                  token_arrays: bool, paged_kv: bool) -> tuple[StagedCommon, CommonWriter]:
    """:func:`stage_common`, and the :class:`CommonWriter` that wrote the step (for the step composer,
    :class:`attnmeta.compose.StepBuilder`, which replays the layout on a later step of the slot)."""
    if type(spec) is not BatchSpec and not isinstance(spec, BatchSpec):
        raise TypeError(f"spec: expected a BatchSpec, got {type(spec).__name__} {spec!r:.80}")
    if type(step) is not Step:
        raise TypeError(f"step: expected an open attnmeta.Step (`with stager.step() as step:`), got "
                        f"{type(step).__name__} {step!r:.80}")
    B, T = spec.num_reqs, spec.num_tokens
    Bp = B if spec.num_reqs_padded is None else spec.num_reqs_padded
    Tp = T if spec.num_tokens_padded is None else spec.num_tokens_padded
    bs = spec.block_size
    prof = step.profile
    cp = spec.context_parallel
    if prof is not None:  # (a group of another block size than the profile's: that size's profile)
        prof = prof.for_block_size(bs)
    span = bs if cp is None else bs * cp.world_size  # tokens per block-table column
    need = -(-spec.max_exact_seq_len // span)
    if block_table_columns is None:
        block_table_columns = prof.max_blocks_per_req if prof is not None else max(1, need)
    W = block_table_columns
    if need > W:
        raise CapacityError(
            f"block_table_tensor: a request needs {need} blocks but only {W} columns are staged "
            f"(block_table_columns / StaticProfile.max_blocks_per_req)"
        )
    paged = paged_kv and cp is None
    if paged and spec.num_pages > INT32_MAX:
        raise ValueError(f"paged_kv: the step's {spec.num_pages} KV pages overflow paged_kv_indptr's int32")
    Tt = Tp if token_arrays else 0
    group = _common_fields(step, prefix, spec, Bp, W, Tt, paged, prof)
    # (whether the spec has prompts or upper bounds changes no view: the kernel reads them or not)
    has_drafts = spec.num_draft_tokens is not None
    key = (bs, cp, token_arrays, has_drafts)
    writer: CommonWriter | None = group.extras.get(key)
    if writer is None:
        writer = group.extras[key] = CommonWriter(
            step, group, Bp, W, bs, cp, token_arrays, paged, has_drafts, f"{prefix}.paged_kv_indices",
        )
    writer.write(spec)
    host = writer.host(spec, causal)
    paged_part: Staged[PagedKV, PagedKVMetadata] | None = None
    w = writer
    if paged:
        total = spec.num_pages
        paged_part = Staged(step, w.paged_host(total), lambda: w.paged_metadata(step, total))
    staged = StagedCommon(step, host, lambda: w.metadata(step, spec, causal), paged=paged_part,
                          rows=lambda n: w.query_start_loc_rows(step, n), prefix=prefix, spec=spec)
    return staged, w


def stage_paged_kv(
    step: Step, prefix: str, kv_lens: np.ndarray, block_table: np.ndarray, page_size: int, *,
    host_indices: bool = True,
) -> Staged[PagedKV, PagedKVMetadata]:
    """Stage the paged-KV layout of rows of ``kv_lens`` tokens over ``block_table`` into ``step``.

    The same compiled derivation as the common pass's page table (``stage_common(paged_kv=True)``),
    for lengths or tables the common pass does not have (e.g. DCP-local lengths). Fields:
    ``<prefix>.paged_kv_indptr``, ``.paged_kv_last_page_len`` and ``.paged_kv_indices``; in graph mode
    with capacities ``max_num_reqs + 1`` (staged whole, the tail repeating the page count),
    ``max_num_reqs`` and the ``max_num_pages`` of the profile of ``page_size``
    (:meth:`StaticProfile.for_block_size <attnmeta.StaticProfile.for_block_size>`).

    Parameters
    ----------
    step : Step
        The open step.
    prefix : str
        Namespace of the staged fields.
    kv_lens : (num_reqs,) int32, host
        KV tokens of each row (padding rows 0).
    block_table : (num_reqs, max_blocks) int32, host
        Physical page ids of each row.
    page_size : int
        Tokens per page.
    host_indices : bool, default True
        Gather ``paged_kv_indices`` on the host; with False only the indptr and last-page lengths are
        staged (graph mode: the indices' fixed buffer is reserved, unwritten) and the result's indices
        are None, for a builder that gathers them on the device.

    Returns
    -------
    Staged[PagedKV, PagedKVMetadata]
        The host arrays now, the metadata after the commit.

    Raises
    ------
    ValueError
        A row needs more pages than the table has columns, or a negative id in a used column.
    attnmeta.staging.CapacityError
        Graph mode: more pages than ``profile.max_num_pages``.
    """
    B = kv_lens.shape[0]
    total = num_pages(kv_lens, page_size)
    if total > INT32_MAX:
        raise ValueError(f"{prefix}.paged_kv_indptr: {total} pages overflow int32")
    prof = step.profile
    n = prefix + "."
    if prof is not None:
        prof = prof.for_block_size(page_size)
        R, cap = prof.max_num_reqs, prof.max_num_pages
        if total > cap:
            raise CapacityError(
                f"{n}paged_kv_indices: needs {total} pages but its graph-mode capacity is {cap} "
                f"(StaticProfile.max_num_pages)"
            )
        group = step.alloc_fields(((n + "paged_kv_indptr", R + 1, _I32, R + 1, 0),
                                   (n + "paged_kv_last_page_len", B, _I32, R, 0)))
        step.alloc(n + "paged_kv_indices", total if host_indices else 0, _I32, capacity=cap, fill=0)
        indices = step.host_full(n + "paged_kv_indices")
    else:
        rows = bucket_rows(total) if host_indices else 0
        group = step.alloc_fields(((n + "paged_kv_indptr", B + 1, _I32, None, 0),
                                   (n + "paged_kv_last_page_len", B, _I32, None, 0),
                                   (n + "paged_kv_indices", rows, _I32, None, 0)))
        indices = group.host[2]
    indptr, last = group.host[0], group.host[1]
    status = paged_layout_nb(kv_lens, block_table, page_size, host_indices, indptr[: B + 1], indices, last)[0]
    if status:  # the validating wrapper raises the detailed error
        paged_kv_layout(kv_lens, block_table, page_size)
        raise AssertionError("unreachable")  # pragma: no cover
    indptr[B + 1 :] = indptr[B]
    host = PagedKV(_read_only(indptr[: B + 1]), _read_only(indices[:total]) if host_indices else None,
                   _read_only(last))

    def make() -> PagedKVMetadata:
        dev = group.device(step)
        if not host_indices:
            idx = None
        elif prof is not None:
            idx = step.device_full(n + "paged_kv_indices")[:total]
        else:
            idx = dev[2][:total]
        return make_paged(
            paged_kv_indptr=dev[0][: B + 1], paged_kv_indices=idx, paged_kv_last_page_len=dev[1],
            paged_kv_indptr_cpu=host.paged_kv_indptr, paged_kv_indices_cpu=host.paged_kv_indices,
            paged_kv_last_page_len_cpu=host.paged_kv_last_page_len, num_pages=total, page_size=page_size,
        )

    return Staged(step, host, make)


def build_common(spec: BatchSpec, stager: Stager, **kwargs: Any) -> CommonAttentionMetadata:
    """Stage ``spec``'s common metadata in a step of its own, commit it, and return the result.

    Keyword arguments go to :func:`stage_common`. For backends staged alongside, use
    :func:`stage_common` inside ``with stager.step() as step:`` instead.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[2], block_table=[[7, 8]], block_size=4)
    >>> build_common(spec, Stager("cpu")).slot_mapping_cpu.tolist()  # (a host twin: no device read)
    [31, 32]

    Raises
    ------
    TypeError
        ``stager`` is not a :class:`~attnmeta.staging.Stager`; and as :func:`stage_common`.
    """
    if not isinstance(stager, Stager):
        text = repr(stager)
        raise TypeError(f"stager: expected an attnmeta.Stager (e.g. Stager('cpu'), created once and kept), got "
                        f"{type(stager).__name__} {text if len(text) <= 60 else text[:57] + '...'}")
    with stager.step() as step:
        staged = stage_common(spec, step, **kwargs)
    return staged.result()
