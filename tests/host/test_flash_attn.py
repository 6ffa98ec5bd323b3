"""FlashAttention host helpers (docs/semantics.md, "Context parallelism"; docs/semantics-attention.md, "FlashAttentionMetadata"): DCP context lengths and causal flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta.host.flash_attn import causal_per_request, dcp_context_kv_lens, max_dcp_context_kv_len
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import ref_dcp_context_kv_lens

I32 = np.int32


@st.composite
def dcp_batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int, int, int]:
    """(seq_lens, query_lens, world, rank, interleave, num_decodes), with trailing padding rows."""
    rows = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 300)), max_size=10))
    pad = len(draw(st.lists(st.just(0), max_size=2)))
    q = np.array([r[0] for r in rows] + [0] * pad, I32)
    s = np.array([r[0] + r[1] for r in rows] + [0] * pad, I32)
    world = draw(st.sampled_from([1, 2, 3, 4, 8]))
    rank = draw(st.integers(0, world - 1))
    interleave = draw(st.sampled_from([1, 2, 16]))
    num_decodes = draw(st.integers(0, len(rows) + pad))
    return s, q, world, rank, interleave, num_decodes


def test_worked_values() -> None:
    s, q = np.array([10, 17, 5, 0], I32), np.array([1, 4, 5, 0], I32)
    assert_host_equal(dcp_context_kv_lens(s, q, 2, 0), np.array([5, 7, 0, 0], I32))
    assert_host_equal(dcp_context_kv_lens(s, q, 2, 1), np.array([4, 6, 0, 0], I32))
    # interleave 2 over 2 ranks: context 13 = 6 full rounds of 2 (3 per rank) + 1 token on rank 0.
    assert_host_equal(dcp_context_kv_lens(s, q, 2, 0, 2), np.array([5, 7, 0, 0], I32))
    assert_host_equal(dcp_context_kv_lens(s, q, 2, 1, 2, num_decodes=1), np.array([4, 6, 0, 0], I32))
    assert max_dcp_context_kv_len(17, 2) == 9
    assert max_dcp_context_kv_len(17, 2, 4) == 12
    assert max_dcp_context_kv_len(0, 4, 16) == 0


@given(batch=dcp_batches())
def test_dcp_context_matches_reference(
    device: torch.device, batch: tuple[np.ndarray, np.ndarray, int, int, int, int]
) -> None:
    s, q, world, rank, interleave, nd = batch
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q)]).astype(I32)).to(device)
    ref = ref_dcp_context_kv_lens(
        qsl, torch.from_numpy(s).to(device), world, rank, interleave, num_decodes=nd
    )
    host = dcp_context_kv_lens(s, q, world, rank, interleave, num_decodes=nd)
    assert_matches_device(host, ref, "dcp_context_kv_lens")
    # Every rank's share is within the host upper bound, and the shares add up to the whole.
    bound = max_dcp_context_kv_len(int(s.max()) if s.size else 0, world, interleave)
    shares = [dcp_context_kv_lens(s, q, world, r, interleave, num_decodes=nd) for r in range(world)]
    assert all(int(x.max()) <= bound for x in shares if x.size)
    whole = s.astype(np.int64) - np.where(np.arange(s.shape[0]) >= nd, q, 0)
    assert_host_equal(np.sum(shares, axis=0, dtype=np.int64), whole)


def test_causal_per_request() -> None:
    assert_host_equal(causal_per_request(True, 3), np.array([1, 1, 1], I32))
    assert_host_equal(causal_per_request(False, 2), np.array([0, 0], I32))
    assert_host_equal(causal_per_request(np.array([True, False])), np.array([1, 0], I32))
    assert_host_equal(causal_per_request(np.array([0, 1, 1], np.int64), 3), np.array([0, 1, 1], I32))
    out = np.empty(2, I32)
    assert causal_per_request(np.array([1, 0]), out=out) is out


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: dcp_context_kv_lens([3], [4], 2, 0), r"query_lens\[0\]=4 > seq_lens\[0\]=3"),
        (lambda: dcp_context_kv_lens([-3], [0], 2, 0), r"seq_lens\[0\]=-3 is negative"),
        (lambda: dcp_context_kv_lens([3], [-1], 2, 0), r"query_lens\[0\]=-1 is negative"),
        (lambda: dcp_context_kv_lens([3], [1, 1], 2, 0), r"query_lens: expected length 1"),
        (lambda: dcp_context_kv_lens([3], [1], 2, 2), r"dcp_rank: 2 >= dcp_world_size=2"),
        (lambda: dcp_context_kv_lens([3], [1], 0, 0), r"dcp_world_size: must be an int >= 1"),
        (lambda: dcp_context_kv_lens([3], [1], 2, 0, 0), r"interleave: must be an int >= 1"),
        (lambda: dcp_context_kv_lens([3], [1], 2, 0, num_decodes=2), r"num_decodes: 2 > num_reqs=1"),
        (lambda: max_dcp_context_kv_len(-1, 2), r"max_seq_len: must be an int >= 0"),
        (lambda: causal_per_request(True), r"num_reqs: required"),
        (lambda: causal_per_request(np.array([0, 2])), r"causal\[1\]=2; integer causal flags must be 0 or 1"),
        (lambda: causal_per_request(np.array([True]), 2), r"causal: has 1 entries, num_reqs=2"),
    ],
)
def test_bad_inputs_raise_value_error(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_device_tensors_are_rejected() -> None:
    with pytest.raises(TypeError, match="host data only"):
        causal_per_request(torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="host data only"):
        dcp_context_kv_lens(torch.ones(3, dtype=torch.int32), [0, 0, 0], 2, 0)
