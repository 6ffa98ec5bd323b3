"""The stager: one pinned, event-fenced host->device copy per step.

Ownership and stream contract
-----------------------------
A :class:`Stager` belongs to one device and is driven by one thread at a time. It owns

- a ring of ``num_slots`` (default 3) **pinned host slots**: host derivations write a step's arrays
  straight into the current slot through numpy views handed out by :meth:`Step.alloc`;
- **device arenas**: in eager mode one per slot, in graph mode one shared arena with a fixed layout.

:meth:`Step.commit` issues **exactly one** non-blocking H2D copy that covers everything the step
staged, on the commit stream (the current stream unless one was given), then records an event on that
stream. On CUDA, commits on the current stream (eager and graph mode) make both calls through the
driver API when it is available (:mod:`attnmeta.staging._driver`: the same copy and event, less host
time), and through torch otherwise. A slot's pinned memory is rewritten only after the event recorded after its last copy has
completed: before a step begins on a slot the stager queries that event and, only if the GPU is still
behind, waits for it (counted in :attr:`StagerStats.waits`). With ``num_slots >= 2`` the host never
waits in steady state unless it runs ``num_slots - 1`` steps ahead of the GPU.

Device tensors handed out by a committed step are views into a device arena. Kernels enqueued on the
commit stream after the commit see exactly this step's data: either the complete old state or the
complete new one, never a mix. Asking for a step's device views before it commits raises
:class:`StepNotCommittedError`; asking after its eager-mode slot has been reused raises
:class:`StepExpiredError`.

Graph mode
----------
With a :class:`~attnmeta.profile.StaticProfile` (``Stager(device, profile=...)``) every field has a
fixed offset and capacity in one device arena, so a CUDA graph captured over kernels that read the
fields can be replayed after any later commit. Rows past a step's length hold the field's sentinel
(``fill``): every declared field is fully defined after every commit, also when a step does not stage
it. Fields are laid out on first use; :meth:`Stager.freeze` (call it before capturing) forbids new
fields, after which exceeding a capacity or adding a field raises.

On ``cpu`` the same API works without pinning (plain copies); on ``meta`` the device tensors carry no
data at all, so the sync audit can prove nothing reads them.

Why one module
--------------
:class:`Stager`, :class:`Step`, :class:`FieldGroup` and :class:`StepLayout` are one ownership
contract: a step writes the slot the stager fences, a group's cached views are valid for the steps
the stager's generation counters allow, and the commit reads the step's fields to copy and refill
exactly what it staged. Split across modules they would reach into each other's private state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import typing
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._fields import MetadataBase
from attnmeta.profile import StaticProfile
from attnmeta.staging import _driver

__all__ = [
    "STAGEABLE_DTYPES",
    "CapacityError",
    "FieldGroup",
    "FieldLayout",
    "Stager",
    "StagerStats",
    "Step",
    "StepExpiredError",
    "StepLayout",
    "StepNotCommittedError",
    "StepStats",
    "bucket_rows",
    "is_expired",
]

logger = logging.getLogger("attnmeta.staging")

_ALIGN = 64  # bytes; every field starts on a 64-byte boundary
_NP_TO_TORCH = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
}


STAGEABLE_DTYPES: Mapping[np.dtype, torch.dtype] = MappingProxyType(_NP_TO_TORCH)
"""The numpy dtypes a step can stage, and the torch dtype of each one's device view."""

_DTYPES: dict[Any, np.dtype] = {}
for _d in _NP_TO_TORCH:
    _DTYPES[_d] = _d
    _DTYPES[_d.type] = _d


class StepNotCommittedError(RuntimeError):
    """A step's device views were requested before the step committed (they would hold stale data)."""


class StepExpiredError(RuntimeError):
    """A step's metadata (a field of a metadata object, a device or host view) was read after a newer
    step claimed the step's memory; the message names both steps and the ring slot."""


class CapacityError(ValueError):
    """A graph-mode field needs more room than its declared capacity (or a new field after freeze)."""


# The current stream's (id, device index, device type) without building a Stream object; None if
# this torch build lacks the private binding (then torch.cuda.current_stream is used every commit).
_GET_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
# Depths of torch's dispatch / function mode stacks: while either is non-empty (the sync audit), the
# commit's copy goes through torch so the modes see it. Private bindings, guarded: without them every
# commit goes through torch (a depth of 1 says "a mode may be active").
_DISPATCH_DEPTH: Any = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_FUNCTION_DEPTH: Any = getattr(torch._C, "_len_torch_function_stack", lambda: 1)
_CURRENT_DEVICE: Any = getattr(torch._C, "_cuda_getDevice", lambda: -2)  # -2: never a stager's device index


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _device(device: Any) -> torch.device:
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


T = TypeVar("T")

_EXPIRED_TWINS: dict[type, type] = {}
"""A class's expired twin (:func:`_poison`), by class."""
_TWIN_CLASSES: set[type] = set()
_PARTS: dict[type, tuple[str, ...]] = {}
"""A class's fields that may hold another metadata object (poisoned with it), by class."""
_OPEN_NAMES = frozenset({"_lease"})


def is_expired(obj: Any) -> bool:
    """Whether ``obj``, a metadata object handed out by a step, has expired (reading its fields would
    raise :class:`StepExpiredError`): a newer step has claimed its step's memory.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager, build_common
    >>> stager = Stager("cpu", num_slots=2)
    >>> spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[1], block_table=[[7]], block_size=4)
    >>> first = build_common(spec, stager)
    >>> second = build_common(spec, stager)
    >>> is_expired(first), is_expired(second)
    (False, False)
    >>> third = build_common(spec, stager)  # begins on the ring slot of `first`
    >>> is_expired(first)
    True
    """
    return type(obj) in _TWIN_CLASSES


def _expired_twin(cls: type) -> type:
    """The subclass an expired object of ``cls`` becomes: no slots of its own (the same layout), every
    attribute read but ``__class__`` and ``_lease`` raising :class:`StepExpiredError` with the expiry
    of the step in ``_lease``."""
    twin = _EXPIRED_TWINS.get(cls)
    if twin is not None:
        return twin

    def __getattribute__(self: Any, name: str) -> Any:
        if name in _OPEN_NAMES or name.startswith("__"):  # (introspection: the class's dunders)
            return object.__getattribute__(self, name)
        raise StepExpiredError(f"{cls.__name__}.{name}: {object.__getattribute__(self, '_lease').expiry()}")

    def __repr__(self: Any) -> str:
        return f"<expired {cls.__name__}: {object.__getattribute__(self, '_lease').expiry()}>"

    twin = type(f"Expired{cls.__name__}", (cls,), {
        "__slots__": (), "__getattribute__": __getattribute__, "__repr__": __repr__, "__module__": cls.__module__,
    })
    _EXPIRED_TWINS[cls] = twin
    _TWIN_CLASSES.add(twin)
    return twin


def _parts(cls: type) -> tuple[str, ...]:
    """The dataclass fields of ``cls`` annotated with a :class:`MetadataBase` type (optional or not)."""
    found = _PARTS.get(cls)
    if found is not None:
        return found
    names: list[str] = []
    if dataclasses.is_dataclass(cls):
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an annotation that does not resolve at run time: judge by its text
            hints = {}
        for f in dataclasses.fields(cls):
            hint = hints.get(f.name)
            kinds = typing.get_args(hint) or (hint,) if hint is not None else ()
            if any(isinstance(k, type) and issubclass(k, MetadataBase) for k in kinds) or (
                    hint is None and "Metadata" in str(f.type)):
                names.append(f.name)
    _PARTS[cls] = found = tuple(names)
    return found


def _poison_info(cls: type) -> tuple[type, tuple[str, ...]] | None:
    """``(expired twin, metadata parts)`` of ``cls``; None for a twin (already expired)."""
    info = None if cls in _TWIN_CLASSES else (_expired_twin(cls), _parts(cls))
    _POISON[cls] = info
    return info


_POISON: dict[type, tuple[type, tuple[str, ...]] | None] = {}
""":func:`_poison_info` by class."""


def _poison(obj: Any, step: Step) -> None:
    """Turn ``obj`` (owned by ``step``, which has expired) and the metadata objects in its fields that
    no other step owns into their expired twins."""
    cls = type(obj)
    info = _POISON[cls] if cls in _POISON else _poison_info(cls)
    if info is None:
        return
    twin, parts = info
    object.__setattr__(obj, "__class__", twin)
    for name in parts:  # a part no step owns (an owned one is poisoned by its own step)
        part = object.__getattribute__(obj, name)
        if part is not None and type(part) not in _TWIN_CLASSES and getattr(part, "_lease", None) is None:
            object.__setattr__(part, "_lease", step)
            _poison(part, step)


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


class _Slot:
    """One ring slot: pinned host bytes, (eager) its device arena, and the fence event."""

    __slots__ = (
        "copy_pairs", "device_arena", "dirty_rows", "event", "extras", "generation", "groups", "host", "host_np",
        "index", "owner", "ptrs", "typed", "version", "views",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.host: torch.Tensor | None = None
        self.host_np: np.ndarray | None = None
        self.device_arena: torch.Tensor | None = None
        self.event: Any = None
        self.generation = 0
        self.ptrs = (0, 0)  # CUDA: (device arena, pinned host) addresses for the driver copy (graph mode: the one arena)
        self.dirty_rows: dict[str, int] = {}  # graph mode: rows not holding the sentinel
        self.typed: dict[np.dtype, torch.Tensor] = {}  # eager mode: typed views of device_arena
        self.views: dict[tuple[Any, ...], torch.Tensor] = {}  # eager mode: device views by (offset, dtype, shape)
        self.copy_pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, host) slices by copy size
        # alloc_fields cache: (start offset, specs) -> the FieldGroup laid out there on this slot
        self.groups: dict[tuple[Any, ...], FieldGroup] = {}
        self.extras: dict[Any, Any] = {}  # Step.slot_extras: builders' state for this slot's bytes
        self.version = 0  # bumped whenever the slot's memory or (graph mode) the layout changes
        # The step that began on the slot last, weakly (the stager's finalizer holds the slots: a strong
        # reference would keep the step, and through it the stager, alive).
        self.owner: weakref.ref[Step] | None = None


_MAX_CACHED_GROUPS = 512  # per slot; the cache is dropped (and rebuilt on demand) when it outgrows this


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
        self._device: list[torch.Tensor] | None = None

    def device(self, step: Step) -> list[torch.Tensor]:
        """The device views of the group's fields for ``step`` (which reserved the group), in order.

        Raises
        ------
        StepNotCommittedError, StepExpiredError
            As :meth:`Step.device`.
        """
        if step._generation >= 0 and not step._expired:
            d = self._device
            if d is None:
                d = self._device = [step._view(f, f.rows) for f in self.fields]
            return d
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

    __slots__ = ("end", "fields", "slot", "version")

    def __init__(self, slot: _Slot, version: int, fields: dict[str, FieldLayout], end: int) -> None:
        self.slot = slot
        self.version = version
        self.fields = fields
        self.end = end

    @property
    def names(self) -> tuple[str, ...]:
        """The staged field names."""
        return tuple(self.fields)

    def __repr__(self) -> str:
        return f"StepLayout(slot={self.slot.index}, fields={list(self.fields)})"


class Stager:
    """Owns the pinned ring and device arenas of one device; hands out :class:`Step` objects.

    Parameters
    ----------
    device : torch.device or str
        Where device fields live: ``cuda[:n]``, ``cpu`` or ``meta``.
    num_slots : int, default 3
        Pinned ring slots; >= 2 so the host can build step N+1 while step N's copy is in flight.
    profile : StaticProfile, optional
        Enables graph mode: fixed per-field capacities and addresses.
    stream : torch.cuda.Stream, optional
        Stream for every commit; default: the current stream at commit time.
    initial_bytes : int, default 1 MiB
        Initial slot size in eager mode (slots grow geometrically when a step needs more). On the
        CPU (``device="cpu"``, unpinned host slots) the slot and arena bytes are zeroed when
        allocated, so they are resident from the start: a later step that first reaches into a page
        (a new, larger layout) takes no page fault, at the price of resident memory for the whole
        slot. Pinned slots and CUDA arenas are resident anyway.
    num_kv_blocks : int, optional
        Blocks in the KV cache that the block tables of this stager's steps index. When given, every
        step's common pass checks each used block id (columns ``[0, cdiv(seq_len, block_size))`` of
        each row) against it and raises a ``ValueError`` naming the row and column of any id at or
        past it, before anything is copied: a slot mapping never points outside the cache.
    check_lifetimes : bool, default True
        Expire the metadata objects of a step when a newer step claims its memory (see "Lifetimes"):
        reading any of their fields then raises :class:`StepExpiredError`. ``False`` skips the
        bookkeeping (a loop that proves its own lifetimes); expired objects then read whatever the
        newer step wrote. :meth:`Step.device` checks either way.

    Lifetimes
    ---------
    A step's memory is its ring slot's pinned bytes (its host views and twins) and, in eager mode, the
    slot's device arena (its device views). Both are claimed by the step that next begins on the slot,
    ``num_slots`` steps later: from then on the step has *expired*, and reading any field of its
    metadata objects, or :meth:`Step.device`, raises :class:`StepExpiredError` naming both steps and
    the slot. So an engine may hold the metadata of its last ``num_slots - 1`` steps while it builds
    the next one; a larger ring holds more. A step that fails and is abandoned still claims its slot.
    In graph mode every step commits into the one device arena, so a step also expires when a later
    step commits. Arrays taken out of a metadata object (``cm.seq_lens_cpu``) are plain views of the
    memory: they are not checked, so copy what you keep past the step's life.

    Threads
    -------
    A stager is driven by one thread at a time: steps are begun, staged and committed in sequence,
    never concurrently. Handing it over between steps is fine. A second thread that begins a step
    while another thread's step is open gets a ``RuntimeError`` naming both threads. Several threads
    building metadata concurrently use one stager each (one per device, or several per device).

    Examples
    --------
    >>> import numpy as np
    >>> stager = Stager("cpu")
    >>> with stager.step() as step:
    ...     qsl = step.alloc("query_start_loc", 4, np.int32)
    ...     qsl[:] = [0, 3, 4, 9]
    >>> step.device("query_start_loc")
    tensor([0, 3, 4, 9], dtype=torch.int32)
    >>> step.stats.copies, stager.stats.steps
    (1, 1)
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        num_slots: int = 3,
        profile: StaticProfile | None = None,
        stream: Any = None,
        initial_bytes: int = 1 << 20,
        num_kv_blocks: int | None = None,
        check_lifetimes: bool = True,
        _unsafe_disable_fencing: bool = False,
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int | np.integer):
            raise TypeError(f"num_slots: expected an int, got {type(num_slots).__name__} {num_slots!r}")
        if num_slots < 2:
            raise ValueError(f"num_slots: must be >= 2 so a step can be built while the last copies, got {num_slots}")
        if profile is not None and not isinstance(profile, StaticProfile):
            raise TypeError(f"profile: expected a StaticProfile or None, got {type(profile).__name__}")
        if isinstance(initial_bytes, bool) or not isinstance(initial_bytes, int | np.integer) or initial_bytes < 0:
            raise ValueError(f"initial_bytes: expected an int >= 0, got {initial_bytes!r}")
        if num_kv_blocks is not None and (isinstance(num_kv_blocks, bool)
                                          or not isinstance(num_kv_blocks, int | np.integer) or num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks: expected an int >= 1 (the KV cache's blocks) or None, got {num_kv_blocks!r}")
        self.device = _device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_kv_blocks: int | None = None if num_kv_blocks is None else int(num_kv_blocks)
        """Blocks in the KV cache the block tables index (checked by every step's common pass), or None."""
        self._lifetimes = bool(check_lifetimes)
        self._graph_live: weakref.ref[Step] | None = None  # graph mode: the step the device arena holds
        self.num_slots = int(num_slots)
        self.profile = profile
        self.graph_mode = profile is not None
        self._stream = stream
        self._cuda = self.device.type == "cuda"
        self._device_index = self.device.index if self._cuda else -1
        self._stream_key: Any = None
        self._stream_obj: Any = None
        self._pin = self._cuda
        self._slots = [_Slot(i) for i in range(num_slots)]
        self._next = 0
        self._open: Step | None = None
        self._frozen = False
        self._fencing = not _unsafe_disable_fencing
        self.stats = StagerStats()
        # graph mode: one fixed layout and one device arena shared by every slot
        self._layout: dict[str, FieldLayout] = {}
        self._layout_bytes = 0
        self._graph_arena: torch.Tensor | None = None
        self._graph_typed: dict[np.dtype, torch.Tensor] = {}
        self._graph_views: dict[tuple[Any, ...], torch.Tensor] = {}
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
            self._alloc_slot(slot, max(_align(initial_bytes), _ALIGN))
            if self._cuda:
                slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ memory
    def _alloc_host(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        # Pinned memory is resident from the start; pageable memory is touched now (zeros), so a step
        # that first reaches into a page does not pay the page fault (several us each in a VM).
        t = (torch.empty if self._pin else torch.zeros)(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        return t, t.numpy()

    def _alloc_arena(self, nbytes: int) -> torch.Tensor:
        """Device bytes; on the CPU touched now (zeros: no page faults in later steps), elsewhere
        uninitialised (CUDA memory is resident; meta has none)."""
        if self.device.type == "cpu":
            return torch.zeros(nbytes, dtype=torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _alloc_slot(self, slot: _Slot, nbytes: int) -> None:
        slot.host, slot.host_np = self._alloc_host(nbytes)
        if not self.graph_mode:
            slot.device_arena = self._alloc_arena(nbytes)
            if self._cuda:
                slot.ptrs = (slot.device_arena.data_ptr(), slot.host.data_ptr())
        elif self._cuda:  # graph mode: every slot copies into the one arena (its address: _graph_reserve)
            slot.ptrs = (0, slot.host.data_ptr())

    def _grow_slot(self, slot: _Slot, need: int) -> np.ndarray:
        """Eager mode: grow ``slot`` to hold ``need`` bytes; returns the old host bytes.

        Views already handed out this step still point into the old bytes and may still be written;
        the step copies them over (:meth:`Step.commit`, "migrations") just before its one H2D copy.
        """
        assert slot.host_np is not None
        new_size = _align(max(need, 2 * slot.host_np.shape[0]))
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
        self, name: str, dtype: np.dtype, row_shape: tuple[int, ...], capacity: int, fill: Any, step: Step
    ) -> FieldLayout:
        if self._frozen:
            raise CapacityError(
                f"{name}: new staged field after Stager.freeze(); declare every field (run one step of each "
                f"kind) before freezing the layout for CUDA-graph capture"
            )
        f = FieldLayout(name, _align(self._layout_bytes), dtype, row_shape, capacity, capacity, fill)
        self._layout[name] = f
        self._layout_bytes = f.offset + _align(f.nbytes)
        logger.info("attnmeta.staging: graph layout adds %s (%s x %s %s), %d bytes total",
                    name, capacity, row_shape, dtype, self._layout_bytes)
        self.stats.grows += 1
        # Re-create arenas at the new size; existing content is sentinel-refilled below.
        self._graph_arena = self._alloc_arena(self._layout_bytes)
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
                if slot is not step._slot:
                    self._wait_slot(slot)
                slot.host, slot.host_np = self._alloc_host(_align(max(self._layout_bytes, 2 * old.shape[0])))
                slot.host_np[: old.shape[0]] = old
            self._fill_rows(slot, f, 0, capacity)
            slot.dirty_rows[name] = 0
            if self._cuda:
                assert slot.host is not None
                slot.ptrs = (arena_ptr, slot.host.data_ptr())
        self._full_copy_pending = True
        return f

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

    def _host_view(self, slot: _Slot, f: FieldLayout, rows: int) -> np.ndarray:
        return np.ndarray((rows, *f.row_shape), dtype=f.dtype, buffer=slot.host_np, offset=f.offset)  # type: ignore[arg-type]

    def _fill_rows(self, slot: _Slot, f: FieldLayout, start: int, stop: int) -> None:
        if stop > start:
            self._host_view(slot, f, stop)[start:stop] = f.fill

    def _typed(self, arena: torch.Tensor, dtype: np.dtype, cache: dict[np.dtype, torch.Tensor]) -> torch.Tensor:
        t = cache.get(dtype)
        if t is None:
            tdt = _NP_TO_TORCH[dtype]
            usable = arena.shape[0] // dtype.itemsize * dtype.itemsize
            t = arena[:usable].view(tdt)
            cache[dtype] = t
        return t

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

    def _wait_slot(self, slot: _Slot) -> tuple[int, float]:
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
    def step(self) -> Step:
        """Begin a step on the next ring slot (waiting only if that slot's last copy is unfinished).

        Use it as a context manager (``with stager.step() as step:``): leaving the block normally
        commits, leaving it with an exception abandons the step without copying anything.
        """
        if self._open is not None:
            raise RuntimeError(self._busy(self._open))
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
        step = self._open = Step(self, slot, waits, wait_s)
        slot.owner = weakref.ref(step)
        return step

    def _busy(self, open_step: Step) -> str:
        """The message of :meth:`step` while ``open_step`` is open."""
        me, owner = threading.get_ident(), open_step._thread
        if owner == me:
            return (f"Stager.step(): step {open_step.number} has neither committed nor been abandoned; commit it "
                    f"(or leave its `with` block) first")
        names = {t.ident: t.name for t in threading.enumerate()}
        return (f"Stager.step(): called from thread {names.get(me, me)!r} while step {open_step.number} of thread "
                f"{names.get(owner, owner)!r} is open; a Stager is driven by one thread at a time (give each "
                f"thread its own Stager, or hand it over between steps)")

    def _commit(self, step: Step) -> None:
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
            fields, dirty_rows, end = step._fields, slot.dirty_rows, self._copy_end
            for name, f in self._layout.items():
                staged = fields.get(name)
                rows = staged.rows if staged is not None else 0
                if dirty_rows.get(name, 0) > rows:  # rows this slot staged before: back to the sentinel
                    self._fill_rows(slot, f, rows, dirty_rows[name])
                dirty_rows[name] = rows
                e = f.offset + rows * f.row_bytes
                if e > end:
                    end = e
            self._copy_end = end
            nbytes = self._layout_bytes if self._full_copy_pending else end
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
                        if len(slot.copy_pairs) >= _MAX_CACHED_GROUPS:
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
        self._open = None
        step._raw_stats = (slot.index, copies, nbytes)  # StepStats is built on demand (Step.stats)
        s = self.stats
        s.steps += 1
        s.copies += copies
        s.bytes += nbytes

    def _driver_copy(self, slot: _Slot, size: int) -> bool:
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

    def _abandon(self, step: Step) -> None:
        """Close ``step`` without a copy. It claimed its slot when it began (the slot's previous step
        expired then) and may have written any of its fields' bytes: what builders know of the bytes
        the slot holds (its extras, the recorded layouts of :meth:`Step.layout`) is dropped, and in
        graph mode the rows it may have written are refilled with their sentinels at the slot's next
        commit."""
        self._open = None
        slot = step._slot
        slot.extras = {}
        slot.version += 1
        if self.graph_mode:
            dirty = slot.dirty_rows
            for name, f in step._fields.items():
                if f.rows > dirty.get(name, 0):
                    dirty[name] = f.rows
    def __repr__(self) -> str:
        mode = "graph" if self.graph_mode else "eager"
        return (f"Stager(device={self.device}, mode={mode}, num_slots={self.num_slots}, "
                f"steps={self.stats.steps}, waits={self.stats.waits})")


class Step:
    """One step's staging area: numpy views into a pinned slot, then one copy, then device views.

    Obtain it from :meth:`Stager.step`. Not thread-safe; one open step per stager.
    """

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

    def __init__(self, stager: Stager, slot: _Slot, waits: int, wait_s: float) -> None:
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
        known, swap = _POISON, object.__setattr__
        for obj in owned:  # (each one's _lease is this step: own() set it)
            info = known.get(type(obj))
            if info is not None and not info[1]:  # the usual object: no metadata parts, one class swap
                swap(obj, "__class__", info[0])
            else:
                _poison(obj, self)
        flat, self._flat = self._flat, []
        for obj in flat:  # (own_all: their parts are among them)
            info = known.get(type(obj))
            if info is None:
                info = _poison_info(type(obj))
            if info is not None:
                swap(obj, "__class__", info[0])

    # ------------------------------------------------------------------ staging
    @property
    def stager(self) -> Stager:
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

    def alloc(
        self,
        name: str,
        shape: int | tuple[int, ...],
        dtype: npt.DTypeLike,
        *,
        capacity: int | None = None,
        fill: Any = 0,
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
            Graph mode (required there): the most ``rows`` this field can ever have.
        fill : scalar, default 0
            Graph mode: sentinel written to rows ``[rows, capacity)``.

        Returns
        -------
        numpy.ndarray
            ``shape`` and ``dtype``, a view into pinned host memory; write the step's values into it
            before the step commits.

        Raises
        ------
        CapacityError
            Graph mode: ``rows > capacity``, or a new field after :meth:`Stager.freeze`.
        """
        if self._committed:
            raise RuntimeError(f"{name}: alloc() after the step committed")
        if self._shared:
            self._fields, self._shared = dict(self._fields), False
        if name in self._fields:
            raise ValueError(f"{name}: staged twice in one step")
        row_shape: tuple[int, ...]
        if type(shape) is int:
            rows, row_shape = shape, ()
        else:
            shp = (shape,) if isinstance(shape, np.integer) else tuple(int(s) for s in shape)  # type: ignore[union-attr]
            rows, row_shape = int(shp[0]), shp[1:]
        dt = _DTYPES.get(dtype)
        if dt is None:
            dt = np.dtype(dtype)
            if dt not in _NP_TO_TORCH:
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
                f = st._graph_reserve(name, dt, row_shape, int(capacity), fill, self)
                self._grew = True
            elif f.dtype != dt or f.row_shape != row_shape:
                raise ValueError(
                    f"{name}: staged as {dt} rows of {row_shape} but the graph layout holds {f.dtype} rows of {f.row_shape}"
                )
            if rows > f.capacity:
                raise CapacityError(
                    f"{name}: needs {rows} rows but its graph-mode capacity is {f.capacity} "
                    f"(raise the StaticProfile capacity that sizes it)"
                )
            staged = FieldLayout(name, f.offset, dt, row_shape, rows, f.capacity, f.fill)
        else:
            off = (self._used + _ALIGN - 1) // _ALIGN * _ALIGN
            staged = FieldLayout(name, off, dt, row_shape, rows, rows, fill)
            end = off + staged.row_bytes * rows
            assert slot.host_np is not None
            if end > slot.host_np.shape[0]:
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
            raise RuntimeError("alloc_fields() after the step committed")
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
            if len(slot.groups) >= _MAX_CACHED_GROUPS:
                slot.groups.clear()
            slot.groups[ck] = group
        return group

    def alloc_group(self, specs: tuple[tuple[str, Any, Any, int | None, Any], ...]) -> list[np.ndarray]:
        """:meth:`alloc` for several fields at once: ``specs`` is a tuple of
        ``(name, shape, dtype, capacity, fill)``. Returns fresh writable host views, in order.

        Uses the cached layout of :meth:`alloc_fields`; builders that want the cached views too (device
        and read-only host views built once per slot and layout) call :meth:`alloc_fields` directly.
        """
        return [v.view() for v in self.alloc_fields(specs).host]  # fresh objects, the same bytes

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
        """
        if self._expired:
            raise StepExpiredError(f"{name}: {self.expiry()}")
        f = self._fields[name]
        return self._stager._host_view(self._slot, f, f.rows)

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    @property
    def slot_bytes(self) -> int:
        """Bytes of this step's ring slot (pinned host memory; eager mode grows it on demand)."""
        assert self._slot.host_np is not None
        return int(self._slot.host_np.shape[0])

    @property
    def field_names(self) -> tuple[str, ...]:
        """The fields this step has staged so far, in the order they were reserved."""
        return tuple(self._fields)

    # ------------------------------------------------------------------ commit
    def commit(self) -> None:
        """Issue the step's one non-blocking H2D copy and record its fence event.

        What it cost is in :attr:`stats` afterwards.
        """
        if self._committed:
            raise RuntimeError("Step.commit(): already committed")
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
            raise RuntimeError("restage() after the step committed")
        slot = self._slot
        if layout.slot is not slot or layout.version != slot.version or self._fields:
            return False
        fields = layout.fields
        if rows:
            if not self._stager.graph_mode:
                raise ValueError("restage(rows=...): only graph mode has fixed offsets; eager rows are part of the layout")
            fields = dict(fields)
            for name, n in rows.items():
                f = fields.get(name)
                if f is None:
                    raise ValueError(f"restage(rows=...): {name} is not a field of the layout")
                if n > f.capacity:
                    raise CapacityError(f"{name}: needs {n} rows but its graph-mode capacity is {f.capacity}")
                fields[name] = f.with_rows(n)
            self._fields = fields
        else:
            self._fields, self._shared = fields, True  # copied only if the step adds a field
        self._base = slot.host_np
        self._used = layout.end
        return True

    def abandon(self) -> None:
        """Drop the step without copying (its slot is free for the next step)."""
        if not self._committed:
            self._stager._abandon(self)
            self._committed = True
            self._generation = -2

    @property
    def committed(self) -> bool:
        """Whether :meth:`commit` has run."""
        return self._committed and self._generation >= 0

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
            f = self._fields[name]
            return self._view(f, f.rows)
        if self._expired:
            raise StepExpiredError(f"{name}: {self.expiry()}")
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
            raise StepNotCommittedError(f"{name}: device view requested before the step committed")
        f = st._layout[name]
        return self._view(f, f.capacity)

    def host_full(self, name: str) -> np.ndarray:
        """Graph mode: the full-capacity writable host view of ``name`` in this step's pinned slot
        (the host twin of :meth:`device_full`; rows past this step's length hold the sentinel)."""
        st = self._stager
        if not st.graph_mode:
            raise RuntimeError("host_full(): only graph mode has fixed capacities")
        f = st._layout[name]
        return st._host_view(self._slot, f, f.capacity)

    def _view(self, f: FieldLayout, rows: int) -> torch.Tensor:
        """A device view of ``rows`` rows of ``f``; cached per arena by (offset, dtype, shape).

        A cached view aliases exactly the bytes a fresh one would, so reusing the tensor object across
        steps is equivalent (it saves a torch view construction per field per step).
        """
        st = self._stager
        if st.graph_mode:
            arena, cache, views = st._graph_arena, st._graph_typed, st._graph_views
        else:
            arena, cache, views = self._slot.device_arena, self._slot.typed, self._slot.views
        key = (f.offset, f.dtype, rows, f.row_shape)
        v = views.get(key)
        if v is not None:
            return v
        assert arena is not None
        typed = st._typed(arena, f.dtype, cache)
        shape = (rows, *f.row_shape)
        strides = []
        acc = 1
        for d in reversed(shape[1:]):
            strides.append(acc)
            acc *= d
        strides.reverse()
        v = typed.as_strided(shape, (acc, *strides), f.offset // f.dtype.itemsize)
        if len(views) >= 4 * _MAX_CACHED_GROUPS:
            views.clear()
        views[key] = v
        return v

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._committed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abandon()

    def __repr__(self) -> str:
        state = "committed" if self.committed else "open"
        return f"Step(slot={self._slot.index}, {state}, fields={list(self._fields)})"
