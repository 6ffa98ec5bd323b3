"""Hypothesis strategies for attention-backend inputs (paged KV, fast prefill, local attention, cascade).

Requires hypothesis. Every strategy is valid by construction: it draws lists and derives lengths,
never filters, and raises ``hypothesis.errors.InvalidArgument`` for impossible arguments when drawn.
Arrays come out as the host numpy arrays attnmeta's host functions take (int32).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.extra import numpy as hnp

__all__ = [
    "CascadeBatch",
    "FastPrefillBatch",
    "LocalAttentionBatch",
    "PagedBatch",
    "cascade_batches",
    "fast_prefill_batches",
    "local_attention_batches",
    "logits_indices_for",
    "paged_batches",
]


class PagedBatch(NamedTuple):
    """A FlashInfer paged-KV input: host sequence lengths and a block table covering them."""

    seq_lens: np.ndarray
    """(num_reqs,) int32; 0 for padding rows."""
    block_table: np.ndarray
    """(rows, max_blocks_per_req) int32, ``rows >= num_reqs``; used columns hold ids >= 0, unused
    columns and extra rows may hold anything (-1 included), so a reader of them is caught."""
    page_size: int


class FastPrefillBatch(NamedTuple):
    """A KV-sharing fast-prefill input: the step's host qsl and the runner's logits indices."""

    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32; trailing padding rows repeat the last value."""
    seq_lens: np.ndarray
    """(num_reqs,) int32; ``>= query lens``, padding rows 0."""
    logits_indices: np.ndarray
    """(num_logits,) int32: each real request's last ``cnt_i`` token positions, ascending."""


class LocalAttentionBatch(NamedTuple):
    """A chunked-local-attention input (``attn_chunk_size`` a multiple of ``block_size``)."""

    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32; trailing padding rows (q = 0) repeat the last value."""
    seq_lens: np.ndarray
    """(num_reqs,) int32, exact; padding rows 0."""
    attn_chunk_size: int
    block_size: int
    block_table: np.ndarray
    """(rows, max_blocks_per_req) int32 covering ``cdiv(seq_lens, block_size)`` columns."""


class CascadeBatch(NamedTuple):
    """A cascade-attention input: real requests sharing ``num_common_prefix_blocks`` blocks."""

    num_computed_tokens: np.ndarray
    """(num_reqs,) int32."""
    query_lens: np.ndarray
    """(num_reqs,) int32, >= 1 (real requests only; cascade never runs with padding rows)."""
    block_size: int
    num_common_prefix_blocks: int
    """At most ``cdiv(min(num_computed_tokens + query_lens), block_size)`` (the shared blocks are
    blocks of every request)."""
    block_table: np.ndarray
    """(num_reqs, max_blocks_per_req) int32; the first ``num_common_prefix_blocks`` columns are the
    same in every row."""


def _check_range(lo: int, hi: int, lo_name: str, hi_name: str, floor: int = 0) -> None:
    if lo < floor:
        raise InvalidArgument(f"{lo_name}={lo} must be >= {floor}")
    if hi < lo:
        raise InvalidArgument(f"{hi_name}={hi} must be >= {lo_name}={lo}")


def _cdiv(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def _block_table(
    draw: Any, need: np.ndarray, rows: int, extra_columns: int, max_block_id: int, width_floor: int = 0
) -> np.ndarray:
    """A (rows, max(need) + extra, at least width_floor) table: used columns >= 0, the rest anything."""
    width = max(int(need.max()) if need.size else 0, width_floor) + extra_columns
    table: np.ndarray = draw(hnp.arrays(np.int32, (rows, width), elements=st.integers(-1, max_block_id)))
    used = np.arange(width)[None, :] < np.pad(need, (0, rows - need.shape[0]))[:, None]
    return np.where(used & (table < 0), -table - 1, table).astype(np.int32)


@st.composite
def paged_batches(
    draw: Any,
    *,
    min_reqs: int = 0,
    max_reqs: int = 8,
    seq_lens: st.SearchStrategy[int] | None = None,
    page_sizes: st.SearchStrategy[int] | None = None,
    max_extra_columns: int = 3,
    max_extra_rows: int = 2,
    max_block_id: int = 100_000,
) -> PagedBatch:
    """Batches for the paged-KV functions. Requires hypothesis.

    Parameters
    ----------
    min_reqs, max_reqs : int
        Bounds on the number of rows.
    seq_lens : strategy of int, optional
        Per-row sequence lengths; default: 0 (a padding row) or 1..300, weighted toward page
        boundaries by the page-size draw.
    page_sizes : strategy of int, optional
        Default ``sampled_from([1, 2, 3, 16, 64])``.
    max_extra_columns, max_extra_rows : int
        Slack beyond what the lengths need (a persistent table is wider and taller).
    max_block_id : int
        Largest block id drawn.

    Examples
    --------
    >>> from hypothesis import given
    >>> @given(paged_batches())
    ... def test(batch): ...
    """
    _check_range(min_reqs, max_reqs, "min_reqs", "max_reqs")
    if max_extra_columns < 0 or max_extra_rows < 0 or max_block_id < 0:
        raise InvalidArgument("max_extra_columns, max_extra_rows and max_block_id must be >= 0")
    page = draw(page_sizes if page_sizes is not None else st.sampled_from([1, 2, 3, 16, 64]))
    if page <= 0:
        raise InvalidArgument(f"page_sizes drew {page}; page sizes must be > 0")
    elem = (
        seq_lens
        if seq_lens is not None
        else st.one_of(st.just(0), st.integers(1, 300), st.integers(1, 20).map(lambda k: k * page))
    )
    lens = np.array(draw(st.lists(elem, min_size=min_reqs, max_size=max_reqs)), dtype=np.int32)
    if lens.size and int(lens.min()) < 0:
        raise InvalidArgument("seq_lens drew a negative length")
    extra_rows = len(draw(st.lists(st.just(0), max_size=max_extra_rows)))
    extra_cols = len(draw(st.lists(st.just(0), max_size=max_extra_columns)))
    need = _cdiv(lens, page)
    table = _block_table(draw, need, lens.shape[0] + extra_rows, extra_cols, max_block_id)
    return PagedBatch(lens, table, int(page))


def logits_indices_for(
    query_start_loc: Any, *, min_per_req: int = 1, max_per_req: int = 1
) -> st.SearchStrategy[np.ndarray]:
    """The runner's logits indices for a step: each request's last ``cnt_i`` token positions.

    Requires hypothesis. ``cnt_i`` is drawn in ``[min(min_per_req, q_i), min(max_per_req, q_i)]``
    (rows with ``q_i == 0``, padding, get none). ``max_per_req == 1`` is the plain runner; more is spec
    decode (``num_draft_tokens + 1`` sampled positions per request). Ascending int32.

    Parameters
    ----------
    query_start_loc : (num_reqs + 1,) int, host
        The step's query start locations.
    min_per_req, max_per_req : int
        Bounds on logits per non-empty request; ``1 <= min_per_req <= max_per_req``.

    Examples
    --------
    >>> import numpy as np
    >>> from hypothesis import given, strategies as st
    >>> @given(st.data())
    ... def test(data):
    ...     li = data.draw(logits_indices_for(np.array([0, 15, 20, 28], np.int32), max_per_req=2))
    """
    _check_range(min_per_req, max_per_req, "min_per_req", "max_per_req", floor=1)
    try:
        qsl = np.asarray(query_start_loc, dtype=np.int64)
    except (TypeError, ValueError):
        raise InvalidArgument(f"query_start_loc: expected a (num_reqs + 1,) int array, got "
                              f"{type(query_start_loc).__name__}") from None
    if qsl.ndim != 1 or qsl.size < 1:
        raise InvalidArgument(f"query_start_loc: expected a (num_reqs + 1,) int array, got shape {qsl.shape}")
    q = np.diff(qsl)
    if q.size and int(q.min()) < 0:
        raise InvalidArgument("query_start_loc must be non-decreasing")
    counts = [st.integers(min(min_per_req, int(n)), min(max_per_req, int(n))) for n in q]

    def build(cnt: tuple[int, ...]) -> np.ndarray:
        c = np.array(cnt, dtype=np.int64)
        ends = qsl[1:]
        idx = np.repeat(ends - c, c) + (np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c))
        return idx.astype(np.int32)

    return st.tuples(*counts).map(build)


def _query_and_context(
    draw: Any, min_reqs: int, max_reqs: int, max_query_len: int, max_context_len: int
) -> tuple[np.ndarray, np.ndarray]:
    pairs = draw(
        st.lists(
            st.tuples(st.integers(1, max_query_len), st.integers(0, max_context_len)),
            min_size=min_reqs,
            max_size=max_reqs,
        )
    )
    q = np.array([p[0] for p in pairs], dtype=np.int64)
    c = np.array([p[1] for p in pairs], dtype=np.int64)
    return q, c


@st.composite
def fast_prefill_batches(
    draw: Any,
    *,
    min_reqs: int = 1,
    max_reqs: int = 8,
    max_query_len: int = 40,
    max_context_len: int = 100,
    max_per_req: int = 4,
    max_padding_rows: int = 2,
) -> FastPrefillBatch:
    """Steps for the KV-sharing fast prefill, spec decode included. Requires hypothesis.

    Real requests have ``q >= 1`` and one to ``max_per_req`` logits (their last tokens); up to
    ``max_padding_rows`` trailing padding rows have ``q = 0``, ``s = 0`` and no logits.

    Examples
    --------
    >>> from hypothesis import given
    >>> @given(fast_prefill_batches(max_per_req=1))
    ... def test(batch): ...
    """
    _check_range(min_reqs, max_reqs, "min_reqs", "max_reqs")
    _check_range(1, max_query_len, "1", "max_query_len")
    _check_range(1, max_per_req, "1", "max_per_req")
    q, c = _query_and_context(draw, min_reqs, max_reqs, max_query_len, max_context_len)
    pad = len(draw(st.lists(st.just(0), max_size=max_padding_rows)))
    q = np.concatenate([q, np.zeros(pad, np.int64)])
    s = np.concatenate([q[: q.shape[0] - pad] + c, np.zeros(pad, np.int64)])
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    li = draw(logits_indices_for(qsl, max_per_req=max_per_req))
    return FastPrefillBatch(qsl, s.astype(np.int32), li)


@st.composite
def local_attention_batches(
    draw: Any,
    *,
    min_reqs: int = 0,
    max_reqs: int = 6,
    max_query_len: int = 40,
    max_context_len: int = 60,
    block_sizes: st.SearchStrategy[int] | None = None,
    blocks_per_chunk: st.SearchStrategy[int] | None = None,
    max_padding_rows: int = 2,
    max_extra_columns: int = 2,
) -> LocalAttentionBatch:
    """Steps for chunked local attention, with padding rows and a block table. Requires hypothesis.

    ``attn_chunk_size = block_size * blocks_per_chunk`` (a multiple, as vLLM asserts). Real requests
    have ``q >= 1`` and any context (aligned or not to the chunk); padding rows have ``q = s = 0``.
    The block table is at least one column wide and covers every sequence.

    Parameters
    ----------
    min_reqs, max_reqs : int
        Bounds on the real requests.
    max_query_len, max_context_len : int
        Bounds on ``q`` (>= 1) and ``c`` (>= 0) per real request.
    block_sizes : strategy of int, optional
        Default ``sampled_from([1, 2, 4, 16])``.
    blocks_per_chunk : strategy of int, optional
        Default ``integers(1, 4)``.
    max_padding_rows, max_extra_columns : int
        Trailing padding rows; block-table columns beyond what the lengths need.

    Examples
    --------
    >>> from hypothesis import given
    >>> @given(local_attention_batches())
    ... def test(batch): ...
    """
    _check_range(min_reqs, max_reqs, "min_reqs", "max_reqs")
    _check_range(1, max_query_len, "1", "max_query_len")
    bs = draw(block_sizes if block_sizes is not None else st.sampled_from([1, 2, 4, 16]))
    per = draw(blocks_per_chunk if blocks_per_chunk is not None else st.integers(1, 4))
    if bs <= 0 or per <= 0:
        raise InvalidArgument(f"block size {bs} and blocks per chunk {per} must be > 0")
    q, c = _query_and_context(draw, min_reqs, max_reqs, max_query_len, max_context_len)
    pad = len(draw(st.lists(st.just(0), max_size=max_padding_rows)))
    s = np.concatenate([q + c, np.zeros(pad, np.int64)]).astype(np.int32)
    q = np.concatenate([q, np.zeros(pad, np.int64)])
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    extra = len(draw(st.lists(st.just(0), max_size=max_extra_columns)))
    table = _block_table(draw, _cdiv(s, bs), s.shape[0], extra, 100_000, width_floor=1)
    table[s.shape[0] - pad :] = 0  # padding rows hold the null block, as the runner fills them
    return LocalAttentionBatch(qsl, s, int(bs * per), int(bs), table)


@st.composite
def cascade_batches(
    draw: Any,
    *,
    min_reqs: int = 1,
    max_reqs: int = 16,
    max_query_len: int = 8,
    max_context_len: int = 700,
    block_sizes: st.SearchStrategy[int] | None = None,
) -> CascadeBatch:
    """Real requests sharing a cached prefix, for the cascade helpers. Requires hypothesis.

    Query lengths are all 1 about half the time (the flash-decoding branch of the cost model).

    Examples
    --------
    >>> from hypothesis import given
    >>> @given(cascade_batches())
    ... def test(batch): ...
    """
    _check_range(min_reqs, max_reqs, "min_reqs", "max_reqs", floor=1)
    _check_range(1, max_query_len, "1", "max_query_len")
    bs = draw(block_sizes if block_sizes is not None else st.sampled_from([1, 16, 32]))
    decode_only = draw(st.booleans())
    q, c = _query_and_context(draw, min_reqs, max_reqs, 1 if decode_only else max_query_len, max_context_len)
    s = q + c
    blocks = draw(st.integers(0, int(_cdiv(s, bs).min())))
    table = _block_table(draw, _cdiv(s, bs), s.shape[0], 0, 100_000, width_floor=1)
    table[:, :blocks] = table[0, :blocks]
    return CascadeBatch(c.astype(np.int32), q.astype(np.int32), int(bs), blocks, table)
