"""GDN builder: vLLM 0.33.0's worked examples, the equivalence checklist, and random batches against
the device reference (docs/semantics-mamba.md, "Gated delta net")."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnmeta
from attnmeta import BatchSpec, StagedCommon, Stager, StaticProfile, stage_common
from attnmeta.backends.mamba import block_table_columns, gdn
from attnmeta.backends.mamba.gdn import GDN, GDNInputs, GDNMetadata, GDNOptions
from attnmeta.host.gdn import fla_chunk_metadata, plan_flashinfer_checkpoints, spec_token_partition
from attnmeta.testing import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference.gdn import ref_fla_chunk_metadata
from attnmeta.testing.strategies import batch_specs

I32 = np.int32


def _table(rows: int, cols: int = 8) -> np.ndarray:
    """Block ``j`` of row ``i`` is ``10 * (j + 1) + i`` (state column 0: 10, 11, ...)."""
    return (10 * (np.arange(cols)[None, :] + 1) + np.arange(rows)[:, None]).astype(I32)


def _host(a: Any) -> list[Any]:
    assert isinstance(a, np.ndarray)
    return a.tolist()


def _dev(t: Any) -> list[Any]:
    assert isinstance(t, torch.Tensor)
    return t.cpu().tolist()


def _stage_with_drafts(spec: BatchSpec, opts: GDNOptions, drafts: list[int],
                       inputs: GDNInputs | None = None) -> GDNMetadata:
    """Stage with vLLM's ``num_decode_draft_tokens_cpu`` given literally (the worked examples set it by
    hand; a BatchSpec derives it from its drafts)."""
    stager = Stager("cpu")
    with stager.step() as step:
        c = stage_common(spec, step, block_table_columns=block_table_columns(spec, opts), token_arrays=False)
        host = dataclasses.replace(c.host, num_decode_draft_tokens_cpu=np.array(drafts, I32))
        staged = gdn.stage(StagedCommon(step, host, c.result), step, opts, inputs)
    return staged.result()


# ------------------------------------------------------------------------------------------------
# worked examples (vLLM 0.33.0, section "Worked examples" of docs/semantics-mamba.md)
# ------------------------------------------------------------------------------------------------


def _example_a() -> BatchSpec:
    # q = [1, 1, 1, 70, 9, 0], s = [40, 17, 30, 100, 9, 0], is_prefilling [F, F, T, T, T, F], T = 84
    return BatchSpec(num_computed_tokens=[39, 16, 29, 30, 0], num_scheduled_tokens=[1, 1, 1, 70, 9],
                     num_prompt_tokens=[10, 10, 31, 200, 9], block_table=_table(5), block_size=16,
                     num_reqs_padded=6, num_tokens_padded=84)


def test_example_a_no_spec_mixed(device: torch.device) -> None:
    m = gdn.build(_example_a(), Stager("cpu"))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills, m.num_prefill_tokens) == (3, 3, 2, 79)
    assert (m.num_spec_decodes, m.num_spec_decode_tokens, m.num_actual_tokens) == (0, 0, 84)
    assert _dev(m.non_spec_query_start_loc) == [0, 1, 2, 3, 73, 82, 82]
    assert _dev(m.non_spec_state_indices_tensor) == [10, 11, 12, 13, 14, 0]
    assert _dev(m.has_initial_state) == [True, True, True, True, False, False]
    assert _dev(m.prefill_query_start_loc) == _host(m.prefill_query_start_loc_cpu) == [0, 70, 79, 79]
    assert _dev(m.prefill_state_indices) == [13, 14, 0]
    assert _dev(m.prefill_has_initial_state) == [True, False, False]
    assert _dev(m.chunk_indices) == [[0, 0], [0, 1], [1, 0]] and m.chunk_indices is not None
    assert m.chunk_indices.dtype == torch.int32
    assert _dev(m.chunk_offsets) == [0, 2, 3, 3] and m.chunk_offsets is not None
    assert m.chunk_offsets.dtype == torch.int64  # 23.3: int64, as torch's cumsum of int32 counts
    # conv1d metadata over all six non-spec rows, decodes included (23.3)
    assert _host(m.conv1d_nums_cpu) == [1, 1, 1, 9, 2, 0] and m.conv1d_num_programs_total == 14
    assert _host(m.conv1d_mlist_cpu) == [0, 1, 2, *[3] * 9, 4, 4] and m.conv1d_mlist_cpu is not None
    assert m.conv1d_mlist_cpu.dtype == np.int64
    assert _host(m.conv1d_offsetlist_cpu) == [0, 0, 0, *range(9), 0, 1]
    assert _dev(m.batch_ptr)[:15] == [0, 1, 2, *[3] * 9, 4, 4, -1]
    assert m.nums_dict is not None and m.nums_dict[8]["tot"] == 14
    assert m.spec_sequence_masks is None and m.spec_token_indx is None and m.num_accepted_tokens is None
    check_builder("gdn", _example_a(), device, GDNOptions())


def test_example_b_no_spec_decode_full_graph() -> None:
    """2 real decodes + 2 padding rows in graph mode: D = 4 (padding rows decode), tails 0 / last value."""
    spec = BatchSpec(num_computed_tokens=[5, 9], num_scheduled_tokens=[1, 1], num_prompt_tokens=[3, 3],
                     block_table=_table(2), block_size=4, num_reqs_padded=4)
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=32, max_blocks_per_req=8, block_size=4)
    m = gdn.build(spec, Stager("cpu", profile=prof))
    assert (m.num_decodes, m.num_prefills) == (4, 0)
    assert _dev(m.non_spec_query_start_loc) == [0, 1, 2, 2, 2]
    assert _dev(m.non_spec_state_indices_tensor) == [10, 11, 0, 0]
    assert m.has_initial_state is None and m.chunk_indices is None and m.batch_ptr is None


def _example_c(q: list[int], drafts: list[int]) -> BatchSpec:
    n = len(q)
    return BatchSpec(num_computed_tokens=[20] * n, num_scheduled_tokens=q, num_prompt_tokens=[5] * n,
                     num_draft_tokens=drafts, block_table=_table(n), block_size=16, num_reqs_padded=4)


def test_example_c_all_spec_full_graph(device: torch.device) -> None:
    spec = _example_c([3, 3, 3], [2, 2, 2])
    opts = GDNOptions(num_speculative_tokens=2, cudagraph_max_bs=16)
    acc = np.array([1, 3, 2], I32)
    m = gdn.build(spec, Stager("cpu"), opts, GDNInputs(num_accepted_tokens=acc))
    assert (m.num_spec_decodes, m.num_spec_decode_tokens, m.uniform_spec_sequence_length) == (3, 9, 3)
    assert (m.num_decodes, m.num_prefills) == (0, 0)
    assert _dev(m.spec_query_start_loc) == [0, 3, 6, 9, 9]
    assert _dev(m.spec_state_indices_tensor) == [[10, 20, 30], [11, 21, 31], [12, 22, 32], [0, 0, 0]]
    assert _dev(m.spec_sequence_masks) == [True, True, True, False]
    assert _dev(m.spec_token_indx) == list(range(9)) and m.spec_token_indx is not None
    assert m.spec_token_indx.dtype == torch.int32  # all-spec: arange, int32 (23.3)
    assert m.non_spec_token_indx is not None and m.non_spec_token_indx.dtype == torch.int32
    assert m.non_spec_token_indx.numel() == 0
    assert _dev(m.num_accepted_tokens) == [1, 3, 2, 1]
    assert m.non_spec_query_start_loc is None and m.non_spec_state_indices_tensor is None
    check_builder("gdn", spec, device, opts, GDNInputs(num_accepted_tokens=acc))
    # the capture build: q = [3, 3, 0, 0], accepted = diff(qsl) (the default)
    cap = _example_c([3, 3], [2, 2])
    m = gdn.build(cap, Stager("cpu"), opts)
    assert m.num_spec_decodes == 2 and _dev(m.num_accepted_tokens) == [3, 3, 1, 1]
    assert _dev(m.spec_query_start_loc) == [0, 3, 6, 6, 6]
    check_builder("gdn", cap, device, opts)


def test_full_staging_only_within_the_decode_graph_bound() -> None:
    """``S`` or ``St`` above ``cudagraph_max_bs`` (or FULL graphs off): no staging, S rows."""
    spec = _example_c([3, 3, 3], [2, 2, 2])
    for mbs in (None, 8):  # St = 9 > 8
        m = gdn.build(spec, Stager("cpu"), GDNOptions(num_speculative_tokens=2, cudagraph_max_bs=mbs))
        assert _dev(m.spec_query_start_loc) == [0, 3, 6, 9] and _dev(m.num_accepted_tokens) == [3, 3, 3]
        assert m.spec_state_indices_tensor is not None and m.spec_state_indices_tensor.shape == (3, 3)


def test_example_d_spec_mixed(device: torch.device) -> None:
    # q = [3, 1, 2, 6, 0], drafts [2, -1, 1, -1, -1], s = [40, 17, 23, 6, 0]
    spec = BatchSpec(num_computed_tokens=[37, 16, 21, 0], num_scheduled_tokens=[3, 1, 2, 6],
                     num_prompt_tokens=[5, 5, 5, 6], num_draft_tokens=[2, 0, 1, 0], block_table=_table(4),
                     block_size=16, num_reqs_padded=5)
    m = _stage_with_drafts(spec, GDNOptions(num_speculative_tokens=2), [2, -1, 1, -1, -1],
                           GDNInputs(num_accepted_tokens=np.array([2, 3, 1, 3], I32)))
    assert (m.num_spec_decodes, m.num_spec_decode_tokens) == (2, 5)
    assert (m.num_prefills, m.num_prefill_tokens, m.num_decodes, m.num_decode_tokens) == (2, 7, 0, 0)
    assert m.uniform_spec_sequence_length is None
    assert _dev(m.spec_query_start_loc) == [0, 3, 5]
    assert _dev(m.non_spec_query_start_loc) == _host(m.non_spec_query_start_loc_cpu) == [0, 1, 7, 7]
    assert _dev(m.spec_state_indices_tensor) == [[10, 20, 30], [12, 22, 32]]
    assert _dev(m.non_spec_state_indices_tensor) == [11, 13, 0]
    assert _dev(m.spec_token_indx) == [0, 1, 2, 4, 5] and _dev(m.non_spec_token_indx) == [3, 6, 7, 8, 9, 10, 11]
    assert m.spec_token_indx is not None and m.spec_token_indx.dtype == torch.int64  # mixed: argsort (23.3)
    assert m.non_spec_token_indx is not None and m.non_spec_token_indx.dtype == torch.int64
    assert _dev(m.num_accepted_tokens) == [2, 1]
    assert _dev(m.has_initial_state) == [True, False, False]
    assert _dev(m.prefill_query_start_loc) == [0, 1, 7, 7]  # the non-spec ones, not rebased
    assert _host(m.conv1d_nums_cpu) == [1, 1, 0]


# ------------------------------------------------------------------------------------------------
# checklist 23.3
# ------------------------------------------------------------------------------------------------


def test_fresh_one_token_prompt_is_a_prefill_and_a_resumed_one_token_chunk_a_decode(device: torch.device) -> None:
    table = _table(2)
    resumed = BatchSpec(num_computed_tokens=[10, 5], num_scheduled_tokens=[1, 1], num_prompt_tokens=[4, 10],
                        block_table=table, block_size=16)
    fresh = BatchSpec(num_computed_tokens=[10, 0], num_scheduled_tokens=[1, 1], num_prompt_tokens=[4, 1],
                      block_table=table, block_size=16)
    m = gdn.build(resumed, Stager("cpu"))
    assert (m.num_decodes, m.num_prefills) == (2, 0) and m.has_initial_state is None
    m = gdn.build(fresh, Stager("cpu"))
    assert (m.num_decodes, m.num_prefills, m.num_prefill_tokens) == (1, 1, 1)
    assert _dev(m.prefill_has_initial_state) == [False] and _dev(m.prefill_query_start_loc) == [0, 1]
    for spec in (resumed, fresh):
        check_builder("gdn", spec, device, GDNOptions())


def test_trailing_padding_rows_leave_the_prefill_count_not_the_prefill_view() -> None:
    spec = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[130], num_prompt_tokens=[200],
                     block_table=_table(1, 16), block_size=16, num_reqs_padded=3, num_tokens_padded=136)
    m = gdn.build(spec, Stager("cpu"))
    assert (m.num_decodes, m.num_prefills, m.num_prefill_tokens, m.num_actual_tokens) == (0, 1, 130, 136)
    assert _dev(m.prefill_query_start_loc) == [0, 130, 130, 130]
    assert _dev(m.chunk_offsets) == [0, 3, 3, 3] and _dev(m.chunk_indices) == [[0, 0], [0, 1], [0, 2]]


def test_spec_rows_with_more_drafts_than_k_and_bad_accepted_counts_name_the_row() -> None:
    spec = _example_c([3, 3, 3], [2, 2, 2])
    with pytest.raises(attnmeta.UnsupportedBatchError, match="num_draft_tokens"):
        gdn.build(spec, Stager("cpu"), GDNOptions(num_speculative_tokens=1))
    with pytest.raises(ValueError, match=r"num_accepted_tokens\[1\]=4 is outside \[1, 3\] \(row 1"):
        gdn.build(spec, Stager("cpu"), GDNOptions(num_speculative_tokens=2),
                  GDNInputs(num_accepted_tokens=np.array([1, 4, 1], I32)))
    with pytest.raises(attnmeta.UnsupportedBatchError, match="spec decode is off"):
        gdn.build(spec, Stager("cpu"), GDNOptions(), GDNInputs(num_accepted_tokens=np.array([1, 1, 1], I32)))


def test_graph_mode_keeps_addresses_and_writes_the_staged_tails() -> None:
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=8, block_size=16)
    stager = Stager("cpu", profile=prof)
    opts = GDNOptions(num_speculative_tokens=2, cudagraph_max_bs=16)
    a = gdn.build(_example_c([3, 3, 3], [2, 2, 2]), stager, opts)
    ptrs = {f: getattr(a, f).data_ptr() for f in ("spec_query_start_loc", "spec_state_indices_tensor",
                                                     "num_accepted_tokens", "spec_sequence_masks")}
    b = gdn.build(_example_c([3, 3], [2, 2]), stager, opts)
    assert {f: getattr(b, f).data_ptr() for f in ptrs} == ptrs
    assert _dev(b.spec_query_start_loc) == [0, 3, 6, 6, 6] and _dev(b.num_accepted_tokens) == [3, 3, 1, 1]


# ------------------------------------------------------------------------------------------------
# host kernels
# ------------------------------------------------------------------------------------------------


def test_fla_chunks_skip_zero_length_rows_in_the_sequence_number() -> None:
    qsl = np.array([0, 130, 130, 200], I32)
    ci, co = fla_chunk_metadata(qsl)
    assert ci.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1]] and co.tolist() == [0, 3, 3, 5]
    rci, rco = ref_fla_chunk_metadata(torch.from_numpy(qsl))
    assert rci.tolist() == ci.tolist() and rco.tolist() == co.tolist() and rco.dtype == torch.int64
    with pytest.raises(ValueError, match=r"query_start_loc\[2\]=5 < query_start_loc\[1\]=9"):
        fla_chunk_metadata(np.array([0, 9, 5], I32))


@given(lens=st.lists(st.integers(0, 300), max_size=12))
def test_fla_chunks_match_the_upstream_formula(lens: list[int]) -> None:
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(I32)
    ci, co = fla_chunk_metadata(qsl)
    rci, rco = ref_fla_chunk_metadata(torch.from_numpy(qsl))
    assert ci.tolist() == rci.tolist() and co.tolist() == rco.tolist()


def test_flashinfer_checkpoint_plan_example() -> None:
    plan, n = plan_flashinfer_checkpoints([0, 128, 64, 0, 192], [256, 128, 64, 320])
    assert plan.dtype == np.int64 and n == 12
    assert plan[:5].tolist() == [0, 4, 6, 7, 12] and plan[5:].tolist() == [0, 1, 4, 0, 9]


@given(rows=st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=10))
def test_spec_token_partition_is_the_stable_argsort(rows: list[tuple[int, bool]]) -> None:
    q = np.array([r[0] for r in rows], I32)
    mask = np.array([r[1] for r in rows], bool)
    ns, s = spec_token_partition(q, mask)
    index = torch.argsort(torch.repeat_interleave(torch.from_numpy(mask).to(torch.int8), torch.from_numpy(q)),
                          stable=True)
    assert ns.tolist() + s.tolist() == index.tolist() and len(ns) == int(q[~mask].sum())


# ------------------------------------------------------------------------------------------------
# random batches against the device reference
# ------------------------------------------------------------------------------------------------


@st.composite
def _cases(draw: st.DrawFn, long: bool) -> tuple[BatchSpec, GDNOptions, GDNInputs | None]:
    spec = draw(batch_specs(max_reqs=10, max_query_len=40, max_context_len=300, long_prefills=long,
                            max_long_prefill_len=300))
    d = spec.num_draft_tokens
    k = max(int(d.max()) if d is not None and d.size else 0, draw(st.integers(0, 3)))
    opts = GDNOptions(num_speculative_tokens=k, cache_mode=draw(st.sampled_from(["none", "align"])),
                      prefill_backend=draw(st.sampled_from(["triton", "flashinfer"])),
                      cudagraph_max_bs=draw(st.sampled_from([None, 2, 64])),
                      needs_causal_conv1d_metadata=draw(st.booleans()))
    inputs = None
    if k and d is not None and draw(st.booleans()):
        rows = draw(st.sampled_from([spec.num_reqs, spec.padded_num_reqs]))
        inputs = GDNInputs(num_accepted_tokens=np.array(
            draw(st.lists(st.integers(1, 1 + k), min_size=rows, max_size=rows)), I32))
    return spec, opts, inputs


@given(case=_cases(long=False))
def test_random_batches_match_the_vllm_reference(device: torch.device,
                                                 case: tuple[BatchSpec, GDNOptions, GDNInputs | None]) -> None:
    spec, opts, inputs = case
    check_builder("gdn", spec, device, opts, inputs)


@given(case=_cases(long=True))
def test_long_prefills_match_the_vllm_reference(device: torch.device,
                                                case: tuple[BatchSpec, GDNOptions, GDNInputs | None]) -> None:
    spec, opts, inputs = case
    check_builder("gdn", spec, device, opts, inputs)


@given(spec=batch_specs(max_reqs=8, max_query_len=40, max_context_len=300), seed=st.integers(0, 2**32 - 1))
def test_the_lab_sample_is_served_and_matches_the_lab_reference(device: torch.device, spec: BatchSpec,
                                                               seed: int) -> None:
    """The GDN lab entry (attnmeta.testing.labs.mamba, registered as "gdn"): its sample gives options
    and inputs the builder serves, and check_builder compares the build with its reference."""
    opts, inputs = lab("gdn").sample(spec, np.random.default_rng(seed))
    assert isinstance(opts, GDNOptions) and (inputs is None or isinstance(inputs, GDNInputs))
    assert not GDN.unsupported_reasons(spec, opts, GDN.inputs(inputs))
    assert lab("gdn").builder is GDN and lab("gdn").has_reference
    assert not any(hasattr(GDN, m) for m in ("sample", "reference", "defaults"))
    check_builder("gdn", spec, device, opts, inputs)
