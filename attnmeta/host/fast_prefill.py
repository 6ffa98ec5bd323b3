"""KV-sharing fast prefill, derived on the host (docs/semantics-attention.md, "FastPrefillMetadata (KV-sharing fast prefill)").

With ``kv_sharing_fast_prefill``, the layers that reuse an earlier layer's KV cache compute only the
tokens whose logits are needed. Their attention runs a decode-like batch holding just those query
tokens, against each request's full KV. vLLM 0.33.0 derives the new ``query_start_loc`` on the device
(``bucketize`` + ``scatter_add_`` + ``cumsum``) and takes its host copy from a D2H copy that is still
queued when builders read it (a race). attnmeta computes it on the host from the host
``query_start_loc_cpu`` and the host logits indices, so host and device copies agree by construction.

For logits index ``li[j]``, its request is ``rid[j] = #{i : qsl[i+1] <= li[j]}`` (the row whose
half-open range ``[qsl[i], qsl[i+1])`` holds it; ``torch.bucketize(li, qsl[1:], right=True)``);
``cnt[i] = #{j : rid[j] == i}``; the fast-prefill ``query_start_loc = [0, cumsum(cnt)]``. The rest of
the fast-prefill metadata is host arithmetic: ``num_actual_tokens = len(logits_indices)`` and
``max_query_len = max_logits_per_req``.

What vLLM assumes of the logits indices (and attnmeta checks): every index lies in
``[0, query_start_loc_cpu[-1])`` (an index past the last row would make vLLM's ``scatter_add_`` go out of
bounds), and they are sorted, so request ``i``'s queries are ``[qsl'[i], qsl'[i+1])``. The runner's
indices are each request's last ``cnt_i`` token positions, so they are strictly increasing: a repeated
index (which ``bucketize`` would take, counting one token as two queries of its request) is an error
naming its position. That each request's indices are its *last* tokens (which makes the batch
decode-like) is the runner's contract and is not checked.

Shape legend
------------
- ``num_reqs``: request rows ``B``, padding rows included (``len(query_start_loc_cpu) - 1``).
- ``num_logits``: logits indices ``L`` (``len(logits_indices)``), the fast-prefill ``num_actual_tokens``.
- ``num_logits_padded``: ``L`` padded for the CUDA-graph dispatcher (``>= L``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnmeta._checks import as_host_array, check_out
from attnmeta._numba import njit

__all__ = ["fast_prefill_query_start_loc", "max_logits_per_req", "pad_logits_indices"]

_OK = 0
_QSL0 = 1  # query_start_loc_cpu[0] != 0
_QSL_DEC = 2  # query_start_loc_cpu decreases at idx
_LI_RANGE = 3  # logits_indices[idx] outside [0, qsl[-1])
_LI_ORDER = 4  # logits_indices[idx] < logits_indices[idx - 1]
_LI_DUPLICATE = 5  # logits_indices[idx] == logits_indices[idx - 1]


@njit
def _fast_qsl_nb(qsl: np.ndarray, li: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    n = qsl.shape[0] - 1
    if qsl[0] != 0:
        return _QSL0, 0
    for i in range(n):
        if qsl[i + 1] < qsl[i]:
            return _QSL_DEC, i + 1
    total = int(qsl[n])
    out[0] = 0
    row = 0
    prev = -1
    for j in range(li.shape[0]):
        x = int(li[j])
        if x < 0 or x >= total:
            return _LI_RANGE, j
        if x <= prev:
            return (_LI_ORDER if x < prev else _LI_DUPLICATE), j
        prev = x
        # Close every row that ends at or before x: all earlier indices (and no later one) belong to it.
        while qsl[row + 1] <= x:
            row += 1
            out[row] = j
    while row < n:
        row += 1
        out[row] = li.shape[0]
    return _OK, 0


@njit
def _max_diff_nb(indptr: np.ndarray) -> tuple[int, int]:
    best = 0
    for i in range(indptr.shape[0] - 1):
        d = int(indptr[i + 1]) - int(indptr[i])
        if d < 0:
            return -1, i + 1
        if d > best:
            best = d
    return best, 0


def fast_prefill_query_start_loc(
    query_start_loc_cpu: Any, logits_indices: Any, *, out: np.ndarray | None = None
) -> np.ndarray:
    """The fast-prefill ``query_start_loc``: ``[0, cumsum(logits per request)]``, computed on the host.

    Equals vLLM's device ``dqsl`` (``bucketize(li, qsl[1:], right=True)``, a ``scatter_add_``
    histogram, ``cumsum``) bit for bit, without reading anything back from the device.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        The step's query start locations: ``[0] == 0``, non-decreasing; padding rows repeat the last
        value.
    logits_indices : (num_logits,) int, host
        Token positions whose logits are needed (unpadded: ``logits_indices_padded[:num_logits]``), in
        ``[0, query_start_loc_cpu[-1])`` and strictly increasing.
    out : (num_reqs + 1,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs + 1,) int32, host
        ``out`` if given. ``[0] == 0``, ``[-1] == num_logits``; row ``i`` holds the logits indices that
        fall in ``[query_start_loc_cpu[i], query_start_loc_cpu[i+1])``.

    Raises
    ------
    ValueError
        A malformed ``query_start_loc_cpu``, a logits index out of range, out of order or repeated, or
        a wrong ``out``.

    Examples
    --------
    docs/semantics-attention.md, "FastPrefillMetadata (KV-sharing fast prefill)": q = [15, 5, 8], two logits for the second request (spec decode).

    >>> import numpy as np
    >>> qsl = np.array([0, 15, 20, 28], np.int32)
    >>> fast_prefill_query_start_loc(qsl, np.array([14, 18, 19, 27], np.int32))
    array([0, 1, 3, 4], dtype=int32)
    """
    qsl = as_host_array(query_start_loc_cpu, "query_start_loc_cpu")
    if qsl.shape[0] < 1:
        raise ValueError("query_start_loc_cpu: must have num_reqs + 1 >= 1 entries, got an empty array")
    li = as_host_array(logits_indices, "logits_indices")
    res = check_out(out, "fast_prefill_query_start_loc", (qsl.shape[0],), np.int32)
    code, idx = _fast_qsl_nb(qsl, li, res)
    if code == _QSL0:
        raise ValueError(f"query_start_loc_cpu[0]={int(qsl[0])}; query start locations must begin at 0")
    if code == _QSL_DEC:
        raise ValueError(
            f"query_start_loc_cpu[{idx}]={int(qsl[idx])} < query_start_loc_cpu[{idx - 1}]={int(qsl[idx - 1])} "
            f"(request {idx - 1}); query start locations must be non-decreasing"
        )
    if code == _LI_RANGE:
        raise ValueError(
            f"logits_indices[{idx}]={int(li[idx])} is outside [0, query_start_loc_cpu[-1]={int(qsl[-1])}); "
            f"a logits index must be a scheduled token of this step (drop the CUDA-graph padding first)"
        )
    if code == _LI_ORDER:
        raise ValueError(
            f"logits_indices[{idx}]={int(li[idx])} < logits_indices[{idx - 1}]={int(li[idx - 1])}; "
            f"logits indices must be sorted (request by request, as the runner emits them)"
        )
    if code == _LI_DUPLICATE:
        raise ValueError(
            f"logits_indices[{idx}]={int(li[idx])} == logits_indices[{idx - 1}]={int(li[idx - 1])}; logits indices must "
            f"be strictly increasing (each token once: a repeated one would count as two queries of its request)"
        )
    return res


def max_logits_per_req(fast_query_start_loc: Any) -> int:
    """Most logits of any one request: the fast-prefill ``max_query_len`` (host).

    ``max(diff(fast_query_start_loc))``; 0 for an empty batch. For the runner's logits indices this is
    its ``max_num_sampled_tokens`` (``max(num_draft_tokens + 1)``; 1 without spec decode), the value
    vLLM 0.33.0 passes as ``max_logits_per_req``.

    Parameters
    ----------
    fast_query_start_loc : (num_reqs + 1,) int32, host
        From :func:`fast_prefill_query_start_loc`.

    Returns
    -------
    int
        The exact maximum (host int).

    Raises
    ------
    ValueError
        ``fast_query_start_loc`` is empty or decreases.

    Examples
    --------
    >>> import numpy as np
    >>> max_logits_per_req(np.array([0, 1, 3, 4], np.int32))
    2
    """
    arr = as_host_array(fast_query_start_loc, "fast_query_start_loc")
    if arr.shape[0] < 1:
        raise ValueError("fast_query_start_loc: must have num_reqs + 1 >= 1 entries, got an empty array")
    best, idx = _max_diff_nb(arr)
    if best < 0:
        raise ValueError(
            f"fast_query_start_loc[{idx}]={int(arr[idx])} < fast_query_start_loc[{idx - 1}]="
            f"{int(arr[idx - 1])}; query start locations must be non-decreasing"
        )
    return int(best)


def pad_logits_indices(logits_indices: Any, num_padded: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """``logits_indices`` padded to ``num_padded`` entries by repeating the last index (host).

    The runner's ``logits_indices_padded``: the tail ``[num_logits, num_padded)`` repeats
    ``logits_indices[-1]`` so every entry stays a valid token index for the CUDA-graph-padded decoder
    part (vLLM fills it on the device; it once read the last index back with ``.item()``).

    Parameters
    ----------
    logits_indices : (num_logits,) int, host
        Unpadded logits indices, ``num_logits >= 1``.
    num_padded : int
        ``num_logits_padded``, from the CUDA-graph dispatcher; ``>= num_logits``.
    out : (num_logits_padded,) int32, host, optional
        Buffer to write into.

    Returns
    -------
    (num_logits_padded,) int32, host
        ``out`` if given.

    Raises
    ------
    TypeError
        ``num_padded`` is not an int.
    ValueError
        No logits indices, ``num_padded < num_logits``, an index that does not fit int32, or a wrong
        ``out``.

    Examples
    --------
    >>> import numpy as np
    >>> pad_logits_indices(np.array([14, 18, 19, 27], np.int32), 6)
    array([14, 18, 19, 27, 27, 27], dtype=int32)
    """
    li = as_host_array(logits_indices, "logits_indices")
    n = li.shape[0]
    if n == 0:
        raise ValueError(
            "logits_indices: is empty; there is no last index to pad with (vLLM asserts num_logits > 0)"
        )
    if isinstance(num_padded, bool) or not isinstance(num_padded, int | np.integer):
        raise TypeError(f"num_padded: expected an int, got {type(num_padded).__name__} {num_padded!r}")
    if num_padded < n:
        raise ValueError(f"num_padded={num_padded} < num_logits={n} (len(logits_indices)); padding can only add entries")
    res = check_out(out, "logits_indices_padded", (int(num_padded),), np.int32)
    res[:n] = li
    res[n:] = li[n - 1]
    return res
