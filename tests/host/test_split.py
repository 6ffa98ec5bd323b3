"""attnmeta.host.split (the splits): vLLM's worked examples, bad input, equivalence with the reference."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta.host.layout import is_prefilling, query_start_loc, seq_lens
from attnmeta.host.split import (
    SplitCounts,
    SplitCounts3,
    reorder_decodes_and_prefills,
    split_decodes_and_prefills,
    split_decodes_prefills_and_extends,
)
from attnmeta.spec import BatchSpec
from attnmeta.testing.reference import ref_split_decodes_and_prefills, ref_split_decodes_prefills_and_extends
from attnmeta.testing.strategies import batch_specs, query_start_locs


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread() -> Iterator[None]:
    """The references run on tiny tensors: one intra-op thread avoids thread-pool stalls on a busy CI box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _qsl(query_lens: list[int]) -> np.ndarray:
    return query_start_loc(query_lens)


# docs/semantics.md, "split_decodes_and_prefills", the test_attention_splitting.py table: (query_lens, threshold, uniform,
# num_tokens or None for sum(q)) -> (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens).
_SPLIT_CASES = [
    ([1, 1, 1], 1, False, None, (3, 0, 3, 0)),
    ([1, 2, 1, 3, 2, 1, 2], 3, False, None, (7, 0, 12, 0)),
    ([4, 5, 6, 7], 3, False, None, (0, 4, 0, 22)),
    ([2, 1, 3, 4, 5, 6, 7, 8], 4, False, None, (4, 4, 10, 26)),
    ([2, 2, 1, 3, 2, 1, 2], 3, True, None, (2, 5, 4, 9)),
    ([2, 2, 2, 4, 5, 6, 7, 8], 4, True, None, (3, 5, 6, 30)),
    ([2, 1, 2, 4, 5, 6, 7, 8], 4, True, None, (1, 7, 2, 33)),
    ([2, 2, 2, 0], 3, True, 8, (4, 0, 8, 0)),  # padded uniform batch: T counts the padding
]


@pytest.mark.parametrize(("query_lens", "threshold", "uniform", "num_tokens", "expected"), _SPLIT_CASES)
def test_split_worked_examples(
    query_lens: list[int], threshold: int, uniform: bool, num_tokens: int | None, expected: tuple[int, ...]
) -> None:
    total = sum(query_lens) if num_tokens is None else num_tokens
    got = split_decodes_and_prefills(
        _qsl(query_lens),
        num_tokens=total,
        max_query_len=max(query_lens),
        decode_threshold=threshold,
        require_uniform=uniform,
    )
    assert got == SplitCounts(*expected)
    assert all(type(v) is int for v in got)
    ref = ref_split_decodes_and_prefills(torch.from_numpy(_qsl(query_lens)), total, max(query_lens), threshold, uniform)
    assert tuple(got) == ref


def test_split_quirks() -> None:
    # Zero-length padding rows before the first prefill count as decodes; prefill tokens include padding.
    got = split_decodes_and_prefills(_qsl([1, 0, 5, 0]), num_tokens=9, max_query_len=5)
    assert got == SplitCounts(2, 2, 1, 8)
    # Rows after the first prefill are prefills whatever they look like (the split needs the reorder).
    assert split_decodes_and_prefills(_qsl([1, 4, 1]), num_tokens=6, max_query_len=4) == (1, 2, 1, 5)
    # The shortcut reads max_query_len only; it is an upper bound, never checked against q.
    assert split_decodes_and_prefills(_qsl([1, 4]), num_tokens=5, max_query_len=1) == (2, 0, 5, 0)
    # require_uniform with threshold > 1 skips the shortcut.
    assert split_decodes_and_prefills(
        _qsl([2, 1]), num_tokens=3, max_query_len=2, decode_threshold=2, require_uniform=True
    ) == (1, 1, 2, 1)


def test_split_short_extends_as_prefills() -> None:
    qsl = _qsl([1, 1, 2, 6])
    flags = np.array([False, True, True, False])
    got = split_decodes_and_prefills(
        qsl, num_tokens=10, max_query_len=6, decode_threshold=2, treat_short_extends_as_decodes=False, is_prefilling=flags
    )
    assert got == SplitCounts(1, 3, 1, 9)
    # The shortcut does not apply without treat_short_extends_as_decodes.
    got = split_decodes_and_prefills(
        _qsl([1, 1]), num_tokens=2, max_query_len=1, treat_short_extends_as_decodes=False,
        is_prefilling=np.array([False, True]),
    )
    assert got == SplitCounts(1, 1, 1, 1)
    with pytest.raises(ValueError, match="is_prefilling: required when treat_short_extends_as_decodes=False"):
        split_decodes_and_prefills(qsl, num_tokens=10, max_query_len=6, treat_short_extends_as_decodes=False)
    with pytest.raises(ValueError, match=r"is_prefilling: expected length 4"):
        split_decodes_and_prefills(
            qsl, num_tokens=10, max_query_len=6, treat_short_extends_as_decodes=False, is_prefilling=flags[:3]
        )
    with pytest.raises(TypeError, match="is_prefilling: expected a bool array"):
        split_decodes_and_prefills(
            qsl, num_tokens=10, max_query_len=6, treat_short_extends_as_decodes=False, is_prefilling=[0, 1, 1, 0]
        )


def test_split_empty_batch() -> None:
    # vLLM fails on q[0] when the shortcut does not apply; attnmeta returns (0, 0, num_tokens, 0).
    zero = np.zeros(1, dtype=np.int32)
    assert split_decodes_and_prefills(zero, num_tokens=0, max_query_len=0) == (0, 0, 0, 0)
    assert split_decodes_and_prefills(zero, num_tokens=0, max_query_len=5, require_uniform=True) == (0, 0, 0, 0)
    assert split_decodes_and_prefills(
        zero, num_tokens=0, max_query_len=0, treat_short_extends_as_decodes=False, is_prefilling=np.zeros(0, bool)
    ) == (0, 0, 0, 0)
    assert split_decodes_prefills_and_extends(zero, np.zeros(0, np.int32), num_tokens=0, max_query_len=4,
                                              decode_threshold=1) == (0,) * 6


def test_split3_worked_example() -> None:
    # docs/semantics.md, "split_decodes_prefills_and_extends": q=[1,2,4,5,6], s=[10,11,20,5,6], thr 3 -> (2,1,2,3,4,11).
    got = split_decodes_prefills_and_extends(
        _qsl([1, 2, 4, 5, 6]), [10, 11, 20, 5, 6], num_tokens=18, max_query_len=6, decode_threshold=3
    )
    assert got == SplitCounts3(2, 1, 2, 3, 4, 11)


def test_split3_branches() -> None:
    upper = [5, 9, 12]
    # All decodes via the shortcut, token padding included.
    assert split_decodes_prefills_and_extends(
        _qsl([1, 1, 1]), upper, num_tokens=5, max_query_len=1, decode_threshold=1
    ) == (3, 0, 0, 5, 0, 0)
    # No prefill (every long row has context): the rest are extends.
    assert split_decodes_prefills_and_extends(
        _qsl([1, 4, 3]), upper, num_tokens=8, max_query_len=4, decode_threshold=1
    ) == (1, 2, 0, 1, 7, 0)
    # vLLM's quirk: max_query_len above the threshold but no long row gives all zeros.
    assert split_decodes_prefills_and_extends(
        _qsl([1, 1, 1]), upper, num_tokens=3, max_query_len=2, decode_threshold=1
    ) == (0,) * 6


def test_split_bad_input() -> None:
    with pytest.raises(ValueError, match=r"query_start_loc_cpu\[0\]=1; it must start at 0"):
        split_decodes_and_prefills([1, 2], num_tokens=2, max_query_len=1)
    with pytest.raises(ValueError, match=r"query_start_loc_cpu\[2\]=1 < query_start_loc_cpu\[1\]=3 \(request 1"):
        split_decodes_and_prefills([0, 3, 1], num_tokens=3, max_query_len=3)
    with pytest.raises(ValueError, match=r"query_start_loc_cpu\[2\]=5 > num_tokens=4"):
        split_decodes_and_prefills([0, 3, 5], num_tokens=4, max_query_len=3)
    with pytest.raises(ValueError, match="query_start_loc_cpu: must have num_reqs"):
        split_decodes_and_prefills([], num_tokens=0, max_query_len=0)
    for threshold in (0, -1):  # with 0 no row would be a decode
        with pytest.raises(ValueError, match=f"decode_threshold: must be >= 1, got {threshold}"):
            split_decodes_and_prefills([0, 1], num_tokens=1, max_query_len=1, decode_threshold=threshold)
    with pytest.raises(TypeError, match="num_tokens: expected an int"):
        split_decodes_and_prefills([0, 1], num_tokens=1.0, max_query_len=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch"):
        split_decodes_and_prefills(torch.tensor([0, 1]), num_tokens=1, max_query_len=1)
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound: expected length 2"):
        split_decodes_prefills_and_extends([0, 1, 2], [1], num_tokens=2, max_query_len=1, decode_threshold=1)
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound\[0\]=-1 is negative"):
        split_decodes_prefills_and_extends([0, 1, 2], [-1, 1], num_tokens=2, max_query_len=1, decode_threshold=1)


# --------------------------------------------------------------------------------------------------
# equivalence with the reference transcription
# --------------------------------------------------------------------------------------------------

# Small query lengths around small thresholds reach every branch (uniform batches included).
_QSLS = query_start_locs(query_lens=st.integers(0, 6)) | query_start_locs(query_lens=st.sampled_from([0, 2, 2, 3]))


@given(
    qsl=_QSLS,
    threshold=st.integers(1, 4),
    require_uniform=st.booleans(),
    treat_short=st.booleans(),
    data=st.data(),
)
def test_split_matches_reference(
    qsl: np.ndarray,
    threshold: int,
    require_uniform: bool,
    treat_short: bool,
    data: st.DataObject,
    device: torch.device,
) -> None:
    b = qsl.shape[0] - 1
    q = np.diff(qsl)
    num_tokens = int(qsl[-1]) + data.draw(st.integers(0, 4), label="token padding")
    # max_query_len is an upper bound; a value below the true max reaches the shortcut's quirk too.
    max_q = max(0, (int(q.max()) if b else 0) + data.draw(st.integers(-1, 2), label="max_query_len slack"))
    flags = np.array(data.draw(st.lists(st.booleans(), min_size=b, max_size=b), label="is_prefilling"), dtype=bool)
    got = split_decodes_and_prefills(
        qsl,
        num_tokens=num_tokens,
        max_query_len=max_q,
        decode_threshold=threshold,
        require_uniform=require_uniform,
        treat_short_extends_as_decodes=treat_short,
        is_prefilling=flags,
    )
    qsl_t = torch.from_numpy(qsl).to(device)
    ref = ref_split_decodes_and_prefills(
        qsl_t, num_tokens, max_q, threshold, require_uniform, treat_short, torch.from_numpy(flags).to(device)
    )
    assert tuple(got) == ref
    assert got.num_decodes + got.num_prefills == b
    assert got.num_decode_tokens + got.num_prefill_tokens == num_tokens


@given(qsl=_QSLS, threshold=st.integers(1, 4), data=st.data())
def test_split3_matches_reference(qsl: np.ndarray, threshold: int, data: st.DataObject, device: torch.device) -> None:
    b = qsl.shape[0] - 1
    q = np.diff(qsl)
    context = np.array(data.draw(st.lists(st.sampled_from([0, 0, 1, 5]), min_size=b, max_size=b), label="context"))
    upper = (q + context).astype(np.int32)
    num_tokens = int(qsl[-1]) + data.draw(st.integers(0, 4), label="token padding")
    max_q = max(int(q.max()) if b else 0, 0) + data.draw(st.integers(0, 2), label="max_query_len slack")
    got = split_decodes_prefills_and_extends(
        qsl, upper, num_tokens=num_tokens, max_query_len=max_q, decode_threshold=threshold
    )
    ref = ref_split_decodes_prefills_and_extends(
        torch.from_numpy(qsl).to(device), torch.from_numpy(upper).to(device), num_tokens, max_q, threshold
    )
    assert tuple(got) == ref


@given(
    spec=batch_specs(with_prompts=st.just(True), with_upper_bound=st.booleans()),
    threshold=st.integers(1, 5),
    reorder=st.booleans(),
    require_uniform=st.booleans(),
    treat_short=st.booleans(),
)
def test_splits_of_engine_batches_match_reference(
    spec: BatchSpec, threshold: int, reorder: bool, require_uniform: bool, treat_short: bool, device: torch.device
) -> None:
    """Engine-shaped batches (padding, spec decode, short extends), reordered as vLLM would or not."""
    c, q, p = spec.num_computed_tokens, spec.num_scheduled_tokens, spec.num_prompt_tokens
    assert p is not None
    upper = spec.seq_lens_upper_bound if spec.seq_lens_upper_bound is not None else seq_lens(c, q)
    if reorder:
        perm = reorder_decodes_and_prefills(c, q, p, decode_threshold=threshold).permutation
        c, q, p, upper = c[perm], q[perm], p[perm], upper[perm]
    rows = spec.padded_num_reqs
    qsl = query_start_loc(q, num_reqs_padded=rows)
    flags = is_prefilling(c, p, num_reqs_padded=rows)
    upper_padded = np.zeros(rows, dtype=np.int32)
    upper_padded[: spec.num_reqs] = upper
    t = spec.padded_num_tokens
    got = split_decodes_and_prefills(
        qsl,
        num_tokens=t,
        max_query_len=spec.max_query_len,
        decode_threshold=threshold,
        require_uniform=require_uniform,
        treat_short_extends_as_decodes=treat_short,
        is_prefilling=flags,
    )
    qsl_t = torch.from_numpy(qsl).to(device)
    ref = ref_split_decodes_and_prefills(
        qsl_t, t, spec.max_query_len, threshold, require_uniform, treat_short, torch.from_numpy(flags).to(device)
    )
    assert tuple(got) == ref
    got3 = split_decodes_prefills_and_extends(
        qsl, upper_padded, num_tokens=t, max_query_len=spec.max_query_len, decode_threshold=threshold
    )
    ref3 = ref_split_decodes_prefills_and_extends(
        qsl_t, torch.from_numpy(upper_padded).to(device), t, spec.max_query_len, threshold
    )
    assert tuple(got3) == ref3
