"""Device-side reference implementations (attention); see :mod:`attnmeta.testing.reference`.

Straightforward torch transcriptions of the attention-backend metadata, the way engines computed it
on device tensors: FlashInfer's paged-KV arrays (the pre-Triton boolean-mask gather, a ``nonzero``
sync), the fast-prefill ``query_start_loc`` (``bucketize`` + ``scatter_add_`` + ``cumsum``), the
chunked-local-attention virtual batch (the docs/semantics-attention.md, "LocalAttentionMetadata (chunked local attention)" formulas on tensors, with
``repeat_interleave``), the cascade arrays and the DCP context lengths. Obviously correct,
synchronisations and all; never use them on a serving path.

Every function takes tensors on any device and returns tensors on that device with vLLM's dtypes, so
tests compare host results against them bit for bit
(:func:`attnmeta.testing.assertions.assert_matches_device`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "RefLocalBatches",
    "ref_cascade_arrays",
    "ref_dcp_context_kv_lens",
    "ref_fast_prefill_query_start_loc",
    "ref_local_virtual_batches",
    "ref_max_logits_per_req",
    "ref_pad_logits_indices",
    "ref_paged_kv_indices",
    "ref_paged_kv_indptr",
    "ref_paged_kv_last_page_len",
    "ref_use_cascade_attention",
]


def _cdiv_t(x: torch.Tensor, d: int) -> torch.Tensor:
    return -(-x // d)


# ------------------------------------------------------------------------------------------------
# FlashInfer paged KV (docs/semantics-attention.md, "FlashInferMetadata")
# ------------------------------------------------------------------------------------------------


def ref_paged_kv_indptr(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[0, cumsum(cdiv(seq_lens, page_size))]`` as an int32 tensor on ``seq_lens.device``."""
    nblk = _cdiv_t(seq_lens.to(torch.int64), page_size)
    out = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    if nblk.numel():
        torch.cumsum(nblk, dim=0, out=out[1:])
    return out


def ref_paged_kv_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The old boolean-mask gather: ``block_table[:, :max_blocks][arange(max_blocks) < nblk[:, None]]``.

    Reads the first ``len(seq_lens)`` rows of ``block_table``; the mask makes it a ``nonzero`` (a sync
    on CUDA). Returns int32 of length ``sum(nblk)``.
    """
    num_reqs = seq_lens.shape[0]
    nblk = _cdiv_t(seq_lens.to(torch.int64), page_size)
    max_blocks = int(nblk.max().item()) if num_reqs else 0
    table = block_table[:num_reqs, :max_blocks]
    mask = torch.arange(max_blocks, device=block_table.device)[None, :] < nblk[:, None]
    return table[mask].to(torch.int32)


def ref_paged_kv_last_page_len(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``where(s % page == 0 & s != 0, page, s % page)`` as int32 on ``seq_lens.device``."""
    rem = seq_lens % page_size
    full = torch.full_like(rem, page_size)
    return torch.where((rem == 0) & (seq_lens != 0), full, rem).to(torch.int32)


# ------------------------------------------------------------------------------------------------
# KV-sharing fast prefill (docs/semantics-attention.md, "FastPrefillMetadata (KV-sharing fast prefill)")
# ------------------------------------------------------------------------------------------------


def ref_fast_prefill_query_start_loc(
    query_start_loc: torch.Tensor, logits_indices: torch.Tensor
) -> torch.Tensor:
    """vLLM 0.33.0's device ``dqsl``: ``bucketize(li, qsl[1:], right=True)``, ``scatter_add_``, ``cumsum``.

    Same dtype and device as ``query_start_loc``; the first element is set with a slice ``fill_``.
    """
    num_reqs = query_start_loc.shape[0] - 1
    rid = torch.bucketize(logits_indices, query_start_loc[1:], right=True)
    counts = torch.zeros(num_reqs, dtype=torch.int64, device=query_start_loc.device)
    counts.scatter_add_(0, rid.to(torch.int64), torch.ones_like(rid, dtype=torch.int64))
    out = torch.empty(num_reqs + 1, dtype=query_start_loc.dtype, device=query_start_loc.device)
    out[:1].fill_(0)
    if num_reqs:
        torch.cumsum(counts, dim=0, out=out[1:])
    return out


def ref_max_logits_per_req(fast_query_start_loc: torch.Tensor) -> int:
    """``int((qsl'[1:] - qsl'[:-1]).max().item())`` (0 for no rows): the old ``.item()`` sync."""
    if fast_query_start_loc.shape[0] < 2:
        return 0
    return int((fast_query_start_loc[1:] - fast_query_start_loc[:-1]).max().item())


def ref_pad_logits_indices(logits_indices: torch.Tensor, num_padded: int) -> torch.Tensor:
    """The runner's persistent int32 buffer: ``[:L] = li``, ``[L:num_padded] = li[-1]`` (old ``.item()``)."""
    num_logits = logits_indices.shape[0]
    buf = torch.empty(num_padded, dtype=torch.int32, device=logits_indices.device)
    buf[:num_logits].copy_(logits_indices)
    buf[num_logits:].fill_(logits_indices[-1].item())
    return buf


# ------------------------------------------------------------------------------------------------
# Chunked local attention (docs/semantics-attention.md, "LocalAttentionMetadata (chunked local attention)")
# ------------------------------------------------------------------------------------------------


class RefLocalBatches(NamedTuple):
    """Reference virtual batch: tensors on the input device, vLLM dtypes."""

    query_start_loc: torch.Tensor
    """(V + 1,) int32."""
    seq_lens: torch.Tensor
    """(V,) int32."""
    max_query_len: int
    max_seq_len: int
    num_virtual_reqs: int
    req_indices: torch.Tensor
    """(V,) int32."""
    block_starts: torch.Tensor
    """(V,) int32: ``kstart // block_size`` (``kstart`` clamped at 0 when ``clamp_negative_start``)."""
    block_table: torch.Tensor | None
    """(V, A / block_size) int32, or None."""


def ref_local_virtual_batches(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    attn_chunk_size: int,
    block_size: int,
    block_table: torch.Tensor | None = None,
    *,
    clamp_negative_start: bool = True,
) -> RefLocalBatches:
    """A literal tensor transcription of vLLM's ``make_local_attention_virtual_batches`` formulas.

    ``first = min(A - ((s - q) mod A), q)``, ``last = A + (s mod -A)``, ``nb = 1 + cdiv(q - first, A)``;
    per virtual row ``q_v``, ``k_v``, ``kstart_v`` as in docs/semantics-attention.md, "LocalAttentionMetadata (chunked local attention)"; block columns
    ``kstart // bs + arange(A / bs)`` clipped to at most ``W - 1`` and gathered with advanced indexing.

    With ``clamp_negative_start=False`` it is vLLM exactly: a padding row (``s == 0``) has
    ``kstart = -A`` and its negative columns wrap around to the end of the row. With ``True`` (the
    default) ``kstart`` is clamped at 0 first, attnmeta's documented deviation.
    """
    dev = query_start_loc.device
    a_size = attn_chunk_size
    assert a_size % block_size == 0
    ppl = a_size // block_size
    q = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    s = seq_lens.to(torch.int64)
    first = torch.minimum(a_size - torch.remainder(s - q, a_size), q)
    last = a_size + torch.remainder(s, -a_size)
    nb = 1 + _cdiv_t(q - first, a_size)
    num_virtual = int(nb.sum().item())
    req = torch.repeat_interleave(torch.arange(q.shape[0], device=dev), nb)
    row_start = torch.cumsum(nb, 0) - nb
    a = torch.arange(num_virtual, device=dev) - row_start[req]
    ra = nb[req] - 1 - a
    later = torch.clamp(q[req] - first[req] - a_size * (a - 1), max=a_size)
    q_v = torch.where(a == 0, first[req], later)
    k_v = torch.where(ra == 0, last[req], torch.full_like(ra, a_size))
    kstart = s[req] - (ra * a_size + last[req])
    if clamp_negative_start:
        kstart = kstart.clamp(min=0)
    starts = kstart // block_size
    cu = torch.zeros(num_virtual + 1, dtype=torch.int32, device=dev)
    if num_virtual:
        cu[1:] = torch.cumsum(q_v, 0).to(torch.int32)
    table = None
    if block_table is not None:
        cols = (starts[:, None] + torch.arange(ppl, device=dev)[None, :]).clamp(max=block_table.shape[1] - 1)
        table = block_table[req[:, None], cols].to(torch.int32)
    return RefLocalBatches(
        query_start_loc=cu,
        seq_lens=k_v.to(torch.int32),
        max_query_len=int(q_v.max().item()) if num_virtual else 0,
        max_seq_len=int(k_v.max().item()) if num_virtual else 0,
        num_virtual_reqs=num_virtual,
        req_indices=req.to(torch.int32),
        block_starts=starts.to(torch.int32),
        block_table=table,
    )


# ------------------------------------------------------------------------------------------------
# Cascade (docs/semantics-attention.md, "FlashAttentionMetadata") and DCP (5.9)
# ------------------------------------------------------------------------------------------------


def ref_use_cascade_attention(
    common_prefix_len: int,
    query_lens: torch.Tensor,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    use_local_attention: bool,
    num_sms: int,
    dcp_world_size: int = 1,
) -> bool:
    """The pre-removal FlashAttention ``use_cascade_attention``, transcribed (``torch.all`` + ``bool``)."""
    if common_prefix_len < 256:
        return False
    if use_alibi or use_sliding_window or use_local_attention:
        return False
    num_reqs = query_lens.shape[0]
    if num_reqs < 8:
        return False
    if dcp_world_size > 1:
        return False
    per_kv = num_query_heads // num_kv_heads
    if not (per_kv > 1 and bool(torch.all(query_lens == 1))):
        return True
    tiles = -(-common_prefix_len // 128)
    cascade_waves = -(-(num_query_heads * -(-num_reqs // 128)) // num_sms)
    cascade_time = cascade_waves * tiles
    fd_ctas = num_reqs * num_kv_heads * -(-per_kv // 128) * tiles
    return cascade_time < -(-fd_ctas // num_sms)


def ref_cascade_arrays(
    common_prefix_len: int,
    seq_lens: torch.Tensor,
    num_tokens: int,
    block_size: int,
    block_table: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | int | None]:
    """The pre-removal builders' cascade tensors, made the way they were (``torch.tensor(list, device)``).

    Keys: ``cu_prefix_query_lens``, ``prefix_kv_lens``, ``suffix_kv_lens`` (FlashAttention),
    ``num_prefix_blocks``, ``shared_kv_page_indptr``, ``shared_kv_last_page_len``,
    ``shared_kv_page_indices`` (FlashInfer).
    """
    dev = seq_lens.device
    blocks = common_prefix_len // block_size
    return {
        "cu_prefix_query_lens": torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        "prefix_kv_lens": torch.tensor([common_prefix_len], dtype=torch.int32, device=dev),
        "suffix_kv_lens": seq_lens - common_prefix_len,
        "num_prefix_blocks": blocks,
        "shared_kv_page_indptr": torch.tensor([0, blocks], dtype=torch.int32, device=dev),
        "shared_kv_last_page_len": torch.tensor([block_size], dtype=torch.int32, device=dev),
        "shared_kv_page_indices": None if block_table is None else block_table[0, :blocks],
    }


def ref_dcp_context_kv_lens(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    dcp_world_size: int,
    dcp_rank: int,
    interleave: int = 1,
    *,
    num_decodes: int = 0,
) -> torch.Tensor:
    """FlashAttention's device DCP context: ``seq_lens - diff(qsl)``, then ``get_dcp_local_seq_lens``.

    With ``num_decodes > 0`` the leading rows keep their full ``seq_lens`` (FlashInfer's DCP host
    lengths). int32 on the input device.
    """
    context = seq_lens - (query_start_loc[1:] - query_start_loc[:-1])
    context = context.clone()
    context[:num_decodes] = seq_lens[:num_decodes]
    base = context // interleave // dcp_world_size * interleave
    remainder = context - base * dcp_world_size
    local = base + torch.clamp(remainder - dcp_rank * interleave, 0, interleave)
    return local.to(torch.int32)


from attnmeta.testing._oracle import mark_oracles as _mark_oracles  # noqa: E402

_mark_oracles(globals(), __all__)
