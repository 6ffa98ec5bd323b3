"""The common metadata in kernel blocks: :func:`stage_kernel_block_table`.

When an attention backend's kernel supports only block sizes smaller than the KV manager's (vLLM
0.33.0, "kernel block size", :mod:`attnmeta.host.kernel_blocks`), every builder of that backend must
read the block table in kernel units. :func:`stage_kernel_block_table` takes a staged common metadata
(manager units, from :func:`attnmeta.stage_common`), expands its block table on the host into the same
step (one compiled pass; it moves in the step's one copy) and returns a :class:`~attnmeta.StagedCommon`
for that backend's builders: ``block_table_tensor`` / ``block_table_cpu`` in kernel blocks,
``block_size`` the kernel block size, ``num_pages`` counted in kernel pages, and everything else (the
slot mapping in manager units included) the common metadata's own.

Why a function of its own rather than an option of :func:`~attnmeta.stage_common`: the common pass
checks the block ids, computes the slot mapping and builds the optional page table from the manager
table it copies; vLLM keeps that one table per KV-cache group and expands it per *backend* (each
attention group re-runs the choice of kernel block size), so one manager-unit common metadata can feed
several expansions of different sizes in one step, and the common pass's hot path stays as it is.

Shape legend
------------
- ``num_reqs``: request rows including CUDA-graph padding rows.
- ``max_blocks``: manager block-table columns staged by the common metadata.
- ``R``: ``block_size // kernel_block_size``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attnmeta.host.kernel_blocks import expand_block_table
from attnmeta.metadata import CommonAttentionMetadata, StagedCommon
from attnmeta.staging import Step

__all__ = ["stage_kernel_block_table"]


def stage_kernel_block_table(
    common: StagedCommon,
    step: Step,
    kernel_block_size: int,
    *,
    kernel_block_stride: int | None = None,
    prefix: str = "kernel_blocks",
) -> StagedCommon:
    """Stage ``common``'s block table in kernel blocks and return the common metadata a backend with
    that kernel block size reads.

    The field ``<prefix>.block_table_tensor``, ``(num_reqs, max_blocks * R)`` int32, holds
    ``block_table[r, c] * S + j`` at column ``c * R + j`` (``S = kernel_block_stride``, default ``R``):
    every manager entry expands, null and padding entries (0) to ``0 .. R - 1``, as vLLM's
    ``map_to_kernel_block_table`` makes them. Graph mode: capacity ``max_num_reqs`` rows of
    ``max_blocks_per_req * R`` columns at a fixed address; rows past the step's padded rows hold the
    sentinel 0 (a kernel of the step's padded batch never reads them).

    The returned metadata differs from ``common``'s only in ``block_table_tensor`` /
    ``block_table_cpu`` (kernel ids), ``block_size`` (``kernel_block_size``) and, on the host part,
    ``num_pages`` (``sum(cdiv(seq_lens_cpu, kernel_block_size))``). The slot mapping stays in manager
    units; for ``S == R`` it is also the flat slot index in kernel units (under context parallelism
    when the interleave divides ``kernel_block_size``). It carries no page table (a FlashInfer builder
    staged on it builds its own over the kernel table); its ``prefix`` is None (a derived common metadata).

    Parameters
    ----------
    common : StagedCommon
        The common metadata of ``step`` in manager units (:func:`attnmeta.stage_common`).
    step : Step
        The open step ``common`` was staged into.
    kernel_block_size : int
        Tokens per kernel block; divides ``common.host.block_size`` (e.g. from
        :func:`attnmeta.host.kernel_blocks.kernel_block_size`). Equal to it: ``common`` is returned.
    kernel_block_stride : int, optional
        ``S``, kernel blocks between consecutive manager blocks of one layer (``>= R``; packed caches).
    prefix : str, default "kernel_blocks"
        Namespace of the staged field: one per expansion staged in a step.

    Returns
    -------
    StagedCommon
        ``.host`` now, ``.result()`` after the commit.

    Raises
    ------
    TypeError
        ``common`` is not a StagedCommon of ``step``.
    ValueError
        ``kernel_block_size`` does not divide the block size, a bad stride, or kernel ids past int32.
    attnmeta.staging.CapacityError
        Graph mode: more rows than the profile's ``max_num_reqs``.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager, stage_common
    >>> spec = BatchSpec(num_computed_tokens=[130, 60], num_scheduled_tokens=[5, 3],
    ...                  block_table=[[7, 3, 9], [5, 2, 0]], block_size=64, num_reqs_padded=3)
    >>> with Stager("cpu").step() as step:
    ...     common = stage_common(spec, step)
    ...     k16 = stage_kernel_block_table(common, step, 16)
    >>> cm = k16.result()
    >>> cm.block_size, cm.block_table_cpu.shape, cm.block_table_cpu[1].tolist()  # (host twins: no device read)
    (16, (3, 12), [20, 21, 22, 23, 8, 9, 10, 11, 0, 1, 2, 3])
    >>> cm.block_table_cpu[2, :4].tolist(), cm.slot_mapping_cpu.tolist()  # (host twins)
    ([0, 1, 2, 3], [578, 579, 580, 581, 582, 380, 381, 382])
    """
    if not isinstance(common, StagedCommon) or common.step is not step:
        raise TypeError(f"common: expected the StagedCommon of this step (stage_common(spec, step)), got "
                        f"{type(common).__name__} {common!r:.80}")
    h = common.host
    bs = h.block_size
    k = kernel_block_size
    if type(k) is not int or k <= 0 or bs % k:
        raise ValueError(f"kernel_block_size: must be a positive int dividing the block size {bs}, got {k!r}")
    if k == bs and kernel_block_stride is None:
        return common
    R = bs // k
    table = h.block_table_cpu
    rows, cols = table.shape
    prof = step.profile
    name = prefix + ".block_table_tensor"
    out = step.alloc(name, (rows, cols * R), np.int32, capacity=prof.max_num_reqs if prof is not None else None,
                     fill=0)
    expand_block_table(table, R, kernel_block_stride=kernel_block_stride, out=out)
    ro = out.view()
    ro.flags.writeable = False
    sl = h.seq_lens_cpu[: h.num_real_reqs].astype(np.int64)
    pages = int(((sl + (k - 1)) // k).sum())
    host = dataclasses.replace(h, block_table_cpu=ro, block_size=k, num_pages=pages)

    def make() -> CommonAttentionMetadata:
        return common.result().replace(block_table_tensor=step.device(name), block_table_cpu=ro, block_size=k)

    return StagedCommon(step, host, make)
