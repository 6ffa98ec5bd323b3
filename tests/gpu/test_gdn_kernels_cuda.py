"""Real gated-delta-net kernels on a GPU (flash-linear-attention's Triton kernels, ``fla-core``), fed
by attnmeta's GDN metadata, against a float64 per-sequence recurrence.

Runs only where CUDA is present and ``fla`` (``fla-core`` 0.6.0) imports: the GPU machine, through
``benchmarks/gpu_all.sh``'s ``kernels`` part. Every metadata build runs under
``torch.cuda.set_sync_debug_mode("error")`` and :func:`attnmeta.sync.no_device_sync`; the kernels run
outside the audit.

The recurrence (fla's convention, per value head, state ``S`` of shape (K, V)): with ``k_t``, ``q_t``
of the value head's key head, ``S <- exp(g_t) S``, ``u_t = beta_t (v_t - S^T k_t)``,
``S <- S + k_t u_t^T``, ``o_t = scale * S^T q_t``; that is ``S_t = S_{t-1} exp(g_t) (I - beta_t k_t
k_t^T) + beta_t k_t v_t^T`` in the (K, V) layout.

Each seed is one random batch built by :data:`attnmeta.backends.mamba.gdn.GDN`, a third each: no spec
decode (decodes, continued prefills with a state, fresh prefills, in random order), all spec decode
(``k = 2``, FULL-graph staging on some), spec decode mixed with prefills and one-token prompt chunks;
padding rows throughout. States live in a pool indexed by state slot (the block ids of the state
column; slot 0 is the null block). The kernels see only the metadata:

(a) **decode rows** (no-spec path): ``fused_recurrent_gated_delta_rule`` over
    ``non_spec_query_start_loc[:D + 1]``, initial states ``pool[non_spec_state_indices_tensor[:D]]``,
    final states written back there;
(b) **spec-decode rows**: ``fused_recurrent_gated_delta_rule`` over ``spec_query_start_loc`` on the
    tokens ``spec_token_indx``, initial state from column ``num_accepted_tokens - 1`` of
    ``spec_state_indices_tensor``, final state into column ``q - 1`` (fla-core 0.6.0 takes no state
    indices and writes no per-token states, so the indexing is done around the kernel and the
    intermediate columns are not checked);
(c) **prefill rows**: ``chunk_gated_delta_rule`` with ``cu_seqlens = prefill_query_start_loc`` and
    attnmeta's ``chunk_indices``, on the tokens ``non_spec_token_indx`` (spec batches) or the rows
    after the decodes, initial states ``pool[prefill_state_indices]`` zeroed where
    ``prefill_has_initial_state`` is False; and attnmeta's ``chunk_indices`` / ``chunk_offsets``
    equal fla's own ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` of that ``cu_seqlens``.

The reference reads the spec, not the metadata: row ``i``'s initial state is its state slot's
(``block_table[i, acc_i - 1]`` for a spec row, ``block_table[i, 0]`` otherwise, zeros without
context). Outputs of every real token and every non-null pool slot after the step (written slots:
the reference's final state; others unchanged) are compared. The worst error of each kernel is
printed at the end of the module (run with ``-s``; ``benchmarks/gpu_all.sh OUT kernels`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from audit_helpers import KernelResults, audited

from attnmeta import BatchSpec, Stager
from attnmeta.backends.mamba.gdn import FLA_CHUNK_SIZE, GDNInputs, GDNMetadata, GDNOptions
from attnmeta.backends.mamba.gdn import build as build_gdn

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine: bash benchmarks/gpu_all.sh OUT kernels)",
                allow_module_level=True)
fla_gdr = pytest.importorskip(
    "fla.ops.gated_delta_rule",
    reason="needs fla-core, flash-linear-attention's Triton kernels (pip install fla-core==0.6.0)")
fla_index = pytest.importorskip("fla.ops.utils.index", reason="needs fla-core's chunk index helpers")

BLOCK = 16
H, HV, K, V = 2, 4, 128, 128  # key heads, value heads (grouped: 2 value heads a key head), head sizes
SCALE = 1.0  # fla's default is K ** -0.5; 1.0 keeps the outputs O(1) so an error shows at its size
DTYPE = torch.bfloat16
ATOL = RTOL = 3e-2
SEEDS = range(18)
SPEC_K = 2

Recurrent = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Worst absolute error and batch/row counts per kernel, over the module's tests (printed at the end).
RESULTS = KernelResults(f"atol {ATOL}, rtol {RTOL}")
record = RESULTS.record


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Iterator[None]:
    """Print each kernel's batches and worst error once the module's tests have run."""
    yield
    RESULTS.print()


# ------------------------------------------------------------------------------------------------
# batches and inputs
# ------------------------------------------------------------------------------------------------


def random_batch(seed: int) -> tuple[BatchSpec, GDNOptions, np.ndarray | None]:
    """``seed``'s batch, options and accepted counts (spec decode only).

    ``seed % 3 == 0``: no spec decode; decodes (context ``1 .. 300``, ``q = 1``), continued prefills
    (context ``1 .. 300``, ``q = 1 .. 150``: a one-token chunk with a state is a decode for GDN) and
    fresh prefills, in random order half the time. Otherwise ``k = 2``: spec rows first (``d`` drafts,
    ``q = d + 1``, past their prompts, accepted counts ``1 .. k + 1``); ``seed % 3 == 2`` adds continued
    and fresh prefills and one-token prompt chunks, continued or fresh (not spec rows by the runner's
    rule: vLLM makes them prefills of a spec batch); ``seed % 3 == 1`` is all spec, FULL-graph staged half
    the time.
    Distinct blocks per request (ids from 1), 0 to 2 padding rows.
    """
    rng = np.random.default_rng(seed)
    mode = seed % 3
    c: list[int] = []
    q: list[int] = []
    prompt: list[int] = []
    drafts: list[int] = []
    if mode == 0:
        kinds = rng.integers(0, 3, int(rng.integers(1, 9)))
        if rng.random() < 0.5:
            kinds = np.sort(kinds)
        for kind in kinds.tolist():
            ci = int(rng.integers(1, 300)) if kind < 2 else 0
            qi = 1 if kind == 0 else int(rng.integers(1, 150))
            c.append(ci)
            q.append(qi)
            prompt.append(ci if kind == 0 else ci + qi + int(rng.integers(0, 50)))
    else:
        for _ in range(int(rng.integers(1, 6))):
            ci, d = int(rng.integers(1, 300)), int(rng.integers(0, SPEC_K + 1))
            c.append(ci)
            q.append(d + 1)
            prompt.append(ci)
            drafts.append(d)
        if mode == 2:
            for kind in rng.integers(0, 4, int(rng.integers(1, 4))).tolist():
                ci = 0 if kind >= 2 else int(rng.integers(1, 300))
                qi = 1 if kind in (0, 3) else int(rng.integers(2, 150))
                c.append(ci)
                q.append(qi)
                prompt.append(ci + qi + int(rng.integers(0, 50)))
                drafts.append(0)
    n = len(q)
    s = np.array(c) + np.array(q)
    width = max(SPEC_K + 1, int((-(-s // BLOCK)).max())) + int(rng.integers(0, 3))
    table = (1 + rng.permutation(n * width)).reshape(n, width).astype(np.int32)
    pad = int(rng.integers(0, 3))
    spec = BatchSpec(num_computed_tokens=np.array(c, np.int32), num_scheduled_tokens=np.array(q, np.int32),
                     num_prompt_tokens=np.array(prompt, np.int32),
                     num_draft_tokens=np.array(drafts, np.int32) if drafts else None, block_table=table,
                     block_size=BLOCK, num_reqs_padded=n + pad,
                     num_tokens_padded=int(sum(q)) + (int(rng.integers(0, 5)) if pad else 0))
    if mode == 0:
        return spec, GDNOptions(), None
    staged = mode == 1 and rng.random() < 0.5
    opts = GDNOptions(num_speculative_tokens=SPEC_K, cudagraph_max_bs=512 if staged else None)
    acc = np.where(spec_rows(spec, SPEC_K), rng.integers(1, SPEC_K + 2, n), 1).astype(np.int32)
    return spec, opts, acc


def spec_rows(spec: BatchSpec, k: int) -> np.ndarray:
    """(num_reqs,) bool: rows that take the spec path, by vLLM 0.33.0's runner rule (``k > 0``; ``d > 0``
    drafts all scheduled with the bonus token, ``q == d + 1``, or one token past the prompt, ``q == 1``
    and ``c >= prompt``). A one-token prompt chunk is not one."""
    d = spec.num_draft_tokens
    if not k or d is None:
        return np.zeros(spec.num_reqs, bool)
    q, c = spec.num_scheduled_tokens, spec.num_computed_tokens
    past_prompt = np.ones(spec.num_reqs, bool) if spec.num_prompt_tokens is None else c >= spec.num_prompt_tokens
    return np.asarray(((d > 0) & (q == d + 1)) | ((q == 1) & past_prompt))


def inputs(spec: BatchSpec, seed: int) -> dict[str, torch.Tensor]:
    """Host inputs of ``seed``: ``q``, ``k`` (T, H, K) unit-norm, ``v`` (T, HV, V), ``beta`` (T, HV) in
    :data:`DTYPE`; ``g`` (T, HV) float32 log decays; the state ``pool`` (slots, HV, K, V) float32."""
    gen = torch.Generator().manual_seed(seed)
    T = spec.num_tokens if spec.num_tokens_padded is None else spec.num_tokens_padded
    qk = torch.nn.functional.normalize(torch.randn((2, T, H, K), generator=gen), dim=-1)
    return {
        "q": qk[0].to(DTYPE),
        "k": qk[1].to(DTYPE),
        "v": torch.randn((T, HV, V), generator=gen).to(DTYPE),
        "beta": torch.sigmoid(torch.randn((T, HV), generator=gen)).to(DTYPE),
        "g": torch.nn.functional.logsigmoid(torch.randn((T, HV), generator=gen) + 2.0),
        "pool": torch.randn((int(spec.block_table.max()) + 1, HV, K, V), generator=gen),
    }


# ------------------------------------------------------------------------------------------------
# the float64 reference (the spec's rows and block table; never the metadata)
# ------------------------------------------------------------------------------------------------


def recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's gated delta rule in float64: outputs (L, HV, V) and the final state (HV, K, V)."""
    rep = HV // H
    q, k = q.double().repeat_interleave(rep, 1), k.double().repeat_interleave(rep, 1)
    v, g, beta = v.double(), g.double(), beta.double()
    s = state.double().clone()
    out = torch.empty((q.shape[0], HV, V), dtype=torch.float64)
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = SCALE * torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def reference(spec: BatchSpec, x: dict[str, torch.Tensor], k: int, acc: np.ndarray | None,
              ) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """Every real token's output (num_tokens, HV, V), the pool after the step (float64), written slots."""
    pool = x["pool"].double().clone()
    out = torch.zeros((spec.num_tokens, HV, V), dtype=torch.float64)
    is_spec = spec_rows(spec, k)
    written: set[int] = set()
    a = 0
    for i in range(spec.num_reqs):
        qi, ci = int(spec.num_scheduled_tokens[i]), int(spec.num_computed_tokens[i])
        if is_spec[i]:
            assert acc is not None
            src, dst = int(spec.block_table[i, int(acc[i]) - 1]), int(spec.block_table[i, qi - 1])
            h0 = x["pool"][src]
        else:
            src = dst = int(spec.block_table[i, 0])
            h0 = x["pool"][src] if ci > 0 else torch.zeros((HV, K, V))
        rows = slice(a, a + qi)
        out[rows], pool[dst] = recurrence(x["q"][rows], x["k"][rows], x["v"][rows], x["g"][rows], x["beta"][rows], h0)
        written.add(dst)
        a += qi
    return out, pool, written


# ------------------------------------------------------------------------------------------------
# the kernels, driven by the metadata alone
# ------------------------------------------------------------------------------------------------


def run_kernels(m: GDNMetadata, x: dict[str, torch.Tensor], pool: torch.Tensor, recurrent: Recurrent,
                chunked: Recurrent) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, int]]]:
    """Run the step's spec-decode, decode and prefill kernels on device inputs ``x``, updating ``pool``
    in place.

    ``recurrent`` / ``chunked`` take ``(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices)``
    with token-major (T, heads, dim) inputs and return (outputs (T, HV, V), final states (N, HV, K, V)).

    Returns
    -------
    tuple
        The outputs (num_actual_tokens, HV, V) float32, and for each kernel that ran the tokens it
        wrote (int64, device) and its rows.
    """
    dev = pool.device
    out = torch.zeros((m.num_actual_tokens, HV, V), dtype=torch.float32, device=dev)
    before = pool.clone()
    ran: dict[str, tuple[torch.Tensor, int]] = {}

    def take(tok: torch.Tensor) -> list[torch.Tensor]:
        return [x[name][tok] for name in ("q", "k", "v", "g", "beta")]

    if m.num_spec_decodes:
        ts, si, na, cu = m.spec_token_indx, m.spec_state_indices_tensor, m.num_accepted_tokens, m.spec_query_start_loc
        assert ts is not None and si is not None and na is not None and cu is not None
        tok = ts.long()
        h0 = before[si.gather(1, (na.long() - 1)[:, None])[:, 0].long()]
        o, ht = recurrent(*take(tok), h0, cu, None)
        last = (cu[1:] - cu[:-1] - 1).clamp_min(0).long()
        pool[si.gather(1, last[:, None])[:, 0].long()] = ht
        out[tok] = o.float()
        ran["spec"] = (tok, m.num_spec_decodes)
    if m.num_decodes:
        D = m.num_decodes
        cu, idx = m.non_spec_query_start_loc, m.non_spec_state_indices_tensor
        assert cu is not None and idx is not None and m.non_spec_query_start_loc_cpu is not None
        tok = torch.arange(int(m.non_spec_query_start_loc_cpu[D]), device=dev)
        if tok.numel():
            o, ht = recurrent(*take(tok), before[idx[:D].long()], cu[: D + 1], None)
            pool[idx[:D].long()] = ht
            out[tok] = o.float()
            ran["decode"] = (tok, D)
    if m.num_prefills:
        cu, idx, has = m.prefill_query_start_loc, m.prefill_state_indices, m.prefill_has_initial_state
        assert cu is not None and idx is not None and has is not None and m.prefill_query_start_loc_cpu is not None
        if m.non_spec_token_indx is not None:  # spec batch: the non-spec tokens, in order
            tok = m.non_spec_token_indx.long()
        else:  # no spec path: the tokens after the decodes'
            assert m.non_spec_query_start_loc_cpu is not None
            t0 = int(m.non_spec_query_start_loc_cpu[m.num_decodes])
            tok = torch.arange(t0, t0 + int(m.prefill_query_start_loc_cpu[-1]), device=dev)
        h0 = before[idx.long()] * has[:, None, None, None]
        o, ht = chunked(*take(tok), h0, cu, m.chunk_indices)
        pool[idx.long()] = ht
        out[tok] = o.float()
        ran["prefill"] = (tok, m.num_prefills)
    return out, ran


def fla_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  h0: torch.Tensor, cu: torch.Tensor, chunk_indices: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's ``fused_recurrent_gated_delta_rule`` over the packed sequences ``cu`` (batch of 1)."""
    o, ht = fla_gdr.fused_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], scale=SCALE, initial_state=h0,
        output_final_state=True, cu_seqlens=cu)
    return o[0], ht


def fla_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                h0: torch.Tensor, cu: torch.Tensor, chunk_indices: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's ``chunk_gated_delta_rule`` with attnmeta's ``chunk_indices``, after checking them (and the
    metadata's ``chunk_offsets``, which fla derives itself) against fla's own helpers."""
    assert chunk_indices is not None
    want = fla_index.prepare_chunk_indices(cu, FLA_CHUNK_SIZE)
    assert chunk_indices.tolist() == want.tolist(), "chunk_indices differ from fla's prepare_chunk_indices"
    o, ht = fla_gdr.chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=SCALE, initial_state=h0, output_final_state=True,
        cu_seqlens=cu, chunk_indices=chunk_indices)
    return o[0], ht


# ------------------------------------------------------------------------------------------------
# the test
# ------------------------------------------------------------------------------------------------


def check_batch(seed: int, device: torch.device, recurrent: Recurrent, chunked: Recurrent,
                build: Callable[[BatchSpec, GDNOptions, np.ndarray | None], GDNMetadata],
                offsets: Callable[[torch.Tensor], torch.Tensor] | None = None,
                batch: tuple[BatchSpec, GDNOptions, np.ndarray | None] | None = None) -> dict[str, tuple[float, int]]:
    """Build ``seed``'s GDN metadata (or ``batch``'s, with ``seed``'s inputs), run the kernels, compare
    outputs and the state pool.

    Returns each kernel's (worst error, rows); ``offsets`` (fla's ``prepare_chunk_offsets``) checks
    the metadata's ``chunk_offsets``.

    Raises
    ------
    AssertionError
        An output or a pool slot outside ``atol = rtol = 3e-2`` of the float64 reference.
    """
    spec, opts, acc = random_batch(seed) if batch is None else batch
    m = build(spec, opts, acc)
    x = inputs(spec, seed)
    ref_out, ref_pool, written = reference(spec, x, opts.num_speculative_tokens, acc)
    xd = {name: t.to(device) for name, t in x.items()}
    pool = xd.pop("pool")
    if offsets is not None and m.chunk_offsets is not None and m.prefill_query_start_loc is not None:
        assert m.chunk_offsets.tolist() == offsets(m.prefill_query_start_loc).tolist(), f"seed {seed}: chunk_offsets"
    out, ran = run_kernels(m, xd, pool, recurrent, chunked)
    got = out[: spec.num_tokens].double().cpu()
    where = f"seed {seed} (spec rows {m.num_spec_decodes}, decodes {m.num_decodes}, prefills {m.num_prefills})"
    torch.testing.assert_close(got, ref_out, atol=ATOL, rtol=RTOL, msg=lambda s: f"{where}: outputs\n{s}")
    got_pool = pool.double().cpu()
    real = torch.arange(1, got_pool.shape[0])  # slot 0 is the null block: padding rows write there
    torch.testing.assert_close(got_pool[real], ref_pool[real], atol=ATOL, rtol=RTOL,
                               msg=lambda s: f"{where}: state pool\n{s}")
    err = (got - ref_out).abs()
    done: dict[str, tuple[float, int]] = {}
    for kind, (tok, rows) in ran.items():
        t = tok.cpu()
        t = t[t < spec.num_tokens]
        done[kind] = (err[t].max().item() if t.numel() else 0.0, rows)
    done["states"] = ((got_pool[real] - ref_pool[real]).abs().max().item(), len(written))
    return done


NAMES = {"decode": "fla fused_recurrent_gated_delta_rule, decode rows",
         "spec": "fla fused_recurrent_gated_delta_rule, spec-decode rows",
         "prefill": "fla chunk_gated_delta_rule, prefill rows",
         "states": "state pool after the step (all kernels), written slots"}


def audited_build(stager: Stager) -> Callable[[BatchSpec, GDNOptions, np.ndarray | None], GDNMetadata]:
    """The GDN builder on ``stager``, every build under the sync audit."""

    def build(spec: BatchSpec, opts: GDNOptions, acc: np.ndarray | None) -> GDNMetadata:
        with audited():
            m: GDNMetadata = build_gdn(spec, stager, opts, GDNInputs(num_accepted_tokens=acc))
        return m

    return build


@pytest.mark.parametrize("seed", SEEDS)
def test_gdn_metadata_drives_fla_kernels(seed: int) -> None:
    dev = torch.device("cuda")
    done = check_batch(seed, dev, fla_recurrent, fla_chunked, audited_build(Stager(dev)),
                       lambda cu: fla_index.prepare_chunk_offsets(cu, FLA_CHUNK_SIZE))
    for kind, (err, rows) in done.items():
        record(NAMES[kind], err, rows)


def test_a_fresh_one_token_prompt_starts_from_zeros_not_a_recycled_state_slot() -> None:
    """Spec decode on (``k = 2``): a fresh request whose first prompt chunk is one token is a prefill
    without initial state (vLLM's runner gives it -1 drafts), as is a one-token chunk in the middle of a
    prompt (which continues its state). The fresh row's state slot holds another request's state (the
    pool is random), which a spec-path read would take as its initial state."""
    spec = BatchSpec(num_computed_tokens=[50, 30, 0, 7], num_scheduled_tokens=[3, 1, 1, 1],
                     num_prompt_tokens=[20, 30, 10, 12], num_draft_tokens=[2, 0, 0, 0],
                     block_table=(1 + np.arange(4 * 8, dtype=np.int32)).reshape(4, 8), block_size=BLOCK)
    acc = np.array([2, 1, 2, 3], np.int32)  # the counts a recycled row's stale entries might hold
    opts = GDNOptions(num_speculative_tokens=SPEC_K)
    assert spec_rows(spec, SPEC_K).tolist() == [True, True, False, False]
    dev = torch.device("cuda")
    done = check_batch(1000, dev, fla_recurrent, fla_chunked, audited_build(Stager(dev)), batch=(spec, opts, acc))
    assert set(done) == {"spec", "prefill", "states"}
    for kind, (err, rows) in done.items():
        record(NAMES[kind], err, rows)
