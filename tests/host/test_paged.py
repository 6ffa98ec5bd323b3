"""FlashInfer paged-KV layout on the host (docs/semantics-attention.md, "FlashInferMetadata") against the device references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attnmeta.host.paged import (
    num_pages,
    paged_kv_indices,
    paged_kv_indptr,
    paged_kv_last_page_len,
    paged_kv_layout,
    rebase_indptr,
)
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import (
    ref_paged_kv_indices,
    ref_paged_kv_indptr,
    ref_paged_kv_last_page_len,
)
from attnmeta.testing.strategies import PagedBatch, paged_batches

I32 = np.int32


def _dev(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(arr)).to(device)


# ------------------------------------------------------------------------------------------------
# structure: worked values
# ------------------------------------------------------------------------------------------------


def test_worked_example_with_padding_rows() -> None:
    # s % page == 0 -> page; s == 0 (padding) -> 0 pages and last_page_len 0; page boundary +1 -> 1.
    seq_lens = np.array([16, 17, 3, 0, 0], I32)
    bt = np.array([[5, 6, 0], [7, 8, 9], [1, 0, 0], [0, 0, 0], [0, 0, 0]], I32)
    kv = paged_kv_layout(seq_lens, bt, 8)
    assert_host_equal(kv.paged_kv_indptr, np.array([0, 2, 5, 6, 6, 6], I32), "indptr")
    assert_host_equal(kv.paged_kv_indices, np.array([5, 6, 7, 8, 9, 1], I32), "indices")
    assert_host_equal(kv.paged_kv_last_page_len, np.array([8, 1, 3, 0, 0], I32), "last_page_len")
    assert num_pages(seq_lens, 8) == 6


def test_empty_batch() -> None:
    kv = paged_kv_layout(np.zeros(0, I32), np.zeros((0, 4), I32), 16)
    assert_host_equal(kv.paged_kv_indptr, np.array([0], I32))
    assert kv.paged_kv_indices.shape == (0,) and kv.paged_kv_indices.dtype == I32
    assert kv.paged_kv_last_page_len.shape == (0,) and kv.paged_kv_last_page_len.dtype == I32
    assert num_pages(np.zeros(0, I32), 16) == 0


def test_out_buffers_are_written_in_place() -> None:
    seq_lens = np.array([5, 4, 0, 9], I32)
    bt = np.array([[7, 3, 9], [4, 1, 6], [0, 0, 0], [2, 5, 8]], I32)
    total = num_pages(seq_lens, 4)
    staging = np.full(5 + 4 + total + 2, -7, I32)  # two guard entries after the arrays
    ip, lp, ix = staging[:5], staging[5:9], staging[9 : 9 + total]
    kv = paged_kv_layout(seq_lens, bt, 4, indptr_out=ip, indices_out=ix, last_page_len_out=lp)
    assert kv.paged_kv_indptr is ip and kv.paged_kv_indices is ix and kv.paged_kv_last_page_len is lp
    assert staging.tolist() == [0, 2, 3, 3, 6, 1, 4, 0, 1, 7, 3, 4, 2, 5, 8, -7, -7]
    out = np.empty(5, I32)
    assert paged_kv_indptr(seq_lens, 4, out=out) is out
    out_ix = np.empty(6, I32)
    assert paged_kv_indices(bt, out, out=out_ix) is out_ix
    assert_host_equal(out_ix, kv.paged_kv_indices)


def test_rebase_indptr_prefill_part() -> None:
    qsl = np.array([0, 1, 2, 9, 14], I32)
    assert_host_equal(rebase_indptr(qsl, 2, 4), np.array([0, 7, 12], I32))
    assert_host_equal(rebase_indptr(qsl, 4, 4), np.array([0], I32))
    assert_host_equal(rebase_indptr(qsl, 0, 4), qsl)


# ------------------------------------------------------------------------------------------------
# numerics: host vs device reference, bit for bit
# ------------------------------------------------------------------------------------------------


@given(batch=paged_batches())
@example(batch=PagedBatch(np.array([0, 0], I32), np.zeros((2, 1), I32), 16))
@example(batch=PagedBatch(np.array([1, 16, 17, 32], I32), np.arange(12, dtype=I32).reshape(4, 3), 16))
def test_paged_layout_matches_reference(device: torch.device, batch: PagedBatch) -> None:
    s_dev = _dev(batch.seq_lens, device)
    bt_dev = _dev(batch.block_table, device)
    ref_indptr = ref_paged_kv_indptr(s_dev, batch.page_size)
    ref_indices = ref_paged_kv_indices(bt_dev, s_dev, batch.page_size)
    ref_last = ref_paged_kv_last_page_len(s_dev, batch.page_size)

    indptr = paged_kv_indptr(batch.seq_lens, batch.page_size)
    assert_matches_device(indptr, ref_indptr, "paged_kv_indptr")
    assert_matches_device(paged_kv_indices(batch.block_table, indptr), ref_indices, "paged_kv_indices")
    assert_matches_device(
        paged_kv_last_page_len(batch.seq_lens, batch.page_size), ref_last, "paged_kv_last_page_len"
    )
    assert num_pages(batch.seq_lens, batch.page_size) == int(ref_indptr[-1])

    fused = paged_kv_layout(batch.seq_lens, batch.block_table, batch.page_size)
    assert_matches_device(fused.paged_kv_indptr, ref_indptr, "fused indptr")
    assert_matches_device(fused.paged_kv_indices, ref_indices, "fused indices")
    assert_matches_device(fused.paged_kv_last_page_len, ref_last, "fused last_page_len")


@given(batch=paged_batches(min_reqs=1), data=st.data())
def test_rebase_matches_device_slice(device: torch.device, batch: PagedBatch, data: st.DataObject) -> None:
    indptr = paged_kv_indptr(batch.seq_lens, batch.page_size)
    n = batch.seq_lens.shape[0]
    start = data.draw(st.integers(0, n), label="start")
    stop = data.draw(st.integers(start, n), label="stop")
    d = _dev(indptr, device)
    assert_matches_device(rebase_indptr(indptr, start, stop), d[start : stop + 1] - d[start], "rebased")


# ------------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------------

BT = np.array([[1, 2, 3], [4, 5, 6]], I32)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: paged_kv_indptr(np.array([3, -1], I32), 4), r"seq_lens\[1\]=-1 is negative"),
        (lambda: paged_kv_last_page_len(np.array([-2], I32), 4), r"seq_lens\[0\]=-2 is negative"),
        (lambda: num_pages(np.array([1], I32), 0), r"page_size: must be a positive int"),
        (lambda: num_pages(np.array([1], I32), True), r"page_size: must be a positive int"),
        (lambda: num_pages(np.array([2**31 - 1] * 3, I32), 1), r"exceeds int32"),
        (lambda: paged_kv_layout(np.array([4, 13], I32), BT, 4), r"row 1 needs cdiv\(seq_lens\[1\]=13"),
        (
            lambda: paged_kv_layout(np.array([4, 4, 4], I32), BT, 4),
            r"has 2 rows, need one per request \(3\)",
        ),
        (
            lambda: paged_kv_layout(np.array([4, 5], I32), np.array([[1, 2], [3, -1]], I32), 4),
            r"block_table\[1, 1\]=-1 is negative",
        ),
        (
            lambda: paged_kv_layout(np.array([4, 5], I32), BT, 4, indices_out=np.empty(2, I32)),
            r"paged_kv_indices: out= must have shape \(3,\)",
        ),
        (
            lambda: paged_kv_layout(np.array([4, 5], I32), BT, 4, indices_out=np.empty(5, I32)),
            r"paged_kv_indices: out= must have shape \(3,\)",
        ),
        (
            lambda: paged_kv_layout(np.array([4], I32), BT, 4, indices_out=np.empty(1, np.int64)),
            r"must have dtype int32",
        ),
        (lambda: paged_kv_indptr(np.array([4], I32), 4, out=np.empty(3, I32)), r"must have shape \(2,\)"),
        (lambda: paged_kv_indices(BT, np.array([1, 2], I32)), r"paged_kv_indptr\[0\]=1"),
        (
            lambda: paged_kv_indices(BT, np.array([0, 3, 2], I32)),
            r"paged_kv_indptr\[1\]=3 > paged_kv_indptr\[-1\]=2",
        ),
        (lambda: paged_kv_indices(BT, np.array([0, 2, 1, 3], I32)), r"has 2 rows"),
        (lambda: paged_kv_indices(BT, np.array([0, 1, 5], I32)),
         r"request 1 spans 4 pages \(paged_kv_indptr\[2\] - paged_kv_indptr\[1\]\) but the table has 3 columns"),
        (lambda: paged_kv_indices(BT, np.array([0, -1], I32)), r"paged_kv_indptr\[-1\]=-1 is negative"),
        (lambda: paged_kv_indices(BT, np.zeros(0, I32)), r"must have num_reqs \+ 1 >= 1"),
        (lambda: rebase_indptr(np.array([0, 1], I32), 1, 2), r"need 0 <= start <= stop <= num_reqs=1"),
        (lambda: paged_kv_indptr(np.array([[1]], I32), 4), r"seq_lens: expected 1-D"),
    ],
)
def test_bad_inputs_raise_value_error(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_device_tensors_are_rejected() -> None:
    with pytest.raises(TypeError, match="host data only"):
        paged_kv_indptr(torch.tensor([1, 2], dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="host data only"):
        paged_kv_layout(np.array([1], I32), torch.zeros((1, 1), dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="out= must be a numpy array"):
        paged_kv_layout(np.array([1], I32), BT, 4, indices_out=[0])  # type: ignore[arg-type]
