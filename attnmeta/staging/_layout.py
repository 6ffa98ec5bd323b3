"""Staging's data: the ring slots, where each staged field lies, the cached field groups and the
errors and statistics that the ring (:mod:`attnmeta.staging._ring`), its arenas
(:mod:`attnmeta.staging._arena`) and the step API (:mod:`attnmeta.staging.step`) share.

Nothing here reads a stager's or a step's state: :class:`FieldGroup` reaches its step through the
:class:`StepViews` protocol that :class:`~attnmeta.staging.Step` implements.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

__all__ = [
    "ALIGN",
    "DTYPES",
    "MAX_CACHED",
    "NP_TO_TORCH",
    "STAGEABLE_DTYPES",
    "CapacityError",
    "FieldGroup",
    "FieldLayout",
    "Restaged",
    "Slot",
    "StagerStats",
    "StepExpiredError",
    "StepLayout",
    "StepNotCommittedError",
    "StepStats",
    "StepViews",
    "align",
    "bucket_rows",
    "device_bytes",
    "plain_tensors",
    "resolve_device",
]

ALIGN = 64  # bytes; every field starts on a 64-byte boundary
NP_TO_TORCH = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
}


STAGEABLE_DTYPES: Mapping[np.dtype, torch.dtype] = MappingProxyType(NP_TO_TORCH)
"""The numpy dtypes a step can stage, and the torch dtype of each one's device view."""

DTYPES: dict[Any, np.dtype] = {}
for _d in NP_TO_TORCH:
    DTYPES[_d] = _d
    DTYPES[_d.type] = _d


class StepNotCommittedError(RuntimeError):
    """A step's device views were requested before the step committed (they would hold stale data)."""


class StepExpiredError(RuntimeError):
    """A step's metadata (a field of a metadata object, a device or host view) was read after a newer
    step claimed the step's memory; the message names both steps and the ring slot."""


class CapacityError(ValueError):
    """A graph-mode field needs more room than its declared capacity (or a new field after freeze)."""




def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def exact_fill(name: str, dtype: np.dtype, fill: Any) -> Any:
    """``fill``, a graph-mode field's sentinel, checked to be a value ``dtype`` holds exactly (-1 in a
    uint8, 0.7 in an int32, 5 in a bool or 1e50 in a float32 would be stored as another value).

    Raises
    ------
    ValueError
        Naming the field, the fill and the dtype.
    """
    try:
        given = np.asarray(fill)
        with np.errstate(all="ignore"):  # (an overflowing cast is what this finds)
            stored = given.astype(dtype)
        exact = given.shape == () and (stored.astype(given.dtype) == given or (given != given and stored != stored))
    except (TypeError, ValueError, OverflowError):
        exact = False
    if not exact:
        raise ValueError(f"{name}: fill={fill!r} is not a {dtype} value (a sentinel must be stored exactly)")
    return fill


_EXACT_FILLS: set[tuple[np.dtype, type, Any]] = set()
"""``(dtype, type(fill), fill)`` that :func:`exact_fill` accepted (bounded: a step stages a few fills)."""


def checked_fill(name: str, dtype: np.dtype, fill: Any) -> Any:
    """:func:`exact_fill`, remembered per dtype and value: an eager step checks each field's ``fill`` as
    graph mode would (code written in eager mode then runs in graph mode unchanged), for the price of a
    set lookup once a value has passed."""
    # (NaN is not equal to itself, so it would miss the set every time: it is keyed by name)
    key = (dtype, type(fill), "nan" if isinstance(fill, float | np.floating) and fill != fill else fill)
    try:
        if key in _EXACT_FILLS:
            return fill
    except TypeError:  # (an unhashable fill: exact_fill names it)
        return exact_fill(name, dtype, fill)
    exact_fill(name, dtype, fill)
    if len(_EXACT_FILLS) < 4096:
        _EXACT_FILLS.add(key)
    return fill


def same_fill(a: Any, b: Any) -> bool:
    """Whether two sentinels are the same value (NaN the same as NaN)."""
    return bool(a == b) or (a != a and b != b)


def plain_tensors() -> torch.inference_mode:
    """The context in which staging makes every tensor it keeps (pinned slots, device arenas, their
    typed views, cached index tensors): ``torch.inference_mode(False)``, so that they are plain tensors
    whether or not the caller runs inside ``torch.inference_mode()``.

    vLLM's runner builds each step inside inference mode; a tensor made there is an inference tensor,
    which torch refuses to write in place outside it, so a slot grown inside inference mode would fail
    its next commit outside it. Plain tensors serve both modes (views made of them inside inference mode
    are plain too)."""
    return torch.inference_mode(False)


def device_bytes(device: torch.device, nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8 device bytes for a stager's arena, a plain tensor (:func:`plain_tensors`): on the
    CPU zeroed now (later steps take no page faults), elsewhere uninitialised (CUDA memory is resident;
    meta has none)."""
    with plain_tensors():
        if device.type == "cpu":
            return torch.zeros(nbytes, dtype=torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` a stager can serve: ``cuda[:n]`` (present on this machine),
    ``cpu`` or ``meta``; a ``TypeError`` / ``ValueError`` naming what is wrong otherwise."""
    if not isinstance(device, torch.device | str):
        raise TypeError(f"device: expected a torch.device or a str such as 'cuda', 'cuda:1' or 'cpu', got "
                        f"{type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from None
    if dev.type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"device: {device!r}; a Stager serves 'cuda[:n]', 'cpu' or 'meta'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device: {device!r} but no CUDA device is available (torch {torch.__version__}, "
                             f"{build}); use Stager('cpu') to build metadata without a GPU")
        if dev.index is not None and not 0 <= dev.index < torch.cuda.device_count():
            raise ValueError(f"device: {device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def bucket_rows(n: int) -> int:
    """The row count to stage, in eager mode, for a field whose exact length changes almost every
    step (a per-token array, the page indices, a bound on chunks): ``n`` rounded up to one of 8 steps
    per power of two, at least 64, so at most 12.5% (and 64 rows) more than needed.

    A field group's layout, and so every view cached with it, lasts while the bucket does; a layout
    per exact length would be rebuilt every step. The rows past ``n`` are staged but never read (a
    builder hands out views of the first ``n``).

    Examples
    --------
    >>> [bucket_rows(n) for n in (0, 64, 65, 100, 1000, 1025)]
    [64, 64, 72, 104, 1024, 1152]
    """
    if n <= 64:
        return 64
    step = 1 << (n.bit_length() - 4)
    return (n + step - 1) // step * step


class StepStats(NamedTuple):
    """What one committed step cost.

    Attributes
    ----------
    slot : int
        Ring slot the step used.
    copies : int
        H2D copies issued by the commit (1, or 0 for an empty step).
    bytes : int
        Bytes of staged data the copy carried (in eager mode the copy itself is rounded up to whole
        4 KiB pages, never past the slot).
    waits : int
        1 if beginning the step had to wait for the slot's previous copy, else 0.
    wait_seconds : float
        Host time spent in that wait.
    grew : bool
        Whether the step had to grow a slot (eager mode, outside steady state).
    """

    slot: int
    copies: int
    bytes: int
    waits: int
    wait_seconds: float
    grew: bool


@dataclasses.dataclass(slots=True)
class StagerStats:
    """Running totals over a stager's life (exposed for benchmarks and monitoring)."""

    steps: int = 0
    """Steps committed."""
    copies: int = 0
    """H2D copies issued (equals ``steps`` minus empty steps)."""
    bytes: int = 0
    """Bytes copied host->device."""
    waits: int = 0
    """Times a step had to wait for a slot's previous copy to finish."""
    wait_seconds: float = 0.0
    """Host time spent waiting."""
    grows: int = 0
    """Times a slot or arena had to grow (eager mode) or the layout changed before freeze."""
    slot_reuses: int = 0
    """Steps that began on a slot used before (every step after the first ``num_slots``)."""
    steps_begun: int = 0
    """Steps begun, committed or abandoned. Slots are visited in ring order, so the step that begins
    when this reads ``n`` uses the slot that the step begun at ``n - num_slots`` used, and no step in
    between touched it (a builder may rely on bytes that step left in the slot)."""


class FieldLayout:
    """Where one staged field lives: byte offset, dtype, row shape, rows staged, capacity, sentinel.

    Attributes
    ----------
    name : str
        The field's name in its step.
    offset : int
        Byte offset into the slot (and, in graph mode, into the one device arena); a multiple of 64.
    dtype : numpy.dtype
        Element type.
    row_shape : tuple of int
        Shape of one row (``()`` for a 1-D field).
    rows : int
        Rows staged by the step.
    capacity : int
        Graph mode: the most rows the field can ever have (its fixed buffer); eager mode: ``rows``.
    fill : scalar
        Graph mode: the sentinel the rows past ``rows`` hold after the commit.
    row_bytes : int
        Bytes of one row.
    """

    __slots__ = ("capacity", "dtype", "fill", "name", "offset", "row_bytes", "row_shape", "rows")

    def __init__(
        self, name: str, offset: int, dtype: np.dtype, row_shape: tuple[int, ...], rows: int, capacity: int, fill: Any
    ) -> None:
        self.name = name
        self.offset = offset  # bytes into the slot / arena
        self.dtype = dtype
        self.row_shape = row_shape
        self.rows = rows  # rows staged by the current step
        self.capacity = capacity  # graph mode: fixed; eager: == rows
        self.fill = fill
        rb = dtype.itemsize
        for d in row_shape:
            rb *= d
        self.row_bytes = rb

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.capacity

    def with_rows(self, rows: int) -> FieldLayout:
        """Graph mode: the same field (fixed offset and capacity) staged with ``rows`` rows."""
        f = FieldLayout.__new__(FieldLayout)
        f.name, f.offset, f.dtype, f.row_shape = self.name, self.offset, self.dtype, self.row_shape
        f.rows, f.capacity, f.fill, f.row_bytes = rows, self.capacity, self.fill, self.row_bytes
        return f


Restaged = tuple[dict[str, FieldLayout], tuple[str, ...], dict[str, FieldLayout]]
"""How a step was restaged (:meth:`attnmeta.staging.Step.restage`): the recorded layout's fields, the
names of those given other row counts, and the step's fields (the same dict while the row counts repeat)."""


class Slot:
    """One ring slot: pinned host bytes, (eager) its device arena, and the fence event."""

    __slots__ = (
        "clean", "copy_pairs", "device_arena", "dirty_rows", "event", "extras", "generation", "groups", "host",
        "host_np", "index", "owner", "ptrs", "typed", "version", "views",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        """Position in the ring."""
        self.host: torch.Tensor | None = None
        self.host_np: np.ndarray | None = None
        self.device_arena: torch.Tensor | None = None
        self.event: Any = None
        self.generation = 0
        self.ptrs = (0, 0)  # CUDA: (device arena, pinned host) addresses for the driver copy (graph mode: the one arena)
        self.dirty_rows: dict[str, int] = {}  # graph mode: rows not holding the sentinel
        # Graph mode, while dirty_rows still equals the rows of the slot's last commit and that step was
        # restaged (Step.restage): (the recorded layout's fields it was restaged from, the names it gave
        # other row counts, its fields). A commit restaged from the same layout settles only its names
        # and these, and nothing when its fields are the very same.
        self.clean: Restaged | None = None
        self.typed: dict[np.dtype, torch.Tensor] = {}  # eager mode: typed views of device_arena
        self.views: dict[tuple[Any, ...], torch.Tensor] = {}  # eager mode: device views by (offset, dtype, shape)
        self.copy_pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, host) slices by copy size
        # alloc_fields cache: (start offset, specs) -> the FieldGroup laid out there on this slot
        self.groups: dict[tuple[Any, ...], FieldGroup] = {}
        self.extras: dict[Any, Any] = {}  # Step.slot_extras: builders' state for this slot's bytes
        self.version = 0  # bumped whenever the slot's memory or (graph mode) the layout changes
        # The step that began on the slot last, weakly (the stager's finalizer holds the slots: a strong
        # reference would keep the step, and through it the stager, alive).
        self.owner: weakref.ref[Any] | None = None  # (a StepCore: attnmeta.staging._ring.slot_owner)


MAX_CACHED = 512  # per slot; the cache is dropped (and rebuilt on demand) when it outgrows this


class StepViews(Protocol):
    """What :class:`FieldGroup` reads of a step (implemented by :class:`~attnmeta.staging.Step`)."""

    _generation: int
    _expired: bool

    def _view(self, f: FieldLayout, rows: int) -> torch.Tensor: ...

    def _arena(self) -> torch.Tensor | None: ...

    def device(self, name: str) -> torch.Tensor: ...


class FieldGroup:
    """Fields reserved together by :meth:`Step.alloc_fields`, cached per ring slot and layout.

    A step that repeats an earlier step's shapes on the same slot gets the *same* group back, with
    the same view objects: staging a group then costs one dictionary lookup, and the device views,
    read-only host views and any per-group values a builder caches in :attr:`extras` are built once
    per slot and layout instead of once per step.

    Attributes
    ----------
    names : tuple of str
        The field names, in the order they were requested.
    host : list of numpy.ndarray
        Writable host views into the slot's pinned bytes, one per field, ``(rows, *row_shape)``.
        Write the step's values here before the commit. Do not hand these out: later steps on the
        same slot write into the same memory.
    frozen : list of numpy.ndarray
        Read-only views of the same memory (what metadata objects expose as host twins).
    buf : numpy.ndarray or None
        The uint8 host bytes every field was carved from (field ``i`` starts at byte
        ``fields[i].offset``), for kernels that address the fields inside one buffer; ``None`` in the
        rare step where the slot grew while the group was reserved (use :attr:`host` then).
    extras : dict
        Free per-group storage for builders (e.g. host-only arrays of the group's shapes, derived
        read-only slices); it lives exactly as long as the group's layout on this slot.
    """

    __slots__ = ("_device", "buf", "buf_map", "end", "extras", "field_map", "fields", "frozen", "host", "names")

    def __init__(self, fields: list[FieldLayout], views: list[np.ndarray], end: int, buf: np.ndarray | None) -> None:
        self.fields = fields
        self.names = tuple(f.name for f in fields)
        self.host = views
        frozen = []
        for v in views:
            r = v.view()
            r.flags.writeable = False
            frozen.append(r)
        self.frozen = frozen
        self.end = end
        self.buf = buf
        self.field_map = {f.name: f for f in fields}
        self.buf_map = dict.fromkeys(self.names, buf)
        self.extras: dict[Any, Any] = {}
        self._device: tuple[torch.Tensor | None, list[torch.Tensor]] | None = None  # (the arena they view, the views)

    def device(self, step: StepViews) -> list[torch.Tensor]:
        """The device views of the group's fields for ``step`` (which reserved the group), in order.

        Raises
        ------
        StepNotCommittedError, StepExpiredError
            As :meth:`Step.device`.
        """
        if step._generation >= 0 and not step._expired:
            d = self._device
            arena = step._arena()
            if d is None or d[0] is not arena:  # (a group reserved before its arena grew: views of the new one)
                d = self._device = (arena, [step._view(f, f.rows) for f in self.fields])
            return d[1]
        step.device(self.names[0])  # raises the right error
        raise AssertionError("unreachable")  # pragma: no cover

    def __repr__(self) -> str:
        return f"FieldGroup({', '.join(self.names)})"


class StepLayout:
    """The fields a committed step staged on its ring slot (:meth:`Step.layout`), to stage again with
    :meth:`Step.restage`. Opaque: it names the slot, the slot's memory version and each field's place.

    Valid while the slot's memory and (graph mode) the stager's layout stay as they were; a stale one
    makes :meth:`Step.restage` return False.
    """

    __slots__ = ("by_rows", "end", "fields", "plain", "slot", "version")

    def __init__(self, slot: Slot, version: int, fields: dict[str, FieldLayout], end: int) -> None:
        self.slot = slot
        self.version = version
        self.fields = fields
        self.end = end
        self.plain: Restaged = (fields, (), fields)
        """A step restaged with the layout's own row counts."""
        # Graph mode: what a step restaged with other row counts than the layout's was restaged as, by those
        # fields and rows (one field dict per row counts, shared by the steps that restage them: a commit that
        # repeats its slot's last one sees the same dict).
        self.by_rows: dict[tuple[tuple[str, Any], ...], Restaged] = {}

    @property
    def names(self) -> tuple[str, ...]:
        """The staged field names."""
        return tuple(self.fields)

    def __repr__(self) -> str:
        return f"StepLayout(slot={self.slot.index}, fields={list(self.fields)})"


for _public in (CapacityError, FieldGroup, FieldLayout, StagerStats, StepExpiredError, StepLayout,
                StepNotCommittedError, StepStats):
    _public.__module__ = "attnmeta.staging"  # where users import them from (and tracebacks name them)
