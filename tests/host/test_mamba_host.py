"""attnmeta.host.mamba: state indices, classification and prefill checkpoints vs the references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given

from attnmeta.host.chunks import chunk_metadata
from attnmeta.host.mamba import (
    CheckpointConfig,
    classify_mamba_rows,
    gather_checkpoint_state_indices,
    mamba_state_indices,
    prefill_checkpoints,
)
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference.mamba import (
    ref_classify_mamba_rows,
    ref_mamba_state_indices,
    ref_prefill_checkpoints,
)
from attnmeta.testing.strategies import (
    MambaClassificationCase,
    MambaStateIndexCase,
    PrefillCheckpointCase,
    mamba_classification_cases,
    mamba_state_index_cases,
    prefill_checkpoint_cases,
)


def i32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


# ------------------------------------------------------------------------------------------------
# state indices (5.10)


def test_state_indices_align_example() -> None:
    bt = np.arange(40, dtype=np.int32).reshape(4, 10)
    got = mamba_state_indices(bt, i32([1, 16, 17, 0]), mamba_block_size=8, mode="align", num_state_columns=3)
    # starts: max((s-1)//8, 0) = 0, 1, 2, 0 (padding row reads column 0)
    assert_host_equal(got, np.array([[0, 1, 2], [11, 12, 13], [22, 23, 24], [30, 31, 32]], np.int32))


@given(case=mamba_state_index_cases())
def test_state_indices_match_reference(device: torch.device, case: MambaStateIndexCase) -> None:
    got = mamba_state_indices(
        case.block_table,
        case.seq_lens,
        mamba_block_size=case.mamba_block_size,
        mode=case.mode,  # type: ignore[arg-type]
        num_state_columns=case.num_state_columns,
    )
    ref = ref_mamba_state_indices(
        torch.from_numpy(case.block_table).to(device),
        torch.from_numpy(case.seq_lens).to(device),
        mamba_block_size=case.mamba_block_size,
        mode=case.mode,
        num_state_columns=case.num_state_columns,
    )
    assert_matches_device(got, ref, "state_indices")
    out = np.empty_like(got)
    again = mamba_state_indices(
        case.block_table,
        case.seq_lens,
        mamba_block_size=case.mamba_block_size,
        mode=case.mode,  # type: ignore[arg-type]
        num_state_columns=case.num_state_columns,
        out=out,
    )
    assert again is out
    assert_host_equal(out, got)


def test_state_indices_bad_input() -> None:
    bt = np.zeros((2, 3), np.int32)
    kw = {"mamba_block_size": 4, "num_state_columns": 2}
    with pytest.raises(
        ValueError, match=r"block_table: row 1 needs columns 2\.\.3 .*but the table has 3 columns"
    ):
        mamba_state_indices(bt, i32([4, 9]), mode="align", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=-1 is negative"):
        mamba_state_indices(bt, i32([-1, 2]), mode="align", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode: must be 'none' or 'align'"):
        mamba_state_indices(bt, i32([1, 2]), mode="all", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_table: has 2 rows, need one per seq_lens entry"):
        mamba_state_indices(bt, i32([1, 2, 3]), mode="none", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_state_columns: must be a positive int"):
        mamba_state_indices(bt, i32([1, 2]), mode="none", mamba_block_size=4, num_state_columns=0)
    with pytest.raises(ValueError, match="must have shape"):
        mamba_state_indices(bt, i32([1, 2]), mode="none", out=np.empty((2, 3), np.int32), **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# classification (6.3 step 3)


def test_classification_example() -> None:
    qsl = i32([0, 1, 2, 5, 7, 7])
    ub = i32([9, 1, 8, 6, 0])
    isp = np.array([True, True, True, True, False])
    before = isp.copy()
    got, moved = classify_mamba_rows(qsl, ub, isp)
    # row 0: one-token chunk with prior state -> decode; row 1: first token of a prompt (no prior state)
    assert got.tolist() == [False, True, True, True, False] and moved
    assert_host_equal(isp, before)  # never mutates its input
    got, moved = classify_mamba_rows(qsl, ub, isp, i32([-1, -1, 2, -1, -1]))
    assert got.tolist() == [False, True, False, True, False] and moved
    got, moved = classify_mamba_rows(qsl[:1], ub[:0], isp[:0])
    assert got.shape == (0,) and not moved


@given(case=mamba_classification_cases())
def test_classification_matches_reference(case: MambaClassificationCase) -> None:
    before = case.is_prefilling.copy()
    got, moved = classify_mamba_rows(*case)
    drafts = None if case.num_decode_draft_tokens is None else torch.from_numpy(case.num_decode_draft_tokens)
    ref, ref_moved = ref_classify_mamba_rows(
        torch.from_numpy(case.query_start_loc_cpu),
        torch.from_numpy(case.seq_lens_upper_bound),
        torch.from_numpy(case.is_prefilling),
        drafts,
    )
    assert_matches_device(got, ref, "is_prefilling")
    assert moved == ref_moved
    assert got is not case.is_prefilling
    assert_host_equal(case.is_prefilling, before)


def test_classification_bad_input() -> None:
    isp = np.array([True, True])
    with pytest.raises(ValueError, match=r"query_start_loc_cpu\[2\]=1 < query_start_loc_cpu\[1\]=3"):
        classify_mamba_rows(i32([0, 3, 1]), i32([3, 3]), isp)
    with pytest.raises(ValueError, match=r"num_decode_draft_tokens\[1\]=-3 < -1"):
        classify_mamba_rows(i32([0, 1, 2]), i32([3, 3]), isp, i32([0, -3]))
    with pytest.raises(ValueError, match="query_start_loc_cpu: expected length num_reqs \\+ 1 = 3"):
        classify_mamba_rows(i32([0, 1]), i32([3, 3]), isp)
    with pytest.raises(TypeError, match="bool array"):
        classify_mamba_rows(i32([0, 1, 2]), i32([3, 3]), i32([1, 1]))
    with pytest.raises(ValueError, match="is_prefilling: expected length num_reqs = 2"):
        classify_mamba_rows(i32([0, 1, 2]), i32([3, 3]), np.array([True]))


# ------------------------------------------------------------------------------------------------
# prefill checkpoints (6.8)

CFG = CheckpointConfig(
    hash_block_size=4, cache_hit_alignment_tokens=4, mamba_block_size=4, checkpoint_alignment=4
)


def test_checkpoint_example_and_chunk_layout() -> None:
    bt = np.arange(12, dtype=np.int32).reshape(2, 6)
    r = prefill_checkpoints(i32([17, 20]), i32([17, 12]), bt, config=CFG)
    assert r is not None
    # row 0: qs=0, pos=16, col=cdiv(17,4)-2=3; row 1: qs=8, pos=16, col=3
    assert_host_equal(r.offsets, np.array([16, 8], np.int32))
    assert_host_equal(r.cols, np.array([3, 3], np.int64))
    assert r.state_indices is not None
    assert_host_equal(r.state_indices, np.array([3, 9], np.int32))
    # the offsets put a chunk boundary on each checkpoint
    m = chunk_metadata(4, i32([0, 8]), i32([0, 17, 29]), r.offsets)
    cu = m.cu_chunk_seqlens
    assert cu[m.checkpoint_chunk_idx[0] + 1] == 16 and cu[m.checkpoint_chunk_idx[1] + 1] == 17 + 8
    assert_host_equal(gather_checkpoint_state_indices(bt, r.cols), r.state_indices)


def test_checkpoint_none_cases() -> None:
    assert prefill_checkpoints(i32([]), i32([]), config=CFG) is None
    off = CFG._replace(checkpoint_alignment=None)
    assert prefill_checkpoints(i32([17]), i32([17]), config=off) is None
    # drop_eagle moves the position back one H; lookahead moves lim back
    eagle = CFG._replace(drop_eagle_block=True)
    r = prefill_checkpoints(i32([17]), i32([17]), config=eagle)
    assert r is not None and r.offsets.tolist() == [12] and r.state_indices is None
    look = CFG._replace(num_hash_lookahead_tokens=2)
    r = prefill_checkpoints(i32([17]), i32([17]), config=look)
    assert r is not None and r.offsets.tolist() == [12]


@given(case=prefill_checkpoint_cases())
def test_checkpoints_match_reference(device: torch.device, case: PrefillCheckpointCase) -> None:
    got = prefill_checkpoints(
        case.seq_lens_upper_bound_p, case.query_lens_p, case.block_table_p, config=case.config
    )
    ref = ref_prefill_checkpoints(
        torch.from_numpy(case.seq_lens_upper_bound_p),
        torch.from_numpy(case.query_lens_p),
        torch.from_numpy(case.block_table_p).to(device),
        config=case.config,
        device=device,
    )
    if ref is None:
        assert got is None
        return
    assert got is not None
    assert_matches_device(got.offsets, ref[0], "offsets")
    assert_matches_device(got.cols, ref[1], "cols")
    assert_matches_device(got.state_indices, ref[2], "state_indices")
    # the offsets are valid checkpoint offsets for the chunk layout
    qsl = np.zeros(case.query_lens_p.shape[0] + 1, np.int32)
    qsl[1:] = np.cumsum(case.query_lens_p)
    nc = case.seq_lens_upper_bound_p - case.query_lens_p
    chunk_metadata(16, nc, qsl, got.offsets)


def test_checkpoint_bad_input() -> None:
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound_p\[0\]=3 < query_lens_p\[0\]=5"):
        prefill_checkpoints(i32([3]), i32([5]), config=CFG)
    with pytest.raises(ValueError, match=r"query_lens_p\[0\]=-1 is negative"):
        prefill_checkpoints(i32([3]), i32([-1]), config=CFG)
    with pytest.raises(ValueError, match="query_lens_p: expected length num_prefills = 1"):
        prefill_checkpoints(i32([3]), i32([1, 2]), config=CFG)
    with pytest.raises(ValueError, match=r"config\.mamba_block_size: must be a positive int"):
        prefill_checkpoints(i32([3]), i32([1]), config=CFG._replace(mamba_block_size=0))
    with pytest.raises(ValueError, match=r"config\.checkpoint_alignment: must be a positive int"):
        prefill_checkpoints(i32([3]), i32([1]), config=CFG._replace(checkpoint_alignment=0))
    with pytest.raises(TypeError, match="config: expected CheckpointConfig"):
        prefill_checkpoints(i32([3]), i32([1]), config=(4, 4, 4, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint in column 3 but the table has 2 columns"):
        prefill_checkpoints(i32([17]), i32([17]), np.zeros((1, 2), np.int32), config=CFG)
