"""FlashInfer paged-KV metadata (docs/semantics-attention.md), derived on the host.

``FlashInferMetadata`` carries what FlashInfer's ``plan()`` / ``run()`` take for a reordered batch:
the decode rows ``[0, num_decodes)`` and the prefill rows ``[num_decodes, num_reqs)``, the paged-KV
arrays ``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len`` of every row, the query
indptrs of both parts and the KV lengths. Every array is computed on the host from the common
metadata's host twins and staged into the same step, so it moves in the step's one copy; the metadata
holds **both** the pinned host arrays (for ``plan()``) and the device views (for ``run()`` and for
TRTLLM-style kernels that read device arrays).

What vLLM 0.33.0 does differently, and why attnmeta does not:

- it reads ``seq_lens.cpu()`` (a sync) whenever spec decode is on and a native FlashInfer path or DCP
  needs host lengths. attnmeta's host ``seq_lens_cpu`` is exact by construction (it comes from the
  :class:`~attnmeta.spec.BatchSpec`), so the host never waits; see "Async spec decode" below for what
  the caller must pass;
- it gathers ``paged_kv_indices`` on the device with a Triton kernel. attnmeta gathers them on the host
  in compiled code by default (``indices="host"``: nothing but the step's copy touches the device), or,
  for very long contexts where the host gather is O(pages), on the device from the staged block table
  with sync-free torch ops whose output sizes come from the host (``indices="device"``);
- its host indptr / last-page buffers are deliberately *not* pinned (each copy stages a fresh pinned
  snapshot, vllm#32799). attnmeta's are views of the stager's pinned, event-fenced slot.

Where the page table comes from
-------------------------------
One derivation (:func:`attnmeta.common.stage_paged_kv`'s compiled pass) builds the page table from
the KV lengths and the staged block table. Without DCP and with ``indices="host"`` (the builder's
:meth:`~FlashInferBuilder.needs`) the common pass builds it alongside the common fields
(``stage_common(paged_kv=True)``, :attr:`attnmeta.StagedCommon.paged`) and the builder hands it out as
it is; otherwise (DCP lengths, device-side indices, or a common staged without it) the builder
stages its own.

Handing the host arrays to ``plan()``
-------------------------------------
FlashInfer's ``plan()`` wants host tensors (given device tensors it copies them back with a blocking
``.to("cpu")``). Pass :func:`host_tensor` views of the host arrays (``host_tensor(meta.paged_kv_indptr_cpu)``
and friends; zero-copy, unlike ``torch.tensor``): on CUDA they share the step's **pinned** slot, so
``plan()``'s ``.to("cpu")`` calls are no-ops and its internal ``.to(device, non_blocking=True)`` copies
are truly asynchronous DMA, never a staged pageable copy.
The decode part is ``qo_indptr_decode_cpu``, ``paged_kv_indptr_cpu[:num_decodes + 1]``,
``paged_kv_last_page_len_cpu[:num_decodes]``, ``kv_lens_cpu[:num_decodes]``; the prefill part is
``qo_indptr_prefill_cpu`` (rebased to 0), ``paged_kv_indptr_cpu[num_decodes:]`` (not rebased: it
indexes the whole ``paged_kv_indices``), ``paged_kv_last_page_len_cpu[num_decodes:]``,
``kv_lens_cpu[num_decodes:]``.

Lifetime caveat: ``plan()``'s copies read the pinned slot when the stream reaches them, while the
stager fences the slot with the event recorded after its *own* commit copy. Call ``plan()`` right
after the commit (before building the next step); the slot is rewritten only ``num_slots`` steps
later, so the copies are safe unless the GPU falls ``num_slots`` steps behind between the commit and
the ``plan()`` copies.

Async spec decode
-----------------
The paged-KV arrays and ``kv_lens`` need each request's exact KV length on the host. attnmeta never
reads it back from the device: it uses ``seq_lens_cpu = num_computed_tokens + num_scheduled_tokens``
of the :class:`~attnmeta.spec.BatchSpec`. Under async scheduling with speculative decoding, pass the
**exact** (accepted-corrected) ``num_computed_tokens`` of every request this builder plans, and the
optimistic lengths only as ``seq_lens_upper_bound`` (docs/serving.md, "What to pass under async spec
decode"). A device-side correction of ``seq_lens`` after the build (which FlashAttention tolerates)
does not fix these host-derived arrays; an engine that builds step N+1 before it knows step N's
accepted counts must use a path that reads device ``seq_lens`` only (e.g. TRTLLM/XQA decode), not the
native ``plan()``.

Graph mode
----------
With a :class:`~attnmeta.profile.StaticProfile` every device field has a fixed address and capacity:
``paged_kv_indptr`` and ``qo_indptr_prefill`` have ``max_num_reqs + 1`` entries and are staged in full,
their tail repeating the last value (like ``query_start_loc``); ``paged_kv_last_page_len`` and the DCP
``kv_lens`` have ``max_num_reqs`` (tail 0); ``paged_kv_indices`` has ``profile.max_num_pages`` (tail
0). ``Step.device_full(prefix + ".<field>")`` gives the full-capacity views to capture over, with the
prefix of whichever staged the page table (the common's, ``"common"``, when the builder reuses its
page table; else the options' ``prefix``). With
``indices="device"`` the gather writes into that fixed buffer when ``Staged.result()`` runs, so call it
every step before replaying a graph that reads the indices.

Shape legend
------------
- ``num_reqs``: request rows ``B``, CUDA-graph padding rows included.
- ``num_decodes`` / ``num_prefills``: rows ``[0, D)`` / ``[D, B)`` of the decode/prefill split.
- ``num_pages``: ``paged_kv_indptr[-1]``, total KV pages of the batch.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from attnmeta._checks import check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory, template
from attnmeta.builder import Builder, CommonNeeds, Replayer, register
from attnmeta.common import stage_paged_kv
from attnmeta.host.flash_attn import dcp_context_kv_lens
from attnmeta.host.paged import prefill_qo_indptr
from attnmeta.host.split import SplitCounts
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import Staged, Step

__all__ = [
    "FLASHINFER",
    "FlashInferBuilder",
    "FlashInferMetadata",
    "FlashInferOptions",
    "build",
    "host_tensor",
    "stage",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlashInferOptions:
    """Options of the FlashInfer builder (validated when constructed).

    Examples
    --------
    >>> FlashInferOptions(decode_threshold=4, require_uniform=False).indices
    'host'
    >>> FlashInferOptions(indices="gpu")
    Traceback (most recent call last):
    ValueError: FlashInferOptions.indices: must be 'host' or 'device', got 'gpu'
    """

    decode_threshold: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Longest query counted as a decode (vLLM's ``reorder_batch_threshold``; ``1 + k`` with ``k``
    speculative tokens when spec decode runs as decode)."""
    require_uniform: bool = dataclasses.field(default=True, metadata=option_rule("bool"))
    """Decode rows must share one query length (vLLM: ``True`` for the native FlashInfer and FA2 decode
    paths, ``False`` for XQA / trtllm-gen varlen)."""
    causal: bool = dataclasses.field(default=True, metadata=option_rule("bool"))
    """Causal attention. When False every row is a prefill (vLLM splits only causal batches)."""
    indices: Literal["host", "device"] = dataclasses.field(
        default="host", metadata=option_rule("choice", choices=("host", "device")))
    """Where ``paged_kv_indices`` is gathered: ``"host"`` (compiled, staged with the step) or
    ``"device"`` (only the indptr is staged; the gather runs on the device from the staged block
    table when :meth:`Staged.result` is first called, on the current stream)."""
    dcp_world_size: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Decode-context-parallel world size ``W`` (1: off)."""
    dcp_rank: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0, below="dcp_world_size"))
    """This rank, ``0 <= dcp_rank < dcp_world_size``."""
    dcp_interleave: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Consecutive tokens per DCP rank (``cp_kv_cache_interleave_size``)."""
    prefix: str = dataclasses.field(default="flashinfer", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class FlashInferMetadata(MetadataBase):
    """FlashInfer paged-KV metadata of one step; contains the step's common metadata.

    The host arrays are views of the step's pinned staging slot (read-only), the device tensors views
    of the same step's device arena: both hold the same values, written once on the host.

    Examples
    --------
    Two decodes with 5 and 7 cached tokens, a fresh 4-token prefill and one padding row, page size 4:

    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4, num_reqs_padded=4)
    >>> fi = build(spec, Stager("cpu"))
    >>> fi.num_decodes, fi.num_prefills, fi.num_decode_tokens, fi.num_prefill_tokens
    (2, 2, 2, 4)
    >>> fi.paged_kv_indptr_cpu, fi.paged_kv_last_page_len_cpu
    (array([0, 2, 4, 5, 5], dtype=int32), array([2, 4, 4, 0], dtype=int32))
    >>> fi.paged_kv_indices
    tensor([10, 11, 20, 21, 30], dtype=torch.int32)
    >>> fi.qo_indptr_decode_cpu, fi.qo_indptr_prefill_cpu
    (array([0, 1, 2], dtype=int32), array([0, 4, 4], dtype=int32))
    >>> fi.kv_lens_cpu, fi.num_pages, fi.max_kv_len
    (array([6, 8, 4, 0], dtype=int32), 5, 8)
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "paged_kv_indptr",
        "paged_kv_indices",
        "paged_kv_last_page_len",
        "kv_lens",
        "qo_indptr_decode",
        "qo_indptr_prefill",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "paged_kv_indptr_cpu",
        "paged_kv_indices_cpu",
        "paged_kv_last_page_len_cpu",
        "kv_lens_cpu",
        "qo_indptr_decode_cpu",
        "qo_indptr_prefill_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_decodes",
        "num_prefills",
        "num_decode_tokens",
        "num_prefill_tokens",
        "num_pages",
        "page_size",
        "max_decode_query_len",
        "max_prefill_query_len",
        "max_kv_len",
        "causal",
        "indices",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("paged_kv_indptr", "paged_kv_indptr_cpu"),
        ("paged_kv_indices", "paged_kv_indices_cpu"),
        ("paged_kv_last_page_len", "paged_kv_last_page_len_cpu"),
        ("kv_lens", "kv_lens_cpu"),
        ("qo_indptr_decode", "qo_indptr_decode_cpu"),
        ("qo_indptr_prefill", "qo_indptr_prefill_cpu"),
    )

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    paged: PagedKVMetadata
    """The page table of the step's rows (:class:`~attnmeta.metadata.PagedKVMetadata`): the common
    pass's own (the same object) when the builder reuses it; its fields are also this object's
    ``paged_kv_*`` attributes, ``num_pages`` and ``page_size``."""
    # ---- device fields
    kv_lens: torch.Tensor
    """(num_reqs,) int32, device. KV length of each row: the common ``seq_lens`` (the same view), or
    with DCP this rank's local share (decode rows: of the whole sequence; prefill rows: of the context
    ``seq_lens - query_lens``), staged."""
    qo_indptr_decode: torch.Tensor
    """(num_decodes + 1,) int32, device. ``query_start_loc[:num_decodes + 1]`` (a view)."""
    qo_indptr_prefill: torch.Tensor
    """(num_prefills + 1,) int32, device. ``query_start_loc[num_decodes:] - query_start_loc[num_decodes]``
    (rebased to 0; TRTLLM's ``cum_seq_lens_q``)."""
    # ---- host fields
    kv_lens_cpu: np.ndarray
    """(num_reqs,) int32, host (pinned staged view). Twin of ``kv_lens``: exact (from the
    :class:`~attnmeta.spec.BatchSpec`, never read back from the device)."""
    qo_indptr_decode_cpu: np.ndarray
    """(num_decodes + 1,) int32, host. Twin of ``qo_indptr_decode`` (a view of ``query_start_loc_cpu``)."""
    qo_indptr_prefill_cpu: np.ndarray
    """(num_prefills + 1,) int32, host (pinned staged view). Twin of ``qo_indptr_prefill``."""
    # ---- host scalars
    num_decodes: int
    """Leading decode rows ``D``."""
    num_prefills: int
    """Prefill rows ``B - D`` (padding rows after the first prefill count here)."""
    num_decode_tokens: int
    """Tokens of the decode rows (all tokens, padding included, when every row decodes)."""
    num_prefill_tokens: int
    """Tokens of the prefill rows, token padding included (as vLLM counts them)."""
    max_decode_query_len: int
    """Longest decode query (the uniform ``q_len_per_req`` under ``require_uniform``); 0 without decodes."""
    max_prefill_query_len: int
    """Longest prefill query (TRTLLM's ``max_q_len``); 0 without prefills."""
    max_kv_len: int
    """``max(kv_lens_cpu)`` (exact); 0 for an empty batch."""
    causal: bool
    """Whether the batch was split as causal (else every row is a prefill)."""
    indices: str
    """``"host"`` or ``"device"``: where ``paged_kv_indices`` was gathered."""

    # ---- the page table's fields, read through ``paged`` (plan() reads them once a step)
    @property
    def paged_kv_indptr(self) -> torch.Tensor:
        """(num_reqs + 1,) int32, device. ``[0, cumsum(cdiv(kv_lens, page_size))]``; padding rows repeat
        the last value (they have no pages)."""
        return self.paged.paged_kv_indptr

    @property
    def paged_kv_indices(self) -> torch.Tensor:
        """(num_pages,) int32, device. Page ids of row 0, then row 1, ...:
        ``paged_kv_indices[indptr[i]:indptr[i+1]] = block_table[i, :indptr[i+1] - indptr[i]]``."""
        indices = self.paged.paged_kv_indices
        assert indices is not None  # (a builder that gathers on the device gives its part the gathered ones)
        return indices

    @property
    def paged_kv_last_page_len(self) -> torch.Tensor:
        """(num_reqs,) int32, device. Tokens in each row's last page: ``page_size`` if ``kv_lens %
        page_size == 0`` and ``kv_lens != 0``, else ``kv_lens % page_size`` (0 for padding rows)."""
        return self.paged.paged_kv_last_page_len

    @property
    def paged_kv_indptr_cpu(self) -> np.ndarray:
        """(num_reqs + 1,) int32, host (pinned staged view). Twin of ``paged_kv_indptr``."""
        return self.paged.paged_kv_indptr_cpu

    @property
    def paged_kv_indices_cpu(self) -> np.ndarray | None:
        """(num_pages,) int32, host (pinned staged view), twin of ``paged_kv_indices``; ``None`` with
        ``indices="device"`` (never computed on the host)."""
        return self.paged.paged_kv_indices_cpu

    @property
    def paged_kv_last_page_len_cpu(self) -> np.ndarray:
        """(num_reqs,) int32, host (pinned staged view). Twin of ``paged_kv_last_page_len``."""
        return self.paged.paged_kv_last_page_len_cpu

    @property
    def num_pages(self) -> int:
        """``paged_kv_indptr_cpu[-1]``: length of ``paged_kv_indices``."""
        return self.paged.num_pages

    @property
    def page_size(self) -> int:
        """Tokens per KV page (the block size)."""
        return self.paged.page_size


_make_fi = keyword_factory(FlashInferMetadata)
_I32 = np.dtype(np.int32)


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing a host array's memory, for APIs that take host tensors (``plan()``).

    The metadata's host arrays are read-only views of the step's pinned slot; ``torch.from_numpy``
    warns about read-only arrays, this does not. On CUDA the result ``is_pinned()``, so a
    ``non_blocking=True`` copy from it is real DMA. Do not write into it; it is valid as long as the
    array (until the stager reuses the step's slot).

    Torch warns about a read-only array once a process. The first call of a process keeps that warning
    away (and checks that torch does not warn again); every later call is ``torch.from_numpy`` alone,
    which leaves the process's warning filters untouched. (A change of the filters makes Python forget
    which warnings it has shown: changed at every call, a warning of the caller's shown "once per
    place" would show again after each call; the first call's change makes it forget once.)

    Parameters
    ----------
    array : numpy.ndarray
        A host field of a metadata object, e.g. ``meta.paged_kv_indptr_cpu[:meta.num_decodes + 1]``.

    Returns
    -------
    torch.Tensor
        CPU tensor, same shape, dtype and memory (no copy).

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4)
    >>> fi = build(spec, Stager("cpu"))
    >>> host_tensor(fi.paged_kv_indptr_cpu[fi.num_decodes :])
    tensor([4, 5], dtype=torch.int32)
    """
    if _QUIET or array.flags.writeable:
        return torch.from_numpy(array)
    return _first_read_only(array)


_QUIET = False
"""Whether torch is known not to warn about a read-only array again in this process."""
_LOUD = False
"""Whether torch is known to warn about every read-only array (then every call keeps it away)."""
_READ_ONLY_TEXT = "The given NumPy array is not writable"


def _first_read_only(array: np.ndarray) -> torch.Tensor:
    """:func:`host_tensor` of a read-only array while torch may still warn about one: its warning kept
    away, the process's own filters restored after; torch's warning is once a process, which a second
    call here checks once (a torch that warned every time keeps this path)."""
    global _QUIET, _LOUD
    check = not _LOUD
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = torch.from_numpy(array)
        first = len(seen)
        if check:
            torch.from_numpy(array)
    for w in seen:  # (anything but torch's read-only warning is the caller's to see)
        if _READ_ONLY_TEXT not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if check:
        _LOUD = len(seen) > first
        _QUIET = not _LOUD
    return out


def _max_query(qsl: np.ndarray, start: int, stop: int) -> int:
    """``max(diff(qsl[start:stop+1]))``, 0 for an empty range (host)."""
    if stop <= start:
        return 0
    return int((qsl[start + 1 : stop + 1] - qsl[start:stop]).max())


def _gather_indices(
    indptr: torch.Tensor, block_table: torch.Tensor, total: int, out: torch.Tensor | None
) -> torch.Tensor:
    """``paged_kv_indices`` gathered on the device, without a sync.

    Page ``p`` belongs to row ``searchsorted(indptr[1:], p, right=True)`` at column ``p - indptr[row]``;
    every shape is ``total`` (a host int), so nothing is read back. With ``out`` (a fixed-capacity
    buffer) the result goes to ``out[:total]`` and ``out[total:]`` is zeroed.
    """
    dev = indptr.device
    pages = torch.arange(total, dtype=torch.int32, device=dev)
    rows = torch.searchsorted(indptr[1:], pages, right=True)
    cols = pages.to(torch.int64) - indptr[rows].to(torch.int64)
    values = block_table[rows, cols]
    if out is None:
        return values
    out[:total].copy_(values)
    out[total:].fill_(0)
    return out[:total]


_QsRows = Callable[[int], tuple[torch.Tensor, np.ndarray]]
"""``rows -> (device, host)`` views of the first ``rows`` entries of the common ``query_start_loc``."""


class _Prefix:
    """``rows -> (device, host)`` views of the first ``rows`` entries of the staged prefill query indptr
    (graph mode: of its whole buffer), the host view read-only; the same views for the same rows (cached:
    slicing a tensor costs more than the lookup)."""

    __slots__ = ("cache", "dev", "host")

    def __init__(self, dev: torch.Tensor, host: np.ndarray) -> None:
        self.dev, self.host = dev, host
        self.cache: dict[int, tuple[torch.Tensor, np.ndarray]] = {}

    def __call__(self, rows: int) -> tuple[torch.Tensor, np.ndarray]:
        found = self.cache.get(rows)
        if found is None:
            h = self.host[:rows].view()
            h.flags.writeable = False
            if len(self.cache) > 64:
                self.cache.clear()
            found = self.cache[rows] = (self.dev[:rows], h)
        return found


def _own_views(step: Step, name: str, qo: tuple[str, np.ndarray] | None) -> _Prefix | None:
    """The views of the staged prefill query indptr of ``step`` (:class:`_Prefix`), or None."""
    if qo is None:
        return None
    return _Prefix(step.device_full(name) if step.profile is not None else step.device(name), qo[1])


_PER_STEP = ("common", "paged", "qo_indptr_decode", "qo_indptr_prefill", "qo_indptr_decode_cpu",
             "qo_indptr_prefill_cpu", "num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens",
             "max_decode_query_len", "max_prefill_query_len", "max_kv_len", "kv_lens", "kv_lens_cpu")
"""The fields a step of one layout changes (:func:`_per_step` computes them; the rest are the layout's)."""


def _per_step(cm: CommonAttentionMetadata, pk: PagedKVMetadata, h: CommonHost, split: SplitCounts,
              qo: _QsRows | None, rows: _QsRows, max_kv: int, kv: torch.Tensor, kv_cpu: np.ndarray) -> tuple[Any, ...]:
    """The values of :data:`_PER_STEP` of a step, from its split and the views of its fields: every value a
    step of a layout changes, computed here for a staged and a replayed step alike."""
    qsl = h.query_start_loc_cpu
    B = h.num_reqs
    D, P = split.num_decodes, split.num_prefills
    if D == B:
        mdq, mpq = h.max_query_len, 0
    elif D == 0:
        mdq, mpq = 0, h.max_query_len
    else:
        mdq, mpq = _max_query(qsl, 0, D), _max_query(qsl, D, B)
    qd = cm.query_start_loc
    if qo is not None:  # the staged prefill indptr: graph mode its whole buffer, eager mode its P + 1 rows
        qo_d, qo_h = qo(P + 1)
    elif P == 0:
        qo_d, qo_h = rows(1)
    else:
        qo_d, qo_h = qd, qsl
    if D == B:
        qd_d, qd_h = qd, qsl
    else:
        qd_d, qd_h = rows(D + 1)
    return cm, pk, qd_d, qo_d, qd_h, qo_h, *split, mdq, mpq, max_kv, kv, kv_cpu


def _metadata(cm: CommonAttentionMetadata, pk: PagedKVMetadata, h: CommonHost, opts: FlashInferOptions,
              split: SplitCounts, kv: torch.Tensor, kv_cpu: np.ndarray, qo: _QsRows | None,
              rows: _QsRows, max_kv: int) -> FlashInferMetadata:
    """The step's FlashInfer metadata after the commit, from its split and the views of its fields."""
    _, _, qd_d, qo_d, qd_h, qo_h, nd, np_, ndt, npt, mdq, mpq, mkv, _kv, _kv_cpu = _per_step(cm, pk, h, split, qo, rows,
                                                                                           max_kv, kv, kv_cpu)
    return _make_fi(
        common=cm, paged=pk, kv_lens=kv, qo_indptr_decode=qd_d, qo_indptr_prefill=qo_d, kv_lens_cpu=kv_cpu,
        qo_indptr_decode_cpu=qd_h, qo_indptr_prefill_cpu=qo_h, num_decodes=nd, num_prefills=np_,
        num_decode_tokens=ndt, num_prefill_tokens=npt, max_decode_query_len=mdq, max_prefill_query_len=mpq,
        max_kv_len=mkv, causal=bool(opts.causal), indices=opts.indices,
    )


def _split(h: CommonHost, opts: FlashInferOptions) -> SplitCounts:
    """The step's decode/prefill split (every row a prefill row without causal attention)."""
    if opts.causal:
        return h.split(opts.decode_threshold, opts.require_uniform)
    return SplitCounts(0, h.num_reqs, 0, h.num_actual_tokens)


class FlashInferBuilder(Builder[FlashInferOptions, None, SplitCounts, FlashInferMetadata]):
    """The FlashInfer builder (:data:`FLASHINFER`).

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[3, 9, 0], num_scheduled_tokens=[2, 2, 5],
    ...                  block_table=[[4, 5, 6], [7, 8, 9], [1, 2, 3]], block_size=4)
    >>> fi = build(spec, Stager("cpu"), FlashInferOptions(decode_threshold=2, indices="device"))
    >>> fi.num_decodes, fi.max_decode_query_len, fi.paged_kv_indices_cpu is None
    (2, 2, True)
    >>> fi.paged_kv_indices
    tensor([4, 5, 7, 8, 9, 1, 2], dtype=torch.int32)
    """

    name = "flashinfer"
    options_type = FlashInferOptions
    metadata_type = FlashInferMetadata

    def needs(self, shape: StepShape, options: FlashInferOptions) -> CommonNeeds:
        """Every common field, and the common pass's page table unless DCP or device-side indices."""
        return _WITH_PAGES if options.dcp_world_size == 1 and options.indices == "host" else _WITHOUT_PAGES

    def derive(
        self, common: StagedCommon, step: Step, options: FlashInferOptions, inputs: None
    ) -> Staged[SplitCounts, FlashInferMetadata]:
        """Derive FlashInfer metadata from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step`` (reordered: decodes first); with
            ``paged_kv=True`` its page table is reused.
        step : Step
            The open step.
        options : FlashInferOptions
            Split, gather location, DCP layout, field namespace.
        inputs : None
            The builder takes no per-step inputs.

        Returns
        -------
        Staged[SplitCounts, FlashInferMetadata]
            ``.host`` is the step's decode/prefill split; ``.result()`` after the commit (with
            ``indices="device"`` it enqueues the device gather on the current stream the first time).

        Raises
        ------
        ValueError
            A block table too narrow for a row's pages.
        attnmeta.staging.CapacityError
            Graph mode: more pages than ``profile.max_num_pages``.
        """
        opts = options
        h = common.host
        qsl = h.query_start_loc_cpu
        B, page = h.num_reqs, h.block_size
        split = _split(h, opts)
        D, P = split.num_decodes, split.num_prefills
        p = opts.prefix + "."
        prof = step.profile
        graph = prof is not None
        host_indices = opts.indices == "host"
        kv_name = ""
        if opts.dcp_world_size > 1:
            kv_name = p + "kv_lens"
            kv = step.alloc(kv_name, B, np.int32, fill=0, capacity=prof.max_num_reqs if prof is not None else None)
            dcp_context_kv_lens(h.seq_lens_cpu, np.diff(qsl).astype(np.int32), opts.dcp_world_size, opts.dcp_rank,
                                opts.dcp_interleave, num_decodes=D, out=kv)
            kv.flags.writeable = False
            mkv = int(kv.max()) if B else 0
        else:
            kv = h.seq_lens_cpu
            mkv = h.max_exact_seq_len
        paged = common.paged if not kv_name and host_indices else None
        if paged is None:
            paged = stage_paged_kv(step, opts.prefix, kv, h.block_table_cpu, page, host_indices=host_indices)
        # The prefill rows' query indptr, rebased to 0. Graph mode: its own fixed buffer, always
        # written. Eager mode: staged only when both parts have rows (else a view of query_start_loc).
        qo: tuple[str, np.ndarray] | None = None
        if prof is not None:
            qo = (p + "qo_indptr_prefill", step.alloc(p + "qo_indptr_prefill", prof.max_num_reqs + 1, np.int32,
                                                      capacity=prof.max_num_reqs + 1))
            prefill_qo_indptr(qsl, D, out=qo[1])
        elif D and P:
            qo = (p + "qo_indptr_prefill", step.alloc(p + "qo_indptr_prefill", P + 1, np.int32))
            np.subtract(qsl[D : B + 1], qsl[D], out=qo[1])
        kv_host = kv
        paged_part = paged
        qo_name = qo[0] if qo is not None else ""

        def make() -> FlashInferMetadata:
            cm = common.result()
            pk = paged_part.result()
            if pk.paged_kv_indices is None:  # indices="device": gathered on the device from the staged table
                fixed = step.device_full(p + "paged_kv_indices") if graph else None
                pk = dataclasses.replace(
                    pk, paged_kv_indices=_gather_indices(pk.paged_kv_indptr, cm.block_table_tensor, pk.num_pages, fixed))
            return _metadata(cm, pk, h, opts, split, step.device(kv_name) if kv_name else cm.seq_lens, kv_host,
                             _own_views(step, qo_name, qo), common.query_start_loc_rows, mkv)

        return _Staged(step, split, make, qo)

    def replay_key(self, shape: StepShape, options: FlashInferOptions, inputs: None) -> Hashable | None:
        """Steps whose fields do not depend on their split: every row a decode row (the longest query
        within the threshold; under ``require_uniform`` past a threshold of 1, every query of the
        first's length: :attr:`~attnmeta.StepShape.uniform_queries`), every row a prefill row, or (graph
        mode, where the prefill query indptr is a fixed buffer) any split of a padded step; with
        the page table from the common pass (no DCP, host-side indices). Else None: composed."""
        if options.dcp_world_size != 1 or options.indices != "host":
            return None
        if not options.causal:
            return "prefill"
        thr = options.decode_threshold
        if shape.max_query_len <= thr and (not options.require_uniform or thr <= 1 or shape.uniform_queries):
            return "decode"
        if shape.first_query_len > thr:
            return "prefill"
        return None if shape.num_reqs_padded is None else "mixed"  # (the graph-mode buffer; else composed)

    def any_rows_key(self, shape: StepShape, options: FlashInferOptions, inputs: None) -> Hashable | None:
        """:meth:`replay_key`'s key, an unpadded mixed step's included (``"mixed"``), where it replays at all
        (no DCP, host-side indices): in graph mode its own field is a fixed buffer (the prefill query
        indptr) and its other arrays are views of the common fields, made per step."""
        if options.dcp_world_size != 1 or options.indices != "host":
            return None
        key = self.replay_key(shape, options, inputs)
        return "mixed" if key is None else key

    def reads_lengths(self, options: FlashInferOptions) -> bool:
        """False: neither :meth:`needs` nor :meth:`replay_key` reads the step's lengths."""
        return False

    def replayer(self, staged: Staged[SplitCounts, FlashInferMetadata], common: StagedCommon, step: Step,
                 options: FlashInferOptions, inputs: None) -> _Replayer | None:
        """Replays of the layouts :meth:`replay_key` names (graph mode rewrites the prefill query indptr)."""
        assert isinstance(staged, _Staged)
        if common.paged is None or (staged.qo is not None and step.profile is None):
            return None  # (eager mode stages the prefill indptr only for mixed steps, never replayed)
        return _Replayer(staged.result(), step, options, staged.qo)

    def unsupported_reasons(self, spec: BatchSpec, options: FlashInferOptions, inputs: None) -> list[str]:
        """A context-parallel spec whose world size is not the options' ``dcp_world_size`` (its table's
        columns hold ``block_size * world_size`` tokens; the pages are then the rank's own)."""
        cp = spec.context_parallel
        if cp is not None and cp.world_size != options.dcp_world_size:
            return [f"the spec's context_parallel.world_size={cp.world_size} != FlashInferOptions.dcp_world_size="
                    f"{options.dcp_world_size}: set dcp_world_size (and dcp_rank) to the spec's layout"]
        return []


class _Staged(Staged[SplitCounts, FlashInferMetadata]):
    """A staged FlashInfer step: its split, and its own prefill query indptr (for a replayer)."""

    __slots__ = ("qo",)

    def __init__(self, step: Step, split: SplitCounts, make: Callable[[], FlashInferMetadata],
                 qo: tuple[str, np.ndarray] | None) -> None:
        super().__init__(step, split, make)
        self.qo = qo


class _Replayer(Replayer[None, FlashInferMetadata]):
    """Replays of a FlashInfer layout whose page table the common pass writes: graph mode rewrites the
    fixed prefill query indptr; then the recorded step's metadata with this step's :data:`_PER_STEP`
    values (:func:`_per_step`). The decode query starts come from the common ``query_start_loc``, sliced
    once per layout and row count."""

    __slots__ = ("make", "options", "qd", "qh", "qo", "qo_views", "rows_cache")

    def __init__(self, recorded: FlashInferMetadata, step: Step, options: FlashInferOptions,
                 qo: tuple[str, np.ndarray] | None) -> None:
        self.options, self.qo = options, qo
        self.qo_views = _own_views(step, qo[0], qo) if qo is not None else None
        self.rows_cache: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
        self.qd: torch.Tensor | None = None
        self.qh: np.ndarray | None = None
        self.make = template(recorded, _PER_STEP)

    def rewrite(self, step: Step, host: CommonHost, inputs: None) -> None:
        if self.qo is not None:
            prefill_qo_indptr(host.query_start_loc_cpu, _split(host, self.options).num_decodes, out=self.qo[1])

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: None) -> FlashInferMetadata:
        assert paged is not None
        self.qd, self.qh = common.query_start_loc, host.query_start_loc_cpu
        return self.make(*_per_step(common, paged, host, _split(host, self.options), self.qo_views, self.rows,
                                    host.max_exact_seq_len, common.seq_lens, host.seq_lens_cpu))

    def rows(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """The device and host views of this step's common ``query_start_loc``'s first ``n`` entries (the
        same views while the layout lasts, cached)."""
        qd, qh = self.qd, self.qh
        assert qd is not None and qh is not None
        found = self.rows_cache.get(n)
        if found is None or found[0] is not qd:
            if len(self.rows_cache) > 64:
                self.rows_cache.clear()
            found = self.rows_cache[n] = (qd, qd[:n], qh[:n])
        return found[1], found[2]


_WITH_PAGES = CommonNeeds(paged_kv=True)
_WITHOUT_PAGES = CommonNeeds()
FLASHINFER = register(FlashInferBuilder())
"""The registered FlashInfer builder."""
stage = FLASHINFER.stage
build = FLASHINFER.build
