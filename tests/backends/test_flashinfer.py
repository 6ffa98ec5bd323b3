"""FlashInfer backend metadata (docs/semantics-attention.md, "FlashInferMetadata") against device references, graph mode, audit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.backends.flashinfer import FlashInferMetadata, FlashInferOptions
from attnmeta.staging import CapacityError
from attnmeta.sync import no_device_sync
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.builders import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference import (
    ref_dcp_context_kv_lens,
    ref_paged_kv_indices,
    ref_paged_kv_indptr,
    ref_paged_kv_last_page_len,
    ref_query_start_loc,
    ref_seq_lens,
    ref_split_decodes_and_prefills,
)
from attnmeta.testing.strategies import batch_specs

I32 = np.int32
_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device) -> Stager:
    """One eager stager per device for the whole module (hypothesis examples reuse its ring)."""
    key = str(device)
    if key not in _STAGERS:
        _STAGERS[key] = Stager(device)
    return _STAGERS[key]


def _spec(c: list[int], q: list[int], table: list[list[int]], bs: int, **kw: int) -> BatchSpec:
    return BatchSpec(num_computed_tokens=np.array(c, I32), num_scheduled_tokens=np.array(q, I32),
                     block_table=np.array(table, I32), block_size=bs, **kw)


def _device_inputs(spec: BatchSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's inputs on ``device``: padded qsl, seq_lens and block table."""
    c = torch.from_numpy(spec.num_computed_tokens.copy()).to(device)
    q = torch.from_numpy(spec.num_scheduled_tokens.copy()).to(device)
    rows = spec.padded_num_reqs
    table = np.zeros((rows, spec.block_table.shape[1]), I32)
    table[: spec.num_reqs] = spec.block_table[: spec.num_reqs]
    return ref_query_start_loc(q, rows), ref_seq_lens(c, q, rows), torch.from_numpy(table).to(device)


def _check_twins(meta: FlashInferMetadata) -> None:
    for dev, host in meta._TWINS:
        if getattr(meta, host) is not None:
            assert_matches_device(getattr(meta, host), getattr(meta, dev), dev)


# ------------------------------------------------------------------------------------------------
# worked examples
# ------------------------------------------------------------------------------------------------

MIXED = _spec([5, 7, 0], [1, 1, 4], [[10, 11], [20, 21], [30, 31]], 4, num_reqs_padded=4)


@pytest.mark.parametrize("mode", ["host", "device"])
def test_worked_example(device: torch.device, mode: str) -> None:
    fi = flashinfer.build(MIXED, _stager(device), FlashInferOptions(indices=mode))
    # s = [6, 8, 4, 0]: 2, 2, 1, 0 pages; last pages hold 2, 4, 4, 0 tokens.
    assert (fi.num_decodes, fi.num_prefills, fi.num_decode_tokens, fi.num_prefill_tokens) == (2, 2, 2, 4)
    assert fi.paged_kv_indptr.cpu().tolist() == [0, 2, 4, 5, 5]
    assert fi.paged_kv_indices.cpu().tolist() == [10, 11, 20, 21, 30]
    assert fi.paged_kv_last_page_len.cpu().tolist() == [2, 4, 4, 0]
    assert fi.qo_indptr_decode.cpu().tolist() == [0, 1, 2]
    assert fi.qo_indptr_prefill.cpu().tolist() == [0, 4, 4]
    assert fi.kv_lens.cpu().tolist() == [6, 8, 4, 0]
    assert (fi.num_pages, fi.page_size, fi.max_kv_len) == (5, 4, 8)
    assert (fi.max_decode_query_len, fi.max_prefill_query_len) == (1, 4)
    assert fi.kv_lens is fi.common.seq_lens  # no DCP: the common view itself, not a copy
    assert (fi.paged_kv_indices_cpu is None) == (mode == "device")
    _check_twins(fi)


def test_non_causal_and_dcp_example(device: torch.device) -> None:
    fi = flashinfer.build(MIXED, _stager(device), FlashInferOptions(causal=False))
    assert (fi.num_decodes, fi.num_prefills, fi.num_decode_tokens, fi.num_prefill_tokens) == (0, 4, 0, 6)
    assert fi.qo_indptr_prefill_cpu.tolist() == [0, 1, 2, 6, 6]
    # DCP W=2, rank 1: decode rows keep their whole length (6 -> 3, 8 -> 4); the prefill row's
    # context is 0; pages of the local lengths.
    fi = flashinfer.build(MIXED, _stager(device), FlashInferOptions(dcp_world_size=2, dcp_rank=1))
    assert fi.kv_lens_cpu.tolist() == [3, 4, 0, 0]
    assert fi.paged_kv_indptr_cpu.tolist() == [0, 1, 2, 2, 2]
    assert fi.paged_kv_last_page_len_cpu.tolist() == [3, 4, 0, 0]
    assert fi.paged_kv_indices_cpu is not None and fi.paged_kv_indices_cpu.tolist() == [10, 20]
    _check_twins(fi)


def test_spec_decode_uniform_split() -> None:
    # Two spec-decode rows of 3 tokens (threshold 3), a 2-token row (not uniform), a prefill.
    spec = _spec([9, 9, 9, 0], [3, 3, 2, 6], [[1, 2, 3]] * 4, 4)
    uniform = flashinfer.build(spec, _stager(torch.device("cpu")), FlashInferOptions(decode_threshold=3))
    assert (uniform.num_decodes, uniform.max_decode_query_len) == (2, 3)
    ragged = flashinfer.build(
        spec, _stager(torch.device("cpu")), FlashInferOptions(decode_threshold=3, require_uniform=False)
    )
    assert (ragged.num_decodes, ragged.max_decode_query_len, ragged.max_prefill_query_len) == (3, 3, 6)
    assert ragged.qo_indptr_prefill_cpu.tolist() == [0, 6]


def test_host_views_are_the_staged_read_only_arrays() -> None:
    stager = Stager("cpu")
    with stager.step() as step:
        staged = flashinfer.stage(stage_common(MIXED, step), step)
        indptr_view = step.host("flashinfer.paged_kv_indptr")
    fi = staged.result()
    assert np.shares_memory(fi.paged_kv_indptr_cpu, indptr_view)
    for name in ("paged_kv_indptr_cpu", "paged_kv_indices_cpu", "paged_kv_last_page_len_cpu", "qo_indptr_prefill_cpu"):
        assert not getattr(fi, name).flags.writeable, name
    assert staged.host.num_decodes == 2  # the host part: the step's split
    assert "paged_kv_indptr=(5,) int32 cpu" in repr(fi)  # repr shows shapes, never values


def test_host_tensor_leaves_the_callers_warnings_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``host_tensor`` of a read-only host array shares its memory and shows no warning, and a loop that
    calls it every step still sees its own "once per place" warning once: each call used to change the
    process's warning filters, which made Python forget the warnings it had shown (the caller's warning
    printed every step). Torch's own read-only warning is once a process, so only a process's first call
    needs to keep it away; a torch that warned at every call would keep that path for every call."""
    import warnings

    from attnmeta.backends import flashinfer as fi_module

    a = np.arange(6, dtype=np.int32)
    a.flags.writeable = False
    t = flashinfer.host_tensor(a)
    assert t.tolist() == a.tolist() and t.data_ptr() == a.ctypes.data  # (the same memory, no copy)
    shown: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kw: shown.append(str(message)))

    def step() -> None:
        warnings.warn("the caller's warning", UserWarning, stacklevel=1)

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # (once per place: pytest's own capture sets "always")
        for _ in range(5):
            step()
            flashinfer.host_tensor(a[1:])
    assert shown == ["the caller's warning"]
    # a torch that warns at every call: each call keeps the warning away, and says nothing of its own
    monkeypatch.setattr(fi_module, "_QUIET", False)
    monkeypatch.setattr(fi_module, "_LOUD", False)
    calls: list[int] = []

    def loud(array: np.ndarray) -> torch.Tensor:
        calls.append(1)
        warnings.warn(fi_module._READ_ONLY_TEXT + " (stand-in)", UserWarning, stacklevel=1)
        return torch.zeros(array.shape, dtype=torch.int32)

    monkeypatch.setattr(torch, "from_numpy", loud)
    shown.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        flashinfer.host_tensor(a)
        flashinfer.host_tensor(a)
    assert shown == [] and fi_module._QUIET is False and fi_module._LOUD is True
    assert len(calls) == 3  # (the first call checks whether torch warns again; the next only keeps it away)


def test_bad_options_fail_fast() -> None:
    with pytest.raises(ValueError, match="indices: must be 'host' or 'device'"):
        flashinfer.build(MIXED, Stager("cpu"), FlashInferOptions(indices="gpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dcp_rank"):
        flashinfer.build(MIXED, Stager("cpu"), FlashInferOptions(dcp_world_size=2, dcp_rank=2))


# ------------------------------------------------------------------------------------------------
# equivalence with the device references (hypothesis)
# ------------------------------------------------------------------------------------------------

_DCP = st.sampled_from([(1, 0, 1), (2, 0, 1), (2, 1, 2), (4, 3, 1), (4, 1, 4)])


@given(
    spec=batch_specs(max_reqs=8, max_query_len=24, max_context_len=200),
    threshold=st.sampled_from([1, 2, 4]),
    uniform=st.booleans(),
    mode=st.sampled_from(["host", "device"]),
    dcp=_DCP,
    causal=st.booleans(),
    paged=st.booleans(),
)
def test_matches_device_reference(
    device: torch.device, spec: BatchSpec, threshold: int, uniform: bool, mode: str, dcp: tuple[int, int, int],
    causal: bool, paged: bool,
) -> None:
    """Every field against the references; ``paged``: the common staged with ``paged_kv=True``, whose
    arrays the builder reuses (default host-indices options without DCP) or ignores (the rest)."""
    opts = FlashInferOptions(decode_threshold=threshold, require_uniform=uniform, indices=mode,  # type: ignore[arg-type]
                             dcp_world_size=dcp[0], dcp_rank=dcp[1], dcp_interleave=dcp[2], causal=causal)
    with no_device_sync(devices={device.type}):
        if paged:
            with _stager(device).step() as step:
                staged = flashinfer.stage(stage_common(spec, step, paged_kv=True), step, opts)
            fi = staged.result()
        else:
            fi = flashinfer.build(spec, _stager(device), opts)
    qsl, sl, table = _device_inputs(spec, device)
    rows, tokens = spec.padded_num_reqs, spec.padded_num_tokens
    if causal:
        split = ref_split_decodes_and_prefills(qsl, tokens, spec.max_query_len, threshold, uniform)
    else:
        split = (0, rows, 0, tokens)
    assert (fi.num_decodes, fi.num_prefills, fi.num_decode_tokens, fi.num_prefill_tokens) == split
    d = split[0]
    kv = ref_dcp_context_kv_lens(qsl, sl, dcp[0], dcp[1], dcp[2], num_decodes=d) if dcp[0] > 1 else sl
    page = spec.block_size
    expected = {
        "paged_kv_indptr": ref_paged_kv_indptr(kv, page),
        "paged_kv_indices": ref_paged_kv_indices(table, kv, page),
        "paged_kv_last_page_len": ref_paged_kv_last_page_len(kv, page),
        "kv_lens": kv,
        "qo_indptr_decode": qsl[: d + 1],
        "qo_indptr_prefill": qsl[d:] - qsl[d],
    }
    for name, ref in expected.items():
        assert torch.equal(getattr(fi, name), ref), name
        host = getattr(fi, name + "_cpu")
        if host is not None:
            assert_matches_device(host, ref, name + "_cpu")
    assert fi.num_pages == int(expected["paged_kv_indptr"][-1])
    assert fi.max_kv_len == (int(kv.max()) if rows else 0)
    q = (qsl[1:] - qsl[:-1]).cpu()
    assert fi.max_decode_query_len == (int(q[:d].max()) if d else 0)
    assert fi.max_prefill_query_len == (int(q[d:].max()) if d < rows else 0)


@given(spec=batch_specs(max_reqs=8, max_query_len=24, max_context_len=200), seed=st.integers(0, 2**32 - 1))
def test_lab_sample_matches_the_lab_reference(device: torch.device, spec: BatchSpec, seed: int) -> None:
    """The lab's random options (thresholds, uniformity, gather location, DCP) against its reference."""
    options, inputs = lab("flashinfer").sample(spec, np.random.default_rng(seed))
    assert inputs is None
    if flashinfer.FLASHINFER.unsupported_reasons(spec, options, None):
        return
    check_builder("flashinfer", spec, device, options)


@given(spec=batch_specs(max_reqs=6, max_query_len=16, max_context_len=100))
def test_pages_read_back_the_tokens_the_common_slot_mapping_wrote(spec: BatchSpec) -> None:
    """Paging semantics end to end: the KV slots reached through indptr/indices/last_page_len are
    exactly ``block * page + offset`` of positions ``[0, s)``, and their tail is where the common
    ``slot_mapping`` wrote this step's tokens."""
    fi = flashinfer.build(spec, _stager(torch.device("cpu")), FlashInferOptions(indices="device"))
    page = spec.block_size
    indptr, last = fi.paged_kv_indptr_cpu, fi.paged_kv_last_page_len_cpu
    indices = fi.paged_kv_indices.numpy()
    qsl, slots = fi.common.query_start_loc_cpu, fi.common.slot_mapping_cpu
    for i in range(spec.num_reqs):
        pages = indices[indptr[i] : indptr[i + 1]]
        kv_slots = (pages[:, None].astype(np.int64) * page + np.arange(page)).reshape(-1)
        kv_slots = kv_slots[: max(0, (len(pages) - 1) * page + int(last[i]))]
        assert kv_slots.shape[0] == int(fi.kv_lens_cpu[i])
        q = int(qsl[i + 1] - qsl[i])
        assert_host_equal(kv_slots[kv_slots.shape[0] - q :], slots[qsl[i] : qsl[i + 1]], f"row {i}")


# ------------------------------------------------------------------------------------------------
# graph mode, meta device, one copy
# ------------------------------------------------------------------------------------------------

PROFILE = StaticProfile(max_num_reqs=6, max_num_tokens=64, max_blocks_per_req=8, block_size=4)
BIG = _spec([20, 9, 0, 3], [1, 2, 7, 5], [[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0], [4, 4, 0, 0, 0, 0],
                                          [5, 6, 0, 0, 0, 0]], 4)
SMALL = _spec([3], [1], [[9, 0]], 4, num_reqs_padded=2, num_tokens_padded=2)


@pytest.mark.parametrize("mode", ["host", "device"])
def test_graph_mode_fixed_addresses_and_sentinels(mode: str) -> None:
    stager = Stager("cpu", profile=PROFILE)
    opts = FlashInferOptions(indices=mode)  # type: ignore[arg-type]
    names = ["paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "qo_indptr_prefill"]
    addresses = None
    for spec in (BIG, SMALL, BIG, SMALL):
        with stager.step() as step:
            staged = flashinfer.stage(stage_common(spec, step), step, opts)
        fi = staged.result()
        full = {n: step.device_full("flashinfer." + n) for n in names}
        now = {n: t.data_ptr() for n, t in full.items()}
        addresses = addresses or now
        assert now == addresses
        assert full["paged_kv_indptr"].shape == (PROFILE.max_num_reqs + 1,)
        assert full["paged_kv_indices"].shape == (PROFILE.max_num_pages,)
        b, n = fi.common.num_reqs, fi.num_pages
        assert full["paged_kv_indptr"][b + 1 :].eq(n).all()  # tail repeats the last value
        assert full["paged_kv_last_page_len"][b:].eq(0).all()
        assert full["paged_kv_indices"][n:].eq(0).all()  # tail 0, also after a bigger step
        assert full["qo_indptr_prefill"][fi.num_prefills + 1 :].eq(fi.qo_indptr_prefill_cpu[-1]).all()
        assert fi.paged_kv_indices.data_ptr() == full["paged_kv_indices"].data_ptr()
        _check_twins(fi)
    assert fi.paged_kv_indptr.tolist() == [0, 1, 1]


def test_graph_mode_capacity_error() -> None:
    small = StaticProfile(max_num_reqs=6, max_num_tokens=64, max_blocks_per_req=8, block_size=4,
                          max_num_pages_override=6)
    for mode in ("host", "device"):
        with pytest.raises(CapacityError, match="paged_kv_indices"), Stager("cpu", profile=small).step() as step:
            flashinfer.stage(stage_common(BIG, step), step, FlashInferOptions(indices=mode))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_meta_device_build_passes_the_audit(mode: str, profile: StaticProfile | None) -> None:
    stager = Stager("meta", profile=profile)
    for spec in (BIG, SMALL, MIXED):
        with no_device_sync():
            fi = flashinfer.build(spec, stager, FlashInferOptions(indices=mode))  # type: ignore[arg-type]
        assert fi.paged_kv_indices.device.type == "meta"
        assert fi.paged_kv_indices.shape == (fi.num_pages,)


@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_one_copy_with_common_and_flash_attention(profile: StaticProfile | None) -> None:
    stager = Stager("cpu", profile=profile)
    for spec in (BIG, SMALL):
        with stager.step() as step:
            common = stage_common(spec, step)
            fa = flash_attn.stage(common, step)
            fi_host = flashinfer.stage(common, step)
            fi_dev = flashinfer.stage(common, step, FlashInferOptions(indices="device", prefix="flashinfer_dev"))
        assert step.stats.copies == 1
        assert torch.equal(fi_host.result().paged_kv_indices, fi_dev.result().paged_kv_indices)
        assert fa.result().seq_lens is fi_host.result().kv_lens


def test_common_from_another_step_is_rejected() -> None:
    from attnmeta.backends import cascade, fast_prefill, local_attn

    stager = Stager("cpu")
    with stager.step() as first:
        common = stage_common(MIXED, first)
    stages = [
        lambda step: flashinfer.stage(common, step),
        lambda step: fast_prefill.stage(common, step, None,
                                        fast_prefill.FastPrefillInputs(logits_indices=np.array([0, 1, 5], I32))),
        lambda step: local_attn.stage(common, step, local_attn.LocalAttentionOptions(attn_chunk_size=4)),
        lambda step: cascade.stage(common, step, cascade.CascadeOptions(8, 8, 132),
                                   cascade.CascadeInputs(num_common_prefix_blocks=1)),
    ]
    for stage in stages:
        with pytest.raises(ValueError, match="staged in another step"), stager.step() as step:
            stage(step)


def test_paged_kv_common_is_reused_and_moves_in_the_one_copy(device: torch.device) -> None:
    """With ``stage_common(paged_kv=True)`` the builder stages nothing of its own for a decode batch and
    hands out the common's arrays; the values equal a build without it."""
    spec = _spec([5, 7, 30], [1, 1, 1], [[10, 11, 0, 0, 0, 0, 0, 0], [20, 21, 0, 0, 0, 0, 0, 0],
                                         [1, 2, 3, 4, 5, 6, 7, 8]], 4, num_reqs_padded=4)
    stager = Stager(device)
    for _ in range(4):  # steady state: cached layouts on every slot
        with stager.step() as step:
            common = stage_common(spec, step, paged_kv=True)
            staged = flashinfer.stage(common, step)
        assert step.stats.copies == 1
        assert not any(name.startswith("flashinfer.") for name in step.field_names)
        fi = staged.result()
        plain = flashinfer.build(spec, Stager(device))
        for name in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "kv_lens",
                     "qo_indptr_decode", "qo_indptr_prefill"):
            assert torch.equal(getattr(fi, name), getattr(plain, name)), name
            assert np.array_equal(getattr(fi, name + "_cpu"), getattr(plain, name + "_cpu")), name
        assert fi.paged_kv_indices_cpu.tolist() == [10, 11, 20, 21, 1, 2, 3, 4, 5, 6, 7, 8]
        assert (fi.num_pages, fi.max_kv_len, fi.max_decode_query_len, fi.num_decodes) == (12, 31, 1, 4)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_uniform_spec_decode_steps_replay_and_ragged_ones_are_composed_in_eager_mode(graph: bool) -> None:
    """``require_uniform`` with a threshold of 3 (2 drafts): a step whose every query has the first's length
    (``StepShape.uniform_queries``) is all decode rows and replays its decode layout; a row verifying one
    draft among 3-token rows makes the uniform split put it among the prefills: an eager step of it stages
    the prefill query indptr and is composed (graph mode's fixed indptr replays a padded step of any split)."""
    from attnmeta.testing import check_replay
    from attnmeta.testing.workloads import advance

    table = np.arange(1, 1 + 4 * 12, dtype=np.int32).reshape(4, 12)
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=12, block_size=4)

    def walk(q: list[int]) -> list[BatchSpec]:
        return advance(BatchSpec(num_computed_tokens=[5, 9, 2, 13], num_scheduled_tokens=q, block_table=table,
                                 block_size=4), 6)

    opts = FlashInferOptions(decode_threshold=3, require_uniform=True)
    uniform, ragged = walk([3, 3, 3, 3]), walk([3, 2, 3, 3])
    assert uniform[0].shape.uniform_queries and not ragged[0].shape.uniform_queries
    assert flashinfer.FLASHINFER.replay_key(uniform[0].shape, opts, None) == "decode"

    def stager() -> Stager:
        return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=prof if graph else None)

    assert check_replay("flashinfer", uniform, opts, stager=stager()) >= 3
    ragged_replays = check_replay("flashinfer", ragged, opts, stager=stager())  # (equal to the reference either way)
    if not graph:
        assert ragged_replays == 0
