"""Host derivations at boundaries the property tests rarely reach: local-attention out= buffers sized
for MORE virtual rows, the int32 edge of the kernel-block expansion, Triton-MLA's split count just
past a multiple of 512."""

from __future__ import annotations

import numpy as np
import pytest

from attnmeta.host.kernel_blocks import expand_block_table
from attnmeta.host.local_attn import local_virtual_batches, num_virtual_reqs
from attnmeta.host.mla import triton_num_kv_splits

I32 = np.int32
# The local-attention worked example: q = [4, 10, 5], s = [6, 17, 9], A = 4, bs = 2.
QSL = np.array([0, 4, 14, 19], I32)
SEQ = np.array([6, 17, 9], I32)
BT = np.arange(30, dtype=I32).reshape(3, 10)


def test_local_out_buffers_sized_for_more_virtual_rows_are_refused() -> None:
    """Buffers one row too long would leave a stale trailing row and a wrong ``num_virtual_reqs``."""
    v = num_virtual_reqs(QSL, SEQ, 4)
    bufs = {
        "query_start_loc_out": np.full(v + 2, -1, I32),
        "seq_lens_out": np.full(v + 1, -1, I32),
        "req_indices_out": np.full(v + 1, -1, I32),
        "block_starts_out": np.full(v + 1, -1, I32),
        "block_table_out": np.full((v + 1, 2), -1, I32),
    }
    with pytest.raises(ValueError, match=rf"sized for num_virtual_reqs={v + 1} but this batch has {v} virtual rows"):
        local_virtual_batches(QSL, SEQ, 4, 2, BT, **bufs)
    without_table = {k: b for k, b in bufs.items() if k != "block_table_out"}
    with pytest.raises(ValueError, match=rf"sized for num_virtual_reqs={v + 1}"):
        local_virtual_batches(QSL, SEQ, 4, 2, **without_table)


@pytest.mark.parametrize(("R", "last_fitting"), [(3, 715827881), (4, 536870911), (2, 1073741823)])
def test_expansion_int32_edge_counts_the_last_kernel_block(R: int, last_fitting: int) -> None:
    """Manager block ``b`` expands to ``b * R + 0 .. R - 1``: the largest id whose LAST kernel block fits
    int32 expands, the next one is refused even where ``b * R`` alone still fits."""
    ok = expand_block_table([[last_fitting]], R)
    assert ok.tolist() == [[last_fitting * R + j for j in range(R)]]
    assert int(ok.max()) <= 2**31 - 1 and int(ok.min()) >= 0
    bad = last_fitting + 1
    with pytest.raises(ValueError, match=rf"block_table\[0, 0\]={bad}: its kernel blocks .* leave int32"):
        expand_block_table([[bad]], R)


def test_triton_splits_floor_the_512_token_count() -> None:
    """``next_pow2(max(1, max_seq_len // 512))``: a FLOOR division, so one token past a multiple of 512
    does not add a split."""
    got = [triton_num_kv_splits(s, 132) for s in (513, 1023, 1024, 1025, 1536, 2047, 2048, 2049, 4096, 4097)]
    assert got == [1, 1, 2, 2, 4, 4, 4, 4, 8, 8]
    assert triton_num_kv_splits(1025, 1) == 2 and triton_num_kv_splits(4097, 2) == 4
