"""The vLLM adapter without vLLM (runs in CI): the pinned fields of vLLM 0.33.0's
``CommonAttentionMetadata``, the adapter's mapping of every one of them, and both directions round
tripped through a stand-in with the same fields, under the sync audit.

tests/integrations/test_vllm_real.py does the same against vLLM's real class (``-m vllm``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnmeta
from attnmeta import BatchSpec, CommonAttentionMetadata, Stager, build_common
from attnmeta.integrations import vllm as adapter
from attnmeta.sync import no_device_sync
from attnmeta.testing.strategies import batch_specs

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
KINDS = ("decode", "spec_decode", "prefill", "chunked_prefill")  # what vLLM schedules: every row has a query


@dataclasses.dataclass
class StandInCommon:
    """vLLM 0.33.0's ``CommonAttentionMetadata`` fields (vllm/v1/attention/backend.py), written out by
    hand: names, order, types and defaults; no methods."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None
    max_logits_per_req: int | None = None
    encoder_seq_lens: torch.Tensor | None = None
    encoder_seq_lens_cpu: np.ndarray | None = None
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu_upper_bound: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    req_idx: np.ndarray | None = None
    mm_req_doc_ranges: dict[int, list[tuple[int, int]]] | None = None
    rswa_prefix_lens: torch.Tensor | None = None
    replayssm_decode_base_cpu: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None
    _token_to_req_indices_cache: torch.Tensor | None = None


def _spec_of(cm: CommonAttentionMetadata, spec: BatchSpec, **kw: object) -> BatchSpec:
    """spec_from_vllm over the stand-in of ``cm``, with what a vLLM caller passes besides."""
    vcm = StandInCommon(**adapter.vllm_common_kwargs(cm))
    optimistic = spec.seq_lens_upper_bound is not None  # (may exceed c + q: async spec decode)
    return adapter.spec_from_vllm(
        vcm, block_table=cm.block_table_cpu, block_size=spec.block_size,
        num_computed_tokens=cm.num_computed_tokens_cpu if optimistic else None,  # exact counts under async spec decode
        num_draft_tokens=spec.num_draft_tokens, context_parallel=spec.context_parallel, **kw,  # type: ignore[arg-type]
    )


def assert_same_common(a: CommonAttentionMetadata, b: CommonAttentionMetadata) -> None:
    """Every field of two common metadata objects equal: dtype, shape, values, scalars."""
    for name, role in a.field_roles().items():
        x, y = getattr(a, name), getattr(b, name)
        if role == "scalar" or x is None or y is None:
            assert x == y, f"{name}: {x!r} != {y!r}"
        elif role == "device":
            assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, f"{name}: {x} vs {y}"
            if x.device.type != "meta":
                assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
        else:
            assert x.dtype == y.dtype and np.array_equal(x, y), f"{name}: {x!r} != {y!r}"


# ------------------------------------------------------------------ the pinned fields and the map


def test_the_pinned_fields_are_vllm_0_33_0s() -> None:
    fields = dataclasses.fields(StandInCommon)
    assert adapter.VLLM_VERSION == "0.33.0"
    assert tuple(f.name for f in fields) == adapter.VLLM_COMMON_FIELDS
    assert {f.name: f.default for f in fields if f.default is not dataclasses.MISSING} == dict(
        adapter.VLLM_COMMON_DEFAULTS)


def test_the_map_covers_exactly_the_pinned_fields() -> None:
    assert tuple(m.vllm for m in adapter.VLLM_FIELD_MAP) == adapter.VLLM_COMMON_FIELDS
    ours = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    for m in adapter.VLLM_FIELD_MAP:
        assert m.role in ("device", "host", "scalar", "input", "memo"), m
        assert (m.source is None) == (m.role in ("input", "memo")), m
        assert m.note, m
        if m.source is not None:
            assert m.source in ours, m
    sources = {m.source for m in adapter.VLLM_FIELD_MAP if m.source is not None}
    assert not sources & set(adapter.ATTNMETA_ONLY_FIELDS)
    assert sources | set(adapter.ATTNMETA_ONLY_FIELDS) == ours, "every attnmeta field is mapped or said unmappable"
    inputs = {m.vllm for m in adapter.VLLM_FIELD_MAP if m.role == "input"}
    assert inputs == adapter.VLLM_INPUT_FIELDS


def test_roles_match_attnmetas_declared_roles() -> None:
    spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[2], block_table=[[7, 8]], block_size=4)
    roles = build_common(spec, Stager("cpu")).field_roles()
    for m in adapter.VLLM_FIELD_MAP:
        if m.source is not None:
            assert roles[m.source] == m.role, m


def test_the_doc_lists_every_field() -> None:
    text = DOC.read_text()
    for name in (*adapter.VLLM_COMMON_FIELDS, *adapter.ATTNMETA_ONLY_FIELDS):
        assert f"| `{name}` |" in text, f"docs/vllm.md: no table row for `{name}`"


def test_importing_the_adapter_never_imports_vllm() -> None:
    code = "import sys, attnmeta.integrations.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ attnmeta -> vLLM


def test_kwargs_build_vllms_fields() -> None:
    spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
                     block_table=[[10, 11], [20, 21], [30, 31]], block_size=4, num_prompt_tokens=[3, 9, 4],
                     num_reqs_padded=4, num_tokens_padded=8)
    cm = build_common(spec, Stager("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read-only host arrays make no warning
        kw = adapter.vllm_common_kwargs(cm, mm_req_doc_ranges={2: [(0, 3)]})
    memos = {m.vllm for m in adapter.VLLM_FIELD_MAP if m.role == "memo"}
    assert list(kw) == [n for n in adapter.VLLM_COMMON_FIELDS if n not in memos]
    vcm = StandInCommon(**kw)
    assert vcm.query_start_loc is cm.query_start_loc and vcm.slot_mapping is cm.slot_mapping
    assert vcm.block_table_tensor is cm.block_table_tensor and vcm.positions is cm.positions
    for name, twin in (("query_start_loc_cpu", "query_start_loc_cpu"), ("is_prefilling", "is_prefilling"),
                       ("seq_lens_cpu_upper_bound", "seq_lens_cpu_upper_bound")):
        t, a = getattr(vcm, name), getattr(cm, twin)
        assert t.device.type == "cpu" and t.data_ptr() == a.ctypes.data, f"{name} shares the host array's memory"
        assert t.tolist() == a.tolist()
    assert vcm.query_start_loc_cpu.dtype == torch.int32 and vcm.is_prefilling.dtype == torch.bool
    assert vcm.is_prefilling.tolist() == [False, True, True, False]
    assert (vcm.num_reqs, vcm.num_actual_tokens, vcm.max_query_len, vcm.max_seq_len, vcm.causal) == (4, 8, 4, 8, True)
    assert vcm.mm_req_doc_ranges == {2: [(0, 3)]}
    assert all(getattr(vcm, n) is None for n in adapter.VLLM_INPUT_FIELDS - {"mm_req_doc_ranges"})


def test_positions_none_without_token_arrays() -> None:
    spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[2], block_table=[[7, 8]], block_size=4)
    with Stager("cpu").step() as step:
        staged = attnmeta.stage_common(spec, step, token_arrays=False)
    kw = adapter.vllm_common_kwargs(staged.result())
    assert kw["positions"] is None and tuple(kw["slot_mapping"].shape) == (0,)


def test_kwargs_reject_bad_inputs() -> None:
    spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[2], block_table=[[7, 8]], block_size=4)
    cm = build_common(spec, Stager("cpu"))
    with pytest.raises(TypeError, match=r"\['seq_lens'\] come from attnmeta's metadata"):
        adapter.vllm_common_kwargs(cm, seq_lens=cm.seq_lens)
    with pytest.raises(TypeError, match=r"\['sliding_window'\] not accepted.*inputs are"):
        adapter.vllm_common_kwargs(cm, sliding_window=4)
    with pytest.raises(TypeError, match=r"expected an attnmeta.CommonAttentionMetadata"):
        adapter.vllm_common_kwargs(StandInCommon(**adapter.vllm_common_kwargs(cm)))  # type: ignore[arg-type]


def test_to_vllm_common_without_vllm_says_how_to_get_it() -> None:
    try:
        import vllm.v1.attention.backends.utils  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is importable here: tests/integrations/test_vllm_real.py covers to_vllm_common")
    spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[2], block_table=[[7, 8]], block_size=4)
    with pytest.raises(ImportError, match=r"install_vllm.sh"):
        adapter.to_vllm_common(build_common(spec, Stager("cpu")))


# ------------------------------------------------------------------ vLLM -> attnmeta, round trips


@given(spec=batch_specs(kinds=KINDS, max_reqs=8, with_context_parallel=st.booleans()))
def test_round_trip_through_vllms_fields(spec: BatchSpec) -> None:
    """attnmeta -> vLLM's fields -> BatchSpec -> attnmeta gives every field back (CPU device)."""
    stager = Stager("cpu")
    cm = build_common(spec, stager)
    with no_device_sync():
        back = _spec_of(cm, spec)
    assert (back.num_reqs, back.padded_num_reqs, back.num_tokens, back.padded_num_tokens) == (
        spec.num_reqs, spec.padded_num_reqs, spec.num_tokens, spec.padded_num_tokens)
    assert back.max_seq_len == spec.max_seq_len
    assert_same_common(build_common(back, stager), cm)


@given(spec=batch_specs(max_reqs=8))
def test_round_trip_with_empty_rows_and_the_real_count(spec: BatchSpec) -> None:
    """attnmeta's zero-length real rows (vLLM has none) come back when the real count is passed."""
    stager = Stager("cpu")
    cm = build_common(spec, stager)
    with no_device_sync():
        back = _spec_of(cm, spec, num_real_reqs=spec.num_reqs)
    assert_same_common(build_common(back, stager), cm)


@given(spec=batch_specs(kinds=KINDS, max_reqs=8, with_upper_bound=st.just(False)))
def test_exact_spec_from_the_upper_bound_alone(spec: BatchSpec) -> None:
    """Without async spec decode, vLLM's host fields alone (no num_computed_tokens) give the spec."""
    cm = build_common(spec, Stager("cpu"))
    vcm = StandInCommon(**adapter.vllm_common_kwargs(cm))
    with no_device_sync():
        back = adapter.spec_from_vllm(vcm, block_table=spec.block_table, block_size=spec.block_size)
    np.testing.assert_array_equal(back.num_computed_tokens, spec.num_computed_tokens)
    np.testing.assert_array_equal(back.num_scheduled_tokens, spec.num_scheduled_tokens)
    assert back.seq_lens_upper_bound is None
    assert (back.padded_num_reqs, back.padded_num_tokens) == (spec.padded_num_reqs, spec.padded_num_tokens)
    assert back.num_prompt_tokens is not None  # (from is_prefilling, which vLLM's fields always have here)
    pre = spec.num_prompt_tokens
    expect = np.zeros(spec.num_reqs, bool) if pre is None else spec.num_computed_tokens < pre
    np.testing.assert_array_equal(back.num_computed_tokens < back.num_prompt_tokens, expect)


@given(spec=batch_specs(kinds=KINDS, max_reqs=6))
def test_both_directions_on_meta_read_no_device_data(spec: BatchSpec) -> None:
    """On the meta device (tensors without data: any read fails) both directions pass the audit."""
    cm = build_common(spec, Stager("meta"))
    with no_device_sync():
        vcm = StandInCommon(**adapter.vllm_common_kwargs(cm))
        back = _spec_of(cm, spec)
    assert vcm.seq_lens.device.type == "meta" and vcm.query_start_loc_cpu.device.type == "cpu"
    np.testing.assert_array_equal(back.num_scheduled_tokens, spec.num_scheduled_tokens)
    assert_same_common(build_common(back, Stager("meta")), cm)


# ------------------------------------------------------------------ spec_from_vllm's errors


def _vcm(**changes: object) -> StandInCommon:
    spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
                     block_size=4, num_reqs_padded=3, num_tokens_padded=6)
    kw = adapter.vllm_common_kwargs(build_common(spec, Stager("meta")))
    kw.update(changes)
    return StandInCommon(**kw)


TABLE = np.array([[1, 2], [3, 4], [0, 0]], np.int32)


def test_padding_is_inferred() -> None:
    spec = adapter.spec_from_vllm(_vcm(), block_table=TABLE, block_size=4)
    assert (spec.num_reqs, spec.num_reqs_padded, spec.num_tokens, spec.num_tokens_padded) == (2, 3, 4, 6)
    assert spec.num_computed_tokens.tolist() == [5, 0]


def test_no_host_block_table_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"block_table: None.*get_numpy_array\(\).*no mode that builds from a device"):
        adapter.spec_from_vllm(_vcm(), block_size=4)
    vcm = _vcm()
    with no_device_sync(), pytest.raises(TypeError, match=r"block_table: a meta tensor.*never reads"):
        adapter.spec_from_vllm(vcm, block_table=vcm.block_table_tensor, block_size=4)
    cpu_table = torch.from_numpy(TABLE)  # a CPU tensor is host memory: fine
    assert adapter.spec_from_vllm(vcm, block_table=cpu_table, block_size=4).num_reqs == 2


def test_device_host_fields_are_refused_unread() -> None:
    vcm = _vcm()
    bad = _vcm(query_start_loc_cpu=vcm.query_start_loc)  # a meta tensor where a host one belongs
    with no_device_sync(), pytest.raises(TypeError, match=r"cm.query_start_loc_cpu: a meta tensor"):
        adapter.spec_from_vllm(bad, block_table=TABLE, block_size=4)
    with no_device_sync(), pytest.raises(TypeError, match="num_computed_tokens: a meta tensor"):
        adapter.spec_from_vllm(vcm, block_table=TABLE, block_size=4, num_computed_tokens=vcm.seq_lens)


def test_lengths_only_on_the_device_need_the_host_counts() -> None:
    vcm = _vcm(seq_lens_cpu_upper_bound=None)
    with pytest.raises(ValueError, match=r"num_computed_tokens: required when cm.seq_lens_cpu_upper_bound is None"):
        adapter.spec_from_vllm(vcm, block_table=TABLE, block_size=4)
    spec = adapter.spec_from_vllm(vcm, block_table=TABLE, block_size=4, num_computed_tokens=[5, 0, 9])
    assert spec.num_computed_tokens.tolist() == [5, 0] and spec.num_reqs_padded == 3


def test_broken_vllm_fields_are_named() -> None:
    with pytest.raises(ValueError, match=r"cm.query_start_loc_cpu decreases at row 1"):
        adapter.spec_from_vllm(_vcm(query_start_loc_cpu=torch.tensor([0, 1, 0, 0], dtype=torch.int32)),
                               block_table=TABLE, block_size=4)
    with pytest.raises(ValueError, match=r"cm.query_start_loc_cpu\[-1\]=9 > cm.num_actual_tokens=6"):
        adapter.spec_from_vllm(_vcm(query_start_loc_cpu=torch.tensor([0, 1, 9, 9], dtype=torch.int32)),
                               block_table=TABLE, block_size=4)
    with pytest.raises(ValueError, match=r"cm.query_start_loc_cpu: expected length 5"):
        adapter.spec_from_vllm(_vcm(num_reqs=4), block_table=TABLE, block_size=4)
    with pytest.raises(ValueError, match=r"padding row 1 \(>= num_real_reqs=1\) has 3 query tokens"):
        adapter.spec_from_vllm(_vcm(), block_table=TABLE, block_size=4, num_real_reqs=1)
    with pytest.raises(ValueError, match=r"spec_from_vllm: .*block_table: row 0 needs .* \(vLLM batch: num_reqs=3"):
        adapter.spec_from_vllm(_vcm(), block_table=TABLE[:, :1], block_size=4)
    with pytest.raises(TypeError, match=r"expected a vLLM CommonAttentionMetadata"):
        adapter.spec_from_vllm(object(), block_table=TABLE, block_size=4)


def test_only_the_real_rows_of_the_runners_table_are_read() -> None:
    """The whole persistent table was converted and range-checked every step: a stale id past int32 in a
    padding row was refused, and an int64 or strided table was copied whole (seconds for vLLM's
    largest tables)."""
    stale = np.array([[1, 2], [3, 4], [2**40, 0]], np.int64)  # row 2: padding, stale
    spec = adapter.spec_from_vllm(_vcm(), block_table=stale, block_size=4)
    assert spec.block_table.tolist() == [[1, 2], [3, 4]] and spec.block_table.dtype == np.int32
    wide = torch.zeros(3, 64, dtype=torch.int32)
    wide[:2, :2] = torch.from_numpy(TABLE[:2])
    view = wide[:, :32]  # (a column slice: not contiguous)
    assert adapter.spec_from_vllm(_vcm(), block_table=view, block_size=4).block_table.shape == (2, 32)


def test_the_counts_must_be_host_ints() -> None:
    """``int()`` made 1.9 a 1 and "1" a 1, and read a 0-d device tensor (a sync on CUDA)."""
    for field, bad in (("num_reqs", 1.9), ("num_reqs", "3"), ("num_actual_tokens", None),
                       ("num_actual_tokens", torch.tensor(6, device="meta"))):
        with no_device_sync(), pytest.raises(TypeError, match=rf"cm.{field}: expected a host int, got"):
            adapter.spec_from_vllm(_vcm(**{field: bad}), block_table=TABLE, block_size=4)
    assert adapter.spec_from_vllm(_vcm(num_reqs=np.int64(3)), block_table=TABLE, block_size=4).num_reqs == 2
