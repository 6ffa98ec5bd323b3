"""Mamba-family metadata (vllm-semantics.md section 6), derived on the host, staged in the step's copy.

Three builders share one code path here:

- :func:`stage` / :func:`build`: **Mamba2** (:class:`Mamba2Metadata`): vLLM 0.33.0's
  ``BaseMambaAttentionMetadataBuilder._compute_common_metadata`` plus the Mamba2 ``build`` (6.3-6.9):
  prefill/decode classification, state indices, prefill query starts and initial-state flags,
  causal-conv1d launch metadata, the chunk-aligned SSD layout (``cu_chunk_seqlen_p``, ``seq_idx_p``,
  ``last_chunk_indices_p``), "align"-mode prefill checkpoints, spec-decode fields and CUDA-graph
  padding; optionally also the two chunk formats other engines use (logical ``chunk_indices`` /
  ``chunk_offsets`` and the per-token ``seq_idx`` of ``mamba_ssm``).
- :func:`stage_mamba1` / :func:`build_mamba1`: **Mamba1** (:class:`Mamba1Metadata`): the same
  common part with ``thr = 1`` and no chunk metadata (6.12).
- :func:`stage_linear_attn` / :func:`build_linear_attn`: **linear attention**
  (:class:`LinearAttentionMetadata`, 6.12): the plain split and column 0 of the state indices.

(:mod:`attnmeta.backends.mamba1` and :mod:`attnmeta.backends.linear_attn` re-export the last two
under the usual ``stage`` / ``build`` names.)

Everything is computed from the common metadata's **host** arrays with the compiled kernels of
:mod:`attnmeta.host` and written into the step's pinned slot, so it moves in the step's single H2D
copy. Nothing is read back from the device. Where vLLM computes on the device, attnmeta computes
the same values on the host:

- ``has_initial_states_p``: vLLM compares the device ``seq_lens - diff(query_start_loc)`` with 0;
  attnmeta uses ``seq_lens_cpu_upper_bound - query_lens`` on the host, which is exact for prefill
  rows (the upper bound is optimistic only for rows with drafts in flight, whose context is >= 1, so
  the flag is the same);
- ``query_start_loc_p``: host ``query_start_loc_cpu[-P-1:] - num_decode_tokens``, staged;
- state indices: vLLM gathers from the device block table with the device ``seq_lens``; attnmeta
  gathers from ``block_table_cpu`` with the exact host ``seq_lens_cpu``.

The common block table and the state columns
--------------------------------------------
The state indices read block-table columns ``start_i .. start_i + k`` (``k`` speculative tokens;
``start_i = 0`` in ``"none"`` mode, ``max((s_i - 1) // mamba_block_size, 0)`` in ``"align"`` mode).
:func:`attnmeta.stage_common` stages only as many columns as the longest sequence needs, which is
``k`` too few under spec decode: stage the common metadata with
``block_table_columns=block_table_columns(spec, options)`` (:func:`build` does), or in graph mode
with a profile whose ``max_blocks_per_req`` covers them. A table that is too narrow is a
``ValueError`` naming the row, never a silent clip.

The per-step cost
-----------------
In eager mode (no profile), without checkpoints, logical chunks or per-token ``seq_idx``, the
Mamba2 and Mamba1 builders take a fast path: ONE ``Step.alloc_fields`` of a layout that is known
before any pass over the rows (``B`` rows for every per-row field, so decode / prefill fields are
views of their first ``D`` / ``P`` rows; bucketed bounds from ``B`` and ``num_actual_tokens`` for the
chunk and causal-conv1d fields, so steps whose counts wobble keep the layout), ONE compiled call
(:func:`attnmeta.host.mamba._mamba_fill_packed_nb`) that classifies, splits and writes every array
straight into the step's pinned bytes (host-only arrays into a buffer that lives with the cached
field group), exact-length views cached per group and step shape, and the result built with a
positional constructor. The ``-1`` tails of ``batch_ptr`` / ``token_chunk_offset_ptr`` are written
only where the slot does not already hold them from its previous step. Every other configuration
takes the general path; both produce the same values (the property tests check both against the
vLLM-style reference). With the causal-conv1d metadata on, the two pointer arrays
(``2 * max(1024, tot)`` int32 each, ``tot`` about ``num_prefill_tokens / 8``) and the int64
``mlist`` are most of a large prefill step's bytes.

Graph mode
----------
With a :class:`~attnmeta.profile.StaticProfile` every device field has a fixed address and capacity
(``Step.device_full(prefix + ".<field>")`` gives the full views) and rows past the step's length hold
documented sentinels: the decode fields follow 6.9 (``state_indices_tensor_d`` rows ``NULL_BLOCK_ID
= 0``, ``num_accepted_tokens`` 1, ``query_start_loc_d`` is a view of the common ``query_start_loc``,
whose tail repeats its last value); ``query_start_loc_p`` and ``cu_chunk_seqlen_p`` repeat their last
value (zero-length rows / chunks); ``has_initial_states_p`` False; ``state_indices_tensor_p`` 0;
``seq_idx_p`` and ``last_chunk_indices_p`` -1; the causal-conv1d pointers -1 (as vLLM pads them);
the per-token ``seq_idx`` -1; logical chunks 0; checkpoint fields 0 (columns -1). The chunk
capacity is :attr:`StaticProfile.max_num_chunks`, so the profile's ``chunk_size`` must equal the
options'.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, CUDA-graph padding rows included.
- ``num_decodes`` (``D``) / ``num_prefills`` (``P``): rows ``[0, D)`` / ``[D, B)`` after the split.
- ``num_prefill_tokens`` (``Pt``): tokens of the prefill rows, token padding included.
- ``num_spec_tokens`` (``k``): ``Mamba2Options.num_speculative_tokens`` (0 without spec decode).
- ``num_chunks``: chunks of the chunk-aligned layout; ``num_logical_chunks``: of the logical one.
- ``num_programs_total`` (``tot``): causal-conv1d programs, ``sum(cdiv(query_len_p, 8))``;
  ``max_num_programs``: ``2 * max(1024, tot)`` (graph mode: the fixed capacity).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch

from attnmeta._fields import MetadataBase, Staged, fast_constructor
from attnmeta.backends._shared import require_same_step
from attnmeta.host import mamba as _hm
from attnmeta.host.chunks import (
    ChunkMetadata,
    checkpoint_chunk_index_tensor_values,
    chunk_metadata,
    logical_chunks,
    token_seq_idx,
)
from attnmeta.host.conv1d import (  # private kernels: inputs were validated when common was staged
    Conv1dMetadata,
    _count_programs_nb,
    _fill_programs_nb,
)
from attnmeta.host.layout import _prefill_cpu_metadata_nb, prefill_cpu_metadata
from attnmeta.host.mamba import (
    CheckpointConfig,
    _classify_nb,
    _mamba_fill_nb,
    _mamba_fill_packed_nb,
    _state_indices_nb,
    classify_mamba_rows,
    mamba_state_indices,
    prefill_checkpoints,
)
from attnmeta.host.split import SplitCounts, _split_nb
from attnmeta.metadata import CommonAttentionMetadata, common_split, stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import CapacityError, FieldGroup, Stager, Step

__all__ = [
    "LinearAttentionMetadata",
    "LinearAttnOptions",
    "Mamba1Metadata",
    "Mamba1Options",
    "Mamba2Metadata",
    "Mamba2Options",
    "MambaCheckpointMetadata",
    "MambaMetadata",
    "block_table_columns",
    "build",
    "build_linear_attn",
    "build_mamba1",
    "stage",
    "stage_linear_attn",
    "stage_mamba1",
]

_NULL_BLOCK_ID = 0
_CONV1D_BLOCK_M = 8
_NO_DRAFTS = np.zeros(0, np.int32)
_NO_MLIST = np.zeros(0, np.int64)  # the fill kernel's mlist argument when no conv1d fields are staged
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)

CacheMode = Literal["none", "align"]


# ------------------------------------------------------------------------------------------------
# options
# ------------------------------------------------------------------------------------------------


class Mamba2Options(NamedTuple):
    """Options of the Mamba2 builder (the static part of vLLM's builder configuration)."""

    chunk_size: int = 256
    """SSD chunk size ``C`` (vLLM ``model_config.get_mamba_chunk_size()``)."""
    mamba_block_size: int | None = None
    """Mamba block size (``MambaSpec.block_size``), used by ``"align"`` mode; ``None``: the common
    metadata's ``block_size`` (the mamba group's block table)."""
    cache_mode: CacheMode = "none"
    """vLLM's ``mamba_cache_mode``: ``"none"`` (state in column 0) or ``"align"`` (the last blocks)."""
    num_speculative_tokens: int = 0
    """``k``; spec decode is on when > 0: the decode threshold becomes ``1 + k``, decode rows get
    ``1 + k`` state columns, ``query_start_loc_d`` and ``num_accepted_tokens``."""
    checkpoint: CheckpointConfig | None = None
    """Prefill checkpoints (6.8); only with ``cache_mode="align"``, and its ``mamba_block_size`` must
    equal the resolved ``mamba_block_size``."""
    needs_causal_conv1d_metadata: bool = True
    """Emit the causal-conv1d launch metadata (5.8) for prefills."""
    logical_chunks: bool = False
    """Also emit vLLM-v0 / SGLang / TRT-LLM ``chunk_indices_p`` / ``chunk_offsets_p``."""
    token_seq_idx: bool = False
    """Also emit the per-token ``token_seq_idx_p`` of the upstream ``mamba_ssm`` kernels."""
    consecutive_seq_ids: bool = False
    """``token_seq_idx_p`` numbers the non-empty prefill sequences 0, 1, 2, ... instead of by row."""
    prefix: str = "mamba2"
    """Namespace of this builder's staged fields."""


class Mamba1Options(NamedTuple):
    """Options of the Mamba1 builder (vLLM passes it no spec-decode arguments: threshold 1)."""

    mamba_block_size: int | None = None
    """Mamba block size for ``"align"`` mode; ``None``: the common metadata's ``block_size``."""
    cache_mode: CacheMode = "none"
    """vLLM's ``mamba_cache_mode``."""
    needs_causal_conv1d_metadata: bool = True
    """Emit the causal-conv1d launch metadata for prefills."""
    prefix: str = "mamba1"
    """Namespace of this builder's staged fields."""


class LinearAttnOptions(NamedTuple):
    """Options of the linear-attention builder (vLLM ``LinearAttentionMetadataBuilder``)."""

    mamba_block_size: int | None = None
    """Mamba block size for ``"align"`` mode; ``None``: the common metadata's ``block_size``."""
    cache_mode: CacheMode = "none"
    """vLLM's ``mamba_cache_mode``."""
    prefix: str = "linear_attn"
    """Namespace of this builder's staged fields."""


AnyMambaOptions = Mamba2Options | Mamba1Options | LinearAttnOptions


# ------------------------------------------------------------------------------------------------
# metadata types
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MambaCheckpointMetadata(MetadataBase):
    """"align"-mode prefill checkpoints of one step (vLLM's ``checkpoint_meta``, 6.8).

    Row ``j`` is prefill row ``j`` (batch row ``first_row + j``). A row without a checkpoint has
    offset 0, column -1 and state index 0.
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("offsets", "cols", "state_indices")
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ("offsets_cpu", "cols_cpu", "state_indices_cpu", "query_lens_cpu")
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ("first_row",)
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("offsets", "offsets_cpu"),
        ("cols", "cols_cpu"),
        ("state_indices", "state_indices_cpu"),
    )

    offsets: torch.Tensor
    """(num_prefills,) int32, device. Tokens into each row's query where the checkpoint state is
    exported (0: none); the chunk layout ends a chunk there."""
    cols: torch.Tensor
    """(num_prefills,) int64, device. Block-table column of the checkpoint state,
    ``cdiv(s, mamba_block_size) - 2``, or -1."""
    state_indices: torch.Tensor
    """(num_prefills,) int32, device. ``where(cols >= 0, block_table[first_row + j, cols], 0)``,
    gathered on the host."""
    offsets_cpu: np.ndarray
    """(num_prefills,) int32, host twin of ``offsets`` (vLLM's host list ``offsets``)."""
    cols_cpu: np.ndarray
    """(num_prefills,) int64, host twin of ``cols``."""
    state_indices_cpu: np.ndarray
    """(num_prefills,) int32, host twin of ``state_indices``."""
    query_lens_cpu: np.ndarray
    """(num_prefills,) int32, host only. Query length of each prefill row (vLLM's ``query_lens``)."""
    first_row: int
    """Batch row of prefill row 0 (``num_reqs - num_prefills``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MambaMetadata(MetadataBase):
    """Fields shared by the Mamba builders (vLLM's ``BaseMambaAttentionMetadata``, 6.1).

    ``None`` follows vLLM: the prefill fields are ``None`` when ``num_prefills == 0``; the
    spec-decode fields when spec decode is off or ``num_decodes == 0``; the causal-conv1d fields
    also when the options turn them off. ``state_indices_tensor_p`` / ``state_indices_tensor_d`` are
    always tensors (empty when their part is), as vLLM splits them from one gather.

    The ReplaySSM fields of vLLM (``write_pos_d``, ``is_flush_d``, ``bc_pre_scratch``,
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

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    # ---- host scalars
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
    # ---- device fields
    has_initial_states_p: torch.Tensor | None
    """(num_prefills,) bool, device, or None without prefills. Whether each prefill row continues
    a state: ``num_computed_tokens_p > 0``."""
    query_start_loc_p: torch.Tensor | None
    """(num_prefills + 1,) int32, device, or None without prefills.
    ``query_start_loc[-P-1:] - num_decode_tokens``: query starts of the prefill rows, from 0."""
    state_indices_tensor_p: torch.Tensor
    """(num_prefills,) int32, device. State slot of each prefill row: column 0 of the state
    indices (``block_table[i, start_i]``, ``start_i`` as in the module docstring), contiguous."""
    state_indices_tensor_d: torch.Tensor
    """(num_decodes, 1 + num_spec_tokens) int32, device. State slots of each decode row:
    ``block_table[i, start_i + j]``. In graph mode a view of a fixed ``(max_num_reqs, 1 + k)``
    buffer whose rows past ``D`` hold ``NULL_BLOCK_ID = 0`` (vLLM's persistent buffer, 6.9)."""
    query_start_loc_d: torch.Tensor | None
    """(num_decodes + 1,) int32, device, or None (spec decode off or no decodes).
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
    # ---- host fields
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
    row's state: ``seq_lens_cpu_upper_bound[D:] - query_lens_p`` (vLLM's ``num_computed_tokens_p_cpu``)."""
    conv1d_nums_cpu: np.ndarray | None
    """(num_prefills,) int32, host only. Causal-conv1d programs per prefill row (vLLM ``nums``)."""
    conv1d_mlist_cpu: np.ndarray | None
    """(num_programs_total,) int64, host only. Prefill row of each program (vLLM ``mlist``)."""
    conv1d_offsetlist_cpu: np.ndarray | None
    """(num_programs_total,) int32, host only. Block of its row each program handles (``offsetlist``)."""
    nums_dict: dict[int, dict[str, Any]] | None
    """vLLM's ``nums_dict``: ``{8: {"nums", "tot", "mlist", "mlist_len", "offsetlist", "batch_ptr",
    "token_chunk_offset_ptr"}}`` with the host arrays above (numpy, where vLLM has CPU tensors) and
    the two device tensors; None without causal-conv1d metadata."""
    # ---- vLLM ReplaySSM fields: never produced
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
class Mamba1Metadata(MambaMetadata):
    """Mamba1 metadata: exactly the shared Mamba fields (vLLM's ``Mamba1AttentionMetadata``).

    Examples
    --------
    A decode, then a 5-token chunk that continues 3 cached tokens, ``"none"`` mode (state in column 0):

    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[6, 3], num_scheduled_tokens=[1, 5],
    ...                  num_prompt_tokens=[2, 20], block_table=[[7, 8], [9, 10]], block_size=4)
    >>> m = build_mamba1(spec, Stager("cpu"))
    >>> m.num_decodes, m.num_prefills, m.state_indices_tensor_d_cpu.tolist(), m.state_indices_tensor_p_cpu
    (1, 1, [[7]], array([9], dtype=int32))
    >>> m.query_start_loc_p_cpu, m.has_initial_states_p_cpu, m.query_start_loc_d
    (array([0, 5], dtype=int32), array([ True]), None)
    """


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class Mamba2Metadata(MambaMetadata):
    """Mamba2 metadata (vLLM's ``Mamba2AttentionMetadata``): the shared fields plus the SSD chunks.

    The chunk fields are ``None`` when ``num_prefills == 0`` (vLLM computes them only for
    prefills); the optional formats also when their option is off.

    Examples
    --------
    One decode, then a chunked prefill with 5 cached tokens and 10 new ones, then a fresh 3-token
    prefill; chunk size 8:

    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[9, 5, 0], num_scheduled_tokens=[1, 10, 3],
    ...                  num_prompt_tokens=[4, 40, 3], block_table=[[1, 2], [3, 4], [5, 6]], block_size=8)
    >>> m = build(spec, Stager("cpu"), Mamba2Options(chunk_size=8, logical_chunks=True))
    >>> m.num_decodes, m.num_prefills, m.num_decode_tokens, m.num_prefill_tokens
    (1, 2, 1, 13)
    >>> m.query_start_loc_p_cpu, m.has_initial_states_p_cpu, m.prep_initial_states
    (array([ 0, 10, 13], dtype=int32), array([ True, False]), True)
    >>> m.cu_chunk_seqlen_p_cpu, m.seq_idx_p_cpu, m.last_chunk_indices_p_cpu
    (array([ 0,  3, 10, 13], dtype=int32), array([0, 0, 1], dtype=int32), array([1, 2], dtype=int32))
    >>> m.chunk_indices_p_cpu, m.chunk_offsets_p_cpu
    (array([0, 1, 1], dtype=int32), array([0, 0, 2], dtype=int32))
    >>> m.cu_chunk_seqlen_p
    tensor([ 0,  3, 10, 13], dtype=torch.int32)
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        *MambaMetadata._DEVICE_FIELDS,
        "cu_chunk_seqlen_p",
        "seq_idx_p",
        "last_chunk_indices_p",
        "checkpoint_chunk_idx",
        "chunk_indices_p",
        "chunk_offsets_p",
        "token_seq_idx_p",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        *MambaMetadata._HOST_FIELDS,
        "cu_chunk_seqlen_p_cpu",
        "seq_idx_p_cpu",
        "last_chunk_indices_p_cpu",
        "checkpoint_chunk_idx_cpu",
        "chunk_indices_p_cpu",
        "chunk_offsets_p_cpu",
        "token_seq_idx_p_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        *MambaMetadata._SCALAR_FIELDS,
        "prep_initial_states",
        "chunk_size",
        "num_chunks",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        *MambaMetadata._TWINS,
        ("cu_chunk_seqlen_p", "cu_chunk_seqlen_p_cpu"),
        ("seq_idx_p", "seq_idx_p_cpu"),
        ("last_chunk_indices_p", "last_chunk_indices_p_cpu"),
        ("checkpoint_chunk_idx", "checkpoint_chunk_idx_cpu"),
        ("chunk_indices_p", "chunk_indices_p_cpu"),
        ("chunk_offsets_p", "chunk_offsets_p_cpu"),
        ("token_seq_idx_p", "token_seq_idx_p_cpu"),
    )

    # ---- host scalars
    prep_initial_states: bool
    """Whether any prefill row continues a state (``any(has_initial_states_p)``), host only; False
    without prefills."""
    chunk_size: int
    """SSD chunk size ``C``."""
    num_chunks: int
    """Chunks of the chunk-aligned layout (``len(seq_idx_p)``); 0 without prefills."""
    # ---- device fields
    cu_chunk_seqlen_p: torch.Tensor | None
    """(num_chunks + 1,) int32, device, or None without prefills. Token offset of each chunk in
    the packed prefill tokens; ``[-1] == query_start_loc_p[-1]``. Chunks never cross a sequence nor
    an absolute multiple of ``C`` of their request (a context that is not a multiple of ``C`` first
    gets a realigning chunk), nor a checkpoint offset. An unaligned zero-token row has one
    zero-length chunk (vLLM's quirk)."""
    seq_idx_p: torch.Tensor | None
    """(num_chunks,) int32, device, or None. Prefill row of each chunk (non-decreasing)."""
    last_chunk_indices_p: torch.Tensor | None
    """(num_prefills,) int32, device, or None. Last chunk of each prefill row; an aligned zero-token
    row (no chunk) repeats the previous row's value, -1 for the first row (vLLM's quirk)."""
    checkpoint_chunk_idx: torch.Tensor | None
    """(num_prefills,) int64, device, or None unless some row has a checkpoint. Chunk ending each
    row's checkpoint segment, 0 for rows without one (vLLM uploads ``max(idx, 0)``)."""
    chunk_indices_p: torch.Tensor | None
    """(num_logical_chunks,) int32, device, or None (option off / no prefills). Logical chunks
    (anchors.md 4.3): the physical chunk ``[j*C, (j+1)*C)`` of the packed prefill tokens each
    logical chunk lies in."""
    chunk_offsets_p: torch.Tensor | None
    """(num_logical_chunks,) int32, device, or None. Start of each logical chunk inside its
    physical chunk."""
    token_seq_idx_p: torch.Tensor | None
    """(num_prefill_tokens,) int32, device, or None (option off / no prefills). Prefill row of each
    prefill token (``mamba_ssm``'s ``seq_idx``; consecutive ids with ``consecutive_seq_ids``), -1
    for token padding."""
    # ---- host fields
    cu_chunk_seqlen_p_cpu: np.ndarray | None
    """(num_chunks + 1,) int32, host twin of ``cu_chunk_seqlen_p``."""
    seq_idx_p_cpu: np.ndarray | None
    """(num_chunks,) int32, host twin of ``seq_idx_p``."""
    last_chunk_indices_p_cpu: np.ndarray | None
    """(num_prefills,) int32, host twin of ``last_chunk_indices_p``."""
    checkpoint_chunk_idx_cpu: np.ndarray | None
    """(num_prefills,) int64, host twin of ``checkpoint_chunk_idx``."""
    chunk_indices_p_cpu: np.ndarray | None
    """(num_logical_chunks,) int32, host twin of ``chunk_indices_p``."""
    chunk_offsets_p_cpu: np.ndarray | None
    """(num_logical_chunks,) int32, host twin of ``chunk_offsets_p``."""
    token_seq_idx_p_cpu: np.ndarray | None
    """(num_prefill_tokens,) int32, host twin of ``token_seq_idx_p``."""
    checkpoint_meta: MambaCheckpointMetadata | None
    """The step's prefill checkpoints, or None (no checkpoint config, no prefills, or no row with a
    checkpoint: vLLM returns None when every offset is 0)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class LinearAttentionMetadata(MetadataBase):
    """Linear-attention metadata (vLLM's ``LinearAttentionMetadata``, 6.12).

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[6, 0, 2], num_scheduled_tokens=[1, 4, 1],
    ...                  block_table=[[7, 8], [9, 10], [11, 12]], block_size=4)
    >>> la = build_linear_attn(spec, Stager("cpu"))
    >>> la.num_decodes, la.num_prefills, la.num_decode_tokens, la.num_prefill_tokens
    (1, 2, 1, 5)
    >>> la.state_indices_tensor
    tensor([ 7,  9, 11], dtype=torch.int32)
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("query_start_loc", "seq_lens", "state_indices_tensor")
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ("query_start_loc_cpu", "seq_lens_cpu", "state_indices_tensor_cpu")
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_prefills",
        "num_prefill_tokens",
        "num_decodes",
        "num_decode_tokens",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("query_start_loc", "query_start_loc_cpu"),
        ("seq_lens", "seq_lens_cpu"),
        ("state_indices_tensor", "state_indices_tensor_cpu"),
    )

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    num_prefills: int
    """Prefill rows (the plain split at threshold 1: from the first row with more than one token)."""
    num_prefill_tokens: int
    """Tokens of the prefill rows, token padding included."""
    num_decodes: int
    """Decode rows."""
    num_decode_tokens: int
    """Tokens of the decode rows."""
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32, device. The common ``query_start_loc`` (the same view)."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32, device. The common ``seq_lens`` (the same view)."""
    state_indices_tensor: torch.Tensor
    """(num_reqs,) int32, device. State slot of every row: column 0 of the state indices
    (``block_table[i, start_i]``); padding rows read ``NULL_BLOCK_ID = 0``. Graph mode: a view of a
    fixed ``(max_num_reqs,)`` buffer, tail 0."""
    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host twin of ``query_start_loc``."""
    seq_lens_cpu: np.ndarray
    """(num_reqs,) int32, host twin of ``seq_lens``."""
    state_indices_tensor_cpu: np.ndarray
    """(num_reqs,) int32, host twin of ``state_indices_tensor``."""


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return int(value)


def _check_mode(mode: Any, owner: str) -> None:
    if mode not in ("none", "align"):
        raise ValueError(f"{owner}.cache_mode: must be 'none' or 'align' (vLLM mamba_cache_mode), got {mode!r}")


def _mamba_block_size(options: AnyMambaOptions, block_size: int) -> int:
    bs = options.mamba_block_size
    if bs is None:
        return block_size
    return _positive_int(bs, f"{type(options).__name__}.mamba_block_size")


def _spec_tokens(options: AnyMambaOptions) -> int:
    k = getattr(options, "num_speculative_tokens", 0)
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
        raise ValueError(f"Mamba2Options.num_speculative_tokens: must be an int >= 0, got {k!r}")
    return int(k)


_CHECKED: dict[tuple[Any, ...], tuple[int, int]] = {}
"""Options already validated, by ``(options, mamba block size, profile chunk size)`` (immutable values
only, so an entry can never go stale): steady-state steps skip re-validation."""
_LAST_CHECKED: tuple[Any, ...] = (None, 0, None, (0, 0))
"""The last options object validated (``options, bs_m, profile chunk size, result``): a step that passes
the same object skips hashing it (the reference keeps its id from being reused)."""


def _check_mamba2(options: Mamba2Options, bs_m: int, step: Step) -> tuple[int, int]:
    """Validate the Mamba2 options; returns ``(chunk_size, k)``."""
    global _LAST_CHECKED
    prof = step.profile
    pcs = None if prof is None else prof.chunk_size
    last = _LAST_CHECKED
    if options is last[0] and bs_m == last[1] and pcs == last[2]:  # the same options object as last step
        return last[3]  # type: ignore[no-any-return]
    key = (options, bs_m, pcs)
    try:
        hit = _CHECKED.get(key)
    except TypeError:  # an unhashable field: validate (and fail) below
        hit = None
    if hit is not None:
        _LAST_CHECKED = (options, bs_m, pcs, hit)
        return hit
    cs = _positive_int(options.chunk_size, "Mamba2Options.chunk_size")
    _check_mode(options.cache_mode, "Mamba2Options")
    k = _spec_tokens(options)
    ck = options.checkpoint
    if ck is not None:
        if not isinstance(ck, CheckpointConfig):
            raise TypeError(f"Mamba2Options.checkpoint: expected CheckpointConfig or None, got {type(ck).__name__}")
        if options.cache_mode != "align":
            raise ValueError(
                f"Mamba2Options.checkpoint: prefill checkpoints need cache_mode='align' (vLLM 6.8), got "
                f"{options.cache_mode!r}"
            )
        if ck.mamba_block_size != bs_m:
            raise ValueError(
                f"Mamba2Options.checkpoint.mamba_block_size={ck.mamba_block_size} != the builder's mamba "
                f"block size {bs_m}; both describe the same MambaSpec.block_size"
            )
    if prof is not None and prof.chunk_size != cs:
        raise ValueError(
            f"Mamba2Options.chunk_size={cs} != StaticProfile.chunk_size={prof.chunk_size}: graph mode sizes "
            f"the chunk buffers with the profile's max_num_chunks; build the profile with chunk_size={cs}"
        )
    if len(_CHECKED) < 64:
        _CHECKED[key] = (cs, k)
    _LAST_CHECKED = (options, bs_m, pcs, (cs, k))
    return cs, k


def block_table_columns(spec: BatchSpec, options: AnyMambaOptions) -> int:
    """Block-table columns :func:`attnmeta.stage_common` must stage for a Mamba builder of ``spec``.

    The state indices read columns ``start_i .. start_i + k`` (module docstring); the common default
    covers only the blocks the sequences use. Pass the result as ``stage_common(spec, step,
    block_table_columns=...)`` in eager mode (graph mode stages ``profile.max_blocks_per_req``).

    Parameters
    ----------
    spec : BatchSpec
        The step.
    options : Mamba2Options, Mamba1Options or LinearAttnOptions
        The builder's options (mamba block size, cache mode, speculative tokens).

    Returns
    -------
    int
        ``max(1, cdiv(max_seq_len, block_size), max_i(start_i) + 1 + k)`` over the real rows, with
        exact sequence lengths; with prefill checkpoints also the checkpoint column
        ``cdiv(s, mamba_block_size) - 2`` of the longest upper-bound length ``s`` (plus one), as far
        as the spec's table reaches.

    Raises
    ------
    ValueError
        Invalid options.

    Examples
    --------
    >>> from attnmeta import BatchSpec
    >>> spec = BatchSpec(num_computed_tokens=[9], num_scheduled_tokens=[3], block_table=[[1, 2, 3, 4, 5]],
    ...                  block_size=4)
    >>> block_table_columns(spec, Mamba2Options(cache_mode="align", num_speculative_tokens=2))
    5
    >>> block_table_columns(spec, Mamba2Options())
    3
    """
    _check_mode(options.cache_mode, type(options).__name__)
    bs = int(spec.block_size)
    bs_m = _mamba_block_size(options, bs)
    k = _spec_tokens(options)
    s = int(spec.max_exact_seq_len)
    used = -(-s // bs)
    start = max((s - 1) // bs_m, 0) if options.cache_mode == "align" else 0
    # Prefill checkpoints (6.8) read column cdiv(s, bs_m) - 2 with s the *upper-bound* length.
    ckpt = getattr(options, "checkpoint", None)
    ckpt_cols = max(0, -(-int(spec.max_seq_len) // bs_m) - 1) if ckpt is not None else 0
    return max(1, used, start + 1 + k, min(ckpt_cols, int(spec.block_table.shape[1])))


def _state_indices(bt: np.ndarray, sl: np.ndarray, bs_m: int, mode: str, ncols: int, out: np.ndarray) -> None:
    """:func:`mamba_state_indices` into ``out`` (the compiled kernel: the staged inputs are valid);
    a too-narrow table names the fix."""
    if mode in ("none", "align") and int(_state_indices_nb(bt, sl, bs_m, mode == "align", out)) < 0:
        return
    try:  # re-run the validating wrapper for its message
        mamba_state_indices(bt, sl, mamba_block_size=bs_m, mode=mode, num_state_columns=ncols,  # type: ignore[arg-type]
                            out=out)
    except ValueError as e:
        raise ValueError(
            f"state indices: {e}. The common "
            f"metadata stages {bt.shape[1]} block-table columns; stage it with "
            f"stage_common(..., block_table_columns=attnmeta.backends.mamba2.block_table_columns(spec, options)) "
            f"or, in graph mode, a profile with enough max_blocks_per_req"
        ) from e


class _Plan:
    """The fields one builder stages in a step: collected, then reserved with ONE ``alloc_group``.

    ``add`` records a field and, optionally, host values to copy in (``src``). With ``full`` (graph
    mode) all ``capacity`` rows are staged and the tail repeats the last value of ``src`` (the
    sentinel of an indptr-like field depends on the data, so the stager's constant fill cannot
    express it).
    """

    __slots__ = ("fulls", "keys", "prefix", "specs", "srcs")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix + "."
        self.keys: list[str] = []
        self.specs: list[tuple[str, Any, Any, int | None, Any]] = []
        self.srcs: list[np.ndarray | None] = []
        self.fulls: list[bool] = []

    def add(
        self, key: str, shape: Any, dtype: np.dtype, capacity: int | None, fill: Any,
        src: np.ndarray | None = None, full: bool = False,
    ) -> None:
        self.keys.append(key)
        self.specs.append((self.prefix + key, shape, dtype, capacity, fill))
        self.srcs.append(src)
        self.fulls.append(full)

    def allocate(self, step: Step) -> dict[str, np.ndarray]:
        views = step.alloc_group(tuple(self.specs)) if self.specs else []
        out: dict[str, np.ndarray] = {}
        for key, view, src, full in zip(self.keys, views, self.srcs, self.fulls):
            if src is not None:
                if full:
                    n = src.shape[0]
                    view[:n] = src
                    view[n:] = src[n - 1]
                else:
                    view[...] = src
            out[key] = view
        return out


def _indptr_capacity(name: str, rows: int, cap: int | None) -> tuple[int, int | None]:
    """Rows to stage for an indptr-like field of ``rows`` entries (graph mode: all ``cap``)."""
    if cap is None:
        return rows, None
    if rows > cap:
        raise CapacityError(f"{name}: needs {rows} entries but its graph-mode capacity is {cap}")
    return cap, cap


class _Base:
    """What the shared Mamba derivation computes on the host: before staging (:func:`_base`), then
    straight into the staged views (:func:`_fill_base`: state indices, causal-conv1d pointers)."""

    __slots__ = ("accepted", "conv", "conv1d", "conv_nums", "conv_tot", "has_initial_states_p", "is_prefilling",
                 "num_computed_p", "query_start_loc_p", "split")

    def __init__(self, split: SplitCounts, is_prefilling: np.ndarray, num_computed_p: np.ndarray | None,
                 query_start_loc_p: np.ndarray | None, accepted: np.ndarray | None, conv1d: bool) -> None:
        self.split = split
        self.is_prefilling = is_prefilling
        self.num_computed_p = num_computed_p
        self.query_start_loc_p = query_start_loc_p
        self.has_initial_states_p = None if num_computed_p is None else num_computed_p > 0
        self.accepted = accepted
        self.conv1d = conv1d and query_start_loc_p is not None
        self.conv: Conv1dMetadata | None = None
        self.conv_nums: np.ndarray | None = None
        self.conv_tot = 0
        if self.conv1d:
            assert query_start_loc_p is not None
            nums = self.conv_nums = np.empty(query_start_loc_p.shape[0] - 1, np.int32)
            self.conv_tot = int(_count_programs_nb(query_start_loc_p, _CONV1D_BLOCK_M, nums))


def _accepted_rows(values: Any, num_reqs: int, num_real: int, num_decodes: int) -> np.ndarray:
    """The first ``num_decodes`` accepted counts; padding rows (past ``num_real``) are 1."""
    from attnmeta._checks import as_host_array

    a = as_host_array(values, "num_accepted_tokens", dtype=np.int32)
    if a.shape[0] not in (num_real, num_reqs):
        raise ValueError(
            f"num_accepted_tokens: expected one count per real request ({num_real}) or per row ({num_reqs}), "
            f"got shape {a.shape}"
        )
    if a.shape[0] >= num_decodes:
        return a[:num_decodes]
    out = np.ones(num_decodes, np.int32)
    out[: a.shape[0]] = a
    return out


def _base(
    common: Staged[CommonAttentionMetadata],
    *,
    threshold: int,
    moves: bool,
    spec_tokens: int,
    conv1d: bool,
    num_accepted_tokens: Any,
) -> _Base:
    """6.3 on host data, before staging: classification, split, prefill query starts and contexts."""
    h = common.host
    qsl, ub = h["query_start_loc_cpu"], h["seq_lens_cpu_upper_bound"]
    B, T = h["num_reqs"], h["num_actual_tokens"]
    isp = h["is_prefilling"]
    if not moves:
        split = common_split(h, decode_threshold=threshold)
    elif not isp.any():  # nothing to move, and only long queries are prefills
        if h["max_query_len"] <= threshold:
            split = SplitCounts(B, 0, T, 0)  # what the split returns when no row is a prefill
        else:
            split = common_split(h, decode_threshold=threshold, treat_short_extends_as_decodes=False)
    else:
        drafts = h["num_decode_draft_tokens_cpu"] if spec_tokens > 0 else None
        moved = np.empty(B, np.bool_)
        status = int(_classify_nb(qsl, ub, isp, _NO_DRAFTS if drafts is None else drafts, drafts is not None, moved))
        if status < 0:
            classify_mamba_rows(qsl, ub, isp, drafts)  # raises the detailed error
        if status == 0:  # no row moved: the common split of this step (shared with other builders)
            split = common_split(h, decode_threshold=threshold, treat_short_extends_as_decodes=False)
        else:
            isp = moved
            nd, np_, ndt, npt = _split_nb(qsl, T, h["max_query_len"], threshold, False, False, isp)
            split = SplitCounts(int(nd), int(np_), int(ndt), int(npt))
    D, P, Dt = split.num_decodes, split.num_prefills, split.num_decode_tokens
    accepted = None
    given = None if num_accepted_tokens is None else _accepted_rows(num_accepted_tokens, B, h["num_real_reqs"], D)
    if spec_tokens > 0 and D > 0:
        accepted = np.diff(qsl[: D + 1]) if given is None else given
    nc_p = qsl_p = None
    if P > 0:
        nc_p, qsl_p = np.empty(P, np.int32), np.empty(P + 1, np.int32)
        if _prefill_cpu_metadata_nb(qsl, ub, B, Dt, nc_p, qsl_p)[0]:
            prefill_cpu_metadata(qsl, ub, num_reqs=B, num_prefills=P, num_decode_tokens=Dt)  # raises
    return _Base(split, isp, nc_p, qsl_p, accepted, conv1d)


def _plan_base(plan: _Plan, step: Step, b: _Base, ncols: int) -> None:
    """Stage the shared fields (decode fields first: a decode-only step repeats its group shape)."""
    prof = step.profile
    rcap = prof.max_num_reqs if prof is not None else None
    D, P = b.split.num_decodes, b.split.num_prefills
    plan.add("state_indices_tensor_d", (D, ncols), _I32, rcap, _NULL_BLOCK_ID)
    if b.accepted is not None:
        plan.add("num_accepted_tokens", D, _I32, rcap, 1, src=b.accepted)
    plan.add("state_indices_tensor_p", P, _I32, rcap, _NULL_BLOCK_ID)
    qsl_p = b.query_start_loc_p
    if qsl_p is not None:
        rows, cap = _indptr_capacity(plan.prefix + "query_start_loc_p", P + 1,
                                     None if rcap is None else rcap + 1)
        plan.add("query_start_loc_p", rows, _I32, cap, 0, src=qsl_p, full=cap is not None)
        plan.add("has_initial_states_p", P, _BOOL, rcap, False, src=b.has_initial_states_p)
        if b.conv1d:
            # vLLM's length 2 * max(1024, tot); graph mode: tot rows, the stager's -1 fill after them
            tot = b.conv_tot
            rows, cap = (2 * max(1024, tot), None) if prof is None else (tot, _conv1d_capacity(step))
            plan.add("batch_ptr", rows, _I32, cap, -1)
            plan.add("token_chunk_offset_ptr", rows, _I32, cap, -1)


def _conv1d_capacity(step: Step) -> int:
    """Graph mode: ``2 * max(1024, cdiv(max_num_tokens, 8) + max_num_reqs)`` programs (>= any ``tot``)."""
    prof = step.profile
    assert prof is not None
    return 2 * max(1024, -(-prof.max_num_tokens // _CONV1D_BLOCK_M) + prof.max_num_reqs)


def _fill_base(
    views: dict[str, np.ndarray], h: dict[str, Any], b: _Base, bs_m: int, mode: str, ncols: int
) -> None:
    """Compute the state indices and the causal-conv1d pointers straight into the staged views.

    Decode rows gather ``ncols`` columns, prefill rows only the first (all that vLLM keeps of them).
    """
    bt, sl = h["block_table_cpu"], h["seq_lens_cpu"]
    D, B = b.split.num_decodes, h["num_reqs"]
    _state_indices(bt[:D], sl[:D], bs_m, mode, ncols, views["state_indices_tensor_d"])
    sip = views["state_indices_tensor_p"]
    _state_indices(bt[D:B], sl[D:B], bs_m, mode, 1, sip.reshape(B - D, 1))
    if b.conv1d:
        assert b.conv_nums is not None
        tot = b.conv_tot
        bp, op = views["batch_ptr"], views["token_chunk_offset_ptr"]
        mlist = np.empty(tot, np.int64)
        _fill_programs_nb(b.conv_nums, mlist, bp, op)  # values, then -1 to the end of the staged rows
        b.conv = Conv1dMetadata(b.conv_nums, tot, mlist, op[:tot], 2 * max(1024, tot), bp, op)


def _freeze(views: dict[str, np.ndarray], b: _Base) -> None:
    """Make this step's own host arrays read-only (staged views and the kernels' fresh outputs)."""
    for v in views.values():
        v.flags.writeable = False
    if b.num_computed_p is not None:
        b.num_computed_p.flags.writeable = False
    c = b.conv
    if c is not None:
        c.nums.flags.writeable = c.mlist.flags.writeable = c.offsetlist.flags.writeable = False


def _base_fields(
    step: Step, prefix: str, cm: CommonAttentionMetadata, b: _Base, views: dict[str, np.ndarray]
) -> dict[str, Any]:
    """The :class:`MambaMetadata` field values, after the commit."""
    p = prefix + "."
    dev = step.device
    D, P = b.split.num_decodes, b.split.num_prefills
    graph = step.profile is not None
    qsl_p_d = qsl_p_h = None
    if b.query_start_loc_p is not None:
        qsl_p_d = dev(p + "query_start_loc_p")
        qsl_p_h = views["query_start_loc_p"]
        if graph:
            qsl_p_d, qsl_p_h = qsl_p_d[: P + 1], qsl_p_h[: P + 1]
    qsl_d = qsl_d_h = None
    if b.accepted is not None:
        qsl_d, qsl_d_h = cm.query_start_loc[: D + 1], cm.query_start_loc_cpu[: D + 1]
    c = b.conv
    bp = op = bp_h = op_h = None
    nums_dict = None
    if c is not None:
        bp_h, op_h = views["batch_ptr"], views["token_chunk_offset_ptr"]
        if graph:
            bp, op = step.device_full(p + "batch_ptr"), step.device_full(p + "token_chunk_offset_ptr")
            tot = c.num_programs_total
            bp_h, op_h = bp_h[:tot], op_h[:tot]
        else:
            bp, op = dev(p + "batch_ptr"), dev(p + "token_chunk_offset_ptr")
        nums_dict = {_CONV1D_BLOCK_M: {
            "nums": c.nums, "tot": c.num_programs_total, "mlist": c.mlist, "mlist_len": c.num_programs_total,
            "offsetlist": c.offsetlist, "batch_ptr": bp, "token_chunk_offset_ptr": op,
        }}
    has_init = b.query_start_loc_p is not None
    return {
        "common": cm,
        "num_prefills": P,
        "num_prefill_tokens": b.split.num_prefill_tokens,
        "num_decodes": D,
        "num_decode_tokens": b.split.num_decode_tokens,
        "num_reqs": cm.num_reqs,
        "conv1d_num_programs_total": c.num_programs_total if c is not None else 0,
        "conv1d_max_num_programs": int(bp.shape[0]) if bp is not None else 0,
        "has_initial_states_p": dev(p + "has_initial_states_p") if has_init else None,
        "query_start_loc_p": qsl_p_d,
        "state_indices_tensor_p": dev(p + "state_indices_tensor_p"),
        "state_indices_tensor_d": dev(p + "state_indices_tensor_d"),
        "query_start_loc_d": qsl_d,
        "num_accepted_tokens": dev(p + "num_accepted_tokens") if b.accepted is not None else None,
        "seq_lens": cm.seq_lens,
        "batch_ptr": bp,
        "token_chunk_offset_ptr": op,
        "has_initial_states_p_cpu": views["has_initial_states_p"] if has_init else None,
        "query_start_loc_p_cpu": qsl_p_h,
        "state_indices_tensor_p_cpu": views["state_indices_tensor_p"],
        "state_indices_tensor_d_cpu": views["state_indices_tensor_d"],
        "query_start_loc_d_cpu": qsl_d_h,
        "num_accepted_tokens_cpu": views["num_accepted_tokens"] if b.accepted is not None else None,
        "seq_lens_cpu": cm.seq_lens_cpu,
        "batch_ptr_cpu": bp_h,
        "token_chunk_offset_ptr_cpu": op_h,
        "num_computed_tokens_p_cpu": b.num_computed_p,
        "conv1d_nums_cpu": c.nums if c is not None else None,
        "conv1d_mlist_cpu": c.mlist if c is not None else None,
        "conv1d_offsetlist_cpu": c.offsetlist if c is not None else None,
        "nums_dict": nums_dict,
    }


def _host_dict(b: _Base, views: dict[str, np.ndarray]) -> dict[str, Any]:
    """``Staged.host``: the split, the classification and the staged host views (by field name)."""
    return {"split": b.split, "is_prefilling": b.is_prefilling, "num_computed_tokens_p_cpu": b.num_computed_p,
            "query_start_loc_p_cpu": b.query_start_loc_p, "staged": views}


# ------------------------------------------------------------------------------------------------
# the fast path: eager mode without checkpoints / logical chunks / per-token seq_idx
# ------------------------------------------------------------------------------------------------
#
# ONE alloc_fields of a layout known before any pass over the rows (B rows per row field; bounds,
# bucketed, on the chunk and causal-conv1d counts from B and num_actual_tokens), ONE compiled call
# that classifies, splits and writes every array straight into the group's pinned bytes (host-only
# arrays into a buffer that lives with the group), views cached per group and step shape, and the
# result built with a positional constructor. The general path handles every other option; the
# property tests run both against the vLLM reference.

_new_m2 = fast_constructor(Mamba2Metadata)
_new_m1 = fast_constructor(Mamba1Metadata)
_FAST_FIELDS = (
    "state_indices_tensor_d", "num_accepted_tokens", "state_indices_tensor_p", "query_start_loc_p",
    "has_initial_states_p", "cu_chunk_seqlen_p", "seq_idx_p", "last_chunk_indices_p", "batch_ptr",
    "token_chunk_offset_ptr",
)
_FAST_OFFSET = (
    _hm.FILL_O_SI_D, _hm.FILL_O_ACC, _hm.FILL_O_SI_P, _hm.FILL_O_QSL_P, _hm.FILL_O_INIT, _hm.FILL_O_CU,
    _hm.FILL_O_SIDX, _hm.FILL_O_LAST, _hm.FILL_O_BP, _hm.FILL_O_OP,
)
_SpecTuple = tuple[tuple[str, Any, np.dtype, None, int], ...]
_FAST_SPECS: dict[tuple[Any, ...], _SpecTuple] = {}
_BOUNDS: dict[tuple[int, int, int, int], tuple[int, int]] = {}
_new_split = tuple.__new__


class _FastConfig(NamedTuple):
    """What the fast path needs of validated options (cached per options object)."""

    options: Any
    mamba2: bool
    chunk_size: int
    k: int
    mamba_block_size: int | None
    align: bool
    flags: int
    """Bit 0: causal-conv1d metadata; bit 1: chunk metadata."""
    prefix: str


_FAST_CONFIGS: dict[int, _FastConfig] = {}
"""Fast-path configs by ``id(options)``; each holds its options object, so the id is not reused while
the entry lives (a step passing the same options object skips validation)."""


def _fast_config(options: Mamba2Options | Mamba1Options, step: Step, block_size: int) -> _FastConfig | None:
    """The fast-path config of ``options`` (validated), or None when the general path must run:
    graph mode, checkpoints, logical chunks, per-token ``seq_idx``."""
    if step.profile is not None:
        return None
    cfg = _FAST_CONFIGS.get(id(options))
    if cfg is not None and cfg.options is options:
        return cfg
    m2 = isinstance(options, Mamba2Options)
    if m2:
        assert isinstance(options, Mamba2Options)
        if options.checkpoint is not None or options.logical_chunks or options.token_seq_idx:
            return None
        C, k = _check_mamba2(options, _mamba_block_size(options, block_size), step)
    else:
        _check_mode(options.cache_mode, "Mamba1Options")
        _mamba_block_size(options, block_size)
        C, k = 1, 0
    mbs = options.mamba_block_size
    cfg = _FastConfig(options, m2, C, k, None if mbs is None else int(mbs), options.cache_mode == "align",
                      (1 if options.needs_causal_conv1d_metadata else 0) | (2 if m2 else 0), options.prefix)
    if len(_FAST_CONFIGS) >= 64:
        _FAST_CONFIGS.clear()
    _FAST_CONFIGS[id(options)] = cfg
    return cfg


def _bucket(n: int) -> int:
    """``n`` rounded up to a multiple of 64 and of 1/32 of its power of two (at most 64 rows or 3.1%
    more), so a field sized by a bound keeps its layout (and its cached views) while the bound wobbles
    by a few percent; finer than the usual 8 steps per power of two because these fields are large and
    every staged row is copied."""
    step = max(64, 1 << max(n.bit_length() - 6, 0))
    return max(64, (n + step - 1) // step * step)


def _bounds(B: int, T: int, chunk_size: int, flags: int) -> tuple[int, int]:
    """Rows to stage for the chunk fields and the causal-conv1d pointers of a step of ``B`` rows and
    ``T`` tokens (``flags``: bit 0 conv1d, bit 1 chunks), bucketed:
    :func:`~attnmeta.host.chunks.max_num_chunks` of ``T`` tokens in ``B`` rows, and
    ``2 * max(1024, min(T, T // 8 + B))`` (the programs number ``sum(cdiv(q, 8))`` over at most ``B``
    rows of ``T`` tokens)."""
    key = (B, T, chunk_size, flags)
    hit = _BOUNDS.get(key)
    if hit is None:
        nb = _bucket(min(T + B, T // chunk_size + 2 * B)) if flags & 2 else 0
        mb = _bucket(2 * max(1024, min(T, T // _CONV1D_BLOCK_M + B))) if flags & 1 else 0
        if len(_BOUNDS) >= 4096:
            _BOUNDS.clear()
        hit = _BOUNDS[key] = (nb, mb)
    return hit


def _fast_specs(key: tuple[Any, ...]) -> _SpecTuple:
    """The ``alloc_fields`` specs of a fast-path layout ``(prefix, B, ncols, acc, prefills, nb, mb)``
    (``nb`` / ``mb``: chunk / causal-conv1d rows, 0 without them); cached, since the stager hashes the
    tuple every step."""
    prefix, B, ncols, acc, pre, nb, mb = key
    rows: dict[str, Any] = {"state_indices_tensor_d": (B, ncols), "state_indices_tensor_p": B}
    if acc:
        rows["num_accepted_tokens"] = B
    if pre:
        rows.update(query_start_loc_p=B + 1, has_initial_states_p=B)
        if nb:
            rows.update(cu_chunk_seqlen_p=nb + 1, seq_idx_p=nb, last_chunk_indices_p=B)
        if mb:
            rows.update(batch_ptr=mb, token_chunk_offset_ptr=mb)
    specs = tuple((f"{prefix}.{n}", rows[n], _BOOL if n == "has_initial_states_p" else _I32, None, 0)
                  for n in _FAST_FIELDS if n in rows)
    if len(_FAST_SPECS) >= 1024:
        _FAST_SPECS.clear()
    _FAST_SPECS[key] = specs
    return specs


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class _Fast:
    """Fast-path state of one :class:`~attnmeta.staging.FieldGroup` (one ring slot and layout) and
    builder configuration, kept in the group's ``extras``: the host-only buffer (the fill kernel's
    parameters first) and every view handed out.

    The host-only arrays (``num_computed_tokens_p``, the causal-conv1d ``nums`` / ``mlist``, the
    all ``-1`` checkpoint chunk list, ``is_prefilling`` after the moves) live in ``hbuf``, which
    belongs to the group as the staged bytes belong to the slot: a step's arrays stay valid until the
    stager reuses its slot.
    """

    __slots__ = ("cbuf", "ckpt", "dfull", "dlen", "dv", "dview", "full", "hbuf", "hd", "hn", "ht", "hv", "mlist",
                 "moved", "nc", "nums", "obp", "oop", "prm", "qd", "src")

    def __init__(self, group: FieldGroup, key: tuple[Any, ...], chunk_size: int, bs_m: int, align: bool,
                 acc_mode: int) -> None:
        prefix, B, ncols, _acc, _pre, nb, mb = key
        n0 = len(prefix) + 1
        at = {f.name[n0:]: i for i, f in enumerate(group.fields)}
        a4, a8 = (4 * B + 63) // 64 * 64, (8 * B + 63) // 64 * 64
        o_nc = 8 * _hm.FILL_PARAMS
        o_nums, o_ckpt, o_moved = o_nc + a4, o_nc + 2 * a4, o_nc + 2 * a4 + a8
        hbuf = self.hbuf = np.zeros(o_moved + (B + 63) // 64 * 64, np.uint8)
        prm = self.prm = hbuf[:o_nc].view(np.int64)
        for name, o in zip(_FAST_FIELDS, _FAST_OFFSET):
            prm[o] = group.fields[at[name]].offset if name in at else -1
        prm[_hm.FILL_B], prm[_hm.FILL_NCOLS], prm[_hm.FILL_THRESHOLD], prm[_hm.FILL_ACC] = B, ncols, ncols, acc_mode
        prm[_hm.FILL_CHUNK], prm[_hm.FILL_BSM], prm[_hm.FILL_ALIGN] = chunk_size, bs_m, align
        prm[_hm.FILL_CONV], prm[_hm.FILL_CHUNKS], prm[_hm.FILL_MB], prm[_hm.FILL_NB] = mb > 0, nb > 0, mb, nb
        prm[_hm.FILL_H_NC], prm[_hm.FILL_H_NUMS], prm[_hm.FILL_H_MOVED] = o_nc, o_nums, o_moved
        self.nc = _read_only(hbuf[o_nc : o_nc + 4 * B].view(np.int32))
        self.nums = _read_only(hbuf[o_nums : o_nums + 4 * B].view(np.int32))
        ckpt = hbuf[o_ckpt : o_ckpt + 8 * B].view(np.int64)
        ckpt[:] = -1  # ChunkMetadata.checkpoint_chunk_idx without checkpoints; never rewritten
        self.ckpt = _read_only(ckpt)
        self.moved = _read_only(hbuf[o_moved : o_moved + B].view(np.bool_))
        self.mlist: tuple[Any, Any] = (None, None)  # (the slot's shared mlist buffer, its read-only twin)
        fz = group.frozen
        # read-only views of the staged rows, in _FAST_FIELDS order (None: not staged)
        self.full: tuple[Any, ...] = tuple(fz[at[n]] if n in at else None for n in _FAST_FIELDS)
        self.src: tuple[Any, ...] = (None, None)  # the common's (qsl, ub) views the packed kernel was set up for
        self.cbuf: np.ndarray | None = None  # ... and the common's host-only bytes (None: explicit arrays)
        self.obp = int(prm[_hm.FILL_O_BP])  # byte offsets of batch_ptr / token_chunk_offset_ptr (-1: none)
        self.oop = int(prm[_hm.FILL_O_OP])
        self.hv: tuple[Any, ...] = (-1, -1, -1)  # per-step host views, by (D, num_chunks, tot) ...
        self.hd: tuple[Any, ...] = (-1,)  # ... assembled from the views sized by D, ...
        self.hn: tuple[Any, ...] = (-1, False)  # ... by the chunk count ...
        self.ht: tuple[Any, ...] = (-1, False, None, None, None, None, None)  # ... and by the conv1d program count
        self.dv: tuple[Any, ...] = (None, -1, -1, -1)  # per-step device views, by (group views, D, n, tot)
        self.dlen: list[int] = []  # per field: rows of its cached device view (dview), from the full view (dfull)
        self.dview: list[Any] = []
        self.dfull: list[Any] = []
        self.qd: tuple[Any, ...] = (None, None, None, -1)  # query_start_loc_d: views of the common's, by D

    def locate(self, h: dict[str, Any], buf: np.ndarray | None) -> None:
        """Point the packed kernel at the common metadata's host arrays, or (``cbuf = None``) fall back
        to passing them explicitly when they do not live in the slot / one host-only buffer."""
        qsl, ub = h["query_start_loc_cpu"], h["seq_lens_cpu_upper_bound"]
        self.src = (qsl, ub)
        self.cbuf = None
        sl, bt, isp, dr = h["seq_lens_cpu"], h["block_table_cpu"], h["is_prefilling"], h["num_decode_draft_tokens_cpu"]
        cbuf = ub.base
        if (buf is None or not isinstance(cbuf, np.ndarray) or cbuf.dtype != np.uint8 or cbuf.ndim != 1
                or any(a.base is not buf or not a.flags.c_contiguous for a in (qsl, sl, bt))
                or isp.base is not cbuf or (dr is not None and dr.base is not cbuf)
                or not (ub.flags.c_contiguous and isp.flags.c_contiguous and (dr is None or dr.flags.c_contiguous))):
            return
        b0, c0 = _address(buf), _address(cbuf)
        prm = self.prm
        prm[_hm.FILL_C_QSL], prm[_hm.FILL_C_SL], prm[_hm.FILL_C_BT] = (_address(a) - b0 for a in (qsl, sl, bt))
        prm[_hm.FILL_C_W] = bt.shape[1]
        prm[_hm.FILL_C_UB], prm[_hm.FILL_C_ISP] = _address(ub) - c0, _address(isp) - c0
        prm[_hm.FILL_C_DRAFTS] = -1 if dr is None else _address(dr) - c0
        self.cbuf = cbuf

    def host_views(self, D: int, n: int, tot: int) -> tuple[Any, ...]:
        """The host views of a step shape: ``(D, n, tot, *fields in _FAST_FIELDS order,
        num_computed_tokens_p, nums, mlist, offsetlist, staged, chunk_metadata)``.

        Built from three cached parts, each rebuilt only when its own count changed: the views sized
        by the decode / prefill split (``D``), by the chunk count (``n``) and by the conv1d program
        count (``tot``). A prefill step of an engine changes ``n`` and ``tot`` nearly every step and
        the split far less often.
        """
        si_d, acc, si_p, qsl_p, init, cu, sidx, last, bp, op = self.full
        P = si_p.shape[0] - D
        pre = P > 0
        hd = self.hd
        if hd[0] != D:
            hd = self.hd = (
                D, si_d[:D], acc[:D] if D and acc is not None else None, si_p[:P],
                qsl_p[: P + 1] if pre and qsl_p is not None else None, init[:P] if pre and init is not None else None,
                last[:P] if pre and last is not None else None, self.nc[:P] if pre else None,
                self.nums[:P] if pre and bp is not None else None, self.ckpt[:P],
            )
        hn = self.hn
        if hn[0] != n or hn[1] != pre:
            hn = self.hn = (n, pre, cu[: n + 1] if pre and cu is not None else None,
                            sidx[:n] if pre and sidx is not None else None)
        ht = self.ht
        mlist = self.mlist[1]
        if ht[0] != tot or ht[1] != pre or ht[6] is not mlist:
            total = 2 * max(1024, tot)
            conv = pre and bp is not None
            ht = self.ht = (tot, pre, bp[:total] if conv else None, op[:total] if pre and op is not None else None,
                            mlist[:tot] if conv else None, op[:tot] if conv else None, mlist)
        exact = (hd[1], hd[2], hd[3], hd[4], hd[5], hn[2], hn[3], hd[6], ht[2], ht[3])
        cm = None if hn[2] is None else ChunkMetadata(hn[2], hn[3], hd[6], hd[9], n)
        staged = types.MappingProxyType({k: v for k, v in zip(_FAST_FIELDS, exact) if v is not None})
        self.hv = (D, n, tot, *exact, hd[7], hd[8], ht[4], ht[5], staged, cm)
        return self.hv

    def device_views(self, dev: list[torch.Tensor], hv: tuple[Any, ...]) -> tuple[Any, ...]:
        """The device views of the step shape of host views ``hv``: ``(dev, D, n, tot, *fields in
        _FAST_FIELDS order)``.

        A torch view costs ~1-2 us of host time, and consecutive steps change only some lengths
        (the chunk and conv1d counts of a prefill step; the decode count of a mixed one): a field
        whose length did not change keeps the view of the previous shape (lengths are compared as
        Python ints, ``Tensor.shape`` is not free either).
        """
        if self.dv[0] is not dev:
            self.dlen = [-1] * len(_FAST_FIELDS)
            self.dview = [None] * len(_FAST_FIELDS)
            self.dfull = [None if f is None else t for f, t in zip(self.full, _fill_none(self.full, dev))]
        dlen, dview, dfull = self.dlen, self.dview, self.dfull
        out: list[Any] = [dev, *hv[:3]]
        for i in range(len(_FAST_FIELDS)):
            v = hv[3 + i]
            t = dfull[i]
            if v is None or t is None:
                out.append(None)
                continue
            rows = v.shape[0]
            if dlen[i] != rows:
                dlen[i] = rows
                dview[i] = t if self.full[i].shape[0] == rows else t[:rows]
            out.append(dview[i])
        self.dv = tuple(out)
        return self.dv


def _fill_none(full: tuple[Any, ...], dev: list[torch.Tensor]) -> list[Any]:
    """``dev`` (the staged fields' device views, in order) spread over ``full``'s positions (None
    where a field of _FAST_FIELDS is not staged)."""
    it = iter(dev)
    return [None if f is None else next(it) for f in full]


def _accepted_input(values: Any, num_reqs: int, num_real: int) -> np.ndarray:
    """``num_accepted_tokens`` validated as :func:`_accepted_rows` does (one count per real request
    or per row)."""
    from attnmeta._checks import as_host_array

    a = as_host_array(values, "num_accepted_tokens", dtype=np.int32)
    if a.shape[0] not in (num_real, num_reqs):
        raise ValueError(
            f"num_accepted_tokens: expected one count per real request ({num_real}) or per row ({num_reqs}), "
            f"got shape {a.shape}"
        )
    return a


def _scatter(group: FieldGroup, tmp: np.ndarray) -> None:
    """Copy fields written at their slot offsets into ``tmp`` to the group's own views (the rare step
    in which the slot grew while the group was reserved, so its fields live in two buffers)."""
    for f, view in zip(group.fields, group.host):
        view.reshape(-1).view(np.uint8)[:] = tmp[f.offset : f.offset + f.rows * f.row_bytes]


def _raise_fill_error(status: int, h: dict[str, Any], k: int, bs_m: int, align: bool) -> None:
    """Re-run the validating code on the first bad row the fill kernel reported, for its message."""
    enc = -1 - status
    row, code = enc // 8, enc % 8
    qsl, ub, bt, sl, B = (h["query_start_loc_cpu"], h["seq_lens_cpu_upper_bound"], h["block_table_cpu"],
                          h["seq_lens_cpu"], h["num_reqs"])
    mode = "align" if align else "none"
    if code in (_hm.FILL_E_QSL, _hm.FILL_E_DRAFTS):
        classify_mamba_rows(qsl, ub, h["is_prefilling"], h["num_decode_draft_tokens_cpu"] if k else None)
    elif code == _hm.FILL_E_TABLE_D:  # decode rows before ``row`` fit their 1 + k columns
        _state_indices(bt[: row + 1], sl[: row + 1], bs_m, mode, 1 + k, np.empty((row + 1, 1 + k), np.int32))
    elif code == _hm.FILL_E_TABLE_P:  # every row before ``row`` fits one column
        _state_indices(bt[: row + 1], sl[: row + 1], bs_m, mode, 1, np.empty((row + 1, 1), np.int32))
    elif code == _hm.FILL_E_CONTEXT:
        prefill_cpu_metadata(qsl, ub, num_reqs=B, num_prefills=B - row, num_decode_tokens=int(qsl[row]))
    raise AssertionError(f"mamba fill: internal status {status} (row {row})")  # pragma: no cover


# Builder state kept with the ring slot (Step.slot_extras, emptied when the slot's memory is
# reallocated):
# - "mamba.mlist", prefix -> one int64 ``mlist`` buffer per KV-cache group, shared by every layout
#   that group stages on the slot: a step's mlist lives as long as the slot's other host arrays
#   (until the slot is reused); one per layout would hold ~8 bytes per conv1d program per layout;
# - "mamba.neg" -> ring stamp -> byte ranges of the slot that hold -1 after that step's causal-conv1d
#   tails were written. A step reads the record of the slot's previous use (begun num_slots before
#   it; no step in between touches the slot); within a step, the rows of a field group are written
#   by its owner only, so the -1 rows that record places inside this step's conv1d arrays still
#   hold -1, whichever layout the earlier step had.


def _slot_mlist(step: Step, prefix: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared ``mlist`` buffer of ``step``'s slot and ``prefix`` (at least ``rows`` int64) and its
    read-only twin; grown geometrically (a new buffer: views handed out by the slot's earlier steps
    keep the old one)."""
    key = ("mamba.mlist", prefix)
    ex = step.slot_extras
    cur: tuple[np.ndarray, np.ndarray] | None = ex.get(key)
    if cur is None or cur[0].shape[0] < rows:
        buf = np.zeros(max(rows, 2 * (0 if cur is None else cur[0].shape[0])), np.int64)
        cur = ex[key] = (buf, _read_only(buf))
    return cur


def _stamp(step: Step) -> int:
    """The ring stamp of ``step`` (``StagerStats.steps_begun`` when it began)."""
    return int(step.stager.stats.steps_begun)


def _known_rows(ranges: list[tuple[int, int]], offset: int, rows: int) -> tuple[int, int]:
    """The longest run of int32 rows ``[lo, hi)`` of an array at byte ``offset`` (``rows`` long) that
    lies inside one of the byte ``ranges``; ``(0, 0)`` if none."""
    best = (0, 0)
    for a, b in ranges:
        lo = max(0, -(-(a - offset) // 4))
        hi = min(rows, (b - offset) // 4)
        if hi - lo > best[1] - best[0]:
            best = (lo, hi)
    return best


def _note_tails(rec: dict[int, list[tuple[int, int]]], stamp: int, fs: _Fast, tot: int, num_slots: int) -> None:
    """Record that rows ``[tot, 2 * max(1024, tot))`` of both conv1d arrays now hold -1."""
    total = 2 * max(1024, tot)
    rec.setdefault(stamp, []).extend(((fs.obp + 4 * tot, fs.obp + 4 * total), (fs.oop + 4 * tot, fs.oop + 4 * total)))
    for old in [k for k in rec if k < stamp - num_slots]:  # steps read the slot's previous use only
        del rec[old]


def _stage_fast(
    common: Staged[CommonAttentionMetadata], step: Step, cfg: _FastConfig, num_accepted_tokens: Any
) -> Staged[Any]:
    """:func:`stage` / :func:`stage_mamba1` in eager mode without checkpoints, logical chunks or
    per-token ``seq_idx``: one ``alloc_fields``, one fill kernel, cached views."""
    h = common.host
    B, T, isp = h["num_reqs"], h["num_actual_tokens"], h["is_prefilling"]
    k = cfg.k
    thr = 1 + k
    C = cfg.chunk_size
    # Prefill rows are possible when a query is longer than the threshold or a row still prefills;
    # a step that cannot have any stages no prefill fields.
    pre = h["max_query_len"] > thr or bool(isp.any())
    nb, mb = _bounds(B, T, C, cfg.flags) if pre else (0, 0)
    acc_mode = (1 if num_accepted_tokens is None else 2) if k else 0
    key = (cfg.prefix, B, thr, acc_mode != 0, pre, nb, mb)
    specs = _FAST_SPECS.get(key)
    group = step.alloc_fields(specs if specs is not None else _fast_specs(key))
    bs_m = cfg.mamba_block_size or h["block_size"]
    ekey = (C, bs_m, cfg.align, acc_mode)
    fs = group.extras.get(ekey)
    if fs is None:
        fs = group.extras[ekey] = _Fast(group, key, C, bs_m, cfg.align, acc_mode)
    buf = group.buf
    known = (0, 0, 0, 0)
    rec = None
    if mb and buf is not None:
        rec = step.slot_extras.setdefault("mamba.neg", {})
        prev = rec.get(_stamp(step) - step.stager.num_slots)
        if prev is not None:
            known = (*_known_rows(prev, fs.obp, mb), *_known_rows(prev, fs.oop, mb))
    if mb:
        fs.mlist = _slot_mlist(step, cfg.prefix, mb // 2)
    mlist = fs.mlist[0] if mb else _NO_MLIST
    acc_in = _NO_DRAFTS if num_accepted_tokens is None else _accepted_input(num_accepted_tokens, B, h["num_real_reqs"])
    src = fs.src
    if src[0] is not h["query_start_loc_cpu"] or src[1] is not h["seq_lens_cpu_upper_bound"]:
        fs.locate(h, buf)
    if fs.cbuf is not None and buf is not None:
        status, num_moved, D, Dt, tot, n, prep = _mamba_fill_packed_nb(buf, fs.cbuf, fs.hbuf, mlist, acc_in, T, *known)
    else:
        dr = h["num_decode_draft_tokens_cpu"] if k else None
        target = buf if buf is not None else np.empty(group.end, np.uint8)
        status, num_moved, D, Dt, tot, n, prep = _mamba_fill_nb(
            h["query_start_loc_cpu"], h["seq_lens_cpu_upper_bound"], isp, _NO_DRAFTS if dr is None else dr,
            h["seq_lens_cpu"], h["block_table_cpu"], acc_in, target, fs.hbuf, mlist, T, *known)
        if buf is None and not status:
            _scatter(group, target)
    if status:
        _raise_fill_error(status, h, k, bs_m, cfg.align)
    if rec is not None and D < B:  # (without prefill rows the kernel writes no conv1d rows)
        _note_tails(rec, _stamp(step), fs, tot, step.stager.num_slots)
    hv = fs.hv
    if hv[0] != D or hv[1] != n or hv[2] != tot or fs.ht[6] is not fs.mlist[1]:
        hv = fs.host_views(D, n, tot)
    P = B - D
    split = _new_split(SplitCounts, (D, P, Dt, T - Dt))
    conv = hv[11] is not None
    host = {"split": split, "is_prefilling": fs.moved if num_moved else isp, "num_computed_tokens_p_cpu": hv[13],
            "query_start_loc_p_cpu": hv[6], "staged": hv[17]}

    def views() -> tuple[tuple[Any, ...], Any, Any, Any]:
        """The device views, ``query_start_loc_d`` (device and host) and ``nums_dict``."""
        dev = group.device(step)  # raises if the step has not committed or its slot was reused
        dv = fs.dv
        if dv[0] is not dev or dv[1] != D or dv[2] != n or dv[3] != tot:
            dv = fs.device_views(dev, hv)
        qd = None
        if D and hv[4] is not None:  # spec decode with decodes: query_start_loc_d, a view of the common's
            qd = fs.qd
            cm_qsl = common.result().query_start_loc
            if qd[0] is not cm_qsl or qd[3] != D:
                qd = fs.qd = (cm_qsl, cm_qsl[: D + 1], common.host["query_start_loc_cpu"][: D + 1], D)
        nums_dict = None
        if conv:
            nums_dict = {_CONV1D_BLOCK_M: {
                "nums": hv[14], "tot": tot, "mlist": hv[15], "mlist_len": tot, "offsetlist": hv[16],
                "batch_ptr": dv[12], "token_chunk_offset_ptr": dv[13],
            }}
        return dv, None if qd is None else qd[1], None if qd is None else qd[2], nums_dict

    M = 2 * max(1024, tot) if conv else 0
    Pt = T - Dt
    if not cfg.mamba2:

        def make1() -> Mamba1Metadata:
            cm = common.result()
            dv, _qd, _qd_h, nums_dict = views()
            return _new_m1(
                cm, P, Pt, D, Dt, cm.num_reqs, tot, M, dv[8], dv[7], dv[6], dv[4], None, None, cm.seq_lens,
                dv[12], dv[13], hv[7], hv[6], hv[5], hv[3], None, None, cm.seq_lens_cpu, hv[11], hv[12],
                hv[13], hv[14], hv[15], hv[16], nums_dict, None, None, None, None, None,
            )

        return Staged(step, host, make1)
    host["chunk_metadata"], host["checkpoints"] = hv[18], None

    def make2() -> Mamba2Metadata:
        cm = common.result()
        dv, qd, qd_h, nums_dict = views()
        return _new_m2(
            cm, P, Pt, D, Dt, cm.num_reqs, tot, M, dv[8], dv[7], dv[6], dv[4], qd, dv[5], cm.seq_lens,
            dv[12], dv[13], hv[7], hv[6], hv[5], hv[3], qd_h, hv[4], cm.seq_lens_cpu, hv[11], hv[12],
            hv[13], hv[14], hv[15], hv[16], nums_dict, None, None, None, None, None,
            prep, C, n, dv[9], dv[10], dv[11], None, None, None, None,
            hv[8], hv[9], hv[10], None, None, None, None, None,
        )

    return Staged(step, host, make2)


# ------------------------------------------------------------------------------------------------
# Mamba2
# ------------------------------------------------------------------------------------------------


def stage(
    common: Staged[CommonAttentionMetadata],
    step: Step,
    options: Mamba2Options = Mamba2Options(),
    *,
    num_accepted_tokens: np.ndarray | None = None,
) -> Staged[Mamba2Metadata]:
    """Derive Mamba2 metadata from the staged common metadata, staging into the same step.

    Parameters
    ----------
    common : Staged[CommonAttentionMetadata]
        From :func:`attnmeta.stage_common` on the same ``step`` (a batch reordered decode -> short
        extend -> long extend -> prefill, as vLLM's runner orders it), staged with at least
        :func:`block_table_columns` columns.
    step : Step
        The open step.
    options : Mamba2Options
        Chunk size, cache mode, spec decode, checkpoints, extra chunk formats, namespace.
    num_accepted_tokens : (num_real_reqs,) or (num_reqs,) int32, host, optional
        Spec decode only: the runner's accepted-token count of every row (padding rows 1 when only
        the real rows are given). Default: ``diff(query_start_loc_d)`` (vLLM's capture / no-count
        path).

    Returns
    -------
    Staged[Mamba2Metadata]
        ``.result()`` after the commit. ``.host`` holds ``split``
        (:class:`~attnmeta.host.split.SplitCounts`), ``is_prefilling`` after the moves,
        ``num_computed_tokens_p_cpu``, ``query_start_loc_p_cpu``, ``chunk_metadata``
        (:class:`~attnmeta.host.chunks.ChunkMetadata` or None), ``checkpoints`` and ``staged`` (the
        staged host views by field name; a read-only mapping of exact-length views on the fast path,
        see "The per-step cost"), for other builders of the same step.

    Raises
    ------
    ValueError
        Bad options; ``num_accepted_tokens`` without spec decode or of the wrong length; a block table
        too narrow for the state columns.
    TypeError
        A non-:class:`~attnmeta.host.mamba.CheckpointConfig` checkpoint, or a torch tensor passed as
        ``num_accepted_tokens``.
    attnmeta.staging.CapacityError
        Graph mode: the step exceeds a profile capacity.
    """
    if common.step is not step:
        require_same_step(common, step)  # raises
    cfg = _fast_config(options, step, common.host["block_size"])
    if cfg is not None:
        if num_accepted_tokens is not None and cfg.k == 0:
            raise ValueError(
                "num_accepted_tokens: given, but spec decode is off (Mamba2Options.num_speculative_tokens == 0)")
        return _stage_fast(common, step, cfg, num_accepted_tokens)
    h = common.host
    bs_m = _mamba_block_size(options, h["block_size"])
    C, k = _check_mamba2(options, bs_m, step)
    if num_accepted_tokens is not None and k == 0:
        raise ValueError("num_accepted_tokens: given, but spec decode is off (Mamba2Options.num_speculative_tokens == 0)")
    b = _base(common, threshold=1 + k, moves=True, spec_tokens=k,
              conv1d=bool(options.needs_causal_conv1d_metadata), num_accepted_tokens=num_accepted_tokens)
    B, P, Pt = h["num_reqs"], b.split.num_prefills, b.split.num_prefill_tokens
    prof = step.profile
    rcap = prof.max_num_reqs if prof is not None else None
    plan = _Plan(options.prefix)
    _plan_base(plan, step, b, 1 + k)

    cm_host = ckpt = ck_idx = logical = q_p = None
    if P > 0:
        nc_p, qsl_p = b.num_computed_p, b.query_start_loc_p
        assert nc_p is not None and qsl_p is not None
        if options.checkpoint is not None:
            q_p = np.diff(qsl_p)
            ckpt = prefill_checkpoints(h["seq_lens_cpu_upper_bound"][B - P:], q_p, h["block_table_cpu"][B - P:],
                                       config=options.checkpoint)
        cm_host = chunk_metadata(C, nc_p, qsl_p, None if ckpt is None else ckpt.offsets)
        n = cm_host.num_chunks
        ccap = prof.max_num_chunks if prof is not None else None
        rows, cap = _indptr_capacity(plan.prefix + "cu_chunk_seqlen_p", n + 1,
                                     None if ccap is None else ccap + 1)
        plan.add("cu_chunk_seqlen_p", rows, _I32, cap, 0, src=cm_host.cu_chunk_seqlens, full=cap is not None)
        if ccap is not None and n > ccap:
            raise CapacityError(f"{plan.prefix}seq_idx_p: needs {n} chunks but the profile's max_num_chunks is {ccap}")
        plan.add("seq_idx_p", n, _I32, ccap, -1, src=cm_host.seq_idx)
        plan.add("last_chunk_indices_p", P, _I32, rcap, -1, src=cm_host.last_chunk_indices)
        if ckpt is not None:
            ck_idx = checkpoint_chunk_index_tensor_values(cm_host.checkpoint_chunk_idx)
            assert ck_idx is not None  # prefill_checkpoints returns None when no row has one
            assert ckpt.state_indices is not None
            plan.add("checkpoint_chunk_idx", P, _I64, rcap, 0, src=ck_idx)
            plan.add("checkpoint_offsets", P, _I32, rcap, 0, src=ckpt.offsets)
            plan.add("checkpoint_cols", P, _I64, rcap, -1, src=ckpt.cols)
            plan.add("checkpoint_state_indices", P, _I32, rcap, _NULL_BLOCK_ID, src=ckpt.state_indices)
        if options.logical_chunks:
            logical = logical_chunks(qsl_p, C)
            lcap = None if prof is None else -(-prof.max_num_tokens // C) + prof.max_num_reqs
            nl = logical[0].shape[0]
            if lcap is not None and nl > lcap:
                raise CapacityError(f"{plan.prefix}chunk_indices_p: needs {nl} logical chunks but its capacity is {lcap}")
            plan.add("chunk_indices_p", nl, _I32, lcap, 0, src=logical[0])
            plan.add("chunk_offsets_p", nl, _I32, lcap, 0, src=logical[1])
        if options.token_seq_idx:
            tcap = prof.max_num_tokens if prof is not None else None
            plan.add("token_seq_idx_p", Pt, _I32, tcap, -1)
    views = plan.allocate(step)
    _fill_base(views, h, b, bs_m, options.cache_mode, 1 + k)
    if "token_seq_idx_p" in views:
        assert b.query_start_loc_p is not None
        token_seq_idx(b.query_start_loc_p, num_tokens_padded=Pt, consecutive=bool(options.consecutive_seq_ids),
                      out=views["token_seq_idx_p"])
    prefix = options.prefix
    graph = prof is not None

    def make() -> Mamba2Metadata:
        cm = common.result()
        dev = step.device
        p = prefix + "."
        _freeze(views, b)  # first: views sliced below inherit read-only
        fields = _base_fields(step, prefix, cm, b, views)
        has = views.get
        cu_d = cu_h = None
        if cm_host is not None:
            cu_d, cu_h = dev(p + "cu_chunk_seqlen_p"), views["cu_chunk_seqlen_p"]
            if graph:
                cu_d, cu_h = cu_d[: cm_host.num_chunks + 1], cu_h[: cm_host.num_chunks + 1]
        ck_meta = None
        if ckpt is not None:
            assert q_p is not None
            q_p.flags.writeable = False
            ck_meta = MambaCheckpointMetadata(
                offsets=dev(p + "checkpoint_offsets"), cols=dev(p + "checkpoint_cols"),
                state_indices=dev(p + "checkpoint_state_indices"), offsets_cpu=views["checkpoint_offsets"],
                cols_cpu=views["checkpoint_cols"], state_indices_cpu=views["checkpoint_state_indices"],
                query_lens_cpu=q_p, first_row=B - P,
            )

        def pair(key: str) -> tuple[torch.Tensor | None, np.ndarray | None]:
            v = has(key)
            return (dev(p + key), v) if v is not None else (None, None)

        seq_d, seq_h = pair("seq_idx_p")
        last_d, last_h = pair("last_chunk_indices_p")
        ck_d, ck_h = pair("checkpoint_chunk_idx")
        ci_d, ci_h = pair("chunk_indices_p")
        co_d, co_h = pair("chunk_offsets_p")
        ts_d, ts_h = pair("token_seq_idx_p")
        return Mamba2Metadata(
            **fields,
            prep_initial_states=bool(b.has_initial_states_p.any()) if b.has_initial_states_p is not None else False,
            chunk_size=C,
            num_chunks=cm_host.num_chunks if cm_host is not None else 0,
            cu_chunk_seqlen_p=cu_d, seq_idx_p=seq_d, last_chunk_indices_p=last_d, checkpoint_chunk_idx=ck_d,
            chunk_indices_p=ci_d, chunk_offsets_p=co_d, token_seq_idx_p=ts_d,
            cu_chunk_seqlen_p_cpu=cu_h, seq_idx_p_cpu=seq_h, last_chunk_indices_p_cpu=last_h,
            checkpoint_chunk_idx_cpu=ck_h, chunk_indices_p_cpu=ci_h, chunk_offsets_p_cpu=co_h,
            token_seq_idx_p_cpu=ts_h, checkpoint_meta=ck_meta,
        )

    host = _host_dict(b, views)
    host["chunk_metadata"] = cm_host
    host["checkpoints"] = ckpt
    return Staged(step, host, make)


def _build_with(spec: BatchSpec, stager: Stager, options: AnyMambaOptions, stage_fn: Any, **kw: Any) -> Any:
    cols = None if stager.graph_mode else block_table_columns(spec, options)
    with stager.step() as step:
        staged = stage_fn(stage_common(spec, step, block_table_columns=cols), step, options, **kw)
    return staged.result()


def build(
    spec: BatchSpec,
    stager: Stager,
    options: Mamba2Options = Mamba2Options(),
    *,
    num_accepted_tokens: np.ndarray | None = None,
) -> Mamba2Metadata:
    """Common + Mamba2 metadata of ``spec`` in one step of its own (one copy).

    The common metadata is staged with :func:`block_table_columns` columns (eager mode).

    Parameters
    ----------
    spec : BatchSpec
        The step (reordered: decodes, short extends, then prefills).
    stager : Stager
        Owns the pinned ring; the step commits before this returns.
    options : Mamba2Options
        As for :func:`stage`.
    num_accepted_tokens : (num_real_reqs,) or (num_reqs,) int32, host, optional
        As for :func:`stage`.

    Returns
    -------
    Mamba2Metadata
        Device fields are views into the step's upload.

    Raises
    ------
    ValueError, TypeError, attnmeta.staging.CapacityError
        As for :func:`stage` and :func:`attnmeta.stage_common`.

    Examples
    --------
    Spec decode with 2 drafts (threshold 3), ``"align"`` mode: a spec-decode row, a stateful
    one-token prompt chunk (moved to the decode side), a fresh prefill and a padding row:

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[9, 4, 0], num_scheduled_tokens=[3, 1, 6],
    ...                  num_prompt_tokens=[5, 8, 6], num_draft_tokens=[2, 0, 0],
    ...                  block_table=np.arange(30, dtype=np.int32).reshape(3, 10), block_size=4,
    ...                  num_reqs_padded=4)
    >>> m = build(spec, Stager("cpu"), Mamba2Options(chunk_size=4, cache_mode="align", num_speculative_tokens=2),
    ...           num_accepted_tokens=np.array([2, 1, 1], np.int32))
    >>> m.num_decodes, m.num_prefills, m.num_decode_tokens, m.num_prefill_tokens
    (2, 2, 4, 6)
    >>> m.state_indices_tensor_d_cpu
    array([[ 2,  3,  4],
           [11, 12, 13]], dtype=int32)
    >>> m.query_start_loc_d_cpu, m.num_accepted_tokens_cpu, m.state_indices_tensor_p_cpu
    (array([0, 3, 4], dtype=int32), array([2, 1], dtype=int32), array([21,  0], dtype=int32))
    """
    out: Mamba2Metadata = _build_with(spec, stager, options, stage, num_accepted_tokens=num_accepted_tokens)
    return out


# ------------------------------------------------------------------------------------------------
# Mamba1
# ------------------------------------------------------------------------------------------------


def stage_mamba1(
    common: Staged[CommonAttentionMetadata], step: Step, options: Mamba1Options = Mamba1Options()
) -> Staged[Mamba1Metadata]:
    """Derive Mamba1 metadata from the staged common metadata, staging into the same step.

    The shared Mamba derivation of :func:`stage` with threshold 1, no spec-decode fields and no
    chunk metadata (vLLM calls ``_compute_common_metadata(cam)`` without spec arguments, 6.12). The
    one-token-stateful-prefill move still applies.

    Parameters
    ----------
    common : Staged[CommonAttentionMetadata]
        From :func:`attnmeta.stage_common` on the same ``step``.
    step : Step
        The open step.
    options : Mamba1Options
        Cache mode, mamba block size, conv1d metadata, namespace.

    Returns
    -------
    Staged[Mamba1Metadata]
        ``.result()`` after the commit; ``.host`` as for :func:`stage`.

    Raises
    ------
    ValueError
        Bad options or a block table too narrow for the state column.
    attnmeta.staging.CapacityError
        Graph mode: the step exceeds a profile capacity.
    """
    require_same_step(common, step)
    h = common.host
    _check_mode(options.cache_mode, "Mamba1Options")
    bs_m = _mamba_block_size(options, h["block_size"])
    cfg = _fast_config(options, step, h["block_size"])
    if cfg is not None:
        return _stage_fast(common, step, cfg, None)
    b = _base(common, threshold=1, moves=True, spec_tokens=0,
              conv1d=bool(options.needs_causal_conv1d_metadata), num_accepted_tokens=None)
    plan = _Plan(options.prefix)
    _plan_base(plan, step, b, 1)
    views = plan.allocate(step)
    _fill_base(views, h, b, bs_m, options.cache_mode, 1)
    prefix = options.prefix

    def make() -> Mamba1Metadata:
        cm = common.result()
        _freeze(views, b)
        return Mamba1Metadata(**_base_fields(step, prefix, cm, b, views))

    return Staged(step, _host_dict(b, views), make)


def build_mamba1(spec: BatchSpec, stager: Stager, options: Mamba1Options = Mamba1Options()) -> Mamba1Metadata:
    """Common + Mamba1 metadata of ``spec`` in one step of its own (one copy).

    Parameters
    ----------
    spec : BatchSpec
        The step (reordered).
    stager : Stager
        Owns the pinned ring; the step commits before this returns.
    options : Mamba1Options
        As for :func:`stage_mamba1`.

    Returns
    -------
    Mamba1Metadata
        Device fields are views into the step's upload.

    Raises
    ------
    ValueError, attnmeta.staging.CapacityError
        As for :func:`stage_mamba1` and :func:`attnmeta.stage_common`.
    """
    out: Mamba1Metadata = _build_with(spec, stager, options, stage_mamba1)
    return out


# ------------------------------------------------------------------------------------------------
# linear attention
# ------------------------------------------------------------------------------------------------


def stage_linear_attn(
    common: Staged[CommonAttentionMetadata], step: Step, options: LinearAttnOptions = LinearAttnOptions()
) -> Staged[LinearAttentionMetadata]:
    """Derive linear-attention metadata from the staged common metadata, staging into the same step.

    vLLM's ``LinearAttentionMetadataBuilder`` (6.12): ``split_decodes_and_prefills`` at threshold 1
    with the default short-extend handling (no ``is_prefilling``, no moves), ``query_start_loc`` and
    ``seq_lens`` passed through, and column 0 of the state indices for every row.

    Parameters
    ----------
    common : Staged[CommonAttentionMetadata]
        From :func:`attnmeta.stage_common` on the same ``step``.
    step : Step
        The open step.
    options : LinearAttnOptions
        Cache mode, mamba block size, namespace.

    Returns
    -------
    Staged[LinearAttentionMetadata]
        ``.result()`` after the commit; ``.host`` holds ``split`` and ``state_indices_tensor_cpu``.

    Raises
    ------
    ValueError
        Bad options or a block table too narrow for the state column.
    attnmeta.staging.CapacityError
        Graph mode: the step exceeds a profile capacity.
    """
    require_same_step(common, step)
    h = common.host
    _check_mode(options.cache_mode, "LinearAttnOptions")
    bs_m = _mamba_block_size(options, h["block_size"])
    B = h["num_reqs"]
    split = common_split(h, decode_threshold=1)  # the step's shared split
    prof = step.profile
    si = step.alloc(options.prefix + ".state_indices_tensor", B, _I32,
                    capacity=prof.max_num_reqs if prof is not None else None, fill=_NULL_BLOCK_ID)
    _state_indices(h["block_table_cpu"], h["seq_lens_cpu"], bs_m, options.cache_mode, 1, si.reshape(B, 1))
    name = options.prefix + ".state_indices_tensor"

    def make() -> LinearAttentionMetadata:
        cm = common.result()
        si.flags.writeable = False
        return LinearAttentionMetadata(
            common=cm,
            num_prefills=split.num_prefills,
            num_prefill_tokens=split.num_prefill_tokens,
            num_decodes=split.num_decodes,
            num_decode_tokens=split.num_decode_tokens,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            state_indices_tensor=step.device(name),
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens_cpu=cm.seq_lens_cpu,
            state_indices_tensor_cpu=si,
        )

    return Staged(step, {"split": split, "state_indices_tensor_cpu": si}, make)


def build_linear_attn(
    spec: BatchSpec, stager: Stager, options: LinearAttnOptions = LinearAttnOptions()
) -> LinearAttentionMetadata:
    """Common + linear-attention metadata of ``spec`` in one step of its own (one copy).

    Parameters
    ----------
    spec : BatchSpec
        The step (reordered).
    stager : Stager
        Owns the pinned ring; the step commits before this returns.
    options : LinearAttnOptions
        As for :func:`stage_linear_attn`.

    Returns
    -------
    LinearAttentionMetadata
        Device fields are views into the step's upload.

    Raises
    ------
    ValueError, attnmeta.staging.CapacityError
        As for :func:`stage_linear_attn` and :func:`attnmeta.stage_common`.
    """
    out: LinearAttentionMetadata = _build_with(spec, stager, options, stage_linear_attn)
    return out
