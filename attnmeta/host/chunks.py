"""Mamba2 / SSD chunk metadata, derived on the host.

Four chunk formats, all from host ``query_start_loc`` (and for the vLLM builder layout, the number of
tokens each prefill already has in its state):

- :func:`chunk_metadata`: the **chunk-aligned** layout of the vLLM V1 Mamba2 builder
  (docs/semantics-mamba.md, "The chunk-aligned layout"): logical chunks never cross a sequence
  boundary nor an *absolute* multiple of ``chunk_size`` of the request, plus optional
  prefill-checkpoint segments. Bit-exact with vLLM 0.33.0, quirks included (see the function's
  Notes). :func:`num_chunks` gives its exact chunk count and :func:`max_num_chunks` a closed-form
  bound for sizing graph-mode buffers.
- :func:`logical_chunks`: the vLLM-v0 / SGLang / TensorRT-LLM ``chunk_indices`` / ``chunk_offsets``
  pair (docs/semantics-mamba.md, "Logical chunks"): logical chunks split at sequence boundaries and
  at multiples of ``chunk_size`` of the *packed* token index.
- :func:`token_seq_idx`: the per-token sequence index the upstream ``mamba_ssm`` kernels take.
- :func:`varlen_chunk_metadata`: vLLM's ``compute_varlen_chunk_metadata`` (used by its kernel tests),
  which splits at multiples of ``chunk_size`` of the packed token index. It is **not** the builder's
  layout; never use it as the oracle for :func:`chunk_metadata`.

Every function is numpy in, numpy out, compiled with numba, and validates its input with a
``ValueError`` naming the field, the row and the rule. Functions that may write straight into a
staging buffer take ``out=``. The builders of :mod:`attnmeta.backends.mamba` call the kernels
:func:`chunk_layout_nb` (inside :func:`attnmeta.host.mamba.mamba_fill_nb`), :func:`logical_chunks_nb`
and :func:`token_seq_idx_nb` on the staged views directly.

Why one module
--------------
It holds the four formats of the same prefill tokens, each a compiled kernel behind a validating
wrapper, and they share their input checks and error codes; split apart, each piece would import the
others' private helpers.

Shape legend
------------
- ``num_prefills`` (``P``): prefill rows; ``query_start_loc_p`` has ``P + 1`` entries.
- ``num_reqs`` (``B``): sequences (rows) of a generic ``query_start_loc`` of ``B + 1`` entries.
- ``num_tokens`` (``T``): ``query_start_loc[-1]``, the packed token count.
- ``num_tokens_padded``: tokens including trailing padding tokens (``>= T``).
- ``num_chunks``: logical chunks of the layout (``ChunkMetadata.num_chunks``).
- ``capacity``: length of a caller-provided ``out=`` buffer (``>=`` what the batch needs).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnmeta._checks import INT32_MAX, as_host_array, check_out, reject_tensor
from attnmeta._intdiv import pow2_shift
from attnmeta._numba import njit

__all__ = [
    "ChunkBuffers",
    "ChunkMetadata",
    "allocate_chunk_buffers",
    "checkpoint_chunk_index_tensor_values",
    "chunk_metadata",
    "logical_chunks",
    "max_num_chunks",
    "num_chunks",
    "token_seq_idx",
    "varlen_chunk_metadata",
]

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_NO_OFFSETS = np.zeros(0, dtype=np.int32)
_NO_CKPT = np.zeros(0, dtype=np.int64)
_NO_CHECKPOINTS = np.full(4096, -1, dtype=np.int64)
"""``ChunkMetadata.checkpoint_chunk_idx`` without checkpoint offsets (all -1), read-only: results of
up to 4096 rows are views of it instead of a fresh array each call."""
_NO_CHECKPOINTS.flags.writeable = False
_NO_CHECKPOINTS_ROWS = _NO_CHECKPOINTS.shape[0]
_new_chunk_metadata = tuple.__new__  # ChunkMetadata from a tuple without NamedTuple.__new__'s argument parsing

# Error codes returned (encoded as ``-1 - (row * _NCODES + code)``) by the kernels; the wrappers
# turn them into messages. Kernels never format strings.
_NCODES = 8
_E_QSL_DECREASING = 1
_E_COMPUTED_NEGATIVE = 2
_E_OFFSET_NEGATIVE = 3
_E_OFFSET_TOO_LARGE = 4
_E_QSL_BEYOND_TOTAL = 5
_E_QSL_START = 6


class ChunkMetadata(NamedTuple):
    """Chunk-aligned Mamba2 prefill layout (docs/semantics-mamba.md, "The chunk-aligned layout");
    all arrays host numpy.

    When built into caller buffers (``chunk_metadata(..., out=...)``) the arrays are views of the
    used prefix of those buffers.
    """

    cu_chunk_seqlens: np.ndarray
    """(num_chunks + 1,) int32, host. Token offset of each chunk in the packed prefill tokens;
    ``[0] == 0`` and ``[-1] == query_start_loc_p[-1]``. Zero-length chunks are possible (an unaligned
    zero-token row)."""
    seq_idx: np.ndarray
    """(num_chunks,) int32, host. Prefill row (0-based) each chunk belongs to; non-decreasing."""
    last_chunk_indices: np.ndarray
    """(num_prefills,) int32, host. Index of each row's last chunk. A row that emitted no chunk (an
    aligned zero-token row) repeats the previous row's value, or -1 for the first row."""
    checkpoint_chunk_idx: np.ndarray
    """(num_prefills,) int64, host. Index of the chunk that ends each row's checkpoint segment, or -1
    where the row has no checkpoint. Without ``checkpoint_offsets`` (and without ``out=``) it is all -1
    and read-only (a view of a shared constant). This is vLLM's host list; the builder uploads
    :func:`checkpoint_chunk_index_tensor_values` of it (or ``None``)."""
    num_chunks: int
    """Number of chunks, ``len(seq_idx)``: a host scalar."""


class ChunkBuffers(NamedTuple):
    """Preallocated ``out=`` buffers for :func:`chunk_metadata` (e.g. views into a staging arena).

    Size them with :func:`allocate_chunk_buffers` or :func:`max_num_chunks`.
    """

    cu_chunk_seqlens: np.ndarray
    """(capacity + 1,) int32, host: at least ``num_chunks + 1`` entries."""
    seq_idx: np.ndarray
    """(capacity,) int32, host: at least ``num_chunks`` entries."""
    last_chunk_indices: np.ndarray
    """(max_prefills,) int32, host: at least ``num_prefills`` entries."""
    checkpoint_chunk_idx: np.ndarray
    """(max_prefills,) int64, host: at least ``num_prefills`` entries."""


# --------------------------------------------------------------------------------------------------
# input helpers


def _i32_vector(value: Any, name: str) -> np.ndarray:
    """Fast path for a C-contiguous 1-D int32 numpy array; everything else via ``as_host_array``."""
    if type(value) is np.ndarray and value.dtype is _I32 and value.ndim == 1 and value.flags.c_contiguous:
        return value
    return as_host_array(value, name, dtype=np.int32)


def _check_chunk_size(chunk_size: Any) -> int:
    if type(chunk_size) is int and chunk_size > 0:
        return chunk_size
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def _check_qsl_start(qsl: np.ndarray, name: str) -> None:
    if qsl.shape[0] == 0:
        raise ValueError(f"{name}: must have at least one entry ([0] for an empty batch), got shape (0,)")
    if qsl.item(0) != 0:
        raise ValueError(f"{name}[0]={int(qsl[0])}: must be 0 (exclusive prefix sum of query lengths)")


def _qsl_error(code: int, row: int, qsl: np.ndarray, name: str) -> ValueError:
    if code == _E_QSL_DECREASING:
        return ValueError(
            f"{name}[{row + 1}]={int(qsl[row + 1])} < {name}[{row}]={int(qsl[row])} (row {row}): "
            f"{name} must be non-decreasing (query lengths >= 0)"
        )
    return ValueError(
        f"{name}[{row + 1}]={int(qsl[row + 1])} > {name}[-1]={int(qsl[-1])} (row {row}): "
        f"{name} must be non-decreasing"
    )


def _decode_error(status: int) -> tuple[int, int]:
    enc = -1 - status
    return enc // _NCODES, enc % _NCODES


# --------------------------------------------------------------------------------------------------
# chunk-aligned layout (vLLM V1 builder)


@njit
def _segment_checked_nb(
    chunk_size: int, start: int, length: int, row: int, pos: int, count: int, cu: np.ndarray, seq_idx: np.ndarray,
    cap: int,
) -> tuple[int, int]:
    """Chunk one segment ``[start, start + length)`` writing only chunks below ``cap`` (the rare path
    of :func:`chunk_layout_nb` near the end of its buffers). Returns ``(pos, count)``."""
    rem = start % chunk_size
    end = pos + length
    if rem != 0:  # a realigning chunk of min(C - start % C, length) tokens
        if count < cap:
            cu[count] = pos
            seq_idx[count] = row
        count += 1
        pos += min(chunk_size - rem, length)
    while pos < end:  # then chunks of C tokens, the last one partial
        if count < cap:
            cu[count] = pos
            seq_idx[count] = row
        count += 1
        pos += chunk_size
    return end, count


@njit
def _segment_nb(
    chunk_size: int, shift: int, start: int, seg_end: int, row: int, pos: int, count: int, cu: np.ndarray,
    seq_idx: np.ndarray,
) -> tuple[int, int]:
    """Chunk one segment that starts at absolute position ``start`` and ends at packed position
    ``seg_end`` (every chunk fits the buffers): a realigning chunk when ``start`` is off a multiple
    of ``C``, then chunks of ``C`` tokens, the last one partial. Returns ``(seg_end, count)``."""
    rem = start & (chunk_size - 1) if shift >= 0 else start % chunk_size
    if rem != 0:
        cu[count] = pos
        seq_idx[count] = row
        count += 1
        pos += chunk_size - rem
    while pos < seg_end:
        cu[count] = pos
        seq_idx[count] = row
        count += 1
        pos += chunk_size
    return seg_end, count


@njit
def chunk_layout_nb(
    chunk_size: int,
    num_computed: np.ndarray,
    qsl: np.ndarray,
    offsets: np.ndarray,
    cu: np.ndarray,
    seq_idx: np.ndarray,
    last: np.ndarray,
    ckpt_idx: np.ndarray,
) -> int:
    """The 6.5 layout in one pass: validate, count and write. Returns num_chunks or an error code.

    ``offsets`` (empty: no checkpoints) are the checkpoint offsets; ``ckpt_idx`` (empty: not wanted)
    receives each row's checkpoint chunk, -1 without one. Chunks beyond ``cap = min(len(cu) - 1,
    len(seq_idx))`` are counted but not written, so a count above ``cap`` tells the caller its
    buffers were too small.

    A row emits at most ``n // C + 4`` chunks (``n // C + 2`` without a checkpoint), so while that
    many fit below ``cap`` (always, with buffers sized by :func:`max_num_chunks`) the row is written
    without per-chunk checks (:func:`_segment_nb`, which LLVM inlines); without checkpoint offsets a
    loop of its own does it (the common case: ~15% less time per row than the general loop's
    checkpoint tests). Each segment's chunks are ``cu`` values ``pos, pos + C, ...`` up to the
    segment's end, the first one (when the segment starts off a multiple of ``C``)
    ``min(C - start % C, length)`` tokens long.
    """
    num_rows = num_computed.shape[0]
    if qsl[0] != 0:
        return -1 - _E_QSL_START
    has_offsets = offsets.shape[0] > 0
    write_ckpt = ckpt_idx.shape[0] > 0
    cap = min(cu.shape[0] - 1, seq_idx.shape[0])
    shift = pow2_shift(chunk_size)  # masks and shifts replace divisions when >= 0
    pos = 0
    count = 0
    prev_end = 0
    first_row = 0
    if not has_offsets:
        # No checkpoint segments: the loop of the common case alone, up to the first row whose chunks
        # might not fit the buffers (the general loop below takes over from there).
        while first_row < num_rows:
            i = first_row
            c = num_computed[i]
            end = qsl[i + 1]
            n = end - prev_end
            if n < 0:
                return -1 - (i * _NCODES + _E_QSL_DECREASING)
            if c < 0:
                return -1 - (i * _NCODES + _E_COMPUTED_NEGATIVE)
            if count + (n >> shift if shift >= 0 else n // chunk_size) + 2 > cap:
                break
            prev_end = end
            pos, count = _segment_nb(chunk_size, shift, c, end, i, pos, count, cu, seq_idx)
            last[i] = count - 1
            if write_ckpt:
                ckpt_idx[i] = -1
            first_row += 1
    for i in range(first_row, num_rows):
        c = num_computed[i]
        end = qsl[i + 1]
        n = end - prev_end
        prev_end = end
        if n < 0:
            return -1 - (i * _NCODES + _E_QSL_DECREASING)
        if c < 0:
            return -1 - (i * _NCODES + _E_COMPUTED_NEGATIVE)
        k = 0
        if has_offsets:
            k = offsets[i]
            if k < 0:
                return -1 - (i * _NCODES + _E_OFFSET_NEGATIVE)
            if k > n:
                return -1 - (i * _NCODES + _E_OFFSET_TOO_LARGE)
        most = (n >> shift if shift >= 0 else n // chunk_size) + 4
        if count + most > cap:  # near the end of the buffers: write what fits, count the rest
            if k > 0:
                pos, count = _segment_checked_nb(chunk_size, c, k, i, pos, count, cu, seq_idx, cap)
                if write_ckpt:
                    ckpt_idx[i] = count - 1
            elif write_ckpt:
                ckpt_idx[i] = -1
            pos, count = _segment_checked_nb(chunk_size, c + k, n - k, i, pos, count, cu, seq_idx, cap)
            last[i] = count - 1
            continue
        if k > 0:  # the checkpoint segment [c, c + k)
            pos, count = _segment_nb(chunk_size, shift, c, pos + k, i, pos, count, cu, seq_idx)
            if write_ckpt:
                ckpt_idx[i] = count - 1
            c += k
        elif write_ckpt:
            ckpt_idx[i] = -1
        # the query segment [c + k, c + n), up to the row's end qsl[i + 1]
        pos, count = _segment_nb(chunk_size, shift, c, end, i, pos, count, cu, seq_idx)
        last[i] = count - 1
    if count <= cap:
        cu[count] = pos
    return count


@njit
def _chunk_metadata_nb(chunk_size: int, num_computed: np.ndarray, qsl: np.ndarray, buf: np.ndarray) -> int:
    """:func:`chunk_layout_nb` without checkpoints into :func:`chunk_metadata`'s own buffer ``[cu
    (cap + 1) | seq_idx (cap) | last (P)]`` (few arrays to pass: the per-call dispatch is a good part
    of a small batch's cost)."""
    num_rows = num_computed.shape[0]
    cap = (buf.shape[0] - 1 - num_rows) // 2
    none = num_computed[:0]  # no checkpoint offsets, no checkpoint list wanted
    return chunk_layout_nb(chunk_size, num_computed, qsl, none, buf[: cap + 1], buf[cap + 1 : 2 * cap + 1],
                            buf[2 * cap + 1 :], none)


@njit
def _chunk_metadata_ckpt_nb(
    chunk_size: int, num_computed: np.ndarray, qsl: np.ndarray, offsets: np.ndarray, buf: np.ndarray,
    ckpt_idx: np.ndarray,
) -> int:
    """:func:`_chunk_metadata_nb` with checkpoint offsets and the checkpoint list ``ckpt_idx``."""
    num_rows = num_computed.shape[0]
    cap = (buf.shape[0] - 1 - num_rows) // 2
    return chunk_layout_nb(chunk_size, num_computed, qsl, offsets, buf[: cap + 1], buf[cap + 1 : 2 * cap + 1],
                            buf[2 * cap + 1 :], ckpt_idx)


@njit
def _chunk_count_nb(
    chunk_size: int, num_computed: np.ndarray, qsl: np.ndarray, offsets: np.ndarray, has_offsets: bool
) -> int:
    """Validate and count the 6.5 layout in O(P). Returns num_chunks or an error code."""
    if qsl[0] != 0:
        return -1 - _E_QSL_START
    shift = pow2_shift(chunk_size)  # masks and shifts replace divisions when >= 0
    mask = chunk_size - 1
    count = 0
    for i in range(num_computed.shape[0]):
        c = int(num_computed[i])
        n = int(qsl[i + 1]) - int(qsl[i])
        if n < 0:
            return -1 - (i * _NCODES + _E_QSL_DECREASING)
        if c < 0:
            return -1 - (i * _NCODES + _E_COMPUTED_NEGATIVE)
        k = 0
        if has_offsets:
            k = int(offsets[i])
            if k < 0:
                return -1 - (i * _NCODES + _E_OFFSET_NEGATIVE)
            if k > n:
                return -1 - (i * _NCODES + _E_OFFSET_TOO_LARGE)
        for seg in range(0 if k > 0 else 1, 2):
            start = c if seg == 0 else c + k
            length = k if seg == 0 else n - k
            rem = start & mask if shift >= 0 else start % chunk_size
            if rem != 0:
                first = chunk_size - rem
                if first > length:
                    first = length
                count += 1
                length -= first
            count += (length + mask) >> shift if shift >= 0 else (length + mask) // chunk_size
    return count


def _layout_inputs(
    chunk_size: Any, num_computed_p: Any, query_start_loc_p: Any, checkpoint_offsets: Any
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, bool]:
    cs = _check_chunk_size(chunk_size)
    nc = _i32_vector(num_computed_p, "num_computed_p")
    qsl = _i32_vector(query_start_loc_p, "query_start_loc_p")
    num_rows = nc.shape[0]
    if qsl.shape[0] != num_rows + 1:
        raise ValueError(
            f"query_start_loc_p: expected length num_prefills + 1 = {num_rows + 1} "
            f"(num_computed_p has {num_rows} rows), got shape {qsl.shape}"
        )
    if checkpoint_offsets is None:
        return cs, nc, qsl, _NO_OFFSETS, False
    offs = _i32_vector(checkpoint_offsets, "checkpoint_offsets")
    if offs.shape[0] != num_rows:
        raise ValueError(
            f"checkpoint_offsets: expected length num_prefills = {num_rows}, got shape {offs.shape}"
        )
    return cs, nc, qsl, offs, True


def _raise_layout_error(status: int, nc: np.ndarray, qsl: np.ndarray, offs: np.ndarray) -> None:
    row, code = _decode_error(status)
    if code == _E_QSL_START:
        raise ValueError(
            f"query_start_loc_p[0]={int(qsl[0])}: must be 0 (exclusive prefix sum of query lengths)"
        )
    if code == _E_QSL_DECREASING:
        raise _qsl_error(code, row, qsl, "query_start_loc_p")
    if code == _E_COMPUTED_NEGATIVE:
        raise ValueError(
            f"num_computed_p[{row}]={int(nc[row])} is negative (prefill row {row}); counts must be >= 0"
        )
    n = int(qsl[row + 1]) - int(qsl[row])
    if code == _E_OFFSET_NEGATIVE:
        raise ValueError(
            f"checkpoint_offsets[{row}]={int(offs[row])} is negative (prefill row {row}); "
            f"a checkpoint offset k must satisfy 0 <= k <= query length (0 means no checkpoint)"
        )
    raise ValueError(
        f"checkpoint_offsets[{row}]={int(offs[row])} > query length {n} (prefill row {row}); "
        f"a checkpoint offset k must satisfy 0 <= k <= query length (0 means no checkpoint)"
    )


def num_chunks(
    chunk_size: int,
    num_computed_p: np.ndarray,
    query_start_loc_p: np.ndarray,
    checkpoint_offsets: np.ndarray | None = None,
) -> int:
    """Exact number of chunks :func:`chunk_metadata` emits for this batch, in O(num_prefills).

    Parameters
    ----------
    chunk_size : int
        Mamba2 chunk size ``C`` (> 0).
    num_computed_p : (num_prefills,) int32, host
        Tokens each prefill row already has in its state (``c``).
    query_start_loc_p : (num_prefills + 1,) int32, host
        Exclusive prefix sum of the prefill query lengths; ``[0] == 0``.
    checkpoint_offsets : (num_prefills,) int32, host, optional
        Checkpoint offset ``k`` into each row's query (``0 <= k <= n``; 0 means none).

    Returns
    -------
    int
        ``len(chunk_metadata(...).seq_idx)``.

    Raises
    ------
    ValueError
        Same rules as :func:`chunk_metadata`.

    Examples
    --------
    >>> import numpy as np
    >>> num_chunks(8, np.array([5, 0], np.int32), np.array([0, 10, 13], np.int32))
    3
    """
    cs, nc, qsl, offs, has = _layout_inputs(chunk_size, num_computed_p, query_start_loc_p, checkpoint_offsets)
    status = int(_chunk_count_nb(cs, nc, qsl, offs, has))
    if status < 0:
        _raise_layout_error(status, nc, qsl, offs)
    return status


def max_num_chunks(
    num_tokens: int, num_prefills: int, chunk_size: int, *, with_checkpoints: bool = False
) -> int:
    """Closed-form upper bound on :func:`num_chunks` for *any* batch with these totals.

    Every segment (a row's query, or each of its two parts with a checkpoint) emits at most
    ``floor(len / C) + 2`` chunks (one realigning chunk, full chunks, one partial tail), and a row
    emits at most ``n + 1`` chunks (only an unaligned zero-token segment emits an empty chunk). So::

        bound = min(T + P, T // C + 2 * P)      # without checkpoints
        bound = min(T + P, T // C + 4 * P)      # with checkpoints

    Use it to size graph-mode / staging buffers (``cu_chunk_seqlens`` needs ``bound + 1``).

    Parameters
    ----------
    num_tokens : int
        Total prefill tokens ``T = query_start_loc_p[-1]`` (>= 0).
    num_prefills : int
        Prefill rows ``P`` (>= 0).
    chunk_size : int
        Mamba2 chunk size ``C`` (> 0).
    with_checkpoints : bool, default False
        Whether ``checkpoint_offsets`` may be passed.

    Returns
    -------
    int
        An upper bound on the number of chunks.

    Raises
    ------
    ValueError
        Negative totals or ``chunk_size <= 0``.

    Examples
    --------
    >>> max_num_chunks(13, 2, 8)
    5
    >>> max_num_chunks(0, 3, 256)
    3
    """
    cs = _check_chunk_size(chunk_size)
    if num_tokens < 0 or num_prefills < 0:
        raise ValueError(f"num_tokens={num_tokens}, num_prefills={num_prefills}: totals must be >= 0")
    t = int(num_tokens)
    p = int(num_prefills)
    per_row = 4 if with_checkpoints else 2
    return min(t + p, t // cs + per_row * p)


def allocate_chunk_buffers(capacity: int, max_prefills: int) -> ChunkBuffers:
    """Allocate :class:`ChunkBuffers` for up to ``capacity`` chunks and ``max_prefills`` rows.

    Parameters
    ----------
    capacity : int
        Maximum chunks (e.g. :func:`max_num_chunks` of the largest batch).
    max_prefills : int
        Maximum prefill rows.

    Returns
    -------
    ChunkBuffers
        Uninitialised host buffers: ``(capacity + 1,)``, ``(capacity,)`` int32,
        ``(max_prefills,)`` int32 and ``(max_prefills,)`` int64.

    Raises
    ------
    ValueError
        Negative sizes.

    Examples
    --------
    >>> [b.shape for b in allocate_chunk_buffers(5, 2)]
    [(6,), (5,), (2,), (2,)]
    """
    if capacity < 0 or max_prefills < 0:
        raise ValueError(f"capacity={capacity}, max_prefills={max_prefills}: sizes must be >= 0")
    return ChunkBuffers(
        np.empty(capacity + 1, dtype=np.int32),
        np.empty(capacity, dtype=np.int32),
        np.empty(max_prefills, dtype=np.int32),
        np.empty(max_prefills, dtype=np.int64),
    )


def _check_buffer(buf: Any, name: str, dtype: np.dtype, min_len: int) -> np.ndarray:
    if (
        type(buf) is np.ndarray
        and buf.dtype is dtype
        and buf.ndim == 1
        and buf.shape[0] >= min_len
        and buf.flags.c_contiguous
        and buf.flags.writeable
    ):
        return buf
    reject_tensor(buf, name)
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{name}: out= buffers must be numpy arrays, got {type(buf).__name__}")
    if buf.dtype != dtype:
        raise ValueError(f"{name}: out= buffer must have dtype {dtype}, got {buf.dtype}")
    if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError(f"{name}: out= buffer must be 1-D, C-contiguous and writable, got shape {buf.shape}")
    if buf.shape[0] < min_len:
        raise ValueError(f"{name}: out= buffer has {buf.shape[0]} entries, need at least {min_len}")
    return buf


def chunk_metadata(
    chunk_size: int,
    num_computed_p: np.ndarray,
    query_start_loc_p: np.ndarray,
    checkpoint_offsets: np.ndarray | None = None,
    *,
    out: ChunkBuffers | tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> ChunkMetadata:
    """Chunk-aligned Mamba2 prefill layout of vLLM's builder, host.

    Each prefill row ``i`` (``c = num_computed_p[i]``, ``n`` its query length,
    ``k = checkpoint_offsets[i]`` or 0) is split into segments: ``[c, c + k)`` when ``k > 0`` (the
    checkpoint segment), then ``[c + k, c + n)``. A segment starting at an absolute position that is
    not a multiple of ``C`` first gets one realigning chunk of ``min(C - start % C, len)`` tokens, then
    ``cdiv(rest, C)`` chunks of at most ``C`` tokens. The chunk ending a checkpoint segment is
    recorded in ``checkpoint_chunk_idx[i]``, the last chunk of the row in ``last_chunk_indices[i]``.

    One compiled pass validates, counts and writes.

    Parameters
    ----------
    chunk_size : int
        Mamba2 chunk size ``C`` (> 0).
    num_computed_p : (num_prefills,) int32, host
        Tokens each prefill row already has in its state (vLLM: ``seq_lens_cpu_upper_bound[B-P:] -
        diff(query_start_loc_p)``, exact for prefill rows). Must be >= 0.
    query_start_loc_p : (num_prefills + 1,) int32, host
        Exclusive prefix sum of the prefill query lengths (vLLM: ``qsl_cpu[-P-1:] - num_decode_tokens``);
        ``[0] == 0``, non-decreasing. Zero-token rows are allowed.
    checkpoint_offsets : (num_prefills,) int32, host, optional
        Prefill-checkpoint offset ``k`` into each row's query, ``0 <= k <= n`` (0: no checkpoint); the
        ``offsets`` of :func:`attnmeta.host.mamba.prefill_checkpoints`.
    out : ChunkBuffers or 4-tuple of arrays, optional
        ``(cu_chunk_seqlens, seq_idx, last_chunk_indices, checkpoint_chunk_idx)`` buffers of dtypes
        int32, int32, int32, int64 with at least ``num_chunks + 1``, ``num_chunks``, ``num_prefills``,
        ``num_prefills`` entries (size them with :func:`max_num_chunks`). Only the used prefix is written.

    Returns
    -------
    ChunkMetadata
        ``cu_chunk_seqlens (num_chunks + 1,) int32``, ``seq_idx (num_chunks,) int32``,
        ``last_chunk_indices (num_prefills,) int32``, ``checkpoint_chunk_idx (num_prefills,) int64``
        (host arrays; views of the used prefix of ``out`` when given, or of an internal buffer sized
        by :func:`max_num_chunks`) and ``num_chunks``.

    Raises
    ------
    ValueError
        ``chunk_size <= 0``; length mismatches; ``query_start_loc_p[0] != 0``; a decreasing
        ``query_start_loc_p``; a negative ``num_computed_p``; a checkpoint offset outside ``[0, n]``;
        an ``out`` buffer of the wrong dtype/layout or too small.
    TypeError
        A torch tensor or a non-integer array is passed.

    Notes
    -----
    Quirks reproduced bit for bit (vLLM 0.33.0):

    - an **unaligned** zero-token row (``c % C != 0``, ``n == 0``) emits one **zero-length** chunk;
    - an **aligned** zero-token row emits no chunk, so its ``last_chunk_indices`` entry repeats the
      previous row's last chunk (``-1`` for the first row);
    - with ``k == n`` the remaining empty segment behaves like a zero-token row.

    vLLM's builder uploads ``checkpoint_chunk_idx`` as ``None`` when no entry is ``>= 0`` and as
    ``max(idx, 0)`` (int64) otherwise: :func:`checkpoint_chunk_index_tensor_values` computes that.

    Examples
    --------
    >>> import numpy as np
    >>> m = chunk_metadata(8, np.array([5, 0], np.int32), np.array([0, 10, 13], np.int32))
    >>> m.cu_chunk_seqlens, m.seq_idx, m.last_chunk_indices, m.num_chunks
    (array([ 0,  3, 10, 13], dtype=int32), array([0, 0, 1], dtype=int32), array([1, 2], dtype=int32), 3)
    >>> m.checkpoint_chunk_idx
    array([-1, -1])
    >>> z = chunk_metadata(8, np.array([0, 3], np.int32), np.array([0, 0, 0], np.int32))
    >>> z.cu_chunk_seqlens, z.seq_idx, z.last_chunk_indices
    (array([0, 0], dtype=int32), array([1], dtype=int32), array([-1,  0], dtype=int32))
    >>> k = chunk_metadata(4, np.array([2], np.int32), np.array([0, 9], np.int32), np.array([2], np.int32))
    >>> k.cu_chunk_seqlens, k.last_chunk_indices, k.checkpoint_chunk_idx
    (array([0, 2, 6, 9], dtype=int32), array([2], dtype=int32), array([0]))
    """
    nc, qsl, offs = num_computed_p, query_start_loc_p, checkpoint_offsets
    if (
        out is None
        and type(nc) is np.ndarray
        and type(qsl) is np.ndarray
        and nc.dtype is _I32
        and qsl.dtype is _I32
        and type(chunk_size) is int
        and chunk_size > 0
        and nc.ndim == 1
        and qsl.ndim == 1
    ):
        # The per-step call (exact int32 host arrays, no out=): the same checks in fewer steps, the
        # results in one fresh buffer [cu | seq_idx | last] sized by max_num_chunks (at a few hundred
        # rows, allocation and per-call overhead are most of the cost).
        P = nc.shape[0]
        if qsl.shape[0] == P + 1:
            if offs is None:
                total = qsl.item(P)
                if total < 0:
                    total = 0  # a decreasing qsl: the kernel reports the row
                cap = total // chunk_size + 2 * P
                if cap > total + P:
                    cap = total + P
                buf = np.empty(2 * cap + 1 + P, _I32)
                n = _chunk_metadata_nb(chunk_size, nc, qsl, buf)
                if n >= 0:
                    return _new_chunk_metadata(ChunkMetadata, (
                        buf[: n + 1], buf[cap + 1 : cap + 1 + n], buf[2 * cap + 1 :],
                        _NO_CHECKPOINTS[:P] if P <= _NO_CHECKPOINTS_ROWS else _no_checkpoints(P), n))
                _raise_layout_error(n, nc, qsl, _NO_OFFSETS)
            elif type(offs) is np.ndarray and offs.dtype is _I32 and offs.ndim == 1 and offs.shape[0] == P:
                total = qsl.item(P)
                if total < 0:
                    total = 0
                cap = total // chunk_size + 4 * P
                if cap > total + P:
                    cap = total + P
                buf = np.empty(2 * cap + 1 + P, _I32)
                ckpt = np.empty(P, _I64)
                n = _chunk_metadata_ckpt_nb(chunk_size, nc, qsl, offs, buf, ckpt)
                if n >= 0:
                    return _new_chunk_metadata(ChunkMetadata, (
                        buf[: n + 1], buf[cap + 1 : cap + 1 + n], buf[2 * cap + 1 :], ckpt, n))
                _raise_layout_error(n, nc, qsl, offs)
    cs, nc, qsl, offs, has = _layout_inputs(chunk_size, num_computed_p, query_start_loc_p, checkpoint_offsets)
    num_rows = nc.shape[0]
    if out is None:
        return _into_own_buffer(cs, nc, qsl, offs if has else None)
    if len(out) < 4:
        raise ValueError(
            "out: expected (cu_chunk_seqlens, seq_idx, last_chunk_indices, checkpoint_chunk_idx) buffers"
        )
    cu = _check_buffer(out[0], "out.cu_chunk_seqlens", _I32, 1)
    sidx = _check_buffer(out[1], "out.seq_idx", _I32, 0)
    last = _check_buffer(out[2], "out.last_chunk_indices", _I32, num_rows)
    ckpt = _check_buffer(out[3], "out.checkpoint_chunk_idx", _I64, num_rows)
    if num_rows == 0:
        ckpt = ckpt[:0]
    status = int(chunk_layout_nb(cs, nc, qsl, offs, cu, sidx, last, ckpt))
    if status < 0:
        _raise_layout_error(status, nc, qsl, offs)
    if status + 1 > cu.shape[0] or status > sidx.shape[0]:
        raise ValueError(
            f"out: this batch needs {status} chunks ({status + 1} cu_chunk_seqlens entries) but the "
            f"buffers hold {cu.shape[0] - 1} / {sidx.shape[0]}; size them with max_num_chunks()"
        )
    return ChunkMetadata(cu[: status + 1], sidx[:status], last[:num_rows], ckpt[:num_rows], status)


def _into_own_buffer(cs: int, nc: np.ndarray, qsl: np.ndarray, offs: np.ndarray | None) -> ChunkMetadata:
    """:func:`chunk_metadata` into one fresh int32 buffer ``[cu | seq_idx | last]`` sized by
    :func:`max_num_chunks`, plus the int64 checkpoint list: a fresh one with ``offs``, else a
    read-only view of the all ``-1`` constant."""
    num_rows = nc.shape[0]
    total = max(qsl.item(num_rows), 0)  # (a decreasing qsl: the kernel reports the row)
    cap = min(total + num_rows, total // cs + (2 if offs is None else 4) * num_rows)
    buf = np.empty(2 * cap + 1 + num_rows, _I32)
    if offs is None:
        status = _chunk_metadata_nb(cs, nc, qsl, buf)
        ckpt = _NO_CHECKPOINTS[:num_rows] if num_rows <= _NO_CHECKPOINTS_ROWS else _no_checkpoints(num_rows)
    else:
        ckpt = np.empty(num_rows, _I64)
        status = _chunk_metadata_ckpt_nb(cs, nc, qsl, offs, buf, ckpt)
    if status < 0:
        _raise_layout_error(status, nc, qsl, _NO_OFFSETS if offs is None else offs)
    return _new_chunk_metadata(
        ChunkMetadata, (buf[: status + 1], buf[cap + 1 : cap + 1 + status], buf[2 * cap + 1 :], ckpt, status)
    )


def _no_checkpoints(num_rows: int) -> np.ndarray:
    """A read-only all ``-1`` int64 array of ``num_rows`` (:data:`_NO_CHECKPOINTS` is shorter)."""
    a = np.full(num_rows, -1, _I64)
    a.flags.writeable = False
    return a


def checkpoint_chunk_index_tensor_values(checkpoint_chunk_idx: np.ndarray) -> np.ndarray | None:
    """What vLLM's builder uploads for ``checkpoint_chunk_idx``, host.

    Parameters
    ----------
    checkpoint_chunk_idx : (num_prefills,) int64, host
        ``ChunkMetadata.checkpoint_chunk_idx`` (-1 where a row has no checkpoint).

    Returns
    -------
    (num_prefills,) int64 ndarray, host, or None
        ``None`` unless some entry is ``>= 0``; otherwise ``max(idx, 0)`` per row (a new array).

    Raises
    ------
    ValueError
        Not a 1-D integer array.

    Examples
    --------
    >>> import numpy as np
    >>> checkpoint_chunk_index_tensor_values(np.array([-1, 4, -1]))
    array([0, 4, 0])
    >>> checkpoint_chunk_index_tensor_values(np.array([-1, -1])) is None
    True
    """
    idx = as_host_array(checkpoint_chunk_idx, "checkpoint_chunk_idx", dtype=np.int64)
    if idx.shape[0] == 0 or int(idx.max()) < 0:
        return None
    clamped: np.ndarray = np.maximum(idx, 0)
    return clamped


# --------------------------------------------------------------------------------------------------
# logical chunks (vLLM v0 / SGLang / TRT-LLM)


@njit
def _qsl_scan_nb(qsl: np.ndarray) -> int:
    """First row whose length is negative or whose end exceeds ``qsl[-1]``, encoded; else 0."""
    total = int(qsl[qsl.shape[0] - 1])
    for i in range(qsl.shape[0] - 1):
        if qsl[i + 1] < qsl[i]:
            return -1 - (i * _NCODES + _E_QSL_DECREASING)
        if int(qsl[i + 1]) > total:
            return -1 - (i * _NCODES + _E_QSL_BEYOND_TOTAL)
    return 0


@njit
def logical_chunks_nb(qsl: np.ndarray, chunk_size: int, indices: np.ndarray, offsets: np.ndarray) -> int:
    """:func:`logical_chunks`'s compiled pass into ``indices`` / ``offsets``: returns the number of
    logical chunks (written only when it fits both buffers) or an error code."""
    status = _qsl_scan_nb(qsl)
    if status < 0:
        return status
    num_seqs = qsl.shape[0] - 1
    total = int(qsl[num_seqs])
    n = (total + chunk_size - 1) // chunk_size
    for i in range(1, num_seqs):
        if qsl[i] % chunk_size > 0:
            n += 1
    cap = min(indices.shape[0], offsets.shape[0])
    if n > cap:
        return n
    for j in range(n):
        indices[j] = j
        offsets[j] = 0
    inserted = 0
    for i in range(1, num_seqs):
        s = int(qsl[i])
        e = int(qsl[i + 1])
        s_off = s % chunk_size
        if s_off > 0:
            inserted += 1
        lo = s // chunk_size + inserted
        hi = e // chunk_size + inserted
        if e % chunk_size > 0:
            hi += 1
        if hi > n:
            hi = n
        for j in range(lo, hi):
            indices[j] -= inserted
        if lo < n:
            offsets[lo] = s_off
    return n


def logical_chunks(
    query_start_loc: np.ndarray,
    chunk_size: int,
    *,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """vLLM-v0 style logical chunks ``(chunk_indices, chunk_offsets)``, host.

    A logical chunk is a maximal run of tokens of one sequence inside one physical chunk
    ``[j * C, (j + 1) * C)`` of the packed token axis. ``chunk_indices[k]`` is the physical chunk of
    logical chunk ``k`` and ``chunk_offsets[k]`` its start inside it. There are
    ``cdiv(T, C) + #{i in 1..B-1 : query_start_loc[i] % C != 0}`` of them. This is the format of
    vLLM v0's ``_query_start_loc_to_chunk_indices_offsets`` (copied into SGLang and TensorRT-LLM),
    reproduced exactly, including its zero-length sequences: one starting at an unaligned position
    still gets its (empty) logical chunk.

    Parameters
    ----------
    query_start_loc : (num_reqs + 1,) int32, host
        Exclusive prefix sum of the sequence lengths; ``[0] == 0``, non-decreasing.
    chunk_size : int
        Physical chunk size ``C`` (> 0).
    out : (chunk_indices, chunk_offsets), optional
        Two int32 buffers of at least ``num_logical_chunks`` entries; the used prefix is returned.

    Returns
    -------
    chunk_indices : (num_logical_chunks,) int32 ndarray, host
    chunk_offsets : (num_logical_chunks,) int32 ndarray, host

    Raises
    ------
    ValueError
        ``chunk_size <= 0``, ``query_start_loc[0] != 0``, a decreasing ``query_start_loc``, or ``out``
        buffers of the wrong dtype/layout or too small.

    Notes
    -----
    One deliberate difference: with an *aligned* zero-length sequence at the very end of a batch
    whose total is a multiple of ``C`` the vLLM routine raises ``IndexError`` (it writes one past its
    outputs); here that write is skipped.

    Examples
    --------
    >>> import numpy as np
    >>> logical_chunks(np.array([0, 5, 10], np.int32), 8)
    (array([0, 0, 1], dtype=int32), array([0, 5, 0], dtype=int32))
    """
    cs = _check_chunk_size(chunk_size)
    qsl = _i32_vector(query_start_loc, "query_start_loc")
    _check_qsl_start(qsl, "query_start_loc")
    if out is None:
        total = max(int(qsl[-1]), 0)
        cap = (total + cs - 1) // cs + max(qsl.shape[0] - 2, 0)
        indices = np.empty(cap, dtype=_I32)
        offsets = np.empty(cap, dtype=_I32)
    else:
        indices = _check_buffer(out[0], "out.chunk_indices", _I32, 0)
        offsets = _check_buffer(out[1], "out.chunk_offsets", _I32, 0)
    status = int(logical_chunks_nb(qsl, cs, indices, offsets))
    if status < 0:
        row, code = _decode_error(status)
        raise _qsl_error(code, row, qsl, "query_start_loc")
    if status > indices.shape[0] or status > offsets.shape[0]:
        raise ValueError(
            f"out: this batch has {status} logical chunks but the buffers hold "
            f"{indices.shape[0]} / {offsets.shape[0]}"
        )
    return indices[:status], offsets[:status]


# --------------------------------------------------------------------------------------------------
# per-token sequence index (mamba_ssm)


@njit
def token_seq_idx_nb(qsl: np.ndarray, consecutive: bool, out: np.ndarray) -> int:
    """:func:`token_seq_idx`'s compiled pass: the ids of ``qsl[-1]`` tokens, then -1 to the end of
    ``out`` (at least ``qsl[-1]`` long); returns 0 or an error code."""
    status = _qsl_scan_nb(qsl)
    if status < 0:
        return status
    num_seqs = qsl.shape[0] - 1
    seq = 0
    for i in range(num_seqs):
        a = qsl[i]
        b = qsl[i + 1]
        if b == a:
            continue
        ident = seq if consecutive else i
        for t in range(a, b):
            out[t] = ident
        seq += 1
    for t in range(qsl[num_seqs], out.shape[0]):
        out[t] = -1
    return 0


def token_seq_idx(
    query_start_loc: np.ndarray,
    *,
    num_tokens_padded: int | None = None,
    consecutive: bool = False,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Per-token sequence index for the ``mamba_ssm`` SSD kernels, host.

    ``seq_idx[t]`` is the sequence of packed token ``t`` and ``-1`` for padding tokens
    ``[query_start_loc[-1], num_tokens_padded)``, which the kernels treat as padding (negative).

    Zero-length sequences contribute no tokens. By default the ids are the **request row index**
    (``repeat_interleave(arange(B), diff(query_start_loc))``, what vLLM v0, SGLang and TensorRT-LLM
    upload), so the ids are non-decreasing but skip the rows of empty sequences. That is what forked
    kernels need when they index per-request arrays (initial states, state indices) with ``seq_idx``;
    upstream kernels only compare ids for equality and reject negatives, so gaps are harmless there.
    With ``consecutive=True`` the non-empty sequences are numbered ``0, 1, 2, ...`` instead: the
    upstream convention, under which the first non-empty sequence is always id 0 (the only one that
    can receive ``initial_states`` in ``mamba_chunk_scan_combined``).

    Parameters
    ----------
    query_start_loc : (num_reqs + 1,) int32, host
        Exclusive prefix sum of the sequence lengths; ``[0] == 0``, non-decreasing.
    num_tokens_padded : int, optional
        Output length (``>= query_start_loc[-1]``); default ``query_start_loc[-1]``.
    consecutive : bool, default False
        Number the non-empty sequences consecutively instead of by row.
    out : (num_tokens_padded,) int32 ndarray, optional
        Buffer to write into (its length is ``num_tokens_padded`` when that is omitted).

    Returns
    -------
    (num_tokens_padded,) int32 ndarray, host

    Raises
    ------
    ValueError
        ``query_start_loc[0] != 0``, a decreasing ``query_start_loc``, ``num_tokens_padded`` smaller
        than the token count, or a wrong ``out`` buffer.

    Examples
    --------
    >>> import numpy as np
    >>> token_seq_idx(np.array([0, 2, 2, 5], np.int32), num_tokens_padded=7)
    array([ 0,  0,  2,  2,  2, -1, -1], dtype=int32)
    >>> token_seq_idx(np.array([0, 2, 2, 5], np.int32), consecutive=True)
    array([0, 0, 1, 1, 1], dtype=int32)
    """
    qsl = _i32_vector(query_start_loc, "query_start_loc")
    _check_qsl_start(qsl, "query_start_loc")
    total = int(qsl[-1])
    if num_tokens_padded is None:
        length = out.shape[0] if isinstance(out, np.ndarray) else max(total, 0)
    else:
        length = int(num_tokens_padded)
    if length < total or length > INT32_MAX:
        raise ValueError(
            f"num_tokens_padded={length}: must be >= query_start_loc[-1]={total} (padding only adds tokens) "
            f"and fit int32"
        )
    buf = check_out(out, "token_seq_idx", (length,), np.int32)
    status = int(token_seq_idx_nb(qsl, bool(consecutive), buf))
    if status < 0:
        row, code = _decode_error(status)
        raise _qsl_error(code, row, qsl, "query_start_loc")
    return buf


# --------------------------------------------------------------------------------------------------
# vLLM compute_varlen_chunk_metadata (packed-index chunks)


@njit
def _varlen_nb(qsl: np.ndarray, chunk_size: int, cu: np.ndarray, last: np.ndarray, sidx: np.ndarray) -> int:
    status = _qsl_scan_nb(qsl)
    if status < 0:
        return status
    cap = min(cu.shape[0] - 1, sidx.shape[0])
    count = 0
    for b in range(qsl.shape[0] - 1):
        pos = int(qsl[b])
        end = int(qsl[b + 1])
        last[b] = -1
        while pos < end:
            take = chunk_size - pos % chunk_size
            if take > end - pos:
                take = end - pos
            if count < cap:
                cu[count] = pos
                sidx[count] = b
            count += 1
            last[b] = count - 1
            pos += take
    if count <= cap:
        cu[count] = qsl[qsl.shape[0] - 1]
    return count


def varlen_chunk_metadata(
    query_start_loc: np.ndarray, chunk_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's ``compute_varlen_chunk_metadata``, host.

    Splits every sequence at multiples of ``chunk_size`` of the **packed** token index (ignoring how
    many tokens the sequence already has). This is the helper vLLM's SSD kernel tests use; it is
    **not** the Mamba2 builder's layout (:func:`chunk_metadata`), which aligns chunks to absolute
    positions in each request. The two agree only when every context length is a multiple of
    ``chunk_size`` and every sequence starts at a packed multiple of it.

    Parameters
    ----------
    query_start_loc : (num_reqs + 1,) int32, host
        Exclusive prefix sum of the sequence lengths; ``[0] == 0``, non-decreasing.
    chunk_size : int
        Physical chunk size ``C`` (> 0).

    Returns
    -------
    cu_chunk_seqlens : (num_chunks + 1,) int32 ndarray, host
        Token offset of each chunk, then ``query_start_loc[-1]``.
    last_chunk_indices : (num_reqs,) int32 ndarray, host
        Last chunk of each sequence; -1 for an empty sequence.
    seq_idx : (num_chunks,) int32 ndarray, host
        Sequence of each chunk.

    Note the order (cu, last, seq_idx), as in vLLM.

    Raises
    ------
    ValueError
        ``chunk_size <= 0``, ``query_start_loc[0] != 0`` or a decreasing ``query_start_loc``.

    Examples
    --------
    >>> import numpy as np
    >>> varlen_chunk_metadata(np.array([0, 10, 13], np.int32), 8)
    (array([ 0,  8, 10, 13], dtype=int32), array([1, 2], dtype=int32), array([0, 0, 1], dtype=int32))
    """
    cs = _check_chunk_size(chunk_size)
    qsl = _i32_vector(query_start_loc, "query_start_loc")
    _check_qsl_start(qsl, "query_start_loc")
    num_seqs = qsl.shape[0] - 1
    total = max(int(qsl[-1]), 0)
    cap = (total + cs - 1) // cs + num_seqs
    cu = np.empty(cap + 1, dtype=_I32)
    sidx = np.empty(cap, dtype=_I32)
    last = np.empty(num_seqs, dtype=_I32)
    status = int(_varlen_nb(qsl, cs, cu, last, sidx))
    if status < 0:
        row, code = _decode_error(status)
        raise _qsl_error(code, row, qsl, "query_start_loc")
    return cu[: status + 1], last, sidx[:status]
