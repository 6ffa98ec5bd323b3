"""Micro-batches (DBO): the plan, each micro-batch's common metadata against vLLM's device slicing
(vllm-semantics section 17, worked examples 17.4 a-c), every builder on each micro-batch, the sync audit."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnmeta
from attnmeta import BatchSpec, Stager
from attnmeta.builder import CommonNeeds
from attnmeta.sync import no_device_sync
from attnmeta.testing.lab import lab
from attnmeta.testing.reference import ref_ubatch_commons, ref_ubatch_slices
from attnmeta.testing.strategies import batch_specs
from attnmeta.ubatch import UBatchSlice, is_last_ubatch_empty, stage_ubatches, ubatch_slices, ubatch_specs


def _spec(c: list[int], q: list[int], bp: int | None = None, tp: int | None = None, bs: int = 4) -> BatchSpec:
    w = max(1, -(-max(a + b for a, b in zip(c, q)) // bs))
    bt = (np.arange(len(c) * w, dtype=np.int32).reshape(len(c), w) * 3 + 1)
    return BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt, block_size=bs,
                     num_reqs_padded=bp, num_tokens_padded=tp)


def _stage(spec: BatchSpec, slices: Any, stager: Stager | None = None) -> list[Any]:
    stager = stager or Stager("cpu")
    with stager.step() as step:
        ubs = stage_ubatches(spec, step, slices)
    assert step.stats.copies == 1
    return [u.result() for u in ubs]


def _parent(spec: BatchSpec) -> Any:
    return attnmeta.build_common(spec, Stager("cpu"))


# ------------------------------------------------------------------------------------ worked examples 17.4
def test_is_last_ubatch_empty() -> None:
    assert is_last_ubatch_empty(10, 16, 2) is False
    assert is_last_ubatch_empty(8, 16, 2) is True
    with pytest.raises(ValueError, match="num_ubatches"):
        is_last_ubatch_empty(8, 16, 1)


def test_worked_example_a_split_across_two() -> None:
    spec = _spec([7, 0, 21, 6], [5, 3, 9, 1], bp=6, tp=20)
    plan = ubatch_slices(spec.num_scheduled_tokens, 20, 6, 2)
    assert plan.slices == (UBatchSlice(slice(0, 3), slice(0, 10)), UBatchSlice(slice(2, 4), slice(10, 18)))
    assert plan.padded_slices[1] == UBatchSlice(slice(2, 6), slice(10, 20))
    parent = _parent(spec)
    assert parent.seq_lens_cpu.tolist() == [12, 3, 30, 7, 0, 0]
    m0, m1 = _stage(spec, plan.padded_slices)
    assert m0.query_start_loc_cpu.tolist() == [0, 5, 8, 10] and m0.query_start_loc.tolist() == [0, 5, 8, 10]
    assert m0.seq_lens_cpu.tolist() == [12, 3, 23] and m0.seq_lens.tolist() == [12, 3, 23]
    assert (m0.max_query_len, m0.max_seq_len) == (5, 30)
    assert m0.slot_mapping.tolist() == parent.slot_mapping_cpu[0:10].tolist()
    assert m1.query_start_loc_cpu.tolist() == [0, 7, 8, 8, 8]
    assert m1.seq_lens_cpu.tolist() == [30, 7, 0, 0]
    assert (m1.max_query_len, m1.max_seq_len) == (7, 30)
    assert m1.slot_mapping.tolist() == parent.slot_mapping_cpu[10:20].tolist()  # padding slots -1 included
    assert m1.positions.tolist() == parent.positions_cpu[10:20].tolist()
    assert m1.positions_cpu[:7].tolist() == list(range(23, 30))  # row 2's continuation: positions 23..29
    # what vLLM drops (is_prefilling None), attnmeta keeps, from the micro-batch's own rows
    assert m1.num_computed_tokens_cpu.tolist() == [23, 6, 0, 0] and m1.is_prefilling.shape == (4,)


def test_worked_example_b_one_request_each() -> None:
    spec = _spec([0, 3, 9], [4, 4, 4])
    plan = ubatch_slices([4, 4, 4], 12, 3, 3)
    assert [(s.request_slice, s.token_slice) for s in plan.slices] == [
        (slice(0, 1), slice(0, 4)), (slice(1, 2), slice(4, 8)), (slice(2, 3), slice(8, 12))]
    assert [m.seq_lens_cpu.tolist() for m in _stage(spec, plan.slices)] == [[4], [7], [13]]


def test_worked_example_c_one_request_in_three() -> None:
    spec = _spec([8], [12])
    plan = ubatch_slices([12], 12, 1, 3)
    assert all(s.request_slice == slice(0, 1) for s in plan.slices)
    ms = _stage(spec, plan.slices)
    assert [m.query_start_loc_cpu.tolist() for m in ms] == [[0, 4]] * 3
    assert [m.seq_lens_cpu.tolist() for m in ms] == [[12], [16], [20]]  # first part, middle, continuation
    assert [m.positions_cpu.tolist() for m in ms] == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]
    assert [m.max_seq_len for m in ms] == [20] * 3


def test_bad_plans_and_slices_are_named() -> None:
    with pytest.raises(ValueError, match="is_last_ubatch_empty"):
        ubatch_slices([4, 4], 16, 2, 2)  # split at 8 = every real token: the last micro-batch is empty
    with pytest.raises(ValueError, match="num_tokens_padded"):
        ubatch_slices([4, 4], 6, 2, 2)
    with pytest.raises(ValueError, match="2 split points"):
        ubatch_slices([4, 4], 8, 2, 3, split_point=[3])
    with pytest.raises(TypeError, match="num_ubatches"):
        ubatch_slices([4, 4], 8, 2, 2.0)  # type: ignore[arg-type]
    spec = _spec([0, 0], [4, 4])
    with pytest.raises(ValueError, match="first token 5 is not in its first request 0"):
        ubatch_specs(spec, [UBatchSlice(slice(0, 2), slice(5, 8))])
    with pytest.raises(ValueError, match="run past its last request 0"):
        ubatch_specs(spec, [UBatchSlice(slice(0, 1), slice(0, 6))])
    with pytest.raises(TypeError, match="UBatchSlice"):
        ubatch_specs(spec, [(slice(0, 1), slice(0, 4))])  # type: ignore[list-item]


# ------------------------------------------------------------------------------------ against vLLM's way
def _check_against_reference(spec: BatchSpec, plan_slices: Any, device: torch.device) -> None:
    W = max(1, -(-spec.max_exact_seq_len // spec.block_size))
    got = _stage(spec, plan_slices)
    want = ref_ubatch_commons(spec, [(s.request_slice, s.token_slice) for s in plan_slices], device, W)
    for k, (g, w) in enumerate(zip(got, want)):
        for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions"):
            assert torch.equal(getattr(g, name), getattr(w, name).cpu()), (k, name, getattr(g, name), getattr(w, name))
        assert g.query_start_loc_cpu.tolist() == w.query_start_loc_cpu.tolist(), k
        assert g.seq_lens_cpu_upper_bound.tolist() == w.seq_lens_cpu_upper_bound.tolist(), k
        assert g.seq_lens_cpu.tolist() == g.seq_lens.tolist()
        assert (g.num_reqs, g.num_actual_tokens, g.max_query_len, g.max_seq_len) == (
            w.num_reqs, w.num_actual_tokens, w.max_query_len, w.max_seq_len), k


SPECS = batch_specs(min_reqs=1, max_reqs=10, max_query_len=40, max_context_len=200)


@given(spec=SPECS, n=st.sampled_from([2, 3]))
def test_default_plan_equals_vllm(device: torch.device, spec: BatchSpec, n: int) -> None:
    T, Tp, Bp = spec.num_tokens, spec.padded_num_tokens, spec.padded_num_reqs
    if n > T or is_last_ubatch_empty(T, Tp, n):
        with pytest.raises(ValueError):
            ubatch_slices(spec.num_scheduled_tokens, Tp, Bp, n)
        return
    plan = ubatch_slices(spec.num_scheduled_tokens, Tp, Bp, n)
    ref, ref_padded = ref_ubatch_slices(spec.num_scheduled_tokens, Tp, Bp, n)
    assert [(s.request_slice, s.token_slice) for s in plan.slices] == ref
    assert [(s.request_slice, s.token_slice) for s in plan.padded_slices] == ref_padded
    _check_against_reference(spec, plan.slices, device)
    _check_against_reference(spec, plan.padded_slices, device)


@given(spec=SPECS, data=st.data())
def test_any_split_points_equal_vllm(device: torch.device, spec: BatchSpec, data: st.DataObject) -> None:
    """Explicit split points anywhere: requests cut across 2 and 3 micro-batches, zero-length rows at a
    boundary, padding in the last one."""
    T = spec.num_tokens
    if T < 2:
        with pytest.raises(ValueError):
            ubatch_slices(spec.num_scheduled_tokens, spec.padded_num_tokens, spec.padded_num_reqs, 2, split_point=[T])
        return
    points = sorted(data.draw(st.sets(st.integers(1, T - 1), min_size=1, max_size=min(2, T - 1)), label="points"))
    n = len(points) + 1
    plan = ubatch_slices(spec.num_scheduled_tokens, spec.padded_num_tokens, spec.padded_num_reqs, n, split_point=points)
    ref, ref_padded = ref_ubatch_slices(spec.num_scheduled_tokens, spec.padded_num_tokens, spec.padded_num_reqs, n,
                                        points)
    assert [(s.request_slice, s.token_slice) for s in plan.slices] == ref
    assert [(s.request_slice, s.token_slice) for s in plan.padded_slices] == ref_padded
    _check_against_reference(spec, plan.slices, device)
    _check_against_reference(spec, plan.padded_slices, device)
    # a split request's parts: the first sees c + its tokens, the continuation keeps the full s
    subs = ubatch_specs(spec, plan.slices)
    for sub, s in zip(subs, plan.slices):
        r0 = s.request_slice.start
        assert int(sub.num_computed_tokens[0] + sub.num_scheduled_tokens[0]) <= int(
            spec.num_computed_tokens[r0] + spec.num_scheduled_tokens[r0])
        assert sub.num_tokens == min(s.token_slice.stop, T) - s.token_slice.start


# ------------------------------------------------------------------------------------ every builder, the audit
def _mixed() -> BatchSpec:
    rng = np.random.default_rng(3)
    c = [40, 0, 17, 90, 5, 0, 33, 8]
    q = [1, 37, 22, 1, 1, 9, 1, 14]
    bs = 16
    w = max(-(-(a + b) // bs) for a, b in zip(c, q)) + 1
    bt = rng.integers(0, 500, size=(len(c), w)).astype(np.int32)
    return BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt, block_size=bs,
                     num_prompt_tokens=[40, 37, 60, 50, 2, 9, 20, 30], num_reqs_padded=10, num_tokens_padded=96)


@pytest.mark.parametrize("name", sorted(attnmeta.registry()))
def test_every_builder_stages_on_every_ubatch(name: str) -> None:
    """Each registered builder stages on each micro-batch's common metadata, all in one step, one copy."""
    spec = _mixed()
    plan = ubatch_slices(spec.num_scheduled_tokens, 96, 10, 2)
    assert plan.slices[0].request_slice.stop - 1 == plan.slices[1].request_slice.start  # a request is split
    b = attnmeta.get_builder(name)
    subs = ubatch_specs(spec, plan.padded_slices)
    # one builder's fields per micro-batch: each under a prefix of its own, as the common ones
    chosen = [(dataclasses.replace(o, prefix=f"{o.prefix}_ub{k}"), i)
              for k, (o, i) in enumerate(lab(b).defaults(sub) for sub in subs)]
    for sub, (opts, inputs) in zip(subs, chosen):
        assert b.unsupported_reasons(sub, b.options(opts), b.inputs(inputs)) == [], name
    needs = CommonNeeds()
    for sub, (opts, _) in zip(subs, chosen):
        needs = needs.merge(b.needs(sub.shape, opts))
    W = max(needs.block_table_columns or 1, -(-spec.max_exact_seq_len // spec.block_size))
    stager = Stager("cpu")
    with stager.step() as step:
        commons = stage_ubatches(spec, step, plan.padded_slices, token_arrays=needs.token_arrays,
                                 paged_kv=needs.paged_kv, block_table_columns=W)
        staged = [b.stage(cm, step, opts, inputs) for cm, (opts, inputs) in zip(commons, chosen)]
    assert step.stats.copies == 1
    for st_, cm in zip(staged, commons):
        meta = st_.result()
        assert isinstance(meta, b.metadata_type)
        assert cm.result().max_seq_len == spec.max_seq_len


@pytest.mark.parametrize("dev", ["meta", "cpu"])
def test_all_ubatches_one_copy_no_sync(dev: str) -> None:
    spec = _mixed()
    for n in (2, 3):
        plan = ubatch_slices(spec.num_scheduled_tokens, 96, 10, n)
        stager = Stager(dev)
        with no_device_sync(devices={dev}):
            with stager.step() as step:
                ubs = stage_ubatches(spec, step, plan.padded_slices, paged_kv=True)
            metas = [u.result() for u in ubs]
        assert step.stats.copies == 1 and stager.stats.copies == 1
        assert len(metas) == n and all(m.slot_mapping.device.type == dev for m in metas)
