"""EPLB (expert-parallel load balancing): the logical expert maps, derived on the host, and a pad-out
that never blocks the host.

An MoE model with EPLB places ``num_physical`` expert slots (spread over the expert-parallel ranks)
per MoE layer; each slot holds a replica of one of ``num_logical`` logical experts, and popular
experts get several replicas. After a rearrangement the engine has the new
``physical_to_logical_map`` on the host and must publish three device tensors the MoE layers read:

- ``physical_to_logical_map``: ``(L, P)``, the logical expert of every physical slot (``-1``: a new
  slot during scale-up, holding nothing yet);
- ``logical_replica_count``: ``(L, E)``, how many slots hold each logical expert;
- ``logical_to_physical_map``: ``(L, E, W)``, the slots holding each logical expert in increasing
  slot order, ``-1`` past its replicas. The device tensor has a fixed width ``W`` (its address and
  shape are captured by CUDA graphs), so the map is *padded out* with ``-1`` to ``W`` columns.

Two layers:

- :func:`compute_logical_maps` derives the two logical maps on the host (numpy in, numpy out, one
  compiled pass), at the map's natural width ``max_replicas`` (vLLM's ``compute_logical_maps``) or
  directly at the destination width ``W`` (the padded map), optionally into caller buffers.
- :func:`stage_expert_maps` writes all three maps straight into a step's pinned slot, so they move to
  the device in the step's ONE non-blocking copy, fenced by the step's event;
  :meth:`ExpertMaps.copy_into` then copies them device-to-device into the engine's persistent
  tensors. :func:`pad_out_expert_maps` does both in one call (its own step). Nothing reads device
  data and nothing is uploaded from pageable memory, so the host never waits for the GPU. vLLM 0.33
  pads with ``torch.nn.functional.pad`` on the host and uploads with a blocking pageable ``copy_``,
  which waits for all queued GPU work (docs/semantics.md, "EPLB: the logical expert maps").

Shape legend
------------
- ``L``: MoE layers (absent for a one-layer, 1-D map).
- ``P``: physical expert slots per layer (``num_physical``).
- ``E``: logical experts (``num_logical_experts``).
- ``R``: ``max_replicas``, the largest replica count of any logical expert in any layer.
- ``W``: the padded width of the logical-to-physical map (``W >= R``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import torch

from attnmeta._checks import reject_tensor
from attnmeta._numba import njit
from attnmeta.staging import Staged, Stager, Step

__all__ = ["ExpertMaps", "LogicalMaps", "compute_logical_maps", "pad_out_expert_maps", "stage_expert_maps"]

_MAP_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}

# kernel status codes (the wrapper formats the messages)
_OK = 0
_BAD_EXPERT = 1


class LogicalMaps(NamedTuple):
    """The logical expert maps of one or ``L`` layers, on the host.

    Shapes are given for a 2-D input ``(L, P)``; for a 1-D input (one layer) the leading ``L`` is
    absent. Both arrays have the input map's dtype (int32 or int64).
    """

    logical_to_physical_map: np.ndarray
    """(L, E, W) int32/int64, host. ``[l, e, k]``: the k-th physical slot (increasing order) holding
    logical expert ``e`` in layer ``l``; -1 for ``k >= logical_replica_count[l, e]``."""
    logical_replica_count: np.ndarray
    """(L, E) int32/int64, host. Physical slots holding each logical expert (-1 entries ignored)."""
    max_replicas: int
    """Host scalar: ``logical_replica_count.max()`` (0 when every slot is -1), the natural width R."""


@njit
def _replica_count_nb(p2l: np.ndarray, num_logical: int, count: np.ndarray) -> tuple[int, int, int, int]:
    """Count replicas into ``count`` (L, E); returns (status, layer, slot, max_replicas)."""
    count[:] = 0
    top = 0
    for l in range(p2l.shape[0]):  # noqa: E741
        for p in range(p2l.shape[1]):
            e = p2l[l, p]
            if e == -1:
                continue
            if e < -1 or e >= num_logical:
                return _BAD_EXPERT, l, p, 0
            c = count[l, e] + 1
            count[l, e] = c
            if c > top:
                top = c
    return _OK, 0, 0, top


@njit
def _logical_to_physical_nb(p2l: np.ndarray, count: np.ndarray, out: np.ndarray) -> None:
    """Fill ``out`` (L, E, W >= R) with the slots of each logical expert, -1 elsewhere. ``count`` is
    scratch (L, E) and holds the replica counts again on return."""
    out[:] = -1
    count[:] = 0
    for l in range(p2l.shape[0]):  # noqa: E741
        for p in range(p2l.shape[1]):
            e = p2l[l, p]
            if e >= 0:
                k = count[l, e]
                out[l, e, k] = p
                count[l, e] = k + 1


def _as_map(physical_to_logical_map: Any) -> np.ndarray:
    reject_tensor(physical_to_logical_map, "physical_to_logical_map")
    arr = np.asarray(physical_to_logical_map)
    if arr.size == 0 and arr.dtype == np.float64:
        arr = arr.astype(np.int64)  # an empty list
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"physical_to_logical_map: expected an integer array (int32 or int64), got dtype {arr.dtype}")
    if arr.dtype not in _MAP_DTYPES:
        arr = arr.astype(np.int64)  # other integer widths (and Python ints): int64, as torch.tensor(list) gives
    if arr.ndim not in (1, 2):
        raise ValueError(f"physical_to_logical_map: expected (num_physical,) for one layer or (num_layers, "
                         f"num_physical), got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def _check_out(out: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    reject_tensor(out, name)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name}: expected a writable C-contiguous {shape} {dtype} array (the input map's dtype), got "
                         f"{out.shape} {out.dtype}{'' if out.flags.c_contiguous else ', not C-contiguous'}"
                         f"{'' if out.flags.writeable else ', read-only'}")
    return out


def compute_logical_maps(
    physical_to_logical_map: Any,
    num_logical_experts: int,
    *,
    width: int | None = None,
    out: np.ndarray | None = None,
    count_out: np.ndarray | None = None,
) -> LogicalMaps:
    """The logical-to-physical map and replica counts of a physical-to-logical expert map, on the host.

    Parameters
    ----------
    physical_to_logical_map : array_like of int, shape (P,) or (L, P)
        Host data (numpy or nested lists; a torch tensor is refused). The logical expert of each
        physical slot, in ``[0, E)``, or -1 for an empty slot (ignored). int32 and int64 keep their
        dtype; other integer inputs become int64.
    num_logical_experts : int
        ``E`` (>= 1).
    width : int, optional
        ``W``, the padded width of the logical-to-physical map (>= ``max_replicas``); default
        ``max_replicas`` (vLLM's unpadded map). With ``out`` given it defaults to ``out``'s width.
    out : numpy.ndarray, optional
        ``(L, E, W)`` (or ``(E, W)``) buffer of the input's dtype for the logical-to-physical map, for
        instance a view into a step's pinned slot.
    count_out : numpy.ndarray, optional
        ``(L, E)`` (or ``(E,)``) buffer of the input's dtype for the replica counts.

    Returns
    -------
    LogicalMaps
        ``logical_to_physical_map`` ``(L, E, W)``, ``logical_replica_count`` ``(L, E)`` (the input's
        dtype, host; ``out`` / ``count_out`` when given) and the host scalar ``max_replicas``.

    Raises
    ------
    TypeError
        A torch tensor, a non-integer map, or a non-numpy buffer.
    ValueError
        A map that is not 1-D or 2-D; ``num_logical_experts < 1``; an entry outside ``[-1, E)`` (the
        message names the layer, slot and value); ``width < max_replicas`` (names the expert that
        needs more columns); a buffer of the wrong shape or dtype.

    Examples
    --------
    Two layers, six slots, four logical experts (slot 4 of layer 1 is a new, empty slot):

    >>> maps = compute_logical_maps([[0, 1, 2, 0, 3, 0], [2, 2, 1, 0, -1, 3]], 4)
    >>> maps.logical_replica_count.tolist()
    [[3, 1, 1, 1], [1, 1, 2, 1]]
    >>> maps.logical_to_physical_map.tolist()  # doctest: +NORMALIZE_WHITESPACE
    [[[0, 3, 5], [1, -1, -1], [2, -1, -1], [4, -1, -1]],
     [[3, -1, -1], [2, -1, -1], [0, 1, -1], [5, -1, -1]]]
    >>> compute_logical_maps([2, 2, 1, 0], 3, width=4).logical_to_physical_map.tolist()
    [[3, -1, -1, -1], [2, -1, -1, -1], [0, 1, -1, -1]]
    """
    p2l = _as_map(physical_to_logical_map)
    if isinstance(num_logical_experts, bool) or not isinstance(num_logical_experts, int | np.integer):
        raise TypeError(f"num_logical_experts: expected an int, got {type(num_logical_experts).__name__}")
    num_logical = int(num_logical_experts)
    if num_logical < 1:
        raise ValueError(f"num_logical_experts: expected >= 1, got {num_logical}")
    per_layer = p2l.ndim == 1
    p2l2 = p2l.reshape(1, -1) if per_layer else p2l
    lead: tuple[int, ...] = () if per_layer else (p2l.shape[0],)
    dt = p2l.dtype
    if count_out is None:
        count = np.empty((*lead, num_logical), dtype=dt)
    else:
        count = _check_out(count_out, "count_out", (*lead, num_logical), dt)
    status, layer, slot, top = _replica_count_nb(p2l2, num_logical, count.reshape(p2l2.shape[0], num_logical))
    if status != _OK:
        where = f"[{slot}]" if per_layer else f"[{layer}, {slot}]"
        raise ValueError(f"physical_to_logical_map{where}={int(p2l2[layer, slot])}: expected a logical expert in "
                         f"[0, {num_logical}) or -1 (an empty slot)")
    if out is not None:
        reject_tensor(out, "out")
        if not isinstance(out, np.ndarray) or out.ndim != len(lead) + 2:
            got = f"shape {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
            raise ValueError(f"out: expected a {len(lead) + 2}-D numpy array ({'' if per_layer else 'L, '}E, W), got {got}")
        if width is not None and width != out.shape[-1]:
            raise ValueError(f"width={width} but out has width {out.shape[-1]}")
        width = int(out.shape[-1])
    if width is None:
        width = top
    elif isinstance(width, bool) or not isinstance(width, int | np.integer):
        raise TypeError(f"width: expected an int or None, got {type(width).__name__}")
    width = int(width)
    if width < top:
        flat = int(np.argmax(count.reshape(-1) == top))
        l, e = divmod(flat, num_logical)  # noqa: E741
        who = f"expert {e}" if per_layer else f"expert {e} of layer {l}"
        raise ValueError(f"width={width}: {who} has {top} replicas; the padded map needs width >= max_replicas={top}")
    shape = (*lead, num_logical, width)
    l2p = np.empty(shape, dtype=dt) if out is None else _check_out(out, "out", shape, dt)
    _logical_to_physical_nb(p2l2, count.reshape(p2l2.shape[0], num_logical),
                            l2p.reshape(p2l2.shape[0], num_logical, width))
    return LogicalMaps(l2p, count, int(top))


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertMaps:
    """The three expert maps of a committed step, on the device (views into the step's arena).

    Valid for work enqueued on the commit stream after the commit, until the stager reuses the step's
    ring slot: the tensors are plain views, so after that they hold a newer step's bytes (they are not
    checked; :func:`stage_expert_maps`'s ``result()`` raises :class:`attnmeta.StepExpiredError` if
    first called then). :meth:`copy_into` moves them into the engine's persistent tensors; call it
    right after the commit. Shapes as
    :func:`stage_expert_maps` describes (``L`` absent for a one-layer map).
    """

    physical_to_logical_map: torch.Tensor
    """(L, P) int32/int64, device. The staged physical-to-logical map, as given."""
    logical_to_physical_map: torch.Tensor
    """(L, E, W) int32/int64, device. The padded logical-to-physical map (-1 past each expert's replicas)."""
    logical_replica_count: torch.Tensor
    """(L, E) int32/int64, device. Replicas of each logical expert."""
    max_replicas: int
    """Host scalar: the largest replica count (<= W)."""

    def copy_into(
        self,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor | None = None,
        physical_to_logical_map: torch.Tensor | None = None,
    ) -> None:
        """Copy the maps into persistent device tensors: non-blocking device-to-device copies only.

        Enqueue it on the step's commit stream (the current stream by default), after the commit. No
        tensor's data is read on the host; shapes, dtypes and devices are checked from metadata.

        Parameters
        ----------
        logical_to_physical_map : torch.Tensor
            ``(L, E, W)`` destination (device, the maps' dtype); receives the padded map.
        logical_replica_count : torch.Tensor, optional
            ``(L, E)`` destination for the replica counts.
        physical_to_logical_map : torch.Tensor, optional
            ``(L, P)`` destination for the physical-to-logical map.

        Raises
        ------
        ValueError
            A destination whose shape, dtype or device differs from the staged map's.
        """
        pairs = (("logical_to_physical_map", logical_to_physical_map, self.logical_to_physical_map),
                 ("logical_replica_count", logical_replica_count, self.logical_replica_count),
                 ("physical_to_logical_map", physical_to_logical_map, self.physical_to_logical_map))
        for name, dst, src in pairs:
            if dst is not None:
                _check_dst(name, dst, tuple(src.shape), src.dtype, src.device)
        for _, dst, src in pairs:
            if dst is not None:
                dst.copy_(src, non_blocking=True)


def _check_dst(name: str, dst: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (the persistent device map), got {type(dst).__name__}")
    if tuple(dst.shape) != shape or dst.dtype != dtype or dst.device != device:
        raise ValueError(f"{name}: expected a {shape} {dtype} tensor on {device}, got {tuple(dst.shape)} {dst.dtype} "
                         f"on {dst.device}")


def stage_expert_maps(
    step: Step,
    physical_to_logical_map: Any,
    num_logical_experts: int,
    *,
    width: int,
    prefix: str = "eplb",
) -> Staged[LogicalMaps, ExpertMaps]:
    """Stage the three expert maps in ``step``: derived on the host, written into its pinned slot.

    The maps travel in the step's one non-blocking H2D copy (with whatever else the step stages);
    nothing is read from the device. In graph mode each field's capacity is its row count (the maps'
    shapes are fixed for a model).

    Parameters
    ----------
    step : Step
        An open step of a :class:`~attnmeta.Stager`.
    physical_to_logical_map : array_like of int, shape (P,) or (L, P)
        Host map, as for :func:`compute_logical_maps` (its dtype is the maps' dtype).
    num_logical_experts : int
        ``E`` (>= 1).
    width : int
        ``W``: the persistent logical-to-physical map's width (>= ``max_replicas``).
    prefix : str, default "eplb"
        Field names in the step: ``{prefix}.physical_to_logical_map``,
        ``{prefix}.logical_to_physical_map``, ``{prefix}.logical_replica_count``.

    Returns
    -------
    Staged[LogicalMaps, ExpertMaps]
        ``host``: the host maps at width ``W`` (copies the caller may keep); ``result()`` after the
        commit: the :class:`ExpertMaps` device views.

    Raises
    ------
    TypeError, ValueError
        As :func:`compute_logical_maps`; the map is validated before anything is reserved, so a bad map
        leaves the step as it was.

    Examples
    --------
    >>> from attnmeta import Stager
    >>> stager = Stager("cpu")
    >>> with stager.step() as step:
    ...     staged = stage_expert_maps(step, [2, 2, 1, 0], 3, width=4)
    >>> staged.result().logical_to_physical_map
    tensor([[ 3, -1, -1, -1],
            [ 2, -1, -1, -1],
            [ 0,  1, -1, -1]])
    >>> staged.host.max_replicas, step.stats.copies
    (2, 1)
    """
    p2l = _as_map(physical_to_logical_map)
    maps = compute_logical_maps(p2l, num_logical_experts, width=width)  # validates before reserving
    dt = p2l.dtype
    names = (f"{prefix}.physical_to_logical_map", f"{prefix}.logical_to_physical_map", f"{prefix}.logical_replica_count")
    for name, arr in zip(names, (p2l, maps.logical_to_physical_map, maps.logical_replica_count), strict=True):
        step.alloc(name, arr.shape, dt, capacity=arr.shape[0], fill=-1)[...] = arr
    max_replicas = maps.max_replicas

    def make() -> ExpertMaps:
        return ExpertMaps(step.device(names[0]), step.device(names[1]), step.device(names[2]), max_replicas)

    return Staged(step, maps, make)


def pad_out_expert_maps(
    stager: Stager,
    physical_to_logical_map: Any,
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor | None = None,
    physical_to_logical_map_out: torch.Tensor | None = None,
) -> LogicalMaps:
    """Publish a new expert placement into persistent device maps without ever blocking the host.

    The sync-free replacement of vLLM's ``_commit_eplb_maps`` (and, given one layer's rows, of
    ``_commit_eplb_maps_for_layer``): derives the maps on the host, stages them in one step of
    ``stager`` (one non-blocking copy from pinned memory, fenced by the step's event), then copies
    them device-to-device (non-blocking) into the destinations, all on the current stream. ``E`` and
    ``W`` are read from ``logical_to_physical_map``'s shape.

    Parameters
    ----------
    stager : Stager
        The stager of the destinations' device (no step may be open on it).
    physical_to_logical_map : array_like of int, shape (P,) or (L, P)
        The new placement, host data; its dtype must be the destinations' dtype.
    logical_to_physical_map : torch.Tensor
        ``(L, E, W)`` (or ``(E, W)``) persistent device map; receives the map padded with -1 to ``W``.
    logical_replica_count : torch.Tensor, optional
        ``(L, E)`` (or ``(E,)``) persistent device counts.
    physical_to_logical_map_out : torch.Tensor, optional
        ``(L, P)`` (or ``(P,)``) persistent device copy of the placement.

    Returns
    -------
    LogicalMaps
        The host maps at width ``W`` (the device tensors' host twins).

    Raises
    ------
    TypeError, ValueError
        As :func:`compute_logical_maps`, or a destination of the wrong shape, dtype or device (checked
        before the step begins, so a bad call leaves the stager untouched).

    Examples
    --------
    >>> import torch
    >>> from attnmeta import Stager
    >>> l2p = torch.zeros(2, 4, 4, dtype=torch.int64)      # persistent (L, E, W) map
    >>> counts = torch.zeros(2, 4, dtype=torch.int64)
    >>> host = pad_out_expert_maps(Stager("cpu"), [[0, 1, 2, 0, 3, 0], [2, 2, 1, 0, -1, 3]], l2p, counts)
    >>> l2p[1].tolist(), counts.tolist()
    ([[3, -1, -1, -1], [2, -1, -1, -1], [0, 1, -1, -1], [5, -1, -1, -1]], [[3, 1, 1, 1], [1, 1, 2, 1]])
    """
    p2l = _as_map(physical_to_logical_map)
    if not isinstance(logical_to_physical_map, torch.Tensor) or logical_to_physical_map.dim() != p2l.ndim + 1:
        got = (f"shape {tuple(logical_to_physical_map.shape)}" if isinstance(logical_to_physical_map, torch.Tensor)
               else type(logical_to_physical_map).__name__)
        raise ValueError(f"logical_to_physical_map: expected a {p2l.ndim + 1}-D device tensor "
                         f"({'' if p2l.ndim == 1 else 'L, '}E, W) for a {p2l.ndim}-D placement, got {got}")
    num_logical, width = int(logical_to_physical_map.shape[-2]), int(logical_to_physical_map.shape[-1])
    dtype, device = _TORCH_DTYPES[p2l.dtype], stager.device
    lead = tuple(p2l.shape[:-1])
    _check_dst("logical_to_physical_map", logical_to_physical_map, (*lead, num_logical, width), dtype, device)
    if logical_replica_count is not None:
        _check_dst("logical_replica_count", logical_replica_count, (*lead, num_logical), dtype, device)
    if physical_to_logical_map_out is not None:
        _check_dst("physical_to_logical_map_out", physical_to_logical_map_out, tuple(p2l.shape), dtype, device)
    compute_logical_maps(p2l, num_logical, width=width)  # validate before a step begins
    with stager.step() as step:
        staged = stage_expert_maps(step, p2l, num_logical, width=width)
    staged.result().copy_into(logical_to_physical_map, logical_replica_count, physical_to_logical_map_out)
    return staged.host
