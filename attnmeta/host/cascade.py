"""Cascade attention: shared-prefix decision and arrays, on the host (docs/semantics-attention.md, "FlashAttentionMetadata").

Cascade attention splits a batch whose requests share a cached prefix of ``L`` tokens into two passes:
one non-causal pass of *all* query tokens over the shared prefix (batch of one), and one causal pass of
each request over its own suffix; the two are merged by log-sum-exp. vLLM removed it by 0.33.0
(``common_prefix_len`` is "deprecated and always 0"); attnmeta keeps the host half, because its inputs
are all host data and its old device half was built with blocking ``torch.tensor(list, device=...)``
uploads.

- :func:`cascade_prefix_len`: the runner's rule (``_compute_cascade_attn_prefix_len`` before the
  builder's vote): ``L = num_common_prefix_blocks * block_size``, capped at the smallest
  ``num_computed_tokens`` (no +1, so both passes always have work and no query sees a prefix token it
  should not), rounded down to a whole block. Given the block table, it also checks that every row
  holds row 0's blocks in those ``L / block_size`` columns (the prefix pass reads row 0's only).
- :func:`use_cascade_attention`: the FlashAttention builder's vote, with its flash-decoding cost model.
- :func:`cascade_arrays`: the FlashAttention arrays (``cu_prefix_query_lens = [0, T]``,
  ``prefix_kv_lens = [L]``, ``suffix_kv_lens = seq_lens - L``) and the FlashInfer shared level
  (``qo_indptr = [0, T]``, ``kv_indptr = [0, L / block_size]``, ``kv_indices = block_table[0, :L /
  block_size]``, ``last_page_len = [block_size]``).

FlashInfer's per-request (suffix) level is :func:`attnmeta.host.paged.paged_kv_layout` of
``suffix_kv_lens`` over ``block_table[:, num_prefix_blocks:]``: since ``L`` is a whole number of blocks
and every real row has ``seq_lens >= L``, its last-page lengths equal those of the full lengths. (One
stored pre-removal vLLM version shortened the page counts before gathering from the *unsliced* table,
which reads prefix blocks; it was disabled, vllm#26130. attnmeta documents the consistent form.)

Shape legend
------------
- ``num_reqs``: request rows ``B`` (cascade is never combined with CUDA-graph padding rows).
- ``num_tokens``: query tokens ``T`` of the step (``num_actual_tokens``).
- ``num_prefix_blocks``: ``common_prefix_len // block_size``.
- ``max_blocks_per_req``: block-table width ``W``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnmeta._checks import INT32_MAX, as_host_array, check_nonnegative, first_bad_row

__all__ = ["CASCADE_MIN_PREFIX", "CASCADE_MIN_REQS", "CascadeArrays", "cascade_arrays", "cascade_prefix_len",
           "use_cascade_attention"]

CASCADE_MIN_PREFIX = 256
"""Shortest common prefix worth a cascade, in tokens (vLLM's arbitrary 256-token threshold)."""
CASCADE_MIN_REQS = 8
"""Fewest requests worth a cascade (vLLM's arbitrary 8-request threshold)."""
#: Default flash-attn tile sizes assumed by the cost model.
_Q_TILE = 128
_KV_TILE = 128


class CascadeArrays(NamedTuple):
    """Host arrays of one cascade step; upload them with the step's one copy.

    Examples
    --------
    >>> import numpy as np
    >>> bt = np.array([[3, 4, 5, 6], [3, 4, 7, 0], [3, 4, 8, 9]], np.int32)
    >>> ca = cascade_arrays(32, np.array([40, 35, 60], np.int32), 5, 16, block_table=bt)
    >>> ca.cu_prefix_query_lens, ca.prefix_kv_lens, ca.suffix_kv_lens, ca.num_prefix_blocks
    (array([0, 5], dtype=int32), array([32], dtype=int32), array([ 8,  3, 28], dtype=int32), 2)
    >>> ca.shared_kv_page_indptr, ca.shared_kv_page_indices, ca.shared_kv_last_page_len
    (array([0, 2], dtype=int32), array([3, 4], dtype=int32), array([16], dtype=int32))
    """

    cu_prefix_query_lens: np.ndarray
    """(2,) int32, host. ``[0, num_tokens]``: every query token as one request of the prefix pass.
    Also FlashInfer's shared-level ``qo_indptr``."""
    prefix_kv_lens: np.ndarray
    """(1,) int32, host. ``[common_prefix_len]``."""
    suffix_kv_lens: np.ndarray
    """(num_reqs,) int32, host. ``seq_lens - common_prefix_len``: each request's own KV."""
    num_prefix_blocks: int
    """``common_prefix_len // block_size``: the suffix pass reads ``block_table[:, num_prefix_blocks:]``."""
    shared_kv_page_indptr: np.ndarray
    """(2,) int32, host. FlashInfer shared level: ``[0, num_prefix_blocks]``."""
    shared_kv_last_page_len: np.ndarray
    """(1,) int32, host. FlashInfer shared level: ``[block_size]`` (the prefix is whole blocks)."""
    shared_kv_page_indices: np.ndarray | None
    """(num_prefix_blocks,) int32, host, or ``None`` without a block table. A copy of
    ``block_table[0, :num_prefix_blocks]`` (the prefix blocks are the same in every row)."""


def _check_int(value: Any, name: str, *, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < 0 or (positive and v == 0):
        raise ValueError(f"{name}: must be {'> 0' if positive else '>= 0'}, got {v}")
    return v


def cascade_prefix_len(
    num_common_prefix_blocks: int, block_size: int, num_computed_tokens: Any, *, block_table: Any = None
) -> int:
    """Common-prefix length the runner offers to the cascade decision, in tokens (host).

    ``L = num_common_prefix_blocks * block_size``; 0 stays 0; else ``L = min(L, min(num_computed_tokens))``
    rounded down to a multiple of ``block_size``. Pass the result to :func:`use_cascade_attention`; the
    step's ``common_prefix_len`` is ``L`` if it votes yes, else 0.

    With ``block_table``, the prefix columns ``[0, L / block_size)`` of every request's row must hold
    row 0's block ids: the prefix pass reads row 0's blocks for every request, so a count larger than
    the blocks the rows share would attend to another request's KV. vLLM's count is the blocks every
    running request holds; the cap at the smallest context (vLLM's) makes ``L`` fit every row.

    Parameters
    ----------
    num_common_prefix_blocks : int
        KV blocks every running request shares (from the KV-cache manager), >= 0.
    block_size : int
        Tokens per KV block, > 0.
    num_computed_tokens : (num_reqs,) int32, host
        Tokens already in the KV cache for each real request (``c``).
    block_table : (rows >= num_reqs, max_blocks_per_req) int32, host, optional
        The step's block table: its first ``num_reqs`` rows are checked over the prefix columns.

    Returns
    -------
    int
        The capped prefix length, a multiple of ``block_size``; 0 when no blocks are shared or there
        are no requests.

    Raises
    ------
    TypeError
        A count or size that is not an int.
    ValueError
        Negative counts or a non-positive ``block_size``; a request whose prefix columns differ from
        row 0's (the message names the first row and column), or a table without them.

    Examples
    --------
    >>> import numpy as np
    >>> cascade_prefix_len(20, 16, np.array([300, 290, 500], np.int32))
    288
    >>> cascade_prefix_len(0, 16, np.array([300, 290, 500], np.int32))
    0
    >>> cascade_prefix_len(3, 16, np.array([300, 290]), block_table=[[7, 8, 9], [7, 4, 9]])
    Traceback (most recent call last):
    ValueError: num_common_prefix_blocks=3: block_table[1, 1]=4 != block_table[0, 1]=8; the 3 shared prefix blocks (common_prefix_len=48) must be the same in every request (row 1 differs)
    """
    blocks = _check_int(num_common_prefix_blocks, "num_common_prefix_blocks")
    bs = _check_int(block_size, "block_size", positive=True)
    c = as_host_array(num_computed_tokens, "num_computed_tokens")
    check_nonnegative(c, "num_computed_tokens")
    length = blocks * bs
    if length == 0 or c.shape[0] == 0:
        return 0
    length = min(length, int(c.min())) // bs * bs
    if block_table is not None and length:
        _check_shared_prefix(as_host_array(block_table, "block_table", ndim=2), c.shape[0], length // bs, blocks, bs)
    return length


def _check_shared_prefix(bt: np.ndarray, rows: int, nb: int, offered: int, bs: int) -> None:
    """Every one of the first ``rows`` rows of ``bt`` holds row 0's ids in columns ``[0, nb)``."""
    if bt.shape[0] < rows or bt.shape[1] < nb:
        raise ValueError(
            f"block_table: shape {bt.shape} lacks the {nb} prefix columns of the {rows} requests "
            f"(num_common_prefix_blocks={offered}, block_size={bs})"
        )
    head = bt[:rows, :nb]
    differ = head[1:] != head[0]
    if differ.any():
        flat = int(np.argmax(differ))  # row-major: the first row that differs, its first column
        r, col = flat // nb + 1, flat % nb
        raise ValueError(
            f"num_common_prefix_blocks={offered}: block_table[{r}, {col}]={int(bt[r, col])} != block_table[0, {col}]="
            f"{int(bt[0, col])}; the {nb} shared prefix blocks (common_prefix_len={nb * bs}) must be the same in every "
            f"request (row {r} differs)"
        )


def use_cascade_attention(
    *,
    common_prefix_len: int,
    query_lens: Any,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    use_local_attention: bool,
    num_sms: int,
    dcp_world_size: int = 1,
) -> bool:
    """Whether cascade attention is supported and expected to pay off (FlashAttention's rule, host).

    No if the prefix is shorter than 256 tokens, ALiBi / sliding-window / chunked local attention is in
    use, there are fewer than 8 requests, or decode context parallelism is on. Otherwise yes, unless
    plain attention would run as *flash decoding* (grouped-query heads, ``g = num_query_heads //
    num_kv_heads > 1``, and every query length 1); then a rough cost model with 128x128 tiles decides,
    with ``tiles = cdiv(L, 128)``:
    ``cascade = cdiv(num_query_heads * cdiv(B, 128), num_sms) * tiles`` against
    ``flash_decoding = cdiv(B * num_kv_heads * cdiv(g, 128) * tiles, num_sms)``; yes iff
    ``cascade < flash_decoding``.

    Parameters
    ----------
    common_prefix_len : int
        From :func:`cascade_prefix_len`, >= 0.
    query_lens : (num_reqs,) int32, host
        Scheduled tokens per real request.
    num_query_heads, num_kv_heads : int
        Attention heads of this rank, > 0.
    use_alibi, use_sliding_window, use_local_attention : bool
        Model features that rule cascade out.
    num_sms : int
        Streaming multiprocessors of the device, > 0.
    dcp_world_size : int, default 1
        Decode-context-parallel world size; > 1 rules cascade out.

    Returns
    -------
    bool
        The decision.

    Raises
    ------
    TypeError
        A count that is not an int.
    ValueError
        Negative or zero counts where positive ones are needed.

    Examples
    --------
    >>> import numpy as np
    >>> kw = dict(num_query_heads=32, num_kv_heads=8, use_alibi=False, use_sliding_window=False,
    ...           use_local_attention=False, num_sms=132)
    >>> use_cascade_attention(common_prefix_len=512, query_lens=np.array([5, 1, 1, 1, 1, 1, 1, 1]), **kw)
    True
    >>> use_cascade_attention(common_prefix_len=512, query_lens=np.ones(8, np.int32), **kw)
    False
    >>> use_cascade_attention(common_prefix_len=128, query_lens=np.array([5, 1, 1, 1, 1, 1, 1, 1]), **kw)
    False
    """
    prefix = _check_int(common_prefix_len, "common_prefix_len")
    hq = _check_int(num_query_heads, "num_query_heads", positive=True)
    hkv = _check_int(num_kv_heads, "num_kv_heads", positive=True)
    sms = _check_int(num_sms, "num_sms", positive=True)
    dcp = _check_int(dcp_world_size, "dcp_world_size", positive=True)
    q = as_host_array(query_lens, "query_lens")
    check_nonnegative(q, "query_lens")
    if prefix < CASCADE_MIN_PREFIX:
        return False
    if use_alibi or use_sliding_window or use_local_attention:
        return False
    num_reqs = q.shape[0]
    if num_reqs < CASCADE_MIN_REQS:
        return False
    if dcp > 1:
        return False
    group = hq // hkv
    flash_decoding = group > 1 and bool((q == 1).all())
    if not flash_decoding:
        return True
    tiles = -(-prefix // _KV_TILE)
    cascade_time = -(-(hq * -(-num_reqs // _Q_TILE)) // sms) * tiles
    fd_ctas = num_reqs * hkv * -(-group // _Q_TILE) * tiles
    fd_time = -(-fd_ctas // sms)
    return bool(cascade_time < fd_time)


def cascade_arrays(
    common_prefix_len: int,
    seq_lens: Any,
    num_tokens: int,
    block_size: int,
    *,
    block_table: Any = None,
) -> CascadeArrays:
    """The host arrays of a cascade step, FlashAttention and FlashInfer variants (host).

    Same values and dtypes as the pre-removal vLLM builders (FlashAttention's ``cu_prefix_query_lens``,
    ``prefix_kv_lens``, ``suffix_kv_lens``; FlashInfer's shared ``qo_indptr``, ``kv_page_indptr``,
    ``kv_page_indices``, ``kv_last_page_len``), without their blocking uploads.

    Parameters
    ----------
    common_prefix_len : int
        ``L`` from :func:`cascade_prefix_len` (after a yes from :func:`use_cascade_attention`): a
        multiple of ``block_size``, at most every ``seq_lens[i]``.
    seq_lens : (num_reqs,) int32, host
        Exact sequence lengths.
    num_tokens : int
        Query tokens of the step ``T`` (``num_actual_tokens``).
    block_size : int
        Tokens per KV block (FlashInfer page size), > 0.
    block_table : (rows, max_blocks_per_req) int32, host, optional
        Gives ``shared_kv_page_indices`` (row 0's first ``num_prefix_blocks`` columns).

    Returns
    -------
    CascadeArrays
        Fresh arrays (small; nothing aliases the inputs).

    Raises
    ------
    TypeError
        A count or size that is not an int.
    ValueError
        ``common_prefix_len`` negative or not a multiple of ``block_size``, a sequence shorter than the
        prefix, ``num_tokens`` negative or above int32, a block table with no rows or too few columns.

    Examples
    --------
    >>> import numpy as np
    >>> ca = cascade_arrays(256, np.array([300, 260, 400, 257], np.int32), 9, 16)
    >>> ca.cu_prefix_query_lens, ca.prefix_kv_lens, ca.suffix_kv_lens
    (array([0, 9], dtype=int32), array([256], dtype=int32), array([ 44,   4, 144,   1], dtype=int32))
    >>> ca.num_prefix_blocks, ca.shared_kv_page_indptr, ca.shared_kv_last_page_len
    (16, array([ 0, 16], dtype=int32), array([16], dtype=int32))
    """
    bs = _check_int(block_size, "block_size", positive=True)
    prefix = _check_int(common_prefix_len, "common_prefix_len")
    if prefix % bs:
        raise ValueError(
            f"common_prefix_len={prefix} is not a multiple of block_size={bs}; cascade_prefix_len() rounds it down"
        )
    tokens = _check_int(num_tokens, "num_tokens")
    for name, value in (("num_tokens", tokens), ("common_prefix_len", prefix)):
        if value > INT32_MAX:
            raise ValueError(f"{name}: {value} overflows int32")
    s = as_host_array(seq_lens, "seq_lens")
    check_nonnegative(s, "seq_lens")
    if s.shape[0] and int(s.min()) < prefix:
        i = first_bad_row(s < prefix)
        raise ValueError(
            f"seq_lens[{i}]={int(s[i])} < common_prefix_len={prefix} (request {i}); the shared prefix is "
            f"capped at the smallest num_computed_tokens, so every sequence must contain it"
        )
    blocks = prefix // bs
    indices = None
    if block_table is not None:
        bt = as_host_array(block_table, "block_table", ndim=2)
        if bt.shape[0] < 1 or bt.shape[1] < blocks:
            raise ValueError(
                f"block_table: shape {bt.shape} has no row 0 with the {blocks} prefix blocks "
                f"(common_prefix_len={prefix}, block_size={bs})"
            )
        indices = bt[0, :blocks].copy()
    return CascadeArrays(
        cu_prefix_query_lens=np.array([0, tokens], np.int32),
        prefix_kv_lens=np.array([prefix], np.int32),
        suffix_kv_lens=s - np.int32(prefix),
        num_prefix_blocks=blocks,
        shared_kv_page_indptr=np.array([0, blocks], np.int32),
        shared_kv_last_page_len=np.array([bs], np.int32),
        shared_kv_page_indices=indices,
    )
