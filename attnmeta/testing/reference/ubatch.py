"""Device-side reference of micro-batching (DBO): vLLM 0.33's way, syncs and all.

:func:`ref_ubatch_slices` finds each micro-batch's rows by scanning the query offsets (the obvious
loop, an oracle for :func:`attnmeta.ubatch.ubatch_slices`' ``searchsorted``).
:func:`ref_split_attn_metadata` is vLLM's ``split_attn_metadata``: the parent's device tensors
sliced per micro-batch, the query offsets rebased with device subtractions, a split request's
``seq_lens`` entry cloned and reduced on the device. :func:`ref_ubatch_commons` builds the parent
the reference way from a :class:`~attnmeta.spec.BatchSpec` and splits it: the oracle of
:func:`attnmeta.ubatch.stage_ubatches`.

Shape legend
------------
- ``num_reqs`` / ``num_reqs_padded``: the parent's real request rows / rows with padding.
- ``num_tokens_padded``: the parent's tokens with padding.
- ``max_blocks``: block-table columns.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from attnmeta.spec import BatchSpec
from attnmeta.testing.reference.layout import ref_common_fields

__all__ = ["RefUBatchCommon", "ref_split_attn_metadata", "ref_ubatch_commons", "ref_ubatch_slices"]


class RefUBatchCommon(NamedTuple):
    """The fields vLLM's ``_make_metadata_with_slice`` sets on one micro-batch's metadata (every
    other field of its ``CommonAttentionMetadata`` takes its default)."""

    query_start_loc: Tensor
    """(num_reqs' + 1,) int32, device: the parent's rows rebased, a split request's part only."""
    query_start_loc_cpu: Tensor
    """(num_reqs' + 1,) int32, host twin."""
    seq_lens: Tensor
    """(num_reqs',) int32, device: a view of the parent's, or a clone when the last row is split."""
    seq_lens_cpu_upper_bound: Tensor
    """(num_reqs',) int32, host: the parent's upper bounds, the last reduced when split."""
    block_table_tensor: Tensor
    """(num_reqs', max_blocks) int32, device: the parent's rows."""
    slot_mapping: Tensor
    """(num_actual_tokens',) int64, device: ``parent[token_slice]``."""
    positions: Tensor
    """(num_actual_tokens',) int64, device: ``parent[token_slice]``."""
    num_reqs: int
    """Rows of the request slice."""
    num_actual_tokens: int
    """Tokens of the token slice."""
    max_query_len: int
    """``max(diff(query_start_loc_cpu))``, the parent's when 0."""
    max_seq_len: int
    """``max(max(seq_lens_cpu_upper_bound), parent max_seq_len)``: the parent's."""


def ref_ubatch_slices(
    num_scheduled_tokens: npt.ArrayLike, num_tokens_padded: int, num_reqs_padded: int, num_ubatches: int,
    split_points: Sequence[int] | None = None,
) -> tuple[list[tuple[slice, slice]], list[tuple[slice, slice]]]:
    """vLLM's micro-batch plan by scanning rows: ``(slices, padded_slices)`` as
    ``(request_slice, token_slice)`` pairs.

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int, host
        Tokens per real request.
    num_tokens_padded, num_reqs_padded : int
        The parent's padded counts.
    num_ubatches : int
        Micro-batches.
    split_points : sequence of int, optional
        The ``num_ubatches - 1`` split points; default ``[(num_tokens_padded // n) * i]``.

    Returns
    -------
    tuple of two lists of (slice, slice)
        Unpadded and padded (the last widened to the padded counts). No validation.

    Examples
    --------
    >>> ref_ubatch_slices([4, 4, 4], 12, 3, 3)[0]
    [(slice(0, 1, None), slice(0, 4, None)), (slice(1, 2, None), slice(4, 8, None)), (slice(2, 3, None), slice(8, 12, None))]
    """
    q = [int(x) for x in np.asarray(num_scheduled_tokens).tolist()]
    n = num_ubatches
    points = list(split_points) if split_points is not None else [(num_tokens_padded // n) * i for i in range(1, n)]
    starts_of_rows = [sum(q[:r]) for r in range(len(q) + 1)]
    bounds = [0, *points, starts_of_rows[-1]]
    slices = []
    for start, end in itertools.pairwise(bounds):
        r0 = max(r for r in range(len(starts_of_rows)) if starts_of_rows[r] <= start)  # row holding `start`
        r_stop = min(r for r in range(len(starts_of_rows)) if starts_of_rows[r] >= end)  # first row at/after `end`
        slices.append((slice(r0, r_stop), slice(start, end)))
    last = slices[-1]
    padded = [*slices[:-1], (slice(last[0].start, num_reqs_padded), slice(last[1].start, num_tokens_padded))]
    return slices, padded


def ref_split_attn_metadata(
    slices: Sequence[tuple[slice, slice]],
    query_start_loc: Tensor,
    query_start_loc_cpu: Tensor,
    seq_lens: Tensor,
    seq_lens_cpu_upper_bound: Tensor,
    block_table: Tensor,
    slot_mapping: Tensor,
    positions: Tensor,
    max_query_len: int,
    max_seq_len: int,
) -> list[RefUBatchCommon]:
    """vLLM's ``split_attn_metadata``: one micro-batch metadata per slice, by device slicing.

    Parameters
    ----------
    slices : sequence of (slice, slice)
        ``(request_slice, token_slice)`` per micro-batch.
    query_start_loc : (num_reqs_padded + 1,) int32, device
        The parent's (padding repeats the total).
    query_start_loc_cpu : (num_reqs_padded + 1,) int32, host (a CPU tensor)
        Its host twin.
    seq_lens : (num_reqs_padded,) int32, device
        The parent's.
    seq_lens_cpu_upper_bound : (num_reqs_padded,) int32, host (a CPU tensor)
        The parent's upper bounds.
    block_table : (num_reqs_padded, max_blocks) int32, device
        The parent's.
    slot_mapping, positions : (num_tokens_padded,) int64, device
        The parent's.
    max_query_len, max_seq_len : int
        The parent's scalars.

    Returns
    -------
    list of RefUBatchCommon
        One per slice, on the parent's device.
    """
    L = query_start_loc_cpu
    out = []
    for rs, ts in slices:
        r0, r1 = rs.start, rs.stop - 1
        t0, t1 = ts.start, ts.stop - 1
        assert L[r0] <= t0 < L[r0 + 1], "first token not in first request"
        splits_first = t0 > int(L[r0])
        splits_last = t1 < int(L[r1 + 1]) - 1
        qsl_cpu = L[r0 : r1 + 2] - L[r0]
        qsl = query_start_loc[r0 : r1 + 2] - query_start_loc[r0]
        if splits_first:
            skip = t0 - int(L[r0])
            qsl_cpu[1:] -= skip
            qsl[1:] -= torch.tensor(skip, dtype=qsl.dtype)  # a CPU 0-d scalar: no sync
        sl = seq_lens[r0 : r1 + 1]
        ub = seq_lens_cpu_upper_bound[r0 : r1 + 1]
        if splits_last:
            skip = int(L[r1 + 1]) - ts.stop
            qsl_cpu[-1] -= skip
            qsl[-1] -= skip
            sl = sl.clone()
            sl[-1] -= skip
            ub = ub.clone()
            ub[-1] -= skip
        mq = int(torch.diff(qsl_cpu).max().item()) if qsl_cpu.numel() > 1 else 0
        out.append(RefUBatchCommon(
            query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=sl, seq_lens_cpu_upper_bound=ub,
            block_table_tensor=block_table[r0 : r1 + 1], slot_mapping=slot_mapping[ts], positions=positions[ts],
            num_reqs=r1 - r0 + 1, num_actual_tokens=ts.stop - ts.start,
            max_query_len=mq if mq else max_query_len,
            max_seq_len=max(int(ub.max().item()) if ub.numel() else 0, max_seq_len),
        ))
    return out


def ref_ubatch_commons(
    spec: BatchSpec, slices: Sequence[tuple[slice, slice]], device: torch.device | str, block_table_columns: int,
) -> list[RefUBatchCommon]:
    """The parent's common metadata of ``spec`` built the reference way on ``device``, then split as
    vLLM does (:func:`ref_split_attn_metadata`).

    Parameters
    ----------
    spec : BatchSpec
        The parent step (no context parallelism).
    slices : sequence of (slice, slice)
        ``(request_slice, token_slice)`` per micro-batch.
    device : torch.device or str
        Where the parent's tensors live.
    block_table_columns : int
        The parent block table's width (the spec's table, truncated or zero-extended; padding rows 0).

    Returns
    -------
    list of RefUBatchCommon
        One per slice.
    """
    dev = torch.device(device)
    f = ref_common_fields(spec, dev)
    B, Bp, W = spec.num_reqs, spec.padded_num_reqs, block_table_columns
    bt = np.zeros((Bp, W), np.int32)
    w = min(W, spec.block_table.shape[1])
    bt[:B, :w] = spec.block_table[:B, :w]
    exact = spec.num_computed_tokens.astype(np.int32) + spec.num_scheduled_tokens
    ub = np.zeros(Bp, np.int32)
    ub[:B] = exact if spec.seq_lens_upper_bound is None else spec.seq_lens_upper_bound
    qsl_cpu = f["query_start_loc"].cpu()
    return ref_split_attn_metadata(
        [(rs, ts) for rs, ts in slices], f["query_start_loc"], qsl_cpu, f["seq_lens"], torch.tensor(ub),
        torch.tensor(bt).to(dev), f["slot_mapping"], f["positions"],
        int(torch.diff(qsl_cpu).max().item()) if B else 0, int(ub[:B].max()) if B else 0,
    )
