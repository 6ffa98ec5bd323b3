"""Micro-batching (DBO) of vLLM 0.33.0's V2 model runner (``vllm/v1/worker/gpu/``) against attnmeta's
:mod:`attnmeta.ubatch` (marker ``vllm``), on generated batches, CPU tensors.

attnmeta matches the V1 runner's micro-batching (tests/integrations/test_vllm_differential.py). The V2
runner plans the same way (it calls V1's ``maybe_create_ubatch_slices``) but builds each micro-batch
differently (vllm/v1/worker/gpu/ubatch_utils.py):

- ``create_ubatch_slices`` (49-75) takes the PADDED slices and clamps each request slice to
  ``[min(start, num_reqs - 1), min(stop, num_reqs_after_padding))``;
- ``_slice_input_batch`` (78-199) rebases ``query_start_loc`` by ``clamp(qsl[r0:r1+1] - t0, 0, n_tok)``,
  cuts the last row's ``seq_lens`` / upper bound by the tokens past ``t1``, counts only real rows and
  tokens (``num_reqs``, ``num_tokens``) and takes ``max_query_len`` from the clipped offsets;
- ``UBatchRunner.prepare`` (335-393) hands it to ``DefaultModelState.prepare_attn``
  (model_states/default.py:167-247): FULL graphs use the micro-batch's padded counts, eager its real
  ones; ``max_seq_len`` is the micro-batch's own upper bound (not the parent's, as V1's
  ``split_attn_metadata`` gives); ``is_prefilling`` the parent's rows; the slot mapping and positions
  its whole (padded) token slice.

And, unlike V1 (``is_last_ubatch_empty`` in vllm/v1/worker/dp_utils.py:91 turns micro-batching off),
V2's DP sync (vllm/v1/worker/gpu/dp_utils.py:103-152) pads every rank to the LARGEST rank's token count
and micro-batches anyway, so a smaller rank's last micro-batch can be entirely padding: its request
slice clamped onto the last real request with a zero-length query (ubatch_utils.py:52-56).

V2 micro-batching is reachable only with ``VLLM_USE_V2_MODEL_RUNNER=1``: with the variable unset,
``--enable-dbo`` (or ``--ubatch-size > 1``) makes ``VllmConfig.use_v2_model_runner`` pick the V1 runner
(config/vllm.py:731-767, 3222-3230). :func:`test_dbo_picks_v1_runner_unless_v2_is_forced` checks this on
vLLM's real ``VllmConfig``.

What runs of vLLM: its real ``create_ubatch_slices``, ``_slice_input_batch``, ``UBatchRunner.prepare``,
``DefaultModelState.prepare_attn`` and ``build_attn_metadata``. Stubbed, because they need CUDA or
Triton: the ``UBatchRunner`` instance (its ``__init__`` makes CUDA streams; :class:`_V2Runner` holds the
attributes ``prepare`` reads, and its ``_make_forward_contexts`` returns the metadata instead of forward
contexts), the model state's instance attributes, an attention group whose builder returns the
``CommonAttentionMetadata`` it is given, and the runner's Triton kernels that fill the parent batch
(``prepare_pos_seq_lens``, ``gather_block_tables``, ``compute_slot_mappings``): :func:`v2_parent`
computes their outputs in torch by their rules (padding rows: seq_len 0 and block row 0; padding tokens:
slot -1; stale positions are written 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager
from attnmeta.testing.strategies import batch_specs
from attnmeta.ubatch import UBatchSlice, is_last_ubatch_empty, stage_ubatches, ubatch_slices

pytestmark = pytest.mark.vllm

INSTALL = ("vLLM 0.33.0 is not importable here: bash tests/integrations/install_vllm.sh ENV, then "
           "ENV/bin/python -m pytest -m vllm tests/integrations (docs/testing.md, 'Test your own builder')")
pytest.importorskip("vllm.v1.worker.gpu.ubatch_utils", reason=INSTALL)

from profile_helpers import scaled_examples  # noqa: E402
from vllm.config import CUDAGraphMode, DeviceConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.v1.worker.dp_utils import _post_process_ubatch as v1_post_process_ubatch  # noqa: E402
from vllm.v1.worker.gpu import dp_utils as v2_dp_utils  # noqa: E402
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch  # noqa: E402
from vllm.v1.worker.gpu.model_states.default import DefaultModelState  # noqa: E402
from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, create_ubatch_slices  # noqa: E402
from vllm_runner import assert_same_as_vllm, host_copy  # noqa: E402

CPU = torch.device("cpu")
LAYER = "model.layers.0.self_attn.attn"
KINDS = ("decode", "prefill", "chunked_prefill")
"""What V2 micro-batches: no spec decode (config/vllm.py:3238, 'dual batch overlap with speculative decoding')."""
TALLY: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    for name, cases in sorted(TALLY.items()):
        print(f"\nDIFFERENTIAL V2 {name}: {cases} cases compared with vLLM 0.33.0")


def _count(name: str) -> None:
    TALLY[name] = TALLY.get(name, 0) + 1


def _same(field: str, got: Any, want: Any, *, dtype: bool = True) -> None:
    assert_same_as_vllm(field, got, want, dtype=dtype, vllm="vLLM V2")


# ============================================================================ vLLM's V2 runner, on CPU
def v2_parent(spec: BatchSpec, num_tokens_padded: int, num_reqs_padded: int
              ) -> tuple[InputBatch, tuple[torch.Tensor, ...], torch.Tensor]:
    """The parent ``InputBatch``, block tables and slot mappings V2's ``prepare_inputs`` /
    ``prepare_attn`` (gpu/model_runner.py:1388-1615) make for ``spec``'s real rows, padded to
    ``num_tokens_padded`` tokens (the DP max or the FULL graph's size) and ``num_reqs_padded`` rows (the
    FULL graph's; eager: the real count). The Triton kernels' outputs are computed in torch."""
    B, T, bs = spec.num_reqs, spec.num_tokens, spec.block_size
    Tp, Bp = num_tokens_padded, num_reqs_padded
    c = spec.num_computed_tokens.astype(np.int64)
    q = spec.num_scheduled_tokens.astype(np.int32)
    qsl_np = np.full(Bp + 1, T, np.int32)  # padding rows: num_tokens (model_runner.py:1468)
    qsl_np[0] = 0
    np.cumsum(q, out=qsl_np[1:B + 1])
    seq_lens = torch.zeros(Bp, dtype=torch.int32)  # _prepare_pos_seq_lens_kernel: padding rows 0
    seq_lens[:B] = torch.from_numpy((c + q).astype(np.int32))
    ub = c + q if spec.seq_lens_upper_bound is None else spec.seq_lens_upper_bound.astype(np.int64)
    ub_cpu = np.zeros(Bp, np.int32)  # model_runner.py:1536: padded entries left at zero
    ub_cpu[:B] = ub
    req = np.repeat(np.arange(B), q)
    pos = c[req] + (np.arange(T) - qsl_np[req])
    positions = torch.zeros(Tp, dtype=torch.int64)
    positions[:T] = torch.from_numpy(pos)
    table = torch.zeros((Bp, spec.block_table.shape[1]), dtype=torch.int32)  # gather kernel zeroes padding
    table[:B] = torch.from_numpy(spec.block_table[:B])
    slots = torch.full((1, Tp), -1, dtype=torch.int64)  # PAD_SLOT_ID past num_tokens
    slots[0, :T] = torch.from_numpy(spec.block_table[req, pos // bs].astype(np.int64) * bs + pos % bs)
    prompt = (np.zeros(B, np.int32) if spec.num_prompt_tokens is None
              else spec.num_prompt_tokens.astype(np.int32))
    done_prefill = np.minimum(c, prompt).astype(np.int32)
    is_prefilling = done_prefill < prompt  # model_runner.py:1338
    idx = _idx(B)
    batch = InputBatch(
        req_ids=[f"r{i}" for i in range(B)], num_reqs=B, num_reqs_after_padding=Bp,
        idx_mapping=torch.from_numpy(idx.astype(np.int64)), idx_mapping_np=idx,
        expanded_idx_mapping=torch.from_numpy(idx.astype(np.int64)),
        expanded_local_pos=torch.zeros(B, dtype=torch.int32),
        num_scheduled_tokens=q, num_tokens=T, num_tokens_after_padding=Tp, num_draft_tokens=0,
        num_draft_tokens_per_req=None,
        query_start_loc=torch.from_numpy(qsl_np.copy()), query_start_loc_np=qsl_np,
        seq_lens=seq_lens, seq_lens_cpu_upper_bound=torch.from_numpy(ub_cpu), dcp_local_seq_lens=None,
        num_computed_tokens_np=c.astype(np.int32), prefill_len_np=prompt,
        num_computed_prefill_tokens_np=done_prefill, is_prefilling_np=is_prefilling,
        has_prefill=bool(is_prefilling.any()), decode_graph_eligible=not bool(is_prefilling.any()),
        input_ids=torch.zeros(Tp, dtype=torch.int32), positions=positions,
        is_padding=torch.arange(Tp) >= T,
        logits_indices=torch.from_numpy(qsl_np[1:B + 1] - 1), cu_num_logits=torch.arange(B + 1, dtype=torch.int32),
        cu_num_logits_np=np.arange(B + 1, dtype=np.int32), has_structured_output_reqs=False, prompt_lens=None,
    )
    return batch, (table,), slots


def _idx(num_reqs: int) -> np.ndarray:
    """The batch-state rows of the step's requests (``idx_mapping``): any permutation, here reversed + 3."""
    return np.arange(num_reqs, dtype=np.intp)[::-1] + 3


class _Builder:
    supports_update_block_table = False


class _Group:
    """An attention group whose builder returns the ``CommonAttentionMetadata`` it gets."""

    layer_names: ClassVar[list[str]] = [LAYER]
    kv_cache_spec = None

    def get_metadata_builder(self, ubatch_idx: int = 0) -> _Builder:
        return _Builder()

    def build_metadata(self, common: Any, ubatch_idx: int = 0, **kwargs: Any) -> Any:
        return common


class _ModelState:
    """What ``DefaultModelState.prepare_attn`` reads of its instance (a text-only model)."""

    prepare_attn = DefaultModelState.prepare_attn
    supports_mm_inputs = False
    encoder_cache = None
    model_config = None
    max_model_len = 1 << 16


class _V2Runner:
    """What ``UBatchRunner.prepare`` reads of its instance (``UBatchRunner.__init__`` makes CUDA streams and
    an SM-control context); no decode context parallelism (V2 refuses it under DBO, config/vllm.py:3242)."""

    prepare = UBatchRunner.prepare

    def __init__(self, num_ubatches: int, max_num_reqs: int) -> None:
        self.num_ubatches = num_ubatches
        self.dcp_size, self.dcp_rank, self.cp_interleave = 1, 0, 1
        self.ubatch_query_start_loc = [torch.zeros(max_num_reqs + 1, dtype=torch.int32) for _ in range(num_ubatches)]
        self.ubatch_seq_lens = [torch.zeros(max_num_reqs, dtype=torch.int32) for _ in range(num_ubatches)]
        self.ubatch_dcp_local_seq_lens: list[torch.Tensor | None] = [None] * num_ubatches
        self.model_state = _ModelState()
        self.attn_groups = [[_Group()]]
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[LAYER])])

    def _make_forward_contexts(self, slices: Any, attn_metadata: list[dict[str, Any]], slot_mappings: Any,
                               is_padding: Any) -> list[Any]:
        return [m[LAYER] for m in attn_metadata]


def v2_ubatches(spec: BatchSpec, num_tokens_padded: int, num_reqs_padded: int, n: int, *, full: bool
                ) -> tuple[list[tuple[slice, slice]], list[Any]]:
    """V2's micro-batch slices and the ``CommonAttentionMetadata`` each micro-batch's builders get."""
    batch, tables, slots = v2_parent(spec, num_tokens_padded, num_reqs_padded)
    runner = _V2Runner(n, max(num_reqs_padded, 1) + 1)
    mode = CUDAGraphMode.FULL if full else CUDAGraphMode.NONE
    state = runner.prepare(batch, tables, slots, cg_mode=mode)
    assert [(s.request_slice, s.token_slice) for s in create_ubatch_slices(batch, n)] == \
        [(s.request_slice, s.token_slice) for s in state.slices]
    return [(s.request_slice, s.token_slice) for s in state.slices], list(state.forward_contexts)




# ============================================================================ comparisons
DOCUMENTED = {
    "max_seq_len": "V2: the micro-batch's own bound, max of its (cut) seq_lens_cpu_upper_bound "
                   "(gpu/model_states/default.py:199, cut at gpu/ubatch_utils.py:139-144); attnmeta and V1's "
                   "split_attn_metadata: the parent's (vllm/v1/worker/ubatch_utils.py:303)",
    "eager token tensors": "V2 eager: slot_mapping and positions span the micro-batch's padded token slice "
                           "(gpu/ubatch_utils.py:189-191, 367) while num_actual_tokens counts its real tokens "
                           "(gpu/ubatch_utils.py:114, default.py:186); attnmeta (unpadded slices, as V1 eager): "
                           "the real tokens only. Equal on [:num_actual_tokens]; V2's tail is PAD_SLOT_ID",
    "FULL is_prefilling rows": "V2: is_prefilling and req_idx hold the micro-batch's REAL rows only "
                               "(is_prefilling_np has num_reqs entries, sliced at gpu/ubatch_utils.py:183), fewer "
                               "than num_reqs under FULL graphs; attnmeta: num_reqs rows, padding False",
}
"""The differences the checks step around (each comparison says where) and why."""


def _check_v2_extras(name: str, want: Any, idx_rows: np.ndarray) -> None:
    """The V2 fields attnmeta has no counterpart for, as V2 sets them on a plain text model without DCP."""
    for field in ("dcp_local_seq_lens", "dcp_local_seq_lens_cpu_upper_bound", "mm_req_doc_ranges", "rswa_prefix_lens",
                  "logits_indices_padded", "num_logits_indices", "max_logits_per_req", "encoder_seq_lens"):
        assert getattr(want, field) is None, f"{name}.{field}"
    assert want.causal is True
    assert np.array_equal(want.req_idx, idx_rows), f"{name}.req_idx"


def _compare(name: str, got: Any, want: Any, *, full: bool, parent_max_seq_len: int) -> bool:
    """attnmeta's micro-batch against V2's, every field; returns whether ``max_seq_len`` differed."""
    for field in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound"):
        _same(f"{name}.{field}", getattr(got, field), getattr(want, field))
    _same(f"{name}.seq_lens_cpu", got.seq_lens_cpu, want.seq_lens)
    _same(f"{name}.num_computed_tokens_cpu", got.num_computed_tokens_cpu, want.compute_num_computed_tokens())
    _same(f"{name}.block_table_tensor", got.block_table_tensor, want.block_table_tensor)
    _same(f"{name}.block_table_cpu", got.block_table_cpu, want.block_table_tensor)
    assert (got.num_reqs, got.num_actual_tokens, got.max_query_len, got.causal) == (
        want.num_reqs, want.num_actual_tokens, want.max_query_len, want.causal), name
    real = got.num_real_tokens
    _same(f"{name}.positions[:real]", got.positions[:real], want.positions[:real])
    if full:
        _same(f"{name}.slot_mapping", got.slot_mapping, want.slot_mapping)
        assert got.positions.shape == want.positions.shape
        # DOCUMENTED["FULL is_prefilling rows"]
        v2_rows = want.is_prefilling.shape[0]
        _same(f"{name}.is_prefilling[:v2 rows]", got.is_prefilling[:v2_rows], want.is_prefilling, dtype=False)
        assert v2_rows == got.num_real_reqs and not got.is_prefilling[v2_rows:].any()
    else:
        # DOCUMENTED["eager token tensors"]
        n = got.num_actual_tokens
        _same(f"{name}.slot_mapping", got.slot_mapping, want.slot_mapping[:n])
        assert (host_copy(want.slot_mapping[n:]) == -1).all(), f"{name}: V2's slot tail is not padding"
        _same(f"{name}.is_prefilling", got.is_prefilling, want.is_prefilling, dtype=False)
    # DOCUMENTED["max_seq_len"]: V2 the micro-batch's own, attnmeta the parent's
    ub = host_copy(got.seq_lens_cpu_upper_bound)[:got.num_real_reqs]
    assert want.max_seq_len == int(ub.max()), f"{name}: V2 max_seq_len {want.max_seq_len} != own {int(ub.max())}"
    assert got.max_seq_len == parent_max_seq_len, name
    return bool(got.max_seq_len != want.max_seq_len)


def _pairs(slices: Any) -> list[tuple[slice, slice]]:
    return [(s.request_slice, s.token_slice) for s in slices]


def _expected_all_padding(spec: BatchSpec, Tp: int, Bp: int, n: int, k: int, *, full: bool) -> dict[str, Any]:
    """V2's micro-batch ``k`` when it holds no real token (``t0 >= T``); what attnmeta would have to return:
    the last real row, clamped in (gpu/ubatch_utils.py:69), with a zero-length query and its full length."""
    B, T = spec.num_reqs, spec.num_tokens
    t0 = (Tp // n) * k
    t1 = Tp if k == n - 1 else (Tp // n) * (k + 1)
    assert t0 >= T
    stop = Bp if k == n - 1 else min(B + 1, Bp)  # raw stop searchsorted(cu, t1) = B + 1, clamped
    rows = stop - (B - 1)
    num_reqs = rows if full else 1
    last = B - 1
    s = int(spec.num_computed_tokens[last] + spec.num_scheduled_tokens[last])
    u = s if spec.seq_lens_upper_bound is None else int(spec.seq_lens_upper_bound[last])
    seq = np.zeros(num_reqs, np.int32)
    seq[0] = s
    ub = np.zeros(num_reqs, np.int32)
    ub[0] = u
    table = np.zeros((num_reqs, spec.block_table.shape[1]), np.int32)
    table[0] = spec.block_table[last]
    pre = bool(spec.num_prompt_tokens is not None and spec.num_computed_tokens[last] < spec.num_prompt_tokens[last])
    return dict(slices=(slice(B - 1, stop), slice(t0, t1)), query_start_loc=np.zeros(num_reqs + 1, np.int32),
                seq_lens=seq, seq_lens_cpu_upper_bound=ub, block_table_tensor=table,
                slot_mapping=np.full(t1 - t0, -1, np.int64), num_reqs=num_reqs,
                num_actual_tokens=t1 - t0 if full else 0, max_query_len=0, max_seq_len=u,
                is_prefilling=np.array([pre]))


def _check_all_padding(name: str, want: Any, sl: tuple[slice, slice], exp: dict[str, Any]) -> None:
    assert sl == exp["slices"], f"{name}: slices {sl} != {exp['slices']}"
    for field in ("query_start_loc", "seq_lens", "seq_lens_cpu_upper_bound", "block_table_tensor", "slot_mapping",
                  "is_prefilling"):
        _same(f"{name}.{field} (expected <- V2)", exp[field], getattr(want, field))
    _same(f"{name}.query_start_loc_cpu (expected <- V2)", exp["query_start_loc"], want.query_start_loc_cpu)
    for field in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
        assert getattr(want, field) == exp[field], f"{name}.{field}: V2 {getattr(want, field)} != {exp[field]}"


# ============================================================================ tests
@st.composite
def v2_cases(draw: st.DrawFn, *, full: bool) -> tuple[BatchSpec, int, int, int]:
    """A V2 step of real rows (decode, prefill, chunked prefill; no spec decode, which V2 refuses under DBO),
    its padded counts and the number of micro-batches. Eager: rows unpadded, tokens padded to a larger DP
    rank's count (gpu/dp_utils.py:120, 138-142; model_runner.py:1396). FULL: rows and tokens padded to a
    graph's size, only when ``2 * T >= Tp`` (else V2 falls back to eager, gpu/dp_utils.py:133-136); V2
    captures micro-batched FULL graphs for uniform decodes only (gpu/cudagraph_utils.py:229-255), but its
    slicing does not look at the rows' kinds, so any rows are drawn. ``T >= n`` always (the DBO thresholds are at least ``n``, config/parallel.py:1180-1186)."""
    n = draw(st.sampled_from([2, 2, 3]))
    spec = draw(batch_specs(min_reqs=1, max_reqs=8, max_query_len=40, max_context_len=120, kinds=KINDS,
                            with_padding=st.just(False)).filter(lambda s: s.num_tokens >= n))
    T, B = spec.num_tokens, spec.num_reqs
    if full:
        edge = draw(st.sampled_from([False, False, False, True]))  # Tp = 2T: the all-padding case FULL keeps
        Tp = 2 * T if edge else draw(st.integers(T, 2 * T))
        Bp = draw(st.integers(B, max(B, min(Tp, B + 4))))
    else:
        Tp = draw(st.integers(T, 3 * T + 8))
        Bp = B
    return spec, Tp, Bp, n


def _run(spec: BatchSpec, Tp: int, Bp: int, n: int, *, full: bool) -> str:
    """V2's micro-batches of ``spec`` against attnmeta's; returns the kind of case compared."""
    T, B = spec.num_tokens, spec.num_reqs
    q = spec.num_scheduled_tokens
    slices, want = v2_ubatches(spec, Tp, Bp, n, full=full)
    assert len(want) == n
    if is_last_ubatch_empty(T, Tp, n):
        # V2 micro-batches it anyway; attnmeta (as V1, dp_utils.py:91) refuses it
        with pytest.raises(ValueError, match="without a real token"):
            ubatch_slices(q, Tp, Bp, n)
        j = next(k for k in range(n) if (Tp // n) * k >= T)  # micro-batches j.. hold no real token
        assert j >= 1
        for k in range(j, n):
            _check_all_padding(f"ubatch {k}", want[k], slices[k], _expected_all_padding(spec, Tp, Bp, n, k, full=full))
            _check_v2_extras(f"ubatch {k}", want[k], _idx(B)[B - 1:])
        # the others are attnmeta's micro-batches of the same rows and tokens (eager: up to the real ones)
        mine = [UBatchSlice(slice(rs.start, rs.stop if full else min(rs.stop, B)),
                            slice(ts.start, ts.stop if full else min(ts.stop, T))) for rs, ts in slices[:j]]
        _stage_and_compare(spec, Tp, Bp, mine, want[:j], slices[:j], full=full)
        return "all-padding micro-batch (attnmeta refuses)"
    plan = ubatch_slices(q, Tp, Bp, n)
    assert _pairs(plan.padded_slices) == slices, "plan"
    differed = _stage_and_compare(spec, Tp, Bp, plan.padded_slices if full else plan.slices, want, slices, full=full)
    return "equal but documented" + (" (max_seq_len differed)" if differed else "")


def _stage_and_compare(spec: BatchSpec, Tp: int, Bp: int, mine: Sequence[UBatchSlice], want: list[Any],
                       slices: list[tuple[slice, slice]], *, full: bool) -> bool:
    """attnmeta's ``stage_ubatches`` on ``mine`` (FULL: over the padded parent; eager: the unpadded one)
    against V2's micro-batches ``want``; returns whether a ``max_seq_len`` differed."""
    parent = spec if not full else dataclasses.replace(spec, num_reqs_padded=Bp, num_tokens_padded=Tp)
    with Stager("cpu").step() as step:
        staged = stage_ubatches(parent, step, mine, block_table_columns=spec.block_table.shape[1])
    differed = False
    for k, (g, w, (rs, _)) in enumerate(zip((s.result() for s in staged), want, slices, strict=True)):
        differed |= _compare(f"ubatch {k}", g, w, full=full, parent_max_seq_len=spec.max_seq_len)
        _check_v2_extras(f"ubatch {k}", w, _idx(spec.num_reqs)[rs.start:min(rs.stop, spec.num_reqs)])
    return differed


@settings(max_examples=scaled_examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=v2_cases(full=False))
def test_v2_eager_ubatches_equal_attnmeta_but_documented(case: tuple[BatchSpec, int, int, int]) -> None:
    """V2 eager (cudagraph NONE; tokens padded to the largest DP rank's count) against ``ubatch_slices`` +
    ``stage_ubatches`` on the unpadded slices (the V1 eager form): equal but for :data:`DOCUMENTED`; when
    the last micro-batch holds no real token V2 still runs it (checked against :func:`_expected_all_padding`)
    and attnmeta raises."""
    spec, Tp, Bp, n = case
    _count("eager: " + _run(spec, Tp, Bp, n, full=False))


@settings(max_examples=scaled_examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=v2_cases(full=True))
def test_v2_full_graph_ubatches_equal_attnmeta_but_documented(case: tuple[BatchSpec, int, int, int]) -> None:
    """V2 under FULL graphs (rows and tokens padded; metadata at padded counts) against ``stage_ubatches`` on the
    padded slices of the padded parent: equal but for :data:`DOCUMENTED`; an all-padding last micro-batch
    (``2T == Tp``) as in the eager test."""
    spec, Tp, Bp, n = case
    _count("FULL: " + _run(spec, Tp, Bp, n, full=True))


# ============================================================================ when V2 micro-batches, and how
@pytest.mark.parametrize(("env", "dbo", "v2"), [
    (None, False, True),   # V2 is the default runner ...
    (None, True, False),   # ... but DBO falls back to V1 unless V2 is forced (config/vllm.py:3229-3230)
    ("1", True, True),     # VLLM_USE_V2_MODEL_RUNNER=1: V2 micro-batches (the only way to get there)
    ("0", True, False),
])
def test_dbo_picks_v1_runner_unless_v2_is_forced(monkeypatch: pytest.MonkeyPatch, env: str | None, dbo: bool,
                                                 v2: bool) -> None:
    """vLLM's real ``VllmConfig.use_v2_model_runner`` (config/vllm.py:731-767): with micro-batching on, the V1
    runner unless ``VLLM_USE_V2_MODEL_RUNNER`` is set (``_get_dbo_unsupported_features``, 3222-3230)."""
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    pc = ParallelConfig(enable_dbo=dbo, data_parallel_size=2, all2all_backend="deepep_low_latency")
    cfg = VllmConfig(parallel_config=pc, device_config=DeviceConfig(device="cpu"))
    assert pc.use_ubatching == dbo
    assert cfg.use_v2_model_runner is v2


class _TwoRanks:
    """The DP group's CPU all-reduce of two ranks: fills in the other rank's column (the sum of the two)."""

    def __init__(self, other: list[int]) -> None:
        self.other = other

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor[:, 1] = torch.tensor(self.other, dtype=tensor.dtype)
        return tensor


def test_v2_dp_sync_pads_to_the_largest_rank_and_micro_batches_where_v1_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two DP ranks, 600 and 2000 tokens (both past the 512-token prefill threshold), eager: V2's real
    ``sync_cudagraph_and_dp_padding`` (gpu/dp_utils.py:103-152; only the DP group's all-reduce stubbed)
    micro-batches rank 0 padded to 2000, so its split point 1000 leaves its last micro-batch all padding;
    V1's ``_post_process_ubatch`` (dp_utils.py:79-96) on the same counts turns micro-batching off."""
    monkeypatch.setattr(v2_dp_utils, "get_dp_group", lambda: _TwoRanks([2000, 0, 0, -1, 1, 5, 0]))
    pc = ParallelConfig(enable_dbo=True, data_parallel_size=2, all2all_backend="deepep_low_latency")
    desired = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=600, num_reqs=2)
    desc, sync = v2_dp_utils.sync_cudagraph_and_dp_padding(
        None, desired, 600, 2, None, 2, 0, parallel_config=pc, allow_ubatching=True)
    assert (desc.cg_mode, desc.num_tokens, desc.num_reqs, desc.num_ubatches) == (CUDAGraphMode.NONE, 2000, 2, 2)
    assert sync is not None and sync.num_tokens_across_dp.tolist() == [2000, 2000]
    assert is_last_ubatch_empty(600, 2000, 2)
    v1 = torch.tensor([[600, 2000], [600, 2000], [1, 1], [0, 0]], dtype=torch.int32)
    assert v1_post_process_ubatch(v1, 2) is False


REPRO = BatchSpec(num_computed_tokens=[9, 4], num_scheduled_tokens=[1, 3], num_prompt_tokens=[5, 20],
                  block_table=[[1, 2, 3, 0], [4, 5, 0, 0]], block_size=4)
"""A decode (9 + 1) and a prefill chunk (4 + 3 of a 20-token prompt): 4 tokens on a rank whose DP peer has 10
(thresholds lowered to 4; with the defaults read 600 and 2000, as above)."""


def test_all_padding_last_ubatch_minimal_repro() -> None:
    """V2 micro-batches ``REPRO`` padded to 10 tokens: split at 5, micro-batch 1 is tokens [5, 10), all padding.
    V2 gives it the last request with a zero-length query; attnmeta's ``ubatch_slices`` refuses the plan (as V1
    never runs it). Not default-reachable (V2 micro-batches only under ``VLLM_USE_V2_MODEL_RUNNER=1``), so this
    pins both behaviours rather than failing; the values here are what attnmeta would return to follow V2."""
    slices, (ub0, ub1) = v2_ubatches(REPRO, 10, 2, 2, full=False)
    assert slices == [(slice(0, 2), slice(0, 5)), (slice(1, 2), slice(5, 10))]
    # micro-batch 0: both rows, the 4 real tokens; its token tensors span [0, 5)
    assert (ub0.num_reqs, ub0.num_actual_tokens, ub0.max_query_len, ub0.max_seq_len) == (2, 4, 3, 10)
    assert ub0.query_start_loc_cpu.tolist() == [0, 1, 4] and ub0.seq_lens.tolist() == [10, 7]
    assert ub0.slot_mapping.tolist() == [13, 20, 21, 22, -1]  # position 9 in block 3; 4..6 in block 5; padding
    # micro-batch 1: the last request again, zero query tokens, its full length; the padding tokens' slots
    assert (ub1.num_reqs, ub1.num_actual_tokens, ub1.max_query_len, ub1.max_seq_len) == (1, 0, 0, 7)
    assert ub1.query_start_loc.tolist() == ub1.query_start_loc_cpu.tolist() == [0, 0]
    assert ub1.seq_lens.tolist() == ub1.seq_lens_cpu_upper_bound.tolist() == [7]
    assert ub1.compute_num_computed_tokens().tolist() == [7]
    assert ub1.block_table_tensor.tolist() == [[4, 5, 0, 0]]
    assert ub1.slot_mapping.tolist() == [-1] * 5 and ub1.positions.shape == (5,)
    assert ub1.is_prefilling.tolist() == [True] and ub1.req_idx.tolist() == [_idx(2)[1]]
    assert ub1.causal is True and ub1.dcp_local_seq_lens is None
    with pytest.raises(ValueError, match="micro-batch 1 without a real token"):
        ubatch_slices(REPRO.num_scheduled_tokens, 10, 2, 2)
    # FULL graphs (2 * 4 >= 8 keeps the graph, gpu/dp_utils.py:133): 8 tokens, 4 rows
    slices, (_, f1) = v2_ubatches(REPRO, 8, 4, 2, full=True)
    assert slices[1] == (slice(1, 4), slice(4, 8))
    assert (f1.num_reqs, f1.num_actual_tokens, f1.max_query_len, f1.max_seq_len) == (3, 4, 0, 7)
    assert f1.query_start_loc_cpu.tolist() == [0, 0, 0, 0] and f1.seq_lens.tolist() == [7, 0, 0]
    assert f1.is_prefilling.tolist() == [True]  # the real row only (DOCUMENTED["FULL is_prefilling rows"])
    with pytest.raises(ValueError, match="micro-batch 1 without a real token"):
        ubatch_slices(REPRO.num_scheduled_tokens, 8, 4, 2)
