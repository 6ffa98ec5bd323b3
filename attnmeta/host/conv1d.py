"""Causal-conv1d launch metadata for Mamba / GDN prefills, derived on the host.

vLLM's Triton ``causal_conv1d_fn`` runs one program per ``BLOCK_M`` tokens of each prefill sequence;
``compute_causal_conv1d_metadata`` (docs/semantics-mamba.md, "Causal-conv1d programs") tells each program which sequence
(``batch_ptr``) and which ``BLOCK_M`` block of it (``token_chunk_offset_ptr``) it handles.
:func:`causal_conv1d_metadata` computes the same values, dtypes and padded lengths from the host
``query_start_loc_p`` in one compiled pass, optionally straight into staging buffers.

Shape legend
------------
- ``num_prefills`` (``P``): prefill rows; ``query_start_loc_p`` has ``P + 1`` entries.
- ``num_programs_total`` (``tot``): ``sum(cdiv(query_len_i, block_m))``, programs actually launched.
- ``max_num_programs``: ``2 * max(1024, tot)``, vLLM's padded device length of the two pointers.
- ``capacity``: length of caller-provided ``out=`` buffers (``>= tot``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnmeta._checks import as_host_array, reject_tensor
from attnmeta._numba import njit

__all__ = ["Conv1dMetadata", "causal_conv1d_metadata"]

_I32 = np.dtype(np.int32)


class Conv1dMetadata(NamedTuple):
    """Causal-conv1d metadata for one ``BLOCK_M`` (vLLM's ``nums_dict[BLOCK_M]`` plus the pointers).

    All arrays are host numpy; ``batch_ptr`` / ``token_chunk_offset_ptr`` are the host images of the
    device int32 arrays vLLM uploads.
    """

    nums: np.ndarray
    """(num_prefills,) int32, host. Programs per prefill row, ``cdiv(query_len, block_m)`` (vLLM:
    ``-(-seqlens // BLOCK_M)`` on the int32 ``diff(query_start_loc_p)``, hence int32)."""
    num_programs_total: int
    """``tot = sum(nums)``: programs launched (vLLM ``nums_dict[8]["tot"]`` and ``["mlist_len"]``)."""
    mlist: np.ndarray
    """(num_programs_total,) int64, host. Prefill row of each program,
    ``repeat(arange(P), nums)``."""
    offsetlist: np.ndarray
    """(num_programs_total,) int32, host. ``BLOCK_M`` block of its row each program handles,
    the concatenation of ``range(nums_i)``. Shares memory with ``token_chunk_offset_ptr[:tot]``."""
    max_num_programs: int
    """``2 * max(1024, num_programs_total)`` (vLLM's ``MAX_NUM_PROGRAMS``)."""
    batch_ptr: np.ndarray
    """(max_num_programs,) int32, host (or the whole ``out`` buffer, ``(capacity,)``). ``mlist``
    narrowed to int32, then ``-1`` (``PAD_SLOT_ID``) to the end."""
    token_chunk_offset_ptr: np.ndarray
    """(max_num_programs,) int32, host (or the whole ``out`` buffer, ``(capacity,)``). ``offsetlist``,
    then ``-1`` to the end."""


@njit
def count_programs_nb(qsl: np.ndarray, block_m: int, nums: np.ndarray) -> int:
    """Fill ``nums``; return ``tot`` or ``-1 - row`` for the first decreasing row."""
    tot = 0
    for i in range(nums.shape[0]):
        n = int(qsl[i + 1]) - int(qsl[i])
        if n < 0:
            return -1 - i
        m = (n + block_m - 1) // block_m
        nums[i] = m
        tot += m
    return tot


@njit
def minus_one_nb(a: np.ndarray, start: int, stop: int, known_lo: int, known_hi: int) -> None:
    """``a[start:stop] = -1`` except rows ``[known_lo, known_hi)``, which the caller knows hold -1
    already (1-D slices: the loops vectorize)."""
    for lo, hi in ((start, min(stop, known_lo)), (max(start, known_hi), stop)):
        if hi > lo:
            seg = a[lo:hi]
            for t in range(hi - lo):
                seg[t] = -1


@njit
def fill_programs_nb(
    nums: np.ndarray, mlist: np.ndarray, batch_ptr: np.ndarray, offset_ptr: np.ndarray, stop: int, bp_lo: int,
    bp_hi: int, op_lo: int, op_hi: int,
) -> int:
    """Write ``mlist``, ``batch_ptr`` and ``offset_ptr`` for programs ``nums`` (``tot`` rows each),
    then ``-1`` on rows ``[tot, stop)`` of each pointer (within its length), except the rows
    ``[bp_lo, bp_hi)`` / ``[op_lo, op_hi)`` the caller knows hold -1 already; returns ``tot``. One
    1-D slice per row and array, so every fill loop vectorizes."""
    k = 0
    for i in range(nums.shape[0]):
        m = nums[i]
        seg = batch_ptr[k : k + m]
        for t in range(m):
            seg[t] = i
        seg = offset_ptr[k : k + m]
        for t in range(m):
            seg[t] = t
        seg64 = mlist[k : k + m]
        for t in range(m):
            seg64[t] = i
        k += m
    minus_one_nb(batch_ptr, k, min(stop, batch_ptr.shape[0]), bp_lo, bp_hi)
    minus_one_nb(offset_ptr, k, min(stop, offset_ptr.shape[0]), op_lo, op_hi)
    return k


def _out_buffer(buf: Any, name: str, tot: int) -> np.ndarray:
    reject_tensor(buf, name)
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{name}: out= buffers must be numpy arrays, got {type(buf).__name__}")
    if buf.dtype != _I32:
        raise ValueError(f"{name}: out= buffer must have dtype int32, got {buf.dtype}")
    if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError(f"{name}: out= buffer must be 1-D, C-contiguous and writable, got shape {buf.shape}")
    if buf.shape[0] < tot:
        raise ValueError(
            f"{name}: out= buffer has {buf.shape[0]} entries but this batch launches {tot} programs"
        )
    return buf


def causal_conv1d_metadata(
    query_start_loc_p: np.ndarray,
    *,
    block_m: int = 8,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> Conv1dMetadata:
    """Causal-conv1d program metadata of vLLM's ``compute_causal_conv1d_metadata``, host.

    For query lengths ``q_i = diff(query_start_loc_p)``: ``nums = cdiv(q, block_m)``,
    ``tot = sum(nums)``, ``mlist = repeat(arange(P), nums)`` (int64),
    ``offsetlist = concat(range(nums_i))`` (int32), ``max_num_programs = 2 * max(1024, tot)``, and the
    host images of vLLM's device ``batch_ptr`` / ``token_chunk_offset_ptr`` (int32, ``-1`` after the
    first ``tot`` entries). Zero-length rows get 0 programs.

    Parameters
    ----------
    query_start_loc_p : (num_prefills + 1,) int32, host
        Prefill query start locations (vLLM: ``qsl_cpu[-P-1:] - num_decode_tokens``); non-decreasing.
        Only differences are used, so ``[0]`` need not be 0.
    block_m : int, default 8
        Tokens per program (vLLM's ``BLOCK_M``; 8 is the only value vLLM uses).
    out : (batch_ptr, token_chunk_offset_ptr), optional
        Two int32 buffers of at least ``tot`` entries (e.g. graph-mode staging views). They are filled
        entirely (values, then ``-1``) and returned whole instead of ``(max_num_programs,)`` arrays.

    Returns
    -------
    Conv1dMetadata
        ``nums (P,) int32``, ``num_programs_total``, ``mlist (tot,) int64``, ``offsetlist (tot,) int32``,
        ``max_num_programs``, ``batch_ptr`` and ``token_chunk_offset_ptr`` ``(max_num_programs,) int32``.

    Raises
    ------
    ValueError
        ``block_m <= 0``, a decreasing ``query_start_loc_p``, or wrong / too small ``out`` buffers.
    TypeError
        A torch tensor or non-integer array is passed.

    Examples
    --------
    >>> import numpy as np
    >>> m = causal_conv1d_metadata(np.array([0, 10, 10, 13], np.int32))
    >>> m.nums, m.num_programs_total, m.mlist, m.offsetlist
    (array([2, 0, 1], dtype=int32), 3, array([0, 0, 2]), array([0, 1, 0], dtype=int32))
    >>> m.max_num_programs, m.batch_ptr[:5], m.token_chunk_offset_ptr[:5]
    (2048, array([ 0,  0,  2, -1, -1], dtype=int32), array([ 0,  1,  0, -1, -1], dtype=int32))
    """
    if isinstance(block_m, bool) or not isinstance(block_m, int | np.integer) or block_m <= 0:
        raise ValueError(f"block_m: must be a positive int, got {block_m!r}")
    qsl = query_start_loc_p
    if not (type(qsl) is np.ndarray and qsl.dtype is _I32 and qsl.ndim == 1 and qsl.flags.c_contiguous):
        qsl = as_host_array(qsl, "query_start_loc_p", dtype=np.int32)
    if qsl.shape[0] == 0:
        raise ValueError("query_start_loc_p: must have num_prefills + 1 >= 1 entries, got shape (0,)")
    num_rows = qsl.shape[0] - 1
    nums = np.empty(num_rows, dtype=_I32)
    tot = int(count_programs_nb(qsl, int(block_m), nums))
    if tot < 0:
        row = -1 - tot
        raise ValueError(
            f"query_start_loc_p[{row + 1}]={int(qsl[row + 1])} < query_start_loc_p[{row}]={int(qsl[row])} "
            f"(prefill row {row}): query_start_loc_p must be non-decreasing"
        )
    max_programs = 2 * max(1024, tot)
    if out is None:
        batch_ptr = np.empty(max_programs, dtype=_I32)
        offset_ptr = np.empty(max_programs, dtype=_I32)
    else:
        batch_ptr = _out_buffer(out[0], "out.batch_ptr", tot)
        offset_ptr = _out_buffer(out[1], "out.token_chunk_offset_ptr", tot)
    mlist = np.empty(tot, dtype=np.int64)
    fill_programs_nb(nums, mlist, batch_ptr, offset_ptr, max(batch_ptr.shape[0], offset_ptr.shape[0]), 0, 0, 0, 0)
    return Conv1dMetadata(nums, tot, mlist, offset_ptr[:tot], max_programs, batch_ptr, offset_ptr)
