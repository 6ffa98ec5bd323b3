"""Pieces the Mamba builders share (private to :mod:`attnmeta.backends.mamba`).

- :data:`MAMBA_BLOCK_SIZE_RULE` / :data:`CACHE_MODE_RULE`: the declared rules of the option fields
  every Mamba options type has; :func:`check_checkpoint_option`: the check of a ``checkpoint`` option;
  :func:`check_align_block_size`: the per-step check of the mamba block size against the step's block
  size in ``"align"`` mode.
- :class:`MambaMetadata`: the base of :class:`~attnmeta.backends.mamba.Mamba2Metadata` and
  :class:`~attnmeta.backends.mamba.Mamba1Metadata` (vLLM's ``BaseMambaAttentionMetadata``): the
  fields they share, declared once.
- :class:`MambaHost`: the host part of a staged Mamba2 / Mamba1 metadata.
- :func:`block_table_columns` / :func:`common_needs`: the common metadata a Mamba builder reads.

The one fill path of the Mamba2 and Mamba1 builders is :mod:`attnmeta.backends.mamba._fill`.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, CUDA-graph padding rows included.
- ``num_prefills`` (``P``): the prefill rows, ``[B - P, B)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from attnmeta._checks import option_rule
from attnmeta._fields import MetadataBase, keyword_factory
from attnmeta.builder import CommonNeeds
from attnmeta.host.chunks import ChunkMetadata
from attnmeta.host.mamba import (
    CheckpointConfig,
    PrefillCheckpoints,
    checkpoint_parameters,
    mamba_state_indices,
)
from attnmeta.host.split import SplitCounts
from attnmeta.metadata import CommonAttentionMetadata, CommonHost
from attnmeta.spec import BatchSpec, StepShape

__all__ = [
    "CACHE_MODE_RULE",
    "MAMBA_BLOCK_SIZE_RULE",
    "NULL_BLOCK_ID",
    "CacheMode",
    "MambaHost",
    "MambaMetadata",
    "block_table_columns",
    "check_align_block_size",
    "check_checkpoint_option",
    "common_needs",
    "excess_drafts_reason",
    "make_host",
    "runner_draft_counts",
    "state_indices_error",
]

NULL_BLOCK_ID = 0
"""vLLM's ``NULL_BLOCK_ID``: the state index of padding rows and the sentinel of the state fields."""

CacheMode = Literal["none", "align"]
"""vLLM's ``mamba_cache_mode``: ``"none"`` (state in column 0) or ``"align"`` (the last blocks)."""

# ------------------------------------------------------------------------------------------------
# options
# ------------------------------------------------------------------------------------------------


MAMBA_BLOCK_SIZE_RULE = option_rule("int", minimum=1, allow_none=True)
"""The declared rule (``dataclasses.field`` metadata) of every Mamba options type's ``mamba_block_size``:
a positive int, or None (the step's ``block_size``)."""
CACHE_MODE_RULE = option_rule("choice", choices=("none", "align"))
"""The declared rule of every Mamba options type's ``cache_mode``: ``"none"`` or ``"align"``."""


def check_align_block_size(owner: str, mamba_block_size: int | None, block_size: int) -> None:
    """In ``"align"`` mode, the mamba block size must be at least the step's block size (O(1), per step).

    The state column of a row of ``s`` tokens is ``(s - 1) // mamba_block_size``; the block table
    covers the row's ``cdiv(s, block_size)`` columns, which hold that column for every ``s`` only if
    ``mamba_block_size >= block_size``. A smaller one reads a column past the row's blocks: a zero, the
    null block's state. (vLLM sets ``mamba_block_size = block_size`` in align mode.)

    Raises
    ------
    ValueError
        ``mamba_block_size < block_size``.
    """
    if mamba_block_size is not None and mamba_block_size < block_size:
        raise ValueError(
            f"{owner}.mamba_block_size={mamba_block_size} < block_size={block_size}: cache_mode='align' reads the "
            f"state of column (s - 1) // mamba_block_size, past the cdiv(s, block_size) blocks of a row's table (the "
            f"null block); use a mamba block size >= the block size (vLLM: mamba_block_size = block_size) or None"
        )


def check_checkpoint_option(options: Any) -> None:
    """``__post_init__`` check of an options type's ``checkpoint``: a valid
    :class:`~attnmeta.host.mamba.CheckpointConfig` or None; only with ``cache_mode="align"``, and with
    the mamba block size when the options set one."""
    ck = options.checkpoint
    if ck is None:
        return
    owner = type(options).__name__
    if not isinstance(ck, CheckpointConfig):
        raise TypeError(f"{owner}.checkpoint: expected CheckpointConfig or None, got {type(ck).__name__}")
    checkpoint_parameters(ck, f"{owner}.checkpoint")
    if options.cache_mode != "align":
        raise ValueError(
            f"{owner}.checkpoint: prefill checkpoints need cache_mode='align' (docs/semantics-mamba.md, "
            f"\"Prefill checkpoints\"), got {options.cache_mode!r}"
        )
    bs_m = options.mamba_block_size
    if bs_m is not None and ck.mamba_block_size != bs_m:
        raise ValueError(
            f"{owner}.checkpoint.mamba_block_size={ck.mamba_block_size} != {owner}.mamba_block_size={bs_m}; "
            f"both describe the same MambaSpec.block_size"
        )


def block_table_columns(spec: BatchSpec | StepShape, options: Any) -> int:
    """Block-table columns :func:`attnmeta.stage_common` must stage for a Mamba builder of ``spec``.

    The state indices read columns ``start_i .. start_i + k`` (docs/semantics-mamba.md, "State
    indices"); the common default covers only the blocks the sequences use. :meth:`needs` of every
    Mamba builder asks for this width, so the generic :func:`attnmeta.builder.build` stages it; when
    staging the common metadata yourself pass ``stage_common(spec, step, block_table_columns=...)`` in
    eager mode (graph mode stages ``profile.max_blocks_per_req``).

    Parameters
    ----------
    spec : BatchSpec or StepShape
        The step, or its scalars (:attr:`BatchSpec.shape <attnmeta.BatchSpec.shape>`).
    options : Mamba2Options, Mamba1Options, LinearAttentionOptions or GDNOptions
        The builder's options (mamba block size, cache mode, speculative tokens, checkpoints).

    Returns
    -------
    int
        ``max(1, cdiv(max_seq_len, block_size), max_i(start_i) + 1 + k)`` over the real rows, with
        exact sequence lengths; with prefill checkpoints also the checkpoint column
        ``cdiv(s, mamba_block_size) - 2`` of the longest upper-bound length ``s`` (plus one), as far
        as the spec's table reaches.

    Examples
    --------
    >>> from attnmeta import BatchSpec
    >>> from attnmeta.backends.mamba import Mamba2Options
    >>> spec = BatchSpec(num_computed_tokens=[9], num_scheduled_tokens=[3], block_table=[[1, 2, 3, 4, 5]],
    ...                  block_size=4)
    >>> block_table_columns(spec, Mamba2Options(cache_mode="align", num_speculative_tokens=2))
    5
    >>> block_table_columns(spec, Mamba2Options())
    3
    """
    bs = int(spec.block_size)
    bs_m = options.mamba_block_size or bs
    k = getattr(options, "num_speculative_tokens", 0)
    s = int(spec.max_exact_seq_len)
    used = -(-s // bs)
    start = max((s - 1) // bs_m, 0) if options.cache_mode == "align" else 0
    # Prefill checkpoints read column cdiv(s, bs_m) - 2 with s the *upper-bound* length.
    ckpt_cols = max(0, -(-int(spec.max_seq_len) // bs_m) - 1) if getattr(options, "checkpoint", None) else 0
    width = spec.table_columns if isinstance(spec, StepShape) else int(spec.block_table.shape[1])
    return max(1, used, start + 1 + k, min(ckpt_cols, width))


class AlignReadsLengths:
    """:meth:`attnmeta.builder.Builder.reads_lengths` of the Mamba family: only with
    ``cache_mode="align"``, whose state columns follow the longest request; in the other modes
    :meth:`~attnmeta.builder.Builder.needs` asks for the longest request's blocks and a minimum that
    the options fix (:func:`block_table_columns`)."""

    def reads_lengths(self, options: Any) -> bool:
        """Whether ``options`` stage the state columns of ``cache_mode="align"``."""
        return bool(options.cache_mode == "align")


@functools.lru_cache(maxsize=256)
def excess_drafts_reason(spec: BatchSpec, spec_tokens: int, owner: str) -> str | None:
    """With spec decode on, the reason a spec row (``num_scheduled_tokens == num_draft_tokens + 1``)
    that verifies more drafts than ``spec_tokens`` cannot be served (vLLM's runner never schedules one;
    past the decode threshold it would run as a prefill); None when there is none. ``owner`` names the
    options type."""
    d = spec.num_draft_tokens
    if not spec_tokens or d is None:
        return None
    rows = (spec.num_scheduled_tokens == d + 1) & (d > spec_tokens)
    if not rows.any():
        return None
    r = int(np.argmax(rows))
    return f"num_draft_tokens[{r}]={int(d[r])} > {owner}.num_speculative_tokens={spec_tokens} (request {r})"


def runner_draft_counts(h: CommonHost, spec_tokens: int) -> np.ndarray | None:
    """The runner's ``num_decode_draft_tokens_cpu`` a Mamba-family builder reads: the common metadata's
    when the spec gave draft counts; else, with spec decode on (``spec_tokens > 0``), vLLM's runner rule
    for a step in which no row got drafts (it fills the counts every step while spec decode is on): 0
    for a one-token row past its prompt (a spec row with zero drafts), -1 for the rest; else None.

    ``(num_reqs,)`` int32, host, read-only (as the common metadata's own: one compiled type for the
    kernels that read either).
    """
    drafts = h.num_decode_draft_tokens_cpu
    if drafts is not None or not spec_tokens:
        return drafts
    q = np.diff(h.query_start_loc_cpu)
    rule: np.ndarray = np.where((q == 1) & ~h.is_prefilling, 0, -1).astype(np.int32)
    rule.flags.writeable = False
    return rule


def common_needs(columns: int) -> CommonNeeds:
    """What a Mamba builder reads of the common metadata: no per-token arrays (vLLM's
    ``SlotMappingMode.NONE``) and ``columns`` block-table columns (one immutable object per width,
    made once: a builder's ``needs`` runs every step)."""
    needs = _NEEDS.get(columns)
    if needs is None:
        if len(_NEEDS) >= 1024:
            _NEEDS.clear()
        needs = _NEEDS[columns] = CommonNeeds(token_arrays=False, block_table_columns=columns)
    return needs


_NEEDS: dict[int, CommonNeeds] = {}


def state_indices_error(common: CommonHost, rows: slice, bs_m: int, mode: str, ncols: int) -> ValueError:
    """The error for state columns outside the staged block table: the validating
    :func:`~attnmeta.host.mamba.mamba_state_indices` message, and the fix."""
    bt, sl = common.block_table_cpu[rows], common.seq_lens_cpu[rows]
    try:
        mamba_state_indices(bt, sl, mamba_block_size=bs_m, mode=mode, num_state_columns=ncols)  # type: ignore[arg-type]
    except ValueError as e:
        return ValueError(
            f"state indices: {e}. The common metadata stages {bt.shape[1]} block-table columns; stage it with "
            f"stage_common(..., block_table_columns=attnmeta.backends.mamba.block_table_columns(spec, options)) "
            f"(the generic attnmeta.builder.build does) or, in graph mode, a profile with enough max_blocks_per_req"
        )
    return ValueError("state indices: the block table is too narrow")  # pragma: no cover


# ------------------------------------------------------------------------------------------------
# the shared metadata base and host part
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MambaMetadata(MetadataBase):
    """Fields shared by the Mamba builders (vLLM's ``BaseMambaAttentionMetadata``; docs/semantics-mamba.md,
    "Fields shared by the Mamba builders").

    The base class of :class:`~attnmeta.backends.mamba.Mamba2Metadata` and
    :class:`~attnmeta.backends.mamba.Mamba1Metadata`. ``None`` follows vLLM: the prefill fields are ``None`` when
    ``num_prefills == 0``; the spec-decode fields when spec decode is off or ``num_decodes == 0``; the
    causal-conv1d fields also when the options turn them off. ``state_indices_tensor_p`` /
    ``state_indices_tensor_d`` are always tensors (empty when their part is), as vLLM splits them from
    one gather. vLLM's ReplaySSM fields (``write_pos_d``, ``is_flush_d``, ``bc_pre_scratch``,
    ``replayssm_scratch``, ``replayssm_state_indices_d``) are not produced and are always ``None``.
    """


    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "has_initial_states_p",
        "query_start_loc_p",
        "state_indices_tensor_p",
        "state_indices_tensor_d",
        "query_start_loc_d",
        "num_accepted_tokens",
        "seq_lens",
        "batch_ptr",
        "token_chunk_offset_ptr",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "has_initial_states_p_cpu",
        "query_start_loc_p_cpu",
        "state_indices_tensor_p_cpu",
        "state_indices_tensor_d_cpu",
        "query_start_loc_d_cpu",
        "num_accepted_tokens_cpu",
        "seq_lens_cpu",
        "batch_ptr_cpu",
        "token_chunk_offset_ptr_cpu",
        "num_computed_tokens_p_cpu",
        "conv1d_nums_cpu",
        "conv1d_mlist_cpu",
        "conv1d_offsetlist_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_prefills",
        "num_prefill_tokens",
        "num_decodes",
        "num_decode_tokens",
        "num_reqs",
        "conv1d_num_programs_total",
        "conv1d_max_num_programs",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("has_initial_states_p", "has_initial_states_p_cpu"),
        ("query_start_loc_p", "query_start_loc_p_cpu"),
        ("state_indices_tensor_p", "state_indices_tensor_p_cpu"),
        ("state_indices_tensor_d", "state_indices_tensor_d_cpu"),
        ("query_start_loc_d", "query_start_loc_d_cpu"),
        ("num_accepted_tokens", "num_accepted_tokens_cpu"),
        ("seq_lens", "seq_lens_cpu"),
        ("batch_ptr", "batch_ptr_cpu"),
        ("token_chunk_offset_ptr", "token_chunk_offset_ptr_cpu"),
    )
    _PREFIX_TWINS: ClassVar[tuple[str, ...]] = ("batch_ptr_cpu", "token_chunk_offset_ptr_cpu")

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    num_prefills: int
    """Prefill rows ``P``: rows ``[D, B)``, from the first row that is a prefill after the moves
    (padding rows after it count here, as in vLLM)."""
    num_prefill_tokens: int
    """Tokens of the prefill rows, token padding included (vLLM's count)."""
    num_decodes: int
    """Decode rows ``D``: rows ``[0, D)`` (zero-length rows before the first prefill count here)."""
    num_decode_tokens: int
    """Tokens of the decode rows (all tokens, padding included, when every row decodes)."""
    num_reqs: int
    """Request rows ``B``, padding included (``D + P``)."""
    conv1d_num_programs_total: int
    """``tot``: causal-conv1d programs launched (vLLM ``nums_dict[8]["tot"]``); 0 without them."""
    conv1d_max_num_programs: int
    """Length of ``batch_ptr`` / ``token_chunk_offset_ptr``: ``2 * max(1024, tot)`` (vLLM's
    ``MAX_NUM_PROGRAMS``), the fixed capacity in graph mode; 0 without them."""
    has_initial_states_p: torch.Tensor | None
    """(num_prefills,) bool, device, or None without prefills. Whether each prefill row continues a
    state: ``num_computed_tokens_p > 0``."""
    query_start_loc_p: torch.Tensor | None
    """(num_prefills + 1,) int32, device, or None without prefills. ``query_start_loc[-P-1:] -
    num_decode_tokens``: query starts of the prefill rows, from 0."""
    state_indices_tensor_p: torch.Tensor
    """(num_prefills,) int32, device. State slot of each prefill row: column 0 of the state indices
    (``block_table[i, start_i]``, docs/semantics-mamba.md, "State indices")."""
    state_indices_tensor_d: torch.Tensor
    """(num_decodes, 1 + num_spec_tokens) int32, device (Mamba1: one column). State slots of each decode row:
    ``block_table[i, start_i + j]``. In graph mode a view of a fixed ``(max_num_reqs, 1 + k)`` buffer
    whose rows past ``D`` hold ``NULL_BLOCK_ID = 0``."""
    query_start_loc_d: torch.Tensor | None
    """(num_decodes + 1,) int32, device, or None (spec decode off or no decodes; always None for Mamba1).
    ``query_start_loc[:D + 1]``, a view of the common ``query_start_loc``."""
    num_accepted_tokens: torch.Tensor | None
    """(num_decodes,) int32, device, or None (as ``query_start_loc_d``). The step's accepted-token
    counts of the decode rows (padding rows 1), or ``diff(query_start_loc_d)`` when none were given.
    Graph mode: a view of a fixed buffer whose rows past ``D`` hold 1."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32, device. The common ``seq_lens`` (the same view)."""
    batch_ptr: torch.Tensor | None
    """(conv1d_max_num_programs,) int32, device, or None. Prefill row of each causal-conv1d program
    (``repeat(arange(P), cdiv(query_len_p, 8))``), then -1 (``PAD_SLOT_ID``)."""
    token_chunk_offset_ptr: torch.Tensor | None
    """(conv1d_max_num_programs,) int32, device, or None. Which 8-token block of its row each program
    handles, then -1."""
    has_initial_states_p_cpu: np.ndarray | None
    """(num_prefills,) bool, host twin of ``has_initial_states_p``."""
    query_start_loc_p_cpu: np.ndarray | None
    """(num_prefills + 1,) int32, host twin of ``query_start_loc_p``."""
    state_indices_tensor_p_cpu: np.ndarray
    """(num_prefills,) int32, host twin of ``state_indices_tensor_p``."""
    state_indices_tensor_d_cpu: np.ndarray
    """(num_decodes, 1 + num_spec_tokens) int32, host twin of ``state_indices_tensor_d``."""
    query_start_loc_d_cpu: np.ndarray | None
    """(num_decodes + 1,) int32, host twin of ``query_start_loc_d`` (a view of the common host qsl)."""
    num_accepted_tokens_cpu: np.ndarray | None
    """(num_decodes,) int32, host twin of ``num_accepted_tokens``."""
    seq_lens_cpu: np.ndarray
    """(num_reqs,) int32, host twin of ``seq_lens`` (the common ``seq_lens_cpu``)."""
    batch_ptr_cpu: np.ndarray | None
    """(conv1d_max_num_programs,) int32, host twin of ``batch_ptr`` (graph mode: the first ``tot``
    entries; the device buffer holds -1 after them)."""
    token_chunk_offset_ptr_cpu: np.ndarray | None
    """(conv1d_max_num_programs,) int32, host twin of ``token_chunk_offset_ptr`` (graph mode: the
    first ``tot`` entries)."""
    num_computed_tokens_p_cpu: np.ndarray | None
    """(num_prefills,) int32, host only, or None without prefills. Tokens already in each prefill
    row's state: ``seq_lens_cpu_upper_bound[D:] - query_lens_p``."""
    conv1d_nums_cpu: np.ndarray | None
    """(num_prefills,) int32, host only. Causal-conv1d programs per prefill row (vLLM ``nums``)."""
    conv1d_mlist_cpu: np.ndarray | None
    """(num_programs_total,) int64, host only. Prefill row of each program (vLLM ``mlist``)."""
    conv1d_offsetlist_cpu: np.ndarray | None
    """(num_programs_total,) int32, host only. Block of its row each program handles (``offsetlist``)."""
    nums_dict: dict[int, dict[str, Any]] | None
    """vLLM's ``nums_dict``: ``{8: {"nums", "tot", "mlist", "mlist_len", "offsetlist", "batch_ptr",
    "token_chunk_offset_ptr"}}`` with the host arrays above (numpy, where vLLM has CPU tensors) and
    the two device tensors; None without causal-conv1d metadata. Reading it after the step expired
    raises; a dict taken out before is plain (not checked), as a tensor taken out is."""
    write_pos_d: None = None
    """ReplaySSM only: not produced (always None)."""
    is_flush_d: None = None
    """ReplaySSM only: not produced (always None)."""
    bc_pre_scratch: None = None
    """ReplaySSM only: not produced (always None)."""
    replayssm_scratch: None = None
    """ReplaySSM only: not produced (always None)."""
    replayssm_state_indices_d: None = None
    """ReplaySSM only: not produced (always None)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MambaHost(MetadataBase):
    """The host part of a staged Mamba2 / Mamba1 metadata (``Staged.host``), for builders staged after
    it in the same step. Arrays are read-only views valid until the stager reuses the step's slot.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager, stage_common
    >>> from attnmeta.backends.mamba import Mamba2Options, mamba2
    >>> spec = BatchSpec(num_computed_tokens=[6, 3], num_scheduled_tokens=[1, 5],
    ...                  num_prompt_tokens=[9, 20], block_table=[[7, 8], [9, 10]], block_size=4)
    >>> with Stager("cpu").step() as step:
    ...     staged = mamba2.stage(stage_common(spec, step), step, Mamba2Options(chunk_size=4))
    >>> host = staged.host
    >>> host.split, host.is_prefilling.tolist(), host.query_start_loc_p_cpu.tolist()
    (SplitCounts(num_decodes=1, num_prefills=1, num_decode_tokens=1, num_prefill_tokens=5), [False, True], [0, 5])
    >>> host.chunks.cu_chunk_seqlens.tolist(), host.checkpoints is None
    ([0, 1, 5], True)
    """

    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ("is_prefilling", "num_computed_tokens_p_cpu", "query_start_loc_p_cpu")
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ("split", "chunks", "checkpoints")

    split: SplitCounts
    """The builder's decode/prefill split (after the prefill -> decode moves)."""
    is_prefilling: np.ndarray
    """(num_reqs,) bool, host. ``is_prefilling`` after the moves (docs/semantics-mamba.md, "Classification")."""
    num_computed_tokens_p_cpu: np.ndarray | None
    """(num_prefills,) int32, host, or None without prefills. Tokens already in each prefill row's state."""
    query_start_loc_p_cpu: np.ndarray | None
    """(num_prefills + 1,) int32, host, or None without prefills. Query starts of the prefill rows, from 0."""
    chunks: ChunkMetadata | None
    """Mamba2 with prefills: the chunk-aligned layout (host arrays of the staged fields); else None."""
    checkpoints: PrefillCheckpoints | None
    """The prefill checkpoints, or None (no checkpoint config, no prefills, or no row with one)."""


make_host = keyword_factory(MambaHost)
"""Keyword constructor of :class:`MambaHost` (the fill path builds one per step)."""
