"""Several devices, one process: a step derived once, copied once to each device.

With tensor parallelism every rank needs the same metadata of a step. :class:`MultiStager` is a
:class:`~attnmeta.staging.Stager` whose steps are derived once, on the host, into one pinned slot and
committed with **one non-blocking copy per device** of that slot, each on that device's current
stream, followed by a fence event per device. Every builder works on it unchanged: it *is* a
stager (of its first device, the **primary**), and its steps are ordinary steps.

Ownership and stream contract
-----------------------------
- The ring of pinned slots is the primary's (:class:`~attnmeta.staging.Stager`, "Ownership and
  stream contract"). Each other device (a **mirror**) has device arenas of its own with the same
  layout: in eager mode one per ring slot, in graph mode one fixed arena per device.
- :meth:`Step.commit <attnmeta.staging.Step.commit>` copies the step's bytes to the primary (the
  primary's one copy, as a plain stager does), then, for each mirror in order, copies the same bytes
  of the same slot into that mirror's arena with ``copy_(non_blocking=True)`` on the mirror's current
  stream and records the mirror's event for the slot there. A step copies nothing when it staged
  nothing.
- A slot's pinned bytes are rewritten only after **every** device's copy of them has completed: before
  a step begins on a slot, the stager queries each mirror's event for the slot and waits (counted in
  :attr:`DeviceStats.waits` and in the stager's :attr:`~attnmeta.staging.StagerStats.waits`) only if
  that device is still behind; then the primary's own fence, as for a plain stager.
- Kernels enqueued on device ``d``'s current stream after the commit see exactly this step's data in
  device ``d``'s arena. Lifetimes are the primary step's: a replica expires with its step.

Results per device
------------------
Builders hand out the primary's metadata (``staged.result()``, :func:`attnmeta.build`,
``FusedStepBuilder.build``). :meth:`MultiStager.view` gives the same metadata on device ``d``: the same
tree of objects, host arrays shared (one pinned slot), each device tensor the view at the same place
in device ``d``'s arena. :meth:`MultiStager.result` does it for a :class:`~attnmeta.staging.Staged`.
A replica is built once per object, device and step (later calls return the same object), costs a
walk over the object's fields (no device work, no copy), and is tied to the step's lifetime like the
primary's object. Only fields that are views of the step's copy can be replicated: a builder option
that computes a field on the device when ``result()`` runs (FlashInfer ``indices="device"``, local
attention ``block_table="device"``) raises :class:`NotReplicableError` here; stage those on the host.

Graph mode
----------
With a profile, every device has one fixed arena of the primary's layout, so a CUDA graph captured on
device ``d`` over ``view(step.device_full(name), d)`` replays correctly after any later commit. When
the layout grows (before :meth:`~attnmeta.staging.Stager.freeze`) each mirror gets a new arena and a
full copy, as the primary does.

Devices
-------
``devices`` are CUDA devices with distinct indices, or (to simulate several devices on a machine
without them, as the tests and the CPU benchmark do) ``"cpu"`` repeated: each entry its own arena. A
device is named by its position in ``devices`` (0 is the primary) or, where it is unique, by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from attnmeta._fields import MetadataBase
from attnmeta.profile import StaticProfile
from attnmeta.staging._layout import FieldLayout, Slot, StepExpiredError, device_bytes, resolve_device
from attnmeta.staging._replica import (
    NotReplicableError,
    PlacementCache,
    Retarget,
    TensorAt,
    arena_view,
    kind,
    owner,
    placement,
)
from attnmeta.staging._ring import (
    _GET_CURRENT_STREAM,
    StepCore,
    checks_lifetimes,
    copied_bytes,
    fencing,
    has_open_step,
    layout_bytes,
    next_slot,
    ring_slots,
    slot_of,
    step_grew,
)
from attnmeta.staging.staged import Staged
from attnmeta.staging.stager import Stager, Step

__all__ = ["DeviceStats", "MultiStager", "NotReplicableError"]

T = TypeVar("T")
M = TypeVar("M")


@dataclasses.dataclass(slots=True)
class DeviceStats:
    """Running totals of one device of a :class:`MultiStager`."""

    copies: int = 0
    """H2D copies into this device (one per committed non-empty step)."""
    bytes: int = 0
    """Bytes of staged data copied into this device (as :attr:`~attnmeta.staging.StagerStats.bytes`)."""
    waits: int = 0
    """Times a step had to wait for this device's copy of its slot to finish (mirrors only; the
    primary's waits are the stager's :attr:`~attnmeta.staging.StagerStats.waits` minus the mirrors')."""
    wait_seconds: float = 0.0
    """Host time spent in those waits."""


class _Mirror:
    """A device other than the primary: its arenas (eager: one per slot; graph: one), its fence
    events (one per slot), its view cache."""

    __slots__ = ("arenas", "cuda", "device", "events", "graph_arena", "graph_src", "index", "pairs", "stats",
                 "stream_key", "stream_obj", "typed", "used", "views")

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.index = device.index if self.cuda else -1
        self.arenas: list[torch.Tensor | None] = [None] * num_slots
        self.events: list[Any] = [torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]
                                  for _ in range(num_slots)]
        self.used = [False] * num_slots  # a copy of the slot was issued (its event was recorded)
        self.graph_arena: torch.Tensor | None = None
        self.graph_src: torch.Tensor | None = None  # the primary's graph arena this one mirrors
        self.pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (slot, size) -> (dst, src)
        self.typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.views: dict[TensorAt, torch.Tensor] = {}
        self.stats = DeviceStats()
        self.stream_key: Any = None
        self.stream_obj: Any = None

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Device bytes (:func:`~attnmeta.staging._layout.device_bytes`)."""
        return device_bytes(self.device, nbytes)

    def stream(self) -> Any:
        """This device's current stream (the ``Stream`` object rebuilt only when it changes)."""
        get = _GET_CURRENT_STREAM
        if get is None:
            return torch.cuda.current_stream(self.device)
        key = get(self.index)
        if key != self.stream_key:
            self.stream_key = key
            self.stream_obj = torch.cuda.current_stream(self.device)
        return self.stream_obj

    def wait(self, slot: int, totals: Any) -> None:
        """Before the slot's pinned bytes are rewritten: wait (counted) if this device's last copy of
        them has not completed."""
        if not self.cuda or not self.used[slot]:
            return
        ev = self.events[slot]
        if ev.query():
            return
        t0 = time.perf_counter()
        ev.synchronize()  # the host waits for this device; counted, never silent
        dt = time.perf_counter() - t0
        self.stats.waits += 1
        self.stats.wait_seconds += dt
        totals.waits += 1
        totals.wait_seconds += dt

    def copy(self, slot: Slot, size: int, dst: torch.Tensor, staged: int) -> None:
        """The slot's first ``size`` pinned bytes into ``dst`` (this device's arena for the slot), a
        copy that carries the step's ``staged`` bytes."""
        assert slot.host is not None
        key = (slot.index, size)
        pair = self.pairs.get(key)
        if pair is None:
            pair = (dst[:size], slot.host[:size])
            if len(self.pairs) >= 512:
                self.pairs.clear()
            self.pairs[key] = pair
        pair[0].copy_(pair[1], non_blocking=True)
        if self.cuda:
            self.events[slot.index].record(self.stream())
            self.used[slot.index] = True
        self.stats.copies += 1
        self.stats.bytes += staged

    def view(self, at: TensorAt) -> torch.Tensor:
        """The view at ``at`` in this device's arena (cached per placement)."""
        arena = self.arenas[at.arena] if at.arena >= 0 else self.graph_arena
        return arena_view(at, arena, self.typed, self.views)

    def forget(self) -> None:
        """Drop the cached views (an arena was reallocated)."""
        self.typed = {}
        self.views = {}
        self.pairs = {}


class MultiStager(Stager):
    """A :class:`~attnmeta.staging.Stager` whose steps are committed to several devices, one copy each.

    Parameters
    ----------
    devices : sequence of torch.device or str
        Where the metadata goes; ``devices[0]`` is the primary (:attr:`device`): builders' results are
        its. CUDA devices with distinct indices, or ``"cpu"`` repeated (each entry its own arenas).
    num_slots : int, default 3
        Pinned ring slots (as :class:`~attnmeta.staging.Stager`).
    profile : StaticProfile, optional
        Graph mode: fixed arenas, one per device.
    initial_bytes : int, optional
        Initial slot size in eager mode; default 1 MiB, or ``max_step_bytes`` when that is smaller.
    num_kv_blocks : int, optional
        As :class:`~attnmeta.staging.Stager`.
    check_lifetimes : bool, default True
        As :class:`~attnmeta.staging.Stager`; replicas expire with their step too.

    Attributes
    ----------
    devices : tuple of torch.device
        The devices, the primary first.
    device_stats : tuple of DeviceStats
        Per device, in the order of :attr:`devices` (the primary's from its own commits).

    Raises
    ------
    ValueError
        No devices, devices of different types, a CUDA device twice or without an index past the
        first, or a device this machine does not have.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec, stage_common
    >>> multi = MultiStager(["cpu", "cpu"])           # two simulated devices
    >>> spec = BatchSpec(num_computed_tokens=[3, 0], num_scheduled_tokens=[1, 2],
    ...                  block_table=[[7, 0], [8, 9]], block_size=4)
    >>> with multi.step() as step:                    # derived once, into one pinned slot
    ...     common = stage_common(spec, step)
    >>> cm0 = common.result()                         # device 0: the primary
    >>> cm1 = multi.result(common, 1)                 # device 1: its own arena, the same bytes
    >>> cm1.slot_mapping.tolist(), cm1.slot_mapping.data_ptr() != cm0.slot_mapping.data_ptr()
    ([31, 32, 33], True)
    >>> cm1.seq_lens_cpu is cm0.seq_lens_cpu          # host twins: the one pinned slot
    True
    >>> [s.copies for s in multi.device_stats]
    [1, 1]
    """

    def __init__(
        self,
        devices: Sequence[torch.device | str],
        *,
        num_slots: int = 3,
        profile: StaticProfile | None = None,
        initial_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        check_lifetimes: bool = True,
        debug_fill: int | None = None,
        _unsafe_disable_fencing: bool = False,
    ) -> None:
        if isinstance(devices, str | torch.device) or not isinstance(devices, Sequence):
            raise TypeError(f"devices: expected a sequence of devices (e.g. ['cuda:0', 'cuda:1']), got "
                            f"{type(devices).__name__} {devices!r}")
        devs = [resolve_device(d) for d in devices]
        if not devs:
            raise ValueError("devices: at least one device")
        super().__init__(devs[0], num_slots=num_slots, profile=profile, initial_bytes=initial_bytes,
                         num_kv_blocks=num_kv_blocks, check_lifetimes=check_lifetimes, debug_fill=debug_fill,
                         _unsafe_disable_fencing=_unsafe_disable_fencing)
        devs[0] = self.device
        if len({d.type for d in devs}) > 1:
            raise ValueError(f"devices: all of one type, got {[str(d) for d in devs]}")
        if self.device.type == "cuda":
            if any(d.index is None for d in devs[1:]):
                raise ValueError(f"devices: name every CUDA device past the first with its index, got "
                                 f"{[str(d) for d in devices]}")
            if len({d.index for d in devs}) < len(devs):
                raise ValueError(f"devices: a CUDA device twice in {[str(d) for d in devs]}")
        self.devices: tuple[torch.device, ...] = tuple(devs)
        """The devices, the primary first."""
        self._mirrors = [_Mirror(d, self.num_slots) for d in devs[1:]]
        self._primary = DeviceStats()
        self._placed = PlacementCache(self)  # where device views lie, while no arena moves
        self._retargets = [Retarget(functools.partial(self._twin, k)) for k in range(len(self._mirrors))]
        if not self.graph_mode:
            for m in self._mirrors:
                for slot in ring_slots(self):
                    assert slot.host_np is not None
                    m.arenas[slot.index] = m.alloc(slot.host_np.shape[0])

    @property
    def device_stats(self) -> tuple[DeviceStats, ...]:
        """Per device, in the order of :attr:`devices`."""
        return (self._primary, *(m.stats for m in self._mirrors))

    def index(self, device: int | torch.device | str) -> int:
        """The position of ``device`` in :attr:`devices` (0: the primary).

        Raises
        ------
        ValueError
            Not one of the devices, or a device listed more than once (simulated ``"cpu"`` devices:
            name them by position).
        """
        if isinstance(device, int) and not isinstance(device, bool):
            if not 0 <= device < len(self.devices):
                raise ValueError(f"device: {device} is not a position in devices ({len(self.devices)} devices)")
            return device
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        found = [i for i, d in enumerate(self.devices) if d == dev]
        if len(found) != 1:
            raise ValueError(f"device: {device!r} is {'listed ' + str(len(found)) + ' times' if found else 'not'} in "
                             f"devices {[str(d) for d in self.devices]}; name it by its position")
        return found[0]

    # ------------------------------------------------------------------ the step's life
    def step(self) -> Step:
        """Begin a step on the next ring slot, waiting (counted) only while a device's copy of that
        slot is unfinished. See :meth:`attnmeta.staging.Stager.step`."""
        if not has_open_step(self):
            i = next_slot(self)
            if fencing(self):
                for m in self._mirrors:
                    m.wait(i, self.stats)
            for rt in self._retargets:
                rt.memo.clear()
        return super().step()

    def _commit(self, step: StepCore) -> None:
        """The primary's commit, then one copy of the same slot bytes per mirror."""
        super()._commit(step)
        if step_grew(step):  # a slot or the graph layout moved: cached placements and copy pairs name old memory
            self._forget()
        nbytes = copied_bytes(step)
        if not nbytes:
            return
        p = self._primary
        p.copies += 1
        p.bytes += nbytes
        slot = slot_of(step)
        assert slot.host_np is not None
        if self.graph_mode:
            src = self.graph_arena
            assert src is not None
            for m in self._mirrors:
                size = nbytes
                if m.graph_src is not src:  # a new layout: a new arena, copied whole
                    m.graph_arena, m.graph_src = m.alloc(layout_bytes(self)), src
                    self._forget()
                    size = layout_bytes(self)
                assert m.graph_arena is not None
                m.copy(slot, size, m.graph_arena, nbytes)
        else:
            cap = slot.host_np.shape[0]
            size = min((nbytes + 4095) & ~4095, cap)
            for m in self._mirrors:
                dst = m.arenas[slot.index]
                if dst is None or dst.shape[0] < cap:  # the slot grew
                    dst = m.arenas[slot.index] = m.alloc(cap)
                    self._forget()
                m.copy(slot, size, dst, nbytes)

    def _graph_reserve(self, name: str, dtype: np.dtype, row_shape: tuple[int, ...], capacity: int, fill: Any,
                       current: Slot) -> FieldLayout:
        """The primary's new arena (:meth:`Stager._graph_reserve`), and the placements that named the old
        one dropped (the mirrors keep theirs, which hold the live step's bytes, until the next commit)."""
        f = super()._graph_reserve(name, dtype, row_shape, capacity, fill, current)
        self._placed.clear()
        return f

    def _forget(self) -> None:
        """Drop every cached placement, view and replica (an arena moved)."""
        self._placed.clear()
        for m in self._mirrors:
            m.forget()
        for rt in self._retargets:
            rt.forget()

    # ------------------------------------------------------------------ results per device
    def view(self, obj: T, device: int | torch.device | str) -> T:
        """``obj`` (metadata a committed step of this stager handed out, a tuple, list or dict of such,
        or one device tensor of it) on ``device``.

        Parameters
        ----------
        obj : metadata object, container of them, or torch.Tensor
            On the primary, from a committed step that has not expired.
        device : int, torch.device or str
            A position in :attr:`devices`, or a device listed once.

        Returns
        -------
        The same type as ``obj``
            ``obj`` itself for the primary (and for an object without device tensors); else the same
            tree with each device tensor the view at the same place in ``device``'s arena, host arrays
            and plain values shared. The same object on every call until the next step begins.

        Raises
        ------
        NotReplicableError
            A device tensor of ``obj`` is not a view of the step's copy (see the module docstring).
        StepExpiredError, StepNotCommittedError
            The step has expired or has not committed.
        ValueError
            ``device`` is not one of :attr:`devices`; a tensor of ``obj`` is not on the primary.
        TypeError
            ``obj`` holds a value that is neither a dataclass, tuple, list, dict, tensor, array nor a
            plain value.
        """
        k = self.index(device)
        if k == 0:
            return obj
        step = self._step_of(obj)
        if step is None:
            try:
                kind(type(obj))  # (a tree view() walks; anything else would come back unchanged, its tensors the primary's)
            except TypeError as e:
                raise TypeError(f"view(): {e} (a step composer's ComposedStep: view its .metadata, .commons and "
                                f".arrays)") from None
            return obj
        rt = self._retargets[k - 1]
        rt.own = step.own if checks_lifetimes(self) else None
        rt.slot = slot_of(step).index
        try:
            out: T = rt(obj)
        except NotReplicableError as e:
            raise e.named_in(obj) from None
        return out

    def result(self, staged: Staged[Any, M], device: int | torch.device | str) -> M:
        """``staged.result()`` on ``device``: :meth:`view` of the builder's metadata.

        Parameters
        ----------
        staged : Staged
            A builder's output in a committed step of this stager.
        device : int, torch.device or str
            As :meth:`view`.

        Returns
        -------
        The builder's metadata type
            On ``device``.

        Raises
        ------
        TypeError
            ``staged`` is not a :class:`~attnmeta.staging.Staged`.
        StepNotCommittedError, StepExpiredError, NotReplicableError
            As ``staged.result()`` and :meth:`view`.
        """
        if not isinstance(staged, Staged):
            raise TypeError(f"MultiStager.result(): expected what a builder's stage() returned (a Staged), got "
                            f"{type(staged).__name__}" + (" (for metadata already made, call view(metadata, device))"
                                                          if isinstance(staged, MetadataBase) else ""))
        return self.view(staged.result(), device)

    def _step_of(self, obj: Any) -> StepCore | None:
        """The live, committed step of this stager whose metadata ``obj`` is (None: no device tensor in
        it). A metadata object names its step (its lease); a tensor, or a tree of objects that do not
        (``check_lifetimes=False``), by where its first tensor lies."""
        lease = getattr(obj, "_lease", None) if isinstance(obj, MetadataBase) else None
        if lease is None and isinstance(obj, tuple | list | dict):
            for part in obj.values() if isinstance(obj, dict) else obj:
                if isinstance(part, MetadataBase):
                    lease = getattr(part, "_lease", None)
                    if lease is not None:
                        break
        if isinstance(lease, Step):
            if lease.stager is not self:
                raise ValueError("view(): the object comes from a step of another stager")
            if lease.expired:
                raise StepExpiredError(lease.expiry())
            return lease
        t = _first_tensor(obj, set())
        if t is None:
            return None
        if t.device != self.device:
            raise ValueError(f"view(): a {tuple(t.shape)} tensor on {t.device}, not on this stager's primary "
                             f"({self.device})")
        return owner(self, placement(self, t).arena)

    def _twin(self, k: int, t: torch.Tensor) -> torch.Tensor:
        """Mirror ``k``'s view at the place of ``t`` (a view of a step's copy on the primary)."""
        if t.device != self.device:
            raise ValueError(f"view(): a {tuple(t.shape)} tensor on {t.device}, not on this stager's primary "
                             f"({self.device})")
        return self._mirrors[k].view(self._placed(t))

    def __repr__(self) -> str:
        mode = "graph" if self.graph_mode else "eager"
        return (f"MultiStager(devices=[{', '.join(str(d) for d in self.devices)}], mode={mode}, "
                f"num_slots={self.num_slots}, steps={self.stats.steps}, waits={self.stats.waits})")




def _first_tensor(obj: Any, seen: set[int]) -> torch.Tensor | None:
    """The first tensor in the tree ``obj`` (depth first), or None."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, str | bytes | int | float) or obj is None or id(obj) in seen:
        return None
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        parts: Any = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        parts = obj.values()
    elif isinstance(obj, tuple | list):
        parts = obj
    else:
        return None
    for p in parts:
        found = _first_tensor(p, seen)
        if found is not None:
            return found
    return None
