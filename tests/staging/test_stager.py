"""Stager / Step structure and numerics on cpu and meta (the CUDA half lives in tests/gpu)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from attnmeta.profile import StaticProfile
from attnmeta.staging import (
    CapacityError,
    DeviceIndexCache,
    MultiStager,
    Stager,
    StepExpiredError,
    StepNotCommittedError,
    pad_out,
)
from attnmeta.staging._ring import staged_fields

PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=32, max_blocks_per_req=4, block_size=4)


class CopyCounter(TorchDispatchMode):
    """Counts aten copies between distinct tensors (what a commit issues)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            self.copies.append((str(args[0].device), str(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_one_copy_per_commit(dev: str) -> None:
    stager = Stager(dev)
    with CopyCounter() as cc, stager.step() as step:
        step.alloc("a", 3, np.int32)[:] = [1, 2, 3]
        step.alloc("b", (2, 2), np.int64)[:] = [[4, 5], [6, 7]]
        step.alloc("c", 5, np.bool_)[:] = True
    assert len(cc.copies) == 1
    assert cc.copies[0][1] == "True", "the commit copy must be non_blocking"
    assert step.stats.copies == 1 and stager.stats.copies == 1
    assert step.device("b").shape == (2, 2) and step.device("b").dtype == torch.int64
    if dev == "cpu":
        assert step.device("a").tolist() == [1, 2, 3]
        assert step.device("b").tolist() == [[4, 5], [6, 7]]
        assert step.device("c").all()


def test_empty_step_issues_no_copy() -> None:
    stager = Stager("cpu")
    with stager.step() as step:
        pass
    assert step.stats.copies == 0 and step.stats.bytes == 0


def test_device_before_commit_is_an_error() -> None:
    stager = Stager("cpu")
    step = stager.step()
    step.alloc("a", 2, np.int32)[:] = 1
    with pytest.raises(StepNotCommittedError, match="before the step committed"):
        step.device("a")
    with pytest.raises(StepNotCommittedError):
        _ = step.stats
    step.commit()
    assert step.device("a").tolist() == [1, 1]
    with pytest.raises(RuntimeError, match="already committed"):
        step.commit()
    with pytest.raises(RuntimeError, match=r"alloc\(\): step 1 has already committed"):
        step.alloc("b", 1, np.int32)


def test_step_expires_when_its_slot_is_reused() -> None:
    stager = Stager("cpu", num_slots=2)
    with stager.step() as first:
        first.alloc("a", 1, np.int32)[:] = 11
    with stager.step() as s:
        s.alloc("a", 1, np.int32)[:] = 22
    assert first.device("a").tolist() == [11]  # still valid: its slot was not reused yet
    with stager.step() as s:
        s.alloc("a", 1, np.int32)[:] = 33
    with pytest.raises(StepExpiredError, match=r"step 1 \(ring slot 0 of 2\) has expired: step 3 began on that slot"):
        first.device("a")


def test_one_open_step_at_a_time_and_abandon() -> None:
    stager = Stager("cpu")
    step = stager.step()
    with pytest.raises(RuntimeError, match="neither committed nor been abandoned"):
        stager.step()
    step.abandon()
    with pytest.raises(ValueError, match="boom"), stager.step() as s2:
        s2.alloc("x", 1, np.int32)
        raise ValueError("boom")
    assert not s2.committed and stager.stats.copies == 0
    with stager.step() as s3:
        s3.alloc("x", 1, np.int32)[:] = 5
    assert s3.device("x").tolist() == [5]


def test_growth_keeps_views_handed_out_earlier() -> None:
    stager = Stager("cpu", initial_bytes=64)
    with stager.step() as step:
        a = step.alloc("a", 4, np.int32)
        b = step.alloc("b", 1000, np.int64)  # forces the slot to grow
        a[:] = [1, 2, 3, 4]  # written after the growth, through the old view
        b[:] = np.arange(1000)
    assert step.stats.grew and stager.stats.grows >= 1
    assert step.device("a").tolist() == [1, 2, 3, 4]
    assert step.device("b").tolist() == list(range(1000))
    with stager.step() as s2:
        s2.alloc("a", 4, np.int32)[:] = 9
    assert not s2.stats.grew


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        Stager("cpu", num_slots=1)
    stager = Stager("cpu")
    with stager.step() as step:
        step.alloc("a", 1, np.int32)
        with pytest.raises(ValueError, match="staged twice"):
            step.alloc("a", 1, np.int32)
        with pytest.raises(TypeError, match="cannot be staged"):
            step.alloc("f", 1, np.complex64)
        step.host_only("token_ids", [1, 2])
        with pytest.raises(ValueError, match="host-only or staged"):
            step.host_only("a", 1)
    assert step.host_fields == {"token_ids": [1, 2]}
    with pytest.raises(RuntimeError, match="graph-mode"):
        stager.freeze()


def test_host_only_fields_are_never_copied() -> None:
    stager = Stager("cpu")
    with stager.step() as step:
        step.alloc("a", 2, np.int32)[:] = 1
        step.host_only("grid", (4, 2))
    assert step.stats.bytes == 8
    with pytest.raises(KeyError):
        step.device("grid")


# ------------------------------------------------------------------------------- graph mode
def test_graph_mode_fixed_addresses_and_sentinels() -> None:
    stager = Stager("cpu", profile=PROFILE)
    ptrs = None
    for rows, vals in [(3, [1, 2, 3]), (1, [9]), (5, [4, 4, 4, 4, 4])]:
        with stager.step() as step:
            step.alloc("slot_mapping", rows, np.int64, capacity=8, fill=-1)[:] = vals
            if rows != 1:
                step.alloc("seq_lens", rows, np.int32, capacity=8, fill=0)[:] = 7
        full = step.device_full("slot_mapping")
        assert full.tolist() == vals + [-1] * (8 - rows)
        assert step.device("slot_mapping").tolist() == vals
        sl = step.device_full("seq_lens")
        # a field not staged in a step reads its sentinel everywhere
        assert sl.tolist() == ([7] * rows + [0] * (8 - rows) if rows != 1 else [0] * 8)
        now = (full.data_ptr(), sl.data_ptr())
        assert ptrs is None or now == ptrs, "graph-mode fields must keep their addresses"
        ptrs = now


def test_graph_mode_host_full_is_the_host_twin_of_device_full() -> None:
    """``host_full`` is the slot's whole fixed buffer: this step's rows, then the sentinel the commit
    refilled (rows a previous step on the slot staged included); eager mode has no fixed capacity."""
    stager = Stager("cpu", profile=PROFILE, num_slots=2)
    for rows in (5, 1, 2, 1):  # the 4th step reuses the 2nd one's slot, which held 1 row
        with stager.step() as step:
            step.alloc("slot_mapping", rows, np.int64, capacity=8, fill=-1)[:] = rows
        assert step.host_full("slot_mapping").tolist() == step.device_full("slot_mapping").tolist()
        assert step.host_full("slot_mapping").tolist() == [rows] * rows + [-1] * (8 - rows)
    with Stager("cpu").step() as step, pytest.raises(RuntimeError, match="only graph mode"):
        step.host_full("slot_mapping")


def test_graph_mode_capacity_errors() -> None:
    stager = Stager("cpu", profile=PROFILE)
    with stager.step() as step:
        with pytest.raises(CapacityError, match="needs capacity="):
            step.alloc("x", 1, np.int32)
        with pytest.raises(CapacityError, match="needs 9 rows but its capacity is 8"):
            step.alloc("y", 9, np.int32, capacity=8)
        step.alloc("z", 2, np.int32, capacity=8)[:] = 1
    stager.freeze()
    with stager.step() as step:
        with pytest.raises(CapacityError, match=r"z: needs 9 rows but its graph-mode capacity is 8"):
            step.alloc("z", 9, np.int32)
        with pytest.raises(CapacityError, match=r"after Stager\.freeze"):
            step.alloc("new", 1, np.int32, capacity=4)
        with pytest.raises(ValueError, match="graph layout holds"):
            step.alloc("z", 2, np.int64)


def test_graph_mode_layout_growth_keeps_earlier_views() -> None:
    stager = Stager("cpu", profile=PROFILE, initial_bytes=64)
    with stager.step() as step:
        a = step.alloc("a", 4, np.int32, capacity=4)
        step.alloc("big", 500, np.int64, capacity=500)[:] = 3
        a[:] = [1, 2, 3, 4]
    assert step.device("a").tolist() == [1, 2, 3, 4]
    assert step.device("big").tolist() == [3] * 500


# ------------------------------------------------------------------------------- property
fields = st.lists(
    st.tuples(st.integers(0, 40), st.sampled_from([np.int32, np.int64, np.bool_, np.int8])), min_size=1, max_size=6
)


@given(steps=st.lists(fields, min_size=1, max_size=12), num_slots=st.integers(2, 4), graph=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_device_equals_host_snapshot(steps: list[list[tuple[int, Any]]], num_slots: int, graph: bool, seed: int) -> None:
    """Every live step's device views equal what the host wrote for that step, bit for bit."""
    rng = np.random.default_rng(seed)
    stager = Stager("cpu", num_slots=num_slots, profile=PROFILE if graph else None, initial_bytes=128)
    live: list[tuple[Any, dict[str, np.ndarray]]] = []
    for spec in steps:
        with stager.step() as step:
            snap = {}
            for i, (n, dt) in enumerate(spec):
                name = f"f{i}_{np.dtype(dt).name}"
                view = step.alloc(name, n, dt, capacity=40, fill=0)
                vals = rng.integers(0, 2 if dt is np.bool_ else 100, size=n).astype(dt)
                view[:] = vals
                snap[name] = vals
        live.append((step, snap))
        keep = 1 if graph else num_slots
        for old_step, old_snap in live[-keep:]:
            for name, vals in old_snap.items():
                got = old_step.device(name).numpy()
                assert got.dtype == vals.dtype and np.array_equal(got, vals), name
    # one copy per step at most; an eager step with data always copies (graph mode may skip a step
    # whose layout holds nothing but sentinels)
    assert stager.stats.copies <= len(steps)
    if not graph:
        assert stager.stats.copies == sum(1 for s in steps if any(n for n, _ in s))


@given(plan=st.lists(st.tuples(st.sampled_from(["alloc", "restage", "restage", "abandon"]), st.sampled_from([0, 2, 6]),
                               st.sampled_from([1, 6]), st.sampled_from(["ab", "ab", "a", "b", ""])),
                     min_size=1, max_size=24), num_slots=st.integers(2, 3))
def test_graph_mode_restaged_steps_refill_every_sentinel(plan: list[tuple[str, int, int, str]], num_slots: int) -> None:
    """Graph mode, steps restaged from recorded layouts (with the row counts of the step for some of
    the fields, as a step composer replays them; the others keep the recorded rows) among fresh and
    abandoned ones: after each commit the arena holds exactly the step's rows and the sentinel past
    them. A commit restaged from the layout its slot's last commit was restaged from settles only the
    fields either gave other row counts (none when its fields are the very same), so a restage after an
    abandoned or a longer step on the slot, or after one that gave another field other rows, must not
    skip any other."""
    stager = Stager("cpu", num_slots=num_slots, profile=PROFILE)
    layouts: dict[int, Any] = {}  # slot -> a recorded layout
    for k, (kind, a, b, named) in enumerate(plan):
        step = stager.step()
        slot = (step.number - 1) % num_slots
        rec = layouts.get(slot)
        if rec is not None:  # the fields not given keep the recorded rows
            a = a if "a" in named else rec.fields["a"].rows
            b = b if "b" in named else rec.fields["b"].rows
        rows = {n: v for n, v in (("a", a), ("b", b)) if n in named}
        restaged = kind != "alloc" and rec is not None and step.restage(rec, rows)
        if restaged:
            step.host_full("a")[:a] = k
            step.host_full("b")[:b] = k
        else:
            step.alloc("a", a, np.int32, capacity=6, fill=-1)[:] = k
            step.alloc("b", b, np.int64, capacity=6, fill=-2)[:] = k
        if kind == "abandon":
            step.abandon()
            continue
        step.commit()
        assert step.device_full("a").tolist() == [k] * a + [-1] * (6 - a)
        assert step.device_full("b").tolist() == [k] * b + [-2] * (6 - b)
        if not restaged and not step.stats.grew:  # (kept while it restages: as a step composer records)
            layouts[slot] = step.layout()


def test_graph_mode_restage_after_an_abandoned_longer_step_refills_its_rows() -> None:
    """The slot's last commits restaged a layout with 2 rows; a step on the slot then wrote 6 rows and
    was abandoned: the layout is stale (restage refuses it), and the next 2-row step's commit refills
    rows 2-5 with the sentinel (the sentinel pass a repeated commit of the same fields skips is only
    skipped on a slot nothing else touched)."""
    stager = Stager("cpu", num_slots=2, profile=PROFILE)

    def on_slot_0() -> Any:  # (an empty step on slot 1 first: slots are used in ring order)
        with stager.step():
            pass
        return stager.step()

    with stager.step() as step:  # (lays the field out: this step grew the layout)
        step.alloc("a", 6, np.int32, capacity=6, fill=-1)[:] = 1
    step = on_slot_0()
    step.alloc("a", 6, np.int32)[:] = 1
    step.commit()
    rec = step.layout()
    for k in (2, 3):
        step = on_slot_0()
        assert step.restage(rec, {"a": 2})
        step.host_full("a")[:2] = k
        step.commit()
    step = on_slot_0()
    assert step.restage(rec, {"a": 6})
    step.host_full("a")[:] = 9
    step.abandon()
    step = on_slot_0()
    assert not step.restage(rec, {"a": 2}), "an abandoned step leaves its slot's recorded layouts stale"
    step.alloc("a", 2, np.int32)[:] = 5
    step.commit()
    assert step.device_full("a").tolist() == [5, 5, -1, -1, -1, -1]


def test_restage_rows_equal_to_the_layouts_reuse_its_fields_and_eager_mode_refuses_rows() -> None:
    """Graph mode: row counts equal to the recorded layout's change nothing (the step takes the layout's
    own fields, as with no rows); other row counts are checked against the capacity. Eager mode has no
    fixed offsets: any ``rows`` is refused, even the layout's own."""
    stager = Stager("cpu", num_slots=2, profile=PROFILE)

    def on_slot_1(s: Stager) -> Any:  # (an empty step on slot 0 first: slots are used in ring order)
        with s.step():
            pass
        return s.step()

    with stager.step() as step:  # (lays the field out: this step grew the layout)
        step.alloc("a", 3, np.int32, capacity=6, fill=-1)[:] = 1
    with stager.step() as step:
        step.alloc("a", 3, np.int32)[:] = 1
    rec = step.layout()
    step = on_slot_1(stager)
    assert step.restage(rec, {"a": 3})
    assert staged_fields(step) is rec.fields
    step.host_full("a")[:3] = 2
    step.commit()
    assert step.device_full("a").tolist() == [2, 2, 2, -1, -1, -1]
    step = on_slot_1(stager)
    with pytest.raises(CapacityError, match="needs 7 rows but its graph-mode capacity is 6"):
        step.restage(rec, {"a": 7})
    step.abandon()
    eager = Stager("cpu", num_slots=2)
    with eager.step():
        pass
    with eager.step() as step:
        step.alloc("a", 3, np.int32)[:] = 1
    rec = step.layout()
    step = on_slot_1(eager)
    with pytest.raises(ValueError, match="only graph mode has fixed offsets"):
        step.restage(rec, {"a": 3})
    step.abandon()


# ------------------------------------------------------------------------------- helpers
def test_device_index_cache_uploads_once() -> None:
    cache = DeviceIndexCache("cpu")
    calls = []

    def make() -> np.ndarray:
        calls.append(1)
        return np.array([1, 3])

    t = torch.zeros(4, dtype=torch.int64)
    cache.index_fill_(t, "k", make, 5)
    cache.index_fill_(t, "k", make, 6)
    assert t.tolist() == [0, 6, 0, 6] and len(calls) == 1 and cache.uploads == 1
    src = torch.tensor([10, 30])
    cache.index_copy_(t, "k", make, src)
    assert t.tolist() == [0, 10, 0, 30]
    with pytest.raises(ValueError, match="1-D"):
        cache.get("bad", lambda: np.zeros((2, 2)))


def test_pad_out() -> None:
    dst = torch.empty(4, 2, dtype=torch.int32)
    pad_out(torch.ones(1, 2, dtype=torch.int32), dst, 0)
    assert dst.tolist() == [[1, 1], [0, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="cannot place"):
        pad_out(torch.ones(5, 2, dtype=torch.int32), dst, 0)


# --------------------------------------------------------------------------------------------------
# alloc_fields: layouts cached per slot
# --------------------------------------------------------------------------------------------------

_GROUP = (("g.a", 3, np.dtype(np.int32), None, 0), ("g.b", (2, 2), np.dtype(np.int64), None, 0))


@pytest.mark.parametrize("num_slots", [2, 3])
def test_alloc_fields_reuses_the_slot_layout_and_views(num_slots: int) -> None:
    stager = Stager("cpu", num_slots=num_slots)
    groups = []
    for i in range(3 * num_slots):
        with stager.step() as step:
            g = step.alloc_fields(_GROUP)
            g.host[0][:] = [i, i + 1, i + 2]
            g.host[1][:] = i
        assert step.device("g.a").tolist() == [i, i + 1, i + 2]  # each step its own values
        assert g.device(step)[1].tolist() == [[i, i], [i, i]]
        assert not g.frozen[0].flags.writeable and g.frozen[0].tolist() == [i, i + 1, i + 2]
        groups.append(g)
    # the same slot and layout give back the same group (views built once per slot)
    assert all(groups[i] is groups[i + num_slots] for i in range(2 * num_slots))
    assert len({id(g) for g in groups}) == num_slots


def test_alloc_fields_other_shapes_other_group_and_errors() -> None:
    stager = Stager("cpu")
    with stager.step() as step:
        g1 = step.alloc_fields(_GROUP)
        with pytest.raises(ValueError, match="staged twice"):
            step.alloc_fields(_GROUP)
    other = stager.step()
    with pytest.raises(StepNotCommittedError):
        g1.device(other)  # another step, not committed
    other.abandon()
    for _ in range(2):
        with stager.step():
            pass
    with stager.step() as step:
        g2 = step.alloc_fields((("g.a", 4, np.dtype(np.int32), None, 0),))
    assert g2 is not g1 and g2.host[0].shape == (4,)
    with pytest.raises(StepExpiredError):
        for _ in range(3):
            with stager.step():
                pass
        g2.device(step)


def test_alloc_fields_when_the_slot_grows_mid_group() -> None:
    """A group whose fields straddle a slot growth has no single buffer; it still commits right."""
    stager = Stager("cpu", initial_bytes=64)
    with stager.step() as step:
        g = step.alloc_fields((("x", 8, np.dtype(np.int32), None, 0), ("y", 64, np.dtype(np.int64), None, 0)))
        g.host[0][:] = 7
        g.host[1][:] = np.arange(64)
    assert g.buf is None
    assert step.device("x").tolist() == [7] * 8 and step.device("y").tolist() == list(range(64))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_cached_group_whose_arena_grows_later_in_the_step_views_the_new_arena(graph: bool) -> None:
    """A group handed back from the slot's cache (its device views built by an earlier step), then a
    field that grows the arena in the same step (eager: past the slot's bytes; graph mode: a new field of
    the fixed layout): the group's device views are views of the new arena, holding this step's values."""
    profile = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=4, block_size=16) if graph else None
    stager = Stager("cpu", num_slots=2, profile=profile, initial_bytes=4096)
    spec = (("g.a", 4, np.dtype(np.int32), 8 if graph else None, 0),)
    groups = []
    for i in range(4):  # the group recorded on both slots, its device views built
        with stager.step() as step:
            g = step.alloc_fields(spec)
            g.host[0][:] = i
        assert g.device(step)[0].tolist() == [i] * 4
        groups.append(g)
    with stager.step() as step:
        hit = step.alloc_fields(spec)
        assert hit is groups[2]  # (slot 0's group, from its cache)
        hit.host[0][:] = 42
        if graph:
            step.alloc("g.late", 2, np.int32, capacity=4)  # a new field: the graph layout and arena grow
        else:
            step.alloc("g.big", 8192, np.int32)  # more than the slot's bytes: it grows
    assert stager.stats.grows >= 1
    assert hit.device(step)[0].tolist() == [42] * 4
    assert hit.device(step)[0].data_ptr() == step.device("g.a").data_ptr()


def test_steps_begun_counts_every_step_in_ring_order() -> None:
    stager = Stager("cpu", num_slots=3)
    slots = []
    for i in range(7):
        step = stager.step()
        slots.append(step._slot.index)
        if i % 3 == 1:
            step.abandon()
        else:
            step.commit()
        assert stager.stats.steps_begun == i + 1
    assert slots == [0, 1, 2, 0, 1, 2, 0]  # the step begun at n uses the slot of the step begun at n - 3


# ---- the driver fast path's bookkeeping (attnmeta.staging._driver); the copies themselves are
# tested on the GPU machine (tests/gpu/test_staging_cuda.py)
class _FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class _FakeSlot:
    def __init__(self, done: bool | None, generation: int = 1) -> None:
        self.event = None if done is None else _FakeEvent(done)
        self.host = object()
        self.generation = generation


def test_driver_copy_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnmeta.staging import _driver

    monkeypatch.setattr(_driver, "_LOADED", [])
    monkeypatch.setenv("ATTNMETA_DRIVER_COPY", "0")
    assert _driver.load() is None
    assert Stager("cpu")._driver is None  # and never on a CPU (or meta) device


def test_retired_pinned_slots_live_until_their_last_copy_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnmeta.staging import _driver

    monkeypatch.setattr(_driver, "_RETIRED", [])
    pending, done, unused, no_event = _FakeSlot(False), _FakeSlot(True), _FakeSlot(False, 0), _FakeSlot(None)
    _driver.retire([pending, done, unused, no_event])
    assert [host for _, host in _driver._RETIRED] == [pending.host]  # completed / never copied: released
    _driver.purge()
    assert len(_driver._RETIRED) == 1
    assert pending.event is not None
    pending.event.done = True
    _driver.purge()
    assert _driver._RETIRED == []


def test_slot_extras_follow_the_ring_and_empty_when_the_slot_grows() -> None:
    """Step.slot_extras is the builders' per-slot state: the same dict on every use of a slot, never
    shared between slots, and emptied when the stager reallocates the slot's memory."""
    stager = Stager("cpu", num_slots=2, initial_bytes=64)
    seen = []
    for i in range(4):
        with stager.step() as step:
            step.alloc("x", 4, np.int32)[:] = i
            seen.append(step.slot_extras)
            step.slot_extras.setdefault("uses", []).append(i)
    assert seen[0] is seen[2] and seen[1] is seen[3] and seen[0] is not seen[1]
    assert seen[0]["uses"] == [0, 2] and seen[1]["uses"] == [1, 3]
    with stager.step() as step:  # slot 0 again, now growing past its 64 bytes
        assert step.slot_extras["uses"] == [0, 2]
        step.alloc("big", 1 << 12, np.int32)[:] = 0
        assert step.slot_extras == {}
    assert stager.stats.grows >= 1


def test_cpu_slot_memory_is_resident_from_allocation() -> None:
    """On the CPU the stager touches its slot and arena bytes when it allocates them, so a later step
    that first writes far into a slot (a new, larger layout) takes no page faults there: 32 MiB
    written and copied would otherwise fault 16,384 pages (4 KiB each), several us each in a VM."""
    import resource

    stager = Stager("cpu", num_slots=2, initial_bytes=32 << 20)
    n = (32 << 20) // 4
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with stager.step() as step:
        step.alloc("x", n, np.int32)[:] = 1  # the whole slot, and the commit copies it all
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert step.device("x")[-1].item() == 1
    assert faults < 1000, faults


# ------------------------------------------------------------------------------------------------
# found by an adversarial review: a live step across a layout growth, fills, negative rows


@pytest.mark.parametrize("abandon", [False, True])
def test_a_live_graph_step_keeps_its_data_when_a_later_step_grows_the_layout(abandon: bool) -> None:
    """Graph mode before freeze(): step 2 adds a field (a new arena) while step 1 is still live (until a
    later commit). Views of step 1 made after that read step 1's bytes (the old arena's are carried over),
    not an arena no commit wrote; so does a MultiStager replica. The debug fill stands for CUDA's
    uninitialised memory."""
    from attnmeta import BatchSpec, stage_common
    from attnmeta.backends import flash_attn

    spec = BatchSpec(num_computed_tokens=[5, 9], num_scheduled_tokens=[1, 1], block_table=[[1, 2, 3], [4, 5, 6]],
                     block_size=4)
    for stager in (Stager("cpu", profile=PROFILE, debug_fill=0xA5),
                   MultiStager(["cpu", "cpu"], profile=PROFILE, debug_fill=0xA5)):
        with stager.step() as s1:
            fa = flash_attn.stage(stage_common(spec, s1), s1)
        before = fa.result()
        try:
            with stager.step() as s2:
                stage_common(spec, s2)
                s2.alloc("engine.new_field", 2, np.int32, capacity=4)
                assert s1.state == "committed"
                m = fa.result()
                assert m.seq_lens.tolist() == [6, 10] and s1.device("common.seq_lens").tolist() == [6, 10]
                assert s1.device_full("common.seq_lens").tolist()[:2] == [6, 10]
                if isinstance(stager, MultiStager):
                    assert stager.view(before, 1).seq_lens.tolist() == [6, 10]
                    assert stager.view(m, 1).seq_lens.tolist() == [6, 10]
                if abandon:
                    raise KeyError("the engine's step failed")
        except KeyError:
            assert s2.state == "abandoned" and s1.state == "committed"
            assert s1.device("common.seq_lens").tolist() == [6, 10]
        else:
            assert s1.state == "expired"
        with stager.step() as s3:  # the next commit: the new arena holds the step's whole layout
            stage_common(spec, s3)
            s3.alloc("engine.new_field", 1, np.int32, capacity=4)[:] = 3
        assert s3.device_full("engine.new_field").tolist() == [3, 0, 0, 0]
        assert s3.device("common.seq_lens").tolist() == [6, 10]


def test_a_graph_fill_is_checked_before_the_layout_changes() -> None:
    """A sentinel its dtype cannot hold exactly raised from the middle of the reservation (the field laid
    out, no slot filled); a later step's other fill was ignored. Both are ValueErrors before anything
    changes, and the field's first fill stays the one its tail holds."""
    stager = Stager("cpu", profile=PROFILE, num_slots=2, debug_fill=0xA5)
    for dtype, fill in ((np.uint8, -1), (np.int32, 0.7), (np.bool_, 5), (np.float32, 1e50), (np.int32, "x")):
        with pytest.raises(ValueError, match=r"engine.flags: fill=.* is not a .* value"), stager.step() as step:
            step.alloc("engine.flags", 2, dtype, capacity=8, fill=fill)
        assert step.state == "abandoned" and "engine.flags" not in stager.graph_fields
    for rows in (4, 1, 8, 0):
        with stager.step() as step:
            step.alloc("engine.flags", rows, np.uint8, capacity=8, fill=255)[:] = 1
        assert step.device_full("engine.flags").tolist() == [1] * rows + [255] * (8 - rows)
    with pytest.raises(ValueError, match=r"engine.flags: staged with fill=0 but the graph layout's sentinel is 255"), \
            stager.step() as step:
        step.alloc("engine.flags", 2, np.uint8, capacity=8, fill=0)
    with stager.step() as step:  # (leaving it out, or the same value, is the layout's)
        step.alloc("engine.flags", 2, np.uint8)[:] = 1
        step.alloc("engine.nan", 1, np.float32, capacity=2, fill=float("nan"))[:] = 0
    with stager.step() as step:
        step.alloc("engine.flags", 1, np.uint8, capacity=8, fill=255)[:] = 1
        step.alloc("engine.nan", 1, np.float32, capacity=2, fill=float("nan"))[:] = 0
    assert step.device_full("engine.flags").tolist() == [1] + [255] * 7


@pytest.mark.parametrize("graph", [False, True])
def test_a_negative_dimension_is_refused_before_the_step_moves(graph: bool) -> None:
    """Eager mode moved the step's write offset back before numpy refused a negative row count, so the next
    field overlaid earlier ones when the caller went on staging."""
    stager = Stager("cpu", profile=PROFILE if graph else None)
    cap: dict[str, Any] = {"capacity": 8} if graph else {}
    with stager.step() as step:
        ids = step.alloc("engine.ids", 2, np.int32, **cap)
        ids[:] = [11, 12]
        with pytest.raises(ValueError, match=r"engine.extra: negative row count -40"):
            step.alloc("engine.extra", -40, np.int32, **cap)
        with pytest.raises(ValueError, match=r"engine.extra: negative dimension in shape \(2, -1\)"):
            step.alloc("engine.extra", (2, -1), np.int32, **cap)
        step.alloc("engine.more", 2, np.int32, **cap)[:] = [-7, -1]
    assert step.device("engine.ids").tolist() == [11, 12]


def test_host_views_of_a_step_whose_slot_is_another_steps_raise() -> None:
    """``host_full`` of an expired graph-mode step returned (writable) the newer step's bytes while ``host``
    raised; both returned an abandoned step's half-written bytes (found by an adversarial review)."""
    stager = Stager("cpu", profile=PROFILE, num_slots=2)
    with stager.step() as first:
        first.alloc("a", 2, np.int32, capacity=8)[:] = 1
    for _ in range(2):
        with stager.step() as step:
            step.alloc("a", 2, np.int32)[:] = 2
    for view in (first.host, first.host_full):
        with pytest.raises(StepExpiredError):
            view("a")
    with pytest.raises(KeyError), stager.step() as dropped:
        dropped.alloc("a", 2, np.int32)[:] = 3
        raise KeyError("the engine's step failed")
    for view in (dropped.host, dropped.host_full):
        with pytest.raises(StepNotCommittedError, match=r"a: host view: step .* was abandoned"):
            view("a")
