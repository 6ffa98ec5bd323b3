"""Device-side reference implementations (MLA); see :mod:`attnmeta.testing.reference`.

Straightforward transcriptions of vLLM 0.33.0's MLA formulas: ``plan_mla_context_chunks`` and the
flattening of ``build_mla_chunked_context_metadata`` over Python lists read from device tensors with
``.tolist()``, uploads with ``torch.tensor(..., device=...)``, the decode/prefill slices and DCP bounds
as device arithmetic. Obviously correct, synchronisations and all; never use them on a serving path.

Shape legend
------------
- ``num_prefills``: prefill rows; ``num_pieces``, ``num_cu``: as in :mod:`attnmeta.host.mla`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attnmeta.testing.reference.layout import ref_common_fields, ref_split_decodes_and_prefills

__all__ = ["ref_mla_context_chunks", "ref_mla_decode_threshold", "ref_mla_fields", "ref_mla_row_requests"]

#: Each decode builder's class-level ``reorder_batch_threshold`` in vLLM 0.33.0.
_REF_CLASS_THRESHOLD = {"flashmla": 128, "flashattn_mla": 512, "flashinfer_mla": 1, "triton_mla": 1}


def ref_mla_decode_threshold(variant: str, num_speculative_tokens: int, dcp_world_size: int,
                             dcp_interleave: int) -> int:
    """vLLM's ``_init_reorder_batch_threshold`` for an MLA decode builder, written out.

    The class threshold (FlashMLA 128, FlashAttn-MLA 512, FlashInfer-MLA 1, Triton-MLA 1); with ``k``
    speculative tokens (every variant here supports spec as decode) ``max(threshold, 1 + k)``; with DCP
    ``> 1`` it drops to 1 unless the builder supports DCP with varlen queries (FlashInfer-MLA always,
    FlashAttn-MLA with ``cp_kv_cache_interleave_size == 1``).

    Parameters
    ----------
    variant : str
        ``"flashmla"``, ``"flashattn_mla"``, ``"flashinfer_mla"`` or ``"triton_mla"``.
    num_speculative_tokens : int
        Draft tokens ``k`` per request.
    dcp_world_size, dcp_interleave : int
        The DCP layout.

    Returns
    -------
    int
        The decode threshold.

    Examples
    --------
    >>> ref_mla_decode_threshold("flashmla", 0, 1, 1), ref_mla_decode_threshold("triton_mla", 2, 1, 1)
    (128, 3)
    >>> ref_mla_decode_threshold("flashattn_mla", 0, 2, 1), ref_mla_decode_threshold("flashattn_mla", 0, 2, 2)
    (512, 1)
    """
    thr = _REF_CLASS_THRESHOLD[variant]
    if num_speculative_tokens > 0:
        thr = max(thr, 1 + num_speculative_tokens)
    varlen_dcp = variant == "flashinfer_mla" or (variant == "flashattn_mla" and dcp_interleave == 1)
    if dcp_world_size > 1 and not varlen_dcp:
        thr = 1
    return thr


def ref_mla_context_chunks(
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    workspace_size: int,
    block_size: int,
    align_chunk_to_block: bool = True,
    dcp_world_size: int = 1,
    dcp_interleave: int = 1,
    align_indptr: bool = False,
) -> dict[str, Any] | None:
    """vLLM's chunk plan and flat fields, from device tensors (``.tolist()``), uploaded with ``torch.tensor``.

    Parameters
    ----------
    context_lens : (num_prefills,) int32, any device
        Context of each prefill row.
    query_start_loc : (num_prefills + 1,) int32, any device
        Prefill-local query starts.
    workspace_size, block_size, align_chunk_to_block, dcp_world_size, dcp_interleave, align_indptr
        As :func:`attnmeta.host.mla.plan_context_chunks`.

    Returns
    -------
    dict or None
        Flat device tensors (``starts``, ``seq_lens``, ``cu_seq_lens``, ``cu_seqlens_q``,
        ``token_to_seq``, DCP ``padded_local_*`` and ``local_context_lens_allranks``) plus a host list
        ``chunks`` of per-chunk dicts; None when no row has context.
    """
    dev = context_lens.device
    ctx = [int(x) for x in context_lens.tolist()]
    qsl = [int(x) for x in query_start_loc.tolist()]
    if max(ctx, default=0) <= 0:
        return None
    W, inter = dcp_world_size, dcp_interleave
    V = W * inter
    align = block_size if align_chunk_to_block else 1
    budget = workspace_size
    if W > 1:
        align = math.lcm(align, V)
        budget = workspace_size // W

    def padded_rows(x: int) -> int:
        return x if W <= 1 else -(-x // V) * inter

    max_chunk = workspace_size // align * align
    plans: list[tuple[int, list[int], list[int]]] = []  # (first row, starts, lengths)
    r = start = 0
    P = len(ctx)
    while r < P:
        if ctx[r] == 0:
            r += 1
            continue
        first, starts, lens, used = r, [], [], 0
        while r < P and ctx[r] > 0:
            remaining = ctx[r] - start
            need = padded_rows(start + remaining) - padded_rows(start)
            if used + need > budget:
                best = 0
                cap = min(max_chunk, (remaining - 1) // align * align)
                for L in range(align, cap + 1, align):  # linear scan instead of vLLM's bisection
                    if padded_rows(start + L) - padded_rows(start) <= budget - used:
                        best = L
                if best > 0:
                    starts.append(start)
                    lens.append(best)
                    start += best
                break
            starts.append(start)
            lens.append(remaining)
            used += need
            r += 1
            start = 0
        assert lens
        plans.append((first, starts, lens))
    starts_flat: list[int] = []
    seq_flat: list[int] = []
    cu_flat: list[int] = []
    cuq_flat: list[int] = []
    tok_parts: list[torch.Tensor] = []
    lcu_flat: list[int] = []
    llen_flat: list[int] = []
    ltok_parts: list[torch.Tensor] = []
    chunks: list[dict[str, Any]] = []
    for idx, (first, starts, lens) in enumerate(plans):
        n = len(lens)
        if align_indptr:
            pad = (-len(cu_flat)) % 4
            cu_flat += [0] * pad
            cuq_flat += [0] * pad
            if W > 1:
                lcu_flat += [0] * pad
        cu_off = len(cu_flat)
        seq_flat += lens
        cu_flat += [0, *torch.cumsum(torch.tensor(lens), 0).tolist()]
        cuq_flat += [qsl[j] - qsl[first] for j in range(first, first + n + 1)]
        tok_parts.append(torch.repeat_interleave(torch.arange(n, dtype=torch.int32), torch.tensor(lens)))
        local_tokens = sum(lens)
        if W > 1:
            lst = [padded_rows(s) for s in starts]
            llen = [padded_rows(s + ln) - ls for s, ln, ls in zip(starts, lens, lst, strict=True)]
            lcu_flat += [0, *torch.cumsum(torch.tensor(llen), 0).tolist()]
            llen_flat += llen
            ltok_parts.append(torch.repeat_interleave(torch.arange(n, dtype=torch.int32), torch.tensor(llen)))
            starts_flat += lst
            local_tokens = sum(llen)
            assert local_tokens <= budget
        else:
            starts_flat += starts
        qs = [qsl[j + 1] - qsl[j] for j in range(first, first + n)]
        chunks.append({
            "index": idx, "request_slice": slice(first, first + n), "token_slice": slice(qsl[first], qsl[first + n]),
            "continuation_token_end": qsl[first + 1], "is_continuation": starts[0] > 0,
            "num_context_tokens": sum(lens), "num_local_context_tokens": local_tokens, "max_query_len": max(qs),
            "max_seq_len": max(lens), "all_rows_active": all(q > 0 for q in qs) and all(ln > 0 for ln in lens),
            "cu_offset": cu_off,
        })
    out: dict[str, Any] = {
        "context_lens": torch.tensor(ctx, dtype=torch.int32, device=dev),
        "starts": torch.tensor(starts_flat, dtype=torch.int32, device=dev),
        "seq_lens": torch.tensor(seq_flat, dtype=torch.int32, device=dev),
        "cu_seq_lens": torch.tensor(cu_flat, dtype=torch.int32, device=dev),
        "cu_seqlens_q": torch.tensor(cuq_flat, dtype=torch.int32, device=dev),
        "token_to_seq": torch.cat(tok_parts).to(dev),
        "chunks": chunks,
        "empty_token_slices": [(qsl[i], qsl[i + 1]) for i in range(P) if ctx[i] == 0],
    }
    if W > 1:
        ranks = torch.arange(W, device=dev)
        c = out["context_lens"].long()[:, None]
        base = c // V * inter
        extra = (c - base * W - ranks[None, :] * inter).clamp(0, inter)  # get_dcp_local_seq_lens
        out["local_context_lens_allranks"] = (base + extra).to(torch.int32)
        out["padded_local_seq_lens"] = torch.tensor(llen_flat, dtype=torch.int32, device=dev)
        out["padded_local_cu_seq_lens"] = torch.tensor(lcu_flat, dtype=torch.int32, device=dev)
        out["padded_local_token_to_seq"] = torch.cat(ltok_parts).to(dev)
    return out


def ref_mla_row_requests(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """FlashInfer-MLA's ``row_req`` on the device: ``searchsorted(qsl[1:], t, right=True)`` clamped to D-1.

    Parameters
    ----------
    query_start_loc : (D + 1,) int32, any device
        Decode query starts.
    num_rows : int
        Flattened rows.

    Returns
    -------
    (num_rows,) int64, on ``query_start_loc``'s device.
    """
    t = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    d = query_start_loc.shape[0] - 1
    return torch.searchsorted(query_start_loc[1:].contiguous(), t, right=True).clamp(max=d - 1)


def ref_mla_fields(spec: Any, options: Any, device: torch.device | str) -> dict[str, Any]:
    """The MLA builder's fields of ``spec`` the way vLLM 0.33.0's ``MLACommonMetadataBuilder.build`` computes them.

    Parameters
    ----------
    spec : BatchSpec
        The step.
    options : MLAOptions
        The builder's options.
    device : torch.device or str
        Where to compute.

    Returns
    -------
    dict
        Field name -> expected value (device tensors, ints), for :func:`attnmeta.testing.check_builder`.
    """
    f = ref_common_fields(spec, device)
    qsl, seq = f["query_start_loc"], f["seq_lens"]
    B, T = spec.padded_num_reqs, spec.padded_num_tokens
    thr = ref_mla_decode_threshold(options.variant, options.num_speculative_tokens, options.dcp_world_size,
                                   options.dcp_interleave)
    causal = options.causal is not False
    if causal:
        D, P, Dt, Pt = ref_split_decodes_and_prefills(qsl, T, spec.max_query_len, thr,
                                                      options.variant in ("flashmla", "triton_mla"))
    else:
        D, P, Dt, Pt = B, 0, T, 0
    W, inter = options.dcp_world_size, options.dcp_interleave
    max_seq_len = spec.max_seq_len
    dec_seq = seq[:D]
    out: dict[str, Any] = {}
    if W > 1:
        s = dec_seq.long()
        base = s // (W * inter) * inter
        dec_seq = (base + (s - base * W - options.dcp_rank * inter).clamp(0, inter)).to(torch.int32)
        out["decode_dcp_tot_seq_lens"] = seq[:D]
        if D > 0:
            max_seq_len = -(-max_seq_len // (W * inter)) * inter
    q = qsl[1:] - qsl[:-1]
    if options.variant in ("flashmla", "flashattn_mla"):
        dec_mq = int(q[:D].max().item()) if D else 0
    else:
        dec_mq = min(spec.max_query_len, thr)
    if not causal and options.variant == "flashinfer_mla" and D > 0:
        rr = ref_mla_row_requests(qsl[: D + 1], Dt)
        out["decode_row_req"] = rr
        out["decode_flattened_seq_lens"] = dec_seq[rr]
    out["num_kv_splits"] = 0
    if options.variant == "triton_mla":
        n = max(1, max_seq_len // 512)
        out["num_kv_splits"] = min(1 << (n - 1).bit_length(), 2 * options.num_sms)
    pqsl = qsl[D:] - qsl[D]
    ctx = (seq[D:] - q[D:]).to(torch.int32)
    chunks = ref_mla_context_chunks(ctx, pqsl, workspace_size=options.workspace_size, block_size=spec.block_size,
                                    align_chunk_to_block=options.align_chunk_to_block, dcp_world_size=W,
                                    dcp_interleave=inter, align_indptr=options.align_indptr) if P else None
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    get = (lambda k: chunks[k]) if chunks is not None else (lambda k: empty)
    out.update({
        "query_start_loc": qsl, "seq_lens": seq, "slot_mapping": f["slot_mapping"],
        "decode_query_start_loc": qsl[: D + 1], "decode_seq_lens": dec_seq,
        "num_reqs": B, "num_actual_tokens": T, "max_query_len": spec.max_query_len, "max_seq_len": max_seq_len,
        "num_decodes": D, "num_prefills": P, "num_decode_tokens": Dt, "num_prefill_tokens": Pt,
        "causal": causal, "decode_threshold": thr, "decode_max_query_len": dec_mq,
        "prefill_max_query_len": spec.max_query_len if P else 0,
        "prefill_query_start_loc": pqsl, "prefill_query_lens_cpu": q[D:], "context_lens": ctx,
        "chunk_starts": get("starts"), "chunk_seq_lens_cpu": get("seq_lens"), "chunk_cu_seq_lens": get("cu_seq_lens"),
        "chunk_cu_seqlens_q": get("cu_seqlens_q"), "chunk_token_to_seq": get("token_to_seq"),
        "num_chunks": len(chunks["chunks"]) if chunks is not None else 0,
    })
    if W > 1:
        out["chunk_padded_local_cu_seq_lens"] = get("padded_local_cu_seq_lens")
        out["chunk_padded_local_token_to_seq"] = get("padded_local_token_to_seq")
    return out
