"""Hypothesis strategies (_mamba): valid inputs for the Mamba-family host derivations. Requires hypothesis.

Everything is valid by construction: per-row records are drawn as a list (its length is the number
of rows) and every array is derived from them; nothing is filtered. Knobs users want to vary take
strategies.

- :func:`mamba2_chunk_layouts`: inputs of :func:`attnmeta.host.chunks.chunk_metadata` (the workloads
  of vLLM's own ``_compute_chunk_metadata`` test, plus zero-token rows and checkpoints).
- :func:`mamba_state_index_cases`: inputs of :func:`attnmeta.host.mamba.mamba_state_indices`.
- :func:`mamba_classification_cases`: inputs of :func:`attnmeta.host.mamba.classify_mamba_rows`.
- :func:`prefill_checkpoint_cases`: inputs of :func:`attnmeta.host.mamba.prefill_checkpoints`.

Shape legend
------------
- ``num_prefills`` (``P``): prefill rows drawn.
- ``num_reqs`` (``B``): request rows drawn.
- ``max_blocks_per_req`` (``W``): block-table width, at least what every row reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from attnmeta.host.mamba import CheckpointConfig

__all__ = [
    "ALIGNMENT_MODES",
    "Mamba2ChunkLayout",
    "MambaClassificationCase",
    "MambaStateIndexCase",
    "PrefillCheckpointCase",
    "mamba2_chunk_layouts",
    "mamba_classification_cases",
    "mamba_state_index_cases",
    "prefill_checkpoint_cases",
]

ALIGNMENT_MODES = ("aligned", "unaligned", "random")
"""How :func:`mamba2_chunk_layouts` draws context lengths: multiples of the chunk size, a multiple
plus 1..C-1, or uniform in ``[0, 4C]`` (the modes of vLLM's chunk-metadata test)."""


class Mamba2ChunkLayout(NamedTuple):
    """One drawn input of :func:`attnmeta.host.chunks.chunk_metadata` (unpacks positionally)."""

    chunk_size: int
    """Mamba2 chunk size ``C``."""
    num_computed_p: np.ndarray
    """(num_prefills,) int32, host. Tokens already in each row's state."""
    query_start_loc_p: np.ndarray
    """(num_prefills + 1,) int32, host. ``[0, cumsum(n)...]``; zero-token rows allowed."""
    checkpoint_offsets: np.ndarray | None
    """(num_prefills,) int32, host, or None. ``0 <= k <= n`` (0: no checkpoint)."""


class MambaStateIndexCase(NamedTuple):
    """One drawn input of :func:`attnmeta.host.mamba.mamba_state_indices`."""

    block_table: np.ndarray
    """(num_reqs + extra_rows, max_blocks_per_req) int32, host; block ids >= 0."""
    seq_lens: np.ndarray
    """(num_reqs,) int32, host; 0 for padding rows."""
    mamba_block_size: int
    """Mamba block size."""
    mode: str
    """``"none"`` or ``"align"``."""
    num_state_columns: int
    """``1 + num_speculative_blocks``."""


class MambaClassificationCase(NamedTuple):
    """One drawn input of :func:`attnmeta.host.mamba.classify_mamba_rows`."""

    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host."""
    seq_lens_upper_bound: np.ndarray
    """(num_reqs,) int32, host; ``>= q`` per row."""
    is_prefilling: np.ndarray
    """(num_reqs,) bool, host."""
    num_decode_draft_tokens: np.ndarray | None
    """(num_reqs,) int32, host (``-1`` where not a draft-decode row), or None."""


class PrefillCheckpointCase(NamedTuple):
    """One drawn input of :func:`attnmeta.host.mamba.prefill_checkpoints`."""

    seq_lens_upper_bound_p: np.ndarray
    """(num_prefills,) int32, host; ``>= query_lens_p``."""
    query_lens_p: np.ndarray
    """(num_prefills,) int32, host."""
    block_table_p: np.ndarray
    """(num_prefills, max_blocks_per_req) int32, host; wide enough for every checkpoint column."""
    config: CheckpointConfig
    """The drawn configuration."""


_CHUNK_SIZES = st.sampled_from([8, 64, 256, 2048])
_MODES = st.sampled_from(ALIGNMENT_MODES)
_FLAGS = st.booleans()
_SEEDS = st.integers(0, 2**32 - 1)
_STATE_MODES = st.sampled_from(["none", "align"])
_MAMBA_BLOCK_SIZES = st.sampled_from([1, 4, 16])
_HASH_BLOCK_SIZES = st.sampled_from([1, 2, 4, 16])
_RAW = st.integers(0, 2**30)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidArgument(message)


def _int32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).astype(np.int32)


def _qsl(lens: list[int]) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    out[1:] = np.cumsum(np.asarray(lens, dtype=np.int64))
    return out.astype(np.int32)


def mamba2_chunk_layouts(
    *,
    chunk_sizes: SearchStrategy[int] = _CHUNK_SIZES,
    min_prefills: int = 0,
    max_prefills: int = 128,
    alignment: SearchStrategy[str] = _MODES,
    tiny: SearchStrategy[bool] = _FLAGS,
    with_checkpoints: SearchStrategy[bool] = _FLAGS,
    max_new_tokens: int | None = None,
    zero_token_rows: bool = True,
) -> SearchStrategy[Mamba2ChunkLayout]:
    """Inputs of :func:`~attnmeta.host.chunks.chunk_metadata`. Requires hypothesis.

    Per batch a chunk size ``C``, an alignment mode, whether the batch is "tiny" (at most 3 new
    tokens per row, so new tokens often do not even fill the realigning chunk) and whether it has
    checkpoints are drawn; then a list of rows. Context lengths follow the mode
    (:data:`ALIGNMENT_MODES`: ``m * C`` with ``m <= 8``; ``m * C + r`` with ``1 <= r < C``; uniform in
    ``[0, 4C]``). New tokens are uniform in ``[0, 6C]`` (``[1, ...]`` without ``zero_token_rows``).
    With checkpoints, each row's offset is 0 or in ``[1, n]``.

    Parameters
    ----------
    chunk_sizes : SearchStrategy[int]
        Chunk sizes (default ``{8, 64, 256, 2048}``, vLLM's test grid). With ``C == 1`` every context
        is aligned, whatever the mode.
    min_prefills, max_prefills : int
        Bounds on the number of prefill rows.
    alignment : SearchStrategy[str]
        Modes from :data:`ALIGNMENT_MODES`.
    tiny : SearchStrategy[bool]
        Whether the batch uses at most 3 new tokens per row.
    with_checkpoints : SearchStrategy[bool]
        Whether ``checkpoint_offsets`` is an array (else None).
    max_new_tokens : int, optional
        Upper bound on new tokens per row, overriding ``6 * C`` (and ``tiny``).
    zero_token_rows : bool, default True
        Whether rows with no new tokens are drawn.

    Returns
    -------
    SearchStrategy[Mamba2ChunkLayout]
        ``(chunk_size, num_computed_p, query_start_loc_p, checkpoint_offsets)``.

    Raises
    ------
    hypothesis.errors.InvalidArgument
        At draw time: inverted or negative bounds, an unknown mode, a chunk size < 1,
        ``max_new_tokens < 1``.

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> from attnmeta.host.chunks import chunk_metadata
    >>> @settings(max_examples=5)
    ... @given(mamba2_chunk_layouts(max_prefills=4))
    ... def test_ends_at_total(layout):
    ...     assert chunk_metadata(*layout).cu_chunk_seqlens[-1] == layout.query_start_loc_p[-1]
    >>> test_ends_at_total()
    """

    @st.composite
    def build(draw: Any) -> Mamba2ChunkLayout:
        _check(
            0 <= min_prefills <= max_prefills,
            f"need 0 <= min_prefills <= max_prefills, got {min_prefills}, {max_prefills}",
        )
        _check(
            max_new_tokens is None or max_new_tokens >= 1,
            f"max_new_tokens must be >= 1, got {max_new_tokens}",
        )
        cs = draw(chunk_sizes)
        _check(isinstance(cs, int) and cs >= 1, f"chunk_sizes drew {cs!r}; chunk sizes must be ints >= 1")
        mode = draw(alignment)
        _check(mode in ALIGNMENT_MODES, f"alignment drew {mode!r}; expected one of {ALIGNMENT_MODES}")
        is_tiny = draw(tiny)
        ckpt = draw(with_checkpoints)
        default_hi = 3 if is_tiny else 6 * cs
        hi = default_hi if max_new_tokens is None else max_new_tokens
        lo = 0 if zero_token_rows else 1
        if mode == "aligned" or cs == 1:  # with C == 1 every context is aligned
            computed = st.integers(0, 8).map(lambda m: m * cs)
        elif mode == "unaligned":
            computed = st.tuples(st.integers(0, 8), st.integers(1, cs - 1)).map(lambda t: t[0] * cs + t[1])
        else:
            computed = st.integers(0, 4 * cs)
        rows = draw(
            st.lists(
                st.tuples(computed, st.integers(lo, hi), _RAW if ckpt else st.just(0)),
                min_size=min_prefills,
                max_size=max_prefills,
            )
        )
        lens = [n for _, n, _ in rows]
        offsets = None
        if ckpt:
            # raw 0 -> no checkpoint; otherwise an offset in [1, n] (valid by construction)
            offsets = _int32([0 if raw == 0 or n == 0 else 1 + (raw - 1) % n for _, n, raw in rows])
        return Mamba2ChunkLayout(cs, _int32([c for c, _, _ in rows]), _qsl(lens), offsets)

    return build()


def mamba_state_index_cases(
    *,
    modes: SearchStrategy[str] = _STATE_MODES,
    min_reqs: int = 0,
    max_reqs: int = 16,
    block_sizes: SearchStrategy[int] = _MAMBA_BLOCK_SIZES,
    max_state_columns: int = 3,
    max_seq_len: int = 200,
) -> SearchStrategy[MambaStateIndexCase]:
    """Inputs of :func:`~attnmeta.host.mamba.mamba_state_indices`. Requires hypothesis.

    Rows have ``seq_lens`` in ``[0, max_seq_len]`` (0 is a padding row); the block table is as wide as
    the widest row needs plus up to 3 spare columns, has up to 2 spare rows, and holds random
    block ids in ``[0, 10_000)``.

    Parameters
    ----------
    modes : SearchStrategy[str]
        ``"none"`` / ``"align"``.
    min_reqs, max_reqs : int
        Bounds on the number of rows.
    block_sizes : SearchStrategy[int]
        Mamba block sizes (>= 1).
    max_state_columns : int
        Upper bound on ``num_state_columns`` (>= 1).
    max_seq_len : int
        Upper bound on ``seq_lens``.

    Returns
    -------
    SearchStrategy[MambaStateIndexCase]

    Raises
    ------
    hypothesis.errors.InvalidArgument
        At draw time, for inverted bounds, a block size < 1 or an unknown mode.

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5)
    ... @given(mamba_state_index_cases(max_reqs=3))
    ... def test_shape(case):
    ...     assert case.block_table.shape[0] >= case.seq_lens.shape[0]
    >>> test_shape()
    """

    @st.composite
    def build(draw: Any) -> MambaStateIndexCase:
        _check(0 <= min_reqs <= max_reqs, f"need 0 <= min_reqs <= max_reqs, got {min_reqs}, {max_reqs}")
        _check(max_state_columns >= 1, f"max_state_columns must be >= 1, got {max_state_columns}")
        mode = draw(modes)
        _check(mode in ("none", "align"), f"modes drew {mode!r}")
        bs = draw(block_sizes)
        _check(isinstance(bs, int) and bs >= 1, f"block_sizes drew {bs!r}")
        ncols = draw(st.integers(1, max_state_columns))
        seq = draw(st.lists(st.integers(0, max_seq_len), min_size=min_reqs, max_size=max_reqs))
        starts = [max((s - 1) // bs, 0) if mode == "align" else 0 for s in seq]
        width = max(starts, default=0) + ncols + draw(st.integers(0, 3))
        rows = len(seq) + draw(st.integers(0, 2))
        rng = np.random.default_rng(draw(_SEEDS))
        table = rng.integers(0, 10_000, size=(rows, width)).astype(np.int32)
        return MambaStateIndexCase(table, _int32(seq), bs, mode, ncols)

    return build()


def mamba_classification_cases(
    *,
    min_reqs: int = 0,
    max_reqs: int = 32,
    max_query_len: int = 6,
    with_drafts: SearchStrategy[bool] = _FLAGS,
) -> SearchStrategy[MambaClassificationCase]:
    """Inputs of :func:`~attnmeta.host.mamba.classify_mamba_rows`. Requires hypothesis.

    Each row draws ``q`` in ``[0, max_query_len]``, prior state ``ub - q`` in ``[0, 8]``, an
    ``is_prefilling`` flag and (with drafts) a draft count that is ``q - 1`` (a draft-padded tail),
    ``-1`` or anything in ``[0, 3]``.

    Parameters
    ----------
    min_reqs, max_reqs : int
        Bounds on the number of rows.
    max_query_len : int
        Upper bound on query lengths (>= 0).
    with_drafts : SearchStrategy[bool]
        Whether ``num_decode_draft_tokens`` is an array (else None).

    Returns
    -------
    SearchStrategy[MambaClassificationCase]

    Raises
    ------
    hypothesis.errors.InvalidArgument
        At draw time, for inverted or negative bounds.

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5)
    ... @given(mamba_classification_cases(max_reqs=3))
    ... def test_lengths(case):
    ...     assert case.query_start_loc_cpu.shape[0] == case.is_prefilling.shape[0] + 1
    >>> test_lengths()
    """

    @st.composite
    def build(draw: Any) -> MambaClassificationCase:
        _check(0 <= min_reqs <= max_reqs, f"need 0 <= min_reqs <= max_reqs, got {min_reqs}, {max_reqs}")
        _check(max_query_len >= 0, f"max_query_len must be >= 0, got {max_query_len}")
        drafts_on = draw(with_drafts)
        rows = draw(
            st.lists(
                st.tuples(
                    st.integers(0, max_query_len),
                    st.integers(0, 8),
                    st.booleans(),
                    st.one_of(st.just(-2), st.integers(-1, 3)),
                ),
                min_size=min_reqs,
                max_size=max_reqs,
            )
        )
        q = [r[0] for r in rows]
        ub = _int32([r[0] + r[1] for r in rows])
        isp = np.asarray([r[2] for r in rows], dtype=np.bool_)
        drafts = None
        if drafts_on:
            # -2 is the marker for "a draft-padded tail": drafts = q - 1 (-1 when q == 0)
            drafts = _int32([qq - 1 if d == -2 else d for qq, (_, _, _, d) in zip(q, rows)])
        return MambaClassificationCase(_qsl(q), ub, isp, drafts)

    return build()


def prefill_checkpoint_cases(
    *,
    min_prefills: int = 0,
    max_prefills: int = 16,
    hash_block_sizes: SearchStrategy[int] = _HASH_BLOCK_SIZES,
) -> SearchStrategy[PrefillCheckpointCase]:
    """Inputs of :func:`~attnmeta.host.mamba.prefill_checkpoints`. Requires hypothesis.

    The configuration uses a hash block ``hb``, a hit alignment ``H`` in ``{hb, 2hb}``, a mamba block
    size in ``{hb, 2hb, 4hb}``, an alignment in ``{None, 1, hb, H}``, a lookahead in ``[0, 3]`` and a
    random EAGLE drop flag. Rows start their query at a multiple of ``hb`` most of the time (so many
    checkpoints are valid) and schedule up to ``8 * bs_m`` tokens; the block table is wide enough for
    every checkpoint column.

    Parameters
    ----------
    min_prefills, max_prefills : int
        Bounds on the number of prefill rows.
    hash_block_sizes : SearchStrategy[int]
        Hash block sizes (>= 1).

    Returns
    -------
    SearchStrategy[PrefillCheckpointCase]

    Raises
    ------
    hypothesis.errors.InvalidArgument
        At draw time, for inverted bounds or a hash block size < 1.

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5)
    ... @given(prefill_checkpoint_cases(max_prefills=3))
    ... def test_query_fits(case):
    ...     assert (case.seq_lens_upper_bound_p >= case.query_lens_p).all()
    >>> test_query_fits()
    """

    @st.composite
    def build(draw: Any) -> PrefillCheckpointCase:
        _check(
            0 <= min_prefills <= max_prefills,
            f"need 0 <= min_prefills <= max_prefills, got {min_prefills}, {max_prefills}",
        )
        hb = draw(hash_block_sizes)
        _check(isinstance(hb, int) and hb >= 1, f"hash_block_sizes drew {hb!r}")
        hit = hb * draw(st.sampled_from([1, 2]))
        bs = hb * draw(st.sampled_from([1, 2, 4]))
        align = draw(st.sampled_from([None, 1, hb, hit]))
        config = CheckpointConfig(
            hash_block_size=hb,
            cache_hit_alignment_tokens=hit,
            mamba_block_size=bs,
            checkpoint_alignment=align,
            num_hash_lookahead_tokens=draw(st.integers(0, 3)),
            drop_eagle_block=draw(st.booleans()),
        )
        rows = draw(
            st.lists(
                st.tuples(st.integers(0, 6), st.integers(0, hb - 1), st.booleans(), st.integers(0, 8 * bs)),
                min_size=min_prefills,
                max_size=max_prefills,
            )
        )
        # query start: a multiple of hb, or (flag) shifted off the hash grid
        starts = [m * hb + (r if off else 0) for m, r, off, _ in rows]
        q = [n for _, _, _, n in rows]
        seq = [s + n for s, n in zip(starts, q)]
        width = max([(s + bs - 1) // bs for s in seq], default=0) + 1
        rng = np.random.default_rng(draw(_SEEDS))
        table = rng.integers(0, 10_000, size=(len(rows), width)).astype(np.int32)
        return PrefillCheckpointCase(_int32(seq), _int32(q), table, config)

    return build()
