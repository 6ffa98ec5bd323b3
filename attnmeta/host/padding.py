"""CUDA-graph padding values at replay (vLLM 0.33.0, docs/semantics.md, "Padding values per backend").

:data:`REPLAY_PADDING` lists what vLLM's runner puts in padded request rows and tokens at replay, which
is what attnmeta's common pass and graph-mode sentinels write on the host; :func:`bailing_state_indices`
is the one builder-specific replay value that differs (Bailing linear attention's -1 state index).

Shape legend
------------
- ``num_reqs``: real request rows; ``num_reqs_padded``: rows including padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from attnmeta._checks import as_host_array, check_out

__all__ = ["LAST", "REPLAY_PADDING", "bailing_state_indices"]

LAST = "last"
"""Marks a padding value that repeats the array's last real value."""

REPLAY_PADDING: Mapping[str, int | str] = MappingProxyType({
    "query_start_loc": LAST,
    "seq_lens": 0,
    "seq_lens_cpu_upper_bound": 0,
    "block_table_tensor": 0,
    "slot_mapping": -1,
    "positions": 0,
    "is_prefilling": 0,
    "dcp_local_seq_lens": 0,
    "encoder_seq_lens": 0,
    "num_accepted_tokens": 1,
    "num_decode_draft_tokens": -1,
    "logits_indices_padded": LAST,
    "paged_kv_indptr": LAST,
    "paged_kv_last_page_len": 0,
    "state_indices": 0,
})
"""Replay value of each padded row (token, for per-token arrays) by field: an int or :data:`LAST`.
``seq_lens`` is 0 at replay for every backend (the capture-time 1 of some backends is not a replay
value: :mod:`attnmeta.graph_padding`); ``block_table_tensor`` rows are ``NULL_BLOCK_ID`` 0, which a
kernel-block table expands to ``0 .. R - 1``; ``state_indices`` is 0 except Bailing's -1."""


def bailing_state_indices(
    state_indices: npt.ArrayLike, seq_lens: npt.ArrayLike, num_reqs_padded: int, *, out: np.ndarray | None = None,
) -> np.ndarray:
    """Bailing linear attention's state indices: -1 for rows with ``seq_lens == 0`` and for the padding tail.

    vLLM computes it on the device (``torch.where(seq_lens == 0, -1, ...)`` and a tail fill); here on
    the host, before the step's copy.

    Parameters
    ----------
    state_indices : (num_reqs,) int32, host
        The rows' state (block) indices.
    seq_lens : (num_reqs,) int32, host
    num_reqs_padded : int
        ``>= num_reqs``.
    out : (num_reqs_padded,) int32, host, optional

    Returns
    -------
    (num_reqs_padded,) int32, host

    Examples
    --------
    >>> bailing_state_indices([4, 9, 7], [12, 0, 3], 5).tolist()
    [4, -1, 7, -1, -1]
    """
    si = as_host_array(state_indices, "state_indices")
    sl = as_host_array(seq_lens, "seq_lens", length=si.shape[0])
    B = si.shape[0]
    if type(num_reqs_padded) is not int or num_reqs_padded < B:
        raise ValueError(f"num_reqs_padded: must be an int >= num_reqs={B}, got {num_reqs_padded!r}")
    res = check_out(out, "out", (num_reqs_padded,), np.int32)
    np.copyto(res[:B], np.where(sl == 0, np.int32(-1), si))
    res[B:] = -1
    return res
