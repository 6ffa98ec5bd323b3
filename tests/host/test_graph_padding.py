"""CUDA-graph padding values (docs/semantics.md, "Padding values per backend"; checklist 23.7): the replay
values of every builder's padded rows against vLLM's, capture-time fills only where vLLM has them,
Bailing's -1, and the DCP skip and split helpers."""

from __future__ import annotations

import numpy as np
import pytest

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.builder import registry
from attnmeta.graph_padding import CAPTURE_FILLS, CaptureFill, apply_capture_fill, capture_fill
from attnmeta.host.dcp import (
    dcp_context_kv_lens,
    should_skip_dcp_context_attention,
    should_split_fa2_dcp_context_attention,
    split_dcp_context_queries,
)
from attnmeta.host.padding import LAST, REPLAY_PADDING, bailing_state_indices
from attnmeta.kernel_blocks import stage_kernel_block_table
from attnmeta.testing.lab import lab

PROF = StaticProfile(max_num_reqs=6, max_num_tokens=16, max_blocks_per_req=4, block_size=16)
B, BP, T, TP = 3, 5, 3, 5


def _spec() -> BatchSpec:
    """Three decodes padded to 5 rows / 5 tokens (a FULL-graph decode batch)."""
    return BatchSpec(num_computed_tokens=[37, 5, 20], num_scheduled_tokens=[1, 1, 1], num_prompt_tokens=[10, 3, 5],
                     num_draft_tokens=[0, 0, 0], block_table=[[1, 2, 3], [4, 0, 0], [5, 6, 0]], block_size=16,
                     num_reqs_padded=BP, num_tokens_padded=TP)


def _expect(values: list[int], name: str, real: int) -> None:
    v = REPLAY_PADDING[name]
    pad = values[real - 1] if v == LAST else v
    assert values[real:] == [pad] * (len(values) - real), (name, values)


def test_replay_values_of_the_common_metadata_20_1() -> None:
    """Padded rows within the step and rows past it up to the profile's capacity (graph sentinels)."""
    stager = Stager("cpu", profile=PROF)
    with stager.step() as step:
        common = stage_common(spec := _spec(), step)
    cm = common.result()
    _expect(cm.query_start_loc.tolist(), "query_start_loc", B + 1)
    _expect(step.device_full("common.query_start_loc").tolist(), "query_start_loc", B + 1)
    for name, dev_name in (("seq_lens", "seq_lens"), ("block_table_tensor", "block_table_tensor")):
        full = step.device_full("common." + dev_name)
        assert full.shape[0] == PROF.max_num_reqs
        _expect(full.reshape(full.shape[0], -1)[:, 0].tolist(), name, B)
        assert (full[B:] == 0).all()
    _expect(step.device_full("common.slot_mapping").tolist(), "slot_mapping", T)
    _expect(step.device_full("common.positions").tolist(), "positions", T)
    _expect(cm.seq_lens_cpu_upper_bound.tolist(), "seq_lens_cpu_upper_bound", B)
    _expect(cm.is_prefilling.astype(int).tolist(), "is_prefilling", B)
    _expect(cm.num_decode_draft_tokens_cpu.tolist(), "num_decode_draft_tokens", B)
    assert spec.num_reqs == B


def test_replay_values_of_every_builder_20_2() -> None:
    """Every registered builder staged on a padded decode batch: its per-row fields' padding rows hold
    vLLM's replay values (passthrough of the common ones, paged indptr repeating, last_page_len 0, state
    indices 0, local attention's documented ``k = A`` quirk)."""
    spec = _spec()
    seen = set()
    for name, builder in registry().items():
        opts, inputs = lab(builder).defaults(spec)
        opts = builder.options(opts)
        needs = builder.needs(spec.shape, opts)
        with Stager("cpu", profile=PROF).step() as step:
            common = stage_common(spec, step, token_arrays=needs.token_arrays)
            staged = builder.stage(common, step, opts, inputs)
        m = staged.result()
        for field in type(m)._DEVICE_FIELDS:
            v = getattr(m, field, None)
            if v is None or not hasattr(v, "shape") or v.ndim == 0:
                continue
            rows = v.reshape(v.shape[0], -1)[:, 0].tolist() if v.ndim > 1 else v.tolist()
            key = next((k for k in REPLAY_PADDING if field.endswith(k)), None)
            if field in ("query_start_loc", "paged_kv_indptr", "qo_indptr_decode") and len(rows) == BP + 1:
                _expect(rows, "query_start_loc", B + 1)
                seen.add((name, field))
            elif field == "seq_lens" and name == "local_attn":
                assert rows[B:] == [rows[B]] * (BP - B) and rows[B] > 0  # k_v = A for a padding row (quirk)
                seen.add((name, field))
            elif field in ("kv_lens", "seq_lens") or field.startswith("state_indices") or key in (
                    "block_table_tensor", "paged_kv_last_page_len", "slot_mapping"):
                if field.startswith("state_indices") and len(rows) == 0:
                    continue
                if key is None:
                    key = "state_indices" if field.startswith("state_indices") else "seq_lens"
                real = T if key == "slot_mapping" else B
                if len(rows) in (BP, TP):
                    _expect(rows, key, real)
                    seen.add((name, field))
            elif field == "block_table":
                _expect(rows, "block_table_tensor", B)
                seen.add((name, field))
    for must in [("flash_attn", "seq_lens"), ("flash_attn", "block_table"), ("flash_attn", "slot_mapping"),
                 ("flashinfer", "paged_kv_indptr"), ("flashinfer", "paged_kv_last_page_len"),
                 ("linear_attn", "state_indices_tensor"), ("mamba2", "state_indices_tensor_d"),
                 ("mamba1", "state_indices_tensor_d"), ("local_attn", "seq_lens")]:
        assert must in seen, must


def test_kernel_block_table_padding_rows_are_0_to_R_minus_1() -> None:
    with Stager("cpu", profile=PROF).step() as step:
        k4 = stage_kernel_block_table(stage_common(_spec(), step), step, 4)
    bt = k4.result().block_table_tensor
    assert bt[B:].tolist() == [list(range(4)) * PROF.max_blocks_per_req] * (BP - B)


def test_capture_fill_only_where_vllm_fills() -> None:
    assert {n for n, f in CAPTURE_FILLS.items() if f.seq_lens == 1} == {
        "triton_attn", "rocm_attn", "rocm_aiter_unified_attn", "turboquant"}
    assert [n for n, f in CAPTURE_FILLS.items() if f.zero_query_start_loc] == ["rocm_attn"]
    for other in ("flash_attn", "flashinfer", "flashmla", "mamba2", "gdn_attn", "flex_attention"):
        assert capture_fill(other) == CaptureFill()
    with pytest.raises(ValueError, match="seq_lens"):
        CaptureFill(seq_lens=-1)


@pytest.mark.parametrize("backend", ["triton_attn", "rocm_attn", "flash_attn"])
def test_capture_fill_over_the_whole_tensor_and_replay_unchanged(backend: str) -> None:
    stager = Stager("cpu", profile=PROF)
    fill = capture_fill(backend)
    with stager.step() as step:  # the capture step
        common = stage_common(_spec(), step)
        apply_capture_fill(common, fill)
        fa = flash_attn.stage(common, step)
    cap = fa.result()
    if fill.seq_lens is None:
        assert cap.seq_lens.tolist() == [38, 6, 21, 0, 0]
    else:
        assert cap.seq_lens.tolist() == [1] * BP  # real rows too
        assert cap.seq_lens_cpu.tolist() == [1] * BP  # twins stay equal
    qsl = step.device_full("common.query_start_loc").tolist()
    assert qsl == ([0] * (PROF.max_num_reqs + 1) if fill.zero_query_start_loc else [0, 1, 2, 3, 3, 3, 3])
    with stager.step() as step:  # a replay step: the runner's values, padding 0
        common = stage_common(_spec(), step)
    assert common.result().seq_lens.tolist() == [38, 6, 21, 0, 0]
    with pytest.raises(RuntimeError, match="committed"):
        apply_capture_fill(common, fill)


def test_capture_fill_rejects_a_derived_common() -> None:
    with Stager("cpu").step() as step:
        derived = stage_kernel_block_table(stage_common(_spec(), step), step, 4)
        with pytest.raises(TypeError, match="derived"):
            apply_capture_fill(derived, capture_fill("triton_attn"))
        with pytest.raises(TypeError, match="CaptureFill"):
            apply_capture_fill(derived, 1)  # type: ignore[arg-type]


def test_flashinfer_padded_rows_have_no_pages() -> None:
    with Stager("cpu", profile=PROF).step() as step:
        common = stage_common(_spec(), step, paged_kv=True)
        staged = flashinfer.stage(common, step)
    f = staged.result()
    assert f.paged_kv_indptr_cpu.tolist() == [0, 3, 4, 6, 6, 6]
    assert f.paged_kv_last_page_len_cpu.tolist() == [6, 6, 5, 0, 0]


def test_bailing_minus_one() -> None:
    assert bailing_state_indices([4, 9, 7], [12, 0, 3], 5).tolist() == [4, -1, 7, -1, -1]
    out = np.zeros(3, np.int32)
    assert bailing_state_indices([4, 9, 7], [1, 1, 1], 3, out=out) is out and out.tolist() == [4, 9, 7]
    with pytest.raises(ValueError, match="num_reqs_padded"):
        bailing_state_indices([1], [1], 0)


# ------------------------------------------------------------------------------------------------
# 20.3: DCP skip and split
# ------------------------------------------------------------------------------------------------


def test_should_skip_dcp_context_attention_worked() -> None:
    assert should_skip_dcp_context_attention([0, 0, 0]) is True
    assert should_skip_dcp_context_attention([0, 5, 0]) is False
    assert should_skip_dcp_context_attention(np.zeros(0, np.int32)) is True


def test_dcp_context_kv_lens_is_rank_invariant() -> None:
    ctx = dcp_context_kv_lens([0, 1, 2, 6, 14], [9, 12, 20, 8])
    assert ctx.dtype == np.int32 and ctx.tolist() == [8, 11, 16, 0]
    assert should_skip_dcp_context_attention(dcp_context_kv_lens([0, 4, 7], [4, 3])) is True  # fresh prefills


def test_split_dcp_context_queries_worked() -> None:
    r = split_dcp_context_queries([0, 1, 2, 6, 14], [9, 12, 20, 8], 8, 14)
    assert r == (2, 1, 2, 4) and all(type(x) is int for x in r)  # vLLM's last entry is a 0-d tensor
    assert split_dcp_context_queries([0, 1, 2, 3], [5, 6, 7], 1, 3) == (3, 0, 3, 0)
    assert split_dcp_context_queries([0, 1, 5], None, 4, 5) == (0, 2, 0, 5)


def test_should_split_fa2_dcp_context_attention() -> None:
    assert should_split_fa2_dcp_context_attention(2, 8, 2, 1, 1)
    assert should_split_fa2_dcp_context_attention(2, 8, 0, 0, 2)  # prefills without context
    assert not should_split_fa2_dcp_context_attention(3, 8, 2, 1, 1)  # FA3
    assert not should_split_fa2_dcp_context_attention(2, 1, 3, 0, 0)  # decode-only
    assert not should_split_fa2_dcp_context_attention(2, 8, 0, 2, 0)  # extends only
    assert not should_split_fa2_dcp_context_attention(2, 1, 1, 1, 1)  # max_query_len 1: never, whatever the split
