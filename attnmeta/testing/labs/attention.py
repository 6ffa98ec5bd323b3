"""Lab entries of the attention builders: FlashAttention, FlashInfer, cascade, fast prefill, local
attention (reference values from :mod:`attnmeta.testing.reference`, random and demo options)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnmeta.backends.cascade import CascadeInputs, CascadeOptions
from attnmeta.backends.fast_prefill import FastPrefillInputs, FastPrefillOptions
from attnmeta.backends.flash_attn import FlashAttentionInputs, FlashAttentionOptions
from attnmeta.backends.flashinfer import FlashInferOptions
from attnmeta.backends.local_attn import LocalAttentionOptions
from attnmeta.spec import BatchSpec
from attnmeta.testing.labs._entry import LabEntry, LeadingColumns
from attnmeta.testing.reference.attention import (
    ref_cascade_arrays,
    ref_dcp_context_kv_lens,
    ref_fast_prefill_query_start_loc,
    ref_local_virtual_batches,
    ref_max_logits_per_req,
    ref_pad_logits_indices,
    ref_paged_kv_indices,
    ref_paged_kv_indptr,
    ref_paged_kv_last_page_len,
    ref_use_cascade_attention,
)
from attnmeta.testing.reference.layout import (
    ref_block_table,
    ref_common_fields,
    ref_split_decodes_and_prefills,
    ref_split_decodes_prefills_and_extends,
)

__all__ = ["ENTRIES"]


# ------------------------------------------------------------------------------------------------
# FlashAttention


def flash_attn_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[FlashAttentionOptions, Any]:
    """DCP on half the draws (world size 2, a random rank), else per-request causal flags."""
    if rng.random() < 0.5:
        return FlashAttentionOptions(dcp_world_size=2, dcp_rank=int(rng.integers(0, 2))), None
    return FlashAttentionOptions(), FlashAttentionInputs(causal=rng.random(spec.num_reqs) < 0.7)


def flash_attn_reference(spec: BatchSpec, options: FlashAttentionOptions, device: torch.device,
                         inputs: FlashAttentionInputs) -> dict[str, Any]:
    """The common fields it passes on, the step's maxima, vLLM 0.33.0's FlashAttention counts: none
    without DCP; under DCP (with a query longer than one token) the decodes and extends of
    ``split_decodes_prefills_and_extends`` at threshold 1 (its ``split_dcp_context_queries``), and
    ``max_dcp_context_kv_len`` 0 when no row has context (the DCP lengths: the FlashAttention tests);
    and the causal flags: with per-request flags (``inputs.causal``) an int32 device array of them, 1 on
    padding rows, and the scalar ``causal`` true when every row is causal; without them no array and
    the options' flag (a plain step's common metadata is causal); under DCP this rank's share of each
    row's context (``seq_lens - query_lens``, vLLM's ``get_dcp_local_seq_lens``); the block table's
    read columns, the padded token count and the options' ``max_num_splits``."""
    ref = ref_common_fields(spec, device)
    flags = None if inputs is None or inputs.causal is None else np.asarray(inputs.causal).astype(bool)
    causal_tensor = None
    if flags is not None:
        padded = np.ones(spec.padded_num_reqs, np.int32)
        padded[: spec.num_reqs] = flags
        causal_tensor = torch.tensor(padded).to(device)
    causal = bool(flags.all()) if flags is not None else (True if options.causal is None else options.causal)
    counts = (0, 0, 0, 0)
    max_dcp = 0
    dcp_lens = None
    if options.dcp_world_size > 1:
        dcp_lens = ref_dcp_context_kv_lens(ref["query_start_loc"], ref["seq_lens"], options.dcp_world_size,
                                           options.dcp_rank, options.dcp_interleave)
        qsl = ref["query_start_loc"].cpu()  # (a reference: reads back freely)
        c = torch.tensor(spec.num_computed_tokens.astype(np.int32))
        q = torch.tensor(spec.num_scheduled_tokens.astype(np.int32))
        upper = c + q if spec.seq_lens_upper_bound is None else torch.tensor(spec.seq_lens_upper_bound.astype(np.int32))
        ub = torch.zeros(spec.padded_num_reqs, dtype=torch.int32)  # padding rows: 0
        ub[: spec.num_reqs] = upper
        if spec.max_query_len > 1:
            d, e, _p, dt, et, _pt = ref_split_decodes_prefills_and_extends(qsl, ub, spec.padded_num_tokens,
                                                                           spec.max_query_len, 1)
            counts = (d, e, dt, et)
        has_context = spec.num_reqs > 0 and int((upper - q).max()) > 0
        if has_context:
            parts = options.dcp_world_size * options.dcp_interleave
            max_dcp = -(-int(upper.max()) // parts) * options.dcp_interleave
    return {"query_start_loc": ref["query_start_loc"], "seq_lens": ref["seq_lens"],
            "slot_mapping": ref["slot_mapping"], "num_decode_reqs": counts[0], "num_prefill_reqs": counts[1],
            "num_decode_tokens": counts[2], "num_prefill_tokens": counts[3], "max_dcp_context_kv_len": max_dcp,
            "max_query_len": spec.max_query_len, "max_seq_len": spec.max_seq_len, "causal_tensor": causal_tensor,
            "causal": causal, "dcp_context_kv_lens": dcp_lens, "block_table": LeadingColumns(ref_block_table(spec, device)),
            "num_actual_tokens": spec.padded_num_tokens, "max_num_splits": options.max_num_splits}


# ------------------------------------------------------------------------------------------------
# FlashInfer


def flashinfer_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[FlashInferOptions, None]:
    """Random thresholds, uniformity, gather location, and DCP on about a third of the draws."""
    if rng.random() < 0.5:
        return FlashInferOptions(), None
    dcp = rng.random() < 0.3
    return FlashInferOptions(
        decode_threshold=int(rng.integers(1, 5)), require_uniform=bool(rng.random() < 0.5),
        indices="device" if rng.random() < 0.5 else "host", dcp_world_size=2 if dcp else 1,
        dcp_rank=int(rng.integers(0, 2)) if dcp else 0,
    ), None


def flashinfer_reference(spec: BatchSpec, options: FlashInferOptions, device: torch.device,
                         inputs: None) -> dict[str, Any]:
    """The split, the KV lengths and the page table, computed the reference way on ``device``; the page
    count, the longest decode and prefill query and KV length (0 where there is none), and the options
    it passes on (page size, causal, where the indices are gathered)."""
    f = ref_common_fields(spec, device)
    qsl, sl = f["query_start_loc"], f["seq_lens"]
    rows, tokens = spec.padded_num_reqs, spec.padded_num_tokens
    if options.causal:
        split = ref_split_decodes_and_prefills(qsl, tokens, spec.max_query_len, options.decode_threshold,
                                               options.require_uniform)
    else:
        split = (0, rows, 0, tokens)
    d = split[0]
    W = options.dcp_world_size
    kv = ref_dcp_context_kv_lens(qsl, sl, W, options.dcp_rank, options.dcp_interleave, num_decodes=d) \
        if W > 1 else sl
    padded_table = np.zeros((spec.padded_num_reqs, spec.block_table.shape[1]), np.int32)
    padded_table[: spec.num_reqs] = spec.block_table[: spec.num_reqs]  # padding rows: no pages
    table = torch.tensor(padded_table).to(device)
    page = spec.block_size
    q = (qsl[1:] - qsl[:-1]).cpu().tolist()  # (a reference: reads back freely)
    kv_host = kv.cpu().tolist()
    return {
        "num_pages": sum(-(-s // page) for s in kv_host), "page_size": page,
        "max_decode_query_len": max(q[:d], default=0), "max_prefill_query_len": max(q[d:], default=0),
        "max_kv_len": max(kv_host, default=0), "causal": options.causal, "indices": options.indices,
        "num_decodes": split[0], "num_prefills": split[1], "num_decode_tokens": split[2],
        "num_prefill_tokens": split[3], "paged_kv_indptr": ref_paged_kv_indptr(kv, page),
        "paged_kv_indices": ref_paged_kv_indices(table, kv, page),
        "paged_kv_last_page_len": ref_paged_kv_last_page_len(kv, page), "kv_lens": kv,
        "qo_indptr_decode": qsl[: d + 1], "qo_indptr_prefill": qsl[d:] - qsl[d],
    }


# ------------------------------------------------------------------------------------------------
# Cascade


def cascade_defaults(spec: BatchSpec) -> tuple[CascadeOptions, CascadeInputs]:
    """An H100-like device (132 SMs), 32 query and 8 KV heads, no shared prefix."""
    return CascadeOptions(num_query_heads=32, num_kv_heads=8, num_sms=132), CascadeInputs(num_common_prefix_blocks=0)


def cascade_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[CascadeOptions, CascadeInputs]:
    """8, 32 or 64 query heads, 1, 4 or 8 KV heads, 1 to 132 SMs (so the cost vote's branches and its
    ties are drawn, not only flash decoding's easy win), and a block count the requests' rows bear out:
    up to the leading columns every real row shares, or any of 0-63 when the smallest context caps the
    prefix within them."""
    opts = CascadeOptions(num_query_heads=int(rng.choice([8, 32, 64])), num_kv_heads=int(rng.choice([1, 4, 8])),
                          num_sms=int(rng.choice([1, 4, 16, 132])))
    n, bs = spec.num_reqs, spec.block_size
    cap = int(spec.num_computed_tokens.min()) // bs if n else 0  # prefix columns the cap allows
    head = spec.block_table[:n, :cap]
    differ = (head != head[:1]).any(axis=0)
    shared = int(np.argmax(differ)) if differ.any() else cap  # leading columns every row shares
    top = 63 if shared == cap else shared
    return opts, CascadeInputs(num_common_prefix_blocks=int(rng.integers(0, top + 1)))


def _runner_cascade_prefix_len(spec: BatchSpec, num_common_prefix_blocks: int) -> int:
    """vLLM's runner (``_compute_cascade_attn_prefix_len`` before the builder's vote), written out:
    ``L = blocks * block_size`` (0 stays 0), capped at the smallest ``num_computed_tokens`` of the
    real requests (no +1), rounded down to a whole block."""
    length = num_common_prefix_blocks * spec.block_size
    if length == 0 or spec.num_reqs == 0:
        return 0
    length = min(length, int(spec.num_computed_tokens[: spec.num_reqs].min()))
    return length // spec.block_size * spec.block_size


def cascade_reference(spec: BatchSpec, options: CascadeOptions, device: torch.device,
                      inputs: CascadeInputs) -> dict[str, Any]:
    """The decision and the prefix arrays the pre-removal vLLM builders made (the runner's prefix
    rule, ``torch.all`` + ``bool`` for the decision, ``torch.tensor(list, device)`` uploads)."""
    f = ref_common_fields(spec, device)
    qsl, sl = f["query_start_loc"], f["seq_lens"]
    length = _runner_cascade_prefix_len(spec, inputs.num_common_prefix_blocks)
    q = (qsl[1:] - qsl[:-1])[: spec.num_reqs]
    use = spec.padded_num_reqs == spec.num_reqs and ref_use_cascade_attention(
        length, q, options.num_query_heads, options.num_kv_heads, options.use_alibi, options.use_sliding_window,
        options.use_local_attention, options.num_sms, options.dcp_world_size)
    if not use:
        return {"use_cascade": False, "common_prefix_len": 0, "num_prefix_blocks": 0}
    arrays = ref_cascade_arrays(length, sl, spec.padded_num_tokens, spec.block_size,
                                torch.tensor(spec.block_table).to(device))
    return {"use_cascade": True, "common_prefix_len": length, **{k: v for k, v in arrays.items() if v is not None}}


# ------------------------------------------------------------------------------------------------
# KV-sharing fast prefill


def fast_prefill_defaults(spec: BatchSpec) -> tuple[FastPrefillOptions, FastPrefillInputs | None]:
    """The logits of each scheduled request's last token (the plain sampling case; no inputs when
    no request is scheduled)."""
    ends = np.cumsum(spec.num_scheduled_tokens, dtype=np.int64)
    last = (ends - 1)[spec.num_scheduled_tokens > 0].astype(np.int32)
    return FastPrefillOptions(), (FastPrefillInputs(logits_indices=last) if last.size else None)


def fast_prefill_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[FastPrefillOptions,
                                                                            FastPrefillInputs | None]:
    """The last 1-3 tokens of each request as logits indices, padded by 0-3 entries."""
    q = spec.num_scheduled_tokens.astype(np.int64)
    ends = np.cumsum(q)
    cnt = np.minimum(rng.integers(1, 4, q.shape[0]), q)  # the last cnt_i tokens of each request
    starts = np.cumsum(cnt) - cnt
    li = (np.repeat(ends - cnt, cnt) + np.arange(int(cnt.sum())) - np.repeat(starts, cnt)).astype(np.int32)
    if not li.size:
        return FastPrefillOptions(), None
    return FastPrefillOptions(), FastPrefillInputs(logits_indices=li,
                                                   num_logits_padded=li.shape[0] + int(rng.integers(0, 4)))


def fast_prefill_reference(spec: BatchSpec, options: FastPrefillOptions, device: torch.device,
                           inputs: FastPrefillInputs) -> dict[str, Any]:
    """The fast batch's query starts, the padded logits indices and the scalars, computed the
    reference way (vLLM's device bucketize / scatter_add / cumsum, ``.item()`` for the maxima)."""
    qsl = ref_common_fields(spec, device)["query_start_loc"]
    li = inputs.logits_indices
    if li is None:
        return {"applied": False, "num_logits_indices": None, "query_start_loc": qsl, "max_query_len": spec.max_query_len}
    li_t = torch.tensor(np.asarray(li, np.int32)).to(device)
    n_pad = li_t.shape[0] if inputs.num_logits_padded is None else inputs.num_logits_padded
    applied = spec.max_query_len != 1
    fqsl = ref_fast_prefill_query_start_loc(qsl, li_t) if applied else qsl
    return {
        "applied": applied, "num_logits_indices": int(li_t.shape[0]), "query_start_loc": fqsl,
        "logits_indices_padded": ref_pad_logits_indices(li_t, int(n_pad)),
        "max_query_len": ref_max_logits_per_req(fqsl) if applied else spec.max_query_len,
    }


# ------------------------------------------------------------------------------------------------
# Chunked local attention


def local_attn_defaults(spec: BatchSpec) -> tuple[LocalAttentionOptions, None]:
    """Chunks of 4 blocks (Llama 4's 8192-token chunks at block size 2048; any block size here)."""
    return LocalAttentionOptions(attn_chunk_size=4 * spec.block_size), None


def local_attn_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[LocalAttentionOptions, None]:
    """A chunk of 1-4 blocks, the table gathered on the host or the device."""
    return LocalAttentionOptions(attn_chunk_size=spec.block_size * int(rng.integers(1, 5)),
                                 block_table="device" if rng.random() < 0.5 else "host"), None


def local_attn_reference(spec: BatchSpec, options: LocalAttentionOptions, device: torch.device,
                         inputs: None) -> dict[str, Any]:
    """The virtual batch by a literal tensor transcription of vLLM's formulas, over the block table
    the common metadata stages by default (the longest request's blocks; padding rows 0), its virtual
    block table compared on each row's own blocks (the entries after them repeat the staged table's
    last column, which follows the staging), its rows' original requests and first block columns
    (device fields with ``block_table="device"``, host arrays with ``"host"``), and the options it
    passes on."""
    f = ref_common_fields(spec, device)
    span = spec.block_size * (1 if spec.context_parallel is None else spec.context_parallel.world_size)
    width = max(1, -(-spec.max_exact_seq_len // span))  # (at least one column: ref_block_table's may have none)
    table = np.zeros((spec.padded_num_reqs, width), np.int32)
    table[: spec.num_reqs] = spec.block_table[: spec.num_reqs, :width]
    lb = ref_local_virtual_batches(f["query_start_loc"], f["seq_lens"], options.attn_chunk_size, spec.block_size,
                                   torch.tensor(table).to(device))
    on_device = options.block_table == "device"
    assert lb.block_table is not None  # (given a table)
    # Each virtual row's blocks (kstart is a block boundary), within its request's own columns: past them
    # the entries follow the staged width (a zero-length request's virtual row has k = A, vLLM's formula).
    own = -(-f["seq_lens"].long()[lb.req_indices.long()] // span) - lb.block_starts.long()
    read = torch.minimum(-(-lb.seq_lens.long() // spec.block_size), own).clamp(min=0)
    return {"query_start_loc": lb.query_start_loc, "seq_lens": lb.seq_lens,
            "block_table": LeadingColumns(lb.block_table, read),
            "num_virtual_reqs": lb.num_virtual_reqs, "attn_chunk_size": options.attn_chunk_size,
            "pages_per_local_block": options.attn_chunk_size // spec.block_size,
            "block_table_mode": options.block_table,
            "req_indices": lb.req_indices if on_device else None, "req_indices_cpu": lb.req_indices,
            "block_starts": lb.block_starts if on_device else None, "block_starts_cpu": lb.block_starts}


ENTRIES: dict[str, LabEntry] = {
    "flash_attn": LabEntry(reference=flash_attn_reference, sample=flash_attn_sample),
    "flashinfer": LabEntry(reference=flashinfer_reference, sample=flashinfer_sample),
    "cascade": LabEntry(reference=cascade_reference, sample=cascade_sample, defaults=cascade_defaults),
    "fast_prefill": LabEntry(reference=fast_prefill_reference, sample=fast_prefill_sample,
                             defaults=fast_prefill_defaults),
    "local_attn": LabEntry(reference=local_attn_reference, sample=local_attn_sample, defaults=local_attn_defaults),
}
"""The attention builders' lab entries, by registry name."""
