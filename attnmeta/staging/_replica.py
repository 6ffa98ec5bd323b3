"""Replicas: a step's metadata described by where its views lie, and built again on other memory.

A metadata object a step hands out is a tree: dataclasses (the metadata types), tuples (named or
not), lists and dicts, whose leaves are device tensors (views into the step's device arena), host
arrays (views into the step's pinned slot, or buffers of their own) and plain values. Every device
that received a copy of the same slot holds the same bytes at the same offsets, so the tree of
another device is the same tree with each device view taken at the same place in that device's
arena.

- :func:`placement` says where a device view of a stager's step lies (:class:`TensorAt`: which arena,
  storage offset, dtype, shape, strides) and refuses a tensor that is not a view of bytes the step
  copied (a field a builder computed on the device at ``result()``: such bytes exist on one device
  only);
- :class:`Encoder` turns a tree into a **skeleton**: the same tree with each device view replaced by
  its :class:`TensorAt` and, when asked, each host view of the slot by its :class:`ArrayAt` (what a
  process that maps the same slot needs); a subtree with neither stays the object it is;
- :class:`Decoder` builds the tree again from a skeleton, with each placement taken on another
  device's (or process's) memory, metadata objects tied to the owner's lifetime.

:class:`attnmeta.staging.MultiStager` (several devices, one process) and
:mod:`attnmeta.staging.shared` (one process per device) are built on these three.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import operator
import pickle
from collections.abc import Callable
from itertools import compress
from typing import Any, NamedTuple

import numpy as np
import torch

from attnmeta._fields import MetadataBase, positional_factory
from attnmeta.staging._layout import StepExpiredError, StepNotCommittedError, plain_tensors
from attnmeta.staging._ring import (
    Ring,
    StepCore,
    graph_layout,
    graph_live,
    ring_slots,
    slot_owner,
    staged_fields,
    used_bytes,
)

__all__ = ["ArenaIndex", "ArrayAt", "Decoder", "DescriptionError", "Encoder", "NotReplicableError", "PlacementCache", "Resolver", "Retarget", "TensorAt", "arena_keys", "owner", "placement"]


class NotReplicableError(ValueError):
    """A device tensor of a step's metadata is not a view of bytes the step copied (a builder computed
    it on the device when ``result()`` ran, e.g. FlashInfer's ``indices="device"`` gather), so another
    device's copy of the step does not hold it. The message begins with the field that holds it
    (``FlashInferMetadata.paged.paged_kv_indices: ...``) where the tensor was found in an object.

    Attributes
    ----------
    tensor : torch.Tensor or None
        The tensor (device), where known.
    """

    def __init__(self, message: str, tensor: torch.Tensor | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor

    def named_in(self, root: Any, name: str | None = None) -> NotReplicableError:
        """This error with the path of :attr:`tensor` inside ``root`` (a metadata object, a container
        of them; called ``name``, by default its class's name) in front of its message; itself where the
        tensor is not found there."""
        path = _path_to(root, self.tensor, type(root).__name__ if name is None else name, set())
        if path is None:
            return self
        return NotReplicableError(f"{path}: {self}", self.tensor)


def _path_to(obj: Any, target: Any, path: str, seen: set[int]) -> str | None:
    """The path (``Class.field[2].field``) from ``obj`` to the object ``target``, or None (the error
    path of :meth:`NotReplicableError.named_in`: a walk over dataclass fields, named tuples, tuples,
    lists and dicts)."""
    if obj is target:
        return path
    if id(obj) in seen or isinstance(obj, torch.Tensor | np.ndarray | str | bytes | int | float) or obj is None:
        return None
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f".{f.name}", object.__getattribute__(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        items = [(f".{n}", v) for n, v in zip(obj._fields, obj, strict=True)]
    elif isinstance(obj, list | tuple):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(f"[{k!r}]", v) for k, v in obj.items()]
    else:
        return None
    for step, value in items:
        found = _path_to(value, target, path + step, seen)
        if found is not None:
            return found
    return None


class TensorAt(NamedTuple):
    """Where a device view lies in a stager's arena."""

    arena: int
    """Eager mode: the ring slot whose device arena it views; graph mode: -1 (the one arena)."""
    offset: int
    """Storage offset, in elements of ``dtype`` (the arena starts at element 0)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class ArrayAt(NamedTuple):
    """Where a host view lies in a ring slot's pinned bytes."""

    slot: int
    offset: int
    """Bytes into the slot."""
    dtype: str
    """``numpy.dtype.str``."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]


ATOM, TENSOR, ARRAY, DATACLASS, NAMEDTUPLE, TUPLE, LIST, DICT = range(8)
KINDS: dict[type, int] = {t: ATOM for t in (int, float, bool, str, bytes, complex, type(None), range, slice,
                                              torch.dtype, torch.device, np.dtype)}
KINDS.update({torch.Tensor: TENSOR, np.ndarray: ARRAY, tuple: TUPLE, list: LIST, dict: DICT})
GETTERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}
_PLAIN = frozenset((int, float, bool, str, type(None)))
FACTORIES: dict[type, Callable[..., Any]] = {}


def _getter(names: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    """``obj -> tuple of its fields named names`` (one C call for two or more)."""
    if len(names) >= 2:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


def kind(cls: type) -> int:
    """The kind of a value of class ``cls`` (cached); a ``TypeError`` for a class a tree may not hold."""
    k = KINDS.get(cls)
    if k is not None:
        return k
    if issubclass(cls, torch.Tensor):
        k = TENSOR
    elif issubclass(cls, np.ndarray):
        k = ARRAY
    elif dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
        GETTERS[cls] = _getter(names)
        FACTORIES[cls] = positional_factory(cls)
        k = DATACLASS
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        k = NAMEDTUPLE
    elif issubclass(cls, np.generic | enum.Enum | int | float | str):
        k = ATOM
    else:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__}: a metadata tree holds dataclasses, tuples, lists, "
                        f"dicts, tensors, arrays and plain values; this value cannot be replicated")
    KINDS[cls] = k
    return k


def _extent(t: torch.Tensor) -> int:
    """Elements from a view's first element to one past its last (0 for an empty view)."""
    n = 1
    for d, s in zip(t.shape, t.stride()):
        if d == 0:
            return 0
        n += (d - 1) * s
    return n


def _storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, the same for every view of it (also on ``meta``, whose
    storages have no address)."""
    storage = t.untyped_storage()
    key = getattr(storage, "_cdata", None)
    return int(key) if key is not None else int(storage.data_ptr())


def arena_keys(stager: Ring) -> dict[int, int]:
    """``{storage identity: arena}`` of ``stager``'s device arenas now (eager: the ring slots'; graph
    mode: -1 for the one arena, and for those the layout grew out of since the last commit, whose step
    is the one the arena holds)."""
    if stager.graph_mode:
        return {_storage_key(arena): -1 for arena in stager.graph_arenas}
    return {_storage_key(s.device_arena): s.index for s in ring_slots(stager) if s.device_arena is not None}


class ArenaIndex:
    """Which arena of a stager a device view lies in, found fast: by the view's root tensor (the
    typed view of an arena every field view is carved from) once that root has been seen, else by
    its storage. Valid until an arena is reallocated (a step that grew a slot or the graph layout):
    the caller makes a new one then.

    Parameters
    ----------
    stager : Stager
        The stager whose arenas to index.
    """

    __slots__ = ("fields", "keys", "roots")

    def __init__(self, stager: Ring) -> None:
        self.keys = arena_keys(stager)
        self.roots: dict[int, tuple[torch.Tensor, int]] = {}
        self.fields: tuple[list[int], list[Any]] | None = None
        if stager.graph_mode:  # the graph layout by offset, for the staged-rows check
            laid = sorted(graph_layout(stager).values(), key=lambda f: f.offset)
            self.fields = ([f.offset for f in laid], laid)

    def find(self, t: torch.Tensor) -> int:
        """The arena of ``t`` (:attr:`TensorAt.arena`), or -2 for none of the stager's."""
        root = t._base
        if root is None:
            root = t
        hit = self.roots.get(id(root))
        if hit is not None and hit[0] is root:
            return hit[1]
        at = self.keys.get(_storage_key(t), -2)
        if at != -2:
            self.roots[id(root)] = (root, at)
        return at


class PlacementCache:
    """:func:`placement` of a stager's device views, remembered by identity (a step's views are looked
    up again on every use; cleared past 4096 entries), with one :class:`ArenaIndex`. Valid while no
    arena moves: :meth:`clear` after a step that grew a slot or the graph layout.

    Parameters
    ----------
    stager : Stager
        The stager whose views to place.
    """

    __slots__ = ("_index", "_places", "stager")

    def __init__(self, stager: Ring) -> None:
        self.stager = stager
        self._index: ArenaIndex | None = None
        self._places: dict[int, tuple[torch.Tensor, TensorAt]] = {}  # id(device view) -> its placement

    def clear(self) -> None:
        """Forget every placement and the arena index (an arena moved)."""
        self._places.clear()
        self._index = None

    def __call__(self, t: torch.Tensor) -> TensorAt:
        """:func:`placement` of ``t`` (same errors)."""
        hit = self._places.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        if self._index is None:
            self._index = ArenaIndex(self.stager)
        at = placement(self.stager, t, self._index)
        if len(self._places) >= 4096:
            self._places.clear()
        self._places[id(t)] = (t, at)
        return at


def placement(stager: Ring, t: torch.Tensor, index: ArenaIndex | None = None) -> TensorAt:
    """Where ``t``, a device tensor of a committed step of ``stager``, lies in the stager's arenas.

    Parameters
    ----------
    stager : Stager
        The stager whose step handed ``t`` out.
    t : torch.Tensor
        On ``stager.device``.
    index : ArenaIndex, optional
        The caller's :class:`ArenaIndex` of ``stager``; default: a new one.

    Returns
    -------
    TensorAt
        The arena (eager: the ring slot; graph mode: -1), offset, dtype, shape and strides.

    Raises
    ------
    NotReplicableError
        ``t`` is not a view of a stager arena, or lies past the bytes its step copied (eager), or in a
        graph-mode field its step staged no rows of (a buffer a builder filled on the device).
    StepExpiredError, StepNotCommittedError
        The arena's step has expired (a newer step claimed the memory) or has not committed.
    """
    if index is None:
        index = ArenaIndex(stager)
    at = index.find(t)
    if at == -2:
        raise NotReplicableError(
            f"a {tuple(t.shape)} {t.dtype} tensor on {t.device} is not a view of the step's copy: a builder "
            f"computed it on the device when result() ran, so no other device's copy holds it (stage such "
            f"fields on the host, e.g. FlashInfer indices='host', local attention block_table='host'), or it "
            f"comes from another stager", t)
    step = owner(stager, at)
    size = t.element_size()
    off = int(t.storage_offset())
    lo = off * size
    n = _extent(t)
    if n:
        hi = lo + n * size
        if at >= 0:
            if hi > used_bytes(step):
                raise NotReplicableError(f"a {tuple(t.shape)} {t.dtype} view reaches byte {hi} of the step's "
                                         f"arena, past the {used_bytes(step)} bytes the step copied", t)
        else:
            if index.fields is None or len(index.fields[1]) != len(graph_layout(stager)):
                index.fields = None
                laid = sorted(graph_layout(stager).values(), key=lambda f: f.offset)
                index.fields = ([f.offset for f in laid], laid)
            offsets, laid = index.fields
            j = bisect.bisect_right(offsets, lo) - 1
            f = laid[j] if j >= 0 else None
            end = 0 if f is None else f.offset + f.capacity * f.row_bytes
            if f is not None and lo < end:
                staged = staged_fields(step).get(f.name)
                if staged is None or staged.rows == 0 or hi > end:
                    raise NotReplicableError(
                        f"{f.name}: a {tuple(t.shape)} {t.dtype} view of a field the step staged "
                        f"{0 if staged is None else staged.rows} rows of: a buffer a builder filled on "
                        f"the device when result() ran, which no other device's copy holds (stage the "
                        f"field on the host)", t)
    return TensorAt(at, off, t.dtype, tuple(t.shape), tuple(t.stride()))


def arena_view(at: TensorAt, arena: torch.Tensor | None, typed: dict[tuple[int, torch.dtype], torch.Tensor],
               views: dict[TensorAt, torch.Tensor]) -> torch.Tensor:
    """The tensor at ``at`` in ``arena`` (the uint8 device arena ``at`` names), a view of its bytes.

    ``views`` caches the views per placement (cleared past 4096), ``typed`` each arena's
    reinterpretation per dtype; a holder drops both when it reallocates an arena.
    """
    v = views.get(at)
    if v is not None:
        return v
    assert arena is not None, "a placement in an arena this device has not received"
    key = (at.arena, at.dtype)
    t = typed.get(key)
    if t is None:
        size = torch.empty((), dtype=at.dtype).element_size()
        with plain_tensors():  # (a dtype view made inside inference mode would be an inference tensor)
            t = typed[key] = arena[: arena.shape[0] // size * size].view(at.dtype)
    v = t.as_strided(at.shape, at.stride, at.offset)
    if len(views) >= 4096:
        views.clear()
    views[at] = v
    return v


def owner(stager: Ring, arena: int) -> StepCore:
    """The committed, live step whose data the arena ``arena`` (:attr:`TensorAt.arena`) of ``stager``
    holds.

    Raises
    ------
    StepExpiredError, StepNotCommittedError
        As :func:`placement`.
    """
    step = slot_owner(stager, arena) if arena >= 0 else graph_live(stager)
    if step is None or not step.committed:
        if step is not None and step.expired:
            raise StepExpiredError(step.expiry())
        raise StepNotCommittedError("a view of a step that has not committed (or was abandoned)")
    if step.expired:
        raise StepExpiredError(step.expiry())
    return step


# The wire format of a skeleton: nested tuples of ints, floats, strs, bytes, bools and None only, so
# ``marshal`` serialises it in C (no ``__reduce__`` calls). Every container is a tagged tuple:
#   (W_TENSOR, arena, offset, dtype name, shape, stride)   a device view (its TensorAt)
#   (W_HOST, slot, offset, dtype str, shape, strides)      a host view of the shared slot (its ArrayAt)
#   (W_ARRAY, dtype str, shape, bytes)                     any other host array, by value
#   (W_PICKLED, bytes)                                     any other plain value (an enum, a numpy scalar)
#   (W_OBJ | W_NAMEDTUPLE, class, gen, values)             a dataclass / named tuple, every field
#   (W_PATCH, class, gen, base, positions, values, tag)    the same, as the fields that changed since the
#                                                          state ``base`` of (class, slot), tag W_OBJ/W_NAMEDTUPLE
#   (W_TUPLE | W_LIST, values), (W_DICT, keys, values)    keys encoded as values are (a numpy int key)
# A value is "sticky" when the same Python object always means the same wire value: a plain value, a
# device view (its place), a view of the shared slot (its place; the reader reads the slot itself). A
# patch leaves out the sticky fields that hold the very object they held in the state it patches;
# every other field (a nested object, a container, an array by value) is sent again.
W_OBJ, W_NAMEDTUPLE, W_TUPLE, W_LIST, W_DICT, W_TENSOR, W_HOST, W_ARRAY, W_PICKLED, W_PATCH = range(10)
_R_OBJ, _R_NAMEDTUPLE = 20, 21  # a reader's resolved object node: (tag, class, values)
_DTYPE_NAMES = {dt: str(dt).removeprefix("torch.") for dt in (
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64)}
_DTYPES = {name: dt for dt, name in _DTYPE_NAMES.items()}
_CLASSES: dict[str, type] = {}
_KEYS: dict[type, str] = {}


def _class_key(cls: type) -> str:
    key = _KEYS.get(cls)
    if key is None:
        key = _KEYS[cls] = f"{cls.__module__}:{cls.__qualname__}"
    return key


def _class(key: str) -> type:
    cls = _CLASSES.get(key)
    if cls is None:
        import importlib

        mod, _, qual = key.partition(":")
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        cls = _CLASSES[key] = obj
    return cls


class DescriptionError(RuntimeError):
    """A reader's state of the published descriptions does not match the patch it received (it did
    not receive every step of the ring in order)."""


class Encoder:
    """Turns metadata trees into wire skeletons (for ``marshal``), as patches where it can.

    It keeps, per type and ring slot, the state it last sent (a generation number, the values, their
    encodings): an object whose type it has sent before on the slot goes as a patch of that state.
    Readers apply the patches in the same order (:class:`Resolver`), so both sides' states agree.

    Parameters
    ----------
    tensor : callable
        ``tensor(t) -> TensorAt`` for each device tensor (e.g. :func:`placement`).
    array : callable
        ``array(a) -> ArrayAt | None`` for each host array: a place in the shared slot, or None (the
        array goes by value).
    """

    __slots__ = ("array", "gen", "lasts", "memo", "slot", "tensor")

    def __init__(self, tensor: Callable[[torch.Tensor], TensorAt],
                 array: Callable[[np.ndarray], ArrayAt | None]) -> None:
        self.tensor = tensor
        self.array = array
        self.memo: dict[int, tuple[Any, Any]] = {}
        """This step's encodings by object id (emptied by the caller for each step)."""
        self.lasts: dict[tuple[type, int], tuple[int, tuple[Any, ...], list[Any], list[bool]]] = {}
        self.gen = 0
        self.slot = 0
        """The ring slot of the step being encoded."""

    def forget(self) -> None:
        """Drop every state (an arena moved, or an encoding failed half way): objects go whole next."""
        self.memo = {}
        self.lasts = {}

    def __call__(self, obj: Any) -> Any:
        """The wire skeleton of ``obj``."""
        return self.encode(obj)[0]

    def encode(self, obj: Any) -> tuple[Any, bool]:
        """``(wire value of obj, whether it is sticky)``."""
        t = type(obj)
        if t is int or t is float or t is str or t is bool or obj is None:
            return obj, True
        k = KINDS.get(t)
        if k is None:
            k = kind(t)
        if k == TENSOR:
            at = self.tensor(obj)
            return (W_TENSOR, at.arena, at.offset, _DTYPE_NAMES[at.dtype], at.shape, at.stride), True
        if k == ARRAY:
            place = self.array(obj)
            if place is not None:
                return (W_HOST, *place), True
            a = np.ascontiguousarray(obj)
            return (W_ARRAY, a.dtype.str, a.shape, a.tobytes()), False
        if k == ATOM:
            return (obj, True) if t is bytes else ((W_PICKLED, pickle.dumps(obj)), False)
        hit = self.memo.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1], False
        out: Any
        if k in (DATACLASS, NAMEDTUPLE):
            vals = GETTERS[t](obj) if k == DATACLASS else tuple(obj)
            key = (t, self.slot)
            last = self.lasts.get(key)
            self.gen += 1
            tag = W_OBJ if k == DATACLASS else W_NAMEDTUPLE
            if last is None or len(last[1]) != len(vals):
                pairs = [self.encode(x) for x in vals]
                encs = [p[0] for p in pairs]
                sticky = [p[1] for p in pairs]
                out = (tag, _class_key(t), self.gen, tuple(encs))
            else:
                base, lvals, lencs, lsticky = last
                encs, sticky = list(lencs), list(lsticky)
                # the fields that are not the objects they were (a C-level scan), and the non-sticky ones
                pos = list(compress(range(len(vals)), map(operator.is_not, vals, lvals)))
                if not all(lsticky):
                    pos = sorted(set(pos).union(compress(range(len(vals)), map(operator.not_, lsticky))))
                new = []
                for i in pos:
                    x = vals[i]
                    if type(x) in _PLAIN:
                        e = x
                        sticky[i] = True
                    else:
                        e, sticky[i] = self.encode(x)
                    encs[i] = e
                    new.append(e)
                out = (W_PATCH, _class_key(t), self.gen, base, tuple(pos), tuple(new), tag)
            self.lasts[key] = (self.gen, vals, encs, sticky)
        elif k == DICT:
            out = (W_DICT, tuple([self.encode(k)[0] for k in obj]), tuple([self.encode(v)[0] for v in obj.values()]))
        else:
            out = (W_LIST if k == LIST else W_TUPLE, tuple([self.encode(v)[0] for v in obj]))
        self.memo[id(obj)] = (obj, out)
        return out, False


class Resolver:
    """A reader's side of :class:`Encoder`'s states: turns each received skeleton's patches into whole
    objects, in the order the writer encoded them. Run on every received step (it is cheap: a patch
    costs what changed)."""

    __slots__ = ("memo", "slot", "states")

    def __init__(self) -> None:
        self.states: dict[tuple[str, int], tuple[int, list[Any]]] = {}
        self.memo: dict[int, tuple[Any, Any]] = {}
        self.slot = 0
        """The ring slot of the step being resolved."""

    def __call__(self, w: Any) -> Any:
        """``w`` with every object node whole (``(tag, class, values)``).

        Raises
        ------
        DescriptionError
            A patch of a state this reader does not hold.
        """
        if type(w) is not tuple:
            return w
        tag = w[0]
        if tag >= W_TENSOR and tag != W_PATCH:
            return w
        hit = self.memo.get(id(w))
        if hit is not None and hit[0] is w:
            return hit[1]
        out: Any
        if tag in (W_OBJ, W_NAMEDTUPLE):
            vals = [self(v) for v in w[3]]
            self.states[(w[1], self.slot)] = (w[2], vals)
            out = (_R_OBJ if tag == W_OBJ else _R_NAMEDTUPLE, w[1], tuple(vals))
        elif tag == W_PATCH:
            key = (w[1], self.slot)
            state = self.states.get(key)
            if state is None or state[0] != w[3]:
                raise DescriptionError(
                    f"{w[1]}: a patch of description state {w[3]}, but this reader holds "
                    f"{None if state is None else state[0]} for ring slot {self.slot} (a reader must receive "
                    f"every step of the ring, in order, from the first)")
            vals = list(state[1])
            for p, v in zip(w[4], w[5]):
                vals[p] = self(v)
            self.states[key] = (w[2], vals)
            out = (_R_OBJ if w[6] == W_OBJ else _R_NAMEDTUPLE, w[1], tuple(vals))
        elif tag == W_DICT:
            out = (W_DICT, tuple([self(k) for k in w[1]]), tuple([self(v) for v in w[2]]))
        else:
            out = (tag, tuple([self(v) for v in w[1]]))
        self.memo[id(w)] = (w, out)
        return out


class Decoder:
    """Builds metadata trees from resolved skeletons (:class:`Resolver`) on this process's memory.

    It keeps, per class and ring slot, the last resolved values and what they decoded to: a leaf that
    is the very wire value it was last time (a resolved state carries unchanged leaves over) is not
    decoded again; metadata objects are always new (each is owned by its own step).

    Parameters
    ----------
    tensor : callable
        ``tensor(at) -> torch.Tensor``: the view at ``at`` on this decoder's device.
    array : callable
        ``array(at) -> numpy.ndarray``: the read-only host view at ``at`` in this process's mapping of
        the shared slot.
    """

    __slots__ = ("array", "lasts", "memo", "own", "slot", "tensor")

    def __init__(self, tensor: Callable[[TensorAt], torch.Tensor], array: Callable[[ArrayAt], np.ndarray]) -> None:
        self.tensor = tensor
        self.array = array
        self.own: Callable[[Any], Any] | None = None
        """Called with each rebuilt metadata object (ties it to its step), or None."""
        self.slot = 0
        """The ring slot of the step being decoded."""
        self.memo: dict[int, tuple[Any, Any]] = {}
        self.lasts: dict[tuple[str, int], tuple[tuple[Any, ...], list[Any]]] = {}

    def forget(self) -> None:
        """Drop every cached value (an arena moved)."""
        self.memo = {}
        self.lasts = {}

    def __call__(self, skel: Any) -> Any:
        """The tree ``skel`` (resolved) describes, on this decoder's memory."""
        if type(skel) is not tuple:
            return skel
        tag = skel[0]
        if tag == W_TENSOR:
            return self.tensor(TensorAt(skel[1], skel[2], _DTYPES[skel[3]], skel[4], skel[5]))
        if tag == W_HOST:
            return self.array(ArrayAt(*skel[1:]))
        if tag == W_ARRAY:
            return np.frombuffer(skel[3], np.dtype(skel[1])).reshape(skel[2])  # read-only: views the bytes
        if tag == W_PICKLED:
            return pickle.loads(skel[1])
        hit = self.memo.get(id(skel))
        if hit is not None and hit[0] is skel:
            return hit[1]
        out: Any
        if tag in (_R_OBJ, _R_NAMEDTUPLE):
            vals = skel[2]
            key = (skel[1], self.slot)
            last = self.lasts.get(key)
            if last is not None and len(last[0]) == len(vals):
                new = list(last[1])
                for i in compress(range(len(vals)), map(operator.is_not, vals, last[0])):
                    x = vals[i]
                    new[i] = self(x) if type(x) is tuple else x
            else:
                new = [self(x) for x in vals]
            self.lasts[key] = (vals, new)
            cls = _class(skel[1])
            if tag == _R_NAMEDTUPLE:
                out = cls._make(new)  # type: ignore[attr-defined]
            else:
                if cls not in FACTORIES:
                    kind(cls)
                out = FACTORIES[cls](*new)
                if self.own is not None and isinstance(out, MetadataBase):
                    self.own(out)
        elif tag == W_DICT:
            out = dict(zip([self(k) for k in skel[1]], [self(v) for v in skel[2]]))
        else:
            new = [self(v) for v in skel[1]]
            out = new if tag == W_LIST else tuple(new)
        self.memo[id(skel)] = (skel, out)
        return out


def _lease_of(obj: Any) -> Any:
    """The step that owns metadata object ``obj`` (its lease), or None."""
    try:
        lease = object.__getattribute__(obj, "_lease")
    except AttributeError:
        return None
    return lease if hasattr(lease, "own") else None


class Retarget:
    """Builds replicas of metadata trees in one process: the same tree with each device tensor
    replaced by ``tensor(t)`` (its twin on another device), host values shared.

    It keeps, per dataclass type, the last object's field values and their replicas: a field whose
    value is the very object it was last time (a builder's cached view, a recorded value of a replayed
    layout) gets its last replica back without a walk, so replicating a replayed step costs one pass
    of identity checks per object. A value's replica depends only on the value (a view's place in its
    arena), and the caller empties the caches (:meth:`forget`) whenever an arena moves.

    Parameters
    ----------
    tensor : callable
        ``tensor(t) -> torch.Tensor``: ``t``'s twin (called once per distinct tensor object, cached).
    """

    __slots__ = ("lasts", "memo", "own", "slot", "tensor", "twins")

    def __init__(self, tensor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.tensor = tensor
        self.twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # per (type, slot): the last values and their replicas (the values themselves: a host-only object)
        self.lasts: dict[tuple[type, int], tuple[tuple[Any, ...], list[Any] | tuple[Any, ...]]] = {}
        self.memo: dict[int, tuple[Any, Any]] = {}
        self.own: Callable[[Any], Any] | None = None
        """Called with each new metadata object (``Step.own`` of the step being replicated), or None."""
        self.slot = 0
        """The ring slot of the step being replicated: the last values are kept per type and slot (a
        replayed layout reuses its values on its own slot)."""

    def forget(self) -> None:
        """Drop every cached replica (an arena was reallocated)."""
        self.twins = {}
        self.lasts = {}
        self.memo = {}

    def __call__(self, v: Any) -> Any:
        """The replica of ``v``: ``v`` itself when it holds no device tensor."""
        t = type(v)
        if t is torch.Tensor:
            hit = self.twins.get(id(v))
            if hit is not None and hit[0] is v:
                return hit[1]
            twin = self.tensor(v)
            if len(self.twins) >= 4096:
                self.twins.clear()
            self.twins[id(v)] = (v, twin)
            return twin
        k = KINDS.get(t)
        if k is None:
            k = kind(t)
        if k <= ARRAY:  # a plain value or a host array: shared
            if k == TENSOR:  # (a tensor subclass)
                return self.tensor(v)
            return v
        hit = self.memo.get(id(v))
        if hit is not None and hit[0] is v:
            return hit[1]
        out: Any
        if k == DATACLASS:
            vals = GETTERS[t](v)
            key = (t, self.slot)
            last = self.lasts.get(key)
            if last is not None:
                new = list(last[1])
                for i in compress(range(len(vals)), map(operator.is_not, vals, last[0])):
                    x = vals[i]
                    new[i] = x if type(x) in _PLAIN else self(x)
            else:
                new = [self(x) for x in vals]
            self.lasts[key] = (vals, new)
            if (last is None or last[1] is last[0] or not new) and all(map(operator.is_, new, vals)):
                out = v  # nothing to replicate: the object itself (its lasts entry says so next time)
                self.lasts[key] = (vals, vals)
            else:
                out = FACTORIES[t](*new)
                if self.own is not None and isinstance(out, MetadataBase):
                    lease = _lease_of(v)  # (a container may mix steps: each replica is its primary's step's)
                    (self.own if lease is None else lease.own)(out)
        elif k == DICT:
            vals = tuple(v.values())
            new = [self(x) for x in vals]
            out = v if all(map(operator.is_, new, vals)) else dict(zip(v, new))
        else:
            vals = tuple(v)
            new = [self(x) for x in vals]
            if all(map(operator.is_, new, vals)):
                out = v
            else:
                out = t._make(new) if k == NAMEDTUPLE else new if k == LIST else tuple(new)
        self.memo[id(v)] = (v, out)
        return out
