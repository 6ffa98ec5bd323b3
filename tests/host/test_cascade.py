"""Cascade attention on the host (docs/semantics-attention.md, "FlashAttentionMetadata"): runner rule, decision, arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta.host.cascade import cascade_arrays, cascade_prefix_len, use_cascade_attention
from attnmeta.host.paged import paged_kv_layout
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import (
    ref_cascade_arrays,
    ref_paged_kv_indices,
    ref_paged_kv_last_page_len,
    ref_use_cascade_attention,
)
from attnmeta.testing.strategies import CascadeBatch, cascade_batches

I32 = np.int32
NO_FEATURES = {"use_alibi": False, "use_sliding_window": False, "use_local_attention": False}


def _dev(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(arr)).to(device)


# ------------------------------------------------------------------------------------------------
# structure: the rules, case by case
# ------------------------------------------------------------------------------------------------


def test_prefix_len_is_capped_at_min_computed_and_block_aligned() -> None:
    c = np.array([300, 290, 500], I32)
    assert cascade_prefix_len(20, 16, c) == 288  # min(320, 290) = 290 -> 288
    assert cascade_prefix_len(10, 16, c) == 160  # the blocks themselves are the cap
    assert cascade_prefix_len(0, 16, c) == 0
    assert cascade_prefix_len(20, 16, np.array([300, 15], I32)) == 0  # capped below one block
    assert cascade_prefix_len(4, 16, np.zeros(0, I32)) == 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"common_prefix_len": 255}, False),  # below the 256-token threshold
        ({"common_prefix_len": 256}, True),
        ({"use_alibi": True}, False),
        ({"use_sliding_window": True}, False),
        ({"use_local_attention": True}, False),
        ({"query_lens": np.full(7, 3, I32)}, False),  # fewer than 8 requests
        ({"dcp_world_size": 2}, False),
        ({"num_kv_heads": 32}, True),  # g = 1: never flash decoding
        # Flash decoding (g = 4, all q == 1), 8 requests: cascade 1 wave * 4 tiles vs cdiv(256, 132) = 2.
        ({"query_lens": np.ones(8, I32)}, False),
        # 4096 requests: cascade cdiv(32 * 32, 132) * 4 = 32 vs flash decoding cdiv(4096 * 8 * 4, 132) = 993.
        ({"query_lens": np.ones(4096, I32)}, True),
    ],
)
def test_use_cascade_attention_cases(kwargs: dict[str, object], expected: bool) -> None:
    args: dict[str, object] = {
        "common_prefix_len": 512,
        "query_lens": np.array([5, 1, 1, 1, 1, 1, 1, 1], I32),
        "num_query_heads": 32,
        "num_kv_heads": 8,
        "num_sms": 132,
        **NO_FEATURES,
    }
    args.update(kwargs)
    assert use_cascade_attention(**args) is expected  # type: ignore[arg-type]


def test_arrays_worked_example() -> None:
    bt = np.array([[3, 4, 5, 6], [3, 4, 7, 0], [3, 4, 8, 9]], I32)
    ca = cascade_arrays(32, np.array([40, 35, 60], I32), 5, 16, block_table=bt)
    assert_host_equal(ca.cu_prefix_query_lens, np.array([0, 5], I32))
    assert_host_equal(ca.prefix_kv_lens, np.array([32], I32))
    assert_host_equal(ca.suffix_kv_lens, np.array([8, 3, 28], I32))
    assert ca.num_prefix_blocks == 2
    assert_host_equal(ca.shared_kv_page_indptr, np.array([0, 2], I32))
    assert_host_equal(ca.shared_kv_last_page_len, np.array([16], I32))
    assert ca.shared_kv_page_indices is not None
    assert_host_equal(ca.shared_kv_page_indices, np.array([3, 4], I32))
    bt[0, 0] = 99  # a copy: the persistent table may change after the step
    assert int(ca.shared_kv_page_indices[0]) == 3
    # a table exactly as wide as the prefix's blocks is enough (every prefix block, no column more)
    exact = cascade_arrays(32, np.array([32, 32], I32), 2, 16, block_table=bt[:2, :2])
    assert exact.shared_kv_page_indices is not None
    assert_host_equal(exact.shared_kv_page_indices, np.array([99, 4], I32))


# ------------------------------------------------------------------------------------------------
# numerics: against the transcribed references
# ------------------------------------------------------------------------------------------------


@given(
    batch=cascade_batches(),
    heads=st.sampled_from([(32, 8), (32, 32), (64, 1), (8, 8), (40, 8)]),
    num_sms=st.sampled_from([1, 78, 132]),
    features=st.one_of(
        st.just(NO_FEATURES),
        st.fixed_dictionaries(
            {
                "use_alibi": st.booleans(),
                "use_sliding_window": st.booleans(),
                "use_local_attention": st.booleans(),
            }
        ),
    ),
    dcp=st.sampled_from([1, 1, 1, 2]),
)
def test_decision_matches_reference(
    device: torch.device,
    batch: CascadeBatch,
    heads: tuple[int, int],
    num_sms: int,
    features: dict[str, bool],
    dcp: int,
) -> None:
    prefix = cascade_prefix_len(batch.num_common_prefix_blocks, batch.block_size, batch.num_computed_tokens)
    hq, hkv = heads
    host = use_cascade_attention(
        common_prefix_len=prefix,
        query_lens=batch.query_lens,
        num_query_heads=hq,
        num_kv_heads=hkv,
        num_sms=num_sms,
        dcp_world_size=dcp,
        **features,
    )
    ref = ref_use_cascade_attention(
        prefix, _dev(batch.query_lens, device), hq, hkv, num_sms=num_sms, dcp_world_size=dcp, **features
    )
    assert host is ref


def test_the_cost_vote_matches_the_reference_on_a_grid_with_ties() -> None:
    """Flash decoding's branch (GQA, every query length 1), where the two costs tie on some inputs: the
    vote is ``cascade < flash_decoding``, so a tie keeps flash decoding (a mutant voting ``<=`` survived
    the generated batches, whose heads and SMs never tied)."""
    ties = 0
    for length in (256, 300, 384, 512, 640):
        for reqs in (8, 10, 128, 129, 200):
            for hq in (8, 32, 64):
                for hkv in (1, 4, 8):
                    for sms in (1, 4, 16, 132):
                        g, tiles = hq // hkv, -(-length // 128)
                        cascade = -(-(hq * -(-reqs // 128)) // sms) * tiles
                        fd = -(-(reqs * hkv * -(-g // 128) * tiles) // sms)
                        ties += g > 1 and cascade == fd
                        q = np.ones(reqs, np.int32)
                        args = dict(use_alibi=False, use_sliding_window=False, use_local_attention=False, num_sms=sms)
                        host = use_cascade_attention(common_prefix_len=length, query_lens=q, num_query_heads=hq,
                                                     num_kv_heads=hkv, **args)  # type: ignore[arg-type]
                        ref = ref_use_cascade_attention(length, torch.from_numpy(q), hq, hkv, **args)  # type: ignore[arg-type]
                        assert host is ref, (length, reqs, hq, hkv, sms)
    assert ties > 0


@given(batch=cascade_batches(), extra_tokens=st.integers(0, 5))
def test_arrays_match_reference(device: torch.device, batch: CascadeBatch, extra_tokens: int) -> None:
    bs = batch.block_size
    prefix = cascade_prefix_len(batch.num_common_prefix_blocks, bs, batch.num_computed_tokens)
    seq_lens = (batch.num_computed_tokens + batch.query_lens).astype(I32)
    num_tokens = int(batch.query_lens.sum()) + extra_tokens
    ca = cascade_arrays(prefix, seq_lens, num_tokens, bs, block_table=batch.block_table)
    s_dev, bt_dev = _dev(seq_lens, device), _dev(batch.block_table, device)
    ref = ref_cascade_arrays(prefix, s_dev, num_tokens, bs, bt_dev)
    for name in (
        "cu_prefix_query_lens",
        "prefix_kv_lens",
        "suffix_kv_lens",
        "shared_kv_page_indptr",
        "shared_kv_last_page_len",
        "shared_kv_page_indices",
    ):
        assert_matches_device(getattr(ca, name), ref[name], name)  # type: ignore[arg-type]
    assert ca.num_prefix_blocks == ref["num_prefix_blocks"]
    # The suffix level of FlashInfer: the per-request pages after the prefix, same last-page lengths.
    suffix = paged_kv_layout(ca.suffix_kv_lens, batch.block_table[:, ca.num_prefix_blocks :], bs)
    full_rows = bt_dev[:, ca.num_prefix_blocks :]
    assert_matches_device(suffix.paged_kv_indices, ref_paged_kv_indices(full_rows, s_dev - prefix, bs))
    assert_matches_device(suffix.paged_kv_last_page_len, ref_paged_kv_last_page_len(s_dev, bs))


# ------------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------------

S = np.array([40, 35, 60], I32)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cascade_arrays(24, S, 5, 16), r"common_prefix_len=24 is not a multiple of block_size=16"),
        (
            lambda: cascade_arrays(48, np.array([64, 35, 60], I32), 5, 16),
            r"seq_lens\[1\]=35 < common_prefix_len=48",
        ),
        (lambda: cascade_arrays(-16, S, 5, 16), r"common_prefix_len: must be >= 0"),
        (lambda: cascade_arrays(16, S, -1, 16), r"num_tokens: must be >= 0"),
        (lambda: cascade_arrays(16, S, 2**31, 16), r"num_tokens: 2147483648 overflows int32"),
        (lambda: cascade_arrays(16, S, 5, 0), r"block_size: must be > 0"),
        (lambda: cascade_arrays(0, np.array([3, -1], I32), 5, 16), r"seq_lens\[1\]=-1 is negative"),
        (
            lambda: cascade_arrays(32, S, 5, 16, block_table=np.zeros((3, 1), I32)),
            r"no row 0 with the 2 prefix blocks",
        ),
        (lambda: cascade_prefix_len(-1, 16, S), r"num_common_prefix_blocks: must be >= 0"),
        (
            lambda: cascade_prefix_len(2, 16, np.array([5, -5], I32)),
            r"num_computed_tokens\[1\]=-5 is negative",
        ),
        (
            lambda: use_cascade_attention(
                common_prefix_len=512,
                query_lens=S,
                num_query_heads=8,
                num_kv_heads=0,
                num_sms=1,
                **NO_FEATURES,
            ),
            r"num_kv_heads: must be > 0",
        ),
        (
            lambda: use_cascade_attention(
                common_prefix_len=512,
                query_lens=np.array([1, -1], I32),
                num_query_heads=8,
                num_kv_heads=8,
                num_sms=1,
                **NO_FEATURES,
            ),
            r"query_lens\[1\]=-1 is negative",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]
