"""Decode-context-parallel (DCP) host decisions of vLLM 0.33.0's ``cp_utils`` (docs/semantics.md,
"DCP context attention").

Host code only: numpy in, Python scalars out; nothing reads a device tensor, so none of it syncs.

Shape legend
------------
- ``num_reqs``: request rows (padding rows included).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from attnmeta._checks import as_host_array
from attnmeta.host.split import split_decodes_prefills_and_extends

__all__ = [
    "dcp_context_kv_lens",
    "should_skip_dcp_context_attention",
    "should_split_fa2_dcp_context_attention",
    "split_dcp_context_queries",
]


def should_skip_dcp_context_attention(context_kv_lens: npt.ArrayLike) -> bool:
    """Whether every request has no context: vLLM ``should_skip_dcp_context_attention`` (``max == 0``).

    The input must be **rank-invariant**: the global context lengths, not this rank's share. The
    non-skip path issues DCP collectives, so every rank must take the same branch, and a rank can hold
    no local context while another holds some. An empty batch skips.

    Parameters
    ----------
    context_kv_lens : (num_reqs,) int32, host
        Global context tokens of each request (e.g. :func:`dcp_context_kv_lens`).

    Returns
    -------
    bool

    Examples
    --------
    >>> should_skip_dcp_context_attention([0, 0, 0]), should_skip_dcp_context_attention([0, 5, 0])
    (True, False)
    """
    ctx = as_host_array(context_kv_lens, "context_kv_lens")
    return bool(ctx.size == 0 or int(ctx.max()) == 0)


def dcp_context_kv_lens(query_start_loc_cpu: npt.ArrayLike, seq_lens_upper_bound: npt.ArrayLike) -> np.ndarray:
    """Global context tokens of each row, as FlashAttention's DCP build computes them for the skip test:
    ``seq_lens_upper_bound - diff(query_start_loc_cpu)``.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
    seq_lens_upper_bound : (num_reqs,) int32, host
        ``seq_lens_cpu_upper_bound`` (global lengths: rank-invariant).

    Returns
    -------
    (num_reqs,) int32, host

    Examples
    --------
    >>> dcp_context_kv_lens([0, 1, 2, 6, 14], [9, 12, 20, 8]).tolist()
    [8, 11, 16, 0]
    """
    qsl = as_host_array(query_start_loc_cpu, "query_start_loc_cpu")
    ub = as_host_array(seq_lens_upper_bound, "seq_lens_upper_bound", length=max(qsl.shape[0] - 1, 0))
    return (ub - np.diff(qsl)).astype(np.int32)


def split_dcp_context_queries(
    query_start_loc_cpu: npt.ArrayLike,
    seq_lens_upper_bound: npt.ArrayLike | None,
    max_query_len: int,
    num_tokens: int,
) -> tuple[int, int, int, int]:
    """``(num_decodes, num_extends, num_decode_tokens, num_extend_tokens)``: vLLM ``split_dcp_context_queries``.

    ``max_query_len <= 1``: every row decodes, ``(B, 0, T, 0)``. No upper bound: ``(0, B, 0, T)``.
    Otherwise the decode / extend part of :func:`attnmeta.host.split.split_decodes_prefills_and_extends`
    with threshold 1 (prefill rows, without context, are in neither count). vLLM returns the extend
    token count as a 0-d int32 tensor in that last case; this returns an ``int`` always.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, host
    seq_lens_upper_bound : (num_reqs,) int32, host, or None
    max_query_len : int
    num_tokens : int
        ``T``, the step's tokens (token padding included).

    Returns
    -------
    tuple of 4 int

    Examples
    --------
    >>> split_dcp_context_queries([0, 1, 2, 6, 14], [9, 12, 20, 8], 8, 14)
    (2, 1, 2, 4)
    >>> split_dcp_context_queries([0, 1, 2], None, 1, 2), split_dcp_context_queries([0, 3], None, 3, 3)
    ((2, 0, 2, 0), (0, 1, 0, 3))
    """
    qsl = as_host_array(query_start_loc_cpu, "query_start_loc_cpu")
    B = qsl.shape[0] - 1
    if max_query_len <= 1:
        return B, 0, num_tokens, 0
    if seq_lens_upper_bound is None:
        return 0, B, 0, num_tokens
    s = split_decodes_prefills_and_extends(qsl, seq_lens_upper_bound, num_tokens=num_tokens,
                                           max_query_len=max_query_len, decode_threshold=1)
    return int(s.num_decodes), int(s.num_extends), int(s.num_decode_tokens), int(s.num_extend_tokens)


def should_split_fa2_dcp_context_attention(
    fa_version: int, max_query_len: int, num_decodes: int, num_extends: int, num_prefills: int,
) -> bool:
    """Whether FlashAttention 2's DCP context path splits the batch (vLLM
    ``should_split_fa2_dcp_context_attention``): FA2, ``max_query_len > 1``, rows past the decodes,
    and decodes present or some prefill without context.

    Parameters
    ----------
    fa_version : int
    max_query_len : int
    num_decodes, num_extends, num_prefills : int
        The split of :func:`attnmeta.host.split.split_decodes_prefills_and_extends` (threshold 1).

    Returns
    -------
    bool

    Examples
    --------
    >>> should_split_fa2_dcp_context_attention(2, 8, 2, 1, 1), should_split_fa2_dcp_context_attention(3, 8, 2, 1, 1)
    (True, False)
    >>> should_split_fa2_dcp_context_attention(2, 8, 0, 2, 0)
    False
    """
    return (fa_version == 2 and max_query_len > 1 and num_extends + num_prefills > 0
            and (num_decodes > 0 or num_prefills > 0))
