"""Staging's ring: the slots in order, their fences, the one copy per step, and a step's lifetime.

:class:`Ring` is :class:`~attnmeta.staging.Stager` less its public face: it begins steps on the slots
in ring order, waits on a slot's fence only while the GPU is behind, commits a step as one
non-blocking copy plus an event (through the driver when it can, :mod:`attnmeta.staging._driver`)
and expires the step that a new one replaces. Its memory is :class:`~attnmeta.staging._arena.Arenas`.
:class:`StepCore` is the state of a step that the ring reads.

The internal interface
----------------------
The multi-device stager, the shared ring and the replica machinery (:mod:`attnmeta.staging.multi`,
:mod:`~attnmeta.staging.shared`, :mod:`~attnmeta.staging._replica`) build on a stager's ring through
the functions at the end of this module (a step's slot, its staged fields and bytes, the ring's slots
and graph layout, ...) and override the hooks :meth:`Ring._commit`, :meth:`Ring._abandon` and those
of :class:`~attnmeta.staging._arena.Arenas`; they read no private attribute of a step or a stager.
"""

from __future__ import annotations

import difflib
import gc
import inspect
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from attnmeta.profile import StaticProfile
from attnmeta.staging import _driver
from attnmeta.staging._arena import Arenas
from attnmeta.staging._layout import (
    ALIGN,
    MAX_CACHED,
    FieldLayout,
    Restaged,
    Slot,
    StagerStats,
    StepExpiredError,
    StepStats,
    align,
    resolve_device,
)
from attnmeta.staging._lifetime import POISON_INFO, poison, poison_info

__all__ = [
    "DEFAULT_MAX_STEP_BYTES",
    "MAX_SLOTS",
    "Ring",
    "StepCore",
    "UncheckedBlockIdsWarning",
    "checks_lifetimes",
    "copied_bytes",
    "fencing",
    "graph_layout",
    "graph_live",
    "has_open_step",
    "layout_bytes",
    "next_slot",
    "ring_slots",
    "slot_of",
    "slot_owner",
    "staged_fields",
    "step_grew",
    "used_bytes",
]

T = TypeVar("T")
S = TypeVar("S", bound="StepCore")

DEFAULT_MAX_STEP_BYTES = 1 << 30
"""``Stager(max_step_bytes=...)``'s default: 1 GiB of staged bytes a step."""
DEFAULT_INITIAL_BYTES = 1 << 20
"""An eager slot's first size when ``max_step_bytes`` is larger (``Stager(initial_bytes=None)``): 1 MiB."""
MAX_SLOTS = 64
"""The most ring slots a stager may have."""


class UncheckedBlockIdsWarning(UserWarning):  # (public as attnmeta.staging.UncheckedBlockIdsWarning)
    """A CUDA stager was made without ``num_kv_blocks``: the block ids of its steps are checked for
    being negative only, not against the KV cache's size (a slot mapping could point past it)."""


_WARNED: list[bool] = []


def _warn_unchecked_block_ids() -> None:
    """Warn once per process that a CUDA stager does not check block ids against the cache."""
    if _WARNED:
        return
    _WARNED.append(True)
    warnings.warn("Stager(device='cuda') without num_kv_blocks: block ids are not checked against the KV cache's "
                  "size, so a bad block table could write KV past the cache; pass Stager(..., num_kv_blocks=N) "
                  "(warned once per process)", UncheckedBlockIdsWarning, stacklevel=4)

# this torch build lacks the private binding (then torch.cuda.current_stream is used every commit).
_GET_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
# Depths of torch's dispatch / function mode stacks: while either is non-empty (the sync audit), the
# commit's copy goes through torch so the modes see it. Private bindings, guarded: without them every
# commit goes through torch (a depth of 1 says "a mode may be active").
_DISPATCH_DEPTH: Any = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_FUNCTION_DEPTH: Any = getattr(torch._C, "_len_torch_function_stack", lambda: 1)
_CURRENT_DEVICE: Any = getattr(torch._C, "_cuda_getDevice", lambda: -2)  # -2: never a stager's device index



class Ring(Arenas):
    """The ring of :class:`~attnmeta.staging.Stager` (see the module docstring); constructed through
    it, with the parameters its docstring lists."""

    def __init__(
        self,
        device: torch.device | str,
        *positional: Any,
        num_slots: int = 3,
        profile: StaticProfile | None = None,
        stream: Any = None,
        initial_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        check_lifetimes: bool = True,
        max_step_bytes: int = DEFAULT_MAX_STEP_BYTES,
        debug_fill: int | None = None,
        _unsafe_disable_fencing: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:  # (Python's own error would name Ring.__init__)
            known = [p for p in inspect.signature(type(self)).parameters if not p.startswith("_")]
            bad = next(iter(unknown))
            close = difflib.get_close_matches(bad, known, n=1)
            raise TypeError(f"{type(self).__name__}(): no argument {bad!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(known)}"))
        if positional:  # (keyword-only after the device; Python's own error would name Ring.__init__)
            raise TypeError(f"{type(self).__name__}(): only the device is positional, got {len(positional) + 1} "
                            f"positional arguments; give the rest by keyword ({type(self).__name__}(device, "
                            f"num_slots=..., profile=...))")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int | np.integer):
            raise TypeError(f"num_slots: expected an int, got {type(num_slots).__name__} {num_slots!r}")
        if not 2 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots: must be >= 2 so a step can be built while the last copies, got {num_slots}"
                             if num_slots < 2 else f"num_slots: at most {MAX_SLOTS} (each slot is pinned memory of its "
                             f"own; a deeper ring holds no more work in flight), got {num_slots}")
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream: expected a torch.cuda.Stream or None, got {type(stream).__name__}")
        if profile is not None and not isinstance(profile, StaticProfile):
            raise TypeError(f"profile: expected a StaticProfile or None, got {type(profile).__name__}")
        _require_int("max_step_bytes", max_step_bytes, ALIGN, "")
        if initial_bytes is None:  # (the default: 1 MiB, or the whole step's bound when that is smaller)
            initial_bytes = min(DEFAULT_INITIAL_BYTES, max_step_bytes)
        _require_int("initial_bytes", initial_bytes, 0, "")
        if initial_bytes > max_step_bytes:
            raise ValueError(f"initial_bytes: {initial_bytes} is more than max_step_bytes={max_step_bytes} (a slot holds "
                             f"one step; raise max_step_bytes for larger steps)")
        if num_kv_blocks is not None:
            _require_int("num_kv_blocks", num_kv_blocks, 1, " (the KV cache's blocks) or None")
        if debug_fill is not None:
            _require_int("debug_fill", debug_fill, 0, " (a byte value, at most 255) or None")
            if debug_fill > 255:
                raise ValueError(f"debug_fill: a byte value, at most 255, got {debug_fill}")
        self._debug_fill = None if debug_fill is None else int(debug_fill)
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_kv_blocks: int | None = None if num_kv_blocks is None else int(num_kv_blocks)
        """Blocks in the KV cache the block tables index (checked by every step's common pass), or None."""
        self.max_step_bytes = int(max_step_bytes)
        """The most bytes one step may stage (eager: a slot's size; graph mode: the fixed layout)."""
        if self.device.type == "cuda" and num_kv_blocks is None:
            _warn_unchecked_block_ids()
        self._claim = threading.Lock()  # held while a step begins: the check for an open step and the claim
        self._claimer = 0  # the thread holding it
        self._lifetimes = bool(check_lifetimes)
        self._graph_live: weakref.ref[StepCore] | None = None  # graph mode: the step the device arena holds
        self.num_slots = int(num_slots)
        self.profile = profile
        self.graph_mode = profile is not None
        self._stream = stream
        self._cuda = self.device.type == "cuda"
        self._device_index = self.device.index if self._cuda else -1
        self._stream_key: Any = None
        self._stream_obj: Any = None
        self._pin = self._cuda
        self._slots = [Slot(i) for i in range(num_slots)]
        self._next = 0
        self._open: weakref.ref[StepCore] | None = None  # the step begun and not yet committed or abandoned
        self._open_slot: Slot | None = None  # ... its slot and number (to abandon it once it is gone)
        self._open_number = 0
        self._frozen = False
        self._fencing = not _unsafe_disable_fencing
        self.stats = StagerStats()
        # graph mode: one fixed layout and one device arena shared by every slot
        self._layout: dict[str, FieldLayout] = {}
        self._layout_bytes = 0
        self._graph_arena: torch.Tensor | None = None
        self._graph_typed: dict[np.dtype, torch.Tensor] = {}
        self._graph_views: dict[tuple[Any, ...], torch.Tensor] = {}
        self._graph_retired: list[torch.Tensor] = []
        self._copy_end = 0  # graph mode: bytes a commit must copy (high-water mark of non-sentinel data)
        self._full_copy_pending = True
        self._stream_handle = 0
        # CUDA commits go through the driver API when it is available (attnmeta.staging._driver);
        # the pinned slots then outlive this stager until their last copies complete.
        self._driver = _driver.load() if self._cuda else None
        if self._driver is not None and _GET_CURRENT_STREAM is not None:
            weakref.finalize(self, _driver.retire, self._slots).atexit = False  # at exit nothing is reused
        else:
            self._driver = None
        for slot in self._slots:
            self._alloc_slot(slot, max(align(initial_bytes), ALIGN))
            if self._cuda:
                slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]


    # ------------------------------------------------------------------ fencing
    def _stream_now(self) -> Any:
        if not self._cuda:
            return None
        return self._stream if self._stream is not None else self._current_stream()

    def _current_stream(self) -> Any:
        """``torch.cuda.current_stream(device)``, cached while the current stream stays the same.

        ``torch.cuda.current_stream`` builds a new Python ``Stream`` every call, which costs more host
        time than the commit's copy launch; the C-level query of the current stream's id costs a
        fraction of that, and the ``Stream`` object is rebuilt only when the id changes.
        """
        get = _GET_CURRENT_STREAM
        if get is None:
            return torch.cuda.current_stream(self.device)
        key = get(self._device_index)
        if key != self._stream_key:
            self._stream_key = key
            self._stream_obj = torch.cuda.current_stream(self.device)
            self._stream_handle = self._stream_obj.cuda_stream
        return self._stream_obj

    def _wait_slot(self, slot: Slot) -> tuple[int, float]:
        if not self._cuda or not self._fencing or slot.generation == 0:
            return 0, 0.0
        if slot.event.query():
            return 0, 0.0
        t0 = time.perf_counter()
        slot.event.synchronize()  # the host waits for the GPU; counted, never silent
        dt = time.perf_counter() - t0
        self.stats.waits += 1
        self.stats.wait_seconds += dt
        return 1, dt


    # ------------------------------------------------------------------ steps
    def _begin(self, make: Callable[[Ring, Slot, int, float], S]) -> S:
        """Begin a step on the next ring slot: claim the slot (its previous step expires), wait for its
        last copy only if the GPU is behind, and return ``make(self, slot, waits, wait_seconds)``.

        The check for an open step and the claim are one atomic act (a lock, never waited on): a second
        thread that calls this meanwhile gets the thread error, never a share of the slot."""
        claim = self._claim
        if not claim.acquire(False):
            raise RuntimeError(self._busy(None))
        try:
            self._claimer = threading.get_ident()
            if self._open is not None:
                open_step = self._live_open_step()
                if open_step is not None:
                    raise RuntimeError(self._busy(open_step))
                self._abandon_lost(warn=True)
            return self._claim_slot(make)
        finally:
            claim.release()

    def _live_open_step(self) -> StepCore | None:
        """The step begun and neither committed nor abandoned, if it is still referenced; None if there
        is none or it was dropped (then :meth:`_abandon_lost` abandons it).

        A step dropped after it staged metadata stays alive in a reference cycle (the objects it owns
        name it in their leases) until the cycle collector runs, whenever that is (never, in a loop that
        turns the collector off). So where the step is alive, this collects once and looks again: it
        runs only where a step is open when the next begins, which is an error but for a dropped one."""
        ref = self._open
        if ref is None or ref() is None:
            return None
        gc.collect()
        return ref()

    def _abandon_lost(self, *, warn: bool) -> None:
        """The open step's object is gone (it was begun outside ``with`` and dropped before it
        committed): abandon it through :meth:`_abandon`, as if it had written every row of every field
        (which rows it wrote is not known any more)."""
        slot = self._open_slot
        assert slot is not None
        self._abandon(slot, self._open_number, None)
        if warn:
            warnings.warn("Stager.step(): the last step was begun and dropped without a commit; it is abandoned "
                          "(nothing of it was copied). Use `with stager.step() as step:` so a step always ends",
                          RuntimeWarning, stacklevel=4)

    def reset(self) -> bool:
        """Abandon the open step, if any (nothing of it is copied; the next step begins on the next
        slot), whichever thread began it: the way out after a step was begun outside ``with`` and is
        still referenced. Call it only once that step's thread is done with it. Returns whether a step
        was abandoned. (A step begun and dropped without a commit is abandoned by the next
        :meth:`~attnmeta.staging.Stager.step` anyway, with a ``RuntimeWarning``.)"""
        ref = self._open
        if ref is None:
            return False
        open_step = ref()
        if open_step is None:
            self._abandon_lost(warn=False)
        else:
            open_step.abandon()
        return True

    def _claim_slot(self, make: Callable[[Ring, Slot, int, float], S]) -> S:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.num_slots
        if _driver._RETIRED:
            _driver.purge()
        st = self.stats
        st.steps_begun += 1
        if slot.generation:
            st.slot_reuses += 1
        owner = slot.owner
        prev = None if owner is None else owner()
        if prev is not None and not prev._expired:
            prev._expire(st.steps_begun)  # the new step claims the slot before it writes a byte
        waits, wait_s = self._wait_slot(slot)
        step = make(self, slot, waits, wait_s)
        self._open = slot.owner = weakref.ref(step)  # (held weakly: a step dropped while open is abandoned)
        self._open_slot, self._open_number = slot, st.steps_begun
        return step

    def _busy(self, open_step: StepCore | None) -> str:
        """The message of :meth:`step` while ``open_step`` is open (None: while another thread is
        beginning one)."""
        me = threading.get_ident()
        owner = self._claimer if open_step is None else open_step._thread
        if owner == me and open_step is not None:
            return (f"Stager.step(): step {open_step.number} has neither committed nor been abandoned; commit it "
                    f"(or leave its `with` block) first, or call stager.reset() to abandon it")
        names = {t.ident: t.name for t in threading.enumerate()}
        what = "a step is being begun by" if open_step is None else f"step {open_step.number} of"
        return (f"Stager.step(): called from thread {names.get(me, me)!r} while {what} thread "
                f"{names.get(owner, owner)!r}{'' if open_step is None else ' is open'}; a Stager is driven by one "
                f"thread at a time (give each thread its own Stager, or hand it over between steps)")

    def _commit(self, step: StepCore) -> None:
        """The step's one copy (only the bytes it staged; graph mode: sentinels refilled first) and its
        fence; the step it replaces in graph mode's arena expires."""
        slot = step._slot
        assert slot.host is not None and slot.host_np is not None
        if step._grew:
            # Migrations: a field allocated before its slot grew was written through a view of the old bytes.
            for name, f in step._fields.items():
                buf = step._bufs.get(name, step._base)
                if buf is not slot.host_np:
                    assert buf is not None
                    lo, hi = f.offset, f.offset + f.rows * f.row_bytes
                    slot.host_np[lo:hi] = buf[lo:hi]
        if self.graph_mode:
            # Sentinels: every row a field held at this slot's last commit and does not hold now is refilled.
            # A step restaged from the layout the slot's last commit was restaged from differs from it only
            # in the fields either gave other row counts (Step.restage's rows): those alone are settled.
            fields = step._fields
            done = step._restaged if step._shared and not step._grew else None
            last = slot.clean
            if done is None or last is None or done[0] is not last[0]:
                self._settle(slot, fields, self._layout)
            elif fields is not last[2]:  # (the very fields of the last commit: nothing to settle)
                self._settle(slot, fields, done[1] if done[1] == last[1] else done[1] + last[1])
            slot.clean = done
            nbytes = self._layout_bytes if self._full_copy_pending else self._copy_end
            self._full_copy_pending = False
            dst = self._graph_arena
        else:
            nbytes = step._used
            dst = slot.device_arena
        assert dst is not None
        copies = 0
        if nbytes:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    dst[:nbytes].copy_(slot.host[:nbytes], non_blocking=True)
                    slot.event.record(self._stream)
            else:
                # Eager mode copies whole 4 KiB pages (never past the slot): the (device, host) slice
                # pair of each length is cached, and rounding keeps that cache small.
                size = nbytes if self.graph_mode else min((nbytes + 4095) & ~4095, slot.host_np.shape[0])
                if self._driver is None or not self._driver_copy(slot, size):
                    pair = slot.copy_pairs.get(size)
                    if pair is None:
                        pair = (dst[:size], slot.host[:size])
                        if len(slot.copy_pairs) >= MAX_CACHED:
                            slot.copy_pairs.clear()
                        slot.copy_pairs[size] = pair
                    pair[0].copy_(pair[1], non_blocking=True)
                    if self._cuda:
                        slot.event.record(self._current_stream())
            copies = 1
        slot.generation += 1
        step._generation = slot.generation
        if self.graph_mode:  # the arena now holds this step's data: the step it held before expires
            live = self._graph_live
            prev = None if live is None else live()
            if prev is not None and not prev._expired:
                prev._expire(-step._number)
            self._graph_live = weakref.ref(step)
            self._graph_retired.clear()  # (their step has expired)
        self._open = None
        step._raw_stats = (slot.index, copies, nbytes)  # StepStats is built on demand (Step.stats)
        s = self.stats
        s.steps += 1
        s.copies += copies
        s.bytes += nbytes

    def _settle(self, slot: Slot, fields: Mapping[str, FieldLayout], names: Iterable[str]) -> None:
        """Graph mode: give the slot's rows of each field of ``names`` (fields of the layout) the row count
        ``fields`` stages (0 for one it does not stage), refilling the sentinel of the rows it held past
        that, and raise the copy's high-water mark to their end."""
        dirty_rows, end, layout = slot.dirty_rows, self._copy_end, self._layout
        for name in names:
            f = layout[name]
            staged = fields.get(name)
            rows = staged.rows if staged is not None else 0
            if dirty_rows.get(name, 0) > rows:  # rows this slot staged before: back to the sentinel
                self._fill_rows(slot, f, rows, dirty_rows[name])
            dirty_rows[name] = rows
            e = f.offset + rows * f.row_bytes
            if e > end:
                end = e
        self._copy_end = end

    def _driver_copy(self, slot: Slot, size: int) -> bool:
        """CUDA commit through the driver: the copy on the current stream (into the slot's arena, or in
        graph mode the one arena), then the slot's fence.

        Returns False (nothing enqueued, the caller uses torch) while a torch dispatch or function
        mode is active (the sync audit must see the copy), while another CUDA device is current (the
        driver call would run in that device's context), before the slot's event exists (torch
        creates it on its first record) or when the driver reports any error for the copy.
        """
        ev = slot.event.cuda_event
        if not ev or _DISPATCH_DEPTH() or _FUNCTION_DEPTH() or _CURRENT_DEVICE() != self._device_index:
            return False  # (the driver call runs in the current device's context)
        self._current_stream()  # refreshes _stream_handle if the current stream changed
        drv = self._driver
        assert drv is not None
        handle = self._stream_handle
        if drv.copy(slot.ptrs[0], slot.ptrs[1], size, handle):
            return False
        if drv.record(ev, handle):
            slot.event.record(self._stream_obj)  # the copy is enqueued; fence it the torch way
        return True

    def _abandon(self, slot: Slot, number: int, written: Mapping[str, FieldLayout] | None) -> None:
        """Close step ``number`` on ``slot`` without a copy. It claimed the slot when it began (the
        slot's previous step expired then) and may have written any of the rows of ``written`` (its
        staged fields; None: unknown, every field of graph mode's layout whole): what builders know of
        the bytes the slot holds (its extras, the recorded layouts of :meth:`Step.layout`) is dropped,
        and in graph mode those rows are refilled with their sentinels at the slot's next commit."""
        self._open = self._open_slot = None
        slot.extras = {}
        slot.version += 1
        if self.graph_mode:
            slot.clean = None
            dirty = slot.dirty_rows
            fields = self._layout if written is None else written
            for name, f in fields.items():
                rows = f.capacity if written is None else f.rows
                if rows > dirty.get(name, 0):
                    dirty[name] = rows

    def __repr__(self) -> str:
        mode = "graph" if self.graph_mode else "eager"
        return (f"Stager(device={self.device}, mode={mode}, num_slots={self.num_slots}, "
                f"steps={self.stats.steps}, waits={self.stats.waits})")


def _signature_without_positional() -> inspect.Signature:
    """``Ring.__init__``'s signature as users call it: the device, then keywords only (its ``*positional``
    and ``**unknown`` exist only to name the class in the error a stray argument raises)."""
    sig = inspect.signature(Ring.__init__)
    return sig.replace(parameters=[p for p in sig.parameters.values()
                                   if p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD])


Ring.__init__.__signature__ = _signature_without_positional()  # type: ignore[attr-defined]


def _require_int(name: str, value: Any, lo: int, what: str) -> None:
    """Raise unless ``value`` is an int (not a bool) of at least ``lo``: a ``TypeError`` for another
    type, a ``ValueError`` for a smaller int; ``what`` describes the argument after ``an int >= lo``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int >= {lo}{what}, got {type(value).__name__} {value!r:.40}")
    if value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}{what}, got {value}")


class StepCore:
    """A step's state and lifetime: the part of :class:`~attnmeta.staging.Step` the ring reads when it
    commits, abandons or expires a step (the step API is :class:`~attnmeta.staging.Step`)."""

    __slots__ = (
        "__weakref__",
        "_base",
        "_bufs",
        "_committed",
        "_expired",
        "_expired_by",
        "_fields",
        "_flat",
        "_generation",
        "_grew",
        "_lifetimes",
        "_number",
        "_owned",
        "_raw_stats",
        "_restaged",
        "_shared",
        "_slot",
        "_stager",
        "_stats",
        "_thread",
        "_used",
        "_wait_s",
        "_waits",
        "host_fields",
        "profile",
    )

    def __init__(self, stager: Ring, slot: Slot, waits: int, wait_s: float) -> None:
        self._stager = stager
        self.profile: StaticProfile | None = stager.profile
        """The stager's profile in graph mode, else ``None``."""
        self._slot = slot
        self._fields: dict[str, FieldLayout] = {}
        self._used = 0
        self._waits = waits
        self._wait_s = wait_s
        self._grew = False
        self._committed = False
        self._generation = -1
        self._stats: StepStats | None = None
        self._raw_stats: tuple[int, int, int] | None = None
        self._bufs: dict[str, np.ndarray | None] = {}  # field -> host bytes its view was carved from
        self._base = slot.host_np  # ... or these, for fields restaged (restage())
        self._shared = False  # _fields is a recorded layout's dict: copy it before adding a field
        # a restaged step: (the recorded layout's fields, the names restaged with other rows, its fields)
        self._restaged: Restaged | None = None
        self.host_fields: dict[str, Any] = {}
        """Host-only values recorded with :meth:`host_only` (never staged to the device)."""
        self._number = stager.stats.steps_begun  # this step's number: the count of steps begun, itself included
        self._thread = threading.get_ident()
        self._expired = False
        self._expired_by = 0  # the step whose beginning (or, graph mode, commit) expired this one
        self._owned: list[Any] = []  # objects whose fields view this step's memory (own())
        self._flat: list[Any] = []  # ... whose parts are owned too (own_all())
        self._lifetimes = stager._lifetimes

    # ------------------------------------------------------------------ lifetime
    @property
    def number(self) -> int:
        """This step's number: ``stats.steps_begun`` of its stager once it began (the first step is 1)."""
        return self._number

    @property
    def expired(self) -> bool:
        """Whether a newer step has claimed this step's memory (:meth:`Stager.step`, "Lifetimes")."""
        return self._expired

    def expiry(self) -> str:
        """Why this step has expired (the text of its :class:`StepExpiredError`), or ``""`` if it has not."""
        if not self._expired:
            return ""
        st = self._stager
        if self._expired_by < 0:
            return (f"step {self._number} (graph mode, ring slot {self._slot.index}) has expired: step "
                    f"{-self._expired_by} committed into the shared device arena after it; a graph-mode step's "
                    f"metadata is valid until the next step commits")
        return (f"step {self._number} (ring slot {self._slot.index} of {st.num_slots}) has expired: step "
                f"{self._expired_by} began on that slot and reuses its memory; a step's metadata is valid until "
                f"the step {st.num_slots} steps later begins (Stager(num_slots=...) sets the ring's size)")

    def own(self, obj: T) -> T:
        """Tie ``obj`` (a metadata object whose fields view this step's memory) to this step's lifetime:
        once a newer step claims the memory, reading any attribute of ``obj`` raises
        :class:`StepExpiredError`, and so does reading any metadata object held in one of its fields.
        Returns ``obj``.

        Builders call it for every object they hand out (:meth:`Staged.result
        <attnmeta.staging.Staged.result>` does it for theirs). ``obj``'s class must accept a
        ``__class__`` change to a subclass without slots of its own (any ordinary class does, slotted
        dataclasses included) and have a ``_lease`` slot or a ``__dict__``
        (:class:`attnmeta._fields.MetadataBase` has the slot). With ``Stager(check_lifetimes=False)``
        it only returns ``obj``.

        Raises
        ------
        StepExpiredError
            The step has expired already.
        """
        if self._expired:
            raise StepExpiredError(f"own(): {self.expiry()}")
        if self._lifetimes:
            object.__setattr__(obj, "_lease", self)
            self._owned.append(obj)
        return obj

    def own_all(self, objs: list[Any]) -> None:
        """:meth:`own` for each object of ``objs``, in one call, where every metadata object held in one
        of their fields is among them (a step composer hands out the common metadata, the page table
        and the builders' metadata that hold them): at expiry each becomes its expired twin with one
        class change, with no walk over its fields.

        Raises
        ------
        StepExpiredError
            The step has expired already.
        """
        if self._expired:
            raise StepExpiredError(f"own(): {self.expiry()}")
        if self._lifetimes:
            for obj in objs:
                object.__setattr__(obj, "_lease", self)
            self._flat.extend(objs)

    def _expire(self, by: int) -> None:
        """Mark the step expired by step ``by`` (negative: a graph-mode commit) and poison what it owns."""
        self._expired = True
        self._expired_by = by
        owned, self._owned = self._owned, []
        known, swap = POISON_INFO, object.__setattr__
        for obj in owned:  # (each one's _lease is this step: own() set it)
            info = known.get(type(obj))
            if info is not None and not info[1]:  # the usual object: no metadata parts, one class swap
                swap(obj, "__class__", info[0])
            else:
                poison(obj, self)
        flat, self._flat = self._flat, []
        for obj in flat:  # (own_all: their parts are among them)
            info = known.get(type(obj))
            if info is None:
                info = poison_info(type(obj))
            if info is not None:
                swap(obj, "__class__", info[0])

    @property
    def stager(self) -> Ring:
        """The :class:`Stager` this step belongs to."""
        return self._stager

    @property
    def slot_extras(self) -> dict[Any, Any]:
        """State a builder keeps with this step's ring slot, across the slot's uses (what it knows
        about bytes it left in the slot, buffers whose lifetime is the slot's). The stager never
        reads it, and empties it whenever it reallocates the slot's memory. Slots are used in ring
        order: the step begun at ``stats.steps_begun - num_slots`` was this slot's previous use."""
        return self._slot.extras

    @property
    def device_type(self) -> str:
        """``"cuda"``, ``"cpu"`` or ``"meta"``."""
        return self._stager.device.type

    @property
    def committed(self) -> bool:
        """Whether the step has committed (:meth:`Step.commit <attnmeta.staging.Step.commit>`; not when abandoned)."""
        return self._committed and self._generation >= 0

    @property
    def state(self) -> str:
        """``"open"`` (builders stage into it), ``"committed"`` (its copy is issued; its metadata is
        readable), ``"expired"`` (a newer step reuses its memory) or ``"abandoned"`` (an exception left
        its ``with`` block, or :meth:`abandon` or :meth:`Stager.reset <attnmeta.staging.Stager.reset>`
        was called: nothing of it was copied)."""
        if not self._committed:
            return "open"
        if self._generation < 0:
            return "abandoned"
        return "expired" if self._expired else "committed"

    def require_open(self, what: str) -> None:
        """Raise unless the step is open: ``what`` (e.g. ``"mybuilder: stage()"``) needs to stage into it.

        Raises
        ------
        RuntimeError
            The step has committed (or expired), or was abandoned; the message says which and what to do.
        """
        if self._committed:
            raise RuntimeError(self._closed(what))

    def _closed(self, what: str) -> str:
        """The message for ``what`` (an operation of an open step) on this step, which is not open."""
        if self._generation < 0:
            return (f"{what}: step {self._number} was abandoned (an exception left its `with stager.step()` block, "
                    f"or abandon() or stager.reset() was called) and nothing of it was copied; stage it again in a "
                    f"new step")
        return f"{what}: step {self._number} has already committed; stage into a new step (`with stager.step() as step:`)"

    def abandon(self) -> None:
        """Drop the step without copying (its slot is free for the next step)."""
        if not self._committed:
            self._stager._abandon(self._slot, self._number, self._fields)
            self._committed = True
            self._generation = -2

    def _view(self, f: FieldLayout, rows: int) -> torch.Tensor:
        """A device view of ``rows`` rows of ``f`` in this step's arena (cached; see Arenas._device_view)."""
        return self._stager._device_view(self._slot, f, rows)

    def _arena(self) -> torch.Tensor | None:
        """The device arena this step's fields live in (graph mode: the stager's one; a slot or a layout
        that grows gets a new one)."""
        st = self._stager
        return st._graph_arena if st.graph_mode else self._slot.device_arena


# ---------------------------------------------------------------------------- the internal interface
def slot_of(step: StepCore) -> Slot:
    """The ring slot ``step`` began on."""
    return step._slot


def staged_fields(step: StepCore) -> dict[str, FieldLayout]:
    """The fields ``step`` has staged, by name, in the order it reserved them (do not modify)."""
    return step._fields


def used_bytes(step: StepCore) -> int:
    """Eager mode: the bytes of ``step``'s slot its fields reach (what its copy carries)."""
    return step._used


def step_grew(step: StepCore) -> bool:
    """Whether ``step`` grew its slot or (graph mode) the layout: memory that cached views name moved."""
    return step._grew


def copied_bytes(step: StepCore) -> int:
    """The bytes ``step``'s commit copied (0 for an empty step); ``step`` has committed."""
    raw = step._raw_stats
    if raw is None:
        raise RuntimeError(f"step {step.number} has not committed")
    return raw[2]


def ring_slots(stager: Ring) -> list[Slot]:
    """The ring's slots, in ring order (do not modify the list)."""
    return stager._slots


def slot_owner(stager: Ring, index: int) -> StepCore | None:
    """The step that began on slot ``index`` last (None before the first, or if it is gone)."""
    ref = stager._slots[index].owner
    step = None if ref is None else ref()
    assert step is None or isinstance(step, StepCore)
    return step


def next_slot(stager: Ring) -> int:
    """The index of the slot the next step begins on."""
    return stager._next


def has_open_step(stager: Ring) -> bool:
    """Whether a step of ``stager`` has begun, has neither committed nor been abandoned, and is still
    referenced (a step dropped while open is abandoned when the next one begins)."""
    return stager._open is not None and stager._live_open_step() is not None


def fencing(stager: Ring) -> bool:
    """Whether a step waits for its slot's last copy (off only in the race tests' control)."""
    return stager._fencing


def checks_lifetimes(stager: Ring) -> bool:
    """Whether ``stager``'s steps expire the metadata they own (``check_lifetimes``)."""
    return stager._lifetimes


def graph_layout(stager: Ring) -> dict[str, FieldLayout]:
    """Graph mode: every field of the fixed layout, by name (the stager's own dict: do not modify)."""
    return stager._layout


def layout_bytes(stager: Ring) -> int:
    """Graph mode: the bytes of the fixed layout (the one arena's size)."""
    return stager._layout_bytes


def graph_live(stager: Ring) -> StepCore | None:
    """Graph mode: the step whose data the one arena holds (None before the first commit, or if it is gone)."""
    ref = stager._graph_live
    return None if ref is None else ref()


UncheckedBlockIdsWarning.__module__ = "attnmeta.staging"
