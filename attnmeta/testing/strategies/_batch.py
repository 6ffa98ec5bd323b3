"""Hypothesis strategies (_batch): valid :class:`~attnmeta.spec.BatchSpec` steps. Requires hypothesis.

Every batch is valid by construction: a list of per-request records is drawn (its length is the
number of requests) and every array is derived from it, so nothing is filtered. Sizes stay small by
default so property tests run fast; every limit is a knob.

Request kinds (``kinds=``):

- ``"decode"``: context ``c >= 1``, one scheduled token, prompt done (``P <= c``).
- ``"spec_decode"``: like decode with ``d >= 1`` draft tokens, ``q = 1 + d``.
- ``"prefill"``: first chunk, ``c == 0``; ``P >= q``.
- ``"chunked_prefill"``: a later prompt chunk; ``c >= 1`` is not aligned to anything and ``P >= c + q``
  (``q <= decode_threshold`` makes it a short extend).
- ``"empty"``: a zero-length row (``q == 0``) with any context and prompt.
- ``"long_prefill"``: a prefill of ``max_query_len`` to ``max_long_prefill_len`` tokens, maybe with
  context (opt in with ``long_prefills=True`` or by naming it).

Shape legend
------------
- ``num_reqs``: real requests of the drawn batch; ``num_reqs_padded`` with CUDA-graph padding rows.
- ``num_tokens`` / ``num_tokens_padded``: real tokens / with padding tokens.
- ``max_blocks_per_req``: block-table width, at least what the longest sequence needs (its optimistic
  upper bound, when one is drawn: the engine allocated those blocks).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from attnmeta._checks import INT32_MAX
from attnmeta.spec import BatchSpec, ContextParallel

__all__ = ["DEFAULT_KINDS", "REQUEST_KINDS", "batch_specs", "query_start_locs"]

REQUEST_KINDS = ("decode", "spec_decode", "prefill", "chunked_prefill", "empty", "long_prefill")
"""Every request kind :func:`batch_specs` knows."""

DEFAULT_KINDS = ("decode", "spec_decode", "prefill", "chunked_prefill", "empty")
"""The kinds drawn by default (everything but the opt-in ``"long_prefill"``)."""


class _Row(NamedTuple):
    computed: int
    scheduled: int
    prompt: int
    drafts: int
    optimism: int  # extra tokens of the optimistic upper bound (async spec decode)


_BLOCK_SIZES = st.sampled_from([1, 4, 6, 16])  # 6: kernels divide by other sizes (no shift)
_FLAGS = st.booleans()
_NEVER = st.just(False)
_EXTRA_COLUMNS = st.integers(0, 3)
_CP_WORLD_SIZES = st.sampled_from([1, 2, 4])
_QUERY_LENS = st.integers(0, 64)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidArgument(message)


def _row_strategy(
    kind: str, *, max_query_len: int, max_context_len: int, max_draft_tokens: int, max_long_prefill_len: int
) -> SearchStrategy[_Row]:
    """Strategy for one request record of ``kind`` (built once; dependent values are derived, not drawn)."""
    context = st.integers(1, max_context_len)
    slack = st.integers(0, max_context_len)  # prompt tokens beyond this chunk, or a done prompt's distance
    optimism = st.integers(0, max_draft_tokens)

    if kind == "decode":
        return st.tuples(context, slack, optimism).map(lambda t: _Row(t[0], 1, max(1, t[0] - t[1]), 0, t[2]))
    if kind == "spec_decode":
        drafts = st.integers(1, min(max_draft_tokens, max_query_len - 1))
        return st.tuples(context, drafts, slack, optimism).map(
            lambda t: _Row(t[0], 1 + t[1], max(1, t[0] - t[2]), t[1], t[3])
        )
    if kind == "prefill":
        return st.tuples(st.integers(1, max_query_len), slack).map(lambda t: _Row(0, t[0], t[0] + t[1], 0, 0))
    if kind == "chunked_prefill":
        return st.tuples(context, st.integers(1, max_query_len), slack).map(
            lambda t: _Row(t[0], t[1], t[0] + t[1] + t[2], 0, 0)
        )
    if kind == "empty":
        return st.tuples(st.integers(0, max_context_len), st.integers(0, max_context_len)).map(
            lambda t: _Row(t[0], 0, t[1], 0, 0)
        )
    # long_prefill
    return st.tuples(st.integers(0, max_context_len), st.integers(max_query_len, max_long_prefill_len), slack).map(
        lambda t: _Row(t[0], t[1], t[0] + t[1] + t[2], 0, 0)
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_specs(
    *,
    min_reqs: int = 0,
    max_reqs: int = 16,
    max_query_len: int = 64,
    max_context_len: int = 512,
    block_sizes: SearchStrategy[int] = _BLOCK_SIZES,
    kinds: Collection[str] = DEFAULT_KINDS,
    max_draft_tokens: int = 4,
    with_prompts: SearchStrategy[bool] = _FLAGS,
    with_upper_bound: SearchStrategy[bool] = _FLAGS,
    with_padding: SearchStrategy[bool] = _FLAGS,
    max_padding_reqs: int = 4,
    max_padding_tokens: int = 16,
    extra_block_columns: SearchStrategy[int] = _EXTRA_COLUMNS,
    max_block_id: int = 100_000,
    with_context_parallel: SearchStrategy[bool] = _NEVER,
    cp_world_sizes: SearchStrategy[int] = _CP_WORLD_SIZES,
    long_prefills: bool = False,
    max_long_prefill_len: int = 4096,
) -> SearchStrategy[BatchSpec]:
    """Valid :class:`~attnmeta.spec.BatchSpec` steps. Requires hypothesis.

    Each batch first draws a non-empty subset of ``kinds`` (so decode-only, prefill-only and mixed
    batches all come up often), then one request record per row from that subset, then derives every
    array from the records.

    Parameters
    ----------
    min_reqs, max_reqs : int
        Bounds on the number of real requests (0 is allowed: an empty step).
    max_query_len : int
        Largest query of the ordinary kinds (spec decode: ``1 + drafts <= max_query_len``).
    max_context_len : int
        Largest context (``num_computed_tokens``) and largest extra prompt beyond a chunk.
    block_sizes : SearchStrategy[int]
        KV block sizes to draw from (default 1, 4, 6 and 16: powers of two, which the kernels divide
        by with a shift, and one that they divide by with a division).
    kinds : collection of str
        Allowed request kinds (module docstring); e.g. ``["decode"]`` for decode-only batches,
        ``["prefill", "chunked_prefill"]`` for prefill-only ones.
    max_draft_tokens : int
        Most draft tokens of a ``"spec_decode"`` row; also the most a decode row's optimistic upper
        bound exceeds its sequence length.
    with_prompts : SearchStrategy[bool]
        Whether ``num_prompt_tokens`` is given (otherwise no row is prefilling).
    with_upper_bound : SearchStrategy[bool]
        Whether ``seq_lens_upper_bound`` is given; decode rows may then be optimistic by up to
        ``max_draft_tokens``, prefill rows are exact.
    with_padding : SearchStrategy[bool]
        Whether the batch has CUDA-graph padding (``num_reqs_padded`` / ``num_tokens_padded``).
    max_padding_reqs, max_padding_tokens : int
        Most padding rows / tokens added when padded (0 is drawn too).
    extra_block_columns : SearchStrategy[int]
        Block-table columns beyond what the longest sequence needs (wide tables). Unused entries hold
        0 or -1; padding rows hold 0 (``NULL_BLOCK_ID``).
    max_block_id : int
        Block ids are drawn from ``[0, max_block_id]``.
    with_context_parallel : SearchStrategy[bool]
        Whether to attach a :class:`~attnmeta.spec.ContextParallel` layout (rank and interleave drawn;
        the interleave divides the block size).
    cp_world_sizes : SearchStrategy[int]
        Context-parallel world sizes to draw from (1 is the plain layout).
    long_prefills : bool
        Opt in to ``"long_prefill"`` rows of up to ``max_long_prefill_len`` tokens.
    max_long_prefill_len : int
        Longest long prefill.

    Returns
    -------
    SearchStrategy[BatchSpec]
        Valid batches; ``num_draft_tokens`` is given whenever the batch may hold spec-decode rows.

    Raises
    ------
    hypothesis.errors.InvalidArgument
        At draw time, for impossible settings (negative or inverted bounds, unknown or no kinds, spec
        decode without room for a draft, a long prefill shorter than ``max_query_len``).

    Examples
    --------
    >>> from hypothesis import HealthCheck, given, settings
    >>> @given(batch_specs(kinds=["decode"], max_reqs=4))
    ... @settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
    ... def test_decodes(spec):
    ...     assert (spec.num_scheduled_tokens == 1).all()
    >>> test_decodes()
    """

    def build() -> SearchStrategy[BatchSpec]:
        _check(not isinstance(kinds, str),
               f"kinds: expected a collection of request kinds (e.g. [{kinds!r}]), got the str {kinds!r}")
        for name, value, of in (("block_sizes", block_sizes, "int"), ("with_prompts", with_prompts, "bool"),
                                ("with_upper_bound", with_upper_bound, "bool"), ("with_padding", with_padding, "bool"),
                                ("extra_block_columns", extra_block_columns, "int"),
                                ("with_context_parallel", with_context_parallel, "bool"),
                                ("cp_world_sizes", cp_world_sizes, "int")):
            _check(isinstance(value, SearchStrategy),
                   f"{name}: expected a hypothesis strategy of {of} (e.g. "
                   + (f"st.sampled_from({value!r:.40}) to draw from those values"
                      if isinstance(value, list | tuple | set | frozenset | range)
                      else f"st.just({value!r:.40}) for that value every time")
                   + f"), got {type(value).__name__} {value!r:.40}")
        allowed = set(kinds)
        if long_prefills:
            allowed.add("long_prefill")
        _validate(
            allowed,
            min_reqs=min_reqs,
            max_reqs=max_reqs,
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            max_draft_tokens=max_draft_tokens,
            max_padding_reqs=max_padding_reqs,
            max_padding_tokens=max_padding_tokens,
            max_block_id=max_block_id,
            max_long_prefill_len=max_long_prefill_len,
        )
        rows_of = {
            kind: _row_strategy(
                kind,
                max_query_len=max_query_len,
                max_context_len=max_context_len,
                max_draft_tokens=max_draft_tokens,
                max_long_prefill_len=max_long_prefill_len,
            )
            for kind in allowed
        }
        subsets = st.lists(st.sampled_from(sorted(allowed)), min_size=1, unique=True).map(tuple)
        kind_lists: dict[tuple[str, ...], SearchStrategy[list[str]]] = {}
        pad_reqs = st.integers(0, max_padding_reqs)
        pad_tokens = st.integers(0, max_padding_tokens)
        seeds = st.integers(0, 2**32 - 1)
        fillers = st.sampled_from([0, -1])

        @st.composite
        def draw_batch(draw: st.DrawFn) -> BatchSpec:
            subset = draw(subsets)
            if subset not in kind_lists:
                kind_lists[subset] = st.lists(st.sampled_from(subset), min_size=min_reqs, max_size=max_reqs)
            rows = [draw(rows_of[kind]) for kind in draw(kind_lists[subset])]
            n = len(rows)
            c = np.array([r.computed for r in rows], dtype=np.int32)
            q = np.array([r.scheduled for r in rows], dtype=np.int32)
            seq = c.astype(np.int64) + q
            num_tokens = int(q.sum())

            num_reqs_padded = num_tokens_padded = None
            if draw(with_padding):
                num_reqs_padded = n + draw(pad_reqs)
                num_tokens_padded = num_tokens + draw(pad_tokens)
            total_rows = n if num_reqs_padded is None else num_reqs_padded

            upper = None
            if draw(with_upper_bound):
                upper = (seq + np.array([r.optimism for r in rows], dtype=np.int64)).astype(np.int32)

            bs = draw(block_sizes)
            _check(isinstance(bs, int) and bs >= 1, f"block_sizes drew {bs!r}; block sizes must be positive ints")
            # An engine has allocated blocks for every token it scheduled, the optimistic ones included:
            # the real block ids cover the upper bound; columns past it hold the filler.
            need = ((seq if upper is None else np.maximum(seq, upper)) + bs - 1) // bs
            width = max(1, int(need.max()) if n else 0) + draw(extra_block_columns)
            rng = np.random.default_rng(draw(seeds))
            table = rng.integers(0, max_block_id, size=(total_rows, width), endpoint=True, dtype=np.int32)
            table[n:] = 0
            table[:n][np.arange(width)[None, :] >= need[:, None]] = draw(fillers)

            cp = None
            if draw(with_context_parallel):
                world = draw(cp_world_sizes)
                _check(isinstance(world, int) and world >= 1, f"cp_world_sizes drew {world!r}; must be ints >= 1")
                cp = ContextParallel(world, draw(st.integers(0, world - 1)), draw(st.sampled_from(_divisors(bs))))

            return BatchSpec(
                num_computed_tokens=c,
                num_scheduled_tokens=q,
                block_table=table,
                block_size=bs,
                num_prompt_tokens=np.array([r.prompt for r in rows], dtype=np.int32) if draw(with_prompts) else None,
                num_draft_tokens=(
                    np.array([r.drafts for r in rows], dtype=np.int32) if "spec_decode" in subset else None
                ),
                seq_lens_upper_bound=upper,
                num_reqs_padded=num_reqs_padded,
                num_tokens_padded=num_tokens_padded,
                context_parallel=cp,
            )

        return draw_batch()

    # Deferred: the settings are checked (InvalidArgument) and the strategies built once, when first drawn.
    return st.deferred(build)


def _validate(
    allowed: set[str],
    *,
    min_reqs: int,
    max_reqs: int,
    max_query_len: int,
    max_context_len: int,
    max_draft_tokens: int,
    max_padding_reqs: int,
    max_padding_tokens: int,
    max_block_id: int,
    max_long_prefill_len: int,
) -> None:
    for name, value in (("min_reqs", min_reqs), ("max_reqs", max_reqs), ("max_query_len", max_query_len),
                        ("max_context_len", max_context_len), ("max_draft_tokens", max_draft_tokens),
                        ("max_padding_reqs", max_padding_reqs), ("max_padding_tokens", max_padding_tokens),
                        ("max_block_id", max_block_id), ("max_long_prefill_len", max_long_prefill_len)):
        _check(isinstance(value, int | np.integer) and not isinstance(value, bool),
               f"{name}: expected an int, got {type(value).__name__} {value!r:.40}")
    unknown = allowed.difference(REQUEST_KINDS)
    _check(not unknown, f"kinds: unknown request kinds {sorted(unknown)}; known: {list(REQUEST_KINDS)}")
    _check(bool(allowed), "kinds: need at least one request kind")
    _check(0 <= min_reqs <= max_reqs, f"need 0 <= min_reqs <= max_reqs, got min_reqs={min_reqs}, max_reqs={max_reqs}")
    _check(max_query_len >= 1, f"max_query_len={max_query_len}: must be >= 1")
    _check(max_context_len >= 1, f"max_context_len={max_context_len}: must be >= 1")
    _check(max_draft_tokens >= 0, f"max_draft_tokens={max_draft_tokens}: must be >= 0")
    _check(
        "spec_decode" not in allowed or (max_draft_tokens >= 1 and max_query_len >= 2),
        f"kinds: 'spec_decode' needs max_draft_tokens >= 1 and max_query_len >= 2, got "
        f"{max_draft_tokens} and {max_query_len}",
    )
    _check(
        "long_prefill" not in allowed or max_long_prefill_len >= max_query_len,
        f"max_long_prefill_len={max_long_prefill_len} < max_query_len={max_query_len}",
    )
    _check(min(max_padding_reqs, max_padding_tokens, max_block_id) >= 0, "padding bounds and max_block_id must be >= 0")
    longest = max(max_query_len, max_long_prefill_len if "long_prefill" in allowed else 0)
    _check(
        max_reqs * (2 * max_context_len + longest + max_draft_tokens) + max_padding_tokens <= INT32_MAX,
        "sizes too large: sequence lengths or token totals could overflow int32",
    )


def query_start_locs(
    *,
    min_reqs: int = 0,
    max_reqs: int = 16,
    query_lens: SearchStrategy[int] = _QUERY_LENS,
) -> SearchStrategy[np.ndarray]:
    """``query_start_loc`` arrays: (num_reqs + 1,) int32, host, ``[0, cumsum(q)...]``. Requires hypothesis.

    Parameters
    ----------
    min_reqs, max_reqs : int
        Bounds on the number of rows.
    query_lens : SearchStrategy[int]
        Query length of each row (must draw ints >= 0).

    Returns
    -------
    SearchStrategy[numpy.ndarray]
        Non-decreasing int32 arrays starting at 0.

    Raises
    ------
    hypothesis.errors.InvalidArgument
        At draw time, for inverted or negative bounds or a negative query length.

    Examples
    --------
    >>> from hypothesis import given
    >>> @given(query_start_locs(max_reqs=4))
    ... def test_starts_at_zero(qsl):
    ...     assert qsl[0] == 0 and (qsl[1:] >= qsl[:-1]).all()
    >>> test_starts_at_zero()
    """

    def build(lens: list[int]) -> np.ndarray:
        _check(all(v >= 0 for v in lens), f"query_lens drew a negative length: {lens}")
        out = np.zeros(len(lens) + 1, dtype=np.int32)
        out[1:] = np.cumsum(np.asarray(lens, dtype=np.int64))
        return out

    @st.composite
    def draw_qsl(draw: st.DrawFn) -> np.ndarray:
        _check(0 <= min_reqs <= max_reqs, f"need 0 <= min_reqs <= max_reqs, got {min_reqs}, {max_reqs}")
        return build(draw(st.lists(query_lens, min_size=min_reqs, max_size=max_reqs)))

    return draw_qsl()
