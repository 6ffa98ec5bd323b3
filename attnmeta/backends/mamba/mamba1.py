"""Mamba1 metadata (docs/semantics-mamba.md, "Mamba1 and linear attention"), derived on the host.

The builder is :data:`MAMBA1` (registry name ``"mamba1"``; :func:`stage` and :func:`build` are its
methods): vLLM 0.33.0's ``Mamba1AttentionMetadataBuilder``, the shared Mamba fields alone. It runs
the one fill path of the Mamba builders (:mod:`attnmeta.backends.mamba._fill`) with threshold 1,
no spec-decode fields and no chunk metadata (vLLM calls ``_compute_common_metadata(cam)`` without
spec arguments); the one-token-stateful-prefill move still applies.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, CUDA-graph padding rows included.
- ``num_decodes`` (``D``) / ``num_prefills`` (``P``): rows ``[0, D)`` / ``[D, B)`` after the split.
- ``num_programs_total`` (``tot``): causal-conv1d programs, ``sum(cdiv(query_len_p, 8))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from attnmeta._checks import check_option_fields, option_rule
from attnmeta._fields import keyword_factory
from attnmeta.backends.mamba._fill import Filled, FilledStaged, FillReplayer, fill, fill_key
from attnmeta.backends.mamba._shared import (
    CACHE_MODE_RULE,
    MAMBA_BLOCK_SIZE_RULE,
    AlignReadsLengths,
    CacheMode,
    MambaHost,
    MambaMetadata,
    block_table_columns,
    common_needs,
)
from attnmeta.builder import Builder, CommonNeeds, register
from attnmeta.metadata import CommonAttentionMetadata, StagedCommon
from attnmeta.spec import StepShape
from attnmeta.staging import Staged, Step

__all__ = ["MAMBA1", "Mamba1Builder", "Mamba1Metadata", "Mamba1Options", "block_table_columns", "build", "stage"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Mamba1Options:
    """Options of the Mamba1 builder (vLLM passes it no spec-decode arguments: threshold 1), validated
    when constructed.

    Examples
    --------
    >>> Mamba1Options(cache_mode="align", mamba_block_size=16).prefix
    'mamba1'
    """

    mamba_block_size: int | None = dataclasses.field(default=None, metadata=MAMBA_BLOCK_SIZE_RULE)
    """Mamba block size for ``"align"`` mode, at least the step's ``block_size``; ``None``: the common
    metadata's ``block_size``."""
    cache_mode: CacheMode = dataclasses.field(default="none", metadata=CACHE_MODE_RULE)
    """vLLM's ``mamba_cache_mode``."""
    needs_causal_conv1d_metadata: bool = dataclasses.field(default=True, metadata=option_rule("bool"))
    """Emit the causal-conv1d launch metadata for prefills."""
    prefix: str = dataclasses.field(default="mamba1", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class Mamba1Metadata(MambaMetadata):
    """Mamba1 metadata: exactly the shared Mamba fields (vLLM's ``Mamba1AttentionMetadata``; see
    :class:`~attnmeta.backends.mamba.MambaMetadata`).

    Examples
    --------
    A decode, then a 5-token chunk that continues 3 cached tokens, ``"none"`` mode (state in column 0):

    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[6, 3], num_scheduled_tokens=[1, 5],
    ...                  num_prompt_tokens=[2, 20], block_table=[[7, 8], [9, 10]], block_size=4)
    >>> m = build(spec, Stager("cpu"))
    >>> m.num_decodes, m.num_prefills, m.state_indices_tensor_d_cpu.tolist(), m.state_indices_tensor_p_cpu
    (1, 1, [[7]], array([9], dtype=int32))
    >>> m.query_start_loc_p_cpu, m.has_initial_states_p_cpu, m.query_start_loc_d
    (array([0, 5], dtype=int32), array([ True]), None)
    """


_make_m1 = keyword_factory(Mamba1Metadata)


class Mamba1Builder(AlignReadsLengths, Builder[Mamba1Options, None, MambaHost, Mamba1Metadata]):
    """The Mamba1 builder (:data:`MAMBA1`)."""

    name = "mamba1"
    options_type = Mamba1Options
    metadata_type = Mamba1Metadata

    def needs(self, shape: StepShape, options: Mamba1Options) -> CommonNeeds:
        """No per-token arrays; :func:`~attnmeta.backends.mamba.block_table_columns` columns."""
        return common_needs(block_table_columns(shape, options))

    def derive(
        self, common: StagedCommon, step: Step, options: Mamba1Options, inputs: None
    ) -> Staged[MambaHost, Mamba1Metadata]:
        """Derive Mamba1 metadata from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : Mamba1Options
            Cache mode, mamba block size, conv1d metadata, namespace.
        inputs : None
            The builder takes no per-step inputs (:attr:`~attnmeta.builder.Builder.inputs_type` is None).

        Returns
        -------
        Staged[MambaHost, Mamba1Metadata]
            ``.host`` as for the Mamba2 builder (no chunks); ``.result()`` after the commit.

        Raises
        ------
        ValueError
            A block table too narrow for the state column; ``"align"`` mode with a mamba block size
            below the block size.
        attnmeta.staging.CapacityError
            Graph mode: the step exceeds a profile capacity.
        """
        o = options
        f = fill(common, step, "Mamba1Options", o.prefix, 0, 0, o.mamba_block_size, o.cache_mode == "align",
                 o.needs_causal_conv1d_metadata, None, False, False, False, None)
        return FilledStaged(step, f, lambda: _metadata(f, common.result()))

    def replay_key(self, shape: StepShape, options: Mamba1Options, inputs: None) -> Hashable:
        """The fill path's layout (:func:`~attnmeta.backends.mamba._fill.fill_key`): rows, whether a row
        may prefill, the bucketed causal-conv1d rows (a replayed step writes them all)."""
        o = options
        return fill_key(shape.padded_num_reqs, shape.padded_num_tokens, shape.max_query_len, shape.any_prefilling,
                        o.prefix, 0, 0, o.needs_causal_conv1d_metadata, None, False, False, None,
                        o.cache_mode == "align")

    def any_rows_key(self, shape: StepShape, options: Mamba1Options, inputs: None) -> Hashable:
        """Graph mode stages every field of the fill path whole, at the profile's rows: :meth:`replay_key`
        without the counts (Mamba2's)."""
        o = options
        return fill_key(0, 0, shape.max_query_len, shape.any_prefilling, o.prefix, 0, 0, o.needs_causal_conv1d_metadata,
                        None, False, False, None, o.cache_mode == "align")

    def replayer(self, staged: Staged[MambaHost, Mamba1Metadata], common: StagedCommon, step: Step,
                 options: Mamba1Options, inputs: None) -> FillReplayer[Mamba1Metadata]:
        """Replays rewrite the recorded layout's fields with the fill path's one compiled call (Mamba2's
        replayer, without chunks or spec decode)."""
        assert isinstance(staged, FilledStaged)
        o = options
        return FillReplayer(staged.filled, _metadata, "Mamba1Options", o.prefix, 0, 0, o.mamba_block_size,
                            o.cache_mode == "align", None, False)


def _metadata(f: Filled, cm: CommonAttentionMetadata) -> Mamba1Metadata:
    """A filled step's Mamba1 metadata, after its commit (a staged and a replayed step alike)."""
    return _make_m1(**f.shared_fields(cm))


MAMBA1 = register(Mamba1Builder())
"""The registered Mamba1 builder."""
stage = MAMBA1.stage
build = MAMBA1.build
