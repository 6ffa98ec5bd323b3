"""A stager works inside and outside ``torch.inference_mode()``, whichever mode made its memory.

vLLM's runner builds every step inside ``torch.inference_mode()`` (``GPUModelRunner.execute_model``),
and an engine may warm up or test outside it. A tensor made inside inference mode is an inference
tensor, which torch refuses to write in place outside it; so a stager whose slots, arenas or typed
views were made (or grown) inside inference mode would fail its next commit outside it. Every
persistent tensor of staging is made as a plain tensor instead. On the CPU the commit is a torch copy
into the device arena, so these tests see the failure without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import attnmeta
from attnmeta import BatchSpec, StaticProfile, stage_common
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.compose import Group, StepBuilder
from attnmeta.staging import MultiStager, Stager
from attnmeta.staging.helpers import DeviceIndexCache
from attnmeta.staging.shared import RingReader, RingWriter, SharedRing
from attnmeta.testing.multi import assert_replica
from attnmeta.testing.workloads import decode_spec, mixed_spec

PROFILE = StaticProfile(max_num_reqs=64, max_num_tokens=65536, max_blocks_per_req=512, block_size=16)


def _spec(seed: int, big: bool = False) -> BatchSpec:
    rng = np.random.default_rng(seed)
    if big:  # more bytes than the eager stagers' first slots hold (SMALL): the step grows its slot
        return mixed_spec(rng, prefills=8, decodes=48, max_prompt=2000, max_context=3000)
    return mixed_spec(rng, prefills=2, decodes=6, max_prompt=100, max_context=300)


SMALL = 4096
"""Eager stagers' first slot bytes here (``Stager(initial_bytes=...)``), so that a big step grows them."""


def _step(stager: Any, spec: BatchSpec) -> tuple[Any, Any]:
    with stager.step() as step:
        common = stage_common(spec, step, paged_kv=True)
        fi = flashinfer.stage(common, step)
    return common.result(), fi.result()


def _reference(spec: BatchSpec) -> tuple[Any, Any]:
    """The same step on a stager made and used outside inference mode."""
    return _step(Stager("cpu"), spec)


def _same(got: tuple[Any, Any], want: tuple[Any, Any]) -> None:
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), name
    width = want[0].block_table_tensor.shape[1]  # (graph mode stages the profile's width)
    assert torch.equal(got[0].block_table_tensor[:, :width], want[0].block_table_tensor)
    for name in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        assert torch.equal(getattr(got[1], name), getattr(want[1], name)), name


MODES: dict[str, Callable[[], Any]] = {"eager": lambda: Stager("cpu", initial_bytes=SMALL),
                                       "graph": lambda: Stager("cpu", profile=PROFILE)}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_stager_made_inside_inference_mode_works_outside_it(mode: str) -> None:
    with torch.inference_mode():
        stager = MODES[mode]()
        _same(_step(stager, _spec(0)), _reference(_spec(0)))
    for seed in range(1, 5):  # every ring slot, outside inference mode
        got = _step(stager, _spec(seed))
        _same(got, _reference(_spec(seed)))
        assert not got[0].seq_lens.is_inference()


@pytest.mark.parametrize("mode", list(MODES))
def test_memory_made_inside_inference_mode_is_plain(mode: str) -> None:
    """Slots grown (eager) or fields laid out (graph) inside inference mode, then steps outside it, then
    inside again."""
    stager = MODES[mode]()
    _step(stager, _spec(0))
    with torch.inference_mode():
        for seed in range(1, 4):  # eager: each slot grows; graph: the layout's new fields
            _same(_step(stager, _spec(seed, big=True)), _reference(_spec(seed, big=True)))
    if mode == "eager":
        assert stager.stats.grows >= 3, "the big steps grew the slots inside inference mode"
    for seed in range(4, 8):
        _same(_step(stager, _spec(seed, big=True)), _reference(_spec(seed, big=True)))
    with torch.inference_mode():
        _same(_step(stager, _spec(9)), _reference(_spec(9)))


def test_the_step_composer_inside_then_outside_inference_mode() -> None:
    composer = StepBuilder(Stager("cpu", profile=PROFILE), Group({"flash_attn": flash_attn.FLASH_ATTN,
                                                                  "flashinfer": flashinfer.FLASHINFER}))
    spec = decode_spec(16, np.random.default_rng(0), table_width=256)
    with torch.inference_mode():
        for _ in range(4):  # composed, then replayed on every slot
            inside = composer.build((spec,))
    want = _reference(spec)
    replayed = composer.stats.replayed
    for _ in range(4):
        outside = composer.build((spec,))
        assert torch.equal(outside.common.slot_mapping, want[0].slot_mapping)
        assert torch.equal(outside["flashinfer"].paged_kv_indices, want[1].paged_kv_indices)
    assert composer.stats.replayed == replayed + 4, "outside inference mode, the layouts recorded inside replay"
    del inside


def test_a_multi_stager_made_inside_inference_mode() -> None:
    with torch.inference_mode():
        multi = MultiStager(["cpu", "cpu"], initial_bytes=SMALL)
        got = _step(multi, _spec(0, big=True))
    for seed in range(1, 4):
        spec = _spec(seed, big=True)
        with multi.step() as step:
            common = stage_common(spec, step, paged_kv=True)
        own = common.result()
        replica = multi.view(own, 1)
        assert_replica(own, replica, shared_host=True)
        assert torch.equal(own.slot_mapping, _reference(spec)[0].slot_mapping)
    del got


@pytest.fixture
def ring() -> Iterator[SharedRing]:
    r = SharedRing.create(num_readers=1, num_slots=3, slot_bytes=4 << 20)
    yield r
    r.unlink()


def test_a_shared_ring_s_writer_and_reader_made_inside_inference_mode(ring: SharedRing) -> None:
    with torch.inference_mode():
        writer = RingWriter(ring, "cpu", timeout=10, profile=PROFILE)
        reader = RingReader(SharedRing.attach(ring.name), 0, "cpu")
        for seed in range(2):
            with writer.step() as step:
                common = stage_common(_spec(seed), step, paged_kv=True)
            writer.publish({"common": common.result()})
            assert reader.receive(timeout=10) is not None
    for seed in range(2, 6):
        spec = _spec(seed)
        with writer.step() as step:
            common = stage_common(spec, step, paged_kv=True)
        writer.publish({"common": common.result()})
        got = reader.receive(timeout=10)
        assert got is not None
        assert torch.equal(got.result("common").slot_mapping, _reference(spec)[0].slot_mapping)


def test_device_index_cache_made_inside_inference_mode() -> None:
    with torch.inference_mode():
        cache = DeviceIndexCache("cpu")
        idx = cache.get("evens", lambda: np.arange(0, 6, 2))
    assert not idx.is_inference()
    target = torch.zeros(6, dtype=torch.int32)
    cache.index_fill_(target, "evens", lambda: np.arange(0, 6, 2), 7)
    assert target.tolist() == [7, 0, 7, 0, 7, 0]
    assert attnmeta.__name__ == "attnmeta"
