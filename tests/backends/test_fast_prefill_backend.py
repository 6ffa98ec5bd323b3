"""KV-sharing fast prefill metadata (docs/semantics-attention.md, "FastPrefillMetadata (KV-sharing fast prefill)") against device references, graph mode, audit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import fast_prefill, flash_attn
from attnmeta.backends.fast_prefill import FastPrefillInputs
from attnmeta.staging import CapacityError
from attnmeta.sync import no_device_sync
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.builders import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference import (
    ref_fast_prefill_query_start_loc,
    ref_max_logits_per_req,
    ref_pad_logits_indices,
    ref_positions,
    ref_query_start_loc,
    ref_seq_lens,
)
from attnmeta.testing.strategies import batch_specs, logits_indices_for

I32 = np.int32
_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device) -> Stager:
    key = str(device)
    if key not in _STAGERS:
        _STAGERS[key] = Stager(device)
    return _STAGERS[key]


# The 5.5 test: s = [41, 31, 40], q = [15, 5, 8] -> qsl = [0, 15, 20, 28]; logits [14, 18, 19, 27].
SPEC_5_5 = BatchSpec(num_computed_tokens=np.array([26, 26, 32], I32), num_scheduled_tokens=np.array([15, 5, 8], I32),
                     block_table=np.arange(9, dtype=I32).reshape(3, 3), block_size=16)
LOGITS_5_5 = np.array([14, 18, 19, 27], I32)


# ------------------------------------------------------------------------------------------------
# worked examples and quirks
# ------------------------------------------------------------------------------------------------


def test_worked_example_5_5(device: torch.device) -> None:
    stager = _stager(device)
    with stager.step() as step:
        common = stage_common(SPEC_5_5, step)
        staged = fast_prefill.stage(common, step, None,
                                    FastPrefillInputs(logits_indices=LOGITS_5_5, num_logits_padded=5))
    fp, cm0 = staged.result(), common.result()
    cm = fp.common
    assert fp.applied and fp.num_logits_indices == 4
    assert cm.query_start_loc.cpu().tolist() == [0, 1, 3, 4]  # rid = [0, 1, 1, 2], cnt = [1, 2, 1]
    assert cm.query_start_loc_cpu.tolist() == [0, 1, 3, 4]
    assert (cm.num_actual_tokens, cm.num_real_tokens, cm.max_query_len) == (4, 4, 2)
    assert (cm.num_reqs, cm.max_seq_len) == (3, 41)
    # Carried unchanged: the same views, not copies.
    for name in ("seq_lens", "block_table_tensor", "slot_mapping", "seq_lens_cpu", "seq_lens_cpu_upper_bound",
                 "block_table_cpu", "slot_mapping_cpu", "is_prefilling"):
        assert getattr(cm, name) is getattr(cm0, name), name
    assert cm.seq_lens_cpu.tolist() == [41, 31, 40]
    assert cm.positions.cpu().tolist() == [40, 29, 30, 39]  # positions[logits_indices]
    assert cm.num_computed_tokens_cpu.tolist() == [40, 29, 39]  # s - cnt
    assert cm.num_decode_draft_tokens_cpu is None and cm.causal
    assert fp.logits_indices_padded is not None and fp.logits_indices_padded_cpu is not None
    assert fp.logits_indices_padded.cpu().tolist() == [14, 18, 19, 27, 27]  # tail = last index
    assert fp.query_start_loc is cm.query_start_loc and fp.max_query_len == 2
    cm.validate()
    for dev, host in cm._TWINS:
        assert_matches_device(getattr(cm, host), getattr(cm, dev), dev)


def test_all_decode_step_is_unchanged() -> None:
    # Quirk 1 of 5.5: max_query_len == 1 returns the common metadata itself.
    spec = BatchSpec(num_computed_tokens=np.array([4, 9, 2], I32), num_scheduled_tokens=np.array([1, 1, 1], I32),
                     block_table=np.array([[1, 2], [3, 4], [5, 6]], I32), block_size=8)
    with Stager("cpu").step() as step:
        common = stage_common(spec, step)
        staged = fast_prefill.stage(common, step, None,
                                    FastPrefillInputs(logits_indices=np.array([0, 1, 2], I32), num_logits_padded=4))
    fp = staged.result()
    assert not fp.applied and fp.common is common.result() and staged.host.common is common
    assert fp.num_logits_indices == 3
    assert fp.logits_indices_padded is not None and fp.logits_indices_padded.tolist() == [0, 1, 2, 2]
    assert "fast_prefill.query_start_loc" not in step


def test_not_armed_is_unchanged() -> None:
    with Stager("cpu").step() as step:
        common = stage_common(SPEC_5_5, step)
        staged = fast_prefill.stage(common, step, None, FastPrefillInputs(logits_indices=None))
    fp = staged.result()
    assert not fp.applied and fp.common is common.result()
    assert fp.logits_indices_padded is None and fp.logits_indices_padded_cpu is None
    assert fp.num_logits_indices is None


def test_bad_logits_fail_fast() -> None:
    stager = Stager("cpu")
    cases = [
        (np.array([14, 28], I32), None, r"logits_indices\[1\]=28 is outside \[0, query_start_loc_cpu\[-1\]=28\)"),
        (np.array([18, 14], I32), None, r"must be sorted"),
        (np.zeros(0, I32), None, r"is empty"),
        (LOGITS_5_5, 3, r"num_logits_padded=3 < num_logits=4"),
        (np.array([14, 18, 18, 27], I32), None, r"logits_indices\[2\]=18 == logits_indices\[1\]=18"),
    ]
    for li, opts, message in cases:
        with pytest.raises(ValueError, match=message), stager.step() as step:
            fast_prefill.stage(stage_common(SPEC_5_5, step), step, None,
                               FastPrefillInputs(logits_indices=li, num_logits_padded=opts))
    with pytest.raises(TypeError), stager.step() as step:
        fast_prefill.stage(stage_common(SPEC_5_5, step), step, None,
                           FastPrefillInputs(logits_indices=torch.tensor([14, 18])))


# ------------------------------------------------------------------------------------------------
# equivalence with the device references (hypothesis)
# ------------------------------------------------------------------------------------------------


@st.composite
def _steps(draw: st.DrawFn) -> tuple[BatchSpec, np.ndarray, int]:
    """A batch with at least one token, its runner logits indices (spec decode: several per request)
    and a padded logits count."""
    spec = draw(batch_specs(min_reqs=1, max_reqs=8, max_query_len=20, max_context_len=100))
    qsl = np.concatenate([[0], np.cumsum(spec.num_scheduled_tokens)]).astype(I32)
    li = draw(logits_indices_for(qsl, max_per_req=draw(st.sampled_from([1, 1, 3]))))
    pad = draw(st.integers(0, 4))
    return spec, li, li.shape[0] + pad


@given(step=_steps())
def test_matches_device_reference(device: torch.device, step: tuple[BatchSpec, np.ndarray, int]) -> None:
    spec, li, n_pad = step
    if li.shape[0] == 0:
        return  # no token at all: vLLM asserts num_logits > 0 (covered by test_bad_logits_fail_fast)
    with no_device_sync(devices={device.type}):
        fp = fast_prefill.build(spec, _stager(device), None,
                                FastPrefillInputs(logits_indices=li, num_logits_padded=n_pad))
    rows = spec.padded_num_reqs
    c = torch.from_numpy(spec.num_computed_tokens.copy()).to(device)
    q = torch.from_numpy(spec.num_scheduled_tokens.copy()).to(device)
    qsl = ref_query_start_loc(q, rows)
    li_d = torch.from_numpy(li).to(device)
    assert fp.logits_indices_padded is not None
    assert_matches_device(fp.logits_indices_padded_cpu, ref_pad_logits_indices(li_d, n_pad), "logits_indices_padded")
    assert torch.equal(fp.logits_indices_padded, ref_pad_logits_indices(li_d, n_pad))
    assert fp.num_logits_indices == li.shape[0]
    cm = fp.common
    if spec.max_query_len == 1:
        assert not fp.applied and cm.query_start_loc_cpu.tolist() == qsl.cpu().tolist()
        return
    fqsl = ref_fast_prefill_query_start_loc(qsl, li_d)
    assert fp.applied
    assert torch.equal(cm.query_start_loc, fqsl)
    assert_matches_device(cm.query_start_loc_cpu, fqsl, "query_start_loc_cpu")
    assert cm.max_query_len == ref_max_logits_per_req(fqsl)
    assert cm.num_actual_tokens == cm.num_real_tokens == li.shape[0]
    positions = ref_positions(c, q, spec.padded_num_tokens)[li_d]
    assert torch.equal(cm.positions, positions)
    assert_matches_device(cm.positions_cpu, positions, "positions_cpu")
    seq = ref_seq_lens(c, q, rows)
    assert torch.equal(cm.seq_lens, seq)
    assert_host_equal(cm.num_computed_tokens_cpu, (seq - (fqsl[1:] - fqsl[:-1])).cpu().numpy())
    cm.validate()


@given(spec=batch_specs(max_reqs=8, max_query_len=20, max_context_len=100), seed=st.integers(0, 2**32 - 1))
def test_lab_defaults_and_sample_match_the_lab_reference(device: torch.device, spec: BatchSpec, seed: int) -> None:
    """The lab's demo inputs (each request's last token) and random ones (its last 1-3 tokens, padded)
    against its reference."""
    entry = lab("fast_prefill")
    for options, inputs in (entry.defaults(spec), entry.sample(spec, np.random.default_rng(seed))):
        assert inputs is None or isinstance(inputs, FastPrefillInputs)
        check_builder("fast_prefill", spec, device, options, inputs)
    options, inputs = entry.defaults(spec)
    if spec.num_tokens:
        assert inputs is not None and np.asarray(inputs.logits_indices).tolist() == [
            int(e) - 1 for e, q in zip(np.cumsum(spec.num_scheduled_tokens), spec.num_scheduled_tokens, strict=True)
            if q > 0]


# ------------------------------------------------------------------------------------------------
# graph mode, meta device, one copy
# ------------------------------------------------------------------------------------------------

PROFILE = StaticProfile(max_num_reqs=6, max_num_tokens=48, max_blocks_per_req=4, block_size=16)
SMALL = BatchSpec(num_computed_tokens=np.array([3, 0], I32), num_scheduled_tokens=np.array([2, 6], I32),
                  block_table=np.array([[1], [2]], I32), block_size=16, num_reqs_padded=3, num_tokens_padded=10)
LOGITS_SMALL = np.array([1, 7], I32)


def test_graph_mode_fixed_addresses_and_sentinels() -> None:
    stager = Stager("cpu", profile=PROFILE)
    names = ["logits_indices_padded", "query_start_loc", "positions"]
    addresses = None
    for spec, li, n_pad in ((SPEC_5_5, LOGITS_5_5, 6), (SMALL, LOGITS_SMALL, 2), (SPEC_5_5, LOGITS_5_5, 4)):
        with stager.step() as step:
            staged = fast_prefill.stage(stage_common(spec, step), step, None,
                                        FastPrefillInputs(logits_indices=li, num_logits_padded=n_pad))
        fp = staged.result()
        full = {n: step.device_full("fast_prefill." + n) for n in names}
        now = {n: t.data_ptr() for n, t in full.items()}
        addresses = addresses or now
        assert now == addresses
        assert full["logits_indices_padded"].shape == (PROFILE.max_num_tokens,)
        # The runner's buffer: the last index through the whole tail.
        assert full["logits_indices_padded"][li.shape[0] :].eq(int(li[-1])).all()
        assert fp.logits_indices_padded is not None and fp.logits_indices_padded.shape == (n_pad,)
        b = fp.common.num_reqs
        assert full["query_start_loc"][b + 1 :].eq(li.shape[0]).all()
        assert full["positions"][li.shape[0] :].eq(0).all()
    assert fp.common.query_start_loc.tolist() == [0, 1, 3, 4]
    with pytest.raises(CapacityError, match="logits_indices_padded"), stager.step() as step:
        fast_prefill.stage(stage_common(SMALL, step), step, None,
                           FastPrefillInputs(logits_indices=LOGITS_SMALL, num_logits_padded=49))


@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_meta_device_build_passes_the_audit(profile: StaticProfile | None) -> None:
    stager = Stager("meta", profile=profile)
    for spec, li in ((SPEC_5_5, LOGITS_5_5), (SMALL, LOGITS_SMALL)):
        with no_device_sync():
            fp = fast_prefill.build(spec, stager, None,
                                    FastPrefillInputs(logits_indices=li, num_logits_padded=li.shape[0] + 1))
        assert fp.common.query_start_loc.device.type == "meta"
        assert fp.common.positions.shape == (li.shape[0],)


@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_one_copy_with_common_and_flash_attention(profile: StaticProfile | None) -> None:
    stager = Stager("cpu", profile=profile)
    with stager.step() as step:
        common = stage_common(SPEC_5_5, step)
        fa_full = flash_attn.stage(common, step)
        fp = fast_prefill.stage(common, step, None, FastPrefillInputs(logits_indices=LOGITS_5_5))
        fa_fast = flash_attn.stage(fp.host.common, step, flash_attn.FlashAttentionOptions(prefix="flash_attn_fast"))
    assert step.stats.copies == 1
    fast = fa_fast.result()
    assert fast.common is fp.result().common
    assert fast.query_start_loc.tolist() == [0, 1, 3, 4] and fast.max_query_len == 2
    assert fast.num_actual_tokens == 4 and fast.seq_lens is fa_full.result().seq_lens
