"""The common per-step derivation in one compiled call.

:func:`common_layout` fills every host array of :class:`attnmeta.CommonAttentionMetadata` from a
validated :class:`attnmeta.BatchSpec` in a single numba call that composes the kernels of
:mod:`attnmeta.host.layout` (query_start_loc, seq_lens, positions + slot mapping, is_prefilling),
so a step pays one Python->numba transition instead of one per array. The outputs are caller
buffers (staging views in the normal path).

Shape legend
------------
- ``num_reqs`` / ``num_reqs_padded``: real request rows / rows including padding.
- ``num_tokens_padded``: tokens including padding.
- ``max_blocks``: staged block-table columns.
"""

from __future__ import annotations

import numba
import numpy as np

from attnmeta._intdiv import cdiv_by, pow2_shift
from attnmeta._numba import njit, njit_parallel
from attnmeta.host.layout import (
    _TOO_NARROW,
    _is_prefilling_nb,
    _query_start_loc_nb,
    _seq_lens_nb,
    _token_layout_nb,
)
from attnmeta.host.paged import paged_indices_nb, paged_layout_nb
from attnmeta.spec import BatchSpec

__all__ = [
    "ABSENT",
    "BAD_BLOCK_ID",
    "HAS_DRAFTS",
    "HAS_PROMPT",
    "HAS_UPPER",
    "PASS_OUTPUTS",
    "PLAN_WIDTH",
    "bad_block_id",
    "block_table_rows_par_nb",
    "common_layout",
    "common_pass_nb",
    "common_passes_nb",
    "optional_arrays",
]

_SHORT_INDICES = 1 << 20  # common_pass_nb's status for an ``indices`` shorter than the page count
BAD_BLOCK_ID = 1 << 21
""":func:`common_pass_nb`'s status for a used block id that is negative or ``>= num_kv_blocks``."""
HAS_PROMPT, HAS_DRAFTS, HAS_UPPER = 1, 2, 4
"""The bits of :func:`common_pass_nb`'s ``present``: which of the spec's optional arrays it has."""
ABSENT = np.zeros(0, np.int32)
"""What :func:`common_pass_nb` and :func:`common_passes_nb` (and the Mamba fill kernel, for draft counts)
take for an optional int32 array a step does not have: read-only, as a spec's own arrays and the common
metadata's host views are, so present and absent arrays are one compiled type."""
ABSENT.flags.writeable = False


def optional_arrays(prompt: np.ndarray | None, drafts: np.ndarray | None,
                    upper: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(prompt, drafts, upper, present)`` as :func:`common_pass_nb` takes a spec's optional arrays:
    :data:`ABSENT` for each one that is None, and the :data:`HAS_PROMPT` / :data:`HAS_DRAFTS` /
    :data:`HAS_UPPER` bits of those that are not."""
    present = (0 if prompt is None else HAS_PROMPT) | (0 if drafts is None else HAS_DRAFTS) | (
        0 if upper is None else HAS_UPPER)
    return (ABSENT if prompt is None else prompt, ABSENT if drafts is None else drafts,
            ABSENT if upper is None else upper, present)


@njit
def common_pass_nb(
    c: np.ndarray,
    q: np.ndarray,
    table: np.ndarray,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int,
    num_kv_blocks: int,
    prompt: np.ndarray,
    drafts: np.ndarray,
    upper: np.ndarray,
    present: int,
    do_tokens: bool,
    copy_rows: bool,
    qsl: np.ndarray,
    seq_lens: np.ndarray,
    bt: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    ub: np.ndarray,
    nc: np.ndarray,
    pre: np.ndarray,
    ddt: np.ndarray,
    paged: bool,
    indptr: np.ndarray,
    last: np.ndarray,
    indices: np.ndarray,
) -> int:
    """The common metadata's compiled host pass (:func:`common_layout` is its validating wrapper),
    and with ``paged`` the paged-KV layout of every row from the block-table rows just written (still
    in cache; page size = block size; :func:`attnmeta.host.paged.paged_layout_nb`): ``indptr`` (its
    entries past ``Bp + 1`` repeat the page count, a graph-mode sentinel), ``last`` and ``indices``
    (longer than the page count is fine; its tail is left as it is).

    Unchecked: for a validated :class:`~attnmeta.BatchSpec`'s arrays and outputs of the right shapes
    (:class:`attnmeta.common.CommonWriter` keeps them). ``qsl`` may be longer than ``Bp + 1`` (graph
    mode: the tail repeats the total). With ``copy_rows`` False the caller has copied the real
    block-table rows (:func:`block_table_rows_par_nb`) and copies the page indices afterwards
    (:func:`attnmeta.host.paged.paged_indices_par_nb`): the same bytes, on numba's thread pool.
    ``prompt`` / ``drafts`` / ``upper`` are the spec's optional arrays, :data:`ABSENT` for those it does
    not have, and ``present`` their :data:`HAS_PROMPT` / :data:`HAS_DRAFTS` / :data:`HAS_UPPER` bits
    (:func:`optional_arrays` makes both): one compiled variant serves every combination, where ``None``
    for an absent array compiled this long kernel up to eight times over, for branches that cost nothing
    at run time.

    The one check it makes: the block table is read now, not when its spec was validated, so every
    used block id (columns ``[0, cdiv(c + q, block_size * world_size))`` of each real row) must be
    in ``[0, num_kv_blocks)``; else it returns :data:`BAD_BLOCK_ID` (the caller names the entry).
    Returns 0, or a non-zero status for inputs a validated spec never has.
    """
    n = q.shape[0]
    status = _query_start_loc_nb(q, qsl)[0]
    status |= _seq_lens_nb(c, q, seq_lens)[0]
    if copy_rows:
        w = min(bt.shape[1], table.shape[1])
        for i in range(n):
            src = table[i]  # 1-D row views: the copy loop vectorizes
            dst = bt[i]
            for j in range(w):
                dst[j] = src[j]
            for j in range(w, dst.shape[0]):
                dst[j] = 0
    # Every used block id (columns [0, cdiv(c + q, span)) of a real row), in the rows just copied; or,
    # where this call copies the paged-KV indices of one rank, below in them: the same ids, contiguous.
    in_indices = paged and copy_rows and world_size == 1
    if not in_indices:
        lo, hi = _used_block_range_nb(c, q, bt, block_size * world_size)
        if lo < 0 or np.int64(hi) >= num_kv_blocks:
            return BAD_BLOCK_ID
    # The slot mapping reads the rows just copied (in cache) rather than the spec's wide table; a
    # staged table narrower than a request's blocks falls back to the spec's.
    if do_tokens:
        code = _token_layout_nb(c, q, bt, block_size, world_size, rank, interleave, True, True, positions, slots)[0]
        if code == _TOO_NARROW:
            code = _token_layout_nb(c, q, table, block_size, world_size, rank, interleave, True, True, positions,
                                    slots)[0]
        status |= code
    Bp = bt.shape[0]
    has_prompt = (present & HAS_PROMPT) != 0
    if (present & HAS_UPPER) == 0:
        for i in range(n):
            ub[i] = seq_lens[i]
    else:
        for i in range(n):
            ub[i] = upper[i]
    for i in range(n):
        nc[i] = c[i]
    if present & HAS_DRAFTS:  # vLLM's runner rule (docs/semantics.md, "Draft tokens")
        for i in range(n):
            d = drafts[i]
            if d > 0 and q[i] == d + 1:
                ddt[i] = d  # drafts plus the bonus token
            elif q[i] == 1 and (not has_prompt or c[i] >= prompt[i]):
                ddt[i] = 0  # a one-token decode past its prompt: a spec row with zero drafts
            else:
                ddt[i] = -1  # a prompt chunk (a one-token one included), or drafts that are not all scheduled
        for i in range(n, Bp):
            ddt[i] = -1
    for i in range(n, Bp):
        for j in range(bt.shape[1]):
            bt[i, j] = 0
        ub[i] = 0
        nc[i] = 0
    if has_prompt:
        status |= _is_prefilling_nb(c, prompt, pre)[0]
    else:
        pre[:] = False
    if paged:
        code, _row, _col, total = paged_layout_nb(seq_lens, bt, block_size, False, indptr[: Bp + 1], indices, last)
        code = code if total <= indices.shape[0] else _SHORT_INDICES
        if copy_rows and code == 0:  # (the unchecked copy: ids are copied, never used as addresses)
            paged_indices_nb(bt, indptr, indices, Bp)
        if in_indices:  # (page size = block size, one rank: the page indices are the used block ids)
            lo, hi = _id_range_nb(indices, total) if code == 0 else _used_block_range_nb(c, q, bt, block_size)
            if lo < 0 or np.int64(hi) >= num_kv_blocks:
                return BAD_BLOCK_ID
        status |= code
        for i in range(Bp + 1, indptr.shape[0]):
            indptr[i] = indptr[Bp]
    return status


# A row of common_passes_nb's plan: for each output of common_pass_nb, in its argument order, the
# buffer it lives in (an index into ``bufs``) and its first and last-plus-one byte there; then the
# group's scalars.
PASS_OUTPUTS = ("qsl", "sl", "bt", "pos", "sm", "ub", "nc", "pre", "ddt", "indptr", "last", "indices")
P_BLOCK_SIZE, P_WORLD, P_RANK, P_INTERLEAVE, P_KV_BLOCKS, P_TOKENS, P_PAGED, P_ROWS, P_COLUMNS = range(36, 45)
PLAN_WIDTH = 45


@njit
def common_passes_nb(
    c: np.ndarray,
    q: np.ndarray,
    prompt: np.ndarray,
    drafts: np.ndarray,
    upper: np.ndarray,
    present: int,
    tables: tuple[np.ndarray, ...],
    bufs: tuple[np.ndarray, ...],
    plan: np.ndarray,
) -> int:
    """:func:`common_pass_nb` of every KV-cache group of one step (serial, rows copied here), in one
    compiled call: group ``g`` reads the counts and ``tables[g]`` (C-contiguous int32 tables, all
    writable or all read-only: one compiled type for the tuple), with the optional arrays as
    :func:`common_pass_nb` takes them, and writes the outputs that row ``g``
    of ``plan`` places in ``bufs``. What the call saves is the per-call cost of a compiled call: a few
    arrays to unbox instead of fifteen per group.

    ``plan`` is ``(groups, PLAN_WIDTH)`` int64: for each name of :data:`PASS_OUTPUTS` (the outputs of
    :func:`common_pass_nb`, in its argument order) the index in ``bufs`` of the uint8 buffer it lives
    in and its first and last-plus-one byte; then ``block_size``, ``world_size``, ``rank``,
    ``interleave``, ``num_kv_blocks``, ``do_tokens``, ``paged``, and the block table's rows and columns
    (``P_BLOCK_SIZE`` ... ``P_COLUMNS``). The outputs are int32 but ``pos`` and ``sm`` (int64) and
    ``pre`` (bool). Unchecked, as :func:`common_pass_nb`: :class:`attnmeta.common.CommonPasses` makes
    the plan from the writers' own views.

    Returns 0, or ``g + 1`` for the first group whose pass returned a non-zero status (the groups
    after it are not written): the caller writes the groups again one by one, which names the error.
    """
    for g in range(plan.shape[0]):
        p = plan[g]
        qsl = bufs[p[0]][p[1] : p[2]].view(np.int32)
        seq_lens = bufs[p[3]][p[4] : p[5]].view(np.int32)
        bt = bufs[p[6]][p[7] : p[8]].view(np.int32).reshape((p[P_ROWS], p[P_COLUMNS]))
        positions = bufs[p[9]][p[10] : p[11]].view(np.int64)
        slots = bufs[p[12]][p[13] : p[14]].view(np.int64)
        ub = bufs[p[15]][p[16] : p[17]].view(np.int32)
        nc = bufs[p[18]][p[19] : p[20]].view(np.int32)
        pre = bufs[p[21]][p[22] : p[23]].view(np.bool_)
        ddt = bufs[p[24]][p[25] : p[26]].view(np.int32)
        indptr = bufs[p[27]][p[28] : p[29]].view(np.int32)
        last = bufs[p[30]][p[31] : p[32]].view(np.int32)
        indices = bufs[p[33]][p[34] : p[35]].view(np.int32)
        status = common_pass_nb(c, q, tables[g], p[P_BLOCK_SIZE], p[P_WORLD], p[P_RANK], p[P_INTERLEAVE],
                                p[P_KV_BLOCKS], prompt, drafts, upper, present, p[P_TOKENS] != 0, True, qsl, seq_lens, bt,
                                positions, slots, ub, nc, pre, ddt, p[P_PAGED] != 0, indptr, last, indices)
        if status:
            return g + 1
    return 0


@njit
def _used_block_range_nb(c: np.ndarray, q: np.ndarray, bt: np.ndarray, span: int) -> tuple[np.int32, np.int32]:
    """``(min(0, smallest), largest)`` of the used block ids of ``bt``'s rows: columns
    ``[0, cdiv(c + q, span))`` of each of the ``len(q)`` real rows (at most ``bt``'s width). A kernel
    of its own: compiled alone, its loop is split once on shift-or-divide and vectorizes (inside the
    common pass it would not, and a fold inside the row copy stops the copy's vectorization)."""
    sh = pow2_shift(span)
    w = bt.shape[1]
    lo = np.int32(0)
    hi = np.int32(0)
    for i in range(q.shape[0]):
        row = bt[i]
        for j in range(min(cdiv_by(np.int64(c[i]) + np.int64(q[i]), span, sh), w)):
            v = row[j]
            lo = v if v < lo else lo
            hi = v if v > hi else hi
    return lo, hi


@njit
def _id_range_nb(ids: np.ndarray, n: int) -> tuple[np.int32, np.int32]:
    """``(min(0, smallest), largest)`` of ``ids[:n]`` (a contiguous run: the loop vectorizes).
    :func:`_used_block_range_nb` keeps a fold of its own: called once per row, this one was slower than
    that fold over the same rows."""
    lo = np.int32(0)
    hi = np.int32(0)
    for j in range(n):
        v = ids[j]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    return lo, hi


@njit_parallel
def block_table_rows_par_nb(table: np.ndarray, bt: np.ndarray, n: int) -> None:
    """:func:`common_pass_nb`'s block-table copy on numba's thread pool: the first ``n`` rows of ``bt``
    from ``table`` (as many columns as both have), zeros past them; rows past ``n`` are left to
    :func:`common_pass_nb` (padding). Unchecked inputs."""
    w = min(bt.shape[1], table.shape[1])
    for i in numba.prange(n):
        src = table[i]
        dst = bt[i]
        for j in range(w):
            dst[j] = src[j]
        for j in range(w, dst.shape[0]):
            dst[j] = 0


_EMPTY_I32 = np.zeros(0, np.int32)
_NO_LIMIT = 1 << 31  # num_kv_blocks when the cache's size is not known: every int32 id >= 0 is in range


def bad_block_id(spec: BatchSpec, num_kv_blocks: int | None) -> ValueError:
    """The ``ValueError`` naming the first used block id of ``spec`` that is negative or at or past
    ``num_kv_blocks`` (row, column, value, rule), for :func:`common_pass_nb`'s :data:`BAD_BLOCK_ID`.

    Examples
    --------
    >>> table = np.array([[3, 4], [5, 9]], np.int32)
    >>> spec = BatchSpec(num_computed_tokens=[3, 5], num_scheduled_tokens=[1, 1], block_table=table, block_size=4)
    >>> print(bad_block_id(spec, 8))
    block_table[1, 1]=9 is past the KV cache's last block (num_kv_blocks=8) but column 1 holds tokens of request 1 (seq_len 6); a slot mapping through it would write outside the cache
    """
    cp = spec.context_parallel
    span = spec.block_size * (1 if cp is None else cp.world_size)
    cap = _NO_LIMIT if num_kv_blocks is None else num_kv_blocks
    seq = spec.num_computed_tokens.astype(np.int64) + spec.num_scheduled_tokens
    for i in range(spec.num_reqs):
        used = spec.block_table[i, : -(-int(seq[i]) // span)]
        bad = np.flatnonzero((used < 0) | (used >= cap))
        if bad.size:
            j = int(bad[0])
            v = int(used[j])
            what = ("is negative" if v < 0 else
                    f"is past the KV cache's last block (num_kv_blocks={num_kv_blocks})")
            return ValueError(
                f"block_table[{i}, {j}]={v} {what} but column {j} holds tokens of request {i} (seq_len {int(seq[i])}); "
                f"a slot mapping through it would write outside the cache")
    return ValueError("block_table: a used block id is out of range (not found again: was the table changed "
                      "while the step was built?)")


def common_layout(
    spec: BatchSpec,
    *,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    seq_lens_upper_bound: np.ndarray,
    num_computed_tokens: np.ndarray,
    is_prefilling: np.ndarray,
    num_decode_draft_tokens: np.ndarray | None,
) -> None:
    """Fill the common metadata's host arrays for ``spec`` in one compiled call.

    Every output is a caller buffer of exactly the documented shape (``spec`` was validated at
    construction, so no further checks run here):

    Parameters
    ----------
    spec : BatchSpec
        The validated step description.
    query_start_loc : (num_reqs_padded + 1,) int32, host
        Or longer (graph mode): entries past the real rows repeat the total.
    seq_lens : (num_reqs_padded,) int32, host
        ``c + q``; padding 0.
    block_table : (num_reqs_padded, max_blocks) int32, host
        The spec's table, truncated or zero-extended to ``max_blocks`` columns; padding rows 0.
    positions : (num_tokens_padded,) int64, host
        Absolute positions; padding 0.
    slot_mapping : (num_tokens_padded,) int64, host
        KV slots; padding and non-local tokens -1.
    seq_lens_upper_bound : (num_reqs_padded,) int32, host
        The spec's upper bound, else ``seq_lens``; padding 0.
    num_computed_tokens : (num_reqs_padded,) int32, host
        ``c``; padding 0.
    is_prefilling : (num_reqs_padded,) bool, host
        ``c < prompt``; all False without prompt lengths.
    num_decode_draft_tokens : (num_reqs_padded,) int32, host, or None
        Required when the spec has drafts: vLLM's runner rule, ``d`` where ``d > 0`` and ``q == d + 1``;
        else 0 for a one-token row past its prompt (``q == 1`` and ``c >= prompt``; every row counts as
        past its prompt without prompt lengths); else -1. Padding -1.

    Examples
    --------
    >>> spec = BatchSpec(num_computed_tokens=[3, 0], num_scheduled_tokens=[1, 2],
    ...                  block_table=[[7], [9]], block_size=4, num_reqs_padded=3)
    >>> bufs = dict(query_start_loc=np.empty(4, np.int32), seq_lens=np.empty(3, np.int32),
    ...             block_table=np.empty((3, 1), np.int32), positions=np.empty(3, np.int64),
    ...             slot_mapping=np.empty(3, np.int64), seq_lens_upper_bound=np.empty(3, np.int32),
    ...             num_computed_tokens=np.empty(3, np.int32), is_prefilling=np.empty(3, np.bool_),
    ...             num_decode_draft_tokens=None)
    >>> common_layout(spec, **bufs)
    >>> bufs["query_start_loc"].tolist(), bufs["slot_mapping"].tolist(), bufs["block_table"].tolist()
    ([0, 1, 3, 3], [31, 36, 37], [[7], [9], [0]])
    """
    cp = spec.context_parallel
    ws, rank, il = (1, 0, 1) if cp is None else (cp.world_size, cp.rank, cp.interleave)
    has_d = spec.num_draft_tokens is not None
    if has_d and num_decode_draft_tokens is None:
        raise ValueError("num_decode_draft_tokens: a buffer is required when the spec has num_draft_tokens")
    status = common_pass_nb(
        spec.num_computed_tokens,
        spec.num_scheduled_tokens,
        spec.block_table,
        spec.block_size,
        ws,
        rank,
        il,
        _NO_LIMIT,
        *optional_arrays(spec.num_prompt_tokens, spec.num_draft_tokens, spec.seq_lens_upper_bound),
        True,
        True,
        query_start_loc,
        seq_lens,
        block_table,
        positions,
        slot_mapping,
        seq_lens_upper_bound,
        num_computed_tokens,
        is_prefilling,
        num_decode_draft_tokens if num_decode_draft_tokens is not None else _EMPTY_I32,
        False,
        _EMPTY_I32,
        _EMPTY_I32,
        _EMPTY_I32,
    )
    if status == BAD_BLOCK_ID:
        raise bad_block_id(spec, None)
    if status:  # unreachable for a validated spec and correctly sized buffers
        raise ValueError(f"common_layout: internal status {status}; the spec or a buffer is inconsistent")
