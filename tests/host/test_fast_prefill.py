"""KV-sharing fast prefill on the host (docs/semantics-attention.md, "FastPrefillMetadata (KV-sharing fast prefill)") against the device reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attnmeta.host.fast_prefill import fast_prefill_query_start_loc, max_logits_per_req, pad_logits_indices
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import (
    ref_fast_prefill_query_start_loc,
    ref_max_logits_per_req,
    ref_pad_logits_indices,
)
from attnmeta.testing.strategies import FastPrefillBatch, fast_prefill_batches, logits_indices_for

I32 = np.int32


def _dev(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(arr)).to(device)


# ------------------------------------------------------------------------------------------------
# structure: the worked example and edge cases
# ------------------------------------------------------------------------------------------------


def test_worked_example_5_5() -> None:
    # s = [41, 31, 40], q = [15, 5, 8]; logits_indices_padded = [14, 18, 19, 27, 99], L = 4.
    qsl = np.array([0, 15, 20, 28], I32)
    padded = np.array([14, 18, 19, 27, 99], I32)
    num_logits = 4
    dqsl = fast_prefill_query_start_loc(qsl, padded[:num_logits])
    assert_host_equal(dqsl, np.array([0, 1, 3, 4], I32), "fast query_start_loc")
    assert int(dqsl[-1]) == num_logits  # num_actual_tokens
    assert max_logits_per_req(dqsl) == 2  # max_query_len


def test_padding_rows_and_empty_rows_get_no_logits() -> None:
    # Row 1 is empty (q = 0) in the middle; rows 3, 4 are trailing padding rows repeating qsl[-1].
    qsl = np.array([0, 3, 3, 5, 5, 5], I32)
    dqsl = fast_prefill_query_start_loc(qsl, np.array([2, 3, 4], I32))
    assert_host_equal(dqsl, np.array([0, 1, 1, 3, 3, 3], I32))
    assert max_logits_per_req(dqsl) == 2


def test_no_logits_and_no_rows() -> None:
    assert_host_equal(
        fast_prefill_query_start_loc(np.array([0, 4, 9], I32), np.zeros(0, I32)), np.zeros(3, I32)
    )
    assert_host_equal(fast_prefill_query_start_loc(np.array([0], I32), np.zeros(0, I32)), np.zeros(1, I32))
    assert max_logits_per_req(np.array([0], I32)) == 0


def test_int64_logits_and_out_buffer() -> None:
    out = np.empty(4, I32)
    res = fast_prefill_query_start_loc(
        np.array([0, 15, 20, 28], I32), np.array([14, 19, 27], np.int64), out=out
    )
    assert res is out
    assert_host_equal(out, np.array([0, 1, 2, 3], I32))


def test_pad_logits_indices_runner_tail() -> None:
    assert_host_equal(
        pad_logits_indices(np.array([14, 18, 19, 27], I32), 8),
        np.array([14, 18, 19, 27, 27, 27, 27, 27], I32),
    )
    assert_host_equal(pad_logits_indices(np.array([5], I32), 1), np.array([5], I32))


# ------------------------------------------------------------------------------------------------
# numerics: host vs device reference, bit for bit
# ------------------------------------------------------------------------------------------------


@given(batch=fast_prefill_batches())
@example(
    batch=FastPrefillBatch(
        np.array([0, 15, 20, 28], I32), np.array([41, 31, 40], I32), np.array([14, 18, 19, 27], I32)
    )
)
@example(batch=FastPrefillBatch(np.array([0, 1, 2, 2], I32), np.array([5, 1, 0], I32), np.array([0, 1], I32)))
def test_fast_prefill_matches_reference(device: torch.device, batch: FastPrefillBatch) -> None:
    qsl_dev = _dev(batch.query_start_loc_cpu, device)
    li_dev = _dev(batch.logits_indices, device)
    ref = ref_fast_prefill_query_start_loc(qsl_dev, li_dev)
    host = fast_prefill_query_start_loc(batch.query_start_loc_cpu, batch.logits_indices)
    assert_matches_device(host, ref, "fast_prefill_query_start_loc")
    assert max_logits_per_req(host) == ref_max_logits_per_req(ref)


@given(batch=fast_prefill_batches(max_per_req=1))
def test_one_logit_per_request_is_a_decode_batch(batch: FastPrefillBatch) -> None:
    # Without spec decode every real row has exactly one logit (its last token), padding rows none.
    dqsl = fast_prefill_query_start_loc(batch.query_start_loc_cpu, batch.logits_indices)
    q = np.diff(batch.query_start_loc_cpu)
    assert_host_equal(np.diff(dqsl), (q > 0).astype(I32))
    assert max_logits_per_req(dqsl) == int((q > 0).any())


@given(batch=fast_prefill_batches(), extra=st.integers(0, 9))
def test_pad_logits_matches_reference(device: torch.device, batch: FastPrefillBatch, extra: int) -> None:
    num_logits = batch.logits_indices.shape[0]
    padded = pad_logits_indices(batch.logits_indices, num_logits + extra)
    assert_matches_device(
        padded, ref_pad_logits_indices(_dev(batch.logits_indices, device), num_logits + extra)
    )


@given(
    qsl=st.lists(st.integers(0, 12), max_size=6).map(
        lambda q: np.concatenate([[0], np.cumsum(q)]).astype(I32)
    ),
    data=st.data(),
)
def test_logits_strategy_gives_each_requests_last_tokens(qsl: np.ndarray, data: st.DataObject) -> None:
    li = data.draw(logits_indices_for(qsl, max_per_req=3))
    dqsl = fast_prefill_query_start_loc(qsl, li)
    for i in range(qsl.shape[0] - 1):
        mine = li[dqsl[i] : dqsl[i + 1]].tolist()
        end = int(qsl[i + 1])
        assert mine == list(range(end - len(mine), end))
        assert (len(mine) >= 1) == (end > int(qsl[i])) and len(mine) <= 3


# ------------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------------

QSL = np.array([0, 15, 20, 28], I32)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: fast_prefill_query_start_loc(QSL, np.array([14, 28], I32)),
            r"logits_indices\[1\]=28 is outside \[0, query_start_loc_cpu\[-1\]=28\)",
        ),
        (
            lambda: fast_prefill_query_start_loc(QSL, np.array([-1], I32)),
            r"logits_indices\[0\]=-1 is outside",
        ),
        (
            lambda: fast_prefill_query_start_loc(QSL, np.array([19, 14], I32)),
            r"logits_indices\[1\]=14 < logits_indices\[0\]=19",
        ),
        (
            lambda: fast_prefill_query_start_loc(np.array([1, 15], I32), np.array([2], I32)),
            r"query_start_loc_cpu\[0\]=1",
        ),
        (
            lambda: fast_prefill_query_start_loc(np.array([0, 15, 9], I32), np.array([2], I32)),
            r"query_start_loc_cpu\[2\]=9 < query_start_loc_cpu\[1\]=15 \(request 1\); query start locations must be non-decreasing",
        ),
        (
            lambda: fast_prefill_query_start_loc(np.zeros(0, I32), np.zeros(0, I32)),
            r"must have num_reqs \+ 1 >= 1",
        ),
        (lambda: fast_prefill_query_start_loc(QSL, np.array([2**40], np.int64)), r"does not fit int32"),
        (
            lambda: fast_prefill_query_start_loc(QSL, np.array([1], I32), out=np.empty(3, I32)),
            r"must have shape \(4,\)",
        ),
        (
            lambda: max_logits_per_req(np.array([0, 2, 1], I32)),
            r"fast_query_start_loc\[2\]=1 < fast_query_start_loc\[1\]=2",
        ),
        (lambda: max_logits_per_req(np.zeros(0, I32)), r"must have num_reqs \+ 1 >= 1"),
        (lambda: pad_logits_indices(np.zeros(0, I32), 4), r"logits_indices: is empty"),
        (lambda: pad_logits_indices(np.array([1, 2], I32), 1), r"num_padded=1 < num_logits=2 \(len\(logits_indices\)\)"),
        (
            lambda: fast_prefill_query_start_loc(QSL, np.array([14, 18, 18, 27], I32)),
            r"logits_indices\[2\]=18 == logits_indices\[1\]=18; logits indices must be strictly increasing",
        ),
        (
            lambda: pad_logits_indices(np.array([1, 2], I32), 3, out=np.empty(3, np.int64)),
            r"must have dtype int32",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_a_padded_count_that_is_not_an_int_is_a_type_error() -> None:
    for bad in (2.0, "3", True, [3]):
        with pytest.raises(TypeError, match="num_padded: expected an int, got"):
            pad_logits_indices(np.array([1, 2], I32), bad)  # type: ignore[arg-type]


def test_device_tensors_are_rejected() -> None:
    with pytest.raises(TypeError, match="host data only"):
        fast_prefill_query_start_loc(QSL, torch.tensor([14, 18]))
    with pytest.raises(TypeError, match="expected an integer array"):
        fast_prefill_query_start_loc(QSL, np.array([1.0]))
