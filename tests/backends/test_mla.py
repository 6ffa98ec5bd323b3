"""The MLA builder: vLLM 0.33.0's worked examples (15.10 b, d, e, f) through the builder, the split and
chunk-planner checklists (23.1, 23.2), graph mode, and generated batches against the device reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, ContextParallel, Stager, StaticProfile
from attnmeta.backends.mla import MLA, MLAOptions, build, mla_decode_threshold
from attnmeta.testing.builders import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference.mla import ref_mla_decode_threshold
from attnmeta.testing.strategies import batch_specs


def _spec(q: list[int], s: list[int], block_size: int = 64, **kw: object) -> BatchSpec:
    n = len(q)
    cols = max(1, -(-max(s) // block_size))
    table = np.arange(n * cols, dtype=np.int32).reshape(n, cols)
    return BatchSpec(num_computed_tokens=[si - qi for qi, si in zip(q, s, strict=True)], num_scheduled_tokens=q,
                     block_table=table, block_size=block_size, **kw)  # type: ignore[arg-type]


B_Q, B_S = [2, 2, 2, 200, 7], [50, 61, 9, 1200, 7]


def test_example_b_flashmla() -> None:
    m = build(_spec(B_Q, B_S), Stager("cpu"), MLAOptions(variant="flashmla", workspace_size=512))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (3, 6, 2)
    assert m.prefill_query_start_loc.tolist() == [0, 200, 207] and m.prefill_query_lens_cpu.tolist() == [200, 7]
    assert m.prefill_max_query_len == 200 and m.context_lens.tolist() == [1000, 0]
    assert m.num_chunks == 2
    c0, c1 = m.chunk(0), m.chunk(1)
    assert c0.starts.tolist() == [0] and c0.seq_lens.tolist() == [512] and not c0.is_continuation
    assert c1.starts.tolist() == [512] and c1.seq_lens.tolist() == [488] and c1.is_continuation
    assert m.chunk_plan is not None and m.chunk_plan.empty_token_slices.tolist() == [[200, 207]]
    assert m.decode_seq_lens.tolist() == [50, 61, 9] and m.scheduler_metadata is None
    assert m.decode_max_query_len == 2  # measured


def test_example_b_flashattn_mla_all_decodes() -> None:
    m = build(_spec(B_Q, B_S), Stager("cpu"), MLAOptions(variant="flashattn_mla", workspace_size=512))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (5, 213, 0)
    assert m.decode_query_start_loc.tolist() == [0, 2, 4, 6, 206, 213]
    assert m.decode_max_query_len == 200  # measured, not the threshold
    assert m.num_chunks == 0 and m.prefill_max_query_len == 0


def test_example_b_threshold_2_like_flashmla() -> None:
    m = build(_spec(B_Q, B_S), Stager("cpu"), MLAOptions(variant="triton_mla", num_speculative_tokens=1,
                                                       workspace_size=512))
    assert m.decode_threshold == 2 and (m.num_decodes, m.num_prefills) == (3, 2)


def test_example_d_padded_uniform_decode() -> None:
    spec = _spec([2, 2], [30, 31], num_reqs_padded=4, num_tokens_padded=8)
    m = build(spec, Stager("cpu"), MLAOptions(variant="triton_mla", num_speculative_tokens=1))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (4, 8, 0)
    assert m.decode_seq_lens.tolist() == [30, 31, 0, 0]


def test_example_e_dcp_decode_and_prefill() -> None:
    spec = _spec([1, 1, 200, 7], [50, 33, 1200, 7], block_size=16)
    m = build(spec, Stager("cpu"), MLAOptions(variant="flashmla", workspace_size=512, dcp_world_size=2, dcp_rank=0))
    assert m.decode_threshold == 1 and m.num_decodes == 2
    assert m.decode_seq_lens.tolist() == [25, 17]  # local
    assert m.decode_dcp_tot_seq_lens is not None and m.decode_dcp_tot_seq_lens.tolist() == [50, 33]
    assert m.max_seq_len == 600  # quirk: the local bound cdiv(1200, 2)
    c0, c1 = m.chunk(0), m.chunk(1)
    assert c0.starts.tolist() == [0] and c0.num_local_context_tokens == 256
    assert c1.starts.tolist() == [256] and c1.num_local_context_tokens == 244  # local start
    assert c1.local_context_lens_allranks is not None and c1.local_context_lens_allranks.tolist() == [[500, 500]]


def test_example_f_flashinfer_mixed_with_padding() -> None:
    spec = _spec([3, 1, 50], [13, 20, 80], num_reqs_padded=5, num_tokens_padded=56)
    m = build(spec, Stager("cpu"), MLAOptions(variant="flashinfer_mla", num_speculative_tokens=2))
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (2, 4, 3)
    assert m.decode_query_start_loc.tolist() == [0, 3, 4]
    assert m.decode_max_query_len == 3  # promised min(50, 3)
    assert m.prefill_query_start_loc.tolist() == [0, 50, 50, 50] and m.prefill_query_lens_cpu.tolist() == [50, 0, 0]
    assert m.context_lens.tolist() == [30, 0, 0] and m.num_chunks == 1
    assert m.chunk(0).seq_lens.tolist() == [30]
    assert m.chunk_plan is not None and m.chunk_plan.empty_token_slices.tolist() == [[50, 50], [50, 50]]


def test_checklist_split_per_variant() -> None:
    """23.2: FlashMLA's uniform rule (thr 128), FlashAttention-MLA's 512, DCP forcing 1."""
    m = build(_spec([2, 2, 3, 2], [10, 10, 10, 10]), Stager("cpu"), MLAOptions(variant="flashmla"))
    assert (m.num_decodes, m.num_prefills) == (2, 2)  # uniform: q 3 starts the prefills
    m = build(_spec([2, 2, 3, 2], [10, 10, 10, 10]), Stager("cpu"), MLAOptions(variant="flashattn_mla"))
    assert (m.num_decodes, m.num_prefills) == (4, 0)
    m = build(_spec([129, 1], [200, 10]), Stager("cpu"), MLAOptions(variant="flashmla"))
    assert (m.num_decodes, m.num_prefills) == (0, 2)
    assert [mla_decode_threshold(MLAOptions(variant=v, dcp_world_size=2)) for v in
            ("flashmla", "flashattn_mla", "flashinfer_mla", "triton_mla")] == [1, 512, 1, 1]
    assert mla_decode_threshold(MLAOptions(variant="flashattn_mla", dcp_world_size=2, dcp_interleave=8)) == 1
    assert mla_decode_threshold(MLAOptions(variant="flashattn_mla", num_speculative_tokens=600)) == 601


@pytest.mark.parametrize("variant", ["flashmla", "flashattn_mla", "flashinfer_mla", "triton_mla"])
def test_reference_threshold_is_vllms_rule(variant: str) -> None:
    """The reference derives the threshold itself (vLLM's ``_init_reorder_batch_threshold``); it agrees
    with the builder's over spec decode and every DCP layout."""
    base = {"flashmla": 128, "flashattn_mla": 512, "flashinfer_mla": 1, "triton_mla": 1}[variant]
    for k in (0, 1, 3, 600):
        for world, inter in ((1, 1), (2, 1), (2, 8), (4, 1)):
            if variant == "flashinfer_mla" and world > 1 and inter != 1:
                continue  # an options error
            opts = MLAOptions(variant=variant, num_speculative_tokens=k, dcp_world_size=world,  # type: ignore[arg-type]
                              dcp_interleave=inter)
            keeps = world == 1 or variant == "flashinfer_mla" or (variant == "flashattn_mla" and inter == 1)
            want = max(base, 1 + k) if keeps else 1
            assert ref_mla_decode_threshold(variant, k, world, inter) == want
            assert mla_decode_threshold(opts) == want


def test_checklist_max_query_len_promised_vs_measured() -> None:
    spec = _spec([1, 1, 40], [5, 6, 40])
    fi = build(spec, Stager("cpu"), MLAOptions(variant="flashinfer_mla", num_speculative_tokens=3))
    fm = build(spec, Stager("cpu"), MLAOptions(variant="flashattn_mla"))
    assert fi.num_decodes == 2 and fi.decode_max_query_len == 4  # min(40, 4): promised
    assert fm.num_decodes == 3 and fm.decode_max_query_len == 40  # measured
    assert build(_spec([1, 1], [5, 6]), Stager("cpu"), MLAOptions(variant="flashmla")).max_seq_len == 6


def test_triton_split_count_and_flashinfer_non_causal_flattening() -> None:
    m = build(_spec([1], [4000]), Stager("cpu"), MLAOptions(variant="triton_mla", num_sms=132))
    assert m.num_kv_splits == 8
    spec = _spec([3, 3], [10, 20], num_reqs_padded=3, num_tokens_padded=7)
    m = build(spec, Stager("cpu"), MLAOptions(variant="flashinfer_mla", causal=False))
    assert (m.num_decodes, m.num_prefills, m.causal) == (3, 0, False)
    assert m.decode_row_req is not None and m.decode_row_req.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert m.decode_flattened_seq_lens is not None
    assert m.decode_flattened_seq_lens.tolist() == [10, 10, 10, 20, 20, 20, 0]


def test_bad_options_and_unsupported_batches() -> None:
    with pytest.raises(ValueError, match=r"MLAOptions\.causal"):
        MLAOptions(variant="flashmla", causal=False)
    with pytest.raises(ValueError, match=r"MLAOptions\.variant"):
        MLAOptions(variant="cutlass")  # type: ignore[arg-type]
    spec = _spec([3, 2], [10, 20])
    assert MLA.unsupported_reasons(spec, MLAOptions(variant="triton_mla", causal=False), None)
    cp = _spec([1, 4], [10, 20], block_size=16, context_parallel=ContextParallel(2, 0))
    assert any("world_size" in r for r in MLA.unsupported_reasons(cp, MLAOptions(), None))
    assert not MLA.unsupported_reasons(cp, MLAOptions(dcp_world_size=2), None)
    assert MLA.unsupported_reasons(spec, MLAOptions(workspace_size=8), None)


def test_graph_mode_tails_and_addresses() -> None:
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=256, max_blocks_per_req=8, block_size=16)
    stager = Stager("cpu", profile=prof)
    spec = _spec([1, 50, 5], [20, 100, 5], block_size=16)
    opts = MLAOptions(variant="flashmla", workspace_size=32)
    first = build(spec, stager, opts)
    ptr = first.chunk_cu_seq_lens.data_ptr()
    cu = first.chunk_cu_seq_lens.tolist()
    second = check_builder(MLA, spec, "cpu", opts, stager=stager)
    assert second.chunk_cu_seq_lens.data_ptr() == ptr and second.chunk_cu_seq_lens.tolist() == cu
    with stager.step() as step:  # the full-capacity view: the indptr tail repeats the last value
        import attnmeta

        common = attnmeta.stage_common(spec, step)
        staged = MLA.stage(common, step, opts)
    full = step.device_full("mla.chunk_cu_seq_lens")
    assert full[len(cu):].eq(cu[-1]).all()
    assert staged.result().prefill_query_start_loc.tolist() == [0, 50, 55]


_SPECS = batch_specs(max_reqs=8, max_query_len=40, max_context_len=600)


@given(spec=_SPECS, seed=st.integers(0, 2**32 - 1), variant=st.sampled_from(
    ["flashmla", "flashattn_mla", "flashinfer_mla", "triton_mla"]), dcp=st.sampled_from([1, 1, 2, 4]),
       inter=st.sampled_from([1, 2]), k=st.integers(0, 3), ws_units=st.integers(1, 6), align_indptr=st.booleans())
def test_builder_matches_reference(spec: BatchSpec, seed: int, variant: str, dcp: int, inter: int, k: int,
                                   ws_units: int, align_indptr: bool) -> None:
    """DCP, spec decode, padding and zero-context rows come from the strategy; every variant."""
    if variant == "flashinfer_mla":
        inter = 1
    opts = MLAOptions(variant=variant, num_speculative_tokens=k, dcp_world_size=dcp,  # type: ignore[arg-type]
                      dcp_rank=seed % dcp, dcp_interleave=inter, align_indptr=align_indptr)
    import math

    align = math.lcm(spec.block_size, dcp * inter if dcp > 1 else 1)
    opts = dataclasses.replace(opts, workspace_size=ws_units * align * dcp)
    check_builder(MLA, spec, torch.device("cpu"), opts)


@given(spec=_SPECS, seed=st.integers(0, 2**32 - 1))
def test_lab_sample_matches_reference(spec: BatchSpec, seed: int) -> None:
    """The lab's random options (a workspace of whole split alignments, so contexts chunk) build and
    match the reference."""
    options, inputs = lab("mla").sample(spec, np.random.default_rng(seed))
    assert inputs is None
    if MLA.unsupported_reasons(spec, options, None):
        return
    check_builder("mla", spec, "cpu", options)


def test_a_chunk_expires_with_its_step() -> None:
    """``chunk(i)`` handed out a plain object: after the slot was reused it read the newer step's chunk
    starts silently while its metadata raised (found by an adversarial review)."""
    from attnmeta.staging import StepExpiredError, is_expired

    stager = Stager("cpu", num_slots=2)
    opts = MLAOptions(variant="flashinfer_mla", workspace_size=256)

    def step(ctx: int) -> BatchSpec:
        return BatchSpec(num_computed_tokens=[49, 0, ctx], num_scheduled_tokens=[1, 4, 20],
                         block_table=np.zeros((3, 20), np.int32), block_size=16)

    m = build(step(300), stager, opts)
    chunk = m.chunk(0)
    assert chunk.seq_lens.tolist() == [256] and not is_expired(chunk)
    build(step(120), stager, opts)
    build(step(100), stager, opts)  # (reuses the first step's slot)
    assert is_expired(chunk)
    with pytest.raises(StepExpiredError, match=r"MLAChunk\.starts"):
        chunk.starts  # noqa: B018
