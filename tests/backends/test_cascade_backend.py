"""Cascade (shared-prefix) attention metadata (docs/semantics-attention.md, "FlashAttentionMetadata") against device references, audit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import cascade, flash_attn, flashinfer
from attnmeta.backends.cascade import CascadeInputs, CascadeMetadata, CascadeOptions
from attnmeta.sync import no_device_sync
from attnmeta.testing.assertions import assert_matches_device
from attnmeta.testing.builders import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference import (
    ref_cascade_arrays,
    ref_paged_kv_indices,
    ref_paged_kv_indptr,
    ref_paged_kv_last_page_len,
    ref_seq_lens,
    ref_use_cascade_attention,
)
from attnmeta.testing.strategies import CascadeBatch, cascade_batches

I32 = np.int32
OPTIONS = CascadeOptions(num_query_heads=8, num_kv_heads=8, num_sms=132)
_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device) -> Stager:
    key = str(device)
    if key not in _STAGERS:
        _STAGERS[key] = Stager(device)
    return _STAGERS[key]


def _eight_decodes(**kw: int) -> BatchSpec:
    """Eight decodes with 300..370 cached tokens sharing blocks 3 and 4 (block size 128)."""
    table = np.array([[3, 4, 10 + i, 20 + i] for i in range(8)], I32)
    return BatchSpec(num_computed_tokens=np.arange(300, 380, 10, dtype=I32), num_scheduled_tokens=np.ones(8, I32),
                     block_table=table, block_size=128, **kw)


def _twins(meta: CascadeMetadata) -> None:
    for dev, host in meta._TWINS:
        assert_matches_device(getattr(meta, host), getattr(meta, dev), dev)


# ------------------------------------------------------------------------------------------------
# worked examples
# ------------------------------------------------------------------------------------------------


def test_worked_example(device: torch.device) -> None:
    ca = cascade.build(_eight_decodes(), _stager(device), OPTIONS, CascadeInputs(num_common_prefix_blocks=2))
    assert (ca.use_cascade, ca.common_prefix_len, ca.num_prefix_blocks) == (True, 256, 2)
    assert ca.cu_prefix_query_lens is not None and ca.cu_prefix_query_lens.cpu().tolist() == [0, 8]
    assert ca.prefix_kv_lens is not None and ca.prefix_kv_lens.cpu().tolist() == [256]
    assert ca.suffix_kv_lens is not None and ca.suffix_kv_lens.cpu().tolist() == list(range(45, 125, 10))
    assert ca.shared_kv_page_indptr_cpu is not None and ca.shared_kv_page_indptr_cpu.tolist() == [0, 2]
    assert ca.shared_kv_page_indices_cpu is not None and ca.shared_kv_page_indices_cpu.tolist() == [3, 4]
    assert ca.shared_kv_last_page_len_cpu is not None and ca.shared_kv_last_page_len_cpu.tolist() == [128]
    # Suffix level: one page each (45..115 tokens), the block after the prefix, last pages 45..115.
    assert ca.suffix_paged_kv_indptr_cpu is not None and ca.suffix_paged_kv_indptr_cpu.tolist() == list(range(9))
    assert ca.suffix_paged_kv_indices_cpu is not None and ca.suffix_paged_kv_indices_cpu.tolist() == list(range(10, 18))
    assert ca.suffix_paged_kv_last_page_len_cpu is not None
    assert ca.suffix_paged_kv_last_page_len_cpu.tolist() == list(range(45, 125, 10))
    assert ca.suffix_block_table is not None and ca.suffix_block_table.cpu().tolist() == [[10 + i] for i in range(8)]
    _twins(ca)


@pytest.mark.parametrize(
    ("spec", "blocks", "options", "why"),
    [
        (_eight_decodes(), 1, OPTIONS, "prefix 128 < 256 tokens"),
        (_eight_decodes(), 0, OPTIONS, "nothing shared"),
        (_eight_decodes(num_reqs_padded=9), 2, OPTIONS, "CUDA-graph padding rows"),
        (_eight_decodes(), 2, dataclasses.replace(OPTIONS, use_sliding_window=True), "sliding window"),
        (_eight_decodes(), 2, dataclasses.replace(OPTIONS, dcp_world_size=2), "DCP"),
        (_eight_decodes(), 2, dataclasses.replace(OPTIONS, num_kv_heads=1), "flash decoding wins the cost model"),
    ],
)
def test_no_cascade(spec: BatchSpec, blocks: int, options: CascadeOptions, why: str) -> None:
    with Stager("cpu").step() as step:
        staged = cascade.stage(stage_common(spec, step), step, options,
                               CascadeInputs(num_common_prefix_blocks=blocks))
    ca = staged.result()
    assert not ca.use_cascade and ca.common_prefix_len == 0 and ca.num_prefix_blocks == 0, why
    assert (staged.host.use_cascade, staged.host.common_prefix_len) == (False, 0)
    assert all(getattr(ca, n) is None for n in ca._DEVICE_FIELDS + ca._HOST_FIELDS), why
    assert "cascade.suffix_kv_lens" not in step  # nothing of cascade staged


def test_prefix_capped_at_the_smallest_context() -> None:
    # 3 shared blocks of 128 offered, but one request has only 300 cached tokens: L = 256.
    ca = cascade.build(_eight_decodes(), Stager("cpu"), OPTIONS, CascadeInputs(num_common_prefix_blocks=3))
    assert (ca.common_prefix_len, ca.num_prefix_blocks) == (256, 2)


# ------------------------------------------------------------------------------------------------
# equivalence with the device references (hypothesis)
# ------------------------------------------------------------------------------------------------


@st.composite
def _sharing_batches(draw: st.DrawFn) -> CascadeBatch:
    """A drawn batch with up to 600 more cached tokens shared by every request: whole blocks
    prepended to every row (so cascade actually runs for a good share of the examples)."""
    batch = draw(cascade_batches(min_reqs=draw(st.sampled_from([1, 8])), max_reqs=12))
    bs, rows = batch.block_size, batch.block_table.shape[0]
    extra = draw(st.integers(0, 600)) // bs
    shared = np.broadcast_to(np.arange(200_000, 200_000 + extra, dtype=I32), (rows, extra))
    return CascadeBatch(batch.num_computed_tokens + I32(extra * bs), batch.query_lens, bs,
                        batch.num_common_prefix_blocks + extra, np.concatenate([shared, batch.block_table], axis=1))


@given(batch=_sharing_batches(), heads=st.sampled_from([(8, 8), (32, 8), (16, 1)]), sms=st.sampled_from([8, 132]))
def test_matches_device_reference(device: torch.device, batch: CascadeBatch, heads: tuple[int, int], sms: int) -> None:
    spec = BatchSpec(num_computed_tokens=batch.num_computed_tokens, num_scheduled_tokens=batch.query_lens,
                     block_table=batch.block_table, block_size=batch.block_size)
    options = CascadeOptions(num_query_heads=heads[0], num_kv_heads=heads[1], num_sms=sms)
    with no_device_sync(devices={device.type}), _stager(device).step() as step:
        common = stage_common(spec, step)
        staged = cascade.stage(common, step, options,
                               CascadeInputs(num_common_prefix_blocks=batch.num_common_prefix_blocks))
    ca, cm = staged.result(), common.result()
    bs = batch.block_size
    c = torch.from_numpy(batch.num_computed_tokens).to(device)
    q = torch.from_numpy(batch.query_lens).to(device)
    offered = min(batch.num_common_prefix_blocks * bs, int(c.min())) // bs * bs
    use = ref_use_cascade_attention(offered, q, heads[0], heads[1], False, False, False, sms)
    assert ca.use_cascade == use
    if not use:
        assert ca.common_prefix_len == 0 and ca.suffix_kv_lens is None
        return
    seq = ref_seq_lens(c, q)
    table = cm.block_table_tensor
    ref = ref_cascade_arrays(offered, seq, spec.num_tokens, bs, table)
    assert (ca.common_prefix_len, ca.num_prefix_blocks) == (offered, ref["num_prefix_blocks"])
    for name in ("cu_prefix_query_lens", "prefix_kv_lens", "suffix_kv_lens", "shared_kv_page_indptr",
                 "shared_kv_last_page_len", "shared_kv_page_indices"):
        assert torch.equal(getattr(ca, name), ref[name]), name  # type: ignore[arg-type]
    suffix, suffix_table = ref["suffix_kv_lens"], table[:, ca.num_prefix_blocks :]
    assert isinstance(suffix, torch.Tensor)
    assert torch.equal(ca.suffix_paged_kv_indptr, ref_paged_kv_indptr(suffix, bs))  # type: ignore[arg-type]
    assert torch.equal(ca.suffix_paged_kv_indices, ref_paged_kv_indices(suffix_table, suffix, bs))  # type: ignore[arg-type]
    assert torch.equal(ca.suffix_paged_kv_last_page_len, ref_paged_kv_last_page_len(suffix, bs))  # type: ignore[arg-type]
    assert torch.equal(ca.suffix_block_table, suffix_table)  # type: ignore[arg-type]
    _twins(ca)


@given(batch=_sharing_batches(), seed=st.integers(0, 2**32 - 1))
def test_lab_defaults_and_sample_match_the_lab_reference(device: torch.device, batch: CascadeBatch, seed: int) -> None:
    """The lab's demo and random options and inputs (a block count the rows bear out) against its
    reference, which derives the prefix length by the runner's rule itself."""
    spec = BatchSpec(num_computed_tokens=batch.num_computed_tokens, num_scheduled_tokens=batch.query_lens,
                     block_table=batch.block_table, block_size=batch.block_size)
    entry = lab("cascade")
    for options, inputs in (entry.defaults(spec), entry.sample(spec, np.random.default_rng(seed))):
        assert isinstance(inputs, CascadeInputs)
        check_builder("cascade", spec, device, options, inputs)


def test_lab_reference_caps_the_prefix_at_the_smallest_context() -> None:
    ref = lab("cascade").reference(_eight_decodes(), OPTIONS, "cpu", CascadeInputs(num_common_prefix_blocks=3))
    assert ref is not None and (ref["use_cascade"], ref["common_prefix_len"]) == (True, 256)
    ref = lab("cascade").reference(_eight_decodes(), OPTIONS, "cpu", CascadeInputs(num_common_prefix_blocks=1))
    assert ref == {"use_cascade": False, "common_prefix_len": 0, "num_prefix_blocks": 0}


# ------------------------------------------------------------------------------------------------
# graph mode, meta device, one copy
# ------------------------------------------------------------------------------------------------

PROFILE = StaticProfile(max_num_reqs=10, max_num_tokens=32, max_blocks_per_req=6, block_size=128)


def test_graph_mode_fixed_addresses_and_sentinels() -> None:
    stager = Stager("cpu", profile=PROFILE)
    names = ["cu_prefix_query_lens", "suffix_kv_lens", "shared_kv_page_indices", "suffix_paged_kv_indptr",
             "suffix_paged_kv_indices", "suffix_paged_kv_last_page_len"]
    addresses = None
    for blocks in (2, 0, 2):
        with stager.step() as step:
            staged = cascade.stage(stage_common(_eight_decodes(), step), step, OPTIONS,
                                   CascadeInputs(num_common_prefix_blocks=blocks))
        ca = staged.result()
        full = {n: step.device_full("cascade." + n) for n in names}
        now = {n: t.data_ptr() for n, t in full.items()}
        addresses = addresses or now
        assert now == addresses
        if ca.use_cascade:
            assert full["suffix_paged_kv_indptr"][9:].eq(8).all()  # tail repeats the last value
            assert full["suffix_kv_lens"][8:].eq(0).all() and full["suffix_paged_kv_indices"][8:].eq(0).all()
            assert ca.suffix_kv_lens is not None and ca.suffix_kv_lens.data_ptr() == full["suffix_kv_lens"].data_ptr()
        else:  # a step without cascade leaves every declared field at its sentinel
            assert full["suffix_kv_lens"].eq(0).all() and full["cu_prefix_query_lens"].eq(0).all()


@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_meta_device_build_passes_the_audit(profile: StaticProfile | None) -> None:
    stager = Stager("meta", profile=profile)
    for blocks in (2, 1):
        with no_device_sync():
            ca = cascade.build(_eight_decodes(), stager, OPTIONS,
                               CascadeInputs(num_common_prefix_blocks=blocks))
        assert ca.use_cascade == (blocks == 2)
        if ca.suffix_paged_kv_indices is not None:
            assert ca.suffix_paged_kv_indices.device.type == "meta"


def test_one_copy_with_common_flash_attention_and_flashinfer() -> None:
    with Stager("cpu").step() as step:
        common = stage_common(_eight_decodes(), step)
        flash_attn.stage(common, step)
        flashinfer.stage(common, step)
        staged = cascade.stage(common, step, OPTIONS, CascadeInputs(num_common_prefix_blocks=2))
    assert step.stats.copies == 1
    assert staged.result().use_cascade
