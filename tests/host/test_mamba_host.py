"""attnmeta.host.mamba: state indices, classification, prefill checkpoints and the builders' fill kernel vs the
references."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta.host import mamba as hm
from attnmeta.host.chunks import chunk_metadata, max_num_chunks
from attnmeta.host.conv1d import causal_conv1d_metadata
from attnmeta.host.layout import prefill_cpu_metadata
from attnmeta.host.mamba import (
    CheckpointConfig,
    classify_mamba_rows,
    gather_checkpoint_state_indices,
    mamba_state_indices,
    prefill_checkpoints,
)
from attnmeta.host.split import split_decodes_and_prefills
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference.mamba import (
    ref_classify_mamba_rows,
    ref_mamba_state_indices,
    ref_prefill_checkpoints,
)
from attnmeta.testing.strategies import (
    MambaClassificationCase,
    MambaStateIndexCase,
    PrefillCheckpointCase,
    mamba_classification_cases,
    mamba_state_index_cases,
    prefill_checkpoint_cases,
)


def i32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


# ------------------------------------------------------------------------------------------------
# state indices


def test_state_indices_align_example() -> None:
    bt = np.arange(40, dtype=np.int32).reshape(4, 10)
    got = mamba_state_indices(bt, i32([1, 16, 17, 0]), mamba_block_size=8, mode="align", num_state_columns=3)
    # starts: max((s-1)//8, 0) = 0, 1, 2, 0 (padding row reads column 0)
    assert_host_equal(got, np.array([[0, 1, 2], [11, 12, 13], [22, 23, 24], [30, 31, 32]], np.int32))


@given(case=mamba_state_index_cases())
def test_state_indices_match_reference(device: torch.device, case: MambaStateIndexCase) -> None:
    got = mamba_state_indices(
        case.block_table,
        case.seq_lens,
        mamba_block_size=case.mamba_block_size,
        mode=case.mode,  # type: ignore[arg-type]
        num_state_columns=case.num_state_columns,
    )
    ref = ref_mamba_state_indices(
        torch.from_numpy(case.block_table).to(device),
        torch.from_numpy(case.seq_lens).to(device),
        mamba_block_size=case.mamba_block_size,
        mode=case.mode,
        num_state_columns=case.num_state_columns,
    )
    assert_matches_device(got, ref, "state_indices")
    out = np.empty_like(got)
    again = mamba_state_indices(
        case.block_table,
        case.seq_lens,
        mamba_block_size=case.mamba_block_size,
        mode=case.mode,  # type: ignore[arg-type]
        num_state_columns=case.num_state_columns,
        out=out,
    )
    assert again is out
    assert_host_equal(out, got)


def test_state_indices_bad_input() -> None:
    bt = np.zeros((2, 3), np.int32)
    kw = {"mamba_block_size": 4, "num_state_columns": 2}
    with pytest.raises(
        ValueError, match=r"block_table: row 1 needs columns 2\.\.3 .*but the table has 3 columns"
    ):
        mamba_state_indices(bt, i32([4, 9]), mode="align", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=-1 is negative"):
        mamba_state_indices(bt, i32([-1, 2]), mode="align", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode: must be 'none' or 'align'"):
        mamba_state_indices(bt, i32([1, 2]), mode="all", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_table: has 2 rows, need one per seq_lens entry"):
        mamba_state_indices(bt, i32([1, 2, 3]), mode="none", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_state_columns: must be a positive int"):
        mamba_state_indices(bt, i32([1, 2]), mode="none", mamba_block_size=4, num_state_columns=0)
    with pytest.raises(ValueError, match="must have shape"):
        mamba_state_indices(bt, i32([1, 2]), mode="none", out=np.empty((2, 3), np.int32), **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# classification


def test_classification_example() -> None:
    qsl = i32([0, 1, 2, 5, 7, 7])
    ub = i32([9, 1, 8, 6, 0])
    isp = np.array([True, True, True, True, False])
    before = isp.copy()
    got, moved = classify_mamba_rows(qsl, ub, isp)
    # row 0: one-token chunk with prior state -> decode; row 1: first token of a prompt (no prior state)
    assert got.tolist() == [False, True, True, True, False] and moved
    assert_host_equal(isp, before)  # never mutates its input
    got, moved = classify_mamba_rows(qsl, ub, isp, i32([-1, -1, 2, -1, -1]))
    assert got.tolist() == [False, True, False, True, False] and moved
    got, moved = classify_mamba_rows(qsl[:1], ub[:0], isp[:0])
    assert got.shape == (0,) and not moved


@given(case=mamba_classification_cases())
def test_classification_matches_reference(case: MambaClassificationCase) -> None:
    before = case.is_prefilling.copy()
    got, moved = classify_mamba_rows(*case)
    drafts = None if case.num_decode_draft_tokens is None else torch.from_numpy(case.num_decode_draft_tokens)
    ref, ref_moved = ref_classify_mamba_rows(
        torch.from_numpy(case.query_start_loc_cpu),
        torch.from_numpy(case.seq_lens_upper_bound),
        torch.from_numpy(case.is_prefilling),
        drafts,
    )
    assert_matches_device(got, ref, "is_prefilling")
    assert moved == ref_moved
    assert got is not case.is_prefilling
    assert_host_equal(case.is_prefilling, before)


def test_classification_bad_input() -> None:
    isp = np.array([True, True])
    with pytest.raises(ValueError, match=r"query_start_loc_cpu\[2\]=1 < query_start_loc_cpu\[1\]=3"):
        classify_mamba_rows(i32([0, 3, 1]), i32([3, 3]), isp)
    with pytest.raises(ValueError, match=r"num_decode_draft_tokens\[1\]=-3 < -1"):
        classify_mamba_rows(i32([0, 1, 2]), i32([3, 3]), isp, i32([0, -3]))
    with pytest.raises(ValueError, match="query_start_loc_cpu: expected length num_reqs \\+ 1 = 3"):
        classify_mamba_rows(i32([0, 1]), i32([3, 3]), isp)
    with pytest.raises(TypeError, match="bool array"):
        classify_mamba_rows(i32([0, 1, 2]), i32([3, 3]), i32([1, 1]))
    with pytest.raises(ValueError, match="is_prefilling: expected length num_reqs = 2"):
        classify_mamba_rows(i32([0, 1, 2]), i32([3, 3]), np.array([True]))


# ------------------------------------------------------------------------------------------------
# prefill checkpoints

CFG = CheckpointConfig(
    hash_block_size=4, cache_hit_alignment_tokens=4, mamba_block_size=4, checkpoint_alignment=4
)


def test_checkpoint_example_and_chunk_layout() -> None:
    bt = np.arange(12, dtype=np.int32).reshape(2, 6)
    r = prefill_checkpoints(i32([17, 20]), i32([17, 12]), bt, config=CFG)
    assert r is not None
    # row 0: qs=0, pos=16, col=cdiv(17,4)-2=3; row 1: qs=8, pos=16, col=3
    assert_host_equal(r.offsets, np.array([16, 8], np.int32))
    assert_host_equal(r.cols, np.array([3, 3], np.int64))
    assert r.state_indices is not None
    assert_host_equal(r.state_indices, np.array([3, 9], np.int32))
    # the offsets put a chunk boundary on each checkpoint
    m = chunk_metadata(4, i32([0, 8]), i32([0, 17, 29]), r.offsets)
    cu = m.cu_chunk_seqlens
    assert cu[m.checkpoint_chunk_idx[0] + 1] == 16 and cu[m.checkpoint_chunk_idx[1] + 1] == 17 + 8
    assert_host_equal(gather_checkpoint_state_indices(bt, r.cols), r.state_indices)


def test_checkpoint_none_cases() -> None:
    assert prefill_checkpoints(i32([]), i32([]), config=CFG) is None
    off = CFG._replace(checkpoint_alignment=None)
    assert prefill_checkpoints(i32([17]), i32([17]), config=off) is None
    # drop_eagle moves the position back one H; lookahead moves lim back
    eagle = CFG._replace(drop_eagle_block=True)
    r = prefill_checkpoints(i32([17]), i32([17]), config=eagle)
    assert r is not None and r.offsets.tolist() == [12] and r.state_indices is None
    look = CFG._replace(num_hash_lookahead_tokens=2)
    r = prefill_checkpoints(i32([17]), i32([17]), config=look)
    assert r is not None and r.offsets.tolist() == [12]


@given(case=prefill_checkpoint_cases())
def test_checkpoints_match_reference(device: torch.device, case: PrefillCheckpointCase) -> None:
    got = prefill_checkpoints(
        case.seq_lens_upper_bound_p, case.query_lens_p, case.block_table_p, config=case.config
    )
    ref = ref_prefill_checkpoints(
        torch.from_numpy(case.seq_lens_upper_bound_p),
        torch.from_numpy(case.query_lens_p),
        torch.from_numpy(case.block_table_p).to(device),
        config=case.config,
        device=device,
    )
    if ref is None:
        assert got is None
        return
    assert got is not None
    assert_matches_device(got.offsets, ref[0], "offsets")
    assert_matches_device(got.cols, ref[1], "cols")
    assert_matches_device(got.state_indices, ref[2], "state_indices")
    # the offsets are valid checkpoint offsets for the chunk layout
    qsl = np.zeros(case.query_lens_p.shape[0] + 1, np.int32)
    qsl[1:] = np.cumsum(case.query_lens_p)
    nc = case.seq_lens_upper_bound_p - case.query_lens_p
    chunk_metadata(16, nc, qsl, got.offsets)


def test_checkpoint_bad_input() -> None:
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound_p\[0\]=3 < query_lens_p\[0\]=5"):
        prefill_checkpoints(i32([3]), i32([5]), config=CFG)
    with pytest.raises(ValueError, match=r"query_lens_p\[0\]=-1 is negative"):
        prefill_checkpoints(i32([3]), i32([-1]), config=CFG)
    with pytest.raises(ValueError, match="query_lens_p: expected length num_prefills = 1"):
        prefill_checkpoints(i32([3]), i32([1, 2]), config=CFG)
    with pytest.raises(ValueError, match=r"config\.mamba_block_size: must be a positive int"):
        prefill_checkpoints(i32([3]), i32([1]), config=CFG._replace(mamba_block_size=0))
    with pytest.raises(ValueError, match=r"config\.checkpoint_alignment: must be a positive int"):
        prefill_checkpoints(i32([3]), i32([1]), config=CFG._replace(checkpoint_alignment=0))
    with pytest.raises(TypeError, match="config: expected CheckpointConfig"):
        prefill_checkpoints(i32([3]), i32([1]), config=(4, 4, 4, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint in column 3 but the table has 2 columns"):
        prefill_checkpoints(i32([17]), i32([17]), np.zeros((1, 2), np.int32), config=CFG)


# ------------------------------------------------------------------------------------------------
# the fill kernel of the Mamba builders (attnmeta.backends.mamba), checked field by field against the
# public host functions it is composed of


_GUARD32, _GUARD64 = -77, -7777  # values the kernel must never write past an output's used rows


@st.composite
def _fill_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A reordered batch (decodes, short extends, prefills, zero-length and padding rows) and builder
    options; valid by construction."""
    k = draw(st.integers(0, 3))
    rows = draw(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 70), st.booleans(), st.integers(-1, 3)),
                         max_size=12))
    pad = draw(st.integers(0, 3))
    n = len(rows)
    B = n + pad
    c = np.array([r[0] for r in rows] + [0] * pad, np.int32)
    q = np.array([r[1] for r in rows] + [0] * pad, np.int32)
    sl = c + q
    isp = np.array([r[2] for r in rows] + [False] * pad, np.bool_)
    # (a row verifies at most k drafts: more is the kernel's FILL_E_DRAFTS_K, the test below)
    drafts = np.array([min(r[3], k) for r in rows] + [-1] * pad, np.int32) if k else np.zeros(0, np.int32)
    qsl = np.zeros(B + 1, np.int32)
    np.cumsum(q, out=qsl[1:])
    T = int(qsl[-1]) + draw(st.integers(0, 9))
    bsm = draw(st.sampled_from([4, 16]))
    align = draw(st.booleans())
    ckpt = draw(st.one_of(st.none(), st.builds(CheckpointConfig, st.sampled_from([1, 4]), st.sampled_from([4, 8]),
                                               st.just(bsm), st.sampled_from([None, 1, 4]), st.integers(0, 2),
                                               st.booleans()))) if align else None
    W = max([max((int(s) - 1) // bsm, 0) for s in sl], default=0) + 1 + k + draw(st.integers(0, 2))
    W = max(W, max([-(-int(s) // bsm) - 1 for s in sl], default=1))  # checkpoint columns too
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bt = rng.integers(0, 10_000, (B, W), dtype=np.int32)
    given_acc = bool(k) and draw(st.booleans())
    accepted = (rng.integers(1, 2 + k, draw(st.sampled_from([n, B])), dtype=np.int32) if given_acc  # in [1, 1 + k]
                else np.zeros(0, np.int32))
    return {"qsl": qsl, "ub": sl.copy(), "isp": isp, "drafts": drafts, "sl": sl, "bt": bt, "accepted": accepted,
            "given": given_acc, "T": T, "k": k, "C": draw(st.sampled_from([0, 4, 8, 6, 256])), "bsm": bsm,
            "align": align, "ckpt": ckpt, "conv": draw(st.booleans()), "pad": draw(st.booleans()),
            "known": draw(st.tuples(*[st.integers(0, 5000)] * 4))}


def _outputs(case: dict[str, Any]) -> dict[str, np.ndarray]:
    """The kernel's outputs, each with guard rows past what any step of these shapes writes."""
    B, T, C = case["qsl"].shape[0] - 1, case["T"], case["C"]
    g = 5
    conv = 2 * max(1024, min(T, T // 8 + B)) if case["conv"] else 0
    nb = max_num_chunks(T, B, C, with_checkpoints=True) if C else 0
    ck = case["ckpt"] is not None

    def a(rows: int, dtype: Any = np.int32, on: bool = True) -> np.ndarray:
        return np.full(rows + g if on else 0, _GUARD64 if dtype == np.int64 else _GUARD32, dtype)

    out = {"moved": np.zeros(B, np.bool_), "state_d": np.full((B + g, 1 + case["k"]), _GUARD32, np.int32),
           "accepted_d": a(B, on=case["k"] > 0), "state_p": a(B), "query_start_loc_p": a(B + 1),
           "has_initial_p": np.zeros(B + g, np.bool_), "num_computed_p": a(B), "nums": a(B, on=conv > 0),
           "mlist": a(conv // 2, np.int64, conv > 0), "batch_ptr": a(conv, on=conv > 0),
           "offset_ptr": a(conv, on=conv > 0), "cu_chunk_seqlens": a(nb + 1, on=C > 0), "seq_idx": a(nb, on=C > 0),
           "last_chunk": a(B, on=C > 0), "query_lens_p": a(B, on=ck), "ckpt_offsets": a(B, on=ck),
           "ckpt_cols": a(B, np.int64, ck), "ckpt_state": a(B, on=ck), "ckpt_chunk": a(B, np.int64, ck),
           "ckpt_chunk_list": a(B, np.int64, ck)}
    if case["pad"]:  # graph mode: every output is padded to its end, so exact lengths (no guard rows)
        for name, arr in out.items():
            if name != "moved" and arr.shape[0]:
                out[name] = arr[: arr.shape[0] - g]
    return out


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _fill(case: dict[str, Any], out: dict[str, np.ndarray]) -> tuple[int, ...]:
    ck = case["ckpt"]
    params = (0, 0, 0, 0, False) if ck is None else (
        ck.hash_block_size, ck.cache_hit_alignment_tokens, ck.checkpoint_alignment or 0, ck.num_hash_lookahead_tokens,
        ck.drop_eagle_block)
    lo, hi = sorted(case["known"][:2])
    olo, ohi = sorted(case["known"][2:])
    rows = out["batch_ptr"].shape[0]
    for arr, (a, b) in ((out["batch_ptr"], (lo, hi)), (out["offset_ptr"], (olo, ohi))):
        arr[min(a, rows) : min(b, rows)] = -1  # rows the caller knows hold -1 already
    # The inputs read-only, as the builder passes them (host views of the common metadata): the compiled
    # variant the library runs, not one of writable arrays compiled for this test alone.
    qsl, ub, isp, drafts, sl, bt = (_read_only(case[n]) for n in ("qsl", "ub", "isp", "drafts", "sl", "bt"))
    return tuple(hm.mamba_fill_nb(
        qsl, ub, isp, drafts, sl, bt, case["T"], 1 + case["k"],
        case["bsm"], case["align"], case["C"], case["pad"], case["accepted"], case["given"], min(lo, rows),
        min(hi, rows), min(olo, rows), min(ohi, rows), *params, **out))


@given(case=_fill_cases())
def test_fill_kernel_matches_the_host_functions(case: dict[str, Any]) -> None:
    qsl, ub, isp, drafts, sl, bt = (case[n] for n in ("qsl", "ub", "isp", "drafts", "sl", "bt"))
    B, T, k, C, bsm, align, pad = (qsl.shape[0] - 1, case["T"], case["k"], case["C"], case["bsm"], case["align"],
                                   case["pad"])
    out = _outputs(case)
    status, D, Dt, tot, nchunks, prep, nck, num_moved = _fill(case, out)
    assert status == 0
    ncols = 1 + k
    # classification and split
    moved, any_moved = classify_mamba_rows(qsl, ub, isp, drafts if k else None)
    assert num_moved == int((moved != isp).sum()) and bool(num_moved) == any_moved
    assert_host_equal(out["moved"], moved)
    split = split_decodes_and_prefills(qsl, num_tokens=T, max_query_len=int(np.diff(qsl).max(initial=0)),
                                       decode_threshold=1 + k, treat_short_extends_as_decodes=False,
                                       is_prefilling=moved)
    P = B - D
    assert (D, P, Dt) == tuple(split)[:3]
    # state indices, accepted counts; every row of an output past its used ones: a sentinel (pad) or untouched
    mode = "align" if align else "none"

    def rest(name: str, used: int, sentinel: Any) -> None:
        arr = out[name]
        tail = arr[used:]
        if pad:
            assert (tail == sentinel).all(), f"{name}: rows past {used} are not the sentinel {sentinel}"
        elif arr.dtype != np.bool_:
            guard = _GUARD64 if arr.dtype == np.int64 else _GUARD32
            assert (tail == guard).all(), f"{name}: written past its {used} used rows"

    assert_host_equal(out["state_d"][:D], mamba_state_indices(bt[:D], sl[:D], mamba_block_size=bsm, mode=mode,
                                                              num_state_columns=ncols))
    rest("state_d", D, 0)
    assert_host_equal(out["state_p"][:P], mamba_state_indices(bt[D:], sl[D:], mamba_block_size=bsm, mode=mode,
                                                              num_state_columns=1)[:, 0])
    rest("state_p", P, 0)
    if k:
        acc = np.diff(qsl[: D + 1]).astype(np.int32)
        if case["given"]:
            acc = np.ones(D, np.int32)
            m = min(D, case["accepted"].shape[0])
            acc[:m] = case["accepted"][:m]
        assert_host_equal(out["accepted_d"][:D], acc)
        rest("accepted_d", D, 1)
    if not P:
        assert (tot, nchunks, prep, nck) == (0, 0, False, 0)
        if pad:  # the staged prefill fields hold their sentinels
            for name, sentinel in (("query_start_loc_p", 0), ("batch_ptr", -1), ("offset_ptr", -1),
                                   ("cu_chunk_seqlens", 0), ("seq_idx", -1), ("last_chunk", -1), ("ckpt_offsets", 0),
                                   ("ckpt_cols", -1), ("ckpt_state", 0), ("ckpt_chunk", 0)):
                assert (out[name] == sentinel).all(), name
        return
    nc, qsl_p = prefill_cpu_metadata(qsl, ub, num_reqs=B, num_prefills=P, num_decode_tokens=Dt)
    assert_host_equal(out["query_start_loc_p"][: P + 1], qsl_p)
    rest("query_start_loc_p", P + 1, qsl_p[-1])
    assert_host_equal(out["num_computed_p"][:P], nc)
    assert_host_equal(out["has_initial_p"][:P], nc > 0)
    assert prep == bool((nc > 0).any())
    if case["conv"]:
        conv = causal_conv1d_metadata(qsl_p)
        M = out["batch_ptr"].shape[0] if pad else conv.max_num_programs
        assert tot == conv.num_programs_total
        assert_host_equal(out["nums"][:P], conv.nums)
        assert_host_equal(out["mlist"][:tot], conv.mlist)
        assert_host_equal(out["batch_ptr"][:M], _pad(conv.batch_ptr, M))
        assert_host_equal(out["offset_ptr"][:M], _pad(conv.token_chunk_offset_ptr, M))
    ckpts = None
    if case["ckpt"] is not None:
        q_p = np.diff(qsl_p).astype(np.int32)
        ckpts = prefill_checkpoints(ub[D:], q_p, bt[D:], config=case["ckpt"])
        assert nck == (0 if ckpts is None else int((ckpts.offsets > 0).sum()))
        if ckpts is not None:
            assert_host_equal(out["ckpt_offsets"][:P], ckpts.offsets)
            assert_host_equal(out["ckpt_cols"][:P], ckpts.cols)
            assert ckpts.state_indices is not None
            assert_host_equal(out["ckpt_state"][:P], ckpts.state_indices)
        else:  # no row has one: the sentinels
            assert (out["ckpt_offsets"][:P] == 0).all() and (out["ckpt_cols"][:P] == -1).all()
        rest("ckpt_offsets", P, 0)
        rest("ckpt_cols", P, -1)
    if C:
        cm = chunk_metadata(C, nc, qsl_p, None if ckpts is None else ckpts.offsets)
        assert nchunks == cm.num_chunks
        assert_host_equal(out["cu_chunk_seqlens"][: nchunks + 1], cm.cu_chunk_seqlens)
        rest("cu_chunk_seqlens", nchunks + 1, cm.cu_chunk_seqlens[-1])
        assert_host_equal(out["seq_idx"][:nchunks], cm.seq_idx)
        rest("seq_idx", nchunks, -1)
        assert_host_equal(out["last_chunk"][:P], cm.last_chunk_indices)
        rest("last_chunk", P, -1)
        if case["ckpt"] is not None:
            assert_host_equal(out["ckpt_chunk"][:P], np.maximum(cm.checkpoint_chunk_idx, 0))
            rest("ckpt_chunk", P, 0)


def _pad(values: np.ndarray, rows: int) -> np.ndarray:
    full = np.full(rows, -1, np.int32)
    full[: values.shape[0]] = values[:rows]
    return full


def test_fill_kernel_refuses_a_row_with_more_drafts_than_k() -> None:
    """Row 1 verifies 2 drafts with k = 1 (q = 3 > 1 + k): it would run as a prefill, its drafts taken
    into the state as accepted tokens; the kernel reports it (the builders' ValueError names it)."""
    from attnmeta.host.mamba import FILL_E_DRAFTS_K, FILL_STATUS_STRIDE

    qsl, sl = np.array([0, 2, 5], np.int32), np.array([11, 12], np.int32)
    case = {"qsl": qsl, "ub": sl.copy(), "isp": np.zeros(2, np.bool_), "drafts": np.array([1, 2], np.int32),
            "sl": sl, "bt": np.arange(8, dtype=np.int32).reshape(2, 4), "accepted": np.zeros(0, np.int32),
            "given": False, "T": 5, "k": 1, "C": 8, "bsm": 4, "align": False, "ckpt": None, "conv": False,
            "pad": False, "known": (0, 0, 0, 0)}
    status = _fill(case, _outputs(case))[0]
    assert status == -1 - (1 * FILL_STATUS_STRIDE + FILL_E_DRAFTS_K)
    case["drafts"] = np.array([1, 1], np.int32)  # (q = 3 > 1 + k with one draft: a plain prefill row)
    assert _fill(case, _outputs(case))[0] == 0


def test_fill_kernel_outputs_are_its_parameters() -> None:
    """The builder passes the kernel's outputs by name (attnmeta.backends.mamba._shared._Outputs): they
    are the kernel's trailing parameters, in order."""
    from attnmeta.backends.mamba._fill import _Outputs

    params = list(inspect.signature(getattr(hm.mamba_fill_nb, "py_func", hm.mamba_fill_nb)).parameters)
    assert params[-len(_Outputs._fields):] == list(_Outputs._fields)


def test_fill_kernel_reports_a_too_narrow_table() -> None:
    # one prefill row whose align-mode state column (s=20, block 4: column 4) is past a 2-column table
    case = {"qsl": i32([0, 20]), "ub": i32([20]), "isp": np.array([True]), "drafts": np.zeros(0, np.int32),
            "sl": i32([20]), "bt": np.zeros((1, 2), np.int32), "accepted": np.zeros(0, np.int32), "given": False,
            "T": 20, "k": 0, "C": 8, "bsm": 4, "align": True, "ckpt": None, "conv": True, "pad": False,
            "known": (0, 0, 0, 0)}
    status = _fill(case, _outputs(case))[0]
    assert status == -1 - (0 * hm.FILL_STATUS_STRIDE + hm.FILL_E_TABLE_P)


def test_fill_kernel_reports_an_accepted_count_outside_one_to_one_plus_k() -> None:
    # two spec-decode rows (k = 2) and a prefill: row 1's count 4 > 1 + k; the prefill row's is not read
    q = i32([3, 3, 6])
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    sl = i32([12, 20, 6])
    case = {"qsl": qsl, "ub": sl, "isp": np.array([False, False, True]), "drafts": i32([2, 2, 0]), "sl": sl,
            "bt": np.arange(30, dtype=np.int32).reshape(3, 10), "accepted": i32([3, 4, 0]), "given": True,
            "T": 12, "k": 2, "C": 8, "bsm": 4, "align": False, "ckpt": None, "conv": False, "pad": False,
            "known": (0, 0, 0, 0)}
    assert _fill(case, _outputs(case))[0] == -1 - (1 * hm.FILL_STATUS_STRIDE + hm.FILL_E_ACCEPTED)
    for bad in (0, -5, 99):
        case["accepted"] = i32([bad, 1, 1])
        assert _fill(case, _outputs(case))[0] == -1 - (0 * hm.FILL_STATUS_STRIDE + hm.FILL_E_ACCEPTED)
    case["accepted"] = i32([1, 3, 0])  # the prefill row's 0 is not read
    out = _outputs(case)
    assert _fill(case, out)[:2] == (0, 2) and out["accepted_d"][:2].tolist() == [1, 3]
