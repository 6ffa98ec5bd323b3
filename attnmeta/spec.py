"""``BatchSpec``: the host description of one engine step.

A ``BatchSpec`` is everything the scheduler knows about a step, as numpy arrays: per request the
number of tokens already in the KV cache (or state), the number scheduled this step, optionally the
prompt length and the number of speculative draft tokens, the block table, and optional CUDA-graph
padding. Every other piece of metadata attnmeta produces is derived from it on the host.

Construction validates everything that can be checked on the host and fails fast with a
``ValueError`` that names the field, the row and the rule.

Why one module
--------------
A spec's rules and scalars come from one compiled pass over its rows (``_validate_nb``), which three
callers share: the constructor, the error path that names a broken rule, and the step composer's
scan of a scheduler's arrays (``scan_counts``), which makes no spec at all. The scalars a
:class:`StepShape` holds must be the same from either entry (the composer finds a step's layout from
them), so the pass, both entries and the shape live side by side.

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
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import numpy as np
import numpy.typing as npt

from attnmeta._checks import INT32_MAX, as_host_array, block_table_rows
from attnmeta._intdiv import cdiv_by, pow2_shift
from attnmeta._numba import njit

__all__ = ["MAX_PADDED_REQS", "MAX_PADDED_TOKENS", "BatchSpec", "ContextParallel", "StepShape"]

MAX_PADDED_REQS = 1 << 20
"""The most request rows a step may be padded to (``num_reqs_padded``): far past any CUDA-graph batch
size, and a bound that names itself instead of an allocator error."""
MAX_PADDED_TOKENS = 1 << 24
"""The most tokens a step may be padded to (``num_tokens_padded``), for the same reason."""


class ContextParallel(NamedTuple):
    """Decode/prefill context parallelism (DCP/PCP) layout of the KV cache.

    Token ``p`` of a request lives on rank ``(p % (block_size * world_size)) // interleave % world_size``
    (docs/semantics.md, "Context parallelism").
    """

    world_size: int
    """Total context-parallel world size ``W`` (DCP x PCP); 1 disables it."""
    rank: int
    """This rank, ``0 <= rank < world_size``."""
    interleave: int = 1
    """Interleave size ``I``: consecutive tokens per rank; must divide ``block_size``."""


class StepShape(NamedTuple):
    """A step's host scalars: all a builder's :meth:`~attnmeta.builder.Builder.needs` and
    :meth:`~attnmeta.builder.Builder.replay_key` may read (:attr:`BatchSpec.shape`).

    No arrays: what a step's layout depends on is a function of these, the builder's options and its
    inputs, so the step composer (:class:`attnmeta.compose.StepBuilder`) computes a layout's key from
    them (once per class of shapes without the three lengths, for builders that do not read them:
    :meth:`~attnmeta.builder.Builder.reads_lengths`), and its counts entry
    (:meth:`~attnmeta.compose.StepBuilder.build_counts`)
    makes no :class:`BatchSpec` for a replayed step. The names are :class:`BatchSpec`'s.

    Examples
    --------
    >>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 4], block_table=[[1, 2], [3, 0]],
    ...                  block_size=4, num_prompt_tokens=[3, 9])
    >>> s = spec.shape
    >>> s.num_reqs, s.first_query_len, s.max_query_len, s.any_prefilling, s.table_columns, s.padded_num_tokens
    (2, 1, 4, True, 2, 5)
    """

    num_reqs: int
    """Real requests."""
    num_tokens: int
    """Real tokens."""
    num_reqs_padded: int | None
    """Request rows after CUDA-graph padding, as given (None: not padded)."""
    num_tokens_padded: int | None
    """Tokens after padding, as given (None: not padded)."""
    max_query_len: int
    """``max(num_scheduled_tokens)`` (0 for an empty batch)."""
    first_query_len: int
    """``num_scheduled_tokens[0]`` (0 for an empty batch): after the decode-first reorder, whether the
    first row is a prefill row."""
    max_seq_len: int
    """``max(seq_lens_upper_bound)`` (the exact maximum without upper bounds)."""
    max_exact_seq_len: int
    """``max(num_computed_tokens + num_scheduled_tokens)``."""
    num_pages: int
    """``sum(cdiv(seq_len, block_size))``."""
    block_size: int
    """Tokens per KV block."""
    table_columns: int
    """The block table's columns."""
    any_prefilling: bool
    """Whether a row is still in its prompt (``num_computed_tokens < num_prompt_tokens``; False without
    prompt lengths)."""
    has_prompt: bool
    """``num_prompt_tokens`` given."""
    has_drafts: bool
    """``num_draft_tokens`` given."""
    has_upper_bound: bool
    """``seq_lens_upper_bound`` given."""
    context_parallel: ContextParallel | None
    """As :attr:`BatchSpec.context_parallel`."""
    uniform_queries: bool = False
    """Every row's query is ``first_query_len`` tokens or none (padding rows): the split's uniform rule
    (``require_uniform``) makes no row a prefill row for being unlike the first. True without rows (the
    default, False, claims nothing, for a shape made by hand)."""
    all_spec_rows: bool = False
    """Every real row is a spec-decode row by vLLM's runner rule (``num_decode_draft_tokens_cpu >= 0``:
    ``d > 0`` drafts and ``q == d + 1`` tokens, or one token past the prompt). False without rows."""

    @property
    def padded_num_reqs(self) -> int:
        """Request rows including padding."""
        return self.num_reqs if self.num_reqs_padded is None else self.num_reqs_padded

    @property
    def padded_num_tokens(self) -> int:
        """Tokens including padding."""
        return self.num_tokens if self.num_tokens_padded is None else self.num_tokens_padded


_I32 = np.dtype(np.int32)
_EMPTY = np.zeros(0, np.int32)
_NO_COPY = np.zeros((0, 0), np.int32)
_INT_TYPES = (int, np.integer)
_BOOL_TYPES = (bool, np.bool_)
# _validate_nb status codes: 0 = valid; _INVALID = some rule is broken (``diagnose=False``); else the
# first broken rule (``diagnose=True``), numbered in the order a row's rules are checked
_INVALID = -1
_NEG_C, _NEG_Q, _SEQ_OVF, _TOT_OVF, _NARROW, _NEG_P, _NEG_D, _DRAFTS, _NEG_UB, _UB = range(1, 11)


@njit
def _own_nb(c: np.ndarray, q: np.ndarray, prompt: np.ndarray, drafts: np.ndarray, ub: np.ndarray,
            out: np.ndarray) -> None:
    """Copy the per-request vectors into the rows of ``out`` (``(2 + given optional arrays, n)``
    int32): ``c``, ``q``, then each of ``prompt``, ``drafts``, ``ub`` that is not empty, in order."""
    _copy_nb(c, out[0])
    _copy_nb(q, out[1])
    row = 2
    if prompt.shape[0]:
        _copy_nb(prompt, out[row])
        row += 1
    if drafts.shape[0]:
        _copy_nb(drafts, out[row])
        row += 1
    if ub.shape[0]:
        _copy_nb(ub, out[row])


@njit
def _copy_nb(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@njit
def _validate_nb(
    c: np.ndarray, q: np.ndarray, bt: np.ndarray, span: int, bs: int,
    prompt: np.ndarray, drafts: np.ndarray, ub: np.ndarray, diagnose: bool, own: np.ndarray,
) -> tuple[int, int, int, int, int, int, int, int, bool, bool, bool]:
    """Every rule of BatchSpec, and the derived scalars; with a non-empty ``own``, of copies.

    ``own`` is ``(0, 0)``, or ``(2 + given optional arrays, n)`` int32: the vectors are first copied
    into its rows (:func:`_own_nb`) and the rules asked of the copies, which the spec keeps.

    ``prompt``, ``drafts`` and ``ub`` are empty when not given (else they have ``c``'s length: with no
    rows the two are alike). Returns ``(status, row, col, total, max_q, max_seq, max_ub, pages,
    prefilling)``: status 0 = valid, with ``pages`` the sum of ``cdiv(seq, bs)`` and ``prefilling``
    whether some ``c < prompt``; else a rule is broken and the scalars mean nothing. (Then also
    ``uniform_queries, all_spec_rows``: :func:`_row_classes_nb` of the rows.)

    The rules come in four groups: the counts (``c, q >= 0``; ``c + q`` and the running total of
    ``q`` fit int32; the table is wide enough: status ``_NEG_C`` to ``_NARROW``), the prompt lengths,
    the drafts, the upper bounds. (The block ids are checked when a step is built, by the pass that
    copies them: :func:`attnmeta.host.common.common_pass_nb`.) The rows are taken in chunks. For each
    chunk, each group in turn folds the chunk's rows into running minimums, maximums and sums (loops
    without early exits, which the compiler vectorizes) and then asks its rules of them; the first
    broken rule ends the pass.

    - ``diagnose=False``: one chunk of every row. Status ``_INVALID`` when a rule is broken. The
      usual call: a spec is valid almost always.
    - ``diagnose=True``: chunks of one row. Every rule holds for the rows before a chunk (else the
      pass would have ended there), so a rule the running reductions break is broken by this row:
      status is the first broken rule of the first broken row (a row's rules asked in status-code
      order), at ``row``. Slower; run it to name the rule.
    """
    n = c.shape[0]
    if own.shape[0]:
        _own_nb(c, q, prompt, drafts, ub, own)
        c, q = own[0], own[1]
        row = 2
        if prompt.shape[0]:
            prompt = own[row]
            row += 1
        if drafts.shape[0]:
            drafts = own[row]
            row += 1
        if ub.shape[0]:
            ub = own[row]
    width = bt.shape[1]
    sh_bs = pow2_shift(bs)  # power-of-two sizes divide by shifts (attnmeta._intdiv)
    sh_span = pow2_shift(span)
    lo_c = lo_q = lo_p = lo_d = lo_u = np.int64(0)  # running minimums: negative breaks a rule
    over = short = np.int64(0)  # max(drafts - q), max(c + q - upper bound): positive breaks one
    ahead = np.int64(0)  # max(prompt - c): positive when a row is still in its prompt
    total = pages = max_q = max_seq = max_ub = np.int64(0)
    code = 0
    row = 0  # (read after the loop)
    step = 1 if diagnose else max(n, 1)
    for row in range(0, n, step):
        # The chunk's rows as views indexed from 0: numba's negative-index wraparound folds away for
        # an index known to be >= 0, and without it the loops vectorize.
        end = min(row + step, n)
        cs, qs = c[row:end], q[row:end]
        lo_c, lo_q, total, pages, max_q, max_seq = _fold_counts(
            cs, qs, bs, sh_bs, lo_c, lo_q, total, pages, max_q, max_seq)
        code = (_NEG_C if lo_c < 0 else _NEG_Q if lo_q < 0 else _SEQ_OVF if max_seq > INT32_MAX
                else _TOT_OVF if total > INT32_MAX else _NARROW if cdiv_by(max_seq, span, sh_span) > width
                else 0)
        if code:
            break
        if prompt.shape[0]:
            ps = prompt[row:end]
            for i in range(ps.shape[0]):
                p = np.int64(ps[i])
                lo_p = min(lo_p, p)
                ahead = max(ahead, p - np.int64(cs[i]))
            if lo_p < 0:
                code = _NEG_P
                break
        if drafts.shape[0]:
            ds = drafts[row:end]
            for i in range(ds.shape[0]):
                d = np.int64(ds[i])
                lo_d = min(lo_d, d)
                over = max(over, d - np.int64(qs[i]))
            if lo_d < 0 or over > 0:
                code = _NEG_D if lo_d < 0 else _DRAFTS
                break
        if ub.shape[0]:
            us = ub[row:end]
            for i in range(us.shape[0]):
                u = np.int64(us[i])
                lo_u = min(lo_u, u)
                short = max(short, np.int64(cs[i]) + np.int64(qs[i]) - u)
                max_ub = max(max_ub, u)
            if lo_u < 0 or short > 0:
                code = _NEG_UB if lo_u < 0 else _UB
                break
    if code == 0:
        uniform, spec = _row_classes_nb(c, q, prompt, drafts)
        return 0, 0, 0, int(total), int(max_q), int(max_seq), int(max_ub), int(pages), bool(ahead > 0), uniform, spec
    if not diagnose:
        return _INVALID, 0, 0, 0, 0, 0, 0, 0, False, False, False
    return code, row, 0, 0, 0, 0, 0, 0, False, False, False


# The fold that divides is a kernel of its own: compiled alone, its loop is split once on
# shift-or-divide and then vectorizes; inside the chunk loop of _validate_nb it would not be.
@njit
def _fold_counts(
    c: np.ndarray, q: np.ndarray, bs: int, sh_bs: int,
    lo_c: np.int64, lo_q: np.int64, total: np.int64, pages: np.int64, max_q: np.int64, max_seq: np.int64,
) -> tuple[np.int64, np.int64, np.int64, np.int64, np.int64, np.int64]:
    """The running ``(min c, min q, sum q, sum cdiv(c + q, bs), max q, max(c + q))``, rows folded in."""
    for i in range(c.shape[0]):
        ci = np.int64(c[i])
        qi = np.int64(q[i])
        seq = ci + qi
        lo_c = min(lo_c, ci)
        lo_q = min(lo_q, qi)
        total += qi
        pages += cdiv_by(seq, bs, sh_bs)
        max_q = max(max_q, qi)
        max_seq = max(max_seq, seq)
    return lo_c, lo_q, total, pages, max_q, max_seq


def _raise_invalid(
    c: np.ndarray, q: np.ndarray, bt: np.ndarray, span: int, bs: int,
    prompt: np.ndarray | None, drafts: np.ndarray | None, ub: np.ndarray | None,
) -> NoReturn:
    """Raise the ``ValueError`` of the first broken rule of a spec that breaks one (found by
    :func:`_validate_nb` with ``diagnose=True``): the field, the row, the value and the rule."""
    code, i = _validate_nb(
        c, q, bt, span, bs, _EMPTY if prompt is None else prompt, _EMPTY if drafts is None else drafts,
        _EMPTY if ub is None else ub, True, _NO_COPY,
    )[:2]
    assert code > 0, "_raise_invalid called for a valid spec"
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
        CUDA-graph padding: request rows and tokens after padding (``>= num_reqs`` / ``>= num_tokens``;
        at most :data:`MAX_PADDED_REQS` / :data:`MAX_PADDED_TOKENS`).
    context_parallel : ContextParallel, optional
        DCP/PCP layout for the slot mapping; ``None`` means no context parallelism.

    What the spec keeps
    -------------------
    The per-request vectors (``num_computed_tokens``, ``num_scheduled_tokens`` and the optional
    ones) are copied at construction into one read-only buffer of the spec's own, and validated
    there: a caller may reuse or change its arrays as soon as the constructor returns. The block
    table is kept by reference (it is the one large array, and an engine's is usually a slice of a
    persistent table): it is read when a step is built, and every used block id (columns
    ``[0, cdiv(c + q, block_size))`` of each row) is checked then, by the build's compiled pass that
    copies them (negative, or past the stager's ``num_kv_blocks``, is a ``ValueError`` naming the row
    and column). Change the table's used entries only between building steps.

    Raises
    ------
    TypeError
        A field is a torch tensor or not an integer array; ``block_size`` or a padding count is not an
        int (a bool is not).
    ValueError
        Negative counts, length mismatches, a block table too narrow for ``c + q``, padding smaller
        than the real batch or past its bound, totals that overflow int32. (The block ids themselves are checked when
        a step is built: see "What the spec keeps".)

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
    any_prefilling: bool = dataclasses.field(init=False)
    """Whether a row is still in its prompt (``num_computed_tokens < num_prompt_tokens``; False without
    prompt lengths)."""
    uniform_queries: bool = dataclasses.field(init=False)
    """Every row's query is ``num_scheduled_tokens[0]`` tokens or none (:attr:`StepShape.uniform_queries`)."""
    all_spec_rows: bool = dataclasses.field(init=False)
    """Every row a spec-decode row by vLLM's runner rule (:attr:`StepShape.all_spec_rows`)."""

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
        bs = _block_size(block_size)
        bt = block_table_rows(block_table, n)
        cp = context_parallel
        if cp is not None:
            if not isinstance(cp, ContextParallel):
                raise TypeError(f"context_parallel: expected ContextParallel, got {type(cp).__name__}")
            if cp.world_size < 1 or not 0 <= cp.rank < cp.world_size:
                raise ValueError(f"context_parallel: need 0 <= rank < world_size, got {cp}")
            _check_interleave(cp, bs)
        prompt = None if num_prompt_tokens is None else as_host_array(num_prompt_tokens, "num_prompt_tokens", length=n)
        drafts = None if num_draft_tokens is None else as_host_array(num_draft_tokens, "num_draft_tokens", length=n)
        ub = (None if seq_lens_upper_bound is None
              else as_host_array(seq_lens_upper_bound, "seq_lens_upper_bound", length=n))
        span = bs * (1 if cp is None else cp.world_size)  # tokens per block-table column
        # The spec owns its per-request vectors: the kernel copies them into one read-only buffer and
        # validates the copies, so a caller changing its arrays afterwards changes nothing here.
        own = np.empty((2 + (prompt is not None) + (drafts is not None) + (ub is not None), n), np.int32)
        code, _, _, total, max_q, max_seq, max_ub, pages, prefilling, uniform, all_spec = _validate_nb(
            c, q, bt, span, bs, _EMPTY if prompt is None else prompt, _EMPTY if drafts is None else drafts,
            _EMPTY if ub is None else ub, False, own,  # (diagnose: only when a rule is broken, to name it)
        )
        c, q, prompt, drafts, ub = _owned_rows(own, prompt, drafts, ub)
        if code:
            _raise_invalid(c, q, bt, span, bs, prompt, drafts, ub)
        rp = num_reqs_padded
        if rp is not None or num_tokens_padded is not None:
            for name, v in (("num_reqs_padded", rp), ("num_tokens_padded", num_tokens_padded)):
                if v is not None and (isinstance(v, _BOOL_TYPES) or not isinstance(v, _INT_TYPES)):
                    raise TypeError(f"{name}: expected an int or None, got {type(v).__name__} {v!r}")
        if rp is not None and not n <= rp <= MAX_PADDED_REQS:
            raise ValueError(f"num_reqs_padded: {rp!r} < num_reqs={n}; padding can only add rows" if rp < n
                             else f"num_reqs_padded: {rp} is more than attnmeta.spec.MAX_PADDED_REQS="
                                  f"{MAX_PADDED_REQS} rows a step (for a batch of {n} requests)")
        tp = num_tokens_padded
        if tp is not None:
            if not isinstance(tp, _INT_TYPES) or tp < total:
                raise ValueError(f"num_tokens_padded: {tp!r} < num_tokens={total}; padding can only add tokens")
            if tp > MAX_PADDED_TOKENS:
                raise ValueError(f"num_tokens_padded: {tp} is more than attnmeta.spec.MAX_PADDED_TOKENS="
                                 f"{MAX_PADDED_TOKENS} tokens a step (for a batch of {total} tokens)")
        # Every field is set once, here. A frozen dataclass refuses `self.x = v`, and one
        # object.__setattr__ call a field is a sizeable part of a small step's construction, so `self`
        # becomes a _FillableBatchSpec (same slots, same memory layout, no frozen __setattr__) for
        # plain slot stores, then a BatchSpec again: the stores cannot fail, and the `finally` restores
        # the class even if an interrupt lands between them. A subclass's instance (another layout)
        # cannot switch: its fields are stored into a scratch _FillableBatchSpec and copied over, one
        # object.__setattr__ each.
        mine = type(self) is BatchSpec
        o: Any = self if mine else object.__new__(_FillableBatchSpec)
        if mine:
            object.__setattr__(self, "__class__", _FillableBatchSpec)
        try:
            o.num_computed_tokens = c
            o.num_scheduled_tokens = q
            o.block_table = bt
            o.block_size = bs
            o.num_prompt_tokens = prompt
            o.num_draft_tokens = drafts
            o.seq_lens_upper_bound = ub
            o.num_reqs_padded = None if rp is None else int(rp)
            o.num_tokens_padded = None if tp is None else int(tp)
            o.context_parallel = cp
            o.num_reqs = n
            o.num_tokens = total
            o.max_query_len = max_q
            o.max_seq_len = max_seq if ub is None else max_ub
            o.max_exact_seq_len = max_seq
            o.num_pages = pages
            o.any_prefilling = prefilling
            o.uniform_queries = uniform
            o.all_spec_rows = all_spec
        finally:
            if mine:
                o.__class__ = BatchSpec
        if not mine:
            for name in _FIELDS:
                object.__setattr__(self, name, getattr(o, name))

    def for_group(self, *, block_table: npt.ArrayLike, block_size: int) -> BatchSpec:
        """The same step for another KV-cache group: this spec's requests, counts, optional arrays,
        padding and context parallelism, with that group's block table and block size (a hybrid model's
        Mamba group: one state block a request; an attention group of another page size).

        The per-request vectors are this spec's own read-only ones, already copied and validated, so this
        costs less than a new :class:`BatchSpec` of the same arguments; the new table is checked as the
        constructor checks it (wide enough for ``c + q`` at the new block size), and the derived scalars
        (``num_pages`` among them) are those of the new block size.

        Parameters
        ----------
        block_table : (num_reqs, max_blocks_per_req) int32, host
            The group's block table (kept by reference, as the constructor keeps it).
        block_size : int
            The group's tokens per block.

        Returns
        -------
        BatchSpec
            Equal to ``BatchSpec(**{**spec_arguments(self), "block_table": block_table, "block_size": block_size})``.

        Raises
        ------
        TypeError, ValueError
            As the constructor, for the table and the block size.

        Examples
        --------
        >>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 4],
        ...                  block_table=[[1, 2], [3, 0]], block_size=4)
        >>> states = spec.for_group(block_table=[[7], [8]], block_size=1024)
        >>> states.num_pages, states.num_tokens, states.num_computed_tokens is spec.num_computed_tokens
        (2, 5, True)
        """
        if type(self) is not BatchSpec:  # (a subclass: its own construction, its own fields kept)
            return dataclasses.replace(self, block_table=block_table, block_size=block_size)  # type: ignore[arg-type]
        n = self.num_reqs
        bs = _block_size(block_size)
        bt = block_table_rows(block_table, n)
        cp = self.context_parallel
        if cp is not None:
            _check_interleave(cp, bs)
        span = bs * (1 if cp is None else cp.world_size)
        # The counts' rules held when this spec was made; of the new table only its width is new, a rule
        # of the longest sequence (max_exact_seq_len); the pages are those of the new block size.
        if -(-self.max_exact_seq_len // span) > bt.shape[1]:
            _raise_invalid(self.num_computed_tokens, self.num_scheduled_tokens, bt, span, bs, self.num_prompt_tokens,
                           self.num_draft_tokens, self.seq_lens_upper_bound)
        values = list(_GET_FIELDS(self))
        values[_AT_TABLE], values[_AT_BLOCK_SIZE] = bt, bs
        values[_AT_PAGES] = _pages_nb(self.num_computed_tokens, self.num_scheduled_tokens, bs, pow2_shift(bs))
        out: Any = object.__new__(_FillableBatchSpec)  # (as __init__: plain slot stores, then a BatchSpec)
        _store_fields(out, *values)
        out.__class__ = BatchSpec
        return out  # type: ignore[no-any-return]

    def __post_init__(self) -> None:
        """A dataclass subclass's generated ``__init__`` sets the init fields and calls this: validate
        them and set the derived fields, as :meth:`__init__` does (``BatchSpec`` itself never calls it)."""
        BatchSpec.__init__(self, **spec_arguments(self))

    @property
    def shape(self) -> StepShape:
        """The step's scalars (:class:`StepShape`): what builders' ``needs`` and ``replay_key`` read."""
        q, prompt = self.num_scheduled_tokens, self.num_prompt_tokens
        return StepShape(
            self.num_reqs, self.num_tokens, self.num_reqs_padded, self.num_tokens_padded, self.max_query_len,
            int(q[0]) if self.num_reqs else 0, self.max_seq_len, self.max_exact_seq_len, self.num_pages,
            self.block_size, int(self.block_table.shape[1]),
            self.any_prefilling, prompt is not None,
            self.num_draft_tokens is not None, self.seq_lens_upper_bound is not None, self.context_parallel,
            self.uniform_queries, self.all_spec_rows,
        )

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


def _block_size(bs: Any) -> int:
    """``block_size`` checked: a positive int that fits int32 (a bool is not an int here)."""
    if type(bs) is not int and (isinstance(bs, _BOOL_TYPES) or not isinstance(bs, _INT_TYPES)):
        raise TypeError(f"block_size: expected a positive int, got {type(bs).__name__} {bs!r}")
    if bs <= 0:
        raise ValueError(f"block_size: must be a positive int, got {bs!r}")
    if bs > INT32_MAX:
        raise ValueError(f"block_size: {bs} overflows int32")
    return int(bs)


def _check_interleave(cp: ContextParallel, bs: int) -> None:
    if cp.interleave < 1 or bs % cp.interleave:
        raise ValueError(f"context_parallel.interleave={cp.interleave} must be >= 1 and divide block_size={bs}")


def _owned_rows(own: np.ndarray, prompt: Any, drafts: Any, ub: Any) -> tuple[Any, ...]:
    """``own`` (a spec's copies of its per-request arrays, one row each: the computed and scheduled
    counts, then those of ``prompt``, ``drafts`` and ``ub`` that are not None) made read-only, as the
    spec's ``(num_computed_tokens, num_scheduled_tokens, num_prompt_tokens, num_draft_tokens,
    seq_lens_upper_bound)``: a row each, None for an array not given."""
    own.setflags(write=False)
    k = 2
    p = d = u = None
    if prompt is not None:
        p, k = own[k], k + 1
    if drafts is not None:
        d, k = own[k], k + 1
    if ub is not None:
        u = own[k]
    return own[0], own[1], p, d, u


class _FillableBatchSpec:
    """:class:`BatchSpec`'s slots, writable: the same base and the same slots in the same order, so
    the same memory layout, and an instance may switch ``__class__`` between the two (``__init__``)."""

    __slots__ = BatchSpec.__slots__


_FIELDS = tuple(f.name for f in dataclasses.fields(BatchSpec))
"""Every field, in declaration order."""
_INIT_FIELDS = tuple(f.name for f in dataclasses.fields(BatchSpec) if f.init)
"""The constructor's arguments, in declaration order."""


_GET_FIELDS = operator.attrgetter(*_FIELDS)
"""Every field's value of a spec, in declaration order (one call)."""
_AT_TABLE, _AT_BLOCK_SIZE, _AT_PAGES = (_FIELDS.index(n) for n in ("block_table", "block_size", "num_pages"))
_store_fields = vars(dataclasses.make_dataclass("_BatchSpecStores", [(n, Any) for n in _FIELDS], eq=False,
                                                repr=False))["__init__"]
"""Stores every field, given in declaration order, into a :class:`_FillableBatchSpec` (plain slot stores)."""


@njit
def _pages_nb(c: np.ndarray, q: np.ndarray, bs: int, sh_bs: int) -> int:
    """``sum(cdiv(c + q, bs))`` over the rows (counts already validated): :func:`_fold_counts`'s page sum."""
    z = np.int64(0)
    return int(_fold_counts(c, q, bs, sh_bs, z, z, z, z, z, z)[3])


def spec_arguments(spec: BatchSpec) -> dict[str, Any]:
    """The keyword arguments that construct ``spec`` again (its init fields, the host arrays
    themselves, not copies): what an engine passes each step, for benchmarks and subclasses."""
    return {name: getattr(spec, name) for name in _INIT_FIELDS}


@njit
def _row_classes_nb(c: np.ndarray, q: np.ndarray, prompt: np.ndarray, drafts: np.ndarray) -> tuple[bool, bool]:
    """:attr:`StepShape.uniform_queries` and :attr:`StepShape.all_spec_rows` of valid counts (``prompt`` and
    ``drafts`` empty when not given): every query ``q[0]`` tokens or none; every row ``d > 0`` drafts and
    ``q == d + 1`` tokens, or one token past its prompt (``c >= prompt``)."""
    n = q.shape[0]
    if n == 0:
        return True, False
    q0 = q[0]
    uniform = spec = True
    has_p, has_d = prompt.shape[0] > 0, drafts.shape[0] > 0
    for i in range(n):
        qi = q[i]
        if qi != 0 and qi != q0:
            uniform = False
        d = drafts[i] if has_d else 0
        if not ((d > 0 and qi == d + 1) or (qi == 1 and (not has_p or c[i] >= prompt[i]))):
            spec = False
    return uniform, spec


@njit
def _scan_nb(c: np.ndarray, q: np.ndarray, bt: np.ndarray, bs: int, prompt: np.ndarray, drafts: np.ndarray,
             ub: np.ndarray, groups: np.ndarray, none: np.ndarray
             ) -> tuple[int, int, int, int, int, int, int, bool, bool, bool]:
    """:func:`_validate_nb` of the counts against the first group's table (no copies, no context
    parallelism); the width rule and the page count of every further group (``groups``: a row per group,
    ``(block size, table columns, pages)``, the pages written here); the scalars a :class:`StepShape`
    adds.

    Returns ``(status, total, max_q, max_seq, max_ub, pages, first_q, prefilling, uniform_queries,
    all_spec_rows)``; status 0 = every rule holds (else the scalars mean nothing: the constructor names
    the broken rule)."""
    st, _row, _col, total, max_q, max_seq, max_ub, pages0, prefilling, uniform, spec = _validate_nb(
        c, q, bt, bs, bs, prompt, drafts, ub, False, none)
    if st:
        return st, 0, 0, 0, 0, 0, 0, False, False, False
    z = np.int64(0)
    for g in range(groups.shape[0]):
        s = groups[g, 0]
        sh = pow2_shift(s)
        if cdiv_by(np.int64(max_seq), s, sh) > groups[g, 1]:
            return _NARROW, 0, 0, 0, 0, 0, 0, False, False, False
        groups[g, 2] = _fold_counts(c, q, s, sh, z, z, z, z, z, z)[3]
    return 0, total, max_q, max_seq, max_ub, pages0, int(q[0]) if c.shape[0] else 0, prefilling, uniform, spec


def _counted(a: Any, n: int) -> bool:
    """``a`` is what :func:`as_host_array` keeps as it is: a C-contiguous int32 vector of ``n`` rows."""
    return type(a) is np.ndarray and a.dtype == _I32 and a.ndim == 1 and a.shape[0] == n and a.flags.c_contiguous


def _table(t: Any, n: int) -> bool:
    """``t`` is a ``(block_table, block_size)`` tuple that :func:`block_table_rows` and the block-size check
    keep as they are, with at least ``n`` rows."""
    if type(t) is not tuple or len(t) != 2:
        return False
    bt, bs = t
    return (type(bt) is np.ndarray and bt.dtype == _I32 and bt.ndim == 2 and bt.shape[0] >= n
            and bt.flags.c_contiguous and type(bs) is int and 0 < bs <= INT32_MAX)


def scan_counts(
    c: Any, q: Any, tables: Any, prompt: Any, drafts: Any, ub: Any, rp: Any, tp: Any, groups: np.ndarray,
) -> tuple[Any, ...] | None:
    """The host scalars of one step over several KV-cache groups, from the scheduler's arrays, in one
    compiled scan that checks every rule a :class:`BatchSpec` checks; None when an argument is not
    already what a spec keeps as given, or a rule is broken (then ``BatchSpec(...)`` and
    :meth:`BatchSpec.for_group` of the same arguments raise the error that names it).

    ``tables`` is a list or tuple of ``(block_table, block_size)``, one per group; ``groups`` a scratch
    ``(len(tables) - 1, 3)`` int64 array. Returns a plain tuple, the step composer's key into its cache
    of shapes (:func:`shapes_of` makes them): ``(num_reqs, num_tokens, num_reqs_padded,
    num_tokens_padded, max_query_len, first_query_len, max_seq_len, max_exact_seq_len, any_prefilling,
    has_prompt, has_drafts, has_upper_bound, uniform_queries, all_spec_rows)`` and per group ``(num_pages,
    block_size, table_columns)``.
    Reads the arrays and keeps none (:meth:`attnmeta.compose.StepBuilder.build_counts`).
    """
    if type(c) is not np.ndarray or c.ndim != 1:
        return None
    n = c.shape[0]
    if not _counted(c, n) or not _counted(q, n):
        return None
    if (prompt is not None and not _counted(prompt, n)) or (drafts is not None and not _counted(drafts, n)) or (
            ub is not None and not _counted(ub, n)):
        return None
    if (rp is not None and (type(rp) is not int or not n <= rp <= MAX_PADDED_REQS)) or (
            tp is not None and type(tp) is not int):
        return None
    if type(tables) not in (list, tuple) or len(tables) != groups.shape[0] + 1:
        return None
    for g, t in enumerate(tables):
        if not _table(t, n):
            return None
        if g:
            groups[g - 1, 0] = t[1]
            groups[g - 1, 1] = t[0].shape[1]
    bt0, bs0 = tables[0]
    st, total, max_q, max_seq, max_ub, pages0, first, pre, uni, spec = _scan_nb(
        c, q, bt0, bs0, _EMPTY if prompt is None else prompt, _EMPTY if drafts is None else drafts,
        _EMPTY if ub is None else ub, groups, _NO_COPY)
    if st or (tp is not None and not total <= tp <= MAX_PADDED_TOKENS):
        return None
    head = (n, total, rp, tp, max_q, first, max_seq if ub is None else max_ub, max_seq, pre, prompt is not None,
            drafts is not None, ub is not None, uni, spec, pages0, bs0, bt0.shape[1])
    if not groups.shape[0]:
        return head
    rest: list[int] = []
    for bs, width, pages in groups.tolist():  # (a host array: the scan's scratch)
        rest += (pages, bs, width)
    return head + tuple(rest)


_new_tuple = tuple.__new__
"""``_new_tuple(StepShape, fields)``: a :class:`StepShape` of its 18 fields in order, without the named
tuple's Python-level ``__new__``."""


SCAN_HEAD = 14
"""The scalars of a :func:`scan_counts` result before its groups' ``(num_pages, block_size, table_columns)``."""


def specs_of_scan(c: np.ndarray, q: np.ndarray, tables: Sequence[tuple[np.ndarray, int]], prompt: np.ndarray | None,
                  drafts: np.ndarray | None, ub: np.ndarray | None, scan: tuple[Any, ...]) -> tuple[BatchSpec, ...]:
    """The specs of :func:`scan_counts`' arguments, one per group, from its (not None) result: equal, field
    for field, to ``BatchSpec(...)`` of the first group's table and :meth:`BatchSpec.for_group` of each
    further one, without checking again what the scan checked.

    The per-request arrays are copied once into one read-only buffer the specs share, as the constructor
    and ``for_group`` share theirs; every scalar is the scan's. The step composer's counts entry
    (:meth:`attnmeta.compose.StepBuilder.build_counts`) makes its specs this way for the steps it composes
    (a serving loop's mixed steps, most of them).
    """
    n, total, rp, tp, max_q, _first, top, exact, pre, _has_p, _has_d, _has_u, uni, spec = scan[:SCAN_HEAD]
    rows = [c, q] + [a for a in (prompt, drafts, ub) if a is not None]
    own = np.empty((len(rows), n), np.int32)
    for i, a in enumerate(rows):
        own[i] = a
    cc, qq, p, d, u = _owned_rows(own, prompt, drafts, ub)
    out: list[BatchSpec] = []
    for g, (bt, bs) in enumerate(tables):
        o: Any = object.__new__(_FillableBatchSpec)  # (as for_group: plain slot stores, then a BatchSpec)
        _store_fields(o, num_computed_tokens=cc, num_scheduled_tokens=qq, block_table=bt, block_size=bs,
                      num_prompt_tokens=p, num_draft_tokens=d, seq_lens_upper_bound=u, num_reqs_padded=rp,
                      num_tokens_padded=tp, context_parallel=None, num_reqs=n, num_tokens=total, max_query_len=max_q,
                      max_seq_len=top, max_exact_seq_len=exact, num_pages=scan[SCAN_HEAD + 3 * g], any_prefilling=pre,
                      uniform_queries=uni, all_spec_rows=spec)
        o.__class__ = BatchSpec
        out.append(o)
    return tuple(out)


def shapes_of(scan: tuple[Any, ...]) -> tuple[StepShape, ...]:
    """The :class:`StepShape` of each group of a :func:`scan_counts` result."""
    n, total, rp, tp, max_q, first, top, exact, pre, has_p, has_d, has_u, uni, spec = scan[:SCAN_HEAD]
    shapes = []
    for k in range(SCAN_HEAD, len(scan), 3):
        shapes.append(_new_tuple(StepShape, (n, total, rp, tp, max_q, first, top, exact, scan[k], scan[k + 1],
                                             scan[k + 2], pre, has_p, has_d, has_u, None, uni, spec)))
    return tuple(shapes)

