"""``CommonAttentionMetadata``: the per-step metadata every attention-like layer shares.

Field names, dtypes, shapes and semantics follow vLLM 0.33.0's ``CommonAttentionMetadata``
(docs/semantics.md), but this is not vLLM's class: a vLLM backend takes it through
:func:`attnmeta.integrations.vllm.to_vllm_common`, which builds vLLM's own object from it (device
views as they are, host twins as CPU tensors sharing the pinned memory; docs/vllm.md lists the vLLM
fields attnmeta does not derive, and why). Differences, all deliberate:

- every device field has its numpy host twin (``<name>_cpu``), filled on the host first and copied to
  the device in the step's one H2D copy; nothing is ever copied back;
- there are no memo caches: ``replace()`` can never carry a stale derived value, and changing a device
  field without its host twin (or the reverse) is an error;
- ``block_table_tensor`` has ``max_blocks`` columns: in eager mode the most blocks any request uses
  (columns past a request's own blocks are never read by kernels), in graph mode the profile's
  ``max_blocks_per_req``; vLLM stages its full persistent width;
- ``seq_lens_cpu`` (exact, from the host) exists; vLLM removed it because its host could not know
  exact lengths under async spec decode, where attnmeta's caller passes the optimistic lengths as
  ``BatchSpec.seq_lens_upper_bound`` (see docs/serving.md).

Build one with :func:`attnmeta.build_common` (its own step) or :func:`attnmeta.stage_common` (into a
step shared with backend builders, so everything moves in the same single copy); both live in
:mod:`attnmeta.common`, the common metadata's host pass.

The staged form
---------------
:func:`~attnmeta.stage_common` returns a :class:`StagedCommon`: the step's :class:`CommonHost` (the
host twins and scalars, and the step's decode/prefill splits) for the builders staged after it,
and optionally the paged-KV layout of the step (:class:`PagedKVMetadata`, FlashInfer's page-table
format) that the compiled pass built alongside.

Shape legend
------------
- ``num_reqs``: request rows including CUDA-graph padding rows.
- ``num_actual_tokens``: tokens including CUDA-graph padding tokens.
- ``max_blocks``: block-table columns staged (see above).
- ``num_pages``: KV pages of the step, ``sum(cdiv(seq_lens, block_size))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from attnmeta._fields import MetadataBase, keyword_factory
from attnmeta.host.paged import PagedKV
from attnmeta.host.split import SplitCounts, split_counts_nb
from attnmeta.staging import Staged, Step

if TYPE_CHECKING:
    from attnmeta.spec import BatchSpec

__all__ = ["CommonAttentionMetadata", "CommonHost", "PagedKVMetadata", "StagedCommon"]

_new_tuple = tuple.__new__  # a NamedTuple from a tuple of its fields, without __new__'s argument parsing


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class CommonAttentionMetadata(MetadataBase):
    """Per-step metadata shared by every attention-like layer of one KV-cache group.

    Device tensors are views into a step's device arena, valid for kernels enqueued on the commit
    stream after the step commits. Host arrays are read-only views into the step's pinned slot (the
    host-only ones into buffers that belong to that slot); they stay valid until the stager reuses
    that slot (``num_slots`` steps later): copy them if you keep them longer.

    Examples
    --------
    Two decodes with 5 and 7 cached tokens, one fresh 4-token prefill, block size 4, padded to 4
    rows and 8 tokens:

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager, build_common
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4,
    ...                  num_reqs_padded=4, num_tokens_padded=8)
    >>> cm = build_common(spec, Stager("cpu"))
    >>> cm.query_start_loc_cpu.tolist(), cm.seq_lens_cpu.tolist()  # (host twins: no device read)
    ([0, 1, 2, 6, 6], [6, 8, 4, 0])
    >>> cm.slot_mapping_cpu.tolist()  # (a host twin)
    [45, 87, 120, 121, 122, 123, -1, -1]
    >>> cm.query_start_loc
    tensor([0, 1, 2, 6, 6], dtype=torch.int32)
    >>> cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, cm.max_seq_len
    (4, 8, 4, 8)
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc",
        "seq_lens",
        "block_table_tensor",
        "slot_mapping",
        "positions",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc_cpu",
        "seq_lens_cpu",
        "seq_lens_cpu_upper_bound",
        "num_computed_tokens_cpu",
        "block_table_cpu",
        "slot_mapping_cpu",
        "positions_cpu",
        "is_prefilling",
        "num_decode_draft_tokens_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_reqs",
        "num_actual_tokens",
        "max_query_len",
        "max_seq_len",
        "block_size",
        "causal",
        "num_real_reqs",
        "num_real_tokens",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("query_start_loc", "query_start_loc_cpu"),
        ("seq_lens", "seq_lens_cpu"),
        ("block_table_tensor", "block_table_cpu"),
        ("slot_mapping", "slot_mapping_cpu"),
        ("positions", "positions_cpu"),
    )

    # ---- device fields
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32, device. Exclusive prefix sum of query lengths; [0] == 0; padding rows
    repeat the last value (their query length is 0)."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32, device. ``num_computed_tokens + num_scheduled_tokens``; padding rows 0."""
    block_table_tensor: torch.Tensor
    """(num_reqs, max_blocks) int32, device. Physical block ids; padding rows 0 (NULL_BLOCK_ID)."""
    slot_mapping: torch.Tensor
    """(num_actual_tokens,) int64, device. KV slot of each token; padding (and non-local, under
    context parallelism) tokens -1 (PAD_SLOT_ID). ``(0,)`` when staged with ``token_arrays=False``."""
    positions: torch.Tensor
    """(num_actual_tokens,) int64, device. Absolute position of each token; padding tokens 0. ``(0,)``
    when staged with ``token_arrays=False``."""
    # ---- host fields
    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host. Twin of ``query_start_loc``."""
    seq_lens_cpu: np.ndarray
    """(num_reqs,) int32, host. Twin of ``seq_lens`` (exact)."""
    seq_lens_cpu_upper_bound: np.ndarray
    """(num_reqs,) int32, host. ``BatchSpec.seq_lens_upper_bound`` (optimistic under async spec decode),
    else equal to ``seq_lens_cpu``; padding rows 0."""
    num_computed_tokens_cpu: np.ndarray
    """(num_reqs,) int32, host. ``seq_lens_cpu - diff(query_start_loc_cpu)``; padding rows 0."""
    block_table_cpu: np.ndarray
    """(num_reqs, max_blocks) int32, host. Twin of ``block_table_tensor``."""
    slot_mapping_cpu: np.ndarray
    """(num_actual_tokens,) int64, host. Twin of ``slot_mapping``."""
    positions_cpu: np.ndarray
    """(num_actual_tokens,) int64, host. Twin of ``positions``."""
    is_prefilling: np.ndarray
    """(num_reqs,) bool, host only. ``num_computed_tokens < num_prompt_tokens``; padding rows False;
    all False when the spec gives no prompt lengths."""
    num_decode_draft_tokens_cpu: np.ndarray | None
    """(num_reqs,) int32, host only, or None without spec decode. vLLM's runner rule: ``d_i`` when
    ``d_i > 0`` and ``q_i == d_i + 1``; else 0 when ``q_i == 1`` and row i is past its prompt (a spec
    row with zero drafts); else -1 (a prompt chunk, a one-token one included); padding rows -1
    (docs/semantics.md, "Draft tokens")."""
    # ---- host scalars
    num_reqs: int
    """Request rows, padding included."""
    num_actual_tokens: int
    """Tokens, padding included (may exceed ``query_start_loc_cpu[-1]``)."""
    max_query_len: int
    """Max scheduled tokens over the real rows."""
    max_seq_len: int
    """Max of ``seq_lens_cpu_upper_bound`` over the real rows (an upper bound under async spec decode)."""
    block_size: int
    """Tokens per KV block."""
    causal: bool = True
    """Causal attention for every request."""
    num_real_reqs: int
    """Requests before padding."""
    num_real_tokens: int
    """Tokens before padding (``query_start_loc_cpu[-1]``)."""

    # ------------------------------------------------------------------ methods
    def replace(self, **changes: Any) -> CommonAttentionMetadata:
        """A new object with ``changes`` applied.

        A device field and its host twin must change together. ``num_computed_tokens_cpu`` is
        re-derived when ``seq_lens_cpu`` or ``query_start_loc_cpu`` change (unless given), so no stale
        derived value survives.
        """
        self._check_twins(changes)
        if ("seq_lens_cpu" in changes or "query_start_loc_cpu" in changes) and "num_computed_tokens_cpu" not in changes:
            sl = changes.get("seq_lens_cpu", self.seq_lens_cpu)
            qsl = changes.get("query_start_loc_cpu", self.query_start_loc_cpu)
            if np.shape(qsl) != (np.shape(sl)[0] + 1,):
                raise ValueError(
                    f"replace(): cannot re-derive num_computed_tokens_cpu: seq_lens_cpu has shape {np.shape(sl)} "
                    f"but query_start_loc_cpu has shape {np.shape(qsl)} (need len(seq_lens_cpu) + 1 entries); "
                    f"fix the shapes or pass num_computed_tokens_cpu explicitly"
                )
            changes["num_computed_tokens_cpu"] = (sl - np.diff(qsl)).astype(np.int32)
        return self._derived(dataclasses.replace(self, **changes))

    def unpadded(self, num_actual_tokens: int, num_reqs: int) -> CommonAttentionMetadata:
        """The first ``num_reqs`` rows and ``num_actual_tokens`` tokens (drops padding).

        ``max_query_len`` / ``max_seq_len`` are kept as they are (vLLM's ``unpadded``).
        """
        if not 0 <= num_reqs <= self.num_reqs or not 0 <= num_actual_tokens <= self.num_actual_tokens:
            raise ValueError(
                f"unpadded({num_actual_tokens}, {num_reqs}): must be within num_actual_tokens="
                f"{self.num_actual_tokens}, num_reqs={self.num_reqs}"
            )
        B, T = num_reqs, num_actual_tokens
        ddt = self.num_decode_draft_tokens_cpu
        return self._derived(dataclasses.replace(
            self,
            query_start_loc=self.query_start_loc[: B + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: B + 1],
            seq_lens=self.seq_lens[:B],
            seq_lens_cpu=self.seq_lens_cpu[:B],
            seq_lens_cpu_upper_bound=self.seq_lens_cpu_upper_bound[:B],
            num_computed_tokens_cpu=self.num_computed_tokens_cpu[:B],
            block_table_tensor=self.block_table_tensor[:B],
            block_table_cpu=self.block_table_cpu[:B],
            slot_mapping=self.slot_mapping[:T],
            slot_mapping_cpu=self.slot_mapping_cpu[:T],
            positions=self.positions[:T],
            positions_cpu=self.positions_cpu[:T],
            is_prefilling=self.is_prefilling[:B],
            num_decode_draft_tokens_cpu=None if ddt is None else ddt[:B],
            num_reqs=B,
            num_actual_tokens=T,
            num_real_reqs=min(self.num_real_reqs, B),
            num_real_tokens=int(self.query_start_loc_cpu[B]),
        ))

    def query_lens_cpu(self) -> np.ndarray:
        """(num_reqs,) int32, host: ``diff(query_start_loc_cpu)``."""
        return np.diff(self.query_start_loc_cpu).astype(np.int32)

    def compute_num_computed_tokens(self) -> torch.Tensor:
        """(num_reqs,) int32, device: ``seq_lens - diff(query_start_loc)``, computed on the device (no
        sync; a new tensor each call, never memoised)."""
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])

    def validate(self) -> None:
        """Check the invariants of docs/semantics.md, "CommonAttentionMetadata" on the host twins (never syncs).

        Raises
        ------
        ValueError
            Naming the invariant, the first offending row and the values.
        """
        qsl, B, T = self.query_start_loc_cpu, self.num_reqs, self.num_actual_tokens
        if qsl.shape != (B + 1,):
            raise ValueError(f"query_start_loc_cpu: shape {qsl.shape} != (num_reqs + 1,) = ({B + 1},)")
        for name in ("seq_lens_cpu", "seq_lens_cpu_upper_bound", "num_computed_tokens_cpu", "is_prefilling",
                     "num_decode_draft_tokens_cpu"):
            arr = getattr(self, name)
            if arr is not None and arr.shape != (B,):
                raise ValueError(f"{name}: shape {arr.shape} != (num_reqs,) = ({B},)")
        if qsl[0] != 0:
            raise ValueError(f"query_start_loc_cpu[0]={int(qsl[0])} != 0")
        q = np.diff(qsl)
        if (q < 0).any():
            i = int(np.argmax(q < 0))
            raise ValueError(f"query_start_loc_cpu decreases at row {i}: {int(qsl[i])} -> {int(qsl[i + 1])}")
        if int(qsl[-1]) > T:
            raise ValueError(f"query_start_loc_cpu[-1]={int(qsl[-1])} > num_actual_tokens={T}")
        if (self.seq_lens_cpu < q).any():
            i = int(np.argmax(self.seq_lens_cpu < q))
            raise ValueError(f"seq_lens_cpu[{i}]={int(self.seq_lens_cpu[i])} < query_lens[{i}]={int(q[i])} (request {i})")
        if (self.seq_lens_cpu_upper_bound < self.seq_lens_cpu).any():
            i = int(np.argmax(self.seq_lens_cpu_upper_bound < self.seq_lens_cpu))
            raise ValueError(
                f"seq_lens_cpu_upper_bound[{i}]={int(self.seq_lens_cpu_upper_bound[i])} < seq_lens_cpu[{i}]="
                f"{int(self.seq_lens_cpu[i])} (request {i})"
            )
        for name, rows in (("block_table_tensor", B), ("slot_mapping", T), ("seq_lens", B), ("positions", T)):
            got = getattr(self, name).shape[0]
            if got == 0 and name in ("slot_mapping", "positions"):
                continue  # not computed (token_arrays=False)
            if got < rows:
                raise ValueError(f"{name}: {got} rows < required {rows}")
        for dev, host in self._TWINS:
            d, h = getattr(self, dev), getattr(self, host)
            if tuple(d.shape) != h.shape:
                raise ValueError(f"{dev} shape {tuple(d.shape)} != its host twin {host} shape {h.shape}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class CommonHost(MetadataBase):
    """The host part of a staged common metadata (:attr:`StagedCommon.host`).

    Every host twin and host scalar of the step's :class:`CommonAttentionMetadata`, two scalars of
    the :class:`~attnmeta.BatchSpec` that builders need, and :meth:`split`, the step's decode/prefill
    splits (computed once per step and set of flags, shared by every builder of the step). It is what
    a builder staged after the common metadata reads; it never holds a device tensor. The arrays are
    read-only views of the step's pinned slot, valid until the stager reuses the slot.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager, stage_common
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4)
    >>> with Stager("cpu").step() as step:
    ...     host = stage_common(spec, step).host
    >>> host.seq_lens_cpu.tolist(), host.num_pages, host.split()  # (host arrays)
    ([6, 8, 4], 5, SplitCounts(num_decodes=2, num_prefills=1, num_decode_tokens=2, num_prefill_tokens=4))
    """

    _HOST_FIELDS: ClassVar[tuple[str, ...]] = CommonAttentionMetadata._HOST_FIELDS
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        *CommonAttentionMetadata._SCALAR_FIELDS, "num_pages", "max_exact_seq_len",
    )

    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host. As :attr:`CommonAttentionMetadata.query_start_loc_cpu`."""
    seq_lens_cpu: np.ndarray
    """(num_reqs,) int32, host. Exact sequence lengths; padding rows 0."""
    seq_lens_cpu_upper_bound: np.ndarray
    """(num_reqs,) int32, host. Optimistic lengths under async spec decode, else ``seq_lens_cpu``."""
    num_computed_tokens_cpu: np.ndarray
    """(num_reqs,) int32, host. ``seq_lens_cpu - query_lens``; padding rows 0."""
    block_table_cpu: np.ndarray
    """(num_reqs, max_blocks) int32, host. The staged block table."""
    slot_mapping_cpu: np.ndarray
    """(num_actual_tokens,) int64, host; ``(0,)`` without token arrays."""
    positions_cpu: np.ndarray
    """(num_actual_tokens,) int64, host; ``(0,)`` without token arrays."""
    is_prefilling: np.ndarray
    """(num_reqs,) bool, host. ``num_computed_tokens < num_prompt_tokens``."""
    num_decode_draft_tokens_cpu: np.ndarray | None
    """(num_reqs,) int32, host, or None without spec decode."""
    num_reqs: int
    """Request rows, padding included."""
    num_actual_tokens: int
    """Tokens, padding included."""
    max_query_len: int
    """Max scheduled tokens over the real rows."""
    max_seq_len: int
    """Max of ``seq_lens_cpu_upper_bound`` over the real rows."""
    block_size: int
    """Tokens per KV block."""
    causal: bool
    """Causal attention for every request."""
    num_real_reqs: int
    """Requests before padding."""
    num_real_tokens: int
    """Tokens before padding."""
    num_pages: int
    """``sum(cdiv(seq_lens_cpu, block_size))``: the step's KV pages (:attr:`BatchSpec.num_pages`)."""
    max_exact_seq_len: int
    """``max(seq_lens_cpu)`` over the real rows (exact; 0 for an empty batch)."""
    splits: dict[tuple[int, bool, bool], SplitCounts] = dataclasses.field(default_factory=dict)
    """The memo of :meth:`split` (one entry per set of flags asked this step)."""

    def split(
        self, decode_threshold: int = 1, require_uniform: bool = False, treat_short_extends_as_decodes: bool = True
    ) -> SplitCounts:
        """:func:`attnmeta.host.split.split_decodes_and_prefills` of this step (docs/semantics.md).

        Computed once per step and set of flags, and shared by every builder of the step. The inputs
        were validated when the step was staged, so the compiled split runs directly.

        Parameters
        ----------
        decode_threshold : int, default 1
            Longest query that counts as a decode (>= 1).
        require_uniform : bool, default False
            Decodes must share row 0's query length (zero-length padding rows allowed).
        treat_short_extends_as_decodes : bool, default True
            When False, rows still prefilling (:attr:`is_prefilling`) are prefills.

        Returns
        -------
        SplitCounts
            ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.

        Raises
        ------
        ValueError
            ``decode_threshold`` is not an int >= 1 (0 or less would make every row a prefill).
        """
        key = (decode_threshold, require_uniform, treat_short_extends_as_decodes)
        found = self.splits.get(key)
        if found is not None:
            return found
        if type(decode_threshold) is not int and (isinstance(decode_threshold, bool)
                                                  or not isinstance(decode_threshold, int | np.integer)):
            decode_threshold = 0  # (the message below)
        if decode_threshold < 1:
            raise ValueError(f"split(): decode_threshold must be an int >= 1 (the longest query that counts as a "
                             f"decode), got {key[0]!r}")
        if treat_short_extends_as_decodes and self.max_query_len <= decode_threshold and (
                not require_uniform or decode_threshold <= 1):  # every row decodes: the split's first rule
            found = self.splits[key] = _new_tuple(SplitCounts, (self.num_reqs, 0, self.num_actual_tokens, 0))
            return found
        nd, np_, ndt, npt = split_counts_nb(
            self.query_start_loc_cpu, self.num_actual_tokens, self.max_query_len, decode_threshold,
            require_uniform, treat_short_extends_as_decodes, self.is_prefilling,
        )
        found = self.splits[key] = SplitCounts(int(nd), int(np_), int(ndt), int(npt))
        return found


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class PagedKVMetadata(MetadataBase):
    """The paged-KV layout of a step's rows: FlashInfer's page table (page size = block size).

    With ``nblk_i = cdiv(kv_lens_i, page_size)``: ``paged_kv_indptr = [0, cumsum(nblk)]``, row ``i``'s
    pages are ``paged_kv_indices[indptr[i]:indptr[i + 1]] = block_table[i, :nblk_i]``, and
    ``paged_kv_last_page_len`` counts the tokens of each row's last page (``page_size`` for a full
    one, 0 for a row without pages). Built by :func:`stage_common` with ``paged_kv=True`` (from the
    common ``seq_lens``, in the same compiled pass) or by :func:`stage_paged_kv` (any lengths).

    Shape legend: ``num_reqs`` rows (padding included), ``num_pages = paged_kv_indptr[-1]``.
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "paged_kv_indptr_cpu", "paged_kv_indices_cpu", "paged_kv_last_page_len_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ("num_pages", "page_size")
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("paged_kv_indptr", "paged_kv_indptr_cpu"),
        ("paged_kv_last_page_len", "paged_kv_last_page_len_cpu"),
    )

    paged_kv_indptr: torch.Tensor
    """(num_reqs + 1,) int32, device. In graph mode a view of a fixed ``(max_num_reqs + 1,)`` buffer
    whose tail repeats the page count."""
    paged_kv_indices: torch.Tensor | None
    """(num_pages,) int32, device; None where the builder gathers the indices itself."""
    paged_kv_last_page_len: torch.Tensor
    """(num_reqs,) int32, device."""
    paged_kv_indptr_cpu: np.ndarray
    """(num_reqs + 1,) int32, host (pinned staged view)."""
    paged_kv_indices_cpu: np.ndarray | None
    """(num_pages,) int32, host (pinned staged view), or None (as ``paged_kv_indices``)."""
    paged_kv_last_page_len_cpu: np.ndarray
    """(num_reqs,) int32, host (pinned staged view)."""
    num_pages: int
    """``paged_kv_indptr_cpu[-1]``."""
    page_size: int
    """Tokens per page."""


make_paged = keyword_factory(PagedKVMetadata)
"""Keyword constructor of :class:`PagedKVMetadata` for builders."""


class StagedCommon(Staged[CommonHost, CommonAttentionMetadata]):
    """:func:`stage_common`'s result: ``host`` (:class:`CommonHost`) now, :meth:`result` after the
    commit, and the optional paged-KV part.

    Attributes
    ----------
    host : CommonHost
        The host twins, scalars and splits of the step.
    paged : Staged[PagedKV, PagedKVMetadata] or None
        The step's paged-KV layout (page size = block size) when staged with ``paged_kv=True``:
        ``paged.host`` the three host arrays (:class:`attnmeta.host.paged.PagedKV`), ``paged.result()``
        the :class:`PagedKVMetadata` after the commit. A FlashInfer builder of the step reuses it.
    prefix : str or None
        The namespace of the common fields staged in the step (``<prefix>.seq_lens``, ...); None for
        a common metadata derived from another (a backend's transformed batch: fast prefill, local
        attention, a micro-batch), whose fields are views of another's.
    spec : BatchSpec or None
        The spec :func:`stage_common` derived it from (None for a derived common metadata, as ``prefix``).
    """

    __slots__ = ("_rows", "paged", "prefix", "spec")

    def __init__(self, step: Step, host: CommonHost, make: Callable[[], CommonAttentionMetadata], *,
                 paged: Staged[PagedKV, PagedKVMetadata] | None = None,
                 rows: Callable[[int], tuple[torch.Tensor, np.ndarray]] | None = None, prefix: str | None = None,
                 spec: BatchSpec | None = None) -> None:
        self.step, self.host, self._make, self._result = step, step.own(host), make, None  # (Staged.__init__, inlined)
        self.paged = paged
        self._rows = rows
        self.prefix = prefix
        self.spec = spec

    def query_start_loc_rows(self, rows: int) -> tuple[torch.Tensor, np.ndarray]:
        """The device and host views of ``query_start_loc``'s first ``rows`` entries, after the commit
        (e.g. the decode rows' query starts, ``rows = num_decodes + 1``): cached with the step's layout
        where :func:`stage_common` staged the common metadata, sliced otherwise."""
        if self._rows is not None:
            return self._rows(rows)
        cm = self.result()
        return cm.query_start_loc[:rows], cm.query_start_loc_cpu[:rows]
