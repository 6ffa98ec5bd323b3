"""An engine loop's common, FlashAttention and FlashInfer metadata in one call per step.

:class:`FusedStepBuilder` is a :class:`~attnmeta.compose.StepBuilder` of one group, the registered
FlashAttention and FlashInfer builders over the common metadata, that returns the three objects as a
:class:`FusedStep`. Everything it does (the common metadata with the page table FlashInfer reads, the
block table rounded up by ``table_column_step``: :func:`table_columns`, replays of steady-state steps)
is the composer's: see :mod:`attnmeta.compose`.

Shape legend
------------
As in :mod:`attnmeta.metadata`, :mod:`attnmeta.backends.flash_attn` and
:mod:`attnmeta.backends.flashinfer`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from attnmeta.backends.flash_attn import FLASH_ATTN, FlashAttentionMetadata, FlashAttentionOptions
from attnmeta.backends.flashinfer import FLASHINFER, FlashInferMetadata, FlashInferOptions
from attnmeta.compose import PARALLEL_MIN_ROWS, ComposeStats, Group, StepBuilder, table_columns
from attnmeta.metadata import CommonAttentionMetadata
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager

__all__ = ["PARALLEL_MIN_ROWS", "FusedStep", "FusedStepBuilder", "table_columns"]


class FusedStep(NamedTuple):
    """The metadata of one step built by :meth:`FusedStepBuilder.build` (valid as a
    :class:`~attnmeta.compose.ComposedStep`'s)."""

    common: CommonAttentionMetadata
    """The common metadata (``stage_common``'s fields, with FlashInfer's page table staged alongside)."""
    flash_attn: FlashAttentionMetadata | None
    """FlashAttention varlen metadata, or None when the builder was made with ``flash_attn=None``."""
    flashinfer: FlashInferMetadata | None
    """FlashInfer paged-KV metadata, or None when the builder was made with ``flashinfer=None``."""


class FusedStepBuilder:
    """Builds a step's common + FlashAttention + FlashInfer metadata in one call and one copy.

    A thin wrapper of :class:`attnmeta.compose.StepBuilder` with one group of these two builders,
    for ready-made specs: it takes no inputs or engine arrays and has no ``build_counts`` (an engine
    that needs those uses ``StepBuilder`` itself).

    Parameters
    ----------
    stager : Stager
        Owns the pinned ring; every :meth:`build` is one step of it.
    flash_attn : FlashAttentionOptions, True or None, default True
        Options of the FlashAttention metadata (True: the defaults); None builds none.
    flashinfer : FlashInferOptions, True or None, default True
        Options of the FlashInfer metadata (True: the defaults); None builds none.
    causal : bool, default True
        ``CommonAttentionMetadata.causal``.
    prefix : str, default "common"
        Namespace of the common metadata's staged fields.
    table_column_step : int, default 8
        :attr:`attnmeta.compose.Group.table_column_step`.
    threads : int, default 1
        As for :class:`~attnmeta.compose.StepBuilder`.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> builder = FusedStepBuilder(Stager("cpu"))
    >>> spec = BatchSpec(num_computed_tokens=[5, 17], num_scheduled_tokens=[1, 1],
    ...                  block_table=[[3, 4, 0, 0, 0], [7, 8, 9, 1, 2]], block_size=4)
    >>> for _ in range(4):  # the 4th step replays the layout the 1st recorded on ring slot 0
    ...     common, fa, fi = builder.build(spec)
    >>> fi.paged_kv_indices_cpu.tolist(), fa.max_seq_len, common.slot_mapping_cpu.tolist()
    ([3, 4, 7, 8, 9, 1, 2], 18, [17, 9])
    >>> builder.stats
    ComposeStats(steps=4, replayed=1)
    """

    def __init__(
        self,
        stager: Stager,
        *,
        flash_attn: FlashAttentionOptions | bool | None = True,
        flashinfer: FlashInferOptions | bool | None = True,
        causal: bool = True,
        prefix: str = "common",
        table_column_step: int = 8,
        threads: int = 1,
    ) -> None:
        fa = FlashAttentionOptions() if flash_attn is True else flash_attn or None
        fi = FlashInferOptions() if flashinfer is True else flashinfer or None
        builders: dict[str, Any] = {}
        if fa is not None:
            builders["flash_attn"] = (FLASH_ATTN, fa)
        if fi is not None:
            builders["flashinfer"] = (FLASHINFER, fi)
        self._composer = StepBuilder(stager, Group(builders, prefix, causal, table_column_step), threads=threads)

    @property
    def stager(self) -> Stager:
        """The :class:`Stager` every step goes through."""
        return self._composer.stager

    @property
    def stats(self) -> ComposeStats:
        """Steps built and replayed."""
        return self._composer.stats

    def build(self, spec: BatchSpec) -> FusedStep:
        """One step: stage ``spec``'s metadata, commit it (one copy), return the objects.

        Parameters
        ----------
        spec : BatchSpec
            The step (reordered: decodes first, as FlashInfer requires).

        Returns
        -------
        FusedStep
            ``(common, flash_attn, flashinfer)``; a backend built with None is None.

        Raises
        ------
        attnmeta.UnsupportedBatchError, ValueError, attnmeta.staging.CapacityError
            As :meth:`attnmeta.compose.StepBuilder.build`.
        """
        out = self._composer.build(spec)
        m = out.metadata
        return FusedStep(out.common, m.get("flash_attn"), m.get("flashinfer"))

    def __repr__(self) -> str:
        return f"FusedStepBuilder({self._composer!r})"
