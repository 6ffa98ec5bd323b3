"""FlashInfer paged-KV layout, derived on the host (docs/semantics-attention.md).

FlashInfer describes each request's KV cache as a run of pages: ``paged_kv_indptr`` (an exclusive
prefix sum of pages per request), ``paged_kv_indices`` (the physical page ids, request after request)
and ``paged_kv_last_page_len`` (how many tokens the last page holds). vLLM 0.33.0 computes the indptr
and the last-page lengths on the host but gathers the indices on the device (a Triton kernel reading the
device indptr); attnmeta gathers them from the host block table in compiled code, so the whole layout
is ready for the step's one copy.

With ``nblk_i = cdiv(seq_lens[i], page_size)``:

- ``paged_kv_indptr = [0, cumsum(nblk)]``;
- ``paged_kv_indices[indptr[i]:indptr[i+1]] = block_table[i, :nblk_i]``;
- ``paged_kv_last_page_len[i] = page_size`` if ``seq_lens[i] % page_size == 0`` and ``seq_lens[i] != 0``,
  else ``seq_lens[i] % page_size`` (so 0 for a padding row with ``seq_lens[i] == 0``, which also has no
  pages).

Sizes first: :func:`num_pages` gives ``paged_kv_indptr[-1]`` without writing anything, so a caller can
carve every output out of a staging buffer and pass it as ``out=``. :func:`paged_kv_layout` computes
all three arrays in one pass. :func:`rebase_indptr` slices an indptr for the prefill rows ``[D, B)``.

On error the contents of any ``out=`` buffer are unspecified.

Shape legend
------------
- ``num_reqs``: request rows ``B``, CUDA-graph padding rows included (``len(seq_lens)``).
- ``max_blocks_per_req``: block-table width ``W``.
- ``paged_kv_indptr[-1]``: total pages of the batch, ``num_pages(seq_lens, page_size)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np

from attnmeta._checks import INT32_MAX, as_host_array, block_table_rows, check_out
from attnmeta._intdiv import cdiv_by, mod_by, pow2_shift
from attnmeta._numba import njit, njit_parallel

__all__ = [
    "PagedKV",
    "num_pages",
    "paged_indices_nb",
    "paged_indices_par_nb",
    "paged_kv_indices",
    "paged_kv_indptr",
    "paged_kv_last_page_len",
    "paged_kv_layout",
    "paged_layout_nb",
    "prefill_qo_indptr",
    "rebase_indptr",
]

# Status codes returned by the kernels (the wrappers turn them into messages).
_OK = 0
_NEG_SEQ = 1  # seq_lens[row] < 0
_OVERFLOW = 2  # the running page count passed INT32_MAX at row
_TOO_WIDE = 3  # row needs more pages than the block table has columns
_NEG_BLOCK = 4  # block_table[row, col] < 0 in a gathered column
_OUT_LEN = 5  # indices out= has the wrong length
_INDPTR0 = 6  # paged_kv_indptr[0] != 0
_INDPTR_DEC = 7  # paged_kv_indptr[row + 1] < paged_kv_indptr[row]


class PagedKV(NamedTuple):
    """FlashInfer paged-KV arrays of one batch, all host numpy.

    Examples
    --------
    >>> import numpy as np
    >>> layout = paged_kv_layout(np.array([5, 8, 0], np.int32), np.arange(12, dtype=np.int32).reshape(3, 4), 4)
    >>> layout.paged_kv_indptr, layout.paged_kv_indices, layout.paged_kv_last_page_len
    (array([0, 2, 4, 4], dtype=int32), array([0, 1, 4, 5], dtype=int32), array([1, 4, 0], dtype=int32))
    """

    paged_kv_indptr: np.ndarray
    """(num_reqs + 1,) int32, host. ``[0, cumsum(cdiv(seq_lens, page_size))]``."""
    paged_kv_indices: np.ndarray | None
    """(paged_kv_indptr[-1],) int32, host. Page ids of request 0, then request 1, ... (None only in
    the host part of a page table whose indices a builder gathers on the device)."""
    paged_kv_last_page_len: np.ndarray
    """(num_reqs,) int32, host. Tokens in each request's last page; 0 for ``seq_lens[i] == 0``."""


def _check_page_size(page_size: Any) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int | np.integer) or int(page_size) <= 0:
        raise ValueError(f"page_size: must be a positive int, got {page_size!r}")
    return int(page_size)


def _any_len_out(out: Any, name: str) -> np.ndarray:
    """Validate a 1-D int32 ``out=`` whose length the kernel checks (it is only known after a pass)."""
    if isinstance(out, np.ndarray) and out.ndim != 1:
        raise ValueError(f"{name}: out= must be 1-D, got shape {out.shape}")
    return check_out(out, name, tuple(getattr(out, "shape", ())), np.int32)


def _raise_seq(code: int, row: int, seq_lens: np.ndarray, page_size: int, width: int = 0) -> None:
    if code == _NEG_SEQ:
        raise ValueError(
            f"seq_lens[{row}]={int(seq_lens[row])} is negative (request {row}); lengths must be >= 0"
        )
    if code == _OVERFLOW:
        raise ValueError(
            f"seq_lens: the page count cdiv(seq_lens, page_size={page_size}) summed up to request {row} "
            f"exceeds int32 ({INT32_MAX})"
        )
    if code == _TOO_WIDE:
        s = int(seq_lens[row])
        raise ValueError(
            f"block_table: row {row} needs cdiv(seq_lens[{row}]={s}, page_size={page_size})="
            f"{-(-s // page_size)} pages but the table has {width} columns (request {row})"
        )


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------


@njit
def _copy_row(src: np.ndarray, dst: np.ndarray, n: int) -> int:
    """``dst[:n] = src[:n]``; returns ``min(0, src[:n])``. A branch-free loop over 1-D slices, which
    LLVM vectorizes (an early exit on a negative id, or 2-D indexing, makes it several times slower)."""
    low = 0
    for j in range(n):
        b = src[j]
        dst[j] = b
        low = min(low, b)
    return low


@njit
def _first_negative(src: np.ndarray, n: int) -> int:
    for j in range(n):
        if src[j] < 0:
            return j
    return -1


@njit
def _indices_nb(block_table: np.ndarray, indptr: np.ndarray, out: np.ndarray) -> tuple[int, int, int]:
    n = indptr.shape[0] - 1
    width = block_table.shape[1]
    if indptr[0] != 0:
        return _INDPTR0, 0, 0
    for i in range(n):
        start = int(indptr[i])
        nb = int(indptr[i + 1]) - start
        if nb < 0:
            return _INDPTR_DEC, i, 0
        if nb > width:
            return _TOO_WIDE, i, nb
        if start + nb > out.shape[0]:
            return _OUT_LEN, i, 0
        if _copy_row(block_table[i], out[start : start + nb], nb) < 0:
            return _NEG_BLOCK, i, _first_negative(block_table[i], nb)
    return _OK, 0, 0


@njit
def paged_layout_nb(
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    page_size: int,
    copy: bool,
    indptr: np.ndarray,
    indices: np.ndarray,
    last: np.ndarray,
) -> tuple[int, int, int, int]:
    """The one compiled pass of the paged-KV layout (every public function here, the common pass's
    page table and :func:`attnmeta.common.stage_paged_kv` run it): row by row, ``indptr[i + 1]``, the
    last page's tokens ``last[i]`` and, with ``copy``, row ``i``'s page ids into ``indices`` (which may
    be longer than the page count; its tail is left as it is).

    Unchecked inputs: ``indptr`` has ``len(seq_lens) + 1`` entries, ``last`` ``len(seq_lens)``,
    ``block_table`` at least as many rows. Returns ``(code, row, col, total)``: ``code`` 0, or the
    first rule broken, at ``row`` (and block-table column ``col``): a negative length, a total above
    int32, more pages than the table has columns, ``indices`` too short (with ``copy``), a negative
    id in a used column. ``total`` is the page count.
    """
    width = block_table.shape[1]
    cap = indices.shape[0]
    total = 0
    indptr[0] = 0
    sh = pow2_shift(page_size)
    for i in range(seq_lens.shape[0]):
        s = int(seq_lens[i])
        if s < 0:
            return _NEG_SEQ, i, 0, 0
        nb = int(cdiv_by(s, page_size, sh))
        if nb > width:
            return _TOO_WIDE, i, 0, 0
        if copy:
            if total + nb > cap:
                return _OUT_LEN, i, 0, 0
            if _copy_row(block_table[i], indices[total : total + nb], nb) < 0:
                return _NEG_BLOCK, i, _first_negative(block_table[i], nb), 0
        total += nb
        if total > INT32_MAX:
            return _OVERFLOW, i, 0, 0
        indptr[i + 1] = total
        r = mod_by(s, page_size, sh)
        last[i] = page_size if (r == 0 and s != 0) else r
    return _OK, 0, 0, total


@njit
def paged_indices_nb(block_table: np.ndarray, indptr: np.ndarray, indices: np.ndarray, n: int) -> None:
    """:func:`paged_layout_nb`'s page-index copy of rows ``[0, n)`` from an ``indptr`` it wrote
    (``copy=False``), without its checks: for a table whose used columns are known valid (a validated
    :class:`~attnmeta.BatchSpec`'s) and an ``indices`` long enough. The same bytes; a loop of plain
    row copies, faster than the checked one."""
    for i in range(n):
        lo = indptr[i]
        nb = indptr[i + 1] - lo
        src = block_table[i]
        dst = indices[lo : lo + nb]  # 1-D slices: the copy vectorizes
        for j in range(nb):
            dst[j] = src[j]


@njit_parallel
def paged_indices_par_nb(block_table: np.ndarray, indptr: np.ndarray, indices: np.ndarray, n: int) -> None:
    """:func:`paged_indices_nb` on numba's thread pool: the same bytes. Unchecked inputs."""
    for i in numba.prange(n):
        lo = indptr[i]
        nb = indptr[i + 1] - lo
        src = block_table[i]
        dst = indices[lo : lo + nb]  # 1-D slices: the copy vectorizes
        for j in range(nb):
            dst[j] = src[j]


def _counts(seq_lens: np.ndarray, page_size: int, indptr: np.ndarray | None = None,
            last: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`paged_layout_nb` without the copy (any width): indptr, last-page lengths and the total;
    raises the detailed error."""
    n = seq_lens.shape[0]
    indptr = np.empty(n + 1, np.int32) if indptr is None else indptr
    last = np.empty(n, np.int32) if last is None else last
    code, row, _col, total = paged_layout_nb(seq_lens, _NO_TABLE, page_size, False, indptr, _NO_INDICES, last)
    if code:
        _raise_seq(code, row, seq_lens, page_size)
    return indptr, last, int(total)


_NO_TABLE = np.zeros((0, INT32_MAX), np.int32)  # no rows (nothing is copied), any row's pages fit
_NO_INDICES = np.zeros(0, np.int32)


# --------------------------------------------------------------------------------------------------
# public wrappers
# --------------------------------------------------------------------------------------------------


def num_pages(seq_lens: Any, page_size: int) -> int:
    """Total pages of a batch, ``sum(cdiv(seq_lens, page_size))`` (host), to size ``paged_kv_indices``.

    Parameters
    ----------
    seq_lens : (num_reqs,) int32, host
        Sequence lengths ``s_i = c_i + q_i``; padding rows 0.
    page_size : int
        Tokens per KV page (the block size), > 0.

    Returns
    -------
    int
        ``paged_kv_indptr[-1]``: the length of :func:`paged_kv_indices`' output.

    Raises
    ------
    ValueError
        A negative sequence length, a non-positive ``page_size``, or a total above int32.

    Examples
    --------
    >>> import numpy as np
    >>> num_pages(np.array([5, 8, 0, 1], np.int32), 4)
    5
    """
    ps = _check_page_size(page_size)
    return _counts(as_host_array(seq_lens, "seq_lens"), ps)[2]


def paged_kv_indptr(seq_lens: Any, page_size: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """FlashInfer ``paged_kv_indptr``: ``[0, cumsum(cdiv(seq_lens, page_size))]`` (host).

    Parameters
    ----------
    seq_lens : (num_reqs,) int32, host
        Sequence lengths; padding rows 0 (they get 0 pages).
    page_size : int
        Tokens per KV page, > 0.
    out : (num_reqs + 1,) int32, host, optional
        Buffer to write into (e.g. a staging-buffer view).

    Returns
    -------
    (num_reqs + 1,) int32, host
        ``out`` if given. ``[0] == 0``; ``[-1] == num_pages(seq_lens, page_size)``.

    Raises
    ------
    ValueError
        A negative sequence length, a non-positive ``page_size``, an int32 overflow of the total, or a
        wrong ``out``.

    Examples
    --------
    >>> import numpy as np
    >>> paged_kv_indptr(np.array([5, 8, 0, 1], np.int32), 4)
    array([0, 2, 4, 4, 5], dtype=int32)
    """
    ps = _check_page_size(page_size)
    s = as_host_array(seq_lens, "seq_lens")
    res = check_out(out, "paged_kv_indptr", (s.shape[0] + 1,), np.int32)
    return _counts(s, ps, indptr=res)[0]


def paged_kv_last_page_len(seq_lens: Any, page_size: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """FlashInfer ``paged_kv_last_page_len``: tokens in each request's last page (host).

    ``page_size`` if ``s % page_size == 0`` and ``s != 0``, else ``s % page_size``; 0 for ``s == 0``.

    Parameters
    ----------
    seq_lens : (num_reqs,) int32, host
        Sequence lengths; padding rows 0.
    page_size : int
        Tokens per KV page, > 0.
    out : (num_reqs,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs,) int32, host
        ``out`` if given; every value is in ``[0, page_size]``.

    Raises
    ------
    ValueError
        A negative sequence length, a non-positive ``page_size``, or a wrong ``out``.

    Examples
    --------
    >>> import numpy as np
    >>> paged_kv_last_page_len(np.array([5, 8, 0, 1], np.int32), 4)
    array([1, 4, 0, 1], dtype=int32)
    """
    ps = _check_page_size(page_size)
    s = as_host_array(seq_lens, "seq_lens")
    res = check_out(out, "paged_kv_last_page_len", (s.shape[0],), np.int32)
    return _counts(s, ps, last=res)[1]


def paged_kv_indices(block_table: Any, paged_kv_indptr: Any, *, out: np.ndarray | None = None) -> np.ndarray:
    """FlashInfer ``paged_kv_indices``, gathered from the host block table in compiled code (host).

    ``out[indptr[i]:indptr[i+1]] = block_table[i, :indptr[i+1] - indptr[i]]``: the same values vLLM's
    device gather (and, before it, the boolean-mask ``block_table[:, :max_blocks][arange < nblk]``)
    produces.

    Parameters
    ----------
    block_table : (rows, max_blocks_per_req) int32, host
        Physical block ids; ``rows >= num_reqs`` (a persistent table may be passed whole; only its first
        ``num_reqs`` rows are read). Gathered entries must be >= 0.
    paged_kv_indptr : (num_reqs + 1,) int32, host
        From :func:`paged_kv_indptr`: ``[0] == 0``, non-decreasing, row ``i`` spans at most
        ``max_blocks_per_req`` pages.
    out : (paged_kv_indptr[-1],) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (paged_kv_indptr[-1],) int32, host
        ``out`` if given.

    Raises
    ------
    ValueError
        Too few block-table rows, a malformed ``paged_kv_indptr``, a row needing more pages than the
        table has columns, a negative block id in a gathered column, or a wrong ``out``.

    Examples
    --------
    >>> import numpy as np
    >>> bt = np.array([[7, 3, 9], [4, 0, 0], [0, 0, 0], [2, 5, 8]], np.int32)
    >>> paged_kv_indices(bt, np.array([0, 2, 3, 3, 6], np.int32))
    array([7, 3, 4, 2, 5, 8], dtype=int32)
    """
    indptr = as_host_array(paged_kv_indptr, "paged_kv_indptr")
    if indptr.shape[0] < 1:
        raise ValueError("paged_kv_indptr: must have num_reqs + 1 >= 1 entries, got an empty array")
    n = indptr.shape[0] - 1
    bt = block_table_rows(block_table, n)
    total = int(indptr[-1])
    if total < 0:
        raise ValueError(f"paged_kv_indptr[-1]={total} is negative; an indptr counts pages from 0")
    res = check_out(out, "paged_kv_indices", (total,), np.int32)
    code, row, col = _indices_nb(bt, indptr, res)
    if code == _INDPTR0:
        raise ValueError(f"paged_kv_indptr[0]={int(indptr[0])}; an indptr must start at 0")
    if code == _INDPTR_DEC:
        raise ValueError(
            f"paged_kv_indptr[{row + 1}]={int(indptr[row + 1])} < paged_kv_indptr[{row}]={int(indptr[row])} "
            f"(request {row}); an indptr must be non-decreasing"
        )
    if code == _OUT_LEN:
        raise ValueError(
            f"paged_kv_indptr[{row + 1}]={int(indptr[row + 1])} > paged_kv_indptr[-1]={total} "
            f"(request {row}); an indptr must be non-decreasing"
        )
    if code == _TOO_WIDE:
        raise ValueError(
            f"block_table: request {row} spans {col} pages (paged_kv_indptr[{row + 1}] - "
            f"paged_kv_indptr[{row}]) but the table has {bt.shape[1]} columns"
        )
    if code == _NEG_BLOCK:
        raise ValueError(
            f"block_table[{row}, {col}]={int(bt[row, col])} is negative but column {col} holds pages of "
            f"request {row}; block ids must be >= 0"
        )
    return res


def paged_kv_layout(
    seq_lens: Any,
    block_table: Any,
    page_size: int,
    *,
    indptr_out: np.ndarray | None = None,
    indices_out: np.ndarray | None = None,
    last_page_len_out: np.ndarray | None = None,
) -> PagedKV:
    """All three FlashInfer paged-KV arrays in one compiled pass over the batch (host).

    Equivalent to :func:`paged_kv_indptr`, :func:`paged_kv_indices` and :func:`paged_kv_last_page_len`
    together, reading ``seq_lens`` once.

    Parameters
    ----------
    seq_lens : (num_reqs,) int32, host
        Sequence lengths; padding rows 0.
    block_table : (rows, max_blocks_per_req) int32, host
        Physical block ids, ``rows >= num_reqs``; columns ``[0, cdiv(seq_lens[i], page_size))`` of row
        ``i`` are read and must be >= 0.
    page_size : int
        Tokens per KV page, > 0.
    indptr_out : (num_reqs + 1,) int32, host, optional
        Buffer for ``paged_kv_indptr``.
    indices_out : (num_pages(seq_lens, page_size),) int32, host, optional
        Buffer for ``paged_kv_indices``; size it with :func:`num_pages` first. Without it the total is
        counted in an extra (cheap) pass and a new array is allocated.
    last_page_len_out : (num_reqs,) int32, host, optional
        Buffer for ``paged_kv_last_page_len``.

    Returns
    -------
    PagedKV
        ``(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)``, the given buffers where passed.

    Raises
    ------
    ValueError
        A negative sequence length, a non-positive ``page_size``, too few block-table rows or columns, a
        negative block id in a used column, an int32 overflow of the total, or a wrong ``out`` buffer
        (including an ``indices_out`` whose length is not the page total).

    Examples
    --------
    >>> import numpy as np
    >>> bt = np.array([[7, 3, 9], [4, 1, 6], [0, 0, 0], [2, 5, 8]], np.int32)
    >>> seq_lens = np.array([5, 4, 0, 9], np.int32)
    >>> staging = np.empty(num_pages(seq_lens, 4), np.int32)
    >>> kv = paged_kv_layout(seq_lens, bt, 4, indices_out=staging)
    >>> kv.paged_kv_indptr
    array([0, 2, 3, 3, 6], dtype=int32)
    >>> kv.paged_kv_indices, kv.paged_kv_indices is staging
    (array([7, 3, 4, 2, 5, 8], dtype=int32), True)
    >>> kv.paged_kv_last_page_len
    array([1, 4, 0, 1], dtype=int32)
    """
    ps = _check_page_size(page_size)
    s = as_host_array(seq_lens, "seq_lens")
    n = s.shape[0]
    bt = block_table_rows(block_table, n)
    indptr = check_out(indptr_out, "paged_kv_indptr", (n + 1,), np.int32)
    last = check_out(last_page_len_out, "paged_kv_last_page_len", (n,), np.int32)
    if indices_out is None:
        indices = np.empty(_counts(s, ps)[2], np.int32)
    else:
        indices = _any_len_out(indices_out, "paged_kv_indices")
    code, row, col, total = paged_layout_nb(s, bt, ps, True, indptr, indices, last)
    if code == _OK and total != indices.shape[0]:
        code = _OUT_LEN
    if code == _NEG_BLOCK:
        raise ValueError(
            f"block_table[{row}, {col}]={int(bt[row, col])} is negative but column {col} holds tokens of "
            f"request {row} (seq_len {int(s[row])}); block ids must be >= 0"
        )
    if code == _OUT_LEN:
        total = num_pages(s, ps)
        raise ValueError(
            f"paged_kv_indices: out= must have shape ({total},) (num_pages(seq_lens, page_size)), "
            f"got {indices.shape}"
        )
    if code:
        _raise_seq(code, row, s, ps, bt.shape[1])
    return PagedKV(indptr, indices, last)


def rebase_indptr(indptr: Any, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` of an indptr, rebased to start at 0: ``indptr[start:stop+1] - indptr[start]``.

    For the prefill part ``[D, B)`` of a reordered batch: FlashInfer's prefill ``qo_indptr`` is
    ``rebase_indptr(query_start_loc_cpu, D, B)``, and TRTLLM's ``cum_seq_lens_kv`` is
    ``rebase_indptr(paged_kv_indptr, D, B)`` (host).

    Parameters
    ----------
    indptr : (num_reqs + 1,) int32, host
        Any exclusive prefix sum (``query_start_loc_cpu``, ``paged_kv_indptr``).
    start, stop : int
        First row and one past the last row, ``0 <= start <= stop <= num_reqs``.
    out : (stop - start + 1,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (stop - start + 1,) int32, host
        ``out`` if given; ``[0] == 0``.

    Raises
    ------
    ValueError
        ``start``/``stop`` out of range, or a wrong ``out``.

    Examples
    --------
    >>> import numpy as np
    >>> rebase_indptr(np.array([0, 1, 2, 9, 14], np.int32), 2, 4)
    array([ 0,  7, 12], dtype=int32)
    """
    arr = as_host_array(indptr, "indptr")
    n = arr.shape[0] - 1
    if isinstance(start, bool) or isinstance(stop, bool) or not (0 <= start <= stop <= n):
        raise ValueError(
            f"rebase_indptr: need 0 <= start <= stop <= num_reqs={n}, got start={start}, stop={stop}"
        )
    res = check_out(out, "rebase_indptr", (stop - start + 1,), np.int32)
    np.subtract(arr[start : stop + 1], arr[start], out=res)
    return res


def prefill_qo_indptr(query_start_loc: np.ndarray, num_decodes: int, *, out: np.ndarray) -> np.ndarray:
    """The prefill rows' query indptr of a reordered batch, rebased to 0, into ``out`` (host).

    ``out[:P + 1] = query_start_loc[D:] - query_start_loc[D]`` with ``P = num_reqs - D``; entries past
    ``P + 1`` (a graph-mode buffer longer than the step) repeat the last value, as zero-length rows.

    Parameters
    ----------
    query_start_loc : (num_reqs + 1,) int32, host
        The batch's query start locations.
    num_decodes : int
        Leading decode rows ``D``, ``0 <= D <= num_reqs``.
    out : (>= num_reqs - num_decodes + 1,) int32, host
        Where to write (FlashInfer's ``qo_indptr`` of its prefill part, TRTLLM's ``cum_seq_lens_q``).

    Returns
    -------
    numpy.ndarray
        ``out``.

    Examples
    --------
    >>> import numpy as np
    >>> prefill_qo_indptr(np.array([0, 1, 2, 9, 14], np.int32), 2, out=np.empty(5, np.int32))
    array([ 0,  7, 12, 12, 12], dtype=int32)
    """
    B = query_start_loc.shape[0] - 1
    P = B - num_decodes
    if P == 0:  # (no prefill rows: every entry is 0; the usual graph-mode decode step)
        out.fill(0)
        return out
    np.subtract(query_start_loc[num_decodes:], query_start_loc[num_decodes], out=out[: P + 1])
    out[P + 1 :] = out[P]
    return out
