"""Device-side reference of the GDN builder: vLLM 0.33.0's ``GDNAttentionMetadataBuilder.build``
transcribed with torch on the device (host-mask gathers, ``repeat_interleave``, stable ``argsort``,
``cumsum``, ``.item()`` where vLLM reads host tensors), the oracle of
:class:`attnmeta.backends.mamba.gdn.GDNBuilder`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["ref_fla_chunk_metadata", "ref_gdn_metadata"]


def ref_fla_chunk_metadata(query_start_loc_cpu: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` as written upstream, on a host int32
    ``query_start_loc``: ``(N, 2)`` int32 and ``(P + 1,)`` int64 host tensors."""
    lens = query_start_loc_cpu.diff()
    n = -(-lens // chunk_size)
    pieces = [torch.arange(int(m)) for m in n.tolist()]
    indices = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    chunk_indices = torch.stack([indices.eq(0).cumsum(0) - 1, indices], 1).to(query_start_loc_cpu)
    chunk_offsets = torch.cat([query_start_loc_cpu.new_tensor([0]), n]).cumsum(-1)
    return chunk_indices, chunk_offsets


def ref_gdn_metadata(
    spec: Any, options: Any, device: torch.device | str, *, num_accepted_tokens: Any = None
) -> dict[str, Any]:
    """Every GDN field the way vLLM 0.33.0 computes it (``spec``: a ``BatchSpec``; ``options``: a
    ``GDNOptions``, read by attribute; ``num_accepted_tokens``: host int32 per real request or row)."""
    from attnmeta.testing.reference.layout import (
        ref_num_decode_draft_tokens,
        ref_query_start_loc,
        ref_seq_lens,
        ref_split_decodes_and_prefills,
    )
    from attnmeta.testing.reference.mamba import (
        ref_causal_conv1d_metadata,
        ref_mamba_block_table,
        ref_mamba_state_indices,
    )

    dev = torch.device(device)
    B, n, T = spec.padded_num_reqs, spec.num_reqs, spec.padded_num_tokens
    k = options.num_speculative_tokens
    c_np, q_np = spec.num_computed_tokens.copy(), spec.num_scheduled_tokens.copy()
    qsl = ref_query_start_loc(torch.tensor(q_np).to(dev), B)
    seq_lens = ref_seq_lens(torch.tensor(c_np).to(dev), torch.tensor(q_np).to(dev), B)
    qsl_cpu = qsl.cpu()
    q_cpu = qsl_cpu.diff()
    ub = torch.zeros(B, dtype=torch.int32)
    ub[:n] = torch.tensor((c_np + q_np) if spec.seq_lens_upper_bound is None else spec.seq_lens_upper_bound)
    is_pre = torch.zeros(B, dtype=torch.bool)
    if spec.num_prompt_tokens is not None:
        is_pre[:n] = torch.tensor(c_np < spec.num_prompt_tokens)
    drafts = None
    if spec.num_draft_tokens is not None or k > 0:  # the runner fills the counts every step of spec decode
        prompt = None if spec.num_prompt_tokens is None else torch.tensor(spec.num_prompt_tokens)
        scheduled = np.zeros(n, np.int32) if spec.num_draft_tokens is None else spec.num_draft_tokens.copy()
        drafts = ref_num_decode_draft_tokens(torch.tensor(q_np), torch.tensor(scheduled),
                                             torch.tensor(c_np), prompt, B)
    bs_m = options.mamba_block_size or spec.block_size
    table = ref_mamba_block_table(spec, num_state_columns=k + 1, mamba_block_size=bs_m, mode=options.cache_mode,
                                  device=dev)
    bt = ref_mamba_state_indices(table, seq_lens, mamba_block_size=bs_m, mode=options.cache_mode,
                                 num_state_columns=k + 1)
    acc_dev = None
    if num_accepted_tokens is not None:
        a = torch.ones(B, dtype=torch.int32)
        given = torch.tensor(np.asarray(num_accepted_tokens, np.int32))
        a[: given.shape[0]] = given
        acc_dev = a.to(dev)

    spec_mask_cpu = spec_masks = None
    if k > 0 and drafts is not None:
        spec_mask_cpu = drafts >= 0
        if int(spec_mask_cpu.sum().item()) == 0:
            spec_mask_cpu = None
        else:
            spec_masks = spec_mask_cpu.to(dev)

    out: dict[str, Any] = dict.fromkeys((
        "spec_query_start_loc", "non_spec_query_start_loc", "spec_state_indices_tensor",
        "non_spec_state_indices_tensor", "spec_sequence_masks", "spec_token_indx", "non_spec_token_indx",
        "num_accepted_tokens", "has_initial_state", "prefill_query_start_loc", "prefill_state_indices",
        "prefill_has_initial_state", "chunk_indices", "chunk_offsets", "batch_ptr", "token_chunk_offset_ptr",
        "uniform_spec_sequence_length"))
    S = St = 0
    has_init = (seq_lens - qsl.diff()) > 0  # vLLM: device context lengths
    if spec_mask_cpu is None:
        no_prior = (q_cpu > 0) & (ub <= q_cpu) & is_pre
        D, P, Dt, Pt = ref_split_decodes_and_prefills(qsl_cpu, T, spec.max_query_len, 1, False, False, no_prior)
        if P > 0:
            P -= int((q_cpu[D:] == 0).sum().item())
            Pt = int(qsl_cpu[D + P].item()) - Dt
        ns_state, ns_qsl, ns_qsl_cpu = bt[:, 0], qsl, qsl_cpu
        out["non_spec_state_indices_tensor"], out["non_spec_query_start_loc"] = ns_state, ns_qsl
    else:
        S = int(spec_mask_cpu.sum().item())
        qs = q_cpu[spec_mask_cpu]
        out["uniform_spec_sequence_length"] = int(qs[0]) if qs[0] > 0 and bool((qs == qs[0]).all()) else None
        qn = q_cpu[~spec_mask_cpu]
        D = int((qn == 1).sum().item())
        Z = int((qn == 0).sum().item())
        P = qn.shape[0] - D - Z
        Dt = D
        Pt = int(qn.sum().item()) - Dt
        St = int(q_cpu.sum().item()) - Pt - Dt
        if D > 0:
            P, Pt, D, Dt = P + D, Pt + Dt, 0, 0
        acc = qsl.diff() if acc_dev is None else acc_dev
        out["spec_sequence_masks"] = spec_masks
        if P == 0 and D == 0:
            out["spec_token_indx"] = torch.arange(min(S * (k + 1), int(qsl_cpu[-1])), dtype=torch.int32, device=dev)
            out["non_spec_token_indx"] = torch.empty(0, dtype=torch.int32, device=dev)
            si, sq, na = bt[:S, : k + 1], qsl[: S + 1], acc[:S]
            mbs = options.cudagraph_max_bs
            if mbs is not None and mbs >= S and St <= mbs:  # _stage_spec_decode into persistent buffers
                buf_si = torch.empty((B, k + 1), dtype=torch.int32, device=dev)
                buf_si[:S].copy_(si)
                buf_si[S:].fill_(0)
                buf_q = torch.empty(B + 1, dtype=torch.int32, device=dev)
                buf_q[: S + 1].copy_(sq)
                buf_q[S + 1 :].fill_(sq[-1])
                buf_a = torch.empty(B, dtype=torch.int32, device=dev)
                buf_a[:S].copy_(na)
                buf_a[S:].fill_(1)
                masks = spec_masks.clone()  # type: ignore[union-attr]
                masks[S:] = False
                si, sq, na, out["spec_sequence_masks"] = buf_si, buf_q, buf_a, masks
            out["spec_state_indices_tensor"], out["spec_query_start_loc"], out["num_accepted_tokens"] = si, sq, na
        else:
            tok_mask = torch.repeat_interleave(spec_masks, qsl.diff(), output_size=int(qsl_cpu[-1]))  # type: ignore[arg-type]
            index = torch.argsort(tok_mask.to(torch.int8), stable=True)
            out["non_spec_token_indx"], out["spec_token_indx"] = index[: Pt + Dt], index[Pt + Dt :]
            out["spec_state_indices_tensor"] = bt[spec_mask_cpu.to(dev), : k + 1]
            ns_state = bt[(~spec_mask_cpu).to(dev), 0]
            out["non_spec_state_indices_tensor"] = ns_state
            qd = qsl.diff()
            sq = torch.zeros(S + 1, dtype=torch.int32, device=dev)
            torch.cumsum(qd[spec_mask_cpu.to(dev)], 0, out=sq[1:])
            ns_qsl = torch.zeros(B - S + 1, dtype=torch.int32, device=dev)
            torch.cumsum(qd[(~spec_mask_cpu).to(dev)], 0, out=ns_qsl[1:])
            ns_qsl_cpu = ns_qsl.cpu()
            out["spec_query_start_loc"], out["non_spec_query_start_loc"] = sq, ns_qsl
            out["num_accepted_tokens"] = acc[spec_mask_cpu.to(dev)]
            has_init = has_init[(~spec_mask_cpu).to(dev)]
    conv: dict[str, Any] | None = None
    if P > 0:
        if spec_mask_cpu is None and D > 0:
            p_qsl, p_qsl_cpu = ns_qsl[D:] - Dt, ns_qsl_cpu[D:] - Dt
            out["prefill_state_indices"], out["prefill_has_initial_state"] = ns_state[D:], has_init[D:]
        else:
            p_qsl, p_qsl_cpu = ns_qsl, ns_qsl_cpu
            out["prefill_state_indices"], out["prefill_has_initial_state"] = ns_state, has_init
        out["prefill_query_start_loc"], out["has_initial_state"] = p_qsl, has_init
        if options.prefill_backend == "triton":
            ci, co = ref_fla_chunk_metadata(p_qsl_cpu)
            out["chunk_indices"], out["chunk_offsets"] = ci.to(dev), co.to(dev)
        if options.needs_causal_conv1d_metadata:
            conv = ref_causal_conv1d_metadata(ns_qsl_cpu, device=dev)
            out["batch_ptr"], out["token_chunk_offset_ptr"] = conv["batch_ptr"], conv["token_chunk_offset_ptr"]
    out.update(num_prefills=P, num_prefill_tokens=Pt, num_decodes=D, num_decode_tokens=Dt, num_spec_decodes=S,
               num_spec_decode_tokens=St, num_actual_tokens=T, num_reqs=B,
               conv1d_num_programs_total=0 if conv is None else conv["tot"],
               conv1d_max_num_programs=0 if conv is None else conv["max_num_programs"])
    if conv is not None:
        out.update(conv1d_nums_cpu=conv["nums"], conv1d_mlist_cpu=conv["mlist"], conv1d_offsetlist_cpu=conv["offsetlist"])
    return out


from attnmeta.testing._oracle import mark_oracles as _mark_oracles  # noqa: E402

_mark_oracles(globals(), __all__)
