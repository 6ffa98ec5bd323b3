"""The multimodal prefix spans' overlap rule: a request's placeholders are distinct prompt tokens, so
two of its spans that share a token are refused (adjacent ones and other requests' spans are not)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnmeta import BatchSpec, Stager
from attnmeta.backends.mm_prefix import MMPrefixInputs, build, mm_prefix_ranges

I32 = np.int32
# Row 0 an image (offset 2, length 5); row 1 nothing; row 2 an image (offset 0, length 6) and a video
# (offset 20, length 300): the worked example's spans.
INPUTS = MMPrefixInputs(mm_span_indptr=np.array([0, 1, 1, 3], I32), mm_span_starts=np.array([2, 0, 20], I32),
                        mm_span_lengths=np.array([5, 6, 300], I32))
SPEC = BatchSpec(num_computed_tokens=[0, 0, 0], num_scheduled_tokens=[7, 3, 8],
                 block_table=np.zeros((3, 1), I32), block_size=512)


@pytest.mark.parametrize(("starts", "message"), [
    ([2, 0, 5], r"spans 1 \[0, 6\) and 2 \[5, 305\) of request 2 overlap"),
    ([2, 25, 20], r"spans 1 \[25, 31\) and 2 \[20, 320\) of request 2 overlap"),
    ([2, 20, 20], r"spans 1 \[20, 26\) and 2 \[20, 320\) of request 2 overlap"),
])
def test_overlapping_spans_of_one_request_are_refused(starts: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(SPEC, Stager("cpu"), None, dataclasses.replace(INPUTS, mm_span_starts=np.array(starts, I32)))
    with pytest.raises(ValueError, match=message):
        mm_prefix_ranges(INPUTS.mm_span_indptr, starts, INPUTS.mm_span_lengths)


def test_adjacent_spans_and_other_requests_spans_may_touch() -> None:
    """``[0, 6)`` then ``[6, 306)`` share no token; row 0's span may cover row 2's positions."""
    ip, ranges = mm_prefix_ranges([0, 1, 1, 3], [0, 0, 6], [5, 6, 300])
    assert ip.tolist() == [0, 1, 1, 3] and ranges.tolist() == [[0, 4], [0, 5], [6, 305]]
    m = build(SPEC, Stager("cpu"), None, dataclasses.replace(INPUTS, mm_span_starts=np.array([0, 0, 6], I32)))
    assert m.doc_ranges() == {0: [(0, 4)], 1: [], 2: [(0, 5), (6, 305)]}
