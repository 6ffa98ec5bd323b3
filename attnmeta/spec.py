"""``BatchSpec``: the host description of one engine step.

A ``BatchSpec`` is everything the scheduler knows about a step, as numpy arrays: per request the
number of tokens already in the KV cache (or state), the number scheduled this step, optionally the
prompt length and the number of speculative draft tokens, the block table, and optional CUDA-graph
padding. Every other piece of metadata attnmeta produces is derived from it on the host.

Construction validates everything that can be checked on the host and fails fast with a
``ValueError`` that names the field, the row and the rule.

Shape legend
------------
- ``num_reqs``: real requests this step (``len(num_scheduled_tokens)``).
- ``num_reqs_padded``: request rows including CUDA-graph padding rows (``>= num_reqs``).
- ``num_tokens``: real tokens this step (``num_scheduled_tokens.sum()``).
- ``num_tokens_padded``: tokens including CUDA-graph padding tokens (``>= num_tokens``).
- ``max_blocks_per_req``: block-table width ``W``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from attnmeta._checks import INT32_MAX, as_host_array
from attnmeta._intdiv import cdiv_by, pow2_shift
from attnmeta._numba import njit
from attnmeta._slots import slot_filler

__all__ = ["BatchSpec", "ContextParallel"]


class ContextParallel(NamedTuple):
    """Decode/prefill context parallelism (DCP/PCP) layout of the KV cache.

    Token ``p`` of a request lives on rank ``(p % (block_size * world_size)) // interleave % world_size``
    (vllm-semantics.md section 4).
    """

    world_size: int
    """Total context-parallel world size ``W`` (DCP x PCP); 1 disables it."""
    rank: int
    """This rank, ``0 <= rank < world_size``."""
    interleave: int = 1
    """Interleave size ``I``: consecutive tokens per rank; must divide ``block_size``."""


_EMPTY = np.zeros(0, np.int32)
_INT_TYPES = (int, np.integer)
# _validate_nb status codes
_NEG_C, _NEG_Q, _SEQ_OVF, _TOT_OVF, _NARROW, _NEG_BLOCK, _NEG_P, _NEG_D, _DRAFTS, _NEG_UB, _UB = range(1, 12)


@njit
def _validate_nb(
    c: np.ndarray, q: np.ndarray, bt: np.ndarray, span: int, bs: int,
    prompt: np.ndarray, has_p: bool, drafts: np.ndarray, has_d: bool, ub: np.ndarray, has_ub: bool,
) -> tuple[int, int, int, int, int, int, int, int]:
    """Every rule of BatchSpec: :func:`_validate_rows_nb`'s result, faster for a valid spec.

    With power-of-two ``bs`` and ``span`` (the usual case), loops without early exits (reductions
    the compiler vectorizes) decide whether every rule holds and compute the scalars; only when one
    does not does the row-by-row pass run, to name the first broken rule exactly as it would have.
    """
    sh_bs = pow2_shift(bs)
    sh_span = pow2_shift(span)
    if sh_bs < 0 or sh_span < 0:
        return _validate_rows_nb(c, q, bt, span, bs, prompt, has_p, drafts, has_d, ub, has_ub)
    n = c.shape[0]
    lo = np.int64(0)  # the smallest count seen (negative: a rule is broken)
    total = np.int64(0)
    pages = np.int64(0)
    max_q = np.int64(0)
    max_seq = np.int64(0)
    for i in range(n):
        ci = np.int64(c[i])
        qi = np.int64(q[i])
        seq = ci + qi
        lo = min(lo, min(ci, qi))
        total += qi
        pages += (seq + bs - 1) >> sh_bs
        max_q = max(max_q, qi)
        max_seq = max(max_seq, seq)
    bad = lo < 0 or max_seq > INT32_MAX or total > INT32_MAX or ((max_seq + span - 1) >> sh_span) > bt.shape[1]
    max_ub = np.int64(0)
    if not bad:
        low = np.int32(0)
        for i in range(n):
            need = (np.int64(c[i]) + np.int64(q[i]) + span - 1) >> sh_span
            row = bt[i]
            for j in range(need):
                v = row[j]
                low = v if v < low else low
        bad = low < 0
    if not bad and has_p:
        for i in range(n):
            lo = min(lo, np.int64(prompt[i]))
        bad = lo < 0
    if not bad and has_d:
        over = np.int64(0)
        for i in range(n):
            d = np.int64(drafts[i])
            lo = min(lo, d)
            over = max(over, d - np.int64(q[i]))
        bad = lo < 0 or over > 0
    if not bad and has_ub:
        short = np.int64(0)
        for i in range(n):
            u = np.int64(ub[i])
            lo = min(lo, u)
            short = max(short, np.int64(c[i]) + np.int64(q[i]) - u)
            max_ub = max(max_ub, u)
        bad = lo < 0 or short > 0
    if bad:
        return _validate_rows_nb(c, q, bt, span, bs, prompt, has_p, drafts, has_d, ub, has_ub)
    return 0, 0, 0, int(total), int(max_q), int(max_seq), int(max_ub), int(pages)


@njit
def _validate_rows_nb(
    c: np.ndarray, q: np.ndarray, bt: np.ndarray, span: int, bs: int,
    prompt: np.ndarray, has_p: bool, drafts: np.ndarray, has_d: bool, ub: np.ndarray, has_ub: bool,
) -> tuple[int, int, int, int, int, int, int, int]:
    """One pass over requests (and their used block-table columns): every rule of BatchSpec, row by
    row, stopping at the first broken one.

    Returns ``(status, row, col, total, max_q, max_seq, max_ub, pages)``: status 0 = valid, else the
    rule broken at ``row`` (and block-table column ``col``); ``pages`` is the sum of ``cdiv(seq, bs)``.
    A row's used block ids are checked with a running minimum (no early exit, so the loop
    vectorizes); only a row whose minimum is negative is searched for the column.
    """
    total = np.int64(0)
    pages = np.int64(0)
    max_q = np.int64(0)
    max_seq = np.int64(0)
    max_ub = np.int64(0)
    width = bt.shape[1]
    sh_bs = pow2_shift(bs)  # shifts instead of divisions for power-of-two sizes (attnmeta._intdiv)
    sh_span = pow2_shift(span)
    for i in range(c.shape[0]):
        ci = np.int64(c[i])
        qi = np.int64(q[i])
        if ci < 0:
            return _NEG_C, i, 0, 0, 0, 0, 0, 0
        if qi < 0:
            return _NEG_Q, i, 0, 0, 0, 0, 0, 0
        seq = ci + qi
        if seq > INT32_MAX:
            return _SEQ_OVF, i, 0, 0, 0, 0, 0, 0
        total += qi
        if total > INT32_MAX:
            return _TOT_OVF, i, 0, 0, 0, 0, 0, 0
        nb = cdiv_by(seq, bs, sh_bs)
        pages += nb
        need = nb if span == bs else cdiv_by(seq, span, sh_span)
        if need > width:
            return _NARROW, i, 0, 0, 0, 0, 0, 0
        row = bt[i]
        low = np.int32(0)
        for j in range(need):
            v = row[j]
            low = v if v < low else low
        if low < 0:
            for j in range(need):
                if row[j] < 0:
                    return _NEG_BLOCK, i, j, 0, 0, 0, 0, 0
        if has_p and prompt[i] < 0:
            return _NEG_P, i, 0, 0, 0, 0, 0, 0
        if has_d:
            if drafts[i] < 0:
                return _NEG_D, i, 0, 0, 0, 0, 0, 0
            if drafts[i] > qi:
                return _DRAFTS, i, 0, 0, 0, 0, 0, 0
        if has_ub:
            u = np.int64(ub[i])
            if u < 0:
                return _NEG_UB, i, 0, 0, 0, 0, 0, 0
            if u < seq:
                return _UB, i, 0, 0, 0, 0, 0, 0
            max_ub = max(max_ub, u)
        max_q = max(max_q, qi)
        max_seq = max(max_seq, seq)
    return 0, 0, 0, int(total), int(max_q), int(max_seq), int(max_ub), int(pages)


def _raise_invalid(
    code: int, i: int, j: int, c: np.ndarray, q: np.ndarray, bt: np.ndarray, bs: int, span: int,
    prompt: np.ndarray | None, drafts: np.ndarray | None, ub: np.ndarray | None,
) -> None:
    seq = int(c[i]) + int(q[i])
    if code == _NEG_C:
        raise ValueError(f"num_computed_tokens[{i}]={int(c[i])} is negative (request {i}); counts must be >= 0")
    if code == _NEG_Q:
        raise ValueError(f"num_scheduled_tokens[{i}]={int(q[i])} is negative (request {i}); counts must be >= 0")
    if code == _SEQ_OVF:
        raise ValueError(f"seq_lens[{i}]=num_computed_tokens[{i}]+num_scheduled_tokens[{i}]={seq} overflows int32")
    if code == _TOT_OVF:
        raise ValueError(f"num_scheduled_tokens: total {int(q.sum(dtype=np.int64))} overflows int32")
    if code == _NARROW:
        need = -(-seq // span)
        what = f"cdiv(seq_len={seq}, block_size={bs})" if span == bs else f"cdiv(seq_len={seq}, block_size*world_size={span})"
        raise ValueError(
            f"block_table: row {i} needs {what}={need} blocks but the table has {bt.shape[1]} columns (request {i})"
        )
    if code == _NEG_BLOCK:
        raise ValueError(
            f"block_table[{i}, {j}]={int(bt[i, j])} is negative but column {j} holds tokens of "
            f"request {i} (seq_len {seq}); block ids must be >= 0"
        )
    for name, arr, neg in (("num_prompt_tokens", prompt, _NEG_P), ("num_draft_tokens", drafts, _NEG_D),
                           ("seq_lens_upper_bound", ub, _NEG_UB)):
        if code == neg:
            assert arr is not None
            raise ValueError(f"{name}[{i}]={int(arr[i])} is negative (request {i}); counts must be >= 0")
    if code == _DRAFTS:
        assert drafts is not None
        raise ValueError(
            f"num_draft_tokens[{i}]={int(drafts[i])} > num_scheduled_tokens[{i}]={int(q[i])} (request {i}); "
            f"drafts are part of the scheduled tokens"
        )
    assert ub is not None
    raise ValueError(
        f"seq_lens_upper_bound[{i}]={int(ub[i])} < seq_len={seq} (request {i}); "
        f"an upper bound must be >= num_computed_tokens + num_scheduled_tokens"
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False, init=False)
class BatchSpec:
    """Host description of one step; validated on construction.

    Parameters
    ----------
    num_computed_tokens : (num_reqs,) int32, host
        Tokens of each request already in the KV cache / state before this step (``c``). Must be the
        exact count (under async spec decode pass the corrected count, and the optimistic one as
        ``seq_lens_upper_bound``).
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled for each request this step (``q``); 0 is allowed.
    block_table : (num_reqs, max_blocks_per_req) int32, host
        Physical KV block ids of each request; columns ``[0, cdiv(c + q, block_size))`` are read.
    block_size : int
        Tokens per KV block (page).
    num_prompt_tokens : (num_reqs,) int32, host, optional
        Prompt length ``P``; gives ``is_prefilling = c < P``. Without it no row is prefilling.
    num_draft_tokens : (num_reqs,) int32, host, optional
        Speculative draft tokens scheduled for each request (spec decode); ``<= q``.
    seq_lens_upper_bound : (num_reqs,) int32, host, optional
        Optimistic sequence lengths under async spec decode (every draft accepted); ``>= c + q``.
        Defaults to the exact ``c + q``.
    num_reqs_padded, num_tokens_padded : int, optional
        CUDA-graph padding: request rows and tokens after padding (``>= num_reqs`` / ``>= num_tokens``).
    context_parallel : ContextParallel, optional
        DCP/PCP layout for the slot mapping; ``None`` means no context parallelism.

    Raises
    ------
    TypeError
        A field is a torch tensor or not an integer array.
    ValueError
        Negative counts, length mismatches, a block table too narrow for ``c + q``, a negative block id
        in a used column, padding smaller than the real batch, totals that overflow int32.

    Examples
    --------
    >>> import numpy as np
    >>> spec = BatchSpec(num_computed_tokens=[5, 0, 7], num_scheduled_tokens=[1, 4, 1],
    ...                  block_table=np.arange(9, dtype=np.int32).reshape(3, 3), block_size=4)
    >>> spec.num_reqs, spec.num_tokens, spec.max_query_len, spec.max_seq_len
    (3, 6, 4, 8)
    """

    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    block_table: np.ndarray
    block_size: int
    num_prompt_tokens: np.ndarray | None = None
    num_draft_tokens: np.ndarray | None = None
    seq_lens_upper_bound: np.ndarray | None = None
    num_reqs_padded: int | None = None
    num_tokens_padded: int | None = None
    context_parallel: ContextParallel | None = None

    # Derived host scalars (computed in __init__, never passed by the caller).
    num_reqs: int = dataclasses.field(init=False)
    """Real requests."""
    num_tokens: int = dataclasses.field(init=False)
    """Real tokens, ``sum(num_scheduled_tokens)``."""
    max_query_len: int = dataclasses.field(init=False)
    """``max(num_scheduled_tokens)`` over real rows (0 for an empty batch)."""
    max_seq_len: int = dataclasses.field(init=False)
    """``max(seq_lens_upper_bound)`` over real rows: an upper bound under async spec decode."""
    max_exact_seq_len: int = dataclasses.field(init=False)
    """``max(num_computed_tokens + num_scheduled_tokens)`` over real rows (0 for an empty batch)."""
    num_pages: int = dataclasses.field(init=False)
    """``sum(cdiv(num_computed_tokens + num_scheduled_tokens, block_size))`` over real rows: the KV
    pages of the batch (FlashInfer's ``paged_kv_indptr[-1]`` without decode context parallelism)."""

    def __init__(
        self,
        *,
        num_computed_tokens: npt.ArrayLike,
        num_scheduled_tokens: npt.ArrayLike,
        block_table: npt.ArrayLike,
        block_size: int,
        num_prompt_tokens: npt.ArrayLike | None = None,
        num_draft_tokens: npt.ArrayLike | None = None,
        seq_lens_upper_bound: npt.ArrayLike | None = None,
        num_reqs_padded: int | None = None,
        num_tokens_padded: int | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> None:
        # Built once per engine step: every rule is checked, arrays that are already C-contiguous
        # int32 of the right length are kept as they are, and each field is set once, at the end.
        c = as_host_array(num_computed_tokens, "num_computed_tokens")
        n = c.shape[0]
        q = as_host_array(num_scheduled_tokens, "num_scheduled_tokens", length=n)
        bs = block_size
        if not isinstance(bs, _INT_TYPES) or bs <= 0:
            raise ValueError(f"block_size: must be a positive int, got {bs!r}")
        bs = int(bs)
        bt = as_host_array(block_table, "block_table", ndim=2)
        if bt.shape[0] < n:
            raise ValueError(f"block_table: has {bt.shape[0]} rows, need one per request ({n})")
        cp = context_parallel
        if cp is not None:
            if not isinstance(cp, ContextParallel):
                raise TypeError(f"context_parallel: expected ContextParallel, got {type(cp).__name__}")
            if cp.world_size < 1 or not 0 <= cp.rank < cp.world_size:
                raise ValueError(f"context_parallel: need 0 <= rank < world_size, got {cp}")
            if cp.interleave < 1 or bs % cp.interleave:
                raise ValueError(
                    f"context_parallel.interleave={cp.interleave} must be >= 1 and divide block_size={bs}"
                )
        prompt = None if num_prompt_tokens is None else as_host_array(num_prompt_tokens, "num_prompt_tokens", length=n)
        drafts = None if num_draft_tokens is None else as_host_array(num_draft_tokens, "num_draft_tokens", length=n)
        ub = (None if seq_lens_upper_bound is None
              else as_host_array(seq_lens_upper_bound, "seq_lens_upper_bound", length=n))
        span = bs * (1 if cp is None else cp.world_size)  # tokens per block-table column
        code, row, col, total, max_q, max_seq, max_ub, pages = _validate_nb(
            c, q, bt, span, bs,
            _EMPTY if prompt is None else prompt, prompt is not None,
            _EMPTY if drafts is None else drafts, drafts is not None,
            _EMPTY if ub is None else ub, ub is not None,
        )
        if code:
            _raise_invalid(code, row, col, c, q, bt, bs, span, prompt, drafts, ub)
        rp = num_reqs_padded
        if rp is not None and (not isinstance(rp, _INT_TYPES) or rp < n):
            raise ValueError(f"num_reqs_padded: {rp!r} < num_reqs={n}; padding can only add rows")
        tp = num_tokens_padded
        if tp is not None:
            if not isinstance(tp, _INT_TYPES) or tp < total:
                raise ValueError(f"num_tokens_padded: {tp!r} < num_tokens={total}; padding can only add tokens")
            if tp > INT32_MAX:
                raise ValueError(f"num_tokens_padded: {tp} overflows int32")
        _fill_spec(  # every field, in declaration order (test_fields_are_set_in_declaration_order)
            self, c, q, bt, bs, prompt, drafts, ub, None if rp is None else int(rp),
            None if tp is None else int(tp), cp, n, total, max_q, max_ub if ub is not None else max_seq, max_seq,
            pages,
        )

    def __post_init__(self) -> None:
        """A dataclass subclass's generated ``__init__`` sets the init fields and calls this: validate
        them and set the derived fields, as :meth:`__init__` does (``BatchSpec`` itself never calls it)."""
        BatchSpec.__init__(self, **spec_arguments(self))

    @property
    def padded_num_reqs(self) -> int:
        """Request rows including padding (``num_reqs_padded`` or ``num_reqs``)."""
        return self.num_reqs if self.num_reqs_padded is None else self.num_reqs_padded

    @property
    def padded_num_tokens(self) -> int:
        """Tokens including padding (``num_tokens_padded`` or ``num_tokens``)."""
        return self.num_tokens if self.num_tokens_padded is None else self.num_tokens_padded

    def __repr__(self) -> str:
        return (
            f"BatchSpec(num_reqs={self.num_reqs}, num_tokens={self.num_tokens}, "
            f"padded=({self.padded_num_reqs}, {self.padded_num_tokens}), block_size={self.block_size}, "
            f"max_query_len={self.max_query_len}, max_seq_len={self.max_seq_len}, "
            f"block_table={self.block_table.shape}, prompts={self.num_prompt_tokens is not None}, "
            f"drafts={self.num_draft_tokens is not None}, context_parallel={self.context_parallel})"
        )


_fill_spec = slot_filler(BatchSpec)
"""Sets every field of a BatchSpec under construction (:func:`attnmeta._slots.slot_filler`)."""
_INIT_FIELDS = tuple(f.name for f in dataclasses.fields(BatchSpec) if f.init)
"""The constructor's arguments, in declaration order."""


def spec_arguments(spec: BatchSpec) -> dict[str, Any]:
    """The keyword arguments that construct ``spec`` again (its init fields, the host arrays
    themselves, not copies): what an engine passes each step, for benchmarks and subclasses."""
    return {name: getattr(spec, name) for name in _INIT_FIELDS}
