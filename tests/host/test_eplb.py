"""attnmeta.eplb: vLLM's worked example (21.1), bad input, equivalence with the device reference, the
one-copy staging and the sync audit (0 syncs, 1 non-blocking H2D copy) of the pad-out."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from attnmeta.eplb import ExpertMaps, compute_logical_maps, pad_out_expert_maps, stage_expert_maps
from attnmeta.profile import StaticProfile
from attnmeta.staging import Stager
from attnmeta.sync import DeviceSyncError, no_device_sync, record_device_syncs
from attnmeta.testing.reference import ref_commit_expert_maps, ref_compute_logical_maps, ref_pad_out_tensor

# vllm-semantics 21.1 [V]: two layers, six slots, four logical experts; slot 4 of layer 1 is new (-1)
MAP = [[0, 1, 2, 0, 3, 0], [2, 2, 1, 0, -1, 3]]
COUNTS = [[3, 1, 1, 1], [1, 1, 2, 1]]
L2P = [[[0, 3, 5], [1, -1, -1], [2, -1, -1], [4, -1, -1]], [[3, -1, -1], [2, -1, -1], [0, 1, -1], [5, -1, -1]]]


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CopyCounter(TorchDispatchMode):
    """Records every aten copy as (source device, destination device, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[1].device.type, args[0].device.type, bool(kwargs.get("non_blocking", False)
                                                                               or (len(args) > 2 and args[2]))))
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# worked examples
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_worked_example_21_1(dtype: type) -> None:
    maps = compute_logical_maps(np.array(MAP, dtype), 4)
    assert maps.logical_replica_count.tolist() == COUNTS
    assert maps.logical_to_physical_map.tolist() == L2P
    assert maps.max_replicas == 3
    assert maps.logical_to_physical_map.dtype == maps.logical_replica_count.dtype == np.dtype(dtype)
    ref_l2p, ref_count = ref_compute_logical_maps(torch.tensor(MAP), 4)  # the reference reproduces it too
    assert ref_l2p.tolist() == L2P and ref_count.tolist() == COUNTS


def test_worked_example_pad_width_3_to_4() -> None:
    """21.1 [V]: padding width 3 -> 4 adds a -1 column; vLLM's way and attnmeta's agree."""
    padded = [[[*row, -1] for row in layer] for layer in L2P]
    assert compute_logical_maps(MAP, 4, width=4).logical_to_physical_map.tolist() == padded
    dst = torch.zeros(2, 4, 4, dtype=torch.int64)
    ref_pad_out_tensor(torch.tensor(L2P), dst)
    assert dst.tolist() == padded
    mine, counts = torch.zeros(2, 4, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)
    pad_out_expert_maps(Stager("cpu"), MAP, mine, counts)
    assert mine.tolist() == padded and counts.tolist() == COUNTS


def test_one_layer_and_empty_slots() -> None:
    one = compute_logical_maps([2, 2, 1, 0, -1, 3], 4, width=3)
    assert compute_logical_maps([2, 2, 1, 0, -1, 3], 4).max_replicas == 2  # its own width: 2
    assert one.logical_to_physical_map.tolist() == L2P[1] and one.logical_replica_count.tolist() == COUNTS[1]
    empty = compute_logical_maps([[-1, -1, -1]], 2)  # every slot new: width 0, as vLLM
    assert empty.max_replicas == 0 and empty.logical_to_physical_map.shape == (1, 2, 0)
    assert compute_logical_maps([[-1, -1, -1]], 2, width=2).logical_to_physical_map.tolist() == [[[-1, -1], [-1, -1]]]
    assert compute_logical_maps([0, 0], 1).logical_to_physical_map.dtype == np.int64  # lists: int64, as torch


def test_out_buffers_are_filled_and_returned() -> None:
    out, count = np.full((2, 4, 5), 99, np.int64), np.full((2, 4), 99, np.int64)
    maps = compute_logical_maps(np.array(MAP, np.int64), 4, out=out, count_out=count)
    assert maps.logical_to_physical_map is out and maps.logical_replica_count is count
    assert out[:, :, :3].tolist() == L2P and (out[:, :, 3:] == -1).all() and count.tolist() == COUNTS


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "kwargs", "exc", "match"), [
    (([[0, 4]], 4), {}, ValueError, r"physical_to_logical_map\[0, 1\]=4: expected a logical expert in \[0, 4\) or -1"),
    (([0, -2, 1], 2), {}, ValueError, r"physical_to_logical_map\[1\]=-2"),
    ((MAP, 4), {"width": 2}, ValueError, r"width=2: expert 0 of layer 0 has 3 replicas; .* max_replicas=3"),
    (([1, 1], 2), {"width": 1}, ValueError, r"width=1: expert 1 has 2 replicas"),
    ((MAP, 0), {}, ValueError, r"num_logical_experts: expected >= 1, got 0"),
    ((MAP, 2.0), {}, TypeError, r"num_logical_experts: expected an int"),
    (([[[0]]], 1), {}, ValueError, r"expected \(num_physical,\) .* got shape \(1, 1, 1\)"),
    (([0.0, 1.0], 2), {}, TypeError, r"expected an integer array .* float64"),
    ((torch.tensor([0]), 1), {}, TypeError, r"physical_to_logical_map: got a torch.Tensor .* `physical_to_logical_map\.numpy\(\)`"),
    ((np.array(MAP), 4), {"out": np.zeros((2, 4, 3), np.int32)}, ValueError, r"out: expected a writable .* int64"),
    ((np.array(MAP), 4), {"out": np.zeros((2, 4, 3), np.int64), "width": 4}, ValueError, r"width=4 but out has width 3"),
    ((np.array(MAP), 4), {"count_out": np.zeros(4, np.int64)}, ValueError, r"count_out: expected .* \(2, 4\)"),
])
def test_bad_input_names_the_culprit(args: tuple[Any, ...], kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        compute_logical_maps(*args, **kwargs)


def test_bad_destinations_leave_the_stager_untouched() -> None:
    stager = Stager("cpu")
    with pytest.raises(ValueError, match=r"logical_to_physical_map: expected a 3-D device tensor"):
        pad_out_expert_maps(stager, MAP, torch.zeros(4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"logical_to_physical_map: expected a \(2, 4, 3\) torch.int64 tensor on cpu, "
                                         r"got \(2, 4, 3\) torch.int32"):
        pad_out_expert_maps(stager, MAP, torch.zeros(2, 4, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"logical_replica_count: expected a \(2, 4\)"):
        pad_out_expert_maps(stager, MAP, torch.zeros(2, 4, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"on cpu, got .* on meta"):
        pad_out_expert_maps(stager, MAP, torch.zeros(2, 4, 3, dtype=torch.int64), None,
                            torch.zeros(2, 6, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match=r"width=2: expert 0 of layer 0 has 3 replicas"):
        pad_out_expert_maps(stager, MAP, torch.zeros(2, 4, 2, dtype=torch.int64))
    assert stager.stats.steps_begun == 0


def test_copy_into_checks_shapes() -> None:
    with Stager("cpu").step() as step:
        staged = stage_expert_maps(step, MAP, 4, width=3)
    maps = staged.result()
    with pytest.raises(ValueError, match=r"physical_to_logical_map: expected a \(2, 6\) torch.int64"):
        maps.copy_into(torch.zeros(2, 4, 3, dtype=torch.int64), None, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        maps.copy_into(np.zeros((2, 4, 3), np.int64))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# equivalence with vLLM's way (hypothesis)
# ------------------------------------------------------------------------------------------------


@st.composite
def eplb_placements(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """A realistic placement: every logical expert once, redundant replicas of random experts, padded
    to ``num_ranks`` equal shares with new (-1) slots, shuffled per layer."""
    num_logical = draw(st.integers(1, 8))
    num_ranks = draw(st.integers(1, 4))
    redundant = draw(st.lists(st.integers(0, num_logical - 1), max_size=8))
    per_rank = -(-(num_logical + len(redundant)) // num_ranks)
    new_slots = per_rank * num_ranks - num_logical - len(redundant)
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        extra = draw(st.lists(st.integers(0, num_logical - 1), min_size=len(redundant), max_size=len(redundant)))
        layers.append(draw(st.permutations([*range(num_logical), *extra, *([-1] * new_slots)])))
    return np.array(layers, dtype=np.int64), num_logical


@st.composite
def arbitrary_maps(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Any valid map: entries in [-1, E), experts missing or replicated freely, 1-D or 2-D."""
    num_logical = draw(st.integers(1, 6))
    entry = st.integers(-1, num_logical - 1)
    first = draw(st.lists(entry, max_size=12))
    rows = [first, *draw(st.lists(st.lists(entry, min_size=len(first), max_size=len(first)), max_size=2))]
    arr = np.array(rows, dtype=np.int64).reshape(len(rows), len(first))
    return (arr[0] if draw(st.booleans()) else arr), num_logical


@given(case=st.one_of(eplb_placements(), arbitrary_maps()), extra=st.integers(0, 3),
       dtype=st.sampled_from([np.int32, np.int64]))
@example(case=(np.array([[-1, -1]]), 3), extra=0, dtype=np.int64)
def test_matches_device_reference(device: torch.device, case: tuple[np.ndarray, int], extra: int, dtype: type) -> None:
    p2l, num_logical = case[0].astype(dtype), case[1]
    ref_l2p, ref_count = ref_compute_logical_maps(torch.from_numpy(p2l).to(device), num_logical)
    maps = compute_logical_maps(p2l, num_logical)
    assert maps.max_replicas == ref_l2p.shape[-1]
    assert torch.equal(torch.from_numpy(maps.logical_to_physical_map).to(device), ref_l2p)
    assert torch.equal(torch.from_numpy(maps.logical_replica_count).to(device), ref_count)
    # padded to a persistent width: vLLM's pad-out (blocking copy) vs attnmeta's staged one
    width = maps.max_replicas + extra
    tdt = torch.from_numpy(p2l).dtype
    ref_dst = torch.zeros((*p2l.shape[:-1], num_logical, width), dtype=tdt, device=device)
    ref_counts = torch.zeros((*p2l.shape[:-1], num_logical), dtype=tdt, device=device)
    ref_commit_expert_maps(torch.from_numpy(p2l), ref_dst, ref_counts)
    padded = compute_logical_maps(p2l, num_logical, width=width)
    assert torch.equal(torch.from_numpy(padded.logical_to_physical_map).to(device), ref_dst)
    dst, counts = torch.full_like(ref_dst, 7), torch.full_like(ref_counts, 7)
    placed = torch.full(p2l.shape, 7, dtype=tdt, device=device)
    host = pad_out_expert_maps(Stager(device), p2l, dst, counts, placed)
    assert torch.equal(dst, ref_dst) and torch.equal(counts, ref_counts)
    assert torch.equal(placed, torch.from_numpy(p2l).to(device))
    assert np.array_equal(host.logical_to_physical_map, padded.logical_to_physical_map)


# ------------------------------------------------------------------------------------------------
# staging: one copy, shared with the step's other fields; the sync audit
# ------------------------------------------------------------------------------------------------


def test_rides_in_the_steps_one_copy() -> None:
    stager = Stager("meta")
    with CopyCounter() as cc, stager.step() as step:
        step.alloc("query_start_loc", 3, np.int32)[:] = [0, 2, 5]
        staged = stage_expert_maps(step, MAP, 4, width=4)
    assert cc.copies == [("cpu", "meta", True)]  # one non-blocking H2D copy for everything
    assert step.stats.copies == 1
    maps = staged.result()
    assert isinstance(maps, ExpertMaps) and maps.max_replicas == 3
    assert maps.logical_to_physical_map.shape == (2, 4, 4) and maps.logical_to_physical_map.device.type == "meta"
    assert staged.host.logical_to_physical_map.shape == (2, 4, 4)


@pytest.mark.parametrize("dev", ["meta", "cpu"])
def test_pad_out_passes_the_sync_audit_with_one_copy(dev: str) -> None:
    """0 syncs (every device read or blocking/pageable copy raises inside the audit), one
    non-blocking H2D copy, then device-to-device copies into the persistent maps only."""
    stager = Stager(dev)
    l2p = torch.zeros(2, 4, 5, dtype=torch.int64, device=dev)
    counts = torch.zeros(2, 4, dtype=torch.int64, device=dev)
    placed = torch.zeros(2, 6, dtype=torch.int64, device=dev)
    p2l = np.array(MAP, np.int64)
    pad_out_expert_maps(stager, p2l, l2p, counts, placed)  # compile and size the ring outside the count
    with no_device_sync(devices={dev}), CopyCounter() as cc:
        pad_out_expert_maps(stager, p2l, l2p, counts, placed)
    assert cc.copies[0] == ("cpu", dev, True), cc.copies  # the step's one H2D copy, non-blocking
    assert cc.copies[1:] == [(dev, dev, True)] * 3, cc.copies  # device-to-device into the persistent maps
    assert stager.stats.copies == 2 and stager.stats.waits == 0
    if dev == "cpu":
        assert l2p[:, :, :3].tolist() == L2P and l2p[:, :, 3:].eq(-1).all() and counts.tolist() == COUNTS
        assert placed.tolist() == MAP


def test_the_reference_is_not_sync_free() -> None:
    """The audit does catch vLLM's way: the reference reads device data on the host."""
    l2p, counts = torch.zeros(2, 4, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)
    with record_device_syncs(devices={"cpu"}) as found:
        ref_commit_expert_maps(torch.tensor(MAP), l2p, counts)
    assert any(e.op == "aten._local_scalar_dense.default" for e in found), [e.op for e in found]
    with pytest.raises(DeviceSyncError), no_device_sync(devices={"cpu"}):
        ref_commit_expert_maps(torch.tensor(MAP), l2p, counts)


def test_graph_mode_keeps_addresses_and_values() -> None:
    stager = Stager("cpu", profile=StaticProfile(max_num_reqs=4, max_num_tokens=8, max_blocks_per_req=2, block_size=4))
    ptrs = set()
    for placement in (MAP, [[3, 2, 1, 0, 0, 0], [1, 1, 1, 2, 3, 0]], MAP):
        with stager.step() as step:
            staged = stage_expert_maps(step, placement, 4, width=3)
        maps = staged.result()
        ptrs.add(maps.logical_to_physical_map.data_ptr())
        expect = compute_logical_maps(placement, 4, width=3)
        assert maps.logical_to_physical_map.tolist() == expect.logical_to_physical_map.tolist()
        assert maps.logical_replica_count.tolist() == expect.logical_replica_count.tolist()
    assert len(ptrs) == 1
