"""Kernel block sizes (docs/semantics.md, "Kernel block sizes"): the choice, the host expansion against
vLLM's device expansion, slots unchanged, and every block-table builder reading the kernel table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import cascade, flash_attn, flashinfer
from attnmeta.backends.cascade import CascadeOptions
from attnmeta.host.kernel_blocks import (
    MultipleOf,
    block_table_width,
    expand_block_table,
    kernel_block_size,
    select_common_block_size,
)
from attnmeta.host.layout import slot_mapping
from attnmeta.kernel_blocks import stage_kernel_block_table
from attnmeta.spec import ContextParallel
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference.kernel_blocks import ref_kernel_block_table
from attnmeta.testing.strategies import batch_specs

I32 = np.int32
TABLE = [[7, 3, 0], [5, 0, 0], [0, 0, 0]]  # the 19.2 worked example (manager 64 -> kernel 16)


# ------------------------------------------------------------------------------------------------
# 19.1: choosing the kernel block size
# ------------------------------------------------------------------------------------------------


def test_select_worked_examples() -> None:
    assert select_common_block_size(256, [[64]]) == 64  # FlashMLA
    assert select_common_block_size(64, [[MultipleOf(16)]]) == 64  # FlashAttention
    assert select_common_block_size(128, [[32, 64], [MultipleOf(16)]]) == 64  # FlashInfer-MLA + Triton-MLA
    with pytest.raises(ValueError, match="No common block size for manager block size 256"):
        select_common_block_size(256, [[128], [32, 64]])  # CUTLASS-MLA + FlashInfer-MLA


def test_select_rules() -> None:
    assert select_common_block_size(64, [[64], [MultipleOf(32)]]) == 64  # every backend accepts the manager size
    assert select_common_block_size(96, [[32, 48], [MultipleOf(16)]]) == 48  # largest accepted divisor
    assert select_common_block_size(64, [[128, 16]]) == 16  # a candidate must divide the manager size
    assert kernel_block_size(256, [64]) == 64 and kernel_block_size(256, [256, 64], block_outermost=True) == 256
    # block-outermost packing cannot be split: a backend that needs smaller blocks is refused, as vLLM
    # refuses it when the cache is bound (it returned the manager size, a size the backend cannot read)
    with pytest.raises(ValueError, match="cannot read a KV cache packed block-outermost in 256-token blocks"):
        kernel_block_size(256, [64], block_outermost=True)
    assert kernel_block_size(256, [MultipleOf(16)], block_outermost=True) == 256
    for bad in ([], [[]], [[0]], [["16"]]):
        with pytest.raises(ValueError):
            select_common_block_size(64, bad)
    with pytest.raises(ValueError, match="manager_block_size"):
        select_common_block_size(0, [[16]])
    with pytest.raises(ValueError, match=r"MultipleOf\.base"):
        MultipleOf(0)


def test_block_table_width_worked_examples() -> None:
    assert [block_table_width(*a) for a in ((100, 16), (100, 256), (33, 48), (5, 1))] == [104, 100, 40, 128]


# ------------------------------------------------------------------------------------------------
# 19.2: the expansion (checklist 23.6: null entries -> 0..R-1, packed stride)
# ------------------------------------------------------------------------------------------------


def test_expansion_worked_example_nulls_become_0_to_R_minus_1() -> None:
    out = expand_block_table(TABLE, 4)
    assert out.dtype == I32 and out.shape == (3, 12) and out.flags.c_contiguous
    assert out.tolist() == [[28, 29, 30, 31, 12, 13, 14, 15, 0, 1, 2, 3],
                            [20, 21, 22, 23, 0, 1, 2, 3, 0, 1, 2, 3],
                            [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]]


def test_expansion_worked_example_packed_stride() -> None:
    out = expand_block_table(TABLE, 4, kernel_block_stride=6)
    assert out.tolist() == [[42, 43, 44, 45, 18, 19, 20, 21, 0, 1, 2, 3],
                            [30, 31, 32, 33, 0, 1, 2, 3, 0, 1, 2, 3],
                            [0, 1, 2, 3] * 3]
    assert out.strides == (12 * 4, 4)  # packed: row stride max_blocks * R entries


def test_expansion_matches_the_device_reference_worked(device: torch.device) -> None:
    t = torch.tensor(TABLE, dtype=torch.int32, device=device)
    assert_matches_device(expand_block_table(TABLE, 4), ref_kernel_block_table(t, 4), "kernel table")
    assert_matches_device(expand_block_table(TABLE, 4, kernel_block_stride=6), ref_kernel_block_table(t, 4, 6), "S=6")


def test_expansion_errors_and_out() -> None:
    out = np.full((3, 6), 99, I32)
    assert expand_block_table(TABLE, 2, out=out) is out and out[2].tolist() == [0, 1] * 3
    with pytest.raises(ValueError, match="blocks_per_kv_block"):
        expand_block_table(TABLE, 0)
    with pytest.raises(ValueError, match="kernel_block_stride"):
        expand_block_table(TABLE, 4, kernel_block_stride=3)
    with pytest.raises(ValueError, match="2-D"):
        expand_block_table([1, 2], 2)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]=1073741824.*leave int32"):
        expand_block_table([[1], [2**30]], 2)
    with pytest.raises(ValueError, match="out= must have shape"):
        expand_block_table(TABLE, 2, out=np.zeros((3, 5), I32))
    with pytest.raises(TypeError):
        expand_block_table(torch.zeros((1, 1), dtype=torch.int32), 2)


@given(
    table=st.lists(st.lists(st.integers(-1, 50_000), min_size=3, max_size=3), min_size=0, max_size=6),
    R=st.sampled_from([1, 2, 4, 16]),
    extra=st.integers(0, 3),
)
def test_expansion_property_against_the_device_reference(table: list[list[int]], R: int, extra: int) -> None:
    t = np.array(table, I32).reshape(len(table), 3)
    S = R + extra
    host = expand_block_table(t, R, kernel_block_stride=S)
    assert_matches_device(host, ref_kernel_block_table(torch.from_numpy(t), R, S), "kernel table")
    # every kernel block of manager block b is b * S + j, in order
    offsets = np.ascontiguousarray(np.broadcast_to(np.arange(R, dtype=np.int64), (t.shape[0], 3, R)))
    assert_host_equal(host.reshape(t.shape[0], 3, R) - t[..., None].astype(np.int64) * S, offsets, "offsets")


# ------------------------------------------------------------------------------------------------
# 19.3: slots unchanged in manager units (checklist 23.6)
# ------------------------------------------------------------------------------------------------

_C, _Q, _ROWS = [130, 60], [5, 3], [[7, 3, 9, 0], [5, 2, 0, 0]]
_NEG4 = [-1] * 4


@pytest.mark.parametrize(("cp", "expected"), [
    (None, [578, 579, 580, 581, 582, 380, 381, 382, *_NEG4]),
    (ContextParallel(2, 0), [193, -1, 194, -1, 195, 350, -1, 351, *_NEG4]),
    (ContextParallel(2, 1), [-1, 193, -1, 194, -1, -1, 350, -1, *_NEG4]),
    (ContextParallel(2, 0, 4), [194, 195, -1, -1, -1, -1, -1, -1, *_NEG4]),
    (ContextParallel(2, 1, 4), [-1, -1, 192, 193, 194, 348, 349, 350, *_NEG4]),
])
def test_slots_worked_example_same_in_manager_and_kernel_units(cp: ContextParallel | None, expected: list[int]) -> None:
    manager = slot_mapping(_C, _Q, _ROWS, 64, num_tokens_padded=12, context_parallel=cp)
    kernel = slot_mapping(_C, _Q, expand_block_table(_ROWS, 4), 16, num_tokens_padded=12, context_parallel=cp)
    assert manager.tolist() == expected
    assert kernel.tolist() == expected


@given(spec=batch_specs(max_reqs=6, max_query_len=24, max_context_len=200, block_sizes=st.sampled_from([16, 64]),
                        with_context_parallel=st.booleans()),
       log_r=st.integers(0, 3))
def test_staged_kernel_table_property(spec: BatchSpec, log_r: int) -> None:
    """Staged expansion == device reference over the common table; slots, lengths unchanged; the slot
    mapping recomputed in kernel units equals the manager one (interleave dividing the kernel size)."""
    cp = spec.context_parallel
    R = 1 << log_r
    k = spec.block_size // R
    il = 1 if cp is None else cp.interleave
    if k % il:
        R, k = 1, spec.block_size
    with Stager("cpu").step() as step:
        common = stage_common(spec, step)
        kern = stage_kernel_block_table(common, step, k, kernel_block_stride=R + 1 if R > 1 and cp is None else None)
    cm, km = common.result(), kern.result()
    if R == 1:
        assert kern is common
        return
    S = R + 1 if cp is None else R
    ref = ref_kernel_block_table(cm.block_table_tensor, R, S)
    assert_matches_device(km.block_table_cpu, ref, "block_table_cpu")
    assert torch.equal(km.block_table_tensor, ref)
    assert km.block_size == k and kern.host.block_size == k
    for name in ("slot_mapping", "seq_lens", "query_start_loc", "positions"):
        assert torch.equal(getattr(km, name), getattr(cm, name)), name
    q = spec.num_scheduled_tokens.astype(np.int64)
    assert kern.host.num_pages == int(((spec.num_computed_tokens + q + k - 1) // k).sum())
    if S == R:
        again = slot_mapping(spec.num_computed_tokens, spec.num_scheduled_tokens, km.block_table_cpu, k,
                             num_tokens_padded=cm.num_actual_tokens, context_parallel=cp)
        assert_host_equal(again, cm.slot_mapping_cpu, "slot_mapping in kernel units")


# ------------------------------------------------------------------------------------------------
# staging: eager and graph mode, builders
# ------------------------------------------------------------------------------------------------


def _spec(padded: int | None = 3) -> BatchSpec:
    return BatchSpec(num_computed_tokens=_C, num_scheduled_tokens=_Q, block_table=_ROWS, block_size=64,
                     num_reqs_padded=padded)


def test_stage_eager_padding_rows_and_one_copy() -> None:
    with Stager("cpu").step() as step:
        common = stage_common(_spec(), step)
        kern = stage_kernel_block_table(common, step, 16)
    km = kern.result()
    assert step.stats.copies == 1
    assert km.block_table_tensor.tolist() == expand_block_table(common.host.block_table_cpu, 4).tolist()
    assert km.block_table_tensor[2].tolist() == [0, 1, 2, 3] * 3  # the padding row: NULL_BLOCK_ID expanded
    assert not km.block_table_cpu.flags.writeable
    assert kern.paged is None and kern.prefix is None  # derived: its fields are views of another's


def test_stage_graph_mode_fixed_address() -> None:
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=4, block_size=64)
    stager = Stager("cpu", profile=prof)
    ptrs = []
    for padded in (3, 4):
        with stager.step() as step:
            kern = stage_kernel_block_table(stage_common(_spec(padded), step), step, 16)
        km = kern.result()
        full = step.device_full("kernel_blocks.block_table_tensor")
        assert full.shape == (4, 16)
        ptrs.append(full.data_ptr())
        assert km.block_table_tensor.shape == (padded, 16)
        assert km.block_table_tensor[0].tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37, 38, 39, 0, 1, 2, 3]
        assert km.block_table_tensor[2].tolist() == list(range(4)) * 4
        if padded == 3:
            assert full[3].tolist() == [0] * 16  # past the step's padded rows: the staging sentinel
    assert ptrs[0] == ptrs[1]


def test_stage_errors() -> None:
    with Stager("cpu").step() as step:
        common = stage_common(_spec(), step)
        with pytest.raises(ValueError, match="kernel_block_size"):
            stage_kernel_block_table(common, step, 48)
        with pytest.raises(TypeError, match="StagedCommon"):
            stage_kernel_block_table(common.host, step, 16)  # type: ignore[arg-type]
        assert stage_kernel_block_table(common, step, 64) is common
        a = stage_kernel_block_table(common, step, 16)
        b = stage_kernel_block_table(common, step, 32, prefix="k32")  # two backends, two sizes, one step
    assert a.result().block_table_cpu.shape == (3, 12) and b.result().block_table_cpu.shape == (3, 6)


def test_every_block_table_builder_reads_the_kernel_table() -> None:
    spec = _spec()
    with Stager("cpu").step() as step:
        common = stage_common(spec, step, paged_kv=True)
        kern = stage_kernel_block_table(common, step, 16)
        fa = flash_attn.stage(kern, step)
        fi = flashinfer.stage(kern, step)
        ca = cascade.stage(kern, step, CascadeOptions(num_query_heads=8, num_kv_heads=8, num_sms=132))
    expanded = expand_block_table(common.host.block_table_cpu, 4)
    assert fa.result().block_table.tolist() == expanded.tolist()
    f = fi.result()
    assert f.page_size == 16
    # kernel pages: cdiv(135, 16) = 9 of row 0, cdiv(63, 16) = 4 of row 1, none of the padding row
    assert f.paged_kv_indptr_cpu.tolist() == [0, 9, 13, 13]
    assert f.paged_kv_indices_cpu.tolist() == [*expanded[0, :9], *expanded[1, :4]]
    assert f.paged_kv_last_page_len_cpu.tolist() == [7, 15, 0]
    assert ca.result().common.block_table_tensor.tolist() == expanded.tolist()
    assert step.stats.copies == 1


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_kernel_table_and_capture_fill_are_sync_free(graph: bool) -> None:
    """On a device that holds no data (``meta``) under the sync audit: the common metadata, its kernel
    block table, a FlashAttention builder reading it and a capture-time fill, all in one copy."""
    from attnmeta.graph_padding import apply_capture_fill, capture_fill
    from attnmeta.sync import no_device_sync

    spec = BatchSpec(num_computed_tokens=[130, 60], num_scheduled_tokens=[5, 3], block_table=[[7, 3, 9], [5, 2, 0]],
                     block_size=64, num_reqs_padded=3)
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=3, block_size=64) if graph else None
    stager = Stager("meta", profile=prof)
    with no_device_sync():
        with stager.step() as step:
            common = stage_common(spec, step)
            apply_capture_fill(common, capture_fill("triton_attn"))
            k16 = stage_kernel_block_table(common, step, 16)
            fa = flash_attn.stage(k16, step)
        cm, meta = k16.result(), fa.result()
    assert step.stats.copies == 1 and cm.block_table_tensor.device.type == "meta"
    assert meta.common.block_size == 16 and tuple(cm.block_table_tensor.shape) == (3, 12)
    assert capture_fill("triton_attn") != capture_fill("flash_attn")  # (the fill above was a real one)
