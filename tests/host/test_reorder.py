"""attnmeta.host.split.reorder_decodes_and_prefills: the replayed cycle-swap reorder (section 5.3)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta.host.split import Reorder, reorder_decodes_and_prefills
from attnmeta.spec import BatchSpec
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import ref_reorder
from attnmeta.testing.strategies import batch_specs


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread() -> Iterator[None]:
    """The references run on tiny tensors: one intra-op thread avoids thread-pool stalls on a busy CI box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _regions(c: np.ndarray, q: np.ndarray, p: np.ndarray, threshold: int) -> np.ndarray:
    """Region per row, written independently of both implementations: 0 decode .. 3 prefill."""
    out = np.empty(len(c), dtype=np.int64)
    for i in range(len(c)):
        if c[i] == 0:
            out[i] = 3
        elif q[i] > threshold:
            out[i] = 2
        elif c[i] < p[i]:
            out[i] = 1
        else:
            out[i] = 0
    return out


def _apply(swaps: np.ndarray, n: int) -> np.ndarray:
    """Replay the swap_states calls on an identity list."""
    rows = list(range(n))
    for i, j in swaps.tolist():
        rows[i], rows[j] = rows[j], rows[i]
    return np.array(rows, dtype=np.int32)


def test_worked_example_moves_a_cycle() -> None:
    # Rows: prefill, long extend, decode, decode -> one 3-cycle starting at the first decode (row 2).
    r = reorder_decodes_and_prefills([0, 4, 9, 7], [5, 6, 1, 1], [5, 12, 9, 7])
    assert_host_equal(r.swaps, np.array([[2, 0], [2, 3], [2, 1]], np.int32))
    assert_host_equal(r.permutation, np.array([2, 3, 1, 0], np.int32))
    assert r.modified


def test_not_a_stable_sort() -> None:
    # decode, prefill, decode, decode: only rows 1 and 3 are misplaced; row 3 swaps into slot 1, so the
    # decodes end up as rows 0, 3, 2 (a stable sort would give 0, 2, 3).
    r = reorder_decodes_and_prefills([4, 0, 6, 8], [1, 3, 1, 1], [4, 3, 6, 8])
    assert_host_equal(r.swaps, np.array([[3, 1]], np.int32))
    assert_host_equal(r.permutation, np.array([0, 3, 2, 1], np.int32))


def test_short_extend_between_decodes_and_long_extends() -> None:
    # long extend, short extend (c < P, q <= thr), decode, prefill with threshold 2.
    r = reorder_decodes_and_prefills([3, 2, 9, 0], [5, 2, 1, 4], [20, 10, 9, 4], decode_threshold=2)
    assert_host_equal(r.permutation, np.array([2, 1, 0, 3], np.int32))
    assert_host_equal(r.swaps, np.array([[2, 0]], np.int32))


def test_already_ordered_and_empty() -> None:
    r = reorder_decodes_and_prefills([9, 4, 0], [1, 6, 5], [9, 12, 5])
    assert r.swaps.shape == (0, 2) and r.swaps.dtype == np.int32
    assert_host_equal(r.permutation, np.arange(3, dtype=np.int32))
    assert not r.modified
    r = reorder_decodes_and_prefills([], [], [])
    assert r.swaps.shape == (0, 2) and r.permutation.shape == (0,)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[1\]=-1 is negative \(request 1\)"):
        reorder_decodes_and_prefills([1, 1], [1, -1], [1, 1])
    with pytest.raises(ValueError, match=r"num_prompt_tokens\[0\]=-2 is negative"):
        reorder_decodes_and_prefills([1], [1], [-2])
    with pytest.raises(ValueError, match=r"num_prompt_tokens: expected length 2"):
        reorder_decodes_and_prefills([1, 2], [1, 1], [1])
    with pytest.raises(TypeError, match="decode_threshold: expected an int"):
        reorder_decodes_and_prefills([1], [1], [1], decode_threshold=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch"):
        reorder_decodes_and_prefills(torch.tensor([1]), [1], [1])


_SPECS = batch_specs(with_prompts=st.just(True), max_reqs=24)


@given(spec=_SPECS, threshold=st.integers(1, 5))
def test_reorder_properties_and_reference(spec: BatchSpec, threshold: int, device: torch.device) -> None:
    c, q, p = spec.num_computed_tokens, spec.num_scheduled_tokens, spec.num_prompt_tokens
    assert p is not None
    got = reorder_decodes_and_prefills(c, q, p, decode_threshold=threshold)
    assert isinstance(got, Reorder)
    n = spec.num_reqs
    assert got.swaps.dtype == np.int32 and got.swaps.ndim == 2 and got.swaps.shape[1] == 2
    assert got.swaps.shape[0] < max(n, 1)
    # Replaying the swaps gives the permutation.
    assert_host_equal(_apply(got.swaps, n), got.permutation, "replayed swaps")
    # The permuted batch is in region order, and rows already in their region's slots never move.
    regions = _regions(c, q, p, threshold)
    after = regions[got.permutation]
    assert (np.diff(after) >= 0).all(), after
    target = np.sort(regions)
    fixed = regions == target
    assert_host_equal(got.permutation[fixed], np.flatnonzero(fixed).astype(np.int32), "untouched rows")
    assert got.modified == bool((~fixed).any())
    # Bit-exact with the torch transcription of the prose.
    ref_swaps, ref_perm = ref_reorder(
        torch.tensor(c).to(device), torch.tensor(q).to(device), torch.tensor(p).to(device), threshold
    )
    assert_matches_device(got.swaps, ref_swaps, "swaps")
    assert_matches_device(got.permutation, ref_perm, "permutation")
