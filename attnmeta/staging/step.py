"""The step API: what a builder stages into one step, and the device views it hands out.

A :class:`Step` is begun by :meth:`Stager.step <attnmeta.staging.Stager.step>`; its builders reserve
fields (:meth:`Step.alloc`, :meth:`Step.alloc_fields`), write the step's values into the returned
pinned host views, and after :meth:`Step.commit` read the device views (:meth:`Step.device`). A
steady-state step may stage exactly the fields of an earlier step on its ring slot with one call
(:meth:`Step.layout`, :meth:`Step.restage`). The state and lifetime it shares with the ring are
:class:`~attnmeta.staging._ring.StepCore`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from attnmeta.staging._layout import (
    ALIGN,
    DTYPES,
    MAX_CACHED,
    NP_TO_TORCH,
    CapacityError,
    FieldGroup,
    FieldLayout,
    StepExpiredError,
    StepLayout,
    StepNotCommittedError,
    StepStats,
    checked_fill,
    exact_fill,
    same_fill,
)
from attnmeta.staging._ring import StepCore

__all__ = ["Step"]

_MAX_ROW_COUNTS = 32
"""Row-count combinations a recorded layout keeps the restaged fields of (:meth:`Step.restage`: the fields
given another row count than the layout's), dropped when it outgrows this. A small batch repeats a few (its
page count changes every ``block_size`` decode steps), and every entry holds a field dict, so a short list
bounds the memory."""


class Step(StepCore):
    """One step's staging area: numpy views into a pinned slot, then one copy, then device views.

    Obtain it from :meth:`Stager.step <attnmeta.staging.Stager.step>`. Not thread-safe; one open step
    per stager.
    """

    __slots__ = ()

    def alloc(
        self,
        name: str,
        shape: int | tuple[int, ...],
        dtype: npt.DTypeLike,
        *,
        capacity: int | None = None,
        fill: Any = None,
    ) -> np.ndarray:
        """Reserve a field in this step and return its writable host view (uninitialised contents).

        Parameters
        ----------
        name : str
            Field name, unique within the step.
        shape : int or tuple of int
            ``(rows, *row_shape)``; ``rows`` may vary from step to step.
        dtype : numpy dtype
            bool, int8/16/32/64, uint8 or float32.
        capacity : int, optional
            Graph mode (required there): the most ``rows`` this field can ever have. Eager mode checks
            ``rows`` against it when given.
        fill : scalar, optional
            Graph mode: sentinel written to rows ``[rows, capacity)``, fixed when the field is first
            staged (default 0); a later step may leave it out or give the same value.

        Returns
        -------
        numpy.ndarray
            ``shape`` and ``dtype``, a view into pinned host memory; write the step's values into it
            before the step commits.

        Raises
        ------
        CapacityError
            ``rows > capacity``; graph mode: a new field after :meth:`Stager.freeze`.
        ValueError
            A negative dimension; a field staged twice in one step; a ``fill`` the dtype cannot hold
            exactly (checked in eager mode too, so code that runs eager runs in graph mode). Graph
            mode: another ``fill`` than the field's layout holds.
        """
        if self._committed:
            raise RuntimeError(self._closed(f"{name}: alloc()"))
        if self._shared:
            self._fields, self._shared = dict(self._fields), False
        if type(name) is not str or not name:
            if not isinstance(name, str):
                raise TypeError(f"alloc(): a field's name is a str ('<prefix>.<field>'), got {type(name).__name__} "
                                f"{name!r}")
            if not name:
                raise ValueError("alloc(): a field's name must not be empty ('<prefix>.<field>')")
        if name in self._fields:
            raise ValueError(f"{name}: staged twice in one step (two builders of one step share a prefix? give each its "
                             f"own: (builder, its options with prefix=...))")
        row_shape: tuple[int, ...]
        if type(shape) is int:
            rows, row_shape = shape, ()
        else:
            if not isinstance(shape, np.integer | tuple | list | np.ndarray | torch.Size):
                raise TypeError(f"{name}: shape must be an int or a tuple of ints (rows, *row_shape), got "
                                f"{type(shape).__name__} {shape!r}")
            try:
                shp = (int(shape),) if isinstance(shape, np.integer) else tuple(operator.index(s) for s in shape)
            except TypeError:
                raise TypeError(f"{name}: shape must be an int or a tuple of ints (rows, *row_shape), got "
                                f"{shape!r}") from None
            rows, row_shape = int(shp[0]), shp[1:]
            if row_shape and min(row_shape) < 0:
                raise ValueError(f"{name}: negative dimension in shape {shp}")
        if rows < 0:
            raise ValueError(f"{name}: negative row count {rows}")
        dt = DTYPES.get(dtype)
        if dt is None:
            try:
                dt = np.dtype(dtype)
            except TypeError:
                hint = " (a torch dtype: pass numpy's, e.g. np.int32)" if isinstance(dtype, torch.dtype) else ""
                raise TypeError(f"{name}: dtype {dtype!r} is not a numpy dtype{hint}") from None
            if dt not in NP_TO_TORCH:
                raise TypeError(f"{name}: dtype {dt} cannot be staged")
        st = self._stager
        slot = self._slot
        if st.graph_mode:
            f = st._layout.get(name)
            if f is None:
                if capacity is None:
                    raise CapacityError(f"{name}: graph mode needs capacity= for every staged field")
                if rows > capacity:
                    raise CapacityError(f"{name}: needs {rows} rows but its capacity is {capacity}")
                f = st._graph_reserve(name, dt, row_shape, int(capacity), exact_fill(name, dt, 0 if fill is None else fill),
                                      slot)
                self._grew = True
            elif f.dtype != dt or f.row_shape != row_shape:
                raise ValueError(
                    f"{name}: staged as {dt} rows of {row_shape} but the graph layout holds {f.dtype} rows of {f.row_shape}"
                )
            elif fill is not None and fill is not f.fill and not same_fill(fill, f.fill):
                raise ValueError(f"{name}: staged with fill={fill!r} but the graph layout's sentinel is {f.fill!r} "
                                 f"(a field's fill is fixed when it is first staged)")
            if rows > f.capacity:
                raise CapacityError(
                    f"{name}: needs {rows} rows but its graph-mode capacity is {f.capacity} "
                    f"(raise the StaticProfile capacity that sizes it)"
                )
            staged = FieldLayout(name, f.offset, dt, row_shape, rows, f.capacity, f.fill)
        else:
            if capacity is not None and rows > capacity:  # (as graph mode would: eager code runs in graph mode)
                raise CapacityError(f"{name}: needs {rows} rows but its capacity is {capacity}")
            off = (self._used + ALIGN - 1) // ALIGN * ALIGN
            staged = FieldLayout(name, off, dt, row_shape, rows, rows, 0 if fill is None else checked_fill(name, dt, fill))
            end = off + staged.row_bytes * rows
            assert slot.host_np is not None
            if end > slot.host_np.shape[0]:
                if end > st.max_step_bytes:
                    raise CapacityError(
                        f"{name}: the step would stage {end} bytes ({rows} rows of {staged.row_bytes} bytes for this "
                        f"field), more than Stager(max_step_bytes={st.max_step_bytes}); a padded count or a row "
                        f"count that large is likely a mistake, else raise max_step_bytes"
                    )
                st._grow_slot(slot, end)
                self._grew = True
            self._used = end
        self._fields[name] = staged
        self._bufs[name] = slot.host_np  # the bytes this view writes into (see _commit: migrations)
        return st._host_view(slot, staged, rows)

    def alloc_fields(
        self, specs: tuple[tuple[str, Any, Any, int | None, Any], ...] | Callable[[], tuple[Any, ...]],
        key: Any = None,
    ) -> FieldGroup:
        """Reserve several fields at once and return them as a cached :class:`FieldGroup`.

        ``specs`` is a tuple of ``(name, shape, dtype, capacity, fill)`` as for :meth:`alloc`. The
        group's layout is cached per slot, keyed by the specs and where the group starts, so a step that
        repeats an earlier step's shapes on the same slot (steady-state decoding, graph-mode padding)
        gets the same group back: one dictionary lookup instead of re-deriving offsets and views.

        Parameters
        ----------
        specs : tuple of (str, int or tuple, dtype, int or None, scalar), or a callable returning one
            One entry per field; ``specs`` must be hashable (tuples and numpy dtypes are). With
            ``key``, a callable may stand in for the tuple: it is called only when the layout is not
            cached yet.
        key : hashable, optional
            A cheap value that determines ``specs`` uniquely (e.g. the builder's name and its row
            counts): the cache is then keyed by ``key`` instead of by the whole ``specs`` tuple,
            saving the per-step construction and hashing of the nested tuple.

        Returns
        -------
        FieldGroup
            ``.host`` are the writable host views (write the step's values there), ``.frozen``
            read-only views of the same memory, ``.device(step)`` the device views after the commit.

        Raises
        ------
        ValueError
            A field of the group is already staged in this step.
        CapacityError
            As :meth:`alloc`.
        """
        if self._committed:
            raise RuntimeError(self._closed("alloc_fields()"))
        slot = self._slot
        ck = (self._used, specs if key is None else key)
        hit = slot.groups.get(ck)
        if hit is not None and hit.buf is slot.host_np:
            if self._shared:
                self._fields, self._shared = dict(self._fields), False
            own = self._fields
            if own.keys().isdisjoint(hit.field_map):
                own.update(hit.field_map)
                self._bufs.update(hit.buf_map)
                if not self._stager.graph_mode:
                    self._used = hit.end
                return hit
        if callable(specs):
            specs = specs()
        views = [self.alloc(n, sh, d, capacity=c, fill=fl) for (n, sh, d, c, fl) in specs]
        bufs = {id(self._bufs[n]) for (n, *_rest) in specs}
        # ``buf`` is None when the slot grew while the group was carved (its fields live in two buffers)
        buf = self._bufs[specs[0][0]] if len(bufs) == 1 and specs else None
        group = FieldGroup([self._fields[n] for (n, *_rest) in specs], views, self._used, buf)
        if not self._grew:
            if len(slot.groups) >= MAX_CACHED:
                slot.groups.clear()
            slot.groups[ck] = group
        return group

    def stage(self, name: str, values: Any, dtype: npt.DTypeLike | None = None, **kw: Any) -> np.ndarray:
        """Copy ``values`` (a numpy array) into a new field; returns the host view. See :meth:`alloc`."""
        arr = np.asarray(values)
        out = self.alloc(name, arr.shape if arr.ndim else (1,), dtype if dtype is not None else arr.dtype, **kw)
        out[...] = arr
        return out

    def host_only(self, name: str, value: Any) -> None:
        """Record a host-only field (token ids, sizes, grid shapes): it is never staged to the device."""
        if name in self._fields:
            raise ValueError(f"{name}: already staged to the device; a field is host-only or staged, not both")
        self.host_fields[name] = value

    def host(self, name: str) -> np.ndarray:
        """The staged host view of ``name`` (valid until the stager reuses this step's slot).

        Raises
        ------
        StepExpiredError
            The step has expired.
        StepNotCommittedError
            The step was abandoned (its slot's bytes are the next step's).
        """
        self._check_host(name)
        f = self._fields.get(name)
        if f is None:
            raise self._unknown(name)
        return self._stager._host_view(self._slot, f, f.rows)

    def _unknown(self, name: str) -> KeyError:
        """The error for a field this step did not stage, listing those it did."""
        names = sorted(self._fields)
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        return KeyError(f"{name!r}: not staged in step {self.number} (its fields: {shown or 'none'})")

    def _check_host(self, name: str) -> None:
        """Raise unless this step's slot still holds its bytes (open, or committed and not expired)."""
        if self._expired:
            raise StepExpiredError(f"{name}: {self.expiry()}")
        if self._committed and self._generation < 0:
            raise StepNotCommittedError(self._closed(f"{name}: host view"))

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    @property
    def slot_bytes(self) -> int:
        """Bytes of this step's ring slot (pinned host memory; eager mode grows it on demand)."""
        assert self._slot.host_np is not None
        return int(self._slot.host_np.shape[0])

    @property
    def field_names(self) -> tuple[str, ...]:
        """The fields this step has staged so far, in the order they were reserved (each one's host view:
        :meth:`host`; after the commit its device view: :meth:`device`)."""
        return tuple(self._fields)

    # ------------------------------------------------------------------ commit
    def commit(self) -> None:
        """Issue the step's one non-blocking H2D copy and record its fence event.

        What it cost is in :attr:`stats` afterwards.
        """
        if self._committed:
            raise RuntimeError(self._closed("Step.commit()"))
        self._stager._commit(self)
        self._committed = True

    def layout(self) -> StepLayout:
        """What this committed step staged, for :meth:`restage` on a later step of the same ring slot.

        Raises
        ------
        StepNotCommittedError
            The step has not committed.
        RuntimeError
            The step grew its slot or the graph layout (its layout is not a steady-state one).
        """
        if not self.committed:
            raise StepNotCommittedError("Step.layout(): the step has not committed")
        if self._grew:
            raise RuntimeError("Step.layout(): the step grew its slot or the graph layout; record a later step")
        return StepLayout(self._slot, self._slot.version, dict(self._fields), self._used)

    def restage(self, layout: StepLayout, rows: dict[str, int] | None = None) -> bool:
        """Reserve exactly the fields of ``layout`` (a :meth:`layout` of an earlier step on this ring
        slot), at the same places, without handing out views.

        This is how a builder replays a step it staged before: it keeps the host views of its first
        step (:attr:`FieldGroup.host`, :meth:`host_full`), and a later step on the same slot reserves
        the same bytes with one call. **The caller must then write every byte of every field of the
        layout** (the slot holds whatever its last step left there) before the commit, which copies
        them exactly as if they had been allocated this step (in graph mode with the sentinel past each
        field's rows).

        Parameters
        ----------
        layout : StepLayout
            From :meth:`layout` of a committed step.
        rows : dict of str to int, optional
            Graph mode only: fields staged with another row count than in ``layout`` (at most their
            capacity).

        Returns
        -------
        bool
            True when the fields are reserved. False, with nothing reserved, when ``layout`` belongs to
            another ring slot, the slot's memory or the graph layout changed since it was recorded, or
            this step has already staged fields: the caller then stages the ordinary way.

        Raises
        ------
        CapacityError
            ``rows`` above a field's capacity.
        ValueError
            ``rows`` in eager mode, or naming a field the layout does not have.
        """
        if self._committed:
            raise RuntimeError(self._closed("restage()"))
        slot = self._slot
        if layout.slot is not slot or layout.version != slot.version or self._fields:
            return False
        done = layout.plain
        if rows:
            if not self._stager.graph_mode:
                raise ValueError("restage(rows=...): only graph mode has fixed offsets; eager rows are part of the "
                                 "layout")
            fields = layout.fields
            changed = []  # (the fields given another row count than the layout's)
            for item in rows.items():
                f = fields.get(item[0])
                if f is None or type(item[1]) is not int or f.rows != item[1]:
                    changed.append(item)
            if changed:
                key = tuple(changed)
                found = layout.by_rows.get(key)
                if found is None:
                    made = dict(fields)
                    for name, n in changed:
                        made[name] = self._with_rows(layout, name, n)
                    found = (fields, tuple([name for name, _n in changed]), made)
                    if len(layout.by_rows) >= _MAX_ROW_COUNTS:
                        layout.by_rows.clear()
                    layout.by_rows[key] = found
                done = found
        self._fields, self._shared = done[2], True  # copied only if the step adds a field
        self._restaged = done
        self._base = slot.host_np
        self._used = layout.end
        return True

    def _with_rows(self, layout: StepLayout, name: str, n: Any) -> FieldLayout:
        """``layout``'s field ``name`` staged with ``n`` rows (graph mode), checked."""
        f = layout.fields.get(name)
        if f is None:
            raise ValueError(f"restage(rows=...): {name} is not a field of the layout")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"restage(rows=...): {name} needs a row count >= 0, got {n!r}")
        if n > f.capacity:
            raise CapacityError(f"{name}: needs {n} rows but its graph-mode capacity is {f.capacity}")
        return f.with_rows(int(n))

    @property
    def stats(self) -> StepStats:
        """This step's :class:`StepStats` (after commit)."""
        st = self._stats
        if st is None:
            raw = self._raw_stats
            if raw is None:
                raise StepNotCommittedError("Step.stats: the step has not committed yet")
            st = self._stats = StepStats(raw[0], raw[1], raw[2], self._waits, self._wait_s, self._grew)
        return st

    def device(self, name: str) -> torch.Tensor:
        """The device view of ``name``: ``(rows, *row_shape)``, valid for work enqueued after the commit.

        Raises
        ------
        StepNotCommittedError
            The step has not committed: the device memory does not hold this step's data yet.
        StepExpiredError
            Eager mode: the stager has reused this step's slot for a newer step.
        KeyError
            ``name`` was not staged in this step.
        """
        if self._generation >= 0 and not self._expired:
            try:
                f = self._fields[name]
            except KeyError:
                raise self._unknown(name) from None
            return self._view(f, f.rows)
        if self._expired:
            raise StepExpiredError(f"{name}: {self.expiry()}")
        if self._committed:  # (abandoned)
            raise StepNotCommittedError(self._closed(f"{name}: device view"))
        raise StepNotCommittedError(
            f"{name}: device view requested before the step committed; stage everything, commit "
            f"(or leave the `with stager.step()` block), then read device fields"
        )

    def device_full(self, name: str) -> torch.Tensor:
        """Graph mode: the full-capacity device view of ``name`` (fixed address; rows past this step's
        length hold the sentinel). Capture CUDA graphs over these."""
        st = self._stager
        if not st.graph_mode:
            raise RuntimeError("device_full(): only graph mode has fixed capacities")
        if not self.committed:
            if self._committed:  # (abandoned)
                raise StepNotCommittedError(self._closed(f"{name}: device view"))
            raise StepNotCommittedError(f"{name}: device view requested before the step committed")
        f = st._layout[name]
        return self._view(f, f.capacity)

    def host_full(self, name: str) -> np.ndarray:
        """Graph mode: the full-capacity writable host view of ``name`` in this step's pinned slot
        (the host twin of :meth:`device_full`; rows past this step's length hold the sentinel).

        Raises
        ------
        StepExpiredError, StepNotCommittedError
            As :meth:`host`: the slot's bytes are a newer step's.
        """
        st = self._stager
        if not st.graph_mode:
            raise RuntimeError("host_full(): only graph mode has fixed capacities")
        self._check_host(name)
        f = st._layout[name]
        return st._host_view(self._slot, f, f.capacity)

    def __enter__(self) -> Step:
        if self._committed:
            raise RuntimeError(self._closed("with step"))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._committed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abandon()

    def __repr__(self) -> str:
        return f"Step(slot={self._slot.index}, {self.state}, fields={list(self._fields)})"
