"""Chunked local attention as virtual batches, derived on the host (docs/semantics-attention.md, "LocalAttentionMetadata (chunked local attention)").

Chunked local attention (Llama 4's ``attention_chunk_size``, ``A``) lets a token see only the KV of its
own aligned ``A``-token chunk. vLLM turns each request into "virtual" requests, one per local chunk its
queries touch, so that an ordinary varlen kernel can run them. vLLM 0.33.0 does this in host numpy but
reads ``seq_lens.cpu()`` first (a sync it keeps knowingly); attnmeta takes the host sequence lengths and
runs the whole derivation, block-table gather included, in compiled code.

For request ``i`` with ``q_i`` queries and sequence length ``s_i`` (context ``c_i = s_i - q_i``):

- ``first_i = min(A - (c_i mod A), q_i)``: queries in the first (possibly partial) local chunk;
- ``last_i = s_i mod A``, or ``A`` when that is 0: KV tokens in the last local chunk;
- ``nb_i = 1 + cdiv(q_i - first_i, A)`` virtual rows; ``num_virtual_reqs = V = sum(nb)``.

Virtual row ``v``, the ``a``-th of request ``i`` (``ra = nb_i - 1 - a`` counts from the end):

- ``q_v = first_i`` if ``a == 0``, else ``min(q_i - first_i - A*(a-1), A)``;
- ``k_v = last_i`` for the last row of the request (``ra == 0``), else ``A``;
- ``kstart_v = s_i - (ra*A + last_i)``: the first KV position of the row's chunk;
- block-table row: columns ``kstart_v // block_size + [0, A / block_size)`` of request ``i``'s row,
  each clipped to at most ``W - 1``.

**Deliberate deviation (padding rows).** A padding row (``q = 0``, ``s = 0``) yields one virtual row with
``q_v = 0``, ``k_v = A`` (as in vLLM) and ``kstart_v = -A``. vLLM turns that into negative block
columns, which numpy/torch indexing wraps around to the *end* of the block-table row. attnmeta clamps
``kstart_v`` to 0 instead, so the row reads columns ``[0, A / block_size)`` (block id 0, the null block,
for a padding row). The row has ``q_v = 0`` and is never read by a kernel, so no output changes; the
defined value keeps indices non-negative (a device gather with them is safe everywhere) and makes the
padded output independent of the block-table width (with fewer than ``A / block_size`` columns vLLM's
wrapped index is out of bounds outright). Every row with ``s > 0`` has ``kstart_v >= 0`` and matches
vLLM exactly.

Shape legend
------------
- ``num_reqs``: request rows ``B``, padding rows included (``len(seq_lens)``).
- ``num_virtual_reqs``: virtual rows ``V`` (:func:`num_virtual_reqs`).
- ``pages_per_local_block``: ``attn_chunk_size // block_size``.
- ``max_blocks_per_req``: block-table width ``W``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnmeta._checks import INT32_MAX, as_host_array, block_table_rows, check_out
from attnmeta._numba import njit

__all__ = ["LocalBatches", "local_virtual_batches", "num_virtual_reqs"]

_OK = 0
_QSL0 = 1  # query_start_loc_cpu[0] != 0
_NEG_Q = 2  # query length of row idx is negative
_NEG_S = 3  # seq_lens[idx] < 0
_S_LT_Q = 4  # seq_lens[idx] < query length
_TOO_NARROW = 5  # block table narrower than cdiv(s, block_size) for row idx
_OUT_LEN = 6  # out= buffers sized for a different V
_OVERFLOW = 7  # V overflows int32


class LocalBatches(NamedTuple):
    """The virtual batch of chunked local attention; every array is host numpy.

    Examples
    --------
    q = [1, 5, 0], s = [5, 6, 0] (the last row is padding), A = 4, block_size = 2:

    >>> import numpy as np
    >>> lb = local_virtual_batches(np.array([0, 1, 6, 6], np.int32), np.array([5, 6, 0], np.int32), 4, 2)
    >>> lb.query_start_loc, lb.seq_lens
    (array([0, 1, 4, 6, 6], dtype=int32), array([1, 4, 2, 4], dtype=int32))
    >>> lb.req_indices, lb.block_starts
    (array([0, 1, 1, 2], dtype=int32), array([2, 0, 2, 0], dtype=int32))
    """

    query_start_loc: np.ndarray
    """(num_virtual_reqs + 1,) int32, host. ``[0, cumsum(q_v)]``; ``[-1]`` equals the input's
    ``query_start_loc_cpu[-1]``."""
    seq_lens: np.ndarray
    """(num_virtual_reqs,) int32, host. KV length ``k_v`` of each virtual row, in ``[1, A]``."""
    seq_lens_upper_bound: np.ndarray
    """(num_virtual_reqs,) int32, host. The same array as ``seq_lens`` (exact here; vLLM sets the
    CAM's ``seq_lens_cpu_upper_bound`` to ``k``)."""
    max_query_len: int
    """``max(q_v)``, exact; 0 when there are no rows."""
    max_seq_len: int
    """``max(k_v)``, exact; 0 when there are no rows."""
    num_virtual_reqs: int
    """``V``, the new ``num_reqs``."""
    req_indices: np.ndarray
    """(num_virtual_reqs,) int32, host. Row of the original batch each virtual row comes from."""
    block_starts: np.ndarray
    """(num_virtual_reqs,) int32, host. First block-table column of each virtual row,
    ``max(kstart_v, 0) // block_size`` (before the ``W - 1`` clip). With ``req_indices`` this lets a
    caller gather the local block table from a device block table (vLLM's ``make_block_table``):
    ``bt[req_indices[:, None], (block_starts[:, None] + arange(pages_per_local_block)).clamp(max=W-1)]``."""
    block_table: np.ndarray | None
    """(num_virtual_reqs, pages_per_local_block) int32, host, or ``None`` when no block table was given.
    Row ``v``: ``block_table[req_indices[v], min(block_starts[v] + j, W - 1)]``."""
    pages_per_local_block: int
    """``attn_chunk_size // block_size``."""


def _check_pos_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) <= 0:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return int(value)


@njit
def _count_nb(qsl: np.ndarray, seq_lens: np.ndarray, chunk: int) -> tuple[int, int, int]:
    if qsl[0] != 0:
        return _QSL0, 0, 0
    total = 0
    for i in range(seq_lens.shape[0]):
        q = int(qsl[i + 1]) - int(qsl[i])
        s = int(seq_lens[i])
        if q < 0:
            return _NEG_Q, i, 0
        if s < 0:
            return _NEG_S, i, 0
        if s < q:
            return _S_LT_Q, i, 0
        first = min(chunk - (s - q) % chunk, q)
        total += 1 + (q - first + chunk - 1) // chunk
        if total > INT32_MAX:
            return _OVERFLOW, i, 0
    return _OK, 0, total


@njit
def _fill_nb(
    qsl: np.ndarray,
    seq_lens: np.ndarray,
    chunk: int,
    block_size: int,
    ppl: int,
    bt: np.ndarray,
    gather: bool,
    qsl_out: np.ndarray,
    k_out: np.ndarray,
    req_out: np.ndarray,
    start_out: np.ndarray,
    bt_out: np.ndarray,
) -> tuple[int, int, int, int]:
    cap = k_out.shape[0]
    width = bt.shape[1]
    if qsl[0] != 0:
        return _QSL0, 0, 0, 0
    v = 0
    cum = 0
    max_q = 0
    max_k = 0
    qsl_out[0] = 0
    for i in range(seq_lens.shape[0]):
        q = int(qsl[i + 1]) - int(qsl[i])
        s = int(seq_lens[i])
        if q < 0:
            return _NEG_Q, i, 0, 0
        if s < 0:
            return _NEG_S, i, 0, 0
        if s < q:
            return _S_LT_Q, i, 0, 0
        if gather and (s + block_size - 1) // block_size > width:
            return _TOO_NARROW, i, 0, 0
        first = min(chunk - (s - q) % chunk, q)
        last = s % chunk
        if last == 0:
            last = chunk
        nb = 1 + (q - first + chunk - 1) // chunk
        if v + nb > cap:
            return _OUT_LEN, i, 0, 0
        for a in range(nb):
            ra = nb - 1 - a
            qv = first if a == 0 else min(q - first - chunk * (a - 1), chunk)
            kv = last if ra == 0 else chunk
            kstart = s - (ra * chunk + last)
            if kstart < 0:
                kstart = 0  # padding row (s == 0): read column 0, not a wrapped negative column
            b0 = kstart // block_size
            cum += qv
            qsl_out[v + 1] = cum
            k_out[v] = kv
            req_out[v] = i
            start_out[v] = b0
            if gather:
                # Columns inside the table are copied; the rest repeat column W - 1 (vLLM's clip).
                # Zero-offset 1-D slices on both sides let LLVM vectorize the copy (memcpy speed).
                n_in = min(ppl, width - b0)
                src = bt[i, b0 : b0 + n_in]
                dst = bt_out[v]
                for j in range(n_in):
                    dst[j] = src[j]
                edge = bt[i, width - 1]
                for j in range(n_in, ppl):
                    dst[j] = edge
            if qv > max_q:
                max_q = qv
            if kv > max_k:
                max_k = kv
            v += 1
    if v != cap:
        return _OUT_LEN, seq_lens.shape[0], 0, 0
    return _OK, 0, max_q, max_k


def _inputs(query_start_loc_cpu: Any, seq_lens: Any) -> tuple[np.ndarray, np.ndarray]:
    qsl = as_host_array(query_start_loc_cpu, "query_start_loc_cpu")
    if qsl.shape[0] < 1:
        raise ValueError("query_start_loc_cpu: must have num_reqs + 1 >= 1 entries, got an empty array")
    s = as_host_array(seq_lens, "seq_lens", length=qsl.shape[0] - 1)
    return qsl, s


def _raise(code: int, idx: int, qsl: np.ndarray, s: np.ndarray, block_size: int = 0, width: int = 0) -> None:
    if code == _QSL0:
        raise ValueError(f"query_start_loc_cpu[0]={int(qsl[0])}; query start locations must begin at 0")
    if code == _NEG_Q:
        raise ValueError(
            f"query_start_loc_cpu[{idx + 1}]={int(qsl[idx + 1])} < query_start_loc_cpu[{idx}]={int(qsl[idx])} "
            f"(request {idx}); query start locations must be non-decreasing"
        )
    if code == _NEG_S:
        raise ValueError(f"seq_lens[{idx}]={int(s[idx])} is negative (request {idx}); lengths must be >= 0")
    if code == _S_LT_Q:
        q = int(qsl[idx + 1]) - int(qsl[idx])
        raise ValueError(
            f"seq_lens[{idx}]={int(s[idx])} < query_lens[{idx}]={q} (request {idx}); a sequence includes "
            f"its queries (pass exact seq_lens = num_computed_tokens + num_scheduled_tokens)"
        )
    if code == _TOO_NARROW:
        raise ValueError(
            f"block_table: row {idx} needs cdiv(seq_lens[{idx}]={int(s[idx])}, block_size={block_size})="
            f"{-(-int(s[idx]) // block_size)} columns but the table has {width} (request {idx})"
        )
    if code == _OVERFLOW:
        raise ValueError(f"num_virtual_reqs: overflows int32 at request {idx}")


def num_virtual_reqs(query_start_loc_cpu: Any, seq_lens: Any, attn_chunk_size: int) -> int:
    """Number of virtual rows ``V`` of the local-attention batch, to size staging buffers first (host).

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        Query start locations: ``[0] == 0``, non-decreasing.
    seq_lens : (num_reqs,) int32, host
        Exact sequence lengths (``>=`` each request's query length); padding rows 0.
    attn_chunk_size : int
        Local attention chunk ``A``, > 0.

    Returns
    -------
    int
        ``V = sum_i (1 + cdiv(q_i - first_i, A))``.

    Raises
    ------
    ValueError
        Malformed ``query_start_loc_cpu``, a negative or too short sequence length, a non-positive
        ``attn_chunk_size``.

    Examples
    --------
    >>> import numpy as np
    >>> num_virtual_reqs(np.array([0, 4, 14, 19, 19], np.int32), np.array([6, 17, 9, 0], np.int32), 4)
    9
    """
    chunk = _check_pos_int(attn_chunk_size, "attn_chunk_size")
    qsl, s = _inputs(query_start_loc_cpu, seq_lens)
    code, idx, total = _count_nb(qsl, s, chunk)
    if code:
        _raise(code, idx, qsl, s)
    return int(total)


_NO_TABLE = np.zeros((0, 0), np.int32)


def local_virtual_batches(
    query_start_loc_cpu: Any,
    seq_lens: Any,
    attn_chunk_size: int,
    block_size: int,
    block_table: Any = None,
    *,
    query_start_loc_out: np.ndarray | None = None,
    seq_lens_out: np.ndarray | None = None,
    req_indices_out: np.ndarray | None = None,
    block_starts_out: np.ndarray | None = None,
    block_table_out: np.ndarray | None = None,
) -> LocalBatches:
    """Split every request into its local-attention virtual rows (host, vllm 5.6 semantics).

    Same values, dtypes and shapes as vLLM 0.33.0's ``make_local_attention_virtual_batches`` (its
    ``query_start_loc_cpu``, ``seq_lens``, ``num_reqs``, ``max_query_len``, ``max_seq_len`` and
    block table), except padding rows' block columns (see the module docstring).

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        Query start locations: ``[0] == 0``, non-decreasing; padding rows repeat the last value.
    seq_lens : (num_reqs,) int32, host
        **Exact** sequence lengths ``c + q`` (not the async-spec-decode upper bound); padding rows 0.
    attn_chunk_size : int
        Local attention chunk ``A``; a positive multiple of ``block_size``.
    block_size : int
        Tokens per KV block, > 0.
    block_table : (rows, max_blocks_per_req) int32, host, optional
        The group's block table, ``rows >= num_reqs``, wide enough for every ``cdiv(seq_lens[i],
        block_size)``. Without it, ``block_table`` of the result is ``None`` (gather on the device from
        ``req_indices`` and ``block_starts``).
    query_start_loc_out : (num_virtual_reqs + 1,) int32, host, optional
    seq_lens_out, req_indices_out, block_starts_out : (num_virtual_reqs,) int32, host, optional
    block_table_out : (num_virtual_reqs, pages_per_local_block) int32, host, optional
        Buffers to write into (size them with :func:`num_virtual_reqs`). ``block_table_out`` needs
        ``block_table``.

    Returns
    -------
    LocalBatches
        The virtual batch; the given buffers where passed.

    Raises
    ------
    ValueError
        ``attn_chunk_size`` not a positive multiple of ``block_size``, malformed
        ``query_start_loc_cpu``, a negative or too short sequence length, a block table with too few
        rows or columns, wrong ``out`` buffers (sized for another ``num_virtual_reqs``).

    Examples
    --------
    docs/semantics-attention.md, "LocalAttentionMetadata (chunked local attention)": q = [4, 10, 5], s = [6, 17, 9], A = 4, block_size = 2, block rows
    ``[10i .. 10i+9]``, plus one padding row.

    >>> import numpy as np
    >>> qsl = np.array([0, 4, 14, 19, 19], np.int32)
    >>> seq_lens = np.array([6, 17, 9, 0], np.int32)
    >>> bt = np.arange(40, dtype=np.int32).reshape(4, 10)
    >>> bt[3] = 0
    >>> lb = local_virtual_batches(qsl, seq_lens, 4, 2, bt)
    >>> lb.query_start_loc
    array([ 0,  2,  4,  5,  9, 13, 14, 18, 19, 19], dtype=int32)
    >>> lb.seq_lens
    array([4, 2, 4, 4, 4, 1, 4, 1, 4], dtype=int32)
    >>> lb.num_virtual_reqs, lb.max_query_len, lb.max_seq_len
    (9, 4, 4)
    >>> lb.req_indices
    array([0, 0, 1, 1, 1, 1, 2, 2, 3], dtype=int32)
    >>> lb.block_table.tolist()
    [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25], [0, 0]]
    """
    chunk = _check_pos_int(attn_chunk_size, "attn_chunk_size")
    bs = _check_pos_int(block_size, "block_size")
    if chunk % bs:
        raise ValueError(
            f"attn_chunk_size={chunk} is not a multiple of block_size={bs}; a local chunk must span whole blocks"
        )
    ppl = chunk // bs
    qsl, s = _inputs(query_start_loc_cpu, seq_lens)
    gather = block_table is not None
    if gather:
        bt = block_table_rows(block_table, s.shape[0])
        if bt.shape[1] < 1 and s.shape[0]:
            raise ValueError(
                f"block_table: shape {bt.shape} has no columns; every virtual row reads at least one"
            )
    elif block_table_out is not None:
        raise ValueError("block_table_out: given without block_table; there is nothing to gather")
    else:
        bt = _NO_TABLE
    if query_start_loc_out is not None:
        shape: tuple[int, ...] = tuple(getattr(query_start_loc_out, "shape", ()))
        if isinstance(query_start_loc_out, np.ndarray) and (len(shape) != 1 or shape[0] < 1):
            raise ValueError(
                f"query_start_loc_out: must be 1-D with num_virtual_reqs + 1 >= 1 entries, got shape {shape}"
            )
        v = int(shape[0]) - 1 if shape else 0  # check_out below rejects what is not an array
    else:
        code, idx, v = _count_nb(qsl, s, chunk)
        if code:
            _raise(code, idx, qsl, s)
    qsl_o = check_out(query_start_loc_out, "query_start_loc", (v + 1,), np.int32)
    k_o = check_out(seq_lens_out, "seq_lens", (v,), np.int32)
    req_o = check_out(req_indices_out, "req_indices", (v,), np.int32)
    start_o = check_out(block_starts_out, "block_starts", (v,), np.int32)
    bt_o = check_out(block_table_out, "block_table", (v, ppl), np.int32) if gather else _NO_TABLE
    code, idx, max_q, max_k = _fill_nb(qsl, s, chunk, bs, ppl, bt, gather, qsl_o, k_o, req_o, start_o, bt_o)
    if code == _OUT_LEN:
        need = num_virtual_reqs(qsl, s, chunk)
        raise ValueError(
            f"query_start_loc_out: sized for num_virtual_reqs={v} but this batch has {need} virtual rows; "
            f"size the buffers with num_virtual_reqs(...)"
        )
    if code:
        _raise(code, idx, qsl, s, bs, bt.shape[1])
    return LocalBatches(
        query_start_loc=qsl_o,
        seq_lens=k_o,
        seq_lens_upper_bound=k_o,
        max_query_len=int(max_q),
        max_seq_len=int(max_k),
        num_virtual_reqs=v,
        req_indices=req_o,
        block_starts=start_o,
        block_table=bt_o if gather else None,
        pages_per_local_block=ppl,
    )
