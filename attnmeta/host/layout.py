"""Host derivations of one step's request and token layout.

Everything here is numpy in, numpy out, computed by numba kernels in one pass over the requests or
tokens; nothing imports torch. Each public function validates its inputs (a ``ValueError`` or
``TypeError`` that names the field, the row and the rule), allocates its output with an explicit dtype
or writes into a caller's ``out=`` buffer (for instance a view into the step's pinned staging
buffer), and matches vLLM 0.33.0 value for value, dtype for dtype (docs/semantics.md, "How a step is
derived" and "Context parallelism"; docs/semantics-mamba.md, "Prefill query starts and contexts").

Padding sentinels (docs/semantics.md, "CUDA-graph padding"): request rows past ``num_reqs`` get
``query_start_loc`` repeating its last value, ``seq_lens`` 0 and ``is_prefilling`` False; tokens past
``num_tokens`` get ``positions`` 0 and ``slot_mapping`` :data:`PAD_SLOT_ID` (-1).

When a function raises, the contents of an ``out=`` buffer it was given are unspecified.

Why one module
--------------
Its functions are one derivation seen from several sides: the token layout (positions, slot
mapping) reads the query starts and sequence lengths computed here, and the common pass
(:mod:`attnmeta.host.common`) composes the same kernels. Each public function is a short kernel plus
its validating wrapper and worked example, which is most of the length.

Shape legend
------------
- ``num_reqs``: real requests (``len(num_scheduled_tokens)``).
- ``num_reqs_padded``: request rows including CUDA-graph padding rows (``>= num_reqs``; default
  ``num_reqs``).
- ``num_tokens``: real tokens, ``sum(num_scheduled_tokens)``.
- ``num_tokens_padded``: tokens including CUDA-graph padding tokens (``>= num_tokens``; default
  ``num_tokens``).
- ``max_blocks_per_req``: block-table width.
- ``world_size``: context-parallel (DCP x PCP) world size.
- ``num_prefills``: prefill rows, the last rows of the batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from attnmeta._checks import INT32_MAX, as_host_array, block_table_rows, check_out
from attnmeta._intdiv import div_by, pow2_shift
from attnmeta._numba import njit
from attnmeta.spec import ContextParallel

__all__ = [
    "PAD_SLOT_ID",
    "dcp_local_seq_lens",
    "is_prefilling",
    "positions",
    "prefill_cpu_metadata",
    "query_positions",
    "query_start_loc",
    "seq_lens",
    "slot_mapping",
    "token_layout",
    "token_req_indices",
]

PAD_SLOT_ID = -1
"""Slot-mapping value of padding tokens and of tokens another context-parallel rank stores."""

# Kernel status codes. Kernels report a code plus the offending row (and column); the wrappers turn
# them into messages, so no kernel ever formats a string.
_OK = 0
_NEG_COMPUTED = 1
_NEG_SCHEDULED = 2
_OVERFLOW = 3
_TOO_NARROW = 4
_NEG_BLOCK = 5
_OUT_TOO_SHORT = 6
_NEG_PROMPT = 7
_NEG_SEQ_LEN = 8
_NEG_CONTEXT = 9

_NO_I64 = np.empty(0, dtype=np.int64)
_NO_I32 = np.empty(0, dtype=np.int32)
_NO_TABLE = np.empty((0, 0), dtype=np.int32)


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------


@njit
def _query_start_loc_nb(q: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """out[0] = 0, out[i + 1] = out[i] + q[i]; rows past len(q) repeat the total."""
    n = q.shape[0]
    acc = np.int64(0)
    out[0] = 0
    for i in range(n):
        qi = np.int64(q[i])
        if qi < 0:
            return _NEG_SCHEDULED, i
        acc += qi
        if acc > INT32_MAX:
            return _OVERFLOW, i
        out[i + 1] = acc
    for j in range(n + 1, out.shape[0]):
        out[j] = acc
    return _OK, -1


@njit
def _seq_lens_nb(c: np.ndarray, q: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """out[i] = c[i] + q[i]; rows past len(q) are 0."""
    n = q.shape[0]
    for i in range(n):
        ci = np.int64(c[i])
        qi = np.int64(q[i])
        if ci < 0:
            return _NEG_COMPUTED, i
        if qi < 0:
            return _NEG_SCHEDULED, i
        s = ci + qi
        if s > INT32_MAX:
            return _OVERFLOW, i
        out[i] = s
    for j in range(n, out.shape[0]):
        out[j] = 0
    return _OK, -1


@njit
def _is_prefilling_nb(c: np.ndarray, prompt: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """out[i] = c[i] < prompt[i]; rows past len(c) are False."""
    n = c.shape[0]
    for i in range(n):
        if c[i] < 0:
            return _NEG_COMPUTED, i
        if prompt[i] < 0:
            return _NEG_PROMPT, i
        out[i] = c[i] < prompt[i]
    for j in range(n, out.shape[0]):
        out[j] = False
    return _OK, -1


@njit
def _token_index_nb(
    q: np.ndarray, do_req: bool, do_qpos: bool, req_out: np.ndarray, qpos_out: np.ndarray
) -> tuple[int, int]:
    """Per token: its request row (req_out) and its index inside the request (qpos_out)."""
    n = q.shape[0]
    cap = req_out.shape[0] if do_req else qpos_out.shape[0]
    t = np.int64(0)
    for i in range(n):
        qi = np.int64(q[i])
        if qi < 0:
            return _NEG_SCHEDULED, i
        if t + qi > cap:
            return _OUT_TOO_SHORT, i
        for k in range(qi):
            if do_req:
                req_out[t + k] = i
            if do_qpos:
                qpos_out[t + k] = k
        t += qi
    return _OK, -1


@njit
def _token_layout_nb(
    c: np.ndarray,
    q: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int,
    do_pos: bool,
    do_slot: bool,
    pos_out: np.ndarray,
    slot_out: np.ndarray,
) -> tuple[int, int, int]:
    """Positions and/or slot mapping in one pass over tokens; tokens past the real ones are padding.

    Returns ``(status, row, column)``.
    """
    n = q.shape[0]
    cap = pos_out.shape[0] if do_pos else slot_out.shape[0]
    width = block_table.shape[1]
    span = np.int64(block_size) * world_size  # tokens of one virtual block (all ranks)
    stripe = np.int64(world_size) * interleave
    sh_span = pow2_shift(span)  # shifts instead of divisions for power-of-two sizes (attnmeta._intdiv)
    sh_bs = pow2_shift(block_size)
    t = np.int64(0)
    for i in range(n):
        ci = np.int64(c[i])
        qi = np.int64(q[i])
        if ci < 0:
            return _NEG_COMPUTED, i, 0
        if qi < 0:
            return _NEG_SCHEDULED, i, 0
        if t + qi > cap:
            return _OUT_TOO_SHORT, i, 0
        if qi == 0:
            continue
        if do_pos:
            for k in range(qi):
                pos_out[t + k] = ci + k
        if do_slot:
            last_col = div_by(ci + qi - 1, span, sh_span)
            if last_col >= width:
                return _TOO_NARROW, i, int(last_col)
            if world_size == 1:
                # Walk the blocks instead of dividing per token.
                col = div_by(ci, block_size, sh_bs)
                off = ci - col * block_size
                blk = np.int64(block_table[i, col])
                if blk < 0:
                    return _NEG_BLOCK, i, int(col)
                base = blk * block_size
                for k in range(qi):
                    slot_out[t + k] = base + off
                    off += 1
                    if off == block_size and k + 1 < qi:
                        off = np.int64(0)
                        col += 1
                        blk = np.int64(block_table[i, col])
                        if blk < 0:
                            return _NEG_BLOCK, i, int(col)
                        base = blk * block_size
            else:
                for k in range(qi):
                    p = ci + k
                    vb = p // span
                    o = p - vb * span
                    if (o // interleave) % world_size == rank:
                        blk = np.int64(block_table[i, vb])
                        if blk < 0:
                            return _NEG_BLOCK, i, int(vb)
                        slot_out[t + k] = blk * block_size + (o // stripe) * interleave + o % interleave
                    else:
                        slot_out[t + k] = PAD_SLOT_ID
        t += qi
    for j in range(t, cap):
        if do_pos:
            pos_out[j] = 0
        if do_slot:
            slot_out[j] = PAD_SLOT_ID
    return _OK, -1, -1


@njit
def _dcp_local_seq_lens_nb(
    s: np.ndarray, world_size: int, rank: int, interleave: int, out: np.ndarray
) -> tuple[int, int]:
    """out[i, j] = local length on rank ``rank + j`` (out is (B, 1) for one rank, (B, W) for all)."""
    n = s.shape[0]
    ranks = out.shape[1]
    for i in range(n):
        si = np.int64(s[i])
        if si < 0:
            return _NEG_SEQ_LEN, i
        base = si // interleave // world_size * interleave
        rem = si - base * world_size
        for j in range(ranks):
            extra = rem - (rank + j) * np.int64(interleave)
            if extra < 0:
                extra = np.int64(0)
            elif extra > interleave:
                extra = np.int64(interleave)
            out[i, j] = base + extra
    return _OK, -1


@njit
def _prefill_cpu_metadata_nb(
    qsl: np.ndarray,
    upper: np.ndarray,
    num_reqs: int,
    num_decode_tokens: int,
    ctx_out: np.ndarray,
    qsl_out: np.ndarray,
) -> tuple[int, int]:
    """qsl_out = qsl[B-P:] - Dt and ctx_out = upper[B-P:B] - diff(qsl_out), computed in int64."""
    p = ctx_out.shape[0]
    first = num_reqs - p
    qsl_out[0] = np.int64(qsl[first]) - num_decode_tokens
    for k in range(p):
        lo = np.int64(qsl[first + k])
        hi = np.int64(qsl[first + k + 1])
        qsl_out[k + 1] = hi - num_decode_tokens
        ctx = np.int64(upper[first + k]) - (hi - lo)
        if ctx < 0:
            return _NEG_CONTEXT, first + k
        ctx_out[k] = ctx
    return _OK, -1


# --------------------------------------------------------------------------------------------------
# validation helpers (host scalars only; O(1) except the one sum in _num_tokens)
# --------------------------------------------------------------------------------------------------


def _int_arg(value: Any, name: str, *, minimum: int = 0) -> int:
    """``value`` as a Python int ``>= minimum``; bools and floats are rejected."""
    if type(value) is int:  # the common case, checked first: these wrappers run every step
        v = value
    elif isinstance(value, np.integer):
        v = int(value)
    else:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if v < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")
    return v


def _padding(value: Any, name: str, minimum: int, what: str) -> int:
    """A padded size: ``minimum`` when None, else an int ``>= minimum``."""
    if value is None:
        return minimum
    v = _int_arg(value, name)
    if v < minimum:
        raise ValueError(f"{name}={v} < {what}={minimum}; padding can only add, never drop")
    return v


def _counts(num_scheduled_tokens: Any, num_computed_tokens: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(c, q) as int32 host arrays of equal length (c is empty when not given)."""
    if num_computed_tokens is None:
        return _NO_I32, as_host_array(num_scheduled_tokens, "num_scheduled_tokens")
    c = as_host_array(num_computed_tokens, "num_computed_tokens")
    q = as_host_array(num_scheduled_tokens, "num_scheduled_tokens", length=c.shape[0])
    return c, q


def _num_tokens(q: np.ndarray) -> int:
    """``sum(q)``, which must fit int32 (negative entries are reported by the kernels)."""
    total = int(q.sum(dtype=np.int64))
    if total > INT32_MAX:
        raise ValueError(f"num_scheduled_tokens: total {total} overflows int32")
    return max(total, 0)


def _block_args(block_table: Any, block_size: Any, num_reqs: int) -> tuple[np.ndarray, int]:
    bt = block_table_rows(block_table, num_reqs)
    bs = _int_arg(block_size, "block_size", minimum=1)
    return bt, bs


def _cp_args(cp: ContextParallel | None, block_size: int) -> tuple[int, int, int]:
    """(world_size, rank, interleave); ``None`` is plain (1, 0, 1)."""
    if cp is None:
        return 1, 0, 1
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"context_parallel: expected ContextParallel or None, got {type(cp).__name__}")
    world = _int_arg(cp.world_size, "context_parallel.world_size", minimum=1)
    rank = _int_arg(cp.rank, "context_parallel.rank")
    inter = _int_arg(cp.interleave, "context_parallel.interleave", minimum=1)
    if rank >= world:
        raise ValueError(f"context_parallel: need 0 <= rank < world_size, got {cp}")
    if block_size % inter:
        raise ValueError(f"context_parallel.interleave={inter} must divide block_size={block_size}")
    return world, rank, inter


def _raise(
    code: int,
    row: int,
    col: int = -1,
    *,
    c: np.ndarray | None = None,
    q: np.ndarray | None = None,
    prompt: np.ndarray | None = None,
    block_table: np.ndarray | None = None,
    span: int = 1,
) -> None:
    """Turn a kernel status into the ValueError it stands for (no-op for ``_OK``)."""
    if code == _OK:
        return
    i = row
    if code == _OUT_TOO_SHORT and q is not None and (q < 0).any():
        # The output was sized from sum(q), which a negative count further on made too small.
        code, i = _NEG_SCHEDULED, int(np.argmax(q < 0))
    if code == _NEG_COMPUTED and c is not None:
        raise ValueError(
            f"num_computed_tokens[{i}]={int(c[i])} is negative (request {i}); counts must be >= 0"
        )
    if code == _NEG_SCHEDULED and q is not None:
        raise ValueError(
            f"num_scheduled_tokens[{i}]={int(q[i])} is negative (request {i}); counts must be >= 0"
        )
    if code == _NEG_PROMPT and prompt is not None:
        raise ValueError(f"num_prompt_tokens[{i}]={int(prompt[i])} is negative (request {i}); counts must be >= 0")
    if code == _OVERFLOW and q is not None:
        if c is not None and c.shape[0]:
            s = int(c[i]) + int(q[i])
            raise ValueError(
                f"seq_lens[{i}]=num_computed_tokens[{i}]+num_scheduled_tokens[{i}]={s} overflows int32 "
                f"(request {i})"
            )
        raise ValueError(
            f"query_start_loc[{i + 1}]: the running sum of num_scheduled_tokens overflows int32 at "
            f"request {i}"
        )
    if code == _TOO_NARROW and block_table is not None and c is not None and q is not None:
        s = int(c[i]) + int(q[i])
        raise ValueError(
            f"block_table: request {i} (seq_len {s}) reads column {col} = (seq_len - 1) // {span} but the "
            f"table has {block_table.shape[1]} columns; it needs cdiv(seq_len, {span}) columns"
        )
    if code == _NEG_BLOCK and block_table is not None:
        raise ValueError(
            f"block_table[{i}, {col}]={int(block_table[i, col])} is negative but column {col} holds tokens "
            f"of request {i}; block ids must be >= 0"
        )
    raise AssertionError(f"internal: kernel status {code} at row {row}, column {col}")  # pragma: no cover


# --------------------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------------------


def query_start_loc(
    num_scheduled_tokens: npt.ArrayLike,
    *,
    num_reqs_padded: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Exclusive prefix sum of the query lengths (vLLM ``query_start_loc``).

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled for each request this step (``q``); 0 is allowed.
    num_reqs_padded : int, optional
        Request rows including CUDA-graph padding (``>= num_reqs``); defaults to ``num_reqs``.
    out : (num_reqs_padded + 1,) int32, host, optional
        Buffer to write into (for instance a view of the step's pinned staging buffer).

    Returns
    -------
    (num_reqs_padded + 1,) int32, host
        ``out[0] == 0``, ``out[i + 1] == out[i] + q[i]``; padding rows repeat the last value, so their
        query length is 0.

    Raises
    ------
    TypeError
        An input is a torch tensor or not an integer array.
    ValueError
        A negative count, a total that overflows int32, ``num_reqs_padded < num_reqs``, or an
        ``out`` of the wrong shape or dtype.

    Examples
    --------
    >>> query_start_loc([1, 4, 2])
    array([0, 1, 5, 7], dtype=int32)
    >>> query_start_loc([1, 4, 2], num_reqs_padded=5)
    array([0, 1, 5, 7, 7, 7], dtype=int32)
    """
    _, q = _counts(num_scheduled_tokens)
    n = q.shape[0]
    rows = _padding(num_reqs_padded, "num_reqs_padded", n, "num_reqs")
    res = check_out(out, "query_start_loc", (rows + 1,), np.int32)
    code, row = _query_start_loc_nb(q, res)
    _raise(code, row, q=q)
    return res


def seq_lens(
    num_computed_tokens: npt.ArrayLike,
    num_scheduled_tokens: npt.ArrayLike,
    *,
    num_reqs_padded: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Sequence length of each request after this step, ``c + q`` (vLLM ``seq_lens``).

    Parameters
    ----------
    num_computed_tokens : (num_reqs,) int32, host
        Tokens already in the KV cache / state (``c``).
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled this step (``q``).
    num_reqs_padded : int, optional
        Request rows including CUDA-graph padding (``>= num_reqs``); defaults to ``num_reqs``.
    out : (num_reqs_padded,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs_padded,) int32, host
        ``c[i] + q[i]`` for real rows, 0 for padding rows.

    Raises
    ------
    TypeError
        An input is a torch tensor or not an integer array.
    ValueError
        Length mismatch, a negative count, ``c + q`` overflowing int32, ``num_reqs_padded <
        num_reqs``, or a bad ``out``.

    Examples
    --------
    >>> seq_lens([5, 0, 7], [1, 4, 2], num_reqs_padded=4)
    array([6, 4, 9, 0], dtype=int32)
    """
    c, q = _counts(num_scheduled_tokens, num_computed_tokens)
    n = q.shape[0]
    rows = _padding(num_reqs_padded, "num_reqs_padded", n, "num_reqs")
    res = check_out(out, "seq_lens", (rows,), np.int32)
    code, row = _seq_lens_nb(c, q, res)
    _raise(code, row, c=c, q=q)
    return res


def is_prefilling(
    num_computed_tokens: npt.ArrayLike,
    num_prompt_tokens: npt.ArrayLike,
    *,
    num_reqs_padded: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Whether each request is still prefilling its prompt, ``c < P`` (vLLM ``is_prefilling``).

    Parameters
    ----------
    num_computed_tokens : (num_reqs,) int32, host
        Tokens already in the KV cache / state (``c``).
    num_prompt_tokens : (num_reqs,) int32, host
        Prompt length of each request (``P``).
    num_reqs_padded : int, optional
        Request rows including CUDA-graph padding (``>= num_reqs``); defaults to ``num_reqs``.
    out : (num_reqs_padded,) bool, host, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs_padded,) bool, host
        ``c[i] < P[i]`` for real rows, False for padding rows.

    Raises
    ------
    TypeError
        An input is a torch tensor or not an integer array.
    ValueError
        Length mismatch, a negative count, ``num_reqs_padded < num_reqs``, or a bad ``out``.

    Examples
    --------
    >>> is_prefilling([5, 0, 7], [3, 8, 9], num_reqs_padded=4)
    array([False,  True,  True, False])
    """
    c = as_host_array(num_computed_tokens, "num_computed_tokens")
    prompt = as_host_array(num_prompt_tokens, "num_prompt_tokens", length=c.shape[0])
    rows = _padding(num_reqs_padded, "num_reqs_padded", c.shape[0], "num_reqs")
    res = check_out(out, "is_prefilling", (rows,), np.bool_)
    code, row = _is_prefilling_nb(c, prompt, res)
    _raise(code, row, c=c, prompt=prompt)
    return res


def token_req_indices(num_scheduled_tokens: npt.ArrayLike, *, out: np.ndarray | None = None) -> np.ndarray:
    """Request row of every scheduled token (vLLM's ``req_indices``, ``repeat(arange(B), q)``).

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled for each request this step (``q``).
    out : (num_tokens,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_tokens,) int32, host
        ``i`` repeated ``q[i]`` times, in request order.

    Raises
    ------
    TypeError
        An input is a torch tensor or not an integer array.
    ValueError
        A negative count, a total that overflows int32, or a bad ``out``.

    Examples
    --------
    >>> token_req_indices([1, 0, 3, 2])
    array([0, 2, 2, 2, 3, 3], dtype=int32)
    """
    _, q = _counts(num_scheduled_tokens)
    res = check_out(out, "token_req_indices", (_num_tokens(q),), np.int32)
    code, row = _token_index_nb(q, True, False, res, _NO_I32)
    _raise(code, row, q=q)
    return res


def query_positions(num_scheduled_tokens: npt.ArrayLike, *, out: np.ndarray | None = None) -> np.ndarray:
    """Index of every scheduled token inside its request's query (the per-request arange).

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled for each request this step (``q``).
    out : (num_tokens,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_tokens,) int32, host
        ``0, 1, ..., q[i] - 1`` for each request in turn.

    Raises
    ------
    TypeError
        An input is a torch tensor or not an integer array.
    ValueError
        A negative count, a total that overflows int32, or a bad ``out``.

    Examples
    --------
    >>> query_positions([1, 0, 3, 2])
    array([0, 0, 1, 2, 0, 1], dtype=int32)
    """
    _, q = _counts(num_scheduled_tokens)
    res = check_out(out, "query_positions", (_num_tokens(q),), np.int32)
    code, row = _token_index_nb(q, False, True, _NO_I32, res)
    _raise(code, row, q=q)
    return res


def positions(
    num_computed_tokens: npt.ArrayLike,
    num_scheduled_tokens: npt.ArrayLike,
    *,
    num_tokens_padded: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Absolute position of every scheduled token, ``c[req] + query_pos`` (vLLM ``positions``).

    Parameters
    ----------
    num_computed_tokens : (num_reqs,) int32, host
        Tokens already in the KV cache / state (``c``).
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled this step (``q``).
    num_tokens_padded : int, optional
        Tokens including CUDA-graph padding (``>= num_tokens``); defaults to ``num_tokens``.
    out : (num_tokens_padded,) int64, host, optional
        Buffer to write into.

    Returns
    -------
    (num_tokens_padded,) int64, host
        ``c[i], c[i] + 1, ..., c[i] + q[i] - 1`` for each request in turn; padding tokens are 0
        (attnmeta's sentinel: vLLM leaves whatever its persistent buffer held there).

    Raises
    ------
    TypeError
        An input is a torch tensor or not an integer array.
    ValueError
        Length mismatch, a negative count, ``num_tokens_padded < num_tokens``, or a bad ``out``.

    Examples
    --------
    >>> positions([5, 0, 7], [1, 4, 2], num_tokens_padded=8)
    array([5, 0, 1, 2, 3, 7, 8, 0])
    """
    c, q = _counts(num_scheduled_tokens, num_computed_tokens)
    total = _padding(num_tokens_padded, "num_tokens_padded", _num_tokens(q), "num_tokens")
    res = check_out(out, "positions", (total,), np.int64)
    code, row, col = _token_layout_nb(c, q, _NO_TABLE, 1, 1, 0, 1, True, False, res, _NO_I64)
    _raise(code, row, col, c=c, q=q)
    return res


def slot_mapping(
    num_computed_tokens: npt.ArrayLike,
    num_scheduled_tokens: npt.ArrayLike,
    block_table: npt.ArrayLike,
    block_size: int,
    *,
    num_tokens_padded: int | None = None,
    context_parallel: ContextParallel | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """KV-cache slot of every scheduled token (vLLM ``slot_mapping``, docs/semantics.md, "Block table and slot mapping").

    For request ``i`` and a token at position ``p``:

    - plain: ``block_table[i, p // block_size] * block_size + p % block_size``;
    - context parallel (world size ``W``, rank ``r``, interleave ``I``): with ``V = block_size * W``,
      ``o = p % V``, the token is stored on this rank iff ``(o // I) % W == r``, at
      ``block_table[i, p // V] * block_size + (o // (W * I)) * I + o % I``; otherwise its slot is -1.
      ``W == 1`` is the plain layout.

    Parameters
    ----------
    num_computed_tokens : (num_reqs,) int32, host
        Tokens already in the KV cache / state (``c``).
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled this step (``q``).
    block_table : (>= num_reqs, max_blocks_per_req) int32, host
        Physical block ids; row ``i`` is read in columns ``[c[i] // V, (c[i] + q[i] - 1) // V]``,
        which must be ``>= 0``. Rows past ``num_reqs`` are never read.
    block_size : int
        Tokens per KV block.
    num_tokens_padded : int, optional
        Tokens including CUDA-graph padding (``>= num_tokens``); defaults to ``num_tokens``.
    context_parallel : ContextParallel, optional
        DCP/PCP layout of this rank; ``None`` is the plain layout.
    out : (num_tokens_padded,) int64, host, optional
        Buffer to write into.

    Returns
    -------
    (num_tokens_padded,) int64, host
        The slot of each token; :data:`PAD_SLOT_ID` (-1) for padding tokens and for tokens another
        context-parallel rank stores.

    Raises
    ------
    TypeError
        An input is a torch tensor or not an integer array; ``context_parallel`` has the wrong type.
    ValueError
        Length mismatch, a negative count, a block table with too few rows or columns or a negative
        block id where it is read, a bad ``block_size`` or ``context_parallel``, ``num_tokens_padded <
        num_tokens``, or a bad ``out``.

    Examples
    --------
    >>> bt = [[10, 11, 0], [20, 0, 0], [30, 31, 32]]
    >>> slot_mapping([5, 0, 7], [1, 4, 2], bt, 4, num_tokens_padded=8)
    array([ 45,  80,  81,  82,  83, 127, 128,  -1])
    >>> slot_mapping([5, 0, 7], [1, 4, 2], bt, 4, context_parallel=ContextParallel(2, 1))
    array([ 42,  -1,  80,  -1,  81, 123,  -1])
    """
    c, q = _counts(num_scheduled_tokens, num_computed_tokens)
    bt, bs = _block_args(block_table, block_size, q.shape[0])
    world, rank, inter = _cp_args(context_parallel, bs)
    total = _padding(num_tokens_padded, "num_tokens_padded", _num_tokens(q), "num_tokens")
    res = check_out(out, "slot_mapping", (total,), np.int64)
    code, row, col = _token_layout_nb(c, q, bt, bs, world, rank, inter, False, True, _NO_I64, res)
    _raise(code, row, col, c=c, q=q, block_table=bt, span=bs * world)
    return res


def token_layout(
    num_computed_tokens: npt.ArrayLike,
    num_scheduled_tokens: npt.ArrayLike,
    block_table: npt.ArrayLike,
    block_size: int,
    *,
    num_tokens_padded: int | None = None,
    context_parallel: ContextParallel | None = None,
    positions_out: np.ndarray | None = None,
    slot_mapping_out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`positions` and :func:`slot_mapping` together, in one pass over the tokens.

    The step build needs both every step; this validates the inputs once and walks the tokens once.
    The values are exactly those of the two separate functions.

    Parameters
    ----------
    num_computed_tokens : (num_reqs,) int32, host
        Tokens already in the KV cache / state (``c``).
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled this step (``q``).
    block_table : (>= num_reqs, max_blocks_per_req) int32, host
        Physical block ids (see :func:`slot_mapping` for which entries are read).
    block_size : int
        Tokens per KV block.
    num_tokens_padded : int, optional
        Tokens including CUDA-graph padding (``>= num_tokens``); defaults to ``num_tokens``.
    context_parallel : ContextParallel, optional
        DCP/PCP layout of this rank; ``None`` is the plain layout.
    positions_out : (num_tokens_padded,) int64, host, optional
        Buffer for the positions.
    slot_mapping_out : (num_tokens_padded,) int64, host, optional
        Buffer for the slot mapping.

    Returns
    -------
    positions : (num_tokens_padded,) int64, host
        As :func:`positions` (padding tokens 0).
    slot_mapping : (num_tokens_padded,) int64, host
        As :func:`slot_mapping` (padding and non-local tokens -1).

    Raises
    ------
    TypeError
        As :func:`slot_mapping`.
    ValueError
        As :func:`slot_mapping`.

    Examples
    --------
    >>> bt = [[10, 11, 0], [20, 0, 0], [30, 31, 32]]
    >>> pos, slots = token_layout([5, 0, 7], [1, 4, 2], bt, 4, num_tokens_padded=8)
    >>> pos
    array([5, 0, 1, 2, 3, 7, 8, 0])
    >>> slots
    array([ 45,  80,  81,  82,  83, 127, 128,  -1])
    """
    c, q = _counts(num_scheduled_tokens, num_computed_tokens)
    bt, bs = _block_args(block_table, block_size, q.shape[0])
    world, rank, inter = _cp_args(context_parallel, bs)
    total = _padding(num_tokens_padded, "num_tokens_padded", _num_tokens(q), "num_tokens")
    pos = check_out(positions_out, "positions", (total,), np.int64)
    slots = check_out(slot_mapping_out, "slot_mapping", (total,), np.int64)
    code, row, col = _token_layout_nb(c, q, bt, bs, world, rank, inter, True, True, pos, slots)
    _raise(code, row, col, c=c, q=q, block_table=bt, span=bs * world)
    return pos, slots


def dcp_local_seq_lens(
    seq_lens: npt.ArrayLike,
    world_size: int,
    rank: int | None = None,
    interleave: int = 1,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Tokens of each sequence stored on one (or every) context-parallel rank (docs/semantics.md, "Context parallelism").

    With ``base = (S // I // W) * I`` and ``rem = S - base * W``, rank ``r`` holds
    ``base + clip(rem - r * I, 0, I)`` tokens of a sequence of length ``S``.

    Parameters
    ----------
    seq_lens : (num_reqs,) int32, host
        Sequence lengths ``S`` (vLLM passes ``seq_lens_cpu_upper_bound``).
    world_size : int
        Context-parallel world size ``W`` (``>= 1``).
    rank : int, optional
        The rank ``r`` (``0 <= rank < world_size``); ``None`` computes every rank.
    interleave : int
        Interleave size ``I`` (``>= 1``): consecutive tokens stored on one rank.
    out : (num_reqs,) or (num_reqs, world_size) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs,) int32, host
        When ``rank`` is given.
    (num_reqs, world_size) int32, host
        When ``rank`` is None; column ``r`` is rank ``r`` (``(num_reqs, 1)`` for one rank, as vLLM's
        ``get_dcp_local_seq_lens``, which does not squeeze).

    Raises
    ------
    TypeError
        ``seq_lens`` is a torch tensor or not an integer array; a scalar argument is not an int.
    ValueError
        A negative length, ``world_size < 1``, ``interleave < 1``, ``rank`` out of range, or a bad
        ``out``.

    Examples
    --------
    >>> dcp_local_seq_lens([7, 8, 1], 2, rank=1, interleave=2)
    array([3, 4, 0], dtype=int32)
    >>> dcp_local_seq_lens([7, 8, 1], 2, interleave=2)
    array([[4, 3],
           [4, 4],
           [1, 0]], dtype=int32)
    """
    s = as_host_array(seq_lens, "seq_lens")
    world = _int_arg(world_size, "world_size", minimum=1)
    inter = _int_arg(interleave, "interleave", minimum=1)
    n = s.shape[0]
    if rank is None:
        res = check_out(out, "dcp_local_seq_lens", (n, world), np.int32)
        code, row = _dcp_local_seq_lens_nb(s, world, 0, inter, res)
    else:
        r = _int_arg(rank, "rank")
        if r >= world:
            raise ValueError(f"rank: need 0 <= rank < world_size={world}, got {r}")
        res = check_out(out, "dcp_local_seq_lens", (n,), np.int32)
        code, row = _dcp_local_seq_lens_nb(s, world, r, inter, res.reshape(n, 1))
    if code != _OK:
        raise ValueError(f"seq_lens[{row}]={int(s[row])} is negative (request {row}); lengths must be >= 0")
    return res


def prefill_cpu_metadata(
    query_start_loc_cpu: npt.ArrayLike,
    seq_lens_upper_bound: npt.ArrayLike,
    *,
    num_reqs: int,
    num_prefills: int,
    num_decode_tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Context lengths and query starts of the prefill rows, from host data (docs/semantics-mamba.md, "Prefill query starts and contexts").

    The prefill rows are the last ``num_prefills`` rows of a reordered batch. Their query starts are
    ``query_start_loc_cpu[num_reqs - num_prefills:] - num_decode_tokens`` and their computed-token
    counts ``seq_lens_upper_bound[num_reqs - num_prefills:] - q_p``; the upper bound is exact for
    prefill rows, so no device read is needed.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        Query start offsets of the (padded) batch.
    seq_lens_upper_bound : (num_reqs,) int32, host
        ``seq_lens_cpu_upper_bound`` of the batch (exact on prefill rows).
    num_reqs : int
        Request rows, padding included.
    num_prefills : int
        Prefill rows (``0 <= num_prefills <= num_reqs``), from the split.
    num_decode_tokens : int
        Decode tokens, from the split.

    Returns
    -------
    num_computed_tokens_p : (num_prefills,) int32, host
        Tokens already computed for each prefill row.
    query_start_loc_p : (num_prefills + 1,) int32, host
        Query start offsets of the prefill rows, relative to the first prefill token.

    Raises
    ------
    TypeError
        An array is a torch tensor or not an integer array; a scalar is not an int.
    ValueError
        Wrong lengths, ``num_prefills`` out of range, a negative ``num_decode_tokens``, or an upper
        bound below a prefill row's query length.

    Examples
    --------
    >>> prefill_cpu_metadata([0, 1, 2, 7, 10], [9, 4, 5, 8], num_reqs=4, num_prefills=2,
    ...                      num_decode_tokens=2)
    (array([0, 5], dtype=int32), array([0, 5, 8], dtype=int32))
    """
    b = _int_arg(num_reqs, "num_reqs")
    p = _int_arg(num_prefills, "num_prefills")
    dt = _int_arg(num_decode_tokens, "num_decode_tokens")
    if dt > INT32_MAX:
        raise ValueError(f"num_decode_tokens={dt} overflows int32")
    if p > b:
        raise ValueError(f"num_prefills={p} > num_reqs={b}")
    qsl = as_host_array(query_start_loc_cpu, "query_start_loc_cpu", length=b + 1)
    upper = as_host_array(seq_lens_upper_bound, "seq_lens_upper_bound", length=b)
    ctx = np.empty(p, dtype=np.int32)
    qsl_p = np.empty(p + 1, dtype=np.int32)
    code, row = _prefill_cpu_metadata_nb(qsl, upper, b, dt, ctx, qsl_p)
    if code != _OK:
        q_row = int(qsl[row + 1]) - int(qsl[row])
        raise ValueError(
            f"seq_lens_upper_bound[{row}]={int(upper[row])} < query length {q_row} of prefill request "
            f"{row}; an upper bound must be >= num_computed_tokens + num_scheduled_tokens"
        )
    return ctx, qsl_p
