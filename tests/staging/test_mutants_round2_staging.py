"""The shared ring's edges that the protocol tests left open: a step that stages nothing, a device
tensor of another slot's step, a reader's memory over many steps, and a claim that another process
took after a forced release."""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Iterator

import numpy as np
import pytest

import attnmeta
from attnmeta import stage_common
from attnmeta.backends import flash_attn
from attnmeta.staging.shared import RingReader, RingStep, RingWriter, SharedRing
from attnmeta.testing.workloads import mixed_spec


@pytest.fixture
def ring() -> Iterator[SharedRing]:
    r = SharedRing.create(num_readers=1, num_slots=3, slot_bytes=1 << 20)
    yield r
    r.unlink()


def test_a_step_that_stages_nothing_is_received_not_skipped(ring: SharedRing) -> None:
    """A committed step with no staged field copies 0 bytes; it is still a step (with its published
    values), unlike an abandoned one (-1 bytes), and the reader hands it out in its turn."""
    writer = RingWriter(ring, "cpu", timeout=10)
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    try:
        with writer.step():
            pass
        writer.publish({"note": {"rows": 3}})
        with writer.step() as step:
            step.alloc("x", 2, np.int32)[:] = 7
        writer.publish()
        first = rd.receive(timeout=10)
        assert first is not None and first.number == 1 and first.result("note") == {"rows": 3}
        assert first.field_names == ()
        second = rd.receive(timeout=10)
        assert second is not None and second.number == 2 and second.device("x").tolist() == [7, 7]
        assert rd.stats.steps == 2 and rd.stats.copies == 1
    finally:
        rd.close()


def test_a_device_tensor_of_another_slots_step_is_refused(ring: SharedRing) -> None:
    """A reader resolves a device view by its slot's arena: a tensor of the previous step (another
    slot) would be read there after that slot is rewritten, so publish() refuses it and the step stays
    unpublished."""
    writer = RingWriter(ring, "cpu", timeout=10)
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    spec = attnmeta.BatchSpec(num_computed_tokens=[9, 40], num_scheduled_tokens=[1, 1],
                              block_table=np.arange(16, dtype=np.int32).reshape(2, 8), block_size=16)
    try:
        old = flash_attn.build(spec, writer)
        writer.publish({"fa": old})
        assert rd.receive(timeout=10) is not None
        meta = flash_attn.build(spec, writer)
        with pytest.raises(ValueError, match=r"publish\(\): a \(2,\) tensor of the step in slot 0, not of the step "
                                             r"being published \(slot 1\)"):
            writer.publish({"fa": dataclasses.replace(meta, seq_lens=old.seq_lens)})
        writer.publish({"fa": meta})
        got = rd.receive(timeout=10)
        assert got is not None and got.number == 2 and got.result("fa").seq_lens.tolist() == [10, 41]
    finally:
        rd.close()


def test_a_reader_keeps_no_expired_step_alive(ring: SharedRing) -> None:
    """The reader's decoder shares a part between the objects of one step only: what it decoded for an
    expired step is dropped, so a long-running reader's memory does not grow with the step count."""
    writer = RingWriter(ring, "cpu", timeout=10)
    rd = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    rng = np.random.default_rng(5)
    try:
        for _ in range(40):
            with writer.step() as step:
                common = stage_common(mixed_spec(rng, prefills=2, decodes=3, max_prompt=50, max_context=80), step)
            writer.publish({"common": common.result()})
            got = rd.receive(timeout=10)
            assert got is not None
            got.result("common")
        del got
        gc.collect()
        alive = [o for o in gc.get_objects() if type(o) is RingStep and o._reader is rd]
        assert len(alive) <= 2 * ring.num_slots, f"{len(alive)} of 40 ring steps are still referenced"
    finally:
        rd.close()


def test_closing_a_reader_keeps_a_claim_another_process_took(ring: SharedRing) -> None:
    """After a launcher frees a number by hand and another process claims it, the reader that held it
    before and closes late clears its own registration only, not the other process's claim."""
    first = RingReader(SharedRing.attach(ring.name), 0, "cpu")
    ring.release_reader(0)
    ring.header[ring._claim0 + 0] = os.getppid()  # another live process took the number
    first.close()
    assert ring.claimed_by(0) == os.getppid()
    ring.release_reader(0)
    assert ring.claimed_by(0) == 0
