"""Staging's memory: the pinned host slots, the device arenas and graph mode's fixed layout.

:class:`Arenas` is the part of :class:`~attnmeta.staging.Stager` that owns bytes: it allocates a
slot's pinned host memory and (eager mode) its device arena, grows a slot, lays out graph mode's
fields in the one shared arena, and builds host and device views of a field. The ring
(:class:`~attnmeta.staging._ring.Ring`) adds the fences, the commit and the steps' order on top.

Subclass hooks (the shared ring's writer overrides them to use the ring's slots): :meth:`_alloc_slot`,
:meth:`_grow_slot`, :meth:`_graph_reserve`; :meth:`_alloc_arena` allocates device bytes.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from attnmeta.staging._layout import (
    MAX_CACHED,
    NP_TO_TORCH,
    CapacityError,
    FieldLayout,
    Slot,
    StagerStats,
    align,
    device_bytes,
    plain_tensors,
)

__all__ = ["Arenas"]

logger = logging.getLogger("attnmeta.staging")


class Arenas:
    """The memory of a stager: ring slots' bytes, device arenas, graph mode's layout (see the module
    docstring). Its state is set by :class:`~attnmeta.staging._ring.Ring`'s constructor."""

    device: torch.device
    graph_mode: bool
    max_step_bytes: int
    stats: StagerStats
    _cuda: bool
    _pin: bool
    _slots: list[Slot]
    _frozen: bool
    _layout: dict[str, FieldLayout]  # graph mode: every field, at its fixed offset and capacity
    _layout_bytes: int
    _graph_arena: torch.Tensor | None
    _graph_typed: dict[np.dtype, torch.Tensor]
    _graph_views: dict[tuple[Any, ...], torch.Tensor]
    _full_copy_pending: bool
    _debug_fill: int | None
    _graph_retired: list[torch.Tensor]  # graph mode: arenas the layout grew out of since the last commit

    def _wait_slot(self, slot: Slot) -> tuple[int, float]:
        """Wait until ``slot``'s last copy has completed (the ring's fence: Ring._wait_slot)."""
        raise NotImplementedError

    def _stream_now(self) -> Any:
        """The stream commits copy on (Ring._stream_now; None off CUDA)."""
        raise NotImplementedError

    def _alloc_host(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        # Pinned memory is resident from the start; pageable memory is touched now (zeros), so a step
        # that first reaches into a page does not pay the page fault (several us each in a VM).
        with plain_tensors():
            t = (torch.empty if self._pin else torch.zeros)(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        a = t.numpy()
        if self._debug_fill is not None:  # (Stager(debug_fill=...): a byte no step wrote shows)
            a.fill(self._debug_fill)
        return t, a

    def _alloc_arena(self, nbytes: int) -> torch.Tensor:
        """Device bytes (:func:`~attnmeta.staging._layout.device_bytes`)."""
        t = device_bytes(self.device, nbytes)
        if self._debug_fill is not None and self.device.type != "meta":
            with plain_tensors():
                t.fill_(self._debug_fill)  # (a device op: no sync)
        return t

    def _alloc_slot(self, slot: Slot, nbytes: int) -> None:
        slot.host, slot.host_np = self._alloc_host(nbytes)
        if not self.graph_mode:
            slot.device_arena = self._alloc_arena(nbytes)
            if self._cuda:
                slot.ptrs = (slot.device_arena.data_ptr(), slot.host.data_ptr())
        elif self._cuda:  # graph mode: every slot copies into the one arena (its address: _graph_reserve)
            slot.ptrs = (0, slot.host.data_ptr())

    def _grow_slot(self, slot: Slot, need: int) -> np.ndarray:
        """Eager mode: grow ``slot`` to hold ``need`` bytes; returns the old host bytes.

        Views already handed out this step still point into the old bytes and may still be written;
        the step copies them over (:meth:`Step.commit`, "migrations") just before its one H2D copy.
        """
        assert slot.host_np is not None
        new_size = align(max(need, min(2 * slot.host_np.shape[0], self.max_step_bytes)))
        old_host = slot.host_np
        logger.info("attnmeta.staging: growing slot %d to %d bytes (outside steady state)", slot.index, new_size)
        slot.host, slot.host_np = self._alloc_host(new_size)
        slot.device_arena = self._alloc_arena(new_size)
        if self._cuda:
            slot.ptrs = (slot.device_arena.data_ptr(), slot.host.data_ptr())
        slot.typed = {}
        slot.views = {}
        slot.groups = {}
        slot.extras = {}
        slot.copy_pairs = {}
        slot.version += 1
        self.stats.grows += 1
        return old_host

    def _graph_reserve(
        self, name: str, dtype: np.dtype, row_shape: tuple[int, ...], capacity: int, fill: Any, current: Slot
    ) -> FieldLayout:
        """Graph mode: lay out a new field after the last one (``current`` is the open step's slot; every
        other slot's last copy is waited for before its host bytes move) and re-create the arena."""
        if self._frozen:
            raise CapacityError(
                f"{name}: new staged field after Stager.freeze(); declare every field (run one step of each "
                f"kind) before freezing the layout for CUDA-graph capture"
            )
        f = FieldLayout(name, align(self._layout_bytes), dtype, row_shape, capacity, capacity, fill)
        if f.offset + f.nbytes > self.max_step_bytes:
            raise CapacityError(
                f"{name}: the graph layout would take {f.offset + f.nbytes} bytes ({capacity} rows of {f.row_bytes} "
                f"bytes for this field), more than Stager(max_step_bytes={self.max_step_bytes}); lower the "
                f"StaticProfile capacity that sizes it, or raise max_step_bytes"
            )
        self._layout[name] = f
        self._layout_bytes = f.offset + align(f.nbytes)
        logger.info("attnmeta.staging: graph layout adds %s (%s x %s %s), %d bytes total",
                    name, capacity, row_shape, dtype, self._layout_bytes)
        self.stats.grows += 1
        # Re-create the arena at the new size. The fields before the new one keep their offsets: the old
        # arena's bytes are carried over, so a committed step that is still live (graph mode: until the
        # next commit) reads its data from a view made now as from one made before.
        old_arena = self._graph_arena
        self._graph_arena = self._alloc_arena(self._layout_bytes)
        if old_arena is not None:
            self._carry(old_arena, self._graph_arena)
        arena_ptr = self._graph_arena.data_ptr() if self._cuda else 0
        self._graph_typed = {}
        self._graph_views = {}
        for s in self._slots:
            s.groups = {}
            s.extras = {}
            s.copy_pairs = {}  # they slice the old arena
            s.version += 1
        for slot in self._slots:
            assert slot.host_np is not None
            if slot.host_np.shape[0] < self._layout_bytes:
                old = slot.host_np
                if slot is not current:
                    self._wait_slot(slot)
                slot.host, slot.host_np = self._alloc_host(align(max(self._layout_bytes, 2 * old.shape[0])))
                slot.host_np[: old.shape[0]] = old
            self._fill_rows(slot, f, 0, capacity)
            slot.dirty_rows[name] = 0
            slot.clean = None
            if self._cuda:
                assert slot.host is not None
                slot.ptrs = (arena_ptr, slot.host.data_ptr())
        self._full_copy_pending = True
        return f

    def _carry(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Graph mode: ``old``'s bytes into the start of ``new`` (a device copy ordered after the last
        commit's copy and ``new``'s allocation); ``old`` is kept, and indexed for replicas, until the
        next commit expires the step it holds."""
        n = old.shape[0]
        with plain_tensors():
            if self._cuda:
                stream = self._stream_now()
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    new[:n].copy_(old, non_blocking=True)
                old.record_stream(stream)
            elif self.device.type != "meta":
                new[:n].copy_(old)
        self._graph_retired.append(old)

    @property
    def graph_arenas(self) -> list[torch.Tensor]:
        """Graph mode: the arena, then those the layout grew out of since the last commit (whose step,
        the last committed one, may still hand out views of them); empty in eager mode or before the
        first field."""
        return [*([] if self._graph_arena is None else [self._graph_arena]), *self._graph_retired]

    @property
    def graph_fields(self) -> dict[str, FieldLayout]:
        """Graph mode: every field of the fixed layout, by name (a copy; empty in eager mode)."""
        return dict(self._layout)

    @property
    def graph_arena(self) -> torch.Tensor | None:
        """Graph mode: the one device arena (uint8) every field lives in, at the offsets of
        :attr:`graph_fields`; None in eager mode or before the first field."""
        return self._graph_arena

    def freeze(self) -> None:
        """Graph mode: forbid new fields from now on (call before capturing CUDA graphs)."""
        if not self.graph_mode:
            raise RuntimeError("freeze(): only a graph-mode stager (constructed with profile=) has a fixed layout")
        self._frozen = True

    def _host_view(self, slot: Slot, f: FieldLayout, rows: int) -> np.ndarray:
        return np.ndarray((rows, *f.row_shape), dtype=f.dtype, buffer=slot.host_np, offset=f.offset)  # type: ignore[arg-type]

    def _fill_rows(self, slot: Slot, f: FieldLayout, start: int, stop: int) -> None:
        if stop > start:
            self._host_view(slot, f, stop)[start:stop] = f.fill

    def _typed(self, arena: torch.Tensor, dtype: np.dtype, cache: dict[np.dtype, torch.Tensor]) -> torch.Tensor:
        t = cache.get(dtype)
        if t is None:
            tdt = NP_TO_TORCH[dtype]
            usable = arena.shape[0] // dtype.itemsize * dtype.itemsize
            with plain_tensors():  # (a dtype view made inside inference mode would be an inference tensor)
                t = arena[:usable].view(tdt)
            cache[dtype] = t
        return t

    def _device_view(self, slot: Slot, f: FieldLayout, rows: int) -> torch.Tensor:
        """A device view of ``rows`` rows of ``f``; cached per arena by (offset, dtype, shape).

        A cached view aliases exactly the bytes a fresh one would, so reusing the tensor object across
        steps is equivalent (it saves a torch view construction per field per step).
        """
        if self.graph_mode:
            arena, cache, views = self._graph_arena, self._graph_typed, self._graph_views
        else:
            arena, cache, views = slot.device_arena, slot.typed, slot.views
        key = (f.offset, f.dtype, rows, f.row_shape)
        v = views.get(key)
        if v is not None:
            return v
        assert arena is not None
        typed = self._typed(arena, f.dtype, cache)
        shape = (rows, *f.row_shape)
        strides = []
        acc = 1
        for d in reversed(shape[1:]):
            strides.append(acc)
            acc *= d
        strides.reverse()
        v = typed.as_strided(shape, (acc, *strides), f.offset // f.dtype.itemsize)
        if len(views) >= 4 * MAX_CACHED:
            views.clear()
        views[key] = v
        return v
