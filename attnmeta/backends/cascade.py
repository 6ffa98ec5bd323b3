"""Cascade (shared-prefix) attention metadata (docs/semantics-attention.md), derived on the host.

When every request of a step shares a cached prefix of ``L`` tokens, cascade attention runs one
non-causal pass of *all* query tokens over the shared prefix (a batch of one) and one causal pass of
each request over its own suffix, merged by log-sum-exp. vLLM removed it by 0.33.0 (it hung on Blackwell
with prefix caching, vllm#26130); before that, its builders made the prefix arrays with blocking
``torch.tensor(list, device=...)`` uploads and, in some versions, ``seq_lens.cpu()``. Every input is
host data, so attnmeta decides and derives on the host and stages the arrays with the step's one copy.

The decision (:func:`attnmeta.host.cascade.cascade_prefix_len`, then
:func:`attnmeta.host.cascade.use_cascade_attention` over the real requests): ``L`` is the shared blocks
(the step's :class:`CascadeInputs`, ``num_common_prefix_blocks``) capped at the smallest ``num_computed_tokens`` and rounded down to a block; cascade runs if ``L >= 256``,
at least 8 requests, no ALiBi / sliding window / local attention / DCP, and (for flash-decoding batches)
the cost model prefers it. A step with CUDA-graph padding rows never cascades (vLLM turns full graphs
off for cascade steps).

When it runs, the metadata holds

- FlashAttention's arrays: ``cu_prefix_query_lens = [0, num_actual_tokens]``, ``prefix_kv_lens = [L]``,
  ``suffix_kv_lens = seq_lens - L``, and ``suffix_block_table = block_table[:, L / block_size:]`` (a
  view: the suffix pass reads the blocks after the prefix);
- FlashInfer's shared level: ``qo_indptr = cu_prefix_query_lens``, ``shared_kv_page_indptr = [0, L /
  block_size]``, ``shared_kv_page_indices = block_table[0, :L / block_size]``,
  ``shared_kv_last_page_len = [block_size]``; and its per-request level, the paged layout of
  ``suffix_kv_lens`` over ``suffix_block_table`` (``suffix_paged_kv_*``; its ``qo_indptr`` is the common
  ``query_start_loc``).

Otherwise every array field is None and ``common_prefix_len`` is 0.

Graph mode: capacities 2 / 1 for the fixed-size arrays, ``max_num_reqs`` for ``suffix_kv_lens`` and
``suffix_paged_kv_last_page_len``, ``max_num_reqs + 1`` for ``suffix_paged_kv_indptr`` (staged in full,
its tail repeating the last value), ``max_blocks_per_req`` for the shared indices and
``profile.max_num_pages`` for the suffix indices (tails 0).

Replay (:class:`attnmeta.compose.StepBuilder`): a step that cannot cascade whatever its rows hold (the
scalars rule it out: CUDA-graph padding rows, fewer than 8 requests, an offered prefix
``num_common_prefix_blocks * block_size`` under 256 tokens, ALiBi, a sliding window, local attention,
DCP; :func:`_ruled_out`) stages nothing and replays (:meth:`CascadeBuilder.replay_key`); a replay runs the
derive's decision (:func:`_decide`) for its checks and makes the metadata of a step without cascade. A
step that may cascade is never replayed: its prefix ``L`` is capped at the smallest
``num_computed_tokens`` (per-row data), which sets the shared page indices' rows and, with grouped-query
heads, the cost model's vote, and its suffix page indices have a row per suffix page (every row's length).

Shape legend
------------
- ``num_reqs``: request rows ``B`` (no padding rows when cascade runs).
- ``num_prefix_blocks``: ``common_prefix_len // block_size``.
- ``max_blocks``: columns of the common block table.
- ``num_suffix_pages``: ``suffix_paged_kv_indptr[-1]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar

import numpy as np
import torch

from attnmeta._checks import check_option_fields, option_rule
from attnmeta._fields import MetadataBase, template
from attnmeta.backends._shared import alloc_indptr
from attnmeta.builder import Builder, Replayer, register
from attnmeta.host.cascade import (
    CASCADE_MIN_PREFIX,
    CASCADE_MIN_REQS,
    cascade_arrays,
    cascade_prefix_len,
    use_cascade_attention,
)
from attnmeta.host.paged import num_pages, paged_kv_layout
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import StepShape
from attnmeta.staging import Staged, Step

__all__ = [
    "CASCADE",
    "CascadeBuilder",
    "CascadeHost",
    "CascadeInputs",
    "CascadeMetadata",
    "CascadeOptions",
    "build",
    "stage",
]


@dataclasses.dataclass(frozen=True, slots=True)
class CascadeOptions:
    """The model and device facts the cascade decision needs (validated when constructed)."""

    num_query_heads: int = dataclasses.field(metadata=option_rule("int", minimum=1))
    """Query heads of this rank."""
    num_kv_heads: int = dataclasses.field(metadata=option_rule("int", minimum=1))
    """KV heads of this rank."""
    num_sms: int = dataclasses.field(metadata=option_rule("int", minimum=1))
    """Streaming multiprocessors of the device (the cost model's wave size)."""
    use_alibi: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """ALiBi rules cascade out."""
    use_sliding_window: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """Sliding-window attention rules cascade out."""
    use_local_attention: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """Chunked local attention rules cascade out."""
    dcp_world_size: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Decode context parallelism (> 1) rules cascade out."""
    prefix: str = dataclasses.field(default="cascade", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, slots=True)
class CascadeHost:
    """The host part of a staged cascade metadata: the step's decision, for builders staged after it
    (a FlashAttention or FlashInfer wrapper choosing its cascade path)."""

    use_cascade: bool
    """Whether the step runs cascade attention."""
    common_prefix_len: int
    """The shared prefix in tokens when it does, else 0."""


_ARRAYS = (
    "cu_prefix_query_lens",
    "prefix_kv_lens",
    "suffix_kv_lens",
    "shared_kv_page_indptr",
    "shared_kv_page_indices",
    "shared_kv_last_page_len",
    "suffix_paged_kv_indptr",
    "suffix_paged_kv_indices",
    "suffix_paged_kv_last_page_len",
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class CascadeMetadata(MetadataBase):
    """Cascade-attention metadata of one step; contains the step's common metadata.

    Every array field is None when ``use_cascade`` is False.

    Examples
    --------
    Eight decodes sharing 2 blocks of 128 tokens (each has at least 300 cached tokens):

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> table = np.array([[3, 4, 10 + i, 20 + i] for i in range(8)], np.int32)
    >>> spec = BatchSpec(num_computed_tokens=[300, 310, 320, 330, 340, 350, 360, 370],
    ...                  num_scheduled_tokens=[1] * 8, block_table=table, block_size=128)
    >>> ca = build(spec, Stager("cpu"), CascadeOptions(num_query_heads=8, num_kv_heads=8, num_sms=132),
    ...            CascadeInputs(num_common_prefix_blocks=2))
    >>> ca.use_cascade, ca.common_prefix_len, ca.num_prefix_blocks
    (True, 256, 2)
    >>> ca.cu_prefix_query_lens_cpu, ca.prefix_kv_lens_cpu, ca.suffix_kv_lens
    (array([0, 8], dtype=int32), array([256], dtype=int32), tensor([ 45,  55,  65,  75,  85,  95, 105, 115], dtype=torch.int32))
    >>> ca.shared_kv_page_indices_cpu, ca.suffix_paged_kv_indptr_cpu
    (array([3, 4], dtype=int32), array([0, 1, 2, 3, 4, 5, 6, 7, 8], dtype=int32))
    >>> ca.suffix_paged_kv_indices_cpu, ca.suffix_block_table.shape
    (array([10, 11, 12, 13, 14, 15, 16, 17], dtype=int32), torch.Size([8, 1]))
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (*_ARRAYS, "suffix_block_table")
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (*(n + "_cpu" for n in _ARRAYS), "suffix_block_table_cpu")
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ("use_cascade", "common_prefix_len", "num_prefix_blocks")
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = tuple((n, n + "_cpu") for n in (*_ARRAYS, "suffix_block_table"))

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    # ---- device fields (None without cascade)
    cu_prefix_query_lens: torch.Tensor | None
    """(2,) int32, device. ``[0, num_actual_tokens]``: every query token as one request of the prefix
    pass; also FlashInfer's shared-level ``qo_indptr``."""
    prefix_kv_lens: torch.Tensor | None
    """(1,) int32, device. ``[common_prefix_len]``."""
    suffix_kv_lens: torch.Tensor | None
    """(num_reqs,) int32, device. ``seq_lens - common_prefix_len``."""
    shared_kv_page_indptr: torch.Tensor | None
    """(2,) int32, device. FlashInfer shared level: ``[0, num_prefix_blocks]``."""
    shared_kv_page_indices: torch.Tensor | None
    """(num_prefix_blocks,) int32, device. ``block_table[0, :num_prefix_blocks]`` (the same blocks in
    every row)."""
    shared_kv_last_page_len: torch.Tensor | None
    """(1,) int32, device. ``[block_size]`` (the prefix is whole blocks)."""
    suffix_paged_kv_indptr: torch.Tensor | None
    """(num_reqs + 1,) int32, device. FlashInfer per-request level: ``[0, cumsum(cdiv(suffix_kv_lens,
    block_size))]``."""
    suffix_paged_kv_indices: torch.Tensor | None
    """(num_suffix_pages,) int32, device. Row ``i``'s suffix pages: ``suffix_block_table[i, :n_i]``."""
    suffix_paged_kv_last_page_len: torch.Tensor | None
    """(num_reqs,) int32, device. Tokens in each row's last suffix page (0 for an empty suffix)."""
    suffix_block_table: torch.Tensor | None
    """(num_reqs, max_blocks - num_prefix_blocks) int32, device. A view of the common
    ``block_table_tensor`` from column ``num_prefix_blocks`` on (FlashAttention's suffix pass)."""
    # ---- host twins (None without cascade)
    cu_prefix_query_lens_cpu: np.ndarray | None
    """(2,) int32, host (pinned staged view)."""
    prefix_kv_lens_cpu: np.ndarray | None
    """(1,) int32, host (pinned staged view)."""
    suffix_kv_lens_cpu: np.ndarray | None
    """(num_reqs,) int32, host (pinned staged view)."""
    shared_kv_page_indptr_cpu: np.ndarray | None
    """(2,) int32, host (pinned staged view)."""
    shared_kv_page_indices_cpu: np.ndarray | None
    """(num_prefix_blocks,) int32, host (pinned staged view)."""
    shared_kv_last_page_len_cpu: np.ndarray | None
    """(1,) int32, host (pinned staged view)."""
    suffix_paged_kv_indptr_cpu: np.ndarray | None
    """(num_reqs + 1,) int32, host (pinned staged view)."""
    suffix_paged_kv_indices_cpu: np.ndarray | None
    """(num_suffix_pages,) int32, host (pinned staged view)."""
    suffix_paged_kv_last_page_len_cpu: np.ndarray | None
    """(num_reqs,) int32, host (pinned staged view)."""
    suffix_block_table_cpu: np.ndarray | None
    """(num_reqs, max_blocks - num_prefix_blocks) int32, host. View of the common ``block_table_cpu``."""
    # ---- host scalars
    use_cascade: bool
    """The decision."""
    common_prefix_len: int
    """``L`` in tokens when cascading, else 0."""
    num_prefix_blocks: int
    """``common_prefix_len // block_size``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CascadeInputs:
    """Per-step inputs of the cascade builder.

    Examples
    --------
    >>> CascadeInputs(num_common_prefix_blocks=2).num_common_prefix_blocks
    2
    """

    num_common_prefix_blocks: int = 0
    """KV blocks every running request shares (from the KV-cache manager), >= 0. The prefix the step
    uses (capped at the smallest context, in whole blocks) must be the same block ids in every real
    request's row."""


class CascadeBuilder(Builder[CascadeOptions, CascadeInputs, CascadeHost, CascadeMetadata]):
    """The cascade-attention builder (:data:`CASCADE`).

    Examples
    --------
    Fewer than 8 requests never cascade:

    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[300, 400], num_scheduled_tokens=[1, 1],
    ...                  block_table=[[3, 4, 5, 6], [3, 4, 7, 8]], block_size=128)
    >>> ca = build(spec, Stager("cpu"), CascadeOptions(num_query_heads=8, num_kv_heads=8, num_sms=132),
    ...            CascadeInputs(num_common_prefix_blocks=2))
    >>> ca.use_cascade, ca.common_prefix_len, ca.suffix_kv_lens
    (False, 0, None)
    """

    name = "cascade"
    options_type = CascadeOptions
    inputs_type = CascadeInputs
    metadata_type = CascadeMetadata

    def options(self, options: CascadeOptions | None) -> CascadeOptions:
        """``options``; there are no defaults (heads and SMs are the model's and the device's)."""
        if options is None:
            raise TypeError("cascade: options are required: CascadeOptions(num_query_heads=..., num_kv_heads=..., "
                            "num_sms=...)")
        return super().options(options)

    def derive(self, common: StagedCommon, step: Step, options: CascadeOptions,
               inputs: CascadeInputs) -> Staged[CascadeHost, CascadeMetadata]:
        """Decide on cascade attention for the step and stage its arrays into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : CascadeOptions
            Heads, SM count, model features that rule cascade out (required).
        inputs : CascadeInputs
            The blocks every running request shares (default 0).

        Returns
        -------
        Staged[CascadeHost, CascadeMetadata]
            ``.host`` is the decision; ``.result()`` after the commit.

        Raises
        ------
        TypeError
            A block count that is not an int.
        ValueError
            A negative block count, or a request whose prefix blocks differ from row 0's (naming the row
            and column).
        attnmeta.staging.CapacityError
            Graph mode: a capacity of the profile is exceeded.
        """
        return _stage(common, step, options, inputs.num_common_prefix_blocks)

    def replay_key(self, shape: StepShape, options: CascadeOptions, inputs: CascadeInputs) -> Hashable | None:
        """``"off"`` for a step the scalars rule cascade out of (:func:`_ruled_out`: padding rows, fewer
        than 8 requests, an offered prefix under 256 tokens, a model feature or DCP), which stages nothing.
        Else None: whether the step cascades, and the rows of its prefix and suffix fields, depend on the
        smallest context and every row's length (module docstring). A block count that is not an int >= 0
        gives None too (the staged step raises)."""
        blocks = inputs.num_common_prefix_blocks
        if isinstance(blocks, bool) or not isinstance(blocks, int | np.integer) or blocks < 0:
            return None
        if _ruled_out(shape.num_reqs, shape.padded_num_reqs, int(blocks) * shape.block_size, options):
            return "off"
        return None

    def reads_lengths(self, options: CascadeOptions) -> bool:
        """False: neither :meth:`needs` (the default) nor :meth:`replay_key` reads the step's lengths."""
        return False

    def replayer(self, staged: Staged[CascadeHost, CascadeMetadata], common: StagedCommon, step: Step,
                 options: CascadeOptions, inputs: CascadeInputs) -> _Replayer | None:
        """Replays of a step without cascade (the only steps :meth:`replay_key` names); None for a step that
        cascaded (its key did not promise this layout)."""
        m = staged.result()
        if m.use_cascade:
            return None
        return _Replayer(m, options)


def _ruled_out(num_real_reqs: int, num_reqs: int, offered_len: int, options: CascadeOptions) -> bool:
    """Whether a step cannot cascade whatever its rows hold: padding rows (``num_real_reqs != num_reqs``,
    vLLM turns full graphs off for cascade steps), fewer than 8 requests, an offered prefix
    (``num_common_prefix_blocks * block_size``, which bounds ``L``) under 256 tokens, ALiBi, a sliding
    window, local attention, DCP: the tests of :func:`~attnmeta.host.cascade.use_cascade_attention` that
    read scalars only. One function for the staged step's decision (:func:`_decide`) and the replay key."""
    return (num_real_reqs != num_reqs or num_real_reqs < CASCADE_MIN_REQS or offered_len < CASCADE_MIN_PREFIX
            or options.use_alibi or options.use_sliding_window or options.use_local_attention
            or options.dcp_world_size > 1)


def _decide(h: CommonHost, options: CascadeOptions, num_common_prefix_blocks: int) -> int:
    """The step's ``common_prefix_len`` when it cascades, else 0: the runner's prefix rule and its checks
    (:func:`~attnmeta.host.cascade.cascade_prefix_len`: the block count, the rows' shared prefix columns),
    then the vote (:func:`_ruled_out`, then :func:`~attnmeta.host.cascade.use_cascade_attention`). A staged
    and a replayed step alike.

    Raises
    ------
    TypeError, ValueError
        As :func:`~attnmeta.host.cascade.cascade_prefix_len`.
    """
    if type(num_common_prefix_blocks) is int and num_common_prefix_blocks == 0:
        return 0  # (no prefix offered, the common case: nothing to check or vote on)
    B, B_real, bs = h.num_reqs, h.num_real_reqs, h.block_size
    length = cascade_prefix_len(num_common_prefix_blocks, bs, h.num_computed_tokens_cpu[:B_real],
                                block_table=h.block_table_cpu)
    if _ruled_out(B_real, B, int(num_common_prefix_blocks) * bs, options):
        return 0
    use = use_cascade_attention(
        common_prefix_len=length,
        query_lens=np.diff(h.query_start_loc_cpu[: B_real + 1]).astype(np.int32),
        num_query_heads=options.num_query_heads,
        num_kv_heads=options.num_kv_heads,
        use_alibi=options.use_alibi,
        use_sliding_window=options.use_sliding_window,
        use_local_attention=options.use_local_attention,
        num_sms=options.num_sms,
        dcp_world_size=options.dcp_world_size,
    )
    return length if use else 0


_NONE_FIELDS = tuple(n + s for n in (*_ARRAYS, "suffix_block_table") for s in ("", "_cpu"))
"""Every array field of :class:`CascadeMetadata` (None without cascade)."""


def _off_metadata(cm: CommonAttentionMetadata) -> CascadeMetadata:
    """The metadata of a step without cascade: ``cm``, every array None."""
    return CascadeMetadata(common=cm, use_cascade=False, common_prefix_len=0, num_prefix_blocks=0,
                           **dict.fromkeys(_NONE_FIELDS))


def _stage(common: StagedCommon, step: Step, options: CascadeOptions,
           num_common_prefix_blocks: int) -> Staged[CascadeHost, CascadeMetadata]:
    """Decide (:func:`_decide`) and, when the step cascades, stage its arrays (:func:`_stage_arrays`)."""
    length = _decide(common.host, options, num_common_prefix_blocks)
    if not length:
        return Staged(step, CascadeHost(False, 0), lambda: _off_metadata(common.result()))
    return _stage_arrays(common, step, options, length)


def _stage_arrays(common: StagedCommon, step: Step, options: CascadeOptions,
                  length: int) -> Staged[CascadeHost, CascadeMetadata]:
    """Stage the arrays of a step that cascades with a prefix of ``length`` tokens."""
    h = common.host
    B, bs = h.num_reqs, h.block_size
    sl, bt = h.seq_lens_cpu, h.block_table_cpu
    p = options.prefix + "."
    prof = step.profile
    if prof is not None:  # (the group's block size's: StaticProfile.for_block_size)
        prof = prof.for_block_size(bs)
    graph = prof is not None
    arrays = cascade_arrays(length, sl, h.num_actual_tokens, bs, block_table=bt)
    nb = arrays.num_prefix_blocks
    staged: dict[str, np.ndarray] = {}

    def put(name: str, values: np.ndarray, capacity: int) -> None:
        """Stage ``values`` as the int32 field ``name`` (graph mode: of ``capacity`` rows, tail 0)."""
        kw: dict[str, Any] = {"capacity": capacity, "fill": 0} if graph else {}
        staged[name] = step.stage(p + name, values, np.int32, **kw)

    put("cu_prefix_query_lens", arrays.cu_prefix_query_lens, 2)
    put("prefix_kv_lens", arrays.prefix_kv_lens, 1)
    put("shared_kv_page_indptr", arrays.shared_kv_page_indptr, 2)
    put("shared_kv_last_page_len", arrays.shared_kv_last_page_len, 1)
    assert arrays.shared_kv_page_indices is not None
    put("shared_kv_page_indices", arrays.shared_kv_page_indices, prof.max_blocks_per_req if prof else 0)
    put("suffix_kv_lens", arrays.suffix_kv_lens, prof.max_num_reqs if prof else 0)
    suffix = staged["suffix_kv_lens"]

    suffix_table = bt[:, nb:]
    req_cap = prof.max_num_reqs if prof is not None else None
    indptr_full = alloc_indptr(step, p + "suffix_paged_kv_indptr", B, req_cap)
    kw_r: dict[str, Any] = {"capacity": req_cap, "fill": 0} if graph else {}
    kw_p: dict[str, Any] = {"capacity": prof.max_num_pages, "fill": 0} if prof is not None else {}
    last = step.alloc(p + "suffix_paged_kv_last_page_len", B, np.int32, **kw_r)
    indices = step.alloc(p + "suffix_paged_kv_indices", num_pages(suffix, bs), np.int32, **kw_p)
    paged_kv_layout(suffix, suffix_table, bs, indptr_out=indptr_full[: B + 1], indices_out=indices,
                    last_page_len_out=last)
    indptr_full[B + 1 :] = indptr_full[B]
    staged["suffix_paged_kv_last_page_len"] = last
    staged["suffix_paged_kv_indices"] = indices
    staged["suffix_paged_kv_indptr"] = indptr_full[: B + 1]

    def make() -> CascadeMetadata:
        """The metadata, after the commit."""
        cm = common.result()
        fields: dict[str, Any] = {n: step.device(p + n)[: v.shape[0]] for n, v in staged.items()}
        fields.update({n + "_cpu": v for n, v in staged.items()})
        for v in staged.values():
            v.flags.writeable = False
        indptr_full.flags.writeable = False
        return CascadeMetadata(
            common=cm,
            suffix_block_table=cm.block_table_tensor[:, nb:],
            suffix_block_table_cpu=cm.block_table_cpu[:, nb:],
            use_cascade=True,
            common_prefix_len=length,
            num_prefix_blocks=nb,
            **fields,
        )

    return Staged(step, CascadeHost(True, length), make)


class _Replayer(Replayer[CascadeInputs, CascadeMetadata]):
    """Replays of a step without cascade (:meth:`CascadeBuilder.replay_key` ``"off"``): no own fields; the
    metadata is the recorded one with this step's common metadata."""

    __slots__ = ("make", "options")

    def __init__(self, recorded: CascadeMetadata, options: CascadeOptions) -> None:
        self.options = options
        self.make = template(recorded, ("common",))

    def rewrite(self, step: Step, host: CommonHost, inputs: CascadeInputs) -> None:
        """No own fields to write: the step's decision (:func:`_decide`) runs for its checks, raising what a
        staged step raises (a block count that is not an int >= 0, rows whose prefix columns differ). The
        key's :func:`_ruled_out` is the decision's first test, so it returns 0 here."""
        _decide(host, self.options, inputs.num_common_prefix_blocks)

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: CascadeInputs) -> CascadeMetadata:
        """The recorded metadata (every array None) with this step's common metadata."""
        return self.make(common)


CASCADE = register(CascadeBuilder())
"""The registered cascade builder."""
stage = CASCADE.stage
build = CASCADE.build
