"""The shared ring: one writer derives, every reader copies; the protocol's fences, on the CPU.

Most tests run the writer and its readers in this process, one after the other (each reader maps
the segment through its own ``SharedRing.attach``). The race test runs readers in spawned processes
whose copies are held back, and checks every step's bytes against what the writer wrote; its control
(a writer that does not wait for releases) must see torn steps. The CUDA half is
tests/gpu/test_multi_cuda.py.
"""

from __future__ import annotations

import enum
import gc
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import attnmeta
from attnmeta import StaticProfile, stage_common
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.staging import CapacityError, NotReplicableError, StepExpiredError
from attnmeta.staging.shared import (
    ClaimError,
    DescriptionError,
    RingOverrunError,
    RingReader,
    RingWriter,
    SharedRing,
)
from attnmeta.staging.stager import is_expired
from attnmeta.testing.multi import assert_replica, run_reader, run_writer
from attnmeta.testing.workloads import mixed_spec

PROFILE = StaticProfile(max_num_reqs=16, max_num_tokens=4096, max_blocks_per_req=256, block_size=16)


@pytest.fixture
def ring() -> Iterator[SharedRing]:
    r = SharedRing.create(num_readers=2, num_slots=3, slot_bytes=1 << 20)
    yield r
    r.unlink()


def _spec(rng: np.random.Generator) -> Any:
    return mixed_spec(rng, prefills=3, decodes=5, max_prompt=200, max_context=500)


# ------------------------------------------------------------------------------------------ the protocol
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_readers_get_the_writers_metadata(ring: SharedRing, graph: bool) -> None:
    """The composable builders in the writer; each reader's objects equal the writer's, in its own
    device memory, host views in its own mapping of the shared slot; one copy per reader per step."""
    writer = RingWriter(ring, "cpu", timeout=10, profile=PROFILE if graph else None)
    readers = [RingReader(SharedRing.attach(ring.name), r, "cpu") for r in range(2)]
    rng = np.random.default_rng(1)
    for n in range(1, 10):
        spec = _spec(rng)
        with writer.step() as step:
            common = stage_common(spec, step, paged_kv=True)
            fa = flash_attn.stage(common, step)
            fi = flashinfer.stage(common, step)
        writer.publish({"fa": fa.result(), "fi": fi.result()})
        for rd in readers:
            got = rd.receive(timeout=10)
            assert got is not None and got.number == n and sorted(got.names) == ["fa", "fi"]
            gfa, gfi = got.result("fa"), got.result("fi")
            assert gfa.common is gfi.common, "a part shared in the writer is shared in the reader"
            assert_replica(fa.result(), gfa, shared_host=False)
            assert_replica(fi.result(), gfi, shared_host=False)
            np.testing.assert_array_equal(gfa.query_start_loc_cpu, fa.result().query_start_loc_cpu)
            assert not gfa.seq_lens_cpu.flags.writeable, "a reader never writes the shared slot"
            assert torch.equal(got.device("common.seq_lens"), step.device("common.seq_lens"))
            np.testing.assert_array_equal(got.host("common.slot_mapping"), step.host("common.slot_mapping"))
    assert [rd.stats.copies for rd in readers] == [9, 9]
    assert writer.ring_stats.published == 9 and writer.ring_stats.waits == 0


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_fused_steps_go_as_patches_and_stay_exact(ring: SharedRing, graph: bool) -> None:
    """FusedStepBuilder's replays change a few fields a step: the description goes as patches, and
    every reader's objects stay equal to the writer's, step after step."""
    from attnmeta.bench.scenarios import decode_walks

    specs = dict(decode_walks(True))[8]
    writer = RingWriter(ring, "cpu", timeout=10, profile=StaticProfile(
        max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=128, block_size=16) if graph else None)
    builder = FusedStepBuilder(writer)
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    idle = RingReader(SharedRing.attach(ring.name), 1, "cpu")  # receives, never decodes
    sizes = []
    for spec in specs[:30]:
        fs = builder.build(spec)
        writer.publish({"step": fs})
        got = rd.receive(timeout=10)
        assert got is not None and idle.receive(timeout=10) is not None
        sizes.append(got._meta_len)
        assert_replica(fs, got.result("step"), shared_host=False)
    assert builder.stats.replayed > 0
    assert max(sizes[10:]) < sizes[0], "replayed steps are described as patches, smaller than the first"


def test_a_reader_that_never_decodes_stays_in_step(ring: SharedRing) -> None:
    writer = RingWriter(ring, "cpu", timeout=10)
    builder = FusedStepBuilder(writer)
    readers = [RingReader(SharedRing.attach(ring.name), r, "cpu") for r in range(2)]
    rng = np.random.default_rng(2)
    specs = [_spec(rng) for _ in range(4)]
    for i in range(24):
        fs = builder.build(specs[i % 4])
        writer.publish({"step": fs})
        lazy = readers[0].receive(timeout=10)
        eager = readers[1].receive(timeout=10)
        assert lazy is not None and eager is not None
        assert_replica(fs, eager.result("step"), shared_host=False)
        if i % 5 == 4:  # the lazy reader decodes only now and then
            assert_replica(fs, lazy.result("step"), shared_host=False)


def test_lifetimes_and_releases(ring: SharedRing) -> None:
    """A reader holds its last num_slots - 1 steps; a step expires (its objects raise) when the one
    num_slots - 1 later is received, and only then is its slot released."""
    writer = RingWriter(ring, "cpu", timeout=10)
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    other = RingReader(SharedRing.attach(ring.name), 1, "cpu")
    spec = _spec(np.random.default_rng(3))
    got, objs = [], []
    for _ in range(3):
        meta = attnmeta.build(spec, writer, "flash_attn")
        writer.publish({"fa": meta})
        got.append(rd.receive(timeout=10))
        objs.append(got[-1].result("fa"))
        other.receive(timeout=10)
    first = objs[0]
    assert is_expired(first), "step 1 expired when step 3 was received (num_slots - 1 = 2 later)"
    with pytest.raises(StepExpiredError, match="ring step 1"):
        got[0].result("fa")
    assert not is_expired(objs[1]) and got[1].result("fa") is objs[1]
    assert ring.done(0, 0) == 1 and ring.done(0, 1) == 0, "step 1's slot released, step 2's held"
    assert ring.received(0) == 3


def test_abandoned_steps_are_skipped(ring: SharedRing) -> None:
    writer = RingWriter(ring, "cpu", timeout=10)
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    rd1 = RingReader(SharedRing.attach(ring.name), 1, "cpu")
    with pytest.raises(RuntimeError, match="boom"), writer.step() as step:
        step.alloc("x", 2, np.int32)[:] = 5
        raise RuntimeError("boom")
    with writer.step() as step:
        step.alloc("x", 2, np.int32)[:] = 7
    writer.publish()
    for r in (rd, rd1):
        got = r.receive(timeout=10)
        assert got is not None and got.number == 2 and got.device("x").tolist() == [7, 7]
        assert r.stats.steps == 2 and r.stats.copies == 1


def test_a_step_dropped_while_open_is_skipped_too(ring: SharedRing) -> None:
    """A writer's step begun outside ``with`` and dropped: the next step abandons it through the same
    hook as an abandoned one, so the readers are told it is a skip (else they would wait for it)."""
    import gc

    writer = RingWriter(ring, "cpu", timeout=10)
    readers = [RingReader(SharedRing.attach(ring.name), r, "cpu") for r in range(2)]
    writer.step().alloc("x", 2, np.int32)[:] = 5  # begun, written, dropped
    gc.collect()
    with pytest.warns(RuntimeWarning, match="dropped without a commit"), writer.step() as step:
        step.alloc("x", 2, np.int32)[:] = 7
    writer.publish()
    for r in readers:
        got = r.receive(timeout=10)
        assert got is not None and got.number == 2 and got.device("x").tolist() == [7, 7]
        assert r.stats.steps == 2 and r.stats.copies == 1


def test_publish_is_required_and_checked(ring: SharedRing) -> None:
    writer = RingWriter(ring, "cpu", timeout=10)
    with pytest.raises(RuntimeError, match="no committed step"):
        writer.publish()
    spec = _spec(np.random.default_rng(4))
    meta = attnmeta.build(spec, writer, "flashinfer", flashinfer.FlashInferOptions(indices="device"))
    with pytest.raises(RuntimeError, match="was not published"):
        writer.step()
    with pytest.raises(NotReplicableError, match=r"^results\['fi'\]\.paged\.paged_kv_indices: .*computed it on the device"):
        writer.publish({"fi": meta})
    writer.publish()  # the step goes without it
    with pytest.raises(TypeError, match=r"results must be a mapping of name to metadata.*got FlashAttentionMetadata"):
        writer.publish(attnmeta.build(spec, writer, "flash_attn"))  # type: ignore[arg-type]
    writer.publish()
    attnmeta.build(spec, writer, "flash_attn")  # committed, never published: close() sends it as a skip
    with pytest.warns(UserWarning, match=r"step 3 was committed but never published; the readers skip it"):
        writer.close()
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    assert [rd.receive(timeout=10).number for _ in range(2)] == [1, 2]  # type: ignore[union-attr]
    assert rd.receive(timeout=10) is None, "a closed ring ends after its last step"
    assert rd.stats.steps == 3 and rd.stats.copies == 2


def test_capacities_are_fixed(ring: SharedRing) -> None:
    small = SharedRing.create(num_readers=1, num_slots=2, slot_bytes=4096, meta_bytes=4096)
    try:
        writer = RingWriter(small, "cpu")
        with pytest.raises(CapacityError, match="never grow"), writer.step() as step:
            step.alloc("x", 5000, np.int64)
        gwriter_ring = SharedRing.create(num_readers=1, num_slots=2, slot_bytes=4096)
        try:
            gw = RingWriter(gwriter_ring, "cpu", profile=PROFILE)
            with pytest.raises(CapacityError, match="graph layout"), gw.step() as step:
                step.alloc("x", 1, np.int64, capacity=10_000)
        finally:
            gwriter_ring.unlink()
    finally:
        small.unlink()
    with pytest.raises(ValueError, match="num_slots"):
        SharedRing.create(num_readers=1, num_slots=1)
    with pytest.raises(ValueError, match="hold"):
        RingReader(ring, 0, "cpu", hold=3)


def test_a_writer_that_outruns_its_readers_times_out_naming_them(ring: SharedRing) -> None:
    writer = RingWriter(ring, "cpu", timeout=0.2)
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    for _ in range(3):
        with writer.step() as step:
            step.alloc("x", 1, np.int32)[:] = 1
        writer.publish()
    rd.receive(timeout=10)
    with pytest.raises(TimeoutError, match=r"readers \[0, 1\] have not released step 1"):
        writer.step()


def test_overrun_and_description_mismatch_are_caught(ring: SharedRing) -> None:
    """What the protocol rules out is detected, not silently read: a slot that holds a later step than
    the reader expects, and a patch of a description state the reader does not hold."""
    writer = RingWriter(ring, "cpu", timeout=10)
    late = RingReader(SharedRing.attach(ring.name), 1, "cpu")
    with writer.step() as step:
        step.alloc("x", 1, np.int32)[:] = 1
    writer.publish()
    ring.header[16] = 4  # slot 0's seq: as if the writer had lapped this reader (it never does while fencing)
    with pytest.raises(RingOverrunError, match="slot 0 holds step 4, expected step 1"):
        late.receive(timeout=1)
    ring2 = SharedRing.create(num_readers=1, num_slots=2)
    try:
        w2 = RingWriter(ring2, "cpu", timeout=10)
        fb = FusedStepBuilder(w2)
        rd = RingReader(SharedRing.attach(ring2.name), 0, "cpu", hold=1)
        spec = _spec(np.random.default_rng(5))
        for _ in range(2):
            w2.publish({"s": fb.build(spec)})
            rd.receive(timeout=10)
        rd._resolver.states.clear()  # as if this reader had missed steps 1 and 2
        w2.publish({"s": fb.build(spec)})  # step 3, slot 0: a patch of step 1's description
        with pytest.raises(DescriptionError, match="receive every step"):
            rd.receive(timeout=10)
    finally:
        ring2.unlink()


# ------------------------------------------------------------------------------------------ the race test
READERS = 3


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(READERS) as p:
        yield p


def _race(pool: Any, steps: int, fencing: bool, num_slots: int) -> tuple[dict[str, float], list[dict[str, int]]]:
    ring = SharedRing.create(num_readers=READERS, num_slots=num_slots, slot_bytes=64 << 10, meta_bytes=4096)
    try:
        jobs = [pool.apply_async(run_reader, (ring.name, r, 11), {"hold_every": 4, "hold_seconds": 0.003})
                for r in range(READERS)]
        stats = run_writer(ring, steps, 11, fencing=fencing)
        return stats, [j.get(timeout=300) for j in jobs]
    finally:
        ring.unlink()


def test_race_free_with_fencing_under_held_copies(pool: Any) -> None:
    """Three reader processes whose copies are held back (every 4th copy waits 3 ms): with the
    protocol's fences no reader ever sees a step other than the one the writer wrote."""
    stats, results = _race(pool, 1500, fencing=True, num_slots=3)
    for r in results:
        assert r == {"steps": 1500, "torn_device": 0, "torn_host": 0, "overruns": 0}, r
    assert stats["waits"] > 0, "the writer had to wait for held readers (else the test held nothing)"


def test_race_test_detects_missing_fencing(pool: Any) -> None:
    """The same test with a writer that waits only until readers have received a step must see torn
    steps, or it proves nothing."""
    _, results = _race(pool, 600, fencing=False, num_slots=2)
    torn = sum(r["torn_device"] + r["torn_host"] + r["overruns"] for r in results)
    assert torn > 0, results


# ------------------------------------------------------------------------------------------------
# found by an adversarial review


class _Kind(enum.Enum):
    """A dict key of a published object (pickled, as any value marshal does not write)."""

    DECODE = 1


def _ring_pair(**reader_kw: Any) -> tuple[SharedRing, RingWriter, RingReader]:
    ring = SharedRing.create(num_readers=1, num_slots=3)
    return ring, RingWriter(ring, "cpu", timeout=5), RingReader(SharedRing.attach(ring.name), 0, "cpu", **reader_kw)


def test_a_ring_steps_field_views_raise_once_it_expired() -> None:
    """``RingStep.device``/``host`` cached the step's field table and skipped the expiry check after it:
    read once while live, they went on returning the newer steps' bytes of the reused slot."""
    ring, writer, reader = _ring_pair()
    try:
        received = []
        for n in range(1, 6):
            with writer.step() as st:
                st.alloc("x", 4, np.int32)[:] = n
            writer.publish({})
            received.append(reader.receive(timeout=5))
            if n == 1:
                assert received[0].device("x").tolist() == [1] * 4 and received[0].host("x").tolist() == [1] * 4
        assert received[0].expired
        with pytest.raises(StepExpiredError):
            received[0].device("x")
        with pytest.raises(StepExpiredError):
            received[0].host("x")
    finally:
        reader.close()
        writer.close()
        ring.unlink()


def test_published_dict_keys_arrive_as_sent_and_another_slots_host_view_is_refused() -> None:
    """Dict keys went through marshal raw: a numpy integer key arrived as bytes, an enum key failed the
    publish after the writer's description state had moved on. A host view of another slot's step was
    published (the reader read it after that slot was rewritten); a device tensor of one was refused."""
    import dataclasses

    ring, writer, reader = _ring_pair(hold=1)
    spec = attnmeta.BatchSpec(num_computed_tokens=[9, 40], num_scheduled_tokens=[1, 1],
                              block_table=np.arange(16, dtype=np.int32).reshape(2, 8), block_size=16)
    try:
        sent = {"ids": {np.int64(7): 3, 8: 4}, "by_kind": {_Kind.DECODE: 1}}
        meta = attnmeta.build(spec, writer, "flash_attn")
        writer.publish({"fa": meta, "extra": sent})
        got = reader.receive(timeout=5).result("extra")
        assert got == sent and [type(k) for k in got["ids"]] == [np.int64, int]
        old = meta
        meta = attnmeta.build(spec, writer, "flash_attn")
        with pytest.raises(ValueError, match=r"publish\(\): a \(2,\) int32 host view of the step in slot 0"):
            writer.publish({"fa": dataclasses.replace(meta, seq_lens_cpu=old.seq_lens_cpu, seq_lens=meta.seq_lens)})
        writer.publish({"fa": meta})  # (the step stays unpublished: publish it again without it)
        assert reader.receive(timeout=5).result("fa").seq_lens.tolist() == [10, 41]
    finally:
        reader.close()
        writer.close()
        ring.unlink()


def _hold_reader(name: str, reader: int, ready: Any, leave: Any) -> None:
    """A reader process that takes its number and exits without closing (as a crashed rank does)."""
    RingReader(SharedRing.attach(name), reader, "cpu")
    ready.set()
    leave.wait(60)
    os._exit(0)


def test_a_reader_number_has_one_live_reader(ring: SharedRing) -> None:
    """Two readers under one number each released slots the other still read, so the writer rewrote a
    slot under one of them with no error; the second reader is now refused, in this process and from
    another, and the number is free again once its reader closes, is collected (for its own process), or its process exits."""
    first = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    assert ring.claimed_by(0) == os.getpid() and ring.claimed_by(1) == 0
    with pytest.raises(ClaimError, match=r"reader 0 of ring .* already taken in this process"):
        RingReader(SharedRing.attach(ring.name), 0, "cpu")
    RingReader(SharedRing.attach(ring.name), 1, "cpu").close()  # another number: fine
    first.close()
    assert ring.claimed_by(0) == 0
    second = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    del second
    gc.collect()
    RingReader(SharedRing.attach(ring.name), 0, "cpu").close()  # a collected reader's number is free

    ctx = multiprocessing.get_context("spawn")
    ready, leave = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_reader, args=(ring.name, 1, ready, leave))
    proc.start()
    try:
        assert ready.wait(120), "the reader process did not start"
        assert ring.claimed_by(1) == proc.pid
        with pytest.raises(ClaimError, match=f"reader 1 of ring .* already taken by process {proc.pid}"):
            RingReader(SharedRing.attach(ring.name), 1, "cpu")
    finally:
        leave.set()
        proc.join(60)
    taken_over = RingReader(SharedRing.attach(ring.name), 1, "cpu")  # its process exited: the claim is stale
    assert ring.claimed_by(1) == os.getpid()
    taken_over.close()


def test_release_reader_frees_a_number_by_hand(ring: SharedRing) -> None:
    """What the liveness check cannot see (a recycled process id, another PID namespace): the launcher
    frees the number itself."""
    ring.header[ring._claim0 + 0] = os.getppid()  # a live process that is no reader of this ring
    with pytest.raises(ClaimError, match=r"SharedRing.release_reader\(0\)"):
        RingReader(SharedRing.attach(ring.name), 0, "cpu")
    ring.release_reader(0)
    RingReader(SharedRing.attach(ring.name), 0, "cpu").close()
    with pytest.raises(ValueError, match="reader"):
        ring.release_reader(2)
