"""FlashInfer paged-KV metadata (vllm-semantics.md section 8), derived on the host.

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
0). ``Step.device_full(prefix + ".<field>")`` gives the full-capacity views to capture over. With
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
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch

from attnmeta._fields import MetadataBase, Staged, fast_constructor
from attnmeta.backends._shared import require_same_step
from attnmeta.host.flash_attn import dcp_context_kv_lens
from attnmeta.host.paged import (  # private kernels: inputs were validated when common was staged
    _flashinfer_nb,
    _num_pages_nb,
    num_pages,
    paged_kv_indptr,
    paged_kv_last_page_len,
    paged_kv_layout,
)
from attnmeta.host.split import SplitCounts
from attnmeta.metadata import CommonAttentionMetadata, _bucket, common_split, stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import CapacityError, Stager, Step

__all__ = ["FlashInferMetadata", "FlashInferOptions", "build", "host_tensor", "stage"]


class FlashInferOptions(NamedTuple):
    """Options of the FlashInfer builder."""

    decode_threshold: int = 1
    """Longest query counted as a decode (vLLM's ``reorder_batch_threshold``; ``1 + k`` with ``k``
    speculative tokens when spec decode runs as decode)."""
    require_uniform: bool = True
    """Decode rows must share one query length (vLLM: ``True`` for the native FlashInfer and FA2 decode
    paths, ``False`` for XQA / trtllm-gen varlen)."""
    causal: bool = True
    """Causal attention. When False every row is a prefill (vLLM splits only causal batches)."""
    indices: Literal["host", "device"] = "host"
    """Where ``paged_kv_indices`` is gathered: ``"host"`` (compiled, staged with the step) or
    ``"device"`` (only the indptr is staged; the gather runs on the device from the staged block
    table when :meth:`Staged.result` is first called, on the current stream)."""
    dcp_world_size: int = 1
    """Decode-context-parallel world size ``W`` (1: off)."""
    dcp_rank: int = 0
    """This rank, ``0 <= dcp_rank < dcp_world_size``."""
    dcp_interleave: int = 1
    """Consecutive tokens per DCP rank (``cp_kv_cache_interleave_size``)."""
    prefix: str = "flashinfer"
    """Namespace of this builder's staged fields."""


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
    # ---- device fields
    paged_kv_indptr: torch.Tensor
    """(num_reqs + 1,) int32, device. ``[0, cumsum(cdiv(kv_lens, page_size))]``; padding rows repeat
    the last value (they have no pages)."""
    paged_kv_indices: torch.Tensor
    """(num_pages,) int32, device. Page ids of row 0, then row 1, ...:
    ``paged_kv_indices[indptr[i]:indptr[i+1]] = block_table[i, :indptr[i+1] - indptr[i]]``."""
    paged_kv_last_page_len: torch.Tensor
    """(num_reqs,) int32, device. Tokens in each row's last page: ``page_size`` if ``kv_lens % page_size
    == 0`` and ``kv_lens != 0``, else ``kv_lens % page_size`` (0 for padding rows)."""
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
    paged_kv_indptr_cpu: np.ndarray
    """(num_reqs + 1,) int32, host (pinned staged view). Twin of ``paged_kv_indptr``."""
    paged_kv_indices_cpu: np.ndarray | None
    """(num_pages,) int32, host (pinned staged view), twin of ``paged_kv_indices``; ``None`` with
    ``indices="device"`` (never computed on the host)."""
    paged_kv_last_page_len_cpu: np.ndarray
    """(num_reqs,) int32, host (pinned staged view). Twin of ``paged_kv_last_page_len``."""
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
    num_pages: int
    """``paged_kv_indptr_cpu[-1]``: length of ``paged_kv_indices``."""
    page_size: int
    """Tokens per KV page (the block size)."""
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


_new_fi = fast_constructor(FlashInferMetadata)


_STAGED = ("paged_kv_indptr", "paged_kv_last_page_len", "qo_indptr_prefill", "paged_kv_indices", "kv_lens")
_NAMES: dict[str, tuple[str, ...]] = {}  # prefix -> staged field names
_I32 = np.dtype(np.int32)


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing a host array's memory, for APIs that take host tensors (``plan()``).

    The metadata's host arrays are read-only views of the step's pinned slot; ``torch.from_numpy``
    warns about read-only arrays, this does not. On CUDA the result ``is_pinned()``, so a
    ``non_blocking=True`` copy from it is real DMA. Do not write into it; it is valid as long as the
    array (until the stager reuses the step's slot).

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
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _max_len(indptr: np.ndarray, start: int, stop: int) -> int:
    """``max(diff(indptr[start:stop+1]))``, 0 for an empty range (host)."""
    if stop <= start:
        return 0
    return int((indptr[start + 1 : stop + 1] - indptr[start:stop]).max())


_CHECKED: set[FlashInferOptions] = set()  # options already validated (a NamedTuple of hashables)


def _check_options(options: FlashInferOptions) -> None:
    if options in _CHECKED:
        return
    if options.indices not in ("host", "device"):
        raise ValueError(f"FlashInferOptions.indices: must be 'host' or 'device', got {options.indices!r}")
    w, r = options.dcp_world_size, options.dcp_rank
    if not (isinstance(w, int) and w >= 1 and isinstance(r, int) and 0 <= r < w):
        raise ValueError(f"FlashInferOptions: need dcp_world_size >= 1 and 0 <= dcp_rank < dcp_world_size, got {w}, {r}")
    if len(_CHECKED) < 256:
        _CHECKED.add(options)


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


_DEFAULT_OPTIONS = FlashInferOptions()
_DEFAULT_QO = f"{_DEFAULT_OPTIONS.prefix}.qo_indptr_prefill"


def stage(
    common: Staged[CommonAttentionMetadata], step: Step, options: FlashInferOptions = _DEFAULT_OPTIONS
) -> Staged[FlashInferMetadata]:
    """Derive FlashInfer metadata from the staged common metadata, staging into the same step.

    Parameters
    ----------
    common : Staged[CommonAttentionMetadata]
        From :func:`attnmeta.stage_common` on the same ``step`` (reordered: decodes first).
    step : Step
        The open step.
    options : FlashInferOptions
        Split, gather location, DCP layout, field namespace.

    Returns
    -------
    Staged[FlashInferMetadata]
        ``.result()`` after the commit (with ``indices="device"`` it enqueues the device gather on the
        current stream the first time). ``.host`` holds ``split`` (:class:`~attnmeta.host.split.SplitCounts`)
        and the host arrays, for other builders of the same step.

    Raises
    ------
    ValueError
        Bad options, a block table too narrow for a row's pages, or ``common`` from another step.
    attnmeta.staging.CapacityError
        Graph mode: more pages than ``profile.max_num_pages``.
    """
    if common.step is not step:
        require_same_step(common, step)  # raises
    h = common.host
    if options is _DEFAULT_OPTIONS and "_paged" in h:  # the steady-state decode path, nothing to check
        split = common_split(h, decode_threshold=1, require_uniform=True)
        return _stage_reusing_common(common, step, options, split, h["_paged"], _DEFAULT_QO)
    _check_options(options)
    qsl, sl, bt = h["query_start_loc_cpu"], h["seq_lens_cpu"], h["block_table_cpu"]
    B, T, page = h["num_reqs"], h["num_actual_tokens"], h["block_size"]
    names = _NAMES.get(options.prefix)
    if names is None:
        names = _NAMES[options.prefix] = tuple(f"{options.prefix}.{n}" for n in _STAGED)
    n_indptr, n_last, n_qo, n_indices, n_kv = names
    prof = step.profile
    req_cap = prof.max_num_reqs if prof is not None else None
    host_indices = options.indices == "host"
    if options.causal:
        split = common_split(h, decode_threshold=options.decode_threshold, require_uniform=options.require_uniform)
    else:
        split = SplitCounts(0, B, 0, T)
    D, P = split.num_decodes, split.num_prefills

    dcp = options.dcp_world_size > 1
    paged = h.get("_paged")
    if paged is not None and not dcp and host_indices:
        return _stage_reusing_common(common, step, options, split, paged, n_qo)
    if dcp:
        kv = step.alloc(n_kv, B, np.int32, fill=0, capacity=req_cap)
        dcp_context_kv_lens(sl, np.diff(qsl).astype(np.int32), options.dcp_world_size, options.dcp_rank,
                            options.dcp_interleave, num_decodes=D, out=kv)
        code, _row, total = _num_pages_nb(kv, page)
        if code:
            num_pages(kv, page)  # raises the detailed error
        total = int(total)
    else:
        kv = sl
        total = h["num_pages"]  # sum(cdiv(seq_lens, page)), from the spec's validation pass
    if prof is not None and total > prof.max_num_pages:
        raise CapacityError(
            f"{n_indices}: needs {total} pages but its graph-mode capacity is {prof.max_num_pages} "
            f"(StaticProfile.max_num_pages)"
        )
    idx_group = None
    if req_cap is None:
        if host_indices:
            # The page count changes almost every step; staging the indices with a bucketed row count
            # (<= 12.5% slack, never read) keeps the group's layout, so its cached views, stable.
            rows = _bucket(total)
            fixed = step.alloc_fields(lambda: ((n_indptr, B + 1, _I32, None, 0), (n_last, B, _I32, None, 0),
                                               (n_qo, P + 1, _I32, None, 0), (n_indices, rows, _I32, None, 0)),
                                      (names, B, P, rows))
            idx_group = fixed
        else:
            fixed = step.alloc_fields(((n_indptr, B + 1, _I32, None, 0), (n_last, B, _I32, None, 0),
                                       (n_qo, P + 1, _I32, None, 0)))
    else:  # graph mode: the indptrs stage their full capacity (their sentinel repeats the last value)
        assert prof is not None
        fixed = step.alloc_fields(((n_indptr, req_cap + 1, _I32, req_cap + 1, 0), (n_last, B, _I32, req_cap, 0),
                                   (n_qo, req_cap + 1, _I32, req_cap + 1, 0)))
        if host_indices:  # exactly ``total`` rows: the rest of the fixed buffer is refilled with the sentinel
            idx_group = step.alloc_fields(((n_indices, total, _I32, prof.max_num_pages, 0),))
        else:  # reserve the fixed device buffer the gather writes into; nothing is staged
            step.alloc(n_indices, 0, np.int32, capacity=prof.max_num_pages)
    indptr_full, last, qo_full = fixed.host[:3]
    views = fixed.extras.get("views")
    if views is None:
        views = fixed.extras["views"] = (fixed.frozen[0][: B + 1], fixed.frozen[1], fixed.frozen[2][: P + 1])
    indptr_ro, last_ro, qo_ro = views
    indices_ro: np.ndarray | None = None
    idx_views = None
    if idx_group is not None:
        idx_views = idx_group.extras.get("indices")
        if idx_views is None or idx_views[0] != total:
            i = len(idx_group.fields) - 1
            idx_views = idx_group.extras["indices"] = (total, idx_group.host[i][:total], idx_group.frozen[i][:total],
                                                       None)
        indices_ro = idx_views[2]
        code, _r, _c, mdq, mpq, mkv = _flashinfer_nb(kv, bt, page, qsl, D, indptr_full, idx_views[1], last, qo_full)
        if code:  # an inconsistent block table: the validating wrapper raises the detailed error
            paged_kv_layout(kv, bt, page, indptr_out=indptr_full[: B + 1], indices_out=idx_views[1],
                            last_page_len_out=last)
            raise AssertionError("unreachable")  # pragma: no cover
    else:
        if B and -(-int(kv.max()) // page) > bt.shape[1]:
            i = int(np.argmax(kv))
            raise ValueError(
                f"block_table: row {i} needs cdiv(kv_lens[{i}]={int(kv[i])}, page_size={page}) pages but the "
                f"staged table has {bt.shape[1]} columns (request {i})"
            )
        paged_kv_indptr(kv, page, out=indptr_full[: B + 1])
        paged_kv_last_page_len(kv, page, out=last)
        indptr_full[B + 1 :] = indptr_full[B]
        np.subtract(qsl[D : B + 1], qsl[D], out=qo_full[: P + 1])
        qo_full[P + 1 :] = qo_full[P]
        mdq, mpq, mkv = _max_len(qsl, 0, D), _max_len(qsl, D, B), (int(kv.max()) if B else 0)
    kv_ro = kv
    if dcp:
        kv_ro = kv.view()
        kv_ro.flags.writeable = False
    qo_dec_ro = qsl[: D + 1]
    causal = bool(options.causal)
    host = _host_dict(split, indptr_ro, indices_ro, last_ro, kv_ro, qo_dec_ro, qo_ro, total, page, mdq, mpq, mkv,
                      causal, options.indices)

    def make() -> FlashInferMetadata:
        cm = common.result()
        full_d = fixed.device(step)  # raises if the step has not committed or has expired
        dev = fixed.extras.get("device")
        if dev is None:
            indptr_d, last_d, qo_d = full_d[:3]
            dev = fixed.extras["device"] = (indptr_d[: B + 1] if req_cap is not None else indptr_d, last_d,
                                            qo_d[: P + 1] if req_cap is not None else qo_d)
        indptr_d, last_d, qo_d = dev
        indices_d: torch.Tensor
        if idx_group is not None:
            assert idx_views is not None
            cached_d = idx_views[3]
            if cached_d is None:  # the device slice of this group's indices, cached with its length
                full_idx = idx_group.device(step)[-1]
                cached_d = full_idx[:total] if full_idx.shape[0] != total else full_idx
                idx_group.extras["indices"] = (*idx_views[:3], cached_d)
            indices_d = cached_d
        else:
            fixed_out = step.device_full(n_indices) if prof is not None else None
            indices_d = _gather_indices(indptr_d, cm.block_table_tensor, total, fixed_out)
        qd = cm.query_start_loc
        return _new_fi(
            cm, indptr_d, indices_d, last_d, step.device(n_kv) if dcp else cm.seq_lens,
            qd if D == B and req_cap is None else qd[: D + 1], qo_d,
            indptr_ro, indices_ro, last_ro, kv_ro, qo_dec_ro, qo_ro,
            D, P, split.num_decode_tokens, split.num_prefill_tokens, total, page, mdq, mpq, mkv, causal,
            options.indices,
        )

    return Staged(step, host, make)


def _host_dict(
    split: SplitCounts, indptr: np.ndarray, indices: np.ndarray | None, last: np.ndarray, kv: np.ndarray,
    qo_decode: np.ndarray, qo_prefill: np.ndarray, total: int, page: int, mdq: int, mpq: int, mkv: int,
    causal: bool, indices_mode: str,
) -> dict[str, Any]:
    """``Staged[FlashInferMetadata].host``: the split, the host arrays and the scalars."""
    return {
        "split": split,
        "paged_kv_indptr_cpu": indptr,
        "paged_kv_indices_cpu": indices,
        "paged_kv_last_page_len_cpu": last,
        "kv_lens_cpu": kv,
        "qo_indptr_decode_cpu": qo_decode,
        "qo_indptr_prefill_cpu": qo_prefill,
        "num_decodes": split.num_decodes,
        "num_prefills": split.num_prefills,
        "num_decode_tokens": split.num_decode_tokens,
        "num_prefill_tokens": split.num_prefill_tokens,
        "num_pages": total,
        "page_size": page,
        "max_decode_query_len": mdq,
        "max_prefill_query_len": mpq,
        "max_kv_len": mkv,
        "causal": causal,
        "indices": indices_mode,
    }


def _stage_reusing_common(
    common: Staged[CommonAttentionMetadata], step: Step, options: FlashInferOptions, split: SplitCounts,
    paged: tuple[Any, ...], n_qo: str,
) -> Staged[FlashInferMetadata]:
    """:func:`stage` when the common metadata was staged with ``paged_kv=True`` (eager mode): the
    paged-KV arrays are the common's (built in its pass); only the prefill query indptr is left, and
    with no prefill row it is ``query_start_loc[:1] == [0]``, a view."""
    h = common.host
    indptr_ro, last_ro, indices_ro, total = paged
    group = h["_group"][0]  # the common's group: the paged fields are its last three
    qsl = h["query_start_loc_cpu"]
    B, page = h["num_reqs"], h["block_size"]
    D, P = split.num_decodes, split.num_prefills
    qo_group = None
    if P == 0:
        qo_ro = qsl[:1]
        mdq, mpq = h["max_query_len"], 0
    else:
        qo_group = step.alloc_fields(((n_qo, P + 1, _I32, None, 0),))
        np.subtract(qsl[D : B + 1], qsl[D], out=qo_group.host[0])
        qo_ro = qo_group.frozen[0]
        mdq, mpq = _max_len(qsl, 0, D), _max_len(qsl, D, B)
    mkv = h["max_exact_seq_len"]
    qo_dec_ro = qsl[: D + 1] if D < B else qsl
    causal = bool(options.causal)
    host = _host_dict(split, indptr_ro, indices_ro, last_ro, h["seq_lens_cpu"], qo_dec_ro, qo_ro, total, page, mdq,
                      mpq, mkv, causal, "host")

    def make() -> FlashInferMetadata:
        cm = common.result()
        d = group.device(step)  # raises if the step has not committed or has expired
        extras = group.extras
        qd = cm.query_start_loc
        # Views cached with the group: the page indices by page count (it changes about every step),
        # the empty prefill part by the common's device view (it does not).
        cached = extras.get("fi_device")
        if cached is None or cached[0] != total:
            cached = extras["fi_device"] = (total, d[7][:total])
        qo0 = extras.get("fi_qo0")
        if qo0 is None or qo0[0] is not qd:
            qo0 = extras["fi_qo0"] = (qd, qd[:1])
        return _new_fi(
            cm, d[5], cached[1], d[6], cm.seq_lens,
            qd if D == B else qd[: D + 1], qo0[1] if qo_group is None else qo_group.device(step)[0],
            indptr_ro, indices_ro, last_ro, h["seq_lens_cpu"], qo_dec_ro, qo_ro,
            D, P, split.num_decode_tokens, split.num_prefill_tokens, total, page, mdq, mpq, mkv, causal, "host",
        )

    return Staged(step, host, make)


def build(spec: BatchSpec, stager: Stager, options: FlashInferOptions = FlashInferOptions()) -> FlashInferMetadata:
    """Common + FlashInfer metadata of ``spec`` in one step of its own (one copy).

    Parameters
    ----------
    spec : BatchSpec
        The step (reordered: decodes first).
    stager : Stager
        Owns the pinned ring; the step commits before this returns.
    options : FlashInferOptions
        As for :func:`stage`.

    Returns
    -------
    FlashInferMetadata
        Device fields are views into the step's upload.

    Raises
    ------
    ValueError, attnmeta.staging.CapacityError
        As for :func:`stage` and :func:`attnmeta.stage_common`.

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
    with stager.step() as step:
        staged = stage(stage_common(spec, step), step, options)
    return staged.result()
