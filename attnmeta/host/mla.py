"""MLA host derivations (docs/semantics-attention.md, "MLA"): the chunked-context plan, workspace sizing,
and the decode-side helpers of vLLM 0.33.0's dense MLA builders.

vLLM packs the prefill rows' cached contexts (``ctx_i = seq_len_i - query_len_i``) into
workspace-sized *chunks*: a chunk is a contiguous run of prefill rows with context, only its first row
may continue a row split in the previous chunk, and a row without context ends the current chunk.
:func:`plan_context_chunks` reproduces that planner (``plan_mla_context_chunks`` plus the flattening
of ``build_mla_chunked_context_metadata``), DCP variant included, in compiled code; every per-chunk
device field is a slice of one flat array, so a builder stages all of them in its step's one copy.

Shape legend
------------
- ``num_prefills``: prefill rows ``P`` (rows ``[num_decodes, num_reqs)`` of the batch).
- ``num_pieces``: row pieces over all chunks (a row split across ``k`` chunks is ``k`` pieces).
- ``num_chunks``: chunks.
- ``num_cu``: entries of the flat indptr lists (``num_pieces + num_chunks`` plus ``align_indptr``
  padding).
- ``num_context_tokens``: gathered context rows over all chunks (``seq_lens.sum()``).
- ``num_local_context_tokens``: DCP: local rows over all chunks.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from attnmeta._checks import as_host_array
from attnmeta._numba import njit
from attnmeta.host.flash_attn import _dcp_local_len  # (vLLM's get_dcp_local_seq_lens, one implementation)

__all__ = [
    "MLAContextChunks",
    "dcp_local_context_lens",
    "flattened_row_requests",
    "plan_context_chunks",
    "triton_num_kv_splits",
    "workspace_size",
]

_OK = 0
_NO_FIT = 1
_NEG_CTX = 2


@njit
def _padded_rows(x: int, world: int, interleave: int) -> int:
    """Local rows any rank needs for the first ``x`` context tokens (identity without DCP)."""
    if world <= 1:
        return x
    v = world * interleave
    return (x + v - 1) // v * interleave


@njit
def _plan_nb(
    ctx: np.ndarray, row_budget: int, max_chunk: int, align: int, world: int, interleave: int,
    piece_row: np.ndarray, piece_start: np.ndarray, piece_len: np.ndarray, chunk_piece: np.ndarray,
    write: bool,
) -> tuple[int, int, int, int]:
    """``plan_mla_context_chunks``: pieces ``(row, start, len)`` and each chunk's first piece.

    Returns ``(status, row, num_pieces, num_chunks)``; with ``write`` False only counts."""
    p = ctx.shape[0]
    r = 0
    start = 0
    npc = 0
    nch = 0
    while r < p:
        if ctx[r] < 0:
            return _NEG_CTX, r, 0, 0
        if ctx[r] == 0:
            r += 1
            continue
        if write:
            chunk_piece[nch] = npc
        first_piece = npc
        used = 0
        while r < p and ctx[r] > 0:
            c = int(ctx[r])
            remaining = c - start
            need = _padded_rows(start + remaining, world, interleave) - _padded_rows(start, world, interleave)
            if used + need > row_budget:
                hi = min(max_chunk, (remaining - 1) // align * align) // align
                lo = 0
                while lo < hi:  # largest k with the piece k*align fitting the free rows
                    mid = (lo + hi + 1) // 2
                    ln = mid * align
                    if _padded_rows(start + ln, world, interleave) - _padded_rows(start, world, interleave) \
                            <= row_budget - used:
                        lo = mid
                    else:
                        hi = mid - 1
                ln = lo * align
                if ln > 0:
                    if write:
                        piece_row[npc] = r
                        piece_start[npc] = start
                        piece_len[npc] = ln
                    npc += 1
                    start += ln
                break
            if write:
                piece_row[npc] = r
                piece_start[npc] = start
                piece_len[npc] = remaining
            npc += 1
            used += need
            r += 1
            start = 0
        if npc == first_piece:
            return _NO_FIT, r, 0, 0
        nch += 1
    if write:
        chunk_piece[nch] = npc
    return _OK, 0, npc, nch


@njit
def _cu_size_nb(piece_row: np.ndarray, chunk_piece: np.ndarray, align_indptr: bool) -> int:
    """Entries of the flat indptr lists (``align_indptr``: each chunk starts at a multiple of 4)."""
    n = 0
    for c in range(chunk_piece.shape[0] - 1):
        if align_indptr:
            n += (-n) % 4
        n += chunk_piece[c + 1] - chunk_piece[c] + 1
    return n


@njit
def _flatten_nb(
    ctx: np.ndarray, qsl: np.ndarray, piece_row: np.ndarray, piece_start: np.ndarray, piece_len: np.ndarray,
    chunk_piece: np.ndarray, world: int, interleave: int, align_indptr: bool,
    starts: np.ndarray, cu: np.ndarray, cu_q: np.ndarray, tok2seq: np.ndarray,
    local_lens: np.ndarray, local_cu: np.ndarray, local_tok2seq: np.ndarray, chunk_ints: np.ndarray,
) -> None:
    """The flat per-chunk fields of ``build_mla_chunked_context_metadata`` (step 6)."""
    ncu = 0
    ntok = 0
    nloc = 0
    dcp = world > 1
    for c in range(chunk_piece.shape[0] - 1):
        a = chunk_piece[c]
        b = chunk_piece[c + 1]
        if align_indptr:
            pad = (-ncu) % 4
            for _ in range(pad):
                cu[ncu] = 0
                cu_q[ncu] = 0
                if dcp:
                    local_cu[ncu] = 0
                ncu += 1
        first = piece_row[a]
        last = piece_row[b - 1]
        ci = chunk_ints[c]
        ci[0] = first
        ci[1] = last + 1
        ci[2] = a
        ci[3] = ncu
        ci[4] = ntok
        ci[5] = nloc
        cu[ncu] = 0
        cu_q[ncu] = 0
        if dcp:
            local_cu[ncu] = 0
        tot = 0
        ltot = 0
        mq = 0
        ms = 0
        active = True
        for k in range(a, b):
            row = piece_row[k]
            ln = piece_len[k]
            st = piece_start[k]
            j = k - a
            q = int(qsl[row + 1]) - int(qsl[row])
            if q > mq:
                mq = q
            if ln > ms:
                ms = ln
            if q <= 0 or ln <= 0:
                active = False
            for _ in range(ln):
                tok2seq[ntok] = j
                ntok += 1
            tot += ln
            cu[ncu + j + 1] = tot
            cu_q[ncu + j + 1] = int(qsl[row + 1]) - int(qsl[first])
            if dcp:
                lst = _padded_rows(st, world, interleave)
                lln = _padded_rows(st + ln, world, interleave) - lst
                starts[k] = lst
                local_lens[k] = lln
                for _ in range(lln):
                    local_tok2seq[nloc] = j
                    nloc += 1
                ltot += lln
                local_cu[ncu + j + 1] = ltot
            else:
                starts[k] = st
                ltot += ln
        ncu += b - a + 1
        ci[6] = tot
        ci[7] = ltot
        ci[8] = mq
        ci[9] = ms
        ci[10] = 1 if piece_start[a] > 0 else 0
        ci[11] = 1 if active else 0
        ci[12] = qsl[first]
        ci[13] = qsl[last + 1]
        ci[14] = qsl[first + 1]


@njit
def _allranks_nb(ctx: np.ndarray, world: int, interleave: int, out: np.ndarray) -> None:
    for i in range(ctx.shape[0]):
        for r in range(world):
            out[i, r] = _dcp_local_len(int(ctx[i]), world, r, interleave)


class MLAContextChunks(NamedTuple):
    """The chunked-context plan of one step's prefill rows, flattened (vLLM ``ChunkedContextMetadata``).

    Chunk ``c``'s fields are slices of the flat arrays: its pieces ``[piece_offset[c],
    piece_offset[c + 1])`` of ``starts``/``seq_lens``, its ``n_c + 1`` indptr entries from
    ``cu_offset[c]`` of ``cu_seq_lens``/``cu_seqlens_q``, its ``num_context_tokens[c]`` entries from
    ``token_offset[c]`` of ``token_to_seq``. Row and token indices are prefill-local.
    """

    context_lens: np.ndarray
    """(num_prefills,) int32, host. Context of every prefill row, zeros included."""
    starts: np.ndarray
    """(num_pieces,) int32, host. Context offset where each piece starts (the *local* offset under DCP)."""
    seq_lens: np.ndarray
    """(num_pieces,) int32, host. Each piece's length (global context tokens)."""
    cu_seq_lens: np.ndarray
    """(num_cu,) int32, host. Per chunk ``[0, cumsum(seq_lens)]``, chunks concatenated (with zeros of
    ``align_indptr`` padding before a chunk)."""
    cu_seqlens_q: np.ndarray
    """(num_cu,) int32, host. Per chunk the query starts of its rows rebased to the first row."""
    token_to_seq: np.ndarray
    """(num_context_tokens,) int32, host. Chunk-local row of each gathered context row."""
    padded_local_seq_lens: np.ndarray | None
    """(num_pieces,) int32, host, DCP only. ``padded_rows(start + len) - padded_rows(start)``."""
    padded_local_cu_seq_lens: np.ndarray | None
    """(num_cu,) int32, host, DCP only. Per chunk ``[0, cumsum(padded_local_seq_lens)]``."""
    padded_local_token_to_seq: np.ndarray | None
    """(num_local_context_tokens,) int32, host, DCP only."""
    local_context_lens_allranks: np.ndarray | None
    """(num_prefills, dcp_world_size) int32, host, DCP only. Each rank's share of each context."""
    request_start: np.ndarray
    """(num_chunks,) int64, host. First prefill row of each chunk (``request_slice.start``)."""
    request_end: np.ndarray
    """(num_chunks,) int64, host. ``request_slice.stop``."""
    piece_offset: np.ndarray
    """(num_chunks + 1,) int64, host. Each chunk's first piece; ``[-1] == num_pieces``."""
    cu_offset: np.ndarray
    """(num_chunks,) int64, host. Where each chunk's indptr lists start in the flat lists."""
    token_offset: np.ndarray
    """(num_chunks,) int64, host. Where each chunk's ``token_to_seq`` starts."""
    local_token_offset: np.ndarray
    """(num_chunks,) int64, host. Where each chunk's ``padded_local_token_to_seq`` starts (DCP)."""
    num_context_tokens: np.ndarray
    """(num_chunks,) int64, host. Context rows gathered per chunk."""
    num_local_context_tokens: np.ndarray
    """(num_chunks,) int64, host. Local rows per chunk (== ``num_context_tokens`` without DCP)."""
    max_query_len: np.ndarray
    """(num_chunks,) int64, host. Longest query of each chunk's rows."""
    max_seq_len: np.ndarray
    """(num_chunks,) int64, host. Longest piece of each chunk."""
    is_continuation: np.ndarray
    """(num_chunks,) bool, host. The chunk's first row continues a row split in the previous chunk."""
    all_rows_active: np.ndarray
    """(num_chunks,) bool, host. Every row has q > 0 and a piece > 0."""
    token_start: np.ndarray
    """(num_chunks,) int64, host. ``token_slice.start`` (prefill-local)."""
    token_end: np.ndarray
    """(num_chunks,) int64, host. ``token_slice.stop``."""
    continuation_token_end: np.ndarray
    """(num_chunks,) int64, host. End of the first row's tokens."""
    empty_token_slices: np.ndarray
    """(num_empty, 2) int64, host. ``[start, stop)`` token ranges of the rows without context."""

    @property
    def num_chunks(self) -> int:
        """Chunks of the plan."""
        return int(self.request_start.shape[0])


def workspace_size(max_model_len: int, max_num_seqs: int, block_size: int, dcp_world_size: int = 1,
                   dcp_interleave: int = 1) -> int:
    """vLLM's chunked-prefill workspace rows (``determine_chunked_prefill_workspace_size`` + alignment).

    ``w = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 65536)``, then rounded up to a
    multiple of ``a = block_size`` (DCP: ``lcm(block_size, W * I)``), at least ``a``.

    Examples
    --------
    >>> workspace_size(4096, 256, 64), workspace_size(2048, 8, 16), workspace_size(4096, 256, 64, 3)
    (65536, 16384, 65664)
    >>> workspace_size(1000, 2, 16, 4, 8)
    8000
    """
    for name, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs), ("block_size", block_size),
                    ("dcp_world_size", dcp_world_size), ("dcp_interleave", dcp_interleave)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name}: must be an int >= 1, got {v!r}")
    w = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
    a = block_size if dcp_world_size <= 1 else math.lcm(block_size, dcp_world_size * dcp_interleave)
    return -(-max(w, a) // a) * a


def plan_context_chunks(
    context_lens: npt.ArrayLike,
    query_start_loc: npt.ArrayLike,
    *,
    workspace_size: int,
    block_size: int,
    align_chunk_to_block: bool = True,
    dcp_world_size: int = 1,
    dcp_interleave: int = 1,
    align_indptr: bool = False,
) -> MLAContextChunks | None:
    """Plan and flatten the prefill rows' context chunks (vLLM ``build_mla_chunked_context_metadata``).

    Parameters
    ----------
    context_lens : (num_prefills,) int, host
        Context of each prefill row (``seq_lens - query_lens``).
    query_start_loc : (num_prefills + 1,) int, host
        Prefill-local query starts (``qsl[D:] - qsl[D]``).
    workspace_size : int
        Workspace rows ``WS`` (:func:`workspace_size`); the row budget is ``WS // W`` under DCP.
    block_size : int
        Page size; split starts are multiples of it (``align_chunk_to_block``; DCP: ``lcm`` with ``W*I``).
    align_chunk_to_block : bool, default True
        False: alignment 1 (DCP: ``W*I``).
    dcp_world_size, dcp_interleave : int, default 1
        DCP layout ``W`` and ``I``.
    align_indptr : bool, default False
        Pad the flat indptr lists so each chunk's starts at a multiple of 4 entries (16 bytes).

    Returns
    -------
    MLAContextChunks or None
        None when no prefill row has context (vLLM's ``chunked_context = None``).

    Raises
    ------
    ValueError
        Negative context, mismatched lengths, bad sizes, or a workspace too small for one aligned piece.

    Examples
    --------
    >>> ch = plan_context_chunks([0, 100, 300, 40], [0, 5, 12, 20, 23], workspace_size=256, block_size=16)
    >>> ch.num_chunks, ch.starts.tolist(), ch.seq_lens.tolist(), ch.cu_seq_lens.tolist()
    (2, [0, 0, 144, 0], [100, 144, 156, 40], [0, 100, 244, 0, 156, 196])
    >>> ch.cu_seqlens_q.tolist(), ch.is_continuation.tolist(), ch.empty_token_slices.tolist()
    ([0, 7, 15, 0, 8, 11], [False, True], [[0, 5]])
    """
    ctx = as_host_array(context_lens, "context_lens", dtype=np.int32, ndim=1)
    qsl = as_host_array(query_start_loc, "query_start_loc", dtype=np.int32, ndim=1)
    p = ctx.shape[0]
    if qsl.shape[0] != p + 1:
        raise ValueError(f"query_start_loc: expected {p + 1} entries (num_prefills + 1), got {qsl.shape[0]}")
    for name, v, lo in (("workspace_size", workspace_size, 1), ("block_size", block_size, 1),
                        ("dcp_world_size", dcp_world_size, 1), ("dcp_interleave", dcp_interleave, 1)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
            raise ValueError(f"{name}: must be an int >= {lo}, got {v!r}")
    if p and (ctx < 0).any():
        i = int(np.argmax(ctx < 0))
        raise ValueError(f"context_lens[{i}]={int(ctx[i])} < 0 (prefill row {i})")
    if p == 0 or int(ctx.max()) <= 0:
        return None
    W, inter = int(dcp_world_size), int(dcp_interleave)
    align = int(block_size) if align_chunk_to_block else 1
    budget = int(workspace_size)
    if W > 1:
        align = math.lcm(align, W * inter)
        budget //= W
    max_chunk = int(workspace_size) // align * align
    if max_chunk <= 0:
        raise ValueError(f"workspace_size={workspace_size} is smaller than the split alignment {align}")
    e32 = np.empty(0, np.int32)
    e64 = np.empty(0, np.int64)
    st, row, npc, nch = _plan_nb(ctx, budget, max_chunk, align, W, inter, e32, e32, e32, e64, False)
    if st != _OK:
        raise ValueError(f"workspace_size={workspace_size}: row budget {budget} cannot hold one piece "
                         f"aligned to {align} of prefill row {row}")
    piece_row = np.empty(npc, np.int32)
    piece_start = np.empty(npc, np.int32)
    piece_len = np.empty(npc, np.int32)
    chunk_piece = np.empty(nch + 1, np.int64)
    _plan_nb(ctx, budget, max_chunk, align, W, inter, piece_row, piece_start, piece_len, chunk_piece, True)
    ncu = _cu_size_nb(piece_row, chunk_piece, bool(align_indptr))
    ntok = int(piece_len.sum())
    dcp = W > 1
    starts = np.empty(npc, np.int32)
    cu = np.empty(ncu, np.int32)
    cu_q = np.empty(ncu, np.int32)
    tok = np.empty(ntok, np.int32)
    if dcp:
        # upper bound on local rows: every piece rounds up to at most one extra interleave block
        local_lens = np.empty(npc, np.int32)
        local_cu = np.empty(ncu, np.int32)
        local_tok = np.empty(ntok // W + (npc + 1) * inter + 1, np.int32)
    else:
        local_lens, local_cu, local_tok = e32, e32, e32
    ints = np.zeros((nch, 15), np.int64)
    _flatten_nb(ctx, qsl, piece_row, piece_start, piece_len, chunk_piece, W, inter, bool(align_indptr),
                starts, cu, cu_q, tok, local_lens, local_cu, local_tok, ints)
    allranks = None
    if dcp:
        allranks = np.empty((p, W), np.int32)
        _allranks_nb(ctx, W, inter, allranks)
        local_tok = local_tok[: int(ints[:, 7].sum())]
    empty = np.flatnonzero(ctx == 0)
    slices = np.stack([qsl[empty], qsl[empty + 1]], axis=1).astype(np.int64) if empty.size else \
        np.zeros((0, 2), np.int64)
    return MLAContextChunks(
        context_lens=ctx.copy(), starts=starts, seq_lens=piece_len, cu_seq_lens=cu, cu_seqlens_q=cu_q,
        token_to_seq=tok, padded_local_seq_lens=local_lens if dcp else None,
        padded_local_cu_seq_lens=local_cu if dcp else None, padded_local_token_to_seq=local_tok if dcp else None,
        local_context_lens_allranks=allranks, request_start=ints[:, 0].copy(), request_end=ints[:, 1].copy(),
        piece_offset=chunk_piece, cu_offset=ints[:, 3].copy(), token_offset=ints[:, 4].copy(),
        local_token_offset=ints[:, 5].copy(), num_context_tokens=ints[:, 6].copy(),
        num_local_context_tokens=ints[:, 7].copy(), max_query_len=ints[:, 8].copy(),
        max_seq_len=ints[:, 9].copy(), is_continuation=ints[:, 10].astype(bool),
        all_rows_active=ints[:, 11].astype(bool), token_start=ints[:, 12].copy(), token_end=ints[:, 13].copy(),
        continuation_token_end=ints[:, 14].copy(), empty_token_slices=slices,
    )


def dcp_local_context_lens(context_lens: npt.ArrayLike, dcp_world_size: int, dcp_interleave: int = 1) -> np.ndarray:
    """Each rank's share of each context (vLLM ``get_dcp_local_seq_lens``), ``(n, W)`` int32, host.

    Examples
    --------
    >>> dcp_local_context_lens([70, 45], 2).tolist()
    [[35, 35], [23, 22]]
    """
    ctx = as_host_array(context_lens, "context_lens", dtype=np.int32, ndim=1)
    if isinstance(dcp_world_size, bool) or not isinstance(dcp_world_size, int) or dcp_world_size < 1:
        raise ValueError(f"dcp_world_size: must be an int >= 1, got {dcp_world_size!r}")
    if isinstance(dcp_interleave, bool) or not isinstance(dcp_interleave, int) or dcp_interleave < 1:
        raise ValueError(f"dcp_interleave: must be an int >= 1, got {dcp_interleave!r}")
    out = np.empty((ctx.shape[0], dcp_world_size), np.int32)
    _allranks_nb(ctx, dcp_world_size, dcp_interleave, out)
    return out


def triton_num_kv_splits(max_seq_len: int, num_sms: int) -> int:
    """Triton-MLA's KV split count: ``min(next_pow2(max(1, max_seq_len // 512)), 2 * num_sms)``.

    Examples
    --------
    >>> [triton_num_kv_splits(s, 132) for s in (1, 511, 512, 4000, 200000)]
    [1, 1, 1, 8, 264]
    """
    for name, v, lo in (("max_seq_len", max_seq_len, 0), ("num_sms", num_sms, 1)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
            raise ValueError(f"{name}: must be an int >= {lo}, got {v!r}")
    n = max(1, int(max_seq_len) // 512)
    return min(1 << (n - 1).bit_length(), 2 * int(num_sms))


@njit
def _row_req_nb(qsl: np.ndarray, num_rows: int, out: np.ndarray) -> None:
    d = qsl.shape[0] - 1
    r = 0
    for t in range(num_rows):
        while r < d and qsl[r + 1] <= t:
            r += 1
        out[t] = min(r, d - 1)


def flattened_row_requests(query_start_loc: npt.ArrayLike, num_rows: int, *, out: Any = None) -> np.ndarray:
    """FlashInfer-MLA's non-causal flattening: the request of each query row, ``(num_rows,)`` int64, host.

    ``row_req[t] = searchsorted(qsl[1:], t, right=True)`` clamped to ``D - 1``.

    Examples
    --------
    >>> flattened_row_requests([0, 3, 6, 6], 7).tolist()
    [0, 0, 0, 1, 1, 1, 2]
    """
    qsl = as_host_array(query_start_loc, "query_start_loc", dtype=np.int32, ndim=1)
    if qsl.shape[0] < 2:
        raise ValueError("query_start_loc: needs at least one request (2 entries)")
    res = np.empty(num_rows, np.int64) if out is None else out
    if res.shape != (num_rows,) or res.dtype != np.int64:
        raise ValueError(f"out: expected ({num_rows},) int64, got {res.shape} {res.dtype}")
    _row_req_nb(qsl, int(num_rows), res)
    return res
