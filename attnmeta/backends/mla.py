"""MLA (multi-head latent attention) metadata of vLLM 0.33.0's dense MLA builders, derived on the host.

One builder serves the four decode variants as an option (docs/semantics-attention.md, "MLA"):

============== ============== ============= ==============================================
variant        threshold      rule          decode ``max_query_len``
============== ============== ============= ==============================================
flashmla       128            uniform       measured (max decode q, host)
flashattn_mla  512            varlen        measured
flashinfer_mla 1              varlen        promised ``min(batch max_query_len, threshold)``
triton_mla     1              uniform       promised; plus ``num_kv_splits``
============== ============== ============= ==============================================

With ``num_speculative_tokens = k`` the threshold is ``max(threshold, 1 + k)``; with DCP > 1 it is 1
except FlashAttention-MLA with interleave 1 and FlashInfer-MLA (which keep it). The split is the
common host part's :meth:`~attnmeta.metadata.CommonHost.split` (vLLM ``split_decodes_and_prefills``
with ``require_uniform`` for the uniform variants): MLA's rule is that function, nothing of its own.

The prefill part's chunked context (:func:`attnmeta.host.mla.plan_context_chunks`) is planned on the
host and every per-chunk device field is a slice of one flat staged array, so the whole
``ChunkedContextMetadata`` travels in the step's one copy (vLLM uploads 4-6 tensors per build).

FlashMLA's tile schedule (``tile_scheduler_metadata``, ``num_splits``) is computed on the device in
0.33.0 by the first ``flash_mla_with_kvcache`` call of a step, from the device ``seq_lens``; attnmeta
hands it ``decode_seq_lens`` (device, local under DCP) and the host ints ``decode_max_query_len`` and
``num_decode_tokens``, and stages no schedule (``scheduler_metadata`` is always None here, as is
FlashAttention-MLA's FA3 AOT schedule, a device call a backend can make on these fields).

The builder is :data:`MLA` (registry name ``"mla"``); :func:`stage` and :func:`build` are its methods.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, padding included; ``num_actual_tokens`` (``T``): tokens.
- ``num_decodes`` (``D``), ``num_prefills`` (``P = B - D``), ``num_decode_tokens`` (``Dt``).
- ``num_pieces``, ``num_cu``, ``num_context_tokens``, ``num_local_context_tokens``: the chunk plan's
  sizes (:mod:`attnmeta.host.mla`).
- ``max_blocks``: staged block-table columns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from typing import ClassVar, Literal

import numpy as np
import torch

from attnmeta._checks import check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory, template
from attnmeta.builder import Builder, Replayer, register
from attnmeta.host.mla import (
    MLAContextChunks,
    dcp_local_context_lens,
    flattened_row_requests,
    plan_context_chunks,
    triton_num_kv_splits,
)
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import CapacityError, Staged, Step

__all__ = [
    "MLA",
    "MLABuilder",
    "MLAChunk",
    "MLAMetadata",
    "MLAOptions",
    "build",
    "mla_decode_threshold",
    "stage",
]

Variant = Literal["flashmla", "flashattn_mla", "flashinfer_mla", "triton_mla"]
_VARIANTS: tuple[str, ...] = ("flashmla", "flashattn_mla", "flashinfer_mla", "triton_mla")
_CLASS_THRESHOLD = {"flashmla": 128, "flashattn_mla": 512, "flashinfer_mla": 1, "triton_mla": 1}
_UNIFORM = ("flashmla", "triton_mla")
_NON_CAUSAL_OK = ("flashinfer_mla", "triton_mla")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MLAOptions:
    """Options of the MLA builder (validated when constructed).

    Examples
    --------
    >>> MLAOptions(variant="flashattn_mla").variant
    'flashattn_mla'
    >>> MLAOptions(variant="flashinfer_mla", dcp_world_size=2, dcp_interleave=8)
    Traceback (most recent call last):
    ValueError: MLAOptions.dcp_interleave: flashinfer_mla needs dcp_interleave == 1 under DCP, got 8
    """

    variant: Variant = dataclasses.field(default="flashmla", metadata=option_rule("choice", choices=_VARIANTS))
    """Decode kernel family: its threshold, split rule and decode fields (module docstring)."""
    num_speculative_tokens: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0))
    """Draft tokens ``k`` per request: the threshold becomes ``max(threshold, 1 + k)``."""
    workspace_size: int = dataclasses.field(default=65536, metadata=option_rule("int", minimum=1))
    """Chunked-context workspace rows ``WS`` (:func:`attnmeta.host.mla.workspace_size`)."""
    align_chunk_to_block: bool = dataclasses.field(default=True, metadata=option_rule("bool"))
    """Split rows at multiples of the block size (vLLM: always True)."""
    align_indptr: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """Start each chunk's indptr lists at a multiple of 4 entries (TRTLLM-ragged cute-dsl prefill)."""
    causal: bool | None = dataclasses.field(default=None, metadata=option_rule("bool", allow_none=True))
    """False: non-causal multi-token decode (every row a decode; FlashInfer-MLA and Triton-MLA only);
    None: the common metadata's ``causal``."""
    num_sms: int = dataclasses.field(default=132, metadata=option_rule("int", minimum=1))
    """Streaming multiprocessors (caps Triton-MLA's ``num_kv_splits`` at ``2 * num_sms``)."""
    dcp_world_size: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Decode-context-parallel world size ``W`` (1: off)."""
    dcp_rank: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0, below="dcp_world_size"))
    """This rank, ``0 <= dcp_rank < dcp_world_size``."""
    dcp_interleave: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Consecutive tokens per DCP rank ``I`` (``cp_kv_cache_interleave_size``)."""
    prefix: str = dataclasses.field(default="mla", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)
        if self.variant == "flashinfer_mla" and self.dcp_world_size > 1 and self.dcp_interleave != 1:
            raise ValueError(f"MLAOptions.dcp_interleave: flashinfer_mla needs dcp_interleave == 1 under DCP, "
                             f"got {self.dcp_interleave}")
        if self.causal is False and self.variant not in _NON_CAUSAL_OK:
            raise ValueError(f"MLAOptions.causal: non-causal decode needs variant flashinfer_mla or triton_mla, "
                             f"got {self.variant!r}")


def mla_decode_threshold(options: MLAOptions) -> int:
    """The variant's decode threshold after spec decode and DCP (vLLM ``_init_reorder_batch_threshold``).

    Examples
    --------
    >>> mla_decode_threshold(MLAOptions()), mla_decode_threshold(MLAOptions(variant="triton_mla",
    ...     num_speculative_tokens=2)), mla_decode_threshold(MLAOptions(dcp_world_size=2))
    (128, 3, 1)
    """
    thr = max(_CLASS_THRESHOLD[options.variant], 1 + options.num_speculative_tokens)
    if options.dcp_world_size > 1:
        keeps = options.variant == "flashinfer_mla" or (
            options.variant == "flashattn_mla" and options.dcp_interleave == 1)
        if not keeps:
            thr = 1
    return thr


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MLAChunk(MetadataBase):
    """One context chunk (vLLM ``ContextChunk``): device views into the flat fields, host ints. It
    expires with the step of the :class:`MLAMetadata` it came from (:meth:`MLAMetadata.chunk`)."""

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("query_start_loc", "cu_seq_lens", "starts", "token_to_seq",
                                                 "padded_local_cu_seq_lens", "padded_local_token_to_seq")
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ("seq_lens", "padded_local_seq_lens", "local_context_lens_allranks")
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "index", "request_slice", "token_slice", "continuation_token_end", "is_continuation", "num_context_tokens",
        "num_local_context_tokens", "max_query_len", "max_seq_len", "all_rows_active")

    index: int
    """Chunk number."""
    request_slice: slice
    """Prefill rows of the chunk."""
    token_slice: slice
    """Prefill-local tokens of the chunk."""
    continuation_token_end: int
    """End of the first row's tokens."""
    is_continuation: bool
    """The first row continues a row split in the previous chunk."""
    num_context_tokens: int
    """Context rows gathered (global)."""
    num_local_context_tokens: int
    """DCP: local rows (else ``num_context_tokens``)."""
    max_query_len: int
    """Longest query of the chunk's rows."""
    max_seq_len: int
    """Longest piece."""
    all_rows_active: bool
    """Every row has q > 0 and a piece > 0."""
    query_start_loc: torch.Tensor
    """(n + 1,) int32, device."""
    cu_seq_lens: torch.Tensor
    """(n + 1,) int32, device."""
    starts: torch.Tensor
    """(n,) int32, device (local starts under DCP)."""
    seq_lens: np.ndarray
    """(n,) int32, host."""
    token_to_seq: torch.Tensor
    """(num_context_tokens,) int32, device."""
    padded_local_seq_lens: np.ndarray | None
    """(n,) int32, host, DCP only."""
    padded_local_cu_seq_lens: torch.Tensor | None
    """(n + 1,) int32, device, DCP only."""
    padded_local_token_to_seq: torch.Tensor | None
    """(num_local_context_tokens,) int32, device, DCP only."""
    local_context_lens_allranks: np.ndarray | None
    """(n, dcp_world_size) int32, host, DCP only."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MLAMetadata(MetadataBase):
    """Metadata of vLLM's dense MLA builders (``MLACommonMetadata`` with its prefill and decode parts).

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[48, 59, 7, 1000, 0], num_scheduled_tokens=[2, 2, 2, 200, 7],
    ...                  block_table=[[1] * 19] * 5, block_size=64)
    >>> m = build(spec, Stager("cpu"), MLAOptions(workspace_size=512))
    >>> m.num_decodes, m.num_prefills, m.prefill_max_query_len, m.decode_seq_lens.tolist()
    (3, 2, 200, [50, 61, 9])
    >>> m.context_lens.tolist(), m.chunk_seq_lens_cpu.tolist(), m.chunk_starts.tolist()
    ([1000, 0], [512, 488], [0, 512])
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc", "seq_lens", "block_table", "slot_mapping", "decode_query_start_loc",
        "decode_seq_lens", "decode_dcp_tot_seq_lens", "decode_row_req", "decode_flattened_seq_lens",
        "prefill_query_start_loc", "context_lens", "chunk_starts", "chunk_cu_seq_lens", "chunk_cu_seqlens_q",
        "chunk_token_to_seq", "chunk_padded_local_cu_seq_lens", "chunk_padded_local_token_to_seq",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc_cpu", "decode_seq_lens_cpu", "decode_row_req_cpu", "decode_flattened_seq_lens_cpu",
        "prefill_query_start_loc_cpu", "prefill_query_lens_cpu", "context_lens_cpu", "chunk_starts_cpu",
        "chunk_seq_lens_cpu", "chunk_cu_seq_lens_cpu", "chunk_cu_seqlens_q_cpu", "chunk_token_to_seq_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "num_decodes", "num_decode_tokens",
        "num_prefills", "num_prefill_tokens", "causal", "decode_threshold", "decode_max_query_len",
        "prefill_max_query_len", "num_kv_splits", "num_chunks",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("query_start_loc", "query_start_loc_cpu"), ("decode_seq_lens", "decode_seq_lens_cpu"),
        ("decode_row_req", "decode_row_req_cpu"), ("decode_flattened_seq_lens", "decode_flattened_seq_lens_cpu"),
        ("prefill_query_start_loc", "prefill_query_start_loc_cpu"), ("context_lens", "context_lens_cpu"),
        ("chunk_starts", "chunk_starts_cpu"), ("chunk_cu_seq_lens", "chunk_cu_seq_lens_cpu"),
        ("chunk_cu_seqlens_q", "chunk_cu_seqlens_q_cpu"), ("chunk_token_to_seq", "chunk_token_to_seq_cpu"),
    )

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32, device. The full batch's query starts (CAM passthrough)."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32, device. Global sequence lengths (CAM passthrough)."""
    block_table: torch.Tensor
    """(num_reqs, max_blocks) int32, device. Decode rows ``[:D]``, prefill rows ``[D:]``."""
    slot_mapping: torch.Tensor
    """(num_actual_tokens,) int64, device. KV-cache write slots; padding -1."""
    decode_query_start_loc: torch.Tensor
    """(num_decodes + 1,) int32, device. ``query_start_loc[:D + 1]``."""
    decode_seq_lens: torch.Tensor
    """(num_decodes,) int32, device. ``seq_lens[:D]``; under DCP this rank's local lengths."""
    decode_dcp_tot_seq_lens: torch.Tensor | None
    """(num_decodes,) int32, device, DCP only (else None). Global ``seq_lens[:D]``."""
    decode_row_req: torch.Tensor | None
    """(num_decode_tokens,) int64, device; FlashInfer-MLA non-causal only (else None). Request of each
    flattened query row; ``block_table[decode_row_req]`` is the flattened block table."""
    decode_flattened_seq_lens: torch.Tensor | None
    """(num_decode_tokens,) int32, device; FlashInfer-MLA non-causal only. ``decode_seq_lens[row_req]``."""
    prefill_query_start_loc: torch.Tensor
    """(num_prefills + 1,) int32, device. ``qsl[D:] - qsl[D]``."""
    context_lens: torch.Tensor
    """(num_prefills,) int32, device. Context of each prefill row (``seq_lens - query_lens``)."""
    chunk_starts: torch.Tensor
    """(num_pieces,) int32, device. Every chunk's ``starts`` (local offsets under DCP), concatenated."""
    chunk_cu_seq_lens: torch.Tensor
    """(num_cu,) int32, device. Every chunk's ``cu_seq_lens``, concatenated (``align_indptr`` zeros)."""
    chunk_cu_seqlens_q: torch.Tensor
    """(num_cu,) int32, device. Every chunk's ``query_start_loc``, concatenated."""
    chunk_token_to_seq: torch.Tensor
    """(num_context_tokens,) int32, device. Every chunk's ``token_to_seq``, concatenated."""
    chunk_padded_local_cu_seq_lens: torch.Tensor | None
    """(num_cu,) int32, device, DCP only (else None)."""
    chunk_padded_local_token_to_seq: torch.Tensor | None
    """(num_local_context_tokens,) int32, device, DCP only (else None)."""
    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host twin."""
    decode_seq_lens_cpu: np.ndarray
    """(num_decodes,) int32, host twin."""
    decode_row_req_cpu: np.ndarray | None
    """(num_decode_tokens,) int64, host twin."""
    decode_flattened_seq_lens_cpu: np.ndarray | None
    """(num_decode_tokens,) int32, host twin."""
    prefill_query_start_loc_cpu: np.ndarray
    """(num_prefills + 1,) int32, host twin."""
    prefill_query_lens_cpu: np.ndarray
    """(num_prefills,) int32, host. ``diff(prefill_query_start_loc_cpu)``."""
    context_lens_cpu: np.ndarray
    """(num_prefills,) int32, host twin."""
    chunk_starts_cpu: np.ndarray
    """(num_pieces,) int32, host twin."""
    chunk_seq_lens_cpu: np.ndarray
    """(num_pieces,) int32, host. Every chunk's ``seq_lens`` (vLLM keeps them on the host)."""
    chunk_cu_seq_lens_cpu: np.ndarray
    """(num_cu,) int32, host twin."""
    chunk_cu_seqlens_q_cpu: np.ndarray
    """(num_cu,) int32, host twin."""
    chunk_token_to_seq_cpu: np.ndarray
    """(num_context_tokens,) int32, host twin."""
    chunk_plan: MLAContextChunks | None
    """The host plan (per-chunk offsets and ints); None when no prefill row has context."""
    num_reqs: int
    """Rows, padding included."""
    num_actual_tokens: int
    """Tokens, padding included."""
    max_query_len: int
    """The batch's longest query (CAM)."""
    max_seq_len: int
    """CAM ``max_seq_len``; **quirk**: under DCP with decodes, the local bound ``cdiv(max_seq_len, W*I)*I``."""
    num_decodes: int
    """Leading decode rows ``D``."""
    num_decode_tokens: int
    """Tokens of the decode rows."""
    num_prefills: int
    """Prefill rows ``P`` (trailing padding rows after the first prefill included)."""
    num_prefill_tokens: int
    """Tokens of the prefill rows, token padding included (vLLM does not store it)."""
    causal: bool
    """False: non-causal multi-token decode (every row a decode)."""
    decode_threshold: int
    """The threshold the split used (:func:`mla_decode_threshold`)."""
    decode_max_query_len: int
    """Measured max decode q (flashmla, flashattn_mla) or promised ``min(max_query_len, threshold)``."""
    prefill_max_query_len: int
    """**Quirk**: the whole batch's ``max_query_len``, not the prefill rows' (0 without prefills)."""
    num_kv_splits: int
    """Triton-MLA: ``min(next_pow2(max(1, max_seq_len // 512)), 2 * num_sms)``; else 0."""
    num_chunks: int
    """Context chunks (0 without context)."""
    scheduler_metadata: None = None
    """FlashMLA / FA3 schedules: computed on the device by the kernels (module docstring)."""

    def chunk(self, index: int) -> MLAChunk:
        """Chunk ``index``'s fields as vLLM's ``ContextChunk``: views into the flat staged arrays, an
        object that expires with this metadata's step.

        Raises
        ------
        IndexError
            ``index`` outside ``[0, num_chunks)``.
        """
        plan = self.chunk_plan
        if plan is None or not 0 <= index < plan.num_chunks:
            raise IndexError(f"chunk {index}: this step has {self.num_chunks} chunks")
        a, b = int(plan.piece_offset[index]), int(plan.piece_offset[index + 1])
        n = b - a
        cu = int(plan.cu_offset[index])
        t = int(plan.token_offset[index])
        nt = int(plan.num_context_tokens[index])
        lt = int(plan.local_token_offset[index])
        nl = int(plan.num_local_context_tokens[index])
        dcp = plan.padded_local_seq_lens is not None
        r0, r1 = int(plan.request_start[index]), int(plan.request_end[index])
        plc = self.chunk_padded_local_cu_seq_lens
        plt = self.chunk_padded_local_token_to_seq
        return self._derived(MLAChunk(
            index=index, request_slice=slice(r0, r1),
            token_slice=slice(int(plan.token_start[index]), int(plan.token_end[index])),
            continuation_token_end=int(plan.continuation_token_end[index]),
            is_continuation=bool(plan.is_continuation[index]), num_context_tokens=nt,
            num_local_context_tokens=nl, max_query_len=int(plan.max_query_len[index]),
            max_seq_len=int(plan.max_seq_len[index]), all_rows_active=bool(plan.all_rows_active[index]),
            query_start_loc=self.chunk_cu_seqlens_q[cu: cu + n + 1], cu_seq_lens=self.chunk_cu_seq_lens[cu: cu + n + 1],
            starts=self.chunk_starts[a:b], seq_lens=self.chunk_seq_lens_cpu[a:b],
            token_to_seq=self.chunk_token_to_seq[t: t + nt],
            padded_local_seq_lens=plan.padded_local_seq_lens[a:b] if plan.padded_local_seq_lens is not None else None,
            padded_local_cu_seq_lens=plc[cu: cu + n + 1] if dcp and plc is not None else None,
            padded_local_token_to_seq=plt[lt: lt + nl] if dcp and plt is not None else None,
            local_context_lens_allranks=(plan.local_context_lens_allranks[r0:r1]
                                         if plan.local_context_lens_allranks is not None else None),
        ))


_make = keyword_factory(MLAMetadata)


def _alignment(block_size: int, opts: MLAOptions) -> int:
    a = block_size if opts.align_chunk_to_block else 1
    if opts.dcp_world_size > 1:
        a = math.lcm(a, opts.dcp_world_size * opts.dcp_interleave)
    return a


class MLABuilder(Builder[MLAOptions, None, None, MLAMetadata]):
    """The dense MLA builder (:data:`MLA`): split, chunked context, decode fields of each variant."""

    name = "mla"
    options_type = MLAOptions
    metadata_type = MLAMetadata

    def derive(
        self, common: StagedCommon, step: Step, options: MLAOptions, inputs: None
    ) -> Staged[None, MLAMetadata]:
        """Derive the MLA metadata from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : MLAOptions
            Variant, workspace, DCP layout, field namespace.
        inputs : None
            The builder takes no per-step inputs.

        Returns
        -------
        Staged[None, MLAMetadata]
            ``.result()`` after the commit.

        Raises
        ------
        ValueError
            Non-causal decode rows of unequal length, or a workspace smaller than the split alignment.
        attnmeta.staging.CapacityError
            Graph mode: a field past its profile capacity.
        """
        opts = options
        h = common.host
        B, T = h.num_reqs, h.num_actual_tokens
        qsl = h.query_start_loc_cpu
        causal = h.causal if opts.causal is None else opts.causal
        thr = mla_decode_threshold(opts)
        if not causal:
            _check_non_causal(qsl)
            D, P, Dt, Pt = B, 0, T, 0
        else:
            s = h.split(thr, opts.variant in _UNIFORM)
            D, P, Dt, Pt = s.num_decodes, s.num_prefills, s.num_decode_tokens, s.num_prefill_tokens
        W, inter = opts.dcp_world_size, opts.dcp_interleave
        dcp = W > 1
        seq = h.seq_lens_cpu
        q_all = np.diff(qsl).astype(np.int32)
        p = opts.prefix + "."
        prof = step.profile
        R = prof.max_num_reqs if prof is not None else None

        written: dict[str, np.ndarray] = {}  # every byte staged, writable (for a replayer)

        def put(name: str, arr: np.ndarray, cap: int | None, fill: int = 0, indptr: bool = False) -> np.ndarray:
            n = arr.shape[0]
            if cap is None:
                host = written[name] = step.alloc(p + name, n, arr.dtype)
                host[:] = arr
                return host[:]
            if n > cap:
                raise CapacityError(f"{p}{name}: needs {n} entries but its graph-mode capacity is {cap} "
                                    f"(raise the StaticProfile capacities that size it)")
            if not indptr:
                host = written[name] = step.alloc(p + name, n, arr.dtype, capacity=cap, fill=fill)
                host[:] = arr
                return host[:]
            full = written[name] = step.alloc(p + name, cap, arr.dtype, capacity=cap)
            full[:n] = arr
            full[n:] = arr[-1] if n else 0  # indptr sentinel: the last value repeated
            return full[:n]

        # decode part
        dec_seq = put("decode_seq_lens", _dcp_decode_lens(seq, D, opts), R) if dcp else seq[:D]
        max_seq_len, dec_mq, kv_splits = _decode_scalars(h, opts, D, thr)
        row_req = flat_seq = None
        if not causal and opts.variant == "flashinfer_mla" and D > 0:
            rr = flattened_row_requests(qsl[: D + 1], Dt)
            row_req = put("decode_row_req", rr, None if prof is None else prof.max_num_tokens)
            flat_seq = put("decode_flattened_seq_lens", np.ascontiguousarray(dec_seq[rr]),
                           None if prof is None else prof.max_num_tokens)

        # prefill part
        pq = (qsl[D:] - qsl[D]).astype(np.int32)
        pqsl = put("prefill_query_start_loc", pq, None if R is None else R + 1, indptr=True)
        pql = q_all[D:]
        ctx = (seq[D:] - pql).astype(np.int32)
        ctx_host = put("context_lens", ctx, R)
        align = _alignment(h.block_size, opts)
        if opts.workspace_size // align * align <= 0 and P > 0 and ctx.size and int(ctx.max()) > 0:
            raise ValueError(f"MLAOptions.workspace_size={opts.workspace_size} is smaller than the split alignment "
                             f"{align} (block_size {h.block_size}, DCP {W}x{inter})")
        plan = plan_context_chunks(ctx, pq, workspace_size=opts.workspace_size, block_size=h.block_size,
                                   align_chunk_to_block=opts.align_chunk_to_block, dcp_world_size=W,
                                   dcp_interleave=inter, align_indptr=opts.align_indptr) if P else None
        caps: dict[str, int | None] = dict.fromkeys(("pieces", "cu", "tok", "ltok"))
        if prof is not None:
            ctx_cap = prof.max_num_reqs * prof.max_blocks_per_req * prof.block_size * W
            pieces = prof.max_num_reqs + ctx_cap // align
            caps = {"pieces": pieces, "cu": 5 * pieces, "tok": ctx_cap, "ltok": ctx_cap // W + pieces * inter + 1}
        e = np.zeros(0, np.int32)
        z = np.zeros(1, np.int32)
        starts = put("chunk_starts", plan.starts if plan else e, caps["pieces"])
        cu = put("chunk_cu_seq_lens", plan.cu_seq_lens if plan else z[:0], caps["cu"], indptr=True)
        cuq = put("chunk_cu_seqlens_q", plan.cu_seqlens_q if plan else z[:0], caps["cu"], indptr=True)
        tok = put("chunk_token_to_seq", plan.token_to_seq if plan else e, caps["tok"])
        lcu = None
        if dcp:
            lcu = put("chunk_padded_local_cu_seq_lens",
                      plan.padded_local_cu_seq_lens if plan and plan.padded_local_cu_seq_lens is not None else e,
                      caps["cu"], indptr=True)
            put("chunk_padded_local_token_to_seq",
                       plan.padded_local_token_to_seq if plan and plan.padded_local_token_to_seq is not None else e,
                       caps["ltok"])
        chunk_seq = plan.seq_lens if plan else e
        for arr in (starts, cu, cuq, tok, pqsl, ctx_host, pql, dec_seq, *(plan or ())):  # (handed out: read-only)
            if isinstance(arr, np.ndarray):
                arr.flags.writeable = False
        n_chunks = plan.num_chunks if plan else 0
        names = {k: p + k for k in ("decode_seq_lens", "decode_row_req", "decode_flattened_seq_lens",
                                    "prefill_query_start_loc", "context_lens", "chunk_starts", "chunk_cu_seq_lens",
                                    "chunk_cu_seqlens_q", "chunk_token_to_seq", "chunk_padded_local_cu_seq_lens",
                                    "chunk_padded_local_token_to_seq")}
        sizes = {"prefill_query_start_loc": P + 1, "chunk_cu_seq_lens": cu.shape[0],
                 "chunk_cu_seqlens_q": cuq.shape[0],
                 "chunk_padded_local_cu_seq_lens": 0 if lcu is None else lcu.shape[0]}
        mql = h.max_query_len

        def dev(key: str) -> torch.Tensor:
            t = step.device(names[key])
            n = sizes.get(key)
            return t if n is None else t[:n]

        def make() -> MLAMetadata:
            cm = common.result()
            return _make(
                common=cm, query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens,
                block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
                decode_query_start_loc=cm.query_start_loc[: D + 1],
                decode_seq_lens=dev("decode_seq_lens") if dcp else cm.seq_lens[:D],
                decode_dcp_tot_seq_lens=cm.seq_lens[:D] if dcp else None,
                decode_row_req=dev("decode_row_req") if row_req is not None else None,
                decode_flattened_seq_lens=dev("decode_flattened_seq_lens") if flat_seq is not None else None,
                prefill_query_start_loc=dev("prefill_query_start_loc"), context_lens=dev("context_lens"),
                chunk_starts=dev("chunk_starts"), chunk_cu_seq_lens=dev("chunk_cu_seq_lens"),
                chunk_cu_seqlens_q=dev("chunk_cu_seqlens_q"), chunk_token_to_seq=dev("chunk_token_to_seq"),
                chunk_padded_local_cu_seq_lens=dev("chunk_padded_local_cu_seq_lens") if dcp else None,
                chunk_padded_local_token_to_seq=dev("chunk_padded_local_token_to_seq") if dcp else None,
                query_start_loc_cpu=cm.query_start_loc_cpu, decode_seq_lens_cpu=dec_seq,
                decode_row_req_cpu=row_req, decode_flattened_seq_lens_cpu=flat_seq,
                prefill_query_start_loc_cpu=pqsl, prefill_query_lens_cpu=pql, context_lens_cpu=ctx_host,
                chunk_starts_cpu=starts, chunk_seq_lens_cpu=chunk_seq, chunk_cu_seq_lens_cpu=cu,
                chunk_cu_seqlens_q_cpu=cuq, chunk_token_to_seq_cpu=tok, chunk_plan=plan, num_reqs=B,
                num_actual_tokens=T, max_query_len=mql, max_seq_len=max_seq_len, num_decodes=D,
                num_decode_tokens=Dt, num_prefills=P, num_prefill_tokens=Pt, causal=causal, decode_threshold=thr,
                decode_max_query_len=dec_mq, prefill_max_query_len=mql if P else 0, num_kv_splits=kv_splits,
                num_chunks=n_chunks,
            )

        return _Staged(step, make, written)

    def replay_key(self, shape: StepShape, options: MLAOptions, inputs: None) -> Hashable | None:
        """Steps whose every row is a decode row, whose prefill and context-chunk fields are empty; with
        DCP too (the rank's decode lengths, rewritten). The scalars tell: the longest query within the
        threshold, and for the variants that need uniform decodes (FlashMLA, Triton-MLA) a threshold of
        1 or every query of the first's length (:attr:`~attnmeta.StepShape.uniform_queries`: else a
        shorter one beside longer ones is a prefill row). Else None: composed (a step with prefill rows stages fields sized by its context
        chunks). A non-causal group's steps are composed too (:meth:`replayer` says so)."""
        thr = mla_decode_threshold(options)
        if shape.max_query_len <= thr and (options.variant not in _UNIFORM or thr <= 1 or shape.uniform_queries):
            return "decode"
        return None

    def reads_lengths(self, options: MLAOptions) -> bool:
        """False: neither :meth:`needs` nor :meth:`replay_key` reads the step's lengths."""
        return False

    def replayer(self, staged: Staged[None, MLAMetadata], common: StagedCommon, step: Step, options: MLAOptions,
                 inputs: None) -> _Replayer | None:
        """Replays of a decode-only step: the empty prefill and chunk fields rewritten, the DCP decode
        lengths recomputed; None for a step with prefill rows, or of a non-causal group (whose rows
        each step must check are uniform, and whose FlashInfer-MLA steps stage per-token rows)."""
        assert isinstance(staged, _Staged)
        m = staged.result()
        if m.num_prefills or not m.causal:
            return None
        return _Replayer(m, options, staged.written)

    def unsupported_reasons(self, spec: BatchSpec, options: MLAOptions, inputs: None) -> list[str]:
        """A context-parallel spec of another world size; a workspace below the split alignment;
        non-causal rows of unequal length."""
        reasons = []
        cp = spec.context_parallel
        if cp is not None and cp.world_size != options.dcp_world_size:
            reasons.append(f"the spec's context_parallel.world_size={cp.world_size} != MLAOptions.dcp_world_size="
                           f"{options.dcp_world_size}: set dcp_world_size (and dcp_rank) to the spec's layout")
        align = _alignment(spec.block_size, options)
        if options.workspace_size < align:
            reasons.append(f"MLAOptions.workspace_size={options.workspace_size} < the split alignment {align}")
        if options.causal is False:
            q = np.asarray(spec.num_scheduled_tokens)
            active = q[q > 0]
            if q.size and (not (q[: active.size] > 0).all() or (active != q[0]).any()):
                reasons.append("non-causal decode: the active rows must all have the first row's query length "
                               "and be followed only by empty rows")
        return reasons


def _dcp_decode_lens(seq: np.ndarray, D: int, opts: MLAOptions) -> np.ndarray:
    """The rank's local context lengths of the ``D`` decode rows under DCP ((D,) int32, host)."""
    if not D:
        return np.zeros(0, np.int32)
    return dcp_local_context_lens(seq[:D], opts.dcp_world_size, opts.dcp_interleave)[:, opts.dcp_rank].copy()


def _decode_scalars(h: CommonHost, opts: MLAOptions, D: int, thr: int) -> tuple[int, int, int]:
    """A step's ``(max_seq_len, decode_max_query_len, num_kv_splits)`` with ``D`` decode rows and the
    split's threshold ``thr`` (a staged and a replayed step alike)."""
    max_seq_len = h.max_seq_len
    if opts.dcp_world_size > 1 and D > 0:
        inter = opts.dcp_interleave
        max_seq_len = -(-max_seq_len // (opts.dcp_world_size * inter)) * inter
    if opts.variant in ("flashmla", "flashattn_mla"):  # the decode rows' longest query
        if h.num_reqs == D:  # (every row decodes: the batch's, padding rows being empty)
            dec_mq = h.max_query_len
        else:
            dec_mq = int(np.diff(h.query_start_loc_cpu[: D + 1]).max()) if D else 0
    else:
        dec_mq = min(h.max_query_len, thr)
    kv_splits = triton_num_kv_splits(max_seq_len, opts.num_sms) if opts.variant == "triton_mla" else 0
    return max_seq_len, dec_mq, kv_splits


class _Staged(Staged[None, MLAMetadata]):
    """A staged MLA step: the writable host views of every byte it staged (for a replayer), by field."""

    __slots__ = ("written",)

    def __init__(self, step: Step, make: Callable[[], MLAMetadata], written: dict[str, np.ndarray]) -> None:
        super().__init__(step, None, make)
        self.written = written


_PER_STEP = ("common", "query_start_loc", "seq_lens", "block_table", "slot_mapping", "decode_query_start_loc",
             "decode_seq_lens", "decode_dcp_tot_seq_lens", "query_start_loc_cpu", "decode_seq_lens_cpu", "num_reqs",
             "num_actual_tokens", "max_query_len", "max_seq_len", "num_decodes", "num_decode_tokens",
             "num_prefill_tokens", "decode_max_query_len", "num_kv_splits")
"""The fields of a decode-only step that change from replay to replay of one layout (the rest are the
layout's: its counts, and views of the empty prefill and chunk fields at the slot's fixed places)."""


class _Replayer(Replayer[None, MLAMetadata]):
    """Replays of a decode-only MLA layout (every row a decode row, :meth:`MLABuilder.replay_key`).

    Such a step's prefill and context-chunk fields hold no rows: the prefill query indptr is ``[0]``
    (in graph mode its whole buffer, the sentinel repeating it) and the rest are empty, so
    :meth:`rewrite` writes zeros into every byte of them (the slot may hold another layout's bytes
    there), and under DCP the rank's decode lengths (:func:`_dcp_decode_lens`). :meth:`result` makes
    the recorded step's metadata with this step's :data:`_PER_STEP` values (:func:`_decode_scalars`).
    """

    __slots__ = ("dcp", "make", "options", "thr", "uniform", "zeros")

    def __init__(self, recorded: MLAMetadata, options: MLAOptions, written: dict[str, np.ndarray]) -> None:
        self.options, self.thr, self.uniform = options, recorded.decode_threshold, options.variant in _UNIFORM
        self.dcp = written.get("decode_seq_lens")
        self.zeros = [v for k, v in written.items() if k != "decode_seq_lens"]
        self.make = template(recorded, _PER_STEP)

    def rewrite(self, step: Step, host: CommonHost, inputs: None) -> None:
        for v in self.zeros:
            v.fill(0)
        if self.dcp is not None:
            self.dcp[:] = _dcp_decode_lens(host.seq_lens_cpu, self._decodes(host)[0], self.options)

    def _decodes(self, host: CommonHost) -> tuple[int, int, int]:
        """The step's decode rows, decode tokens and prefill tokens (token padding): the split
        :meth:`MLABuilder.derive` makes (every row a decode row, as the layout's key promises)."""
        s = host.split(self.thr, self.uniform)
        assert not s.num_prefills, "a decode-only MLA layout replayed for a step with prefill rows"
        return s.num_decodes, s.num_decode_tokens, s.num_prefill_tokens

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: None) -> MLAMetadata:
        D, Dt, Pt = self._decodes(host)
        max_seq_len, dec_mq, kv_splits = _decode_scalars(host, self.options, D, self.thr)
        qsl, seq = common.query_start_loc, common.seq_lens
        if self.dcp is None:
            dec, tot, dec_cpu = seq[:D], None, host.seq_lens_cpu[:D]
        else:
            dec, tot, dec_cpu = step.device(self.options.prefix + ".decode_seq_lens"), seq[:D], self.dcp[:]
            dec_cpu.flags.writeable = False
        return self.make(common, qsl, seq, common.block_table_tensor, common.slot_mapping, qsl[: D + 1], dec, tot,
                         common.query_start_loc_cpu, dec_cpu, host.num_reqs, host.num_actual_tokens, host.max_query_len,
                         max_seq_len, D, Dt, Pt, dec_mq, kv_splits)


def _check_non_causal(qsl: np.ndarray) -> None:
    q = np.diff(qsl)
    active = q[q > 0]
    if q.size and (not (q[: active.size] > 0).all() or (active != q[0]).any()):
        raise ValueError("non-causal decode: the active rows must all have the first row's query length and be "
                         f"followed only by empty rows, got query lengths {q[:8].tolist()}")


MLA = register(MLABuilder())
"""The registered MLA builder."""
stage = MLA.stage
build = MLA.build
