"""Mamba2 metadata (docs/semantics-mamba.md), derived on the host, staged in the step's one copy.

The builder is :data:`MAMBA2` (registry name ``"mamba2"``; :func:`stage` and :func:`build` are its
methods): vLLM 0.33.0's ``Mamba2AttentionMetadataBuilder``, field for field. It classifies the rows
(docs/semantics-mamba.md, "Classification"), gathers the state indices, computes the prefill query
starts, contexts and initial-state flags, the causal-conv1d launch metadata, the chunk-aligned SSD
layout (``cu_chunk_seqlen_p``, ``seq_idx_p``, ``last_chunk_indices_p``), "align"-mode prefill
checkpoints and the spec-decode fields; optionally also the two chunk formats other engines use
(logical ``chunk_indices`` / ``chunk_offsets`` and the per-token ``seq_idx`` of ``mamba_ssm``).

Everything is computed from the common metadata's **host** arrays by the one fill path of the Mamba
builders (:mod:`attnmeta.backends.mamba._fill`: one cached field group per ring slot and layout, one
compiled call per step) and moves in the step's single H2D copy; nothing is read back from the
device. The common metadata must be staged with :func:`~attnmeta.backends.mamba.block_table_columns`
columns (the generic :func:`attnmeta.builder.build` does, and stages no per-token ``positions`` /
``slot_mapping``: a Mamba KV-cache group reads neither).

Graph mode (a :class:`~attnmeta.profile.StaticProfile`): every device field has a fixed address and
capacity (``Step.device_full(prefix + ".<field>")``) and rows past the step's length hold the
sentinels of docs/semantics-mamba.md, "CUDA graphs (graph mode)"; the profile's ``chunk_size`` must
equal the options'.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, CUDA-graph padding rows included.
- ``num_decodes`` (``D``) / ``num_prefills`` (``P``): rows ``[0, D)`` / ``[D, B)`` after the split.
- ``num_prefill_tokens`` (``Pt``): tokens of the prefill rows, token padding included.
- ``num_spec_tokens`` (``k``): :attr:`Mamba2Options.num_speculative_tokens`.
- ``num_chunks``: chunks of the chunk-aligned layout; ``num_logical_chunks``: of the logical one.
- ``num_programs_total`` (``tot``): causal-conv1d programs, ``sum(cdiv(query_len_p, 8))``;
  ``max_num_programs``: ``2 * max(1024, tot)`` (graph mode: the fixed capacity).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._checks import check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory
from attnmeta.backends.mamba._fill import Filled, FilledStaged, FillReplayer, fill, fill_key
from attnmeta.backends.mamba._shared import (
    CACHE_MODE_RULE,
    MAMBA_BLOCK_SIZE_RULE,
    AlignReadsLengths,
    CacheMode,
    MambaHost,
    MambaMetadata,
    block_table_columns,
    check_checkpoint_option,
    common_needs,
    excess_drafts_reason,
)
from attnmeta.builder import Builder, CommonNeeds, register
from attnmeta.host.mamba import CheckpointConfig
from attnmeta.metadata import CommonAttentionMetadata, StagedCommon
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import Staged, Step

__all__ = [
    "MAMBA2",
    "CheckpointConfig",
    "Mamba2Builder",
    "Mamba2Inputs",
    "Mamba2Metadata",
    "Mamba2Options",
    "MambaCheckpointMetadata",
    "block_table_columns",
    "build",
    "stage",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Mamba2Options:
    """Options of the Mamba2 builder (the static part of vLLM's builder configuration), validated when
    constructed: a wrong type is a ``TypeError`` naming the option, a bad value a ``ValueError``.

    Examples
    --------
    >>> Mamba2Options(chunk_size=128, cache_mode="align", num_speculative_tokens=2).prefix
    'mamba2'
    >>> Mamba2Options(chunk_size=0)
    Traceback (most recent call last):
    ValueError: Mamba2Options.chunk_size: must be >= 1, got 0
    """

    chunk_size: int = dataclasses.field(default=256, metadata=option_rule("int", minimum=1))
    """SSD chunk size ``C`` (vLLM ``model_config.get_mamba_chunk_size()``)."""
    mamba_block_size: int | None = dataclasses.field(default=None, metadata=MAMBA_BLOCK_SIZE_RULE)
    """Mamba block size (``MambaSpec.block_size``), used by ``"align"`` mode, at least the step's
    ``block_size`` (vLLM: equal); ``None``: the common metadata's ``block_size`` (the mamba group's
    block table)."""
    cache_mode: CacheMode = dataclasses.field(default="none", metadata=CACHE_MODE_RULE)
    """vLLM's ``mamba_cache_mode``: ``"none"`` (state in column 0) or ``"align"`` (the last blocks)."""
    num_speculative_tokens: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0))
    """``k``; spec decode is on when > 0: the decode threshold becomes ``1 + k``, decode rows get
    ``1 + k`` state columns, ``query_start_loc_d`` and ``num_accepted_tokens``."""
    checkpoint: CheckpointConfig | None = None
    """Prefill checkpoints (docs/semantics-mamba.md, "Prefill checkpoints"); only with
    ``cache_mode="align"``, and its ``mamba_block_size`` must equal the builder's mamba block size."""
    needs_causal_conv1d_metadata: bool = dataclasses.field(default=True, metadata=option_rule("bool"))
    """Emit the causal-conv1d launch metadata for prefills."""
    logical_chunks: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """Also emit vLLM-v0 / SGLang / TRT-LLM ``chunk_indices_p`` / ``chunk_offsets_p``."""
    token_seq_idx: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """Also emit the per-token ``token_seq_idx_p`` of the upstream ``mamba_ssm`` kernels."""
    consecutive_seq_ids: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """``token_seq_idx_p`` numbers the non-empty prefill sequences 0, 1, 2, ... instead of by row."""
    prefix: str = dataclasses.field(default="mamba2", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)
        check_checkpoint_option(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MambaCheckpointMetadata(MetadataBase):
    """"align"-mode prefill checkpoints of one step (vLLM's ``checkpoint_meta``; docs/semantics-mamba.md,
    "Prefill checkpoints").

    Row ``j`` is prefill row ``j`` (batch row ``first_row + j``). A row without a checkpoint has
    offset 0, column -1 and state index 0.

    Examples
    --------
    A prefill row of 9 new tokens after 2 cached ones; the configuration exports the state at absolute
    position 4 (offset 2 into the query), from column ``cdiv(11, 4) - 2 = 1``:

    >>> from attnmeta import BatchSpec, Stager
    >>> from attnmeta.backends.mamba import CheckpointConfig
    >>> cfg = CheckpointConfig(hash_block_size=2, cache_hit_alignment_tokens=4, mamba_block_size=4,
    ...                        checkpoint_alignment=2, drop_eagle_block=True)
    >>> spec = BatchSpec(num_computed_tokens=[2], num_scheduled_tokens=[9], num_prompt_tokens=[20],
    ...                  block_table=[[5, 6, 7, 8]], block_size=4)
    >>> ck = build(spec, Stager("cpu"), Mamba2Options(chunk_size=4, cache_mode="align", checkpoint=cfg)).checkpoint_meta
    >>> ck.offsets_cpu, ck.cols_cpu, ck.state_indices_cpu, ck.query_lens_cpu, ck.first_row
    (array([2], dtype=int32), array([1]), array([6], dtype=int32), array([9], dtype=int32), 0)
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


_make_checkpoints = keyword_factory(MambaCheckpointMetadata)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class Mamba2Metadata(MambaMetadata):
    """Mamba2 metadata (vLLM's ``Mamba2AttentionMetadata``): the shared Mamba fields
    (:class:`~attnmeta.backends.mamba.MambaMetadata`) plus the SSD chunks.

    The chunk fields are ``None`` when ``num_prefills == 0`` (vLLM computes them only for
    prefills); the optional formats also when their option is off. Device fields are views of the
    step's device arena; host arrays are read-only views of its pinned slot (or of host-only buffers
    that live as long), valid until the stager reuses the slot.

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
    >>> m.state_indices_tensor_d_cpu.tolist(), m.state_indices_tensor_p_cpu.tolist()
    ([[1]], [3, 5])
    >>> m.query_start_loc_p_cpu, m.has_initial_states_p_cpu, m.prep_initial_states
    (array([ 0, 10, 13], dtype=int32), array([ True, False]), True)
    >>> m.cu_chunk_seqlen_p_cpu, m.seq_idx_p_cpu, m.last_chunk_indices_p_cpu
    (array([ 0,  3, 10, 13], dtype=int32), array([0, 0, 1], dtype=int32), array([1, 2], dtype=int32))
    >>> m.chunk_indices_p_cpu, m.chunk_offsets_p_cpu
    (array([0, 1, 1], dtype=int32), array([0, 0, 2], dtype=int32))
    >>> m.conv1d_nums_cpu, m.batch_ptr_cpu[:4], m.conv1d_max_num_programs
    (array([2, 1], dtype=int32), array([ 0,  0,  1, -1], dtype=int32), 2048)
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

    prep_initial_states: bool
    """Whether any prefill row continues a state, host only: vLLM's ``any(nc_p_cpu > 0)`` of the upper
    bounds (``any(has_initial_states_p)`` wherever a prefill row's bound is exact, as vLLM's runner makes
    it); False without prefills."""
    chunk_size: int
    """SSD chunk size ``C``."""
    num_chunks: int
    """Chunks of the chunk-aligned layout (``len(seq_idx_p)``); 0 without prefills."""
    cu_chunk_seqlen_p: torch.Tensor | None
    """(num_chunks + 1,) int32, device, or None without prefills. Token offset of each chunk in the
    packed prefill tokens; ``[-1] == query_start_loc_p[-1]``. Chunks never cross a sequence nor an
    absolute multiple of ``C`` of their request (a context that is not a multiple of ``C`` first gets a
    realigning chunk), nor a checkpoint offset. An unaligned zero-token row has one zero-length chunk
    (vLLM's quirk)."""
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
    (docs/semantics-mamba.md, "Logical chunks"): the physical chunk ``[j*C, (j+1)*C)`` of the packed
    prefill tokens each logical chunk lies in."""
    chunk_offsets_p: torch.Tensor | None
    """(num_logical_chunks,) int32, device, or None. Start of each logical chunk inside its physical
    chunk."""
    token_seq_idx_p: torch.Tensor | None
    """(num_prefill_tokens,) int32, device, or None (option off / no prefills). Prefill row of each
    prefill token (``mamba_ssm``'s ``seq_idx``; consecutive ids with ``consecutive_seq_ids``), -1 for
    token padding."""
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


_make_m2 = keyword_factory(Mamba2Metadata)
_NO_PREFILLS: dict[str, Any] = dict.fromkeys((
    "cu_chunk_seqlen_p", "seq_idx_p", "last_chunk_indices_p", "checkpoint_chunk_idx", "chunk_indices_p", "chunk_offsets_p",
    "token_seq_idx_p", "cu_chunk_seqlen_p_cpu", "seq_idx_p_cpu", "last_chunk_indices_p_cpu", "checkpoint_chunk_idx_cpu",
    "chunk_indices_p_cpu", "chunk_offsets_p_cpu", "token_seq_idx_p_cpu", "checkpoint_meta",
))
_NO_PREFILLS.update(prep_initial_states=False, num_chunks=0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Mamba2Inputs:
    """Per-step inputs of the Mamba2 builder.

    Examples
    --------
    >>> Mamba2Inputs(num_accepted_tokens=[2, 1]).num_accepted_tokens
    [2, 1]
    """

    num_accepted_tokens: npt.ArrayLike | None = None
    """(num_real_reqs,) or (num_reqs,) int32, host. Spec decode only: the runner's accepted-token
    count of every row (padding rows 1 when only the real rows are given); each decode row's in
    ``[1, 1 + num_speculative_tokens]`` (the prefill rows' are not read). Default:
    ``diff(query_start_loc_d)`` (vLLM's capture path)."""


class Mamba2Builder(AlignReadsLengths, Builder[Mamba2Options, Mamba2Inputs, MambaHost, Mamba2Metadata]):
    """The Mamba2 builder (:data:`MAMBA2`).

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
    ...           Mamba2Inputs(num_accepted_tokens=np.array([2, 1, 1], np.int32)))
    >>> m.num_decodes, m.num_prefills, m.num_decode_tokens, m.num_prefill_tokens
    (2, 2, 4, 6)
    >>> m.state_indices_tensor_d_cpu
    array([[ 2,  3,  4],
           [11, 12, 13]], dtype=int32)
    >>> m.query_start_loc_d_cpu, m.num_accepted_tokens_cpu, m.state_indices_tensor_p_cpu
    (array([0, 3, 4], dtype=int32), array([2, 1], dtype=int32), array([21,  0], dtype=int32))
    """

    name = "mamba2"
    options_type = Mamba2Options
    inputs_type = Mamba2Inputs
    metadata_type = Mamba2Metadata

    def needs(self, shape: StepShape, options: Mamba2Options) -> CommonNeeds:
        """No per-token arrays; :func:`~attnmeta.backends.mamba.block_table_columns` columns."""
        return common_needs(block_table_columns(shape, options))

    def derive(self, common: StagedCommon, step: Step, options: Mamba2Options,
               inputs: Mamba2Inputs) -> Staged[MambaHost, Mamba2Metadata]:
        """Derive Mamba2 metadata from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step`` (a batch reordered decode -> short
            extend -> long extend -> prefill, as vLLM's runner orders it), staged with at least
            :func:`~attnmeta.backends.mamba.block_table_columns` columns.
        step : Step
            The open step.
        options : Mamba2Options
            Chunk size, cache mode, spec decode, checkpoints, extra chunk formats, namespace.
        inputs : Mamba2Inputs
            Spec decode only: the accepted-token counts.

        Returns
        -------
        Staged[MambaHost, Mamba2Metadata]
            ``.host`` (:class:`~attnmeta.backends.mamba.MambaHost`: the split, ``is_prefilling`` after
            the moves, the prefill query starts and contexts, the chunk layout and checkpoints) for
            builders staged after it; ``.result()`` after the commit.

        Raises
        ------
        ValueError
            ``num_accepted_tokens`` without spec decode, of the wrong length, or with a decode row's
            count outside ``[1, 1 + num_speculative_tokens]`` (naming the row); ``"align"`` mode with
            a mamba block size below the block size; a block table too narrow for the state or
            checkpoint columns; a checkpoint block size other than the builder's; graph mode: a chunk
            size other than the profile's.
        TypeError
            A torch tensor or a non-integer array passed as ``num_accepted_tokens``.
        attnmeta.staging.CapacityError
            Graph mode: the step exceeds a profile capacity.

        Examples
        --------
        Through :meth:`~attnmeta.builder.Builder.stage` (the shared preamble, then this), with the
        step's accepted-token counts as :class:`Mamba2Inputs`:

        >>> from attnmeta import BatchSpec, Stager, stage_common
        >>> spec = BatchSpec(num_computed_tokens=[9, 0], num_scheduled_tokens=[2, 5], num_prompt_tokens=[4, 5],
        ...                  num_draft_tokens=[1, 0], block_table=[[1, 2, 3], [4, 5, 6]], block_size=4)
        >>> opts = Mamba2Options(chunk_size=4, num_speculative_tokens=1)
        >>> with Stager("cpu").step() as step:
        ...     common = stage_common(spec, step, block_table_columns=block_table_columns(spec, opts))
        ...     staged = MAMBA2.stage(common, step, opts, Mamba2Inputs(num_accepted_tokens=[2, 1]))
        >>> staged.host.split
        SplitCounts(num_decodes=1, num_prefills=1, num_decode_tokens=2, num_prefill_tokens=5)
        >>> m = staged.result()
        >>> m.state_indices_tensor_d_cpu.tolist(), m.num_accepted_tokens_cpu.tolist()
        ([[1, 2]], [2])
        """
        o = options
        C = o.chunk_size
        f = fill(common, step, "Mamba2Options", o.prefix, o.num_speculative_tokens, C, o.mamba_block_size, o.cache_mode == "align",
                 o.needs_causal_conv1d_metadata, o.checkpoint, o.logical_chunks, o.token_seq_idx, o.consecutive_seq_ids,
                 inputs.num_accepted_tokens)
        return FilledStaged(step, f, lambda: _metadata(f, common.result(), C))

    def unsupported_reasons(self, spec: BatchSpec, options: Mamba2Options, inputs: Mamba2Inputs) -> list[str]:
        """``num_accepted_tokens`` without spec decode, or not one count per real request or row; with spec
        decode on, a row that verifies more drafts than ``num_speculative_tokens`` (vLLM's runner never
        schedules one: past the decode threshold ``1 + k`` it would run as a prefill, its drafts taken
        into the state as accepted tokens)."""
        k = options.num_speculative_tokens
        drafts = excess_drafts_reason(spec, k, "Mamba2Options")
        if drafts is not None:
            return [drafts]
        acc = inputs.num_accepted_tokens
        if acc is None:
            return []
        if not k:
            return ["num_accepted_tokens: given, but spec decode is off (Mamba2Options.num_speculative_tokens == 0)"]
        n = np.shape(acc)
        if n != (spec.num_reqs,) and n != (spec.padded_num_reqs,):
            return [f"num_accepted_tokens: expected one count per real request ({spec.num_reqs}) or per row "
                    f"({spec.padded_num_reqs}), got shape {n}"]
        return []


    def replay_key(self, shape: StepShape, options: Mamba2Options, inputs: Mamba2Inputs) -> Hashable:
        """The fill path's layout (:func:`~attnmeta.backends.mamba._fill.fill_key`): rows, whether a row
        may prefill, the bucketed chunk and causal-conv1d rows (a replayed step writes them all)."""
        o = options
        return fill_key(shape.padded_num_reqs, shape.padded_num_tokens, shape.max_query_len, shape.any_prefilling,
                        o.prefix, o.num_speculative_tokens, o.chunk_size, o.needs_causal_conv1d_metadata, o.checkpoint,
                        o.logical_chunks, o.token_seq_idx, None, o.cache_mode == "align")

    def any_rows_key(self, shape: StepShape, options: Mamba2Options, inputs: Mamba2Inputs) -> Hashable:
        """Graph mode stages every field of the fill path whole, at the profile's rows
        (:func:`~attnmeta.backends.mamba._fill.fill_key`), and a replay reads the counts from the step's
        common part: :meth:`replay_key` without the counts."""
        o = options
        return fill_key(0, 0, shape.max_query_len, shape.any_prefilling, o.prefix, o.num_speculative_tokens,
                        o.chunk_size, o.needs_causal_conv1d_metadata, o.checkpoint, o.logical_chunks, o.token_seq_idx,
                        None, o.cache_mode == "align")

    def replayer(self, staged: Staged[MambaHost, Mamba2Metadata], common: StagedCommon, step: Step,
                 options: Mamba2Options, inputs: Mamba2Inputs) -> FillReplayer[Mamba2Metadata]:
        """Replays rewrite the recorded layout's fields with the fill path's one compiled call."""
        assert isinstance(staged, FilledStaged)
        o = options
        C = o.chunk_size
        return FillReplayer(staged.filled, lambda f, cm: _metadata(f, cm, C), "Mamba2Options", o.prefix,
                            o.num_speculative_tokens, C, o.mamba_block_size, o.cache_mode == "align", o.checkpoint,
                            o.consecutive_seq_ids)


def _metadata(f: Filled, cm: CommonAttentionMetadata, C: int) -> Mamba2Metadata:
    """A filled step's Mamba2 metadata, after its commit (a staged and a replayed step alike)."""
    shared = f.shared_fields(cm)
    P = f.P
    if not P:
        return _make_m2(**shared, **_NO_PREFILLS, chunk_size=C)
    lay, n, dev, hd, dd = f.layout, f.n, f.dev, f.host_d, f.dev_d
    cu_h, sidx_h = lay.host_n(n)
    cu_d, sidx_d = lay.device_n(dev, n)
    ci_h = co_h = ci_d = co_d = ts_h = ts_d = ck_meta = ck_d = ck_h = None
    if lay.logical is not None:
        ci_h, co_h = lay.host_l(f.nl)
        ci_d, co_d = lay.device_l(dev, f.nl)
    if lay.tokens is not None:
        ts_h, ts_d = lay.host_pt(f.Pt), lay.device_pt(dev, f.Pt)
    if f.nck:
        ck_d, ck_h = dd[9], hd[12]
        ck_meta = _make_checkpoints(offsets=dd[6], cols=dd[7], state_indices=dd[8], offsets_cpu=hd[9],
                                    cols_cpu=hd[10], state_indices_cpu=hd[11], query_lens_cpu=hd[8],
                                    first_row=f.D)
    return _make_m2(
        **shared, prep_initial_states=f.prep, chunk_size=C, num_chunks=n, cu_chunk_seqlen_p=cu_d,
        seq_idx_p=sidx_d, last_chunk_indices_p=dd[5], checkpoint_chunk_idx=ck_d, chunk_indices_p=ci_d,
        chunk_offsets_p=co_d, token_seq_idx_p=ts_d, cu_chunk_seqlen_p_cpu=cu_h, seq_idx_p_cpu=sidx_h,
        last_chunk_indices_p_cpu=hd[6], checkpoint_chunk_idx_cpu=ck_h, chunk_indices_p_cpu=ci_h,
        chunk_offsets_p_cpu=co_h, token_seq_idx_p_cpu=ts_h, checkpoint_meta=ck_meta,
    )


MAMBA2 = register(Mamba2Builder())
"""The registered Mamba2 builder."""
stage = MAMBA2.stage
build = MAMBA2.build
