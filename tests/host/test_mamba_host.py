"""attnmeta.host.mamba: state indices, classification, prefill checkpoints and the fused builder kernel vs the
references."""

from __future__ import annotations

import itertools
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
# state indices (5.10)


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
# classification (6.3 step 3)


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
# prefill checkpoints (6.8)

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
# the fused builder kernel (attnmeta.backends.mamba2's fast path): its parameter protocol, checked
# field by field against the public host functions


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


_GUARD = 0xAB  # bytes the kernel must never write


def _fill_buffers(
    B: int, ncols: int, C: int, bsm: int, align: bool, acc_mode: int, nb: int, mb: int
) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[int, int]]]:
    """Staged bytes ``buf`` (every field, guard bytes between them) and host-only bytes ``hbuf``
    (parameters first), laid out as attnmeta.backends.mamba2 does; returns the byte ranges. The
    kernel's ``mlist`` is a separate array (:func:`_mlist_buffer`)."""
    sizes = {"si_d": 4 * B * ncols, "acc": 4 * B, "si_p": 4 * B, "qsl_p": 4 * (B + 1), "init": B,
             "cu": 4 * (nb + 1), "sidx": 4 * nb, "last": 4 * B, "bp": 4 * mb, "op": 4 * mb}
    where: dict[str, tuple[int, int]] = {}
    off = 64
    for name, n in sizes.items():
        where[name] = (off, n)
        off = _align64(off + n) + 64  # a guard gap after every field
    buf = np.full(off, _GUARD, np.uint8)
    o_nc = 8 * hm.FILL_PARAMS
    o_nums = o_nc + _align64(4 * B)
    o_moved = o_nums + _align64(4 * B)
    hbuf = np.zeros(o_moved + _align64(B), np.uint8)
    prm = hbuf[:o_nc].view(np.int64)
    for name, idx in (("si_d", hm.FILL_O_SI_D), ("acc", hm.FILL_O_ACC), ("si_p", hm.FILL_O_SI_P),
                      ("qsl_p", hm.FILL_O_QSL_P), ("init", hm.FILL_O_INIT), ("cu", hm.FILL_O_CU),
                      ("sidx", hm.FILL_O_SIDX), ("last", hm.FILL_O_LAST), ("bp", hm.FILL_O_BP), ("op", hm.FILL_O_OP)):
        prm[idx] = where[name][0]
    prm[hm.FILL_B], prm[hm.FILL_NCOLS], prm[hm.FILL_THRESHOLD], prm[hm.FILL_ACC] = B, ncols, ncols, acc_mode
    prm[hm.FILL_CHUNK], prm[hm.FILL_BSM], prm[hm.FILL_ALIGN] = C, bsm, align
    prm[hm.FILL_CONV], prm[hm.FILL_CHUNKS], prm[hm.FILL_MB], prm[hm.FILL_NB] = mb > 0, nb > 0, mb, nb
    prm[hm.FILL_H_NC], prm[hm.FILL_H_NUMS], prm[hm.FILL_H_MOVED] = o_nc, o_nums, o_moved
    where.update(nc=(o_nc, 4 * B), nums=(o_nums, 4 * B), moved=(o_moved, B))
    return buf, hbuf, where


def _mlist_buffer(mb: int) -> np.ndarray:
    """The kernel's ``mlist`` output: ``mb // 2`` int64 rows, then guard rows it must not write."""
    return np.full(mb // 2 + 8, -77, np.int64)


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
    isp = np.array([r[2] for r in rows] + [False] * pad)
    drafts = np.array([r[3] for r in rows] + [-1] * pad, np.int32) if k else np.zeros(0, np.int32)
    qsl = np.zeros(B + 1, np.int32)
    np.cumsum(q, out=qsl[1:])
    T = int(qsl[-1]) + draw(st.integers(0, 9))
    bsm = draw(st.sampled_from([4, 16]))
    align = draw(st.booleans())
    W = max([max((int(s) - 1) // bsm, 0) for s in sl], default=0) + 1 + k + draw(st.integers(0, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bt = rng.integers(0, 10_000, (B, W), dtype=np.int32)
    acc_mode = draw(st.sampled_from([1, 2])) if k else 0
    accepted = rng.integers(1, 5, draw(st.sampled_from([n, B])), dtype=np.int32) if acc_mode == 2 else np.zeros(0, np.int32)
    return {"qsl": qsl, "ub": sl.copy(), "isp": isp, "drafts": drafts, "sl": sl, "bt": bt, "accepted": accepted,
            "T": T, "k": k, "C": draw(st.sampled_from([4, 8, 6, 256])), "bsm": bsm, "align": align,
            "conv": draw(st.booleans()), "acc_mode": acc_mode,
            "tails": draw(st.tuples(*[st.tuples(st.integers(0, 5000), st.integers(0, 5000))] * 2))}


def _untouched(buf: np.ndarray, lo: int, hi: int, what: str) -> None:
    assert (buf[lo:hi] == _GUARD).all(), f"{what}: the kernel wrote bytes it must not write"


@given(case=_fill_cases())
def test_fused_kernel_matches_the_host_functions(case: dict[str, Any]) -> None:
    qsl, ub, isp, drafts, sl, bt = (case[n] for n in ("qsl", "ub", "isp", "drafts", "sl", "bt"))
    B, T, k, C, bsm, align = qsl.shape[0] - 1, case["T"], case["k"], case["C"], case["bsm"], case["align"]
    ncols = 1 + k
    nb = max_num_chunks(T, B, C)
    mb = 2 * max(1024, min(T, T // 8 + B)) if case["conv"] else 0
    buf, hbuf, where = _fill_buffers(B, ncols, C, bsm, align, case["acc_mode"], nb, mb)
    mlist = _mlist_buffer(mb)
    # rows [lo, hi) of each pointer array already hold -1 (the builder's knowledge of the slot)
    known = [tuple(sorted(min(t, mb) for t in tail)) for tail in case["tails"]]
    for name, (lo, hi) in zip(("bp", "op"), known):
        o = where[name][0]
        buf[o + 4 * lo : o + 4 * hi].view(np.int32)[:] = -1
    snapshot = buf.copy()
    status, num_moved, D, Dt, tot, nchunks, prep = hm._mamba_fill_nb(
        qsl, ub, isp, drafts, sl, bt, case["accepted"], buf, hbuf, mlist, T, *known[0], *known[1])
    assert status == 0

    def field(name: str, dtype: Any, count: int) -> np.ndarray:
        if name == "mlist":
            return mlist[:count]
        o = where[name][0]
        arr = hbuf if name in ("nc", "nums", "moved") else buf
        return arr[o : o + np.dtype(dtype).itemsize * count].view(dtype)

    # classification and split
    moved, any_moved = classify_mamba_rows(qsl, ub, isp, drafts if k else None)
    assert num_moved == int((moved != isp).sum()) and bool(num_moved) == any_moved
    assert_host_equal(field("moved", np.bool_, B), moved)
    split = split_decodes_and_prefills(qsl, num_tokens=T, max_query_len=int(np.diff(qsl).max(initial=0)),
                                       decode_threshold=1 + k, treat_short_extends_as_decodes=False,
                                       is_prefilling=moved)
    P = B - D
    assert (D, P, Dt) == tuple(split)[:3]
    # state indices, accepted counts
    mode = "align" if align else "none"
    assert_host_equal(field("si_d", np.int32, D * ncols).reshape(D, ncols),
                      mamba_state_indices(bt[:D], sl[:D], mamba_block_size=bsm, mode=mode, num_state_columns=ncols))
    assert_host_equal(field("si_p", np.int32, P),
                      mamba_state_indices(bt[D:], sl[D:], mamba_block_size=bsm, mode=mode, num_state_columns=1)[:, 0])
    if case["acc_mode"] == 1:
        assert_host_equal(field("acc", np.int32, D), np.diff(qsl[: D + 1]).astype(np.int32))
    elif case["acc_mode"] == 2:
        acc = np.ones(D, np.int32)
        m = min(D, case["accepted"].shape[0])
        acc[:m] = case["accepted"][:m]
        assert_host_equal(field("acc", np.int32, D), acc)
    written = {"si_d": 4 * D * ncols, "acc": 4 * D if case["acc_mode"] else 0, "si_p": 4 * P}
    if P:
        nc, qsl_p = prefill_cpu_metadata(qsl, ub, num_reqs=B, num_prefills=P, num_decode_tokens=Dt)
        assert_host_equal(field("qsl_p", np.int32, P + 1), qsl_p)
        assert_host_equal(field("nc", np.int32, P), nc)
        assert_host_equal(field("init", np.bool_, P), nc > 0)
        assert prep == bool((nc > 0).any())
        cm = chunk_metadata(C, nc, qsl_p)
        assert nchunks == cm.num_chunks
        assert_host_equal(field("cu", np.int32, nchunks + 1), cm.cu_chunk_seqlens)
        assert_host_equal(field("sidx", np.int32, nchunks), cm.seq_idx)
        assert_host_equal(field("last", np.int32, P), cm.last_chunk_indices)
        written.update(qsl_p=4 * (P + 1), init=P, cu=4 * (nchunks + 1), sidx=4 * nchunks, last=4 * P)
        if case["conv"]:
            conv = causal_conv1d_metadata(qsl_p)
            M = conv.max_num_programs
            assert tot == conv.num_programs_total
            assert mb >= M
            assert_host_equal(field("nums", np.int32, P), conv.nums)
            assert_host_equal(field("mlist", np.int64, tot), conv.mlist)
            assert_host_equal(field("bp", np.int32, M), conv.batch_ptr)
            assert_host_equal(field("op", np.int32, M), conv.token_chunk_offset_ptr)
            written.update(bp=4 * M, op=4 * M)
    # nothing written outside each field's used prefix (the pointers' trusted rows stay as they were)
    assert (mlist[mb // 2 :] == -77).all(), "mlist: written past its rows"
    for name, (o, size) in where.items():
        if name in ("nc", "nums", "moved"):
            continue
        w = written.get(name, 0)
        assert (buf[o + w : o + size] == snapshot[o + w : o + size]).all(), f"{name}: written past its used rows"
    gaps = sorted(where[n] for n in where if n not in ("nc", "nums", "moved"))
    _untouched(buf, 0, gaps[0][0], "leading guard")
    for (o, size), (o2, _s) in itertools.pairwise(gaps):
        _untouched(buf, o + size, o2, "guard")
    # the packed entry point: the same results with the inputs addressed inside the two buffers
    cbuf = np.zeros(_align64(4 * B) * 2 + _align64(B), np.uint8)
    c_ub, c_isp, c_dr = 0, _align64(4 * B), 2 * _align64(4 * B)
    cbuf[c_ub : c_ub + 4 * B].view(np.int32)[:] = ub
    cbuf[c_isp : c_isp + B].view(np.bool_)[:] = isp
    ibuf = np.zeros(buf.shape[0] + _align64(4 * (B + 1)) + _align64(4 * B) + _align64(bt.nbytes), np.uint8)
    i_qsl = buf.shape[0]
    i_sl = i_qsl + _align64(4 * (B + 1))
    i_bt = i_sl + _align64(4 * B)
    ibuf[: buf.shape[0]] = snapshot
    ibuf[i_qsl : i_qsl + 4 * (B + 1)].view(np.int32)[:] = qsl
    ibuf[i_sl : i_sl + 4 * B].view(np.int32)[:] = sl
    ibuf[i_bt : i_bt + bt.nbytes].view(np.int32)[:] = bt.reshape(-1)
    hbuf2 = hbuf.copy()
    prm = hbuf2[: 8 * hm.FILL_PARAMS].view(np.int64)
    prm[hm.FILL_C_QSL], prm[hm.FILL_C_SL], prm[hm.FILL_C_BT], prm[hm.FILL_C_W] = i_qsl, i_sl, i_bt, bt.shape[1]
    prm[hm.FILL_C_UB], prm[hm.FILL_C_ISP] = c_ub, c_isp
    if k:
        cbuf = np.concatenate([cbuf, np.zeros(_align64(4 * B), np.uint8)])
        cbuf[c_dr : c_dr + 4 * B].view(np.int32)[:] = drafts
        prm[hm.FILL_C_DRAFTS] = c_dr
    else:
        prm[hm.FILL_C_DRAFTS] = -1
    mlist2 = _mlist_buffer(mb)
    got = hm._mamba_fill_packed_nb(ibuf, cbuf, hbuf2, mlist2, case["accepted"], T, *known[0], *known[1])
    assert got == (status, num_moved, D, Dt, tot, nchunks, prep)
    assert (mlist2[:tot] == mlist[:tot]).all()
    assert (ibuf[: buf.shape[0]] == buf).all()
    assert (hbuf2[8 * hm.FILL_PARAMS :] == hbuf[8 * hm.FILL_PARAMS :]).all()


def test_fused_kernel_reports_a_too_narrow_table() -> None:
    # one prefill row whose align-mode state column (s=20, block 4: column 4) is past a 2-column table
    B, ncols = 1, 1
    buf, hbuf, _ = _fill_buffers(B, ncols, 8, 4, True, 0, max_num_chunks(20, 1, 8), 2048)
    status = hm._mamba_fill_nb(i32([0, 20]), i32([20]), np.array([True]), np.zeros(0, np.int32), i32([20]),
                               np.zeros((1, 2), np.int32), np.zeros(0, np.int32), buf, hbuf, _mlist_buffer(2048), 20,
                               0, 0, 0, 0)[0]
    assert status == -1 - (0 * 8 + hm.FILL_E_TABLE_P)
