"""Chunked local attention virtual batches on the host (docs/semantics-attention.md, "LocalAttentionMetadata (chunked local attention)") against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given

from attnmeta.host.local_attn import LocalBatches, local_virtual_batches, num_virtual_reqs
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import ref_local_virtual_batches
from attnmeta.testing.strategies import LocalAttentionBatch, local_attention_batches

I32 = np.int32


def _dev(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(arr)).to(device)


# The worked example: q = [4, 10, 5], s = [6, 17, 9], A = 4, bs = 2, block rows [10i .. 10i+9].
QSL = np.array([0, 4, 14, 19], I32)
SEQ = np.array([6, 17, 9], I32)
BT = np.arange(30, dtype=I32).reshape(3, 10)


# ------------------------------------------------------------------------------------------------
# structure: the worked examples
# ------------------------------------------------------------------------------------------------


def test_worked_example_5_6() -> None:
    lb = local_virtual_batches(QSL, SEQ, 4, 2, BT)
    # The corrected cu_q_local (the upstream comment's [0,4,6,10,14,18,19,23,24] is wrong).
    assert_host_equal(lb.query_start_loc, np.array([0, 2, 4, 5, 9, 13, 14, 18, 19], I32), "cu_q_local")
    assert_host_equal(lb.seq_lens, np.array([4, 2, 4, 4, 4, 1, 4, 1], I32), "k_local")
    assert lb.seq_lens_upper_bound is lb.seq_lens
    # kstart = [0, 4, 4, 8, 12, 16, 4, 8] -> first columns kstart // 2.
    assert_host_equal(lb.block_starts, np.array([0, 2, 2, 4, 6, 8, 2, 4], I32), "block_starts")
    assert_host_equal(lb.req_indices, np.array([0, 0, 1, 1, 1, 1, 2, 2], I32), "req_indices")
    expected_rows = [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]
    assert lb.block_table is not None
    assert_host_equal(lb.block_table, np.array(expected_rows, I32), "block rows")
    assert (lb.num_virtual_reqs, lb.max_query_len, lb.max_seq_len, lb.pages_per_local_block) == (8, 4, 4, 2)
    assert num_virtual_reqs(QSL, SEQ, 4) == 8


def test_single_query_at_chunk_start_sees_one_token() -> None:
    # vllm issue #21694: q = [1], s = [5], A = 4 -> k = [1] (token 4 starts a new chunk).
    lb = local_virtual_batches(np.array([0, 1], I32), np.array([5], I32), 4, 4)
    assert_host_equal(lb.seq_lens, np.array([1], I32))
    assert_host_equal(lb.query_start_loc, np.array([0, 1], I32))
    assert lb.block_table is None
    assert_host_equal(lb.block_starts, np.array([1], I32))


def test_padding_row_reads_column_zero_not_a_wrapped_column() -> None:
    # A padding row (q = 0, s = 0): one virtual row, q = 0, k = A as in vLLM, and a defined block row.
    qsl = np.array([0, 4, 14, 19, 19], I32)
    seq = np.array([6, 17, 9, 0], I32)
    bt = np.vstack([BT, np.arange(100, 110, dtype=I32)[None, :]])
    lb = local_virtual_batches(qsl, seq, 4, 2, bt)
    assert lb.num_virtual_reqs == 9
    assert int(lb.query_start_loc[-1] - lb.query_start_loc[-2]) == 0
    assert int(lb.seq_lens[-1]) == 4 and int(lb.req_indices[-1]) == 3 and int(lb.block_starts[-1]) == 0
    assert lb.block_table is not None
    assert lb.block_table[-1].tolist() == [100, 101]  # vLLM would read the wrapped columns [108, 109]
    # Every other row is exactly vLLM's.
    vllm = ref_local_virtual_batches(
        _dev(qsl, torch.device("cpu")),
        _dev(seq, torch.device("cpu")),
        4,
        2,
        _dev(bt, torch.device("cpu")),
        clamp_negative_start=False,
    )
    assert vllm.block_table is not None
    assert vllm.block_table[-1].tolist() == [108, 109]
    assert_matches_device(lb.block_table[:-1], vllm.block_table[:-1], "real rows")


def test_empty_batch() -> None:
    lb = local_virtual_batches(np.array([0], I32), np.zeros(0, I32), 8, 4, np.zeros((0, 3), I32))
    assert lb.num_virtual_reqs == 0 and lb.max_query_len == 0 and lb.max_seq_len == 0
    assert_host_equal(lb.query_start_loc, np.array([0], I32))
    assert lb.block_table is not None and lb.block_table.shape == (0, 2)


def test_out_buffers_sized_first() -> None:
    v = num_virtual_reqs(QSL, SEQ, 4)
    staging = np.full(4 * v + 1 + 2 * v, -1, I32)
    bufs = {
        "query_start_loc_out": staging[: v + 1],
        "seq_lens_out": staging[v + 1 : 2 * v + 1],
        "req_indices_out": staging[2 * v + 1 : 3 * v + 1],
        "block_starts_out": staging[3 * v + 1 : 4 * v + 1],
        "block_table_out": staging[4 * v + 1 :].reshape(v, 2),
    }
    lb = local_virtual_batches(QSL, SEQ, 4, 2, BT, **bufs)
    assert lb.query_start_loc is bufs["query_start_loc_out"] and lb.block_table is bufs["block_table_out"]
    ref = local_virtual_batches(QSL, SEQ, 4, 2, BT)
    for name in ("query_start_loc", "seq_lens", "req_indices", "block_starts", "block_table"):
        assert_host_equal(getattr(lb, name), getattr(ref, name), name)


# ------------------------------------------------------------------------------------------------
# numerics: host vs device reference, bit for bit
# ------------------------------------------------------------------------------------------------


def _check(lb: LocalBatches, ref: object) -> None:
    for name in ("query_start_loc", "seq_lens", "req_indices", "block_starts", "block_table"):
        assert_matches_device(getattr(lb, name), getattr(ref, name), name)
    for name in ("max_query_len", "max_seq_len", "num_virtual_reqs"):
        assert getattr(lb, name) == getattr(ref, name), name


@given(batch=local_attention_batches())
@example(batch=LocalAttentionBatch(np.array([0, 4, 14, 19], I32), SEQ, 4, 2, BT))
@example(
    batch=LocalAttentionBatch(np.array([0, 1, 1], I32), np.array([5, 0], I32), 4, 4, np.zeros((2, 2), I32))
)
@example(batch=LocalAttentionBatch(np.array([0, 8], I32), np.array([16], I32), 8, 8, np.array([[3, 4]], I32)))
def test_local_batches_match_reference(device: torch.device, batch: LocalAttentionBatch) -> None:
    qsl, s, bt = (_dev(a, device) for a in (batch.query_start_loc_cpu, batch.seq_lens, batch.block_table))
    ref = ref_local_virtual_batches(qsl, s, batch.attn_chunk_size, batch.block_size, bt)
    lb = local_virtual_batches(
        batch.query_start_loc_cpu, batch.seq_lens, batch.attn_chunk_size, batch.block_size, batch.block_table
    )
    _check(lb, ref)
    assert (
        num_virtual_reqs(batch.query_start_loc_cpu, batch.seq_lens, batch.attn_chunk_size)
        == lb.num_virtual_reqs
    )
    # Semantics: the virtual rows tile every request's queries.
    assert int(lb.query_start_loc[-1]) == int(batch.query_start_loc_cpu[-1])
    if batch.block_table.shape[1] < lb.pages_per_local_block and (batch.seq_lens == 0).any():
        return  # vLLM's wrapped column -A/bs is out of bounds here (an IndexError / device assert)
    # vLLM exactly (negative columns wrap) on every row with s > 0; only padding rows differ.
    vllm = ref_local_virtual_batches(
        qsl, s, batch.attn_chunk_size, batch.block_size, bt, clamp_negative_start=False
    )
    real = batch.seq_lens[lb.req_indices] > 0
    assert lb.block_table is not None and vllm.block_table is not None
    assert_matches_device(
        lb.block_table[real], vllm.block_table[torch.from_numpy(real).to(device)], "vLLM rows"
    )
    for name in ("query_start_loc", "seq_lens", "req_indices"):
        assert_matches_device(getattr(lb, name), getattr(vllm, name), name)


@given(batch=local_attention_batches())
def test_without_block_table(device: torch.device, batch: LocalAttentionBatch) -> None:
    qsl, s = _dev(batch.query_start_loc_cpu, device), _dev(batch.seq_lens, device)
    ref = ref_local_virtual_batches(qsl, s, batch.attn_chunk_size, batch.block_size)
    lb = local_virtual_batches(
        batch.query_start_loc_cpu, batch.seq_lens, batch.attn_chunk_size, batch.block_size
    )
    _check(lb, ref)


# ------------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: local_virtual_batches(QSL, SEQ, 6, 4),
            r"attn_chunk_size=6 is not a multiple of block_size=4",
        ),
        (lambda: local_virtual_batches(QSL, SEQ, 0, 4), r"attn_chunk_size: must be a positive int"),
        (lambda: local_virtual_batches(QSL, SEQ, 4, 0), r"block_size: must be a positive int"),
        (lambda: num_virtual_reqs(QSL, SEQ[:2], 4), r"seq_lens: expected length 3"),
        (lambda: num_virtual_reqs(QSL, np.array([6, 17, 4], I32), 4), r"seq_lens\[2\]=4 < query_lens\[2\]=5"),
        (lambda: num_virtual_reqs(QSL, np.array([6, -1, 9], I32), 4), r"seq_lens\[1\]=-1 is negative"),
        (
            lambda: num_virtual_reqs(np.array([1, 4], I32), np.array([6], I32), 4),
            r"query_start_loc_cpu\[0\]=1",
        ),
        (
            lambda: num_virtual_reqs(np.array([0, 4, 2], I32), np.array([6, 6], I32), 4),
            r"query_start_loc_cpu\[2\]=2 < query_start_loc_cpu\[1\]=4",
        ),
        (
            lambda: local_virtual_batches(QSL, SEQ, 4, 2, BT[:2]),
            r"has 2 rows, need one per request \(3\)",
        ),
        (
            lambda: local_virtual_batches(
                np.array([0, 0], I32), np.array([0], I32), 4, 2, np.zeros((1, 0), I32)
            ),
            r"has no columns",
        ),
        (
            lambda: local_virtual_batches(QSL, SEQ, 4, 2, BT[:, :8]),
            r"row 1 needs cdiv\(seq_lens\[1\]=17, block_size=2\)=9",
        ),
        (
            lambda: local_virtual_batches(QSL, SEQ, 4, 2, block_table_out=np.empty((8, 2), I32)),
            r"block_table_out: given without block_table",
        ),
        (
            lambda: local_virtual_batches(QSL, SEQ, 4, 2, query_start_loc_out=np.empty(8, I32)),
            r"sized for num_virtual_reqs=7 but this batch has 8",
        ),
        (
            lambda: local_virtual_batches(
                QSL, SEQ, 4, 2, query_start_loc_out=np.empty(9, I32), seq_lens_out=np.empty(7, I32)
            ),
            r"seq_lens: out= must have shape \(8,\)",
        ),
        (
            lambda: local_virtual_batches(QSL, SEQ, 4, 2, query_start_loc_out=np.empty((9, 1), I32)),
            r"query_start_loc_out: must be 1-D",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_device_tensors_are_rejected() -> None:
    with pytest.raises(TypeError, match="host data only"):
        local_virtual_batches(QSL, torch.from_numpy(SEQ), 4, 2)
