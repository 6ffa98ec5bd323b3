"""The one fill path of the Mamba2 and Mamba1 builders (private to :mod:`attnmeta.backends.mamba`).

:func:`fill` stages one step of either builder, for every configuration (eager and graph mode, spec
decode, checkpoints, causal-conv1d on or off, the extra chunk formats); :class:`Filled` is what it
staged, from which each builder makes its metadata after the commit.

The fill path
-------------
Everything a step stages is reserved with ONE :meth:`attnmeta.staging.Step.alloc_fields`, whose layout
is known before any pass over the rows: ``B`` rows for every per-row field (decode and prefill
fields are views of their first ``D`` / ``P`` rows), and :func:`attnmeta.staging.bucket_rows` of a
bound from ``B`` and ``num_actual_tokens`` for the chunk, causal-conv1d and per-token fields, so
consecutive steps whose counts wobble keep the layout (and every view cached with it). In graph
mode every field is staged whole, at its fixed offset and capacity (the profile's rows, whatever the
step's counts; the kernel writes each field's sentinel past the step's rows): one layout serves the
steps of any counts, so a serving loop's mixed steps, whose counts change from step to step, replay
it (:meth:`attnmeta.builder.Builder.any_rows_key`), and the views handed out are of the step's rows
(``D`` / ``P`` of the split, cached by the split).

Then ONE compiled call, :func:`attnmeta.host.mamba.mamba_fill_nb`, classifies, splits and writes
every array straight into the staged views (host-only arrays into buffers that live with the field
group, as the staged bytes live with the slot). The optional chunk formats (logical chunks, per-token
``seq_idx``) run their own kernels of :mod:`attnmeta.host.chunks` after it, only when asked for.
An eager layout without prefill fields or spec decode (its key says every row of its steps is a
decode) skips the kernel's other parts: the split is known, and its one write, the decode rows'
state indices, is the kernel's own step (:func:`attnmeta.host.mamba.state_indices_nb`), called
alone (``_refill_decodes``). In ``"none"`` mode such a layout stages no state indices at all:
vLLM's ``state_indices_tensor_d`` is then the first column of the common block table's decode rows,
a view (``block_table_tensor[:D, :1]``), and so is attnmeta's (device and host alike). Its steps
write nothing of their own.

What the fill path keeps per ring slot and layout is a :class:`_Layout` in the field group's
``extras``: the views, the host-only arrays and the exact-length views of the latest counts (rebuilt
only when a count changes). Per ring slot (:attr:`attnmeta.staging.Step.slot_extras`) it keeps one
speed trick, a :class:`_MinusOnes`: the byte ranges of the slot that the causal-conv1d pointers of
the slot's last step left holding ``-1`` (their tail, ``2 * max(1024, tot) - tot`` rows each, most of
a large prefill step's writes). The next step of the slot does not write them again where its own
pointers lie over them: :attr:`attnmeta.staging.StagerStats.steps_begun` tells that no other step
touched the slot in between, and within a step the bytes of a field are written by its owner only.

Why one module
--------------
A layout's key (:func:`fill_key`), the fields it stages, the views it keeps and every write into them
(the kernel's, the decode-only short path's, a replay's) must agree byte for byte: a field a key
leaves out is one no write may touch. Kept side by side, one reading shows they do.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, CUDA-graph padding rows included.
- ``num_decodes`` (``D``) / ``num_prefills`` (``P``): rows ``[0, D)`` / ``[D, B)`` after the split.
- ``num_prefill_tokens`` (``Pt``): tokens of the prefill rows, token padding included.
- ``num_spec_tokens`` (``k``): speculative tokens (0 without spec decode).
- ``num_chunks``: chunks of the chunk-aligned layout; ``num_logical_chunks``: of the logical one.
- ``tot``: causal-conv1d programs, ``sum(cdiv(query_len_p, 8))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import torch

from attnmeta._checks import as_host_array
from attnmeta._fields import template
from attnmeta.backends.mamba._shared import (
    NULL_BLOCK_ID,
    MambaHost,
    check_align_block_size,
    make_host,
    runner_draft_counts,
    state_indices_error,
)
from attnmeta.builder import Replayer
from attnmeta.host.chunks import ChunkMetadata, logical_chunks_nb, token_seq_idx_nb
from attnmeta.host.common import ABSENT
from attnmeta.host.layout import prefill_cpu_metadata
from attnmeta.host.mamba import (
    CONV1D_BLOCK_M,
    FILL_E_ACCEPTED,
    FILL_E_CAPACITY,
    FILL_E_CHECKPOINT,
    FILL_E_CONTEXT,
    FILL_E_DRAFTS,
    FILL_E_DRAFTS_K,
    FILL_E_QSL,
    FILL_E_TABLE_D,
    FILL_E_TABLE_P,
    FILL_STATUS_STRIDE,
    CheckpointConfig,
    PrefillCheckpoints,
    classify_mamba_rows,
    mamba_fill_nb,
    prefill_checkpoints,
    state_indices_nb,
)
from attnmeta.host.split import SplitCounts
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.profile import StaticProfile
from attnmeta.staging import CapacityError, FieldGroup, Staged, Step, bucket_rows

__all__ = ["FillReplayer", "Filled", "FilledStaged", "accepted_counts", "conv1d_capacity", "fill", "fill_key", "logical_capacity", "refill"]

_I32, _I64, _BOOL = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_)
_NO_I32 = np.zeros(0, _I32)
_NO_I64 = np.zeros(0, _I64)
_NO_BOOL = np.zeros(0, _BOOL)
_NO_ROWS = (0, 0, 0, 0)  # no conv1d pointer rows known to hold -1
_new_tuple = tuple.__new__  # a NamedTuple from a tuple of its fields, without __new__'s argument parsing


# ------------------------------------------------------------------------------------------------
# the one fill path
# ------------------------------------------------------------------------------------------------


class _Outputs(NamedTuple):
    """The output arrays of :func:`attnmeta.host.mamba.mamba_fill_nb`, by the kernel's parameter names
    (its trailing parameters, in order); empty arrays for parts a layout does not stage."""

    moved: np.ndarray
    state_d: np.ndarray
    accepted_d: np.ndarray
    state_p: np.ndarray
    query_start_loc_p: np.ndarray
    has_initial_p: np.ndarray
    num_computed_p: np.ndarray
    nums: np.ndarray
    mlist: np.ndarray
    batch_ptr: np.ndarray
    offset_ptr: np.ndarray
    cu_chunk_seqlens: np.ndarray
    seq_idx: np.ndarray
    last_chunk: np.ndarray
    query_lens_p: np.ndarray
    ckpt_offsets: np.ndarray
    ckpt_cols: np.ndarray
    ckpt_state: np.ndarray
    ckpt_chunk: np.ndarray
    ckpt_chunk_list: np.ndarray


# staged field -> (its _Outputs name, dtype, sentinel); in the order a layout stages them (decode
# fields first: a decode-only step repeats its group's shape)
_FIELDS: dict[str, tuple[str, np.dtype, Any]] = {
    "state_indices_tensor_d": ("state_d", _I32, NULL_BLOCK_ID),
    "num_accepted_tokens": ("accepted_d", _I32, 1),
    "state_indices_tensor_p": ("state_p", _I32, NULL_BLOCK_ID),
    "query_start_loc_p": ("query_start_loc_p", _I32, 0),
    "has_initial_states_p": ("has_initial_p", _BOOL, False),
    "batch_ptr": ("batch_ptr", _I32, -1),
    "token_chunk_offset_ptr": ("offset_ptr", _I32, -1),
    "cu_chunk_seqlen_p": ("cu_chunk_seqlens", _I32, 0),
    "seq_idx_p": ("seq_idx", _I32, -1),
    "last_chunk_indices_p": ("last_chunk", _I32, -1),
    "checkpoint_chunk_idx": ("ckpt_chunk", _I64, 0),
    "checkpoint_offsets": ("ckpt_offsets", _I32, 0),
    "checkpoint_cols": ("ckpt_cols", _I64, -1),
    "checkpoint_state_indices": ("ckpt_state", _I32, NULL_BLOCK_ID),
    "chunk_indices_p": ("", _I32, 0),
    "chunk_offsets_p": ("", _I32, 0),
    "token_seq_idx_p": ("", _I32, -1),
}
_EMPTY = {_I32: _NO_I32, _I64: _NO_I64, _BOOL: _NO_BOOL}


class _Shape(NamedTuple):
    """What a layout stages (the ``alloc_fields`` key, with the prefix): rows per field group."""

    prefix: str
    num_reqs: int
    ncols: int
    accepted: bool
    prefill: bool
    conv_rows: int
    """Rows of ``batch_ptr`` / ``token_chunk_offset_ptr`` (0: not staged)."""
    chunk_rows: int
    """Rows of ``seq_idx_p`` (0: no chunk fields)."""
    checkpoints: bool
    logical_rows: int
    """Rows of ``chunk_indices_p`` / ``chunk_offsets_p`` (0: not staged)."""
    token_rows: int
    """Rows of ``token_seq_idx_p`` (0: not staged)."""
    graph: bool
    table_d: bool
    """``"none"`` mode, eager, no prefill fields, no spec decode: ``state_indices_tensor_d`` is not
    staged but a view of the common block table's first column."""


def _specs(shape: _Shape, step: Step) -> tuple[tuple[str, Any, np.dtype, int | None, Any], ...]:
    """The ``alloc_fields`` specs of a layout: ``(name, rows, dtype, capacity, sentinel)``."""
    B = shape.num_reqs
    prof = step.profile
    rows: dict[str, Any] = {"state_indices_tensor_p": B}
    if not shape.table_d:
        rows["state_indices_tensor_d"] = (B, shape.ncols)
    caps: dict[str, int | None] = dict.fromkeys(_FIELDS)
    if shape.accepted:
        rows["num_accepted_tokens"] = B
    if shape.prefill:
        rows.update(query_start_loc_p=B + 1, has_initial_states_p=B)
        if shape.conv_rows:
            rows.update(batch_ptr=shape.conv_rows, token_chunk_offset_ptr=shape.conv_rows)
        if shape.chunk_rows:
            rows.update(cu_chunk_seqlen_p=shape.chunk_rows + 1, seq_idx_p=shape.chunk_rows, last_chunk_indices_p=B)
        if shape.checkpoints:
            rows.update(checkpoint_chunk_idx=B, checkpoint_offsets=B, checkpoint_cols=B, checkpoint_state_indices=B)
        if shape.logical_rows:
            rows.update(chunk_indices_p=shape.logical_rows, chunk_offsets_p=shape.logical_rows)
        if shape.token_rows:
            rows["token_seq_idx_p"] = shape.token_rows
    if prof is not None:
        R = prof.max_num_reqs
        caps = dict.fromkeys(_FIELDS, R)
        # data-dependent sentinels (the last value repeated): staged whole
        caps["query_start_loc_p"] = rows["query_start_loc_p"] = R + 1
        caps["cu_chunk_seqlen_p"] = rows["cu_chunk_seqlen_p"] = prof.max_num_chunks + 1
        caps["seq_idx_p"] = prof.max_num_chunks
        caps["batch_ptr"] = caps["token_chunk_offset_ptr"] = conv1d_capacity(prof.max_num_tokens, R)
        caps["chunk_indices_p"] = caps["chunk_offsets_p"] = logical_capacity(prof.max_num_tokens, R, prof.chunk_size)
        caps["token_seq_idx_p"] = prof.max_num_tokens
    p = shape.prefix + "."
    return tuple((p + name, rows[name], dt, caps[name], fill) for name, (_o, dt, fill) in _FIELDS.items()
                 if name in rows)


def conv1d_capacity(max_num_tokens: int, max_num_reqs: int) -> int:
    """Graph mode: ``2 * max(1024, cdiv(max_num_tokens, 8) + max_num_reqs)`` causal-conv1d programs
    (at least any step's ``2 * max(1024, tot)``)."""
    return 2 * max(1024, -(-max_num_tokens // CONV1D_BLOCK_M) + max_num_reqs)


def logical_capacity(max_num_tokens: int, max_num_reqs: int, chunk_size: int) -> int:
    """Graph mode: ``cdiv(max_num_tokens, chunk_size) + max_num_reqs`` logical chunks."""
    return -(-max_num_tokens // chunk_size) + max_num_reqs


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class _Layout:
    """One Mamba builder's fields in one ring slot and layout, kept in the field group's ``extras``:
    the kernel's output arrays, the read-only views handed out, and the exact-length views of the
    latest counts (host and device, each rebuilt only when its count changes)."""

    __slots__ = (
        "bp_full",
        "by_d",
        "by_l",
        "by_n",
        "by_pt",
        "by_tot",
        "conv_rows",
        "decodes_only",
        "dev_d",
        "dev_l",
        "dev_n",
        "dev_pt",
        "dev_tot",
        "graph",
        "index",
        "logical",
        "mlist",
        "moved",
        "offsets",
        "outputs",
        "qsl_d",
        "ro",
        "staged_rows",
        "table_d",
        "tokens",
    )

    def __init__(self, group: FieldGroup, shape: _Shape) -> None:
        B = shape.num_reqs
        n0 = len(shape.prefix) + 1
        self.index = {f.name[n0:]: i for i, f in enumerate(group.fields)}
        self.staged_rows = [f.rows for f in group.fields]  # rows of each field's device view
        self.graph = shape.graph
        self.conv_rows = shape.conv_rows
        # An eager layout without prefill fields or spec decode: every row of its steps is a decode
        # (fill_key), and a step writes only the decode rows' state indices (refill's short path).
        self.decodes_only = not (shape.prefill or shape.accepted or shape.graph)
        # "none" mode: nothing staged for the decode rows; their state indices are views of the common
        # block table: (its device view, D, the [:D, :1] device view, the host one) of the last step
        self.table_d: tuple[Any, ...] | None = (None, -1, None, None) if shape.table_d else None
        assert shape.table_d <= self.decodes_only, "a table_d layout is a decode-only one (refill's short path)"
        host = {name: group.host[i] for name, i in self.index.items()}
        self.ro: dict[str, np.ndarray | None] = {name: group.frozen[i] for name, i in self.index.items()}
        prefill = shape.prefill
        ck = shape.checkpoints and prefill
        conv = "batch_ptr" in host
        self.moved = np.zeros(B, _BOOL)
        # host-only arrays, rewritten by every step of this layout on this slot
        nc = np.zeros(B if prefill else 0, _I32)
        nums = np.zeros(B if conv else 0, _I32)
        self.mlist = np.zeros(host["batch_ptr"].shape[0] // 2 + 1 if conv else 0, _I64)
        q_p, ck_list = np.zeros(B if ck else 0, _I32), np.zeros(B if ck else 0, _I64)
        out: dict[str, Any] = {o: host[name] if name in host else _EMPTY[dt] for name, (o, dt, _f) in _FIELDS.items()
                               if o}
        self.outputs = _Outputs(moved=self.moved, num_computed_p=nc, nums=nums, mlist=self.mlist, query_lens_p=q_p,
                                ckpt_chunk_list=ck_list, **out)
        self.ro.update(nc=_read_only(nc), nums=_read_only(nums),
                       mlist=_read_only(self.mlist), q_p=_read_only(q_p), ck_list=_read_only(ck_list))
        self.logical = (host["chunk_indices_p"], host["chunk_offsets_p"]) if "chunk_indices_p" in host else None
        self.tokens = host.get("token_seq_idx_p")
        # byte offsets of batch_ptr / token_chunk_offset_ptr in the slot (this layout's own fields)
        self.offsets = ((group.fields[self.index["batch_ptr"]].offset, group.fields[self.index["token_chunk_offset_ptr"]].offset)
                        if conv else (0, 0))
        # graph mode: (the group's device views they go with, the pointers' full device buffers, their length)
        self.bp_full: tuple[Any, ...] | None = None
        self.qsl_d: tuple[Any, ...] = (None, -1, None, None)  # (common qsl tensor, D, its [:D + 1] views)
        # the exact-length views of the latest counts: (count, views) on the host, (device views of the
        # group, count, views) on the device
        none: tuple[Any, ...] = (-1, None)
        self.by_d = self.by_n = self.by_tot = self.by_l = self.by_pt = none
        dnone: tuple[Any, ...] = (None, -1, None)
        self.dev_d = self.dev_n = self.dev_tot = self.dev_l = self.dev_pt = dnone

    def views(self, name: str, rows: int) -> np.ndarray | None:
        """The first ``rows`` rows of a read-only view (None when not staged)."""
        v = self.ro.get(name)
        return None if v is None else v[:rows]

    def host_d(self, D: int, P: int) -> tuple[Any, ...]:
        """Host views of the fields sized by the split (``D`` decode rows, ``P`` prefill rows): ``(si_d,
        acc, si_p, qsl_p, init, nc, last, nums, q_p, ck_off, ck_cols, ck_si, ck_chunk, ck_list)``."""
        hit = self.by_d
        if hit[0] != (D, P):
            v = self.views
            hit = self.by_d = ((D, P), (
                v("state_indices_tensor_d", D), v("num_accepted_tokens", D), v("state_indices_tensor_p", P),
                v("query_start_loc_p", P + 1), v("has_initial_states_p", P), v("nc", P), v("last_chunk_indices_p", P),
                v("nums", P), v("q_p", P), v("checkpoint_offsets", P), v("checkpoint_cols", P),
                v("checkpoint_state_indices", P), v("checkpoint_chunk_idx", P), v("ck_list", P),
            ))
        views: tuple[Any, ...] = hit[1]
        return views

    def host_n(self, n: int) -> tuple[Any, Any]:
        """``(cu_chunk_seqlen_p, seq_idx_p)`` host views of ``n`` chunks."""
        hit = self.by_n
        if hit[0] != n:
            hit = self.by_n = (n, (self.views("cu_chunk_seqlen_p", n + 1), self.views("seq_idx_p", n)))
        views: tuple[Any, Any] = hit[1]
        return views

    def host_tot(self, tot: int) -> tuple[Any, Any, Any, Any]:
        """``(mlist, offsetlist, batch_ptr, token_chunk_offset_ptr)`` host views of ``tot`` programs
        (eager: the pointers' ``2 * max(1024, tot)`` rows; graph mode: the first ``tot``)."""
        hit = self.by_tot
        if hit[0] != tot:
            rows = tot if self.graph else 2 * max(1024, tot)
            v = self.views
            hit = self.by_tot = (tot, (v("mlist", tot), v("token_chunk_offset_ptr", tot), v("batch_ptr", rows),
                                       v("token_chunk_offset_ptr", rows)))
        views: tuple[Any, Any, Any, Any] = hit[1]
        return views

    def host_l(self, nl: int) -> tuple[Any, Any]:
        """``(chunk_indices_p, chunk_offsets_p)`` host views of ``nl`` logical chunks."""
        hit = self.by_l
        if hit[0] != nl:
            hit = self.by_l = (nl, (self.views("chunk_indices_p", nl), self.views("chunk_offsets_p", nl)))
        views: tuple[Any, Any] = hit[1]
        return views

    def host_pt(self, Pt: int) -> Any:
        """The ``token_seq_idx_p`` host view of ``Pt`` prefill tokens."""
        hit = self.by_pt
        if hit[0] != Pt:
            hit = self.by_pt = (Pt, self.views("token_seq_idx_p", Pt))
        return hit[1]

    def _dev(self, dev: list[torch.Tensor], name: str, rows: int) -> torch.Tensor | None:
        i = self.index.get(name)
        if i is None:
            return None
        t = dev[i]
        if self.staged_rows[i] == rows:
            return t
        # as_strided: the same view as t[:rows] (t is contiguous), for less host time
        return t.as_strided((rows, *t.shape[1:]), t.stride()) if t.dim() > 1 else t.as_strided((rows,), (1,))

    def device_d(self, dev: list[torch.Tensor], D: int, P: int) -> tuple[Any, ...]:
        """Device views of the fields sized by the split (``D`` decode rows, ``P`` prefill rows): ``(si_d,
        acc, si_p, qsl_p, init, last, ck_off, ck_cols, ck_si, ck_chunk)``."""
        hit = self.dev_d
        if hit[0] is not dev or hit[1] != (D, P):
            d = self._dev
            hit = self.dev_d = (dev, (D, P), (
                d(dev, "state_indices_tensor_d", D), d(dev, "num_accepted_tokens", D),
                d(dev, "state_indices_tensor_p", P), d(dev, "query_start_loc_p", P + 1),
                d(dev, "has_initial_states_p", P), d(dev, "last_chunk_indices_p", P), d(dev, "checkpoint_offsets", P),
                d(dev, "checkpoint_cols", P), d(dev, "checkpoint_state_indices", P), d(dev, "checkpoint_chunk_idx", P),
            ))
        views: tuple[Any, ...] = hit[2]
        return views

    def device_n(self, dev: list[torch.Tensor], n: int) -> tuple[Any, Any]:
        """``(cu_chunk_seqlen_p, seq_idx_p)`` device views of ``n`` chunks."""
        hit = self.dev_n
        if hit[0] is not dev or hit[1] != n:
            hit = self.dev_n = (dev, n, (self._dev(dev, "cu_chunk_seqlen_p", n + 1), self._dev(dev, "seq_idx_p", n)))
        views: tuple[Any, Any] = hit[2]
        return views

    def device_tot(self, dev: list[torch.Tensor], tot: int, step: Step, prefix: str) -> tuple[Any, Any, int]:
        """``(batch_ptr, token_chunk_offset_ptr, length)`` device views: eager ``2 * max(1024, tot)``
        rows, graph mode the full fixed buffers."""
        if self.graph:
            full = self.bp_full
            if full is None or full[0] is not dev:  # (new views: the graph arena grew, as the group's views tell)
                bp = step.device_full(prefix + ".batch_ptr")
                full = self.bp_full = (dev, bp, step.device_full(prefix + ".token_chunk_offset_ptr"), int(bp.shape[0]))
            return full[1], full[2], full[3]
        hit = self.dev_tot
        rows = 2 * max(1024, tot)
        if hit[0] is not dev or hit[1] != rows:
            hit = self.dev_tot = (dev, rows, (self._dev(dev, "batch_ptr", rows),
                                              self._dev(dev, "token_chunk_offset_ptr", rows), rows))
        views: tuple[Any, Any, int] = hit[2]
        return views

    def reads_table(self, h: CommonHost) -> bool:
        """A :attr:`table_d` layout's step whose state indices are views of its common block table: the
        table has the one column they read (else the fill path raises the kernel's error)."""
        return self.table_d is not None and (h.block_table_cpu.shape[1] >= 1 or not h.num_reqs)

    def table_views(self, common: CommonAttentionMetadata, D: int) -> tuple[torch.Tensor, np.ndarray]:
        """A :attr:`table_d` layout's ``state_indices_tensor_d`` and its host twin: the first column of
        the common block table's ``D`` decode rows (device and read-only host views)."""
        hit = self.table_d
        assert hit is not None
        bt = common.block_table_tensor
        if hit[0] is not bt or hit[1] != D:
            hit = self.table_d = (bt, D, bt[:D, :1], common.block_table_cpu[:D, :1])
        return hit[2], hit[3]

    def query_start_loc_d(self, common: CommonAttentionMetadata, D: int) -> tuple[Any, Any]:
        """``query_start_loc[:D + 1]`` of the common metadata: the device and host views."""
        hit = self.qsl_d
        qsl = common.query_start_loc
        if hit[0] is not qsl or hit[1] != D:
            hit = self.qsl_d = (qsl, D, qsl[: D + 1], common.query_start_loc_cpu[: D + 1])
        return hit[2], hit[3]

    def device_l(self, dev: list[torch.Tensor], nl: int) -> tuple[Any, Any]:
        """``(chunk_indices_p, chunk_offsets_p)`` device views of ``nl`` logical chunks."""
        hit = self.dev_l
        if hit[0] is not dev or hit[1] != nl:
            hit = self.dev_l = (dev, nl, (self._dev(dev, "chunk_indices_p", nl), self._dev(dev, "chunk_offsets_p", nl)))
        views: tuple[Any, Any] = hit[2]
        return views

    def device_pt(self, dev: list[torch.Tensor], Pt: int) -> Any:
        """The ``token_seq_idx_p`` device view of ``Pt`` prefill tokens."""
        hit = self.dev_pt
        if hit[0] is not dev or hit[1] != Pt:
            hit = self.dev_pt = (dev, Pt, self._dev(dev, "token_seq_idx_p", Pt))
        return hit[2]


class _MinusOnes:
    """The rows of causal-conv1d pointer arrays that hold -1 in a ring slot after the slot's steps,
    by the step's stamp (:attr:`attnmeta.staging.StagerStats.steps_begun` when it began) and the
    array's byte offset in the slot; kept in :attr:`attnmeta.staging.Step.slot_extras`. A step reads
    the entry of the slot's previous use only, and adds its own."""

    __slots__ = ("by_stamp",)

    def __init__(self) -> None:
        self.by_stamp: dict[int, dict[int, tuple[int, int]]] = {}

    def known_rows(self, stamp: int, offsets: tuple[int, int], rows: int) -> tuple[int, int, int, int]:
        """For two int32 arrays of ``rows`` rows at byte ``offsets``: a run of rows ``[lo, hi)`` of each
        that step ``stamp`` left holding -1 (``(0, 0)`` where none)."""
        arrays = self.by_stamp.get(stamp)
        if not arrays:
            return _NO_ROWS
        a, b = offsets
        fa, fb = arrays.get(a), arrays.get(b)  # the usual case: the same layout as the slot's last step
        if fa is not None and fb is not None:
            return fa[0], min(fa[1], rows), fb[0], min(fb[1], rows)
        out: list[int] = []
        for offset in offsets:  # another layout: the longest run inside one of the recorded ranges
            best = (0, 0)
            for base, (lo, hi) in arrays.items():
                first = max(0, -(-(base + 4 * lo - offset) // 4))
                last = min(rows, (base + 4 * hi - offset) // 4)
                if last - first > best[1] - best[0]:
                    best = (first, last)
            out += best
        return out[0], out[1], out[2], out[3]

    def add(self, stamp: int, offsets: tuple[int, int], lo: int, hi: int, oldest: int) -> None:
        """Record that rows ``[lo, hi)`` of the int32 arrays at byte ``offsets`` hold -1 after step
        ``stamp``; forget the entries of steps before ``oldest``."""
        by = self.by_stamp
        arrays = by.get(stamp)
        if arrays is None:
            arrays = by[stamp] = {}
            if len(by) > 2:
                for old in [k for k in by if k < oldest]:
                    del by[old]
        arrays[offsets[0]] = arrays[offsets[1]] = (lo, hi)


class Filled:
    """What :func:`fill` staged in one step: the counts (``D``, ``P``, ``Dt``, ``Pt``, ``tot``, ``n``
    chunks, ``prep``, ``nck`` checkpoint rows, ``nl`` logical chunks), the layout, and the host part.

    :meth:`shared_fields` after the commit gives the shared metadata fields (exact-length views of
    the staged fields) and keeps the views it looked up (``dev``, ``host_d``, ``dev_d``) for the
    builder's own fields.
    """

    __slots__ = ("D", "Dt", "P", "Pt", "dev", "dev_d", "group", "host", "host_d", "layout", "n", "nck", "nl", "prefix",
                 "prep", "step", "tot")

    dev: list[torch.Tensor]
    """After :meth:`shared_fields`: the field group's device views."""
    host_d: tuple[Any, ...]
    """After :meth:`shared_fields`: :meth:`_Layout.host_d` of this step's split."""
    dev_d: tuple[Any, ...]
    """After :meth:`shared_fields`: :meth:`_Layout.device_d` of this step's split."""

    def __init__(self, step: Step, group: FieldGroup, layout: _Layout, prefix: str, host: MambaHost, D: int, P: int,
                 Dt: int, Pt: int, tot: int, n: int, prep: bool, nck: int, nl: int) -> None:
        self.step, self.group, self.layout, self.prefix, self.host = step, group, layout, prefix, host
        self.D, self.P, self.Dt, self.Pt, self.tot, self.n, self.prep, self.nck, self.nl = D, P, Dt, Pt, tot, n, prep, nck, nl


    def shared_fields(self, cm: CommonAttentionMetadata) -> dict[str, Any]:
        """The :class:`MambaMetadata` field values of this step, after its commit (``cm`` is the common
        metadata): exact-length views of the staged fields."""
        lay, D, P, tot = self.layout, self.D, self.P, self.tot
        dev = self.dev = self.group.device(self.step)  # raises if the step has not committed or its slot was reused
        hd = self.host_d = lay.host_d(D, P)
        dd = self.dev_d = lay.device_d(dev, D, P)
        if lay.table_d is not None:
            si_d, si_d_h = lay.table_views(cm, D)
        else:
            si_d, si_d_h = dd[0], hd[0]
        qsl_d = qsl_d_h = acc = acc_h = None
        if D and hd[1] is not None:  # spec decode with decodes
            qsl_d, qsl_d_h = lay.query_start_loc_d(cm, D)
            acc, acc_h = dd[1], hd[1]
        pre = P > 0
        bp = op = bp_h = op_h = nums = mlist = offsets = nums_dict = None
        length = 0
        if pre and lay.mlist.shape[0]:
            mlist, offsets, bp_h, op_h = lay.host_tot(tot)
            bp, op, length = lay.device_tot(dev, tot, self.step, self.prefix)
            nums = hd[7]
            nums_dict = {CONV1D_BLOCK_M: {"nums": nums, "tot": tot, "mlist": mlist, "mlist_len": tot,
                                          "offsetlist": offsets, "batch_ptr": bp, "token_chunk_offset_ptr": op}}
        return {
            "common": cm, "num_prefills": P, "num_prefill_tokens": self.Pt, "num_decodes": D,
            "num_decode_tokens": self.Dt, "num_reqs": D + P, "conv1d_num_programs_total": tot if nums is not None else 0,
            "conv1d_max_num_programs": length, "has_initial_states_p": dd[4] if pre else None,
            "query_start_loc_p": dd[3] if pre else None, "state_indices_tensor_p": dd[2],
            "state_indices_tensor_d": si_d, "query_start_loc_d": qsl_d, "num_accepted_tokens": acc,
            "seq_lens": cm.seq_lens, "batch_ptr": bp, "token_chunk_offset_ptr": op,
            "has_initial_states_p_cpu": hd[4] if pre else None, "query_start_loc_p_cpu": hd[3] if pre else None,
            "state_indices_tensor_p_cpu": hd[2], "state_indices_tensor_d_cpu": si_d_h, "query_start_loc_d_cpu": qsl_d_h,
            "num_accepted_tokens_cpu": acc_h, "seq_lens_cpu": cm.seq_lens_cpu, "batch_ptr_cpu": bp_h,
            "token_chunk_offset_ptr_cpu": op_h, "num_computed_tokens_p_cpu": hd[5] if pre else None,
            "conv1d_nums_cpu": nums, "conv1d_mlist_cpu": mlist, "conv1d_offsetlist_cpu": offsets,
            "nums_dict": nums_dict,
        }


def accepted_counts(values: Any, h: CommonHost, spec_tokens: int, owner: str) -> np.ndarray:
    """``num_accepted_tokens`` checked: one count per real request or per row (int32, host); empty when
    None.

    Raises
    ------
    ValueError
        Counts without spec decode, or of the wrong length.
    TypeError
        A torch tensor or a non-integer array.
    """
    if values is None:
        return _NO_I32
    if not spec_tokens:
        raise ValueError(f"num_accepted_tokens: given, but spec decode is off ({owner}.num_speculative_tokens == 0)")
    a = as_host_array(values, "num_accepted_tokens", dtype=np.int32)
    if a.shape[0] != h.num_real_reqs and a.shape[0] != h.num_reqs:
        raise ValueError(
            f"num_accepted_tokens: expected one count per real request ({h.num_real_reqs}) or per row "
            f"({h.num_reqs}), got shape {a.shape}"
        )
    return a


def fill(
    common: StagedCommon,
    step: Step,
    owner: str,
    prefix: str,
    spec_tokens: int,
    chunk_size: int,
    mamba_block_size: int | None,
    align: bool,
    conv1d: bool,
    checkpoint: CheckpointConfig | None,
    logical: bool,
    token_seq_idx: bool,
    consecutive: bool,
    num_accepted_tokens: Any,
) -> Filled:
    """Stage one Mamba2 (``chunk_size > 0``) or Mamba1 (``chunk_size == 0``) step: the fill path of the
    module docstring. ``owner`` is the options type's name (for messages).

    Raises
    ------
    ValueError
        A block table too narrow for the state or checkpoint columns; ``num_accepted_tokens`` without
        spec decode, of the wrong length, or with a decode row's count outside ``[1, 1 + k]``; in
        ``"align"`` mode a mamba block size below the block size; a checkpoint block size other than
        the builder's; graph mode: a chunk size other than the profile's.
    attnmeta.staging.CapacityError
        Graph mode: the step exceeds a profile capacity.
    """
    h = common.host
    B, T = h.num_reqs, h.num_actual_tokens
    bs_m = h.block_size if mamba_block_size is None else mamba_block_size
    if align and bs_m < h.block_size:
        check_align_block_size(owner, mamba_block_size, h.block_size)  # raises
    prof = step.profile
    isp = h.is_prefilling
    accepted = accepted_counts(num_accepted_tokens, h, spec_tokens, owner)
    if checkpoint is not None and checkpoint.mamba_block_size != bs_m:
        raise ValueError(
            f"Mamba2Options.checkpoint.mamba_block_size={checkpoint.mamba_block_size} != the builder's mamba block "
            f"size {bs_m} (the common block size); both describe the same MambaSpec.block_size"
        )
    if prof is not None and chunk_size and prof.chunk_size != chunk_size:
        raise ValueError(
            f"Mamba2Options.chunk_size={chunk_size} != StaticProfile.chunk_size={prof.chunk_size}: graph mode sizes "
            f"the chunk buffers with the profile's max_num_chunks; build the profile with chunk_size={chunk_size}"
        )
    if prof is not None and (prof.max_num_reqs < B or prof.max_num_tokens < T):  # (the kernel writes B rows)
        raise CapacityError(f"{prefix}: batch of {B} rows / {T} tokens exceeds the profile "
                            f"(max_num_reqs={prof.max_num_reqs}, max_num_tokens={prof.max_num_tokens})")
    key = fill_key(B, T, h.max_query_len, bool(np.count_nonzero(isp)), prefix, spec_tokens, chunk_size, conv1d,
                   checkpoint, logical, token_seq_idx, prof, align)
    group = step.alloc_fields(lambda: _specs(_Shape(*key), step), key)
    lay: _Layout | None = group.extras.get(_Layout)
    if lay is None:
        lay = group.extras[_Layout] = _Layout(group, _Shape(*key))
    return refill(step, h, group, lay, owner, prefix, spec_tokens, chunk_size, bs_m, align, checkpoint, consecutive,
                  accepted, num_accepted_tokens is not None)


def fill_key(num_reqs: int, num_tokens: int, max_query_len: int, any_prefilling: bool, prefix: str, spec_tokens: int,
             chunk_size: int, conv1d: bool, checkpoint: CheckpointConfig | None, logical: bool, token_seq_idx: bool,
             profile: StaticProfile | None, align: bool) -> tuple[Any, ...]:
    """What the fields :func:`fill` stages depend on: their names, rows and order (:class:`_Shape`).

    ``num_reqs`` / ``num_tokens`` are the padded counts; ``any_prefilling`` whether a row is still in
    its prompt; ``align`` whether the cache mode is ``"align"``. The same key from a spec (a replay's)
    and from its staged common metadata (a step's). With a ``profile`` (graph mode) the rows are the
    profile's, whatever the counts: every field is staged whole, at its fixed place, and one layout
    serves the steps of any counts (:meth:`attnmeta.builder.Builder.any_rows_key`)."""
    thr = 1 + spec_tokens
    B, T = (num_reqs, num_tokens) if profile is None else (profile.max_num_reqs, profile.max_num_tokens)
    # Prefill rows are possible when a query is longer than the threshold or a row still prefills;
    # a step that cannot have any stages no prefill field.
    pre = max_query_len > thr or any_prefilling
    conv_rows = chunk_rows = logical_rows = token_rows = 0
    if pre:
        if conv1d:
            conv_rows = bucket_rows(2 * max(1024, min(T, T // CONV1D_BLOCK_M + B)))
        if chunk_size:
            chunk_rows = bucket_rows(min(T + B, T // chunk_size + (4 if checkpoint is not None else 2) * B))
            if logical:
                logical_rows = bucket_rows(-(-T // chunk_size) + B)
        if token_seq_idx:
            token_rows = bucket_rows(T)
        if profile is not None:
            R, Q = profile.max_num_reqs, profile.max_num_tokens
            conv_rows = min(conv_rows, conv1d_capacity(Q, R))
            chunk_rows = min(chunk_rows, profile.max_num_chunks)
            logical_rows = min(logical_rows, logical_capacity(Q, R, chunk_size or 1))
            token_rows = min(token_rows, Q)
    return (prefix, B, thr, spec_tokens > 0, pre, conv_rows, chunk_rows, checkpoint is not None, logical_rows,
            token_rows, profile is not None, not (align or pre or spec_tokens or profile is not None))


def refill(step: Step, h: CommonHost, group: FieldGroup, lay: _Layout, owner: str, prefix: str, spec_tokens: int,
           chunk_size: int, bs_m: int, align: bool, checkpoint: CheckpointConfig | None, consecutive: bool,
           accepted: np.ndarray, has_accepted: bool) -> Filled:
    """Write one step into the fields of ``group`` (reserved by :func:`fill`, this step or, replayed, a
    step of the same layout on the same slot): every staged byte, with ONE compiled call and the
    optional chunk formats' kernels (a decode-only eager layout: :func:`_refill_decodes`). ``accepted``:
    the checked accepted counts (empty without)."""
    if lay.decodes_only:
        return _refill_decodes(step, h, group, lay, prefix, bs_m, align, checkpoint, owner)
    B, T = h.num_reqs, h.num_actual_tokens
    thr = 1 + spec_tokens
    prof = step.profile
    isp = h.is_prefilling
    conv_rows = lay.conv_rows
    known = _NO_ROWS
    record: _MinusOnes | None = None
    stamp = num_slots = 0
    if conv_rows:
        stager = step.stager
        stamp, num_slots = stager.stats.steps_begun, stager.num_slots
        record = step.slot_extras.get(_MinusOnes)
        if record is None:
            record = step.slot_extras[_MinusOnes] = _MinusOnes()
        known = record.known_rows(stamp - num_slots, lay.offsets, conv_rows)
    hb = hit = ck_align = look = 0
    drop = False
    if checkpoint is not None:
        hb, hit, look = checkpoint.hash_block_size, checkpoint.cache_hit_alignment_tokens, checkpoint.num_hash_lookahead_tokens
        ck_align, drop = checkpoint.checkpoint_alignment or 0, checkpoint.drop_eagle_block
    drafts = runner_draft_counts(h, spec_tokens) if spec_tokens else None
    status, D, Dt, tot, n, prep, nck, num_moved = mamba_fill_nb(
        h.query_start_loc_cpu, h.seq_lens_cpu_upper_bound, isp, ABSENT if drafts is None else drafts,
        h.seq_lens_cpu, h.block_table_cpu, T, thr, bs_m, align, chunk_size, prof is not None, accepted,
        has_accepted, known[0], known[1], known[2], known[3], hb, hit, ck_align, look, drop,
        *lay.outputs,
    )
    if status:
        _raise_fill_error(status, h, spec_tokens, bs_m, align, checkpoint, prefix, accepted, owner)
    P = B - D
    if record is not None and (P or prof is not None):  # the pointers were written: [tot, stop) holds -1
        record.add(stamp, lay.offsets, tot, conv_rows if prof is not None else 2 * max(1024, tot), stamp - num_slots)
    Pt = T - Dt
    nl = 0
    if P and lay.logical is not None:
        ci, co = lay.logical
        nl = logical_chunks_nb(lay.outputs.query_start_loc_p[: P + 1], chunk_size, ci, co)
        if nl > ci.shape[0]:
            raise CapacityError(f"{prefix}.chunk_indices_p: needs {nl} logical chunks but its capacity is {ci.shape[0]}")
        if prof is not None:
            ci[nl:] = 0
            co[nl:] = 0
    elif lay.logical is not None and prof is not None:
        lay.logical[0][:] = 0
        lay.logical[1][:] = 0
    if lay.tokens is not None:
        if P:
            token_seq_idx_nb(lay.outputs.query_start_loc_p[: P + 1], consecutive,
                              lay.tokens if prof is not None else lay.tokens[:Pt])
        elif prof is not None:
            lay.tokens[:] = -1
    hd = lay.host_d(D, P)
    chunks = checkpoints = None
    if P and chunk_size:
        cu, sidx = lay.host_n(n)
        chunks = _new_tuple(ChunkMetadata, (cu, sidx, hd[6], hd[13] if nck else _no_checkpoints(P), n))
        if nck:
            checkpoints = PrefillCheckpoints(hd[9], hd[10], hd[11])
    host = make_host(
        split=_new_tuple(SplitCounts, (D, P, Dt, Pt)), is_prefilling=_read_only(lay.moved[:B]) if num_moved else isp,
        num_computed_tokens_p_cpu=hd[5] if P else None, query_start_loc_p_cpu=hd[3] if P else None, chunks=chunks,
        checkpoints=checkpoints,
    )
    return Filled(step, group, lay, prefix, host, D, P, Dt, Pt, tot, n, prep, nck, nl)


MetadataT = TypeVar("MetadataT")


class FilledStaged(Staged[MambaHost, MetadataT]):
    """A staged fill-path step (Mamba1 or Mamba2): its host part, and what it filled (for a
    :class:`FillReplayer` of its layout)."""

    __slots__ = ("filled",)

    def __init__(self, step: Step, filled: Filled, make: Callable[[], MetadataT]) -> None:
        super().__init__(step, filled.host, make)
        self.filled = filled


class FillReplayer(Replayer[Any, MetadataT], Generic[MetadataT]):
    """Replays of a fill-path layout (the Mamba1 and Mamba2 builders): :func:`refill` into the recorded
    fields, then the builder's ``make(filled, common)``, the function its staged steps make their
    metadata with.

    A step without prefill rows makes its metadata from the last such step's with the three fields
    that change (:data:`_DECODE_PER_STEP`, :func:`attnmeta._fields.template`) while the slot's device
    views, the split, the common query starts and block table are the same objects. A ``"none"``-mode
    decode-only layout stages nothing (:attr:`_Layout.table_d`): its :meth:`rewrite` checks the table
    has the column it reads (:meth:`_Layout.reads_table`, the fill's one check) and keeps the step for
    :meth:`result`, which fills only when it cannot reuse. ``inputs`` are the builder's (their ``num_accepted_tokens``, if any, are the step's accepted counts).
    """

    __slots__ = ("align", "bs_m", "checkpoint", "chunk_size", "consecutive", "decode", "filled", "group", "layout",
                 "make", "owner", "prefix", "spec_tokens", "unwritten")

    def __init__(self, filled: Filled, make: Callable[[Filled, CommonAttentionMetadata], MetadataT], owner: str,
                 prefix: str, spec_tokens: int, chunk_size: int, mamba_block_size: int | None, align: bool,
                 checkpoint: CheckpointConfig | None, consecutive: bool) -> None:
        self.group, self.layout, self.make, self.owner, self.prefix = filled.group, filled.layout, make, owner, prefix
        self.spec_tokens, self.chunk_size, self.bs_m, self.align = spec_tokens, chunk_size, mamba_block_size, align
        self.checkpoint, self.consecutive = checkpoint, consecutive
        self.filled: Filled | None = None
        # (the slot's device views, the common query starts, the split, the common block table, template(...))
        # of the last step without prefill rows
        self.decode: tuple[Any, Any, tuple[int, int, int], Any, Callable[..., MetadataT]] | None = None
        # a table_d layout's (step, common host, inputs), kept by rewrite() for result()
        self.unwritten: tuple[Step, CommonHost, Any] | None = None

    def rewrite(self, step: Step, host: CommonHost, inputs: Any) -> None:
        accepted = getattr(inputs, "num_accepted_tokens", None)
        if accepted is None and self.layout.reads_table(host):
            self.filled, self.unwritten = None, (step, host, inputs)
            return
        self.unwritten = None
        self.filled = self._refill(step, host, accepted)

    def _refill(self, step: Step, host: CommonHost, accepted: Any) -> Filled:
        bs_m = host.block_size if self.bs_m is None else self.bs_m
        acc = accepted_counts(accepted, host, self.spec_tokens, self.owner)
        return refill(step, host, self.group, self.layout, self.owner, self.prefix, self.spec_tokens, self.chunk_size,
                      bs_m, self.align, self.checkpoint, self.consecutive, acc, accepted is not None)

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: Any) -> MetadataT:
        f, self.filled = self.filled, None
        u, self.unwritten = self.unwritten, None
        if u is not None:  # (a table_d layout: every row a decode, nothing staged: the split is the host's)
            assert u[0] is step, "result() without this step's rewrite()"
            split = (u[1].num_reqs, u[1].num_actual_tokens, 0)
        else:
            assert f is not None and f.step is step, "result() without this step's rewrite()"
            if f.P:
                return self.make(f, common)
            split = (f.D, f.Dt, f.Pt)
        dev, qsl, bt = self.group.device(step), common.query_start_loc, common.block_table_tensor  # (raises if expired)
        d = self.decode
        if d is not None and d[0] is dev and d[1] is qsl and d[2] == split and d[3] is bt:
            return d[4](common, common.seq_lens, common.seq_lens_cpu)
        if f is None:  # (a table_d layout writes nothing: its fill may follow the commit)
            assert u is not None
            f = self._refill(step, u[1], getattr(u[2], "num_accepted_tokens", None))
        m = self.make(f, common)
        self.decode = (dev, qsl, split, bt, template(m, _DECODE_PER_STEP))
        return m


_DECODE_PER_STEP = ("common", "seq_lens", "seq_lens_cpu")
"""The fields of a step without prefill rows that a replay of the same split on the same views changes."""


def _refill_decodes(step: Step, h: CommonHost, group: FieldGroup, lay: _Layout, prefix: str, bs_m: int, align: bool,
                    checkpoint: CheckpointConfig | None, owner: str) -> Filled:
    """:func:`refill` of a :attr:`_Layout.decodes_only` layout: what the fill kernel does for a step
    whose rows are all decodes (no query longer than 1, no row in its prompt: the layout's key says
    so), without its other parts: the split is ``(B, 0, T, 0)`` and the one staged write is the state
    indices of the decode rows (:func:`~attnmeta.host.mamba.state_indices_nb`, the kernel's own step
    2; none in a :attr:`_Layout.table_d` layout, whose one check is the table's first column). Its
    errors are the kernel's."""
    B, T = h.num_reqs, h.num_actual_tokens
    if lay.table_d is not None:  # nothing to write: the views of the common block table (a column is enough)
        bad = -1 if lay.reads_table(h) else 0
    else:
        bad = state_indices_nb(h.block_table_cpu[:B], h.seq_lens_cpu[:B], bs_m, align, lay.outputs.state_d[:B])
    if bad >= 0:
        _raise_fill_error(-1 - (bad * FILL_STATUS_STRIDE + FILL_E_TABLE_D), h, 0, bs_m, align, checkpoint, prefix,
                          _NO_I32, owner)
    host = make_host(split=_new_tuple(SplitCounts, (B, 0, T, 0)), is_prefilling=h.is_prefilling,
                     num_computed_tokens_p_cpu=None, query_start_loc_p_cpu=None, chunks=None, checkpoints=None)
    return Filled(step, group, lay, prefix, host, B, 0, T, 0, 0, 0, False, 0, 0)


_MINUS_ONES = np.full(4096, -1, _I64)
_MINUS_ONES.flags.writeable = False


def _no_checkpoints(num_rows: int) -> np.ndarray:
    """``ChunkMetadata.checkpoint_chunk_idx`` without checkpoints: ``num_rows`` times -1 (read-only)."""
    if num_rows <= _MINUS_ONES.shape[0]:
        return _MINUS_ONES[:num_rows]
    return _read_only(np.full(num_rows, -1, _I64))


def _raise_fill_error(status: int, h: CommonHost, k: int, bs_m: int, align: bool, checkpoint: CheckpointConfig | None,
                      prefix: str, accepted: np.ndarray, owner: str) -> None:
    """Turn the fill kernel's status into the validating functions' message (re-run on the failing part)."""
    enc = -1 - status
    row, code = enc // FILL_STATUS_STRIDE, enc % FILL_STATUS_STRIDE
    qsl, ub, B = h.query_start_loc_cpu, h.seq_lens_cpu_upper_bound, h.num_reqs
    mode = "align" if align else "none"
    if code in (FILL_E_QSL, FILL_E_DRAFTS):
        classify_mamba_rows(qsl, ub, h.is_prefilling, runner_draft_counts(h, k) if k else None)
    elif code == FILL_E_TABLE_D:  # decode rows before ``row`` fit their 1 + k columns
        raise state_indices_error(h, slice(0, row + 1), bs_m, mode, 1 + k)
    elif code == FILL_E_TABLE_P:  # every row before ``row`` fits one column
        raise state_indices_error(h, slice(0, row + 1), bs_m, mode, 1)
    elif code == FILL_E_CONTEXT:
        prefill_cpu_metadata(qsl, ub, num_reqs=B, num_prefills=B - row, num_decode_tokens=int(qsl[row]))
    elif code == FILL_E_CHECKPOINT and checkpoint is not None:
        q = np.diff(qsl[row : row + 2]).astype(np.int32)
        prefill_checkpoints(ub[row : row + 1], q, h.block_table_cpu[row : row + 1], config=checkpoint)
    elif code == FILL_E_DRAFTS_K:
        drafts = runner_draft_counts(h, k)
        assert drafts is not None  # (the kernel checks drafts only when it has them)
        raise ValueError(
            f"num_draft_tokens[{row}]={int(drafts[row])} > {owner}.num_speculative_tokens={k} "
            f"(request {row}): a row verifies at most k drafts (past the decode threshold 1 + k it would run as a "
            f"prefill, its drafts taken into the state as accepted tokens)"
        )
    elif code == FILL_E_ACCEPTED:
        raise ValueError(
            f"num_accepted_tokens[{row}]={int(accepted[row])} is outside [1, {1 + k}] (row {row}, a decode row; "
            f"1 + {owner}.num_speculative_tokens={k}): a decode row accepted at least its bonus token and at most "
            f"every draft"
        )
    elif code == FILL_E_CAPACITY:
        raise CapacityError(
            f"{prefix}: the step needs {row} rows of a field past its graph-mode capacity (raise the StaticProfile "
            f"capacity that sizes it: max_num_reqs, max_num_tokens or, for chunks, max_num_chunks)"
        )
    raise AssertionError(f"mamba fill: internal status {status} (row {row})")  # pragma: no cover

