"""attnmeta.host.conv1d: causal-conv1d program metadata vs vLLM's algorithm (reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta.host.conv1d import causal_conv1d_metadata
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference.mamba import ref_causal_conv1d_metadata


def qsl_of(lens: list[int]) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    out[1:] = np.cumsum(lens)
    return out


query_start_locs = st.lists(st.integers(0, 100), max_size=64).map(qsl_of)


def test_example() -> None:
    m = causal_conv1d_metadata(np.array([0, 10, 10, 13, 29], np.int32))
    assert_host_equal(m.nums, np.array([2, 0, 1, 2], np.int32), "nums")
    assert m.num_programs_total == 5
    assert_host_equal(m.mlist, np.array([0, 0, 2, 3, 3], np.int64), "mlist")
    assert_host_equal(m.offsetlist, np.array([0, 1, 0, 0, 1], np.int32), "offsetlist")
    assert m.max_num_programs == 2048
    assert m.batch_ptr.shape == (2048,) and m.batch_ptr.dtype == np.int32
    assert m.batch_ptr[:6].tolist() == [0, 0, 2, 3, 3, -1] and (m.batch_ptr[5:] == -1).all()
    assert m.token_chunk_offset_ptr[:6].tolist() == [0, 1, 0, 0, 1, -1]
    assert (m.token_chunk_offset_ptr[5:] == -1).all()


def test_large_batch_grows_max_programs() -> None:
    qsl = qsl_of([8] * 1500)
    m = causal_conv1d_metadata(qsl)
    assert m.num_programs_total == 1500 and m.max_num_programs == 3000


def test_empty_batch() -> None:
    m = causal_conv1d_metadata(np.array([0], np.int32))
    assert m.nums.shape == (0,) and m.num_programs_total == 0 and m.mlist.shape == (0,)
    assert (m.batch_ptr == -1).all() and m.max_num_programs == 2048


@given(qsl=query_start_locs, block_m=st.sampled_from([8, 8, 8, 1, 3, 16]), offset=st.integers(0, 50))
def test_matches_reference(device: torch.device, qsl: np.ndarray, block_m: int, offset: int) -> None:
    # only differences matter: a shifted qsl (qsl_cpu[-P-1:] before subtracting Dt) gives the same
    shifted = (qsl + offset).astype(np.int32)
    m = causal_conv1d_metadata(shifted, block_m=block_m)
    ref = ref_causal_conv1d_metadata(torch.from_numpy(qsl), device=device, block_m=block_m)
    assert_matches_device(m.nums, ref["nums"], "nums")
    assert m.num_programs_total == ref["tot"]
    assert_matches_device(m.mlist, ref["mlist"], "mlist")
    assert_matches_device(m.offsetlist, ref["offsetlist"], "offsetlist")
    assert m.max_num_programs == ref["max_num_programs"]
    assert_matches_device(m.batch_ptr, ref["batch_ptr"], "batch_ptr")
    assert_matches_device(m.token_chunk_offset_ptr, ref["token_chunk_offset_ptr"], "token_chunk_offset_ptr")
    # into caller buffers (e.g. a graph-mode staging view of its own capacity)
    cap = m.num_programs_total + 7
    bp, tp = np.zeros(cap, np.int32), np.zeros(cap, np.int32)
    m2 = causal_conv1d_metadata(shifted, block_m=block_m, out=(bp, tp))
    assert m2.batch_ptr is bp and m2.token_chunk_offset_ptr is tp
    assert_host_equal(bp, m.batch_ptr[:cap], "batch_ptr (out)")
    assert_host_equal(tp, m.token_chunk_offset_ptr[:cap], "token_chunk_offset_ptr (out)")


def test_bad_input() -> None:
    with pytest.raises(
        ValueError, match=r"query_start_loc_p\[2\]=3 < query_start_loc_p\[1\]=5 \(prefill row 1\)"
    ):
        causal_conv1d_metadata(np.array([0, 5, 3], np.int32))
    with pytest.raises(ValueError, match="block_m: must be a positive int"):
        causal_conv1d_metadata(np.array([0, 5], np.int32), block_m=0)
    with pytest.raises(ValueError, match="must have num_prefills"):
        causal_conv1d_metadata(np.array([], np.int32))
    with pytest.raises(
        ValueError, match=r"out\.batch_ptr: out= buffer has 1 entries but this batch launches 2"
    ):
        causal_conv1d_metadata(
            np.array([0, 16], np.int32), out=(np.empty(1, np.int32), np.empty(8, np.int32))
        )
    with pytest.raises(ValueError, match="dtype int32"):
        causal_conv1d_metadata(
            np.array([0, 16], np.int32), out=(np.empty(8, np.int64), np.empty(8, np.int32))
        )
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        causal_conv1d_metadata(torch.tensor([0, 16], dtype=torch.int32))  # type: ignore[arg-type]
