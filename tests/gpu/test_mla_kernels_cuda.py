"""Real MLA kernels on a GPU, fed by attnmeta's MLA metadata, against a dense float32 MLA reference.

Runs only where CUDA is present and FlashInfer (``flashinfer-python`` 0.5.3) imports: the GPU machine,
through ``benchmarks/gpu_all.sh``'s ``kernels`` part. Every metadata build runs under
``torch.cuda.set_sync_debug_mode("error")`` and :func:`attnmeta.sync.no_device_sync`; the kernels run
outside the audit.

Each seed is one random mixed batch (decodes with up to ``1 + k`` tokens, chunked prefills with
unaligned context, fresh prefills, padding rows) built by :data:`attnmeta.backends.mla.MLA` with a
small chunked-context workspace (so contexts split over several chunks), one of the four decode
variants per seed. The model is absorbed-weight MLA: ``H`` heads, a compressed KV latent ``c_kv``
(``LORA = 512``) and a shared rope key ``k_pe`` (``ROPE = 64``) per token in a paged cache, queries
``q_nope`` (``NOPE = 128``) and ``q_pe`` per head, up-projections ``W_UK`` / ``W_UV``.

(a) **Decode rows** through FlashInfer's ``BatchMLAPagedAttentionWrapper``, planned from the MLA
    metadata's pinned host arrays (``query_start_loc_cpu[:D + 1]``, ``decode_seq_lens_cpu``) and run
    on its device block table (``block_table[:D]`` flattened; page ``j`` of decode row ``i`` is entry
    ``i * max_blocks + j``), on the absorbed query ``q_nope @ W_UK``; compared in latent space.
(b) **Prefill rows** the way vLLM's MLA prefill runs them: for every context chunk, the workspace is
    gathered from the paged cache through the chunk's ``token_to_seq``, ``cu_seq_lens`` and
    ``starts`` and the prefill rows of ``block_table``, up-projected, and attended non-causally by
    the chunk's queries (``query_start_loc``, ``max_query_len``, ``max_seq_len``) through torch's
    ``varlen_attn`` with its log-sum-exp; the partials are folded chunk by chunk (continuation tokens
    ``[token_slice.start, continuation_token_end)`` merged, the others copied); then the new tokens'
    causal self-attention (keys gathered through ``slot_mapping``, ``prefill_query_start_loc``) is
    merged in. Compared after ``W_UV``.

The dense reference reads the cache through the *spec's* block table on the host, never through the
metadata. The worst error of each kernel over all batches is printed at the end of the module (run
with ``-s``; ``benchmarks/gpu_all.sh OUT kernels`` does).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from audit_helpers import KernelResults, audited

from attnmeta import BatchSpec, Stager
from attnmeta.backends.flashinfer import host_tensor
from attnmeta.backends.mla import MLAMetadata, MLAOptions
from attnmeta.backends.mla import build as build_mla

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine: bash benchmarks/gpu_all.sh OUT kernels)",
                allow_module_level=True)
flashinfer_mla = pytest.importorskip(
    "flashinfer.mla", reason="needs FlashInfer (pip install flashinfer-python==0.5.3)")
varlen = pytest.importorskip("torch.nn.attention.varlen", reason="needs torch.nn.attention.varlen (torch >= 2.10)")

PAGE = 64
HEADS = 16
LORA = 512
ROPE = 64
NOPE = 128
VDIM = 128
SCALE = 1.0 / math.sqrt(NOPE + ROPE)
Q_GAIN = 2.5  # larger logits: a softmax peaked enough that one misplaced key shows
DTYPE = torch.float16
ATOL = RTOL = 1e-2
SEEDS = range(16)
VARIANTS = ("flashinfer_mla", "flashmla", "triton_mla", "flashattn_mla")

Kernel = Callable[..., torch.Tensor]
VarlenKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Worst absolute error and batch/row/chunk counts per kernel, over the module's tests (printed at the end).
RESULTS = KernelResults(f"atol {ATOL}, rtol {RTOL}")
record = RESULTS.record


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Iterator[None]:
    """Print each kernel's batches and worst error once the module's tests have run."""
    yield
    RESULTS.print()


# ------------------------------------------------------------------------------------------------
# batches, weights, cache
# ------------------------------------------------------------------------------------------------


def random_batch(seed: int) -> tuple[BatchSpec, MLAOptions]:
    """One reordered mixed batch and the MLA options of ``seed``.

    Decodes (``1 .. 1 + k`` tokens, context ``1 .. 600``), chunked prefills (context ``1 .. 700``,
    ``2 .. 90`` new tokens; ``513 .. 600`` for FlashAttention-MLA, whose threshold is 512), fresh
    prefills; distinct pages per request (ids from 1); 0 to 2 padding rows; a workspace of 1 to 5
    pages, so that contexts split over several chunks.
    """
    rng = np.random.default_rng(seed)
    variant = VARIANTS[seed % len(VARIANTS)]
    k = int(rng.integers(0, 3))
    n = int(rng.integers(2, 9))
    kinds = np.sort(rng.integers(0, 3, n))  # 0 decode, 1 chunked prefill, 2 fresh prefill
    long_q = variant == "flashattn_mla"
    c = np.where(kinds == 0, rng.integers(1, 600, n), np.where(kinds == 1, rng.integers(1, 700, n), 0))
    q_pre = rng.integers(513, 600, n) if long_q else rng.integers(2, 90, n)
    q = np.where(kinds == 0, 1 + rng.integers(0, k + 1, n), np.where(kinds == 1, q_pre, rng.integers(1, 100, n)))
    s = c + q
    width = int((-(-s // PAGE)).max()) + int(rng.integers(0, 3))
    table = (1 + rng.permutation(n * width)).reshape(n, width).astype(np.int32)
    pad = int(rng.integers(0, 3))
    spec = BatchSpec(num_computed_tokens=c.astype(np.int32), num_scheduled_tokens=q.astype(np.int32),
                     block_table=table, block_size=PAGE, num_reqs_padded=n + pad,
                     num_tokens_padded=int(q.sum()) + (int(rng.integers(0, 5)) if pad else 0))
    opts = MLAOptions(variant=variant, num_speculative_tokens=k,  # type: ignore[arg-type]
                      workspace_size=PAGE * int(rng.integers(1, 6)), align_indptr=bool(rng.random() < 0.3))
    return spec, opts


def model_tensors(spec: BatchSpec, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random paged latent cache (``ckv`` (pages, PAGE, LORA), ``kpe`` (pages, PAGE, ROPE)), queries
    (``q_nope`` (T, H, NOPE), ``q_pe`` (T, H, ROPE)) in :data:`DTYPE`, float32 ``W_UK`` (H, NOPE, LORA)
    and ``W_UV`` (H, VDIM, LORA)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages = int(spec.block_table.max()) + 1
    T = spec.num_tokens if spec.num_tokens_padded is None else spec.num_tokens_padded
    out = {
        "ckv": torch.randn((pages, PAGE, LORA), generator=gen),
        "kpe": torch.randn((pages, PAGE, ROPE), generator=gen),
        "q_nope": Q_GAIN * torch.randn((T, HEADS, NOPE), generator=gen),
        "q_pe": Q_GAIN * torch.randn((T, HEADS, ROPE), generator=gen),
    }
    t = {name: v.to(DTYPE).to(device) for name, v in out.items()}
    t["w_uk"] = (torch.randn((HEADS, NOPE, LORA), generator=gen) / math.sqrt(LORA)).to(device)
    t["w_uv"] = (torch.randn((HEADS, VDIM, LORA), generator=gen) / math.sqrt(LORA)).to(device)
    return t


def absorbed_query(t: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
    """``q_nope @ W_UK`` for token ``rows``: (n, H, LORA) float32."""
    return torch.einsum("thn,hnl->thl", t["q_nope"][rows].float(), t["w_uk"])


# ------------------------------------------------------------------------------------------------
# the dense reference (spec's block table on the host; never the metadata)
# ------------------------------------------------------------------------------------------------


def dense_reference(spec: BatchSpec, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Absorbed-weight MLA of every real token in float32: (num_tokens, H, LORA) latent outputs.

    Query ``i`` of a request with context ``c`` sits at position ``c + i`` and sees keys ``[0, c + i]``:
    ``softmax(SCALE * (q_lat . c_kv + q_pe . k_pe)) @ c_kv``.
    """
    dev = t["ckv"].device
    ckv = t["ckv"].reshape(-1, LORA).float()
    kpe = t["kpe"].reshape(-1, ROPE).float()
    out = torch.zeros((spec.num_tokens, HEADS, LORA), dtype=torch.float32, device=dev)
    start = 0
    for i in range(spec.num_reqs):
        c, q = int(spec.num_computed_tokens[i]), int(spec.num_scheduled_tokens[i])
        s = c + q
        if q:
            pos = np.arange(s)
            slots = torch.from_numpy(spec.block_table[i, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE).to(dev)
            k_lat, k_pe = ckv[slots], kpe[slots]
            rows = slice(start, start + q)
            q_lat = absorbed_query(t, rows)
            logits = SCALE * (torch.einsum("thl,sl->hts", q_lat, k_lat)
                              + torch.einsum("thr,sr->hts", t["q_pe"][rows].float(), k_pe))
            mask = torch.arange(s, device=dev)[None, :] <= (c + torch.arange(q, device=dev))[:, None]
            p = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
            out[rows] = torch.einsum("hts,sl->thl", p, k_lat)
        start += q
    return out


# ------------------------------------------------------------------------------------------------
# (a) decode rows: FlashInfer's MLA paged wrapper planned from the MLA metadata
# ------------------------------------------------------------------------------------------------


def pinned(array: np.ndarray) -> torch.Tensor:
    """A pinned host copy of a host array the test derives (FlashInfer copies it with non_blocking)."""
    out = torch.empty(array.shape, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    out.numpy()[...] = array
    return out


def flashinfer_decode(wrapper: Any, m: MLAMetadata, q_lat: torch.Tensor, q_pe: torch.Tensor,
                      ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor:
    """The decode rows' latent outputs through ``BatchMLAPagedAttentionWrapper``: (qsl[D], H, LORA).

    Planned from the metadata's pinned host twins: ``qo_indptr = query_start_loc_cpu[:D + 1]``,
    ``kv_len_arr = decode_seq_lens_cpu``; pages from the device ``block_table[:D]``, row-major, with
    ``kv_indptr = arange(D + 1) * max_blocks`` (the kernel reads page ``kv_indices[kv_indptr[i] + j]``
    for the ``j``-th page of row ``i`` and bounds the keys by ``kv_len_arr``).
    """
    D = m.num_decodes
    qo_indptr = host_tensor(m.query_start_loc_cpu[: D + 1])
    kv_len = host_tensor(m.decode_seq_lens_cpu)
    if torch.cuda.is_available():  # the plan's non-blocking copies read them: pinned, so real DMA
        assert qo_indptr.is_pinned() and kv_len.is_pinned()
    width = m.block_table.shape[1]
    kv_indptr = pinned(np.arange(D + 1, dtype=np.int32) * width)
    kv_indices = m.block_table[:D].reshape(-1)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, HEADS, LORA, ROPE, PAGE, True, SCALE,
                 q_lat.dtype, ckv.dtype)
    out: torch.Tensor = wrapper.run(q_lat, q_pe, ckv, kpe)
    return out


# ------------------------------------------------------------------------------------------------
# (b) prefill rows: chunked context + new tokens through varlen attention, merged by log-sum-exp
# ------------------------------------------------------------------------------------------------


def varlen_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``varlen_attn`` with its log-sum-exp, whichever spelling this torch uses: (out, lse (T, H) float32)."""
    fn = varlen.varlen_attn
    params = inspect.signature(fn).parameters
    kw: dict[str, Any] = {"return_aux": varlen.AuxRequest(lse=True)}
    if "is_causal" in params:
        kw["is_causal"] = causal
    elif causal:
        kw["window_size"] = (-1, 0)
    if "scale" in params:
        kw["scale"] = SCALE
    out, lse = fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    return out, lse_rows(lse, q.shape[0], q.shape[1])


def lse_rows(lse: torch.Tensor, tokens: int, heads: int) -> torch.Tensor:
    """FlashAttention's varlen log-sum-exp is (heads, tokens); some wrappers give (tokens, heads)."""
    if lse.shape == (heads, tokens):
        return lse.t().float()
    if lse.shape == (tokens, heads):
        return lse.float()
    raise AssertionError(f"varlen_attn lse of shape {tuple(lse.shape)}, expected ({heads}, {tokens}) or the transpose")


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention partials over disjoint keys combined by log-sum-exp (``l = -inf``: no keys)."""
    mx = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - mx), torch.exp(l2 - mx)
    tot = w1 + w2
    return (o1 * w1[..., None] + o2 * w2[..., None]) / tot[..., None], mx + torch.log(tot)


def up_project(t: dict[str, torch.Tensor], ckv: torch.Tensor, kpe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[c_kv @ W_UK^T, k_pe]`` (n, H, NOPE + ROPE) and values ``c_kv @ W_UV^T`` zero-padded to the
    same width (FlashAttention takes one head size), both :data:`DTYPE`."""
    n = ckv.shape[0]
    k_nope = torch.einsum("sl,hnl->shn", ckv.float(), t["w_uk"])
    k = torch.cat([k_nope, kpe.float()[:, None, :].expand(n, HEADS, ROPE)], dim=-1).to(DTYPE)
    v = torch.zeros((n, HEADS, NOPE + ROPE), dtype=DTYPE, device=ckv.device)
    v[..., :VDIM] = torch.einsum("sl,hvl->shv", ckv.float(), t["w_uv"]).to(DTYPE)
    return k.contiguous(), v


def chunked_prefill(m: MLAMetadata, t: dict[str, torch.Tensor], attend: VarlenKernel) -> tuple[torch.Tensor, int]:
    """The prefill rows' outputs after ``W_UV`` (num prefill tokens, H, VDIM) float32, and the chunk count.

    Every index comes from the metadata: the prefill rows' block table ``block_table[D:]``, each
    chunk's ``token_to_seq`` / ``cu_seq_lens`` / ``starts`` (the workspace gather), its
    ``query_start_loc`` / ``max_query_len`` / ``max_seq_len`` and token slices, ``slot_mapping`` and
    ``prefill_query_start_loc`` for the new tokens.
    """
    D = m.num_decodes
    dev = m.block_table.device
    t0 = int(m.query_start_loc_cpu[D])  # first prefill token (global)
    n_tok = int(m.prefill_query_start_loc_cpu[-1])
    rows = slice(t0, t0 + n_tok)
    q = torch.cat([t["q_nope"][rows], t["q_pe"][rows]], dim=-1).contiguous()
    ckv_flat = t["ckv"].reshape(-1, LORA)
    kpe_flat = t["kpe"].reshape(-1, ROPE)
    # new tokens: their own latent, found through slot_mapping, causal
    slots = m.slot_mapping[rows]
    k_new, v_new = up_project(t, ckv_flat[slots], kpe_flat[slots])
    pq = m.prefill_query_start_loc
    o_new, l_new = attend(q, k_new, v_new, pq, pq, m.prefill_max_query_len, m.prefill_max_query_len, True)
    o_new = o_new[..., :VDIM].float()
    # context: chunk by chunk, folded into a running partial (empty context: lse -inf)
    o_ctx = torch.zeros((n_tok, HEADS, VDIM), dtype=torch.float32, device=dev)
    l_ctx = torch.full((n_tok, HEADS), float("-inf"), dtype=torch.float32, device=dev)
    bt = m.block_table[D:]
    for index in range(m.num_chunks):
        ch = m.chunk(index)
        nt = ch.num_context_tokens
        r0 = ch.request_slice.start
        tts = ch.token_to_seq.long()
        pos = ch.starts.long()[tts] + torch.arange(nt, device=dev) - ch.cu_seq_lens.long()[tts]
        page = bt[r0 + tts, pos // PAGE].long()
        ws = page * PAGE + pos % PAGE
        k_c, v_c = up_project(t, ckv_flat[ws], kpe_flat[ws])
        a, b = ch.token_slice.start, ch.token_slice.stop
        o_c, l_c = attend(q[a:b], k_c, v_c, ch.query_start_loc, ch.cu_seq_lens, ch.max_query_len, ch.max_seq_len,
                          False)
        o_c = o_c[..., :VDIM].float()
        split = ch.continuation_token_end if ch.is_continuation else a
        if split > a:  # the first row continues from the previous chunk: merge
            o_ctx[a:split], l_ctx[a:split] = merge(o_ctx[a:split], l_ctx[a:split], o_c[: split - a], l_c[: split - a])
        o_ctx[split:b], l_ctx[split:b] = o_c[split - a:], l_c[split - a:]
    out, _ = merge(o_ctx, l_ctx, o_new, l_new)
    return out, m.num_chunks


# ------------------------------------------------------------------------------------------------
# the test
# ------------------------------------------------------------------------------------------------


def check_batch(seed: int, device: torch.device, decode: Kernel, attend: VarlenKernel,
                build: Callable[[BatchSpec, MLAOptions], MLAMetadata]) -> dict[str, tuple[float, int, int]]:
    """Build ``seed``'s MLA metadata, run both paths, compare; return each path's (worst error, rows,
    context chunks).

    Raises
    ------
    AssertionError
        A kernel output outside ``atol = rtol = 1e-2`` of the dense reference.
    """
    spec, opts = random_batch(seed)
    m = build(spec, opts)
    t = model_tensors(spec, seed, device)
    ref = dense_reference(spec, t)
    D = m.num_decodes
    done: dict[str, tuple[float, int, int]] = {}
    n_dec = int(m.query_start_loc_cpu[D])
    if n_dec:
        rows = slice(0, n_dec)
        q_lat = absorbed_query(t, rows).to(DTYPE)
        got = decode(m, q_lat, t["q_pe"][rows].contiguous(), t["ckv"], t["kpe"]).float()
        torch.testing.assert_close(got, ref[rows], atol=ATOL, rtol=RTOL,
                                   msg=lambda s: f"seed {seed} ({opts.variant}, D={D}): decode rows\n{s}")
        done["decode"] = ((got - ref[rows]).abs().max().item(), D, 0)
    n_pre = int(m.prefill_query_start_loc_cpu[-1]) if m.num_prefills else 0
    if n_pre:
        got, chunks = chunked_prefill(m, t, attend)
        want = torch.einsum("thl,hvl->thv", ref[n_dec: n_dec + n_pre], t["w_uv"])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL,
                                   msg=lambda s: f"seed {seed} ({opts.variant}, {chunks} chunks): prefill rows\n{s}")
        done["prefill"] = ((got - want).abs().max().item(), m.num_prefills, chunks)
    return done


@pytest.fixture(scope="module")
def mla_wrapper() -> Any:
    """One ``BatchMLAPagedAttentionWrapper`` with a 128 MiB workspace: FlashInfer's choice (fa3 on
    Hopper), or fa2 where that one does not build here (the summary names the backend that ran)."""
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    failed = []
    for backend in ("auto", "fa2"):
        wrapper = flashinfer_mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
        try:  # one row, one key: builds (JIT) and runs the backend's kernels
            one = torch.ones(2, dtype=torch.int32)
            wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32, device="cuda"), one[:1], HEADS, LORA, ROPE, PAGE, True,
                         SCALE, DTYPE, DTYPE)
            wrapper.run(torch.zeros((1, HEADS, LORA), dtype=DTYPE, device="cuda"),
                        torch.zeros((1, HEADS, ROPE), dtype=DTYPE, device="cuda"),
                        torch.zeros((2, PAGE, LORA), dtype=DTYPE, device="cuda"),
                        torch.zeros((2, PAGE, ROPE), dtype=DTYPE, device="cuda"))
            torch.cuda.synchronize()
            return wrapper
        except Exception as e:  # a backend that does not compile or run on this machine
            failed.append(f"{backend}: {e!r}"[:400])
            print(f"\nFlashInfer MLA backend {backend!r} failed: {failed[-1]}")
    pytest.fail("no FlashInfer MLA backend ran: " + "; ".join(failed))


@pytest.mark.parametrize("seed", SEEDS)
def test_mla_metadata_drives_flashinfer_mla_and_chunked_prefill(seed: int, mla_wrapper: Any) -> None:
    dev = torch.device("cuda")
    stager = Stager(dev)

    def build(spec: BatchSpec, opts: MLAOptions) -> MLAMetadata:
        with audited():
            m: MLAMetadata = build_mla(spec, stager, opts)
        return m

    def decode(m: MLAMetadata, q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor,
               kpe: torch.Tensor) -> torch.Tensor:
        return flashinfer_decode(mla_wrapper, m, q_lat, q_pe, ckv, kpe)

    done = check_batch(seed, dev, decode, varlen_lse, build)
    backend = getattr(mla_wrapper, "_backend", "?")
    if "decode" in done:
        record(f"flashinfer.mla.BatchMLAPagedAttentionWrapper ({backend}), decode rows", *done["decode"])
    if "prefill" in done:
        record("torch varlen_attn, chunked-context prefill merged by LSE, prefill rows", *done["prefill"])
