"""attnmeta.host.layout: worked examples, bad input, and bit-exact equivalence with the references."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attnmeta.host import layout
from attnmeta.spec import BatchSpec, ContextParallel
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import (
    ref_dcp_local_seq_lens,
    ref_is_prefilling,
    ref_positions,
    ref_prefill_cpu_metadata,
    ref_query_positions,
    ref_query_start_loc,
    ref_seq_lens,
    ref_slot_mapping,
    ref_token_layout,
    ref_token_req_indices,
)
from attnmeta.testing.strategies import batch_specs


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread() -> Iterator[None]:
    """The references run on tiny tensors: one intra-op thread avoids thread-pool stalls on a busy CI box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _t(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (the reference's input)."""
    return torch.from_numpy(np.array(x)).to(device)


def _cq(spec: BatchSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _t(spec.num_computed_tokens, device), _t(spec.num_scheduled_tokens, device)


_CP_SPECS = batch_specs(with_context_parallel=st.booleans(), cp_world_sizes=st.sampled_from([1, 2, 3, 4, 8]))

# A hand-made batch: a decode, a fresh prefill, a chunk across a block boundary, a zero-length row.
_C = np.array([5, 0, 7, 3], dtype=np.int32)
_Q = np.array([1, 4, 2, 0], dtype=np.int32)
_BT = np.array([[10, 11, -1], [20, -1, -1], [30, 31, 32], [40, -1, -1]], dtype=np.int32)


# --------------------------------------------------------------------------------------------------
# worked examples
# --------------------------------------------------------------------------------------------------


def test_small_batch_values() -> None:
    assert_host_equal(layout.query_start_loc(_Q, num_reqs_padded=6), np.array([0, 1, 5, 7, 7, 7, 7], np.int32))
    assert_host_equal(layout.seq_lens(_C, _Q, num_reqs_padded=5), np.array([6, 4, 9, 3, 0], np.int32))
    assert_host_equal(layout.token_req_indices(_Q), np.array([0, 1, 1, 1, 1, 2, 2], np.int32))
    assert_host_equal(layout.query_positions(_Q), np.array([0, 0, 1, 2, 3, 0, 1], np.int32))
    assert_host_equal(layout.positions(_C, _Q, num_tokens_padded=9), np.array([5, 0, 1, 2, 3, 7, 8, 0, 0]))
    assert_host_equal(
        layout.slot_mapping(_C, _Q, _BT, 4, num_tokens_padded=9),
        np.array([45, 80, 81, 82, 83, 127, 128, -1, -1]),
    )
    assert_host_equal(
        layout.is_prefilling(_C, [5, 8, 9, 3], num_reqs_padded=5), np.array([False, True, True, False, False])
    )


def test_slot_mapping_context_parallel_by_hand() -> None:
    # W=2, I=2, block_size=4 -> virtual block of 8 tokens; ranks own tokens [0,1],[4,5] (rank 0) and
    # [2,3],[6,7] (rank 1) of each virtual block, at local offsets 0,1,2,3.
    c, q, bt = [0], [10], [[7, 9, 11]]
    r0 = layout.slot_mapping(c, q, bt, 4, context_parallel=ContextParallel(2, 0, 2))
    r1 = layout.slot_mapping(c, q, bt, 4, context_parallel=ContextParallel(2, 1, 2))
    assert_host_equal(r0, np.array([28, 29, -1, -1, 30, 31, -1, -1, 36, 37]))
    assert_host_equal(r1, np.array([-1, -1, 28, 29, -1, -1, 30, 31, -1, -1]))
    # world_size 1 is the plain layout whatever the interleave.
    plain = layout.slot_mapping(c, q, bt, 4)
    assert_host_equal(layout.slot_mapping(c, q, bt, 4, context_parallel=ContextParallel(1, 0, 2)), plain)


@pytest.mark.parametrize(
    ("seq", "world", "interleave", "expected"),
    [
        # base = (S // I // W) * I, rem = S - base * W, rank r: base + clip(rem - r * I, 0, I)
        ([0, 1, 5, 8, 11], 4, 1, [[0, 0, 0, 0], [1, 0, 0, 0], [2, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 2]]),
        ([3, 8, 13, 16, 21], 2, 4, [[3, 0], [4, 4], [8, 5], [8, 8], [12, 9]]),
        ([7, 12, 1], 3, 2, [[3, 2, 2], [4, 4, 4], [1, 0, 0]]),
        ([5, 0], 1, 1, [[5], [0]]),
    ],
)
def test_dcp_local_seq_lens_worked(seq: list[int], world: int, interleave: int, expected: list[list[int]]) -> None:
    want = np.array(expected, dtype=np.int32)
    assert_host_equal(layout.dcp_local_seq_lens(seq, world, interleave=interleave), want)
    for r in range(world):
        assert_host_equal(layout.dcp_local_seq_lens(seq, world, r, interleave), want[:, r].copy())


def test_dcp_local_seq_lens_single_rank_literal() -> None:
    assert_host_equal(layout.dcp_local_seq_lens([0, 1, 5, 8, 11], 4, rank=2), np.array([0, 0, 1, 2, 3], np.int32))


def test_prefill_cpu_metadata_worked() -> None:
    # Two decodes (q=1), then prefills with q=5 (fresh) and q=3 (context 5).
    ctx, qsl_p = layout.prefill_cpu_metadata(
        [0, 1, 2, 7, 10], [9, 4, 5, 8], num_reqs=4, num_prefills=2, num_decode_tokens=2
    )
    assert_host_equal(ctx, np.array([0, 5], np.int32))
    assert_host_equal(qsl_p, np.array([0, 5, 8], np.int32))
    ctx, qsl_p = layout.prefill_cpu_metadata([0, 1, 2], [9, 4], num_reqs=2, num_prefills=0, num_decode_tokens=2)
    assert ctx.shape == (0,) and ctx.dtype == np.int32
    assert_host_equal(qsl_p, np.array([0], np.int32))


def test_empty_batch() -> None:
    assert_host_equal(layout.query_start_loc([]), np.array([0], np.int32))
    assert_host_equal(layout.query_start_loc([], num_reqs_padded=2), np.array([0, 0, 0], np.int32))
    assert_host_equal(layout.seq_lens([], []), np.zeros(0, np.int32))
    assert_host_equal(layout.token_req_indices([]), np.zeros(0, np.int32))
    assert_host_equal(layout.positions([], [], num_tokens_padded=2), np.zeros(2, np.int64))
    assert_host_equal(layout.slot_mapping([], [], np.zeros((0, 1), np.int32), 16, num_tokens_padded=2), np.full(2, -1))


# --------------------------------------------------------------------------------------------------
# out= buffers
# --------------------------------------------------------------------------------------------------


def test_out_buffers_are_filled_in_place() -> None:
    staging = np.full(32, 99, dtype=np.int64)
    pos_view, slot_view = staging[:9], staging[9:18]
    pos, slots = layout.token_layout(
        _C, _Q, _BT, 4, num_tokens_padded=9, positions_out=pos_view, slot_mapping_out=slot_view
    )
    assert pos is pos_view and slots is slot_view
    assert_host_equal(staging[:18], np.concatenate([layout.positions(_C, _Q, num_tokens_padded=9),
                                                    layout.slot_mapping(_C, _Q, _BT, 4, num_tokens_padded=9)]))
    assert (staging[18:] == 99).all()
    qsl = np.full(8, 99, dtype=np.int32)
    assert layout.query_start_loc(_Q, num_reqs_padded=7, out=qsl) is qsl


@pytest.mark.parametrize(
    ("out", "match"),
    [
        (np.zeros(4, np.int64), "dtype int32"),
        (np.zeros(6, np.int32), r"shape \(5,\)"),
        (np.zeros(10, np.int32)[::2], "C-contiguous"),
    ],
)
def test_bad_out(out: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        layout.query_start_loc(_Q, out=out)


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------


def test_negative_counts_name_field_and_row() -> None:
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[2\]=-1 is negative \(request 2\)"):
        layout.query_start_loc([1, 2, -1])
    with pytest.raises(ValueError, match=r"num_computed_tokens\[1\]=-3 is negative"):
        layout.seq_lens([0, -3], [1, 1])
    with pytest.raises(ValueError, match=r"num_computed_tokens\[0\]=-1 is negative"):
        layout.slot_mapping([-1], [1], [[0]], 4)
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[1\]=-2 is negative"):
        layout.token_req_indices([3, -2])
    with pytest.raises(ValueError, match=r"num_prompt_tokens\[0\]=-4 is negative"):
        layout.is_prefilling([1], [-4])
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=-1 is negative"):
        layout.dcp_local_seq_lens([3, -1], 2)


def test_overflow() -> None:
    big = np.iinfo(np.int32).max
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=.* overflows int32 \(request 1\)"):
        layout.seq_lens([0, big], [1, 1])
    with pytest.raises(ValueError, match=r"total .* overflows int32"):
        layout.token_req_indices([big, 1])
    with pytest.raises(ValueError, match=r"query_start_loc\[2\].*overflows int32 at request 1"):
        layout.query_start_loc([big, 1])
    with pytest.raises(ValueError, match="does not fit int32"):
        layout.query_start_loc(np.array([2**31], dtype=np.int64))


def test_type_errors() -> None:
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        layout.query_start_loc(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="integer array"):
        layout.seq_lens([1.0], [1.0])
    with pytest.raises(TypeError, match="num_reqs_padded: expected an int"):
        layout.seq_lens([1], [1], num_reqs_padded=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="context_parallel: expected ContextParallel"):
        layout.slot_mapping([0], [1], [[0]], 4, context_parallel=(2, 0, 1))  # type: ignore[arg-type]


def test_length_mismatch_and_padding() -> None:
    with pytest.raises(ValueError, match=r"num_scheduled_tokens: expected length 2, got shape \(3,\)"):
        layout.positions([1, 2], [1, 1, 1])
    with pytest.raises(ValueError, match="num_reqs_padded=1 < num_reqs=2; padding can only add"):
        layout.seq_lens([1, 2], [1, 1], num_reqs_padded=1)
    with pytest.raises(ValueError, match="num_tokens_padded=2 < num_tokens=3"):
        layout.positions([1, 2], [1, 2], num_tokens_padded=2)


def test_block_table_errors() -> None:
    with pytest.raises(ValueError, match=r"block_table: has 1 rows, need one per request \(2\)"):
        layout.slot_mapping([0, 0], [1, 1], [[0, 1]], 4)
    with pytest.raises(ValueError, match=r"request 0 \(seq_len 9\) reads column 2 .* table has 2 columns"):
        layout.slot_mapping([8], [1], [[0, 1]], 4)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=-1 is negative but column 1 holds tokens of request 0"):
        layout.slot_mapping([2], [4], [[3, -1]], 4)
    with pytest.raises(ValueError, match="block_size: must be >= 1"):
        layout.slot_mapping([0], [1], [[0]], 0)
    # A negative id in a column no token of this step reads is fine (it is stale context).
    assert_host_equal(layout.slot_mapping([4], [1], [[-1, 5]], 4), np.array([20]))


def test_context_parallel_errors() -> None:
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        layout.slot_mapping([0], [1], [[0]], 4, context_parallel=ContextParallel(2, 2))
    with pytest.raises(ValueError, match="interleave=3 must divide block_size=4"):
        layout.slot_mapping([0], [1], [[0]], 4, context_parallel=ContextParallel(2, 0, 3))
    with pytest.raises(ValueError, match="world_size: must be >= 1"):
        layout.dcp_local_seq_lens([1], 0)
    with pytest.raises(ValueError, match="rank: need 0 <= rank < world_size=2, got 2"):
        layout.dcp_local_seq_lens([1], 2, 2)


def test_prefill_cpu_metadata_errors() -> None:
    with pytest.raises(ValueError, match="num_prefills=3 > num_reqs=2"):
        layout.prefill_cpu_metadata([0, 1, 2], [1, 1], num_reqs=2, num_prefills=3, num_decode_tokens=0)
    with pytest.raises(ValueError, match=r"query_start_loc_cpu: expected length 3"):
        layout.prefill_cpu_metadata([0, 1], [1, 1], num_reqs=2, num_prefills=1, num_decode_tokens=0)
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound\[1\]=2 < query length 4 of prefill request 1"):
        layout.prefill_cpu_metadata([0, 1, 5], [1, 2], num_reqs=2, num_prefills=1, num_decode_tokens=1)


# --------------------------------------------------------------------------------------------------
# equivalence with the device references (bit exact: dtype, shape, values)
# --------------------------------------------------------------------------------------------------


@given(spec=batch_specs())
def test_query_start_loc_and_seq_lens_match_reference(spec: BatchSpec, device: torch.device) -> None:
    c, q = _cq(spec, device)
    rows = spec.num_reqs_padded
    assert_matches_device(
        layout.query_start_loc(spec.num_scheduled_tokens, num_reqs_padded=rows),
        ref_query_start_loc(q, rows),
        "query_start_loc",
    )
    assert_matches_device(
        layout.seq_lens(spec.num_computed_tokens, spec.num_scheduled_tokens, num_reqs_padded=rows),
        ref_seq_lens(c, q, rows),
        "seq_lens",
    )


@given(spec=batch_specs(with_prompts=st.just(True)))
def test_is_prefilling_matches_reference(spec: BatchSpec, device: torch.device) -> None:
    assert spec.num_prompt_tokens is not None
    host = layout.is_prefilling(spec.num_computed_tokens, spec.num_prompt_tokens, num_reqs_padded=spec.num_reqs_padded)
    ref = ref_is_prefilling(_t(spec.num_computed_tokens, device), _t(spec.num_prompt_tokens, device), spec.num_reqs_padded)
    assert_matches_device(host, ref, "is_prefilling")


@given(spec=batch_specs())
def test_token_indices_match_reference(spec: BatchSpec, device: torch.device) -> None:
    q = _t(spec.num_scheduled_tokens, device)
    assert_matches_device(layout.token_req_indices(spec.num_scheduled_tokens), ref_token_req_indices(q), "req_idx")
    assert_matches_device(layout.query_positions(spec.num_scheduled_tokens), ref_query_positions(q), "query_pos")


@given(spec=batch_specs())
def test_positions_match_reference(spec: BatchSpec, device: torch.device) -> None:
    c, q = _cq(spec, device)
    host = layout.positions(spec.num_computed_tokens, spec.num_scheduled_tokens, num_tokens_padded=spec.num_tokens_padded)
    assert_matches_device(host, ref_positions(c, q, spec.num_tokens_padded), "positions")


@given(spec=_CP_SPECS)
@example(
    spec=BatchSpec(
        num_computed_tokens=np.array([0, 13], np.int32),
        num_scheduled_tokens=np.array([0, 11], np.int32),
        block_table=np.array([[0, 0, 0, 0, 0, 0], [5, 6, 7, 8, 9, 10]], np.int32),
        block_size=4,
        num_tokens_padded=12,
        context_parallel=ContextParallel(2, 1, 2),
    )
)
def test_slot_mapping_matches_reference(spec: BatchSpec, device: torch.device) -> None:
    c, q = _cq(spec, device)
    host = layout.slot_mapping(
        spec.num_computed_tokens,
        spec.num_scheduled_tokens,
        spec.block_table,
        spec.block_size,
        num_tokens_padded=spec.num_tokens_padded,
        context_parallel=spec.context_parallel,
    )
    ref = ref_slot_mapping(
        c, q, _t(spec.block_table, device), spec.block_size, spec.num_tokens_padded, spec.context_parallel
    )
    assert_matches_device(host, ref, "slot_mapping")


@given(spec=batch_specs(with_context_parallel=st.booleans(), long_prefills=True, max_reqs=6))
def test_token_layout_matches_reference_and_separate_functions(spec: BatchSpec, device: torch.device) -> None:
    args = (spec.num_computed_tokens, spec.num_scheduled_tokens, spec.block_table, spec.block_size)
    kw = {"num_tokens_padded": spec.num_tokens_padded, "context_parallel": spec.context_parallel}
    pos, slots = layout.token_layout(*args, **kw)  # type: ignore[arg-type]
    c, q = _cq(spec, device)
    ref_pos, ref_slots = ref_token_layout(
        c, q, _t(spec.block_table, device), spec.block_size, spec.num_tokens_padded, spec.context_parallel
    )
    assert_matches_device(pos, ref_pos, "positions")
    assert_matches_device(slots, ref_slots, "slot_mapping")
    assert_host_equal(pos, layout.positions(spec.num_computed_tokens, spec.num_scheduled_tokens,
                                            num_tokens_padded=spec.num_tokens_padded))
    assert_host_equal(slots, layout.slot_mapping(*args, **kw))  # type: ignore[arg-type]


@given(spec=batch_specs(with_upper_bound=st.just(True)), world=st.integers(1, 8), data=st.data())
def test_dcp_local_seq_lens_matches_reference(spec: BatchSpec, world: int, data: st.DataObject, device: torch.device) -> None:
    assert spec.seq_lens_upper_bound is not None
    seq = spec.seq_lens_upper_bound
    interleave = data.draw(st.sampled_from([1, 2, 4, 16]), label="interleave")
    rank = data.draw(st.none() | st.integers(0, world - 1), label="rank")
    host = layout.dcp_local_seq_lens(seq, world, rank, interleave)
    assert_matches_device(host, ref_dcp_local_seq_lens(_t(seq, device), world, rank, interleave), "dcp_local_seq_lens")
    if rank is None:
        assert_host_equal(host.sum(axis=1, dtype=np.int64), seq.astype(np.int64), "tokens over all ranks")


@given(spec=batch_specs(with_context_parallel=st.just(True), cp_world_sizes=st.sampled_from([1, 2, 3, 4, 8])))
def test_dcp_local_seq_lens_counts_local_slots(spec: BatchSpec) -> None:
    """A full prefill of each sequence stores exactly dcp_local_seq_lens tokens on this rank."""
    cp = spec.context_parallel
    assert cp is not None
    seq = (spec.num_computed_tokens.astype(np.int64) + spec.num_scheduled_tokens).astype(np.int32)
    zeros = np.zeros_like(seq)
    slots = layout.slot_mapping(zeros, seq, spec.block_table, spec.block_size, context_parallel=cp)
    req = layout.token_req_indices(seq)
    local = np.bincount(req[slots >= 0], minlength=seq.shape[0]).astype(np.int32)
    assert_host_equal(local, layout.dcp_local_seq_lens(seq, cp.world_size, cp.rank, cp.interleave))


@given(spec=batch_specs(with_upper_bound=st.booleans()), data=st.data())
def test_prefill_cpu_metadata_matches_reference(spec: BatchSpec, data: st.DataObject, device: torch.device) -> None:
    rows = spec.padded_num_reqs
    qsl = layout.query_start_loc(spec.num_scheduled_tokens, num_reqs_padded=rows)
    upper = np.zeros(rows, dtype=np.int32)
    upper[: spec.num_reqs] = (
        spec.seq_lens_upper_bound
        if spec.seq_lens_upper_bound is not None
        else layout.seq_lens(spec.num_computed_tokens, spec.num_scheduled_tokens)
    )
    num_prefills = data.draw(st.integers(0, rows), label="num_prefills")
    dt = int(qsl[rows - num_prefills])
    host = layout.prefill_cpu_metadata(qsl, upper, num_reqs=rows, num_prefills=num_prefills, num_decode_tokens=dt)
    ref = ref_prefill_cpu_metadata(_t(qsl, device), _t(upper, device), rows, num_prefills, dt)
    assert_matches_device(host[0], ref[0], "num_computed_tokens_p")
    assert_matches_device(host[1], ref[1], "query_start_loc_p")
    if spec.seq_lens_upper_bound is None:
        # An exact upper bound gives back the computed counts (0 on padding rows).
        computed = np.zeros(rows, dtype=np.int32)
        computed[: spec.num_reqs] = spec.num_computed_tokens
        assert_host_equal(host[0], computed[rows - num_prefills :])
