"""Host classification of a step's requests: decode / extend / prefill splits and the batch reorder.

Backends run decode rows and prefill rows through different kernels, so they need to know where the
boundary lies in a batch ordered decode -> short extend -> long extend -> prefill. These functions
reproduce vLLM 0.33.0's helpers (docs/semantics.md, "Splitting decodes from prefills") exactly, quirks included, but
read host arrays only and run in numba, so they never touch a device tensor.

Shape legend
------------
- ``num_reqs``: request rows, CUDA-graph padding rows included (``B`` in docs/semantics.md).
- ``num_tokens``: tokens of the step (``num_actual_tokens``), token padding included; may exceed
  ``query_start_loc_cpu[-1]``.
- ``num_swaps``: row swaps the reorder performs (``< num_reqs``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from attnmeta._checks import INT32_MAX, as_host_array
from attnmeta._numba import njit
from attnmeta.host.layout import _int_arg

__all__ = [
    "Reorder",
    "SplitCounts",
    "SplitCounts3",
    "reorder_decodes_and_prefills",
    "split_counts_nb",
    "split_decodes_and_prefills",
    "split_decodes_prefills_and_extends",
]

_EMPTY_BOOL = np.empty(0, dtype=np.bool_)

# Kernel status codes (the wrappers format the messages).
_OK = 0
_QSL_START = 1
_QSL_DECREASING = 2
_QSL_PAST_END = 3
_NEG_COMPUTED = 5
_NEG_SCHEDULED = 6
_NEG_PROMPT = 7


class SplitCounts(NamedTuple):
    """Decode/prefill split of a reordered batch (vLLM ``split_decodes_and_prefills``).

    Decodes are rows ``[0, num_decodes)`` and tokens ``[0, num_decode_tokens)``; prefills are the
    rest. Always ``num_decodes + num_prefills == num_reqs`` and ``num_decode_tokens +
    num_prefill_tokens == num_tokens``.
    """

    num_decodes: int
    """Decode rows (zero-length padding rows before the first prefill count as decodes)."""
    num_prefills: int
    """Prefill rows."""
    num_decode_tokens: int
    """Tokens of the decode rows (all of ``num_tokens``, padding included, when every row decodes)."""
    num_prefill_tokens: int
    """Tokens of the prefill rows, token padding included."""


class SplitCounts3(NamedTuple):
    """Decode/extend/prefill split (vLLM ``split_decodes_prefills_and_extends``).

    Rows are decodes, then extends (context already computed), then prefills (no context).
    """

    num_decodes: int
    """Decode rows."""
    num_extends: int
    """Extend rows: longer than the threshold, with context."""
    num_prefills: int
    """Prefill rows: longer than the threshold, without context."""
    num_decode_tokens: int
    """Tokens of the decode rows."""
    num_extend_tokens: int
    """Tokens of the extend rows."""
    num_prefill_tokens: int
    """Tokens of the prefill rows, token padding included."""


class Reorder(NamedTuple):
    """The row swaps that put a batch in decode -> short extend -> long extend -> prefill order.

    attnmeta only computes the swaps; the caller applies them to its own persistent batch state:
    either call its ``swap_states(i, j)`` for each ``(i, j)`` in ``swaps``, in order (exactly the calls
    vLLM makes), or gather every per-request array once with ``new[slot] = old[permutation[slot]]``.
    """

    swaps: np.ndarray
    """(num_swaps, 2) int32, host. The ``swap_states(i, j)`` calls, in order; empty when the batch is
    already ordered."""
    permutation: np.ndarray
    """(num_reqs,) int32, host. ``permutation[slot]`` is the original row that ends up in ``slot``
    after the swaps; the identity when nothing moves."""

    @property
    def modified(self) -> bool:
        """Whether any row moves (vLLM's return value)."""
        return bool(self.swaps.shape[0])


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------


@njit
def _qsl_status_nb(qsl: np.ndarray, num_tokens: int) -> tuple[int, int]:
    """Check ``qsl[0] == 0``, non-decreasing, ``qsl[-1] <= num_tokens``."""
    if qsl[0] != 0:
        return _QSL_START, 0
    for i in range(1, qsl.shape[0]):
        if qsl[i] < qsl[i - 1]:
            return _QSL_DECREASING, i
    if qsl[qsl.shape[0] - 1] > num_tokens:
        return _QSL_PAST_END, qsl.shape[0] - 1
    return _OK, -1


@njit
def _first_negative_nb(values: np.ndarray) -> int:
    for i in range(values.shape[0]):
        if values[i] < 0:
            return i
    return -1


@njit
def split_counts_nb(
    qsl: np.ndarray,
    num_tokens: int,
    max_query_len: int,
    threshold: int,
    require_uniform: bool,
    treat_short_extends_as_decodes: bool,
    prefilling: np.ndarray,
) -> tuple[int, int, int, int]:
    """:func:`split_decodes_and_prefills`'s compiled pass: ``(num_decodes, num_prefills,
    num_decode_tokens, num_prefill_tokens)``. Unchecked inputs (a validated step's host arrays;
    ``prefilling`` may be empty unless ``treat_short_extends_as_decodes`` is False)."""
    b = qsl.shape[0] - 1
    if treat_short_extends_as_decodes and max_query_len <= threshold and (not require_uniform or threshold <= 1):
        return b, 0, num_tokens, 0
    if b == 0:
        return 0, 0, num_tokens, 0  # vLLM indexes q[0] here and fails
    q0 = int(qsl[1]) - int(qsl[0])
    if q0 > threshold:
        return 0, b, 0, num_tokens
    for i in range(b):
        qi = int(qsl[i + 1]) - int(qsl[i])
        # Uniform: with treat_short_extends_as_decodes, a batch whose rows are all q0 or 0 (a padded
        # uniform batch) finds no prefill here and is all decodes, as in vLLM.
        prefill = (qi != q0 and qi != 0) if require_uniform else qi > threshold
        if not treat_short_extends_as_decodes and prefilling[i]:
            prefill = True
        if prefill:
            start = int(qsl[i])
            return i, b - i, start, num_tokens - start
    return b, 0, num_tokens, 0


@njit
def _split3_nb(
    qsl: np.ndarray, upper: np.ndarray, num_tokens: int, max_query_len: int, threshold: int
) -> tuple[int, int, int, int, int, int]:
    b = qsl.shape[0] - 1
    if max_query_len <= threshold:
        return b, 0, 0, num_tokens, 0, 0
    first_extend = -1
    first_prefill = -1
    for i in range(b):
        qi = int(qsl[i + 1]) - int(qsl[i])
        if qi > threshold:
            if first_extend < 0:
                first_extend = i
            if int(upper[i]) == qi:
                first_prefill = i
                break
    if first_extend < 0:
        # vLLM: argmax of an all-False mask is 0, so it returns num_decodes = 0, qsl[0] = 0 tokens.
        return 0, 0, 0, 0, 0, 0
    nd = first_extend
    ndt = int(qsl[nd])
    if first_prefill < 0:
        return nd, b - nd, 0, ndt, num_tokens - ndt, 0
    npt_ = num_tokens - int(qsl[first_prefill])
    return nd, first_prefill - nd, b - first_prefill, ndt, (num_tokens - ndt) - npt_, npt_


@njit
def _reorder_nb(
    c: np.ndarray, q: np.ndarray, prompt: np.ndarray, threshold: int, swaps: np.ndarray, perm: np.ndarray
) -> tuple[int, int, int]:
    """Replay vLLM's cycle-swap reorder; returns ``(status, row, num_swaps)``."""
    n = c.shape[0]
    region = np.empty(n, dtype=np.int8)
    counts = np.zeros(4, dtype=np.int64)
    for i in range(n):
        if c[i] < 0:
            return _NEG_COMPUTED, i, 0
        if q[i] < 0:
            return _NEG_SCHEDULED, i, 0
        if prompt[i] < 0:
            return _NEG_PROMPT, i, 0
        if c[i] == 0:
            r = 3  # prefill: no context yet
        elif q[i] > threshold:
            r = 2  # long extend
        elif c[i] < prompt[i]:
            r = 1  # short extend: still prefilling
        else:
            r = 0  # decode
        region[i] = r
        counts[r] += 1
        perm[i] = i
    end0 = counts[0]
    end1 = end0 + counts[1]
    end2 = end1 + counts[2]
    # Rows whose region differs from their slot's target region, ascending.
    misplaced = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        if i < end0:
            target = 0
        elif i < end1:
            target = 1
        elif i < end2:
            target = 2
        else:
            target = 3
        if region[i] != target:
            misplaced[m] = i
            m += 1
    if m == 0:
        return _OK, -1, 0
    # Sources: the misplaced rows stably sorted by region; the k-th source goes to the k-th misplaced
    # slot.
    sources = np.empty(m, dtype=np.int64)
    dest = np.full(n, -1, dtype=np.int64)
    k = 0
    for r in range(4):
        for j in range(m):
            row = misplaced[j]
            if region[row] == r:
                sources[k] = row
                dest[row] = misplaced[k]
                k += 1
    # Follow each cycle from its first source: swap the source slot with the destination, mark the
    # destination done, continue with where the row now in the source slot must go.
    num_swaps = 0
    for j in range(m):
        src = sources[j]
        dst = dest[src]
        while src != dst:
            swaps[num_swaps, 0] = src
            swaps[num_swaps, 1] = dst
            num_swaps += 1
            held = perm[src]
            perm[src] = perm[dst]
            perm[dst] = held
            nxt = dest[dst]
            dest[dst] = dst
            dst = nxt
    return _OK, -1, num_swaps


# --------------------------------------------------------------------------------------------------
# wrappers
# --------------------------------------------------------------------------------------------------


def _query_start_loc_arg(value: Any, num_tokens: int) -> np.ndarray:
    qsl = as_host_array(value, "query_start_loc_cpu")
    if qsl.shape[0] == 0:
        raise ValueError("query_start_loc_cpu: must have num_reqs + 1 >= 1 entries, got 0")
    code, i = _qsl_status_nb(qsl, num_tokens)
    if code == _QSL_START:
        raise ValueError(f"query_start_loc_cpu[0]={int(qsl[0])}; it must start at 0")
    if code == _QSL_DECREASING:
        raise ValueError(
            f"query_start_loc_cpu[{i}]={int(qsl[i])} < query_start_loc_cpu[{i - 1}]={int(qsl[i - 1])} "
            f"(request {i - 1} has a negative query length); it must be non-decreasing"
        )
    if code == _QSL_PAST_END:
        raise ValueError(
            f"query_start_loc_cpu[{i}]={int(qsl[i])} > num_tokens={num_tokens}; num_tokens counts every "
            f"scheduled token (plus padding)"
        )
    return qsl


def _scalars(num_tokens: Any, max_query_len: Any, decode_threshold: Any) -> tuple[int, int, int]:
    t = _int_arg(num_tokens, "num_tokens")
    if t > INT32_MAX:
        raise ValueError(f"num_tokens={t} overflows int32")
    return t, _int_arg(max_query_len, "max_query_len"), _int_arg(decode_threshold, "decode_threshold", minimum=1)


def split_decodes_and_prefills(
    query_start_loc_cpu: npt.ArrayLike,
    *,
    num_tokens: int,
    max_query_len: int,
    decode_threshold: int = 1,
    require_uniform: bool = False,
    treat_short_extends_as_decodes: bool = True,
    is_prefilling: npt.ArrayLike | None = None,
) -> SplitCounts:
    """Where the decodes end in a reordered batch (vLLM ``split_decodes_and_prefills``, section 5.1).

    With ``q = diff(query_start_loc_cpu)`` and ``B = num_reqs``:

    1. If ``treat_short_extends_as_decodes``, ``max_query_len <= decode_threshold`` and (not
       ``require_uniform`` or ``decode_threshold <= 1``): all ``B`` rows decode.
    2. If ``q[0] > decode_threshold``: all rows are prefills.
    3. A row is a prefill if ``q != q[0] and q != 0`` (``require_uniform``) or ``q >
       decode_threshold`` (otherwise), or, when not ``treat_short_extends_as_decodes``, it is still
       prefilling. The first such row starts the prefills (rows after it are prefills whatever they
       look like); with none, all rows decode.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        Query start offsets of the batch, padding rows included.
    num_tokens : int
        Tokens of the step, token padding included (``num_actual_tokens``; ``>=
        query_start_loc_cpu[-1]``).
    max_query_len : int
        The batch's ``max_query_len`` (an upper bound on ``q``; the shortcut in rule 1 reads it).
    decode_threshold : int
        Longest query that counts as a decode, >= 1 (with 0 no row would be a decode).
    require_uniform : bool
        Decodes must all have the query length of row 0 (zero-length padding rows allowed).
    treat_short_extends_as_decodes : bool
        When False, rows in ``is_prefilling`` are prefills whatever their query length (the Mamba,
        GDN and short-conv split).
    is_prefilling : (num_reqs,) bool, host, optional
        Required when ``treat_short_extends_as_decodes`` is False; ignored otherwise.

    Returns
    -------
    SplitCounts
        ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` as Python ints.

    Raises
    ------
    TypeError
        An array is a torch tensor or of the wrong dtype; a scalar is not an int.
    ValueError
        ``query_start_loc_cpu`` empty, not starting at 0, decreasing or past ``num_tokens``; a negative
        scalar or a ``decode_threshold`` below 1; ``is_prefilling`` missing or of the wrong length.

    Notes
    -----
    ``num_reqs == 0``: vLLM fails indexing ``q[0]`` unless rule 1 applies; attnmeta returns
    ``SplitCounts(0, 0, num_tokens, 0)`` either way, which is all zeros for an empty unpadded batch
    and keeps the two sums above.

    Examples
    --------
    >>> split_decodes_and_prefills([0, 2, 3, 6, 10], num_tokens=10, max_query_len=4,
    ...                            decode_threshold=3)
    SplitCounts(num_decodes=3, num_prefills=1, num_decode_tokens=6, num_prefill_tokens=4)
    >>> split_decodes_and_prefills([0, 2, 4, 6, 6], num_tokens=8, max_query_len=2,
    ...                            decode_threshold=3, require_uniform=True)
    SplitCounts(num_decodes=4, num_prefills=0, num_decode_tokens=8, num_prefill_tokens=0)
    >>> split_decodes_and_prefills([0, 1, 2, 3], num_tokens=3, max_query_len=1,
    ...                            treat_short_extends_as_decodes=False,
    ...                            is_prefilling=[False, True, False])
    SplitCounts(num_decodes=1, num_prefills=2, num_decode_tokens=1, num_prefill_tokens=2)
    """
    t, mq, thr = _scalars(num_tokens, max_query_len, decode_threshold)
    qsl = _query_start_loc_arg(query_start_loc_cpu, t)
    b = qsl.shape[0] - 1
    treat_short = bool(treat_short_extends_as_decodes)
    if treat_short:
        prefilling = _EMPTY_BOOL
    elif is_prefilling is None:
        raise ValueError(
            "is_prefilling: required when treat_short_extends_as_decodes=False "
            "(pass the batch's (num_reqs,) bool is_prefilling)"
        )
    else:
        prefilling = as_host_array(is_prefilling, "is_prefilling", dtype=np.bool_, length=b)
    nd, np_, ndt, npt_ = split_counts_nb(qsl, t, mq, thr, bool(require_uniform), treat_short, prefilling)
    return SplitCounts(int(nd), int(np_), int(ndt), int(npt_))


def split_decodes_prefills_and_extends(
    query_start_loc_cpu: npt.ArrayLike,
    seq_lens_upper_bound: npt.ArrayLike,
    *,
    num_tokens: int,
    max_query_len: int,
    decode_threshold: int,
) -> SplitCounts3:
    """Decode / extend / prefill split of a reordered batch (vLLM 0.33.0, section 5.2).

    If ``max_query_len <= decode_threshold`` every row decodes. Otherwise rows with ``q >
    decode_threshold`` are extends or prefills; the first of them ends the decodes, and the first one
    whose ``seq_lens_upper_bound == q`` (no context) starts the prefills.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        Query start offsets of the batch, padding rows included.
    seq_lens_upper_bound : (num_reqs,) int32, host
        ``seq_lens_cpu_upper_bound`` (exact on prefill rows, which is all the test needs).
    num_tokens : int
        Tokens of the step, token padding included.
    max_query_len : int
        The batch's ``max_query_len``.
    decode_threshold : int
        Longest query that counts as a decode, >= 1 (with 0 no row would be a decode).

    Returns
    -------
    SplitCounts3
        ``(num_decodes, num_extends, num_prefills, num_decode_tokens, num_extend_tokens,
        num_prefill_tokens)`` as Python ints.

    Raises
    ------
    TypeError
        An array is a torch tensor or of the wrong dtype; a scalar is not an int.
    ValueError
        A bad ``query_start_loc_cpu`` (as in :func:`split_decodes_and_prefills`), a wrong length or a
        negative entry in ``seq_lens_upper_bound``, a negative scalar, ``decode_threshold < 1``.

    Notes
    -----
    vLLM's quirk is kept: if ``max_query_len > decode_threshold`` but no row is longer than the
    threshold (``max_query_len`` is only an upper bound), the result is all zeros, not all decodes.

    Examples
    --------
    >>> split_decodes_prefills_and_extends([0, 1, 3, 7, 12, 18], [10, 11, 20, 5, 6],
    ...                                    num_tokens=18, max_query_len=6, decode_threshold=3)
    SplitCounts3(num_decodes=2, num_extends=1, num_prefills=2, num_decode_tokens=3, num_extend_tokens=4, num_prefill_tokens=11)
    """
    t, mq, thr = _scalars(num_tokens, max_query_len, decode_threshold)
    qsl = _query_start_loc_arg(query_start_loc_cpu, t)
    b = qsl.shape[0] - 1
    upper = as_host_array(seq_lens_upper_bound, "seq_lens_upper_bound", length=b)
    bad = _first_negative_nb(upper)
    if bad >= 0:
        raise ValueError(f"seq_lens_upper_bound[{bad}]={int(upper[bad])} is negative (request {bad})")
    return SplitCounts3(*(int(v) for v in _split3_nb(qsl, upper, t, mq, thr)))


def reorder_decodes_and_prefills(
    num_computed_tokens: npt.ArrayLike,
    num_scheduled_tokens: npt.ArrayLike,
    num_prompt_tokens: npt.ArrayLike,
    *,
    decode_threshold: int = 1,
) -> Reorder:
    """The row swaps vLLM makes to order a batch decode -> short extend -> long extend -> prefill.

    Each row gets a region (docs/semantics.md, "reorder_decodes_and_prefills"): 0 decode (``c > 0``, ``q <= threshold``,
    ``c >= P``), 1 short extend (``c > 0``, ``q <= threshold``, ``c < P``), 2 long extend (``c > 0``,
    ``q > threshold``), 3 prefill (``c == 0``). Only rows whose region differs from their slot's
    target region move: stably sorted by region they are mapped onto those slots in ascending order,
    and the map is applied as cycles of swaps, exactly as vLLM does. The order inside a region may
    change; this is not a stable sort.

    This computes the swaps; it does not move anything. The caller applies :class:`Reorder` to its
    own per-request state (see there).

    Parameters
    ----------
    num_computed_tokens : (num_reqs,) int32, host
        Tokens already computed (``c``), real rows only.
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled this step (``q``).
    num_prompt_tokens : (num_reqs,) int32, host
        Prompt lengths (``P``).
    decode_threshold : int
        Longest query that counts as a decode (the runner's ``reorder_batch_threshold``), >= 1.

    Returns
    -------
    Reorder
        ``swaps`` (num_swaps, 2) int32 and ``permutation`` (num_reqs,) int32, host; empty swaps and the
        identity when the batch is already ordered.

    Raises
    ------
    TypeError
        An array is a torch tensor or not an integer array; the threshold is not an int.
    ValueError
        Length mismatch, a negative count or a threshold below 1.

    Examples
    --------
    A prefill, a long extend and two decodes; the decodes are rows 2 and 3:

    >>> r = reorder_decodes_and_prefills([0, 4, 9, 7], [5, 6, 1, 1], [5, 12, 9, 7])
    >>> r.swaps
    array([[2, 0],
           [2, 3],
           [2, 1]], dtype=int32)
    >>> r.permutation
    array([2, 3, 1, 0], dtype=int32)
    >>> reorder_decodes_and_prefills([9, 4, 0], [1, 6, 5], [9, 12, 5]).modified
    False
    """
    c = as_host_array(num_computed_tokens, "num_computed_tokens")
    n = c.shape[0]
    q = as_host_array(num_scheduled_tokens, "num_scheduled_tokens", length=n)
    prompt = as_host_array(num_prompt_tokens, "num_prompt_tokens", length=n)
    thr = _int_arg(decode_threshold, "decode_threshold", minimum=1)
    swaps = np.empty((n, 2), dtype=np.int32)
    perm = np.empty(n, dtype=np.int32)
    code, i, k = _reorder_nb(c, q, prompt, thr, swaps, perm)
    if code != _OK:
        name, arr = {
            _NEG_COMPUTED: ("num_computed_tokens", c),
            _NEG_SCHEDULED: ("num_scheduled_tokens", q),
            _NEG_PROMPT: ("num_prompt_tokens", prompt),
        }[code]
        raise ValueError(f"{name}[{i}]={int(arr[i])} is negative (request {i}); counts must be >= 0")
    return Reorder(swaps[:k], perm)
