"""Kernel checks on a real GPU: attnmeta's metadata drives attention kernels to the right answers.

Runs only where CUDA is present (the GPU machine). Every metadata build runs under
``torch.cuda.set_sync_debug_mode("error")`` and :func:`attnmeta.sync.no_device_sync`: any synchronising
call raises. The kernels then run outside the audit and are compared with dense references:

(a) FlashAttention metadata through ``torch.nn.attention.varlen.varlen_attn`` (not paged: each
    request's K/V is gathered contiguous through ``block_table`` / ``seq_lens`` on the device) against
    per-request ``scaled_dot_product_attention`` with the causal mask aligned to the end of each
    sequence (query ``i`` of a request with context ``c`` sees keys ``[0, c + i]``);
(b) a paged attention written in torch that reaches K/V only through FlashInfer's
    ``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len`` (host and device gathers),
    against dense attention;
(c) the fast-prefill batch (logits-position queries against the full KV equal the matching rows of
    full attention) and the chunked-local virtual batch (paged through the virtual block table, equal
    to dense attention under the chunked-local mask).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from audit_helpers import audited

from attnmeta import BatchSpec, Stager, stage_common
from attnmeta.backends import fast_prefill, flash_attn, flashinfer, local_attn
from attnmeta.backends.flashinfer import FlashInferOptions, host_tensor
from attnmeta.backends.local_attn import LocalAttentionOptions

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

DEV = torch.device("cuda")
PAGE = 16
HEADS = 4
HEAD_DIM = 64
SEEDS = range(12)


# ------------------------------------------------------------------------------------------------
# batches and KV caches
# ------------------------------------------------------------------------------------------------


def _random_spec(rng: np.random.Generator, *, max_reqs: int = 6, padding: bool = True, spec_decode: bool = False) -> BatchSpec:
    """A reordered mixed batch: decodes (1 token, or 1 + drafts), chunked prefills with unaligned
    context, fresh prefills; each request owns distinct pages (ids from 1; 0 is the null page)."""
    n = int(rng.integers(1, max_reqs + 1))
    kinds = np.sort(rng.integers(0, 3, n))  # 0 decode, 1 chunked prefill, 2 fresh prefill
    c = np.where(kinds == 0, rng.integers(1, 200, n), np.where(kinds == 1, rng.integers(1, 150, n), 0))
    decode_q = 1 + (rng.integers(0, 3, n) if spec_decode else 0)
    q = np.where(kinds == 0, decode_q, np.where(kinds == 1, rng.integers(2, 40, n), rng.integers(1, 60, n)))
    s = c + q
    width = int((-(-s // PAGE)).max()) + int(rng.integers(0, 3))
    table = (1 + rng.permutation(n * width)).reshape(n, width).astype(np.int32)
    pad = int(rng.integers(0, 3)) if padding else 0
    return BatchSpec(num_computed_tokens=c.astype(np.int32), num_scheduled_tokens=q.astype(np.int32),
                     block_table=table, block_size=PAGE, num_reqs_padded=n + pad,
                     num_tokens_padded=int(q.sum()) + (int(rng.integers(0, 5)) if pad else 0))


def _kv_cache(spec: BatchSpec, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V caches, (num_pages, PAGE, HEADS, HEAD_DIM); unused pages hold garbage too."""
    pages = int(spec.block_table.max()) + 1
    shape = (pages, PAGE, HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    v = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    return k, v


def _contiguous_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, cu_k: torch.Tensor, total: int
) -> torch.Tensor:
    """Every request's K (or V) packed contiguously, gathered through ``block_table`` on the device.

    ``total`` (the sum of the sequence lengths) comes from the host, so nothing syncs.
    """
    rows = torch.arange(seq_lens.shape[0], device=cache.device)
    req = torch.repeat_interleave(rows, seq_lens.to(torch.int64), output_size=total)
    pos = torch.arange(total, device=cache.device) - cu_k[req]
    return cache[block_table[req, pos // PAGE].to(torch.int64), pos % PAGE]


def _cu(lens: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as int32 on the device."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens, 0)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA in fp32 over (len, heads, dim) tensors with a (len_q, len_k) boolean mask."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def _causal_end_aligned(q_len: int, k_len: int, device: torch.device, chunk: int | None = None) -> torch.Tensor:
    """Query ``i`` sits at position ``k_len - q_len + i`` and sees keys up to it (and, with ``chunk``,
    only keys of its own ``chunk``-aligned local block)."""
    pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    keys = torch.arange(k_len, device=device)[None, :]
    mask = keys <= pos
    if chunk is not None:
        mask &= keys // chunk == pos // chunk
    return mask


def _dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: np.ndarray, seq_lens: np.ndarray, chunk: int | None = None
) -> torch.Tensor:
    """Per-request attention over contiguous K/V (``k``/``v`` packed by sequence), fp32."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    start_k = 0
    for i in range(seq_lens.shape[0]):
        a, b, s = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        if b > a:
            mask = _causal_end_aligned(b - a, s, q.device, chunk)
            out[a:b] = _attend(q[a:b], k[start_k : start_k + s], v[start_k : start_k + s], mask)
        start_k += s
    return out


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
            max_q: int, max_k: int) -> torch.Tensor:
    """``varlen_attn`` with causal masking, whichever spelling this torch uses."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    params = inspect.signature(varlen.varlen_attn).parameters
    kw: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    out = varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    return out[0] if isinstance(out, tuple) else out


def _setup(seed: int, dtype: torch.dtype, **spec_kw: Any) -> tuple[BatchSpec, torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    spec = _random_spec(rng, **spec_kw)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k_cache, v_cache = _kv_cache(spec, dtype, gen)
    q = torch.randn((spec.num_tokens, HEADS, HEAD_DIM), generator=gen, device=DEV).to(dtype)
    return spec, q, k_cache, v_cache


# ------------------------------------------------------------------------------------------------
# (a) FlashAttention metadata through varlen_attn
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_flash_attention_metadata_drives_varlen_attn(seed: int) -> None:
    spec, q, k_cache, v_cache = _setup(seed, torch.float16)
    stager = Stager(DEV)
    with audited():
        fa = flash_attn.build(spec, stager)
    n = spec.num_reqs  # the kernel runs the real rows; padding rows are CUDA-graph filler
    seq = fa.seq_lens[:n]
    cu_k = _cu(seq)
    total = int(fa.seq_lens_cpu[:n].sum())
    k = _contiguous_kv(k_cache, fa.block_table[:n], seq, cu_k, total)
    v = _contiguous_kv(v_cache, fa.block_table[:n], seq, cu_k, total)
    out = _varlen(q, k, v, fa.query_start_loc[: n + 1], cu_k, fa.max_query_len, fa.max_seq_len)
    ref = _dense_reference(q, k, v, fa.query_start_loc_cpu, fa.seq_lens_cpu[:n])
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------------------
# (b) FlashInfer paged-KV arrays through a torch paged attention
# ------------------------------------------------------------------------------------------------


def _paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qsl: np.ndarray, indptr: np.ndarray,
    indices: torch.Tensor, last_page_len: np.ndarray,
) -> torch.Tensor:
    """Attention that finds K/V only through FlashInfer's layout: row ``i``'s pages are
    ``indices[indptr[i]:indptr[i+1]]``, the last one holding ``last_page_len[i]`` tokens."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(indptr.shape[0] - 1):
        a, b = int(qsl[i]), int(qsl[i + 1])
        npages = int(indptr[i + 1] - indptr[i])
        if b == a or npages == 0:
            continue
        pages = indices[int(indptr[i]) : int(indptr[i + 1])].to(torch.int64)
        kv_len = (npages - 1) * PAGE + int(last_page_len[i])
        k = k_cache[pages].reshape(-1, HEADS, HEAD_DIM)[:kv_len]
        v = v_cache[pages].reshape(-1, HEADS, HEAD_DIM)[:kv_len]
        out[a:b] = _attend(q[a:b], k, v, _causal_end_aligned(b - a, kv_len, q.device))
    return out


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("seed", SEEDS)
def test_flashinfer_paged_kv_reaches_the_right_tokens(seed: int, mode: str) -> None:
    spec, q, k_cache, v_cache = _setup(seed, torch.float32, spec_decode=True)
    stager = Stager(DEV)
    with audited():
        fi = flashinfer.build(spec, stager, FlashInferOptions(decode_threshold=3, indices=mode))  # type: ignore[arg-type]
    # The host arrays plan() takes are pinned: its internal non-blocking copies are real DMA.
    assert host_tensor(fi.paged_kv_indptr_cpu).is_pinned()
    assert host_tensor(fi.paged_kv_last_page_len_cpu[fi.num_decodes :]).is_pinned()
    assert host_tensor(fi.qo_indptr_prefill_cpu).is_pinned() and host_tensor(fi.kv_lens_cpu).is_pinned()
    cm = fi.common
    n = spec.num_reqs
    paged = _paged_attention(q, k_cache, v_cache, cm.query_start_loc_cpu, fi.paged_kv_indptr_cpu,
                             fi.paged_kv_indices, fi.paged_kv_last_page_len_cpu)
    seq = cm.seq_lens[:n]
    cu_k = _cu(seq)
    total = int(cm.seq_lens_cpu[:n].sum())
    k = _contiguous_kv(k_cache, cm.block_table_tensor[:n], seq, cu_k, total)
    v = _contiguous_kv(v_cache, cm.block_table_tensor[:n], seq, cu_k, total)
    dense = _dense_reference(q, k, v, cm.query_start_loc_cpu, cm.seq_lens_cpu[:n])
    torch.testing.assert_close(paged, dense)


# ------------------------------------------------------------------------------------------------
# (c) fast prefill and chunked local attention through the same kernels
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_fast_prefill_rows_equal_full_attention_rows(seed: int) -> None:
    spec, q, k_cache, v_cache = _setup(seed, torch.float16, padding=False, spec_decode=True)
    rng = np.random.default_rng(seed + 1000)
    qsl = np.concatenate([[0], np.cumsum(spec.num_scheduled_tokens)])
    # The runner's logits: each request's last 1..3 tokens (several: spec decode).
    counts = np.minimum(rng.integers(1, 4, spec.num_reqs), spec.num_scheduled_tokens)
    li = np.concatenate([np.arange(e - c, e) for e, c in zip(qsl[1:], counts, strict=True)]).astype(np.int32)
    stager = Stager(DEV)
    with audited(), stager.step() as step:
        staged = flash_attn.stage(stage_common(spec, step), step)
    full_meta = staged.result()
    with audited():
        fp = fast_prefill.build(spec, stager, None,
                                fast_prefill.FastPrefillInputs(logits_indices=li, num_logits_padded=li.shape[0] + 3))
    cm = fp.common
    n = spec.num_reqs
    seq = full_meta.seq_lens[:n]
    cu_k = _cu(seq)
    total = int(full_meta.seq_lens_cpu[:n].sum())
    k = _contiguous_kv(k_cache, full_meta.block_table[:n], seq, cu_k, total)
    v = _contiguous_kv(v_cache, full_meta.block_table[:n], seq, cu_k, total)
    full = _varlen(q, k, v, full_meta.query_start_loc, cu_k, full_meta.max_query_len, full_meta.max_seq_len)
    li_d = fp.logits_indices_padded[: fp.num_logits_indices]  # type: ignore[index]
    if fp.applied:
        fast = _varlen(q[li_d].contiguous(), k, v, cm.query_start_loc, cu_k, cm.max_query_len, cm.max_seq_len)
    else:  # an all-decode step: the batch is already one query per request
        fast = _varlen(q, k, v, cm.query_start_loc, cu_k, cm.max_query_len, cm.max_seq_len)[li_d]
    torch.testing.assert_close(fast.float(), full[li_d].float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("chunk", [PAGE, 2 * PAGE, 4 * PAGE])
@pytest.mark.parametrize("seed", SEEDS)
def test_local_attention_virtual_batch_equals_the_chunked_local_mask(seed: int, chunk: int, mode: str) -> None:
    spec, q, k_cache, v_cache = _setup(seed, torch.float32)
    stager = Stager(DEV)
    with audited():
        la = local_attn.build(spec, stager, LocalAttentionOptions(attn_chunk_size=chunk, block_table=mode))  # type: ignore[arg-type]
    cm = la.common
    # Virtual rows through the paged gather: row v's pages are its virtual block-table row.
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl, k_lens = la.query_start_loc_cpu, la.seq_lens_cpu
    for row in range(la.num_virtual_reqs):
        a, b, kv_len = int(qsl[row]), int(qsl[row + 1]), int(k_lens[row])
        if b == a:
            continue
        pages = la.block_table[row].to(torch.int64)
        k = k_cache[pages].reshape(-1, HEADS, HEAD_DIM)[:kv_len]
        v = v_cache[pages].reshape(-1, HEADS, HEAD_DIM)[:kv_len]
        out[a:b] = _attend(q[a:b], k, v, _causal_end_aligned(b - a, kv_len, q.device))
    # Dense attention over each whole sequence under the chunked-local mask.
    with Stager(DEV).step() as step:
        full = stage_common(spec, step)
    base = full.result()
    n = spec.num_reqs
    seq = base.seq_lens[:n]
    cu_k = _cu(seq)
    total = int(base.seq_lens_cpu[:n].sum())
    k = _contiguous_kv(k_cache, base.block_table_tensor[:n], seq, cu_k, total)
    v = _contiguous_kv(v_cache, base.block_table_tensor[:n], seq, cu_k, total)
    dense = _dense_reference(q, k, v, base.query_start_loc_cpu, base.seq_lens_cpu[:n], chunk=chunk)
    assert cm.num_actual_tokens == base.num_actual_tokens
    torch.testing.assert_close(out, dense)
