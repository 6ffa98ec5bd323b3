"""Chunked local attention as virtual batches (docs/semantics-attention.md), derived on the host.

Chunked local attention (Llama 4's ``attention_chunk_size`` ``A``) lets a token see only the KV of its
own aligned ``A``-token chunk. Each request becomes one "virtual" row per local chunk its queries touch,
so an ordinary varlen paged kernel runs them: virtual row ``v`` has ``q_v`` queries and attends, causally
aligned to its end, the ``k_v`` KV tokens of one chunk, whose pages are row ``v`` of a small
``(num_virtual_reqs, A / block_size)`` block table (the chunk starts on a block boundary).

vLLM 0.33.0 computes this in host numpy but first reads ``seq_lens.cpu()``, a sync it keeps knowingly
(TODO vllm#31852). attnmeta uses the common metadata's exact host ``seq_lens_cpu``
(:func:`attnmeta.host.local_attn.local_virtual_batches`, compiled) and stages the result into the step:
nothing is read back.

The result is a :class:`LocalAttentionMetadata` that **contains** the virtual batch as a
:class:`~attnmeta.metadata.CommonAttentionMetadata` (``.common``; the table below), so any backend
builder runs over it unchanged: ``Staged.host.common`` is its staged form, e.g. for
:func:`attnmeta.backends.flash_attn.stage` in the same step.

===============================  ====================================================================
virtual common field             value
===============================  ====================================================================
``query_start_loc`` (+_cpu)      ``[0, cumsum(q_v)]``, staged (``[-1]`` unchanged: the same tokens)
``seq_lens`` (+_cpu)             ``k_v``, staged; ``seq_lens_cpu_upper_bound`` is the same array
``block_table_tensor`` (+_cpu)   the virtual block table (below)
``num_reqs``                     ``V`` (``num_real_reqs``: ``V`` minus one row per padding row)
``max_query_len``                ``max(q_v)``
``max_seq_len``                  ``max(k_v)``
``num_computed_tokens_cpu``      ``k_v - q_v``
``is_prefilling``                the original row's flag, per virtual row (vLLM: None)
``num_decode_draft_tokens_cpu``  None
``causal``                       True
unchanged                        ``num_actual_tokens``, ``num_real_tokens``, ``slot_mapping``,
                                 ``positions`` (the tokens keep their order), ``block_size``
===============================  ====================================================================

The virtual block table
-----------------------
Row ``v`` is ``block_table[req_indices[v], min(block_starts[v] + j, W - 1)]`` for ``j < A / block_size``.
With ``block_table="host"`` (default) it is gathered on the host in compiled code and staged:
``O(V * A / block_size)`` host work. With ``block_table="device"`` only ``req_indices`` and
``block_starts`` (``V`` each) are staged and the gather runs on the device from the staged common block
table when :meth:`Staged.result` is first called (on the current stream), vLLM's ``make_block_table``
without its ``async_tensor_h2d`` uploads. In device mode the virtual common metadata's host twin
``block_table_cpu`` is not computed: it is a read-only broadcast of ``-1`` (an invalid block id, which a
host consumer's validation rejects) with the right shape.

Columns past the staged width are clipped to its last column ``W - 1``, as vLLM clips to the width of
its persistent table; in eager mode attnmeta stages only the columns the batch uses, so a virtual row
whose chunk runs past the staged width repeats the last staged column where vLLM reads the (unused)
columns after it. Kernels never read them (``k_v`` bounds the KV); stage the common metadata with
``block_table_columns=`` (or use graph mode, which stages the profile's full width) for vLLM's exact
values.

Padding rows: one virtual row each, ``q_v = 0``, ``k_v = A`` (as vLLM), block columns from 0
(:mod:`attnmeta.host.local_attn` explains this deliberate deviation from vLLM's wrapped negative
columns).

Graph mode: ``V`` is at most ``max_virtual_reqs(profile, A) = 2 * max_num_reqs + cdiv(max_num_tokens,
A)`` (each request adds at most one partial chunk at each end); every staged field has that capacity
(``query_start_loc`` one more, staged in full with its tail repeating the last value; the rest fill 0).
With ``block_table="device"`` the gather writes into the fixed ``block_table`` buffer when
``Staged.result()`` runs: call it every step before replaying a graph that reads the table.

Replay (:class:`attnmeta.compose.StepBuilder`): a step whose every query is at most one token (a decode
step, padding rows included) has one virtual row per row, ``V = num_reqs``, whatever its lengths; its
layout is keyed on that (:meth:`LocalAttentionBuilder.replay_key`), and a replay rewrites every own
field with the same compiled fill as ``derive`` (:func:`_fill`) and makes the metadata with the same
helpers. A step with a longer query is never replayed: its ``V`` depends on where each request's
queries cross a chunk boundary, which the step's scalars do not tell.

Shape legend
------------
- ``num_reqs``: request rows ``B`` of the step, padding rows included.
- ``num_virtual_reqs``: virtual rows ``V``.
- ``pages_per_local_block``: ``A / block_size``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch

from attnmeta._checks import check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory, template
from attnmeta.backends._shared import alloc_indptr, read_only_view
from attnmeta.builder import Builder, Replayer, register
from attnmeta.host.local_attn import LocalBatches, local_virtual_batches, num_virtual_reqs
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import CapacityError, Staged, Step

__all__ = [
    "LOCAL_ATTN",
    "LocalAttentionBuilder",
    "LocalAttentionHost",
    "LocalAttentionMetadata",
    "LocalAttentionOptions",
    "build",
    "max_virtual_reqs",
    "stage",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalAttentionOptions:
    """Options of the chunked-local-attention builder (validated when constructed)."""

    attn_chunk_size: int = dataclasses.field(metadata=option_rule("int", minimum=1))
    """Local attention chunk ``A``: a positive multiple of the block size."""
    block_table: Literal["host", "device"] = dataclasses.field(
        default="host", metadata=option_rule("choice", choices=("host", "device")))
    """Where the virtual block table is gathered (see the module docstring)."""
    prefix: str = dataclasses.field(default="local_attn", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, slots=True)
class LocalAttentionHost:
    """The host part of a staged local-attention metadata, for builders staged after it."""

    common: StagedCommon
    """The virtual batch as a staged common metadata: stage other backends over it in the same step."""
    local_batches: LocalBatches
    """The host arrays of the virtual batch (:func:`attnmeta.host.local_attn.local_virtual_batches`)."""


def max_virtual_reqs(profile: StaticProfile, attn_chunk_size: int) -> int:
    """Graph-mode capacity of the virtual batch: ``2 * max_num_reqs + cdiv(max_num_tokens, A)``.

    Request ``i`` yields ``1 + cdiv(q_i - first_i, A) <= 2 + q_i // A`` virtual rows, and the ``q_i`` sum
    to at most ``max_num_tokens``.

    Parameters
    ----------
    profile : StaticProfile
        The capture-time capacities.
    attn_chunk_size : int
        Local attention chunk ``A``, > 0.

    Returns
    -------
    int
        The most virtual rows any step within ``profile`` can have.

    Raises
    ------
    ValueError
        ``attn_chunk_size`` is not a positive int.

    Examples
    --------
    >>> from attnmeta import StaticProfile
    >>> max_virtual_reqs(StaticProfile(max_num_reqs=8, max_num_tokens=100, max_blocks_per_req=4, block_size=16), 32)
    20
    """
    if isinstance(attn_chunk_size, bool) or not isinstance(attn_chunk_size, int) or attn_chunk_size <= 0:
        raise ValueError(f"attn_chunk_size: must be a positive int, got {attn_chunk_size!r}")
    return 2 * profile.max_num_reqs + -(-profile.max_num_tokens // attn_chunk_size)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class LocalAttentionMetadata(MetadataBase):
    """The virtual batch of chunked local attention; contains it as common metadata.

    Examples
    --------
    The worked example of docs/semantics-attention.md: ``q = [4, 10, 5]``, ``s = [6, 17, 9]``, ``A = 4``, block size 2, block rows
    ``[10i .. 10i+9]`` (all 10 columns staged, as vLLM's persistent table would be):

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager, stage_common
    >>> spec = BatchSpec(num_computed_tokens=[2, 7, 4], num_scheduled_tokens=[4, 10, 5],
    ...                  block_table=np.arange(30, dtype=np.int32).reshape(3, 10), block_size=2)
    >>> with Stager("cpu").step() as step:
    ...     common = stage_common(spec, step, block_table_columns=10)
    ...     staged = stage(common, step, LocalAttentionOptions(attn_chunk_size=4))
    >>> la = staged.result()
    >>> la.query_start_loc_cpu
    array([ 0,  2,  4,  5,  9, 13, 14, 18, 19], dtype=int32)
    >>> la.seq_lens
    tensor([4, 2, 4, 4, 4, 1, 4, 1], dtype=torch.int32)
    >>> la.block_table_cpu.tolist()
    [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]
    >>> la.num_virtual_reqs, la.common.num_reqs, la.common.max_query_len, la.common.max_seq_len
    (8, 8, 4, 4)
    >>> la.common.num_actual_tokens, la.common.num_computed_tokens_cpu
    (19, array([2, 0, 3, 0, 0, 0, 0, 0], dtype=int32))
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc",
        "seq_lens",
        "block_table",
        "req_indices",
        "block_starts",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc_cpu",
        "seq_lens_cpu",
        "block_table_cpu",
        "req_indices_cpu",
        "block_starts_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_virtual_reqs",
        "attn_chunk_size",
        "pages_per_local_block",
        "block_table_mode",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("query_start_loc", "query_start_loc_cpu"),
        ("seq_lens", "seq_lens_cpu"),
        ("block_table", "block_table_cpu"),
        ("req_indices", "req_indices_cpu"),
        ("block_starts", "block_starts_cpu"),
    )

    common: CommonAttentionMetadata
    """The virtual batch as common metadata (module docstring table)."""
    # ---- device fields
    query_start_loc: torch.Tensor
    """(num_virtual_reqs + 1,) int32, device. ``cu_seqlens_q_local``; ``common.query_start_loc``."""
    seq_lens: torch.Tensor
    """(num_virtual_reqs,) int32, device. ``k_v`` in ``[1, A]``; ``common.seq_lens``."""
    block_table: torch.Tensor
    """(num_virtual_reqs, pages_per_local_block) int32, device. The virtual block table;
    ``common.block_table_tensor``."""
    req_indices: torch.Tensor | None
    """(num_virtual_reqs,) int32, device, with ``block_table="device"`` (else None). Original row of
    each virtual row."""
    block_starts: torch.Tensor | None
    """(num_virtual_reqs,) int32, device, with ``block_table="device"`` (else None). First block-table
    column of each virtual row's chunk."""
    # ---- host fields
    query_start_loc_cpu: np.ndarray
    """(num_virtual_reqs + 1,) int32, host (pinned staged view). Twin of ``query_start_loc``."""
    seq_lens_cpu: np.ndarray
    """(num_virtual_reqs,) int32, host (pinned staged view). Twin of ``seq_lens``."""
    block_table_cpu: np.ndarray | None
    """(num_virtual_reqs, pages_per_local_block) int32, host (pinned staged view); None with
    ``block_table="device"``."""
    req_indices_cpu: np.ndarray
    """(num_virtual_reqs,) int32, host. Original row of each virtual row (staged view in device mode,
    a host-only array in host mode, which a replay on the step's ring slot rewrites: valid as long as the
    staged views)."""
    block_starts_cpu: np.ndarray
    """(num_virtual_reqs,) int32, host. ``max(kstart_v, 0) // block_size`` (staged view in device mode,
    a host-only array in host mode, as ``req_indices_cpu``)."""
    # ---- host scalars
    num_virtual_reqs: int
    """``V``."""
    attn_chunk_size: int
    """``A``."""
    pages_per_local_block: int
    """``A / block_size``."""
    block_table_mode: str
    """``"host"`` or ``"device"``: where the virtual block table was gathered."""


_make_local = keyword_factory(LocalAttentionMetadata)


class _Own(NamedTuple):
    """The writable host views a step of one layout writes its virtual batch into (:func:`_fill`): its own
    staged fields and, with ``block_table="host"``, its host-only row indices and block starts (buffers of
    the step, kept with its ring slot as the staged views are)."""

    query_start_loc: np.ndarray
    """The staged ``query_start_loc`` in full (graph mode: all ``capacity + 1`` entries)."""
    seq_lens: np.ndarray
    """(num_virtual_reqs,), the staged ``seq_lens``."""
    req_indices: np.ndarray
    """(num_virtual_reqs,): staged in device mode, host-only in host mode."""
    block_starts: np.ndarray
    """(num_virtual_reqs,): staged in device mode, host-only in host mode."""
    block_table: np.ndarray | None
    """(num_virtual_reqs, pages_per_local_block), the staged virtual block table (host mode; else None)."""


class _HostViews(NamedTuple):
    """The read-only host views of :class:`_Own` a step's metadata holds (the same memory)."""

    query_start_loc: np.ndarray
    """(num_virtual_reqs + 1,)."""
    seq_lens: np.ndarray
    """(num_virtual_reqs,)."""
    block_table: np.ndarray | None
    """The virtual block table (host mode; else None)."""
    block_table_common: np.ndarray
    """The virtual common metadata's ``block_table_cpu``: ``block_table``, or device mode's read-only
    broadcast of ``-1``."""
    req_indices: np.ndarray
    """(num_virtual_reqs,)."""
    block_starts: np.ndarray
    """(num_virtual_reqs,)."""


class _DeviceViews(NamedTuple):
    """The device views of a committed step's own fields (:func:`_device_views`)."""

    query_start_loc: torch.Tensor
    """(num_virtual_reqs + 1,)."""
    seq_lens: torch.Tensor
    """(num_virtual_reqs,)."""
    block_table: torch.Tensor | None
    """Host mode: the staged virtual block table; device mode: graph mode's fixed buffer the gather
    writes into, or None (eager mode: the gather makes a tensor)."""
    req_indices: torch.Tensor | None
    """Device mode: the staged row indices (else None)."""
    block_starts: torch.Tensor | None
    """Device mode: the staged block starts (else None)."""


def _alloc(step: Step, p: str, V: int, ppl: int, mode: str, cap: int | None) -> _Own:
    """Stage the own fields of a step of ``V`` virtual rows (graph mode: of capacity ``cap``)."""
    qsl_full = alloc_indptr(step, p + "query_start_loc", V, cap)
    k = step.alloc(p + "seq_lens", V, np.int32, fill=0, capacity=cap)
    if mode == "host":
        table = step.alloc(p + "block_table", (V, ppl), np.int32, fill=0, capacity=cap)
        return _Own(qsl_full, k, np.empty(V, np.int32), np.empty(V, np.int32), table)
    req = step.alloc(p + "req_indices", V, np.int32, fill=0, capacity=cap)
    starts = step.alloc(p + "block_starts", V, np.int32, fill=0, capacity=cap)
    if cap is not None:
        step.alloc(p + "block_table", (0, ppl), np.int32, fill=0, capacity=cap)  # the gather's fixed buffer
    return _Own(qsl_full, k, req, starts, None)


def _fill(h: CommonHost, A: int, own: _Own) -> LocalBatches:
    """Write the step's virtual batch into every byte of ``own`` (graph mode's indptr tail included) with
    the compiled :func:`~attnmeta.host.local_attn.local_virtual_batches`: a staged and a replayed step alike."""
    V = own.seq_lens.shape[0]
    qsl = own.query_start_loc
    lb = local_virtual_batches(
        h.query_start_loc_cpu, h.seq_lens_cpu, A, h.block_size, h.block_table_cpu if own.block_table is not None else None,
        query_start_loc_out=qsl[: V + 1], seq_lens_out=own.seq_lens, req_indices_out=own.req_indices,
        block_starts_out=own.block_starts, block_table_out=own.block_table,
    )
    qsl[V + 1 :] = qsl[V]
    return lb


def _host_views(own: _Own, ppl: int) -> _HostViews:
    """The read-only views of ``own`` (made once per layout: a replay writes the same memory)."""
    V = own.seq_lens.shape[0]
    table = None if own.block_table is None else read_only_view(own.block_table)
    return _HostViews(read_only_view(own.query_start_loc[: V + 1]), read_only_view(own.seq_lens), table,
                      table if table is not None else np.broadcast_to(np.int32(-1), (V, ppl)),
                      read_only_view(own.req_indices), read_only_view(own.block_starts))


_PER_STEP = ("num_computed_tokens_cpu", "is_prefilling", "max_query_len", "max_seq_len", "num_real_reqs")
"""The virtual common metadata's fields computed for each step (:func:`_per_step`)."""
_LAYOUT = ("query_start_loc", "seq_lens", "query_start_loc_cpu", "seq_lens_cpu", "seq_lens_cpu_upper_bound",
           "block_table_cpu", "num_decode_draft_tokens_cpu", "num_reqs", "causal")
"""The virtual common metadata's fields a replayed layout keeps (:func:`_changes` and the own fields' views):
the views of the own fields, the rows its key fixes (``num_reqs``) and the constants."""
_FROM_COMMON = tuple(f.name for f in dataclasses.fields(CommonAttentionMetadata)
                     if f.name not in (*_LAYOUT, *_PER_STEP, "block_table_tensor"))
"""The virtual common metadata's fields that are the step's common metadata's (the token arrays, the token
counts, the block size): every field :func:`_virtual_common` does not replace."""
_from_common = operator.attrgetter(*_FROM_COMMON)


def _per_step(h: CommonHost, lb: LocalBatches, views: _HostViews) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """The values of :data:`_PER_STEP` of a step, from its common host part and its virtual batch
    (:func:`_fill`), for a staged and a replayed step alike."""
    nc = (views.seq_lens - np.diff(views.query_start_loc)).astype(np.int32)
    prefilling = h.is_prefilling[lb.req_indices]
    nc.flags.writeable = False
    prefilling.flags.writeable = False
    return nc, prefilling, lb.max_query_len, lb.max_seq_len, lb.num_virtual_reqs - (h.num_reqs - h.num_real_reqs)


def _changes(views: _HostViews, per_step: tuple[Any, ...]) -> dict[str, Any]:
    """The virtual common metadata's host fields and scalars (module docstring table): the layout's and a
    step's :func:`_per_step` values."""
    changes: dict[str, Any] = {
        "query_start_loc_cpu": views.query_start_loc,
        "seq_lens_cpu": views.seq_lens,
        "seq_lens_cpu_upper_bound": views.seq_lens,
        "block_table_cpu": views.block_table_common,
        "num_decode_draft_tokens_cpu": None,
        "num_reqs": views.seq_lens.shape[0],
        "causal": True,
    }
    changes.update(zip(_PER_STEP, per_step, strict=True))
    return changes


def _device_views(step: Step, p: str, V: int, mode: str, graph: bool) -> _DeviceViews:
    """The device views of a committed step's own fields (of prefix ``p``)."""
    qsl = step.device(p + "query_start_loc")[: V + 1]
    k = step.device(p + "seq_lens")
    if mode == "host":
        return _DeviceViews(qsl, k, step.device(p + "block_table"), None, None)
    fixed = step.device_full(p + "block_table") if graph else None
    return _DeviceViews(qsl, k, fixed, step.device(p + "req_indices"), step.device(p + "block_starts"))


def _gather_rows(
    block_table: torch.Tensor, req: torch.Tensor, starts: torch.Tensor, ppl: int, out: torch.Tensor | None
) -> torch.Tensor:
    """The virtual block table gathered on the device (no sync: every shape is known on the host)."""
    dev = block_table.device
    v = req.shape[0]
    cols = starts.to(torch.int64)[:, None] + torch.arange(ppl, dtype=torch.int64, device=dev)[None, :]
    cols.clamp_(max=block_table.shape[1] - 1)
    values = block_table[req.to(torch.int64)[:, None], cols]
    if out is None:
        return values
    out[:v].copy_(values)
    out[v:].fill_(0)
    return out[:v]


def _table(cm: CommonAttentionMetadata, dv: _DeviceViews, ppl: int) -> torch.Tensor:
    """The step's virtual block table on the device, after the commit: the staged one (host mode), or
    gathered from the step's common block table here, on the current stream (device mode)."""
    if dv.req_indices is None:
        assert dv.block_table is not None
        return dv.block_table
    assert dv.block_starts is not None
    return _gather_rows(cm.block_table_tensor, dv.req_indices, dv.block_starts, ppl, dv.block_table)


def _virtual_common(cm: CommonAttentionMetadata, dv: _DeviceViews, changes: dict[str, Any],
                    ppl: int) -> CommonAttentionMetadata:
    """The step's virtual batch as common metadata, after the commit, from the step's common metadata,
    its own fields' device views and :func:`_changes`."""
    return cm.replace(query_start_loc=dv.query_start_loc, seq_lens=dv.seq_lens, block_table_tensor=_table(cm, dv, ppl),
                      **changes)


def _metadata(cm: CommonAttentionMetadata, dv: _DeviceViews, views: _HostViews, opts: LocalAttentionOptions,
              ppl: int) -> LocalAttentionMetadata:
    """The step's metadata from its virtual common metadata (:func:`_virtual_common`) and its own fields' views."""
    return _make_local(
        common=cm, query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
        req_indices=dv.req_indices, block_starts=dv.block_starts, query_start_loc_cpu=views.query_start_loc,
        seq_lens_cpu=views.seq_lens, block_table_cpu=views.block_table, req_indices_cpu=views.req_indices,
        block_starts_cpu=views.block_starts, num_virtual_reqs=cm.num_reqs, attn_chunk_size=opts.attn_chunk_size,
        pages_per_local_block=ppl, block_table_mode=opts.block_table,
    )


class LocalAttentionBuilder(Builder[LocalAttentionOptions, None, LocalAttentionHost, LocalAttentionMetadata]):
    """The chunked-local-attention builder (:data:`LOCAL_ATTN`).

    Examples
    --------
    One query at a chunk start sees one KV token (vllm issue #21694); a padding row gets one empty
    virtual row; the table is gathered on the device:

    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[4], num_scheduled_tokens=[1], block_table=[[7, 8, 9]],
    ...                  block_size=2, num_reqs_padded=2)
    >>> la = build(spec, Stager("cpu"), LocalAttentionOptions(attn_chunk_size=4, block_table="device"))
    >>> la.seq_lens_cpu, la.query_start_loc_cpu, la.block_starts_cpu
    (array([1, 4], dtype=int32), array([0, 1, 1], dtype=int32), array([2, 0], dtype=int32))
    >>> la.block_table
    tensor([[9, 9],
            [0, 0]], dtype=torch.int32)
    """

    name = "local_attn"
    options_type = LocalAttentionOptions
    metadata_type = LocalAttentionMetadata

    def options(self, options: LocalAttentionOptions | None) -> LocalAttentionOptions:
        """``options``; there are no defaults (the chunk size is the model's)."""
        if options is None:
            raise TypeError("local_attn: options are required: LocalAttentionOptions(attn_chunk_size=...)")
        return super().options(options)

    def derive(
        self, common: StagedCommon, step: Step, options: LocalAttentionOptions, inputs: None
    ) -> Staged[LocalAttentionHost, LocalAttentionMetadata]:
        """Derive the chunked-local-attention virtual batch from the staged common metadata.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : LocalAttentionOptions
            Chunk size, where to gather the virtual block table, field namespace (required).
        inputs : None
            The builder takes no per-step inputs.

        Returns
        -------
        Staged[LocalAttentionHost, LocalAttentionMetadata]
            ``.result()`` after the commit (with ``block_table="device"`` it enqueues the gather on the
            current stream the first time). ``.host.common`` is the staged virtual common metadata, to
            stage other backends over it in the same step.

        Raises
        ------
        ValueError
            ``attn_chunk_size`` not a multiple of the block size.
        attnmeta.staging.CapacityError
            Graph mode: more virtual rows than :func:`max_virtual_reqs` (cannot happen within the profile).
        """
        opts = options
        h = common.host
        A, bs = opts.attn_chunk_size, h.block_size
        if A % bs:
            raise ValueError(f"LocalAttentionOptions.attn_chunk_size: must be a positive multiple of block_size={bs}, got {A!r}")
        p = opts.prefix + "."
        prof = step.profile
        V = num_virtual_reqs(h.query_start_loc_cpu, h.seq_lens_cpu, A)
        cap = max_virtual_reqs(prof, A) if prof is not None else None
        if cap is not None and cap < V:
            raise CapacityError(f"{p}: {V} virtual rows exceed the graph-mode capacity {cap}")
        ppl = A // bs
        own = _alloc(step, p, V, ppl, opts.block_table, cap)
        lb = _fill(h, A, own)
        views = _host_views(own, ppl)
        changes = _changes(views, _per_step(h, lb, views))
        local_host = dataclasses.replace(h, **changes, num_pages=-(-int(own.seq_lens.sum()) // bs) if V else 0,
                                         max_exact_seq_len=lb.max_seq_len, splits={})
        lb = lb._replace(query_start_loc=views.query_start_loc, seq_lens=views.seq_lens,
                         seq_lens_upper_bound=views.seq_lens, req_indices=views.req_indices,
                         block_starts=views.block_starts, block_table=views.block_table)
        graph = cap is not None

        def make_common() -> CommonAttentionMetadata:
            return _virtual_common(common.result(), _device_views(step, p, V, opts.block_table, graph), changes, ppl)

        local_common = StagedCommon(step, local_host, make_common)

        def make() -> LocalAttentionMetadata:
            cm = local_common.result()
            return _metadata(cm, _device_views(step, p, V, opts.block_table, graph), views, opts, ppl)

        return _Staged(step, LocalAttentionHost(local_common, lb), make, own, views)

    def unsupported_reasons(self, spec: BatchSpec, options: LocalAttentionOptions, inputs: None) -> list[str]:
        """A chunk size that is not a multiple of the block size; a context-parallel spec."""
        reasons = []
        if options.attn_chunk_size % spec.block_size:
            reasons.append(f"attn_chunk_size={options.attn_chunk_size} is not a multiple of block_size={spec.block_size}")
        if spec.context_parallel is not None:
            reasons.append("a context-parallel spec: the local-attention virtual batch indexes blocks of block_size "
                           "tokens, not the block_size * world_size of a context-parallel table")
        return reasons

    def replay_key(self, shape: StepShape, options: LocalAttentionOptions, inputs: None) -> Hashable | None:
        """Steps whose every query is at most one token (decode steps, padding rows included): one virtual
        row per row, so the own fields have ``num_reqs`` rows whatever the lengths. Else None: a longer
        query's virtual rows depend on where it crosses a chunk boundary (its context length), which the
        step's scalars do not tell."""
        if shape.max_query_len > 1:
            return None
        return "decode", shape.padded_num_reqs

    def reads_lengths(self, options: LocalAttentionOptions) -> bool:
        """False: neither :meth:`needs` (the default) nor :meth:`replay_key` reads the step's lengths."""
        return False

    def replayer(self, staged: Staged[LocalAttentionHost, LocalAttentionMetadata], common: StagedCommon, step: Step,
                 options: LocalAttentionOptions, inputs: None) -> _Replayer:
        """Replays rewrite the recorded step's own fields with :func:`_fill` and make the metadata with
        :func:`_virtual_common` and the recorded step's views."""
        assert isinstance(staged, _Staged)
        m = staged.result()
        p = options.prefix + "."
        return _Replayer(m, options, staged.own, staged.views,
                         _device_views(step, p, m.num_virtual_reqs, options.block_table, step.profile is not None))


class _Staged(Staged[LocalAttentionHost, LocalAttentionMetadata]):
    """A staged local-attention step: its host part, and its own fields' writable and read-only host views
    (for a replayer of its layout)."""

    __slots__ = ("own", "views")

    def __init__(self, step: Step, host: LocalAttentionHost, make: Callable[[], LocalAttentionMetadata], own: _Own,
                 views: _HostViews) -> None:
        super().__init__(step, host, make)
        self.own, self.views = own, views


class _Replayer(Replayer[None, LocalAttentionMetadata]):
    """Replays of a decode layout: :func:`_fill` into the recorded step's own fields (the slot's memory, at
    the same places), then the recorded virtual common metadata with this step's :data:`_PER_STEP` values,
    device block table (:func:`_table`) and :data:`_FROM_COMMON` fields, and the recorded metadata with it
    (the rest are views of the own fields, which a replay stages at the same places of the same slot)."""

    __slots__ = ("dv", "filled", "make", "make_common", "options", "own", "ppl", "views")

    def __init__(self, recorded: LocalAttentionMetadata, options: LocalAttentionOptions, own: _Own, views: _HostViews,
                 dv: _DeviceViews) -> None:
        self.options, self.own, self.views, self.dv = options, own, views, dv
        self.ppl = recorded.pages_per_local_block
        self.make_common = template(recorded.common, (*_PER_STEP, "block_table_tensor", *_FROM_COMMON))
        self.make = template(recorded, ("common", "block_table"))
        self.filled: tuple[Step, LocalBatches] | None = None

    def rewrite(self, step: Step, host: CommonHost, inputs: None) -> None:
        self.filled = None  # (until the fill succeeds)
        self.filled = (step, _fill(host, self.options.attn_chunk_size, self.own))

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: None) -> LocalAttentionMetadata:
        f, self.filled = self.filled, None
        assert f is not None and f[0] is step, "result() without this step's rewrite()"
        table = _table(common, self.dv, self.ppl)
        cm = self.make_common(*_per_step(host, f[1], self.views), table, *_from_common(common))
        return self.make(cm, table)


LOCAL_ATTN = register(LocalAttentionBuilder())
"""The registered chunked-local-attention builder."""
stage = LOCAL_ATTN.stage
build = LOCAL_ATTN.build
