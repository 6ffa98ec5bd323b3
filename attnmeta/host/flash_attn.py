"""FlashAttention (and FlashInfer) host helpers: DCP context lengths and per-request causal flags.

docs/semantics.md, "Context parallelism"; docs/semantics-attention.md, "FlashAttentionMetadata". With decode context parallelism (DCP, world size ``W``, this
rank ``r``, interleave ``I``), each rank holds only part of every request's KV cache, and the
FlashAttention builder attends to the *context* (``seq_lens - query_lens``; the new tokens are attended
separately) through the rank's local share of it. vLLM 0.33.0 computes those local lengths on the
device; they are plain host arithmetic, so attnmeta derives them on the host:

``local(S) = base + clip(S - base*W - r*I, 0, I)`` with ``base = (S // I // W) * I``.

``max_dcp_context_kv_len`` is the upper bound ``cdiv(max_seq_len, W*I) * I`` vLLM uses instead of the
old ``.max().item()`` sync, or 0 when no row has context (:func:`dcp_context_is_empty`). Under DCP the
builder also counts the decode rows and the rows whose context it attends to
(:func:`dcp_context_split`). FlashAttention also needs a per-request ``causal`` array to be int32
(:func:`causal_per_request`).

Shape legend
------------
- ``num_reqs``: request rows ``B``, padding rows included (``len(seq_lens)``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from attnmeta._checks import as_host_array, check_out, reject_tensor
from attnmeta._numba import njit
from attnmeta.host.split import split_decodes_prefills_and_extends

__all__ = ["DCPContextSplit", "causal_per_request", "dcp_context_is_empty", "dcp_context_kv_lens", "dcp_context_split",
           "max_dcp_context_kv_len"]


class DCPContextSplit(NamedTuple):
    """FlashAttention's decode / context-query counts under DCP (vLLM 0.33.0's ``split_dcp_context_queries``).

    The "prefill" counts are the rows with a query longer than one token *and* context (vLLM's
    extends); rows without context (pure prefills) are in neither count.
    """

    num_decode_reqs: int
    """Leading rows with a one-token query."""
    num_prefill_reqs: int
    """Rows after them with a longer query and context (vLLM's extends)."""
    num_decode_tokens: int
    """Tokens of the decode rows."""
    num_prefill_tokens: int
    """Tokens of the extend rows."""


def dcp_context_split(query_start_loc_cpu: npt.ArrayLike, seq_lens_upper_bound: npt.ArrayLike, *, num_tokens: int,
                      max_query_len: int) -> DCPContextSplit:
    """The counts vLLM 0.33.0's FlashAttention builder sets under DCP: all 0 when ``max_query_len <= 1``
    (its builder skips the split then), else the decodes and extends of
    :func:`~attnmeta.host.split.split_decodes_prefills_and_extends` with threshold 1.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        Query start offsets, padding rows included.
    seq_lens_upper_bound : (num_reqs,) int32, host
        ``seq_lens_cpu_upper_bound`` (exact on the rows the split reads: prefills).
    num_tokens : int
        Tokens of the step, padding included (``num_actual_tokens``).
    max_query_len : int
        The step's ``max_query_len``.

    Returns
    -------
    DCPContextSplit

    Raises
    ------
    TypeError, ValueError
        As :func:`~attnmeta.host.split.split_decodes_prefills_and_extends`.

    Examples
    --------
    >>> dcp_context_split([0, 1, 2, 6, 9], [40, 7, 30, 3], num_tokens=9, max_query_len=4)
    DCPContextSplit(num_decode_reqs=2, num_prefill_reqs=1, num_decode_tokens=2, num_prefill_tokens=4)
    >>> dcp_context_split([0, 1, 2], [40, 7], num_tokens=2, max_query_len=1)
    DCPContextSplit(num_decode_reqs=0, num_prefill_reqs=0, num_decode_tokens=0, num_prefill_tokens=0)
    """
    if max_query_len <= 1:
        return DCPContextSplit(0, 0, 0, 0)
    d, e, _p, dt, et, _pt = split_decodes_prefills_and_extends(
        query_start_loc_cpu, seq_lens_upper_bound, num_tokens=num_tokens, max_query_len=max_query_len,
        decode_threshold=1)
    return DCPContextSplit(d, e, dt, et)


def dcp_context_is_empty(query_start_loc_cpu: npt.ArrayLike, seq_lens_upper_bound: npt.ArrayLike) -> bool:
    """Whether no row has context (``seq_lens_upper_bound - query_lens`` all 0): vLLM 0.33.0's
    ``should_skip_dcp_context_attention``, from the rank-invariant global lengths; its FlashAttention
    builder then passes ``max_dcp_context_kv_len = 0``.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
    seq_lens_upper_bound : (num_reqs,) int32, host

    Returns
    -------
    bool

    Examples
    --------
    >>> dcp_context_is_empty([0, 3, 5], [3, 2]), dcp_context_is_empty([0, 1, 5], [9, 4])
    (True, False)
    """
    qsl = np.asarray(query_start_loc_cpu)
    ub = np.asarray(seq_lens_upper_bound)
    return bool(ub.shape[0] == 0 or int((ub - np.diff(qsl)).max()) == 0)

_OK = 0
_NEG_S = 1
_NEG_Q = 2
_Q_GT_S = 3


@njit
def _dcp_local_len(total: int, world: int, rank: int, interleave: int) -> int:
    """Tokens of a ``total``-token sequence held by ``rank`` (docs/semantics.md, "Context parallelism")."""
    base = total // interleave // world * interleave
    extra = total - base * world - rank * interleave
    if extra < 0:
        extra = 0
    elif extra > interleave:
        extra = interleave
    return base + extra


@njit
def _dcp_context_nb(
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    num_decodes: int,
    world: int,
    rank: int,
    interleave: int,
    out: np.ndarray,
) -> tuple[int, int]:
    for i in range(seq_lens.shape[0]):
        s = int(seq_lens[i])
        if s < 0:
            return _NEG_S, i
        if i >= num_decodes:
            q = int(query_lens[i])
            if q < 0:
                return _NEG_Q, i
            if q > s:
                return _Q_GT_S, i
            s -= q
        out[i] = _dcp_local_len(s, world, rank, interleave)
    return _OK, 0


def _check_int(value: Any, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < lo:
        raise ValueError(f"{name}: must be an int >= {lo}, got {value!r}")
    return int(value)


def dcp_context_kv_lens(
    seq_lens: Any,
    query_lens: Any,
    dcp_world_size: int,
    dcp_rank: int,
    interleave: int = 1,
    *,
    num_decodes: int = 0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """This rank's share of each request's context, ``local(seq_lens - query_lens)`` (host).

    FlashAttention's ``dcp_context_kv_lens`` (every row, ``num_decodes=0``). FlashInfer's DCP host
    ``seq_lens`` keep the decode rows ``[0, num_decodes)`` whole and subtract the queries only from the
    prefill rows: pass ``num_decodes``.

    Parameters
    ----------
    seq_lens : (num_reqs,) int32, host
        Sequence lengths (exact, or the upper bound where the builder uses it); padding rows 0.
    query_lens : (num_reqs,) int32, host
        Scheduled tokens per row, ``<= seq_lens``; padding rows 0.
    dcp_world_size : int
        ``W >= 1``.
    dcp_rank : int
        ``0 <= r < W``.
    interleave : int, default 1
        ``I >= 1``: consecutive tokens per rank (``cp_kv_cache_interleave_size``).
    num_decodes : int, default 0
        Leading rows whose full ``seq_lens`` are distributed instead of their context.
    out : (num_reqs,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs,) int32, host
        ``out`` if given.

    Raises
    ------
    ValueError
        Bad parallel layout, mismatched lengths, negative lengths, a query longer than its sequence.

    Examples
    --------
    >>> import numpy as np
    >>> s, q = np.array([10, 17, 5, 0], np.int32), np.array([1, 4, 5, 0], np.int32)
    >>> dcp_context_kv_lens(s, q, 2, 0), dcp_context_kv_lens(s, q, 2, 1)
    (array([5, 7, 0, 0], dtype=int32), array([4, 6, 0, 0], dtype=int32))
    >>> dcp_context_kv_lens(s, q, 2, 1, 2, num_decodes=1)
    array([4, 6, 0, 0], dtype=int32)
    """
    world = _check_int(dcp_world_size, "dcp_world_size", 1)
    rank = _check_int(dcp_rank, "dcp_rank", 0)
    if rank >= world:
        raise ValueError(f"dcp_rank: {rank} >= dcp_world_size={world}; need 0 <= rank < world_size")
    inter = _check_int(interleave, "interleave", 1)
    s = as_host_array(seq_lens, "seq_lens")
    n = s.shape[0]
    q = as_host_array(query_lens, "query_lens", length=n)
    nd = _check_int(num_decodes, "num_decodes", 0)
    if nd > n:
        raise ValueError(f"num_decodes: {nd} > num_reqs={n}")
    res = check_out(out, "dcp_context_kv_lens", (n,), np.int32)
    code, i = _dcp_context_nb(s, q, nd, world, rank, inter, res)
    if code == _NEG_S:
        raise ValueError(f"seq_lens[{i}]={int(s[i])} is negative (request {i}); lengths must be >= 0")
    if code == _NEG_Q:
        raise ValueError(f"query_lens[{i}]={int(q[i])} is negative (request {i}); lengths must be >= 0")
    if code == _Q_GT_S:
        raise ValueError(
            f"query_lens[{i}]={int(q[i])} > seq_lens[{i}]={int(s[i])} (request {i}); a sequence includes its queries"
        )
    return res


def max_dcp_context_kv_len(max_seq_len: int, dcp_world_size: int, interleave: int = 1) -> int:
    """Upper bound of any rank's DCP context length: ``cdiv(max_seq_len, W*I) * I`` (host).

    What vLLM 0.33.0 passes as ``max_dcp_context_kv_len`` (it replaced a ``.max().item()`` sync). It
    bounds :func:`dcp_context_kv_lens` for every row with ``seq_lens <= max_seq_len``.

    Parameters
    ----------
    max_seq_len : int
        The step's ``max_seq_len`` (itself an upper bound), >= 0.
    dcp_world_size : int
        ``W >= 1``.
    interleave : int, default 1
        ``I >= 1``.

    Returns
    -------
    int
        The bound.

    Raises
    ------
    ValueError
        Negative ``max_seq_len`` or a non-positive ``W``/``I``.

    Examples
    --------
    >>> max_dcp_context_kv_len(17, 2), max_dcp_context_kv_len(17, 2, 4)
    (9, 12)
    """
    m = _check_int(max_seq_len, "max_seq_len", 0)
    parts = _check_int(dcp_world_size, "dcp_world_size", 1) * _check_int(interleave, "interleave", 1)
    return -(-m // parts) * int(interleave)


def causal_per_request(
    causal: Any, num_reqs: int | None = None, *, out: np.ndarray | None = None
) -> np.ndarray:
    """A per-request ``causal`` flag array in the int32 form FlashAttention requires (host).

    Parameters
    ----------
    causal : bool or (num_reqs,) bool or int, host
        One flag for every row (then ``num_reqs`` is required), or one per row; integer flags must be
        0 or 1.
    num_reqs : int, optional
        Rows, when ``causal`` is a single bool; must match ``len(causal)`` otherwise.
    out : (num_reqs,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs,) int32, host
        1 for causal rows, 0 for bidirectional ones; ``out`` if given.

    Raises
    ------
    ValueError
        Missing or mismatched ``num_reqs``, flags other than 0/1, a wrong ``out``.
    TypeError
        ``causal`` is a torch tensor or not bool/integer.

    Examples
    --------
    >>> import numpy as np
    >>> causal_per_request(True, 3)
    array([1, 1, 1], dtype=int32)
    >>> causal_per_request(np.array([True, False, True, True]))
    array([1, 0, 1, 1], dtype=int32)
    """
    if isinstance(causal, bool | np.bool_):
        if num_reqs is None:
            raise ValueError("num_reqs: required when causal is a single bool")
        n = _check_int(num_reqs, "num_reqs", 0)
        res = check_out(out, "causal", (n,), np.int32)
        res.fill(1 if causal else 0)
        return res
    reject_tensor(causal, "causal")
    arr = np.asarray(causal)
    flags = as_host_array(arr, "causal", dtype=np.bool_ if arr.dtype == np.bool_ else np.int32)
    if num_reqs is not None and flags.shape[0] != num_reqs:
        raise ValueError(f"causal: has {flags.shape[0]} entries, num_reqs={num_reqs}")
    if flags.dtype != np.bool_ and flags.size and (int(flags.min()) < 0 or int(flags.max()) > 1):
        i = int(np.argmax((flags < 0) | (flags > 1)))
        raise ValueError(f"causal[{i}]={int(flags[i])}; integer causal flags must be 0 or 1 (request {i})")
    res = check_out(out, "causal", (flags.shape[0],), np.int32)
    res[:] = flags
    return res
