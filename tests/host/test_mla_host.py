"""MLA host derivations: vLLM 0.33.0's worked examples (15.10 a, c, e), the planner checklist, and the
planner against its device reference on generated prefill parts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attnmeta.host.mla import (
    dcp_local_context_lens,
    flattened_row_requests,
    plan_context_chunks,
    triton_num_kv_splits,
    workspace_size,
)
from attnmeta.testing.reference.mla import ref_mla_context_chunks, ref_mla_row_requests


def test_example_a_no_dcp() -> None:
    ch = plan_context_chunks([0, 100, 300, 40], [0, 5, 12, 20, 23], workspace_size=256, block_size=16)
    assert ch is not None and ch.num_chunks == 2
    assert ch.empty_token_slices.tolist() == [[0, 5]]
    assert ch.context_lens.tolist() == [0, 100, 300, 40]
    # chunk 0: rows 1:3, tokens 5:20, row 2 split at 144
    assert (ch.request_start[0], ch.request_end[0], ch.token_start[0], ch.token_end[0]) == (1, 3, 5, 20)
    assert not ch.is_continuation[0] and ch.continuation_token_end[0] == 12
    assert ch.starts[:2].tolist() == [0, 0] and ch.seq_lens[:2].tolist() == [100, 144]
    assert ch.cu_seq_lens[:3].tolist() == [0, 100, 244] and ch.cu_seqlens_q[:3].tolist() == [0, 7, 15]
    assert (ch.max_query_len[0], ch.max_seq_len[0], ch.num_context_tokens[0]) == (8, 144, 244)
    assert ch.token_to_seq[:244].tolist() == [0] * 100 + [1] * 144
    # chunk 1: the continuation
    assert (ch.request_start[1], ch.request_end[1], ch.token_start[1], ch.token_end[1]) == (2, 4, 12, 23)
    assert ch.is_continuation[1] and ch.continuation_token_end[1] == 20
    assert ch.starts[2:].tolist() == [144, 0] and ch.seq_lens[2:].tolist() == [156, 40]
    assert ch.cu_seq_lens[3:].tolist() == [0, 156, 196] and ch.cu_seqlens_q[3:].tolist() == [0, 8, 11]
    assert ch.num_context_tokens[1] == 196 and ch.cu_offset.tolist() == [0, 3]


def test_example_a_align_indptr() -> None:
    plain = plan_context_chunks([0, 100, 300, 40], [0, 5, 12, 20, 23], workspace_size=256, block_size=16)
    ch = plan_context_chunks([0, 100, 300, 40], [0, 5, 12, 20, 23], workspace_size=256, block_size=16,
                             align_indptr=True)
    assert plain is not None and ch is not None
    assert ch.cu_offset.tolist() == [0, 4]  # one zero of padding
    assert ch.cu_seq_lens.tolist() == [0, 100, 244, 0, 0, 156, 196]
    assert ch.seq_lens.tolist() == plain.seq_lens.tolist() and ch.starts.tolist() == plain.starts.tolist()


def test_example_c_dcp() -> None:
    ch = plan_context_chunks([70, 0, 45], [0, 3, 7, 9], workspace_size=128, block_size=16, dcp_world_size=2)
    assert ch is not None and ch.num_chunks == 2  # the zero-context row splits them
    assert ch.starts.tolist() == [0, 0] and ch.seq_lens.tolist() == [70, 45]
    assert ch.local_context_lens_allranks is not None and ch.padded_local_seq_lens is not None
    assert ch.local_context_lens_allranks[0].tolist() == [35, 35]
    assert ch.local_context_lens_allranks[2].tolist() == [23, 22]
    assert ch.padded_local_seq_lens.tolist() == [35, 23]
    assert ch.padded_local_cu_seq_lens is not None and ch.padded_local_cu_seq_lens[:2].tolist() == [0, 35]
    assert ch.num_local_context_tokens.tolist() == [35, 23]
    assert ch.cu_offset.tolist() == [0, 2]


def test_example_e_dcp_local_starts() -> None:
    ch = plan_context_chunks([1000, 0], [0, 200, 207], workspace_size=512, block_size=16, dcp_world_size=2)
    assert ch is not None and ch.num_chunks == 2
    assert ch.seq_lens.tolist() == [512, 488]
    assert ch.starts.tolist() == [0, 256]  # local starts
    assert ch.num_local_context_tokens.tolist() == [256, 244]
    assert ch.local_context_lens_allranks is not None
    assert ch.local_context_lens_allranks[0].tolist() == [500, 500]
    assert ch.empty_token_slices.tolist() == [[200, 207]]


def test_example_b_prefill_chunks() -> None:
    ch = plan_context_chunks([1000, 0], [0, 200, 207], workspace_size=512, block_size=64)
    assert ch is not None and ch.starts.tolist() == [0, 512] and ch.seq_lens.tolist() == [512, 488]
    assert ch.is_continuation.tolist() == [False, True]


def test_example_f_padding_rows() -> None:
    ch = plan_context_chunks([30, 0, 0], [0, 50, 50, 50], workspace_size=512, block_size=16)
    assert ch is not None and ch.num_chunks == 1 and ch.seq_lens.tolist() == [30]
    assert ch.empty_token_slices.tolist() == [[50, 50], [50, 50]]


def test_no_context_is_none() -> None:
    assert plan_context_chunks([0, 0], [0, 3, 5], workspace_size=64, block_size=16) is None
    assert plan_context_chunks([], [0], workspace_size=64, block_size=16) is None


def test_workspace_sizes() -> None:
    assert workspace_size(4096, 256, 64) == 65536
    assert workspace_size(163840, 256, 64) == 65536
    assert workspace_size(2048, 8, 16) == 16384
    assert workspace_size(4096, 256, 64, 3, 1) == 65664
    assert workspace_size(1000, 2, 16, 4, 8) == 8000
    with pytest.raises(ValueError, match="block_size"):
        workspace_size(1000, 2, 0)


def test_triton_splits_and_row_requests() -> None:
    assert [triton_num_kv_splits(s, 132) for s in (1, 511, 512, 4000, 200000)] == [1, 1, 1, 8, 264]
    assert flattened_row_requests([0, 3, 6, 6], 7).tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert dcp_local_context_lens([70, 45], 2).tolist() == [[35, 35], [23, 22]]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        plan_context_chunks([3, -1], [0, 1, 2], workspace_size=64, block_size=16)
    with pytest.raises(ValueError, match="query_start_loc"):
        plan_context_chunks([3, 1], [0, 1], workspace_size=64, block_size=16)
    with pytest.raises(ValueError, match="workspace_size"):
        plan_context_chunks([30], [0, 1], workspace_size=8, block_size=16)
    with pytest.raises(TypeError):
        plan_context_chunks(torch.tensor([3]), [0, 1], workspace_size=64, block_size=16)


@st.composite
def _prefill_parts(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int, int, bool, bool]:
    rows = draw(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 20)), min_size=1, max_size=8))
    ctx = [c if draw(st.booleans()) else 0 for c, _ in rows]
    qsl = [0]
    for _, q in rows:
        qsl.append(qsl[-1] + q)
    block = draw(st.sampled_from([1, 16, 64]))
    W = draw(st.sampled_from([1, 1, 2, 4]))
    inter = draw(st.sampled_from([1, 8])) if W > 1 else 1
    align_unit = math.lcm(block, W * inter)
    ws = draw(st.integers(1, 8)) * align_unit * W
    return ctx, qsl, ws, block, W, inter, draw(st.booleans()), draw(st.booleans())


@given(_prefill_parts())
@example(([70, 0, 45], [0, 3, 7, 9], 128, 16, 2, 1, True, False))
@example(([1000, 0], [0, 200, 207], 512, 16, 4, 8, True, True))
def test_planner_matches_reference(case: tuple[list[int], list[int], int, int, int, int, bool, bool]) -> None:
    ctx, qsl, ws, block, W, inter, to_block, align_indptr = case
    kw = dict(workspace_size=ws, block_size=block, align_chunk_to_block=to_block, dcp_world_size=W,
              dcp_interleave=inter, align_indptr=align_indptr)
    got = plan_context_chunks(ctx, qsl, **kw)  # type: ignore[arg-type]
    ref = ref_mla_context_chunks(torch.tensor(ctx, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                                 **kw)  # type: ignore[arg-type]
    if ref is None:
        assert got is None
        return
    assert got is not None
    for f in ("context_lens", "starts", "seq_lens", "cu_seq_lens", "cu_seqlens_q", "token_to_seq"):
        assert np.array_equal(getattr(got, f), ref[f].numpy()), f
    if W > 1:
        for f in ("padded_local_seq_lens", "padded_local_cu_seq_lens", "padded_local_token_to_seq",
                  "local_context_lens_allranks"):
            assert np.array_equal(getattr(got, f), ref[f].numpy()), f
    assert got.num_chunks == len(ref["chunks"])
    for c, rc in enumerate(ref["chunks"]):
        assert (got.request_start[c], got.request_end[c]) == (rc["request_slice"].start, rc["request_slice"].stop)
        assert (got.token_start[c], got.token_end[c]) == (rc["token_slice"].start, rc["token_slice"].stop)
        assert got.continuation_token_end[c] == rc["continuation_token_end"]
        assert bool(got.is_continuation[c]) == rc["is_continuation"]
        assert bool(got.all_rows_active[c]) == rc["all_rows_active"]
        assert got.num_context_tokens[c] == rc["num_context_tokens"]
        assert got.num_local_context_tokens[c] == rc["num_local_context_tokens"]
        assert (got.max_query_len[c], got.max_seq_len[c]) == (rc["max_query_len"], rc["max_seq_len"])
        assert got.cu_offset[c] == rc["cu_offset"]
    assert [tuple(x) for x in got.empty_token_slices.tolist()] == ref["empty_token_slices"]


@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 3))
def test_row_requests_match_reference(q: list[int], extra: int) -> None:
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    n = int(qsl[-1]) + extra
    ref = ref_mla_row_requests(torch.from_numpy(qsl), n)
    assert flattened_row_requests(qsl, n).tolist() == ref.tolist()
