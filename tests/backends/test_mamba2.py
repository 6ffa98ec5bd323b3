"""Mamba2 / Mamba1 / linear-attention metadata (docs/semantics-mamba.md) against vLLM-style device references.

The reference (:func:`attnmeta.testing.reference.ref_mamba_metadata`, the builders' lab reference)
rebuilds every field the way vLLM 0.33.0's builder does: host classification and split on CPU
tensors, state indices gathered from the *device* block table with the *device* ``seq_lens``,
``has_initial_states_p`` and ``query_start_loc_p`` computed on the device, the chunk layout by the
per-request loop, the causal-conv1d metadata and the checkpoints by their reference loops. attnmeta's
host path must equal it bit for bit (values, dtypes, shapes, None).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import flash_attn
from attnmeta.backends.mamba import (
    LinearAttentionOptions,
    Mamba1Options,
    Mamba2Inputs,
    Mamba2Metadata,
    Mamba2Options,
    MambaMetadata,
    block_table_columns,
    linear_attn,
    mamba1,
    mamba2,
)
from attnmeta.backends.mamba import _fill as mamba_fill
from attnmeta.builder import UnsupportedBatchError
from attnmeta.builder import build as generic_build
from attnmeta.host.mamba import CheckpointConfig, classify_mamba_rows
from attnmeta.host.split import split_decodes_and_prefills
from attnmeta.staging import CapacityError
from attnmeta.sync import no_device_sync
from attnmeta.testing import check_metadata
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.builders import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.reference import (
    ref_linear_attn_metadata,
    ref_mamba_metadata,
    ref_query_start_loc,
    ref_split_decodes_and_prefills,
)
from attnmeta.testing.strategies import PrefillCheckpointCase, batch_specs, prefill_checkpoint_cases

I32 = np.int32
_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device | str) -> Stager:
    key = str(device)
    if key not in _STAGERS:
        _STAGERS[key] = Stager(device)
    return _STAGERS[key]


def _spec(c: list[int], q: list[int], prompt: list[int] | None = None, *, bs: int = 16, width: int | None = None,
          **kw: Any) -> BatchSpec:
    """Rows ``c``/``q``; request r's blocks are ``r * 100 + [0, 1, ...]`` (``width`` columns)."""
    n = len(c)
    w = width or max(1, max((ci + qi + bs - 1) // bs for ci, qi in zip(c, q))) if n else 1
    table = (np.arange(n, dtype=I32)[:, None] * 100 + np.arange(w, dtype=I32)[None, :]).astype(I32)
    return BatchSpec(num_computed_tokens=np.array(c, I32), num_scheduled_tokens=np.array(q, I32),
                     num_prompt_tokens=None if prompt is None else np.array(prompt, I32),
                     block_table=table, block_size=bs, **kw)


# ------------------------------------------------------------------------------------------------
# the vLLM-style reference
# ------------------------------------------------------------------------------------------------


def _vllm_reference(
    spec: BatchSpec, options: Any, accepted: np.ndarray | None, device: torch.device
) -> dict[str, Any]:
    """Every Mamba2 field as vLLM 0.33.0 computes it, from device tensors (syncs and all)."""
    return ref_mamba_metadata(spec, options, device, num_accepted_tokens=accepted)


def _same(actual: torch.Tensor | None, expected: torch.Tensor | None, name: str) -> None:
    """Device field vs reference tensor: both None, or equal dtype, shape and values."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{name}: {actual!r} vs reference {expected!r}"
        return
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual.cpu(), expected.cpu()), f"{name}: {actual.cpu()} != {expected.cpu()}"


_DEVICE_COMPARED = (
    "state_indices_tensor_d", "state_indices_tensor_p", "seq_lens", "query_start_loc_d", "num_accepted_tokens",
    "has_initial_states_p", "query_start_loc_p", "batch_ptr", "token_chunk_offset_ptr", "cu_chunk_seqlen_p",
    "seq_idx_p", "last_chunk_indices_p", "checkpoint_chunk_idx", "chunk_indices_p", "chunk_offsets_p",
    "token_seq_idx_p",
)


def _check_against_reference(m: Mamba2Metadata, ref: dict[str, Any]) -> None:
    for name in ("num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens", "num_reqs",
                 "prep_initial_states", "chunk_size"):
        assert getattr(m, name) == ref[name], f"{name}: {getattr(m, name)} != {ref[name]}"
    for name in _DEVICE_COMPARED:
        _same(getattr(m, name), ref[name], name)
        host = getattr(m, name + "_cpu")
        assert_matches_device(host, ref[name], name + "_cpu")
    if ref["conv1d_nums_cpu"] is None:
        assert m.nums_dict is None and m.conv1d_nums_cpu is None and m.conv1d_num_programs_total == 0
    else:
        assert_matches_device(m.conv1d_nums_cpu, ref["conv1d_nums_cpu"], "nums")
        assert_matches_device(m.conv1d_mlist_cpu, ref["conv1d_mlist_cpu"], "mlist")
        assert_matches_device(m.conv1d_offsetlist_cpu, ref["conv1d_offsetlist_cpu"], "offsetlist")
        assert m.conv1d_num_programs_total == ref["conv1d_num_programs_total"]
        assert m.conv1d_max_num_programs == ref["conv1d_max_num_programs"]
        assert m.nums_dict is not None and m.nums_dict[8]["tot"] == ref["conv1d_num_programs_total"]
        assert m.nums_dict[8]["batch_ptr"] is m.batch_ptr
    ck = ref["checkpoint_meta"]
    if ck is None:
        assert m.checkpoint_meta is None
    else:
        meta = m.checkpoint_meta
        assert meta is not None
        for name in ("offsets", "cols", "state_indices"):
            _same(getattr(meta, name), ck[name], "checkpoint." + name)
            assert_matches_device(getattr(meta, name + "_cpu"), ck[name], "checkpoint." + name + "_cpu")
        assert meta.first_row == m.num_reqs - m.num_prefills == ck["first_row"]
    assert m.num_chunks == (0 if ref["seq_idx_p"] is None else ref["seq_idx_p"].shape[0]) == ref["num_chunks"]


# ------------------------------------------------------------------------------------------------
# the worked examples of docs/semantics-mamba.md ("The chunk-aligned layout"), through the backend
# ------------------------------------------------------------------------------------------------


def _build(spec: BatchSpec, options: Mamba2Options, device: torch.device | str = "cpu",
           accepted: np.ndarray | None = None) -> Mamba2Metadata:
    with no_device_sync(devices={torch.device(device).type}):
        m = mamba2.build(spec, _stager(device), options, Mamba2Inputs(num_accepted_tokens=accepted))
    _check_against_reference(m, _vllm_reference(spec, options, accepted, torch.device(device)))
    if not currently_in_test_context():
        return m
    # what the example exercised (hypothesis --hypothesis-show-statistics)
    event(f"prefills: {'0' if m.num_prefills == 0 else '1-8' if m.num_prefills <= 8 else '>8'}")
    if m.checkpoint_meta is not None:
        event("checkpoint")
    if m.query_start_loc_d is not None:
        event("spec decode with decodes")
    if m.cu_chunk_seqlen_p_cpu is not None and (np.diff(m.cu_chunk_seqlen_p_cpu) == 0).any():
        event("zero-length chunk")
    if m.last_chunk_indices_p_cpu is not None and m.last_chunk_indices_p_cpu[0] == -1:
        event("last_chunk_indices -1")
    return m


def _chunks(m: Mamba2Metadata) -> tuple[list[int], list[int], list[int]]:
    assert m.cu_chunk_seqlen_p_cpu is not None and m.seq_idx_p_cpu is not None
    assert m.last_chunk_indices_p_cpu is not None
    return m.cu_chunk_seqlen_p_cpu.tolist(), m.seq_idx_p_cpu.tolist(), m.last_chunk_indices_p_cpu.tolist()


def test_table_65_realigning_chunk(device: torch.device) -> None:
    # A decode first (its token is subtracted from query_start_loc_p), then c=[5,0], q=[10,3], C=8.
    m = _build(_spec([30, 5, 0], [1, 10, 3], [10, 40, 3]), Mamba2Options(chunk_size=8), device)
    assert (m.num_decodes, m.num_prefills, m.num_decode_tokens) == (1, 2, 1)
    assert m.query_start_loc_p_cpu is not None and m.query_start_loc_p_cpu.tolist() == [0, 10, 13]
    assert _chunks(m) == ([0, 3, 10, 13], [0, 0, 1], [1, 2])
    assert m.checkpoint_chunk_idx is None


def test_table_65_zero_token_rows(device: torch.device) -> None:
    # Two zero-token prompt rows, aligned (c=0) and unaligned (c=3): one zero-length chunk, last=[-1, 0].
    m = _build(_spec([0, 3], [0, 0], [5, 9]), Mamba2Options(chunk_size=8), device)
    assert (m.num_decodes, m.num_prefills) == (0, 2)
    assert _chunks(m) == ([0, 0], [1], [-1, 0])
    assert m.has_initial_states_p_cpu is not None and m.has_initial_states_p_cpu.tolist() == [False, True]


CKPT_CFG = CheckpointConfig(hash_block_size=2, cache_hit_alignment_tokens=4, mamba_block_size=4,
                            checkpoint_alignment=2, drop_eagle_block=True)


def test_table_65_checkpoint(device: torch.device) -> None:
    # c=2, q=9, C=4: the config puts the checkpoint at position 4 (offset 2): segments [2,4) and [4,11).
    opts = Mamba2Options(chunk_size=4, mamba_block_size=4, cache_mode="align", checkpoint=CKPT_CFG)
    m = _build(_spec([2], [9], [20], bs=4, width=4), opts, device)
    assert _chunks(m) == ([0, 2, 6, 9], [0, 0, 0], [2])
    assert m.checkpoint_chunk_idx_cpu is not None and m.checkpoint_chunk_idx_cpu.tolist() == [0]
    ck = m.checkpoint_meta
    assert ck is not None
    # column cdiv(11, 4) - 2 = 1 of request 0's blocks [0, 1, 2, 3]
    assert (ck.offsets_cpu.tolist(), ck.cols_cpu.tolist(), ck.state_indices_cpu.tolist()) == ([2], [1], [1])
    assert ck.query_lens_cpu.tolist() == [9] and ck.first_row == 0


def test_table_65_aligned_upstream_case(device: torch.device) -> None:
    opts = Mamba2Options(chunk_size=256)
    m = _build(_spec([0, 256, 512], [256, 512, 256], [256, 2000, 2000]), opts, device)
    assert _chunks(m) == ([0, 256, 512, 768, 1024], [0, 1, 1, 2], [0, 2, 3])
    assert m.has_initial_states_p_cpu is not None and m.has_initial_states_p_cpu.tolist() == [False, True, True]


def test_table_65_no_prefills(device: torch.device) -> None:
    # P = 0: vLLM computes no chunk metadata (the host layout would be cu=[0]); every prefill field is None.
    m = _build(_spec([7, 9], [1, 1], [3, 3]), Mamba2Options(chunk_size=8, logical_chunks=True, token_seq_idx=True),
               device)
    assert (m.num_decodes, m.num_prefills, m.num_chunks, m.prep_initial_states) == (2, 0, 0, False)
    for name in ("cu_chunk_seqlen_p", "seq_idx_p", "last_chunk_indices_p", "query_start_loc_p",
                 "has_initial_states_p", "batch_ptr", "chunk_indices_p", "token_seq_idx_p"):
        assert getattr(m, name) is None, name
    assert m.state_indices_tensor_p.shape == (0,)  # split from one gather: empty, not None
    assert m.state_indices_tensor_d_cpu.tolist() == [[0], [100]]


# ------------------------------------------------------------------------------------------------
# section-13 corner cases
# ------------------------------------------------------------------------------------------------


def test_padding_rows_at_the_end_with_token_padding(device: torch.device) -> None:
    spec = _spec([37, 77, 0], [1, 40, 33], [20, 300, 33], num_reqs_padded=6, num_tokens_padded=96)
    m = _build(spec, Mamba2Options(chunk_size=16, token_seq_idx=True, logical_chunks=True), device)
    # the padding rows follow the first prefill: they are prefills (zero-token, aligned: no chunk)
    assert (m.num_decodes, m.num_prefills, m.num_decode_tokens, m.num_prefill_tokens) == (1, 5, 1, 95)
    assert m.query_start_loc_p_cpu is not None and m.query_start_loc_p_cpu.tolist() == [0, 40, 73, 73, 73, 73]
    assert _chunks(m)[2] == [3, 6, 6, 6, 6]
    assert m.state_indices_tensor_p_cpu.tolist() == [100, 200, 0, 0, 0]
    assert m.token_seq_idx_p_cpu is not None
    assert m.token_seq_idx_p_cpu[73:].tolist() == [-1] * 22 and m.token_seq_idx_p_cpu[39:41].tolist() == [0, 1]


@pytest.mark.parametrize(("rem", "cu"), [(0, [0, 8, 16, 20]), (1, [0, 7, 15, 20]), (7, [0, 1, 9, 17, 20])])
def test_context_mod_chunk_size(device: torch.device, rem: int, cu: list[int]) -> None:
    # c = 3C + rem, 20 new tokens, C = 8: a realigning chunk of C - rem tokens unless rem == 0
    m = _build(_spec([24 + rem], [20], [100]), Mamba2Options(chunk_size=8), device)
    assert _chunks(m)[0] == cu


def test_query_smaller_than_the_realignment_gap(device: torch.device) -> None:
    # c=5, C=8: 3 tokens to realign, but only 2 scheduled -> one 2-token chunk; the next row aligned.
    m = _build(_spec([5, 16], [2, 9], [50, 50]), Mamba2Options(chunk_size=8), device)
    assert _chunks(m) == ([0, 2, 10, 11], [0, 1, 1], [0, 2])


def test_uniform_spec_batch_with_padding(device: torch.device) -> None:
    # 3 spec-decode rows of 1 + 2 tokens, padded to 5 rows / 12 tokens: every row decodes (D == B).
    spec = _spec([9, 17, 33], [3, 3, 3], [4, 4, 4], num_reqs_padded=5, num_tokens_padded=12,
                 num_draft_tokens=np.array([2, 2, 2], I32), width=8)
    opts = Mamba2Options(chunk_size=8, cache_mode="align", mamba_block_size=16, num_speculative_tokens=2)
    m = _build(spec, opts, device, accepted=np.array([3, 1, 2], I32))
    assert (m.num_decodes, m.num_prefills, m.num_decode_tokens) == (5, 0, 12)
    assert m.query_start_loc_d_cpu is not None and m.query_start_loc_d_cpu.tolist() == [0, 3, 6, 9, 9, 9]
    assert m.num_accepted_tokens_cpu is not None and m.num_accepted_tokens_cpu.tolist() == [3, 1, 2, 1, 1]
    # align: s = 12, 20, 36 -> start 0, 1, 2; padding rows read column 0 of a zero row
    assert m.state_indices_tensor_d_cpu.tolist() == [[0, 1, 2], [101, 102, 103], [202, 203, 204], [0, 0, 0],
                                                     [0, 0, 0]]
    m2 = _build(spec, opts, device)  # no counts: diff(query_start_loc_d), 0 for the padding rows (vLLM)
    assert m2.num_accepted_tokens_cpu is not None and m2.num_accepted_tokens_cpu.tolist() == [3, 3, 3, 0, 0]


def test_short_extends_and_one_token_stateful_prefills_move_to_decode(device: torch.device) -> None:
    # rows: decode; one-token prompt chunk with state (moves); draft-padded prompt tail q == d + 1
    # (moves under spec decode); a short extend q=2 <= thr that is still prefilling (prefill: the
    # split does not treat short extends as decodes); a fresh prefill.
    spec = _spec([20, 6, 8, 5, 0], [1, 1, 3, 2, 4], [10, 30, 30, 30, 4],
                 num_draft_tokens=np.array([0, 0, 2, 0, 0], I32))
    m = _build(spec, Mamba2Options(chunk_size=8, num_speculative_tokens=2), device)
    assert (m.num_decodes, m.num_prefills, m.num_decode_tokens, m.num_prefill_tokens) == (3, 2, 5, 6)
    assert m.num_accepted_tokens_cpu is not None and m.num_accepted_tokens_cpu.tolist() == [1, 1, 3]
    # without spec decode the draft-padded tail stays a prefill (thr 1, drafts ignored)
    m1 = _build(spec, Mamba2Options(chunk_size=8), device)
    assert (m1.num_decodes, m1.num_prefills) == (2, 3)
    one = mamba1.build(spec, _stager(device))
    assert (one.num_decodes, one.num_prefills) == (2, 3)
    la = linear_attn.build(spec, _stager(device))  # no moves, short extends are decodes: split at q > 1
    assert (la.num_decodes, la.num_prefills) == (2, 3)


def test_max_query_len_one(device: torch.device) -> None:
    # All q == 1: rows still prefilling without prior state stay prefills (vLLM skips the shortcut).
    spec = _spec([4, 0, 3], [1, 1, 1], [2, 1, 9])
    m = _build(spec, Mamba2Options(chunk_size=8), device)
    # row 1: first prompt token (no state) -> prefill; row 2 has state and q == 1 -> moved, but it
    # comes after the first prefill so it is a prefill row anyway
    assert (m.num_decodes, m.num_prefills) == (1, 2)
    la = linear_attn.build(spec, _stager(device))
    assert (la.num_decodes, la.num_prefills, la.num_decode_tokens) == (3, 0, 3)


def test_table_too_narrow_names_the_fix() -> None:
    spec = _spec([9], [3], [1], bs=4, width=3)
    opts = Mamba2Options(cache_mode="align", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="block_table_columns"), Stager("cpu").step() as step:
        mamba2.stage(stage_common(spec, step), step, opts)
    m = mamba2.build(spec, Stager("cpu"), opts)  # build stages the columns it needs (zero-filled past the spec)
    assert m.state_indices_tensor_d_cpu.tolist() == [[2, 0, 0]]


def test_bad_options_fail_fast() -> None:
    spec = _spec([3], [4], [9])
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(chunk_size=0), "chunk_size"),
        (dict(cache_mode="all"), "cache_mode"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(checkpoint=CKPT_CFG), "cache_mode='align'"),
        (dict(cache_mode="align", checkpoint=CKPT_CFG, mamba_block_size=8), "mamba_block_size"),
    ]
    for kwargs, msg in cases:  # options validate when constructed
        with pytest.raises(ValueError, match=msg):
            mamba2.build(spec, Stager("cpu"), Mamba2Options(**kwargs))
    with pytest.raises(ValueError, match="spec decode is off"):
        mamba2.build(spec, Stager("cpu"), Mamba2Options(), Mamba2Inputs(num_accepted_tokens=np.array([1], I32)))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        mamba2.build(spec, Stager("cpu"), Mamba2Options(num_speculative_tokens=1),
                     Mamba2Inputs(num_accepted_tokens=np.array([1, 1, 1], I32)))
    # a row verifying more drafts than k: refused (it ran as a prefill, its drafts taken as accepted)
    drafted = BatchSpec(num_computed_tokens=[9, 9], num_scheduled_tokens=[2, 3], num_prompt_tokens=[4, 4],
                        num_draft_tokens=[1, 2], block_table=[[1, 2, 3], [4, 5, 6]], block_size=4)
    with pytest.raises(UnsupportedBatchError, match=r"num_draft_tokens\[1\]=2 > Mamba2Options.num_speculative_tokens=1"):
        mamba2.build(drafted, Stager("cpu"), Mamba2Options(chunk_size=4, num_speculative_tokens=1))
    with pytest.raises(ValueError, match=r"num_draft_tokens\[1\]=2 > .*at most k drafts"), Stager("cpu").step() as step:
        mamba2.stage(stage_common(drafted, step), step, Mamba2Options(chunk_size=4, num_speculative_tokens=1))
    assert mamba2.build(drafted, Stager("cpu"), Mamba2Options(chunk_size=4, num_speculative_tokens=2)).num_decodes == 2
    # the same checks in stage() itself (the generic build lists them as unsupported reasons first)
    with pytest.raises(ValueError, match="spec decode is off"), Stager("cpu").step() as step:
        mamba2.stage(stage_common(spec, step), step, Mamba2Options(), Mamba2Inputs(num_accepted_tokens=np.array([1], I32)))
    # a wrong type is a TypeError naming the option; a checkpoint's block size is checked against the
    # common block size when the options leave the mamba block size unset
    with pytest.raises(TypeError, match=r"Mamba2Options\.chunk_size"):
        Mamba2Options(chunk_size="8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Mamba2Options\.checkpoint"):
        Mamba2Options(cache_mode="align", checkpoint=(1, 2, 3, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mamba_block_size"):
        mamba2.build(_spec([3], [4], [9], bs=16), Stager("cpu"), Mamba2Options(cache_mode="align", checkpoint=CKPT_CFG))


def test_host_views_are_read_only_and_repr_shows_no_values() -> None:
    spec = _spec([30, 5, 0], [1, 10, 3], [10, 40, 3])
    m = mamba2.build(spec, Stager("cpu"), Mamba2Options(chunk_size=8, logical_chunks=True))
    for name in m._HOST_FIELDS:
        v = getattr(m, name)
        if v is not None:
            assert not v.flags.writeable, name
    r = repr(m)
    assert "cu_chunk_seqlen_p=(4,) int32 cpu" in r and "[0, 3" not in r
    assert "cu_chunk_seqlen_p_cpu" in m.describe()
    assert isinstance(m, MambaMetadata) and m.write_pos_d is None


# ------------------------------------------------------------------------------------------------
# hypothesis: every field equals the vLLM-style device reference
# ------------------------------------------------------------------------------------------------

_CHUNK_SIZES = st.sampled_from([8, 64, 256, 2048])


@st.composite
def _checkpoint_configs(draw: st.DrawFn, bs_m: int) -> CheckpointConfig:
    hb = draw(st.sampled_from([d for d in (1, 2, 4, 16) if bs_m % d == 0]))
    return CheckpointConfig(
        hash_block_size=hb, cache_hit_alignment_tokens=hb * draw(st.sampled_from([1, 2])), mamba_block_size=bs_m,
        checkpoint_alignment=draw(st.sampled_from([None, 1, hb])), num_hash_lookahead_tokens=draw(st.integers(0, 3)),
        drop_eagle_block=draw(st.booleans()),
    )


@st.composite
def _options(draw: st.DrawFn, block_size: int) -> Mamba2Options:
    align = draw(st.booleans())
    # align mode: a mamba block of at least the block size (smaller ones are refused)
    bs_m = draw(st.sampled_from([block_size, max(4, block_size), max(16, block_size), 2 * block_size]))
    ckpt = draw(st.one_of(st.none(), _checkpoint_configs(bs_m))) if align else None
    consecutive = draw(st.booleans())
    return Mamba2Options(
        chunk_size=draw(_CHUNK_SIZES), mamba_block_size=bs_m, cache_mode="align" if align else "none",
        num_speculative_tokens=draw(st.integers(0, 3)), checkpoint=ckpt,
        needs_causal_conv1d_metadata=draw(st.booleans()), logical_chunks=draw(st.booleans()),
        token_seq_idx=draw(st.booleans()), consecutive_seq_ids=consecutive,
    )


def _draw_accepted(spec: BatchSpec, opts: Any, data: st.DataObject) -> np.ndarray | None:
    """Spec decode: sometimes ``num_accepted_tokens`` (one per real request or per row), else None."""
    if opts.num_speculative_tokens and data.draw(st.booleans()):
        rows = data.draw(st.sampled_from([spec.num_reqs, spec.padded_num_reqs]))
        k = opts.num_speculative_tokens  # a decode row's count lies in [1, 1 + k]
        return np.array(data.draw(st.lists(st.integers(1, 1 + k), min_size=rows, max_size=rows)), I32)
    return None


def _covering_drafts(spec: BatchSpec, opts: Mamba2Options) -> Mamba2Options:
    """``opts`` with spec decode's ``k`` raised to the batch's most drafts: vLLM's runner never schedules
    a row with more drafts than k (attnmeta refuses one: test_bad_options_fail_fast)."""
    d = spec.num_draft_tokens
    if not opts.num_speculative_tokens or d is None or not d.size:
        return opts
    return dataclasses.replace(opts, num_speculative_tokens=max(opts.num_speculative_tokens, int(d.max())))


@given(spec=batch_specs(max_reqs=10, max_query_len=40, max_context_len=300, long_prefills=True,
                        max_long_prefill_len=600), data=st.data())
def test_random_batches_match_the_vllm_reference(device: torch.device, spec: BatchSpec, data: st.DataObject) -> None:
    opts = _covering_drafts(spec, data.draw(_options(spec.block_size)))
    _build(spec, opts, device, _draw_accepted(spec, opts, data))


@st.composite
def _prefill_batches(draw: st.DrawFn) -> tuple[BatchSpec, Mamba2Options]:
    """Engine-ordered batches (decodes, then prefills) with 0-128 prefill rows whose contexts are
    multiples of C, a multiple plus 1 or C-1, or random, plus zero-token rows and padding."""
    C = draw(_CHUNK_SIZES)
    bs = draw(st.sampled_from([4, 16]))
    decodes = draw(st.lists(st.integers(1, 3 * C), max_size=8))
    ctx = st.tuples(st.integers(0, 3), st.sampled_from([0, 1, C - 1, -1]), st.integers(0, C - 1)).map(
        lambda t: t[0] * C + (t[2] if t[1] == -1 else t[1]))
    prefills = draw(st.lists(st.tuples(ctx, st.integers(0, 3 * C if C <= 64 else C // 2)), max_size=128))
    c = decodes + [p[0] for p in prefills]
    q = [1] * len(decodes) + [p[1] for p in prefills]
    prompt = [max(1, x // 2) for x in decodes] + [p[0] + p[1] + 1 for p in prefills]
    n = len(c)
    pad_rows, pad_tokens = draw(st.integers(0, 3)), draw(st.integers(0, 9))
    w = max([(ci + qi + bs - 1) // bs for ci, qi in zip(c, q)], default=1) + 2
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spec = BatchSpec(
        num_computed_tokens=np.array(c, I32), num_scheduled_tokens=np.array(q, I32),
        num_prompt_tokens=np.array(prompt, I32), block_table=rng.integers(0, 10_000, (n, max(w, 1)), dtype=I32),
        block_size=bs, num_reqs_padded=n + pad_rows, num_tokens_padded=sum(q) + pad_tokens,
    )
    align = draw(st.booleans())
    ckpt = draw(st.one_of(st.none(), _checkpoint_configs(bs))) if align else None
    opts = Mamba2Options(chunk_size=C, cache_mode="align" if align else "none", checkpoint=ckpt,
                         logical_chunks=draw(st.booleans()), token_seq_idx=draw(st.booleans()))
    return spec, opts


@given(case=_prefill_batches())
@example(case=(_spec([0, 3, 5, 7], [0, 0, 2, 0], [1, 9, 9, 9], bs=4), Mamba2Options(chunk_size=8)))
def test_prefill_layouts_match_the_vllm_reference(device: torch.device, case: tuple[BatchSpec, Mamba2Options]) -> None:
    _build(*case, device)


@given(case=prefill_checkpoint_cases(max_prefills=16), chunk_size=st.sampled_from([4, 8, 64]), decode=st.booleans())
def test_checkpoint_batches_match_the_vllm_reference(
    device: torch.device, case: PrefillCheckpointCase, chunk_size: int, decode: bool
) -> None:
    """Batches whose prefill rows often have a valid checkpoint, optionally after a decode row."""
    s, q = case.seq_lens_upper_bound_p, case.query_lens_p
    c, prompt = s - q, s + 1  # every row is still prefilling
    bs = case.config.mamba_block_size
    table = np.zeros((s.shape[0], max(case.block_table_p.shape[1], -(-8 // bs))), I32)
    table[:, : case.block_table_p.shape[1]] = case.block_table_p
    if decode:  # a decode row first (7 cached tokens, one new one, prompt done)
        c, q, prompt = (np.concatenate([[x], y]) for x, y in ((7, c), (1, q), (1, prompt)))
        table = np.concatenate([np.full((1, table.shape[1]), 9, I32), table])
    spec = BatchSpec(num_computed_tokens=c.astype(I32), num_scheduled_tokens=q.astype(I32),
                     num_prompt_tokens=prompt.astype(I32), block_table=table, block_size=bs)
    _build(spec, Mamba2Options(chunk_size=chunk_size, cache_mode="align", checkpoint=case.config), device)


# ------------------------------------------------------------------------------------------------
# Mamba1 and linear attention: the shared code, checked against the same reference
# ------------------------------------------------------------------------------------------------


@given(spec=batch_specs(max_reqs=8, max_query_len=24, max_context_len=200), align=st.booleans())
def test_mamba1_and_linear_attn_match_the_reference(device: torch.device, spec: BatchSpec, align: bool) -> None:
    mode = "align" if align else "none"
    with no_device_sync(devices={device.type}):
        m1 = mamba1.build(spec, _stager(device), Mamba1Options(cache_mode=mode))
        la = linear_attn.build(spec, _stager(device), LinearAttentionOptions(cache_mode=mode))
    # Mamba1 = the Mamba2 reference with thr 1, no spec decode, no chunk fields
    ref = _vllm_reference(spec, Mamba2Options(cache_mode=mode), None, device)
    for name in ("num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens", "num_reqs"):
        assert getattr(m1, name) == ref[name], name
    for name in ("state_indices_tensor_d", "state_indices_tensor_p", "seq_lens", "has_initial_states_p",
                 "query_start_loc_p", "batch_ptr", "token_chunk_offset_ptr"):
        _same(getattr(m1, name), ref[name], name)
        assert_matches_device(getattr(m1, name + "_cpu"), ref[name], name + "_cpu")
    assert m1.query_start_loc_d is None and m1.num_accepted_tokens is None
    assert not hasattr(m1, "cu_chunk_seqlen_p")
    # linear attention: plain split at threshold 1, column 0 of the state indices of every row
    B = spec.padded_num_reqs
    qsl = ref_query_start_loc(torch.from_numpy(spec.num_scheduled_tokens.copy()).to(device), B)
    split = ref_split_decodes_and_prefills(qsl.cpu(), spec.padded_num_tokens, spec.max_query_len, 1)
    assert (la.num_decodes, la.num_prefills, la.num_decode_tokens, la.num_prefill_tokens) == split
    _same(la.state_indices_tensor, torch.cat([ref["state_indices_tensor_d"][:, 0], ref["state_indices_tensor_p"]]),
          "state_indices_tensor")
    la_ref = ref_linear_attn_metadata(spec, LinearAttentionOptions(cache_mode=mode), device)
    for name in ("query_start_loc", "seq_lens", "state_indices_tensor"):
        _same(getattr(la, name), la_ref[name], name)
    assert la.query_start_loc is la.common.query_start_loc and la.seq_lens is la.common.seq_lens


# ------------------------------------------------------------------------------------------------
# eager steps: cached layouts reused across steps, trusted causal-conv1d tails, SlotMappingMode.NONE,
# the host part for builders staged after it
# ------------------------------------------------------------------------------------------------


@st.composite
def _eager_options(draw: st.DrawFn, block_size: int) -> Mamba2Options:
    """Options without checkpoints or extra chunk formats (eager mode)."""
    return Mamba2Options(
        chunk_size=draw(st.sampled_from([8, 64, 256, 6])),
        mamba_block_size=draw(st.sampled_from([None, max(4, block_size), max(16, block_size)])),
        cache_mode=draw(st.sampled_from(["none", "align"])), num_speculative_tokens=draw(st.integers(0, 3)),
        needs_causal_conv1d_metadata=draw(st.booleans()),
    )


@given(spec=batch_specs(max_reqs=12, max_query_len=40, max_context_len=300, long_prefills=True,
                        max_long_prefill_len=600), data=st.data())
def test_eager_steps_and_their_host_part_match_the_vllm_reference(device: torch.device, spec: BatchSpec, data: st.DataObject) -> None:
    opts = _covering_drafts(spec, data.draw(_eager_options(spec.block_size)))
    accepted = _draw_accepted(spec, opts, data)
    _build(spec, opts, device, accepted)
    # the host part for other builders of the step: the split and is_prefilling after the moves
    with _stager("cpu").step() as step:
        common = stage_common(spec, step, block_table_columns=block_table_columns(spec, opts), token_arrays=False)
        staged = mamba2.stage(common, step, opts, Mamba2Inputs(num_accepted_tokens=accepted))
    h = common.host
    k = opts.num_speculative_tokens
    isp, _ = classify_mamba_rows(h.query_start_loc_cpu, h.seq_lens_cpu_upper_bound, h.is_prefilling,
                                 h.num_decode_draft_tokens_cpu if k else None)
    assert_host_equal(staged.host.is_prefilling, isp)
    assert tuple(staged.host.split) == tuple(split_decodes_and_prefills(
        h.query_start_loc_cpu, num_tokens=h.num_actual_tokens, max_query_len=h.max_query_len,
        decode_threshold=1 + k, treat_short_extends_as_decodes=False, is_prefilling=isp))
    m = staged.result()
    host = staged.host  # the host part other builders of the step read: the metadata's own arrays
    for name in ("num_computed_tokens_p_cpu", "query_start_loc_p_cpu"):
        a, b = getattr(host, name), getattr(m, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert_host_equal(a, b)
    if m.num_prefills:
        assert host.chunks is not None and host.chunks.num_chunks == m.num_chunks
        assert_host_equal(host.chunks.cu_chunk_seqlens, m.cu_chunk_seqlen_p_cpu)
        assert_host_equal(host.chunks.seq_idx, m.seq_idx_p_cpu)
        assert_host_equal(host.chunks.last_chunk_indices, m.last_chunk_indices_p_cpu)
    else:
        assert host.chunks is None


def _same_shape_specs(rng: np.random.Generator, count: int, B: int, T: int) -> list[BatchSpec]:
    """``count`` steps of ``B`` rows and ``T`` tokens with different values: 0-2 decodes, then
    prefills (some continuing an unaligned context, some zero-length); every other one without
    prompt lengths (no row is still prefilling: the split is by query length alone). The block tables
    have ``cdiv(T + 700, 16)`` columns, enough for any row: stage them all (a fixed width)."""
    out = []
    for i in range(count):
        nd = int(rng.integers(0, 3))
        cuts = np.sort(rng.integers(0, T - nd + 1, B - nd - 1))
        qp = np.diff(np.concatenate([[0], cuts, [T - nd]]))
        q = np.concatenate([np.ones(nd, np.int64), qp]).astype(I32)
        c = np.concatenate([rng.integers(1, 500, nd), np.where(rng.random(B - nd) < 0.5, 0, rng.integers(1, 700, B - nd))])
        prompt = np.concatenate([np.minimum(c[:nd], 3), c[nd:] + qp + 5]).astype(I32)
        table = rng.integers(0, 10_000, (B, -(-(T + 700) // 16)), dtype=I32)  # any row's blocks
        out.append(BatchSpec(num_computed_tokens=c.astype(I32), num_scheduled_tokens=q, block_table=table, block_size=16,
                             num_prompt_tokens=prompt if i % 2 == 0 else None))
    return out


def _spy_known_rows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, int]]:
    """Record, per call of the fill kernel, the rows it was told already hold -1:
    ``(batch_ptr lo, hi, token_chunk_offset_ptr lo, hi)``."""
    calls: list[tuple[int, int, int, int]] = []
    fill = mamba_fill.mamba_fill_nb
    names = list(inspect.signature(getattr(fill, "py_func", fill)).parameters)
    at = [names.index(n) for n in ("known_bp_lo", "known_bp_hi", "known_op_lo", "known_op_hi")]

    def spy(*args: Any) -> Any:
        calls.append((args[at[0]], args[at[1]], args[at[2]], args[at[3]]))
        return fill(*args)

    monkeypatch.setattr(mamba_fill, "mamba_fill_nb", spy)
    return calls


@pytest.mark.parametrize("num_slots", [2, 3])
def test_cached_layouts_give_every_step_its_own_values(num_slots: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps repeating one shape reuse each slot's field group, views and trusted -1 tails; each step's
    metadata stays exact (and intact until its slot is reused), also after an abandoned step and a
    step of other builders on the same slot wrote over the group's bytes."""
    tails = _spy_known_rows(monkeypatch)
    rng = np.random.default_rng(7)
    specs = _same_shape_specs(rng, 30, B=9, T=700)
    other = _same_shape_specs(rng, 1, B=5, T=300)[0]
    opts = Mamba2Options(chunk_size=8, cache_mode="align", num_speculative_tokens=1, mamba_block_size=16)
    cols, other_cols = specs[0].block_table.shape[1], other.block_table.shape[1]
    stager = Stager("cpu", num_slots=num_slots)
    live: list[tuple[Mamba2Metadata, dict[str, Any]]] = []
    addresses = set()
    for i, spec in enumerate(specs):
        if i in (11, 19):  # an abandoned step of another shape, then other builders, on the next slots
            with pytest.raises(RuntimeError), stager.step() as step:
                mamba2.stage(stage_common(other, step, block_table_columns=other_cols, token_arrays=False), step, opts)
                raise RuntimeError("abandon")
            with stager.step() as step:
                fa = flash_attn.stage(stage_common(other, step, block_table_columns=other_cols), step)
            fa.result()
            live = []  # those two steps reused slots: the older steps' metadata has expired
        with stager.step() as step:
            staged = mamba2.stage(stage_common(spec, step, block_table_columns=cols, token_arrays=False), step, opts)
        m = staged.result()
        ref = _vllm_reference(spec, opts, None, torch.device("cpu"))
        _check_against_reference(m, ref)
        live = [*live[-(num_slots - 1):], (m, ref)] if num_slots > 1 else [(m, ref)]
        for old, old_ref in live:  # the steps whose slots were not reused since stay intact
            _check_against_reference(old, old_ref)
        if m.batch_ptr is not None:
            addresses.add(m.batch_ptr.data_ptr())
    assert len(addresses) <= num_slots + 1  # one field group per slot (the other shape's slot aside)
    assert any(bp_hi > 0 and op_hi > 0 for _a, bp_hi, _b, op_hi in tails)  # some steps trusted the slot's -1


@pytest.mark.parametrize("num_slots", [2, 3])
def test_a_walk_of_distinct_steps_gives_every_step_its_own_values(num_slots: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's consecutive prefill steps differ in tokens, chunks, conv1d programs and split: the
    views cached per field (rebuilt only where a count changed) must give each step its own exact
    values, and older steps whose slot was not reused stay intact; the conv1d -1 rows a slot's
    previous step left are trusted across layouts. The common metadata of these steps (no per-token
    arrays) keeps one cached layout per row count, whatever the token count."""
    trusted = _spy_known_rows(monkeypatch)
    rng = np.random.default_rng(11)
    specs = [s for B, T in ((9, 700), (9, 650), (9, 700), (5, 300), (9, 90), (9, 700), (5, 320), (9, 710))
             for s in _same_shape_specs(rng, 3, B=B, T=T)]
    opts = Mamba2Options(chunk_size=8, cache_mode="align", num_speculative_tokens=1, mamba_block_size=16)
    cols = max(s.block_table.shape[1] for s in specs)  # one staged width (narrower tables are zero-extended)
    stager = Stager("cpu", num_slots=num_slots)
    live: list[tuple[Mamba2Metadata, dict[str, Any]]] = []
    for spec in specs:
        with stager.step() as step:
            staged = mamba2.stage(stage_common(spec, step, block_table_columns=cols, token_arrays=False), step, opts)
        m = staged.result()
        ref = _vllm_reference(spec, opts, None, torch.device("cpu"))
        _check_against_reference(m, ref)
        live = [*live[-(num_slots - 1):], (m, ref)]
        for old, old_ref in live:
            _check_against_reference(old, old_ref)
    per_slot = [{k for k in slot.groups if isinstance(k[1], tuple) and k[1][0] == "mamba2"} for slot in stager._slots]
    assert max(len(layouts) for layouts in per_slot) >= 2  # the walk changes the layout on a slot ...
    assert sum(bp_hi > bp_lo and op_hi > op_lo for bp_lo, bp_hi, op_lo, op_hi in trusted) >= len(specs) // 2  # ... and trusts
    for slot in stager._slots:  # common layouts by row count (9 or 5), not one per token count (7 of them)
        common = {k[1] for k in slot.groups if isinstance(k[1], tuple) and k[1][0] == "common"}
        assert 1 <= len(common) <= 2


def test_a_step_without_prefill_rows_vouches_for_no_conv1d_rows() -> None:
    """Regression: a step whose rows all end up decodes (one-token chunks of still-prefilling rows
    move to the decode side) keeps the conv1d fields but writes none of their rows; the rows the
    slot's earlier prefill step filled with programs must not be trusted to hold -1 afterwards."""
    opts = Mamba2Options(chunk_size=8)
    table = np.arange(4 * 64, dtype=I32).reshape(4, 64)

    def spec(c: list[int], q: list[int], prompt: list[int]) -> BatchSpec:
        return BatchSpec(num_computed_tokens=np.array(c, I32), num_scheduled_tokens=np.array(q, I32),
                         num_prompt_tokens=np.array(prompt, I32), block_table=table, block_size=16)

    big = spec([0] * 4, [40] * 4, [50] * 4)  # 20 conv1d programs
    moved = spec([5] * 4, [1] * 4, [50] * 4)  # every row a one-token chunk of a prefill: P == 0
    small = spec([0] * 4, [8] * 4, [50] * 4)  # 4 programs: rows 4..19 must be -1 again
    stager = Stager("cpu", num_slots=2)
    for s_ in (big, small, moved, small, small, small):  # slot 0 sees big, moved, small
        with stager.step() as step:
            staged = mamba2.stage(stage_common(s_, step, block_table_columns=block_table_columns(s_, opts),
                                               token_arrays=False), step, opts)
        m = staged.result()
        _check_against_reference(m, _vllm_reference(s_, opts, None, torch.device("cpu")))


def test_two_kv_groups_in_one_step_keep_their_own_mlist() -> None:
    """Two Mamba2 groups staged into one step, whose splits differ, each keep their own programs (the
    host ``mlist`` lives with each group's layout)."""
    table = np.arange(4 * 8, dtype=I32).reshape(4, 8)
    spec = BatchSpec(num_computed_tokens=np.array([30, 30, 0, 0], I32), num_scheduled_tokens=np.array([2, 2, 40, 30], I32),
                     num_draft_tokens=np.array([1, 1, 0, 0], I32), block_table=table, block_size=16)
    plain = Mamba2Options(chunk_size=8)  # threshold 1: four prefill rows, 11 programs
    spec_k1 = Mamba2Options(chunk_size=8, num_speculative_tokens=1, prefix="mamba2_mtp")  # two decodes, 9 programs
    stager = Stager("cpu", num_slots=2)
    for _ in range(5):
        with stager.step() as step:
            common = stage_common(spec, step, block_table_columns=8, token_arrays=False)
            a, b = mamba2.stage(common, step, plain), mamba2.stage(common, step, spec_k1)
        ma, mb_ = a.result(), b.result()
        assert ma.conv1d_num_programs_total == 11 and mb_.conv1d_num_programs_total == 9
        _check_against_reference(ma, _vllm_reference(spec, plain, None, torch.device("cpu")))
        _check_against_reference(mb_, _vllm_reference(spec, spec_k1, None, torch.device("cpu")))
        assert ma.conv1d_mlist_cpu is not None and mb_.conv1d_mlist_cpu is not None
        assert not np.shares_memory(ma.conv1d_mlist_cpu, mb_.conv1d_mlist_cpu)


def test_growing_slots_keep_the_fill_path_exact() -> None:
    """Slots that grow mid-step (fields in two buffers, or the common's in the old one) still give
    exact values."""
    rng = np.random.default_rng(3)
    opts = Mamba2Options(chunk_size=8)
    stager = Stager("cpu", num_slots=2, initial_bytes=64)
    for B, T in ((3, 40), (6, 300), (12, 900), (20, 4000), (6, 300)):
        spec = _same_shape_specs(rng, 1, B=B, T=T)[0]
        with stager.step() as step:
            staged = mamba2.stage(stage_common(spec, step, block_table_columns=spec.block_table.shape[1],
                                               token_arrays=False), step, opts)
        _check_against_reference(staged.result(), _vllm_reference(spec, opts, None, torch.device("cpu")))
    assert stager.stats.grows > 0


@given(spec=batch_specs(max_reqs=8, max_query_len=40, max_context_len=300), conv=st.booleans())
def test_slot_mapping_mode_none_gives_the_same_mamba_fields(spec: BatchSpec, conv: bool) -> None:
    """``stage_common(..., token_arrays=False)`` (vLLM's SlotMappingMode.NONE for Mamba groups)
    changes no Mamba field: they never read positions or the slot mapping."""
    opts = Mamba2Options(chunk_size=8, needs_causal_conv1d_metadata=conv)
    cols = block_table_columns(spec, opts)
    out = []
    for tokens in (True, False):
        with _stager("cpu").step() as step:
            common = stage_common(spec, step, block_table_columns=cols, token_arrays=tokens)
            m2, m1 = mamba2.stage(common, step, opts), mamba1.stage(common, step, Mamba1Options(
                needs_causal_conv1d_metadata=conv))
        out.append((m2.result(), m1.result()))
    assert out[1][0].common.slot_mapping.shape == (0,) and out[1][0].common.positions.shape == (0,)
    for a, b in zip(out[0], out[1]):
        for f in dataclasses.fields(a):
            if f.name == "common":
                continue
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(x, torch.Tensor):
                _same(x, y, f.name)
            elif isinstance(x, np.ndarray):
                assert_host_equal(x, y)
            elif isinstance(x, dict):
                assert x.keys() == y.keys() and x[8]["tot"] == y[8]["tot"], f.name
            else:
                assert x == y, f.name


def test_a_too_narrow_decode_row_names_the_fix() -> None:
    # align mode with 2 speculative tokens: the decode row (s=12, block 4: state columns 2..4) reads
    # 2 columns past the 3 that stage_common stages by default
    spec = _spec([9], [3], [5], bs=4, width=8, num_draft_tokens=np.array([2], I32))
    opts = Mamba2Options(chunk_size=8, cache_mode="align", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="block_table_columns"), Stager("cpu").step() as step:
        mamba2.stage(stage_common(spec, step), step, opts)
    m = mamba2.build(spec, Stager("cpu"), opts)
    assert m.state_indices_tensor_d_cpu.tolist() == [[2, 3, 4]]



@given(c=st.lists(st.integers(0, 200), min_size=0, max_size=10), data=st.data(), align=st.booleans(),
       bs=st.sampled_from([1, 4, 16]))
def test_decode_only_eager_steps_take_the_short_path_and_match_the_reference(
        c: list[int], data: st.DataObject, align: bool, bs: int) -> None:
    # Rows of 0 or 1 query tokens, none in its prompt, no spec decode, eager: the layout's key says every
    # row decodes, and refill writes the state indices without the fill kernel (patched to fail here).
    q = [data.draw(st.integers(0, 1)) for _ in c]
    spec = _spec(c, q, bs=bs)
    opts = Mamba2Options(chunk_size=8, cache_mode="align" if align else "none", mamba_block_size=max(bs, 4))

    def kernel(*args: Any) -> Any:
        raise AssertionError("a decode-only eager step ran the fill kernel")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mamba_fill, "mamba_fill_nb", kernel)
        for _ in range(4):  # a new layout, then the slots' cached ones (sync audit and reference: _build)
            _build(spec, opts)


def test_a_decode_only_step_with_a_too_narrow_align_row_raises_what_the_kernel_raises() -> None:
    # align mode, mamba block 4, the common table staged with 1 column: the second row (s = 13) reads
    # column 3; the short path and the fill kernel give the same error
    spec = _spec([4, 12], [1, 1], bs=4)
    opts = Mamba2Options(chunk_size=8, cache_mode="align")

    def stage() -> str:
        with pytest.raises(ValueError, match="block_table_columns") as err, Stager("cpu").step() as step:
            mamba2.stage(stage_common(spec, step, block_table_columns=1), step, opts)
        return str(err.value)

    short = stage()
    init = mamba_fill._Layout.__init__

    def kernel_layout(self: Any, *args: Any) -> None:
        init(self, *args)
        self.decodes_only = False

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mamba_fill._Layout, "__init__", kernel_layout)
        assert stage() == short


# ------------------------------------------------------------------------------------------------
# graph mode, meta device, one copy
# ------------------------------------------------------------------------------------------------

PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=128, max_blocks_per_req=16, block_size=4, chunk_size=8)
PREFILL = _spec([9, 5, 0, 13], [1, 10, 3, 30], [4, 40, 3, 60], bs=4, width=16)
DECODE = _spec([9, 11], [3, 3], [4, 4], bs=4, width=12, num_reqs_padded=4, num_tokens_padded=12,
               num_draft_tokens=np.array([2, 2], I32))
GRAPH_OPTS = Mamba2Options(chunk_size=8, cache_mode="align", num_speculative_tokens=2, logical_chunks=True,
                           token_seq_idx=True, checkpoint=CheckpointConfig(1, 4, 4, 1))
_FULL = ("state_indices_tensor_d", "num_accepted_tokens", "state_indices_tensor_p", "query_start_loc_p",
         "has_initial_states_p", "batch_ptr", "token_chunk_offset_ptr", "cu_chunk_seqlen_p", "seq_idx_p",
         "last_chunk_indices_p", "chunk_indices_p", "chunk_offsets_p", "token_seq_idx_p", "checkpoint_offsets",
         "checkpoint_state_indices", "checkpoint_cols", "checkpoint_chunk_idx")
_SENTINEL = {"state_indices_tensor_d": 0, "num_accepted_tokens": 1, "state_indices_tensor_p": 0,
             "has_initial_states_p": False, "batch_ptr": -1, "token_chunk_offset_ptr": -1, "seq_idx_p": -1,
             "last_chunk_indices_p": -1, "chunk_indices_p": 0, "chunk_offsets_p": 0, "token_seq_idx_p": -1,
             "checkpoint_offsets": 0, "checkpoint_state_indices": 0, "checkpoint_cols": -1,
             "checkpoint_chunk_idx": 0}


BIG = _spec([0] * 6, [20] * 6, [20] * 6, bs=4, width=16)
"""More chunks, programs and prefill rows than PREFILL: run on every ring slot first, so that each later
step's sentinel tails are written over a longer step's values (a kernel that left one entry past its
rows stale kept BIG's value there)."""


def test_graph_mode_fixed_addresses_sentinels_and_values() -> None:
    stager = Stager("cpu", profile=PROFILE)
    addresses: dict[str, int] | None = None
    for spec in (BIG, BIG, BIG, PREFILL, DECODE, PREFILL, DECODE):
        with stager.step() as step:
            staged = mamba2.stage(stage_common(spec, step), step, GRAPH_OPTS)
        m = staged.result()
        eager = mamba2.build(spec, Stager("cpu"), GRAPH_OPTS)  # the same values, eager
        if spec is DECODE:
            assert m.num_prefills == 0 and m.num_decodes == 4  # 6.9 applies: D == B
        full = {n: step.device_full("mamba2." + n) for n in _FULL}
        now = {n: t.data_ptr() for n, t in full.items()}
        addresses = addresses or now
        assert now == addresses
        ck = m.num_prefills if m.checkpoint_meta is not None else 0
        used = {"state_indices_tensor_d": m.num_decodes, "num_accepted_tokens": m.num_decodes,
                "batch_ptr": m.conv1d_num_programs_total, "token_chunk_offset_ptr": m.conv1d_num_programs_total,
                "seq_idx_p": m.num_chunks, "token_seq_idx_p": m.num_prefill_tokens,
                "chunk_indices_p": 0 if m.chunk_indices_p is None else m.chunk_indices_p.shape[0],
                "checkpoint_offsets": ck, "checkpoint_state_indices": ck, "checkpoint_cols": ck,
                "checkpoint_chunk_idx": ck}
        used["chunk_offsets_p"] = used["chunk_indices_p"]
        for name, fill in _SENTINEL.items():
            assert full[name][used.get(name, m.num_prefills):].eq(fill).all(), name
        for name in ("query_start_loc_p", "cu_chunk_seqlen_p"):  # tails repeat the last value
            t = getattr(m, name)
            last = 0 if t is None else int(t[-1])
            assert full[name][0 if t is None else t.shape[0]:].eq(last).all(), name
        assert full["batch_ptr"].shape == (2 * max(1024, 128 // 8 + 8),)
        assert full["cu_chunk_seqlen_p"].shape == (PROFILE.max_num_chunks + 1,)
        tot = m.conv1d_num_programs_total
        for name in _DEVICE_COMPARED:
            a, b = getattr(m, name), getattr(eager, name)
            if name in ("batch_ptr", "token_chunk_offset_ptr") and a is not None:  # graph: capacity length
                a, b = a[:tot], b[:tot]
            _same(a, b, name)
        if spec is DECODE:
            assert m.state_indices_tensor_d.data_ptr() == full["state_indices_tensor_d"].data_ptr()
            assert m.query_start_loc_d is not None and m.query_start_loc_d.tolist() == [0, 3, 6, 6, 6]


def test_graph_mode_conv1d_pointers_follow_the_arena_when_the_layout_grows() -> None:
    """Graph mode: the causal-conv1d pointers' full device buffers were cached once per slot and layout;
    a later step of that slot whose layout grows (a field no step had staged before: a new graph arena)
    handed out the old arena's buffers, which never received the step's values (in a composer: a GDN
    group's spec-decode fields first staged beside a Mamba2 group's prefill)."""
    stager = Stager("cpu", num_slots=2, profile=PROFILE)
    opts = Mamba2Options(chunk_size=8)
    for k in range(5):  # slots 0, 1, 0 (a layout the slot keeps), 1, 0
        with stager.step() as step:
            staged = mamba2.stage(stage_common(PREFILL, step), step, opts)
            if k == 4:  # slot 0's kept layout again, and a new field grows the fixed layout (a new graph arena)
                step.alloc("engine.new_field", 4, np.int32, capacity=1 << 16)[:] = 7
        m = staged.result()
        tot = m.conv1d_num_programs_total
        assert tot > 0
        for name in ("batch_ptr", "token_chunk_offset_ptr"):
            dev, host = getattr(m, name), getattr(m, name + "_cpu")
            assert dev.data_ptr() == step.device_full("mamba2." + name).data_ptr(), f"step {k} {name}: a stale buffer"
            assert dev[:tot].tolist() == host[:tot].tolist(), f"step {k} {name}"
            assert dev[tot:].eq(-1).all(), f"step {k} {name}"


def test_graph_mode_chunk_size_must_match_the_profile() -> None:
    with pytest.raises(ValueError, match=r"StaticProfile\.chunk_size"), \
            Stager("cpu", profile=PROFILE).step() as step:
        mamba2.stage(stage_common(PREFILL, step), step, Mamba2Options(chunk_size=16))


def test_graph_mode_too_narrow_profile() -> None:
    narrow = StaticProfile(max_num_reqs=8, max_num_tokens=128, max_blocks_per_req=3, block_size=4, chunk_size=8)
    with pytest.raises(ValueError, match="max_blocks_per_req"), Stager("cpu", profile=narrow).step() as step:
        mamba2.stage(stage_common(DECODE, step), step, GRAPH_OPTS)
    with pytest.raises(CapacityError):  # the common metadata refuses batches beyond the profile first
        mamba2.build(_spec([0] * 9, [1] * 9, [9] * 9, bs=4, width=12), Stager("cpu", profile=PROFILE), GRAPH_OPTS)


@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_meta_device_builds_pass_the_audit(profile: StaticProfile | None) -> None:
    stager = Stager("meta", profile=profile)
    for spec in (PREFILL, DECODE, _spec([0, 3], [0, 0], [5, 9], bs=4, width=12)):
        with no_device_sync():
            m = mamba2.build(spec, stager, GRAPH_OPTS)
        assert m.state_indices_tensor_d.device.type == "meta"
        if m.cu_chunk_seqlen_p is not None:
            assert m.cu_chunk_seqlen_p.shape == (m.num_chunks + 1,)
        with no_device_sync():
            mamba1.build(spec, stager)
            linear_attn.build(spec, stager)


@pytest.mark.parametrize("profile", [None, PROFILE], ids=["eager", "graph"])
def test_one_copy_for_common_and_every_mamba_builder(profile: StaticProfile | None) -> None:
    stager = Stager("cpu", profile=profile)
    for spec in (PREFILL, DECODE):
        with stager.step() as step:
            cols = None if profile is not None else block_table_columns(spec, GRAPH_OPTS)
            common = stage_common(spec, step, block_table_columns=cols)
            m2 = mamba2.stage(common, step, GRAPH_OPTS)
            m1 = mamba1.stage(common, step)
            la = linear_attn.stage(common, step)
            fa = flash_attn.stage(common, step)
        assert step.stats.copies == 1
        assert m2.result().seq_lens is fa.result().seq_lens is m1.result().seq_lens
        assert la.result().state_indices_tensor.shape == (spec.padded_num_reqs,)


@pytest.mark.gpu
def test_cuda_builds_are_sync_free_graph_stable_and_equal_to_cpu(cuda_device: torch.device) -> None:
    """On the GPU machine: pinned one-copy builds under the CUDA sync audit, fixed graph addresses,
    and the same values as an eager CPU build."""
    stager = Stager(cuda_device, profile=PROFILE)
    address = None
    for spec in (PREFILL, DECODE, PREFILL):
        with no_device_sync(devices={"cuda"}):
            m = mamba2.build(spec, stager, GRAPH_OPTS)
        cpu = mamba2.build(spec, Stager("cpu"), GRAPH_OPTS)
        torch.cuda.synchronize(cuda_device)
        for name in _DEVICE_COMPARED:
            a, b = getattr(m, name), getattr(cpu, name)
            if name in ("batch_ptr", "token_chunk_offset_ptr") and a is not None:
                a, b = a[: m.conv1d_num_programs_total], b[: m.conv1d_num_programs_total]
            _same(a, b, name)
        address = address or m.state_indices_tensor_d.data_ptr()
        assert m.state_indices_tensor_d.data_ptr() == address


def test_checkpoints_of_an_optimistic_upper_bound_read_the_columns_it_allocated() -> None:
    """Regression (found by the CI's random batches): a prefill's checkpoint column comes from its
    upper-bound length; the builder stages that column when the spec's table has it, and names the
    upper bound when it does not. The strategy now draws tables covering the upper bound."""
    opts = Mamba2Options(chunk_size=8, mamba_block_size=1, cache_mode="align",
                         checkpoint=CheckpointConfig(hash_block_size=1, cache_hit_alignment_tokens=1,
                                                     mamba_block_size=1, checkpoint_alignment=1,
                                                     num_hash_lookahead_tokens=0, drop_eagle_block=False),
                         needs_causal_conv1d_metadata=False)
    table = np.array([[11, 12, 0, 0, 0]] * 8 + [[21, 22, 23, 24, 25]], I32)
    kw = dict(num_computed_tokens=np.ones(9, I32), num_scheduled_tokens=np.array([1] * 8 + [2], I32),
              block_size=1, num_draft_tokens=np.array([0] * 8 + [1], I32),
              seq_lens_upper_bound=np.array([2] * 8 + [5], I32))
    m = _build(BatchSpec(block_table=table, **kw), opts)  # checked field by field against the reference
    assert m.checkpoint_meta is not None and m.checkpoint_meta.cols_cpu.tolist() == [3]
    assert m.checkpoint_meta.state_indices_cpu.tolist() == [24]
    with pytest.raises(ValueError, match="must cover seq_lens_upper_bound"):
        mamba2.build(BatchSpec(block_table=table[:, :3], **kw), _stager("cpu"), opts)


# ------------------------------------------------------------------------------------------------
# the builder protocol: registry, generic build, needs, sample / reference, options, constructors
# ------------------------------------------------------------------------------------------------


def test_registered_and_built_through_the_generic_build() -> None:
    """The three builders are registered; the generic build stages exactly what a Mamba group reads
    (no per-token arrays, block_table_columns columns) and gives the module build's values."""
    from attnmeta.builder import registry

    reg = registry()
    assert reg["mamba2"] is mamba2.MAMBA2 and reg["mamba1"] is mamba1.MAMBA1 and reg["linear_attn"] is linear_attn.LINEAR_ATTN
    spec = _spec([30, 5, 0], [1, 10, 3], [10, 40, 3], num_reqs_padded=4, num_tokens_padded=16)
    opts = Mamba2Options(chunk_size=8, cache_mode="align", num_speculative_tokens=1, logical_chunks=True)
    needs = mamba2.MAMBA2.needs(spec.shape, opts)
    assert not needs.token_arrays and needs.block_table_columns == block_table_columns(spec, opts)
    m = generic_build(spec, Stager("cpu"), "mamba2", opts, Mamba2Inputs(num_accepted_tokens=np.array([1, 1, 1], I32)))
    assert m.common.slot_mapping.shape == (0,) and m.common.positions.shape == (0,)
    assert m.common.block_table_tensor.shape == (4, needs.block_table_columns)
    _check_against_reference(m, _vllm_reference(spec, opts, np.array([1, 1, 1], I32), torch.device("cpu")))
    for name, builder, opts1 in (("mamba1", mamba1.MAMBA1, Mamba1Options()),
                                 ("linear_attn", linear_attn.LINEAR_ATTN, LinearAttentionOptions())):
        assert not builder.needs(spec.shape, opts1).token_arrays
        assert generic_build(spec, Stager("cpu"), name, opts1).common.slot_mapping.shape == (0,)
    with pytest.raises(ValueError, match="spec decode is off"):  # UnsupportedBatchError, a ValueError
        generic_build(spec, Stager("cpu"), "mamba2", Mamba2Options(), Mamba2Inputs(num_accepted_tokens=np.ones(3, I32)))


@given(spec=batch_specs(max_reqs=8, max_query_len=40, max_context_len=300), seed=st.integers(0, 2**32 - 1))
def test_sampled_options_match_the_builders_references(device: torch.device, spec: BatchSpec, seed: int) -> None:
    """Each builder's lab sample gives options and inputs it serves; its lab reference gives the
    fields it builds (the audit and the benchmarks use both)."""
    rng = np.random.default_rng(seed)
    opts, inputs = lab("mamba2").sample(spec, rng)
    assert isinstance(opts, Mamba2Options) and (inputs is None or isinstance(inputs, Mamba2Inputs))
    assert not mamba2.MAMBA2.unsupported_reasons(spec, opts, mamba2.MAMBA2.inputs(inputs))
    with no_device_sync(devices={device.type}):
        m = mamba2.build(spec, _stager(device), opts, inputs)
    ref = lab("mamba2").reference(spec, opts, device, inputs)
    assert ref is not None
    _check_against_reference(m, ref)
    opts1, inputs1 = lab("mamba1").sample(spec, rng)
    assert isinstance(opts1, Mamba1Options) and inputs1 is None
    m1 = mamba1.build(spec, _stager(device), opts1)
    ref1 = lab("mamba1").reference(spec, opts1, device)
    assert ref1 is not None
    for name in ("state_indices_tensor_d", "state_indices_tensor_p", "has_initial_states_p", "query_start_loc_p",
                 "batch_ptr", "token_chunk_offset_ptr", "num_decodes", "num_prefills", "num_decode_tokens"):
        a = getattr(m1, name)
        if isinstance(a, torch.Tensor) or a is None:
            _same(a, ref1[name], name)
        else:
            assert a == ref1[name], name
    opts2, inputs2 = lab("linear_attn").sample(spec, rng)
    assert isinstance(opts2, LinearAttentionOptions) and inputs2 is None
    la = linear_attn.build(spec, _stager(device), opts2)
    ref2 = lab("linear_attn").reference(spec, opts2, device)
    assert ref2 is not None
    for name in ("query_start_loc", "seq_lens", "state_indices_tensor"):
        _same(getattr(la, name), ref2[name], name)
    assert (la.num_decodes, la.num_prefills) == (ref2["num_decodes"], ref2["num_prefills"])


def test_the_lab_entries_are_registered_by_builder_name() -> None:
    """The Mamba-family lab functions live in attnmeta.testing.labs.mamba, registered under the
    builders' registry names; the builders themselves carry no sample / reference / defaults."""
    from attnmeta.testing.labs import mamba as mamba_labs

    assert set(mamba_labs.ENTRIES) == {"mamba2", "mamba1", "linear_attn", "gdn"}
    for name, builder in (("mamba2", mamba2.MAMBA2), ("mamba1", mamba1.MAMBA1),
                          ("linear_attn", linear_attn.LINEAR_ATTN)):
        entry = lab(name)
        assert entry.builder is builder and entry.has_reference, name
        assert not any(hasattr(builder, m) for m in ("sample", "reference", "defaults")), name
        assert entry.defaults(_spec([3], [4], [9])) == (builder.options(None), None), name


def test_options_are_validated_when_constructed() -> None:
    with pytest.raises(TypeError, match=r"Mamba1Options\.needs_causal_conv1d_metadata"):
        Mamba1Options(needs_causal_conv1d_metadata=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"LinearAttentionOptions\.mamba_block_size"):
        LinearAttentionOptions(mamba_block_size=0)
    with pytest.raises(ValueError, match=r"Mamba2Options\.prefix"):
        Mamba2Options(prefix="a.b")
    with pytest.raises(TypeError, match="options must be Mamba2Options"):
        mamba2.build(_spec([3], [4], [9]), Stager("cpu"), Mamba1Options())  # type: ignore[arg-type]
    assert Mamba2Options(chunk_size=8) == Mamba2Options(chunk_size=8)  # frozen values, hashable
    hash(Mamba2Options(cache_mode="align", checkpoint=CKPT_CFG))


def test_metadata_objects_take_the_fast_keyword_constructor() -> None:
    """keyword_factory gives every metadata type of the family its fast constructor (a twin class),
    the two that share the frozen MambaMetadata base included, and the objects are ordinary frozen
    instances."""
    from attnmeta._fields import keyword_factory
    from attnmeta.backends.mamba import (
        LinearAttentionMetadata,
        Mamba1Metadata,
        MambaCheckpointMetadata,
        MambaHost,
    )

    for cls in (Mamba2Metadata, Mamba1Metadata, LinearAttentionMetadata, MambaCheckpointMetadata, MambaHost):
        assert keyword_factory(cls) is not cls, cls.__name__
    m = mamba2.build(_spec([30, 5, 0], [1, 10, 3], [10, 40, 3]), Stager("cpu"), Mamba2Options(chunk_size=8))
    assert type(m) is Mamba2Metadata and isinstance(m, MambaMetadata)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.num_prefills = 3  # type: ignore[misc]


def test_a_checkpoint_config_without_checkpoints_changes_nothing_but_the_options() -> None:
    """With a checkpoint config under which no row exports a checkpoint, every field is what the step
    gives without one (vLLM: checkpoint_meta None); the same fill path serves both."""
    spec = _spec([5, 0], [10, 3], [40, 3], bs=4)
    cfg = CheckpointConfig(hash_block_size=4, cache_hit_alignment_tokens=4, mamba_block_size=4, checkpoint_alignment=None)
    with_cfg = mamba2.build(spec, Stager("cpu"), Mamba2Options(chunk_size=8, cache_mode="align", checkpoint=cfg))
    without = mamba2.build(spec, Stager("cpu"), Mamba2Options(chunk_size=8, cache_mode="align"))
    assert with_cfg.checkpoint_meta is None and with_cfg.checkpoint_chunk_idx is None
    for name in _DEVICE_COMPARED:
        _same(getattr(with_cfg, name), getattr(without, name), name)


def test_one_compiled_fill_serves_steps_with_and_without_draft_counts() -> None:
    """The fill kernel (the package's longest to compile) takes the draft counts as one compiled type
    whether the step has none, derives them by vLLM's runner rule (spec decode on, no drafts given),
    or reads the common metadata's: each is a read-only int32 array, so no step compiles it again."""
    from attnmeta.host.mamba import mamba_fill_nb

    before = set(mamba_fill_nb.signatures)
    table = [[1, 2, 0], [3, 4, 5], [6, 7, 8]]
    plain = BatchSpec(num_computed_tokens=[4, 0, 7], num_scheduled_tokens=[1, 5, 3], block_table=table, block_size=4,
                      num_prompt_tokens=[2, 9, 3])
    drafted = BatchSpec(num_computed_tokens=[4, 0, 7], num_scheduled_tokens=[1, 5, 3], block_table=table, block_size=4,
                        num_prompt_tokens=[2, 9, 3], num_draft_tokens=[0, 0, 2])
    accepted = Mamba2Inputs(num_accepted_tokens=np.array([1, 1, 1], np.int32))
    spec_on = Mamba2Options(num_speculative_tokens=2)
    for spec, options, inputs in ((plain, Mamba2Options(), None), (plain, spec_on, accepted), (drafted, spec_on, accepted)):
        mamba2.build(spec, Stager("cpu"), options, inputs)
    added = set(mamba_fill_nb.signatures) - before
    assert len(added) <= 1, added


@pytest.mark.parametrize("name", ["mamba2", "mamba1", "gdn"])
def test_the_lab_reference_follows_a_large_profiles_conv1d_capacity(name: str) -> None:
    """Graph mode stages the causal-conv1d pointers at ``2 * max(1024, cdiv(max_num_tokens, 8) +
    max_num_reqs)`` programs; the lab reference gave vLLM's eager ``2 * max(1024, tot)``, so
    ``check_builder`` refused a correct build once a profile's tokens passed 8,064 (found by an
    adversarial review)."""
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=8192, max_blocks_per_req=24, block_size=16, chunk_size=16)
    spec = BatchSpec(num_computed_tokens=[0, 7], num_scheduled_tokens=[20, 5], num_prompt_tokens=[20, 30],
                     block_table=[[3] * 24, [4] * 24], block_size=16)
    opts = {"mamba2": Mamba2Options(chunk_size=16), "mamba1": None, "gdn": None}[name]
    m = check_builder(name, spec, "cpu", opts, stager=Stager("cpu", profile=prof), strict=True)
    assert m.batch_ptr.shape == (2064,) and m.conv1d_max_num_programs == 2064


@pytest.mark.parametrize("name", ["mamba1", "mamba2"])
def test_a_prefill_row_with_a_loose_upper_bound_takes_has_initial_states_from_its_exact_length(name: str) -> None:
    """vLLM computes ``has_initial_states_p`` on the device from the exact lengths (``seq_lens - q > 0``) and
    ``prep_initial_states`` on the host from the upper bounds (``nc_p_cpu > 0``). Row 2 below has no context
    (``c = 0``) but an upper bound one past its exact length: no initial state, as vLLM's device says
    (the fill used the bound for both; a review's random walk found it). vLLM's runner keeps prefill rows'
    bounds exact, so the two rules agree on its steps."""
    spec = BatchSpec(num_computed_tokens=[8, 17, 0], num_scheduled_tokens=[3, 3, 3], num_prompt_tokens=[3, 19, 0],
                     num_draft_tokens=[2, 2, 1], seq_lens_upper_bound=[11, 21, 4],
                     block_table=np.arange(1, 37, dtype=np.int32).reshape(3, 12), block_size=4)
    m = generic_build(spec, Stager("cpu"), name)
    check_metadata(name, m, spec)
    assert m.has_initial_states_p_cpu[-1] == np.False_
    if name == "mamba2":
        assert m.prep_initial_states  # (rows 0 and 1 continue a state either way)
