"""Chunked local attention metadata (docs/semantics-attention.md, "LocalAttentionMetadata (chunked local attention)") against device references, graph mode, audit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import flash_attn, local_attn
from attnmeta.backends.local_attn import LocalAttentionMetadata, LocalAttentionOptions, max_virtual_reqs
from attnmeta.staging import CapacityError
from attnmeta.sync import no_device_sync
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.builders import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference import ref_local_virtual_batches, ref_query_start_loc, ref_seq_lens
from attnmeta.testing.strategies import batch_specs

I32 = np.int32
_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device) -> Stager:
    key = str(device)
    if key not in _STAGERS:
        _STAGERS[key] = Stager(device)
    return _STAGERS[key]


def _build(spec: BatchSpec, stager: Stager, opts: LocalAttentionOptions, columns: int | None = None) -> LocalAttentionMetadata:
    with stager.step() as step:
        staged = local_attn.stage(stage_common(spec, step, block_table_columns=columns), step, opts)
    return staged.result()


# The 5.6 example: q = [4, 10, 5], s = [6, 17, 9], A = 4, bs = 2, block rows [10i .. 10i+9]; one padding row.
SPEC_5_6 = BatchSpec(num_computed_tokens=np.array([2, 7, 4], I32), num_scheduled_tokens=np.array([4, 10, 5], I32),
                     block_table=np.arange(30, dtype=I32).reshape(3, 10), block_size=2, num_reqs_padded=4,
                     num_tokens_padded=21)
ROWS_5_6 = [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25], [0, 0]]


# ------------------------------------------------------------------------------------------------
# worked examples
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["host", "device"])
def test_worked_example_5_6(device: torch.device, mode: str) -> None:
    la = _build(SPEC_5_6, _stager(device), LocalAttentionOptions(attn_chunk_size=4, block_table=mode), columns=10)  # type: ignore[arg-type]
    cm = la.common
    # The corrected cu_seqlens_q_local (the upstream comment's [0,4,6,10,14,18,19,23,24] is wrong),
    # plus the padding row's empty virtual row.
    assert cm.query_start_loc.cpu().tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19, 19]
    assert cm.seq_lens.cpu().tolist() == [4, 2, 4, 4, 4, 1, 4, 1, 4]
    assert cm.block_table_tensor.cpu().tolist() == ROWS_5_6
    assert la.req_indices_cpu.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 3]
    assert la.block_starts_cpu.tolist() == [0, 2, 2, 4, 6, 8, 2, 4, 0]
    assert (la.num_virtual_reqs, cm.num_reqs, cm.num_real_reqs) == (9, 9, 8)
    assert (cm.max_query_len, cm.max_seq_len, la.pages_per_local_block) == (4, 4, 2)
    assert (cm.num_actual_tokens, cm.num_real_tokens) == (21, 19)  # unchanged: the same tokens
    assert cm.seq_lens_cpu_upper_bound is cm.seq_lens_cpu
    assert cm.num_computed_tokens_cpu.tolist() == [2, 0, 3, 0, 0, 0, 0, 0, 4]
    assert cm.is_prefilling.tolist() == [False] * 9  # no prompts given: nothing is prefilling
    assert cm.num_decode_draft_tokens_cpu is None and cm.causal
    if mode == "host":
        assert la.block_table_cpu is not None and la.block_table_cpu.tolist() == ROWS_5_6
        assert la.req_indices is None and la.block_starts is None
    else:
        assert la.block_table_cpu is None and cm.block_table_cpu.tolist() == [[-1, -1]] * 9  # the poison
        assert la.req_indices is not None and la.req_indices.cpu().tolist() == la.req_indices_cpu.tolist()
    assert la.block_table is cm.block_table_tensor and la.seq_lens is cm.seq_lens


def test_positions_and_slot_mapping_are_carried() -> None:
    with Stager("cpu").step() as step:
        common = stage_common(SPEC_5_6, step)
        staged = local_attn.stage(common, step, LocalAttentionOptions(attn_chunk_size=4))
    cm, cm0 = staged.result().common, common.result()
    for name in ("slot_mapping", "slot_mapping_cpu", "positions", "positions_cpu"):
        assert getattr(cm, name) is getattr(cm0, name), name
    cm.validate()


def test_staged_width_clips_unused_columns() -> None:
    # Eager staging keeps cdiv(17, 2) = 9 columns; the row whose chunk starts at column 8 repeats
    # column 8 where vLLM's 10-column table reads (the unused) column 9.
    la = _build(SPEC_5_6, Stager("cpu"), LocalAttentionOptions(attn_chunk_size=4))
    assert la.block_table.tolist()[5] == [18, 18] and la.seq_lens_cpu[5] == 1


def test_bad_options_fail_fast() -> None:
    with pytest.raises(ValueError, match="positive multiple of block_size=2"):
        _build(SPEC_5_6, Stager("cpu"), LocalAttentionOptions(attn_chunk_size=3))
    with pytest.raises(ValueError, match="block_table: must be 'host' or 'device'"):
        _build(SPEC_5_6, Stager("cpu"), LocalAttentionOptions(attn_chunk_size=4, block_table="gpu"))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# equivalence with the device references (hypothesis)
# ------------------------------------------------------------------------------------------------


@given(
    spec=batch_specs(max_reqs=8, max_query_len=24, max_context_len=80, block_sizes=st.sampled_from([1, 2, 4])),
    blocks_per_chunk=st.integers(1, 4),
    mode=st.sampled_from(["host", "device"]),
)
def test_matches_device_reference(device: torch.device, spec: BatchSpec, blocks_per_chunk: int, mode: str) -> None:
    chunk = spec.block_size * blocks_per_chunk
    opts = LocalAttentionOptions(attn_chunk_size=chunk, block_table=mode)  # type: ignore[arg-type]
    with no_device_sync(devices={device.type}), _stager(device).step() as step:
        common = stage_common(spec, step)
        staged = local_attn.stage(common, step, opts)
    la = staged.result()
    cm = la.common
    rows = spec.padded_num_reqs
    c = torch.from_numpy(spec.num_computed_tokens.copy()).to(device)
    q = torch.from_numpy(spec.num_scheduled_tokens.copy()).to(device)
    table = common.result().block_table_tensor  # both gathers read the staged common table
    ref = ref_local_virtual_batches(ref_query_start_loc(q, rows), ref_seq_lens(c, q, rows), chunk, spec.block_size,
                                    table)
    assert la.num_virtual_reqs == cm.num_reqs == ref.num_virtual_reqs
    assert (cm.max_query_len, cm.max_seq_len) == (ref.max_query_len, ref.max_seq_len)
    expected = {"query_start_loc": ref.query_start_loc, "seq_lens": ref.seq_lens, "block_table": ref.block_table}
    for name, value in expected.items():
        assert torch.equal(getattr(la, name), value), name
    for name in ("query_start_loc", "seq_lens", "block_table_tensor"):
        if name != "block_table_tensor" or mode == "host":
            host = getattr(cm, "block_table_cpu" if name == "block_table_tensor" else name + "_cpu")
            assert_matches_device(host, getattr(cm, name), name)
    assert_matches_device(la.req_indices_cpu, ref.req_indices, "req_indices")
    assert_matches_device(la.block_starts_cpu, ref.block_starts, "block_starts")
    assert cm.num_real_reqs == ref.num_virtual_reqs - (rows - spec.num_reqs)
    assert_host_equal(cm.num_computed_tokens_cpu, (ref.seq_lens - (ref.query_start_loc[1:] - ref.query_start_loc[:-1])).cpu().numpy())
    cm.validate()


@given(spec=batch_specs(max_reqs=8, max_query_len=24, max_context_len=80, block_sizes=st.sampled_from([1, 2, 4])),
       seed=st.integers(0, 2**32 - 1))
def test_lab_defaults_and_sample_match_the_lab_reference(device: torch.device, spec: BatchSpec, seed: int) -> None:
    """The lab's demo options (chunks of 4 blocks) and random ones (1-4 blocks, either gather) against
    its reference."""
    entry = lab("local_attn")
    for options, inputs in (entry.defaults(spec), entry.sample(spec, np.random.default_rng(seed))):
        assert inputs is None and options.attn_chunk_size % spec.block_size == 0
        if local_attn.LOCAL_ATTN.unsupported_reasons(spec, options, None):
            continue
        check_builder("local_attn", spec, device, options)
    assert entry.defaults(spec)[0].attn_chunk_size == 4 * spec.block_size


@pytest.mark.parametrize("mode", ["host", "device"])
def test_the_lab_reference_of_a_zero_length_request_in_graph_mode(mode: str) -> None:
    """vLLM's formulas give a zero-length request a virtual row of k = A (one whole chunk), whose table
    entries past the request's own (none) follow the staged width: a graph-mode step's profile width
    gathers padding there, an eager step's one column repeats. The reference compared them (found by a
    400-example fuzz of the registry's graph-mode check); it now compares each virtual row within its
    request's own columns."""
    spec = BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[0, 1], block_table=[[-1], [63696]],
                     block_size=1)
    opts = LocalAttentionOptions(attn_chunk_size=4, block_table=mode)  # type: ignore[arg-type]
    prof = StaticProfile(max_num_reqs=16, max_num_tokens=512, max_blocks_per_req=512, block_size=1)
    for stager in (Stager("cpu"), Stager("cpu", profile=prof, debug_fill=0xA5)):
        m = check_builder("local_attn", spec, "cpu", opts, stager=stager, strict=True)
        assert m.seq_lens.tolist() == [4, 1]


# ------------------------------------------------------------------------------------------------
# graph mode, meta device, one copy
# ------------------------------------------------------------------------------------------------

PROFILE = StaticProfile(max_num_reqs=6, max_num_tokens=40, max_blocks_per_req=12, block_size=2)
SMALL = BatchSpec(num_computed_tokens=np.array([5], I32), num_scheduled_tokens=np.array([1], I32),
                  block_table=np.array([[7, 8, 9]], I32), block_size=2, num_reqs_padded=2)


@pytest.mark.parametrize("mode", ["host", "device"])
def test_graph_mode_fixed_addresses_and_sentinels(mode: str) -> None:
    stager = Stager("cpu", profile=PROFILE)
    opts = LocalAttentionOptions(attn_chunk_size=4, block_table=mode)  # type: ignore[arg-type]
    cap = max_virtual_reqs(PROFILE, 4)
    assert cap == 22
    names = ["query_start_loc", "seq_lens", "block_table"] + (["req_indices", "block_starts"] if mode == "device" else [])
    addresses = None
    for spec in (SPEC_5_6, SMALL, SPEC_5_6, SMALL):
        with stager.step() as step:
            staged = local_attn.stage(stage_common(spec, step), step, opts)
        la = staged.result()
        full = {n: step.device_full("local_attn." + n) for n in names}
        now = {n: t.data_ptr() for n, t in full.items()}
        addresses = addresses or now
        assert now == addresses
        v = la.num_virtual_reqs
        assert full["query_start_loc"].shape == (cap + 1,)
        assert full["query_start_loc"][v + 1 :].eq(int(la.query_start_loc_cpu[-1])).all()
        assert full["seq_lens"][v:].eq(0).all()
        assert full["block_table"].shape == (cap, 2) and full["block_table"][v:].eq(0).all()
        assert la.block_table.data_ptr() == full["block_table"].data_ptr()
        if mode == "device":
            assert full["req_indices"][v:].eq(0).all() and full["block_starts"][v:].eq(0).all()
    # Graph mode stages the profile's full width, so the 5.6 rows match vLLM exactly.
    assert _build(SPEC_5_6, stager, opts).block_table.tolist() == ROWS_5_6


def test_graph_mode_capacity_is_never_exceeded_within_the_profile() -> None:
    # A worst case for the bound: every request has one query before a chunk boundary and the rest after.
    spec = BatchSpec(num_computed_tokens=np.array([3] * 6, I32), num_scheduled_tokens=np.array([6, 6, 6, 6, 6, 10], I32),
                     block_table=np.zeros((6, 12), I32), block_size=2)
    la = _build(spec, Stager("cpu", profile=PROFILE), LocalAttentionOptions(attn_chunk_size=4))
    assert la.num_virtual_reqs <= max_virtual_reqs(PROFILE, 4)
    with pytest.raises(ValueError, match="attn_chunk_size"):
        max_virtual_reqs(PROFILE, 0)
    # A profile too small for the step fails in the common staging, before the virtual batch.
    tiny = StaticProfile(max_num_reqs=2, max_num_tokens=8, max_blocks_per_req=12, block_size=2)
    with pytest.raises(CapacityError):
        _build(spec, Stager("cpu", profile=tiny), LocalAttentionOptions(attn_chunk_size=4))


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_meta_device_build_passes_the_audit(mode: str, profile: StaticProfile | None) -> None:
    stager = Stager("meta", profile=profile)
    for spec in (SPEC_5_6, SMALL):
        with no_device_sync():
            la = local_attn.build(spec, stager, LocalAttentionOptions(attn_chunk_size=4, block_table=mode))  # type: ignore[arg-type]
        assert la.block_table.device.type == "meta"
        assert la.block_table.shape == (la.num_virtual_reqs, 2)


@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_one_copy_with_common_and_flash_attention(profile: StaticProfile | None) -> None:
    stager = Stager("cpu", profile=profile)
    with stager.step() as step:
        common = stage_common(SPEC_5_6, step)
        flash_attn.stage(common, step)
        la = local_attn.stage(common, step, LocalAttentionOptions(attn_chunk_size=4))
        fa_local = flash_attn.stage(la.host.common, step, flash_attn.FlashAttentionOptions(prefix="flash_attn_local"))
    assert step.stats.copies == 1
    fa = fa_local.result()
    assert fa.common is la.result().common
    assert fa.query_start_loc.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19, 19]
    assert fa.block_table.shape == (9, 2) and fa.max_query_len == 4
