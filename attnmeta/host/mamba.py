"""Mamba-family host derivations: state indices, prefill/decode classification, prefill checkpoints.

- :func:`mamba_state_indices`: vLLM's ``mamba_get_block_table_tensor`` (vllm-semantics.md 5.10),
  gathered on the host from the host block table and the exact sequence lengths.
- :func:`classify_mamba_rows`: the prefill -> decode moves of the Mamba builders' classification
  (6.3 step 3): one-token chunks that continue existing state, and prompt tails padded with
  placeholder drafts.
- :func:`prefill_checkpoints`: the "align"-mode prefill checkpoints (6.8): the offset into each
  prefill's query where a checkpoint state is exported, its block-table column and its state index.
- ``_mamba_fill_nb`` / ``_mamba_fill_packed_nb`` (private): the whole per-step Mamba2 / Mamba1
  builder derivation in one compiled pass (classification, split, state indices, prefill query starts
  and contexts, causal-conv1d programs, chunk-aligned layout), writing into staging bytes at byte
  offsets the builder passes in a parameter vector; used by :mod:`attnmeta.backends.mamba2`, checked
  field by field against the public functions here and in :mod:`attnmeta.host.chunks` /
  :mod:`attnmeta.host.conv1d`.

All numpy in, numpy out, compiled with numba; never imports torch.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, CUDA-graph padding rows included.
- ``num_prefills`` (``P``): prefill rows (the last ``P`` rows of the batch).
- ``max_blocks_per_req`` (``W``): block-table width.
- ``num_state_columns`` (``n``): state columns per row, ``1 + num_speculative_blocks``.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np

from attnmeta._checks import as_host_array, check_out
from attnmeta._numba import njit
from attnmeta.host.chunks import _chunk_layout_nb

__all__ = [
    "CheckpointConfig",
    "PrefillCheckpoints",
    "classify_mamba_rows",
    "gather_checkpoint_state_indices",
    "mamba_state_indices",
    "prefill_checkpoints",
]

_I32 = np.dtype(np.int32)
_EMPTY_I32 = np.zeros(0, dtype=np.int32)


def _i32(value: Any, name: str, ndim: int = 1) -> np.ndarray:
    if type(value) is np.ndarray and value.dtype is _I32 and value.ndim == ndim and value.flags.c_contiguous:
        return value
    return as_host_array(value, name, dtype=np.int32, ndim=ndim)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------------
# state indices (5.10)


@njit
def _state_indices_nb(
    block_table: np.ndarray, seq_lens: np.ndarray, block_size: int, align: bool, out: np.ndarray
) -> int:
    """Fill ``out``; return -1, or the first row whose columns fall outside the table / s < 0."""
    width = block_table.shape[1]
    ncols = out.shape[1]
    for i in range(seq_lens.shape[0]):
        s = int(seq_lens[i])
        if s < 0:
            return i
        start = 0
        if align:
            start = (s - 1) // block_size
            if start < 0:
                start = 0
        if start + ncols > width:
            return i
        for j in range(ncols):
            out[i, j] = block_table[i, start + j]
    return -1


def mamba_state_indices(
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    *,
    mamba_block_size: int,
    mode: Literal["none", "align"],
    num_state_columns: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Mamba state indices per row, vLLM's ``mamba_get_block_table_tensor`` (5.10), host.

    - ``mode="none"``: ``out[i, j] = block_table[i, j]`` (the first ``n`` columns; vLLM returns the
      mamba block table itself, which has exactly ``n`` columns).
    - ``mode="align"``: ``out[i, j] = block_table[i, start_i + j]`` with
      ``start_i = max((seq_lens[i] - 1) // mamba_block_size, 0)``: the last ``n`` blocks of the
      request. A padding row with ``seq_lens == 0`` reads column 0.

    Column 0 of the prefill rows is ``state_indices_tensor_p``; the first ``1 + k`` columns of the
    decode rows are ``state_indices_tensor_d``.

    Parameters
    ----------
    block_table : (>= num_reqs, max_blocks_per_req) int32, host
        The mamba group's block table (padding rows hold ``NULL_BLOCK_ID = 0``).
    seq_lens : (num_reqs,) int32, host
        **Exact** sequence lengths ``c + q`` (what vLLM's device ``seq_lens`` holds; not the async
        spec-decode upper bound). Padding rows 0. Unused values for ``mode="none"`` but still checked.
    mamba_block_size : int
        Mamba block size (``MambaSpec.block_size``), > 0.
    mode : {"none", "align"}
        vLLM's ``mamba_cache_mode``.
    num_state_columns : int
        ``n = 1 + num_speculative_blocks`` (>= 1).
    out : (num_reqs, num_state_columns) int32 ndarray, optional
        Buffer to write into.

    Returns
    -------
    (num_reqs, num_state_columns) int32 ndarray, host

    Raises
    ------
    ValueError
        Unknown ``mode``; non-positive sizes; fewer table rows than ``seq_lens``; a negative
        ``seq_lens``; a row whose columns ``start_i .. start_i + n - 1`` fall outside the table; a wrong
        ``out`` buffer.

    Examples
    --------
    >>> import numpy as np
    >>> bt = np.array([[10, 11, 12, 13], [20, 21, 22, 23], [0, 0, 0, 0]], np.int32)
    >>> mamba_state_indices(bt, np.array([9, 3, 0], np.int32), mamba_block_size=4, mode="align",
    ...                     num_state_columns=2)
    array([[12, 13],
           [20, 21],
           [ 0,  0]], dtype=int32)
    >>> mamba_state_indices(bt, np.array([9, 3, 0], np.int32), mamba_block_size=4, mode="none",
    ...                     num_state_columns=1)[:, 0]
    array([10, 20,  0], dtype=int32)
    """
    if mode not in ("none", "align"):
        raise ValueError(f"mode: must be 'none' or 'align' (vLLM mamba_cache_mode), got {mode!r}")
    bs = _positive_int(mamba_block_size, "mamba_block_size")
    ncols = _positive_int(num_state_columns, "num_state_columns")
    bt = _i32(block_table, "block_table", ndim=2)
    sl = _i32(seq_lens, "seq_lens")
    num_rows = sl.shape[0]
    if bt.shape[0] < num_rows:
        raise ValueError(f"block_table: has {bt.shape[0]} rows, need one per seq_lens entry ({num_rows})")
    res = check_out(out, "mamba_state_indices", (num_rows, ncols), np.int32)
    bad = int(_state_indices_nb(bt, sl, bs, mode == "align", res))
    if bad >= 0:
        s = int(sl[bad])
        if s < 0:
            raise ValueError(f"seq_lens[{bad}]={s} is negative (request {bad}); counts must be >= 0")
        start = max((s - 1) // bs, 0) if mode == "align" else 0
        raise ValueError(
            f"block_table: row {bad} needs columns {start}..{start + ncols - 1} "
            f"(seq_lens[{bad}]={s}, mamba_block_size={bs}, mode={mode!r}, num_state_columns={ncols}) "
            f"but the table has {bt.shape[1]} columns (request {bad})"
        )
    return res


# --------------------------------------------------------------------------------------------------
# classification (6.3 step 3)


@njit
def _classify_nb(
    qsl: np.ndarray,
    ub: np.ndarray,
    is_prefilling: np.ndarray,
    drafts: np.ndarray,
    has_drafts: bool,
    out: np.ndarray,
) -> int:
    """Fill ``out``; return the number of moved rows, or ``-1 - (row * 4 + code)`` on bad input."""
    moved = 0
    for i in range(ub.shape[0]):
        qh = int(qsl[i + 1]) - int(qsl[i])
        if qh < 0:
            return -1 - (i * 4 + 1)
        stateful = is_prefilling[i] and int(ub[i]) > qh
        move = stateful and qh == 1
        if has_drafts:
            d = int(drafts[i])
            if d < -1:
                return -1 - (i * 4 + 2)
            if stateful and d >= 0 and qh == d + 1:
                move = True
        if move:
            moved += 1
            out[i] = False
        else:
            out[i] = is_prefilling[i]
    return moved


def classify_mamba_rows(
    query_start_loc_cpu: np.ndarray,
    seq_lens_upper_bound: np.ndarray,
    is_prefilling: np.ndarray,
    num_decode_draft_tokens: np.ndarray | None = None,
    *,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, bool]:
    """``is_prefilling`` after the Mamba builders' prefill -> decode moves (6.3 step 3), host.

    With ``qh = diff(query_start_loc_cpu)``, a row is *stateful* when ``is_prefilling[i]`` and
    ``seq_lens_upper_bound[i] > qh[i]`` (it continues existing state). A stateful row moves to the
    decode side (its flag is cleared) when ``qh == 1`` (a one-token prompt chunk), or, with drafts,
    when ``drafts >= 0`` and ``qh == drafts + 1`` (a prompt tail padded with placeholder drafts so the
    uniform ``K + 1`` CUDA graph still applies). The input is never modified.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
        Query start locations of the whole batch (non-decreasing).
    seq_lens_upper_bound : (num_reqs,) int32, host
        vLLM's ``seq_lens_cpu_upper_bound`` (padding rows 0).
    is_prefilling : (num_reqs,) bool, host
        ``num_computed < num_prompt`` per row (padding rows False).
    num_decode_draft_tokens : (num_reqs,) int32, host, optional
        The runner's ``num_decode_draft_tokens_cpu`` (``-1`` where not a draft-decode row); pass it
        only under spec decode.
    out : (num_reqs,) bool ndarray, optional
        Buffer to write into (must not be ``is_prefilling`` itself if you still need it).

    Returns
    -------
    is_prefilling_after_moves : (num_reqs,) bool ndarray, host
        A new array (or ``out``).
    moved : bool
        Whether any row moved (vLLM then replaces ``is_prefilling`` on the CAM).

    Raises
    ------
    ValueError
        Length mismatches, a decreasing ``query_start_loc_cpu``, a draft count below -1.
    TypeError
        ``is_prefilling`` not bool, or a torch tensor passed.

    Examples
    --------
    >>> import numpy as np
    >>> qsl = np.array([0, 1, 2, 5, 7], np.int32)
    >>> ub = np.array([9, 1, 8, 6], np.int32)
    >>> isp = np.array([True, True, True, True])
    >>> classify_mamba_rows(qsl, ub, isp)
    (array([False,  True,  True,  True]), True)
    >>> classify_mamba_rows(qsl, ub, isp, np.array([-1, -1, 2, -1], np.int32))
    (array([False,  True, False,  True]), True)
    """
    qsl = _i32(query_start_loc_cpu, "query_start_loc_cpu")
    ub = _i32(seq_lens_upper_bound, "seq_lens_upper_bound")
    num_rows = ub.shape[0]
    if qsl.shape[0] != num_rows + 1:
        raise ValueError(
            f"query_start_loc_cpu: expected length num_reqs + 1 = {num_rows + 1}, got shape {qsl.shape}"
        )
    isp = is_prefilling
    if not (type(isp) is np.ndarray and isp.dtype == np.bool_ and isp.ndim == 1 and isp.flags.c_contiguous):
        isp = as_host_array(isp, "is_prefilling", dtype=np.bool_)
    if isp.shape[0] != num_rows:
        raise ValueError(f"is_prefilling: expected length num_reqs = {num_rows}, got shape {isp.shape}")
    if num_decode_draft_tokens is None:
        drafts, has = _EMPTY_I32, False
    else:
        drafts, has = _i32(num_decode_draft_tokens, "num_decode_draft_tokens"), True
        if drafts.shape[0] != num_rows:
            raise ValueError(
                f"num_decode_draft_tokens: expected length num_reqs = {num_rows}, got shape {drafts.shape}"
            )
    res = check_out(out, "is_prefilling_after_moves", (num_rows,), np.bool_)
    status = int(_classify_nb(qsl, ub, isp, drafts, has, res))
    if status < 0:
        enc = -1 - status
        row, code = enc // 4, enc % 4
        if code == 1:
            raise ValueError(
                f"query_start_loc_cpu[{row + 1}]={int(qsl[row + 1])} < query_start_loc_cpu[{row}]="
                f"{int(qsl[row])} (request {row}): query_start_loc_cpu must be non-decreasing"
            )
        raise ValueError(
            f"num_decode_draft_tokens[{row}]={int(drafts[row])} < -1 (request {row}); use -1 for rows "
            f"that are not draft-decode rows"
        )
    return res, status > 0


# --------------------------------------------------------------------------------------------------
# the fused Mamba2 / Mamba1 builder kernels (used by attnmeta.backends.mamba2)


# Parameters of _mamba_fill_nb: an int64 vector at the start of the host-only buffer ``hbuf`` (so
# the call boxes few arguments): sizes and flags, then the byte offsets of the staged fields in
# ``buf`` and of the host-only arrays in ``hbuf``. Internal to attnmeta.backends.mamba2.
FILL_B, FILL_NCOLS, FILL_THRESHOLD, FILL_CHUNK, FILL_BSM, FILL_ALIGN, FILL_CONV, FILL_CHUNKS = range(8)
FILL_ACC, FILL_MB, FILL_NB = range(8, 11)
(FILL_O_SI_D, FILL_O_ACC, FILL_O_SI_P, FILL_O_QSL_P, FILL_O_INIT, FILL_O_CU, FILL_O_SIDX, FILL_O_LAST, FILL_O_BP,
 FILL_O_OP, FILL_H_NC, FILL_H_NUMS, FILL_H_MOVED) = range(16, 29)
# where _mamba_fill_packed_nb finds the common metadata's host arrays: byte offsets into the slot
# bytes (qsl, seq_lens, block table and its width) and into the common's host-only bytes
(FILL_C_QSL, FILL_C_SL, FILL_C_BT, FILL_C_W, FILL_C_UB, FILL_C_ISP, FILL_C_DRAFTS) = range(32, 39)
FILL_PARAMS = 40
CONV1D_BLOCK_M = 8
"""vLLM's ``BLOCK_M`` of the causal-conv1d programs (the only value it uses)."""

# status codes of _mamba_fill_nb, encoded as ``-1 - (row * 8 + code)``
FILL_E_QSL = 1  # a decreasing query_start_loc (classification)
FILL_E_DRAFTS = 2  # a draft count below -1 (classification)
FILL_E_TABLE_D = 3  # a decode row's state columns fall outside the block table (or s < 0)
FILL_E_TABLE_P = 4  # a prefill row's state column falls outside the block table (or s < 0)
FILL_E_CONTEXT = 5  # a prefill row's seq_lens_upper_bound < its query length
FILL_E_CAPACITY = 6  # a staged buffer is smaller than the step needs (a bad bound: a bug)


@njit
def _state_start(s: int, block_size: int, align: bool) -> int:
    if not align:
        return 0
    start = (s - 1) // block_size
    return start if start > 0 else 0


@njit
def _fill_minus_one(a: np.ndarray, start: int, stop: int, known_lo: int, known_hi: int) -> None:
    """``a[start:stop] = -1`` except rows ``[known_lo, known_hi)``, which already hold -1 (1-D slices:
    the loops vectorize)."""
    for lo, hi in ((start, min(stop, known_lo)), (max(start, known_hi), stop)):
        if hi > lo:
            seg = a[lo:hi]
            for t in range(hi - lo):
                seg[t] = -1


@njit
def _mamba_fill_nb(
    qsl: np.ndarray,
    ub: np.ndarray,
    is_prefilling: np.ndarray,
    drafts: np.ndarray,
    sl: np.ndarray,
    bt: np.ndarray,
    accepted: np.ndarray,
    buf: np.ndarray,
    hbuf: np.ndarray,
    mlist: np.ndarray,
    num_tokens: int,
    bp_lo: int,
    bp_hi: int,
    op_lo: int,
    op_hi: int,
) -> tuple[int, int, int, int, int, int, bool]:
    """One step of the Mamba2 (and Mamba1) builder in one pass: classification, split and every
    per-step array, written straight into staging bytes.

    Inputs are the common metadata's host ``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``,
    ``is_prefilling``, ``num_decode_draft_tokens_cpu`` (empty without spec decode), ``seq_lens_cpu``
    (exact) and ``block_table_cpu`` (``B`` rows), and ``num_actual_tokens``. The parameters (sizes,
    flags, byte offsets: the ``FILL_*`` indices) are the int64 vector at the start of ``hbuf``.

    1. Classification (6.3 step 3, as :func:`_classify_nb`; the flags after the moves go to
       ``hbuf``) and split (step 4): the first row with ``q > threshold`` or still prefilling after
       the moves, which is ``split_decodes_and_prefills(..., treat_short_extends_as_decodes=False)``
       (5.1: with ``require_uniform=False`` its first-row and shortcut rules give the same
       boundary). ``D`` decodes, then ``P = B - D`` prefills.
    2. Into ``buf`` (fields staged for ``B`` rows; the first ``D`` / ``P`` are written):
       ``state_indices_tensor_d`` ``(B, ncols)`` (5.10: ``bt[i, start_i + j]``),
       ``num_accepted_tokens`` (``FILL_ACC`` 1: ``diff(qsl[:D + 1])``; 2: ``accepted[i]``, 1 past its
       end), ``state_indices_tensor_p`` (column ``start_i`` of the prefill rows),
       ``query_start_loc_p`` (``qsl[D:] - qsl[D]``), ``has_initial_states_p`` and, in ``hbuf``,
       ``num_computed_tokens_p = ub[D:] - q`` (6.4).
    3. With ``FILL_CONV``: ``batch_ptr`` / ``token_chunk_offset_ptr`` (5.8; ``-1`` from ``tot`` to
       ``2 * max(1024, tot)``, except rows ``[bp_lo, bp_hi)`` / ``[op_lo, op_hi)`` that the caller
       knows already hold ``-1``), ``nums`` (int32, in ``hbuf``) and ``mlist`` (int64, the caller's
       array of at least ``FILL_MB // 2`` rows: the builder shares one per ring slot). One 1-D slice
       per row and array, so every fill loop vectorizes.
    4. With ``FILL_CHUNKS``: ``cu_chunk_seqlen_p`` / ``seq_idx_p`` / ``last_chunk_indices_p``, the
       chunk-aligned layout of :func:`attnmeta.host.chunks.chunk_metadata` without checkpoints (6.5).

    The causal-conv1d and chunk fields hold ``FILL_MB`` / ``FILL_NB`` rows, bounds that the caller
    derives from ``B`` and ``num_tokens``; rows past what the step needs are not written.

    Returns ``(status, num_moved, D, num_decode_tokens, tot, num_chunks, prep_initial_states)``;
    ``status`` is 0 or ``-1 - (row * 8 + code)`` (``FILL_E_*``), unreachable for staged common
    metadata.
    """
    prm = hbuf[: 8 * FILL_PARAMS].view(np.int64)
    B = prm[FILL_B]
    threshold = prm[FILL_THRESHOLD]
    o = prm[FILL_H_MOVED]
    moved = hbuf[o : o + B].view(np.bool_)
    # ---- classification and split
    has_drafts = drafts.shape[0] > 0
    num_moved = 0
    D = B
    for i in range(B):
        qh = int(qsl[i + 1]) - int(qsl[i])
        if qh < 0:
            return -1 - (i * 8 + FILL_E_QSL), 0, 0, 0, 0, 0, False
        p = is_prefilling[i]
        d = -1
        if has_drafts:
            d = int(drafts[i])
            if d < -1:
                return -1 - (i * 8 + FILL_E_DRAFTS), 0, 0, 0, 0, 0, False
        if p and int(ub[i]) > qh and (qh == 1 or (d >= 0 and qh == d + 1)):
            num_moved += 1  # a stateful one-token chunk, or a prompt tail padded with drafts
            p = False
        moved[i] = p
        if D == B and (qh > threshold or p):
            D = i
    P = B - D
    dt = int(qsl[D]) if P else num_tokens
    # ---- decode rows: 1 + k state columns
    ncols = prm[FILL_NCOLS]
    bsm = prm[FILL_BSM]
    align = prm[FILL_ALIGN] != 0
    width = bt.shape[1]
    o = prm[FILL_O_SI_D]
    si_d = buf[o : o + 4 * D * ncols].view(np.int32)
    for i in range(D):
        s = int(sl[i])
        start = _state_start(s, bsm, align)
        if s < 0 or start + ncols > width:
            return -1 - (i * 8 + FILL_E_TABLE_D), 0, 0, 0, 0, 0, False
        for j in range(ncols):
            si_d[i * ncols + j] = bt[i, start + j]
    acc_mode = prm[FILL_ACC]
    if acc_mode != 0:
        o = prm[FILL_O_ACC]
        acc = buf[o : o + 4 * D].view(np.int32)
        if acc_mode == 1:
            for i in range(D):
                acc[i] = qsl[i + 1] - qsl[i]
        else:
            na = accepted.shape[0]
            for i in range(D):
                acc[i] = accepted[i] if i < na else 1
    # ---- prefill rows: column start_i of their state indices
    o = prm[FILL_O_SI_P]
    si_p = buf[o : o + 4 * P].view(np.int32)
    for j in range(P):
        r = D + j
        s = int(sl[r])
        start = _state_start(s, bsm, align)
        if s < 0 or start + 1 > width:
            return -1 - (r * 8 + FILL_E_TABLE_P), 0, 0, 0, 0, 0, False
        si_p[j] = bt[r, start]
    if P == 0:
        return 0, num_moved, D, dt, 0, 0, False
    if prm[FILL_O_QSL_P] < 0:  # the caller staged no prefill fields
        return -1 - (D * 8 + FILL_E_CAPACITY), 0, 0, 0, 0, 0, False
    # ---- prefill query starts, contexts, initial-state flags (6.4)
    o = prm[FILL_O_QSL_P]
    qsl_p = buf[o : o + 4 * (P + 1)].view(np.int32)
    o = prm[FILL_O_INIT]
    init = buf[o : o + P].view(np.bool_)
    o = prm[FILL_H_NC]
    nc = hbuf[o : o + 4 * P].view(np.int32)
    qsl_p[0] = 0
    prep = False
    for j in range(P):
        lo = int(qsl[D + j])
        hi = int(qsl[D + j + 1])
        qsl_p[j + 1] = hi - dt
        c = int(ub[D + j]) - (hi - lo)
        if c < 0:
            return -1 - ((D + j) * 8 + FILL_E_CONTEXT), 0, 0, 0, 0, 0, False
        nc[j] = c
        init[j] = c > 0
        if c > 0:
            prep = True
    # ---- causal-conv1d programs (5.8)
    tot = 0
    if prm[FILL_CONV] != 0:
        mb = prm[FILL_MB]
        o = prm[FILL_O_BP]
        bp = buf[o : o + 4 * mb].view(np.int32)
        o = prm[FILL_O_OP]
        op = buf[o : o + 4 * mb].view(np.int32)
        o = prm[FILL_H_NUMS]
        nums = hbuf[o : o + 4 * P].view(np.int32)
        if mlist.shape[0] < mb // 2:
            return -1 - (D * 8 + FILL_E_CAPACITY), 0, 0, 0, 0, 0, False
        k = 0
        for j in range(P):
            m = (int(qsl[D + j + 1]) - int(qsl[D + j]) + CONV1D_BLOCK_M - 1) // CONV1D_BLOCK_M
            nums[j] = m
            if 2 * (k + m) > mb:
                return -1 - ((D + j) * 8 + FILL_E_CAPACITY), 0, 0, 0, 0, 0, False
            seg = bp[k : k + m]
            for t in range(m):
                seg[t] = j
            seg = op[k : k + m]
            for t in range(m):
                seg[t] = t
            seg64 = mlist[k : k + m]
            for t in range(m):
                seg64[t] = j
            k += m
        tot = k
        total = 2 * max(1024, tot)
        if total > mb:
            return -1 - FILL_E_CAPACITY, 0, 0, 0, 0, 0, False
        # -1 on [tot, total), except the rows the caller knows already hold -1
        _fill_minus_one(bp, tot, total, bp_lo, bp_hi)
        _fill_minus_one(op, tot, total, op_lo, op_hi)
    # ---- the chunk-aligned SSD layout (6.5)
    count = 0
    if prm[FILL_CHUNKS] != 0:
        C = prm[FILL_CHUNK]
        nb = prm[FILL_NB]
        o = prm[FILL_O_CU]
        cu = buf[o : o + 4 * (nb + 1)].view(np.int32)
        o = prm[FILL_O_SIDX]
        sidx = buf[o : o + 4 * nb].view(np.int32)
        o = prm[FILL_O_LAST]
        last = buf[o : o + 4 * P].view(np.int32)
        # The one chunking kernel of host/chunks.py (no checkpoint offsets). Its per-row checkpoint
        # index output (-1 here) goes to ``last``, which the same row then overwrites with its last chunk.
        count = _chunk_layout_nb(C, nc, qsl_p, nc[:0], False, cu, sidx, last, last)
        if count < 0 or count > nb:  # unreachable: the inputs are validated and nb is an upper bound
            return -1 - (D * 8 + FILL_E_CAPACITY), 0, 0, 0, 0, 0, False
    return 0, num_moved, D, dt, tot, count, prep


@njit
def _mamba_fill_packed_nb(
    buf: np.ndarray,
    cbuf: np.ndarray,
    hbuf: np.ndarray,
    mlist: np.ndarray,
    accepted: np.ndarray,
    num_tokens: int,
    bp_lo: int,
    bp_hi: int,
    op_lo: int,
    op_hi: int,
) -> tuple[int, int, int, int, int, int, bool]:
    """:func:`_mamba_fill_nb` with the common metadata's host arrays addressed inside the slot bytes
    ``buf`` (``query_start_loc_cpu``, ``seq_lens_cpu``, ``block_table_cpu``) and the common's
    host-only bytes ``cbuf`` (``seq_lens_cpu_upper_bound``, ``is_prefilling``, and
    ``num_decode_draft_tokens_cpu`` unless ``FILL_C_DRAFTS`` is -1), at the byte offsets of the
    ``FILL_C_*`` parameters: six fewer arrays to box per call.
    """
    prm = hbuf[: 8 * FILL_PARAMS].view(np.int64)
    B = prm[FILL_B]
    W = prm[FILL_C_W]
    o = prm[FILL_C_QSL]
    qsl = buf[o : o + 4 * (B + 1)].view(np.int32)
    o = prm[FILL_C_SL]
    sl = buf[o : o + 4 * B].view(np.int32)
    o = prm[FILL_C_BT]
    bt = buf[o : o + 4 * B * W].view(np.int32).reshape(B, W)
    o = prm[FILL_C_UB]
    ub = cbuf[o : o + 4 * B].view(np.int32)
    o = prm[FILL_C_ISP]
    isp = cbuf[o : o + B].view(np.bool_)
    o = prm[FILL_C_DRAFTS]
    drafts = cbuf[o : o + 4 * B].view(np.int32) if o >= 0 else cbuf[0:0].view(np.int32)
    return _mamba_fill_nb(qsl, ub, isp, drafts, sl, bt, accepted, buf, hbuf, mlist, num_tokens, bp_lo, bp_hi, op_lo,
                          op_hi)


# --------------------------------------------------------------------------------------------------
# prefill checkpoints (6.8)


class CheckpointConfig(NamedTuple):
    """Static configuration of "align"-mode Mamba prefill checkpoints (vllm-semantics.md 6.8).

    Checkpoints are only active when ``mamba_cache_mode == "align"`` and the mamba spec has
    ``num_prefill_checkpoint_blocks > 0``; otherwise do not call :func:`prefill_checkpoints`.
    """

    hash_block_size: int
    """Prefix-cache hash unit in tokens (vLLM: ``cache_config.prefix_match_unit or block_size``)."""
    cache_hit_alignment_tokens: int
    """Granularity ``H`` of prefix-cache hits; the checkpoint position is a multiple of it."""
    mamba_block_size: int
    """Mamba block size ``bs_m`` (``MambaSpec.block_size``)."""
    checkpoint_alignment: int | None
    """``MambaSpec.prefill_checkpoint_alignment``: the offset into the query must be a multiple of
    it; ``None`` disables checkpoints (every row invalid)."""
    num_hash_lookahead_tokens: int = 0
    """Tokens kept out of the hit at the end of the sequence (at least 1 is always kept unless
    ``drop_eagle_block``)."""
    drop_eagle_block: bool = False
    """EAGLE block drop (``speculative_config.use_eagle_block_drop()``): the checkpoint moves back one
    ``H`` and no lookahead is subtracted."""


class PrefillCheckpoints(NamedTuple):
    """Per-prefill-row checkpoint locations (vLLM's ``MambaPrefillCheckpointMetadata``, host side)."""

    offsets: np.ndarray
    """(num_prefills,) int32, host. Offset of the checkpoint into each row's query (0: none): the
    ``checkpoint_offsets`` of :func:`attnmeta.host.chunks.chunk_metadata` and the device
    ``checkpoint_offsets``."""
    cols: np.ndarray
    """(num_prefills,) int64, host. Block-table column of the checkpoint state,
    ``cdiv(s, bs_m) - 2``, or -1 (vLLM's ``block_cols``)."""
    state_indices: np.ndarray | None
    """(num_prefills,) int32, host: ``where(cols >= 0, block_table_p[row, cols], 0)``; ``None`` when
    no block table was given."""


@njit
def _checkpoints_nb(
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    hash_block: int,
    hit_align: int,
    mamba_bs: int,
    ckpt_align: int,
    lookahead: int,
    drop_eagle: bool,
    offsets: np.ndarray,
    cols: np.ndarray,
) -> int:
    """Fill offsets/cols; return the number of valid rows or ``-1 - (row * 4 + code)``."""
    valid_rows = 0
    for i in range(seq_lens.shape[0]):
        s = int(seq_lens[i])
        q = int(query_lens[i])
        if q < 0:
            return -1 - (i * 4 + 1)
        if s < q:
            return -1 - (i * 4 + 2)
        qs = s - q
        lim = s if drop_eagle else s - (lookahead if lookahead > 1 else 1)
        pos = (lim // hit_align) * hit_align
        if drop_eagle:
            pos -= hit_align
        if pos < 0:
            pos = 0
        col = (s + mamba_bs - 1) // mamba_bs - 2
        valid = (
            ckpt_align > 0
            and qs % hash_block == 0
            and col > (qs - 1) // mamba_bs
            and qs + hash_block <= pos
            and qs < pos
            and pos < s
            and (pos - qs) % ckpt_align == 0
        )
        if valid:
            offsets[i] = pos - qs
            cols[i] = col
            valid_rows += 1
        else:
            offsets[i] = 0
            cols[i] = -1
    return valid_rows


@njit
def _gather_ckpt_nb(block_table: np.ndarray, cols: np.ndarray, out: np.ndarray) -> int:
    """``out[i] = block_table[i, cols[i]]`` where ``cols[i] >= 0`` else 0; first bad row or -1."""
    width = block_table.shape[1]
    for i in range(cols.shape[0]):
        c = cols[i]
        if c >= width:
            return i
        out[i] = block_table[i, c] if c >= 0 else 0
    return -1


def _gather(block_table_p: Any, cols: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    bt = _i32(block_table_p, "block_table_p", ndim=2)
    num_rows = cols.shape[0]
    if bt.shape[0] < num_rows:
        raise ValueError(f"block_table_p: has {bt.shape[0]} rows, need one per prefill row ({num_rows})")
    res = check_out(out, "checkpoint_state_indices", (num_rows,), np.int32)
    bad = int(_gather_ckpt_nb(bt, cols, res))
    if bad >= 0:
        raise ValueError(
            f"block_table_p: prefill row {bad} has its checkpoint in column {int(cols[bad])} but the "
            f"table has {bt.shape[1]} columns (checkpoints use the upper-bound sequence length: the block "
            f"table must cover seq_lens_upper_bound, whose blocks the engine has allocated)"
        )
    return res


def gather_checkpoint_state_indices(
    block_table_p: np.ndarray, cols: np.ndarray, *, out: np.ndarray | None = None
) -> np.ndarray:
    """Checkpoint state indices ``where(cols >= 0, block_table_p[row, cols], 0)``, host.

    vLLM's ``regather_state_indices``: re-derive the state indices for another KV-cache group's block
    table from :attr:`PrefillCheckpoints.cols`.

    Parameters
    ----------
    block_table_p : (>= num_prefills, max_blocks_per_req) int32, host
        Block-table rows of the prefill rows, in prefill order.
    cols : (num_prefills,) int64, host
        :attr:`PrefillCheckpoints.cols` (-1 where a row has no checkpoint).
    out : (num_prefills,) int32 ndarray, optional
        Buffer to write into.

    Returns
    -------
    (num_prefills,) int32 ndarray, host

    Raises
    ------
    ValueError
        Too few table rows, a column beyond the table, a wrong ``out`` buffer.

    Examples
    --------
    >>> import numpy as np
    >>> gather_checkpoint_state_indices(np.array([[5, 6, 7], [8, 9, 10]], np.int32), np.array([-1, 1]))
    array([0, 9], dtype=int32)
    """
    c = as_host_array(cols, "cols", dtype=np.int64)
    return _gather(block_table_p, c, out)


def prefill_checkpoints(
    seq_lens_upper_bound_p: np.ndarray,
    query_lens_p: np.ndarray,
    block_table_p: np.ndarray | None = None,
    *,
    config: CheckpointConfig,
    out: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None,
) -> PrefillCheckpoints | None:
    """Prefill checkpoints of vLLM's "align" mamba cache mode (vllm-semantics.md 6.8), host.

    Per prefill row with ``s = seq_lens_upper_bound_p[i]``, ``q = query_lens_p[i]``, ``qs = s - q``:

    - position: ``lim = s`` if ``drop_eagle_block`` else ``s - max(1, num_hash_lookahead_tokens)``;
      ``pos = floor(lim / H) * H`` (``H = cache_hit_alignment_tokens``), minus ``H`` with
      ``drop_eagle_block``, clamped at 0;
    - valid iff ``checkpoint_alignment`` is set, ``qs % hash_block_size == 0``,
      ``cdiv(s, bs_m) - 2 > (qs - 1) // bs_m``, ``qs + hash_block_size <= pos``, ``qs < pos < s`` and
      ``(pos - qs) % checkpoint_alignment == 0``;
    - ``offset = pos - qs`` and ``col = cdiv(s, bs_m) - 2`` when valid, else 0 and -1.

    Parameters
    ----------
    seq_lens_upper_bound_p : (num_prefills,) int32, host
        ``seq_lens_cpu_upper_bound`` of the prefill rows (exact for prefill rows).
    query_lens_p : (num_prefills,) int32, host
        Query lengths of the prefill rows, ``diff(query_start_loc_p)``.
    block_table_p : (>= num_prefills, max_blocks_per_req) int32, host, optional
        Block-table rows of the prefill rows; when given, ``state_indices`` are gathered.
    config : CheckpointConfig
        Static checkpoint configuration.
    out : (offsets, cols, state_indices), optional
        ``(num_prefills,)`` int32 / int64 / int32 buffers (``state_indices`` may be None).

    Returns
    -------
    PrefillCheckpoints or None
        ``None`` when every offset is 0 (vLLM returns no checkpoint metadata), including
        ``num_prefills == 0``.

    Raises
    ------
    ValueError
        Non-positive sizes in ``config``; length mismatches; ``q < 0`` or ``s < q``; a checkpoint
        column beyond the block table; wrong ``out`` buffers.

    Examples
    --------
    >>> import numpy as np
    >>> cfg = CheckpointConfig(hash_block_size=4, cache_hit_alignment_tokens=4, mamba_block_size=4,
    ...                        checkpoint_alignment=4)
    >>> bt = np.arange(12, dtype=np.int32).reshape(2, 6)
    >>> r = prefill_checkpoints(np.array([17, 3], np.int32), np.array([17, 3], np.int32), bt, config=cfg)
    >>> r.offsets, r.cols, r.state_indices
    (array([16,  0], dtype=int32), array([ 3, -1]), array([3, 0], dtype=int32))
    >>> prefill_checkpoints(np.array([9], np.int32), np.array([1], np.int32), config=cfg) is None
    True
    """
    if not isinstance(config, CheckpointConfig):
        raise TypeError(f"config: expected CheckpointConfig, got {type(config).__name__}")
    hb = _positive_int(config.hash_block_size, "config.hash_block_size")
    hit = _positive_int(config.cache_hit_alignment_tokens, "config.cache_hit_alignment_tokens")
    mbs = _positive_int(config.mamba_block_size, "config.mamba_block_size")
    align = 0
    if config.checkpoint_alignment is not None:
        align = _positive_int(config.checkpoint_alignment, "config.checkpoint_alignment")
    look = int(config.num_hash_lookahead_tokens)
    if look < 0:
        raise ValueError(f"config.num_hash_lookahead_tokens: must be >= 0, got {look}")
    s = _i32(seq_lens_upper_bound_p, "seq_lens_upper_bound_p")
    q = _i32(query_lens_p, "query_lens_p")
    num_rows = s.shape[0]
    if q.shape[0] != num_rows:
        raise ValueError(
            f"query_lens_p: expected length num_prefills = {num_rows} (seq_lens_upper_bound_p), got shape {q.shape}"
        )
    if out is None:
        offsets = np.empty(num_rows, dtype=_I32)
        cols = np.empty(num_rows, dtype=np.int64)
        si_out = None
    else:
        offsets = check_out(out[0], "checkpoint offsets", (num_rows,), np.int32)
        cols = check_out(out[1], "checkpoint cols", (num_rows,), np.int64)
        si_out = out[2]
    status = int(
        _checkpoints_nb(s, q, hb, hit, mbs, align, look, bool(config.drop_eagle_block), offsets, cols)
    )
    if status < 0:
        enc = -1 - status
        row, code = enc // 4, enc % 4
        if code == 1:
            raise ValueError(f"query_lens_p[{row}]={int(q[row])} is negative (prefill row {row})")
        raise ValueError(
            f"seq_lens_upper_bound_p[{row}]={int(s[row])} < query_lens_p[{row}]={int(q[row])} "
            f"(prefill row {row}); a sequence length includes the query"
        )
    if status == 0:
        return None
    state = None if block_table_p is None else _gather(block_table_p, cols, si_out)
    return PrefillCheckpoints(offsets, cols, state)
