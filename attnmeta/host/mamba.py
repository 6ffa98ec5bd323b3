"""Mamba-family host derivations: state indices, prefill/decode classification, prefill checkpoints.

- :func:`mamba_state_indices`: vLLM's ``mamba_get_block_table_tensor`` (docs/semantics-mamba.md,
  "State indices"), gathered on the host from the host block table and the exact sequence lengths.
- :func:`classify_mamba_rows`: the prefill -> decode moves of the Mamba builders' classification
  (docs/semantics-mamba.md, "Classification"): one-token chunks that continue existing state, and
  prompt tails padded with placeholder drafts.
- :func:`prefill_checkpoints`: the "align"-mode prefill checkpoints (docs/semantics-mamba.md,
  "Prefill checkpoints"): the offset into each prefill's query where a checkpoint state is exported,
  its block-table column and its state index.
- ``mamba_fill_nb``: one step of the Mamba2 / Mamba1 builders of :mod:`attnmeta.backends.mamba` in
  one compiled call, composed of the kernels behind the public functions here and in
  :mod:`attnmeta.host.layout`, :mod:`~attnmeta.host.split`, :mod:`~attnmeta.host.conv1d` and
  :mod:`~attnmeta.host.chunks` (classification, split, state indices, prefill query starts and
  contexts, causal-conv1d programs, checkpoints, chunk-aligned layout), writing into the arrays the
  builder passes by name (views of its staged fields).

Why one module
--------------
The three derivations share their per-row classification rules, and ``mamba_fill_nb`` composes them
with the chunk and conv1d kernels into the one call a step makes; keeping the rules and their
composition side by side is what keeps the fill path and the public functions computing the same
bytes (the tests compare them field by field).

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
from attnmeta.host.chunks import chunk_layout_nb
from attnmeta.host.conv1d import count_programs_nb, fill_programs_nb, minus_one_nb
from attnmeta.host.layout import _prefill_cpu_metadata_nb
from attnmeta.host.split import split_counts_nb

__all__ = [
    "CheckpointConfig",
    "PrefillCheckpoints",
    "checkpoint_parameters",
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
# state indices (docs/semantics-mamba.md, "State indices")


@njit
def state_indices_nb(
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
    """Mamba state indices per row, vLLM's ``mamba_get_block_table_tensor``, host.

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
    bad = int(state_indices_nb(bt, sl, bs, mode == "align", res))
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
# classification (docs/semantics-mamba.md, "Classification")


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
    """``is_prefilling`` after the Mamba builders' prefill -> decode moves, host.

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
# prefill checkpoints (docs/semantics-mamba.md, "Prefill checkpoints")


class CheckpointConfig(NamedTuple):
    """Static configuration of "align"-mode Mamba prefill checkpoints (docs/semantics-mamba.md, "Prefill checkpoints").

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


def checkpoint_parameters(config: CheckpointConfig, name: str = "config") -> tuple[int, int, int, int, int, bool]:
    """Validate ``config`` and return its values as the checkpoint kernels take them.

    Parameters
    ----------
    config : CheckpointConfig
        The configuration to check.
    name : str, default "config"
        How error messages name it (e.g. ``"Mamba2Options.checkpoint"``).

    Returns
    -------
    tuple of (int, int, int, int, int, bool)
        ``(hash_block_size, cache_hit_alignment_tokens, mamba_block_size, checkpoint_alignment or 0,
        num_hash_lookahead_tokens, drop_eagle_block)``.

    Raises
    ------
    TypeError
        Not a :class:`CheckpointConfig`.
    ValueError
        A size that is not a positive int, or a negative lookahead.

    Examples
    --------
    >>> checkpoint_parameters(CheckpointConfig(4, 4, 16, None))
    (4, 4, 16, 0, 0, False)
    """
    if not isinstance(config, CheckpointConfig):
        raise TypeError(f"{name}: expected CheckpointConfig, got {type(config).__name__}")
    hb = _positive_int(config.hash_block_size, f"{name}.hash_block_size")
    hit = _positive_int(config.cache_hit_alignment_tokens, f"{name}.cache_hit_alignment_tokens")
    mbs = _positive_int(config.mamba_block_size, f"{name}.mamba_block_size")
    align = 0
    if config.checkpoint_alignment is not None:
        align = _positive_int(config.checkpoint_alignment, f"{name}.checkpoint_alignment")
    look = config.num_hash_lookahead_tokens
    if isinstance(look, bool) or not isinstance(look, int | np.integer) or look < 0:
        raise ValueError(f"{name}.num_hash_lookahead_tokens: must be an int >= 0, got {look!r}")
    return hb, hit, mbs, align, int(look), bool(config.drop_eagle_block)


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
    """Prefill checkpoints of vLLM's "align" mamba cache mode (docs/semantics-mamba.md, "Prefill checkpoints"), host.

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
    hb, hit, mbs, align, look, drop = checkpoint_parameters(config)
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
        _checkpoints_nb(s, q, hb, hit, mbs, align, look, drop, offsets, cols)
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


# --------------------------------------------------------------------------------------------------
# the one fill path of the Mamba2 / Mamba1 builders (attnmeta.backends.mamba)

CONV1D_BLOCK_M = 8
"""vLLM's ``BLOCK_M`` of the causal-conv1d programs (the only value it uses)."""

# Status codes of mamba_fill_nb, encoded as ``-1 - (row * FILL_STATUS_STRIDE + code)``; the builder turns
# them into messages (re-running the validating public function of the step that failed, where one exists).
FILL_STATUS_STRIDE = 16
"""``status = -1 - (row * FILL_STATUS_STRIDE + code)`` (every ``FILL_E_*`` code is below it)."""
FILL_E_QSL = 1
"""A decreasing ``query_start_loc`` (classification)."""
FILL_E_DRAFTS = 2
"""A draft count below -1 (classification)."""
FILL_E_TABLE_D = 3
"""A decode row's state columns fall outside the block table (or its length is negative)."""
FILL_E_TABLE_P = 4
"""A prefill row's state column falls outside the block table (or its length is negative)."""
FILL_E_CONTEXT = 5
"""A prefill row's ``seq_lens_upper_bound`` is below its query length."""
FILL_E_CAPACITY = 6
"""An output is shorter than the step needs; ``row`` is the count needed (graph mode: a capacity)."""
FILL_E_CHECKPOINT = 7
"""A prefill row's checkpoint column falls outside the block table."""
FILL_E_ACCEPTED = 8
"""A decode row's given accepted-token count is outside ``[1, threshold]`` (``threshold = 1 + k``)."""
FILL_E_DRAFTS_K = 9
"""A row verifying more drafts than ``threshold - 1`` (``q == drafts + 1 > threshold``): it would run as a
prefill, its drafts taken into the state as accepted tokens."""


@njit
def _fail(row: int, code: int) -> tuple[int, int, int, int, int, bool, int, int]:
    return -1 - (row * FILL_STATUS_STRIDE + code), 0, 0, 0, 0, False, 0, 0


@njit
def mamba_fill_nb(
    query_start_loc: np.ndarray,
    seq_lens_upper_bound: np.ndarray,
    is_prefilling: np.ndarray,
    draft_tokens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    num_tokens: int,
    threshold: int,
    mamba_block_size: int,
    align: bool,
    chunk_size: int,
    pad: bool,
    accepted: np.ndarray,
    accepted_given: bool,
    known_bp_lo: int,
    known_bp_hi: int,
    known_op_lo: int,
    known_op_hi: int,
    ckpt_hash_block: int,
    ckpt_hit_align: int,
    ckpt_align: int,
    ckpt_lookahead: int,
    ckpt_drop_eagle: bool,
    moved: np.ndarray,
    state_d: np.ndarray,
    accepted_d: np.ndarray,
    state_p: np.ndarray,
    query_start_loc_p: np.ndarray,
    has_initial_p: np.ndarray,
    num_computed_p: np.ndarray,
    nums: np.ndarray,
    mlist: np.ndarray,
    batch_ptr: np.ndarray,
    offset_ptr: np.ndarray,
    cu_chunk_seqlens: np.ndarray,
    seq_idx: np.ndarray,
    last_chunk: np.ndarray,
    query_lens_p: np.ndarray,
    ckpt_offsets: np.ndarray,
    ckpt_cols: np.ndarray,
    ckpt_state: np.ndarray,
    ckpt_chunk: np.ndarray,
    ckpt_chunk_list: np.ndarray,
) -> tuple[int, int, int, int, int, bool, int, int]:
    """One step of the Mamba2 / Mamba1 builders: every per-step array, from the kernels of this module
    and of :mod:`attnmeta.host.layout`, :mod:`~attnmeta.host.split`, :mod:`~attnmeta.host.conv1d` and
    :mod:`~attnmeta.host.chunks`, in one call (docs/semantics-mamba.md).

    Inputs: the common metadata's host ``query_start_loc`` ``(B + 1,)``, ``seq_lens_upper_bound``,
    ``is_prefilling``, ``draft_tokens`` (``num_decode_draft_tokens``; empty without spec decode),
    ``seq_lens`` (exact) and ``block_table`` (``B`` rows), and ``num_tokens`` (padding included). An
    empty output array turns its part off; every output is written from row 0.

    1. Classification and split (:func:`_classify_nb` into ``moved``, then ``split_decodes_and_prefills``
       at ``threshold`` with ``treat_short_extends_as_decodes=False``): ``D`` decodes, ``P = B - D``
       prefills.
    2. State indices (:func:`state_indices_nb`): ``state_d`` ``(>= D, 1 + k)`` for the decode rows,
       ``state_p`` column 0 for the prefill rows; ``accepted_d``: ``accepted`` (1 past its end) when
       ``accepted_given``, each count of a decode row checked to lie in ``[1, threshold]`` (the prefill
       rows' counts are not read, as in vLLM), else ``diff(query_start_loc[:D + 1])``.
    3. Prefill query starts and contexts (``_prefill_cpu_metadata_nb`` of :mod:`attnmeta.host.layout`): ``query_start_loc_p``,
       ``num_computed_p`` (of the upper bounds), ``has_initial_p`` (of the exact lengths, ``seq_lens - q > 0``,
       vLLM's device rule; the two differ only for a prefill row whose bound is not exact).
    4. Causal-conv1d programs (``count_programs_nb``, ``fill_programs_nb``) when ``batch_ptr`` is
       given: ``nums``, ``mlist``, ``batch_ptr`` / ``offset_ptr`` with ``-1`` up to
       ``2 * max(1024, tot)`` (with ``pad``: to their end), skipping rows ``[known_bp_lo,
       known_bp_hi)`` / ``[known_op_lo, known_op_hi)`` that the caller knows hold ``-1`` already.
    5. Prefill checkpoints (:func:`_checkpoints_nb`, :func:`_gather_ckpt_nb`) when
       ``ckpt_hash_block > 0``: ``query_lens_p``, ``ckpt_offsets``, ``ckpt_cols``, ``ckpt_state``.
    6. The chunk-aligned layout (``chunk_layout_nb``) when ``chunk_size > 0``: ``cu_chunk_seqlens``,
       ``seq_idx``, ``last_chunk``, and with checkpoints ``ckpt_chunk_list`` (-1 where none) and
       ``ckpt_chunk`` (``max(idx, 0)``, vLLM's upload).

    With ``pad`` (graph mode) every output past the step's rows gets its sentinel to its end
    (``query_start_loc_p`` / ``cu_chunk_seqlens`` repeat their last value). Returns ``(status, D,
    num_decode_tokens, tot, num_chunks, prep_initial_states, num_checkpoints, num_moved)``;
    ``status`` is 0 or ``-1 - (row * FILL_STATUS_STRIDE + code)`` (``FILL_E_*``).
    """
    num_reqs = seq_lens_upper_bound.shape[0]
    # 1. classification and split
    num_moved = _classify_nb(query_start_loc, seq_lens_upper_bound, is_prefilling, draft_tokens,
                             draft_tokens.shape[0] > 0, moved)
    if num_moved < 0:
        enc = -1 - num_moved
        return _fail(enc // 4, FILL_E_QSL if enc % 4 == 1 else FILL_E_DRAFTS)
    D, P, Dt, _Pt = split_counts_nb(query_start_loc, num_tokens, 0, threshold, False, False, moved)
    if draft_tokens.shape[0] > 0:  # (spec decode: a decode row has at most threshold - 1 drafts)
        for i in range(D, num_reqs):
            d = int(draft_tokens[i])
            if d >= threshold and int(query_start_loc[i + 1]) - int(query_start_loc[i]) == d + 1:
                return _fail(i, FILL_E_DRAFTS_K)
    # 2. state indices and accepted counts
    bad = state_indices_nb(block_table[:D], seq_lens[:D], mamba_block_size, align, state_d[:D])
    if bad >= 0:
        return _fail(bad, FILL_E_TABLE_D)
    bad = state_indices_nb(block_table[D:num_reqs], seq_lens[D:num_reqs], mamba_block_size, align,
                            state_p[:P].reshape((P, 1)))
    if bad >= 0:
        return _fail(D + bad, FILL_E_TABLE_P)
    if accepted_d.shape[0] > 0:
        if accepted_given:
            na = accepted.shape[0]
            for i in range(D):
                if i < na:
                    a = accepted[i]
                    if a < 1 or a > threshold:
                        return _fail(i, FILL_E_ACCEPTED)
                    accepted_d[i] = a
                else:
                    accepted_d[i] = 1
        else:
            for i in range(D):
                accepted_d[i] = query_start_loc[i + 1] - query_start_loc[i]
    if pad:
        state_d[D:] = 0
        accepted_d[D:] = 1
        state_p[P:] = 0
    if query_start_loc_p.shape[0] == 0 or P == 0:
        if P > 0:  # prefill rows, but the caller staged no prefill fields (a bug)
            return _fail(P, FILL_E_CAPACITY)
        if pad and query_start_loc_p.shape[0] > 0:  # staged prefill fields hold their sentinels
            query_start_loc_p[:] = 0
            has_initial_p[:] = False
            minus_one_nb(batch_ptr, 0, batch_ptr.shape[0], known_bp_lo, known_bp_hi)
            minus_one_nb(offset_ptr, 0, offset_ptr.shape[0], known_op_lo, known_op_hi)
            cu_chunk_seqlens[:] = 0
            seq_idx[:] = -1
            last_chunk[:] = -1
            ckpt_offsets[:] = 0
            ckpt_cols[:] = -1
            ckpt_state[:] = 0
            ckpt_chunk[:] = 0
        return 0, D, Dt, 0, 0, False, 0, num_moved
    # 3. prefill query starts, contexts, initial-state flags
    status, row = _prefill_cpu_metadata_nb(query_start_loc, seq_lens_upper_bound, num_reqs, Dt,
                                           num_computed_p[:P], query_start_loc_p[: P + 1])
    if status != 0:
        return _fail(row, FILL_E_CONTEXT)
    prep = False
    first = num_reqs - P
    for j in range(P):
        # vLLM's has_initial_states_p reads the device's exact lengths (seq_lens - q > 0); its host
        # prep_initial_states and chunk layout read the upper bound (num_computed_p): they differ only
        # where a prefill row's bound is not exact, which vLLM's runner never schedules
        r = first + j
        has_initial_p[j] = np.int64(seq_lens[r]) - (np.int64(query_start_loc[r + 1]) - np.int64(query_start_loc[r])) > 0
        prep = prep or num_computed_p[j] > 0
    if pad:
        query_start_loc_p[P + 1 :] = query_start_loc_p[P]
        has_initial_p[P:] = False
    # 4. causal-conv1d programs
    tot = 0
    if batch_ptr.shape[0] > 0:
        tot = count_programs_nb(query_start_loc_p[: P + 1], CONV1D_BLOCK_M, nums[:P])
        stop = batch_ptr.shape[0] if pad else 2 * max(1024, tot)
        if stop > batch_ptr.shape[0] or stop > offset_ptr.shape[0] or tot > mlist.shape[0]:
            return _fail(stop, FILL_E_CAPACITY)
        fill_programs_nb(nums[:P], mlist, batch_ptr, offset_ptr, stop, known_bp_lo, known_bp_hi, known_op_lo,
                          known_op_hi)
    # 5. prefill checkpoints
    nck = 0
    if ckpt_hash_block > 0:
        for j in range(P):
            query_lens_p[j] = query_start_loc_p[j + 1] - query_start_loc_p[j]
        nck = _checkpoints_nb(seq_lens_upper_bound[D:num_reqs], query_lens_p[:P], ckpt_hash_block, ckpt_hit_align,
                              mamba_block_size, ckpt_align, ckpt_lookahead, ckpt_drop_eagle, ckpt_offsets[:P],
                              ckpt_cols[:P])
        bad = _gather_ckpt_nb(block_table[D:num_reqs], ckpt_cols[:P], ckpt_state[:P])
        if bad >= 0:
            return _fail(D + bad, FILL_E_CHECKPOINT)
        if pad:
            ckpt_offsets[P:] = 0
            ckpt_cols[P:] = -1
            ckpt_state[P:] = 0
    # 6. the chunk-aligned layout
    count = 0
    if chunk_size > 0:
        with_ckpt = nck > 0
        count = chunk_layout_nb(chunk_size, num_computed_p[:P], query_start_loc_p[: P + 1],
                                 ckpt_offsets[:P] if with_ckpt else ckpt_offsets[:0], cu_chunk_seqlens, seq_idx,
                                 last_chunk[:P], ckpt_chunk_list[:P] if with_ckpt else ckpt_chunk_list[:0])
        if count < 0:  # unreachable: the inputs were validated above
            return _fail(0, FILL_E_CONTEXT)
        if count >= cu_chunk_seqlens.shape[0] or count > seq_idx.shape[0]:
            return _fail(count, FILL_E_CAPACITY)
        if ckpt_chunk.shape[0] > 0:
            for j in range(P):
                ckpt_chunk[j] = ckpt_chunk_list[j] if with_ckpt and ckpt_chunk_list[j] > 0 else 0
        if pad:
            cu_chunk_seqlens[count + 1 :] = cu_chunk_seqlens[count]
            seq_idx[count:] = -1
            last_chunk[P:] = -1
            ckpt_chunk[P:] = 0
    return 0, D, Dt, tot, count, prep, nck, num_moved
