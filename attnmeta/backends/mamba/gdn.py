"""Gated-delta-net (GDN) metadata (docs/semantics-mamba.md, "Gated delta net"), derived on the host.

The builder is :data:`GDN` (registry name ``"gdn"``; :func:`stage` and :func:`build` are its
methods): vLLM 0.33.0's ``GDNAttentionMetadataBuilder``. Every field is computed on the host from the
step's host twins (the split with ``no_prior`` rows, the spec / non-spec partition of rows and tokens,
the state indices, the FLA chunk metadata, the causal-conv1d programs, ``has_initial_state`` from the
host context lengths) and staged in the step's one copy; vLLM's host-mask gathers, device
``repeat_interleave`` / ``argsort`` / ``cumsum`` and tail ``fill_`` calls become host writes into
staging.

A step composer (:class:`attnmeta.compose.StepBuilder`) replays the steps of a decode loop
(:meth:`GDNBuilder.replay_key`: no row longer than one token or still in its prompt): their own fields
are rewritten by the derive's helpers, their metadata is the recorded step's with the step's common
metadata and token count. Steps with prefill rows, and spec-decode steps with drafts (whose spec rows
the shape does not tell), are staged the ordinary way.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, CUDA-graph padding rows included.
- ``num_spec_decodes`` (``S``): spec-decode rows (``num_decode_draft_tokens_cpu >= 0``).
- ``num_spec_tokens`` (``k``): ``GDNOptions.num_speculative_tokens``.
- ``num_decodes`` (``D``), ``num_prefills`` (``P``) and their token counts ``Dt`` / ``Pt``.
- ``num_chunks`` (``N``): FLA chunks of the prefill rows, ``sum(cdiv(q_i, 64))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._checks import as_host_array, check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory, template
from attnmeta.backends._shared import read_only_view
from attnmeta.backends.mamba._fill import conv1d_capacity
from attnmeta.backends.mamba._shared import (
    CACHE_MODE_RULE,
    MAMBA_BLOCK_SIZE_RULE,
    NULL_BLOCK_ID,
    AlignReadsLengths,
    CacheMode,
    block_table_columns,
    check_align_block_size,
    common_needs,
    excess_drafts_reason,
    runner_draft_counts,
    state_indices_error,
)
from attnmeta.builder import Builder, CommonNeeds, Replayer, register
from attnmeta.host.conv1d import causal_conv1d_metadata
from attnmeta.host.gdn import FLA_CHUNK_SIZE, fla_chunk_metadata, token_partition_nb
from attnmeta.host.mamba import state_indices_nb
from attnmeta.host.split import split_decodes_and_prefills
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import Staged, Step

__all__ = [
    "FLA_CHUNK_SIZE",
    "GDN",
    "GDNBuilder",
    "GDNInputs",
    "GDNMetadata",
    "GDNOptions",
    "PrefillBackend",
    "build",
    "stage",
]

PrefillBackend = Literal["triton", "flashinfer"]
"""vLLM's ``gdn_prefill_backend`` values this builder serves (FlashInfer skips the FLA chunk fields)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GDNOptions:
    """Options of the GDN builder (the static part of vLLM's ``GDNAttentionMetadataBuilder``), validated
    when constructed.

    Examples
    --------
    >>> GDNOptions(num_speculative_tokens=2).prefix
    'gdn'
    >>> GDNOptions(prefill_backend="cutedsl")
    Traceback (most recent call last):
    ValueError: GDNOptions.prefill_backend: must be 'triton' or 'flashinfer', got 'cutedsl'
    """

    num_speculative_tokens: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0))
    """``k``; spec decode is on when > 0: rows with ``num_decode_draft_tokens_cpu >= 0`` take the spec
    path with ``1 + k`` state columns."""
    mamba_block_size: int | None = dataclasses.field(default=None, metadata=MAMBA_BLOCK_SIZE_RULE)
    """Mamba block size for ``"align"`` mode (at least the step's ``block_size``); ``None``: the common
    metadata's ``block_size``."""
    cache_mode: CacheMode = dataclasses.field(default="none", metadata=CACHE_MODE_RULE)
    """vLLM's ``mamba_cache_mode``: ``"none"`` (state in column 0) or ``"align"`` (the last blocks)."""
    prefill_backend: PrefillBackend = dataclasses.field(
        default="triton", metadata=option_rule("choice", choices=("triton", "flashinfer")))
    """vLLM's ``gdn_prefill_backend``: ``"triton"`` (FLA: ``chunk_indices`` / ``chunk_offsets``) or
    ``"flashinfer"`` (no chunk fields)."""
    cudagraph_max_bs: int | None = dataclasses.field(
        default=None, metadata=option_rule("int", minimum=1, allow_none=True))
    """FULL CUDA graphs: vLLM's ``decode_cudagraph_max_bs`` (``min(max_num_seqs * (k + 1),
    max_cudagraph_capture_size)``); an all-spec step with ``S`` and ``St`` within it is staged to ``B``
    rows (``_stage_spec_decode``). ``None``: FULL graphs off."""
    needs_causal_conv1d_metadata: bool = dataclasses.field(default=True, metadata=option_rule("bool"))
    """Emit the causal-conv1d launch metadata (``batch_ptr``, ...) when there are prefills."""
    prefix: str = dataclasses.field(default="gdn", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class GDNMetadata(MetadataBase):
    """GDN metadata (vLLM's ``GDNAttentionMetadata``). Fields vLLM leaves ``None`` in a case are None
    here too (spec fields without spec rows, non-spec fields in an all-spec batch, prefill fields
    without prefills).

    Examples
    --------
    Spec decode with ``k = 2``: three spec rows (a one-token decode is a spec row with 0 drafts), a
    prefill and a padding row; the token indices of a mixed batch are int64:

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[37, 16, 21, 0], num_scheduled_tokens=[3, 1, 2, 6],
    ...                  num_prompt_tokens=[5, 5, 5, 6], num_draft_tokens=[2, 0, 1, 0],
    ...                  block_table=np.arange(40, dtype=np.int32).reshape(4, 10), block_size=16,
    ...                  num_reqs_padded=5)
    >>> m = build(spec, Stager("cpu"), GDNOptions(num_speculative_tokens=2),
    ...           GDNInputs(num_accepted_tokens=np.array([2, 1, 1, 1], np.int32)))
    >>> m.num_spec_decodes, m.num_prefills, m.num_decodes, m.num_prefill_tokens
    (3, 1, 0, 6)
    >>> m.spec_token_indx_cpu.tolist(), m.non_spec_token_indx_cpu.tolist(), m.spec_token_indx.dtype
    ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], torch.int64)
    >>> m.non_spec_query_start_loc_cpu.tolist(), m.num_accepted_tokens_cpu.tolist()
    ([0, 6, 6], [2, 1, 1])
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "spec_query_start_loc",
        "non_spec_query_start_loc",
        "spec_state_indices_tensor",
        "non_spec_state_indices_tensor",
        "spec_sequence_masks",
        "spec_token_indx",
        "non_spec_token_indx",
        "num_accepted_tokens",
        "has_initial_state",
        "prefill_query_start_loc",
        "prefill_state_indices",
        "prefill_has_initial_state",
        "chunk_indices",
        "chunk_offsets",
        "batch_ptr",
        "token_chunk_offset_ptr",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (*(f + "_cpu" for f in _DEVICE_FIELDS),
                                               "conv1d_nums_cpu", "conv1d_mlist_cpu", "conv1d_offsetlist_cpu")
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_prefills",
        "num_prefill_tokens",
        "num_decodes",
        "num_decode_tokens",
        "num_spec_decodes",
        "num_spec_decode_tokens",
        "num_actual_tokens",
        "num_reqs",
        "uniform_spec_sequence_length",
        "conv1d_num_programs_total",
        "conv1d_max_num_programs",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = tuple((f, f + "_cpu") for f in _DEVICE_FIELDS)

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    num_prefills: int
    """Prefill rows: no spec path, the split with ``no_prior`` rows minus the zero-length rows after the
    decodes; spec path, the non-spec rows with ``q > 0`` (plain decodes become prefills)."""
    num_prefill_tokens: int
    """Tokens of the prefill rows, token padding *not* included (``qsl[D + P] - Dt``)."""
    num_decodes: int
    """Decode rows ``D`` (no spec path only; 0 with spec rows). Padding rows count when nothing prefills."""
    num_decode_tokens: int
    """Tokens of the decode rows (the padded token count when every row decodes)."""
    num_spec_decodes: int
    """Spec-decode rows ``S``."""
    num_spec_decode_tokens: int
    """``St = sum(q) - Pt - Dt``."""
    num_actual_tokens: int
    """Tokens of the step, padding included."""
    num_reqs: int
    """Request rows ``B``, padding included."""
    uniform_spec_sequence_length: int | None
    """The common ``q`` of the spec rows when they all share one ``q > 0``, else None."""
    conv1d_num_programs_total: int
    """Causal-conv1d programs (vLLM ``nums_dict[8]["tot"]``); 0 without them."""
    conv1d_max_num_programs: int
    """Length of ``batch_ptr`` (``2 * max(1024, tot)``; graph mode: the fixed capacity); 0 without them."""
    spec_query_start_loc: torch.Tensor | None
    """(S + 1,) int32, device, or None. All-spec: ``qsl[:S + 1]``; mixed: ``[0, cumsum(q[spec])]``. FULL
    staging: ``(B + 1,)``, the tail repeats ``qsl[S]``."""
    non_spec_query_start_loc: torch.Tensor | None
    """(B + 1,) int32 (no spec path: the common ``query_start_loc``) or (B - S + 1,) (mixed:
    ``[0, cumsum(q[~spec])]``), device, or None (all-spec)."""
    spec_state_indices_tensor: torch.Tensor | None
    """(S, k + 1) int32, device, or None. State slots of the spec rows (columns ``start_i .. start_i + k``
    of the block table). FULL staging: ``(B, k + 1)``, rows ``[S:]`` 0."""
    non_spec_state_indices_tensor: torch.Tensor | None
    """(B,) int32 (no spec path) or (B - S,) (mixed), device, or None (all-spec). Column 0 of the state
    indices of the non-spec rows."""
    spec_sequence_masks: torch.Tensor | None
    """(B,) bool, device, or None (no spec rows). ``num_decode_draft_tokens_cpu >= 0``."""
    spec_token_indx: torch.Tensor | None
    """(St,) device, or None: **int32** ``arange(min(S * (k + 1), qsl[-1]))`` in an all-spec batch,
    **int64** (argsort) spec token indices in a mixed one."""
    non_spec_token_indx: torch.Tensor | None
    """(Pt + Dt,) device, or None (no spec path): empty int32 in an all-spec batch, int64 in a mixed one."""
    num_accepted_tokens: torch.Tensor | None
    """(S,) int32, device, or None. Accepted counts of the spec rows (FULL staging: ``(B,)``, tail 1)."""
    has_initial_state: torch.Tensor | None
    """(B,) bool (no spec path) or (B - S,) (mixed), device, or None without prefills. ``c > 0``."""
    prefill_query_start_loc: torch.Tensor | None
    """(B - D + 1,) int32, device, or None. No spec path with decodes: ``qsl[D:] - Dt``; otherwise the
    non-spec query starts."""
    prefill_state_indices: torch.Tensor | None
    """(B - D,) int32, device, or None. ``non_spec_state_indices_tensor[D:]``."""
    prefill_has_initial_state: torch.Tensor | None
    """(B - D,) bool, device, or None. ``has_initial_state[D:]``."""
    chunk_indices: torch.Tensor | None
    """(N, 2) int32, device, or None (no prefills, or FlashInfer). FLA ``[sequence, chunk]`` of each
    64-token chunk of the prefill rows."""
    chunk_offsets: torch.Tensor | None
    """(B - D + 1,) **int64**, device, or None. ``[0, cumsum(cdiv(q_i, 64))]`` over the prefill rows."""
    batch_ptr: torch.Tensor | None
    """(conv1d_max_num_programs,) int32, device, or None. Causal-conv1d program rows over the whole
    non-spec batch (decode rows included), then -1."""
    token_chunk_offset_ptr: torch.Tensor | None
    """(conv1d_max_num_programs,) int32, device, or None. The 8-token block of each program, then -1."""
    spec_query_start_loc_cpu: np.ndarray | None
    """Host twin of ``spec_query_start_loc``."""
    non_spec_query_start_loc_cpu: np.ndarray | None
    """Host twin of ``non_spec_query_start_loc``."""
    spec_state_indices_tensor_cpu: np.ndarray | None
    """Host twin of ``spec_state_indices_tensor``."""
    non_spec_state_indices_tensor_cpu: np.ndarray | None
    """Host twin of ``non_spec_state_indices_tensor``."""
    spec_sequence_masks_cpu: np.ndarray | None
    """Host twin of ``spec_sequence_masks``."""
    spec_token_indx_cpu: np.ndarray | None
    """Host twin of ``spec_token_indx``."""
    non_spec_token_indx_cpu: np.ndarray | None
    """Host twin of ``non_spec_token_indx``."""
    num_accepted_tokens_cpu: np.ndarray | None
    """Host twin of ``num_accepted_tokens``."""
    has_initial_state_cpu: np.ndarray | None
    """Host twin of ``has_initial_state``."""
    prefill_query_start_loc_cpu: np.ndarray | None
    """Host twin of ``prefill_query_start_loc``."""
    prefill_state_indices_cpu: np.ndarray | None
    """Host twin of ``prefill_state_indices``."""
    prefill_has_initial_state_cpu: np.ndarray | None
    """Host twin of ``prefill_has_initial_state``."""
    chunk_indices_cpu: np.ndarray | None
    """Host twin of ``chunk_indices``."""
    chunk_offsets_cpu: np.ndarray | None
    """Host twin of ``chunk_offsets``."""
    batch_ptr_cpu: np.ndarray | None
    """Host twin of ``batch_ptr``."""
    token_chunk_offset_ptr_cpu: np.ndarray | None
    """Host twin of ``token_chunk_offset_ptr``."""
    conv1d_nums_cpu: np.ndarray | None
    """(num non-spec rows,) int32, host only. Causal-conv1d programs per non-spec row (vLLM ``nums``)."""
    conv1d_mlist_cpu: np.ndarray | None
    """(tot,) int64, host only. Row of each program (vLLM ``mlist``)."""
    conv1d_offsetlist_cpu: np.ndarray | None
    """(tot,) int32, host only. Block of its row each program handles (``offsetlist``)."""
    nums_dict: dict[int, dict[str, Any]] | None
    """vLLM's ``nums_dict`` (``{8: {"nums", "tot", "mlist", "mlist_len", "offsetlist", "batch_ptr",
    "token_chunk_offset_ptr"}}``, host numpy arrays and the two device tensors), or None. Reading it
    after the step expired raises; a dict taken out before is plain (not checked), as a tensor taken
    out is."""


_make = keyword_factory(GDNMetadata)


def _accepted(values: Any, h: CommonHost, k: int) -> np.ndarray:
    """``num_accepted_tokens`` as a (B,) int32 host array (padding rows 1)."""
    if not k:
        raise ValueError("num_accepted_tokens: given, but spec decode is off (GDNOptions.num_speculative_tokens == 0)")
    a = as_host_array(values, "num_accepted_tokens", dtype=np.int32)
    if a.shape[0] != h.num_real_reqs and a.shape[0] != h.num_reqs:
        raise ValueError(f"num_accepted_tokens: expected one count per real request ({h.num_real_reqs}) or per row "
                         f"({h.num_reqs}), got shape {a.shape}")
    out = np.ones(h.num_reqs, np.int32)
    out[: a.shape[0]] = a
    return out


def _mamba_block_size(h: CommonHost, o: GDNOptions) -> int:
    """The step's mamba block size, checked against its block size in ``"align"`` mode."""
    bs_m = h.block_size if o.mamba_block_size is None else o.mamba_block_size
    if o.cache_mode == "align" and bs_m < h.block_size:
        check_align_block_size("GDNOptions", bs_m, h.block_size)  # raises
    return bs_m


def _state_indices(h: CommonHost, o: GDNOptions, bs_m: int, out: np.ndarray) -> None:
    """The state slots of every row into ``out`` (``(B, 1 + k)`` int32, or ``(B, 1)``: column 0 only):
    the block-table columns ``start_i .. start_i + k``; raises for columns past the staged table."""
    if state_indices_nb(h.block_table_cpu, h.seq_lens_cpu, bs_m, o.cache_mode == "align", out) >= 0:
        raise state_indices_error(h, slice(0, h.num_reqs), bs_m, o.cache_mode, o.num_speculative_tokens + 1)


def _spec_mask(h: CommonHost, k: int, acc: np.ndarray | None) -> np.ndarray | None:
    """The spec rows (the runner's ``num_decode_draft_tokens_cpu >= 0``; (B,) bool), or None when spec
    decode is off or no row is one; checked: a spec row has at most ``k`` drafts and (``acc``, the step's
    accepted counts) accepts ``1 .. 1 + k`` tokens."""
    drafts = runner_draft_counts(h, k)
    if not k or drafts is None:
        return None
    mask = drafts >= 0
    if not mask.any():
        return None
    # (each check first over every row, one reduction: a row is looked for only when one may be wrong)
    if int(drafts.max()) > k:
        bad = np.flatnonzero(mask & (drafts > k))
        if bad.size:
            r = int(bad[0])
            raise ValueError(f"num_decode_draft_tokens[{r}]={int(drafts[r])} > num_speculative_tokens={k} "
                             f"(row {r}): a spec row has at most k drafts")
    if acc is not None and (int(acc.min()) < 1 or int(acc.max()) > k + 1):
        bad = np.flatnonzero(mask & ((acc < 1) | (acc > k + 1)))
        if bad.size:
            r = int(bad[0])
            raise ValueError(f"num_accepted_tokens[{r}]={int(acc[r])} is outside [1, {k + 1}] (row {r}, "
                             f"a spec-decode row)")
    return mask


def _all_spec_staged(o: GDNOptions, S: int, St: int) -> bool:
    """Whether an all-spec step of ``S`` rows and ``St`` tokens is staged to every row (FULL CUDA graphs:
    vLLM's ``_stage_spec_decode``)."""
    mbs = o.cudagraph_max_bs
    return mbs is not None and mbs >= S and St <= mbs


def _write_all_spec(h: CommonHost, bt: np.ndarray, mask: np.ndarray, acc: np.ndarray | None, S: int, staged: bool,
                    sm: np.ndarray, si: np.ndarray, sq: np.ndarray, na: np.ndarray, sti: np.ndarray) -> None:
    """An all-spec step's fields into their views (every byte; rows past ``S`` of a staged step hold
    vLLM's fills): the spec masks (staged: False past ``S``), the first ``S`` rows' state indices
    (vLLM relies on the spec rows coming first), query starts and accepted counts (default: the rows'
    ``q``), and the spec token indices ``arange``."""
    qsl = h.query_start_loc_cpu
    sm[...] = mask
    if staged:
        sm[S:] = False  # vLLM's _stage_spec_decode
    si[:S] = bt[:S]
    si[S:] = 0
    sq[: S + 1] = qsl[: S + 1]
    sq[S + 1 :] = qsl[S]
    na[:S] = np.diff(qsl[: S + 1]) if acc is None else acc[:S]
    na[S:] = 1
    sti[...] = np.arange(sti.shape[0], dtype=np.int32)


class _Stage:
    """The host fields of one step, staged one by one (graph mode: at the profile's capacities)."""

    def __init__(self, step: Step, prefix: str) -> None:
        self.step, self.prefix = step, prefix
        self.host: dict[str, np.ndarray] = {}
        self.views: dict[str, np.ndarray] = {}
        self.names: dict[str, str] = {}

    def alloc(self, field: str, shape: int | tuple[int, ...], dtype: Any, cap: int | None, fill: Any = 0,
              key: str | None = None) -> np.ndarray:
        """Reserve ``field`` and return its writable host view (the metadata gets a read-only one)."""
        name = f"{self.prefix}.{key or field}"
        view = self.step.alloc(name, shape, dtype, capacity=cap, fill=fill)
        self.views[field], self.host[field], self.names[field] = view, read_only_view(view), name
        return view

    def put(self, field: str, values: np.ndarray, cap: int | None, fill: Any = 0, key: str | None = None) -> None:
        """Stage ``field`` holding ``values``."""
        self.alloc(field, values.shape, values.dtype, cap, fill, key)[...] = values


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GDNInputs:
    """Per-step inputs of the GDN builder.

    Examples
    --------
    >>> GDNInputs(num_accepted_tokens=[2, 1]).num_accepted_tokens
    [2, 1]
    """

    num_accepted_tokens: npt.ArrayLike | None = None
    """(num_real_reqs,) or (num_reqs,) int32, host. Spec decode only: the runner's accepted-token
    count of every row (padding rows 1 when only the real rows are given); each spec row's in
    ``[1, 1 + k]``. Default: the rows' ``q`` (vLLM's capture path)."""


class GDNBuilder(AlignReadsLengths, Builder[GDNOptions, GDNInputs, None, GDNMetadata]):
    """The GDN builder (:data:`GDN`)."""

    name = "gdn"
    options_type = GDNOptions
    inputs_type = GDNInputs
    metadata_type = GDNMetadata

    def needs(self, shape: StepShape, options: GDNOptions) -> CommonNeeds:
        """No per-token arrays; :func:`~attnmeta.backends.mamba.block_table_columns` columns."""
        return common_needs(block_table_columns(shape, options))

    def derive(self, common: StagedCommon, step: Step, options: GDNOptions,
               inputs: GDNInputs) -> Staged[None, GDNMetadata]:
        """Derive GDN metadata from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step`` (spec rows first, as vLLM's runner
            orders a batch), with at least :func:`~attnmeta.backends.mamba.block_table_columns` columns.
        step : Step
            The open step.
        options : GDNOptions
            Spec tokens, cache mode, prefill backend, FULL-graph staging, namespace.
        inputs : GDNInputs
            Spec decode only: the accepted-token counts.

        Returns
        -------
        Staged[None, GDNMetadata]
            ``.result()`` after the commit.

        Raises
        ------
        ValueError
            ``num_accepted_tokens`` without spec decode, of the wrong length, or a spec row's count
            outside ``[1, 1 + k]``; a spec row with more than ``k`` drafts; ``"align"`` mode with a mamba
            block size below the block size; a block table too narrow.
        TypeError
            A torch tensor or a non-integer array as ``num_accepted_tokens``.
        attnmeta.staging.CapacityError
            Graph mode: more rows or tokens than the profile holds.

        Examples
        --------
        Through :meth:`~attnmeta.builder.Builder.stage` (the shared preamble, then this): a spec row
        with 2 drafts and a prefill, the step's accepted-token counts as :class:`GDNInputs`:

        >>> from attnmeta import BatchSpec, Stager, stage_common
        >>> from attnmeta.backends.mamba import block_table_columns
        >>> spec = BatchSpec(num_computed_tokens=[20, 0], num_scheduled_tokens=[3, 6], num_prompt_tokens=[5, 6],
        ...                  num_draft_tokens=[2, 0], block_table=[[1, 2], [3, 4]], block_size=16)
        >>> opts = GDNOptions(num_speculative_tokens=2)
        >>> with Stager("cpu").step() as step:
        ...     common = stage_common(spec, step, block_table_columns=block_table_columns(spec, opts))
        ...     staged = GDN.stage(common, step, opts, GDNInputs(num_accepted_tokens=[2, 1]))
        >>> m = staged.result()
        >>> m.num_spec_decodes, m.num_prefills, m.spec_state_indices_tensor_cpu.tolist(), m.num_accepted_tokens_cpu.tolist()
        (1, 1, [[1, 2, 0]], [2])
        """
        o = options
        h = common.host
        B, T, k = h.num_reqs, h.num_actual_tokens, o.num_speculative_tokens
        bs_m = _mamba_block_size(h, o)
        acc = None if inputs.num_accepted_tokens is None else _accepted(inputs.num_accepted_tokens, h, k)
        qsl = h.query_start_loc_cpu
        q = np.diff(qsl).astype(np.int32)
        bt = np.empty((B, k + 1), np.int32)
        _state_indices(h, o, bs_m, bt)
        mask = _spec_mask(h, k, acc)
        prof = step.profile
        R = None if prof is None else prof.max_num_reqs
        Tm = None if prof is None else prof.max_num_tokens
        R1 = None if R is None else R + 1
        st = _Stage(step, o.prefix)
        c = h.num_computed_tokens_cpu
        use_cm_qsl = False
        uniform = None
        S = St = 0
        form: Hashable | None = None  # (the replay key of the step's layout, where it has one)
        if mask is None:
            no_prior = (q > 0) & (h.seq_lens_cpu_upper_bound <= q) & h.is_prefilling
            D, P, Dt, Pt = split_decodes_and_prefills(qsl, num_tokens=T, max_query_len=h.max_query_len,
                                                      treat_short_extends_as_decodes=False, is_prefilling=no_prior)
            if P > 0:
                P -= int(np.count_nonzero(q[D:] == 0))
                Pt = int(qsl[D + P]) - Dt
            use_cm_qsl = True
            st.put("non_spec_state_indices_tensor", np.ascontiguousarray(bt[:, 0]), R, NULL_BLOCK_ID)
            if P == 0:  # (every row a decode: D == B, Dt == T)
                form = _DECODE
            ns_qsl = qsl
            if P > 0:
                hi = c > 0
                st.put("has_initial_state", hi, R, False)
                if D > 0:
                    st.put("prefill_query_start_loc", (qsl[D:] - Dt).astype(np.int32), R1)
                p_qsl = st.host["prefill_query_start_loc"] if D > 0 else qsl
        else:
            S = int(np.count_nonzero(mask))
            qs = q[mask]
            uniform = int(qs[0]) if qs[0] > 0 and bool(np.all(qs == qs[0])) else None
            ns = ~mask
            qn = q[ns]
            D = int(np.count_nonzero(qn == 1))
            Z = int(np.count_nonzero(qn == 0))
            P = int(qn.shape[0]) - D - Z
            Dt = D
            Pt = int(qn.sum()) - Dt
            St = int(q.sum()) - Pt - Dt
            if D > 0:
                P, Pt, D, Dt = P + D, Pt + Dt, 0, 0
            if P == 0 and D == 0:
                staged = _all_spec_staged(o, S, St)
                rows = B if staged else S
                sm = st.alloc("spec_sequence_masks", B, np.bool_, R, False)
                si = st.alloc("spec_state_indices_tensor", (rows, k + 1), np.int32, R, NULL_BLOCK_ID)
                sq = st.alloc("spec_query_start_loc", rows + 1, np.int32, R1)
                na = st.alloc("num_accepted_tokens", rows, np.int32, R, 1)
                sti = st.alloc("spec_token_indx", min(S * (k + 1), int(qsl[-1])), np.int32, Tm, key="spec_token_indx.i32")
                st.alloc("non_spec_token_indx", 0, np.int32, Tm, key="non_spec_token_indx.i32")
                _write_all_spec(h, bt, mask, acc, S, staged, sm, si, sq, na, sti)
                form = (_SPEC, S, St, staged, uniform)
            else:
                given = q if acc is None else acc
                st.put("spec_sequence_masks", mask, R, False)
                st.put("spec_state_indices_tensor", np.ascontiguousarray(bt[mask]), R, NULL_BLOCK_ID)
                st.put("non_spec_state_indices_tensor", np.ascontiguousarray(bt[ns, 0]), R, NULL_BLOCK_ID)
                sq = np.zeros(S + 1, np.int32)
                np.cumsum(qs, out=sq[1:])
                ns_qsl = np.zeros(qn.shape[0] + 1, np.int32)
                np.cumsum(qn, out=ns_qsl[1:])
                st.put("spec_query_start_loc", sq, R1)
                st.put("non_spec_query_start_loc", ns_qsl, R1)
                st.put("num_accepted_tokens", np.ascontiguousarray(given[mask]), R, 1)
                nsi, si_tok = np.empty(Pt + Dt, np.int64), np.empty(int(qsl[-1]) - Pt - Dt, np.int64)
                token_partition_nb(q, mask, nsi, si_tok)
                st.put("spec_token_indx", si_tok, Tm, key="spec_token_indx.i64")
                st.put("non_spec_token_indx", nsi, Tm, key="non_spec_token_indx.i64")
                if P > 0:
                    st.put("has_initial_state", c[ns] > 0, R, False)
                p_qsl = ns_qsl
        nums = mlist = offl = None
        tot = maxp = 0
        if P > 0:
            if o.prefill_backend == "triton":
                ci, co = fla_chunk_metadata(p_qsl)
                st.put("chunk_indices", ci, None if prof is None else -(-prof.max_num_tokens // FLA_CHUNK_SIZE)
                       + prof.max_num_reqs)
                st.put("chunk_offsets", co, R1)
            if o.needs_causal_conv1d_metadata:
                cm1 = causal_conv1d_metadata(ns_qsl)
                tot, nums, mlist, offl = cm1.num_programs_total, cm1.nums, cm1.mlist, cm1.offsetlist
                for arr in (nums, mlist, offl):  # (host arrays handed out: read-only)
                    arr.flags.writeable = False
                maxp = cm1.max_num_programs if prof is None else conv1d_capacity(prof.max_num_tokens, prof.max_num_reqs)
                for f, src in (("batch_ptr", cm1.batch_ptr), ("token_chunk_offset_ptr", cm1.token_chunk_offset_ptr)):
                    full = np.full(maxp, -1, np.int32)
                    full[:tot] = src[:tot]
                    st.put(f, full, maxp, -1)
                nums.flags.writeable = mlist.flags.writeable = False
        split = (D, P, Dt, Pt)
        host = st.host
        names = st.names
        cm_qsl = use_cm_qsl

        def make() -> GDNMetadata:
            cm = common.result()
            dev: dict[str, Any] = {f: step.device(nm) for f, nm in names.items()}
            hv: dict[str, Any] = {f + "_cpu": v for f, v in host.items()}
            if cm_qsl:
                dev["non_spec_query_start_loc"] = cm.query_start_loc
                hv["non_spec_query_start_loc_cpu"] = cm.query_start_loc_cpu
            D_, P_, _, _ = split
            if P_ > 0 and "has_initial_state" in dev:
                if cm_qsl and D_ > 0:
                    dev["prefill_state_indices"] = dev["non_spec_state_indices_tensor"][D_:]
                    hv["prefill_state_indices_cpu"] = hv["non_spec_state_indices_tensor_cpu"][D_:]
                    dev["prefill_has_initial_state"] = dev["has_initial_state"][D_:]
                    hv["prefill_has_initial_state_cpu"] = hv["has_initial_state_cpu"][D_:]
                else:
                    for f in ("query_start_loc", "state_indices", "has_initial_state"):
                        src = {"query_start_loc": "non_spec_query_start_loc",
                               "state_indices": "non_spec_state_indices_tensor",
                               "has_initial_state": "has_initial_state"}[f]
                        dev["prefill_" + f] = dev[src]
                        hv["prefill_" + f + "_cpu"] = hv[src + "_cpu"]
            fields: dict[str, Any] = {f: dev.get(f) for f in GDNMetadata._DEVICE_FIELDS}
            fields.update({f + "_cpu": hv.get(f + "_cpu") for f in GDNMetadata._DEVICE_FIELDS})
            nd = None
            if nums is not None:
                nd = {8: {"nums": nums, "tot": tot, "mlist": mlist, "mlist_len": tot, "offsetlist": offl,
                          "batch_ptr": dev["batch_ptr"], "token_chunk_offset_ptr": dev["token_chunk_offset_ptr"]}}
            return _make(
                common=cm, num_prefills=P_, num_prefill_tokens=split[3], num_decodes=D_, num_decode_tokens=split[2],
                num_spec_decodes=S, num_spec_decode_tokens=St, num_actual_tokens=T, num_reqs=B,
                uniform_spec_sequence_length=uniform, conv1d_num_programs_total=tot, conv1d_max_num_programs=maxp,
                conv1d_nums_cpu=nums, conv1d_mlist_cpu=mlist, conv1d_offsetlist_cpu=offl, nums_dict=nd, **fields,
            )

        return _Staged(step, make, st.views, form)

    def unsupported_reasons(self, spec: BatchSpec, options: GDNOptions, inputs: GDNInputs) -> list[str]:
        """Context parallelism (vLLM's GDN has none), ``num_accepted_tokens`` without spec decode or of
        the wrong length, and spec rows with more drafts than ``num_speculative_tokens``."""
        reasons = []
        if spec.context_parallel is not None:
            reasons.append("context parallelism: vLLM's GDN builder has no DCP/PCP support")
        k = options.num_speculative_tokens
        acc = inputs.num_accepted_tokens
        if acc is not None:
            if not k:
                reasons.append("num_accepted_tokens: given, but spec decode is off "
                               "(GDNOptions.num_speculative_tokens == 0)")
            elif np.shape(acc) not in ((spec.num_reqs,), (spec.padded_num_reqs,)):
                reasons.append(f"num_accepted_tokens: expected one count per real request ({spec.num_reqs}) or per "
                               f"row ({spec.padded_num_reqs}), got shape {np.shape(acc)}")
        drafts = excess_drafts_reason(spec, k, "GDNOptions")
        if drafts is not None:
            reasons.append(drafts)
        return reasons

    def replay_key(self, shape: StepShape, options: GDNOptions, inputs: GDNInputs) -> Hashable | None:
        """The layout of a decode loop's step. Spec decode off (or a step without tokens): a step no row
        of which is longer than one token or still in its prompt, whose one own field is column 0 of the
        state indices (:data:`_DECODE`). Spec decode on: an all-spec step, every real row a spec row
        (:attr:`~attnmeta.StepShape.all_spec_rows`: drafts ``d > 0`` verified with ``d + 1`` tokens, or
        one token past its prompt), or every row of at most one token past its prompt (padding rows
        among them): ``(_SPEC, S, St, staged, uniform)``, its ``S`` spec rows and ``St`` tokens, whether
        FULL CUDA graphs stage it to every row, and the spec rows' common query length (None unless
        uniform). Else None (composed): which rows are spec rows or prefills, and so the fields' rows,
        depend on per-row counts the scalars do not give."""
        k = options.num_speculative_tokens
        if k and shape.num_tokens and shape.all_spec_rows:
            S, St = shape.num_reqs, shape.num_tokens
            uniform = shape.first_query_len if shape.uniform_queries else None
        elif shape.max_query_len > 1 or shape.any_prefilling:
            return None
        elif not k or not shape.num_tokens:
            return _DECODE
        else:  # (one-token rows past their prompts and empty rows: the one-token rows are the spec rows)
            S = St = shape.num_tokens
            uniform = 1
        return (_SPEC, S, St, _all_spec_staged(options, S, St), uniform)

    def replayer(self, staged: Staged[None, GDNMetadata], common: StagedCommon, step: Step, options: GDNOptions,
                 inputs: GDNInputs) -> _Replayer | None:
        """Replays rewrite the recorded step's own fields with the derive's helpers; None (never replayed:
        every step of the key composed) where the step staged another layout than its key names, which
        the tests hold never happens."""
        assert isinstance(staged, _Staged)
        spec = common.spec
        if staged.form is None or (spec is not None and staged.form != self.replay_key(spec.shape, options, inputs)):
            return None
        return _Replayer(staged.result(), options, staged.form, staged.views)


_DECODE = ("decode",)
"""The replay key of a step without spec rows whose rows all decode: its one own field is column 0 of
the state indices; the split is ``(B, 0, T, 0)``."""
_SPEC = "all_spec"
"""The tag of the replay key of an all-spec step: ``(_SPEC, S, St, staged, uniform)``."""

_DECODE_PER_STEP = ("common", "num_decode_tokens", "num_actual_tokens", "non_spec_query_start_loc",
                    "non_spec_query_start_loc_cpu")
"""The fields of a :data:`_DECODE` layout's metadata that change from step to step (the common metadata's,
and its token count, which is every row's: ``num_decode_tokens == num_actual_tokens``)."""
_SPEC_PER_STEP = ("common", "num_actual_tokens")
"""The fields of an all-spec layout's metadata that change from step to step (the rest are views of the
own fields, rewritten, and counts its key fixes)."""


class _Staged(Staged[None, GDNMetadata]):
    """A staged GDN step: the writable host views of its own fields and its layout's replay key (None:
    not replayed)."""

    __slots__ = ("form", "views")

    def __init__(self, step: Step, make: Callable[[], GDNMetadata], views: dict[str, np.ndarray],
                 form: Hashable | None) -> None:
        super().__init__(step, None, make)
        self.views, self.form = views, form


class _Replayer(Replayer[GDNInputs, GDNMetadata]):
    """Replays of a GDN layout (:meth:`GDNBuilder.replay_key`): the derive's helpers rewrite the own
    fields (state indices, spec masks, query starts, accepted counts, token indices), then the recorded
    step's metadata with this step's common metadata and token count."""

    __slots__ = ("bt", "direct", "fields", "make", "options", "spec")

    def __init__(self, recorded: GDNMetadata, options: GDNOptions, form: Hashable, views: dict[str, np.ndarray]
                 ) -> None:
        self.options = options
        k = options.num_speculative_tokens
        self.bt = np.empty((recorded.num_reqs, k + 1), np.int32)  # (the state indices of every row)
        self.spec: tuple[int, bool] | None = None
        self.direct: np.ndarray | None = None
        if form == _DECODE:
            assert recorded.num_decode_tokens == recorded.num_actual_tokens and not recorded.num_prefills
            nssi = views["non_spec_state_indices_tensor"]
            self.fields: tuple[np.ndarray, ...] = (nssi,)
            if not k:  # (one state column: written in place)
                self.direct = nssi.reshape(-1, 1)
            self.make = template(recorded, _DECODE_PER_STEP)
        else:
            assert isinstance(form, tuple) and recorded.num_spec_decodes == form[1]
            self.spec = (form[1], form[3])
            self.fields = tuple(views[f] for f in ("spec_sequence_masks", "spec_state_indices_tensor",
                                                   "spec_query_start_loc", "num_accepted_tokens", "spec_token_indx"))
            self.make = template(recorded, _SPEC_PER_STEP)

    def rewrite(self, step: Step, host: CommonHost, inputs: GDNInputs) -> None:
        """The own fields of ``step``, in the derive's order of checks."""
        o = self.options
        k = o.num_speculative_tokens
        bs_m = _mamba_block_size(host, o)
        acc = None if inputs.num_accepted_tokens is None else _accepted(inputs.num_accepted_tokens, host, k)
        spec = self.spec
        if spec is None:
            if self.direct is not None:
                _state_indices(host, o, bs_m, self.direct)
            else:
                _state_indices(host, o, bs_m, self.bt)
                self.fields[0][...] = self.bt[:, 0]
            return
        bt = self.bt
        _state_indices(host, o, bs_m, bt)
        mask = _spec_mask(host, k, acc)
        assert mask is not None, "a step of an all-spec layout without spec rows"
        sm, si, sq, na, sti = self.fields
        _write_all_spec(host, bt, mask, acc, spec[0], spec[1], sm, si, sq, na, sti)

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: GDNInputs) -> GDNMetadata:
        """The recorded step's metadata with this step's per-step fields."""
        T = host.num_actual_tokens
        if self.spec is None:
            return self.make(common, T, T, common.query_start_loc, common.query_start_loc_cpu)
        return self.make(common, T)


GDN = register(GDNBuilder())
"""The registered GDN builder."""
stage = GDN.stage
build = GDN.build
