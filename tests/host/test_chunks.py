"""attnmeta.host.chunks: Mamba2 chunk layouts vs the worked examples and the torch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attnmeta.host.chunks import (
    ChunkBuffers,
    allocate_chunk_buffers,
    checkpoint_chunk_index_tensor_values,
    chunk_metadata,
    logical_chunks,
    max_num_chunks,
    num_chunks,
    token_seq_idx,
    varlen_chunk_metadata,
)
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference.mamba import (
    ref_checkpoint_chunk_index,
    ref_chunk_metadata,
    ref_logical_chunks,
    ref_token_seq_idx,
    ref_varlen_chunk_metadata,
)
from attnmeta.testing.strategies import Mamba2ChunkLayout, mamba2_chunk_layouts


def i32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def qsl_of(lens: list[int]) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    out[1:] = np.cumsum(lens)
    return out


# A query_start_loc with zero-length rows: lists of lengths, cumsum'ed (valid by construction).
query_start_locs = st.lists(st.integers(0, 40), max_size=24).map(qsl_of)
small_chunk_sizes = st.sampled_from([1, 3, 8, 16])


# ------------------------------------------------------------------------------------------------
# the worked examples of docs/semantics-mamba.md ("The chunk-aligned layout") and the corner cases of
# docs/testing.md ("Corner cases to cover")


# (C, c, qsl, ckpt, cu, seq_idx, last, ckpt_idx)
WORKED = [
    pytest.param(8, [5, 0], [0, 10, 13], None, [0, 3, 10, 13], [0, 0, 1], [1, 2], [-1, -1], id="realign-3"),
    pytest.param(8, [0, 3], [0, 0, 0], None, [0, 0], [1], [-1, 0], [-1, -1], id="zero-token-rows"),
    pytest.param(4, [2], [0, 9], [2], [0, 2, 6, 9], [0, 0, 0], [2], [0], id="checkpoint"),
    pytest.param(
        256,
        [0, 256, 512],
        [0, 256, 768, 1024],
        None,
        [0, 256, 512, 768, 1024],
        [0, 1, 1, 2],
        [0, 2, 3],
        [-1, -1, -1],
        id="aligned-upstream",
    ),
    pytest.param(256, [], [0], None, [0], [], [], [], id="no-prefills"),
    # corner cases: c mod C = 0, 1, C-1
    pytest.param(8, [16], [0, 10], None, [0, 8, 10], [0, 0], [1], [-1], id="c-mod-C-0"),
    pytest.param(8, [17], [0, 10], None, [0, 7, 10], [0, 0], [1], [-1], id="c-mod-C-1"),
    pytest.param(8, [23], [0, 10], None, [0, 1, 9, 10], [0, 0, 0], [2], [-1], id="c-mod-C-C-1"),
    # q smaller than the realignment gap
    pytest.param(8, [3, 9], [0, 2, 3], None, [0, 2, 3], [0, 1], [0, 1], [-1, -1], id="q-below-gap"),
    # zero-token rows: unaligned first (empty chunk), then aligned (no chunk, repeats last)
    pytest.param(8, [3, 0, 8], [0, 0, 0, 4], None, [0, 0, 4], [0, 2], [0, 0, 1], [-1, -1, -1], id="zero-mix"),
    # checkpoints: k == n aligned (no trailing chunk), k == n unaligned (trailing empty chunk),
    # k == 0 on one row, unaligned checkpoint segment
    pytest.param(8, [0], [0, 8], [8], [0, 8], [0], [0], [0], id="ckpt-k-eq-n-aligned"),
    pytest.param(8, [3], [0, 4], [4], [0, 4, 4], [0, 0], [1], [0], id="ckpt-k-eq-n-unaligned"),
    pytest.param(
        8,
        [3, 0],
        [0, 20, 25],
        [9, 0],
        [0, 5, 9, 13, 20, 25],
        [0, 0, 0, 0, 1],
        [3, 4],
        [1, -1],
        id="ckpt-mixed",
    ),
]


@pytest.mark.parametrize(("C", "c", "qsl", "ckpt", "cu", "seq_idx", "last", "ckpt_idx"), WORKED)
def test_worked_examples(
    C: int,
    c: list[int],
    qsl: list[int],
    ckpt: list[int] | None,
    cu: list[int],
    seq_idx: list[int],
    last: list[int],
    ckpt_idx: list[int],
) -> None:
    offs = None if ckpt is None else i32(ckpt)
    m = chunk_metadata(C, i32(c), i32(qsl), offs)
    assert_host_equal(m.cu_chunk_seqlens, np.asarray(cu, dtype=np.int32), "cu_chunk_seqlens")
    assert_host_equal(m.seq_idx, np.asarray(seq_idx, dtype=np.int32), "seq_idx")
    assert_host_equal(m.last_chunk_indices, np.asarray(last, dtype=np.int32), "last_chunk_indices")
    assert_host_equal(m.checkpoint_chunk_idx, np.asarray(ckpt_idx, dtype=np.int64), "checkpoint_chunk_idx")
    assert m.num_chunks == len(seq_idx)
    assert num_chunks(C, i32(c), i32(qsl), offs) == len(seq_idx)
    # the reference agrees with the literal table too
    ref = ref_chunk_metadata(
        C, torch.tensor(c, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32), ckpt
    )
    for host, dev, name in zip(m[:4], ref, ("cu", "seq_idx", "last", "ckpt")):
        assert_matches_device(host, dev, name)


def test_checkpoint_tensor_values() -> None:
    assert checkpoint_chunk_index_tensor_values(np.array([-1, -1], np.int64)) is None
    assert checkpoint_chunk_index_tensor_values(np.zeros(0, np.int64)) is None
    got = checkpoint_chunk_index_tensor_values(np.array([-1, 0, 3], np.int64))
    assert_host_equal(got, np.array([0, 0, 3], np.int64))


def test_accepts_lists_and_int64() -> None:
    m = chunk_metadata(8, [5, 0], np.array([0, 10, 13], np.int64))  # type: ignore[arg-type]
    assert m.cu_chunk_seqlens.dtype == np.int32
    assert m.cu_chunk_seqlens.tolist() == [0, 3, 10, 13]


def test_non_power_of_two_chunk_size() -> None:
    m = chunk_metadata(6, i32([4, 0]), i32([0, 9, 16]))
    # row 0: realign 2 (4 -> 6), then 6, then 1; row 1: 6 + 1
    assert m.cu_chunk_seqlens.tolist() == [0, 2, 8, 9, 15, 16]
    assert m.last_chunk_indices.tolist() == [2, 4]


# ------------------------------------------------------------------------------------------------
# equivalence with the reference (device fixture)


@given(layout=mamba2_chunk_layouts())
@example(layout=Mamba2ChunkLayout(8, i32([0, 3]), i32([0, 0, 0]), None))
@example(layout=Mamba2ChunkLayout(8, i32([3, 0]), i32([0, 4, 4]), i32([4, 0])))
@example(layout=Mamba2ChunkLayout(2048, i32([]), i32([0]), i32([])))
def test_chunk_metadata_matches_reference(device: torch.device, layout: Mamba2ChunkLayout) -> None:
    cs, nc, qsl, offs = layout
    m = chunk_metadata(cs, nc, qsl, offs)
    ckpt_list = None if offs is None else offs.tolist()
    ref = ref_chunk_metadata(cs, torch.from_numpy(nc), torch.from_numpy(qsl), ckpt_list, device=device)
    assert_matches_device(m.cu_chunk_seqlens, ref[0], "cu_chunk_seqlens")
    assert_matches_device(m.seq_idx, ref[1], "seq_idx")
    assert_matches_device(m.last_chunk_indices, ref[2], "last_chunk_indices")
    assert_matches_device(m.checkpoint_chunk_idx, ref[3], "checkpoint_chunk_idx")
    assert m.num_chunks == m.seq_idx.shape[0] == m.cu_chunk_seqlens.shape[0] - 1
    assert num_chunks(cs, nc, qsl, offs) == m.num_chunks
    num_rows = nc.shape[0]
    bound = max_num_chunks(int(qsl[-1]), num_rows, cs, with_checkpoints=offs is not None)
    assert m.num_chunks <= bound
    assert_matches_device(
        checkpoint_chunk_index_tensor_values(m.checkpoint_chunk_idx),
        ref_checkpoint_chunk_index(ref[3].tolist(), device=device),
        "checkpoint_chunk_idx tensor",
    )
    # writing into exactly-bounded caller buffers, and inputs that are not exact int32 arrays (int64, a
    # list: the general path), give the same arrays
    bufs = allocate_chunk_buffers(bound, num_rows + 2)
    m2 = chunk_metadata(cs, nc, qsl, offs, out=bufs)
    m3 = chunk_metadata(cs, nc.astype(np.int64), qsl.tolist(), None if offs is None else offs.astype(np.int64))
    for other in (m2, m3):
        for a, b, name in zip(other[:4], m[:4], ("cu", "seq_idx", "last", "ckpt")):
            assert_host_equal(a, b, name)
        assert other.num_chunks == m.num_chunks
    assert np.shares_memory(m2.cu_chunk_seqlens, bufs.cu_chunk_seqlens)


# big batches are slow to generate: a fifth of the profile's examples (20 in ci, 200 thorough)
@settings(max_examples=max(10, settings.default.max_examples // 5))
@given(layout=mamba2_chunk_layouts(min_prefills=100, max_prefills=128))
def test_large_batches_match_reference(device: torch.device, layout: Mamba2ChunkLayout) -> None:
    """Hypothesis keeps lists short; this pins the 100-128 prefill batches of vLLM's test grid."""
    cs, nc, qsl, offs = layout
    m = chunk_metadata(cs, nc, qsl, offs)
    ckpt_list = None if offs is None else offs.tolist()
    ref = ref_chunk_metadata(cs, torch.from_numpy(nc), torch.from_numpy(qsl), ckpt_list, device=device)
    for host, dev, name in zip(m[:4], ref, ("cu", "seq_idx", "last", "ckpt")):
        assert_matches_device(host, dev, name)
    assert m.num_chunks <= max_num_chunks(int(qsl[-1]), nc.shape[0], cs, with_checkpoints=offs is not None)


@given(
    layout=mamba2_chunk_layouts(
        chunk_sizes=st.sampled_from([1, 5, 6, 8, 12]), max_prefills=16, max_new_tokens=40
    )
)
def test_any_chunk_size_matches_reference(layout: Mamba2ChunkLayout) -> None:
    """Non-powers of two take the division path of the kernel."""
    cs, nc, qsl, offs = layout
    m = chunk_metadata(cs, nc, qsl, offs)
    ref = ref_chunk_metadata(
        cs, torch.from_numpy(nc), torch.from_numpy(qsl), None if offs is None else offs.tolist()
    )
    for host, dev, name in zip(m[:4], ref, ("cu", "seq_idx", "last", "ckpt")):
        assert_matches_device(host, dev, name)
    assert num_chunks(cs, nc, qsl, offs) == m.num_chunks


def test_max_num_chunks_bound_is_tight_enough() -> None:
    assert max_num_chunks(0, 0, 256) == 0
    assert max_num_chunks(13, 2, 8) == 5
    assert max_num_chunks(1000, 3, 256, with_checkpoints=True) == 3 + 12
    # reached: a realigning chunk plus a partial tail; unaligned zero-token rows (T + P)
    assert chunk_metadata(8, i32([7]), i32([0, 2])).num_chunks == 2 == max_num_chunks(2, 1, 8)
    assert chunk_metadata(8, i32([3, 5]), i32([0, 0, 0])).num_chunks == 2 == max_num_chunks(0, 2, 8)


# ------------------------------------------------------------------------------------------------
# out= buffers


def test_buffers_for_no_prefills() -> None:
    """Sizes of 0 are sizes (a graph profile without prefill rows): only negative ones are refused."""
    assert [b.shape for b in allocate_chunk_buffers(0, 0)] == [(1,), (0,), (0,), (0,)]
    assert [b.shape for b in allocate_chunk_buffers(5, 0)] == [(6,), (5,), (0,), (0,)]


def test_out_buffers_too_small() -> None:
    bufs = allocate_chunk_buffers(2, 2)
    with pytest.raises(ValueError, match="needs 3 chunks"):
        chunk_metadata(8, i32([5, 0]), i32([0, 10, 13]), out=bufs)


def test_out_buffers_wrong_dtype_and_rows() -> None:
    good = allocate_chunk_buffers(8, 2)
    bad_dtype = ChunkBuffers(good.cu_chunk_seqlens.astype(np.int64), *good[1:])
    with pytest.raises(ValueError, match=r"out\.cu_chunk_seqlens: out= buffer must have dtype int32"):
        chunk_metadata(8, i32([5, 0]), i32([0, 10, 13]), out=bad_dtype)
    short_rows = ChunkBuffers(*good[:2], np.empty(1, np.int32), good[3])
    with pytest.raises(
        ValueError, match=r"out\.last_chunk_indices: out= buffer has 1 entries, need at least 2"
    ):
        chunk_metadata(8, i32([5, 0]), i32([0, 10, 13]), out=short_rows)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        chunk_metadata(8, i32([5, 0]), i32([0, 10, 13]), out=(torch.zeros(4, dtype=torch.int32), *good[1:]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected"):
        chunk_metadata(8, i32([5, 0]), i32([0, 10, 13]), out=good[:2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, [1], [0, 3]), r"chunk_size: must be a positive int, got 0"),
        ((-8, [1], [0, 3]), r"chunk_size: must be a positive int"),
        ((True, [1], [0, 3]), r"chunk_size: must be a positive int"),
        ((8, [1, -2], [0, 3, 4]), r"num_computed_p\[1\]=-2 is negative \(prefill row 1\)"),
        (
            (8, [1, 2], [0, 5, 4]),
            r"query_start_loc_p\[2\]=4 < query_start_loc_p\[1\]=5 \(row 1\).*non-decreasing",
        ),
        ((8, [1, 2], [1, 5, 6]), r"query_start_loc_p\[0\]=1: must be 0"),
        ((8, [1, 2], [0, 5]), r"query_start_loc_p: expected length num_prefills \+ 1 = 3"),
        ((8, [1], []), r"query_start_loc_p: expected length"),
        ((8, [1, 2], [0, 5, 9], [0, 5]), r"checkpoint_offsets\[1\]=5 > query length 4 \(prefill row 1\)"),
        ((8, [1, 2], [0, 5, 9], [-1, 0]), r"checkpoint_offsets\[0\]=-1 is negative \(prefill row 0\)"),
        ((8, [1, 2], [0, 5, 9], [1]), r"checkpoint_offsets: expected length num_prefills = 2"),
        ((8, [2**31], [0, 1]), r"num_computed_p\[0\]=2147483648 does not fit int32"),
    ],
)
def test_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        chunk_metadata(*args)
    with pytest.raises(ValueError, match=match):
        num_chunks(*args)


def test_rejects_tensors_and_floats() -> None:
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        chunk_metadata(8, torch.zeros(1, dtype=torch.int32), i32([0, 1]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="integer array"):
        chunk_metadata(8, np.zeros(1), i32([0, 1]))


def test_max_num_chunks_bad_input() -> None:
    with pytest.raises(ValueError, match="totals must be >= 0"):
        max_num_chunks(-1, 2, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        max_num_chunks(1, 2, 0)


# ------------------------------------------------------------------------------------------------
# logical chunks


def test_logical_chunks_example() -> None:
    idx, off = logical_chunks(i32([0, 5, 10]), 8)
    assert_host_equal(idx, np.array([0, 0, 1], np.int32))
    assert_host_equal(off, np.array([0, 5, 0], np.int32))


def test_logical_chunks_quirks() -> None:
    # an empty sequence at an unaligned start keeps its (empty) logical chunk
    idx, off = logical_chunks(i32([0, 5, 5, 10]), 8)
    assert idx.tolist() == [0, 0, 0, 1] and off.tolist() == [0, 5, 5, 0]
    # an aligned empty sequence at the end of an aligned batch: vLLM's IndexError write is skipped
    idx, off = logical_chunks(i32([0, 8, 8]), 8)
    assert idx.tolist() == [0] and off.tolist() == [0]
    idx, off = logical_chunks(i32([0]), 8)
    assert idx.shape == (0,) and idx.dtype == np.int32


@given(qsl=query_start_locs, cs=small_chunk_sizes)
def test_logical_chunks_match_reference(device: torch.device, qsl: np.ndarray, cs: int) -> None:
    idx, off = logical_chunks(qsl, cs)
    ref_idx, ref_off = ref_logical_chunks(torch.from_numpy(qsl).to(device), cs)
    assert_matches_device(idx, ref_idx, "chunk_indices")
    assert_matches_device(off, ref_off, "chunk_offsets")
    # every logical chunk lies in its physical chunk; into caller buffers gives the same
    assert (off < cs).all() and (off >= 0).all()
    n = idx.shape[0]
    bi, bo = np.full(n + 3, 99, np.int32), np.full(n + 3, 99, np.int32)
    i2, o2 = logical_chunks(qsl, cs, out=(bi, bo))
    assert_host_equal(i2, idx)
    assert_host_equal(o2, off)


def test_logical_chunks_bad_input() -> None:
    with pytest.raises(ValueError, match=r"query_start_loc\[2\]=3 < query_start_loc\[1\]=5"):
        logical_chunks(i32([0, 5, 3, 9]), 8)
    with pytest.raises(ValueError, match=r"query_start_loc\[0\]=2: must be 0"):
        logical_chunks(i32([2, 5]), 8)
    with pytest.raises(ValueError, match="chunk_size"):
        logical_chunks(i32([0, 5]), 0)
    with pytest.raises(ValueError, match="logical chunks but the buffers hold"):
        logical_chunks(i32([0, 5, 10]), 8, out=(np.empty(2, np.int32), np.empty(2, np.int32)))


# ------------------------------------------------------------------------------------------------
# per-token seq_idx


@given(qsl=query_start_locs, pad=st.integers(0, 5), consecutive=st.booleans())
def test_token_seq_idx_properties(device: torch.device, qsl: np.ndarray, pad: int, consecutive: bool) -> None:
    total = int(qsl[-1])
    got = token_seq_idx(qsl, num_tokens_padded=total + pad, consecutive=consecutive)
    assert got.dtype == np.int32 and got.shape == (total + pad,)
    assert (got[total:] == -1).all()
    real = got[:total]
    assert (real >= 0).all() and (np.diff(real) >= 0).all()
    lens = np.diff(qsl)
    if consecutive:
        assert real.tolist() == np.repeat(np.arange(int((lens > 0).sum())), lens[lens > 0]).tolist()
    else:
        assert real.tolist() == np.repeat(np.arange(lens.shape[0]), lens).tolist()
    ref = ref_token_seq_idx(
        torch.from_numpy(qsl).to(device), num_tokens_padded=total + pad, consecutive=consecutive
    )
    assert_matches_device(got, ref, "seq_idx")
    buf = np.empty(total + pad, np.int32)
    assert token_seq_idx(qsl, consecutive=consecutive, out=buf) is buf
    assert_host_equal(buf, got)


def test_token_seq_idx_bad_input() -> None:
    with pytest.raises(ValueError, match=r"num_tokens_padded=3: must be >= query_start_loc\[-1\]=5"):
        token_seq_idx(i32([0, 5]), num_tokens_padded=3)
    with pytest.raises(ValueError, match=r"query_start_loc\[2\]=9 > query_start_loc\[-1\]=7"):
        token_seq_idx(i32([0, 5, 9, 7]))
    with pytest.raises(ValueError, match="must have shape"):
        token_seq_idx(i32([0, 5]), num_tokens_padded=6, out=np.empty(5, np.int32))


# ------------------------------------------------------------------------------------------------
# vLLM compute_varlen_chunk_metadata


def test_varlen_example() -> None:
    cu, last, seq_idx = varlen_chunk_metadata(i32([0, 10, 13]), 8)
    assert_host_equal(cu, np.array([0, 8, 10, 13], np.int32))
    assert_host_equal(last, np.array([1, 2], np.int32))
    assert_host_equal(seq_idx, np.array([0, 0, 1], np.int32))
    # the builder's layout differs for the same qsl with unaligned context
    assert chunk_metadata(8, i32([5, 0]), i32([0, 10, 13])).cu_chunk_seqlens.tolist() == [0, 3, 10, 13]


def test_varlen_empty_rows() -> None:
    cu, last, seq_idx = varlen_chunk_metadata(i32([0, 0, 4, 4]), 8)
    assert cu.tolist() == [0, 4] and last.tolist() == [-1, 0, -1] and seq_idx.tolist() == [1]
    cu, last, seq_idx = varlen_chunk_metadata(i32([0]), 8)
    assert cu.tolist() == [0] and last.shape == (0,) and seq_idx.shape == (0,)


@given(qsl=query_start_locs, cs=small_chunk_sizes)
def test_varlen_matches_reference(device: torch.device, qsl: np.ndarray, cs: int) -> None:
    got = varlen_chunk_metadata(qsl, cs)
    ref = ref_varlen_chunk_metadata(torch.from_numpy(qsl).to(device), cs)
    for host, dev, name in zip(got, ref, ("cu", "last", "seq_idx")):
        assert_matches_device(host, dev, name)


def test_varlen_bad_input() -> None:
    with pytest.raises(ValueError, match=r"query_start_loc\[1\]=4 > query_start_loc\[-1\]=3"):
        varlen_chunk_metadata(i32([0, 4, 3]), 8)
