"""Device-side reference implementations (mamba); see :mod:`attnmeta.testing.reference`.

Straightforward torch transcriptions of the Mamba-family metadata computations, the way engines do
them: per-request Python loops with ``.item()`` / ``.tolist()`` (the vLLM chunk layout, the
checkpoint rules), device arithmetic, ``repeat_interleave`` and ``gather`` on device tensors.
Obviously correct, synchronisations and all; never use them on a serving path.

Every function returns torch tensors on ``device`` with the dtypes vLLM uses, so tests compare the
host results against them bit for bit (``attnmeta.testing.assertions.assert_matches_device``).

Shape legend
------------
- ``num_prefills`` (``P``): prefill rows; ``num_reqs`` (``B``): request rows.
- ``num_chunks``: chunks of a layout; ``num_tokens`` (``T``): ``query_start_loc[-1]``.
- ``max_blocks_per_req`` (``W``): block-table width.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from attnmeta.spec import BatchSpec

__all__ = [
    "ref_causal_conv1d_metadata",
    "ref_checkpoint_chunk_index",
    "ref_chunk_metadata",
    "ref_chunk_metadata_lists",
    "ref_classify_mamba_rows",
    "ref_linear_attn_metadata",
    "ref_logical_chunks",
    "ref_mamba_block_table",
    "ref_mamba_metadata",
    "ref_mamba_state_indices",
    "ref_prefill_checkpoints",
    "ref_token_seq_idx",
    "ref_varlen_chunk_metadata",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ref_chunk_metadata_lists(
    chunk_size: int,
    num_computed_p_cpu: torch.Tensor,
    query_start_loc_p_cpu: torch.Tensor,
    checkpoint_offsets: list[int] | None = None,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The 6.5 chunk layout as host Python lists: the engine's per-request loop over CPU tensors.

    A line-by-line transcription of the prose algorithm of docs/semantics-mamba.md, "The chunk-aligned layout" (segments, then
    chunking with a realigning first chunk), reading one request at a time with ``.item()``. This is
    also the "engine-style baseline" the benchmarks time.

    Returns ``(cu_chunk_seqlens, seq_idx, last_chunk_indices, checkpoint_chunk_idx)``.
    """
    num_prefills = num_computed_p_cpu.shape[0]
    segments: list[tuple[int, int, int, bool]] = []
    for i in range(num_prefills):
        c = int(num_computed_p_cpu[i].item())
        n = int(query_start_loc_p_cpu[i + 1].item()) - int(query_start_loc_p_cpu[i].item())
        k = 0 if checkpoint_offsets is None else int(checkpoint_offsets[i])
        if k > 0:
            segments.append((i, c, k, True))
        segments.append((i, c + k, n - k, False))

    pos = 0
    cu: list[int] = []
    seq_idx: list[int] = []
    last: list[int] = []
    ckpt_idx = [-1] * num_prefills
    for i, c, n, is_ckpt in segments:
        if c % chunk_size != 0:
            cu.append(pos)
            seq_idx.append(i)
            length = min(_cdiv(c, chunk_size) * chunk_size - c, n)
            pos += length
            n -= length
        for _ in range(_cdiv(n, chunk_size)):
            cu.append(pos)
            seq_idx.append(i)
            length = min(chunk_size, n)
            pos += length
            n -= length
        assert n == 0
        if is_ckpt:
            ckpt_idx[i] = len(cu) - 1
        else:
            last.append(len(cu) - 1)
    cu.append(pos)
    return cu, seq_idx, last, ckpt_idx


def ref_chunk_metadata(
    chunk_size: int,
    num_computed_p: torch.Tensor,
    query_start_loc_p: torch.Tensor,
    checkpoint_offsets: list[int] | None = None,
    *,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ref_chunk_metadata_lists` uploaded as vLLM does: int32, int32, int32 and int64 tensors.

    Returns ``(cu_chunk_seqlens, seq_idx, last_chunk_indices, checkpoint_chunk_idx)`` on ``device``.
    """
    cu, seq_idx, last, ckpt = ref_chunk_metadata_lists(
        chunk_size, num_computed_p.cpu(), query_start_loc_p.cpu(), checkpoint_offsets
    )
    return (
        torch.tensor(cu, dtype=torch.int32, device=device),
        torch.tensor(seq_idx, dtype=torch.int32, device=device),
        torch.tensor(last, dtype=torch.int32, device=device),
        torch.tensor(ckpt, dtype=torch.int64, device=device),
    )


def ref_checkpoint_chunk_index(
    checkpoint_chunk_idx: list[int], *, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """vLLM's upload of the checkpoint chunk list: None unless some entry >= 0, else max(idx, 0)."""
    if not any(idx >= 0 for idx in checkpoint_chunk_idx):
        return None
    return torch.tensor([max(idx, 0) for idx in checkpoint_chunk_idx], dtype=torch.int64, device=device)


def ref_logical_chunks(query_start_loc: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM v0's ``chunk_indices`` / ``chunk_offsets`` on a device tensor (docs/semantics-mamba.md,
    "Logical chunks").

    The original routine: size ``N`` from a device reduction, ``arange`` / ``zeros`` on the device,
    then a Python loop over device scalars that shifts index slices. The one out-of-bounds write of
    the original (an aligned empty sequence at the end of an aligned batch) is skipped.
    """
    dev = query_start_loc.device
    ends = query_start_loc[1:]
    total = int(query_start_loc[-1].item())
    n = _cdiv(total, chunk_size) + int((ends[:-1] % chunk_size > 0).sum().item())
    indices = torch.arange(n, dtype=torch.int32, device=dev)
    offsets = torch.zeros((n,), dtype=torch.int32, device=dev)
    inserted = 0
    for s_t, e_t in itertools.pairwise(ends):
        s = int(s_t.item())
        e = int(e_t.item())
        inserted += int(s % chunk_size > 0)
        lo = s // chunk_size + inserted
        hi = e // chunk_size + inserted + int(e % chunk_size > 0)
        indices[lo:hi] -= inserted
        if lo < n:
            offsets[lo] = s % chunk_size
    return indices, offsets


def ref_token_seq_idx(
    query_start_loc: torch.Tensor,
    *,
    num_tokens_padded: int | None = None,
    consecutive: bool = False,
) -> torch.Tensor:
    """Per-token sequence index: ``repeat_interleave(arange(B), diff(qsl))`` then ``-1`` padding.

    With ``consecutive`` the ids are ``cumsum(q > 0) - 1`` instead of the row index.
    """
    dev = query_start_loc.device
    q = query_start_loc.diff()
    total = int(query_start_loc[-1].item())
    if consecutive:
        ids = (torch.cumsum((q > 0).to(torch.int32), 0) - 1).to(torch.int32)
    else:
        ids = torch.arange(q.shape[0], dtype=torch.int32, device=dev)
    seq = torch.repeat_interleave(ids, q, output_size=total)
    length = total if num_tokens_padded is None else num_tokens_padded
    out = torch.full((length,), -1, dtype=torch.int32, device=dev)
    out[:total] = seq
    return out


def ref_varlen_chunk_metadata(
    query_start_loc: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``compute_varlen_chunk_metadata``: packed-index chunks, ``(cu, last, seq_idx)``."""
    dev = query_start_loc.device
    starts = query_start_loc[:-1].tolist()
    ends = query_start_loc[1:].tolist()
    lens: list[int] = []
    seq_idx: list[int] = []
    last = [-1] * len(starts)
    for b, (s, e) in enumerate(zip(starts, ends)):
        pos = s
        while pos < e:
            take = min(chunk_size - pos % chunk_size, e - pos)
            lens.append(take)
            seq_idx.append(b)
            last[b] = len(lens) - 1
            pos += take
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    return (
        torch.tensor(cu, dtype=torch.int32, device=dev),
        torch.tensor(last, dtype=torch.int32, device=dev),
        torch.tensor(seq_idx, dtype=torch.int32, device=dev),
    )


def ref_causal_conv1d_metadata(
    query_start_loc_p_cpu: torch.Tensor, *, device: torch.device | str = "cpu", block_m: int = 8
) -> dict[str, Any]:
    """vLLM's ``compute_causal_conv1d_metadata`` from a host int32 tensor.

    Returns a dict with ``nums`` (int32, host), ``tot``, ``mlist`` (int64, host), ``offsetlist``
    (int32, host), ``max_num_programs``, and ``batch_ptr`` / ``token_chunk_offset_ptr`` (int32, on
    ``device``, ``-1`` after the first ``tot`` entries).
    """
    seqlens = query_start_loc_p_cpu.diff()
    nums = -(-seqlens // block_m)
    tot = int(nums.sum().item())
    mlist = torch.repeat_interleave(torch.arange(nums.shape[0], dtype=torch.int64), nums.to(torch.int64))
    pieces = [torch.arange(int(m), dtype=torch.int32) for m in nums.tolist()]
    offsetlist = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    max_programs = 2 * max(1024, mlist.shape[0])
    batch_ptr = torch.full((max_programs,), -1, dtype=torch.int32, device=device)
    offset_ptr = torch.full((max_programs,), -1, dtype=torch.int32, device=device)
    batch_ptr[: mlist.shape[0]].copy_(mlist)
    offset_ptr[: offsetlist.shape[0]].copy_(offsetlist)
    return {
        "nums": nums,
        "tot": tot,
        "mlist": mlist,
        "offsetlist": offsetlist,
        "max_num_programs": max_programs,
        "batch_ptr": batch_ptr,
        "token_chunk_offset_ptr": offset_ptr,
    }


def ref_mamba_state_indices(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mamba_block_size: int,
    mode: str,
    num_state_columns: int,
) -> torch.Tensor:
    """``mamba_get_block_table_tensor`` with a torch gather on the device block table."""
    num_rows = seq_lens.shape[0]
    table = block_table[:num_rows]
    if mode == "none":
        return table[:, :num_state_columns].contiguous()
    start = torch.clamp(
        torch.div(seq_lens.to(torch.int64) - 1, mamba_block_size, rounding_mode="floor"), min=0
    )
    cols = start[:, None] + torch.arange(num_state_columns, device=seq_lens.device)[None, :]
    return torch.gather(table, 1, cols)


def ref_classify_mamba_rows(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_upper_bound_cpu: torch.Tensor,
    is_prefilling_cpu: torch.Tensor,
    num_decode_draft_tokens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool]:
    """The prefill -> decode moves of 6.3 step 3 with torch boolean algebra on host tensors."""
    qh = query_start_loc_cpu.diff()
    stateful = is_prefilling_cpu & (seq_lens_upper_bound_cpu > qh)
    move = stateful & (qh == 1)
    if num_decode_draft_tokens_cpu is not None:
        drafts = num_decode_draft_tokens_cpu
        move = move | (stateful & (drafts >= 0) & (qh == drafts + 1))
    moved = bool(torch.any(move).item())
    result = is_prefilling_cpu.clone()
    if moved:
        result[move] = False
    return result, moved


def ref_prefill_checkpoints(
    seq_lens_upper_bound_p: torch.Tensor,
    query_lens_p: torch.Tensor,
    block_table_p: torch.Tensor | None,
    *,
    config: Any,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The 6.8 checkpoint rules as a per-row Python loop, then vLLM's device ``where``/gather.

    ``config`` is an :class:`attnmeta.host.mamba.CheckpointConfig` (read by attribute). Returns
    ``None`` when every offset is 0, else ``(offsets int32, cols int64, state_indices int32 or None)``
    on ``device``.
    """
    hb = config.hash_block_size
    hit = config.cache_hit_alignment_tokens
    bs = config.mamba_block_size
    align = config.checkpoint_alignment
    offsets: list[int] = []
    cols: list[int] = []
    for s, q in zip(seq_lens_upper_bound_p.tolist(), query_lens_p.tolist()):
        qs = s - q
        lim = s if config.drop_eagle_block else s - max(1, config.num_hash_lookahead_tokens)
        pos = (lim // hit) * hit
        if config.drop_eagle_block:
            pos -= hit
        pos = max(pos, 0)
        col = _cdiv(s, bs) - 2
        valid = (
            align is not None
            and qs % hb == 0
            and col > (qs - 1) // bs
            and qs + hb <= pos
            and qs < pos < s
            and (pos - qs) % align == 0
        )
        offsets.append(pos - qs if valid else 0)
        cols.append(col if valid else -1)
    if not any(offsets):
        return None
    off_t = torch.tensor(offsets, dtype=torch.int32, device=device)
    cols_t = torch.tensor(cols, dtype=torch.int64, device=device)
    if block_table_p is None:
        return off_t, cols_t, None
    rows_t = torch.arange(len(cols), dtype=torch.int64, device=device)
    table = block_table_p.to(device)
    state = torch.where(cols_t >= 0, table[rows_t, cols_t], 0)
    return off_t, cols_t, state



def ref_mamba_block_table(
    spec: BatchSpec,
    *,
    num_state_columns: int,
    mamba_block_size: int,
    mode: str,
    checkpoint: Any = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The Mamba group's block table as vLLM's runner holds it, uploaded to ``device``: (B, W) int32.

    Rows ``[0, num_reqs)`` are the spec's rows, padding rows are zeros. vLLM's persistent table is
    ``max_num_blocks_per_req`` wide, and the blocks a request does not hold read as 0 (the null
    block); here the spec's columns are followed by zero columns as far as any gather of the builder
    reads: the state columns ``start_i .. start_i + num_state_columns - 1`` of every real row
    (``start_i = max((s_i - 1) // mamba_block_size, 0)`` in ``"align"`` mode with ``s_i`` the exact
    sequence length, else 0) and, with a ``checkpoint`` config, the checkpoint column
    ``cdiv(u_i, mamba_block_size) - 2`` of every real row's upper-bound length ``u_i``.
    """
    n, B = spec.num_reqs, spec.padded_num_reqs
    width = spec.block_table.shape[1]
    last = num_state_columns - 1  # the last column a row reads, over every real row
    for i in range(n):
        s = int(spec.num_computed_tokens[i]) + int(spec.num_scheduled_tokens[i])
        start = max((s - 1) // mamba_block_size, 0) if mode == "align" else 0
        last = max(last, start + num_state_columns - 1)
        if checkpoint is not None:
            u = s if spec.seq_lens_upper_bound is None else int(spec.seq_lens_upper_bound[i])
            last = max(last, _cdiv(u, mamba_block_size) - 2)
    table = torch.zeros((B, max(width, last + 1)), dtype=torch.int32)
    table[:n, :width] = torch.tensor(np.array(spec.block_table[:n], dtype=np.int32))
    return table.to(device)


def _padded(x: np.ndarray, rows: int, value: int) -> np.ndarray:
    out = np.full(rows, value, dtype=x.dtype)
    out[: x.shape[0]] = x
    return out


def ref_mamba_metadata(
    spec: BatchSpec, options: Any, device: torch.device | str, *, num_accepted_tokens: npt.ArrayLike | None = None
) -> dict[str, Any]:
    """Every Mamba2 (or Mamba1) metadata field the way vLLM 0.33.0's builder computes it, from device
    tensors (syncs and all): the oracle of :mod:`attnmeta.backends.mamba`.

    The runner's host tensors (query starts, upper-bound lengths, prefill flags, draft counts) drive
    the classification and split on the host, as vLLM's do; the state indices are gathered from the
    *device* block table with the *device* ``seq_lens``; ``has_initial_states_p`` and
    ``query_start_loc_p`` are computed on the device; the causal-conv1d metadata, the checkpoints and
    the chunk layout by their reference loops. ``options`` is a ``Mamba2Options`` or ``Mamba1Options``
    (read by attribute; Mamba1: threshold 1, no chunk fields).

    Returns a dict by metadata field name: device fields as tensors on ``device`` (or None), the host
    scalars, ``conv1d_nums_cpu`` / ``conv1d_mlist_cpu`` / ``conv1d_offsetlist_cpu`` (CPU tensors, or
    None), and ``checkpoint_meta`` (None or a dict of ``offsets`` / ``cols`` / ``state_indices``
    tensors and ``first_row``).
    """
    from attnmeta.testing.reference.layout import (
        ref_is_prefilling,
        ref_num_decode_draft_tokens,
        ref_prefill_cpu_metadata,
        ref_query_start_loc,
        ref_seq_lens,
        ref_split_decodes_and_prefills,
    )

    B, T = spec.padded_num_reqs, spec.padded_num_tokens
    c, q = spec.num_computed_tokens, spec.num_scheduled_tokens
    k = getattr(options, "num_speculative_tokens", 0)
    C = getattr(options, "chunk_size", None)
    ckpt_cfg = getattr(options, "checkpoint", None)
    bs_m = options.mamba_block_size or spec.block_size
    # the runner's host tensors (CAM *_cpu fields)
    qsl_cpu = ref_query_start_loc(torch.tensor(q), B)
    ub = spec.seq_lens_upper_bound if spec.seq_lens_upper_bound is not None else c + q
    ub_cpu = torch.tensor(_padded(ub.astype(np.int32), B, 0))
    if spec.num_prompt_tokens is not None:
        isp_cpu = ref_is_prefilling(torch.tensor(c), torch.tensor(spec.num_prompt_tokens), B)
    else:
        isp_cpu = torch.zeros(B, dtype=torch.bool)
    drafts_cpu = None
    if spec.num_draft_tokens is not None or k > 0:  # the runner fills the counts every step of spec decode
        prompt = None if spec.num_prompt_tokens is None else torch.tensor(spec.num_prompt_tokens)
        scheduled_drafts = (np.zeros(len(q), np.int32) if spec.num_draft_tokens is None
                            else spec.num_draft_tokens.copy())
        drafts_cpu = ref_num_decode_draft_tokens(torch.tensor(q), torch.tensor(scheduled_drafts),
                                                 torch.tensor(c), prompt, B)
    # the runner's device tensors (CAM device fields), uploaded
    qsl = ref_query_start_loc(torch.tensor(q).to(device), B)
    seq_lens = ref_seq_lens(torch.tensor(c).to(device), torch.tensor(q).to(device), B)
    table = ref_mamba_block_table(spec, num_state_columns=1 + k, mamba_block_size=bs_m, mode=options.cache_mode,
                                  checkpoint=ckpt_cfg, device=device)

    # classification and split, on the host
    thr = 1 + k
    isp2, _ = ref_classify_mamba_rows(qsl_cpu, ub_cpu, isp_cpu, drafts_cpu if k > 0 else None)
    D, P, Dt, Pt = ref_split_decodes_and_prefills(qsl_cpu, T, spec.max_query_len, thr, False, False, isp2)
    # state indices from the device block table and device seq_lens
    si = ref_mamba_state_indices(table, seq_lens, mamba_block_size=bs_m, mode=options.cache_mode,
                                 num_state_columns=1 + k)
    out: dict[str, Any] = {
        "num_decodes": D, "num_prefills": P, "num_decode_tokens": Dt, "num_prefill_tokens": Pt, "num_reqs": B,
        "state_indices_tensor_d": si[:D, : 1 + k], "state_indices_tensor_p": si[D:, 0],
        "seq_lens": seq_lens, "query_start_loc_d": None, "num_accepted_tokens": None,
        "has_initial_states_p": None, "query_start_loc_p": None, "batch_ptr": None, "token_chunk_offset_ptr": None,
        "conv1d_nums_cpu": None, "conv1d_mlist_cpu": None, "conv1d_offsetlist_cpu": None,
        "conv1d_num_programs_total": 0, "conv1d_max_num_programs": 0, "num_computed_tokens_p_cpu": None,
    }
    if C is not None:
        out.update(prep_initial_states=False, chunk_size=C, num_chunks=0, cu_chunk_seqlen_p=None, seq_idx_p=None,
                   last_chunk_indices_p=None, checkpoint_chunk_idx=None, checkpoint_meta=None, chunk_indices_p=None,
                   chunk_offsets_p=None, token_seq_idx_p=None)
    # spec decode
    if D > 0 and k > 0:
        qsl_d = qsl[: D + 1]
        out["query_start_loc_d"] = qsl_d
        if num_accepted_tokens is None:
            out["num_accepted_tokens"] = torch.diff(qsl_d)
        else:
            full = torch.tensor(_padded(np.asarray(num_accepted_tokens, np.int32), B, 1)).to(device)
            out["num_accepted_tokens"] = full[:D]
    if P == 0:
        return out
    # prefills
    nc = seq_lens - torch.diff(qsl)
    out["query_start_loc_p"] = qsl[-P - 1 :] - Dt
    nc_p_cpu, qsl_p_cpu = ref_prefill_cpu_metadata(qsl_cpu, ub_cpu, B, P, Dt)
    out["num_computed_tokens_p_cpu"] = nc_p_cpu
    out["has_initial_states_p"] = nc[B - P : B] > 0
    if options.needs_causal_conv1d_metadata:
        conv = ref_causal_conv1d_metadata(qsl_cpu[-P - 1 :] - Dt, device=device)
        out.update(batch_ptr=conv["batch_ptr"], token_chunk_offset_ptr=conv["token_chunk_offset_ptr"],
                   conv1d_nums_cpu=conv["nums"], conv1d_mlist_cpu=conv["mlist"],
                   conv1d_offsetlist_cpu=conv["offsetlist"], conv1d_num_programs_total=conv["tot"],
                   conv1d_max_num_programs=conv["max_num_programs"])
    if C is None:
        return out
    out["prep_initial_states"] = bool(torch.any(nc_p_cpu > 0).item())
    offsets = None
    if ckpt_cfg is not None:
        ck = ref_prefill_checkpoints(ub_cpu[B - P :], torch.diff(qsl_p_cpu), table[B - P :], config=ckpt_cfg,
                                     device=device)
        if ck is not None:
            out["checkpoint_meta"] = {"offsets": ck[0], "cols": ck[1], "state_indices": ck[2], "first_row": B - P}
            offsets = ck[0].cpu().tolist()
    cu, sidx, last, ckidx = ref_chunk_metadata(C, nc_p_cpu, qsl_p_cpu, offsets, device=device)
    out.update(cu_chunk_seqlen_p=cu, seq_idx_p=sidx, last_chunk_indices_p=last, num_chunks=int(sidx.shape[0]),
               checkpoint_chunk_idx=ref_checkpoint_chunk_index(ckidx.cpu().tolist(), device=device))
    if options.logical_chunks:
        out["chunk_indices_p"], out["chunk_offsets_p"] = ref_logical_chunks(out["query_start_loc_p"], C)
    if options.token_seq_idx:
        out["token_seq_idx_p"] = ref_token_seq_idx(out["query_start_loc_p"], num_tokens_padded=Pt,
                                                   consecutive=options.consecutive_seq_ids)
    return out


def ref_linear_attn_metadata(spec: BatchSpec, options: Any, device: torch.device | str) -> dict[str, Any]:
    """The linear-attention fields the way vLLM 0.33.0 computes them: the plain split at threshold 1
    on the host query starts, the common ``query_start_loc`` / ``seq_lens``, and column 0 of the
    state indices of every row gathered from the device block table (``options``: a
    ``LinearAttentionOptions``, read by attribute)."""
    from attnmeta.testing.reference.layout import (
        ref_query_start_loc,
        ref_seq_lens,
        ref_split_decodes_and_prefills,
    )

    B = spec.padded_num_reqs
    c, q = spec.num_computed_tokens, spec.num_scheduled_tokens
    qsl = ref_query_start_loc(torch.tensor(q).to(device), B)
    seq_lens = ref_seq_lens(torch.tensor(c).to(device), torch.tensor(q).to(device), B)
    bs_m = options.mamba_block_size or spec.block_size
    table = ref_mamba_block_table(spec, num_state_columns=1, mamba_block_size=bs_m, mode=options.cache_mode,
                                  device=device)
    si = ref_mamba_state_indices(table, seq_lens, mamba_block_size=bs_m, mode=options.cache_mode, num_state_columns=1)
    nd, np_, ndt, npt = ref_split_decodes_and_prefills(qsl.cpu(), spec.padded_num_tokens, spec.max_query_len, 1)
    return {"num_decodes": nd, "num_prefills": np_, "num_decode_tokens": ndt, "num_prefill_tokens": npt,
            "query_start_loc": qsl, "seq_lens": seq_lens, "state_indices_tensor": si[:, 0]}


from attnmeta.testing._oracle import mark_oracles as _mark_oracles  # noqa: E402

_mark_oracles(globals(), __all__)
