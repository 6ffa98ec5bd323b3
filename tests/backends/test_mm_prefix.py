"""The multimodal prefix-range builder (``mm_prefix``): vLLM 0.33.0's worked examples as literal tests,
the checklist cases (one-token ranges, sliding-window drop vs clamp, ``span_pad``, partial coverage in a
later prefill chunk, the empty result), properties against the device references, the one copy and the
host-only fields, and the input checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnmeta
from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.mm_prefix import MM_PREFIX, MMPrefixInputs, MMPrefixOptions, build, mm_prefix_ranges
from attnmeta.staging import CapacityError
from attnmeta.testing import audit_builder, check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference.mm_prefix import (
    ref_mm_prefix_query_ranges,
    ref_mm_prefix_range_tensor,
    ref_mm_prefix_ranges,
)
from attnmeta.testing.strategies import batch_specs

I32 = np.int32
# The features of section 18.2: row 0 an image (offset 2, length 5) (its audio feature is not a span);
# row 1 nothing; row 2 an image (offset 0, length 6, is_embed [F, T, T, F, T, T]) and a video (offset
# 20, length 300).
SPANS = {
    "mm_span_indptr": np.array([0, 1, 1, 3], I32),
    "mm_span_starts": np.array([2, 0, 20], I32),
    "mm_span_lengths": np.array([5, 6, 300], I32),
    "mm_is_embed": np.array([True] * 5 + [False, True, True, False, True, True] + [True] * 300),
}
INPUTS = MMPrefixInputs(**SPANS)
FIRST_CHUNKS = BatchSpec(num_computed_tokens=[0, 0, 0], num_scheduled_tokens=[7, 3, 8],
                         block_table=np.zeros((3, 1), I32), block_size=512)
# The FlashAttention example: qsl [0, 6, 9, 13], seq lens (ub) [6, 20, 25]: row 2 is a later chunk.
LATER_CHUNK = BatchSpec(num_computed_tokens=[0, 17, 21], num_scheduled_tokens=[6, 3, 4],
                        block_table=np.zeros((3, 1), I32), block_size=512)
FA = MMPrefixOptions(form="flash_attn")


def _dict(**kw: object) -> dict[int, list[tuple[int, int]]]:
    ip, r = mm_prefix_ranges(*SPANS.values(), **kw)  # type: ignore[arg-type]
    return {i: [(int(s), int(e)) for s, e in r[ip[i]:ip[i + 1]]] for i in range(len(ip) - 1)}


# ------------------------------------------------------------------------------------------------
# the worked examples of section 18
# ------------------------------------------------------------------------------------------------


def test_worked_example_ranges_default_sliding_window_and_span_pad() -> None:
    assert _dict() == {0: [(2, 6)], 1: [], 2: [(1, 2), (4, 5), (20, 319)]}
    assert _dict(sliding_window=256) == {0: [(2, 6)], 1: [], 2: [(1, 2), (4, 5)]}
    assert _dict(span_pad=4) == {0: [(3, 6)], 1: [], 2: [(3, 5), (23, 319)]}
    m = build(FIRST_CHUNKS, Stager("cpu"), MMPrefixOptions(span_pad=4), INPUTS)
    assert m.doc_ranges() == {0: [(3, 6)], 1: [], 2: [(3, 5), (23, 319)]}


def test_worked_example_triton_form() -> None:
    m = build(FIRST_CHUNKS, Stager("cpu"), None, INPUTS)
    want = [[[2, 6], [0, 0], [0, 0]], [[0, 0], [0, 0], [0, 0]], [[1, 2], [4, 5], [20, 319]]]
    assert m.mm_prefix_range_tensor is not None and m.mm_prefix_range_tensor_cpu is not None
    assert m.mm_prefix_range_tensor.tolist() == want and m.mm_prefix_range_tensor_cpu.tolist() == want
    assert m.mm_prefix_range_tensor.dtype == torch.int32 and m.max_ranges == 3 and m.num_ranges == 4
    assert m.mm_prefix_query_range_tensor is None and m.num_query_range_rows == 0


def test_worked_example_flash_attn_form_with_a_later_prefill_chunk() -> None:
    m = build(LATER_CHUNK, Stager("cpu"), FA, INPUTS)
    assert m.num_query_range_rows == 13
    t = m.mm_prefix_query_range_tensor
    assert t is not None and t.dtype == torch.int32 and t.shape == (13, 2)
    want = [[-1, -1]] * 13
    want[2:6] = [[2, 6]] * 4  # row 0, positions 2-5
    want[9:13] = [[20, 319]] * 4  # row 2, positions 21-24: the part of the video range in this chunk
    assert t.tolist() == want and m.mm_prefix_query_range_tensor_cpu.tolist() == want  # type: ignore[union-attr]
    assert m.mm_prefix_range_tensor is None


def test_worked_example_only_one_token_ranges_gives_none_in_the_flash_attn_form() -> None:
    """``{0: [(3, 3), (4, 4)]}`` returns 0 (field None); the Triton form keeps them."""
    spec = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[8], block_table=[[0]], block_size=16)
    spans = MMPrefixInputs(mm_span_indptr=[0, 2], mm_span_starts=[3, 4], mm_span_lengths=[1, 1])
    fa = build(spec, Stager("cpu"), FA, spans)
    assert fa.doc_ranges() == {0: [(3, 3), (4, 4)]}
    assert fa.mm_prefix_query_range_tensor is None and fa.num_query_range_rows == 0
    tri = build(spec, Stager("cpu"), None, spans)
    assert tri.mm_prefix_range_tensor is not None and tri.mm_prefix_range_tensor.tolist() == [[[3, 3], [4, 4]]]


# ------------------------------------------------------------------------------------------------
# the section 23 item 5 checklist
# ------------------------------------------------------------------------------------------------


def test_sliding_window_drops_long_ranges_unless_clamped() -> None:
    opts = MMPrefixOptions(sliding_window=256)
    dropped = build(FIRST_CHUNKS, Stager("cpu"), opts, INPUTS)
    assert dropped.doc_ranges()[2] == [(1, 2), (4, 5)]
    assert dropped.mm_prefix_range_tensor is not None and dropped.mm_prefix_range_tensor.shape == (3, 2, 2)
    kept = build(FIRST_CHUNKS, Stager("cpu"), MMPrefixOptions(sliding_window=256, clamp_sliding_window=True), INPUTS)
    assert kept.doc_ranges()[2] == [(1, 2), (4, 5), (20, 319)]  # kept unchanged: the kernel clamps
    # exactly the window is kept, one more is dropped
    assert _dict(sliding_window=300)[2][-1] == (20, 319) and _dict(sliding_window=299)[2] == [(1, 2), (4, 5)]
    fa = build(LATER_CHUNK, Stager("cpu"), MMPrefixOptions(form="flash_attn", sliding_window=256), INPUTS)
    assert fa.mm_prefix_query_range_tensor is not None
    assert fa.mm_prefix_query_range_tensor[9:].tolist() == [[-1, -1]] * 4  # the video range is gone


def test_span_pad_ignores_is_embed_and_can_give_an_empty_range() -> None:
    # offset 8, length 2, pad 4: start 11 > end 9: kept in the ranges, skipped by the FA form
    _, r = mm_prefix_ranges([0, 1], [8], [2], [False, True], span_pad=4)
    assert r.tolist() == [[11, 9]]
    spec = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[12], block_table=[[0]], block_size=16)
    m = build(spec, Stager("cpu"), MMPrefixOptions(form="flash_attn", span_pad=4),
              MMPrefixInputs(mm_span_indptr=[0, 1], mm_span_starts=[8], mm_span_lengths=[2]))
    assert m.mm_prefix_query_range_tensor is None


def test_one_token_range_is_skipped_but_a_two_token_one_is_not() -> None:
    spec = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[6], block_table=[[0]], block_size=16)
    m = build(spec, Stager("cpu"), FA,
              MMPrefixInputs(mm_span_indptr=[0, 2], mm_span_starts=[1, 3], mm_span_lengths=[1, 2]))
    assert m.mm_prefix_query_range_tensor is not None
    assert m.mm_prefix_query_range_tensor.tolist() == [[-1, -1], [-1, -1], [-1, -1], [3, 4], [3, 4], [-1, -1]]


def test_partial_coverage_at_both_ends_of_a_chunk() -> None:
    """A chunk at positions 10..13 over a range (8, 11) and a range (13, 20): tokens 10, 11 and 13."""
    spec = BatchSpec(num_computed_tokens=[10], num_scheduled_tokens=[4], num_prompt_tokens=[30], block_table=[[0]],
                     block_size=32)
    spans = MMPrefixInputs(mm_span_indptr=[0, 2], mm_span_starts=[8, 13], mm_span_lengths=[4, 8])
    m = build(spec, Stager("cpu"), FA, spans)
    assert m.mm_prefix_query_range_tensor is not None
    assert m.mm_prefix_query_range_tensor.tolist() == [[8, 11], [8, 11], [-1, -1], [13, 20]]
    # a chunk past every range: nothing covered, the field is None
    past = BatchSpec(num_computed_tokens=[21], num_scheduled_tokens=[4], num_prompt_tokens=[30], block_table=[[0]],
                     block_size=32)
    assert build(past, Stager("cpu"), FA, spans).mm_prefix_query_range_tensor is None


def test_empty_results_are_none() -> None:
    stager = Stager("cpu")
    for opts in (MMPrefixOptions(), FA):
        none = build(FIRST_CHUNKS, stager, opts)  # no spans at all
        assert none.mm_prefix_range_tensor is None and none.mm_prefix_query_range_tensor is None
        assert none.doc_ranges() == {0: [], 1: [], 2: []} and none.num_ranges == 0
        masked = build(FIRST_CHUNKS, stager, opts, MMPrefixInputs(
            mm_span_indptr=[0, 1, 1, 1], mm_span_starts=[2], mm_span_lengths=[3], mm_is_embed=[False, False, False]))
        assert masked.doc_ranges() == {0: [], 1: [], 2: []}
        assert masked.mm_prefix_range_tensor is None and masked.mm_prefix_query_range_tensor is None
    # the Triton form's quirk: a lone real range (0, 0) counts as the (0, 0) placeholder
    lone = build(FIRST_CHUNKS, stager, None,
                 MMPrefixInputs(mm_span_indptr=[0, 1, 1, 1], mm_span_starts=[0], mm_span_lengths=[1]))
    assert lone.doc_ranges()[0] == [(0, 0)] and lone.mm_prefix_range_tensor is None and lone.max_ranges == 0


def test_padding_rows_get_zero_ranges_in_the_triton_form() -> None:
    spec = BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[4, 4], block_table=np.zeros((2, 1), I32),
                     block_size=16, num_reqs_padded=4)
    m = build(spec, Stager("cpu"), None,
              MMPrefixInputs(mm_span_indptr=[0, 0, 1], mm_span_starts=[1], mm_span_lengths=[3]))
    assert m.mm_prefix_range_tensor is not None
    assert m.mm_prefix_range_tensor.tolist() == [[[0, 0]], [[1, 3]], [[0, 0]], [[0, 0]]]
    assert m.doc_ranges() == {0: [], 1: [(1, 3)]}


# ------------------------------------------------------------------------------------------------
# one copy, no sync, host-only ranges
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["triton", "flash_attn"])
def test_one_copy_and_the_ranges_never_staged(form: str) -> None:
    stager = Stager("cpu")
    opts = MMPrefixOptions(form=form)  # type: ignore[arg-type]
    with stager.step() as step:
        common = attnmeta.stage_common(LATER_CHUNK, step, token_arrays=False)
        staged = MM_PREFIX.stage(common, step, opts, INPUTS)
    m = staged.result()
    assert step.stats.copies == 1
    staged_field = f"mm_prefix.{'mm_prefix_range_tensor' if form == 'triton' else 'mm_prefix_query_range_tensor'}"
    assert staged_field in step.field_names
    assert "mm_prefix.mm_ranges" not in step.field_names and "mm_prefix.mm_range_indptr" not in step.field_names
    assert step.host_fields["mm_prefix.mm_ranges"] is m.mm_ranges_cpu
    assert m.mm_ranges_cpu.tolist() == [[2, 6], [1, 2], [4, 5], [20, 319]]
    assert isinstance(m.mm_ranges_cpu, np.ndarray) and not m.mm_ranges_cpu.flags.writeable


def test_audit_zero_syncs_zero_pageable_copies() -> None:
    rows = audit_builder("mm_prefix", batches=2)
    assert [(r.syncs, r.pageable_copies, r.races, r.errors) for r in rows] == [(0, 0, 0, 0)] * len(rows), \
        [r.first_problem for r in rows]


def test_graph_mode_keeps_the_address() -> None:
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=32, max_blocks_per_req=2, block_size=512)
    stager = Stager("cpu", profile=prof)
    for form in ("triton", "flash_attn"):
        opts = MMPrefixOptions(form=form, prefix=f"mm_{form}")  # type: ignore[arg-type]
        a = build(LATER_CHUNK, stager, opts, INPUTS)
        ta = a.mm_prefix_range_tensor if form == "triton" else a.mm_prefix_query_range_tensor
        assert ta is not None
        ptr, values = ta.data_ptr(), ta.tolist()
        b = build(LATER_CHUNK, stager, opts, INPUTS)
        tb = b.mm_prefix_range_tensor if form == "triton" else b.mm_prefix_query_range_tensor
        assert tb is not None and tb.data_ptr() == ptr and tb.tolist() == values


# ------------------------------------------------------------------------------------------------
# properties against the device references
# ------------------------------------------------------------------------------------------------


@given(spec=batch_specs(max_reqs=8, max_query_len=40, max_context_len=200), seed=st.integers(0, 2**32 - 1),
       form=st.sampled_from(["triton", "flash_attn"]))
def test_equals_the_reference(device: torch.device, spec: BatchSpec, seed: int, form: str) -> None:
    options, inputs = lab("mm_prefix").sample(spec, np.random.default_rng(seed))
    options = dataclasses.replace(options, form=form)
    if MM_PREFIX.unsupported_reasons(spec, options, inputs):
        return
    check_builder(MM_PREFIX, spec, device, options, inputs)


@given(lengths=st.lists(st.integers(1, 12), max_size=6), data=st.data())
def test_ranges_equal_the_reference_runs(lengths: list[int], data: st.DataObject) -> None:
    """The is_embed runs, span_pad and the window rule, span by span, against the torch transcription."""
    starts = np.cumsum([0, *lengths[:-1]]).astype(I32) + 3 if lengths else np.zeros(0, I32)
    embed = np.array(data.draw(st.lists(st.booleans(), min_size=sum(lengths), max_size=sum(lengths))), bool)
    window = data.draw(st.none() | st.integers(1, 10))
    pad = data.draw(st.none() | st.integers(1, 5))
    clamp = data.draw(st.booleans())
    cut = data.draw(st.integers(0, len(lengths)))
    indptr = np.array([0, cut, len(lengths)], I32)
    ip, r = mm_prefix_ranges(indptr, starts, np.array(lengths, I32), embed, sliding_window=window,
                             clamp_sliding_window=clamp, span_pad=pad)
    ref = ref_mm_prefix_ranges(torch.from_numpy(indptr), torch.from_numpy(starts), torch.tensor(lengths, dtype=torch.int32),
                               torch.from_numpy(embed), sliding_window=window, clamp_sliding_window=clamp, span_pad=pad)
    assert {i: [tuple(x) for x in r[ip[i]:ip[i + 1]].tolist()] for i in range(2)} == ref


def test_references_on_the_worked_examples() -> None:
    """The oracles themselves reproduce section 18's values (so the property above tests against vLLM)."""
    ranges = {0: [(2, 6)], 1: [], 2: [(1, 2), (4, 5), (20, 319)]}
    t = ref_mm_prefix_range_tensor(ranges, 3, torch.device("cpu"))
    assert t is not None and t.tolist()[2] == [[1, 2], [4, 5], [20, 319]] and t.tolist()[1] == [[0, 0]] * 3
    q = ref_mm_prefix_query_ranges(ranges, torch.tensor([0, 6, 9, 13]), torch.tensor([6, 20, 25]))
    assert q is not None and q[:, 0].tolist() == [-1, -1, 2, 2, 2, 2, -1, -1, -1, 20, 20, 20, 20]
    assert ref_mm_prefix_query_ranges({0: [(3, 3), (4, 4)]}, torch.tensor([0, 8]), torch.tensor([8])) is None


# ------------------------------------------------------------------------------------------------
# input checks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    ({"mm_span_starts": [2, -1, 20]}, r"mm_span_starts\[1\]=-1 < 0 \(request 2, span 1\)"),
    ({"mm_span_lengths": [5, 6, 0]}, r"mm_span_lengths\[2\]=0 < 1 \(request 2, span 2\)"),
    ({"mm_span_indptr": [0, 2, 1, 3]}, r"mm_span_indptr\[2\]=1 < mm_span_indptr\[1\]=2 \(request 1\)"),
    ({"mm_span_indptr": [0, 1, 1, 2]}, r"mm_span_indptr\[-1\]=2 != 3 spans"),
    ({"mm_span_indptr": [0, 1, 3]}, r"mm_span_indptr: .*4"),
    ({"mm_span_lengths": [5, 6]}, r"mm_span_lengths: 2 entries but mm_span_starts has 3"),
    ({"mm_is_embed": [True] * 10}, r"mm_is_embed: 10 entries, expected sum\(mm_span_lengths\)=311"),
    ({"mm_span_starts": [2, 0, 2**31 - 100]}, r"mm_span_starts\[2\] \+ mm_span_lengths\[2\] = .* does not fit int32"),
])
def test_bad_spans_name_the_input_request_and_span(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(FIRST_CHUNKS, Stager("cpu"), None, dataclasses.replace(INPUTS, **change))


def test_type_errors_and_context_parallel() -> None:
    with pytest.raises(TypeError, match=r"mm_is_embed: expected a bool array"):
        build(FIRST_CHUNKS, Stager("cpu"), None, dataclasses.replace(INPUTS, mm_is_embed=np.ones(311, I32)))
    with pytest.raises(TypeError, match=r"mm_span_starts"):
        build(FIRST_CHUNKS, Stager("cpu"), None, dataclasses.replace(INPUTS, mm_span_starts=torch.tensor([2, 0, 20])))
    with pytest.raises(ValueError, match=r"MMPrefixOptions\.sliding_window: must be >= 1"):
        MMPrefixOptions(sliding_window=0)
    from attnmeta import ContextParallel

    cp = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], num_prompt_tokens=[5, 3],
                   block_table=np.zeros((2, 2), I32), block_size=4, context_parallel=ContextParallel(2, 0))
    with pytest.raises(attnmeta.UnsupportedBatchError, match="context-parallel"):
        build(cp, Stager("cpu"))


def test_graph_mode_triton_rows_have_one_stride() -> None:
    """Graph mode stages (num_reqs, graph_max_ranges, 2) whatever a step's widest row, so a captured
    kernel reads one row stride; a row with more ranges is a CapacityError naming the option."""
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=64, max_blocks_per_req=2, block_size=512)
    stager = Stager("cpu", profile=prof)
    spec = BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[20, 10], block_table=np.zeros((2, 1), np.int32),
                     block_size=512)
    opts = MMPrefixOptions(graph_max_ranges=4)
    shapes, ptrs = [], []
    for starts in ([2], [2, 6, 10]):  # one range, then three, in row 0
        spans = MMPrefixInputs(mm_span_indptr=[0, len(starts), len(starts)], mm_span_starts=starts,
                               mm_span_lengths=[3] * len(starts))
        m = build(spec, stager, opts, spans)
        t = m.mm_prefix_range_tensor
        assert t is not None and m.max_ranges == 4
        shapes.append(tuple(t.shape))
        ptrs.append(t.data_ptr())
        assert t[0, : len(starts)].tolist() == [[s, s + 2] for s in starts] and t[0, len(starts):].abs().sum() == 0
    assert shapes == [(2, 4, 2)] * 2 and ptrs[0] == ptrs[1]
    five = MMPrefixInputs(mm_span_indptr=[0, 5, 5], mm_span_starts=[0, 3, 6, 9, 12], mm_span_lengths=[2] * 5)
    with pytest.raises(CapacityError, match=r"a row has 5 ranges but MMPrefixOptions\.graph_max_ranges=4"):
        build(spec, stager, opts, five)
