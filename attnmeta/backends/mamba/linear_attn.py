"""Linear-attention metadata (docs/semantics-mamba.md, "Mamba1 and linear attention"), derived on the host.

The builder is :data:`LINEAR_ATTN` (registry name ``"linear_attn"``; :func:`stage` and :func:`build`
are its methods): vLLM 0.33.0's ``LinearAttentionMetadataBuilder``. The plain decode/prefill split at
threshold 1 (short extends count as decodes, no rows move; the step's shared split of
:meth:`attnmeta.metadata.CommonHost.split`), ``query_start_loc`` and ``seq_lens`` passed through, and
one state index per row (column 0 of the state indices, gathered on the host by the same compiled
kernel as the Mamba builders', :func:`attnmeta.host.mamba.mamba_state_indices`).

Replay (:class:`attnmeta.compose.StepBuilder`): the one staged field has a row per request row whatever
the step holds, so every step replays its slot's recorded layout of its row count (decode, prefill and
mixed steps alike): a replay rewrites the state indices with the same compiled gather as ``derive``
(:func:`_write_state_indices`) and makes the metadata from the step's split and common metadata
(:func:`_per_step`).

Shape legend
------------
- ``num_reqs`` (``B``): request rows, padding included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import numpy as np
import torch

from attnmeta._checks import check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory, template
from attnmeta.backends.mamba._shared import (
    CACHE_MODE_RULE,
    MAMBA_BLOCK_SIZE_RULE,
    NULL_BLOCK_ID,
    AlignReadsLengths,
    CacheMode,
    block_table_columns,
    check_align_block_size,
    common_needs,
    state_indices_error,
)
from attnmeta.builder import Builder, CommonNeeds, Replayer, register
from attnmeta.host.mamba import state_indices_nb
from attnmeta.host.split import SplitCounts
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import StepShape
from attnmeta.staging import Staged, Step

__all__ = [
    "LINEAR_ATTN",
    "LinearAttentionBuilder",
    "LinearAttentionHost",
    "LinearAttentionMetadata",
    "LinearAttentionOptions",
    "block_table_columns",
    "build",
    "stage",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinearAttentionOptions:
    """Options of the linear-attention builder (vLLM ``LinearAttentionMetadataBuilder``), validated
    when constructed.

    Examples
    --------
    >>> LinearAttentionOptions(cache_mode="all")
    Traceback (most recent call last):
    ValueError: LinearAttentionOptions.cache_mode: must be 'none' or 'align', got 'all'
    """

    mamba_block_size: int | None = dataclasses.field(default=None, metadata=MAMBA_BLOCK_SIZE_RULE)
    """Mamba block size for ``"align"`` mode, at least the step's ``block_size``; ``None``: the common
    metadata's ``block_size``."""
    cache_mode: CacheMode = dataclasses.field(default="none", metadata=CACHE_MODE_RULE)
    """vLLM's ``mamba_cache_mode``."""
    prefix: str = dataclasses.field(default="linear_attn", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, slots=True)
class LinearAttentionHost:
    """The host part of a staged linear-attention metadata (``Staged.host``)."""

    split: SplitCounts
    """The plain split at threshold 1 (the step's shared one)."""
    state_indices_tensor_cpu: np.ndarray
    """(num_reqs,) int32, host (read-only). Column 0 of the state indices of every row."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class LinearAttentionMetadata(MetadataBase):
    """Linear-attention metadata (vLLM's ``LinearAttentionMetadata``).

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[6, 0, 2], num_scheduled_tokens=[1, 4, 1],
    ...                  block_table=[[7, 8], [9, 10], [11, 12]], block_size=4)
    >>> la = build(spec, Stager("cpu"))
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


_make_la = keyword_factory(LinearAttentionMetadata)

_PER_STEP = ("common", "num_prefills", "num_prefill_tokens", "num_decodes", "num_decode_tokens", "query_start_loc",
             "seq_lens", "query_start_loc_cpu", "seq_lens_cpu")
"""The fields a step of one layout changes (:func:`_per_step` computes them; the state indices' views are
the layout's)."""


def _per_step(cm: CommonAttentionMetadata, split: SplitCounts) -> tuple[Any, ...]:
    """The values of :data:`_PER_STEP` of a step, from its common metadata and its split: every value a step
    of a layout changes, for a staged and a replayed step alike."""
    return (cm, split.num_prefills, split.num_prefill_tokens, split.num_decodes, split.num_decode_tokens,
            cm.query_start_loc, cm.seq_lens, cm.query_start_loc_cpu, cm.seq_lens_cpu)


def _metadata(cm: CommonAttentionMetadata, split: SplitCounts, si: torch.Tensor,
              si_cpu: np.ndarray) -> LinearAttentionMetadata:
    """The step's metadata after the commit, from its common metadata, its split and the views of its
    state indices."""
    return _make_la(**dict(zip(_PER_STEP, _per_step(cm, split), strict=True)), state_indices_tensor=si,
                    state_indices_tensor_cpu=si_cpu)


def _write_state_indices(h: CommonHost, o: LinearAttentionOptions, out: np.ndarray) -> None:
    """Column 0 of every row's state indices into ``out`` (``(num_reqs,)`` int32, every byte), with the
    compiled gather of the Mamba builders: a staged and a replayed step alike.

    Raises
    ------
    ValueError
        ``"align"`` mode with a mamba block size below the block size; a block table too narrow for a
        row's state column.
    """
    bs_m = h.block_size if o.mamba_block_size is None else o.mamba_block_size
    align = o.cache_mode == "align"
    if align and bs_m < h.block_size:
        check_align_block_size("LinearAttentionOptions", bs_m, h.block_size)  # raises
    B = h.num_reqs
    if state_indices_nb(h.block_table_cpu, h.seq_lens_cpu, bs_m, align, out.reshape(B, 1)) >= 0:
        raise state_indices_error(h, slice(0, B), bs_m, o.cache_mode, 1)


class LinearAttentionBuilder(AlignReadsLengths, Builder[LinearAttentionOptions, None, LinearAttentionHost, LinearAttentionMetadata]):
    """The linear-attention builder (:data:`LINEAR_ATTN`)."""

    name = "linear_attn"
    options_type = LinearAttentionOptions
    metadata_type = LinearAttentionMetadata

    def needs(self, shape: StepShape, options: LinearAttentionOptions) -> CommonNeeds:
        """No per-token arrays; :func:`~attnmeta.backends.mamba.block_table_columns` columns."""
        return common_needs(block_table_columns(shape, options))

    def derive(
        self, common: StagedCommon, step: Step, options: LinearAttentionOptions, inputs: None
    ) -> Staged[LinearAttentionHost, LinearAttentionMetadata]:
        """Derive linear-attention metadata from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : LinearAttentionOptions
            Cache mode, mamba block size, namespace.
        inputs : None
            The builder takes no per-step inputs (:attr:`~attnmeta.builder.Builder.inputs_type` is None).

        Returns
        -------
        Staged[LinearAttentionHost, LinearAttentionMetadata]
            ``.host`` (the split and the host state indices); ``.result()`` after the commit.

        Raises
        ------
        ValueError
            A block table too narrow for the state column; ``"align"`` mode with a mamba block size
            below the block size.
        attnmeta.staging.CapacityError
            Graph mode: more rows than ``max_num_reqs``.
        """
        o = options
        h = common.host
        B = h.num_reqs
        split = h.split(1)  # the step's shared split
        prof = step.profile
        name = o.prefix + ".state_indices_tensor"
        group = step.alloc_fields(((name, B, np.int32, prof.max_num_reqs if prof is not None else None, NULL_BLOCK_ID),))
        _write_state_indices(h, o, group.host[0])
        si_ro = group.frozen[0]

        def make() -> LinearAttentionMetadata:
            return _metadata(common.result(), split, group.device(step)[0], si_ro)

        return _Staged(step, LinearAttentionHost(split, si_ro), make, group.host[0])

    def replay_key(self, shape: StepShape, options: LinearAttentionOptions, inputs: None) -> Hashable:
        """The rows of the one staged field (the state indices, a row per request row): every step replays
        its slot's recorded layout of its row count, whatever its split."""
        return shape.padded_num_reqs

    def replayer(self, staged: Staged[LinearAttentionHost, LinearAttentionMetadata], common: StagedCommon, step: Step,
                 options: LinearAttentionOptions, inputs: None) -> _Replayer:
        """Replays rewrite the recorded step's state indices (:func:`_write_state_indices`)."""
        assert isinstance(staged, _Staged)
        return _Replayer(staged.result(), options, staged.state_indices)


class _Staged(Staged[LinearAttentionHost, LinearAttentionMetadata]):
    """A staged linear-attention step: its host part, and the writable host view of its state indices (for a
    replayer of its layout)."""

    __slots__ = ("state_indices",)

    def __init__(self, step: Step, host: LinearAttentionHost, make: Callable[[], LinearAttentionMetadata],
                 state_indices: np.ndarray) -> None:
        super().__init__(step, host, make)
        self.state_indices = state_indices


class _Replayer(Replayer[None, LinearAttentionMetadata]):
    """Replays of a linear-attention layout: :func:`_write_state_indices` into the recorded step's field (the
    slot's memory, at the same place), then the recorded metadata with this step's :data:`_PER_STEP` values
    (:func:`_per_step`)."""

    __slots__ = ("make", "options", "state_indices")

    def __init__(self, recorded: LinearAttentionMetadata, options: LinearAttentionOptions,
                 state_indices: np.ndarray) -> None:
        self.options, self.state_indices = options, state_indices
        self.make = template(recorded, _PER_STEP)

    def rewrite(self, step: Step, host: CommonHost, inputs: None) -> None:
        _write_state_indices(host, self.options, self.state_indices)

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: None) -> LinearAttentionMetadata:
        return self.make(*_per_step(common, host.split(1)))


LINEAR_ATTN = register(LinearAttentionBuilder())
"""The registered linear-attention builder."""
stage = LINEAR_ATTN.stage
build = LINEAR_ATTN.build
