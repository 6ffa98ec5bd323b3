"""Gated-delta-net (GDN) host derivations: FLA chunk metadata, the spec / non-spec token partition and
the FlashInfer checkpoint plan (docs/semantics-mamba.md, "Gated delta net").

- :func:`fla_chunk_metadata`: FLA's ``prepare_chunk_indices`` / ``prepare_chunk_offsets``
  (``FLA_CHUNK_SIZE = 64``) from a host prefill ``query_start_loc``.
- :func:`spec_token_partition`: vLLM's stable argsort of the per-token spec mask, computed on the
  host: the non-spec token indices, then the spec ones.
- :func:`plan_flashinfer_checkpoints`: vLLM's FlashInfer checkpoint plan.

Shape legend
------------
- ``num_rows`` (``P``): rows of a prefill ``query_start_loc`` (``P + 1`` entries).
- ``num_chunks`` (``N``): ``sum(cdiv(q_i, chunk_size))``.
- ``num_reqs`` (``B``): request rows; ``num_tokens`` (``T``): ``sum(q)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnmeta._checks import as_host_array
from attnmeta._numba import njit

__all__ = ["FLA_CHUNK_SIZE", "fla_chunk_metadata", "plan_flashinfer_checkpoints", "spec_token_partition"]

FLA_CHUNK_SIZE = 64
"""vLLM's ``FLA_CHUNK_SIZE``: tokens per chunk of the FLA gated-delta-rule kernels."""


@njit
def fla_count_nb(qsl: np.ndarray, chunk_size: int) -> int:
    """Total chunks ``sum(cdiv(q_i, chunk_size))``; ``-1 - row`` for a decreasing ``qsl``."""
    tot = 0
    for i in range(qsl.shape[0] - 1):
        q = int(qsl[i + 1]) - int(qsl[i])
        if q < 0:
            return -1 - i
        tot += (q + chunk_size - 1) // chunk_size
    return tot


@njit
def fla_fill_nb(qsl: np.ndarray, chunk_size: int, indices: np.ndarray, offsets: np.ndarray) -> None:
    """Fill ``indices`` ``(N, 2)`` and ``offsets`` ``(P + 1,)`` (a valid ``qsl``)."""
    seq = -1
    k = 0
    offsets[0] = 0
    for i in range(qsl.shape[0] - 1):
        n = (int(qsl[i + 1]) - int(qsl[i]) + chunk_size - 1) // chunk_size
        if n > 0:
            seq += 1  # FLA numbers a sequence by the chunks with index 0 so far: empty rows are skipped
        for j in range(n):
            indices[k, 0] = seq
            indices[k, 1] = j
            k += 1
        offsets[i + 1] = k


def fla_chunk_metadata(
    query_start_loc: Any, *, chunk_size: int = FLA_CHUNK_SIZE, out: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """FLA's ``prepare_chunk_indices`` and ``prepare_chunk_offsets``, on the host.

    With ``n_i = cdiv(q_i, chunk_size)``: ``chunk_indices[c] = [sequence number, chunk index in the
    sequence]``, where the sequence number counts the chunks with index 0 before it, minus 1 (a
    zero-length row makes no chunk and does not advance it); ``chunk_offsets = [0, cumsum(n_i)]``.

    Parameters
    ----------
    query_start_loc : (P + 1,) int32, host
        Prefill query starts (non-decreasing; only differences are read).
    chunk_size : int, default 64
        ``FLA_CHUNK_SIZE``.
    out : (indices, offsets), optional
        Buffers of at least ``(N, 2)`` int32 and ``(P + 1,)`` int64 (e.g. staging views), filled in
        their leading rows.

    Returns
    -------
    chunk_indices : (N, 2) int32, host
    chunk_offsets : (P + 1,) int64, host
        (torch's ``cumsum`` of FLA's int32 counts promotes to int64.)

    Raises
    ------
    ValueError
        A decreasing ``query_start_loc``, ``chunk_size < 1`` or too small ``out`` buffers.
    TypeError
        A torch tensor or a non-integer array.

    Examples
    --------
    >>> import numpy as np
    >>> ci, co = fla_chunk_metadata(np.array([0, 130, 130, 200], np.int32))
    >>> ci.tolist(), co.tolist(), co.dtype
    ([[0, 0], [0, 1], [0, 2], [1, 0], [1, 1]], [0, 3, 3, 5], dtype('int64'))
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
    qsl = as_host_array(query_start_loc, "query_start_loc", dtype=np.int32)
    if qsl.shape[0] == 0:
        raise ValueError("query_start_loc: must have num_rows + 1 >= 1 entries, got shape (0,)")
    n = int(fla_count_nb(qsl, int(chunk_size)))
    if n < 0:
        row = -1 - n
        raise ValueError(f"query_start_loc[{row + 1}]={int(qsl[row + 1])} < query_start_loc[{row}]={int(qsl[row])} "
                         f"(row {row}): query_start_loc must be non-decreasing")
    if out is None:
        indices, offsets = np.empty((n, 2), np.int32), np.empty(qsl.shape[0], np.int64)
    else:
        indices, offsets = out
        if indices.dtype != np.int32 or indices.ndim != 2 or indices.shape[0] < n or indices.shape[1] != 2:
            raise ValueError(f"out[0]: expected an int32 ({n}, 2) buffer or longer, got {indices.dtype} {indices.shape}")
        if offsets.dtype != np.int64 or offsets.ndim != 1 or offsets.shape[0] < qsl.shape[0]:
            raise ValueError(f"out[1]: expected an int64 ({qsl.shape[0]},) buffer or longer, got "
                             f"{offsets.dtype} {offsets.shape}")
    fla_fill_nb(qsl, int(chunk_size), indices, offsets)
    return indices[:n], offsets[: qsl.shape[0]]


@njit
def token_partition_nb(q: np.ndarray, mask: np.ndarray, non_spec: np.ndarray, spec: np.ndarray) -> None:
    """Stable partition of ``arange(sum(q))`` by the per-row ``mask``: unmasked tokens to ``non_spec``,
    masked ones to ``spec`` (both sized by the caller)."""
    t = 0
    a = 0
    b = 0
    for i in range(q.shape[0]):
        for _ in range(q[i]):
            if mask[i]:
                spec[b] = t
                b += 1
            else:
                non_spec[a] = t
                a += 1
            t += 1


def spec_token_partition(query_lens: Any, spec_mask: Any) -> tuple[np.ndarray, np.ndarray]:
    """The spec / non-spec token indices of vLLM's mixed GDN batch, on the host.

    vLLM computes ``argsort(repeat_interleave(spec_mask, q), stable=True)`` on the device and splits it
    after the non-spec tokens; this is the same stable partition of ``arange(sum(q))``.

    Parameters
    ----------
    query_lens : (B,) int32, host
        ``q`` of every row (>= 0).
    spec_mask : (B,) bool, host
        Spec-decode rows.

    Returns
    -------
    non_spec_token_indx : (sum(q[~mask]),) int64, host
    spec_token_indx : (sum(q[mask]),) int64, host

    Examples
    --------
    >>> import numpy as np
    >>> ns, s = spec_token_partition(np.array([3, 1, 2, 6, 0], np.int32), np.array([1, 0, 1, 0, 0], bool))
    >>> s.tolist(), ns.tolist()
    ([0, 1, 2, 4, 5], [3, 6, 7, 8, 9, 10, 11])
    """
    q = as_host_array(query_lens, "query_lens", dtype=np.int32)
    m = np.asarray(spec_mask)
    if m.dtype != np.bool_ or m.shape != q.shape:
        raise ValueError(f"spec_mask: expected a bool array of shape {q.shape}, got {m.dtype} {m.shape}")
    if q.size and int(q.min()) < 0:
        row = int(np.argmax(q < 0))
        raise ValueError(f"query_lens[{row}]={int(q[row])} < 0 (row {row})")
    ns_n = int(q[~m].sum())
    non_spec, spec = np.empty(ns_n, np.int64), np.empty(int(q.sum()) - ns_n, np.int64)
    token_partition_nb(q, m, non_spec, spec)
    return non_spec, spec


def plan_flashinfer_checkpoints(offsets: Any, query_lens: Any) -> tuple[np.ndarray, int]:
    """vLLM's ``plan_flashinfer_checkpoints``: checkpoint rows of FlashInfer's GDN prefill, host.

    ``every_n = gcd(offsets)``; ``cu_starts = [0, cumsum(q_i // every_n)]``; for the checkpoint rows
    (the last ``len(query_lens)`` offsets) with an offset > 0, ``rows[R - P + j] = cu_starts[j] +
    offsets[R - P + j] // every_n - 1``, every other entry of ``rows`` (R,) 0.

    Parameters
    ----------
    offsets : (R,) int64, host
        Checkpoint offsets into each row's query (0: no checkpoint), R >= len(query_lens).
    query_lens : (P,) int32 or int64, host
        Query lengths of the prefill kernel's rows.

    Returns
    -------
    plan : (P + 1 + R,) int64, host
        ``cu_starts`` then ``rows`` (vLLM uploads them as one tensor).
    num_checkpoints : int
        ``cu_starts[-1]``.

    Examples
    --------
    >>> plan, n = plan_flashinfer_checkpoints([0, 128, 64, 0, 192], [256, 128, 64, 320])
    >>> plan.tolist(), n
    ([0, 4, 6, 7, 12, 0, 1, 4, 0, 9], 12)
    """
    off = as_host_array(offsets, "offsets", dtype=np.int64)
    q = as_host_array(query_lens, "query_lens", dtype=np.int64)
    if off.shape[0] < q.shape[0]:
        raise ValueError(f"offsets: expected at least len(query_lens)={q.shape[0]} entries, got {off.shape[0]}")
    every_n = math.gcd(*(int(v) for v in off)) or 1
    cu = np.zeros(q.shape[0] + 1, np.int64)
    np.cumsum(q // every_n, out=cu[1:])
    first = off.shape[0] - q.shape[0]
    rows = np.zeros(off.shape[0], np.int64)
    tail = off[first:]
    rows[first:] = np.where(tail > 0, cu[:-1] + tail // every_n - 1, 0)
    return np.concatenate([cu, rows]), int(cu[-1])
