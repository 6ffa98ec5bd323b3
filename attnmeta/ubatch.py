"""Micro-batches (DBO): the plan of a step's micro-batches and one common metadata per micro-batch.

Under dual-batch overlap (vLLM's DBO, data parallel size > 1) a step's tokens are cut into
``num_ubatches`` contiguous token ranges; each runs the model on its own, with its own common
attention metadata. This module does both halves the attnmeta way:

- :func:`ubatch_slices` (vLLM's ``maybe_create_ubatch_slices``) and :func:`is_last_ubatch_empty`:
  the plan, pure host arithmetic on the scheduled token counts;
- :func:`ubatch_specs` and :func:`stage_ubatches`: each micro-batch described as a
  :class:`~attnmeta.spec.BatchSpec` of its own (the rows of its requests, a split request's first
  part and continuation following vLLM's ``split_attn_metadata`` rules) and staged through
  :func:`attnmeta.stage_common` under its own prefix (``common_ub0``, ``common_ub1``, ...), so that
  every micro-batch moves in the step's ONE copy. vLLM instead slices the parent's device tensors
  and subtracts on the device, per micro-batch.

Why one top-level module rather than ``host/ubatch.py`` plus a staging function: the host part is a
few lines of numpy over ``num_reqs + 1`` offsets (nothing to compile, no per-token loop), and the
staging half is one :func:`attnmeta.stage_common` call per micro-batch; split in two, each half would
be a wrapper of the other.

What a micro-batch's metadata carries (field by field, docs/semantics.md "Micro-batches"): the
``query_start_loc``, ``seq_lens``, ``block_table_tensor``, ``slot_mapping`` and ``positions`` (and
their host twins) equal vLLM's ``split_attn_metadata`` results, padding included;
``max_seq_len`` is the PARENT's (vLLM's quirk); ``max_query_len`` is the micro-batch's own (the
parent's if that is 0). vLLM drops every other field (``is_prefilling`` becomes None, ``causal``
True, ...); attnmeta's micro-batches carry them, derived from the micro-batch's own rows:
``num_computed_tokens_cpu`` (a continuation's ``c`` grows by the tokens before the slice),
``is_prefilling`` (``c' < num_prompt_tokens``), ``num_decode_draft_tokens_cpu`` (the row's draft
tokens that fall inside the slice), ``causal`` (the caller's).

Shape legend
------------
- ``num_reqs`` / ``num_reqs_padded``: the parent step's real request rows / rows with padding.
- ``num_tokens`` / ``num_tokens_padded``: the parent step's real tokens / tokens with padding.
- ``num_ubatches``: micro-batches (2 or more).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from attnmeta._checks import as_host_array
from attnmeta.common import stage_common
from attnmeta.metadata import CommonAttentionMetadata, StagedCommon
from attnmeta.spec import BatchSpec
from attnmeta.staging import Step

__all__ = [
    "UBatchPlan",
    "UBatchSlice",
    "is_last_ubatch_empty",
    "stage_ubatches",
    "ubatch_slices",
    "ubatch_specs",
]


class UBatchSlice(NamedTuple):
    """One micro-batch: the parent step's request rows and tokens it covers (vLLM's ``UBatchSlice``).

    A request that crosses a split point appears in the slices on both sides of it.
    """

    request_slice: slice
    """Rows ``[start, stop)`` of the parent step (``step`` None)."""
    token_slice: slice
    """Tokens ``[start, stop)`` of the parent step (``step`` None)."""

    def is_empty(self) -> bool:
        """Whether the slice covers no row or no token (vLLM's ``UBatchSlice.is_empty()``)."""
        return bool(self.request_slice.start == self.request_slice.stop
                    or self.token_slice.start == self.token_slice.stop)

    @property
    def num_tokens(self) -> int:
        """Tokens of the slice, ``token_slice.stop - token_slice.start``."""
        return int(self.token_slice.stop - self.token_slice.start)


class UBatchPlan(NamedTuple):
    """:func:`ubatch_slices`'s result: the micro-batches unpadded and padded."""

    slices: tuple[UBatchSlice, ...]
    """The micro-batches over real rows and tokens (attention built from these when not padded)."""
    padded_slices: tuple[UBatchSlice, ...]
    """The same, the last widened to ``num_reqs_padded`` rows and ``num_tokens_padded`` tokens
    (attention built from these under full CUDA graphs; per-layer slot mappings use their tokens)."""


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {v}")
    return int(v)


def is_last_ubatch_empty(orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int) -> bool:
    """Whether the last micro-batch would hold no real token (vLLM's ``is_last_ubatch_empty``).

    The split points come from the padded count, ``(padded // n) * i``; the last micro-batch starts at
    ``(padded // n) * (n - 1)`` and is empty of real tokens when that is ``>= orig``. vLLM then does not
    micro-batch the step.

    Parameters
    ----------
    orig_num_tokens : int
        Real tokens of the step (vLLM: the minimum over data-parallel ranks).
    padded_num_tokens : int
        Tokens after padding (vLLM: the maximum over ranks).
    num_ubatches : int
        Micro-batches, >= 2.

    Returns
    -------
    bool

    Raises
    ------
    TypeError, ValueError
        A count that is not an int, negative, or ``num_ubatches < 2``.

    Examples
    --------
    >>> is_last_ubatch_empty(10, 16, 2), is_last_ubatch_empty(8, 16, 2)
    (False, True)
    """
    o = _check_int("orig_num_tokens", orig_num_tokens, 0)
    p = _check_int("padded_num_tokens", padded_num_tokens, 0)
    n = _check_int("num_ubatches", num_ubatches, 2)
    return (p // n) * (n - 1) >= o


def ubatch_slices(
    num_scheduled_tokens: npt.ArrayLike,
    num_tokens_padded: int,
    num_reqs_padded: int,
    num_ubatches: int,
    split_point: int | Sequence[int] | None = None,
) -> UBatchPlan:
    """The micro-batches of a step: vLLM's ``maybe_create_ubatch_slices`` when it micro-batches.

    Split points: ``split_point`` (one int ``p`` gives ``[p, 2p, ...]``; a sequence gives the
    ``num_ubatches - 1`` points themselves), by default ``num_tokens_padded // num_ubatches`` (from the
    PADDED count, so the last micro-batch holds fewer real tokens). The last micro-batch ends at the
    real token total. Each micro-batch's rows: from the row containing its first token
    (``searchsorted(cu, start, 'right') - 1``) to the first row starting at or after its end
    (``searchsorted(cu, end, 'left')``), with ``cu = [0, cumsum(num_scheduled_tokens)]``.

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int32, host
        Tokens scheduled per real request.
    num_tokens_padded : int
        Tokens after padding, ``>= sum(num_scheduled_tokens)``.
    num_reqs_padded : int
        Request rows after padding, ``>= num_reqs``.
    num_ubatches : int
        Micro-batches, >= 2.
    split_point : int or sequence of int, optional
        The split points (see above); default from the padded token count.

    Returns
    -------
    UBatchPlan
        ``slices`` and ``padded_slices``, ``num_ubatches`` each.

    Raises
    ------
    TypeError
        A count is not an int, or ``num_scheduled_tokens`` not an integer array.
    ValueError
        Padding smaller than the real batch; split points that are not strictly increasing within
        ``(0, num_tokens)`` (every micro-batch must hold a real token: with the default points this
        is ``not is_last_ubatch_empty(num_tokens, num_tokens_padded, num_ubatches)``).

    Examples
    --------
    >>> plan = ubatch_slices([5, 3, 9, 1], num_tokens_padded=20, num_reqs_padded=6, num_ubatches=2)
    >>> [(s.request_slice, s.token_slice) for s in plan.slices]
    [(slice(0, 3, None), slice(0, 10, None)), (slice(2, 4, None), slice(10, 18, None))]
    >>> plan.padded_slices[1]
    UBatchSlice(request_slice=slice(2, 6, None), token_slice=slice(10, 20, None))
    """
    q = as_host_array(num_scheduled_tokens, "num_scheduled_tokens")
    if q.size and int(q.min()) < 0:
        i = int(np.argmin(q))
        raise ValueError(f"num_scheduled_tokens[{i}]={int(q[i])} is negative; counts must be >= 0")
    n = _check_int("num_ubatches", num_ubatches, 2)
    B = q.shape[0]
    cu = np.zeros(B + 1, np.int64)
    np.cumsum(q, out=cu[1:])
    T = int(cu[-1])
    Tp = _check_int("num_tokens_padded", num_tokens_padded, 0)
    Bp = _check_int("num_reqs_padded", num_reqs_padded, 0)
    if Tp < T:
        raise ValueError(f"num_tokens_padded: {Tp} < num_tokens={T}; padding can only add tokens")
    if Bp < B:
        raise ValueError(f"num_reqs_padded: {Bp} < num_reqs={B}; padding can only add rows")
    if split_point is None:
        points = [(Tp // n) * i for i in range(1, n)]
        how = f"from num_tokens_padded // num_ubatches = {Tp} // {n}"
    elif isinstance(split_point, int | np.integer) and not isinstance(split_point, bool | np.bool_):
        points = [int(split_point) * i for i in range(1, n)]
        how = f"from split_point={int(split_point)}"
    else:
        points = [_check_int(f"split_point[{i}]", p, 0) for i, p in enumerate(split_point)]  # type: ignore[arg-type]
        how = "given"
        if len(points) != n - 1:
            raise ValueError(f"split_point: {n} micro-batches need {n - 1} split points, got {len(points)}: {points}")
    bounds = [0, *points, T]
    for i in range(n):
        if not bounds[i] < bounds[i + 1]:
            raise ValueError(
                f"split points {points} ({how}) leave micro-batch {i} without a real token (tokens "
                f"[{bounds[i]}, {bounds[i + 1]}) of num_tokens={T}); they must be strictly increasing within "
                f"(0, num_tokens) (vLLM does not micro-batch such a step: is_last_ubatch_empty)"
            )
    starts = np.asarray(bounds[:-1], np.int64)
    ends = np.asarray(bounds[1:], np.int64)
    r_start = np.searchsorted(cu, starts, "right") - 1
    r_stop = np.searchsorted(cu, ends, "left")
    slices = tuple(UBatchSlice(slice(int(a), int(b)), slice(int(s), int(e)))
                   for a, b, s, e in zip(r_start, r_stop, starts, ends))
    last = slices[-1]
    padded = (*slices[:-1], UBatchSlice(slice(last.request_slice.start, Bp), slice(last.token_slice.start, Tp)))
    assert sum(s.num_tokens for s in padded) == Tp
    return UBatchPlan(slices, padded)


def _slice_spec(spec: BatchSpec, cu: np.ndarray, i: int, s: UBatchSlice) -> BatchSpec:
    """The BatchSpec of micro-batch ``i`` (``s``) of ``spec``, whose query offsets are ``cu``."""
    if not isinstance(s, UBatchSlice):
        raise TypeError(f"slices[{i}]: expected a UBatchSlice, got {type(s).__name__} {s!r}")
    rs, ts = s.request_slice, s.token_slice
    B, Bp, Tp = spec.num_reqs, spec.padded_num_reqs, spec.padded_num_tokens
    for name, sl in (("request_slice", rs), ("token_slice", ts)):
        if not isinstance(sl, slice) or not isinstance(sl.start, int) or not isinstance(sl.stop, int) or sl.step not in (None, 1):
            raise TypeError(f"slices[{i}].{name}: expected a slice of ints with step None, got {sl!r}")
    r0, rstop, t0, tstop = rs.start, rs.stop, ts.start, ts.stop
    if not 0 <= r0 < rstop <= Bp:
        raise ValueError(f"slices[{i}].request_slice={rs}: need 0 <= start < stop <= num_reqs_padded={Bp}")
    if not 0 <= t0 < tstop <= Tp:
        raise ValueError(f"slices[{i}].token_slice={ts}: need 0 <= start < stop <= num_tokens_padded={Tp}")
    if r0 >= B or not cu[r0] <= t0 < cu[r0 + 1]:
        raise ValueError(
            f"slices[{i}]: its first token {t0} is not in its first request {r0}"
            + (f" (tokens [{int(cu[r0])}, {int(cu[r0 + 1])}))" if r0 < B else f" (a padding row; num_reqs={B})")
        )
    stop = min(rstop, B)  # real rows [r0, stop); rows [stop, rstop) are padding
    if rstop < B and tstop > cu[rstop]:
        raise ValueError(f"slices[{i}]: tokens up to {tstop} run past its last request {rstop - 1} "
                         f"(which ends at token {int(cu[rstop])})")
    c = spec.num_computed_tokens[r0:stop].copy()
    q = spec.num_scheduled_tokens[r0:stop].copy()
    ub_parent = spec.seq_lens_upper_bound
    ub = None if ub_parent is None else ub_parent[r0:stop].copy()
    before = t0 - int(cu[r0])  # tokens of the first row in earlier micro-batches
    after = max(0, int(cu[stop]) - tstop)  # tokens of the last row in later ones
    q0, ql = int(q[0]), int(q[-1])
    c[0] += before
    q[0] -= before
    q[-1] -= after
    if ub is not None:
        ub[-1] -= after
    if q[-1] < 0:
        raise ValueError(f"slices[{i}]: its last token {tstop - 1} is before its last request {stop - 1} "
                         f"(tokens [{int(cu[stop - 1])}, {int(cu[stop])}))")
    drafts = None
    if spec.num_draft_tokens is not None:
        # a row's drafts are its last d tokens: keep those inside [first, last) of the row's tokens
        d = spec.num_draft_tokens[r0:stop].copy()
        first = np.zeros(d.shape[0], np.int64)
        last = spec.num_scheduled_tokens[r0:stop].astype(np.int64)
        first[0] = before
        last[-1] = (q0 if stop - r0 == 1 else ql) - after
        d_start = spec.num_scheduled_tokens[r0:stop].astype(np.int64) - d
        drafts = np.maximum(0, last - np.maximum(first, d_start)).astype(np.int32)
    prompt = None if spec.num_prompt_tokens is None else spec.num_prompt_tokens[r0:stop]
    return BatchSpec(
        num_computed_tokens=c, num_scheduled_tokens=q, block_table=spec.block_table[r0:stop],
        block_size=spec.block_size, num_prompt_tokens=prompt, num_draft_tokens=drafts, seq_lens_upper_bound=ub,
        num_reqs_padded=rstop - r0, num_tokens_padded=tstop - t0, context_parallel=spec.context_parallel,
    )


def ubatch_specs(spec: BatchSpec, slices: Sequence[UBatchSlice]) -> list[BatchSpec]:
    """Each micro-batch of ``spec`` as a :class:`BatchSpec` of its own (host only).

    Micro-batch ``k`` covers rows ``r0..r1`` and tokens ``[t0, t1)`` of the parent. Its rows are those
    requests, with vLLM's ``split_attn_metadata`` rules for a request cut by a split point:

    - the FIRST part (the request continues in a later micro-batch): ``c' = c``, ``q'`` = its tokens
      here, so ``seq_len' = c + q'`` and the upper bound shrinks by the tokens cut off;
    - a CONTINUATION (the request began in an earlier micro-batch): ``c' = c +`` the tokens before
      ``t0``, ``q'`` = its tokens here: it keeps the full ``seq_len`` and upper bound, only its query
      shrinks.

    So the positions and slots of its tokens are those of the parent's tokens ``[t0, t1)``. Rows past
    the parent's real rows and tokens past its real tokens become the micro-batch's padding
    (``num_reqs_padded = r1 - r0 + 1``, ``num_tokens_padded = t1 - t0``). ``num_prompt_tokens`` is
    kept per row; ``num_draft_tokens`` counts the row's drafts (its last ``d`` tokens) inside the
    micro-batch. The block-table rows are views of the parent's.

    Parameters
    ----------
    spec : BatchSpec
        The parent step.
    slices : sequence of UBatchSlice
        Its micro-batches (:func:`ubatch_slices`' ``slices`` or ``padded_slices``), in any number.

    Returns
    -------
    list of BatchSpec
        One per slice.

    Raises
    ------
    TypeError
        ``spec`` is not a BatchSpec, or a slice is not a :class:`UBatchSlice` of int slices.
    ValueError
        A slice out of range, empty, or whose first (last) token is not in its first (last) row.

    Examples
    --------
    >>> spec = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[12], block_table=[[0, 1, 2, 3, 4]],
    ...                  block_size=4)
    >>> plan = ubatch_slices([12], 12, 1, 3)
    >>> [(int(s.num_computed_tokens[0]), int(s.num_scheduled_tokens[0])) for s in ubatch_specs(spec, plan.slices)]
    [(0, 4), (4, 4), (8, 4)]
    """
    if not isinstance(spec, BatchSpec):
        raise TypeError(f"spec: expected a BatchSpec, got {type(spec).__name__}")
    cu = np.zeros(spec.num_reqs + 1, np.int64)
    np.cumsum(spec.num_scheduled_tokens, out=cu[1:])
    return [_slice_spec(spec, cu, i, s) for i, s in enumerate(slices)]


def stage_ubatches(
    spec: BatchSpec,
    step: Step,
    slices: Sequence[UBatchSlice],
    *,
    prefix: str = "common",
    causal: bool = True,
    block_table_columns: int | None = None,
    token_arrays: bool = True,
    paged_kv: bool = False,
) -> list[StagedCommon]:
    """Derive one common metadata per micro-batch of ``spec`` on the host, all staged in ``step``.

    Micro-batch ``k`` is :func:`ubatch_specs`' ``k``-th spec staged by :func:`attnmeta.stage_common`
    under ``f"{prefix}_ub{k}"``: no device arithmetic, and every micro-batch moves in the step's one
    copy. Each result is a :class:`StagedCommon` any registered builder stages on (in the same step).

    Fields: ``query_start_loc``, ``seq_lens``, ``block_table_tensor``, ``slot_mapping``,
    ``positions`` and their twins equal vLLM's ``split_attn_metadata`` (the parent's slices, with a
    split request's first part and continuation as in :func:`ubatch_specs`); the block table has the
    parent's width. Scalars: ``max_seq_len`` is the PARENT's ``spec.max_seq_len`` (vLLM's quirk: an
    upper bound of the micro-batch's); ``max_query_len`` the micro-batch's own (the parent's if 0);
    ``num_reqs`` / ``num_actual_tokens`` the slice's rows and tokens; ``num_real_reqs`` /
    ``num_real_tokens`` its real ones. ``is_prefilling``, ``num_computed_tokens_cpu``,
    ``num_decode_draft_tokens_cpu`` and ``causal``, which vLLM drops, are the micro-batch's own.
    ``.prefix`` is None (the metadata is derived from a transformed batch).

    Parameters
    ----------
    spec : BatchSpec
        The parent step.
    step : Step
        An open step; everything moves in its one copy.
    slices : sequence of UBatchSlice
        The micro-batches (:func:`ubatch_slices`).
    prefix : str, default "common"
        Micro-batch ``k``'s fields are staged under ``f"{prefix}_ub{k}"``.
    causal : bool, default True
        Stored as ``causal`` in each.
    block_table_columns : int, optional
        Columns of each block table. Default: eager mode, the parent's (the most blocks any request of
        ``spec`` uses, at least 1); graph mode, the profile's.
    token_arrays : bool, default True
        As :func:`attnmeta.stage_common`.
    paged_kv : bool, default False
        As :func:`attnmeta.stage_common` (each micro-batch's own page table).

    Returns
    -------
    list of StagedCommon
        One per slice: ``.host`` now, ``.result()`` (:class:`CommonAttentionMetadata`, device views of
        the step's arena) after the commit.

    Raises
    ------
    TypeError, ValueError
        As :func:`ubatch_specs` and :func:`attnmeta.stage_common`.
    attnmeta.staging.CapacityError
        As :func:`attnmeta.stage_common`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[7, 0, 21, 6], num_scheduled_tokens=[5, 3, 9, 1],
    ...                  block_table=np.arange(32, dtype=np.int32).reshape(4, 8), block_size=4,
    ...                  num_reqs_padded=6, num_tokens_padded=20)
    >>> plan = ubatch_slices(spec.num_scheduled_tokens, 20, 6, 2)
    >>> stager = Stager("cpu")
    >>> with stager.step() as step:
    ...     ubs = stage_ubatches(spec, step, plan.padded_slices)
    >>> [u.result().seq_lens_cpu.tolist() for u in ubs], stager.stats.copies  # (host twins)
    ([[12, 3, 23], [30, 7, 0, 0]], 1)
    >>> ubs[1].result().query_start_loc_cpu.tolist(), ubs[1].result().max_seq_len  # (host twins)
    ([0, 7, 8, 8, 8], 30)
    """
    specs = ubatch_specs(spec, slices)
    if block_table_columns is None and step.profile is None:
        cp = spec.context_parallel
        span = spec.block_size * (1 if cp is None else cp.world_size)
        block_table_columns = max(1, -(-spec.max_exact_seq_len // span))
    parent_max_seq, parent_max_q = spec.max_seq_len, spec.max_query_len
    out = []
    for k, sub in enumerate(specs):
        staged = stage_common(sub, step, prefix=f"{prefix}_ub{k}", causal=causal,
                              block_table_columns=block_table_columns, token_arrays=token_arrays, paged_kv=paged_kv)
        max_q = sub.max_query_len or parent_max_q
        host = dataclasses.replace(staged.host, max_seq_len=parent_max_seq, max_query_len=max_q)
        out.append(StagedCommon(step, host, _Quirks(staged, parent_max_seq, max_q), paged=staged.paged))
    return out


class _Quirks:
    """The metadata of one micro-batch with vLLM's scalars (parent ``max_seq_len``)."""

    __slots__ = ("max_q", "max_seq", "staged")

    def __init__(self, staged: StagedCommon, max_seq: int, max_q: int) -> None:
        self.staged, self.max_seq, self.max_q = staged, max_seq, max_q

    def __call__(self) -> CommonAttentionMetadata:
        return self.staged.result().replace(max_seq_len=self.max_seq, max_query_len=self.max_q)
