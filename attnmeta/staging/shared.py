"""One process per device: a step derived once into shared pinned memory, copied by every rank.

The common deployment of tensor parallelism runs one process per GPU, and each rank derives the same
metadata from the same scheduler output. Here one process, the **writer** (a rank, or a helper
process with no device of its own), derives each step into a slot of a :class:`SharedRing`, a
shared-memory segment that every process maps (and, on CUDA, registers as pinned memory with
``cudaHostRegister``); each **reader** (every other rank) commits its own one non-blocking copy of
the slot to its device and builds the step's metadata objects from a description the writer
publishes with it. Builders run in the writer only, unchanged: :class:`RingWriter` is a
:class:`~attnmeta.staging.Stager` whose ring slots are the shared ones.

The segment
-----------
A header of 64-bit words, then per ring slot a **meta** region (the published description) and a
**data** region (the slot's pinned bytes, what builders write and copies read). The header holds,
per slot, ``seq`` (the number of the step it holds, 0 for none), ``nbytes`` (bytes to copy; -1 for a
step the writer abandoned), ``arena_bytes`` (graph mode: the device arena's size) and ``meta_len``;
per reader, ``received`` (the last step it received); per reader and slot, ``done`` (the last
step of that slot it released); and per reader, ``claim`` (the process id of the reader that holds the
number, 0 for none: a second live reader under a number already held is refused, since each number's
words must have one writer).

The protocol
------------
Steps are numbered 1, 2, 3, ... in the order the writer begins them (:attr:`Step.number
<attnmeta.staging.Step.number>`); step ``n`` lives in slot ``(n - 1) % num_slots``.

1. **Writer, before step n.** Its slot last held step ``n - num_slots``. The writer waits until every
   reader's ``done`` for the slot has reached that step (counted in :attr:`RingStats.waits`; a
   :class:`TimeoutError` naming the readers behind after ``timeout`` seconds), and its own device's
   copy of the slot has completed (its stager's fence). Only then does it write a byte of the slot.
2. **Writer, publishing step n.** After the step commits (the writer's own copy, if it has a device),
   :meth:`RingWriter.publish` writes the step's field table and the description of the metadata
   objects it is given into the slot's meta region, then ``nbytes``, ``arena_bytes``, ``meta_len``,
   and last ``seq = n``. An abandoned step is published as a skip (``nbytes = -1``) at once, so
   readers keep counting.
3. **Reader, receiving step n.** It waits until its slot's ``seq`` reaches ``n`` (a larger ``seq``
   would mean the slot was rewritten before this reader released it, which the writer's wait rules
   out; it raises :class:`RingOverrunError`), stores ``received = n``, issues **one** non-blocking copy
   of the slot's ``nbytes`` into its own arena on its device's current stream and records the slot's
   event (on the CPU the copy is done when the call returns), and hands out a :class:`RingStep`.
4. **Reader, releasing.** A reader holds its last ``hold`` steps (default ``num_slots - 1``): their
   metadata stays valid (host views read the shared slot) until it receives the step ``hold`` later,
   when they expire (reading them raises :class:`~attnmeta.staging.StepExpiredError`; in graph mode a step's
   device views also expire when the next step's copy is issued into the one arena). Step ``q`` is
   **released**, ``done = q`` for its slot, once it has expired *and* its copy's event has completed;
   a reader checks both whenever it receives or waits. So ``done`` covers the reader's copy as well as
   every read of the slot's host memory.

Hence the guarantee: **a slot is rewritten only after every reader's copy of it has completed and no
reader holds its step** (the writer's own copy is fenced by its stager); no reader ever reads a slot
that was rewritten under it. The writer can be ``num_slots - hold`` steps ahead of the slowest
reader's receive (one, by default: enough for tensor-parallel ranks that run each step together).
The race test (``tests/staging/test_shared.py``; tests/gpu on two GPUs) holds each reader's copies
back and checks every step's device bytes and host views against what the writer wrote; with
``RingWriter(..., _unsafe_disable_fencing=True)`` (the writer waits for ``received`` only, not for
``done``) the same test sees torn steps.

Ordering between processes: every counter is one aligned 64-bit word written by one process, and
each side puts a memory fence between its data and the counter that publishes it (a lock released
and taken again: a full barrier on every platform CPython runs on).

What a reader gets
------------------
The writer's :meth:`~RingWriter.publish` takes named metadata objects (what the builders returned)
and describes each as a skeleton (``marshal``-ed into the slot's meta region): the same tree with
each device view replaced by its place in the arena (offset, dtype, shape, strides) and each host
view of the slot by its place in the slot; other host arrays and plain values go by value. An object
of a type the writer has described before on the same slot goes as a **patch**: only the fields that
are not the very objects they were (a replayed layout changes a few scalars and views a step). Every
reader applies every step's patches in order when it receives the step (a patch of a state it does
not hold raises :class:`DescriptionError`), and builds the objects on its own memory on first use:
device views in its arena, host views read-only in its mapping of the shared slot.
:meth:`RingStep.result` returns them; :meth:`RingStep.device` and :meth:`RingStep.host` give the
raw staged fields.

Why one module
--------------
The segment's layout, the writer's half of the protocol and the readers' half are one contract: the
header words each side writes and the other waits on, the order of a slot's words, what a release
means. Split over modules, each side would reach into the other's offsets and private state.
"""

from __future__ import annotations

import collections
import dataclasses
import marshal
import os
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from attnmeta.profile import StaticProfile
from attnmeta.staging._claim import ClaimError, claim, release
from attnmeta.staging._copy import CopyEngine, DeviceCopyEngine
from attnmeta.staging._layout import (
    STAGEABLE_DTYPES,
    CapacityError,
    FieldLayout,
    Slot,
    StepExpiredError,
    align,
    device_bytes,
    plain_tensors,
    resolve_device,
)
from attnmeta.staging._lifetime import poison
from attnmeta.staging._replica import (
    ArrayAt,
    Decoder,
    DescriptionError,
    Encoder,
    NotReplicableError,
    PlacementCache,
    Resolver,
    TensorAt,
    arena_view,
)
from attnmeta.staging._ring import (
    StepCore,
    copied_bytes,
    has_open_step,
    layout_bytes,
    next_slot,
    slot_of,
    staged_fields,
    step_grew,
)
from attnmeta.staging.stager import Stager, Step

__all__ = [
    "ClaimError",
    "CopyEngine",
    "DescriptionError",
    "DeviceCopyEngine",
    "ReaderStats",
    "RingOverrunError",
    "RingReader",
    "RingStats",
    "RingStep",
    "RingWriter",
    "SharedRing",
]

_MAGIC = 0x61746E6D72696E67  # "atnmring"
_FORMAT = 2
_PAGE = 4096
# header words
_W_MAGIC, _W_FORMAT, _W_SLOTS, _W_SLOT_BYTES, _W_META_BYTES, _W_READERS, _W_MODE, _W_CLOSED, _W_PUBLISHED = range(9)
_W_SLOT0 = 16  # per slot: seq, nbytes, arena_bytes, meta_len
_SEQ, _NBYTES, _ARENA, _META = range(4)
_MODE_EAGER, _MODE_GRAPH = 1, 2

_FENCE = threading.Lock()
_FENCE.acquire()


def _fence() -> None:
    """A full memory barrier: a lock's release (store-release) followed by taking it again (an
    acquire read-modify-write). Orders this process's data stores before its next counter store,
    and its counter loads before its next data loads, on weakly ordered CPUs too."""
    _FENCE.release()
    _FENCE.acquire()


def _pause(spins: int) -> None:
    """One turn of a wait loop: yield for the first ~100 us, then sleep 50 us, after ~0.1 s 1 ms."""
    if spins < 200:
        time.sleep(0)
    elif spins < 2200:
        time.sleep(50e-6)
    else:
        time.sleep(1e-3)


class RingOverrunError(RuntimeError):
    """A reader found its next step's slot already holding a later step: the slot was rewritten
    before this reader released it (impossible while the writer fences; see the protocol)."""


class SharedRing:
    """The shared-memory segment of a ring: a header, then per slot a meta and a data region.

    Create it once (:meth:`create`, in the writer or a launcher), pass :attr:`name` to every other
    process, and :meth:`attach` there. Not constructed directly.

    Attributes
    ----------
    name : str
        The segment's name (``/dev/shm/<name>`` on Linux).
    num_slots, slot_bytes, meta_bytes, num_readers : int
        The ring's shape: slots, bytes of each slot's data and meta regions, readers.
    """

    def __init__(self, name: str, buf: Any, owner: Any, created: bool) -> None:
        self.name = name
        self._buf = buf  # memoryview or mmap of the whole segment
        self._owner = owner  # the SharedMemory / mmap object keeping the mapping alive
        self._created = created
        hdr = np.ndarray((_W_SLOT0,), np.int64, buffer=buf)
        if int(hdr[_W_MAGIC]) != _MAGIC or int(hdr[_W_FORMAT]) != _FORMAT:
            raise ValueError(f"SharedRing {name!r}: not an attnmeta ring of format {_FORMAT}")
        self.num_slots = int(hdr[_W_SLOTS])
        self.slot_bytes = int(hdr[_W_SLOT_BYTES])
        self.meta_bytes = int(hdr[_W_META_BYTES])
        self.num_readers = int(hdr[_W_READERS])
        S, R = self.num_slots, self.num_readers
        self._received0 = _W_SLOT0 + 4 * S
        self._done0 = self._received0 + R
        self._claim0 = self._done0 + R * S
        words = self._claim0 + R
        self.header = np.ndarray((words,), np.int64, buffer=buf)
        """The header's 64-bit words (see the module docstring)."""
        head = _round_page(8 * words)
        stride = self.meta_bytes + self.slot_bytes
        u8 = np.ndarray((head + S * stride,), np.uint8, buffer=buf)
        self._u8 = u8
        self.meta = [u8[head + i * stride: head + i * stride + self.meta_bytes] for i in range(S)]
        """Per slot: its meta region (uint8)."""
        self.data = [u8[head + i * stride + self.meta_bytes: head + (i + 1) * stride] for i in range(S)]
        """Per slot: its data region (uint8), the slot's pinned bytes."""
        with plain_tensors():
            self._tensor = torch.from_numpy(u8)
        self.slot_tensors = [self._tensor[head + i * stride + self.meta_bytes: head + (i + 1) * stride]
                             for i in range(S)]
        """Per slot: the data region as a uint8 torch tensor (the source of every copy)."""
        self._pinned = False
        path = "/dev/shm/" + name.lstrip("/")
        self._lock_fd: int | None = os.open(path, os.O_RDWR) if os.path.exists(path) else None
        """The segment's file, open while this object lives: reader claims ``flock`` it."""
        if self._lock_fd is not None:
            weakref.finalize(self, os.close, self._lock_fd)

    @staticmethod
    def size(*, num_readers: int, num_slots: int = 3, slot_bytes: int = 1 << 20, meta_bytes: int = 1 << 16) -> int:
        """Bytes of a segment of this shape.

        Parameters
        ----------
        num_readers : int
            Processes that copy from the ring (every rank but the writer).
        num_slots : int, default 3
            Ring slots (>= 2).
        slot_bytes : int, default 1 MiB
            Each slot's data region (rounded up to 4 KiB): the most a step may stage.
        meta_bytes : int, default 64 KiB
            Each slot's meta region (rounded up to 4 KiB): the most a published description may take.

        Returns
        -------
        int
        """
        words = _W_SLOT0 + 4 * num_slots + num_readers * (num_slots + 2)
        return _round_page(8 * words) + num_slots * (_round_page(meta_bytes) + _round_page(slot_bytes))

    @classmethod
    def create(cls, *, num_readers: int, num_slots: int = 3, slot_bytes: int = 1 << 20, meta_bytes: int = 1 << 16,
               name: str | None = None) -> SharedRing:
        """Create a ring (the creator unlinks it: :meth:`unlink`).

        Parameters
        ----------
        num_readers : int
            Processes that will copy from it (every rank but the writer), >= 1.
        num_slots : int, default 3
            Ring slots, >= 2.
        slot_bytes : int, default 1 MiB
            Each slot's data region (rounded up to 4 KiB). A step that needs more raises
            :class:`~attnmeta.staging.CapacityError` (the slots never grow).
        meta_bytes : int, default 64 KiB
            Each slot's meta region (rounded up to 4 KiB).
        name : str, optional
            The segment's name; default a fresh one.

        Returns
        -------
        SharedRing

        Raises
        ------
        ValueError
            A count or size out of range.
        """
        for what, v, low in (("num_readers", num_readers, 1), ("num_slots", num_slots, 2),
                             ("slot_bytes", slot_bytes, 1), ("meta_bytes", meta_bytes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{what}: expected an int >= {low}, got {v!r}")
        slot_bytes, meta_bytes = _round_page(slot_bytes), _round_page(meta_bytes)
        size = cls.size(num_readers=num_readers, num_slots=num_slots, slot_bytes=slot_bytes, meta_bytes=meta_bytes)
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        hdr = np.ndarray((_W_SLOT0 + 4 * num_slots + num_readers * (num_slots + 2),), np.int64, buffer=shm.buf)
        hdr[:] = 0
        hdr[_W_FORMAT], hdr[_W_SLOTS], hdr[_W_SLOT_BYTES] = _FORMAT, num_slots, slot_bytes
        hdr[_W_META_BYTES], hdr[_W_READERS] = meta_bytes, num_readers
        hdr[_W_MAGIC] = _MAGIC
        return cls(shm.name, shm.buf, shm, True)

    @classmethod
    def attach(cls, name: str) -> SharedRing:
        """Map an existing ring by name (in a reader, or a writer that did not create it).

        On Linux the segment is mapped from ``/dev/shm`` directly, so this process's exit never
        unlinks it (Python's resource tracker would, for a segment attached as a ``SharedMemory``).

        Parameters
        ----------
        name : str
            :attr:`name` of the created ring.

        Returns
        -------
        SharedRing

        Raises
        ------
        FileNotFoundError
            No such segment.
        ValueError
            The segment is not a ring of this format.
        """
        path = "/dev/shm/" + name.lstrip("/")
        if os.path.isdir("/dev/shm"):
            import mmap

            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            return cls(name, mm, mm, False)
        shm = shared_memory.SharedMemory(name=name)  # pragma: no cover - platforms without /dev/shm
        return cls(name, shm.buf, shm, False)

    def pin(self) -> None:
        """Register the whole segment with CUDA as page-locked memory in this process
        (``cudaHostRegister``), so copies from it run asynchronously; once per process (later calls
        do nothing). Readers and writers on CUDA call it themselves.

        Raises
        ------
        RuntimeError
            CUDA refused the registration.
        """
        if self._pinned:
            return
        rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            self._tensor.data_ptr(), self._tensor.numel(), 0)
        if int(getattr(rc, "value", rc)) != 0:
            raise RuntimeError(f"SharedRing {self.name!r}: cudaHostRegister of {self._tensor.numel()} bytes failed ({rc})")
        self._pinned = True

    def close(self) -> None:
        """Mark the ring closed for readers: a reader's :meth:`RingReader.receive` returns None once
        it has received every published step. (The mapping itself lives until this object is
        collected.)"""
        _fence()
        self.header[_W_CLOSED] = 1

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (by any process)."""
        return bool(self.header[_W_CLOSED])

    def unlink(self) -> None:
        """Remove the segment's name (the creator does, once every process has attached); mappings
        stay valid until their processes drop them."""
        if isinstance(self._owner, shared_memory.SharedMemory):
            self._owner.unlink()
        else:
            os.unlink("/dev/shm/" + self.name.lstrip("/"))

    def claimed_by(self, reader: int) -> int:
        """The process id of the :class:`RingReader` that holds number ``reader`` (0: none)."""
        return int(self.header[self._claim0 + reader])

    def release_reader(self, reader: int) -> None:
        """Free reader number ``reader`` by hand, whoever holds it.

        A reader frees its number itself (:meth:`RingReader.close`), and a number whose process has
        exited is taken over by the next reader. This is for what that check
        cannot see: a recycled process id, or a reader in another PID namespace.
        """
        if not 0 <= reader < self.num_readers:
            raise ValueError(f"reader: expected an int in [0, {self.num_readers}), got {reader!r}")
        release(self.header, self._claim0 + reader, self._lock_fd, (self.name, reader), None)

    def slot_word(self, slot: int, word: int) -> int:
        """Header word ``word`` (0 seq, 1 nbytes, 2 arena_bytes, 3 meta_len) of ``slot``."""
        return int(self.header[_W_SLOT0 + 4 * slot + word])

    def received(self, reader: int) -> int:
        """The last step ``reader`` received."""
        return int(self.header[self._received0 + reader])

    def done(self, reader: int, slot: int) -> int:
        """The last step of ``slot`` that ``reader`` released."""
        return int(self.header[self._done0 + reader * self.num_slots + slot])

    def __repr__(self) -> str:
        return (f"SharedRing({self.name!r}, num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
                f"num_readers={self.num_readers}, published={int(self.header[_W_PUBLISHED])})")


def _round_page(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in elements."""
    out = []
    acc = 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


# ---------------------------------------------------------------------------------------------- writer
@dataclasses.dataclass(slots=True)
class RingStats:
    """A :class:`RingWriter`'s running totals of the ring protocol."""

    published: int = 0
    """Steps published (committed and abandoned)."""
    waits: int = 0
    """Steps that had to wait for a reader to release their slot."""
    wait_seconds: float = 0.0
    """Host time spent in those waits."""
    meta_bytes: int = 0
    """Bytes of published descriptions, in total."""


class RingWriter(Stager):
    """The one process that derives steps into a :class:`SharedRing`: a stager whose ring slots are
    the ring's.

    Builders stage into its steps as into any stager's. After each committed step call
    :meth:`publish` with the metadata objects the readers need (none for raw fields only); an
    abandoned step is published as a skip by itself. The next step does not begin before the last
    committed one is published.

    Parameters
    ----------
    ring : SharedRing
        Created with as many readers as there are other ranks.
    device : torch.device or str, default "meta"
        The writer's own device: ``cuda[:n]`` for a rank that also computes (its copy and fence are
        its stager's), ``cpu``, or ``meta`` for a helper process without a device (nothing is copied
        there; the metadata it builds describes the layout).
    profile : StaticProfile, optional
        Graph mode (every reader then keeps one fixed arena).
    num_kv_blocks : int, optional
        As :class:`~attnmeta.staging.Stager`.
    check_lifetimes : bool, default True
        As :class:`~attnmeta.staging.Stager`.
    timeout : float, default 60
        Seconds to wait for a reader to release a slot before a :class:`TimeoutError`.

    Raises
    ------
    ValueError
        ``ring`` already has a writer of another mode, or a bad device.
    """

    def __init__(
        self,
        ring: SharedRing,
        device: torch.device | str = "meta",
        *,
        profile: StaticProfile | None = None,
        num_kv_blocks: int | None = None,
        check_lifetimes: bool = True,
        timeout: float = 60.0,
        _unsafe_disable_fencing: bool = False,
    ) -> None:
        if not isinstance(ring, SharedRing):
            raise TypeError(f"ring: expected a SharedRing, got {type(ring).__name__}")
        self._ring = ring
        dev = resolve_device(device)
        if dev.type == "cuda":
            ring.pin()
        mode = _MODE_GRAPH if profile is not None else _MODE_EAGER
        was = int(ring.header[_W_MODE])
        if was and was != mode:
            raise ValueError(f"ring {ring.name!r}: a writer in {'graph' if was == _MODE_GRAPH else 'eager'} mode "
                             f"has used it already")
        ring.header[_W_MODE] = mode
        self.timeout = float(timeout)
        """Seconds to wait for a reader before a :class:`TimeoutError`."""
        self.ring_stats = RingStats()
        """The protocol's running totals."""
        self._unpublished: StepCore | None = None
        self._ring_fencing = not _unsafe_disable_fencing
        super().__init__(dev, num_slots=ring.num_slots, profile=profile, initial_bytes=ring.slot_bytes,
                         num_kv_blocks=num_kv_blocks, check_lifetimes=check_lifetimes,
                         _unsafe_disable_fencing=_unsafe_disable_fencing)
        self._placed = PlacementCache(self)
        self._arrays: dict[int, tuple[np.ndarray, ArrayAt | None]] = {}
        self._publishing = -1  # the slot of the step publish() is describing
        self._encoder = Encoder(self._place, self._array)
        # per slot: (a step's field dict, its marshalled table); a restaged step shares its layout's dict
        self._fields_blob: list[tuple[Any, bytes]] = [(None, b"")] * ring.num_slots
        self._bounds = [(int(d.ctypes.data), int(d.ctypes.data) + d.shape[0]) for d in ring.data]

    @property
    def ring(self) -> SharedRing:
        """The ring the steps go to."""
        return self._ring

    # ---------------------------------------------------------------- the slots are the ring's
    def _alloc_slot(self, slot: Slot, nbytes: int) -> None:
        ring = self._ring
        if nbytes > ring.slot_bytes:
            raise CapacityError(f"a slot of {nbytes} bytes; the ring's slots hold {ring.slot_bytes} "
                                f"(SharedRing.create(slot_bytes=...))")
        slot.host, slot.host_np = ring.slot_tensors[slot.index], ring.data[slot.index]
        if not self.graph_mode:
            slot.device_arena = self._alloc_arena(ring.slot_bytes)
            if self.device.type == "cuda":
                slot.ptrs = (slot.device_arena.data_ptr(), slot.host.data_ptr())
        elif self.device.type == "cuda":
            slot.ptrs = (0, slot.host.data_ptr())

    def _grow_slot(self, slot: Slot, need: int) -> np.ndarray:
        raise CapacityError(f"a step needs {need} bytes; the shared ring's slots hold {self._ring.slot_bytes} and "
                            f"never grow (SharedRing.create(slot_bytes=...))")

    def _graph_reserve(self, name: str, dtype: np.dtype, row_shape: tuple[int, ...], capacity: int, fill: Any,
                       current: Slot) -> FieldLayout:
        row = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        end = align(layout_bytes(self)) + align(row * capacity)
        if end > self._ring.slot_bytes:
            raise CapacityError(f"{name}: the graph layout would need {end} bytes; the shared ring's slots hold "
                                f"{self._ring.slot_bytes} (SharedRing.create(slot_bytes=...))")
        return super()._graph_reserve(name, dtype, row_shape, capacity, fill, current)

    # ---------------------------------------------------------------- the protocol
    def step(self) -> Step:
        """Begin a step on the next ring slot once every reader has released it (and this device's
        copy of it has completed). See :meth:`attnmeta.staging.Stager.step`.

        Raises
        ------
        RuntimeError
            The last committed step has not been published.
        TimeoutError
            A reader has not released the slot within :attr:`timeout` seconds.
        """
        if self._unpublished is not None:
            raise RuntimeError(f"RingWriter.step(): step {self._unpublished.number} committed but was not "
                               f"published; call publish() (with its metadata, or none) first")
        if not has_open_step(self):
            self._wait_readers(next_slot(self))
        return super().step()

    def _wait_readers(self, slot: int) -> None:
        ring = self._ring
        prev = ring.slot_word(slot, _SEQ)
        if prev <= 0:
            return
        hdr, R, S = ring.header, ring.num_readers, ring.num_slots
        if self._ring_fencing:
            words = [ring._done0 + r * S + slot for r in range(R)]
        else:  # the control of the race test: readers have received the step, maybe not copied it
            words = [ring._received0 + r for r in range(R)]
        if all(hdr[w] >= prev for w in words):
            _fence()
            return
        t0 = time.perf_counter()
        spins = 0
        while not all(hdr[w] >= prev for w in words):
            if time.perf_counter() - t0 > self.timeout:
                behind = [r for r, w in enumerate(words) if hdr[w] < prev]
                raise TimeoutError(
                    f"RingWriter: readers {behind} have not released step {prev} (slot {slot}) after "
                    f"{self.timeout:g} s (received: {[ring.received(r) for r in behind]})")
            _pause(spins)
            spins += 1
        _fence()
        st = self.ring_stats
        st.waits += 1
        st.wait_seconds += time.perf_counter() - t0

    def _commit(self, step: StepCore) -> None:
        super()._commit(step)
        if step_grew(step):
            self._placed.clear()
            self._encoder.forget()
        self._unpublished = step

    def _abandon(self, slot: Slot, number: int, written: Mapping[str, FieldLayout] | None) -> None:
        super()._abandon(slot, number, written)
        self._announce(slot.index, number, -1, 0, 0)  # (a skip: a dropped step's too)

    def publish(self, results: Mapping[str, Any] | None = None) -> None:
        """Publish the last committed step to the readers, with ``results`` for
        :meth:`RingStep.result`.

        Parameters
        ----------
        results : mapping of str to metadata, optional
            Named metadata objects of the step (what its builders returned, a ``FusedStep``, or
            containers of them). Their device views must be views of the step's copy (builders
            computing a field on the device at ``result()`` are refused), their host arrays go by
            place when they view the slot and by value otherwise.

        Raises
        ------
        RuntimeError
            No committed step waits to be published.
        attnmeta.staging.NotReplicableError
            A device tensor of ``results`` is not a view of the step's copy (the step stays
            unpublished: publish it again without it).
        CapacityError
            The description exceeds the ring's ``meta_bytes``.
        """
        step = self._unpublished
        if step is None:
            raise RuntimeError("RingWriter.publish(): no committed step to publish (each step is published once)")
        if results is not None and not isinstance(results, Mapping):
            raise TypeError(f"RingWriter.publish(): results must be a mapping of name to metadata (e.g. "
                            f"{{'attn': metadata}}), got {type(results).__name__}")
        skel: dict[str, Any] = {}
        if results:
            enc = self._encoder
            self._publishing = enc.slot = slot_of(step).index
            enc.memo.clear()
            try:
                skel = {str(name): enc(obj) for name, obj in results.items()}
            except BaseException as e:
                enc.forget()  # its states moved on for objects that will not be sent: start whole again
                if isinstance(e, NotReplicableError):
                    raise e.named_in(dict(results), "results") from None
                raise
        fields = staged_fields(step)
        i = slot_of(step).index
        cached = self._fields_blob[i]
        if cached[0] is not fields:  # (a restaged step shares its layout's table)
            table = {n: (f.offset, f.dtype.str, f.row_shape, f.rows, f.capacity) for n, f in fields.items()}
            cached = self._fields_blob[i] = (fields, marshal.dumps(table))
        try:
            blob = marshal.dumps((cached[1], skel))
        except ValueError as e:  # (a value of a type marshal refuses slipped through: nothing is sent)
            self._encoder.forget()
            raise ValueError(f"publish(): the step's description holds a value marshal cannot write ({e}); the "
                             f"step stays unpublished: publish it again without it") from None
        ring = self._ring
        if len(blob) > ring.meta_bytes:
            self._encoder.forget()
            raise CapacityError(f"publish(): the step's description takes {len(blob)} bytes; the ring's meta "
                                f"regions hold {ring.meta_bytes} (SharedRing.create(meta_bytes=...))")
        ring.meta[i][: len(blob)] = np.frombuffer(blob, np.uint8)
        self._announce(slot_of(step).index, step.number, copied_bytes(step), layout_bytes(self) if self.graph_mode else 0,
                       len(blob))
        self._unpublished = None
        self.ring_stats.meta_bytes += len(blob)

    def _announce(self, slot: int, number: int, nbytes: int, arena_bytes: int, meta_len: int) -> None:
        """Write the words of step ``number`` in ring slot ``slot``, then (after a fence) its ``seq``."""
        ring = self._ring
        base = _W_SLOT0 + 4 * slot
        hdr = ring.header
        hdr[base + _NBYTES], hdr[base + _ARENA], hdr[base + _META] = nbytes, arena_bytes, meta_len
        _fence()
        hdr[base + _SEQ] = number
        hdr[_W_PUBLISHED] = number
        self.ring_stats.published += 1

    def _place(self, t: torch.Tensor) -> TensorAt:
        at = self._placed(t)
        if at.arena >= 0 and at.arena != self._publishing:
            raise ValueError(f"publish(): a {tuple(t.shape)} tensor of the step in slot {at.arena}, not of the step "
                             f"being published (slot {self._publishing})")
        return at

    def _array(self, a: np.ndarray) -> ArrayAt | None:
        hit = self._arrays.get(id(a))
        if hit is not None and hit[0] is a:
            at = hit[1]
        else:
            at = None
            ptr = int(a.__array_interface__["data"][0])
            for i, (lo, hi) in enumerate(self._bounds):
                if lo <= ptr < hi:
                    at = ArrayAt(i, ptr - lo, a.dtype.str, tuple(a.shape), tuple(a.strides))
                    break
            if len(self._arrays) >= 4096:
                self._arrays.clear()
            self._arrays[id(a)] = (a, at)
        if at is not None and at.slot != self._publishing:
            raise ValueError(f"publish(): a {a.shape} {a.dtype} host view of the step in slot {at.slot}, not of the "
                             f"step being published (slot {self._publishing}): a reader would read it after that "
                             f"slot is rewritten")
        return at

    def close(self) -> None:
        """Tell the readers no step follows (after the last :meth:`publish`).

        A committed step not yet published (an engine stopped between its commit and its publish) goes to
        the readers as a skip, as an abandoned step does, with a warning; the ring closes either way."""
        step, self._unpublished = self._unpublished, None
        if step is not None:
            self._announce(slot_of(step).index, step.number, -1, 0, 0)
        self._ring.close()
        if step is not None:  # (after the ring is closed: a warnings filter that raises leaks nothing)
            warnings.warn(f"RingWriter.close(): step {step.number} was committed but never published; the readers "
                          f"skip it", stacklevel=2)

    def __repr__(self) -> str:
        mode = "graph" if self.graph_mode else "eager"
        return (f"RingWriter({self._ring.name!r}, device={self.device}, mode={mode}, steps={self.stats.steps}, "
                f"waits={self.ring_stats.waits})")


# ---------------------------------------------------------------------------------------------- readers
@dataclasses.dataclass(slots=True)
class ReaderStats:
    """A :class:`RingReader`'s running totals."""

    steps: int = 0
    """Steps received (skips included)."""
    copies: int = 0
    """Copies issued (one per received step that staged bytes)."""
    bytes: int = 0
    """Bytes copied."""
    waits: int = 0
    """Receives that had to wait for the writer to publish."""
    wait_seconds: float = 0.0
    """Host time spent in those waits."""


class RingReader:
    """A rank that copies the writer's steps from a :class:`SharedRing` to its own device.

    Parameters
    ----------
    ring : SharedRing
        The ring (:meth:`SharedRing.attach` in this process).
    reader : int
        This reader's number, ``0 <= reader < ring.num_readers``; one live reader each, in the whole
        machine: the number is claimed here and freed by :meth:`close` or by its process's exit (a
        reader collected without ``close()`` frees it for its own process only).
    device : torch.device or str
        This rank's device (``cuda:n``, or ``cpu`` to run the protocol without a GPU).
    check_lifetimes : bool, default True
        Expire a step's metadata when it is released (see the protocol); False skips the bookkeeping.
    timeout : float, optional
        Default seconds :meth:`receive` waits for the writer; None waits until the ring is closed.
    copier : CopyEngine, optional
        How copies are issued and fenced; default :class:`DeviceCopyEngine` (tests pass one that holds
        copies back).
    hold : int, optional
        How many received steps stay valid: a step expires when the step ``hold`` later is received.
        Default ``num_slots - 1`` (as a :class:`~attnmeta.staging.Stager`'s owner holds its last
        ``num_slots - 1`` steps while it builds the next); at least 1, at most ``num_slots - 1``. The
        writer can then be ``num_slots - hold`` steps ahead of this reader's receives.

    Raises
    ------
    ValueError
        ``reader`` or ``hold`` out of range, or a device this machine does not have.
    ClaimError
        (a ValueError) Another live reader, in this process or another, holds number ``reader``
        (:meth:`SharedRing.claimed_by` names its process; :meth:`SharedRing.release_reader` frees it).
    """

    def __init__(self, ring: SharedRing, reader: int, device: torch.device | str, *, check_lifetimes: bool = True,
                 timeout: float | None = None, copier: CopyEngine | None = None, hold: int | None = None) -> None:
        if not isinstance(ring, SharedRing):
            raise TypeError(f"ring: expected a SharedRing, got {type(ring).__name__}")
        if isinstance(reader, bool) or not isinstance(reader, int) or not 0 <= reader < ring.num_readers:
            raise ValueError(f"reader: expected an int in [0, {ring.num_readers}), got {reader!r}")
        S = ring.num_slots
        hold = S - 1 if hold is None else hold
        if isinstance(hold, bool) or not isinstance(hold, int) or not 1 <= hold <= S - 1:
            raise ValueError(f"hold: expected an int in [1, {S - 1}] (the ring has {S} slots), got {hold!r}")
        self.hold = hold
        """Received steps that stay valid (see the parameter)."""
        self.ring = ring
        self.reader = reader
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            ring.pin()
        self.timeout = timeout
        self.stats = ReaderStats()
        """Running totals."""
        self._copier: CopyEngine = copier if copier is not None else DeviceCopyEngine(self.device, ring.num_slots)
        self._lifetimes = bool(check_lifetimes)
        self._seq = ring.received(reader)
        self._arenas: list[torch.Tensor | None] = [None] * S
        self._graph_arena: torch.Tensor | None = None
        self._views: dict[TensorAt, torch.Tensor] = {}
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._host: dict[ArrayAt, np.ndarray] = {}
        self._decoder = Decoder(self._device_view, self._host_view)
        self._resolver = Resolver()
        self._decoding = 0  # the step whose objects the decoder's memo holds
        self._pending: collections.deque[tuple[int, int, Any]] = collections.deque()  # (step, slot, fence)
        self._live: collections.deque[RingStep] = collections.deque()
        claim(ring.header, ring._claim0 + reader, ring._lock_fd, (ring.name, reader), self,
              f"reader {reader} of ring {ring.name!r}")

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return device_bytes(self.device, nbytes)

    def receive(self, timeout: float | None = -1.0) -> RingStep | None:
        """Wait for the writer's next step, commit this rank's one copy of it, and return it.

        Parameters
        ----------
        timeout : float or None, optional
            Seconds to wait for the writer (None: until the ring is closed); default :attr:`timeout`.

        Returns
        -------
        RingStep or None
            The step (abandoned steps are skipped), or None once the ring is closed and every
            published step has been received.

        Raises
        ------
        TimeoutError
            Nothing published within ``timeout``.
        RingOverrunError
            The slot holds a later step (the writer does not fence: see the protocol).
        """
        wait = self.timeout if timeout == -1.0 else timeout
        ring, S = self.ring, self.ring.num_slots
        hdr = ring.header
        while True:
            n = self._seq + 1
            i = (n - 1) % S
            seq_word = _W_SLOT0 + 4 * i + _SEQ
            self._release()
            if hdr[seq_word] < n:
                t0 = time.perf_counter()
                spins = 0
                while hdr[seq_word] < n:
                    if hdr[_W_CLOSED] and hdr[_W_PUBLISHED] < n:
                        return None
                    if wait is not None and time.perf_counter() - t0 > wait:
                        raise TimeoutError(f"RingReader {self.reader}: step {n} not published after {wait:g} s")
                    _pause(spins)
                    spins += 1
                    if spins % 16 == 0:
                        self._release()
                self.stats.waits += 1
                self.stats.wait_seconds += time.perf_counter() - t0
            _fence()
            got = int(hdr[seq_word])
            if got != n:
                raise RingOverrunError(f"RingReader {self.reader}: slot {i} holds step {got}, expected step {n}: "
                                       f"it was rewritten before this reader released it")
            self._seq = n
            hdr[ring._received0 + self.reader] = n
            self.stats.steps += 1
            self._expire(n)
            nbytes = int(hdr[_W_SLOT0 + 4 * i + _NBYTES])
            if nbytes < 0:  # an abandoned step: nothing to copy or hold
                self._pending.append((n, i, None))
                continue
            fence = None
            if nbytes:
                arena_bytes = int(hdr[_W_SLOT0 + 4 * i + _ARENA])
                if arena_bytes:  # graph mode: one arena of the layout's size
                    dst = self._graph_arena
                    if dst is None or dst.shape[0] != arena_bytes:
                        dst = self._graph_arena = self._alloc(arena_bytes)
                        self._views, self._typed = {}, {}
                        self._decoder.forget()
                        nbytes = arena_bytes
                else:
                    dst = self._arenas[i]
                    if dst is None:
                        dst = self._arenas[i] = self._alloc(ring.slot_bytes)
                    nbytes = min((nbytes + 4095) & ~4095, ring.slot_bytes)
                fence = self._copier.copy(dst[:nbytes], ring.slot_tensors[i][:nbytes], i)
                self.stats.copies += 1
                self.stats.bytes += nbytes
            self._pending.append((n, i, fence))
            step = RingStep(self, n, i, int(hdr[_W_SLOT0 + 4 * i + _META]), bool(int(hdr[_W_SLOT0 + 4 * i + _ARENA])))
            self._live.append(step)
            step._resolve()  # every step, in order: the writer's patches build on the last state
            self._release()  # the step `hold` back expired just now
            return step

    def _expire(self, n: int) -> None:
        """Receiving step ``n``: steps older than the last :attr:`hold` expire (graph mode: every earlier
        one, whose device views the new copy overwrites)."""
        keep = self.hold
        live = self._live
        while live and (live[0].number <= n - keep or live[0]._graph):
            live.popleft()._expire(n)

    def _release(self) -> None:
        """Release every expired step whose copy has completed (its slot's ``done``)."""
        pending = self._pending
        if not pending:
            return
        oldest = self._seq - self.hold
        hdr, base = self.ring.header, self.ring._done0 + self.reader * self.ring.num_slots
        released = False
        while pending and pending[0][0] <= oldest and self._copier.done(pending[0][2]):
            n, i, _ = pending.popleft()
            if not released:
                _fence()  # every read of the slot (copy, host views) before the counter that frees it
                released = True
            hdr[base + i] = n

    def close(self) -> None:
        """Stop reading: expire every step and release every slot this reader holds (waiting for
        their copies), so the writer is never held back by a reader that has left, and free this
        reader's number for another."""
        for st in self._live:
            st._expire(self._seq + 1)
        self._live.clear()
        base = self.ring._done0 + self.reader * self.ring.num_slots
        for n, i, fence in self._pending:
            while not self._copier.done(fence):
                time.sleep(1e-4)
            _fence()
            self.ring.header[base + i] = n
        self._pending.clear()
        release(self.ring.header, self.ring._claim0 + self.reader, self.ring._lock_fd, (self.ring.name, self.reader),
                self)

    # ---------------------------------------------------------------- views
    def _device_view(self, at: TensorAt) -> torch.Tensor:
        arena = self._arenas[at.arena] if at.arena >= 0 else self._graph_arena
        return arena_view(at, arena, self._typed, self._views)

    def _host_view(self, at: ArrayAt) -> np.ndarray:
        v = self._host.get(at)
        if v is not None:
            return v
        v = np.ndarray(at.shape, np.dtype(at.dtype), buffer=self.ring.data[at.slot], offset=at.offset,
                       strides=at.strides)
        v.flags.writeable = False
        if len(self._host) >= 4096:
            self._host.clear()
        self._host[at] = v
        return v

    def __repr__(self) -> str:
        return f"RingReader({self.ring.name!r}, reader={self.reader}, device={self.device}, received={self._seq})"


class RingStep:
    """A step a :class:`RingReader` received: its metadata on the reader's device.

    Device views are valid for work enqueued on the reader's current stream after
    :meth:`RingReader.receive` returned it; host views are read-only views of the shared slot. Both
    until the step expires (the reader receives the step :attr:`RingReader.hold` later; in graph mode
    the device views also when the next step is received).
    """

    __slots__ = ("_expired_by", "_graph", "_meta_len", "_owned", "_reader", "_results", "_table", "_wire", "expired",
                 "number", "slot")

    def __init__(self, reader: RingReader, number: int, slot: int, meta_len: int, graph: bool) -> None:
        self._reader = reader
        self.number = number
        """The writer's step number."""
        self.slot = slot
        """The ring slot it lives in."""
        self._meta_len = meta_len
        self._graph = graph
        self._wire: tuple[bytes, dict[str, Any]] | None = None
        self._table: dict[str, tuple[Any, ...]] | None = None
        self._results: dict[str, Any] = {}
        self._owned: list[Any] = []
        self.expired = False
        """Whether the reader has released the step (its metadata raises when read)."""
        self._expired_by = 0

    def expiry(self) -> str:
        """Why this step has expired (the text of its :class:`~attnmeta.staging.StepExpiredError`), or ``""``."""
        if not self.expired:
            return ""
        return (f"ring step {self.number} (slot {self.slot}) has expired for reader {self._reader.reader}: it "
                f"received step {self._expired_by}; a ring step's metadata is valid until the reader receives the "
                f"step {self._reader.hold} later (graph mode: the next one)")

    def own(self, obj: Any) -> Any:
        """Tie ``obj`` (metadata viewing this step's memory) to this step's lifetime; returns it."""
        if self.expired:
            raise StepExpiredError(f"own(): {self.expiry()}")
        object.__setattr__(obj, "_lease", self)
        self._owned.append(obj)
        return obj

    def _expire(self, by: int) -> None:
        self.expired = True
        self._expired_by = by
        owned, self._owned = self._owned, []
        for obj in owned:
            poison(obj, self)

    def _resolve(self) -> None:
        """Unmarshal the step's description and resolve its patches (at receive, in order)."""
        table, skel = marshal.loads(self._reader.ring.meta[self.slot][: self._meta_len].data)
        if skel:
            res = self._reader._resolver
            res.slot = self.slot
            res.memo = {}
            skel = {name: res(w) for name, w in skel.items()}
        self._wire = (table, skel)

    def _load(self) -> tuple[bytes, dict[str, Any]]:
        """``(marshalled field table, {name: resolved skeleton})`` of the step."""
        if self.expired:
            raise StepExpiredError(self.expiry())
        d = self._wire
        assert d is not None
        return d

    def _fields(self) -> dict[str, tuple[Any, ...]]:
        f = self._table
        if f is None:
            f = self._table = marshal.loads(self._load()[0])
        elif self.expired:  # (the table is cached; the slot's bytes are a newer step's)
            raise StepExpiredError(self.expiry())
        return f

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the metadata objects the writer published with this step."""
        return tuple(self._load()[1])

    def result(self, name: str) -> Any:
        """The published metadata object ``name``, on this reader's device (built on first use).

        Raises
        ------
        KeyError
            The writer published no object of that name.
        StepExpiredError
            The step has expired.
        """
        skel = self._load()[1]
        if name not in skel:
            raise KeyError(f"{name!r}: the writer published {sorted(skel)} with step {self.number}")
        got = self._results.get(name)
        if got is None:
            rd = self._reader
            dec = rd._decoder
            dec.own = self.own if rd._lifetimes else None
            dec.slot = self.slot
            if rd._decoding != self.number:  # shared parts are shared within a step only
                dec.memo = {}
                rd._decoding = self.number
            got = self._results[name] = dec(skel[name])
        return got

    @property
    def field_names(self) -> tuple[str, ...]:
        """The step's staged fields."""
        return tuple(self._fields())

    def device(self, name: str) -> torch.Tensor:
        """The device view of staged field ``name``, ``(rows, *row_shape)``, on this reader's device."""
        off, dt, row_shape, rows, _cap = self._fields()[name]
        return self._view(off, dt, row_shape, rows)

    def device_full(self, name: str) -> torch.Tensor:
        """Graph mode: the full-capacity device view of ``name`` (a fixed address: capture over it)."""
        if not self._graph:
            raise RuntimeError("device_full(): only a graph-mode ring has fixed capacities")
        off, dt, row_shape, _rows, cap = self._fields()[name]
        return self._view(off, dt, row_shape, cap)

    def host(self, name: str) -> np.ndarray:
        """The read-only host view of staged field ``name`` in the shared slot."""
        off, dt, row_shape, rows, _cap = self._fields()[name]
        shape = (rows, *row_shape)
        itemsize = np.dtype(dt).itemsize
        return self._reader._host_view(ArrayAt(self.slot, off, dt, shape,
                                               tuple(s * itemsize for s in _c_strides(shape))))

    def _view(self, off: int, dt: str, row_shape: tuple[int, ...], rows: int) -> torch.Tensor:
        dtype = np.dtype(dt)
        shape = (rows, *row_shape)
        return self._reader._device_view(TensorAt(-1 if self._graph else self.slot, off // dtype.itemsize,
                                                  STAGEABLE_DTYPES[dtype], shape, _c_strides(shape)))

    def __repr__(self) -> str:
        state = "expired" if self.expired else "live"
        return f"RingStep({self.number}, slot={self.slot}, {state})"

